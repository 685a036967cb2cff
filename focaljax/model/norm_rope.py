"""RMSNorm and rotary embeddings: the explicit RMSNorm backward, the RoPE tables, and QK-norm
followed by RoPE as one custom VJP whose backward is XLA ("fused") or one Pallas pass ("pallas",
`pallas_kernels.glue.norm_rope`).

Einsum letters as in model.py: B batch, T positions, N heads, D head dim, d = D/2, R rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from focaljax import ops
from focaljax import sharding
from pallas_kernels.glue import norm_rope as nr


def _column_sum(v_RD):
  """Σ over rows of a [rows, D] float32 array in two stages: blocks of up to 1024 rows first,
  so the first reduction has (rows/G)·D outputs, not just D; the barrier keeps XLA from merging
  the stages. Meant for the [B·T·N, 128] QK-norm gain gradient; on the H200 the 1.3B step moved
  271.7 -> 270.3 ms (noise), and the attention block's big reductions stayed (BENCHMARKS.md)."""
  R, D = v_RD.shape
  G = next(g for g in (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1) if R % g == 0)
  partial = jax.lax.optimization_barrier(v_RD.reshape(R // G, G, D).sum(axis=1))
  return partial.sum(axis=0)


def _rms_norm32(x, scale_D, eps: float):
  # Statistics in float32: bf16 mean-of-squares loses precision over d_model terms.
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y * scale_D.astype(jnp.float32)


def _rms_norm(x, scale_D, eps: float):
  return _rms_norm32(x, scale_D, eps).astype(x.dtype)


# x / rms(x) · scale over the last axis, in x's dtype. The backward recomputes 1/rms from x (the
# only residual besides the gain) and keeps the whole gradient in float32.
rms_norm = jax.custom_vjp(_rms_norm, nondiff_argnums=(2,))


def _rms_norm_fwd(x, scale_D, eps):
  return rms_norm(x, scale_D, eps), (x, scale_D)


def _rms_norm_vjp32(x, scale_D, eps, g32):
  """(dx, d_scale) in float32 for the float32 cotangent g32 of the normalized output."""
  x32 = x.astype(jnp.float32)
  rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  xhat = x32 * rstd
  dxhat = g32 * scale_D.astype(jnp.float32)
  dx = rstd * (dxhat - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
  return dx, _column_sum((g32 * xhat).reshape(-1, x.shape[-1]))


def _rms_norm_bwd(eps, res, g):
  x, scale_D = res
  dx, d_scale = _rms_norm_vjp32(x, scale_D, eps, g.astype(jnp.float32))
  return dx.astype(x.dtype), d_scale.astype(scale_D.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rope_tables(positions_BT, theta, D: int):
  """cos, sin [B, T, D/2] float32 of the angles p·θ^(-2i/D): the one place the formula lives."""
  inv_freq = theta ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)
  angle_BTd = positions_BT[..., None].astype(jnp.float32) * inv_freq
  return jnp.cos(angle_BTd), jnp.sin(angle_BTd)


def apply_rope(x_BTND, positions_BT, theta: float):
  """Rotate-half RoPE (the LLaMA / Hugging Face convention, so imported weights agree)."""
  cos_BTd, sin_BTd = rope_tables(positions_BT, theta, x_BTND.shape[-1])
  return nr.rotate_half(x_BTND.astype(jnp.float32), cos_BTd, sin_BTd).astype(x_BTND.dtype)


def _qk_norm_rope(x_BTND, scale_D, cos_BTd, sin_BTd, eps: float, backward: str = "fused"):
  if _use_pallas(backward):
    return _pallas_fwd(x_BTND, scale_D, cos_BTd, sin_BTd, eps)
  # One cast at the end: the separate pair rounds to x's dtype between the norm and the rotation.
  y_BTND = nr.rotate_half(_rms_norm32(x_BTND, scale_D, eps), cos_BTd, sin_BTd)
  return y_BTND.astype(x_BTND.dtype)


def _use_pallas(backward: str) -> bool:
  # The kernels are Triton (interpreted on CPU); the TPU keeps XLA's passes.
  return backward == "pallas" and jax.default_backend() != "tpu"


# apply_rope(rms_norm(x, scale)) with the tables precomputed, as one custom VJP. Its backward
# un-rotates the cotangent once, instead of inside each of RMSNorm's two reductions. With
# backward="pallas" both directions are one Pallas pass each (XLA's forward wrote the normalised
# rows in float32 and read them back to rotate them).
qk_norm_rope = jax.custom_vjp(_qk_norm_rope, nondiff_argnums=(4, 5))


def _qk_norm_rope_fwd(x_BTND, scale_D, cos_BTd, sin_BTd, eps, backward):
  return (qk_norm_rope(x_BTND, scale_D, cos_BTd, sin_BTd, eps, backward),
          (x_BTND, scale_D, cos_BTd, sin_BTd))


def _qk_norm_rope_bwd(eps, backward, res, g_BTND):
  x_BTND, scale_D, cos_BTd, sin_BTd = res
  # cos/sin come from integer positions: nothing upstream wants their cotangents.
  no_tables = (jnp.zeros_like(cos_BTd), jnp.zeros_like(sin_BTd))
  if _use_pallas(backward):
    dx_BTND, d_scale = _pallas_bwd(x_BTND, scale_D, cos_BTd, sin_BTd, g_BTND, eps)
    return (dx_BTND, d_scale.astype(scale_D.dtype)) + no_tables
  # Stage 1, elementwise: the rotation is orthogonal, so its transpose is the rotation by -angle.
  # The cotangent comes in attention's [B, N, T, D] physical layout, and fused into the norm's
  # reductions its un-rotation cost ~230 µs each (1.3B, H200). [B, T, N·D] has no layout that
  # is a bitcast of [B, N, T, D], so the transpose must happen here, in an elementwise fusion that
  # writes float32 once; the barrier keeps XLA from fusing it into stage 2. (Merging N into D, not
  # B·T·N rows, keeps a tensor-sharded heads axis expressible.)
  shape_BTC = g_BTND.shape[:-2] + (-1,)
  g32_BTC = nr.rotate_half(g_BTND.astype(jnp.float32), cos_BTd, -sin_BTd).reshape(shape_BTC)
  g32_BTND = jax.lax.optimization_barrier(g32_BTC).reshape(g_BTND.shape)
  # Stage 2: RMSNorm's backward on the un-rotated cotangent, reading contiguous rows.
  dx_BTND, d_scale = _rms_norm_vjp32(x_BTND, scale_D, eps, g32_BTND)
  return (dx_BTND.astype(x_BTND.dtype), d_scale.astype(scale_D.dtype)) + no_tables


qk_norm_rope.defvjp(_qk_norm_rope_fwd, _qk_norm_rope_bwd)


def _per_device(local, x_BTND, scale_D, cos_BTd, sin_BTd, *more_BTND, sums_scale: bool):
  """local(x, scale, cos, sin, *more) on each device's rows ("batch") and heads: a pallas_call has
  no partitioning rule, so under a mesh it is shard_map'd over the axes that divide x. With
  sums_scale its second output (the gain's gradient) is summed over those axes."""
  B, T, _, D = x_BTND.shape
  cos_BTd, sin_BTd = (jnp.broadcast_to(a, (B, T, D // 2)) for a in (cos_BTd, sin_BTd))
  args = (x_BTND, scale_D, cos_BTd, sin_BTd, *more_BTND)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return local(*args)
  xs = sharding.dividing_spec(mesh, ("batch", None, "heads", None), x_BTND.shape)
  # The mesh axes that split x (a PartitionSpec entry is an axis name or a tuple of them).
  summed = tuple(a for part in xs if part for a in ((part,) if isinstance(part, str) else part))
  if not summed:
    return local(*args)
  ts = P(xs[0], None, None)
  in_specs = (xs, P(), ts, ts) + (xs,) * len(more_BTND)
  if not sums_scale:
    return jax.shard_map(local, in_specs=in_specs, out_specs=xs, check_vma=False)(*args)

  def sharded(*a):
    dx, ds = local(*a)
    return dx, jax.lax.psum(ds, summed)
  return jax.shard_map(sharded, in_specs=in_specs, out_specs=(xs, P()), check_vma=False)(*args)


def _flat(x_BTND, *tables_BTd):
  """[B·T, N, D] rows of x and [B·T, D/2] rows of each table, the kernels' layout."""
  B, T, N, D = x_BTND.shape
  return (x_BTND.reshape(B * T, N, D),) + tuple(t.reshape(B * T, D // 2) for t in tables_BTd)


def _pallas_fwd(x_BTND, scale_D, cos_BTd, sin_BTd, eps):
  """y through `pallas_kernels.glue.norm_rope.norm_rope_fwd`, per device (`_per_device`)."""

  def local(x, s, c, sn):
    x_RND, c_Rd, sn_Rd = _flat(x, c, sn)
    y_RND = nr.norm_rope_fwd(x_RND, s, c_Rd, sn_Rd, eps=eps,
                             interpret=ops._interpret())  # pylint: disable=protected-access
    return y_RND.reshape(x.shape)
  return _per_device(local, x_BTND, scale_D, cos_BTd, sin_BTd, sums_scale=False)


def _pallas_bwd(x_BTND, scale_D, cos_BTd, sin_BTd, g_BTND, eps):
  """(dx, d_scale) through `pallas_kernels.glue.norm_rope.norm_rope_bwd`: compiled on GPU, interpreted
  on CPU, per device (`_per_device`)."""

  def local(x, s, c, sn, g):
    (x_RND, c_Rd, sn_Rd), (g_RND,) = _flat(x, c, sn), _flat(g)
    dx, ds = nr.norm_rope_bwd(x_RND, s, c_Rd, sn_Rd, g_RND, eps=eps,
                              interpret=ops._interpret())  # pylint: disable=protected-access
    return dx.reshape(x.shape), ds
  return _per_device(local, x_BTND, scale_D, cos_BTd, sin_BTd, g_BTND, sums_scale=True)
