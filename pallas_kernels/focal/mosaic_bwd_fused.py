"""Single-pass Hopper (Mosaic GPU) focal backward (FA3 Algorithm 3): dq, dk, dv, d_scale.

Grid (Hkv, S / (W·block_kv_dkv), B), the ring and masks of `mosaic_dkv`: k, v resident, dk, dv
f32 in registers; per [bkv, bq] step r = k·qᵀ, dv += p·dO, dP = v·dOᵀ, dk += (s ⊙ dx)·q, and
dxᵀ·k goes through an f32 SMEM tile into a TMA reduce-add of acc [B, T, Hq, D] f32 (aliased GMEM
Ref). XLA then forms dq = s·acc and d_scale = Σ q·acc. dq is not bitwise reproducible.
SMEM W·2·bkv·D·2 + C·(2·bq·D·2) + W·bkv·bq·2 + W·bq·D·4 (C = 3 does not fit at D = 128).
Interpreted there is no TMA reduction: acc gets one slab per kv tile, summed by XLA.
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
  b, kv_head, wg, cta_k0, i_lo, per_head = mosaic_dkv.cta_start(causal=causal, bq=bq, bkv=bkv,
                                                                 n_q=n_q)
  seg_ref, _, segq_s = seg or (None, None, None)

  @pl.when(wg < W)
  def _compute():
    k0, rows, segk_K = mosaic_dkv.load_resident(k_ref, v_ref, k_s, v_s, res_bar, seg, b=b,
                                                kv_head=kv_head, wg=wg, cta_k0=cta_k0, bkv=bkv,
                                                interpret=interpret)
    # Interpreted: this warpgroup's own slab (no TMA reduction there; module docstring).
    slab = lax.div(k0, jnp.int32(bkv))
    acc = acc_ref.at[slab] if interpret else acc_ref
    ds_KQ_s, dq_QD_s = ds_s.at[wg], dq_s.at[wg]

    def step(t, carry, *, g, masked):
      dk_KD, dv_KD = carry
      i, slot, c_Q, dv_KD, dx_KQ = mosaic_dkv.step_dx(
          t, dv_KD, g=g, masked=masked, wg=wg, k_s=k_s, v_s=v_s, q_s=q_s, do_s=do_s, c_s=c_s,
          lse_s=lse_s, delta_s=delta_s, q_bar=q_bar, segk_K=segk_K, segq_s=segq_s, i_lo=i_lo,
          per_head=per_head, steps=steps, k0=k0, bq=bq, bkv=bkv, interpret=interpret)

      def store_ds():  # overlapped with the dk wgmma; the last step's dsᵀ·k was awaited
        ds_KQ_s[...] = dx_KQ.astype(ds_KQ_s.dtype)
        plgpu.commit_smem()  # visible to the wgmma below (async proxy)

      # dk contracts over queries: the temperature scales each query's column first.
      dxs_KQ = (dx_KQ * mc.bcast(c_Q * LN2, dx_KQ.shape, 1)).astype(q_s.dtype)
      dk_KD = mc.mma(dxs_KQ, q_s.at[slot], acc=dk_KD, during=store_ds, interpret=interpret)
      plgpu.barrier_arrive(q_free.at[slot])  # q, dO and rows of this slot are no longer read
      n = kv_head * group + g
      acc_QD = mc.mma_t(ds_KQ_s, k_s.at[wg], interpret=interpret)
      dst = acc.at[b, pl.ds(i * bq, bq), n]
      # f32 dq tile → SMEM → TMA reduce-add, once the previous reduce has read the tile.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      dq_QD_s[...] = acc_QD
      plgpu.commit_smem()
      mc.copy_smem_to_gmem_add(dq_QD_s, dst, interpret=interpret)
      return dk_KD, dv_KD

    dk_KD, dv_KD = mosaic_dkv.visit_q_blocks(
        step, causal=causal, group=group, per_head=per_head, steps=steps, k0=k0, bq=bq, bkv=bkv,
        i_lo=i_lo, q_bar=q_bar, q_free=q_free, D=k_s.shape[-1], interpret=interpret)
    # k, v tiles are free (the last dsᵀ·k was awaited); the wait covers the last dq reduce.
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
  """The kernel: (acc [B,T,Hq,D] f32 = Σ_s dx_ts k_s, dk, dv [B,S,Hkv,D] k.dtype)."""
  S, D = k.shape[1], q.shape[3]
  flag, _ = mc.launch_params(interpret)
  bq, bkv = blocks.block_q_dkv, blocks.block_kv_dkv
  acc_shape = (S // bkv, *q.shape) if flag else q.shape  # interpreted: one slab per kv tile
  acc_ref = jax.new_ref(jnp.zeros(acc_shape, jnp.float32), memory_space=plgpu.GMEM)
  # 128-byte swizzle: 64 16-bit or 32 float32 elements per row (the wgmma / TMA tile).
  f32_tile = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
  segments = seg_BT is not None
  operands = (q, k, v, do, c_BNT, lse_BNT, delta_BNT, acc_ref) + ((seg_BT,) if segments else ())
  dk, dv = mosaic_dkv.launch(
      _kernel, operands, q, k, causal=causal, blocks=blocks, interpret=interpret,
      segments=segments, name="focal_mgpu_bwd_fused", ref=True, extra=(
          mc.tile_smem((W, bkv, bq), q.dtype),                          # ds = dx, 16-bit
          plgpu.SMEM((W, bq, D), jnp.float32, transforms=f32_tile)))    # dq tile to reduce
  acc = acc_ref[...]
  return (acc.sum(axis=0) if flag else acc), dk, dv


def epilogue(q, s_BNT, acc_BTND):
  """(dq, d_scale) from acc by multiply-and-sum (no TF32 dot touches d_scale)."""
  s_BTN = jnp.swapaxes(s_BNT, 1, 2)
  dq = (acc_BTND * s_BTN[..., None]).astype(q.dtype)
  ds_BTN = jnp.sum(q.astype(jnp.float32) * acc_BTND, axis=-1)
  return dq, jnp.swapaxes(ds_BTN, 1, 2)


def backward(q, k, v, s_BNT, out, lse_BNT, do, *, causal: bool, blocks, interpret, seg_BT=None):
  """As `mosaic_bwd.backward`, in one kernel."""
  mosaic_bwd.check(q, k, v, s_BNT, lse_BNT, do, blocks, seg_BT)
  _check_smem(q, blocks)
  c_BNT, delta_BNT = mosaic_bwd.backward_rows(s_BNT, out, do)
  acc_BTND, dk, dv = fused_call(q, k, v, do.astype(q.dtype), c_BNT, lse_BNT, delta_BNT,
                                causal=causal, blocks=blocks, interpret=interpret, seg_BT=seg_BT)
  dq, ds_BNT = epilogue(q, s_BNT, acc_BTND)
  return dq, dk, dv, ds_BNT
