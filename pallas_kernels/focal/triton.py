"""Triton focal flash-attention forward (FlashAttention-2); the backward is `triton_bwd`.

Grid (T/block_q, B, Hq): q tile resident, loop over kv blocks (kv head n // G) with the online
softmax on f32 logits times the row scale·log2(e); carries acc [block_q, D], m, l [block_q] f32.
Writes out (q.dtype) and lse [B, Hq, T] f32 base 2. Causal: only blocks crossing the diagonal
mask. `BlockSizes`: powers of two >= 16 dividing T and S after clipping; no padding.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.focal import reference

LOG2E = math.log2(math.e)
# Finite start for the running max: a fully masked first block gives 0, not nan.
MASK_VALUE = reference.MASK_VALUE
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and Triton launch parameters (powers of two >= 16; clipped to T and S)."""
  block_q: int = 128
  block_kv: int = 64
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  block_q_dq: int = 64
  block_kv_dq: int = 64
  num_warps_fwd: int = 8
  num_warps_bwd: int = 8
  num_stages_fwd: int = 2
  num_stages_bwd: int = 2

  @classmethod
  def default(cls, head_dim: int, dtype=jnp.bfloat16) -> "BlockSizes":
    # f32 accumulators in registers, tiles in SMEM: D=256 and 4-byte inputs get half-size tiles.
    if head_dim > 128 or jnp.dtype(dtype).itemsize > 2:
      return cls(block_q=64, block_kv=32, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32,
                 block_kv_dq=32, num_warps_fwd=4 if head_dim <= 64 else 8)
    if head_dim <= 64:
      return cls(num_warps_fwd=4, num_warps_bwd=4, num_stages_fwd=3)
    return cls()


def dot(a, b, contract_a: int, contract_b: int):
  """2-D matmul with f32 accumulation; f32 inputs use IEEE (Triton would otherwise pick TF32)."""
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                         precision=precision, preferred_element_type=jnp.float32)


def visible(q_start, k_start, block_q: int, block_k: int, causal: bool, seg_q, seg_k):
  """Boolean [block_q, block_k] visibility of one tile (causal and/or same segment)."""
  t = q_start + jnp.arange(block_q, dtype=jnp.int32)
  s = k_start + jnp.arange(block_k, dtype=jnp.int32)
  vis = None
  if causal:
    vis = s[None, :] <= t[:, None]
  if seg_q is not None:
    same = seg_q[:, None] == seg_k[None, :]
    vis = same if vis is None else jnp.logical_and(vis, same)
  return vis


def q_block(pid, n_q: int, causal: bool):
  """Causal grids visit q blocks last-first (heaviest programs start early)."""
  return n_q - 1 - pid if causal else pid


def cdiv(a, b: int):
  # lax.div truncates; every operand here is non-negative.
  return lax.div(a + (b - 1), b)


def kv_block_range(i, block_q: int, block_k: int, n_kv: int, causal: bool):
  """For q block i: (first kv block that needs the causal mask, end of visited kv blocks)."""
  if not causal:
    return n_kv, n_kv
  n_end = jnp.minimum(cdiv((i + 1) * block_q, block_k), n_kv)
  n_full = jnp.minimum(lax.div(i * block_q, block_k), n_end)
  return n_full, n_end


def run_loops(body, carry, lo, mid, hi, *, causal: bool, segments: bool, masked_first: bool):
  """body(j, carry, masked=...) over [lo, hi); causal alone masks only the diagonal part."""
  if segments:
    return lax.fori_loop(lo, hi, functools.partial(body, masked=True), carry)
  if not causal:
    return lax.fori_loop(lo, hi, functools.partial(body, masked=False), carry)
  first, second = (True, False) if masked_first else (False, True)
  carry = lax.fori_loop(lo, mid, functools.partial(body, masked=first), carry)
  return lax.fori_loop(mid, hi, functools.partial(body, masked=second), carry)


