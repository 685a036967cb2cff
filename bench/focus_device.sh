#!/usr/bin/env bash
# Issue 5 in one device call: a small base pretrained on the carried corpus, the FocusLLM adapter
# over it, then the evaluation (passkey at 2-100x, loss by position to 32x, the base's own NTK
# curve) and, with DECODE=1, the decode benchmark. A device machine starts bare and its files
# survive only while it stays warm (30 s idle), so every stage can run in one call, each under its
# own wall limit, and the small outputs (configs,
# metrics, eval JSON, logs; no weights) come back packed in $OUT/focus_run.tgz.
#
# Once, here (the study's set-up, see bench/study_device.sh): .data/corpus/*.xz, the 16K BPE in
#   .data/study/tokenizer/ (and, for TOKENIZER below, e.g. .data/study_llama/tokenizer/), and the
#   cp312 wheels in .whl/. Carry them all.
# The machine keeps $ROOT while it stays warm: a second call soon after resumes the base (and the
# adapter) instead of starting over. A stage limit of 0 skips that stage, e.g. a base-only call:
#   BASE_STEPS=2000 BASE_MIX=0.5 BASE_LIMIT=540 FOCUS_LIMIT=0 EVAL_LIMIT=0 BASE_EVAL_LIMIT=0 \
#     bash bench/focus_device.sh     then, while warm:   BASE_LIMIT=0 BASE_PASSKEY_LIMIT=0 ...
# Per call:   bash bench/focus_device.sh   (about 9.5 minutes: base 700 steps ~3.7, adapter ~2.2,
#             eval ~3.5; stage limits BASE_LIMIT, FOCUS_LIMIT, EVAL_LIMIT, BASE_EVAL_LIMIT)
# CPU check:  SIZE=tiny BASE_STEPS=20 SEQ=128 FOCUS_STEPS=4 CHUNKS=16,32 PROMPT=16 LOCAL=64 \
#             FOCUS_WARMUP=1 DOC_MIN=512 BATCH=2 MULTS=2 MAXMULT=2 SEEDS=2 \
#             DECODE=1 DECODE_ARGS=--smoke COPY_MIN=0 bash bench/focus_device.sh
#
# The base is the study's softmax+RoPE arm (bench/study.py: same tokenizer, data and preset) with
# fewer steps and BASE_MIX (0.3) of its rows passkey drills (data.retrieval_mix: the study's bases
# never read a needle even inside their context); the adapter turns FOCUS_MIX (0.5) of its
# continuation samples into drills (focus.retrieval_mix). The adapter uses the paper's recipe
# (configs/focus.py) with chunks that fit the base's 1K context: chunk + prompt + targets - 1 <= 1024.
# MEM: focus.memory_tokens, memory lengths drawn per step (default: DOC_MIN - LOCAL - 1, i.e. 4
# chunks of 512); e.g. DOC_MIN=8000 MEM=2048,4096,7168 for 4 to 14 chunks. DOC_MAX:
# focus.doc_max_tokens (8000), raised with memories past it.
# PK_BATCH: passkey trials per generate call in the eval stage (eval.py --focus_passkey_batch, 1).
# TARGETS: focus.num_targets (16); the local decoder runs BATCH x TARGETS rows, most of a step.
# WINDOW: focus.drill_in_window, the share of drills whose needle sits in the local window (0).
# PRECON: focus.p_reconstruction (the paper's 0.5); lower it to give the drills' answers more of the loss.
# ANSWER_W: focus.answer_weight, how many times a drill answer's targets count in the loss (1).
# CAND_BIAS: focus.candidate_bias, "none" (the paper) or "log_count" (candidates' logits - log C),
# for the adapter (and the copy-initialised one); EVAL_CAND_BIAS overrides it in the eval stage.
# SINK: focus.sink, "none" (the paper) or "first_token" (the memory's first token's frozen k/v as an
# attention sink before the candidates; needs CAND_BIAS=none); EVAL_SINK overrides it at eval.
# STAGES="1:150 2:150 3:400": instead of the knobs above, the committed staged recipe
# (configs/focus_drills.py:stage=N, FOCUSLLM.md § Eighteenth), each stage resuming $RUN under its
# own limit in seconds; BATCH, FOCUS_CKPT, DTYPE, FOCUS_IMPL and FOCUS_ARGS (free-form overrides,
# e.g. "--config.optim.peak_lr=2e-3") still apply. FOCUS_LIMIT=0 skips it too.
# KEY_STALL=9 (with STAGES): after each stage, stop there, and skip the evaluation, when the
# drills' answer NLL over its last 100 steps is still above 9 (the prior is ~11.8; runs that read
# the memory were at 5.8-7.0 by step 600) and the run has passed step KEY_STALL_FROM (600; no
# verdict before). E.g. STAGES="1:80 1:100 2:150" KEY_STALL=9 probes first: 80 s is ~800 steps
# with the compile, 60 s only ~400 (twentieth session).
# FOCUS_SEED: the adapter run's config.seed (0), i.e. its sample order, drills and keys (the adapter
# starts as a copy of the base, so that is all it changes): repeats of one arm over one base.
# FOCUS_SEEDS="1 2 3": stages 2 and 3 once per seed, each in $RUN-s<seed>, logging to
# adapter_s<seed>.log and eval_focus_s<seed>.log (keep 3 or fewer: the 8-file return limit).
# CAND_PATH: focus.candidate_path, "adapter" (the paper: the candidate's own q/k/v/o train) or
# "frozen" (the candidate's forward stays the base's; only the k/v the window sees train).
# ADAPTER: what the eval stage reads (default: the adapter run's latest adapter/<step>).
# FILLER=books: passkey prompts filled with a held-out book instead of the official sentences.
# CAND_POS: focus.candidate_positions for stages 1b and 2, default sequential (the official
# layout); shared for the A/B. configs/focus_drills.py's recipe (FOCUSLLM.md, tenth and
# thirteenth sessions): CHUNKS=512 TARGETS=8 PRECON=0 FOCUS_LR=1e-3 FOCUS_WARMUP=50 FOCUS_MIX=0.9
# and ~2800 steps; with TARGETS=16 and the paper's PRECON (0.5) it learned in two runs of four.
set -uo pipefail
ROOT=${ROOT:-/tmp/focus}
# A call that skips the base (BASE_LIMIT=0) needs the one an earlier call left on this machine. A
# machine idle for 30 s is released with its files (eleventh session: a base lost that way), so fail
# in seconds, before the wheels install, instead of spending the call on nothing.
uses_base=$(( ${BASE_PASSKEY_LIMIT:-40} + ${INIT_LIMIT:-0} + ${FOCUS_LIMIT:-130} + ${EVAL_LIMIT:-130} \
  + ${BASE_EVAL_LIMIT:-50} ))
