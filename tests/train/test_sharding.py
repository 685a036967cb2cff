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

SLOW = pytest.mark.slow  # extra configurations: deselected unless -m slow (pyproject)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 4


def _train(workdir, devices=1, extra=(), env_extra=None, wait=True, config="smoke.py"):
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  env.update(env_extra or {})
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config",
         os.path.join(ROOT, "configs", config), "--workdir", str(workdir),
         f"--config.train.steps={STEPS}", "--config.train.log_every=1",
         "--config.train.eval_every=0", "--config.train.ckpt_every=100", *extra]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
  if not wait:
    return proc
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out.decode()[-3000:]
  return _losses(workdir)


def _losses(workdir, key="loss"):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return np.array([r[key] for r in rows if key in r])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
  return _train(tmp_path_factory.mktemp("one"), devices=1)


@pytest.mark.parametrize("mesh", [(8, 1, 1), (2, 2, 2), pytest.param((1, 4, 2), marks=SLOW)])
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
  # Fixed data shards make the global batch, and the validation batches, independent of the
  # process count.
  extra = ["--config.data.shards=2", f"--config.train.eval_every={STEPS}",
           "--config.train.ckpt_every=2"]
  ref = _train(tmp_path / "ref", devices=2, extra=extra)
  port = _free_port()
  procs = [
      _train(tmp_path / "multi", devices=1, extra=extra, wait=False,
             env_extra={"JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
                        "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)})
      for i in range(2)]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out.decode()[-3000:]
  np.testing.assert_allclose(_losses(tmp_path / "multi"), ref, rtol=2e-5)
  val = [_losses(d, "val_loss") for d in (tmp_path / "ref", tmp_path / "multi")]
  assert len(val[0]) == 1
  np.testing.assert_allclose(val[1], val[0], rtol=2e-5)
  # The data position is saved per shard: the 2-process run resumes mid-way on one process.
  shutil.rmtree(tmp_path / "multi" / "checkpoints" / str(STEPS))
  lines = open(tmp_path / "multi" / "metrics.jsonl").read().splitlines()[:2]
  open(tmp_path / "multi" / "metrics.jsonl", "w").write("\n".join(lines) + "\n")
  np.testing.assert_allclose(_train(tmp_path / "multi", devices=2, extra=extra), ref, rtol=2e-5)


def test_focusllm_trains_on_two_processes(tmp_path):
  # The frozen base (loaded on one device) and the adapter reach every process's devices:
  # jax.device_put could not place them on another process's, and both processes failed.
  _train(tmp_path / "base", config="base.py", extra=["--config.optim.warmup_steps=1"])
  extra = [f"--config.focus.base_workdir={tmp_path / 'base'}", "--config.focus.chunk_sizes=16,32",
           "--config.focus.prompt_len=32", "--config.focus.local_len=64",
           "--config.focus.num_targets=8", "--config.focus.doc_min_tokens=512",
           "--config.mesh.data=2", "--config.optim.warmup_steps=1"]
  port = _free_port()
  procs = [_train(tmp_path / "focus", extra=extra, wait=False, config="focus.py",
                  env_extra={"JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
                             "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)})
           for i in range(2)]
  for p in procs:
    out = p.communicate(timeout=600)[0]
    assert p.returncode == 0, out.decode()[-3000:]
  assert len(_losses(tmp_path / "focus")) == STEPS


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


_PER_DEVICE = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from focaljax import ops, sharding
B, T, Hq, Hkv, D = 4, 64, 4, 2, 64
ks = jax.random.split(jax.random.key(0), 5)
q = jax.random.normal(ks[0], (B, T, Hq, D)); k = jax.random.normal(ks[1], (B, T, Hkv, D))
v = jax.random.normal(ks[2], (B, T, Hkv, D))
scale = 0.1 + jax.random.uniform(ks[3], (B, 1, T)) * 0.1
seg = jnp.concatenate([jnp.zeros((B, 40), jnp.int32), jnp.ones((B, 24), jnp.int32)], 1)
cases = {"focal": lambda q, k, v, s: ops.focal_attention(q, k, v, scale=s, segment_ids=seg,
                                                        implementation="pallas"),
         "dilution": lambda q, k, v, s: ops.dilution_attention(q, k, v, segment_ids=seg,
                                                              implementation="pallas") * s.mean()}
mesh = sharding.make_mesh(2, 1, 2)
for name, f in cases.items():
  loss = lambda *a: jnp.sum(f(*a) ** 2)
  want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, scale)
  with jax.set_mesh(mesh):
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    args = [jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor", None)))
            for x in (q, k, v)] + [scale]
    hlo = fn.lower(*args).compile().as_text()
    got = fn(*args)
  assert "all-gather" not in hlo, name + ": q/k/v were gathered"
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-4)
# QK-norm + RoPE's Pallas passes: per device too, the gain's gradient summed over both.
from focaljax.model import norm_rope
positions = jnp.arange(T)[None] + 5
cos, sin = norm_rope.rope_tables(positions, 10000.0, D)
gain, w = 1 + 0.1 * jax.random.normal(ks[4], (D,)), jax.random.normal(ks[3], q.shape)
pair = lambda x, g: norm_rope.apply_rope(norm_rope.rms_norm(x, g, 1e-5), positions, 10000.0)
want = jax.jit(jax.grad(lambda x, g: jnp.sum(pair(x, g) * w), (0, 1)))(q, gain)
with jax.set_mesh(mesh):
  fn = jax.jit(jax.grad(
      lambda x, g: jnp.sum(norm_rope.qk_norm_rope(x, g, cos, sin, 1e-5, True) * w), (0, 1)))
  x = jax.device_put(q, NamedSharding(mesh, P("data", None, "tensor", None)))
  hlo = fn.lower(x, gain).compile().as_text()
  got = fn(x, gain)
assert "all-gather" not in hlo, "norm_rope: x was gathered"
for a, b in zip(got, want):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-4)
# The SwiGLU activation's Pallas passes: per device over rows and "mlp" columns.
from focaljax.model import mlp
gate, up = jax.random.normal(ks[0], (B, T, 96)), jax.random.normal(ks[1], (B, T, 96))
sw_loss = lambda act, g, u: jnp.sum(act(g, u) * jnp.sin(g))
want = jax.jit(jax.grad(sw_loss, (1, 2)), static_argnums=0)(mlp.swiglu, gate, up)
pallas = lambda g, u: mlp.swiglu_pallas(g, u, True)
with jax.set_mesh(mesh):
  fn = jax.jit(jax.grad(sw_loss, (1, 2)), static_argnums=0)
  gu = [jax.device_put(a, NamedSharding(mesh, P("data", None, "tensor"))) for a in (gate, up)]
  hlo = fn.lower(pallas, *gu).compile().as_text()
  got = fn(pallas, *gu)
assert "all-gather" not in hlo, "swiglu: gate/up were gathered"
for a, b in zip(got, want):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-4)
# The residual add + RMSNorm Pallas passes: per device over batch rows, the gain's gradient summed.
from focaljax.model import add_norm
xr, dr = jax.random.normal(ks[0], (B, T, 32)), jax.random.normal(ks[1], (B, T, 32))
xla = lambda x, d, g: (x + d, norm_rope.rms_norm(x + d, g, 1e-5))
pallas = lambda x, d, g: add_norm.add_rms_norm(x, d, g, 1e-5, True)
an_loss = lambda f, x, d, g: sum(jnp.sum(o * jnp.sin(o + i)) for i, o in enumerate(f(x, d, g)))
want = jax.jit(jax.grad(an_loss, (1, 2, 3)), static_argnums=0)(xla, xr, dr, jnp.ones(32))
with jax.set_mesh(mesh):
  fn = jax.jit(jax.grad(an_loss, (1, 2, 3)), static_argnums=0)
  xd = [jax.device_put(a, NamedSharding(mesh, P("data", None, None))) for a in (xr, dr)]
  hlo = fn.lower(pallas, *xd, jnp.ones(32)).compile().as_text()
  got = fn(pallas, *xd, jnp.ones(32))
