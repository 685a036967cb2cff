"""Bad input a user can cause: one line naming the field, file or path, exit 2, nothing written;
a second trainer on a workdir is refused; long documents tokenize in bounded pieces."""

import json
import lzma
import os
import re
import shutil
import signal
import struct
import subprocess
import sys

import pytest

from configs import smoke
from focaljax import config as config_lib
from focaljax.data import pipeline
from focaljax.data import sources
from focaljax.data import tokenizer as tokenizer_lib
from focaljax.train import checkpoint
from focaljax.train import lm
from focaljax.train import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**train):
  c = smoke.get_config()
  c.train.update(**train)
  return c


def _one_line(proc, pattern, code=2):
  assert proc.returncode == code, proc.stderr[-3000:]
  lines = [line for line in proc.stderr.splitlines() if "error: " in line]
  assert len(lines) == 1 and re.search(pattern, lines[0]), proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]


def _run(*argv):
  return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)


# Flags and config: a subprocess each for the command-line paths, in-process otherwise.

@pytest.mark.parametrize("args,match", [
    (["--config.train.stepz=3"], r"^error: no config field train.stepz \(did you mean steps\?\)$"),
    (["--config", "/nonexistent/config.py"], r"^error: .*/nonexistent/config.py"),
])
def test_bad_flags_are_one_line(tmp_path, args, match):
  argv = [os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "smoke.py"),
          "--workdir", str(tmp_path / "run"), *args]
  _one_line(_run(*argv), match)
  assert not os.path.exists(tmp_path / "run")


def test_config_file_argument_error_is_one_line_without_its_class_name(tmp_path):
  proc = _run(os.path.join(ROOT, "train.py"), "--config",
              os.path.join(ROOT, "configs", "focal.py") + ":size=13b",
              "--workdir", str(tmp_path / "run"))
  _one_line(proc, r"^error: config arg size='13b': allowed sizes are \('tiny', ")


@pytest.mark.parametrize("text,match", [
    ("def get_config(:\n", r"SyntaxError: invalid syntax \(bad.py, line 1\)$"),
    ("def get_config():\n  raise RuntimeError('boom')\n", r"RuntimeError: boom$"),
    ("SIZES = {}\n", r"the file defines no get_config\(\)$"),
])
def test_a_config_file_that_fails_to_load_is_one_line(tmp_path, text, match):
  (tmp_path / "bad.py").write_text(text)
  proc = _run(os.path.join(ROOT, "train.py"), "--config", str(tmp_path / "bad.py"),
              "--workdir", str(tmp_path / "run"))
  _one_line(proc, rf"^error: --config {tmp_path / 'bad.py'}: {match}")


def test_unknown_field_without_config_is_one_line(tmp_path):
  # Without --config, ml_collections applies overrides to the default file as train.py imports.
  proc = _run(os.path.join(ROOT, "train.py"), "--workdir", str(tmp_path / "run"),
              "--config.train.stepz=3")
  _one_line(proc, r"^error: no config field train.stepz \(did you mean steps\?\)$")
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("field,value,match", [
    ("train.steps", -5, r"^config field train.steps: must be > 0, got -5$"),
    ("train.steps", 0, r"^config field train.steps: must be > 0, got 0$"),
])
def test_bad_fields_are_blamed_on_themselves(field, value, match):
  c = _config()
  section, name = field.split(".")
  c[section][name] = value
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.parse(c)


def test_batch_not_splitting_over_the_devices_is_one_line(tmp_path):
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config",
                         os.path.join(ROOT, "configs", "smoke.py"), "--workdir",
                         str(tmp_path / "run"), "--config.data.global_batch=3"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
  _one_line(proc, r"^error: config field data.global_batch: 3 must be divisible by the 2 "
            r"devices that split it \(mesh.data x mesh.fsdp\)$")
  assert not os.path.exists(tmp_path / "run")


