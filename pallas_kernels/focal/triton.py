"""Flash attention with a fused, differentiable per-query temperature (Pallas, Triton lowering).

  out[b, t, n] = Σ_s softmax_s(scale[b, n, t] · q[b, t, n]·k[b, s, n // G]) · v[b, s, n // G]

over the visible keys (causal: s <= t; packed `segment_ids`: same segment). The spec is
`pallas_kernels.focal.reference.attention`; `scale` is a float or an array broadcastable to [B, Hq, T]
and receives a gradient (a learned temperature). Algorithm: FlashAttention-2 (Dao 2023,
arXiv 2307.08691) §3.1 forward / §3.2 backward (the Triton tutorial structure), with the
temperature applied to the float32 logits row by row instead of folded into q (no bf16 rounding
of q·scale, and d_scale comes out of the dq pass for free).

Passes (all grids are (sequence blocks, B, Hq); G = Hq // Hkv query heads share a kv head, which
the k/v index maps pick as n // G):
  forward  `_fwd_kernel`, grid (T/block_q, B, Hq): q tile resident, loop over kv blocks with the
           online softmax; carries acc [block_q, D] f32, running max m and sum l [block_q] f32
           (base-2 units: log2(e) is folded into the row scale so the loop uses exp2). Writes out
           (q.dtype) and lse [B, Hq, T] f32 (base 2).
  delta    rowsum(dO·O) [B, Hq, T] f32, one fused XLA reduction (memory bound; no kernel needed).
  dk/dv    `focal_flash_bwd._dkv_kernel`, grid (S/block_kv_dkv, B, Hq): k/v tile resident, loop
           over q blocks; carries dk, dv [block_kv_dkv, D] f32. GQA: computed per query head
           ([B, S, Hq, D] f32) and summed over the group outside the kernel (G == 1 writes k.dtype
           directly, no extra memory).
  dq       `focal_flash_bwd._dq_kernel`, grid (T/block_q_dq, B, Hq): q/dO tile resident, loop over
           kv blocks; carries dq [block_q_dq, D] f32 and d_scale [block_q_dq] f32.
Causal block skipping: a q block visits only kv blocks holding a key <= its last query, and only
the blocks crossing the diagonal pay for the mask (two loops with static `masked`). Segment ids
mask every visited block (no per-segment skipping).

Residuals for the backward: q, k, v, the f32 scale [B, Hq, T], segment ids, out and the row
log-sum-exp (B·Hq·T·4 bytes) -- never the probabilities.

d_scale: logits = s_t · r_ts with r = q·k; dlogits_ts = p_ts (dP_ts − delta_t), dP = dO·vᵀ;
d_scale_t = Σ_s dlogits_ts · r_ts, accumulated in float32 from the f32 raw logits already in the dq
loop (more accurate for bf16 than the q_t·dq_t / s_t identity, which would reuse the bf16-rounded
dlogits of the dq matmul). A float `scale` gets no cotangent (it is a constant).

Block sizes (`BlockSizes`, frozen) must be powers of two >= 16 dividing T (q blocks) and S (kv
blocks) after clipping to the sequence length; head dims are powers of two in [16, 256]. Violations
raise ValueError (no silent padding). `BlockSizes.default` picks tiles by head dim and dtype
(untuned guesses until the H200 sweep in bench/attention.py --sweep). On TPU
(jax.default_backend() == "tpu", not interpreting) `focal_attention` hands off to
`pallas_kernels.focal.tpu`. On CPU run with interpret=True.

Limits: first-order gradients only (the backward kernels have no JVP); Triton offsets are int32,
so each operand must hold < 2**31 elements; no dropout, bias, sliding window or softcap.
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
# The running max starts finite so a row whose first visited blocks are fully masked gives
# exp2(-inf - MASK_VALUE) = 0 rather than exp2(-inf + inf) = nan.
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
    # The f32 accumulators live in registers ([block, D] each) and the tiles in shared memory:
    # D=256 and 4-byte inputs get half-size tiles.
    if head_dim > 128 or jnp.dtype(dtype).itemsize > 2:
      return cls(block_q=64, block_kv=32, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32,
                 block_kv_dq=32, num_warps_fwd=4 if head_dim <= 64 else 8)
    if head_dim <= 64:
      return cls(num_warps_fwd=4, num_warps_bwd=4, num_stages_fwd=3)
    return cls()


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything static one call needs (hashable: custom_vjp nondiff arg and jit key)."""
  causal: bool
  blocks: BlockSizes
  interpret: bool
  group: int  # G = Hq // Hkv


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
  """Causal grids visit q blocks last-first: the heaviest programs start early and the final,
  partially filled wave of the GPU holds the light ones."""
  return n_q - 1 - pid if causal else pid


