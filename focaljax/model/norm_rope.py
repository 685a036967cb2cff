"""RMSNorm and rotary embeddings: the explicit RMSNorm backward, the RoPE tables, and QK-norm
followed by RoPE as one custom VJP whose passes are Pallas (`pallas_kernels.glue.norm_rope`),
which the model runs where `focaljax.dispatch` picks them (GPUs).

Einsum letters as in decoder.py: B batch, T positions, N heads, D head dim, d = D/2, R rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from focaljax import sharding
from pallas_kernels.glue import norm_rope as nr


def _column_sum(v_RD):
  """Σ over rows of a [rows, D] float32 array in two stages: blocks of up to 1024 rows first,
  so the first reduction has (rows/G)·D outputs, not just D; the barrier keeps XLA from merging
  the stages (one [D] reduction over all rows is a long serial chain per output)."""
  R, D = v_RD.shape
  G = next(g for g in (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1) if R % g == 0)
  partial = jax.lax.optimization_barrier(v_RD.reshape(R // G, G, D).sum(axis=1))
  return partial.sum(axis=0)


def _rms_norm(x, scale_D, eps: float):
  # Statistics in float32: bf16 mean-of-squares loses precision over d_model terms.
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale_D.astype(jnp.float32)).astype(x.dtype)


# x / rms(x) · scale over the last axis, in x's dtype. The backward recomputes 1/rms from x (the
# only residual besides the gain) and keeps the whole gradient in float32.
rms_norm = jax.custom_vjp(_rms_norm, nondiff_argnums=(2,))


def _rms_norm_fwd(x, scale_D, eps):
  return rms_norm(x, scale_D, eps), (x, scale_D)


def _rms_norm_bwd(eps, res, g):
  x, scale_D = res
  x32, g32 = x.astype(jnp.float32), g.astype(jnp.float32)
  rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  xhat = x32 * rstd
  dxhat = g32 * scale_D.astype(jnp.float32)
  dx = rstd * (dxhat - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
  d_scale = _column_sum((g32 * xhat).reshape(-1, x.shape[-1]))
  return dx.astype(x.dtype), d_scale.astype(scale_D.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
  """Llama 3.1's RoPE frequencies (HF rope_type "llama3"): wavelengths longer than
  original_max_position_embeddings / low_freq_factor are stretched by `factor`, those shorter
  than original_max_position_embeddings / high_freq_factor are kept, and the band between is
  interpolated linearly in original_max_position_embeddings / wavelength."""
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


def rope_tables(positions_BT, theta, D: int, scaling: Llama3Scaling | None = None):
  """cos, sin [B, T, D/2] float32 of the angles p·f_i, f_i = θ^(-2i/D) (Llama 3 scaled with
  `scaling`): the one place the formula lives."""
  inv_freq_d = theta ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)
  if scaling is not None:
    s = scaling
    periods_d = s.original_max_position_embeddings * inv_freq_d / (2 * jnp.pi)
    smooth_d = jnp.clip((periods_d - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor),
                        0.0, 1.0)
    inv_freq_d = inv_freq_d * ((1 - smooth_d) / s.factor + smooth_d)
  angle_BTd = positions_BT[..., None].astype(jnp.float32) * inv_freq_d
  return jnp.cos(angle_BTd), jnp.sin(angle_BTd)


def apply_rope(x_BTND, positions_BT, theta: float, scaling: Llama3Scaling | None = None):
  """Rotate-half RoPE (the LLaMA / Hugging Face convention, so imported weights agree)."""
  cos_BTd, sin_BTd = rope_tables(positions_BT, theta, x_BTND.shape[-1], scaling)
  return nr.rotate_half(x_BTND.astype(jnp.float32), cos_BTd, sin_BTd).astype(x_BTND.dtype)


def _qk_norm_rope(x_BTND, scale_D, cos_BTd, sin_BTd, eps: float, interpret: bool):
  def local(x, s, c, sn):
    x_RND, c_Rd, sn_Rd = _flat(x, c, sn)
    return nr.norm_rope_fwd(x_RND, s, c_Rd, sn_Rd, eps=eps, interpret=interpret).reshape(x.shape)
  return _per_device(local, [_X], x_BTND, scale_D, cos_BTd, sin_BTd)


# apply_rope(rms_norm(x, scale)) with the tables precomputed, one Pallas pass each way: the
# forward reads x once (XLA's wrote the normalised rows in float32 and read them back to rotate
# them), the backward un-rotates the cotangent once instead of inside each of RMSNorm's two
# reductions.
qk_norm_rope = jax.custom_vjp(_qk_norm_rope, nondiff_argnums=(4, 5))


def _qk_norm_rope_fwd(x_BTND, scale_D, cos_BTd, sin_BTd, eps, interpret):
  return (qk_norm_rope(x_BTND, scale_D, cos_BTd, sin_BTd, eps, interpret),
          (x_BTND, scale_D, cos_BTd, sin_BTd))


def _qk_norm_rope_bwd(eps, interpret, res, g_BTND):
  x_BTND, scale_D, cos_BTd, sin_BTd = res

  def local(x, s, c, sn, g):
    (x_RND, c_Rd, sn_Rd), (g_RND,) = _flat(x, c, sn), _flat(g)
    dx, ds = nr.norm_rope_bwd(x_RND, s, c_Rd, sn_Rd, g_RND, eps=eps, interpret=interpret)
    return dx.reshape(x.shape), ds
  dx_BTND, d_scale = _per_device(local, [_X, sharding.SUMMED], x_BTND, scale_D, cos_BTd,
                                 sin_BTd, g_BTND)
  # cos/sin come from integer positions: nothing upstream wants their cotangents.
  return (dx_BTND, d_scale.astype(scale_D.dtype), jnp.zeros_like(cos_BTd),
          jnp.zeros_like(sin_BTd))


qk_norm_rope.defvjp(_qk_norm_rope_fwd, _qk_norm_rope_bwd)

_X = ("batch", None, "heads", None)
_TABLE = ("batch", None, None)


def _per_device(local, out_axes, x_BTND, scale_D, cos_BTd, sin_BTd, *more_BTND):
  """local(x, scale, cos, sin, *more) on each device's rows and heads (sharding.per_device);
  the tables are broadcast to [B, T, D/2] so they split with x's rows."""
  B, T, _, D = x_BTND.shape
  cos_BTd, sin_BTd = (jnp.broadcast_to(a, (B, T, D // 2)) for a in (cos_BTd, sin_BTd))
  in_axes = (_X, None, _TABLE, _TABLE) + (_X,) * len(more_BTND)
  out = out_axes[0] if len(out_axes) == 1 else out_axes
  return sharding.per_device(local, in_axes, out)(x_BTND, scale_D, cos_BTd, sin_BTd, *more_BTND)


def _flat(x_BTND, *tables_BTd):
  """[B·T, N, D] rows of x and [B·T, D/2] rows of each table, the kernels' layout."""
  B, T, N, D = x_BTND.shape
  return (x_BTND.reshape(B * T, N, D),) + tuple(t.reshape(B * T, D // 2) for t in tables_BTd)
