"""Tiles and backward choice of the Mosaic focal attention, validated on construction."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Forward tiles (block_q rows per compute warpgroup) and backward tiles; multiples of 64."""
  block_q: int = 64
  block_kv: int = 128
  max_concurrent_steps: int = 2  # K/V ring depth (pipeline stages)
  block_q_dq: int = 64
  block_kv_dq: int = 64
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  # One-pass backward (mosaic_bwd_fused: 5 matmuls a tile, dq by f32 reduce-add, not bitwise
  # reproducible) instead of the deterministic dq and dk/dv kernels: the faster at D = 64 only.
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
    # D = 64 halves every tile, so a third stage fits.
    del dtype  # bf16 and fp16 have the same footprint
    if head_dim <= 64:
      return cls(max_concurrent_steps=3, fused_backward=True)
    return cls()
