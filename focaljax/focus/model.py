"""FocusLLM (arXiv 2408.11745) around a frozen focaljax `Transformer`: orchestration, not a variant.

Einsum letters as in model.py (B batch, T positions, S key positions, E d_model, N query heads,
K kv heads, D head dim, V vocabulary, G query heads per kv head), plus C chunks, Q candidates per
chunk (query points), R rows = B·C chunk sequences (or B·Q local rows), M memory tokens.

The long input is memory (M tokens, split into C chunks of `chunk_size`) + a local window. Every
chunk is run as the sequence [chunk | sep? | dynamic prompt], the dynamic prompt being the last
min(prompt_len, chunk_size) local tokens. Every position runs through the frozen base, except the
last prompt token (the candidate), which uses the adapter's own q/k/v/o (initialised as copies, so
at init the candidate IS the base's hidden state there) with the frozen norms and MLP; with
`candidate_path="frozen"` it runs the base's too, and the adapter only maps it to k/v. The local
decoder is the frozen base over the local window, with every chunk's candidate k/v prepended at
every layer and visible to every local token. All chunks run as one batch (rows = B·C).

Trainability is data: `params = {"base": ..., "adapter": ...}` and `trainable_mask(params)` is
True on adapter leaves only; `optim.make(cfg, params, trainable=mask)` gives the base exactly zero
updates. The model has no `if frozen` branch.

Position ids (no RoPE position ever exceeds the base's trained context; never NTK-scaled):
  chunk sequence   chunk tokens 0..s-1, the optional separator s, prompt tokens from s(+1); the
                   candidate is the last prompt token (position s+sep+P-1, then +1 per generated
                   token), i.e. every chunk is positioned as if it started the document.
  local decoder    `FocusConfig.candidate_positions` picks the layout:
    "sequential"   (default) the official code's: candidate c (chunk order) at position c, local
                   tokens at C..C+T-1 (+1 per generated token): the candidates read as an ordinary
                   preceding context, but C + T must fit the base's context, which bounds the
                   memory (1K context, 512 local tokens, chunk 512: up to ~260K memory tokens).
    "shared"       local tokens 0..T-1 (+1 per generated token); every candidate key is rotated
                   at CANDIDATE_POSITION (0): all memory sits "at the start" with one phase, and
                   positions do not grow with C. Kept for A/B: on the H200 (tenth session) a
                   97.5M base's adapter learned to read the memory with "sequential" within ~1000
                   steps (drill answer NLL 11.9 -> 1.0), and with "shared" not in 1600 (needle in
                   memory 0/10 at 2x-100x), plausibly because position 0 is where a trained base
                   keeps its attention sink.
  `check_positions` raises (naming the field) unless max(s + sep + P - 1, [C +] T - 1) + generated
  tokens stays below the base's `max_seq_len`.

Leak-free objective (`target_nll`, `loss`): the paper's Eq. 6 scores every local token, but the
candidates are condensed with a dynamic prompt that ends at the LAST local token, so the
prediction at position i would see x_{i+1}.. through the candidates. We score the last Q input
positions i_1 < ... < i_Q (query points) and give each its own candidates. The chunk sequence is
[chunk | sep? | x_a .. x_{i_Q - 1}] (frozen, causal, one batched pass; a = i_1 - P + 1), and
candidate q is x_{i_q} through the adapter at its own position, attending to the frozen keys
strictly before it and to itself. So candidate q sees exactly the dynamic prompt x_a..x_{i_q}
that generation uses at the step where x_{i_q} is the newest token (the prompt grows by one token
per step). Local row q is the frozen decoder over the local window with candidates_q visible to
all its tokens; its logits at i_q score the target x_{i_q+1}. Every target is predicted exactly
as generation would predict it (teacher forced), nothing at or after the target reaches its
prediction (tests/focus/test_focus.py checks the gradient is exactly zero), and one chunk pass serves
all Q targets; the local decoder costs Q rows.

Supported bases: softmax and focal (constant temperature) layers, RoPE or no positions, QK-norm.
Dilution layers (their running demand has no candidate analogue) and learned-τ focal layers (the
τ prefix mean over a sequence the candidate is not part of) raise NotImplementedError.
Generation lives in focus_generate.py.

Cost notes: the frozen chunk prefill goes through the base's fused attention (`Block.cached`);
candidate and local-decoder attention (explicit prefix/per-query visibility) go through
focus_attention.py, switched by `FocusConfig.implementation`: "xla" (einsums materialising
[rows, heads, T, S] float32 probabilities) or "pallas" (pallas_kernels/condense/api.py: split-K over
every chunk cache in one launch, and a flash local attention with its backward). Differentiate
w.r.t. the adapter only (close over the base params): the frozen stream then keeps no residuals
(and the kernels skip the cache's dk/dv).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from focaljax.focus import attention as focus_attention
from focaljax.model import decoder as model_lib
from focaljax import sharding
# The chunk side lives in focus_candidates; its names stay importable from here.
from focaljax.focus.candidates import (CANDIDATE_PATHS, CandidatePath,  # noqa: F401
                                       _rope, candidates, frozen_prefill, frozen_step)

CANDIDATE_POSITION = 0   # the RoPE position of every candidate key in the "shared" layout
CANDIDATE_POSITIONS = ("shared", "sequential")   # FocusConfig.candidate_positions (module doc)
# FocusConfig.candidate_bias: the logit bias of every candidate in the local decoder, by the number
# of candidates C. "none" is the paper's. "log_count" (-log C) makes C identical candidates weigh
# as one key, so their total weight does not grow with the memory's length (FOCUSLLM.md,
# fourteenth session: failed adapters' answers broke down as C grew).
CANDIDATE_BIASES = {"none": lambda C: 0.0, "log_count": lambda C: -math.log(C) if C > 1 else 0.0}
# FocusConfig.sink: "first_token" prepends the memory's first token, as the frozen base cached it
# in chunk 0 (position 0, no context), to the local decoder's candidates, as a BOS-like attention
# sink (the official local decoder starts with BOS). "none" is the paper's. Untrained and trained
# adapters put no attention on it (FOCUSLLM.md, sixteenth session).
SINKS = ("none", "first_token")


@dataclasses.dataclass(frozen=True)
class FocusConfig:
  chunk_size: int                   # memory tokens per chunk (s); memory length must divide by it
  prompt_len: int = 512             # dynamic prompt: the last min(prompt_len, chunk_size) tokens
  sep_id: int | None = None         # token between chunk and prompt (the official code: BOS)
  implementation: str = "xla"       # candidate/local attention: "xla" | "pallas" (focus_attention)
  candidate_positions: str = "sequential"   # local-decoder layout: "sequential" | "shared" (module doc)
  candidate_bias: str = "none"      # candidates' logit bias in the local decoder (CANDIDATE_BIASES)
  sink: str = "none"                # an attention sink before the candidates (SINKS)
  candidate_path: str = "adapter"   # the candidate's own forward: adapter or frozen (CANDIDATE_PATHS)

  def __post_init__(self):
    if self.chunk_size < 1 or self.prompt_len < 1:
      raise ValueError(f"FocusConfig: chunk_size ({self.chunk_size}) and prompt_len "
                       f"({self.prompt_len}) must be >= 1")
    focus_attention.check(self.implementation)
    if self.candidate_positions not in CANDIDATE_POSITIONS:
      raise ValueError(f"FocusConfig.candidate_positions must be one of {CANDIDATE_POSITIONS}; "
                       f"got {self.candidate_positions!r}")
    if self.candidate_bias not in CANDIDATE_BIASES:
      raise ValueError(f"FocusConfig.candidate_bias must be one of {sorted(CANDIDATE_BIASES)}; "
                       f"got {self.candidate_bias!r}")
    if self.sink not in SINKS:
      raise ValueError(f"FocusConfig.sink must be one of {SINKS}; got {self.sink!r}")
    if self.candidate_path not in CANDIDATE_PATHS:
      raise ValueError(f"FocusConfig.candidate_path must be one of {sorted(CANDIDATE_PATHS)}; got "
                       f"{self.candidate_path!r}")
    if self.sink != "none" and self.candidate_bias != "none":
      # The kernels bias every key of the candidate block, and the sink rides in it.
      raise ValueError(f"FocusConfig.sink={self.sink!r} needs candidate_bias='none'; got "
                       f"{self.candidate_bias!r}")

  @property
  def sequential_positions(self) -> bool:
    return self.candidate_positions == "sequential"

  def prompt_tokens(self, available: int) -> int:
    return min(self.prompt_len, self.chunk_size, available)

  @property
  def prefix(self) -> int:
    """Position of the first prompt token in a chunk sequence."""
    return self.chunk_size + (self.sep_id is not None)


# ------------------------------------------------------------------------- adapter and masks


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
  if candidate_path not in CANDIDATE_PATHS:
    raise ValueError(f"focus.init_adapter: candidate_path must be one of "
                     f"{sorted(CANDIDATE_PATHS)}; got {candidate_path!r}")
  leaves = CANDIDATE_PATHS[candidate_path].adapter_leaves
  return {i: {n: jnp.array(getattr(b.attn, n)[...]) for n in leaves}
          for i, b in enumerate(base.blocks)}


def trainable_mask(params: dict):
  """params = {"base": ..., "adapter": ...} -> the same tree of bools, True on the adapter."""
  return {"base": jax.tree.map(lambda _: False, params["base"]),
          "adapter": jax.tree.map(lambda _: True, params["adapter"])}


def check_positions(base_cfg: model_lib.ModelConfig, cfg: FocusConfig, local_len: int,
                    prompt_len: int, extra: int = 0, memory_len: int = 0) -> None:
  """Raises unless every RoPE position (see the module docstring) is < base max_seq_len.
  `memory_len` gives the number of chunks, which the "sequential" layout puts before the window."""
  limit = base_cfg.max_seq_len
  chunk_max = cfg.prefix + prompt_len - 1 + extra
  if chunk_max >= limit:
    raise ValueError(f"focus: chunk_size ({cfg.chunk_size}) + separator + dynamic prompt "
                     f"({prompt_len}) + new tokens ({extra}) = {chunk_max + 1} exceeds the base's "
                     f"trained context max_seq_len={limit}; lower chunk_size or prompt_len")
  C = (memory_len // cfg.chunk_size + (cfg.sink != "none" and memory_len > 0)
       if cfg.sequential_positions else 0)
  if C and C + local_len - 1 + extra >= limit:
    raise ValueError(f"focus: candidate_positions='sequential' puts {C} candidates before the "
                     f"local window ({local_len}) + new tokens ({extra}): {C + local_len + extra} "
                     f"positions exceed the base's max_seq_len={limit} (the official layout's "
                     f"memory limit); use a larger chunk_size, less memory or 'shared'")
  if local_len - 1 + extra >= limit:
    raise ValueError(f"focus: the local window ({local_len}) + new tokens ({extra}) exceeds the "
                     f"base's trained context max_seq_len={limit}; move tokens into memory")


# ------------------------------------------------------------------------ the local decoder


def local_logits(base, tokens_BT, cand_kv, theta: float, *, implementation: str = "xla",
                 sequential_positions: bool = False, at_B=None, candidate_mass: bool = False,
                 candidate_bias: str = "none"):
  """The frozen decoder over the local window with the C candidates of each row (per layer (k
  before RoPE, v) [B, C, K, D], chunk order) prepended and visible to every token. Positions: local
  tokens 0..T-1, candidates at CANDIDATE_POSITION; with `sequential_positions`, candidates 0..C-1
  and local tokens C..C+T-1 (FocusConfig.candidate_positions, module docstring).
  Logits [B, T, V], or with `at_B` (int [B]) only row b's position at_B[b]: [B, V]. Training and
  decoding read one position per row, and the [B·Q, T, V] head matmul would cost ~10% of a step.
  `candidate_mass` (with `at_B`) also returns, per layer, the attention that position puts on each
  candidate, head-averaged float32 [L, B, C]: a diagnostic of how the memory is read.
  `candidate_bias` names the candidates' logit bias (CANDIDATE_BIASES, by C)."""
  if candidate_mass and at_B is None:
    raise ValueError("focus.local_logits: candidate_mass needs at_B (the positions it reads)")
  B, T = tokens_BT.shape
  C = cand_kv[0][0].shape[1]
  bias = CANDIDATE_BIASES[candidate_bias](C)
  if sequential_positions:
    cand_C, local_T = jnp.arange(C), C + jnp.arange(T)
  else:
    cand_C, local_T = jnp.full((C,), CANDIDATE_POSITION), jnp.arange(T)
  positions_BT = jnp.broadcast_to(local_T, (B, T))
  cand_BC = jnp.broadcast_to(cand_C, (B, C))
  x_BTE = base.embed[...][tokens_BT]
  mass = []
  for block, (kc_BCKD, vc_BCKD) in zip(base.blocks, cand_kv):
    attn = block.attn
    q, k, v = attn._project(  # pylint: disable=protected-access
        block.attn_norm(x_BTE), positions_BT, theta)
    kc_BCKD = _rope(attn, kc_BCKD.astype(k.dtype), cand_BC, theta)
    if candidate_mass:
      q_BND = jnp.take_along_axis(q, jnp.asarray(at_B)[:, None, None, None], axis=1)[:, 0]
      mass.append(focus_attention.candidate_mass(attn, q_BND, k, kc_BCKD, at_B, bias).mean(axis=1))
    out = focus_attention.local(implementation, attn, q, k, v, kc_BCKD, vc_BCKD, bias)
    x_BTE = x_BTE + jnp.einsum("BTND,NDE->BTE", out, attn.wo[...].astype(out.dtype))
    x_BTE = x_BTE + block.mlp(block.mlp_norm(x_BTE))
  if at_B is not None:
    x_BTE = jnp.take_along_axis(x_BTE, jnp.asarray(at_B)[:, None, None], axis=1)
    logits_BV = base._logits(x_BTE)[:, 0]  # pylint: disable=protected-access
    return (logits_BV, jnp.stack(mass)) if candidate_mass else logits_BV
  return base._logits(x_BTE)  # pylint: disable=protected-access


