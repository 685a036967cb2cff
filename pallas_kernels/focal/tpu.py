"""TPU focal attention: jax's Pallas TPU flash attention with the temperature folded into q
(an array scale multiplies q in f32, rounded to q.dtype; a float goes in as sm_scale) and GQA by
repeating k, v over the group. S must be a multiple of 128.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

from pallas_kernels.focal import reference


def _blocks(T: int, S: int) -> tpu_flash.BlockSizes:
  bq, bk = min(128, T), min(128, S)
  return tpu_flash.BlockSizes(
      block_q=bq, block_k_major=bk, block_k=bk, block_b=1,
      block_q_major_dkv=bq, block_k_major_dkv=bk, block_k_dkv=bk, block_q_dkv=bq,
      block_k_major_dq=bk, block_k_dq=bk, block_q_dq=bq)


def focal_attention(q, k, v, *, scale, causal: bool = True, segment_ids=None):
  """Same contract as `api.focal_attention` (q [B,T,Hq,D], k/v [B,S,Hkv,D])."""
  if isinstance(scale, (int, float)):
    return _tpu_attention(q, k, v, None, segment_ids, sm_scale=float(scale), causal=causal)
  return _tpu_attention(q, k, v, scale, segment_ids, sm_scale=1.0, causal=causal)


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal"))
def _tpu_attention(q, k, v, scale, segment_ids, *, sm_scale: float, causal: bool):
  B, T, S, N, K, _ = reference.check_qkv(q, k, v)
  q_BNTD = q.transpose(0, 2, 1, 3)
  if scale is not None:
    s_BNT = reference.scale_BNT(scale, B, N, T)
    # Multiply in f32, round once to q.dtype (the kernel's matmul input type).
    q_BNTD = (q_BNTD.astype(jnp.float32) * s_BNT[..., None]).astype(q.dtype)
  k_BNSD = jnp.repeat(k, N // K, axis=2).transpose(0, 2, 1, 3)
  v_BNSD = jnp.repeat(v, N // K, axis=2).transpose(0, 2, 1, 3)
  seg = None
  if segment_ids is not None:
    if T != S:
      raise ValueError(f"segment_ids need T == S; got T={T}, S={S}")
    seg_BT = jnp.asarray(segment_ids, jnp.int32)
    seg = tpu_flash.SegmentIds(q=seg_BT, kv=seg_BT)
  out_BNTD = tpu_flash.flash_attention(q_BNTD, k_BNSD, v_BNSD, segment_ids=seg, causal=causal,
                                       sm_scale=sm_scale, block_sizes=_blocks(T, S))
  return out_BNTD.transpose(0, 2, 1, 3).astype(q.dtype)
