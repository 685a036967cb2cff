"""Optax: global-norm clip + AdamW with linear warmup and cosine decay (the focal paper's recipe).

Weight decay skips the parameter groups named in `no_decay` ("norm": RMSNorm gains, "embed":
token embeddings and the LM head). What trains is what the loop differentiates (train/loop.py's
Task.params: a model's, or a FocusLLM adapter's); frozen params never reach the optimizer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

NO_DECAY_GROUPS = {
    # group -> predicate on the parameter's path (tuple of keys)
    "norm": lambda path: any("norm" in str(k) for k in path),
    "embed": lambda path: path[-1] in ("embed", "lm_head"),
}


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  peak_lr: float
  warmup_steps: int
  total_steps: int
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  weight_decay: float = 0.05
  no_decay: tuple[str, ...] = ("norm", "embed")
  clip_norm: float = 1.0
  mu_dtype: str = "float32"      # the first moment's dtype; the second stays float32


def schedule(cfg: OptimConfig) -> optax.Schedule:
  """0 -> peak linearly over warmup_steps, then cosine to min_lr_ratio · peak at total_steps."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.peak_lr, warmup_steps=cfg.warmup_steps,
      decay_steps=max(cfg.total_steps, cfg.warmup_steps + 1),
      end_value=cfg.peak_lr * cfg.min_lr_ratio)


def _path_keys(path):
  return tuple(getattr(p, "key", getattr(p, "idx", p)) for p in path)


def decay_mask(params, no_decay: tuple[str, ...]):
  preds = [NO_DECAY_GROUPS[g] for g in no_decay]
  return jax.tree_util.tree_map_with_path(
      lambda path, _: not any(p(_path_keys(path)) for p in preds), params)


def make(cfg: OptimConfig, params) -> optax.GradientTransformation:
  adamw = optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                      mask=decay_mask(params, cfg.no_decay), mu_dtype=jnp.dtype(cfg.mu_dtype))
  return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
