"""The device mesh, the logical-axis rules table, and the shardings derived from them.

Every parameter carries logical axis names (`axes` metadata, set in model.py); activations are
constrained at block boundaries with the same vocabulary. `RULES` is the only place that maps a
logical name to mesh axes; a name missing from it is an error, never silently replicated.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axis (or tuple of axes, or None = replicated)
RULES: tuple[tuple[str, object], ...] = (
    ("batch", ("data", "fsdp")),   # activations: every data-like axis splits the batch
    ("seq", None),
    ("embed_act", None),           # the residual stream stays whole per device
    ("vocab", "tensor"),
    ("embed", "fsdp"),             # FSDP shards parameters along d_model
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
)


def make_mesh(data: int, fsdp: int, tensor: int, devices=None) -> jax.sharding.Mesh:
  """A (data, fsdp, tensor) mesh; one size may be -1 (filled from the device count)."""
  devices = jax.devices() if devices is None else devices
  sizes = [data, fsdp, tensor]
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh: at most one of data/fsdp/tensor may be -1; got {sizes}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"mesh: {len(devices)} devices are not divisible by {known}")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(f"mesh: data*fsdp*tensor = {math.prod(sizes)} but there are "
                     f"{len(devices)} devices (set one of mesh.data/fsdp/tensor to -1)")
  arr = np.asarray(devices).reshape(sizes)
  return jax.sharding.Mesh(arr, MESH_AXES)


def spec(logical: tuple[str | None, ...], rules=RULES) -> P:
  table = dict(rules)
  out = []
  for name in logical:
    if name is None:
      out.append(None)
      continue
    if name not in table:
      raise KeyError(f"logical axis {name!r} has no rule in focaljax.sharding.RULES")
    out.append(table[name])
  return P(*out)


def param_axes(state: nnx.State):
  """Pure dict of logical axis tuples, same structure as `nnx.to_pure_dict(state)`."""
  return nnx.to_pure_dict(jax.tree.map(
      lambda v: _axes(v), state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def _axes(v: nnx.Variable):
  axes = v.get_metadata().get("axes")
  if axes is None:
    raise ValueError(f"parameter of shape {v.shape} has no logical axes")
  return _Axes(axes)


class _Axes(tuple):
  """A tuple that jax.tree treats as a leaf (unregistered tuple subclasses are leaves)."""


def param_shardings(state: nnx.State, mesh, rules=RULES):
  """NamedShardings for the pure param dict of `state`."""
  axes = param_axes(state)
  return jax.tree.map(lambda a: NamedSharding(mesh, spec(tuple(a), rules)), axes,
                      is_leaf=lambda x: isinstance(x, _Axes))


def opt_state_shardings(tx, params, param_sh, mesh):
  """Shardings for `tx.init(params)`'s state: a leaf shaped like a parameter, at a path that ends
  in that parameter's path (Adam's mu and nu, ...), takes the parameter's sharding; the rest
  (step counts, scalars) is replicated. Left to XLA, `jit(tx.init)` replicated the moments
  (zeros_like does not read its input): every device held them whole, in float32, under FSDP
  and tensor parallelism alike, and every step gathered the sharded updates to match."""
  flat_params, _ = jax.tree_util.tree_flatten_with_path(params)
  by_path = {tuple(path): (leaf.shape, sh)
             for (path, leaf), sh in zip(flat_params, jax.tree.leaves(param_sh))}
  replicated = NamedSharding(mesh, P())

  def pick(path, leaf):
    for start in range(len(path)):  # the longest matching suffix
      shape, sh = by_path.get(tuple(path[start:]), (None, None))
      if shape == leaf.shape:
        return sh
    return replicated

  return jax.tree_util.tree_map_with_path(pick, jax.eval_shape(tx.init, params))


def batch_sharding(mesh) -> NamedSharding:
  return NamedSharding(mesh, spec(("batch", "seq")))


def dividing_axes(mesh, logical: str, size: int) -> tuple[str, ...] | None:
  """The mesh axes RULES give `logical`, if they split it (more than one device) and their
  devices divide `size`; else None: the dimension stays whole. For shard_map'd kernels."""
  axes = spec((logical,))[0]
  if axes is None:
    return None
  axes = axes if isinstance(axes, tuple) else (axes,)
  n = math.prod(mesh.shape[a] for a in axes)
  return axes if n > 1 and size % n == 0 else None


def dividing_spec(mesh, logical: tuple[str | None, ...], shape) -> P:
  """The PartitionSpec that splits each dimension of `shape` by its logical name's mesh axes
  where they divide it (`dividing_axes`), else keeps it whole. For shard_map'd kernels."""
  return P(*(None if name is None else dividing_axes(mesh, name, n)
             for name, n in zip(logical, shape)))


def constrain(x, logical: tuple[str | None, ...]):
  """with_sharding_constraint by logical names under the ambient mesh (a no-op without one)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, spec(logical))
