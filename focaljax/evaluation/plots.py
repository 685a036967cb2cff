"""PNG figures of evaluation results (matplotlib, Agg backend; the optional extra `plots`).

Every figure is drawn from the JSON-able result dicts of focaljax.evaluation.suites (and the trainer's
metrics.jsonl), never from a model, so old results can be re-plotted without re-running.
"""

from __future__ import annotations

import json
import os


def _pyplot():
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")  # no display on training hosts
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def loss_by_position(result: dict, path: str) -> str:
  """NLL per doubling position range, one line per pass, the trained context marked."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6.4, 4))
  # Geometric midpoints: the ranges double, so a log axis spaces them evenly.
  xs = [((max(a, 1) * b) ** 0.5) for a, b in result["ranges"]]
  for name, curve in result["curves"].items():
    ax.errorbar(xs, curve["mean"], yerr=curve["stderr"], marker="o", ms=3, capsize=2,
                label=name)
  ax.axvline(result["trained_len"], color="gray", ls="--", lw=1, label="trained context")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("token position (range midpoint)")
  ax.set_ylabel("NLL (nats/token)")
  ax.set_title(f"Loss by position, {result['num_books']} documents")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def retrieval_heatmap(result: dict, path: str, title: str) -> str:
  """Accuracy per (length, depth) as a heat map, the value written in each cell."""
  plt = _pyplot()
  acc = [[float("nan") if a is None else a for a in row] for row in result["accuracy"]]
  fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(result["depths"]), 1.2 + 0.5 * len(acc)))
  im = ax.imshow(acc, vmin=0, vmax=1, cmap="viridis", aspect="auto")
  ax.set_xticks(range(len(result["depths"])), [f"{d:.2f}" for d in result["depths"]])
  ax.set_yticks(range(len(result["lengths"])), [str(n) for n in result["lengths"]])
  for i, row in enumerate(acc):
    for j, a in enumerate(row):
      ax.text(j, i, "-" if a != a else f"{a:.2f}", ha="center", va="center",
              color="w" if a < 0.6 else "k", fontsize=8)
  ax.set_xlabel("needle depth")
  ax.set_ylabel("context length (tokens)")
  overall = result["overall"]
  ax.set_title(f"{title}: overall " + ("-" if overall is None else f"{overall:.2f}"))
  fig.colorbar(im, ax=ax, fraction=0.05)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def read_metrics(metrics_path: str) -> list[dict]:
  rows = []
  with open(metrics_path) as f:
    for line in f:
      if line.strip():
        rows.append(json.loads(line))
  return rows


def training_curves(metrics_path: str, path: str) -> str | None:
  """Train loss (and validation loss), learning rate and throughput against step."""
  rows = read_metrics(metrics_path)
  panels = [k for k in ("loss", "lr", "tokens_per_s") if any(k in r for r in rows)]
  if not panels:
    return None
  plt = _pyplot()
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
  for ax, key in zip(axes[0], panels):
    pts = [(r["step"], r[key]) for r in rows if key in r]
    ax.plot(*zip(*pts), lw=1, label=key)
    if key == "loss":
      val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
      if val:
        ax.plot(*zip(*val), "o-", ms=3, label="val_loss")
      ax.legend()
    ax.set_xlabel("step")
    ax.set_title(key)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def attention_distribution(result: dict, path: str) -> str:
  """One query's attention over key positions: softmax vs focal (the focal paper's Figure 1)."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 3.4))
  keys = range(len(result["softmax"]))
  ax.plot(keys, result["softmax"], lw=1, label="softmax(q·k/√d)")
  ax.plot(keys, result["focal"], lw=1, label=f"softmax(q·k/(t√d)), t={result['temperature']}")
  ax.set_xlabel("key position")
  ax.set_ylabel("attention probability")
  ax.set_title(f"Last query, layer {result['layer']} head {result['head']} "
               f"({result['variant']} layer)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def write_all(results: dict, workdir: str, out_dir: str, log=print) -> list[str]:
  """Every figure the results allow, as PNGs in out_dir; [] (with a note) without matplotlib."""
  try:
    _pyplot()
  except ImportError:
    log("plots skipped: matplotlib is not installed (pip install matplotlib)")
    return []
  usable = {k: v for k, v in results.items() if isinstance(v, dict) and "skipped" not in v}
  written = []
  if "longdoc" in usable:
    written.append(loss_by_position(usable["longdoc"],
                                    os.path.join(out_dir, "loss_by_position.png")))
  for suite, title in (("passkey", "Passkey retrieval"), ("keyword", "Keyword retrieval")):
    if suite in usable:
      written.append(retrieval_heatmap(usable[suite], os.path.join(out_dir, f"{suite}.png"), title))
  if "attention" in usable:
    written.append(attention_distribution(usable["attention"],
                                          os.path.join(out_dir, "attention.png")))
  metrics = os.path.join(workdir, "metrics.jsonl")
  if os.path.isfile(metrics):
    curve = training_curves(metrics, os.path.join(out_dir, "training.png"))
    written += [curve] if curve else []
  log(f"plots: {', '.join(os.path.basename(p) for p in written) or 'none'}")
  return written
