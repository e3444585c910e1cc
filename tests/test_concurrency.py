"""Issue 36.1-36.2: every per-instance admission limit follows from one declared concurrency
(``VAE_CONCURRENCY``, Cloud Run's ``containerConcurrency``), or the service refuses to start,
naming the values that disagree; the Cloud Run manifest's body limit stays under the platform's
32 MiB request limit, and its 413 says so. A real server in the manifest's own settings takes
``containerConcurrency`` concurrent image and MP4 decodes without one 429 or 503."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml
from pydantic import ValidationError

from app.config import CLOUD_RUN_REQUEST_MB, Settings
from tests import faulty, launch
from tests.helpers import metric, raw_request, read_response
from tests.mp4_client import video_latent

MANIFEST = faulty.ROOT / "deploy/cloudrun/service.yaml"
LIMITS = ("VAE_CONCURRENCY", "VAE_QUEUE_DEPTH", "VAE_STREAMS_MAX", "VAE_BODIES_MB",
          "VAE_MAX_BODY_MB", "VAE_PLATFORM")  # fmt: skip


@pytest.fixture(autouse=True)
def no_limits_in_the_environment(monkeypatch):
    """The unit cases read only their own arguments (a developer's shell may export some)."""
    for name in LIMITS:
        monkeypatch.delenv(name, raising=False)


def manifest() -> tuple[int, dict[str, str]]:
    """deploy/cloudrun/service.yaml: the service container's concurrency and environment."""
    spec = yaml.safe_load(MANIFEST.read_text())["spec"]["template"]["spec"]
    (vae,) = [c for c in spec["containers"] if c["name"] == "vae"]
    return int(spec["containerConcurrency"]), {e["name"]: str(e["value"]) for e in vae["env"]}


# --- the derived limits and the refusal ---------------------------------------------------


def test_without_a_declared_concurrency_the_defaults_stand():
    s = Settings()
    assert s.concurrency is None
    assert (s.queue_depth, s.streams_max, s.bodies_mb, s.max_body_mb) == (32, 8, 1024, 256)


def test_every_admission_limit_derives_from_the_concurrency():
    # each may hold a 256 MiB bf16 body parsed to float32 and 8 float32 2048x2048 images
    s = Settings(concurrency=16)
    assert (s.queue_depth, s.streams_max, s.bodies_mb) == (16, 16, 16 * (2 * 256 + 8 * 48))
    derived = {"queue_depth", "streams_max", "bodies_mb"}
    assert "concurrency" in s.model_fields_set and not derived & s.model_fields_set  # not set
    s = Settings(concurrency=3, max_body_mb=10)  # an image of 2048x2048 float32 pixels: 48 MiB
    assert (s.queue_depth, s.streams_max, s.bodies_mb) == (3, 3, 3 * (48 + 8 * 48))
    assert Settings(concurrency=3, max_batch=1, max_output_mb=20).bodies_mb == 3 * (512 + 20)


def test_cloud_run_bounds_the_body_limit_under_its_32_mib():
    s = Settings(platform="cloud-run")
    assert s.max_body_mb == CLOUD_RUN_REQUEST_MB - 1 == 31
    assert Settings(platform="cloud-run", concurrency=16).bodies_mb == 16 * (2 * 31 + 8 * 48)
    assert Settings(platform="cloud-run", max_body_mb=8).max_body_mb == 8  # lower is fine
    with pytest.raises(ValidationError) as refused:
        Settings(platform="cloud-run", max_body_mb=32)
    assert "VAE_MAX_BODY_MB=32 > 31 with VAE_PLATFORM=cloud-run" in str(refused.value)


def test_explicit_values_at_or_above_what_the_concurrency_needs_are_kept():
    s = Settings(concurrency=16, queue_depth=40, streams_max=16, bodies_mb=8000, max_body_mb=31)
    assert (s.queue_depth, s.streams_max, s.bodies_mb) == (40, 16, 8000)
    s = Settings(concurrency=16, queue_depth=16)  # one explicit, the others derived
    assert (s.queue_depth, s.streams_max, s.bodies_mb) == (16, 16, 16 * 896)


@pytest.mark.parametrize(
    ("explicit", "message"),
    [
        ({"streams_max": 8}, "VAE_STREAMS_MAX=8 < VAE_CONCURRENCY=16"),
        ({"queue_depth": 15}, "VAE_QUEUE_DEPTH=15 < VAE_CONCURRENCY=16"),
        (
            {"bodies_mb": 4096, "max_body_mb": 256},
            "VAE_BODIES_MB=4096 < VAE_CONCURRENCY=16 x 896 MiB",
        ),
    ],
)
def test_an_explicit_value_below_what_the_concurrency_needs_is_refused(explicit, message):
    with pytest.raises(ValidationError) as refused:
        Settings(concurrency=16, **explicit)
    assert message in str(refused.value)


def test_values_from_the_environment_count_as_explicit(monkeypatch):
    """The issue's replica: concurrency and queue 16 from the manifest, streams 8."""
    monkeypatch.setenv("VAE_CONCURRENCY", "16")
    monkeypatch.setenv("VAE_QUEUE_DEPTH", "16")
    monkeypatch.setenv("VAE_STREAMS_MAX", "8")
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert "VAE_STREAMS_MAX=8 < VAE_CONCURRENCY=16" in str(refused.value)
    assert "VAE_QUEUE_DEPTH" not in str(refused.value)  # 16 is enough
    monkeypatch.delenv("VAE_STREAMS_MAX")
    assert Settings().streams_max == 16


def serve_refusal(store: Path, env: dict[str, str]) -> tuple[int, list[str]]:
    """``python -m app serve`` run with ``env`` until it exits: its status and output lines."""
    run = launch.run(
        [sys.executable, "-m", "app", "serve", "--models-dir", str(store)],
        cwd=faulty.ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return run.returncode, (run.stdout + run.stderr).strip().splitlines()


def test_serve_refuses_an_inconsistent_set_in_one_line(tmp_path):
    env = {**os.environ, "VAE_CONCURRENCY": "16", "VAE_STREAMS_MAX": "8",
           "VAE_API_TOKENS": "do-not-print-me", "VAE_LOG_FORMAT": "text"}  # fmt: skip
    code, lines = serve_refusal(tmp_path, env)
    assert code == 2, lines
    assert len(lines) == 1, lines  # no traceback, no pydantic banner
    assert "refusing to start: VAE_STREAMS_MAX=8 < VAE_CONCURRENCY=16" in lines[0]
    assert "do-not-print-me" not in lines[0]


def test_serve_names_a_misspelt_variable_and_the_setting_it_is_close_to(tmp_path):
    """pydantic ignores a ``VAE_*`` variable no setting reads: a misspelt limit would be its
    default in silence. The build's arguments (VAE_NAME) are not settings, and not warned."""
    env = {**os.environ, "VAE_LOG_FORMAT": "text", "VAE_MAX_BATCHES": "2", "vae_concurency": "4",
           "VAE_NAME": "flux1-dev", "VAE_THREADS": "-1"}  # fmt: skip
    code, lines = serve_refusal(tmp_path, env)
    assert code == 2, lines
    warned = [line for line in lines if "is not a setting" in line]
    assert len(warned) == 2, lines
    assert "VAE_MAX_BATCHES is not a setting (did you mean VAE_MAX_BATCH?)" in "".join(warned)
    assert "vae_concurency is not a setting (did you mean VAE_CONCURRENCY?)" in "".join(warned)
    assert "refusing to start: VAE_THREADS: " in lines[-1], lines


def test_the_manifest_declares_its_concurrency_and_every_limit_follows():
    concurrency, env = manifest()
    assert env["VAE_CONCURRENCY"] == str(concurrency)
    s = Settings(**{k.removeprefix("VAE_").lower(): v for k, v in env.items() if k in LIMITS})
    assert s.queue_depth >= concurrency and s.streams_max >= concurrency
    assert s.bodies_mb >= concurrency * s.held_mb() >= concurrency * 2 * s.max_body_mb
    assert s.max_body_mb < CLOUD_RUN_REQUEST_MB  # a body and its headers pass the front end


# --- the manifest's own settings on a real server -----------------------------------------


@pytest.fixture(scope="module")
def manifest_server(tmp_path_factory):
    """``python -m app serve`` with deploy/cloudrun/service.yaml's environment, changed only
    where a CPU test machine needs it: the CPU, float32, the test store, no GCP project."""
    tmp = tmp_path_factory.mktemp("manifest")
    store = tmp / "store"
    with faulty.registered():
        faulty.bake(store, "faulty")
        faulty.bake(store, "faulty-video", video=True)
    concurrency, env = manifest()
    env |= {"VAE_DEVICE": "cpu", "VAE_DTYPE": "float32", "GOOGLE_CLOUD_PROJECT": "test-project",
            "VAE_COMPILE_CACHE_DIR": str(tmp / "compile-cache")}  # fmt: skip
    with faulty.serve_process(store, tmp / "serve.log", True, **env) as (url, _):
        yield url, concurrency, tmp / "serve.log"


def _image(tag: float) -> tuple[str, bytes, dict]:
    z = faulty.latent(faulty.SLEEP, 0.02, tag)
    params = {"shape": json.dumps(list(z.shape)), "output_type": "pil"}
    return "faulty", z.numpy().tobytes(), params


def _mp4(tag: float) -> tuple[str, bytes, dict]:
    z = video_latent(tag, frames=3, size=4, command=faulty.SLEEP, arg=0.02)
    params = {"shape": json.dumps(list(z.shape)), "output_type": "mp4"}
    return "faulty-video", z.numpy().tobytes(), params


def _send(url: str, request: tuple[str, bytes, dict], into: list) -> threading.Thread:
    model, body, params = request

    def call() -> None:
        r = requests.post(f"{url}/decode/{model}", data=body, params=params, timeout=120,
                          headers={"Content-Type": "tensor/binary"})  # fmt: skip
        into.append((model, r.status_code, r.headers, r.content))

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def test_the_declared_concurrency_of_image_and_mp4_decodes_is_never_refused(manifest_server):
    """Cloud Run sends a replica at most containerConcurrency requests at once. Here exactly
    that many are in the replica at once, all admitted before any is decoded: one image decode
    holds the worker (HOLD) while the others, three quarters of them MP4s (the issue's 12 of
    16, past the old stream cap of 8), all wait in the queue; then it is released. None may be
    refused. Requests past the declared concurrency (which Cloud Run never sends) may be
    refused, but only with 429 + Retry-After."""
    url, concurrency, log = manifest_server
    held = 3601.0
    mp4s = concurrency * 3 // 4
    answers: list = []
    threads = [_send(url, ("faulty", faulty.latent(faulty.HOLD, 0, held).numpy().tobytes(),
                           {"shape": "[1,4,4,4]", "output_type": "pil"}), answers)]  # fmt: skip
    faulty.wait_for("the held decode started", lambda: faulty.started(held) or answers)
    assert answers == [], answers
    others = [_mp4(3700.0 + i) for i in range(mp4s)]
    others += [_image(3800.0 + i) for i in range(concurrency - 1 - mp4s)]
    threads += [_send(url, request, answers) for request in others]
    queued = lambda: metric(url, "vae_queue_depth") == concurrency - 1  # noqa: E731
    faulty.wait_for("every one admitted, or one answered", lambda: queued() or answers)
    assert answers == [], [(model, status, content[:120]) for model, status, _, content in answers]
    # past the declared concurrency: what Cloud Run never sends
    extra: list = []
    beyond = [_send(url, request, extra) for request in (_image(3900.0), _mp4(3901.0),
                                                          _image(3902.0), _mp4(3903.0))]  # fmt: skip
    faulty.wait_for("the extra requests answered or queued", lambda: len(extra) + (
        metric(url, "vae_queue_depth") - (concurrency - 1)) == len(beyond))  # fmt: skip
    faulty.release(held)
    for t in threads + beyond:
        t.join(120)
    codes = sorted((model, status) for model, status, _, _ in answers)
    assert [status for _, status in codes] == [200] * concurrency, (codes, log.read_text()[-3000:])
    for model, _, headers, content in answers:
        if model == "faulty-video":
            assert headers["content-type"] == "video/mp4" and content[4:8] == b"ftyp"
        else:
            assert content.startswith(b"\x89PNG")
    for _, status, headers, _ in extra:
        assert status in (200, 429), status
        if status == 429:
            assert int(headers["Retry-After"]) >= 1
    refused = sum(status == 429 for _, status, _, _ in extra)
    print(f"{concurrency} concurrent ({mp4s} MP4s): all 200; {len(extra)} beyond: "
          f"{refused} x 429 (queue full), {len(extra) - refused} x 200")  # fmt: skip


def test_a_body_over_the_manifests_limit_gets_a_413_naming_it_and_the_way_around(
    manifest_server,
):
    """Cloud Run refuses HTTP/1 requests over 32 MiB itself; a body over the service's 31 MiB
    that reaches it is answered before it is sent, naming the limit, the setting, Cloud Run's
    limit and what to send instead."""
    url, _, _ = manifest_server
    limit = 31 << 20
    sock = raw_request(url, "/decode/faulty?shape=[1,4,4,4]",
                       headers={"Content-Length": str(limit + 1)})  # fmt: skip
    status, body = read_response(sock)
    assert status == 413, body
    assert f"exceeds the limit of {limit} bytes (VAE_MAX_BODY_MB=31" in body["error"]
    assert "Cloud Run's 32 MiB" in body["error"]
    assert "bfloat16" in body["expected"]
    started = time.monotonic()
    target = "/decode/faulty?shape=[1,4,2048,2048]&dtype=float32"  # 64 MiB declared
    status, body = read_response(raw_request(url, target, headers={"Content-Length": "0"}))
    assert status == 413 and "VAE_MAX_BODY_MB" in body["error"], body
    assert "float16" in body["expected"] and time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("PORT", "abc"),
        ("VAE_LOG_FORMAT", "yaml"),
        ("VAE_THREADS", "-1"),
        ("VAE_WARMUP_SHAPES", "1x16xfoo"),
        ("VAE_H264_ENCODER", "bogus"),
        ("VAE_MAX_PIXELS", "0"),
        ("VAE_PARITY_MIN_COS", "0"),
        ("VAE_PARITY_MIN_COS", "inf"),
        ("VAE_HEAP_IDLE_S", "inf"),
        ("VAE_BATCH_WINDOW_MS", "inf"),
        ("VAE_DEVICE_MEMORY_GB", "inf"),
        ("VAE_DRAIN_GRACE_S", "0.2"),
        ("VAE_FORWARDED_ALLOW_IPS", "127.0.0.1,notanip"),
        ("VAE_API_TOKENS", " , "),
    ],
)
def test_serve_refuses_a_bad_value_in_one_line_naming_its_variable(tmp_path, variable, value):
    """Not a traceback at startup, nor a value taken silently that fails later (a warm-up
    shape that killed the loader thread while /readyz turned 200; an infinite wait that
    killed the decode worker's thread; tokens that expand to none, leaving the service open)."""
    env = {**os.environ, "VAE_LOG_FORMAT": "text", variable: value}
    code, lines = serve_refusal(tmp_path, env)
    assert code == 2 and len(lines) == 1, lines
    assert f"refusing to start: {variable}: " in lines[0], lines


def test_an_empty_model_or_cache_folder_is_unset(monkeypatch):
    """A template's blank variable means the default: POST /decode's model is then the only
    one served, not a model named "" (a 404); Inductor's caches are not the working folder."""
    from app.config import Settings

    monkeypatch.setenv("VAE_DEFAULT_MODEL", "")
    monkeypatch.setenv("VAE_COMPILE_CACHE_DIR", " ")
    settings = Settings()
    assert settings.default_model is None and settings.compile_cache_dir is None
