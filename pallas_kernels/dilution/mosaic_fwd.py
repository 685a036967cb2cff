"""Dilution forward passes on Hopper (Mosaic GPU): the F2 key sweep and F1's `row_stats`.

F2 as `triton_fwd.key_sweep`. Grid (Hq, T / 64G, B), G = f2_key_tiles: warpgroup 0 computes on
64×64 [keys, queries] tiles with the per-key carry in registers (inclusive = carry + p·U≤,
σ = p / (inclusive + ε)), warpgroup 1 TMA-streams q, lse and ids through a `steps`-slot ring.
σᵀ·V over the G tiles and colsum(σ) leave by TMA reduce-adds into N and S (interpreted: one slab
per CTA); checkpoints every ckpt_rows rows and the final totals by TMA copies.
SMEM grows by G·(2·64·D·2 + 64·64·2) bytes.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import mosaic_common as mc
from pallas_kernels.dilution import mosaic_b1 as dm
from pallas_kernels.focal import mosaic as focal_mosaic

BQ = BKV = dm.BQ


def _kernel(q_ref, k_ref, v_ref, seg_ref, lse_ref, incl_ref, codes_ref, n_acc, s_acc, ckpt_ref,
            total_ref,
            k_s, v_s, incl_s, segk_s, q_s, lse_s, segq_s, sig_s, n_s, s_s, vec_s,
            res_bar, q_bar, q_free, *, scale, eps, n_q, ckpt_tiles, group, steps, with_ckpt,
            key_tiles, chain, interpret):
  n, jk, b = lax.axis_index("heads"), lax.axis_index("kv_seq"), lax.axis_index("batch")
  wg = lax.axis_index("wg")
  G = key_tiles
  # Tile g of a per-key-tile scratch ref (with one tile the refs have no tile axis).
  at = (lambda ref, g: ref) if G == 1 else (lambda ref, g: ref.at[g])
  k0 = jk * (G * BKV)
  i_lo = lax.div(k0, jnp.int32(BQ))           # the first row tile that sees a key of J
  wgmma = plgpu.Layout.WGMMA
  row_layout = wgmma.reduce(1)

  @pl.when(wg == 0)
  def _compute():
    plgpu.set_max_registers(dm.REGISTERS, action="increase")
    kv_head = lax.div(n, jnp.int32(group))
    for g in range(G):
      rows_k = (b, pl.ds(k0 + g * BKV, BKV), kv_head)
      for src, dst in ((k_ref.at[rows_k], at(k_s, g)), (v_ref.at[rows_k], at(v_s, g)),
                       (seg_ref.at[b, pl.ds(k0 + g * BKV, BKV)], at(segk_s, g))):
        plgpu.copy_gmem_to_smem(src, dst, res_bar)
    plgpu.copy_gmem_to_smem(incl_ref, incl_s, res_bar)
    plgpu.barrier_wait(res_bar)
    segk_K = [mc.load(at(segk_s, g), layout=row_layout, interpret=interpret) for g in range(G)]
    n_out = n_acc.at[jk] if interpret else n_acc   # interpreted: this CTA's own slab
    s_out = s_acc.at[jk] if interpret else s_acc
    shape_KQ = (BKV, BQ)
    key_KQ, qry_KQ = dm.positions(k0, interpret=interpret)

    def write_vecs(carries, dst):
      """Per-key [64] vectors to GMEM through SMEM and TMA."""
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      for g in range(G):
        at(vec_s, g)[...] = carries[g]
      plgpu.commit_smem()
      for g in range(G):
        plgpu.copy_smem_to_gmem(at(vec_s, g), dst(g))

    def tile(i, carries):
      if with_ckpt:
        @pl.when(lax.rem(i, ckpt_tiles) == 0)   # super-block i / ckpt_tiles starts here
        def _():
          write_vecs(carries, lambda g: ckpt_ref.at[b, n, lax.div(i, ckpt_tiles),
                                                    pl.ds(k0 + g * BKV, BKV)])

      slot = lax.rem(i - i_lo, steps)
      plgpu.barrier_wait(q_bar.at[slot])
      new_carries, sig_sum_KQ = [], None
      for g in range(G):   # key tiles above row tile i get p = 0: σ = 0, the carry stays
        p_KQ = dm.tile_probs_kq(at(k_s, g), q_s.at[slot], lse_s.at[slot], segq_s.at[slot],
                                segk_K[g], key_KQ + g * BKV, qry_KQ, i, scale=scale,
                                interpret=interpret,
                                unmasked=dm.visible_all(codes_ref, b, G * jk + g, i))
        if g == G - 1:
          plgpu.barrier_arrive(q_free.at[slot])   # q, lse and ids of this slot are read
        incl_KQ = mc.bcast(carries[g], shape_KQ, 0) + dm.mask_dot(
            p_KQ, incl_s, chain=chain, interpret=interpret)
        sig_KQ = p_KQ * dm.recip(incl_KQ + eps)
        sig_sum_KQ = sig_KQ if sig_sum_KQ is None else sig_sum_KQ + sig_KQ
        if g == G - 1:
          s_Q = sig_sum_KQ.sum(axis=0)
        if g == 0:
          # The last reduces have read n_s and s_s.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        at(sig_s, g)[...] = sig_KQ.astype(sig_s.dtype)
        new_carries.append(carries[g] + p_KQ.sum(axis=1))
      plgpu.commit_smem()
      if G == 1:
        n_QD = mc.mma_t(sig_s, v_s, interpret=interpret)
      else:
        # One accumulator over the CTA's key tiles: one reduce-add of N per row tile.
        n_QD = mc.mma_t_sum([(sig_s.at[g], v_s.at[g]) for g in range(G)], interpret=interpret)
      n_s[...] = n_QD
      s_s[...] = s_Q
      plgpu.commit_smem()
      mc.copy_smem_to_gmem_add(n_s, n_out.at[b, pl.ds(i * BQ, BQ), n], interpret=interpret)
      mc.copy_smem_to_gmem_add(s_s, s_out.at[b, n, pl.ds(i * BQ, BQ)], interpret=interpret)
      return tuple(new_carries)

    zeros_K = mc.layout_cast(jnp.zeros((BKV,), jnp.float32), row_layout, interpret=interpret)
    carries = lax.fori_loop(i_lo, n_q, tile, (zeros_K,) * G)
    write_vecs(carries, lambda g: total_ref.at[b, n, pl.ds(k0 + g * BKV, BKV)])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 1)
  def _producer():
    plgpu.set_max_registers(40, action="decrease")

    def visit(i, st):
      slot = dm.ring_slot(st, steps, q_free)
      bar = q_bar.at[slot]
      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(i * BQ, BQ), n], q_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(lse_ref.at[b, n, pl.ds(i * BQ, BQ)], lse_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(seg_ref.at[b, pl.ds(i * BQ, BQ)], segq_s.at[slot], bar)
      return st + 1

    mc.drain(q_free, lax.fori_loop(i_lo, n_q, visit, jnp.int32(0)), steps)


@functools.partial(jax.jit, static_argnames=("scale", "eps", "ckpt_rows", "with_ckpt",
                                             "key_tiles", "chain", "steps", "interpret"))
def key_sweep(q, k, v, seg, lse, *, scale, eps, ckpt_rows, with_ckpt, key_tiles, chain, steps=2,
              interpret=False):
  """F2: (N f32 [B,T,Hq,D], S, total f32 [B,Hq,T], ckpt or None); T a multiple of 64·key_tiles."""
  dm.check_inputs(q, "mosaic_fwd.key_sweep", key_tiles * BKV)
  B, T, N, D = q.shape
  flag, params = mc.launch_params(interpret)
  n_q = T // BQ
  slab = (T // (key_tiles * BKV),) if flag else ()
  n_acc = jax.new_ref(jnp.zeros(slab + q.shape, jnp.float32), memory_space=plgpu.GMEM)
  s_acc = jax.new_ref(jnp.zeros(slab + (B, N, T), jnp.float32), memory_space=plgpu.GMEM)
  n_super = -(-T // ckpt_rows)
  ckpt = jax.new_ref(jnp.zeros((B, N, n_super if with_ckpt else 1, T), jnp.float32),
                     memory_space=plgpu.GMEM)
  r_QQ, i_QQ = (lax.broadcasted_iota(jnp.int32, (BQ, BQ), d) for d in (0, 1))
  G = key_tiles
  tiles = (G,) if G > 1 else ()   # the key-tile axis of k, v, ids, σ and carries (`at`)
  steps = max(1, min(steps, n_q))
  vec = lambda dtype: plgpu.SMEM((steps, BQ), dtype)
  total = mc.ref_kernel(
      functools.partial(_kernel, scale=float(scale), eps=float(eps), n_q=n_q,
                        ckpt_tiles=ckpt_rows // BQ, group=N // k.shape[2], steps=steps,
                        with_ckpt=with_ckpt, key_tiles=key_tiles, chain=chain, interpret=flag),
      out_type=jax.ShapeDtypeStruct((B, N, T), jnp.float32),   # every key block writes its keys
      scratch_types=[
          mc.tile_smem(tiles + (BKV, D), k.dtype), mc.tile_smem(tiles + (BKV, D), k.dtype),
          mc.tile_smem((BQ, BQ), jnp.bfloat16),                                 # U≤
          plgpu.SMEM(tiles + (BKV,), jnp.int32),                                # key ids
          mc.tile_smem((steps, BQ, D), q.dtype), vec(jnp.float32), vec(jnp.int32),  # q, lse, ids
          mc.tile_smem(tiles + (BKV, BQ), q.dtype),                             # σ, 16-bit
          plgpu.SMEM((BQ, D), jnp.float32, transforms=dm.F32_TILE),             # N tile
          plgpu.SMEM((BQ,), jnp.float32), plgpu.SMEM(tiles + (BKV,), jnp.float32),  # S, carries
          plgpu.Barrier(num_arrivals=3 * G + 1),           # k, v, key ids per tile; U≤ landed
          plgpu.Barrier(num_arrivals=3, num_barriers=steps),   # q, lse, ids of a slot landed
          plgpu.Barrier(num_arrivals=1, num_barriers=steps),   # slot released
      ],
      grid=(N, T // (G * BKV), B), grid_names=("heads", "kv_seq", "batch"),
      num_threads=2, thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=params, name="dilution_mgpu_f2")(
          q, k, v, seg, lse, (r_QQ <= i_QQ).astype(jnp.bfloat16), dm.block_codes(seg), n_acc,
          s_acc, ckpt)
  n_out, s_out = n_acc[...], s_acc[...]
  if flag:
    n_out, s_out = n_out.sum(axis=0), s_out.sum(axis=0)
  return n_out, s_out, total, ckpt[...] if with_ckpt else None


def row_stats(q, k, seg, *, scale, with_pk, interpret=False):
  """F1 as `triton_fwd.row_stats` from focal's Mosaic forward with V := K. pk comes back as out
  plus its rounding residual (~16 bits): dq = dq_main − ĝ·pk may nearly cancel, so pk must not be
  rounded to bf16. Needs 16-bit q/k, D 64 or 128, T a multiple of 128."""
  B, T, N, _ = q.shape
  s_BNT = jnp.full((B, N, T), scale, jnp.float32)
  outs = focal_mosaic.forward(q, k, k, s_BNT, causal=True, blocks=None, interpret=interpret,
                              segment_ids=seg, out_lo=with_pk)
  lse = outs[1] * (1.0 / dm.LOG2E)   # focal's lse is base 2
  if not with_pk:
    return lse, None
  return lse, scale * (outs[0].astype(jnp.float32) + outs[2].astype(jnp.float32))
