"""A training step's device memory: the micro-batch that fits, a closed-form estimate, OOM errors.

A step holds the float32 params, AdamW's moments, the float32 gradients (and, when it accumulates
micro-batches, their running sum) and one micro-batch's activations. The activations are the only
part the micro-batch scales, so `fit_micro_batch` picks the largest micro-batch dividing a
device's rows whose compiled program (`compiled.memory_analysis()`, per device) fits the device.
Where nothing can compile for the target (a preset larger than the devices, a dry run on CPU),
`estimate` gives the same parts in closed form.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from typing import Callable

import jax

from focaljax import config as config_lib
from focaljax.model import decoder as model_lib

GB = 1e9
# Fits if the compiled peak stays under this share of the device's pool: XLA's allocator
# fragments, and the runtime keeps a little for itself.
FIT_SHARE = 0.97


class OutOfMemory(RuntimeError):
  """The device ran out of memory; the message is one line with the estimate and the knobs."""


def device_memory(device=None) -> int | None:
  """Bytes jax may allocate on `device` (its pool), or None where the backend does not say (CPU)."""
  stats = (device or jax.local_devices()[0]).memory_stats()
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def host_memory_per_device() -> int | None:
  """This host's physical memory over its local devices (CPU devices share it); None if unknown."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // jax.local_device_count()
  except (ValueError, OSError, AttributeError):
    return None


def compiled_bytes(compiled) -> int:
  """Peak bytes per device of a compiled program: its inputs, outputs not aliased to an input
  (donated state), and its temporaries."""
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes +
          m.temp_size_in_bytes)


def divisors_desc(n: int) -> list[int]:
  return [d for d in range(n, 0, -1) if n % d == 0]


def fit_micro_batch(rows: int, peak_at: Callable[[int], int], limit: int,
                    guess_at: Callable[[int], float]) -> tuple[int, int, int]:
  """(micro-batch, its peak bytes, compiles): the largest divisor of a device's `rows` whose
  program fits `limit` bytes; `peak_at(micro)` compiles it, `guess_at(micro)` is the closed-form
  estimate. The estimate's pick is compiled first (usually the only compile, and the program the
  run then uses); the next larger divisor is tried only if the compiled peak plus the estimate's
  extra activations still fits, and a pick that does not fit steps down."""
  cands = divisors_desc(rows)
  d = next((c for c in cands if guess_at(c) <= limit), 1)
  known = {d: peak_at(d)}
  while known[d] <= limit and d != rows:
    up = cands[cands.index(d) - 1]
    if known[d] + guess_at(up) - guess_at(d) > limit:
      break
    known[up] = peak_at(up)
    if known[up] > limit:
      break
    d = up
  while known[d] > limit and d != 1:
    d = cands[cands.index(d) + 1]
    known[d] = peak_at(d)
  return d, known[d], len(known)


def rows_per_device(abstract_batches: dict, batch_sh) -> int:
  """Rows of a global batch each device gets (its first array's leading axis, as sharded)."""
  name, leaf = next(iter(next(iter(abstract_batches.values())).items()))
  sh = batch_sh[name] if isinstance(batch_sh, dict) else batch_sh
  return sh.shard_shape(leaf.shape)[0]


def resolve_micro_batch(requested: int, rows: int, peak_at: Callable[[int], int],
                        memory: int | None, guess_at: Callable[[int], float]
                        ) -> tuple[int, int | None]:
  """(micro-batch, its compiled peak bytes or None): train.micro_batch if set (it must divide the
  device's rows; a warning if the estimate puts it past `memory`); 0: the largest that fits
  `memory`, or, where the device does not say (CPU), the whole batch."""
  limit = None if memory is None else int(FIT_SHARE * memory)
  if requested:
    if rows % requested:
      raise config_lib.ConfigError(
          f"config field train.micro_batch: {requested} must divide the {rows} rows of "
          f"data.global_batch each device gets; allowed: {divisors_desc(rows)} (0: auto)")
    # Past the limit XLA rematerialises the step until it fits, several times slower, or fails.
    need = None if limit is None else guess_at(requested)
    if need is not None and need > limit and jax.process_index() == 0:
      fits = next((c for c in divisors_desc(rows) if guess_at(c) <= limit), 1)
      print(f"warning: train.micro_batch={requested} is estimated at "
            f"{need / GB:.0f} GB per device, past the {limit / GB:.0f} GB that "
            f"fit: XLA may recompute much of the step or run out of memory; {fits} is estimated "
            "to fit (0 picks the largest that does)", file=sys.stderr)
    return requested, None
  if memory is None:
    return rows, None
  micro, peak, _ = fit_micro_batch(rows, peak_at, limit, guess_at)
  return micro, peak


