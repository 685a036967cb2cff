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
import signal
import sys

# A preemption while the imports below run (seconds): the exit a scheduler requeues (75), as
# train_cli's handlers give later in set-up and in training.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))

# jax's default pool is 75% of a GPU's memory, which the large presets' measured batches (1.3B at
# 24 x 2048 on an H200) outgrow; a user's own setting wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

from absl import app, flags  # noqa: E402  (jax reads the memory setting when it starts)

from focaljax import train_cli  # noqa: E402

if __name__ == "__main__":
  train_cli.define_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                                       "base.py"))
  flags.adopt_module_key_flags(train_cli)   # --help lists them
  app.run(train_cli.main, flags_parser=train_cli.parse_flags)
