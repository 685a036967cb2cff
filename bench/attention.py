"""Causal bf16 attention throughput: focal attention (`mosaic`: `backend="mosaic"`, the Hopper
Mosaic GPU kernel; `pallas`: `backend="triton"`) against cuDNN, jax's bundled Pallas Triton `mha`,
the XLA reference and (if importable) tokamax.

FLOPs: forward 4·B·H·T²·D / 2 (causal); forward+backward 3.5× that. Timing: jit, 2 warm-up calls,
median of --iters calls each ended by block_until_ready, on fresh random bf16 inputs.
`*_temp` rows use an array temperature [B, H, T] (gradient to it included in fwd+bwd); `err` is
max|out − out_ref| against cuDNN (else the XLA reference; cudnn_temp / xla_temp for the _temp
rows) on the same inputs. The Mosaic kernel's own tiles: bench/focal_tiles.py.

  python bench/attention.py [--quick] [--sweep] [--out bench_attention.json]   # GPU
  python bench/attention.py --smoke                                           # CPU, interpret mode
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import tokamax_shim  # noqa: E402
import pallas_kernels.focal as focal  # noqa: E402
from pallas_kernels.focal import reference  # noqa: E402

SHAPES = [(4, 16, 2048, 128), (2, 16, 4096, 128), (1, 16, 8192, 128), (1, 8, 16384, 128),
          (2, 12, 16384, 64)]  # (B, H, T, D)
QUICK = [(4, 16, 2048, 128), (1, 16, 8192, 128)]
SMOKE = [(1, 2, 128, 64)]
XLA_FWD_LOGITS_MAX, XLA_BWD_LOGITS_MAX = 40e9, 12e9  # bytes of f32 logits before skipping
# --sweep: Triton tile configs for the Pallas kernel (the first one is the default for D=128).
SWEEP = [
    focal.BlockSizes(),
    focal.BlockSizes(block_q=128, block_kv=128),
    focal.BlockSizes(block_q=64, block_kv=64, num_warps_fwd=4, num_stages_fwd=3),
    focal.BlockSizes(num_stages_fwd=3, num_stages_bwd=3),
    focal.BlockSizes(block_q_dkv=32, block_kv_dkv=128, block_q_dq=128, block_kv_dq=32),
    focal.BlockSizes(block_q_dkv=64, block_kv_dkv=128, block_q_dq=128, block_kv_dq=64),
    focal.BlockSizes(block_q_dkv=32, block_kv_dkv=64, block_q_dq=64, block_kv_dq=32,
                     num_warps_bwd=4, num_stages_bwd=3),
]


def _impls(interpret: bool, sweep: bool):
  """name -> attend(q, k, v, temp_BHT) with q/k/v [B, T, H, D] bf16, causal."""
  def pallas(blocks=None, temp=False, backend="triton"):
    def attend(q, k, v, t):
      scale = t if temp else q.shape[-1] ** -0.5
      return focal.focal_attention(q, k, v, scale=scale, causal=True, backend=backend,
                                   block_sizes=blocks, interpret=interpret)
    return attend

  def cudnn(temp=False):
    def attend(q, k, v, t):
      if temp:  # fold the temperature into q in f32, as focaljax.ops does for cuDNN
        q = (q.astype(jnp.float32) * t.transpose(0, 2, 1)[..., None]).astype(q.dtype)
      return jax.nn.dot_product_attention(q, k, v, scale=1.0 if temp else None, is_causal=True,
                                          implementation="cudnn")
    return attend

  def jax_triton(q, k, v, t):
    from jax.experimental.pallas.ops.gpu import attention  # pylint: disable=import-outside-toplevel
    return attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=True,
                         interpret=interpret)

  def xla(temp=False):
    def attend(q, k, v, t):
      return reference.attention(q, k, v, scale=t if temp else q.shape[-1] ** -0.5, causal=True)
    return attend

  def tokamax_(implementation):
    return lambda q, k, v, t: _tokamax(q, k, v, implementation)

  # References first: `err` of later rows is measured against them.
  impls = {"cudnn": cudnn(), "xla": xla(), "cudnn_temp": cudnn(temp=True),
           "xla_temp": xla(temp=True), "mosaic": pallas(backend="mosaic"),
           "mosaic_temp": pallas(temp=True, backend="mosaic"), "pallas": pallas(),
           "pallas_temp": pallas(temp=True), "jax_triton": jax_triton,
           "tokamax": tokamax_("mosaic"), "tokamax_triton": tokamax_("triton")}
  if sweep:
    for b in SWEEP:
      tag = (f"q{b.block_q}k{b.block_kv}w{b.num_warps_fwd}s{b.num_stages_fwd}/"
             f"dkv{b.block_q_dkv}x{b.block_kv_dkv}dq{b.block_q_dq}x{b.block_kv_dq}"
             f"w{b.num_warps_bwd}s{b.num_stages_bwd}")
      impls[f"pallas[{tag}]"] = pallas(blocks=b)
  return impls


def _tokamax(q, k, v, implementation):
  """tokamax's attention with one named implementation ("mosaic": its Hopper Mosaic GPU kernel;
  "triton"), so a failing kernel is reported instead of falling back to another."""
  tokamax_shim.prepare()  # absl flags and jax 0.11's plgpu.kernel keywords
  import tokamax  # pylint: disable=import-outside-toplevel
  return tokamax.dot_product_attention(q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5,
                                       implementation=implementation)


def _time(fn, args, iters: int) -> float:
  """Median seconds of one call (after compile + 2 warm-up calls)."""
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - t0)
  return statistics.median(samples)


def _inputs(seed: int, B: int, H: int, T: int, D: int):
  kq, kk, kv, kt, kdo = jax.random.split(jax.random.key(seed), 5)
  q, k, v, do = (jax.random.normal(key, (B, T, H, D), jnp.bfloat16) for key in (kq, kk, kv, kdo))
  temp_BHT = D**-0.5 * jnp.exp(0.2 * jax.random.normal(kt, (B, H, T), jnp.float32))
  return q, k, v, temp_BHT, do


def _bench_one(name, attend, shape, seed, iters, ref_out):
  B, H, T, D = shape
  flops_fwd = 4 * B * H * T * T * D / 2
  rec = {"impl": name, "B": B, "H": H, "T": T, "D": D}
  logits_bytes = B * H * T * T * 4
  q, k, v, t, do = _inputs(seed, B, H, T, D)
  fwd = jax.jit(attend)
  try:
    if name.startswith("xla") and logits_bytes > XLA_FWD_LOGITS_MAX:
      raise MemoryError(f"skipped: {logits_bytes / 1e9:.0f} GB of logits")
    out = fwd(q, k, v, t)
    if ref_out is not None:
      rec["err"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out)))
    rec["fwd_ms"] = 1e3 * _time(fwd, (q, k, v, t), iters)
    rec["fwd_tflops"] = flops_fwd / rec["fwd_ms"] / 1e9
  except Exception as e:  # pylint: disable=broad-except  one failure must not kill the table
    rec["fwd_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    out = None
  wrt = (0, 1, 2, 3) if name.endswith("_temp") else (0, 1, 2)

  def fwd_bwd(q, k, v, t, do):
    out, vjp = jax.vjp(attend, q, k, v, t)
    grads = vjp(do)
    return out, tuple(grads[i] for i in wrt)

  try:
    if name.startswith("xla") and logits_bytes > XLA_BWD_LOGITS_MAX:
      raise MemoryError(f"skipped: {logits_bytes / 1e9:.0f} GB of logits (x4 for the backward)")
    rec["fwd_bwd_ms"] = 1e3 * _time(jax.jit(fwd_bwd), (q, k, v, t, do), iters)
    rec["fwd_bwd_tflops"] = 3.5 * flops_fwd / rec["fwd_bwd_ms"] / 1e9
  except Exception as e:  # pylint: disable=broad-except
    rec["fwd_bwd_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
  return rec, out


def _fmt(x, spec):
  return format(x, spec) if isinstance(x, (int, float)) else format("-", ">" + spec.split(".")[0])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="two shapes only")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shape, interpret mode on CPU: checks the script runs")
  parser.add_argument("--sweep", action="store_true", help="also time Pallas tile configs")
  parser.add_argument("--impls", default="",
                      help="comma-separated names or globs, e.g. 'cudnn,pallas*' (default: all)")
  parser.add_argument("--shapes", default="",
                      help="B,H,T,D shapes separated by ';' (default: the issue's five)")
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--out", default="bench_attention.json")
  args = parser.parse_args(argv)

  interpret = jax.default_backend() not in ("gpu", "tpu")
  shapes = SMOKE if args.smoke else QUICK if args.quick else SHAPES
  if args.shapes:
    shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shapes.split(";")]
  iters = 2 if args.smoke else max(args.iters, 10)
  impls = _impls(interpret, args.sweep)
  if args.smoke and not args.impls:
    impls = {n: impls[n] for n in ("cudnn", "xla", "xla_temp", "pallas", "pallas_temp",
                                   "jax_triton")}
  elif not args.impls:
    del impls["xla_temp"]  # the GPU table's temperature reference is cudnn_temp
  if args.impls:
    patterns = args.impls.split(",")
    impls = {n: f for n, f in impls.items() if any(fnmatch.fnmatchcase(n, p) for p in patterns)}

  records = []
  header = (f"{'impl':<56} {'B,H,T,D':<16} {'fwd ms':>8} {'TFLOP/s':>8} {'f+b ms':>8} "
            f"{'TFLOP/s':>8} {'err':>8}  note")
  print(header)
  for si, shape in enumerate(shapes):
    refs = {}  # temperature or not -> f32 output of the first of cudnn / xla that ran
    for name, attend in impls.items():
      temp = name.endswith("_temp")
      # Same seed for every impl of a shape (fresh arrays, equal values) so `err` is meaningful.
      rec, out = _bench_one(name, attend, shape, 1000 + si, iters, refs.get(temp))
      if temp not in refs and out is not None and name.startswith(("cudnn", "xla")):
        refs[temp] = out.astype(jnp.float32)
      records.append(rec)
      note = rec.get("fwd_error") or rec.get("fwd_bwd_error") or ""
      print(f"{name:<56} {','.join(map(str, shape)):<16} {_fmt(rec.get('fwd_ms'), '8.3f')} "
            f"{_fmt(rec.get('fwd_tflops'), '8.1f')} {_fmt(rec.get('fwd_bwd_ms'), '8.3f')} "
            f"{_fmt(rec.get('fwd_bwd_tflops'), '8.1f')} {_fmt(rec.get('err'), '8.4f')}  "
            f"{note[:90]}", flush=True)
  meta = {"jax": jax.__version__, "backend": jax.default_backend(),
          "device": str(jax.devices()[0].device_kind), "interpret": interpret,
          "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "flops": "fwd 4*B*H*T^2*D/2 (causal); fwd+bwd 3.5x fwd", "dtype": "bfloat16"}
  Path(args.out).write_text(json.dumps({"meta": meta, "results": records}, indent=1))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
