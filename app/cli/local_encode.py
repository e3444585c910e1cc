"""Encode an image or video file in this process from the local model store (``python -m app
encode`` without ``--url``): the entry's encoder, exact float32 on the CPU.

``encode_file`` is the one entry point. Images are preprocessed as diffusers'
``VaeImageProcessor`` does (RGB, Lanczos-resized down to a multiple of the encoder's spatial
scale when they are not one, then to [-1, 1]); MP4 frames are read by ``app.media.read``
(the service's reader: ffmpeg with the container forced) and each treated the same way.
Module level imports no torch, so the command line fails fast on bad arguments.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from app.cli.local_decode import LocalDecodeError, _atomic, check_model

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIXES = (".mp4",)
LATENT_SUFFIXES = (".safetensors", ".npy", ".bin")
OPTION_NAMES = ("scaling_factor", "shift_factor", "do_scaling", "sample", "seed", "packed")


class LocalEncodeError(LocalDecodeError):
    """An encode refused in one line: a missing file, a model not in the store, no encoder."""


def check_input_file(path: Path) -> None:
    if not path.is_file():
        raise LocalEncodeError(f"input file not found: {path}")
    if path.suffix.lower() not in IMAGE_SUFFIXES + VIDEO_SUFFIXES:
        raise LocalEncodeError(
            f"{path}: an image or video is {', '.join(IMAGE_SUFFIXES + VIDEO_SUFFIXES)}"
        )


def check_latent_output(path: Path) -> None:
    if path.suffix.lower() not in LATENT_SUFFIXES:
        raise LocalEncodeError(
            f"{path}: the latent file is {', '.join(LATENT_SUFFIXES)} (the suffix names the format)"
        )


def encode_file(
    source: Path, model: str, out: Path, models_dir: Path, options: dict[str, Any] | None = None
) -> tuple[tuple[int, ...], dict[str, float]]:
    """Encode ``source`` with ``model``'s encoder into ``out`` (``.safetensors``: one tensor
    ``latent``; ``.npy``; ``.bin``: the raw little-endian float32 bytes). ``options`` are the
    service's encode params (``OPTION_NAMES``). Returns the latent's shape and the per-phase
    times in milliseconds; raises LocalEncodeError for what the service would refuse."""
    check_input_file(source)
    check_latent_output(out)
    try:
        check_model(models_dir, model)
    except LocalDecodeError as exc:
        raise LocalEncodeError(str(exc)) from None
    t0 = time.perf_counter()
    from app.telemetry.timing import PhaseTimer

    timer = PhaseTimer()
    timer.add("import", time.perf_counter() - t0)
    shape = _encode(source, model, out, models_dir, dict(options or {}), timer)
    return shape, {name: seconds * 1000 for name, seconds in timer.phases().items()}


def _encode(
    source: Path, model: str, out: Path, store: Path, options: dict[str, Any], timer: Any
) -> tuple[int, ...]:
    import torch

    with timer.phase("load"):
        encoder = load_local_encoder(store, model)
    with timer.phase("read"):
        if source.suffix.lower() in VIDEO_SUFFIXES:
            if not encoder.is_video:
                raise LocalEncodeError(
                    f"{model} ({encoder.family}) encodes images: an MP4 needs a video family's entry"
                )
            x = read_video(source, encoder.spatial_scale)
        else:
            x = read_image(source, encoder.spatial_scale)
    with timer.phase("encode"), torch.inference_mode():
        z = encode_pixels(encoder, x, options)
    with timer.phase("write"):
        write_latent(z, out)
    return tuple(z.shape)


def load_local_encoder(store: Path, name: str) -> Any:
    """The entry's encoder in float32 on the CPU; a decoder-only entry is refused."""
    from app.encoders import encoder_module
    from app.store import StoreError, load_encoder

    try:
        manifest, state = load_encoder(store, name)
    except StoreError as exc:
        raise LocalEncodeError(str(exc)) from exc
    try:
        encoder = encoder_module(manifest.family).Encoder(manifest.encoder_config)
    except KeyError as exc:
        raise LocalEncodeError(f"{name}: {exc.args[0]}") from exc
    encoder.load_state_dict(state)
    return encoder.float().eval().requires_grad_(False)


