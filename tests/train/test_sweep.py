"""The sweep command: a grid of overrides becomes runs with their own workdirs."""

import os
import re
import subprocess
import sys

import pytest

from focaljax import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_grid_expands_to_cartesian_product():
  grid = sweep.parse_grid(["model.attention.temperature=0.3,0.4,0.5,0.6", "seed=0,1"])
  runs = sweep.expand("configs/focal.py", "runs/t", grid, ["--config.train.steps=10"])
  assert len(runs) == 8
  workdirs = [w for w, _ in runs]
  assert len(set(workdirs)) == 8
  # A relative root is made absolute: the launch lines run from any directory.
  assert os.path.abspath(os.path.join("runs/t", "temperature=0.4,seed=1")) in workdirs
  argv = dict(runs)[os.path.abspath(os.path.join("runs/t", "temperature=0.4,seed=1"))]
  assert "--config.model.attention.temperature=0.4" in argv and "--config.seed=1" in argv
  assert argv[-1] == "--config.train.steps=10"


def test_values_holding_commas_are_separated_by_semicolons():
  grid = sweep.parse_grid(["model.attention.pattern=softmax:rope;softmax:rope,dilution:none"])
  assert grid == [("model.attention.pattern", ["softmax:rope", "softmax:rope,dilution:none"])]
  one = sweep.parse_grid(["model.attention.pattern=softmax:rope,dilution:none;"])
  assert one == [("model.attention.pattern", ["softmax:rope,dilution:none"])]
  for bad in ("seed=1,,2", "seed=1;;2", "seed=;"):
    with pytest.raises(sweep.SweepError, match="an empty value"):
      sweep.parse_grid([bad])


def test_bad_grid_is_refused():
  with pytest.raises(sweep.SweepError, match="field=v1,v2"):
    sweep.parse_grid(["temperature"])


