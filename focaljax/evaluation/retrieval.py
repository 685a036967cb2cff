"""Passkey (greedy decoding) and keyword (candidate log-likelihoods) accuracy by length and depth,
over the prompts of focaljax.data.retrieval."""

from __future__ import annotations

import re

import numpy as np

from focaljax.data.retrieval import (CANDIDATES, DEFAULT_DEPTHS, PASSKEY_HEAD, PASSKEY_NEEDLE,
                                     PASSKEY_QUESTION, keyword_prompt, passkey_prompt)
from focaljax.evaluation import generate as gen_lib
from focaljax.evaluation import loading


def leading_number(output: str) -> str:
  """The digits an answer starts with (after spaces), or "": a trial is right when this is K."""
  match = re.match(r"\s*(\d+)", output)
  return match.group(1) if match else ""


def passkey_budget(tokenizer, keys) -> tuple[int, int]:
  """(new tokens to generate, the shortest prompt that holds the task text, needle and question)."""
  max_new = max(len(tokenizer.encode(f" {k}")) for k in keys) + 1
  return max_new, max(len(tokenizer.encode(PASSKEY_HEAD + PASSKEY_NEEDLE.format(key=k) +
                                           PASSKEY_QUESTION)) for k in keys) + 8


def _batches(rows: np.ndarray, batch_size: int):
  """Yields (start, batch, n_real), the last batch padded with row 0: one compiled shape."""
  for i in range(0, len(rows), batch_size):
    batch = rows[i:i + batch_size]
    yield i, np.concatenate([batch, np.repeat(rows[:1], batch_size - len(batch), 0)]), len(batch)


def passkey(model, tokenizer, lengths, depths=DEFAULT_DEPTHS, seeds=range(5), *,
            batch_size: int = 32) -> dict:
  """Passkey accuracy per (length, depth) over `seeds` (one random 5-digit key per seed)."""
  module = loading.module(model)
  depths = [float(d) for d in depths]
  keys = [int(np.random.default_rng(s).integers(10_000, 100_000)) for s in seeds]
  max_new, overhead = passkey_budget(tokenizer, keys)
  accuracy, examples = [], []
  for length in lengths:
    if length < overhead:
      # Too short for the task text, needle and question: reported as None, not as failures.
      accuracy.append([None] * len(depths))
      continue
    trials = [(d, k) for d in depths for k in keys]
    rows = np.array([passkey_prompt(tokenizer, length, d, k) for d, k in trials], np.int32)
    texts = []
    for _, batch, n in _batches(rows, min(batch_size, len(rows))):
      out = np.asarray(gen_lib.generate(module, batch, max_new_tokens=max_new))
      texts += [tokenizer.decode(row[length:].tolist()) for row in out[:n]]
    correct = [leading_number(text) == str(key) for (_, key), text in zip(trials, texts)]
    accuracy.append(np.asarray(correct, float).reshape(len(depths), len(keys)).mean(1).tolist())
    examples.append({"length": length, "key": trials[0][1], "output": texts[0]})
  acc = np.asarray(accuracy, float)  # None -> nan
  by_length = [None if np.isnan(a) else float(a) for a in acc.mean(1)]
  return {"lengths": list(lengths), "depths": depths, "trials_per_cell": len(keys),
          "accuracy": accuracy, "accuracy_by_length": by_length,
          "overall": float(np.nanmean(acc)) if not np.isnan(acc).all() else None,
          "min_length": overhead, "examples": examples}


def candidate_loglik(model, prompts_BP: np.ndarray, candidates: list[list[int]], *,
                     batch_size: int = 8) -> np.ndarray:
  """log p(candidate tokens | prompt), float [B, C]. Multi-token candidates are teacher-forced;
  the first such pass also scores every single-token one. Every pass takes the prompt's length as
  RoPE's NTK length, so all candidates see one rotary base."""
  module = loading.module(model)
  B, P = prompts_BP.shape
  out = np.zeros((B, len(candidates)))
  single = [j for j, c in enumerate(candidates) if len(c) == 1]
  # One pass per multi-token candidate (one in all if there is none).
  passes = [i for i, c in enumerate(candidates) if len(c) > 1] or single[:1]
  for start, batch, n in _batches(prompts_BP, batch_size):
    for k, i in enumerate(passes):
      cont = candidates[i]
      teacher = np.tile(np.asarray(cont[:-1], np.int32), (len(batch), 1))
      inputs = np.concatenate([batch, teacher], 1)
      logp = np.asarray(gen_lib.tail_logprobs(module, inputs, len(cont), rope_length=P))[:n]
      if k == 0:
        out[start:start + n, single] = logp[:, 0, [candidates[j][0] for j in single]]
      out[start:start + n, i] = logp[:, np.arange(len(cont)), cont].sum(1)
  return out


def keyword_retrieval(model, tokenizer, lengths, depths=DEFAULT_DEPTHS, *,
                      candidates=CANDIDATES, disqualify: int = 1, batch_size: int = 14) -> dict:
  """Secret-keyword accuracy per (length, depth). A needle-free control of the same length
  disqualifies the `disqualify` candidates the model prefers a priori; each other candidate is the
  needle in turn, and a row passes when the needle has the highest log-likelihood of them."""
  depths = [float(d) for d in depths]
  cand_tokens = [tokenizer.encode(c) for c in candidates]
  accuracy, gaps, disqualified, scored_names = [], [], [], []
  for length in lengths:
    # The control and every candidate as needle share the batches (one compiled shape per
    # length); rows of the disqualified candidate are scored but not counted.
    rows = [(i, d) for i in range(len(candidates)) for d in depths]
    prompts = np.array([keyword_prompt(tokenizer, length, 0.0, None)] +
                       [keyword_prompt(tokenizer, length, d, candidates[i]) for i, d in rows],
                       np.int32)
    ll = candidate_loglik(model, prompts, cand_tokens, batch_size=batch_size)
    dropped = sorted(np.argsort(-ll[0])[:disqualify].tolist())
    scored = [i for i in range(len(candidates)) if i not in dropped]
    # A row's gap: its needle's log-likelihood minus the best other scored candidate's.
    needle, ll = np.array([i for i, _ in rows]), ll[1:]
    true_ll = ll[np.arange(len(rows)), needle]
    ll[:, dropped] = -np.inf
    ll[np.arange(len(rows)), needle] = -np.inf
    gap = (true_ll - ll.max(1))[np.isin(needle, scored)]
    passed = (gap >= 0).reshape(len(scored), len(depths))
    accuracy.append(passed.mean(0).tolist())
    gaps.append(float(gap.mean()))
    disqualified.append([candidates[i] for i in dropped])
    scored_names.append([candidates[i] for i in scored])
  acc = np.asarray(accuracy)
  d = np.asarray(depths)
  bands = {"early": d < 0.34, "mid": (d >= 0.34) & (d < 0.67), "late": d >= 0.67}
  return {
      "lengths": list(lengths), "depths": depths, "candidates": list(candidates),
      "candidate_tokens": cand_tokens, "disqualified": disqualified, "scored": scored_names,
      "rows_per_cell": len(candidates) - disqualify, "chance": 1 / (len(candidates) - disqualify),
      "accuracy": accuracy, "accuracy_by_length": acc.mean(1).tolist(),
      "overall": float(acc.mean()), "mean_gap": gaps,
      "by_band": {name: (acc[:, m].mean(1).tolist() if m.any() else None)
                  for name, m in bands.items()},
  }