if [ "${BASE_LIMIT:-220}" = 0 ] && [ "$uses_base" != 0 ] && [ ! -f "$ROOT/softmax_rope-s0/config.json" ]; then
  echo "focus_device.sh: BASE_LIMIT=0 but no base at $ROOT/softmax_rope-s0 (a fresh machine?);" \
       "train the base first" >&2
  exit 3
fi
# RUN_TAG (e.g. the session's name, the same in all of its calls) guards against a machine that
# holds an earlier session's $ROOT (thirteenth session: a machine reported cold held the
# eleventh's adapter). The base stage starts a $ROOT tagged otherwise afresh (study.py would
# resume a stale base); later calls that skip the base fail in seconds unless the tags match.
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
# it falls below ~10 (seventeenth session). Before ~600 steps a run that takes off can still be
# above 9 (twentieth session: 10.09 at steps 301-400, 7.01 at 501-600), so earlier is no verdict.
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
# Not under XLA's --xla_gpu_deterministic_ops: with it, jax 0.11.2 failed the base's first step
# (an XLA-internal IndexError, twentieth session), so same-seed bases still differ across sessions.
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
#     the chunk layout lets the base read the needle at all, before any training (INIT_LIMIT=0 skips).
#     INIT_BIASES (default: CAND_BIAS) evaluates it once per candidate bias (eval.py
#     --focus_candidate_bias), each under INIT_LIMIT, into $OUT/eval_init_<bias>.log, e.g.
#     INIT_BIASES="none log_count"; likewise INIT_SINKS (default: SINK) per sink, e.g.
#     INIT_SINKS="none first_token" (logs eval_init_<bias>[_<sink>].log; a sink runs with bias none).
if [ "${INIT_LIMIT:-0}" != 0 ]; then
  python3 -c "import sys; from focaljax import focus, focus_adapter, loaded
