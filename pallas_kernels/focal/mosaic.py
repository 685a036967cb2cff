"""Hopper flash-attention forward with a per-query temperature (Pallas Mosaic GPU, FA3 §3.1-3.2).

Grid (Hq, T / (2·block_q), B), 3 warpgroups per CTA. wg 0, 1 compute block_q rows each: S = q·kᵀ,
x = S·scale·log2(e), online softmax, acc += p·v (p 16-bit from registers); carries acc
[block_q, D] f32, m, l [block_q] f32 (base 2); a schedule barrier ping-pongs the two. wg 2 is the
TMA producer of a K/V ring of `max_concurrent_steps` slots (K carries its segment ids). Causal:
blocks below the diagonal run unmasked, blocks above are never loaded; q tiles run last-first.
SMEM: q/out 2·block_q·D·2 B + K, V rings 2·stages·block_kv·D·2 B + rows (< 227 KiB).
Outputs out [B, T, Hq, D], lse [B, Hq, T] f32 base 2 (optionally out's rounding residual).
Backward: `mosaic_bwd` (two kernels) or `mosaic_bwd_fused` (`BlockSizes.fused_backward`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import mosaic_common as mc
from pallas_kernels.focal import mosaic_bwd
from pallas_kernels.focal import mosaic_bwd_fused
from pallas_kernels.focal import reference
from pallas_kernels.focal.mosaic_blocks import BlockSizes

LOG2E = math.log2(math.e)
# Finite start for the running max: a fully masked first block gives 0, not nan.
MASK_VALUE = reference.MASK_VALUE
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_HEAD_DIMS = (64, 128)
_COMPUTE_WGS = 2
_WGMMA = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)  # a [block_q] vector aligned with the rows of a WGMMA tile
_COL = plgpu.Layout.WGMMA.reduce(0)  # a [block_kv] vector aligned with its columns


def supported(q, k, v, segment_ids, causal, *, blocks: BlockSizes | None = None) -> str | None:
  """None if this kernel handles the call, else why not (shapes and dtypes only)."""
  del causal  # both handled; causal with T != S means s <= t, as in reference.attention
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    return f"q, k, v must be rank 4; got shapes {q.shape}, {k.shape}, {v.shape}"
  B, T, N, D = q.shape
  S, K = k.shape[1], k.shape[2]
  if tuple(k.shape) != tuple(v.shape) or k.shape[0] != B or k.shape[3] != D:
    return f"k and v must both be [B={B}, S, Hkv, D={D}]; got {k.shape}, {v.shape}"
  if K == 0 or N % K:
    return f"query heads Hq={N} must be a multiple of kv heads Hkv={K}"
  dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
  if len(dtypes) != 1 or jnp.dtype(q.dtype) not in _DTYPES:
    return (f"q, k, v must share one dtype among bfloat16/float16; got {q.dtype}, {k.dtype}, "
            f"{v.dtype}")
  if D not in _HEAD_DIMS:
    return f"head dim D={D} must be one of {_HEAD_DIMS}"
  if segment_ids is not None:
    if S != T:
      return f"segment_ids need T == S (self-attention); got T={T}, S={S}"
    if tuple(segment_ids.shape) != (B, T) or jnp.dtype(segment_ids.dtype) != jnp.int32:
      return (f"segment_ids must be int32 [B, T] = {(B, T)}; got {segment_ids.dtype} "
              f"{tuple(segment_ids.shape)}")
  blocks = blocks or BlockSizes.default(D, q.dtype)
  rows = _COMPUTE_WGS * blocks.block_q
  if T % rows:
    return f"T={T} must be a multiple of 2·block_q={rows} (two compute warpgroups per CTA)"
  if S % blocks.block_kv:
    return f"S={S} must be a multiple of block_kv={blocks.block_kv}"
  return None


def _kernel(q_ref, k_ref, v_ref, s_ref, out_ref, lse_ref, qo_smem2, k_smem, v_smem, rows_smem2,
            q_barriers, s_barriers, k_barriers, v_barriers, k_consumed, v_consumed, schedule,
            *, seg, lo_ref, causal, group, block_q, block_kv, n_kv, n_q_tiles, stages, interpret):
  b = lax.axis_index("batch")
  h = lax.axis_index("heads")
  # Causal: the last q tiles see the most keys; starting them first shortens the tail.
  tile = lax.axis_index("q_seq")
  if causal:
    tile = n_q_tiles - 1 - tile
  wg = lax.axis_index("wg")
  rows = _COMPUTE_WGS * block_q

  def kv_blocks_until(q_end):
    """Number of kv blocks holding a key visible to some query < q_end."""
    if not causal:
      return n_kv
    return jnp.minimum(lax.div(q_end + (block_kv - 1), block_kv), n_kv)

  # Blocks the producer loads: what warpgroup 1 (the later rows) needs.
  max_steps = kv_blocks_until((tile + 1) * rows)

  def slot_of(step):
    return lax.rem(step, stages)

  def schedule_barrier():
    plgpu.barrier_arrive(schedule)
    plgpu.barrier_wait(schedule)

  # seg: None or (ids [B, T] GMEM, per-wg q ids, K-ring ids); ids ride the scale / K barriers.
  seg_ref, segq_smem2, segk_smem = seg or (None, None, None)

  @pl.when(wg < _COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(mc.COMPUTE_REGISTERS, action="increase")
    qo_smem = qo_smem2.at[wg]
    rows_smem = rows_smem2.at[wg]
    q_start = tile * rows + wg * block_q
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_start, block_q), h], qo_smem, q_barriers.at[wg])
    plgpu.copy_gmem_to_smem(s_ref.at[b, h, pl.ds(q_start, block_q)], rows_smem,
                            s_barriers.at[wg])
    if seg:
      plgpu.copy_gmem_to_smem(seg_ref.at[b, pl.ds(q_start, block_q)], segq_smem2.at[wg],
                              s_barriers.at[wg])
    kv_steps = kv_blocks_until(q_start + block_q)
    # Blocks entirely at or below the first query row need no mask.
    full_steps = jnp.minimum(lax.div(q_start, block_kv), kv_steps) if causal else n_kv
    plgpu.barrier_wait(s_barriers.at[wg])
    c_Q = mc.load(rows_smem, layout=_ROW, interpret=interpret) * LOG2E
    if seg:
      segq_Q = mc.load(segq_smem2.at[wg], layout=_ROW, interpret=interpret)
    plgpu.barrier_wait(q_barriers.at[wg])

    acc_QD = mc.layout_cast(jnp.zeros(qo_smem.shape, jnp.float32), _WGMMA, interpret=interpret)
    m_Q = mc.layout_cast(jnp.full((block_q,), MASK_VALUE, jnp.float32), _ROW, interpret=interpret)
    l_Q = mc.layout_cast(jnp.zeros((block_q,), jnp.float32), _ROW, interpret=interpret)

    @pl.when(kv_steps > 0)
    def _():
      plgpu.barrier_wait(k_barriers.at[0])

    # Ping-pong: warpgroup 1 starts one schedule phase behind warpgroup 0 (FA3 §3.2).
    pl.when(wg == 1)(schedule_barrier)

    def step(j, carry, *, masked):
      acc_QD, m_Q, l_Q = carry
      slot = slot_of(j)
      if seg:  # read before the K-slot release lets the producer refill it
        segk_K = mc.load(segk_smem.at[slot], layout=_COL, interpret=interpret)
      s_QK = mc.mma(qo_smem, k_smem.at[slot], transpose_b=True, during=schedule_barrier,
                    interpret=interpret)
      plgpu.barrier_arrive(k_consumed.at[slot])
      x_QK = s_QK * lax.broadcast_in_dim(c_Q, s_QK.shape, [0])
      if masked:
        t_QK = mc.iota(jnp.int32, s_QK.shape, 0, _WGMMA, interpret=interpret) + q_start
        s_idx_QK = mc.iota(jnp.int32, s_QK.shape, 1, _WGMMA, interpret=interpret) + j * block_kv
        x_QK = jnp.where(s_idx_QK <= t_QK, x_QK, -jnp.inf)
      if seg:
        same_QK = (lax.broadcast_in_dim(segq_Q, s_QK.shape, [0])
                   == lax.broadcast_in_dim(segk_K, s_QK.shape, [1]))
        x_QK = jnp.where(same_QK, x_QK, -jnp.inf)
      m_new = jnp.maximum(m_Q, x_QK.max(axis=1))
      alpha_Q = jnp.exp2(m_Q - m_new)
      p_QK = jnp.exp2(x_QK - lax.broadcast_in_dim(m_new, x_QK.shape, [0]))
      acc_QD = acc_QD * lax.broadcast_in_dim(alpha_Q, acc_QD.shape, [0])
      # p is rounded to the input dtype for the tensor cores (FA2/FA3 do the same).
      p16_QK = p_QK.astype(qo_smem.dtype)
      l_Q = l_Q * alpha_Q + p_QK.sum(axis=1)
      # The fence keeps the softmax ahead of the barrier below.
      acc_QD, l_Q, m_new, p16_QK = lax.optimization_barrier((acc_QD, l_Q, m_new, p16_QK))
      plgpu.barrier_arrive(schedule)  # softmax done: the other warpgroup may issue its matmuls
      plgpu.barrier_wait(v_barriers.at[slot])
      plgpu.barrier_wait(schedule)  # and this one waits for the tensor cores to be free

      def wait_next_k():  # overlapped with the p·v wgmma
        @pl.when(j + 1 < kv_steps)
        def _():
          plgpu.barrier_wait(k_barriers.at[slot_of(j + 1)])

      acc_QD = mc.mma(p16_QK, v_smem.at[slot], acc=acc_QD, during=wait_next_k,
                      interpret=interpret)
      plgpu.barrier_arrive(v_consumed.at[slot])
      return acc_QD, m_new, l_Q

    carry = lax.fori_loop(0, full_steps, functools.partial(step, masked=False),
                          (acc_QD, m_Q, l_Q))
    if causal:
      carry = lax.fori_loop(full_steps, kv_steps, functools.partial(step, masked=True), carry)

      # Warpgroup 0 waits for and releases warpgroup 1's extra blocks, keeping phases in step.
      @pl.loop(kv_steps, max_steps)
      def _(j):
        slot = slot_of(j)
        plgpu.barrier_wait(k_barriers.at[slot])
        plgpu.barrier_arrive(k_consumed.at[slot])
        plgpu.barrier_wait(v_barriers.at[slot])
        plgpu.barrier_arrive(v_consumed.at[slot])
        schedule_barrier()
        schedule_barrier()

    acc_QD, m_Q, l_Q = carry
    pl.when(wg == 0)(schedule_barrier)  # balances warpgroup 1's extra phase at the start

    # A row with no visible key (not produced by the contract's masks) gives out 0, lse = MASK.
    l_Q = jnp.where(l_Q == 0.0, 1.0, l_Q)
    out_QD = acc_QD * lax.broadcast_in_dim(1.0 / l_Q, acc_QD.shape, [0])
    out16_QD = out_QD.astype(qo_smem.dtype)
    qo_smem[...] = out16_QD
    # 0.10.2's Mosaic GPU has no log2 lowering: log2(l) = ln(l) · log2(e).
    rows_smem[...] = m_Q + jnp.log(l_Q) * LOG2E
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, pl.ds(q_start, block_q), h])
    plgpu.copy_smem_to_gmem(rows_smem, lse_ref.at[b, h, pl.ds(q_start, block_q)])
    if lo_ref is not None:  # the rounding residual, through the same tile once it was read
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      qo_smem[...] = (out_QD - out16_QD.astype(jnp.float32)).astype(qo_smem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(qo_smem, lo_ref.at[b, pl.ds(q_start, block_q), h])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _COMPUTE_WGS)
  def _producer():
    plgpu.set_max_registers(mc.PRODUCER_REGISTERS, action="decrease")
    kv_h = lax.div(h, group)

    def load(src_ref, dst_smem, barriers, step, slot, ids=False):
      src = src_ref.at[b, pl.ds(step * block_kv, block_kv), kv_h]
      plgpu.copy_gmem_to_smem(src, dst_smem.at[slot], barriers.at[slot])
      if seg and ids:  # the block's key ids ride with K
        plgpu.copy_gmem_to_smem(seg_ref.at[b, pl.ds(step * block_kv, block_kv)],
                                segk_smem.at[slot], barriers.at[slot])

    for i in range(stages):
      @pl.when(i < max_steps)
      def _():
        load(k_ref, k_smem, k_barriers, i, i, ids=True)
        load(v_ref, v_smem, v_barriers, i, i)

    @pl.loop(0, jnp.maximum(max_steps - stages, 0))
    def _(j):
      slot = slot_of(j)
      # K is released after q·kᵀ, V only after p·v: refill K first so it lands sooner.
      plgpu.barrier_wait(k_consumed.at[slot])
      load(k_ref, k_smem, k_barriers, j + stages, slot, ids=True)
      plgpu.barrier_wait(v_consumed.at[slot])
      load(v_ref, v_smem, v_barriers, j + stages, slot)

    # Drain: observe the last releases too, so every barrier phase is consumed before exit.
    @pl.loop(jnp.maximum(max_steps - stages, 0), max_steps)
    def _(j):
      plgpu.barrier_wait(k_consumed.at[slot_of(j)])
      plgpu.barrier_wait(v_consumed.at[slot_of(j)])


def forward(q_BTHD, k_BSKD, v_BSKD, s_BNT, *, causal: bool, blocks: BlockSizes | None,
            interpret: bool, segment_ids=None, out_lo: bool = False):
  """(out, lse [B, Hq, T] f32 base 2[, lo]). out_lo adds out's rounding residual in q.dtype
  (dilution's F1 needs the float32 output). Raises ValueError on calls `supported` rejects."""
  blocks = blocks or BlockSizes.default(q_BTHD.shape[-1], q_BTHD.dtype)
  why = supported(q_BTHD, k_BSKD, v_BSKD, segment_ids, causal, blocks=blocks)
  if why:
    raise ValueError(f"mosaic.forward: {why}")
  B, T, N, D = q_BTHD.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  if tuple(s_BNT.shape) != (B, N, T) or s_BNT.dtype != jnp.float32:
    raise ValueError(f"s_BNT must be float32 [B, Hq, T] = {(B, N, T)}; got {s_BNT.dtype} "
                     f"{s_BNT.shape}")
  bq, bkv = blocks.block_q, blocks.block_kv
  n_kv = S // bkv
  n_q_tiles = T // (_COMPUTE_WGS * bq)
  # More slots than kv blocks would only load blocks nobody reads.
  stages = min(blocks.max_concurrent_steps, n_kv)
  dtype = q_BTHD.dtype
  # (8, 64) tiles with a 128-byte swizzle: the wgmma operand layout for 16-bit types.
  transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  segments = segment_ids is not None
  # With segments the ids are one more TMA copy on the scale and K barriers.
  arrivals = 2 if segments else 1
  scratch = [
      plgpu.SMEM((_COMPUTE_WGS, bq, D), dtype, transforms=transforms),  # q, then out
      plgpu.SMEM((stages, bkv, D), dtype, transforms=transforms),  # K ring
      plgpu.SMEM((stages, bkv, D), dtype, transforms=transforms),  # V ring
      plgpu.SMEM((_COMPUTE_WGS, bq), jnp.float32),  # scale row in, lse row out
      plgpu.Barrier(num_barriers=_COMPUTE_WGS),  # q landed
      plgpu.Barrier(num_arrivals=arrivals, num_barriers=_COMPUTE_WGS),  # scale (+ q ids) landed
      plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages),  # K (+ key ids) slot landed
      plgpu.Barrier(num_barriers=stages),  # V slot landed
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),  # K slot released
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),  # V slot released
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS),  # ping-pong schedule
  ]
  operands = (q_BTHD, k_BSKD, v_BSKD, s_BNT)
  lo_at = len(operands) + 2   # out_lo's ref: after the operands (less the ids) and out, lse
  if segments:
    operands += (segment_ids,)
    scratch += [plgpu.SMEM((_COMPUTE_WGS, bq), jnp.int32),  # q ids per compute warpgroup
                plgpu.SMEM((stages, bkv), jnp.int32)]  # key ids ring, beside K
  kernel = mc.with_segments(mc.with_optional_ref(functools.partial(
      _kernel, causal=causal, group=N // K, block_q=bq, block_kv=bkv, n_kv=n_kv,
      n_q_tiles=n_q_tiles, stages=stages, interpret=interpret),
      "lo_ref", at=lo_at, present=out_lo), n_in=len(operands), n_seg_scratch=2, segments=segments)
  out_types = (jax.ShapeDtypeStruct(q_BTHD.shape, dtype),
               jax.ShapeDtypeStruct((B, N, T), jnp.float32))
  out_types += (jax.ShapeDtypeStruct(q_BTHD.shape, dtype),) if out_lo else ()
  return plgpu.kernel(
      kernel, out_type=out_types, scratch_types=scratch,
      grid=(N, n_q_tiles, B), grid_names=("heads", "q_seq", "batch"),
      num_threads=_COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=mc.interpret_params() if interpret else None,
  )(*operands)


