"""An optional extra that is not installed: its command says which, in one line, exit 2."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is not None, reason="lm-eval installed")
def test_lm_eval_command_without_lm_eval_is_one_line():
  proc = subprocess.run([sys.executable, "-m", "focaljax.interop.lm_eval", "--tasks", "x"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip().count("\n") == 0 and ".[lmeval]" in proc.stderr, proc.stderr
