"""Faults a run must survive: a bad step never reaches a checkpoint, bad input is one line and
exit 2, SIGTERM exits 75, a workdir refuses another model. Every case checks that no file of the
trained workdir was lost or changed."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from configs import smoke
from focaljax import config as config_lib
from focaljax.train import checkpoint
from focaljax.train import lm
from focaljax.train import loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**train):
  c = smoke.get_config()   # 6 steps, checkpoints at 3 and 6
  c.train.update(**train)
  return c


def _snapshot(workdir):
  """sha256 of every checkpoint file, the tokenizer and the config."""
  out = {}
  for dirpath, _, names in os.walk(workdir):
    for name in names:
      path = os.path.join(dirpath, name)
      rel = os.path.relpath(path, workdir)
      if rel.startswith("checkpoints") or rel in ("tokenizer.json", "config.json"):
        with open(path, "rb") as f:
          out[rel] = hashlib.sha256(f.read()).hexdigest()
  return out


def _kept(workdir):
  """The snapshot less config.json, which records the latest run's config."""
  return {k: v for k, v in _snapshot(workdir).items() if k != "config.json"}


def _steps(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["step"] for line in f if '"loss"' in line]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A smoke run trained to step 6; tests work on copies (`workdir`)."""
  workdir = str(tmp_path_factory.mktemp("faults") / "trained")
  lm.train(config_lib.parse(_config()), workdir)
  return workdir, _snapshot(workdir)


@pytest.fixture
def workdir(trained, tmp_path):
  copy = str(tmp_path / "run")
  shutil.copytree(trained[0], copy)
  return copy


def _train_py(workdir, *overrides, before="", config="smoke.py"):
  """train.py in a subprocess (`before`: Python run first, e.g. patching a loop constant)."""
  argv = [os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", config),
          "--workdir", str(workdir), *overrides]
  code = f"{before}\nimport runpy, sys\nsys.argv = {argv!r}\nrunpy.run_path(sys.argv[0], " \
         "run_name='__main__')"
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)


def _one_error_line(proc, pattern):
  import re  # pylint: disable=import-outside-toplevel
  lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert len(lines) == 1 and re.search(pattern, lines[0]), proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
  return lines[0]


# 1. No NaN checkpoint.

def test_nonfinite_parameters_are_never_saved(trained, workdir):
  # lr = inf: step 7's loss and gradient are finite, its updated parameters are not. Checkpoint
  # every step, so a save of step 7 would follow at once.
  proc = _train_py(workdir, "--config.train.steps=9", "--config.train.ckpt_every=1",
                   "--config.optim.peak_lr=1e39")
  assert proc.returncode == 1, proc.stderr[-3000:]
  _one_error_line(proc, r"^error: non-finite parameters after the update at step 7; stopped[^;]*; "
                  r"the latest checkpoint is step 6$")
  assert checkpoint.latest_step(workdir) == 6
  assert _kept(workdir) == _kept(trained[0])


def test_exploded_loss_stops_before_the_save(trained, workdir, monkeypatch):
  monkeypatch.setattr(loop, "MAX_LOSS", 1.0)   # the smoke model's loss is about 5
  with pytest.raises(loop.NonFiniteLoss, match=r"^exploded loss \(\S+ > 1\) at step 7; stopped .*; "
                     "the latest checkpoint is step 6$"):
    lm.train(config_lib.parse(_config(steps=9, ckpt_every=1)), workdir)
  assert _kept(workdir) == _kept(trained[0])


def test_a_nonfinite_validation_loss_stops_before_the_save(tmp_path):
  # lr 1e8: step 3's training loss is finite, but its parameters overflow the validation
  # forward (the user trial's case: the "last good" checkpoint gave NaN logits).
  c = _config(steps=20, eval_every=3, ckpt_every=3)
  c.optim.update(peak_lr=1e8, clip_norm=1e9)
  with pytest.raises(loop.NonFiniteLoss, match=r"^non-finite or exploded val_loss nan at step 3; "
                     "stopped; the latest checkpoint is none$"):
    lm.train(config_lib.parse(c), str(tmp_path))
  assert checkpoint.latest_step(str(tmp_path)) is None


def test_skip_gives_up_after_consecutive_skips(trained, workdir, monkeypatch):
  monkeypatch.setattr(loop, "MAX_SKIPPED", 3)
  c = _config(steps=30, nonfinite="skip")   # checkpoint steps 9, 12, ...
  c.optim.peak_lr = 1e39
  with pytest.raises(loop.NonFiniteLoss, match=r"^3 consecutive skipped steps \(7-9, the last: "
                     r".*\) at step 9; giving up \(train.nonfinite=skip\); the latest checkpoint "
                     r"is step 6$"):
    lm.train(config_lib.parse(c), workdir)
  assert _kept(workdir) == _kept(trained[0])


# 2. Resume-finished.

def test_resume_finished_trains_nothing(trained, workdir):
  proc = _train_py(workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "holds the finished run (step 6 of train.steps=6): nothing to train" in proc.stdout
  assert _snapshot(workdir) == trained[1]
  assert _steps(workdir) == _steps(trained[0])


# 3. Data checked before the first step.

def test_empty_corpus_exits_2_before_compiling(tmp_path):
  (tmp_path / "empty.txt").write_text("")
  proc = _train_py(tmp_path / "run", f"--config.data.source=text:{tmp_path}/empty.txt")
  assert proc.returncode == 2, proc.stderr[-3000:]
  _one_error_line(proc, r"^error: data.source='text:.*empty.txt': no text in .*empty.txt$")
  assert not os.path.exists(tmp_path / "run" / "checkpoints")
  assert not os.path.exists(tmp_path / "run" / "tokenizer.json")


# 4. Exit codes.

@pytest.mark.parametrize("script,args,match", [
    ("train.py", ["--config.train.foo=1"], r"^error: no config field train.foo$"),
    ("train.py", ["--config.train.log_every=0"], r"^error: config field train.log_every: "),
    ("eval.py", ["--workdir", "/nonexistent/run"], r"^error: /nonexistent/run is neither"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, script, args, match):
  argv = [os.path.join(ROOT, script)]
  if script == "train.py":
    argv += ["--config", os.path.join(ROOT, "configs", "smoke.py"), "--workdir", str(tmp_path)]
  argv += args
  proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  _one_error_line(proc, match)
  assert not os.path.exists(tmp_path / "checkpoints")


def test_sigterm_saves_and_exits_75(trained, workdir):
  argv = [sys.executable, os.path.join(ROOT, "train.py"), "--config",
          os.path.join(ROOT, "configs", "smoke.py"), "--workdir", workdir,
          "--config.train.steps=100000", "--config.train.log_every=1",
          "--config.train.eval_every=0", "--config.train.ckpt_every=100000"]
  proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  deadline = time.time() + 240
  while time.time() < deadline and max(_steps(workdir)) < 8:
    time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 75, out.decode()[-3000:]
  assert b"SIGTERM: saved step" in out
  assert checkpoint.latest_step(workdir) >= 8
  snap = _snapshot(workdir)
  assert all(snap.get(k) == v for k, v in trained[1].items()
             if k.startswith("checkpoints/6/") or k == "tokenizer.json")


def test_sigterm_during_set_up_exits_75_without_writing(tmp_path):
  """Before the first step (data, compile) there is nothing new to save: exit 75 all the same,
  so a scheduler that requeues on 75 reruns it."""
  workdir = str(tmp_path / "run")
  argv = [sys.executable, os.path.join(ROOT, "train.py"), "--config",
          os.path.join(ROOT, "configs", "smoke.py"), "--workdir", workdir]
  proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  deadline = time.time() + 120   # the lock: train.py's handler is set, set-up is under way
  while time.time() < deadline and not os.path.exists(os.path.join(workdir, ".lock")):
    time.sleep(0.01)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 75, out.decode()[-3000:]
  assert b"SIGTERM before the first step" in out and b"Traceback" not in out
  assert not os.path.exists(os.path.join(workdir, "checkpoints", "1"))


def test_sigterm_while_importing_exits_75(tmp_path):
  """Sent as soon as train.py catches SIGTERM, while jax imports (the user trial's 143)."""
  argv = [sys.executable, os.path.join(ROOT, "train.py"), "--workdir", str(tmp_path / "run")]
  proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  deadline = time.time() + 60
  while time.time() < deadline:   # bit 14 of SigCgt: a handler for signal 15
    status = open(f"/proc/{proc.pid}/status").read()
    if int(status.split("SigCgt:")[1].split()[0], 16) >> 14 & 1:
      break
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=60)
  assert proc.returncode == 75, out.decode()[-3000:]
  source = open(os.path.join(ROOT, "train.py")).read()   # the handler comes before any import
  assert source.index("signal.signal(signal.SIGTERM") < source.index("from absl")


