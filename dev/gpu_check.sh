#!/usr/bin/env bash
# One device call after a change: the GPU tests, then the kernel and attention benches; logs under $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log -1 --oneline; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout "${PYTEST_S:-280}" python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider tests \
  --ignore=tests/test_serve_api.py --ignore=tests/test_serve_loop.py > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc $?"; grep -E "passed|failed|error" "$OUT/pytest_gpu.txt" | tail -3; grep -E "^FAILED|^ERROR" "$OUT/pytest_gpu.txt" | head -20
timeout "${KERNELS_S:-110}" python3 -m xtrain.cli bench kernels > "$OUT/kernels.txt" 2>&1; echo "kernels rc $?"
timeout "${ATTN_S:-170}" python3 -m xtrain.cli bench attention --rounds 1 --no-composed > "$OUT/attention.txt" 2>&1; echo "attention rc $?"
tail -40 "$OUT/kernels.txt"; tail -30 "$OUT/attention.txt"
