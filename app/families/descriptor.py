"""``Family``: everything the service, the store, the command line, the benches and the GPU
proof know about one family, in one value. Each family package exports it as ``FAMILY``
(``app/families/<package>/__init__.py``); every registry is derived from these values, so a
family is added as one folder plus its line in ``app.families.PACKAGES`` (docs/families.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command line lists the families without importing torch
    import torch
    from torch import Tensor, nn

Config = dict[str, Any]
State = dict[str, "Tensor"]
# A latent's published preview format (``app/media/preview.py``) from the model's config and
# latent channels; None where nothing is published.
PreviewFormat = Callable[[Config, int], str | None]


def no_preview(config: Config, channels: int) -> str | None:
    return None


def previews_by_channels(formats: Mapping[int, str]) -> PreviewFormat:
    """The preview format of a family whose latent spaces differ by their channel count."""
    table = dict(formats)
    return lambda config, channels: table.get(channels)


@dataclass(frozen=True)
class Part:
    """One direction of a family (its decoder or its encoder): the module built from a plain
    JSON config, the checkpoint converter, and the seeded trained-like initialisation."""

    module: type[nn.Module]
    # folder or single file -> (config, state dict in canonical names); ``ValueError`` when
    # the checkpoint holds no such part (an encoder-less decoder file)
    convert: Callable[[Path], tuple[Config, State]]
    init_synthetic: Callable[[nn.Module, torch.Generator], None]


@dataclass(frozen=True)
class Recipe:
    """An embedded model: seeded weights of these configs, nothing to download."""

    config: Config
    encoder_config: Config | None = None  # None: a decoder-only entry
    baked: bool = True  # ``bake --synthetic`` writes it; False: named ones only (the proofs)


@dataclass(frozen=True)
class Family:
    """One family: its key (manifests, the command line, metrics), its decoder and encoder,
    the embedded models, and the choices that depend on it."""

    key: str  # the package name with '-' for '_' (app.families.key_of)
    decoder: Part
    encoder: Part | None = None
    synthetic: Mapping[str, Recipe] = field(default_factory=dict)
    preview: PreviewFormat = no_preview
    # the 3-D conv weight layout of the family's copy on a GPU (NCDHW or channels_last_3d):
    # NCDHW measured as fast or faster for LTX, LTX-2 and MiniMax-H3 (docs/gpu/README.md)
    gpu_conv3d_layout: str = "NCDHW"
    # rows of ``python -m bench all``: row name -> the bench module measuring it against its
    # peer (``table_setup``); a family without one is benched on its own served path
    bench: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "synthetic", MappingProxyType(dict(self.synthetic)))
        object.__setattr__(self, "bench", MappingProxyType(dict(self.bench)))
        # the key is spelled once: the modules take it from here
        self.decoder.module.family = self.key
        if self.encoder is not None:
            self.encoder.module.family = self.key

    def baked(self) -> dict[str, Recipe]:
        """The embedded models ``bake --synthetic`` writes."""
        return {name: r for name, r in self.synthetic.items() if r.baked}


def recipes(
    decoders: Mapping[str, Config],
    encoders: Mapping[str, Config] | None = None,
    baked: bool = True,
) -> dict[str, Recipe]:
    """Recipes of the decoder configs by name, each with the encoder config of its name."""
    encoders = encoders or {}
    return {
        name: Recipe(dict(config), _copy(encoders.get(name)), baked)
        for name, config in decoders.items()
    }


def _copy(config: Config | None) -> Config | None:
    return None if config is None else dict(config)
