"""The SwiGLU feed-forward block: silu(x·W_gate) ⊙ (x·W_up) · W_down, and its activation.

Einsum letters as in model.py: B batch, T positions, E d_model, F d_ff, C the stacked gate/up pair.

`swiglu` is the activation with a hand-written backward; `ModelConfig.mlp_backward` picks it
("explicit"), autodiff of `jax.nn.silu(gate) * up` ("autodiff", kept for A/B runs), or
`swiglu_pallas`, forward and backward as Pallas elementwise passes ("pallas",
pallas_kernels/glue/swiglu.py; the explicit XLA one on TPU); "auto" is "pallas" on GPUs, "autodiff"
elsewhere (`resolve_mlp_backward`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from focaljax import ops
from focaljax import sharding
from pallas_kernels.glue import swiglu as swiglu_kernels

_interpret = ops._interpret  # pylint: disable=protected-access

if TYPE_CHECKING:
  from focaljax.model.decoder import ModelConfig

MLP_BACKWARDS = ("autodiff", "explicit", "pallas", "auto")


def resolve_mlp_backward(name: str) -> str:
  """`auto`: the measured faster choice per platform. H200, jax 0.11.2, 2K tokens: "pallas" took
  the 400M step (b16) from 213.3 to 210.1 ms and the 1.3B (b8) from 292.1 to 290.2 ms; off the GPU
  the Pallas passes would run interpreted (CPU) or fall back to "explicit" (TPU), untimed there."""
  if name == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "autodiff"
  return name


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


def _per_device(fn, n_out: int, *arrays_BTF):
  """fn's n_out [B, T, F] outputs (one array when n_out == 1), computed on each device's block
  of the [B, T, F] inputs (jax.shard_map over the rows and "mlp" columns the devices divide): a
  pallas_call has no partitioning rule, so XLA would otherwise gather them onto every device."""
  mesh = jax.sharding.get_abstract_mesh()
  spec = None if mesh.empty else sharding.dividing_spec(mesh, ("batch", None, "mlp"),
                                                         arrays_BTF[0].shape)
  if spec is None or all(a is None for a in spec):
    return fn(*arrays_BTF)
  return jax.shard_map(fn, in_specs=(spec,) * len(arrays_BTF),
                       out_specs=spec if n_out == 1 else (spec,) * n_out,
                       check_vma=False)(*arrays_BTF)


@jax.custom_vjp
def swiglu_pallas(gate_BTF, up_BTF):
  """swiglu through the Pallas kernels (compiled on GPU, interpreted on CPU; XLA on TPU, where
  the Triton kernels do not run)."""
  if jax.default_backend() == "tpu":
    return _swiglu(gate_BTF, up_BTF)
  fwd = lambda g, u: swiglu_kernels.swiglu_fwd(g, u, interpret=_interpret())  # noqa: E731
  return _per_device(fwd, 1, gate_BTF, up_BTF)


def _swiglu_pallas_fwd(gate_BTF, up_BTF):
  return swiglu_pallas(gate_BTF, up_BTF), (gate_BTF, up_BTF)


def _swiglu_pallas_bwd(res, dh_BTF):
  if jax.default_backend() == "tpu":
    return _swiglu_bwd(res, dh_BTF)
  bwd = lambda g, u, d: swiglu_kernels.swiglu_bwd(g, u, d, interpret=_interpret())  # noqa: E731
  return tuple(_per_device(bwd, 2, *res, dh_BTF))


swiglu_pallas.defvjp(_swiglu_pallas_fwd, _swiglu_pallas_bwd)


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
    self.activation = {"autodiff": _swiglu_autodiff, "explicit": swiglu,
                       "pallas": swiglu_pallas}[resolve_mlp_backward(cfg.mlp_backward)]

  def __call__(self, x_BTE):
    dt = x_BTE.dtype
    if self.fused:
      w_ECF = jnp.stack([self.w_gate[...], self.w_up[...]], axis=1).astype(dt)
      gu_BTCF = jnp.einsum("BTE,ECF->BTCF", x_BTE, w_ECF)
      gate_BTF, up_BTF = gu_BTCF[:, :, 0], gu_BTCF[:, :, 1]
    else:
      gate_BTF = jnp.einsum("BTE,EF->BTF", x_BTE, self.w_gate[...].astype(dt))
      up_BTF = jnp.einsum("BTE,EF->BTF", x_BTE, self.w_up[...].astype(dt))
    h_BTF = self.activation(gate_BTF, up_BTF)
    return jnp.einsum("BTF,FE->BTE", h_BTF, self.w_down[...].astype(dt))
