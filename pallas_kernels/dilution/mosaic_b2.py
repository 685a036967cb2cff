"""Dilution B2 (dk correction corr_j = Σ_i p_ij ĝ_i q_i) on Hopper (Mosaic GPU), as
`triton_bwd.dk_correction`.

Grid (Hq, T / 128, B): compute warpgroups 0, 1 each own a 64-key block (k tile in SMEM, corr
[64, D] f32 in registers) and walk the row tiles top-down: r = k·qᵀ, p masked, corr += (p·ĝ)·q;
warpgroup 2 TMA-streams q, lse, ĝ and ids through a `steps`-slot ring. No reduce-adds.
SMEM ≈ 66 KB at D = 64, 130 KB at D = 128.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import mosaic_common as mc
from pallas_kernels.dilution import blocks
from pallas_kernels.dilution import mosaic_b1

BQ = BKV = mosaic_b1.BQ
_COMPUTE_WGS = 2
ROWS_PER_CTA = blocks.MOSAIC_CTA_ROWS   # keys per CTA, _COMPUTE_WGS·BKV; T must be a multiple


def _kernel(q_ref, k_ref, seg_ref, lse_ref, gh_ref, corr_ref,
            k_s, segk_s, q_s, lse_s, gh_s, segq_s, out_s, k_bar, q_bar, q_free,
            *, scale, n_q, group, steps, interpret):
  n, jc, b = lax.axis_index("heads"), lax.axis_index("kv_seq"), lax.axis_index("batch")
  wg = lax.axis_index("wg")
  i_lo = jc * _COMPUTE_WGS          # the first row tile that sees a key of this CTA
  n_tiles = n_q - i_lo
  wgmma = plgpu.Layout.WGMMA
  row_layout, col_layout = wgmma.reduce(1), wgmma.reduce(0)   # per key / per query vectors

  def compute(w: int):
    plgpu.set_max_registers(mc.COMPUTE_REGISTERS, action="increase")
    k0 = jc * ROWS_PER_CTA + w * BKV
    rows_k = (b, pl.ds(k0, BKV), lax.div(n, jnp.int32(group)))
    plgpu.copy_gmem_to_smem(k_ref.at[rows_k], k_s.at[w], k_bar.at[w])
    plgpu.copy_gmem_to_smem(seg_ref.at[b, pl.ds(k0, BKV)], segk_s.at[w], k_bar.at[w])
    plgpu.barrier_wait(k_bar.at[w])
    segk_K = mc.load(segk_s.at[w], layout=row_layout, interpret=interpret)
    shape_KQ = (BKV, BQ)
    key_KQ = mc.iota(jnp.int32, shape_KQ, 0, wgmma, interpret=interpret) + k0
    qry_KQ = mc.iota(jnp.int32, shape_KQ, 1, wgmma, interpret=interpret)

    def tile(u, corr_KD):
      slot = lax.rem(u, steps)
      plgpu.barrier_wait(q_bar.at[slot])
      p_KQ = mosaic_b1.tile_probs_kq(k_s.at[w], q_s.at[slot], lse_s.at[slot], segq_s.at[slot],
                                     segk_K,
                              key_KQ, qry_KQ, i_lo + u, scale=scale, interpret=interpret)
      gh_Q = mc.load(gh_s.at[slot], layout=col_layout, interpret=interpret)
      x_KQ = (p_KQ * lax.broadcast_in_dim(gh_Q, shape_KQ, [1])).astype(q_s.dtype)
      corr_KD = mc.mma(x_KQ, q_s.at[slot], acc=corr_KD, interpret=interpret)
      plgpu.barrier_arrive(q_free.at[slot])   # q and the rows of this slot are read
      return corr_KD

    D = q_s.shape[-1]
    zeros_KD = mc.layout_cast(jnp.zeros((BKV, D), jnp.float32), wgmma, interpret=interpret)
    corr_KD = lax.fori_loop(0, n_tiles, tile, zeros_KD)
    out_s.at[w][...] = corr_KD
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_s.at[w], corr_ref.at[b, pl.ds(k0, BKV), n])
    plgpu.wait_smem_to_gmem(0)

  for w in range(_COMPUTE_WGS):
    pl.when(wg == w)(functools.partial(compute, w))

  @pl.when(wg == _COMPUTE_WGS)
  def _producer():
    plgpu.set_max_registers(mc.PRODUCER_REGISTERS, action="decrease")

    def visit(u, carry):
      i = i_lo + u
      slot = mosaic_b1.ring_slot(u, steps, q_free)
      bar, vec = q_bar.at[slot], (b, n, pl.ds(i * BQ, BQ))
      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(i * BQ, BQ), n], q_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(gh_ref.at[vec], gh_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(seg_ref.at[b, pl.ds(i * BQ, BQ)], segq_s.at[slot], bar)
      return carry

    lax.fori_loop(0, n_tiles, visit, jnp.int32(0))
    mc.drain(q_free, n_tiles, steps)


@functools.partial(jax.jit, static_argnames=("scale", "steps", "interpret"))
def dk_correction(q, k, seg, lse, ghat, *, scale, steps=2, interpret=False):
  """B2 as `triton_bwd.dk_correction`: Σ_i p_ij ĝ_i q_i, float32 [B, T, Hq, D] (unscaled)."""
  mosaic_b1.check_inputs(q, "mosaic_b2.dk_correction", ROWS_PER_CTA)
  B, T, N, D = q.shape
  n_q = T // BQ
  steps = max(1, min(steps, n_q))
  vec = lambda dtype: plgpu.SMEM((steps, BQ), dtype)
  return plgpu.kernel(
      functools.partial(_kernel, scale=float(scale), n_q=n_q, group=N // k.shape[2], steps=steps,
                        interpret=bool(interpret)),
      out_type=jax.ShapeDtypeStruct(q.shape, jnp.float32),
      scratch_types=[
          mc.tile_smem((_COMPUTE_WGS, BKV, D), k.dtype),                    # k
          plgpu.SMEM((_COMPUTE_WGS, BKV), jnp.int32),                       # key ids
          mc.tile_smem((steps, BQ, D), q.dtype),                            # q ring
          vec(jnp.float32), vec(jnp.float32), vec(jnp.int32),               # lse, ĝ, query ids
          plgpu.SMEM((_COMPUTE_WGS, BKV, D), jnp.float32,
                     transforms=mosaic_b1.F32_TILE),                        # corr out
          plgpu.Barrier(num_arrivals=2, num_barriers=_COMPUTE_WGS),   # k, key ids landed
          plgpu.Barrier(num_arrivals=4, num_barriers=steps),   # q, lse, ĝ, ids of a slot
          plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=steps),   # slot released
      ],
      grid=(N, T // ROWS_PER_CTA, B), grid_names=("heads", "kv_seq", "batch"),
      num_threads=_COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(),
      interpret=mc.interpret_params() if interpret else None)(q, k, seg, lse, ghat)
