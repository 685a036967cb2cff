"""The SwiGLU feed-forward block: silu(x·W_gate) ⊙ (x·W_up) · W_down.

Einsum letters as in model.py: B batch, T positions, E d_model, F d_ff, C the stacked gate/up pair.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

if TYPE_CHECKING:
  from focaljax.model import ModelConfig


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

  def __call__(self, x_BTE):
    dt = x_BTE.dtype
    if self.fused:
      w_ECF = jnp.stack([self.w_gate[...], self.w_up[...]], axis=1).astype(dt)
      gu_BTCF = jnp.einsum("BTE,ECF->BTCF", x_BTE, w_ECF)
      gate_BTF, up_BTF = gu_BTCF[:, :, 0], gu_BTCF[:, :, 1]
    else:
      gate_BTF = jnp.einsum("BTE,EF->BTF", x_BTE, self.w_gate[...].astype(dt))
      up_BTF = jnp.einsum("BTE,EF->BTF", x_BTE, self.w_up[...].astype(dt))
    h_BTF = jax.nn.silu(gate_BTF) * up_BTF
    return jnp.einsum("BTF,FE->BTE", h_BTF, self.w_down[...].astype(dt))
