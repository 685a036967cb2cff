"""Dilution attention on TPU (Pallas Mosaic TPU): training forward and exact backward.

Operator and gradient as api.py's (spec reference.py). TPU Pallas has no atomics, but a core walks
its grid in order, so each cross-block sum is a VMEM scratch carried along "arbitrary" (sequential)
grid axes. Per-key vectors (demand carries, g-suffixes) stay whole in VMEM, O(T); no [T, D]
accumulator does: row sums finish in row-major passes (key blocks innermost), key sums in a
key-major one, so the backward sweeps its tiles twice instead of exchanging atomics. Inside, q, dO
are [B,Hq,T,D], k, v [B,Hkv,T,D] (GQA by index map), row stats [B,Hq,T,1]; T is padded to both
blocks (bq rows, bk keys); R = ckpt_rows, Rt = R / bq.

  F1 row stats  grid (B, Hq, T/bq, T/bk): online softmax → lse.
  F2 demand     grid (B, Hq, T/bq, T/bk), rows top-down: carry_j, the demand of the rows above
                ([T/bk, bk] VMEM), gives σ = p / (carry + in-tile cumsum + eps); S_i, N_i sum in
                VMEM over the keys, out = N / (S + eps) at the last one. At every R-th row the
                carry is stored into checkpoint row [B, Hq, T/R, 1, T] (a block that stays
                resident while its super-block runs).
  B1 rows       grid (B, Hq, T/R, 2·Rt, T/bk), super-blocks bottom-up: Rt forward steps rebuild
                each row block's carry from the checkpoint ([T/bk, Rt, bk] VMEM), Rt reverse steps
                carry the per-key g-suffix ([T/bk, 1, bk] VMEM) and finish, per row block,
                ĝ = rowsum(W) and dq = scale·(W K − ĝ p K).
  B2 keys       grid (B, Hq, T/bk, T/R, 2·Rt): the same sweep for one key block (carries
                [Rt, bk], suffix [1, bk]): dk = scale·(W − p ĝ)ᵀ Q, dv = Aᵀ dO; GQA sums dk, dv
                over each query-head group in XLA.
In-tile cumsums and suffixes are 0/1 triangular-mask products at f32 precision; carries are only
rebuilt by forward summation (never total − suffix), so the gradient is exact. Tiles above the
diagonal skip their compute and repeat the previous block index (no DMA). Accumulation is f32;
16-bit operands feed the MXU. Memory per (batch, query head): HBM ≈ 4·T·D + 4·T + ceil(T/R)·T
f32 of residuals and gradients; VMEM ≈ (Rt + 2)·T f32 plus tiles; no T×T tensor anywhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.dilution.api import _pad
from pallas_kernels.focal import reference

MASK_VALUE = reference.MASK_VALUE
LANES = 128   # a compiled key block must fill whole vector lanes


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
  """Tiles of the four passes: block_q rows × block_k keys; ckpt_rows = R."""
  block_q: int = 128
  block_k: int = 128
  ckpt_rows: int = 1024  # ceil(T/R)·T·4 bytes of HBM and (R/block_q)·T·4 of VMEM in B1

  def validate(self, interpret: bool):
    for name in ("block_q", "block_k", "ckpt_rows"):
      x = getattr(self, name)
      if not isinstance(x, int) or x < 8 or x & (x - 1):
        raise ValueError(f"TpuBlockSizes.{name}={x!r} must be a power of two >= 8")
    if self.ckpt_rows < self.block_q:
      raise ValueError(f"TpuBlockSizes.ckpt_rows={self.ckpt_rows} must be >= block_q="
                       f"{self.block_q}")
    if not interpret and self.block_k % LANES:
      raise ValueError(f"TpuBlockSizes.block_k={self.block_k} must be a multiple of {LANES} "
                       "when compiled (smaller blocks are for interpret mode)")


def _idiv(a, b):
  """Non-negative int32 division without floor-division's sign fix-ups (index maps)."""
  return lax.div(jnp.asarray(a, jnp.int32), jnp.int32(b))