def test_mesh_not_matching_devices_is_one_line(tmp_path):
  c = _config()
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 3, 1, 1
  with pytest.raises(config_lib.ConfigError, match=r"^config field mesh: data\*fsdp\*tensor = 3 "
                     r"but there are \d+ devices"):
    lm.train(config_lib.parse(c), str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("implementation,dtype,match", [
    ("cudnn", "float32", r"'cudnn' takes 16-bit q, k, v"),   # the config alone decides
    ("cudnn", "bfloat16", r"'cudnn' needs an NVIDIA GPU"),   # the machine decides (no GPU here)
])
def test_an_implementation_this_machine_cannot_run_is_refused_before_the_workdir(
    tmp_path, implementation, dtype, match):
  c = _config(compute_dtype=dtype)
  c.model.attention.implementation = implementation
  with pytest.raises(config_lib.ConfigError, match="^config field model.attention."
                     f"implementation: {match}"):
    lm.train(config_lib.parse(c), str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_workdir_that_is_a_file_is_refused(tmp_path, where):
  (tmp_path / "f").write_text("keep me")
  workdir = tmp_path / "f" if where == "file" else tmp_path / "f" / "run"
  with pytest.raises(config_lib.ConfigError, match=r"is a file, not a directory$"):
    lm.train(config_lib.parse(_config()), str(workdir))
  assert (tmp_path / "f").read_text() == "keep me"


def test_read_only_workdir_is_one_line(tmp_path, monkeypatch):
  # Root ignores file modes, so the file system's refusal is simulated where the lock opens.
  real_open = os.open

  def refuse(path, *args, **kwargs):
    if str(path).endswith(workdir_lib.LOCK_FILE):
      raise PermissionError(13, "Permission denied", path)
    return real_open(path, *args, **kwargs)

  monkeypatch.setattr(workdir_lib.os, "open", refuse)
  with pytest.raises(config_lib.ConfigError, match=r"^--workdir .*run: cannot write there "
                     r"\(Permission denied\)$"):
    lm.train(config_lib.parse(_config()), str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run" / "config.json")


# Conversion input.

def _hf_dir(path, config_text, safetensors=None):
  os.makedirs(path)
  (path / "config.json").write_text(config_text)
  if safetensors is not None:
    (path / "model.safetensors").write_bytes(safetensors)
  return str(path)


_HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
       "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
       "max_position_embeddings": 64, "hidden_act": "silu"}
_HEADER = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": [64, 32],
                                                    "data_offsets": [0, 64 * 32 * 4]}}).encode()


@pytest.mark.parametrize("config_text,safetensors,match", [
    ('{"architectures": [', None, r"config.json is not valid JSON"),
    (json.dumps(_HF), struct.pack("<Q", len(_HEADER)) + _HEADER + b"\0" * 100,
     r"model.safetensors is truncated"),
])
def test_bad_hf_checkpoint_is_one_line(tmp_path, config_text, safetensors, match):
  hf_dir = _hf_dir(tmp_path / "hf", config_text, safetensors)
  proc = _run("-m", "focaljax.convert", "hf-to-focaljax", hf_dir, str(tmp_path / "out"))
  _one_line(proc, match)
  assert not os.listdir(tmp_path / "out") if os.path.exists(tmp_path / "out") else True


# Data: named by file and line, before anything is written.

