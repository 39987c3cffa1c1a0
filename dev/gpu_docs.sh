#!/usr/bin/env bash
# One device call for packed documents and the GPU tests, most wanted first; each part bounded by a timeout,
# logs under $OUT. PARTS picks parts (default: tests docs64); TESTS overrides the test files.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --oneline; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for part in ${PARTS:-tests docs64}; do
  case $part in
  tests)
    timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu -q -p no:cacheprovider -n ${WORKERS:-4} -rfE ${TESTS:-tests/test_doc_mask_triton.py \
      tests/test_gpu_model.py tests/test_gpu_serve.py tests/test_flash_plans.py} > "$OUT/pytest_gpu.txt" 2>&1
    echo "gpu tests rc $?"; grep -E "passed|failed" "$OUT/pytest_gpu.txt" | tail -1; grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu.txt" | head -20 ;;
  tol)
    timeout ${TOL_TIMEOUT:-150} python3 -m pytest -m gpu -q -p no:cacheprovider -rA -s tests/test_gpu_model.py > "$OUT/pytest_tol.txt" 2>&1
    echo "tol tests rc $?"; grep -E "passed|failed" "$OUT/pytest_tol.txt" | tail -1 ;;
  docs64|docs128)
    timeout ${DOCS_TIMEOUT:-300} python3 -m xtrain.cli bench attention --docs ${MEANS:-} --head-dims ${part#docs} ${DOCS_ARGS:-} \
      --json "$OUT/$part.json" > "$OUT/$part.txt" 2>&1
    echo "bench $part rc $?"; grep -v -i warn "$OUT/$part.txt" | tail -16 ;;
  tiles)
    timeout ${TILES_TIMEOUT:-150} python3 dev/doc_tiles.py > "$OUT/doc_tiles.txt" 2>&1; echo "doc tiles rc $?"
    grep -v -i warn "$OUT/doc_tiles.txt" | tail -40 ;;
  train|train4k)  # train: the preset's T (seed: 1024); train4k: T = 4096, a quarter of the batch
    [ $part = train4k ] && extra="--seq-len 4096" && batch=$(( ${BATCH:-8} / 4 )) || { extra=""; batch=${BATCH:-8}; }
    timeout ${TRAIN_TIMEOUT:-200} python3 -m xtrain.cli bench train --device cuda --dtype bfloat16 --preset ${PRESET:-seed} \
      --batch-size $batch $extra --doc-mask ${DOC_MEAN:-256} --steps 10 --warmup 3 ${TRAIN_ARGS:-} > "$OUT/$part.txt" 2>&1
    echo "bench $part rc $?"; grep -v -i warn "$OUT/$part.txt" | tail -8 ;;
  esac
done
