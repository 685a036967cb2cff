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
from focaljax.data import sources
from focaljax.data import tokenizer as tokenizer_lib

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


def test_a_damaged_token_cache_is_tokenized_again(corpus, tmp_path, capsys):
  """A cache file cut short (a killed run) is a warning and a fresh tokenization, not a crash."""
  cfg, _ = corpus
  cached = dataclasses.replace(cfg, tokenize="ahead", token_cache=str(tmp_path), num_epochs=1)
  want = batches(cached)
  (path,) = tmp_path.glob("tokens-*.npz")
  for cut in (100, 0):   # cut short, or empty
    path.write_bytes(path.read_bytes()[:cut])
    got = batches(cached)
    assert "is unreadable" in capsys.readouterr().err and len(got) == len(want)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g["inputs"], w["inputs"])
    assert len(path.read_bytes()) > 100   # written again whole


def test_a_file_that_is_no_tokenizer_is_a_data_error(tmp_path):
  (tmp_path / "config.json").write_text('{"model": {"d_model": 8}}')
  with pytest.raises(sources.DataError, match="is not a tokenizer.json"):
    tokenizer_lib.Tokenizer.load(tmp_path / "config.json")


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


def test_tfds_dataset_not_built_is_one_line(corpus, tmp_path):
  pytest.importorskip("tensorflow_datasets")
  cfg, _ = corpus
  missing = dataclasses.replace(cfg, source="tfds:no_such_text", tfds_data_dir=str(tmp_path))
  with pytest.raises(sources.DataError, match=r"^data.source='tfds:no_such_text': Dataset "
                     r"no_such_text not found\. \(data.tfds_data_dir="):
    data.documents(missing, "train")


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


def _save_restore(tmp_path, save, restore, make, saved_at=5):
  ocp = pytest.importorskip("orbax.checkpoint")
  it = make()
  for _ in range(saved_at):
    next(it)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(saved_at, args=ocp.args.Composite(data=save(it)))
    mngr.wait_until_finished()
  want = [next(it) for _ in range(4)]
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    restored = mngr.restore(saved_at, args=ocp.args.Composite(data=restore(make())))["data"]
  for w in want:
    g = next(restored)
    for key in w:
      np.testing.assert_array_equal(g[key], w[key])


@pytest.mark.parametrize("shards", [1, 2])
def test_orbax_checkpoint_roundtrip(corpus, tmp_path, shards):
  """The way the trainer saves the iterator: one file per data shard (data/state.py)."""
  from focaljax.data import state  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(corpus[0], num_epochs=None)
  make = lambda: data.make_iterator(cfg, WordTokenizer(), num_shards=shards)
  _save_restore(tmp_path, state.Save, state.Restore, make)
  names = sorted(p.name for p in (tmp_path / "ckpt" / "5" / "data").glob("*.json"))
  assert names == [f"shard_{s}-of-{shards}.json" for s in range(shards)]


def test_grain_per_process_checkpoints_still_restore(corpus, tmp_path):
  """Checkpoints written by Grain's handler (process_0-of-1.json) restore on that process count."""
  import grain  # pylint: disable=g-import-not-at-top
  from focaljax.data import state  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(corpus[0], num_epochs=None)
  _save_restore(tmp_path, grain.checkpoint.CheckpointSave, state.Restore,
                lambda: data.make_iterator(cfg, WordTokenizer()))


def test_other_shards_are_named(corpus, tmp_path):
  from focaljax.data import state  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(corpus[0], num_epochs=None)
  (tmp_path / "shard_0-of-2.json").write_text("{}")
  with pytest.raises(state.ShardsMismatch, match=r"shard_0-of-2.json.*shards \[0\] of 1"):
    state.Handler().restore(tmp_path, data.make_iterator(cfg, WordTokenizer()))


