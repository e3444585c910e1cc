"""What the parity and HTTP tests share: seeded latents, cosine, PSNR, a parity check,
diffusers references with seeded weights and our decoders and encoders loaded from them, the
checks every video encoder family passes, MP4 frames.

Computed here, independently of ``app`` (a test must not grade the code with its own ruler):
a family module is passed in by the test that checks it.
"""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import imageio_ffmpeg
import numpy as np
import pytest
import requests
import torch
from fastapi.testclient import TestClient
from torch import nn

from app.config import Settings
from app.http import create_app
from app.telemetry import timing
from app.telemetry.timing import PhaseTimer
from tests import faulty
from tests.live import live_server


def latent(*shape: int, seed: int = 0) -> torch.Tensor:
    """A seeded N(0, 1) float32 tensor of ``shape``."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two tensors, flattened, in float64."""
    a, b = a.detach().double().flatten().cpu(), b.detach().double().flatten().cpu()
    return float(a @ b / (a.norm() * b.norm()))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two uint8-range images; inf when identical."""
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0**2 / mse)) if mse else math.inf


def report(name: str, got: torch.Tensor, expected: torch.Tensor) -> float:
    """Print cosine and max-abs error of ``got`` against ``expected``; return the cosine."""
    cos = cosine(got, expected)
    err = (got.double() - expected.double()).abs().max().item()
    print(f"{name}: shape={list(got.shape)} cos={cos:.12f} (1-cos {1 - cos:.1e}) max_abs={err:.2e}")
    return cos


def check(
    name: str,
    got: torch.Tensor,
    expected: torch.Tensor,
    min_cos: float = 0.99999,
    dtype: torch.dtype | None = None,
) -> None:
    """``got`` has ``expected``'s shape (and ``dtype``) and a cosine of at least ``min_cos``."""
    cos = report(name, got, expected)
    assert got.shape == expected.shape
    assert dtype is None or got.dtype == dtype
    assert cos >= min_cos


# --- diffusers references and our decoders built from them --------------------------------
def seeded(cls: type[nn.Module], seed: int = 0, **config: Any) -> nn.Module:
    """A diffusers model of ``config`` in eval mode, its default init drawn after
    ``torch.manual_seed(seed)``: the same random weights on every run."""
    torch.manual_seed(seed)
    return cls(**config).eval()


@torch.no_grad()
def checked_reference_decode(ref: Any, ours: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """diffusers' decode of ``z`` ``[B,C,T,H,W]``, whose frame count and width are those
    ``ours`` announces (``frames_out``, ``spatial_scale``)."""
    expected = ref.decode(z).sample
    assert expected.shape[2] == ours.frames_out(z.shape[2])
    assert expected.shape[-1] == z.shape[-1] * ours.spatial_scale
    return expected


def decoder_state(vae: nn.Module, prefix: str = "decoder.") -> dict[str, torch.Tensor]:
    """``vae``'s tensors under ``prefix``, without it: what our decoder's state dict holds."""
    return {k[len(prefix) :]: v for k, v in vae.state_dict().items() if k.startswith(prefix)}


def saved(vae: Any, folder: Path) -> Path:
    """``folder`` after ``vae.save_pretrained`` into it: a diffusers model folder."""
    vae.save_pretrained(folder)
    return folder


def decoder_from(family: ModuleType, config: dict, state: dict[str, torch.Tensor]) -> nn.Module:
    """``family.Decoder`` holding ``state``; its config goes through JSON first, as a store
    manifest keeps it, so a config that does not survive JSON fails here."""
    ours = family.Decoder(json.loads(json.dumps(config))).eval()
    ours.load_state_dict(state)
    return ours


def import_pair(ref: Any, family: ModuleType, folder: Path) -> tuple[Any, nn.Module, dict]:
    """(``ref``, our decoder, its config): ``ref`` saved as the ``vae/`` of a pipeline folder
    and imported with ``family.convert``, so the converter is on the path of every parity
    number."""
    config, state = family.convert(saved(ref, folder / "vae").parent)
    return ref, decoder_from(family, config, state), config


def synthetic_twins(family: ModuleType, config: dict, seed: int) -> tuple[nn.Module, nn.Module]:
    """Two ``family.Decoder``s of ``config`` after ``init_synthetic`` with the same seed;
    asserts they are equal (a synthetic model must be reproducible)."""
    a, b = family.Decoder(config), family.Decoder(config)
    family.init_synthetic(a, torch.Generator().manual_seed(seed))
    family.init_synthetic(b, torch.Generator().manual_seed(seed))
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)
    return a, b