# 5. Workdir identity.

def test_other_model_shape_is_refused_before_writing(trained, workdir):
  before = {name: os.path.getmtime(os.path.join(workdir, name)) for name in os.listdir(workdir)}
  with open(os.path.join(workdir, "metrics.jsonl"), "rb") as f:
    metrics_before = f.read()
  proc = _train_py(workdir, "--config.model.d_model=32", "--config.model.num_layers=3")
  assert proc.returncode == 2, proc.stderr[-3000:]
  line = _one_error_line(proc, r"holds a different model \(checkpoint step 6\): ")
  assert "model.d_model 64 -> 32" in line and "model.num_layers" in line
  assert _snapshot(workdir) == trained[1]
  assert {n: os.path.getmtime(os.path.join(workdir, n)) for n in os.listdir(workdir)} == before
  with open(os.path.join(workdir, "metrics.jsonl"), "rb") as f:
    assert f.read() == metrics_before


def test_resume_cuts_metrics_back_to_the_checkpoint(trained, workdir):
  # A run killed after step 8 had logged steps 7-8 (and half a line) past its last checkpoint, 6.
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write('{"step": 7, "loss": 1.0}\n{"step": 8, "loss": 1.0}\n{"step": 9, "lo')
  lm.train(config_lib.parse(_config(steps=8, log_every=1, eval_every=0)), workdir)
  steps = _steps(workdir)
  assert steps == sorted(set(steps)) and steps[-2:] == [7, 8], steps
