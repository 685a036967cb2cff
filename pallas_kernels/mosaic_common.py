"""Mosaic GPU helpers shared by the Hopper kernels: jax 0.10.2 / 0.11.2 shims and CPU fallbacks.

GPU interpret mode cannot run wgmma with a transposed or register operand, `pl.run_state`,
`plgpu.layout_cast` or a laid-out iota on 0.10.2: with `interpret` the helpers below replace
exactly those with jnp on the same SMEM refs (read when the wgmma is issued, so a missing barrier
wait still shows up); copies, barriers and loops are interpreted as written.
"""

from __future__ import annotations

import inspect

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

# 2 compute warpgroups + 1 producer at 168 registers a thread: 2·256·240 + 128·24 = 384·168.
COMPUTE_REGISTERS = 240
PRODUCER_REGISTERS = 24

# 0.11.2 gives `idx` a default (api.NotSpecified) and warns when it is passed.
_LOAD_IDX = inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_NEEDS_IDX = _LOAD_IDX is not None and _LOAD_IDX.default is inspect.Parameter.empty


def interpret_params():
  """GPU-interpret parameters: NaN-filled fresh buffers and the race detector on (0.10.2 has the
  class only in a private module, imported lazily)."""
  cls = getattr(plgpu, "InterpretGPUParams", None)
  if cls is None:
    from jax._src.pallas.mosaic_gpu.interpret import params  # lazy: private module
    cls = params.InterpretGPUParams
  return cls(detect_races=True, uninitialized_memory="nan")


def launch_params(interpret: bool):
  """(interpret flag for the kernel bodies, plgpu.kernel's `interpret`)."""
  return bool(interpret), (interpret_params() if interpret else None)


def tile_smem(shape, dtype):
  """SMEM for a 16-bit wgmma operand: (8, 64) tiles, 128-byte swizzle."""
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                              plgpu.SwizzleTransform(128)))


def bcast(x, shape, dim: int):
  """A vector along dimension `dim` of `shape` (e.g. a per-key row vector over a tile)."""
  return lax.broadcast_in_dim(x, shape, [dim])


def drain(free_bar, total, steps: int):
  """The producer awaits the last releases of its `steps`-slot ring (every phase observed)."""
  @pl.loop(jnp.maximum(total - steps, 0), total)
  def _(st):
    plgpu.barrier_wait(free_bar.at[lax.rem(st, steps)])


def load(ref, *, layout, interpret: bool):
  """Whole-ref SMEM load into `layout`."""
  if interpret:
    return ref[...]
  if _LOAD_NEEDS_IDX:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def layout_cast(x, layout, *, interpret: bool):
  return x if interpret else plgpu.layout_cast(x, layout)


def iota(dtype, shape, dim: int, layout, *, interpret: bool):
  if interpret:
    return lax.broadcasted_iota(dtype, shape, dim)
  return plgpu.broadcasted_iota(dtype, shape, dim, layout=layout)


def is_ref(x) -> bool:
  """True for a kernel ref (plain or `.at`/`.transpose`-transformed), False for a value."""
  from jax._src.state import types  # lazy: private module, only needed when interpreting
  return isinstance(x, types.TransformedRef) or isinstance(jax.typeof(x), types.AbstractRef)


