#!/usr/bin/env bash
# One device call: the new GPU tests first, batch-1 decode at the seed preset, a user's run stopped and resumed
# with the graph on, then the whole -m gpu suite.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_gpu_serve.py tests/test_gpu_model.py > "$OUT/pytest_new.txt" 2>&1
echo "new gpu tests rc $?"; grep -E "passed|failed" "$OUT/pytest_new.txt" | tail -1; grep -E "^FAILED|^ERROR|Error" "$OUT/pytest_new.txt" | head -20
timeout 100 python3 -m xtrain.cli bench serve --preset seed --skip serving --tokens 128 --prompt-len 16 --reps 5 > "$OUT/serve_seed.txt" 2>&1
echo "bench serve rc $?"; tail -8 "$OUT/serve_seed.txt"
# a user's run with the graph on: 30 steps straight vs 15 + --resume 15, the weights compared byte for byte
A="--device cuda --preset tiny --steps 30 --eval-every 10 --sample-tokens 0 --no-progress --seed 3"
( timeout 120 python3 -m xtrain.cli train $A --out /tmp/r_full > "$OUT/run_full.txt" 2>&1 &&
  timeout 60 python3 -m xtrain.cli train $A --out /tmp/r_half --stop-after 15 > "$OUT/run_half.txt" 2>&1 &&
  timeout 60 python3 -m xtrain.cli train --resume /tmp/r_half > "$OUT/run_resume.txt" 2>&1 ); echo "runs rc $?"
grep -h "graph" "$OUT"/run_*.txt | sort | uniq -c | head -5
cmp /tmp/r_full/model.safetensors /tmp/r_half/model.safetensors && echo "resumed weights == uninterrupted weights (bytes)"
cmp /tmp/r_full/optimizer.safetensors /tmp/r_half/optimizer.safetensors && echo "optimizer state equal (bytes)"
tail -2 /tmp/r_full/metrics.jsonl | cut -c1-400
timeout ${SUITE_TIMEOUT:-280} python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -rfE tests > "$OUT/pytest_all.txt" 2>&1
echo "gpu suite rc $?"; grep -E "passed|failed" "$OUT/pytest_all.txt" | tail -1; grep -E "^FAILED|^ERROR" "$OUT/pytest_all.txt" | head -20
