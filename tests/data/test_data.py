"""Data pipeline invariants: packing is lossless and never mixes documents; resume is exact.

Most tests use a word tokenizer over synthetic documents whose tokens are unique integers, so
every token's document and position can be recovered from its value alone.
"""

import dataclasses
import json
import lzma
import sys

import numpy as np
import pytest

from focaljax.data import pipeline as data
from focaljax.data import retrieval
from focaljax.data import sources

EOS = 1  # the fake tokenizer's <|endoftext|>; padding is 0 and document tokens are >= 10_000


class WordTokenizer:
  """"w10003 w10004" -> [10003, 10004]: token values identify (document, index)."""

  eos_id = EOS
  vocab_size = 1 << 20

  def encode(self, text):
    return [int(w[1:]) for w in text.split()]

  def encode_batch(self, texts):
    return [self.encode(t) for t in texts]

  def fingerprint(self):
    return "words"


def make_docs(lengths):
  return [[10_000 * (d + 1) + j for j in range(n)] for d, n in enumerate(lengths)]


def doc_text(doc):
  return " ".join(f"w{t}" for t in doc)


# Lengths include the empty document, exact row fits (seq_len + 1 = 9 with eos), and documents
# spanning several rows, so every packing case and every checkpoint state shape occurs.
LENGTHS = [5, 8, 0, 3, 30, 1, 17, 8, 8, 2, 44, 7, 11, 4, 6, 9, 1, 25, 3, 8]


@pytest.fixture
def corpus(tmp_path):
  docs = make_docs(LENGTHS)
  path = tmp_path / "docs.jsonl.xz"
  with lzma.open(path, "wt") as f:
    for doc in docs:
      f.write(json.dumps({"text": doc_text(doc), "id": len(doc)}) + "\n")
  cfg = data.DataConfig(source=f"text:{path}", tokenizer="bundled", seq_len=8, global_batch=4,
                        seed=3, num_epochs=1, valid_fraction=0.0)
  return cfg, docs


def batches(cfg, **kw):
  return list(data.make_iterator(cfg, WordTokenizer(), **kw))


def stream(batch_list):
  """Tokens of all rows in order (rows = inputs + last target), padding removed."""
  rows = [np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1) for b in batch_list]
  flat = np.concatenate(rows).reshape(-1)
  return flat[flat != 0]


def split_docs(tokens):
  """Token stream -> documents (lists without eos)."""
  docs, cur = [], []
  for t in tokens.tolist():
    if t == EOS:
      docs.append(cur)
      cur = []
    else:
      cur.append(t)
  assert not cur, "stream must end with a complete document"
  return docs


def check_batch(b, cfg, docs_by_first_token=None):
  b_, t_ = cfg.global_batch, cfg.seq_len
  assert set(b) == {"inputs", "targets", "segment_ids", "positions", "weights"}
  for k, v in b.items():
    assert v.shape == (b_, t_), k
    assert v.dtype == (np.float32 if k == "weights" else np.int32), k
  keys = ("inputs", "targets", "segment_ids", "positions", "weights")
  inp, tgt, seg, pos, w = (b[k] for k in keys)
  for r in range(b_):
    real = seg[r] != 0
    # Padding only at the end of a row; segments count 1, 2, 3, ... and step after each eos.
    n = int(real.sum())
    assert real[:n].all() and not real[n:].any()
    assert (inp[r, n:] == 0).all() and (w[r, n:] == 0).all()
    if n:
      assert seg[r, 0] == 1 and pos[r, 0] == 0
    for t in range(1, n):
      new_doc = inp[r, t - 1] == EOS
      assert seg[r, t] == seg[r, t - 1] + new_doc
      assert pos[r, t] == (0 if new_doc else pos[r, t - 1] + 1)
    for t in range(n):
      if inp[r, t] == EOS:
        assert w[r, t] == 0  # its target is the next document (or padding)
      elif tgt[r, t] == 0:
        assert w[r, t] == 0  # padding target
      else:
        # weights == 1 <=> the target is the next token of the same document.
        assert w[r, t] == 1
        assert tgt[r, t] == inp[r, t] + 1 or (tgt[r, t] == EOS and inp[r, t] % 10_000 ==
                                               LENGTHS[inp[r, t] // 10_000 - 1] - 1)


def test_packing_invariants_and_lossless_epoch(corpus):
  cfg, docs = corpus
  out = batches(cfg)
  for b in out:
    check_batch(b, cfg)
  got = split_docs(stream(out))
  # Every document exactly once, whole and contiguous; the shuffle changed their order.
  assert sorted(got) == sorted(docs)
  assert got != docs
  # All rows but the last are full: padding appears only at the very end of the epoch.
  rows = np.concatenate([b["segment_ids"] for b in out])
  assert (rows[:-cfg.global_batch - 1] != 0).all()


def test_hand_made_row():
  rows = {
      "tokens": np.array([[7, 8, EOS, 9, EOS, 5, 6, 0, 0]], np.int32),
      "tokens_segment_ids": np.array([[1, 1, 1, 2, 2, 3, 3, 0, 0]], np.int32),
      "tokens_positions": np.array([[0, 1, 2, 0, 1, 0, 1, 0, 0]], np.int32),
  }
  b = data.to_example(rows)
  np.testing.assert_array_equal(b["inputs"], [[7, 8, EOS, 9, EOS, 5, 6, 0]])
  np.testing.assert_array_equal(b["targets"], [[8, EOS, 9, EOS, 5, 6, 0, 0]])
  np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 2, 2, 3, 3, 0]])
  np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 0, 1, 0, 1, 0]])
  np.testing.assert_array_equal(b["weights"], [[1, 1, 0, 1, 0, 1, 0, 0]])


