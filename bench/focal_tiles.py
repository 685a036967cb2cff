"""Tile sweep of the Hopper Mosaic GPU focal attention (`pallas_kernels.focal.mosaic`) vs cuDNN.

--pass fwd: the forward at each --fwd_tiles config (block_q per compute warpgroup, two per CTA,
  block_kv, K/V ring stages); cuDNN's forward with a float scale for reference, and `err` =
  max|out − cudnn| / max|cudnn| with that same scale on both.
--pass bwd: the backward alone, on residuals (out, base-2 lse) from the Mosaic forward, at each
  --bwd_tiles config (block_q_dq, block_kv_dq, block_q_dkv, block_kv_dkv, stages): `default` (what
  focal_attention runs at this D: the two kernels at D=128, the fused single pass at D=64), `two`
  (dq kernel + dk/dv kernel, also timed apart), `fused` (one FlashAttention-3-style kernel, dq by
  TMA reduce-add; a config over its shared-memory budget is reported as skipped); cuDNN's backward
  as time(fwd+bwd) − time(fwd).
FLOPs: forward 4·B·H·T²·D, halved when causal; backward 2.5× that. Timing: jit, 2 warm-up calls,
median of --iters calls each ended by block_until_ready; fresh random inputs, Hq = Hkv = H, an
array temperature [B, H, T] for ours.

  python bench/focal_tiles.py [--pass fwd|bwd|both] [--shapes 2,16,4096,128 ...] [--out t.json]
  python bench/focal_tiles.py --smoke      # CPU: GPU interpret mode, one tiny shape and config
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.focal import mosaic  # noqa: E402
from pallas_kernels.focal import mosaic_bwd  # noqa: E402
from pallas_kernels.focal import mosaic_bwd_fused  # noqa: E402
from pallas_kernels.focal import mosaic_dkv  # noqa: E402

SHAPES = [(2, 16, 4096, 128), (1, 16, 8192, 128), (1, 8, 16384, 128), (2, 12, 16384, 64)]
SMOKE = [(1, 2, 256, 64)]
FWD_TILES = ["64,128,2", "64,128,3", "64,64,2", "64,64,3", "64,64,4"]  # the first: D=128's default
BWD_TILES = ["64,64,64,64,2", "64,128,128,64,2", "64,64,64,64,3"]  # the first: the default


def _fwd_blocks(text: str) -> mosaic.BlockSizes:
  bq, bkv, steps = map(int, text.split(","))
  return mosaic.BlockSizes(block_q=bq, block_kv=bkv, max_concurrent_steps=steps)


def _bwd_blocks(text: str, D: int) -> mosaic.BlockSizes:
  bq_dq, bkv_dq, bq_dkv, bkv_dkv, steps = map(int, text.split(","))
  return dataclasses.replace(mosaic.BlockSizes.default(D), block_q_dq=bq_dq, block_kv_dq=bkv_dq,
                             block_q_dkv=bq_dkv, block_kv_dkv=bkv_dkv,
                             max_concurrent_steps=steps)


def _median_ms(fn, *args, iters: int, warmup: int) -> float:
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(samples)


def _timed(fn, *args, **kw):
  """Milliseconds, or the first line of the error (a config that does not fit is no crash)."""
  try:
    return _median_ms(fn, *args, **kw)
  except Exception as e:  # pylint: disable=broad-except
    return f"skipped: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"


def _inputs(shape, dtype):
  B, H, T, D = shape
  kq, kk, kv, ks, kdo = jax.random.split(jax.random.key(0), 5)
  q, k, v, do = (jax.random.normal(key, (B, T, H, D), jnp.float32).astype(dtype)
                 for key in (kq, kk, kv, kdo))
  s_BHT = D**-0.5 * jnp.exp(0.3 * jax.random.normal(ks, (B, H, T), jnp.float32))
  return q, k, v, s_BHT, do


def _cudnn(causal, D):
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=D**-0.5, is_causal=causal,
                                                      implementation="cudnn")


def forward_rows(shape, tiles, *, dtype, causal, interpret, timing):
  q, k, v, s_BHT, _ = _inputs(shape, dtype)
  D = shape[3]
  rows, ref = [], None
  if not interpret:
    cudnn = jax.jit(_cudnn(causal, D))
    rows.append({"impl": "cudnn", "fwd": _timed(cudnn, q, k, v, **timing)})
    ref = cudnn(q, k, v).astype(jnp.float32)
  for text in tiles:
    blocks = _fwd_blocks(text)
    attend = lambda q, k, v, s, blocks=blocks: mosaic.focal_attention(
        q, k, v, scale=s, causal=causal, block_sizes=blocks, interpret=interpret)
    row = {"impl": "mosaic", "tiles": text, "fwd": _timed(jax.jit(attend), q, k, v, s_BHT,
                                                          **timing)}
    if ref is not None and isinstance(row["fwd"], float):  # same float scale as cuDNN
      out = jax.jit(attend)(q, k, v, D**-0.5).astype(jnp.float32)
      row["err"] = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
    rows.append(row)
  return rows


def backward_rows(shape, tiles, *, dtype, causal, interpret, timing):
  q, k, v, s_BHT, do = _inputs(shape, dtype)
  D = shape[3]
  out, lse = jax.jit(lambda *a: mosaic.forward(*a, causal=causal, blocks=None,
                                               interpret=interpret))(q, k, v, s_BHT)
  rows = []
  if not interpret:
    cudnn = _cudnn(causal, D)
    fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(cudnn, q, k, v)[1](do))
    ms = _timed(fwd_bwd, q, k, v, do, **timing)
    fwd = _timed(jax.jit(cudnn), q, k, v, **timing)
    bwd = ms - fwd if isinstance(ms, float) and isinstance(fwd, float) else (
        ms if isinstance(ms, str) else fwd)
    rows.append({"impl": "cudnn", "bwd": bwd})
  args = (q, k, v, s_BHT, out, lse, do)
  c_BHT, delta_BHT = jax.jit(mosaic_bwd.backward_rows)(s_BHT, out, do)
  kernel_args = (q, k, v, do, c_BHT, lse, delta_BHT)
  for text in tiles:
    kw = dict(causal=causal, blocks=_bwd_blocks(text, D), interpret=interpret)
    two = _timed(jax.jit(lambda *a, kw=kw: mosaic_bwd.backward(*a, **kw)), *args, **timing)
    fused = _timed(jax.jit(lambda *a, kw=kw: mosaic_bwd_fused.backward(*a, **kw)), *args,
                   **timing)
    rows.append({"impl": "mosaic", "tiles": text, "two": two, "fused": fused,
                 "default": fused if kw["blocks"].fused_backward else two,
                 "dq": _timed(jax.jit(lambda *a, kw=kw: mosaic_bwd.dq_call(*a, **kw)),
                              *kernel_args, **timing),
                 "dkv": _timed(jax.jit(lambda *a, kw=kw: mosaic_dkv.dkv_call(*a, **kw)),
                               *kernel_args, **timing)})
  return rows


def _fmt(x, flops=None):
  """ms [and TFLOP/s], or the reason a row has no time."""
  if not isinstance(x, float):
    return str(x)
  return f"{x:8.3f}" + (f" {flops / x / 1e9:6.0f}" if flops else "")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--pass", dest="which", default="both", choices=["fwd", "bwd", "both"])
  ap.add_argument("--shapes", nargs="*", help="B,H,T,D ... (default: four long-context shapes)")
  ap.add_argument("--fwd_tiles", nargs="*", default=FWD_TILES, help="block_q,block_kv,stages")
  ap.add_argument("--bwd_tiles", nargs="*", default=BWD_TILES,
                  help="block_q_dq,block_kv_dq,block_q_dkv,block_kv_dkv,stages")
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
  ap.add_argument("--noncausal", action="store_true")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--smoke", action="store_true", help="CPU interpret mode, one tiny shape")
  ap.add_argument("--out", help="write the rows as JSON here")
  a = ap.parse_args(argv)
  shapes = [tuple(map(int, s.split(","))) for s in a.shapes] if a.shapes else (
      SMOKE if a.smoke else SHAPES)
  fwd_tiles, bwd_tiles = a.fwd_tiles, a.bwd_tiles
  if a.smoke:  # interpreted runs are slow; this only checks the script end to end
    fwd_tiles, bwd_tiles = fwd_tiles[:1], bwd_tiles[:1]
  kw = dict(dtype=jnp.dtype(a.dtype), causal=not a.noncausal, interpret=a.smoke,
            timing=dict(iters=1 if a.smoke else a.iters, warmup=0 if a.smoke else 2))
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {a.dtype}, "
        f"causal={not a.noncausal}; ms and TFLOP/s")
  records = []
  for shape in shapes:
    B, H, T, D = shape
    flops = 4 * B * H * T * T * D / (1 if a.noncausal else 2)
    if a.which in ("fwd", "both"):
      for r in forward_rows(shape, fwd_tiles, **kw):
        records.append({"pass": "fwd", "shape": shape, **r})
        print(f"fwd {str(shape):>20} {r['impl']:<7} {r.get('tiles', ''):<16} "
              f"{_fmt(r['fwd'], flops)}" + (f"  err {r['err']:.1e}" if "err" in r else ""),
              flush=True)
    if a.which in ("bwd", "both"):
      for r in backward_rows(shape, bwd_tiles, **kw):
        records.append({"pass": "bwd", "shape": shape, **r})
        if r["impl"] == "cudnn":
          print(f"bwd {str(shape):>20} cudnn   {'':<16} {_fmt(r['bwd'], 2.5 * flops)}",
                flush=True)
          continue
        print(f"bwd {str(shape):>20} mosaic  {r['tiles']:<16} "
              f"default {_fmt(r['default'], 2.5 * flops)} | two {_fmt(r['two'])} "
              f"(dq {_fmt(r['dq'])}, dk/dv {_fmt(r['dkv'])}) | fused {_fmt(r['fused'])}",
              flush=True)
  if a.out:
    meta = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
            "dtype": a.dtype, "causal": not a.noncausal, "iters": a.iters}
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": records}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
