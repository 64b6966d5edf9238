#!/usr/bin/env bash
# Continue the shipped drafter on a CUDA machine: the target answers new prompts (`dflashkit data`), the drafter
# trains on those answers and any earlier ones (`dflashkit train --init`, distilled), and the n-gram store of the
# new greedy answers is merged into the shipped one (`dflashkit ngram-store --merge`). Run it from the repository
# root on a machine with a GPU and dflashkit installed (`pip install -e ".[train]"`); everything it writes goes
# under $WORK. Each phase resumes where a previous run of it stopped; `all` runs them in turn within END_S seconds.
#
#   bash scripts/gpu_train.sh check      # the GPU decodes losslessly, with and without CUDA graphs (~70 s)
#   bash scripts/gpu_train.sh data [N]   # N prompts (default PROMPTS_N) answered greedily into $WORK/data/gpu
#   bash scripts/gpu_train.sh train      # continue the shipped drafter on every data folder; $WORK/run/drafter
#   bash scripts/gpu_train.sh store      # the new greedy answers' n-gram store, merged, into $WORK/run/drafter
#   bash scripts/gpu_train.sh all        # data for DATA_S s, training for what is left of END_S, then the store
#
# Settings (environment variables, defaults in brackets):
#   WORK [~/.cache/dflashkit/gpu-train]  where data and the run go;  DEVICE [cuda];  PY [python3]
#   SOURCES [magpie:0.75,magpie-code:0.25]  prompt sources of `dflashkit data` (magpie: requests the target writes
#       itself; jsonl:PATH for a prompt list); PROMPTS_N [16000]; DSEED [1]: use a new seed for new prompts
#   BATCH [2048], SHARD [16384]  data's batch slots and shard size (a shard is answered and written at once)
#   SAMPLED_S [0], STEMP [0.8]  seconds of DATA_S kept for sampled answers to the same prompts (gpu-sampled folder)
#   EXTRA_DATA  comma-separated earlier `dflashkit data` folders to train on as well
#   SEQS [128], LR [6e-4], DISTILL_W [0.5], EPOCHS [6]  sequences per step, learning rate, distillation weight, cap
#   LAYERS, FEATURES, LOSS, COMPILE=1  deepen the drafter (`--layers`), its target layers (`--target-layers`),
#       `--loss-weighting`, `--compile`; a run that names them must name them again when it resumes
#   END_S [560], DATA_S [200]  time limits of `all`;  MAX_ENTRIES  cap of the merged n-gram store (`--max-entries`)
#
# Rates seen on one H100 / H200 with the default target (SmolLM2-135M-Instruct): `data` answers 45-62K tokens/s
# (its own requests are written first: ~370 a second); training runs 4-4.9 steps/s at 128 sequences per step.
# Judge the drafter with scripts/compare_drafters.py against the shipped one, then package it with
# scripts/model_card.py (the shipped drafter, n-gram store included, must stay under 40 MB).
if [ "${BASH_SOURCE[0]}" = "$0" ]; then set -euo pipefail; fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WORK=${WORK:-${XDG_CACHE_HOME:-$HOME/.cache}/dflashkit/gpu-train}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
SHIPPED=dflashkit/drafters/smollm2-135m-instruct
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1

data_dirs() {  # the folders training reads (those holding answers); `new`: this run's greedy answers only
  local dirs="" folder
  for folder in "$WORK/data/gpu" "$WORK/data/gpu-sampled"; do
    [ -f "$folder/meta.json" ] || continue
    if [ "${1:-}" = new ] && [ "$folder" != "$WORK/data/gpu" ]; then continue; fi
    dirs=${dirs:+$dirs,}$folder
  done
  if [ "${1:-}" != new ] && [ -n "${EXTRA_DATA:-}" ]; then dirs=${dirs:+$dirs,}$EXTRA_DATA; fi
  echo "$dirs"
}

count_answers() {  # "ANSWERS TOKENS" in the folders training reads (unfinished shards included)
  "$PY" -c "import sys; from dflashkit.training.dataset import load_shards; \
r = [x for d in sys.argv[1].split(',') if d for x in load_shards(d, include_partial=True)]; \
print(len(r), sum(len(x['response_ids']) for x in r))" "$(data_dirs)" 2>/dev/null || echo "0 0"
}

check() {
  "$PY" -c "import torch, transformers, dflashkit; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'cuda', torch.cuda.is_available())"
  "$PY" -m dflashkit generate "Write a haiku about the sea." --device "$DEVICE" --max-new-tokens 64 --compare-ar \
    --no-cuda-graphs
  "$PY" -m dflashkit generate "Write a haiku about the sea." --device "$DEVICE" --max-new-tokens 64 --compare-ar
  "$PY" scripts/gpu_check.py
}

