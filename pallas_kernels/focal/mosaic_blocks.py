"""focal_mgpu's tiles and kernel choices (`BlockSizes`), apart from the kernels that read them.

Every field is validated on construction (ValueError naming the field and what it allows); the
comments beside each field record what the H200 measured when it was chosen or left off.
`focal_mgpu.BlockSizes` is this class (re-exported there).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the forward (block_q rows per compute warpgroup, two warpgroups per CTA) and of the
  backward kernels (focal_mgpu_bwd reads the *_dq / *_dkv fields). Multiples of 64 (wgmma M)."""
  block_q: int = 64
  block_kv: int = 128
  max_concurrent_steps: int = 2  # K/V ring depth (pipeline stages)
  block_q_dq: int = 64
  block_kv_dq: int = 64
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  # The backward as one FA3-style kernel (focal_mgpu_bwd_fused: 5 matmuls per tile, dq by float32
  # TMA reduce-add) instead of the dq and dk/dv kernels (7 matmuls, deterministic). On the H200
  # (2026-11-30) it was 1.10x faster at (2,12,16K,64) but 0.68-0.83x at D=128, so only D=64
  # defaults to it. Packed batches (segment ids) take it too: its segment masking passed
  # compiled on the H200 at D=64 (twenty-fifth session).
  fused_backward: bool = False
  # With fused_backward at D=128: dq computed jointly by both compute warpgroups over the CTA's
  # keys, each taking half its columns (FlashAttention-3's split; half the float32 reduce-add
  # traffic and dq SMEM tile, dS double-buffered). Compiled on the H200 it passes (twenty-fifth
  # session) but is slower: 0.67 / 0.73 / 0.78x the two kernels at (2,16,4K) / (1,16,8K) /
  # (1,8,16K), D=128, and the 1.3B step took 6 ms longer; so off.
  joint_dq: bool = False
  # With fused_backward at D=128: each warpgroup's dq tile as two 64-column wgmmas, SMEM tiles
  # and reduce-adds (focal_mgpu_bwd_fused's docstring); no coupling between warpgroups. Compiled
  # on the H200 it passes its tests but spills more and ran 2% slower than the plain fused kernel
  # at (1,16,8K,128), and the 1.3B step 19.5 ms slower (twenty-sixth session); so off.
  dq_halves: bool = False
  # What the dk/dv step of focal_mgpu_dkv and the fused backward keeps live across its wgmma
  # pair: focal_mgpu_dkv.DKV_STEPS, "plain" or "lean" (`dv_and_dx`). "lean" spills less at D=128
  # and made the fused backward 5-15% faster there, but the dk/dv kernel slower (twenty-seventh
  # session); no default takes the fused backward at D=128, so "plain" stays.
  dkv_step: str = "plain"
  # FA3's ping-pong schedule (as in the forward) in the dk/dv kernel and the fused backward: the
  # two compute warpgroups take turns at the tensor cores (focal_mgpu_bwd's docstring), so one's
  # elementwise work overlaps the other's matmuls. pingpong_dq: the same in the dq kernel.
  # Compiled on the H200 (twenty-eighth session) both pass their tests. With dkv_step="lean" the
  # dk/dv kernel ran 17% faster at (24,16,2K,128) on one machine and 9% slower on another; the
  # 1.3B step with lean + pingpong_backward was 0.6 ms slower over five pairs: so both off.
  pingpong_backward: bool = False
  pingpong_dq: bool = False
  # The forward's kv loop with FA3's intra-warpgroup overlap (focal_mgpu_overlap): block j's
  # softmax runs while the same warpgroup's p·v of block j-1 is on the tensor cores. Compiled on
  # the H200 it passes its tests (thirtieth session) but the forward was level at (24,16,2K,128)
  # and 5-7% slower at T >= 4K, and the 1.3B step 1-2 ms slower; so off.
  overlap_softmax: bool = False

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if f.name == "dkv_step":
        if value not in ("plain", "lean"):  # focal_mgpu_dkv.DKV_STEPS
          raise ValueError(f"BlockSizes.dkv_step={value!r} must be 'plain' or 'lean'")
      elif f.name in ("fused_backward", "joint_dq", "dq_halves", "pingpong_backward",
                      "pingpong_dq", "overlap_softmax"):
        if not isinstance(value, bool):
          raise ValueError(f"BlockSizes.{f.name}={value!r} must be True or False")
      elif f.name == "max_concurrent_steps":
        if not isinstance(value, int) or value < 2:
          raise ValueError(f"BlockSizes.max_concurrent_steps={value} must be an int >= 2 (one slot "
                           f"loading while another is read)")
      elif not isinstance(value, int) or value <= 0 or value % 64:
        raise ValueError(f"BlockSizes.{f.name}={value} must be a positive multiple of 64 (the "
                         f"wgmma tile height)")

  @classmethod
  def default(cls, head_dim: int, dtype=jnp.bfloat16) -> "BlockSizes":
    # Untuned until bench/focal_mgpu_fwd.py runs on the H200; (64, 128, 2 stages) is jax's
    # attention_mgpu choice at D=128. D=64 halves every tile, so a third stage fits easily.
    del dtype  # bf16 and fp16 have the same footprint
    if head_dim <= 64:
      return cls(max_concurrent_steps=3, fused_backward=True)
    return cls()
