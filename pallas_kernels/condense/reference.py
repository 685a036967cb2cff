"""Pure-JAX specs of `condense.api` (f32, materialises every [T, S] matrix) and a diagnostic."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30   # logits: finite, so masked entries get exactly zero probability


def _probs_reference(q_RTND, k_RSKD, visible_RTS, scale):
  """softmax(scale·q·kᵀ) over an explicit visibility, float32 [R, K, G, T, S]."""
  R, T, N, D = q_RTND.shape
  K = k_RSKD.shape[2]
  logits_RKGTS = jnp.einsum("RTKGD,RSKD->RKGTS", q_RTND.reshape(R, T, K, N // K, D), k_RSKD,
                            preferred_element_type=jnp.float32) * scale
  logits_RKGTS = jnp.where(visible_RTS[:, None, None], logits_RKGTS, _MASKED)
  return jax.nn.softmax(logits_RKGTS, axis=-1)


def _attend_reference(q_RTND, k_RSKD, v_RSKD, visible_RTS, scale):
  """softmax(scale·q·kᵀ) v over an explicit visibility in q.dtype; rows seeing nothing give 0."""
  R, T, N, D = q_RTND.shape
  probs_RKGTS = _probs_reference(q_RTND, k_RSKD, visible_RTS, scale)
  out_RTKGD = jnp.einsum("RKGTS,RSKD->RTKGD", probs_RKGTS, v_RSKD.astype(jnp.float32))
  out_RTND = out_RTKGD.reshape(R, T, N, D)
  return jnp.where(visible_RTS.any(-1)[..., None, None], out_RTND, 0.0).astype(q_RTND.dtype)


def candidate_attention_reference(q_RQND, k_RSKD, v_RSKD, visible_len_RQ, self_k_RQKD=None,
                                  self_v_RQKD=None, *, scale):
  """The spec of `candidate_attention` (focus.candidates' visibility). The self key joins as one
  more logit column rather than a concatenated key: a decode step then reads the cache once and
  never copies it."""
  R, Q, N, D = q_RQND.shape
  S, K = k_RSKD.shape[1], k_RSKD.shape[2]
  q_RQKGD = q_RQND.reshape(R, Q, K, N // K, D)
  visible_RQS = jnp.arange(S)[None, None, :] < visible_len_RQ[:, :, None]
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  logits_RKGQS = jnp.einsum("RQKGD,RSKD->RKGQS", q_RQKGD, k_RSKD,
                            preferred_element_type=jnp.float32) * scale
  logits_RKGQS = jnp.where(visible_RQS[:, None, None], logits_RKGQS, _MASKED)
  if self_k_RQKD is not None:
    self_RQKG = (f32(q_RQKGD) * f32(self_k_RQKD)[:, :, :, None]).sum(-1) * scale
    logits_RKGQS = jnp.concatenate([logits_RKGQS, self_RQKG.transpose(0, 2, 3, 1)[..., None]],
                                   axis=-1)
  probs_RKGQS = jax.nn.softmax(logits_RKGQS, axis=-1)
  out_RQKGD = jnp.einsum("RKGQS,RSKD->RQKGD", probs_RKGQS[..., :S], f32(v_RSKD))
  if self_k_RQKD is None:
    seen_RQ = visible_RQS.any(-1)   # rows seeing nothing give 0
    out_RQKGD = jnp.where(seen_RQ[:, :, None, None, None], out_RQKGD, 0.0)
  else:
    out_RQKGD = out_RQKGD + (probs_RKGQS[..., S].transpose(0, 3, 1, 2)[..., None]
                             * f32(self_v_RQKD)[:, :, :, None])
  return out_RQKGD.reshape(R, Q, N, D).astype(q_RQND.dtype)


def local_attention_reference(q_RTND, k_RTKD, v_RTKD, cand_k_RCKD, cand_v_RCKD, *, scale):
  """The spec of `local_attention`: [candidates (all visible) | causal local tokens]."""
  R, T = q_RTND.shape[:2]
  C = cand_k_RCKD.shape[1]
  visible_RTS = jnp.broadcast_to(jnp.concatenate(
      [jnp.ones((T, C), bool), jnp.tril(jnp.ones((T, T), bool))], axis=1), (R, T, C + T))
  return _attend_reference(q_RTND, jnp.concatenate([cand_k_RCKD, k_RTKD], 1),
                           jnp.concatenate([cand_v_RCKD, v_RTKD], 1), visible_RTS, scale)


def candidate_mass_reference(q_RND, k_RTKD, cand_k_RCKD, at_R, *, scale):
  """Diagnostic: the probability local query at_R[r] puts on each candidate, float32 [R, N, C]."""
  R, N, _ = q_RND.shape
  T, C = k_RTKD.shape[1], cand_k_RCKD.shape[1]
  keys_RSKD = jnp.concatenate([cand_k_RCKD.astype(k_RTKD.dtype), k_RTKD], 1)
  visible_RS = jnp.concatenate([jnp.ones((R, C), bool),
                                jnp.arange(T)[None, :] <= jnp.asarray(at_R)[:, None]], axis=1)
  probs_RKG1S = _probs_reference(q_RND[:, None], keys_RSKD, visible_RS[:, None], scale)
  return probs_RKG1S[:, :, :, 0, :C].reshape(R, N, C)
