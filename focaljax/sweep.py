"""Expand a grid of config overrides into runs, each with its own workdir.

  python -m focaljax.sweep --config configs/focal.py --root runs/temp \\
      --grid model.attention.temperature=0.3,0.4,0.5,0.6 [--grid seed=0,1] [--print [slurm]] \\
      [-- --config.train.steps=2000]

Runs one after another locally (each a `train.py` subprocess, so one run's failure does not stop
the rest). --print writes one launch line per run for a cluster scheduler (prefix each with your
`srun`/`gcloud ... ssh` as usual); --print slurm writes a SLURM array job, one array task per run
on one node (edit its #SBATCH lines, then sbatch it; see launch/slurm.sbatch). The cartesian
product of all --grid flags is taken; values that hold commas (hybrid patterns) are separated
by ';' instead: --grid 'model.attention.pattern=softmax:rope;softmax:rope,dilution:none' (one
such value: end it with ';').
Workdirs are named after the overrides: root/temperature=0.3,seed=1; root may be a URL
(gs://bucket/sweep). Every run's config and the arguments after -- (--config.<field>=value,
--dry_run, --verbose) are checked first: a misspelt flag or field or a bad value is one error
line, and nothing runs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import subprocess
import sys

from absl import flags
from etils import epath
from ml_collections import config_flags

from focaljax import config as config_lib

_TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")
_TRAIN_FLAGS = ("--dry_run", "--nodry_run", "--verbose", "--noverbose")   # besides --config.*


class SweepError(ValueError):
  """Bad --grid or override: one line, nothing launched or printed."""


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
  grid = []
  for item in items:
    key, sep, values = item.partition("=")
    if not sep or not values:
      raise SweepError(f"--grid {item!r}: expected field=v1,v2,... e.g. "
                       "model.attention.temperature=0.3,0.4")
    # ';' separates values that hold commas; a trailing ';' makes one such value a list
    items = values.split(";" if ";" in values else ",")
    items = items[:-1] if ";" in values and values.endswith(";") else items
    if not all(items):
      raise SweepError(f"--grid {item!r}: an empty value")
    grid.append((key, items))
  return grid


def config_path(config: str) -> str:
  """--config with its file made absolute, so the launch lines run from any directory."""
  path, sep, arg = config.partition(":")
  if not os.path.isfile(path):
    raise SweepError(f"--config {config}: no file {path} (relative paths start at {os.getcwd()})")
  return os.path.abspath(path) + sep + arg


def check_extra(extra: list[str]) -> None:
  """The arguments for every run: --config.<field>=value (checked with the config) or a flag of
  train.py's; anything else would fail every run after launch."""
  for arg in extra:
    if not (arg.startswith("--config.") or arg.split("=")[0] in _TRAIN_FLAGS):
      raise SweepError(f"unknown argument {arg!r}: runs take --config.<field>=value, "
                       f"{', '.join(_TRAIN_FLAGS[::2])} (sweep's own: --config, --root, --grid, "
                       "--print)")


def expand(config: str, root: str, grid, extra: list[str]) -> list[tuple[str, list[str]]]:
  """[(workdir, argv)] for every point of the grid."""
  if "://" not in root:   # the launch lines run from any directory
    root = os.path.abspath(root)
  runs = []
  keys = [k for k, _ in grid]
  for values in itertools.product(*(v for _, v in grid)):
    name = ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in zip(keys, values)) or "run"
    workdir = str(epath.Path(root) / name)   # gs://bucket/sweep stays a URL
    argv = [sys.executable, _TRAIN, f"--config={config}", f"--workdir={workdir}"]
    argv += [f"--config.{k}={v}" for k, v in zip(keys, values)] + list(extra)
    runs.append((workdir, argv))
  return runs


def check(runs: list[tuple[str, list[str]]]) -> None:
  """Every run's config as train.py would build it, validated (config_lib.validate) before
  anything launches or prints: a misspelt field or a bad value is one error, not N failed runs."""
  for workdir, argv in runs:
    args = [a for a in argv[2:] if a.startswith("--config")]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True,
                                    sys_argv=["sweep", *args])
    try:
      fv(["sweep", *args])
      config_lib.validate(fv.config)
    except (AttributeError, KeyError) as e:   # ml_collections: a path naming no field
      raise SweepError(f"{workdir}: {config_lib.no_field_message(e, args)}") from None
    except (flags.Error, config_lib.ConfigError) as e:   # a config file's error: its last line
      lines = [line.strip() for line in str(e).splitlines() if line.strip()]
      raise SweepError(f"{workdir}: {lines[-1] if lines else e}") from None


def slurm_array(runs: list[str]) -> str:
  """An sbatch array job: task i runs the launch line runs[i] on one node, one process per GPU
  (jax's SLURM detection gives each process the GPU of its SLURM_LOCALID)."""
  cases = "\n".join(f"  {i}) srun {line} || rc=$? ;;" for i, line in enumerate(runs))
  return f"""#!/bin/bash
# {len(runs)} focaljax runs (focaljax.sweep --print slurm); edit the resources, then sbatch.
#SBATCH --job-name=focaljax-sweep
#SBATCH --array=0-{len(runs) - 1}
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@300
#SBATCH --output=slurm-%A_%a.out
set -uo pipefail
cd "${{SLURM_SUBMIT_DIR:-.}}"
rc=0
case "$SLURM_ARRAY_TASK_ID" in
{cases}
esac
if [ "$rc" -eq 75 ]; then   # saved on SIGTERM: run again from the checkpoint
  scontrol requeue "${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}"
fi
exit "$rc"
"""


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--config", required=True, help="config file, e.g. configs/focal.py[:arg]")
  p.add_argument("--root", required=True, help="parent directory of the runs' workdirs")
  p.add_argument("--grid", action="append", default=[], help="field=v1,v2,... or, for values holding commas, field=v1;v2 "
                 "(one value: v1;) (repeatable)")
  p.add_argument("--print", dest="print_only", nargs="?", const="lines",
                 choices=("lines", "slurm"),
                 help="print launch lines (or, with 'slurm', a SLURM array job) instead of running")
  args, extra = p.parse_known_args(argv)
  extra = [e for e in extra if e != "--"]
  try:
    check_extra(extra)
    runs = expand(config_path(args.config), args.root, parse_grid(args.grid), extra)
    check(runs)
  except SweepError as e:
    print(f"sweep: error: {e}", file=sys.stderr)
    return 2
  if args.print_only:
    lines = [shlex.join(["python"] + run_argv[1:]) for _, run_argv in runs]
    print(slurm_array(lines) if args.print_only == "slurm" else "\n".join(lines + [""]), end="")
    return 0
  failed = []
  for i, (workdir, run_argv) in enumerate(runs):
    print(f"[{i + 1}/{len(runs)}] {workdir}", flush=True)
    if subprocess.call(run_argv) != 0:
      failed.append(workdir)
  for workdir in failed:
    print(f"FAILED: {workdir}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
