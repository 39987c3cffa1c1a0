#!/usr/bin/env bash
# One device call: `xtrain bench train` against every torch side (compile modes, whole-step graphs) at the presets
# given (PRESETS="seed:8 gpt2-small:16"), then the GPU tests named in TESTS; logs under $OUT, a short table last.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --oneline; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ -n "${TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-120} python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 $TESTS > "$OUT/pytest_gpu.txt" 2>&1
  echo "pytest rc $?"; grep -E "passed|failed|error" "$OUT/pytest_gpu.txt" | tail -2; grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu.txt" | head -20
fi
for spec in ${PRESETS:-seed:8}; do
  set -- ${spec%%:*} ${spec##*:}
  timeout ${BENCH_TIMEOUT:-500} python3 -m xtrain.cli bench train --device cuda --dtype bfloat16 --preset $1 --batch-size $2 \
    --steps ${STEPS:-20} --warmup 3 ${BENCH_ARGS:-} > "$OUT/train_$1.txt" 2>&1; echo "bench train $1 rc $?"
  grep -E "skipped|fell back|Error" "$OUT/train_$1.txt" | head -5; sed -n '/first-step loss/,$p' "$OUT/train_$1.txt"
done
