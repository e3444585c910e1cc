"""TAESD family: madebyollin's tiny preview decoders (TAESD, TAEF1, TAEF2).

A stack of conv/ReLU residual blocks and nearest 2x upsamples, ~1.2 M parameters,
that decodes a diffusion model's latent straight to RGB in about [0, 1]. Built for
live previews: a sampler decodes every step with it instead of the full VAE.

Layout for ``channels = [c0, c1, ..., cn]`` and ``blocks = [b0, b1, ..., bn]``::

    clamp     tanh(z / 3) * 3
    conv_in   3x3 conv latent -> c0, ReLU
    mid       b0 blocks at c0 (latent resolution); TAEF2 adds a GroupNorm "pool"
              branch to each of them
    up_i      nearest 2x upsample, 3x3 conv c_i -> c_{i+1} (no bias), b_{i+1} blocks
    conv_out  3x3 conv cn -> 3 (RGB, not clamped, like the reference)

The latent is decoded as the diffusion model emits it: no scale or shift (TAEF2 takes
FLUX.2's BatchNorm-normalized, unpatchified 32-channel latent at 8x).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app.decoders.base import VAEDecoder
from app.timing import NULL_TIMER, PhaseTimer

# Label -> the latent channels of that variant; TAEF2 is also told apart by its pool branch.
VARIANT_CHANNELS = {"taesd": 4, "taef1": 16, "taef2": 32}
DEFAULTS: dict[str, Any] = {
    "channels": [64, 64, 64, 64],
    "blocks": [3, 3, 3, 1],
    # TAEF2's mid-block pool: 1x1 conv c0 -> 4*c0, GroupNorm, ReLU, 1x1 conv back.
    "mid_pool_channels": 0,
    # Not visible in the weights' shapes; 4 is upstream's value (checked by the
    # real-photo round trip: other group counts lose several dB).
    "mid_pool_groups": 4,
}


def conv3(c_in: int, c_out: int, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, padding=1, bias=bias)


def conv1(c_in: int, c_out: int) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 1, bias=False)


class Block(nn.Module):
    """conv/ReLU/conv/ReLU/conv plus a skip, then ReLU; optionally a pool branch first."""

    def __init__(self, c_in: int, c_out: int, pool_channels: int = 0, pool_groups: int = 4):
        super().__init__()
        self.pool: nn.Sequential | None = None
        if pool_channels:
            self.pool = nn.Sequential(
                conv1(c_in, pool_channels),
                nn.GroupNorm(pool_groups, pool_channels),
                nn.ReLU(),
                conv1(pool_channels, c_in),
            )
        self.conv = nn.Sequential(
            conv3(c_in, c_out), nn.ReLU(), conv3(c_out, c_out), nn.ReLU(), conv3(c_out, c_out)
        )
        self.skip: nn.Module = conv1(c_in, c_out) if c_in != c_out else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        if self.pool is not None:
            x = x + self.pool(x)
        return F.relu(self.conv(x) + self.skip(x))


class UpStage(nn.Module):
    """Nearest 2x upsample, a bias-free conv, then blocks."""

    def __init__(self, c_in: int, c_out: int, n_blocks: int):
        super().__init__()
        self.conv = conv3(c_in, c_out, bias=False)
        self.blocks = nn.Sequential(*(Block(c_out, c_out) for _ in range(n_blocks)))

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest")))


def normalize_config(config: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults and check the geometry; a bad config fails here, not mid-decode."""
    variant = config.get("variant", "taesd")
    if variant not in VARIANT_CHANNELS:
        raise ValueError(
            f"taesd: unknown variant {variant!r}; known: {', '.join(VARIANT_CHANNELS)}"
        )
    cfg = {**DEFAULTS, "latent_channels": VARIANT_CHANNELS[variant], **config, "variant": variant}
    if variant == "taef2" and "mid_pool_channels" not in config:
        cfg["mid_pool_channels"] = 4 * cfg["channels"][0]
    cfg["channels"], cfg["blocks"] = list(cfg["channels"]), list(cfg["blocks"])
    if len(cfg["channels"]) != len(cfg["blocks"]) or len(cfg["channels"]) < 1:
        raise ValueError("taesd: 'channels' and 'blocks' need one entry per stage (mid + each up)")
    pool = cfg["mid_pool_channels"]
    if pool and pool % cfg["mid_pool_groups"]:
        raise ValueError("taesd: mid_pool_channels must be a multiple of mid_pool_groups")
    return cfg


