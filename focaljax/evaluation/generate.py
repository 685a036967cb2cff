"""Running a model outside training: full-forward logits and per-token NLL, and KV-cached decoding.

Every function takes an nnx `Transformer` and splits it once into (graphdef, state); the jitted
cores take the graphdef as a static argument, so each shape compiles once and is reused across
calls and across models of the same architecture.

Decoding: one jitted prefill of the prompt into `model.init_cache`, then one jitted
`jax.lax.fori_loop` over the new tokens (`model.forward_cached` with T == 1). Dilution layers carry
their running demand in the cache and learned-τ layers their prefix sum, so cached decoding equals
recomputing the whole forward at every step (tests/evaluation/test_generate.py checks this).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def _split(model):
  graphdef, state = nnx.split(model)
  return graphdef, state


@functools.partial(jax.jit, static_argnames=("graphdef", "rope_length", "dtype"))
def _logits(graphdef, state, tokens_BT, positions_BT, segment_ids_BT, rope_length, dtype):
  model = nnx.merge(graphdef, state)
  return model(tokens_BT, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT,
               rope_length=rope_length, dtype=dtype)


def logits(model, tokens_BT, *, positions_BT=None, segment_ids_BT=None, rope_length=None,
           dtype=jnp.float32) -> jax.Array:
  """float32 [B, T, V]. `rope_length` defaults to T: RoPE NTK-scales past the trained context."""
  graphdef, state = _split(model)
  return _logits(graphdef, state, jnp.asarray(tokens_BT, jnp.int32), positions_BT, segment_ids_BT,
                 rope_length, dtype)


@functools.partial(jax.jit, static_argnames=("graphdef", "rope_length", "dtype"))
def _token_nll(graphdef, state, inputs_BT, targets_BT, positions_BT, segment_ids_BT, rope_length,
               dtype):
  model = nnx.merge(graphdef, state)
  logits_BTV = model(inputs_BT, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT,
                     rope_length=rope_length, dtype=dtype)
  # Only [B, T] leaves the device: long passes never copy [B, T, V] logits to the host.
  target_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits_BTV, axis=-1) - target_BT


def token_nll(model, inputs_BT, targets_BT, *, positions_BT=None, segment_ids_BT=None,
              rope_length=None, dtype=jnp.float32) -> jax.Array:
  """Teacher-forced negative log-likelihood of each target, float32 [B, T]."""
  graphdef, state = _split(model)
  return _token_nll(graphdef, state, jnp.asarray(inputs_BT, jnp.int32),
                    jnp.asarray(targets_BT, jnp.int32), positions_BT, segment_ids_BT, rope_length,
                    dtype)


@functools.partial(jax.jit, static_argnames=("graphdef", "n", "rope_length", "dtype"))
def _tail_logprobs(graphdef, state, tokens_BT, n, rope_length, dtype):
  model = nnx.merge(graphdef, state)
  logits_BTV = model(tokens_BT, rope_length=rope_length, dtype=dtype)
  return jax.nn.log_softmax(logits_BTV[:, -n:], axis=-1)


def tail_logprobs(model, tokens_BT, n: int = 1, *, rope_length=None, dtype=jnp.float32):
  """log-softmax of the last `n` positions, float32 [B, n, V] (all a scorer of endings needs)."""
  graphdef, state = _split(model)
  return _tail_logprobs(graphdef, state, jnp.asarray(tokens_BT, jnp.int32), n, rope_length, dtype)


def _nucleus(logits_BV, top_p):
  """Logits outside the top-p nucleus set to -inf; the most likely token always stays."""
  sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
  probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
  # Keep a token while the mass before it is < top_p: the smallest set whose mass reaches top_p.
  before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
  keep_BV = before_BV < top_p
  threshold_B = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits_BV >= threshold_B, logits_BV, -jnp.inf)


def _pick(logits_BV, key, temperature, top_p, greedy):
  if greedy:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = _nucleus(logits_BV / temperature, top_p)
  return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "rope_length", "dtype"))
def _prefill(graphdef, state, prompt_BT, max_len, rope_length, dtype):
  model = nnx.merge(graphdef, state)
  caches = model.init_cache(prompt_BT.shape[0], max_len, dtype)
  logits_BTV, caches = model.forward_cached(prompt_BT, caches, 0, rope_length=rope_length,
                                            dtype=dtype)
  return logits_BTV[:, -1], caches


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "rope_length", "dtype",
                                             "greedy"))
def _decode(graphdef, state, caches, logits_BV, prompt_BT, key, temperature, top_p, eos_id,
            max_new, rope_length, dtype, greedy):
  model = nnx.merge(graphdef, state)
  B, T = prompt_BT.shape
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
                                               rope_length=rope_length, dtype=dtype)
    return out_BL, caches, step_logits[:, 0], done_B

  done_B = jnp.zeros((B,), bool)
  out_BL, *_ = jax.lax.fori_loop(0, max_new, step, (out_BL, caches, logits_BV, done_B))
  return out_BL


def generate(model, prompt_tokens_BT, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, rng=None, eos_id: int | None = None,
             rope_length: int | None = None, dtype=jnp.float32) -> jax.Array:
  """Continues same-length prompts; returns int32 [B, T + max_new_tokens] (prompt included).

  temperature 0 is greedy; otherwise samples from softmax(logits / temperature) restricted to the
  top-p nucleus, with `rng` (a PRNG key; default key 0). After a row emits `eos_id` it is padded
  with `eos_id`. `rope_length` (the NTK length for RoPE layers) defaults to the final length, so
  the prompt and the new tokens share one rotary base.
  """
  prompt_BT = jnp.asarray(prompt_tokens_BT, jnp.int32)
  if prompt_BT.ndim != 2 or prompt_BT.shape[1] == 0:
    raise ValueError(f"prompt_tokens_BT must be [B, T] with T >= 1, got shape {prompt_BT.shape}")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  max_len = prompt_BT.shape[1] + max_new_tokens
  rope_length = rope_length or max_len
  key = jax.random.key(0) if rng is None else rng
  graphdef, state = _split(model)
  logits_BV, caches = _prefill(graphdef, state, prompt_BT, max_len, rope_length, dtype)
  return _decode(graphdef, state, caches, logits_BV, prompt_BT, key,
                 jnp.float32(max(temperature, 1e-6)), jnp.float32(top_p),
                 jnp.int32(-1 if eos_id is None else eos_id), max_new_tokens, rope_length, dtype,
                 temperature == 0.0)
