"""Dilution attention on TPU (Pallas Mosaic TPU): the exact backward passes B1 and B2.

Called by tpu.py's custom VJP with the forward's residuals: lse, S = rowsum(σ), dbar = dO·O and
the demand checkpoints ckpt [B, Hq, T/R, 1, T] (R = ckpt_rows, Rt = R / bq). Both passes sweep
each R-row super-block bottom-up in 2·Rt steps: Rt forward steps rebuild each row block's carry
from the checkpoint, Rt reverse steps carry the per-key g-suffix and take each tile's gradients.
  B1 rows       grid (B, Hq, T/R, 2·Rt, T/bk), key blocks innermost: carries [T/bk, Rt, bk],
                running carry and suffix [T/bk, 1, bk] VMEM; finishes, per row block,
                ĝ = rowsum(W) and dq = scale·(W K − ĝ p K).
  B2 keys       grid (B, Hq, T/bk, T/R, 2·Rt): the same sweep for one key block (carries
                [Rt, bk], suffix [1, bk]): dk = scale·(W − p ĝ)ᵀ Q, dv = Aᵀ dO; GQA sums dk, dv
                over each query-head group in XLA.
In-tile cumsums and suffixes are 0/1 triangular-mask products at f32 precision; carries are only
rebuilt by forward summation (never total − suffix), so the gradient is exact. Memory per
(batch, query head): HBM 3·T·D + T f32 of gradients; VMEM ≈ (Rt + 2)·T f32 in B1, (Rt + 2)·bk +
2·bk·D in B2, plus tiles.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.dilution.tpu_tile import (dot, f32, idiv, tile_probs, tile_specs, tpu_call,
                                              tri, vmem)


def _tile_grads(p_TS, carry_1S, sufk_1S, do_TD, v_SD, rn_T1, dbar_T1, eps):
  """(A, g, W) of a tile: c = carry + rows above in the tile, inv = 1/(c + p + eps),
  dσ = (dO vᵀ − dbar)/(S + eps), g = −dσ p inv²,
  W = p (dσ (c + eps) inv² + Σ_{r>i} g_rj)."""
  n = p_TS.shape[0]
  c_TS = carry_1S + dot(tri(n, upper=False), p_TS)
  inv_TS = 1.0 / (c_TS + p_TS + eps)
  a_TS = p_TS * inv_TS * rn_T1
  ds_TS = (dot(do_TD, v_SD, tb=True) - dbar_T1) * rn_T1
  g_TS = -ds_TS * p_TS * inv_TS * inv_TS
  # The suffix from later rows only: g ~ −dσ/p is huge at a key's first visible row and would
  # cancel in total − cumsum.
  suffix_TS = sufk_1S + dot(tri(n, upper=True), g_TS)
  w_TS = p_TS * (ds_TS * (c_TS + eps) * inv_TS * inv_TS + suffix_TS)
  return a_TS, g_TS, w_TS


def _sweep(ins, t, u, j, n_super, run, carries, sufk, on_tile, *, scale, eps, bq, bk, rt,
           n_rows):
  """The backward step (t, u) on key block j shared by B1 and B2 (ins: their common inputs;
  per-key scratch views run, sufk [1, bk], carries [Rt, bk]): super-block n_super-1-t; forward
  step u < Rt on row block lo+u stores its carry, reverse step u >= Rt on row block lo+2Rt-1-u
  takes the tile's gradients, advances the suffix and hands (p, A, W) to on_tile. Returns
  (reverse step, row block)."""
  q_ref, k_ref, v_ref, segq_ref, segk_ref, lse_ref, ssum_ref, dbar_ref, do_ref, ckpt_ref = ins
  lo = (n_super - 1 - t) * rt
  mini = u < rt
  i = jnp.where(mini, lo + u, lo + 2 * rt - 1 - u)
  slot = pl.ds(i - lo, 1)
  row_ok = i < n_rows
  tile_ok = row_ok & (j * bk < (i + 1) * bq)
  probs = lambda: tile_probs(q_ref[...], k_ref[...], lse_ref[...], segq_ref[...], segk_ref[...],
                              i * bq, j * bk, scale)

  @pl.when((t == 0) & (u == 0))
  def _():
    sufk[...] = jnp.zeros(sufk.shape, jnp.float32)

  @pl.when(u == 0)
  def _():
    run[...] = ckpt_ref[...]

  @pl.when(mini & row_ok)
  def _():
    carries[slot, :] = run[...]

  # The last row block's column sums would only feed the next super-block's (stored) start.
  @pl.when(mini & tile_ok & (u < rt - 1) & (i < n_rows - 1))
  def _():
    run[...] += probs().sum(axis=0, keepdims=True)

  @pl.when(~mini & tile_ok)
  def _():
    p_TS = probs()
    a_TS, g_TS, w_TS = _tile_grads(p_TS, carries[slot, :], sufk[...], do_ref[...], v_ref[...],
                                   1.0 / (ssum_ref[...] + eps), dbar_ref[...], eps)
    sufk[...] += g_TS.sum(axis=0, keepdims=True)
    on_tile(p_TS, a_TS, w_TS)

  return ~mini, i


def _b1_kernel(*refs, **kw):
  ins, (dq_ref, ghat_ref), (run_sc, carries_sc, sufk_sc, ghat_sc, wk_sc, pk_sc) = (
      refs[:10], refs[10:12], refs[12:])
  t, u, j = pl.program_id(2), pl.program_id(3), pl.program_id(4)

  @pl.when((u >= kw["rt"]) & (j == 0))
  def _():
    ghat_sc[...] = jnp.zeros(ghat_sc.shape, jnp.float32)
    wk_sc[...] = jnp.zeros(wk_sc.shape, jnp.float32)
    pk_sc[...] = jnp.zeros(pk_sc.shape, jnp.float32)

  def on_tile(p_TS, a_TS, w_TS):
    del a_TS
    ghat_sc[...] += w_TS.sum(axis=1, keepdims=True)
    k_SD = ins[1][...]
    wk_sc[...] += dot(w_TS.astype(k_SD.dtype), k_SD)
    pk_sc[...] += dot(p_TS.astype(k_SD.dtype), k_SD)

  rev, i = _sweep(ins, t, u, j, pl.num_programs(2), run_sc.at[j], carries_sc.at[j],
                  sufk_sc.at[j], on_tile, **kw)

  @pl.when(rev & (i < kw["n_rows"]) & (j == pl.num_programs(4) - 1))
  def _():
    # dq_i = scale·Σ_j (W_ij − p_ij ĝ_i) k_j, with ĝ_i known only after the last key block.
    dq_ref[...] = kw["scale"] * (wk_sc[...] - ghat_sc[...] * pk_sc[...])
    ghat_ref[...] = ghat_sc[...]


def _b2_kernel(*refs, **kw):
  ins, ghat_ref, (dk_ref, dv_ref), (run_sc, carries_sc, sufk_sc, dk_sc, dv_sc) = (
      refs[:10], refs[10], refs[11:13], refs[13:])
  j, t, u = pl.program_id(2), pl.program_id(3), pl.program_id(4)

  @pl.when((t == 0) & (u == 0))
  def _():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  def on_tile(p_TS, a_TS, w_TS):
    q_TD, do_TD = ins[0][...], ins[8][...]
    ds_TS = w_TS - p_TS * ghat_ref[...]   # the softmax's own backward, with ĝ from B1
    dk_sc[...] += dot(ds_TS.astype(q_TD.dtype), q_TD, ta=True)
    dv_sc[...] += dot(a_TS.astype(do_TD.dtype), do_TD, ta=True)

  _sweep(ins, t, u, j, pl.num_programs(3), run_sc, carries_sc, sufk_sc, on_tile, **kw)

  @pl.when((t == pl.num_programs(3) - 1) & (u == pl.num_programs(4) - 1))
  def _():
    dk_ref[...] = kw["scale"] * dk_sc[...]
    dv_ref[...] = dv_sc[...]


def backward(q, k, v, seg, do, lse, ssum, dbar, ckpt, scale, eps, bs, interpret):
  """B1 and B2: (dq, dk, dv) float32 per query head, [B,Hq,T,D]."""
  B, N, T, D = q.shape
  G = N // k.shape[1]
  bq, bk, rt = bs.block_q, bs.block_k, bs.ckpt_rows // bs.block_q
  n_rows, n_keys, n_super = T // bq, T // bk, ckpt.shape[2]
  kw = dict(scale=scale, eps=eps, bq=bq, bk=bk, rt=rt, n_rows=n_rows)
  args = (q, k, v, seg[:, :, None], seg[:, None, :], lse, ssum, dbar, do, ckpt)

  def row(t, u):
    # Rt forward steps top-down, then Rt reverse steps; past the last row block the nearest
    # real one repeats, so every block's visits stay consecutive.
    lo = (n_super - 1 - t) * rt
    return jnp.minimum(jnp.where(u < rt, lo + u, lo + 2 * rt - 1 - u), n_rows - 1)

  # B1: grid (b, h, t, u, j); outputs are written by reverse steps only, so the forward steps
  # park on the first of them.
  q_s, kv_s, segq_s, segk_s, row_s = tile_specs(
      D, G, bq, bk, lambda t, u, j: row(t, u),
      lambda t, u, j: jnp.minimum(j, idiv(row(t, u) * bq + bq - 1, bk)))
  ckpt_s = pl.BlockSpec((None, None, None, 1, bk),
                        lambda b, h, t, u, j: (b, h, n_super - 1 - t, 0, j))
  out_s = [pl.BlockSpec((None, None, bq, x),
                        lambda b, h, t, u, j: (b, h, row(t, jnp.maximum(u, rt)), 0))
           for x in (D, 1)]
  dq, ghat = tpu_call(
      functools.partial(_b1_kernel, **kw), (B, N, n_super, 2 * rt, n_keys),
      [q_s, kv_s, kv_s, segq_s, segk_s, row_s, row_s, row_s, q_s, ckpt_s], out_s,
      [f32(B, N, T, D), f32(B, N, T, 1)],
      [vmem(n_keys, 1, bk), vmem(n_keys, rt, bk), vmem(n_keys, 1, bk), vmem(bq, 1),
       vmem(bq, D), vmem(bq, D)],
      ("parallel", "parallel", "arbitrary", "arbitrary", "arbitrary"), interpret,
      "dilution_tpu_bwd_rows",
  )(*args)

  # B2: grid (b, h, j, t, u); rows above key block j repeat its first visible row block.
  q_s, kv_s, segq_s, segk_s, row_s = tile_specs(
      D, G, bq, bk, lambda j, t, u: jnp.maximum(row(t, u), idiv(j * bk, bq)),
      lambda j, t, u: j)
  ckpt_s = pl.BlockSpec((None, None, None, 1, bk),
                        lambda b, h, j, t, u: (b, h, n_super - 1 - t, 0, j))
  key_s = pl.BlockSpec((None, None, bk, D), lambda b, h, j, t, u: (b, h, j, 0))
  dk, dv = tpu_call(
      functools.partial(_b2_kernel, **kw), (B, N, n_keys, n_super, 2 * rt),
      [q_s, kv_s, kv_s, segq_s, segk_s, row_s, row_s, row_s, q_s, ckpt_s, row_s],
      [key_s, key_s], [f32(B, N, T, D)] * 2,
      [vmem(1, bk), vmem(rt, bk), vmem(1, bk), vmem(bk, D), vmem(bk, D)],
      ("parallel", "parallel", "parallel", "arbitrary", "arbitrary"), interpret,
      "dilution_tpu_bwd_keys",
  )(*args, ghat)
  return dq, dk, dv
