"""End-to-end training step time and MFU of the focal configs, one implementation after another.

  python bench/train_step.py --sizes 400m,1.3b --impls cudnn,pallas,tokamax,xla --out step.json
  python bench/train_step.py --sizes 209m --seq_len 16384 --batch 1 --impls pallas \
      --patterns "softmax:rope;dilution:none" --out dilution_step.json   # issue 4's step ratio

Synthetic batches (random tokens, one document per row) so only the step is timed: the same
jitted, donated `trainer.train_step` that train.py runs, bf16 compute over float32 master
weights, on one device here (bench/scaling.py calls `run` over device meshes). MFU against the
device's dense bf16 peak (989 TFLOP/s on H100/H200), per device.

The best steps on record need more than jax's default 75% of the GPU: on one H200 the 400M
step at --batch 32 (46.4% MFU) and the 1.3B at --batch 24 (54.5%) ran with
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95, which bench/gpu_session.sh sets (docs/BENCHMARKS.md).
"""

import argparse
import ast
import contextlib
import dataclasses
import faulthandler
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from configs import base  # noqa: E402
from focaljax import config as config_lib  # noqa: E402
from focaljax import sharding
from focaljax.train import metrics
from focaljax.train import optim
from focaljax.train import loop as trainer  # noqa: E402
from focaljax.model import decoder as model_lib  # noqa: E402
from bench import dilution as dilution_bench  # noqa: E402
from bench import tokamax_shim  # noqa: E402
from pallas_kernels.dilution import api as dilution
from pallas_kernels.focal import mosaic as focal_mgpu  # noqa: E402

BATCH = {"400m": 16, "1.3b": 8, "small": 8, "tiny": 8}
PROFILED_STEPS = 3
# `bench.mgpu_backward=<choice>` in a --variants arm: the Mosaic kernel's backward for that arm
# alone (focal_mgpu.BlockSizes fields), to time a kernel choice end to end before it becomes a
# default. Not a config field: the kernels' tiles are not a model setting.
MGPU_BACKWARD = {
    "two_kernel": {"fused_backward": False, "joint_dq": False, "dq_halves": False},
    "fused": {"fused_backward": True, "joint_dq": False, "dq_halves": False},
    "fused_joint": {"fused_backward": True, "joint_dq": True, "dq_halves": False},
    "fused_halves": {"fused_backward": True, "joint_dq": False, "dq_halves": True},
    **{f"{kind}_{arm}": {"fused_backward": kind == "fused", "joint_dq": False,
                         "dq_halves": False, "dkv_step": "lean" if "lean" in arm else "plain",
                         "pingpong_backward": "pingpong" in arm,
                         "pingpong_dq": arm in ("pingpong", "lean_pingpong")}
       for kind in ("two_kernel", "fused")
       for arm in ("lean", "pingpong", "lean_pingpong", "lean_pingpong_dkv")},
    # Not a backward: the forward's intra-warpgroup overlap (BlockSizes.overlap_softmax).
    "overlap_fwd": {"overlap_softmax": True}}


# `bench.dilution_blocks=<choice>` likewise: pallas_kernels.dilution.api.BlockSizes.default with the
# fields of bench/dilution.py's B1_VARIANTS[choice] for that arm (the dilution kernels' settings
# before one becomes the default).
DILUTION_BLOCKS = dilution_bench.B1_VARIANTS


@contextlib.contextmanager
def patched_default(blocks_cls, table, field, choice):
  """`blocks_cls.default` (focal_mgpu's or dilution's BlockSizes) with the fields of
  table[choice] while an arm runs; `field` names the bench.* override in errors."""
  if choice is None:
    yield
    return
  if choice not in table:
    raise ValueError(f"{field}={choice!r}: want one of {sorted(table)}")
  default = blocks_cls.default
  blocks_cls.default = lambda *a, **kw: dataclasses.replace(default(*a, **kw), **table[choice])
  jax.clear_caches()  # the op's jit resolved block_sizes=None in an earlier arm
  try:
    yield
  finally:
    blocks_cls.default = default
    jax.clear_caches()


