#!/usr/bin/env bash
# One device call: the GPU tests of the captured step, decode graphs and attention plans/kernels; batch-1 decode
# at the seed preset; a user's run stopped and resumed with the graph on (weights compared byte for byte).
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
timeout ${TEST_TIMEOUT:-140} python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -rfE tests/test_gpu_serve.py \
  tests/test_gpu_model.py tests/test_flash_plans.py tests/test_flash_gluon_bwd.py tests/test_flash_gluon_onepass.py \
  > "$OUT/pytest_gpu.txt" 2>&1
echo "gpu tests rc $?"; grep -E "passed|failed" "$OUT/pytest_gpu.txt" | tail -1; grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu.txt" | head -20
timeout 80 python3 -m xtrain.cli bench serve --preset seed --skip serving --tokens 128 --prompt-len 16 --reps 5 > "$OUT/serve_seed.txt" 2>&1
echo "bench serve rc $?"; tail -7 "$OUT/serve_seed.txt"
# a small corpus from this checkout's own text (no data preparation of the default corpus on a fresh machine)
cat $(git ls-files '*.py' '*.md') > /tmp/corpus.txt
A="--device cuda --preset tiny --data /tmp/corpus.txt --vocab-size 512 --steps 30 --eval-every 10 --sample-tokens 0 --no-progress --seed 3"
( timeout 60 python3 -m xtrain.cli train $A --out /tmp/r_full > "$OUT/run_full.txt" 2>&1 &&
  timeout 40 python3 -m xtrain.cli train $A --out /tmp/r_half --stop-after 15 > "$OUT/run_half.txt" 2>&1 &&
  timeout 40 python3 -m xtrain.cli train --resume /tmp/r_half > "$OUT/run_resume.txt" 2>&1 ); echo "runs rc $?"
grep -h "graph" "$OUT"/run_*.txt | sort | uniq -c | head -5; tail -3 "$OUT/run_resume.txt"
cmp /tmp/r_full/model.safetensors /tmp/r_half/model.safetensors && echo "resumed weights == uninterrupted weights (bytes)"
cmp /tmp/r_full/optimizer.safetensors /tmp/r_half/optimizer.safetensors && echo "optimizer state equal (bytes)"
grep -o '"graph[^,]*' /tmp/r_half/metrics.jsonl | sort | uniq -c
