"""Train a focaljax model.

  python train.py                                   # tiny model, bundled text, CPU, a few minutes
  python train.py --config configs/focal.py --workdir runs/focal --config.train.steps=2000
  python train.py --config configs/base.py:size=400m --dry_run   # memory per device, no training

Any config field can be overridden with --config.<path>=<value>; unknown keys, wrong types and
invalid values are refused before anything compiles. The run resumes from the workdir's latest
checkpoint. Grids of overrides: python -m focaljax.sweep --help.

Exit status: 0 trained (or nothing left to train); 1 stopped at a NaN/Inf or exploded step (the
latest checkpoint is the last good one); 2 bad input (flags, config, missing files, bad data),
one line `error: ...` before anything compiles, or out of device memory (one line with the
compiled step's size and the knobs: train.micro_batch, model.remat, mesh.fsdp); 75 (EX_TEMPFAIL)
preempted by SIGTERM (during training after saving a checkpoint; before it, with nothing new to
save): run the same command again to resume.
"""

import os
import re
import signal
import sys
import traceback

# jax's default pool is 75% of a GPU's memory, which the large presets' measured batches (1.3B at
# 24 x 2048 on an H200) outgrow; a user's own setting wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402  (after the memory setting, which jax reads when it starts a backend)
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags

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

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Checkpoints, metrics and eval output.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Compile the train step, print memory, exit.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "On bad input, print the traceback too.")


def fail(message: str, code: int = EXIT_BAD_INPUT):
  """One line on stderr, no traceback (unless --verbose)."""
  if _VERBOSE.value if flags.FLAGS.is_parsed() else "--verbose" in sys.argv:
    traceback.print_exc()
  lines = [line.strip() for line in str(message).splitlines() if line.strip()]
  # A config file's own error arrives as the last line of its traceback: drop the class name.
  last = re.sub(r"^\w*(Error|Exception): ", "", lines[-1]) if lines else message
  print(f"error: {last}", file=sys.stderr)
  sys.exit(code)


try:   # without --config, ml_collections applies the overrides to the default file right here
  _CONFIG = config_flags.DEFINE_config_file(
      "config", os.path.join(_HERE, "configs", "base.py"), "Config file (ConfigDict).",
      lock_config=True)
except (AttributeError, KeyError) as e:
  fail(config_lib.no_field_message(e, sys.argv))


def parse_flags(argv):
  """absl's flag parsing, with bad flags and config files as one line and exit 2."""
  try:
    argv = flags.FLAGS(argv)
    _CONFIG.value.get("train")   # a config file that failed to load raises here
  except flags.UnrecognizedFlagError as e:
    name = e.flagname or ""
    fail(f"no config field {name[len('config.'):]}" if name.startswith("config.") else e)
  except (flags.Error, OSError) as e:
    fail(e)
  except (AttributeError, KeyError) as e:   # --config.<path> naming no field
    fail(config_lib.no_field_message(e, argv))
  if len(argv) > 1:
    fail(f"unexpected arguments: {argv[1:]}")
  return argv


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


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
