"""Dilution attention's forward passes on Hopper (Pallas Mosaic GPU): the F2 key sweep, the heavy
pass, and F1's row statistics (`row_stats`, focal_mgpu's flash forward with V := K, at the end).

The same math and outputs as `dilution_fwd.key_sweep` (its docstring): a key block J walks the row
tiles that can see it top-down with its per-key committed demand `carry`:
    inclusive = carry + p·U≤ (U≤[r, i] = r ≤ i: the in-tile inclusive prefix over queries),
    σ = p / (inclusive + ε);  S_I += colsum(σ);  N_I += σᵀ V_J;  carry += rowsum(p),
storing the incoming carry at every super-block of `ckpt_rows` rows (the backward's checkpoints)
and the final carry (the column total, the decode demand).

Grid (Hq, T / 64, B), two Pallas threads (as dilution_mgpu's B1): warpgroup 0 computes on
[keys, queries] tiles (64 × 64), warpgroup 1 TMA-streams q, lse and segment ids through a ring
of `steps` slots. Per tile: k·qᵀ and three bf16-piece products against U≤ (float32-exact, see
dilution_mgpu.mask_dot; two with BlockSizes.f2_mask_pieces=2) on wgmma; σ → SMEM (16-bit:
σ ∈ [0, 1]) → σᵀ·V (transposed SMEM lhs) → float32 SMEM → TMA reduce-add into N; colsum(σ)
(a cross-warp reduction, hence one compute warpgroup) → TMA reduce-add into S. The Triton kernel
adds both with per-element fp32 atomics. Checkpoints and totals leave through a [64] SMEM vector
and a TMA copy; checkpoints of super-blocks before the first visible one stay zero (XLA
zero-fills the buffer).

BlockSizes.f2_key_tiles = G > 1 (`key_tiles`): one CTA owns G consecutive 64-key tiles (grid
(Hq, T / 64G, B)), walks the row tiles from its first key's, and per row tile sums σ_g, colsum(σ_g)
and σ_gᵀ V_g over its tiles (σ through G SMEM tiles, one accumulator: mc.mma_t_sum) before one
reduce-add of N and S: G times fewer float32 reduce-adds (12.9 GB of them at (2,12,16K,64) with
G = 1). Tiles above a row tile's diagonal run with p = 0 (G(G-1)/2 wasted tile pairs per CTA).
Why: F2 and B1 are the two passes with a reduce-add per tile pair and run at 57 and 86 TFLOP/s,
F1 and B2 (none) at 181 and 167, and the Triton and Mosaic F2s, built nothing alike, run at the
same speed; the reduce-adds were the suspect. Measured (twenty-ninth session, H200, F2 alone at
(2,12,16K,64), two mask pieces): 59 / 67 / 52 TFLOP/s at G = 1 / 2 / 4. So the reduce-adds are not
the whole bound (G = 4 quarters them and loses, paying G(G-1)/2 masked tile pairs and more SMEM
traffic); G = 2 is the D = 64 Hopper default. SMEM grows by G·(2·64·D·2 + 64·64·2) bytes: G = 4
at D = 128 needs 239 KiB and is refused (`key_tiles_for`).

On CPU pass interpret=True: N and S then get one slab per CTA (TMA reductions are not
interpreted), summed by XLA. Written in the thirteenth session with dilution_mgpu's B1;
interpret-tested on CPU, compiled and tested on the H200 (jax 0.11.2). Timed there: 15.3 ms against
the Triton F2's 14.5 at (2,12,16K,64) bf16, but faster at D = 128 (forward 3.94 against 5.76 ms at
(1,16,8K,128)). `BlockSizes.default` picks it on sm_90 at D 64 (two pieces, G = 2) and 128.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.dilution import mosaic_b1 as dm
from pallas_kernels.focal import mosaic as focal_mgpu
from pallas_kernels import mosaic_common as mc

BQ = BKV = dm.BQ
KEY_TILES = (1, 2, 4)   # BlockSizes.f2_key_tiles
F1_ROWS_PER_CTA = 128   # row_stats (focal_mgpu's forward): two 64-row tiles a CTA, T a multiple


def key_tiles_for(D: int) -> tuple[int, ...]:
  """The key_tiles that fit shared memory: 4 at D = 128 needs 239 KiB of the 227 available."""
  return tuple(g for g in KEY_TILES if g * D <= 256)


def _kernel(q_ref, k_ref, v_ref, seg_ref, lse_ref, incl_ref, codes_ref, n_acc, s_acc, ckpt_ref,
            total_ref,
            k_s, v_s, incl_s, segk_s, q_s, lse_s, segq_s, sig_s, n_s, s_s, vec_s,
            res_bar, q_bar, q_free, *, scale, eps, n_q, ckpt_tiles, group, steps, with_ckpt,
            mask_pieces, key_tiles, registers, lean, skip_masks, chain, interpret):
  n, jk, b = lax.axis_index("heads"), lax.axis_index("kv_seq"), lax.axis_index("batch")
  wg = lax.axis_index("wg")
  G = key_tiles
  # Tile g of a per-key-tile scratch ref: with one tile the refs have no tile axis, so the
  # default kernel is the one compiled and timed before f2_key_tiles existed.
  at = (lambda ref, g: ref) if G == 1 else (lambda ref, g: ref.at[g])
  k0 = jk * (G * BKV)
  i_lo = lax.div(k0, jnp.int32(BQ))           # the first row tile that sees a key of J
  wgmma = plgpu.Layout.WGMMA
  row_layout = wgmma.reduce(1)

  @pl.when(wg == 0)
  def _compute():
    plgpu.set_max_registers(registers, action="increase")
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
    key_KQ, qry_KQ = dm.positions(k0, lean=lean, interpret=interpret)

    def write_vecs(carries, dst):
      """Per-key vectors to GMEM (dst(g): tile g's [64] keys): SMEM, then TMA (the last copies
      out of vec_s have read it)."""
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
                                unmasked=dm.visible_all(codes_ref, b, G * jk + g, i)
                                if skip_masks else None)
        if g == G - 1:
          plgpu.barrier_arrive(q_free.at[slot])   # q, lse and ids of this slot are read
        incl_KQ = dm._bcast(carries[g], shape_KQ, 0) + dm.mask_dot(
            p_KQ, incl_s, pieces=mask_pieces, chain=chain, interpret=interpret)
        sig_KQ = p_KQ * dm.recip(incl_KQ + eps, lean=True) if lean else p_KQ / (incl_KQ + eps)
        sig_sum_KQ = sig_KQ if sig_sum_KQ is None else sig_sum_KQ + sig_KQ
        if g == G - 1:
          s_Q = sig_sum_KQ.sum(axis=0)
        if g == 0:
          # The last reduces have read n_s and s_s. (They do not read σ, so this wait could
          # move below the σᵀ·V wgmma; it stays where the compiled, timed kernel has it.)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        at(sig_s, g)[...] = sig_KQ.astype(sig_s.dtype)
        new_carries.append(carries[g] + p_KQ.sum(axis=1))
      plgpu.commit_smem()
      if G == 1:
        n_QD = mc.mma_t(sig_s, v_s, interpret=interpret)
      else:
        # One accumulator over the CTA's key tiles, so N gets one reduce-add per row tile
        # instead of one per key tile (mma_t_sum: static tile views as wgmma operands).
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

    dm._drain(q_free, lax.fori_loop(i_lo, n_q, visit, jnp.int32(0)), steps)


@functools.partial(jax.jit, static_argnames=("scale", "eps", "ckpt_rows", "with_ckpt", "steps",
                                             "mask_pieces", "key_tiles", "registers", "lean",
                                             "skip_masks", "chain", "interpret"))
def key_sweep(q, k, v, seg, lse, *, scale, eps, ckpt_rows, with_ckpt, steps=2, mask_pieces=3,
              key_tiles=1, registers=256, lean=False, skip_masks=False, chain=False,
              interpret=False):
  """F2 as `dilution_fwd.key_sweep`: (N float32 [B,T,Hq,D], S, total float32 [B,Hq,T], ckpt
  float32 [B, Hq, ceil(T / ckpt_rows), T] or None). seg int32 [B, T]; lse float32 [B, Hq, T].
  mask_pieces: bf16 pieces of p in the in-tile prefix (3 exact, 2 ~16 bits; dm.mask_dot).
  key_tiles: 64-key tiles per CTA (1, 2, 4; BlockSizes.f2_key_tiles), their N and S summed
  before one reduce-add per row tile; T must be a multiple of 64·key_tiles.
  registers: the compute warpgroup's setmaxnreg (232..256, BlockSizes.mosaic_registers).
  lean: BlockSizes.mosaic_lean (approx_math, dm.recip, dm.positions as vectors).
  skip_masks: BlockSizes.mosaic_skip_masks (dm.visible_all).
  chain: BlockSizes.mosaic_chain_pieces (dm.mask_dot)."""
  why = dm.supported(q, ckpt_rows)
  B, T, N, D = q.shape
  if not why and (key_tiles not in key_tiles_for(D) or T % (key_tiles * BKV)):
    why = (f"key_tiles={key_tiles} must be one of {key_tiles_for(D)} at D={D} (shared memory) "
           f"and divide T={T} into 64-key tiles")
  if why:
    raise ValueError(f"dilution_mgpu_fwd.key_sweep: {why}")
  flag, params = dm._launch_params(interpret)
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
                        with_ckpt=with_ckpt, mask_pieces=mask_pieces, key_tiles=key_tiles,
                        registers=registers, lean=lean, skip_masks=skip_masks, chain=chain,
                        interpret=flag),
      out_type=jax.ShapeDtypeStruct((B, N, T), jnp.float32),   # every key block writes its keys
      scratch_types=[
          dm._tile_smem(tiles + (BKV, D), k.dtype), dm._tile_smem(tiles + (BKV, D), k.dtype),
          dm._tile_smem((BQ, BQ), jnp.bfloat16),                                # U≤
          plgpu.SMEM(tiles + (BKV,), jnp.int32),                                # key ids
          dm._tile_smem((steps, BQ, D), q.dtype), vec(jnp.float32), vec(jnp.int32),  # q, lse, ids
          dm._tile_smem(tiles + (BKV, BQ), q.dtype),                            # σ, 16-bit
          plgpu.SMEM((BQ, D), jnp.float32, transforms=dm._F32_TILE),            # N tile
          plgpu.SMEM((BQ,), jnp.float32), plgpu.SMEM(tiles + (BKV,), jnp.float32),  # S, carries
          plgpu.Barrier(num_arrivals=3 * G + 1),           # k, v, key ids per tile; U≤ landed
          plgpu.Barrier(num_arrivals=3, num_barriers=steps),   # q, lse, ids of a slot landed
          plgpu.Barrier(num_arrivals=1, num_barriers=steps),   # slot released
      ],
      grid=(N, T // (G * BKV), B), grid_names=("heads", "kv_seq", "batch"),
      num_threads=2, thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=lean),
      interpret=params, name="dilution_mgpu_f2")(
          q, k, v, seg, lse, (r_QQ <= i_QQ).astype(jnp.bfloat16), dm.block_codes(seg), n_acc,
          s_acc, ckpt)
  n_out, s_out = n_acc[...], s_acc[...]
  if flag:
    n_out, s_out = n_out.sum(axis=0), s_out.sum(axis=0)
  return n_out, s_out, total, ckpt[...] if with_ckpt else None


def row_stats_supported(q, k, seg) -> str | None:
  """None if `row_stats` takes these (padded) inputs, else why not."""
  return focal_mgpu.supported(q, k, k, seg, True)


def row_stats(q, k, seg, *, scale, with_pk, interpret=False):
  """F1 as `dilution_fwd.row_stats` (lse float32 [B, Hq, T], natural log; pk = scale·Σ_j p_ij k_j
  float32 [B, T, Hq, D] or None) from focal_mgpu's forward with V := K and a constant scale: that
  kernel is F1's flash loop on wgmma (FA3's warp specialisation and ping-pong), where the Triton
  F1 runs at ~180 TFLOP/s. Its output leaves in q.dtype, so pk comes back as out + its rounding
  residual (`out_lo`: ~16 significant bits). The float32 pk matters: dq = dq_main − ĝ·pk subtracts
  two terms that can nearly cancel, so one bf16 rounding of pk (2⁻⁹) could dominate dq's error.
  Every row sees its own key (padding rows their own segment), so no row is empty. Needs what
  focal_mgpu.supported needs: 16-bit q/k, D 64 or 128, T a multiple of 128. H200, (2,12,16K,64):
  307 against the Triton F1's 174 TFLOP/s; the sm_90 default (`f1_impl`) since the thirty-second
  session, compiled-tested through the op."""
  B, T, N, _ = q.shape
  s_BNT = jnp.full((B, N, T), scale, jnp.float32)
  outs = focal_mgpu.forward(q, k, k, s_BNT, causal=True, blocks=None, interpret=interpret,
                            segment_ids=seg, out_lo=with_pk)
  lse = outs[1] * (1.0 / dm.LOG2E)   # focal's lse is base 2
  if not with_pk:
    return lse, None
  return lse, scale * (outs[0].astype(jnp.float32) + outs[2].astype(jnp.float32))
