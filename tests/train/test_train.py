"""End-to-end training on CPU: the loss falls, resume is exact, non-finite losses stop, SIGTERM saves."""

import functools
import json
import glob
import os
import shutil
import re
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


def test_grad_accumulation_matches_one_big_batch(tmp_path, capsys):
  """train.micro_batch=2 of the smoke run's 8 rows (4 accumulation steps): the loss curve of
  the whole batch at once."""
  losses = []
  for micro in (0, 2):   # 0 on CPU: the whole batch
    c = smoke.get_config()
    c.train.update(steps=3, log_every=1, eval_every=0, ckpt_every=100, micro_batch=micro)
    _train(c, tmp_path / f"m{micro}")
    losses.append(_losses(tmp_path / f"m{micro}"))
    assert f"micro-batch {micro or 8} x {8 // (micro or 8)} accumulation" in capsys.readouterr().out
  for step in (1, 2, 3):
    assert losses[0][step] == pytest.approx(losses[1][step], rel=1e-4)


def test_accumulated_update_equals_one_big_batch():
  """One step over 4 micro-batches (float32 sums under lax.scan, one optimizer update) gives the
  params and optimizer state of one step over the whole batch."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from focaljax.train import optim

  def loss_fn(params, frozen, batch):
    del frozen
    pred = jnp.tanh(batch["x"] @ params["w"]) @ params["v"]
    w = batch["weights"]
    return (w * (pred[:, 0] - batch["y"]) ** 2).sum(), (w.sum(), {"n": (w.sum(), 1.0)})

  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(5, 7)), jnp.float32),
            "v": jnp.asarray(rng.normal(size=(7, 1)), jnp.float32)}
  batch = {"x": jnp.asarray(rng.normal(size=(16, 5)), jnp.float32),
           "y": jnp.asarray(rng.normal(size=(16,)), jnp.float32),
           "weights": jnp.asarray(rng.integers(0, 2, size=(16,)), jnp.float32)}
  tx = optim.make(optim.OptimConfig(peak_lr=1e-2, warmup_steps=0, total_steps=10), params)
  out = {}
  for accum in (1, 4):
    cfg = loop.StepConfig(jnp.float32, accum, False)
    step = functools.partial(loop.step, loss_fn=loss_fn, tx=tx, cfg=cfg)
    out[accum] = jax.jit(step)(params, tx.init(params), None, batch)
  same = lambda out: (out[0], out[1], out[2]["loss"], out[2]["grad_norm"], out[2]["sums"]["n"][0])
  for a, b in zip(jax.tree.leaves(same(out[1])), jax.tree.leaves(same(out[4]))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert float(out[4][2]["loss"]) > 0


def test_micro_batch_must_divide_the_rows_per_device(tmp_path):
  c = smoke.get_config()
  c.train.micro_batch = 3
  with pytest.raises(config_lib.ConfigError, match=r"train.micro_batch: 3 must divide the 8 rows"):
    _train(c, tmp_path)


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
  c = smoke.get_config()
  c.data.tokenizer = "train:300"   # trained for its vocabulary, not saved
  out = _train(c, tmp_path / "run", dry_run=True)
  assert out["dry_run"] and out["memory"][None]["peak"] > out["memory"][None]["params"] > 0
  assert not os.path.exists(tmp_path / "run")   # nothing written: no lock, tokenizer or config
  text = capsys.readouterr().out
  assert "per device: params" in text and "compiled peak" in text and "closed-form" in text


def test_dry_run_over_another_models_workdir(tmp_path):
  """A dry run restores nothing, so a workdir holding another model (e.g. runs/default) is fine."""
  c = smoke.get_config()
  c.train.update(steps=2, log_every=1, eval_every=0)
  _train(c, tmp_path)
  before = sorted((p, os.path.getmtime(p)) for p in glob.glob(f"{tmp_path}/**", recursive=True))
  c = smoke.get_config("pattern=dilution:none")
  c.model.d_model *= 2
  assert _train(c, tmp_path, dry_run=True)["dry_run"]
  assert before == sorted((p, os.path.getmtime(p))
                          for p in glob.glob(f"{tmp_path}/**", recursive=True))


def test_a_fine_tune_outlives_its_source(tmp_path, capsys):
  """train.init_from is read by a fresh run alone: with the source gone, the fine-tuned run
  still loads and resumes; a dry run checks the source's shapes as a real run does."""
  import focaljax  # pylint: disable=import-outside-toplevel
  from configs import finetune  # pylint: disable=import-outside-toplevel
  c = smoke.get_config()
  c.train.update(steps=2, eval_every=0)
  _train(c, tmp_path / "src")
  f = finetune.get_config(str(tmp_path / "src"))
  f.train.update(steps=2, eval_every=0)
  f.optim.warmup_steps = 1
  f.model.attention.update(learned=True, pattern="focal")   # w_τ: another parameter tree
  with pytest.raises(config_lib.ConfigError, match=r"other shapes: model.attention.learned "
                     r"False -> True; keep its model fields"):
    _train(f, tmp_path / "ft", dry_run=True)
  f.model.attention.update(learned=False, pattern="focal")   # the same shapes
  _train(f, tmp_path / "ft")
  shutil.rmtree(tmp_path / "src")
  assert focaljax.load(str(tmp_path / "ft")).logits([[1, 2, 3]]).shape[-1] > 0
  f.train.steps, f.data.tokenizer = 3, str(tmp_path / "ft" / "tokenizer.json")
  assert _train(f, tmp_path / "ft")["step"] == 3   # a resume reads its own checkpoints alone
  capsys.readouterr()
  f.train.steps, f.train.init_from = 4, str(tmp_path / "elsewhere")
  assert _train(f, tmp_path / "ft")["step"] == 4
  assert f"train.init_from '{tmp_path / 'elsewhere'}' is not read" in capsys.readouterr().err


