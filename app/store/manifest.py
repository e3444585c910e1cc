"""An entry's manifest: family, config, dtype, source and the parts with their sha256."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.store.files import MANIFEST, WEIGHTS, write_synced


@dataclass
class Manifest:
    name: str
    family: str
    config: dict[str, Any]
    dtype: str
    source: str
    sha256: str  # the decoder's weights (what manifests before ``parts`` held)
    created: str = ""
    # part -> {"file", "sha256"[, "config"]}; older manifests: the decoder only, from ``sha256``
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)
    integrity: str = ""  # sha256 of every other field: an edited manifest fails it

    def __post_init__(self) -> None:
        if not self.parts:
            self.parts = {"decoder": {"file": WEIGHTS, "sha256": self.sha256}}

    @property
    def encoder_config(self) -> dict[str, Any]:
        return self.parts.get("encoder", {}).get("config", self.config)

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        data = json.loads((folder / MANIFEST).read_text())
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def fields(self) -> dict[str, Any]:
        """The manifest as JSON holds it (lists, not tuples), without ``integrity``."""
        data = {k: v for k, v in self.__dict__.items() if k != "integrity"}
        return json.loads(json.dumps(data))

    def digest(self) -> str:
        canonical = json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def write(self, folder: Path) -> None:
        self.integrity = self.digest()
        text = json.dumps({**self.fields(), "integrity": self.integrity}, indent=2, sort_keys=True)
        write_synced(folder / MANIFEST, (text + "\n").encode())


def public_source(source: str) -> str:
    """What ``/models`` shows of where a model came from: a path's last part (the host's
    folders are nobody's business), other labels (``synthetic:seed=0``) as they are."""
    if "/" in source or "\\" in source:
        return re.split(r"[/\\]", source.rstrip("/\\"))[-1] or "-"
    return source


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
