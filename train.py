"""Train a focaljax model.

  python train.py                                   # tiny model, bundled text, CPU, a few minutes
  python train.py --config configs/focal.py --workdir runs/focal --config.train.steps=2000
  python train.py --config configs/base.py:size=400m --dry_run   # compile + memory, no training

Any config field can be overridden with --config.<path>=<value>; unknown keys, wrong types and
invalid values are refused before anything compiles. The run resumes from the workdir's latest
checkpoint. Grids of overrides: python -m focaljax.sweep --help.
"""

import os
import sys

# jax's default pool is 75% of a GPU's memory, which the large presets' measured batches (1.3B at
# 24 x 2048 on an H200) outgrow; a user's own setting wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402  (after the memory setting, which jax reads when it starts a backend)
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags

from focaljax import config as config_lib
from focaljax.focus import train as focus_train
from focaljax.train import distributed
from focaljax.train import lm

_HERE = os.path.dirname(os.path.abspath(__file__))
_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(_HERE, "configs", "base.py"), "Config file (ConfigDict).",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Checkpoints, metrics and eval output.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Compile the train step, print memory, exit.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax and Grain log every save at INFO
  distributed.initialize()
  try:
    cfg = config_lib.parse(_CONFIG.value, process_count=jax.process_count())
    # A FocusLLM config (configs/focus.py) trains a candidate adapter over a frozen base.
    (focus_train.train if cfg.focus else lm.train)(cfg, _WORKDIR.value, dry_run=_DRY_RUN.value)
  except (config_lib.ConfigError, FileNotFoundError) as e:   # bad input: one line, no traceback
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main)