def test_resuming_a_finished_run_trains_nothing(tmp_path, capsys):
  c = smoke.get_config()
  c.train.update(steps=2, log_every=1, eval_every=0, ckpt_every=100)
  assert _train(c, tmp_path)["step"] == 2
  before = _losses(tmp_path)
  capsys.readouterr()
  out = _train(c, tmp_path)
  assert out["finished"] and out["step"] == 2 and "loss" not in out
  assert "holds the finished run (step 2 of train.steps=2)" in capsys.readouterr().out
  assert _losses(tmp_path) == before


def test_first_step_line_splits_the_start(tmp_path, capsys):
  c = smoke.get_config()
  c.train.update(steps=2, eval_every=0)
  _train(c, tmp_path)
  out = capsys.readouterr().out
  assert re.search(r"first step started after [\d.]+ s: data [\d.]+ s, compile [\d.]+ s \(init "
                   r"[\d.]+ s beside it; .*\); its call returned [\d.]+ s later", out), out


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


def test_fit_micro_batch_takes_the_largest_that_fits_in_few_compiles():
  from focaljax.train import memory
  compiles = []

  def peak_at(micro):   # 10 GB of state, 3 GB a row
    compiles.append(micro)
    return int(10e9 + 3e9 * micro)

  # 128 rows: 16 fit 100 GB (58 GB), 32 do not (106 GB). An exact estimate: one compile.
  assert memory.fit_micro_batch(128, peak_at, int(100e9), lambda m: 10e9 + 3e9 * m)[0] == 16
  assert compiles == [16]
  compiles.clear()   # an estimate 30% low: its pick (32) does not fit, one step down does
  assert memory.fit_micro_batch(128, peak_at, int(100e9), lambda m: 7e9 + 2.1e9 * m)[0] == 16
  assert compiles == [32, 16]
  compiles.clear()   # 2x high: 8 fits, and 16 is tried since 8's peak plus the extra rows may fit
  assert memory.fit_micro_batch(128, peak_at, int(100e9), lambda m: 20e9 + 6e9 * m)[0] == 16
  assert compiles == [8, 16]
  compiles.clear()
  assert memory.fit_micro_batch(8, peak_at, int(100e9), lambda m: 0) == (8, int(34e9), 1)
  assert compiles == [8]


def test_an_explicit_micro_batch_past_the_estimate_warns(capsys):
  from focaljax.train import memory
  guess = lambda m: 10e9 + 3e9 * m   # noqa: E731  (16 rows: 58 GB, 32: 106 GB)
  never = lambda m: pytest.fail("an explicit micro-batch compiles nothing here")  # noqa: E731
  assert memory.resolve_micro_batch(16, 128, never, int(100e9), guess) == (16, None)
  assert capsys.readouterr().err == ""
  assert memory.resolve_micro_batch(32, 128, never, int(100e9), guess) == (32, None)
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "train.micro_batch=32" in err and "16 is estimated" in err
  assert memory.resolve_micro_batch(32, 128, never, None, guess) == (32, None)   # CPU
  assert capsys.readouterr().err == ""


