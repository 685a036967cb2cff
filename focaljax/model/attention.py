"""Attention variants and the one table that dispatches them.

Variants (per layer, from the config's `model.attention.pattern`):
  softmax   softmax(q·kᵀ/√d) v
  focal     constant: softmax(q·kᵀ/(t·√d)) v                       (Focal Attention, t≈0.4 best)
            learned:  τ = clip(mean(X·w_τ) + τ_init, τ_min, τ_max);  softmax(q·kᵀ/τ) v
  dilution  p = causal softmax; share = p/(committed + p + ε), committed[i,j] = Σ_{r<i} p[r,j];
            A = share/rowsum(share); out = A v                      (DilutionAttention)

Each layer also has a position mode: `rope` or `none`. The math of every variant lives in
`focaljax.ops` / `pallas_kernels`; this module only chooses the variant (`focaljax.dispatch`
chooses the implementation). Strings are parsed once here into enums, and `FAMILY` is the only
place that maps a variant to code: nothing else in the package compares variant names
(tests/test_style.py checks this).
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from focaljax import ops


class Variant(enum.Enum):
  SOFTMAX = "softmax"
  FOCAL = "focal"
  DILUTION = "dilution"


class Position(enum.Enum):
  ROPE = "rope"
  NONE = "none"


class TauMean(enum.Enum):
  """How the learned temperature averages X·w_τ over tokens.

  causal:   τ_t from the running mean over tokens ≤ t of the same document (default). Causal, and
            training matches generation exactly.
  token:    τ_t from token t alone. Causal, no averaging.
  sequence: one τ per document from the mean over ALL its tokens: the paper's literal formula. Every
            position sees a scalar summary of the future, and generation (which only has the
            prefix) differs from training. Offered for ablations only.
  """
  CAUSAL = "causal"
  TOKEN = "token"
  SEQUENCE = "sequence"


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  variant: Variant
  position: Position


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Frozen attention settings a model receives (built from the ConfigDict by focaljax.config,
  whose defaults are configs/base.py's; these are for direct construction)."""
  layers: tuple[LayerSpec, ...]
  implementation: str = "auto"      # focaljax.dispatch.IMPLEMENTATIONS
  temperature: float = 0.4          # focal constant t
  learned: bool = False             # focal: learned τ instead of t·√d
  tau_min: float = 5.0              # the paper's, for head dim 128 (focaljax.config scales them)
  tau_max: float = 10.0
  tau_init: float = 7.5             # offset added to mean(X·w_τ): starts τ inside the clip range
  tau_mean: TauMean = TauMean.CAUSAL
  eps: float = 1e-9                 # dilution ε
  checkpoint_rows: int | None = None  # dilution, Pallas; None: the kernels' default
  sliding_window: int | None = None   # softmax/focal: query t sees keys t-W < s <= t (Mistral)


def parse_pattern(pattern: str, num_layers: int) -> tuple[LayerSpec, ...]:
  """"softmax:rope,dilution:none" -> one LayerSpec per layer, the list cycled over the layers.

  A bare variant takes its natural position mode: rope for softmax/focal, none for dilution.
  """
  items = [p.strip() for p in pattern.split(",")]
  if not any(items):
    raise ValueError("model.attention.pattern is empty; e.g. 'softmax:rope' or "
                     "'softmax:rope,dilution:none'")
  if not all(items):
    raise ValueError(f"model.attention.pattern: an empty entry in {pattern!r}; entries are "
                     "variant[:position] separated by single commas")
  specs = []
  for item in items:
    name, colon, pos = item.partition(":")
    try:
      variant = Variant(name)
    except ValueError:
      raise ValueError(f"model.attention.pattern: unknown variant {name!r}; allowed: "
                       f"{[v.value for v in Variant]}") from None
    try:
      position = Position(pos) if colon else _NATURAL_POSITION[variant]
    except ValueError:
      raise ValueError(f"model.attention.pattern: unknown position mode {pos!r} in {item!r}; "
                       f"allowed: {[p.value for p in Position]}") from None
    specs.append(LayerSpec(variant, position))
  return tuple(specs[i % len(specs)] for i in range(num_layers))


# ----------------------------------------------------------------- per-family attention code


def _scale_softmax(cfg: AttentionConfig, head_dim: int, tau_BT):
  del cfg, tau_BT
  return head_dim**-0.5


