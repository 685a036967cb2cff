"""FocusLLM training samples (focus_train.py): memory + local window, drawn from long documents.

Each step draws one chunk size s from `focus.chunk_sizes` and one memory length from
`focus.memory_tokens`, rounded down to whole chunks: M = s·⌊m / s⌋. Every sample of the step
uses that (s, M), so each pair compiles once. Empty `memory_tokens` (the default) means one length,
m = doc_min_tokens − local_len − 1, the longest memory every document admits (longer documents
give other windows, not longer memories). Documents shorter than `doc_min_tokens` are skipped,
longer ones cropped to their first `doc_max_tokens`. With local_len = T:
  continuation     a random window of M + T + 1 tokens: memory = its first M, local tokens =
                   the rest (the text right after the memory).
  reconstruction   a random window of M tokens is the memory; the local tokens are T + 1
                   consecutive tokens copied from inside it (probability `p_reconstruction`).
The seed's summary says the chunks are the tokens "before and after" the span; the official code
(shared/notes/focus_focal.md §1.6) keeps the span and its targets in the memory, which is what
teaches copying (the ablation's passkey result), and the brief's "repeats a span" agrees: we do
the same. With `focus.retrieval_mix`, that share of continuation samples become passkey drills
(`Sampler._drill`; the base's own drills are data.retrieval_mix).

Why several memory lengths: the paper trains on 3–8K-token documents whose whole prefix is the
memory, so the number of chunks varies from sample to sample. One fixed length (4 chunks of 512
at doc_min_tokens=3000) shows the adapter one needle among few candidates only; evaluation at 32×
a 1K context has 63.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import os

import numpy as np

from focaljax import config as config_lib
from focaljax.data import pipeline as data_lib
from focaljax.data import retrieval

_MAX_DRAWS = 1000   # document draws per sample before concluding the source has no long documents
# Token ids kept per process, in bytes: every long document of the bundled corpus fits (~2.3K of
# 4.9K at 8000 tokens: 74 MB), so after the first pass no step tokenizes (~20 ms a document).
_CACHE_BYTES = 512 << 20
# Batches built ahead on worker threads, so sampling overlaps the device's steps (0: on the
# training thread; tests that signal at a known step use that). Until the cache holds the
# corpus's documents a batch tokenizes ~12 of them (~0.15 s), slower than a device step; the
# tokenizer releases the GIL, so the threads build batches in parallel, one per spare core.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
PREFETCH = max(2, min(8, _CORES - 1))


def fail(field: str, msg: str):
  raise config_lib.ConfigError(f"config field focus.{field}: {msg}")


def _int_list(config, field: str) -> tuple[int, ...]:
  try:
    values = tuple(int(s) for s in config.focus[field].split(","))
  except ValueError:
    values = ()
  if not values or min(values) < 1:
    fail(field, f"{config.focus[field]!r} must be a comma list of positive ints")
  return values


def chunk_sizes(config) -> tuple[int, ...]:
  return _int_list(config, "chunk_sizes")


def memory_tokens(config) -> tuple[int, ...]:
  """The memory lengths before rounding to whole chunks (module docstring)."""
  f = config.focus
  if not f.get("memory_tokens", ""):
    return (f.doc_min_tokens - f.local_len - 1,)
  return _int_list(config, "memory_tokens")


def memory_len(chunk: int, tokens: int) -> int:
  return chunk * (tokens // chunk)


class Sampler:
  """Batches as a pure function of (seed, step, process): resumable without iterator state."""

  def __init__(self, config, tokenizer, process_index: int, local_batch: int):
    self.f, self.seed, self.pidx = config.focus, config.seed, process_index
    self.local_batch = local_batch
    self.tok, self.retrieval_mix = tokenizer, self.f.get("retrieval_mix", 0.0)
    self.in_window = self.f.get("drill_in_window", 0.0)
    # A drill's tail is question + answer: its answer starts this many tokens in.
    self._question_len = len(tokenizer.encode(retrieval.PASSKEY_QUESTION))
    self.sizes, self.memories = chunk_sizes(config), memory_tokens(config)
    self.docs = data_lib.documents(config_lib.data_config(config), "train")
    # Documents are re-drawn many times: keep their token ids (the crop bounds the memory use).
    # Books run to 1M tokens: cut the text first (a BPE token spans far fewer than 16 chars).
    n = self.f.doc_max_tokens
    self._tokens = functools.lru_cache(maxsize=max(64, _CACHE_BYTES // (4 * n)))(
        lambda i: np.asarray(tokenizer.encode(self.docs[i][:16 * n])[:n], np.int32))
    # Documents found too short are never tokenized again (most draws, early in a run). Skipping
    # one still consumes its draw, so the samples are those of a sampler without this set.
    self._short: set[int] = set()

  def shape(self, step: int) -> tuple[int, int]:
    """(chunk size, memory length) of the step, the same on every process: all of them must
    build the same shapes. The memory draw has its own stream, so adding lengths leaves the chunk
    sizes of every step as they were."""
    s = self.sizes[np.random.default_rng([self.seed, step]).integers(len(self.sizes))]
    m = self.memories[np.random.default_rng([self.seed, step, 2]).integers(len(self.memories))]
    return s, memory_len(s, m)

  def _document(self, rng) -> np.ndarray:
    for _ in range(_MAX_DRAWS):
      i = int(rng.integers(len(self.docs)))
      if i in self._short:
        continue
      ids = self._tokens(i)
      if len(ids) >= self.f.doc_min_tokens:
        return ids
      self._short.add(i)
    fail("doc_min_tokens", f"{_MAX_DRAWS} random documents of data.source were all shorter than "
         f"{self.f.doc_min_tokens} tokens; lower it or use a source with longer documents")

  def _drill(self, memory, local, rng) -> tuple[np.ndarray, np.ndarray, int]:
    """A continuation sample turned passkey drill (focus.retrieval_mix): the needle overwrites a
    random stretch of the memory and the local window ends with the question and " K.", so the
    key's tokens are among the supervised last targets and only the memory holds them.

    A `focus.drill_in_window` share of drills puts the needle in the local window instead, before
    the question, as the evaluation does for its deepest needles (depth > 0.985 at 32x): with
    memory-only drills the adapter's candidates learn to answer whatever the memory holds, and
    an answer in plain sight of the local decoder came out with wrong digits (FOCUSLLM.md)."""
    needle, tail = retrieval.drill_pieces(self.tok, rng)
    answer = len(tail) - self._question_len
    # Only the answer must be supervised; question tokens before the targets are plain input.
    if len(needle) > len(memory) or len(tail) > len(local) or answer > self.f.num_targets:
      fail("retrieval_mix", f"a drill needs a memory of >= {len(needle)} tokens, a local window "
           f"of >= {len(tail)} (question and key) and focus.num_targets >= {answer} (the key)")
    # The answer " K." ends the window: it starts at this index among the num_targets targets.
    key_at = self.f.num_targets - answer
    context = local[:len(local) - len(tail)].copy()
    # Drawn only when asked for, so the samples of runs without it stay as they were.
    if self.in_window and rng.random() < self.in_window:
      if len(needle) > len(context):
        fail("drill_in_window", f"the needle ({len(needle)} tokens) and the question and key "
             f"({len(tail)}) do not fit focus.local_len + 1 = {len(local)} tokens; raise "
             "focus.local_len or set drill_in_window to 0")
      at = int(rng.integers(len(context) - len(needle) + 1))
      context[at:at + len(needle)] = needle
      key_at = -1   # loss_key stays the memory's metric; the answer is still a target
    else:
      memory = memory.copy()
      at = int(rng.integers(len(memory) - len(needle) + 1))
      memory[at:at + len(needle)] = needle
    return memory, np.concatenate([context, np.asarray(tail, np.int32)]), key_at

  def batch(self, step: int) -> dict[str, np.ndarray]:
    """memory int32 [b, M], tokens int32 [b, local_len + 1], reconstruction float32 [b],
    key_at int32 [b]: where a drill's answer " K." starts among the last num_targets, or -1."""
    _, M = self.shape(step)
    T = self.f.local_len
    rng = np.random.default_rng([self.seed, step, self.pidx, 1])
    memory, tokens, recon, key_at = [], [], [], []
    for _ in range(self.local_batch):
      ids = self._document(rng)
      is_recon, at = rng.random() < self.f.p_reconstruction, -1
      n = M if is_recon else M + T + 1
      window = ids[(o := rng.integers(len(ids) - n + 1)):o + n]
      memory.append(window[:M])
      if is_recon:
        tokens.append(window[(r := rng.integers(M - T)):r + T + 1])
      elif rng.random() < self.retrieval_mix:
        memory[-1], local, at = self._drill(window[:M], window[M:], rng)
        tokens.append(local)
      else:
        tokens.append(window[M:])
      recon.append(float(is_recon))
      key_at.append(at)
    return {"memory": np.stack(memory), "tokens": np.stack(tokens),
            "reconstruction": np.asarray(recon, np.float32),
            "key_at": np.asarray(key_at, np.int32)}


def prefetch(sampler: Sampler, start: int, stop: int, depth: int | None = None):
  """Yields (step, sampler.batch(step)) for steps [start, stop), `depth` batches ahead on worker
  threads, so the host's sampling overlaps the device's earlier steps instead of sitting between
  them (the training loop blocks on the device only when it reads a step's metrics). Batches are
  pure functions of the step: threads change no sample. Close the generator to stop the workers."""
  depth = PREFETCH if depth is None else depth
  if depth == 0:
    for step in range(start, stop):
      yield step, sampler.batch(step)
    return
  with concurrent.futures.ThreadPoolExecutor(depth, thread_name_prefix="focus-sampler") as pool:
    ahead: collections.deque = collections.deque()
    queued = start
    try:
      for step in range(start, stop):
        while queued < stop and queued <= step + depth:
          ahead.append(pool.submit(sampler.batch, queued))
          queued += 1
        yield step, ahead.popleft().result()
    finally:
      for future in ahead:
        future.cancel()
