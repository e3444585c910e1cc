#!/usr/bin/env bash
# The build steps of Dockerfile.gpu as a plain script, runnable without Docker.
#
# Dockerfile.gpu runs these very steps (builder: `venv torch install`, baker: `bake`), so CI,
# which cannot run Docker on its machines, exercises the same code path the image build does
# (tests/test_deploy.py runs `bake smoke`; the full list runs anywhere with network access).
#
#   scripts/build_image.sh [STEP ...]        steps, in order: venv torch install cuda bake smoke
#                                            (default: all but cuda, which needs a CUDA torch)
#
# Environment (all optional):
#   VENV              virtual environment to create / use        (default: .build/venv)
#   PYTHON            interpreter that creates VENV              (default: python3.11, else python3)
#   STORE             model store to bake into                   (default: .build/models)
#   TORCH_INDEX_URL   index for torch only; Dockerfile.gpu passes https://download.pytorch.org/whl/cu128
#                     (a CUDA 12 build for Cloud Run's L4 driver, 535 / CUDA 12.2); default: PyPI's
#   TARGET_CUDA       cuda step: the CUDA version the target's driver supports (default: 12.2);
#                     fails when torch is a CPU build or built for a newer CUDA major
#   VAE_FAMILY        flux | ltx | minimax-h3 | taesd: import a real checkpoint ...
#   VAE_CHECKPOINT    ... from this path: a diffusers `vae/` folder (config.json + safetensors),
#                     a pipeline folder holding `vae/`, a single file (ae.safetensors, *.pth), or
#                     a folder holding exactly one such file
#   VAE_NAME          ... under this store name (required with VAE_FAMILY)
#   VAE_IMPORT_DTYPE  float32 | bfloat16 | float16 (default: the checkpoint's own dtype)
#   VAE_BAKE_ONLY     with no VAE_FAMILY: space-separated synthetic names to bake (default: all)
#   SMOKE_TIMEOUT     seconds the smoke step waits for /readyz (default: 600)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.build/venv}
STORE=${STORE:-$ROOT/.build/models}
if [ -z "${PYTHON:-}" ]; then
    PYTHON=$(command -v python3.11 || command -v python3)
