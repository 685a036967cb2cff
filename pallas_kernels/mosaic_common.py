"""Mosaic GPU helpers shared by the Hopper kernels: jax-version shims and GPU-interpret fallbacks.

Two jax versions must run the same kernel source: 0.10.2 (CI, CPU) and 0.11.2 (GPU).
What differs for the APIs we call, checked against both sources:
  * `plgpu.load(ref, idx, layout=...)`: 0.10.2 requires `idx`; 0.11.2 deprecates it (the ref is
    indexed with `.at` first). `load` below picks the spelling the installed version wants.
  * `plgpu.transpose_ref(ref, perm)` is deprecated in 0.11.2; `ref.transpose(perm)` works in both
    (0.10.2's transpose_ref is that call), so kernels use the method directly and need no shim.

GPU interpret mode (`InterpretGPUParams`, CPU) simulates threads, SMEM, TMA copies and barriers
(with race detection), but on 0.10.2 it cannot run: wgmma with a transposed operand (no transform
but indexing), wgmma with a register operand, `pl.run_state`, `plgpu.layout_cast` or
`plgpu.broadcasted_iota(layout=...)` (no CPU lowering). The helpers below take `interpret` and
replace exactly those with plain jnp on the same SMEM refs; everything else (copies, barriers,
loops, masks, softmax) is interpreted as written. The matmul fallbacks read their SMEM operands
when the wgmma is issued, the earliest point the hardware may read them, so a missing barrier
wait still shows up as a race or a wrong answer.

Kernel helpers: `tile_smem` (the wgmma operand layout), `bcast`, `drain` (the producer's last
waits) and `launch_params` (interpret flag and parameters).
Test helpers: `cached_interpreter_threads` (compile each simulated thread once, ~5x faster
interpret tests) and `interpret_races_found` (the race detector's flag).

The focal and dilution Mosaic kernels both import this module: keep every name they use.
"""

from __future__ import annotations

import contextlib
import inspect

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

# Register split of CTAs with 2 compute warpgroups + 1 TMA producer (384 threads, launched at 168
# registers each): `set_max_registers` hands the producer's to the consumers,
# 2·256·240 + 128·24 = 384·168 (FlashAttention-3's split). 240 / 24 spills less than 232 / 40 in
# the focal dk/dv kernel at D = 128; the producers do not spill at 24.
COMPUTE_REGISTERS = 240
PRODUCER_REGISTERS = 24

# 0.11.2 gives `idx` a default (api.NotSpecified) and warns when it is passed.
_LOAD_IDX = inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_NEEDS_IDX = _LOAD_IDX is not None and _LOAD_IDX.default is inspect.Parameter.empty


def interpret_params(detect_races: bool = True):
  """GPU-interpret parameters: NaN-filled fresh buffers (an unwritten output shows up as NaN)
  and the happens-before race detector on. 0.11 exports the class from plgpu; 0.10.2 only has
  the private module (imported lazily, so compiled use never depends on it)."""
  return _interpret_params_class()(detect_races=detect_races, uninitialized_memory="nan")


def _interpret_params_class():
  cls = getattr(plgpu, "InterpretGPUParams", None)
  if cls is None:
    from jax._src.pallas.mosaic_gpu.interpret import params  # lazy: private module
    cls = params.InterpretGPUParams
  return cls


def launch_params(interpret):
  """(interpret flag for the kernel bodies, what plgpu.kernel gets as `interpret`): a bool, or
  an InterpretGPUParams passed through."""
  if interpret and not isinstance(interpret, bool) and isinstance(interpret,
                                                                 _interpret_params_class()):
    return True, interpret
  return bool(interpret), (interpret_params() if interpret else None)


def tile_smem(shape, dtype):
  """SMEM for a 16-bit wgmma operand: (8, 64) tiles with a 128-byte swizzle over 64-element
  rows, the layout wgmma reads without bank conflicts."""
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                              plgpu.SwizzleTransform(128)))


def bcast(x, shape, dim: int):
  """A vector along dimension `dim` of `shape` (e.g. a per-key row vector over a tile)."""
  return lax.broadcast_in_dim(x, shape, [dim])


