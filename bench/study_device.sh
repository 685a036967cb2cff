#!/usr/bin/env bash
# One device call of the study (issue 7, bench/study.py): trains and evaluates the named arms on
# the carried corpus and tokenizer, then packs each arm's small outputs (config, tokenizer,
# metrics, eval results, an empty checkpoint marker -- no weights) into $OUT/study_arms.tgz.
# A device machine starts bare, so every call must finish its arms; unpack the archives here into
# the same --root and `python bench/study.py --root .data/study --stage collect` writes the tables.
#
# Once, here:  mkdir -p .data/corpus && cp ../shared/data/corpus/*.xz .data/corpus/ &&
#              python bench/study.py --root .data/study --stage tokenizer --train .data/corpus/train.jsonl.xz
# Per call (carry .whl and .data):  STEPS=900 bash bench/study_device.sh softmax_rope focal
# Here, after it:  tar xzf <files_at>/study_arms.tgz -C .data/study
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! python3 -c 'import grain, ml_collections' 2>/dev/null; then  # the GPU image lacks them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
  export PYTHONPATH=/tmp/site:.whl/stub:$PWD
fi
export PYTHONUNBUFFERED=1
ROOT=${ROOT:-/tmp/study}; mkdir -p "$ROOT"
cp -r .data/study/tokenizer "$ROOT/"
C=.data/corpus
arms=$(IFS=,; echo "$*")
python3 bench/study.py --root "$ROOT" --arms "$arms" --size "${SIZE:-100m}" --steps "${STEPS:-900}" \
  --train $C/train.jsonl.xz --valid $C/valid.jsonl.xz --books $C/longeval.jsonl.xz \
  --val_batches "${VAL_BATCHES:-200}" --time_limit "${LIMIT:-540}" --no_plots 2>&1 \
  | grep --line-buffered -v -i "autotun\|deprecat" | tee "$OUT/study.log" | tail -40
cd "$ROOT" && tar czf "$OUT/study_arms.tgz" --exclude='*/checkpoints/*/*' \
  $(for d in */; do d=${d%/}; [ "$d" = tokenizer ] && continue; echo "$d"; done)
