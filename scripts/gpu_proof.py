"""The GPU proof: one run that shows the service's GPU path works, and how fast it is.

    python scripts/gpu_proof.py [--device cuda|cpu] [--quick] [--out DIR] [--only SECTION ...]
                                [--models NAME ...]

Sections (each one's failure is recorded and the run goes on; results are written after
every section, so a run cut short still leaves its report):
  gate     every family's embedded models (the descriptors' ``synthetic`` recipes, baked or
           not) gated on the device, each mode, every served way (--models: only the named
           ones; ``one_per_family``: each family's cheapest, the CPU test's choice)
  flux     FLUX.1 decode time and peak memory: the service as served vs diffusers (bf16,
           NCHW and channels_last) on the same device, same weights, CUDA events
  e2e      the real HTTP service: PNG requests (Server-Timing vs client wall time) and
           LTX MP4s read back by ffmpeg
  ladder   a forced out-of-memory and the rungs that answered it
  l4       an L4's memory emulated on this card: which sizes and batches decode, and how
  graphs   a captured CUDA graph of the served FLUX decode vs eager launches
  compile  torch.compile of the served FLUX decode: compile time, speed, cosine vs eager
  profile  the compiled FLUX 1024^2 decode kernel by kernel (NCHW and channels_last), against
           its FLOPs and the card's bf16 GEMM rate
  video    every video family at its real size (scripts/video_proof.py): as served vs
           diffusers, kernels, bf16 parity, layouts, device-aware choices, an emulated L4, and
           an HTTP MP4 of LTX 121x512x768 from a server pinned to 6 cores; on any machine the
           real sizes' estimates, live peaks and planned rungs on the meta device
Writes gpu_proof.json ({"device", "gate", "flux", "e2e", "ladder", "l4", "ok", ...}) and
gpu_proof.md to --out (default $OUT, else /tmp/gpu_proof). Exits 1 on a gate failure, a
request error, an ungated served path or a section that failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import requests
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.families import families, family  # noqa: E402
from app.families.descriptor import Part  # noqa: E402
from app.protocol.request import DecodeRequest  # noqa: E402
from app.runtime import device as devices  # noqa: E402
from app.runtime import gate, modes  # noqa: E402
from app.runtime.runner import Runner  # noqa: E402
from app.telemetry.metrics import Metrics  # noqa: E402
from app.telemetry.timing import PhaseTimer  # noqa: E402
from bench import common  # noqa: E402

# the quick run's image model: the same tiny FLUX as tests/live.py's "flux-tiny" (scripts
# import nothing from tests/), its row bands of 1 MiB as there (a cheap tiled probe)
TINY_FLUX = {
    "flux-tiny": {
        "latent_channels": 16,
        "block_out_channels": [16, 32, 32, 32],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "band_mb": 1,
    }
}


def bake(store: Path, key: str, name: str, config: dict, seed: int = 0) -> None:
    """Write one seeded model into a store, as ``python -m app bake`` would."""
    from app.store import write_model

    decoder = seeded(family(key).decoder, config, seed)
    write_model(store, name, key, config, decoder.state_dict(), source="test", dtype="float32")


def seeded(part: Part, config: dict, seed: int = 0) -> torch.nn.Module:
    """A family's part of ``config`` with its seeded trained-like weights, frozen."""
    module = part.module(dict(config))
    part.init_synthetic(module, torch.Generator().manual_seed(seed))
    return module.eval().requires_grad_(False)


def embedded_models(quick: bool) -> list[tuple[str, str, dict]]:
    """(family, name, config) of every family's embedded model (its descriptor's ``synthetic``
    recipes, baked or not: taesd's seeded one is only for the proofs); a quick run swaps the
    full-size FLUX.1 for a tiny one (minutes of float32 CPU decoding otherwise)."""
    out = []
    for key, described in families().items():
        for name, recipe in described.synthetic.items():
            config = recipe.config
            if quick and name == "flux1-synthetic":
                name, config = "flux-tiny", TINY_FLUX["flux-tiny"]
            out.append((key, name, dict(config)))
    return out


def one_per_family(quick: bool) -> list[str]:
    """Each family's embedded model whose gate probe decodes in the fewest FLOPs: one gated
    model per family, what a CPU run of the proof checks the script and its report with."""
    cheapest: dict[str, tuple[int, str]] = {}
    for key, name, config in embedded_models(quick):
        flops = probe_flops(family(key).decoder, config)
        if key not in cheapest or flops < cheapest[key][0]:
            cheapest[key] = (flops, name)
    return [name for _, name in cheapest.values()]