assert "all-gather" not in hlo, "add_norm: x was gathered"
for a, b in zip(got, want):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-4)
print("ok")
'''


def test_pallas_attention_runs_per_device():
  """Under a (data 2, tensor 2) mesh the Pallas kernels run on each device's rows and heads
  (no all-gather of q/k/v) and give the unsharded values and gradients, GQA and segments too;
  likewise qk_norm_rope's Pallas backward, the SwiGLU activation's and the residual add + norm's
  Pallas passes."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-c", _PER_DEVICE], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0 and "ok" in out.stdout, (out.stdout + out.stderr)[-3000:]


_OPT_STATE = r'''
import functools, jax, jax.numpy as jnp
from flax import nnx
from configs import base
from focaljax import config as config_lib, sharding
from focaljax.model import decoder as model_lib
from focaljax.train import lm, loop, optim
c = base.get_config("size=small")
cfg = config_lib.model_config(c, 512)
graphdef, state = nnx.split(nnx.eval_shape(lambda: model_lib.Transformer(cfg, nnx.Rngs(0))))
for shape in [(1, 2, 2), (2, 1, 2), (1, 4, 1)]:
  mesh = sharding.make_mesh(*shape)
  param_sh = sharding.param_shardings(state, mesh)
  tx = optim.make(config_lib.optim_config(c), nnx.to_pure_dict(state))
  params, opt, opt_sh = lm.init_state(cfg, tx, param_sh, mesh, jax.random.key(0))
  adam = opt[1][0]  # chain(clip, adamw): adamw's ScaleByAdamState
  for moment in (adam.mu, adam.nu):
    for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(moment)):
      assert m.sharding.spec == p.sharding.spec, (shape, m.sharding.spec, p.sharding.spec)
  assert adam.count.sharding.spec == jax.sharding.PartitionSpec()
  if shape == (2, 1, 2):  # data x tensor parallelism: all-reduces, and no weight is gathered
    step = jax.jit(functools.partial(lm.train_step, graphdef=graphdef, tx=tx,
                                     cfg=loop.StepConfig(jnp.float32, 1, False)),
                   in_shardings=(param_sh, opt_sh, sharding.batch_sharding(mesh)),
                   out_shardings=(param_sh, opt_sh, None))
    T = c.data.seq_len
    batch = {k: jax.ShapeDtypeStruct((8, T), jnp.float32 if k == "weights" else jnp.int32)
             for k in ("inputs", "targets", "positions", "weights")}
    with jax.set_mesh(mesh):
      hlo = step.lower(params, opt, batch).compile().as_text()
    assert "all-gather(" not in hlo, "tensor parallelism gathered a weight"