def _dot(a, b, *, ta=False, tb=False):
  """a·b with f32 accumulation; f32 operands at full precision (masks, 32-bit inputs)."""
  prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _tri(n, upper):
  """0/1 float32 [n, n]: strictly lower (row > col: rows above) or strictly upper (rows below)."""
  r = lax.broadcasted_iota(jnp.int32, (n, n), 0)
  c = lax.broadcasted_iota(jnp.int32, (n, n), 1)
  return ((r < c) if upper else (r > c)).astype(jnp.float32)


def _logits(q_TD, k_SD, segq_T1, segk_1S, r0, k0, scale):
  """(scale·q kᵀ, visible) of a tile: causal (row r sees key c <= r) and same segment."""
  s_TS = _dot(q_TD, k_SD, tb=True) * scale
  shape = s_TS.shape
  vis = ((r0 + lax.broadcasted_iota(jnp.int32, shape, 0)
          >= k0 + lax.broadcasted_iota(jnp.int32, shape, 1)) & (segq_T1 == segk_1S))
  return s_TS, vis


def _probs(q_TD, k_SD, lse_T1, segq_T1, segk_1S, r0, k0, scale):
  """Softmax probabilities of a tile, float32, exactly 0 where masked."""
  s_TS, vis = _logits(q_TD, k_SD, segq_T1, segk_1S, r0, k0, scale)
  return jnp.exp(jnp.where(vis, s_TS - lse_T1, -jnp.inf))


def _tile_grads(p_TS, carry_1S, sufk_1S, do_TD, v_SD, rn_T1, dbar_T1, eps):
  """(A, g, W) of a tile: c = carry + rows above in the tile, inv = 1/(c + p + eps),
  dσ = (dO vᵀ − dbar)/(S + eps), g = −dσ p inv²,
  W = p (dσ (c + eps) inv² + Σ_{r>i} g_rj)."""
  n = p_TS.shape[0]
  c_TS = carry_1S + _dot(_tri(n, upper=False), p_TS)
  inv_TS = 1.0 / (c_TS + p_TS + eps)
  a_TS = p_TS * inv_TS * rn_T1
  ds_TS = (_dot(do_TD, v_SD, tb=True) - dbar_T1) * rn_T1
  g_TS = -ds_TS * p_TS * inv_TS * inv_TS
  # The suffix from later rows only: g ~ −dσ/p is huge at a key's first visible row and would
  # cancel in total − cumsum.
  suffix_TS = sufk_1S + _dot(_tri(n, upper=True), g_TS)
  w_TS = p_TS * (ds_TS * (c_TS + eps) * inv_TS * inv_TS + suffix_TS)
  return a_TS, g_TS, w_TS


def _f1_kernel(q_ref, k_ref, segq_ref, segk_ref, lse_ref, m_sc, l_sc, *, scale, bq, bk):
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)

  @pl.when(j * bk < (i + 1) * bq)
  def _():
    s_TS, vis = _logits(q_ref[...], k_ref[...], segq_ref[...], segk_ref[...], i * bq, j * bk,
                        scale)
    s_TS = jnp.where(vis, s_TS, MASK_VALUE)
    m_T1 = m_sc[...]
    m_new = jnp.maximum(m_T1, s_TS.max(axis=1, keepdims=True))
    e_TS = jnp.where(vis, jnp.exp(s_TS - m_new), 0.0)
    l_sc[...] = l_sc[...] * jnp.exp(m_T1 - m_new) + e_TS.sum(axis=1, keepdims=True)
    m_sc[...] = m_new

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    # Every row sees its own key, so l >= 1 after the max shift.
    lse_ref[...] = m_sc[...] + jnp.log(l_sc[...])


