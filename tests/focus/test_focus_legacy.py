"""focus/legacy.py: runs saved in the .npz adapter layout convert to Orbax checkpoints."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import focus as focus_config
from focaljax import config as config_lib
from focaljax.focus import legacy
from focaljax.focus import model as focus
from focaljax.focus import train as focus_train
from focaljax.train import checkpoint
from focaljax.train import optim
from test_focus import REPO, perturbed, tiny_base


def test_old_npz_adapters_convert(tmp_path):
  """adapter/<step>/ (adapter.npz, focus.json, opt_state.npz) converts in place, optimizer state
  included, served with its eval prompt; loading it first names the command; an adapter of a
  removed arm is refused naming it."""
  base = tiny_base()
  adapter = perturbed(focus.init_adapter(base))
  c = focus_config.get_config()
  c.focus.update(base_workdir="/base", local_len=16, eval_prompt_len=6)
  checkpoint.write_config(str(tmp_path), c)
  opt_state = optim.make(config_lib.optim_config(c), adapter).init(adapter)
  old = {"chunk_size": 8, "prompt_len": 4, "sep_id": None, "implementation": "xla",
         "candidate_positions": "sequential", "candidate_bias": "none", "sink": "none",
         "candidate_path": "adapter"}
  d = tmp_path / "adapter" / "2"
  d.mkdir(parents=True)
  np.savez(d / "adapter.npz", **{f"{i}/{n}": np.asarray(w) for i, ws in adapter.items()
                                 for n, w in ws.items()})
  np.savez(d / "opt_state.npz", *[np.asarray(x) for x in jax.tree.leaves(opt_state)])
  (d / "focus.json").write_text(json.dumps({"config": old, "base_workdir": "/base"}))
  with pytest.raises(FileNotFoundError, match="python -m focaljax.focus.legacy"):
    focus_train.load(str(tmp_path), base)
  out = subprocess.run([sys.executable, "-m", "focaljax.focus.legacy", str(tmp_path)],
                       capture_output=True, text=True, cwd=REPO, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-2000:]
  loaded, cfg, meta = focus_train.load(str(tmp_path), base)
  jax.tree.map(np.testing.assert_array_equal, loaded, adapter)
  assert cfg.chunk_size == 8 and cfg.prompt_len == 6 and meta["local_len"] == 16
  assert meta["trained_prompt_len"] == 4 and meta["step"] == 2
  restored = checkpoint.Checkpointer(str(tmp_path)).restore(
      2, checkpoint.abstract_like(adapter), checkpoint.abstract_like(opt_state), None)[1]
  jax.tree.map(np.testing.assert_array_equal, restored, opt_state)
  del old["candidate_positions"]   # before that field: the "shared" layout, which is gone
  (d / "focus.json").write_text(json.dumps({"config": old, "base_workdir": "/base"}))
  with pytest.raises(ValueError, match="candidate_positions='shared'"):
    legacy.convert(str(tmp_path))


def test_bad_input_is_one_line_exit_2(tmp_path):
  # A language model's workdir, and a damaged focus.json: one line naming it, exit 2.
  from configs import smoke
  checkpoint.write_config(str(tmp_path), smoke.get_config())
  (tmp_path / "adapter" / "2").mkdir(parents=True)
  (tmp_path / "adapter" / "2" / "focus.json").write_text("{bad")
  run = lambda: subprocess.run([sys.executable, "-m", "focaljax.focus.legacy", str(tmp_path)],
                               capture_output=True, text=True, cwd=REPO, timeout=300)
  out = run()
  assert out.returncode == 2 and "language model's, not a FocusLLM run's" in out.stderr
  assert "Traceback" not in out.stderr
  c = json.loads((tmp_path / "config.json").read_text())
  c["focus"] = {}
  (tmp_path / "config.json").write_text(json.dumps(c))
  out = run()
  assert out.returncode == 2 and "focus.json: not JSON" in out.stderr, out.stderr