class Decoder(VAEDecoder):
    """A TAESD-family decoder; ``decode`` returns RGB in about [0, 1], unclamped."""

    family = "taesd"
    output_space = "unit"
    channels_last = True

    def __init__(self, config: dict[str, Any]) -> None:
        cfg = normalize_config(config)
        super().__init__(cfg)
        ch, blocks = cfg["channels"], cfg["blocks"]
        self.conv_in = conv3(cfg["latent_channels"], ch[0])
        pool = (cfg["mid_pool_channels"], cfg["mid_pool_groups"])
        self.mid = nn.Sequential(*(Block(ch[0], ch[0], *pool) for _ in range(blocks[0])))
        self.up = nn.ModuleList(
            UpStage(ch[i], ch[i + 1], blocks[i + 1]) for i in range(len(ch) - 1)
        )
        self.conv_out = conv3(ch[-1], 3)

    @property
    def latent_channels(self) -> int:
        return int(self.config["latent_channels"])

    @property
    def spatial_scale(self) -> int:
        return 2 ** len(self.up)

    def summary(self) -> dict[str, Any]:
        # "preview" lets a sampler pick this model for per-step previews from GET /models.
        return {**super().summary(), "preview": True, "variant": self.config["variant"]}

    def probe_latent(self, generator: torch.Generator) -> Tensor:
        # A tiny decoder needs no 256-px probe: 128 px exercises every layer.
        return torch.randn((1, self.latent_channels, 16, 16), generator=generator)

    def decode(self, z: Tensor, timer: PhaseTimer = NULL_TIMER, **options: Any) -> Tensor:
        if z.ndim != 4 or z.shape[1] != self.latent_channels:
            raise ValueError(
                f"taesd: expected a latent [B,{self.latent_channels},H,W], got {list(z.shape)}"
            )
        z = z.to(self.conv_in.weight.dtype)
        with timer.phase("clamp"):
            x = torch.tanh(z / 3) * 3
        with timer.phase("conv_in"):
            x = F.relu(self.conv_in(x))
        with timer.phase("mid"):
            x = self.mid(x)
        for i, stage in enumerate(self.up):
            with timer.phase(f"up_{i}"):
                x = stage(x)
        with timer.phase("conv_out"):
            return self.conv_out(x)


# --- checkpoint conversion -------------------------------------------------

_CANONICAL = re.compile(r"^(conv_in|mid|up|conv_out)\.")


def _load(source: Path) -> dict[str, Tensor]:
    if source.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(source))
    # weights_only: a .pth is a pickle; never run code from it.
    return torch.load(source, weights_only=True, map_location="cpu")


