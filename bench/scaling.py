"""Sharded training across the GPUs of one host: weak scaling and a mesh-changing restore.

  python bench/scaling.py --out scaling.json                     # every GPU of this host
  python bench/scaling.py --gpus 2 --only focal --steps 5        # a subset
  python bench/scaling.py --only focal --xla --layouts fsdp,fsdp+xla   # with/without XLA flags

Per GPU the work is fixed (weak scaling): global batch = per-GPU batch x GPUs. Each row times the
same jitted, donated `lm.train_step` that train.py runs, with train.py's shardings (the
logical-axis rules in focaljax/sharding.py), through `bench/train_step.run`:
  focal     the 1.3B focal config at 2K, 8 rows per GPU, cuDNN attention: one GPU, then pure data
            parallelism (N,1,1), FSDP (1,N,1), and FSDP x tensor (1,N/2,2) -- at N=2 that is pure
            tensor parallelism (1,1,2).
  dilution  the 209M dilution config at 16K, one row per GPU, the Pallas kernels (run per device
            under shard_map): one GPU, then FSDP (1,N,1).
Weak-scaling efficiency = tokens/s per GPU on N GPUs / tokens/s on one GPU, same run.

Each row runs in its own process (a fresh memory pool) under --row_timeout: a row that hangs or
compiles for minutes is recorded as such, with the Python stack faulthandler prints shortly
before the limit, and the table goes on.

`--ckpt`: saved on N GPUs, restored on one. train.py (configs/smoke.py, the bundled text) trains
8 steps under FSDP over N GPUs with a checkpoint at step 4; the step-8 checkpoint is dropped and
the run resumes on one GPU; its losses for steps 5-8 are compared with an uninterrupted one-GPU
run's. Then the reverse: saved on one GPU, resumed under FSDP x tensor on N.
"""

