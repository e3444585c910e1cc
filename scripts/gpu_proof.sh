#!/usr/bin/env bash
# The GPU proof in one command (scripts/gpu_proof.py says what it checks):
#   bash scripts/gpu_proof.sh                         # on a GPU machine: report in $OUT
#   bash scripts/gpu_proof.sh --device cpu --quick    # anywhere, a few minutes on 2 cores
# A machine without the service's packages (the lent GPU machine: offline, torch preinstalled)
# takes them as wheels in .whl/ (scripts/gpu_wheels.sh, on a machine with network):
# they are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then py=.venv/bin/python; fi
# found, not imported (diffusers alone takes seconds to import)
needs="import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in
('fastapi', 'fastapi_offline', 'uvicorn', 'pydantic_settings', 'imageio_ffmpeg', 'diffusers')))"
if ! "$py" -c "$needs" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
exec "$py" scripts/gpu_proof.py --out "${OUT:-/tmp/gpu_proof}" "$@"
