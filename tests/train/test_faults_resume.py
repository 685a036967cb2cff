"""A workdir resumes only as the run it holds: other fields are refused in one line naming them
(old -> new), equal models spelt otherwise resume, and a second trainer is refused by the lock."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from configs import smoke
from focaljax import config as config_lib
from focaljax.data import tokenizer as tokenizer_lib
from focaljax.train import checkpoint
from focaljax.train import lm
from focaljax.train import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**train):
  c = smoke.get_config()
  c.train.update(**train)
  return c


# Run identity and the lock (a trained workdir copied per case).

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("input") / "trained")
  lm.train(config_lib.parse(_config(steps=3, eval_every=0)), workdir)
  return workdir


@pytest.fixture
def workdir(trained, tmp_path):
  copy = str(tmp_path / "run")
  shutil.copytree(trained, copy)
  return copy


def _listing(workdir):
  return {os.path.join(d, n): os.path.getmtime(os.path.join(d, n))
          for d, _, names in os.walk(workdir) for n in names}


@pytest.mark.parametrize("field,value,want", [
    ("data.source", "text:README.md", "data.source 'bundled' -> 'text:README.md'"),
    ("data.global_batch", 4, "data.global_batch 8 -> 4"),
    ("data.tokenizer", "train:300", "data.tokenizer 'bundled' -> 'train:300'"),
    ("model.qkv_bias", True, "model.qkv_bias False -> True"),   # a parameter tree field
    ("data.jsonl_field", "body", "data.jsonl_field 'text' -> 'body'"),
    ("model.num_layers", 5, "model.num_layers 2 -> 5; resume"),   # and not the cycled pattern
])
def test_other_run_is_refused_listing_fields(workdir, field, value, want):
  c = _config(steps=9)
  section, name = field.split(".")
  c[section][name] = value
  before = _listing(workdir)
  with pytest.raises(config_lib.ConfigError,
                     match=r"holds a different (run|model) \(checkpoint step 3\)") as e:
    lm.train(config_lib.parse(c), workdir)
  assert want in str(e.value) and "\n" not in str(e.value)
  assert _listing(workdir) == before


def test_a_resume_reading_other_data_shards_is_refused_naming_them(workdir):
  """data.shards 0 is the process count: saved on one process, it resumes as data.shards=1,
  while 2 shards would read another data order (the position is saved per shard)."""
  c = _config(steps=9)
  c.data.shards = 2
  before = _listing(workdir)
  with pytest.raises(checkpoint.CorruptCheckpoint, match=r"step 3 .* does not resume here: its "
                     r"data position was saved as shard_0-of-1.json.*set data.shards") as e:
    lm.train(config_lib.parse(c), workdir)
  assert "\n" not in str(e.value)
  after = _listing(workdir)   # tokenizer.json is written again, the same
  assert after.keys() == before.keys()
  assert all(after[f] == t for f, t in before.items() if "checkpoints" in f or "config" in f)
  c = _config(steps=4, eval_every=0)
  c.data.shards = 1
  assert lm.train(config_lib.parse(c), workdir)["step"] == 4


def test_a_resume_spelling_the_same_model_otherwise_trains(workdir):
  c = _config(steps=4, eval_every=0)
  c.model.attention.pattern = c.model.attention.pattern.split(":")[0]   # its natural position
  c.model.head_dim = c.model.d_model // c.model.num_heads   # 0 resolves to this
  assert lm.train(config_lib.parse(c), workdir)["step"] == 4


def test_checkpoints_of_another_model_are_not_called_damaged(workdir):
  # No config.json to compare (deleted): the restore finds the other shapes, and the run's
  # config.json is not written over by the refused one.
  os.remove(os.path.join(workdir, "config.json"))
  c = _config(steps=6)
  c.model.d_model *= 2
  with pytest.raises(checkpoint.CorruptCheckpoint, match="hold another model than this config's"):
    lm.train(config_lib.parse(c), workdir)
  assert not os.path.exists(os.path.join(workdir, "config.json"))


def test_a_resume_at_another_seq_len_trains_and_says_so(workdir, capsys):
  """Context extension: a new data.seq_len is allowed on resume, with one line saying so."""
  c = _config(steps=4)
  c.data.seq_len //= 2
  lm.train(config_lib.parse(c), workdir)
  err = capsys.readouterr().err
  assert f"with data.seq_len {2 * c.data.seq_len} -> {c.data.seq_len}:" in err


def test_a_resume_that_moves_the_learned_tau_range_is_refused(tmp_path):
  """A run trained with explicit τ bounds (as every run before the scaled default) resumed under
  the default: w_τ would mean another τ."""
  c = _config(steps=2, eval_every=0)
  c.model.attention.update(pattern="focal", learned=True, tau_min=5.0, tau_max=10.0,
                           tau_init=7.5)
  lm.train(config_lib.parse(c), str(tmp_path))
  c.model.attention.update(tau_min=0.0, tau_max=0.0, tau_init=0.0)
  c.train.steps = 3
  with pytest.raises(config_lib.ConfigError, match=r"holds a different model \(checkpoint step "
                     r"2\): model.attention.tau_min 5 -> "):
    lm.train(config_lib.parse(c), str(tmp_path))
  c.model.attention.update(tau_min=5.0, tau_max=10.0, tau_init=7.5)   # as trained: resumes
  assert lm.train(config_lib.parse(c), str(tmp_path))["step"] == 3


def test_refused_resume_leaves_the_runs_config(workdir):
  # Refused after the identity check (the micro-batch is resolved with the compiled step).
  before = open(os.path.join(workdir, "config.json")).read()
  with pytest.raises(config_lib.ConfigError, match="train.micro_batch: 3 must divide"):
    lm.train(config_lib.parse(_config(steps=9, micro_batch=3)), workdir)
  assert open(os.path.join(workdir, "config.json")).read() == before


_HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from focaljax.train import workdir
workdir.lock({wd!r})
print("locked", flush=True)
time.sleep(120)
"""


