"""dk/dv kernel of the Mosaic focal backward and the key-resident pieces `mosaic_bwd_fused` shares
(producer, q-block walk, dv/dx step, write-out); see `mosaic_bwd`."""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import mosaic_common as mc

W = 2  # compute warpgroups per CTA
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def stream_q_rows(gmem, smem, q_bar, q_free, *, b, kv_head, group, i_lo, per_head, bq, steps,
                  seg=None):
  """Producer: TMA-streams q, dO and rows (c, lse, delta) of the `group` query heads, q blocks
  i_lo .. i_lo + per_head - 1, through a `steps`-slot ring (refilled once both compute
  warpgroups released it); seg ids, when given, join each slot."""
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

  mc.drain(q_free, total, steps)


def visit_q_blocks(step, *, causal, group, per_head, steps, k0, bq, bkv, i_lo, q_bar, q_free, D,
                   interpret):
  """A compute warpgroup's walk: step(t, (dk, dv), g=g, masked=...) per q block of each query
  head from f32 zeros; causal blocks above its keys only wait for and release their slot."""
  def skip(t, carry, *, g):
    slot = lax.rem(g * per_head + t, steps)
    plgpu.barrier_wait(q_bar.at[slot])
    plgpu.barrier_arrive(q_free.at[slot])
    return carry

  def head(g, carry):
    unmasked = functools.partial(step, g=g, masked=False)
    if not causal:
      return lax.fori_loop(0, per_head, unmasked, carry)
    # q blocks [i_lo, i_vis) see none of its keys, [i_vis, i_full) cross its diagonal.
    t_vis = jnp.clip(lax.div(k0, jnp.int32(bq)) - i_lo, 0, per_head)
    t_full = jnp.clip(pl.cdiv(k0 + bkv, jnp.int32(bq)) - i_lo, 0, per_head)
    carry = lax.fori_loop(0, t_vis, functools.partial(skip, g=g), carry)
    carry = lax.fori_loop(t_vis, t_full, functools.partial(step, g=g, masked=True), carry)
    return lax.fori_loop(t_full, per_head, unmasked, carry)

  zeros = mc.layout_cast(jnp.zeros((bkv, D), jnp.float32), plgpu.Layout.WGMMA,
                         interpret=interpret)
  return lax.fori_loop(0, group, head, (zeros, zeros))


def dv_and_dx(p_KQ, dv_KD, *, v_tile, do_tile, delta_tile, interpret):
  """dv += p·dO and dP = v·dOᵀ issued together, then dx = p ⊙ (dP − delta); (dv, dx) f32."""
  p16_KQ = p_KQ.astype(do_tile.dtype)
  dv_KD, dp_KQ = mc.mma_pair((p16_KQ, do_tile, dv_KD, False), (v_tile, do_tile, None, True),
                             interpret=interpret)
  delta_Q = mc.load(delta_tile, layout=plgpu.Layout.WGMMA.reduce(0), interpret=interpret)
  dx_KQ = p_KQ * (dp_KQ - mc.bcast(delta_Q, dp_KQ.shape, 1))
  return dv_KD, dx_KQ


