"""Residual add + RMSNorm Pallas passes alone: time and bandwidth per tile, against XLA's passes.

  python bench/add_norm.py [--shapes 49152,2048 65536,1024] [--out add_norm.json]
  python bench/add_norm.py --smoke     # CPU, interpret mode, one tiny shape

Rows R = B·T tokens of width E = d_model, bf16 (the 1.3B step at 24 × 2048 is 49152,2048; the
400M at 32 × 2048 is 65536,1024). Forward reads x, δ and writes h, y; backward reads h, g_h, g_y
and writes dh: 4 row tensors each way, the bytes printed over the time. The XLA row is
`add_norm_reference` and autodiff of it plus the stream's cotangent, as the model's XLA path
runs them. Timing as bench/norm_rope.py's (--copies distinct inputs per jitted call).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: norm_rope's timers
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import norm_rope as timing  # noqa: E402
from pallas_kernels.glue import add_norm as an  # noqa: E402

# (forward block_rows, num_warps, backward block_rows, num_warps, rows per program)
TILES = [(2, 4, 2, 4, 64), (2, 8, 2, 4, 128), (1, 4, 1, 4, 64), (2, 4, 2, 4, 32),
         (2, 2, 2, 2, 64)]


def run(shape, tiles, iters, copies, interpret):
  R, E = shape
  ks = jax.random.split(jax.random.key(0), 3 * copies)
  xs = [jax.random.normal(k, (R, E), jnp.bfloat16) for k in ks]
  a, b, c = xs[:copies], xs[copies:2 * copies], xs[2 * copies:]
  s = jnp.ones((E,), jnp.float32)
  nbytes = 4 * R * E * 2
  ref = lambda x, d, s: an.add_norm_reference(x, d, s, 1e-5)  # noqa: E731

  def xla_bwd(h, gh, gy, s):
    _, vjp = jax.vjp(lambda h, s: ref(h, jnp.zeros_like(h), s)[1], h, s)
    dh, ds = vjp(gy)
    return gh + dh, ds
  candidates = [("xla", ref, xla_bwd)] if not interpret else []
  for fb, fw, bb, bw, rp in tiles:
    fkw = dict(eps=1e-5, block_rows=fb, num_warps=fw, interpret=interpret)
    bkw = dict(eps=1e-5, block_rows=bb, num_warps=bw, rows_per_program=rp, interpret=interpret)
    candidates.append((f"pallas {fb}x{fw}/{bb}x{bw}/{rp}",
                       lambda x, d, s, kw=fkw: an.add_norm_fwd(x, d, s, **kw),
                       lambda h, gh, gy, s, kw=bkw: an.add_norm_bwd(h, s, gh, gy, **kw)))
  out = []
  for name, fwd, bwd in candidates:
    try:
      f_ms = timing._median_ms(timing._batched(lambda x, d, s: fwd(x, d, s)), s, a, b,
                               iters=iters) / copies
      b_ms = timing._median_ms(timing._batched(lambda h, gh, gy, s: bwd(h, gh, gy, s)), s, a, b,
                               c, iters=iters) / copies
    except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result too
      print(f"{str(shape):>14} {name:>22}  failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
      continue
    r = {"shape": shape, "impl": name, "fwd_ms": f_ms, "bwd_ms": b_ms,
         "fwd_TBps": nbytes / f_ms / 1e9, "bwd_TBps": nbytes / b_ms / 1e9}
    out.append(r)
    print(f"{str(shape):>14} {name:>22} {f_ms:8.3f} {r['fwd_TBps']:6.2f} {b_ms:8.3f} "
          f"{r['bwd_TBps']:6.2f}", flush=True)
  return out


def main():
  a, shapes = timing.parse_args(__doc__, ["49152,2048", "65536,1024"], (64, 32),
                                "bench_add_norm.json")
  tiles = [(2, 4, 2, 4, 16)] if a.smoke else TILES
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind}  (defaults: forward "
        f"{an.FWD_BLOCK_ROWS}x{an.FWD_NUM_WARPS}, backward {an.BWD_BLOCK_ROWS}x"
        f"{an.BWD_NUM_WARPS}/{an.ROWS_PER_PROGRAM})")
  print(f"{'(R,E)':>14} {'impl':>22} {'fwd ms':>8} {'TB/s':>6} {'bwd ms':>8} {'TB/s':>6}")
  rows = [r for shape in shapes
          for r in run(shape, tiles, 1 if a.smoke else a.iters, 2 if a.smoke else a.copies,
                       a.smoke)]
  with open(a.out, "w") as f:
    json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": rows}, f,
              indent=1)


if __name__ == "__main__":
  main()
