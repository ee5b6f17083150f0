#!/usr/bin/env bash
# Prepare and run bench/gpu_check.py on a GPU machine that has python3 with a CUDA build of torch (and
# transformers, tokenizers, numpy, scipy, safetensors) but not the rest of what fedclinic's training path imports,
# and no network.
#
#   bench/gpu_check_setup.sh download        # HERE (pip + PyPI): wheels of the missing packages -> build/gpu-wheels
#   bench/gpu_check_setup.sh check           # THERE: python3, torch + CUDA, the packages; says what is missing
#   bench/gpu_check_setup.sh run [ARGS...]   # THERE: install the wheels into /tmp/gpu-site, check, run the bench
#
# The wheels (CPython 3.12, manylinux x86-64, versions pinned in constraints.txt) are installed with --no-deps
# into /tmp/gpu-site, put first on PYTHONPATH; nothing is installed system-wide. protobuf and grpcio travel even
# when the machine has them: fedclinic's generated code needs protobuf >= 7.35 and grpcio >= 1.85.1.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=build/gpu-wheels
SITE=/tmp/gpu-site
PY=${PYTHON:-python3}
pin() { grep -E "^$1==" constraints.txt | head -1; }
# packages fedclinic's training path needs that a plain CUDA PyTorch image may lack (cffi/pycparser: cryptography's)
PKGS="$(pin opacus) $(pin cryptography) $(pin protobuf) $(pin grpcio) cffi==2.1.1 pycparser==3.12"

check() {
    if ! command -v "$PY" >/dev/null; then
        echo "gpu_check_setup: $PY not found; put a Python 3.12 with a CUDA build of torch on PATH (or set PYTHON)"
        return 1
    fi
    if ! "$PY" -c "import torch" 2>/dev/null; then
        echo "gpu_check_setup: torch is not installed for $PY; install a CUDA build of torch (constraints.txt: $(pin torch))"
        return 1
    fi
    "$PY" -c "import torch; print('gpu_check_setup: torch', torch.__version__, 'cuda available:', torch.cuda.is_available(), 'GPUs:', torch.cuda.device_count())"
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check_setup: torch is installed but without CUDA (a CPU-only build, or no visible GPU / driver); install a CUDA build of torch"
        return 1
    fi
    "$PY" - <<'EOF'
import importlib.util, sys
mods = {"torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers", "numpy": "numpy",
        "opacus": "opacus", "safetensors": "safetensors", "scipy": "scipy", "google.protobuf": "protobuf",
        "grpc": "grpcio", "cryptography": "cryptography"}
missing = []
for mod, pip in mods.items():
    try:
        ok = importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        ok = False
    if not ok:
        missing.append(pip)
print("gpu_check_setup: missing packages: " + (", ".join(missing) if missing else "none"))
sys.exit(1 if missing else 0)
EOF
}

case "${1:-check}" in
    download)
        mkdir -p "$WHEELS"
        # shellcheck disable=SC2086
        "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 -d "$WHEELS" $PKGS
        ls -l "$WHEELS"
        ;;
    check)
        check
        ;;
    run)
        shift
        if compgen -G "$WHEELS/*.whl" >/dev/null; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
            export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        fi
        check || { echo "gpu_check_setup: not ready (above); running the check anyway so it reports what it can"; }
        export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
        exec "$PY" bench/gpu_check.py "$@"
        ;;
    *)
        echo "usage: $0 download | check | run [gpu_check.py arguments]" >&2
        exit 2
        ;;
esac
