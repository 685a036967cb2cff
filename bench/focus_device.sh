#!/usr/bin/env bash
# FocusLLM end to end in one device call: a small base pretrained on the carried corpus, the
# adapter over it, then the evaluation (passkey at 2-100x, loss by position to 32x, the base's own
# NTK curve) and, with DECODE=1, the decode benchmark. A device machine starts bare and its files
# survive only while it stays warm, so every stage can run in one call, each under its own wall
# limit, and the small outputs (configs, metrics, eval JSON, logs; no weights) come back packed in
# $OUT/focus_run.tgz.
#
# Once, here (the study's set-up, see bench/device.sh): .data/corpus/*.xz, the 16K BPE in
#   .data/study/tokenizer/ (and, for TOKENIZER below, e.g. .data/study_llama/tokenizer/), and the
#   cp312 wheels in .whl/. Carry them all.
# The machine keeps $ROOT while it stays warm: a second call soon after resumes the base (and the
# adapter) instead of starting over. A stage limit of 0 skips that stage, e.g. a base-only call:
#   BASE_STEPS=2000 BASE_MIX=0.5 BASE_LIMIT=540 FOCUS_LIMIT=0 EVAL_LIMIT=0 BASE_EVAL_LIMIT=0 \
#     bash bench/focus_device.sh     then, while warm:   BASE_LIMIT=0 BASE_PASSKEY_LIMIT=0 ...
# Stage limits: BASE_LIMIT, BASE_PASSKEY_LIMIT, INIT_LIMIT, FOCUS_LIMIT, EVAL_LIMIT, BASE_EVAL_LIMIT.
# CPU check:  SIZE=tiny BASE_STEPS=20 SEQ=128 FOCUS_STEPS=4 CHUNKS=16,32 PROMPT=16 LOCAL=64 \
#             FOCUS_WARMUP=1 DOC_MIN=512 BATCH=2 MULTS=2 MAXMULT=2 SEEDS=2 \
#             DECODE=1 DECODE_ARGS=--smoke COPY_MIN=0 bash bench/focus_device.sh
#
# The base is the study's softmax+RoPE arm (bench/study.py: same tokenizer, data and preset) with
# fewer steps and BASE_MIX (0.3) of its rows passkey drills (data.retrieval_mix). The adapter:
# STAGES="1:150 2:150 3:400" runs the staged recipe (configs/focus_drills.py:stage=N), each stage
# resuming $RUN under its own limit in seconds; without STAGES, configs/focus.py with the knobs
# below. BATCH, FOCUS_CKPT, DTYPE, FOCUS_IMPL and FOCUS_ARGS (free-form overrides, e.g.
# "--config.optim.peak_lr=2e-3") apply to both.
# Knobs of configs/focus.py: CHUNKS (focus.chunk_sizes, chunk + prompt + targets - 1 <= 1024),
# PROMPT, LOCAL, DOC_MIN, DOC_MAX, MEM (focus.memory_tokens, e.g. DOC_MIN=8000 MEM=2048,4096,7168
# for 4 to 14 chunks), TARGETS (focus.num_targets), PRECON (focus.p_reconstruction), FOCUS_MIX
# (focus.retrieval_mix, 0.5), CAND_PATH (focus.candidate_path: adapter | frozen), FOCUS_STEPS,
# FOCUS_WARMUP, FOCUS_LR.
# KEY_STALL=9 (with STAGES): after each stage, stop there, and skip the evaluation, when the
# drills' answer NLL over its last 100 steps is still above 9 (the prior is ~11.8; runs that read
# the memory were at 5.8-7.0 by step 600) and the run has passed step KEY_STALL_FROM (600).
# FOCUS_SEED: the adapter run's config.seed (0): its sample order, drills and keys.
# FOCUS_SEEDS="1 2 3": stages 2 and 3 once per seed, each in $RUN-s<seed>, logging to
# adapter_s<seed>.log and eval_focus_s<seed>.log (keep 3 or fewer: the 8-file return limit).
# ADAPTER: what the eval stage reads (default: the adapter run's latest checkpoint).
# PK_BATCH: passkey trials per generate call (eval.py --focus_passkey_batch, 1).
# FILLER=books: passkey prompts filled with a held-out book instead of the official sentences.
set -uo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;; esac
ROOT=${ROOT:-/tmp/focus}
# A call that skips the base (BASE_LIMIT=0) needs the one an earlier call left on this machine. A
# machine idle for a while is released with its files, so fail in seconds, before the wheels
# install, instead of spending the call on nothing.
uses_base=$(( ${BASE_PASSKEY_LIMIT:-40} + ${INIT_LIMIT:-0} + ${FOCUS_LIMIT:-130} + ${EVAL_LIMIT:-130} \
  + ${BASE_EVAL_LIMIT:-50} ))
