"""The ConfigDict boundary: validation, and conversion to the frozen dataclasses the library takes.

`validate` runs before anything is built or compiled. Every error names the field and the allowed
values; nothing is silently corrected. Past this module no code reads a ConfigDict.
"""

from __future__ import annotations

import ml_collections

from focaljax.model import add_norm as add_norm_lib
from focaljax.model import attention as attn_lib
from focaljax.train import loss as loss_lib
from focaljax.model import mlp as mlp_lib
from focaljax.model import decoder as model_lib
from focaljax import ops

_CHOICES = {
    "model.attention.implementation": attn_lib.IMPLEMENTATIONS,
    "model.attention.tau_mean": tuple(m.value for m in attn_lib.TauMean),
    "model.norm_backward": ("explicit", "autodiff"),
    "model.qk_rope_backward": model_lib.QK_ROPE_BACKWARDS,
    "model.mlp_backward": mlp_lib.MLP_BACKWARDS,
    "model.add_norm": add_norm_lib.ADD_NORMS,
    "model.remat_policy": tuple(model_lib.REMAT_POLICIES),
    "optim.mu_dtype": ("float32", "bfloat16"),
    "train.compute_dtype": ("float32", "bfloat16"),
    "train.nonfinite": ("stop", "skip"),
    "train.cross_entropy": tuple(loss_lib.CROSS_ENTROPIES),
}
_NO_DECAY = ("norm", "embed")


class ConfigError(ValueError):
  """A config field has an invalid value; the message names it."""


def _get(c, dotted):
  for part in dotted.split("."):
    c = c[part]
  return c


def _require(ok: bool, field: str, msg: str):
  if not ok:
    raise ConfigError(f"config field {field}: {msg}")


def validate(c: ml_collections.ConfigDict, *, vocab_size: int | None = None,
             process_count: int = 1) -> None:
  """Raises ConfigError naming the first invalid field."""
  for field, allowed in _CHOICES.items():
    _require(_get(c, field) in allowed, field, f"{_get(c, field)!r} is not one of {list(allowed)}")
  m, a, d, o, t = c.model, c.model.attention, c.data, c.optim, c.train
  for f in ("d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff"):
    _require(m[f] > 0, f"model.{f}", f"must be > 0, got {m[f]}")
  _require(m.vocab_size >= 0, "model.vocab_size", "must be >= 0 (0 = the tokenizer's)")
  _require(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads",
           f"{m.num_kv_heads} must divide model.num_heads={m.num_heads}")
  head_dim = m.head_dim or m.d_model // m.num_heads
  _require(m.head_dim > 0 or m.d_model % m.num_heads == 0, "model.num_heads",
           f"{m.num_heads} must divide model.d_model={m.d_model} (or set model.head_dim)")
  _require(head_dim % 2 == 0, "model.head_dim", f"must be even for RoPE, got {head_dim}")
  _require(m.rope_theta > 0, "model.rope_theta", f"must be > 0, got {m.rope_theta}")
  try:
    attn_lib.parse_pattern(a.pattern, m.num_layers)
  except ValueError as e:
    raise ConfigError(f"config field {e}") from None
  _require(a.temperature > 0, "model.attention.temperature", f"must be > 0, got {a.temperature}")
  _require(0 < a.tau_min < a.tau_max, "model.attention.tau_min",
           f"need 0 < tau_min < tau_max, got tau_min={a.tau_min}, tau_max={a.tau_max}")
  _require(a.tau_min <= a.tau_init <= a.tau_max, "model.attention.tau_init",
           f"{a.tau_init} must lie in [tau_min, tau_max] = [{a.tau_min}, {a.tau_max}] or w_τ "
           "starts clipped and never learns")
  _require(a.eps > 0, "model.attention.eps", f"must be > 0, got {a.eps}")
  if (rows := a.get("checkpoint_rows")) is not None:   # None: the kernels' default
    try:
      ops.check_checkpoint_rows(rows, "model.attention.checkpoint_rows")
    except ValueError as e:
      raise ConfigError(f"config field {e}") from None
  _require(d.seq_len > 0, "data.seq_len", f"must be > 0, got {d.seq_len}")
  if a.implementation == "pallas":
    _require(d.seq_len % 64 == 0, "data.seq_len",
             f"{d.seq_len} must be divisible by the Pallas kernels' 64-token blocks")
  _require(d.global_batch > 0, "data.global_batch", f"must be > 0, got {d.global_batch}")
  _require(0 <= d.get("retrieval_mix", 0.0) < 1, "data.retrieval_mix",
           f"must be in [0, 1), got {d.get('retrieval_mix')}")
  shards = d.shards or process_count
  _require(d.shards >= 0 and shards % process_count == 0 and d.global_batch % shards == 0,
           "data.shards", f"{d.shards} must be 0 or a multiple of the {process_count} processes "
           f"dividing data.global_batch={d.global_batch}")
  _require(o.grad_accum > 0 and d.global_batch % (o.grad_accum * process_count) == 0,
           "optim.grad_accum", f"data.global_batch={d.global_batch} must be divisible by "
           f"grad_accum={o.grad_accum} x {process_count} processes")
  _require(o.peak_lr > 0, "optim.peak_lr", f"must be > 0, got {o.peak_lr}")
  _require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
  _require(0 <= o.warmup_steps <= t.steps, "optim.warmup_steps",
           f"must be in [0, train.steps={t.steps}], got {o.warmup_steps}")
  _require(o.get("schedule_steps", 0) == 0 or o.schedule_steps > o.warmup_steps,
           "optim.schedule_steps", f"must be 0 (train.steps) or > optim.warmup_steps="
           f"{o.warmup_steps}, got {o.get('schedule_steps')}")
  _require(o.clip_norm > 0, "optim.clip_norm", f"must be > 0, got {o.clip_norm}")
  for item in filter(None, o.no_decay.split(",")):
    _require(item in _NO_DECAY, "optim.no_decay", f"{item!r} is not one of {list(_NO_DECAY)}")
  _require(t.steps > 0, "train.steps", f"must be > 0, got {t.steps}")
  for f in ("log_every", "ckpt_every", "keep_ckpts"):
    _require(t[f] > 0, f"train.{f}", f"must be > 0, got {t[f]}")
  _require(t.eval_every >= 0, "train.eval_every", f"must be >= 0, got {t.eval_every}")
  sizes = [c.mesh.data, c.mesh.fsdp, c.mesh.tensor]
  _require(all(s == -1 or s > 0 for s in sizes) and sizes.count(-1) <= 1, "mesh",
           f"data/fsdp/tensor must be positive with at most one -1, got {sizes}")
  if c.mesh.tensor > 1:
    _require(m.num_kv_heads % c.mesh.tensor == 0, "mesh.tensor",
             f"{c.mesh.tensor} must divide model.num_kv_heads={m.num_kv_heads}")
  if vocab_size is not None and m.vocab_size:
    _require(m.vocab_size >= vocab_size, "model.vocab_size",
             f"{m.vocab_size} is smaller than the tokenizer's {vocab_size}")


