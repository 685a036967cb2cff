"""Dilution attention in Pallas: fused training forward + exact backward, prefill, cached decode.

Per head (spec `reference.py`): p = causal_softmax(scale·q kᵀ), committed_ij = Σ_{r<i} p_rj,
share = p / (committed + p + eps), A = share / (rowsum(share) + eps), out = A v. GQA: query head
h reads kv head h // (Hq/Hkv); a query sees, and adds demand to, keys of its own segment only.

Training (custom_vjp), four passes; `backend` "triton" or "mosaic" (Hopper, 16-bit, D 64/128):
  F1 row stats   row-parallel flash loop: lse_i, pk_i = scale·Σ_j p_ij k_j (Mosaic: V := K)
  F2 key sweep   key-parallel, committed-demand carry per key in registers, rows top-down;
                 S_i = Σ_j σ_ij, N_i = Σ_j σ_ij v_j by f32 atomics; carry stored every R = ckpt_rows
                 rows; out = N / (S + eps) in XLA
  B1 reverse     key-parallel, R-row super-blocks bottom-up: mini-sweep rebuilds the carries from
                 the checkpoint, reverse pass carries the g-suffix; dv, dk_main in registers,
                 ĝ, dq_main by f32 atomics
  B2 dk corr     corr_j = Σ_i p_ij ĝ_i q_i; dq = dq_main − ĝ ⊙ pk, dk = scale·(dk_main − corr) (XLA)
Triton grids (blocks, B, Hq), Mosaic (Hq, blocks, B); T is padded to `BlockSizes.pad_multiple`.
Carries are only rebuilt by forward summation (never total − suffix), so the gradient is exact;
accumulators are f32, atomics make results non-bitwise-deterministic.
Memory (f32, per batch and query head): ≈ 6·T·D + 4·T + ceil(T/R)·T, no T×T tensor.
Prefill: F1 + F2 without checkpoints, returns the demand totals. Decode: Triton flash-decoding
over key splits (triton_decode.py), O(S_max) f32 logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.dilution import mosaic_b1
from pallas_kernels.dilution import mosaic_b2
from pallas_kernels.dilution import mosaic_fwd
from pallas_kernels.dilution import triton_bwd
from pallas_kernels.dilution import triton_decode
from pallas_kernels.dilution import triton_fwd
from pallas_kernels.dilution.blocks import BlockSizes, default_block_sizes, runs_mosaic
from pallas_kernels.focal import reference


def _check(q, k, v, scale, bs, mosaic):
  B, T, S, _, _, D = reference.check_qkv(q, k, v)
  if T != S:
    raise ValueError(f"dilution attention is causal self-attention: T ({T}) must equal S ({S})")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q, k, v must share a dtype (tensor-core operands); got {q.dtype}, "
                     f"{k.dtype}, {v.dtype}")
  if not isinstance(scale, (int, float)):
    raise ValueError(f"scale must be a Python float for the Pallas kernels; got {type(scale)}")
  bs.validate(D, mosaic)
  return B, T


def _pad(q, k, v, seg, multiple):
  """Pads T to `multiple`; padded rows get their own segment, so they never touch real rows."""
  T = q.shape[1]
  pad = -T % multiple
  if not pad:
    return q, k, v, seg
  cfg = ((0, 0), (0, pad), (0, 0), (0, 0))
  sentinel = jnp.iinfo(jnp.int32).min
  seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=sentinel)
  return jnp.pad(q, cfg), jnp.pad(k, cfg), jnp.pad(v, cfg), seg


def _forward(q, k, v, seg, scale, eps, bs, mosaic, interpret, *, training):
  """F1 and F2: (out float32, (lse, pk, S, total, ckpt))."""
  if mosaic:
    lse, pk = mosaic_fwd.row_stats(q, k, seg, scale=scale, with_pk=training, interpret=interpret)
    n, ssum, total, ckpt = mosaic_fwd.key_sweep(
        q, k, v, seg, lse, scale=scale, eps=eps, ckpt_rows=bs.ckpt_rows, with_ckpt=training,
        key_tiles=bs.f2_key_tiles, chain=bs.chain_pieces, interpret=interpret)
  else:
    lse, pk = triton_fwd.row_stats(q, k, seg, scale=scale, bs=bs, with_pk=training,
                                   interpret=interpret)
    n, ssum, total, ckpt = triton_fwd.key_sweep(q, k, v, seg, lse, scale=scale, eps=eps, bs=bs,
                                                with_ckpt=training, interpret=interpret)
  # Row normaliser; float32 until the final cast to the activation dtype.
  out_f32 = n / (ssum.transpose(0, 2, 1)[..., None] + eps)
  return out_f32, (lse, pk, ssum, total, ckpt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _dilution_core(q, k, v, seg, scale, eps, bs, mosaic, interpret):
  out_f32, _ = _forward(q, k, v, seg, scale, eps, bs, mosaic, interpret, training=False)
  return out_f32.astype(q.dtype)


def _core_fwd(q, k, v, seg, scale, eps, bs, mosaic, interpret):
  out_f32, (lse, pk, ssum, _, ckpt) = _forward(q, k, v, seg, scale, eps, bs, mosaic, interpret,
                                               training=True)
  return out_f32.astype(q.dtype), (q, k, v, seg, out_f32, lse, pk, ssum, ckpt)


def _core_bwd(scale, eps, bs, mosaic, interpret, res, do):
  """B1 and B2, then the XLA epilogue."""
  q, k, v, seg, out_f32, lse, pk, ssum, ckpt = res
  B, T, N, D = q.shape
  K = k.shape[2]
  # dbar_i = dO_i·O_i with the float32 output (exact identity Σ_k σ_ik dO_i·v_k/(S_i+eps)).
  dbar = jnp.einsum("BTND,BTND->BNT", do.astype(jnp.float32), out_f32)
  args = (q, k, v, seg, lse, ssum, dbar, do.astype(q.dtype), ckpt)
  if mosaic:
    dq_main, ghat, dk_main, dv = mosaic_b1.reverse_sweep(
        *args, scale=scale, eps=eps, ckpt_rows=bs.ckpt_rows, chain=bs.chain_pieces,
        interpret=interpret)
    corr = mosaic_b2.dk_correction(q, k, seg, lse, ghat, scale=scale, interpret=interpret)
  else:
    dq_main, ghat, dk_main, dv = triton_bwd.reverse_sweep(*args, scale=scale, eps=eps, bs=bs,
                                                          interpret=interpret)
    corr = triton_bwd.dk_correction(q, k, seg, lse, ghat, scale=scale, bs=bs,
                                    interpret=interpret)
  dq = dq_main - ghat.transpose(0, 2, 1)[..., None] * pk
  dk = scale * (dk_main - corr)
  # GQA: a kv head's gradient is the sum over its query-head group.
  dk = dk.reshape(B, T, K, N // K, D).sum(3)
  dv = dv.reshape(B, T, K, N // K, D).sum(3)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_dilution_core.defvjp(_core_fwd, _core_bwd)


def _setup(q, k, v, scale, backend, block_sizes):
  """(block sizes, whether the Mosaic passes run, B, T) after validating the call."""
  D = q.shape[-1]
  mosaic = runs_mosaic(backend, D, q.dtype)
  bs = block_sizes or default_block_sizes(backend, D, q.dtype)
  B, T = _check(q, k, v, scale, bs, mosaic)
  return bs, mosaic, B, T


@functools.partial(jax.jit, static_argnames=("scale", "eps", "backend", "block_sizes",
                                             "interpret"))
def dilution_attention(q, k, v, *, scale, eps, segment_ids=None, backend="triton",
                       block_sizes=None, interpret=False):
  """Causal dilution attention with an exact custom VJP; out [B, T, Hq, D] in q.dtype.
  scale, eps static floats; backend "triton" | "mosaic" (Triton where unsupported);
  block_sizes None: `default_block_sizes(backend, D, dtype)`."""
  bs, mosaic, B, T = _setup(q, k, v, scale, backend, block_sizes)
  seg = (jnp.zeros((B, T), jnp.int32) if segment_ids is None
         else jnp.asarray(segment_ids, jnp.int32))
  qp, kp, vp, segp = _pad(q, k, v, seg, bs.pad_multiple(mosaic))
  return _dilution_core(qp, kp, vp, segp, float(scale), float(eps), bs, mosaic, interpret)[:, :T]


@functools.partial(jax.jit, static_argnames=("scale", "eps", "backend", "block_sizes",
                                             "interpret"))
def dilution_prefill(q, k, v, *, scale, eps, backend="triton", block_sizes=None,
                     interpret=False):
  """Forward-only over a prompt: (out [B,T,Hq,D], demand f32 [B,Hq,T] = Σ_i p_ij)."""
  bs, mosaic, B, T = _setup(q, k, v, scale, backend, block_sizes)
  seg = jnp.zeros((B, T), jnp.int32)
  qp, kp, vp, segp = _pad(q, k, v, seg, bs.pad_multiple(mosaic, training=False))
  out_f32, (_, _, _, total, _) = _forward(qp, kp, vp, segp, float(scale), float(eps), bs, mosaic,
                                          interpret, training=False)
  return out_f32[:, :T].astype(q.dtype), total[:, :, :T]


@functools.partial(jax.jit, static_argnames=("scale", "eps", "block_sizes", "interpret"))
def dilution_decode_step(q, k_cache, v_cache, demand, length, *, scale, eps, block_sizes=None,
                         interpret=False):
  """One cached step for the query at length-1 (q [B, Hq, D], caches [B, S_max, Hkv, D] filled
  below length, demand f32 [B, Hq, S_max]); returns (out [B, Hq, D], demand + p)."""
  bs = block_sizes or BlockSizes()
  if q.ndim != 3:
    raise ValueError(f"q must be [B, Hq, D] for a decode step; got {q.shape}")
  reference.check_qkv(q[:, None], k_cache, v_cache)
  bs.validate(q.shape[-1], mosaic=False)
  return triton_decode.decode_step(q, k_cache, v_cache, demand, length, scale=float(scale),
                                   eps=float(eps), bs=bs, interpret=interpret)
