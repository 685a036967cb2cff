"""Orbax checkpoints of the trained state and the data iterator.

Layout of a workdir:
  config.json          the config of the latest run (written by process 0; read through
                       focaljax.config.read_run_config)
  metrics.jsonl        one JSON line per logged step (train/metrics.py)
  tokenizer.json       the language model's tokenizer (travels with the checkpoint)
  checkpoints/<step>/  Orbax items: params (the trained parameters: the model's, or a FocusLLM
                       adapter's), opt_state, data (the Grain iterator, where there is one), meta
                       (JSON: the step and what the task records, e.g. the adapter's FocusConfig)

Resume (train/loop.py): refuse a config whose model differs in shape (workdir.SHAPE_FIELDS), before
anything is written -> build the state and its shardings -> find the latest step -> restore
params, opt_state and the iterator into them -> cut metrics.jsonl back to that step -> continue at
step+1. Only a step whose loss, gradient norm and parameters are finite is ever saved. Saving is
asynchronous unless train.async_ckpt is off; every process calls save/restore (Orbax coordinates
multi-host writes).
"""

from __future__ import annotations

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


def _manager(workdir: str, **options) -> ocp.CheckpointManager:
  directory = epath.Path(os.path.abspath(workdir)) / "checkpoints"   # Orbax wants absolute
  return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(**options),
                               item_names=ITEMS)


class Checkpointer:
  """Keeps the last `keep` checkpoints under workdir/checkpoints."""

  def __init__(self, workdir: str, *, keep: int = 3, async_save: bool = True):
    self.manager = _manager(workdir, max_to_keep=keep, create=True,
                            enable_async_checkpointing=async_save)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, params, opt_state, data_iter, meta: dict) -> bool:
    """`data_iter`: a Grain iterator saved with the state, or None (batches a function of the
    step)."""
    items = dict(params=ocp.args.StandardSave(to_str_keys(params)),
                 opt_state=ocp.args.StandardSave(opt_state), meta=ocp.args.JsonSave(meta))
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    return self.manager.save(step, force=True, args=ocp.args.Composite(**items))

  def restore(self, step: int, abstract_params, abstract_opt_state, data_iter):
    """(params, opt_state, meta) restored into the given abstract (sharded ShapeDtypeStruct)
    trees, and the iterator (unless None) in place."""
    items = dict(params=ocp.args.StandardRestore(to_str_keys(abstract_params)),
                 opt_state=ocp.args.StandardRestore(abstract_opt_state),
                 meta=ocp.args.JsonRestore())
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    out = self.manager.restore(step, args=ocp.args.Composite(**items))
    return from_str_keys(out.params, abstract_params), out.opt_state, out.meta

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


def latest_step(workdir: str) -> int | None:
  """The newest saved step under workdir/checkpoints (None: none), without opening Orbax."""
  root = os.path.join(workdir, "checkpoints")
  steps = [int(d) for d in os.listdir(root) if d.isdigit()] if os.path.isdir(root) else []
  return max(steps, default=None)


def write_config(workdir: str, config) -> None:
  """`config`: the JSON text (focaljax.config.Config.config_json) or a ConfigDict."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
    f.write(config if isinstance(config, str) else config.to_json_best_effort(indent=2))


def _restore(workdir: str, step: int | None, **items):
  manager = _manager(workdir)
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint under {workdir}/checkpoints")
  out = manager.restore(step, args=ocp.args.Composite(**items))
  manager.close()
  return out, step


def restore_params(workdir: str, step: int | None, abstract_params):
  """Params alone (no optimizer state) into `abstract_params` (ShapeDtypeStructs with shardings);
  returns (params, step)."""
  out, step = _restore(workdir, step,
                       params=ocp.args.StandardRestore(to_str_keys(abstract_params)))
  return from_str_keys(out.params, abstract_params), step


def save_params(workdir: str, step: int, params, meta: dict, opt_state=None) -> None:
  """One checkpoint written outside training: params, meta and, when given, the optimizer state
  (a converted or copy-initialised FocusLLM adapter)."""
  items = dict(params=ocp.args.StandardSave(to_str_keys(params)), meta=ocp.args.JsonSave(meta))
  if opt_state is not None:
    items["opt_state"] = ocp.args.StandardSave(opt_state)
  manager = _manager(workdir, create=True)
  manager.save(step, args=ocp.args.Composite(**items))
  manager.wait_until_finished()
  manager.close()


def read_meta(workdir: str, step: int | None) -> tuple[dict, int]:
  """(the meta item, step) of a checkpoint (default: the latest)."""
  out, step = _restore(workdir, step, meta=ocp.args.JsonRestore())
  return out.meta, step


def abstract_like(tree, sharding=None):
  """ShapeDtypeStructs of `tree` on `sharding` (default: the first local device)."""
  sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
