"""Tiles and backward choice of the Hopper Mosaic GPU focal attention (`mosaic.BlockSizes`).

Every field is validated on construction (ValueError naming the field and what it allows).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the forward (block_q rows per compute warpgroup, two warpgroups per CTA) and of the
  backward kernels (the *_dq / *_dkv fields). Multiples of 64 (wgmma M)."""
  block_q: int = 64
  block_kv: int = 128
  max_concurrent_steps: int = 2  # K/V ring depth (pipeline stages)
  block_q_dq: int = 64
  block_kv_dq: int = 64
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  # The backward as one FA3-style kernel (mosaic_bwd_fused: 5 matmuls per tile, dq by float32 TMA
  # reduce-add, not bitwise reproducible) instead of the dq and dk/dv kernels (7 matmuls,
  # deterministic): faster at D=64, where it is the default, slower at D=128.
  fused_backward: bool = False

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if f.name == "fused_backward":
        if not isinstance(value, bool):
          raise ValueError(f"BlockSizes.fused_backward={value!r} must be True or False")
      elif f.name == "max_concurrent_steps":
        if not isinstance(value, int) or value < 2:
          raise ValueError(f"BlockSizes.max_concurrent_steps={value} must be an int >= 2 (one slot "
                           f"loading while another is read)")
      elif not isinstance(value, int) or value <= 0 or value % 64:
        raise ValueError(f"BlockSizes.{f.name}={value} must be a positive multiple of 64 (the "
                         f"wgmma tile height)")

  @classmethod
  def default(cls, head_dim: int, dtype=jnp.bfloat16) -> "BlockSizes":
    # (64, 128, 2 stages) is jax's attention_mgpu choice at D=128; D=64 halves every tile, so a
    # third stage fits.
    del dtype  # bf16 and fp16 have the same footprint
    if head_dim <= 64:
      return cls(max_concurrent_steps=3, fused_backward=True)
    return cls()
