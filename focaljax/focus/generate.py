"""Greedy FocusLLM generation: each step appends the previous token to every chunk cache (built
once at prefill) as a frozen token, condenses the new one and reruns the local decoder. The prompt
grows by one token a step (its start fixed), so step t equals `focus.logits` with prompt P + t.

`generate` runs every step after the prefill as one compiled loop (lax.scan) over a donated state:
the chunk caches are updated in place and the host neither syncs nor dispatches per token.
`prefill` / `step` / `decode` expose the same pieces; `step` and `decode` consume their state."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from focaljax.focus import model as focus

_STATIC = ("implementation", "candidate_path")   # not arrays
_READOUT = ("candidate_top", "candidate_mass")   # diagnostics, not generation's state
_ROOM = "steps_left"   # a host int: steps the token buffer still holds (no device sync to check)


def _local_at(base, state, index, implementation, candidate_mass=False):
  """Next-token logits float32 [B, V] at buffer position `index` (local_logits)."""
  return focus.local_logits(base, state["tokens"], state["kv"], base.cfg.rope_theta,
                            implementation=implementation, candidate_mass=candidate_mass,
                            at_B=jnp.full((state["tokens"].shape[0],), index))


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "max_new_tokens", "readout"))
def _prefill(graphdef, base_state, adapter, memory_BM, prompt_BT, cfg, max_new_tokens, readout):
  base = nnx.merge(graphdef, base_state)
  B, T = prompt_BT.shape
  P = cfg.prompt_tokens(T)
  h_BCQE, kv, caches = focus.condense(adapter, base, memory_BM, prompt_BT[:, T - P:], 1, cfg,
                                      extra=max_new_tokens - 1)
  tokens_BL = jnp.zeros((B, T + max_new_tokens - 1), jnp.int32).at[:, :T].set(prompt_BT)
  # The candidate sits last in its chunk sequence [chunk | dynamic prompt].
  state = {"tokens": tokens_BL, "length": jnp.int32(T), "caches": caches,
           "kv": [(k[:, :, 0], v[:, :, 0]) for k, v in kv],
           "candidate_pos": jnp.int32(cfg.chunk_size + P - 1)}
  out = _local_at(base, state, T - 1, cfg.implementation, candidate_mass=readout)
  if not readout:
    return state, out
  return {**state, "candidate_top": _tops(base, h_BCQE[:, :, 0]), "candidate_mass": out[1]}, out[0]


def _tops(base, h_BCE):
  """int32 [B, C]: each chunk's candidate's own top next token (its hidden state, LM head)."""
  logits_BCV = base._logits(h_BCE)  # pylint: disable=protected-access
  return jnp.argmax(logits_BCV, axis=-1).astype(jnp.int32)


def _advance(base, adapter, state, token_B, implementation, candidate_path, readout):
  """One step on the device: (state, logits float32 [B, V], candidate tops int32 [B, C])."""
  theta = base.cfg.rope_theta
  length, pos, caches = state["length"], state["candidate_pos"], state["caches"]
  prev_B = jax.lax.dynamic_index_in_dim(state["tokens"], length - 1, axis=1, keepdims=False)
  tokens_BL = jax.lax.dynamic_update_slice(state["tokens"], token_B[:, None].astype(jnp.int32),
                                           (0, length))
  kv, top_BC = state["kv"], jnp.zeros((token_B.shape[0], 0), jnp.int32)
  if caches is not None:   # the old candidate becomes a frozen token of every dynamic prompt
    B, C = kv[0][0].shape[0], kv[0][0].shape[1]
    prev_R, token_R = jnp.repeat(prev_B, C), jnp.repeat(token_B, C)
    kw = dict(implementation=implementation, path=candidate_path)
    if base.cfg.attention.sliding_window:   # Block.cached windows the frozen token's keys
      caches = focus.frozen_step(base, caches, prev_R[:, None], pos, theta)
      h_R1E, kv_R = focus.candidates(adapter, base, caches, token_R[:, None],
                                     jnp.full((B * C, 1), pos + 1), theta, **kw)
    else:
      caches, h_R1E, kv_R = focus.decode_step(adapter, base, caches, prev_R, token_R, pos,
                                              theta, **kw)
    pos = pos + 1
    split = lambda x: x[:, 0].reshape(B, C, *x.shape[2:])  # noqa: E731
    kv = [(split(k), split(v)) for k, v in kv_R]
    top_BC = _tops(base, split(h_R1E)) if readout else top_BC
  state = {"tokens": tokens_BL, "length": length + 1, "caches": caches, "kv": kv,
           "candidate_pos": pos}
  return state, _local_at(base, state, length, implementation), top_BC


@functools.partial(jax.jit, static_argnames=("graphdef", "readout") + _STATIC,
                   donate_argnames=("state",))
def _step(graphdef, base_state, adapter, state, token_B, implementation, candidate_path,
          readout):
  base = nnx.merge(graphdef, base_state)
  state, logits_BV, top_BC = _advance(base, adapter, state, token_B, implementation,
                                      candidate_path, readout)
  return (({**state, "candidate_top": top_BC} if readout else state), logits_BV)


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "readout") + _STATIC,
                   donate_argnames=("state",))
def _decode(graphdef, base_state, adapter, state, logits_BV, steps, implementation,
            candidate_path, readout):
  """`steps` greedy steps as one scan: (state, last logits, tops int32 [steps, B, C])."""
  base = nnx.merge(graphdef, base_state)

  def body(carry, _):
    state, logits_BV = carry
    token_B = jnp.argmax(logits_BV, -1).astype(jnp.int32)
    state, logits_BV, top_BC = _advance(base, adapter, state, token_B, implementation,
                                        candidate_path, readout)
    return (state, logits_BV), top_BC
  (state, logits_BV), tops_SBC = jax.lax.scan(body, (state, logits_BV), length=steps)
  return state, logits_BV, tops_SBC


def prefill(adapter, base, memory_BM, prompt_BT, cfg: focus.FocusConfig, max_new_tokens: int,
            *, readout: bool = False):
  """(state, next-token logits float32 [B, V]); `state` feeds `step`. With `readout`, also
  diagnostics: `state["candidate_top"]` int32 [B, C], each chunk's candidate's own top next token
  (`step(readout=True)` renews it), and `state["candidate_mass"]` float32 [L, B, C], the last
  prompt token's head-averaged attention on each candidate per layer."""
  if max_new_tokens < 1:
    raise ValueError(f"focus generate: max_new_tokens must be >= 1; got {max_new_tokens}")
  focus.check_base(base.cfg)
  prompt_BT, memory_BM = jnp.asarray(prompt_BT, jnp.int32), jnp.asarray(memory_BM, jnp.int32)
  T = prompt_BT.shape[1]
  focus.check_positions(base.cfg, cfg, T, cfg.prompt_tokens(T), extra=max_new_tokens - 1,
                        memory_len=memory_BM.shape[1])
  graphdef, base_state = nnx.split(base)
  state, logits_BV = _prefill(graphdef, base_state, adapter, memory_BM, prompt_BT, cfg,
                              max_new_tokens, readout)
  return {**state, "implementation": cfg.implementation, "candidate_path": cfg.candidate_path,
          _ROOM: max_new_tokens - 1}, logits_BV


