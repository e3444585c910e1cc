"""Service configuration from the environment: every ``VAE_*`` variable is a field here
(README's configuration tables list them all, tests/test_settings_docs.py checks both ways).
Code that runs before or without a whole ``Settings`` (logging, the command line, the CPU's
bf16 order) reads one field with ``setting``, still as declared here."""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:  # imported where used: the command line reads settings without torch
    from app.protocol import Limits

# Cloud Run's front end refuses an HTTP/1 request over 32 MiB with a page of its own: a body
# limit of 31 MiB leaves the request line and headers room, so every body the service admits
# passes the front end (deploy/README.md, "Request size and HTTP/2").
CLOUD_RUN_REQUEST_MB = 32
# what one request holds at most (Settings.held_mb)
HELD_MB_WHY = (
    "its input (a VAE_MAX_BODY_MB body of half floats parsed to float32, or a VAE_MAX_PIXELS "
    "image as float32) and its whole answer (VAE_MAX_BATCH float32 VAE_MAX_PIXELS images, "
    "within VAE_MAX_OUTPUT_MB)"
)


# latent shapes of 3 to 5 positive dims, "x" between them, separated by commas or spaces
WARMUP_SHAPES = re.compile(r"[\s,;]*([1-9]\d*([xX][1-9]\d*){2,4}([\s,;]+|$))*")


def _shapes(text: str) -> str:
    if not WARMUP_SHAPES.fullmatch(text):
        raise ValueError("latent shapes of 3 to 5 positive sizes, e.g. 1x16x128x128,1x16x64x64")
    return text


def _peers(text: str) -> str:
    for peer in filter(None, (p.strip() for p in text.split(","))):
        if peer != "*":
            ipaddress.ip_network(peer, strict=False)  # ValueError names the bad one
    return text


