"""Configs: every file loads and builds abstractly; bad values are refused naming the field."""

import glob
import math
import os
import subprocess
import sys

import jax
import pytest
from flax import nnx
from ml_collections import config_flags  # noqa: F401  (the loader train.py uses)

from configs import base, sizes
from focaljax import config as config_lib
from focaljax.model import decoder as model_lib
from focaljax.train import checkpoint
from focaljax.train import saved_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                      if not os.path.basename(p).startswith("_") and "sizes" not in p
                      and "finetune" not in p)   # finetune needs a workdir: test_round_trip.py


def _load(name, arg=None):
  import importlib
  return importlib.import_module(f"configs.{name}").get_config(arg)


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_config_files_validate(name):
  c = _load(name)
  c.lock()
  config_lib.validate(c)


def test_finetune_names_its_missing_workdir():
  with pytest.raises(ValueError, match=r"^config arg: the workdir to fine-tune, e.g. "):
    _load("finetune")


@pytest.mark.parametrize("size", sizes.NAMES)
def test_size_presets_build_abstractly(size):
  c = base.get_config(f"size={size}")
  config_lib.validate(c)
  cfg = config_lib.model_config(c, vocab_size=4096)
  abstract = nnx.eval_shape(lambda: model_lib.Transformer(cfg, nnx.Rngs(0)))
  n = sum(x.size for x in jax.tree.leaves(nnx.split(abstract)[1]))
  assert n == model_lib.param_count(cfg)
  expected = {"400m": 0.4e9, "777m": 0.78e9, "1.3b": 1.3e9, "2.7b": 2.7e9, "6.7b": 6.7e9,
              "9.5b": 9.5e9, "209m": 0.209e9}
  if size in expected:  # within 12% of the name (the papers count embeddings differently)
    assert abs(n - expected[size]) / expected[size] < 0.12, (size, n)


@pytest.mark.parametrize("field,value,match", [
    ("model.attention.temperature", 0.0, "model.attention.temperature"),
    ("model.attention.tau_min", 10.0, "model.attention.tau_min"),
    ("model.attention.tau_max", -1.0, "model.attention.tau_max: must be finite and > 0"),
    ("model.head_dim", -4, "model.head_dim: must be >= 0"),
    ("model.norm_eps", -1.0, "model.norm_eps"),
    ("model.attention.pattern", "softmax:rope,", "an empty entry"),
    ("optim.b1", 1.5, "optim.b1"),
    ("optim.weight_decay", -1.0, "optim.weight_decay"),
    ("train.eval_batches", 0, "train.eval_batches"),
    ("seed", -1, "seed: must be in"),
    ("seed", 2**32, "seed: must be in"),
    ("model.rope_scaling", {"factor": 2.0}, "model.rope_scaling: needs exactly the fields"),
    ("data.token_cache", __file__, "data.token_cache: .* is a file"),
    ("model.attention.learned", True, "model.attention.learned: True, but .* no focal layer"),
    ("model.num_kv_heads", 3, "model.num_kv_heads"),
    ("model.num_heads", 3, "model.num_heads"),
    ("model.attention.pattern", "softmax,flash", "unknown variant 'flash'"),
    ("model.attention.pattern", "softmax:", "unknown position mode '' in 'softmax:'"),
    ("model.attention.implementation", "triton", "model.attention.implementation"),
    ("model.attention.tau_mean", "global", "model.attention.tau_mean"),
    ("model.attention.checkpoint_rows", 96, "model.attention.checkpoint_rows: must be a power"),
    ("model.attention.checkpoint_rows", 32, "model.attention.checkpoint_rows"),
    ("train.micro_batch", -1, "train.micro_batch"),
    ("train.nonfinite", "ignore", "train.nonfinite"),
    ("optim.no_decay", "norm,bias", "optim.no_decay"),
    ("mesh.tensor", 3, "mesh.tensor"),
    ("model.remat_policy", "full", "model.remat_policy"),
    ("optim.mu_dtype", "float16", "optim.mu_dtype"),
    ("optim.schedule_steps", 10, "optim.schedule_steps"),   # not past the 30 warmup steps
    ("optim.peak_lr", float("inf"), "optim.peak_lr: must be a finite number > 0, got inf"),
    ("model.attention.temperature", float("inf"), "model.attention.temperature: must be a fin"),
    ("model.attention.tau_max", float("inf"), "model.attention.tau_max: must be finite"),
])
def test_invalid_values_name_the_field(field, value, match):
  c = base.get_config()
  node = c
  *parents, leaf = field.split(".")
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(c)


