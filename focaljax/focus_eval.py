"""FocusLLM evaluation: passkey retrieval and loss by position far beyond the base's context.

Lengths are multiples of the base's trained context (`base.cfg.max_seq_len`, "ctx" below). Every
input is split into a local window (the last T tokens, the local decoder's input) and the memory
(everything before it, cut into chunks of `cfg.chunk_size`). T defaults (in `run`) to the
adapter run's focus.local_len, the window it was trained on, else ctx // 2, the official ratio
(local_window 2048 on LLaMA-2's 4K). The memory must be whole chunks (focus.chunk_rows):

  passkey           keeps the requested total length exactly and takes the largest window
                    T <= local_len with (length - T) % chunk_size == 0, or the smallest above it
                    when that one would not hold the question (local_len_for; rows record T).
  loss_by_position  keeps T and drops the oldest (p - T) % chunk_size tokens of the document (its
                    beginning) from the memory of a window ending at p.

passkey (notes/focus_focal.md §1.8, the official eval_passkey.py): the grass/sky/sun filler with
"The pass key is K. Remember it. K is the pass key." split at a random point, the task text in
front and "What is the pass key? The pass key is" at the end (focaljax/retrieval.py builds it to
exactly the requested number of tokens), 10 trials per length with seeds 0-9, greedy decoding
(focus_generate.generate). Seed s draws the key then the depth from default_rng(s): the key is
5 digits (10000-99999, the same keys as retrieval.passkey; the official code draws 1-50000), the
depth uniform in [0, 1) like the official random split point. A trial is correct when the leading
number of the continuation is exactly K. As in the official code the needle can land in the local
window (at 2x, about T / length of the trials); `accuracy_needle_in_memory` counts only the trials
whose needle lies wholly in the memory, and `digits_in_memory` the mean share of their key's digits
read in place (`key_digits`: partial reads). For those, `candidate_readout` is the share whose
needle chunk's candidate, read through the base's LM head, predicts the key's first token by itself
(knowing the key, whether or not the local decoder then uses it); trials whose key starts with a
digit-free token (a lone space) get none. `candidate_mass` is the layer-mean attention that the
first answer token puts on all candidates, and `needle_share` the needle chunk's candidate's share
of it (uniform: 1 / chunks); every trial keeps both per layer.

loss_by_position: NLL of long documents in doubling position ranges [0, ctx), [ctx, 2ctx),
[2ctx, 4ctx), ... up to max_multiplier x ctx, through the leak-free `focus.target_nll`. A window
ending at p scores the Q = num_targets targets at positions p-Q+1 .. p of the document (each
predicted from its own candidates, module docstring of focus.py): local tokens doc[p-T .. p-1],
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
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from focaljax import checkpoint
from focaljax import evaluate
from focaljax import focus
from focaljax import focus_adapter
from focaljax import focus_generate
from focaljax import focus_train
from focaljax import loaded as loaded_lib
from focaljax import retrieval

FOCUS_SUITES = ("focus_passkey", "focus_longdoc")
DEFAULT_MULTIPLIERS = (2, 8, 32, 100)   # the paper's Fig. 1 spans 2K..400K on a 4K base


def _module(model):
  return getattr(model, "model", model)


def local_len_for(length: int, chunk_size: int, local_len: int, min_len: int = 1,
                  max_len: int | None = None) -> int:
  """The local window T for a `length`-token input: whole chunks before it, (length - T) %
  chunk_size == 0, and T the largest such value <= local_len, or else (below min_len) the
  smallest above it if that is <= max_len. The whole input when length <= local_len."""
  if length <= local_len:
    return length
  below = local_len - (length - local_len) % chunk_size
  if below >= min_len:
    return below
  above = below + chunk_size
  if above <= min(length, max_len or length):
    return above
  raise ValueError(f"focus: no local window for {length} tokens leaves whole chunks of "
                   f"chunk_size {chunk_size} before it with {min_len} <= window <= "
                   f"{max_len or length} (local_len {local_len}); change local_len or chunk_size")


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "num_targets"))
def _target_nll(graphdef, base_state, adapter, memory_BM, tokens_BT, cfg, num_targets):
  base = nnx.merge(graphdef, base_state)
  return focus.target_nll(adapter, base, memory_BM, tokens_BT, cfg, num_targets)


def _find(seq: np.ndarray, sub: list[int]) -> int:
  windows = np.lib.stride_tricks.sliding_window_view(seq, len(sub))
  hits = np.flatnonzero((windows == np.asarray(sub)).all(axis=1))
  return int(hits[0]) if hits.size else -1


def _share(flags) -> float | None:
  return float(np.mean(flags)) if flags else None


def _leading_number(output: str) -> str:
  """The digits the answer starts with (after spaces), or ""."""
  match = re.match(r"\s*(\d+)", output)
  return match.group(1) if match else ""


def key_digits(output: str, key: int) -> float:
  """Share of the key's digits that the answer's leading number has in the same place, counted
  from the last digit: a partial read (" 75381." for 85381: 0.8) that exact match scores 0."""
  got, want = _leading_number(output), str(key)
  return sum(a == b for a, b in zip(reversed(got), reversed(want))) / len(want)


def passkey(adapter, base, cfg: focus.FocusConfig, tokenizer, multipliers=DEFAULT_MULTIPLIERS,
            seeds=10, *, local_len: int | None = None, batch_size: int = 1, filler_ids=None,
            log=None) -> dict:
  """Passkey accuracy per length m x ctx (module docstring) and every trial's raw generation.

  `seeds`: a count (seeds 0..n-1) or a list. `batch_size` trials share one generate call; 1 by
  default because at 100x a single trial's chunk caches are large. `filler_ids` (a book's tokens)
  replace the official grass/sky/sun filler, whose repeats make every filler chunk's candidate
  nearly the same: a diagnostic, not the protocol.
  """
  if batch_size < 1:
    raise ValueError(f"focus passkey: batch_size (eval.py --focus_passkey_batch) must be >= 1; "
                     f"got {batch_size}")
  base = _module(base)
  ctx = base.cfg.max_seq_len
  seeds = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
  local_len = local_len or ctx // 2
  draws = []
  for s in seeds:
    rng = np.random.default_rng(s)
    draws.append((s, int(rng.integers(10_000, 100_000)), float(rng.random())))
  max_new = max(len(tokenizer.encode(f" {k}")) for _, k, _ in draws) + 1
  question = len(tokenizer.encode(retrieval.PASSKEY_QUESTION))
  overhead = max(len(tokenizer.encode(retrieval.PASSKEY_HEAD + retrieval.PASSKEY_NEEDLE.format(
      key=k) + retrieval.PASSKEY_QUESTION)) for _, k, _ in draws) + 8
  rows = []
  for m in multipliers:
    L = int(m * ctx)
    # The window holds the question (+1 token) and the answer stays inside the trained context.
    T = local_len_for(L, cfg.chunk_size, local_len, question + 1, ctx - max_new + 1)
    row = {"multiplier": m, "length": L, "local_len": T, "memory_len": L - T,
           "num_chunks": (L - T) // cfg.chunk_size, "trials": []}
    rows.append(row)
    if L < overhead:
      continue   # too short for the task text: reported as None, not as failures
    try:   # "sequential" candidate positions refuse long memories: this length only
      focus.check_positions(base.cfg, cfg, T, cfg.prompt_tokens(T), max_new - 1, L - T)
    except ValueError as e:
      row["skipped"] = str(e)
      continue
    t0 = time.time()
    prompts = []
    for s, key, depth in draws:
      p = np.asarray(retrieval.passkey_prompt(tokenizer, L, depth, key, filler_ids), np.int32)
      needle = tokenizer.encode(retrieval.PASSKEY_NEEDLE.format(key=key))
      at = _find(p, needle)
      prompts.append(p)
      row["trials"].append({"seed": s, "key": key, "depth": depth, "needle_at": at,
                            "needle_end": at + len(needle) - 1,
                            "needle_in_memory": 0 <= at and at + len(needle) <= L - T})
    for i in range(0, len(prompts), batch_size):
      batch = np.stack(prompts[i:i + batch_size])
      out, readout = focus_generate.generate(adapter, base, batch[:, :L - T], batch[:, L - T:],
                                             cfg, max_new_tokens=max_new, readout=True)
      mass_BLC = np.asarray(readout["candidate_mass"]).transpose(1, 0, 2)
      # The sink's mass only where there is one (FocusConfig.sink).
      sink_BL = (np.asarray(readout["sink_mass"]).T if cfg.sink != "none"
                 else np.zeros(mass_BLC.shape[:2]))
      for trial, new, top_C, mass_LC, sink_L in zip(row["trials"][i:i + batch_size],
                                                    np.asarray(out)[:, T:],
                                                    np.asarray(readout["candidate_top"]),
                                                    mass_BLC, sink_BL):
        # Where the first answer token looks, per layer: all candidates, the needle's, the sink.
        trial["candidate_mass"] = [round(float(x), 5) for x in mass_LC.sum(-1)]
        if cfg.sink != "none":
          trial["sink_mass"] = [round(float(x), 5) for x in sink_L]
        if trial["needle_in_memory"]:
          needle_L = mass_LC[:, trial["needle_end"] // cfg.chunk_size]
          trial["needle_mass"] = [round(float(x), 5) for x in needle_L]
          trial["needle_share"] = float(needle_L.sum() / max(mass_LC.sum(), 1e-30))
        text = tokenizer.decode(new.tolist())
        trial.update(output=text, correct=_leading_number(text) == str(trial["key"]),
                     digits=key_digits(text, trial["key"]))
        first = tokenizer.encode(f" {trial['key']}")[0]
        # A tokenizer that spells " 86556" as " ", "8", ... makes the first token a bare space:
        # predicting it says nothing about the key, so such trials get no readout.
        if trial["needle_in_memory"] and any(c.isdigit() for c in tokenizer.decode([first])):
          # Does the chunk holding the needle's end predict the key's first token by itself?
          trial["candidate_reads_key"] = bool(top_C[trial["needle_end"] // cfg.chunk_size]
                                              == first)
    row["seconds"] = round(time.time() - t0, 1)
    if log:
      # The whole row as it finishes: a run cut short by its wall limit still reports it
      # (fifteenth session: the copy-initialised adapter's table was lost that way).
      mem = [t for t in row["trials"] if t["needle_in_memory"]]
      shares = [t["needle_share"] for t in mem]
      sinks = [np.mean(t["sink_mass"]) for t in row["trials"] if "sink_mass" in t]
      log(f"  focus passkey {m}x ({L} tokens): {sum(t['correct'] for t in row['trials'])}"
          f"/{len(seeds)} in {row['seconds']} s; needle in memory "
          f"{sum(t['correct'] for t in mem)}/{len(mem)}, cand mass "
          f"{np.mean([np.mean(t['candidate_mass']) for t in row['trials']]):.3f}, needle/cand "
          + (f"{np.mean(shares):.3f}" if shares else "-")
          + (f", sink mass {np.mean(sinks):.3f}" if sinks else ""))

  def acc(trials):
    return _share([t["correct"] for t in trials])

  by_length = [acc(r["trials"]) for r in rows]
  scored = [a for a in by_length if a is not None]
  return {"context": ctx, "chunk_size": cfg.chunk_size, "prompt_len": cfg.prompt_len,
          "filler": "grass" if filler_ids is None else "text", "seeds": seeds,
          "max_new_tokens": max_new, "min_length": overhead,
          "multipliers": list(multipliers), "lengths": [r["length"] for r in rows],
          "accuracy_by_length": by_length,
          "accuracy_needle_in_memory": [acc([t for t in r["trials"] if t["needle_in_memory"]])
                                        for r in rows],
          "digits_in_memory": [_share([t["digits"] for t in r["trials"] if t["needle_in_memory"]])
                               for r in rows],
          "candidate_readout": [_share([t["candidate_reads_key"] for t in r["trials"]
                                        if "candidate_reads_key" in t]) for r in rows],
          # Layer-mean attention of the first answer token on all candidates, and the needle
          # candidate's share of it (uniform would be 1 / chunks).
          "candidate_mass": [_share([np.mean(t["candidate_mass"]) for t in r["trials"]
                                     if "candidate_mass" in t]) for r in rows],
          "needle_share": [_share([t["needle_share"] for t in r["trials"] if "needle_share" in t])
                           for r in rows],
          # FocusConfig.sink: the first answer token's layer-mean attention on the sink.
          "sink_mass": [_share([np.mean(t["sink_mass"]) for t in r["trials"]
                                if "sink_mass" in t]) for r in rows],
          "overall": float(np.mean(scored)) if scored else None, "rows": rows}


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


def resolve_adapter(path: str) -> tuple[str, str, int | None]:
  """(adapter dir, run dir, step) from a focus run workdir (its latest adapter/<step>), an
  adapter/<step> directory, or any directory holding adapter.npz (its own run dir, no step)."""
  path = os.path.abspath(path)
  if os.path.isfile(os.path.join(path, "adapter.npz")):
    parent = os.path.dirname(path)
    if os.path.basename(parent) == focus_train.ADAPTER_DIR and os.path.basename(path).isdigit():
      return path, os.path.dirname(parent), int(os.path.basename(path))
    return path, path, None
  steps = focus_train.saved_steps(path)
  if not steps:
    raise FileNotFoundError(f"--focus_adapter {path}: neither a focus run workdir (no "
                            f"{focus_train.ADAPTER_DIR}/<step>/) nor a directory with adapter.npz")
  return os.path.join(path, focus_train.ADAPTER_DIR, str(steps[-1])), path, None


def cast(tree, dtype):
  """Floating leaves of a pytree (an nnx state, an adapter) cast to `dtype`."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      tree)


