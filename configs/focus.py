"""FocusLLM (arXiv 2408.11745): train the candidate q/k/v/o adapter of a frozen focaljax base.

  python train.py --config configs/focus.py --workdir runs/focus_400m \
      --config.focus.base_workdir=runs/focal_400m --config.focus.chunk_sizes=64,128,256,512,1024
  python train.py --config configs/focus.py --workdir runs/focus_tiny \
      --config.focus.base_workdir=runs/default --config.focus.chunk_sizes=16,32,64 \
      --config.focus.prompt_len=32 --config.focus.local_len=64 --config.focus.num_targets=8 \
      --config.focus.doc_min_tokens=512

The model is the base workdir's (model.* and data.seq_len here are ignored); data.source,
data.global_batch, seed, optim.* and train.* apply. Every chunk size must keep chunk + dynamic
prompt + num_targets - 1 inside the base's trained context (its data.seq_len): the paper's 2048
does not fit a 2K base, so the 400m line above drops it (focaljax.config refuses it, naming the
field). The staged recipe measured to read a passkey over a small base: configs/focus_drills.py.
"""

import ml_collections

from configs import base


def get_config(arg=None):
  c = base.get_config(arg)
  c.focus = ml_collections.ConfigDict(dict(
      base_workdir="",                        # trained focaljax workdir (required; stays untouched)
      chunk_sizes="64,128,256,512,1024,2048",  # one drawn per step (paper set + the code's 512)
      prompt_len=512,           # dynamic prompt: the last min(prompt_len, chunk) local tokens
      # The dynamic prompt eval.py serves the adapter with (0: prompt_len; its --focus_prompt_len
      # overrides it). About the whole window, as the official code serves, also reads the
      # needles in the window that lie before a shorter trained prompt.
      eval_prompt_len=0,
      p_reconstruction=0.5,     # share of samples whose local window repeats a span of the memory
      doc_min_tokens=3000,      # shorter documents are skipped; the default memory length (below)
      memory_tokens="",         # memory lengths, one drawn per step ("" = doc_min_tokens -
                                # local_len - 1; focaljax/focus/train.py)
      doc_max_tokens=8000,      # longer documents are cropped to their first doc_max_tokens
      local_len=512,            # local-window tokens the frozen decoder reads (<= base context)
      num_targets=16,           # supervised query points per sample: the window's last tokens
      retrieval_mix=0.0,        # share of continuation samples turned into passkey drills
      implementation="auto",    # candidate/local attention: "auto" (the kernels on GPUs, else
                                # the einsum spec) | "xla" | "pallas" (interpreted on CPU)
      # The candidate's own forward: "adapter" (the paper's: its own q/k/v/o train) | "frozen"
      # (the base's; the adapter's wk/wv only map it to the local decoder's keys/values: over
      # small bases it leaves the answer prior reliably, docs/focusllm.md).
      candidate_path="adapter",
  ))
  c.data.global_batch = 8       # the paper's; the local decoder runs global_batch·num_targets rows
  c.train.eval_every = 0        # FocusLLM runs have no validation loop (eval.py evaluates them)
  # The paper's adapter recipe: a small learning rate and no weight decay (decay would pull the
  # candidate projections toward zero, not toward the frozen copies they start from).
  c.optim.update(peak_lr=5e-5, weight_decay=0.0)
  return c
