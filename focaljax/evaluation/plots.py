"""PNG figures (matplotlib, the optional extra `plots`) drawn from the suites' result dicts and
metrics.jsonl, never from a model, so old results can be re-plotted without re-running."""

from __future__ import annotations

import json

from etils import epath


def _pyplot():
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")  # no display on training hosts
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def _save(fig, path: str) -> str:
  fig.tight_layout()
  with epath.Path(path).open("wb") as f:
    fig.savefig(f, format="png", dpi=110)
  _pyplot().close(fig)
  return path


def loss_by_position(result: dict, path: str) -> str:
  """NLL per doubling position range, one line per pass, the trained context marked."""
  fig, ax = _pyplot().subplots(figsize=(6.4, 4))
  # Geometric midpoints: the ranges double, so a log axis spaces them evenly.
  xs = [((max(a, 1) * b) ** 0.5) for a, b in result["ranges"]]
  for name, curve in result["curves"].items():
    ax.errorbar(xs, curve["mean"], yerr=curve["stderr"], marker="o", ms=3, capsize=2,
                label=name)
  ax.axvline(result["trained_len"], color="gray", ls="--", lw=1, label="trained context")
  ax.set_xscale("log", base=2)
  ax.set(xlabel="token position (range midpoint)", ylabel="NLL (nats/token)",
         title=f"Loss by position, {result['num_books']} documents")
  ax.legend()
  return _save(fig, path)


def retrieval_heatmap(result: dict, path: str, title: str) -> str:
  """Accuracy per (length, depth) as a heat map, the value written in each cell."""
  acc = [[float("nan") if a is None else a for a in row] for row in result["accuracy"]]
  fig, ax = _pyplot().subplots(figsize=(1.2 + 0.9 * len(result["depths"]), 1.2 + 0.5 * len(acc)))
  im = ax.imshow(acc, vmin=0, vmax=1, cmap="viridis", aspect="auto")
  ax.set_xticks(range(len(result["depths"])), [f"{d:.2f}" for d in result["depths"]])
  ax.set_yticks(range(len(result["lengths"])), [str(n) for n in result["lengths"]])
  for i, row in enumerate(acc):
    for j, a in enumerate(row):
      ax.text(j, i, "-" if a != a else f"{a:.2f}", ha="center", va="center",
              color="w" if a < 0.6 else "k", fontsize=8)
  overall = result["overall"]
  ax.set(xlabel="needle depth", ylabel="context length (tokens)",
         title=f"{title}: overall " + ("-" if overall is None else f"{overall:.2f}"))
  fig.colorbar(im, ax=ax, fraction=0.05)
  return _save(fig, path)


def training_curves(metrics_path: str, path: str) -> str | None:
  """Train loss (and validation loss), learning rate and throughput against step."""
  lines = epath.Path(metrics_path).read_text().splitlines()
  rows = [json.loads(line) for line in lines if line.strip()]
  panels = [k for k in ("loss", "lr", "tokens_per_s") if any(k in r for r in rows)]
  if not panels:
    return None
  fig, axes = _pyplot().subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
  for ax, key in zip(axes[0], panels):
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]   # null: a skipped step
    ax.plot(*zip(*pts), lw=1, label=key)
    if key == "loss":
      val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
      if val:
        ax.plot(*zip(*val), "o-", ms=3, label="val_loss")
      ax.legend()
    ax.set(xlabel="step", title=key)
  return _save(fig, path)


def attention_distribution(result: dict, path: str) -> str:
  """One query's attention over key positions: softmax vs focal (the focal paper's Figure 1)."""
  fig, ax = _pyplot().subplots(figsize=(7, 3.4))
  keys = range(len(result["softmax"]))
  ax.plot(keys, result["softmax"], lw=1, label="softmax(q·k/√d)")
  ax.plot(keys, result["focal"], lw=1, label=f"softmax(q·k/(t√d)), t={result['temperature']:.3g}")
  ax.set(xlabel="key position", ylabel="attention probability",
         title=f"Last query, layer {result['layer']} head {result['head']} ({result['variant']} "
         "layer)")
  ax.legend()
  return _save(fig, path)


def write_all(results: dict, workdir: str, out_dir: str, log=print) -> list[str]:
  """Every figure the results allow, as PNGs in out_dir; [] (with a note) without matplotlib."""
  try:
    _pyplot()
  except ImportError:
    log("plots skipped: matplotlib is not installed (pip install matplotlib)")
    return []
  out, metrics = epath.Path(out_dir), epath.Path(workdir) / "metrics.jsonl"
  figures = {"longdoc": ("loss_by_position", loss_by_position),
             "passkey": ("passkey", lambda r, p: retrieval_heatmap(r, p, "Passkey retrieval")),
             "keyword": ("keyword", lambda r, p: retrieval_heatmap(r, p, "Keyword retrieval")),
             "attention": ("attention", attention_distribution)}
  written = [draw(results[suite], str(out / f"{name}.png"))
             for suite, (name, draw) in figures.items()
             if isinstance(results.get(suite), dict) and "skipped" not in results[suite]]
  if metrics.exists():
    written += [c for c in [training_curves(str(metrics), str(out / "training.png"))] if c]
  log(f"plots: {', '.join(epath.Path(p).name for p in written) or 'none'}")
  return written
