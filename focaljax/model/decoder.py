"""LLaMA-style decoder (Flax NNX) whose attention layers are chosen per layer from a pattern.

Einsum letters: B batch, T positions, S key positions, E d_model, F d_ff, N query heads,
K kv heads, D head dim, V vocabulary.

Pre-RMSNorm blocks, SwiGLU MLP, optional q/k/v biases (Qwen2), optional tied embeddings,
grouped-query attention, optional QK-norm, rotary embeddings (per-layer `rope` or `none`,
optionally Llama 3 scaled) with dynamic NTK scaling past the trained context. Every parameter
carries logical axis names in its `axes` metadata (`focaljax.sharding.RULES` maps them to mesh
axes). The model knows no variant names: each layer gets its `attention.Family` from
`attention.FAMILY`. `focaljax.dispatch` picks, per platform, the glue passes: QK-norm + RoPE, the
SwiGLU activation (mlp.py), the residual add with the norm after it (add_norm.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from focaljax import dispatch
from focaljax import sharding
from focaljax.model import add_norm as add_norm_lib
from focaljax.model import attention as attn_lib
from focaljax.model import mlp as mlp_lib
# Re-exported: focus, the tests and conversions call these as decoder.<name>.
from focaljax.model.norm_rope import (Llama3Scaling, _rms_norm, apply_rope,  # noqa: F401
                                      qk_norm_rope, rms_norm, rope_tables)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_ff: int
  max_seq_len: int                  # trained context; RoPE NTK-scales beyond it
  attention: attn_lib.AttentionConfig
  tie_embeddings: bool = False
  qk_norm: bool = False
  qkv_bias: bool = False            # biases on q, k and v (Qwen2), none on o
  rope_theta: float = 10000.0
  rope_scaling: Llama3Scaling | None = None
  norm_eps: float = 1e-5
  remat: bool = False
  # What each block's backward keeps when remat is on (REMAT_POLICIES); the rest is recomputed.
  remat_policy: str = "nothing"
  init_std: float = 0.02


# model.remat_policy -> the jax.checkpoint policy of each block (MaxText's remat_policy):
# "nothing" recomputes the whole block (least memory); "dots" keeps every matmul's output;
# "dots_no_batch" keeps those against weights (q/k/v/o, the MLP) but recomputes the attention
# scores and everything elementwise: norms, RoPE, SwiGLU's activation. A fused attention kernel
# (Pallas, cuDNN) is not a matmul to these policies: its forward reruns in the backward.
REMAT_POLICIES = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _param(rngs, shape, std, axes):
  return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, axes=("norm",)):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), axes=axes)
    self.eps = eps

  def __call__(self, x):
    return rms_norm(x, self.scale[...], self.eps)


class Mlp(nnx.Module):
  """silu(x·W_gate) ⊙ (x·W_up) · W_down."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    E, F = cfg.d_model, cfg.d_ff
    self.w_gate = _param(rngs, (E, F), E**-0.5, ("embed", "mlp"))
    self.w_up = _param(rngs, (E, F), E**-0.5, ("embed", "mlp"))
    self.w_down = _param(rngs, (F, E), cfg.init_std / (2 * cfg.num_layers) ** 0.5, ("mlp", "embed"))

  def __call__(self, x_BTE):
    dt = x_BTE.dtype
    gate_BTF = jnp.einsum("BTE,EF->BTF", x_BTE, self.w_gate[...].astype(dt))
    up_BTF = jnp.einsum("BTE,EF->BTF", x_BTE, self.w_up[...].astype(dt))
    h_BTF = mlp_lib.swiglu(gate_BTF, up_BTF)
    return jnp.einsum("BTF,FE->BTE", h_BTF, self.w_down[...].astype(dt))


def rope_theta(cfg: ModelConfig, length: int | None) -> float:
  """Dynamic NTK: θ' = θ·(L/T_train)^(D/(D-2)) when L exceeds the trained context."""
  if length is None or length <= cfg.max_seq_len:
    return cfg.rope_theta
  D = cfg.head_dim
  return cfg.rope_theta * (length / cfg.max_seq_len) ** (D / (D - 2))


