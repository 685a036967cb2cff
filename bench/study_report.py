"""The study's report (bench/study.py --stage collect): the claims, the markdown tables, the figures.

  python bench/study_report.py study.json [--figures DIR]   # the tables again from a study JSON

A claim is a comparison of one number per seed: Δ = the arm's value − the reference's (another arm,
the best other arm, or nothing: then Δ is the arm's own value), and it holds for a seed when
`Δ <op> bound`. Seeds are paired, so a seed missing either side is left out of that claim. The
verdict is "held" or "did not hold" only when at least two seeds agree; otherwise, and for a
retrieval claim where neither arm retrieves inside its trained context, it is "undecided at this
budget" with the reason (a retrieval claim counts only the seeds where retrieval formed inside the
context). Each claim also gets the mean Δ and its 95% t-interval over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import operator
import os
import statistics

# The claim put dilution 0.036 nats behind softmax+RoPE at 209M / 1K; up to this counts as "small".
GAP_TOLERANCE = 0.1
# Long-book NLL past the trained context minus in context: up to this counts as "flat", more as
# "degrades" (the dilution page's NoPE softmax loses whole nats past its context).
FLAT_TOLERANCE = 0.05
OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt}
# A retrieval claim past the context needs retrieval inside it: in-context accuracy above chance by
# this much in at least one of the two arms.
RETRIEVES = 0.2
# Two-sided 95% Student t quantiles by degrees of freedom (seeds - 1).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
# (claim, arm, reference: an arm | "best other" | None, key, (op, bound) a supporting Δ meets, note)
CLAIMS = (
    ("focal t=0.4: lower val loss than softmax+RoPE", "focal", "softmax_rope", "val_loss",
     ("<", 0.0), ""),
    ("focal learned: lower val loss than softmax+RoPE", "focal_learned", "softmax_rope",
     "val_loss", ("<", 0.0), ""),
    ("focal t=0.4: better passkey retrieval than softmax+RoPE inside the trained context", "focal",
     "softmax_rope", "passkey_in_context", (">", 0.0),
     "accuracy at 1x; the paper's largest gains are in retrieval and in-context learning"),
    ("focal t=0.4: better passkey retrieval than softmax+RoPE past the trained context", "focal",
     "softmax_rope", "passkey_beyond", (">", 0.0), "mean accuracy at 2x..8x (NTK doubling)"),
    (f"dilution-NoPE: long-book NLL flat past the trained context (drift <= {FLAT_TOLERANCE})",
     "dilution_nope", None, "longdoc_drift", ("<=", FLAT_TOLERANCE),
     "drift = mean NLL of the ranges past 1x - in-context mean"),
    (f"softmax-NoPE: long-book NLL degrades past the trained context (drift > {FLAT_TOLERANCE})",
     "softmax_nope", None, "longdoc_drift", (">", FLAT_TOLERANCE),
     "the failure dilution is claimed to avoid"),
    ("dilution-NoPE: lower long-book NLL than softmax-NoPE past the trained context",
     "dilution_nope", "softmax_nope", "longdoc_beyond", ("<", 0.0),
     "mean of the ranges past 1x (includes any in-context gap)"),
    ("dilution-NoPE: better keyword retrieval than softmax-NoPE past the trained context",
     "dilution_nope", "softmax_nope", "keyword_beyond", (">", 0.0), "mean accuracy at 2x..8x"),
    ("dilution-NoPE: better passkey retrieval than softmax-NoPE past the trained context",
     "dilution_nope", "softmax_nope", "passkey_beyond", (">", 0.0), "mean accuracy at 2x..8x"),
    ("dilution-NoPE: better passkey retrieval than softmax+RoPE past the trained context",
     "dilution_nope", "softmax_rope", "passkey_beyond", (">", 0.0), "mean accuracy at 2x..8x"),
    (f"dilution-NoPE's in-domain cost vs softmax+RoPE is small (val loss gap <= {GAP_TOLERANCE})",
     "dilution_nope", "softmax_rope", "val_loss", ("<=", GAP_TOLERANCE),
     "claimed: +0.036 nats at 209M / 1K context"),
    ("the alternating hybrid has the lowest validation loss of all arms", "hybrid", "best other",
     "val_loss", ("<", 0.0), "reference: the best other arm of the same seed"),
)


def interval(deltas: list[float]) -> list[float] | None:
  """The mean's 95% t-interval over seeds (None with fewer than two)."""
  if len(deltas) < 2:
    return None
  mean, half = statistics.fmean(deltas), T95.get(len(deltas) - 1, 1.96) * statistics.stdev(
      deltas) / math.sqrt(len(deltas))
  return [mean - half, mean + half]