def _holder(workdir):
  proc = subprocess.Popen([sys.executable, "-c", _HOLD.format(root=ROOT, wd=workdir)],
                          stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "locked"
  return proc


def test_second_trainer_is_refused_naming_the_holder(workdir):
  holder = _holder(workdir)
  try:
    before = _listing(workdir)
    with pytest.raises(config_lib.ConfigError, match=rf"is in use by pid {holder.pid} on \S+ "):
      lm.train(config_lib.parse(_config(steps=3, eval_every=0)), workdir)
    assert {k: v for k, v in _listing(workdir).items() if not k.endswith(".lock")} == \
        {k: v for k, v in before.items() if not k.endswith(".lock")}
  finally:
    holder.kill()
    holder.wait()


def test_lock_of_a_killed_trainer_is_not_stale(workdir):
  holder = _holder(workdir)
  holder.send_signal(signal.SIGKILL)
  holder.wait()
  assert os.path.exists(os.path.join(workdir, workdir_lib.LOCK_FILE))   # left behind, but free
  workdir_lib.lock(workdir)
  workdir_lib.unlock(workdir)


def test_non_local_workdir_is_not_locked(capsys):
  workdir_lib.lock("gs://bucket/run")
  assert "not on a local file system; not locked" in capsys.readouterr().err


def test_a_resume_whose_tokenizer_file_changed_is_refused(tmp_path):
  # The same data.tokenizer path, other contents: the workdir keeps the one it trained with.
  tokenizer_lib.bundled().save(tmp_path / "tok")
  c = _config(steps=2, eval_every=0)
  c.data.tokenizer = str(tmp_path / "tok" / "tokenizer.json")
  lm.train(config_lib.parse(c), str(tmp_path / "run"))
  texts = [f"some words {i} and more words" for i in range(50)]
  tokenizer_lib.train_bpe(iter(texts), 300).save(tmp_path / "tok")
  c.train.steps = 3
  with pytest.raises(config_lib.ConfigError, match=r"^config field data.tokenizer: .* is not the "
                     r"tokenizer .* checkpoints trained with"):
    lm.train(config_lib.parse(c), str(tmp_path / "run"))
