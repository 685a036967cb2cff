"""Metrics backends: JSONL and TensorBoard always, Weights & Biases with train.wandb_project."""

import importlib.util
import json

import pytest

from configs import smoke
from focaljax import config as config_lib
from focaljax.train import metrics


def test_jsonl_and_tensorboard(tmp_path):
  w = metrics.Writer(tmp_path, 2, 0, enabled=True)
  w.write(1, {"loss": 3.0})
  w.close()
  rows = [json.loads(l) for l in (tmp_path / metrics.METRICS_FILE).read_text().splitlines()]
  assert rows == [{"step": 1, "loss": 3.0}]
  assert list((tmp_path / "tb").iterdir())


def test_a_non_finite_value_is_null_in_the_jsonl(tmp_path):
  # A skipped step's NaN: strict JSON readers refuse the bare NaN json.dumps writes.
  w = metrics.Writer(tmp_path, 2, 0, enabled=True)
  w.write(1, {"loss": float("nan"), "lr": 1e-3})
  w.close()
  line = (tmp_path / metrics.METRICS_FILE).read_text().splitlines()[0]
  assert json.loads(line, parse_constant=pytest.fail) == {"step": 1, "loss": None, "lr": 1e-3}


def test_wandb_offline_run_resumes_by_workdir(tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  ids = []
  for start in (0, 2):   # a resumed run continues the same W&B run
    w = metrics.Writer(tmp_path, 4, start, enabled=True, wandb_project="focaljax-test",
                       config_json='{"seed": 0}')
    w.write(start + 1, {"val_loss_for_wandb": 2.5})
    ids.append(w.wandb.id)
    w.close()
  assert ids[0] == ids[1]
  logs = list((tmp_path / "wandb").glob(f"offline-run-*-{ids[0]}/run-{ids[0]}.wandb"))
  assert logs and all(b"val_loss_for_wandb" in p.read_bytes() for p in logs)


def test_wandb_project_without_wandb_is_refused(monkeypatch):
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "wandb" else find_spec(name, *a))
  c = smoke.get_config()
  c.train.wandb_project = "p"
  with pytest.raises(config_lib.ConfigError, match="train.wandb_project.*pip install"):
    config_lib.parse(c)
