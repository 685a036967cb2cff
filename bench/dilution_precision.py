"""Precision of the dilution kernels against a float64 reference, beside bf16 softmax's.

  python bench/dilution_precision.py --out dilution_precision.json   # GPU (Hopper passes)
  python bench/dilution_precision.py --smoke --out /tmp/p.json       # CPU: T=128, interpret mode

For each T, bf16 q, k, v ~ N(0, 1) at (1, T, --heads, --head_dim) and a random float32 output
cotangent: the kernels' output and dq, dk, dv (default block sizes) against the float64
reference (pallas_kernels/dilution/reference.py) on the same bf16 inputs. The anchor row is bf16 softmax attention (cuDNN on GPU, XLA elsewhere) against its own
float64 reference: the rounding that training in bf16 already accepts. Errors: `rel_l2` =
‖x − ref‖ / ‖ref‖ over the whole tensor, `rel_max` = max |x − ref| / max |ref|.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

# CPU interpret mode runs each simulated GPU thread on XLA's host pool: it needs more than 2.
os.environ.setdefault("PJRT_NPROC", "8")
# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pallas_kernels.dilution as dilution
from pallas_kernels.dilution import reference

EPS = 1e-9
NAMES = ("out", "dq", "dk", "dv")


def _errors(got, want):
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return dict(rel_l2=float(np.linalg.norm(g - w) / np.linalg.norm(w)),
              rel_max=float(np.abs(g - w).max() / np.abs(w).max()))


def _kernel(bs, scale, backend, interpret):
  return lambda q, k, v: dilution.dilution_attention(q, k, v, scale=scale, eps=EPS,
                                                     backend=backend, block_sizes=bs,
                                                     interpret=interpret)


def _out_and_grads(fn, q, k, v, do):
  out, vjp = jax.vjp(fn, q, k, v)
  return (out, *vjp(do.astype(out.dtype)))


def _per_head_f64(fn, q, k, v, do):
  """fn's output and gradients in float64 on the host CPU (cuBLAS has no float64 GEMM here), one
  head at a time (T x T float64 per head); x64 only here: the kernels' index arithmetic is int32."""
  host = [np.asarray(x, np.float64) for x in (q, k, v, do)]
  with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
    per = [_out_and_grads(jax.jit(fn), *(jnp.asarray(x[:, :, h:h + 1]) for x in host))
           for h in range(q.shape[2])]
    return tuple(np.concatenate([np.asarray(p) for p in parts], axis=2) for parts in zip(*per))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--t", default="2048,4096,8192,16384", help="comma list of sequence lengths")
  ap.add_argument("--heads", type=int, default=2)
  ap.add_argument("--head_dim", type=int, default=64)
  ap.add_argument("--backend", default="mosaic", choices=dilution.BACKENDS)
  ap.add_argument("--smoke", action="store_true", help="T=128 in interpret mode (CPU)")
  ap.add_argument("--out", required=True, help="JSON file to write")
  args = ap.parse_args(argv)
  interpret = args.smoke or jax.default_backend() != "gpu"
  ts = [128] if args.smoke else [int(t) for t in args.t.split(",")]
  D, H, scale = args.head_dim, args.heads, args.head_dim**-0.5
  softmax_impl = None if interpret else "cudnn"
  base_bs = dilution.default_block_sizes(args.backend, D, jnp.bfloat16)
  if args.smoke:
    base_bs = dataclasses.replace(base_bs, ckpt_rows=64)
  meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, backend=args.backend,
              heads=H, head_dim=D, interpret=interpret)
  print(" ".join(f"{k}={v}" for k, v in meta.items()))
  print(f"{'T':>6} {'variant':<17} " + " ".join(f"{n + ' l2':>10} {n + ' max':>10}" for n in NAMES))
  rows = []
  for T in ts:
    ks = jax.random.split(jax.random.PRNGKey(T), 4)
    q, k, v = (jax.random.normal(kk, (1, T, H, D), jnp.bfloat16) for kk in ks[:3])
    do = jax.random.normal(ks[3], (1, T, H, D), jnp.float32)
    dil64 = lambda q, k, v: reference.dilution_attention(q, k, v, scale=scale, eps=EPS)[0]
    soft = lambda q, k, v, impl=None: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=True, implementation=impl)
    variants = {"dilution": (_kernel(base_bs, scale, args.backend, interpret), dil64)}
    variants["softmax (anchor)"] = (lambda q, k, v: soft(q, k, v, softmax_impl), soft)
    wants = {}
    for name, (fn, fn64) in variants.items():
      if fn64 not in wants:
        wants[fn64] = _per_head_f64(fn64, q, k, v, do)
      want = wants[fn64]
      got = _out_and_grads(jax.jit(fn), q, k, v, do)
      errs = {n: _errors(g, w) for n, g, w in zip(NAMES, got, want)}
      rows.append(dict(T=T, variant=name, **errs))
      print(f"{T:>6} {name:<17} " + " ".join(
          f"{errs[n]['rel_l2']:10.2e} {errs[n]['rel_max']:10.2e}" for n in NAMES), flush=True)
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(dict(meta, rows=rows), f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