def _segment_bounds(segment_ids_BT, T):
  """Index of each token's document start and end within its row."""
  t = jnp.arange(T)
  if segment_ids_BT is None:
    return jnp.zeros((1, T), jnp.int32), jnp.full((1, T), T - 1, jnp.int32)
  seg = segment_ids_BT
  is_start = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], 1)
  start = jax.lax.cummax(jnp.where(is_start, t, 0), axis=1)
  is_end = jnp.concatenate([seg[:, 1:] != seg[:, :-1], jnp.ones_like(seg[:, :1], bool)], 1)
  end = jax.lax.cummin(jnp.where(is_end, t, T - 1), axis=1, reverse=True)
  return start, end


def learned_tau(a_BT, cfg: attn_lib.AttentionConfig, segment_ids_BT=None):
  """τ per token from a = X·w_τ: the running (or whole-document, or per-token) mean, clipped."""
  B, T = a_BT.shape
  if cfg.tau_mean is attn_lib.TauMean.TOKEN:
    mean_BT = a_BT
  else:
    start, end = _segment_bounds(segment_ids_BT, T)
    start, end = jnp.broadcast_to(start, (B, T)), jnp.broadcast_to(end, (B, T))
    cs = jnp.cumsum(a_BT, axis=1)
    before = jnp.take_along_axis(cs - a_BT, start, axis=1)
    upto = end if cfg.tau_mean is attn_lib.TauMean.SEQUENCE else jnp.arange(T)[None]
    total = jnp.take_along_axis(cs, jnp.broadcast_to(upto, (B, T)), axis=1) - before
    mean_BT = total / (upto - start + 1).astype(jnp.float32)
  return jnp.clip(mean_BT + cfg.tau_init, cfg.tau_min, cfg.tau_max)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, spec: attn_lib.LayerSpec, rngs: nnx.Rngs):
    E, N, K, D = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.cfg, self.spec = cfg, spec
    self.family = attn_lib.FAMILY[spec.variant]
    std_out = cfg.init_std / (2 * cfg.num_layers) ** 0.5
    self.wq = _param(rngs, (E, N, D), E**-0.5, ("embed", "heads", "head_dim"))
    self.wk = _param(rngs, (E, K, D), E**-0.5, ("embed", "kv_heads", "head_dim"))
    self.wv = _param(rngs, (E, K, D), E**-0.5, ("embed", "kv_heads", "head_dim"))
    self.wo = _param(rngs, (N, D, E), std_out, ("heads", "head_dim", "embed"))
    if cfg.qkv_bias:
      self.bq = nnx.Param(jnp.zeros((N, D), jnp.float32), axes=("heads", "head_dim"))
      self.bk = nnx.Param(jnp.zeros((K, D), jnp.float32), axes=("kv_heads", "head_dim"))
      self.bv = nnx.Param(jnp.zeros((K, D), jnp.float32), axes=("kv_heads", "head_dim"))
    if cfg.qk_norm:
      self.q_norm = RMSNorm(D, cfg.norm_eps, ("head_dim",))
      self.k_norm = RMSNorm(D, cfg.norm_eps, ("head_dim",))
    if attn_lib.uses_learned_tau(cfg.attention, spec):
      # Zero init: τ starts at tau_init, inside the clip range, so w_τ gets gradient from step 0.
      self.w_tau = nnx.Param(jnp.zeros((E,), jnp.float32), axes=("embed",))

  def _project(self, x_BTE, positions_BT, theta):
    dt = x_BTE.dtype
    q = jnp.einsum("BTE,END->BTND", x_BTE, self.wq[...].astype(dt))
    k = jnp.einsum("BTE,EKD->BTKD", x_BTE, self.wk[...].astype(dt))
    v = jnp.einsum("BTE,EKD->BTKD", x_BTE, self.wv[...].astype(dt))
    if self.cfg.qkv_bias:
      q, k, v = (y + b[...].astype(dt) for y, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
    rope, scaling = self.spec.position is attn_lib.Position.ROPE, self.cfg.rope_scaling
    glue = dispatch.choose("qk_norm_rope", head_dim=self.cfg.head_dim)
    if self.cfg.qk_norm and rope and glue.implementation == "pallas":
      cos_BTd, sin_BTd = rope_tables(positions_BT, theta, self.cfg.head_dim, scaling)
      q = qk_norm_rope(q, self.q_norm.scale[...], cos_BTd, sin_BTd, self.q_norm.eps, glue.interpret)
      k = qk_norm_rope(k, self.k_norm.scale[...], cos_BTd, sin_BTd, self.k_norm.eps, glue.interpret)
      return q, k, v
    if self.cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    if rope:
      q, k = (apply_rope(y, positions_BT, theta, scaling) for y in (q, k))
    return q, k, v

  def _tau_a(self, x_BTE):
    if not hasattr(self, "w_tau"):
      return None
    return jnp.einsum("BTE,E->BT", x_BTE.astype(jnp.float32), self.w_tau[...].astype(jnp.float32))

  def __call__(self, x_BTE, positions_BT, segment_ids_BT, theta):
    q, k, v = self._project(x_BTE, positions_BT, theta)
    a_BT = self._tau_a(x_BTE)
    tau_BT = None if a_BT is None else learned_tau(a_BT, self.cfg.attention, segment_ids_BT)
    scale = self.family.scale(self.cfg.attention, self.cfg.head_dim, tau_BT)
    out = self.family.attend(self.cfg.attention, q, k, v, scale, segment_ids_BT)
    return jnp.einsum("BTND,NDE->BTE", out, self.wo[...].astype(out.dtype))

  def cached(self, x_BTE, cache, start, theta):
    """Prefill (start == 0, T tokens) or one decode step (T == 1) against this layer's cache."""
    B, T, _ = x_BTE.shape
    positions_BT = jnp.broadcast_to(start + jnp.arange(T), (B, T))
    q, k, v = self._project(x_BTE, positions_BT, theta)
    cache = {**cache,
             "k": jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, start, 0, 0)),
             "v": jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), (0, start, 0, 0))}
    a_BT = self._tau_a(x_BTE)
    tau_BT = None
    if a_BT is not None:
      cfg = self.cfg.attention
      if cfg.tau_mean is attn_lib.TauMean.TOKEN:
        tau_BT = learned_tau(a_BT, cfg)
      else:
        # Running mean over the prefix: training's causal mode exactly; the whole-document mode
        # cannot see the future here, which is the mismatch its docstring warns about.
        prefix_BT = cache["tau_sum"][:, None] + jnp.cumsum(a_BT, axis=1)
        mean_BT = prefix_BT / (start + jnp.arange(T) + 1).astype(jnp.float32)
        tau_BT = jnp.clip(mean_BT + cfg.tau_init, cfg.tau_min, cfg.tau_max)
        cache = {**cache, "tau_sum": prefix_BT[:, -1]}
    scale = self.family.scale(self.cfg.attention, self.cfg.head_dim, tau_BT)
    out, cache = self.family.cached(self.cfg.attention, q, cache, scale, start)
    return jnp.einsum("BTND,NDE->BTE", out, self.wo[...].astype(out.dtype)), cache


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, spec: attn_lib.LayerSpec, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.attn = Attention(cfg, spec, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.mlp = Mlp(cfg, rngs)

  def __call__(self, x_BTE, positions_BT, segment_ids_BT, theta):
    # Named scopes label the HLO (profiles, bench/step_profile.py's "model part"); nothing else.
    with jax.named_scope("attn"):
      x_BTE = x_BTE + self.attn(self.attn_norm(x_BTE), positions_BT, segment_ids_BT, theta)
    with jax.named_scope("mlp"):
      x_BTE = x_BTE + self.mlp(self.mlp_norm(x_BTE))
    return sharding.constrain(x_BTE, ("batch", "seq", "embed_act"))

  def deferred(self, x_BTE, d_BTE, positions_BT, segment_ids_BT, theta, interpret: bool):
    """`__call__` of x + δ with the residual adds deferred into the next norm: returns (x', δ')
    with x' + δ' the block's output, each add done by `add_norm.add_rms_norm` together with the
    norm that reads its sum (one Pallas pass each way). δ None: the first block (plain norm)."""
    with jax.named_scope("attn"):
      if d_BTE is None:
        y_BTE = self.attn_norm(x_BTE)
      else:
        x_BTE, y_BTE = add_norm_lib.add_rms_norm(x_BTE, d_BTE, self.attn_norm.scale[...],
                                                 self.attn_norm.eps, interpret)
      d_BTE = self.attn(y_BTE, positions_BT, segment_ids_BT, theta)
    with jax.named_scope("mlp"):
      x_BTE, y_BTE = add_norm_lib.add_rms_norm(x_BTE, d_BTE, self.mlp_norm.scale[...],
                                               self.mlp_norm.eps, interpret)
      d_BTE = self.mlp(y_BTE)
    act = ("batch", "seq", "embed_act")
    return sharding.constrain(x_BTE, act), sharding.constrain(d_BTE, act)

  def cached(self, x_BTE, cache, start, theta):
    h, cache = self.attn.cached(self.attn_norm(x_BTE), cache, start, theta)
    x_BTE = x_BTE + h
    return x_BTE + self.mlp(self.mlp_norm(x_BTE)), cache


def _apply_block(block: Block, method: str, policy: str | None, *args, **static):
  """block.<method>(*args, **static), remat'd by `policy` (None: not), as a call of one jitted
  function that every block of the same layer spec shares: jax traces and lowers it once, not
  once per layer (seconds of start-up at 24 layers); XLA inlines the calls, so the compiled step
  is the same."""
  graphdef, state = nnx.split(block)
  return _block_call(state, *args, graphdef=graphdef, method=method, policy=policy,
                     static=tuple(sorted(static.items())))


@functools.partial(jax.jit, static_argnames=("graphdef", "method", "policy", "static"))
def _block_call(state, *args, graphdef, method, policy, static):
  def call(state, *args):
    return getattr(nnx.merge(graphdef, state), method)(*args, **dict(static))
  if policy is not None:
    call = jax.checkpoint(call, policy=REMAT_POLICIES[policy])
  return call(state, *args)


@jax.custom_vjp
def head_matmul(x_BTE, w_EV):
  """float32 logits from compute-dtype activations and weights: the loss and sampling need the
  full range. The backward casts the float32 logit gradient back to the compute dtype, so its two
  [B·T, V] GEMMs run on 16-bit tensor cores like every other layer's (as autodiff leaves them,
  they are float32 x bf16 dots, which XLA runs in float32); accumulation stays float32."""
  return jnp.einsum("BTE,EV->BTV", x_BTE, w_EV, preferred_element_type=jnp.float32)


def _head_matmul_fwd(x_BTE, w_EV):
  return head_matmul(x_BTE, w_EV), (x_BTE, w_EV)


def _head_matmul_bwd(res, g_BTV):
  x_BTE, w_EV = res
  g_BTV = g_BTV.astype(x_BTE.dtype)
  dx_BTE = jnp.einsum("BTV,EV->BTE", g_BTV, w_EV, preferred_element_type=jnp.float32)
  dw_EV = jnp.einsum("BTE,BTV->EV", x_BTE, g_BTV, preferred_element_type=jnp.float32)
  return dx_BTE.astype(x_BTE.dtype), dw_EV.astype(w_EV.dtype)


head_matmul.defvjp(_head_matmul_fwd, _head_matmul_bwd)


class Transformer(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std, ("vocab", "embed"))
    self.blocks = nnx.List([Block(cfg, spec, rngs) for spec in cfg.attention.layers])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), cfg.d_model**-0.5,
                            ("embed", "vocab"))

  @jax.named_scope("logits")
  def _logits(self, x_BTE):
    x_BTE = self.final_norm(x_BTE)
    if self.cfg.tie_embeddings:
      w_EV = self.embed[...].T
    else:
      w_EV = self.lm_head[...]
    return head_matmul(x_BTE, w_EV.astype(x_BTE.dtype))

  def __call__(self, tokens_BT, *, positions_BT=None, segment_ids_BT=None, rope_length=None,
               dtype=jnp.float32):
    """Logits float32 [B, T, V]. `rope_length`: the length to NTK-scale for (default T)."""
    B, T = tokens_BT.shape
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
    theta = rope_theta(self.cfg, rope_length or T)
    x_BTE = self.embed[...].astype(dtype)[tokens_BT]
    x_BTE = sharding.constrain(x_BTE, ("batch", "seq", "embed_act"))
    add_norm = dispatch.choose("add_norm", width=self.cfg.d_model)
    if add_norm.implementation == "pallas":
      return self._logits(self._deferred_blocks(x_BTE, positions_BT, segment_ids_BT, theta,
                                                add_norm.interpret))
    policy = self.cfg.remat_policy if self.cfg.remat else None
    for block in self.blocks:
      x_BTE = _apply_block(block, "__call__", policy, x_BTE, positions_BT, segment_ids_BT,
                           theta=theta)
    return self._logits(x_BTE)

  def _deferred_blocks(self, x_BTE, positions_BT, segment_ids_BT, theta, interpret):
    """The blocks through `Block.deferred`: the same sums, each residual add fused with the norm
    after it; the last add is XLA's, before the final norm."""
    policy = self.cfg.remat_policy if self.cfg.remat else None
    d_BTE = None
    for block in self.blocks:
      x_BTE, d_BTE = _apply_block(block, "deferred", policy, x_BTE, d_BTE, positions_BT,
                                  segment_ids_BT, theta=theta, interpret=interpret)
    return x_BTE + d_BTE

  def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> list[dict]:
    """Per-layer KV cache (+ running float32 demand for dilution, + τ prefix sum if learned)."""
    cfg = self.cfg
    caches = []
    for block in self.blocks:
      c = {"k": jnp.zeros((batch, max_len, cfg.num_kv_heads, cfg.head_dim), dtype),
           "v": jnp.zeros((batch, max_len, cfg.num_kv_heads, cfg.head_dim), dtype)}
      if block.attn.family.demand:
        c["demand"] = jnp.zeros((batch, cfg.num_heads, max_len), jnp.float32)
      if hasattr(block.attn, "w_tau"):
        c["tau_sum"] = jnp.zeros((batch,), jnp.float32)
      caches.append(c)
    return caches

  def forward_cached(self, tokens_BT, caches, start, *, rope_length: int, dtype=jnp.float32):
    """Logits for tokens at positions start.. (prefill from start == 0, or T == 1 steps)."""
    theta = rope_theta(self.cfg, rope_length)
    x_BTE = self.embed[...].astype(dtype)[tokens_BT]
    new = []
    for block, cache in zip(self.blocks, caches):
      x_BTE, cache = block.cached(x_BTE, cache, start, theta)
      new.append(cache)
    return self._logits(x_BTE), new


def param_count(cfg: ModelConfig) -> int:
  """Closed form, checked against the module in tests: embeddings + head + per-layer weights."""
  E, F, N, K, D, V, L = (cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.vocab_size, cfg.num_layers)
  per_layer = E * D * (2 * N + 2 * K) + 3 * E * F + 2 * E + (2 * D if cfg.qk_norm else 0)
  per_layer += (N + 2 * K) * D if cfg.qkv_bias else 0
  learned = sum(E for s in cfg.attention.layers if attn_lib.uses_learned_tau(cfg.attention, s))
  return V * E * (1 if cfg.tie_embeddings else 2) + L * per_layer + E + learned


def abstract_model(cfg: ModelConfig):
  """(graphdef, abstract state) of a Transformer, without allocating its parameters."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
