"""Grain input pipeline: documents -> tokens -> packed rows -> batches of next-token examples.

One straight chain (see `make_dataset`):

  documents (str)            `documents(cfg, split)`: bundled text, local files or TFDS
  -> host shard              documents[process_index::process_count]; hosts never share a doc
  -> tokenize                ids + <|endoftext|>: lazily per document, or the whole shard
                             up front (DataConfig.tokenize, see TOKENIZE)
  -> shuffle(seed)           document order, reshuffled every epoch
  -> repeat(num_epochs)      None = forever
  -> ConcatThenSplit         rows of exactly seq_len + 1 tokens, documents concatenated and
                             split at row boundaries; only the very last row is zero-padded
  -> passkey drills          train only, DataConfig.retrieval_mix > 0: that share of rows becomes
                             a passkey drill cut from its own text (retrieval.PasskeyDrills)
  -> batch                   global_batch // process_count rows; a short final batch is padded
                             with all-zero rows (segment 0, weight 0), never dropped
  -> to_example              inputs/targets/segment_ids/positions/weights, below

Every batch is a dict of numpy arrays, all [local_batch, seq_len]:
  inputs       int32    row[:-1]
  targets      int32    row[1:], the next token
  segment_ids  int32    1, 2, 3, ... per document piece within the row; 0 = padding.
                        Attention must stay within a segment id: that alone keeps documents apart.
  positions    int32    position within the document piece; restarts at 0 at every document start
                        AND at every row start (a long document split over rows starts each piece
                        at 0, i.e. pieces are trained as independent documents)
  weights      float32  1 where the target is the next token of the same document (a document's
                        last real token predicts its <|endoftext|>); 0 for padding and for
                        <|endoftext|> itself, whose target is the next document

A row holds seq_len + 1 tokens so targets need no look-ahead; the cost is one unused transition
(row[-1] -> next row[0]) per row. Across an epoch every document token lands in exactly one
row: nothing is lost or repeated.

Checkpointing: `make_iterator` returns a grain DatasetIterator; `get_state()` / `set_state()`
resume exactly (the next batches are identical). Orbax saves it through focaljax/data/state.py,
one file per data shard, so a run resumes on another number of processes.

Streaming tokenization feeds a few hundred thousand tokens/s per 2 CPU cores; `tokenize="ahead"`
removes that limit for corpora that fit in memory. Otherwise wrap `make_dataset(...)` in
`.mp_prefetch(grain.MultiprocessingOptions(num_workers=N))` (absl flags must be parsed; restore
with the same N: workers take interleaved document slices).

With a finite `num_epochs`, hosts hold different token counts and may run out of batches at
different steps; multi-host loops should use num_epochs=None (as training does) or a fixed
batch count.

The train/valid split of a source is `sources.documents`'s: `valid_source` if set, else an evenly
spaced `valid_fraction` of the source's documents (TFDS sources: their own splits).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import sys
import zipfile
from typing import Any

import grain
import jax
import numpy as np
from etils import epath

from focaljax.data import retrieval
from focaljax.data import sources
from focaljax.data import tokenizer as tokenizer_lib
from focaljax.data.sources import read_text_files  # noqa: F401  (re-exported for evaluation)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """What to read and how to cut it. Built by the trainer from the ConfigDict."""

  # "bundled" | "text:<glob>[,<glob>...]" (.txt/.jsonl, optionally .xz/.gz) | "tfds:<name>[:split]"
  source: str
  # "bundled" | "train:<vocab_size>[:digits|:llama_digits]" (BPE trained on the train split; the
  # suffix gives every digit its own token: tokenizer.DIGIT_STYLES) | path to tokenizer.json
  tokenizer: str
  seq_len: int  # tokens per example (T); rows hold T + 1 tokens
  global_batch: int  # rows per step over all hosts; each host yields global_batch // process_count
  seed: int = 0  # document shuffle seed
  shuffle: bool = True  # shuffle document order (each epoch differently)
  num_epochs: int | None = None  # None: repeat forever
  jsonl_field: str = "text"  # the document field of .jsonl(.xz) lines
  tfds_data_dir: str | None = None  # data_dir for "tfds:" sources (None: TFDS default)
  valid_source: str | None = None  # same syntax as source; None: hold out valid_fraction
  valid_fraction: float = 0.05  # share of source documents held out when valid_source is None
  tokenize: str = "auto"  # "stream" | "ahead" | "auto": see TOKENIZE
  token_cache: str | None = None  # tokenize="ahead"/"auto": a directory reusing tokenized splits
  retrieval_mix: float = 0.0  # share of train rows replaced by passkey drills (retrieval.py)

  def __post_init__(self):
    sources.parse_source(self.source, "source")
    if self.valid_source is not None:
      sources.parse_source(self.valid_source, "valid_source")
    _check_tokenizer_spec(self.tokenizer)
    for name in ("seq_len", "global_batch"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"DataConfig.{name} must be a positive int, got {value!r}")
    epochs = self.num_epochs
    if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
      raise ValueError(f"DataConfig.num_epochs must be None (forever) or >= 1, got {epochs!r}")
    if self.tokenize not in TOKENIZE:
      raise ValueError(f"DataConfig.tokenize must be one of {sorted(TOKENIZE)}, got "
                       f"{self.tokenize!r}")
    if self.token_cache is not None and self.tokenize == "stream":
      raise ValueError(f"DataConfig.token_cache={self.token_cache!r} needs tokenize='ahead', got "
                       f"tokenize={self.tokenize!r}")
    if not 0.0 <= self.retrieval_mix < 1.0:
      raise ValueError(f"DataConfig.retrieval_mix must be in [0, 1), got {self.retrieval_mix!r}")
    if not 0.0 <= self.valid_fraction < 1.0:
      raise ValueError(f"DataConfig.valid_fraction must be in [0, 1), got {self.valid_fraction!r}")


def documents(cfg: DataConfig, split: str) -> grain.MapDataset:
  """All documents (str) of `split` ("train" | "valid") of cfg's sources, in a fixed order."""
  return sources.documents(split, cfg.source, valid_source=cfg.valid_source,
                           valid_fraction=cfg.valid_fraction, jsonl_field=cfg.jsonl_field,
                           tfds_data_dir=cfg.tfds_data_dir)


