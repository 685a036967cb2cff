"""Benchmark: FocusLLM condensing kernels (pallas_kernels/condense/api.py) vs their einsum specs.

  python bench/condense.py --out condense_bench.json            # GPU: the full table
  python bench/condense.py --sweep --out condense_sweep.json    # GPU: tile variants (pallas only)
  python bench/condense.py --smoke --out /tmp/smoke.json        # CPU: tiny shapes, interpret mode

Entries (bf16 unless --dtype): candidate attention at R=64 chunk rows, S=2048 cached keys, Q=1
(a generation step) and Q=16 (training's query points), N=16 query / K=4 kv heads, D=64, each
candidate seeing the keys before its position and itself: `fwd`, `fwd+bwd` as in training (the
cache closed over: dq, d self_k, d self_v) and `fwd+bwd+dkv` (the cache differentiated too).
Local attention at R=16 rows, T=512 local tokens, C=64 candidates, same heads: `fwd` and `fwd+bwd`
(all five inputs). Each entry is jitted, warmed up, then timed as the median of --reps runs with
block_until_ready; temp_MiB is XLA's compiled scratch for the function. Errors (OOM, unsupported)
are reported per entry, not raised.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels.condense import api as condense  # pylint: disable=wrong-import-position
from pallas_kernels.condense import reference as condense_ref  # noqa: E402

CAND = dict(R=64, S=2048, N=16, K=4, D=64)
CAND_Q = (1, 16)
LOCAL = dict(R=16, T=512, C=64, N=16, K=4, D=64)
SMOKE_CAND, SMOKE_LOCAL = dict(R=2, S=64, N=4, K=2, D=16), dict(R=2, T=32, C=5, N=4, K=2, D=16)
SMOKE_BLOCKS = condense.BlockSizes(block_k=16, split_k=32, block_q=16, block_kv=16,
                                   block_q_dkv=16, block_kv_dkv=16, block_q_dq=16, block_kv_dq=16)
# --sweep: (candidate split_k, block_k) and (local block_q, block_kv) variants.
SWEEP_CAND = list(itertools.product((128, 256, 512, 1024), (32, 64, 128)))
SWEEP_LOCAL = [(64, 64), (128, 64), (64, 32), (128, 128), (32, 32)]


def _time(fn, args, reps):
  """(median seconds, compiled temp bytes) of a jitted fn."""
  compiled = jax.jit(fn).lower(*args).compile()
  try:
    temp = compiled.memory_analysis().temp_size_in_bytes
  except Exception:  # pylint: disable=broad-except
    temp = None
  jax.block_until_ready(compiled(*args))  # warm-up
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), temp


def _grad(fn, argnums):
  return jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums)


def _candidate_inputs(R, Q, S, N, K, D, dtype):
  ks = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(ks[0], (R, Q, N, D), dtype)
  k, v = (jax.random.normal(kk, (R, S, K, D), dtype) for kk in ks[1:3])
  sk, sv = (jax.random.normal(kk, (R, Q, K, D), dtype) for kk in ks[3:5])
  # Candidate q sits after the cache's first S - Q + q keys (target_nll's query points).
  vlen = jnp.broadcast_to(S - Q + jnp.arange(Q, dtype=jnp.int32), (R, Q))
  return q, k, v, sk, sv, vlen


def _local_inputs(R, T, C, N, K, D, dtype):
  ks = jax.random.split(jax.random.key(1), 5)
  q = jax.random.normal(ks[0], (R, T, N, D), dtype)
  k, v = (jax.random.normal(kk, (R, T, K, D), dtype) for kk in ks[1:3])
  ck, cv = (jax.random.normal(kk, (R, C, K, D), dtype) for kk in ks[3:5])
  return q, k, v, ck, cv


def _candidate_fn(impl, interpret, bs):
  if impl == "xla":
    return lambda q, k, v, sk, sv, vl: condense_ref.candidate_attention_reference(
        q, k, v, vl, sk, sv, scale=0.125)
  return lambda q, k, v, sk, sv, vl: condense.candidate_attention(
      q, k, v, vl, sk, sv, scale=0.125, interpret=interpret, block_sizes=bs)


def _local_fn(impl, interpret, bs):
  if impl == "xla":
    return lambda *a: condense_ref.local_attention_reference(*a, scale=0.125)
  return lambda *a: condense.local_attention(*a, scale=0.125, interpret=interpret, block_sizes=bs)


def _entry(rows, kind, impl, shape, thunk):
  row = dict(kind=kind, impl=impl, shape=shape)
  try:
    sec, temp = thunk()
    row.update(ms=1e3 * sec, temp_MiB=None if temp is None else temp / 2**20)
  except Exception as e:  # pylint: disable=broad-except
    row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    if os.environ.get("BENCH_TRACEBACK"):
      traceback.print_exc()
  rows.append(row)
  ms = f"{row['ms']:10.3f}" if "ms" in row else f"{'-':>10}"
  tmp = f"{row['temp_MiB']:10.1f}" if row.get("temp_MiB") is not None else f"{'-':>10}"
  print(f"{kind:<22} {impl:<28} {shape:<34} {ms} {tmp}  {row.get('error', '')}", flush=True)


def _candidate_entries(rows, impls, shape, Q, dtype, reps, interpret, bs):
  args = _candidate_inputs(Q=Q, dtype=dtype, **shape)
  name = f"R{shape['R']} Q{Q} S{shape['S']} N{shape['N']} K{shape['K']} D{shape['D']}"
  for impl in impls:
    fn = _candidate_fn(impl, interpret, bs)
    label = impl if impl == "xla" or bs is None else f"pallas {bs.split_k}/{bs.block_k}"
    _entry(rows, "candidate fwd", label, name, lambda: _time(fn, args, reps))
    _entry(rows, "candidate fwd+bwd", label, name,
           lambda: _time(_grad(fn, (0, 3, 4)), args, reps))
    _entry(rows, "candidate fwd+bwd+dkv", label, name,
           lambda: _time(_grad(fn, (0, 1, 2, 3, 4)), args, reps))


def _local_entries(rows, impls, shape, dtype, reps, interpret, bs):
  args = _local_inputs(dtype=dtype, **shape)
  name = " ".join(f"{k}{v}" for k, v in shape.items())
  for impl in impls:
    fn = _local_fn(impl, interpret, bs)
    label = impl if impl == "xla" or bs is None else f"pallas {bs.block_q}/{bs.block_kv}"
    _entry(rows, "local fwd", label, name, lambda: _time(fn, args, reps))
    _entry(rows, "local fwd+bwd", label, name,
           lambda: _time(_grad(fn, (0, 1, 2, 3, 4)), args, reps))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=None, help="write the rows as JSON here")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
  ap.add_argument("--sweep", action="store_true", help="time tile variants of the kernels only")
  ap.add_argument("--reps", type=int, default=20, help="timed runs per entry (median)")
  ap.add_argument("--impls", default="pallas,xla", help="comma list: pallas, xla")
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  args = ap.parse_args(argv)

  dtype = jnp.dtype(args.dtype)
  impls = [i for i in args.impls.split(",") if i]
  interpret = args.smoke or jax.default_backend() != "gpu"
  cand, local, reps = CAND, LOCAL, args.reps
  bs = None
  if args.smoke:
    cand, local, reps, bs = SMOKE_CAND, SMOKE_LOCAL, min(reps, 2), SMOKE_BLOCKS
  print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} "
        f"jax={jax.__version__} dtype={dtype.name} interpret={interpret}")
  print(f"{'kind':<22} {'impl':<28} {'shape':<34} {'ms':>10} {'temp_MiB':>10}")
  rows = []
  if args.sweep:
    for split_k, block_k in ([(32, 16)] if args.smoke else SWEEP_CAND):
      b = condense.BlockSizes(split_k=split_k, block_k=block_k)
      for Q in CAND_Q:
        _candidate_entries(rows, ["pallas"], cand, Q, dtype, reps, interpret, b)
    for block_q, block_kv in ([(16, 16)] if args.smoke else SWEEP_LOCAL):
      b = condense.BlockSizes(block_q=block_q, block_kv=block_kv, block_q_dq=block_q,
                              block_kv_dq=block_kv, block_q_dkv=block_kv, block_kv_dkv=block_q)
      _local_entries(rows, ["pallas"], local, dtype, reps, interpret, b)
  else:
    for Q in CAND_Q:
      _candidate_entries(rows, impls, cand, Q, dtype, reps, interpret, bs)
    _local_entries(rows, impls, local, dtype, reps, interpret, bs)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                 "jax": jax.__version__, "dtype": dtype.name, "rows": rows}, f, indent=2)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
  main()
