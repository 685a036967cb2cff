"""Dilution attention in Pallas: fused training forward + exact backward, prefill, cached decode.

Operator (CONTRACT.md; notes/dilution.md §1; Royer, "DilutionAttention", 2026), causal, per head:
    p = causal_softmax(scale · q kᵀ);  committed_ij = Σ_{r<i} p_rj;
    share = p / (committed + p + eps);  A = share / (rowsum(share) + eps);  out = A v.
Spec: `pallas_kernels.focal.reference` (`dilution_attention`, `dilution_decode_step`).

Layout q [B, T, Hq, D], k/v [B, T, Hkv, D] (GQA: query head h reads kv head h // (Hq/Hkv)),
segment_ids int32 [B, T] (a query sees, and adds demand to, keys of its own segment only).
Softmax, demand, share and every accumulator are float32; bf16/fp16 appear only as dot operands
(fp32 inputs use IEEE dots). Head dim: a power of two ≥ 16 (64 and 128 are the tuned cases).

Training (`dilution_attention`, jax.custom_vjp) — kernels in dilution_fwd.py / dilution_bwd.py,
every grid (blocks, B, Hq) with the block axis first (CUDA caps grid axes 1-2 at 65,535):
  F1 row_stats      grid (T/64, B, Hq), row-parallel flash-style online softmax:
                    lse_i and pk_i = scale·Σ_j p_ij k_j                   [QKᵀ, PK]
                    (f1_impl="mosaic": focal_mgpu's forward with V := K, Hopper)
  F2 key_sweep      grid (T/64, B, Hq), key-parallel: a program owns 64 keys and their
                    committed-demand carry (registers), walks 32-row tiles top-down;
                    S_i, N_i by fp32 atomics; carry checkpoint every R rows  [QKᵀ, σV]
  out = N / (S + eps)  (XLA elementwise)
  B1 reverse_sweep  grid (T/Kb1, B, Hq), key-parallel, Kb1 = b1_block_k or block_k (64) keys
                    and b1_warps or num_warps' rule warps per program; R-row super-blocks
                    bottom-up: a forward mini-sweep rebuilds the R/32 tile carries from the
                    checkpoint into a register array (or an HBM scratch slice), then the
                    reverse pass carries the per-key g-suffix; dv, dk_main in registers;
                    ĝ, dq_main by fp32 atomics
                    [2 QKᵀ, dO·Vᵀ, AᵀdO, W·K, Wᵀ·Q, triangular suffix (3 bf16 dots, fp32-exact)]
  B2 dk_correction  grid (T/block_k, B, Hq): corr_j = Σ_i p_ij ĝ_i q_i       [QKᵀ, (PĝᵀQ)]
                    (b2_impl="mosaic": dilution_mgpu_b2, Hopper)
  B1 and B2 exchange only whole per-row / per-key buffers (ĝ, and dq_main, dk_main, dv, corr
  combined in XLA), so their key blocks are independent; T is padded to a multiple of both.
  dq = dq_main − ĝ ⊙ pk,  dk = scale·(dk_main − corr),  GQA groups summed  (XLA).
  The gradient is exact (notes/dilution.md §3, §9.3): it flows through the cumulative demand
  and the renormalisation; nothing is treated as a constant. Carries are only ever rebuilt by
  forward summation from a checkpoint (never total − suffix, which cancels catastrophically in
  fp32 for heavy keys), and the in-tile g-suffix is a strictly-triangular fp32 product, not
  column total − cumsum (the first visible row of a key has g ≈ −dσ/p, huge for tiny p).

Memory (no T×T tensor anywhere). Per (batch, query head), float32, T padded to a block multiple:
  saved for backward: lse, S (2T) + out_f32, pk (2·T·D) + checkpoints ceil(T/R)·T
  transient: forward N (T·D); backward dq, dk, dv, corr (4·T·D) + ĝ, dbar (2T)
  → extra ≈ B·Hq·(6·T·D + 4·T + ceil(T/R)·T)·4 bytes, R = ckpt_rows (default 1024 ≥ 1024).
  E.g. B2 Hq12 T16K D64: the 6·T·D terms 576 MiB, checkpoints 24·16·16K·4 B = 24 MiB per layer
  (the released kernels' every-32-rows checkpoints: 768 MiB).
  Registers: each B1 program holds an [R/32, Kb1] fp32 carry array (R = 1024, Kb1 = 64: 8 KiB),
  or with BlockSizes.b1_carries="scratch" an HBM slice of that size per program instead
  (transient B·Hq·T·R/32 fp32 whatever Kb1: 48 MiB at B2 Hq12 T16K; dilution_bwd.py says why).

Prefill (`dilution_prefill`): F1 without pk + F2 without checkpoints (the training op's F2 choice:
the Mosaic F2 on Hopper, 1.25× the Triton prefill at D = 128); returns out and the demand
totals (F2's final carries). Extra memory B·Hq·(2·T·D + 3T)·4 bytes (N and the fp32 output, lse,
S, totals), linear in T: B1 Hq12 T128K D64 → 768 MiB + 18 MiB, plus the q-sized output (and a
padded copy of q, k, v when T is not a multiple of the largest forward block, 128 by default).

Decode (`dilution_decode_step`): flash-decoding over key splits (dilution_decode.py): one launch
for logits + per-split softmax stats, an XLA merge, one launch for shares, Σσv and the in-place
demand update; keys at or beyond `length` are never read. Extra memory O(B·Hq·S_max) fp32 logits.
Keep S_max a multiple of block_k_decode (128), or every step pads (copies) the cache.

Backends: `interpret=True` runs every kernel in Pallas interpret mode (CPU tests). On GPU the
kernels lower through Triton (explicit `pltriton.CompilerParams`; jax ≥ 0.11 warns that the Triton
backend is deprecated), except that on sm_90 with 16-bit inputs `BlockSizes.default` swaps in the
Mosaic GPU B1 and F2 (both, at D 64 and 128: the H200 measured them faster). On TPU there is no
Mosaic-TPU port (fp32 atomics): when `jax.default_backend() == "tpu"` and interpret is False, the
functions fall back to the XLA reference in `pallas_kernels.focal.reference` (T×T memory: short contexts
only).
Atomics make GPU results non-bitwise-deterministic (fp32 summation order).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.focal import reference

from pallas_kernels.dilution import reference as dilution_reference
from pallas_kernels.dilution import triton_bwd as dilution_bwd
from pallas_kernels.dilution import triton_decode as dilution_decode
from pallas_kernels.dilution import triton_fwd as dilution_fwd
from pallas_kernels.dilution import mosaic_b1 as dilution_mgpu
from pallas_kernels.dilution import mosaic_b2 as dilution_mgpu_b2
from pallas_kernels.dilution import mosaic_fwd as dilution_mgpu_fwd
from pallas_kernels.focal import triton as focal_flash


B1_CARRIES = ("registers", "scratch")
KERNEL_IMPLS = ("triton", "mosaic")
B1_WARPS = (1, 2, 4, 8, 16)  # Triton: a power of two; 16 warps = 512 threads


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes (powers of two ≥ 16) and Triton launch parameters."""
  block_q_stats: int = 64     # F1 rows per program
  block_k_stats: int = 64     # F1 keys per loop step
  block_q: int = 32           # row tile of the key-parallel sweeps F2, B1, B2
  block_k: int = 64           # keys owned by one B2 program, and by one B1 program by default
  # F2's key block: larger tiles cut its fp32 atomics (T²·D/block_k per head). On the H200 at
  # (2,12,16K,64) 128 took the forward from 21.7 to 18.0 ms, while B1 with 128 slowed 100→173 ms.
  # Carries and checkpoints are per key, so F2 and B1/B2 may tile the keys differently.
  block_k_fwd: int = 128
  # R: rows between stored carry checkpoints (multiple of block_q). 64 (past the issue's
  # R >= 1024 bound; 403 MiB at (2,12,16K,64)) spares the Mosaic B1 its carry rebuild.
  ckpt_rows: int = 1024
  block_k_decode: int = 128   # keys per decode loop step
  split_k_decode: int = 2048  # keys per decode program (flash-decoding split)
  num_warps: int | None = None  # None: 4 for D <= 64, else 8 (B1 keeps dk, dv [64, D] fp32 live)
  num_stages_fwd: int = 2
  num_stages_bwd: int = 1
  # Where B1 keeps the R/block_q carries its mini-sweep rebuilds per super-block: "registers"
  # (an [R/block_q, block_k] array written/read by one-hot selects: 2·R/block_q·block_k selects
  # and a cross-warp column reduction per tile) or "scratch" (a per-program HBM slice, one
  # block_k-row store and load per tile; frees the array's registers, so block_k=128 fits).
  b1_carries: str = "registers"
  # B1-only tile: None = block_k / warps(D). B1 and B2 share no tile state (dq, ĝ, dk_main, dv,
  # corr are whole [T]-indexed buffers; F2's checkpoints are per key), so each tiles T by its own
  # key block. On the H200 at (2,12,16K,64) B1 alone: 55.5 ms default, 51.8 ms with scratch
  # carries, 128 keys, 8 warps; these fields let B1 take that while B2 keeps 64 keys, 4 warps.
  b1_block_k: int | None = None
  b1_warps: int | None = None
  # B1's kernel: "triton" (dilution_bwd, every dtype) or "mosaic" (dilution_mgpu: Hopper wgmma/TMA,
  # 16-bit inputs, D 64 or 128, 64-row tiles).
  b1_impl: str = "triton"
  # F2's kernel likewise: "triton" (dilution_fwd) or "mosaic" (dilution_mgpu_fwd).
  f2_impl: str = "triton"
  # F1's: "triton" (dilution_fwd.row_stats, block_*_stats) or "mosaic" (focal_mgpu's forward
  # with V := K, dilution_mgpu_fwd.row_stats; T padded to 128). Hopper default since the
  # thirty-second session (F1 alone 174 → 307 TFLOP/s at (2,12,16K,64)).
  f1_impl: str = "triton"
  # B2's: "triton" (dilution_bwd.dk_correction) or "mosaic" (dilution_mgpu_b2: two compute
  # warpgroups of 64 keys; T padded to 128 for training). Hopper default since the
  # thirty-second session (B2 alone 169 → 278 TFLOP/s at (2,12,16K,64)).
  b2_impl: str = "triton"
  # The Mosaic B1's in-tile prefix and suffix products (6 of its 12 wgmmas per tile pair at 3):
  # 3 bf16 pieces keep float32 accuracy; 2 keep ~16 bits (relative error ≲ 2⁻¹⁶) and drop two
  # products. The Triton B1 ignores it.
  b1_mask_pieces: int = 3
  # The same for the Mosaic F2's in-tile inclusive prefix (3 of its 5 wgmmas per tile pair at 3,
  # at D = 64 each as large as k·qᵀ). 2 on Hopper by default (twenty-ninth session: F2 alone 53
  # → 59 TFLOP/s at (2,12,16K,64)).
  f2_mask_pieces: int = 3
  # 64-key tiles per Mosaic F2 CTA (1, 2, 4), summed before one float32 reduce-add of N and S per
  # row tile (dilution_mgpu_fwd's docstring). H200, F2 alone at (2,12,16K,64) with two pieces:
  # 59 / 67 / 52 TFLOP/s at 1 / 2 / 4 tiles, so 2 is the D = 64 Hopper default.
  f2_key_tiles: int = 1
  # Registers per thread of the Mosaic B1's and F2's compute warpgroup (setmaxnreg, 232 to 256 in
  # steps of 8; their producer keeps 40). One 256-thread CTA fills an SM at 232 already, so up
  # to 256 costs no occupancy. On the H200 (twenty-eighth session, (2,12,16K,64)): B1's spill
  # stores 488 → 368 bytes and B1 alone 84 → 86 TFLOP/s, forward+backward 51.36 → 51.06 ms;
  # F2 spills nothing either way and runs the same.
  mosaic_registers: int = 256
  # Fewer instructions per element in the Mosaic B1 and F2: approx_math (ex2.approx.ftz instead
  # of ex2.approx with its denormal fix-up), reciprocals as rsqrt.approx² (the old path's `1/x`
  # was already rcp.approx), the causal positions as [64] vectors instead of two int32 tiles, and
  # B1's per-query 1/(S + ε), dbar/(S + ε) from XLA once instead of 16 reciprocals per thread
  # and tile. SASS of B1's reverse tile 2178 → 1869 instructions. H200 (thirty-fourth session,
  # (2,12,16K,64)): B1 alone 28.6 → 24.6 ms, F2 12.3 → 10.2; the Hopper default since.
  mosaic_lean: bool = False
  # Skip the causal/segment mask (compares and a select per element, twice per B1 tile pair) on
  # tiles below the diagonal whose 64 keys and 64 queries lie in one segment: a branch per tile on
  # per-block (min, max) segment ids (dilution_mgpu.visible_all). With lean, B1 24.6 → 24.1 ms
  # on unsegmented rows (the bench's), forward+backward 39.2 → 38.7; the Hopper default since.
  mosaic_skip_masks: bool = False
  # The Mosaic B1's and F2's in-tile mask products issue their bf16 pieces' wgmmas as one group,
  # awaited once (SASS: a wait after each piece, i.e. two more per B1 tile pair). H200
  # (thirty-fifth session, (2,12,16K,64)): B1 alone 103 → 108 TFLOP/s, forward+backward 38.8 →
  # 37.5 ms, the 209M step 506.5 → 488.2 ms; the Hopper default at D = 64 since. At D = 128 the
  # forward+backward at (1,16,8K,128) went the other way, 13.7 → 14.3 ms, so it stays off there.
  mosaic_chain_pieces: bool = False

  @classmethod
  def default(cls, head_dim: int, dtype=None, *, hopper: bool = False) -> "BlockSizes":
    """What `dilution_attention` runs without block_sizes; `hopper`: compiling for an sm_90 GPU.

    On Hopper with 16-bit inputs at D 64 or 128 (what the Mosaic kernels take,
    `dilution_mgpu.supported`) all four training passes run on Mosaic GPU, B1 and F2 with two mask
    pieces (~16 significant bits in the in-tile products, far below the bf16 inputs' 8; 3 restores
    float32 accuracy) and F2 with two 64-key tiles per CTA at D = 64. Each choice was the faster
    in the same run on the H200 (BENCHMARKS.md, dilution section), and both run with
    mosaic_lean and mosaic_skip_masks (thirty-fourth session: forward+backward 45.4 → 38.7 ms at
    (2,12,16K,64), 15.8 → 13.3 ms at (1,16,8K,128)) and, at D = 64, mosaic_chain_pieces
    (thirty-fifth: 38.8 → 37.5 ms). Anything else,
    interpret mode and other GPUs get the Triton passes; at D <= 64 the Triton B1 takes its
    measured tile (scratch carries, 128 keys, 8 warps: 74.6 against 78.3 ms)."""
    mosaic = hopper and head_dim in (64, 128) and dtype is not None and jnp.dtype(dtype) in (
        jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    # With both passes on Mosaic the Triton-only fields below are inert; they stay so that
    # b1_impl="triton" / f2_impl="triton" alone restore the measured Triton tiles.
    hop = {}
    if mosaic:
      hop = dict(b1_impl="mosaic", f2_impl="mosaic", f1_impl="mosaic", b2_impl="mosaic",
                 b1_mask_pieces=2, f2_mask_pieces=2,
                 f2_key_tiles=2 if head_dim <= 64 else 1,
                 mosaic_lean=True, mosaic_skip_masks=True,
                 mosaic_chain_pieces=head_dim <= 64)
    if head_dim <= 64:
      return cls(b1_carries="scratch", b1_block_k=128, b1_warps=8, **hop)
    return cls(**hop)

  def warps(self, D: int) -> int:
    return self.num_warps or (4 if D <= 64 else 8)

  def keys_b1(self) -> int:
    """Keys owned by one B1 program."""
    return self.b1_block_k or self.block_k

  def warps_b1(self, D: int) -> int:
    return self.b1_warps or self.warps(D)

  def pad_multiple(self, training: bool = True) -> int:
    """T is padded to this: a multiple of every row/key block the passes run use (all powers of
    two, so the largest is a multiple of the rest); B1/B2's key blocks only when training."""
    fwd = max(self.block_q_stats, self.block_k_stats, self.block_q, self.block_k_fwd,
              # the Mosaic F2's CTA spans f2_key_tiles 64-key tiles (the Triton F2 ignores it)
              dilution_mgpu_fwd.BKV * self.f2_key_tiles if self.f2_key_tiles > 1 else 0,
              dilution_mgpu_fwd.F1_ROWS_PER_CTA if self.f1_impl == "mosaic" else 0)
    b2 = dilution_mgpu_b2.ROWS_PER_CTA if self.b2_impl == "mosaic" else 0
    return max(fwd, self.block_k, self.keys_b1(), b2) if training else fwd

  def validate(self, D: int):
    if self.b1_carries not in B1_CARRIES:
      raise ValueError(f"BlockSizes.b1_carries={self.b1_carries!r} must be one of {B1_CARRIES}")
    for field in ("b1_impl", "f2_impl", "f1_impl", "b2_impl"):
      if getattr(self, field) not in KERNEL_IMPLS:
        raise ValueError(f"BlockSizes.{field}={getattr(self, field)!r} must be one of "
                         f"{KERNEL_IMPLS}")
    for field in ("b1_mask_pieces", "f2_mask_pieces"):
      if getattr(self, field) not in (2, 3):
        raise ValueError(f"BlockSizes.{field}={getattr(self, field)!r} must be 2 or 3")
    if self.f2_key_tiles not in dilution_mgpu_fwd.key_tiles_for(D):
      raise ValueError(f"BlockSizes.f2_key_tiles={self.f2_key_tiles!r} must be one of "
                       f"{dilution_mgpu_fwd.key_tiles_for(D)} at head dim {D}")
    for field in ("mosaic_lean", "mosaic_skip_masks", "mosaic_chain_pieces"):
      if not isinstance(getattr(self, field), bool):
        raise ValueError(f"BlockSizes.{field}={getattr(self, field)!r} must be True or False")
    if self.mosaic_registers not in range(232, 257, 8):
      raise ValueError(f"BlockSizes.mosaic_registers={self.mosaic_registers!r} must be one of "
                       f"{list(range(232, 257, 8))}")
    for f in dataclasses.fields(self):
      x = getattr(self, f.name)
      if f.name.startswith("block") or f.name in ("ckpt_rows", "split_k_decode"):
        if x < 16 or x & (x - 1):
          raise ValueError(f"BlockSizes.{f.name}={x} must be a power of two >= 16")
    x = self.b1_block_k
    if x is not None and (not isinstance(x, int) or x < 16 or x & (x - 1)):
      raise ValueError(f"BlockSizes.b1_block_k={x!r} must be None (use block_k) or a power of "
                       "two >= 16")
    if self.b1_warps is not None and self.b1_warps not in B1_WARPS:
      raise ValueError(f"BlockSizes.b1_warps={self.b1_warps!r} must be None (the num_warps rule) "
                       f"or one of {B1_WARPS}")
    if self.ckpt_rows % self.block_q or self.split_k_decode % self.block_k_decode:
      raise ValueError("ckpt_rows must be a multiple of block_q and split_k_decode of "
                       "block_k_decode")
    if D < 16 or D & (D - 1):
      raise ValueError(f"head dim {D} must be a power of two >= 16 (64 and 128 are tuned)")


def default_block_sizes(head_dim: int, dtype, interpret: bool) -> BlockSizes:
  """What `dilution_attention` runs without block_sizes on this machine: BlockSizes.default,
  with the Mosaic passes when compiling for sm_90."""
  return BlockSizes.default(head_dim, dtype, hopper=not interpret and focal_flash.hopper())


def _use_reference(interpret: bool) -> bool:
  return not interpret and jax.default_backend() == "tpu"


def _check(q, k, v, scale, bs):
  B, T, S, N, K, D = reference.check_qkv(q, k, v)
  if T != S:
    raise ValueError(f"dilution attention is causal self-attention: T ({T}) must equal S ({S})")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q, k, v must share a dtype (tensor-core operands); got {q.dtype}, "
                     f"{k.dtype}, {v.dtype}")
  if not isinstance(scale, (int, float)):
    raise ValueError(f"scale must be a Python float for the Pallas kernels; got {type(scale)}")
  bs.validate(D)
  return B, T, D


