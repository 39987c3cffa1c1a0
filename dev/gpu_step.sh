#!/usr/bin/env bash
# One device call for the whole training step, most wanted first: `bench train` at the seed and gpt2-small presets
# (bf16; BENCH="preset:batch ..."), kernel rows (KERNELS="group,..."), the step's GPU tests (TESTS, on 4 xdist
# workers), and profiles (PROFILE="trainer compile"); each bounded by a timeout, logs under $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --oneline; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for spec in ${BENCH:-seed:8 gpt2-small:16}; do
  set -- ${spec%%:*} ${spec##*:}
  timeout ${BENCH_TIMEOUT:-200} python3 -m xtrain.cli bench train --device cuda --dtype bfloat16 --preset $1 --batch-size $2 \
    --steps ${STEPS:-10} --warmup 3 ${BENCH_ARGS:-} > "$OUT/train_$1.txt" 2>&1; echo "bench train $1 rc $?"; grep -v Warning "$OUT/train_$1.txt" | tail -9
done
if [ -n "${KERNELS:-}" ]; then
  timeout 120 python3 -m xtrain.cli bench kernels --only $KERNELS > "$OUT/kernels.txt" 2>&1; echo "bench kernels rc $?"
  grep -E "fwd|bwd|copy" "$OUT/kernels.txt" | tail -20
fi
if [ -n "${TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 $TESTS > "$OUT/pytest_gpu.txt" 2>&1
  echo "pytest rc $?"; grep -E "passed|failed|error" "$OUT/pytest_gpu.txt" | tail -2; grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu.txt" | head -20
fi
for s in ${PROFILE:-}; do
  timeout 150 python3 -m xtrain.cli bench profile_train --device cuda --dtype bfloat16 --preset seed --batch-size 8 \
    --step $s --top 40 > "$OUT/profile_$s.txt" 2>&1; echo "profile $s rc $?"; grep -E "^wall" "$OUT/profile_$s.txt"; sed -n '/kind of work/,/^---/p' "$OUT/profile_$s.txt"
done