def model_config(c: ml_collections.ConfigDict, vocab_size: int) -> model_lib.ModelConfig:
  """Frozen ModelConfig; vocab_size is the tokenizer's, padded to a multiple of 128 unless set."""
  m, a = c.model, c.model.attention
  vocab = m.vocab_size or -(-vocab_size // 128) * 128   # padded: matmul-friendly shapes
  return model_lib.ModelConfig(
      vocab_size=vocab, d_model=m.d_model, num_layers=m.num_layers, num_heads=m.num_heads,
      num_kv_heads=m.num_kv_heads, head_dim=m.head_dim or m.d_model // m.num_heads,
      d_ff=m.d_ff, max_seq_len=c.data.seq_len, tie_embeddings=m.tie_embeddings,
      qk_norm=m.qk_norm, rope_theta=m.rope_theta, norm_eps=m.norm_eps, remat=m.remat,
      remat_policy=m.get("remat_policy", "nothing"),
      fuse_matmuls=m.fuse_matmuls, norm_backward=m.get("norm_backward", "explicit"),
      qk_rope_backward=m.get("qk_rope_backward", "separate"),
      mlp_backward=m.get("mlp_backward", "autodiff"), add_norm=m.get("add_norm", "separate"),
      attention=attn_lib.AttentionConfig(
          layers=attn_lib.parse_pattern(a.pattern, m.num_layers),
          implementation=a.implementation, temperature=a.temperature, learned=a.learned,
          tau_min=a.tau_min, tau_max=a.tau_max, tau_init=a.tau_init,
          tau_mean=attn_lib.TauMean(a.tau_mean), eps=a.eps,
          checkpoint_rows=a.get("checkpoint_rows")))


def optim_config(c: ml_collections.ConfigDict):
  from focaljax.train import optim  # pylint: disable=import-outside-toplevel
  o = c.optim
  return optim.OptimConfig(
      peak_lr=o.peak_lr, warmup_steps=o.warmup_steps,
      total_steps=o.get("schedule_steps", 0) or c.train.steps,
      min_lr_ratio=o.min_lr_ratio, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay,
      no_decay=tuple(filter(None, o.no_decay.split(","))), clip_norm=o.clip_norm,
      mu_dtype=o.get("mu_dtype", "float32"))


def data_config(c: ml_collections.ConfigDict):
  from focaljax.data import pipeline as data  # pylint: disable=import-outside-toplevel
  d = c.data
  return data.DataConfig(source=d.source, valid_source=d.valid_source or None,
                         tokenizer=d.tokenizer, seq_len=d.seq_len, global_batch=d.global_batch,
                         seed=c.seed, shuffle=d.shuffle,
                         # Workdirs written before these fields existed still evaluate and resume.
                         tokenize=d.get("tokenize", "stream"),
                         token_cache=d.get("token_cache") or None,
                         retrieval_mix=d.get("retrieval_mix", 0.0))