def cdiv(a, b: int):
  # lax.div truncates; every operand here is non-negative.
  return lax.div(a + (b - 1), b)


def kv_block_range(i, block_q: int, block_k: int, n_kv: int, causal: bool):
  """For q block i: (first kv block needing the causal mask, end of visited kv blocks).

  Blocks [0, n_full) are fully visible; [n_full, n_end) cross the diagonal. With power-of-two
  blocks a q block start i·block_q is never ≡ -1 (mod block_k), so n_full = ⌊i·block_q/block_k⌋.
  """
  if not causal:
    return n_kv, n_kv
  n_end = jnp.minimum(cdiv((i + 1) * block_q, block_k), n_kv)
  n_full = jnp.minimum(lax.div(i * block_q, block_k), n_end)
  return n_full, n_end


def run_loops(body, carry, lo, mid, hi, *, causal: bool, segments: bool, masked_first: bool):
  """Loops body(j, carry, masked=...) over blocks [lo, hi); with causal alone only the diagonal
  part ([lo, mid) if masked_first else [mid, hi)) pays for the mask; segments mask everything."""
  if segments:
    return lax.fori_loop(lo, hi, functools.partial(body, masked=True), carry)
  if not causal:
    return lax.fori_loop(lo, hi, functools.partial(body, masked=False), carry)
  first, second = (True, False) if masked_first else (False, True)
  carry = lax.fori_loop(lo, mid, functools.partial(body, masked=first), carry)
  return lax.fori_loop(mid, hi, functools.partial(body, masked=second), carry)


def compiler_params(num_warps: int, num_stages: int):
  # Explicit Triton params: on jax >= 0.9 GPUs this is what routes pallas_call through Triton
  # rather than Mosaic GPU (the default).
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


def _forward(q, k, v, s_BNT, seg_BT, st: _Static):
  B, T, N, D = q.shape
  S = k.shape[1]
  bq = clip_block(st.blocks.block_q, T, "block_q")
  bk = clip_block(st.blocks.block_kv, S, "block_kv")
  G = st.group
  n_q, causal = T // bq, st.causal
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
      compiler_params=compiler_params(st.blocks.num_warps_fwd, st.blocks.num_stages_fwd),
      interpret=st.interpret, name="focal_flash_fwd")(q, k, v, s_BNT, seg_BT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, s_BNT, seg_BT, st: _Static):
  return _forward(q, k, v, s_BNT, seg_BT, st)[0]


def _flash_fwd(q, k, v, s_BNT, seg_BT, st: _Static):
  out, lse_BNT = _forward(q, k, v, s_BNT, seg_BT, st)
  return out, (q, k, v, s_BNT, seg_BT, out, lse_BNT)


def _flash_bwd(st: _Static, res, do):
  from pallas_kernels.focal import triton_bwd as focal_flash_bwd  # pylint: disable=import-outside-toplevel
  q, k, v, s_BNT, seg_BT, out, lse_BNT = res
  dq, dk, dv, ds_BNT = focal_flash_bwd.backward(q, k, v, s_BNT, seg_BT, out, lse_BNT, do, st)
  return dq, dk, dv, ds_BNT, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def clip_block(block: int, length: int, name: str) -> int:
  b = min(block, length)
  if b < 16 or b & (b - 1):
    raise ValueError(f"{name}={block} clipped to the sequence length {length} gives {b}: block "
                     f"sizes must be powers of two >= 16 (Triton tiles)")
  if length % b:
    raise ValueError(f"sequence length {length} must be a multiple of {name}={b} (no padding)")
  return b


