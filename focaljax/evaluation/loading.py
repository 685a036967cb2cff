"""`load(path)`: a trained model, its tokenizer and config, ready for logits and generation.

`path` is a training workdir (latest checkpoint) or one of its `checkpoints/<step>` directories.
Only the params are restored (no optimizer state, no data iterator), onto the first local device.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from focaljax.train import checkpoint
from focaljax import config as config_lib
from focaljax.evaluation import generate as gen_lib
from focaljax.model import decoder as model_lib
from focaljax.data import tokenizer as tokenizer_lib


@dataclasses.dataclass
class LoadedModel:
  model: model_lib.Transformer
  tokenizer: tokenizer_lib.Tokenizer
  config: model_lib.ModelConfig
  run: config_lib.Config   # the workdir's whole config (config.json), vocabulary resolved
  workdir: str
  step: int

  @property
  def trained_len(self) -> int:
    return self.config.max_seq_len

  def logits(self, tokens) -> jax.Array:
    """int32 [B, T] (or [T]) -> float32 [B, T, V]; RoPE layers NTK-scale when T > trained_len."""
    tokens_BT = jnp.asarray(tokens, jnp.int32)
    if tokens_BT.ndim == 1:
      tokens_BT = tokens_BT[None]
    return gen_lib.logits(self.model, tokens_BT)

  def generate(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, stop_at_eos: bool = True):
    """str -> continuation text; list[int] / [T] -> int32 [T + new]; [B, T] -> int32 [B, T + new].

    Text generation stops at the tokenizer's eos (and cuts it off) unless stop_at_eos=False.
    """
    is_text = isinstance(prompt, str)
    tokens = np.asarray(self.tokenizer.encode(prompt) if is_text else prompt, np.int32)
    if tokens.size == 0:
      raise ValueError("generate: the prompt is empty (it must encode to at least one token)")
    tokens_BT = tokens[None] if tokens.ndim == 1 else tokens
    out_BL = gen_lib.generate(self.model, tokens_BT, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_p=top_p, rng=jax.random.key(seed),
                              eos_id=self.tokenizer.eos_id if stop_at_eos else None)
    out_BL = np.asarray(out_BL)
    if not is_text:
      return out_BL[0] if tokens.ndim == 1 else out_BL
    new = out_BL[0, tokens_BT.shape[1]:].tolist()
    if stop_at_eos and self.tokenizer.eos_id in new:
      new = new[:new.index(self.tokenizer.eos_id)]
    return self.tokenizer.decode(new)


def _tokenizer(workdir: str, run: config_lib.Config) -> tokenizer_lib.Tokenizer:
  if os.path.isfile(os.path.join(workdir, checkpoint.TOKENIZER_FILE)):
    return tokenizer_lib.Tokenizer.load(workdir)
  if run.data.tokenizer == "bundled":
    return tokenizer_lib.bundled()
  raise FileNotFoundError(f"{workdir} has no {checkpoint.TOKENIZER_FILE}, and its config's "
                          f"data.tokenizer={run.data.tokenizer!r} is not 'bundled'")


def load(path: str) -> LoadedModel:
  """A workdir (latest step) or workdir/checkpoints/<step> -> LoadedModel."""
  workdir, step = checkpoint.resolve(path)
  saved = config_lib.read_run_config(workdir)
  if "focus" in saved:
    raise ValueError(f"{workdir} is a FocusLLM adapter run; evaluate it with python eval.py "
                     f"--workdir BASE --focus_adapter {workdir}")
  run = config_lib.parse(saved)
  tok = _tokenizer(workdir, run)
  run = run.with_vocab(tok.vocab_size)
  cfg = run.model
  graphdef, abstract_state = model_lib.abstract_model(cfg)
  abstract_params = checkpoint.abstract_like(nnx.to_pure_dict(abstract_state))
  params, step = checkpoint.restore_params(workdir, step, abstract_params)
  nnx.replace_by_pure_dict(abstract_state, params)
  model = nnx.merge(graphdef, abstract_state)
  return LoadedModel(model=model, tokenizer=tok, config=cfg, run=run, workdir=workdir,
                     step=int(step))
