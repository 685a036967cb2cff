"""Data sources, the bundled corpus, tokenizer loading, retrieval drills and config validation.

Packing, shuffling and resume are in test_data.py; the tokenizer itself in test_tokenizer.py.
"""

import dataclasses
import json
import lzma

import numpy as np
import pytest

from focaljax.data import pipeline as data
from focaljax.data import retrieval
from focaljax.data import sources


def test_text_sources_and_valid_split(tmp_path):
  (tmp_path / "a.txt").write_text("first file\n\nis one document")
  with lzma.open(tmp_path / "b.txt.xz", "wt") as f:
    f.write("second")
  with lzma.open(tmp_path / "c.jsonl.xz", "wt") as f:
    for i in range(18):
      f.write(json.dumps({"body": f"doc {i}", "text": "unused"}) + "\n")
  cfg = data.DataConfig(source=f"text:{tmp_path}/*.txt*,{tmp_path}/*.jsonl.xz", tokenizer="bundled",
                        seq_len=8, global_batch=1, jsonl_field="body")
  train, valid = (list(data.documents(cfg, s)) for s in sources.SPLITS)
  everything = ["first file\n\nis one document", "second"] + [f"doc {i}" for i in range(18)]
  assert len(valid) == 1 and sorted(train + valid) == sorted(everything)
  assert valid == [everything[19]]  # evenly spaced hold-out: every 20th document
  other = dataclasses.replace(cfg, valid_source=f"text:{tmp_path}/a.txt")
  assert list(data.documents(other, "valid")) == [everything[0]]
  assert list(data.documents(other, "train")) == everything
  with pytest.raises(ValueError, match="jsonl_field"):
    list(data.documents(dataclasses.replace(cfg, jsonl_field="nope"), "train"))


def test_bundled_default_run():
  cfg = data.DataConfig(source="bundled", tokenizer="bundled", seq_len=128, global_batch=4)
  train, valid = data.documents(cfg, "train"), data.documents(cfg, "valid")
  assert len(train) > 30 and 1 <= len(valid) <= 3
  assert not set(train) & set(valid)
  assert 1_000_000 < sum(map(len, train)) + sum(map(len, valid)) < 2_000_000
  tok = data.load_tokenizer(cfg, None)
  b = next(data.make_iterator(cfg, tok))
  assert b["inputs"].shape == (4, 128) and b["weights"].mean() > 0.9
  np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
  assert len(tok.decode(b["inputs"][0].tolist())) > 128  # real text, several bytes per token


def test_passkey_drill_shape():
  tok = data.load_tokenizer(data.DataConfig(source="bundled", tokenizer="bundled", seq_len=8,
                                            global_batch=1), None)
  text = np.asarray(tok.encode("It was the best of times, it was the worst of times. " * 40))
  for seed in range(20):
    ids = retrieval.passkey_drill(tok, text, np.random.default_rng(seed), 128)
    assert len(ids) <= 128 and ids[-1] == tok.eos_id
    s = tok.decode(ids[:-1].tolist())
    key = s.rsplit("The pass key is", 1)[1].strip().rstrip(".")
    assert len(key) == 5 and f"The pass key is {key}. Remember it. {key} is the pass key." in s
  with pytest.raises(ValueError, match="max_len"):
    retrieval.passkey_drill(tok, text, np.random.default_rng(0), 16)
  # The bound holds for every key, and a row just that long always takes a drill (its head
  # dropped where it does not fit).
  need = retrieval.drill_min_tokens(tok)
  pieces = [retrieval.drill_pieces(tok, np.random.default_rng(s)) for s in range(300)]
  assert need >= max(len(needle) + len(tail) + 1 for needle, tail in pieces)
  for seed in range(50):
    assert len(retrieval.passkey_drill(tok, text, np.random.default_rng(seed), need)) <= need