def drain(free_bar, total, steps: int):
  """The producer awaits the consumers' last releases of its `steps`-slot ring, so that it has
  observed every phase of every slot barrier when the kernel ends (the interpreter checks this;
  on hardware it costs one wait per slot at the very end)."""
  @pl.loop(jnp.maximum(total - steps, 0), total)
  def _(st):
    plgpu.barrier_wait(free_bar.at[lax.rem(st, steps)])


def load(ref, *, layout, interpret: bool):
  """Whole-ref SMEM load into `layout` (e.g. a row vector in Layout.WGMMA.reduce(1))."""
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
  """float32 acc + a @ b on the tensor cores (one warpgroup's wgmma).

  a: an SMEM ref or a register array (Layout.WGMMA, 16-bit); b_ref: an SMEM ref [K, N], or [N, K]
  read transposed with transpose_b. acc: None (zeros) or a float32 Layout.WGMMA array.
  `during()` runs after the wgmma is issued and before its result is awaited: the place to
  overlap barrier traffic with the matmul.
  """
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
  """Two independent wgmmas issued together and awaited once: (acc1 + a1 @ b1, acc2 + a2 @ b2).

  first, second: (a, b_ref, acc, transpose_b) with the meanings of `mma` (acc None = zeros).
  One run_state over both accumulators (jax's attention_mgpu dk/dv kernel does the same for dV
  and dPᵀ): the second matmul is queued behind the first instead of waiting for it.
  `during()`, as in `mma`, runs after both are issued and before they are awaited.
  """
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


