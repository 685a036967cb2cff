"""A run whose workdir is a URL (gs://bucket/run) trains, checkpoints, resumes and loads.

Offline there is no GCS, so the test gives `gs://` two stand-ins that share one local directory:
  - etils.epath's fsspec backend gets an fsspec filesystem for `gs://` rooted there, so every
    file focaljax writes (config.json, tokenizer.json, metrics.jsonl, tb/, the token cache) and
    every file Orbax writes through epath (step directories, metadata, commit markers) lands in
    it under <bucket>/<path>;
  - Orbax's TensorStore kvstore for a gs:// path (the `gcs` driver: HTTP to
    storage.googleapis.com, which nothing in-process can serve) becomes a `file` kvstore on the
    same directory, so the arrays land beside what epath wrote.
Orbax still takes its GCS code paths (commit-file atomicity instead of renames, gcs rmtree).
Any code that handled the URL with os.path or open() would write under the working directory
instead: the test runs in an empty one and checks it stays empty.
"""

import dataclasses
import json
import lzma
import os

import numpy as np
import pytest
from etils import epath
from etils.epath import backend as epath_backend
from fsspec.implementations import dirfs
from fsspec.implementations import local
from orbax.checkpoint._src.path import gcs_utils

import focaljax
from configs import smoke
from focaljax import config as config_lib
from focaljax.data import pipeline
from focaljax.data import tokenizer as tokenizer_lib
from focaljax.train import checkpoint
from focaljax.train import lm
from focaljax.train import saved_config
from focaljax.train import metrics
from focaljax.train import workdir as workdir_lib

URL = "gs://bucket/runs/smoke"


class _FakeGCS(dirfs.DirFileSystem):
  """gs://<bucket>/<path> -> <root>/<bucket>/<path> on the local disk."""
  protocol = ("gs", "gcs")
  cachable = False
  root = ""

  def __init__(self, *args, **kwargs):
    del args, kwargs   # etils passes GCS options (finalize_on_close)
    super().__init__(path=self.root, fs=local.LocalFileSystem())


@pytest.fixture
def bucket(tmp_path, monkeypatch):
  """The local directory behind gs://; the test runs in an empty working directory."""
  import fsspec  # pylint: disable=import-outside-toplevel
  root = tmp_path / "gcs"
  root.mkdir()
  monkeypatch.setattr(_FakeGCS, "root", str(root))
  fsspec.register_implementation("gs", _FakeGCS, clobber=True)
  fsspec.register_implementation("gcs", _FakeGCS, clobber=True)
  epath_backend.fsspec_backend._get_filesystem.cache_clear()   # etils caches one per protocol

  def kvstore(path):
    name, key = gcs_utils.parse_gcs_path(path, add_trailing_slash=False)
    return {"driver": "file", "path": str(root / name / key)}

  monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs", kvstore)
  # Orbax asks a real bucket whether it has a hierarchical namespace (google-cloud-storage).
  monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  yield root
  assert not os.listdir(cwd), f"a gs:// path was written locally: {os.listdir(cwd)}"
  epath_backend.fsspec_backend._get_filesystem.cache_clear()


def _cfg(steps):
  c = smoke.get_config()
  c.train.update(steps=steps, log_every=1, eval_every=2, ckpt_every=2, async_ckpt=True)
  return config_lib.parse(c)


def test_epath_reaches_the_stand_in(bucket):
  epath.Path(URL, "x.txt").parent.mkdir(parents=True, exist_ok=True)
  epath.Path(URL, "x.txt").write_text("hi")
  assert (bucket / "bucket" / "runs" / "smoke" / "x.txt").read_text() == "hi"


def test_run_on_a_url_trains_resumes_and_loads(bucket):
  local_dir = bucket / "bucket" / "runs" / "smoke"
  first = lm.train(_cfg(4), URL, stop_at=2)
  assert first["step"] == 2 and checkpoint.latest_step(URL) == 2
  for name in ("config.json", "tokenizer.json", "metrics.jsonl"):
    assert (local_dir / name).is_file(), name
  assert os.listdir(local_dir / "tb")
  second = lm.train(_cfg(4), URL)
  assert second["start_step"] == 2 and second["step"] == 4
  assert checkpoint.latest_step(URL) == 4
  rows = [json.loads(line) for line in (local_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
  assert checkpoint.resolve(URL) == (URL, None)
  assert checkpoint.resolve(URL + "/checkpoints/2") == (URL, 2)
  model = focaljax.load(URL)
  logits = model.logits(np.asarray([model.tokenizer.encode("hello world")], np.int32))
  assert np.isfinite(np.asarray(logits)).all()
  assert repr(model).startswith(f"LoadedModel(workdir={URL!r}, step=4, params=") and (
      "\n" not in repr(model))   # one line, not the module tree


def test_workdir_checks_read_the_url(bucket):
  lm.train(_cfg(2), URL)
  other = smoke.get_config()
  other.model.d_model *= 2
  with pytest.raises(config_lib.ConfigError, match="holds a different model"):
    workdir_lib.check(URL, config_lib.parse(other).config_json)
  workdir_lib.cut_metrics(URL, 1)
  rows = epath.Path(URL, metrics.METRICS_FILE).read_text().splitlines()
  assert [json.loads(r)["step"] for r in rows] == [1]
  assert saved_config.read(URL).train.steps == 2


def test_tokenizer_and_token_cache_on_a_url(bucket):
  tok = tokenizer_lib.bundled()
  tok.save(URL)
  assert tokenizer_lib.Tokenizer.load(URL).encode("abc") == tok.encode("abc")
  cfg = _cfg(2).data
  cache = "gs://bucket/cache"
  cfg = dataclasses.replace(cfg, tokenize="ahead", token_cache=cache)
  docs = pipeline.documents(cfg, "valid")
  first = pipeline._tokenize_ahead(docs, tok, cfg)   # pylint: disable=protected-access
  assert [p.name for p in epath.Path(cache).iterdir()][0].startswith("tokens-")
  again = pipeline._tokenize_ahead(docs, tok, cfg)   # pylint: disable=protected-access
  assert all((first[i]["tokens"] == again[i]["tokens"]).all() for i in range(len(first)))


def test_text_source_on_a_url(bucket):
  data = bucket / "bucket" / "data"
  data.mkdir(parents=True)
  (data / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
  (data / "b.jsonl.xz").write_bytes(lzma.compress(b'{"text": "three"}\n'))
  docs = pipeline.sources.documents("train", "text:gs://bucket/data/*.jsonl*", valid_fraction=0)
  assert [docs[i] for i in range(len(docs))] == ["one", "two", "three"]
