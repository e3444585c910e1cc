"""Deployment and observability, proven against the real tools.

* ``Dockerfile.gpu`` passes hadolint; what it copies exists and is not dockerignored; its build
  steps (``scripts/build_image.sh``) import a checkpoint, serve it and stop on SIGTERM.
* ``deploy/prometheus``: ``promtool check config``, ``check rules`` and the rules' unit tests.
* ``docker-compose.yml`` (+ the CPU override) parses and every path it references exists.
* ``deploy/cloudrun/service.yaml`` holds what an L4 service needs.
* The live test: the service on loopback, a real Prometheus scraping it every second, a few
  decodes (successes and 4xx), then every Grafana panel query must return data and every alert
  expression must evaluate.
* ``app/logging_json``: one parseable JSON line per request, with Cloud Logging's field names.

hadolint and prometheus/promtool come from ``scripts/install_ci_deps.sh``; without them the
tests that need them skip and say so.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import io
import json
import logging
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROM_DIR = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "vae.json"
INSTALL_HINT = "install it with `bash scripts/install_ci_deps.sh` (CI does)"
NVML_METRICS = ("vae_device_utilization_ratio", "vae_gpu_memory_bytes")  # absent without a GPU
# panels drawn per replica: by the self-hosted `instance` and the sidecar's `instanceId`
PER_REPLICA = ("Queue depth and in-flight", "Device memory",
               "GPU utilization (NVML, from the service)")  # fmt: skip


def _tool(name: str) -> str | None:
    """A binary from the running venv (pip-installed tools) or else from PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def _run(cmd: list[str], timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


# --- Dockerfile.gpu ------------------------------------------------------------------------


def test_hadolint_dockerfile_gpu():
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip(f"hadolint is not installed: {INSTALL_HINT}")
    result = _run([hadolint, "--no-color", "Dockerfile.gpu"], cwd=ROOT)
    # No finding at any level: the two DL3008 waivers are inline and explained.
    assert result.returncode == 0, result.stdout + result.stderr


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out, pending = [], ""
    for line in (ROOT / "Dockerfile.gpu").read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            if pending.strip():
                word, _, rest = pending.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def test_dockerfile_gpu_exposes_nvenc_to_the_container():
    """Without the ``video`` driver capability the NVIDIA runtime mounts no NVENC library and
    h264_nvenc never comes up on the L4 (issue 23.8)."""
    env = " ".join(args for word, args in _dockerfile() if word == "ENV")
    match = re.search(r"NVIDIA_DRIVER_CAPABILITIES=(\S+)", env)
    assert match, "Dockerfile.gpu sets no NVIDIA_DRIVER_CAPABILITIES"
    assert {"compute", "utility", "video"} <= set(match.group(1).strip("\"'").split(","))


def _dockerignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").strip("/")
        for prefix in prefixes:
            if fnmatch.fnmatch(prefix, pat) or (
                pat.startswith("**/") and fnmatch.fnmatch(prefix.split("/")[-1], pat[3:])
            ):
                ignored = not negate
    return ignored


def test_dockerfile_stages_runtime_and_build_context():
    instructions = _dockerfile()
    stages = [args.split()[-1] for op, args in instructions if op == "FROM"]
    assert stages == ["python", "builder", "baker", "runtime"], stages
    runtime = instructions[max(i for i, (op, _) in enumerate(instructions) if op == "FROM") :]
    ops = {op: args for op, args in runtime}
    user = ops["USER"].split(":")[0]
    assert user not in ("root", "0"), "the runtime stage must not run as root"
    assert "vae-healthcheck" in ops["HEALTHCHECK"] and "CMD [" in ops["HEALTHCHECK"]
    assert "/readyz" in (DEPLOY / "healthcheck.py").read_text()
    # exec form: PID 1 is tini, which hands SIGTERM to the server
    assert json.loads(ops["ENTRYPOINT"])[:2] == ["/usr/bin/tini", "--"]
    assert json.loads(ops["CMD"]) == ["serve"]
    assert "PORT=8080" in ops["ENV"] and "VAE_MODELS_DIR=/models" in ops["ENV"]
    # the baker imports a checkpoint or bakes synthetic weights, through the tested script
    baker = instructions[[a.split()[-1] for o, a in instructions if o == "FROM"].index("baker") :]
    assert any(op == "RUN" and "build_image.sh bake" in args for op, args in baker)

    ignore = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
              if p.strip() and not p.startswith("#")]  # fmt: skip
    default_ckpt = next(a.split("=", 1)[1] for o, a in instructions
                        if o == "ARG" and a.startswith("VAE_CHECKPOINT="))  # fmt: skip
    for op, args in instructions:
        if op != "COPY" or args.startswith("--from"):
            continue
        *sources, _dest = args.split()
        for src in sources:
            src = src.replace("${VAE_CHECKPOINT}", default_ckpt)
            assert (ROOT / src).exists(), f"COPY {src}: not in the build context"
            assert not _dockerignored(src, ignore), f"COPY {src}: excluded by .dockerignore"


def _tiny_diffusers_vae(folder: Path) -> None:
    """A diffusers-layout vae/ folder (config.json + safetensors) written without diffusers."""
    import torch
    from safetensors.torch import save_file

    from app.families import family
    from tests.live import TINY_FLUX

    flux = family("flux").decoder
    config = dict(TINY_FLUX["flux-tiny"])
    decoder = flux.module(config)
    flux.init_synthetic(decoder, torch.Generator().manual_seed(0))
    folder.mkdir(parents=True)
    state = {f"decoder.{k}": v.contiguous() for k, v in decoder.state_dict().items()}
    save_file(state, str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "_class_name": "AutoencoderKL", "in_channels": 3, "out_channels": 3,
        "latent_channels": 16, "block_out_channels": config["block_out_channels"],
        "layers_per_block": 1, "norm_num_groups": 8, "use_post_quant_conv": False,
        "scaling_factor": 0.3611, "shift_factor": 0.1159,
    }))  # fmt: skip


