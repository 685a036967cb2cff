"""Damaged checkpoints: restore verifies every array against the checksums in meta, falls back to
the newest intact step with one warning line, keeps the damaged step as <step>.corrupt (nothing
deleted), and with no intact step refuses in one line, exit 2, changing nothing."""

import asyncio
import gc
import hashlib
import io
import logging
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import smoke
from focaljax import config as config_lib
from focaljax import sharding
from focaljax.train import checkpoint
from focaljax.train import lm
from focaljax.train import loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _files(directory):
  """{relative path: sha256} of every file under `directory`."""
  out = {}
  for dirpath, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(dirpath, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
  return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A smoke run with checkpoints 3 and 6, and abstract trees to restore it into."""
  workdir = str(tmp_path_factory.mktemp("ckpt") / "trained")
  cfg = config_lib.parse(smoke.get_config())
  lm.train(cfg, workdir)
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  task = lm.task(cfg, str(tmp_path_factory.mktemp("scratch")), mesh)
  opt_state, _ = loop.init_opt(task.tx, task.params, task.param_sh, mesh)
  abstract = lambda tree: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
  return workdir, (abstract(task.params), abstract(opt_state), task.data_iter)


@pytest.fixture
def workdir(trained, tmp_path):
  copy = str(tmp_path / "run")
  shutil.copytree(trained[0], copy)
  return copy


def _largest(directory):
  paths = [os.path.join(d, n) for d, _, names in os.walk(directory) for n in names]
  return max(paths, key=os.path.getsize)


def _truncate(step_dir):
  path = _largest(os.path.join(step_dir, "params"))
  os.truncate(path, os.path.getsize(path) // 2)


def _flip(step_dir):
  path = _largest(os.path.join(step_dir, "params"))
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    byte = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([byte[0] ^ 0xFF]))


def _empty(step_dir):
  for name in os.listdir(step_dir):
    path = os.path.join(step_dir, name)
    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _garbage_meta(step_dir):
  with open(os.path.join(step_dir, "meta", "metadata"), "w") as f:
    f.write("{not json")


DAMAGE = {
    "truncated_array_file": _truncate,
    "flipped_bytes": _flip,
    "deleted_opt_state": lambda d: shutil.rmtree(os.path.join(d, "opt_state")),
    "emptied_step_dir": _empty,
    "deleted_data_iterator": lambda d: [os.remove(os.path.join(d, "data", n))
                                        for n in os.listdir(os.path.join(d, "data"))],
    "garbage_meta": _garbage_meta,
}


def _restore(workdir, abstract):
  warnings = []
  ckpt = checkpoint.Checkpointer(workdir, async_save=False)
  try:
    return ckpt.restore_latest(*abstract, warn=warnings.append), warnings
  finally:
    ckpt.close()


def test_checkpoints_record_checksums(trained):
  meta, step = checkpoint.read_meta(trained[0], None)
  assert step == 6 and set(meta["checksums"]) == {"params", "opt_state"}
  assert len(meta["checksums"]["params"]) == len(jax.tree.leaves(trained[1][0]))


def test_checksum_sees_one_changed_element():
  x = np.arange(1000, dtype=np.float32)
  y = x.copy()
  y[537] = np.nextafter(y[537], np.float32(1e9))
  assert checkpoint.checksums({"a": x}) != checkpoint.checksums({"a": y})
  assert checkpoint.checksums({"a": x}) == checkpoint.checksums({"a": x.copy()})


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_latest_falls_back_to_intact(trained, workdir, damage):
  step6 = os.path.join(workdir, "checkpoints", "6")
  DAMAGE[damage](step6)
  damaged = _files(step6)
  step3 = _files(os.path.join(workdir, "checkpoints", "3"))
  (step, params, _, meta), warnings = _restore(workdir, trained[1])
  assert step == 3 and meta["step"] == 3 and params is not None
  assert len(warnings) == 1 and "\n" not in warnings[0], warnings
  assert warnings[0].startswith("checkpoint step 6 is damaged (") and \
      warnings[0].endswith("6.corrupt; resuming from step 3"), warnings[0]
  # Kept, byte for byte, beside the intact step, which is untouched.
  assert not os.path.exists(step6)
  assert _files(step6 + checkpoint.CORRUPT_SUFFIX) == damaged
  assert _files(os.path.join(workdir, "checkpoints", "3")) == step3


def test_no_intact_checkpoint_changes_nothing(trained, workdir):
  for step in ("3", "6"):
    _flip(os.path.join(workdir, "checkpoints", step))
  before = _files(workdir)
  with pytest.raises(checkpoint.CorruptCheckpoint, match=r"^no intact checkpoint under .*: "
                     r"step 6 \(.*\); step 3 \(.*\); nothing was changed"):
    _restore(workdir, trained[1])
  assert _files(workdir) == before


def test_train_py_resumes_past_a_damaged_step(trained, workdir):
  _truncate(os.path.join(workdir, "checkpoints", "6"))
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config",
                         os.path.join(ROOT, "configs", "smoke.py"), "--workdir", workdir,
                         "--config.train.steps=7", "--config.train.eval_every=0"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [line for line in proc.stderr.splitlines() if "damaged" in line]
  assert len(lines) == 1 and lines[0].startswith("warning: checkpoint step 6 is damaged")
  assert "Traceback" not in proc.stderr
  assert checkpoint.latest_step(workdir) == 7
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "6" + checkpoint.CORRUPT_SUFFIX))


def test_train_py_with_no_intact_checkpoint_exits_2(trained, workdir):
  for step in ("3", "6"):
    shutil.rmtree(os.path.join(workdir, "checkpoints", step, "opt_state"))
  before = _files(os.path.join(workdir, "checkpoints"))
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config",
                         os.path.join(ROOT, "configs", "smoke.py"), "--workdir", workdir,
                         "--config.train.steps=7"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and errors[0].startswith("error: no intact checkpoint under ")
  assert "Traceback" not in proc.stderr
  assert _files(os.path.join(workdir, "checkpoints")) == before


def test_damaged_twice_at_one_step_keeps_both(trained, workdir):
  root = os.path.join(workdir, "checkpoints")
  shutil.copytree(os.path.join(root, "6"), os.path.join(root, "6" + checkpoint.CORRUPT_SUFFIX))
  first = _files(os.path.join(root, "6" + checkpoint.CORRUPT_SUFFIX))
  _flip(os.path.join(root, "6"))
  damaged = _files(os.path.join(root, "6"))
  (step, *_), warnings = _restore(workdir, trained[1])
  assert step == 3 and len(warnings) == 1
  assert _files(os.path.join(root, "6" + checkpoint.CORRUPT_SUFFIX)) == first
  assert _files(os.path.join(root, "6" + checkpoint.CORRUPT_SUFFIX + ".2")) == damaged


def test_eval_py_refuses_flipped_params_in_one_line(workdir):
  """Evaluation restores params alone; it checks them against the training checksums too."""
  _flip(os.path.join(workdir, "checkpoints", "6"))
  before = _files(workdir)
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "--workdir", workdir,
                         "--suites", "val"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "does not match its checksum" in proc.stderr and "Traceback" not in proc.stderr
  assert _files(workdir) == before


@pytest.mark.parametrize("damage", [_truncate, _empty], ids=["truncated", "emptied"])
def test_eval_py_on_params_that_do_not_restore_is_one_line(workdir, damage):
  damage(os.path.join(workdir, "checkpoints", "6"))
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "--workdir", workdir,
                         "--suites", "val"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and "checkpoints/6" in errors[0], proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_hf_export_refuses_flipped_params_in_one_line(workdir, tmp_path):
  _flip(os.path.join(workdir, "checkpoints", "6"))
  before = _files(workdir)
  out = str(tmp_path / "hf")
  proc = subprocess.run([sys.executable, "-m", "focaljax.convert", "focaljax-to-hf", workdir, out],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "does not match its checksum" in proc.stderr and "Traceback" not in proc.stderr
  assert _files(workdir) == before and not os.path.exists(out)


def test_failed_reads_never_retrieved_are_not_logged():
  # A damaged step's other reads can end as tasks whose exception nobody retrieves; when such
  # a task is collected asyncio logs it with its traceback. Those are dropped, nothing else.
  checkpoint._quiet_failed_reads()  # pylint: disable=protected-access
  out = io.StringIO()
  handler = logging.StreamHandler(out)
  logging.getLogger("asyncio").addHandler(handler)

  async def _read_array_index_and_device_put():
    raise ValueError("damaged")

  async def other_read():
    raise ValueError("other")

  def leave_unretrieved(coro):
    loop = asyncio.new_event_loop()
    task = loop.create_task(coro)
    loop.run_until_complete(asyncio.sleep(0.01))
    loop.close()
    del task
    gc.collect()

  try:
    leave_unretrieved(_read_array_index_and_device_put())
    assert out.getvalue() == ""
    leave_unretrieved(other_read())
    assert "Task exception was never retrieved" in out.getvalue() and "other_read" in out.getvalue()
  finally:
    logging.getLogger("asyncio").removeHandler(handler)


def test_failed_restores_outside_training_are_quiet_too(tmp_path, monkeypatch):
  # Evaluation, export and FocusLLM's adapter load restore through restore_params: a read that
  # fails there (an adapter onto another base's shapes) leaves the same closed-loop wake-ups.
  monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
  checkpoint.save_params(str(tmp_path), 1, {"w": np.ones((4,), np.float32)}, {})
  with pytest.raises(ValueError, match="not compatible with the stored shape"):
    checkpoint.restore_params(str(tmp_path), None,
                              checkpoint.abstract_like({"w": np.ones((8,), np.float32)}))
  assert getattr(sys.unraisablehook, "_drops_failed_reads", False)