@pytest.mark.parametrize("name,content,match", [
    ("null.jsonl", b'{"text": "fine"}\n{"text": null}\n', r"null.jsonl:2: field 'text' is null, "
     "not a string$"),
    ("number.jsonl", b'{"text": 7}\n', r"number.jsonl:1: field 'text' is 7, not a string$"),
    ("binary.txt", b"text\n\x00\x01\x02\xff\xfe", r"binary.txt:2: binary data \(a NUL byte\)"),
    ("latin1.jsonl", b'{"text": "a"}\n{"text": "na\xefve"}\n', r"latin1.jsonl:2: not UTF-8"),
    ("list.jsonl", b'["text"]\n', r"list.jsonl:1: no field 'text'"),
    ("blank.txt", b"  \n\n ", r"no text in .*blank.txt$"),
    ("one.txt", b"one document. " * 200, r"valid split .* is empty .* set data.valid_source"),
    ("bad.jsonl", b'{"text": "a b"}\n{"text": oops}\n', r"bad.jsonl:2: malformed JSON"),
    ("latin1.txt", b"line one\nna\xefve\n", r"latin1.txt:2: not UTF-8"),
    ("cut.jsonl.xz", lzma.compress(b'{"text": "a b"}\n' * 50)[:40],
     r"cut.jsonl.xz: a damaged or truncated xz file \(EOFError"),
    ("bad.txt.gz", b"\x1f\x8b not gzip", r"bad.txt.gz: a damaged or truncated gz file"),
])
def test_bad_data_names_file_and_line(tmp_path, name, content, match):
  (tmp_path / name).write_bytes(content)
  sources._file_documents.cache_clear()
  c = _config()
  c.data.source = f"text:{tmp_path}/{name}"
  with pytest.raises(sources.DataError, match=match) as e:
    lm.train(config_lib.parse(c), str(tmp_path / "run"))
  assert "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "run" / "checkpoints")
  assert not os.path.exists(tmp_path / "run" / "tokenizer.json")
  assert not os.path.exists(tmp_path / "run" / "config.json")


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
    ("data.shards", 2, "data.shards 0 -> 2"),   # the saved iterators' split
    ("data.jsonl_field", "body", "data.jsonl_field 'text' -> 'body'"),
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


# Long documents.

def test_pieces_cut_at_word_starts_and_encode_alike():
  tok = tokenizer_lib.bundled()
  text = " ".join(f"w{i % 97}x" for i in range(60_000)) + "  tail\n\n"
  parts = tokenizer_lib.pieces(text, 4096)
  assert "".join(parts) == text and len(parts) > 50
  assert all(len(p) <= 4096 and p[-1] != " " for p in parts[:-1])
  assert tok.encode_array(text).tolist() == tok._hf.encode(text, add_special_tokens=False).ids


def test_text_without_spaces_is_cut_anyway():
  parts = tokenizer_lib.pieces("x" * 10_000, 4096)
  assert [len(p) for p in parts] == [4096, 4096, 1808]


def test_long_single_line_reaches_the_first_batch(tmp_path):
  words = " ".join(f"word{i % 500}" for i in range(250_000))   # ~2.2 MB, one line
  (tmp_path / "long.jsonl").write_text(json.dumps({"text": words}) + "\n" +
                                       "".join(json.dumps({"text": f"doc {i}."}) + "\n"
                                               for i in range(30)))
  sources._file_documents.cache_clear()
  cfg = pipeline.DataConfig(source=f"text:{tmp_path}/long.jsonl", tokenizer="bundled",
                            seq_len=64, global_batch=4, shuffle=False)
  batch = next(pipeline.make_iterator(cfg, tokenizer_lib.bundled()))
  assert batch["inputs"].shape == (4, 64) and batch["weights"].sum() > 0


def test_help_exits_0_listing_the_flags():
  proc = _run(os.path.join(ROOT, "train.py"), "--help")
  assert proc.returncode == 0 and "--workdir" in proc.stdout and "--dry_run" in proc.stdout


@pytest.mark.parametrize("override", ["--config.mesh={'data': 1, 'fsdp': 1}",
                                      "--config.optim={'peak_lr': 1.0}"])
def test_a_section_set_whole_is_one_line(tmp_path, override):
  # It would replace the section, skipping its other fields and their types.
  proc = _run(os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "smoke.py"),
              "--workdir", str(tmp_path / "run"), override)
  _one_line(proc, r"^error: --config\.(mesh|optim): a section; set its fields one by one")
  assert not os.path.exists(tmp_path / "run")


def test_an_empty_tokenizer_is_refused_not_read_from_the_current_directory():
  c = _config()
  c.data.tokenizer = ""
  with pytest.raises(config_lib.ConfigError, match=r"^config field data.tokenizer='': expected"):
    config_lib.parse(c)


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


def test_a_split_with_fewer_documents_than_data_shards_is_refused_up_front(tmp_path):
  # Found at the first evaluation before: after compiling and training, with files written.
  c = _config(steps=6)
  c.data.shards = 4   # the bundled text's valid split has 2 documents
  with pytest.raises(sources.DataError, match=r"valid split .* has 2 documents, fewer than the 4 "
                     r"data shards \(data.shards\)$"):
    lm.train(config_lib.parse(c), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
