"""Evaluation suites of a trained model; each returns a JSON-able dict.

  validation        weighted mean loss / perplexity on the validation split
  loss_by_position  long documents, per-position NLL averaged in doubling position ranges,
                    in and beyond the trained context
  passkey, keyword  long-context retrieval (focaljax/evaluation/retrieval.py)
  attention_probe   one query's attention under softmax vs focal temperature (focal paper Fig. 1)
  samples           greedy and nucleus-sampled continuations
  copy_score        a span of real text read twice in one context: NLL on the first and the
                    second reading (can the model copy what its context holds? FocusLLM's
                    reconstruction task assumes the base can)

`run` (eval.py's entry point) loads a workdir, runs the chosen suites, writes DIR/eval/<suite>.json,
DIR/eval/results.json and PNG plots, and prints a table. Functions taking `model` accept an nnx
Transformer or a LoadedModel.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import jax.numpy as jnp
import numpy as np

from focaljax.model import attention as attn_lib
from focaljax.train import checkpoint
from focaljax.evaluation import generate as gen_lib
from focaljax.evaluation import loading as loaded_lib
from focaljax.model import decoder as model_lib
from focaljax.evaluation import retrieval

SUITES = ("val", "longdoc", "passkey", "keyword", "attention", "sample", "copy")


def _module(model):
  return getattr(model, "model", model)


def validation(model, data_iter, num_batches: int | None, *, dtype=jnp.float32) -> dict:
  """Mean NLL weighted by `weights` over up to `num_batches` batches (None: until exhausted)."""
  module = _module(model)
  total, weight, batches = 0.0, 0.0, 0
  for batch in data_iter:
    nll = gen_lib.token_nll(module, batch["inputs"], batch["targets"],
                            positions_BT=jnp.asarray(batch["positions"]),
                            segment_ids_BT=jnp.asarray(batch["segment_ids"]), dtype=dtype)
    total += float(np.sum(np.asarray(nll, np.float64) * batch["weights"]))
    weight += float(np.sum(batch["weights"]))
    batches += 1
    if num_batches is not None and batches >= num_batches:
      break  # before pulling another batch: grain iterators read ahead
  if weight == 0:
    raise ValueError("validation: no weighted target tokens (empty iterator or all padding)")
  loss = total / weight
  return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(weight),
          "batches": batches}


def position_ranges(trained_len: int, max_len: int, first: int | None = None) -> list[list[int]]:
  """[0, f), [f, 2f), [2f, 4f), ... up to max_len; f defaults to trained_len / 8."""
  f = first or max(1, trained_len // 8)
  edges = [0, f]
  while edges[-1] < max_len:
    edges.append(min(edges[-1] * 2, max_len))
  return [[a, b] for a, b in zip(edges[:-1], edges[1:])]


def _has_rope(module) -> bool:
  return any(s.position is attn_lib.Position.ROPE for s in module.cfg.attention.layers)


def _summary(per_book: np.ndarray) -> dict:
  n = per_book.shape[0]
  stderr = per_book.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.zeros(per_book.shape[1:])
  return {"mean": per_book.mean(0).tolist(), "stderr": stderr.tolist(),
          "per_book": per_book.tolist()}


def loss_by_position(model, token_docs, trained_len: int, max_multiplier: int = 8, *,
                     max_books: int | None = None, first_range: int | None = None,
                     dtype=jnp.float32) -> dict:
  """Per-position NLL of long documents in doubling ranges, mean and standard error over books.

  Every document with >= L + 1 tokens (L = trained_len · max_multiplier) contributes its first
  L + 1 tokens, one at a time (batch 1). Curves:
    full      one pass at L (RoPE layers NTK-scaled for L): the simple long-context number.
    doubling  (RoPE models) one pass per L_k = trained_len·2^k with NTK for L_k;
              a range is taken from the shortest pass covering it, so positions < trained_len
              come from the unscaled in-context pass.
    unscaled  (RoPE models) one pass at L with the trained rotary base: the no-NTK baseline.
  `in_context`: mean NLL over positions [0, trained_len) of the pass at trained_len.
  """
  module = _module(model)
  L = trained_len * max_multiplier
  books = [np.asarray(d[:L + 1], np.int32) for d in token_docs if len(d) >= L + 1]
  books = books[:max_books] if max_books else books
  if not books:
    raise ValueError(f"loss_by_position: no document has >= {L + 1} tokens "
                     f"(trained_len {trained_len} x max_multiplier {max_multiplier}); "
                     "lower max_multiplier or use longer books")
  ranges = position_ranges(trained_len, L, first_range)
  rope = _has_rope(module)
  pass_lens = sorted({min(trained_len * 2**k, L) for k in range(max_multiplier.bit_length() + 1)})

  def nll(book, n, rope_length):
    return np.asarray(gen_lib.token_nll(module, book[None, :n], book[None, 1:n + 1],
                                        rope_length=rope_length, dtype=dtype))[0]

  def by_range(nll_T, rs):
    return [float(nll_T[a:b].mean()) for a, b in rs]

  curves = {"full": [], "doubling": [], "unscaled": []} if rope else {"full": []}
  in_context = []
  for book in books:
    full = nll(book, L, L)
    curves["full"].append(by_range(full, ranges))
    if not rope:
      in_context.append(float(full[:trained_len].mean()))
      continue
    # rope_length <= the trained context keeps the trained rotary base (no NTK).
    unscaled_len = module.cfg.max_seq_len
    passes = {n: (full if n == L else nll(book, n, n)) for n in pass_lens}
    curves["doubling"].append([float(passes[min(n for n in pass_lens if n >= b)][a:b].mean())
                               for a, b in ranges])
    curves["unscaled"].append(by_range(nll(book, L, unscaled_len), ranges))
    in_context.append(float(passes[min(pass_lens)][:trained_len].mean()))
  ic = np.asarray(in_context)
  return {
      "trained_len": trained_len, "max_len": L, "num_books": len(books), "ranges": ranges,
      "rope": rope, "curves": {name: _summary(np.asarray(v)) for name, v in curves.items()},
      "in_context": {"mean": float(ic.mean()),
                     "stderr": float(ic.std(ddof=1) / math.sqrt(len(ic))) if len(ic) > 1 else 0.0},
  }


def load_books(path: str, tokenizer, max_books: int | None = None, *, min_tokens: int = 0,
               max_tokens: int | None = None, jsonl_field: str = "text") -> list[list[int]]:
  """Token lists of the documents in `path` (.jsonl/.txt, optionally .xz/.gz), in file order.

  Keeps documents with >= min_tokens tokens; with `max_tokens` each text is cut to a generous
  character budget before encoding (whole books take seconds to tokenize) and then to max_tokens.
  """
  from focaljax.data import pipeline as data  # pylint: disable=import-outside-toplevel
  books = []
  for text in data.read_text_files([path], jsonl_field):
    if max_tokens:
      text = text[:max_tokens * 16]  # >= 16 characters per token never happens for prose
    ids = tokenizer.encode(text)[:max_tokens]
    if len(ids) >= min_tokens:
      books.append(ids)
    if max_books and len(books) >= max_books:
      break
  return books


def attention_probe(model, tokens, *, layer: int | None = None, head: int = 0,
                    temperature: float = 0.4) -> dict:
  """The last token's attention over the text at one layer/head: softmax(q·k/√d) next to
  softmax(q·k/(t·√d)), from the model's own q and k (default layer: the middle one)."""
  module = _module(model)
  cfg = module.cfg
  layer = cfg.num_layers // 2 if layer is None else layer
  tokens_BT = jnp.asarray(tokens, jnp.int32)[None]
  T = tokens_BT.shape[1]
  positions_BT = jnp.arange(T)[None]
  theta = model_lib.rope_theta(cfg, T)
  x_BTE = module.embed[...][tokens_BT]
  for block in module.blocks[:layer]:
    x_BTE = block(x_BTE, positions_BT, None, theta)
  attn = module.blocks[layer].attn
  # The model's own projection (RoPE included) so the probe sees exactly the trained q and k.
  x_BTE = module.blocks[layer].attn_norm(x_BTE)
  q_BTND, k_BTKD, _ = attn._project(x_BTE, positions_BT, theta)  # pylint: disable=protected-access
  kv_head = head // (cfg.num_heads // cfg.num_kv_heads)
  logits_S = np.asarray(k_BTKD[0, :, kv_head] @ q_BTND[0, -1, head], np.float64) / math.sqrt(
      cfg.head_dim)

  def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()

  def entropy(p):
    return float(-(p * np.log(np.maximum(p, 1e-30))).sum())

  soft, focal = softmax(logits_S), softmax(logits_S / temperature)
  return {"layer": layer, "head": head, "variant": attn.spec.variant.value,
          "temperature": temperature, "length": T, "softmax": soft.tolist(),
          "focal": focal.tolist(), "entropy": {"softmax": entropy(soft), "focal": entropy(focal)},
          "max_prob": {"softmax": float(soft.max()), "focal": float(focal.max())}}


