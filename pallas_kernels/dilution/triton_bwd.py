"""Dilution attention's exact backward on Triton: B1 reverse sweep, B2 dk correction.

Per head: c = committed demand, inv = 1/(c + p + eps), σ = p·inv, A = σ/(S + eps),
dσ = (dO·vᵀ − dbar)/(S + eps), g = −dσ p inv², W = p (dσ (c + eps) inv² + Σ_{r>i} g_rj),
ĝ = rowsum(W); dq = s W K − ĝ pk, dk = s Wᵀ Q − s (p ĝ)ᵀ Q, dv = Aᵀ dO.

B1 `reverse_sweep`, grid (T/b1_block_k, B, Hq): a program owns key block J and walks ckpt_rows
super-blocks bottom-up, carrying the per-key g-suffix sufk_J; a forward mini-sweep first rebuilds
the tile carries from F2's checkpoint, kept per b1_carries in "registers" (a [R/block_q, bk]
array, one-hot selects) or "scratch" (the program's slice of an HBM buffer, transient
B·Hq·T·R/block_q f32). dv, dk_main in registers; ĝ, dq_main by f32 atomics. In-tile suffixes are
strictly-triangular products at f32 accuracy (`exact_mask_dot`).
B2 `dk_correction`, grid (T/block_k, B, Hq): corr_J = Σ_I (P_IJ ⊙ ĝ_I)ᵀ Q_I, [block_k, D] f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.dilution.triton_fwd import dot, idiv, tile_probs, warps

B1_WARPS = 8    # B1 keeps dk, dv [b1_block_k, D] float32 live
NUM_STAGES_BWD = 1


def bf16_pieces(x, n: int = 3):
  """n bf16 pieces, largest first: (hi, mid, lo) sum to x exactly, (hi, mid) to ~16 bits."""
  pieces, res = [], x
  for i in range(n):
    pieces.append(res.astype(jnp.bfloat16))
    if i + 1 < n:
      res = res - pieces[-1].astype(jnp.float32)
  return tuple(pieces)


def exact_mask_dot(mask_TT, x_TS):
  """mask·x to f32 accuracy from bf16 tensor-core products (x = hi + mid + lo, bf16 pieces; the
  mask must be exact in bf16): an f32 dot would run as IEEE FMAs on CUDA cores."""
  hi_TS, mid_TS, lo_TS = bf16_pieces(x_TS)
  mask_TT = mask_TT.astype(jnp.bfloat16)
  # Small pieces first, so the big one is added to their already-combined sum.
  return dot(mask_TT, hi_TS) + (dot(mask_TT, mid_TS) + dot(mask_TT, lo_TS))


def _check_tiles(T, block_k, field):
  """The grid is T/block_k programs; api.py pads T to BlockSizes.pad_multiple."""
  if T % block_k:
    raise ValueError(f"T={T} must be a multiple of BlockSizes.{field}={block_k} (pad T, or pick "
                     f"a power of two >= 16 dividing T)")


def _reverse_sweep_kernel(q_ref, k_ref, v_ref, seg_ref, lse_ref, ssum_ref, dbar_ref, do_ref,
                          ckpt_ref, dq0_ref, ghat0_ref,                       # inputs
                          dq_ref, ghat_ref, dk_ref, dv_ref, *carry_ref,       # outputs
                          scale, eps, block_q, block_k, ckpt_tiles, barrier):
  del dq0_ref, ghat0_ref  # zero-initialised buffers aliased to dq_ref / ghat_ref (atomic targets)
  j = pl.program_id(0)
  k0 = j * block_k
  n_tiles = q_ref.shape[0] // block_q
  n_super = ckpt_ref.shape[0]
  k_SD = k_ref[...]
  v_SD = v_ref[...]
  segk_S = seg_ref[pl.ds(k0, block_k)]
  later_TT = (lax.broadcasted_iota(jnp.int32, (block_q, block_q), 0)
              < lax.broadcasted_iota(jnp.int32, (block_q, block_q), 1)).astype(jnp.bfloat16)

  def probs(r0):
    rows = pl.ds(r0, block_q)
    return tile_probs(q_ref[rows, :], k_SD, lse_ref[rows], seg_ref[rows], segk_S, r0, k0, scale)

  def super_block(t, acc):
    s = n_super - 1 - t
    lo = jnp.maximum(s * ckpt_tiles, idiv(k0, block_q))
    hi = jnp.minimum((s + 1) * ckpt_tiles, n_tiles)

    if carry_ref:
      # b1_carries="scratch": this program's own [ckpt_tiles, block_k] slice of an HBM buffer.
      def mini_forward(i, carry_S):
        carry_ref[0][i - s * ckpt_tiles, :] = carry_S
        return carry_S + probs(i * block_q).sum(axis=0)

      lax.fori_loop(lo, hi, mini_forward, ckpt_ref[s, pl.ds(k0, block_k)])
      if barrier:  # other warps read the rows this warp stored (CTA barrier: visibility)
        pltriton.debug_barrier()
      carry_at = lambda slot: carry_ref[0][slot, :]
    else:
      slot_CS = lax.broadcasted_iota(jnp.int32, (ckpt_tiles, block_k), 0)

      def mini_forward(i, state):
        carry_S, carry_CS = state
        carry_CS = jnp.where(slot_CS == i - s * ckpt_tiles, carry_S[None, :], carry_CS)
        return carry_S + probs(i * block_q).sum(axis=0), carry_CS

      _, carry_CS = lax.fori_loop(
          lo, hi, mini_forward,
          (ckpt_ref[s, pl.ds(k0, block_k)], jnp.zeros((ckpt_tiles, block_k), jnp.float32)))
      # Exactly one slot matches: the select-and-sum returns the stored carry bit for bit.
      carry_at = lambda slot: jnp.where(slot_CS == slot, carry_CS, 0.0).sum(axis=0)

    def reverse_tile(u, acc):
      dv_SD, dk_SD, sufk_S = acc
      i = hi - 1 - u
      r0 = i * block_q
      rows = pl.ds(r0, block_q)
      carry_S = carry_at(i - s * ckpt_tiles)
      q_TD = q_ref[rows, :]
      do_TD = do_ref[rows, :]
      p_TS = tile_probs(q_TD, k_SD, lse_ref[rows], seg_ref[rows], segk_S, r0, k0, scale)
      c_TS = carry_S[None, :] + jnp.cumsum(p_TS, axis=0) - p_TS       # exclusive demand
      inv_TS = 1.0 / (c_TS + p_TS + eps)
      rnorm_T = 1.0 / (ssum_ref[rows] + eps)
      a_TS = p_TS * inv_TS * rnorm_T[:, None]
      dv_SD = dv_SD + dot(a_TS.astype(do_TD.dtype), do_TD, ta=True)
      ds_TS = (dot(do_TD, v_SD, tb=True) - dbar_ref[rows][:, None]) * rnorm_T[:, None]
      g_TS = -ds_TS * p_TS * inv_TS * inv_TS
      # Σ over later rows: later tiles (sufk) + a strictly-triangular in-tile product, never
      # total − cumsum (g ~ −dσ/p is huge at a key's first visible row and would cancel).
      suffix_TS = sufk_S[None, :] + exact_mask_dot(later_TT, g_TS)
      w_TS = p_TS * (ds_TS * (c_TS + eps) * inv_TS * inv_TS + suffix_TS)
      pltriton.atomic_add(ghat_ref, (rows,), w_TS.sum(axis=1))
      w_op = w_TS.astype(q_TD.dtype)
      pltriton.atomic_add(dq_ref, (rows, slice(None)), dot(w_op, k_SD) * scale)
      dk_SD = dk_SD + dot(w_op, q_TD, ta=True)
      return dv_SD, dk_SD, sufk_S + g_TS.sum(axis=0)

    acc = lax.fori_loop(0, hi - lo, reverse_tile, acc)
    if carry_ref and barrier:  # the next super-block overwrites rows other warps may still read
      pltriton.debug_barrier()
    return acc

  D = k_SD.shape[-1]
  zeros_SD = jnp.zeros((block_k, D), jnp.float32)
  n_visit = n_super - idiv(idiv(k0, block_q), ckpt_tiles)
  dv_SD, dk_SD, _ = lax.fori_loop(0, n_visit, super_block,
                                  (zeros_SD, zeros_SD, jnp.zeros((block_k,), jnp.float32)))
  dv_ref[...] = dv_SD
  dk_ref[...] = dk_SD


def reverse_sweep(q, k, v, seg, lse, ssum, dbar, do, ckpt, *, scale, eps, bs, interpret):
  """B1: (dq_main (scaled), ghat [B,Hq,T], dk_main (unscaled), dv), f32, per query head."""
  B, T, N, D = q.shape
  G = N // k.shape[2]
  bq, bk = bs.block_q, bs.b1_block_k
  _check_tiles(T, bk, "b1_block_k")
  n_super = ckpt.shape[2]
  row_spec = pl.BlockSpec((None, None, T), lambda j, b, h: (b, h, 0))
  full_spec = pl.BlockSpec((None, T, None, D), lambda j, b, h: (b, 0, h, 0))
  kv_spec = pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, idiv(h, G), 0))
  key_out_spec = pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, h, 0))
  ckpt_tiles = bs.ckpt_rows // bq
  dq0 = jnp.zeros((B, T, N, D), jnp.float32)
  ghat0 = jnp.zeros((B, N, T), jnp.float32)
  out_specs = [full_spec, row_spec, key_out_spec, key_out_spec]
  out_shape = [jax.ShapeDtypeStruct((B, T, N, D), jnp.float32),
               jax.ShapeDtypeStruct((B, N, T), jnp.float32),
               jax.ShapeDtypeStruct((B, T, N, D), jnp.float32),
               jax.ShapeDtypeStruct((B, T, N, D), jnp.float32)]
  if bs.b1_carries == "scratch":
    # One [ckpt_tiles, block_k] slice per program: B·Hq·T·(R/block_q) fp32, discarded after.
    out_specs.append(pl.BlockSpec((None, None, None, ckpt_tiles, bk),
                                  lambda j, b, h: (b, h, j, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((B, N, T // bk, ckpt_tiles, bk), jnp.float32))
  kernel = functools.partial(_reverse_sweep_kernel, scale=scale, eps=eps, block_q=bq,
                             block_k=bk, ckpt_tiles=ckpt_tiles, barrier=not interpret)
  outs = pl.pallas_call(
      kernel,
      grid=(T // bk, B, N),
      in_specs=[full_spec, kv_spec, kv_spec, pl.BlockSpec((None, T), lambda j, b, h: (b, 0)),
                row_spec, row_spec, row_spec, full_spec,
                pl.BlockSpec((None, None, n_super, T), lambda j, b, h: (b, h, 0, 0)),
                full_spec, row_spec],
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases={9: 0, 10: 1},
      compiler_params=pltriton.CompilerParams(num_warps=B1_WARPS, num_stages=NUM_STAGES_BWD),
      interpret=interpret,
      name="dilution_reverse_sweep",
  )(q, k, v, seg, lse, ssum, dbar, do, ckpt, dq0, ghat0)
  return tuple(outs[:4])


def _dk_correction_kernel(q_ref, k_ref, seg_ref, lse_ref, ghat_ref, corr_ref, *,
                          scale, block_q, block_k):
  j = pl.program_id(0)
  k0 = j * block_k
  k_SD = k_ref[...]
  segk_S = seg_ref[pl.ds(k0, block_k)]

  def tile(i, corr_SD):
    r0 = i * block_q
    rows = pl.ds(r0, block_q)
    q_TD = q_ref[rows, :]
    p_TS = tile_probs(q_TD, k_SD, lse_ref[rows], seg_ref[rows], segk_S, r0, k0, scale)
    pg_TS = p_TS * ghat_ref[rows][:, None]
    return corr_SD + dot(pg_TS.astype(q_TD.dtype), q_TD, ta=True)

  corr_SD = lax.fori_loop(idiv(k0, block_q), q_ref.shape[0] // block_q, tile,
                          jnp.zeros(corr_ref.shape, jnp.float32))
  corr_ref[...] = corr_SD


def dk_correction(q, k, seg, lse, ghat, *, scale, bs, interpret):
  """B2: Σ_i p_ij ĝ_i q_i per key and query head, float32 [B, T, Hq, D] (unscaled)."""
  B, T, N, D = q.shape
  G = N // k.shape[2]
  bq, bk = bs.block_q, bs.block_k
  _check_tiles(T, bk, "block_k")
  row_spec = pl.BlockSpec((None, None, T), lambda j, b, h: (b, h, 0))
  kernel = functools.partial(_dk_correction_kernel, scale=scale, block_q=bq, block_k=bk)
  return pl.pallas_call(
      kernel,
      grid=(T // bk, B, N),
      in_specs=[pl.BlockSpec((None, T, None, D), lambda j, b, h: (b, 0, h, 0)),
                pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, idiv(h, G), 0)),
                pl.BlockSpec((None, T), lambda j, b, h: (b, 0)), row_spec, row_spec],
      out_specs=pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, h, 0)),
      out_shape=jax.ShapeDtypeStruct((B, T, N, D), jnp.float32),
      compiler_params=pltriton.CompilerParams(num_warps=warps(D), num_stages=NUM_STAGES_BWD),
      interpret=interpret,
      name="dilution_dk_correction",
  )(q, k, seg, lse, ghat)