def _pad(q, k, v, seg, multiple):
  """Pads T to a block multiple. Padded rows get their own segment id, so they neither see real
  keys nor add demand to them (real rows never see them: they come later)."""
  T = q.shape[1]
  pad = -T % multiple
  if not pad:
    return q, k, v, seg
  cfg = ((0, 0), (0, pad), (0, 0), (0, 0))
  sentinel = jnp.iinfo(jnp.int32).min
  seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=sentinel)
  return jnp.pad(q, cfg), jnp.pad(k, cfg), jnp.pad(v, cfg), seg


def _forward(q, k, v, seg, scale, eps, bs, interpret, *, training):
  if _uses_mosaic(bs, "f1_impl", dilution_mgpu_fwd.row_stats_supported(q, k, seg)):
    lse, pk = dilution_mgpu_fwd.row_stats(q, k, seg, scale=scale, with_pk=training,
                                          interpret=interpret)
  else:
    lse, pk = dilution_fwd.row_stats(q, k, seg, scale=scale, bs=bs, with_pk=training,
                                     interpret=interpret)
  n, ssum, total, ckpt = f2_key_sweep(q, k, v, seg, lse, scale=scale, eps=eps, bs=bs,
                                      with_ckpt=training, interpret=interpret)
  # Row normaliser; fp32 until the final cast to the activation dtype.
  out_f32 = n / (ssum.transpose(0, 2, 1)[..., None] + eps)
  return out_f32, (lse, pk, ssum, total, ckpt)


