"""Two-kernel backward of the Hopper (Mosaic GPU) focal attention: dq, dk, dv and d_scale.

p = exp2(LOG2E·s_t·r_ts − lse_t), dP = dO·vᵀ, delta_t = Σ dO_t·O_t, dx = p ⊙ (dP − delta);
dv = pᵀ·dO, dk = (s ⊙ dx)ᵀ·q, dq = s ⊙ (dx·k), d_scale_t = Σ_s dx_ts r_ts (from f32 r).
Each CTA: W = 2 compute warpgroups + 1 TMA producer; deterministic, no atomics.
  dk/dv `mosaic_dkv`, grid (Hkv, S / (W·block_kv_dkv), B): k, v resident in SMEM, dk, dv f32 in
        registers; q, dO and rows streamed for the G query heads. SMEM W·2·bkv·D·2 + C·(2·bq·D·2).
  dq    `_dq_kernel`, grid (Hq, T / (W·block_q_dq), B): q, dO resident, k, v streamed up to the
        diagonal; carries dq [bq, D] and d_scale [bq] f32. SMEM W·2·bq·D·2 + C·2·bkv·D·2.
Contract (`check`): one 16-bit dtype, D in {64, 128}, tile-aligned T and S.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import mosaic_common as mc
from pallas_kernels.focal.mosaic_dkv import LN2, LOG2E, W, dkv_call

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_BLOCK_FIELDS = ("block_q_dq", "block_kv_dq", "block_q_dkv", "block_kv_dkv")


def check(q, k, v, s_BNT, lse_BNT, do, blocks, seg_BT=None):
  B, T, N, D = q.shape
  S, K = k.shape[1], k.shape[2]
  if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or N % K:
    raise ValueError(f"q [B,T,Hq,D] and k, v [B,S,Hkv,D] with Hq % Hkv == 0 expected; got q "
                     f"{q.shape}, k {k.shape}, v {v.shape}")
  if not (q.dtype == k.dtype == v.dtype) or jnp.dtype(q.dtype) not in _DTYPES:
    raise ValueError(f"q, k, v must share one dtype among bfloat16/float16; got "
                     f"{q.dtype}, {k.dtype}, {v.dtype}")
  if D not in (64, 128):
    raise ValueError(f"head dim D={D} unsupported: the Mosaic GPU backward handles 64 and 128")
  for name, x in (("s_BNT", s_BNT), ("lse_BNT", lse_BNT)):
    if x.shape != (B, N, T) or x.dtype != jnp.float32:
      raise ValueError(f"{name} must be float32 [B, Hq, T] = {(B, N, T)}; got {x.dtype} {x.shape}")
  if do.shape != q.shape:
    raise ValueError(f"do must have q's shape {q.shape}; got {do.shape}")
  if seg_BT is not None and (seg_BT.shape != (B, T) or seg_BT.dtype != jnp.int32 or S != T):
    raise ValueError(f"seg_BT must be int32 [B, T] = {(B, T)} with T == S={S}; got "
                     f"{seg_BT.dtype} {seg_BT.shape}")
  sizes = {f: getattr(blocks, f) for f in _BLOCK_FIELDS}
  for f, b in sizes.items():
    if b % 64 or b <= 0:
      raise ValueError(f"blocks.{f}={b} must be a positive multiple of 64 (wgmma tile rows)")
  for f, length, mult in (("block_q_dq", T, W), ("block_q_dkv", T, 1),
                          ("block_kv_dkv", S, W), ("block_kv_dq", S, 1)):
    if length % (mult * sizes[f]):
      raise ValueError(f"sequence length {length} must be a multiple of "
                       f"{'2·' if mult > 1 else ''}blocks.{f}={sizes[f]} (no padding)")
  if blocks.max_concurrent_steps < 1:
    raise ValueError(f"blocks.max_concurrent_steps={blocks.max_concurrent_steps} must be >= 1")


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, c_ref, lse_ref, delta_ref, dq_ref, ds_ref,
               q_s, do_s, c_s, lse_s, delta_s, ds_s, k_s, v_s, res_bar, kv_bar, kv_free,
               *, seg, causal, bq, bkv, n_kv, n_cta, group, steps, interpret):
  b, n, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
  cta = lax.axis_index("q_seq")
  if causal:  # the last q tiles see the most keys: start them first
    cta = n_cta - 1 - cta
  kv_head = lax.div(n, jnp.int32(group))
  cta_q0 = cta * (W * bq)
  # kv blocks this CTA streams: up to the diagonal of its last query.
  n_kv_cta = jnp.minimum(pl.cdiv(cta_q0 + W * bq, jnp.int32(bkv)), n_kv) if causal else n_kv
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout = wgmma_layout.reduce(1)
  # seg: None or (ids [B, T] GMEM, resident q ids [W, bq], ring of key ids [steps, bkv]).
  seg_ref, segq_s, segk_s = seg or (None, None, None)

  @pl.when(wg < W)
  def _compute():
    plgpu.set_max_registers(mc.COMPUTE_REGISTERS, action="increase")
    q0 = cta_q0 + wg * bq
    rows = (b, pl.ds(q0, bq), n)
    vec = (b, n, pl.ds(q0, bq))
    bar = res_bar.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_s.at[wg], bar)
    plgpu.copy_gmem_to_smem(do_ref.at[rows], do_s.at[wg], bar)
    for src, dst in ((c_ref, c_s), (lse_ref, lse_s), (delta_ref, delta_s)):
      plgpu.copy_gmem_to_smem(src.at[vec], dst.at[wg], bar)
    if seg:
      plgpu.copy_gmem_to_smem(seg_ref.at[b, pl.ds(q0, bq)], segq_s.at[wg], bar)
    plgpu.barrier_wait(bar)
    if seg:
      segq_Q = mc.load(segq_s.at[wg], layout=row_layout, interpret=interpret)
    c_Q = mc.load(c_s.at[wg], layout=row_layout, interpret=interpret)
    lse_Q = mc.load(lse_s.at[wg], layout=row_layout, interpret=interpret)
    delta_Q = mc.load(delta_s.at[wg], layout=row_layout, interpret=interpret)
    shape_QK = (bq, bkv)

    def step(j, carry, *, masked):
      dq_QD, ds_Q = carry
      slot = lax.rem(j, steps)
      plgpu.barrier_wait(kv_bar.at[slot])
      # Both logits-sized products at once: one wgmma wait per step instead of two.
      r_QK, dp_QK = mc.mma_pair((q_s.at[wg], k_s.at[slot], None, True),
                                (do_s.at[wg], v_s.at[slot], None, True), interpret=interpret)
      x_QK = r_QK * mc.bcast(c_Q, shape_QK, 0) - mc.bcast(lse_Q, shape_QK, 0)
      if masked:
        t = mc.iota(jnp.int32, shape_QK, 0, wgmma_layout, interpret=interpret) + q0
        s = mc.iota(jnp.int32, shape_QK, 1, wgmma_layout, interpret=interpret) + j * bkv
        x_QK = jnp.where(s <= t, x_QK, -jnp.inf)
      if seg:
        segk_K = mc.load(segk_s.at[slot], layout=wgmma_layout.reduce(0), interpret=interpret)
        same_QK = mc.bcast(segq_Q, shape_QK, 0) == mc.bcast(segk_K, shape_QK, 1)
        x_QK = jnp.where(same_QK, x_QK, -jnp.inf)
      p_QK = jnp.exp2(x_QK)
      dx_QK = p_QK * (dp_QK - mc.bcast(delta_Q, shape_QK, 0))
      ds_Q = ds_Q + jnp.sum(dx_QK * r_QK, axis=1)
      dq_QD = mc.mma(dx_QK.astype(q_s.dtype), k_s.at[slot], acc=dq_QD, interpret=interpret)
      plgpu.barrier_arrive(kv_free.at[slot])
      return dq_QD, ds_Q

    def skip(j, carry):
      # Another warpgroup of this CTA still needs the slot; keep this one's barrier phase in step.
      slot = lax.rem(j, steps)
      plgpu.barrier_wait(kv_bar.at[slot])
      plgpu.barrier_arrive(kv_free.at[slot])
      return carry

    carry = (mc.layout_cast(jnp.zeros((bq, q_s.shape[-1]), jnp.float32), wgmma_layout,
                            interpret=interpret),
             mc.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout, interpret=interpret))
    unmasked = functools.partial(step, masked=False)
    if causal:
      j_full = lax.div(q0, jnp.int32(bkv))  # blocks wholly at or below the diagonal
      j_end = pl.cdiv(q0 + bq, jnp.int32(bkv))
      carry = lax.fori_loop(0, j_full, unmasked, carry)
      carry = lax.fori_loop(j_full, j_end, functools.partial(step, masked=True), carry)
      carry = lax.fori_loop(j_end, n_kv_cta, skip, carry)
    else:
      carry = lax.fori_loop(0, n_kv, unmasked, carry)
    dq_QD, ds_Q = carry
    # dq_t = s_t Σ_s dx_ts k_s: the temperature is applied once per row here (s = c·ln 2).
    dq_QD = dq_QD * mc.bcast(c_Q * LN2, dq_QD.shape, 0)
    q_s.at[wg][...] = dq_QD.astype(q_s.dtype)  # q's tile is free: every wgmma reading it is done
    ds_s.at[wg][...] = ds_Q
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s.at[wg], dq_ref.at[rows])
    plgpu.copy_smem_to_gmem(ds_s.at[wg], ds_ref.at[vec])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == W)
  def _producer():
    plgpu.set_max_registers(mc.PRODUCER_REGISTERS, action="decrease")

    def issue(j):
      slot = lax.rem(j, steps)
      src = (b, pl.ds(j * bkv, bkv), kv_head)
      plgpu.copy_gmem_to_smem(k_ref.at[src], k_s.at[slot], kv_bar.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[src], v_s.at[slot], kv_bar.at[slot])
      if seg:
        plgpu.copy_gmem_to_smem(seg_ref.at[b, pl.ds(j * bkv, bkv)], segk_s.at[slot],
                                kv_bar.at[slot])

    for j in range(steps):  # fill the ring
      pl.when(j < n_kv_cta)(functools.partial(issue, jnp.int32(j)))

    @pl.loop(steps, n_kv_cta)
    def _(j):
      plgpu.barrier_wait(kv_free.at[lax.rem(j, steps)])  # both warpgroups released step j - C
      issue(j)

    mc.drain(kv_free, n_kv_cta, steps)


def backward_rows(s_BNT, out, do):
  """Per-query f32 rows [B, Hq, T]: c = LOG2E·s and delta = rowsum(dO·O)."""
  delta_BNT = jnp.einsum("BTND,BTND->BNT", out.astype(jnp.float32), do.astype(jnp.float32))
  return s_BNT * LOG2E, delta_BNT


def dq_call(q, k, v, do, c_BNT, lse_BNT, delta_BNT, *, causal: bool, blocks, interpret,
            seg_BT=None):
  """The dq kernel: (dq [B,T,Hq,D] q.dtype, d_scale [B,Hq,T] float32)."""
  B, T, N, D = q.shape
  S, K = k.shape[1], k.shape[2]
  flag, params = mc.launch_params(interpret)
  bq, bkv = blocks.block_q_dq, blocks.block_kv_dq
  n_kv = S // bkv
  steps = max(1, min(blocks.max_concurrent_steps, n_kv))  # more slots than blocks load nothing
  n_cta = T // (W * bq)
  segments = seg_BT is not None
  operands = (q, k, v, do, c_BNT, lse_BNT, delta_BNT) + ((seg_BT,) if segments else ())
  seg_scratch = [plgpu.SMEM((W, bq), jnp.int32),              # resident q ids
                 plgpu.SMEM((steps, bkv), jnp.int32)] if segments else []  # key ids ring
  return plgpu.kernel(
      mc.with_segments(
          functools.partial(_dq_kernel, causal=causal, bq=bq, bkv=bkv, n_kv=n_kv, n_cta=n_cta,
                            group=N // K, steps=steps, interpret=flag),
          n_in=len(operands), n_seg_scratch=2, segments=segments),
      out_type=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((B, N, T), jnp.float32)],
      scratch_types=[
          mc.tile_smem((W, bq, D), q.dtype), mc.tile_smem((W, bq, D), q.dtype),  # q (then dq), dO
          *[plgpu.SMEM((W, bq), jnp.float32) for _ in range(4)],          # c, lse, delta, ds
          mc.tile_smem((steps, bkv, D), k.dtype), mc.tile_smem((steps, bkv, D), k.dtype),  # k, v
          # One arrival per TMA copy; segment ids add one copy to each.
          plgpu.Barrier(num_arrivals=5 + segments, num_barriers=W),   # resident tiles landed
          plgpu.Barrier(num_arrivals=2 + segments, num_barriers=steps),  # k, v slot landed
          plgpu.Barrier(num_arrivals=W, num_barriers=steps),      # slot released by both wgs
          *seg_scratch,
      ],
      grid=(N, n_cta, B), grid_names=("heads", "q_seq", "batch"),
      num_threads=W + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=params,
      kernel_name="focal_mgpu_dq")(*operands)


def backward(q, k, v, s_BNT, out, lse_BNT, do, *, causal: bool, blocks, interpret, seg_BT=None):
  """(dq [B,T,Hq,D], dk, dv [B,S,Hkv,D], d_scale [B,Hq,T] f32). lse_BNT: the forward's base-2
  lse; blocks: mosaic.BlockSizes."""
  check(q, k, v, s_BNT, lse_BNT, do, blocks, seg_BT)
  c_BNT, delta_BNT = backward_rows(s_BNT, out, do)
  args = (q, k, v, do.astype(q.dtype), c_BNT, lse_BNT, delta_BNT)
  kw = dict(causal=causal, blocks=blocks, interpret=interpret, seg_BT=seg_BT)
  dq, ds_BNT = dq_call(*args, **kw)
  dk, dv = dkv_call(*args, **kw)
  return dq, dk, dv, ds_BNT
