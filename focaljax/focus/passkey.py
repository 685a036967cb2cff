"""FocusLLM passkey retrieval far beyond the base's context, the official protocol.

The input of `length` tokens keeps that length exactly: the local window is the largest
T <= local_len with (length - T) % chunk_size == 0, or the smallest above it when that one would
not hold the question (`local_len_for`; rows record T), and the memory before it is whole chunks.

passkey (the official eval_passkey.py's protocol): the grass/sky/sun filler with
"The pass key is K. Remember it. K is the pass key." split at a random point, the task text in
front and "What is the pass key? The pass key is" at the end (focaljax/data/retrieval.py builds it
to exactly the requested number of tokens), 10 trials per length with seeds 0-9, greedy decoding
(focus/generate.py). Seed s draws the key then the depth from default_rng(s): the key is
5 digits (10000-99999, the same keys as retrieval.passkey; the official code draws 1-50000), the
depth uniform in [0, 1) like the official random split point. A trial is correct when the leading
number of the continuation is exactly K. As in the official code the needle can land in the local
window (at 2x, about T / length of the trials); `accuracy_needle_in_memory` counts only the trials
whose needle lies wholly in the memory, `window_in_prompt` / `window_before_prompt` [right, trials]
for needles in the window that lie within / before its last prompt_tokens (which every chunk's
dynamic prompt repeats, so every candidate reads them too), and `digits_in_memory` the mean share
of the in-memory keys' digits read in place (`key_digits`: partial reads); `accuracy_interval`
each length's 95% Wilson interval; `digit_places`, over every trial, the share right
at each place of the key from its first digit. For those in memory, `candidate_readout` is the
share whose needle chunk's candidate, read through the base's LM head, predicts the key's first
token with a digit by itself (knowing the key, whether or not the local decoder then uses it);
for a key spelled " ", "8", ... that is "8", read at the step after the first generated token.
`candidate_mass` is the layer-mean attention that the first answer token puts on all
candidates, and `needle_share` the needle chunk's candidate's share of it (uniform: 1 /
chunks); every trial keeps both per layer.
"""

from __future__ import annotations

import re
import time

import numpy as np

from focaljax.focus import model as focus
from focaljax.focus import generate as focus_generate
from focaljax.data import retrieval

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


def _find(seq: np.ndarray, sub: list[int]) -> int:
  windows = np.lib.stride_tricks.sliding_window_view(seq, len(sub))
  hits = np.flatnonzero((windows == np.asarray(sub)).all(axis=1))
  return int(hits[0]) if hits.size else -1


def _share(flags) -> float | None:
  return float(np.mean(flags)) if flags else None