def _retrieves(runs: dict, arms: list, seed: int, suite: str) -> bool:
  """Whether any of `arms` retrieves inside its trained context (above chance by RETRIEVES)."""
  rs = [runs.get((arm, seed), {}) for arm in arms]
  return any((r.get(f"{suite}_in_context") or 0.0)
             > (r.get(suite, {}).get("chance") or 0.0) + RETRIEVES for r in rs)


def verdict(supports: list[bool]) -> str:
  if not supports:
    return "n/a (arm or result missing)"
  if len(supports) < 2:
    return "undecided at this budget: one seed"
  n = sum(supports)
  return ("held" if n == len(supports) else "did not hold" if n == 0
          else f"undecided at this budget: seeds disagree ({n}/{len(supports)} support it)")


def claims(runs: dict) -> list[dict]:
  """Each claim of CLAIMS over runs {(arm, seed): run}: Δ per seed, its interval and a verdict."""
  out = []
  for text, arm, other, key, (op, bound), note in CLAIMS:
    deltas = {}
    for seed in sorted({s for _, s in runs}):
      mine = runs.get((arm, seed), {}).get(key)
      if other is None:
        theirs = 0.0
      else:
        refs = ([r.get(key) for (a, s), r in runs.items() if s == seed and a != arm]
                if other == "best other" else [runs.get((other, seed), {}).get(key)])
        theirs = min((v for v in refs if v is not None), default=None)
      if mine is not None and theirs is not None:
        deltas[str(seed)] = mine - theirs
    suite = key.split("_")[0]
    # A retrieval claim counts only the seeds where retrieval formed inside the context.
    counted = [d for s, d in deltas.items() if suite not in ("passkey", "keyword")
               or _retrieves(runs, [arm, other], int(s), suite)]
    out.append({"claim": text, "arm": arm, "reference": other, "key": key, "test": [op, bound],
                "deltas": deltas, "interval": interval(list(deltas.values())),
                "verdict": ("undecided at this budget: neither arm retrieves inside its trained "
                            "context") if deltas and not counted
                           else verdict([OPS[op](d, bound) for d in counted]), "note": note})
  return out


def _seeds(vals: list, fmt="{:.3f}") -> str:
  """"a / b (mean m)" over seeds."""
  ok = [v for v in vals if v is not None]
  return " / ".join("–" if v is None else fmt.format(v) for v in vals) + (
      f" (mean {fmt.format(statistics.fmean(ok))})" if len(ok) > 1 else "")


def _table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
  row = lambda cells: "| " + " | ".join(cells) + " |"
  return [title, "", row(header), row(["---"] * len(header)), *map(row, rows), ""]


def _by_arm(study: dict) -> dict[str, list[dict]]:
  by_arm: dict[str, list[dict]] = {}
  for r in study["runs"]:
    by_arm.setdefault(r["arm"], []).append(r)
  return by_arm


