#!/usr/bin/env bash
# One device call: the new GPU tests first, batch-1 decode at the seed preset, then the whole -m gpu suite.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_gpu_serve.py tests/test_gpu_model.py > "$OUT/pytest_new.txt" 2>&1
echo "new gpu tests rc $?"; grep -E "passed|failed" "$OUT/pytest_new.txt" | tail -1; grep -E "^FAILED|^ERROR|Error" "$OUT/pytest_new.txt" | head -20
timeout 120 python3 -m xtrain.cli bench serve --preset seed --skip serving --tokens 128 --prompt-len 16 --reps 5 > "$OUT/serve_seed.txt" 2>&1
echo "bench serve rc $?"; tail -8 "$OUT/serve_seed.txt"
timeout ${SUITE_TIMEOUT:-280} python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -rfE tests > "$OUT/pytest_all.txt" 2>&1
echo "gpu suite rc $?"; grep -E "passed|failed" "$OUT/pytest_all.txt" | tail -1; grep -E "^FAILED|^ERROR" "$OUT/pytest_all.txt" | head -20
