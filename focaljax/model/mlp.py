"""SwiGLU's activation silu(gate) ⊙ up, as the MLP block (decoder.Mlp) runs it: forward and
backward as Pallas elementwise passes (`pallas_kernels.glue.swiglu`) where `focaljax.dispatch`
picks them (GPUs), else autodiff of `jax.nn.silu(gate) * up`.

Einsum letters as in decoder.py: B batch, T positions, F d_ff.
"""

from __future__ import annotations

import jax

from focaljax import dispatch
from focaljax import sharding
from pallas_kernels.glue import swiglu as kernels

_COLUMNS = ("batch", None, "mlp")


def swiglu(gate_BTF, up_BTF):
  """silu(gate)·up in the inputs' dtype, through the implementation dispatch picks."""
  choice = dispatch.choose("swiglu")
  if choice.implementation == "pallas":
    return swiglu_pallas(gate_BTF, up_BTF, choice.interpret)
  return jax.nn.silu(gate_BTF) * up_BTF


def _swiglu_pallas(gate_BTF, up_BTF, interpret):
  fwd = lambda g, u: kernels.swiglu_fwd(g, u, interpret=interpret)  # noqa: E731
  return sharding.per_device(fwd, (_COLUMNS, _COLUMNS), _COLUMNS)(gate_BTF, up_BTF)


# The Pallas passes, on each device's block of rows and "mlp" columns. The residuals are gate and
# up only: the step is bandwidth-bound, and recomputing the sigmoid costs less than writing and
# re-reading a saved one.
swiglu_pallas = jax.custom_vjp(_swiglu_pallas, nondiff_argnums=(2,))


def _swiglu_pallas_fwd(gate_BTF, up_BTF, interpret):
  return swiglu_pallas(gate_BTF, up_BTF, interpret), (gate_BTF, up_BTF)


def _swiglu_pallas_bwd(interpret, res, dh_BTF):
  bwd = lambda g, u, d: kernels.swiglu_bwd(g, u, d, interpret=interpret)  # noqa: E731
  return tuple(sharding.per_device(bwd, (_COLUMNS,) * 3, [_COLUMNS, _COLUMNS])(*res, dh_BTF))


swiglu_pallas.defvjp(_swiglu_pallas_fwd, _swiglu_pallas_bwd)
