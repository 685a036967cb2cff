"""Single-pass Hopper (Mosaic GPU) backward of focal flash attention: dq, dk, dv and d_scale.

FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608) §3 / Algorithm 3: one kernel over kv
blocks that also produces dq, by adding each tile's dq contribution into a float32 accumulator in
global memory: 5 matmuls per tile pair instead of the 7 of `mosaic_bwd`'s two kernels. Same
signature and math as `mosaic_bwd.backward`, except that the kernel leaves acc_t = Σ_s dx_ts k_s
and one memory-bound XLA epilogue forms dq_t = s_t·acc_t and d_scale_t = q_t·acc_t (so d_scale
carries the 16-bit rounding of dx that the tensor cores see; within the tests' tolerance).

Kernel `_kernel`, grid (Hkv, S / (W·block_kv_dkv), B), W = 2 compute warpgroups + 1 TMA producer:
the ring, skip and mask logic of `mosaic_dkv` (k, v tile [bkv, D] resident per warpgroup, dk, dv
[bkv, D] float32 in registers; q, dO [bq, D] and the rows (c, lse, delta) streamed per query head
through `max_concurrent_steps` slots). Per step, [bkv, bq] tiles ("KQ"):
  r = k·qᵀ;  dv += p·dO and dP = v·dOᵀ (issued together);  dk += (s ⊙ dx)·q (dx from registers);
  dx → SMEM tile ds (16-bit, stored while the dk wgmma runs);  acc_QD = dsᵀ·k (transposed SMEM
  lhs) → float32 SMEM tile → TMA reduce-add into acc[b, q block, n]; the warpgroup waits for the
  previous reduce's read only before overwriting the tile (wait_read_only).
The TMA reduce is atomic per element but the order of the float32 additions is not fixed: dq and
d_scale are not bitwise reproducible (dk, dv are). acc is zero-filled by XLA and aliased in place
as a GMEM Ref (`mosaic_common.ref_kernel`). Segment ids: as in `mosaic_dkv`.

SMEM (16-bit inputs, C = max_concurrent_steps): W·2·bkv·D·2 (k, v) + C·(2·bq·D·2 + 3·bq·4) (ring)
+ W·bkv·bq·2 (ds) + W·bq·D·4 (float32 dq tile). D=128, bq = bkv = 64, C = 2: 210 KB of the 227 KB
a CTA may use; C = 3 does not fit at D = 128 (ValueError). D=64, C = 3: 130 KB. Registers: dk +
dv (2·bkv·D/128 per thread) plus the [bkv, bq] tiles; the dq tile is live only after dk's wgmma.
At D = 128 the kernel spills, at D = 64 it does not.

Contract: `mosaic_bwd.check` (this kernel reads block_q_dkv, block_kv_dkv, max_concurrent_steps)
plus the SMEM budget. Interpreted (CPU), jax's GPU interpreter has no TMA reductions: acc gets a
leading axis with one slab per kv tile (S / bkv), each warpgroup copies its dq tiles into its own
slab and XLA sums the slabs; everything else is the compiled code path, race-checked (0.10.2's
interpreter copies SMEM→GMEM synchronously, so it cannot flag a missing wait_read_only).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import mosaic_common as mc
from pallas_kernels.focal import mosaic_bwd
from pallas_kernels.focal import mosaic_dkv
from pallas_kernels.focal.mosaic_dkv import LN2, W

# 227 KB per CTA on Hopper, less the ~3 KB Mosaic keeps for itself (`mosaic`'s docstring).
SMEM_BUDGET = 224 * 1024


def smem_bytes(*, bq: int, bkv: int, D: int, steps: int, itemsize: int = 2) -> int:
  """SMEM the fused kernel allocates (barriers aside); see the module docstring."""
  return (W * 2 * bkv * D * itemsize + steps * (2 * bq * D * itemsize + 3 * bq * 4)
          + W * bkv * bq * itemsize + W * bq * D * 4)


def _kernel(q_ref, k_ref, v_ref, do_ref, c_ref, lse_ref, delta_ref, acc_ref, dk_ref, dv_ref,
            k_s, v_s, q_s, do_s, c_s, lse_s, delta_s, ds_s, dq_s, res_bar, q_bar, q_free,
            *, seg, causal, bq, bkv, n_q, group, steps, interpret):
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
    # Interpreted: this warpgroup's own slab (no TMA reduction there; module docstring).
    slab = lax.div(k0, jnp.int32(bkv))
    acc = acc_ref.at[slab] if interpret else acc_ref
    ds_KQ_s, dq_QD_s = ds_s.at[wg], dq_s.at[wg]
    shape_KQ = (bkv, bq)

    def step(t, carry, *, g, masked):
      dk_KD, dv_KD = carry
      i = i_lo + t
      slot = lax.rem(g * per_head + t, steps)
      plgpu.barrier_wait(q_bar.at[slot])
      r_KQ = mc.mma(k_s.at[wg], q_s.at[slot], transpose_b=True, interpret=interpret)
      c_Q = mc.load(c_s.at[slot], layout=col_layout, interpret=interpret)
      lse_Q = mc.load(lse_s.at[slot], layout=col_layout, interpret=interpret)
      x_KQ = r_KQ * mc.bcast(c_Q, shape_KQ, 1) - mc.bcast(lse_Q, shape_KQ, 1)
      if masked:
        s = mc.iota(jnp.int32, shape_KQ, 0, wgmma_layout, interpret=interpret) + k0
        tq = mc.iota(jnp.int32, shape_KQ, 1, wgmma_layout, interpret=interpret) + i * bq
        x_KQ = jnp.where(s <= tq, x_KQ, -jnp.inf)
      if seg:
        segq_Q = mc.load(segq_s.at[slot], layout=col_layout, interpret=interpret)
        same_KQ = mc.bcast(segk_K, shape_KQ, 0) == mc.bcast(segq_Q, shape_KQ, 1)
        x_KQ = jnp.where(same_KQ, x_KQ, -jnp.inf)
      dv_KD, dx_KQ = mosaic_dkv.dv_and_dx(jnp.exp2(x_KQ), dv_KD, v_tile=v_s.at[wg],
                                          do_tile=do_s.at[slot], delta_tile=delta_s.at[slot],
                                          interpret=interpret)

      def store_ds():  # overlapped with the dk wgmma; the last step's dsᵀ·k was awaited
        ds_KQ_s[...] = dx_KQ.astype(ds_KQ_s.dtype)
        plgpu.commit_smem()  # visible to the wgmma below (async proxy)

      # dk contracts over queries: the temperature scales each query's column first.
      dxs_KQ = (dx_KQ * mc.bcast(c_Q * LN2, shape_KQ, 1)).astype(q_s.dtype)
      dk_KD = mc.mma(dxs_KQ, q_s.at[slot], acc=dk_KD, during=store_ds, interpret=interpret)
      plgpu.barrier_arrive(q_free.at[slot])  # q, dO and rows of this slot are no longer read
      n = kv_head * group + g
      acc_QD = mc.mma_t(ds_KQ_s, k_s.at[wg], interpret=interpret)
      dst = acc.at[b, pl.ds(i * bq, bq), n]
      # Float32 dq tile → its SMEM tile → TMA reduce-add; the previous reduce must have read
      # the tile first.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      dq_QD_s[...] = acc_QD
      plgpu.commit_smem()
      mc.copy_smem_to_gmem_add(dq_QD_s, dst, interpret=interpret)
      return dk_KD, dv_KD

    dk_KD, dv_KD = mosaic_dkv.visit_q_blocks(
        step, causal=causal, group=group, per_head=per_head, steps=steps, k0=k0, bq=bq, bkv=bkv,
        i_lo=i_lo, q_bar=q_bar, q_free=q_free, D=k_s.shape[-1], interpret=interpret)
    # k, v tiles are free: the last dsᵀ·k wgmma was awaited. The wait also covers the last dq
    # reduce.
    mosaic_dkv.write_dk_dv(dk_KD, dv_KD, k_s.at[wg], v_s.at[wg], dk_ref.at[rows],
                           dv_ref.at[rows])

  @pl.when(wg == W)
  def _producer():
    mosaic_dkv.stream_q_rows(
        (q_ref, do_ref, c_ref, lse_ref, delta_ref), (q_s, do_s, c_s, lse_s, delta_s), q_bar,
        q_free, b=b, kv_head=kv_head, group=group, i_lo=i_lo, per_head=per_head, bq=bq,
        steps=steps, seg=None if seg is None else (seg_ref, segq_s))


def _check_smem(q, blocks):
  D, itemsize = q.shape[-1], jnp.dtype(q.dtype).itemsize
  need = smem_bytes(bq=blocks.block_q_dkv, bkv=blocks.block_kv_dkv, D=D,
                    steps=blocks.max_concurrent_steps, itemsize=itemsize)
  if need > SMEM_BUDGET:
    raise ValueError(
        f"fused backward needs {need / 1024:.1f} KB of SMEM > {SMEM_BUDGET // 1024} KB at D={D} "
        f"with blocks.block_q_dkv={blocks.block_q_dkv}, blocks.block_kv_dkv="
        f"{blocks.block_kv_dkv}, blocks.max_concurrent_steps={blocks.max_concurrent_steps}; "
        f"lower max_concurrent_steps or the blocks")


# jit: a Ref with a memory space exists only while tracing (NotImplementedError eagerly).
@functools.partial(jax.jit, static_argnames=("causal", "blocks", "interpret"))
def fused_call(q, k, v, do, c_BNT, lse_BNT, delta_BNT, *, causal: bool, blocks, interpret,
               seg_BT=None):
  """The kernel: (acc [B,T,Hq,D] float32 = Σ_s dx_ts k_s, dk, dv [B,S,Hkv,D] k.dtype).
  Inputs as `backward`'s after `mosaic_bwd.backward_rows`; do in q.dtype; blocks hashable."""
  B, T, N, D = q.shape
  S, K = k.shape[1], k.shape[2]
  flag, params = mc.launch_params(interpret)
  bq, bkv = blocks.block_q_dkv, blocks.block_kv_dkv
  n_q = T // bq
  steps = max(1, min(blocks.max_concurrent_steps, n_q))  # more slots than blocks load nothing
  acc_shape = (S // bkv, *q.shape) if flag else q.shape  # interpreted: one slab per kv tile
  acc_ref = jax.new_ref(jnp.zeros(acc_shape, jnp.float32), memory_space=plgpu.GMEM)
  # 128-byte swizzle: 64 16-bit or 32 float32 elements per row (the wgmma / TMA tile).
  f32_tile = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
  segments = seg_BT is not None
  operands = (q, k, v, do, c_BNT, lse_BNT, delta_BNT, acc_ref) + ((seg_BT,) if segments else ())
  seg_scratch = [plgpu.SMEM((W, bkv), jnp.int32),             # resident key ids
                 plgpu.SMEM((steps, bq), jnp.int32)] if segments else []  # q ids ring
  dk, dv = mc.ref_kernel(
      mc.with_segments(
          functools.partial(_kernel, causal=causal, bq=bq, bkv=bkv, n_q=n_q, group=N // K,
                            steps=steps, interpret=flag),
          n_in=len(operands), n_seg_scratch=2, segments=segments),
      out_type=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      scratch_types=[
          mc.tile_smem((W, bkv, D), k.dtype), mc.tile_smem((W, bkv, D), k.dtype),  # k, v → dk, dv
          mc.tile_smem((steps, bq, D), q.dtype), mc.tile_smem((steps, bq, D), q.dtype),  # q, dO
          *[plgpu.SMEM((steps, bq), jnp.float32) for _ in range(3)],     # c, lse, delta ring
          mc.tile_smem((W, bkv, bq), q.dtype),                          # ds = dx, 16-bit
          plgpu.SMEM((W, bq, D), jnp.float32, transforms=f32_tile),     # dq tile to reduce
          plgpu.Barrier(num_arrivals=2 + segments, num_barriers=W),   # resident tiles landed
          plgpu.Barrier(num_arrivals=5 + segments, num_barriers=steps),  # q, dO, rows landed
          plgpu.Barrier(num_arrivals=W, num_barriers=steps),      # slot released by both wgs
          *seg_scratch,
      ],
      grid=(K, S // (W * bkv), B), grid_names=("heads", "kv_seq", "batch"),
      num_threads=W + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=params, name="focal_mgpu_bwd_fused")(*operands)
  acc = acc_ref[...]
  return (acc.sum(axis=0) if flag else acc), dk, dv


def epilogue(q, s_BNT, acc_BTND):
  """(dq [B,T,Hq,D] q.dtype, d_scale [B,Hq,T] float32) from the kernel's float32 acc: one
  memory-bound XLA fusion. Multiply-and-sum, not einsum, so no TF32 dot touches d_scale."""
  s_BTN = jnp.swapaxes(s_BNT, 1, 2)
  dq = (acc_BTND * s_BTN[..., None]).astype(q.dtype)
  ds_BTN = jnp.sum(q.astype(jnp.float32) * acc_BTND, axis=-1)
  return dq, jnp.swapaxes(ds_BTN, 1, 2)


def backward(q, k, v, s_BNT, out, lse_BNT, do, *, causal: bool, blocks, interpret, seg_BT=None):
  """Returns (dq [B,T,Hq,D] q.dtype, dk, dv [B,S,Hkv,D] k.dtype, d_scale [B,Hq,T] float32),
  as `mosaic_bwd.backward` (same arguments, segment ids included; blocks e.g. mosaic.BlockSizes,
  hashable, of which this kernel uses block_q_dkv, block_kv_dkv and max_concurrent_steps)."""
  mosaic_bwd.check(q, k, v, s_BNT, lse_BNT, do, blocks, seg_BT)
  _check_smem(q, blocks)
  c_BNT, delta_BNT = mosaic_bwd.backward_rows(s_BNT, out, do)
  acc_BTND, dk, dv = fused_call(q, k, v, do.astype(q.dtype), c_BNT, lse_BNT, delta_BNT,
                                causal=causal, blocks=blocks, interpret=interpret, seg_BT=seg_BT)
  dq, ds_BNT = epilogue(q, s_BNT, acc_BTND)
  return dq, dk, dv, ds_BNT
