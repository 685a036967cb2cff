"""Byte-level BPE tokenizer: a thin wrapper over a Hugging Face `tokenizers.Tokenizer`.

Byte-level pre-tokenization maps every byte to a symbol before merging, so any
string (any unicode, any whitespace) encodes and `decode(encode(s)) == s`
exactly; there is no unknown token and no normalization. One special token,
`<|endoftext|>`, separates documents when they are packed into rows (pipeline.py).

Long texts are encoded in pieces of about PIECE_CHARS characters, a batch of pieces at a time:
the Rust encoder's per-token bookkeeping (offsets, strings) is then bounded by a batch, not by
the document, and the pieces encode in parallel. A piece ends before a space that starts a word,
where the byte-level pre-tokenizer splits anyway, so the ids equal a whole-text encode (a text
with no such space for PIECE_CHARS characters is cut where it must be, at a character).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import hashlib
import json
import os
import pathlib

import numpy as np
import tokenizers
from etils import epath
from tokenizers import decoders, models, pre_tokenizers, trainers

from focaljax.data import sources

EOS_TOKEN = "<|endoftext|>"
FILENAME = "tokenizer.json"
CONFIG_FILENAME = "tokenizer_config.json"
BUNDLED_FILE = pathlib.Path(__file__).parents[1] / "assets" / FILENAME  # see bundled()
PIECE_CHARS = 1 << 16
_PIECES_PER_CALL = 16


def pieces(text: str, size: int | None = None) -> list[str]:
  """`text` cut into consecutive pieces of about `size` (default PIECE_CHARS) characters, each
  (but the last) ending just before a space that follows a non-space and precedes one: a
  pre-token boundary."""
  size = size or PIECE_CHARS
  out, start = [], 0
  while len(text) - start > size:
    end = start + size
    cut = end
    while cut > start + size // 2:
      cut = text.rfind(" ", start + size // 2, cut)
      if cut <= start:
        cut = end
        break
      if not text[cut - 1].isspace() and cut + 1 < len(text) and not text[cut + 1].isspace():
        break
    else:
      cut = end
    out.append(text[start:cut])
    start = cut
  out.append(text[start:])
  return out


class Tokenizer:
  """Text <-> token ids. `eos_id` is the document separator."""

  def __init__(self, hf: tokenizers.Tokenizer, eos_token: str = EOS_TOKEN):
    eos_id = hf.token_to_id(eos_token)
    if eos_id is None:
      raise ValueError(f"tokenizer has no {eos_token!r} special token; train it with train_bpe() "
                       "or name its end-of-text token (tokenizer_config.json's eos_token)")
    # Specials are never parsed out of raw text: a document that happens to contain the literal
    # string "<|endoftext|>" must not inject a document boundary (and must still roundtrip).
    hf.encode_special_tokens = True
    self._hf = hf
    self.eos_token = eos_token
    self.eos_id: int = eos_id

  @property
  def vocab_size(self) -> int:
    return self._hf.get_vocab_size(with_added_tokens=True)

  def fingerprint(self) -> str:
    """A digest of the whole tokenizer (vocabulary, merges, specials): equal iff it encodes alike."""
    return hashlib.sha256(self._hf.to_str().encode()).hexdigest()

  def encode(self, text: str) -> list[int]:
    # Through encode_batch: it releases the GIL while Rust tokenizes (encode holds it), so the
    # FocusLLM sampler's prefetch threads tokenize documents in parallel; the ids are the same.
    if len(text) > PIECE_CHARS:
      return self.encode_array(text).tolist()
    return self._hf.encode_batch([text], add_special_tokens=False)[0].ids

  def encode_array(self, text: str) -> np.ndarray:
    """encode(text) as int32, in bounded memory for any length (module docstring)."""
    parts, batch = [], []
    for piece in pieces(text) + [None]:
      if piece is not None:
        batch.append(piece)
      if batch and (piece is None or len(batch) == _PIECES_PER_CALL):
        parts += [np.asarray(e.ids, np.int32)
                  for e in self._hf.encode_batch(batch, add_special_tokens=False)]
        batch = []
    return np.concatenate(parts)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    texts = list(texts)
    long = [i for i, t in enumerate(texts) if len(t) > PIECE_CHARS]
    short = [("" if len(t) > PIECE_CHARS else t) for t in texts] if long else texts
    out = [e.ids for e in self._hf.encode_batch(short, add_special_tokens=False)]
    for i in long:
      out[i] = self.encode_array(texts[i]).tolist()
    return out

  def decode(self, ids: Sequence[int]) -> str:
    return self._hf.decode(list(ids), skip_special_tokens=False)

  def to_str(self) -> str:
    """The tokenizer.json text `save` writes."""
    return self._hf.to_str(pretty=True)

  def same_as(self, path_or_dir: str | os.PathLike) -> bool:
    """Whether the tokenizer saved at `path_or_dir` (as `load` takes it) is this one; both
    re-serialised, so formatting alone never differs."""
    return Tokenizer.load(path_or_dir).to_str() == self.to_str()

  def save(self, directory: str | os.PathLike) -> str:
    """Writes `directory/tokenizer.json` atomically (hosts may race) and returns its path."""
    directory = epath.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / FILENAME
    tmp = directory / f".{FILENAME}.{os.getpid()}.tmp"
    tmp.write_text(self.to_str())
    tmp.replace(path)
    if self.eos_token != EOS_TOKEN:  # imported tokenizers (LLaMA's </s>) name their own eos
      (directory / CONFIG_FILENAME).write_text(json.dumps({"eos_token": self.eos_token}))
    return str(path)

  @classmethod
  def load(cls, path_or_dir: str | os.PathLike) -> Tokenizer:
    """Loads a tokenizer.json, or `dir/tokenizer.json` when given a directory."""
    path = epath.Path(path_or_dir)
    if path.is_dir():
      path = path / FILENAME
    if not path.is_file():
      raise FileNotFoundError(f"no tokenizer file at {path}")
    text = path.read_text()
    try:
      hf = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # pylint: disable=broad-except  (the Rust parser's one error type)
      raise sources.DataError(f"{path} is not a tokenizer.json ({e})") from None
    eos = EOS_TOKEN
    config = path.parent / CONFIG_FILENAME
    if hf.token_to_id(EOS_TOKEN) is None and config.is_file():
      # A Hugging Face tokenizer: its tokenizer_config.json names the end-of-text token.
      eos = json.loads(config.read_text()).get("eos_token", EOS_TOKEN)
      eos = eos.get("content", EOS_TOKEN) if isinstance(eos, dict) else eos
    return cls(hf, eos_token=eos)

  def __repr__(self) -> str:
    return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


# How train_bpe spells numbers (DataConfig.tokenizer "train:<vocab>[:<style>]"): a lossless split
# applied before GPT-2's, or None for plain merges (which spell 5-digit passkeys with rare tokens
# such as "037" or " 500", that a small model reads back poorly).
#   digits        every digit a token, the first keeping its leading space: " 7", "0", "3", ...
#   llama_digits  every digit a token, the space before a number a token of its own (" ", "7",
#                 "0", ...), as LLaMA's tokenizer spells it. With "digits" a passkey answer's
#                 first token " 8" is predicted after " is", which the filler repeats; here "8"
#                 follows a lone space, which the context holds only at the needle.
DIGIT_STYLES = {"": None, "digits": r" ?\p{N}", "llama_digits": r"\p{N}"}


def train_bpe(texts: Iterable[str], vocab_size: int, *, digits: str = "") -> Tokenizer:
  """Trains a byte-level BPE with `vocab_size` entries (256 bytes + <|endoftext|> + merges).

  A small corpus can run out of pairs to merge and yield fewer entries: size the model's
  embedding from the returned `vocab_size`, not from the request.
  `digits`: how numbers are spelled, a key of DIGIT_STYLES; any style but "" makes a number of
  n digits n tokens (plus, for "llama_digits", the space before it).
  """
  min_size = 256 + 1
  if vocab_size < min_size:
    raise ValueError(f"vocab_size must be >= {min_size} (256 bytes + {EOS_TOKEN}), "
                     f"got {vocab_size}")
  if digits not in DIGIT_STYLES:
    raise ValueError(f"digits={digits!r}: expected one of {list(DIGIT_STYLES)}")
  hf = tokenizers.Tokenizer(models.BPE())
  # add_prefix_space=False keeps the roundtrip exact: no space is invented at the start.
  # use_regex=True splits words/digits/punctuation GPT-2 style so merges stay within words.
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if DIGIT_STYLES[digits]:
    # Digits first: the split is lossless (no bytes change), so the roundtrip stays exact.
    split = pre_tokenizers.Split(tokenizers.Regex(DIGIT_STYLES[digits]), behavior="isolated")
    hf.pre_tokenizer = pre_tokenizers.Sequence([split, hf.pre_tokenizer])
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=[EOS_TOKEN],
      # Seed all 256 byte symbols so text unseen in training still encodes.
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  hf.train_from_iterator(texts, trainer=trainer)
  return Tokenizer(hf)


def bundled() -> Tokenizer:
  """The BPE (vocab 4096) shipped for the bundled text (focaljax/assets/)."""
  return Tokenizer.load(BUNDLED_FILE)
