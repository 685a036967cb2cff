"""Greedy FocusLLM generation: chunk caches built once at prefill, extended by one token per step.

Prefill: every chunk sequence [chunk | last P prompt tokens] except its last token runs through the
frozen base into a per-chunk KV cache with room for the new tokens; the last prompt token is
condensed as the candidate against that cache. Each step:
  1. the local decoder (frozen) over the local window + generated tokens, with the current
     candidates prepended at every layer, gives the next token. It is recomputed every step:
     every local token attends to the candidates, and those change every step;
  2. every chunk cache is extended by the previous newest token (now an ordinary frozen token,
     `candidates.frozen_step`), and the new token is condensed as the next candidate against it.
So the dynamic prompt grows by one token per step (its start stays fixed: shifting it would
invalidate every cached key), and step t equals `focus.logits` with prompt_len = P + t on the
tokens so far (tests/focus/test_focus.py checks this against recomputation from scratch). All
positions stay inside the base's trained context; `focus.check_positions` raises before
generating if not.

Shapes are fixed for the whole generation (a token buffer [B, T + new - 1] whose unwritten tail
is causally invisible), so prefill and step each compile once; the graphdef is a static argument
as in evaluation/generate.py. `cfg.implementation` and `cfg.candidate_path` ride in `state` as
static values (outside the jitted arrays), so every step runs the prefill's code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from focaljax.focus import candidates as cand_lib
from focaljax.focus import model as focus

_STATIC = ("implementation", "candidate_path")   # not arrays
_READOUT = ("candidate_top", "candidate_mass")   # diagnostics, not generation's state


def _local_at(base, state, index, implementation, candidate_mass=False):
  """Next-token logits float32 [B, V] read at buffer position `index` (a traced scalar); with
  `candidate_mass`, also that position's attention on each candidate, [L, B, C]."""
  return focus.local_logits(base, state["tokens"], state["kv"], base.cfg.rope_theta,
                            implementation=implementation,
                            at_B=jnp.full((state["tokens"].shape[0],), index),
                            candidate_mass=candidate_mass)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "max_new_tokens", "readout"))
def _prefill(graphdef, base_state, adapter, memory_BM, prompt_BT, cfg, max_new_tokens, readout):
  base = nnx.merge(graphdef, base_state)
  B, T = prompt_BT.shape
  P = cfg.prompt_tokens(T)
  if memory_BM.shape[1] == 0:
    kv, caches, n = focus.no_candidates(base, B, 1), None, 1
    top_BC = jnp.zeros((B, 0), jnp.int32)
  else:
    h_BCQE, kv, caches = focus.condense(adapter, base, memory_BM, prompt_BT[:, T - P:], 1, cfg,
                                        extra=max_new_tokens - 1)
    n = cfg.chunk_size + P                  # chunk sequence length; the candidate sits at n - 1
    # Each chunk's own guess at the next token (its candidate through the LM head).
    if readout:
      top_BC = _tops(base, h_BCQE[:, :, 0])
  tokens_BL = jnp.zeros((B, T + max_new_tokens - 1), jnp.int32).at[:, :T].set(prompt_BT)
  state = {"tokens": tokens_BL, "length": jnp.int32(T), "caches": caches,
           "kv": [(k[:, :, 0], v[:, :, 0]) for k, v in kv], "candidate_pos": jnp.int32(n - 1)}
  if not readout:
    return state, _local_at(base, state, T - 1, cfg.implementation), {}
  # The first answer token's attention on the candidates: [L, B, C] beside a [B, T] local pass.
  logits_BV, mass_LBC = _local_at(base, state, T - 1, cfg.implementation, candidate_mass=True)
  return state, logits_BV, {"candidate_top": top_BC, "candidate_mass": mass_LBC}


def _tops(base, h_BCE):
  """int32 [B, C]: each chunk's candidate's own top next token (its hidden state, LM head)."""
  logits_BCV = base._logits(h_BCE)  # pylint: disable=protected-access
  return jnp.argmax(logits_BCV, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "readout") + _STATIC)
