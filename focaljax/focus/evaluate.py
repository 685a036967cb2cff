"""FocusLLM evaluation far beyond the base's context ("ctx"), and eval.py's entry point `run`.
The window T defaults to the one the adapter trained on, else ctx // 2 (the official ratio).

passkey: the official protocol (data/retrieval.py's prompt; greedy decoding; right when the
answer's leading number is the key), T the largest <= local_len leaving whole chunks before it.
Per length also: accuracy with the needle in memory, digits right by place, needles in the window
within / before the prompt every chunk repeats, a 95% Wilson interval, `candidate_readout` (the
needle chunk's candidate alone predicts the key's first digit token), `candidate_mass` (the first
answer token's attention on all candidates) and `needle_share` (the needle chunk's part of it).

loss_by_position: `focus.target_nll` of windows ending in doubling ranges to max_multiplier x ctx,
one memory length per range (one compile), all books in one batch; `base` is the frozen base alone
on the same windows, `gain` = base - focus per book.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from focaljax.data import retrieval
from focaljax.evaluation import loading as loaded_lib
from focaljax.evaluation import suites as evaluate
from focaljax.evaluation.retrieval import leading_number, passkey_budget
from focaljax.focus import train as focus_train
from focaljax.focus import generate as focus_generate
from focaljax.focus import model as focus
from focaljax.train import checkpoint

FOCUS_SUITES = ("focus_passkey", "focus_longdoc")
DEFAULT_MULTIPLIERS = (2, 8, 32, 100)   # the paper's Fig. 1 spans 2K..400K on a 4K base


class UnreadableBase(ValueError):
  """The base has layers FocusLLM cannot read (focus.model.check_base); eval.py: one line."""


def local_len_for(length: int, chunk_size: int, local_len: int, min_len: int = 1,
                  max_len: int | None = None) -> int:
  """The local window T for a `length`-token input, length - T a multiple of chunk_size: the
  largest T <= local_len, or (below min_len) the smallest >= min_len if it is <= max_len."""
  if length <= local_len:
    return length
  # T ≡ length (mod chunk_size): the memory before the window is whole chunks.
  below = local_len - (local_len - length) % chunk_size
  if below >= min_len:
    return below
  up = min_len + (length - min_len) % chunk_size
  if up <= min(length, max_len or length):
    return up
  raise ValueError(f"focus: no local window for {length} tokens leaves whole chunks of "
                   f"chunk_size {chunk_size} before it with {min_len} <= window <= "
                   f"{min(length, max_len or length)} (local_len {local_len}); change local_len "
                   "or chunk_size")


def _tally(trials: list[dict]) -> list[int]:
  return [sum(bool(t.get("correct")) for t in trials), len(trials)]


def _fmt(x) -> str:
  return "     -" if x is None else f"{x:6.3f}"


def wilson_interval(right: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
  """The 95% Wilson score interval of a share right/n (8 of 10 right: 0.49–0.94)."""
  if n == 0:
    return None
  p, z2 = right / n, z * z
  mid, half = (p + z2 / (2 * n)), z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
  # The bounds lie in [0, 1]; clipped only against rounding (0 right: -1e-17, not -0.00).
  return tuple(float(np.clip(b / (1 + z2 / n), 0.0, 1.0)) for b in (mid - half, mid + half))


def digit_places(output: str, key: int) -> list[bool]:
  """Per place of the key, from its first digit: does the answer's leading number have it?"""
  got, want = leading_number(output), str(key)
  return [i < len(got) and got[i] == c for i, c in enumerate(want)]


