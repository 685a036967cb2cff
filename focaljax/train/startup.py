"""What happens before a run's first step: the compile cache, and whether the input keeps up.

  enable_compile_cache   jax's persistent compilation cache, on unless the user configured it
  probe                  the input pipeline's batches/s alone, measured on a few batches at start
  Pace                   compares it with the steps/s the device runs, and says if input lags
  first_step_line        the time to the first step: data, compile (init beside it), its call
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterator

import jax

# Compiles shorter than this are not cached: a small model's step compiles in well under jax's
# default of one second, and a cache hit still saves it.
MIN_COMPILE_SECS = 0.2
PROBE_BATCHES = 3     # timed after the first, whose latency is start-up, not throughput


def cache_dir() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "focaljax", "jax_cache")


def enable_compile_cache() -> str:
  """Turns on jax's persistent compilation cache (returns its directory): a rerun or resume of
  the same config loads its step instead of compiling it. A directory the user set
  ($JAX_COMPILATION_CACHE_DIR or jax.config) is kept, and so is their minimum compile time."""
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir())
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
  return jax.config.jax_compilation_cache_dir


def probe(make_batches: Callable[[int], Iterator], start: int, data_iter,
          n: int = PROBE_BATCHES) -> tuple[Iterator, float, float | None]:
  """(the batches from `start` on, seconds to the first, batches/s of the next `n`). The probed
  batches are not consumed: the checkpointed iterator `data_iter` is set back to where it was.
  Without one (batches a function of the step, built by the task) nothing is probed."""
  if data_iter is None:
    return make_batches(start), 0.0, None
  state = data_iter.get_state()
  batches = make_batches(start)
  t0 = time.perf_counter()
  next(batches)
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  for _ in range(n):
    next(batches)
  rate = n / max(time.perf_counter() - t0, 1e-9)
  data_iter.set_state(state)
  return batches, first, rate


class Pace:
  """Steps/s the device runs, from the host's clock between fetched steps less the time spent
  waiting for input, measured once over `window` steps after the first (compiling) one."""

  def __init__(self, input_rate: float | None, first_step: int, window: int = 5):
    self.input_rate, self.window = input_rate, window
    self.begin, self.t0, self.waited = first_step + 1, None, 0.0
    self.done = input_rate is None   # nothing probed: nothing to compare

  def add_wait(self, seconds: float):
    if self.t0 is not None:
      self.waited += seconds

  def fetched(self, step: int) -> str | None:
    """At each step whose metrics the host read: a one-line warning once, if input lags."""
    if self.done or step < self.begin:
      return None
    if self.t0 is None:
      self.t0 = time.perf_counter()
      return None
    if step < self.begin + self.window:
      return None
    self.done = True
    busy = max(time.perf_counter() - self.t0 - self.waited, 1e-9)
    need = self.window / busy
    if self.input_rate >= need:
      return None
    return (f"warning: the input pipeline makes {self.input_rate:.2f} batches/s alone, below the "
            f"{need:.2f} steps/s the device runs: tokenize ahead (data.tokenize=ahead, with "
            "data.token_cache to keep it) or give Grain more workers")


def first_step_line(t_setup: float, seconds: dict, first_batch: float, compile_s: float,
                    started: float, call_s: float, micro: int, rows: int) -> str:
  """The time from `t_setup` until the first step started (both perf_counters): data (the
  task's set-up and the first batch), compile, the init that ran beside the compile, with the
  micro-batch chosen; then how long its call took (the batch's transfer and the step's run,
  which the host may wait for: training, not start-up)."""
  cache = jax.config.jax_compilation_cache_dir
  return (f"first step started after {started - t_setup:.1f} s: data "
          f"{seconds.get('data', 0) + first_batch:.1f} s, compile {compile_s:.1f} s (init "
          f"{seconds.get('init', 0):.1f} s beside it; micro-batch {micro} x {rows // micro} "
          f"accumulation steps per device; compile cache {cache or 'off'}); its call returned "
          f"{call_s:.1f} s later")
