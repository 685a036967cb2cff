"""QK-norm then RoPE (x̂ = x·rsqrt(mean(x²) + ε), y = rotate_half(x̂·s)), one Pallas pass each way.

Backward: u = rotate_half(g, cos, −sin), dx = r·(u·s − x̂·mean(u·s·x̂)), ds = Σ u·x̂.
Grid (N, R / block_rows), heads fastest so cos, sin stay in L2; one pass each, no carries; the
gain gradient leaves as f32 partials [N, R / block_rows, D], summed by XLA. Every row is read
once and written once.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# ≤ 16 float32 values per thread for each of ~10 live [rows, D/2] half-tiles at D = 128.
BLOCK_ROWS = 32
NUM_WARPS = 8
BWD_BLOCK_ROWS = 16
BWD_NUM_WARPS = 2


def rotate_half(x_RND, cos_Rd, sin_Rd):
  """Rotate-half RoPE of float32 rows; with −sin it is the inverse (and transpose) rotation."""
  half = x_RND.shape[-1] // 2
  cos, sin = cos_Rd[..., None, :], sin_Rd[..., None, :]
  x1, x2 = x_RND[..., :half], x_RND[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def norm_rope_reference(x_RND, scale_D, cos_Rd, sin_Rd, eps: float):
  """rotate_half(rms_norm(x)·scale) in float32, cast to x's dtype; leading dims are rows."""
  x32 = x_RND.astype(jnp.float32)
  xhat = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return rotate_half(xhat * scale_D.astype(jnp.float32), cos_Rd, sin_Rd).astype(x_RND.dtype)


def _fwd_kernel(x_ref, cos_ref, sin_ref, s_ref, y_ref, *, eps, half):
  f32 = jnp.float32
  lo, hi = pl.ds(0, half), pl.ds(half, half)
  x1, x2 = x_ref[:, lo].astype(f32), x_ref[:, hi].astype(f32)
  c, s = cos_ref[...], sin_ref[...]
  r = lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) * (1.0 / (2 * half))
                + eps)[:, None]
  n1, n2 = x1 * r * s_ref[lo][None, :], x2 * r * s_ref[hi][None, :]
  y_ref[:, lo] = (n1 * c - n2 * s).astype(y_ref.dtype)
  y_ref[:, hi] = (n2 * c + n1 * s).astype(y_ref.dtype)


def _bwd_kernel(x_ref, g_ref, cos_ref, sin_ref, s_ref, dx_ref, ds_ref, *, eps, half):
  f32 = jnp.float32
  lo, hi = pl.ds(0, half), pl.ds(half, half)
  x1, x2 = x_ref[:, lo].astype(f32), x_ref[:, hi].astype(f32)
  g1, g2 = g_ref[:, lo].astype(f32), g_ref[:, hi].astype(f32)
  c, s = cos_ref[...], sin_ref[...]
  u1, u2 = g1 * c + g2 * s, g2 * c - g1 * s
  inv_d = 1.0 / (2 * half)
  r = lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) * inv_d + eps)[:, None]
  xh1, xh2 = x1 * r, x2 * r
  du1, du2 = u1 * s_ref[lo][None, :], u2 * s_ref[hi][None, :]
  m = ((jnp.sum(du1 * xh1, axis=1) + jnp.sum(du2 * xh2, axis=1)) * inv_d)[:, None]
  dx_ref[:, lo] = (r * (du1 - xh1 * m)).astype(dx_ref.dtype)
  dx_ref[:, hi] = (r * (du2 - xh2 * m)).astype(dx_ref.dtype)
  ds_ref[lo] = jnp.sum(u1 * xh1, axis=0)
  ds_ref[hi] = jnp.sum(u2 * xh2, axis=0)


def dividing_rows(R: int, block_rows: int) -> int:
  """The largest power of two ≤ block_rows dividing R (1 if R is odd)."""
  b = block_rows
  while b > 1 and R % b:
    b //= 2
  return b