def _step(graphdef, base_state, adapter, state, token_B, implementation, candidate_path,
          readout):
  base = nnx.merge(graphdef, base_state)
  theta = base.cfg.rope_theta
  length, pos, caches = state["length"], state["candidate_pos"], state["caches"]
  prev_B = jax.lax.dynamic_index_in_dim(state["tokens"], length - 1, axis=1, keepdims=False)
  tokens_BL = jax.lax.dynamic_update_slice(state["tokens"], token_B[:, None].astype(jnp.int32),
                                           (0, length))
  kv, top_BC = state["kv"], jnp.zeros((token_B.shape[0], 0), jnp.int32)
  if caches is not None:
    B, C = kv[0][0].shape[0], caches[0]["k"].shape[0] // kv[0][0].shape[0]
    # The old candidate token becomes an ordinary frozen token of every chunk's dynamic prompt.
    caches = cand_lib.frozen_step(base, caches, jnp.repeat(prev_B, C), pos, theta)
    pos = pos + 1
    h_R1E, kv_R = cand_lib.candidates(adapter, base, caches, jnp.repeat(token_B, C)[:, None],
                                      jnp.full((B * C, 1), pos), theta,
                                      implementation=implementation, path=candidate_path)
    split = lambda x: x[:, 0].reshape(B, C, *x.shape[2:])  # noqa: E731
    kv = [(split(k), split(v)) for k, v in kv_R]
    if readout:
      top_BC = _tops(base, split(h_R1E))
  state = {"tokens": tokens_BL, "length": length + 1, "caches": caches, "kv": kv,
           "candidate_pos": pos}
  if readout:
    state["candidate_top"] = top_BC
  return state, _local_at(base, state, length, implementation)


def prefill(adapter, base, memory_BM, prompt_BT, cfg: focus.FocusConfig, max_new_tokens: int,
            *, readout: bool = False):
  """(state, next-token logits float32 [B, V]); `state` feeds `step`. `state["tokens"][:, :
  state["length"]]` are the tokens so far. With `readout`, diagnostics (computed only then: they
  are not generation's work): `state["candidate_top"]` int32 [B, C], each chunk's candidate's
  own top next token (`step(readout=True)` renews it), and
  `state["candidate_mass"]` float32 [L, B, C], the attention the last prompt token (the one that
  predicts the first new token) puts on each candidate per layer, averaged over heads."""
  if max_new_tokens < 1:
    raise ValueError(f"focus generate: max_new_tokens must be >= 1; got {max_new_tokens}")
  focus.check_base(base)
  prompt_BT, memory_BM = jnp.asarray(prompt_BT, jnp.int32), jnp.asarray(memory_BM, jnp.int32)
  T = prompt_BT.shape[1]
  focus.check_positions(base.cfg, cfg, T, cfg.prompt_tokens(T), extra=max_new_tokens - 1,
                        memory_len=memory_BM.shape[1])
  graphdef, base_state = nnx.split(base)
  state, logits_BV, diagnostics = _prefill(graphdef, base_state, adapter, memory_BM, prompt_BT,
                                           cfg, max_new_tokens, readout)
  return {**state, "implementation": cfg.implementation, "candidate_path": cfg.candidate_path,
          **diagnostics}, logits_BV


def step(adapter, base, state, token_B, *, readout: bool = False):
  """Appends `token_B`: extends every chunk cache by the previous newest token, condenses the new
  candidate, and returns (state, next-token logits float32 [B, V]). At most max_new_tokens - 1
  steps follow one prefill (the buffer and the caches are sized for that). With `readout`,
  `state["candidate_top"]` is the new candidates' own top next token, as after `prefill`."""
  if int(state["length"]) >= state["tokens"].shape[1]:
    raise ValueError("focus generate: more steps than prefill's max_new_tokens - 1")
  graphdef, base_state = nnx.split(base)
  static = {k: state[k] for k in _STATIC}
  arrays = {k: v for k, v in state.items() if k not in _STATIC + _READOUT}
  arrays, logits_BV = _step(graphdef, base_state, adapter, arrays, jnp.asarray(token_B, jnp.int32),
                            readout=readout, **static)
  return {**arrays, **static}, logits_BV


def generate(adapter, base, memory_BM, prompt_BT, cfg: focus.FocusConfig, max_new_tokens: int,
             *, readout: bool = False):
  """Greedy decoding: int32 [B, T + max_new_tokens]; with `readout`, also prefill's diagnostics
  {"candidate_top": [B, C], "candidate_mass": [L, B, C]} (see `prefill`) and
  "candidate_top_steps" int32 [B, max_new_tokens, C]: at s, each chunk's candidate's own guess at
  new token s (s = 0: prefill's "candidate_top"). A key spelled " ", "8", ... is read at its
  first digit, s = 1 (focus/passkey.py)."""
  state, logits_BV = prefill(adapter, base, memory_BM, prompt_BT, cfg, max_new_tokens,
                             readout=readout)
  diagnostics = {k: state[k] for k in _READOUT if k in state}
  tops = [state["candidate_top"]] if readout else []
  for _ in range(max_new_tokens - 1):
    state, logits_BV = step(adapter, base, state, jnp.argmax(logits_BV, -1).astype(jnp.int32),
                            readout=readout)
    tops += [state["candidate_top"]] if readout else []
  if readout:
    diagnostics["candidate_top_steps"] = jnp.stack(tops, axis=1)
  last_B1 = jnp.argmax(logits_BV, -1)[:, None].astype(jnp.int32)
  tokens_BL = jnp.concatenate([state["tokens"], last_B1], axis=1)
  return (tokens_BL, diagnostics) if readout else tokens_BL