def samples(loaded, prompts, *, max_new_tokens: int = 48, seed: int = 0) -> dict:
  """Greedy and nucleus (T=0.8, top-p 0.95) continuations of each prompt."""
  out = []
  for i, p in enumerate(prompts):
    out.append({"prompt": p, "greedy": loaded.generate(p, max_new_tokens),
                "sampled": loaded.generate(p, max_new_tokens, temperature=0.8, top_p=0.95,
                                           seed=seed + i)})
  return {"max_new_tokens": max_new_tokens, "samples": out}


SAMPLE_PROMPTS = ("Once upon a time", "The meaning of the word")


def copy_score(model, spans) -> dict:
  """Mean NLL of each span's tokens (after its first) on the first reading of [span | span] and on
  the second: a model with induction heads drives the second toward 0, one without stays near the
  first. `spans`: equal-length token lists (2·len must fit the trained context)."""
  x_BN = np.asarray(spans, np.int32)
  n = x_BN.shape[1]
  seq_BT = np.concatenate([x_BN, x_BN], axis=1)
  # All 2n tokens go in (fused kernels want lengths in whole tiles); the last target is a dummy.
  nll_BT = np.asarray(gen_lib.token_nll(_module(model), seq_BT, np.roll(seq_BT, -1, axis=1)))
  nll_BT = nll_BT[:, :-1]
  first, second = nll_BT[:, :n - 1].mean(), nll_BT[:, n:].mean()
  return {"span_len": n, "spans": len(spans), "first_nll": float(first),
          "second_nll": float(second), "copy_gain": float(first - second)}


