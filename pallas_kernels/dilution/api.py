"""Dilution attention in Pallas: fused training forward + exact backward, prefill, cached decode.

Operator, causal, per head (spec: `reference.py`):
    p = causal_softmax(scale · q kᵀ);  committed_ij = Σ_{r<i} p_rj;
    share = p / (committed + p + eps);  A = share / (rowsum(share) + eps);  out = A v.
Layout q [B, T, Hq, D], k/v [B, T, Hkv, D] (GQA: query head h reads kv head h // (Hq/Hkv)),
segment_ids int32 [B, T] (a query sees, and adds demand to, keys of its own segment only).

Training (`dilution_attention`, jax.custom_vjp), four passes; `backend` picks their kernels
(blocks.py): "triton" (triton_fwd.py, triton_bwd.py) or "mosaic" (mosaic_fwd.py, mosaic_b1.py,
mosaic_b2.py: Hopper, 16-bit inputs, D 64 or 128; other calls fall back to Triton).
  F1 row stats      row-parallel flash loop: lse_i and pk_i = scale·Σ_j p_ij k_j  [QKᵀ, PK]
                    (Mosaic: focal's flash forward with V := K)
  F2 key sweep      key-parallel: a program owns a key block and its committed-demand carry
                    (registers), walks the row tiles top-down; S_i = Σ_j σ_ij and
                    N_i = Σ_j σ_ij v_j by float32 atomics (Mosaic: TMA reduce-adds); the carry
                    is stored every R = ckpt_rows rows (checkpoints)            [QKᵀ, σV]
  out = N / (S + eps)  (XLA)
  B1 reverse sweep  key-parallel, R-row super-blocks bottom-up: a forward mini-sweep rebuilds
                    the tile carries from the checkpoint, then the reverse pass carries the
                    per-key g-suffix; dv, dk_main in registers; ĝ, dq_main by float32 atomics
                    [2 QKᵀ, dO·Vᵀ, AᵀdO, W·K, Wᵀ·Q, in-tile prefix/suffix products]
  B2 dk correction  key-parallel: corr_j = Σ_i p_ij ĝ_i q_i                    [QKᵀ, (PĝᵀQ)]
  dq = dq_main − ĝ ⊙ pk,  dk = scale·(dk_main − corr),  GQA groups summed  (XLA).
The Triton grids are (blocks, B, Hq) (CUDA caps grid axes 1-2 at 65,535), the Mosaic ones
(Hq, blocks, B). The passes exchange only whole per-row / per-key buffers, so each tiles T its
own way; T is padded to a multiple of all (`BlockSizes.pad_multiple`), padded rows in their own
segment.
The gradient is exact: it flows through the cumulative demand and the renormalisation. Carries
are only rebuilt by forward summation from a checkpoint (never total − suffix, which cancels in
float32 for heavy keys), and the in-tile g-suffix is a strictly-triangular product, not column
total − cumsum (a key's first visible row has g ≈ −dσ/p, huge for tiny p).

Precision: softmax, demand, share and every accumulator are float32; 16-bit types appear only as
dot operands (float32 inputs use IEEE dots, Triton only). The in-tile triangular products split
their float32 operand into bf16 pieces: three in the Triton B1 (float32-exact), two in the Mosaic
B1 and F2 (~16 significant bits, relative error ≲ 2⁻¹⁶, below the 16-bit inputs' 8).
Atomics make GPU results non-bitwise-deterministic (float32 summation order).

Memory (no T×T tensor). Per (batch, query head), float32, T padded:
  saved for backward: lse, S (2T) + out_f32, pk (2·T·D) + checkpoints ceil(T/R)·T
  transient: forward N (T·D); backward dq, dk, dv, corr (4·T·D) + ĝ, dbar (2T)
  → extra ≈ B·Hq·(6·T·D + 4·T + ceil(T/R)·T)·4 bytes, R = ckpt_rows (1024).
  E.g. B2 Hq12 T16K D64: the 6·T·D terms 576 MiB, checkpoints 24 MiB per layer.
  The Triton B1 with b1_carries="scratch" adds a transient B·Hq·T·R/block_q float32 (48 MiB at
  B2 Hq12 T16K); with "registers" each program holds [R/block_q, b1_block_k] float32 instead.

Prefill (`dilution_prefill`): F1 without pk + F2 without checkpoints; returns out and the demand
totals (F2's final carries). Extra memory B·Hq·(2·T·D + 3T)·4 bytes, linear in T.

Decode (`dilution_decode_step`, Triton on any GPU): flash-decoding over key splits
(triton_decode.py); keys at or beyond `length` are never read. Extra memory O(B·Hq·S_max) float32
logits. Keep S_max a multiple of block_k_decode (128), or every step pads (copies) the cache.

`interpret=True` runs every kernel in Pallas interpret mode (CPU tests). The functions never query
the hardware: the caller picks the backend (focaljax.dispatch).
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

  scale, eps: Python floats (static). segment_ids: int32 [B, T] or None. backend: "triton" or
  "mosaic" (falls back to "triton" where unsupported). block_sizes: None for
  `default_block_sizes(backend, D, dtype)`.
  """
  bs, mosaic, B, T = _setup(q, k, v, scale, backend, block_sizes)
  seg = (jnp.zeros((B, T), jnp.int32) if segment_ids is None
         else jnp.asarray(segment_ids, jnp.int32))
  qp, kp, vp, segp = _pad(q, k, v, seg, bs.pad_multiple(mosaic))
  return _dilution_core(qp, kp, vp, segp, float(scale), float(eps), bs, mosaic, interpret)[:, :T]


@functools.partial(jax.jit, static_argnames=("scale", "eps", "backend", "block_sizes",
                                             "interpret"))
def dilution_prefill(q, k, v, *, scale, eps, backend="triton", block_sizes=None,
                     interpret=False):
  """Forward-only dilution over a prompt; returns (out [B,T,Hq,D], demand float32 [B,Hq,T]).

  demand[b, h, j] = Σ_i p[i, j], the state `dilution_decode_step` continues from. Not
  differentiable (use `dilution_attention` for training).
  """
  bs, mosaic, B, T = _setup(q, k, v, scale, backend, block_sizes)
  seg = jnp.zeros((B, T), jnp.int32)
  qp, kp, vp, segp = _pad(q, k, v, seg, bs.pad_multiple(mosaic, training=False))
  out_f32, (_, _, _, total, _) = _forward(qp, kp, vp, segp, float(scale), float(eps), bs, mosaic,
                                          interpret, training=False)
  return out_f32[:, :T].astype(q.dtype), total[:, :, :T]


@functools.partial(jax.jit, static_argnames=("scale", "eps", "block_sizes", "interpret"))
def dilution_decode_step(q, k_cache, v_cache, demand, length, *, scale, eps, block_sizes=None,
                         interpret=False):
  """One cached step for the query at position length-1; returns (out [B,Hq,D], demand + p).

  q [B, Hq, D]; k_cache, v_cache [B, S_max, Hkv, D] with positions < length filled (the new key
  included); demand float32 [B, Hq, S_max] (zero beyond the filled part); length int or int32 [B].
  """
  bs = block_sizes or BlockSizes()
  if q.ndim != 3:
    raise ValueError(f"q must be [B, Hq, D] for a decode step; got {q.shape}")
  reference.check_qkv(q[:, None], k_cache, v_cache)
  bs.validate(q.shape[-1], mosaic=False)
  return triton_decode.decode_step(q, k_cache, v_cache, demand, length, scale=float(scale),
                                   eps=float(eps), bs=bs, interpret=interpret)
