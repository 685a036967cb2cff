"""FocusLLM evaluation: passkey retrieval and loss by position far beyond the base's context.

Lengths are multiples of the base's trained context (`base.cfg.max_seq_len`, "ctx" below). Every
input is split into a local window (the last T tokens, the local decoder's input) and the memory
(everything before it, cut into chunks of `cfg.chunk_size`). T defaults (in `run`) to the
window the adapter trained on (focus.local_len), else ctx // 2, the official ratio (local_window
2048 on LLaMA-2's 4K). The memory must be whole chunks (focus.chunk_sequences):

  passkey           keeps the requested total length exactly and takes the largest window
                    T <= local_len with (length - T) % chunk_size == 0, or the smallest above it
                    when that one would not hold the question (local_len_for; rows record T).
  loss_by_position  keeps T and drops the oldest (p - T) % chunk_size tokens of the document (its
                    beginning) from the memory of a window ending at p.

passkey: focus/passkey.py (the official protocol; its module docstring).

loss_by_position: NLL of long documents in doubling position ranges [0, ctx), [ctx, 2ctx),
[2ctx, 4ctx), ... up to max_multiplier x ctx, through the leak-free `focus.target_nll`. A window
ending at p scores the Q = num_targets targets at positions p-Q+1 .. p of the document (each
predicted from its own candidates, module docstring of focus/model.py): local tokens doc[p-T .. p-1],
memory the whole chunks before doc[p-T]. For each range, `windows` ends p are drawn uniformly
(duplicates dropped) from the ends whose targets all lie in the range (and p >= T) and whose
memory is the same whole number of chunks, that number drawn first: one memory length, so one
compile, per range (one per window took minutes on the GPU at 32x). The ends are the same for
every book and all books run as one batch. Per book and range the value is the mean
NLL over those windows x Q targets; curves report mean and standard error over books. `base`
scores the same targets with the frozen base alone on the same T-token local window (no memory),
and `gain` = base - focus per book (positive: the memory helps). A range with no valid end
(narrower than Q, or wholly before T) is None. The base's own long-context curve (full attention,
NTK-scaled RoPE) on the same books is eval.py's `longdoc` suite.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from focaljax.evaluation import loading as loaded_lib
from focaljax.evaluation import suites as evaluate
from focaljax.focus import adapter as adapter_lib
from focaljax.focus import model as focus
from focaljax.focus.passkey import DEFAULT_MULTIPLIERS, passkey

FOCUS_SUITES = ("focus_passkey", "focus_longdoc")


def _module(model):
  return getattr(model, "model", model)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "num_targets"))
def _target_nll(graphdef, base_state, adapter, memory_BM, tokens_BT, cfg, num_targets):
  base = nnx.merge(graphdef, base_state)
  return focus.target_nll(adapter, base, memory_BM, tokens_BT, cfg, num_targets)


def loss_by_position(adapter, base, cfg: focus.FocusConfig, token_docs, max_multiplier: int = 32,
                     *, local_len: int | None = None, num_targets: int = 16, windows: int = 4,
                     max_books: int | None = None, first_range: int | None = None,
                     seed: int = 0) -> dict:
  """Focus and base-alone NLL by doubling position range (module docstring says what is averaged).

  Documents need >= max_multiplier x ctx tokens; shorter ones are skipped."""
  base = _module(base)
  ctx = base.cfg.max_seq_len
  T, Q, s = local_len or ctx // 2, num_targets, cfg.chunk_size
  if not 1 <= Q <= T:
    raise ValueError(f"focus loss_by_position: num_targets ({Q}) must be in [1, local_len={T}]")
  L = ctx * max_multiplier
  books = [np.asarray(d[:L], np.int32) for d in token_docs if len(d) >= L]
  books = books[:max_books] if max_books else books
  if not books:
    raise ValueError(f"focus loss_by_position: no document has >= {L} tokens (context {ctx} x "
                     f"max_multiplier {max_multiplier}); lower max_multiplier or use longer books")
  ranges = evaluate.position_ranges(ctx, L, first_range or ctx)
  graphdef, state = nnx.split(base)
  ends = []
  for r, (a, b) in enumerate(ranges):
    lo, hi = max(a + Q - 1, T), b - 1
    if lo > hi:
      ends.append([])
      continue
    # One memory length per range (one compile, not one per window): draw the band of ends
    # sharing k whole chunks of memory, then the ends inside it.
    rng = np.random.default_rng([seed, r])
    k = int(rng.integers((lo - T) // s, (hi - T) // s + 1))
    lo, hi = max(lo, T + k * s), min(hi, T + (k + 1) * s - 1)
    ends.append(sorted({int(p) for p in rng.integers(lo, hi + 1, windows)}))
  books_BL = np.stack(books)
  no_memory = np.zeros((len(books), 0), np.int32)
  focus_nll = np.full((len(books), len(ranges)), np.nan)
  base_nll = np.full((len(books), len(ranges)), np.nan)
  for r, ps in enumerate(ends):
    if not ps:
      continue
    f_sum, b_sum = np.zeros(len(books)), np.zeros(len(books))
    for p in ps:   # every book in one batch
      M = s * ((p - T) // s)
      window, memory = books_BL[:, p - T:p + 1], books_BL[:, p - T - M:p - T]
      f_sum += np.asarray(_target_nll(graphdef, state, adapter, memory, window, cfg, Q)).mean(1)
      b_sum += np.asarray(_target_nll(graphdef, state, adapter, no_memory, window, cfg, Q)).mean(1)
    focus_nll[:, r], base_nll[:, r] = f_sum / len(ps), b_sum / len(ps)

  def summary(per_book):
    n = per_book.shape[0]
    mean = per_book.mean(0)
    err = per_book.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.zeros_like(mean)
    clean = lambda x: [None if np.isnan(v) else float(v) for v in x]
    return {"mean": clean(mean), "stderr": clean(err),
            "per_book": [clean(row) for row in per_book]}

  return {"context": ctx, "max_len": L, "local_len": T, "num_targets": Q, "chunk_size": s,
          "prompt_len": cfg.prompt_len, "num_books": len(books), "ranges": ranges,
          "window_ends": ends,
          "memory_chunks": [[(p - T) // s for p in ps] for ps in ends],
          "curves": {"focus": summary(focus_nll), "base": summary(base_nll),
                     "gain": summary(base_nll - focus_nll)}}


# ------------------------------------------------------------------------ eval.py entry point


def cast(tree, dtype):
  """Floating leaves of a pytree (an nnx state, an adapter) cast to `dtype`."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      tree)


