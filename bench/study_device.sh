#!/usr/bin/env bash
# One device call of the study (issue 7, bench/study.py): trains and evaluates the named arms on
# the carried corpus and tokenizer, then packs each arm's small outputs (config, tokenizer,
# metrics, eval results, an empty checkpoint marker -- no weights) into $OUT/study_arms.tgz.
# A device machine starts bare, so every call must finish its arms; unpack the archives here into
# the same --root and `python bench/study.py --root .data/study --stage collect` writes the tables.
#
# Once, here:  mkdir -p .data/corpus && cp ../shared/data/corpus/*.xz .data/corpus/ &&
#              python bench/study.py --root .data/study --stage tokenizer --train .data/corpus/train.jsonl.xz
#   and the wheels the GPU image lacks (cp312; ~5 MB):
#              pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#                --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#                grain==0.2.18 array-record ml_collections tensorboardX portpicker dm-tree
# Per call (carry .whl, .data/corpus and .data/study; a local run's .data/study/tokens cache is
#   ~60 MB, too big to carry: delete it first, the call rebuilds its own):
#              STEPS=900 bash bench/study_device.sh softmax_rope focal
#   (arms run side by side, one worker per GPU; GPUS=1 runs them one after another)
# Here, after it:  tar xzf <files_at>/study_arms.tgz -C .data/study
# A variant of the study (TRAIN_ARGS go to every train.py) keeps its arms in its own STUDY dir,
# since arms are named by attention and seed only: mkdir -p .data/study_qk &&
#   cp -r .data/study/tokenizer .data/study_qk/ && carry it, then
#   STUDY=.data/study_qk TRAIN_ARGS=--config.model.qk_norm=True bash bench/study_device.sh focal ...
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
ROOT=${ROOT:-/tmp/study}; mkdir -p "$ROOT"
# The tokenizer, and any arms an earlier call finished (unpacked here from its study_arms.tgz):
# study.py skips those, so a second call picks up where the first stopped. Only evaluated arms of
# the same STEPS belong in .data/study: an arm's own config says when it is done.
STUDY=${STUDY:-.data/study}
cp -r "$STUDY/." "$ROOT/"
C=.data/corpus
# SUITES: eval.py suites (default: the four the claims use; "sample" and "attention" skipped).
# One worker per GPU (nvidia-smi -L; GPUS overrides), arms dealt round-robin in the order given:
# on a 2-GPU machine `a b c d` runs a,c on GPU 0 and b,d on GPU 1, side by side.
G=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c ^GPU)}; G=$(( G > 0 ? G : 1 ))
arms=("$@"); pids=()
for ((g = 0; g < G; g++)); do
  mine=$(for ((i = g; i < ${#arms[@]}; i += G)); do printf '%s,' "${arms[i]}"; done)
  [ -z "$mine" ] && continue
  CUDA_VISIBLE_DEVICES=$g python3 bench/study.py --root "$ROOT" --arms "${mine%,}" \
    --size "${SIZE:-100m}" --steps "${STEPS:-900}" --out "$ROOT/study_gpu$g.json" \
    --train $C/train.jsonl.xz --valid $C/valid.jsonl.xz --books $C/longeval.jsonl.xz \
    --val_batches "${VAL_BATCHES:-200}" --time_limit "${LIMIT:-540}" --no_plots \
    --suites "${SUITES:-val,longdoc,passkey,keyword}" ${TRAIN_ARGS:+-- $TRAIN_ARGS} 2>&1 \
    | grep --line-buffered -v -i "autotun\|deprecat" > "$OUT/study_gpu$g.log" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
tail -n 25 "$OUT"/study_gpu*.log
# Evaluated arms go to study_arms.tgz (unpack into .data/study; carried, they are skipped). An
# arm the limit cut off goes to study_partial.tgz, for its logs only: without weights it cannot
# resume, so the next call trains it from the start.
cd "$ROOT" || exit 1
done_arms=(); partial=()
for d in */; do
  d=${d%/}; case $d in tokenizer|tokens) continue ;; esac  # shared: the BPE, the token cache
  if [ -f "$d/eval/results.json" ]; then done_arms+=("$d"); else partial+=("$d"); fi
done
[ ${#done_arms[@]} -gt 0 ] && tar czf "$OUT/study_arms.tgz" --exclude='*/checkpoints/*/*' "${done_arms[@]}"
[ ${#partial[@]} -gt 0 ] && tar czf "$OUT/study_partial.tgz" --exclude='*/checkpoints/*' "${partial[@]}"
echo "evaluated: ${done_arms[*]:-none}; cut off: ${partial[*]:-none}"
