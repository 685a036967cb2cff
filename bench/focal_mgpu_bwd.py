"""Causal bf16 attention BACKWARD alone: focal_mgpu_bwd (Mosaic GPU) against cuDNN.

Ours: `focal_mgpu_bwd.backward` on residuals (out, base-2 lse) from `focal_mgpu.forward` when it
imports and runs, else from a chunked XLA forward. Also its two kernels separately (dq+d_scale,
dk+dv). --fused adds `focal_mgpu_bwd_fused.backward` (one FA3-style kernel, dq by TMA reduce-add,
5 matmuls per tile; it reads block_q_dkv, block_kv_dkv, max_concurrent_steps from --blocks), its
kernel alone, and the ratios two-kernel/fused and cuDNN/fused.
cuDNN: jax.nn.dot_product_attention(implementation="cudnn"), time(fwd+bwd) − time(fwd).
FLOPs: backward = 2.5 × forward = 2.5 · 4·B·H·T²·D / 2 (causal), the usual FlashAttention count
(our kernels really do 7 T²-sized matmuls, cuDNN 5). Timing: jit, 2 warm-up calls, median of
--iters calls each ended by block_until_ready. Hq = Hkv = H (no GQA), array temperature for ours.

  python bench/focal_mgpu_bwd.py [--iters 10] [--blocks 64,64,64,64,2] [--shapes 2,16,4096,128]
  python bench/focal_mgpu_bwd.py --fused [--shapes ...]   # + the single-pass backward
  python bench/focal_mgpu_bwd.py --fused --joint --halves # + joint-dq, dq-halves (D = 128)
  python bench/focal_mgpu_bwd.py --ablate [--joint]      # + fused, dq stages left out
  python bench/focal_mgpu_bwd.py --arms lean pingpong [--fused]  # + the ARMS variants
  python bench/focal_mgpu_bwd.py --smoke [--fused]        # CPU, GPU interpret mode, tiny shape
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import jax  # noqa: E402
from jax import lax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.focal import mosaic_bwd as fb  # noqa: E402
from pallas_kernels.focal import mosaic_dkv as focal_mgpu_dkv  # noqa: E402
from pallas_kernels.focal import mosaic_bwd_fused as ff  # noqa: E402

SHAPES = [(2, 16, 4096, 128), (1, 16, 8192, 128), (1, 8, 16384, 128), (2, 12, 16384, 64)]
SMOKE = [(1, 2, 256, 64)]


@dataclasses.dataclass(frozen=True)
class Blocks:
  block_q_dq: int = 64
  block_kv_dq: int = 64
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  max_concurrent_steps: int = 2
  joint_dq: bool = False  # focal_mgpu.BlockSizes.joint_dq (the fused kernel at D = 128)
  dq_halves: bool = False  # focal_mgpu_bwd_fused's dq in two column halves (D = 128, --halves)
  ablate: tuple = ()  # focal_mgpu_bwd_fused's stages to leave out (--ablate; wrong dq)
  dkv_step: str = "plain"  # focal_mgpu.BlockSizes.dkv_step
  pingpong_backward: bool = False  # focal_mgpu.BlockSizes.pingpong_backward (dk/dv, fused)
  pingpong_dq: bool = False  # focal_mgpu.BlockSizes.pingpong_dq


# --arms: BlockSizes fields of the key-resident step, each timed beside the plain kernels.
ARMS = {"lean": dict(dkv_step="lean"), "pingpong": dict(pingpong_backward=True, pingpong_dq=True),
        "lean_pingpong": dict(dkv_step="lean", pingpong_backward=True, pingpong_dq=True),
        "lean_pingpong_dkv": dict(dkv_step="lean", pingpong_backward=True)}


WARMUP = 2


def _median_ms(fn, *args, iters: int) -> float:
  for _ in range(WARMUP):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def _xla_residuals(q, k, v, s_BNT, chunk: int = 1024):
  """Causal (out, base-2 lse) one query chunk at a time (never the whole [T, S] logits)."""
  B, T, H, D = q.shape
  chunk = min(chunk, T)

  def one(i):
    q_c = lax.dynamic_slice_in_dim(q, i * chunk, chunk, axis=1)
    s_c = lax.dynamic_slice_in_dim(s_BNT, i * chunk, chunk, axis=2)
    x = jnp.einsum("BTHD,BSHD->BHTS", q_c, k, preferred_element_type=jnp.float32)
    x = x * s_c[..., None]
    t = i * chunk + jnp.arange(chunk)
    x = jnp.where((jnp.arange(T)[None, :] <= t[:, None])[None, None], x, -jnp.inf)
    lse = jax.nn.logsumexp(x, axis=-1)
    p = jnp.exp(x - lse[..., None])
    out = jnp.einsum("BHTS,BSHD->BTHD", p.astype(v.dtype), v,
                     preferred_element_type=jnp.float32).astype(q.dtype)
    return out, lse * math.log2(math.e)

  out, lse = lax.map(one, jnp.arange(T // chunk))
  out = jnp.moveaxis(out, 0, 1).reshape(B, T, H, D)
  lse = jnp.moveaxis(lse, 0, 2).reshape(B, H, T)
  return out, lse


def _residuals(q, k, v, s_BNT, *, blocks, interpret):
  try:
    from pallas_kernels.focal import mosaic as focal_mgpu  # pylint: disable=import-outside-toplevel
    fwd_blocks = focal_mgpu.BlockSizes.default(q.shape[-1], q.dtype)
    known = {f.name for f in dataclasses.fields(focal_mgpu.BlockSizes)}
    fields = {k: v for k, v in dataclasses.asdict(blocks).items() if k in known}
    fwd_blocks = dataclasses.replace(fwd_blocks, **fields)
    out, lse = jax.jit(lambda *a: focal_mgpu.forward(*a, causal=True, blocks=fwd_blocks,
                                                     interpret=interpret))(q, k, v, s_BNT)
    return jax.block_until_ready(out), lse, "focal_mgpu"
  except Exception as e:  # noqa: BLE001 -- any failure: say so and fall back to XLA
    print(f"  (focal_mgpu.forward unavailable: {type(e).__name__}: {str(e)[:120]}; XLA residuals)")
    return (*jax.jit(_xla_residuals)(q, k, v, s_BNT), "xla")


ABLATIONS = (("dq",), ("reduce",), ("wait",))


def _row(shape, *, blocks, iters, interpret, fused, joint=False, ablate=False, halves=False,
         arms=()):
  B, H, T, D = shape
  kq, kk, kv, ks, kdo = jax.random.split(jax.random.key(0), 5)
  dtype = jnp.bfloat16
  q, k, v, do = (jax.random.normal(key, (B, T, H, D), dtype) for key in (kq, kk, kv, kdo))
  s_BNT = D**-0.5 * jnp.exp(0.3 * jax.random.normal(ks, (B, H, T), jnp.float32))
  out, lse, source = _residuals(q, k, v, s_BNT, blocks=blocks, interpret=interpret)
  kw = dict(causal=True, blocks=blocks, interpret=interpret)
  ours = jax.jit(lambda *a: fb.backward(*a, **kw))
  res = {"source": source, "bwd": _median_ms(ours, q, k, v, s_BNT, out, lse, do, iters=iters)}
  c_BNT, delta_BNT = jax.jit(fb.backward_rows)(s_BNT, out, do)
  rows = (q, k, v, do, c_BNT, lse, delta_BNT)
  res["dq"] = _median_ms(jax.jit(lambda *a: fb.dq_call(*a, **kw)), *rows, iters=iters)
  res["dkv"] = _median_ms(jax.jit(lambda *a: focal_mgpu_dkv.dkv_call(*a, **kw)), *rows, iters=iters)
  if fused:
    res["fused"] = _median_ms(jax.jit(lambda *a: ff.backward(*a, **kw)), q, k, v, s_BNT, out, lse,
                              do, iters=iters)
    res["fused_kernel"] = _median_ms(lambda *a: ff.fused_call(*a, **kw), *rows, iters=iters)
  for name, field, wanted in (("joint", "joint_dq", joint), ("halves", "dq_halves", halves)):
    if wanted and D == 128:  # the fused kernel's two ways to split dq's columns
      vkw = dict(kw, blocks=dataclasses.replace(blocks, **{field: True}))
      res[name] = _median_ms(jax.jit(lambda *a, vkw=vkw: ff.backward(*a, **vkw)), q, k, v, s_BNT,
                             out, lse, do, iters=iters)
  for mode in arms:  # the key-resident step's variants
    mkw = dict(kw, blocks=dataclasses.replace(blocks, **ARMS[mode]))
    res[f"{mode}_bwd"] = _median_ms(jax.jit(lambda *a, mkw=mkw: fb.backward(*a, **mkw)), q, k, v,
                                    s_BNT, out, lse, do, iters=iters)
    res[f"{mode}_dkv"] = _median_ms(
        jax.jit(lambda *a, mkw=mkw: focal_mgpu_dkv.dkv_call(*a, **mkw)), *rows, iters=iters)
    if fused:
      res[f"{mode}_fused"] = _median_ms(jax.jit(lambda *a, mkw=mkw: ff.backward(*a, **mkw)), q, k,
                                        v, s_BNT, out, lse, do, iters=iters)
  if ablate:  # the fused kernel alone with stages left out: their cost is the difference
    cuts = [(cut, False) for cut in ABLATIONS]
    if joint and D == 128:  # the joint-dq kernel's own reduce and wait
      cuts += [(("reduce",), True), (("wait",), True)]
    for cut, joint_cut in cuts:
      akw = dict(kw, blocks=dataclasses.replace(blocks, ablate=cut, joint_dq=joint_cut))
      name = ("joint_" if joint_cut else "") + "no_" + "_".join(cut)
      res[name] = _median_ms(lambda *a: ff.fused_call(*a, **akw), *rows, iters=iters)
  if not interpret:
    attend = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=D**-0.5, is_causal=True, implementation="cudnn")
    fwd = jax.jit(attend)
    fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(attend, q, k, v)[1](do))
    res["cudnn"] = (_median_ms(fwd_bwd, q, k, v, do, iters=iters)
                    - _median_ms(fwd, q, k, v, iters=iters))
  return res


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--blocks", default="64,64,64,64,2",
                  help="block_q_dq,block_kv_dq,block_q_dkv,block_kv_dkv,max_concurrent_steps")
  ap.add_argument("--shapes", nargs="*", help="B,H,T,D ... (default: the four cuDNN rows)")
  ap.add_argument("--smoke", action="store_true", help="CPU interpret mode, one tiny shape")
  ap.add_argument("--fused", action="store_true",
                  help="also time focal_mgpu_bwd_fused (single-pass, dq by TMA reduce-add)")
  ap.add_argument("--joint", action="store_true",
                  help="also time the fused kernel with joint_dq (D = 128 shapes only)")
  ap.add_argument("--halves", action="store_true",
                  help="also time the fused kernel with dq in two column halves (D = 128 only)")
  ap.add_argument("--ablate", action="store_true",
                  help="also time the fused kernel with its dq stages left out (wrong dq; "
                       "a stage's cost is the difference to the whole kernel)")
  ap.add_argument("--arms", nargs="*", default=[], choices=sorted(ARMS),
                  help="also time the two-kernel (and --fused) backward with these ARMS")
  ap.add_argument("--out", help="write the rows as JSON here")
  a = ap.parse_args()
  a.fused = a.fused or a.ablate or a.halves  # these read against the whole fused kernel
  blocks = Blocks(*map(int, a.blocks.split(",")))
  shapes = [tuple(map(int, s.split(","))) for s in a.shapes] if a.shapes else (
      SMOKE if a.smoke else SHAPES)
  iters = 1 if a.smoke else a.iters
  if a.smoke:
    global WARMUP
    WARMUP = 0  # interpreted runs are slow; this only checks the script end to end
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind}  blocks {blocks}")
  print(f"{'(B,H,T,D)':>20} {'resid':>10} {'ours ms':>8} {'TF/s':>6} {'dq ms':>7} {'dkv ms':>7} "
        f"{'cuDNN ms':>8} {'TF/s':>6} {'cuDNN/ours':>10}"
        + (f" {'fused ms':>8} {'TF/s':>6} {'kernel':>7} {'2k/fused':>8} {'cuDNN/fused':>11}"
           if a.fused else ""))
  rows = []
  for shape in shapes:
    B, H, T, D = shape
    flops = 2.5 * 4 * B * H * T * T * D / 2
    r = _row(shape, blocks=blocks, iters=iters, interpret=a.smoke, fused=a.fused,
             joint=a.joint, ablate=a.ablate, halves=a.halves,
             arms=a.arms)
    rows.append({"shape": shape, **r})
    tf = lambda ms: flops / (ms * 1e-3) / 1e12
    cudnn = r.get("cudnn")
    tail = (f"{cudnn:8.3f} {tf(cudnn):6.0f} {cudnn / r['bwd']:10.2f}" if cudnn
            else f"{'-':>8} {'-':>6} {'-':>10}")
    if a.fused:
      fz = r["fused"]
      tail += (f" {fz:8.3f} {tf(fz):6.0f} {r['fused_kernel']:7.3f} {r['bwd'] / fz:8.2f} "
               + (f"{cudnn / fz:11.2f}" if cudnn else f"{'-':>11}"))
    print(f"{str(shape):>20} {r['source']:>10} {r['bwd']:8.3f} {tf(r['bwd']):6.0f} "
          f"{r['dq']:7.3f} {r['dkv']:7.3f} {tail}", flush=True)
    for name in ("joint", "halves"):
      if name in r:
        z = r[name]
        print(f"{'':>20} fused, {name} {z:.3f} ms {tf(z):.0f} TF/s, 2k/{name} "
              f"{r['bwd'] / z:.2f}" + (f", cuDNN/{name} {cudnn / z:.2f}" if cudnn else ""),
              flush=True)
    for mode in a.arms:
      fz = r.get(f"{mode}_fused")
      print(f"{'':>20} {mode}: two kernels {r[mode + '_bwd']:.3f} ms (dkv "
            f"{r[mode + '_dkv']:.3f})" + (f", fused {fz:.3f}" if fz else "")
            + (f", cuDNN/two kernels {cudnn / r[mode + '_bwd']:.2f}" if cudnn else "")
            + (f", cuDNN/fused {cudnn / fz:.2f}" if cudnn and fz else ""), flush=True)
    cuts = {k: v for k, v in r.items() if k.startswith(("no_", "joint_no_"))}
    if cuts:
      print(f"{'':>20} fused kernel {r['fused_kernel']:.3f} ms; without: "
            + ", ".join(f"{k[3:] if k.startswith('no_') else k} {v:.3f}" for k, v in cuts.items()),
            flush=True)
  if a.out:
    Path(a.out).write_text(json.dumps({"jax": jax.__version__, "blocks": dataclasses.asdict(blocks),
                                       "rows": rows}, indent=1))


if __name__ == "__main__":
  main()