@pytest.mark.parametrize("d_model,heads,expected", [(512, 4, (5.0, 10.0, 7.5)),
                                                     (128, 4, (2.5, 5.0, 3.75))])
def test_learned_tau_range_defaults_to_the_papers_t_at_every_head_dim(d_model, heads, expected):
  c = base.get_config()
  c.model.update(d_model=d_model, num_heads=heads, num_kv_heads=heads)
  config_lib.validate(c)
  a = config_lib.model_config(c, vocab_size=256).attention
  assert (a.tau_min, a.tau_max, a.tau_init) == pytest.approx(expected)
  c.model.attention.tau_max = 9.0   # set explicitly: taken as given
  assert config_lib.model_config(c, vocab_size=256).attention.tau_max == 9.0


def test_schedule_steps_sets_the_cosine_length():
  from focaljax.train import optim
  c = base.get_config()
  assert config_lib.optim_config(c).total_steps == c.train.steps   # 0: train.steps
  c.optim.schedule_steps = 2 * c.train.steps
  cfg = config_lib.optim_config(c)
  lr = optim.schedule(cfg)
  # At train.steps the cosine over 2·train.steps (after warmup) is not yet half-way down.
  w, n = cfg.warmup_steps, cfg.total_steps
  frac = 0.5 * (1 + math.cos(math.pi * (c.train.steps - w) / (n - w)))
  expect = cfg.peak_lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * frac)
  assert abs(float(lr(c.train.steps)) - expect) < 1e-6 * cfg.peak_lr
  assert float(lr(c.train.steps)) > cfg.peak_lr * (1 + cfg.min_lr_ratio) / 2


def test_pallas_needs_block_divisible_sequence():
  c = base.get_config()
  c.model.attention.implementation = "pallas"
  c.data.seq_len = 100
  with pytest.raises(config_lib.ConfigError, match="data.seq_len"):
    config_lib.validate(c)


@pytest.mark.parametrize("override,match", [
    ("--config.model.attention.temprature=0.4", "temprature"),      # unknown key (typo)
    ("--config.model.num_layers=two", "num_layers"),                 # wrong type
    ("--config.model.attention.temperature=-1", "model.attention.temperature"),
])
def test_command_line_refuses_bad_overrides(override, match, tmp_path):
  r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config",
                      os.path.join(ROOT, "configs", "smoke.py"), "--workdir", str(tmp_path),
                      override], capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert r.returncode != 0
  assert match in r.stderr + r.stdout
  assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


@pytest.mark.parametrize("name", ["focal", "focal_learned", "dilution", "hybrid", "softmax_nope"])
def test_attention_presets_refuse_a_pattern_arg(name):
  with pytest.raises(ValueError, match=r"^config arg pattern: this preset trains '"):
    _load(name, "size=small,pattern=softmax:rope")
  assert _load(name, "size=small").model.num_layers == _load("base", "size=small").model.num_layers


def test_parse_arg_keeps_commas_in_patterns():
  args = base.parse_arg("size=small,pattern=softmax:rope,dilution:none", size="tiny", pattern="x")
  assert args == {"size": "small", "pattern": "softmax:rope,dilution:none"}
  with pytest.raises(ValueError, match="expected key=value"):
    base.parse_arg("colour=red", size="tiny")


