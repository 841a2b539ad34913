#!/usr/bin/env bash
# Issue 31 item 5 on a lent GPU machine (prepared, not yet run): page-locked host copies
# (tests/gpu/test_cuda_lora_page_lock.py), then `tidal bench lora` on CUDA at Llama-2-7B's width with
# adapters of LAYERS layers (32: ~96 MiB at rank 64) from page-locked and from pageable host copies,
# HELPERS CPU LoRA helpers, whole prompts on the helpers (--chunk 0), the CPU arms native (no pacing);
# each bench prints the decision rule's choices and the T_cpu, X, P it measured (T_cpu < X + P).
# LAYERS=4 fits a short call (the issue-20 geometry); 32 layers is ~13 GB of generated weights.
set -u
OUT=${OUT:-/tmp/gpu-out}
LAYERS=${LAYERS:-8}
HELPERS=${HELPERS:-8}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout ${TEST_TIMEOUT:-90} python3 -m pytest -q -p no:cacheprovider -p no:randomly -rs \
  tests/gpu/test_cuda_lora_page_lock.py > "$OUT/page-lock-tests.log" 2>&1
echo "page-lock tests exit $?"; tail -5 "$OUT/page-lock-tests.log"
for copy in page-locked pageable; do
  flag=""; [ "$copy" = pageable ] && flag="--pageable"
  timeout ${BENCH_TIMEOUT:-150} python3 -m tidal.bench.lora --device cuda:0 --layers "$LAYERS" --hidden 4096 \
    --kv-heads 64 --dtype bfloat16 --requests 32 --rounds 3 --budget 512 --chunk 0 --processes "$HELPERS" \
    --cpu-ratio native --modes cached,slora,async,cpu_assist,auto $flag --out "/tmp/bench-lora-$copy" \
    > "$OUT/bench-lora-$copy.log" 2>&1
  echo "bench lora ($copy) exit $?"
  cp "/tmp/bench-lora-$copy/results.json" "$OUT/bench-lora-$copy.json" 2>/dev/null
  grep -E "^loads|the rule chose|^bench lora:" "$OUT/bench-lora-$copy.log"
done
