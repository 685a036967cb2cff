"""The dk/dv kernel of the Hopper (Mosaic GPU) focal attention backward, and the producer that
streams query-side tiles to it (also used by focal_mgpu_bwd_fused).

Grid (Hkv, S / (W·block_kv_dkv), B); see focal_mgpu_bwd's docstring for the math, the warpgroup
layout, the shared-memory budget and the segment-id handling. Split from focal_mgpu_bwd.py to keep
files short; `focal_mgpu_bwd.backward` calls `dkv_call`.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.focal import mosaic_bwd as fb
from pallas_kernels import mosaic_common as mc

W = fb.W
LOG2E, LN2 = fb.LOG2E, fb.LN2
# pylint: disable=protected-access
_tile_smem, _bcast, _drain, _launch_params = (fb._tile_smem, fb._bcast, fb._drain,
                                               fb._launch_params)
schedule_phase, pingpong = fb.schedule_phase, fb.pingpong


def stream_q_rows(gmem, smem, q_bar, q_free, *, b, kv_head, group, i_lo, per_head, bq, steps,
                  seg=None):
  """Producer warpgroup of the key-resident backward passes (this file's dk/dv kernel and
  focal_mgpu_bwd_fused): TMA-streams q, dO and the rows (LOG2E·s, lse, delta) of the `group`
  query heads of kv head `kv_head`, q blocks i_lo .. i_lo + per_head - 1 per head, through a ring
  of `steps` slots. A slot is refilled once both compute warpgroups arrived on its q_free
  barrier. gmem = (q, dO, c, lse, delta) refs; smem = their ring buffers, in the same order.
  seg: None, or (segment ids [B, T] GMEM ref, their [steps, bq] ring): each q block's ids then
  join its slot (one more arrival on q_bar)."""
  q_ref, do_ref, c_ref, lse_ref, delta_ref = gmem
  q_s, do_s, c_s, lse_s, delta_s = smem
  plgpu.set_max_registers(mc.PRODUCER_REGISTERS, action="decrease")
  total = group * per_head

  def issue(st):
    slot = lax.rem(st, steps)
    g, i = lax.div(st, per_head), i_lo + lax.rem(st, per_head)
    n = kv_head * group + g
    rows, vec = (b, pl.ds(i * bq, bq), n), (b, n, pl.ds(i * bq, bq))
    bar = q_bar.at[slot]
    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_s.at[slot], bar)
    plgpu.copy_gmem_to_smem(do_ref.at[rows], do_s.at[slot], bar)
    for src, dst in ((c_ref, c_s), (lse_ref, lse_s), (delta_ref, delta_s)):
      plgpu.copy_gmem_to_smem(src.at[vec], dst.at[slot], bar)
    if seg is not None:
      plgpu.copy_gmem_to_smem(seg[0].at[b, pl.ds(i * bq, bq)], seg[1].at[slot], bar)

  for st in range(steps):
    pl.when(st < total)(functools.partial(issue, jnp.int32(st)))

  @pl.loop(steps, total)
  def _(st):
    plgpu.barrier_wait(q_free.at[lax.rem(st, steps)])  # both warpgroups released step st - steps
    issue(st)

  _drain(q_free, total, steps)


def visit_q_blocks(step, *, causal, group, per_head, steps, k0, bq, bkv, i_lo, q_bar, q_free, D,
                   interpret, skip_above: bool = True, phase=None, wg=None):
  """A compute warpgroup's walk of a key-resident backward pass (this file's dk/dv kernel and
  focal_mgpu_bwd_fused): for each of the `group` query heads, step(t, (dk, dv), g=g, masked=...)
  on q block i_lo + t, starting from float32 zeros [bkv, D] in the WGMMA layout. Causal: q blocks
  wholly above the warpgroup's keys (from k0) only wait for and release their ring slot, so the
  barrier phases stay in step with the other warpgroup; only blocks crossing its diagonal mask.
  skip_above=False runs those blocks as masked steps instead (all-zero probabilities), for a
  kernel whose warpgroups meet at every step (the fused backward's joint dq).

  phase (BlockSizes.pingpong_backward: one phase of the schedule barrier, `schedule_phase`; wg:
  this warpgroup's index): FA3 §3.2's ping-pong, as in focal_mgpu's forward. Every step passes
  two phases (one after issuing its k·qᵀ wgmma, one before issuing the dv / dP pair,
  `dv_and_dx`), skipped blocks too, and warpgroup 1 runs one phase behind warpgroup 0, so one
  warpgroup's elementwise work overlaps the other's matmuls instead of both reaching the tensor
  cores together."""
  def skip(t, carry, *, g):
    slot = lax.rem(g * per_head + t, steps)
    plgpu.barrier_wait(q_bar.at[slot])
    plgpu.barrier_arrive(q_free.at[slot])
    if phase is not None:
      phase()
      phase()
    return carry

  def head(g, carry):
    unmasked = functools.partial(step, g=g, masked=False)
    if not causal:
      return lax.fori_loop(0, per_head, unmasked, carry)
    # q blocks [i_lo, i_vis) lie wholly above this warpgroup's keys, [i_vis, i_full) cross
    # its diagonal, [i_full, n_q) see all of its keys.
    t_vis = (jnp.clip(lax.div(k0, jnp.int32(bq)) - i_lo, 0, per_head) if skip_above
             else jnp.int32(0))
    t_full = jnp.clip(pl.cdiv(k0 + bkv, jnp.int32(bq)) - i_lo, 0, per_head)
    carry = lax.fori_loop(0, t_vis, functools.partial(skip, g=g), carry)
    carry = lax.fori_loop(t_vis, t_full, functools.partial(step, g=g, masked=True), carry)
    return lax.fori_loop(t_full, per_head, unmasked, carry)

  zeros = mc.layout_cast(jnp.zeros((bkv, D), jnp.float32), plgpu.Layout.WGMMA,
                         interpret=interpret)
  if phase is not None:
    pl.when(wg == 1)(phase)  # one phase behind
  carry = lax.fori_loop(0, group, head, (zeros, zeros))
  if phase is not None:
    pl.when(wg == 0)(phase)  # balances warpgroup 1's
  return carry


# BlockSizes.dkv_step: what the dk/dv step keeps live across its wgmma pair (`dv_and_dx`).
DKV_STEPS = ("plain", "lean")


def dv_and_dx(p_KQ, c_Q, dv_KD, *, v_tile, do_tile, c_tile, delta_tile, mode, interpret,
              phase=None):
  """The key-resident step's middle (this file's dk/dv kernel and focal_mgpu_bwd_fused):
  dv += p·dO and dP = v·dOᵀ, issued together and awaited once, then dx = p ⊙ (dP − delta).
  p_KQ: float32 [bkv, bq] in the WGMMA layout; c_Q: the slot's LOG2E·s row (c_tile) in the
  column layout. Returns (dv, dx [bkv, bq] float32, c_Q).

  mode (BlockSizes.dkv_step), which values live across the pair:
    "plain": p (float32 and 16-bit), dP and c_Q.
    "lean": only the 16-bit p and dP. dx is formed from the 16-bit p that the dv wgmma reads
      (widened after it) and c_Q is reloaded from its SMEM slot afterwards; p's extra rounding
      in dx is the 16-bit rounding dx gets anyway before its own wgmma. At D = 128, where dk and
      dv hold 128 of the 240 registers, ptxas then spills 16 bytes in the dk/dv kernel instead of
      100, and 312 in the fused one instead of 440. On the H200 (twenty-seventh session) that
      made the fused backward 5–15% faster at D = 128, but the dk/dv kernel 1–11% slower (17% at
      D = 64): its hot loop has 18% more instructions (the widening, the reload), and this kernel
      is bound by the issue of its elementwise work, not by the spills, which sit mostly outside
      the unmasked loop.
  phase: the ping-pong schedule's phase (`visit_q_blocks`): this warpgroup's elementwise work is
  done before the pair is issued, then it waits for the other warpgroup's matmuls."""
  p16_KQ = p_KQ.astype(do_tile.dtype)
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  if mode == "lean":
    del p_KQ, c_Q  # rebuilt below, after the wgmmas
  if phase is not None:
    # The fence keeps the exp and the cast ahead of the arrival (focal_mgpu's forward does the
    # same with its softmax).
    if mode == "lean":
      p16_KQ = lax.optimization_barrier(p16_KQ)
    else:
      p_KQ, p16_KQ, c_Q = lax.optimization_barrier((p_KQ, p16_KQ, c_Q))
    phase()
  dv_KD, dp_KQ = mc.mma_pair((p16_KQ, do_tile, dv_KD, False), (v_tile, do_tile, None, True),
                             interpret=interpret)
  delta_Q = mc.load(delta_tile, layout=col_layout, interpret=interpret)
  if mode == "lean":
    p_KQ = p16_KQ.astype(jnp.float32)
    c_Q = mc.load(c_tile, layout=col_layout, interpret=interpret)
  dx_KQ = p_KQ * (dp_KQ - _bcast(delta_Q, dp_KQ.shape, 1))
  return dv_KD, dx_KQ, c_Q


def step_mode(blocks) -> str:
  return getattr(blocks, "dkv_step", "plain")  # benchmark/test Blocks may lack the field


def kernel_name(base: str, blocks) -> str:
  """Kernel name with the step mode and schedule, so profiles and PTX dumps tell the variants
  apart."""
  mode = step_mode(blocks)
  return (base + ("" if mode == "plain" else f"_{mode}")
          + ("_pingpong" if pingpong(blocks) else ""))


def write_dk_dv(dk_KD, dv_KD, k_tile, v_tile, dk_out, dv_out):
  """dk/dv leave through the warpgroup's own k/v SMEM tiles (free once its last wgmma that reads
  them was awaited) by TMA; waits for the copies (and any earlier async TMA of this thread)."""
  k_tile[...] = dk_KD.astype(k_tile.dtype)
  v_tile[...] = dv_KD.astype(v_tile.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(k_tile, dk_out)
  plgpu.copy_smem_to_gmem(v_tile, dv_out)
  plgpu.wait_smem_to_gmem(0)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, c_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                k_s, v_s, q_s, do_s, c_s, lse_s, delta_s, res_bar, q_bar, q_free, schedule,
                *, seg, causal, bq, bkv, n_q, group, steps, mode, pingpong_on, interpret):
  b, kv_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
  cta_k0 = lax.axis_index("kv_seq") * (W * bkv)
  # First q block that sees any key of this CTA (causal); per head the CTA visits [i_lo, n_q).
  i_lo = jnp.minimum(lax.div(cta_k0, jnp.int32(bq)), n_q) if causal else jnp.int32(0)
  per_head = n_q - i_lo
  wgmma_layout = plgpu.Layout.WGMMA
  col_layout = wgmma_layout.reduce(0)  # per-query vectors run along axis 1 of [bkv, bq] tiles
  # seg: None or (ids [B, T] GMEM, resident key ids [W, bkv], ring of q ids [steps, bq]).
  seg_ref, segk_s, segq_s = seg or (None, None, None)

  @pl.when(wg < W)
  def _compute():
    plgpu.set_max_registers(mc.COMPUTE_REGISTERS, action="increase")
    k0 = cta_k0 + wg * bkv
    rows = (b, pl.ds(k0, bkv), kv_head)
    bar = res_bar.at[wg]
    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_s.at[wg], bar)
    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_s.at[wg], bar)
    if seg:
      plgpu.copy_gmem_to_smem(seg_ref.at[b, pl.ds(k0, bkv)], segk_s.at[wg], bar)
    plgpu.barrier_wait(bar)
    if seg:
      segk_K = mc.load(segk_s.at[wg], layout=wgmma_layout.reduce(1), interpret=interpret)
    shape_KQ = (bkv, bq)
    phase = functools.partial(schedule_phase, schedule) if pingpong_on else None

    def step(t, carry, *, g, masked):
      dk_KD, dv_KD = carry
      i = i_lo + t
      slot = lax.rem(g * per_head + t, steps)  # the producer's step index of this q block
      plgpu.barrier_wait(q_bar.at[slot])
      r_KQ = mc.mma(k_s.at[wg], q_s.at[slot], transpose_b=True, interpret=interpret,
                    during=phase)
      c_Q = mc.load(c_s.at[slot], layout=col_layout, interpret=interpret)
      lse_Q = mc.load(lse_s.at[slot], layout=col_layout, interpret=interpret)
      x_KQ = r_KQ * _bcast(c_Q, shape_KQ, 1) - _bcast(lse_Q, shape_KQ, 1)
      if masked:
        s = mc.iota(jnp.int32, shape_KQ, 0, wgmma_layout, interpret=interpret) + k0
        tq = mc.iota(jnp.int32, shape_KQ, 1, wgmma_layout, interpret=interpret) + i * bq
        x_KQ = jnp.where(s <= tq, x_KQ, -jnp.inf)
      if seg:
        segq_Q = mc.load(segq_s.at[slot], layout=col_layout, interpret=interpret)
        same_KQ = _bcast(segk_K, shape_KQ, 0) == _bcast(segq_Q, shape_KQ, 1)
        x_KQ = jnp.where(same_KQ, x_KQ, -jnp.inf)
      dv_KD, dx_KQ, c_Q = dv_and_dx(jnp.exp2(x_KQ), c_Q, dv_KD, v_tile=v_s.at[wg],
                                    do_tile=do_s.at[slot], c_tile=c_s.at[slot],
                                    delta_tile=delta_s.at[slot], mode=mode, interpret=interpret,
                                    phase=phase)
      # The temperature multiplies dlogits per query before the q-side contraction.
      dx_KQ = dx_KQ * _bcast(c_Q * LN2, shape_KQ, 1)
      dk_KD = mc.mma(dx_KQ.astype(q_s.dtype), q_s.at[slot], acc=dk_KD, interpret=interpret)
      plgpu.barrier_arrive(q_free.at[slot])
      return dk_KD, dv_KD

    dk_KD, dv_KD = visit_q_blocks(step, causal=causal, group=group, per_head=per_head,
                                  steps=steps, k0=k0, bq=bq, bkv=bkv, i_lo=i_lo, q_bar=q_bar,
                                  q_free=q_free, D=k_s.shape[-1], interpret=interpret,
                                  phase=phase, wg=wg)
    write_dk_dv(dk_KD, dv_KD, k_s.at[wg], v_s.at[wg], dk_ref.at[rows], dv_ref.at[rows])

  @pl.when(wg == W)
  def _producer():
    stream_q_rows((q_ref, do_ref, c_ref, lse_ref, delta_ref), (q_s, do_s, c_s, lse_s, delta_s),
                  q_bar, q_free, b=b, kv_head=kv_head, group=group, i_lo=i_lo,
                  per_head=per_head, bq=bq, steps=steps,
                  seg=None if seg is None else (seg_ref, segq_s))


