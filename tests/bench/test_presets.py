"""bench/presets.py reads train.py's own first-step line (no GPU)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import presets  # noqa: E402  (a script directory, not a package)

from focaljax.train import startup  # noqa: E402


def test_the_first_step_line_parses_with_its_split():
  line = startup.first_step_line(0.0, {"data": 0.1, "init": 2.5}, 0.2, 7.9, 9.0, 3.9, 8, 128)
  row = presets.parse_log(f"set-up 10.0 s\n{line}\n"
                          "  5/10 [tok/s=60353, mfu=50.5%, wait=1%]\n")
  split = (row["first_step_s"], row["data_s"], row["compile_s"], row["init_s"])
  assert split == (9.0, 0.3, 7.9, 2.5)
  assert row["first_call_s"] == 3.9 and (row["micro_batch"], row["accumulation"]) == (8, 16)
  assert (row["tokens_per_s"], row["mfu"], row["input_wait"]) == (60353, 0.505, 0.01)