def _train_spec(spec: str) -> tuple[int, str] | None:
  """(vocab size, digit style) of a well-formed "train:N[:<style>]" spec (N > 256), else None."""
  kind, _, arg = spec.partition(":")
  size, _, digits = arg.partition(":")
  if (kind == "train" and size.isdigit() and int(size) > 256
      and digits in tokenizer_lib.DIGIT_STYLES):
    return int(size), digits
  return None


def _check_tokenizer_spec(spec: str) -> None:
  if spec and (spec == "bundled" or spec.endswith(".json") or epath.Path(spec).is_dir()
               or _train_spec(spec)):   # "" would name the current directory
    return
  raise ValueError(
      f"DataConfig.tokenizer={spec!r}: expected 'bundled', 'train:<vocab_size> (> 256)', "
      "'train:<vocab_size>:digits' or 'train:<vocab_size>:llama_digits' (one token per digit) "
      "or a path to a tokenizer.json (or a directory holding one)")


def _recorded_with(workdir: str, cfg: DataConfig) -> bool:
  """Whether workdir/config.json (written once a run passed its checks) names cfg's tokenizer
  and source."""
  path = epath.Path(workdir) / "config.json"
  try:
    data = json.loads(path.read_text()).get("data", {}) if path.is_file() else {}
  except (OSError, ValueError, AttributeError):
    return False
  return data.get("tokenizer") == cfg.tokenizer and data.get("source") == cfg.source


def load_tokenizer(cfg: DataConfig, workdir: str | None,
                   save: bool = True) -> tokenizer_lib.Tokenizer:
  """The tokenizer `cfg.tokenizer` names; "train:N[:<style>]" trains once and caches
  workdir/tokenizer.json (unless `save` is False: a dry run).

  The cached file is reused when the workdir's recorded run (its config.json) names the same
  tokenizer and source; one left by a run refused before it recorded anything is retrained.
  Every host trains the same BPE from the same documents, so multi-host runs agree even if they
  race to write the cache (writes are atomic).
  """
  spec = cfg.tokenizer
  if spec == "bundled":
    return tokenizer_lib.bundled()
  train = _train_spec(spec)
  if train is None:
    try:
      return tokenizer_lib.Tokenizer.load(spec)
    except FileNotFoundError as e:
      raise FileNotFoundError(f"data.tokenizer={spec!r}: {e}") from None
  if (workdir is not None and (epath.Path(workdir) / tokenizer_lib.FILENAME).is_file()
      and _recorded_with(workdir, cfg)):
    return tokenizer_lib.Tokenizer.load(workdir)
  docs = documents(cfg, "train")
  size, digits = train
  tok = tokenizer_lib.train_bpe((docs[i] for i in range(len(docs))), size, digits=digits)
  if tok.vocab_size < size and jax.process_index() == 0:   # the corpus ran out of merges
    print(f"note: data.tokenizer={spec!r}: the training text gives {tok.vocab_size} tokens, fewer "
          f"than {size}; the model's vocabulary follows the tokenizer", file=sys.stderr)
  if workdir is not None and save:
    tok.save(workdir)
  return tok