def wilson_interval(right: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
  """The 95% Wilson score interval of a share right/n: what 10 trials can tell apart (8 of 10
  right is 0.49-0.94, so 0.8 and 0.9 are one trial and not distinguishable)."""
  if n == 0:
    return None
  p, z2 = right / n, z * z
  mid, half = (p + z2 / (2 * n)), z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
  return (float((mid - half) / (1 + z2 / n)), float((mid + half) / (1 + z2 / n)))


def _tally(trials: list[dict]) -> list[int]:
  return [sum(bool(t.get("correct")) for t in trials), len(trials)]


def _places(rows: list[list[bool]]) -> list[float] | None:
  return np.mean(rows, axis=0).tolist() if rows else None


def _leading_number(output: str) -> str:
  """The digits the answer starts with (after spaces), or ""."""
  match = re.match(r"\s*(\d+)", output)
  return match.group(1) if match else ""


def key_digits(output: str, key: int) -> float:
  """Share of the key's digits that the answer's leading number has in the same place, counted
  from the last digit: a partial read (" 75381." for 85381: 0.8) that exact match scores 0."""
  got, want = _leading_number(output), str(key)
  return sum(a == b for a, b in zip(reversed(got), reversed(want))) / len(want)


def digit_places(output: str, key: int) -> list[bool]:
  """Per place of the key, from its first digit: does the answer's leading number have it? (A
  digit-per-token tokenizer tends to miss the first place alone.)"""
  got, want = _leading_number(output), str(key)
  return [i < len(got) and got[i] == c for i, c in enumerate(want)]


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
    try:   # the candidates' positions bound the memory: this length only
      focus.check_positions(base.cfg, cfg, T, cfg.prompt_tokens(T), max_new - 1, L - T)
    except ValueError as e:
      row["skipped"] = str(e)
      continue
    t0 = time.time()
    P = cfg.prompt_tokens(T)   # the dynamic prompt every chunk's candidate reads: the window's last P
    row["prompt_tokens"] = P
    prompts = []
    for s, key, depth in draws:
      p = np.asarray(retrieval.passkey_prompt(tokenizer, L, depth, key, filler_ids), np.int32)
      needle = tokenizer.encode(retrieval.PASSKEY_NEEDLE.format(key=key))
      at = _find(p, needle)
      prompts.append(p)
      row["trials"].append({"seed": s, "key": key, "depth": depth, "needle_at": at,
                            "needle_end": at + len(needle) - 1,
                            "needle_in_memory": 0 <= at and at + len(needle) <= L - T,
                            "needle_in_prompt": at >= L - P})
    for i in range(0, len(prompts), batch_size):
      batch = np.stack(prompts[i:i + batch_size])
      out, readout = focus_generate.generate(adapter, base, batch[:, :L - T], batch[:, L - T:],
                                             cfg, max_new_tokens=max_new, readout=True)
      mass_BLC = np.asarray(readout["candidate_mass"]).transpose(1, 0, 2)
      for trial, new, top_SC, mass_LC in zip(row["trials"][i:i + batch_size],
                                             np.asarray(out)[:, T:],
                                             np.asarray(readout["candidate_top_steps"]), mass_BLC):
        # Where the first answer token looks, per layer: all candidates, and the needle's.
        trial["candidate_mass"] = [round(float(x), 5) for x in mass_LC.sum(-1)]
        if trial["needle_in_memory"]:
          needle_L = mass_LC[:, trial["needle_end"] // cfg.chunk_size]
          trial["needle_mass"] = [round(float(x), 5) for x in needle_L]
          trial["needle_share"] = float(needle_L.sum() / max(mass_LC.sum(), 1e-30))
        text = tokenizer.decode(new.tolist())
        trial.update(output=text, correct=_leading_number(text) == str(trial["key"]),
                     digits=key_digits(text, trial["key"]),
                     digit_places=digit_places(text, trial["key"]))
        # The key's first token with a digit: a tokenizer that spells " 86556" as " ", "8", ...
        # (LLaMA's, train:N:llama_digits) puts a bare space first, which says nothing about the
        # key, so the readout is at the step that predicts "8" (the one after the space).
        key_ids = tokenizer.encode(f" {trial['key']}")
        at = next(j for j, t in enumerate(key_ids)
                  if any(c.isdigit() for c in tokenizer.decode([t])))
        if trial["needle_in_memory"] and at < len(top_SC):
          # Does the chunk holding the needle's end predict that token by itself?
          trial["candidate_reads_key"] = bool(top_SC[at, trial["needle_end"] // cfg.chunk_size]
                                              == key_ids[at])
    row["seconds"] = round(time.time() - t0, 1)
    if log:
      # The whole row as it finishes: a run cut short by its wall limit still reports it.
      mem = [t for t in row["trials"] if t["needle_in_memory"]]
      shares = [t["needle_share"] for t in mem]
      log(f"  focus passkey {m}x ({L} tokens): {sum(t['correct'] for t in row['trials'])}"
          f"/{len(seeds)} in {row['seconds']} s; needle in memory "
          f"{sum(t['correct'] for t in mem)}/{len(mem)}, cand mass "
          f"{np.mean([np.mean(t['candidate_mass']) for t in row['trials']]):.3f}, needle/cand "
          + (f"{np.mean(shares):.3f}" if shares else "-"))

  def acc(trials):
    return _share([t["correct"] for t in trials])

  by_length = [acc(r["trials"]) for r in rows]
  scored = [a for a in by_length if a is not None]
  return {"context": ctx, "chunk_size": cfg.chunk_size, "prompt_len": cfg.prompt_len,
          "filler": "grass" if filler_ids is None else "text", "seeds": seeds,
          "max_new_tokens": max_new, "min_length": overhead,
          "multipliers": list(multipliers), "lengths": [r["length"] for r in rows],
          "accuracy_by_length": by_length,
          "accuracy_interval": [wilson_interval(*_tally(r["trials"])) for r in rows],
          "accuracy_needle_in_memory": [acc([t for t in r["trials"] if t["needle_in_memory"]])
                                        for r in rows],
          "digits_in_memory": [_share([t["digits"] for t in r["trials"] if t["needle_in_memory"]])
                               for r in rows],
          # Needles in the local window, split by whether every candidate's dynamic prompt holds
          # them too: [right, trials] within the window's last prompt_tokens, and before them.
          "window_in_prompt": [_tally([t for t in r["trials"] if t.get("needle_in_prompt")])
                               for r in rows],
          "window_before_prompt": [_tally([t for t in r["trials"] if not t["needle_in_memory"]
                                           and not t.get("needle_in_prompt")]) for r in rows],
          # Every trial's share of right digits per place of the key (first digit first).
          "digit_places": [_places([t["digit_places"] for t in r["trials"]
                                    if "digit_places" in t]) for r in rows],
          "candidate_readout": [_share([t["candidate_reads_key"] for t in r["trials"]
                                        if "candidate_reads_key" in t]) for r in rows],
          # Layer-mean attention of the first answer token on all candidates, and the needle
          # candidate's share of it (uniform would be 1 / chunks).
          "candidate_mass": [_share([np.mean(t["candidate_mass"]) for t in r["trials"]
                                     if "candidate_mass" in t]) for r in rows],
          "needle_share": [_share([t["needle_share"] for t in r["trials"] if "needle_share" in t])
                           for r in rows],
          "overall": float(np.mean(scored)) if scored else None, "rows": rows}