def markdown(study: dict) -> str:
  by_arm = _by_arm(study)
  mil = lambda n: f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"
  out = _table("Runs (values per seed)", ["arm", "pattern", "params", "train tokens", "val loss",
                                           "final train loss", "tokens/s", "train min", "eval min"],
               [[arm, f"`{rs[0]['pattern']}`" + (" learned τ" if rs[0]["learned"] else ""),
                 mil(rs[0]["params"]), mil(rs[0]["tokens"]),
                 *(_seeds([r.get(k) for r in rs]) for k in ("val_loss", "train_loss")),
                 _seeds([r.get("tokens_per_s") for r in rs], "{:,.0f}"),
                 *(_seeds([r.get(k, 0) / 60 for r in rs], "{:.1f}") for k in ("train_s", "eval_s"))]
                for arm, rs in by_arm.items()])
  long = {arm: [r for r in rs if "longdoc" in r] for arm, rs in by_arm.items()}
  if any(long.values()):
    first = next(rs[0] for rs in long.values() if rs)
    T, ranges = first["seq_len"], first["longdoc"]["ranges"]
    out += _table(f"Long-book NLL by position range (nats/token, mean over seeds; * = past the "
                  f"trained {T}; RoPE arms: NTK doubling passes)",
                  ["arm", "curve", "in-context"] + [f"[{a},{b}){'*' if a >= T else ''}"
                                                    for a, b in ranges] + ["drift"],
                  [[arm, rs[0]["longdoc"]["curve"],
                    f"{statistics.fmean(r['longdoc']['in_context'] for r in rs):.3f}"]
                   + [f"{statistics.fmean(c):.3f}"
                      for c in zip(*(r["longdoc"]["mean"] for r in rs))]
                   + [_seeds([r.get("longdoc_drift") for r in rs], "{:+.3f}")]
                   for arm, rs in long.items() if rs])
  for suite in ("passkey", "keyword"):
    have = {arm: [r for r in rs if suite in r] for arm, rs in by_arm.items()}
    if not any(have.values()):
      continue
    first = next(rs[0] for rs in have.values() if rs)
    chance = first[suite]["chance"]
    out += _table(f"{suite} accuracy by length (mean over seeds"
                  + (f"; chance {chance:.3f})" if chance else ")"),
                  ["arm"] + [f"{n} ({n // first['seq_len']}x)" for n in first[suite]["lengths"]],
                  [[arm] + ["–" if None in c else f"{statistics.fmean(c):.2f}"
                            for c in zip(*(r[suite]["by_length"] for r in rs))]
                   for arm, rs in have.items() if rs])
  out += _table("Claims (Δ = arm − reference, or the arm's own value where there is none; "
                "paired by seed)",
                ["claim", "Δ per seed", "mean Δ [95% interval]", "verdict", "note"],
                [[c["claim"], ", ".join(f"s{s}: {d:+.3f}" for s, d in c["deltas"].items()) or "–",
                  "{:+.3f} [{:+.3f}, {:+.3f}]".format(sum(c["interval"]) / 2, *c["interval"])
                  if c.get("interval") else "–",
                  f"**{c['verdict']}**", c["note"]] for c in study["claims"]])
  return "\n".join(out)


def figures(study: dict, out_dir: str, stem: str = "study", log=print) -> list[str]:
  """STEM_val_loss.png (validation loss by step) and STEM_longdoc.png (NLL by position); STEM is
  the study JSON's name, so two studies' figures sit side by side."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    log("figures skipped: matplotlib is not installed (pip install matplotlib)")
    return []
  by_arm, written = _by_arm(study), []
  # One colour per arm, one line style per seed: twelve lines stay readable.
  color = {arm: f"C{i}" for i, arm in enumerate(by_arm)}
  style = lambda r: {"color": color[r["arm"]], "linestyle": ("-", "--", ":", "-.")[r["seed"] % 4],
                     "label": f"{r['arm']} s{r['seed']}"}
  os.makedirs(out_dir, exist_ok=True)
  fig, ax = plt.subplots(figsize=(6.4, 4))
  for arm, rs in by_arm.items():
    for r in rs:
      if r.get("val_curve"):
        steps, losses = zip(*r["val_curve"])
        ax.plot(steps, losses, marker=".", **style(r))
  ax.set(xlabel="step", ylabel="validation loss (nats/token)", title="Validation loss")
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
  written.append(os.path.join(out_dir, f"{stem}_val_loss.png"))
  fig.savefig(written[-1], dpi=110, bbox_inches="tight")
  plt.close(fig)
  long = [r for rs in by_arm.values() for r in rs if "longdoc" in r]
  if long:
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for r in long:
      ends = [b for _, b in r["longdoc"]["ranges"]]
      ax.plot(ends, r["longdoc"]["mean"], marker="o", **style(r))
    ax.axvline(long[0]["seq_len"], color="grey", linewidth=0.8, label="trained context")
    ax.set(xscale="log", xlabel="position (end of range, tokens)",
           ylabel="NLL (nats/token)", title="Long held-out books: loss by position")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    written.append(os.path.join(out_dir, f"{stem}_longdoc.png"))
    fig.savefig(written[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
  log(f"figures: {', '.join(written)}")
  return written


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("study_json", help="bench/study.py's --out")
  p.add_argument("--figures", metavar="DIR", help="also draw the figures into DIR")
  args = p.parse_args(argv)
  try:
    with open(args.study_json) as f:
      study = json.load(f)
  except (OSError, ValueError) as e:
    p.error(f"{args.study_json}: {e}")
  if not isinstance(study, dict) or "runs" not in study:
    p.error(f"{args.study_json}: not a study JSON (bench/study.py --out): no 'runs'")
  if args.figures and os.path.exists(args.figures) and not os.path.isdir(args.figures):
    p.error(f"--figures {args.figures}: a file, not a directory")
  print(markdown(study))
  if args.figures:
    figures(study, args.figures, stem=os.path.splitext(os.path.basename(args.study_json))[0])


if __name__ == "__main__":
  main()
