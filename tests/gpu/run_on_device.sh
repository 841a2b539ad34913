#!/usr/bin/env bash
# The CUDA checks, as one script for a lent GPU machine (Python 3.12 with torch, transformers,
# peft; nothing can be downloaded there). Our other dependencies travel as wheels in .whl/
# (see docs/gpu.md for how they are fetched). Writes its logs under $OUT when set.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/device.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
# UCX: CUDA transports between processes on one GPU (cuda_ipc), staging copies (cuda_copy), TCP/shm for the rest
export UCX_TLS=${UCX_TLS:-tcp,sm,cuda_copy,cuda_ipc}
timeout ${TEST_TIMEOUT:-220} python3 -m pytest -q -p no:cacheprovider -p no:randomly tests/gpu -rs --timeout 120 \
  --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
if [ -n "${BENCH:-1}" ]; then
  # the bench module alone: `tidal bench` would import every bench, the gateway's (litestar) too
  timeout 100 python3 -m tidal.bench.lora_invoke --device cuda:0 --repeats 6 --out "$OUT/lora-invoke" 2>&1 | tee "$OUT/lora-invoke.log" | tail -8
fi