def compiler_params(num_warps: int, num_stages: int):
  # Explicit Triton params route pallas_call through Triton rather than Mosaic GPU.
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _fwd_kernel(q_ref, k_ref, v_ref, s_ref, seg_ref, o_ref, lse_ref, *, causal, block_q,
                block_k, n_q):
  i = q_block(pl.program_id(0), n_q, causal)
  n_kv = k_ref.shape[0] // block_k
  q_QD = q_ref[...]
  # log2(e) rides on the per-row temperature: one [block_q] multiply buys exp2 in the loop.
  c_Q = s_ref[...] * LOG2E
  seg_q = None if seg_ref is None else seg_ref[pl.ds(i * block_q, block_q)]

  def body(j, carry, *, masked):
    acc_QD, m_Q, l_Q = carry
    kv_slice = pl.ds(j * block_k, block_k)
    k_KD = k_ref[kv_slice, :]
    x_QK = dot(q_QD, k_KD, 1, 1) * c_Q[:, None]
    if masked:
      seg_k = None if seg_ref is None else seg_ref[kv_slice]
      vis = visible(i * block_q, j * block_k, block_q, block_k, causal, seg_q, seg_k)
      x_QK = jnp.where(vis, x_QK, -jnp.inf)
    m_new = jnp.maximum(m_Q, jnp.max(x_QK, axis=1))
    alpha_Q = jnp.exp2(m_Q - m_new)
    p_QK = jnp.exp2(x_QK - m_new[:, None])
    l_Q = alpha_Q * l_Q + jnp.sum(p_QK, axis=1)
    v_KD = v_ref[kv_slice, :]
    # p is cast to v's dtype for the tensor-core matmul (FA2 does the same); acc stays f32.
    acc_QD = acc_QD * alpha_Q[:, None] + dot(p_QK.astype(v_KD.dtype), v_KD, 1, 0)
    return acc_QD, m_new, l_Q

  carry = (jnp.zeros(q_QD.shape, jnp.float32), jnp.full((block_q,), MASK_VALUE, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  n_full, n_end = kv_block_range(i, block_q, block_k, n_kv, causal)
  acc_QD, m_Q, l_Q = run_loops(body, carry, 0, n_full, n_end, causal=causal,
                               segments=seg_ref is not None, masked_first=False)
  # A row with no visible key (never produced by the contract's masks) gives out 0, lse = MASK.
  l_Q = jnp.where(l_Q == 0.0, 1.0, l_Q)
  o_ref[...] = (acc_QD / l_Q[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m_Q + jnp.log2(l_Q)


def forward(q, k, v, s_BNT, seg_BT, *, causal: bool, blocks: BlockSizes, interpret: bool):
  """(out [B, T, Hq, D] q.dtype, lse [B, Hq, T] f32 base 2)."""
  B, T, N, D = q.shape
  S = k.shape[1]
  bq = clip_block(blocks.block_q, T, "block_q")
  bk = clip_block(blocks.block_kv, S, "block_kv")
  G = N // k.shape[2]
  n_q = T // bq
  kernel = functools.partial(_fwd_kernel, causal=causal, block_q=bq, block_k=bk, n_q=n_q)
  tile_q = pl.BlockSpec((None, bq, None, D), lambda i, b, n: (b, q_block(i, n_q, causal), n, 0))
  row_tile = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, q_block(i, n_q, causal)))
  full_kv = pl.BlockSpec((None, S, None, D), lambda i, b, n: (b, 0, lax.div(n, G), 0))
  in_specs = [tile_q, full_kv, full_kv, row_tile,
              None if seg_BT is None else pl.BlockSpec((None, T), lambda i, b, n: (b, 0))]
  out_specs = [tile_q, row_tile]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((B, N, T), jnp.float32)]
  return pl.pallas_call(
      kernel, grid=(n_q, B, N), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=compiler_params(blocks.num_warps_fwd, blocks.num_stages_fwd),
      interpret=interpret, name="focal_flash_fwd")(q, k, v, s_BNT, seg_BT)


_Q_BLOCKS = ("block_q", "block_q_dkv", "block_q_dq")
_KV_BLOCKS = ("block_kv", "block_kv_dkv", "block_kv_dq")


def _tile_problem(block: int, length: int, name: str) -> str | None:
  """Why `block`, clipped to `length`, cannot tile it (None: it can)."""
  b = min(block, length)
  if b < 16 or b & (b - 1):
    return (f"{name}={block} clipped to the sequence length {length} gives {b}: block sizes "
            "must be powers of two >= 16 (Triton tiles)")
  if length % b:
    return f"sequence length {length} must be a multiple of {name}={b} (no padding)"
  return None


def clip_block(block: int, length: int, name: str) -> int:
  if problem := _tile_problem(block, length, name):
    raise ValueError(problem)
  return min(block, length)


def tiles_fit(T: int, S: int, blocks: BlockSizes) -> bool:
  """Whether `check` accepts query length T and key length S under `blocks` (no padding)."""
  return not any(_tile_problem(getattr(blocks, n), L, n)
                 for names, L in ((_Q_BLOCKS, T), (_KV_BLOCKS, S)) for n in names)


def check(q, k, v, segment_ids, blocks: BlockSizes):
  B, T, S, N, K, D = reference.check_qkv(q, k, v)
  if q.dtype != k.dtype or q.dtype != v.dtype or q.dtype not in _DTYPES:
    raise ValueError(f"q, k, v must share one dtype among float32/bfloat16/float16; got "
                     f"{q.dtype}, {k.dtype}, {v.dtype}")
  if D < 16 or D > 256 or D & (D - 1):
    raise ValueError(f"head dim D={D} must be a power of two in [16, 256] (64/128/256 tuned)")
  if segment_ids is not None:
    if T != S:
      raise ValueError(f"segment_ids need T == S; got T={T}, S={S}")
    if tuple(segment_ids.shape) != (B, T):
      raise ValueError(f"segment_ids must be [B, T] = {(B, T)}; got {segment_ids.shape}")
  for name in _Q_BLOCKS:
    clip_block(getattr(blocks, name), T, name)
  for name in _KV_BLOCKS:
    clip_block(getattr(blocks, name), S, name)
  return B, T, S, N, K, D

