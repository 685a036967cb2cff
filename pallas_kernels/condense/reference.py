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
  """The spec of `candidate_attention` (focus.candidates' visibility)."""
  R, Q = q_RQND.shape[:2]
  visible_RQS = jnp.arange(k_RSKD.shape[1])[None, None, :] < visible_len_RQ[:, :, None]
  if self_k_RQKD is not None:
    visible_RQS = jnp.concatenate(
        [visible_RQS, jnp.broadcast_to(jnp.eye(Q, dtype=bool), (R, Q, Q))], axis=-1)
    k_RSKD = jnp.concatenate([k_RSKD, self_k_RQKD], 1)
    v_RSKD = jnp.concatenate([v_RSKD, self_v_RQKD], 1)
  return _attend_reference(q_RQND, k_RSKD, v_RSKD, visible_RQS, scale)


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