def _check_shapes(adapter, base, adapter_dir: str) -> None:
  for i, block in enumerate(base.blocks):
    for name, w in adapter.get(i, {}).items():
      want = getattr(block.attn, name).shape
      if w.shape != want:
        raise ValueError(f"--focus_adapter {adapter_dir}: layer {i} {name} has shape {w.shape}, "
                         f"the base's is {want}; is --workdir the adapter's base?")
  if len(adapter) != len(base.blocks):
    raise ValueError(f"--focus_adapter {adapter_dir}: {len(adapter)} layers, the base has "
                     f"{len(base.blocks)}; is --workdir the adapter's base?")


def format_suite(suite: str, r: dict) -> str:
  head = f"== {suite} ({r.get('seconds', 0)} s)"
  if "skipped" in r:
    return f"{head}: skipped: {r['skipped']}"
  fmt = lambda x: "     -" if x is None else f"{x:6.3f}"
  if suite == "focus_passkey":
    lines = [head, f"  base context {r['context']}, chunk {r['chunk_size']}, prompt "
             f"{r['prompt_len']}, {len(r['seeds'])} seeds, {r.get('filler', 'grass')} filler",
             "      x   length   memory  chunks  local   acc  in memory  digits"
             "  candidate reads key  cand mass  needle/cand  sink mass"]
    none = [None] * len(r["rows"])
    for row, a, am, dm, cr, cm, ns, sm in zip(
        r["rows"], r["accuracy_by_length"], r["accuracy_needle_in_memory"],
        r.get("digits_in_memory", none), r.get("candidate_readout", none),
        r.get("candidate_mass", none), r.get("needle_share", none), r.get("sink_mass", none)):
      lines.append(f"  {row['multiplier']:>5} {row['length']:>8} {row['memory_len']:>8} "
                   f"{row['num_chunks']:>7} {row['local_len']:>6} {fmt(a)}     {fmt(am)} "
                   f"{fmt(dm)}   {fmt(cr)}             {fmt(cm)}       {fmt(ns)}     {fmt(sm)}")
    lines += [f"  {row['multiplier']}x skipped: {row['skipped']}" for row in r["rows"]
              if "skipped" in row]
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


