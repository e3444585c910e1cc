"""The GPU proof's ``video`` section (issue 23): every video family at the sizes samplers render.

On a GPU, for each model at its real size (seeded trained-like weights built on the device):
  service   the runner as served, to uint8, cold then warm: planner estimate, rung, retries,
            peak allocated/reserved, per-stage CUDA-event times
  diffusers the same weights in diffusers on the same card, bf16, NCDHW and channels_last_3d
            (enable_tiling where the untiled decode runs out of memory)
  kernels   one warm chunk profiled: a vol2col/im2col/slow_conv kernel fails the proof
  parity    the served bf16 copy against a float32 copy on the device, 3 latent frames at full
            resolution (cosine >= 0.9999, PSNR)
  layout    the served copy in NCDHW and channels_last_3d (the family descriptor's
            ``gpu_conv3d_layout`` is served), where it holds 3-D conv weights
  choices   each device-aware setting's GPU candidates (chunk frames, tokens per call, ...)
then an emulated L4 (``VAE_DEVICE_MEMORY_GB=21.5``) with every model resident: each size decodes.
Everywhere: the estimate, live peak and the runner's rung of each real size on the meta device
under the L4 budget. ``--quick`` on a CPU runs the device code at tiny sizes.
Rows go to ``report["video"]`` (the schema of issue 23); the rest to ``report["video_*"]``.
``PROOF_VIDEO_STEPS`` (comma-separated, of ``STEPS``) runs only those steps: a rerun after a
timeout skips what the last run measured (device time is short).
"""

from __future__ import annotations

import inspect
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from app.families import family, ops
from app.families.hunyuan_video import decoder as hunyuan_video
from app.families.ltx.decoder import ltx2
from app.families.minimax_h3.decoder.model import DEFAULTS as MINIMAX_DEFAULTS
from app.families.wan import decoder as wan
from app.protocol.request import DecodeRequest
from app.runtime import device as devices
from app.runtime import gate, modes
from app.runtime.runner import PLANNING_SHARE, OutOfMemory, Runner
from app.store import Manifest
from app.telemetry.metrics import Metrics
from app.telemetry.timing import PhaseTimer, instrument
from bench.ltx import CONFIG_091
from bench.meta_memory import live_peak

L4_BYTES = int(21.5 * 2**30)  # VAE_DEVICE_MEMORY_GB=21.5: an L4's 24 GB less the context
SLOW_KERNELS = ("vol2col", "im2col", "slow_conv")  # a conv that fell off cuDNN
PARITY_COSINE = 0.9999
WAN_21 = {**wan.SYNTHETIC["wan2.1-tiny"], "decoder_base_dim": 96, "num_res_blocks": 2}
HUNYUAN_VIDEO = {
    **hunyuan_video.SYNTHETIC["hunyuan-video-tiny"],
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "norm_num_groups": 32,
}


@dataclass(frozen=True)
class VideoModel:
    name: str  # the row's "family": a released model
    family: str  # the decoder family serving it
    config: dict[str, Any]
    sizes: tuple[tuple[int, int, int], ...]  # (frames, height, width) of issue 23's table
    tiny: str  # the family's SYNTHETIC model for --quick
    tiny_size: tuple[int, int, int]


MODELS = (
    VideoModel("ltx-0.9.1", "ltx", CONFIG_091, ((121, 512, 768),), "ltx-tiny", (17, 64, 96)),
    VideoModel(
        "ltx-2",
        "ltx",
        ltx2.DEFAULTS,
        ((121, 704, 1216), (121, 512, 768)),
        "ltx2-tiny",
        (17, 64, 96),
    ),  # fmt: skip
    VideoModel(
        "wan-2.1", "wan", WAN_21, ((81, 480, 832), (81, 720, 1280)), "wan2.1-tiny", (9, 48, 64)
    ),  # fmt: skip
    VideoModel(
        "hunyuan-video",
        "hunyuan-video",
        HUNYUAN_VIDEO,
        ((61, 544, 960), (129, 720, 1280)),
        "hunyuan-video-tiny",
        (9, 48, 64),
    ),  # fmt: skip
    VideoModel(
        "minimax-h3",
        "minimax-h3",
        MINIMAX_DEFAULTS,
        ((209, 768, 1344),),
        "minimax-h3-tiny",
        (9, 64, 64),
    ),  # fmt: skip
)


