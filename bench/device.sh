#!/usr/bin/env bash
# The GPU side of the repository as named stages, each writing JSON under $OUT (default /tmp/out):
#   bash bench/device.sh tests kernels:500 train_step
#   STUDY_ARMS="softmax_rope focal" STEPS=900 bash bench/device.sh study:560
#
#   tests       the compiled kernel tests (tests/kernels -k Compiled), then every other test
#               marked gpu; TEST_WORKERS (4) processes with pytest-xdist -> tests.json
#   kernels     bench/attention.py and bench/dilution.py, default shapes -> attention.json, dilution.json
#   train_step  bench/train_step.py                                -> train_step.json
#   scaling     bench/scaling.py over every visible GPU            -> scaling.json
#   study       bench/study.py's arms and seeds over the GPUs (below) -> study.json, study_arms.tgz
#   focus       bench/focus_decode.py, FocusLLM decoding           -> focus_decode.json
#   compare     a refactor's check: the focal kernel, dilution fwd+bwd, the 1.3B and 209M-dilution
#               steps, each in BEFORE (default .gpu/before: an older tree unpacked here and
#               carried, e.g. `git archive REV | tar -x -C .gpu/before`), then in this one
#               -> before_*.json, after_*.json
#
# name:seconds gives a stage its wall limit (default 900 s). The limit is the stage's: its commands
# share it, each running under what is left, so one stuck stage cannot eat the whole call.
# <SCRIPT>_ARGS adds arguments to one script, e.g. TRAIN_STEP_ARGS="--sizes 1.3b --batch 24".
# Each stage's log is $OUT/<stage>.log; past 8 files, everything under $OUT goes into device.tgz.
#
# Wheels the GPU image lacks travel as cp312 wheels in .whl/ (carry it; device_env.sh installs):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     grain==0.2.18 array-record ml_collections tensorboardX portpicker dm-tree pytest-xdist execnet
# For the optional tokamax rows add tokamax==0.0.12 jaxtyping typeguard==2.13.3 wadler-lindig
# einshape pydantic pydantic-core qwix immutabledict annotated-types typing-inspection
# typing_extensions (bench/tokamax_shim.py adapts that release to current jax).
#
# study: the corpus in .data/corpus/ (train, valid, longeval .jsonl.xz) and, once, the tokenizer:
#   python bench/study.py --root .data/study --stage tokenizer
# Carry .whl, .data/corpus and .data/study. STUDY_ARMS (default: every arm), SEEDS (0; a comma
# list), STEPS (900), SIZE (100m), SUITES (val,longdoc,passkey,keyword), VAL_BATCHES (200), GPUS
# (default: all), PER_GPU (1: workers sharing each GPU, for models too small to fill one; each
# (arm, seed) run is dealt to a worker), STUDY_ARGS (to study.py, e.g. "--seq_len 256"),
# COLLECT_ARMS (the arms the tables cover, default STUDY_ARMS: e.g. every arm, some run earlier),
# TRAIN_ARGS (to every train.py; give such a variant its own STUDY directory, since arms are named
# by attention and seed only), STUDY (.data/study: its finished arms are skipped). Evaluated arms
# come back in study_arms.tgz: `tar xzf study_arms.tgz -C .data/study`, then
# `python bench/study.py --root .data/study --stage collect` writes the tables (`--include OLD.json`
# joins the runs of an earlier call's study JSON). An arm cut off by the limit has no weights to
# resume from on a fresh machine: its logs are in study_partial.tgz.
set -uo pipefail
case ${1:-} in -h|--help|"") sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.." || exit 1
. bench/device_env.sh
OUT=$(cd "$OUT" && pwd)
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# The largest steps on record (400M at batch 32, 1.3B at batch 24) need more than jax's 75%.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
{ python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
  nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv
  python3 -c "import tokamax; print('tokamax', getattr(tokamax, '__version__', '?'))"
} > "$OUT/env.log" 2>&1

