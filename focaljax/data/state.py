"""The data position in an Orbax checkpoint: one JSON file per data shard, not per process.

Grain's own handler names its file after the process (`process_<p>-of-<P>.json`), which ties a
checkpoint to the process count that wrote it. Here every process writes the state of each shard
it reads (`shard_<s>-of-<S>.json`) and reads back the shards it reads now, so with `data.shards`
fixed a run resumes on any process count that divides it. Checkpoints written in Grain's format
still restore on the process count that wrote them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath


class ShardsMismatch(ValueError):
  """The checkpoint holds the data position of other shards than this run reads."""


def _saved_as(directory: epath.Path) -> str:
  names = sorted(p.name for p in directory.glob("*.json"))
  return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "") or "nothing"


class Handler:
  """Orbax CheckpointHandler (duck-typed, as Grain's) for focaljax's _ShardsIterator."""

  def save(self, directory: epath.Path, item: Any = None, args: Any = None):
    it = item or args.item
    for s, state in zip(it.shard_ids, it.get_state()["shards"]):
      (directory / f"shard_{s}-of-{it.num_shards}.json").write_text(json.dumps(state))

  def restore(self, directory: epath.Path, item: Any = None, args: Any = None):
    it = item or args.item
    files = [directory / f"shard_{s}-of-{it.num_shards}.json" for s in it.shard_ids]
    if all(f.exists() for f in files):
      it.set_state({"shards": [json.loads(f.read_text()) for f in files]})
      return it
    legacy = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    if not any(directory.glob("shard_*")) and legacy.exists():   # Grain's per-process file
      state = json.loads(legacy.read_text())
      it.set_state(state if "shards" in state else {"shards": [state]})
      return it
    raise ShardsMismatch(f"its data position was saved as {_saved_as(directory)}, and this run "
                         f"reads shards {it.shard_ids} of {it.num_shards}")

  def structure(self, directory):  # required by the interface
    del directory

  def metadata(self, directory):
    del directory

  def finalize(self, directory):
    del directory

  def close(self):
    pass

  @classmethod
  def typestr(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


@ocp.args.register_with_handler(Handler, for_save=True)
@dataclasses.dataclass
class Save(ocp.args.CheckpointArgs):
  item: Any


@ocp.args.register_with_handler(Handler, for_restore=True)
@dataclasses.dataclass
class Restore(ocp.args.CheckpointArgs):
  item: Any
