#!/usr/bin/env bash
# One device call: the GPU tests of tests/test_gpu_model.py, each printing its errors (-s) and every outcome listed
# (-rA). Each bf16 model check prints a table against the fp64 oracle: per tensor rel(P) and rel(C) (the path
# checked and the composed bf16 yardstick), their ratio, bias(P) - bias(C), both bounds and the fraction used
# (> 1 fails); the bounds and why are in the test module's docstring. The whole log is $OUT/pytest_gpu_tol.txt;
# the end of this script's output repeats each table's title and summary line and every failing row.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
LOG="$OUT/pytest_gpu_tol.txt"
timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -m gpu -q -p no:cacheprovider -rA -s tests/test_gpu_model.py 2>&1 |
  tee "$LOG"
rc=${PIPESTATUS[0]}
echo "=== gpu tolerance tests rc $rc (124: timed out)"
grep -E "rel\(P\) <=|rel\(P, C\) <=|largest ratio|  FAIL$" "$LOG"
grep -E "^(PASSED|FAILED|ERROR)" "$LOG"
tail -1 "$LOG"
exit "$rc"
