"""Evaluation suites of a trained model (docs/evaluation.md), each a JSON-able dict; `run` is
eval.py's entry point. Functions taking `model` accept a Transformer or a LoadedModel."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import jax.numpy as jnp
import numpy as np
from etils import epath

from focaljax.data import pipeline as data
from focaljax.evaluation import generate as gen_lib
from focaljax.evaluation import loading as loaded_lib
from focaljax.evaluation import retrieval
from focaljax.model import attention as attn_lib
from focaljax.model import decoder as model_lib
from focaljax.train import checkpoint

SUITES = ("val", "longdoc", "passkey", "keyword", "attention", "sample", "copy")
SAMPLE_PROMPTS = ("Once upon a time", "The meaning of the word")
PROBE_TEXT = ("The old house stood at the end of the lane, and every evening the lamps were lit "
              "in its windows. Mary walked there with her brother, who carried the letters from "
              "town. ")


def validation(model, data_iter, num_batches: int | None) -> dict:
  """Mean NLL weighted by `weights` over up to `num_batches` batches (None: until exhausted)."""
  module = loaded_lib.module(model)
  total, weight = 0.0, 0.0
  for batches, batch in enumerate(data_iter, 1):
    nll = gen_lib.token_nll(module, batch["inputs"], batch["targets"],
                            positions_BT=jnp.asarray(batch["positions"]),
                            segment_ids_BT=jnp.asarray(batch["segment_ids"]))
    total += float(np.sum(np.asarray(nll, np.float64) * batch["weights"]))
    weight += float(np.sum(batch["weights"]))
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


def summary(per_book: np.ndarray) -> dict:
  """Mean and standard error over books (axis 0) and each book's values; NaN -> None."""
  n = per_book.shape[0]
  stderr = per_book.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.zeros(per_book.shape[1:])
  clean = lambda x: [None if np.isnan(v) else float(v) for v in x]
  return {"mean": clean(per_book.mean(0)), "stderr": clean(stderr),
          "per_book": [clean(row) for row in per_book]}


def loss_by_position(model, token_docs, trained_len: int, max_multiplier: int = 8) -> dict:
  """Per-position NLL of the first L + 1 tokens (L = trained_len x max_multiplier) of every long
  enough document, in doubling ranges, mean and standard error over books. Curves:
    full      one pass at L (RoPE layers NTK-scaled for L).
    doubling  (RoPE) one pass per L_k = trained_len·2^k, NTK-scaled for L_k; each range from the
              shortest pass covering it, so positions < trained_len come from the unscaled pass.
    unscaled  (RoPE) one pass at L with the trained rotary base: the no-NTK baseline.
  `in_context`: the mean NLL over [0, trained_len) of the pass at trained_len."""
  module = loaded_lib.module(model)
  L = trained_len * max_multiplier
  books = [np.asarray(d[:L + 1], np.int32) for d in token_docs if len(d) >= L + 1]
  if not books:
    raise ValueError(f"loss_by_position: no document has >= {L + 1} tokens "
                     f"(trained_len {trained_len} x max_multiplier {max_multiplier}); "
                     "lower max_multiplier or use longer books")
  ranges = position_ranges(trained_len, L)
  rope = any(s.position is attn_lib.Position.ROPE for s in module.cfg.attention.layers)
  pass_lens = sorted({min(trained_len * 2**k, L) for k in range(max_multiplier.bit_length() + 1)})

  nll = lambda book, n, rope_length: np.asarray(gen_lib.token_nll(
      module, book[None, :n], book[None, 1:n + 1], rope_length=rope_length))[0]
  by_range = lambda nll_T: [float(nll_T[a:b].mean()) for a, b in ranges]

  curves = {"full": [], "doubling": [], "unscaled": []} if rope else {"full": []}
  in_context = []
  for book in books:
    full = in_context_pass = nll(book, L, L)
    curves["full"].append(by_range(full))
    if rope:
      passes = {n: (full if n == L else nll(book, n, n)) for n in pass_lens}
      curves["doubling"].append([float(passes[min(n for n in pass_lens if n >= b)][a:b].mean())
                                 for a, b in ranges])
      # rope_length <= the trained context keeps the trained rotary base (no NTK).
      curves["unscaled"].append(by_range(nll(book, L, module.cfg.max_seq_len)))
      in_context_pass = passes[min(pass_lens)]
    in_context.append(float(in_context_pass[:trained_len].mean()))
  ic = summary(np.asarray(in_context)[:, None])
  return {"trained_len": trained_len, "max_len": L, "num_books": len(books), "ranges": ranges,
          "rope": rope, "curves": {name: summary(np.asarray(v)) for name, v in curves.items()},
          "in_context": {"mean": ic["mean"][0], "stderr": ic["stderr"][0]}}


