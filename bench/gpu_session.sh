#!/usr/bin/env bash
# One GPU session from a clean copy (PLATFORM.md: the device's image has torch but not treadle's other deps):
# install the carried wheels, run bench/gpu.py's items under one time limit, and leave one tar in $OUT (the device
# returns few files). Carry `wheels/` (pip download --python-version 3.12 --only-binary=:all: --no-deps ...).
#   ITEMS=treadle-defaults,hf-bf16 LIMIT_S=300 bash bench/gpu_session.sh
set -u
ITEMS=${ITEMS:-treadle-defaults,treadle-best,hf-bf16,hf-compile,attention}
LIMIT_S=${LIMIT_S:-540}
RESULTS=/tmp/gpu-check
python3 -m pip install --no-deps --no-index -q wheels/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
timeout "$LIMIT_S" python3 bench/gpu.py --only "$ITEMS" --out "$RESULTS"
echo "gpu.py exit $?"
find "$RESULTS" -path '*profile*' -name '*.json' -exec gzip -f {} +
tar czf "${OUT:-/tmp}/gpu-check.tgz" -C "$RESULTS" --exclude=checkpoints --exclude='*.safetensors' --exclude='*.bin' .
ls -la "${OUT:-/tmp}"
