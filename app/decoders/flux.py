"""The FLUX-family decoder: every diffusers ``AutoencoderKL`` decoder, and FLUX.2's.

latent -> [post_quant_conv] -> conv_in -> mid (resnet, attention, resnet)
       -> up blocks (resnets, nearest 2x + conv) -> GroupNorm + SiLU -> conv_out -> RGB in [-1, 1]

One architecture covers FLUX.1 (16 ch, no post-quant conv), SD3 (16 ch), SDXL / SD1.5
(4 ch, post-quant conv) and FLUX.2 (32 ch, post-quant conv, latent BatchNorm statistics over
the 2x2 patch layout). Parameter names follow diffusers' (minus the ``decoder.`` prefix), so a
diffusers checkpoint loads by renaming nothing and the BFL/LDM single-file layout by a small map.

The fast path (bf16, channels_last, the upsample-conv rewrite) is chosen by ``set_fast_path``
and only ever served behind the parity gate; the default is the exact float32 path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

from app.decoders import ops
from app.decoders.base import VAEDecoder
from app.timing import NULL_TIMER, PhaseTimer

GN_EPS = 1e-6
BAND_BYTES = 32 << 20  # float32 temporaries per row band on the fast path
# Banding saves memory but costs a statistics pass per GroupNorm (measured: 1.22x vs 1.39x
# over diffusers at 256 px), so it is used only where memory matters: 1 Mpixel and up.
BAND_MIN_PIXELS = 1024 * 1024

FLUX1_CONFIG: dict[str, Any] = {
    "latent_channels": 16,
    "out_channels": 3,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "mid_block_add_attention": True,
    "use_post_quant_conv": False,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "latent_bn": False,
}


def _band(x: Tensor, band_bytes: int) -> int:
    """Rows per band so one band's float32 temporaries take about ``band_bytes``."""
    row_bytes = x.shape[0] * x.shape[1] * x.shape[3] * 4
    return max(4, band_bytes // max(row_bytes, 1))


class ResnetBlock(nn.Module):
    """x + conv2(silu(norm2(conv1(silu(norm1(x)))))), 1x1 shortcut when widths differ."""

    def __init__(self, cin: int, cout: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps=GN_EPS)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout, eps=GN_EPS)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: Tensor, band_bytes: int = 0) -> Tensor:
        if band_bytes:
            return self._forward_banded(x, band_bytes)
        h = self.conv1(ops.group_norm_silu(self.norm1, x))
        h = self.conv2(ops.group_norm_silu(self.norm2, h))
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return skip + h

    def _forward_banded(self, x: Tensor, band_bytes: int) -> Tensor:
        """Same result; conv2's output and the skip are written over h in place.

        Peak: the input and one activation (x + h), where a layer-at-a-time decode holds
        x, the normalized x, h, the normalized h, conv2's output and the sum.
        """
        h = ops.norm_silu_conv_banded(x, self.norm1, self.conv1, _band(x, band_bytes))
        shortcut = self.conv_shortcut

        def skip(r0: int, r1: int) -> Tensor:
            rows = x[:, :, r0:r1]
            return rows if shortcut is None else shortcut(rows)

        band = _band(h, band_bytes)
        return ops.norm_silu_conv_banded(h, self.norm2, self.conv2, band, out=h, skip=skip)


class SpatialAttention(nn.Module):
    """Single-head self-attention over all H*W positions, residual."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=GN_EPS)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        tokens = self.group_norm(x).flatten(2).transpose(1, 2)  # [B, HW, C]
        q, k, v = (proj(tokens).unsqueeze(1) for proj in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v).squeeze(1)
        out = self.to_out[0](out).transpose(1, 2).reshape(b, c, h, w)
        return x + out


class MidBlock(nn.Module):
    def __init__(self, channels: int, groups: int, attention: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(channels, channels, groups) for _ in range(2)])
        self.attentions = nn.ModuleList([SpatialAttention(channels, groups)] if attention else [])

    def forward(self, x: Tensor, band_bytes: int = 0) -> Tensor:
        x = self.resnets[0](x, band_bytes)
        for attn in self.attentions:
            x = attn(x)
        return self.resnets[1](x, band_bytes)


class Upsample(nn.Module):
    """Nearest 2x then a 3x3 conv (or its exact 4-phase rewrite on the low-res grid)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.phase_weights: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.phase_weights is not None:
            return ops.upsample2x_conv3x3_phases(x, self.phase_weights, self.conv.bias)
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        return self.conv(x)


class UpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, n_resnets: int, groups: int, upsample: bool) -> None:
        super().__init__()
        widths = [cin] + [cout] * n_resnets
        self.resnets = nn.ModuleList(
            ResnetBlock(widths[i], widths[i + 1], groups) for i in range(n_resnets)
        )
        self.upsamplers = nn.ModuleList([Upsample(cout)] if upsample else [])

    def forward(self, x: Tensor, band_bytes: int = 0) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x, band_bytes)
        for up in self.upsamplers:
            if band_bytes and up.phase_weights is not None:
                x = ops.upsample_conv_banded(
                    x, up.phase_weights, up.conv.bias, _band(x, band_bytes)
                )
            else:
                x = up(x)
        return x


class LatentStats(nn.Module):
    """FLUX.2's BatchNorm running statistics over the 2x2-patchified latent (buffers only)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))


class Decoder(VAEDecoder):
    supports_tiling = True  # row bands with exact GroupNorm statistics
    family = "flux"
    output_space = "signed"
    channels_last = True

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__({**FLUX1_CONFIG, **config})
        cfg = self.config
        widths = list(reversed(cfg["block_out_channels"]))
        groups, latent = cfg["norm_num_groups"], cfg["latent_channels"]
        self.post_quant_conv = nn.Conv2d(latent, latent, 1) if cfg["use_post_quant_conv"] else None
        self.conv_in = nn.Conv2d(latent, widths[0], 3, padding=1)
        self.mid_block = MidBlock(widths[0], groups, cfg["mid_block_add_attention"])
        self.up_blocks = nn.ModuleList(
            UpBlock(
                widths[max(i - 1, 0)],
                widths[i],
                cfg["layers_per_block"] + 1,
                groups,
                upsample=i < len(widths) - 1,
            )
            for i in range(len(widths))
        )
        self.conv_norm_out = nn.GroupNorm(groups, widths[-1], eps=GN_EPS)
        self.conv_out = nn.Conv2d(widths[-1], cfg["out_channels"], 3, padding=1)
        self.bn = LatentStats(4 * latent) if cfg["latent_bn"] else None
        self.band_bytes = 0  # fast path: run full-resolution layers in row bands of this size
        self.band_min_pixels = BAND_MIN_PIXELS  # ... for outputs at least this large

    # --- geometry -------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        return self.config["latent_channels"]

    @property
    def spatial_scale(self) -> int:
        return 2 ** (len(self.config["block_out_channels"]) - 1)

    # --- decoding -------------------------------------------------------
    def denormalize(self, z: Tensor) -> Tensor:
        """FLUX.2: BatchNorm stats over the 2x2 patch layout; others: z / scale + shift."""
        if self.bn is None:
            return z / self.config["scaling_factor"] + (self.config.get("shift_factor") or 0.0)
        std = torch.sqrt(self.bn.running_var + self.config.get("batch_norm_eps", 1e-4))
        std, mean = std.view(1, -1, 1, 1).to(z), self.bn.running_mean.view(1, -1, 1, 1).to(z)
        return ops.unpatchify2x2(ops.patchify2x2(z) * std + mean)

    def decode(self, z: Tensor, timer: PhaseTimer = NULL_TIMER, **options: Any) -> Tensor:
        z = ops.to_model(z, self.conv_in.weight)
        with timer.phase("conv_in"):
            if self.post_quant_conv is not None:
                z = self.post_quant_conv(z)
            x = self.conv_in(z)
        tiled = options.get("tiled")
        if tiled is None:  # the default: bands only for outputs of band_min_pixels or more
            band = self.band_bytes if self._output_pixels(z) >= self.band_min_pixels else 0
        else:
            band = (self.band_bytes or BAND_BYTES) if tiled else 0
        # Each stage gets its input with no other reference held here (``forward`` called
        # directly: ``Module.__call__`` would keep it in its args), so a stage's input is
        # freed as soon as the stage has consumed it.
        held = [x]
        del x
        with timer.phase("mid"):
            held.append(self.mid_block.forward(held.pop(), band))
        for i, block in enumerate(self.up_blocks):
            with timer.phase(f"up_{i}"):
                held.append(block.forward(held.pop(), band))
        x = held.pop()
        with timer.phase("conv_out"):
            if band:
                return ops.norm_silu_conv_banded(
                    x, self.conv_norm_out, self.conv_out, _band(x, band)
                )
            return self.conv_out(ops.group_norm_silu(self.conv_norm_out, x))

    def _output_pixels(self, z: Tensor) -> int:
        return z.shape[0] * z.shape[-2] * z.shape[-1] * self.spatial_scale**2

    # --- fast path --------------------------------------------------------
    def optimize(self) -> None:
        self.set_banded(BAND_BYTES)

    def set_banded(self, band_bytes: int) -> None:
        """Row-band execution with exact global GroupNorm statistics (0 = off)."""
        self.band_bytes = band_bytes
        if band_bytes:
            self.set_upsample_rewrite(True)

    def set_upsample_rewrite(self, enabled: bool) -> None:
        """Nearest-2x + 3x3 conv as four 2x2 convs on the low-res grid (exact, 4/9 the FLOPs)."""
        for block in self.up_blocks:
            for up in block.upsamplers:
                up.phase_weights = (
                    ops.upsample_conv_phase_weights(up.conv.weight) if enabled else None
                )


# --- checkpoints ------------------------------------------------------------

# BFL / LDM single-file names -> ours, for the parts that are not per up block.
_LDM_FIXED = {
    "conv_in": "conv_in",
    "mid.block_1": "mid_block.resnets.0",
    "mid.block_2": "mid_block.resnets.1",
    "mid.attn_1.norm": "mid_block.attentions.0.group_norm",
    "mid.attn_1.q": "mid_block.attentions.0.to_q",
    "mid.attn_1.k": "mid_block.attentions.0.to_k",
    "mid.attn_1.v": "mid_block.attentions.0.to_v",
    "mid.attn_1.proj_out": "mid_block.attentions.0.to_out.0",
    "norm_out": "conv_norm_out",
    "conv_out": "conv_out",
}
_SINGLE_FILE_PREFIXES = ("first_stage_model.", "vae.", "ae.")


def convert(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A diffusers ``vae/`` folder (or pipeline folder) or a BFL/LDM single file -> ours."""
    source = Path(source)
    if source.is_dir():
        return _convert_diffusers_folder(source)
    return _convert_single_file(source)


