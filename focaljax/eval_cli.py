"""eval.py's flags, their checks and its run: which suites go to focaljax.evaluation and which
to FocusLLM's, bad input as one line (exit 2), a suite with no result as exit 1."""

import sys

from absl import app
from absl import flags
from absl import logging
from etils import epath

from focaljax import cli
from focaljax import config as config_lib
from focaljax.data import sources
from focaljax.evaluation import loading
from focaljax.evaluation import suites as evaluate
from focaljax.focus import evaluate as focus_eval
from focaljax.focus import train as focus_train
from focaljax.train import checkpoint

_WORKDIR = flags.DEFINE_string("workdir", None, "training workdir or its checkpoints/<step>",
                               required=True)
_SUITES = flags.DEFINE_list("suites", list(evaluate.SUITES),
                            "suites to run; also focus_passkey, focus_longdoc (--focus_adapter)")
_BOOKS = flags.DEFINE_string("books", None, "long documents (.jsonl[.xz] with `text`, or .txt); "
                             "default: the validation documents")
_MAX_MULTIPLIER = flags.DEFINE_integer("max_multiplier", 8, "longest length / trained context",
                                       lower_bound=1)
_MAX_BOOKS = flags.DEFINE_integer("max_books", 8, "documents for the loss-by-position suite",
                                  lower_bound=1)
_DEPTHS = flags.DEFINE_list("depths", ["0", "0.25", "0.5", "0.75", "1"], "needle depths")
_SEEDS = flags.DEFINE_integer("passkey_seeds", 4, "passkey trials (random keys) per cell",
                              lower_bound=1)
_VAL_BATCHES = flags.DEFINE_integer("val_batches", None, "default: config train.eval_batches",
                                    lower_bound=1)
_OUT_DIR = flags.DEFINE_string("out_dir", None, "results directory (made if missing); default: "
                               "WORKDIR/eval")
_PLOTS = flags.DEFINE_bool("plots", True, "write PNG plots (needs matplotlib)")
_FOCUS_ADAPTER = flags.DEFINE_string("focus_adapter", None, "FocusLLM adapter of the --workdir "
                                     "base: a FocusLLM run workdir or its checkpoints/<step>")
_FOCUS_MULTIPLIERS = flags.DEFINE_list("focus_multipliers",
                                       [str(m) for m in focus_eval.DEFAULT_MULTIPLIERS],
                                       "focus_passkey lengths / the base's trained context")
_FOCUS_LOCAL_LEN = flags.DEFINE_integer("focus_local_len", None,
                                        "local window tokens; default: the window the "
                                        "adapter trained on", lower_bound=2)
_FOCUS_CHUNK_SIZE = flags.DEFINE_integer("focus_chunk_size", None,
                                         "memory chunk size; default: the adapter's largest",
                                         lower_bound=1)
_FOCUS_PROMPT_LEN = flags.DEFINE_integer(
    "focus_prompt_len", None, "dynamic prompt: the last min(this, chunk size) window tokens "
    "appended to every chunk; default: the run's focus.eval_prompt_len, else the trained one",
    lower_bound=1)
_FOCUS_IMPLEMENTATION = flags.DEFINE_enum("focus_implementation", None,
                                          ["auto", "xla", "pallas"],
                                          "candidate/local attention; default: the adapter's")
_FOCUS_PASSKEY_BATCH = flags.DEFINE_integer(
    "focus_passkey_batch", 1, "focus_passkey trials per generate call (each holds its own chunk "
    "caches: at 100x a 1K context, several GB in bfloat16 for a 100M base)", lower_bound=1)
_FOCUS_DTYPE = flags.DEFINE_enum("focus_dtype", "float32", ["float32", "bfloat16"],
                                 "cast base and adapter for the FocusLLM suites")


def _depths_ok(values) -> bool:
  try:
    return all(0.0 <= float(v) <= 1.0 for v in values)
  except ValueError:
    return False


def _ints_ok(values) -> bool:
  return all(v.isdigit() and int(v) >= 1 for v in values)


def _dir_ok(path) -> bool:
  """None, or a path whose nearest existing part is a directory (the rest is made)."""
  p = epath.Path(path) if path else None
  while p is not None and not p.exists() and p.parent != p:
    p = p.parent
  return p is None or p.is_dir()


