"""Tokenizer invariants: exact roundtrip for any text, one eos special, save/load identity."""

import pytest

from focaljax.data import tokenizer as tokenizer_lib

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\nand\u00a0nbsp\u2028line sep",
    "multiple     spaces\n\n\n\nblank lines",
    "Unicode: café, naïve, Übermaß, 日本語のテキスト, Ελληνικά, עברית",
    "emoji and ZWJ sequences: 🦀🚀 👩‍👩‍👧",
    "numbers 1234567890 3.14159 -42 1e-9",
    "code: def f(x):\n    return {'a': [1, 2]}  # comment",
    "a literal <|endoftext|> inside a document",
    "\x00\x01 control \x7f chars",
]


@pytest.fixture(scope="module")
def bundled():
  return tokenizer_lib.bundled()


@pytest.fixture(scope="module")
def small():
  corpus = ["the quick brown fox jumps over the lazy dog. " * 20, "hello world " * 50] * 5
  return tokenizer_lib.train_bpe(corpus, vocab_size=300)


def test_bundled_loads(bundled):
  assert bundled.vocab_size == 4096
  assert bundled.decode([bundled.eos_id]) == tokenizer_lib.EOS_TOKEN


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip_bundled(bundled, text):
  ids = bundled.encode(text)
  assert all(0 <= i < bundled.vocab_size for i in ids)
  assert bundled.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip_small_trained(small, text):
  # Text never seen in training (CJK, emoji) still roundtrips: all 256 bytes are in the vocab.
  assert small.decode(small.encode(text)) == text


def test_literal_eos_string_is_not_a_boundary(bundled):
  assert bundled.eos_id not in bundled.encode("x <|endoftext|> y")


def test_bundled_compresses_english(bundled):
  text = "It is a truth universally acknowledged, that the Congress of the United States"
  assert len(bundled.encode(text)) < len(text.encode()) / 2.5


def test_train_small_bpe(small):
  # A tiny corpus can run out of pairs to merge before reaching the requested size.
  assert 257 < small.vocab_size <= 300
  assert small.decode([small.eos_id]) == tokenizer_lib.EOS_TOKEN
  # Merges were learned: a frequent word is a single token.
  assert len(small.encode("hello")) == 1


def test_encode_batch_matches_encode(bundled):
  assert bundled.encode_batch(TEXTS) == [bundled.encode(t) for t in TEXTS]
  # encode goes through encode_batch (it releases the GIL); the ids are the single-text path's.
  for t in TEXTS:
    assert bundled.encode(t) == bundled._hf.encode(t, add_special_tokens=False).ids


def test_save_load(small, tmp_path):
  path = small.save(tmp_path)
  assert path == str(tmp_path / tokenizer_lib.FILENAME)
  for loaded in (tokenizer_lib.Tokenizer.load(tmp_path), tokenizer_lib.Tokenizer.load(path)):
    assert loaded.vocab_size == small.vocab_size and loaded.eos_id == small.eos_id
    for text in TEXTS:
      assert loaded.encode(text) == small.encode(text)


DIGIT_CORPUS = ["the pass key is 70371. Remember it. 50054 is the pass key. " * 20,
                "in 1984 and 2024, 3.14 " * 50] * 5


@pytest.fixture(scope="module", params=["digits", "llama_digits"])
def digits(request):
  return request.param, tokenizer_lib.train_bpe(DIGIT_CORPUS, vocab_size=400, digits=request.param)


@pytest.mark.parametrize("text", TEXTS + [" 70371.", "x1y22z333", "  12  "])
def test_roundtrip_split_digits(digits, text):
  _, tok = digits
  assert tok.decode(tok.encode(text)) == text


def test_split_digits_spells_every_number_digit_by_digit(digits, tmp_path):
  """Whatever the merges learned, a number of n digits is n tokens, in its save/load copy too;
  "digits" keeps the space on the first, "llama_digits" makes it a token of its own."""
  style, tok = digits
  tok.save(tmp_path)
  for t in (tok, tokenizer_lib.Tokenizer.load(tmp_path)):
    for key in ("70371", "50054", "1984"):
      pieces = [t.decode([i]) for i in t.encode(f"The pass key is {key}.")]
      want = [" " + key[0], *key[1:]] if style == "digits" else [" ", *key, "."]
      assert pieces[-len(want):] == want if style == "llama_digits" else (
          [p for p in pieces if any(c.isdigit() for c in p)] == want)


def test_digit_style_must_be_known():
  with pytest.raises(ValueError, match="digits='spaced'.*llama_digits"):
    tokenizer_lib.train_bpe(DIGIT_CORPUS, vocab_size=400, digits="spaced")


def test_errors(tmp_path):
  with pytest.raises(ValueError, match="vocab_size"):
    tokenizer_lib.train_bpe(["abc"], vocab_size=100)
  with pytest.raises(FileNotFoundError):
    tokenizer_lib.Tokenizer.load(tmp_path)


def test_imported_tokenizer_names_its_own_eos(tmp_path):
  """A Hugging Face tokenizer (LLaMA's </s>) loads through tokenizer_config.json's eos_token."""
  import json
  import tokenizers
  from tokenizers import models, pre_tokenizers
  hf = tokenizers.Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel()
  hf.add_special_tokens(["</s>"])
  hf.save(str(tmp_path / "tokenizer.json"))
  with pytest.raises(ValueError, match="<\\|endoftext\\|>"):
    tokenizer_lib.Tokenizer.load(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
  tok = tokenizer_lib.Tokenizer.load(tmp_path)
  assert tok.eos_id == hf.token_to_id("</s>")
  out = tmp_path / "copy"
  tok.save(out)
  assert tokenizer_lib.Tokenizer.load(out).eos_id == tok.eos_id
