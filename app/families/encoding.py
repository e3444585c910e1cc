"""What the video encoder families share: their input checks, ``moments`` and ``iter_moments``
from one chunk schedule, diffusers-style spatial tiles and temporal windows (each encoded on
its own, blended in latent space), the per-channel latent normalisation, reading a diffusers
``vae/`` folder's encoder half, and seeded synthetic weights."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from app.families import ops
from app.families.checkpoint import read_tensors, state_mismatch
from app.families.encoder import Clip, TensorClip
from app.families.tiling import Grid, blend_edge

ENCODER_PREFIXES = ("encoder.", "quant_conv.")


# a family's moments of a checked clip, chunk by chunk in order (``VAEEncoder.iter_moments``)
Schedule = Callable[[Clip], Iterator[Tensor]]
# raises a ValueError when an input of this shape cannot be encoded
ShapeCheck = Callable[[tuple[int, ...]], None]


def check_input(x: Tensor, channels: int, multiple: int) -> None:
    """``x`` is ``[B, channels, H, W]`` or ``[B, channels, T, H, W]`` with H and W multiples of
    ``multiple`` (what the encoder maps onto whole latent cells); a ValueError says what not."""
    check_shape(tuple(x.shape), channels, multiple)


def check_shape(
    shape: tuple[int, ...],
    channels: int,
    multiple: int,
    frames_problem: Callable[[int], str] | None = None,
) -> None:
    """``check_input`` on a shape, and on its frame count: at least one, and none that
    ``frames_problem`` names (the family's rule, ``VAEEncoder.frames_problem``)."""
    if len(shape) not in (4, 5) or shape[1] != channels:
        raise ValueError(
            f"input of shape {list(shape)}: expected [B, {channels}, H, W] or "
            f"[B, {channels}, T, H, W]"
        )
    h, w = shape[-2:]
    if h % multiple or w % multiple or not h or not w:
        raise ValueError(f"frame {h}x{w}: height and width must be multiples of {multiple}")
    frames = shape[2] if len(shape) == 5 else 1
    if frames < 1:
        raise ValueError("a clip of no frames")
    if frames_problem is not None and (problem := frames_problem(frames)):
        raise ValueError(problem)


def whole(schedule: Schedule, x: Tensor, check: ShapeCheck) -> Tensor:
    """``VAEEncoder.moments`` of ``x`` from the family's ``schedule``: its chunks concatenated
    (an image encoded as a one-frame clip, its moments back 4-D), so the two cannot differ."""
    check(tuple(x.shape))
    image = x.ndim == 4
    m = joined(schedule(TensorClip(x.unsqueeze(2) if image else x)))
    return m[:, :, 0] if image else m


def chunked(schedule: Schedule, x: Tensor | Clip, check: ShapeCheck) -> Iterator[Tensor]:
    """``VAEEncoder.iter_moments`` from the family's ``schedule``: a clip's chunks (a 5-D
    tensor's too), an image's moments as one 4-D chunk. The input is checked on the first
    ``next``, before any compute (the runtime answers that ``ValueError`` with a 422)."""
    if isinstance(x, Tensor) and x.ndim != 5:
        yield whole(schedule, x, check)
        return
    check(tuple(x.shape))
    yield from schedule(TensorClip(x) if isinstance(x, Tensor) else x)


def joined(chunks: Iterable[Tensor]) -> Tensor:
    """Moment chunks concatenated along the latent frames (one chunk: itself)."""
    parts = list(chunks)
    return parts[0] if len(parts) == 1 else torch.cat(parts, 2)


def take(clip: Clip, start: int, stop: int, like: Tensor) -> Tensor:
    """Frames ``[start, stop)`` of ``clip`` on ``like``'s device and dtype, the frames before
    ``stop`` released (a schedule whose units do not overlap)."""
    x = clip.window(start, stop)
    clip.release(stop)
    return x.to(device=like.device, dtype=like.dtype)


def stages(
    stem: list[nn.Module], down_blocks: nn.ModuleList, mid: nn.Module | None, head: list[nn.Module]
) -> list[tuple[str, nn.Module]]:
    """A video encoder's timed stages, in order: ``conv_in`` (``stem``), ``down_i``, ``mid``
    (where there is one) and ``conv_out`` (``head``: the output norm to ``quant_conv``)."""
    return [
        *(("conv_in", m) for m in stem),
        *((f"down_{i}", block) for i, block in enumerate(down_blocks)),
        *([("mid", mid)] if mid is not None else []),
        *(("conv_out", m) for m in head),
    ]


def tiled(run: Callable[[Tensor], Tensor], x: Tensor, ratio: int, size: int, stride: int) -> Tensor:
    """diffusers' ``tiled_encode``: ``size``-pixel tiles every ``stride`` pixels, each through
    ``run``; seams blended over ``(size - stride) // ratio`` latent cells in raster order; each
    tile keeps its top-left ``stride // ratio`` cells; the frame cut to ``H // ratio``."""
    h, w = x.shape[-2:]
    ys, xs = range(0, h, stride), range(0, w, stride)
    grid = Grid(
        tiles=[(slice(y, y + size), slice(x0, x0 + size)) for y in ys for x0 in xs],
        columns=len(xs),
        stride=stride // ratio,
        blend_extent=size // ratio - stride // ratio,
        out_hw=(h // ratio, w // ratio),
    )
    outs = [run(x[..., rows, cols]) for rows, cols in grid.tiles]
    return grid.blend(outs)


def temporal_windows(
    run: Callable[[Tensor], Tensor], x: Tensor, ratio: int, size: int, stride: int
) -> Tensor:
    """diffusers' ``_temporal_tiled_encode``: windows of ``size + 1`` frames every ``stride``
    frames, each through ``run``; each window but the first drops its first latent frame and
    is blended over ``(size - stride) // ratio`` latent frames into the one before; each keeps
    ``stride // ratio`` latent frames (the first one more); cut to ``(T - 1) // ratio + 1``.
    The concatenation of ``iter_temporal_windows``."""
    return joined(iter_temporal_windows(run, TensorClip(x), ratio, size, stride))


def iter_temporal_windows(
    run: Callable[[Tensor], Tensor], clip: Clip, ratio: int, size: int, stride: int
) -> Iterator[Tensor]:
    """``temporal_windows`` window by window: each window read from ``clip`` when the one
    before is done (the frames before the next window then released), its kept latent frames
    yielded as soon as they are final. A blend writes only the later window's head, from the
    earlier one's tail, so a window's kept part is final once it is blended from the one
    before; only that one is held for the next blend. Windows past the cut are not run."""
    keep, blend = stride // ratio, size // ratio - stride // ratio
    left = (clip.shape[2] - 1) // ratio + 1  # latent frames still to yield
    prev: Tensor | None = None
    for start in range(0, clip.shape[2], stride):
        if left <= 0:
            break
        tile = run(clip.window(start, start + size + 1))
        clip.release(start + stride)
        if prev is None:
            kept = tile[:, :, : keep + 1]
        else:
            tile = tile[:, :, 1:]
            blend_edge(prev, tile, blend, dim=2)
            kept = tile[:, :, :keep]
        kept = kept[:, :, :left]
        left -= kept.shape[2]
        if kept.shape[2]:
            yield kept
        prev = tile


def normalize(z: Tensor, mean: Tensor, std: Tensor, scaling_factor: float = 1.0) -> Tensor:
    """``(z - mean) * scaling_factor / std`` per channel: the inverse of the decoders'
    ``z * std / scaling_factor + mean``."""
    shape = (1, -1) + (1,) * (z.ndim - 2)
    mean = mean.to(z.device, z.dtype).view(shape)
    std = std.to(z.device, z.dtype).view(shape)
    return (z - mean) * scaling_factor / std


def register_latent_stats(encoder: nn.Module, config: dict[str, Any], channels: int) -> None:
    """The config's ``latents_mean`` / ``latents_std`` (zeros / ones where absent) as the
    encoder's float32 buffers of those names (not in its state dict)."""
    mean = config.get("latents_mean") or [0.0] * channels
    std = config.get("latents_std") or [1.0] * channels
    for name, values in (("latents_mean", mean), ("latents_std", std)):
        encoder.register_buffer(name, torch.tensor(values, dtype=torch.float32), persistent=False)


def read_vae_folder(source: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A diffusers ``vae/`` folder (or a pipeline folder holding one) -> (its config.json,
    every tensor). Refuses a folder with no encoder tensors (a decoder-only checkpoint)."""
    source = Path(source)
    folder = source / "vae" if (source / "vae" / "config.json").exists() else source
    if not (folder / "config.json").exists():
        raise ValueError(f"{source}: no config.json (expected a diffusers vae/ folder)")
    raw = json.loads((folder / "config.json").read_text())
    tensors = ops.read_safetensors_folder(folder)
    if not any(k.startswith("encoder.") for k in tensors):
        raise ValueError(f"{source}: no encoder.* tensors: a decoder-only checkpoint")
    return raw, tensors


def read_single_file(path: Path, prefixes: tuple[str, ...] = ()) -> dict[str, Tensor]:
    """Tensors of a safetensors file, or of a pickled ``.pth`` / ``.pt`` / ``.ckpt`` read with
    ``weights_only=True`` (no code runs; a ``state_dict`` entry is unwrapped); the first of
    ``prefixes`` that every key has is dropped."""
    tensors = read_tensors(Path(path))
    for prefix in prefixes:
        if tensors and all(k.startswith(prefix) for k in tensors):
            return {k[len(prefix) :]: v for k, v in tensors.items()}
    return tensors


def check_state(encoder_cls: Any, config: dict[str, Any], state: dict[str, Tensor], where: Path):
    """The converted names and shapes must be exactly ``encoder_cls(config)``'s (on meta)."""
    with torch.device("meta"):
        encoder = encoder_cls(config)
    if problem := state_mismatch(encoder, state):
        raise ValueError(f"{where}: the encoder weights do not fit their config: {problem}")


def encoder_state(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The encoder half in canonical names (diffusers' own ``encoder.*`` / ``quant_conv.*``)."""
    return {k: v for k, v in tensors.items() if k.startswith(ENCODER_PREFIXES)}


def jsonable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


def synthetic_value(name: str, p: Tensor, gen: torch.Generator) -> Tensor:
    """One parameter's seeded trained-like value: fan-in scaled weights, each residual
    branch's last conv x0.1, small biases, norm scales near 1."""
    randn = torch.randn(p.shape, generator=gen)
    if name.endswith("gamma") or (p.ndim == 1 and "norm" in name and name.endswith("weight")):
        return 1 + randn * 0.02
    if name.endswith("bias"):
        return randn * 0.01
    fan_in = p[0].numel() if p.ndim > 1 else 1
    value = randn / math.sqrt(fan_in)
    if ".conv2." in name or name.endswith("conv2.weight"):
        value *= 0.1
    return value