def _score(trial, new, top_SC, mass_LC, tokenizer, chunk_size) -> None:
  """Fills one trial from its generated tokens and the readout."""
  key, text, c = trial["key"], tokenizer.decode(new.tolist()), trial["needle_end"] // chunk_size
  trial["candidate_mass"] = [round(float(x), 5) for x in mass_LC.sum(-1)]
  if trial["needle_in_memory"]:
    trial["needle_mass"] = [round(float(x), 5) for x in mass_LC[:, c]]
    trial["needle_share"] = float(mass_LC[:, c].sum() / max(mass_LC.sum(), 1e-30))
  trial.update(output=text, correct=leading_number(text) == str(key),
               digit_places=digit_places(text, key))
  # The key's first token with a digit: a tokenizer spelling " 86556" as " ", "8", ... puts a
  # bare space first, which says nothing about the key.
  key_ids = tokenizer.encode(f" {key}")
  at = next(j for j, t in enumerate(key_ids) if any(c.isdigit() for c in tokenizer.decode([t])))
  if trial["needle_in_memory"] and at < len(top_SC):
    trial["candidate_reads_key"] = bool(top_SC[at, c] == key_ids[at])


def passkey(adapter, base, cfg: focus.FocusConfig, tokenizer, multipliers=DEFAULT_MULTIPLIERS,
            seeds=10, *, local_len: int | None = None, batch_size: int = 1, log=None) -> dict:
  """Passkey accuracy per length m x ctx (module docstring) and every trial's generation. `seeds`:
  a count or a list; `batch_size` trials share a generate call (their chunk caches add up)."""
  if batch_size < 1:
    raise ValueError(f"focus passkey: batch_size (eval.py --focus_passkey_batch) must be >= 1; "
                     f"got {batch_size}")
  base = loaded_lib.module(base)
  ctx = base.cfg.max_seq_len
  seeds = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
  local_len = local_len or ctx // 2
  rngs = [np.random.default_rng(s) for s in seeds]   # the key, then the depth
  draws = [(s, int(r.integers(10_000, 100_000)), float(r.random())) for s, r in zip(seeds, rngs)]
  max_new, overhead = passkey_budget(tokenizer, [k for _, k, _ in draws])
  question = len(tokenizer.encode(retrieval.PASSKEY_QUESTION))
  mean = lambda values: float(np.mean(values)) if values else None
  share = lambda key, ts: mean([t[key] for t in ts if key in t])
  memory = lambda ts: [t for t in ts if t["needle_in_memory"]]
  cand_mass = lambda ts: mean([np.mean(t["candidate_mass"]) for t in ts])
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
    P = cfg.prompt_tokens(T)
    try:   # the candidates' positions bound the memory: this length only
      focus.check_positions(base.cfg, cfg, T, P, max_new - 1, L - T)
    except ValueError as e:
      row["skipped"] = str(e)
      continue
    t0, row["prompt_tokens"], prompts = time.time(), P, []
    for s, key, depth in draws:
      prompts.append(np.asarray(retrieval.passkey_prompt(tokenizer, L, depth, key), np.int32))
      needle = tokenizer.encode(retrieval.PASSKEY_NEEDLE.format(key=key))
      hits = np.flatnonzero((np.lib.stride_tricks.sliding_window_view(
          prompts[-1], len(needle)) == np.asarray(needle)).all(axis=1))
      at = int(hits[0]) if hits.size else -1
      row["trials"].append({"seed": s, "key": key, "depth": depth, "needle_at": at,
                            "needle_end": at + len(needle) - 1,
                            "needle_in_memory": 0 <= at and at + len(needle) <= L - T,
                            "needle_in_prompt": at >= L - P})
    for i in range(0, len(prompts), batch_size):
      batch = np.stack(prompts[i:i + batch_size])
      out, readout = focus_generate.generate(adapter, base, batch[:, :L - T], batch[:, L - T:],
                                             cfg, max_new_tokens=max_new, readout=True)
      for args in zip(row["trials"][i:i + batch_size], np.asarray(out)[:, T:],
                      np.asarray(readout["candidate_top_steps"]),
                      np.asarray(readout["candidate_mass"]).transpose(1, 0, 2)):
        _score(*args, tokenizer, cfg.chunk_size)
    row["seconds"] = round(time.time() - t0, 1)
    if log:   # each row as it finishes: a run cut short by its wall limit still reports it
      ts, mem = row["trials"], memory(row["trials"])
      log(f"  focus passkey {m}x ({L} tokens): {_tally(ts)[0]}/{len(seeds)} in {row['seconds']} "
          f"s; needle in memory {_tally(mem)[0]}/{len(mem)}, cand mass {cand_mass(ts):.3f}, "
          f"needle/cand {_fmt(share('needle_share', ts)).strip()}")

  by_row = lambda f: [f(r["trials"]) for r in rows]
  by_length = by_row(lambda ts: share("correct", ts))
  scored = [a for a in by_length if a is not None]
  return {"context": ctx, "chunk_size": cfg.chunk_size, "prompt_len": cfg.prompt_len,
          "seeds": seeds, "max_new_tokens": max_new, "min_length": overhead,
          "multipliers": list(multipliers), "lengths": [r["length"] for r in rows],
          "accuracy_by_length": by_length,
          "accuracy_interval": by_row(lambda ts: wilson_interval(*_tally(ts))),
          "accuracy_needle_in_memory": by_row(lambda ts: share("correct", memory(ts))),
          "window_in_prompt": by_row(lambda ts: _tally([t for t in ts if t["needle_in_prompt"]])),
          "window_before_prompt": by_row(lambda ts: _tally([
              t for t in ts if not t["needle_in_memory"] and not t["needle_in_prompt"]])),
          "digit_places": by_row(lambda ts: np.mean([t["digit_places"] for t in ts], axis=0)
                                 .tolist() if ts else None),
          "candidate_readout": by_row(lambda ts: share("candidate_reads_key", ts)),
          "candidate_mass": by_row(cand_mass),
          "needle_share": by_row(lambda ts: share("needle_share", ts)),
          "overall": float(np.mean(scored)) if scored else None, "rows": rows}


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "num_targets"))
def _target_nll(graphdef, base_state, adapter, memory_BM, tokens_BT, cfg, num_targets):
  base = nnx.merge(graphdef, base_state)
  return focus.target_nll(adapter, base, memory_BM, tokens_BT, cfg, num_targets)


