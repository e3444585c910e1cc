#!/usr/bin/env bash
# The service's packages the lent GPU machine lacks (it is offline, with Python 3.12 and a
# CUDA torch), downloaded here as wheels into the git-ignored .whl/ that scripts/gpu_proof.sh
# installs from there (docs/gpu/README.md). tests/test_gpu_proof.py checks that every
# dependency in pyproject.toml is carried (WHEELS) or already in the machine's image (THERE).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
# imageio-ffmpeg 0.6.0: newer wheels carry a 68 MB ffmpeg, over the device's 64 MB transfer;
# fastapi 0.165 imports opentelemetry-api (without it the first H200 run stopped at import)
THERE=(torch numpy pillow safetensors prometheus-client nvidia-ml-py packaging lazy-loader)
WHEELS=(
    diffusers==0.42.1 fastapi starlette uvicorn pydantic pydantic-core pydantic-settings
    python-dotenv typing-inspection annotated-types imageio-ffmpeg==0.6.0 opentelemetry-api
    importlib_metadata lazy-importer typing_extensions annotated-doc fastapi-offline==1.7.7 fpng
)
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d .whl "${WHEELS[@]}"
du -sh .whl