STEPS = ("service", "parity", "kernels", "layout", "choices", "diffusers", "l4", "bands", "mp4")


def steps() -> set[str]:
    """The steps ``PROOF_VIDEO_STEPS`` names (all by default); an unknown name is an error."""
    chosen = {n for n in os.environ.get("PROOF_VIDEO_STEPS", "").split(",") if n}
    if chosen - set(STEPS):
        raise SystemExit(f"PROOF_VIDEO_STEPS: unknown {sorted(chosen - set(STEPS))}; of {STEPS}")
    return chosen or set(STEPS)


def latent_shape(decoder: Any, frames: int, height: int, width: int) -> tuple[int, ...]:
    s, t = decoder.spatial_scale, (frames - 1) // decoder.temporal_scale + 1
    return (1, decoder.latent_channels, t, max(1, height // s), max(1, width // s))


def row(model: VideoModel, size, device: str, variant: str, **fields: Any) -> dict[str, Any]:
    """One row of ``report["video"]`` in issue 23's schema (plus extra fields)."""
    base = {"family": model.name, "frames": size[0], "height": size[1], "width": size[2],
            "device": device, "variant": variant, "estimate_mib": None, "peak_mib": None,
            "ms": None, "rung": None, "budget_mib": None}  # fmt: skip
    return {**base, **fields}


def mib(n: float | None) -> int | None:
    return None if n is None else round(n / 2**20)


# --- the real sizes on the meta device ----------------------------------------------------------


def served_on_meta(key: str, config: dict[str, Any]) -> Any:
    """The full-size decoder on the meta device in bf16, optimized as the served copy is."""
    with torch.device("meta"):
        decoder = family(key).decoder.module(dict(config)).to(torch.bfloat16).eval()
    decoder.optimize()
    return decoder


def planned_rung(runner: Runner, decoder: Any, shape: tuple[int, ...]) -> tuple[str, bool]:
    """The runner's first plan for one latent: (rung, tiled)."""
    holder = _Held(decoder)
    try:
        attempt = runner._first_attempt(holder, torch.empty(shape, device="meta"))
    except OutOfMemory:
        return "refused", False
    if runner.rows_that_fit(holder, shape) < shape[0]:
        return "split", bool(attempt.tiled)
    return ("tiled" if attempt.tiled else "whole"), bool(attempt.tiled)


class _Held:
    """What the runner's planning reads of a served model."""

    def __init__(self, decoder: Any) -> None:
        self.active = self.fast = self.reference = decoder
        self.compiled = {}

    def decoder_for(self, tiled: bool | None) -> Any:
        return self.active  # the proof measures the copy itself, tiled or not


def meta_rows(budget: int = L4_BYTES, models=MODELS) -> list[dict[str, Any]]:
    """One service row per model and real size: estimate and live peak of the planned path,
    the rung the runner plans under ``budget`` (the model's weights resident within it)."""
    rows = []
    for model in models:
        decoder = served_on_meta(model.family, model.config)
        weights = sum(p.numel() * p.element_size() for p in decoder.parameters())
        runner = Runner(Metrics(), budget=budget - weights)
        for size in model.sizes:
            shape = latent_shape(decoder, *size)
            rung, tiled = planned_rung(runner, decoder, shape)
            z = torch.empty(shape, device="meta", dtype=torch.bfloat16)
            options = {"tiled": tiled} if decoder.supports_tiling else {}
            peak = live_peak(lambda d=decoder, z=z, o=options: d.decode(z, **o))
            estimate = decoder.working_bytes(shape, 2, tiled=tiled)
            rows.append(row(
                model, size, "meta", "service", estimate_mib=mib(estimate), peak_mib=mib(peak),
                rung=rung, budget_mib=mib((budget - weights) * PLANNING_SHARE),
                weights_mib=mib(weights), estimate_over_peak=round(estimate / max(peak, 1), 3),
                whole_estimate_mib=mib(decoder.working_bytes(shape, 2)),
            ))  # fmt: skip
            print(f"  meta {model.name} {size}: {rows[-1]}", flush=True)
    return rows


# --- on the device ------------------------------------------------------------------------------


class VideoSection:
    """The device half: ``proof`` is gpu_proof's ``Proof`` (report, fail, note, write)."""

    def __init__(self, proof: Any, kernel_profile: Callable[..., dict]) -> None:
        self.proof, self.kernel_profile = proof, kernel_profile
        self.device: torch.device = proof.device
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.resident: dict[str, Any] = {}  # model name -> its served copy (the L4 pass)
        report = proof.report
        self.rows = report.setdefault("video", [])
        for key in ("video_kernels", "video_parity", "video_layout", "video_choices"):
            report.setdefault(key, [])
        if self.cuda:
            report["versions"] = {"cudnn": torch.backends.cudnn.version(),
                                  "driver": devices._driver(), "torch": torch.__version__,
                                  "cuda": torch.version.cuda}  # fmt: skip

    def run(self) -> None:
        """Meta rows (on a GPU only with ``PROOF_VIDEO_META=1``: they need no device), each
        chosen model on the device, then the L4 pass. ``PROOF_VIDEO_MODELS`` (comma-separated
        names) picks models: a rerun after a timeout takes the rest."""
        chosen = [n for n in os.environ.get("PROOF_VIDEO_MODELS", "").split(",") if n]
        models = [m for m in MODELS if not chosen or m.name in chosen]
        if not self.cuda or os.environ.get("PROOF_VIDEO_META") == "1":  # CPU-only work
            self.rows.extend(meta_rows(models=models))
            self.proof.write()
        for model in models:
            try:
                self.one_model(model)
            except Exception as exc:  # one model's failure does not stop the others
                self.proof.fail(f"video {model.name}: {type(exc).__name__}: {exc}"[:2000])
            self.proof.write()  # a timeout keeps what ran
        self.l4()
        self.proof.write()

    def sizes(self, model: VideoModel) -> tuple[tuple[int, int, int], ...]:
        return model.sizes if not self.proof.quick else (model.tiny_size,)

    def config(self, model: VideoModel) -> dict[str, Any]:
        if not self.proof.quick:
            return model.config
        return dict(family(model.family).synthetic[model.tiny].config)

    def one_model(self, model: VideoModel) -> None:
        t0 = time.perf_counter()
        reference = self.build_reference(model)
        mode = modes.Mode(self.dtype)
        fast = modes.build(reference, self.device, mode)
        instrument(fast.stages())
        served = _served(model, reference, fast, self.device, mode)
        print(f"  {model.name}: built in {time.perf_counter() - t0:.1f} s", flush=True)
        chosen, size = steps(), self.sizes(model)[0]
        for each in self.sizes(model) if "service" in chosen else ():
            self.service(model, served, each)
            self.proof.write()
        if "parity" in chosen:
            self.parity(model, reference, fast, size)
        if "kernels" in chosen:
            self.kernels(model, fast, size)
        if "layout" in chosen:
            self.layout(model, served, size)
        if "choices" in chosen:
            self.choices(model, served, size)
        del reference  # the float32 copy: only the served one stays for the L4 pass
        served.reference = fast
        _empty(self.device)
        for each in self.sizes(model) if "diffusers" in chosen else ():
            self.diffusers(model, fast, each)
            self.proof.write()
        self.resident[model.name] = served

    def build_reference(self, model: VideoModel) -> Any:
        """The float32 model, built on the device with the family's seeded weights."""
        part = family(model.family).decoder
        with torch.device(self.device):
            decoder = part.module(dict(self.config(model)))
        part.init_synthetic(decoder, torch.Generator().manual_seed(0))
        return decoder.eval().requires_grad_(False)

    def latent(self, decoder: Any, size, frames: int | None = None) -> torch.Tensor:
        shape = latent_shape(decoder, *size)
        if frames is not None:
            shape = (*shape[:2], min(frames, shape[2]), *shape[3:])
        return torch.randn(shape, generator=torch.Generator().manual_seed(1))

    # --- as served ---------------------------------------------------------------------
    def service(self, model: VideoModel, served: Any, size, runner: Runner | None = None,
                runs: tuple[str, ...] = ("cold", "warm"), budget: int | None = None) -> None:  # fmt: skip
        runner = runner or Runner(Metrics())
        decoder = served.active
        z = self.latent(decoder, size)
        estimate = decoder.working_bytes(tuple(z.shape), _element_size(decoder))
        for run in runs:
            _empty(self.device)
            base = _allocated(self.device)
            _reset_peak(self.device)
            before = dict(_retries(runner.metrics))
            timer = PhaseTimer()
            fields: dict[str, Any] = {"run": run, "estimate_mib": mib(estimate)}
            t0 = time.perf_counter()
            try:
                rung, _ = planned_rung(runner, decoder, tuple(z.shape))
                if rung == "refused":
                    raise OutOfMemory("planned refused")
                with _StagePeaks(decoder, self.device, base) as stages:
                    out = runner.decode(served, DecodeRequest(z), timer)
                    devices.synchronize(self.device)
                fields["stage_peaks"] = stages.peaks
                fields.update(ok=True, output=list(out.shape), dtype=str(out.dtype)[6:])
                del out
            except Exception as exc:
                rung = "refused" if isinstance(exc, OutOfMemory) else "error"
                fields.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            retries = {k: v - before.get(k, 0) for k, v in _retries(runner.metrics).items()}
            retries = {k: v for k, v in retries.items() if v}
            if retries:
                rung = "tiled" if "tiled" in retries else "split"
            fields.update(
                ms=round((time.perf_counter() - t0) * 1000, 1), rung=rung, retries=retries,
                peak_mib=mib(_peak_above(self.device, base)), reserved_mib=mib(_reserved(self.device)),
                phases_ms={k: round(v * 1000, 2) for k, v in timer.phases().items()},
                budget_mib=mib(budget),
            )  # fmt: skip
            self.rows.append(row(model, size, self.device.type, "service", **fields))
            print(f"  {model.name} {size} service {run}: {fields['ms']} ms, rung {rung}, "
                  f"peak {fields['peak_mib']} MiB {fields.get('error', '')}", flush=True)  # fmt: skip
            if fields.get("stage_peaks"):
                print(f"    peak set in: {fields['stage_peaks']}", flush=True)

    # --- diffusers on the same card ------------------------------------------------------
    def diffusers(self, model: VideoModel, fast: Any, size) -> None:
        try:
            peer = build_peer(model, self.config(model), fast, self.device, self.dtype)
        except Exception as exc:
            self.proof.note(f"video {model.name}: no diffusers peer: {type(exc).__name__}: {exc}")
            return
        self.peer_agrees(model, peer, fast, size)
        z = self.latent(fast, size).to(self.device, self.dtype)
        for layout in ("NCDHW", "channels_last_3d"):
            modes.set_conv3d_layout(peer, layout)
            fields = self.time_peer(peer, model, z)
            variant = f"diffusers{' tiled' if fields.pop('tiled') else ''} {layout}"
            self.rows.append(row(model, size, self.device.type, variant, **fields))
            print(f"  {model.name} {size} {variant}: {fields}", flush=True)
        del peer
        _empty(self.device)

    def peer_agrees(self, model: VideoModel, peer: Any, fast: Any, size) -> None:
        """The peer decodes what the service does (3 latent frames): its timings compare."""
        z = self.latent(fast, size, frames=3).to(self.device)
        with torch.inference_mode():
            ours = fast.decode(z).float()
            theirs = _peer_call(peer, model, self.config(model))(z.to(self.dtype)).float()
        cos = ops.cosine(ours, theirs) if ours.shape == theirs.shape else None
        self.proof.report.setdefault("video_peer_cos", []).append(
            {"family": model.name, "latent": list(z.shape), "cos": cos}
        )
        print(f"  {model.name} diffusers vs service: cos {cos}", flush=True)
        if cos is None or cos < 0.999:
            self.proof.note(f"video {model.name}: diffusers peer disagrees (cos {cos})")

    def time_peer(self, peer: Any, model: VideoModel, z: torch.Tensor) -> dict[str, Any]:
        call = _peer_call(peer, model, self.config(model))
        for tiled in (False, True):
            if tiled:
                if not hasattr(peer, "enable_tiling"):
                    break
                peer.enable_tiling()
            try:
                _empty(self.device)
                base = _allocated(self.device)
                _reset_peak(self.device)
                with torch.inference_mode():
                    ms = _timed_ms(lambda: call(z), self.device)
                peak = _peak_above(self.device, base)
                return {"ms": round(ms, 1), "peak_mib": mib(peak), "tiled": tiled, "ok": True}
            except Exception as exc:
                if not devices.is_oom(exc):
                    raise
        return {"ok": False, "error": "out of memory, tiled too", "tiled": True}

    # --- the served bf16 against float32 at full resolution -------------------------------
    def parity(self, model: VideoModel, reference: Any, fast: Any, size) -> None:
        z = self.latent(fast, size, frames=3).to(self.device)
        tf32 = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False  # the reference convs in true float32
        try:
            with torch.inference_mode():
                want = reference.decode(z.float()).float()
        finally:
            torch.backends.cudnn.allow_tf32 = tf32
        with torch.inference_mode():
            got = fast.decode(z).float()
        mse = float((want - got).double().square().mean())
        psnr = 10 * math.log10(4.0 / mse) if mse > 0 else None  # signed range [-1, 1]
        cos = ops.cosine(want, got)
        passed = cos >= PARITY_COSINE
        entry = {"family": model.name, "frames": size[0], "height": size[1], "width": size[2],
                 "latent": list(z.shape), "dtype": str(self.dtype)[6:], "cos": cos,
                 "psnr_db": psnr, "passed": passed}  # fmt: skip
        self.proof.report["video_parity"].append(entry)
        print(f"  {model.name} parity: cos {cos:.7f} psnr {psnr}", flush=True)
        if not passed:
            self.proof.fail(f"video parity {model.name}: cosine {cos:.6f} < {PARITY_COSINE}")
        del want, got

    # --- kernels of one warm chunk ---------------------------------------------------------
    def kernels(self, model: VideoModel, fast: Any, size) -> None:
        z = self.latent(fast, size, frames=2).to(self.device)
        profile = self.kernel_profile(lambda x: fast.decode(x), z, top=100_000)
        names = [t["name"] for t in profile["top"]]  # every kernel that ran
        slow = sorted({n for n in names if any(k in n.lower() for k in SLOW_KERNELS)})
        profile["top"] = profile["top"][:10]
        entry = {"family": model.name, "latent": list(z.shape), "slow_kernels": slow, **profile}
        self.proof.report["video_kernels"].append(entry)
        print(f"  {model.name} kernels: {profile['by_kind_ms']} slow: {slow}", flush=True)
        if slow and self.cuda:  # the CPU's aten conv3d may be slow_conv3d: not the target
            self.proof.fail(f"video kernels {model.name}: slow conv kernels ran: {slow}")

    # --- the GPU 3-D conv layout ------------------------------------------------------------
    def layout(self, model: VideoModel, served: Any, size) -> None:
        fast = served.fast
        if not any(p.ndim == 5 for p in fast.parameters()):
            return  # no 3-D conv weights: no layout to choose
        z = self.latent(fast, size).to(self.device)
        chosen = family(model.family).gpu_conv3d_layout
        for layout in modes.CONV3D_LAYOUTS:
            modes.set_conv3d_layout(fast, layout)
            with torch.inference_mode():
                fast.decode(z)  # cuDNN's search for this layout's shapes
                ms = _timed_ms(lambda: fast.decode(z), self.device)
            entry = {"family": model.name, "conv_family": model.family, "layout": layout,
                     "ms": round(ms, 1), "served": layout == chosen}  # fmt: skip
            self.proof.report["video_layout"].append(entry)
            print(f"  {model.name} layout {layout}: {ms:.1f} ms", flush=True)
        modes.set_conv3d_layout(fast, chosen)

    # --- device-aware choices (issue 23.7) -------------------------------------------------
    def choices(self, model: VideoModel, served: Any, size) -> None:
        fast = served.fast
        z = self.latent(fast, size).to(self.device)
        for name, value, options, patch in _candidates(model, fast, self.device):
            with patch(), torch.inference_mode():
                _empty(self.device)
                base = _allocated(self.device)
                _reset_peak(self.device)
                try:
                    fast.decode(z, **options)
                    ms = _timed_ms(lambda o=options: fast.decode(z, **o), self.device)
                    entry = {"ms": round(ms, 1), "peak_mib": mib(_peak_above(self.device, base))}
                except Exception as exc:
                    if not devices.is_oom(exc):
                        raise
                    entry = {"ms": None, "error": "out of memory"}
            entry.update(family=model.name, choice=name, value=value,
                         served=value == _served_value(name, model.family, self.device))  # fmt: skip
            self.proof.report["video_choices"].append(entry)
            print(f"  {model.name} choice {name}={value}: {entry}", flush=True)

    # --- an L4 emulated, every model resident ------------------------------------------------
    def l4(self) -> None:
        if not self.resident or "l4" not in steps():
            return
        if not self.cuda:  # the meta rows hold the CPU's answer under the same budget
            self.proof.note("video l4: the meta rows plan every size under 21.5 GiB")
            return
        devices.prepare(self.device, L4_BYTES)
        runner = Runner(Metrics(), "off", L4_BYTES)
        try:
            for model in MODELS:
                served = self.resident.get(model.name)
                for size in model.sizes if served else ():
                    self.service(model, served, size, runner, ("l4",), L4_BYTES)
                    last = self.rows[-1]
                    if not last.get("ok") or last["rung"] == "refused":
                        self.proof.fail(f"video l4 {model.name} {size}: {last.get('error')}")
                    self.proof.write()
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)


# --- candidates of the device-aware choices ----------------------------------------------------


def _candidates(model: VideoModel, fast: Any, device: torch.device):
    """(choice, value, decode options, context patch) to measure for ``model`` on ``device``."""
    import contextlib

    from app.families.ltx.decoder import decode as ltx_decode
    from app.families.minimax_h3.decoder import decode as mm_decode
    from app.families.wan.decoder import decode as wan_decode

    none = contextlib.nullcontext
    if model.family == "ltx":
        for c in ltx_decode.GPU_CHUNK_CANDIDATES:
            yield "chunk_frames", c, {"chunk_frames": c}, none
    elif model.family == "wan":
        for c in wan_decode.GPU_CHUNK_CANDIDATES:
            yield "chunk_frames", c, {"chunk_frames": c}, none
        for upcast in (True, False):
            yield "rmsnorm_float32", upcast, {}, lambda u=upcast: _wan_rmsnorm_upcast(u)
    elif model.family == "minimax-h3":
        for n in mm_decode.GPU_BATCH_TOKEN_CANDIDATES:
            yield "max_batch_tokens", n, {"max_batch_tokens": n}, none


def _served_value(choice: str, family: str, device: torch.device) -> Any:
    """What ``family`` serves on ``device`` for ``choice`` today."""
    from app.families.ltx.decoder import decode as ltx_decode
    from app.families.minimax_h3.decoder import decode as mm_decode
    from app.families.wan.decoder import decode as wan_decode

    if choice == "chunk_frames":
        return (wan_decode if family == "wan" else ltx_decode).chunk_frames_for(device)
    return {"max_batch_tokens": mm_decode.batch_tokens_for(device),
            "rmsnorm_float32": True}.get(choice)  # fmt: skip


class _wan_rmsnorm_upcast:
    """Wan's RMSNorm with (the served) or without its float32 upcast, for one measurement."""

    def __init__(self, upcast: bool) -> None:
        self.upcast = upcast

    def __enter__(self) -> None:
        from app.families.wan.decoder import model as wan_model

        self.cls, self.saved = wan_model.RMSNorm, wan_model.RMSNorm.forward
        if not self.upcast:
            self.cls.forward = lambda m, x: (
                torch.nn.functional.normalize(x, dim=1) * m.scale * m.gamma
            )

    def __exit__(self, *exc: object) -> None:
        self.cls.forward = self.saved


def flux_band_rows(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    """FLUX's banded decode (the out-of-memory retry) at each band-size candidate."""
    from app.families.flux.decoder import decode as flux_decode
    from app.families.flux.decoder import fast as flux_fast
    from bench import flux as flux_bench

    ours, _ = flux_bench.build() if not quick else (None, None)
    if ours is None:
        part = family("flux").decoder
        ours = part.module(_tiny_flux())
        part.init_synthetic(ours, torch.Generator().manual_seed(0))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fast = modes.build(ours, device, modes.Mode(dtype))
    size = 128 if quick else 1024  # 2048^2 takes ~7 s a decode: too long for 6 runs
    z = torch.randn(1, ours.latent_channels, size // 8, size // 8, device=device)
    rows = []
    for band in flux_decode.GPU_BAND_BYTES_CANDIDATES:
        with torch.inference_mode():
            flux_fast.decode_banded(fast, z.to(dtype), band)
            ms = _timed_ms(lambda b=band: flux_fast.decode_banded(fast, z.to(dtype), b), device)
        rows.append({"family": "flux", "choice": "band_bytes", "value": band,
                     "size": size, "ms": round(ms, 1),
                     "served": band == flux_decode.band_bytes_for(device)})  # fmt: skip
        print(f"  flux band {band >> 20} MiB at {size}^2: {ms:.1f} ms", flush=True)
    return rows


def _tiny_flux() -> dict[str, Any]:
    return {"latent_channels": 16, "block_out_channels": [16, 32, 32, 32],
            "layers_per_block": 1, "norm_num_groups": 8}  # fmt: skip


# --- diffusers peers ----------------------------------------------------------------------------


def build_peer(model: VideoModel, config: dict, ours: Any, device: torch.device, dtype):
    """diffusers' VAE of ``model`` holding ``ours``' decoder weights, on ``device``."""
    import diffusers

    cls = {
        "ltx-0.9.1": diffusers.AutoencoderKLLTXVideo,
        "ltx-2": diffusers.AutoencoderKLLTX2Video,
        "wan-2.1": diffusers.AutoencoderKLWan,
        "hunyuan-video": diffusers.AutoencoderKLHunyuanVideo,
        "minimax-h3": diffusers.AutoencoderKLMiniMaxH3,
    }[model.name]
    if model.family == "wan":
        kwargs = {"base_dim": config["decoder_base_dim"], "z_dim": config["z_dim"],
                  "dim_mult": config["dim_mult"], "num_res_blocks": config["num_res_blocks"],
                  "temperal_downsample": config["temperal_downsample"],
                  "latents_mean": config["latents_mean"], "latents_std": config["latents_std"]}  # fmt: skip
    else:
        accepted = set(inspect.signature(cls.__init__).parameters)
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()
                  if k in accepted}  # fmt: skip
    with torch.device(device):
        peer = cls(**kwargs)
    state = {k: v for k, v in ours.state_dict().items()}
    if model.family in ("ltx",):
        peer.decoder.load_state_dict(state, strict=True)
    else:
        prefixed = {(k if k.startswith("post_quant") else f"decoder.{k}"): v
                    for k, v in state.items()}  # fmt: skip
        if model.family == "minimax-h3":
            prefixed = {k: v for k, v in state.items()}
        missing, unexpected = peer.load_state_dict(prefixed, strict=False)
        decoder_missing = [k for k in missing if k.startswith(("decoder.", "post_quant"))]
        if unexpected or decoder_missing:
            raise RuntimeError(f"weights do not map: {unexpected[:3]} {decoder_missing[:3]}")
    for name in ("encoder", "quant_conv"):
        if hasattr(peer, name):
            delattr(peer, name)
    return peer.to(dtype).eval().requires_grad_(False)


def _peer_call(peer: Any, model: VideoModel, config: dict) -> Callable[[torch.Tensor], Any]:
    if model.family == "ltx" and config.get("timestep_conditioning"):
        t = float(config.get("decode_timestep") or 0.0)

        def call(z: torch.Tensor) -> Any:
            temb = torch.full((z.shape[0],), t, device=z.device, dtype=z.dtype)
            torch.manual_seed(0)
            return peer.decode(z, temb).sample

        return call
    return lambda z: peer.decode(z).sample


# --- helpers -------------------------------------------------------------------------------


def _served(model: VideoModel, reference: Any, fast: Any, device, mode) -> Any:
    from app.runtime.parts import ServedPart

    manifest = Manifest(model.name, model.family, reference.config, "float32", "proof", "")
    return ServedPart(model.name, manifest, reference, fast, device, mode, gate.EXACT_REPORT,
                       False)  # fmt: skip


def _timed_ms(fn: Callable[[], Any], device: torch.device, repeats: int = 1) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _element_size(decoder: Any) -> int:
    return next(decoder.parameters()).element_size()


class _StagePeaks:
    """Where one decode's peak memory is set, on a GPU: each stage (``decoder.stages()``) that
    raised the running peak, with that peak and the memory live when it started (MiB above
    ``base``; ``between stages`` for a rise outside them: assembly, blending, postprocess).
    Empty elsewhere. It says which part of the estimate misses on a GPU (docs/decoders.md)."""

    def __init__(self, decoder: Any, device: torch.device, base: int) -> None:
        self.device, self.base = device, base
        self.stages = decoder.stages() if device.type == "cuda" else []
        self.peaks: dict[str, dict[str, int]] = {}
        self.handles: list[Any] = []
        self.top, self.live = 0, 0  # the running peak and the live memory at the last check

    def __enter__(self) -> _StagePeaks:
        for name, module in self.stages:
            self.handles += [
                module.register_forward_pre_hook(lambda m, a: self._check("between stages")),
                module.register_forward_hook(lambda m, a, o, n=name: self._check(n)),
            ]
        if self.stages:
            self.top, self.live = torch.cuda.max_memory_allocated(self.device), self.base
        return self

    def _check(self, name: str) -> None:
        """Attribute a rise of the running peak since the last check to ``name``."""
        peak = torch.cuda.max_memory_allocated(self.device)
        if peak > self.top:
            entry = self.peaks.setdefault(name, {"peak_mib": 0, "live_at_start_mib": 0})
            entry["peak_mib"] = max(entry["peak_mib"], mib(peak - self.base) or 0)
            live = mib(self.live - self.base) or 0
            entry["live_at_start_mib"] = max(entry["live_at_start_mib"], live)
        self.top, self.live = max(peak, self.top), _allocated(self.device)

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        if self.stages:
            self._check("between stages")


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _reserved(device: torch.device) -> int | None:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_above(device: torch.device, base: int) -> int | None:
    """Peak allocated bytes since the last reset above ``base``; None on the CPU."""
    return torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None


def _empty(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _retries(metrics: Metrics) -> dict[str, float]:
    out = {}
    for metric in metrics.retries_total.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                out[sample.labels["path"]] = sample.value
    return out
