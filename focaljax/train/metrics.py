"""Training metrics: a progress bar (loss, tokens/s, MFU), JSONL, and TensorBoard event files.

Only process 0 writes. MFU = model FLOPs per second / peak FLOPs of the devices in use
(`focaljax.dispatch.peak_flops`: dense bf16 datasheet numbers; MFU is not shown for a chip it
does not know).
"""

from __future__ import annotations

import json
import os
import time

from focaljax import dispatch

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


class Writer:
  """Progress bar + metrics.jsonl + TensorBoard; a no-op on processes other than 0."""

  def __init__(self, workdir: str, total_steps: int, start_step: int, *, enabled: bool):
    self.enabled = enabled
    self.bar = self.tb = self.jsonl = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self.jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
    try:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self.tb = SummaryWriter(os.path.join(workdir, "tb"))
    except ImportError:
      self.tb = None
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
    self._last = (start_step, time.perf_counter())

  def write(self, step: int, scalars: dict) -> None:
    if not self.enabled:
      return
    scalars = {k: float(v) for k, v in scalars.items()}
    self.jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
    self.jsonl.flush()
    if self.tb is not None:
      for k, v in scalars.items():
        self.tb.add_scalar(k, v, step)

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
