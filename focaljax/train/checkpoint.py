"""Orbax checkpoints of the train state and the Grain data iterator.

Layout of a workdir:
  config.json          the resolved config (written once, by process 0)
  tokenizer.json       the tokenizer (travels with the checkpoint)
  checkpoints/<step>/  Orbax items: params, opt_state (StandardSave), data (Grain iterator state),
                       meta (JSON: step, tokens seen)

Resume order (trainer.py): build the abstract state and its shardings -> find the latest step ->
restore params, opt_state, and the iterator into the freshly built pipeline -> continue at step+1.
Saving is asynchronous (Orbax writes in the background; `wait()` before exit). Every process
calls save/restore (Orbax coordinates multi-host writes); metadata is written by process 0.
"""

from __future__ import annotations

import json
import os

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
ITEMS = ("params", "opt_state", "data", "meta")


def to_str_keys(tree):
  """Orbax stores dict keys as strings; nnx.List gives int keys. Stringify on the way in."""
  if isinstance(tree, dict):
    return {str(k): to_str_keys(v) for k, v in tree.items()}
  return tree


def from_str_keys(tree, like):
  if isinstance(like, dict):
    return {k: from_str_keys(tree[str(k)], v) for k, v in like.items()}
  return tree


class Checkpointer:
  """Keeps the last `keep` checkpoints under workdir/checkpoints."""

  def __init__(self, workdir: str, *, keep: int = 3, async_save: bool = True):
    self.directory = epath.Path(os.path.abspath(workdir)) / "checkpoints"  # Orbax wants absolute
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, params, opt_state, data_iter, meta: dict, *, force=False) -> bool:
    return self.manager.save(step, force=force, args=ocp.args.Composite(
        params=ocp.args.StandardSave(to_str_keys(params)),
        opt_state=ocp.args.StandardSave(opt_state),
        data=grain.checkpoint.CheckpointSave(data_iter),
        meta=ocp.args.JsonSave(meta)))

  def restore(self, step: int, abstract_params, abstract_opt_state, data_iter):
    """Restores into the given abstract (sharded ShapeDtypeStruct) trees and the iterator."""
    out = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(to_str_keys(abstract_params)),
        opt_state=ocp.args.StandardRestore(abstract_opt_state),
        data=grain.checkpoint.CheckpointRestore(data_iter),
        meta=ocp.args.JsonRestore()))
    return from_str_keys(out.params, abstract_params), out.opt_state, out.meta

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def resolve(path: str) -> tuple[str, int | None]:
  """(workdir, step) from a workdir (latest step) or a checkpoints/<step> directory."""
  path = os.path.abspath(path)
  if os.path.exists(os.path.join(path, CONFIG_FILE)):
    return path, None
  parent = os.path.dirname(path)
  if os.path.basename(parent) == "checkpoints" and os.path.basename(path).isdigit():
    return os.path.dirname(parent), int(os.path.basename(path))
  raise FileNotFoundError(f"{path} is neither a focaljax workdir (no {CONFIG_FILE}) nor a "
                          "checkpoints/<step> directory inside one")


def read_config(workdir: str):
  import ml_collections  # pylint: disable=import-outside-toplevel
  with open(os.path.join(workdir, CONFIG_FILE)) as f:
    return ml_collections.ConfigDict(json.load(f))


def write_config(workdir: str, config) -> None:
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
    f.write(config.to_json_best_effort(indent=2))


def restore_params(workdir: str, step: int | None, abstract_params):
  """Params alone (no optimizer state) into `abstract_params` (ShapeDtypeStructs with shardings);
  returns (params, step)."""
  manager = ocp.CheckpointManager(epath.Path(os.path.abspath(workdir)) / "checkpoints",
                                 item_names=ITEMS)
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint under {workdir}/checkpoints")
  out = manager.restore(step, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(to_str_keys(abstract_params))))
  manager.close()
  return from_str_keys(out.params, abstract_params), step


def abstract_like(tree, sharding=None):
  """ShapeDtypeStructs of `tree` on `sharding` (default: the first local device)."""
  sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
