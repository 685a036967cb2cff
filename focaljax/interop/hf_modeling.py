"""Hugging Face modeling code for focaljax exports that stock `transformers` cannot compute:
learned focal temperature, dilution attention, layers without RoPE, and mixes of them.

`focaljax.interop.hf_export` copies this file into the export as `modeling_focaljax.py` (and
writes `configuration_focaljax.py`, which re-exports `FocaljaxConfig`), so that
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` loads it. It imports only
torch and transformers. Weight names are LLaMA's, plus `self_attn.w_tau` on learned-τ layers.

Each layer computes, from the per-layer lists in the config:
  scale     layer_scale (1/√D for softmax, 1/(t·√D) for a constant focal temperature t), or on a
            learned-τ layer 1/τ with τ_t = clip(mean_{s≤t}(x_s·w_τ) + τ_init, τ_min, τ_max)
            (x_t·w_τ alone with tau_per_token); x is the attention block's normed input
  softmax   out = softmax(scale · q·kᵀ) v, causal
  dilution  p = that softmax; committed[i, j] = Σ_{r<i} p[r, j]; share = p/(committed + p + ε);
            A = share/(rowsum(share) + ε); out = A v
  rope      rotate-half RoPE; past the trained context θ' = θ·(L/L_train)^(D/(D-2)), L the
            sequence length (as HF's "dynamic" rope with factor 1), or `rope_length` if given;
            then Llama 3's frequency bands if `rope_llama3` names them
  window    sliding_window W (softmax layers): query t sees keys t-W < s <= t

Cached generation keeps, besides each layer's k and v, every dilution layer's column sums of p
(the demand that earlier queries absorbed) and every learned-τ layer's running sum of x·w_τ, so
a decode step computes what the whole forward computes at that position. Pass
`rope_length=<final length>` to `generate` to rotate every position with one θ, as focaljax's
own generation does past the trained context.

Einsum letters: B batch, T queries, S keys, E d_model, N query heads, K kv heads, G = N/K,
D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

# transformers 5 names the cache `cache`; 4.x called it `past_key_values`.
_CACHE_FIELD = ("cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__
                else "past_key_values")


class FocaljaxConfig(PretrainedConfig):
  """LLaMA's shape fields plus one entry per layer for what focaljax chose there."""
  model_type = "focaljax"

  def __init__(self, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=4, head_dim=16,
               max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
               qk_norm=False, layer_rope=None, layer_dilution=None, layer_learned_tau=None,
               layer_scale=None, tau_min=5.0, tau_max=10.0, tau_init=7.5, tau_per_token=False,
               dilution_eps=1e-9, qkv_bias=False, sliding_window=None, rope_llama3=None,
               tie_word_embeddings=True, **kwargs):
    self.vocab_size, self.hidden_size = vocab_size, hidden_size
    self.intermediate_size, self.num_hidden_layers = intermediate_size, num_hidden_layers
    self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
    self.head_dim, self.max_position_embeddings = head_dim, max_position_embeddings
    self.rms_norm_eps, self.rope_theta, self.qk_norm = rms_norm_eps, rope_theta, qk_norm
    L = num_hidden_layers
    for name, value, default in (("layer_rope", layer_rope, True),
                                 ("layer_dilution", layer_dilution, False),
                                 ("layer_learned_tau", layer_learned_tau, False),
                                 ("layer_scale", layer_scale, head_dim**-0.5)):
      value = list(value if value is not None else [default] * L)
      if len(value) != L:
        raise ValueError(f"config.json: {name} has {len(value)} entries for num_hidden_layers={L}")
      setattr(self, name, value)
    self.tau_min, self.tau_max, self.tau_init = tau_min, tau_max, tau_init
    self.tau_per_token, self.dilution_eps = tau_per_token, dilution_eps
    self.qkv_bias, self.sliding_window = qkv_bias, sliding_window
    # Llama 3 bands: {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}.
    self.rope_llama3 = rope_llama3
    super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class FocaljaxCache:
  """Per layer: k, v [B, S, K, D]; demand float32 [B, N, S] (dilution layers; None on others);
  tau_sum float32 [B] (learned τ). Greedy search and sampling only: nothing reorders beams."""

  def __init__(self, num_layers: int):
    self.layers = [{} for _ in range(num_layers)]

  def get_seq_length(self, layer_idx: int = 0) -> int:
    k = self.layers[layer_idx].get("k")
    return 0 if k is None else k.shape[1]


