"""The instruction mix of a Mosaic GPU kernel's loops, from its PTX, on a machine without a GPU.

`bash bench/gpu_session.sh ptx:120` (focal) or `dilution_ptx:120` bring the kernels' PTX back
from the H200; this compiles each file with ptxas for sm_90a, disassembles it with cuobjdump and
prints, per loop that issues wgmmas (a backward branch's target..branch range), how many SASS
instructions it has and of which kinds: HGMMA (wgmma), MUFU (exp2, rcp), FFMA/FMUL/FADD, F2FP
(float32 → 16-bit packs), LDS/STS (shared memory), LDL/STL (register spills), IMAD. With ptxas's
spill report beside it, that says whether a step is bound by spills or by issuing its
elementwise work (twenty-seventh session: the dk/dv kernel's unmasked step is 387 instructions,
"lean" made it 456 and slower, with fewer spills).

Needs `ptxas` (CUDA 12 or later, for sm_90a) and `cuobjdump` on PATH; without a CUDA install they
come from the nvidia-cuda-nvcc and nvidia-cuda-cuobjdump wheels (pip download, unzip, bin/).

  python bench/sass_loops.py out/ptx/focal_mgpu_dkv_2.ptx [more.ptx ...] [--out loops.json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# Opcode prefixes counted per loop, in the order printed.
KINDS = ("HGMMA", "MUFU", "FFMA", "FMUL", "FADD", "F2FP", "LDS", "STS", "LDL", "STL", "IMAD")
_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")
_BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")


def instructions(sass: str) -> list[tuple[int, str]]:
  """(address, instruction text without its predicate) of every SASS line of `sass`."""
  out = []
  for line in sass.splitlines():
    m = _INSTR.match(line)
    if m:
      out.append((int(m.group(1), 16), _PRED.sub("", m.group(2))))
  return out


def loops(sass: str, min_instructions: int = 60) -> list[dict]:
  """Per backward branch (target < branch address) whose range holds at least
  `min_instructions` instructions and a wgmma: its range, length and KINDS counts; innermost
  (shortest) first. Spin-waits on barriers are short backward branches and drop out."""
  ins = instructions(sass)
  found = []
  for addr, text in ins:
    m = _BRANCH.search(text)
    if not m or int(m.group(1), 16) >= addr:
      continue
    start = int(m.group(1), 16)
    ops = [t.split()[0] for a, t in ins if start <= a <= addr]
    counts = {k: sum(op.startswith(k) for op in ops) for k in KINDS}
    if len(ops) >= min_instructions and counts["HGMMA"]:
      found.append({"start": hex(start), "end": hex(addr), "instructions": len(ops), **counts})
  return sorted(found, key=lambda r: r["instructions"])


def compile_and_read(ptx: Path) -> tuple[str, str]:
  """(ptxas -v report, cuobjdump -sass text) of one PTX file for sm_90a."""
  with tempfile.TemporaryDirectory() as tmp:
    cubin = Path(tmp) / "k.cubin"
    rep = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx), "-o", str(cubin)],
                         capture_output=True, text=True, check=True)
    sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
  return rep.stderr + rep.stdout, sass


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("ptx", nargs="+", type=Path)
  ap.add_argument("--loops", type=int, default=4, help="innermost loops printed per kernel")
  ap.add_argument("--out", help="write every kernel's loops and spill line as JSON here")
  a = ap.parse_args()
  rows = {}
  print(f"{'kernel / loop':<44} {'instr':>6} " + " ".join(f"{k:>5}" for k in KINDS))
  for ptx in a.ptx:
    report, sass = compile_and_read(ptx)
    spill = next((line.strip() for line in report.splitlines() if "spill stores" in line
                  and "warning" not in line), "")
    found = loops(sass)
    rows[ptx.name] = {"spills": spill, "loops": found}
    print(f"{ptx.name}: {spill}")
    for r in found[:a.loops]:
      print(f"  {r['start']}-{r['end']:<30} {r['instructions']:>6} "
            + " ".join(f"{r[k]:>5}" for k in KINDS))
  if a.out:
    Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  sys.exit(main())
