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
Workdirs are named after the overrides, one directory each: root/temperature=0.3,seed=1 (other
characters than letters, digits and ._=,:+- become _: data.source=text:/d/a*.txt gives
source=text:_d_a_.txt; runs that would share a name are refused); root may be a URL
(gs://bucket/sweep). The config file, every run's config as train.py builds it
(focaljax.config.parse) and the arguments after -- (--config.<field>=value, --dry_run, --verbose)
are checked first: a broken file, a misspelt flag or field or a bad value is one error line, and
nothing runs. What depends on the launch's devices and processes (mesh sizes, train.micro_batch,
data.shards against the process count) is checked by each run when it starts. Works from any
directory.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import itertools
import os
import re
import shlex
import subprocess
import sys

import ml_collections
from absl import flags
from etils import epath
from ml_collections import config_flags

from focaljax import cli
from focaljax import config as config_lib
from focaljax.data import sources

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # train.py and configs/
_TRAIN = os.path.join(_REPO, "train.py")
_UNSAFE = re.compile(r"[^A-Za-z0-9._=,:+-]")   # in a workdir name: becomes _
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
    if key in dict(grid):
      raise SweepError(f"--grid {key} is given twice: list all its values in one --grid")
    same = [v for i, v in enumerate(items) if _number(v) in map(_number, items[:i])]
    if same:   # 0.3 and 0.30: two workdirs training one value
      raise SweepError(f"--grid {item!r}: {same[0]} repeats an earlier value")
    grid.append((key, items))
  return grid


def _number(value: str):
  try:
    return float(value)
  except ValueError:
    return value


def config_path(config: str) -> str:
  """--config with its file made absolute, so the launch lines run from any directory."""
  path, sep, arg = config.partition(":")
  if not os.path.isfile(path):
    raise SweepError(f"--config {config}: no file {path} (relative paths start at {os.getcwd()})")
  if os.path.exists(arg):   # a path argument (configs/finetune.py:runs/x) travels too
    arg = os.path.abspath(arg)
  return os.path.abspath(path) + sep + arg


def check_extra(extra: list[str], grid) -> list[str]:
  """The arguments for every run, `--config.<field> value` joined with '=': --config.<field>=value
  (checked with the config; not a --grid field, which it would override in every run) or a
  flag of train.py's; anything else would fail every run after launch."""
  out = []
  for arg in extra:
    if out and out[-1].startswith("--config.") and "=" not in out[-1] and not arg.startswith("-"):
      out[-1] += "=" + arg
    elif arg.startswith("--config.") or arg.split("=")[0] in _TRAIN_FLAGS:
      out.append(arg)
    else:
      raise SweepError(f"unknown argument {arg!r}: runs take --config.<field>=value, "
                       f"{', '.join(_TRAIN_FLAGS[::2])} (sweep's own: --config, --root, --grid, "
                       "--print)")
  for arg in out:
    if (field := arg.split("=")[0][len("--config."):]) in dict(grid):
      raise SweepError(f"{arg.split('=')[0]} is swept by --grid; set its values there")
  return out


def expand(config: str, root: str, grid, extra: list[str]) -> list[tuple[str, list[str]]]:
  """[(workdir, argv)] for every point of the grid."""
  if "://" not in root:   # the launch lines run from any directory
    root = os.path.abspath(root)
  runs, points = [], {}
  keys = [k for k, _ in grid]
  for values in itertools.product(*(v for _, v in grid)):
    # One directory per run: a '/' in a value (data.source=text:/d/a*.txt) would nest them.
    label = ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in zip(keys, values))
    name = _UNSAFE.sub("_", label) or "run"
    point = ",".join(f"{k}={v}" for k, v in zip(keys, values))
    if name in points:
      raise SweepError(f"--grid: {points[name]} and {point} would share the workdir {name} "
                       "(names keep letters, digits and ._=,:+-); make the values differ there")
    if len(name.encode()) > 255:
      raise SweepError(f"--grid: the workdir name for {point} is {len(name.encode())} bytes, over "
                       "the 255 a directory name may have; sweep fewer or shorter values")
    points[name] = point
    workdir = str(epath.Path(root) / name)   # gs://bucket/sweep stays a URL
    argv = [sys.executable, _TRAIN, f"--config={config}", f"--workdir={workdir}"]
    argv += [f"--config.{k}={v}" for k, v in zip(keys, values)] + list(extra)
    runs.append((workdir, argv))
  return runs


def _one_line(e: Exception) -> str:
  return f"{type(e).__name__}: {' '.join(str(e).split())}"


def check_config_file(config: str) -> None:
  """--config `config` (file[:arg]) loaded and its get_config called, as train.py will: a broken
  file is one line naming it, not a traceback in every run."""
  path, sep, arg = config.partition(":")
  if _REPO not in sys.path:   # config files import configs/, a folder beside train.py
    sys.path.insert(0, _REPO)
  try:   # ml_collections' own loader (any suffix) and module name
    loader = importlib.machinery.SourceFileLoader("config_config", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    sys.modules[loader.name] = module   # a config's dataclasses look their module up
    loader.exec_module(module)
  except Exception as e:  # pylint: disable=broad-except  (the file's own code ran)
    kind = "" if path.endswith(".py") else "not a Python config file: "
    raise SweepError(f"--config {path}: {kind}{_one_line(e)}") from None
  if not callable(getattr(module, "get_config", None)):
    raise SweepError(f"--config {path}: defines no get_config(); a config file's get_config(arg) "
                     "returns the run's ConfigDict (e.g. configs/focal.py)")
  call = f"get_config({arg!r})" if sep else "get_config()"
  try:
    c = module.get_config(*([arg] if sep else []))
  except Exception as e:  # pylint: disable=broad-except
    raise SweepError(f"--config {config}: {call} failed: {_one_line(e)}") from None
  if not isinstance(c, ml_collections.ConfigDict):
    raise SweepError(f"--config {config}: {call} returned {type(c).__name__}, not a ConfigDict")


def check(runs: list[tuple[str, list[str]]]) -> None:
  """The config file, then every run's config as train.py builds it (config_lib.parse), before
  anything launches or prints: a misspelt field or a bad value is one error, not N failed runs.
  process_count=1: devices and processes are the launch's, checked when each run starts."""
  for config in dict.fromkeys(a[len("--config="):] for _, argv in runs for a in argv
                              if a.startswith("--config=")):
    check_config_file(config)
  for workdir, argv in runs:
    args = [a for a in argv[2:] if a.startswith("--config")]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True,
                                    sys_argv=["sweep", *args])
    try:
      fv(["sweep", *args])
      config_lib.parse(fv.config, process_count=1)   # DataConfig and focus.* too, as train.py
    except (AttributeError, KeyError) as e:   # ml_collections: a path naming no field
      raise SweepError(f"{workdir}: {cli.no_field_message(e, args)}") from None
    except (flags.Error, config_lib.ConfigError, FileNotFoundError, sources.DataError) as e:
      # one line; a config file's error arrives as a traceback: its last line
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
  p.add_argument("--grid", action="append", default=[],
                 help="field=v1,v2,... or, for values holding commas, field=v1;v2 (one value: v1;) "
                 "(repeatable)")
  p.add_argument("--print", dest="print_only", nargs="?", const="lines",
                 choices=("lines", "slurm"),
                 help="print launch lines (or, with 'slurm', a SLURM array job) instead of running")
  args, extra = p.parse_known_args(argv)
  extra = [e for e in extra if e != "--"]
  try:
    grid = parse_grid(args.grid)
    runs = expand(config_path(args.config), args.root, grid, check_extra(extra, grid))
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
