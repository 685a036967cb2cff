"""A FocusLLM adapter on disk: the adapter's weights (numpy .npz) and focus.json, which holds its
`focus.FocusConfig` and the base workdir it was trained on. The base stays in its own workdir;
`from_workdir` loads the two together, `with_attention` swaps the base's attention."""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from focaljax.model import attention as attn_lib
from focaljax.focus import model as focus
from focaljax.evaluation import loading as loaded


def save_adapter(directory: str, adapter: dict, cfg: focus.FocusConfig,
                 base_workdir: str = "") -> None:
  """The adapter alone (numpy .npz) + focus.json; the base stays in its own workdir."""
  os.makedirs(directory, exist_ok=True)
  np.savez(os.path.join(directory, "adapter.npz"),
           **{f"{i}/{n}": np.asarray(w) for i, ws in adapter.items() for n, w in ws.items()})
  with open(os.path.join(directory, "focus.json"), "w") as f:
    json.dump({"config": dataclasses.asdict(cfg), "base_workdir": base_workdir}, f, indent=2)


def load_adapter(directory: str) -> tuple[dict, focus.FocusConfig, str]:
  """(adapter, FocusConfig, base_workdir) written by `save_adapter`."""
  with np.load(os.path.join(directory, "adapter.npz")) as z:
    adapter = {}
    for key in z.files:
      i, n = key.split("/")
      adapter.setdefault(int(i), {})[n] = jnp.asarray(z[key])
  with open(os.path.join(directory, "focus.json")) as f:
    meta = json.load(f)
  # Adapters saved before the field existed were all trained in the then only layout.
  meta["config"].setdefault("candidate_positions", "shared")
  return dict(sorted(adapter.items())), focus.FocusConfig(**meta["config"]), meta["base_workdir"]


def with_attention(model, implementation: str):
  """The same weights with the base's attention implementation replaced (a `how`, not a `what`).

  The chunk caches take the activations' dtype (frozen_prefill); cuDNN accepts only 16-bit q, k,
  v, and the frozen prefill attends over a cache with room for later tokens, so FocusLLM runs the
  base's attention as "xla" (focus.base_attention's default, and eval's) or "pallas" whatever the
  base was trained with: a base trained with cudnn/auto on a GPU is adapted and evaluated as is."""
  if implementation not in attn_lib.IMPLEMENTATIONS:
    raise ValueError(f"focus_adapter.with_attention: implementation {implementation!r} must be "
                     f"one of {attn_lib.IMPLEMENTATIONS}")
  cfg = dataclasses.replace(model.cfg, attention=dataclasses.replace(
      model.cfg.attention, implementation=implementation))
  graphdef, _ = loaded.abstract_model(cfg)
  return nnx.merge(graphdef, nnx.state(model))


def from_workdir(path: str, adapter_dir: str | None = None, base_attention: str | None = None,
                 candidate_path: str = "adapter"):
  """(LoadedModel of the frozen base, adapter): a fresh copy-initialised adapter for
  `candidate_path` (focus.CANDIDATE_PATHS) unless `adapter_dir` names one saved by
  `save_adapter`; `base_attention` swaps the base's attention implementation (with_attention)."""
  base = loaded.load(path)
  if base_attention is not None:
    base = dataclasses.replace(base, model=with_attention(base.model, base_attention))
  adapter = (focus.init_adapter(base.model, candidate_path) if adapter_dir is None
             else load_adapter(adapter_dir)[0])
  return base, adapter
