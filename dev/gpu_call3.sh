#!/usr/bin/env bash
# The shortest device call that checks this round's GPU claims: the captured training step and the decode graphs
# (tests/test_gpu_model.py, tests/test_gpu_serve.py), then batch-1 decode at the seed preset against transformers.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 -rfE tests/test_gpu_serve.py tests/test_gpu_model.py \
  > "$OUT/pytest_gpu.txt" 2>&1
echo "gpu tests rc $?"; grep -E "passed|failed" "$OUT/pytest_gpu.txt" | tail -1; grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu.txt" | head -20
timeout 70 python3 -m xtrain.cli bench serve --preset seed --skip serving --tokens 128 --prompt-len 16 --reps 3 > "$OUT/serve_seed.txt" 2>&1
echo "bench serve rc $?"; tail -7 "$OUT/serve_seed.txt"