def _uses_mosaic(bs, field: str, why: str | None) -> bool:
  """Whether BlockSizes.<field> picks the Mosaic GPU kernel; refuses inputs it cannot run
  (`why`: that kernel's `supported` answer for these inputs)."""
  if getattr(bs, field) != "mosaic":
    return False
  if why:
    raise ValueError(f"BlockSizes.{field}='mosaic': {why}; use {field}='triton'")
  return True


def f2_key_sweep(q, k, v, seg, lse, *, scale, eps, bs, with_ckpt, interpret):
  """F2 by `BlockSizes.f2_impl`: (N, S, total, ckpt), as dilution_fwd.key_sweep."""
  if _uses_mosaic(bs, "f2_impl", dilution_mgpu.supported(q, bs.ckpt_rows)):
    return dilution_mgpu_fwd.key_sweep(q, k, v, seg, lse, scale=scale, eps=eps,
                                       ckpt_rows=bs.ckpt_rows, with_ckpt=with_ckpt,
                                       mask_pieces=bs.f2_mask_pieces,
                                       key_tiles=bs.f2_key_tiles,
                                       registers=bs.mosaic_registers, lean=bs.mosaic_lean,
                                       skip_masks=bs.mosaic_skip_masks,
                                       chain=bs.mosaic_chain_pieces, interpret=interpret)
  return dilution_fwd.key_sweep(q, k, v, seg, lse, scale=scale, eps=eps, bs=bs,
                                with_ckpt=with_ckpt, interpret=interpret)


