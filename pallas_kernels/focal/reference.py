"""Pure-JAX focal attention: the spec the kernels are tested against, plus the masking and shape
checks the dilution reference builds on. Letters: B, T queries, S keys, N query heads, K kv heads,
G = N / K, D. Logits and softmax in float32; materialises [B, K, G, T, S] (spec, not fast path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Large finite negative: exp() underflows to 0 and a fully masked row stays finite.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def check_qkv(q_BTND, k_BSKD, v_BSKD) -> tuple[int, int, int, int, int, int]:
  """Validates the contract shapes; returns (B, T, S, N, K, D)."""
  if q_BTND.ndim != 4 or k_BSKD.ndim != 4 or v_BSKD.ndim != 4:
    raise ValueError(f"q, k, v must be rank 4 ([B,T,N,D], [B,S,K,D]); got shapes "
                     f"{q_BTND.shape}, {k_BSKD.shape}, {v_BSKD.shape}")
  B, T, N, D = q_BTND.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  if k_BSKD.shape != v_BSKD.shape or k_BSKD.shape[0] != B or k_BSKD.shape[3] != D:
    raise ValueError(f"k and v must both be [B={B}, S, K, D={D}]; got {k_BSKD.shape}, "
                     f"{v_BSKD.shape}")
  if N % K:
    raise ValueError(f"query heads ({N}) must be a multiple of kv heads ({K})")
  return B, T, S, N, K, D


def scale_BNT(scale, B: int, N: int, T: int) -> jax.Array:
  """Broadcasts a float or an array broadcastable to [B, N, T] to float32 [B, N, T]."""
  s = jnp.asarray(scale, jnp.float32)
  try:
    return jnp.broadcast_to(s, (B, N, T))
  except ValueError as e:
    raise ValueError(f"scale of shape {s.shape} does not broadcast to [B, Hq, T] = "
                     f"{(B, N, T)}") from e


def visible_BTS(B: int, T: int, S: int, *, causal: bool, segment_ids_BT=None,
                q_offset: int = 0) -> jax.Array:
  """Boolean [B, T, S]: causal (at offset q_offset) and same-segment."""
  vis = jnp.ones((B, T, S), bool)
  if causal:
    t = jnp.arange(T)[:, None] + q_offset
    s = jnp.arange(S)[None, :]
    vis = vis & (s <= t)[None]
  if segment_ids_BT is not None:
    if T != S:
      raise ValueError("segment_ids need T == S (training / prefill shapes)")
    seg = jnp.asarray(segment_ids_BT)
    vis = vis & (seg[:, :, None] == seg[:, None, :])
  return vis


def _logits_BKGTS(q_BTND, k_BSKD, scale_BNT_):
  B, T, N, D = q_BTND.shape
  K = k_BSKD.shape[2]
  G = N // K
  q_BTKGD = q_BTND.reshape(B, T, K, G, D)
  logits = jnp.einsum("BTKGD,BSKD->BKGTS", q_BTKGD, k_BSKD,
                      preferred_element_type=jnp.float32)
  return logits * scale_BNT_.reshape(B, K, G, T)[..., None]


def softmax_probs(q_BTND, k_BSKD, *, scale, causal=True, segment_ids_BT=None, q_offset=0):
  """float32 probabilities [B, K, G, T, S]; fully masked rows are all zero."""
  B, T, S, N, K, D = check_qkv(q_BTND, k_BSKD, k_BSKD)
  logits = _logits_BKGTS(q_BTND, k_BSKD, scale_BNT(scale, B, N, T))
  vis = visible_BTS(B, T, S, causal=causal, segment_ids_BT=segment_ids_BT, q_offset=q_offset)
  vis = vis[:, None, None]
  logits = jnp.where(vis, logits, MASK_VALUE)
  p = jax.nn.softmax(logits, axis=-1)
  return jnp.where(vis, p, 0.0)


def combine(a_BKGTS, v_BSKD, out_dtype):
  B, K, G, T, _ = a_BKGTS.shape
  D = v_BSKD.shape[-1]
  out = jnp.einsum("BKGTS,BSKD->BTKGD", a_BKGTS, v_BSKD.astype(jnp.float32))
  return out.reshape(B, T, K * G, D).astype(out_dtype)


def attention(q_BTND, k_BSKD, v_BSKD, *, scale, causal=True, segment_ids_BT=None):
  """softmax(scale · q·kᵀ) · v. `scale`: float or array broadcastable to [B, N, T]."""
  check_qkv(q_BTND, k_BSKD, v_BSKD)
  p = softmax_probs(q_BTND, k_BSKD, scale=scale, causal=causal, segment_ids_BT=segment_ids_BT)
  return combine(p, v_BSKD, q_BTND.dtype)
