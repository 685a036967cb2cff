"""FocusLLM's chunk side: the frozen stream over every chunk sequence and the candidates.

Einsum letters as in focus/model.py (R rows = chunk sequences, Q candidates per row, S cached
positions). `frozen_prefill` / `frozen_step` build and extend each chunk's frozen K/V cache through
the base's own blocks; `candidates` runs the candidate tokens (the dynamic prompt's last ones) over
those caches. Whose projections the candidate's own forward uses, and which the adapter holds, is
`FocusConfig.candidate_path` (CANDIDATE_PATHS below); the k/v it hands the local decoder are always
the adapter's.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from focaljax.model import attention as attn_lib
from focaljax.focus import attention as focus_attention
from focaljax.model import decoder as model_lib

_PROJ = ("wq", "wk", "wv", "wo")


@dataclasses.dataclass(frozen=True)
class CandidatePath:
  adapter_leaves: tuple[str, ...]   # the adapter's projections per layer (init_adapter)
  own_from_adapter: bool            # the candidate's own forward (q/k/v/o) uses them, not the base's


# FocusConfig.candidate_path. "adapter" (the paper's): the candidate's own forward runs on the
# adapter's q/k/v/o. "frozen": it is the base's, and the adapter's wk/wv only map it, per layer,
# to the k/v the local decoder sees; the same function at copy-init. Over small bases the frozen
# path leaves the answer prior reliably: the untrained candidate already reads the needle, and
# training the candidate's own projections can unlearn that (docs/focusllm.md).
CANDIDATE_PATHS = {"adapter": CandidatePath(_PROJ, True),
                   "frozen": CandidatePath(("wk", "wv"), False)}


def rope(attn, x_RTKD, positions_RT, theta):
  if attn.spec.position is attn_lib.Position.ROPE:
    return model_lib.apply_rope(x_RTKD, positions_RT, theta)
  return x_RTKD


def _candidate_kv(attn, w, x_RQE):
  """k (QK-normed, before RoPE) and v of x through w's wk/wv."""
  dt = x_RQE.dtype
  k = jnp.einsum("RQE,EKD->RQKD", x_RQE, w["wk"].astype(dt))
  v = jnp.einsum("RQE,EKD->RQKD", x_RQE, w["wv"].astype(dt))
  return (attn.k_norm(k) if attn.cfg.qk_norm else k), v


def _candidate_project(attn, w, x_RQE, positions_RQ, theta):
  """Attention._project with w's wq/wk/wv (frozen QK-norm); k also before RoPE."""
  q = jnp.einsum("RQE,END->RQND", x_RQE, w["wq"].astype(x_RQE.dtype))
  if attn.cfg.qk_norm:
    q = attn.q_norm(q)
  k, v = _candidate_kv(attn, w, x_RQE)
  return rope(attn, q, positions_RQ, theta), rope(attn, k, positions_RQ, theta), k, v


def _extend(base, caches, tokens_RT, position, theta: float):
  """The caches with tokens_RT run through the frozen blocks from `position` on."""
  x_RTE = base.embed[...][tokens_RT]
  new = []
  for block, cache in zip(base.blocks, caches):
    x_RTE, cache = block.cached(x_RTE, cache, position, theta)
    new.append(cache)
  return new


def frozen_prefill(base, tokens_RT, max_len: int, theta: float):
  """Frozen K/V caches of the chunk sequences (positions 0..T-1) with room for `max_len`."""
  # Caches in the activations' (the embedding's) dtype: fused attention (cuDNN, the kernels)
  # wants q, k, v alike.
  caches = base.init_cache(tokens_RT.shape[0], max_len, base.embed[...].dtype)
  return _extend(base, caches, tokens_RT, 0, theta)


def frozen_step(base, caches, token_R, position: int, theta: float):
  """Appends one token (frozen path) at `position` to every chunk cache."""
  return _extend(base, caches, token_R[:, None], position, theta)


def candidates(adapter, base, caches, tokens_RQ, positions_RQ, theta: float, *,
               implementation: str = "xla", path: str = "adapter"):
  """Q candidates per chunk row, each at its position: it sees the cached frozen keys strictly
  before it and itself (never the other candidates). Returns (h [R, Q, E], per layer
  (k before RoPE, v) [R, Q, K, D]) -- k is re-rotated in the local decoder. `path`
  (FocusConfig.candidate_path) picks whose q/k/v/o the candidate's own forward uses; the k/v
  returned are always the adapter's."""
  own_from_adapter = CANDIDATE_PATHS[path].own_from_adapter
  x_RQE = base.embed[...][tokens_RQ]
  kv = []
  for i, (block, cache) in enumerate(zip(base.blocks, caches)):
    attn, w = block.attn, adapter[i]
    own = w if own_from_adapter else {n: getattr(attn, n)[...] for n in _PROJ}
    xn_RQE = block.attn_norm(x_RQE)
    q, k, k_pre, v = _candidate_project(attn, own, xn_RQE, positions_RQ, theta)
    out = focus_attention.candidates(implementation, attn, q, cache["k"], cache["v"], k, v,
                                     positions_RQ)
    x_RQE = x_RQE + jnp.einsum("RQND,NDE->RQE", out, own["wo"].astype(out.dtype))
    x_RQE = x_RQE + block.mlp(block.mlp_norm(x_RQE))
    kv.append((k_pre, v) if own_from_adapter else _candidate_kv(attn, w, xn_RQE))
  return x_RQE, kv
