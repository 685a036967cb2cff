"""A trained FocusLLM adapter on disk, and the base it reads.

A FocusLLM run's workdir (focus/train.py) holds config.json, metrics and checkpoints/<step>/ like
a language model's: its params item is the adapter ({layer: {wq, wk, wv, wo}}, {wk, wv} on the
"frozen" candidate path), its meta (`meta`) the adapter's `focus.FocusConfig` as it is served, the
window it trained on and the base workdir. The base stays in its own workdir; `load` restores the
adapter over it, `with_attention` swaps the base's attention.

Runs written before kept adapter/<step>/{adapter.npz, focus.json, opt_state.npz}; convert one in
place (then evaluate or resume it as any other) with
  python -m focaljax.focus.adapter RUN_WORKDIR
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import numpy as np
from flax import nnx

from focaljax import config as config_lib
from focaljax.focus import model as focus
from focaljax.model import decoder as model_lib
from focaljax.train import checkpoint
from focaljax.train import optim

LEGACY_DIR = "adapter"   # the .npz layout's adapter/<step>/


def meta(cfg: focus.FocusConfig, *, trained_prompt_len: int, local_len: int,
         base_workdir: str) -> dict:
  """What a FocusLLM checkpoint records beside the adapter. `cfg` is the adapter as it is served:
  the largest trained chunk, the prompt focus.eval_prompt_len names (else the trained one)."""
  return {"focus": dataclasses.asdict(cfg), "trained_prompt_len": trained_prompt_len,
          "local_len": local_len, "base_workdir": base_workdir}


def with_attention(model, implementation: str):
  """The same weights with the base's attention implementation replaced (a `how`, not a `what`).

  The chunk caches take the activations' dtype (candidates.frozen_prefill); cuDNN accepts only
  16-bit q, k, v, and the frozen prefill attends over a cache with room for later tokens, so
  FocusLLM runs the base's attention as "xla" or "pallas" whatever the base was trained with."""
  cfg = dataclasses.replace(model.cfg, attention=dataclasses.replace(
      model.cfg.attention, implementation=implementation))
  graphdef, _ = model_lib.abstract_model(cfg)
  return nnx.merge(graphdef, nnx.state(model))


def check_not_legacy(run: str) -> None:
  """Raises, naming the conversion command, where `run` keeps the old .npz layout."""
  if os.path.isdir(os.path.join(run, LEGACY_DIR)):
    raise FileNotFoundError(f"{run} keeps its adapter in the old .npz layout; convert it with: "
                            f"python -m focaljax.focus.adapter {run}")


def _resolve(path: str) -> tuple[str, int | None]:
  """(run workdir, step) of a FocusLLM run workdir (latest step) or a checkpoints/<step> in it."""
  path = os.path.abspath(path)
  parent = os.path.dirname(path)
  if os.path.basename(parent) == "checkpoints" and os.path.basename(path).isdigit():
    return os.path.dirname(parent), int(os.path.basename(path))
  if checkpoint.latest_step(path) is not None:
    return path, None
  check_not_legacy(os.path.dirname(parent) if os.path.basename(parent) == LEGACY_DIR else path)
  raise FileNotFoundError(f"{path} is neither a FocusLLM run workdir (no checkpoints/<step>) nor "
                          "a checkpoints/<step> directory inside one")


def load(path: str, base) -> tuple[dict, focus.FocusConfig, dict]:
  """(adapter, FocusConfig, meta + {"workdir", "step"}) of a FocusLLM run workdir (its latest
  checkpoint) or one of its checkpoints/<step>, restored onto the shapes of `base` (a
  Transformer)."""
  workdir, step = _resolve(path)
  saved, step = checkpoint.read_meta(workdir, step)
  if "focus" not in saved:
    raise ValueError(f"{workdir}: its checkpoints hold no FocusLLM adapter (a language model's "
                     "workdir?)")
  cfg = focus.FocusConfig(**saved["focus"])
  like = checkpoint.abstract_like(jax.eval_shape(
      lambda: focus.init_adapter(base, cfg.candidate_path)))
  try:
    adapter, step = checkpoint.restore_params(workdir, step, like)
  except ValueError as e:
    raise ValueError(f"{workdir}: the adapter does not fit this base ({e}); is the base the "
                     f"adapter's, {saved['base_workdir']}?") from None
  return adapter, cfg, {**saved, "workdir": workdir, "step": step}


# focus.json fields of the .npz layout whose arms were removed, with the only value kept.
_REMOVED_ARMS = {"candidate_positions": "sequential", "candidate_bias": "none", "sink": "none",
                 "sep_id": None}


def convert(run: str) -> list[int]:
  """Rewrites every adapter/<step>/ of an old FocusLLM run as checkpoints/<step>/ (adapter,
  optimizer state, meta); returns the steps. The old directories stay."""
  root = os.path.join(run, LEGACY_DIR)
  steps = sorted(int(d) for d in os.listdir(root) if d.isdigit()) if os.path.isdir(root) else []
  if not steps:
    raise FileNotFoundError(f"{root} holds no adapter/<step>/ to convert")
  c = config_lib.read_run_config(run)
  for step in steps:
    d = os.path.join(root, str(step))
    with open(os.path.join(d, "focus.json")) as f:
      saved = json.load(f)
    # Written before candidate_positions existed: the then only layout, "shared".
    old = {"candidate_positions": "shared", **saved["config"]}
    for name, kept in _REMOVED_ARMS.items():
      if old.pop(name, kept) != kept:
        raise ValueError(f"{d}: trained with {name}={saved['config'].get(name, 'shared')!r}, "
                         f"an arm this version no longer has ({name}={kept!r} only)")
    with np.load(os.path.join(d, "adapter.npz")) as z:
      adapter = {}
      for key in z.files:
        layer, name = key.split("/")
        adapter.setdefault(int(layer), {})[name] = z[key]
    adapter = dict(sorted(adapter.items()))
    opt_state = None
    if os.path.isfile(os.path.join(d, "opt_state.npz")):
      structure = jax.tree.structure(jax.eval_shape(
          optim.make(config_lib.optim_config(c), adapter).init, adapter))
      with np.load(os.path.join(d, "opt_state.npz")) as z:
        opt_state = jax.tree.unflatten(structure, [z[f"arr_{i}"] for i in range(len(z.files))])
    served = dataclasses.replace(focus.FocusConfig(**old),
                                 prompt_len=c.focus.eval_prompt_len or old["prompt_len"])
    checkpoint.save_params(run, step, adapter, {"step": step, **meta(
        served, trained_prompt_len=old["prompt_len"], local_len=c.focus.local_len,
        base_workdir=saved["base_workdir"])}, opt_state)
  return steps


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit("usage: python -m focaljax.focus.adapter RUN_WORKDIR   (converts adapter/<step>/)")
  print(f"converted steps {convert(sys.argv[1])} of {sys.argv[1]} to checkpoints/<step>/")