def _f2_kernel(q_ref, k_ref, v_ref, segq_ref, segk_ref, lse_ref,           # inputs
               out_ref, ssum_ref, ckpt_ref,                                # outputs
               carry_sc, n_sc, s_sc, *, scale, eps, bq, bk, rt):
  i, j = pl.program_id(2), pl.program_id(3)
  key = pl.ds(j, 1)

  @pl.when(i == 0)
  def _():
    carry_sc[key, :] = jnp.zeros((1, bk), jnp.float32)

  @pl.when(lax.rem(i, rt) == 0)
  def _():
    ckpt_ref[:, pl.ds(pl.multiple_of(j * bk, bk), bk)] = carry_sc[key, :]

  @pl.when(j == 0)
  def _():
    n_sc[...] = jnp.zeros(n_sc.shape, jnp.float32)
    s_sc[...] = jnp.zeros(s_sc.shape, jnp.float32)

  @pl.when(j * bk < (i + 1) * bq)
  def _():
    p_TS = _probs(q_ref[...], k_ref[...], lse_ref[...], segq_ref[...], segk_ref[...], i * bq,
                  j * bk, scale)
    carry_1S = carry_sc[key, :]
    # Inclusive demand of key j at row r: rows above this tile (carry) plus rows <= r here.
    share_TS = p_TS / (carry_1S + _dot(_tri(bq, upper=False), p_TS) + p_TS + eps)
    s_sc[...] += share_TS.sum(axis=1, keepdims=True)
    v_SD = v_ref[...]
    # share ∈ [0, 1]: safe as a 16-bit MXU operand, like flash attention's p.
    n_sc[...] += _dot(share_TS.astype(v_SD.dtype), v_SD)
    carry_sc[key, :] = carry_1S + p_TS.sum(axis=0, keepdims=True)

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    out_ref[...] = n_sc[...] / (s_sc[...] + eps)
    ssum_ref[...] = s_sc[...]


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
  probs = lambda: _probs(q_ref[...], k_ref[...], lse_ref[...], segq_ref[...], segk_ref[...],
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
    wk_sc[...] += _dot(w_TS.astype(k_SD.dtype), k_SD)
    pk_sc[...] += _dot(p_TS.astype(k_SD.dtype), k_SD)

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
    dk_sc[...] += _dot(ds_TS.astype(q_TD.dtype), q_TD, ta=True)
    dv_sc[...] += _dot(a_TS.astype(do_TD.dtype), do_TD, ta=True)

  _sweep(ins, t, u, j, pl.num_programs(3), run_sc, carries_sc, sufk_sc, on_tile, **kw)

  @pl.when((t == pl.num_programs(3) - 1) & (u == pl.num_programs(4) - 1))
  def _():
    dk_ref[...] = kw["scale"] * dk_sc[...]
    dv_ref[...] = dv_sc[...]


def _call(kernel, grid, in_specs, out_specs, out_shape, scratch, semantics, interpret, name):
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0, grid=grid, in_specs=in_specs,
                                             out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
      interpret=pltpu.InterpretParams() if interpret else False,
      name=name)


