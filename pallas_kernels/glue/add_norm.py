"""Residual add + RMSNorm (h = x + δ, y = rms_norm(h)·s) as one Pallas pass each way.

Forward `add_norm_fwd`, grid (R / block_rows,): reads x, δ, writes h, y; no carries.
Backward `add_norm_bwd`, grid (P,): each program walks its rows in block_rows blocks carrying the
gain gradient Σ g_y·ĥ as an f32 [E] partial ([P, E], summed by XLA);
dh = g_h + r·(g_y·s − ĥ·mean(g_y·s·ĥ)). E is whole and, compiled, a power of two.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.glue.norm_rope import dividing_rows

# 32 float32 values per thread per live [2, E] tile at E = 2048 (bench/add_norm.py).
FWD_BLOCK_ROWS, FWD_NUM_WARPS = 2, 4
BWD_BLOCK_ROWS, BWD_NUM_WARPS = 2, 4
ROWS_PER_PROGRAM = 64


def add_norm_reference(x_RE, d_RE, scale_E, eps: float):
  """(h, y): h = x + δ in x's dtype, y = h / rms(h) · s in x's dtype, statistics in float32."""
  h_RE = x_RE + d_RE
  h32 = h_RE.astype(jnp.float32)
  y = h32 * lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)
  return h_RE, (y * scale_E.astype(jnp.float32)).astype(x_RE.dtype)


def _fwd_kernel(x_ref, d_ref, s_ref, h_ref, y_ref, *, eps):
  f32 = jnp.float32
  h = (x_ref[...].astype(f32) + d_ref[...].astype(f32)).astype(h_ref.dtype)
  h_ref[...] = h
  h32 = h.astype(f32)
  r = lax.rsqrt(jnp.sum(h32 * h32, axis=1) * (1.0 / h32.shape[1]) + eps)[:, None]
  y_ref[...] = (h32 * r * s_ref[...][None, :]).astype(y_ref.dtype)


def _bwd_kernel(h_ref, gh_ref, gy_ref, s_ref, dh_ref, ds_ref, *, eps, block_rows, n_blocks):
  f32 = jnp.float32
  E = h_ref.shape[1]
  s = s_ref[...][None, :]

  def body(j, acc_E):
    rows = pl.ds(j * block_rows, block_rows)
    h = h_ref[rows, :].astype(f32)
    gy = gy_ref[rows, :].astype(f32)
    r = lax.rsqrt(jnp.sum(h * h, axis=1) * (1.0 / E) + eps)[:, None]
    hh = h * r
    du = gy * s
    m = (jnp.sum(du * hh, axis=1) * (1.0 / E))[:, None]
    dh_ref[rows, :] = (gh_ref[rows, :].astype(f32) + r * (du - hh * m)).astype(dh_ref.dtype)
    return acc_E + jnp.sum(gy * hh, axis=0)

  ds_ref[...] = lax.fori_loop(0, n_blocks, body, jnp.zeros((E,), f32))


def _check(name, E, interpret, **same_shape):
  if not interpret and (E & (E - 1) or E < 16):
    raise ValueError(f"{name}: width E={E} must be a power of two ≥ 16 compiled (Triton blocks)")
  shapes = {k: v.shape for k, v in same_shape.items()}
  if len(set(shapes.values())) != 1:
    raise ValueError(f"{name}: want one [R, E] shape; got {shapes}")


def _params(interpret, num_warps):
  return None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=2)


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "num_warps", "interpret"))
def add_norm_fwd(x_RE, d_RE, scale_E, *, eps: float, block_rows: int = FWD_BLOCK_ROWS,
                 num_warps: int = FWD_NUM_WARPS, interpret: bool = False):
  """`add_norm_reference` in one pass: (h, y), both [R, E] in x's dtype; x and δ one dtype."""
  R, E = x_RE.shape
  _check("add_norm_fwd", E, interpret, x=x_RE, d=d_RE)
  if d_RE.dtype != x_RE.dtype:
    raise ValueError(f"add_norm_fwd: want δ in x's dtype {x_RE.dtype}; got {d_RE.dtype}")
  br = dividing_rows(R, block_rows)
  rows = pl.BlockSpec((br, E), lambda i: (i, 0))
  out = jax.ShapeDtypeStruct((R, E), x_RE.dtype)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, eps=float(eps)),
      grid=(R // br,),
      in_specs=[rows, rows, pl.BlockSpec((E,), lambda i: (0,))],
      out_specs=[rows, rows], out_shape=[out, out],
      compiler_params=_params(interpret, num_warps), interpret=interpret, name="add_norm_fwd",
  )(x_RE, d_RE, scale_E.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "num_warps",
                                             "rows_per_program", "interpret"))
def add_norm_bwd(h_RE, scale_E, gh_RE, gy_RE, *, eps: float, block_rows: int = BWD_BLOCK_ROWS,
                 num_warps: int = BWD_NUM_WARPS, rows_per_program: int = ROWS_PER_PROGRAM,
                 interpret: bool = False):
  """(dh, d_scale float32 [E]) for the cotangents g_h, g_y of (h, y)."""
  R, E = h_RE.shape
  _check("add_norm_bwd", E, interpret, h=h_RE, g_h=gh_RE, g_y=gy_RE)
  rp = dividing_rows(R, rows_per_program)
  br = min(dividing_rows(R, block_rows), rp)
  rows = pl.BlockSpec((rp, E), lambda p: (p, 0))
  dh, ds_partial = pl.pallas_call(
      functools.partial(_bwd_kernel, eps=float(eps), block_rows=br, n_blocks=rp // br),
      grid=(R // rp,),
      in_specs=[rows, rows, rows, pl.BlockSpec((E,), lambda p: (0,))],
      out_specs=[rows, pl.BlockSpec((None, E), lambda p: (p, 0))],
      out_shape=[jax.ShapeDtypeStruct((R, E), h_RE.dtype),
                 jax.ShapeDtypeStruct((R // rp, E), jnp.float32)],
      compiler_params=_params(interpret, num_warps), interpret=interpret, name="add_norm_bwd",
  )(h_RE, gh_RE, gy_RE, scale_E.astype(jnp.float32))
  return dh, ds_partial.sum(axis=0)
