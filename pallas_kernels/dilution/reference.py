"""Pure-JAX dilution attention, the spec (f32, materialises [B, K, G, T, S])."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.focal import reference as ref


def dilution_weights(p_BKGTS, eps: float):
  """committed = Σ_{r<i} p_rj; share = p / (committed + p + eps); A = share / (rowsum + eps)."""
  committed = jnp.cumsum(p_BKGTS, axis=-2) - p_BKGTS
  share = p_BKGTS / (committed + p_BKGTS + eps)
  return share / (share.sum(-1, keepdims=True) + eps)


def dilution_attention(q_BTND, k_BSKD, v_BSKD, *, scale=None, eps=1e-9, segment_ids_BT=None):
  """Causal dilution attention (T == S): (out [B,T,N,D], demand f32 [B,N,S])."""
  out, demand, _ = _dilution(q_BTND, k_BSKD, v_BSKD, scale, eps, segment_ids_BT)
  return out, demand


def _dilution(q_BTND, k_BSKD, v_BSKD, scale, eps, segment_ids_BT):
  B, T, S, N, K, D = ref.check_qkv(q_BTND, k_BSKD, v_BSKD)
  if T != S:
    raise ValueError(f"dilution attention is causal self-attention: T ({T}) must equal S ({S})")
  scale = D**-0.5 if scale is None else scale
  p = ref.softmax_probs(q_BTND, k_BSKD, scale=scale, causal=True, segment_ids_BT=segment_ids_BT)
  a = dilution_weights(p, eps)
  demand_BNS = p.sum(-2).reshape(B, N, S)
  return ref.combine(a, v_BSKD, q_BTND.dtype), demand_BNS, a


def dilution_decode_step(q_BND, k_cache_BSKD, v_cache_BSKD, demand_BNS, length_B, *,
                         scale=None, eps=1e-9):
  """One cached dilution step for the query at position length-1; returns (out, demand + p)."""
  B, N, D = q_BND.shape
  _, S, K, _ = k_cache_BSKD.shape
  G = N // K
  scale = D**-0.5 if scale is None else scale
  length_B = jnp.broadcast_to(jnp.asarray(length_B, jnp.int32), (B,))
  q_BKGD = q_BND.reshape(B, K, G, D)
  logits = jnp.einsum("BKGD,BSKD->BKGS", q_BKGD, k_cache_BSKD,
                      preferred_element_type=jnp.float32) * scale
  vis_BS = jnp.arange(S)[None, :] < length_B[:, None]
  vis = vis_BS[:, None, None, :]
  p = jnp.where(vis, jax.nn.softmax(jnp.where(vis, logits, ref.MASK_VALUE), axis=-1), 0.0)
  committed = demand_BNS.reshape(B, K, G, S)
  share = p / (committed + p + eps)
  a = share / (share.sum(-1, keepdims=True) + eps)
  out = jnp.einsum("BKGS,BSKD->BKGD", a, v_cache_BSKD.astype(jnp.float32))
  return out.reshape(B, N, D).astype(q_BND.dtype), demand_BNS + p.reshape(B, N, S)