data() {  # N prompts; TEMP, DATA_NAME and LIMIT (seconds) for the sampled pass and `all`
  local out=$WORK/data/${DATA_NAME:-gpu}
  timeout "${LIMIT:-0}" "$PY" -m dflashkit data --sources "${SOURCES:-magpie:0.75,magpie-code:0.25}" \
    --num-prompts "${1:-${PROMPTS_N:-16000}}" --seed "${DSEED:-1}" --temperature "${TEMP:-0}" --device "$DEVICE" \
    --batch-size "${BATCH:-2048}" --max-new-tokens 192 --max-prompt-tokens 512 --shard-size "${SHARD:-16384}" \
    --out "$out" --no-progress || true  # cut by LIMIT: the same command resumes
  echo "$(ls "$out" 2>/dev/null | grep -c '^shard-.*[0-9].jsonl$' || true) complete shards in $out"
}

train() {  # BUDGET: seconds of training steps (the cosine schedule is sized to end in time); LIMIT: a hard stop
  local answers cap
  answers=$(count_answers)
  cap=$(( ${EPOCHS:-6} * ${answers% *} / ${SEQS:-128} )); cap=$(( cap < 100 ? 100 : cap ))
  echo "training on ${answers% *} answers (${answers#* } tokens): at most $cap steps"
  timeout "${LIMIT:-0}" "$PY" -m dflashkit train --data "$(data_dirs)" --out "$WORK/run" --init "$SHIPPED" \
    --device "$DEVICE" --seqs-per-step "${SEQS:-128}" --steps "$cap" ${BUDGET:+--time-budget "$BUDGET"} \
    --lr "${LR:-6e-4}" --warmup 0.03 --distill-topk 32 --distill-weight "${DISTILL_W:-0.5}" --eval-every 0 \
    --checkpoint-every 500 ${COMPILE:+--compile} ${LAYERS:+--layers "$LAYERS"} \
    ${FEATURES:+--target-layers "$FEATURES"} ${LOSS:+--loss-weighting "$LOSS"} || true
  tail -n 2 "$WORK/run/train_log.jsonl" 2>/dev/null || true
}

store() {  # the shipped store grows by merging: earlier answers need not be kept
  [ -f "$WORK/run/drafter/config.json" ] || { echo "no trained drafter in $WORK/run/drafter: run train first"; return 1; }
  if [ -n "$(data_dirs new)" ]; then
    "$PY" -m dflashkit ngram-store --data "$(data_dirs new)" --out "$WORK/run/drafter" --merge "$SHIPPED" \
      ${MAX_ENTRIES:+--max-entries "$MAX_ENTRIES"}
  else
    cp "$SHIPPED/ngram_store.safetensors" "$WORK/run/drafter/"
  fi
  du -sh "$WORK/run/drafter"
}

all() {  # data, then training, then the store, within END_S seconds (a phase that fails does not stop the others)
  set +e +o pipefail
  local t0=$SECONDS end=${END_S:-560} data_s=${DATA_S:-200} sampled_s=${SAMPLED_S:-0} left
  LIMIT=$(( data_s - sampled_s > 30 ? data_s - sampled_s : 30 )) data
  left=$(( data_s - (SECONDS - t0) ))
  if [ "$left" -gt 30 ]; then  # SAMPLED_S, or every prompt answered early: sampled answers to the same prompts
    LIMIT=$left TEMP=${STEMP:-0.8} DSEED=$(( ${DSEED:-1} + 1000 )) DATA_NAME=gpu-sampled \
      SOURCES="jsonl:$WORK/data/gpu/prompts.jsonl" data
  fi
  echo "== data done at $((SECONDS - t0)) s: $(count_answers) (answers, tokens)"
  local train_s=$(( end - (SECONDS - t0) - 45 ))  # what is left, less the store's time
  LIMIT=$train_s BUDGET=$(( train_s - 35 > 30 ? train_s - 35 : 30 )) train  # ~35 s of loading before the steps
  echo "== training done at $((SECONDS - t0)) s"
  store
  echo "== done at $((SECONDS - t0)) s: $WORK/run/drafter"
}

case "${1:-}" in
  check) check ;;
  data) shift; data "$@" ;;
  train) train ;;
  store) store ;;
  all) all ;;
  -h|--help|"") awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}" ;;
  *) echo "unknown command $1 (check, data, train, store, all)" >&2; exit 2 ;;
esac