def _dot(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def mma(a, b_ref, *, acc=None, transpose_b: bool = False, during=None, interpret: bool):
  """f32 acc + a @ b (one warpgroup's wgmma); a: SMEM ref or WGMMA-layout registers; b_ref: SMEM
  [K, N] ([N, K] with transpose_b); acc None is zeros. `during()` runs between issue and wait."""
  if interpret:
    a_val = a[...] if is_ref(a) else a
    b_val = b_ref[...]
    out = _dot(a_val, b_val.T if transpose_b else b_val)
    if during is not None:
      during()
    return out if acc is None else acc + out
  b_op = b_ref.transpose((1, 0)) if transpose_b else b_ref

  def body(acc_ref):
    plgpu.wgmma(acc_ref, a, b_op)
    if during is not None:
      during()

  if acc is None:
    m = a.shape[0]
    n = b_op.shape[1]

    def scoped(acc_ref):
      body(acc_ref)
      return acc_ref[...]

    return pl.run_scoped(scoped, plgpu.ACC((m, n), jnp.float32))
  return pl.run_state(body)(plgpu.ACC.init(acc))


def mma_pair(first, second, *, during=None, interpret: bool):
  """Two wgmmas issued together, awaited once; first, second: (a, b_ref, acc, transpose_b)."""
  if interpret:
    out = tuple(mma(a, b, acc=acc, transpose_b=tb, interpret=True)
                for a, b, acc, tb in (first, second))
    if during is not None:
      during()
    return out
  ops, inits = [], []
  for a, b_ref, acc, transpose_b in (first, second):
    b_op = b_ref.transpose((1, 0)) if transpose_b else b_ref
    if acc is None:
      acc = layout_cast(jnp.zeros((a.shape[0], b_op.shape[1]), jnp.float32),
                        plgpu.Layout.WGMMA, interpret=False)
    ops.append((a, b_op))
    inits.append(plgpu.ACC.init(acc))

  def body(acc_refs):
    for acc_ref, (a, b_op) in zip(acc_refs, ops):
      plgpu.wgmma(acc_ref, a, b_op)
    if during is not None:
      during()

  return tuple(pl.run_state(body)(tuple(inits)))


def mma_t(a_ref, b_ref, *, acc=None, transpose_b: bool = False, interpret: bool):
  """As `mma` with the SMEM operand a_ref [K, M] read transposed: acc + a_refᵀ @ b."""
  if interpret:
    b_val = b_ref[...]
    out = _dot(a_ref[...].T, b_val.T if transpose_b else b_val)
    return out if acc is None else acc + out
  return mma(a_ref.transpose((1, 0)), b_ref, acc=acc, transpose_b=transpose_b, interpret=False)


def mma_t_sum(pairs, *, interpret: bool):
  """Σ a_refᵀ @ b_ref over SMEM `pairs` in one scoped accumulator (run_scoped, not run_state)."""
  if interpret:
    return sum(_dot(a_ref[...].T, b_ref[...]) for a_ref, b_ref in pairs)
  return _wgmma_sum([(a_ref.transpose((1, 0)), b_ref) for a_ref, b_ref in pairs],
                    (pairs[0][0].shape[1], pairs[0][1].shape[1]))


def _wgmma_sum(operands, shape):
  """Σ a @ b over wgmma operands into one scoped f32 accumulator of `shape`."""
  def scoped(acc_ref):
    for a, b in operands:
      plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]

  return pl.run_scoped(scoped, plgpu.ACC(shape, jnp.float32))


def mma_sum(a_list, b_ref, *, interpret: bool):
  """Σ a @ b_ref over register operands, one scoped accumulator awaited once."""
  if interpret:
    return sum(_dot(a, b_ref[...]) for a in a_list)
  return _wgmma_sum([(a, b_ref) for a in a_list], (a_list[0].shape[0], b_ref.shape[1]))


def copy_smem_to_gmem_add(src, dst, *, interpret: bool):
  """dst += src by TMA reduce-add (atomic per element). The interpreters lack it: there it is a
  plain copy, and callers give each writer its own slab and sum them afterwards."""
  if interpret:
    plgpu.copy_smem_to_gmem(src, dst)
  else:
    plgpu.copy_smem_to_gmem(src, dst, reduction_op="add")


def ref_kernel(body, *, out_type, scratch_types, grid, grid_names, num_threads, thread_name,
               compiler_params, interpret, name):
  """`plgpu.kernel` without custom_vmap, which rejects mutable GMEM Ref operands on 0.10.2."""
  mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=num_threads,
                    thread_name=thread_name)

  def kernel_body(*refs):
    pl.run_scoped(lambda *scratch: body(*refs, *scratch), *scratch_types,
                  collective_axes=thread_name)

  return pl.kernel(kernel_body, out_type=out_type, mesh=mesh, compiler_params=compiler_params,
                   interpret=interpret, name=name)


def with_optional_ref(kernel, name: str, *, at: int, present: bool):
  """Adapts `kernel(*refs, name=ref or None)` to flat refs with an optional ref at `at`."""
  def body(*refs, **kwargs):
    if not present:
      return kernel(*refs, **{name: None}, **kwargs)
    return kernel(*refs[:at], *refs[at + 1:], **{name: refs[at]}, **kwargs)
  return body


def with_segments(kernel, *, n_in: int, n_seg_scratch: int, segments: bool):
  """Adapts `kernel(..., seg=...)` to flat refs with optional segment ids and scratch."""
  def body(*refs):
    if not segments:
      return kernel(*refs, seg=None)
    rest = refs[n_in:]
    cut = len(rest) - n_seg_scratch
    return kernel(*refs[:n_in - 1], *rest[:cut], seg=(refs[n_in - 1], *rest[cut:]))
  return body
