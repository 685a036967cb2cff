"""A run's workdir: what must hold before anything in it is written, and what a resume repairs.

  check        refuses a workdir that is a file, or whose checkpoints hold another run: another
               model shape, data, tokenizer or global batch (one line listing the fields); a
               new data.seq_len (context extension) is allowed and said in one line
  lock         one trainer per workdir (a second is refused naming the holder's pid and host)
  cut_metrics  drops metrics.jsonl rows past the resumed step (a resumed run writes them again)

The lock is fcntl.flock on workdir/.lock: the kernel drops it when its process dies, SIGKILL
included, so a stale lock file never blocks a later run. Storage without POSIX locks (gs://,
other non-local paths) is not locked; a warning says so.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys

from etils import epath

from focaljax import config as config_lib
from focaljax.data import tokenizer as tokenizer_lib
from focaljax.model import attention as attn_lib
from focaljax.train import checkpoint
from focaljax.train import distributed
from focaljax.train import saved_config

# The fields that shape the trained state: a workdir's checkpoints resume only under equal ones.
SHAPE_FIELDS = ("model.vocab_size", "model.d_model", "model.num_layers", "model.num_heads",
                "model.num_kv_heads", "model.head_dim", "model.d_ff", "model.tie_embeddings",
                "model.qk_norm", "model.qkv_bias", "model.attention.pattern",
                "model.attention.learned")
# What else makes a run the same run: its data (and the shards its saved iterators split it
# into), tokenizer and global batch.
IDENTITY_FIELDS = SHAPE_FIELDS + ("data.source", "data.valid_source", "data.jsonl_field",
                                  "data.shards", "data.tokenizer", "data.global_batch")
# Fields a resume may change on purpose (context extension), said in one line.
RESUME_CHANGES = ("data.seq_len",)
LOCK_FILE = ".lock"
_held: dict[str, int] = {}   # workdir -> the open lock file of this process
_made: set[str] = set()      # workdirs lock() created


def check(workdir: str, config_json: str) -> None:
  """Refuses (ConfigError, one line) a workdir that is a file or lies under one, or whose
  checkpoints hold another run (listing the differing fields, old -> new). Writes nothing."""
  path = epath.Path(workdir)
  for parent in (path, *path.parents):
    if parent.exists():
      if not parent.is_dir():
        raise config_lib.ConfigError(f"--workdir {workdir}: {parent} is a file, not a directory")
      break
  step = checkpoint.latest_step(workdir)
  if step is None or not (path / checkpoint.CONFIG_FILE).exists():
    return
  old, new = saved_config.read(workdir).to_dict(), json.loads(config_json)
  # A FocusLLM run's model is its base's (focus.base_workdir, checked with the adapter's
  # checkpoint): the model.* it carries are base.py's unused defaults.
  kept = [f for f in IDENTITY_FIELDS if "focus" not in new or not f.startswith("model.")]
  fields = [f for f in kept if _differs(old, new, f) and not (
      f == "data.tokenizer" and _same_tokenizer(workdir, _get(new, f)))]
  diff = differences(old, new, fields)
  if not fields and _get(old, "model.attention.learned"):
    # The learned τ's clip range as resolved (0: the paper's, scaled to the head dim).
    head_dim = _resolved(old, "model.head_dim")
    was, now = (config_lib.tau_range(t["model"]["attention"], head_dim) for t in (old, new))
    changed = [k for k in was if was[k] != now[k]]
    fields = [f"model.attention.{k}" for k in changed]   # what the trained w_τ means
    diff = [f"model.attention.{k} {was[k]:g} -> {now[k]:g}" for k in changed]
  if diff:
    what = "run" if set(fields) <= set(IDENTITY_FIELDS) - set(SHAPE_FIELDS) else "model"
    raise config_lib.ConfigError(
        f"workdir {workdir} holds a different {what} (checkpoint step {step}): {', '.join(diff)}; "
        "resume it with the config it trained with (its config.json), or train in another "
        "--workdir")
  if _get(new, "train.init_from") not in ("", None, _get(old, "train.init_from")) and (
      distributed.is_primary()):   # a fine-tune's source is read by its fresh start alone
    print(f"note: resuming {workdir} (step {step}): train.init_from "
          f"{_get(new, 'train.init_from')!r} is not read", file=sys.stderr)
  for f in RESUME_CHANGES:
    if _get(old, f) != _get(new, f) and distributed.is_primary():
      print(f"note: resuming {workdir} (step {step}) with {f} {_get(old, f)!r} -> "
            f"{_get(new, f)!r}: eval.py and the export take the new one as the trained context",
            file=sys.stderr)


def _same_tokenizer(workdir: str, spec) -> bool:
  """Whether the file `spec` holds the tokenizer the workdir's checkpoints trained with (its own
  copy, e.g. a fine-tune's once its source is gone)."""
  own = epath.Path(workdir) / tokenizer_lib.FILENAME
  if not (isinstance(spec, str) and os.path.isfile(spec) and own.exists()):
    return False
  return tokenizer_lib.Tokenizer.load(spec).same_as(workdir)