def test_a_workdir_config_from_before_the_data_fields_still_loads():
  # A config.json written before data.tokenize / data.token_cache existed (eval.py, resume).
  saved = base.get_config().to_dict()
  del saved["data"]["tokenize"], saved["data"]["token_cache"]
  d = config_lib.data_config(saved_config.upgrade(saved))
  assert d.tokenize == "stream" and d.token_cache is None


def test_a_workdir_config_with_the_deleted_speed_variants_still_loads():
  # Written when model.fuse_matmuls ... train.cross_entropy were fields, before checkpoint_rows.
  saved = base.get_config().to_dict()
  saved["model"].update(fuse_matmuls=False, norm_backward="explicit", qk_rope_backward="auto",
                        mlp_backward="auto", add_norm="auto")
  saved["model"]["attention"].update(implementation="xla", mask_pieces=1)
  del saved["model"]["attention"]["checkpoint_rows"]
  saved["train"]["cross_entropy"] = "explicit"
  saved["model"]["attention"]["pattern"] = "softmax:rope,,"   # stray commas, accepted then
  saved["train"]["eval_batches"] = 0   # accepted then (it logged val_loss 0.0)
  c = saved_config.upgrade(saved)
  assert c.model.attention.pattern == "softmax:rope" and c.train.eval_batches == 4
  config_lib.validate(c)
  cfg = config_lib.model_config(c, vocab_size=256)
  assert cfg.attention.implementation == "xla" and cfg.attention.checkpoint_rows == 1024


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_focus_drills_stages_validate(stage):
  # Every stage fits a 1K-context base: 63 candidates + the 512-token window at stage 3.
  c = _load("focus_drills", f"stage={stage}")
  c.lock()
  config_lib.validate(c)
  config_lib.focus_config(c, context=1024)
  assert c.focus.eval_prompt_len == 504   # served at 504: 512 + 504 + the answer's 7 fit 1024


def test_focus_eval_prompt_len_is_validated():
  c = _load("focus_drills", "stage=3")
  c.focus.eval_prompt_len = 506   # 512 + 506 + 7 = 1025 positions
  with pytest.raises(config_lib.ConfigError, match="focus.eval_prompt_len.*set it to <= 505"):
    config_lib.focus_config(c, context=1024)
  c.focus.eval_prompt_len = 0   # serves prompt_len: chunk 64 + 64 + 7 > a 128-token base
  c.focus.chunk_sizes, c.focus.prompt_len, c.focus.memory_tokens = "64", 64, "128"
  c.focus.local_len, c.focus.doc_min_tokens = 64, 200
  with pytest.raises(config_lib.ConfigError, match="served dynamic prompt 64 .* set it to <= 57"):
    config_lib.focus_config(c, context=128)
  c.focus.eval_prompt_len = -1
  with pytest.raises(config_lib.ConfigError, match="focus.eval_prompt_len.*>= 0"):
    config_lib.focus_config(c, context=1024)


def test_focus_drills_refuses_an_unknown_stage():
  with pytest.raises(ValueError, match="stage='4'"):
    _load("focus_drills", "stage=4")


@pytest.mark.parametrize("text", ["{bad", "[1]"])
def test_a_damaged_workdir_config_json_is_one_line(tmp_path, text):
  (tmp_path / "config.json").write_text(text)
  with pytest.raises(checkpoint.CorruptCheckpoint, match=r"config.json is not a run's config \("):
    saved_config.read(str(tmp_path))


def test_an_odd_head_dim_needs_no_rope_layer():
  c = base.get_config()
  c.model.update(d_model=56, num_heads=8, num_kv_heads=8)   # head dim 7
  with pytest.raises(config_lib.ConfigError, match="model.head_dim: must be even for RoPE"):
    config_lib.validate(c)
  c.model.attention.pattern = "softmax:none"
  config_lib.validate(c)
