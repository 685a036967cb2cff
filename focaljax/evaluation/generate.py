"""Running a model outside training, in float32: logits, per-token NLL and KV-cached decoding
(which equals recomputing: dilution layers cache their running demand, learned-τ layers their
prefix sum). The jitted cores take the graphdef as a static argument: one compile per shape and
architecture."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@functools.partial(jax.jit, static_argnames=("graphdef", "rope_length", "tail"))
def _apply(graphdef, state, tokens_BT, targets_BT, positions_BT, segment_ids_BT, rope_length,
           tail):
  """Logits; with targets their NLL; with `tail` the last positions' log-softmax (only what is
  asked for leaves the device)."""
  model = nnx.merge(graphdef, state)
  logits_BTV = model(tokens_BT, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT,
                     rope_length=rope_length)
  if tail:
    return jax.nn.log_softmax(logits_BTV[:, -tail:], axis=-1)
  if targets_BT is None:
    return logits_BTV
  target_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits_BTV, axis=-1) - target_BT


def _run(model, tokens_BT, targets_BT=None, *, positions_BT=None, segment_ids_BT=None,
         rope_length=None, tail=0):
  targets_BT = None if targets_BT is None else jnp.asarray(targets_BT, jnp.int32)
  return _apply(*nnx.split(model), jnp.asarray(tokens_BT, jnp.int32), targets_BT, positions_BT,
                segment_ids_BT, rope_length, tail)


def logits(model, tokens_BT, *, rope_length=None) -> jax.Array:
  """float32 [B, T, V]. `rope_length` defaults to T: RoPE NTK-scales past the trained context."""
  return _run(model, tokens_BT, rope_length=rope_length)


def token_nll(model, inputs_BT, targets_BT, *, positions_BT=None, segment_ids_BT=None,
              rope_length=None) -> jax.Array:
  """Teacher-forced negative log-likelihood of each target, float32 [B, T]."""
  return _run(model, inputs_BT, targets_BT, positions_BT=positions_BT,
              segment_ids_BT=segment_ids_BT, rope_length=rope_length)


def tail_logprobs(model, tokens_BT, n: int = 1, *, rope_length=None):
  """log-softmax of the last `n` positions, float32 [B, n, V] (all a scorer of endings needs)."""
  return _run(model, tokens_BT, rope_length=rope_length, tail=n)


def _nucleus(logits_BV, top_p):
  """Logits outside the top-p nucleus set to -inf; the most likely token always stays."""
  sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
  probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
  # Keep a token while the mass before it is < top_p: the smallest set whose mass reaches top_p.
  before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
  # The first column explicitly: a top_p below float32's range arrives here as 0.
  keep_BV = (before_BV < top_p) | (jnp.arange(sorted_BV.shape[-1]) == 0)
  threshold_B = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits_BV >= threshold_B, logits_BV, -jnp.inf)


def _pick(logits_BV, key, temperature, top_p, greedy):
  if greedy:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = _nucleus(logits_BV / temperature, top_p)
  return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "rope_length", "greedy"))
def _generate(graphdef, state, prompt_BT, key, temperature, top_p, eos_id, max_new, rope_length,
              greedy):
  model = nnx.merge(graphdef, state)
  B, T = prompt_BT.shape
  caches = model.init_cache(B, T + max_new)
  logits_BTV, caches = model.forward_cached(prompt_BT, caches, 0, rope_length=rope_length)
  out_BL = jnp.concatenate([prompt_BT, jnp.zeros((B, max_new), jnp.int32)], axis=1)

  def step(i, carry):
    out_BL, caches, logits_BV, done_B = carry
    token_B = _pick(logits_BV, jax.random.fold_in(key, i), temperature, top_p, greedy)
    # Finished rows keep emitting eos (eos_id < 0: never finish).
    token_B = jnp.where(done_B, eos_id, token_B)
    done_B = done_B | (token_B == eos_id)
    out_BL = jax.lax.dynamic_update_slice(out_BL, token_B[:, None], (0, T + i))
    # The last iteration's forward is wasted; it keeps the loop body uniform (one compile).
    step_logits, caches = model.forward_cached(token_B[:, None], caches, T + i,
                                               rope_length=rope_length)
    return out_BL, caches, step_logits[:, 0], done_B

  carry = (out_BL, caches, logits_BTV[:, -1], jnp.zeros((B,), bool))
  return jax.lax.fori_loop(0, max_new, step, carry)[0]


def generate(model, prompt_tokens_BT, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, rng=None, eos_id: int | None = None,
             rope_length: int | None = None) -> jax.Array:
  """Continues same-length prompts: int32 [B, T + max_new_tokens]. temperature 0 is greedy, else
  top-p nucleus sampling with `rng` (default key 0); a row that emits `eos_id` is padded with it.
  `rope_length` (RoPE's NTK length) defaults to the final length: one rotary base for all."""
  prompt_BT = jnp.asarray(prompt_tokens_BT, jnp.int32)
  number = lambda x: isinstance(x, (int, float, np.number)) and not isinstance(x, bool)
  if not (number(temperature) and number(top_p)):
    raise ValueError(f"temperature and top_p must be numbers, got {temperature!r}, {top_p!r}")
  for bad, message in (
      (prompt_BT.ndim != 2 or prompt_BT.shape[-1] == 0,
       f"prompt_tokens_BT must be [B, T] with T >= 1, got shape {prompt_BT.shape}"),
      (max_new_tokens < 1, f"max_new_tokens must be >= 1, got {max_new_tokens}"),
      (not 0 <= temperature < np.inf,
       f"temperature must be finite and >= 0 (0 = greedy), got {temperature}"),
      (not 0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}")):
    if bad:
      raise ValueError(message)
  return _generate(*nnx.split(model), prompt_BT, jax.random.key(0) if rng is None else rng,
                   jnp.float32(max(temperature, 1e-6)), jnp.float32(top_p),
                   jnp.int32(-1 if eos_id is None else eos_id), max_new_tokens,
                   rope_length or prompt_BT.shape[1] + max_new_tokens, temperature == 0.0)