def differences(old: dict, new: dict, fields) -> list[str]:
  """`field old -> new` for each of `fields` that two saved configs give different values."""
  shown = lambda t, f: _get(t, f) if _get(old, f) != _get(new, f) else _resolved(t, f)
  return [f"{f} {shown(old, f)!r} -> {shown(new, f)!r}" for f in fields if _differs(old, new, f)]


def _differs(old: dict, new: dict, dotted: str) -> bool:
  """Whether two saved configs give the field different values as the model takes them
  ('softmax' is 'softmax:rope'; head_dim 0 is d_model / num_heads; a pattern as cycled over the
  new layer count). vocab_size 0 (the tokenizer's, padded) and data.shards 0 (the process
  count) may equal any: a real difference fails the checkpoint's restore, naming it."""
  layers = _get(new, "model.num_layers")
  a, b = _resolved(old, dotted, layers), _resolved(new, dotted, layers)
  return a != b and not (dotted in ("model.vocab_size", "data.shards") and 0 in (a, b))


def _get(tree: dict, dotted: str):
  for part in dotted.split("."):
    tree = tree.get(part) if isinstance(tree, dict) else None
  return tree


def _resolved(tree: dict, dotted: str, num_layers: int | None = None):
  m = tree.get("model", {})
  if dotted == "model.head_dim":
    return m.get("head_dim") or m.get("d_model", 0) // max(m.get("num_heads", 1), 1)
  value = _get(tree, dotted)
  if dotted == "model.attention.pattern":
    try:
      return attn_lib.parse_pattern(value, num_layers or m.get("num_layers", 1))
    except (ValueError, TypeError, AttributeError):
      return value
  return value


def lock(workdir: str) -> None:
  """Takes workdir's lock for this process (again: a no-op); ConfigError naming the holder."""
  if "://" in str(workdir):
    print(f"warning: --workdir {workdir} is not on a local file system; not locked: make sure "
          "no other trainer uses it", file=sys.stderr)
    return
  key = os.path.abspath(workdir)
  if key in _held:
    return
  if not os.path.exists(key):
    _made.add(key)
  try:
    os.makedirs(key, exist_ok=True)
    fd = os.open(os.path.join(key, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    raise config_lib.ConfigError(f"--workdir {workdir}: cannot write there ({e.strerror})") \
        from None
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
    os.close(fd)
    raise config_lib.ConfigError(f"--workdir {workdir} is in use by {holder} (its lock file "
                                 f"{LOCK_FILE}); wait for it, or train in another --workdir") \
        from None
  os.ftruncate(fd, 0)
  os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
  _held[key] = fd


def unlock(workdir: str) -> None:
  key = os.path.abspath(workdir)
  fd = _held.pop(key, None)
  if fd is not None:
    os.close(fd)   # closing the file releases the flock
  left = os.listdir(key) if key in _made else []
  if left and set(left) <= {LOCK_FILE, checkpoint.TOKENIZER_FILE}:   # a refused run leaves no
    for name in left:                                                 # workdir it made
      os.remove(os.path.join(key, name))
    os.rmdir(key)
  _made.discard(key)


def cut_metrics(workdir: str, step: int) -> None:
  """Drops metrics.jsonl rows after `step`, where a resumed run writes them again."""
  path = epath.Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return
  lines = path.read_text().splitlines(keepends=True)
  keep = []
  for line in lines:
    try:
      if json.loads(line)["step"] <= step:
        keep.append(line)
    except (ValueError, KeyError, TypeError):   # a line cut short by a killed run
      pass
  if len(keep) < len(lines):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)
