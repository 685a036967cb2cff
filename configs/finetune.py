"""Fine-tuning: a trained workdir's (or an HF import's) model and tokenizer, starting from its
params (train.init_from); data, optimizer and steps as in configs/base.py.

  python -m focaljax.convert hf-to-focaljax path/to/hf_llama runs/llama
  python train.py --config configs/finetune.py:runs/llama --workdir runs/llama_ft \
      --config.data.source=text:my_corpus.jsonl --config.optim.peak_lr=1e-5

The argument is the workdir (its latest step) or one of its checkpoints/<step>. Model fields
that keep the parameter shapes (e.g. model.attention.pattern=focal) may be overridden.
"""

import os

from configs import base
from focaljax.train import saved_config


def get_config(arg: str | None = None):
  if not arg:
    raise ValueError("config arg: the workdir to fine-tune, e.g. configs/finetune.py:runs/llama")
  workdir = arg.rstrip("/").split("/checkpoints/")[0]
  if not os.path.isfile(os.path.join(workdir, "config.json")):
    raise ValueError(f"config arg: {workdir} is not a focaljax workdir (no config.json)")
  saved = saved_config.read(workdir)
  if "focus" in saved:
    raise ValueError(f"{workdir} is a FocusLLM adapter run: fine-tune its base instead")
  c = base.get_config()
  c.model = saved.model
  c.data.seq_len = saved.data.seq_len
  c.data.tokenizer = os.path.join(os.path.abspath(workdir), "tokenizer.json")
  c.train.init_from = os.path.abspath(arg)
  return c