if [ "${BASE_LIMIT:-220}" = 0 ] && [ "$uses_base" != 0 ] && [ ! -f "$ROOT/softmax_rope-s0/config.json" ]; then
  echo "focus_device.sh: BASE_LIMIT=0 but no base at $ROOT/softmax_rope-s0 (a fresh machine?);" \
       "train the base first" >&2
  exit 3
fi
# RUN_TAG (the same in all calls of one experiment) guards against a machine that still holds an
# earlier experiment's $ROOT. The base stage starts a $ROOT tagged otherwise afresh (study.py
# would resume a stale base); later calls that skip the base fail in seconds unless the tags match.
tag=$(cat "$ROOT/run_tag" 2>/dev/null || true)
if [ -n "${RUN_TAG:-}" ] && [ "$tag" != "$RUN_TAG" ]; then
  if [ "${BASE_LIMIT:-220}" = 0 ] && [ "$uses_base" != 0 ]; then
    echo "focus_device.sh: $ROOT is tagged '${tag:-none}', not RUN_TAG=$RUN_TAG: its base is not" \
         "this run's; train the base first" >&2
    exit 3
  fi
  if [ "${BASE_LIMIT:-220}" != 0 ] && [ -d "$ROOT" ]; then
    echo "focus_device.sh: $ROOT is tagged '${tag:-none}', not RUN_TAG=$RUN_TAG: starting it afresh"
    rm -rf "$ROOT"
  fi
fi
if [ -n "${RUN_TAG:-}" ] && [ "${BASE_LIMIT:-220}" != 0 ]; then
  mkdir -p "$ROOT" && echo "$RUN_TAG" > "$ROOT/run_tag"
fi
. "$(dirname "$0")/device_env.sh"
# TOKENIZER: the BPE directory the base trains with (default the study's;
# .data/study_llama/tokenizer from `bench/study.py --root .data/study_llama --stage tokenizer
# --digits llama_digits`: one token per digit, the space before a number its own). The base's
# workdir keeps its own copy, which the adapter and the evaluation read.
mkdir -p "$ROOT"; rm -rf "$ROOT/tokenizer"; cp -r "${TOKENIZER:-.data/study/tokenizer}" "$ROOT/tokenizer"
C=.data/corpus
# RUN: the adapter's workdir; a second arm on the same warm machine needs its own (an existing
# one resumes), e.g. RUN=/tmp/focus/focus_seq.
BASE=$ROOT/softmax_rope-s0; RUN=${RUN:-$ROOT/focus}
quiet() { grep --line-buffered -v -i "autotun\|deprecat"; }
stage() { echo "=== $1 $(date +%T) (limit ${2}s)"; }
# run_for SECONDS CMD...: CMD under that wall limit (SIGTERM: train.py saves and exits); 0 skips
# it. (`timeout 0` itself would mean no limit at all.)
run_for() { local s=$1; shift; if [ "$s" != 0 ]; then timeout -s TERM "$s" "$@"; fi; }
# key_report METRICS [LIMIT [FROM_STEP]]: loss_key (the drills' answer NLL) by 100-step window, and
# over the last 100 steps; exits 3 when that last mean is above LIMIT and the run has reached
# FROM_STEP (1: no metrics to read). A run has left the answer prior (~11.8 over the 16K BPE) once
# it falls below ~10. Before ~600 steps a run that takes off can still be above 9, so earlier is
# no verdict.
key_report() {
  python3 - "$1" "${2:-inf}" "${3:-0}" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "loss_key" in l]