class _Tokenize(grain.transforms.Map):
  """str -> {"tokens": int32 ids + <|endoftext|>}."""

  def __init__(self, tok: tokenizer_lib.Tokenizer):
    self._tok = tok

  def map(self, text: str) -> dict[str, np.ndarray]:
    ids = self._tok.encode(text)   # a long text in pieces (tokenizer.PIECE_CHARS)
    ids.append(self._tok.eos_id)
    return {"tokens": np.asarray(ids, dtype=np.int32)}


def _tokenize_stream(ds: grain.MapDataset, tok: tokenizer_lib.Tokenizer,
                     cfg: DataConfig) -> grain.MapDataset:
  del cfg
  return ds.map(_Tokenize(tok))


def _tokenize_ahead(ds: grain.MapDataset, tok: tokenizer_lib.Tokenizer,
                    cfg: DataConfig) -> grain.MapDataset:
  texts = [ds[i] for i in range(len(ds))]
  path = None
  if cfg.token_cache:
    # Keyed by content, not by file names: the same documents and tokenizer hit the cache from
    # any path, and an edited corpus or tokenizer misses it (hashing text is cheap next to BPE).
    h = hashlib.sha256(tok.fingerprint().encode())
    for t in texts:
      h.update(t.encode("utf-8", "surrogatepass") + b"\0")
    path = epath.Path(cfg.token_cache) / f"tokens-{h.hexdigest()[:20]}.npz"
    if path.is_file():
      try:
        with path.open("rb") as f, np.load(f) as z:
          flat, ends = z["tokens"].astype(np.int32), z["ends"]
        return grain.MapDataset.source([{"tokens": t} for t in np.split(flat, ends[:-1])])
      except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as e:   # cut short
        print(f"warning: token cache {path} is unreadable ({e}); tokenizing again",
              file=sys.stderr)
  # encode_batch runs in Rust on every core; one chunk of documents at a time bounds the copies.
  tokens, chunk = [], 256
  for start in range(0, len(texts), chunk):
    tokens += [{"tokens": np.asarray(ids + [tok.eos_id], np.int32)}
               for ids in tok.encode_batch(texts[start:start + chunk])]
  if path:
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = np.concatenate([t["tokens"] for t in tokens])
    small = np.uint16 if tok.vocab_size <= 1 << 16 else np.int32  # half the disk for 16-bit vocabs
    buf = io.BytesIO()
    np.savez(buf, tokens=flat.astype(small), ends=np.cumsum([len(t["tokens"]) for t in tokens]))
    # Concurrent runs (one per GPU) race: a rename is atomic locally, an object write on GCS.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(path)
  return grain.MapDataset.source(tokens)


# How documents become tokens (DataConfig.tokenize). The batches are the same either way.
#   stream  one document at a time in the pipeline's reader threads: nothing up front and no
#           memory, but too slow to feed a fast GPU training a small model.
#   ahead   this host's whole split once, in parallel, when the iterator is built (4 bytes a
#           token in memory); then free. With DataConfig.token_cache, later runs on the same
#           documents and tokenizer load the result instead (a study's arms, a resumed run,
#           every validation pass).
#   auto    ahead where the documents are in memory already (bundled text, local files), stream
#           for TFDS sources (read lazily, any size): streaming leaves a GPU waiting on input at
#           the presets' batch sizes.
def _tokenize_auto(ds: grain.MapDataset, tok: tokenizer_lib.Tokenizer,
                   cfg: DataConfig) -> grain.MapDataset:
  lazy = cfg.source.startswith("tfds:")
  return (_tokenize_stream if lazy else _tokenize_ahead)(ds, tok, cfg)


TOKENIZE = {"stream": _tokenize_stream, "ahead": _tokenize_ahead, "auto": _tokenize_auto}