def test_build_script_imports_serves_and_stops_on_sigterm(tmp_path):
    """The baker + a smoke start of the image, as a plain script (Docker cannot run here)."""
    ckpt = tmp_path / "checkpoints" / "vae"
    _tiny_diffusers_vae(ckpt)
    store = tmp_path / "models"
    env = dict(os.environ, VENV=str(Path(sys.executable).parent.parent), STORE=str(store),
               VAE_FAMILY="flux", VAE_CHECKPOINT=str(ckpt.parent), VAE_NAME="flux-ckpt",
               VAE_DEVICE="cpu", VAE_DTYPE="float32", SMOKE_TIMEOUT="120")  # fmt: skip
    result = _run(["bash", "scripts/build_image.sh", "bake", "smoke"], timeout=240, cwd=ROOT,
                  env=env)  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    manifest = json.loads((store / "flux-ckpt" / "manifest.json").read_text())
    assert manifest["family"] == "flux"
    assert "smoke: flux-ckpt on cpu/float32" in out, out[-3000:]
    assert "runtime: torch " in out and "(VAE_DEVICE=cpu)" in out, out[-3000:]  # startup line
    assert "graceful exit on SIGTERM" in out, out[-3000:]


def _check_torch_cuda() -> Any:
    spec = importlib.util.spec_from_file_location("check_torch_cuda",
                                                  ROOT / "scripts" / "check_torch_cuda.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("torch_cuda, driver, runs", [
    ("13.0", "12.2", False),  # PyPI's default torch 2.13 on Cloud Run's L4 driver (535)
    (None, "12.2", False),    # a CPU-only torch in the GPU image
    ("12.8", "12.2", True),   # CUDA minor-version compatibility within 12.x
    ("12.2", "12.2", True),
    ("11.8", "12.2", True),
    ("13.0", "13.0", True),
])  # fmt: skip
def test_cuda_check_refuses_a_torch_the_driver_cannot_run(torch_cuda, driver, runs):
    assert (_check_torch_cuda().problem(torch_cuda, driver) is None) is runs


def test_build_step_cuda_fails_on_a_torch_without_cuda():
    """The image build's check, run for real on this machine's (CPU-only) torch."""
    import torch

    if torch.version.cuda:
        pytest.skip(f"this torch is a CUDA {torch.version.cuda} build: the step would pass")
    env = dict(os.environ, VENV=str(Path(sys.executable).parent.parent), TARGET_CUDA="12.2")
    result = _run(["bash", "scripts/build_image.sh", "cuda"], cwd=ROOT, env=env)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "CPU-only build" in out, out[-2000:]


def _arg_default(name: str) -> str:
    return next(a.split("=", 1)[1].strip('"') for o, a in _dockerfile()
                if o == "ARG" and a.startswith(f"{name}="))  # fmt: skip


def test_image_defaults_to_a_cuda12_torch_that_the_l4_driver_runs():
    """Dockerfile, Cloud Build and compose install torch from a CUDA 12 index by default, the
    build checks it against the target driver, and the runtime refuses to serve on the CPU."""
    index, target = _arg_default("TORCH_INDEX_URL"), _arg_default("TARGET_CUDA")
    match = re.fullmatch(r"https://download\.pytorch\.org/whl/cu(12)(\d)", index)
    assert match, index
    assert target == "12.2"  # Cloud Run's L4: driver 535, CUDA 12.2
    assert _check_torch_cuda().problem(f"{match[1]}.{match[2]}", target) is None
    instructions = _dockerfile()
    runs = [a for o, a in instructions if o == "RUN" and "build_image.sh" in a]
    steps = " ".join(runs).split()
    assert steps.index("cuda") > steps.index("torch"), runs
    runtime = instructions[max(i for i, (op, _) in enumerate(instructions) if op == "FROM") :]
    assert "VAE_DEVICE=cuda" in " ".join(a for o, a in runtime if o == "ENV")
    build = yaml.safe_load((DEPLOY / "cloudrun" / "cloudbuild.yaml").read_text())
    assert build["substitutions"]["_TORCH_INDEX_URL"] == index
    assert build["substitutions"]["_TARGET_CUDA"] == target
    assert "--build-arg=TARGET_CUDA=${_TARGET_CUDA}" in build["steps"][0]["args"]
    vae = _compose("docker-compose.yml")["services"]["vae"]
    assert _interpolated(vae["build"]["args"]["TORCH_INDEX_URL"]) == index
    assert _interpolated(vae["build"]["args"]["TARGET_CUDA"]) == target
    assert vae["environment"]["VAE_DEVICE"] == "cuda"
    service = yaml.safe_load((DEPLOY / "cloudrun" / "service.yaml").read_text())
    env = {e["name"]: e["value"] for c in service["spec"]["template"]["spec"]["containers"]
           for e in c.get("env", [])}  # fmt: skip
    assert env["VAE_DEVICE"] == "cuda"


