"""Benchmark: Pallas dilution kernels vs cuDNN softmax attention vs the XLA dilution reference.

  python bench/dilution.py --out dilution.json                  # GPU: the full table
  python bench/dilution.py --passes --out dilution_passes.json  # GPU: each pass alone
  python bench/dilution.py --smoke --out /tmp/smoke.json        # CPU: tiny shapes, interpret mode

Entries: training forward and forward+backward at (B, H, T, D) = (8,8,4K,64), (2,12,16K,64),
(1,16,8K,128); prefill at 32K/64K/128K/256K (B1 H12, --prefill-d); one decode step against a
16K and a 128K cache. `--backend` picks the dilution kernels ("mosaic": the Hopper passes where they
apply, else Triton). `--passes`: each training pass (F1, F2, B1, B2) of that backend timed alone
at (2,12,16K,64) (or the first --train-shapes), with its matmul TFLOP/s. Each entry is jitted,
warmed up, then timed as the median of --reps runs. Memory: `temp_MiB` is XLA's compiled scratch
for that function; `peak_MiB` the device's process-lifetime peak after the entry (monotonic: read
it as "at most"). Every entry is wrapped in try/except (OOM, unsupported) and reported as an error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position
import pallas_kernels.dilution as dilution
from pallas_kernels.dilution import api as dilution_api
from pallas_kernels.dilution import blocks
from pallas_kernels.dilution import mosaic_b1
from pallas_kernels.dilution import mosaic_b2
from pallas_kernels.dilution import mosaic_fwd
from pallas_kernels.dilution import reference as dilution_reference
from pallas_kernels.dilution import triton_bwd
from pallas_kernels.dilution import triton_fwd

TRAIN_SHAPES = [(8, 8, 4096, 64), (2, 12, 16384, 64), (1, 16, 8192, 128)]
PREFILL_T = [32768, 65536, 131072, 262144]
DECODE_S = [16384, 131072]
EPS = 1e-9
SMOKE_BLOCKS = dilution.BlockSizes(block_q_stats=16, block_k_stats=16, block_q=16, block_k=32,
                                   block_k_fwd=32, b1_block_k=32, ckpt_rows=64,
                                   block_k_decode=16, split_k_decode=64)
# Dense [tile x tile] matmuls per (row tile, key block) pair, each B·H·T²·D FLOPs over the causal
# triangle (the kernels' docstrings).
MATMULS = {"F1": 2, "F2": 2, "B1": 6, "B2": 2}


def _time(fn, args, reps):
  """(median seconds, compiled temp bytes) of a jitted fn."""
  compiled = jax.jit(fn).lower(*args).compile()
  try:
    temp = compiled.memory_analysis().temp_size_in_bytes
  except Exception:  # pylint: disable=broad-except
    temp = None
  jax.block_until_ready(compiled(*args))  # warm-up (autotuning, allocation)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), temp


def _peak():
  try:
    return jax.devices()[0].memory_stats()["peak_bytes_in_use"]
  except Exception:  # pylint: disable=broad-except
    return None


def _qkv(B, H, T, D, dtype, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  return tuple(jax.random.normal(kk, (B, T, H, D), dtype) for kk in ks)


def _attn_fn(impl, scale, backend, bs, interpret):
  if impl == "dilution":
    return lambda q, k, v: dilution.dilution_attention(q, k, v, scale=scale, eps=EPS,
                                                       backend=backend, block_sizes=bs,
                                                       interpret=interpret)
  if impl == "xla":
    return lambda q, k, v: dilution_reference.dilution_attention(q, k, v, scale=scale)[0]
  if impl == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                        implementation="cudnn")
  raise ValueError(impl)


def _fwd_bwd(fn):
  return jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), (0, 1, 2))


def _entry(rows, kind, impl, shape, thunk, **extra):
  row = dict(kind=kind, impl=impl, shape=shape, **extra)
  try:
    sec, temp = thunk()
    row.update(ms=1e3 * sec, temp_MiB=None if temp is None else temp / 2**20)
  except Exception as e:  # pylint: disable=broad-except
    row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    if os.environ.get("BENCH_TRACEBACK"):
      traceback.print_exc()
  peak = _peak()
  row["peak_MiB"] = None if peak is None else peak / 2**20
  rows.append(row)
  ms = f"{row['ms']:10.3f}" if "ms" in row else f"{'-':>10}"
  tmp = f"{row['temp_MiB']:10.1f}" if row.get("temp_MiB") is not None else f"{'-':>10}"
  pk = f"{row['peak_MiB']:10.1f}" if row.get("peak_MiB") is not None else f"{'-':>10}"
  print(f"{kind:<9} {impl:<9} {str(shape):<26} {ms} {tmp} {pk}  {row.get('error', '')}",
        flush=True)


def _passes(shape, dtype, reps, backend, bs, interpret):
  """Each training pass of `backend` alone, on inputs from a real forward (so B1 sees true
  carries): where the forward+backward's time goes. Rows kind="pass", impl = the pass."""
  B, H, T, D = shape
  q, k, v = _qkv(B, H, T, D, dtype)
  seg = jnp.zeros((B, T), jnp.int32)
  scale = D**-0.5
  mosaic = blocks.runs_mosaic(backend, D, dtype)
  out, (lse, _, ssum, _, ckpt) = dilution_api._forward(q, k, v, seg, scale, EPS, bs, mosaic,
                                                       interpret, training=True)
  do = jax.random.normal(jax.random.PRNGKey(9), q.shape, jnp.float32)
  dbar = jnp.einsum("BTND,BTND->BNT", do, out)
  do = do.astype(dtype)
  kw = dict(scale=scale, interpret=interpret)
  if mosaic:
    f1 = lambda q, k: mosaic_fwd.row_stats(q, k, seg, with_pk=True, **kw)
    f2 = lambda q, k, v, lse: mosaic_fwd.key_sweep(
        q, k, v, seg, lse, eps=EPS, ckpt_rows=bs.ckpt_rows, with_ckpt=True,
        key_tiles=bs.f2_key_tiles, chain=bs.chain_pieces, **kw)
    b1 = lambda *a: mosaic_b1.reverse_sweep(*a, eps=EPS, ckpt_rows=bs.ckpt_rows,
                                            chain=bs.chain_pieces, **kw)
    b2 = lambda q, k, lse, ghat: mosaic_b2.dk_correction(q, k, seg, lse, ghat, **kw)
  else:
    f1 = lambda q, k: triton_fwd.row_stats(q, k, seg, with_pk=True, bs=bs, **kw)
    f2 = lambda q, k, v, lse: triton_fwd.key_sweep(q, k, v, seg, lse, eps=EPS, bs=bs,
                                                   with_ckpt=True, **kw)
    b1 = lambda *a: triton_bwd.reverse_sweep(*a, eps=EPS, bs=bs, **kw)
    b2 = lambda q, k, lse, ghat: triton_bwd.dk_correction(q, k, seg, lse, ghat, bs=bs, **kw)
  b1_args = (q, k, v, seg, lse, ssum, dbar, do, ckpt)
  ghat = b1(*b1_args)[1]
  rows = []
  for name, fn, args in (("F1", f1, (q, k)), ("F2", f2, (q, k, v, lse)), ("B1", b1, b1_args),
                         ("B2", b2, (q, k, lse, ghat))):
    _entry(rows, "pass", name, shape, lambda fn=fn, args=args: _time(fn, args, reps),
           backend="mosaic" if mosaic else "triton")
    if "ms" in rows[-1]:
      tflop = MATMULS[name] * B * H * T * T * D / 1e12
      rows[-1].update(matmul_TFLOP=tflop, TFLOP_per_s=tflop / rows[-1]["ms"] * 1e3)
      print(f"          {name}: {MATMULS[name]} matmuls per tile pair, {tflop:.3f} TFLOP, "
            f"{rows[-1]['TFLOP_per_s']:.0f} TFLOP/s")
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=None, help="write the rows as JSON here")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny shapes in interpret mode (CPU; Triton unless --backend is given: the "
                  "Mosaic GPU interpreter takes minutes)")
  ap.add_argument("--reps", type=int, default=10, help="timed runs per entry (median)")
  ap.add_argument("--backend", default=None, choices=dilution.BACKENDS,
                  help="the dilution kernels (default: mosaic, Triton where it does not apply)")
  ap.add_argument("--impls", default="dilution,cudnn,xla",
                  help="comma list for the training entries: dilution, cudnn, xla")
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  ap.add_argument("--passes", action="store_true",
                  help="only each training pass alone (F1, F2, B1, B2) at (2,12,16K,64)")
  ap.add_argument("--train-shapes", default=None,
                  help="comma list of BxHxTxD training shapes (default: the three standard ones)")
  ap.add_argument("--prefill-d", type=int, default=64, help="head dim of the prefill entries")
  ap.add_argument("--skip", default="", help="comma list of sections to skip: train,prefill,decode")
  args = ap.parse_args(argv)

  dtype = jnp.dtype(args.dtype)
  impls = [i for i in args.impls.split(",") if i]
  skip = set(args.skip.split(","))
  interpret = args.smoke
  backend = args.backend or ("triton" if args.smoke else "mosaic")
  train_shapes, prefill_t, decode_s, reps = TRAIN_SHAPES, PREFILL_T, DECODE_S, args.reps
  if args.train_shapes:
    train_shapes = [tuple(int(x) for x in s.split("x")) for s in args.train_shapes.split(",")]
    if any(len(s) != 4 for s in train_shapes):
      raise ValueError(f"--train-shapes: want BxHxTxD items, got {args.train_shapes!r}")
  passes_shape = train_shapes[0] if args.train_shapes else TRAIN_SHAPES[1]
  if args.smoke:
    train_shapes, prefill_t, decode_s = [(1, 2, 128, 64)], [128], [256]
    passes_shape = train_shapes[0]
    impls = [i for i in impls if i != "cudnn"]
    reps = min(reps, 2)
  bs = SMOKE_BLOCKS if args.smoke else None   # None: default_block_sizes(backend, D, dtype)
  dev = jax.devices()[0]
  meta = dict(device=dev.device_kind, jax=jax.__version__, dtype=dtype.name, backend=backend,
              interpret=interpret, reps=reps)
  print(" ".join(f"{k}={v}" for k, v in meta.items()))
  print(f"{'kind':<9} {'impl':<9} {'(B, H, T, D)':<26} {'ms':>10} {'temp_MiB':>10} "
        f"{'peak_MiB':>10}")
  rows = []

  if args.passes:
    pass_bs = bs or dilution.default_block_sizes(backend, passes_shape[3], dtype)
    rows += _passes(passes_shape, dtype, reps, backend, pass_bs, interpret)
    skip |= {"train", "prefill", "decode"}

  if "train" not in skip:
    for B, H, T, D in train_shapes:
      q, k, v = _qkv(B, H, T, D, dtype)
      for impl in impls:
        fn = _attn_fn(impl, D**-0.5, backend, bs, interpret)
        _entry(rows, "fwd", impl, (B, H, T, D), lambda fn=fn: _time(fn, (q, k, v), reps))
        _entry(rows, "fwd+bwd", impl, (B, H, T, D),
               lambda fn=fn: _time(_fwd_bwd(fn), (q, k, v), reps))
      del q, k, v

  if "prefill" not in skip:
    D = args.prefill_d
    for T in prefill_t:
      q, k, v = _qkv(1, 12, T, D, dtype)
      fn = lambda q, k, v: dilution.dilution_prefill(q, k, v, scale=D**-0.5, eps=EPS,
                                                     backend=backend, block_sizes=bs,
                                                     interpret=interpret)
      _entry(rows, "prefill", "dilution", (1, 12, T, D), lambda: _time(fn, (q, k, v), reps))
      if "cudnn" in impls:
        _entry(rows, "prefill", "cudnn", (1, 12, T, D),
               lambda: _time(_attn_fn("cudnn", D**-0.5, None, None, False), (q, k, v), reps))
      del q, k, v

  if "decode" not in skip:
    B, H, D = 1, 12, 64
    for S in decode_s:
      kc, vc, _ = _qkv(B, H, S, D, dtype, seed=1)
      q = jax.random.normal(jax.random.PRNGKey(2), (B, H, D), dtype)
      demand = jax.random.uniform(jax.random.PRNGKey(3), (B, H, S), jnp.float32)
      length = jnp.array([S - 7], jnp.int32)
      fns = {"dilution": lambda *a: dilution.dilution_decode_step(
                 *a, scale=0.125, eps=EPS, block_sizes=bs, interpret=interpret),
             "xla": lambda *a: dilution_reference.dilution_decode_step(*a, scale=0.125)}
      for impl, fn in fns.items():
        _entry(rows, "decode", impl, (B, H, S, D),
               lambda fn=fn: _time(fn, (q, kc, vc, demand, length), reps))

  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {args.out}")
  return rows


if __name__ == "__main__":
  main()