def test_retrieval_mix_needs_rows_that_hold_a_drill():
  cfg = data.DataConfig(source="bundled", tokenizer="bundled", seq_len=16, global_batch=4,
                        retrieval_mix=0.5)
  with pytest.raises(sources.DataError, match=r"a passkey drill takes up to \d+ tokens with "
                     r"this tokenizer; data.seq_len=16 rows hold 17"):
    data.make_iterator(cfg, data.load_tokenizer(cfg, None))


def test_retrieval_mix_turns_train_rows_into_drills():
  kw = dict(source="bundled", tokenizer="bundled", seq_len=256, global_batch=8)
  tok = data.load_tokenizer(data.DataConfig(**kw), None)
  needle = tok.encode(" Remember it.")
  def count(mix, split):
    it = data.make_iterator(data.DataConfig(**kw, retrieval_mix=mix), tok, split=split)
    rows = np.concatenate([next(it)["inputs"] for _ in range(3)])
    return sum(tok.decode(r.tolist()).count("Remember it.") for r in rows)
  assert needle and count(0.0, "train") == 0 and count(0.9, "valid") == 0
  it = data.make_iterator(data.DataConfig(**kw, retrieval_mix=0.5), tok)
  b = next(it)
  drills = [i for i, r in enumerate(b["inputs"]) if "Remember it." in tok.decode(r.tolist())]
  assert 1 <= len(drills) < 8
  for i in drills:  # one segment from position 0, then padding that carries no loss
    n = int((b["segment_ids"][i] == 1).sum())
    assert n > 128 and set(b["segment_ids"][i, n:]) <= {0} and b["weights"][i, n:].sum() == 0
    np.testing.assert_array_equal(b["positions"][i, :n], np.arange(n))


def test_retrieval_mix_resumes_exactly():
  cfg = data.DataConfig(source="bundled", tokenizer="bundled", seq_len=128, global_batch=4,
                        retrieval_mix=0.5)
  tok = data.load_tokenizer(cfg, None)
  it = data.make_iterator(cfg, tok)
  next(it)
  state = json.loads(json.dumps(it.get_state()))
  want = [next(it) for _ in range(3)]
  it = data.make_iterator(cfg, tok)
  it.set_state(state)
  for w in want:
    got = next(it)
    for key in w:
      np.testing.assert_array_equal(got[key], w[key], err_msg=key)


def test_overlapping_globs_read_each_file_once_and_a_directory_is_refused(tmp_path):
  (tmp_path / "a.txt").write_text("alpha")
  (tmp_path / "b.txt").write_text("beta")
  (tmp_path / "dir.txt").mkdir()
  cfg = data.DataConfig(source=f"text:{tmp_path}/a.txt,{tmp_path}/[ab].txt", tokenizer="bundled",
                        seq_len=8, global_batch=1, valid_source=f"text:{tmp_path}/b.txt")
  assert sorted(data.documents(cfg, "train")) == ["alpha", "beta"]
  with pytest.raises(sources.DataError, match=r"matches the directory .*dir.txt; name its files"):
    data.documents(dataclasses.replace(cfg, source=f"text:{tmp_path}/dir.txt"), "train")


def test_a_trained_tokenizer_smaller_than_asked_says_so(tmp_path, capsys):
  path = tmp_path / "d.jsonl"
  path.write_text("".join(json.dumps({"text": f"hello world {i}"}) + "\n" for i in range(20)))
  cfg = data.DataConfig(source=f"text:{path}", tokenizer="train:5000", seq_len=8, global_batch=1)
  tok = data.load_tokenizer(cfg, None)
  assert tok.vocab_size < 5000 and "fewer than 5000" in capsys.readouterr().err