def _validation_pieces(m, n: int, count: int) -> list[list[int]]:
  """Up to `count` consecutive n-token pieces of the validation documents joined with eos."""
  from focaljax.data import pipeline as data  # pylint: disable=import-outside-toplevel
  valid = data.documents(m.run.data, "valid")
  stream = []
  for i in range(len(valid)):
    stream += m.tokenizer.encode(valid[i]) + [m.tokenizer.eos_id]
    if len(stream) >= n * count:
      break
  return [stream[i:i + n] for i in range(0, len(stream) - n + 1, n)][:count]


def _copy_suite(m, num_spans: int = 16) -> dict:
  n = m.trained_len // 2
  spans = _validation_pieces(m, n, num_spans)
  if not spans:
    raise ValueError(f"copy: the validation documents hold fewer than {n} tokens")
  return copy_score(m, spans)


def _validation_suite(m, num_batches: int | None) -> dict:
  from focaljax.data import pipeline as data  # pylint: disable=import-outside-toplevel
  # The loaded tokenizer is passed to the pipeline directly; the config's spec is not re-read.
  cfg = dataclasses.replace(m.run.data, shuffle=False, num_epochs=1)
  num_batches = num_batches or m.run.train.eval_batches
  it = data.make_iterator(cfg, m.tokenizer, split="valid")
  return {**validation(m, it, num_batches), "source": cfg.valid_source or cfg.source}


def _longdoc_suite(m, books: str | None, max_multiplier: int, max_books: int) -> dict:
  L = m.trained_len * max_multiplier
  if books:
    docs = load_books(books, m.tokenizer, max_books, min_tokens=L + 1, max_tokens=L + 1)
    source = books
  else:
    # No long books: the validation documents, joined with eos, cut into L + 1 token pieces.
    docs = _validation_pieces(m, L + 1, max_books)
    source = "validation split documents concatenated (no --books file)"
  return {**loss_by_position(m, docs, m.trained_len, max_multiplier), "source": source}