fi
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Absolute paths, then run from the project root (`python -m app` finds the tree's app/ when the
# venv is a development one without the project installed).
STORE=$(realpath -m "$STORE")
if [ -n "${VAE_CHECKPOINT:-}" ]; then VAE_CHECKPOINT=$(realpath -m "$VAE_CHECKPOINT"); fi
VENV=$(realpath -m "$VENV")
cd "$ROOT"

log() { printf '[build_image] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# The exact torch pin of pyproject.toml (one source of truth for the version).
torch_spec() {
    sed -n 's/^[[:space:]]*"\(torch==[^"]*\)".*/\1/p' "$ROOT/pyproject.toml" | head -n 1
}

step_venv() {
    if [ -x "$VENV/bin/python" ]; then
        log "venv: reusing $VENV"
    else
        log "venv: creating $VENV with $PYTHON"
        "$PYTHON" -m venv "$VENV"
    fi
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
}

step_torch() {
    local spec
    spec=$(torch_spec)
    [ -n "$spec" ] || die "no torch==X pin found in pyproject.toml"
    log "torch: installing $spec${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}"
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        "$VENV/bin/python" -m pip install --quiet --index-url "$TORCH_INDEX_URL" \
            --extra-index-url https://pypi.org/simple "$spec"
    else
        "$VENV/bin/python" -m pip install --quiet "$spec"
    fi
}

step_install() {
    log "install: the project (non-editable) into $VENV"
    "$VENV/bin/python" -m pip install --quiet "$ROOT"
    "$VENV/bin/python" -c 'import torch, app.cli; print("torch", torch.__version__, "cuda", torch.version.cuda)'
}

# The installed torch must run on the target's driver (scripts/check_torch_cuda.py says why not).
step_cuda() {
    log "cuda: torch's CUDA build against the target driver's CUDA ${TARGET_CUDA:-12.2}"
    "$VENV/bin/python" "$ROOT/scripts/check_torch_cuda.py" "${TARGET_CUDA:-12.2}" \
        || die "torch cannot run on the target's driver (see above)"
}

# A folder that is not a diffusers folder but holds exactly one checkpoint file -> that file
# (Dockerfile.gpu copies a single-file checkpoint into /ckpt/, so it arrives as a folder).
resolve_checkpoint() {
    local src=$1
    if [ -d "$src" ] && [ ! -e "$src/config.json" ] && [ ! -e "$src/vae/config.json" ]; then
        local files=()
        while IFS= read -r -d '' f; do files+=("$f"); done < <(
            find "$src" -maxdepth 1 -type f \( -name '*.safetensors' -o -name '*.pth' \
                -o -name '*.pt' -o -name '*.ckpt' -o -name '*.sft' \) -print0)
        if [ "${#files[@]}" -eq 1 ]; then
            src=${files[0]}
        fi
    fi
    printf '%s\n' "$src"
}

step_bake() {
    mkdir -p "$STORE"
    if [ -n "${VAE_FAMILY:-}" ]; then
        [ -n "${VAE_NAME:-}" ] || die "VAE_NAME is required with VAE_FAMILY"
        [ -e "${VAE_CHECKPOINT:-}" ] || die "VAE_CHECKPOINT '${VAE_CHECKPOINT:-}' does not exist"
        local src
        src=$(resolve_checkpoint "$VAE_CHECKPOINT")
        log "bake: importing $VAE_FAMILY checkpoint $src as $VAE_NAME into $STORE"
        local dtype=()
        if [ -n "${VAE_IMPORT_DTYPE:-}" ]; then dtype=(--dtype "$VAE_IMPORT_DTYPE"); fi
        "$VENV/bin/python" -m app import "$VAE_FAMILY" "$src" --name "$VAE_NAME" \
            --models-dir "$STORE" "${dtype[@]}"
    else
        log "bake: no VAE_FAMILY given; baking the embedded synthetic defaults into $STORE"
        local only=()
        # shellcheck disable=SC2206  # a space-separated list, split on purpose
        if [ -n "${VAE_BAKE_ONLY:-}" ]; then only=(--only $VAE_BAKE_ONLY); fi
        "$VENV/bin/python" -m app bake --synthetic --models-dir "$STORE" "${only[@]}"
    fi
    ls -l "$STORE"/*/ >&2
    # The image serves as uid 10001, not as the baker (root): every entry must be readable.
    local unreadable
    unreadable=$(find "$STORE" \( \( -type f ! -perm -0444 \) -o \( -type d ! -perm -0555 \) \) -print)
    [ -z "$unreadable" ] || die "not readable by the service's user: $unreadable"
}

# Start `python -m app serve` on the store, wait for /readyz, decode one latent, read /metrics,
# then SIGTERM it and require a clean exit: what the container does on Cloud Run, minus Docker.
step_smoke() {
    log "smoke: serving $STORE"
    "$VENV/bin/python" - "$STORE" "${SMOKE_TIMEOUT:-600}" <<'PY'
import json, os, signal, socket, struct, subprocess, sys, time, urllib.error, urllib.request

store, timeout = sys.argv[1], float(sys.argv[2])
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
url = f"http://127.0.0.1:{port}"
env = dict(os.environ, PORT=str(port), VAE_MODELS_DIR=store)
server = subprocess.Popen([sys.executable, "-m", "app", "serve", "--host", "127.0.0.1"], env=env)


def get(path, data=None, headers=None):
    req = urllib.request.Request(url + path, data=data, headers=headers or {})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, dict(r.headers), r.read()


try:
    deadline, ready = time.monotonic() + timeout, None
    while time.monotonic() < deadline and server.poll() is None:
        try:
            ready = get("/readyz")
            break
        except urllib.error.HTTPError as exc:
            ready = (exc.code, {}, exc.read())
        except OSError:
            pass
        time.sleep(0.5)
    if ready is None or ready[0] != 200:
        sys.exit(f"smoke: /readyz never answered 200 within {timeout:.0f}s: {ready}")
    models = json.loads(get("/models")[2])["models"]
    model = next((m for m in models if not m["config"]["video"]), models[0])
    cfg = model["config"]
    cells = max(1, 64 // cfg["spatial_scale"]) if not cfg["video"] else max(1, 256 // cfg["spatial_scale"])
    shape = [1, cfg["latent_channels"]] + ([2] if cfg["video"] else []) + [cells, cells]
    n = 1
    for d in shape:
        n *= d
    body = struct.pack(f"<{n}f", *([0.0] * n))
    query = "&".join(f"shape={d}" for d in shape) + "&dtype=float32"
    query += "&output_type=pt" if cfg["video"] else "&output_type=pil&image_format=png"
    status, headers, data = get(f"/decode/{model['name']}?{query}", body,
                                {"Content-Type": "tensor/binary"})
    assert status == 200 and data, (status, headers)
    assert "Server-Timing" in headers or "server-timing" in headers, headers
    metrics = get("/metrics")[2].decode()
    assert "vae_span_seconds_bucket" in metrics and "vae_requests_total" in metrics
    print(f"smoke: {model['name']} on {model['device']}/{model['dtype']}: {len(data)} bytes, "
          f"Server-Timing {headers.get('Server-Timing') or headers.get('server-timing')}")
finally:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
    try:
        rc = server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        sys.exit("smoke: the server did not exit within 30 s of SIGTERM")
# uvicorn drains, then re-raises the signal it caught: -SIGTERM (143 under tini) is a clean stop.
if rc not in (0, -signal.SIGTERM):
    sys.exit(f"smoke: the server exited {rc} after SIGTERM")
print(f"smoke: graceful exit on SIGTERM (status {rc})")
PY
}

steps=("$@")
if [ "${#steps[@]}" -eq 0 ]; then steps=(venv torch install bake smoke); fi
for step in "${steps[@]}"; do
    case "$step" in
        venv | torch | install | cuda | bake | smoke) "step_$step" ;;
        *) die "unknown step '$step' (venv torch install cuda bake smoke)" ;;
    esac
done
log "done: ${steps[*]}"
