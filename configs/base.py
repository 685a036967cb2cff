"""The default: a tiny LLaMA-style model on the bundled public-domain text, a few minutes on CPU.

  python train.py                                   # this config, workdir ./runs/default
  python train.py --config configs/base.py:size=400m --config.model.attention.pattern=focal
  python train.py --config configs/focal.py --config.model.attention.temperature=0.3

`arg` is "key=value,..." with keys `size` (a preset in configs/sizes.py) and `pattern`.
Every field below is overridable on the command line; `focaljax.config.validate` refuses unknown
keys, wrong types and invalid values, naming the field, before anything compiles.
"""

import ml_collections

from configs import sizes


def parse_arg(arg: str | None, **defaults) -> dict:
  """"size=small,pattern=softmax:rope,dilution:none" -> dict; a part without "=" continues the
  previous value (patterns contain commas)."""
  out, key = dict(defaults), None
  for part in filter(None, (arg or "").split(",")):
    name, sep, value = part.partition("=")
    if sep and name in defaults:
      key, out[key] = name, value
    elif key is not None and not sep:
      out[key] += "," + part
    else:
      raise ValueError(f"config arg {part!r}: expected key=value with key in {sorted(defaults)}")
  return out


def preset(arg: str | None, pattern: str) -> ml_collections.ConfigDict:
  """get_config(arg) with the attention pattern a preset file fixes; its arg takes size= only."""
  if parse_arg(arg, size="tiny", pattern="")["pattern"]:
    raise ValueError(f"config arg pattern: this preset trains {pattern!r}; for another pattern "
                     "use configs/base.py:pattern=... or --config.model.attention.pattern=...")
  c = get_config(arg)
  c.model.attention.pattern = pattern
  return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = parse_arg(arg, size="tiny", pattern="softmax:rope")
  c = ml_collections.ConfigDict()
  c.seed = 0                     # parameter init and data order
  c.model = ml_collections.ConfigDict(dict(
      vocab_size=0,              # 0: the tokenizer's vocabulary size
      d_model=128,
      num_layers=4,
      num_heads=4,
      num_kv_heads=4,            # < num_heads: grouped-query attention
      head_dim=0,                # 0: d_model // num_heads
      d_ff=384,                  # SwiGLU hidden width
      tie_embeddings=True,
      qk_norm=False,             # RMSNorm on q and k per head (the focal paper's baseline)
      qkv_bias=False,            # biases on the q, k, v projections (Qwen2)
      sliding_window=0,          # > 0: query t sees keys t-W < s <= t (Mistral); 0: all s <= t
      rope_theta=10000.0,
      # Llama 3 RoPE frequency scaling (rope_type "llama3"); original_max_position_embeddings=0: off
      rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=0),
      norm_eps=1e-5,
      # Memory for compute: recompute each block in the backward, keeping what remat_policy
      # names (nothing | dots | dots_no_batch: focaljax.model.decoder.REMAT_POLICIES).
      remat=False,
      remat_policy="nothing",
  ))
  c.model.attention = ml_collections.ConfigDict(dict(
      # Per-layer "variant[:position]" list, cycled over the layers. variant: softmax | focal |
      # dilution; position: rope | none (default rope, none for dilution).
      # e.g. "softmax:rope,dilution:none" is the alternating hybrid.
      pattern=args["pattern"],
      # auto (the fastest per platform, focaljax/dispatch.py) | xla (the reference) | pallas |
      # cudnn | tokamax
      implementation="auto",
      temperature=0.4,           # focal constant: softmax(q·k / (t·√d)); t > 0
      learned=False,             # focal learned: τ = clip(mean(X·w_τ) + tau_init, tau_min, tau_max)
      tau_min=0.0,               # 0: the paper's 5 (10, 7.5) at head dim 128, times √(d/128)
      tau_max=0.0,
      tau_init=0.0,              # starts τ inside the clip range, so w_τ gets gradient at init
      tau_mean="causal",         # causal | token | sequence (see focaljax.model.attention.TauMean)
      eps=1e-9,                  # dilution ε
      # dilution, Pallas: rows between the demand checkpoints the backward keeps (power of two
      # >= 64; ceil(T/R)·T·4 bytes per row and head). 64 spares the Hopper backward rebuilding
      # its carries, for memory that grows as T²/64.
      checkpoint_rows=1024,
  ))
  c.data = ml_collections.ConfigDict(dict(
      source="bundled",          # bundled | text:<glob> | tfds:<name>[:split]
      valid_source="",           # "" : held out from `source`; or another source string
      jsonl_field="text",        # the document field of .jsonl lines
      tfds_data_dir="",          # where tfds: sources live ("": TFDS's default, $TFDS_DATA_DIR)
      # bundled | train:<vocab size>[:digits|:llama_digits] | path/to/tokenizer.json
      tokenizer="bundled",
      seq_len=128,               # trained context (tokens per packed row)
      global_batch=16,           # rows per optimizer step, across all hosts
      shuffle=True,
      # auto: the whole split up front (ahead) for in-memory sources, per document (stream) for TFDS
      tokenize="auto",           # auto | ahead | stream
      token_cache="",            # with ahead/auto: a directory that keeps tokenized splits for reuse
      shards=0,                  # data shards (0: one per process); fix it to compare host counts
      retrieval_mix=0.0,         # share of train rows turned into passkey drills (data.py)
  ))
  c.optim = ml_collections.ConfigDict(dict(
      peak_lr=3e-3,
      warmup_steps=30,           # linear warmup, then cosine decay to min_lr_ratio · peak_lr
      schedule_steps=0,          # the cosine's length (0: train.steps); longer leaves the run at
                                 # a higher rate, for stages that resume it (MaxText's
                                 # learning_rate_schedule_steps)
      min_lr_ratio=0.1,
      b1=0.9,
      b2=0.95,
      weight_decay=0.05,
      no_decay="norm,embed",     # comma list: norm (RMSNorm gains), embed (embeddings, lm_head)
      clip_norm=1.0,             # global-norm gradient clipping
      mu_dtype="float32",        # AdamW first moment: float32 | bfloat16 (less optimizer traffic)
  ))
  c.train = ml_collections.ConfigDict(dict(
      steps=250,
      compute_dtype="float32",   # float32 | bfloat16 (master weights stay float32)
      # Rows per device per micro-batch; the step accumulates gradients over the rest of the
      # device's share of data.global_batch. 0: the largest divisor that fits the device.
      micro_batch=0,
      log_every=10,
      eval_every=125,            # validation loss every N steps (0: never)
      eval_batches=4,
      ckpt_every=125,            # Orbax checkpoint every N steps (and at the end, and on SIGTERM)
      keep_ckpts=2,
      async_ckpt=True,
      nonfinite="stop",          # stop | skip: what a NaN/Inf loss does
      wandb_project="",          # also log metrics to this W&B project ("": off; pip install wandb)
      # A fresh run starts from these params, not random ones (fine-tuning; configs/finetune.py):
      # a workdir (its latest step) or one of its checkpoints/<step>, e.g. an HF import.
      init_from="",
  ))
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))  # one may be -1
  sizes.apply(c, args["size"])
  return c