def test_build_script_bakes_synthetic_when_no_checkpoint(tmp_path):
    env = dict(os.environ, VENV=str(Path(sys.executable).parent.parent),
               STORE=str(tmp_path / "models"), VAE_FAMILY="", VAE_BAKE_ONLY="ltx-tiny")  # fmt: skip
    result = _run(["bash", "scripts/build_image.sh", "bake"], timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert json.loads((tmp_path / "models" / "ltx-tiny" / "manifest.json").read_text())


# --- Prometheus config and rules -----------------------------------------------------------


def _promtool() -> str:
    promtool = _tool("promtool")
    if promtool is None:
        pytest.skip(f"promtool (Debian package prometheus) is not installed: {INSTALL_HINT}")
    return promtool


@pytest.mark.parametrize("args", [
    ["check", "config", "prometheus.yml"],
    ["check", "rules", "alerts.yml"],
    ["check", "rules", "alerts-cloudrun.yml"],
    ["test", "rules", "alerts_test.yml"],
    ["test", "rules", "alerts-cloudrun_test.yml"],
], ids=["check-config", "check-rules", "check-rules-cloudrun", "rule-unit-tests",
        "rule-unit-tests-cloudrun"])  # fmt: skip
def test_promtool(args):
    result = _run([_promtool(), *args], cwd=PROM_DIR)
    assert result.returncode == 0, result.stdout + result.stderr


def _alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_alert_rules_cover_the_issue():
    names = {r["alert"] for r in _alert_rules()}
    assert {"VaeFallbackActive", "VaeParityBelowThreshold", "VaeDecodeP95High",
            "VaeErrorRatioHigh", "VaeQueueSaturated", "VaeNoTraffic",
            "VaeNoReadyReplica"} <= names  # fmt: skip
    # every alert is covered by a promtool unit test
    tests = yaml.safe_load((PROM_DIR / "alerts_test.yml").read_text())["tests"]
    fired = {c["alertname"] for t in tests for c in t["alert_rule_test"] if c["exp_alerts"]}
    assert fired == names


# --- docker compose --------------------------------------------------------------------------


class _ComposeLoader(yaml.SafeLoader):
    """YAML with compose's merge tags (!reset, !override)."""


def _construct_tagged(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    return loader.construct_scalar(node)


for _tag in ("!reset", "!override"):
    _ComposeLoader.add_constructor(_tag, _construct_tagged)


def _compose(name: str) -> dict[str, Any]:
    return yaml.load((ROOT / name).read_text(), Loader=_ComposeLoader)  # noqa: S506


_DEFAULT = re.compile(r"^\$\{[A-Z_]+:-(.*)\}$")


def _interpolated(value: str) -> str:
    m = _DEFAULT.match(value)
    return m.group(1) if m else value


def test_compose_parses_and_references_what_exists():
    compose = _compose("docker-compose.yml")
    services = compose["services"]
    assert {"vae", "prometheus", "grafana"} <= set(services)
    vae = services["vae"]
    context = ROOT / vae["build"]["context"]
    assert (context / vae["build"]["dockerfile"]).is_file()
    ckpt = _interpolated(vae["build"]["args"]["VAE_CHECKPOINT"])
    assert (context / ckpt).exists(), ckpt
    devices = vae["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    mounts: dict[str, dict[str, Path]] = {}
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name}: {source} does not exist"
                mounts.setdefault(name, {})[target] = ROOT / source
            else:
                assert source in compose.get("volumes", {}), f"{name}: volume {source} undeclared"
        for dep in service.get("depends_on", []):
            assert dep in services
    # Prometheus: the config it is told to read is mounted, and so is every rule file it names
    prom = services["prometheus"]
    config_path = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file"))
    assert config_path in mounts["prometheus"]
    prom_cfg = yaml.safe_load(mounts["prometheus"][config_path].read_text())
    for rule_file in prom_cfg["rule_files"]:
        assert str(Path(config_path).parent / rule_file) in mounts["prometheus"]
    targets = [t for job in prom_cfg["scrape_configs"] if job["job_name"] == "vae"
               for sc in job["static_configs"] for t in sc["targets"]]  # fmt: skip
    assert targets == ["vae:8080"]
    # Grafana: provisioning is mounted; the dashboard provider reads the mounted dashboards
    grafana = mounts["grafana"]
    provisioning = grafana["/etc/grafana/provisioning"]
    provider = yaml.safe_load((provisioning / "dashboards" / "vae.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert (grafana[path] / "vae.json").is_file()
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path}/vae.json"


SIDECAR_SCRAPE_INTERVAL = "30s"  # run-gmp-sidecar's default (its confgenerator's scrape_interval)


def test_grafana_for_cloud_run_reads_managed_prometheus():
    """deploy/grafana/compose.cloudrun.yml: Google's Prometheus frontend + Grafana with the
    Cloud Run provisioning (datasource uid vae-prometheus at the sidecar's interval)."""
    base = DEPLOY / "grafana"
    compose = yaml.load((base / "compose.cloudrun.yml").read_text(), Loader=_ComposeLoader)
    services = compose["services"]
    frontend, grafana = services["frontend"], services["grafana"]
    assert "prometheus-engine/frontend" in frontend["image"]
    assert any(a.startswith("--query.project-id=") for a in frontend["command"])
    listen = next(a for a in frontend["command"] if a.startswith("--web.listen-address="))
    mounts = {}
    for volume in grafana["volumes"]:
        source, target = volume.split(":")[:2]
        assert (base / source).exists(), source
        mounts[target] = base / source
    provisioning = mounts["/etc/grafana/provisioning"]
    (ds,) = yaml.safe_load((provisioning / "datasources/managed-prometheus.yml").read_text())[
        "datasources"
    ]
    assert ds["uid"] == "vae-prometheus" and ds["type"] == "prometheus"
    assert ds["jsonData"]["timeInterval"] == SIDECAR_SCRAPE_INTERVAL
    # the datasource URL is the env Grafana gets, which points at the frontend's port
    assert ds["url"] == "${GMP_FRONTEND_URL}"
    url = grafana["environment"]["GMP_FRONTEND_URL"]
    assert url == f"http://frontend:{listen.rsplit(':', 1)[1]}"
    provider = yaml.safe_load((provisioning / "dashboards/vae.yml").read_text())
    assert (mounts[provider["providers"][0]["options"]["path"]] / "vae.json").is_file()
    # the manifest leaves the sidecar's scrape interval at its default (no RunMonitoring config)
    manifest = yaml.safe_load((DEPLOY / "cloudrun" / "service.yaml").read_text())
    containers = manifest["spec"]["template"]["spec"]["containers"]
    (collector,) = [c for c in containers if "run-gmp-sidecar" in c["image"]]
    assert "volumeMounts" not in collector and "args" not in collector
    # the self-hosted datasource's interval is the vae job's scrape interval
    (local,) = yaml.safe_load((base / "provisioning/datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    scrape = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())["scrape_configs"]
    assert local["jsonData"]["timeInterval"] == next(
        j["scrape_interval"] for j in scrape if j["job_name"] == "vae"
    )
    assert local["uid"] == ds["uid"]
    readme = (DEPLOY / "README.md").read_text()
    assert "compose.cloudrun.yml" in readme and "vae-prometheus" in readme


def test_compose_cpu_override():
    override = _compose("docker-compose.cpu.yml")["services"]["vae"]
    assert override["environment"]["VAE_DEVICE"] == "cpu"
    assert override["deploy"]["resources"]["reservations"]["devices"] == []
    assert "docker-compose.cpu.yml" in (DEPLOY / "README.md").read_text()


# --- Cloud Run -------------------------------------------------------------------------------


def _quantity(value: str) -> float:
    units = {"Gi": 2**30, "Mi": 2**20, "G": 1e9, "M": 1e6, "m": 1e-3}
    for suffix, factor in units.items():
        if str(value).endswith(suffix):
            return float(str(value)[: -len(suffix)]) * factor
    return float(value)


def test_cloud_run_service_for_one_l4():
    service = yaml.safe_load((DEPLOY / "cloudrun" / "service.yaml").read_text())
    assert service["apiVersion"] == "serving.knative.dev/v1" and service["kind"] == "Service"
    template = service["spec"]["template"]
    notes, spec = template["metadata"]["annotations"], template["spec"]
    assert spec["nodeSelector"]["run.googleapis.com/accelerator"] == "nvidia-l4"
    vae = next(c for c in spec["containers"] if c.get("ports"))
    limits = vae["resources"]["limits"]
    assert str(limits["nvidia.com/gpu"]) == "1"
    assert _quantity(limits["cpu"]) >= 4 and _quantity(limits["memory"]) >= 16 * 2**30
    total_cpu = sum(_quantity(c["resources"]["limits"]["cpu"]) for c in spec["containers"])
    assert total_cpu <= 8
    env = {e["name"]: e["value"] for e in vae["env"]}
    assert spec["containerConcurrency"] == int(env["VAE_QUEUE_DEPTH"])
    assert notes["run.googleapis.com/cpu-throttling"] == "false"
    assert notes["run.googleapis.com/startup-cpu-boost"] == "true"
    # scale to zero is the documented choice (deploy/README.md): no L4 billed while idle
    assert int(notes["autoscaling.knative.dev/minScale"]) == 0
    assert notes["run.googleapis.com/gpu-zonal-redundancy-disabled"] in ("true", "false")
    startup, liveness = vae["startupProbe"], vae["livenessProbe"]
    assert startup["httpGet"]["path"] == "/readyz" and liveness["httpGet"]["path"] == "/healthz"
    window = startup["periodSeconds"] * startup["failureThreshold"]
    # from a measured start (docs/BENCHMARKS.md "Cold start"), within Cloud Run's 240 s maximum
    assert 30 <= window <= 240, window
    # SIGTERM -> SIGKILL is 10 s on Cloud Run: the drain must end before it
    assert float(env["VAE_DRAIN_GRACE_S"]) <= 9
    assert env["VAE_FORWARDED_ALLOW_IPS"] not in ("*", ""), "trust only the front end's peer"
    port = vae["ports"][0]["containerPort"]
    assert startup["httpGet"]["port"] == liveness["httpGet"]["port"] == port
    build = yaml.safe_load((DEPLOY / "cloudrun" / "cloudbuild.yaml").read_text())
    assert "--file=Dockerfile.gpu" in build["steps"][0]["args"]
    assert (ROOT / build["substitutions"]["_VAE_CHECKPOINT"]).exists()
    readme = (DEPLOY / "README.md").read_text()
    for command in (
        "gcloud builds submit",
        "gcloud run services replace",
        "gcloud artifacts repositories create",
        "scripts/build_image.sh",
    ):
        assert command in readme, command


def test_request_timeout_covers_queue_wait_plus_longest_decode():
    """Cloud Run cuts a request at timeoutSeconds: it must outlast the longest queue wait
    (VAE_MAX_REQUEST_TIMEOUT_S, the deadline cap) plus the longest decode the limits admit,
    as deploy/README.md states it, and stay within Cloud Run's 3600 s."""
    from app.config import Settings

    service = yaml.safe_load((DEPLOY / "cloudrun" / "service.yaml").read_text())
    spec = service["spec"]["template"]["spec"]
    vae = next(c for c in spec["containers"] if c.get("ports"))
    env = {e["name"]: e["value"] for e in vae["env"]}
    queue_cap = float(env.get("VAE_MAX_REQUEST_TIMEOUT_S", Settings().max_request_timeout_s))
    readme = (DEPLOY / "README.md").read_text()
    (decode,) = re.findall(r"Longest admitted decode: \*\*(\d+) s\*\*", readme)
    assert spec["timeoutSeconds"] >= queue_cap + float(decode), (spec["timeoutSeconds"], env)
    assert spec["timeoutSeconds"] <= 3600
    # the docs' estimate is about the limits the manifest runs with (the defaults)
    for name in ("VAE_MAX_FRAMES", "VAE_MAX_PIXELS"):
        assert name not in env, f"{name} changed: re-derive the longest decode in the README"
    assert "257 frames" in readme and "2048x2048" in readme
    assert Settings().max_frames == 257 and Settings().max_pixels == 2048 * 2048


# --- Grafana dashboard -------------------------------------------------------------------------


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return [p for p in out if p.get("type") != "row"]


def _substitute(expr: str, variables: dict[str, str]) -> str:
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace(f"${{{name}}}", variables[name]).replace(f"${name}", variables[name])
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def test_dashboard_structure():
    dashboard = json.loads(DASHBOARD.read_text())
    uid = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml")
                         .read_text())["datasources"][0]["uid"]  # fmt: skip
    panels = _panels(dashboard)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    templating = {v["name"]: v for v in dashboard["templating"]["list"]}
    variables = set(templating)
    assert {"model", "job", "service", "datasource"} <= variables
    # the datasource is a variable whose default is the provisioned uid (another Grafana picks
    # its own Prometheus datasource there); on a self-hosted Prometheus there is no
    # service_name label, and All (.*) matches its absence
    assert templating["datasource"]["type"] == "datasource"
    assert templating["datasource"]["current"]["value"] == uid
    assert templating["service"]["includeAll"] and templating["service"]["allValue"] == ".*"
    metrics_used = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            if re.search(r"\b(vae_\w+|up)\{", target["expr"]):
                assert 'service_name=~"$service"' in target["expr"], panel["title"]
            # no made-up zero: the watched label sets exist at 0 from a replica's start
            assert "vector(0)" not in target["expr"], panel["title"]
            assert "DCGM" not in target["expr"], panel["title"]
            for var in re.findall(r"\$(\w+)", target["expr"]):
                assert var in variables or var.startswith("__"), (panel["title"], var)
            metrics_used |= set(re.findall(r"\b(vae_\w+|up)\b", target["expr"]))
    # every exported metric has a panel
    for name in ("vae_phase_seconds_sum", "vae_span_seconds_bucket", "vae_request_seconds_bucket",
                 "vae_requests_total",
                 "vae_response_bytes_bucket", "vae_queue_depth", "vae_inflight",
                 "vae_parity_cosine", "vae_fallback_active", "vae_model_load_seconds",
                 "vae_retries_total", "vae_device_memory_bytes",
                 "vae_device_utilization_ratio", "vae_gpu_memory_bytes"):  # fmt: skip
        assert name in metrics_used, name
    per_replica = [p for p in panels if p["title"] in PER_REPLICA]
    assert len(per_replica) == len(PER_REPLICA)
    for panel in per_replica:
        for target in panel["targets"]:
            assert "by (instance, instanceId" in target["expr"], panel["title"]
    # the model variable templates the panels that have a model label
    assert sum('model=~"$model' in t["expr"] for p in panels for t in p["targets"]) >= 10


def _stacked(panel: dict[str, Any]) -> bool:
    custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
    return custom.get("stacking", {}).get("mode", "none") != "none"


def test_dashboard_shows_each_model_s_phases_right():
    """A row repeated per model: mean time per request of each phase stacked (divided by the
    request count, not each phase's own), p50/p95/p99 of the queue/decode/encode spans
    unstacked, queue wait, fallback and parity; and nowhere a stacked quantile."""
    dashboard = json.loads(DASHBOARD.read_text())
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    assert rows[0].get("repeat") == "model", "the first row repeats per model"
    first_row = []
    for panel in dashboard["panels"][1:]:
        if panel["type"] == "row":
            break
        first_row.append(panel)
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in first_row}
    for panel in _panels(dashboard):
        for expr in (t["expr"] for t in panel["targets"]):
            assert not (_stacked(panel) and "histogram_quantile" in expr), panel["title"]
    (mean,) = [p for p in first_row if _stacked(p)]
    (expr,) = [t["expr"] for t in mean["targets"]]
    numerator, _, denominator = expr.partition(" / ")
    assert "sum by (phase)" in numerator and "vae_phase_seconds_sum" in numerator
    assert "vae_request_seconds_count" in denominator and "vae_phase_seconds" not in denominator
    text = json.dumps(exprs)
    for quantile in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (span, le)" in text, quantile
    for needle in ('span=\\"queue\\"', "vae_fallback_active", "vae_parity_cosine"):
        assert needle in text, needle


# --- the live test: service + Prometheus + every panel and alert --------------------------------


def _free_port() -> int:
    from tests.live import free_port

    return free_port()


def _decode(url: str, model: str, shape: list[int], **params: Any) -> requests.Response:
    n = math.prod(shape)
    body = struct.pack(f"<{n}f", *[((i * 7919) % 13) / 13 - 0.5 for i in range(n)])
    query = [("shape", d) for d in shape] + list(params.items())
    return requests.post(f"{url}/decode/{model}", params=query, data=body, timeout=60,
                         headers={"Content-Type": "tensor/binary"})  # fmt: skip


def _requests_total(url: str) -> float:
    """The service's own count of decode requests, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "vae_requests" for sample in family.samples
               if sample.name == "vae_requests_total")  # fmt: skip


class _Prometheus:
    def __init__(self, base: str) -> None:
        self.base = base

    def api(self, path: str, **params: Any) -> dict[str, Any]:
        r = requests.get(f"{self.base}/api/v1/{path}", params=params, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query, evaluated now or at the unix time `at`."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        return self.api("query", **params)["result"]

    def value(self, expr: str, at: float | None = None) -> float:
        result = self.query(expr, at)
        return float(result[0]["value"][1]) if result else float("nan")

    def wait(self, what: str, check, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if check():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"Prometheus: timed out waiting for {what}")
            time.sleep(0.25)


SELF_HOSTED = {"job": "vae", "service": ".*", "replica": "instance"}
# the five scrape targets of the `prometheus` fixture, all the same live service
SCRAPE_TARGETS = ('job="vae", instance=~"127.*"', 'job="vae", instance=~"localhost.*"',
                  'instanceId="replica-a"', 'instanceId="replica-b"', 'instanceId="replica-c"')  # fmt: skip
CLOUD_RUN = {"job": "run-gmp-sidecar", "service": "vae-render", "replica": "instanceId"}


def _scraped(prom: _Prometheus, target: str, total: float, after_ms: int = 0) -> bool:
    """Whether the target's latest scrape counted `total` requests and was taken after the
    unix time `after_ms` (in ms)."""
    now = time.time()
    counted = prom.value(f"sum(vae_requests_total{{{target}}})", now)
    taken = prom.value(f"min(timestamp(vae_requests_total{{{target}}}))", now)
    return counted == total and taken * 1000 > after_ms


def _sidecar_job(name: str, target: str, service: str, replica: str) -> dict[str, Any]:
    """A scrape job that labels its series as Cloud Run's run-gmp-sidecar does (its
    confgenerator): the same job and instance on every replica and service, the replica in
    instanceId, the service in service_name/namespace."""
    labels = {"job": "run-gmp-sidecar", "instance": "8080", "service_name": service,
              "namespace": service, "cluster": "__run__", "revision_name": f"{service}-00001",
              "instanceId": replica}  # fmt: skip
    return {
        "job_name": name,
        "scrape_interval": "1s",
        "scrape_timeout": "1s",
        "static_configs": [{"targets": [target]}],
        "relabel_configs": [
            {"target_label": k, "replacement": v, "action": "replace"} for k, v in labels.items()
        ],
    }


@pytest.fixture
def prometheus(flux_server, tmp_path):
    """A real Prometheus on loopback scraping the live service every second under both label
    sets: the self-hosted job `vae` (two targets = two replicas by `instance`), and the Managed
    Prometheus sidecar's labels (two replicas of vae-render by `instanceId`, plus a replica of
    another Cloud Run service behind the same sidecar job, which the queries must leave out).
    It loads both rule files: alerts.yml and alerts-cloudrun.yml."""
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROM_DIR / "alerts.yml"), str(PROM_DIR / "alerts-cloudrun.yml")]
    address = flux_server.removeprefix("http://")
    port_of_service = address.rsplit(":", 1)[1]
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "vae")
    job.update(scrape_interval="1s", scrape_timeout="1s")
    job["static_configs"][0]["targets"] = [address, f"localhost:{port_of_service}"]
    config["scrape_configs"] = [
        job,
        _sidecar_job("gmp-a", address, "vae-render", "replica-a"),
        _sidecar_job("gmp-b", address, "vae-render", "replica-b"),
        _sidecar_job("gmp-other", address, "other-service", "replica-c"),
    ]
    with running_prometheus(config, tmp_path) as prom:
        yield prom


@contextmanager
def running_prometheus(config: dict[str, Any], tmp_path: Path) -> Iterator[_Prometheus]:
    """Debian's Prometheus on a loopback port with ``config`` (skips without it); its API once
    ready. tests/test_alerts.py starts one too."""
    binary = _tool("prometheus")
    if binary is None:
        pytest.skip(f"the prometheus server (Debian package prometheus) is absent: {INSTALL_HINT}")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    prom = _Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"{prom.base}/-/ready", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.1)
        yield prom
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _scope(variant: dict[str, str]) -> str:
    return f'job=~"{variant["job"]}", service_name=~"{variant["service"]}"'


def _replicas(result: list[dict[str, Any]], variant: dict[str, str]) -> set[str]:
    """The replicas a query's series come from, by the variant's replica label."""
    return {r["metric"].get(variant["replica"], "") for r in result}


def _without_threshold(expr: str) -> str:
    """An alert expression without its final comparison: the series it compares."""
    body = re.sub(r"\s*(>|<|==)\s*[0-9.]+\s*$", "", expr.strip())
    assert body != expr.strip(), expr
    return body


def _alerts_for(variant: dict[str, str]) -> list[dict[str, Any]]:
    name = "alerts.yml" if variant is SELF_HOSTED else "alerts-cloudrun.yml"
    groups = yaml.safe_load((PROM_DIR / name).read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_cloud_run_rules_are_rendered_from_alerts_yml():
    spec = importlib.util.spec_from_file_location(
        "render_alerts", ROOT / "scripts/render_alerts.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    render = module.render
    text = render((PROM_DIR / "alerts.yml").read_text(), service="vae-render")
    assert (PROM_DIR / "alerts-cloudrun.yml").read_text() == text, (
        "alerts-cloudrun.yml is stale: python scripts/render_alerts.py --cloud-run vae-render "
        "-o deploy/prometheus/alerts-cloudrun.yml"
    )
    for rule in _alerts_for(CLOUD_RUN):
        for selector in re.findall(r"\b(?:vae_\w+|up)\{([^}]*)\}", rule["expr"]):
            assert 'job="run-gmp-sidecar", service_name="vae-render"' in selector, rule["alert"]
    # another self-hosted job name: every selector follows it, the comments stay
    other = render((PROM_DIR / "alerts.yml").read_text(), job="elsewhere")
    exprs = [r["expr"] for g in yaml.safe_load(other)["groups"] for r in g["rules"]]
    assert all('job="elsewhere"' in e and 'job="vae"' not in e for e in exprs)


def test_every_panel_and_alert_against_a_live_prometheus(flux_server, prometheus):
    prom = prometheus
    expected_up = {"vae": 2, "run-gmp-sidecar": 3}
    for job, n in expected_up.items():
        prom.wait(f"the first scrapes of {job}",
                  lambda j=job, n=n: prom.value(f'sum(up{{job="{j}"}})') == n)  # fmt: skip

    def traffic() -> None:
        for model, channels in (("flux-tiny", 16), ("sd-tiny", 4)):
            assert _decode(flux_server, model, [1, channels, 4, 4]).status_code == 200
        assert _decode(flux_server, "flux-tiny", [1, 16, 4, 4], output_type="pt").status_code == 200
        assert _decode(flux_server, "flux-tiny", [1, 4, 4, 4]).status_code == 422  # channels
        assert _decode(flux_server, "no-such-model", [1, 16, 4, 4]).status_code == 404

    # Two waves, each scraped by every target: every series exists before the second wave
    # increments it, so rate() and histogram_quantile() have real increases to work with. Each
    # of the five scrape targets is the same service, so each counts every request once. The
    # waits are on what Prometheus stored (sample timestamps), not on sleeps: a loaded machine
    # delays or drops scrapes.
    traffic()
    served_1 = _requests_total(flux_server)
    for target in SCRAPE_TARGETS:
        prom.wait(f"wave 1 scraped by {target}",
                  lambda t=target: _scraped(prom, t, served_1))  # fmt: skip
    # every target's first sample counting all of wave 1 is older than this (ms): each
    # series of wave 1 exists from here on
    start_ms = math.ceil(time.time() * 1000) + 1
    for target in SCRAPE_TARGETS:
        prom.wait(f"{target} scraped again before wave 2",
                  lambda t=target: _scraped(prom, t, served_1, after_ms=start_ms))  # fmt: skip
    traffic()
    served_2 = _requests_total(flux_server)
    for target in SCRAPE_TARGETS:
        prom.wait(f"wave 2 scraped by {target}",
                  lambda t=target: _scraped(prom, t, served_2))  # fmt: skip
    # rate() windows that see wave 2 only, evaluated at one fixed time: every series then
    # exists for the whole window (a series born inside it skews its ratio), and the window
    # holds, for every target, a sample from before wave 2 and one counting all of it
    at_ms = math.floor(time.time() * 1000)
    at, window = at_ms / 1000, f"{at_ms - start_ms}ms"
    for target in SCRAPE_TARGETS:
        selector = f"vae_requests_total{{{target}}}[{window}]"
        grown = prom.value(f"sum(max_over_time({selector}) - min_over_time({selector}))", at)
        assert grown == served_2 - served_1, (target, window, grown, served_1, served_2)

    dashboard = json.loads(DASHBOARD.read_text())
    jobs = prom.api("label/job/values", **{"match[]": "vae_queue_depth"})
    assert set(jobs) == {"vae", "run-gmp-sidecar"}
    services = prom.api("label/service_name/values",
                        **{"match[]": 'vae_queue_depth{job=~"run-gmp-sidecar"}'})  # fmt: skip
    assert set(services) == {"vae-render", "other-service"}
    for variant in (SELF_HOSTED, CLOUD_RUN):
        _check_dashboard(prom, dashboard, variant, window, at)
        _check_alert_series(prom, variant)

    # ...and Prometheus loaded and evaluated every rule of both files without error
    count = len(_alerts_for(SELF_HOSTED)) + len(_alerts_for(CLOUD_RUN))

    def evaluated() -> bool:
        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        return len(rules) == count and all(r["health"] == "ok" for r in rules)

    prom.wait("every alert rule evaluated", evaluated, timeout=15)
    # healthy replicas with traffic: no alert is firing
    firing = [a for a in prom.api("alerts")["alerts"] if a["state"] == "firing"]
    assert not firing, firing


def _check_dashboard(
    prom: _Prometheus, dashboard: dict[str, Any], variant: dict[str, str], window: str, at: float
) -> None:
    """Every panel query under one label set: data (NaN-free somewhere), per-replica panels
    one series per replica of this service (not one collapsed series, not other services').
    The stacked means are checked over `window`, evaluated at the unix time `at`."""
    name = variant["job"]
    models = prom.api("label/model/values",
                      **{"match[]": f"vae_model_load_seconds{{{_scope(variant)}}}"})  # fmt: skip
    assert {"flux-tiny", "sd-tiny", "flux2-tiny"} <= set(models), (name, models)
    choices = {"one model": "flux-tiny", "All": "(" + "|".join(models) + ")"}
    empty, all_nan = [], []
    for label, model in choices.items():
        variables = {"job": variant["job"], "service": variant["service"], "model": model,
                     "__rate_interval": "1m", "__interval": "5s", "__range": "5m"}  # fmt: skip
        for panel in _panels(dashboard):
            values = []
            for target in panel["targets"]:
                expr = _substitute(target["expr"], variables)
                result = prom.query(expr)
                if not result and not any(m in expr for m in NVML_METRICS):
                    empty.append(f"[{name} {label}] {panel['title']}: {expr}")
                values += [float(r["value"][1]) for r in result]
                if panel["title"] in PER_REPLICA and result:
                    replicas = _replicas(result, variant)
                    assert len(replicas) == 2, (name, panel["title"], replicas)
            if values and not any(math.isfinite(v) for v in values):
                all_nan.append(f"[{name} {label}] {panel['title']}")
    assert not empty, "panel queries with no data:\n" + "\n".join(empty)
    assert not all_nan, "panels with only NaN:\n" + "\n".join(all_nan)
    (replicas_panel,) = [p for p in _panels(dashboard) if p["title"] == "Replicas scraped"]
    variables = {"job": variant["job"], "service": variant["service"]}
    assert prom.value(_substitute(replicas_panel["targets"][0]["expr"], variables)) == 2, name

    # the stacked phase means add up to no more than the mean successful request (phases are
    # parts of it), and are not each phase's own mean (whose sum could exceed it)
    sel = f'{_scope(variant)}, model="flux-tiny"'
    (mean_panel,) = [p for p in _panels(dashboard) if _stacked(p)]
    variables = {**variables, "model": "flux-tiny", "__rate_interval": window}
    stack = sum(float(r["value"][1]) for r in
                prom.query(_substitute(mean_panel["targets"][0]["expr"], variables), at))  # fmt: skip
    mean_request = prom.value(
        f'sum(rate(vae_request_seconds_sum{{{sel}, code_class="2xx"}}[{window}]))'
        f' / sum(rate(vae_request_seconds_count{{{sel}, code_class="2xx"}}[{window}]))',
        at,
    )
    # rate() extrapolates each series from its own samples at the window's edges: compare
    # loosely here, exactly on the raw counters below
    assert 0 < stack <= mean_request * 1.25, (name, stack, mean_request)
    raw_stack = prom.value(
        f"sum(vae_phase_seconds_sum{{{sel}}}) / "
        f'sum(vae_request_seconds_count{{{sel}, code_class="2xx"}})'
    )
    raw_mean = prom.value(
        f'sum(vae_request_seconds_sum{{{sel}, code_class="2xx"}})'
        f' / sum(vae_request_seconds_count{{{sel}, code_class="2xx"}})'
    )
    assert 0 < raw_stack <= raw_mean * 1.001, (name, raw_stack, raw_mean)
    # the device gauge and the 4xx latency were scraped too
    scope = _scope(variant)
    assert prom.value(f'max(vae_device_memory_bytes{{{scope}, kind="allocated"}})') > 0
    assert prom.value(f'sum(vae_request_seconds_count{{{scope}, code_class="4xx"}})') > 0


def _check_alert_series(prom: _Prometheus, variant: dict[str, str]) -> None:
    """Each alert's compared series under one label set: the replicas are this service's (2,
    not the sidecar job's 3), one series per replica for the per-replica rules."""
    rules = {rule["alert"]: rule["expr"] for rule in _alerts_for(variant)}
    for expr in rules.values():
        prom.query(expr)  # evaluates (the query API answers success)
    up = prom.query(_without_threshold(rules["VaeTargetDown"]))
    assert len(_replicas(up, variant)) == len(up) == 2, (variant["job"], up)
    queue = prom.query(_without_threshold(rules["VaeQueueSaturated"]))
    assert len(_replicas(queue, variant)) == 2, (variant["job"], queue)
    # every target counts each request once: the scope sees this service's two replicas
    single = prom.value('sum(vae_requests_total{instanceId="replica-a"})')
    total = prom.value(f"sum(vae_requests_total{{{_scope(variant)}}})")
    assert total == 2 * single, (variant["job"], total, single)


# --- structured logs ----------------------------------------------------------------------------


@pytest.fixture
def json_log():
    from app.telemetry.logs import _HANDLER_FLAG, configure_logging

    root = logging.getLogger()
    level = root.level
    stream = io.StringIO()
    configure_logging(json=True, stream=stream)
    try:
        yield stream
    finally:
        root.setLevel(level)
        for handler in [h for h in root.handlers if getattr(h, _HANDLER_FLAG, False)]:
            root.removeHandler(handler)


def test_request_log_is_one_cloud_logging_json_line(json_log):
    from app.telemetry.logs import escape_controls, log_request

    hostile = 'x%s%(message)s{0}"\n\\'
    logged = escape_controls(hostile)  # the newline as a visible \x0a: no forged lines
    fields = log_request(
        "req-1", "flux-tiny", (1, 16, 64, 64), "png", 200,
        {"parse": 0.41, "up_0": 12.3456, "encode": 3.2}, "cuda", False, 0.1234, "POST",
        f"http://svc/decode/flux-tiny?shape=1&shape=16&q={hostile}", hostile, 4096,
        trace_header="0af7651916cd43dd8448eb211c80319c/12345;o=1", project="my-project",
    )  # fmt: skip
    lines = json_log.getvalue().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["severity"] == "INFO"
    # the request's id in the message too, as the text format has it (docs: one line each)
    assert (
        entry["message"]
        == f"POST http://svc/decode/flux-tiny?shape=1&shape=16&q={logged} 200 0.123s id=req-1"
    )  # noqa: E501
    http = entry["httpRequest"]
    assert http == {"requestMethod": "POST", "requestUrl": fields["httpRequest"]["requestUrl"],
                    "status": 200, "latency": "0.123400s", "responseSize": "4096",
                    "userAgent": logged, "protocol": "HTTP/1.1"}  # fmt: skip
    assert entry["request_id"] == "req-1" and entry["model"] == "flux-tiny"
    assert entry["shape"] == [1, 16, 64, 64] and entry["output"] == "png"
    assert entry["status"] == 200 and entry["device"] == "cuda" and entry["fallback"] is False
    assert entry["phases_ms"] == {"parse": 0.41, "up_0": 12.346, "encode": 3.2}
    assert entry["latency_ms"] == 123.4
    assert entry["logging.googleapis.com/trace"] == (
        "projects/my-project/traces/0af7651916cd43dd8448eb211c80319c"
    )
    assert entry["logging.googleapis.com/spanId"] == f"{12345:016x}"
    assert entry["logging.googleapis.com/trace_sampled"] is True
    assert entry["time"].endswith("Z")


def test_request_log_severity_trace_and_clipping(json_log):
    from app.telemetry.logs import MAX_URL, log_request

    long_url = "http://svc/" + "a" * 5000
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    log_request("r2", None, None, None, 500, {}, None, None, 0.5, "POST", long_url, None, None,
                trace_header=traceparent, project="p")  # fmt: skip
    log_request("r3", "m", [1], "pt", 422, {}, "cpu", True, 0.01, "POST", "http://svc/", "ua",
                10, trace_header="garbage", project="p")  # fmt: skip
    # a 503 is load, a deadline or a shutdown: a warning, as a 4xx
    log_request("r4", "m", [1], "pt", 503, {}, "cpu", False, 0.01, "POST", "http://svc/", "ua",
                10, project="p")  # fmt: skip
    first, second, third = (json.loads(line) for line in json_log.getvalue().splitlines())
    assert first["severity"] == "ERROR" and second["severity"] == third["severity"] == "WARNING"
    assert len(first["httpRequest"]["requestUrl"]) == MAX_URL
    assert "responseSize" not in first["httpRequest"]
    assert (
        first["logging.googleapis.com/trace"]
        == "projects/p/traces/4bf92f3577b34da6a3ce929d0e0e4736"
    )  # noqa: E501
    assert first["logging.googleapis.com/spanId"] == "00f067aa0ba902b7"
    assert "logging.googleapis.com/trace" not in second  # an unparseable header is dropped
    assert second["fallback"] is True


def test_other_log_records_are_json_too(json_log):
    log = logging.getLogger("app.runtime.runner")
    log.warning("model %s served on the fallback: %s", "flux", "cosine 0.99 < 0.9999")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("decode failed for model %s", "flux")
    warning, error = (json.loads(line) for line in json_log.getvalue().splitlines())
    assert warning["severity"] == "WARNING" and warning["logger"] == "app.runtime.runner"
    assert warning["message"] == "model flux served on the fallback: cosine 0.99 < 0.9999"
    assert error["severity"] == "ERROR" and "ValueError: boom" in error["message"]
    assert "Traceback" in error["message"]


def test_log_format_from_env(monkeypatch):
    from app.telemetry.logs import json_from_env, uvicorn_kwargs

    monkeypatch.delenv("VAE_LOG_FORMAT", raising=False)
    monkeypatch.delenv("K_SERVICE", raising=False)
    assert json_from_env() is False
    # one request line in both formats: ours; uvicorn's access line off, its loggers ours
    assert uvicorn_kwargs() == {"log_config": None, "access_log": False}
    monkeypatch.setenv("K_SERVICE", "vae-render")  # Cloud Run
    assert json_from_env() is True
    monkeypatch.setenv("VAE_LOG_FORMAT", "text")
    assert json_from_env() is False
