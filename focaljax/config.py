"""The ConfigDict boundary: validation, and conversion to the frozen dataclasses the library takes.

`parse` validates a ConfigDict once, before anything is built or compiled, and returns `Config`
(ModelConfig, DataConfig, OptimConfig, TrainConfig, MeshConfig, FocusTrainConfig). Every error is
one line naming the field and what it allows; nothing is silently corrected. Past this module no
code reads a ConfigDict. A workdir's saved config.json reaches it through
`focaljax.train.saved_config`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import ml_collections

from focaljax import dispatch
from focaljax.model import attention as attn_lib
from focaljax.model import decoder as model_lib

# Fields checked on their own: the choices a field allows, or the interval (in _INTERVALS) it
# must lie in. validate and focus_config check the rest, which relate fields to each other.
_INTERVALS = {"> 0": lambda x: x > 0, ">= 0": lambda x: x >= 0, ">= 1": lambda x: x >= 1,
              "in [0, 1)": lambda x: 0 <= x < 1, "in [0, 1]": lambda x: 0 <= x <= 1,
              "in [0, 2**32)": lambda x: 0 <= x < 2**32}   # the seed: Grain's range
_FIELDS = {
    "model.attention.implementation": dispatch.IMPLEMENTATIONS,
    "model.attention.tau_mean": tuple(m.value for m in attn_lib.TauMean),
    "model.remat_policy": tuple(model_lib.REMAT_POLICIES),
    "optim.mu_dtype": ("float32", "bfloat16"),
    "train.compute_dtype": ("float32", "bfloat16"),
    "train.nonfinite": ("stop", "skip"),
    # train.steps before the fields bound by it, num_kv_heads before what divides by it
    **dict.fromkeys(("model.d_model", "model.num_layers", "model.num_heads", "model.num_kv_heads",
                     "model.d_ff", "model.rope_theta", "model.attention.temperature",
                     "model.attention.eps", "data.seq_len", "data.global_batch", "optim.peak_lr",
                     "optim.clip_norm", "train.steps", "train.log_every", "train.ckpt_every",
                     "train.keep_ckpts"), "> 0"),
    "data.retrieval_mix": "in [0, 1)",
    "optim.min_lr_ratio": "in [0, 1]",
    "optim.b1": "in [0, 1)",
    "optim.b2": "in [0, 1)",
    "optim.weight_decay": ">= 0",
    "model.norm_eps": "> 0",
    "model.head_dim": ">= 0",
    "train.eval_every": ">= 0",
    "train.eval_batches": ">= 1",
    "seed": "in [0, 2**32)",
}
_NO_DECAY = ("norm", "embed")
_ROPE_SCALING = {"factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings"}
# Learned τ: the focal paper's clip range and start at head dim 128, t = τ/√128 in [0.44, 0.88].
_PAPER_TAU = {"tau_min": 5.0, "tau_max": 10.0, "tau_init": 7.5}


class ConfigError(ValueError):
  """A config field has an invalid value; the message names it."""


def _get(c, dotted):
  for part in dotted.split("."):
    c = c[part]
  return c


def _require(ok: bool, field: str, msg: str):
  if not ok:
    raise ConfigError(f"config field {field}: {msg}")


def _check_fields(c, fields: dict) -> None:
  for field, allowed in fields.items():
    value = _get(c, field)
    if isinstance(allowed, str):
      number = (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
      _require(number, field, f"must be a finite number {allowed}, got {value!r}")
      _require(_INTERVALS[allowed](value), field, f"must be {allowed}, got {value}")
    else:
      _require(value in allowed, field, f"{value!r} is not one of {list(allowed)}")


def validate(c: ml_collections.ConfigDict, *, process_count: int = 1) -> None:
  """Raises ConfigError naming the first invalid field (focus.* apart: `focus_config`)."""
  _check_fields(c, _FIELDS)
  m, a, d, o, t = c.model, c.model.attention, c.data, c.optim, c.train
  _require(m.vocab_size >= 0, "model.vocab_size", "must be >= 0 (0 = the tokenizer's)")
  _require(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads",
           f"{m.num_kv_heads} must divide model.num_heads={m.num_heads}")
  head_dim = m.head_dim or m.d_model // m.num_heads
  _require(m.head_dim > 0 or m.d_model % m.num_heads == 0, "model.num_heads",
           f"{m.num_heads} must divide model.d_model={m.d_model} (or set model.head_dim)")
  rs = m.rope_scaling
  _require(set(rs.keys()) == _ROPE_SCALING, "model.rope_scaling",
           f"needs exactly the fields {sorted(_ROPE_SCALING)}, got {sorted(rs.keys())} (set one "
           "with --config.model.rope_scaling.<field>=...)")
  _require(rs.original_max_position_embeddings >= 0,
           "model.rope_scaling.original_max_position_embeddings",
           f"must be >= 0 (0: no Llama 3 scaling), got {rs.original_max_position_embeddings}")
  if rs.original_max_position_embeddings:
    _require(rs.factor >= 1 and 0 < rs.low_freq_factor < rs.high_freq_factor, "model.rope_scaling",
             f"need factor >= 1 and 0 < low_freq_factor < high_freq_factor, got {rs.to_dict()}")
  _require(isinstance(m.sliding_window, int) and m.sliding_window >= 0, "model.sliding_window",
           f"must be 0 (none) or a window of keys > 0, got {m.sliding_window!r}")
  try:
    layers = attn_lib.parse_pattern(a.pattern, m.num_layers)
  except ValueError as e:
    raise ConfigError(f"config field {e}") from None
  if any(s.position is attn_lib.Position.ROPE for s in layers):
    _require(head_dim % 2 == 0, "model.head_dim", f"must be even for RoPE, got {head_dim}")
  if m.sliding_window:
    _require(all(attn_lib.FAMILY[s.variant].window for s in layers), "model.sliding_window",
             f"{m.sliding_window} needs softmax/focal layers: dilution's demand spans the prefix")
  _require(not a.learned or any(s.variant is attn_lib.Variant.FOCAL for s in layers),
           "model.attention.learned", f"True, but model.attention.pattern={a.pattern!r} has no "
           "focal layer to learn τ for (e.g. --config configs/focal_learned.py)")
  tau = tau_range(a, head_dim)
  for name, value in tau.items():
    _require(0 < value < math.inf, f"model.attention.{name}",
             f"must be finite and > 0 (0: the paper's, scaled to head dim {head_dim}), got "
             f"{a[name]}")
  _require(tau["tau_min"] < tau["tau_max"], "model.attention.tau_min",
           f"need tau_min < tau_max, got {tau['tau_min']:g} and {tau['tau_max']:g} at head dim "
           f"{head_dim}")
  _require(tau["tau_min"] <= tau["tau_init"] <= tau["tau_max"], "model.attention.tau_init",
           f"{tau['tau_init']:g} must lie in [tau_min, tau_max] = [{tau['tau_min']:g}, "
           f"{tau['tau_max']:g}] or w_τ starts clipped and never learns")
  _require("://" in d.token_cache or not os.path.isfile(d.token_cache), "data.token_cache",
           f"{d.token_cache} is a file; give a directory (created if missing)")
  _require(a.implementation != "cudnn" or t.compute_dtype == "bfloat16",
           "model.attention.implementation", "'cudnn' takes 16-bit q, k, v: it needs "
           "train.compute_dtype='bfloat16' ('auto' sends float32 to the Pallas kernel)")
  rows = a.checkpoint_rows
  _require(isinstance(rows, int) and rows >= 64 and not rows & (rows - 1),
           "model.attention.checkpoint_rows",
           f"must be a power of two >= 64 (the kernels' row tile); got {rows!r}")
  if a.implementation == "pallas":
    _require(d.seq_len % 64 == 0, "data.seq_len",
             f"{d.seq_len} must be divisible by the Pallas kernels' 64-token blocks")
  shards = d.shards or process_count
  _require(d.shards >= 0 and shards % process_count == 0 and d.global_batch % shards == 0,
           "data.shards", f"{d.shards} must be 0 or a multiple of the {process_count} processes "
           f"dividing data.global_batch={d.global_batch}")
  _require(isinstance(t.micro_batch, int) and t.micro_batch >= 0, "train.micro_batch",
           f"must be 0 (auto: the largest that fits) or rows per device, got {t.micro_batch!r}")
  _require(0 <= o.warmup_steps <= t.steps, "optim.warmup_steps",
           f"must be in [0, train.steps={t.steps}], got {o.warmup_steps}")
  _require(o.schedule_steps == 0 or o.schedule_steps > o.warmup_steps, "optim.schedule_steps",
           f"must be 0 (train.steps) or > optim.warmup_steps={o.warmup_steps}, got "
           f"{o.schedule_steps}")
  for item in filter(None, o.no_decay.split(",")):
    _require(item in _NO_DECAY, "optim.no_decay", f"{item!r} is not one of {list(_NO_DECAY)}")
  _require(not t.wandb_project or importlib.util.find_spec("wandb") is not None,
           "train.wandb_project", "needs wandb: pip install 'focaljax[wandb]' (or leave it empty)")
  sizes = [c.mesh.data, c.mesh.fsdp, c.mesh.tensor]
  _require(all(s == -1 or s > 0 for s in sizes) and sizes.count(-1) <= 1, "mesh",
           f"data/fsdp/tensor must be positive with at most one -1, got {sizes}")
  if c.mesh.tensor > 1 and "focus" not in c:   # FocusLLM: the base's heads, checked on load
    _require(m.num_kv_heads % c.mesh.tensor == 0, "mesh.tensor",
             f"{c.mesh.tensor} must divide model.num_kv_heads={m.num_kv_heads}")


def tau_range(a: ml_collections.ConfigDict, head_dim: int) -> dict:
  """tau_min, tau_max, tau_init, each 0 replaced by the paper's value scaled by √(head_dim/128):
  τ replaces t·√d, so every head dim gets the paper's t in [0.44, 0.88] (at d = 32, [5, 10]
  would be t in [0.88, 1.77], softer than softmax)."""
  return {k: a[k] or v * (head_dim / 128) ** 0.5 for k, v in _PAPER_TAU.items()}


def padded_vocab(vocab_size: int) -> int:
  """The tokenizer's vocabulary rounded up to a multiple of 128: matmul-friendly shapes."""
  return -(-vocab_size // 128) * 128


def _frozen(cls, section: ml_collections.ConfigDict, **computed):
  """A `cls` of the `section` fields named like its own, and `computed` (the rest, or values
  the ConfigDict spells differently); fields in neither take the dataclass's default."""
  names = {f.name for f in dataclasses.fields(cls)} & set(section.keys())
  return cls(**{**{name: section[name] for name in names}, **computed})


def model_config(c: ml_collections.ConfigDict, vocab_size: int) -> model_lib.ModelConfig:
  """Frozen ModelConfig; vocab_size is the tokenizer's, padded to a multiple of 128 unless set."""
  m, a = c.model, c.model.attention
  head_dim = m.head_dim or m.d_model // m.num_heads
  attention = _frozen(attn_lib.AttentionConfig, a, **tau_range(a, head_dim),
                      layers=attn_lib.parse_pattern(a.pattern, m.num_layers),
                      tau_mean=attn_lib.TauMean(a.tau_mean),
                      sliding_window=m.sliding_window or None)
  return _frozen(model_lib.ModelConfig, m, attention=attention,
                 vocab_size=m.vocab_size or padded_vocab(vocab_size),
                 head_dim=head_dim, max_seq_len=c.data.seq_len,
                 rope_scaling=(model_lib.Llama3Scaling(**m.rope_scaling.to_dict())
                               if m.rope_scaling.original_max_position_embeddings else None))


def optim_config(c: ml_collections.ConfigDict):
  from focaljax.train import optim  # pylint: disable=import-outside-toplevel
  return _frozen(optim.OptimConfig, c.optim, total_steps=c.optim.schedule_steps or c.train.steps,
                 no_decay=tuple(filter(None, c.optim.no_decay.split(","))))


def data_config(c: ml_collections.ConfigDict):
  from focaljax.data import pipeline as data  # pylint: disable=import-outside-toplevel
  d = c.data
  try:
    return _frozen(data.DataConfig, d, seed=c.seed, valid_source=d.valid_source or None,
                   token_cache=d.token_cache or None,
                   tfds_data_dir=d.tfds_data_dir or None)
  except ValueError as e:
    raise ConfigError(f"config field {str(e).replace('DataConfig.', 'data.')}") from None


# ------------------------------------------------------------ the frozen config a run is built from


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int
  compute_dtype: str      # float32 | bfloat16: the step's dtype; master weights stay float32
  micro_batch: int        # rows per device per micro-batch (0: the largest that fits)
  skip_nonfinite: bool    # train.nonfinite == "skip": a NaN/Inf step leaves the state as it was
  log_every: int
  eval_every: int         # validation loss every N steps (0: never)
  eval_batches: int
  ckpt_every: int
  keep_ckpts: int
  async_ckpt: bool
  wandb_project: str      # W&B project the metrics also go to ("": off)
  init_from: str          # absolute: the params a fresh run starts from ("": random; a workdir
                          # or one of its checkpoints/<step>, e.g. an HF import)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int               # one of the three may be -1: the devices left
  fsdp: int
  tensor: int


@dataclasses.dataclass(frozen=True)
class FocusTrainConfig:
  """focus.*: a FocusLLM adapter run (configs/focus.py says what each field does)."""
  base_workdir: str                 # absolute: a workdir or one of its checkpoints/<step>
  context: int                      # the base's trained context (its data.seq_len)
  chunk_sizes: tuple[int, ...]
  prompt_len: int
  eval_prompt_len: int              # 0: prompt_len
  p_reconstruction: float
  doc_min_tokens: int
  doc_max_tokens: int
  memory_tokens: tuple[int, ...]    # memory lengths, before rounding down to whole chunks
  local_len: int
  num_targets: int
  retrieval_mix: float
  implementation: str
  candidate_path: str


@dataclasses.dataclass(frozen=True)
class Config:
  """A run's whole config, validated; `parse` builds it and is the only reader of a ConfigDict."""
  seed: int
  model: model_lib.ModelConfig      # vocab_size 0 until `with_vocab`: the tokenizer's
  data: object                      # focaljax.data.pipeline.DataConfig
  data_shards: int                  # 0: one per process
  optim: object                     # focaljax.train.optim.OptimConfig
  train: TrainConfig
  mesh: MeshConfig
  focus: FocusTrainConfig | None    # None: the language model itself trains
  config_json: str                  # the ConfigDict as WORKDIR/config.json keeps it

  def with_vocab(self, vocab_size: int) -> "Config":
    """model.vocab_size resolved against the tokenizer's `vocab_size` (0: it, padded)."""
    m = self.model
    _require(not m.vocab_size or m.vocab_size >= vocab_size, "model.vocab_size",
             f"{m.vocab_size} is smaller than the tokenizer's {vocab_size}")
    return dataclasses.replace(self, model=dataclasses.replace(
        m, vocab_size=m.vocab_size or padded_vocab(vocab_size)))


def parse(c: ml_collections.ConfigDict, *, process_count: int = 1,
          focus_context: int | None = None) -> Config:
  """`c` validated once and frozen. focus.* is checked against the base's trained context,
  read from focus.base_workdir unless `focus_context` gives it."""
  validate(c, process_count=process_count)
  from focaljax.train import checkpoint  # pylint: disable=import-outside-toplevel
  init = c.train.init_from   # checked by a fresh run alone (train/lm.py): eval and export skip it
  train = _frozen(TrainConfig, c.train, skip_nonfinite=c.train.nonfinite == "skip",
                  init_from=init and checkpoint.absolute(init))
  return Config(seed=c.seed, model=model_config(c, 0), data=data_config(c),
                data_shards=c.data.shards, optim=optim_config(c), train=train,
                mesh=MeshConfig(c.mesh.data, c.mesh.fsdp, c.mesh.tensor),
                focus=focus_config(c, focus_context) if "focus" in c else None,
                config_json=c.to_json_best_effort(indent=2))


def _int_list(f, name: str) -> tuple[int, ...]:
  try:
    values = tuple(int(s) for s in f[name].split(","))
  except ValueError:
    values = ()
  _require(bool(values) and min(values) >= 1, f"focus.{name}",
           f"{f[name]!r} must be a comma list of positive ints")
  return values


def checkpointed(path: str, field: str) -> tuple[str, int | None]:
  """(workdir, step or None: the latest) of `path`, a workdir holding a checkpoint or one of its
  checkpoints/<step>."""
  from focaljax.train import checkpoint  # pylint: disable=import-outside-toplevel
  try:
    workdir, step = checkpoint.resolve(path)
  except FileNotFoundError as e:
    raise ConfigError(f"config field {field}: {e}") from None
  _require(step is not None or checkpoint.latest_step(workdir) is not None, field,
           f"{workdir} has no checkpoint under checkpoints/ (train it first)")
  return workdir, step


def _base_context(path: str) -> int:
  """The trained context (data.seq_len) of the base workdir `path`, which must hold a checkpoint."""
  from focaljax.train import saved_config  # pylint: disable=import-outside-toplevel
  _require(bool(path), "focus.base_workdir",
           "is required: a trained focaljax workdir (python train.py ...)")
  workdir = checkpointed(path, "focus.base_workdir")[0]
  base = saved_config.read(workdir)
  _require("focus" not in base, "focus.base_workdir",
           f"{workdir} is a FocusLLM adapter run, not a base language model")
  from focaljax.focus import model as candidates  # pylint: disable=import-outside-toplevel
  try:
    candidates.check_base(model_config(base, 0))
  except (ValueError, NotImplementedError) as e:   # a bad saved pattern, or an unreadable base
    raise ConfigError(f"config field focus.base_workdir: {workdir}: {e}") from None
  return base.data.seq_len


def focus_config(c: ml_collections.ConfigDict, context: int | None = None) -> FocusTrainConfig:
  """focus.*, checked against the base's trained context `context` (default: read from
  focus.base_workdir). Every position a step uses must stay below it."""
  from focaljax.focus import model as candidates  # pylint: disable=import-outside-toplevel
  from focaljax.train import checkpoint  # pylint: disable=import-outside-toplevel
  f = c.focus
  if context is None:
    context = _base_context(f.base_workdir)
  _check_fields(c, {"focus.implementation": candidates.IMPLEMENTATIONS,
                    "focus.candidate_path": tuple(candidates.CANDIDATE_PATHS),
                    "focus.prompt_len": ">= 1",
                    "focus.doc_min_tokens": ">= 1", "focus.retrieval_mix": "in [0, 1)",
                    "focus.p_reconstruction": "in [0, 1]"})
  _require(c.train.eval_every == 0, "train.eval_every",
           f"FocusLLM runs have no validation loop: set 0, got {c.train.eval_every}")
  _require(f.doc_max_tokens >= f.doc_min_tokens, "focus.doc_max_tokens",
           f"{f.doc_max_tokens} < focus.doc_min_tokens={f.doc_min_tokens}")
  _require(2 <= f.local_len <= context, "focus.local_len",
           f"{f.local_len} must be in [2, {context}] (the base's trained context data.seq_len)")
  Q = f.num_targets
  _require(1 <= Q <= f.local_len, "focus.num_targets",
           f"{Q} must be in [1, focus.local_len={f.local_len}]")
  _require(f.eval_prompt_len >= 0, "focus.eval_prompt_len",
           f"must be >= 0 (0: focus.prompt_len), got {f.eval_prompt_len}")
  sizes = _int_list(f, "chunk_sizes")
  memories = (_int_list(f, "memory_tokens") if f.memory_tokens
              else (f.doc_min_tokens - f.local_len - 1,))
  memory_field = "focus.memory_tokens" if f.memory_tokens else "focus.doc_min_tokens"
  for s in sizes:
    # Chunk positions: chunk + dynamic prompt + the Q - 1 later query points (served: the answer).
    prompt = min(f.prompt_len, s, f.local_len - Q + 1)
    _require(s + prompt + Q - 1 <= context, "focus.chunk_sizes",
             f"chunk {s} + dynamic prompt {prompt} + num_targets-1 ({Q - 1}) = "
             f"{s + prompt + Q - 1} positions exceed the base's trained context "
             f"data.seq_len={context}; use chunks <= {context - prompt - Q + 1} or lower "
             "focus.prompt_len")
    # eval.py serves eval_prompt_len (0: prompt_len) whole, not cut to the window's targets.
    served = min(f.eval_prompt_len or f.prompt_len, s, f.local_len)
    _require(s + served + Q - 1 <= context, "focus.eval_prompt_len",
             f"chunk {s} + served dynamic prompt {served} + num_targets-1 ({Q - 1}) exceeds the "
             f"base's trained context data.seq_len={context}; set it to <= "
             f"{context - s - Q + 1} (0 serves focus.prompt_len={f.prompt_len})")
    for m in memories:
      _require(m <= f.doc_min_tokens - f.local_len - 1, "focus.memory_tokens",
               f"{m} + local_len + 1 ({f.local_len + 1}) exceeds focus.doc_min_tokens="
               f"{f.doc_min_tokens}, the shortest document drawn")
      M = s * (m // s)   # whole chunks (focus/train.py)
      need = max(s, f.local_len + 1) if f.p_reconstruction else s
      _require(M >= need, memory_field,
               f"leaves a memory of {M} tokens for chunk {s}; need >= {need} (one chunk" +
               (", and room for a reconstruction span)" if f.p_reconstruction else ")"))
      # The local decoder puts the C candidates at positions 0..C-1, the window after them.
      _require(M // s + f.local_len <= context, memory_field,
               f"{M // s} candidates (chunk {s}, memory {M}) + focus.local_len={f.local_len} "
               f"exceed the base's data.seq_len={context}; use larger chunks or shorter memories")
  return _frozen(FocusTrainConfig, f, context=context, chunk_sizes=sizes, memory_tokens=memories,
                 base_workdir=checkpoint.absolute(f.base_workdir) if f.base_workdir else "")
