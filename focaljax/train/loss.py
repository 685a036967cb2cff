"""The training loss: the per-position cross-entropy of float32 logits and integer targets.

Two implementations of one function, `CROSS_ENTROPIES`: "optax" (its integer-label
cross-entropy under autodiff, the spec) and "explicit" (`cross_entropy`, a custom VJP). `nll`
takes the one focaljax.dispatch picks for the platform.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from focaljax import dispatch


def _logsumexp_one_pass(x_BTV):
  """logsumexp over the last axis as one variadic reduction over (running max, scaled sum):
  jax.nn.logsumexp reads the float32 logits twice (max, then Σ exp)."""
  def combine(a, b):
    (ma, sa), (mb, sb) = a, b
    m = jnp.maximum(ma, mb)
    # A side that saw only -inf logits holds nothing; exp(-inf - -inf) would be nan.
    ea = jnp.where(ma == -jnp.inf, 0.0, sa * jnp.exp(ma - m))
    eb = jnp.where(mb == -jnp.inf, 0.0, sb * jnp.exp(mb - m))
    return m, ea + eb
  f32 = jnp.float32
  m_BT, s_BT = jax.lax.reduce((x_BTV.astype(f32), jnp.ones_like(x_BTV, f32)),
                              (f32(-jnp.inf), f32(0)), combine, (x_BTV.ndim - 1,))
  return m_BT + jnp.log(s_BT)


def _lse_and_nll(logits_BTV, targets_BT):
  lse_BT = _logsumexp_one_pass(logits_BTV)
  return lse_BT, lse_BT - jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]


@jax.custom_vjp
def cross_entropy(logits_BTV, targets_BT):
  """-log softmax(logits)[target] per position, float32; the spec is optax's
  softmax_cross_entropy_with_integer_labels. The log-normaliser is one pass over the logits
  (`_logsumexp_one_pass`), and the backward one elementwise expression, (softmax − onehot)·g,
  with the one-hot from an iota compare: autodiff of the gather leaves a scatter-add into zeros,
  after which XLA writes the float32 [B·T, V] logit gradient and casts it for the head's GEMMs in
  a kernel of its own."""
  return _lse_and_nll(logits_BTV, targets_BT)[1]


def _cross_entropy_fwd(logits_BTV, targets_BT):
  lse_BT, nll_BT = _lse_and_nll(logits_BTV, targets_BT)
  return nll_BT, (logits_BTV, targets_BT, lse_BT)


def _cross_entropy_bwd(res, g_BT):
  logits_BTV, targets_BT, lse_BT = res
  vocab_BTV = jax.lax.broadcasted_iota(jnp.int32, logits_BTV.shape, logits_BTV.ndim - 1)
  onehot_BTV = (vocab_BTV == targets_BT[..., None]).astype(logits_BTV.dtype)
  p_BTV = jnp.exp(logits_BTV - lse_BT[..., None])
  return (p_BTV - onehot_BTV) * g_BT[..., None], None  # integer targets: no cotangent


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)

CROSS_ENTROPIES = {"optax": optax.softmax_cross_entropy_with_integer_labels,
                   "explicit": cross_entropy}


def nll(logits_BTV, targets_BT):
  """float32 [B, T]: the cross-entropy dispatch.choose("cross_entropy") picks for this platform."""
  return CROSS_ENTROPIES[dispatch.choose("cross_entropy").implementation](logits_BTV, targets_BT)