def _bytes_per_device(tree) -> int:
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def report(cfg: config_lib.Config, mesh, micro: int, accum: int, compiled: dict, params,
           opt_state) -> dict:
  """The dry run's lines: per device, the state's exact bytes, each compiled step's peak, and
  the closed-form estimate; returns them by batch key."""
  shape = dict(mesh.shape)
  state = estimate(cfg, micro_batch=micro, accum=accum,
                   state_shards=shape["fsdp"] * shape["tensor"], tensor=shape["tensor"])
  p, o = _bytes_per_device(params), _bytes_per_device(opt_state)
  out = {}
  print(f"dry run on {mesh.devices.size} {jax.devices()[0].platform} device(s), mesh {shape}; "
        f"per device: params {p / GB:.2f} GB, optimizer state {o / GB:.2f} GB; micro-batch "
        f"{micro} x {accum} accumulation steps")
  for key, c in compiled.items():
    m = c.memory_analysis()
    out[key] = {"params": p, "optimizer": o, "peak": compiled_bytes(c),
                "temp": m.temp_size_in_bytes, "estimate": state.total}
    print(f"  step{'' if key is None else f' ({key})'}: compiled peak "
          f"{out[key]['peak'] / GB:.2f} GB per device (temporaries: gradients and activations "
          f"{m.temp_size_in_bytes / GB:.2f} GB)")
  print(f"  closed-form estimate: {state.line()}")
  return {"dry_run": True, "memory": out}


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Bytes per device, in closed form."""
  params: float
  optimizer: float
  gradients: float
  activations: float   # one micro-batch

  @property
  def total(self) -> float:
    return self.params + self.optimizer + self.gradients + self.activations

  def line(self) -> str:
    return (f"params (with any compute-dtype copy) {self.params / GB:.1f} GB, optimizer "
            f"{self.optimizer / GB:.1f} GB, "
            f"gradients {self.gradients / GB:.1f} GB, activations {self.activations / GB:.1f} GB "
            f"per micro-batch; total {self.total / GB:.1f} GB")


def estimate(cfg: config_lib.Config, *, micro_batch: int, accum: int, state_shards: int,
             tensor: int = 1) -> Estimate:
  """Bytes per device of cfg's step at `micro_batch` rows per device, the params and optimizer
  state split `state_shards` ways (mesh.fsdp x mesh.tensor). Activations: what the backward keeps
  per token and layer (all of a block's matmul inputs and outputs; with model.remat only its
  input), plus float32 logits and their gradient; within ~30% of XLA's for the presets."""
  m, n = cfg.model, model_lib.param_count(cfg.model)
  cb = 2 if cfg.train.compute_dtype == "bfloat16" else 4
  mu = 2 if cfg.optim.mu_dtype == "bfloat16" else 4
  tokens = micro_batch * cfg.data.seq_len
  per_layer = 2 * m.d_model if m.remat else (10 * m.d_model + 4 * m.d_ff) // tensor
  logits = 3 * 4 * max(m.vocab_size, 1) // tensor
  acts = tokens * (m.num_layers * per_layer * cb + logits)
  return Estimate(params=(4 + (cb if cb < 4 else 0)) * n / state_shards,
                  optimizer=(mu + 4) * n / state_shards,
                  gradients=(8 if accum > 1 else 4) * n / state_shards, activations=acts)


def devices_needed(cfg: config_lib.Config, memory: int) -> int | None:
  """The fewest devices (a power of two) whose FSDP shares of the state and one row's
  activations fit `memory` bytes each; None if not even 4096 do."""
  n = 1
  while n <= 4096:
    if estimate(cfg, micro_batch=1, accum=2, state_shards=n).total <= FIT_SHARE * memory:
      return n
    n *= 2
  return None


def check_fits(cfg: config_lib.Config, mesh_shape: dict, memory: int | None) -> None:
  """Refuses (ConfigError, one line) a model whose state and one row cannot fit the devices of
  `mesh_shape` however they are meshed, or as meshed; `memory` None: nothing to check."""
  if memory is None:
    return
  devices = math.prod(mesh_shape.values())
  need = devices_needed(cfg, memory)
  params = model_lib.param_count(cfg.model) / 1e9
  if need is None or need > devices:
    raise config_lib.ConfigError(
        f"a {params:.1f}B-parameter model needs at least {need or '> 4096'} devices of "
        f"{memory / GB:.0f} GB with fsdp (mesh.fsdp=-1); got {devices}")
  shards = mesh_shape["fsdp"] * mesh_shape["tensor"]
  if estimate(cfg, micro_batch=1, accum=2, state_shards=shards).total > FIT_SHARE * memory:
    raise config_lib.ConfigError(
        f"mesh {mesh_shape}: a {params:.1f}B-parameter model's state does not fit "
        f"{memory / GB:.0f} GB split {shards} ways; shard it over all {devices} devices with "
        "--config.mesh.data=1 --config.mesh.fsdp=-1")


@contextlib.contextmanager
def oom_as_error(known: dict):
  """Turns XLA's RESOURCE_EXHAUSTED into OutOfMemory: one line with what `known` holds by then
  (micro_batch, accum, peak bytes of the compiled step, device bytes) and the knobs that help."""
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    where = ""
    if "peak" in known:
      where = (f": the compiled step needs {known['peak'] / GB:.1f} GB per device"
               + (f" of {known['memory'] / GB:.1f} GB" if known.get("memory") else ""))
    batch = (f" (micro-batch {known['micro_batch']} x {known['accum']} accumulation steps)"
             if "micro_batch" in known else "")
    raise OutOfMemory(
        f"out of memory{where}{batch}; lower train.micro_batch (0 picks the largest that fits), "
        "set model.remat=True, or split the state over more devices with mesh.fsdp=-1") from None
