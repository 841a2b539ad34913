#!/usr/bin/env bash
# The CUDA checks, as one script for a lent GPU machine (Python 3.12 with torch, transformers,
# peft, triton; nothing can be downloaded there). Our other dependencies travel as wheels in
# .whl/ (see docs/gpu.md for how they are fetched). Writes its logs under $OUT when set.
# Stages, most valuable first, each under its own timeout so the whole ends inside its budget
# and a stage cut short leaves the ones before it intact:
#   1. the new kernels' and graphs' CUDA tests   2. the engine bench (run_engine_bench.sh)
#   3. every other CUDA oracle in tests/gpu      4. (BENCH_LORA=1) the sync-free LoRA bench
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.version.cuda, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
# UCX: CUDA transports between processes on one GPU (cuda_ipc), staging copies (cuda_copy), TCP/shm for the rest
export UCX_TLS=${UCX_TLS:-tcp,sm,cuda_copy,cuda_ipc}
PYTEST="python3 -m pytest -q -p no:cacheprovider -p no:randomly -rs --timeout 120"
NEW="tests/gpu/test_cuda_kernels.py tests/gpu/test_cuda_graphs.py"
if [ -z "${SKIP_NEW:-}" ]; then
  timeout ${NEW_TIMEOUT:-100} $PYTEST $NEW > "$OUT/gpu-new.log" 2>&1; echo "new CUDA tests exit $?"
  tail -25 "$OUT/gpu-new.log"
fi
[ -z "${SKIP_BENCH:-}" ] && bash tests/gpu/run_engine_bench.sh
if [ -z "${SKIP_ORACLES:-}" ]; then
  OLD=$(ls tests/gpu/test_cuda_*.py | grep -v -e test_cuda_kernels -e test_cuda_graphs)
  timeout ${TEST_TIMEOUT:-110} $PYTEST $OLD > "$OUT/gpu-tests.log" 2>&1; echo "CUDA oracles exit $?"
  tail -30 "$OUT/gpu-tests.log"
fi
if [ -n "${BENCH_LORA:-}" ]; then
  timeout 100 python3 -m tidal.bench.lora_invoke --device cuda:0 --repeats 6 --out "$OUT/lora-invoke" 2>&1 | tee "$OUT/lora-invoke.log" | tail -8
fi