def _split_state(state, steps: int):
  if steps > state[_ROOM]:
    raise ValueError(f"focus generate: {steps} more steps, but prefill's max_new_tokens leaves "
                     f"room for {state[_ROOM]}")
  host = {k: state[k] for k in _STATIC}
  arrays = {k: v for k, v in state.items() if k not in _STATIC + _READOUT + (_ROOM,)}
  return host, arrays, {**host, _ROOM: state[_ROOM] - steps}


def step(adapter, base, state, token_B, *, readout: bool = False):
  """Appends `token_B` and returns (state, next-token logits float32 [B, V]); at most
  max_new_tokens - 1 steps follow one prefill. Consumes `state` (its buffers are reused)."""
  static, arrays, host = _split_state(state, 1)
  graphdef, base_state = nnx.split(base)
  arrays, logits_BV = _step(graphdef, base_state, adapter, arrays, jnp.asarray(token_B, jnp.int32),
                            readout=readout, **static)
  return {**arrays, **host}, logits_BV


def decode(adapter, base, state, logits_BV, steps: int, *, readout: bool = False):
  """`steps` greedy steps, each fed the argmax of the logits before it, as one program:
  (state, last logits float32 [B, V], each step's candidate tops int32 [B, steps, C] or None
  without `readout`). Equals `steps` calls of `step`; consumes `state`."""
  static, arrays, host = _split_state(state, steps)
  graphdef, base_state = nnx.split(base)
  arrays, logits_BV, tops_SBC = _decode(graphdef, base_state, adapter, arrays, logits_BV, steps,
                                        readout=readout, **static)
  return {**arrays, **host}, logits_BV, (jnp.moveaxis(tops_SBC, 0, 1) if readout else None)


def generate(adapter, base, memory_BM, prompt_BT, cfg: focus.FocusConfig, max_new_tokens: int,
             *, readout: bool = False):
  """Greedy decoding: int32 [B, T + max_new_tokens]; with `readout`, also prefill's diagnostics
  and "candidate_top_steps" int32 [B, max_new_tokens, C], each chunk's guess at new token s."""
  state, logits_BV = prefill(adapter, base, memory_BM, prompt_BT, cfg, max_new_tokens,
                             readout=readout)
  mass, top_BC = state.get("candidate_mass"), state.get("candidate_top")
  state, logits_BV, tops_BSC = decode(adapter, base, state, logits_BV, max_new_tokens - 1,
                                      readout=readout)
  last_B1 = jnp.argmax(logits_BV, -1)[:, None].astype(jnp.int32)
  tokens_BL = jnp.concatenate([state["tokens"], last_B1], axis=1)
  if not readout:
    return tokens_BL
  return tokens_BL, {"candidate_top": top_BC, "candidate_mass": mass,
                     "candidate_top_steps": jnp.concatenate([top_BC[:, None], tops_BSC], axis=1)}