def probe_tokens(m, length: int | None = None) -> list[int]:
  """A real sentence-rich text, repeated to the trained context, for the attention probe."""
  text = ("The old house stood at the end of the lane, and every evening the lamps were lit in "
          "its windows. Mary walked there with her brother, who carried the letters from town. ")
  ids = m.tokenizer.encode(text)
  n = length or m.trained_len
  return (ids * (n // len(ids) + 1))[:n]


def _fmt(x) -> str:
  return "   -  " if x is None else f"{x:6.3f}"


def format_suite(suite: str, r: dict) -> str:
  """A few readable lines per suite for the terminal."""
  head = f"== {suite} ({r.get('seconds', 0)} s)"
  if "skipped" in r:
    return f"{head}: skipped: {r['skipped']}"
  if suite == "val":
    return f"{head}\n  loss {r['loss']:.4f}  ppl {r['perplexity']:.2f}  tokens {r['tokens']}"
  if suite == "longdoc":
    names = list(r["curves"])
    lines = [head, f"  {r['num_books']} books, NLL by position (trained {r['trained_len']}), "
             f"source: {r['source']}", "  range          " + "".join(f"{n:>10}" for n in names)]
    for i, (a, b) in enumerate(r["ranges"]):
      mark = " *" if b > r["trained_len"] else "  "
      lines.append(f"  [{a:>5},{b:>5}){mark} " + "".join(
          f"{r['curves'][n]['mean'][i]:10.3f}" for n in names))
    lines.append(f"  in-context mean {r['in_context']['mean']:.3f}   (* = beyond trained context)")
    return "\n".join(lines)
  if suite in ("passkey", "keyword"):
    lines = [head, "  length \\ depth " + "".join(f"{d:7.2f}" for d in r["depths"]) + "    all"]
    for length, row, acc in zip(r["lengths"], r["accuracy"], r["accuracy_by_length"]):
      lines.append(f"  {length:>14} " + "".join(f" {_fmt(a)}" for a in row) + f" {_fmt(acc)}")
    extra = (f", chance {r['chance']:.3f}, mean gap {np.mean(r['mean_gap']):.3f} nats"
             if suite == "keyword" else "")
    lines.append(f"  overall {_fmt(r['overall']).strip()}{extra}")
    return "\n".join(lines)
  if suite == "attention":
    return (f"{head}\n  layer {r['layer']} head {r['head']} ({r['variant']}): entropy softmax "
            f"{r['entropy']['softmax']:.3f} vs focal t={r['temperature']} "
            f"{r['entropy']['focal']:.3f} nats")
  if suite == "copy":
    return (f"{head}\n  span {r['span_len']} x{r['spans']}: NLL first reading "
            f"{r['first_nll']:.3f}, second {r['second_nll']:.3f} (copy gain {r['copy_gain']:.3f})")
  if suite == "sample":
    return "\n".join([head] + [f"  {s['prompt']!r} -> greedy {s['greedy']!r}\n"
                                f"  {' ' * len(repr(s['prompt']))}    sampled {s['sampled']!r}"
                                for s in r["samples"]])
  return head


def run(path: str, *, suites=SUITES, books: str | None = None, max_multiplier: int = 8,
        max_books: int = 8, depths=retrieval.DEFAULT_DEPTHS, passkey_seeds: int = 4,
        val_batches: int | None = None, out_dir: str | None = None, plots: bool = True,
        log=print) -> dict:
  """Loads `path` (a workdir or checkpoints/<step>), runs `suites`, writes JSON (and PNG) results
  under out_dir and returns {suite: result}. out_dir defaults to WORKDIR/eval for a workdir and to
  WORKDIR/eval/step_<N> for a checkpoints/<N> path (an older step never overwrites the latest's).
  Retrieval lengths are the trained context x 1, 2, 4, ... up to max_multiplier."""
  unknown = set(suites) - set(SUITES)
  if unknown:
    raise ValueError(f"unknown suites {sorted(unknown)}; allowed: {list(SUITES)}")
  m = loaded_lib.load(path)
  explicit_step = checkpoint.resolve(path)[1] is not None
  out_dir = out_dir or os.path.join(m.workdir, "eval", f"step_{m.step}" if explicit_step else "")
  os.makedirs(out_dir, exist_ok=True)
  trained = m.trained_len
  lengths = [trained * 2**k for k in range(max_multiplier.bit_length())
             if trained * 2**k <= trained * max_multiplier]
  log(f"focaljax eval: {m.workdir} step {m.step}, trained context {trained}, lengths {lengths}")
  results = {"meta": {"workdir": m.workdir, "step": m.step, "trained_len": trained,
                      "suites": list(suites)}}
  tasks = {
      "val": lambda: _validation_suite(m, val_batches),
      "longdoc": lambda: _longdoc_suite(m, books, max_multiplier, max_books),
      "passkey": lambda: retrieval.passkey(m, m.tokenizer, lengths, depths, range(passkey_seeds)),
      "keyword": lambda: retrieval.keyword_retrieval(m, m.tokenizer, lengths, depths),
      "attention": lambda: attention_probe(m, probe_tokens(m)),
      "sample": lambda: samples(m, SAMPLE_PROMPTS),
      "copy": lambda: _copy_suite(m),
  }
  for suite in SUITES:
    if suite not in suites:
      continue
    t0 = time.time()
    try:
      result = tasks[suite]()
    except (ValueError, FileNotFoundError, ImportError) as e:
      # One unusable suite (no long books, no data module yet) must not lose the others.
      result = {"skipped": str(e)}
    result["seconds"] = round(time.time() - t0, 1)
    results[suite] = result
    with open(os.path.join(out_dir, f"{suite}.json"), "w") as f:
      json.dump(result, f, indent=1)
    log(format_suite(suite, result))
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  if plots:
    from focaljax.evaluation import plots as plots_lib  # pylint: disable=import-outside-toplevel
    written = plots_lib.write_all(results, m.workdir, out_dir, log=log)
    results["meta"]["plots"] = written
  log(f"results: {os.path.join(out_dir, 'results.json')}")
  return results