def dkv_call(q, k, v, do, c_BNT, lse_BNT, delta_BNT, *, causal: bool, blocks, interpret,
             seg_BT=None):
  """The dk/dv kernel: (dk, dv [B,S,Hkv,D] k.dtype), summed over each kv head's G query heads."""
  B, T, N, D = q.shape
  S, K = k.shape[1], k.shape[2]
  flag, params = _launch_params(interpret)
  bq, bkv = blocks.block_q_dkv, blocks.block_kv_dkv
  n_q = T // bq
  steps = max(1, min(blocks.max_concurrent_steps, n_q))
  segments = seg_BT is not None
  operands = (q, k, v, do, c_BNT, lse_BNT, delta_BNT) + ((seg_BT,) if segments else ())
  seg_scratch = [plgpu.SMEM((W, bkv), jnp.int32),             # resident key ids
                 plgpu.SMEM((steps, bq), jnp.int32)] if segments else []  # q ids ring
  return plgpu.kernel(
      mc.with_segments(
          functools.partial(_dkv_kernel, causal=causal, bq=bq, bkv=bkv, n_q=n_q, group=N // K,
                            steps=steps, mode=step_mode(blocks), pingpong_on=pingpong(blocks),
                            interpret=flag),
          n_in=len(operands), n_seg_scratch=2, segments=segments),
      out_type=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      scratch_types=[
          _tile_smem((W, bkv, D), k.dtype), _tile_smem((W, bkv, D), k.dtype),  # k, v (then dk, dv)
          _tile_smem((steps, bq, D), q.dtype), _tile_smem((steps, bq, D), q.dtype),  # q, dO ring
          *[plgpu.SMEM((steps, bq), jnp.float32) for _ in range(3)],     # c, lse, delta ring
          plgpu.Barrier(num_arrivals=2 + segments, num_barriers=W),   # resident tiles landed
          plgpu.Barrier(num_arrivals=5 + segments, num_barriers=steps),  # q, dO, rows landed
          plgpu.Barrier(num_arrivals=W, num_barriers=steps),      # slot released by both wgs
          plgpu.Barrier(num_arrivals=W),       # ping-pong schedule (with pingpong_backward)
          *seg_scratch,
      ],
      grid=(K, S // (W * bkv), B), grid_names=("heads", "kv_seq", "batch"),
      num_threads=W + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=params,
      kernel_name=kernel_name("focal_mgpu_dkv", blocks))(*operands)
