"""Model size presets: the focal paper's table (appendix), the dilution study's 209M, tiny CPU sizes.

Each preset sets model shape (and a matching learning rate / context); everything else is base.
"""

import ml_collections

# name: (d_model, d_ff, num_heads, num_layers, overrides)
_FOCAL_PAPER = {  # LLaMA-style, QK-norm, 2K context, vocab 32K (their tokenizer is unnamed)
    "400m": (1024, 3072, 8, 24, dict(peak_lr=4e-3)),
    "777m": (1536, 4096, 12, 24, dict(peak_lr=2e-3)),
    "1.3b": (2048, 5504, 16, 24, dict(peak_lr=1e-3)),
    "2.7b": (2560, 6912, 20, 32, dict(peak_lr=5e-4)),
    "6.7b": (4096, 11008, 32, 32, dict(peak_lr=4e-4)),
    "9.5b": (4608, 12288, 36, 36, dict(peak_lr=4e-4)),
}

NAMES = ("tiny", "small", "35m", "100m", "209m", *_FOCAL_PAPER)


def apply(c: ml_collections.ConfigDict, name: str) -> None:
  m = c.model
  if name == "tiny":        # CPU, a few minutes
    return
  if name == "small":       # CPU tests and smoke runs: seconds
    m.update(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=128)
    c.data.update(seq_len=64, global_batch=8)
  elif name == "35m":       # ~35.7M with a 16K vocabulary, ~2.6x fewer FLOPs a token than 100m:
    # a quick FocusLLM base
    m.update(d_model=512, num_layers=8, num_heads=8, num_kv_heads=8, d_ff=1536)
    c.data.update(seq_len=1024, global_batch=64)
    c.optim.update(peak_lr=1e-3, warmup_steps=500)
    c.train.update(steps=10_000, compute_dtype="bfloat16")
  elif name == "100m":      # the study-sized decoder (~100M with a 16K vocabulary)
    m.update(d_model=768, num_layers=12, num_heads=12, num_kv_heads=12, d_ff=2048)
    c.data.update(seq_len=1024, global_batch=64)
    c.optim.update(peak_lr=1e-3, warmup_steps=500)
    c.train.update(steps=10_000, compute_dtype="bfloat16")
  elif name == "209m":      # the dilution study: 24 layers, d=768, 12 heads, vocab 50,304, tied
    m.update(d_model=768, num_layers=24, num_heads=12, num_kv_heads=12, d_ff=2048,
             vocab_size=50304, tie_embeddings=True)
    c.data.update(seq_len=1024, global_batch=64)
    c.optim.update(peak_lr=6e-4, warmup_steps=1000)
    c.train.update(steps=20_000, compute_dtype="bfloat16")
  elif name in _FOCAL_PAPER:
    d, ff, h, layers, opt = _FOCAL_PAPER[name]
    m.update(d_model=d, d_ff=ff, num_heads=h, num_kv_heads=h, num_layers=layers,
             vocab_size=32000, qk_norm=True, tie_embeddings=False)
    c.data.update(seq_len=2048, global_batch=128)   # 0.26M tokens per step
    c.optim.update(warmup_steps=2000, **opt)
    c.train.update(steps=100_000, compute_dtype="bfloat16")
  else:
    raise ValueError(f"config arg size={name!r}: allowed sizes are {NAMES}")
