"""The GPU proof script runs anywhere in CPU mode and writes its report in the agreed schema
(on a GPU machine it is run whole: docs/gpu/)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _gpu_proof():
    spec = importlib.util.spec_from_file_location("gpu_proof", ROOT / "scripts" / "gpu_proof.py")
    proof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(proof)
    return proof


def test_gpu_proof_runs_on_the_cpu_and_writes_its_report(tmp_path):
    from app.families import keys

    # the gate's cheapest embedded model of each family, as the proof ranks the descriptors'
    # recipes (a new family is in it: tests/test_add_family.py runs the proof on one); this
    # runs the script and checks its report on an image and a video family; every family's
    # bf16 gate is in tests/test_gate.py and the families' tests, and the whole proof on a
    # GPU gates every model
    one_per_family = _gpu_proof().one_per_family(quick=True)
    assert len(one_per_family) == len(keys())
    models = ["flux-tiny", "wan2.2-tiny"]
    assert set(models) <= set(one_per_family)
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": str(Path(os.sys.executable))}
    cmd = ["bash", "scripts/gpu_proof.sh", "--device", "cpu", "--quick",
           "--only", "encoder", "gate", "--models", *models]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_proof.json").read_text())
    assert {"device", "gate", "flux", "e2e", "ok"} <= set(report) and report["ok"] is True
    assert {row["family"] for row in report["gate"]} == {"flux", "wan"}
    # each named model, in every mode the CPU gates: bf16, bf16 unoptimized and float32 fast,
    # or float32 fast alone where the CPU emulates bf16 (auto measures no bf16 there)
    gated = [(row["model"], row["dtype"]) for row in report["gate"]]
    # (as the proof's own process measured it: under load a second measurement can disagree)
    offers_bf16 = report["cpu_offers_bf16"]
    assert offers_bf16 in (True, False), report["cpu_offers_bf16"]
    dtypes = ("bfloat16", "bfloat16", "float32") if offers_bf16 else ("float32",)
    assert sorted(gated) == sorted((m, d) for m in models for d in dtypes)
    assert report["h264_encoder"]
    for row in report["gate"]:
        assert {"model", "family", "dtype", "cos", "psnr_db", "passed"} <= set(row)
        assert row["passed"] and row["cos"] >= 0.9999
        assert {"batch1", "batch2", "denormalized"} <= set(row["checks"])
    assert (tmp_path / "gpu_proof.md").read_text().startswith("# GPU proof")


def test_proof_gates_every_recipe_and_picks_one_model_per_family():
    """The gate's models are every family's recipes (taesd's seeded one too, though not baked),
    the quick run's FLUX.1 swapped for a tiny one; one per family is the cheapest probe."""
    from app.families import families

    proof = _gpu_proof()
    listed = proof.embedded_models(quick=True)
    names = {name for _, name, _ in listed}
    expected = {n for f in families().values() for n in f.synthetic} - {"flux1-synthetic"}
    assert names == expected | {"flux-tiny"} and "taesd-seeded" in names
    assert {name for _, name, _ in proof.embedded_models(quick=False)} == expected | {
        "flux1-synthetic"
    }
    chosen = proof.one_per_family(quick=True)
    by_family = {name: key for key, name, _ in listed}
    assert sorted(by_family[n] for n in chosen) == sorted(families())
    cost = {n: proof.probe_flops(families()[k].decoder, c) for k, n, c in listed}
    for name in chosen:  # no cheaper model of its family
        assert cost[name] == min(cost[n] for n, k in by_family.items() if k == by_family[name])


def test_kernel_profile_accounts_a_decode_by_kind_and_renders():
    """The profile section's accounting, run on the CPU (aten ops stand in for kernels)."""
    import torch

    from app.families.flux import decoder as flux
    from tests.live import TINY_FLUX

    proof = _gpu_proof()
    model = flux.Decoder(TINY_FLUX["flux-tiny"])
    flux.init_synthetic(model, torch.Generator().manual_seed(0))
    z = torch.randn(1, model.latent_channels, 8, 8)
    kernels = proof._kernel_profile(lambda x: model.decode(x), z)
    kinds = kernels["by_kind_ms"]
    assert kinds["convolution"] > 0 and kinds.get("other", 0) > 0
    assert abs(sum(kinds.values()) - kernels["total_ms"]) < 1e-6
    assert kernels["top"] and all(t["calls"] >= 1 for t in kernels["top"])
    report = {
        "device": "cpu", "machine": "m", "started": "t", "quick": True, "ok": True,
        "gate": [], "flux": [], "e2e": [], "ladder": [], "l4": [], "notes": [], "errors": [],
        "profile": {"size": 64, "flops": 1e9, "gemm_tflops": 1.0,
                    "rows": [{"layout": "NCHW", "ms": 1.0, "tflops": 1.0, "kernels": kernels}]},
    }  # fmt: skip
    text = proof.markdown(report)
    assert "kernel by kernel" in text and kernels["top"][0]["name"][:20] in text


def _video_proof():
    import importlib
    import sys

    sys.path.insert(0, str(ROOT))
    return importlib.import_module("scripts.video_proof")


def test_video_meta_rows_plan_the_real_sizes_under_an_l4():
    """The CPU half of the video section: a row per real size in issue 23's schema, its
    estimate within 1.0-1.5x of the live peak, and MiniMax-H3 (cannot tile) not refused."""
    video = _video_proof()
    model = next(m for m in video.MODELS if m.name == "minimax-h3")
    (row,) = video.meta_rows(models=(model,))
    assert set(SCHEMA) <= set(row)
    assert (row["frames"], row["height"], row["width"]) == (209, 768, 1344)
    assert row["device"] == "meta" and row["variant"] == "service" and row["ms"] is None
    assert row["rung"] == "whole" and row["budget_mib"] > row["estimate_mib"]
    assert 1.0 <= row["estimate_mib"] / row["peak_mib"] <= 1.5


SCHEMA = ("family", "frames", "height", "width", "device", "variant", "estimate_mib",
          "peak_mib", "ms", "rung", "budget_mib")  # fmt: skip


class _Report:
    """What the video section reads of gpu_proof's ``Proof``: its report and verdicts."""

    def __init__(self, device):
        self.device, self.quick = device, True
        self.report = {"notes": [], "errors": [], "ok": True}

    def fail(self, message):
        self.report["errors"].append(message)
        self.report["ok"] = False

    def note(self, message):
        self.report["notes"].append(message)

    def write(self):
        pass


def test_video_section_on_the_cpu_serves_parities_and_times_one_family():
    """The device half at a tiny size: service rows cold and warm (uint8 frames), diffusers
    in both layouts agreeing with the service, parity, kernels, layouts and chunk choices."""
    import torch

    video = _video_proof()
    proof = _gpu_proof()
    report = _Report(torch.device("cpu"))
    section = video.VideoSection(report, proof._kernel_profile)
    model = next(m for m in video.MODELS if m.name == "ltx-0.9.1")
    section.one_model(model)
    r = report.report
    assert r["ok"], r["errors"]
    rows = r["video"]
    service = [x for x in rows if x["variant"] == "service"]
    assert [x["run"] for x in service] == ["cold", "warm"]
    assert all(x["ok"] and x["rung"] == "whole" and x["dtype"] == "uint8" for x in service)
    frames = model.tiny_size[0]
    assert service[0]["output"] == [frames, model.tiny_size[1], model.tiny_size[2], 3]
    peers = {x["variant"] for x in rows if "diffusers" in x["variant"]}
    assert peers == {"diffusers NCDHW", "diffusers channels_last_3d"}
    assert all(set(SCHEMA) <= set(x) for x in rows)
    assert r["video_peer_cos"][0]["cos"] > 0.9999  # the peer decodes what the service does
    assert r["video_parity"][0]["passed"]
    assert {x["layout"] for x in r["video_layout"]} == {"NCDHW", "channels_last_3d"}
    assert {x["value"] for x in r["video_choices"]} >= {2, 4}


def test_video_steps_run_only_what_proof_video_steps_names(monkeypatch):
    """A rerun after a timeout takes only the steps it names (device time is short): layouts
    and choices here, no service, parity, kernels or diffusers rows; an unknown step stops."""
    video = _video_proof()
    report = _Report(torch.device("cpu"))
    section = video.VideoSection(report, _gpu_proof()._kernel_profile)
    monkeypatch.setenv("PROOF_VIDEO_STEPS", "layout,choices")
    section.one_model(next(m for m in video.MODELS if m.name == "wan-2.1"))
    r = report.report
    assert r["ok"], r["errors"]
    assert r["video_layout"] and r["video_choices"]
    assert not r["video"] and not r["video_parity"] and not r.get("video_peer_cos")
    monkeypatch.setenv("PROOF_VIDEO_STEPS", "layout,nosuch")
    with pytest.raises(SystemExit, match="nosuch"):
        video.steps()


def _measured(pattern: str):
    """Every committed GPU proof's JSON matching ``pattern`` (docs/gpu/)."""
    return [json.loads(p.read_text()) for p in sorted((ROOT / "docs/gpu").glob(pattern))]


def test_each_gpu_margin_covers_the_peak_the_h200_measured():
    """A GPU plans ``working_bytes`` x the family's ``gpu_margin``: that covers every peak a
    committed H200 proof measured, video rows (their estimate beside their peak) and the FLUX
    rows of runs 3 and 4 (the estimate recomputed from the published config)."""
    from app.families import family
    from app.families.flux.decoder.model import FLUX1_CONFIG

    video = _video_proof()
    family_of = {m.name: m.family for m in video.MODELS}
    rows = [r for d in _measured("*-video.json") for r in d.get("video", [])]
    served = [r for r in rows if r["device"] == "cuda" and r["variant"] == "service"]
    assert served, "no committed H200 video rows"
    for r in served:
        margin = family(family_of[r["family"]]).decoder.module.gpu_margin
        assert r["estimate_mib"] * margin >= r["peak_mib"], r
    with torch.device("meta"):
        flux = family("flux").decoder.module(FLUX1_CONFIG)
    flux_rows = [r for d in _measured("*-h200-run[34].json") for r in d.get("flux", [])]
    assert flux_rows, "no committed H200 FLUX rows"
    for r in (r for r in flux_rows if r["variant"] == "service bfloat16"):
        cells = r["size"] // flux.spatial_scale
        estimate = flux.working_bytes((r["batch"], 16, cells, cells), 2) / 2**20
        assert estimate * flux.gpu_margin >= r["peak_mib"], r


def test_the_gpu_wheels_carry_every_dependency_the_gpu_image_lacks():
    """The lent GPU machine is offline: a dependency neither carried by scripts/gpu_wheels.sh
    nor in its image stops the proof's HTTP sections at import (fastapi-offline, 2026-12-04)."""
    import re
    import tomllib

    def names(words):
        return {re.split(r"[=<>;\[ ]", w.strip())[0].lower().replace("_", "-") for w in words}

    script = (ROOT / "scripts/gpu_wheels.sh").read_text()
    listed = {k: names(re.search(rf"^{k}=\(([^)]*)\)", script, re.M).group(1).split())
              for k in ("WHEELS", "THERE")}  # fmt: skip
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    missing = names(project["dependencies"]) - listed["WHEELS"] - listed["THERE"]
    assert not missing, f"add to scripts/gpu_wheels.sh: {sorted(missing)}"


def test_the_stage_that_sets_a_decodes_gpu_peak_is_named(monkeypatch):
    """The video proof names the stage during which a GPU decode's peak memory rose (CUDA's
    counters stood in for by a counter one stage raises), and a rise after the last stage."""
    from app.families import family

    video = _video_proof()
    part = family("ltx").decoder
    decoder = part.module(dict(family("ltx").synthetic["ltx-tiny"].config)).eval()
    names = [name for name, _ in decoder.stages()]
    memory = {"peak": 100 << 20, "live": 100 << 20}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: memory["peak"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: memory["live"])
    raiser = dict(decoder.stages())[names[1]]
    raiser.register_forward_hook(lambda *_: memory.update(peak=900 << 20, live=300 << 20))
    with torch.no_grad(), video._StagePeaks(decoder, torch.device("cuda"), 100 << 20) as peaks:
        decoder.decode(torch.randn(1, 128, 2, 4, 4))
        memory["peak"] = 1000 << 20  # the output's assembly, after every stage
    assert peaks.peaks == {
        names[1]: {"peak_mib": 800, "live_at_start_mib": 0},
        "between stages": {"peak_mib": 900, "live_at_start_mib": 200},
    }
    assert video._StagePeaks(decoder, torch.device("cpu"), 0).stages == []
    row = {"family": "ltx-0.9.1", "frames": 9, "height": 32, "width": 32, "device": "cuda",
           "variant": "service", "run": "warm", "rung": "whole", "estimate_mib": 1,
           "peak_mib": 900, "ms": 1.0, "budget_mib": None, "stage_peaks": peaks.peaks}  # fmt: skip
    text = "\n".join(_gpu_proof().video_markdown({"video": [row]}))
    assert f"| ltx-0.9.1 | 9x32x32 | warm | {names[1]} | 800 | 0 |" in text
