"""The residual add and the RMSNorm after it, h = x + δ and y = rms_norm(h)·s, as the model's
blocks chain them (`ModelConfig.add_norm`, `model.Block.deferred`):

  "separate": the add in XLA, then `norm_rope.rms_norm` (its explicit backward): the spec.
  "pallas":   one custom VJP, one Pallas pass each way (`pallas_kernels/glue/add_norm.py`), per device
              under a mesh; XLA's passes on TPU (the kernels are Triton).
  "auto":     "pallas" on GPUs where d_model is a power of two (the kernels' blocks), else
              "separate".

Einsum letters as in model.py: B batch, T positions, E d_model, R rows (B·T).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from focaljax.model import norm_rope
from focaljax import ops
from focaljax import sharding
from pallas_kernels.glue import add_norm as kernel

ADD_NORMS = ("separate", "pallas", "auto")


def resolve(name: str, d_model: int) -> str:
  """ModelConfig.add_norm -> "separate" or "pallas"; errors name the field."""
  if name not in ADD_NORMS:
    raise ValueError(f"ModelConfig.add_norm={name!r} is not one of {list(ADD_NORMS)}")
  fits = d_model >= 16 and not d_model & (d_model - 1)
  if name == "auto":
    return "pallas" if jax.default_backend() == "gpu" and fits else "separate"
  if name == "pallas" and not fits:
    raise ValueError(f"ModelConfig.add_norm='pallas' needs d_model a power of two ≥ 16 (the "
                     f"kernels' Triton blocks); got d_model={d_model}; use 'separate'")
  return name


def add_rms_norm(x_BTE, d_BTE, scale_E, eps: float, impl: str):
  """(h, y) = (x + δ, rms_norm(x + δ)·s), both in x's dtype; impl as `resolve` returns it."""
  if impl == "pallas" and jax.default_backend() != "tpu":
    return _pallas_add_norm(x_BTE, d_BTE, scale_E, eps)
  h_BTE = x_BTE + d_BTE
  return h_BTE, norm_rope.rms_norm(h_BTE, scale_E, eps)


def _per_device(local, scale_E, *arrays_BTE, out_kinds: tuple[str, ...]):
  """local(scale, *arrays) on each device's batch rows: a pallas_call has no partitioning rule,
  so under a mesh it is shard_map'd over the axes that split the batch. out_kinds: per output,
  "rows" ([B, T, E], split like the inputs) or "sum" (the gain's gradient, summed over them)."""
  mesh = jax.sharding.get_abstract_mesh()
  xs = None if mesh.empty else sharding.dividing_spec(mesh, ("batch", None, None),
                                                       arrays_BTE[0].shape)
  if xs is None or xs[0] is None:
    return local(scale_E, *arrays_BTE)
  summed = xs[0] if isinstance(xs[0], tuple) else (xs[0],)

  def sharded(*a):
    return tuple(jax.lax.psum(o, summed) if k == "sum" else o
                 for o, k in zip(local(*a), out_kinds))
  return jax.shard_map(sharded, in_specs=(P(),) + (xs,) * len(arrays_BTE),
                       out_specs=tuple(P() if k == "sum" else xs for k in out_kinds),
                       check_vma=False)(scale_E, *arrays_BTE)


def _rows(a_BTE):
  return a_BTE.reshape(-1, a_BTE.shape[-1])


def _pallas_add_norm_impl(x_BTE, d_BTE, scale_E, eps):
  def local(s, x, d):
    h, y = kernel.add_norm_fwd(_rows(x), _rows(d), s, eps=eps,
                               interpret=ops._interpret())  # pylint: disable=protected-access
    return h.reshape(x.shape), y.reshape(x.shape)
  return _per_device(local, scale_E, x_BTE, d_BTE, out_kinds=("rows", "rows"))


_pallas_add_norm = jax.custom_vjp(_pallas_add_norm_impl, nondiff_argnums=(3,))


def _fwd(x_BTE, d_BTE, scale_E, eps):
  h_BTE, y_BTE = _pallas_add_norm_impl(x_BTE, d_BTE, scale_E, eps)
  return (h_BTE, y_BTE), (h_BTE, scale_E)


def _bwd(eps, res, g):
  h_BTE, scale_E = res
  gh_BTE, gy_BTE = g

  def local(s, h, gh, gy):
    dh, ds = kernel.add_norm_bwd(_rows(h), s, _rows(gh), _rows(gy), eps=eps,
                                 interpret=ops._interpret())  # pylint: disable=protected-access
    return dh.reshape(h.shape), ds
  dh_BTE, d_scale = _per_device(local, scale_E, h_BTE, gh_BTE, gy_BTE, out_kinds=("rows", "sum"))
  return dh_BTE, dh_BTE, d_scale.astype(scale_E.dtype)


_pallas_add_norm.defvjp(_fwd, _bwd)
