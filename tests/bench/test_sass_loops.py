"""bench/sass_loops.py finds a kernel's wgmma loops in cuobjdump's SASS and counts their mix.

Invariant: on a SASS listing (here a hand-made one in cuobjdump's line format), `loops` returns
each backward branch's range that issues a wgmma, innermost first, with per-kind counts that
ignore predicates; short spin-wait loops and loops without HGMMA are left out. ptxas and
cuobjdump themselves are not needed (the listing is given).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import sass_loops  # noqa: E402  (a script directory, not a package)


def _line(addr: int, text: str) -> str:
  return f"        /*{addr:04x}*/                   {text} ;                /* 0x000000 */"


def _listing():
  lines, addr = [], 0x100
  def emit(text):
    nonlocal addr
    lines.append(_line(addr, text))
    addr += 0x10
    return addr - 0x10
  emit("MOV R1, c[0x0][0x28]")
  spin = emit("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR7], R2")
  emit(f"@!P1 BRA 0x{spin:x}")                      # a spin-wait: short, no wgmma
  outer = emit("WARPGROUP.ARRIVE")
  inner = emit("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT")
  for _ in range(40):
    emit("FFMA R2, R3, R4, R5")
  for _ in range(30):
    emit("MUFU.EX2 R6, R7")
  emit("@P2 LDL R8, [R1+0x4]")                      # a predicated spill load counts as LDL
  emit(f"@P0 BRA 0x{inner:x}")                      # inner loop: 73 instructions
  for _ in range(10):
    emit("F2FP.BF16.F32.PACK_AB R9, R10, R11")
  emit(f"BRA 0x{outer:x}")                          # outer loop: 85 instructions
  no_mma = emit("FMUL R1, R2, R3")
  for _ in range(70):
    emit("FADD R1, R2, R3")
  emit(f"BRA 0x{no_mma:x}")                         # long, but no wgmma
  return "\n".join(["Function : k", *lines])


def test_loops_innermost_first_with_counts():
  found = sass_loops.loops(_listing())
  assert [r["instructions"] for r in found] == [73, 85]
  inner, outer = found
  assert (inner["HGMMA"], inner["FFMA"], inner["MUFU"], inner["LDL"]) == (1, 40, 30, 1)
  assert (outer["F2FP"], outer["HGMMA"]) == (10, 1)
  assert inner["start"] == "0x140"


def test_short_or_mma_free_loops_drop_out():
  assert all(r["HGMMA"] for r in sass_loops.loops(_listing()))
  assert sass_loops.loops(_listing(), min_instructions=80)[0]["instructions"] == 85