left() {  # CMD...: CMD under what is left of the stage's limit; SIGINT first, so that pytest
  local s=$((deadline - SECONDS))  # still writes its report and Python its traceback
  if [ "$s" -le 0 ]; then echo "stage limit reached; not run: $*"; return 124; fi
  timeout -s INT -k 30 "$s" "$@"
}
log() { grep --line-buffered -v -i "autotun\|deprecat" | tee -a "$OUT/$stage.log" | tail -n 40; }
bench() {  # NAME [ARGS...]: bench/NAME.py ARGS $NAME_ARGS --out $OUT/NAME.json
  local extra=${1^^}_ARGS
  left python3 "bench/$1.py" "${@:2}" ${!extra:-} --out "$OUT/$1.json" 2>&1 | log
}

tests_stage() {
  local pytest=(python3 -m pytest -q -o addopts= -p no:cacheprovider) n=${TEST_WORKERS:-4}
  # Compiling dominates and runs on the CPU: test files in parallel processes (each its share of
  # the GPU's memory) when pytest-xdist travels in .whl; serially otherwise.
  if [ "$n" -gt 1 ] && python3 -c "import xdist" 2>/dev/null; then
    pytest+=(-n "$n" --dist loadfile)
    local -x XLA_PYTHON_CLIENT_MEM_FRACTION
    XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.9 / $n, 3))")
  fi
  left "${pytest[@]}" tests/kernels -k Compiled --junitxml="$OUT/tests_kernels.xml" 2>&1 | log
  left "${pytest[@]}" tests -m gpu --ignore=tests/kernels --junitxml="$OUT/tests_other.xml" 2>&1 | log
  python3 - "$OUT" <<'PY'
import glob, json, os, sys
import xml.etree.ElementTree as ET
out = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "tests_*.xml"))):
  for suite in ET.parse(path).getroot().iter("testsuite"):
    cases = suite.iter("testcase")
    out[os.path.basename(path)[6:-4]] = {
        **{k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")},
        "seconds": float(suite.get("time", 0)),
        "failed": ["::".join(filter(None, (c.get("classname"), c.get("name")))) for c in cases
                   if c.find("failure") is not None or c.find("error") is not None]}
  os.remove(path)
json.dump(out, open(os.path.join(sys.argv[1], "tests.json"), "w"), indent=1)
print(json.dumps({k: {n: v[n] for n in ("tests", "failures", "errors")} for k, v in out.items()}))
PY
}

compare_stage() {
  local before=${BEFORE:-.gpu/before}
  [ -d "$before/bench" ] || { echo "compare: BEFORE=$before holds no tree"; return 1; }
  before=$(cd "$before" && pwd); local here=$PWD
  pair() {  # NAME SCRIPT ARGS...: the same command in the older tree, then in this one
    local tree side
    for tree in "$before" "$here"; do
      side=after; [ "$tree" = "$before" ] && side=before
      (cd "$tree" && PYTHONPATH="$tree:/tmp/site:$here/.whl/stub" left python3 "$2" "${@:3}" \
        --out "$OUT/${side}_$1.json") 2>&1 | log
    done
  }
  pair attention bench/attention.py --impls mosaic,cudnn \
    --shapes "2,16,4096,128;1,16,8192,128;1,8,16384,128;2,12,16384,64"
  pair dilution bench/dilution.py --impls dilution,cudnn --train-shapes 2x12x16384x64 \
    --skip prefill,decode
  # Batch 12: 16 needs 77.8 GiB, more than an H100 holds, in either tree.
  pair step_1p3b bench/train_step.py --sizes 1.3b --batch 12 --impls pallas --steps 10
  pair step_dilution bench/train_step.py --sizes 209m --seq_len 16384 --batch 1 --impls pallas \
    --patterns dilution:none --steps 10
}

