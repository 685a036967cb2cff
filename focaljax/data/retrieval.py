"""Long-context retrieval probes (docs/evaluation.md): passkey (generation) and secret keyword
(likelihood ranking), and the passkey drills of training.

Prompts are assembled from separately encoded pieces (head, filler, needle, question) so that
every prompt is exactly the requested number of tokens and the needle sits at a fixed filler
token. The pieces start with a space or newline, which byte-level BPE splits on anyway, so the
concatenation is the same token sequence the whole string encodes to (up to the one place where
the filler is cut).
"""

from __future__ import annotations

import grain
import numpy as np


PASSKEY_HEAD = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
                "memorize it. I will quiz you about the important information there.\n")
PASSKEY_FILLER = (" The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
                  "back again.")
PASSKEY_NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"

KEYWORD_FILLER = (" This document contains procedural notes about scheduling, budgeting, and "
                  "system maintenance. It references tasks, owners, and brief status updates. The "
                  "content includes repeated mentions of priorities, milestones, risk items, and "
                  "follow-ups. Some sections contain numbered lists and short headings.")
KEYWORD_NEEDLE = " The secret keyword is{answer}."
KEYWORD_QUESTION = "\n\n### IMPORTANT DATA: The secret keyword is"
CANDIDATES = (" gold", " life", " time", " love", " work", " play", " game", " rain")
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def build_prompt(tokenizer, length: int, depth: float, head: str, filler: str, needle: str,
                 question: str) -> list[int]:
  """head + filler[:i] + needle + filler[i:] + question, exactly `length` tokens; i = depth·filler
  (the filler repeated as needed). needle="" gives the needle-free control of the same length."""
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth must be in [0, 1], got {depth}")
  head_t, needle_t, question_t = (tokenizer.encode(s) if s else []
                                  for s in (head, needle, question))
  n = length - len(head_t) - len(needle_t) - len(question_t)
  if n < 0:
    raise ValueError(f"length {length} is shorter than the prompt without filler "
                     f"({length - n} tokens)")
  unit = tokenizer.encode(filler)
  filler_t = (unit * (n // len(unit) + 1))[:n]
  at = int(depth * n)
  return head_t + filler_t[:at] + needle_t + filler_t[at:] + question_t


def passkey_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
  return build_prompt(tokenizer, length, depth, PASSKEY_HEAD, PASSKEY_FILLER,
                      PASSKEY_NEEDLE.format(key=key), PASSKEY_QUESTION)


def drill_pieces(tokenizer, rng: np.random.Generator) -> tuple[list[int], list[int]]:
  """A random 5-digit key K's needle, and the drill's tail: question + " K." (K is the target)."""
  key = int(rng.integers(10_000, 100_000))
  return (tokenizer.encode(PASSKEY_NEEDLE.format(key=key)),
          tokenizer.encode(PASSKEY_QUESTION) + tokenizer.encode(f" {key}."))


def drill_sizes(tokenizer) -> tuple[int, int, int]:
  """The most tokens a drill's needle, its tail (question + " K.") and the tail's answer " K."
  can take over all keys: each occurrence of the key counted at its worst (" K" is 6 bytes: at
  most 6 tokens)."""
  key = 10_000
  worse = 6 - len(tokenizer.encode(f" {key}"))
  needle = len(tokenizer.encode(PASSKEY_NEEDLE.format(key=key))) + 2 * worse   # "K" twice
  answer = len(tokenizer.encode(f" {key}.")) + worse
  return needle, len(tokenizer.encode(PASSKEY_QUESTION)) + answer, answer


def drill_min_tokens(tokenizer) -> int:
  """The most tokens a drill without filler or head can take: needle + tail + <|endoftext|>."""
  needle, tail, _ = drill_sizes(tokenizer)
  return needle + tail + 1


def passkey_drill(tokenizer, text_ids: np.ndarray, rng: np.random.Generator,
                  max_len: int) -> np.ndarray:
  """A passkey training document of at most `max_len` tokens (ids + <|endoftext|>).

  [head (half the time, if it fits)] + text[:i] + needle + text[i:n] + question + " K." with a
  random 5-digit K, n uniform in [room/2, room] (room: what max_len leaves for filler), i uniform
  in [0, n]. The filler is a random crop of `text_ids`, real text (the row it replaces), not the
  evaluation's grass/sky/sun sentences: the drill teaches reading the needle back out of a
  context, not the evaluation's filler. A small base does not learn retrieval from plain text
  alone, and FocusLLM can only carry past the context what the base already does inside it.
  """
  needle, tail = drill_pieces(tokenizer, rng)
  head = tokenizer.encode(PASSKEY_HEAD) if rng.random() < 0.5 else []
  if max_len - 1 - len(head) - len(needle) - len(tail) < 0:
    head = []   # a short row: the drill without its head
  room = max_len - 1 - len(head) - len(needle) - len(tail)
  if room < 0:
    raise ValueError(f"passkey_drill: max_len={max_len} is shorter than the drill without "
                     f"filler ({max_len - room} tokens)")
  most = min(room, len(text_ids))
  n = int(rng.integers(most // 2, most + 1))
  start = int(rng.integers(0, len(text_ids) - n + 1))
  filler, at = text_ids[start:start + n].tolist(), int(rng.integers(0, n + 1))
  ids = head + filler[:at] + needle + filler[at:] + tail + [tokenizer.eos_id]
  return np.asarray(ids, np.int32)


class PasskeyDrills(grain.transforms.RandomMap):
  """A packed row -> with probability `share`, one passkey drill cut from the row's own text.

  The drill's filler is the row's longest document piece (so it never spans an <|endoftext|>);
  the drill is segment 1 from position 0 and the rest of the row is padding (segment 0, weight 0).
  Rows, not documents, are drawn: corpora of long books would otherwise see almost no drills. The
  rng is grain's, per row index, and part of the iterator state: resuming replays the same drills.
  """

  def __init__(self, tok, share: float):
    self._tok, self._share = tok, share

  def random_map(self, row: dict[str, np.ndarray], rng: np.random.Generator):
    if rng.random() >= self._share:
      return row
    tokens, seg = row["tokens"], row["tokens_segment_ids"]
    ids, counts = np.unique(seg[seg > 0], return_counts=True)
    text = tokens[seg == ids[np.argmax(counts)]] if len(ids) else tokens[:0]
    text = text[text != self._tok.eos_id]
    drill = passkey_drill(self._tok, text, rng, len(tokens))
    n, pad = len(drill), len(tokens) - len(drill)
    out = lambda x: np.concatenate([x, np.zeros(pad, np.int32)]).astype(tokens.dtype)
    return {"tokens": out(drill), "tokens_segment_ids": out(np.ones(n, np.int32)),
            "tokens_positions": out(np.arange(n, dtype=np.int32))}


def keyword_prompt(tokenizer, length: int, depth: float, answer: str | None) -> list[int]:
  """answer=None: the needle-free control prompt."""
  needle = "" if answer is None else KEYWORD_NEEDLE.format(answer=answer)
  return build_prompt(tokenizer, length, depth, "", KEYWORD_FILLER, needle, KEYWORD_QUESTION)
