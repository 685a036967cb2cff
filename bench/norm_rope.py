"""QK-norm + RoPE Pallas passes alone: time and bandwidth per tile shape, against XLA's passes.

  python bench/norm_rope.py [--shapes 49152,16,128 65536,8,128] [--out norm_rope.json]
  python bench/norm_rope.py --smoke     # CPU, interpret mode, one tiny shape

Rows R = B·T tokens, N heads, D head dim, bf16 (the 1.3B step at 24 × 2048 is 49152,16,128; the
400M at 32 × 2048 is 65536,8,128). For each (block_rows, num_warps) it times
`norm_rope_fwd` and `norm_rope_bwd` and prints the bytes each pass must move over its time:
forward reads x and the cos/sin tables and writes y; backward reads x, g and the tables and
writes dx. The XLA row is `norm_rope_reference` and autodiff of it. Timing: one jitted call runs
the pass on --copies distinct inputs (a kernel timed alone in its own call measures as much
dispatch and sync as kernel), 2 warm-up calls, median of --iters, divided by --copies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.glue import norm_rope as nr  # noqa: E402

TILES = [(32, 4), (16, 4), (64, 4), (32, 8), (64, 8), (16, 2)]


def _median_ms(fn, *args, iters):
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


def _inputs(R, N, D, copies):
  ks = jax.random.split(jax.random.key(0), 2 * copies + 1)
  xs = [jax.random.normal(k, (R, N, D), jnp.bfloat16) for k in ks[:copies]]
  gs = [jax.random.normal(k, (R, N, D), jnp.bfloat16) for k in ks[copies:-1]]
  angle = jax.random.uniform(ks[-1], (R, D // 2)) * 100
  return xs, jnp.ones((D,), jnp.float32), jnp.cos(angle), jnp.sin(angle), gs


def _batched(one):
  """One jit over every copy: distinct inputs, so XLA cannot merge the calls."""
  return jax.jit(lambda s, *arrays: [one(*a, s) for a in zip(*arrays)])


def run(shape, tiles, iters, copies, interpret):
  R, N, D = shape
  xs, s, c, sn, gs = _inputs(R, N, D, copies)
  rows, table = R * N * D * 2, 2 * R * (D // 2) * 4
  fwd_bytes, bwd_bytes = 2 * rows + table, 3 * rows + table
  out = []
  ref = lambda x, s: nr.norm_rope_reference(x, s, c, sn, 1e-5)  # noqa: E731
  xla_bwd = lambda x, g, s: jax.vjp(ref, x, s)[1](g)  # noqa: E731
  candidates = [("xla", None, None, lambda x, s: ref(x, s), xla_bwd)] if not interpret else []
  for br, nw in tiles:
    kw = dict(eps=1e-5, block_rows=br, num_warps=nw, interpret=interpret)
    candidates.append((f"pallas {br}x{nw}", br, nw,
                       lambda x, s, kw=kw: nr.norm_rope_fwd(x, s, c, sn, **kw),
                       lambda x, g, s, kw=kw: nr.norm_rope_bwd(x, s, c, sn, g, **kw)))
  for name, br, nw, fwd, bwd in candidates:
    try:
      f_ms = _median_ms(_batched(fwd), s, xs, iters=iters) / copies
      b_ms = _median_ms(_batched(bwd), s, xs, gs, iters=iters) / copies
    except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result too
      print(f"{str(shape):>18} {name:>14}  failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
      continue
    r = {"shape": shape, "impl": name, "block_rows": br, "num_warps": nw, "fwd_ms": f_ms,
         "bwd_ms": b_ms, "fwd_TBps": fwd_bytes / f_ms / 1e9, "bwd_TBps": bwd_bytes / b_ms / 1e9}
    out.append(r)
    print(f"{str(shape):>18} {name:>14} {f_ms:8.3f} {r['fwd_TBps']:6.2f} {b_ms:8.3f} "
          f"{r['bwd_TBps']:6.2f}", flush=True)
  return out


def parse_args(doc: str, shapes: list[str], smoke_shape: tuple, out: str):
  """The glue benches' command line (this one's and bench/add_norm.py's): (args, shapes)."""
  ap = argparse.ArgumentParser(description=doc.split("\n")[0])
  ap.add_argument("--shapes", nargs="*", default=shapes)
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--copies", type=int, default=8, help="distinct inputs per timed call")
  ap.add_argument("--smoke", action="store_true", help="CPU interpret mode, one tiny shape")
  ap.add_argument("--out", default=out)
  a = ap.parse_args()
  return a, [smoke_shape] if a.smoke else [tuple(map(int, s.split(","))) for s in a.shapes]


def main():
  a, shapes = parse_args(__doc__, ["49152,16,128", "65536,8,128"], (64, 2, 16),
                         "bench_norm_rope.json")
  tiles = [(8, 4)] if a.smoke else TILES
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind}  (default tiles: forward "
        f"{nr.BLOCK_ROWS}x{nr.NUM_WARPS}, backward {nr.BWD_BLOCK_ROWS}x{nr.BWD_NUM_WARPS})")
  print(f"{'(R,N,D)':>18} {'impl':>14} {'fwd ms':>8} {'TB/s':>6} {'bwd ms':>8} {'TB/s':>6}")
  copies = 2 if a.smoke else a.copies
  rows = [r for shape in shapes
          for r in run(shape, tiles, 1 if a.smoke else a.iters, copies, a.smoke)]
  with open(a.out, "w") as f:
    json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": rows}, f,
              indent=1)


if __name__ == "__main__":
  main()