def _check(name, x_RND, cos_Rd, sin_Rd, interpret):
  R, _, D = x_RND.shape
  if D % 2 or (not interpret and D & (D - 1)):
    raise ValueError(f"{name}: head dim D={D} must be even (a power of two compiled)")
  if cos_Rd.shape != (R, D // 2) or sin_Rd.shape != cos_Rd.shape:
    raise ValueError(f"{name}: want cos/sin {(R, D // 2)}; got {cos_Rd.shape}, {sin_Rd.shape}")


def _pad_rows(R: int, block_rows: int, *arrays):
  """(block rows, padded row count, zero-padded arrays)."""
  br = dividing_rows(R, block_rows)
  if br >= 8:
    return br, R, arrays
  br = min(block_rows, 8)
  Rp = -(-R // br) * br
  pad = lambda a: jnp.pad(a, [(0, Rp - R)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
  return br, Rp, tuple(map(pad, arrays))


def _params(interpret, num_warps):
  return None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=1)


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "num_warps", "interpret"))
def norm_rope_fwd(x_RND, scale_D, cos_Rd, sin_Rd, *, eps: float, block_rows: int = BLOCK_ROWS,
                  num_warps: int = NUM_WARPS, interpret: bool = False):
  """`norm_rope_reference` in one pass: y in x's dtype, [R, N, D]. Shapes as norm_rope_bwd's."""
  R, N, D = x_RND.shape
  _check("norm_rope_fwd", x_RND, cos_Rd, sin_Rd, interpret)
  br, Rp, (x_RND, cos_Rd, sin_Rd) = _pad_rows(R, block_rows, x_RND, cos_Rd, sin_Rd)
  rows = pl.BlockSpec((br, None, D), lambda h, i: (i, h, 0))
  table = pl.BlockSpec((br, D // 2), lambda h, i: (i, 0))
  y = pl.pallas_call(
      functools.partial(_fwd_kernel, eps=float(eps), half=D // 2),
      grid=(N, Rp // br),
      in_specs=[rows, table, table, pl.BlockSpec((D,), lambda h, i: (0,))],
      out_specs=rows,
      out_shape=jax.ShapeDtypeStruct((Rp, N, D), x_RND.dtype),
      compiler_params=_params(interpret, num_warps), interpret=interpret, name="norm_rope_fwd",
  )(x_RND, cos_Rd.astype(jnp.float32), sin_Rd.astype(jnp.float32), scale_D.astype(jnp.float32))
  return y[:R]


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "num_warps", "interpret"))
def norm_rope_bwd(x_RND, scale_D, cos_Rd, sin_Rd, g_RND, *, eps: float,
                  block_rows: int = BWD_BLOCK_ROWS, num_warps: int = BWD_NUM_WARPS,
                  interpret: bool = False):
  """(dx, d_scale f32 [D]) for the cotangent g; x, g [R, N, D]; cos, sin f32 [R, D/2]."""
  R, N, D = x_RND.shape
  _check("norm_rope_bwd", x_RND, cos_Rd, sin_Rd, interpret)
  if g_RND.shape != x_RND.shape:
    raise ValueError(f"norm_rope_bwd: want g {x_RND.shape}; got {g_RND.shape}")
  br, Rp, (x_RND, g_RND, cos_Rd, sin_Rd) = _pad_rows(R, block_rows, x_RND, g_RND, cos_Rd, sin_Rd)
  rows = pl.BlockSpec((br, None, D), lambda h, i: (i, h, 0))
  table = pl.BlockSpec((br, D // 2), lambda h, i: (i, 0))
  dx, ds_partial = pl.pallas_call(
      functools.partial(_bwd_kernel, eps=float(eps), half=D // 2),
      grid=(N, Rp // br),
      in_specs=[rows, rows, table, table, pl.BlockSpec((D,), lambda h, i: (0,))],
      out_specs=[rows, pl.BlockSpec((None, None, D), lambda h, i: (h, i, 0))],
      out_shape=[jax.ShapeDtypeStruct((Rp, N, D), x_RND.dtype),
                 jax.ShapeDtypeStruct((N, Rp // br, D), jnp.float32)],
      compiler_params=_params(interpret, num_warps), interpret=interpret, name="norm_rope_bwd",
  )(x_RND, g_RND, cos_Rd.astype(jnp.float32), sin_Rd.astype(jnp.float32),
    scale_D.astype(jnp.float32))
  return dx[:R], ds_partial.sum(axis=(0, 1))