def _convert_diffusers_folder(folder: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    if not (folder / "config.json").exists() and (folder / "vae" / "config.json").exists():
        folder = folder / "vae"
    raw = json.loads((folder / "config.json").read_text())
    state = ops.read_safetensors_folder(folder)
    config = {key: raw[key] for key in FLUX1_CONFIG if key in raw}
    config["block_out_channels"] = (
        raw.get("decoder_block_out_channels") or raw["block_out_channels"]
    )
    config["use_post_quant_conv"] = "post_quant_conv.weight" in state
    config["latent_bn"] = "bn.running_mean" in state
    if config["latent_bn"]:
        config["batch_norm_eps"] = raw.get("batch_norm_eps", 1e-4)
    config["source_class"] = raw.get("_class_name", "AutoencoderKL")
    out = {}
    for key, value in state.items():
        if key.startswith("decoder."):
            out[key.removeprefix("decoder.")] = value
        elif key.startswith(("post_quant_conv.", "bn.running_")):
            out[key] = value
    return config, out


def _convert_single_file(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        raw = {k: f.get_tensor(k) for k in f.keys()}
    for prefix in _SINGLE_FILE_PREFIXES:
        if any(k.startswith(prefix + "decoder.") for k in raw):
            raw = {k.removeprefix(prefix): v for k, v in raw.items() if k.startswith(prefix)}
            break
    dec = {k.removeprefix("decoder."): v for k, v in raw.items() if k.startswith("decoder.")}
    if not dec:
        raise ValueError(f"{path}: no decoder.* tensors: not a FLUX/LDM autoencoder checkpoint")
    n_up = 1 + max(int(k.split(".")[1]) for k in dec if k.startswith("up."))
    state: dict[str, Tensor] = {}
    for key, value in dec.items():
        name, leaf = key.rsplit(".", 1)
        ours = _ldm_name(name, n_up)
        if ours.startswith("mid_block.attentions.0.to_") and value.ndim == 4:
            value = value[:, :, 0, 0]  # BFL stores the attention projections as 1x1 convs
        state[f"{ours}.{leaf}"] = value.contiguous()
    for key in ("post_quant_conv.weight", "post_quant_conv.bias"):
        if key in raw:
            state[key] = raw[key]
    if "bn.running_mean" in raw:
        state["bn.running_mean"] = raw["bn.running_mean"]
        state["bn.running_var"] = raw["bn.running_var"]
    return _infer_config(state, n_up), state


def _ldm_name(name: str, n_up: int) -> str:
    if name in _LDM_FIXED:
        return _LDM_FIXED[name]
    for ldm, ours in _LDM_FIXED.items():
        if name.startswith(ldm + "."):
            return ours + name[len(ldm) :]
    parts = name.split(".")  # up.{i}.block.{j}.rest | up.{i}.upsample.conv
    if parts[0] != "up":
        raise ValueError(f"unexpected decoder tensor {name!r}")
    block = n_up - 1 - int(parts[1])  # BFL's up indices run in reverse of diffusers'
    if parts[2] == "block":
        rest = ".".join(parts[4:]).replace("nin_shortcut", "conv_shortcut")
        return f"up_blocks.{block}.resnets.{parts[3]}.{rest}"
    return f"up_blocks.{block}.upsamplers.0.{'.'.join(parts[3:])}"


def _infer_config(state: dict[str, Tensor], n_up: int) -> dict[str, Any]:
    latent = state["conv_in.weight"].shape[1]
    widths = [state[f"up_blocks.{i}.resnets.0.conv2.weight"].shape[0] for i in range(n_up)]
    n_res = 1 + max(int(k.split(".")[3]) for k in state if k.startswith("up_blocks.0.resnets."))
    config = {
        **FLUX1_CONFIG,
        "latent_channels": latent,
        "block_out_channels": list(reversed(widths)),
        "layers_per_block": n_res - 1,
        "mid_block_add_attention": any(k.startswith("mid_block.attentions.") for k in state),
        "use_post_quant_conv": "post_quant_conv.weight" in state,
        "latent_bn": "bn.running_mean" in state,
    }
    if latent != 16:  # FLUX.1's factors are the defaults; others must come from the user
        config.update(scaling_factor=1.0, shift_factor=0.0)
    if config["latent_bn"]:
        config["batch_norm_eps"] = 1e-4
    return config


# --- embedded defaults --------------------------------------------------------

SYNTHETIC: dict[str, dict[str, Any]] = {"flux1-synthetic": dict(FLUX1_CONFIG)}


@torch.no_grad()
def init_synthetic(decoder: Decoder, generator: torch.Generator) -> None:
    """Seeded weights initialised like a trained VAE's: small residual-branch outputs.

    Default-init random weights make every residual branch as large as its input, which
    pushes bf16 far below the parity threshold; trained VAEs add small corrections.
    """
    for name, param in decoder.named_parameters():
        if name.endswith(".bias"):
            param.zero_()
        elif "norm" in name:
            param.fill_(1.0)
        else:
            fan_in = param[0].numel()
            param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)
    if decoder.bn is not None:  # FLUX.2: non-trivial latent statistics, like trained ones
        decoder.bn.running_mean.copy_(
            0.5 * torch.randn(decoder.bn.running_mean.shape, generator=generator)
        )
        decoder.bn.running_var.copy_(
            0.5 + 1.5 * torch.rand(decoder.bn.running_var.shape, generator=generator)
        )
    for module in decoder.modules():
        if isinstance(module, ResnetBlock):
            module.conv2.weight.mul_(0.1)
        elif isinstance(module, SpatialAttention):
            module.to_out[0].weight.mul_(0.1)
