"""End-to-end training on CPU: the loss falls, resume is exact, non-finite losses stop, SIGTERM saves."""

import json
import os
import sys

import pytest

from configs import smoke
from focaljax import config as config_lib
from focaljax.model import decoder as model_lib
from focaljax.train import lm
from focaljax.train import loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(c, workdir, **kw):
  return lm.train(config_lib.parse(c), str(workdir), **kw)


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_loss_falls(tmp_path, monkeypatch):
  c = smoke.get_config()
  c.train.update(steps=30, log_every=5, eval_every=15, ckpt_every=30)
  c.optim.update(peak_lr=3e-3, warmup_steps=5)
  monkeypatch.chdir(tmp_path.parent)  # a relative workdir, as `python train.py` uses
  out = _train(c, tmp_path.name)
  losses = _losses(tmp_path)
  assert losses[30] < losses[5] - 0.5, losses
  assert out["val_loss"] < 8.0
  for name in ("config.json", "tokenizer.json", "metrics.jsonl"):
    assert os.path.exists(os.path.join(tmp_path, name))
  assert os.listdir(os.path.join(tmp_path, "tb"))


@pytest.mark.parametrize("pattern", ["softmax:rope,dilution:none"])
def test_resume_reproduces_uninterrupted_run(tmp_path, pattern):
  def cfg():
    c = smoke.get_config(f"pattern={pattern}")
    c.train.update(steps=6, log_every=1, eval_every=0, ckpt_every=100)
    return c
  _train(cfg(), tmp_path / "straight")
  first = _train(cfg(), tmp_path / "resumed", stop_at=3)
  assert first["step"] == 3
  second = _train(cfg(), tmp_path / "resumed")
  assert second["start_step"] == 3
  straight, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
  assert sorted(resumed) == sorted(straight) == list(range(1, 7))
  assert resumed == straight  # exactly: same params, optimizer state and data order


def test_grad_accumulation_matches_one_big_batch(tmp_path):
  losses = []
  for accum in (1, 4):
    c = smoke.get_config()
    c.train.update(steps=3, log_every=1, eval_every=0, ckpt_every=100)
    c.optim.grad_accum = accum
    _train(c, tmp_path / f"a{accum}")
    losses.append(_losses(tmp_path / f"a{accum}"))
  for step in (1, 2, 3):
    assert losses[0][step] == pytest.approx(losses[1][step], rel=1e-4)


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_nonfinite_loss(tmp_path, mode):
  c = smoke.get_config()
  c.train.update(steps=5, log_every=1, eval_every=0, nonfinite=mode)
  c.optim.update(peak_lr=1e35, warmup_steps=1)
  if mode == "stop":
    with pytest.raises(loop.NonFiniteLoss, match=r"non-finite loss .* at step \d"):
      _train(c, tmp_path)
  else:
    out = _train(c, tmp_path)
    assert out["step"] == 5


def test_bf16_compute_with_float32_master_weights(tmp_path):
  import jax
  from flax import nnx
  from focaljax.data import tokenizer as tokenizer_lib
  from focaljax.train import checkpoint
  c = smoke.get_config("pattern=softmax:rope,dilution:none")
  c.train.update(steps=3, log_every=1, eval_every=0, compute_dtype="bfloat16")
  out = _train(c, tmp_path)
  assert out["step"] == 3 and out["loss"] < 20
  model_cfg = config_lib.parse(c).with_vocab(tokenizer_lib.bundled().vocab_size).model
  abstract = checkpoint.abstract_like(nnx.to_pure_dict(model_lib.abstract_model(model_cfg)[1]))
  params, _ = checkpoint.restore_params(str(tmp_path), None, abstract)
  assert {x.dtype.name for x in jax.tree.leaves(params)} == {"float32"}


def test_dry_run_compiles_without_training(tmp_path, capsys):
  out = _train(smoke.get_config(), tmp_path, dry_run=True)
  assert out["dry_run"] and "memory" in out
  assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


def test_bfloat16_first_moment_halves_its_state():
  """optim.mu_dtype=bfloat16: AdamW's first moment is stored in bf16, the second stays float32,
  and an update is finite and close to the float32 one."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from focaljax.train import optim
  params = {"w": jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4)}
  grads = {"w": jnp.full((3, 4), 0.3, jnp.float32)}
  updates = {}
  for mu in ("float32", "bfloat16"):
    tx = optim.make(optim.OptimConfig(peak_lr=1e-2, warmup_steps=0, total_steps=10, mu_dtype=mu),
                    params)
    state = tx.init(params)
    dtypes = {x.dtype.name for x in jax.tree.leaves(state) if getattr(x, "ndim", 0) == 2}
    assert dtypes == ({"float32"} if mu == "float32" else {"bfloat16", "float32"}), dtypes
    updates[mu], _ = tx.update(grads, state, params)
  np.testing.assert_allclose(updates["bfloat16"]["w"], updates["float32"]["w"], rtol=1e-2)
