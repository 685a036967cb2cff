"""Where documents come from: source specs ("bundled", local .txt/.jsonl files, TFDS) and the
deterministic train/valid split of a source, as grain MapDatasets of str.

Plain arguments, no DataConfig: `pipeline` (which owns DataConfig) and `tfds_text` (which writes
a source's split into a TFDS dataset) both read documents through `documents`.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import gzip
import json
import lzma
import os
import pathlib
import zlib
from typing import Any

import grain
import numpy as np
from etils import epath

BUNDLED_TEXT = pathlib.Path(__file__).parents[1] / "assets" / "bundled.jsonl.xz"
SPLITS = ("train", "valid")
_TEXT_SUFFIXES = (".txt", ".txt.xz", ".txt.gz")
_JSONL_SUFFIXES = (".jsonl", ".jsonl.xz", ".jsonl.gz")


def parse_source(spec: str, field: str) -> tuple[str, str]:
  """Splits "kind:arg" and checks it; returns (kind, arg). `field` names it in the error."""
  kind, _, arg = spec.partition(":")
  if spec == "bundled":
    return "bundled", ""
  if kind in ("text", "tfds") and arg:
    return kind, arg
  raise DataError(
      f"data.{field}={spec!r}: expected 'bundled', 'text:<glob>[,<glob>...]' or "
      "'tfds:<name>[:split]'")


class DataError(ValueError):
  """The data cannot be trained on (empty, malformed, not UTF-8); the message names the file,
  line or source."""


@contextlib.contextmanager
def _open_bytes(path: str):
  """A binary reader of a local file or a URL (gs://...), .xz and .gz decompressed."""
  opener = lzma.open if path.endswith(".xz") else gzip.open if path.endswith(".gz") else None
  with epath.Path(path).open("rb") as raw:
    if opener is None:
      yield raw
      return
    try:
      with opener(raw, "rb") as f:
        yield f
    except (lzma.LZMAError, gzip.BadGzipFile, zlib.error, EOFError) as e:   # cut short, damaged
      raise DataError(f"{path}: a damaged or truncated {path.rsplit('.', 1)[-1]} file "
                      f"({type(e).__name__}: {e})") from None


def _decode(path: str, data: bytes, first_line: int = 1) -> str:
  nul = data.find(b"\0")
  if nul >= 0:   # UTF-8 text never holds NUL: a binary file, whatever its name
    line = first_line + data[:nul].count(b"\n")
    raise DataError(f"{path}:{line}: binary data (a NUL byte), not text")
  try:
    return data.decode("utf-8-sig" if first_line == 1 else "utf-8")   # a file's BOM dropped
  except UnicodeDecodeError as e:
    line = first_line + data[:e.start].count(b"\n")
    raise DataError(f"{path}:{line}: not UTF-8 text (byte {data[e.start]:#04x})") from None


def read_text_files(paths: list[str], jsonl_field: str = "text") -> list[str]:
  """Documents of files (local paths or URLs), in the given order.

  .jsonl: one document per line, from `jsonl_field`. .txt: the whole file is one document (the
  packer splits long documents over rows anyway, so a book needs no pre-chunking). A malformed
  line or bytes that are not UTF-8 raise DataError naming the file and line.
  """
  docs = []
  for path in paths:
    if not path.endswith(_TEXT_SUFFIXES + _JSONL_SUFFIXES):
      raise DataError(f"{path}: unsupported file type; expected one of "
                      f"{_TEXT_SUFFIXES + _JSONL_SUFFIXES}")
    with _open_bytes(path) as f:
      if path.endswith(_TEXT_SUFFIXES):
        text = _decode(path, f.read())
        # Universal newlines, as text-mode open() reads them.
        docs.append(text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text)
        continue
      for lineno, raw in enumerate(f, 1):
        line = _decode(path, raw, lineno)
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(record, dict) or jsonl_field not in record:
          have = sorted(record) if isinstance(record, dict) else type(record).__name__
          raise DataError(f"{path}:{lineno}: no field {jsonl_field!r} (data.jsonl_field); "
                          f"have {have}")
        if not isinstance(record[jsonl_field], str):
          raise DataError(f"{path}:{lineno}: field {jsonl_field!r} is "
                          f"{json.dumps(record[jsonl_field])[:40]}, not a string")
        docs.append(record[jsonl_field])
  return docs


def _glob_files(pattern: str, field: str) -> list[str]:
  paths = []
  for part in pattern.split(","):
    if "://" in part:   # a bucket: wildcards in the file name only (gs://b/data/*.jsonl)
      url = epath.Path(part)
      matches = sorted(str(p) for p in url.parent.glob(url.name))
    else:
      matches = sorted(glob.glob(os.path.expanduser(part)))
    if not matches:
      raise DataError(f"data.{field}: {part!r} matches no files")
    if folders := [m for m in matches if epath.Path(m).is_dir()]:
      raise DataError(f"data.{field}: {part!r} matches the directory {folders[0]}; name its "
                      "files (e.g. dir/*.jsonl)")
    paths.extend(m for m in matches if m not in paths)   # overlapping globs: each file once
  return paths


class _Indexed:
  """A random-access view of `docs` restricted to `indices` (picklable, unlike a lambda)."""

  def __init__(self, docs: Any, indices: np.ndarray):
    self._docs, self._indices = docs, indices

  def __len__(self) -> int:
    return len(self._indices)

  def __getitem__(self, i: int) -> Any:
    return self._docs[int(self._indices[i])]


def _decode_text(record: dict[str, Any]) -> str:
  text = record["text"]
  return text.decode("utf-8") if isinstance(text, bytes) else str(text)


@functools.lru_cache(maxsize=8)
def _file_documents(paths: tuple[str, ...], jsonl_field: str) -> list[str]:
  # Cached: the trainer asks for train and valid (and the tokenizer trainer for train again).
  return read_text_files(list(paths), jsonl_field)


def _source_documents(spec: str, field: str, tfds_split: str, jsonl_field: str,
                      tfds_data_dir: str | None) -> grain.MapDataset:
  kind, arg = parse_source(spec, field)
  if kind == "tfds":
    # Lazy: TFDS is slow to import and optional. ArrayRecord random access, no TensorFlow;
    # download=False, since only focaljax.data.tfds_text.build can prepare our datasets.
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
    name, _, split = arg.partition(":")
    try:
      source = tfds.data_source(name, split=split or tfds_split, data_dir=tfds_data_dir,
                                download=False)
    except (ValueError, RuntimeError, OSError, KeyError) as e:   # unknown, unbuilt, TFRecord
      text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
      first = next((line.strip() for line in text.splitlines() if line.strip()), repr(e))
      raise DataError(f"data.{field}={spec!r}: {first} (data.tfds_data_dir="
                      f"{tfds_data_dir!r}; build ArrayRecord text datasets with "
                      "focaljax.data.tfds_text.build)") from None
    return grain.MapDataset.source(source).map(_decode_text)
  paths = (str(BUNDLED_TEXT),) if kind == "bundled" else tuple(_glob_files(arg, field))
  docs = _file_documents(paths, jsonl_field)
  if not any(d and not d.isspace() for d in docs):
    raise DataError(f"data.{field}={spec!r}: no text in {', '.join(paths)}")
  return grain.MapDataset.source(docs)


def documents(split: str, source: str, *, valid_source: str | None = None,
              valid_fraction: float = 0.05, jsonl_field: str = "text",
              tfds_data_dir: str | None = None) -> grain.MapDataset:
  """All documents (str) of `split` ("train" | "valid"), in a fixed order, as a MapDataset.

  With `valid_source`, "valid" reads all of it. A "tfds:" source brings its own splits ("valid"
  reads "validation"; a ":split" in the spec names the train split only). Otherwise document i
  is held out iff floor((i+1)f) > floor(i f) for f = valid_fraction: evenly spaced, e.g. every
  20th for f = 0.05, and "train" reads the rest.
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  read = functools.partial(_source_documents, jsonl_field=jsonl_field,
                           tfds_data_dir=tfds_data_dir)
  if valid_source is not None:
    if split == "train":
      return read(source, "source", "train")
    return read(valid_source, "valid_source", "validation")
  if source.startswith("tfds:"):
    if split == "valid":
      return read(f"tfds:{source.split(':')[1]}:validation", "source", "validation")
    return read(source, "source", "train")
  docs = read(source, "source", "train")
  i = np.arange(len(docs))
  held_out = np.floor((i + 1) * valid_fraction) > np.floor(i * valid_fraction)
  indices = i[held_out] if split == "valid" else i[~held_out]
  if len(indices) == 0:
    raise DataError(f"the {split} split of data.source={source!r} is empty ({len(docs)} "
                    f"document(s), valid_fraction={valid_fraction} held out); set "
                    "data.valid_source to another source, or train.eval_every=0")
  return grain.MapDataset.source(_Indexed(docs, indices))
