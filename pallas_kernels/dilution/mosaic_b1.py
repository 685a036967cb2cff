"""Dilution B1 reverse sweep on Hopper (Mosaic GPU); math and outputs of `triton_bwd.reverse_sweep`.

Grid (Hq, T / 64, B): warpgroup 0 computes on [keys, queries] 64×64 tiles (one warpgroup: ĝ is a
cross-warp reduction), warpgroup 1 TMA-streams each super-block's q, dO and rows twice (down for
the mini-sweep, up for the reverse pass) through a `steps`-slot ring. Carries: the per-tile
carry_K in SMEM [ckpt_rows/64, 64], the g-suffix sufk and dk, dv [64, D] f32 in registers; dq, ĝ
leave by TMA reduce-adds (interpreted: one slab per key block, summed by XLA). Products with the
triangular masks use two bf16 pieces (`mask_dot`). SMEM ≈ 110 KB at D = 64.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import mosaic_common as mc
from pallas_kernels.dilution import blocks
from pallas_kernels.dilution import triton_bwd

BQ = BKV = blocks.MOSAIC_TILE
LOG2E = math.log2(math.e)
REGISTERS = 256     # per thread of B1's and F2's compute warpgroup (setmaxnreg)
MASK_PIECES = 2     # bf16 pieces per in-tile mask product
F32_TILE = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def mask_dot(x_KQ, mask_s, *, chain: bool, interpret):
  """x·mask with x as two bf16 pieces (~16 bits), small first; chain: one wgmma group, one wait."""
  small_first = list(reversed(triton_bwd.bf16_pieces(x_KQ, MASK_PIECES)))
  if chain:
    return mc.mma_sum(small_first, mask_s, interpret=interpret)
  acc = None
  for piece in small_first:
    acc = mc.mma(piece, mask_s, acc=acc, interpret=interpret)
  return acc


def tile_probs_kq(k_s, q_tile, lse_tile, segq_tile, segk_K, key_KQ, qry_KQ, i, *, scale,
                  interpret, unmasked=None):
  """Causal softmax probabilities of a [keys, queries] tile, f32, exactly 0 where masked.
  key_KQ / qry_KQ: positions (vectors are broadcast, full tiles pass through); unmasked: None or
  a scalar bool, True when the whole tile is visible (the mask is then skipped)."""
  r_KQ = mc.mma(k_s, q_tile, transpose_b=True, interpret=interpret)
  shape_KQ = r_KQ.shape
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  lse_Q = mc.load(lse_tile, layout=col_layout, interpret=interpret)
  segq_Q = mc.load(segq_tile, layout=col_layout, interpret=interpret)
  x_KQ = r_KQ * (scale * LOG2E) - mc.bcast(lse_Q * LOG2E, shape_KQ, 1)

  def masked(x_KQ):
    if key_KQ.ndim == 1:
      causal = mc.bcast(key_KQ, shape_KQ, 0) <= mc.bcast(qry_KQ + i * shape_KQ[1], shape_KQ, 1)
    else:
      causal = key_KQ <= qry_KQ + i * shape_KQ[1]
    vis = causal & (mc.bcast(segk_K, shape_KQ, 0) == mc.bcast(segq_Q, shape_KQ, 1))
    return jnp.exp2(jnp.where(vis, x_KQ, -jnp.inf))

  if unmasked is None:
    return masked(x_KQ)
  return lax.cond(unmasked, jnp.exp2, masked, x_KQ)


def block_codes(seg):
  """[B, T] segment ids → int32 [B, T/64, 2]: each 64-block's (min, max) id, for `visible_all`."""
  B, T = seg.shape
  s = seg.reshape(B, T // BQ, BQ)
  return jnp.stack([s.min(-1), s.max(-1)], axis=-1)


def visible_all(codes_ref, b, kb, i):
  """Whether key block kb and row tile i need no mask (below the diagonal, one segment)."""
  kmin, kmax = codes_ref[b, kb, 0], codes_ref[b, kb, 1]
  qmin, qmax = codes_ref[b, i, 0], codes_ref[b, i, 1]
  return (i > kb) & (kmin == kmax) & (qmin == qmax) & (kmin == qmin)


def positions(k0, *, interpret):
  """Key positions (from k0) and in-tile query offsets as [64] WGMMA row / column vectors."""
  wgmma = plgpu.Layout.WGMMA
  return (mc.iota(jnp.int32, (BKV,), 0, wgmma.reduce(1), interpret=interpret) + k0,
          mc.iota(jnp.int32, (BQ,), 0, wgmma.reduce(0), interpret=interpret))


def recip(x):
  """1/x for x > 0 as rsqrt(x)² (one rsqrt.approx.f32 under approx_math)."""
  r = lax.rsqrt(x)
  return r * r


def ring_slot(st, steps: int, q_free):
  """The producer's slot for step st, once step st - steps released it."""
  slot = lax.rem(st, steps)

  @pl.when(st >= steps)
  def _():
    plgpu.barrier_wait(q_free.at[slot])

  return slot


def _bounds(t, *, n_super, ckpt_tiles, i_lo, n_q):
  """Super-block t of the walk (last first): (s, first row tile, end row tile)."""
  s = n_super - 1 - t
  return s, jnp.maximum(s * ckpt_tiles, i_lo), jnp.minimum((s + 1) * ckpt_tiles, n_q)


def _kernel(q_ref, k_ref, v_ref, seg_ref, lse_ref, ssum_ref, dbar_ref, do_ref, ckpt_ref, up_ref,
            lo_ref, codes_ref, dq_acc, gh_acc, dk_ref, dv_ref,
            k_s, v_s, up_s, lo_s, segk_s, ck0_s, ck_s, q_s, do_s, lse_s, ssum_s, dbar_s, segq_s,
            w_s, dq_s, gh_s, out_s, res_bar, ck_bar, q_bar, q_free,
            *, scale, eps, n_q, n_super, ckpt_tiles, group, steps, chain, interpret):
  n, jk, b = lax.axis_index("heads"), lax.axis_index("kv_seq"), lax.axis_index("batch")
  wg = lax.axis_index("wg")
  k0 = jk * BKV
  i_lo = lax.div(k0, jnp.int32(BQ))           # the first row tile that sees a key of J
  n_visit = n_super - lax.div(i_lo, jnp.int32(ckpt_tiles))
  bounds = functools.partial(_bounds, n_super=n_super, ckpt_tiles=ckpt_tiles, i_lo=i_lo, n_q=n_q)
  wgmma = plgpu.Layout.WGMMA
  row_layout, col_layout = wgmma.reduce(1), wgmma.reduce(0)   # per key / per query vectors

  @pl.when(wg == 0)
  def _compute():
    plgpu.set_max_registers(REGISTERS, action="increase")
    rows_k = (b, pl.ds(k0, BKV), lax.div(n, jnp.int32(group)))
    for src, dst in ((k_ref.at[rows_k], k_s), (v_ref.at[rows_k], v_s), (up_ref, up_s),
                     (lo_ref, lo_s), (seg_ref.at[b, pl.ds(k0, BKV)], segk_s)):
      plgpu.copy_gmem_to_smem(src, dst, res_bar)
    plgpu.barrier_wait(res_bar)
    segk_K = mc.load(segk_s, layout=row_layout, interpret=interpret)
    # Interpreted: this key block's own slab (no TMA reduction there; module docstring).
    dq_out = dq_acc.at[jk] if interpret else dq_acc
    gh_out = gh_acc.at[jk] if interpret else gh_acc
    shape_KQ = (BKV, BQ)
    key_KQ, qry_KQ = positions(k0, interpret=interpret)

    def probs(slot, i):
      return tile_probs_kq(k_s, q_s.at[slot], lse_s.at[slot], segq_s.at[slot], segk_K, key_KQ,
                           qry_KQ, i, scale=scale, interpret=interpret,
                           unmasked=visible_all(codes_ref, b, jk, i))

    def reverse_tile(i, slot, carry_K, acc):
      dk_KD, dv_KD, sufk_K = acc
      p_KQ = probs(slot, i)
      c_KQ = mc.bcast(carry_K, shape_KQ, 0) + mask_dot(p_KQ, up_s, chain=chain,
                                                       interpret=interpret)
      # The rows arrive as 1/(S + ε) and dbar/(S + ε) (reverse_sweep).
      rows_Q = mc.load(ssum_s.at[slot], layout=col_layout, interpret=interpret)
      ce_KQ = c_KQ + eps
      inv_KQ = recip(ce_KQ + p_KQ)
      rn_Q = mc.bcast(rows_Q, shape_KQ, 1)
      pi_KQ = p_KQ * inv_KQ
      a_KQ = pi_KQ * rn_Q
      dv_KD, dp_KQ = mc.mma_pair((a_KQ.astype(q_s.dtype), do_s.at[slot], dv_KD, False),
                                 (v_s, do_s.at[slot], None, True), interpret=interpret)
      dbar_Q = mc.load(dbar_s.at[slot], layout=col_layout, interpret=interpret)
      # t = dσ·inv, so dσ·(c + ε)·inv² = t·(ce·inv) and g = −dσ·p·inv² = −t·pi.
      t_KQ = (dp_KQ * rn_Q - mc.bcast(dbar_Q, shape_KQ, 1)) * inv_KQ
      g_KQ = -(t_KQ * pi_KQ)
      w_KQ = p_KQ * (t_KQ * (ce_KQ * inv_KQ) + mc.bcast(sufk_K, shape_KQ, 0) + mask_dot(
          g_KQ, lo_s, chain=chain, interpret=interpret))
      sufk_K = sufk_K + g_KQ.sum(axis=1)
      gh_Q = w_KQ.sum(axis=0)
      w16_KQ = w_KQ.astype(q_s.dtype)

      def store_w():   # overlapped with the dk wgmma; the last step's Wᵀ·k was awaited
        w_s[...] = w16_KQ
        plgpu.commit_smem()

      dk_KD = mc.mma(w16_KQ, q_s.at[slot], acc=dk_KD, during=store_w, interpret=interpret)
      plgpu.barrier_arrive(q_free.at[slot])   # q, dO and the rows of this slot are read
      dq_QD = mc.mma_t(w_s, k_s, interpret=interpret)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last reduces have read dq_s, gh_s
      dq_s[...] = dq_QD * scale
      gh_s[...] = gh_Q
      plgpu.commit_smem()
      mc.copy_smem_to_gmem_add(dq_s, dq_out.at[b, pl.ds(i * BQ, BQ), n], interpret=interpret)
      mc.copy_smem_to_gmem_add(gh_s, gh_out.at[b, n, pl.ds(i * BQ, BQ)], interpret=interpret)
      return dk_KD, dv_KD, sufk_K

    def super_block(t, state):
      st, acc = state
      s, lo, hi = bounds(t)
      plgpu.commit_smem()   # order the last super-block's reads of ck0_s before the TMA refill
      plgpu.copy_gmem_to_smem(ckpt_ref.at[b, n, s, pl.ds(k0, BKV)], ck0_s, ck_bar)
      plgpu.barrier_wait(ck_bar)

      def mini(i, c):
        st, carry_K = c
        slot = lax.rem(st, steps)
        plgpu.barrier_wait(q_bar.at[slot])
        p_KQ = probs(slot, i)
        ck_s.at[i - s * ckpt_tiles][...] = carry_K
        plgpu.barrier_arrive(q_free.at[slot])
        return st + 1, carry_K + p_KQ.sum(axis=1)

      if ckpt_tiles > 1:
        st, _ = lax.fori_loop(lo, hi, mini,
                              (st, mc.load(ck0_s, layout=row_layout, interpret=interpret)))
      # ckpt_rows = 64: the checkpoint is the carry of the super-block's one tile.
      carries = ck_s if ckpt_tiles > 1 else None

      def reverse(u, c):
        st, acc = c
        i = hi - 1 - u
        slot = lax.rem(st, steps)
        plgpu.barrier_wait(q_bar.at[slot])
        src = ck0_s if carries is None else carries.at[i - s * ckpt_tiles]
        carry_K = mc.load(src, layout=row_layout, interpret=interpret)
        return st + 1, reverse_tile(i, slot, carry_K, acc)

      return lax.fori_loop(0, hi - lo, reverse, (st, acc))

    D = k_s.shape[-1]
    zeros_KD = mc.layout_cast(jnp.zeros((BKV, D), jnp.float32), wgmma, interpret=interpret)
    zeros_K = mc.layout_cast(jnp.zeros((BKV,), jnp.float32), row_layout, interpret=interpret)
    _, (dk_KD, dv_KD, _) = lax.fori_loop(0, n_visit, super_block,
                                         (jnp.int32(0), (zeros_KD, zeros_KD, zeros_K)))
    rows_out = (b, pl.ds(k0, BKV), n)
    for x_KD, dst in ((dk_KD, dk_ref), (dv_KD, dv_ref)):
      plgpu.wait_smem_to_gmem(0)   # the tile's last copy (and every reduce) has completed
      out_s[...] = x_KD
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_s, dst.at[rows_out])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 1)
  def _producer():
    plgpu.set_max_registers(40, action="decrease")

    def visit(i, st):
      slot = ring_slot(st, steps, q_free)
      bar, rows, vec = q_bar.at[slot], (b, pl.ds(i * BQ, BQ), n), (b, n, pl.ds(i * BQ, BQ))
      plgpu.copy_gmem_to_smem(q_ref.at[rows], q_s.at[slot], bar)
      plgpu.copy_gmem_to_smem(do_ref.at[rows], do_s.at[slot], bar)
      for src, dst in ((lse_ref, lse_s), (ssum_ref, ssum_s), (dbar_ref, dbar_s)):
        plgpu.copy_gmem_to_smem(src.at[vec], dst.at[slot], bar)
      plgpu.copy_gmem_to_smem(seg_ref.at[b, pl.ds(i * BQ, BQ)], segq_s.at[slot], bar)
      return st + 1

    def super_block(t, st):
      _, lo, hi = bounds(t)
      if ckpt_tiles > 1:
        st = lax.fori_loop(lo, hi, visit, st)        # the mini-sweep's tiles, top-down
      return lax.fori_loop(0, hi - lo, lambda u, st: visit(hi - 1 - u, st), st)   # bottom-up

    mc.drain(q_free, lax.fori_loop(0, n_visit, super_block, jnp.int32(0)), steps)


