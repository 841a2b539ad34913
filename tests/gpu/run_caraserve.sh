#!/usr/bin/env bash
# Issue 20 on a lent GPU machine, one call: `tidal bench lora` on CUDA (Llama-2-7B's layer geometry,
# 4 layers, bf16, real rank-64 q/k/v adapters copied host-to-device for real, no pacing), then the
# CUDA graphs tests (tests/gpu/test_cuda_graphs.py). Each stage under its own timeout so the whole
# ends inside ~140 s; logs under $OUT. A few small wheels travel in .whl20/ (git-ignored; copies from .whl/, docs/gpu.md).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
nproc | sed "s/^/cpus /" | tee -a "$OUT/device.txt"; df -h /dev/shm | tail -1 | tee -a "$OUT/device.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl20/*.whl 2>&1 | tail -2  # not needed by these imports today; a safety net
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout ${BENCH_TIMEOUT:-80} python3 -m tidal.bench.lora --device cuda:0 --layers 4 --hidden 4096 --kv-heads 64 \
  --dtype bfloat16 --requests 48 --rounds 3 --budget 512 --out /tmp/bench-lora > "$OUT/bench-lora.log" 2>&1
rc=$?
cp /tmp/bench-lora/results.json "$OUT/bench-lora-results.json" 2>/dev/null
echo "bench lora exit $rc"
tail -30 "$OUT/bench-lora.log"
timeout ${GRAPHS_TIMEOUT:-50} python3 -m pytest -q -p no:cacheprovider -p no:randomly -rs --timeout 45 \
  tests/gpu/test_cuda_graphs.py > "$OUT/gpu-graphs.log" 2>&1
echo "cuda graphs tests exit $?"
tail -15 "$OUT/gpu-graphs.log"
