"""Triton focal backward (FlashAttention-2 §3.2), deterministic, in two passes:
`_dkv_kernel` grid (S/block_kv_dkv, B, Hq): k, v resident, carries dk, dv [bkv, D] f32 over q
blocks (per query head, summed over the GQA group here); `_dq_kernel` grid (T/block_q_dq, B, Hq):
q, dO resident, carries dq [bq, D] and d_scale [bq] f32 (d_scale_t = Σ_s dx_ts r_ts).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.focal import triton as ff


def _dkv_kernel(q_ref, k_ref, v_ref, s_ref, seg_ref, lse_ref, delta_ref, do_ref, dk_ref, dv_ref,
                *, causal, block_q, block_k):
  j = pl.program_id(0)
  n_q = q_ref.shape[0] // block_q
  # k_ref/v_ref are this program's [block_k, D] tiles (BlockSpec); seg_ref spans the whole row.
  k_KD, v_KD = k_ref[...], v_ref[...]
  seg_k = None if seg_ref is None else seg_ref[pl.ds(j * block_k, block_k)]

  def body(i, carry, *, masked):
    # q-major tiles [block_q, block_k]; kv-side contractions over axis 0 (kv-major tiles
    # miscompile through Triton on Hopper).
    dk_KD, dv_KD = carry
    q_slice = pl.ds(i * block_q, block_q)
    q_QD, do_QD = q_ref[q_slice, :], do_ref[q_slice, :]
    s_Q = s_ref[q_slice]
    x_QK = ff.dot(q_QD, k_KD, 1, 1) * (s_Q * ff.LOG2E)[:, None]
    if masked:
      seg_q = None if seg_ref is None else seg_ref[q_slice]
      vis = ff.visible(i * block_q, j * block_k, block_q, block_k, causal, seg_q, seg_k)
      x_QK = jnp.where(vis, x_QK, -jnp.inf)
    p_QK = jnp.exp2(x_QK - lse_ref[q_slice][:, None])
    dv_KD = dv_KD + ff.dot(p_QK.astype(do_QD.dtype), do_QD, 0, 0)
    dp_QK = ff.dot(do_QD, v_KD, 1, 1)
    # The temperature multiplies dlogits per query before the q-side contraction.
    dx_QK = p_QK * (dp_QK - delta_ref[q_slice][:, None]) * s_Q[:, None]
    dk_KD = dk_KD + ff.dot(dx_QK.astype(q_QD.dtype), q_QD, 0, 0)
    return dk_KD, dv_KD

  if causal:
    # q block i sees this kv block iff (i+1)·bq − 1 >= j·bk, all of it iff i >= ⌈(j+1)·bk / bq⌉.
    i_lo = jnp.minimum(lax.div(j * block_k, block_q), n_q)
    i_full = jnp.minimum(ff.cdiv((j + 1) * block_k, block_q), n_q)
  else:
    i_lo = i_full = 0
  zeros = jnp.zeros(k_KD.shape, jnp.float32)
  dk_KD, dv_KD = ff.run_loops(body, (zeros, zeros), i_lo, i_full, n_q, causal=causal,
                              segments=seg_ref is not None, masked_first=True)
  dk_ref[...] = dk_KD.astype(dk_ref.dtype)
  dv_ref[...] = dv_KD.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, s_ref, seg_ref, lse_ref, delta_ref, do_ref, dq_ref, dscale_ref,
               *, causal, block_q, block_k, n_q):
  i = ff.q_block(pl.program_id(0), n_q, causal)
  n_kv = k_ref.shape[0] // block_k
  q_QD, do_QD = q_ref[...], do_ref[...]
  s_Q = s_ref[...]
  c_Q = s_Q * ff.LOG2E
  lse_Q, delta_Q = lse_ref[...], delta_ref[...]
  seg_q = None if seg_ref is None else seg_ref[pl.ds(i * block_q, block_q)]

  def body(j, carry, *, masked):
    dq_QD, dscale_Q = carry
    kv_slice = pl.ds(j * block_k, block_k)
    k_KD, v_KD = k_ref[kv_slice, :], v_ref[kv_slice, :]
    r_QK = ff.dot(q_QD, k_KD, 1, 1)
    x_QK = r_QK * c_Q[:, None]
    if masked:
      seg_k = None if seg_ref is None else seg_ref[kv_slice]
      vis = ff.visible(i * block_q, j * block_k, block_q, block_k, causal, seg_q, seg_k)
      x_QK = jnp.where(vis, x_QK, -jnp.inf)
    p_QK = jnp.exp2(x_QK - lse_Q[:, None])
    dx_QK = p_QK * (ff.dot(do_QD, v_KD, 1, 1) - delta_Q[:, None])
    # d_scale from the f32 raw logits (masked entries have dx = 0 exactly).
    dscale_Q = dscale_Q + jnp.sum(dx_QK * r_QK, axis=1)
    dq_QD = dq_QD + ff.dot(dx_QK.astype(k_KD.dtype), k_KD, 1, 0)
    return dq_QD, dscale_Q

  n_full, n_end = ff.kv_block_range(i, block_q, block_k, n_kv, causal)
  carry = (jnp.zeros(q_QD.shape, jnp.float32), jnp.zeros((block_q,), jnp.float32))
  dq_QD, dscale_Q = ff.run_loops(body, carry, 0, n_full, n_end, causal=causal,
                                 segments=seg_ref is not None, masked_first=False)
  # dq_t = s_t Σ_s dx_ts k_s: the row scale is applied once here, not per logit.
  dq_ref[...] = (dq_QD * s_Q[:, None]).astype(dq_ref.dtype)
  dscale_ref[...] = dscale_Q


def backward(q, k, v, s_BNT, seg_BT, out, lse_BNT, do, *, causal: bool, blocks, interpret: bool):
  """(dq, dk, dv, d_scale [B, Hq, T] f32) from the forward's residuals (out, base-2 lse)."""
  B, T, N, D = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  # delta = rowsum(dO·O): memory bound, one fused XLA reduction straight into [B, Hq, T].
  delta_BNT = jnp.einsum("BTND,BTND->BNT", out.astype(jnp.float32), do.astype(jnp.float32))
  do = do.astype(q.dtype)
  params = ff.compiler_params(blocks.num_warps_bwd, blocks.num_stages_bwd)
  args = (q, k, v, s_BNT, seg_BT, lse_BNT, delta_BNT, do)
  seg_spec = None if seg_BT is None else pl.BlockSpec((None, T), lambda _, b, n: (b, 0))

  # dk/dv pass: one program per (kv block, b, q head).
  bq = ff.clip_block(blocks.block_q_dkv, T, "block_q_dkv")
  bk = ff.clip_block(blocks.block_kv_dkv, S, "block_kv_dkv")
  full_q = pl.BlockSpec((None, T, None, D), lambda _, b, n: (b, 0, n, 0))
  row_full = pl.BlockSpec((None, None, T), lambda _, b, n: (b, n, 0))
  tile_kv = pl.BlockSpec((None, bk, None, D), lambda j, b, n: (b, j, lax.div(n, G), 0))
  dkv_dtype = k.dtype if G == 1 else jnp.float32  # group sum in f32 below
  dkv_spec = pl.BlockSpec((None, bk, None, D), lambda j, b, n: (b, j, n, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, causal=causal, block_q=bq, block_k=bk),
      grid=(S // bk, B, N),
      in_specs=[full_q, tile_kv, tile_kv, row_full, seg_spec, row_full, row_full, full_q],
      out_specs=[dkv_spec, dkv_spec],
      out_shape=[jax.ShapeDtypeStruct((B, S, N, D), dkv_dtype)] * 2,
      compiler_params=params, interpret=interpret, name="focal_flash_dkv")(*args)
  if G > 1:
    dk = dk.reshape(B, S, K, G, D).sum(3).astype(k.dtype)
    dv = dv.reshape(B, S, K, G, D).sum(3).astype(v.dtype)

  # dq pass: one program per (q block, b, q head); also emits d_scale.
  bq = ff.clip_block(blocks.block_q_dq, T, "block_q_dq")
  bk = ff.clip_block(blocks.block_kv_dq, S, "block_kv_dq")
  n_q = T // bq
  tile_q = pl.BlockSpec((None, bq, None, D),
                        lambda i, b, n: (b, ff.q_block(i, n_q, causal), n, 0))
  full_kv = pl.BlockSpec((None, S, None, D), lambda _, b, n: (b, 0, lax.div(n, G), 0))
  row_tile = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, ff.q_block(i, n_q, causal)))
  dq, dscale_BNT = pl.pallas_call(
      functools.partial(_dq_kernel, causal=causal, block_q=bq, block_k=bk, n_q=n_q),
      grid=(n_q, B, N),
      in_specs=[tile_q, full_kv, full_kv, row_tile, seg_spec, row_tile, row_tile, tile_q],
      out_specs=[tile_q, row_tile],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((B, N, T), jnp.float32)],
      compiler_params=params, interpret=interpret, name="focal_flash_dq")(*args)
  return dq, dk, dv, dscale_BNT