def loss_by_position(adapter, base, cfg: focus.FocusConfig, token_docs, max_multiplier: int = 32,
                     *, local_len: int | None = None, num_targets: int = 16,
                     windows: int = 4) -> dict:
  """Focus and base-alone NLL by doubling position range (module docstring) over the documents
  of >= max_multiplier x ctx tokens."""
  base = loaded_lib.module(base)
  ctx = base.cfg.max_seq_len
  T, Q, s = local_len or ctx // 2, num_targets, cfg.chunk_size
  if not 1 <= Q <= T:
    raise ValueError(f"focus loss_by_position: num_targets ({Q}) must be in [1, local_len={T}]")
  L = ctx * max_multiplier
  books = [np.asarray(d[:L], np.int32) for d in token_docs if len(d) >= L]
  if not books:
    raise ValueError(f"focus loss_by_position: no document has >= {L} tokens (context {ctx} x "
                     f"max_multiplier {max_multiplier}); lower max_multiplier or use longer books")
  ranges = evaluate.position_ranges(ctx, L, ctx)
  graphdef, state = nnx.split(base)
  ends = []
  for r, (a, b) in enumerate(ranges):
    lo, hi = max(a + Q - 1, T), b - 1   # every target in the range, a whole window before it
    if lo > hi:
      ends.append([])
      continue
    rng = np.random.default_rng([0, r])
    k = int(rng.integers((lo - T) // s, (hi - T) // s + 1))   # the range's whole memory chunks
    lo, hi = max(lo, T + k * s), min(hi, T + (k + 1) * s - 1)
    ends.append(sorted({int(p) for p in rng.integers(lo, hi + 1, windows)}))
  books_BL = np.stack(books)
  # The memory before the window ending at p: its whole chunks, or none for the base alone.
  memory = {"focus": lambda p: books_BL[:, p - T - s * ((p - T) // s):p - T],
            "base": lambda p: books_BL[:, :0]}
  nll = {name: np.full((len(books), len(ranges)), np.nan) for name in memory}
  for r, ps in enumerate(ends):
    for name, memory_at in memory.items():
      per_window = [_target_nll(graphdef, state, adapter, memory_at(p), books_BL[:, p - T:p + 1],
                                cfg, Q).mean(1) for p in ps]
      if per_window:
        nll[name][:, r] = np.mean(per_window, axis=0)
  return {"context": ctx, "max_len": L, "local_len": T, "num_targets": Q, "chunk_size": s,
          "prompt_len": cfg.prompt_len, "num_books": len(books), "ranges": ranges,
          "window_ends": ends, "memory_chunks": [[(p - T) // s for p in ps] for ps in ends],
          "curves": {"focus": evaluate.summary(nll["focus"]), "base": evaluate.summary(
              nll["base"]), "gain": evaluate.summary(nll["base"] - nll["focus"])}}


def cast(tree, dtype):
  """Floating leaves of a pytree (an nnx state, an adapter) cast to `dtype`."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      tree)


def _format_passkey(head: str, r: dict) -> list[str]:
  lines = [head, f"  base context {r['context']}, chunk {r['chunk_size']}, prompt "
           f"{r['prompt_len']}, {len(r['seeds'])} seeds",
           "      x   length   memory  chunks  local   acc  in memory"
           "  candidate reads key  cand mass  needle/cand"]
  for i, row in enumerate(r["rows"]):
    a, am, cr, cm, ns = (_fmt(r[c][i]) for c in (
        "accuracy_by_length", "accuracy_needle_in_memory", "candidate_readout", "candidate_mass",
        "needle_share"))
    lines.append(f"  {row['multiplier']:>5} {row['length']:>8} {row['memory_len']:>8} "
                 f"{row['num_chunks']:>7} {row['local_len']:>6} {a}     {am}   {cr}"
                 f"             {cm}       {ns}")
  for i, row in enumerate(r["rows"]):
    x = f"  {row['multiplier']:>5}x"
    inside, before = r["window_in_prompt"][i], r["window_before_prompt"][i]
    if "skipped" in row:
      lines.append(f"  {row['multiplier']}x skipped: {row['skipped']}")
    if inside[1] + before[1]:
      lines.append(f"{x} needles in the window: {inside[0]}/{inside[1]} within the prompt's "
                   f"last {row['prompt_tokens']} tokens, {before[0]}/{before[1]} before them")
    if r["digit_places"][i]:
      lines.append(f"{x} digits right by place (first to last): "
                   + " ".join(f"{p:.2f}" for p in r["digit_places"][i]))
    # Every miss, so a cut-off log still says which keys and needles failed, and how.
    where = lambda t: ("memory" if t["needle_in_memory"] else
                       "window, in prompt" if t["needle_in_prompt"] else "window")
    misses = [f"s{t['seed']} {t['key']} ({where(t)}) {t['output'][:12]!r}"
              for t in row["trials"] if t.get("correct") is False]
    lines += [f"{x} missed: " + " · ".join(misses)] if misses else []
    if (ci := r["accuracy_interval"][i]):
      lines.append(f"{x} accuracy {_tally(row['trials'])[0]}/{len(row['trials'])}, "
                   f"95% interval {ci[0]:.2f}–{ci[1]:.2f}")
  return lines + [f"  overall {_fmt(r['overall']).strip()}"]


def format_suite(suite: str, r: dict) -> str:
  head = f"== {suite} ({r.get('seconds', 0)} s)"
  if "skipped" in r:
    return f"{head}: skipped: {r['skipped']}"
  if suite == "focus_passkey":
    return "\n".join(_format_passkey(head, r))
  if suite == "focus_longdoc":
    c = r["curves"]
    lines = [head, f"  {r['num_books']} books, NLL of the last {r['num_targets']} tokens of "
             f"{r['local_len']}-token windows (context {r['context']}, chunk {r['chunk_size']}), "
             f"source: {r.get('source', '-')}", "  range                   focus    base    gain"]
    lines += [f"  [{a:>7},{b:>7}) " + "  ".join(_fmt(c[n]["mean"][i]) for n in c)
              for i, (a, b) in enumerate(r["ranges"])]
    return "\n".join(lines + ["  base = the frozen base on the same local window without memory"])
  return head


def serving_config(cfg: focus.FocusConfig, meta: dict, *, chunk_size=None, prompt_len=None,
                   implementation=None, local_len=None):
  """(FocusConfig, local_len) to serve an adapter with: the given values, else its run's."""
  keep = lambda given, own: own if given is None else given   # 0 reaches FocusConfig's check
  cfg = dataclasses.replace(cfg, chunk_size=keep(chunk_size, cfg.chunk_size),
                            prompt_len=keep(prompt_len, cfg.prompt_len),
                            implementation=implementation or cfg.implementation)
  return cfg, keep(local_len, meta.get("local_len"))


def run(base_path: str, adapter_path: str, *, suites=FOCUS_SUITES, books: str | None = None,
        max_multiplier: int = 32, max_books: int = 8, multipliers=DEFAULT_MULTIPLIERS,
        seeds: int = 10, local_len: int | None = None, chunk_size: int | None = None,
        prompt_len: int | None = None, implementation: str | None = None,
        dtype: str = "float32", passkey_batch: int = 1,
        out_dir: str | None = None, log=print) -> dict:
  """eval.py's FocusLLM suites over the base `base_path` and the adapter `adapter_path` (a run
  workdir or one of its checkpoints/<step>), written under out_dir (default: the run's eval/, or
  eval/adapter_<step>). `dtype` casts base and adapter once."""
  evaluate.check_suites(suites, FOCUS_SUITES)
  m = loaded_lib.load(base_path)
  try:   # before the adapter, whose restore would raise it as a traceback
    focus.check_base(m.config)
  except NotImplementedError as e:
    raise UnreadableBase(f"{m.workdir} cannot be a FocusLLM base: {e}") from None
  adapter, cfg, meta = focus_train.load(adapter_path, m.model)
  graphdef, state = nnx.split(focus_train.with_attention(m.model, "xla"))
  base, adapter = nnx.merge(graphdef, cast(state, dtype)), cast(adapter, dtype)
  cfg, local_len = serving_config(cfg, meta, chunk_size=chunk_size, prompt_len=prompt_len,
                                  implementation=implementation, local_len=local_len)
  explicit = focus_train.resolve(adapter_path)[1] is not None
  out_dir = out_dir or str(epath.Path(meta["workdir"]) / "eval" /
                           (f"adapter_{meta['step']}" if explicit else ""))
  ctx = m.trained_len
  try:   # the same shapes restore, so only the recorded path tells another base apart
    trained_on = checkpoint.resolve(meta["base_workdir"])[0]
  except (FileNotFoundError, KeyError):
    trained_on = None   # moved, or not recorded
  if trained_on and trained_on != m.workdir:
    log(f"warning: the adapter was trained on the base {trained_on}, not {m.workdir}")
  log(f"focaljax focus eval: base {m.workdir} step {m.step} (context {ctx}), adapter "
      f"{meta['workdir']} step {meta['step']} (trained on {meta['base_workdir']}), {cfg}, "
      f"local window {local_len or ctx // 2}, {dtype}")

  def longdoc():
    if not books:
      raise ValueError("focus_longdoc needs long documents (--books)")
    L = ctx * max_multiplier
    docs = evaluate.load_books(books, m.tokenizer, max_books, min_tokens=L, max_tokens=L)
    return {**loss_by_position(adapter, base, cfg, docs, max_multiplier, local_len=local_len),
            "source": books}

  tasks = {"focus_passkey": lambda: passkey(adapter, base, cfg, m.tokenizer, multipliers, seeds,
                                            local_len=local_len, batch_size=passkey_batch,
                                            log=log),
           "focus_longdoc": longdoc}
  results = {"meta": {"base": m.workdir, "base_step": m.step, "adapter": meta["workdir"],
                      "adapter_step": meta["step"], "focus": dataclasses.asdict(cfg),
                      "local_len": local_len or ctx // 2, "dtype": dtype, "context": ctx,
                      "suites": list(suites)}}
  evaluate.run_suites(tasks, suites, out_dir, results, "focus_results.json", format_suite, log)
  log(f"results: {epath.Path(out_dir) / 'focus_results.json'}")
  return results