# --------------------------------------------------------------------------- orchestration


def chunk_rows(memory_BM, cfg: FocusConfig):
  """[B, M] -> [B·C, s] chunk rows (B-major)."""
  B, M = memory_BM.shape
  if M % cfg.chunk_size:
    raise ValueError(f"focus: memory length {M} is not a multiple of chunk_size "
                     f"{cfg.chunk_size}; drop or pad the oldest tokens")
  return memory_BM.reshape(B * (M // cfg.chunk_size), cfg.chunk_size)


def chunk_sequences(memory_BM, span_BP, cfg: FocusConfig):
  """[chunk | sep? | span] for every chunk: int32 [B·C, s + sep + P]."""
  chunks_RS = chunk_rows(memory_BM, cfg)
  C = chunks_RS.shape[0] // memory_BM.shape[0]
  parts = [chunks_RS]
  if cfg.sep_id is not None:
    parts.append(jnp.full((chunks_RS.shape[0], 1), cfg.sep_id, chunks_RS.dtype))
  parts.append(jnp.repeat(span_BP.astype(chunks_RS.dtype), C, axis=0))
  return jnp.concatenate(parts, axis=1)


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
  caches = frozen_prefill(base, seq_RN[:, :-1], cache_len, theta)
  positions_RQ = jnp.broadcast_to(jnp.arange(n - Q, n), (R, Q))
  h_RQE, kv = candidates(adapter, base, caches, seq_RN[:, n - Q:], positions_RQ, theta,
                         implementation=cfg.implementation, path=cfg.candidate_path)
  split = lambda x: x.reshape(B, C, *x.shape[1:])
  return split(h_RQE), [(split(k), split(v)) for k, v in kv], caches


def with_sink(kv, caches, sink: str):
  """Per layer (k, v) [B, C, *rest, K, D] with, for sink == "first_token" (FocusConfig.sink), the
  memory's first token prepended as candidate 0: its frozen k/v from chunk 0's cache, broadcast
  over `rest` (e.g. the Q candidates per chunk). Cached at position 0, its key is also the
  unrotated one the local decoder re-rotates (RoPE at 0 is the identity)."""
  if sink == "none" or caches is None:
    return kv
  B = kv[0][0].shape[0]
  C = caches[0]["k"].shape[0] // B

  def cat(x, first_BKD):
    first = first_BKD.astype(x.dtype).reshape((B, 1) + (1,) * (x.ndim - 4) + x.shape[-2:])
    return jnp.concatenate([jnp.broadcast_to(first, (B, 1) + x.shape[2:]), x], axis=1)
  return [(cat(k, c["k"][::C, 0]), cat(v, c["v"][::C, 0])) for (k, v), c in zip(kv, caches)]


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
    _, kv, caches = condense(adapter, base, memory_BM, local_BT[:, T - P:], 1, cfg)
    kv = with_sink(kv, caches, cfg.sink)
  return local_logits(base, local_BT, [(k[:, :, 0], v[:, :, 0]) for k, v in kv],
                      base.cfg.rope_theta, implementation=cfg.implementation,
                      sequential_positions=cfg.sequential_positions,
                      candidate_bias=cfg.candidate_bias)


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
    _, kv, caches = condense(adapter, base, memory_BM, inputs_BT[:, first - P + 1:], Q, cfg)
    kv = with_sink(kv, caches, cfg.sink)
  C = kv[0][0].shape[1]
  # Row (b, q) carries candidates_q of every chunk; B-major like the repeated local tokens.
  rows = lambda x: x.transpose(0, 2, 1, 3, 4).reshape(B * Q, C, *x.shape[3:])
  # Row (b, q) is read only at its own query point first + q.
  at_RV = local_logits(base, jnp.repeat(inputs_BT, Q, axis=0),
                       [(rows(k), rows(v)) for k, v in kv], base.cfg.rope_theta,
                       implementation=cfg.implementation,
                       sequential_positions=cfg.sequential_positions,
                       candidate_bias=cfg.candidate_bias,
                       at_B=jnp.tile(first + jnp.arange(Q), B)).reshape(B, Q, -1)
  target_BQ = tokens_BT[:, first + 1:]
  picked = jnp.take_along_axis(at_RV, target_BQ[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(at_RV, axis=-1) - picked


def loss(adapter, base, memory_BM, tokens_BT, cfg: FocusConfig, num_targets: int):
  """Mean leak-free NLL over B·Q targets (float32 scalar)."""
  return target_nll(adapter, base, memory_BM, tokens_BT, cfg, num_targets).mean()