def _where(trial: dict) -> str:
  if trial["needle_in_memory"]:
    return "memory"
  return "window, in prompt" if trial.get("needle_in_prompt") else "window"


def format_suite(suite: str, r: dict) -> str:
  head = f"== {suite} ({r.get('seconds', 0)} s)"
  if "skipped" in r:
    return f"{head}: skipped: {r['skipped']}"
  fmt = lambda x: "     -" if x is None else f"{x:6.3f}"
  if suite == "focus_passkey":
    lines = [head, f"  base context {r['context']}, chunk {r['chunk_size']}, prompt "
             f"{r['prompt_len']}, {len(r['seeds'])} seeds, {r.get('filler', 'grass')} filler",
             "      x   length   memory  chunks  local   acc  in memory  digits"
             "  candidate reads key  cand mass  needle/cand"]
    none = [None] * len(r["rows"])
    for row, a, am, dm, cr, cm, ns in zip(
        r["rows"], r["accuracy_by_length"], r["accuracy_needle_in_memory"],
        r.get("digits_in_memory", none), r.get("candidate_readout", none),
        r.get("candidate_mass", none), r.get("needle_share", none)):
      lines.append(f"  {row['multiplier']:>5} {row['length']:>8} {row['memory_len']:>8} "
                   f"{row['num_chunks']:>7} {row['local_len']:>6} {fmt(a)}     {fmt(am)} "
                   f"{fmt(dm)}   {fmt(cr)}             {fmt(cm)}       {fmt(ns)}")
    lines += [f"  {row['multiplier']}x skipped: {row['skipped']}" for row in r["rows"]
              if "skipped" in row]
    for row, inside, before in zip(r["rows"], r.get("window_in_prompt", none),
                                   r.get("window_before_prompt", none)):
      if inside and inside[1] + before[1]:
        lines.append(f"  {row['multiplier']:>5}x needles in the window: {inside[0]}/{inside[1]} "
                     f"within the prompt's last {row['prompt_tokens']} tokens, "
                     f"{before[0]}/{before[1]} before them")
    lines += [f"  {row['multiplier']:>5}x digits right by place (first to last): "
              + " ".join(f"{x:.2f}" for x in places)
              for row, places in zip(r["rows"], r.get("digit_places", none)) if places]
    # Every miss, so a cut-off log still says which keys and needles failed, and how.
    lines += [f"  {row['multiplier']:>5}x missed: " + " · ".join(
        f"s{t['seed']} {t['key']} ({_where(t)}) "
        f"{t['output'][:12]!r}" for t in misses)
        for row in r["rows"] if (misses := [t for t in row["trials"] if t.get("correct") is False])]
    for row, ci in zip(r["rows"], r.get("accuracy_interval", none)):
      if ci:
        right = sum(t["correct"] for t in row["trials"])
        lines.append(f"  {row['multiplier']:>5}x accuracy {right}/{len(row['trials'])}, "
                     f"95% interval {ci[0]:.2f}-{ci[1]:.2f}")
    lines.append(f"  overall {fmt(r['overall']).strip()}")
    return "\n".join(lines)
  if suite == "focus_longdoc":
    c = r["curves"]
    lines = [head, f"  {r['num_books']} books, NLL of the last {r['num_targets']} tokens of "
             f"{r['local_len']}-token windows (context {r['context']}, chunk {r['chunk_size']}), "
             f"source: {r.get('source', '-')}", "  range                   focus    base    gain"]
    for i, (a, b) in enumerate(r["ranges"]):
      lines.append(f"  [{a:>7},{b:>7}) " + "  ".join(
          fmt(c[n]["mean"][i]) for n in ("focus", "base", "gain")))
    lines.append("  base = the frozen base on the same local window without memory")
    return "\n".join(lines)
  return head


