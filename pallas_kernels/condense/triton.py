"""Kernel bodies and launches of `condense.api`; logits in base-2 units (exp2 loops).

Candidate rows M = (candidate, group head) of one kv head, padded to Mp (power of two >= 16):
  `candidate_fwd`  grid (R, K, splits): carries acc [Mp, D], m, l [Mp] f32, written unnormalised.
  `candidate_bwd`  same grid: carries dq [Mp, D] f32 per split; per-split dk/dv when asked.
Local attention, grid (T/block, R, N), q blocks last-first:
  `local_fwd`      carries acc [bq, D], m, l [bq]: candidate blocks, then causal local blocks.
  `local_dq`       the same two loops, carrying dq [bq, D] f32.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.focal import triton as ff
from pallas_kernels.focal import triton_bwd as ffb


def _online(carry, x_MK, v_KD):
  """One online-softmax step (FlashAttention-2 Alg. 1) on base-2 logits."""
  acc_MD, m_M, l_M = carry
  m_new = jnp.maximum(m_M, jnp.max(x_MK, axis=1))
  alpha_M = jnp.exp2(m_M - m_new)
  p_MK = jnp.exp2(x_MK - m_new[:, None])
  l_M = alpha_M * l_M + jnp.sum(p_MK, axis=1)
  # p in v's dtype for the tensor-core matmul (as FA2); the accumulator stays f32.
  acc_MD = acc_MD * alpha_M[:, None] + ff.dot(p_MK.astype(v_KD.dtype), v_KD, 1, 0)
  return acc_MD, m_new, l_M


def _init(rows: int, d: int):
  # m starts finite: a fully masked block gives exp2(-inf - MASK) = 0, not nan.
  return (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), ff.MASK_VALUE, jnp.float32),
          jnp.zeros((rows,), jnp.float32))


def _blocks_below(start, length, split: int, block: int):
  """Key blocks of the split starting at `start` that hold a key < length."""
  return jnp.clip(lax.div(length - start + block - 1, block), 0, split // block)


def _cand_fwd_kernel(q_ref, k_ref, v_ref, len_ref, acc_ref, m_ref, l_ref, *, c2, split, block):
  start = pl.program_id(2) * split
  q_MD, len_M = q_ref[...], len_ref[...]

  def body(u, carry):
    k0 = start + u * block
    keys = pl.ds(k0, block)
    x_MK = ff.dot(q_MD, k_ref[keys, :], 1, 1) * c2
    vis = (k0 + jnp.arange(block, dtype=jnp.int32))[None, :] < len_M[:, None]
    return _online(carry, jnp.where(vis, x_MK, -jnp.inf), v_ref[keys, :])

  n = _blocks_below(start, jnp.max(len_M), split, block)
  acc_MD, m_M, l_M = lax.fori_loop(0, n, body, _init(*q_MD.shape))
  acc_ref[...], m_ref[...], l_ref[...] = acc_MD, m_M, l_M


def _cand_bwd_kernel(q_ref, k_ref, v_ref, len_ref, lse_ref, delta_ref, do_ref, dq_ref, dk_ref,
                     dv_ref, *, c2, scale, split, block):
  start = pl.program_id(2) * split
  q_MD, do_MD, len_M = q_ref[...], do_ref[...], len_ref[...]
  lse_M, delta_M = lse_ref[...], delta_ref[...]

  def body(u, dq_MD):
    k0 = start + u * block
    keys = pl.ds(k0, block)
    k_KD, v_KD = k_ref[keys, :], v_ref[keys, :]
    x_MK = ff.dot(q_MD, k_KD, 1, 1) * c2
    vis = (k0 + jnp.arange(block, dtype=jnp.int32))[None, :] < len_M[:, None]
    p_MK = jnp.exp2(jnp.where(vis, x_MK, -jnp.inf) - lse_M[:, None])
    ds_MK = p_MK * (ff.dot(do_MD, v_KD, 1, 1) - delta_M[:, None])
    if dk_ref is not None:
      # q-major contractions over axis 0, as in focal.triton_bwd (kv-major miscompiled there).
      local = pl.ds(u * block, block)
      dv_ref[local, :] = ff.dot(p_MK.astype(do_MD.dtype), do_MD, 0, 0).astype(dv_ref.dtype)
      dk_ref[local, :] = (ff.dot(ds_MK.astype(q_MD.dtype), q_MD, 0, 0) * scale).astype(
          dk_ref.dtype)
    return dq_MD + ff.dot(ds_MK.astype(k_KD.dtype), k_KD, 1, 0)

  n = _blocks_below(start, jnp.max(len_M), split, block)
  dq_MD = lax.fori_loop(0, n, body, jnp.zeros(q_MD.shape, jnp.float32))
  dq_ref[...] = dq_MD * scale
  if dk_ref is not None:
    # Keys nobody sees get an exact zero (the output tile is otherwise uninitialised).
    zeros = jnp.zeros((block, dk_ref.shape[-1]), dk_ref.dtype)

    def clear(u, _):
      dk_ref[pl.ds(u * block, block), :] = zeros
      dv_ref[pl.ds(u * block, block), :] = zeros

    lax.fori_loop(n, split // block, clear, None)


def _cand_specs(S, Mp, D, split):
  rows = pl.BlockSpec((None, None, Mp, D), lambda r, h, c: (r, h, 0, 0))
  row_kv = pl.BlockSpec((None, S, None, D), lambda r, h, c: (r, 0, h, 0))
  lens = pl.BlockSpec((None, Mp), lambda r, h, c: (r, 0))
  stats = pl.BlockSpec((None, None, Mp), lambda r, h, c: (r, h, 0))
  per_split = pl.BlockSpec((None, None, None, Mp, D), lambda r, h, c: (r, h, c, 0, 0))
  per_split_stat = pl.BlockSpec((None, None, None, Mp), lambda r, h, c: (r, h, c, 0))
  split_kv = pl.BlockSpec((None, split, None, D), lambda r, h, c: (r, c, h, 0))
  return rows, row_kv, lens, stats, per_split, per_split_stat, split_kv


def candidate_fwd(q_RKMD, k_RSKD, v_RSKD, len_RM, *, scale, split, block, bs, interpret):
  """Per-split (acc [R, K, C, Mp, D], m, l [R, K, C, Mp]) float32; m in base 2."""
  R, K, Mp, D = q_RKMD.shape
  S = k_RSKD.shape[1]
  C = -(-S // split)
  rows, row_kv, lens, _, per_split, per_split_stat, _ = _cand_specs(S, Mp, D, split)
  return pl.pallas_call(
      functools.partial(_cand_fwd_kernel, c2=scale * ff.LOG2E, split=split, block=block),
      grid=(R, K, C), in_specs=[rows, row_kv, row_kv, lens],
      out_specs=[per_split, per_split_stat, per_split_stat],
      out_shape=[jax.ShapeDtypeStruct((R, K, C, Mp, D), jnp.float32),
                 jax.ShapeDtypeStruct((R, K, C, Mp), jnp.float32),
                 jax.ShapeDtypeStruct((R, K, C, Mp), jnp.float32)],
      compiler_params=ff.compiler_params(bs.warps(Mp, D), bs.num_stages),
      interpret=interpret, name="condense_candidate_fwd")(q_RKMD, k_RSKD, v_RSKD, len_RM)


def candidate_bwd(q_RKMD, k_RSKD, v_RSKD, len_RM, lse_RKM, delta_RKM, do_RKMD, *, with_dkv,
                  scale, split, block, bs, interpret):
  """(dq per split [R, K, C, Mp, D] f32, dk, dv [R, C·split, K, D] or None)."""
  R, K, Mp, D = q_RKMD.shape
  S = k_RSKD.shape[1]
  C = -(-S // split)
  rows, row_kv, lens, stats, per_split, _, split_kv = _cand_specs(S, Mp, D, split)
  out_specs = [per_split]
  out_shape = [jax.ShapeDtypeStruct((R, K, C, Mp, D), jnp.float32)]
  if with_dkv:
    out_specs += [split_kv, split_kv]
    out_shape += [jax.ShapeDtypeStruct((R, C * split, K, D), k_RSKD.dtype)] * 2
  kernel = functools.partial(_cand_bwd_kernel, c2=scale * ff.LOG2E, scale=scale, split=split,
                             block=block)
  if not with_dkv:
    kernel = functools.partial(kernel, dk_ref=None, dv_ref=None)
  out = pl.pallas_call(
      kernel, grid=(R, K, C), in_specs=[rows, row_kv, row_kv, lens, stats, stats, rows],
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=ff.compiler_params(bs.warps(Mp, D), bs.num_stages),
      interpret=interpret, name="condense_candidate_bwd" + ("_dkv" if with_dkv else ""))(
          q_RKMD, k_RSKD, v_RSKD, len_RM, lse_RKM, delta_RKM, do_RKMD)
  return (out[0], out[1], out[2]) if with_dkv else (out[0], None, None)


def _cand_loop(step, carry, ck_ref, cv_ref, block_c, n_cand):
  """Visits every candidate block; only the zero padding past n_cand is masked."""
  if ck_ref is None:
    return carry
  pad = ck_ref.shape[0] != n_cand

  def body(j, carry):
    keys = pl.ds(j * block_c, block_c)
    vis = (j * block_c + jnp.arange(block_c, dtype=jnp.int32))[None, :] < n_cand if pad else None
    return step(carry, ck_ref[keys, :], cv_ref[keys, :], vis)

  return lax.fori_loop(0, ck_ref.shape[0] // block_c, body, carry)


def _local_loop(step, carry, k_ref, v_ref, i, block_q, block_k):
  def body(j, carry, *, masked):
    keys = pl.ds(j * block_k, block_k)
    vis = None
    if masked:
      vis = ff.visible(i * block_q, j * block_k, block_q, block_k, True, None, None)
    return step(carry, k_ref[keys, :], v_ref[keys, :], vis)

  n_full, n_end = ff.kv_block_range(i, block_q, block_k, k_ref.shape[0] // block_k, True)
  return ff.run_loops(body, carry, 0, n_full, n_end, causal=True, segments=False,
                      masked_first=False)


def _local_fwd_kernel(q_ref, k_ref, v_ref, ck_ref, cv_ref, o_ref, lse_ref, *, c2, block_q,
                      block_k, block_c, n_cand, n_q):
  i = ff.q_block(pl.program_id(0), n_q, True)
  q_QD = q_ref[...]

  def step(carry, k_KD, v_KD, vis):
    x_QK = ff.dot(q_QD, k_KD, 1, 1) * c2
    return _online(carry, x_QK if vis is None else jnp.where(vis, x_QK, -jnp.inf), v_KD)

  carry = _cand_loop(step, _init(*q_QD.shape), ck_ref, cv_ref, block_c, n_cand)
  acc_QD, m_Q, l_Q = _local_loop(step, carry, k_ref, v_ref, i, block_q, block_k)
  # Every local query sees itself, so l > 0 on real rows.
  o_ref[...] = (acc_QD / l_Q[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m_Q + jnp.log2(l_Q)


def _local_dq_kernel(q_ref, k_ref, v_ref, ck_ref, cv_ref, lse_ref, delta_ref, do_ref, dq_ref, *,
                     c2, scale, block_q, block_k, block_c, n_cand, n_q):
  i = ff.q_block(pl.program_id(0), n_q, True)
  q_QD, do_QD = q_ref[...], do_ref[...]
  lse_Q, delta_Q = lse_ref[...], delta_ref[...]

  def step(dq_QD, k_KD, v_KD, vis):
    x_QK = ff.dot(q_QD, k_KD, 1, 1) * c2
    p_QK = jnp.exp2((x_QK if vis is None else jnp.where(vis, x_QK, -jnp.inf)) - lse_Q[:, None])
    ds_QK = p_QK * (ff.dot(do_QD, v_KD, 1, 1) - delta_Q[:, None])
    return dq_QD + ff.dot(ds_QK.astype(k_KD.dtype), k_KD, 1, 0)

  dq_QD = _cand_loop(step, jnp.zeros(q_QD.shape, jnp.float32), ck_ref, cv_ref, block_c, n_cand)
  dq_QD = _local_loop(step, dq_QD, k_ref, v_ref, i, block_q, block_k)
  dq_ref[...] = (dq_QD * scale).astype(dq_ref.dtype)


def _local_specs(T, Cp, D, G, bq, n_q):
  tile_q = pl.BlockSpec((None, bq, None, D), lambda i, r, n: (r, ff.q_block(i, n_q, True), n, 0))
  row_tile = pl.BlockSpec((None, None, bq), lambda i, r, n: (r, n, ff.q_block(i, n_q, True)))
  full_kv = pl.BlockSpec((None, T, None, D), lambda i, r, n: (r, 0, lax.div(n, G), 0))
  full_c = None if Cp == 0 else pl.BlockSpec((None, Cp, None, D),
                                             lambda i, r, n: (r, 0, lax.div(n, G), 0))
  return tile_q, row_tile, full_kv, full_c


def local_fwd(q, k, v, ck, cv, *, scale, n_cand, bs, interpret):
  """(out [R, T, N, D] q.dtype, lse [R, N, T] f32 base 2); ck/cv [R, Cp, K, D] or None."""
  R, T, N, D = q.shape
  Cp = 0 if ck is None else ck.shape[1]
  bq, bk = bs.fit("block_q", T), bs.fit("block_kv", T)
  n_q = T // bq
  tile_q, row_tile, full_kv, full_c = _local_specs(T, Cp, D, N // k.shape[2], bq, n_q)
  kernel = functools.partial(_local_fwd_kernel, c2=scale * ff.LOG2E, block_q=bq, block_k=bk,
                             block_c=bs.fit("block_kv", Cp) if Cp else 0, n_cand=n_cand, n_q=n_q)
  return pl.pallas_call(
      kernel, grid=(n_q, R, N), in_specs=[tile_q, full_kv, full_kv, full_c, full_c],
      out_specs=[tile_q, row_tile],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((R, N, T), jnp.float32)],
      compiler_params=ff.compiler_params(bs.num_warps, bs.num_stages),
      interpret=interpret, name="condense_local_fwd")(q, k, v, ck, cv)


def local_dq(q, k, v, ck, cv, lse_RNT, delta_RNT, do, *, scale, n_cand, bs, interpret):
  R, T, N, D = q.shape
  Cp = 0 if ck is None else ck.shape[1]
  bq, bk = bs.fit("block_q_dq", T), bs.fit("block_kv_dq", T)
  n_q = T // bq
  tile_q, row_tile, full_kv, full_c = _local_specs(T, Cp, D, N // k.shape[2], bq, n_q)
  kernel = functools.partial(_local_dq_kernel, c2=scale * ff.LOG2E, scale=scale, block_q=bq,
                             block_k=bk, block_c=bs.fit("block_kv_dq", Cp) if Cp else 0,
                             n_cand=n_cand, n_q=n_q)
  return pl.pallas_call(
      kernel, grid=(n_q, R, N),
      in_specs=[tile_q, full_kv, full_kv, full_c, full_c, row_tile, row_tile, tile_q],
      out_specs=tile_q, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=ff.compiler_params(bs.num_warps, bs.num_stages),
      interpret=interpret, name="condense_local_dq")(q, k, v, ck, cv, lse_RNT, delta_RNT, do)


def local_dkv(q, k, v, s_RNT, lse_RNT, delta_RNT, do, *, causal, bs, interpret, name):
  """dk, dv of one key set via focal's Triton dk/dv kernel, GQA group summed in float32."""
  R, T, N, D = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  bq, bk = bs.fit("block_q_dkv", T), bs.fit("block_kv_dkv", S)
  full_q = pl.BlockSpec((None, T, None, D), lambda _, r, n: (r, 0, n, 0))
  row_full = pl.BlockSpec((None, None, T), lambda _, r, n: (r, n, 0))
  tile_kv = pl.BlockSpec((None, bk, None, D), lambda j, r, n: (r, j, lax.div(n, G), 0))
  out_kv = pl.BlockSpec((None, bk, None, D), lambda j, r, n: (r, j, n, 0))
  dtype = k.dtype if G == 1 else jnp.float32
  dkv_kernel = ffb._dkv_kernel  # pylint: disable=protected-access
  dk, dv = pl.pallas_call(
      functools.partial(dkv_kernel, causal=causal, block_q=bq, block_k=bk),
      grid=(S // bk, R, N),
      in_specs=[full_q, tile_kv, tile_kv, row_full, None, row_full, row_full, full_q],
      out_specs=[out_kv, out_kv], out_shape=[jax.ShapeDtypeStruct((R, S, N, D), dtype)] * 2,
      compiler_params=ff.compiler_params(bs.num_warps, bs.num_stages),
      interpret=interpret, name=name)(q, k, v, s_RNT, None, lse_RNT, delta_RNT, do)
  if G > 1:
    dk = dk.reshape(R, S, K, G, D).sum(3).astype(k.dtype)
    dv = dv.reshape(R, S, K, G, D).sum(3).astype(v.dtype)
  return dk, dv