class Settings(BaseSettings):
    # a number must be finite: "inf" (which float() reads) overflowed timers later, in threads
    model_config = SettingsConfigDict(env_prefix="VAE_", extra="ignore", allow_inf_nan=False)

    models_dir: Path = Path("models")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    fallback: Literal["cpu", "off"] = "cpu"
    parity_min_cos: float = Field(0.9999, gt=0)
    models: str = Field("", description="comma-separated store entries to load; empty = all")
    default_model: str | None = None
    verify_weights: bool = Field(True, description="check each entry's sha256 at startup")
    ready_partial: bool = Field(False, description="/readyz 200 while some models failed")
    serve_encoders: bool = Field(
        True, description="load and gate the entries' encoders (POST /encode); false: decode only"
    )
    # startup
    select: Literal["auto", "before_ready", "after_ready"] = Field(
        "auto",
        description="measure the candidate modes before /readyz turns 200, or serve the exact "
        "path first and swap the winner in (auto: after on the CPU with VAE_DTYPE=auto)",
    )
    gate_full: Literal["auto", "on", "off"] = Field(
        "auto",
        description="the gate's full-resolution check (the family's native size against a "
        "float32 exact copy on the device; auto: on a GPU, where the device can hold it)",
    )
    gate_repeats: int = Field(
        2, ge=1, description="timed decodes of the gate's probe per candidate mode (best kept)"
    )
    load_prefetch: bool = Field(
        True, description="hash and memory-map the next models on a thread while one gates"
    )
    compile_cache_dir: Path | None = Field(
        None, description="torch.compile's caches (Inductor, FX graphs, cache artifacts)"
    )
    # admission and limits
    concurrency: int | None = Field(
        None,
        ge=1,
        description="requests one instance is sent at once (Cloud Run's containerConcurrency): "
        "VAE_QUEUE_DEPTH, VAE_STREAMS_MAX and VAE_BODIES_MB derive from it unless set, and one "
        "set below what it needs is refused; unset: no declared concurrency",
    )
    platform: Literal["none", "cloud-run"] = Field(
        "none",
        description="the front end before the service: cloud-run refuses HTTP/1 requests over "
        "32 MiB, so VAE_MAX_BODY_MB derives to 31 unless set (32 or more is refused) and the "
        "body's 413 names Cloud Run's limit",
    )
    queue_depth: int = Field(32, ge=1)
    max_batch: int = Field(8, ge=1, description="latent rows per request, else 413")
    batch_rows: int = Field(8, ge=1, description="latent rows per micro-batch the worker runs")
    batch_window_ms: float = Field(
        0.0, ge=0, description="how long the worker waits for more requests to fill a micro-batch"
    )
    max_pixels: int = Field(2048 * 2048, ge=1)
    max_frames: int = Field(257, ge=1)
    max_body_mb: int = Field(256, ge=1)
    bodies_mb: int = Field(
        1024,
        ge=1,
        description="what requests hold at once, all requests together: a body as it "
        "arrives (its Content-Length claimed before, while it arrives on pace), then what it "
        "was parsed into (a latent, pixels) and the most its whole answer can be, then that "
        "answer until it is sent; else 429, or 413 for one larger than this",
    )
    max_output_mb: int = Field(1024, ge=1, description="response body bytes per request, else 413")
    max_decode_mb: int = Field(
        16384,
        ge=1,
        description="the planned working memory per request, else 413, and per micro-batch",
    )
    body_timeout_s: float = Field(60.0, gt=0, description="whole request body, else 408")
    header_timeout_s: float = Field(10.0, gt=0, description="a request's headers, else 408")
    max_request_timeout_s: float = Field(300.0, gt=0, description="cap on a request's deadline")
    retry_after_s: int = Field(1, ge=1)
    drain_grace_s: float = Field(
        10.0, ge=1, description="SIGTERM: the process has exited this long after the signal"
    )
    stream_stall_s: float = Field(
        60.0, gt=0, description="a reader that takes nothing of its answer this long is dropped"
    )
    stream_buffer_mb: int = Field(
        256, ge=1, description="decoded frames buffered per streamed video answer"
    )
    stream_wait_s: float = Field(
        5.0, gt=0, description="how long the worker waits on a full stream buffer's reader"
    )
    streams_max: int = Field(
        8,
        ge=1,
        description="streamed video answers admitted at once (queued, decoding, sending), else 429",
    )
    encoder_threads: int = Field(2, ge=1, description="libx264 threads of each MP4 stream's ffmpeg")
    stream_socket_kb: int = Field(
        512, ge=16, description="kernel send buffer of an MP4 stream's connection (SO_SNDBUF)"
    )
    heap_reuse: bool = Field(
        False,
        description="a decode's ops reuse the memory its earlier ops freed (glibc: one arena, "
        "no mmap or trim per tensor) instead of page-faulting each map in: faster on a CPU, "
        'a larger resident peak (README, "The heap")',
    )
    heap_idle_s: float = Field(
        1.0,
        gt=0,
        description="with VAE_HEAP_REUSE: the heap's free pages go back to the OS once the "
        "worker has had no work for this long",
    )
    # device
    device_memory_gb: float = Field(0.0, ge=0, description="cap on device memory; 0 = the card")
    oom_fallback: Literal["off", "cpu"] = Field(
        "off", description="out of memory even tiled: 503 (off) or the float32 CPU path (cpu)"
    )
    warmup_shapes: Annotated[str, AfterValidator(_shapes)] = Field(
        "", description="latent shapes decoded at startup, comma-separated: 1x16x128x128"
    )
    max_decode_mpixels: int = Field(
        4, ge=1, description="GPU: a micro-batch is split into decodes of this many Mpixels"
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="auto: torch.compile the warm-up shapes of image models on a GPU (after "
        "ready, each gated before it serves); on: on the CPU too",
    )
    # security
    api_tokens: SecretStr = Field(SecretStr(""), description="comma-separated bearer tokens")
    protect_metrics: bool = False
    forwarded_allow_ips: Annotated[str, AfterValidator(_peers)] = Field(
        "127.0.0.1",
        description="peers whose X-Forwarded-For names the client (comma-separated IPs or "
        "CIDRs, '*' for any); others' is ignored",
    )
    threads: int = Field(0, ge=0, description="torch's intra-op threads; 0: torch's default")
    # logs, tools and tests
    log_format: Literal["auto", "json", "text"] = Field(
        "auto", description="json: one Cloud Logging line per record; auto: json on Cloud Run"
    )
    gcp_project: str = Field(
        "", description="project of the request lines' trace links (GOOGLE_CLOUD_PROJECT wins)"
    )
    h264_encoder: Literal["", "libx264", "h264_nvenc"] = Field(
        "", description="the MP4 writer's H.264 encoder; empty: detected"
    )
    debug: bool = Field(False, description="the command line shows tracebacks, not one line")
    cpu_fast_bf16: bool | None = Field(
        None, description="order auto's candidates as on a CPU with (or without) native bf16"
    )

    @field_validator("default_model", "compile_cache_dir", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        """An empty value (a template's variable left blank) is the default, as for the other
        settings, not a model named "" nor the working directory."""
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("api_tokens")
    @classmethod
    def _some_token(cls, value: SecretStr) -> SecretStr:
        """Set, it must hold a token: one that expands to commas and spaces (unset secrets in
        a template) would otherwise leave the service open without a word."""
        raw = value.get_secret_value()
        if raw.strip() and not any(t.strip() for t in raw.split(",")):
            raise ValueError("holds no token (only commas and spaces): give one, or unset it")
        return value

    @model_validator(mode="after")
    def _limits_agree(self) -> Settings:
        """The limits that follow from the platform and the declared concurrency: each one
        not set explicitly is derived; one set explicitly below what they need is refused,
        naming both values (``python -m app serve`` prints that one line and exits)."""
        explicit = self.model_fields_set
        conflicts: list[str] = []
        if self.platform == "cloud-run":
            most = CLOUD_RUN_REQUEST_MB - 1
            if "max_body_mb" not in explicit:
                self._derive("max_body_mb", most)
            elif self.max_body_mb > most:
                conflicts.append(
                    f"VAE_MAX_BODY_MB={self.max_body_mb} > {most} with VAE_PLATFORM=cloud-run: "
                    f"Cloud Run refuses HTTP/1 requests over {CLOUD_RUN_REQUEST_MB} MiB with its "
                    f"own page; at most {most} leaves a body of the limit room for its headers"
                )
        n = self.concurrency
        if n is not None:
            needs = {
                # every request admitted may wait in the queue (the batch running has left it)
                "queue_depth": (n, f"VAE_CONCURRENCY={n}", f"{n} requests may all be queued"),
                # every request admitted may be an MP4 stream
                "streams_max": (n, f"VAE_CONCURRENCY={n}", f"{n} requests may all be MP4s"),
                # every request admitted may hold the most one request can, at once
                "bodies_mb": (
                    n * self.held_mb(),
                    f"VAE_CONCURRENCY={n} x {self.held_mb()} MiB",
                    f"{n} requests may each hold the most one can: {HELD_MB_WHY}",
                ),
            }
            for name, (need, why, what) in needs.items():
                value = getattr(self, name)
                if name not in explicit:
                    self._derive(name, need)
                elif value < need:
                    env = f"VAE_{name.upper()}"
                    conflicts.append(f"{env}={value} < {why}: {what}; set {env} >= {need} or "
                                     f"leave it unset (derived)")  # fmt: skip
        if conflicts:
            raise ValueError("; ".join(conflicts))
        return self

    def held_mb(self) -> int:
        """The most one request holds, in MiB (the body budget's unit): its input, a latent
        or pixel body in half precision parsed to float32 or a ``max_pixels`` image as float32
        RGB, and its whole answer, ``max_batch`` such images as a float32 tensor within
        ``max_output_mb`` (a streamed answer has a buffer of its own)."""
        image = -(-12 * self.max_pixels // 2**20)
        return max(2 * self.max_body_mb, image) + min(self.max_output_mb, self.max_batch * image)

    def _derive(self, name: str, value: int) -> None:
        """Set a derived limit without marking it as set (``model_fields_set`` stays what the
        environment and the arguments gave)."""
        self.__dict__[name] = value

    def limits(self) -> Limits:
        from app.protocol import Limits

        return Limits(
            max_body_bytes=self.max_body_mb << 20,
            max_pixels=self.max_pixels,
            max_frames=self.max_frames,
            max_batch=self.max_batch,
            max_output_bytes=self.max_output_mb << 20,
            max_decode_bytes=self.max_decode_mb << 20,
        )

    def device_memory_bytes(self) -> int:
        return int(self.device_memory_gb * 2**30)

    def model_names(self) -> list[str] | None:
        names = [n.strip() for n in self.models.split(",") if n.strip()]
        return names or None

    def tokens(self) -> list[str]:
        return [t.strip() for t in self.api_tokens.get_secret_value().split(",") if t.strip()]


def setting(name: str) -> Any:
    """One field read alone from its variable (``VAE_<NAME>``), typed and defaulted as the
    field declares, without validating the others."""
    field = Settings.model_fields[name]
    raw = _variable(name).strip()
    if not raw:
        return field.get_default(call_default_factory=True)
    try:
        return TypeAdapter(field.annotation).validate_python(raw)
    except ValidationError as exc:  # one line naming the variable (no echo of the value)
        reason = exc.errors(include_url=False, include_input=False)[0]["msg"]
        raise ValueError(f"VAE_{name.upper()}: {reason}") from None


# VAE_* variables that are not the server's settings: the image build's arguments
# (scripts/build_image.sh, Dockerfile.gpu) and the store writer's test hook.
NOT_SETTINGS = frozenset(
    {"VAE_FAMILY", "VAE_CHECKPOINT", "VAE_NAME", "VAE_IMPORT_DTYPE", "VAE_BAKE_ONLY"}
    | {"VAE_STORE_PAUSE_AT"}
)


def unknown_variables(environ: Mapping[str, str] = os.environ) -> list[str]:
    """One line for each ``VAE_*`` variable no setting reads, with the setting it is closest
    to: pydantic ignores them, so a misspelt limit would otherwise be silently the default."""
    known = {f"VAE_{name.upper()}" for name in Settings.model_fields}
    lines = []
    for var in sorted(environ):
        name = var.upper()  # pydantic-settings reads them in any case
        if not name.startswith("VAE_") or name in known or name in NOT_SETTINGS:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"{var} is not a setting{hint}: ignored")
    return lines


def given(name: str) -> bool:
    """Whether the environment sets field ``name`` (its variable is not empty)."""
    return bool(_variable(name).strip())


def _variable(name: str) -> str:
    """Field ``name``'s variable in any case, as ``Settings`` reads it (``vae_log_format``)."""
    wanted = f"VAE_{name.upper()}"
    return next((v for k, v in os.environ.items() if k.upper() == wanted), "")