def write_dk_dv(dk_KD, dv_KD, k_tile, v_tile, dk_out, dv_out):
  """dk/dv out through the warpgroup's own k/v SMEM tiles by TMA, awaited."""
  k_tile[...] = dk_KD.astype(k_tile.dtype)
  v_tile[...] = dv_KD.astype(v_tile.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(k_tile, dk_out)
  plgpu.copy_smem_to_gmem(v_tile, dv_out)
  plgpu.wait_smem_to_gmem(0)


def cta_start(*, causal, bq, bkv, n_q):
  """(b, kv_head, wg, CTA's first key, i_lo, per_head): the CTA visits q blocks [i_lo, n_q)."""
  b, kv_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
  cta_k0 = lax.axis_index("kv_seq") * (W * bkv)
  i_lo = jnp.minimum(lax.div(cta_k0, jnp.int32(bq)), n_q) if causal else jnp.int32(0)
  return b, kv_head, wg, cta_k0, i_lo, n_q - i_lo


def load_resident(k_ref, v_ref, k_s, v_s, res_bar, seg, *, b, kv_head, wg, cta_k0, bkv,
                  interpret):
  """Loads a compute warpgroup's k, v tiles (and key ids); returns (k0, rows, segk_K or None)."""
  plgpu.set_max_registers(mc.COMPUTE_REGISTERS, action="increase")
  k0 = cta_k0 + wg * bkv
  rows = (b, pl.ds(k0, bkv), kv_head)
  bar = res_bar.at[wg]
  plgpu.copy_gmem_to_smem(k_ref.at[rows], k_s.at[wg], bar)
  plgpu.copy_gmem_to_smem(v_ref.at[rows], v_s.at[wg], bar)
  if seg:
    plgpu.copy_gmem_to_smem(seg[0].at[b, pl.ds(k0, bkv)], seg[1].at[wg], bar)
  plgpu.barrier_wait(bar)
  if not seg:
    return k0, rows, None
  return k0, rows, mc.load(seg[1].at[wg], layout=plgpu.Layout.WGMMA.reduce(1), interpret=interpret)


def step_dx(t, dv_KD, *, g, masked, wg, k_s, v_s, q_s, do_s, c_s, lse_s, delta_s, q_bar, segk_K,
            segq_s, i_lo, per_head, steps, k0, bq, bkv, interpret):
  """Start of a key-resident step: wait, r = k·qᵀ, mask, `dv_and_dx`; (i, slot, c_Q, dv, dx)."""
  wgmma_layout = plgpu.Layout.WGMMA
  col_layout = wgmma_layout.reduce(0)  # per-query vectors run along axis 1 of [bkv, bq] tiles
  shape_KQ = (bkv, bq)
  i = i_lo + t
  slot = lax.rem(g * per_head + t, steps)  # the producer's step index of this q block
  plgpu.barrier_wait(q_bar.at[slot])
  r_KQ = mc.mma(k_s.at[wg], q_s.at[slot], transpose_b=True, interpret=interpret)
  c_Q = mc.load(c_s.at[slot], layout=col_layout, interpret=interpret)
  lse_Q = mc.load(lse_s.at[slot], layout=col_layout, interpret=interpret)
  x_KQ = r_KQ * mc.bcast(c_Q, shape_KQ, 1) - mc.bcast(lse_Q, shape_KQ, 1)
  if masked:
    s = mc.iota(jnp.int32, shape_KQ, 0, wgmma_layout, interpret=interpret) + k0
    tq = mc.iota(jnp.int32, shape_KQ, 1, wgmma_layout, interpret=interpret) + i * bq
    x_KQ = jnp.where(s <= tq, x_KQ, -jnp.inf)
  if segk_K is not None:
    segq_Q = mc.load(segq_s.at[slot], layout=col_layout, interpret=interpret)
    same_KQ = mc.bcast(segk_K, shape_KQ, 0) == mc.bcast(segq_Q, shape_KQ, 1)
    x_KQ = jnp.where(same_KQ, x_KQ, -jnp.inf)
  dv_KD, dx_KQ = dv_and_dx(jnp.exp2(x_KQ), dv_KD, v_tile=v_s.at[wg], do_tile=do_s.at[slot],
                           delta_tile=delta_s.at[slot], interpret=interpret)
  return i, slot, c_Q, dv_KD, dx_KQ


def scratch(k, q, *, bq, bkv, steps, segments, extra=()):
  """Scratch of the key-resident kernels, `extra` after the row ring."""
  D = k.shape[-1]
  seg_scratch = [plgpu.SMEM((W, bkv), jnp.int32),             # resident key ids
                 plgpu.SMEM((steps, bq), jnp.int32)] if segments else []  # q ids ring
  return [
      mc.tile_smem((W, bkv, D), k.dtype), mc.tile_smem((W, bkv, D), k.dtype),  # k, v → dk, dv
      mc.tile_smem((steps, bq, D), q.dtype), mc.tile_smem((steps, bq, D), q.dtype),  # q, dO
      *[plgpu.SMEM((steps, bq), jnp.float32) for _ in range(3)],     # c, lse, delta ring
      *extra,
      plgpu.Barrier(num_arrivals=2 + segments, num_barriers=W),   # resident tiles landed
      plgpu.Barrier(num_arrivals=5 + segments, num_barriers=steps),  # q, dO, rows landed
      plgpu.Barrier(num_arrivals=W, num_barriers=steps),      # slot released by both wgs
      *seg_scratch,
  ]


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, c_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                k_s, v_s, q_s, do_s, c_s, lse_s, delta_s, res_bar, q_bar, q_free,
                *, seg, causal, bq, bkv, n_q, group, steps, interpret):
  b, kv_head, wg, cta_k0, i_lo, per_head = cta_start(causal=causal, bq=bq, bkv=bkv, n_q=n_q)
  seg_ref, segk_s, segq_s = seg or (None, None, None)

  @pl.when(wg < W)
  def _compute():
    k0, rows, segk_K = load_resident(k_ref, v_ref, k_s, v_s, res_bar, seg, b=b, kv_head=kv_head,
                                     wg=wg, cta_k0=cta_k0, bkv=bkv, interpret=interpret)

    def step(t, carry, *, g, masked):
      dk_KD, dv_KD = carry
      _, slot, c_Q, dv_KD, dx_KQ = step_dx(
          t, dv_KD, g=g, masked=masked, wg=wg, k_s=k_s, v_s=v_s, q_s=q_s, do_s=do_s, c_s=c_s,
          lse_s=lse_s, delta_s=delta_s, q_bar=q_bar, segk_K=segk_K, segq_s=segq_s, i_lo=i_lo,
          per_head=per_head, steps=steps, k0=k0, bq=bq, bkv=bkv, interpret=interpret)
      # The temperature multiplies dlogits per query before the q-side contraction.
      dx_KQ = dx_KQ * mc.bcast(c_Q * LN2, dx_KQ.shape, 1)
      dk_KD = mc.mma(dx_KQ.astype(q_s.dtype), q_s.at[slot], acc=dk_KD, interpret=interpret)
      plgpu.barrier_arrive(q_free.at[slot])
      return dk_KD, dv_KD

    dk_KD, dv_KD = visit_q_blocks(step, causal=causal, group=group, per_head=per_head,
                                  steps=steps, k0=k0, bq=bq, bkv=bkv, i_lo=i_lo, q_bar=q_bar,
                                  q_free=q_free, D=k_s.shape[-1], interpret=interpret)
    write_dk_dv(dk_KD, dv_KD, k_s.at[wg], v_s.at[wg], dk_ref.at[rows], dv_ref.at[rows])

  @pl.when(wg == W)
  def _producer():
    stream_q_rows((q_ref, do_ref, c_ref, lse_ref, delta_ref), (q_s, do_s, c_s, lse_s, delta_s),
                  q_bar, q_free, b=b, kv_head=kv_head, group=group, i_lo=i_lo,
                  per_head=per_head, bq=bq, steps=steps,
                  seg=None if seg is None else (seg_ref, segq_s))


