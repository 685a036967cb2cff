"""`load(path)`: a trained model's params (onto the first local device), tokenizer and config,
from a training workdir (latest checkpoint) or one of its `checkpoints/<step>` directories."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from focaljax.train import checkpoint
from focaljax.train import saved_config
from focaljax import config as config_lib
from focaljax.evaluation import generate as gen_lib
from focaljax.model import decoder as model_lib
from focaljax.data import tokenizer as tokenizer_lib


class NotALanguageModel(ValueError):
  """The workdir holds a FocusLLM adapter run; the message says how to evaluate it."""


def module(model) -> model_lib.Transformer:
  """The Transformer of a LoadedModel, or `model` itself."""
  return getattr(model, "model", model)


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

  def __repr__(self) -> str:   # the module tree and three copies of the config fill a screen
    c = self.config
    n = sum(x.size for x in jax.tree.leaves(nnx.state(self.model, nnx.Param)))
    pattern = json.loads(self.run.config_json)["model"]["attention"]["pattern"]
    return (f"LoadedModel(workdir={self.workdir!r}, step={self.step}, params={n / 1e6:.1f}M, "
            f"layers={c.num_layers} of {pattern}, d_model={c.d_model}, vocab={c.vocab_size}, "
            f"trained_len={c.max_seq_len})")

  def _ids(self, tokens) -> np.ndarray:
    """Token ids as int32, [T] or [B, T]; anything but integers in [0, vocab) is refused (the
    embedding lookup would clamp them silently)."""
    if isinstance(tokens, (list, tuple)) and any(isinstance(t, str) for t in tokens):
      raise ValueError("a prompt is one string or token ids; for several texts, call once each")
    try:
      ids = np.asarray(tokens)
    except ValueError:   # rows of different lengths
      raise ValueError("token ids must be [T] or [B, T] with rows of one length") from None
    if ids.size == 0:
      raise ValueError("token ids: the input is empty")
    if ids.ndim not in (1, 2):
      raise ValueError(f"token ids must be [T] or [B, T]; got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"token ids must be integers, got {ids.dtype}")
    vocab = self.config.vocab_size
    if ids.min() < 0 or ids.max() >= vocab:
      raise ValueError(f"token ids must lie in [0, {vocab}), the model's vocabulary; got "
                       f"{ids.min()}..{ids.max()}")
    return ids.astype(np.int32)

  def logits(self, tokens) -> jax.Array:
    """int32 [B, T] (or [T]) -> float32 [B, T, V]; RoPE layers NTK-scale when T > trained_len."""
    return gen_lib.logits(self.model, jnp.atleast_2d(jnp.asarray(self._ids(tokens))))

  def generate(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, stop_at_eos: bool = True):
    """str -> continuation text (cut at eos unless stop_at_eos=False); list[int] / [T] -> int32
    [T + new]; [B, T] -> int32 [B, T + new]."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
      raise ValueError(f"generate: max_new_tokens must be an int, got {max_new_tokens!r}")
    is_text = isinstance(prompt, str)
    encoded = self.tokenizer.encode(prompt) if is_text else prompt
    if is_text and not len(encoded):
      raise ValueError("generate: the prompt is empty (it must encode to at least one token)")
    tokens = self._ids(encoded)
    tokens_BT = tokens[None] if tokens.ndim == 1 else tokens
    out_BL = np.asarray(gen_lib.generate(
        self.model, tokens_BT, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        rng=jax.random.key(seed), eos_id=self.tokenizer.eos_id if stop_at_eos else None))
    if not is_text:
      return out_BL[0] if tokens.ndim == 1 else out_BL
    new = out_BL[0, tokens_BT.shape[1]:].tolist()
    if stop_at_eos and self.tokenizer.eos_id in new:
      new = new[:new.index(self.tokenizer.eos_id)]
    return self.tokenizer.decode(new)


def _tokenizer(workdir: str, run: config_lib.Config) -> tokenizer_lib.Tokenizer:
  if (epath.Path(workdir) / checkpoint.TOKENIZER_FILE).exists():
    return tokenizer_lib.Tokenizer.load(workdir)
  if run.data.tokenizer == "bundled":
    return tokenizer_lib.bundled()
  raise FileNotFoundError(f"{workdir} has no {checkpoint.TOKENIZER_FILE} and data.tokenizer="
                          f"{run.data.tokenizer!r} is not 'bundled'")


def load(path: str) -> LoadedModel:
  """A workdir (latest step) or workdir/checkpoints/<step> -> LoadedModel."""
  workdir, step = checkpoint.resolve(path)
  saved = saved_config.read(workdir)
  if "focus" in saved:
    raise NotALanguageModel(f"{workdir} is a FocusLLM adapter run; evaluate it with python "
                            f"eval.py --workdir BASE --focus_adapter {workdir}")
  run = config_lib.parse(saved)
  tok = _tokenizer(workdir, run)
  run = run.with_vocab(tok.vocab_size)
  # Inference runs what dispatch picks: a run trained with a forced implementation may not take
  # float32 (cudnn) or lengths the kernels' tiles do not fit (pallas).
  attention = dataclasses.replace(run.model.attention, implementation="auto")
  run = dataclasses.replace(run, model=dataclasses.replace(run.model, attention=attention))
  graphdef, state = model_lib.abstract_model(run.model)
  params, step = checkpoint.restore_params(workdir, step,
                                           checkpoint.abstract_like(nnx.to_pure_dict(state)))
  nnx.replace_by_pure_dict(state, params)
  return LoadedModel(model=nnx.merge(graphdef, state), tokenizer=tok, config=run.model, run=run,
                     workdir=workdir, step=int(step))