def test_epochs_reshuffle_and_repeat(corpus):
  cfg, docs = corpus
  cfg = dataclasses.replace(cfg, num_epochs=2)
  got = split_docs(stream(batches(cfg)))
  assert sorted(got) == sorted(docs + docs)
  assert got[:len(docs)] != got[len(docs):]  # each epoch has its own order
  no_shuffle = dataclasses.replace(cfg, shuffle=False, num_epochs=1)
  assert split_docs(stream(batches(no_shuffle))) == docs


def test_tokenize_ahead_gives_the_same_batches(corpus):
  cfg, _ = corpus
  cfg = dataclasses.replace(cfg, num_epochs=2)
  ahead = batches(dataclasses.replace(cfg, tokenize="ahead"))
  want = batches(dataclasses.replace(cfg, tokenize="stream"))
  assert len(ahead) == len(want)
  for got, ref in zip(ahead, want):
    for key in ref:
      np.testing.assert_array_equal(got[key], ref[key])


def test_token_cache_reuses_ahead_tokenization_and_misses_on_other_tokens(corpus, tmp_path):
  cfg, _ = corpus
  cached = dataclasses.replace(cfg, tokenize="ahead", token_cache=str(tmp_path), num_epochs=1)
  want = batches(dataclasses.replace(cfg, num_epochs=1, tokenize="stream"))
  first = batches(cached)  # builds and writes the cache
  assert len(list(tmp_path.glob("tokens-*.npz"))) == 1

  class Counting(WordTokenizer):
    calls = 0

    def encode_batch(self, texts):
      Counting.calls += 1
      return super().encode_batch(texts)

  second = list(data.make_iterator(cached, Counting()))
  assert Counting.calls == 0  # loaded, not tokenized
  # auto (the default) tokenizes a local file source ahead: it finds the same cache.
  list(data.make_iterator(dataclasses.replace(cached, tokenize="auto"), Counting()))
  assert Counting.calls == 0
  for got in (first, second):
    assert len(got) == len(want)
    for g, w in zip(got, want):
      for key in w:
        np.testing.assert_array_equal(g[key], w[key])

  class Other(Counting):
    def fingerprint(self):
      return "other words"

  list(data.make_iterator(cached, Other()))  # another tokenizer: a miss, a second file
  assert Counting.calls > 0 and len(list(tmp_path.glob("tokens-*.npz"))) == 2
  with pytest.raises(ValueError, match="token_cache.*needs tokenize='ahead'"):
    dataclasses.replace(cfg, tokenize="stream", token_cache=str(tmp_path))


@pytest.mark.parametrize("num_epochs, tokenize", [(3, "stream"), (None, "stream"), (3, "ahead")])
def test_resume_is_exact_after_json_roundtrip(corpus, num_epochs, tokenize):
  cfg, _ = corpus
  cfg = dataclasses.replace(cfg, num_epochs=num_epochs, global_batch=2, tokenize=tokenize)
  ref_it = data.make_iterator(cfg, WordTokenizer())
  states, ref = [], []
  for _ in range(45):  # 3 epochs are 39 batches: this also resumes at the end of the data
    # Orbax's grain handler stores the state as JSON: restore from exactly that.
    states.append(json.loads(json.dumps(ref_it.get_state())))
    ref.append(next(ref_it, None))
  for k in range(len(states)):
    it = data.make_iterator(cfg, WordTokenizer())
    it.set_state(states[k])
    for want in ref[k:k + 3]:
      got = next(it, None)
      assert (got is None) == (want is None)
      for key in want or ():
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"step {k} {key}")


