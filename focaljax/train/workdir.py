"""A run's workdir: what must hold before anything in it is written, and what a resume repairs.

  check        refuses a workdir whose checkpoints hold another model (one line listing fields)
  cut_metrics  drops metrics.jsonl rows past the resumed step (a resumed run writes them again)
"""

from __future__ import annotations

import json
import os

from focaljax import config as config_lib
from focaljax.train import checkpoint

# The fields that shape the trained state: a workdir's checkpoints resume only under equal ones.
SHAPE_FIELDS = ("model.vocab_size", "model.d_model", "model.num_layers", "model.num_heads",
                "model.num_kv_heads", "model.head_dim", "model.d_ff", "model.tie_embeddings",
                "model.qk_norm", "model.attention.pattern", "model.attention.learned")


def check(workdir: str, config_json: str) -> None:
  """Refuses (ConfigError listing the fields) a workdir whose checkpoints hold another model."""
  step = checkpoint.latest_step(workdir)
  if step is None or not os.path.exists(os.path.join(workdir, checkpoint.CONFIG_FILE)):
    return
  old, new = config_lib.read_run_config(workdir).to_dict(), json.loads(config_json)

  def get(tree, dotted):
    for part in dotted.split("."):
      tree = tree.get(part) if isinstance(tree, dict) else None
    return tree

  diff = [f"{f} {get(old, f)!r} -> {get(new, f)!r}" for f in SHAPE_FIELDS
          if get(old, f) != get(new, f)]
  if diff:
    raise config_lib.ConfigError(
        f"workdir {workdir} holds a different model (checkpoint step {step}): {', '.join(diff)}; "
        "resume it with its own config.json, or train in another --workdir")


def cut_metrics(workdir: str, step: int) -> None:
  """Drops metrics.jsonl rows after `step`, where a resumed run writes them again."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = f.readlines()
  keep = []
  for line in lines:
    try:
      if json.loads(line)["step"] <= step:
        keep.append(line)
    except (ValueError, KeyError, TypeError):   # a line cut short by a killed run
      pass
  if len(keep) < len(lines):
    with open(path + ".tmp", "w") as f:
      f.writelines(keep)
    os.replace(path + ".tmp", path)