study_stage() {
  local root=/tmp/study C=.data/corpus g i w
  local arms=(${STUDY_ARMS:-softmax_rope dilution_nope focal softmax_nope hybrid focal_learned})
  local seeds=(${SEEDS:-0}) runs=() frac=$XLA_PYTHON_CLIENT_MEM_FRACTION
  seeds=(${seeds[*]//,/ })
  for i in "${arms[@]}"; do for g in "${seeds[@]}"; do runs+=("$i:$g"); done; done
  mkdir -p "$root" && cp -r "${STUDY:-.data/study}/." "$root/"
  local G=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c ^GPU)}; G=$(( G > 0 ? G : 1 ))
  local W=$(( G * ${PER_GPU:-1} ))
  # study.py stops at --time_limit (train.py gets SIGTERM and saves); a minute is left to pack.
  worker() {  # W: its runs (dealt round-robin, in the order given), one after another
    local r
    for ((r = $1; r < ${#runs[@]}; r += W)); do
      CUDA_VISIBLE_DEVICES=$(( $1 % G )) XLA_PYTHON_CLIENT_MEM_FRACTION=$frac \
        python3 bench/study.py --root "$root" \
        --arms "${runs[r]%%:*}" --seeds "${runs[r]#*:}" --size "${SIZE:-100m}" \
        --steps "${STEPS:-900}" --train $C/train.jsonl.xz --valid $C/valid.jsonl.xz \
        --books $C/longeval.jsonl.xz --val_batches "${VAL_BATCHES:-200}" \
        --suites "${SUITES:-val,longdoc,passkey,keyword}" ${STUDY_ARGS:-} --no_plots \
        --time_limit $(( deadline - SECONDS - 60 > 30 ? deadline - SECONDS - 60 : 30 )) \
        --out "$root/study_${runs[r]/:/_s}.json" ${TRAIN_ARGS:+-- $TRAIN_ARGS}
    done > "$OUT/study_worker$1.log" 2>&1
  }
  # Each worker its share of the GPU's memory.
  [ "${PER_GPU:-1}" -gt 1 ] && frac=$(python3 -c "print(round(0.9 / ${PER_GPU}, 3))")
  worker 0 &
  # Worker 0 fills the token cache first, unless it exists: the others load it.
  if [ "$W" -gt 1 ] && [ ! -d "$root/tokens" ]; then
    until grep -q "first step started" "$OUT/study_worker0.log" 2>/dev/null ||
          [ -z "$(jobs -r)" ] || [ $((deadline - SECONDS)) -lt 120 ]; do sleep 2; done
  fi
  for ((w = 1; w < W; w++)); do worker "$w" & done
  wait
  tail -n 25 "$OUT"/study_worker*.log
  local all; all=$(IFS=,; echo "${COLLECT_ARMS:-${arms[*]}}" | tr ' ' ,)
  python3 bench/study.py --root "$root" --arms "$all" --seeds "${SEEDS:-0}" --stage collect \
    --size "${SIZE:-100m}" ${STUDY_ARGS:-} --no_plots --out "$OUT/study.json" 2>&1 | log
  # No weights travel: the empty checkpoints/<step> directories are what mark an arm trained.
  ( cd "$root" || exit 1
    done_arms=(); partial=()
    for d in */; do
      d=${d%/}; case $d in tokenizer|tokens) continue ;; esac  # the BPE and the token cache
      if [ -f "$d/eval/results.json" ]; then done_arms+=("$d"); else partial+=("$d"); fi
    done
    [ ${#done_arms[@]} -gt 0 ] && tar czf "$OUT/study_arms.tgz" --exclude='*/checkpoints/*/*' "${done_arms[@]}"
    [ ${#partial[@]} -gt 0 ] && tar czf "$OUT/study_partial.tgz" --exclude='*/checkpoints/*' "${partial[@]}"
    echo "evaluated: ${done_arms[*]:-none}; cut off: ${partial[*]:-none}" )
}

for spec in "$@"; do
  stage=${spec%%:*}; limit=${spec#*:}; [ "$limit" = "$spec" ] && limit=900
  deadline=$((SECONDS + limit))
  echo "=== $stage $(date +%T) (limit ${limit}s)"
  case $stage in
    tests) tests_stage ;;
    kernels) bench attention; bench dilution ;;
    train_step) bench train_step ;;
    scaling) bench scaling ;;
    study) study_stage ;;
    focus) bench focus_decode --size 100m --focus_impl pallas ;;
    compare) compare_stage ;;
    *) echo "unknown stage $stage (tests, kernels, train_step, scaling, study, focus, compare)" ;;
  esac
done
# A device call returns at most 8 files.
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf /tmp/device.tgz ./* && rm -rf ./* && mv /tmp/device.tgz .)
fi
