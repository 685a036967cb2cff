"""FocusLLM (arXiv 2408.11745) around a frozen focaljax `Transformer`: orchestration, not a variant.

Einsum letters as in model/decoder.py (B batch, T positions, S key positions, E d_model, N query
heads, K kv heads, D head dim, V vocabulary), plus C chunks, Q candidates per chunk (query
points), R rows = B·C chunk sequences (or B·Q local rows), M memory tokens.

The long input is memory (M tokens, split into C chunks of `chunk_size`) + a local window. Every
chunk is run as the sequence [chunk | dynamic prompt], the dynamic prompt being the last
min(prompt_len, chunk_size) local tokens. Every position runs through the frozen base, except the
last prompt token (the candidate), whose own forward is the adapter's (focus/candidates.py,
`FocusConfig.candidate_path`). The local decoder is the frozen base over the local window, with
every chunk's candidate k/v prepended at every layer and visible to every local token. All chunks
run as one batch (rows = B·C). The adapter is a pure dict apart from the base; differentiate
w.r.t. it alone (close over the base params): the frozen stream then keeps no residuals.

Position ids (no RoPE position ever exceeds the base's trained context; never NTK-scaled):
  chunk sequence   chunk tokens 0..s-1, prompt tokens from s; the candidate is the last prompt
                   token (position s+P-1, then +1 per generated token): every chunk is positioned
                   as if it started the document.
  local decoder    candidate c (chunk order) at position c, local tokens at C..C+T-1 (+1 per
                   generated token), as in the official code: the candidates read as an ordinary
                   preceding context. C + T must fit the base's context, which bounds the memory
                   (1K context, 512 local tokens, chunk 512: up to ~260K memory tokens).
  `check_positions` raises (naming the field) unless every position stays below max_seq_len.

Leak-free objective (`target_nll`): the paper's Eq. 6 scores every local token, but the candidates
are condensed with a dynamic prompt that ends at the LAST local token, so the prediction at
position i would see x_{i+1}.. through the candidates. We score the last Q input positions
i_1 < ... < i_Q (query points) and give each its own candidates. The chunk sequence is
[chunk | x_a .. x_{i_Q - 1}] (frozen, causal, one batched pass; a = i_1 - P + 1), and candidate q
is x_{i_q} at its own position, attending to the frozen keys strictly before it and to itself. So
candidate q sees exactly the dynamic prompt x_a..x_{i_q} that generation uses when x_{i_q} is the
newest token. Local row q is the frozen decoder over the local window with candidates_q; its
logits at i_q score the target x_{i_q+1}: every target is predicted as generation would predict
it, nothing at or after it reaches its prediction (tests/focus/test_focus.py checks the gradient
is exactly zero), and one chunk pass serves all Q targets.

Supported bases: softmax and focal (constant temperature) layers, RoPE or no positions, QK-norm.
Dilution layers (their running demand has no candidate analogue) and learned-τ focal layers raise
NotImplementedError. Generation lives in focus/generate.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from focaljax import sharding
from focaljax.focus import attention as focus_attention
from focaljax.focus import candidates as cand_lib
from focaljax.model import decoder as model_lib


@dataclasses.dataclass(frozen=True)
class FocusConfig:
  chunk_size: int                   # memory tokens per chunk (s); memory length must divide by it
  prompt_len: int = 512             # dynamic prompt: the last min(prompt_len, chunk_size) tokens
  implementation: str = "xla"       # candidate/local attention: "xla" | "pallas" (focus/attention.py)
  candidate_path: str = "adapter"   # the candidate's own forward (focus/candidates.py)

  def __post_init__(self):
    if self.chunk_size < 1 or self.prompt_len < 1:
      raise ValueError(f"FocusConfig: chunk_size ({self.chunk_size}) and prompt_len "
                       f"({self.prompt_len}) must be >= 1")
    focus_attention.check(self.implementation)
    if self.candidate_path not in cand_lib.CANDIDATE_PATHS:
      raise ValueError(f"FocusConfig.candidate_path must be one of "
                       f"{sorted(cand_lib.CANDIDATE_PATHS)}; got {self.candidate_path!r}")

  def prompt_tokens(self, available: int) -> int:
    return min(self.prompt_len, self.chunk_size, available)


def check_base(base: model_lib.Transformer) -> None:
  for i, block in enumerate(base.blocks):
    if block.attn.family.demand:
      raise NotImplementedError(f"focus: layer {i} uses dilution attention, whose running demand "
                                "has no candidate-token analogue; use softmax or focal layers")
    if hasattr(block.attn, "w_tau"):
      raise NotImplementedError(f"focus: layer {i} is focal with a learned τ "
                                "(model.attention.learned); only a constant temperature works")


def init_adapter(base: model_lib.Transformer, candidate_path: str = "adapter") -> dict:
  """{layer: {wq, wk, wv, wo}} ({wk, wv} for the "frozen" path): copies (not ties) of the frozen
  projections."""
  check_base(base)
  if candidate_path not in cand_lib.CANDIDATE_PATHS:
    raise ValueError(f"focus.init_adapter: candidate_path must be one of "
                     f"{sorted(cand_lib.CANDIDATE_PATHS)}; got {candidate_path!r}")
  leaves = cand_lib.CANDIDATE_PATHS[candidate_path].adapter_leaves
  return {i: {n: jnp.array(getattr(b.attn, n)[...]) for n in leaves}
          for i, b in enumerate(base.blocks)}


def check_positions(base_cfg: model_lib.ModelConfig, cfg: FocusConfig, local_len: int,
                    prompt_len: int, extra: int = 0, memory_len: int = 0) -> None:
  """Raises unless every RoPE position (module docstring) is < base max_seq_len. `memory_len`
  gives the number of chunks, whose candidates sit before the window."""
  limit = base_cfg.max_seq_len
  chunk_max = cfg.chunk_size + prompt_len - 1 + extra
  if chunk_max >= limit:
    raise ValueError(f"focus: chunk_size ({cfg.chunk_size}) + dynamic prompt ({prompt_len}) + "
                     f"new tokens ({extra}) = {chunk_max + 1} exceeds the base's trained context "
                     f"max_seq_len={limit}; lower chunk_size or prompt_len")
  C = memory_len // cfg.chunk_size
  if C + local_len - 1 + extra >= limit:
    raise ValueError(f"focus: {C} candidates before the local window ({local_len}) + new tokens "
                     f"({extra}): {C + local_len + extra} positions exceed the base's "
                     f"max_seq_len={limit}; use a larger chunk_size, less memory or a shorter "
                     "local window")


def local_logits(base, tokens_BT, cand_kv, theta: float, *, implementation: str = "xla",
                 at_B=None, candidate_mass: bool = False):
  """The frozen decoder over the local window with the C candidates of each row (per layer (k
  before RoPE, v) [B, C, K, D], chunk order) prepended at positions 0..C-1 and visible to every
  token, the local tokens at C..C+T-1. Logits [B, T, V], or with `at_B` (int [B]) only row b's
  position at_B[b]: [B, V] (training and decoding read one position per row; the head matmul over
  every [B·Q, T] row would cost a tenth of a step). `candidate_mass` (with `at_B`) also returns,
  per layer, the attention that position puts on each candidate, head-averaged float32 [L, B, C]."""
  if candidate_mass and at_B is None:
    raise ValueError("focus.local_logits: candidate_mass needs at_B (the positions it reads)")
  B, T = tokens_BT.shape
  C = cand_kv[0][0].shape[1]
  positions_BT = jnp.broadcast_to(C + jnp.arange(T), (B, T))
  cand_BC = jnp.broadcast_to(jnp.arange(C), (B, C))
  x_BTE = base.embed[...][tokens_BT]
  mass = []
  for block, (kc_BCKD, vc_BCKD) in zip(base.blocks, cand_kv):
    attn = block.attn
    q, k, v = attn._project(  # pylint: disable=protected-access
        block.attn_norm(x_BTE), positions_BT, theta)
    kc_BCKD = cand_lib.rope(attn, kc_BCKD.astype(k.dtype), cand_BC, theta)
    if candidate_mass:
      q_BND = jnp.take_along_axis(q, jnp.asarray(at_B)[:, None, None, None], axis=1)[:, 0]
      mass.append(focus_attention.candidate_mass(attn, q_BND, k, kc_BCKD, at_B).mean(axis=1))
    out = focus_attention.local(implementation, attn, q, k, v, kc_BCKD, vc_BCKD)
    x_BTE = x_BTE + jnp.einsum("BTND,NDE->BTE", out, attn.wo[...].astype(out.dtype))
    x_BTE = x_BTE + block.mlp(block.mlp_norm(x_BTE))
  if at_B is not None:
    x_BTE = jnp.take_along_axis(x_BTE, jnp.asarray(at_B)[:, None, None], axis=1)
    logits_BV = base._logits(x_BTE)[:, 0]  # pylint: disable=protected-access
    return (logits_BV, jnp.stack(mass)) if candidate_mass else logits_BV
  return base._logits(x_BTE)  # pylint: disable=protected-access


def chunk_sequences(memory_BM, span_BP, cfg: FocusConfig):
  """[chunk | span] for every chunk: int32 [B·C, s + P] (B-major)."""
  B, M = memory_BM.shape
  if M % cfg.chunk_size:
    raise ValueError(f"focus: memory length {M} is not a multiple of chunk_size "
                     f"{cfg.chunk_size}; drop or pad the oldest tokens")
  C = M // cfg.chunk_size
  chunks_RS = memory_BM.reshape(B * C, cfg.chunk_size)
  return jnp.concatenate([chunks_RS, jnp.repeat(span_BP.astype(chunks_RS.dtype), C, axis=0)], 1)


def condense(adapter, base, memory_BM, span_BP, num_candidates: int, cfg: FocusConfig,
             extra: int = 0):
  """Candidates for the last `num_candidates` tokens of the dynamic prompt span, all chunks in one
  batch. Returns (h [B, C, Q, E], per layer (k, v) [B, C, Q, K, D], caches [B·C rows])."""
  B, M = memory_BM.shape
  if M == 0:
    raise ValueError("focus.condense: the memory is empty; use no_candidates(base, B, Q)")
  Q = num_candidates
  theta = base.cfg.rope_theta   # positions stay inside the trained context: no NTK scaling
  # Rows (B·C chunk sequences) split over every data-like mesh axis, so even one long document
  # (B = 1) spreads its chunks across devices; a no-op without an ambient mesh.
  seq_RN = sharding.constrain(chunk_sequences(memory_BM, span_BP, cfg), ("batch", "seq"))
  R, n = seq_RN.shape
  C = R // B
  cache_len = focus_attention.cache_len(cfg.implementation, n - 1 + extra)
  caches = cand_lib.frozen_prefill(base, seq_RN[:, :-1], cache_len, theta)
  positions_RQ = jnp.broadcast_to(jnp.arange(n - Q, n), (R, Q))
  h_RQE, kv = cand_lib.candidates(adapter, base, caches, seq_RN[:, n - Q:], positions_RQ, theta,
                                  implementation=cfg.implementation, path=cfg.candidate_path)
  split = lambda x: x.reshape(B, C, *x.shape[1:])
  return split(h_RQE), [(split(k), split(v)) for k, v in kv], caches


def no_candidates(base, B: int, Q: int):
  """Zero-chunk candidate k/v per layer, [B, 0, Q, K, D] (no memory: the plain base)."""
  c = base.cfg
  z = jnp.zeros((B, 0, Q, c.num_kv_heads, c.head_dim), jnp.float32)
  return [(z, z) for _ in base.blocks]


def logits(adapter, base, memory_BM, local_BT, cfg: FocusConfig):
  """Inference forward: float32 [B, T, V]. Only the last position is a FocusLLM prediction (the
  candidates were condensed with a prompt ending at the last token; earlier positions see it)."""
  B, T = local_BT.shape
  P = cfg.prompt_tokens(T)
  check_positions(base.cfg, cfg, T, P, memory_len=memory_BM.shape[1])
  if memory_BM.shape[1] == 0:
    kv = no_candidates(base, B, 1)
  else:
    _, kv, _ = condense(adapter, base, memory_BM, local_BT[:, T - P:], 1, cfg)
  return local_logits(base, local_BT, [(k[:, :, 0], v[:, :, 0]) for k, v in kv],
                      base.cfg.rope_theta, implementation=cfg.implementation)


def target_nll(adapter, base, memory_BM, tokens_BT, cfg: FocusConfig, num_targets: int):
  """Leak-free per-target NLL, float32 [B, Q]: the last Q tokens of `tokens_BT` are the targets,
  each predicted from its own candidates (module docstring)."""
  B, T1 = tokens_BT.shape
  T, Q = T1 - 1, num_targets
  if not 1 <= Q <= T:
    raise ValueError(f"focus: num_targets ({Q}) must be in [1, {T}] (local tokens - 1)")
  inputs_BT = tokens_BT[:, :-1]
  first = T - Q                                   # index of the first query point
  P = cfg.prompt_tokens(first + 1)
  check_positions(base.cfg, cfg, first + 1, P, extra=Q - 1, memory_len=memory_BM.shape[1])
  if memory_BM.shape[1] == 0:
    kv = no_candidates(base, B, Q)
  else:
    _, kv, _ = condense(adapter, base, memory_BM, inputs_BT[:, first - P + 1:], Q, cfg)
  C = kv[0][0].shape[1]
  # Row (b, q) carries candidates_q of every chunk; B-major like the repeated local tokens.
  rows = lambda x: x.transpose(0, 2, 1, 3, 4).reshape(B * Q, C, *x.shape[3:])
  # Row (b, q) is read only at its own query point first + q.
  at_RV = local_logits(base, jnp.repeat(inputs_BT, Q, axis=0),
                       [(rows(k), rows(v)) for k, v in kv], base.cfg.rope_theta,
                       implementation=cfg.implementation,
                       at_B=jnp.tile(first + jnp.arange(Q), B)).reshape(B, Q, -1)
  target_BQ = tokens_BT[:, first + 1:]
  picked = jnp.take_along_axis(at_RV, target_BQ[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(at_RV, axis=-1) - picked


def loss(adapter, base, memory_BM, tokens_BT, cfg: FocusConfig, num_targets: int):
  """Mean leak-free NLL over B·Q targets (float32 scalar)."""
  return target_nll(adapter, base, memory_BM, tokens_BT, cfg, num_targets).mean()
