"""FocusLLM's two explicit-visibility attentions and their implementation table.

`FocusConfig.implementation` is the one switch, looked up here and nowhere else:
  "xla"     the pure-JAX references of pallas_kernels.condense.api (the spec): einsums that
            materialise [rows, heads, T, S] float32 probabilities.
  "pallas"  pallas_kernels.condense.api: split-K candidate attention and a flash local decoder
            attention with its backward (Triton lowering); compiled on GPU, Pallas interpret
            mode on CPU (slow, for tests); on TPU it raises (no Mosaic-TPU port).
Both compute the same function (tests/kernels/condense/test_condense.py). Letters as in
focus/model.py.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from focaljax import dispatch
from focaljax import sharding
from pallas_kernels.condense import api as condense


def _interpret() -> bool:
  return dispatch.choose("condense", "pallas").interpret


def _candidate_xla(q, k, v, visible_len, self_k, self_v, *, scale):
  return condense.candidate_attention_reference(q, k, v, visible_len, self_k, self_v, scale=scale)


def _rows_local(kernel):
  """`kernel` on each device's rows under a mesh (sharding.per_device); every operand and output
  is row-major [R, ...]."""
  @functools.wraps(kernel)
  def wrapped(*args, **static):
    rows = ("batch",)
    return sharding.per_device(functools.partial(kernel, **static), (rows,) * len(args),
                               rows)(*args)
  return wrapped


@_rows_local
def _candidate_pallas(q, k, v, visible_len, self_k, self_v, *, scale):
  return condense.candidate_attention(q, k, v, visible_len, self_k, self_v, scale=scale,
                                      interpret=_interpret())


def _local_xla(q, k, v, cand_k, cand_v, *, scale):
  return condense.local_attention_reference(q, k, v, cand_k, cand_v, scale=scale)


@_rows_local
def _local_pallas(q, k, v, cand_k, cand_v, *, scale):
  return condense.local_attention(q, k, v, cand_k, cand_v, scale=scale, interpret=_interpret())


@dataclasses.dataclass(frozen=True)
class _Impl:
  candidate: Callable
  local: Callable
  cache_multiple: int   # chunk caches are allocated in multiples of this (kernel tiles)


IMPLEMENTATIONS = {
    "xla": _Impl(_candidate_xla, _local_xla, 1),
    # Multiples of 16: the kernel would otherwise pad (copy) the cache at every call.
    "pallas": _Impl(_candidate_pallas, _local_pallas, 16),
}


def check(implementation: str) -> None:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"FocusConfig.implementation must be one of {sorted(IMPLEMENTATIONS)}; got "
                     f"{implementation!r}")


def _scale(attn) -> float:
  # check_base admits constant-temperature layers only, so this is a Python float.
  return float(attn.family.scale(attn.cfg.attention, attn.cfg.head_dim, None))


def cache_len(implementation: str, length: int) -> int:
  m = IMPLEMENTATIONS[implementation].cache_multiple
  return -(-length // m) * m


def candidates(implementation: str, attn, q_RQND, cache_k_RSKD, cache_v_RSKD, k_RQKD, v_RQKD,
               positions_RQ):
  """Candidate q sees the cached keys at positions < positions_RQ[r, q] and its own k/v."""
  return IMPLEMENTATIONS[implementation].candidate(
      q_RQND, cache_k_RSKD.astype(k_RQKD.dtype), cache_v_RSKD.astype(v_RQKD.dtype),
      positions_RQ, k_RQKD, v_RQKD, scale=_scale(attn))


def local(implementation: str, attn, q_RTND, k_RTKD, v_RTKD, cand_k_RCKD, cand_v_RCKD):
  """Local token t sees every candidate and the local tokens s <= t."""
  return IMPLEMENTATIONS[implementation].local(
      q_RTND, k_RTKD, v_RTKD, cand_k_RCKD.astype(k_RTKD.dtype), cand_v_RCKD.astype(v_RTKD.dtype),
      scale=_scale(attn))


def candidate_mass(attn, q_RND, k_RTKD, cand_k_RCKD, at_R):
  """float32 [R, N, C]: the local query at position at_R's attention on each candidate (XLA under
  either implementation: a diagnostic of one position per row)."""
  return condense.candidate_mass_reference(q_RND, k_RTKD, cand_k_RCKD, at_R, scale=_scale(attn))