def load_books(path: str, tokenizer, max_books: int | None = None, *, min_tokens: int = 0,
               max_tokens: int | None = None) -> list[list[int]]:
  """Token lists of the documents of >= min_tokens in `path` (.jsonl/.txt[.xz|.gz]); with
  `max_tokens` cut to a character budget first (whole books take seconds to tokenize)."""
  books = []
  for text in data.read_text_files([path], "text"):
    ids = tokenizer.encode(text[:max_tokens * 16] if max_tokens else text)[:max_tokens]
    if len(ids) >= min_tokens:
      books.append(ids)
    if max_books and len(books) >= max_books:
      break
  return books


def attention_probe(model, tokens, *, layer: int | None = None, head: int = 0,
                    temperature: float | None = None) -> dict:
  """The last token's attention over the text at one layer/head: softmax(q·k/√d) next to
  softmax(q·k/(t·√d)), from the model's own q and k (default layer: the middle one). Default t:
  the layer's own (a learned-τ layer's τ/√d at the last token), else the model's configured t."""
  module = loaded_lib.module(model)
  cfg = module.cfg
  layer = cfg.num_layers // 2 if layer is None else layer
  T = len(tokens)
  positions_BT, theta = jnp.arange(T)[None], model_lib.rope_theta(cfg, T)
  x_BTE = module.embed[...][jnp.asarray(tokens, jnp.int32)[None]]
  for block in module.blocks[:layer]:
    x_BTE = block(x_BTE, positions_BT, None, theta)
  attn = module.blocks[layer].attn
  # The model's own projection (RoPE included) so the probe sees exactly the trained q and k.
  x_BTE = module.blocks[layer].attn_norm(x_BTE)
  q_BTND, k_BTKD, _ = attn._project(x_BTE, positions_BT, theta)  # pylint: disable=protected-access
  a_BT = attn._tau_a(x_BTE)  # pylint: disable=protected-access
  if temperature is None and a_BT is not None:
    tau = model_lib.learned_tau(a_BT, cfg.attention)[0, -1]
    temperature = float(tau) / math.sqrt(cfg.head_dim)
  temperature = cfg.attention.temperature if temperature is None else temperature
  kv_head = head // (cfg.num_heads // cfg.num_kv_heads)
  logits_S = np.asarray(k_BTKD[0, :, kv_head] @ q_BTND[0, -1, head], np.float64) / math.sqrt(
      cfg.head_dim)
  softmax = lambda z: np.exp(z - z.max()) / np.exp(z - z.max()).sum()
  entropy = lambda p: float(-(p * np.log(np.maximum(p, 1e-30))).sum())
  soft, focal = softmax(logits_S), softmax(logits_S / temperature)
  return {"layer": layer, "head": head, "variant": attn.spec.variant.value,
          "temperature": temperature, "length": T, "softmax": soft.tolist(),
          "focal": focal.tolist(), "entropy": {"softmax": entropy(soft), "focal": entropy(focal)},
          "max_prob": {"softmax": float(soft.max()), "focal": float(focal.max())}}


def samples(loaded, prompts, *, max_new_tokens: int = 48, seed: int = 0) -> dict:
  """Greedy and nucleus (T=0.8, top-p 0.95) continuations of each prompt."""
  return {"max_new_tokens": max_new_tokens, "samples": [
      {"prompt": p, "greedy": loaded.generate(p, max_new_tokens),
       "sampled": loaded.generate(p, max_new_tokens, temperature=0.8, top_p=0.95, seed=seed + i)}
      for i, p in enumerate(prompts)]}


def copy_score(model, spans) -> dict:
  """Mean NLL of each span's tokens (after its first) on the first and the second reading of
  [span | span]: induction heads drive the second toward 0. `spans`: equal-length token lists."""
  x_BN = np.asarray(spans, np.int32)
  n = x_BN.shape[1]
  seq_BT = np.concatenate([x_BN, x_BN], axis=1)
  # All 2n tokens go in (fused kernels want lengths in whole tiles); the last target is a dummy.
  nll_BT = np.asarray(gen_lib.token_nll(loaded_lib.module(model), seq_BT,
                                        np.roll(seq_BT, -1, axis=1)))[:, :-1]
  first, second = nll_BT[:, :n - 1].mean(), nll_BT[:, n:].mean()
  return {"span_len": n, "spans": len(spans), "first_nll": float(first),
          "second_nll": float(second), "copy_gain": float(first - second)}


