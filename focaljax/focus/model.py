"""FocusLLM (arXiv 2408.11745) around a frozen focaljax `Transformer`: orchestration, not a variant.

Letters as in model/decoder.py, plus C chunks, Q candidates per chunk, R rows (B·C chunk sequences
or B·Q local rows), M memory tokens. Each memory chunk runs through the frozen base as [chunk |
dynamic prompt] (the window's last min(prompt_len, chunk_size) tokens), the prompt's last token
(the candidate) through the adapter. The local decoder is the frozen base over the window with
every chunk's candidate k/v prepended at every layer, candidate c at position c and the window at
C..C+T-1 (the official layout; never NTK-scaled). The adapter is a dict apart from the base.

Leak-free objective (`target_nll`): the dynamic prompt ends at the last local token, so scoring
every position (the paper) lets position i see x_{i+1}. We score the last Q positions, each with
its own candidates: candidate q is x_{i_q} at its own position over [chunk | x_a .. x_{i_Q - 1}],
seeing the frozen keys before it, exactly what generation sees when x_{i_q} is newest.

`implementation` ("auto" | "xla" | "pallas") goes through dispatch.choose("condense"): "xla" runs
the einsum references of pallas_kernels.condense (the spec), "pallas" its kernels, per device
under a mesh. Bases: softmax and constant-temperature focal layers, RoPE or none, QK-norm.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from focaljax import dispatch
from focaljax import sharding
from focaljax.model import attention as attn_lib
from focaljax.model import decoder as model_lib
from pallas_kernels.condense import api as kernels

IMPLEMENTATIONS = ("auto", "xla", "pallas")
_PROJ = ("wq", "wk", "wv", "wo")


# The adapter's projections per layer. "adapter" (the paper's): the candidate's own forward runs on
# them. "frozen": it is the base's, and the adapter's wk/wv only map it to the k/v the local decoder
# sees. Over small bases training the candidate's own projections can unlearn its reading.
CANDIDATE_PATHS = {"adapter": _PROJ, "frozen": ("wk", "wv")}


def cache_len(implementation: str, length: int) -> int:
  # Multiples of 16 for the kernels: they would otherwise pad (copy) the cache at every call.
  m = 16 if dispatch.choose("condense", implementation).implementation == "pallas" else 1
  return -(-length // m) * m


def scale(attn) -> float:
  # check_base admits constant-temperature layers only, so this is a Python float.
  return float(attn.family.scale(attn.cfg.attention, attn.cfg.head_dim, None))


def _attend(kernel, reference, implementation, attn, *args):
  choice = dispatch.choose("condense", implementation)
  if choice.implementation == "xla":
    return reference(*args, scale=scale(attn))
  rows = ("batch",)   # every operand and output is [R, ...]: each device takes its rows
  fn = functools.partial(kernel, scale=scale(attn), interpret=choice.interpret)
  return sharding.per_device(fn, (rows,) * len(args), rows)(*args)


def rope(attn, x_RTKD, positions_RT, theta):
  if attn.spec.position is attn_lib.Position.ROPE:
    return model_lib.apply_rope(x_RTKD, positions_RT, theta, attn.cfg.rope_scaling)
  return x_RTKD


def _candidate_kv(attn, w, x_RQE):
  """k (QK-normed, before RoPE) and v of x through w's wk/wv."""
  dt = x_RQE.dtype
  k = jnp.einsum("RQE,EKD->RQKD", x_RQE, w["wk"].astype(dt))
  v = jnp.einsum("RQE,EKD->RQKD", x_RQE, w["wv"].astype(dt))
  return (attn.k_norm(k) if attn.cfg.qk_norm else k), v


def frozen_step(base, caches, tokens_RT, position, theta: float):
  """The chunk caches with tokens_RT run through the frozen blocks from `position` on."""
  x_RTE, new = base.embed[...][tokens_RT], []
  for block, cache in zip(base.blocks, caches):
    x_RTE, cache = block.cached(x_RTE, cache, position, theta)
    new.append(cache)
  return new


def frozen_prefill(base, tokens_RT, max_len: int, theta: float):
  """Frozen K/V caches of the chunk sequences with room for `max_len`, in the activations' dtype."""
  caches = base.init_cache(tokens_RT.shape[0], max_len, base.embed[...].dtype)
  return frozen_step(base, caches, tokens_RT, 0, theta)


