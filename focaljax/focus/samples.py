"""FocusLLM training samples (focus/train.py): memory + local window, drawn from long documents.

Each step draws one chunk size s from `focus.chunk_sizes` and one memory length m from
`focus.memory_tokens`, rounded down to whole chunks: M = s·⌊m / s⌋. Every sample of the step uses
that (s, M), so each pair compiles once. Empty `memory_tokens` means one length,
m = doc_min_tokens − local_len − 1, the longest memory every document admits. Documents shorter
than `doc_min_tokens` are skipped, longer ones cropped to their first `doc_max_tokens`. With
local_len = T:
  continuation     a random window of M + T + 1 tokens: memory = its first M, local tokens =
                   the rest (the text right after the memory).
  reconstruction   a random window of M tokens is the memory; the local tokens are T + 1
                   consecutive tokens copied from inside it (probability `p_reconstruction`).
                   As in the official code the span stays in the memory, which is what teaches
                   copying.
  passkey drill    a `focus.retrieval_mix` share of continuation samples (`Sampler._drill`).
Several memory lengths matter: the paper's documents give memories of varying chunk counts, and an
adapter trained on few chunks spreads its attention when evaluated over many.
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
# Token ids kept per process, in bytes: every long document of the bundled corpus fits, so after
# the first pass no step tokenizes again.
_CACHE_BYTES = 512 << 20
# Batches built ahead on worker threads, so sampling overlaps the device's steps (0: on the
# training thread; tests that signal at a known step use that). Until the cache holds the
# corpus's documents a batch tokenizes a dozen of them, slower than a device step; the tokenizer
# releases the GIL, so the threads build batches in parallel, one per spare core.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
PREFETCH = max(2, min(8, _CORES - 1))


def memory_len(chunk: int, tokens: int) -> int:
  return chunk * (tokens // chunk)


class Sampler:
  """Batches as a pure function of (seed, step, process): resumable without iterator state."""

  def __init__(self, f: config_lib.FocusTrainConfig, data, seed: int, tokenizer,
               process_index: int, local_batch: int):
    """`f`: focus.*; `data`: the run's DataConfig (its source)."""
    self.f, self.seed, self.pidx, self.local_batch = f, seed, process_index, local_batch
    self.tok = tokenizer
    # A drill's tail is question + answer: its answer starts this many tokens in.
    self._question_len = len(tokenizer.encode(retrieval.PASSKEY_QUESTION))
    self.docs = data_lib.documents(data, "train")
    # Documents are re-drawn many times: keep their token ids (the crop bounds the memory use).
    # Books run to 1M tokens: cut the text first (a BPE token spans far fewer than 16 chars).
    n = f.doc_max_tokens
    self._tokens = functools.lru_cache(maxsize=max(64, _CACHE_BYTES // (4 * n)))(
        lambda i: np.asarray(tokenizer.encode(self.docs[i][:16 * n])[:n], np.int32))
    # Documents found too short are never tokenized again. Skipping one still consumes its draw,
    # so the samples are those of a sampler without this set.
    self._short: set[int] = set()

  def shape(self, step: int) -> tuple[int, int]:
    """(chunk size, memory length) of the step, the same on every process: all of them must
    build the same shapes. The memory draw has its own stream, so adding lengths leaves the chunk
    sizes of every step as they were."""
    sizes, memories = self.f.chunk_sizes, self.f.memory_tokens
    s = sizes[np.random.default_rng([self.seed, step]).integers(len(sizes))]
    m = memories[np.random.default_rng([self.seed, step, 2]).integers(len(memories))]
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
    raise config_lib.ConfigError(
        f"config field focus.doc_min_tokens: {_MAX_DRAWS} random documents of data.source were "
        f"all shorter than {self.f.doc_min_tokens} tokens; lower it or use a source with longer "
        "documents")

  def _drill(self, memory, local, rng) -> tuple[np.ndarray, np.ndarray, int]:
    """A continuation sample turned passkey drill: the needle overwrites a random stretch of the
    memory and the local window ends with the question and " K.", so the key's tokens are among
    the supervised last targets and only the memory holds them. Returns (memory, local tokens,
    key_at: where the answer starts among the num_targets targets)."""
    needle, tail = retrieval.drill_pieces(self.tok, rng)
    answer = len(tail) - self._question_len
    # Only the answer must be supervised; question tokens before the targets are plain input.
    if len(needle) > len(memory) or len(tail) > len(local) or answer > self.f.num_targets:
      raise config_lib.ConfigError(
          f"config field focus.retrieval_mix: a drill needs a memory of >= {len(needle)} tokens, "
          f"a local window of >= {len(tail)} (question and key) and focus.num_targets >= "
          f"{answer} (the key)")
    memory = memory.copy()
    at = int(rng.integers(len(memory) - len(needle) + 1))
    memory[at:at + len(needle)] = needle
    context = local[:len(local) - len(tail)]
    return (memory, np.concatenate([context, np.asarray(tail, np.int32)]),
            self.f.num_targets - answer)

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
      elif rng.random() < self.f.retrieval_mix:
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
  threads, so the host's sampling overlaps the device's earlier steps. Batches are pure functions
  of the step: threads change no sample. Close the generator to stop the workers."""
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