m = loaded.load(sys.argv[1])
focus_adapter.save_adapter(sys.argv[2], focus.init_adapter(m.model, sys.argv[8]), focus.FocusConfig(
    int(sys.argv[3]), prompt_len=int(sys.argv[4]), implementation=sys.argv[5],
    candidate_positions=sys.argv[6], candidate_bias=sys.argv[7], candidate_path=sys.argv[8]),
    sys.argv[1])" \
    "$BASE" "$ROOT/focus_init" "${CHUNKS%%,*}" "${PROMPT:-256}" "${FOCUS_IMPL:-pallas}" \
    "${CAND_POS:-sequential}" "${CAND_BIAS:-none}" "${CAND_PATH:-adapter}"
  for sink in ${INIT_SINKS:-${SINK:-none}}; do
    for bias in ${INIT_BIASES:-${CAND_BIAS:-none}}; do
      [ "$sink" != none ] && [ "$bias" != none ] && continue   # focus.FocusConfig refuses both
      name=$bias; [ "$sink" != none ] && name=${bias}_$sink
      stage "init_adapter ($name)" "${INIT_LIMIT}"
      run_for "${INIT_LIMIT}" python3 eval.py --workdir "$BASE" --focus_adapter "$ROOT/focus_init" \
        --suites focus_passkey --focus_multipliers "${INIT_MULTS:-2,8}" --passkey_seeds "${SEEDS:-10}" \
        --focus_dtype "${DTYPE:-bfloat16}" --focus_local_len "${LOCAL:-512}" \
        --focus_candidate_bias="$bias" --focus_sink="$sink" --out_dir "$ROOT/focus_init/eval_$name" \
        2>&1 | quiet > "$OUT/eval_init_$name.log"
      tail -n 8 "$OUT/eval_init_$name.log"
    done
  done
fi

# 2. The adapter (SIGTERM at the limit: train.py saves the adapter and exits).
# COPY_MIN gates it on the base's copy gain (the copy suite above): the one adapter that learned to
# read the memory sat on a base with gain 0.23, the one that did not on 0.12 (FOCUSLLM.md, tenth and
# eleventh sessions). Two runs, so a heuristic: COPY_MIN=0 turns the gate off. Fitted on the 16K
# BPE: a digit-per-token base with gain 0.173 was refused, and its adapter then left the answer
# prior fastest of all (twenty-first session); with TOKENIZER set, pass COPY_MIN=0.
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
      # prior; the later stages and the evaluation would spend the call on it (nineteenth session).
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
      ${WINDOW:+--config.focus.drill_in_window=$WINDOW} ${PRECON:+--config.focus.p_reconstruction=$PRECON} \
      ${ANSWER_W:+--config.focus.answer_weight=$ANSWER_W} \
      --config.data.global_batch="${BATCH:-8}" --config.train.steps="${FOCUS_STEPS:-400}" \
      --config.optim.warmup_steps="${FOCUS_WARMUP:-30}" ${FOCUS_LR:+--config.optim.peak_lr=$FOCUS_LR} \
      --config.train.ckpt_every="${FOCUS_CKPT:-50}" \
      --config.focus.candidate_positions="${CAND_POS:-sequential}" \
      --config.focus.candidate_bias="${CAND_BIAS:-none}" --config.focus.sink="${SINK:-none}" \
      --config.focus.candidate_path="${CAND_PATH:-adapter}" \
      --config.focus.retrieval_mix="${FOCUS_MIX:-0.5}" 2>&1 | quiet >> "$OUT/adapter$sfx.log"
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
      --focus_passkey_batch "${PK_BATCH:-1}" --focus_passkey_filler "${FILLER:-grass}" \
      ${EVAL_CAND_BIAS:+--focus_candidate_bias=$EVAL_CAND_BIAS} ${EVAL_SINK:+--focus_sink=$EVAL_SINK} \
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
find . -path '*/adapter/*/focus.json' >> /tmp/focus_files
tar czf "$OUT/focus_run.tgz" -T /tmp/focus_files
# Skipped stages leave empty logs, and each counts against the 8 (fifteenth session: a call that
# copied two more files lost this archive to the count).
find "$OUT" -maxdepth 1 -type f -empty -delete
ls -la "$OUT"
