#!/usr/bin/env bash
# Everything a lent GPU machine is for, in one run inside 10 minutes (issue 34). From the repository
# root, with .whl/ beside it (docs/gpu.md "How the dependencies get there"):
#
#   bash tests/gpu/run_all.sh                  # on the GPU machine; files under $OUT (default /tmp/gpu-out)
#   DEVICE=cpu bash tests/gpu/run_all.sh       # the CPU dry run: the same stages, --quick grids, no wheels
#
# Stages, each under its own timeout (seconds; the sum stays under 600 with the wheel install):
#   1. PROFILE_TIMEOUT  tidal profile gpu  -> $OUT/h200-measured.json (cpu: $OUT/cpu-measured.json, --quick)
#   2. BENCH_TIMEOUT    the engine bench's summary rows (llama-8b decode b8/b64 at 4096, prefill 2048)
#   3. FIDELITY_TIMEOUT tidal bench fidelity --device: the engine on the device vs the simulator on (1)
#   4. TEST_TIMEOUT     the CUDA test suite: tests/gpu (every CUDA test lives there; skipped on a CPU)
# Prints, last: `bench engine (cuda): ...` and `profile gpu: fields=N measured=N fidelity_ttft_p99_err=NN%`,
# also written to $OUT/figures.txt. A stage cut short by its timeout leaves the ones before it intact.
set -u
DEVICE=${DEVICE:-cuda:0}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
START=$(date +%s)
stamp() { echo "[$(( $(date +%s) - START )) s] $*"; }
if [ "$DEVICE" = cpu ]; then
  PY=${PY:-.venv/bin/python}
  QUICK="--quick"; NAME=cpu-measured; REQUESTS=${REQUESTS:-8}
  : "${PROFILE_TIMEOUT:=420}" "${FIDELITY_TIMEOUT:=240}" "${TEST_TIMEOUT:=120}" "${BENCH_TIMEOUT:=0}"  # a shared 2-core host
  echo "dry run on the CPU: $($PY -c 'import torch; print("torch", torch.__version__)')" | tee "$OUT/device.txt"
else
  PY=${PY:-python3}
  QUICK=""; NAME=h200-measured; REQUESTS=${REQUESTS:-200}
  : "${PROFILE_TIMEOUT:=240}" "${FIDELITY_TIMEOUT:=110}" "${TEST_TIMEOUT:=150}" "${BENCH_TIMEOUT:=80}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
  $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.version.cuda, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
  export UCX_TLS=${UCX_TLS:-tcp,sm,cuda_copy,cuda_ipc}
fi
export PYTHONUNBUFFERED=1
PROFILE="$OUT/$NAME.json"

stamp "1. profile gpu --device $DEVICE $QUICK (timeout $PROFILE_TIMEOUT s)"
timeout "$PROFILE_TIMEOUT" $PY -m tidal profile gpu --device "$DEVICE" $QUICK --name "$NAME" --out "$PROFILE" \
  > "$OUT/profile.log" 2>&1
echo "profile exit $?"; grep -v '^- ' "$OUT/profile.log" | tail -8

if [ "$BENCH_TIMEOUT" -gt 0 ]; then
  stamp "2. bench engine --device $DEVICE (timeout $BENCH_TIMEOUT s)"
  mkdir -p "$OUT/engine"
  timeout "$BENCH_TIMEOUT" $PY -m tidal.bench.engine --device "$DEVICE" --out "$OUT/engine" --shapes llama-8b \
    --batches 8,64 --contexts 4096 --prefill-tokens 2048 --steps 12 --no-eager > "$OUT/engine-bench.log" 2>&1
  echo "engine bench exit $?"; grep -v '^{' "$OUT/engine-bench.log" | tail -8
  BENCH_LINE=$(grep '^bench engine (cuda):' "$OUT/engine-bench.log" | tail -1)
else
  stamp "2. bench engine: skipped (the roofline bench needs CUDA)"
  BENCH_LINE="bench engine (cuda): skipped on $DEVICE (decode_roofline_b64, decode_roofline_b8, prefill_mfu_2k need a GPU)"
fi

stamp "3. bench fidelity --device $DEVICE (timeout $FIDELITY_TIMEOUT s)"
if [ -f "$PROFILE" ]; then
  timeout "$FIDELITY_TIMEOUT" $PY -m tidal.bench.fidelity --device "$DEVICE" --profile "$PROFILE" \
    --requests "$REQUESTS" --out "$OUT/fidelity" > "$OUT/fidelity.log" 2>&1
  echo "fidelity exit $?"; tail -7 "$OUT/fidelity.log"
else
  echo "fidelity: skipped, no profile (stage 1 failed: $OUT/profile.log)"
fi

stamp "4. CUDA tests: tests/gpu (timeout $TEST_TIMEOUT s)"
timeout "$TEST_TIMEOUT" $PY -m pytest -q -p no:cacheprovider -p no:randomly -rs --timeout 120 tests/gpu \
  > "$OUT/gpu-tests.log" 2>&1
echo "CUDA tests exit $?"; tail -1 "$OUT/gpu-tests.log"

stamp "done"
FIG=$($PY - "$PROFILE" "$OUT/fidelity/fidelity-device.json" <<'EOF'
import json, math, sys
try:
    p = json.load(open(sys.argv[1]))
    kinds = [s["kind"] for s in p["sources"].values()]
    fields, measured = len(kinds), kinds.count("measured")
except (OSError, ValueError, KeyError):
    fields = measured = "-"
try:
    err = json.load(open(sys.argv[2]))["errors"]["ttft_p99"]
    err = "-" if err is None or math.isnan(err) else f"{100 * err:.0f}%"
except (OSError, ValueError, KeyError, TypeError):
    err = "-"
print(f"profile gpu: fields={fields} measured={measured} fidelity_ttft_p99_err={err}")
EOF
)
printf '%s\n%s\n' "${BENCH_LINE:-bench engine (cuda): no summary (see $OUT/engine-bench.log)}" "$FIG" | tee "$OUT/figures.txt"
