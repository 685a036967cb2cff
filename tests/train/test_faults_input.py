"""Bad input a user can cause: one line naming the field, file or path, exit 2, nothing written;
long documents tokenize in bounded pieces. Resume identity and the lock: test_faults_resume.py."""

import json
import lzma
import os
import re
import struct
import subprocess
import sys

import pytest

from configs import smoke
from focaljax import config as config_lib
from focaljax.data import pipeline
from focaljax.data import sources
from focaljax.data import tokenizer as tokenizer_lib
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


def test_a_micro_batch_not_dividing_the_rows_leaves_no_workdir(tmp_path):
  # Refused after the task wrote its tokenizer: the workdir this run made goes with it.
  c = _config()
  c.train.micro_batch = 3
  with pytest.raises(config_lib.ConfigError, match=r"train.micro_batch"):
    lm.train(config_lib.parse(c), str(tmp_path / "run"))
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


def test_an_empty_tokenizer_is_refused_not_read_from_the_current_directory():
  c = _config()
  c.data.tokenizer = ""
  with pytest.raises(config_lib.ConfigError, match=r"^config field data.tokenizer='': expected"):
    config_lib.parse(c)


def test_a_split_with_fewer_documents_than_data_shards_is_refused_up_front(tmp_path):
  # Found at the first evaluation before: after compiling and training, with files written.
  c = _config(steps=6)
  c.data.shards = 4   # the bundled text's valid split has 2 documents
  with pytest.raises(sources.DataError, match=r"valid split .* has 2 documents, fewer than the 4 "
                     r"data shards \(data.shards\)$"):
    lm.train(config_lib.parse(c), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
