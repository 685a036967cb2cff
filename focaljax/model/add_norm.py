"""The residual add and the RMSNorm after it, h = x + δ and y = rms_norm(h)·s, as one custom VJP
with one Pallas pass each way (`pallas_kernels.glue.add_norm`), per device under a mesh. The
model chains its blocks through them (`decoder.Block.deferred`) where `focaljax.dispatch` picks
them: GPUs, d_model a power of two (the kernels' blocks); elsewhere the add is XLA's, then
`norm_rope.rms_norm`.

Einsum letters as in decoder.py: B batch, T positions, E d_model.
"""

from __future__ import annotations

import jax

from focaljax import sharding
from pallas_kernels.glue import add_norm as kernel

_ROWS = ("batch", None, "embed_act")


def _rows(a_BTE):
  return a_BTE.reshape(-1, a_BTE.shape[-1])


def _add_rms_norm(x_BTE, d_BTE, scale_E, eps: float, interpret: bool):
  def local(x, d, s):
    h, y = kernel.add_norm_fwd(_rows(x), _rows(d), s, eps=eps, interpret=interpret)
    return h.reshape(x.shape), y.reshape(x.shape)
  return sharding.per_device(local, (_ROWS, _ROWS, None), [_ROWS, _ROWS])(x_BTE, d_BTE, scale_E)


# (h, y) = (x + δ, rms_norm(x + δ)·s), both in x's dtype.
add_rms_norm = jax.custom_vjp(_add_rms_norm, nondiff_argnums=(3, 4))


def _fwd(x_BTE, d_BTE, scale_E, eps, interpret):
  h_BTE, y_BTE = add_rms_norm(x_BTE, d_BTE, scale_E, eps, interpret)
  return (h_BTE, y_BTE), (h_BTE, scale_E)


def _bwd(eps, interpret, res, g):
  h_BTE, scale_E = res

  def local(h, gh, gy, s):
    dh, ds = kernel.add_norm_bwd(_rows(h), s, _rows(gh), _rows(gy), eps=eps, interpret=interpret)
    return dh.reshape(h.shape), ds
  dh_BTE, d_scale = sharding.per_device(local, (_ROWS, _ROWS, _ROWS, None),
                                        [_ROWS, sharding.SUMMED])(h_BTE, *g, scale_E)
  return dh_BTE, dh_BTE, d_scale.astype(scale_E.dtype)


add_rms_norm.defvjp(_fwd, _bwd)
