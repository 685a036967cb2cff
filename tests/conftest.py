"""Shared test set-up: the repo root on sys.path (configs/ is a package there), quiet logs."""

import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# XLA's CPU client runs computations and host callbacks on a pool of one thread per core (2 in
# CI). GPU interpret mode runs a Mosaic kernel from a host callback that holds one worker while
# each simulated Pallas thread (2-3 warpgroups) runs its own computation and waits at barriers
# for the others: with 2 workers a barrier wait and the callback can hold both while another
# thread waits for one, a deadlock. Measured on this 2-core machine (the F2 over 2 key tiles
# interpreted inside the jitted op): 2 of 6 runs hung at the default, 0 of 6 with PJRT_NPROC=3,
# every run with PJRT_NPROC=1. That is the hang seen on 2-core CI hosts. The
# pool must exceed 1 + the simulated threads per kernel; PJRT_NPROC sizes it (read when the
# client starts, so before any test touches a device).
os.environ.setdefault("PJRT_NPROC", "8")
# One persistent XLA compilation cache for the whole run -- xdist workers and the train.py /
# eval.py subprocesses inherit it -- since many tests compile the same small programs again
# (a resumed run, its uninterrupted twin): test_train.py 106 s -> 64 s from a cold cache on 2
# cores. Keys hold the jax version, backend and flags, so a stale entry only misses.
# JAX_COMPILATION_CACHE_DIR= (empty) turns it off.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "focaljax-tests-jax-cache"))
# On a CPU-only machine the suite's time is mostly XLA:CPU compiling small programs, which run
# for milliseconds: LLVM at -O0 compiles them 15-30% faster from a cold cache (measured on 2
# cores: tests/model/test_model.py 136 -> 103 s, an interpreted Mosaic kernel 30 -> 26 s) at no
# visible cost to the run. Kept off where a GPU is present (its compiled tests).
if shutil.which("nvidia-smi") is None and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()