def launch(kernel, operands, q, k, *, causal, blocks, interpret, segments, name, extra=(),
           ref=False):
  """Runs a key-resident `kernel` on grid (Hkv, S / (W·block_kv_dkv), B); ref: operands hold a
  mutable GMEM Ref (`mc.ref_kernel`)."""
  T, N = q.shape[1], q.shape[2]
  S, K = k.shape[1], k.shape[2]
  flag, params = mc.launch_params(interpret)
  bq, bkv = blocks.block_q_dkv, blocks.block_kv_dkv
  n_q = T // bq
  steps = max(1, min(blocks.max_concurrent_steps, n_q))  # more slots than blocks load nothing
  body = mc.with_segments(
      functools.partial(kernel, causal=causal, bq=bq, bkv=bkv, n_q=n_q, group=N // K,
                        steps=steps, interpret=flag),
      n_in=len(operands), n_seg_scratch=2, segments=segments)
  kw = dict(
      out_type=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype)],
      scratch_types=scratch(k, q, bq=bq, bkv=bkv, steps=steps, segments=segments, extra=extra),
      grid=(K, S // (W * bkv), q.shape[0]), grid_names=("heads", "kv_seq", "batch"),
      num_threads=W + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True), interpret=params)
  if ref:
    return mc.ref_kernel(body, **kw, name=name)(*operands)
  return plgpu.kernel(body, **kw, kernel_name=name)(*operands)


def dkv_call(q, k, v, do, c_BNT, lse_BNT, delta_BNT, *, causal: bool, blocks, interpret,
             seg_BT=None):
  """The dk/dv kernel: (dk, dv [B,S,Hkv,D] k.dtype), summed over each kv head's G query heads."""
  segments = seg_BT is not None
  operands = (q, k, v, do, c_BNT, lse_BNT, delta_BNT) + ((seg_BT,) if segments else ())
  return launch(_dkv_kernel, operands, q, k, causal=causal, blocks=blocks, interpret=interpret,
                segments=segments, name="focal_mgpu_dkv")