def probe_flops(part: Part, config: dict) -> int:
    """FLOPs of one decode of the gate's probe latent, counted on the meta device (no weights,
    no arithmetic: a fraction of a second a model)."""
    with torch.device("meta"):
        decoder = part.module(dict(config))
    shape = tuple(decoder.probe_latent(torch.Generator().manual_seed(gate.PROBE_SEED)).shape)
    return common.count_flops(lambda: decoder.decode(torch.empty(shape, device="meta")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


L4_MEMORY_GB = 22.0  # what an L4's 24 GB leaves a process after the CUDA context


def _flux_bench():
    """bench/flux.py (diffusers, the FLUX peer): imported by the sections that use it only,
    so a gate-only run does not pay its import."""
    from bench import flux

    return flux


def _video_proof():
    """scripts/video_proof.py: imported by the video section only (diffusers, dynamo)."""
    from scripts import video_proof

    return video_proof


class Proof:
    def __init__(
        self, device: torch.device, quick: bool, out: Path, models: list[str] | None = None
    ) -> None:
        self.device, self.quick, self.out = device, quick, out
        self.models = models  # the gate's embedded models by name (None: all)
        self.report: dict = {
            "device": _device_name(device),
            "machine": common.machine(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "quick": quick,
            # the CPU's bf16 measured here (timed, so it can differ from another process's)
            "cpu_offers_bf16": devices.cpu_offers_bf16() if device.type == "cpu" else None,
            "gate": [],
            "flux": [],
            "e2e": [],
            "ladder": [],
            "l4": [],
            "notes": [],
            "errors": [],
            "ok": True,
        }

    def section(self, name: str, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            fn()
        except Exception:
            self.fail(f"{name}: {traceback.format_exc(limit=6)}")
        print(f"== {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
        self.write()

    def fail(self, message: str) -> None:
        print("FAIL", message, flush=True)
        self.report["errors"].append(message)
        self.report["ok"] = False

    def note(self, message: str) -> None:
        print("note:", message, flush=True)
        self.report["notes"].append(message)

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_proof.json").write_text(json.dumps(self.report, indent=1) + "\n")
        (self.out / "gpu_proof.md").write_text(markdown(self.report))

    # --- gate -----------------------------------------------------------------------------
    def gate(self) -> None:
        """Every embedded model, every candidate mode on this device, every served way."""
        for key, name, config in self._models():
            reference = seeded(family(key).decoder, config)
            probes = gate.probes_for(reference)
            for mode in self._gate_modes():
                self._gate_one(name, key, reference, probes, mode)

    def _models(self) -> list[tuple[str, str, dict]]:
        """The embedded models this run gates (``--models``: the named ones)."""
        models = embedded_models(self.quick)
        return [m for m in models if self.models is None or m[1] in self.models]

    def _gate_modes(self) -> list[modes.Mode]:
        if self.device.type == "cuda":
            return [modes.Mode(torch.bfloat16), modes.Mode(torch.float32)]
        # the exact path is the reference itself: nothing to gate
        return [m for m in modes.candidate_modes("auto", self.device) if m != modes.EXACT]

    def _gate_one(self, name, family, reference, probes, mode) -> None:
        t0 = time.perf_counter()
        fast = modes.build(reference, self.device, mode)
        result = gate.run(fast, probes)
        expected = {"batch1", "batch2", "denormalized"} | (
            {"tiled"} if reference.supports_tiling else set()
        )
        checked = {c.name for c in result.checks}
        row = {
            "model": name,
            "family": family,
            "dtype": str(mode.dtype).removeprefix("torch."),
            "cos": result.cosine,
            "psnr_db": _finite(result.psnr_db),
            "passed": result.passed(0.9999),
            "checks": result.describe(),
            "seconds": round(time.perf_counter() - t0, 2),
        }
        self.report["gate"].append(row)
        print(f"  {name} {mode}: cos {result.cosine:.7f} psnr {result.psnr_db:.1f} dB", flush=True)
        if not expected <= checked:
            self.fail(f"gate: {name} {mode}: served ways not gated: {expected - checked}")
        if not row["passed"]:
            self.fail(f"gate: {name} {mode}: cosine {result.cosine:.6f} < 0.9999")
        del fast
        _empty(self.device)

    # --- FLUX speed -----------------------------------------------------------------------
    def flux(self) -> None:
        ours, peer = _flux_bench().build()
        cases = (
            [(256, 1)]
            if self.quick and self.device.type == "cpu"
            else [(512, 1), (1024, 1), (1024, 4)]
        )
        repeats = 1 if self.device.type == "cpu" else 10
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        variants = {
            "service": lambda: _service(ours, self.device, modes.Mode(dtype)),
            "diffusers NCHW": lambda: _diffusers(peer, self.device, dtype, False),
            "diffusers channels_last": lambda: _diffusers(peer, self.device, dtype, True),
        }
        if self.device.type == "cuda":  # what the served mode's choices are worth here
            variants["service exact modules"] = lambda: _service(
                ours, self.device, modes.Mode(dtype, optimized=False)
            )
            variants["service channels_last"] = lambda: _service(
                ours, self.device, modes.Mode(dtype), channels_last=True
            )
        for variant, make in variants.items():
            decode = make()
            for size, batch in cases:
                z = torch.randn(
                    batch, 16, size // 8, size // 8, generator=torch.Generator().manual_seed(1)
                )
                row = self._time(decode, z, repeats)
                row.update(size=size, batch=batch, variant=f"{variant} {str(dtype)[6:]}")
                self.report["flux"].append(row)
                print(
                    f"  {row['variant']} {size}^2 x{batch}: {row['ms']:.1f} ms, peak {row['peak_mib']} MiB",
                    flush=True,
                )
            del decode
            _empty(self.device)
        self._ratios()

    def _time(self, decode, z: torch.Tensor, repeats: int) -> dict:
        z = z.to(self.device)
        with torch.inference_mode():
            for _ in range(1 if self.device.type == "cpu" else 3):
                decode(z)
            devices.synchronize(self.device)
            base = _allocated(self.device)
            _reset_peak(self.device)
            times = []
            for _ in range(repeats):
                times.append(_timed(decode, z, self.device))
            peak = _peak(self.device) - base
        return {"ms": statistics.median(times) * 1000, "peak_mib": round(peak / 2**20)}

    def _ratios(self) -> None:
        rows = self.report["flux"]
        for row in rows:
            if not row["variant"].startswith("service"):
                continue
            peers = [
                r["ms"]
                for r in rows
                if "diffusers" in r["variant"]
                and (r["size"], r["batch"]) == (row["size"], row["batch"])
            ]
            if peers:
                row["vs_diffusers_best"] = round(min(peers) / row["ms"], 3)

    # --- end to end -----------------------------------------------------------------------
    def e2e(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            store = Path(tmp) / "models"
            image_model = "flux-tiny" if self.quick else "flux1-synthetic"
            only = ["ltx-tiny"] + ([] if self.quick else [image_model])
            bake_cmd = [sys.executable, "-m", "app", "bake", "--synthetic"]
            _run([*bake_cmd, "--models-dir", str(store), "--only", *only])
            if self.quick:
                bake(store, "flux", image_model, TINY_FLUX[image_model])
            size = 256 if self.quick else 1024
            env = {
                "VAE_DEVICE": self.device.type,
                "VAE_WARMUP_SHAPES": f"1x16x{size // 8}x{size // 8}",
            }
            server = _server(store, Path(tmp) / "serve.log", env)
            with server as url:
                for line in server.startup_lines():
                    self.note(f"service: {line.split(' INFO ')[-1]}")
                self._png_requests(url, image_model, size, 3 if self.quick else 20)
                self._mp4_requests(url, Path(tmp), 2 if self.quick else 5)
                self.report["models"] = requests.get(f"{url}/models", timeout=10).json()["models"]

    def _png_requests(self, url: str, model: str, size: int, count: int) -> None:
        rng = np.random.default_rng(0)
        for i in range(count):
            z = rng.standard_normal((1, 16, size // 8, size // 8), dtype=np.float32)
            t0 = time.perf_counter()
            r = requests.post(
                f"{url}/decode/{model}",
                params={"shape": json.dumps(list(z.shape)), "dtype": "float32"},
                data=z.tobytes(),
                headers={"Content-Type": "tensor/binary", "Accept": "image/png"},
                timeout=300,
            )
            wall = (time.perf_counter() - t0) * 1000
            if r.status_code != 200 or r.content[:8] != b"\x89PNG\r\n\x1a\n":
                self.fail(f"e2e png {i}: {r.status_code} {r.text[:300]}")
                continue
            phases = _server_timing(r.headers.get("server-timing", ""))
            self.report["e2e"].append(
                {"output": "png", "size": size, "ms_total": wall, "phases": phases}
            )
        self._encode_share("png")

    def _mp4_requests(self, url: str, tmp: Path, count: int) -> None:
        import imageio_ffmpeg

        rng = np.random.default_rng(1)
        for i in range(count):
            z = rng.standard_normal((1, 128, 5, 8, 8), dtype=np.float32)  # 33 frames, 256^2
            t0 = time.perf_counter()
            r = requests.post(
                f"{url}/decode/ltx-tiny",
                params={"shape": json.dumps(list(z.shape)), "output_type": "mp4"},
                data=z.tobytes(),
                headers={"Content-Type": "tensor/binary"},
                timeout=300,
            )
            wall = (time.perf_counter() - t0) * 1000
            path = tmp / f"ltx{i}.mp4"
            path.write_bytes(r.content)
            frames = 0
            if r.status_code == 200:
                frames, _ = imageio_ffmpeg.count_frames_and_secs(str(path))
            if r.status_code != 200 or frames != 33:
                self.fail(f"e2e mp4 {i}: {r.status_code}, {frames} frames: {r.text[:200]}")
                continue
            phases = _server_timing(r.headers.get("server-timing", ""))
            self.report["e2e"].append(
                {"output": "mp4", "frames": frames, "ms_total": wall, "phases": phases}
            )

    def _encode_share(self, output: str) -> None:
        rows = [r for r in self.report["e2e"] if r["output"] == output]
        if not rows:
            return
        encode = statistics.median(r["phases"].get("encode", 0.0) for r in rows)
        decode = statistics.median(_decode_ms(r["phases"]) for r in rows)
        total = statistics.median(r["ms_total"] for r in rows)
        self.note(
            f"{output}: median client wall {total:.1f} ms, decode {decode:.1f} ms, "
            f"encode {encode:.1f} ms ({100 * encode / max(total, 1e-9):.0f}% of the request)"
        )

    # --- out of memory --------------------------------------------------------------------
    def ladder(self) -> None:
        """A real out-of-memory: the estimate is told everything fits, the card's memory is
        capped, and a large batch is decoded; the rungs that answered are recorded."""
        if self.device.type != "cuda":
            self.note("ladder: needs a CUDA device (the CPU tests inject out-of-memory instead)")
            return
        served, runner, metrics = self._served_flux(memory_cap=0)
        served.fast.working_bytes = lambda *args, **kwargs: 1  # it fits, says the estimate
        devices.prepare(self.device, int(8 * 2**30))  # an 8 GB card
        try:
            for size, batch in [(2048, 4), (2048, 1)]:
                self.report["ladder"].append(self._decode_row(served, runner, metrics, size, batch))
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)
            del served.fast.working_bytes  # the class's own estimate again

    def l4(self) -> None:
        """An L4's memory on this card: the budget check plans every decode."""
        if self.device.type != "cuda":
            self.note("l4: needs a CUDA device")
            return
        cap = int(L4_MEMORY_GB * 2**30)
        served, runner, metrics = self._served_flux(memory_cap=cap)
        devices.prepare(self.device, cap)
        try:
            for size, batch in [(1024, 1), (1024, 4), (1024, 8), (2048, 1), (2048, 2)]:
                self.report["l4"].append(self._decode_row(served, runner, metrics, size, batch))
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)

    def _served_flux(self, memory_cap: int):
        from app.runtime.parts import ServedPart
        from app.store import Manifest

        ours, _ = _flux_bench().build()
        fast = modes.build(ours, self.device, modes.Mode(torch.bfloat16))
        manifest = Manifest("flux1-synthetic", "flux", ours.config, "float32", "proof", "")
        served = ServedPart(
            "flux1-synthetic", manifest, ours, fast, self.device, modes.Mode(torch.bfloat16),
            gate.EXACT_REPORT, False,
        )  # fmt: skip
        metrics = Metrics()
        return served, Runner(metrics, "off", memory_cap), metrics

    def _decode_row(self, served, runner: Runner, metrics: Metrics, size: int, batch: int) -> dict:
        _empty(self.device)
        _reset_peak(self.device)
        z = torch.randn(batch, 16, size // 8, size // 8)
        timer = PhaseTimer()
        row = {"size": size, "batch": batch}
        t0 = time.perf_counter()
        try:
            out = runner.decode(served, DecodeRequest(z), timer)
            row.update(ok=True, shape=list(out.shape))
        except Exception as exc:
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
        row["ms"] = (time.perf_counter() - t0) * 1000
        row["peak_mib"] = round(_peak(self.device) / 2**20)
        row["retries"] = _retries(metrics)
        row["phases_ms"] = {k: round(v * 1000, 2) for k, v in timer.phases().items()}
        print(f"  {size}^2 x{batch}: {row}", flush=True)
        return row

    # --- CUDA graphs ------------------------------------------------------------------------
    def graphs(self) -> None:
        """Is a captured CUDA graph of the served FLUX decode faster than eager launches?"""
        if self.device.type != "cuda":
            self.note("graphs: needs a CUDA device")
            return
        ours, _ = _flux_bench().build()
        fast = modes.build(ours, self.device, modes.Mode(torch.bfloat16))
        for size in (512, 1024):
            static = torch.randn(1, 16, size // 8, size // 8, device=self.device)
            with torch.inference_mode():
                eager = self._time(lambda z: fast.decode(z, tiled=False), static, 10)["ms"]
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(3):
                        fast.decode(static, tiled=False)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = fast.decode(static, tiled=False)
                replay = self._time(lambda z, run=graph.replay: run(), static, 10)["ms"]
                same = torch.equal(static_out, fast.decode(static, tiled=False))
            row = {"size": size, "eager_ms": eager, "graph_ms": replay, "identical": same}
            self.report.setdefault("graphs", []).append(row)
            print(f"  graphs {row}", flush=True)
            del graph, static_out

    # --- torch.compile --------------------------------------------------------------------
    def compile(self) -> None:
        """torch.compile of the served FLUX decode (inductor fuses GroupNorm + SiLU): its
        compile time, speed and whether it still matches the eager output."""
        if self.device.type != "cuda":
            self.note("compile: evaluated on a CUDA device only")
            return
        ours, _ = _flux_bench().build()
        fast = modes.build(ours, self.device, modes.Mode(torch.bfloat16))
        compiled = torch.compile(lambda z: fast.decode(z, tiled=False))
        for size in (512, 1024):
            z = torch.randn(1, 16, size // 8, size // 8, device=self.device)
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = compiled(z)
                devices.synchronize(self.device)
                compile_s = time.perf_counter() - t0
                eager = fast.decode(z, tiled=False)
                cos = float(
                    torch.nn.functional.cosine_similarity(
                        out.double().flatten(), eager.double().flatten(), 0
                    )
                )
                ms = self._time(compiled, z, 10)["ms"]
            row = {"size": size, "compiled_ms": ms, "first_call_s": compile_s, "cos_vs_eager": cos}
            self.report.setdefault("compile", []).append(row)
            print(f"  compile {row}", flush=True)

    # --- profile --------------------------------------------------------------------------
    def profile(self) -> None:
        """Where the compiled FLUX.1 1024^2 decode spends its time, kernel by kernel, against
        the FLOPs it does and this card's measured bf16 GEMM rate; and whether channels_last
        (slower eagerly: GroupNorm) pays once inductor has fused the normalizations."""
        if self.device.type != "cuda":
            self.note("profile: needs a CUDA device")
            return
        ours, _ = _flux_bench().build()
        size = 1024
        z = torch.randn(1, 16, size // 8, size // 8, device=self.device)
        flops = common.meta_flops(ours, tuple(z.shape))
        gemm = common.gemm_rate(torch.bfloat16, self.device, n=8192)
        rows = []
        for layout in ("NCHW", "channels_last"):
            fast = modes.build(ours, self.device, modes.Mode(torch.bfloat16))
            if layout == "channels_last":
                fast = fast.to(memory_format=torch.channels_last)
            compiled = torch.compile(lambda z, m=fast: m.decode(z, tiled=False), dynamic=False)
            timed = self._time(compiled, z, 10)
            row = {"layout": layout, "ms": timed["ms"], "peak_mib": timed["peak_mib"]}
            row["tflops"] = flops / (timed["ms"] / 1000) / 1e12
            row["kernels"] = _kernel_profile(compiled, z)
            rows.append(row)
            print(
                f"  profile {layout}: {timed['ms']:.2f} ms, {row['tflops']:.0f} TFLOP/s", flush=True
            )
            del fast, compiled
            _empty(self.device)
        self.report["profile"] = {"size": size, "flops": flops, "gemm_tflops": gemm / 1e12}
        self.report["profile"]["rows"] = rows

    # --- video ----------------------------------------------------------------------------
    def video(self) -> None:
        video = _video_proof()
        chosen = video.steps()
        video.VideoSection(self, _kernel_profile).run()
        if "bands" in chosen:
            self.report["video_choices"] += video.flux_band_rows(self.device, self.quick)
            self.write()
        if "mp4" in chosen:
            self._video_mp4()

    def _video_mp4(self) -> None:
        """One MP4 of LTX 0.9.1 121x512x768 (quick: ltx-tiny, 33 frames) over HTTP from a
        server pinned to 6 cores: decode and encode (Server-Timing), wall time, frame count."""
        import imageio_ffmpeg

        cores = sorted(os.sched_getaffinity(0))[:6]
        with tempfile.TemporaryDirectory() as tmp:
            store = Path(tmp) / "models"
            if self.quick:
                name, frames, shape = "ltx-tiny", 33, (1, 128, 5, 8, 8)
                _run([sys.executable, "-m", "app", "bake", "--synthetic", "--models-dir",
                      str(store), "--only", name])  # fmt: skip
            else:
                name, frames, shape = "ltx-0.9.1-synthetic", 121, (1, 128, 16, 16, 24)
                bake(store, "ltx", name, _video_proof().CONFIG_091)
            env = {"VAE_DEVICE": self.device.type, "VAE_WARMUP_SHAPES": ""}
            pin = ["taskset", "-c", ",".join(map(str, cores))] if shutil.which("taskset") else []
            if not pin:
                self.note("video mp4: no taskset here, the server is not pinned")
            server = _server(store, Path(tmp) / "serve.log", env, prefix=pin)
            with server as url:
                z = np.random.default_rng(2).standard_normal(shape, dtype=np.float32)
                t0 = time.perf_counter()
                r = requests.post(
                    f"{url}/decode/{name}",
                    params={"shape": json.dumps(list(z.shape)), "output_type": "mp4"},
                    data=z.tobytes(), headers={"Content-Type": "tensor/binary"}, timeout=600,
                )  # fmt: skip
                wall = (time.perf_counter() - t0) * 1000
                path = Path(tmp) / "video.mp4"
                path.write_bytes(r.content)
                counted = imageio_ffmpeg.count_frames_and_secs(str(path))[0] if r.ok else 0
                time.sleep(0.5)  # the stream's phases are observed as it ends
                observed = _phase_sums(url, name)
            phases = _server_timing(r.headers.get("server-timing", ""))
            phases.setdefault("encode", observed.get("encode"))
            entry = {"model": name, "frames": counted, "expected_frames": frames,
                     "cores": len(cores), "ms_total": wall, "decode_ms": _decode_ms(phases),
                     "encode_ms": phases.get("encode"), "phases": phases,
                     "status": r.status_code}  # fmt: skip
            self.report["video_mp4"] = entry
            print(f"  video mp4: {entry}", flush=True)
            if r.status_code != 200 or counted != frames:
                self.fail(f"video mp4: {r.status_code}, {counted} frames: {r.text[:200]}")

    # --- encoder --------------------------------------------------------------------------
    def encoder(self) -> None:
        from app.media import mp4

        self.report["h264_encoder"] = mp4.h264_encoder()
        self.note(f"MP4 encoder in use: {self.report['h264_encoder']}")


# --- helpers ------------------------------------------------------------------------------


def _service(ours, device: torch.device, mode: modes.Mode, channels_last: bool = False):
    fast = modes.build(ours, device, mode)
    if channels_last:
        fast = fast.to(memory_format=torch.channels_last)
    options = {"tiled": False} if device.type == "cuda" else {}
    return lambda z: fast.decode(z, **options)


def _diffusers(peer, device: torch.device, dtype: torch.dtype, channels_last: bool):
    import copy

    model = copy.deepcopy(peer).to(device=device, dtype=dtype)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return lambda z: model.decode(z.to(dtype)).sample


def _timed(decode, z: torch.Tensor, device: torch.device) -> float:
    if device.type != "cuda":
        t0 = time.perf_counter()
        decode(z)
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    decode(z)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


KERNEL_KINDS = (  # substrings of CUDA kernel names -> what the time is spent on
    ("convolution", ("conv", "xmma", "implicit", "cudnn", "sm90", "cutlass", "gemm", "wgrad")),
    ("fused (triton)", ("triton",)),
    ("copy", ("memcpy", "copy", "memset")),
)


def _kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def _kernel_profile(decode, z: torch.Tensor, top: int = 15) -> dict:
    """Per-kernel time of one decode after a warm-up, in ms: totals by kind and the top
    kernels. CUDA kernels on a GPU; on a CPU, aten ops' self time (so it runs anywhere)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = z.device.type == "cuda"
    device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    with torch.inference_mode():
        decode(z)
        devices.synchronize(z.device)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            decode(z)
            devices.synchronize(z.device)
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == device_type:
            us = event.device_time if cuda else event.self_cpu_time_total
            kernels.setdefault(event.name, []).append(us / 1000)
    kinds: dict[str, float] = {}
    for name, times in kernels.items():
        kind = _kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + sum(times)
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "total_ms": sum(kinds.values()),
        "by_kind_ms": kinds,
        "top": [{"name": n[:120], "calls": len(t), "ms": sum(t)} for n, t in ranked],
    }


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else common.rss_bytes()


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        common.reset_peak_rss()


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return common.peak_rss_bytes()


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


def _server_timing(header: str) -> dict[str, float]:
    phases = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            phases[name] = float(dur)
    return phases


def _phase_sums(url: str, model: str) -> dict[str, float]:
    """ms per phase of ``model``'s requests so far, from the service's /metrics (a streamed
    MP4's encode time is known only once its stream ends: no header carries it)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for metric in text_string_to_metric_families(text):
        for sample in metric.samples:
            if sample.name == "vae_phase_seconds_sum" and sample.labels.get("model") == model:
                phase = sample.labels.get("phase", "")
                out[phase] = out.get(phase, 0.0) + sample.value * 1000
    return out


def _decode_ms(phases: dict[str, float]) -> float:
    host = {"parse", "queue", "encode", "total"}
    return sum(v for k, v in phases.items() if k not in host)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({common.machine()})"


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


class _server:
    """``python -m app serve`` on a loopback port until the block ends."""

    def __init__(
        self, store: Path, log: Path, env: dict[str, str], prefix: list[str] | None = None
    ) -> None:
        self.store, self.log, self.env = store, log, env
        self.prefix = prefix or []  # e.g. taskset: the server pinned to some cores

    def __enter__(self) -> str:
        port = free_port()
        env = {**os.environ, "VAE_LOG_FORMAT": "text", **self.env}
        cmd = [
            *self.prefix,
            sys.executable,
            "-m",
            "app",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [*cmd, "--models-dir", str(self.store)], cwd=ROOT, env=env, stdout=out, stderr=out
            )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if requests.get(f"{url}/readyz", timeout=1).status_code == 200:
                    return url
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        self.__exit__()  # a server that never got ready must not outlive the proof
        raise RuntimeError(f"service not ready:\n{self.log.read_text()[-3000:]}")

    def startup_lines(self) -> list[str]:
        """The service's own account of its startup: gates, compiles, warm-ups."""
        keys = ("parity cosine", "compiled", "warmed up", "serving on")
        return [line for line in self.log.read_text().splitlines() if any(k in line for k in keys)]

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        print("  service log tail:\n" + self.log.read_text()[-1500:], flush=True)


# --- the report ---------------------------------------------------------------------------


def markdown(r: dict) -> str:
    lines = [
        f"# GPU proof: {r['device']}",
        "",
        f"- started {r['started']}; machine: {r['machine']}",
        f"- result: {'PASS' if r['ok'] else 'FAIL'}" + (" (quick)" if r["quick"] else ""),
        "",
        "## Parity gate (every served way: batch 1, batch 2, de-normalized, tiled)",
        "",
        "| model | family | dtype | min cosine | min PSNR dB | passed |",
        "|---|---|---|---|---|---|",
    ]
    for g in r["gate"]:
        psnr = "inf" if g["psnr_db"] is None else f"{g['psnr_db']:.1f}"
        lines.append(
            f"| {g['model']} | {g['family']} | {g['dtype']} | {g['cos']:.7f} | {psnr} | {g['passed']} |"
        )
    lines += [
        "",
        "## FLUX.1 decode (CUDA events, median; peak above the weights)",
        "",
        "| size | batch | variant | ms | peak MiB | diffusers best / this |",
        "|---|---|---|---|---|---|",
    ]
    for f in r["flux"]:
        ratio = f.get("vs_diffusers_best", "")
        lines.append(
            f"| {f['size']} | {f['batch']} | {f['variant']} | {f['ms']:.2f} | {f['peak_mib']} | {ratio} |"
        )
    lines += ["", "## HTTP end to end", "", "| output | client ms | phases (ms) |", "|---|---|---|"]
    for e in r["e2e"]:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in e["phases"].items())
        lines.append(f"| {e['output']} | {e['ms_total']:.1f} | {phases} |")
    for title, key in (("Out-of-memory ladder", "ladder"), ("L4 memory emulated", "l4")):
        lines += [
            "",
            f"## {title}",
            "",
            "| size | batch | ok | ms | peak MiB | retries |",
            "|---|---|---|---|---|---|",
        ]
        for row in r[key]:
            lines.append(
                f"| {row['size']} | {row['batch']} | {row['ok']} | {row['ms']:.0f} | "
                f"{row['peak_mib']} | {row['retries'] or ''} {row.get('error', '')} |"
            )
    lines += [
        "",
        "## CUDA graphs (FLUX.1 bf16, batch 1)",
        "",
        "| size | eager ms | graph replay ms | identical |",
        "|---|---|---|---|",
    ]
    for g in r.get("graphs", []):
        lines.append(
            f"| {g['size']} | {g['eager_ms']:.2f} | {g['graph_ms']:.2f} | {g['identical']} |"
        )
    lines += [
        "",
        "## torch.compile (FLUX.1 bf16, batch 1)",
        "",
        "| size | compiled ms | first call s | cosine vs eager |",
        "|---|---|---|---|",
    ]
    for c in r.get("compile", []):
        lines.append(
            f"| {c['size']} | {c['compiled_ms']:.2f} | {c['first_call_s']:.1f} | {c['cos_vs_eager']:.7f} |"
        )
    prof = r.get("profile")
    if prof:
        lines += [
            "",
            f"## Compiled FLUX.1 {prof['size']}^2 bf16, kernel by kernel",
            "",
            f"{prof['flops'] / 1e12:.2f} TFLOP per decode; bf16 GEMM measured at "
            f"{prof['gemm_tflops']:.0f} TFLOP/s (8192^2).",
            "",
            "| layout | ms | TFLOP/s | kernel ms | by kind (ms) |",
            "|---|---|---|---|---|",
        ]
        for row in prof["rows"]:
            k = row["kernels"]
            kinds = ", ".join(f"{n} {v:.1f}" for n, v in sorted(k["by_kind_ms"].items()))
            lines.append(
                f"| {row['layout']} | {row['ms']:.2f} | {row['tflops']:.0f} | "
                f"{k['total_ms']:.1f} | {kinds} |"
            )
        for row in prof["rows"]:
            lines += [
                "",
                f"Top kernels, {row['layout']}:",
                "",
                "| kernel | calls | ms |",
                "|---|---|---|",
            ]
            for t in row["kernels"]["top"]:
                lines.append(f"| `{t['name']}` | {t['calls']} | {t['ms']:.2f} |")
    lines += video_markdown(r)
    lines += ["", "## Notes", ""] + [f"- {n}" for n in r["notes"]]
    if r["errors"]:
        lines += ["", "## Errors", ""] + [f"```\n{e}\n```" for e in r["errors"]]
    return "\n".join(lines) + "\n"


def video_markdown(r: dict) -> list[str]:
    """The video section's tables (scripts/video_proof.py)."""
    if not r.get("video"):
        return []
    versions = r.get("versions", {})
    lines = [
        "",
        "## Video families at their real sizes",
        "",
        ", ".join(f"{k} {v}" for k, v in versions.items()) or "(no CUDA: versions not read)",
        "",
        "| family | frames x H x W | device | variant | run | rung | estimate MiB | peak MiB "
        "| reserved MiB | ms | budget MiB | retries |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in r["video"]:
        cells = [v["family"], f"{v['frames']}x{v['height']}x{v['width']}", v["device"],
                 v["variant"], v.get("run", ""), v["rung"] or "", v["estimate_mib"],
                 v["peak_mib"], v.get("reserved_mib"), v["ms"], v["budget_mib"],
                 v.get("retries") or v.get("error", "")]  # fmt: skip
        lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    staged = [v for v in r["video"] if v.get("stage_peaks")]
    if staged:
        lines += ["", "Where each service decode's peak was set (a stage that raised the running "
                  "peak; MiB above the weights):", "",
                  "| family | frames x H x W | run | stage | peak MiB | live at its start MiB |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for v in staged:
            for stage, at in v["stage_peaks"].items():
                lines.append(f"| {v['family']} | {v['frames']}x{v['height']}x{v['width']} | "
                             f"{v.get('run', '')} | {stage} | {at['peak_mib']} | "
                             f"{at['live_at_start_mib']} |")  # fmt: skip
    lines += ["", "Parity, served bf16 vs float32 on the device (3 latent frames, full size):", "",
              "| family | latent | cosine | PSNR dB | passed |", "|---|---|---|---|---|"]  # fmt: skip
    for p in r.get("video_parity", []):
        lines.append(f"| {p['family']} | {p['latent']} | {p['cos']:.7f} | {p['psnr_db']} | "
                     f"{p['passed']} |")  # fmt: skip
    lines += ["", "Kernels of one warm 2-frame chunk:", "",
              "| family | by kind (ms) | slow conv kernels |", "|---|---|---|"]  # fmt: skip
    for k in r.get("video_kernels", []):
        kinds = ", ".join(f"{n} {v:.1f}" for n, v in sorted(k["by_kind_ms"].items()))
        lines.append(f"| {k['family']} | {kinds} | {', '.join(k['slow_kernels']) or 'none'} |")
    lines += ["", "3-D conv layout of the served copy:", "",
              "| family | layout | ms | served |", "|---|---|---|---|"]  # fmt: skip
    for x in r.get("video_layout", []):
        lines.append(f"| {x['family']} | {x['layout']} | {x['ms']} | {x['served']} |")
    lines += ["", "Device-aware choices (issue 23.7):", "",
              "| family | choice | value | ms | peak MiB | served |", "|---|---|---|---|---|---|"]  # fmt: skip
    for c in r.get("video_choices", []):
        lines.append(f"| {c['family']} | {c['choice']} | {c['value']} | {c.get('ms')} | "
                     f"{c.get('peak_mib', '')} | {c['served']} |")  # fmt: skip
    mp4 = r.get("video_mp4")
    if mp4:
        lines += ["", f"HTTP MP4 ({mp4['model']}, server on {mp4['cores']} cores): "
                  f"{mp4['frames']}/{mp4['expected_frames']} frames, wall {mp4['ms_total']:.0f} ms, "
                  f"decode {mp4['decode_ms']:.0f} ms, encode {mp4['encode_ms']} ms"]  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU run)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/gpu_proof"))
    parser.add_argument("--only", nargs="*", help="sections to run (default: all)")
    parser.add_argument("--models", nargs="+", help="the gate's embedded models (default: all)")
    args = parser.parse_args()
    device = devices.resolve(args.device)
    devices.prepare(device)
    proof = Proof(device, args.quick, args.out, args.models)
    known = {name for _, name, _ in embedded_models(args.quick)}
    if args.models and not set(args.models) <= known:
        parser.error(f"--models: unknown {sorted(set(args.models) - known)}; known {sorted(known)}")
    print(devices.runtime_summary(args.device), flush=True)
    sections = ["encoder", "gate", "flux", "e2e", "graphs", "ladder", "l4", "compile", "profile"]
    sections.append("video")
    for name in args.only or sections:
        proof.section(name, getattr(proof, name))
    proof.write()
    print(f"wrote {args.out}/gpu_proof.md: {'PASS' if proof.report['ok'] else 'FAIL'}")
    sys.exit(0 if proof.report["ok"] else 1)


if __name__ == "__main__":
    main()