import argparse
import faulthandler
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import train_step  # noqa: E402  (bench/ is on sys.path as the script's directory)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (size, pattern, implementation, seq_len, rows per GPU, meshes for N GPUs)
WORKLOADS = {
    "focal": ("1.3b", "focal", "cudnn", 2048, 8,
              lambda n: {"data": (n, 1, 1), "fsdp": (1, n, 1),
                         "fsdp_x_tensor": (1, max(n // 2, 1), 2)}),
    "dilution": ("209m", "dilution:none", "pallas", 16384, 1,
                 lambda n: {"fsdp": (1, n, 1)}),
}
CKPT_STEPS, CKPT_AT = 8, 4
# `--xla`: every sharded layout again as "<layout>+xla" with these flags (MaxText's GPU set, less
# the while-loop ones: our layers are unrolled): overlap collectives with compute, combine small
# ones, and skip the memory-driven rematerialisation pass (suspected of the slow TP compile).
XLA_OVERLAP = ("--xla_gpu_enable_latency_hiding_scheduler=true "
               "--xla_gpu_enable_highest_priority_async_stream=true "
               "--xla_gpu_all_gather_combine_threshold_bytes=134217728 "
               "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728 "
               "--xla_gpu_all_reduce_combine_threshold_bytes=134217728 "
               "--xla_disable_hlo_passes=rematerialization")


def _layouts(name, n, xla=False):
  sharded = list(WORKLOADS[name][5](n).items())
  extra = [(f"{label}+xla", mesh) for label, mesh in sharded] if xla else []
  return [("1 GPU", (1, 1, 1)), *sharded, *extra]


def run_row(name, n, label, steps, smoke):
  """One (workload, layout) row, in this process: the child side of `scaling`."""
  size, pattern, impl, seq_len, rows, _ = WORKLOADS[name]
  if smoke:  # CPU plumbing check: tiny model, short rows, no cuDNN
    size, seq_len, impl = "small", 64, "xla" if impl == "cudnn" else impl
  mesh = dict(_layouts(name, n, xla=True))[label]
  gpus = int(np.prod(mesh))
  r = train_step.run(size, impl, steps, seq_len, remat=False, batch=rows * gpus,
                     pattern=pattern, segments=False, mesh_shape=mesh)
  r.update(workload=name, layout=label)
  return r


def scaling(name, n, steps, smoke, row_timeout, xla=False, only_layouts=None):
  out = []
  for label, mesh in _layouts(name, n, xla):
    if only_layouts and label != "1 GPU" and label not in only_layouts:
      continue
    cmd = [sys.executable, os.path.abspath(__file__), "--row", f"{name}:{label}",
           "--gpus", str(n), "--steps", str(steps), "--row_timeout", str(row_timeout)]
    env = dict(os.environ)
    flags = XLA_OVERLAP if label.endswith("+xla") else ""
    if flags:
      env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    if smoke:
      cmd.append("--smoke")
      env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} "
                          f"--xla_force_host_platform_device_count={n}").strip()
    try:
      p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=row_timeout)
      found = [l[4:] for l in p.stdout.splitlines() if l.startswith("ROW ")]
      r = json.loads(found[-1]) if found else {
          "error": f"exit {p.returncode}: {(p.stdout + p.stderr)[-1500:]}"}
    except subprocess.TimeoutExpired as e:
      tail = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
      r = {"error": f"no result within {row_timeout} s; last output: {tail[-3000:]}"}
    r.update(workload=name, layout=label, mesh=list(mesh), devices=int(np.prod(mesh)),
             xla_flags=flags)
    out.append(r)
    print(json.dumps(r), flush=True)
  base = out[0].get("tokens_per_s_per_device")
  for r in out:
    if base and "tokens_per_s_per_device" in r:
      r["weak_scaling_efficiency"] = r["tokens_per_s_per_device"] / base
  return out


def _train(workdir, gpus, mesh, smoke, steps=CKPT_STEPS):
  env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, range(gpus))))
  if smoke:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={gpus}"
  cmd = [sys.executable, os.path.join(REPO, "train.py"), "--config",
         os.path.join(REPO, "configs", "smoke.py"), "--workdir", workdir,
         f"--config.train.steps={steps}", "--config.train.log_every=1",
         "--config.train.eval_every=0", f"--config.train.ckpt_every={CKPT_AT}",
         f"--config.mesh.data={mesh[0]}", f"--config.mesh.fsdp={mesh[1]}",
         f"--config.mesh.tensor={mesh[2]}"]
  p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
  if p.returncode:
    raise RuntimeError(f"train.py on {gpus} GPU(s), mesh {mesh}: {p.stdout[-1500:]}"
                       f"{p.stderr[-1500:]}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def mesh_change(n, smoke):
  """Two resumes across a mesh change; each compared with an uninterrupted run on one GPU."""
  root = tempfile.mkdtemp(prefix="ckpt_")
  ref = _train(os.path.join(root, "ref"), 1, (1, 1, 1), smoke)
  out = []
  for label, (save_gpus, save_mesh), (load_gpus, load_mesh) in (
      (f"saved FSDP on {n}, restored on 1", (n, (1, n, 1)), (1, (1, 1, 1))),
      (f"saved on 1, restored FSDP x tensor on {n}", (1, (1, 1, 1)),
       (n, (1, max(n // 2, 1), 2)))):
    wd = os.path.join(root, label.replace(" ", "_").replace(",", ""))
    _train(wd, save_gpus, save_mesh, smoke)
    shutil.rmtree(os.path.join(wd, "checkpoints", str(CKPT_STEPS)))
    with open(os.path.join(wd, "metrics.jsonl")) as f:
      keep = [l for l in f if l.strip() and json.loads(l).get("step", 0) <= CKPT_AT]
    with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
      f.writelines(keep)
    resumed = _train(wd, load_gpus, load_mesh, smoke)
    later = [s for s in sorted(resumed) if s > CKPT_AT]
    diff = max(abs(resumed[s] - ref[s]) / abs(ref[s]) for s in later)
    r = {"case": label, "steps_compared": later, "max_rel_loss_diff": diff,
         "resumed": [resumed[s] for s in later], "uninterrupted_1gpu": [ref[s] for s in later],
         "ok": bool(later) and diff < 1e-2}
    out.append(r)
    print(json.dumps(r), flush=True)
  shutil.rmtree(root, ignore_errors=True)
  return out


def _gpu_count() -> int:
  p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
  return sum(line.startswith("GPU") for line in p.stdout.splitlines())


def _gpu_name() -> str:
  p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                     capture_output=True, text=True) if shutil.which("nvidia-smi") else None
  return p.stdout.splitlines()[0] if p and p.stdout else "cpu"


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--gpus", type=int, default=0, help="N (0: every visible device)")
  p.add_argument("--only", default=",".join(WORKLOADS), help=f"comma list of {list(WORKLOADS)}")
  p.add_argument("--steps", type=int, default=8, help="timed steps per row (median)")
  p.add_argument("--ckpt", action="store_true", help="also the mesh-changing restore")
  p.add_argument("--smoke", action="store_true", help="tiny shapes: a CPU check of the plumbing")
  p.add_argument("--row_timeout", type=int, default=240, help="seconds per row (own process)")
  p.add_argument("--xla", action="store_true", help="also each sharded layout with XLA_OVERLAP")
  p.add_argument("--layouts", default="", help="comma list of layouts to run (default: all; "
                 "'1 GPU' always runs, as the baseline), e.g. fsdp,fsdp+xla")
  p.add_argument("--row", help=argparse.SUPPRESS)  # "workload:layout": the child process
  p.add_argument("--out", default="bench_scaling.json")
  args = p.parse_args()
  if args.row:
    # Where a stuck row is stuck (compiling, or waiting in a step), before the parent kills it.
    faulthandler.dump_traceback_later(max(args.row_timeout - 15, 5), exit=False)
    name, label = args.row.split(":", 1)
    print("ROW " + json.dumps(run_row(name, args.gpus, label, args.steps, args.smoke)), flush=True)
    return
  # The parent never initialises a GPU backend (that would take the memory the rows need).
  # --smoke simulates its devices (XLA_FLAGS in each row's process): 2 unless --gpus says more.
  n = args.gpus or (2 if args.smoke else _gpu_count())
  if n < 2:
    raise SystemExit(f"--gpus: need at least 2 devices; got {n}")
  print(f"jax {jax.__version__}, {n} devices", flush=True)
  ckpt = mesh_change(n, args.smoke) if args.ckpt else []
  rows = [r for w in args.only.split(",") if w
          for r in scaling(w, n, args.steps, args.smoke, args.row_timeout, args.xla,
                           [l for l in args.layouts.split(",") if l])]
  print(f"\n{'workload':>9} {'layout':>14} {'mesh':>10} {'step ms':>8} {'tok/s/GPU':>10} "
        f"{'MFU':>6} {'weak eff':>8}")
  for r in rows:
    head = f"{r['workload']:>9} {r['layout']:>14} {str(tuple(r['mesh'])):>10}"
    if "error" in r:
      print(f"{head}  error: {r['error'][:70]}")
      continue
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"
    eff = r.get("weak_scaling_efficiency")
    print(f"{head} {r['step_ms']:8.1f} {r['tokens_per_s_per_device']:10.0f} {mfu:>6} "
          f"{'' if eff is None else f'{100 * eff:.1f}%':>8}")
  for r in ckpt:
    print(f"{r['case']}: max relative loss difference {r['max_rel_loss_diff']:.2e} over steps "
          f"{r['steps_compared']} -> {'ok' if r['ok'] else 'MISMATCH'}")
  with open(args.out, "w") as f:
    json.dump({"jax": jax.__version__, "device": _gpu_name(), "gpus": n,
               "rows": rows, "mesh_change": ckpt}, f, indent=1)


if __name__ == "__main__":
  main()
