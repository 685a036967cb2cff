"""Benchmark: Pallas dilution kernels vs cuDNN softmax attention vs the XLA dilution reference.

  python bench/dilution.py --out dilution_bench.json          # GPU: the full table
  python bench/dilution.py --smoke --out /tmp/smoke.json      # CPU: tiny shapes, interpret mode

Entries: training forward and forward+backward at (B, H, T, D) = (8,8,4K,64), (2,12,16K,64),
(1,16,8K,128); prefill at 32K/64K/128K (B1 H12 D64); one decode step against a 16K and a 128K
cache. `--passes`: each training kernel pass (F1, F2, B1, B2) timed alone at (2,12,16K,64), to
see where forward+backward goes; `--b1-variants default,scratch,...` (or `all`) times B1 once per
B1_VARIANTS entry (rows carry `variant`); `--train-variants default,b1_scratch_k128_w8,...` (or
`all`) times the dilution training entries (fwd, fwd+bwd of dilution_attention) once per
B1_VARIANTS entry applied to the whole op, so a variant's effect on B2 (and, for block_k or
num_warps, on every pass) is in the number; `--train-shapes 2x12x16384x64` keeps only those
training shapes (not with --smoke). Each entry is jitted, warmed up, then timed as the
median of --reps runs with block_until_ready. Memory: `temp_MiB` is XLA's compiled scratch for
that function (per entry); `peak_MiB` is the device's process-lifetime peak_bytes_in_use after the
entry (monotonic: read it as "at most"). Every entry is wrapped in try/except (OOM, unsupported)
and reported as an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable-next=wrong-import-position
from pallas_kernels.focal import reference
from pallas_kernels.dilution import reference as dilution_reference
from pallas_kernels.dilution import api as dilution
from pallas_kernels.dilution import mosaic_b2 as dilution_mgpu_b2
from pallas_kernels.dilution import mosaic_fwd as dilution_mgpu_fwd

TRAIN_SHAPES = [(8, 8, 4096, 64), (2, 12, 16384, 64), (1, 16, 8192, 128)]
PREFILL_T = [32768, 65536, 131072]
DECODE_S = [16384, 131072]
# --sweep: tile variants for the key-parallel sweeps at (2,12,16K,64) (the first is the default).
# F2/B1 add every (row tile, key block) σV and dq product into global memory with fp32 atomics, so
# larger key blocks cut the atomic traffic (T²·D/block_k per head) at the cost of registers.
SWEEP = [dict(), dict(block_k=128), dict(block_q=64), dict(block_q=16, block_k=128),
         dict(block_q=64, block_k=128, num_warps=8), dict(num_warps=8), dict(num_stages_fwd=3),
         dict(block_q_stats=128, block_k_stats=64)]
# --passes --b1-variants: B1 alone per BlockSizes setting (on top of BlockSizes.default(D), what
# dilution_attention runs, or the smoke blocks), same inputs; "plain" is the fields' own defaults
# (the default before the thirteenth session). scratch: the super-block carries in an HBM slice,
# not a one-hot register array; k128_w8: a 128-key block halves the dq atomics (T²·D/block_k per
# head) but doubles dk/dv registers, so 8 warps; with scratch the carry array no longer doubles too.
# block_k and num_warps also set B2's tile (num_warps every pass's): b1_scratch_k128_w8 gives the
# 128 keys and 8 warps to B1 alone. --train-variants applies these to dilution_attention whole.
B1_PLAIN = dict(b1_carries="registers", b1_block_k=None, b1_warps=None)
B1_VARIANTS = {"default": dict(), "plain": B1_PLAIN,
               "scratch": dict(B1_PLAIN, b1_carries="scratch"),
               "scratch_k128_w8": dict(B1_PLAIN, b1_carries="scratch", block_k=128, num_warps=8),
               "k128_w8": dict(B1_PLAIN, block_k=128, num_warps=8),
               "b1_scratch_k128_w8": dict(b1_carries="scratch", b1_block_k=128, b1_warps=8),
               # B1 (and, for the whole op, F2 too) on Hopper's wgmma/TMA
               # (pallas_kernels/dilution_mgpu*.py; 16-bit only).
               # three bf16 mask pieces (float32-exact) or two (the D = 64 Hopper default)
               "b1_mosaic": dict(b1_impl="mosaic", b1_mask_pieces=3),
               "b1_mosaic_2p": dict(b1_impl="mosaic", b1_mask_pieces=2),
               # ... with 232 registers per compute thread (B1 and, for the whole op, F2;
               # the default is 256)
               "b1_mosaic_2p_r232": dict(b1_impl="mosaic", b1_mask_pieces=2, mosaic_registers=232),
               # the default off Hopper
               "triton": dict(b1_impl="triton", f2_impl="triton", f1_impl="triton",
                              b2_impl="triton"),
               "mosaic": dict(b1_impl="mosaic", f2_impl="mosaic"),
               # both Mosaic passes with two bf16 mask pieces (BlockSizes.f2_mask_pieces)
               "mosaic_2p": dict(b1_impl="mosaic", f2_impl="mosaic", b1_mask_pieces=2,
                                 f2_mask_pieces=2),
               # ... and 4 (D = 64) or 2 key tiles per F2 CTA (BlockSizes.f2_key_tiles)
               "mosaic_2p_k4": dict(b1_impl="mosaic", f2_impl="mosaic", b1_mask_pieces=2,
                                    f2_mask_pieces=2, f2_key_tiles=4),
               "mosaic_2p_k2": dict(b1_impl="mosaic", f2_impl="mosaic", b1_mask_pieces=2,
                                    f2_mask_pieces=2, f2_key_tiles=2),
               # the Hopper defaults before the twenty-ninth session, over today's: the Triton
               # F2 (D = 64) and the Triton B1 with the three-piece Mosaic F2 (D = 128)
               "f2_triton": dict(f2_impl="triton", f2_mask_pieces=3, f2_key_tiles=1),
               # F1 as focal_mgpu's forward with V := K (dilution_mgpu_fwd.row_stats) and B2
               # with two compute warpgroups on wgmma (dilution_mgpu_b2): each alone, both (the
               # Hopper default since the thirty-second session) and neither (the one before)
               "f1_mosaic": dict(f1_impl="mosaic", b2_impl="triton"),
               "b2_mosaic": dict(f1_impl="triton", b2_impl="mosaic"),
               "f1_b2_mosaic": dict(f1_impl="mosaic", b2_impl="mosaic"),
               "f1_b2_triton": dict(f1_impl="triton", b2_impl="triton"),
               "b1_triton": dict(b1_impl="triton", b1_mask_pieces=3, f2_mask_pieces=3,
                                 f2_key_tiles=1),
               # a checkpoint per 64-row tile: the Mosaic B1 rebuilds no carries (one k·qᵀ and
               # exp per tile pair fewer), at ceil(T/64)·T·4 bytes per (batch, head), past the
               # issue's R >= 1024 memory bound
               "ckpt64": dict(ckpt_rows=64),
               # fewer instructions per element in the Mosaic B1 and F2 (BlockSizes.mosaic_lean:
               # approx_math, rsqrt.approx² reciprocals, position vectors, XLA's per-query rows)
               "lean": dict(mosaic_lean=True),
               # ... and no mask on tiles below the diagonal within one segment
               # (BlockSizes.mosaic_skip_masks)
               "lean_skip": dict(mosaic_lean=True, mosaic_skip_masks=True),
               "lean_off": dict(mosaic_lean=False, mosaic_skip_masks=False,
                                mosaic_chain_pieces=False),
               # the mask products' bf16 pieces in one wgmma group (BlockSizes.mosaic_chain_pieces,
               # the Hopper default at D = 64 since the thirty-fifth session), and one by one
               "chain": dict(mosaic_chain_pieces=True),
               "chain_off": dict(mosaic_chain_pieces=False)}
# BlockSizes fields the Mosaic F2 reads as well as B1: --passes times F2 too for variants that set one.
F2_SHARED = ("mosaic_lean", "mosaic_skip_masks", "mosaic_chain_pieces")
SMOKE_BLOCKS = dilution.BlockSizes(block_q_stats=16, block_k_stats=16, block_q=16, block_k=32,
                                   block_k_fwd=32, ckpt_rows=32, block_k_decode=16, split_k_decode=64)


def _time(fn, args, reps):
  """(median seconds, compiled temp bytes) of a jitted fn."""
  jitted = jax.jit(fn)
  compiled = jitted.lower(*args).compile()
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


def _attn_fns(impl, scale, interpret, bs):
  if impl == "dilution":
    return lambda q, k, v: dilution.dilution_attention(q, k, v, scale=scale, block_sizes=bs,
                                                       interpret=interpret)
  if impl == "xla":
    return lambda q, k, v: dilution_reference.dilution_attention(q, k, v, scale=scale)[0]
  if impl == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                        implementation="cudnn")
  raise ValueError(impl)


def _fwd_bwd(fn):
  def loss(q, k, v):
    return fn(q, k, v).astype(jnp.float32).sum()
  return jax.grad(loss, (0, 1, 2))


def _entry(rows, kind, impl, shape, thunk, variant=None):
  row = dict(kind=kind, impl=impl, shape=shape)
  if variant is not None:
    row["variant"] = variant
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
  _print_row(row)


def _print_row(r):
  ms = f"{r['ms']:10.3f}" if "ms" in r else f"{'-':>10}"
  tmp = f"{r['temp_MiB']:10.1f}" if r.get("temp_MiB") is not None else f"{'-':>10}"
  pk = f"{r['peak_MiB']:10.1f}" if r.get("peak_MiB") is not None else f"{'-':>10}"
  print(f"{r['kind']:<9} {r['impl']:<9} {str(r['shape']):<26} {ms} {tmp} {pk}  "
        f"{r.get('variant', '')}  {r.get('error', '')}", flush=True)


def _passes(shape, dtype, reps, interpret, bs, b1_variants=("default",)):
  """Each training pass alone, on inputs from a real forward (so B1 sees true carries): where the
  forward+backward's time goes. Rows kind="pass", impl = the pass name; B1 once per variant name
  in `b1_variants` (B1_VARIANTS fields replaced in `bs`), row["variant"] = the name."""
  from pallas_kernels.dilution import triton_bwd as dilution_bwd
  from pallas_kernels.dilution import triton_fwd as dilution_fwd  # pylint: disable=import-outside-toplevel
  B, H, T, D = shape
  q, k, v = _qkv(B, H, T, D, dtype)
  seg = jnp.zeros((B, T), jnp.int32)
  kw = dict(scale=D**-0.5, bs=bs, interpret=interpret)
  lse, pk = dilution_fwd.row_stats(q, k, seg, with_pk=True, **kw)
  n, ssum, _, ckpt = dilution_fwd.key_sweep(q, k, v, seg, lse, eps=1e-9, with_ckpt=True, **kw)
  out = n / (ssum.transpose(0, 2, 1)[..., None] + 1e-9)
  do = jax.random.normal(jax.random.PRNGKey(9), q.shape, jnp.float32)
  dbar = jnp.einsum("BTND,BTND->BNT", do, out)
  do = do.astype(dtype)
  ghat = dilution_bwd.reverse_sweep(q, k, v, seg, lse, ssum, dbar, do, ckpt, eps=1e-9, **kw)[1]
  # Dense [tile x tile] matmuls per (row tile, key block) pair, from the kernels' docstrings:
  # each costs B·H·T²·D FLOPs over the causal triangle (B1 also has its fp32 triangular product).
  matmuls = {"F1 row_stats": 2, "F2 key_sweep": 2, "B1 reverse_sweep": 6, "B2 dk_correction": 2}
  b1_args = (q, k, v, lse, ssum, dbar, do, ckpt)
  passes = [
      ("F1 row_stats", None, lambda q, k: dilution_fwd.row_stats(q, k, seg, with_pk=True, **kw),
       (q, k)),
      ("F2 key_sweep", None, lambda q, k, v, lse: dilution_fwd.key_sweep(
          q, k, v, seg, lse, eps=1e-9, with_ckpt=True, **kw), (q, k, v, lse)),
  ]
  hopper_arms = not interpret and dtype != jnp.float32 and D in (64, 128)   # the Mosaic passes
  if hopper_arms:   # F1 on wgmma (focal_mgpu)
    passes.append(("F1 row_stats", "mosaic", lambda q, k: dilution_mgpu_fwd.row_stats(
        q, k, seg, scale=D**-0.5, with_pk=True), (q, k)))
  # F2 on wgmma/TMA alongside the Triton F2, at each register budget a B1 variant asks for
  regs = sorted({B1_VARIANTS[v].get("mosaic_registers", bs.mosaic_registers) for v in b1_variants
                 if B1_VARIANTS[v].get("b1_impl") == "mosaic"})
  # (BlockSizes.f2_mask_pieces, f2_key_tiles): 3 pieces and one key tile are the kernel as first
  # timed; the key tiles that fit shared memory at this D
  f2_arms = [(3, 1), (2, 1)] + [(p, g) for g in dilution_mgpu_fwd.key_tiles_for(D) if g > 1
                                for p in (3, 2)]
  for r in regs:
    for pieces, tiles in f2_arms:
      kw_m = dict(kw, bs=dataclasses.replace(bs, f2_impl="mosaic", mosaic_registers=r,
                                             f2_mask_pieces=pieces, f2_key_tiles=tiles))
      name = f"mosaic_r{r}" + ("_2p" if pieces == 2 else "") + (f"_k{tiles}" if tiles > 1 else "")
      passes.append(("F2 key_sweep", name, lambda q, k, v, lse, kw_m=kw_m: dilution.f2_key_sweep(
          q, k, v, seg, lse, eps=1e-9, with_ckpt=True, **kw_m), (q, k, v, lse)))
  f2_variants = [v for v in b1_variants if set(B1_VARIANTS[v]) & set(F2_SHARED)]
  if f2_variants:
    # F2 as the op runs it here (`bs`), and with each variant that sets a field it shares with B1
    for name in ["default", *f2_variants]:
      kw_m = dict(kw, bs=dataclasses.replace(bs, **B1_VARIANTS[name]))
      passes.append(("F2 key_sweep", name, lambda q, k, v, lse, kw_m=kw_m: dilution.f2_key_sweep(
          q, k, v, seg, lse, eps=1e-9, with_ckpt=True, **kw_m), (q, k, v, lse)))
  for variant in b1_variants:
    # The checkpoints are per key (any block_k reads them); block_k must divide T. A variant with
    # its own ckpt_rows gets F2's checkpoints at that spacing.
    kw_v = dict(kw, bs=dataclasses.replace(bs, **B1_VARIANTS[variant]))
    args_v = b1_args
    if kw_v["bs"].ckpt_rows != bs.ckpt_rows:
      ckpt_v = dilution_fwd.key_sweep(q, k, v, seg, lse, eps=1e-9, with_ckpt=True, **kw_v)[3]
      args_v = b1_args[:-1] + (ckpt_v,)
    passes.append(("B1 reverse_sweep", variant,
                   lambda *a, kw_v=kw_v: dilution.b1_reverse_sweep(*a[:3], seg, *a[3:],
                                                                 eps=1e-9, **kw_v), args_v))
  passes.append(("B2 dk_correction", None, lambda q, k, lse, ghat: dilution_bwd.dk_correction(
      q, k, seg, lse, ghat, **kw), (q, k, lse, ghat)))
  if hopper_arms:   # B2 on wgmma
    passes.append(("B2 dk_correction", "mosaic", lambda q, k, lse, ghat: dilution_mgpu_b2.
                   dk_correction(q, k, seg, lse, ghat, scale=D**-0.5), (q, k, lse, ghat)))
  rows = []
  for name, variant, fn, args in passes:
    _entry(rows, "pass", name, shape, lambda fn=fn, args=args: _time(fn, args, reps), variant)
    if "ms" in rows[-1]:
      tflop = matmuls[name] * B * H * T * T * D / 1e12
      rows[-1].update(matmul_TFLOP=tflop, TFLOP_per_s=tflop / rows[-1]["ms"] * 1e3)
      label = f"{name} [{variant}]" if variant else name
      print(f"          {label}: {matmuls[name]} matmuls per tile pair, {tflop:.3f} TFLOP, "
            f"{rows[-1]['TFLOP_per_s']:.0f} TFLOP/s")
  return rows


def _variant_names(flag, value):
  names = list(B1_VARIANTS) if value == "all" else value.split(",")
  for name in names:
    if name not in B1_VARIANTS:
      raise ValueError(f"{flag}: {name!r} is not one of {list(B1_VARIANTS)} or 'all'")
  return names


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=None, help="write the rows as JSON here")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
  ap.add_argument("--reps", type=int, default=10, help="timed runs per entry (median)")
  ap.add_argument("--impls", default="dilution,cudnn,xla",
                  help="comma list for the training entries: dilution, cudnn, xla")
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  ap.add_argument("--sweep", action="store_true",
                  help="only the SWEEP tile variants (fwd, fwd+bwd, F1 alone) at (2,12,16K,64)")
  ap.add_argument("--passes", action="store_true",
                  help="only each training kernel pass alone (F1, F2, B1, B2) at (2,12,16K,64)")
  ap.add_argument("--b1-variants", default="default",
                  help="with --passes: comma list of B1_VARIANTS names to time B1 for, or 'all' "
                       f"({','.join(B1_VARIANTS)})")
  ap.add_argument("--train-variants", default=None,
                  help="comma list of B1_VARIANTS names (or 'all'): the dilution training entries "
                       "once per BlockSizes variant, rows carry 'variant' (default: once, plain)")
  ap.add_argument("--train-shapes", default=None,
                  help="comma list of BxHxTxD training shapes (default: TRAIN_SHAPES)")
  ap.add_argument("--prefill-d", type=int, default=64, help="head dim of the prefill entries")
  ap.add_argument("--skip", default="", help="comma list of sections to skip: train,prefill,decode")
  args = ap.parse_args(argv)

  b1_variants = _variant_names("--b1-variants", args.b1_variants)
  # [None]: the plain dilution rows (no "variant" key), as before --train-variants existed.
  train_variants = ([None] if args.train_variants is None
                    else _variant_names("--train-variants", args.train_variants))
  dtype = jnp.dtype(args.dtype)
  impls = [i for i in args.impls.split(",") if i]
  skip = set(args.skip.split(","))
  interpret = args.smoke or jax.default_backend() != "gpu"
  bs = SMOKE_BLOCKS if args.smoke else None
  train_shapes, prefill_t, decode_s = TRAIN_SHAPES, PREFILL_T, DECODE_S
  if args.train_shapes:
    train_shapes = [tuple(int(x) for x in s.split("x")) for s in args.train_shapes.split(",")]
    if any(len(s) != 4 for s in train_shapes):
      raise ValueError(f"--train-shapes: want BxHxTxD items, got {args.train_shapes!r}")
  reps = args.reps
  if args.smoke:
    train_shapes, prefill_t, decode_s = [(1, 2, 128, 64)], [128], [256]
    impls = [i for i in impls if i != "cudnn" or jax.default_backend() == "gpu"]
    reps = min(reps, 2)
  print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} "
        f"jax={jax.__version__} dtype={dtype.name} interpret={interpret}")
  print(f"{'kind':<9} {'impl':<9} {'(B, H, T, D)':<26} {'ms':>10} {'temp_MiB':>10} "
        f"{'peak_MiB':>10}  variant")
  rows = []

  if args.sweep:
    from pallas_kernels.dilution import triton_fwd as dilution_fwd  # pylint: disable=import-outside-toplevel
    shape = (1, 2, 128, 64) if args.smoke else (2, 12, 16384, 64)
    q, k, v = _qkv(*shape, dtype)
    seg = jnp.zeros(shape[:1] + shape[2:3], jnp.int32)
    for kw in SWEEP:
      b = dilution.BlockSizes(**kw) if not args.smoke else SMOKE_BLOCKS
      name = ",".join(f"{a}={x}" for a, x in kw.items()) or "default"
      fn = _attn_fns("dilution", shape[3]**-0.5, interpret, b)
      f1 = lambda q, k, b=b: dilution_fwd.row_stats(q, k, seg, scale=0.125, bs=b, with_pk=True,
                                                    interpret=interpret)
      _entry(rows, "F1", name, shape, lambda f1=f1: _time(f1, (q, k), reps))
      _entry(rows, "fwd", name, shape, lambda fn=fn: _time(fn, (q, k, v), reps))
      _entry(rows, "fwd+bwd", name, shape, lambda fn=fn: _time(_fwd_bwd(fn), (q, k, v), reps))
    skip |= {"train", "prefill", "decode"}

  if args.passes:
    rows += _passes(train_shapes[0] if args.smoke else TRAIN_SHAPES[1], dtype, reps,
                    interpret, bs or dilution.default_block_sizes(64, dtype, interpret), b1_variants)
    skip |= {"train", "prefill", "decode"}

  if "train" not in skip:
    for B, H, T, D in train_shapes:
      q, k, v = _qkv(B, H, T, D, dtype)
      for impl in impls:
        for variant in (train_variants if impl == "dilution" else [None]):
          b = bs if variant is None else dataclasses.replace(
              bs or dilution.default_block_sizes(D, dtype, interpret), **B1_VARIANTS[variant])
          fn = _attn_fns(impl, D**-0.5, interpret, b)
          _entry(rows, "fwd", impl, (B, H, T, D), lambda fn=fn: _time(fn, (q, k, v), reps),
                 variant)
          _entry(rows, "fwd+bwd", impl, (B, H, T, D),
                 lambda fn=fn: _time(_fwd_bwd(fn), (q, k, v), reps), variant)
      del q, k, v

  if "prefill" not in skip:
    D = args.prefill_d
    for T in prefill_t:
      q, k, v = _qkv(1, 12, T, D, dtype)
      for variant in train_variants:
        b = bs if variant is None else dataclasses.replace(
            bs or dilution.default_block_sizes(D, dtype, interpret), **B1_VARIANTS[variant])
        fn = lambda q, k, v, b=b: dilution.dilution_prefill(q, k, v, scale=D**-0.5, block_sizes=b,
                                                            interpret=interpret)
        _entry(rows, "prefill", "dilution", (1, 12, T, D),
               lambda fn=fn: _time(fn, (q, k, v), reps), variant)
      if "cudnn" in impls:
        _entry(rows, "prefill", "cudnn", (1, 12, T, D),
               lambda: _time(_attn_fns("cudnn", D**-0.5, False, None), (q, k, v), reps))
      del q, k, v

  if "decode" not in skip:
    for S in decode_s:
      B, H, D = 1, 12, 64
      kc, vc, _ = _qkv(B, H, S, D, dtype, seed=1)
      q = jax.random.normal(jax.random.PRNGKey(2), (B, H, D), dtype)
      demand = jax.random.uniform(jax.random.PRNGKey(3), (B, H, S), jnp.float32)
      length = jnp.array([S - 7], jnp.int32)
      for impl in ("dilution", "xla"):
        if impl == "dilution":
          fn = lambda q, kc, vc, d, n: dilution.dilution_decode_step(
              q, kc, vc, d, n, scale=0.125, block_sizes=bs, interpret=interpret)
        else:
          fn = lambda q, kc, vc, d, n: dilution_reference.dilution_decode_step(q, kc, vc, d, n, scale=0.125)
        _entry(rows, "decode", impl, (B, H, S, D),
               lambda fn=fn: _time(fn, (q, kc, vc, demand, length), reps))

  if args.out:
    meta = dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                jax=jax.__version__, dtype=dtype.name, interpret=interpret, reps=reps)
    with open(args.out, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {args.out}")
  return rows


if __name__ == "__main__":
  main()