class RMSNorm(nn.Module):

  def __init__(self, dim: int, eps: float):
    super().__init__()
    self.weight = nn.Parameter(torch.ones(dim))
    self.eps = eps

  def forward(self, x):
    """Statistics in float32, as focaljax computes them; the result in x's dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
    return (y * self.weight.float()).to(x.dtype)


def rope_theta(config: FocaljaxConfig, length: int) -> float:
  """Dynamic NTK: θ·(L/L_train)^(D/(D-2)) when L exceeds the trained context."""
  if length <= config.max_position_embeddings:
    return config.rope_theta
  D = config.head_dim
  return config.rope_theta * (length / config.max_position_embeddings) ** (D / (D - 2))


def apply_rope(x_BTND, positions_BT, theta: float, scaling: dict | None = None):
  """Rotate-half RoPE in float32 (LLaMA's convention), the result in x's dtype."""
  D = x_BTND.shape[-1]
  inv_freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float32, device=x_BTND.device) / D)
  if scaling:
    s = scaling
    periods = s["original_max_position_embeddings"] * inv_freq / (2 * torch.pi)
    smooth = torch.clamp((periods - s["low_freq_factor"])
                         / (s["high_freq_factor"] - s["low_freq_factor"]), 0.0, 1.0)
    inv_freq = inv_freq * ((1 - smooth) / s["factor"] + smooth)
  angle_BTd = positions_BT[..., None].float() * inv_freq
  cos, sin = torch.cos(angle_BTd)[:, :, None], torch.sin(angle_BTd)[:, :, None]
  x = x_BTND.float()
  x1, x2 = x[..., :D // 2], x[..., D // 2:]
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BTND.dtype)


def attend(q_BTND, k_BSKD, v_BSKD, scale, past: int, demand_BNS=None, eps: float = 1e-9,
           window: int | None = None):
  """Causal softmax (demand None) or dilution attention of T queries at positions past.. over
  S = past + T keys, within `window` keys if given. `scale`: a float or float32 [B, T]. Returns
  (out [B, T, N, D] in q's dtype, the demand with these queries' p added, or None)."""
  B, T, N, D = q_BTND.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  G = N // K
  q_BTKGD = q_BTND.float().reshape(B, T, K, G, D)
  logits_BKGTS = torch.einsum("BTKGD,BSKD->BKGTS", q_BTKGD, k_BSKD.float())
  if torch.is_tensor(scale):
    scale = scale.reshape(B, 1, 1, T, 1)
  logits_BKGTS = logits_BKGTS * scale
  pos_T = past + torch.arange(T, device=q_BTND.device)
  s_S = torch.arange(S, device=q_BTND.device)
  visible_TS = s_S[None] <= pos_T[:, None]
  if window:
    visible_TS &= s_S[None] > pos_T[:, None] - window
  p_BKGTS = torch.softmax(logits_BKGTS.masked_fill(~visible_TS, float("-inf")), dim=-1)
  a_BKGTS = p_BKGTS
  if demand_BNS is not None:
    # Keys of this chunk have absorbed nothing yet; earlier chunks' queries are in demand.
    demand_BKGS = F.pad(demand_BNS, (0, S - demand_BNS.shape[-1])).reshape(B, K, G, S)
    committed = demand_BKGS[:, :, :, None] + (torch.cumsum(p_BKGTS, dim=-2) - p_BKGTS)
    share = p_BKGTS / (committed + p_BKGTS + eps)
    a_BKGTS = share / (share.sum(-1, keepdim=True) + eps)
    demand_BNS = (demand_BKGS + p_BKGTS.sum(-2)).reshape(B, N, S)
  out_BTKGD = torch.einsum("BKGTS,BSKD->BTKGD", a_BKGTS, v_BSKD.float())
  return out_BTKGD.reshape(B, T, N, D).to(q_BTND.dtype), demand_BNS


class Attention(nn.Module):

  def __init__(self, config: FocaljaxConfig, layer: int):
    super().__init__()
    E, N, K, D = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                  config.head_dim)
    self.config, self.num_heads, self.num_kv_heads, self.head_dim = config, N, K, D
    self.rope = bool(config.layer_rope[layer])
    self.dilution = bool(config.layer_dilution[layer])
    self.scale = float(config.layer_scale[layer])
    self.q_proj = nn.Linear(E, N * D, bias=config.qkv_bias)
    self.k_proj = nn.Linear(E, K * D, bias=config.qkv_bias)
    self.v_proj = nn.Linear(E, K * D, bias=config.qkv_bias)
    self.o_proj = nn.Linear(N * D, E, bias=False)
    if config.qk_norm:
      self.q_norm = RMSNorm(D, config.rms_norm_eps)
      self.k_norm = RMSNorm(D, config.rms_norm_eps)
    self.w_tau = nn.Parameter(torch.zeros(E)) if config.layer_learned_tau[layer] else None

  def _scale(self, x_BTE, state: dict, past: int):
    """layer_scale, or 1/τ [B, T] from the running mean of x·w_τ (carried in state)."""
    if self.w_tau is None:
      return self.scale
    c = self.config
    a_BT = torch.einsum("BTE,E->BT", x_BTE.float(), self.w_tau.float())
    if c.tau_per_token:
      mean_BT = a_BT
    else:
      prefix_BT = state.get("tau_sum", torch.zeros_like(a_BT[:, 0]))[:, None] + a_BT.cumsum(1)
      count_T = past + torch.arange(a_BT.shape[1], device=a_BT.device) + 1
      mean_BT = prefix_BT / count_T.float()
      state["tau_sum"] = prefix_BT[:, -1]
    return 1.0 / torch.clamp(mean_BT + c.tau_init, c.tau_min, c.tau_max)

  def forward(self, x_BTE, positions_BT, theta: float, state: dict):
    B, T, _ = x_BTE.shape
    N, K, D = self.num_heads, self.num_kv_heads, self.head_dim
    q_BTND = self.q_proj(x_BTE).view(B, T, N, D)
    k_BTKD = self.k_proj(x_BTE).view(B, T, K, D)
    v_BTKD = self.v_proj(x_BTE).view(B, T, K, D)
    if self.config.qk_norm:
      q_BTND, k_BTKD = self.q_norm(q_BTND), self.k_norm(k_BTKD)
    if self.rope:
      scaling = self.config.rope_llama3
      q_BTND, k_BTKD = (apply_rope(y, positions_BT, theta, scaling) for y in (q_BTND, k_BTKD))
    past = state["k"].shape[1] if "k" in state else 0
    k_BSKD = torch.cat([state["k"], k_BTKD], dim=1) if past else k_BTKD
    v_BSKD = torch.cat([state["v"], v_BTKD], dim=1) if past else v_BTKD
    state["k"], state["v"] = k_BSKD, v_BSKD
    scale = self._scale(x_BTE, state, past)
    # Softmax layers carry no demand: attend takes and returns None.
    demand_BNS = (state.get("demand", x_BTE.new_zeros((B, N, 0), dtype=torch.float32))
                  if self.dilution else None)
    out_BTND, state["demand"] = attend(q_BTND, k_BSKD, v_BSKD, scale, past, demand_BNS,
                                       self.config.dilution_eps, self.config.sliding_window)
    return self.o_proj(out_BTND.reshape(B, T, N * D))


class Mlp(nn.Module):

  def __init__(self, config: FocaljaxConfig):
    super().__init__()
    E, F_ = config.hidden_size, config.intermediate_size
    self.gate_proj = nn.Linear(E, F_, bias=False)
    self.up_proj = nn.Linear(E, F_, bias=False)
    self.down_proj = nn.Linear(F_, E, bias=False)

  def forward(self, x):
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):

  def __init__(self, config: FocaljaxConfig, layer: int):
    super().__init__()
    self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
    self.self_attn = Attention(config, layer)
    self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
    self.mlp = Mlp(config)

  def forward(self, x_BTE, positions_BT, theta, state):
    x_BTE = x_BTE + self.self_attn(self.input_layernorm(x_BTE), positions_BT, theta, state)
    return x_BTE + self.mlp(self.post_attention_layernorm(x_BTE))


class FocaljaxModel(nn.Module):

  def __init__(self, config: FocaljaxConfig):
    super().__init__()
    self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
    self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
    self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class FocaljaxForCausalLM(PreTrainedModel, GenerationMixin):
  """focaljax's decoder. Tied embeddings have no lm_head: the logits use embed_tokens."""
  config_class = FocaljaxConfig
  base_model_prefix = "model"
  _no_split_modules = ["Block"]

  def __init__(self, config: FocaljaxConfig):
    super().__init__(config)
    self.model = FocaljaxModel(config)
    if not config.tie_word_embeddings:
      self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    self.post_init()

  @classmethod
  def _supports_default_dynamic_cache(cls) -> bool:
    # The cache also carries demand and τ sums: forward builds a FocaljaxCache.
    return False

  def get_input_embeddings(self):
    return self.model.embed_tokens

  def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
              past_key_values=None, use_cache=None, labels=None, logits_to_keep=0,
              rope_length=None, **kwargs):
    """Logits float32 [B, T, V] for input_ids at positions cache length.. (or position_ids).
    `rope_length`: the length RoPE's θ is NTK-scaled for (default: the sequence so far)."""
    del kwargs  # return_dict, output_attentions, ...: this model returns logits and the cache
    if attention_mask is not None and not bool(torch.all(attention_mask == 1)):
      raise ValueError("attention_mask has zeros: focaljax exports attend to the whole prefix; "
                       "pass unpadded rows of equal length")
    cache = cache if cache is not None else past_key_values
    if cache is not None and not isinstance(cache, FocaljaxCache):
      raise ValueError(f"cache is a {type(cache).__name__}; this model builds its own "
                       "FocaljaxCache (k, v, dilution demand, τ sums): pass none")
    if cache is None:
      cache = FocaljaxCache(self.config.num_hidden_layers)
    B, T = input_ids.shape
    past = cache.get_seq_length()
    if position_ids is None:
      position_ids = (past + torch.arange(T, device=input_ids.device))[None].expand(B, T)
    theta = rope_theta(self.config, rope_length or past + T)
    x_BTE = self.model.embed_tokens(input_ids)
    for block, state in zip(self.model.layers, cache.layers):
      x_BTE = block(x_BTE, position_ids, theta, state)
    x_BTE = self.model.norm(x_BTE)
    if logits_to_keep:
      x_BTE = x_BTE[:, -logits_to_keep:]
    w_VE = (self.model.embed_tokens.weight if self.config.tie_word_embeddings
            else self.lm_head.weight)
    logits = F.linear(x_BTE, w_VE).float()
    loss = None
    if labels is not None:
      loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                             ignore_index=-100)
    return CausalLMOutputWithPast(loss=loss, logits=logits,
                                  **{_CACHE_FIELD: cache if use_cache in (None, True) else None})
