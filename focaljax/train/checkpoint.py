"""Orbax checkpoints of the trained state and the data iterator.

Layout of a workdir:
  config.json          the config of the latest run (written by process 0; read through
                       focaljax.train.saved_config.read)
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

Integrity: meta records a checksum of every params and opt_state array (`checksums`: a weighted
sum of the array's bits, computed on device from the arrays being saved, so a save moves a few
bytes per array to the host, not the model). `Checkpointer.restore_latest` verifies it and falls
back, one warning line each, past any step that fails to restore or to match (a truncated or
missing file, a deleted item, garbage meta, flipped bytes); such a step is moved aside to
checkpoints/<step>.corrupt, never deleted. With no intact step it raises CorruptCheckpoint and
moves nothing.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from focaljax.data import state as data_state


CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
ITEMS = ("params", "opt_state", "data", "meta")
CORRUPT_SUFFIX = ".corrupt"


class CorruptCheckpoint(ValueError):
  """No checkpoint of a workdir restores intact; the message lists what was wrong with each."""


def _fingerprint(x):
  """sum(bits_i * w_i) mod 2**32 with odd weights w_i: any change of one element changes it."""
  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  else:
    bits = jax.lax.bitcast_convert_type(
        x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]).astype(jnp.uint32)
  bits = bits.ravel()
  w = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435762) + jnp.uint32(1)
  return jnp.sum(bits * w, dtype=jnp.uint32)


_fingerprints = jax.jit(lambda tree: jax.tree.map(_fingerprint, tree))


def checksums(tree) -> dict[str, str]:
  """{array path: hex checksum} of a pytree of arrays (jax or numpy)."""
  fps = _fingerprints(tree)
  flat = jax.tree_util.tree_flatten_with_path(fps)[0]
  # Scalars come back replicated: this process's shard holds the value (also multi-host).
  return {jax.tree_util.keystr(path): f"{int(np.asarray(fp.addressable_shards[0].data)):08x}"
          for path, fp in flat}


def param_checksums(workdir: str, step: int) -> dict[str, str]:
  """The checksums training recorded for a step's params ({} for a params-only checkpoint)."""
  try:
    meta = read_meta(workdir, step)[0]
  except KeyError:
    return {}
  return meta.get("checksums", {}).get("params", {}) if isinstance(meta, dict) else {}


def verify_param(want: dict[str, str], keys: tuple[str, ...], array, where: str) -> None:
  """CorruptCheckpoint unless `array`, the params leaf at `keys`, matches its checksum in `want`
  (param_checksums); for readers that load one array at a time (the HF export)."""
  name = "".join(f"[{k!r}]" for k in keys)
  if name in want and f"{int(_fingerprints(array)):08x}" != want[name]:
    raise CorruptCheckpoint(f"{where}: params{name} does not match its checksum; export an "
                            "earlier step (checkpoints/<step>)")


def _verify(meta, **trees) -> None:
  """ValueError naming the first array of `trees` (item name -> tree) that does not match the
  checksum meta records for it."""
  if not isinstance(meta, dict):
    raise ValueError(f"meta is {type(meta).__name__}, not a JSON object")
  want = meta.get("checksums")
  if want is None:   # written before checksums existed
    return
  for item, tree in trees.items():
    have = checksums(tree)
    bad = [k for k in have if want.get(item, {}).get(k) != have[k]]
    if bad:
      raise ValueError(f"{item}{bad[0]} does not match its checksum"
                       + (f" (and {len(bad) - 1} more arrays)" if len(bad) > 1 else ""))


def _quiet_failed_reads() -> None:
  """A failed restore leaves Orbax's other reads of the step to fail whenever they are collected,
  and TensorStore's still-running reads to wake an event loop Orbax has already closed; their
  errors are the damage already reported, not tracebacks for the user. From now on the
  unraisable hook drops exactly those, and asyncio's log its "Task exception was never
  retrieved" for those reads (a collected task logs it); anything else passes on."""
  unraisable_hook = sys.unraisablehook
  if getattr(unraisable_hook, "_drops_failed_reads", False):
    return

  def closed_loop(kind, value, tb) -> bool:
    while tb is not None and tb.tb_next is not None:
      tb = tb.tb_next
    return (kind is RuntimeError and str(value) == "Event loop is closed" and tb is not None
            and tb.tb_frame.f_code.co_name == "_check_closed")

  def drop_unraisable(u):
    if not (getattr(u.object, "__qualname__", "") == "_read_array_index_and_device_put"
            or closed_loop(u.exc_type, u.exc_value, u.exc_traceback)):
      unraisable_hook(u)

  drop_unraisable._drops_failed_reads = True
  sys.unraisablehook = drop_unraisable
  def keep_record(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not ("never retrieved" in message and "_read_array_index_and_device_put" in message)

  logging.getLogger("asyncio").addFilter(keep_record)


# Orbax's words for a restore into another parameter tree or shape.
_OTHER_MODEL = re.compile(r"tree structures do not match|not compatible with the stored shape")


def _describe(e: BaseException) -> str:
  """The root cause's first line: Orbax wraps the storage error in a page of TensorStore spec."""
  while (e.__cause__ or e.__context__) is not None:
    e = e.__cause__ or e.__context__
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return f"{type(e).__name__}: {lines[0] if lines else ''}"[:240]


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
  directory = _path(workdir) / "checkpoints"   # Orbax wants absolute
  return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(**options),
                               item_names=ITEMS)