def _to_flat(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Upstream ``nn.Sequential`` indices (0 = Clamp), from any known layout.

    Layouts: madebyollin's ``N.*`` (.pth and safetensors), and diffusers'
    ``decoder.layers.N.*`` (AutoencoderTiny, taef2.safetensors) whose Sequential
    lacks the Clamp module, so its indices are one lower. Encoder keys are dropped.
    """
    if any(k.startswith("decoder.") for k in sd):
        sd = {k[len("decoder.") :]: v for k, v in sd.items() if k.startswith("decoder.")}
    if all(k.startswith("layers.") for k in sd):
        return {_shift(k[len("layers.") :]): v for k, v in sd.items()}
    if not all(k.split(".", 1)[0].isdigit() for k in sd):
        bad = next(k for k in sd if not k.split(".", 1)[0].isdigit())
        raise ValueError(f"taesd: not a tiny-decoder state dict (unexpected key {bad!r})")
    return sd


def _shift(key: str) -> str:
    index, rest = key.split(".", 1)
    return f"{int(index) + 1}.{rest}"


def _group(sd: dict[str, Tensor]) -> dict[int, dict[str, Tensor]]:
    groups: dict[int, dict[str, Tensor]] = {}
    for key, value in sd.items():
        index, rest = key.split(".", 1)
        groups.setdefault(int(index), {})[rest] = value
    return dict(sorted(groups.items()))


def _canonical_prefixes(groups: dict[int, dict[str, Tensor]]) -> dict[int, str]:
    """Walk the Sequential: conv_in, mid blocks, (upsample, conv, blocks)*, conv_out."""
    indices = list(groups)
    names: dict[int, str] = {}
    stage, block = -1, 0
    for pos, index in enumerate(indices):
        entry = groups[index]
        if pos == 0:
            names[index] = "conv_in"
        elif pos == len(indices) - 1:
            names[index] = "conv_out"
        elif "conv.0.weight" in entry:
            where = "mid" if stage < 0 else f"up.{stage}.blocks"
            names[index], block = f"{where}.{block}", block + 1
        elif set(entry) == {"weight"} and index - indices[pos - 1] == 2:
            stage, block = stage + 1, 0  # the gap is the parameter-free upsample
            names[index] = f"up.{stage}.conv"
        else:
            raise ValueError(f"taesd: unexpected layer {index} with {sorted(entry)}")
    return names


def _canonicalize(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    if all(_CANONICAL.match(k) for k in sd):
        return dict(sd)
    groups = _group(_to_flat(sd))
    prefixes = _canonical_prefixes(groups)
    return {f"{prefixes[i]}.{rest}": v for i, entry in groups.items() for rest, v in entry.items()}


def _count(sd: dict[str, Tensor], pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in sd if (m := rx.match(k))})


def infer_config(sd: dict[str, Tensor]) -> dict[str, Any]:
    """The config of a canonical state dict, read from its key names and shapes."""
    latent = int(sd["conv_in.weight"].shape[1])
    n_up = _count(sd, r"^up\.(\d+)\.conv\.weight$")
    channels = [int(sd["conv_in.weight"].shape[0])]
    channels += [int(sd[f"up.{i}.conv.weight"].shape[0]) for i in range(n_up)]
    blocks = [_count(sd, r"^mid\.(\d+)\.")]
    blocks += [_count(sd, rf"^up\.{i}\.blocks\.(\d+)\.") for i in range(n_up)]
    pool = sd.get("mid.0.pool.0.weight")
    if pool is not None:
        variant = "taef2"
    else:
        # Same architecture; the latent width tells the latent space (TAESD3 is 16 ch too).
        variant = "taef1" if latent == 16 else "taesd"
    return {
        "variant": variant,
        "latent_channels": latent,
        "channels": channels,
        "blocks": blocks,
        "mid_pool_channels": 0 if pool is None else int(pool.shape[0]),
        "mid_pool_groups": DEFAULTS["mid_pool_groups"],
    }


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``*_decoder.pth`` or ``.safetensors`` -> (config, state dict in canonical names).

    The variant comes from the weights (pool branch, latent width), never the file name.
    Tensors keep the checkpoint's dtype (the released ones are float16).
    """
    source = Path(source)
    if source.is_dir():
        source = _pick_file(source.iterdir())
    sd = _canonicalize(_load(source))
    config = infer_config(sd)
    Decoder(config).load_state_dict(sd, strict=True)  # fail at import, not at serve
    return config, sd


def _pick_file(files: Iterable[Path]) -> Path:
    found = sorted(
        p
        for p in files
        if p.name.endswith(("decoder.pth", ".safetensors")) and "encoder" not in p.name
    )
    if not found:
        raise FileNotFoundError("taesd: no *_decoder.pth or .safetensors in the folder")
    return found[0]