def _f32(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def _vmem(*shape):
  return pltpu.VMEM(shape, jnp.float32)


def _specs(D, G, bq, bk, row, key):
  """BlockSpecs (rows [bq, D], kv [bk, D], segq, segk, row stats [bq, 1]) for a grid whose
  indices after (b, h) map to row block row(*g) and key block key(*g)."""
  rows = lambda b, h, *g: (b, h, row(*g), 0)
  return (pl.BlockSpec((None, None, bq, D), rows),
          pl.BlockSpec((None, None, bk, D), lambda b, h, *g: (b, _idiv(h, G), key(*g), 0)),
          pl.BlockSpec((None, bq, 1), lambda b, h, *g: (b, row(*g), 0)),
          pl.BlockSpec((None, 1, bk), lambda b, h, *g: (b, 0, key(*g))),
          pl.BlockSpec((None, None, bq, 1), rows))


def _forward(q, k, v, seg, scale, eps, bs, interpret):
  """F1 and F2 on q [B,Hq,T,D], k, v [B,Hkv,T,D]: (out f32, lse, S, ckpt)."""
  B, N, T, D = q.shape
  bq, bk, rt = bs.block_q, bs.block_k, bs.ckpt_rows // bs.block_q
  n_rows, n_keys = T // bq, T // bk
  segq, segk = seg[:, :, None], seg[:, None, :]
  # Key blocks past the diagonal repeat its block: no DMA for skipped tiles.
  q_s, kv_s, segq_s, segk_s, row_s = _specs(
      D, N // k.shape[1], bq, bk, lambda i, j: i,
      lambda i, j: jnp.minimum(j, _idiv(i * bq + bq - 1, bk)))
  grid = (B, N, n_rows, n_keys)
  lse = _call(
      functools.partial(_f1_kernel, scale=scale, bq=bq, bk=bk), grid,
      [q_s, kv_s, segq_s, segk_s], row_s, _f32(B, N, T, 1), [_vmem(bq, 1)] * 2,
      ("parallel", "parallel", "parallel", "arbitrary"), interpret, "dilution_tpu_row_stats",
  )(q, k, segq, segk)
  # A whole checkpoint row per super-block: its block stays put while the super-block runs.
  ckpt_s = pl.BlockSpec((None, None, None, 1, T), lambda b, h, i, j: (b, h, _idiv(i, rt), 0, 0))
  out, ssum, ckpt = _call(
      functools.partial(_f2_kernel, scale=scale, eps=eps, bq=bq, bk=bk, rt=rt), grid,
      [q_s, kv_s, kv_s, segq_s, segk_s, row_s], [q_s, row_s, ckpt_s],
      [_f32(B, N, T, D), _f32(B, N, T, 1), _f32(B, N, -(-n_rows // rt), 1, T)],
      [_vmem(n_keys, bk), _vmem(bq, D), _vmem(bq, 1)],
      ("parallel", "parallel", "arbitrary", "arbitrary"), interpret, "dilution_tpu_demand",
  )(q, k, v, segq, segk, lse)
  return out, lse, ssum, ckpt


def _backward(q, k, v, seg, do, lse, ssum, dbar, ckpt, scale, eps, bs, interpret):
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
  q_s, kv_s, segq_s, segk_s, row_s = _specs(
      D, G, bq, bk, lambda t, u, j: row(t, u),
      lambda t, u, j: jnp.minimum(j, _idiv(row(t, u) * bq + bq - 1, bk)))
  ckpt_s = pl.BlockSpec((None, None, None, 1, bk),
                        lambda b, h, t, u, j: (b, h, n_super - 1 - t, 0, j))
  out_s = [pl.BlockSpec((None, None, bq, x),
                        lambda b, h, t, u, j: (b, h, row(t, jnp.maximum(u, rt)), 0))
           for x in (D, 1)]
  dq, ghat = _call(
      functools.partial(_b1_kernel, **kw), (B, N, n_super, 2 * rt, n_keys),
      [q_s, kv_s, kv_s, segq_s, segk_s, row_s, row_s, row_s, q_s, ckpt_s], out_s,
      [_f32(B, N, T, D), _f32(B, N, T, 1)],
      [_vmem(n_keys, 1, bk), _vmem(n_keys, rt, bk), _vmem(n_keys, 1, bk), _vmem(bq, 1),
       _vmem(bq, D), _vmem(bq, D)],
      ("parallel", "parallel", "arbitrary", "arbitrary", "arbitrary"), interpret,
      "dilution_tpu_bwd_rows",
  )(*args)

  # B2: grid (b, h, j, t, u); rows above key block j repeat its first visible row block.
  q_s, kv_s, segq_s, segk_s, row_s = _specs(
      D, G, bq, bk, lambda j, t, u: jnp.maximum(row(t, u), _idiv(j * bk, bq)),
      lambda j, t, u: j)
  ckpt_s = pl.BlockSpec((None, None, None, 1, bk),
                        lambda b, h, j, t, u: (b, h, n_super - 1 - t, 0, j))
  key_s = pl.BlockSpec((None, None, bk, D), lambda b, h, j, t, u: (b, h, j, 0))
  dk, dv = _call(
      functools.partial(_b2_kernel, **kw), (B, N, n_keys, n_super, 2 * rt),
      [q_s, kv_s, kv_s, segq_s, segk_s, row_s, row_s, row_s, q_s, ckpt_s, row_s],
      [key_s, key_s], [_f32(B, N, T, D)] * 2,
      [_vmem(1, bk), _vmem(rt, bk), _vmem(1, bk), _vmem(bk, D), _vmem(bk, D)],
      ("parallel", "parallel", "parallel", "arbitrary", "arbitrary"), interpret,
      "dilution_tpu_bwd_keys",
  )(*args, ghat)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _core(q, k, v, seg, scale, eps, bs, interpret):
  return _forward(q, k, v, seg, scale, eps, bs, interpret)[0].astype(q.dtype)


def _core_fwd(q, k, v, seg, scale, eps, bs, interpret):
  out, lse, ssum, ckpt = _forward(q, k, v, seg, scale, eps, bs, interpret)
  return out.astype(q.dtype), (q, k, v, seg, out, lse, ssum, ckpt)


def _core_bwd(scale, eps, bs, interpret, res, do):
  q, k, v, seg, out, lse, ssum, ckpt = res
  B, N, T, D = q.shape
  K = k.shape[1]
  # dbar_i = dO_i·O_i with the float32 output (exact identity Σ_k σ_ik dO_i·v_k/(S_i+eps)).
  dbar = jnp.sum(do.astype(jnp.float32) * out, axis=-1, keepdims=True)
  dq, dk, dv = _backward(q, k, v, seg, do.astype(q.dtype), lse, ssum, dbar, ckpt, scale, eps,
                         bs, interpret)
  # GQA: a kv head's gradient is the sum over its query-head group.
  dk = dk.reshape(B, K, N // K, T, D).sum(2)
  dv = dv.reshape(B, K, N // K, T, D).sum(2)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_core.defvjp(_core_fwd, _core_bwd)


@functools.partial(jax.jit, static_argnames=("scale", "eps", "block_sizes", "interpret"))
def dilution_attention(q, k, v, *, scale, eps, segment_ids=None, block_sizes=None,
                       interpret=False):
  """Causal dilution attention with an exact custom VJP, as `api.dilution_attention`:
  q [B,T,Hq,D], k, v [B,T,Hkv,D] -> [B,T,Hq,D] in q.dtype; scale, eps static floats;
  block_sizes None: `TpuBlockSizes()`; interpret: TPU interpret mode (CPU)."""
  B, T, S, _, _, _ = reference.check_qkv(q, k, v)
  if T != S:
    raise ValueError(f"dilution attention is causal self-attention: T ({T}) must equal S ({S})")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
  if not isinstance(scale, (int, float)):
    raise ValueError(f"scale must be a Python float for the Pallas kernels; got {type(scale)}")
  bs = block_sizes or TpuBlockSizes()
  bs.validate(interpret)
  seg = (jnp.zeros((B, T), jnp.int32) if segment_ids is None
         else jnp.asarray(segment_ids, jnp.int32))
  qp, kp, vp, segp = _pad(q, k, v, seg, max(bs.block_q, bs.block_k))
  to_heads = lambda x: x.transpose(0, 2, 1, 3)
  out = _core(to_heads(qp), to_heads(kp), to_heads(vp), segp, float(scale), float(eps), bs,
              interpret)
  return to_heads(out)[:, :T]