class Checkpointer:
  """Keeps the last `keep` checkpoints under workdir/checkpoints (None: all)."""

  def __init__(self, workdir: str, *, keep: int | None = 3, async_save: bool = True):
    self.manager = _manager(workdir, max_to_keep=keep, create=True,
                            enable_async_checkpointing=async_save)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, params, opt_state, data_iter, meta: dict) -> bool:
    """`data_iter`: a Grain iterator saved with the state, or None (batches a function of the
    step); opt_state None: not saved. meta gains the saved arrays' checksums."""
    trees = {"params": to_str_keys(params), "opt_state": opt_state}
    trees = {item: tree for item, tree in trees.items() if tree is not None}
    meta = {**meta, "checksums": {item: checksums(tree) for item, tree in trees.items()}}
    items = {item: ocp.args.StandardSave(tree) for item, tree in trees.items()}
    items["meta"] = ocp.args.JsonSave(meta)
    if data_iter is not None:
      items["data"] = data_state.Save(data_iter)
    return self.manager.save(step, force=True, args=ocp.args.Composite(**items))

  def restore(self, step: int, abstract_params, abstract_opt_state, data_iter):
    """(params, opt_state, meta) restored into the given abstract (sharded ShapeDtypeStruct)
    trees, and the iterator (unless None) in place."""
    items = dict(params=ocp.args.StandardRestore(to_str_keys(abstract_params)),
                 opt_state=ocp.args.StandardRestore(abstract_opt_state),
                 meta=ocp.args.JsonRestore())
    if data_iter is not None:
      items["data"] = data_state.Restore(data_iter)
    _quiet_failed_reads()   # before the first read: a closed loop can be woken at once
    out = self.manager.restore(step, args=ocp.args.Composite(**items))
    return from_str_keys(out.params, abstract_params), out.opt_state, out.meta

  def restore_latest(self, abstract_params, abstract_opt_state, data_iter, warn=None):
    """(step, params, opt_state, meta) of the newest checkpoint that restores and matches its
    checksums; (0, None, None, None) when there is none. Each newer bad step is moved aside
    with one `warn` line; when every step is bad, CorruptCheckpoint (and nothing is moved)."""
    warn = warn or (lambda line: print(f"warning: {line}", file=sys.stderr))
    root = epath.Path(self.manager.directory)
    bad = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        params, opt_state, meta = self.restore(step, abstract_params, abstract_opt_state,
                                               data_iter)
        _verify(meta, params=to_str_keys(params), opt_state=opt_state)
      except Exception as e:  # pylint: disable=broad-except  (any failure: fall back)
        bad.append((step, _describe(e)))
        gc.collect()   # the failed step's other reads, collected here while quieted
        continue
      # Moved aside, not deleted: the next save of that step must not collide with it.
      for b, why in bad:
        aside, n = root / f"{b}{CORRUPT_SUFFIX}", 1
        while aside.exists():   # damaged twice at one step: keep both
          aside, n = root / f"{b}{CORRUPT_SUFFIX}.{n + 1}", n + 1
        if jax.process_index() == 0 and (root / str(b)).exists():
          (root / str(b)).rename(aside)
        warn(f"checkpoint step {b} is damaged ({why}); kept as {aside}; resuming from step {step}")
      if bad:
        if jax.process_count() > 1:   # every host lists steps after process 0 has moved them
          from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
          multihost_utils.sync_global_devices("focaljax_corrupt_moved")
        self.manager.reload()
      return step, params, opt_state, meta
    if bad and all(_OTHER_MODEL.search(why) for _, why in bad):   # not damage: another model
      raise CorruptCheckpoint(f"the checkpoints under {root} hold another model than this "
                              f"config's ({bad[0][1].split('. ')[0]}): a field that shapes the "
                              "parameters differs from the run's; resume with the config it "
                              "trained with (its config.json), or train in another --workdir")
    if [b for b, _ in bad] == [0]:   # training never saves step 0: an import's params
      raise CorruptCheckpoint(f"{root}/{bad[0][0]} holds parameters alone (an import), nothing "
                              "to resume: fine-tune them in another --workdir with --config "
                              f"configs/finetune.py:{root.parent}")
    if bad and all(why.startswith(data_state.ShardsMismatch.__name__) for _, why in bad):
      raise CorruptCheckpoint(f"checkpoint step {bad[0][0]} under {root} does not resume here: "
                              f"{bad[0][1].split(': ', 1)[1]}; set data.shards to the count it "
                              "was saved with (any multiple of the process count)")
    if bad:
      raise CorruptCheckpoint(f"no intact checkpoint under {root}: "
                              + "; ".join(f"step {b} ({why})" for b, why in bad)
                              + "; nothing was changed: repair or remove them, or train in "
                              "another --workdir")
    return 0, None, None, None

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def absolute(path) -> str:
  """A local path made absolute; a URL (gs://bucket/run) as given."""
  return str(path) if "://" in str(path) else os.path.abspath(path)


