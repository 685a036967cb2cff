"""Evaluates a trained focaljax model; results as JSON (and PNG plots) under WORKDIR/eval/.

  python eval.py --workdir runs/default
  python eval.py --workdir runs/default/checkpoints/250 --suites val,longdoc --max_multiplier 4
  python eval.py --workdir runs/default --books path/to/books.jsonl.xz --max_books 16

Suites: val, longdoc, passkey, keyword, attention, sample (default: all). Long documents default
to ../shared/data/corpus/longeval.jsonl.xz next to the repository when it exists, else the
validation split's documents concatenated (the output says which).
"""

import os

from absl import app
from absl import flags
from absl import logging

from focaljax import evaluate

_REPO = os.path.dirname(os.path.abspath(__file__))
_DEFAULT_BOOKS = os.path.join(_REPO, "..", "shared", "data", "corpus", "longeval.jsonl.xz")

_WORKDIR = flags.DEFINE_string("workdir", None, "training workdir or its checkpoints/<step>",
                               required=True)
_SUITES = flags.DEFINE_list("suites", list(evaluate.SUITES), "suites to run")
_BOOKS = flags.DEFINE_string("books", None, "long documents (.jsonl[.xz] with `text`, or .txt); "
                             "default: shared longeval corpus if present, else validation docs")
_MAX_MULTIPLIER = flags.DEFINE_integer("max_multiplier", 8, "longest length / trained context")
_MAX_BOOKS = flags.DEFINE_integer("max_books", 8, "documents for the loss-by-position suite")
_DEPTHS = flags.DEFINE_list("depths", ["0", "0.25", "0.5", "0.75", "1"], "needle depths")
_SEEDS = flags.DEFINE_integer("passkey_seeds", 4, "passkey trials (random keys) per cell")
_VAL_BATCHES = flags.DEFINE_integer("val_batches", None, "default: config train.eval_batches")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "default: WORKDIR/eval")
_PLOTS = flags.DEFINE_bool("plots", True, "write PNG plots (needs matplotlib)")


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every restore at INFO
  books = _BOOKS.value
  if books is None and os.path.isfile(_DEFAULT_BOOKS):
    books = os.path.normpath(_DEFAULT_BOOKS)
  evaluate.run(_WORKDIR.value, suites=_SUITES.value, books=books,
               max_multiplier=_MAX_MULTIPLIER.value, max_books=_MAX_BOOKS.value,
               depths=[float(d) for d in _DEPTHS.value], passkey_seeds=_SEEDS.value,
               val_batches=_VAL_BATCHES.value, out_dir=_OUT_DIR.value, plots=_PLOTS.value)


if __name__ == "__main__":
  app.run(main)