@dataclasses.dataclass(frozen=True)
class _Static:
  """Static arguments of one call (hashable: custom_vjp nondiff arg and jit key)."""
  causal: bool
  blocks: BlockSizes
  interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attend(q, k, v, s_BNT, seg_BT, st: _Static):
  return forward(q, k, v, s_BNT, causal=st.causal, blocks=st.blocks, interpret=st.interpret,
                 segment_ids=seg_BT)[0]


def _attend_fwd(q, k, v, s_BNT, seg_BT, st: _Static):
  out, lse_BNT = forward(q, k, v, s_BNT, causal=st.causal, blocks=st.blocks,
                         interpret=st.interpret, segment_ids=seg_BT)
  return out, (q, k, v, s_BNT, seg_BT, out, lse_BNT)


def _attend_bwd(st: _Static, res, do):
  q, k, v, s_BNT, seg_BT, out, lse_BNT = res
  backward = mosaic_bwd_fused.backward if st.blocks.fused_backward else mosaic_bwd.backward
  grads = backward(q, k, v, s_BNT, out, lse_BNT, do, causal=st.causal, blocks=st.blocks,
                   interpret=st.interpret, seg_BT=seg_BT)
  return (*grads, None)  # integer segment ids: no cotangent


_attend.defvjp(_attend_fwd, _attend_bwd)


@functools.partial(jax.jit, static_argnames=("causal", "interpret", "block_sizes"))
def focal_attention(q, k, v, *, scale, causal: bool = True, segment_ids=None,
                    interpret: bool = False, block_sizes: BlockSizes | None = None):
  """As `api.focal_attention` with 16-bit inputs; ValueError for calls `supported` rejects."""
  blocks = block_sizes or BlockSizes.default(q.shape[-1], q.dtype)
  why = supported(q, k, v, segment_ids, causal, blocks=blocks)
  if why:
    raise ValueError(f"mosaic.focal_attention: {why}")
  B, T, N, _ = q.shape
  s_BNT = reference.scale_BNT(scale, B, N, T)  # broadcast's transpose sums d_scale back
  return _attend(q, k, v, s_BNT, segment_ids, _Static(causal, blocks, interpret))
