"""Shared test set-up: the repo root on sys.path (configs/ is a package there), quiet logs."""

import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# One persistent XLA compilation cache for the whole run -- xdist workers and the train.py /
# eval.py subprocesses inherit it -- since many tests compile the same small programs again
# (a resumed run, its uninterrupted twin): test_train.py 106 s -> 64 s from a cold cache on 2
# cores. Keys hold the jax version, backend and flags, so a stale entry only misses.
# JAX_COMPILATION_CACHE_DIR= (empty) turns it off.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "focaljax-tests-jax-cache"))
