"""GPU interpret-mode test helpers: the race detector's flag and a per-thread compile cache."""

import contextlib

import jax
import jax.numpy as jnp


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


