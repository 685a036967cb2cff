"""lm-evaluation-harness model "focaljax": any focaljax workdir (or checkpoints/<step> dir).

  python -m focaljax.interop.lm_eval --model focaljax --model_args path=WORKDIR \\
      --batch_size 16 --tasks hellaswag,arc_easy --output_path results/

The module is lm_eval's own CLI with this registration imported first: lm-eval has no plugin
discovery, so `--model focaljax` is only known once this module is imported (in Python:
`import focaljax.interop.lm_eval` before `lm_eval.simple_evaluate(model="focaljax", ...)`).

model_args: path (required); batch_size (an integer >= 1 or auto, meaning 8; default 8; on the
command line use --batch_size, which lm_eval always passes itself); max_length (an integer >= 1,
the context requests are left-truncated to; default the trained context, data.seq_len, so RoPE
never NTK-scales unless asked to).

Scoring right-pads each batch to a length bucket (powers of two up to max_length), so few shapes
compile. RoPE NTK-scales for max_length (only if it exceeds the trained context), never for the
bucket: with the model causal, a request then scores the same in any batch. Generation
cannot pad (there is no attention mask), so it batches requests of equal prompt length and runs
one compiled decode per (batch, prompt length, max_gen_toks); stop strings are applied to the
decoded text after `max_gen_toks` tokens (or eos).
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx

try:
  from lm_eval import utils as lm_utils
  from lm_eval.api.model import TemplateLM
  from lm_eval.api.registry import register_model
except ImportError as e:   # the optional extra: its command says so in one line
  _NEED = f"{e}; install it with: pip install -e '.[lmeval]'"
  if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "focaljax-lm-eval":
    print(f"focaljax-lm-eval: error: {_NEED}", file=sys.stderr)
    sys.exit(2)
  raise ImportError(_NEED) from e

from focaljax.evaluation import generate as gen_lib
from focaljax.evaluation import loading


@functools.partial(jax.jit, static_argnames=("graphdef", "rope_length"))
def _score(graphdef, state, inputs_BT, targets_BT, rope_length):
  """log p(target) and whether the target is the argmax, per position; [B, T] each."""
  logits_BTV = nnx.merge(graphdef, state)(inputs_BT, rope_length=rope_length)
  logp_BT = jnp.take_along_axis(jax.nn.log_softmax(logits_BTV, axis=-1), targets_BT[..., None],
                                axis=-1)[..., 0]
  return logp_BT, jnp.argmax(logits_BTV, axis=-1) == targets_BT


def _bucket(n: int, cap: int) -> int:
  return min(max(16, 1 << (n - 1).bit_length()), cap)


def _count(label: str, value, allowed: str = "an integer >= 1") -> int | None:
  """An int >= 1 (None stays None); anything else one line naming the argument. lm_eval's
  command line reads "-5" or "1e3" as a float: a whole one is its integer."""
  text = str(int(value) if isinstance(value, float) and value.is_integer() else value).strip()
  if value is not None and (isinstance(value, bool) or not text.isdigit() or int(text) < 1):
    raise ValueError(f"{label}={value}: must be {allowed}")
  return None if value is None else int(text)


@register_model("focaljax")
class FocaljaxLM(TemplateLM):
  """Log-likelihoods and greedy/sampled generation from `focaljax.load(path)`."""

  def __init__(self, path: str | None = None, batch_size: int | str = 8,
               max_length: int | str | None = None, device=None, max_batch_size=None, **unused):
    super().__init__()
    del device, max_batch_size   # lm_eval passes these to every model; JAX places the arrays
    if unused:
      raise ValueError(f"model_args {sorted(unused)} are not known; have: path, batch_size, "
                       "max_length")
    if path is None or path == "":
      raise ValueError("model_args path is required: a focaljax workdir or its checkpoints/<step>"
                       " (--model_args path=WORKDIR)")
    # Checked before the model loads; "auto" (lm_eval's "auto:N" too) means 8.
    auto = str(batch_size).split(":")[0] == "auto"
    self.batch_size = 8 if auto else _count("batch_size (--batch_size)", batch_size,
                                            "an integer >= 1 or auto") or 8
    max_length = _count("model_args max_length", max_length)
    self.loaded = loading.load(str(path))
    self.tokenizer = self.loaded.tokenizer
    self.max_length = max_length or self.loaded.trained_len
    self._graphdef, self._state = nnx.split(self.loaded.model)

  @property
  def eot_token_id(self) -> int:
    return self.tokenizer.eos_id

  @property
  def tokenizer_name(self) -> str:
    return f"focaljax:{self.loaded.workdir}"

  def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
    del add_special_tokens, kwargs   # our tokenizer adds no specials
    return self.tokenizer.encode(string)

  def tok_decode(self, tokens) -> str:
    return self.tokenizer.decode(tokens)

  def _score_tokens(self, pairs: list[tuple[list[int], list[int]]],
                    disable_tqdm: bool = True) -> list[tuple[float, bool]]:
    """(context, continuation) token pairs -> (sum log p(continuation), all greedy)."""
    results = [None] * len(pairs)
    # Longest first, so each batch's rows have similar lengths and the bucket fits them all.
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
    for b in tqdm.tqdm(range(0, len(order), self.batch_size), desc="focaljax scoring",
                       disable=disable_tqdm):
      idx = order[b:b + self.batch_size]
      rows = []
      for i in idx:
        ctx, cont = pairs[i]
        if not cont:
          raise ValueError(f"request {i}: the continuation encodes to no tokens")
        # Left-truncate: keep the continuation and as much context as fits in max_length.
        whole = (ctx + cont)[-(self.max_length + 1):]
        rows.append((whole[:-1], whole[1:], min(len(cont), len(whole) - 1)))
      T = _bucket(max(len(r[0]) for r in rows), self.max_length)
      inputs = np.full((self.batch_size, T), self.eot_token_id, np.int32)
      targets = np.zeros((self.batch_size, T), np.int32)
      for r, (inp, tgt, _) in enumerate(rows):
        inputs[r, :len(inp)], targets[r, :len(tgt)] = inp, tgt
      # One rotary base for every request (max_length's), whatever bucket its batch pads to.
      logp, greedy = jax.device_get(_score(self._graphdef, self._state, inputs, targets,
                                           self.max_length))
      for r, (i, (inp, _, n)) in enumerate(zip(idx, rows)):
        span = slice(len(inp) - n, len(inp))
        results[i] = (float(logp[r, span].sum()), bool(greedy[r, span].all()))
    return results

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    out = self._score_tokens([(ctx, cont) for _, ctx, cont in requests], disable_tqdm)
    for (key, _, _), res in zip(requests, out):
      if key is not None:
        self.cache_hook.add_partial("loglikelihood", key, res)
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Whole-document log-likelihood, in disjoint windows of max_length tokens each."""
    texts = [req.args[0] for req in requests]
    owner, windows = [], []
    for d, text in enumerate(texts):
      for w in lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length, context_len=1):
        owner.append(d)
        windows.append(lm_utils.make_disjoint_window(w))
    # All documents' windows batch together; each document sums its own.
    out = [0.0] * len(texts)
    for d, (ll, _) in zip(owner, self._score_tokens(windows, disable_tqdm)):
      out[d] += ll
    for text, total in zip(texts, out):
      self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
    return out

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    results = [None] * len(requests)
    groups: dict[tuple, list[tuple[int, list[int], list[str]]]] = {}
    for i, (context, kwargs) in enumerate([req.args for req in requests]):
      kwargs = dict(kwargs)
      until = kwargs.pop("until", None) or [self.tok_decode([self.eot_token_id])]
      until = [until] if isinstance(until, str) else list(until)
      max_new = int(kwargs.pop("max_gen_toks", 256))
      sample = kwargs.pop("do_sample", False)
      temperature = float(kwargs.pop("temperature", 1.0)) if sample else 0.0
      top_p = float(kwargs.pop("top_p", 1.0)) if sample else 1.0
      # Greedy decoding ignores sampling knobs, as transformers does; anything else would change
      # the scores unnoticed.
      unknown = set(kwargs) - ({"temperature", "top_p", "top_k", "min_p"} if not sample else set())
      if unknown:
        raise ValueError(f"request {i}: generation arguments {sorted(unknown)} are not supported "
                         "(until, max_gen_toks, do_sample, temperature, top_p are)")
      if max_new >= self.max_length:
        raise ValueError(f"request {i}: max_gen_toks={max_new} leaves no room for the context "
                         f"in max_length={self.max_length}")
      # Left-truncate the prompt so prompt + new tokens fit in max_length.
      ctx = (self.tok_encode(context) or [self.prefix_token_id])[-(self.max_length - max_new):]
      groups.setdefault((len(ctx), max_new, temperature, top_p), []).append((i, ctx, until))
    for (T, max_new, temperature, top_p), items in tqdm.tqdm(groups.items(), disable=disable_tqdm,
                                                             desc="focaljax generating"):
      for b in range(0, len(items), self.batch_size):
        chunk = items[b:b + self.batch_size]
        # Pad the batch with copies of its first row: one compiled shape per (T, max_new).
        prompt = np.asarray([c for _, c, _ in chunk] + [chunk[0][1]] *
                            (self.batch_size - len(chunk)), np.int32)
        out = np.asarray(gen_lib.generate(
            self.loaded.model, prompt, max_new_tokens=max_new, temperature=temperature,
            top_p=top_p, rng=jax.random.key(b), eos_id=self.eot_token_id))
        for r, (i, _, until) in enumerate(chunk):
          new = out[r, T:].tolist()
          if self.eot_token_id in new:
            new = new[:new.index(self.eot_token_id)]
          text = self.tok_decode(new)
          for stop in until:
            text = text.split(stop)[0] if stop else text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
          results[i] = text
    return results


def main(argv=None) -> int:
  """lm_eval's command line, with model "focaljax" registered. A missing workdir, an unknown
  task or an unreachable dataset is one line and exit 2, as focaljax-convert does."""
  from lm_eval.__main__ import cli_evaluate  # pylint: disable=import-outside-toplevel
  sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
  try:
    cli_evaluate()
  except (ValueError, OSError) as e:   # OSError: FileNotFoundError, ConnectionError
    print(f"focaljax-lm-eval: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
