"""The attention variants' claims tested at small scale on a real corpus, with one command.

  python bench/study.py --root runs/study --steps 900 --seeds 0,1 --out docs/results/study.json
  python bench/study.py --root runs/study --arms softmax_rope,dilution_nope --time_limit 540
  python bench/study.py --root runs/study --print             # the commands, for a cluster
  bash bench/device.sh study:560                              # on a GPU machine, arms per GPU

The corpus defaults to .data/corpus/{train,valid,longeval}.jsonl.xz (JSON lines with "text").

Stages, each skipped once its output exists (re-running the same command resumes):
  tokenizer  one byte-level BPE (--vocab) trained on the train split: ROOT/tokenizer/, read by
             every arm.
  train      `train.py` per arm and seed in ROOT/<arm>-s<seed>: configs/base.py at --size, the same
             data, schedule, token budget and seed (hence data order); only the attention differs.
             Done at the final step's checkpoint; an interrupted run resumes from its latest.
  eval       `eval.py --books <longeval>`: validation loss, loss by position and passkey/keyword
             retrieval to 8x the trained context. Done when eval/results.json has the final step.
  collect    one JSON (--out), markdown tables, the per-claim verdicts and two figures next to
             the JSON (bench/study_report.py).

--time_limit: past it the running child gets SIGTERM (train.py saves and exits) and the study exits
3; the same command continues later. Arguments after `--` go to every train.py.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import pathlib
import shlex
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: study_report
import study_report as report  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(REPO, ".data", "corpus")
# arm: (model.attention.pattern, model.attention.learned). Focal's t=0.4 is base.py's default.
ARMS = {"softmax_rope": ("softmax:rope", False), "focal": ("focal:rope", False),
        "focal_learned": ("focal:rope", True), "softmax_nope": ("softmax:none", False),
        "dilution_nope": ("dilution:none", False),
        "hybrid": ("softmax:rope,dilution:none", False)}


class OutOfTime(Exception):
  """--time_limit ran out."""


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  add = p.add_argument
  add("--root", required=True, help="parent of the tokenizer and every arm's workdir")
  add("--arms", default=",".join(ARMS), help=f"comma list of {list(ARMS)}")
  add("--seeds", default="0", help="comma list, e.g. 0,1")
  add("--size", default="100m", help="configs/sizes.py preset")
  for name in ("steps", "seq_len", "global_batch"):  # train.steps, data.*; default: the preset's
    add(f"--{name}", type=int)
  add("--warmup_steps", type=int, help="optim.warmup_steps (with --steps: min(500, steps/10))")
  add("--implementation", default="auto", help="model.attention.implementation")
  add("--qk_norm", default="on", choices=("on", "off"),
      help="model.qk_norm on every arm (the focal paper's baseline bounds its logits with it)")
  add("--retrieval_mix", type=float, default=0.5,
      help="data.retrieval_mix on every arm: the share of rows that are passkey drills, so that "
           "in-context retrieval forms and its extrapolation can be tested")
  add("--vocab", type=int, default=16384, help="BPE vocabulary size")
  add("--digits", default="", choices=("", "digits", "llama_digits"),
      help="how the BPE spells numbers (data.tokenizer train:<vocab>:<digits>; "
           "focaljax.data.tokenizer.DIGIT_STYLES)")
  for name, file in (("train", "train"), ("valid", "valid"), ("books", "longeval")):
    add(f"--{name}", default=os.path.join(CORPUS, f"{file}.jsonl.xz"))
  add("--suites", help="eval.py --suites (default: all)")
  add("--max_multiplier", type=int, default=8, help="eval lengths up to this x the context")
  add("--val_batches", type=int, default=1000, help="default: the whole valid split")
  add("--no_plots", action="store_true", help="eval.py --noplots; no study figures")
  add("--out", help="results JSON (default ROOT/study.json)")
  add("--include", default="",
      help="comma list of earlier study JSONs: their runs of --arms/--seeds that ROOT lacks join "
           "the tables (arms trained in separate calls; same tokenizer, data and schedule)")
  add("--stage", default="all", choices=("all", "tokenizer", "collect"))
  add("--time_limit", type=float, help="seconds for this invocation (see above)")
  add("--print", dest="print_only", action="store_true", help="print the commands, run nothing")
  args, extra = p.parse_known_args(argv)
  args.extra = [e for e in extra if e != "--"]
  args.arms = [a for a in args.arms.split(",") if a]
  if set(args.arms) - set(ARMS):
    p.error(f"--arms: unknown {sorted(set(args.arms) - set(ARMS))}; allowed {list(ARMS)}")
  if not all(s.isdigit() for s in args.seeds.split(",") if s):
    p.error(f"--seeds {args.seeds!r}: a comma list of integers >= 0, e.g. 0,1")
  args.seeds = [int(s) for s in args.seeds.split(",") if s]
  args.out = args.out or os.path.join(args.root, "study.json")
  # Absolute: eval.py re-reads them from config.json, possibly from another directory.
  args.train, args.valid, args.books = map(os.path.abspath, (args.train, args.valid, args.books))
  return args


def tokenizer_file(args) -> str:
  return os.path.join(args.root, "tokenizer", "tokenizer.json")


def workdir(args, arm: str, seed: int) -> str:
  return os.path.join(args.root, f"{arm}-s{seed}")


def train_argv(args, arm: str, seed: int) -> list[str]:
  pattern, learned = ARMS[arm]
  warmup = args.warmup_steps
  if warmup is None and args.steps is not None:
    warmup = min(500, args.steps // 10)  # a short study must still reach its peak LR
  # Scripts relative to the working directory: short printed commands, run from anywhere.
  argv = [sys.executable, os.path.relpath(os.path.join(REPO, "train.py")),
          f"--config={os.path.relpath(os.path.join(REPO, 'configs', 'base.py'))}:size={args.size}",
          f"--workdir={workdir(args, arm, seed)}", f"--config.seed={seed}",
          f"--config.data.source=text:{args.train}",
          f"--config.data.valid_source=text:{args.valid}",
          f"--config.data.tokenizer={tokenizer_file(args)}",
          # Streaming tokenization cannot feed a GPU training a 100M model.
          "--config.data.tokenize=ahead",
          # Tokenized once per root: later arms load it instead of tokenizing again.
          f"--config.data.token_cache={os.path.join(args.root, 'tokens')}",
          f"--config.model.attention.pattern={pattern}",
          f"--config.model.attention.learned={learned}",
          f"--config.model.attention.implementation={args.implementation}"]
  fields = {"train.steps": args.steps, "data.seq_len": args.seq_len,
            "data.global_batch": args.global_batch, "optim.warmup_steps": warmup,
            "model.qk_norm": args.qk_norm == "on", "data.retrieval_mix": args.retrieval_mix}
  return argv + [f"--config.{k}={v}" for k, v in fields.items() if v is not None] + args.extra


def eval_argv(args, arm: str, seed: int) -> list[str]:
  return [sys.executable, os.path.relpath(os.path.join(REPO, "eval.py")),
          f"--workdir={workdir(args, arm, seed)}", f"--books={args.books}",
          f"--max_multiplier={args.max_multiplier}", f"--val_batches={args.val_batches}"] + (
              [f"--suites={args.suites}"] if args.suites else []) + (
                  ["--noplots"] if args.no_plots else [])


def _read_json(path: str):
  try:
    with open(path) as f:
      return json.load(f)
  except (FileNotFoundError, json.JSONDecodeError):
    return None


def final_step(wd: str) -> int | None:
  """train.steps as the run was configured (train.py writes config.json when it starts)."""
  config = _read_json(os.path.join(wd, "config.json"))
  return config["train"]["steps"] if config else None


def trained(wd: str) -> bool:
  return os.path.isdir(os.path.join(wd, "checkpoints", str(final_step(wd))))


def evaluated(args, wd: str) -> bool:
  results = _read_json(os.path.join(wd, "eval", "results.json"))
  if not results or results["meta"]["step"] != final_step(wd):
    return False
  return not args.suites or set(args.suites.split(",")) <= set(results["meta"]["suites"])


class StudyError(ValueError):
  """Arguments that contradict what the study root holds: one line, exit 2, nothing run."""


def train_tokenizer(args) -> str:
  path = tokenizer_file(args)
  spec = f"train:{args.vocab}" + (f":{args.digits}" if args.digits else "")
  spec_file = os.path.join(os.path.dirname(path), "spec")   # what trained it
  if os.path.isfile(path):
    had = open(spec_file).read().strip() if os.path.isfile(spec_file) else spec
    if had != spec:
      raise StudyError(f"{path} was trained as {had}, not {spec}: use its --vocab/--digits")
    print(f"tokenizer: reusing {path}", flush=True)
    return path
  from focaljax.data import pipeline as data  # pylint: disable=import-outside-toplevel
  cfg = data.DataConfig(source=f"text:{args.train}", valid_source=f"text:{args.valid}",
                        tokenizer=spec, seq_len=1, global_batch=1)
  t0 = time.time()
  tok = data.load_tokenizer(cfg, os.path.dirname(path))  # trains on the train split only
  pathlib.Path(spec_file).write_text(spec + "\n")
  print(f"tokenizer: {tok.vocab_size} tokens in {time.time() - t0:.0f} s -> {path}", flush=True)
  return path


def _run(argv: list[str], deadline: float | None) -> int:
  """Runs argv; past the deadline sends it SIGTERM (train.py saves and exits) and raises."""
  print("+ " + shlex.join(argv), flush=True)
  proc = subprocess.Popen(argv)
  try:
    return proc.wait(None if deadline is None else max(1.0, deadline - time.time()))
  except subprocess.TimeoutExpired:
    proc.send_signal(signal.SIGTERM)
    try:
      proc.wait(300)  # a 100M checkpoint takes seconds; a slow filesystem gets minutes
    except subprocess.TimeoutExpired:
      proc.kill()  # reaped when the study exits, right after
    raise OutOfTime from None


def _add_time(wd: str, key: str, seconds: float) -> None:
  path = os.path.join(wd, "study_times.json")
  times = _read_json(path) or {}
  times[key] = round(times.get(key, 0.0) + seconds, 1)  # a resumed run's parts add up
  os.makedirs(wd, exist_ok=True)
  with open(path, "w") as f:
    json.dump(times, f)


def _changed(wd: str, argv: list[str]) -> list[str]:
  """The --config.<field>=value of `argv` that the run saved in wd (config.json) had otherwise."""
  saved, out = _read_json(os.path.join(wd, "config.json")), []
  for arg in argv if saved else []:
    if arg.startswith("--config.") and "=" in arg:
      field, value = arg[len("--config."):].split("=", 1)
      node = functools.reduce(lambda n, k: n.get(k) if isinstance(n, dict) else None,
                              field.split("."), saved)
      if node is not None and str(node) != value:
        out.append(f"{field} {node} -> {value}")
  return out


def run_all(args) -> int:
  deadline = None if args.time_limit is None else time.time() + args.time_limit
  for seed in args.seeds:   # a finished run under other arguments would be reported as this one
    for arm in args.arms:
      if diff := _changed(workdir(args, arm, seed), train_argv(args, arm, seed)):
        raise StudyError(f"{workdir(args, arm, seed)} was trained with other arguments "
                         f"({', '.join(diff)}): use its arguments, or another --root")
  train_tokenizer(args)
  failed = []
  try:
    for seed in args.seeds:
      for arm in args.arms:
        wd = workdir(args, arm, seed)
        for stage, argv in (("train", train_argv(args, arm, seed)),
                            ("eval", eval_argv(args, arm, seed))):
          if trained(wd) if stage == "train" else evaluated(args, wd):
            print(f"{arm} seed {seed}: {stage} done, skipped", flush=True)
            continue
          t0 = time.time()
          try:
            rc = _run(argv, deadline)
          finally:
            _add_time(wd, f"{stage}_s", time.time() - t0)
          if rc != 0:
            failed.append(f"{arm} seed {seed} ({stage}, exit {rc})")
            break  # no eval of a failed training run
  except OutOfTime:
    print(f"time limit {args.time_limit:.0f} s reached; run the same command to resume")
    return 3  # incomplete (module docstring)
  collect_and_print(args)
  print("".join(f"FAILED: {f}\n" for f in failed), end="")
  return 1 if failed else 0


def collect_run(args, arm: str, seed: int) -> dict | None:
  """One arm and seed's numbers from its workdir (None before training started)."""
  wd = workdir(args, arm, seed)
  config = _read_json(os.path.join(wd, "config.json"))
  if config is None:
    return None
  # Lazy: --print and the tokenizer stage need no jax.
  # pylint: disable=import-outside-toplevel
  from focaljax import config as config_lib
  from focaljax.data import tokenizer
  from focaljax.model import decoder as model
  from focaljax.train import checkpoint
  from focaljax.train import saved_config
  vocab = tokenizer.Tokenizer.load(wd).vocab_size
  path = pathlib.Path(wd, "metrics.jsonl")
  log = [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
  tps, losses = ([m[k] for m in log if k in m] for k in ("tokens_per_s", "loss"))
  val_curve = [[m["step"], m["val_loss"]] for m in log if "val_loss" in m]
  steps, T, B = config["train"]["steps"], config["data"]["seq_len"], config["data"]["global_batch"]
  a = config["model"]["attention"]
  results = _read_json(os.path.join(wd, "eval", "results.json")) or {}
  r = {"arm": arm, "seed": seed, "workdir": wd, "pattern": a["pattern"], "learned": a["learned"],
       "implementation": a["implementation"], "trained": trained(wd), "steps": steps,
       "seq_len": T, "global_batch": B, "tokens": steps * B * T, "vocab": vocab,
       "params": model.param_count(config_lib.model_config(saved_config.read(wd), vocab)),
       "train_loss": losses[-1] if losses else None,
       # The first logged interval includes compilation (and a resume's restore): the median.
       "tokens_per_s": statistics.median(tps[1:] or tps) if tps else None,
       # eval.py's loss over the valid split; before eval, the last in-training estimate.
       "val_loss": results.get("val", {}).get("loss", val_curve[-1][1] if val_curve else None),
       "val_tokens": results.get("val", {}).get("tokens"), "val_curve": val_curve,
       **(_read_json(os.path.join(wd, "study_times.json")) or {})}
  if "ranges" in results.get("longdoc", {}):
    ld = results["longdoc"]
    # RoPE arms: the §5 protocol's doubling curve (NTK per pass); NoPE arms have one pass.
    curve = "doubling" if "doubling" in ld["curves"] else "full"
    mean = ld["curves"][curve]["mean"]
    beyond = [m for (lo, _), m in zip(ld["ranges"], mean) if lo >= T]
    r["longdoc"] = {"curve": curve, "ranges": ld["ranges"], "mean": mean,
                    "in_context": ld["in_context"]["mean"],
                    "curves": {k: v["mean"] for k, v in ld["curves"].items()}}
    r["longdoc_beyond"] = statistics.fmean(beyond) if beyond else None
    r["longdoc_drift"] = (r["longdoc_beyond"] - ld["in_context"]["mean"]) if beyond else None
  for suite in ("passkey", "keyword"):
    if "lengths" in results.get(suite, {}):
      s = results[suite]
      r[suite] = {"lengths": s["lengths"], "by_length": s["accuracy_by_length"],
                  "chance": s.get("chance")}
      for name, past in (("beyond", True), ("in_context", False)):
        acc = [x for n, x in zip(s["lengths"], s["accuracy_by_length"])
               if (n > T) == past and x is not None]
        r[f"{suite}_{name}"] = statistics.fmean(acc) if acc else None
  return r


def _sha256(path: str) -> str | None:
  return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest() if os.path.isfile(path) \
      else None


def included_runs(args) -> dict:
  """(arm, seed) -> run from the --include JSONs, for the arms and seeds asked for."""
  runs, mine = {}, _sha256(tokenizer_file(args))
  for path in filter(None, args.include.split(",")):
    study = _read_json(path)
    if study is None or "runs" not in study:
      raise SystemExit(f"--include: {path} is not a study JSON (bench/study.py --out)")
    theirs = study.get("tokenizer_sha256")
    if theirs and mine and theirs != mine:
      raise SystemExit(f"--include: {path} was trained with another tokenizer than {args.root}'s")
    if study.get("size") != args.size:
      raise SystemExit(f"--include: {path} is a --size {study.get('size')} study, not {args.size}")
    for r in study["runs"]:
      if r["arm"] in args.arms and r["seed"] in args.seeds:
        runs.setdefault((r["arm"], r["seed"]), {**r, "included_from": path})
  return runs


def collect_and_print(args) -> dict:
  runs = {**included_runs(args),
          **{(arm, seed): r for seed in args.seeds for arm in args.arms
             if (r := collect_run(args, arm, seed)) is not None}}
  runs = {k: runs[k] for k in sorted(runs, key=lambda k: (k[1], args.arms.index(k[0])))}
  import jax  # pylint: disable=import-outside-toplevel
  study = {"collected_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
           "collected_on": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
           "jax": jax.__version__, "root": os.path.abspath(args.root),
           "tokenizer": tokenizer_file(args), "tokenizer_sha256": _sha256(tokenizer_file(args)),
           "train": args.train, "valid": args.valid,
           "books": args.books, "size": args.size, "arms": args.arms, "seeds": args.seeds,
           "runs": list(runs.values()), "claims": report.claims(runs),
           "commands": commands(args),
           **({"included": args.include.split(",")} if args.include else {})}
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(study, f, indent=1)
  print(report.markdown(study) + f"\nresults: {args.out}")
  if not args.no_plots:
    report.figures(study, os.path.dirname(os.path.abspath(args.out)),
                   stem=os.path.splitext(os.path.basename(args.out))[0])
  return study


def commands(args) -> list[str]:
  """Each arm and seed's train.py and eval.py command lines, as a shell would take them."""
  return [shlex.join(["python"] + f(args, a, s)[1:])
          for s in args.seeds for a in args.arms for f in (train_argv, eval_argv)]


def print_commands(args, argv: list[str]) -> None:
  # The stage goes first: anything after a `--` in argv belongs to train.py.
  own = lambda stage: (["python", os.path.relpath(os.path.abspath(__file__)), "--stage", stage]
                       + [a for a in argv if a != "--print"])
  print("\n".join([shlex.join(own("tokenizer")), *commands(args), shlex.join(own("collect"))]))


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  try:
    if args.print_only:
      print_commands(args, argv)
    elif args.stage == "tokenizer":
      train_tokenizer(args)
    elif args.stage == "collect":
      collect_and_print(args)
    else:
      return run_all(args)
  except StudyError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.path.insert(0, REPO)  # focaljax importable when run as bench/study.py without an install
  sys.exit(main())
