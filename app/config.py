"""Service configuration from the environment (``VAE_*``, plus ``PORT``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.protocol import Limits


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VAE_", extra="ignore")

    models_dir: Path = Path("models")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    fallback: Literal["cpu", "off"] = "cpu"
    parity_min_cos: float = 0.9999
    models: str = Field("", description="comma-separated store entries to load; empty = all")
    default_model: str | None = None
    queue_depth: int = 32
    max_batch: int = 8
    max_pixels: int = 2048 * 2048
    max_frames: int = 257
    max_body_mb: int = 256
    retry_after_s: int = 1
    threads: int = 0  # torch intra-op threads; 0 = torch's default

    def limits(self) -> Limits:
        return Limits(
            max_body_bytes=self.max_body_mb << 20,
            max_pixels=self.max_pixels,
            max_frames=self.max_frames,
            max_batch=self.max_batch,
        )

    def model_names(self) -> list[str] | None:
        names = [n.strip() for n in self.models.split(",") if n.strip()]
        return names or None
