"""Cached dilution decode on Triton (flash-decoding), two launches on grid (S_max/split_k, B, Hq):
D1 `_logits_kernel` writes the split's f32 logits and online (max, sum), merged into lse by XLA;
D2 `_share_kernel` forms p, the shares, Σσv, Σσ and updates the demand in place (aliased).
Keys at or beyond `length` are never read; products are f32 broadcast-reduce (bandwidth-bound).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.dilution.triton_fwd import MASK_VALUE, NUM_STAGES_FWD, idiv, warps


def _n_chunks(c, length, split, block):
  """Chunks of this split that hold keys < length (0 when the split starts past length)."""
  return jnp.clip(idiv(length - c * split + block - 1, block), 0, split // block)


def _logits_kernel(q_ref, k_ref, len_ref, logit_ref, ml_ref, *, scale, split, block):
  c = pl.program_id(0)
  length = len_ref[()]
  q_D = q_ref[...].astype(jnp.float32)

  def body(u, carry):
    m, l = carry
    k0 = u * block
    k_SD = k_ref[pl.ds(k0, block), :].astype(jnp.float32)
    vis_S = c * split + k0 + lax.broadcasted_iota(jnp.int32, (block,), 0) < length
    s_S = jnp.where(vis_S, (k_SD * q_D[None, :]).sum(axis=1) * scale, MASK_VALUE)
    logit_ref[pl.ds(k0, block)] = s_S
    m_new = jnp.maximum(m, s_S.max())
    l = l * jnp.exp(m - m_new) + jnp.where(vis_S, jnp.exp(s_S - m_new), 0.0).sum()
    return m_new, l

  m, l = lax.fori_loop(0, _n_chunks(c, length, split, block), body,
                       (jnp.float32(MASK_VALUE), jnp.float32(0.0)))
  # (max, sum) as a 2-vector: avoids scalar stores.
  ml_ref[...] = jnp.where(lax.broadcasted_iota(jnp.int32, (2,), 0) == 0, m, l)


def _share_kernel(v_ref, len_ref, logit_ref, lse_ref, dem_in_ref, dem_ref, acc_ref, ssum_ref, *,
                  eps, split, block):
  del dem_in_ref  # aliased to dem_ref: keys beyond `length` keep their demand
  c = pl.program_id(0)
  length = len_ref[()]
  lse = lse_ref[()]

  def body(u, carry):
    acc_D, ssum = carry
    k0 = u * block
    keys = pl.ds(k0, block)
    vis_S = c * split + k0 + lax.broadcasted_iota(jnp.int32, (block,), 0) < length
    p_S = jnp.where(vis_S, jnp.exp(logit_ref[keys] - lse), 0.0)
    committed_S = dem_ref[keys]
    share_S = p_S / (committed_S + p_S + eps)
    dem_ref[keys] = committed_S + p_S
    v_SD = v_ref[keys, :].astype(jnp.float32)
    return acc_D + (share_S[:, None] * v_SD).sum(axis=0), ssum + share_S.sum()

  D = acc_ref.shape[-1]
  acc_D, ssum = lax.fori_loop(0, _n_chunks(c, length, split, block), body,
                              (jnp.zeros((D,), jnp.float32), jnp.float32(0.0)))
  acc_ref[...] = acc_D
  ssum_ref[...] = jnp.where(lax.broadcasted_iota(jnp.int32, (2,), 0) == 0, ssum, 0.0)


def decode_step(q, k_cache, v_cache, demand, length, *, scale, eps, bs, interpret):
  B, N, D = q.shape
  S = k_cache.shape[1]
  G = N // k_cache.shape[2]
  block = bs.block_k_decode
  # The largest split (≤ split_k_decode) dividing S_max: the cache is copied only when S_max is
  # not a multiple of block_k_decode.
  split = min(bs.split_k_decode, max(block, pl.next_power_of_2(S)))
  while split > block and S % split:
    split //= 2
  pad = -S % split
  if pad:
    # Keeps every loaded chunk in bounds; padded keys sit beyond `length` and are never read.
    cfg = ((0, 0), (0, pad), (0, 0), (0, 0))
    k_cache, v_cache = jnp.pad(k_cache, cfg), jnp.pad(v_cache, cfg)
    demand = jnp.pad(demand, ((0, 0), (0, 0), (0, pad)))
  Sp = S + pad
  n_split = Sp // split
  length_B = jnp.broadcast_to(jnp.asarray(length, jnp.int32), (B,))
  params = pltriton.CompilerParams(num_warps=warps(D), num_stages=NUM_STAGES_FWD)
  grid = (n_split, B, N)
  kv_spec = pl.BlockSpec((None, split, None, D), lambda c, b, h: (b, c, idiv(h, G), 0))
  len_spec = pl.BlockSpec((None,), lambda c, b, h: (b,))
  key_spec = pl.BlockSpec((None, None, split), lambda c, b, h: (b, h, c))
  split_spec = pl.BlockSpec((None, None, None, 2), lambda c, b, h: (b, h, c, 0))

  logits, ml = pl.pallas_call(
      functools.partial(_logits_kernel, scale=scale, split=split, block=block),
      grid=grid,
      in_specs=[pl.BlockSpec((None, None, D), lambda c, b, h: (b, h, 0)), kv_spec, len_spec],
      out_specs=[key_spec, split_spec],
      out_shape=[jax.ShapeDtypeStruct((B, N, Sp), jnp.float32),
                 jax.ShapeDtypeStruct((B, N, n_split, 2), jnp.float32)],
      compiler_params=params, interpret=interpret, name="dilution_decode_logits",
  )(q, k_cache, length_B)
  # Merge the splits' online softmax stats (empty splits have sum 0 and drop out).
  m_BNC, l_BNC = ml[..., 0], ml[..., 1]
  m_BN = m_BNC.max(-1)
  lse_BN = m_BN + jnp.log((l_BNC * jnp.exp(m_BNC - m_BN[..., None])).sum(-1))

  demand_new, acc, ssum = pl.pallas_call(
      functools.partial(_share_kernel, eps=eps, split=split, block=block),
      grid=grid,
      in_specs=[kv_spec, len_spec, key_spec, pl.BlockSpec((None, None), lambda c, b, h: (b, h)),
                key_spec],
      out_specs=[key_spec, pl.BlockSpec((None, None, None, D), lambda c, b, h: (b, h, c, 0)),
                 split_spec],
      out_shape=[jax.ShapeDtypeStruct((B, N, Sp), jnp.float32),
                 jax.ShapeDtypeStruct((B, N, n_split, D), jnp.float32),
                 jax.ShapeDtypeStruct((B, N, n_split, 2), jnp.float32)],
      input_output_aliases={4: 0},
      compiler_params=params, interpret=interpret, name="dilution_decode_share",
  )(v_cache, length_B, logits, lse_BN, demand.astype(jnp.float32))
  out = acc.sum(2) / (ssum[..., 0].sum(2) + eps)[..., None]
  return out.astype(q.dtype), demand_new[:, :, :S]
