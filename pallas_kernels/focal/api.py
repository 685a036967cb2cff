"""Focal attention entry: softmax(scale · q·kᵀ) · v with a differentiable per-query temperature
on the backend the caller names: "triton" (FlashAttention-2, any GPU), "mosaic" (FlashAttention-3
on Hopper for calls `mosaic.supported` accepts, Triton otherwise) or "tpu". Holds the Triton
custom_vjp; residuals q, k, v, scale [B, Hq, T] f32, segment ids, out and the base-2 lse.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.focal import mosaic
from pallas_kernels.focal import reference
from pallas_kernels.focal import tpu
from pallas_kernels.focal import triton
from pallas_kernels.focal import triton_bwd

BACKENDS = ("triton", "mosaic", "tpu")


def focal_attention(q, k, v, *, scale, causal: bool = True, segment_ids=None,
                    backend: str = "triton", block_sizes=None, interpret: bool = False):
  """q [B, T, Hq, D]; k, v [B, S, Hkv, D]; `scale` float or broadcastable to [B, Hq, T];
  `segment_ids` int [B, T] (T == S). `block_sizes`: None or the backend's class (the Mosaic
  fallback uses the Triton default; "tpu" picks its own). Returns [B, T, Hq, D] in q.dtype.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
  if backend == "tpu":
    if block_sizes is not None:
      raise ValueError("block_sizes: the 'tpu' backend picks its own tiles; pass None")
    if interpret:
      raise ValueError("interpret: the 'tpu' backend has no interpret flag; run it under "
                       "jax.experimental.pallas.tpu.force_tpu_interpret_mode() instead")
    return tpu.focal_attention(q, k, v, scale=scale, causal=causal, segment_ids=segment_ids)
  if backend == "mosaic":
    _check_blocks(block_sizes, mosaic.BlockSizes, "mosaic", "MosaicBlockSizes")
    # int32 as the Triton path casts them, so an int64 batch does not silently fall back.
    seg_BT = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    if mosaic.supported(q, k, v, seg_BT, causal, blocks=block_sizes) is None:
      return mosaic.focal_attention(q, k, v, scale=scale, causal=causal, segment_ids=seg_BT,
                                    interpret=interpret, block_sizes=block_sizes)
    block_sizes = None
  _check_blocks(block_sizes, triton.BlockSizes, "triton", "BlockSizes")
  return _attention(q, k, v, scale, segment_ids, causal=causal, interpret=interpret,
                    block_sizes=block_sizes or triton.BlockSizes.default(q.shape[-1], q.dtype))


def tiles_fit(T: int, S: int, head_dim: int, dtype) -> bool:
  """Whether the Triton kernels (and so the Mosaic fallback) take lengths T and S at their
  default tiles: the kernels do not pad."""
  return triton.tiles_fit(T, S, triton.BlockSizes.default(head_dim, dtype))


def _check_blocks(blocks, cls, backend: str, public_name: str):
  if blocks is not None and not isinstance(blocks, cls):
    raise ValueError(f"block_sizes: backend={backend!r} takes pallas_kernels.focal.{public_name} "
                     f"or None; got {type(blocks).__module__}.{type(blocks).__name__}")


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything static one call needs (hashable: custom_vjp nondiff arg and jit key)."""
  causal: bool
  blocks: triton.BlockSizes
  interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, s_BNT, seg_BT, st: _Static):
  return triton.forward(q, k, v, s_BNT, seg_BT, causal=st.causal, blocks=st.blocks,
                        interpret=st.interpret)[0]


def _flash_fwd(q, k, v, s_BNT, seg_BT, st: _Static):
  out, lse_BNT = triton.forward(q, k, v, s_BNT, seg_BT, causal=st.causal, blocks=st.blocks,
                                interpret=st.interpret)
  return out, (q, k, v, s_BNT, seg_BT, out, lse_BNT)


def _flash_bwd(st: _Static, res, do):
  dq, dk, dv, ds_BNT = triton_bwd.backward(*res, do, causal=st.causal, blocks=st.blocks,
                                           interpret=st.interpret)
  return dq, dk, dv, ds_BNT, None  # integer segment ids: no cotangent


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.jit, static_argnames=("causal", "interpret", "block_sizes"))
def _attention(q, k, v, scale, segment_ids, *, causal: bool, interpret: bool,
               block_sizes: triton.BlockSizes):
  B, T, _, N, _, _ = triton.check(q, k, v, segment_ids, block_sizes)
  s_BNT = reference.scale_BNT(scale, B, N, T)  # broadcast's transpose sums d_scale back
  seg_BT = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  return _flash(q, k, v, s_BNT, seg_BT, _Static(causal, block_sizes, interpret))