def interpret_races_found() -> bool:
  """Whether the last GPU-interpreted kernel tripped the race detector (it prints the racing
  accesses; this is the flag tests assert on). Private jax state, 0.10.2 layout."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # lazy: private module
  return bool(gpu_callbacks.get_races().races_found)


@contextlib.contextmanager
def cached_interpreter_threads():
  """Test speed-up for GPU interpret mode: compile each simulated thread's program once.

  0.10.2's thread_map re-traces, lowers and XLA-compiles the per-thread program for every grid
  point and thread (a fresh jit per call), ~1 s each; caching the executable per (jaxpr, argument
  types) makes a T=256 attention forward ~5x faster. Semantics are unchanged: the same jaxpr runs
  on the same arguments. A no-op where the private hook is missing.
  """
  try:
    from jax._src.pallas.mosaic.interpret import thread_map  # lazy: private module
  except ImportError:
    yield
    return
  original = getattr(thread_map, "_run_jaxpr", None)
  if original is None:
    yield
    return
  cache = {}

  def run_jaxpr(jaxpr, consts, *args):
    key = (jaxpr, tuple((jnp.shape(a), jnp.result_type(a)) for a in args))
    exe = cache.get(key)
    if exe is None:
      def run(consts, *args):
        jax.core.eval_jaxpr(jaxpr, consts, *args)
      exe = cache[key] = jax.jit(run).trace(consts, *args).lower().compile()
    exe(consts, *args)

  thread_map._run_jaxpr = run_jaxpr
  try:
    yield
  finally:
    thread_map._run_jaxpr = original


def mma_t(a_ref, b_ref, *, acc=None, transpose_b: bool = False, interpret: bool):
  """As `mma` with the SMEM operand a_ref [K, M] read transposed: acc + a_refᵀ @ b.

  wgmma takes a transposed 16-bit lhs from SMEM in 0.10.2 and 0.11.2 alike (`lhs_transpose` in
  both lowerings); the interpreter cannot read through a transposed ref, hence the jnp fallback.
  """
  if interpret:
    b_val = b_ref[...]
    out = _dot(a_ref[...].T, b_val.T if transpose_b else b_val)
    return out if acc is None else acc + out
  return mma(a_ref.transpose((1, 0)), b_ref, acc=acc, transpose_b=transpose_b, interpret=False)


def mma_t_sum(pairs, *, interpret: bool):
  """Σ a_refᵀ @ b_ref over `pairs` of SMEM refs, the wgmmas issued into one scoped accumulator
  and awaited once (the joint dQ's sum over both warpgroups' dS tiles).

  Why not `mma_t(..., acc=...)` in a loop: its `pl.run_state` returns its closed-over values,
  and 0.11.2's lowering rejects a static index of a ref view (`ds_s.at[buf, 1]`) coming back as
  a literal ("Shaped arrays must be represented by ir.Values, got: TypedInt(1)").
  `pl.run_scoped` returns only what its body returns.
  """
  if interpret:
    return sum(_dot(a_ref[...].T, b_ref[...]) for a_ref, b_ref in pairs)
  return _wgmma_sum([(a_ref.transpose((1, 0)), b_ref) for a_ref, b_ref in pairs],
                    (pairs[0][0].shape[1], pairs[0][1].shape[1]))


def _wgmma_sum(operands, shape):
  """Σ a @ b over (a, b) wgmma operands, issued into one scoped float32 accumulator of `shape`
  and awaited once."""
  def scoped(acc_ref):
    for a, b in operands:
      plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]

  return pl.run_scoped(scoped, plgpu.ACC(shape, jnp.float32))


def mma_sum(a_list, b_ref, *, interpret: bool):
  """Σ a @ b_ref over register operands a (Layout.WGMMA, 16-bit) in that order, the wgmmas
  issued into one scoped accumulator and awaited once, where a loop of `mma(..., acc=)` waits
  after each (the in-tile mask products over bf16 pieces: dilution's mosaic_b1.mask_dot)."""
  if interpret:
    return sum(_dot(a, b_ref[...]) for a in a_list)
  return _wgmma_sum([(a, b_ref) for a in a_list], (a_list[0].shape[0], b_ref.shape[1]))


def copy_smem_to_gmem_add(src, dst, *, interpret: bool):
  """dst += src through a TMA reduce-add (cp.reduce.async.bulk.tensor .add, float32 atomic per
  element in L2, so concurrent CTAs may add into the same rows); awaited like any SMEM->GMEM copy.

  0.10.2 and 0.11.2 both accept `copy_smem_to_gmem(..., reduction_op="add")` in compiled kernels,
  but both GPU interpreters raise NotImplementedError for it: interpreted, this is a plain copy, so
  the caller gives every writer its own zero-initialised destination and sums them afterwards.
  """
  if interpret:
    plgpu.copy_smem_to_gmem(src, dst)
  else:
    plgpu.copy_smem_to_gmem(src, dst, reduction_op="add")


def ref_kernel(body, *, out_type, scratch_types, grid, grid_names, num_threads, thread_name,
               compiler_params, interpret, name):
  """`plgpu.kernel` for bodies that also take mutable Refs
  (`jax.new_ref(x, memory_space=plgpu.GMEM)`) among their operands, updated in place (aliased in
  and out). plgpu.kernel wraps itself in custom_vmap, which rejects Ref operands on 0.10.2
  ("JaxprInputEffect ... does not have a corresponding jaxpr input"); this is its body without
  the vmap rule (so no batching), over the same `pl.kernel` both versions use underneath.
  Operand refs, then output refs, then `scratch_types` reach `body` in that order.
  """
  mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=num_threads,
                    thread_name=thread_name)

  def kernel_body(*refs):
    pl.run_scoped(lambda *scratch: body(*refs, *scratch), *scratch_types,
                  collective_axes=thread_name)

  return pl.kernel(kernel_body, out_type=out_type, mesh=mesh, compiler_params=compiler_params,
                   interpret=interpret, name=name)


def with_optional_ref(kernel, name: str, *, at: int, present: bool):
  """Adapts `kernel(*refs, name=ref or None)` to flat refs where an optional output sits at
  position `at` (after the operands and the outputs before it) only when `present`."""
  def body(*refs, **kwargs):
    if not present:
      return kernel(*refs, **{name: None}, **kwargs)
    return kernel(*refs[:at], *refs[at + 1:], **{name: refs[at]}, **kwargs)
  return body


def with_segments(kernel, *, n_in: int, n_seg_scratch: int, segments: bool):
  """Adapts `kernel(*operands, *outputs, *scratch, seg=...)` to plgpu.kernel's flat refs when an
  optional segment-id operand is passed last among the `n_in` operands and its `n_seg_scratch`
  buffers last among the scratch: seg = (ids GMEM ref, *those SMEM refs), or None without
  segments (the kernel then traces no segment code at all)."""
  def body(*refs):
    if not segments:
      return kernel(*refs, seg=None)
    rest = refs[n_in:]
    cut = len(rest) - n_seg_scratch
    return kernel(*refs[:n_in - 1], *rest[:cut], seg=(refs[n_in - 1], *rest[cut:]))
  return body
