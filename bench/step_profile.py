"""Where a training step's time goes: kernel time by category and by model part, from a trace.

  python bench/step_profile.py --size 1.3b --impl auto --out profile_13b.json   # GPU
  python bench/step_profile.py --size small --seq_len 64 --impl xla --out /tmp/p.json  # CPU check

Runs bench/train_step.py's step (synthetic unpacked rows, no segment ids), then
`train_step.PROFILED_STEPS` more steps under `jax.profiler.trace`, and reads the trace back with
`jax.profiler.ProfileData` (no TensorBoard needed). Every device-side event (GPU: the
`/device:GPU:0` plane's stream lines; CPU: the host's XLA op lines) is put in one kernel
**category** by its name (GEMM, attention, collective, fusion kinds, copies) and in one **model
part** by the JAX name stack of its HLO op (the compiled step's metadata, looked up by the event's
`hlo_op` or its kernel name; else the trace's `tf_op`): embed, attention, mlp, logits/loss,
optimizer. Prints those tables, part × category, and the --top heaviest kernels (default 40) with
the op behind each, per step; writes them as JSON.
The step's measured time sets the denominator; kernel time past it means overlapping streams.
Timing belongs in benchmarks: this reads a trace, so nothing in tests depends on it.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: train_step
# XLA replays a GPU step as CUDA graphs ("command buffers"); their kernels all carry the graph's
# name (hlo_op "command_buffer_1") instead of their own HLO op, so the model-part table came out
# 100% "other". Off for the profile (the step time is printed beside the trace's, to compare).
if "--keep_command_buffers" not in sys.argv:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_gpu_enable_command_buffer=").strip()
import jax  # noqa: E402

import train_step  # noqa: E402

# (category, pattern over the lower-cased kernel name), first match wins.
CATEGORIES = (
    ("collective", r"nccl|all-reduce|all-gather|reduce-scatter|allreduce|allgather"),
    ("attention (cuDNN)", r"cudnn|fmha|flash|sdpa"),
    ("attention (Pallas)", r"focal|mosaic|pallas|_kernel$|dilution|condense"),
    ("GEMM", r"gemm|nvjet|cutlass|xmma|cublas|dot|matmul|sm90_|wgmma"),
    ("copy/memset", r"memcpy|memset|copy|transpose"),
    ("reduction fusion", r"reduce|input_"),
    ("elementwise fusion", r"fusion|loop_|convert|multiply|add|exp|select|broadcast"),
)
# (model part, pattern over the lower-cased tf_op / hlo name stack), first match wins.
# The scopes are decoder.py's / lm.py's jax.named_scope labels; the rest falls back on names.
PARTS = (  # scopes appear as "/attn/", "jvp(attn)" or "transpose(jvp(attn))"
    ("optimizer", r"[/(]optimizer[/)]|adam|apply_updates"),
    ("logits/loss", r"[/(](logits|loss)[/)]|cross_entropy"),
    ("attention", r"[/(]attn[/)]"),
    ("mlp", r"[/(]mlp[/)]"),
    ("embed", r"embed|gather|scatter"),
)


def classify(name: str, table) -> str:
  low = name.lower()
  for label, pattern in table:
    if re.search(pattern, low):
      return label
  return "other"


def device_events(path: str):
  """(kernel name, duration ns, name stack, stats) of every device-side event in one xplane.pb."""
  data = jax.profiler.ProfileData.from_file(path)
  planes = list(data.planes)
  gpu = [p for p in planes if p.name.startswith("/device:GPU")]
  chosen = gpu or [p for p in planes if p.name.startswith("/host:CPU")]
  for plane in chosen[:1]:  # device 0
    for line in plane.lines:
      if gpu and not re.search(r"stream", line.name, re.I):
        continue  # GPU planes also carry XLA module/op summary lines: count kernels once
      if not gpu and "XLA" not in line.name:
        continue
      for e in line.events:
        if not gpu and re.match(r"ThunkExecutor|SlinkyThreadPool", e.name):
          continue  # the CPU runtime's wrappers around the ops listed beside them
        stats = {}
        try:
          stats = {str(k): str(v) for k, v in e.stats}
        except (TypeError, ValueError):
          pass
        stack = stats.get("tf_op") or stats.get("name_stack") or stats.get("hlo_op") or e.name
        yield e.name, float(e.duration_ns), stack, stats


def op_names(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> its JAX name stack (metadata op_name) in the compiled step."""
  pattern = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name="([^"]+)"', re.M)
  # Kernel names spell the instruction's "." as "_" (loop_add_fusion.25 -> loop_add_fusion_25).
  return {k: v for m in pattern.finditer(hlo_text)
          for k, v in ((m.group(1), m.group(2)), (m.group(1).replace(".", "_"), m.group(2)))}


