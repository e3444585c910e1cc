#!/usr/bin/env bash
# The GPU check of the fast-path issue, as one prepared script (about 5 minutes on one card):
#   1. the parity gate of every family's embedded models on the device (bf16 and float32);
#   2. the FLUX.1 benchmark against diffusers at 512 and 1024 (bf16 on the GPU), with peaks.
# Run it where torch sees a CUDA device, from the repository root:
#   bash scripts/gpu_check.sh                 # writes its tables to $OUT (or /tmp/gpu_check)
# A machine without diffusers / fastapi can take them as wheels in .whl/ (pip download on a
# machine with network, then carry the folder): they are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
py=${PYTHON:-python3}
$py - <<'PY' || { echo "gpu_check: torch sees no CUDA device"; exit 1; }
import torch
assert torch.cuda.is_available()
print("device:", torch.cuda.get_device_name(), "torch", torch.__version__)
PY
echo "== parity gate, every family"
timeout 150 $py scripts/gpu_gate.py --device cuda | tee "$out/gate.md"
for size in 512 1024; do
    echo "== FLUX.1 ${size}x${size} vs diffusers"
    timeout 120 $py -m bench flux --size "$size" --repeats 10 --device cuda --memory \
        | tee "$out/flux_${size}.md"
done