def test_two_hosts_disjoint_and_complete(corpus):
  cfg, docs = corpus
  per_host = [batches(cfg, process_index=i, process_count=2) for i in range(2)]
  for out in per_host:
    for b in out:
      assert b["inputs"].shape == (cfg.global_batch // 2, cfg.seq_len)
  host_docs = [split_docs(stream(out)) for out in per_host]
  assert host_docs[0] and host_docs[1]
  assert not {tuple(d) for d in host_docs[0]} & {tuple(d) for d in host_docs[1]}
  assert sorted(host_docs[0] + host_docs[1]) == sorted(docs)


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


def test_train_tokenizer_caches(tmp_path, monkeypatch):
  path = tmp_path / "d.jsonl"
  lines = (json.dumps({"text": f"hello world number {i}"}) + "\n" for i in range(40))
  path.write_text("".join(lines))
  cfg = data.DataConfig(source=f"text:{path}", tokenizer="train:300", seq_len=8, global_batch=1)
  tok = data.load_tokenizer(cfg, str(tmp_path / "work"))
  assert (tmp_path / "work" / "tokenizer.json").is_file()
  monkeypatch.setattr(data.tokenizer_lib, "train_bpe", None)  # a second call must not train
  again = data.load_tokenizer(cfg, str(tmp_path / "work"))
  assert again.encode("hello world") == tok.encode("hello world")
  path_cfg = dataclasses.replace(cfg, tokenizer=str(tmp_path / "work" / "tokenizer.json"))
  assert data.load_tokenizer(path_cfg, None).vocab_size == tok.vocab_size


@pytest.mark.parametrize("style, pieces", [("digits", [" 7", "0", "3", "7", "1"]),
                                           ("llama_digits", [" ", "7", "0", "3", "7", "1"])])
def test_train_tokenizer_digits(tmp_path, style, pieces):
  path = tmp_path / "d.jsonl"
  path.write_text("".join(json.dumps({"text": f"key {i * 7919}"}) + "\n" for i in range(40)))
  cfg = data.DataConfig(source=f"text:{path}", tokenizer=f"train:300:{style}", seq_len=8,
                        global_batch=1)
  tok = data.load_tokenizer(cfg, None)
  assert [tok.decode([i]) for i in tok.encode(" 70371")] == pieces


def test_tfds_builder_roundtrip(corpus, tmp_path):
  tfds_text = pytest.importorskip("focaljax.data.tfds_text")   # needs tensorflow_datasets
  cfg, docs = corpus
  files = cfg.source.removeprefix("text:")
  tfds_text.build(files, str(tmp_path / "tfds"), name="tiny_text", valid_fraction=0.1)
  tcfg = dataclasses.replace(cfg, source="tfds:tiny_text", tfds_data_dir=str(tmp_path / "tfds"))
  got = split_docs(stream(batches(tcfg)))
  valid = split_docs(stream(batches(tcfg, split="valid")))
  assert len(valid) == 2
  assert sorted(got + valid) == sorted(docs)
  for b in batches(tcfg):
    check_batch(b, tcfg)
  explicit = dataclasses.replace(tcfg, source="tfds:tiny_text:validation")
  assert sorted(split_docs(stream(batches(explicit)))) == sorted(valid)
  assert "tensorflow" not in sys.modules  # the whole TFDS path is TF-free


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


def test_runtime_errors(corpus):
  cfg, _ = corpus
  with pytest.raises(ValueError, match="global_batch"):
    data.make_iterator(cfg, WordTokenizer(), process_index=0, process_count=3)
  with pytest.raises(ValueError, match="split"):
    data.documents(cfg, "test")
  with pytest.raises(ValueError, match="matches no files"):
    data.documents(dataclasses.replace(cfg, source="text:/nonexistent/*.txt"), "train")
  with pytest.raises(ValueError, match="valid split"):
    data.documents(cfg, "valid")  # valid_fraction=0 holds nothing out


def test_orbax_checkpoint_roundtrip(corpus, tmp_path):
  """The way the trainer saves the iterator: Composite(data=grain.checkpoint.CheckpointSave)."""
  ocp = pytest.importorskip("orbax.checkpoint")
  import grain  # pylint: disable=g-import-not-at-top

  cfg, _ = corpus
  cfg = dataclasses.replace(cfg, num_epochs=None)
  it = data.make_iterator(cfg, WordTokenizer())
  for _ in range(5):
    next(it)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
  want = [next(it) for _ in range(4)]
  fresh = data.make_iterator(cfg, WordTokenizer())
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    restored = mngr.restore(5, args=ocp.args.Composite(
        data=grain.checkpoint.CheckpointRestore(fresh)))["data"]
  for w in want:
    g = next(restored)
    for key in w:
      np.testing.assert_array_equal(g[key], w[key])