def _validation_pieces(m, n: int, count: int) -> list[list[int]]:
  """Up to `count` consecutive n-token pieces of the validation documents joined with eos."""
  valid = data.documents(m.run.data, "valid")
  stream = []
  for i in range(len(valid)):
    stream += m.tokenizer.encode(valid[i]) + [m.tokenizer.eos_id]
    if len(stream) >= n * count:
      break
  return [stream[i:i + n] for i in range(0, len(stream) - n + 1, n)][:count]


def format_suite(suite: str, r: dict) -> str:
  head = f"== {suite} ({r.get('seconds', 0)} s)"
  if "skipped" in r:
    return f"{head}: skipped: {r['skipped']}"
  lines, fmt = [head], lambda x: "   -  " if x is None else f"{x:6.3f}"
  if suite == "val":
    lines.append(f"  loss {r['loss']:.4f}  ppl {r['perplexity']:.2f}  tokens {r['tokens']}")
  elif suite == "longdoc":
    names = list(r["curves"])
    lines += [f"  {r['num_books']} books, NLL by position (trained {r['trained_len']}), source: "
              f"{r['source']}", "  range          " + "".join(f"{n:>10}" for n in names)]
    lines += [f"  [{a:>5},{b:>5}){' *' if b > r['trained_len'] else '  '} " + "".join(
        f"{r['curves'][n]['mean'][i]:10.3f}" for n in names)
        for i, (a, b) in enumerate(r["ranges"])]
    lines.append(f"  in-context mean {r['in_context']['mean']:.3f}   (* = beyond trained context)")
  elif suite in ("passkey", "keyword"):
    lines.append("  length \\ depth " + "".join(f"{d:7.2f}" for d in r["depths"]) + "    all")
    lines += [f"  {length:>14} " + "".join(f" {fmt(a)}" for a in row) + f" {fmt(acc)}"
              for length, row, acc in zip(r["lengths"], r["accuracy"], r["accuracy_by_length"])]
    extra = (f", chance {r['chance']:.3f}, mean gap {np.mean(r['mean_gap']):.3f} nats"
             if suite == "keyword" else "")
    lines.append(f"  overall {fmt(r['overall']).strip()}{extra}")
  elif suite == "attention":
    lines.append(f"  layer {r['layer']} head {r['head']} ({r['variant']}): entropy softmax "
                 f"{r['entropy']['softmax']:.3f} vs focal t={r['temperature']:.3g} "
                 f"{r['entropy']['focal']:.3f} nats")
  elif suite == "copy":
    lines.append(f"  span {r['span_len']} x{r['spans']}: NLL first reading {r['first_nll']:.3f}, "
                 f"second {r['second_nll']:.3f} (copy gain {r['copy_gain']:.3f})")
  elif suite == "sample":
    lines += [f"  {s['prompt']!r} -> greedy {s['greedy']!r}\n"
              f"  {' ' * len(repr(s['prompt']))}    sampled {s['sampled']!r}" for s in r["samples"]]
  return "\n".join(lines)


def check_suites(suites, allowed) -> None:
  if set(suites) - set(allowed):
    raise ValueError(f"unknown suites {sorted(set(suites) - set(allowed))}; allowed: "
                     f"{list(allowed)}")


def run_suites(tasks: dict, suites, out_dir: str, results: dict, results_file: str, format_fn,
               log, errors=(ValueError, FileNotFoundError)) -> dict:
  """Runs the `suites` of `tasks` ({suite: thunk}) in its order into `results`, writing
  out_dir/<suite>.json and out_dir/results_file (removing the <suite>.json it no longer lists);
  a suite raising one of `errors` is recorded as skipped (one unusable suite must not lose the
  others)."""
  out = epath.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  for suite, task in ((s, t) for s, t in tasks.items() if s in suites):
    t0 = time.time()
    try:
      result = task()
    except errors as e:
      result = {"skipped": str(e)}
    result["seconds"] = round(time.time() - t0, 1)
    results[suite] = result
    (out / f"{suite}.json").write_text(json.dumps(result, indent=1))
    log(format_fn(suite, result))
  merged = _with_earlier(out / results_file, results)
  (out / results_file).write_text(json.dumps(merged, indent=1))
  for stale in set(tasks) - set(merged):   # another checkpoint's or settings': not in merged
    if (out / f"{stale}.json").exists():
      (out / f"{stale}.json").unlink()
  return results


