"""SwiGLU's silu(gate)·up as Pallas (Triton) elementwise passes, f32 math, one rounding.

Arrays are viewed as [rows, LANES] (zero-padded only when needed); grid (rows / block_rows,);
no carries. Backward: d_gate = dh·u·σ·(1 + g·(1 − σ)), d_up = dh·g·σ.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

LANES = 1024
# 4 x 1024 elements over 4 warps: 32 float32 values per thread for each of ~6 live arrays.
BLOCK_ROWS = 4


def swiglu_reference(gate, up):
  g32 = gate.astype(jnp.float32)
  return (g32 * jax.nn.sigmoid(g32) * up.astype(jnp.float32)).astype(
      jnp.result_type(gate, up))


def _sigmoid(g32):
  return 1.0 / (1.0 + jnp.exp(-g32))


def _fwd_kernel(g_ref, u_ref, h_ref):
  g32 = g_ref[...].astype(jnp.float32)
  h_ref[...] = (g32 * _sigmoid(g32) * u_ref[...].astype(jnp.float32)).astype(h_ref.dtype)


def _bwd_kernel(g_ref, u_ref, dh_ref, dg_ref, du_ref):
  g32, u32 = g_ref[...].astype(jnp.float32), u_ref[...].astype(jnp.float32)
  dh32 = dh_ref[...].astype(jnp.float32)
  s32 = _sigmoid(g32)
  # d silu(g)/dg = σ·(1 + g·(1 − σ)): finite for any finite g (σ → 0 makes the product 0).
  dg_ref[...] = (dh32 * u32 * s32 * (1 + g32 * (1 - s32))).astype(dg_ref.dtype)
  du_ref[...] = (dh32 * g32 * s32).astype(du_ref.dtype)


def _tiles(*arrays, block_rows):
  """Flatten to [rows, LANES], rows padded to a multiple of block_rows (zeros: silu(0)·0 = 0)."""
  n = arrays[0].size
  rows = -(-n // LANES)
  rows_p = -(-rows // block_rows) * block_rows
  flat = [jnp.pad(a.reshape(-1), (0, rows_p * LANES - n)).reshape(rows_p, LANES)
          for a in arrays]
  return flat, rows_p


def _call(kernel, inputs, out_dtypes, *, block_rows, interpret, name):
  shape = inputs[0].shape
  flat, rows_p = _tiles(*inputs, block_rows=block_rows)
  spec = pl.BlockSpec((block_rows, LANES), lambda i: (i, 0))
  outs = pl.pallas_call(
      kernel, grid=(rows_p // block_rows,),
      in_specs=[spec] * len(flat), out_specs=[spec] * len(out_dtypes),
      out_shape=[jax.ShapeDtypeStruct((rows_p, LANES), d) for d in out_dtypes],
      compiler_params=None if interpret else pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret, name=name)(*flat)
  n = inputs[0].size
  return [o.reshape(-1)[:n].reshape(shape) for o in outs]


@functools.partial(jax.jit, static_argnames=("block_rows", "interpret"))
def swiglu_fwd(gate, up, *, block_rows: int = BLOCK_ROWS, interpret: bool = False):
  """silu(gate)·up for same-shaped gate and up; returns the inputs' result dtype."""
  if gate.shape != up.shape:
    raise ValueError(f"swiglu: gate {gate.shape} and up {up.shape} must have one shape")
  return _call(_fwd_kernel, [gate, up], [jnp.result_type(gate, up)], block_rows=block_rows,
               interpret=interpret, name="swiglu_fwd")[0]


@functools.partial(jax.jit, static_argnames=("block_rows", "interpret"))
def swiglu_bwd(gate, up, dh, *, block_rows: int = BLOCK_ROWS, interpret: bool = False):
  """(d_gate, d_up) in gate's and up's dtypes for the cotangent dh of silu(gate)·up."""
  if not gate.shape == up.shape == dh.shape:
    raise ValueError(f"swiglu: gate {gate.shape}, up {up.shape} and dh {dh.shape} must have one "
                     "shape")
  dg, du = _call(_bwd_kernel, [gate, up, dh], [gate.dtype, up.dtype], block_rows=block_rows,
                 interpret=interpret, name="swiglu_bwd")
  return dg, du