def _check(q, k, v, segment_ids, blocks: BlockSizes):
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
  for name in ("block_q", "block_q_dkv", "block_q_dq"):
    clip_block(getattr(blocks, name), T, name)
  for name in ("block_kv", "block_kv_dkv", "block_kv_dq"):
    clip_block(getattr(blocks, name), S, name)
  return B, T, S, N, K, D


KERNELS = ("auto", "triton", "mosaic")


def hopper() -> bool:
  """Compiling for an sm_90 GPU (H100/H200), where the Mosaic GPU kernel applies."""
  if jax.default_backend() != "gpu":
    return False
  return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def focal_attention(q, k, v, *, scale, causal: bool = True, segment_ids=None,
                    interpret: bool = False, block_sizes: BlockSizes | None = None,
                    kernel: str = "auto"):
  """softmax(scale · q·kᵀ) · v over the visible keys; see the module docstring.

  q [B, T, Hq, D]; k, v [B, S, Hkv, D], one dtype (f32/bf16/f16); `scale` a float or an array
  broadcastable to [B, Hq, T] (differentiable); `segment_ids` int32 [B, T] (needs T == S).
  `interpret=True` runs the Pallas interpreter (CPU). Returns [B, T, Hq, D] in q.dtype.

  `kernel`: "auto" compiles for Hopper through `focal_mgpu` (Mosaic GPU, wgmma/TMA) whenever
  `focal_mgpu.supported` accepts the call (bf16/fp16, D 64/128, tile-aligned T; packed segment
  ids included: its segment masking passed compiled on the H200 on 2026-11-30), and
  through this module's Triton kernels otherwise; "triton" / "mosaic" force one (a call "mosaic"
  cannot take raises its reason).
  """
  if kernel not in KERNELS:
    raise ValueError(f"kernel={kernel!r}: expected one of {KERNELS}")
  if jax.default_backend() == "tpu" and not interpret:
    # Dispatch before jit so the TPU route still sees a Python-float scale as a float.
    from pallas_kernels.focal import tpu as focal_tpu  # pylint: disable=import-outside-toplevel
    return focal_tpu.focal_attention(q, k, v, scale=scale, causal=causal,
                                     segment_ids=segment_ids)
  if kernel == "mosaic" or (kernel == "auto" and not interpret and hopper()):
    from pallas_kernels.focal import mosaic as focal_mgpu  # pylint: disable=import-outside-toplevel
    # int32 as the Triton route casts them, so an int64 batch does not silently fall back.
    seg_BT = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    why = focal_mgpu.supported(q, k, v, seg_BT, causal)
    if why is None:
      return focal_mgpu.focal_attention(q, k, v, scale=scale, causal=causal, segment_ids=seg_BT,
                                        interpret=interpret)
    if kernel == "mosaic":
      raise ValueError(f"kernel='mosaic': {why}")
  return _attention(q, k, v, scale, segment_ids, causal=causal, interpret=interpret,
                    block_sizes=block_sizes or BlockSizes.default(q.shape[-1], q.dtype))


@functools.partial(jax.jit, static_argnames=("causal", "interpret", "block_sizes"))
def _attention(q, k, v, scale, segment_ids, *, causal: bool, interpret: bool,
               block_sizes: BlockSizes):
  B, _, _, N, K, _ = _check(q, k, v, segment_ids, block_sizes)
  T = q.shape[1]
  s_BNT = reference.scale_BNT(scale, B, N, T)  # broadcast's transpose sums d_scale back
  seg_BT = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  return _flash(q, k, v, s_BNT, seg_BT, _Static(causal, block_sizes, interpret, N // K))
