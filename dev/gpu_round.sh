#!/usr/bin/env bash
# One device call of several stages (STAGES="tests serve finetune train"), each under its own timeout; logs under
# $OUT, a short summary of each stage printed as it ends.
#   tests:    the whole `-m gpu` suite (TEST_S seconds)
#   serve:    batch-1 decode at the seed preset vs transformers generate (`bench serve --skip serving`)
#   finetune: `bench finetune` at Qwen3-0.6B's shape (FT_ARGS, e.g. "--compile-modes default --max-batch")
#   train:    `bench train` at PRESETS (e.g. "seed:8 gpt2-small:16") with TRAIN_ARGS
#   ab:       `bench train --torch-modes none` (the xtrain trainer alone) of an older tree (.ab/old, carried: e.g.
#             `git archive REV xtrain bench | tar -x -C .ab/old`), of a middle one when .ab/mid exists, and of this
#             one, alternating, at PRESETS
#   diag:     the probes named in DIAG (e.g. "dev/addnorm_diag.py"), each under DIAG_S seconds
#   pytest:   pytest PYTEST_ARGS (a selection), under PYTEST_S seconds
#   kp:       the flash/doc-mask `-m gpu` tests of another tree carried in .ab/kp (KP_S seconds), e.g.
#             `git archive BRANCH xtrain tests bench pyproject.toml | tar -x -C .ab/kp`
#   profile:  `bench profile_train` of the steps in PROF_STEPS (default "trainer compile") at gpt2-small B16
# wheels the image lacks (fastapi, uvicorn and their needs, for the serving tests), carried in .whl when present
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git log -1 --oneline; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for stage in ${STAGES:-tests serve}; do
  t0=$(date +%s)
  case $stage in
  tests)
    # -v: every result is logged by name as it comes, so a run cut by its timeout still names its failures
    timeout "${TEST_S:-270}" python3 -m pytest -m gpu -v -n 8 -p no:cacheprovider -rfE tests \
      --ignore=tests/test_serve_api.py --ignore=tests/test_serve_loop.py > "$OUT/pytest_gpu.txt" 2>&1
    echo "tests rc $? ($(grep -c ' PASSED ' "$OUT/pytest_gpu.txt") passed)"; grep -E "passed|failed|error" "$OUT/pytest_gpu.txt" | tail -1
    grep -E " (FAILED|ERROR) " "$OUT/pytest_gpu.txt" | sed 's/^.*\(FAILED\|ERROR\) /\1 /' | sort -u | head -20 ;;
  serve)
    for dt in ${SERVE_DTYPES:-float32}; do
      timeout "${SERVE_S:-100}" python3 -m xtrain.cli bench serve --preset seed --skip serving --tokens 128 \
        --prompt-len 16 --reps 5 --dtype $dt > "$OUT/serve_seed_$dt.txt" 2>&1
      echo "serve $dt rc $?"; tail -6 "$OUT/serve_seed_$dt.txt"
    done ;;
  finetune)
    timeout "${FT_S:-240}" python3 -m xtrain.cli bench finetune --device cuda ${FT_ARGS:-} > "$OUT/finetune.txt" 2>&1
    echo "finetune rc $?"; grep -vE "^\s*$" "$OUT/finetune.txt" | tail -9 ;;
  train)
    for spec in ${PRESETS:-seed:8}; do
      set -- ${spec%%:*} ${spec##*:}
      timeout "${TRAIN_S:-300}" python3 -m xtrain.cli bench train --device cuda --dtype bfloat16 --preset $1 \
        --batch-size $2 --steps 20 --warmup 3 ${TRAIN_ARGS:-} > "$OUT/train_$1.txt" 2>&1; echo "train $1 rc $?"
      grep -E "skipped|fell back|Error" "$OUT/train_$1.txt" | head -5; sed -n '/first-step loss/,$p' "$OUT/train_$1.txt"
    done ;;
  ab)
    for spec in ${PRESETS:-seed:8}; do
      set -- ${spec%%:*} ${spec##*:}
      sides="old new"; [ -d .ab/mid ] && sides="old mid new"
      for round in 1 2; do for side in $sides; do
        root=$PWD; [ $side != new ] && root=$PWD/.ab/$side
        PYTHONPATH=$root timeout "${AB_S:-60}" python3 -m xtrain.cli bench train --device cuda --dtype bfloat16 \
          --preset $1 --batch-size $2 --steps 30 --warmup 3 --torch-modes none > "$OUT/ab_$1_$side$round.txt" 2>&1
        echo "ab $1 $side round $round rc $?: $(grep -E '^xtrain trainer' "$OUT/ab_$1_$side$round.txt" | head -1)"
      done; done
    done ;;
  diag)
    for f in ${DIAG:-}; do timeout "${DIAG_S:-120}" python3 "$f" > "$OUT/$(basename "$f" .py).txt" 2>&1; echo "$f rc $?"
      tail -20 "$OUT/$(basename "$f" .py).txt"; done ;;
  pytest)
    timeout "${PYTEST_S:-200}" python3 -m pytest -p no:cacheprovider -rfE ${PYTEST_ARGS:-} > "$OUT/pytest_sel.txt" 2>&1
    echo "pytest rc $?"; tail -6 "$OUT/pytest_sel.txt" ;;
  kp)
    (cd .ab/kp && PYTHONPATH=$PWD${PYTHONPATH#.} timeout "${KP_S:-200}" python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider \
      -rfE tests/test_flash_*.py tests/test_doc_mask_triton.py > "$OUT/pytest_kp.txt" 2>&1)
    echo "kp rc $?"; tail -6 "$OUT/pytest_kp.txt" ;;
  profile)
    for st in ${PROF_STEPS:-trainer compile}; do
      timeout "${PROF_S:-120}" python3 -m xtrain.cli bench profile_train --device cuda --dtype bfloat16 \
        --preset gpt2-small --batch-size 16 --step $st --top 45 > "$OUT/profile_$st.txt" 2>&1; echo "profile $st rc $?"
      grep -iE "busy|launches|wall" "$OUT/profile_$st.txt" | head -4
    done ;;
  esac
  echo "[$stage took $(( $(date +%s) - t0 )) s]"
done