def check_inputs(q, name: str, multiple: int = BQ):
  """ValueError unless q is 16-bit, D 64 or 128, T a multiple of `multiple`."""
  B, T, N, D = q.shape
  if not blocks.runs_mosaic("mosaic", D, q.dtype):
    raise ValueError(f"{name}: 16-bit q/k/v at head dim 64 or 128 only; got {q.dtype}, D={D}")
  if T % multiple:
    raise ValueError(f"{name}: T={T} must be a multiple of {multiple}")


@functools.partial(jax.jit, static_argnames=("scale", "eps", "ckpt_rows", "chain", "steps",
                                             "interpret"))
def reverse_sweep(q, k, v, seg, lse, ssum, dbar, do, ckpt, *, scale, eps, ckpt_rows, chain,
                  steps=2, interpret=False):
  """B1 as `triton_bwd.reverse_sweep`: (dq_main, ĝ, dk_main, dv), all f32; ckpt from F2 with the
  same ckpt_rows (a multiple of 64); chain: BlockSizes.chain_pieces."""
  check_inputs(q, "mosaic_b1.reverse_sweep")
  B, T, N, D = q.shape
  flag, params = mc.launch_params(interpret)
  n_q, n_kb = T // BQ, T // BKV
  slab = (n_kb,) if flag else ()   # interpreted: one slab per key block
  dq_acc = jax.new_ref(jnp.zeros(slab + q.shape, jnp.float32), memory_space=plgpu.GMEM)
  gh_acc = jax.new_ref(jnp.zeros(slab + (B, N, T), jnp.float32), memory_space=plgpu.GMEM)
  r_QQ, i_QQ = lax.broadcasted_iota(jnp.int32, (BQ, BQ), 0), lax.broadcasted_iota(
      jnp.int32, (BQ, BQ), 1)
  upper, lower = (r_QQ < i_QQ).astype(jnp.bfloat16), (r_QQ > i_QQ).astype(jnp.bfloat16)
  steps = max(1, min(steps, n_q))
  ckpt_tiles = ckpt_rows // BQ
  vec = lambda dtype: plgpu.SMEM((steps, BQ), dtype)
  # The per-query rows once here rather than per key block in the kernel.
  ssum = 1.0 / (ssum + eps)
  dbar = dbar * ssum
  dk, dv = mc.ref_kernel(
      functools.partial(_kernel, scale=float(scale), eps=float(eps), n_q=n_q,
                        n_super=ckpt.shape[2], ckpt_tiles=ckpt_tiles, group=N // k.shape[2],
                        steps=steps, chain=chain, interpret=flag),
      out_type=[jax.ShapeDtypeStruct(q.shape, jnp.float32)] * 2,
      scratch_types=[
          mc.tile_smem((BKV, D), k.dtype), mc.tile_smem((BKV, D), k.dtype),        # k, v
          mc.tile_smem((BQ, BQ), jnp.bfloat16), mc.tile_smem((BQ, BQ), jnp.bfloat16),  # U, L
          plgpu.SMEM((BKV,), jnp.int32), plgpu.SMEM((BKV,), jnp.float32),     # key ids, ckpt
          plgpu.SMEM((ckpt_tiles, BKV), jnp.float32),                         # tile carries
          mc.tile_smem((steps, BQ, D), q.dtype), mc.tile_smem((steps, BQ, D), q.dtype),  # q, dO
          vec(jnp.float32), vec(jnp.float32), vec(jnp.float32), vec(jnp.int32),  # rows, ids
          mc.tile_smem((BKV, BQ), q.dtype),                                   # W, 16-bit
          plgpu.SMEM((BQ, D), jnp.float32, transforms=F32_TILE),              # dq tile
          plgpu.SMEM((BQ,), jnp.float32),                                     # ĝ tile
          plgpu.SMEM((BKV, D), jnp.float32, transforms=F32_TILE),             # dk, dv out
          plgpu.Barrier(num_arrivals=5),                  # k, v, U, L, key ids landed
          plgpu.Barrier(num_arrivals=1),                  # the super-block's checkpoint landed
          plgpu.Barrier(num_arrivals=6, num_barriers=steps),   # q, dO, rows, ids of a slot
          plgpu.Barrier(num_arrivals=1, num_barriers=steps),   # slot released
      ],
      grid=(N, n_kb, B), grid_names=("heads", "kv_seq", "batch"),
      num_threads=2, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=params, name="dilution_mgpu_b1")(
          q, k, v, seg, lse, ssum, dbar, do, ckpt, upper, lower, block_codes(seg), dq_acc, gh_acc)
  dq, gh = dq_acc[...], gh_acc[...]
  if flag:
    dq, gh = dq.sum(axis=0), gh.sum(axis=0)
  return dq, gh, dk, dv