def to_example(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Packed rows [b, T+1] (tokens, tokens_segment_ids, tokens_positions) -> batch of [b, T]."""
  tokens, seg, pos = rows["tokens"], rows["tokens_segment_ids"], rows["tokens_positions"]
  # A target is real iff it sits in the same segment as its input; this zeroes padding, the
  # <|endoftext|> -> next-document transition, and needs no knowledge of eos_id.
  weights = (seg[:, :-1] == seg[:, 1:]) & (seg[:, :-1] != 0)
  return {
      "inputs": tokens[:, :-1].astype(np.int32),
      "targets": tokens[:, 1:].astype(np.int32),
      "segment_ids": seg[:, :-1].astype(np.int32),
      "positions": pos[:, :-1].astype(np.int32),
      "weights": weights.astype(np.float32),
  }


class _JsonStateIterator(grain.DatasetIterator):
  """Passes batches through; makes `set_state` accept the state after a JSON roundtrip.

  Grain's Orbax handler stores `get_state()` as JSON, which turns ConcatThenSplit's slice tuples
  into lists. Grain compares them against the tuple (-1, -1), so a restored list [-1, -1] reads
  as a remainder and silently drops the next document. Re-tupling fixes it.
  """

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(_tuple_slices(state))


def _tuple_slices(state: Any) -> Any:
  if not isinstance(state, dict):
    return state
  return {k: ({f: tuple(sl) for f, sl in v.items()} if k == "remainder_slices" else
              _tuple_slices(v)) for k, v in state.items()}


class _JsonStateDataset(grain.IterDataset):

  def __iter__(self) -> _JsonStateIterator:
    return _JsonStateIterator(self._parent.__iter__())


def make_dataset(cfg: DataConfig, tok: tokenizer_lib.Tokenizer, *, split: str = "train",
                 process_index: int = 0, process_count: int = 1) -> grain.IterDataset:
  """The pipeline of the module docstring, as an IterDataset (wrap with mp_prefetch if needed)."""
  if not 0 <= process_index < process_count:
    raise ValueError(f"need 0 <= process_index < process_count, got {process_index}, "
                     f"{process_count}")
  if cfg.global_batch % process_count:
    raise ValueError(f"DataConfig.global_batch={cfg.global_batch} must be divisible by "
                     f"process_count={process_count}")
  local_batch = cfg.global_batch // process_count
  ds = documents(cfg, split)
  if len(ds) < process_count:
    raise sources.DataError(f"the {split} split of data.source={cfg.source!r} has {len(ds)} "
                            f"documents, fewer than the {process_count} data shards")
  ds = TOKENIZE[cfg.tokenize](ds[process_index::process_count], tok, cfg)
  if cfg.shuffle:
    ds = ds.shuffle(seed=cfg.seed)
  ds = ds.repeat(cfg.num_epochs)
  # Few threads and a short buffer: documents can be large, and 2-core hosts are common.
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=16))
  it = grain.experimental.ConcatThenSplitIterDataset(it, length_struct={"tokens": cfg.seq_len + 1})
  if split == "train" and cfg.retrieval_mix > 0:
    need = retrieval.drill_min_tokens(tok)
    if cfg.seq_len + 1 < need:
      raise sources.DataError(
          f"data.retrieval_mix={cfg.retrieval_mix}: a passkey drill takes up to {need} tokens "
          f"with this tokenizer; data.seq_len={cfg.seq_len} rows hold {cfg.seq_len + 1} (raise "
          "data.seq_len or set data.retrieval_mix=0)")
    it = it.random_map(retrieval.PasskeyDrills(tok, cfg.retrieval_mix), seed=cfg.seed)
  it = it.batch(local_batch, batch_fn=functools.partial(grain.experimental.batch_and_pad,
                                                        batch_size=local_batch))
  return _JsonStateDataset(it.map(to_example))


class _ShardsIterator(grain.DatasetIterator):
  """This host's data shards side by side: each batch is their batches concatenated by row.
  `shard_ids` are their global indices among `num_shards`; focaljax/data/state.py saves the
  position of each shard on its own, so a checkpoint restores on any process count."""

  def __init__(self, parents, shard_ids: list[int], num_shards: int):
    super().__init__(parents)
    self.shard_ids, self.num_shards = shard_ids, num_shards

  def __next__(self) -> dict[str, np.ndarray]:
    parts = [next(it) for it in self._parents]
    if len(parts) == 1:
      return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

  def get_state(self) -> dict[str, Any]:
    return {"shards": [it.get_state() for it in self._parents]}

  def set_state(self, state: dict[str, Any]) -> None:
    for it, st in zip(self._parents, state["shards"]):
      it.set_state(st)


def make_iterator(cfg: DataConfig, tok: tokenizer_lib.Tokenizer, *, split: str = "train",
                  process_index: int = 0, process_count: int = 1,
                  num_shards: int | None = None) -> _ShardsIterator:
  """A checkpointable iterator of this host's batches (see the module docstring).

  `num_shards` (default: process_count) fixes how documents are split into data shards,
  independently of how many processes read them: process p reads shards
  [p·S/P, (p+1)·S/P) and yields their rows in shard order. So the global batch of step n is the
  same on 1 process or on P (the 2-process test relies on this), as long as S is fixed.
  """
  shards = process_count if num_shards is None else num_shards
  if shards % process_count:
    raise ValueError(f"num_shards={shards} must be a multiple of process_count={process_count}")
  per_host = shards // process_count
  ids = list(range(process_index * per_host, (process_index + 1) * per_host))
  its = [iter(make_dataset(cfg, tok, split=split, process_index=s, process_count=shards))
         for s in ids]
  return _ShardsIterator(its, ids, shards)
