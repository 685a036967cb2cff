"""Dilution attention on TPU (Pallas Mosaic TPU): training forward, exact backward and prefill.

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
                resident while its super-block runs). Prefill: no checkpoints; the last row
                block writes the carries, the demand totals [B, Hq, 1, T].
  B1, B2        the exact backward (tpu_bwd.py): per R-row super-block, bottom-up, rebuild the
                carries from the checkpoint, then sweep back with the per-key g-suffix; B1
                (row-major) finishes dq, B2 (key-major) dk and dv.
Shared per-tile math is in tpu_tile.py. Tiles above the diagonal skip their compute and repeat
the previous block index (no DMA). Accumulation is f32; 16-bit operands feed the MXU. Memory per
(batch, query head): HBM ≈ 4·T·D + 4·T + ceil(T/R)·T f32 of residuals and gradients; VMEM ≈
(Rt + 2)·T f32 plus tiles; no T×T tensor anywhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.dilution.api import _pad
from pallas_kernels.dilution.tpu_bwd import backward
from pallas_kernels.dilution.tpu_tile import (MASK_VALUE, dot, f32, idiv, tile_logits,
                                              tile_probs, tile_specs, tpu_call, tri, vmem)
from pallas_kernels.focal import reference

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


def _f1_kernel(q_ref, k_ref, segq_ref, segk_ref, lse_ref, m_sc, l_sc, *, scale, bq, bk):
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)

  @pl.when(j * bk < (i + 1) * bq)
  def _():
    s_TS, vis = tile_logits(q_ref[...], k_ref[...], segq_ref[...], segk_ref[...], i * bq, j * bk,
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
               out_ref, ssum_ref, keys_ref,                                # outputs
               carry_sc, n_sc, s_sc, *, scale, eps, bq, bk, rt):
  """keys_ref: this super-block's checkpoint row (rt row blocks per super-block) or, with
  rt = 0 (prefill), the demand totals."""
  i, j = pl.program_id(2), pl.program_id(3)
  key, cols = pl.ds(j, 1), pl.ds(pl.multiple_of(j * bk, bk), bk)

  @pl.when(i == 0)
  def _():
    carry_sc[key, :] = jnp.zeros((1, bk), jnp.float32)

  if rt:
    @pl.when(lax.rem(i, rt) == 0)
    def _():
      keys_ref[:, cols] = carry_sc[key, :]

  @pl.when(j == 0)
  def _():
    n_sc[...] = jnp.zeros(n_sc.shape, jnp.float32)
    s_sc[...] = jnp.zeros(s_sc.shape, jnp.float32)

  @pl.when(j * bk < (i + 1) * bq)
  def _():
    p_TS = tile_probs(q_ref[...], k_ref[...], lse_ref[...], segq_ref[...], segk_ref[...], i * bq,
                      j * bk, scale)
    carry_1S = carry_sc[key, :]
    # Inclusive demand of key j at row r: rows above this tile (carry) plus rows <= r here.
    share_TS = p_TS / (carry_1S + dot(tri(bq, upper=False), p_TS) + p_TS + eps)
    s_sc[...] += share_TS.sum(axis=1, keepdims=True)
    v_SD = v_ref[...]
    # share ∈ [0, 1]: safe as a 16-bit MXU operand, like flash attention's p.
    n_sc[...] += dot(share_TS.astype(v_SD.dtype), v_SD)
    carry_sc[key, :] = carry_1S + p_TS.sum(axis=0, keepdims=True)
    if not rt:
      @pl.when(i == pl.num_programs(2) - 1)   # every key block computes in the last row block
      def _():
        keys_ref[:, cols] = carry_sc[key, :]

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    out_ref[...] = n_sc[...] / (s_sc[...] + eps)
    ssum_ref[...] = s_sc[...]


def _forward(q, k, v, seg, scale, eps, bs, interpret, training=True):
  """F1 and F2 on q [B,Hq,T,D], k, v [B,Hkv,T,D]: (out f32, lse, S, ckpt, or without training
  the demand totals [B,Hq,1,T])."""
  B, N, T, D = q.shape
  bq, bk = bs.block_q, bs.block_k
  rt = bs.ckpt_rows // bq if training else 0   # row blocks per checkpoint; 0: the totals
  n_rows, n_keys = T // bq, T // bk
  segq, segk = seg[:, :, None], seg[:, None, :]
  # Key blocks past the diagonal repeat its block: no DMA for skipped tiles.
  q_s, kv_s, segq_s, segk_s, row_s = tile_specs(
      D, N // k.shape[1], bq, bk, lambda i, j: i,
      lambda i, j: jnp.minimum(j, idiv(i * bq + bq - 1, bk)))
  grid = (B, N, n_rows, n_keys)
  lse = tpu_call(
      functools.partial(_f1_kernel, scale=scale, bq=bq, bk=bk), grid,
      [q_s, kv_s, segq_s, segk_s], row_s, f32(B, N, T, 1), [vmem(bq, 1)] * 2,
      ("parallel", "parallel", "parallel", "arbitrary"), interpret, "dilution_tpu_row_stats",
  )(q, k, segq, segk)
  if training:   # a whole checkpoint row per super-block: its block stays put while it runs
    keys_s = pl.BlockSpec((None, None, None, 1, T), lambda b, h, i, j: (b, h, idiv(i, rt), 0, 0))
    keys = f32(B, N, -(-n_rows // rt), 1, T)
  else:          # the totals' row stays put for the whole (batch, head)
    keys_s = pl.BlockSpec((None, None, 1, T), lambda b, h, i, j: (b, h, 0, 0))
    keys = f32(B, N, 1, T)
  out, ssum, keys = tpu_call(
      functools.partial(_f2_kernel, scale=scale, eps=eps, bq=bq, bk=bk, rt=rt), grid,
      [q_s, kv_s, kv_s, segq_s, segk_s, row_s], [q_s, row_s, keys_s],
      [f32(B, N, T, D), f32(B, N, T, 1), keys],
      [vmem(n_keys, bk), vmem(bq, D), vmem(bq, 1)],
      ("parallel", "parallel", "arbitrary", "arbitrary"), interpret, "dilution_tpu_demand",
  )(q, k, v, segq, segk, lse)
  return out, lse, ssum, keys


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
  dq, dk, dv = backward(q, k, v, seg, do.astype(q.dtype), lse, ssum, dbar, ckpt, scale, eps,
                        bs, interpret)
  # GQA: a kv head's gradient is the sum over its query-head group.
  dk = dk.reshape(B, K, N // K, T, D).sum(2)
  dv = dv.reshape(B, K, N // K, T, D).sum(2)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_core.defvjp(_core_fwd, _core_bwd)


def _prepare(q, k, v, scale, segment_ids, block_sizes, interpret):
  """Validated, padded, head-major (q, k, v, seg, block sizes)."""
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
  return _to_heads(qp), _to_heads(kp), _to_heads(vp), segp, bs


def _to_heads(x):
  return x.transpose(0, 2, 1, 3)


@functools.partial(jax.jit, static_argnames=("scale", "eps", "block_sizes", "interpret"))
def dilution_attention(q, k, v, *, scale, eps, segment_ids=None, block_sizes=None,
                       interpret=False):
  """Causal dilution attention with an exact custom VJP, as `api.dilution_attention`:
  q [B,T,Hq,D], k, v [B,T,Hkv,D] -> [B,T,Hq,D] in q.dtype; scale, eps static floats;
  block_sizes None: `TpuBlockSizes()`; interpret: TPU interpret mode (CPU)."""
  qh, kh, vh, seg, bs = _prepare(q, k, v, scale, segment_ids, block_sizes, interpret)
  out = _core(qh, kh, vh, seg, float(scale), float(eps), bs, interpret)
  return _to_heads(out)[:, :q.shape[1]]


@functools.partial(jax.jit, static_argnames=("scale", "eps", "block_sizes", "interpret"))
def dilution_prefill(q, k, v, *, scale, eps, block_sizes=None, interpret=False):
  """Forward-only over a prompt, as `api.dilution_prefill`: (out [B,T,Hq,D] in q.dtype,
  demand f32 [B,Hq,T] = Σ_i p_ij), F1 and F2 without checkpoints."""
  T = q.shape[1]
  qh, kh, vh, seg, bs = _prepare(q, k, v, scale, None, block_sizes, interpret)
  out, _, _, total = _forward(qh, kh, vh, seg, float(scale), float(eps), bs, interpret,
                              training=False)
  return _to_heads(out.astype(q.dtype))[:, :T], total[:, :, 0, :T]
