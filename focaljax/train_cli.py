"""train.py's flags, their parsing and its run: bad input as one line and the exit codes that
train.py's docstring lists."""

import signal
import sys
import traceback

import jax
import ml_collections
from absl import flags, logging
from ml_collections import config_flags

from focaljax import cli
from focaljax import config as config_lib
from focaljax.data import sources
from focaljax.focus import train as focus_train
from focaljax.train import checkpoint
from focaljax.train import distributed
from focaljax.train import lm
from focaljax.train import loop
from focaljax.train import memory
from focaljax.train import startup

EXIT_NONFINITE, EXIT_BAD_INPUT, EXIT_PREEMPTED = 1, 2, 75

_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Checkpoints, metrics and eval output.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Compile the train step, print memory, exit.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "On bad input, print the traceback too.")
_CONFIG = None


def fail(message: str, code: int = EXIT_BAD_INPUT):
  """One line on stderr, no traceback (unless --verbose)."""
  if _VERBOSE.value if flags.FLAGS.is_parsed() else "--verbose" in sys.argv:
    traceback.print_exc()
  cli.fail(message, code)


def define_config(default_file: str):
  """--config, defaulting to `default_file` (train.py passes the repository's configs/base.py)."""
  global _CONFIG
  try:   # without --config, ml_collections applies the overrides to the default file right here
    _CONFIG = config_flags.DEFINE_config_file("config", default_file,
                                              "Config file (ConfigDict).", lock_config=True)
  except (AttributeError, KeyError) as e:
    fail(cli.no_field_message(e, sys.argv))


def parse_flags(argv):
  """absl's flag parsing, with bad flags and config files as one line and exit 2."""
  given = list(argv)
  try:
    argv = flags.FLAGS(argv)
    _CONFIG.value.get("train")   # a config file that failed to load raises here
  except SystemExit as e:
    cli.exit_after_help(e, argv)
  except flags.UnrecognizedFlagError as e:
    name = e.flagname or ""
    fail(f"no config field {name[len('config.'):]}" if name.startswith("config.") else e)
  except (flags.Error, OSError) as e:
    fail(e)
  except (AttributeError, KeyError) as e:   # --config.<path> naming no field
    if "get_config" in str(e):
      fail(f"--config {_config_file(argv)}: the file defines no get_config()")
    fail(cli.no_field_message(e, argv))
  except Exception as e:  # pylint: disable=broad-except  (the config file's own code failed)
    fail(f"--config {_config_file(argv)}: {type(e).__name__}: {e}")
  if len(argv) > 1:
    fail(f"unexpected arguments: {argv[1:]}")
  for arg in given[1:]:   # a section set whole would skip its fields' types and defaults
    path = arg[len("--config."):].split("=")[0] if arg.startswith("--config.") else ""
    if path and isinstance(_field(_CONFIG.value, path), (dict, ml_collections.ConfigDict)):
      fail(f"--config.{path}: a section; set its fields one by one (--config.{path}.<field>=...)")
  return argv


def _field(c, dotted: str):
  for part in dotted.split("."):
    c = c.get(part) if hasattr(c, "get") else None
  return c


def _config_file(argv) -> str:
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg[len("--config="):]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return _CONFIG.default if _CONFIG else "configs/base.py"


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax and Grain log every save at INFO
  distributed.initialize()
  startup.enable_compile_cache()   # reruns and resumes load the compiled step
  if jax.process_count() == 1:   # several hosts agree on a step through jax's preemption sync
    signal.signal(signal.SIGTERM, loop.sigterm_before_training)   # set-up and compile: exit 75
  try:
    cfg = config_lib.parse(_CONFIG.value, process_count=jax.process_count())
    # A FocusLLM config (configs/focus.py) trains a candidate adapter over a frozen base.
    summary = (focus_train.train if cfg.focus else lm.train)(cfg, _WORKDIR.value,
                                                             dry_run=_DRY_RUN.value)
  except (config_lib.ConfigError, FileNotFoundError, sources.DataError,
          checkpoint.CorruptCheckpoint) as e:   # bad input
    fail(e)
  except memory.OutOfMemory as e:   # the estimate and the knobs, not XLA's allocator dump
    fail(e)
  except loop.NonFiniteLoss as e:
    fail(e, EXIT_NONFINITE)
  except loop.PreemptedAtStartup as e:   # a scheduler's requeue reruns it
    print(e, file=sys.stderr)
    sys.exit(EXIT_PREEMPTED)
  if summary.get("preempted"):
    sys.exit(EXIT_PREEMPTED)