def run(base_path: str, adapter_path: str, *, suites=FOCUS_SUITES, books: str | None = None,
        max_multiplier: int = 32, max_books: int = 8, multipliers=DEFAULT_MULTIPLIERS,
        seeds: int = 10, local_len: int | None = None, chunk_size: int | None = None,
        implementation: str | None = None, candidate_bias: str | None = None,
        sink: str | None = None,
        dtype: str = "float32", base_attention: str = "xla",
        passkey_batch: int = 1, passkey_filler: str = "grass", out_dir: str | None = None,
        log=print) -> dict:
  """eval.py's FocusLLM suites: loads the base (`base_path`, a workdir or checkpoints/<step>) and
  the adapter (resolve_adapter), writes <suite>.json and focus_results.json under out_dir
  (default: the focus run's eval/, or eval/adapter_<step> for an explicit adapter/<step>).
  `local_len` defaults to the focus run's config focus.local_len, else context // 2. `dtype`
  casts base and adapter once (bfloat16: faster on GPU; the chunk caches follow it).
  `base_attention` replaces the base's attention implementation (focus_adapter.with_attention
  says why).
  `candidate_bias` and `sink` override the adapter's (FocusConfig; diagnostics).
  `passkey_batch` trials share one generate call (passkey's batch_size). `passkey_filler`
  "books" fills the passkey prompts with the first of `books` instead of the official filler."""
  unknown = set(suites) - set(FOCUS_SUITES)
  if unknown:
    raise ValueError(f"unknown focus suites {sorted(unknown)}; allowed: {list(FOCUS_SUITES)}")
  if passkey_filler not in ("grass", "books") or (passkey_filler == "books" and not books):
    raise ValueError(f"focus passkey filler {passkey_filler!r}: must be 'grass' or 'books' (books "
                     "needs --books)")
  m = loaded_lib.load(base_path)
  adapter_dir, run_dir, step = resolve_adapter(adapter_path)
  adapter, cfg, recorded_base = focus_adapter.load_adapter(adapter_dir)
  _check_shapes(adapter, m.model, adapter_dir)
  graphdef, state = nnx.split(focus_adapter.with_attention(m.model, base_attention))
  base, adapter = nnx.merge(graphdef, cast(state, dtype)), cast(adapter, dtype)
  cfg = dataclasses.replace(cfg, chunk_size=chunk_size or cfg.chunk_size,
                            implementation=implementation or cfg.implementation,
                            candidate_bias=candidate_bias or cfg.candidate_bias,
                            sink=sink or cfg.sink)
  if local_len is None and os.path.isfile(os.path.join(run_dir, checkpoint.CONFIG_FILE)):
    # Evaluate with the window the adapter was trained on (focus.local_len of its run).
    local_len = checkpoint.read_config(run_dir).get("focus", {}).get("local_len")
  out_dir = out_dir or os.path.join(run_dir, "eval", "" if step is None else f"adapter_{step}")
  os.makedirs(out_dir, exist_ok=True)
  ctx = m.trained_len
  log(f"focaljax focus eval: base {m.workdir} step {m.step} (context {ctx}; the adapter was "
      f"trained on {recorded_base or '?'}), adapter {adapter_dir}, {cfg}, local window "
      f"{local_len or ctx // 2}, {dtype}, base attention {base_attention}")
  results = {"meta": {"base": m.workdir, "base_step": m.step, "adapter": adapter_dir,
                      "focus": dataclasses.asdict(cfg), "local_len": local_len or ctx // 2,
                      "dtype": dtype, "context": ctx,
                      "suites": list(suites)}}

  def longdoc():
    if not books:
      raise ValueError("focus_longdoc needs long documents (--books, or the shared longeval "
                       "corpus)")
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