def _with_earlier(path: epath.Path, results: dict) -> dict:
  """`results` plus the suites an earlier eval of the same checkpoint and settings (its meta
  but the suite list) wrote to `path` and this one did not run: a rerun of one suite keeps the
  file whole."""
  try:
    old = json.loads(path.read_text()) if path.exists() else {}
  except ValueError:
    old = {}
  ident = lambda meta: {k: v for k, v in meta.items() if k not in ("suites", "plots")}
  if not isinstance(old, dict) or ident(old.get("meta", {})) != ident(results["meta"]):
    return results
  earlier = {k: v for k, v in old.items() if k != "meta" and k not in results}
  meta = {**results["meta"], "suites": [*earlier, *results["meta"].get("suites", [])]}
  return {"meta": meta, **earlier, **{k: v for k, v in results.items() if k != "meta"}}


def unanswered(results: dict) -> list[str]:
  """The suites in `results` that produced no number: skipped, or retrieval that scored no
  length (every length too short, or refused)."""
  return [s for s, r in results.items()
          if s != "meta" and ("skipped" in r or ("overall" in r and r["overall"] is None))]


def run(path: str, *, suites=SUITES, books: str | None = None, max_multiplier: int = 8,
        max_books: int = 8, depths=retrieval.DEFAULT_DEPTHS, passkey_seeds: int = 4,
        val_batches: int | None = None, out_dir: str | None = None, plots: bool = True,
        log=print) -> dict:
  """Runs `suites` on `path` (a workdir or checkpoints/<N>), writing JSON and PNGs under out_dir
  (default WORKDIR/eval, or WORKDIR/eval/step_<N>); retrieval at the context x 1, 2, 4, ..."""
  check_suites(suites, SUITES)
  m = loaded_lib.load(path)
  explicit_step = checkpoint.resolve(path)[1] is not None
  out_dir = out_dir or str(epath.Path(m.workdir) / "eval" /
                           (f"step_{m.step}" if explicit_step else ""))
  trained = m.trained_len
  lengths = [trained * 2**k for k in range(max_multiplier.bit_length())]
  log(f"focaljax eval: {m.workdir} step {m.step}, trained context {trained}, lengths {lengths}")

  def val():
    cfg = dataclasses.replace(m.run.data, shuffle=False, num_epochs=1)
    return {**validation(m, data.make_iterator(cfg, m.tokenizer, split="valid"),
                         val_batches or m.run.train.eval_batches),
            "source": cfg.valid_source or cfg.source}

  def longdoc():
    L = trained * max_multiplier
    if books:
      docs = load_books(books, m.tokenizer, max_books, min_tokens=L + 1, max_tokens=L + 1)
    else:   # the validation documents, joined with eos, cut into L + 1 token pieces
      docs = _validation_pieces(m, L + 1, max_books)
    return {**loss_by_position(m, docs, trained, max_multiplier), "source": books or
            "validation split documents concatenated (no --books file)"}

  def copy():
    spans = _validation_pieces(m, trained // 2, 16)
    if not spans:
      raise ValueError(f"copy: the validation documents hold fewer than {trained // 2} tokens")
    return copy_score(m, spans)

  probe = m.tokenizer.encode(PROBE_TEXT)
  tasks = {   # in SUITES' order
      "val": val, "longdoc": longdoc,
      "passkey": lambda: retrieval.passkey(m, m.tokenizer, lengths, depths, range(passkey_seeds)),
      "keyword": lambda: retrieval.keyword_retrieval(m, m.tokenizer, lengths, depths),
      "attention": lambda: attention_probe(m, (probe * (trained // len(probe) + 1))[:trained]),
      "sample": lambda: samples(m, SAMPLE_PROMPTS), "copy": copy,
  }
  results = {"meta": {"workdir": m.workdir, "step": m.step, "trained_len": trained,
                      "suites": list(suites)}}
  run_suites(tasks, suites, out_dir, results, "results.json", format_suite, log,
             (ValueError, FileNotFoundError, ImportError))
  if plots:
    from focaljax.evaluation import plots as plots_lib  # pylint: disable=import-outside-toplevel
    results["meta"]["plots"] = plots_lib.write_all(results, m.workdir, out_dir, log=log)
  log(f"results: {epath.Path(out_dir) / 'results.json'}")
  return results