# Bad values are refused while the flags are parsed (one line, exit 2), not as a skipped suite.
# An empty list would run no length (or a range() of step 0), so it is bad input too.
flags.register_validator("depths", lambda v: bool(v) and _depths_ok(v),
                         "one or more numbers, each in [0, 1]")
flags.register_validator("focus_multipliers", lambda v: bool(v) and _ints_ok(v),
                         "one or more integers, each >= 1")
flags.register_validator("out_dir", _dir_ok, "must be a directory (made if missing), not a file "
                         "or under one")
flags.register_validator("books", lambda path: path is None or epath.Path(path).exists(),
                         "no such file")


def parse_flags(argv):
  try:
    argv = flags.FLAGS(argv)
  except flags.Error as e:
    cli.fail(e)
  except SystemExit as e:
    cli.exit_after_help(e, argv)
  if len(argv) > 1:
    cli.fail(f"unexpected arguments: {argv[1:]}")
  return argv


def main(argv):
  del argv
  try:
    run()
  # FileExistsError, NotADirectoryError: a default out_dir (WORKDIR/eval) that is a file.
  except (app.UsageError, config_lib.ConfigError, FileNotFoundError, FileExistsError,
          NotADirectoryError, sources.DataError, checkpoint.CorruptCheckpoint,
          loading.NotALanguageModel, focus_train.NotAnAdapter, focus_eval.UnreadableBase) as e:
    cli.fail(e)


def run():
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every restore at INFO
  books = _BOOKS.value
  suites = _SUITES.value
  if _FOCUS_ADAPTER.value and not flags.FLAGS["suites"].present:
    suites = ["focus_passkey"] + (["focus_longdoc"] if books else [])
  if not suites:
    raise app.UsageError("--suites is empty; name one or more of them, or leave it out for all")
  allowed = list(evaluate.SUITES) + list(focus_eval.FOCUS_SUITES)
  if set(suites) - set(allowed):
    raise app.UsageError(f"--suites: unknown {sorted(set(suites) - set(allowed))}; allowed: "
                         f"{allowed}")
  focus_suites = [s for s in suites if s in focus_eval.FOCUS_SUITES]
  base_suites = [s for s in suites if s not in focus_eval.FOCUS_SUITES]
  if focus_suites and not _FOCUS_ADAPTER.value:
    raise app.UsageError(f"--suites {','.join(focus_suites)} needs --focus_adapter")
  if "focus_longdoc" in suites and not books:
    raise app.UsageError("--suites focus_longdoc needs long documents: --books")
  if books and not any(sources.read_text_files([books], "text")):
    # Read before any suite runs: a bad --books file is bad input, not a skipped suite.
    raise sources.DataError(f"--books {books}: no documents")
  results = {}
  if base_suites:
    results |= evaluate.run(_WORKDIR.value, suites=base_suites, books=books,
                 max_multiplier=_MAX_MULTIPLIER.value, max_books=_MAX_BOOKS.value,
                 depths=[float(d) for d in _DEPTHS.value], passkey_seeds=_SEEDS.value,
                 val_batches=_VAL_BATCHES.value, out_dir=_OUT_DIR.value, plots=_PLOTS.value)
  if focus_suites:
    # The base suites' defaults suit a 1-8x sweep; FocusLLM's protocol goes to 32x and 10 seeds.
    present = lambda name: flags.FLAGS[name].present
    results |= focus_eval.run(
        _WORKDIR.value, _FOCUS_ADAPTER.value, suites=focus_suites, books=books,
        max_multiplier=_MAX_MULTIPLIER.value if present("max_multiplier") else 32,
        max_books=_MAX_BOOKS.value, multipliers=[int(m) for m in _FOCUS_MULTIPLIERS.value],
        seeds=_SEEDS.value if present("passkey_seeds") else 10,
        local_len=_FOCUS_LOCAL_LEN.value, chunk_size=_FOCUS_CHUNK_SIZE.value,
        prompt_len=_FOCUS_PROMPT_LEN.value, implementation=_FOCUS_IMPLEMENTATION.value,
        dtype=_FOCUS_DTYPE.value,
        passkey_batch=_FOCUS_PASSKEY_BATCH.value, out_dir=_OUT_DIR.value)
  if empty := evaluate.unanswered(results):
    print(f"error: no result from suite(s) {', '.join(empty)} (the reason is above)",
          file=sys.stderr)
    sys.exit(1)