win = {}
for r in rows:
  win.setdefault((r["step"] - 1) // 100, []).append(r["loss_key"])
print("loss_key by 100 steps:", " ".join(f"{sum(v) / len(v):.2f}" for _, v in sorted(win.items())))
last = [r["loss_key"] for r in rows if r["step"] > rows[-1]["step"] - 100]
mean = sum(last) / len(last)
print(f"loss_key over the last 100 steps: {mean:.2f}")
if rows[-1]["step"] < int(sys.argv[3]):
  print(f"no stall verdict before step {sys.argv[3]} (at {rows[-1]['step']})")
  sys.exit(0)
sys.exit(3 if mean > float(sys.argv[2]) else 0)
PY
}

# 1. The base (train, then the validation loss only; the study's other suites are not needed).
# Not under XLA's --xla_gpu_deterministic_ops (it failed the base's first step with an
# XLA-internal error), so same-seed bases still differ from run to run.
stage base "${BASE_LIMIT:-220}"
# study.py stops itself at --time_limit; the wall limit only adds 30 s of grace for its save.
run_for $(( ${BASE_LIMIT:-220} > 0 ? ${BASE_LIMIT:-220} + 30 : 0 )) python3 bench/study.py --root "$ROOT" \
  --arms softmax_rope --size "${SIZE:-100m}" --steps "${BASE_STEPS:-700}" \
  ${SEQ:+--seq_len $SEQ} --train $C/train.jsonl.xz --valid $C/valid.jsonl.xz \
  --books $C/longeval.jsonl.xz --suites val --val_batches "${VAL_BATCHES:-50}" --no_plots \
  --time_limit "${BASE_LIMIT:-220}" -- --config.data.retrieval_mix="${BASE_MIX:-0.3}" 2>&1 \
  | quiet > "$OUT/base.log"
tail -n 4 "$OUT/base.log" 2>/dev/null
# Can the base read a passkey inside its own context, and copy a span of text it holds (the
# copy suite: reconstruction samples assume it)? FocusLLM cannot carry what the base cannot read.
run_for "${BASE_PASSKEY_LIMIT:-40}" python3 eval.py --workdir "$BASE" --suites passkey,copy \
  --max_multiplier 1 --passkey_seeds "${SEEDS:-10}" --noplots 2>&1 | quiet > "$OUT/eval_base_passkey.log"
tail -n 6 "$OUT/eval_base_passkey.log"

# 1b. The copy-initialised adapter (no training) on the passkey suite: at init every candidate IS
#     the base's hidden state on [chunk | prompt], so its `candidate reads key` column says whether
#     the chunk layout lets the base read the needle at all (INIT_LIMIT=0, the default, skips).
if [ "${INIT_LIMIT:-0}" != 0 ]; then
  rm -rf "$ROOT/focus_init"
  python3 -c "import sys
from focaljax.evaluation import loading
from focaljax.focus import model as focus, train as adapter
from focaljax.train import checkpoint
m = loading.load(sys.argv[1])
cfg = focus.FocusConfig(int(sys.argv[3]), prompt_len=int(sys.argv[4]), implementation=sys.argv[5],
                        candidate_path=sys.argv[6])
checkpoint.save_params(sys.argv[2], 0, focus.init_adapter(m.model, cfg.candidate_path), adapter.meta(
    cfg, trained_prompt_len=cfg.prompt_len, local_len=int(sys.argv[7]), base_workdir=m.workdir))" \
    "$BASE" "$ROOT/focus_init" "${CHUNKS%%,*}" "${PROMPT:-256}" "${FOCUS_IMPL:-pallas}" \
    "${CAND_PATH:-adapter}" "${LOCAL:-512}"
  stage init_adapter "${INIT_LIMIT}"
  run_for "${INIT_LIMIT}" python3 eval.py --workdir "$BASE" --focus_adapter "$ROOT/focus_init" \
    --suites focus_passkey --focus_multipliers "${INIT_MULTS:-2,8}" --passkey_seeds "${SEEDS:-10}" \
    --focus_dtype "${DTYPE:-bfloat16}" 2>&1 | quiet > "$OUT/eval_init.log"
  tail -n 8 "$OUT/eval_init.log"
fi

