"""Sharded training: the same losses on 1 device, on 8 simulated CPU devices (data, FSDP and
tensor parallel), and on 2 processes with CPU collectives."""

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from focaljax import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4


def _train(workdir, devices=1, extra=(), env_extra=None, wait=True):
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  env.update(env_extra or {})
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config",
         os.path.join(ROOT, "configs", "smoke.py"), "--workdir", str(workdir),
         f"--config.train.steps={STEPS}", "--config.train.log_every=1",
         "--config.train.eval_every=0", "--config.train.ckpt_every=100", *extra]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
  if not wait:
    return proc
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out.decode()[-3000:]
  return _losses(workdir)


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return np.array([r["loss"] for r in rows if "loss" in r])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
  return _train(tmp_path_factory.mktemp("one"), devices=1)


@pytest.mark.parametrize("mesh", [(8, 1, 1), (2, 2, 2), (1, 4, 2)])
def test_eight_devices_match_one(single, mesh, tmp_path):
  data, fsdp, tensor = mesh
  losses = _train(tmp_path, devices=8, extra=[f"--config.mesh.data={data}",
                                              f"--config.mesh.fsdp={fsdp}",
                                              f"--config.mesh.tensor={tensor}"])
  assert len(losses) == STEPS
  np.testing.assert_allclose(losses, single, rtol=2e-5)


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
  # Fixed data shards make the global batch independent of the process count.
  ref = _train(tmp_path / "ref", devices=2, extra=["--config.data.shards=2"])
  port = _free_port()
  procs = [
      _train(tmp_path / "multi", devices=1, extra=["--config.data.shards=2"], wait=False,
             env_extra={"JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
                        "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)})
      for i in range(2)]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out.decode()[-3000:]
  np.testing.assert_allclose(_losses(tmp_path / "multi"), ref, rtol=2e-5)


def test_mesh_sizes_are_checked():
  import jax
  with pytest.raises(ValueError, match="at most one"):
    sharding.make_mesh(-1, -1, 1)
  with pytest.raises(ValueError, match="devices"):
    sharding.make_mesh(len(jax.devices()) + 1, 1, 1)


def test_resume_across_a_mesh_change(single, tmp_path):
  """Saved under FSDP x tensor on 8 devices, resumed data-parallel on 2: the curve continues."""
  workdir = tmp_path / "run"
  _train(workdir, devices=8, extra=["--config.mesh.data=1", "--config.mesh.fsdp=4",
                                    "--config.mesh.tensor=2", "--config.train.ckpt_every=2"])
  # Drop the last checkpoint so the second run resumes mid-way on another mesh.
  shutil.rmtree(workdir / "checkpoints" / str(STEPS))
  lines = open(workdir / "metrics.jsonl").read().splitlines()[:2]
  open(workdir / "metrics.jsonl", "w").write("\n".join(lines) + "\n")
  losses = _train(workdir, devices=2, extra=["--config.mesh.data=2"])
  np.testing.assert_allclose(losses, single, rtol=2e-5)