def preprocess(image: Any, multiple: int) -> Any:
    """A PIL image -> ``[1, 3, H, W]`` float32 in [-1, 1], as ``VaeImageProcessor.preprocess``
    (``vae_scale_factor=multiple``): RGB as ``app.media.read.rgb_image`` makes it (16-bit grey
    scaled, not clipped), sizes rounded down to the multiple with Lanczos."""
    import numpy as np
    import torch
    from PIL import Image

    from app.media.read import rgb_image

    image = rgb_image(image)
    w, h = image.size
    size = (w - w % multiple, h - h % multiple)
    if 0 in size:
        raise LocalEncodeError(f"image {w}x{h} is smaller than one latent cell ({multiple} px)")
    if size != image.size:
        image = image.resize(size, resample=Image.Resampling.LANCZOS)
    array = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1)[None].mul(2).sub(1)


def read_image(path: Path, multiple: int) -> Any:
    """Opened as the service opens a body: PNG, JPEG or WebP only, whatever the suffix."""
    from PIL import Image, UnidentifiedImageError

    from app.media.read import IMAGE_FORMATS

    try:
        with Image.open(path, formats=IMAGE_FORMATS) as image:
            return preprocess(image, multiple)
    except UnidentifiedImageError as exc:
        raise LocalEncodeError(f"{path}: not a readable image ({exc})") from exc


def read_video(path: Path, multiple: int) -> Any:
    """The MP4's frames -> ``[1, 3, T, H, W]`` in [-1, 1] (each frame as ``preprocess``),
    read by the service's reader: the ``.mp4`` suffix forces ffmpeg's MP4 demuxer, so a
    file so named that is a concat script or a playlist cannot open other files either."""
    import torch
    from PIL import Image

    from app.media.read import MediaError, mp4_frames, probe_mp4

    try:
        info = probe_mp4(path)
        frames = [preprocess(Image.fromarray(f), multiple) for f in mp4_frames(path, info)]
    except MediaError as exc:
        raise LocalEncodeError(f"{path}: {exc.message}") from None
    if not frames:
        raise LocalEncodeError(f"{path}: the video has no frames")
    return torch.stack(frames, dim=2)


def encode_pixels(encoder: Any, x: Any, options: dict[str, Any]) -> Any:
    """The latent the service answers: the mean or a seeded sample, then ``(z - shift) *
    scale`` when either factor is given, else the model's own normalisation on
    ``do_scaling``; FLUX's packed ``[B, H/2*W/2, 4C]`` layout on ``packed``."""
    import torch

    seed = options.get("seed")
    generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None
    try:
        z = encoder.encode(x, sample=bool(options.get("sample")), generator=generator)
    except ValueError as exc:
        raise LocalEncodeError(str(exc)) from exc
    scale, shift = options.get("scaling_factor"), options.get("shift_factor")
    if scale is not None or shift is not None:
        z = (z - (shift or 0.0)) * (1.0 if scale is None else scale)
    elif options.get("do_scaling"):
        z = encoder.normalize(z)
    if options.get("packed"):
        z = pack(z)
    return z


def pack(z: Any) -> Any:
    """diffusers' FLUX ``_pack_latents``: ``[B, C, H, W]`` -> ``[B, H/2 * W/2, 4C]``."""
    if z.ndim != 4 or z.shape[-1] % 2 or z.shape[-2] % 2:
        raise LocalEncodeError(f"packed needs an image latent of even size, got {list(z.shape)}")
    b, c, h, w = z.shape
    z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return z.reshape(b, (h // 2) * (w // 2), c * 4)


def write_latent(z: Any, out: Path) -> None:
    import numpy as np
    from safetensors.torch import save

    z = z.contiguous().float()
    with _atomic(out) as f:
        suffix = out.suffix.lower()
        if suffix == ".safetensors":
            f.write(save({"latent": z}))
        elif suffix == ".npy":
            np.save(f, z.numpy())
        else:
            f.write(z.numpy().astype("<f4").tobytes())