def test_train_tokenizer_caches(tmp_path, monkeypatch):
  path = tmp_path / "d.jsonl"
  lines = (json.dumps({"text": f"hello world number {i}"}) + "\n" for i in range(40))
  path.write_text("".join(lines))
  cfg = data.DataConfig(source=f"text:{path}", tokenizer="train:300", seq_len=8, global_batch=1)
  tok = data.load_tokenizer(cfg, str(tmp_path / "work"))
  assert (tmp_path / "work" / "tokenizer.json").is_file()
  # Reused once a run recorded it (config.json) with this tokenizer and source ...
  (tmp_path / "work" / "config.json").write_text(json.dumps(
      {"data": {"tokenizer": cfg.tokenizer, "source": cfg.source}}))
  trained = data.tokenizer_lib.train_bpe
  monkeypatch.setattr(data.tokenizer_lib, "train_bpe", None)  # a second call must not train
  again = data.load_tokenizer(cfg, str(tmp_path / "work"))
  assert again.encode("hello world") == tok.encode("hello world")
  path_cfg = dataclasses.replace(cfg, tokenizer=str(tmp_path / "work" / "tokenizer.json"))
  assert data.load_tokenizer(path_cfg, None).vocab_size == tok.vocab_size
  # ... but not when left by a run that recorded nothing, or one with another spec.
  monkeypatch.setattr(data.tokenizer_lib, "train_bpe", trained)
  (tmp_path / "work" / "config.json").unlink()
  other = dataclasses.replace(cfg, tokenizer="train:280")
  assert data.load_tokenizer(other, str(tmp_path / "work")).vocab_size != tok.vocab_size


@pytest.mark.parametrize("style, pieces", [("digits", [" 7", "0", "3", "7", "1"]),
                                           ("llama_digits", [" ", "7", "0", "3", "7", "1"])])
def test_train_tokenizer_digits(tmp_path, style, pieces):
  path = tmp_path / "d.jsonl"
  path.write_text("".join(json.dumps({"text": f"key {i * 7919}"}) + "\n" for i in range(40)))
  cfg = data.DataConfig(source=f"text:{path}", tokenizer=f"train:300:{style}", seq_len=8,
                        global_batch=1)
  tok = data.load_tokenizer(cfg, None)
  assert [tok.decode([i]) for i in tok.encode(" 70371")] == pieces



@pytest.mark.parametrize("field, value, match", [
    ("source", "hf:foo", "source"),
    ("source", "text:", "source"),
    ("tokenizer", "train:abc", "tokenizer"),
    ("tokenizer", "train:300:digit", "train:<vocab_size>:llama_digits"),
    ("tokenizer", "sentencepiece", "tokenizer"),
    ("seq_len", 0, "seq_len"),
    ("global_batch", -1, "global_batch"),
    ("num_epochs", 0, "num_epochs"),
    ("valid_fraction", 1.5, "valid_fraction"),
    ("valid_source", "nope", "valid_source"),
    ("tokenize", "eager", "tokenize"),
    ("retrieval_mix", 1.0, "retrieval_mix"),
])
def test_config_errors_name_the_field(field, value, match):
  kw = dict(source="bundled", tokenizer="bundled", seq_len=8, global_batch=2)
  kw[field] = value
  with pytest.raises(ValueError, match=match):
    data.DataConfig(**kw)


def test_jsonl_field_and_tfds_data_dir_are_config_fields(tmp_path):
  from configs import base
  from focaljax import config as config_lib
  path = tmp_path / "c.jsonl"
  path.write_text("".join(json.dumps({"content": f"document {i} text"}) + "\n" for i in range(40)))
  c = base.get_config()
  c.data.source, c.data.jsonl_field, c.data.tfds_data_dir = f"text:{path}", "content", "/d"
  cfg = config_lib.parse(c).data
  assert (cfg.jsonl_field, cfg.tfds_data_dir) == ("content", "/d")
  assert len(data.documents(cfg, "train")) > 30


def test_a_byte_order_mark_at_a_file_start_is_dropped(tmp_path):
  # Windows tools write one; json.loads refused the first line ("Unexpected UTF-8 BOM").
  (tmp_path / "a.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "one"}\n{"text": "two"}\n')
  (tmp_path / "b.txt").write_bytes(b"\xef\xbb\xbfthree")
  paths = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")]
  assert sources.read_text_files(paths) == ["one", "two", "three"]
