"""Shared fixtures: paths, small configs, and a live uvicorn server on loopback."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Idle OpenMP threads sleep rather than spin (read when torch loads: before its import here,
# and inherited by the xdist workers and every process a test starts): spinning ones took the
# cores from the processes with work (docs/BENCHMARKS.md, "`make test`").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from tests import order  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

# One torch thread per test process (and the live servers it runs on its threads): the suite
# runs more processes than cores (Makefile), and a second thread each only added the cost of
# waking it (docs/BENCHMARKS.md, "`make test` on an AVX2-only CPU").
torch.set_num_threads(1)


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or skip: a user's clone has no ../shared."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent: ../shared ships only beside the project's CI checkout")
    return path


@pytest.fixture(autouse=True)
def _bf16_kernels(request: pytest.FixtureRequest) -> None:
    """A test marked ``bf16_kernels`` computes in bf16 on the CPU: where bf16 is emulated
    (measured: ``app.runtime.device.cpu_bf16_slowdown``) it would take minutes, for a path
    the service does not serve there (``auto`` measures float32 only), so it skips."""
    if request.node.get_closest_marker("bf16_kernels") is None:
        return
    from app.runtime.device import cpu_bf16_slowdown, cpu_emulates_bf16

    if cpu_emulates_bf16():
        pytest.skip(
            f"bf16 is emulated on this CPU (a bf16 convolution takes {cpu_bf16_slowdown():.0f}x "
            f"float32's time): this bf16 computation runs on CPUs with bf16 kernels"
        )


@pytest.fixture(scope="session")
def flux_store(tmp_path_factory) -> Path:
    """Tiny FLUX.1 / SD / FLUX.2 decoders with seeded weights."""
    from tests.live import TINY_FLUX, bake

    store = tmp_path_factory.mktemp("store")
    for name, config in TINY_FLUX.items():
        bake(store, "flux", name, config)
    return store


@pytest.fixture(scope="session")
def flux_server(flux_store):
    from tests.live import live_server

    with live_server(flux_store, dtype="float32", default_model="flux-tiny") as url:
        yield url


@pytest.fixture(scope="session", autouse=True)
def _count_order_consults() -> Iterator[None]:
    """Count every read of the bf16 candidate order in this process (tests/order.py)."""
    from app.runtime import modes

    read = modes.cpu_has_fast_bf16

    def counted() -> bool:
        order.note()
        return read()

    modes.cpu_has_fast_bf16 = counted
    yield
    modes.cpu_has_fast_bf16 = read


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``bf16_order`` runs twice in the one session: in the candidate order the
    environment gives (this CPU's, unless VAE_CPU_FAST_BF16 is set) and in the other (the
    parameter ``bf16_candidate_order``, applied by ``_bf16_candidate_order``)."""
    mark = metafunc.definition.get_closest_marker(order.MARK)
    if mark and not mark.kwargs.get("set_by_test"):  # a test that sets it runs each itself
        metafunc.fixturenames.append(order.PARAM)
        metafunc.parametrize(order.PARAM, order.ORDERS)


@pytest.fixture(autouse=True)
def _bf16_candidate_order(request: pytest.FixtureRequest, monkeypatch) -> None:
    """``swapped``: VAE_CPU_FAST_BF16 set to the opposite of what the process reads now (the
    servers a test starts inherit it). Read unpatched: asking is not the test's consult."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get(order.PARAM) != "swapped":
        return
    from app.runtime.device import cpu_has_fast_bf16

    monkeypatch.setenv("VAE_CPU_FAST_BF16", str(int(not cpu_has_fast_bf16())))


@pytest.fixture(autouse=True)
def _order_mark_is_complete(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test whose run read the candidate order runs in both orders: its module is marked."""
    before = order.consults
    yield
    if order.consults > before and not request.node.get_closest_marker(order.MARK):
        pytest.fail(
            f"{request.node.nodeid} read the bf16 candidate order (VAE_DTYPE=auto on a CPU), "
            f"so its outcome may depend on it: mark its module `pytestmark = "
            f"pytest.mark.{order.MARK}` (those run in both orders)"
        )


@pytest.fixture(autouse=True)
def _fresh_faulty_records() -> None:
    """The faulty family's records start empty for every test (they are module globals: a
    tag another module used must not count here)."""
    import sys

    faulty = sys.modules.get("tests.faulty")
    if faulty is not None:
        with faulty._lock:
            faulty.DECODED.clear()
            faulty.BATCHES.clear()


def pytest_terminal_summary(terminalreporter) -> None:
    """The machine the run had, last (a CI log keeps the end of the output: a slow run there
    says which CPU and how loaded). Reported, never read by a test."""
    import resource

    try:
        cpu = open("/proc/cpuinfo").read()
    except OSError:  # not Linux
        cpu = ""
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                  if line.startswith("model name")), "unknown")  # fmt: skip
    flags = set(cpu.split())
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu_s = sum(u.ru_utime + u.ru_stime for u in used)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    terminalreporter.write_line(
        f"machine: {model}, {os.cpu_count()} cores, {' '.join(simd) or 'no avx2'}; "
        f"load average {load}; this run's CPU {cpu_s:.0f} s (its processes, reaped ones)"
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collecting imported (torch, diffusers, the test modules: most of a worker's
    objects) out of the garbage collector's full collections, as `serve` does with its own
    (README, "The collector"): they live for the session anyway (measured: docs/BENCHMARKS.md,
    "Sixteenth session")."""
    import gc

    gc.collect()
    gc.freeze()
