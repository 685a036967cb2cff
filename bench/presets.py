"""The size presets as a user launches them: train.py with only --workdir, steps and warm-up.

  python bench/presets.py --out docs/results/presets_h100.json     # 1.3b and 400m
  python bench/presets.py --sizes 1.3b --steps 10
  XLA_FLAGS=... python bench/presets.py --sizes 1.3b --first_step_only   # start-up A/B, ~1 min

Per size: a cold launch (an empty compilation cache of its own), then the same command in a fresh
workdir with that cache now warm. Each row: the seconds from launching the process until the
first step started (imports and backend start included: the "first step started" line's arrival
less the first call it reports), that line's own split (data, compile, the init beside it, the
first call), the micro-batch it chose, and the last logged tokens/s, MFU and share of time the
device waited for input; a failed launch, its last line. No environment variables are set beyond
the cache directory: the rows are what `python train.py` gives. `--first_step_only` stops each
launch at its first step (no tokens/s or MFU): enough to compare start-up settings such as
XLA_FLAGS, which the launches inherit.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST = re.compile(r"first step started after ([\d.]+) s: data ([\d.]+) s, compile ([\d.]+) s "
                   r"\(init ([\d.]+) s beside it; micro-batch (\d+) x (\d+)[^)]*\); its call "
                   r"returned ([\d.]+) s later")
PACE = re.compile(r"tok/s=(\d+), mfu=([\d.]+)%, wait=(\d+)%")


def parse_log(text: str) -> dict:
  """train.py's output -> the row's numbers (absent ones left out)."""
  row = {}
  if m := FIRST.search(text):
    row.update(first_step_s=float(m[1]), data_s=float(m[2]), compile_s=float(m[3]),
               init_s=float(m[4]), micro_batch=int(m[5]), accumulation=int(m[6]),
               first_call_s=float(m[7]))
  if paces := PACE.findall(text):
    tok, mfu, wait = paces[-1]
    row.update(tokens_per_s=int(tok), mfu=round(float(mfu) / 100, 4),
               input_wait=round(float(wait) / 100, 4))
  return row


def launch(size: str, steps: int, workdir: str, cache: str, timeout: int,
           first_step_only: bool = False) -> dict:
  cmd = [sys.executable, "train.py", "--config", f"configs/focal.py:size={size}",
         "--workdir", workdir, f"--config.train.steps={steps}", "--config.optim.warmup_steps=2"]
  # Unbuffered: each line arrives when train.py prints it.
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  lines, seen = [], {}

  def read():  # the first-step line's arrival time, as the user sees it
    for line in proc.stdout:
      lines.append(line)
      if "first step started" in line and "launch" not in seen:
        seen["launch"] = time.perf_counter() - t0
        if first_step_only:
          proc.kill()

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  try:
    rc = proc.wait(timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    rc = "timeout"
  reader.join(10)
  if first_step_only and "launch" in seen:
    rc = "stopped at the first step"
  text = "".join(lines).replace("\r", "\n")
  row = {"command": " ".join(cmd[1:]), "rc": rc}
  if rc not in (0, "stopped at the first step"):   # why it failed, e.g. a flag XLA rejects
    row["last_line"] = next((x.strip() for x in reversed(text.splitlines()) if x.strip()), "")
  row.update(parse_log(text))
  if "launch" in seen and "first_call_s" in row:   # the line arrives once the first call returned
    row["launch_to_first_step_s"] = round(seen["launch"] - row["first_call_s"], 1)
  return row


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes", default="1.3b,400m")
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--timeout", type=int, default=300, help="seconds per launch")
  ap.add_argument("--first_step_only", action="store_true",
                  help="stop each launch at its first step (start-up only)")
  ap.add_argument("--out", default="presets.json")
  args = ap.parse_args()
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for size in args.sizes.split(","):
      cache = os.path.join(tmp, f"cache_{size}")
      for run in ("cold", "warm"):
        row = {"size": size, "cache": run,
               **launch(size, args.steps, os.path.join(tmp, f"{size}_{run}"), cache, args.timeout,
                        args.first_step_only)}
        rows.append(row)
        print(f"{size:>5} {run}: first step started {row.get('launch_to_first_step_s', '-')} s "
              f"after launch (train.py: {row.get('first_step_s', '-')} s; data "
              f"{row.get('data_s', '-')}, compile {row.get('compile_s', '-')}, init beside it "
              f"{row.get('init_s', '-')}, first call {row.get('first_call_s', '-')}), MFU "
              f"{row.get('mfu', '-')}, input wait {row.get('input_wait', '-')}, rc {row['rc']}"
              + (f": {row['last_line']}" if "last_line" in row else ""), flush=True)
  with open(args.out, "w") as f:
    json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
