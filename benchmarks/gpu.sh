#!/usr/bin/env bash
# MFU of a bfloat16 ResNet-50 train step on one GPU: one short run (compile ~1 min, 30 timed steps).
#
#   bash benchmarks/gpu.sh [--model resnet50|resnet18] [--batch 128] [--steps 30] [--peak FLOP/s]
#
# Needs only what a CUDA JAX image has (python3 with a CUDA build of jax, flax, optax). dtx runs
# from this checkout (PYTHONPATH, nothing installed); ml_collections and tensorboardX, which dtx
# imports and such images lack, are installed from the wheels in .whl/ (--no-index: no network).
# Prints one markdown table for BENCHMARKS.md ("MFU on one GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c 'import jax, sys; sys.exit(jax.devices()[0].platform != "gpu")'; then
    echo "gpu.sh: jax sees no GPU ($("$PYTHON" -c 'import jax; print(jax.devices())' 2>&1 | tail -1))" >&2
    exit 1
fi
missing=$("$PYTHON" - <<'PY'
import importlib.util
print(" ".join(name for module, name in (("ml_collections", "ml_collections"), ("tensorboardX", "tensorboardX"))
               if importlib.util.find_spec(module) is None))
PY
)
if [ -n "$missing" ]; then
    echo "+ pip install --no-deps --no-index --find-links .whl $missing" >&2
    "$PYTHON" -m pip install --quiet --no-deps --no-index --find-links .whl $missing
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" benchmarks/gpu_mfu.py "$@"
