"""Dilution forward passes on Triton.

F1 `row_stats`, grid (T/block_q_stats, B, Hq): online causal softmax per row block → lse, and
optionally pk = scale·Σ_j p_ij k_j. F2 `key_sweep`, grid (T/block_k_fwd, B, Hq): a program keeps
K_J, V_J and the per-key carry in registers and walks rows top-down: σ = P / (carry + cumsum(P) +
eps), S_I += rowsum(σ), N_I += σ V_J (f32 atomics), carry += colsum(P); the carry is stored every
ckpt_rows rows and at the end (the decode demand). `tile_probs` is shared with the backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Finite start for the online max: a fully masked first block never computes inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
NUM_STAGES_FWD = 2


def warps(D: int) -> int:
  """Warps per program of F1, F2, B2 and decode."""
  return 4 if D <= 64 else 8


def idiv(a, b):
  """Non-negative int32 division that lowers to Triton (`//` emits floor-division fixups)."""
  return lax.div(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def dot(a, b, *, ta=False, tb=False):
  """a·b with f32 accumulation (ta, tb transpose); f32 operands use IEEE products, not tf32."""
  prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def visible(r0, k0, segq_T, segk_S):
  """Boolean [T, S] tile mask: causal (row r sees key c <= r) and same segment."""
  shape = (segq_T.shape[0], segk_S.shape[0])
  rows = r0 + lax.broadcasted_iota(jnp.int32, shape, 0)
  cols = k0 + lax.broadcasted_iota(jnp.int32, shape, 1)
  return (rows >= cols) & (segq_T[:, None] == segk_S[None, :])


def tile_probs(q_TD, k_SD, lse_T, segq_T, segk_S, r0, k0, scale):
  """Causal softmax probabilities of one [T, S] tile, float32, exactly 0 where masked."""
  s_TS = dot(q_TD, k_SD, tb=True) * scale
  vis = visible(r0, k0, segq_T, segk_S)
  # exp(-inf) = 0: masked entries never overflow even when a future key's logit is large.
  return jnp.exp(jnp.where(vis, s_TS - lse_T[:, None], -jnp.inf))


def _row_stats_kernel(q_ref, k_ref, seg_ref, lse_ref, *pk_ref, scale, block_q, block_k):
  i = pl.program_id(0)
  r0 = i * block_q
  q_TD = q_ref[...]
  segq_T = seg_ref[pl.ds(r0, block_q)]

  def body(j, carry):
    m_T, l_T, acc_TD = carry
    k0 = j * block_k
    k_SD = k_ref[pl.ds(k0, block_k), :]
    vis = visible(r0, k0, segq_T, seg_ref[pl.ds(k0, block_k)])
    s_TS = jnp.where(vis, dot(q_TD, k_SD, tb=True) * scale, MASK_VALUE)
    m_new = jnp.maximum(m_T, s_TS.max(axis=1))
    alpha = jnp.exp(m_T - m_new)
    e_TS = jnp.where(vis, jnp.exp(s_TS - m_new[:, None]), 0.0)
    l_T = l_T * alpha + e_TS.sum(axis=1)
    if pk_ref:
      acc_TD = acc_TD * alpha[:, None] + dot(e_TS.astype(k_SD.dtype), k_SD)
    return m_new, l_T, acc_TD

  # Causal: key blocks up to the one holding this row block's last row.
  n_k = idiv(r0 + block_q + block_k - 1, block_k)
  init = (jnp.full((block_q,), MASK_VALUE, jnp.float32), jnp.zeros((block_q,), jnp.float32),
          jnp.zeros(q_TD.shape, jnp.float32))
  m_T, l_T, acc_TD = lax.fori_loop(0, n_k, body, init)
  # Every row sees its own key, so l_T >= 1 after the max shift: log and division are safe.
  lse_ref[...] = m_T + jnp.log(l_T)
  if pk_ref:
    pk_ref[0][...] = acc_TD * (scale / l_T)[:, None]


def row_stats(q, k, seg, *, scale, bs, with_pk, interpret):
  """F1: lse float32 [B, Hq, T] (and pk float32 [B, T, Hq, D] if with_pk)."""
  B, T, N, D = q.shape
  G = N // k.shape[2]
  bq, bk = bs.block_q_stats, bs.block_k_stats
  out_shape = [jax.ShapeDtypeStruct((B, N, T), jnp.float32)]
  out_specs = [pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))]
  if with_pk:
    out_shape.append(jax.ShapeDtypeStruct((B, T, N, D), jnp.float32))
    out_specs.append(pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)))
  kernel = functools.partial(_row_stats_kernel, scale=scale, block_q=bq, block_k=bk)
  outs = pl.pallas_call(
      kernel,
      grid=(T // bq, B, N),
      in_specs=[
          pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),
          pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, idiv(h, G), 0)),
          pl.BlockSpec((None, T), lambda i, b, h: (b, 0)),
      ],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=warps(D), num_stages=NUM_STAGES_FWD),
      interpret=interpret,
      name="dilution_row_stats",
  )(q, k, seg)
  return outs if with_pk else (outs[0], None)


def _key_sweep_kernel(q_ref, k_ref, v_ref, seg_ref, lse_ref, n0_ref, s0_ref,  # inputs
                      n_ref, s_ref, total_ref, *ckpt_ref,                     # outputs
                      scale, eps, block_q, block_k, ckpt_tiles):
  del n0_ref, s0_ref  # zero-initialised buffers aliased to n_ref / s_ref (atomic targets)
  j = pl.program_id(0)
  k0 = j * block_k
  n_tiles = q_ref.shape[0] // block_q
  k_SD = k_ref[...]
  v_SD = v_ref[...]
  segk_S = seg_ref[pl.ds(k0, block_k)]

  def tile(i, carry_S):
    r0 = i * block_q
    rows = pl.ds(r0, block_q)
    p_TS = tile_probs(q_ref[rows, :], k_SD, lse_ref[rows], seg_ref[rows], segk_S, r0, k0, scale)
    # Inclusive demand of key j at row r: all rows above this tile (carry) plus rows <= r here.
    share_TS = p_TS / (carry_S[None, :] + jnp.cumsum(p_TS, axis=0) + eps)
    pltriton.atomic_add(s_ref, (rows,), share_TS.sum(axis=1))
    # share ∈ [0, 1]: safe as a bf16 tensor-core operand, like flash attention's p.
    pltriton.atomic_add(n_ref, (rows, slice(None)), dot(share_TS.astype(v_SD.dtype), v_SD))
    return carry_S + p_TS.sum(axis=0)

  # Rows above k0 cannot see this key block: start at the row tile holding key k0.
  i0 = idiv(k0, block_q)
  carry_S = jnp.zeros((block_k,), jnp.float32)
  if ckpt_ref:
    def super_block(s, carry_S):
      # Checkpoint s = demand committed by rows < s·ckpt_rows (exactly 0 while s·ckpt_rows <= k0).
      ckpt_ref[0][s, pl.ds(k0, block_k)] = carry_S
      lo = jnp.maximum(s * ckpt_tiles, i0)
      hi = jnp.minimum((s + 1) * ckpt_tiles, n_tiles)
      return lax.fori_loop(lo, hi, tile, carry_S)
    n_super = ckpt_ref[0].shape[0]
    carry_S = lax.fori_loop(0, n_super, super_block, carry_S)
  else:
    carry_S = lax.fori_loop(i0, n_tiles, tile, carry_S)
  total_ref[...] = carry_S


def key_sweep(q, k, v, seg, lse, *, scale, eps, bs, with_ckpt, interpret):
  """F2: (N f32 [B,T,Hq,D], S, total f32 [B,Hq,T], ckpt [B, Hq, ceil(T/ckpt_rows), T] or None)."""
  B, T, N, D = q.shape
  G = N // k.shape[2]
  bq, bk = bs.block_q, bs.block_k_fwd
  ckpt_tiles = bs.ckpt_rows // bq
  n_super = -(-(T // bq) // ckpt_tiles)
  n0 = jnp.zeros((B, T, N, D), jnp.float32)
  s0 = jnp.zeros((B, N, T), jnp.float32)
  row_spec = pl.BlockSpec((None, None, T), lambda j, b, h: (b, h, 0))
  acc_spec = pl.BlockSpec((None, T, None, D), lambda j, b, h: (b, 0, h, 0))
  kv_spec = pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, idiv(h, G), 0))
  out_shape = [n0, s0, jax.ShapeDtypeStruct((B, N, T), jnp.float32)]
  out_specs = [acc_spec, row_spec, pl.BlockSpec((None, None, bk), lambda j, b, h: (b, h, j))]
  if with_ckpt:
    out_shape.append(jax.ShapeDtypeStruct((B, N, n_super, T), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, n_super, T), lambda j, b, h: (b, h, 0, 0)))
  kernel = functools.partial(_key_sweep_kernel, scale=scale, eps=eps, block_q=bq, block_k=bk,
                             ckpt_tiles=ckpt_tiles)
  outs = pl.pallas_call(
      kernel,
      grid=(T // bk, B, N),
      in_specs=[acc_spec, kv_spec, kv_spec, pl.BlockSpec((None, T), lambda j, b, h: (b, 0)),
                row_spec, acc_spec, row_spec],
      out_specs=out_specs,
      out_shape=[jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out_shape],
      input_output_aliases={5: 0, 6: 1},
      compiler_params=pltriton.CompilerParams(num_warps=warps(D), num_stages=NUM_STAGES_FWD),
      interpret=interpret,
      name="dilution_key_sweep",
  )(q, k, v, seg, lse, n0, s0)
  return (*outs, None) if not with_ckpt else tuple(outs)