def test_print_writes_launch_lines():
  out = subprocess.run([sys.executable, "-m", "focaljax.sweep", "--config", "configs/focal.py",
                        "--root", "runs/t", "--grid", "model.attention.temperature=0.3,0.4",
                        "--print"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
  lines = out.strip().splitlines()
  assert len(lines) == 2 and all(l.startswith("python ") and "train.py" in l for l in lines)


def test_config_path_is_absolute_and_a_missing_file_one_line(tmp_path, capsys):
  out = subprocess.run([sys.executable, "-m", "focaljax.sweep", "--config",
                        "configs/focal.py:size=400m", "--root", "runs/t", "--grid", "seed=0",
                        "--print"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
  assert f"--config={os.path.join(ROOT, 'configs', 'focal.py')}:size=400m" in out
  rc = sweep.main(["--config", "no/such.py", "--root", str(tmp_path / "r"), "--grid", "seed=0"])
  err = capsys.readouterr().err
  assert rc == 2 and len(err.strip().splitlines()) == 1 and "no file no/such.py" in err


def test_local_sweep_runs_each_point(tmp_path):
  rc = sweep.main(["--config", os.path.join(ROOT, "configs", "smoke.py"), "--root",
                   str(tmp_path), "--grid", "model.attention.temperature=0.3,0.6", "--",
                   "--config.train.steps=2", "--config.train.eval_every=0",
                   "--config.model.attention.pattern=focal"])
  assert rc == 0
  for t in ("0.3", "0.6"):
    assert os.path.exists(tmp_path / f"temperature={t}" / "checkpoints" / "2")


def test_print_slurm_writes_an_array_job():
  out = subprocess.run([sys.executable, "-m", "focaljax.sweep", "--config", "configs/focal.py",
                        "--root", "gs://bucket/sweep", "--grid", "seed=0,1,2", "--print", "slurm",
                        "--", "--config.optim.warmup_steps=2", "--config.train.steps=20"],
                       cwd=ROOT, capture_output=True, text=True, check=True).stdout
  assert out.startswith("#!/bin/bash\n") and "#SBATCH --array=0-2\n" in out
  for i in range(3):   # one case per run, the URL root kept as a URL
    line = next(l for l in out.splitlines() if l.strip().startswith(f"{i}) srun python "))
    assert f"--workdir=gs://bucket/sweep/seed={i}" in line and "--config.train.steps=20" in line
  syntax = subprocess.run(["bash", "-n"], input=out, text=True, capture_output=True)
  assert syntax.returncode == 0, syntax.stderr


def test_print_before_double_dash_still_prints_lines():
  out = subprocess.run([sys.executable, "-m", "focaljax.sweep", "--config", "configs/focal.py",
                        "--root", "runs/t", "--grid", "seed=0", "--print", "--",
                        "--config.optim.warmup_steps=1", "--config.train.steps=2"],
                       cwd=ROOT, capture_output=True, text=True, check=True).stdout
  assert out.startswith("python ") and out.rstrip().endswith("--config.train.steps=2")


@pytest.mark.parametrize("grid,extra,match", [
    ("model.attention.temprature=0.3", [],
     r"temprature=0.3: no config field model.attention.temprature \(did you mean temperature\?\)"),
    ("model.attention.temperature=0.3,-1", [],
     r"temperature=-1: config field model.attention.temperature: must be > 0"),
    ("seed=0", ["--config.train.stepz=3"], r"seed=0: no config field train.stepz"),
    ("seed=0", ["--dry_runn"], r"unknown argument '--dry_runn': runs take --config.<field>"),
    ("seed=0", ["--gird", "seed=1"], r"unknown argument '--gird'"),
    # Refused by config.parse (DataConfig), which train.py runs, not by validate alone.
    ("data.tokenize=foo,ahead", [], r"tokenize=foo: config field data.tokenize must be one of"),
    ("data.source=nope", [], r"source=nope: config field data.source='nope': expected 'bundled'"),
    ("data.tokenizer=train:abc", [], r"config field data.tokenizer='train:abc': expected"),
    # The override would win in every run, all named after the grid's values.
    ("seed=0,1", ["--config.seed=3"], r"--config.seed is swept by --grid; set its values there"),
    ("seed=0,1", ["--config.seed", "3"], r"--config.seed is swept by --grid"),
    ("model.attention.temperature=0.3,0.30", [], r"0.30 repeats an earlier value"),
])
def test_bad_points_are_one_line_before_anything_runs(tmp_path, capsys, grid, extra, match):
  rc = sweep.main(["--config", os.path.join(ROOT, "configs", "smoke.py"), "--root",
                   str(tmp_path), "--grid", grid, "--print", "--", *extra])
  out, err = capsys.readouterr()
  assert rc == 2 and out == "" and not os.listdir(tmp_path)
  assert len(err.strip().splitlines()) == 1 and re.search(match, err), err


def test_a_field_in_two_grids_is_refused(tmp_path, capsys):
  rc = sweep.main(["--config", os.path.join(ROOT, "configs", "smoke.py"), "--root",
                   str(tmp_path), "--grid", "seed=0,1", "--grid", "seed=2", "--print"])
  assert rc == 2 and "--grid seed is given twice: list all its values in one --grid" in \
      capsys.readouterr().err


def test_space_separated_overrides_and_path_args_travel(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "src").mkdir()
  finetune = os.path.join(ROOT, "configs", "finetune.py")
  assert sweep.config_path(f"{finetune}:src") == f"{finetune}:{tmp_path / 'src'}"
  assert sweep.config_path(f"{finetune}:size=1b") == f"{finetune}:size=1b"   # not a path
  rc = sweep.main(["--config", os.path.join(ROOT, "configs", "smoke.py"), "--root", "r",
                   "--grid", "seed=0", "--print", "--", "--config.train.steps", "4"])
  assert rc == 0 and capsys.readouterr().out.rstrip().endswith("--config.train.steps=4")


def test_a_config_file_error_is_its_last_line(tmp_path, capsys):
  rc = sweep.main(["--config", os.path.join(ROOT, "configs", "focal.py") + ":size=bogus",
                   "--root", str(tmp_path), "--grid", "seed=1", "--print"])
  err = capsys.readouterr().err
  assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
  assert "config arg size='bogus'" in err


def test_device_dependent_fields_are_left_to_the_launch(tmp_path, capsys):
  # The sweep machine may be a CPU login node: mesh sizes and micro-batches are the cluster's.
  rc = sweep.main(["--config", os.path.join(ROOT, "configs", "focal.py"), "--root",
                   str(tmp_path), "--grid", "mesh.fsdp=8,64", "--print", "--",
                   "--config.train.micro_batch=4", "--config.mesh.data=-1"])
  out, err = capsys.readouterr()
  assert rc == 0 and len(out.splitlines()) == 2, err


@pytest.mark.parametrize("name,text,match", [
    ("syntax.py", "def get_config(:\n  pass\n", r"syntax.py: SyntaxError: invalid syntax"),
    ("raises.py", "def get_config(arg=None):\n  raise RuntimeError('no cluster here')\n",
     r"raises.py: get_config\(\) failed: RuntimeError: no cluster here"),
    ("notes.md", "# Notes\nIt's a readme.\n", r"notes.md: not a Python config file: SyntaxError"),
    ("plain.py", "x = 1\n", r"plain.py: defines no get_config\(\)"),
    ("number.py", "def get_config():\n  return 3\n", r"returned int, not a ConfigDict"),
    ("sizes", None, r"configs/sizes.py: defines no get_config\(\)"),   # a module, not a config
])
def test_a_broken_config_file_is_one_line_naming_it(tmp_path, capsys, name, text, match):
  path = os.path.join(ROOT, "configs", "sizes.py")
  if text is not None:
    path = str(tmp_path / name)
    with open(path, "w") as f:
      f.write(text)
  rc = sweep.main(["--config", path, "--root", str(tmp_path / "r"), "--grid", "seed=0,1",
                   "--print"])
  out, err = capsys.readouterr()
  assert rc == 2 and out == "" and not os.path.exists(tmp_path / "r")
  assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
  assert err.startswith(f"sweep: error: --config {path}") and re.search(match, err), err


def test_runs_from_outside_the_repository(tmp_path):
  # Config files do `from configs import base`: configs/ is beside train.py, not installed.
  res = subprocess.run([sys.executable, "-m", "focaljax.sweep", "--config",
                        os.path.join(ROOT, "configs", "focal.py"), "--root", "sw", "--grid",
                        "seed=0,1", "--print"], cwd=tmp_path, capture_output=True, text=True)
  assert res.returncode == 0, res.stderr
  lines = res.stdout.strip().splitlines()
  assert len(lines) == 2 and f"--workdir={tmp_path / 'sw' / 'seed=1'}" in lines[1]


def test_workdir_names_are_one_safe_directory_each(tmp_path, capsys):
  grid = sweep.parse_grid(["data.source=text:/data/a*.txt,text:/data/b*.txt", "seed=0"])
  runs = sweep.expand("configs/focal.py", str(tmp_path), grid, [])
  assert [os.path.relpath(w, tmp_path) for w, _ in runs] == [
      "source=text:_data_a_.txt,seed=0", "source=text:_data_b_.txt,seed=0"]
  assert "--config.data.source=text:/data/a*.txt" in runs[0][1]   # the value itself is kept
  rc = sweep.main(["--config", os.path.join(ROOT, "configs", "focal.py"), "--root",
                   str(tmp_path), "--grid", "data.source=text:/data/a*.txt,text:/data/b*.txt",
                   "--print"])
  assert rc == 0 and "--workdir=" + str(tmp_path / "source=text:_data_b_.txt") in (
      capsys.readouterr().out)


@pytest.mark.parametrize("grid,match", [
    (["data.source=text:/d/a*.txt,text:/d/a?.txt"],
     r"data.source=text:/d/a\*.txt and data.source=text:/d/a\?.txt would share the workdir "
     r"source=text:_d_a_.txt"),
    (["seed=0,1,0"], r"'seed=0,1,0': 0 repeats an earlier value"),
    (["data.source=text:" + "a" * 300], r"bytes, over the 255"),
])
def test_runs_that_would_share_a_workdir_are_refused(tmp_path, grid, match):
  with pytest.raises(sweep.SweepError, match=match):
    sweep.expand("configs/focal.py", str(tmp_path), sweep.parse_grid(grid), [])
