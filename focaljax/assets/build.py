"""Rebuilds the bundled text and its tokenizer from a corpus JSONL (see README.md here).

  python -m focaljax.assets.build CORPUS/train.jsonl.xz

Writes bundled.jsonl.xz (one public-domain document per line) and tokenizer.json (byte-level
BPE, vocab 4096, trained on the bundled train split, i.e. without the held-out valid docs).
"""

import json
import lzma
import pathlib
import sys

from focaljax.data import sources
from focaljax.data import tokenizer

HERE = pathlib.Path(__file__).parent
VOCAB_SIZE = 4096
# Public-domain literature only; no software manuals (GPL etc.) and nothing from longeval.
_CANTERBURY = ("alice29", "asyoulik")  # Carroll, Alice in Wonderland; Shakespeare, As You Like It
_SOTU_LAST_YEAR = 1829  # State of the Union addresses 1790-1829 (US Government works)


def _keep(doc: dict) -> bool:
  if doc["source"] == "canterbury":
    return doc["doc"] in _CANTERBURY
  if doc["source"] == "sotu":
    return int(doc["doc"][:4]) <= _SOTU_LAST_YEAR
  return False


def main(corpus: str) -> None:
  with lzma.open(corpus, "rt", encoding="utf-8") as f:
    docs = [d for d in map(json.loads, f) if _keep(d)]
  keep = ("source", "doc", "license", "text")
  xz_preset = 9 | lzma.PRESET_EXTREME  # the smallest file: it lives in git
  with lzma.open(HERE / "bundled.jsonl.xz", "wt", encoding="utf-8", preset=xz_preset) as f:
    for d in docs:
      f.write(json.dumps({k: d[k] for k in keep}, ensure_ascii=False) + "\n")
  tok = tokenizer.train_bpe(sources.documents("train", "bundled"), VOCAB_SIZE)
  tok.save(HERE)
  n_chars = sum(len(d["text"]) for d in docs)
  print(f"{len(docs)} documents, {n_chars} characters; tokenizer vocab {tok.vocab_size}")


if __name__ == "__main__":
  main(sys.argv[1])