def _path(path) -> epath.Path:
  return epath.Path(absolute(path))


def resolve(path: str) -> tuple[str, int | None]:
  """(workdir, step) from a workdir (latest step) or a checkpoints/<step> directory."""
  path = _path(path)
  if (path / CONFIG_FILE).exists():
    return str(path), None
  if path.parent.name == "checkpoints" and path.name.isdigit():
    return str(path.parent.parent), step_dir(path)
  raise FileNotFoundError(f"{path} is neither a focaljax workdir (no {CONFIG_FILE}) nor a "
                          "checkpoints/<step> directory inside one")


def step_dir(path) -> int:
  """The step of a checkpoints/<step> directory; FileNotFoundError listing the saved steps when
  it does not exist."""
  path = _path(path)
  if not path.is_dir():
    steps = sorted(int(d.name) for d in path.parent.iterdir() if d.name.isdigit()) \
        if path.parent.is_dir() else []
    raise FileNotFoundError(f"{path}: no checkpoint at step {path.name}; saved steps: "
                            f"{', '.join(map(str, steps)) or 'none'}")
  return int(path.name)


def latest_step(workdir: str) -> int | None:
  """The newest saved step under workdir/checkpoints (None: none), without opening Orbax."""
  root = epath.Path(workdir) / "checkpoints"
  steps = [int(d.name) for d in root.iterdir() if d.name.isdigit()] if root.is_dir() else []
  return max(steps, default=None)


def write_config(workdir: str, config) -> None:
  """`config`: the JSON text (focaljax.config.Config.config_json) or a ConfigDict."""
  workdir = epath.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / CONFIG_FILE).write_text(
      config if isinstance(config, str) else config.to_json_best_effort(indent=2))


def _restore(workdir: str, step: int | None, **items):
  manager = _manager(workdir)
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint under {workdir}/checkpoints")
  _quiet_failed_reads()
  try:
    out = manager.restore(step, args=ocp.args.Composite(**items))
  except KeyError:
    if set(items) == {"meta"}:   # read_meta: a params-only checkpoint has none
      raise
    raise CorruptCheckpoint(f"{workdir}/checkpoints/{step} holds no {'/'.join(items)}; evaluate "
                            "an earlier step (checkpoints/<step>)") from None
  except Exception as e:  # pylint: disable=broad-except  (Orbax's and TensorStore's many kinds)
    raise CorruptCheckpoint(f"{workdir}/checkpoints/{step} does not restore ({_describe(e)}); "
                            "evaluate an earlier step (checkpoints/<step>)") from None
  finally:
    manager.close()
  return out, step


def restore_params(workdir: str, step: int | None, abstract_params):
  """Params alone (no optimizer state) into `abstract_params` (ShapeDtypeStructs with shardings);
  returns (params, step)."""
  out, step = _restore(workdir, step,
                       params=ocp.args.StandardRestore(to_str_keys(abstract_params)))
  try:
    meta = read_meta(workdir, step)[0]
  except KeyError:   # a params-only checkpoint: nothing to check against
    meta = {}
  try:   # evaluation and export read only what training verified
    if isinstance(meta, dict) and meta.get("checksums", {}).get("params"):
      _verify(meta, params=out.params)
  except ValueError as e:
    raise CorruptCheckpoint(f"{workdir}/checkpoints/{step}: {e}; evaluate an earlier step "
                            "(checkpoints/<step>)") from None
  return from_str_keys(out.params, abstract_params), step


def save_params(workdir: str, step: int, params, meta: dict, opt_state=None) -> None:
  """One checkpoint written outside training: params, meta and, when given, the optimizer state
  (a converted or copy-initialised FocusLLM adapter)."""
  ckpt = Checkpointer(workdir, keep=None, async_save=False)
  ckpt.save(step, params, opt_state, None, meta)
  ckpt.close()


def read_meta(workdir: str, step: int | None) -> tuple[dict, int]:
  """(the meta item, step) of a checkpoint (default: the latest)."""
  out, step = _restore(workdir, step, meta=ocp.args.JsonRestore())
  return out.meta, step


def abstract_like(tree, sharding=None):
  """ShapeDtypeStructs of `tree` on `sharding` (default: the first local device)."""
  sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
