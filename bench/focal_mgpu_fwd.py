"""Forward throughput of focal_mgpu (Hopper Mosaic GPU, fused temperature) against cuDNN.

FLOPs 4·B·H·T²·D, halved when causal. Timing: jit, 2 warm-up calls, median of 10 calls each
ended by block_until_ready, fresh random inputs (MHA: Hq = Hkv = H). focal_mgpu gets a per-query
temperature [B, H, T] (its real workload); cuDNN a float scale. `err` is max|out − cudnn| /
max|cudnn| with the same scale on both (D^-1/2, a float). Tile configs that overflow shared
memory are reported as such and skipped.

  python bench/focal_mgpu_fwd.py [--dtype bfloat16|float16] [--noncausal] [--quick]   # H100/H200
  python bench/focal_mgpu_fwd.py --overlap --iters 40   # default vs overlap_softmax, alternating
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.focal import mosaic as focal_mgpu  # noqa: E402

SHAPES = [(2, 16, 4096, 128), (1, 16, 8192, 128), (1, 8, 16384, 128), (2, 12, 16384, 64)]
QUICK = [(1, 16, 8192, 128)]
B = focal_mgpu.BlockSizes
# block_q is per compute warpgroup (two per CTA: 128 query rows); the first is the D=128 default.
CONFIGS = [B(block_kv=128, max_concurrent_steps=2), B(block_kv=128, max_concurrent_steps=3),
           B(block_kv=64, max_concurrent_steps=2), B(block_kv=64, max_concurrent_steps=3),
           B(block_kv=64, max_concurrent_steps=4)]


def _time(fn, *args, iters=10, warmup=2):
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - t0)
  return statistics.median(samples)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
  ap.add_argument("--noncausal", action="store_true")
  ap.add_argument("--quick", action="store_true", help="one shape only")
  ap.add_argument("--overlap", action="store_true",
                  help="the default tiles against BlockSizes.overlap_softmax, alternating x3")
  ap.add_argument("--iters", type=int, default=10)
  args = ap.parse_args()
  dtype, causal = jnp.dtype(args.dtype), not args.noncausal
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {dtype.name}, causal={causal}")
  print(f"{'B':>2} {'H':>3} {'T':>6} {'D':>4}  {'impl':<34} {'ms':>8} {'TFLOP/s':>8} {'err':>8}")
  shapes = QUICK if args.quick else [(24, 16, 2048, 128)] + SHAPES if args.overlap else SHAPES
  for (b, h, t, d) in shapes:
    kq, kk, kv, ks = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (b, t, h, d), jnp.float32).astype(dtype)
               for key in (kq, kk, kv))
    temp = d**-0.5 * jnp.exp(0.3 * jax.random.normal(ks, (b, h, t), jnp.float32))
    flops = 4 * b * h * t * t * d / (2 if causal else 1)
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=d**-0.5, is_causal=causal, implementation="cudnn"))
    rows = [("cudnn", cudnn, (q, k, v), None)]
    configs = CONFIGS
    if args.overlap:  # the same executables re-timed in turn: machine drift shows as spread
      default = B.default(d, dtype)
      configs = [default, dataclasses.replace(default, overlap_softmax=True)] * 3
    for cfg in configs:
      name = (f"mgpu q{cfg.block_q}x2 kv{cfg.block_kv} st{cfg.max_concurrent_steps}"
              f"{' overlap' if cfg.overlap_softmax else ''}")
      fn = jax.jit(lambda q, k, v, s, cfg=cfg: focal_mgpu.focal_attention(
          q, k, v, scale=s, causal=causal, block_sizes=cfg))
      rows.append((name, fn, (q, k, v, temp), cfg))
    ref = None
    for name, fn, fn_args, cfg in rows:
      try:
        sec = _time(fn, *fn_args, iters=args.iters)
      except Exception as e:  # pylint: disable=broad-except
        msg = str(e).splitlines()[0][:60] if str(e) else type(e).__name__
        print(f"{b:>2} {h:>3} {t:>6} {d:>4}  {name:<34} skipped: {msg}")
        continue
      err = ""
      if cfg is None:
        ref = np.asarray(fn(*fn_args), np.float32)
      elif ref is not None:  # same float scale as cuDNN, so the outputs must agree
        out = np.asarray(focal_mgpu.focal_attention(q, k, v, scale=d**-0.5, causal=causal,
                                                    block_sizes=cfg), np.float32)
        err = f"{np.max(np.abs(out - ref)) / np.max(np.abs(ref)):.1e}"
      print(f"{b:>2} {h:>3} {t:>6} {d:>4}  {name:<34} {sec * 1e3:>8.3f} "
            f"{flops / sec / 1e12:>8.1f} {err:>8}", flush=True)


if __name__ == "__main__":
  main()
