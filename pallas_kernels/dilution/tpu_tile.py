"""Per-tile math and pallas_call plumbing shared by the TPU dilution passes (tpu.py, tpu_bwd.py).

A tile is bq rows × bk keys of one (batch, query head); logits and probabilities are float32 and
exactly 0 where masked (causal, other segment). `tile_specs` maps a pass's grid indices to the
q, k/v, segment-id and row-statistic blocks; kv blocks follow GQA by index map.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.focal import reference

MASK_VALUE = reference.MASK_VALUE


def idiv(a, b):
  """Non-negative int32 division without floor-division's sign fix-ups (index maps)."""
  return lax.div(jnp.asarray(a, jnp.int32), jnp.int32(b))


def dot(a, b, *, ta=False, tb=False):
  """a·b with f32 accumulation; f32 operands at full precision (masks, 32-bit inputs)."""
  prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def tri(n, upper):
  """0/1 float32 [n, n]: strictly lower (row > col: rows above) or strictly upper (rows below)."""
  r = lax.broadcasted_iota(jnp.int32, (n, n), 0)
  c = lax.broadcasted_iota(jnp.int32, (n, n), 1)
  return ((r < c) if upper else (r > c)).astype(jnp.float32)


def tile_logits(q_TD, k_SD, segq_T1, segk_1S, r0, k0, scale):
  """(scale·q kᵀ, visible) of a tile: causal (row r sees key c <= r) and same segment."""
  s_TS = dot(q_TD, k_SD, tb=True) * scale
  shape = s_TS.shape
  vis = ((r0 + lax.broadcasted_iota(jnp.int32, shape, 0)
          >= k0 + lax.broadcasted_iota(jnp.int32, shape, 1)) & (segq_T1 == segk_1S))
  return s_TS, vis


def tile_probs(q_TD, k_SD, lse_T1, segq_T1, segk_1S, r0, k0, scale):
  """Softmax probabilities of a tile, float32, exactly 0 where masked."""
  s_TS, vis = tile_logits(q_TD, k_SD, segq_T1, segk_1S, r0, k0, scale)
  return jnp.exp(jnp.where(vis, s_TS - lse_T1, -jnp.inf))


def tpu_call(kernel, grid, in_specs, out_specs, out_shape, scratch, semantics, interpret, name):
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0, grid=grid, in_specs=in_specs,
                                             out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
      interpret=pltpu.InterpretParams() if interpret else False,
      name=name)


def f32(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def vmem(*shape):
  return pltpu.VMEM(shape, jnp.float32)


def tile_specs(D, G, bq, bk, row, key):
  """BlockSpecs (rows [bq, D], kv [bk, D], segq, segk, row stats [bq, 1]) for a grid whose
  indices after (b, h) map to row block row(*g) and key block key(*g)."""
  rows = lambda b, h, *g: (b, h, row(*g), 0)
  return (pl.BlockSpec((None, None, bq, D), rows),
          pl.BlockSpec((None, None, bk, D), lambda b, h, *g: (b, idiv(h, G), key(*g), 0)),
          pl.BlockSpec((None, bq, 1), lambda b, h, *g: (b, row(*g), 0)),
          pl.BlockSpec((None, 1, bk), lambda b, h, *g: (b, 0, key(*g))),
          pl.BlockSpec((None, None, bq, 1), rows))

