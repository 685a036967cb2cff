"""Runs saved before FocusLLM trained through the shared loop kept adapter/<step>/ with
adapter.npz, focus.json and opt_state.npz. Convert one in place (then evaluate or resume it as any
other run; the old directories stay) with
  python -m focaljax.focus.legacy RUN_WORKDIR
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import numpy as np
from etils import epath

from focaljax import config as config_lib
from focaljax.focus import model as focus
from focaljax.focus import train as focus_train
from focaljax.train import checkpoint
from focaljax.train import optim
from focaljax.train import saved_config

DIR = "adapter"
# focus.json fields of the .npz layout whose arms were removed, with the only value kept.
_REMOVED_ARMS = {"candidate_positions": "sequential", "candidate_bias": "none", "sink": "none",
                 "sep_id": None}


def convert(run: str) -> list[int]:
  """Rewrites every adapter/<step>/ of `run` as checkpoints/<step>/ (adapter, optimizer state,
  meta); returns the steps."""
  root = epath.Path(run) / DIR
  steps = sorted(int(d.name) for d in root.iterdir() if d.name.isdigit()) if root.is_dir() else []
  if not steps:
    raise FileNotFoundError(f"{root} holds no adapter/<step>/ to convert")
  c = saved_config.read(run)
  if "focus" not in c:
    raise ValueError(f"{run}: its config.json is a language model's, not a FocusLLM run's")
  for step in steps:
    d = root / str(step)
    try:
      saved = json.loads((d / "focus.json").read_text())
    except ValueError as e:
      raise ValueError(f"{d / 'focus.json'}: not JSON ({e})") from None
    # Written before candidate_positions existed: the then only layout, "shared".
    old = {"candidate_positions": "shared", **saved["config"]}
    for name, kept in _REMOVED_ARMS.items():
      if old.pop(name, kept) != kept:
        raise ValueError(f"{d}: trained with {name}={saved['config'].get(name, 'shared')!r}, "
                         f"an arm this version no longer has ({name}={kept!r} only)")
    with (d / "adapter.npz").open("rb") as f, np.load(f) as z:
      adapter = {}
      for key in z.files:
        layer, name = key.split("/")
        adapter.setdefault(int(layer), {})[name] = z[key]
    adapter = dict(sorted(adapter.items()))
    opt_state = None
    if (d / "opt_state.npz").exists():
      structure = jax.tree.structure(jax.eval_shape(
          optim.make(config_lib.optim_config(c), adapter).init, adapter))
      with (d / "opt_state.npz").open("rb") as f, np.load(f) as z:
        opt_state = jax.tree.unflatten(structure, [z[f"arr_{i}"] for i in range(len(z.files))])
    served = dataclasses.replace(focus.FocusConfig(**old),
                                 prompt_len=c.focus.eval_prompt_len or old["prompt_len"])
    checkpoint.save_params(run, step, adapter, {"step": step, **focus_train.meta(
        served, trained_prompt_len=old["prompt_len"], local_len=c.focus.local_len,
        base_workdir=saved["base_workdir"])}, opt_state)
  return steps


if __name__ == "__main__":
  if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
    print("usage: python -m focaljax.focus.legacy RUN_WORKDIR   (converts adapter/<step>/)",
          file=sys.stderr if len(sys.argv) != 2 else sys.stdout)
    sys.exit(2 if len(sys.argv) != 2 else 0)
  try:
    print(f"converted steps {convert(sys.argv[1])} of {sys.argv[1]} to checkpoints/<step>/")
  except (FileNotFoundError, ValueError) as e:   # bad input, as train.py and eval.py: exit 2
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    sys.exit(2)
