"""Training metrics: a progress bar (loss, tokens/s, MFU), JSONL, TensorBoard event files and,
with train.wandb_project set, Weights & Biases.

Only process 0 writes. Every file goes through `etils.epath`, so a workdir may be a local
directory or a URL (gs://bucket/run). Object stores cannot append: there metrics.jsonl and the
TensorBoard event file are rewritten whole at each flush (a few MB over a long run).
MFU = model FLOPs per second / peak FLOPs of the devices in use (`focaljax.dispatch.peak_flops`:
dense bf16 datasheet numbers; MFU is not shown for a chip it does not know).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time

from etils import epath
import jax

from focaljax import dispatch

METRICS_FILE = "metrics.jsonl"


def is_local(path) -> bool:
  return "://" not in str(path)


def peak_flops_per_device() -> float | None:
  return dispatch.peak_flops()


def flops_per_token(cfg) -> float:
  """6·N (matmul params, forward + backward) + causal attention's 6·L·T·(N·D) (PaLM appendix B,
  halved for the causal mask)."""
  E, F, L = cfg.d_model, cfg.d_ff, cfg.num_layers
  qkvo = E * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
  matmul_params = L * (qkvo + 3 * E * F) + E * cfg.vocab_size
  attn = 6 * L * cfg.max_seq_len * cfg.num_heads * cfg.head_dim
  return 6 * matmul_params + attn


class _WholeFile:
  """An appendable file on storage that cannot append (object stores): what was there, plus
  every write, rewritten whole at each flush."""

  def __init__(self, path):
    self.path = epath.Path(path)
    self.data = bytearray(self.path.read_bytes() if self.path.exists() else b"")
    self.dirty = False

  def write(self, b):
    self.data += b.encode() if isinstance(b, str) else b
    self.dirty = True
    return len(b)

  def flush(self):
    if self.dirty:
      self.path.write_bytes(bytes(self.data))
      self.dirty = False

  def close(self):
    self.flush()


class _EpathEventFiles:
  """tensorboardX's writer factory for a URL scheme: event files through epath."""

  def open(self, path):
    return _WholeFile(path)

  def directory_check(self, path):
    epath.Path(path).mkdir(parents=True, exist_ok=True)


def _tensorboard(logdir: epath.Path):
  # tensorboardX imports torch where it is installed (seconds of start-up) only to accept torch
  # tensors; we log floats, so torch stays hidden from it unless something imported it already.
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    from tensorboardX import record_writer  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  finally:
    if hide:
      del sys.modules["torch"]
  if not is_local(logdir):
    record_writer.register_writer_factory(str(logdir).split("://")[0], _EpathEventFiles())
  return SummaryWriter(str(logdir))


def _wandb(project: str, workdir: epath.Path, config_json: str):
  """A W&B run that a resumed workdir continues (its id is derived from the workdir)."""
  import wandb  # pylint: disable=import-outside-toplevel  (config.parse checked it is there)
  run_id = hashlib.sha256(str(workdir).encode()).hexdigest()[:16]
  return wandb.init(project=project, id=run_id, resume="allow", name=workdir.name,
                    config=json.loads(config_json) if config_json else None,
                    dir=str(workdir) if is_local(workdir) else None)


class Writer:
  """Progress bar + metrics.jsonl + TensorBoard (+ W&B); a no-op on processes other than 0."""

  def __init__(self, workdir, total_steps: int, start_step: int, *, enabled: bool,
               wandb_project: str = "", config_json: str = ""):
    self.enabled = enabled
    self.bar = self.tb = self.jsonl = self.wandb = None
    if not enabled:
      return
    workdir = epath.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / METRICS_FILE
    self.jsonl = path.open("a") if is_local(workdir) else _WholeFile(path)
    self.tb = _tensorboard(workdir / "tb")
    if wandb_project:
      self.wandb = _wandb(wandb_project, workdir, config_json)
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
    self._last = (start_step, time.perf_counter())

  def write(self, step: int, scalars: dict) -> None:
    if not self.enabled:
      return
    scalars = {k: float(v) for k, v in scalars.items()}
    # A skipped step's NaN is null: strict JSON readers (jq, JavaScript) refuse NaN.
    row = {k: v if math.isfinite(v) else None for k, v in scalars.items()}
    self.jsonl.write(json.dumps({"step": step, **row}) + "\n")
    self.jsonl.flush()
    if self.tb is not None:
      for k, v in scalars.items():
        self.tb.add_scalar(k, v, step)
    if self.wandb is not None:
      self.wandb.log(scalars, step=step)

  def progress(self, step: int, scalars: dict) -> None:
    if not self.enabled:
      return
    self.bar.update(step - self.bar.n)
    shown = {"loss": f"{scalars['loss']:.3f}", "tok/s": f"{scalars['tokens_per_s']:.0f}"}
    if "mfu" in scalars:
      shown["mfu"] = f"{100 * scalars['mfu']:.1f}%"
    if "host_wait_frac" in scalars:   # the loop waiting for its input: the host paces the run
      shown["wait"] = f"{100 * scalars['host_wait_frac']:.0f}%"
    self.bar.set_postfix(shown, refresh=True)

  def message(self, text: str) -> None:
    if self.enabled:
      (self.bar.write if self.bar else print)(text)

  def close(self) -> None:
    if not self.enabled:
      return
    self.bar.close()
    self.jsonl.close()
    if self.tb is not None:
      self.tb.close()
    if self.wandb is not None:
      self.wandb.finish()


class Interval:
  """The metrics of the steps since the last log line: means, Σ value / count, tokens/s.
  Rows are a step's device metrics and its `loop.Batch` (tokens, info)."""

  def __init__(self, lr_at, flops_per_token):
    self.lr_at, self.flops = lr_at, flops_per_token
    self.peak = peak_flops_per_device() if flops_per_token else None
    self.rows, self.waited, self.t0 = [], 0.0, time.perf_counter()

  def add(self, m: dict, batch):
    self.rows.append((m, batch))

  def scalars(self, step: int) -> dict:
    now = time.perf_counter()
    elapsed = max(now - self.t0, 1e-9)
    n = len(self.rows)
    tps = sum(b.tokens for _, b in self.rows) / elapsed
    out = {"loss": sum(float(m["loss"]) for m, _ in self.rows) / n,
           "grad_norm": sum(float(m["grad_norm"]) for m, _ in self.rows) / n,
           "lr": self.lr_at(step - 1), "tokens_per_s": tps,
           # Near 0 when the input keeps up; near 1 when the host, not the device, paces the run.
           "host_wait_frac": self.waited / elapsed, **self.rows[-1][1].info}
    for name in self.rows[-1][0]["sums"]:
      total = sum(float(m["sums"][name][0]) for m, _ in self.rows)
      count = sum(float(m["sums"][name][1]) for m, _ in self.rows)
      if count:
        out[name] = total / count
    if self.peak:
      out["mfu"] = tps * self.flops / (self.peak * jax.device_count())
    self.rows, self.waited, self.t0 = [], 0.0, now
    return out