def parse_variant(text: str) -> dict:
  """"model.norm_backward=autodiff,optim.mu_dtype=bfloat16" -> {dotted field: value} ("" -> {})."""
  out = {}
  for item in filter(None, (t.strip() for t in text.split(","))):
    key, sep, value = item.partition("=")
    if not sep:
      raise ValueError(f"--variants: {item!r} is not field=value")
    if value.lower() in ("true", "false"):  # as ml_collections' command line spells booleans
      out[key] = value.lower() == "true"
      continue
    try:
      out[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      out[key] = value          # a bare string such as autodiff
  return out


def run(size, impl, steps, seq_len, remat, batch=None, fuse=False, pattern="focal",
        segments=True, mesh_shape=(1, 1, 1), profile_dir=None, overrides=None):
  """One timed configuration. `mesh_shape` (data, fsdp, tensor) takes the first data·fsdp·tensor
  devices, with train.py's shardings (the logical-axis rules); `batch` is the global batch.
  `profile_dir`: after timing, 3 more steps under jax.profiler.trace there (bench/step_profile.py).
  `overrides`: {dotted config field: value}, applied last and validated like train.py's (and
  `bench.mgpu_backward`, see MGPU_BACKWARD)."""
  config_overrides = dict(overrides or {})
  with patched_default(focal_mgpu.BlockSizes, MGPU_BACKWARD, "bench.mgpu_backward",
                       config_overrides.pop("bench.mgpu_backward", None)), patched_default(
      dilution.BlockSizes, DILUTION_BLOCKS, "bench.dilution_blocks",
      config_overrides.pop("bench.dilution_blocks", None)):
    r = _run(size, impl, steps, seq_len, remat, batch, fuse, pattern, segments, mesh_shape,
             profile_dir, config_overrides)
  return dict(r, overrides=overrides or {})


def _run(size, impl, steps, seq_len, remat, batch, fuse, pattern, segments, mesh_shape,
         profile_dir, overrides):
  c = base.get_config(f"size={size}")
  c.model.attention.pattern = pattern
  c.model.attention.implementation = impl
  c.model.remat = remat
  c.model.fuse_matmuls = fuse
  c.data.seq_len = seq_len
  c.data.global_batch = batch or BATCH.get(size, 8)
  if overrides:
    c.update_from_flattened_dict(overrides)
    config_lib.validate(c)
  cfg = config_lib.model_config(c, c.model.vocab_size or 32000)
  graphdef, abstract_state = nnx.split(
      nnx.eval_shape(lambda: model_lib.Transformer(cfg, nnx.Rngs(0))))
  n = int(np.prod(mesh_shape))
  mesh = sharding.make_mesh(*mesh_shape, devices=jax.devices()[:n])
  param_sh = sharding.param_shardings(abstract_state, mesh)
  batch_sh = sharding.batch_sharding(mesh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  tx = optim.make(config_lib.optim_config(c), nnx.to_pure_dict(abstract_state))
  step_cfg = trainer.StepConfig(compute_dtype=jnp.bfloat16, grad_accum=1, skip_nonfinite=False,
                                cross_entropy=c.train.cross_entropy)
  params, opt_state, opt_sh = trainer.init_state(cfg, tx, param_sh, mesh, jax.random.key(0))
  with jax.set_mesh(mesh):
    step = jax.jit(functools.partial(trainer.train_step, graphdef=graphdef, tx=tx, cfg=step_cfg),
                   in_shardings=(param_sh, opt_sh, batch_sh),
                   out_shardings=(param_sh, opt_sh, replicated), donate_argnums=(0, 1))
  B, T = c.data.global_batch, seq_len
  rng = np.random.default_rng(0)
  batch = {"inputs": jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32),
           "targets": jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32),
           "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
           "weights": jnp.ones((B, T), jnp.float32)}
  if segments:  # what packed training passes (one segment per synthetic row, but a mask to apply)
    batch["segment_ids"] = jnp.ones((B, T), jnp.int32)
  batch = jax.device_put(batch, batch_sh)
  with jax.set_mesh(mesh):
    t0 = time.perf_counter()
    if profile_dir:  # compiled ahead, so the trace's HLO op names can be mapped to the model
      step = step.lower(params, opt_state, batch).compile()
      os.makedirs(profile_dir, exist_ok=True)
      with open(os.path.join(profile_dir, "step.hlo.txt"), "w") as f:
        f.write(step.as_text())
    # Phases on stderr as they happen: a run cut off by a time limit still says where it was
    # (thirty-first session: the tokamax steps printed nothing before their limits).
    print(f"[{size} {impl}] compiling and running the first step", file=sys.stderr, flush=True)
    params, opt_state, m = step(params, opt_state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    print(f"[{size} {impl}] first step done after {compile_s:.1f} s", file=sys.stderr, flush=True)
    for _ in range(2):
      params, opt_state, m = step(params, opt_state, batch)
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
      t0 = time.perf_counter()
      params, opt_state, m = step(params, opt_state, batch)
      jax.block_until_ready(m)
      times.append(time.perf_counter() - t0)
    if profile_dir:
      with jax.profiler.trace(profile_dir):
        for _ in range(PROFILED_STEPS):
          params, opt_state, m = step(params, opt_state, batch)
        jax.block_until_ready(m)
  dt = float(np.median(times))
  tokens = B * T
  flops = metrics.flops_per_token(cfg) * tokens
  peak = metrics.peak_flops_per_device()
  return {"size": size, "impl": impl, "pattern": pattern, "segments": segments, "batch": B,
          "seq_len": T, "remat": remat, "mesh": list(mesh_shape), "devices": n,
          "fuse_matmuls": fuse, "overrides": overrides or {},
          "params": model_lib.param_count(cfg), "step_ms": dt * 1e3, "tokens_per_s": tokens / dt,
          "tokens_per_s_per_device": tokens / dt / n,
          "tflops": flops / dt / 1e12, "mfu": (flops / dt / n / peak) if peak else None,
          "compile_s": compile_s, "loss": float(m["loss"])}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--sizes", default="400m,1.3b")
  p.add_argument("--impls", default="cudnn,pallas,tokamax,xla")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--seq_len", type=int, default=2048)
  p.add_argument("--remat", action="store_true")
  p.add_argument("--fused", action="store_true", help="one GEMM for q/k/v and one for gate/up")
  p.add_argument("--batch", type=int, default=0, help="global batch (0: the per-size default)")
  p.add_argument("--patterns", default="focal",
                  help="model.attention.pattern values separated by ';', e.g. "
                  "'softmax:rope;dilution:none' (issue 4: the 209M models at 16K, --batch 1)")
  p.add_argument("--no_segments", action="store_true",
                  help="no segment ids in the batch (unpacked rows): no attention mask, and the "
                  "Mosaic kernel is eligible; the plain-JAX anchor's setting")
  p.add_argument("--variants", default="",
                 help="config overrides per A/B arm, arms separated by ';', fields by ',', e.g. "
                 "';model.norm_backward=autodiff;optim.mu_dtype=bfloat16' (the empty arm: "
                 "the defaults); every arm runs for every size, pattern and implementation")
  p.add_argument("--out", default="bench_train_step.json")
  args = p.parse_args()
  rows = []
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
  variants = [parse_variant(v) for v in args.variants.split(";")]
  runs = [(s, i, pat, v) for s in args.sizes.split(",") for pat in args.patterns.split(";")
          for i in args.impls.split(",") for v in variants]
  if "tokamax" in args.impls.split(","):
    tokamax_shim.prepare()
  # STEP_STACK_EVERY=<s>: the Python stack on stderr every s seconds, so a run cut off by a time
  # limit says whether it was compiling, in tokamax's Python, or running (the tokamax steps).
  # Off by default: one tokamax run segfaulted while a dump was being printed mid-lowering.
  if every := float(os.environ.get("STEP_STACK_EVERY", "0")):
    faulthandler.dump_traceback_later(every, repeat=True)
  for size, impl, pattern, variant in runs:
    try:
      r = run(size, impl, args.steps, args.seq_len, args.remat, args.batch or None,
              args.fused, pattern, not args.no_segments, overrides=variant)
    except Exception as e:  # one failing implementation must not lose the table
      r = {"size": size, "impl": impl, "pattern": pattern, "overrides": variant,
           "error": f"{type(e).__name__}: {str(e)[:300]}"}
    rows.append(r)
    print(json.dumps(r), flush=True)
  print(f"\n{'size':>6} {'pattern':>26} {'impl':>8} {'variant':>30} {'step ms':>9} {'tok/s':>9} "
        f"{'TFLOP/s':>8} {'MFU':>6}")
  for r in rows:
    arm = ",".join(f"{k.split('.')[-1]}={v}" for k, v in r["overrides"].items()) or "defaults"
    head = f"{r['size']:>6} {r['pattern']:>26} {r['impl']:>8} {arm:>30}"
    if "error" in r:
      print(f"{head}  error: {r['error'][:80]}")
    else:
      mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"
      print(f"{head} {r['step_ms']:9.1f} {r['tokens_per_s']:9.0f} {r['tflops']:8.1f} {mfu:>6}")
  with open(args.out, "w") as f:
    json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": rows}, f,
              indent=1)


if __name__ == "__main__":
  main()