def candidates(adapter, base, caches, tokens_RQ, positions_RQ, theta: float, *,
               implementation: str = "auto", path: str = "adapter"):
  """Q candidates per chunk row, each seeing the cached frozen keys before it and itself: (h [R, Q,
  E], per layer the adapter's (k before RoPE, v) [R, Q, K, D]). `path`: whose q/k/v/o it runs."""
  own_from_adapter = path == "adapter"
  x_RQE = base.embed[...][tokens_RQ]
  kv = []
  for i, (block, cache) in enumerate(zip(base.blocks, caches)):
    attn, w = block.attn, adapter[i]
    own = w if own_from_adapter else {n: getattr(attn, n)[...] for n in _PROJ}
    xn_RQE = block.attn_norm(x_RQE)
    q = jnp.einsum("RQE,END->RQND", xn_RQE, own["wq"].astype(xn_RQE.dtype))
    q = attn.q_norm(q) if attn.cfg.qk_norm else q
    k_pre, v = _candidate_kv(attn, own, xn_RQE)
    # Candidate q sees the cached keys at positions < positions_RQ[r, q] and its own k/v.
    out = _attend(kernels.candidate_attention, kernels.candidate_attention_reference,
                  implementation, attn, rope(attn, q, positions_RQ, theta),
                  cache["k"].astype(k_pre.dtype), cache["v"].astype(v.dtype), positions_RQ,
                  rope(attn, k_pre, positions_RQ, theta), v)
    x_RQE = x_RQE + jnp.einsum("RQND,NDE->RQE", out, own["wo"].astype(out.dtype))
    x_RQE = x_RQE + block.mlp(block.mlp_norm(x_RQE))
    kv.append((k_pre, v) if own_from_adapter else _candidate_kv(attn, w, xn_RQE))
  return x_RQE, kv


def decode_step(adapter, base, caches, prev_R, token_R, position, theta: float, *,
                implementation: str = "auto", path: str = "adapter"):
  """frozen_step of prev_R at `position`, then candidates of token_R at position + 1, in one pass
  per layer: both queries share one read of the layer's cache (the frozen token sees the keys
  before `position` and itself as the kernel's self key; the candidate sees the keys up to
  `position`, now holding the frozen token's, and itself), and share the norm and MLP matmuls.
  Returns (caches, candidate h [R, 1, E], per layer the adapter's (k before RoPE, v)
  [R, 1, K, D]). Block.cached's sliding window is not applied to the frozen token."""
  R = prev_R.shape[0]
  x_R2E = base.embed[...][jnp.stack([prev_R, token_R], axis=1)]   # [frozen token, candidate]
  at_R1 = jnp.full((R, 1), position)
  visible_R2 = jnp.concatenate([at_R1, at_R1 + 1], axis=1)
  new, kv = [], []
  for i, (block, cache) in enumerate(zip(base.blocks, caches)):
    attn, w = block.attn, adapter[i]
    own = w if path == "adapter" else {n: getattr(attn, n)[...] for n in _PROJ}
    xn_R2E = block.attn_norm(x_R2E)
    xf_R1E, xc_R1E = xn_R2E[:, :1], xn_R2E[:, 1:]
    qf, kf, vf = attn._project(xf_R1E, at_R1, theta)  # pylint: disable=protected-access
    cache = {**cache,
             "k": jax.lax.dynamic_update_slice(cache["k"], kf.astype(cache["k"].dtype),
                                               (0, position, 0, 0)),
             "v": jax.lax.dynamic_update_slice(cache["v"], vf.astype(cache["v"].dtype),
                                               (0, position, 0, 0))}
    qc = jnp.einsum("RQE,END->RQND", xc_R1E, own["wq"].astype(xc_R1E.dtype))
    qc = attn.q_norm(qc) if attn.cfg.qk_norm else qc
    kc_pre, vc = _candidate_kv(attn, own, xc_R1E)
    cat = lambda f, c: jnp.concatenate([f, c.astype(f.dtype)], axis=1)  # noqa: E731
    out_R2ND = _attend(kernels.candidate_attention, kernels.candidate_attention_reference,
                       implementation, attn, cat(qf, rope(attn, qc, at_R1 + 1, theta)),
                       cache["k"].astype(qf.dtype), cache["v"].astype(vf.dtype), visible_R2,
                       cat(kf, rope(attn, kc_pre, at_R1 + 1, theta)), cat(vf, vc))
    dt = out_R2ND.dtype
    x_R2E = x_R2E + jnp.concatenate(
        [jnp.einsum("RQND,NDE->RQE", out_R2ND[:, :1], attn.wo[...].astype(dt)),
         jnp.einsum("RQND,NDE->RQE", out_R2ND[:, 1:], own["wo"].astype(dt))], axis=1)
    x_R2E = x_R2E + block.mlp(block.mlp_norm(x_R2E))
    new.append(cache)
    kv.append((kc_pre, vc) if path == "adapter" else _candidate_kv(attn, w, xc_R1E))
  return new, x_R2E[:, 1:], kv