def fusion_bodies(hlo_text: str, kernels, limit: int = 8, max_lines: int = 30) -> dict[str, str]:
  """Kernel name -> the body of the fused computation it runs (metadata stripped, truncated).

  The op name alone (e.g. `transpose(jvp(attn))/reduce_sum`) does not say WHICH reduction a big
  fusion is; its body does (operand shapes, the reduced dimensions, what is fused in front).
  """
  calls = {}
  for m in re.finditer(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\bcalls=%?([\w.\-]+)', hlo_text, re.M):
    calls[m.group(1)] = calls[m.group(1).replace(".", "_")] = m.group(2)
  comps = {m.group(1): m.group(2) for m in re.finditer(
      r'^%?([\w.\-]+)\s*\(.*?\)\s*->\s*[^{\n]*\{\n(.*?)^\}', hlo_text, re.M | re.S)}
  out = {}
  for kernel in kernels:  # the first `limit` kernels that ARE fusions (cuBLAS/cuDNN have no body)
    body = comps.get(calls.get(kernel.split(" [")[0], ""))
    if body is not None and len(out) < limit:
      lines = [re.sub(r",\s*metadata=\{[^}]*\}", "", ln).strip() for ln in body.splitlines()]
      out[kernel] = "\n".join(lines[:max_lines] + (["..."] if len(lines) > max_lines else []))
  return out


def summarize(events, steps: int, step_ms: float, stacks: dict[str, str] | None = None,
              top: int = 25) -> dict:
  by_cat, by_part, by_kernel, by_both = (collections.Counter() for _ in range(4))
  op_of = {}  # kernel -> the JAX op name behind it (first seen), to tell e.g. which norm it is
  sample_stats = [stats for *_, stats in events[:5]]  # what the trace carries, to refine PARTS
  stacks = stacks or {}
  for name, ns, stack, stats in events:
    stack = stacks.get(stats.get("hlo_op", "")) or stacks.get(name) or stack
    cat, part = classify(name, CATEGORIES), classify(stack, PARTS)
    by_cat[cat] += ns
    by_part[part] += ns
    by_both[f"{part} / {cat}"] += ns
    by_kernel[f"{name} [{part}]"] += ns
    op_of.setdefault(f"{name} [{part}]", stack)
  per_step = lambda c: {k: v / steps / 1e6 for k, v in c.most_common()}  # ms per step
  total = sum(by_cat.values()) / steps / 1e6
  return {"step_ms": step_ms, "kernel_ms_per_step": total, "by_category_ms": per_step(by_cat),
          "by_part_ms": per_step(by_part), "by_part_category_ms": per_step(by_both),
          "top_kernels_ms": dict(list(per_step(by_kernel).items())[:top]),
          "top_kernel_ops": {k: op_of[k] for k in list(per_step(by_kernel))[:top]},
          "sample_stats": sample_stats}


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--size", default="1.3b")
  p.add_argument("--impl", default="auto", help="model.attention.implementation")
  p.add_argument("--pattern", default="focal")
  p.add_argument("--seq_len", type=int, default=2048)
  p.add_argument("--batch", type=int, default=0, help="global batch (0: the per-size default)")
  p.add_argument("--steps", type=int, default=5, help="timed steps before the traced ones")
  p.add_argument("--trace_dir", default="", help="keep the trace here (default: a temp dir)")
  p.add_argument("--out", default="bench_step_profile.json")
  p.add_argument("--keep_command_buffers", action="store_true",
                 help="leave XLA's CUDA graphs on (then kernels cannot be mapped to model parts)")
  p.add_argument("--overrides", default="",
                 help="config fields for the profiled step, e.g. optim.mu_dtype=bfloat16")
  p.add_argument("--top", type=int, default=40, help="list this many of the heaviest kernels")
  p.add_argument("--bodies", type=int, default=8,
                 help="print the fused HLO body of the top this many fusion kernels")
  args = p.parse_args()
  trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="focaljax-trace-")
  r = train_step.run(args.size, args.impl, args.steps, args.seq_len, remat=False,
                     batch=args.batch or None, pattern=args.pattern, segments=False,
                     profile_dir=trace_dir, overrides=train_step.parse_variant(args.overrides))
  found = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  if not found:
    raise SystemExit(f"no *.xplane.pb under {trace_dir}")
  with open(os.path.join(trace_dir, "step.hlo.txt")) as f:
    hlo_text = f.read()
  s = summarize(list(device_events(found[-1])), train_step.PROFILED_STEPS, r["step_ms"],
                op_names(hlo_text), top=args.top)
  s["top_kernel_bodies"] = fusion_bodies(hlo_text, list(s["top_kernels_ms"]), args.bodies)
  s.update(run=r, trace=found[-1], jax=jax.__version__, device=jax.devices()[0].device_kind)
  print(f"{args.size} {args.impl}: step {r['step_ms']:.1f} ms, MFU "
        f"{100 * (r['mfu'] or 0):.1f}%, kernel time {s['kernel_ms_per_step']:.1f} ms per step")
  for title, key in (("category", "by_category_ms"), ("model part", "by_part_ms"),
                     ("model part / category", "by_part_category_ms"),
                     ("kernel [model part]", "top_kernels_ms")):
    print(f"\n{title:<60} {'ms/step':>9} {'share':>7}")
    for k, ms in s[key].items():
      print(f"{k[:60]:<60} {ms:9.2f} {100 * ms / r['step_ms']:6.1f}%")
      if key == "top_kernels_ms":
        print(f"    {s['top_kernel_ops'][k][-96:]}")
  for k, body in s["top_kernel_bodies"].items():
    print(f"\n--- {k}\n{body}")
  with open(args.out, "w") as f:
    json.dump(s, f, indent=1)


if __name__ == "__main__":
  main()
