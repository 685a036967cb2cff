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
  """NamedShardings for the pure param dict of `state`; ValueError naming the first parameter
  whose dimension the mesh axes it is split over do not divide."""
  axes = param_axes(state)
  shardings = jax.tree.map(lambda a: NamedSharding(mesh, spec(tuple(a), rules)), axes,
                           is_leaf=lambda x: isinstance(x, _Axes))
  values, _ = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
  for (path, value), sh in zip(values, jax.tree.leaves(shardings)):
    for dim, (size, names) in enumerate(zip(value.shape, sh.spec)):
      names = () if names is None else names if isinstance(names, tuple) else (names,)
      ways = math.prod(mesh.shape[n] for n in names)
      if size % ways:
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        raise ValueError(f"parameter {name} {tuple(value.shape)}: dimension {dim} ({size}) does "
                         f"not split over mesh axes {'x'.join(names)} ({ways} devices); pick "
                         "mesh sizes that divide the model's dimensions")
  return shardings


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


SUMMED = "summed"   # per_device: an output summed over the devices that split the inputs


def put(tree, shardings):
  """Values every process holds alike (e.g. loaded weights) as global arrays on `shardings`:
  jax.device_put cannot place data on another process's devices."""
  if jax.process_count() == 1:   # device to device, no trip through the host
    return jax.device_put(tree, shardings)

  def one(x, sh):
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sh, lambda index: host[index])
  return jax.tree.map(one, tree, shardings)


def _mesh_axes(logical: str) -> tuple[str, ...]:
  axes = spec((logical,))[0]
  return () if axes is None else axes if isinstance(axes, tuple) else (axes,)


def per_device(fn, in_axes, out_axes):
  """fn run on each device's block of its operands under the ambient mesh (jax.shard_map): a
  pallas_call has no partitioning rule, so XLA would otherwise gather every operand whole onto
  every device. Without a mesh, fn runs as is.

  in_axes: per positional operand, its logical axis names (a prefix of its dimensions), or None
  for an operand every device takes whole; None operands pass through. A logical name splits by
  its RULES mesh axes only where their devices divide every dimension that carries the name (so
  q's heads split only with k's, which keeps every query head with its KV group).
  out_axes: the outputs' logical names (one tuple for all), or a list with one entry per output,
  each a tuple or SUMMED: an output (a gain's gradient) psum'd over every mesh axis that split
  the operands.
  """
  def wrapped(*args):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      return fn(*args)
    used = [i for i, a in enumerate(args) if a is not None]
    split = {}   # logical name -> the mesh axes that split it, or None
    for i in used:
      for name, n in zip(in_axes[i] or (), args[i].shape):
        if name is not None and split.get(name, ()) is not None:
          axes = _mesh_axes(name)
          devices = math.prod(mesh.shape[a] for a in axes)
          split[name] = axes if devices > 1 and n % devices == 0 else None
    if not any(split.values()):
      return fn(*args)

    def to_spec(names):
      return P() if names is None else P(*(split.get(n) for n in names))
    reduced = tuple(a for axes in split.values() if axes for a in axes)

    def local(*xs):
      full = list(args)
      for i, x in zip(used, xs):
        full[i] = x
      out = fn(*full)
      if isinstance(out_axes, list):
        out = tuple(jax.lax.psum(o, reduced) if kind == SUMMED else o
                    for o, kind in zip(out, out_axes))
      return out
    out_specs = (tuple(P() if kind == SUMMED else to_spec(kind) for kind in out_axes)
                 if isinstance(out_axes, list) else to_spec(out_axes))
    return jax.shard_map(local, in_specs=tuple(to_spec(in_axes[i]) for i in used),
                         out_specs=out_specs, check_vma=False)(*(args[i] for i in used))
  return wrapped


def constrain(x, logical: tuple[str | None, ...]):
  """with_sharding_constraint by logical names under the ambient mesh (a no-op without one)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, spec(logical))
