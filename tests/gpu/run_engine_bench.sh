#!/usr/bin/env bash
# The engine bench on the GPU (tidal/bench/engine_cuda.py), called by run_on_device.sh once the
# wheels are installed; alone: OUT=... bash tests/gpu/run_engine_bench.sh. Its table and JSON are
# rewritten after every row, so a run cut short by its timeout keeps what it measured.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT/engine"
# the bench module alone: `tidal bench` would import every bench (the gateway's litestar too)
timeout ${BENCH_TIMEOUT:-150} python3 -m tidal.bench.engine --device cuda:0 --out "$OUT/engine" \
  --shapes ${BENCH_SHAPES:-llama-8b,llama-1b,qwen2-7b} --steps ${BENCH_STEPS:-12} ${BENCH_ARGS:-} \
  > "$OUT/engine-bench.log" 2>&1
echo "engine bench exit $?"
grep -v '^{' "$OUT/engine-bench.log" | tail -45