@dataclasses.dataclass(frozen=True)
class FocusConfig:
  chunk_size: int                   # memory tokens per chunk; the memory is whole chunks
  prompt_len: int = 512             # dynamic prompt: the last min(prompt_len, chunk_size) tokens
  implementation: str = "auto"      # candidate/local attention: auto | xla | pallas
  candidate_path: str = "adapter"   # the candidate's own forward (CANDIDATE_PATHS)

  def __post_init__(self):
    if self.chunk_size < 1 or self.prompt_len < 1:
      raise ValueError(f"FocusConfig: chunk_size ({self.chunk_size}) and prompt_len "
                       f"({self.prompt_len}) must be >= 1")
    for name, allowed in (("implementation", IMPLEMENTATIONS), ("candidate_path", CANDIDATE_PATHS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"FocusConfig.{name} must be one of {list(allowed)}; got "
                         f"{getattr(self, name)!r}")

  def prompt_tokens(self, available: int) -> int:
    return min(self.prompt_len, self.chunk_size, available)


def check_base(cfg: model_lib.ModelConfig) -> None:
  """NotImplementedError naming what of a base FocusLLM cannot read: candidate tokens have no
  analogue of dilution's running demand or of a learned τ's running mean, and the candidate
  projections carry no q/k/v biases."""
  if cfg.qkv_bias:
    raise NotImplementedError("model.qkv_bias is True; FocusLLM's candidate projections read "
                              "bases without q/k/v biases")
  for i, spec in enumerate(cfg.attention.layers):
    learned = attn_lib.uses_learned_tau(cfg.attention, spec)
    if attn_lib.FAMILY[spec.variant].demand or learned:
      raise NotImplementedError(
          f"layer {i} is {spec.variant.value}{' with a learned τ' * learned}; FocusLLM reads "
          "bases of softmax or constant-temperature focal layers")


def init_adapter(base: model_lib.Transformer, candidate_path: str = "adapter") -> dict:
  """{layer: {wq, wk, wv, wo}} ({wk, wv}: "frozen"), copies (not ties) of the base's."""
  check_base(base.cfg)
  if candidate_path not in CANDIDATE_PATHS:
    raise ValueError(f"focus.init_adapter: candidate_path {candidate_path!r} is not one of "
                     f"{list(CANDIDATE_PATHS)}")
  leaves = CANDIDATE_PATHS[candidate_path]
  return {i: {n: jnp.array(getattr(b.attn, n)[...]) for n in leaves}
          for i, b in enumerate(base.blocks)}


def check_positions(base_cfg: model_lib.ModelConfig, cfg: FocusConfig, local_len: int,
                    prompt_len: int, extra: int = 0, memory_len: int = 0) -> None:
  """Raises unless every position (module docstring) is < the base's max_seq_len."""
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


def local_logits(base, tokens_BT, cand_kv, theta: float, *, implementation: str = "auto",
                 at_B=None, candidate_mass: bool = False):
  """The frozen decoder over the window, the C candidates of each row (per layer (k before RoPE,
  v) [B, C, K, D]) at positions 0..C-1 and visible to every token. Logits [B, T, V], or with
  `at_B` only row b's position at_B[b]: [B, V] (the head over every position would cost a tenth
  of a step). `candidate_mass` (with `at_B`) also returns that position's head-averaged
  attention on each candidate per layer, float32 [L, B, C]."""
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
    kc_BCKD = rope(attn, kc_BCKD.astype(k.dtype), cand_BC, theta)
    if candidate_mass:
      q_BND = jnp.take_along_axis(q, jnp.asarray(at_B)[:, None, None, None], axis=1)[:, 0]
      mass.append(kernels.candidate_mass_reference(q_BND, k, kc_BCKD, at_B,
                                                    scale=scale(attn)).mean(axis=1))
    # Local token t sees every candidate and the local tokens s <= t.
    out = _attend(kernels.local_attention, kernels.local_attention_reference, implementation,
                  attn, q, k, v, kc_BCKD, vc_BCKD.astype(v.dtype))
    x_BTE = x_BTE + jnp.einsum("BTND,NDE->BTE", out, attn.wo[...].astype(out.dtype))
    x_BTE = x_BTE + block.mlp(block.mlp_norm(x_BTE))
  if at_B is not None:
    x_BTE = jnp.take_along_axis(x_BTE, jnp.asarray(at_B)[:, None, None], axis=1)
    logits_BV = base._logits(x_BTE)[:, 0]  # pylint: disable=protected-access
    return (logits_BV, jnp.stack(mass)) if candidate_mass else logits_BV
  return base._logits(x_BTE)  # pylint: disable=protected-access


def condense(adapter, base, memory_BM, span_BP, num_candidates: int, cfg: FocusConfig,
             extra: int = 0):
  """Candidates for the last `num_candidates` tokens of the dynamic prompt span, all chunks in one
  batch. Returns (h [B, C, Q, E], per layer (k, v) [B, C, Q, K, D], caches [B·C rows]); without
  memory C = 0 and caches None (the plain base)."""
  B, M = memory_BM.shape
  s, Q = cfg.chunk_size, num_candidates
  if M % s:
    raise ValueError(f"focus.condense: memory length {M} must be a multiple of chunk_size {s}; "
                     "drop or pad the oldest tokens")
  if M == 0:
    z = jnp.zeros((B, 0, Q, base.cfg.num_kv_heads, base.cfg.head_dim), jnp.float32)
    return jnp.zeros((B, 0, Q, base.cfg.d_model), z.dtype), [(z, z) for _ in base.blocks], None
  theta = base.cfg.rope_theta   # positions stay inside the trained context: no NTK scaling
  C = M // s
  seq_RN = jnp.concatenate([memory_BM.reshape(B * C, s),
                            jnp.repeat(span_BP.astype(memory_BM.dtype), C, axis=0)], 1)
  # Rows split over the data-like mesh axes, so even one long document spreads its chunks.
  seq_RN = sharding.constrain(seq_RN, ("batch", "seq"))
  R, n = seq_RN.shape
  caches = frozen_prefill(base, seq_RN[:, :-1], cache_len(cfg.implementation, n - 1 + extra),
                          theta)
  positions_RQ = jnp.broadcast_to(jnp.arange(n - Q, n), (R, Q))
  h_RQE, kv = candidates(adapter, base, caches, seq_RN[:, n - Q:], positions_RQ, theta,
                         implementation=cfg.implementation, path=cfg.candidate_path)
  split = lambda x: x.reshape(B, C, *x.shape[1:])
  return split(h_RQE), [(split(k), split(v)) for k, v in kv], caches


def _window_kv(adapter, base, memory_BM, tokens_BT, n: int, Q: int, cfg: FocusConfig):
  """Per layer (k, v) [B, C, Q, K, D] of the candidates of query points n - 1 .. n + Q - 2 of
  `tokens_BT`, the first one's window being its first n tokens; positions checked."""
  P = cfg.prompt_tokens(n)
  check_positions(base.cfg, cfg, n, P, extra=Q - 1, memory_len=memory_BM.shape[1])
  return condense(adapter, base, memory_BM, tokens_BT[:, n - P:], Q, cfg)[1]


def logits(adapter, base, memory_BM, local_BT, cfg: FocusConfig):
  """float32 [B, T, V]; only the last position is a FocusLLM prediction (the candidates were
  condensed with a prompt ending there)."""
  kv = _window_kv(adapter, base, memory_BM, local_BT, local_BT.shape[1], 1, cfg)
  return local_logits(base, local_BT, [(k[:, :, 0], v[:, :, 0]) for k, v in kv],
                      base.cfg.rope_theta, implementation=cfg.implementation)


def target_nll(adapter, base, memory_BM, tokens_BT, cfg: FocusConfig, num_targets: int):
  """Leak-free NLL of the last Q tokens of `tokens_BT`, float32 [B, Q] (module docstring)."""
  B, T1 = tokens_BT.shape
  T, Q = T1 - 1, num_targets
  if not 1 <= Q <= T:
    raise ValueError(f"focus: num_targets ({Q}) must be in [1, {T}] (local tokens - 1)")
  inputs_BT = tokens_BT[:, :-1]
  first = T - Q                                   # index of the first query point
  kv = _window_kv(adapter, base, memory_BM, inputs_BT, first + 1, Q, cfg)
  C = kv[0][0].shape[1]
  # Row (b, q) carries candidates_q of every chunk and is read only at its query point first + q.
  rows = lambda x: x.transpose(0, 2, 1, 3, 4).reshape(B * Q, C, *x.shape[3:])
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