def test_presets_too_large_for_the_devices_are_refused():
  from configs import base
  from focaljax.train import memory
  h200 = int(141e9)
  cfg = lambda size: config_lib.parse(base.get_config(f"size={size}"))
  for size in ("400m", "1.3b"):
    memory.check_fits(cfg(size), {"data": 1, "fsdp": 1, "tensor": 1}, h200)
    # the measured batches on one H200 fit the estimate: 400M at 32 rows, 1.3B at 16
    rows = {"400m": 32, "1.3b": 16}[size]
    est = memory.estimate(cfg(size), micro_batch=rows, accum=2, state_shards=1)
    assert est.total < h200, (size, est.line())
  need = memory.devices_needed(cfg("9.5b"), h200)
  assert 2 <= need <= 8
  with pytest.raises(config_lib.ConfigError, match=rf"needs at least {need} devices of 141 GB "
                     r"with fsdp \(mesh.fsdp=-1\); got 1"):
    memory.check_fits(cfg("9.5b"), {"data": 1, "fsdp": 1, "tensor": 1}, h200)
  with pytest.raises(config_lib.ConfigError, match="mesh.fsdp=-1"):   # enough devices, replicated
    memory.check_fits(cfg("9.5b"), {"data": 8, "fsdp": 1, "tensor": 1}, h200)
  memory.check_fits(cfg("9.5b"), {"data": 1, "fsdp": 8, "tensor": 1}, h200)
  memory.check_fits(cfg("9.5b"), {"data": 1, "fsdp": 1, "tensor": 1}, None)   # no limit


def test_a_cpu_run_that_cannot_fit_the_host_is_refused_leaving_no_workdir(tmp_path, monkeypatch):
  # CPU devices report no memory: a real run is checked against the host's (a dry run is not).
  from configs import base
  from focaljax.train import memory
  monkeypatch.setattr(memory, "host_memory_per_device", lambda: int(16e9))
  c = base.get_config("size=1.3b")
  c.optim.warmup_steps, c.train.steps = 0, 1
  with pytest.raises(config_lib.ConfigError, match=r"needs at least \d+ devices of 16 GB"):
    lm.train(config_lib.parse(c), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()   # the lock's directory went with it


def test_out_of_memory_is_one_line_with_the_estimate_and_the_knobs():
  import jax
  from focaljax.train import memory
  known = {"memory": int(134e9), "micro_batch": 16, "accum": 8, "peak": int(150e9)}
  with pytest.raises(memory.OutOfMemory) as e:
    with memory.oom_as_error(known):
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                       "allocate 1073741824 bytes.\nBufferAssignment ...")
  msg = str(e.value)
  assert "\n" not in msg and "150.0 GB per device of 134.0 GB" in msg
  for knob in ("train.micro_batch", "model.remat", "mesh.fsdp"):
    assert knob in msg
  with pytest.raises(jax.errors.JaxRuntimeError):   # other runtime errors pass through
    with memory.oom_as_error(known):
      raise jax.errors.JaxRuntimeError("INTERNAL: something else")


def test_train_py_reports_out_of_memory_with_exit_2(tmp_path):
  """The one line, and exit status 2, from the command line."""
  import subprocess
  code = ("import sys, jax; sys.argv = ['train.py', '--config', 'configs/smoke.py', "
          f"'--workdir', {str(tmp_path)!r}]\n"
          "from focaljax.train import loop\n"
          "def oom(*a, **k):\n"
          "  raise jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory')\n"
          "loop.init_opt = oom\n"
          "from focaljax.train import lm\n"
          "lm.init_state = oom\n"
          "import runpy; runpy.run_path('train.py', run_name='__main__')\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert lines[-1].startswith("error: out of memory") and "train.micro_batch" in lines[-1]


def test_compile_cache_is_on_unless_the_user_set_it(monkeypatch, tmp_path):
  import jax
  from focaljax.train import startup
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
  old = (jax.config.jax_compilation_cache_dir,
         jax.config.jax_persistent_cache_min_compile_time_secs)
  try:
    jax.config.update("jax_compilation_cache_dir", None)
    assert startup.enable_compile_cache() == str(tmp_path / "focaljax" / "jax_cache")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == startup.MIN_COMPILE_SECS
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    assert startup.enable_compile_cache() == str(tmp_path / "mine")
  finally:
    jax.config.update("jax_compilation_cache_dir", old[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])


class _Counter:
  """A checkpointable iterator of 0, 1, 2, ..."""

  def __init__(self):
    self.i = 0

  def __next__(self):
    self.i += 1
    return self.i - 1

  def get_state(self):
    return {"i": self.i}

  def set_state(self, state):
    self.i = state["i"]


def test_input_probe_consumes_nothing_and_pace_warns_once():
  from focaljax.train import startup
  it = _Counter()

  def batches(start):
    del start
    while True:
      yield next(it)

  gen, first, rate = startup.probe(batches, 0, it)
  assert [next(gen) for _ in range(3)] == [0, 1, 2] and first >= 0 and rate > 0
  pace = startup.Pace(input_rate=1e-3, first_step=1, window=2)
  warnings = [pace.fetched(s) for s in range(1, 8)]
  lines = [w for w in warnings if w]
  assert len(lines) == 1 and "data.tokenize=ahead" in lines[0] and "\n" not in lines[0]
  pace = startup.Pace(input_rate=1e12, first_step=1, window=2)
  assert not any(pace.fetched(s) for s in range(1, 8))