def b1_reverse_sweep(q, k, v, seg, lse, ssum, dbar, do, ckpt, *, scale, eps, bs, interpret):
  """B1 by `BlockSizes.b1_impl`: (dq_main, ĝ, dk_main, dv), as dilution_bwd.reverse_sweep."""
  if _uses_mosaic(bs, "b1_impl", dilution_mgpu.supported(q, bs.ckpt_rows)):
    return dilution_mgpu.reverse_sweep(q, k, v, seg, lse, ssum, dbar, do, ckpt, scale=scale,
                                       eps=eps, ckpt_rows=bs.ckpt_rows,
                                       mask_pieces=bs.b1_mask_pieces,
                                       registers=bs.mosaic_registers, lean=bs.mosaic_lean,
                                       skip_masks=bs.mosaic_skip_masks,
                                       chain=bs.mosaic_chain_pieces, interpret=interpret)
  return dilution_bwd.reverse_sweep(q, k, v, seg, lse, ssum, dbar, do, ckpt, scale=scale, eps=eps,
                                    bs=bs, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _dilution_core(q, k, v, seg, scale, eps, bs, interpret):
  out_f32, _ = _forward(q, k, v, seg, scale, eps, bs, interpret, training=False)
  return out_f32.astype(q.dtype)


def _core_fwd(q, k, v, seg, scale, eps, bs, interpret):
  out_f32, (lse, pk, ssum, _, ckpt) = _forward(q, k, v, seg, scale, eps, bs, interpret,
                                               training=True)
  return out_f32.astype(q.dtype), (q, k, v, seg, out_f32, lse, pk, ssum, ckpt)


def _core_bwd(scale, eps, bs, interpret, res, do):
  q, k, v, seg, out_f32, lse, pk, ssum, ckpt = res
  B, T, N, D = q.shape
  K = k.shape[2]
  # dbar_i = dO_i·O_i with the fp32 output (exact identity Σ_k σ_ik dO_i·v_k/(S_i+eps)).
  dbar = jnp.einsum("BTND,BTND->BNT", do.astype(jnp.float32), out_f32)
  dq_main, ghat, dk_main, dv = b1_reverse_sweep(
      q, k, v, seg, lse, ssum, dbar, do.astype(q.dtype), ckpt, scale=scale, eps=eps, bs=bs,
      interpret=interpret)
  if _uses_mosaic(bs, "b2_impl", dilution_mgpu_b2.supported(q)):
    corr = dilution_mgpu_b2.dk_correction(q, k, seg, lse, ghat, scale=scale, interpret=interpret)
  else:
    corr = dilution_bwd.dk_correction(q, k, seg, lse, ghat, scale=scale, bs=bs,
                                      interpret=interpret)
  dq = dq_main - ghat.transpose(0, 2, 1)[..., None] * pk
  dk = scale * (dk_main - corr)
  # GQA: a kv head's gradient is the sum over its query-head group.
  dk = dk.reshape(B, T, K, N // K, D).sum(3)
  dv = dv.reshape(B, T, K, N // K, D).sum(3)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_dilution_core.defvjp(_core_fwd, _core_bwd)


@functools.partial(jax.jit, static_argnames=("scale", "eps", "block_sizes", "interpret"))
def dilution_attention(q, k, v, *, scale=None, eps=1e-9, segment_ids=None, block_sizes=None,
                       interpret=False):
  """Causal dilution attention with an exact custom VJP; out [B, T, Hq, D] in q.dtype.

  `scale` defaults to D**-0.5 (a Python float; static). `segment_ids` int32 [B, T] or None.
  """
  bs = block_sizes or default_block_sizes(q.shape[-1], q.dtype, interpret)
  scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
  if _use_reference(interpret):
    return dilution_reference.dilution_attention(q, k, v, scale=scale, eps=eps,
                                        segment_ids_BT=segment_ids)[0]
  B, T, _ = _check(q, k, v, scale, bs)
  seg = (jnp.zeros((B, T), jnp.int32) if segment_ids is None
         else jnp.asarray(segment_ids, jnp.int32))
  qp, kp, vp, segp = _pad(q, k, v, seg, bs.pad_multiple())
  return _dilution_core(qp, kp, vp, segp, scale, float(eps), bs, interpret)[:, :T]


@functools.partial(jax.jit, static_argnames=("scale", "eps", "block_sizes", "interpret"))
def dilution_prefill(q, k, v, *, scale=None, eps=1e-9, block_sizes=None, interpret=False):
  """Forward-only dilution over a prompt; returns (out [B,T,Hq,D], demand float32 [B,Hq,T]).

  demand[b, h, j] = Σ_i p[i, j], the state `dilution_decode_step` continues from. Not
  differentiable (use `dilution_attention` for training). Without block_sizes it runs the
  training op's F1/F2 choice (`default_block_sizes`: the Mosaic F2 on Hopper).
  """
  bs = block_sizes or default_block_sizes(q.shape[-1], q.dtype, interpret)
  scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
  if _use_reference(interpret):
    return dilution_reference.dilution_attention(q, k, v, scale=scale, eps=eps)
  B, T, _ = _check(q, k, v, scale, bs)
  seg = jnp.zeros((B, T), jnp.int32)
  qp, kp, vp, segp = _pad(q, k, v, seg, bs.pad_multiple(training=False))
  out_f32, (_, _, _, total, _) = _forward(qp, kp, vp, segp, scale, float(eps), bs, interpret,
                                          training=False)
  return out_f32[:, :T].astype(q.dtype), total[:, :, :T]


@functools.partial(jax.jit, static_argnames=("scale", "eps", "block_sizes", "interpret"))
def dilution_decode_step(q, k_cache, v_cache, demand, length, *, scale=None, eps=1e-9,
                         block_sizes=None, interpret=False):
  """One cached step for the query at position length-1; returns (out [B,Hq,D], demand + p).

  q [B, Hq, D]; k_cache, v_cache [B, S_max, Hkv, D] with positions < length filled (the new key
  included); demand float32 [B, Hq, S_max] (zero beyond the filled part); length int or int32 [B].
  """
  bs = block_sizes or BlockSizes()
  scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
  if _use_reference(interpret):
    return dilution_reference.dilution_decode_step(q, k_cache, v_cache, demand, length, scale=scale,
                                          eps=eps)
  if q.ndim != 3:
    raise ValueError(f"q must be [B, Hq, D] for a decode step; got {q.shape}")
  reference.check_qkv(q[:, None], k_cache, v_cache)
  bs.validate(q.shape[-1])
  return dilution_decode.decode_step(q, k_cache, v_cache, demand, length, scale=float(scale),
                                     eps=float(eps), bs=bs, interpret=interpret)
