"""FocusLLM adapter recipe for a small (35-100M, 1K-context) base, in three memory stages.

  for s in 1 2 3; do
    python train.py --config configs/focus_drills.py:stage=$s --workdir runs/focus_small \
        --config.focus.base_workdir=runs/base_1k --config.data.source=text:corpus.jsonl.xz
  done
  python eval.py --workdir runs/base_1k --focus_adapter runs/focus_small --suites focus_passkey

Each stage resumes the same workdir (adapter and optimizer state) with longer memories:
  stage 1  memories of 4 chunks of 512 (documents >= 3000 tokens), steps 0-2000
  stage 2  2048 or 7168 tokens (4 or 14 chunks; documents >= 7700), to step 3200
  stage 3  16384 or 32256 tokens (32 or 63 chunks, 32x a 1K context; documents >= 32769), to
           step 3800 of a 6400-step cosine (optim.schedule_steps: the rate stays ~0.45 peak)
Over a 97.5M base pretrained with data.retrieval_mix=0.5 and data.tokenizer=
"train:16384:llama_digits", this read the passkey from memory at 2 / 8 / 32x a 1K context (the
numbers: docs/focusllm.md). A run that stalls shows it by step 600: the drills' answer NLL
(`loss_key`) still at the prior (~11), where runs that read fall to 6-7.

Differences from configs/focus.py (the paper's 7B recipe, whose lr 5e-5 moved nothing here):
  - candidate_path "frozen": the candidate runs the base's own forward and the adapter only maps
    it to the local decoder's keys/values; with the paper's trained q/k/v/o the answer NLL often
    stayed at the prior: the trained candidates lose their own reading of the key;
  - 90% of continuation samples are passkey drills: a small base copies ordinary text too weakly
    for continuation or reconstruction samples to teach the carry;
  - no reconstruction samples (p_reconstruction 0): their loss stayed at the base's validation
    level, and they halve the drills' share;
  - 8 targets per sample, not 16: the answer " K." is then ~45% of the supervised targets;
  - lr 2e-3 with a 50-step warmup; one chunk size, 512, with a 256-token dynamic prompt and a
    512-token local window;
  - served with a 504-token dynamic prompt (eval_prompt_len), about the whole window as in the
    official code; 504 is what fits the 1K context beside a 512-token chunk and the answer. The
    trained 256 misses the needles in the window that lie before its last 256 tokens;
  - memories grow by stage: trained on 4 chunks only, the local decoder's attention spreads over
    the 63 candidates of a 32x input and misses the needle.
"""

from configs import base, focus

# stage -> (focus overrides, train.steps, optim.schedule_steps)
STAGES = {
    "1": (dict(), 2000, 0),
    "2": (dict(doc_min_tokens=7700, memory_tokens="2048,7168"), 3200, 0),
    "3": (dict(doc_min_tokens=32769, doc_max_tokens=33000, memory_tokens="16384,32256"),
          3800, 6400),
}


def get_config(arg=None):
  args = base.parse_arg(arg, size=None, pattern=None, stage="1")
  stage = args.pop("stage")
  if stage not in STAGES:
    raise ValueError(f"configs/focus_drills.py arg stage={stage!r}: expected one of "
                     f"{sorted(STAGES)}")
  # The other keys pass through to configs/base.py, whose defaults stay its own.
  c = focus.get_config(",".join(f"{k}={v}" for k, v in args.items() if v is not None) or None)
  c.focus.update(chunk_sizes="512", prompt_len=256, eval_prompt_len=504, local_len=512,
                 retrieval_mix=0.9, num_targets=8, p_reconstruction=0.0, candidate_path="frozen")
  overrides, steps, schedule = STAGES[stage]
  c.focus.update(**overrides)
  c.optim.update(peak_lr=2e-3, warmup_steps=50, schedule_steps=schedule)
  c.train.steps = steps
  return c
