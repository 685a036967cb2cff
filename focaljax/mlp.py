"""The SwiGLU feed-forward block: silu(x·W_gate) ⊙ (x·W_up) · W_down, and its activation.

Einsum letters as in model.py: B batch, T positions, E d_model, F d_ff, C the stacked gate/up pair.

`swiglu` is the activation with a hand-written backward; `ModelConfig.mlp_backward` picks it
("explicit") or autodiff of `jax.nn.silu(gate) * up` ("autodiff", kept for A/B runs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

if TYPE_CHECKING:
  from focaljax.model import ModelConfig

MLP_BACKWARDS = ("autodiff", "explicit")


def _swiglu(gate_BTF, up_BTF):
  # float32 inside, one rounding at the end: jax.nn.silu on bf16 computes exp(-g) and the +1 in
  # bf16, then converts to float32 for the divide and back (the 1.3B step's fused HLO, H200).
  g32 = gate_BTF.astype(jnp.float32)
  h32 = g32 * jax.nn.sigmoid(g32) * up_BTF.astype(jnp.float32)
  return h32.astype(jnp.result_type(gate_BTF, up_BTF))


# silu(gate) · up, elementwise, in the inputs' dtype. The residuals are gate and up only: on the
# GPU the [B, T, F] step is bandwidth-bound, and recomputing the sigmoid costs less than writing
# and re-reading a saved one. The backward forms both cotangents in one elementwise pass, so XLA
# emits one multi-output fusion that reads gate, up and dh once (autodiff re-reads them per
# cotangent and recomputes the sigmoid in each).
swiglu = jax.custom_vjp(_swiglu)


def _swiglu_fwd(gate_BTF, up_BTF):
  return swiglu(gate_BTF, up_BTF), (gate_BTF, up_BTF)


def _swiglu_bwd(res, dh_BTF):
  gate_BTF, up_BTF = res
  g32, u32, dh32 = (a.astype(jnp.float32) for a in (gate_BTF, up_BTF, dh_BTF))
  s32 = jax.nn.sigmoid(g32)
  # d silu(g)/dg = s + g·s·(1 − s) = s·(1 + g·(1 − s)). Finite for any finite g: where s
  # underflows to 0 the factor 1 + g·(1 − s) is about g, so the product is 0, not inf·0.
  d_gate = dh32 * u32 * s32 * (1 + g32 * (1 - s32))
  d_up = dh32 * g32 * s32
  return d_gate.astype(gate_BTF.dtype), d_up.astype(up_BTF.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _swiglu_autodiff(gate_BTF, up_BTF):
  return jax.nn.silu(gate_BTF) * up_BTF


def _param(rngs, shape, std, axes):
  # model._param's init (same RNG draws, so seeds give the same weights); a local copy because
  # model.py imports this module.
  return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


class Mlp(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    E, F = cfg.d_model, cfg.d_ff
    self.w_gate = _param(rngs, (E, F), E**-0.5, ("embed", "mlp"))
    self.w_up = _param(rngs, (E, F), E**-0.5, ("embed", "mlp"))
    self.w_down = _param(rngs, (F, E), cfg.init_std / (2 * cfg.num_layers) ** 0.5, ("mlp", "embed"))
    self.fused = cfg.fuse_matmuls
    if cfg.mlp_backward not in MLP_BACKWARDS:
      raise ValueError(f"ModelConfig.mlp_backward={cfg.mlp_backward!r} is not one of "
                       f"{list(MLP_BACKWARDS)}")
    self.explicit = cfg.mlp_backward == "explicit"

  def __call__(self, x_BTE):
    dt = x_BTE.dtype
    if self.fused:
      w_ECF = jnp.stack([self.w_gate[...], self.w_up[...]], axis=1).astype(dt)
      gu_BTCF = jnp.einsum("BTE,ECF->BTCF", x_BTE, w_ECF)
      gate_BTF, up_BTF = gu_BTCF[:, :, 0], gu_BTCF[:, :, 1]
    else:
      gate_BTF = jnp.einsum("BTE,EF->BTF", x_BTE, self.w_gate[...].astype(dt))
      up_BTF = jnp.einsum("BTE,EF->BTF", x_BTE, self.w_up[...].astype(dt))
    h_BTF = (swiglu if self.explicit else _swiglu_autodiff)(gate_BTF, up_BTF)
    return jnp.einsum("BTF,FE->BTE", h_BTF, self.w_down[...].astype(dt))