# 2. The adapter (SIGTERM at the limit: train.py saves the adapter and exits).
# COPY_MIN gates it on the base's copy gain (the copy suite above): a heuristic fitted on two runs
# over the 16K BPE (an adapter learned over a base with gain 0.23, not over one with 0.12);
# COPY_MIN=0 turns the gate off, as a digit-per-token TOKENIZER needs.
# The check prints the gain and succeeds only when it is below COPY_MIN (no copy.json: no gate).
FOCUS_RUN=${FOCUS_LIMIT:-130}
if [ "$FOCUS_RUN" != 0 ] && gain=$(python3 -c "import json, sys
g = json.load(open(sys.argv[1]))['copy_gain']; print(g); sys.exit(g >= float(sys.argv[2]))" \
     "$BASE/eval/copy.json" "${COPY_MIN:-0.18}" 2>/dev/null); then
  echo "adapter skipped: the base's copy gain $gain < COPY_MIN=${COPY_MIN:-0.18}; train a stronger" \
       "base (more BASE_STEPS), or COPY_MIN=0 to train the adapter anyway"
  FOCUS_RUN=0
fi
# One adapter and its evaluation per seed (FOCUS_SEEDS above); without it, one run in $RUN.
for seed in ${FOCUS_SEEDS:-"${FOCUS_SEED:-}"}; do
  run=$RUN; sfx=""
  if [ -n "${FOCUS_SEEDS:-}" ]; then run=$RUN-s$seed; sfx=_s$seed; fi
  : > "$OUT/adapter$sfx.log"; stalled=""
  # What every adapter run takes, the staged recipe's and the knobs' alike.
  common=(--workdir "$run" --config.focus.base_workdir="$BASE"
          --config.data.source="text:$C/train.jsonl.xz" ${seed:+--config.seed=$seed}
          --config.train.log_every=10 --config.train.compute_dtype="${DTYPE:-bfloat16}"
          --config.focus.implementation="${FOCUS_IMPL:-pallas}")
  if [ -n "${STAGES:-}" ] && [ "$FOCUS_RUN" != 0 ]; then
    # The committed recipe, configs/focus_drills.py:stage=N, each stage resuming $run under its own
    # limit; only the knobs below and FOCUS_ARGS (free-form overrides) change it.
    for st in $STAGES; do
      n=${st%%:*}; lim=${st#*:}
      stage "adapter$sfx stage $n" "$lim"
      run_for "$lim" python3 train.py --config "configs/focus_drills.py:stage=$n" "${common[@]}" \
        ${BATCH:+--config.data.global_batch=$BATCH} --config.train.ckpt_every="${FOCUS_CKPT:-500}" \
        ${FOCUS_ARGS:-} 2>&1 | quiet >> "$OUT/adapter$sfx.log"
      tail -n 2 "$OUT/adapter$sfx.log"
      # KEY_STALL=9: a run still above it (loss_key over its last 100 steps) has not left the answer
      # prior; the later stages and the evaluation would spend the call on it.
      if [ -n "${KEY_STALL:-}" ] && { key_report "$run/metrics.jsonl" "$KEY_STALL" "${KEY_STALL_FROM:-600}"; [ $? = 3 ]; }; then
        echo "stalled after stage $n (KEY_STALL=$KEY_STALL): the later stages and the evaluation skipped"
        stalled=1; break
      fi
    done
  else
    stage "adapter$sfx" "$FOCUS_RUN"
    run_for "$FOCUS_RUN" python3 train.py --config configs/focus.py "${common[@]}" \
      --config.focus.chunk_sizes="${CHUNKS:-128,256,512}" --config.focus.prompt_len="${PROMPT:-256}" \
      --config.focus.local_len="${LOCAL:-512}" --config.focus.doc_min_tokens="${DOC_MIN:-3000}" \
      ${DOC_MAX:+--config.focus.doc_max_tokens=$DOC_MAX} \
      ${MEM:+--config.focus.memory_tokens=$MEM} ${TARGETS:+--config.focus.num_targets=$TARGETS} \
      ${PRECON:+--config.focus.p_reconstruction=$PRECON} \
      --config.data.global_batch="${BATCH:-8}" --config.train.steps="${FOCUS_STEPS:-400}" \
      --config.optim.warmup_steps="${FOCUS_WARMUP:-30}" ${FOCUS_LR:+--config.optim.peak_lr=$FOCUS_LR} \
      --config.train.ckpt_every="${FOCUS_CKPT:-50}" \
      --config.focus.candidate_path="${CAND_PATH:-adapter}" \
      --config.focus.retrieval_mix="${FOCUS_MIX:-0.5}" ${FOCUS_ARGS:-} 2>&1 \
      | quiet >> "$OUT/adapter$sfx.log"
  fi
  tail -n 4 "$OUT/adapter$sfx.log" 2>/dev/null
  key_report "$run/metrics.jsonl" 2>/dev/null

  # 3. Evaluation: the FocusLLM suites, then the base alone (full attention, NTK-scaled RoPE).
  # EVAL_PROMPTS="- 256": one evaluation per dynamic prompt length, each under EVAL_LIMIT ("-":
  # the run's focus.eval_prompt_len, 504 in configs/focus_drills.py, else the adapter's trained
  # one); the others write eval_p<N>/ and eval_focus<sfx>_p<N>.log. EVAL_SUITES (eval.py --suites,
  # e.g. focus_passkey) narrows them.
  eval_limit=${EVAL_LIMIT:-130}; if [ -n "${stalled:-}" ]; then eval_limit=0; fi
  for prompt in ${EVAL_PROMPTS:--}; do
    ptag=""; pargs=()
    if [ "$prompt" != - ]; then
      ptag=_p$prompt; pargs=(--focus_prompt_len "$prompt" --out_dir "$run/eval$ptag")
    fi
    stage "eval$sfx$ptag" "$eval_limit"
    run_for "$eval_limit" python3 eval.py --workdir "$BASE" --focus_adapter "${ADAPTER:-$run}" \
      --books $C/longeval.jsonl.xz --focus_dtype "${DTYPE:-bfloat16}" \
      --focus_multipliers "${MULTS:-2,8,32,100}" --passkey_seeds "${SEEDS:-10}" \
      --max_multiplier "${MAXMULT:-32}" --max_books "${MAXBOOKS:-8}" \
      --focus_passkey_batch "${PK_BATCH:-1}" \
      ${EVAL_SUITES:+--suites=$EVAL_SUITES} ${pargs[@]+"${pargs[@]}"} \
      2>&1 | quiet > "$OUT/eval_focus$sfx$ptag.log"
    tail -n 16 "$OUT/eval_focus$sfx$ptag.log" 2>/dev/null
  done
done
run_for "${BASE_EVAL_LIMIT:-50}" python3 eval.py --workdir "$BASE" --suites longdoc \
  --books $C/longeval.jsonl.xz --max_multiplier "${MAXMULT:-32}" --max_books "${MAXBOOKS:-8}" \
  --noplots 2>&1 | quiet \
  > "$OUT/eval_base.log"
tail -n 6 "$OUT/eval_base.log" 2>/dev/null

# 4. Decode speed at 8x and 32x of a 1K context: random weights of the base's shape, batched
#    chunks against one chunk at a time and the base with full attention. Off by default (DECODE=1):
#    with it the call passes the device's 10 minutes; run it alone with DECODE=1 and the limits
#    of the other stages at 0, or as `python3 bench/focus_decode.py` in a call of its own.
if [ "${DECODE:-0}" != 0 ]; then
  stage decode "${DECODE_LIMIT:-90}"
  run_for "${DECODE_LIMIT:-90}" python3 bench/focus_decode.py --focus_impl pallas \
    ${DECODE_ARGS:---size 100m --chunk_size 512 --prompt_len 256 --local_len 512} \
    --out "$ROOT/focus_decode.json" 2>&1 | quiet > "$OUT/decode.log"
  tail -n 8 "$OUT/decode.log"
fi

# The device returns at most 8 files: everything small, in one archive (no checkpoints).
cd "$ROOT" || exit 1
find . -name '*.json' -o -name '*.jsonl' -o -name '*.txt' | grep -v '/checkpoints/\|/adapter/\|tokenizer.json' \
  > /tmp/focus_files
tar czf "$OUT/focus_run.tgz" -T /tmp/focus_files
# Skipped stages leave empty logs, and each counts against the 8 returned files.
find "$OUT" -maxdepth 1 -type f -empty -delete
ls -la "$OUT"