def serving_config(cfg: focus.FocusConfig, meta: dict, *, chunk_size=None, prompt_len=None,
                   implementation=None, local_len=None):
  """(FocusConfig, local_len) to evaluate an adapter with: the given values, else the adapter's
  as its run serves it (`cfg`: focus.eval_prompt_len's prompt; the window it trained on)."""
  keep = lambda given, own: own if given is None else given   # 0 reaches FocusConfig's check
  cfg = dataclasses.replace(cfg, chunk_size=keep(chunk_size, cfg.chunk_size),
                            prompt_len=keep(prompt_len, cfg.prompt_len),
                            implementation=implementation or cfg.implementation)
  return cfg, keep(local_len, meta.get("local_len"))


def run(base_path: str, adapter_path: str, *, suites=FOCUS_SUITES, books: str | None = None,
        max_multiplier: int = 32, max_books: int = 8, multipliers=DEFAULT_MULTIPLIERS,
        seeds: int = 10, local_len: int | None = None, chunk_size: int | None = None,
        prompt_len: int | None = None, implementation: str | None = None,
        dtype: str = "float32", base_attention: str = "xla", passkey_batch: int = 1,
        passkey_filler: str = "grass", out_dir: str | None = None, log=print) -> dict:
  """eval.py's FocusLLM suites: loads the base (`base_path`, a workdir or checkpoints/<step>) and
  the adapter (`adapter_path`: a FocusLLM run workdir, its latest checkpoint, or one of its
  checkpoints/<step>), writes <suite>.json and focus_results.json under out_dir (default: the
  run's eval/, or eval/adapter_<step> for an explicit step). `local_len` defaults to the window
  the adapter trained on; `chunk_size` and `prompt_len` to the adapter's as its run serves it
  (focus.eval_prompt_len, else the trained prompt). A longer prompt than trained lets every
  candidate read more of the window: needles in the window but before the trained prompt are
  missed otherwise. `dtype` casts base and adapter once (bfloat16: faster on GPU; the chunk
  caches follow it). `base_attention` replaces the base's attention implementation
  (adapter.with_attention says why). `passkey_batch` trials share one generate call;
  `passkey_filler` "books" fills the passkey prompts with the first of `books` instead of the
  official filler."""
  unknown = set(suites) - set(FOCUS_SUITES)
  if unknown:
    raise ValueError(f"unknown focus suites {sorted(unknown)}; allowed: {list(FOCUS_SUITES)}")
  if passkey_filler not in ("grass", "books") or (passkey_filler == "books" and not books):
    raise ValueError(f"focus passkey filler {passkey_filler!r}: must be 'grass' or 'books' (books "
                     "needs --books)")
  m = loaded_lib.load(base_path)
  adapter, cfg, meta = adapter_lib.load(adapter_path, m.model)
  graphdef, state = nnx.split(adapter_lib.with_attention(m.model, base_attention))
  base, adapter = nnx.merge(graphdef, cast(state, dtype)), cast(adapter, dtype)
  cfg, local_len = serving_config(cfg, meta, chunk_size=chunk_size, prompt_len=prompt_len,
                                  implementation=implementation, local_len=local_len)
  explicit = os.path.basename(os.path.dirname(os.path.abspath(adapter_path))) == "checkpoints"
  out_dir = out_dir or os.path.join(meta["workdir"], "eval",
                                    f"adapter_{meta['step']}" if explicit else "")
  os.makedirs(out_dir, exist_ok=True)
  ctx = m.trained_len
  log(f"focaljax focus eval: base {m.workdir} step {m.step} (context {ctx}; the adapter was "
      f"trained on {meta['base_workdir']}), adapter {meta['workdir']} step {meta['step']}, {cfg}, "
      f"local window "
      f"{local_len or ctx // 2}, {dtype}, base attention {base_attention}")
  results = {"meta": {"base": m.workdir, "base_step": m.step, "adapter": meta["workdir"],
                      "adapter_step": meta["step"],
                      "focus": dataclasses.asdict(cfg), "local_len": local_len or ctx // 2,
                      "dtype": dtype, "context": ctx,
                      "suites": list(suites)}}

  def longdoc():
    if not books:
      raise ValueError("focus_longdoc needs long documents (--books)")
    L = ctx * max_multiplier
    docs = evaluate.load_books(books, m.tokenizer, max_books, min_tokens=L, max_tokens=L)
    return {**loss_by_position(adapter, base, cfg, docs, max_multiplier, local_len=local_len),
            "source": books}

  def passkey_suite():
    filler_ids = None   # read only when the suite runs: a whole book takes seconds to tokenize
    if passkey_filler == "books":
      filler_ids = evaluate.load_books(books, m.tokenizer, 1,
                                       max_tokens=ctx * max(multipliers))[0]
    return passkey(adapter, base, cfg, m.tokenizer, multipliers, seeds, local_len=local_len,
                   batch_size=passkey_batch, filler_ids=filler_ids, log=log)

  tasks = {"focus_passkey": passkey_suite,
           "focus_longdoc": longdoc}
  for suite in FOCUS_SUITES:
    if suite not in suites:
      continue
    t0 = time.time()
    try:
      result = tasks[suite]()
    except (ValueError, FileNotFoundError) as e:
      result = {"skipped": str(e)}   # one unusable suite must not lose the other
    result["seconds"] = round(time.time() - t0, 1)
    results[suite] = result
    with open(os.path.join(out_dir, f"{suite}.json"), "w") as f:
      json.dump(result, f, indent=1)
    log(format_suite(suite, result))
  path = os.path.join(out_dir, "focus_results.json")
  with open(path, "w") as f:
    json.dump(results, f, indent=1)
  log(f"results: {path}")
  return results