def _scale_focal(cfg: AttentionConfig, head_dim: int, tau_BT):
  if cfg.learned:
    # τ replaces t·√d; [B, 1, T] broadcasts over heads and stays differentiable.
    return (1.0 / tau_BT)[:, None, :]
  return 1.0 / (cfg.temperature * head_dim**0.5)


def _attend_softmax(cfg, q, k, v, scale, segment_ids):
  return ops.focal_attention(q, k, v, scale=scale, causal=True, segment_ids=segment_ids,
                             implementation=cfg.implementation, window=cfg.sliding_window)


def _attend_dilution(cfg, q, k, v, scale, segment_ids):
  return ops.dilution_attention(q, k, v, scale=scale, eps=cfg.eps, segment_ids=segment_ids,
                                implementation=cfg.implementation,
                                checkpoint_rows=cfg.checkpoint_rows)


def _cached_softmax(cfg, q_BTND, cache, scale, start):
  """Prefill (T > 1, from position 0) through the fused op, or one step against the cache."""
  k, v = cache["k"], cache["v"]
  B, T, N, D = q_BTND.shape
  if T > 1:
    return _attend_softmax(cfg, q_BTND, k[:, :T], v[:, :T], scale, None), cache
  S, K = k.shape[1], k.shape[2]
  q_BKGD = q_BTND[:, 0].reshape(B, K, N // K, D)
  logits = jnp.einsum("BKGD,BSKD->BKGS", q_BKGD, k, preferred_element_type=jnp.float32)
  if jnp.ndim(scale):  # a learned τ: [B, 1, 1] for this single query
    scale = jnp.broadcast_to(scale, (B, 1, 1))[..., None]
  logits = logits * scale
  visible_S = jnp.arange(S) <= start
  if cfg.sliding_window:
    visible_S &= jnp.arange(S) > start - cfg.sliding_window
  logits = jnp.where(visible_S, logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("BKGS,BSKD->BKGD", probs, v.astype(jnp.float32))
  return out.reshape(B, 1, N, D).astype(q_BTND.dtype), cache


def _cached_dilution(cfg, q_BTND, cache, scale, start):
  """Dilution with a running demand per key and head: prefill from an empty cache, or one step."""
  T = q_BTND.shape[1]
  if T == 1:
    out_BND, demand = ops.dilution_decode_step(
        q_BTND[:, 0], cache["k"], cache["v"], cache["demand"], start + 1, scale=scale,
        eps=cfg.eps, implementation=cfg.implementation)
    return out_BND[:, None], {**cache, "demand": demand}
  # Prefill: the prompt occupies cache[0:T] (generation always prefills from position 0).
  k, v = cache["k"][:, :T], cache["v"][:, :T]
  out, demand_BNT = ops.dilution_prefill(q_BTND, k, v, scale=scale, eps=cfg.eps,
                                         implementation=cfg.implementation)
  demand = jax.lax.dynamic_update_slice(cache["demand"], demand_BNT, (0, 0, 0))
  return out, {**cache, "demand": demand}


@dataclasses.dataclass(frozen=True)
class Family:
  scale: callable      # (cfg, head_dim, tau_BT) -> float | [B, 1, T]
  attend: callable     # (cfg, q, k, v, scale, segment_ids) -> out        (training / full forward)
  cached: callable     # (cfg, q, cache, scale, start) -> (out, cache)   (generation)
  demand: bool         # the cache carries a float32 running demand per key and head
  window: bool         # honours sliding_window (dilution's demand spans the whole prefix)


FAMILY: dict[Variant, Family] = {
    Variant.SOFTMAX: Family(_scale_softmax, _attend_softmax, _cached_softmax, False, True),
    Variant.FOCAL: Family(_scale_focal, _attend_softmax, _cached_softmax, False, True),
    Variant.DILUTION: Family(_scale_softmax, _attend_dilution, _cached_dilution, True, False),
}

_NATURAL_POSITION = {Variant.SOFTMAX: Position.ROPE, Variant.FOCAL: Position.ROPE,
                     Variant.DILUTION: Position.NONE}


def uses_learned_tau(cfg: AttentionConfig, spec: LayerSpec) -> bool:
  return cfg.learned and FAMILY[spec.variant].scale is _scale_focal
