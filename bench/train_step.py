"""End-to-end training step time and MFU of the focal configs, one implementation after another.

  python bench/train_step.py --sizes 400m,1.3b --impls auto,cudnn,pallas,tokamax,xla --out step.json
  python bench/train_step.py --sizes 209m --seq_len 16384 --batch 1 --impls pallas \
      --patterns "softmax:rope;dilution:none" --out dilution_step.json

Synthetic batches (random tokens, one document per row) so only the step is timed: the same
jitted, donated `lm.train_step` that train.py runs, bf16 compute over float32 master weights,
on one device here (bench/scaling.py calls `run` over device meshes). MFU against the device's
dense bf16 peak, per device. The glue passes are whatever focaljax.dispatch picks here.

The large batches need more than jax's default 75% of the GPU's memory:
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (docs/performance.md).
"""

import argparse
import ast
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

from bench import tokamax_shim  # noqa: E402
from configs import base  # noqa: E402
from focaljax import config as config_lib  # noqa: E402
from focaljax import sharding  # noqa: E402
from focaljax.model import decoder as model_lib  # noqa: E402
from focaljax.train import lm  # noqa: E402
from focaljax.train import loop  # noqa: E402
from focaljax.train import metrics  # noqa: E402
from focaljax.train import optim  # noqa: E402

BATCH = {"400m": 16, "1.3b": 8, "small": 8, "tiny": 8}   # global batch when --batch is 0
PROFILED_STEPS = 3


def parse_variant(text: str) -> dict:
  """"model.remat=true,optim.mu_dtype=bfloat16" -> {dotted field: value} ("" -> {})."""
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
      out[key] = value          # a bare string such as bfloat16
  return out


def run(size, impl, steps, seq_len, remat, batch=None, pattern="focal", segments=True,
        mesh_shape=(1, 1, 1), profile_dir=None, overrides=None):
  """One timed configuration. `mesh_shape` (data, fsdp, tensor) takes the first data·fsdp·tensor
  devices, with train.py's shardings (the logical-axis rules); `batch` is the global batch.
  `profile_dir`: after timing, 3 more steps under jax.profiler.trace there (bench/step_profile.py).
  `overrides`: {dotted config field: value}, applied last and validated like train.py's."""
  c = base.get_config(f"size={size}")
  c.model.attention.pattern = pattern
  c.model.attention.implementation = impl
  c.model.remat = remat
  c.data.seq_len = seq_len
  c.data.global_batch = batch or BATCH.get(size, 8)
  if overrides:
    c.update_from_flattened_dict(overrides)
  config_lib.validate(c)
  cfg = config_lib.model_config(c, c.model.vocab_size or 32000)
  graphdef, abstract_state = model_lib.abstract_model(cfg)
  n = int(np.prod(mesh_shape))
  mesh = sharding.make_mesh(*mesh_shape, devices=jax.devices()[:n])
  param_sh = sharding.param_shardings(abstract_state, mesh)
  batch_sh = sharding.batch_sharding(mesh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  tx = optim.make(config_lib.optim_config(c), nnx.to_pure_dict(abstract_state))
  step_cfg = loop.StepConfig(compute_dtype=jnp.bfloat16, grad_accum=1, skip_nonfinite=False)
  params, opt_state, opt_sh = lm.init_state(cfg, tx, param_sh, mesh, jax.random.key(0))
  with jax.set_mesh(mesh):
    step = jax.jit(functools.partial(lm.train_step, graphdef=graphdef, tx=tx, cfg=step_cfg),
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
    # Phases on stderr as they happen: a run cut off by a time limit still says where it was.
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
          "overrides": overrides or {},
          "params": model_lib.param_count(cfg), "step_ms": dt * 1e3, "tokens_per_s": tokens / dt,
          "tokens_per_s_per_device": tokens / dt / n,
          "tflops": flops / dt / 1e12, "mfu": (flops / dt / n / peak) if peak else None,
          "compile_s": compile_s, "loss": float(m["loss"])}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--sizes", default="400m,1.3b")
  p.add_argument("--impls", default="auto,cudnn,pallas,tokamax,xla",
                 help="model.attention.implementation values")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--seq_len", type=int, default=2048)
  p.add_argument("--remat", action="store_true")
  p.add_argument("--batch", type=int, default=0, help="global batch (0: the per-size default)")
  p.add_argument("--patterns", default="focal",
                  help="model.attention.pattern values separated by ';', e.g. "
                  "'softmax:rope;dilution:none' (the 209M models at 16K, --batch 1)")
  p.add_argument("--no_segments", action="store_true",
                  help="no segment ids in the batch (unpacked rows): no attention mask, and the "
                  "Mosaic kernel is eligible; the plain-JAX anchor's setting")
  p.add_argument("--variants", default="",
                 help="config overrides per A/B arm, arms separated by ';', fields by ',', e.g. "
                 "';model.remat=true;optim.mu_dtype=bfloat16' (the empty arm: "
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
      r = run(size, impl, args.steps, args.seq_len, args.remat, args.batch or None, pattern,
              not args.no_segments, overrides=variant)
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