def listed(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its tuples as lists, as JSON (and so a store manifest) keeps them."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


# diffusers' AutoencoderKLWan as Wan 2.2 TI2V builds it: residual blocks, a 2x2 patch (12 channels)
WAN22_PATCHED = dict(is_residual=True, patch_size=2, in_channels=12, out_channels=12)


# --- video encoders: ours against diffusers' ``encode`` -------------------------------------
ENCODER_PARTS = ("encoder.", "quant_conv.")  # a diffusers VAE's encoder half


def encoder_from(family: ModuleType, config: dict, state: dict[str, torch.Tensor]) -> nn.Module:
    """``family.Encoder`` holding ``state``; its config goes through JSON first, as a store
    manifest keeps it."""
    ours = family.Encoder(json.loads(json.dumps(config))).eval()
    ours.load_state_dict(state)
    return ours


def encoder_pair(
    family: ModuleType, ref: nn.Module, config: dict, parts: tuple[str, ...] = ENCODER_PARTS
) -> tuple[nn.Module, nn.Module]:
    """(``ref``, ``family.Encoder(config)`` holding ``ref``'s tensors under ``parts``)."""
    state = {k: v for k, v in ref.state_dict().items() if k.startswith(parts)}
    return ref, encoder_from(family, config, state)


def rgb_video(frames: int, h: int, w: int, batch: int = 1) -> torch.Tensor:
    """A uniform [-1, 1) RGB video ``[batch, 3, frames, h, w]``, seeded by its shape."""
    g = torch.Generator().manual_seed(frames * 1000 + h + w)
    return torch.rand((batch, 3, frames, h, w), generator=g) * 2 - 1


def reference_dist(ref: Any, x: torch.Tensor) -> Any:
    """diffusers' ``encode(x).latent_dist`` (its moments are ``.parameters``)."""
    with torch.no_grad():
        return ref.encode(x).latent_dist


def check_moments(name: str, got: torch.Tensor, ref_dist: Any) -> None:
    """Our moments ``got`` are ``ref_dist``'s (shape, cosine of the moments and of the mean)."""
    expected = ref_dist.parameters
    assert got.shape == expected.shape
    assert report(f"{name} moments", got, expected) >= 0.99999
    assert report(f"{name} mean", got.chunk(2, dim=1)[0], ref_dist.mean) >= 0.99999


def check_encode(
    name: str, ref: Any, ours: nn.Module, shape: tuple[int, int, int], **options: Any
) -> None:
    """``ours.moments`` of a ``(frames, h, w)`` video (a batch of 2 for one frame) with
    ``options`` against ``ref``'s encode, and the latent geometry ``ours`` announces."""
    x = rgb_video(*shape, batch=2 if shape[0] == 1 else 1)
    got = ours.moments(x, **options)
    check_moments(name, got, reference_dist(ref, x))
    assert got.shape[2] == ours.latent_frames(shape[0])
    assert got.shape[-1] * ours.spatial_scale == shape[-1]


def tile_reference(ref: Any, size: int, stride: int, **more: int) -> None:
    """diffusers' ``enable_tiling`` with square ``size``-pixel tiles every ``stride`` pixels."""
    ref.enable_tiling(
        tile_sample_min_height=size,
        tile_sample_min_width=size,
        tile_sample_stride_height=stride,
        tile_sample_stride_width=stride,
        **more,
    )


def check_tiled_encode(
    name: str, ref: Any, ours: nn.Module, x: torch.Tensor, size: int, stride: int
) -> None:
    """Our square tiles of ``size`` pixels every ``stride`` are diffusers' ``enable_tiling``
    encode of ``x``, and differ from the untiled encode (so the tiles are really there)."""
    tile_reference(ref, size, stride)
    got = ours.moments(x, tiled=True, tile_sample_size=size, tile_sample_stride=stride)
    check_moments(f"{name} tiled", got, reference_dist(ref, x))
    assert not torch.allclose(ours.moments(x), got)


def check_folder_import(
    family: ModuleType, ref: Any, ours: nn.Module, folder: Path, x: torch.Tensor
) -> tuple[dict, nn.Module]:
    """``ref`` saved into ``folder`` and imported with ``family.convert``: (its config, the
    encoder loaded from it), whose moments of ``x`` are exactly those of ``ours``."""
    config, state = family.convert(saved(ref, folder))
    loaded = encoder_from(family, config, state)
    torch.testing.assert_close(loaded.moments(x), ours.moments(x), rtol=0, atol=0)
    return config, loaded


def check_encoder_stages(ours: nn.Module, has_mid: bool = True) -> None:
    """The timed stages run ``conv_in``, ``down_0``..., ``mid`` (where there is one),
    ``conv_out`` in that order and hold every parameter of the encoder (none goes untimed)."""
    stages = ours.stages()
    names = [name for name, _ in stages]
    downs = sum(name.startswith("down_") for name in names)
    expected = ["conv_in"] * names.count("conv_in") + [f"down_{i}" for i in range(downs)]
    expected += ["mid"] * has_mid + ["conv_out"] * names.count("conv_out")
    assert names == expected and names[0] == "conv_in" and names[-1] == "conv_out"
    held = {id(p) for _, module in stages for p in module.parameters()}
    assert held == {id(p) for p in ours.parameters()}


def check_synthetic_encoder(family: ModuleType, name: str) -> None:
    """``family.SYNTHETIC[name]`` after ``init_synthetic``: moments of the announced shape,
    finite and of a trained-like spread on the encoder's own probe input."""
    enc = family.Encoder(family.SYNTHETIC[name]).eval()
    family.init_synthetic(enc, torch.Generator().manual_seed(0))
    x = enc.probe_input(torch.Generator().manual_seed(1))
    m = enc.moments(x)
    assert m.shape[1] == 2 * enc.latent_channels
    assert m.shape[2] == enc.latent_frames(x.shape[2])
    assert torch.isfinite(m).all() and 0.05 < m.std() < 20


def check_working_bytes(family: ModuleType, config: dict, shape: tuple[int, ...]) -> None:
    """The memory plan's estimate against the peak live tensor bytes of an encode of
    ``config`` (``{}``: the published architecture), measured on the meta device: enough,
    and not wildly more."""
    from bench.meta_memory import live_peak

    with torch.device("meta"):
        enc = family.Encoder(config).eval()
    x = torch.empty(shape, device="meta")
    peak = live_peak(lambda: enc.moments(x))
    estimate = enc.working_bytes(shape, 4)
    print(f"{shape}: peak {peak / 2**20:.0f} MiB, estimate {estimate / 2**20:.0f} MiB")
    assert peak <= estimate <= 1.5 * peak


def check_bad_input_refused(family: ModuleType) -> None:
    """A frame size off the encoder's spatial cell, or the wrong channel count: a
    ``ValueError`` that says so."""
    enc = family.Encoder(family.SYNTHETIC[next(iter(family.SYNTHETIC))]).eval()
    s = enc.spatial_scale
    with pytest.raises(ValueError, match="multiples of"):
        enc.moments(torch.zeros(1, 3, 1, s, s + s // 2))
    with pytest.raises(ValueError, match="expected"):
        enc.moments(torch.zeros(1, 4, 1, s, s))


# --- HunyuanVideo's original checkpoint (Tencent's hyvideo/vae) ---------------------------
def hunyuan_original_config(ref: Any) -> dict:
    """The original ``vae/config.json`` (Tencent's ``AutoencoderKLCausal3D``) of ``ref``."""
    c = ref.config
    n = len(c.block_out_channels)
    return {
        "_class_name": "AutoencoderKLCausal3D",
        "act_fn": "silu",
        "block_out_channels": list(c.block_out_channels),
        "down_block_types": ["DownEncoderBlockCausal3D"] * n,
        "in_channels": 3,
        "latent_channels": c.latent_channels,
        "layers_per_block": c.layers_per_block,
        "norm_num_groups": c.norm_num_groups,
        "out_channels": 3,
        "sample_size": 256,
        "sample_tsize": 64,
        "up_block_types": ["UpDecoderBlockCausal3D"] * n,
        "scaling_factor": 0.476986,
        "time_compression_ratio": 4,
        "mid_block_add_attention": c.mid_block_add_attention,
    }


def hunyuan_original_checkpoint(ref: Any) -> dict:
    """``pytorch_model.pt`` as hyvideo's ``load_vae`` reads it: ``state_dict``, ``vae.`` keys."""
    state = {f"vae.{k}": v.contiguous() for k, v in ref.state_dict().items()}
    return {"state_dict": {**state, "loss.logvar": torch.zeros(())}}  # a training leftover


# --- videos ---------------------------------------------------------------------------------
MP4_MIN_PSNR = 30.0  # dB: H.264 crf 18 yuv420p MP4 frames against the decoded uint8 frames


def read_mp4(data: bytes, tmp_path: Path, name: str = "out.mp4") -> tuple[dict, np.ndarray]:
    """(ffmpeg's stream metadata, uint8 frames ``[T,H,W,3]``) of MP4 ``data``, read back
    with imageio-ffmpeg's real ffmpeg."""
    path = tmp_path / name
    path.write_bytes(data)
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    w, h = meta["size"]
    return meta, np.stack([np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in reader])


def probe(data: bytes, tmp_path: Path) -> str:
    """What imageio-ffmpeg's ffmpeg says about the stream (``ffmpeg -i``, its ffprobe)."""
    path = tmp_path / "probe.mp4"
    path.write_bytes(data)
    exe = imageio_ffmpeg.get_ffmpeg_exe()
    return subprocess.run(
        [exe, "-hide_banner", "-i", str(path)], capture_output=True, text=True
    ).stderr


def diffusers_frames(decoded: torch.Tensor) -> np.ndarray:
    """diffusers' own uint8 frames ``[T,H,W,3]`` of one video, as its pipelines make them."""
    from diffusers.video_processor import VideoProcessor  # the oracle: imported where used

    frames = VideoProcessor().postprocess_video(decoded, output_type="pil")[0]
    return np.stack([np.asarray(f) for f in frames])


# --- LTX-Video and LTX-2 (both diffusers classes share these decoder parts) -----------------
@torch.no_grad()
def noise_scales_count(vae: nn.Module) -> None:
    """diffusers zero-inits the noise-injection scales: make them count in a parity test."""
    for name, p in vae.decoder.named_parameters():
        if "per_channel_scale" in name:
            p.normal_(0, 0.1)


@torch.no_grad()
def with_stats(vae: nn.Module) -> nn.Module:
    """``vae`` with seeded latent mean/std that are not the identity (for denormalization)."""
    g = torch.Generator().manual_seed(5)
    n = vae.latents_mean.shape[0]
    vae.latents_mean.copy_(torch.randn(n, generator=g))
    vae.latents_std.copy_(torch.rand(n, generator=g) + 0.5)
    return vae


def ltx_decode(
    vae: Any, z: torch.Tensor, timestep: float = 0.0, seed: int = 0, pipeline: Any = None
) -> torch.Tensor:
    """diffusers' decode at ``timestep`` (``pipeline``: after its latent de-normalization).
    Its noise comes from the global RNG, so that is seeded with ``seed``, as ours is."""
    if pipeline is not None:
        z = pipeline._denormalize_latents(
            z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor
        )
    temb = torch.full((z.shape[0],), timestep) if vae.config.timestep_conditioning else None
    torch.manual_seed(seed)
    with torch.no_grad():
        return vae.decode(z, temb).sample


def check_temporal_chunks(name: str, ours: nn.Module, z: torch.Tensor, **options: Any) -> None:
    """One latent frame at a time, state carried across chunks, == one pass (``options``:
    timestep and seed) == the plain forward; no piece is larger than one latent frame's worth
    at the last stage (+1 flush)."""
    whole = ours.decode(z, chunk_frames=0, **options)
    pieces = list(ours.iter_decode(z, chunk_frames=1, **options))
    streamed = torch.cat(pieces, 2)
    assert report(f"{name} chunk=1 vs whole", streamed, whole) >= 0.99999
    assert (streamed - whole).abs().max() < 1e-5
    assert max(p.shape[2] for p in pieces) <= ours.temporal_scale + 1
    cond = ours.conditioning(z, options)
    with torch.no_grad():
        torch.testing.assert_close(ours(z, cond), whole, rtol=0, atol=0)


def stage_phases(ours: nn.Module, z: torch.Tensor, **options: Any) -> list[str]:
    """The phases a fresh ``PhaseTimer`` records over ``ours.decode(z, **options)``, the
    decoder's stages instrumented."""
    timing.instrument(ours.stages())
    timer = PhaseTimer()
    with timer.active():
        ours.decode(z, **options)
    return list(timer.phases())


def lightricks_decoder_name(key: str, blocks: list[tuple[str, list]]) -> str:
    """A decoder tensor name of ours -> Lightricks' single-file one: ``blocks`` lists each
    (our module path, [Lightricks block kind, params]) in its flat ``up_blocks.N`` order."""
    for j, (path, (kind, _)) in sorted(enumerate(blocks), key=lambda b: -len(b[1][0])):
        if key.startswith(path + "."):
            rest = key[len(path) + 1 :]
            rest = rest.replace("resnets.", "res_blocks.") if kind == "res_x" else rest
            key = f"up_blocks.{j}.{rest}"
            break
    for new, old in (("time_embedder.", "last_time_embedder."),
                     ("scale_shift_table", "last_scale_shift_table")):  # fmt: skip
        key = old + key[len(new) :] if key.startswith(new) else key
    return key


@torch.no_grad()
def smooth_head(conv: nn.Conv3d, p: int) -> None:
    """Make ``conv_out`` paint each p x p pixel patch as a mostly gray level plus one ramp
    along x and one along y (and a 10% colour tint), from its own random weights.

    Random heads paint per-pixel colour noise, which yuv420p's 2x2 chroma cannot hold
    (17 dB after H.264 crf 18, measured), so an MP4-vs-frames PSNR floor would say nothing.
    This head gives 33-40 dB here. The x and y ramps differ, so the pt parity still checks
    how unpatchify orders the patch offsets (channel = colour * p * p + x * p + y).
    """
    w = torch.cat([conv.weight.flatten(1), conv.bias[:, None]], 1).view(3, p, p, -1)
    ramp = torch.cos(math.pi * (torch.arange(p) + 0.5) / p)
    gray = w[:1, :1, :1]
    along_x = 0.3 * w[:1, 1 % p : 1 % p + 1, :1] * ramp.view(1, p, 1, 1)
    along_y = 0.3 * w[:1, :1, 1 % p : 1 % p + 1] * ramp.view(1, 1, p, 1)
    painted = 0.7 * (gray + along_x + along_y + 0.1 * w[:, :1, :1])  # 0.7: a softer contrast
    painted = painted.expand_as(w).reshape(3 * p * p, -1)
    conv.weight.copy_(painted[:, :-1].view_as(conv.weight))
    conv.bias.copy_(painted[:, -1])


@torch.no_grad()
def served_ltx(cls: type[nn.Module], seed: int, **config: Any) -> nn.Module:
    """A random diffusers LTX / LTX-2 VAE to serve: noise scales made to count, latent stats
    that are not the identity, and a head a video codec can hold."""
    vae = seeded(cls, seed, **config)
    noise_scales_count(vae)
    vae.latents_mean.normal_(0, 0.5)
    vae.latents_std.uniform_(0.5, 1.5)
    smooth_head(vae.decoder.conv_out.conv, vae.config.patch_size)
    return vae


# --- faulty servers: what the reliability tests (decode faults, deadlines, bodies, store
# names, auth, shutdown) share ---------------------------------------------------------------

SERVE_FAULTY = {"VAE_BATCH_ROWS": "1", "VAE_MODELS": "faulty"}


@pytest.fixture(scope="module", autouse=True)
def faulty_family():
    with faulty.registered():
        yield


@pytest.fixture(scope="module", name="store")
def faulty_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("faulty-store")
    faulty.bake(store, "faulty")
    faulty.bake(store, "faulty-small", max_pixels=32 * 32)  # a manifest that tightens a limit
    faulty.bake(store, "faulty-video", video=True)
    return store


@pytest.fixture(scope="module", name="server")
def faulty_server(store):
    """bf16 on the CPU: the fast path is a copy, so the CPU path is a real fallback."""
    limits = dict(max_batch=4, batch_rows=4, queue_depth=8, max_body_mb=1, body_timeout_s=1.0)
    with live_server(store, device="cpu", dtype="bfloat16", **limits) as url:
        yield url


def post(url: str, z: torch.Tensor, model: str = "faulty", headers=None, **params):
    return requests.post(
        f"{url}/decode/{model}",
        data=z.numpy().tobytes(),
        params={"shape": json.dumps(list(z.shape)), "output_type": "pt", **params},
        headers={"Content-Type": "tensor/binary", **(headers or {})},
        timeout=30,
    )


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of the exposition (0 when absent)."""
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if not line.startswith((name + "{", name + " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def occupy(url: str, tag: float) -> threading.Thread:
    """Hold the single worker until ``faulty.release(tag)``; returns the caller's thread once
    the worker has taken the decode (no guess at how long anything takes)."""
    thread = threading.Thread(target=post, args=(url, faulty.latent(faulty.HOLD, tag=tag)))
    thread.start()
    faulty.wait_for(f"the worker took {tag}", lambda: faulty.started(tag))
    return thread


def wait_queued(url: str, n: int) -> None:
    """Wait until ``n`` decodes wait in the queue (the worker is held)."""
    faulty.wait_for(f"{n} queued", lambda: metric(url, "vae_queue_depth") == n)


def post_mp4(url: str, z: torch.Tensor, **kwargs) -> requests.Response:
    return requests.post(
        f"{url}/decode/faulty-video",
        data=z.numpy().tobytes(),
        params={"shape": json.dumps(list(z.shape)), "output_type": "mp4"},
        headers={"Content-Type": "tensor/binary", **kwargs.pop("headers", {})},
        timeout=30,
        **kwargs,
    )


def raw_request(url: str, target: str, body: bytes = b"", headers: dict | None = None):
    """A hand-made HTTP/1.1 request on a fresh socket (the caller reads or closes it)."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    sock = socket.create_connection((host, port), timeout=10)
    fields = {"Host": f"{host}:{port}", "Content-Type": "tensor/binary"}
    fields |= headers if headers is not None else {"Content-Length": str(len(body))}
    head = f"POST {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items())
    sock.sendall(head.encode() + b"\r\n" + body)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of the response on ``sock`` (read until it closes or completes)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or b"\r\n\r\n"
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    sock.close()
    return int(head.split()[1]), json.loads(rest[:length])


def client(tmp_path, **settings) -> TestClient:
    """The app without its lifespan: routes and middleware, no models loaded."""
    return TestClient(create_app(Settings(models_dir=tmp_path, **settings)))


def upload_and_read(url: str, head: bytes, size: int, seconds: float = 10.0) -> tuple[bytes, str]:
    """Send ``head`` then up to ``size`` body bytes on a raw socket, reading whatever comes
    back *while still sending* (a client mid-upload); stops sending once an answer is in.
    Returns (everything received until the server closed, the error that ended it or '')."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    sock = socket.create_connection((host, port), timeout=seconds)
    received, sent, error = b"", 0, ""
    try:
        sock.sendall(head)
        sock.setblocking(False)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and b"\r\n\r\n" not in received:
            if sent < size:
                try:
                    sent += sock.send(b"\0" * min(1 << 16, size - sent))
                except BlockingIOError:
                    pass
            try:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                received += chunk
            except BlockingIOError:
                time.sleep(0.002)
        sock.setblocking(True)
        sock.settimeout(seconds)
        sock.shutdown(socket.SHUT_WR)  # done sending: the server may now close
        while chunk := sock.recv(1 << 16):
            received += chunk
    except OSError as exc:  # ConnectionResetError above all: the answer may be lost
        error = type(exc).__name__
    finally:
        sock.close()
    return received, error