print("ok")
'''


def test_optimizer_state_is_sharded_like_its_parameters():
  """Adam's moments take their parameter's sharding (jit(tx.init) alone replicated them), so
  FSDP shards them and a tensor-parallel step gathers no weights."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-c", _OPT_STATE], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0 and "ok" in out.stdout, (out.stdout + out.stderr)[-3000:]


def test_a_mesh_that_does_not_divide_a_weight_is_named_before_anything_runs():
  # mesh.tensor=-1 on 4 devices resolves past the config's num_kv_heads check: the shardings
  # name the weight instead of an IndivisibleError at the first device_put.
  import jax
  from configs import smoke
  from focaljax import config as config_lib
  from focaljax.model import decoder as model_lib
  _, state = model_lib.abstract_model(config_lib.model_config(smoke.get_config(), 256))
  mesh = lambda tensor: jax.sharding.AbstractMesh((1, 1, tensor), ("data", "fsdp", "tensor"))
  with pytest.raises(ValueError, match=r"^parameter blocks.0.attn.wk \(64, 2, 16\): dimension 1 "
                     r"\(2\) does not split over mesh axes tensor \(4 devices\)"):
    sharding.param_shardings(state, mesh(4))
  assert len(jax.tree.leaves(sharding.param_shardings(state, mesh(2)))) > 0
