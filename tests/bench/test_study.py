"""bench/study.py: the study end to end at toy scale (two arms, a few steps, a tiny BPE), and its
--print launch lines."""

import importlib.util
import json
import os

import pytest

from focaljax.data import sources

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("study", os.path.join(ROOT, "bench", "study.py"))
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """Train / valid / books JSONL cut from the bundled text: small enough to tokenize in seconds."""
  d = tmp_path_factory.mktemp("corpus")
  docs = sources.read_text_files([str(sources.BUNDLED_TEXT)])
  splits = {"train": [t[:3000] for t in docs[:30]], "valid": [t[:3000] for t in docs[30:34]],
            "books": docs[34:36]}
  for name, texts in splits.items():
    with open(d / f"{name}.jsonl", "w") as f:
      f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
  return {k: str(d / f"{k}.jsonl") for k in splits}


def _args(corpus, root, *more):
  # No passkey drills: a 64-token row is shorter than one drill.
  return ["--retrieval_mix", "0", "--root", str(root), "--arms", "softmax_rope,dilution_nope",
          "--size", "small", "--steps", "2", "--vocab", "300", "--train", corpus["train"], "--valid",
          corpus["valid"], "--books", corpus["books"], "--suites", "val,longdoc",
          "--max_multiplier", "2", "--val_batches", "2", "--no_plots", *more]


def test_print_lists_one_train_and_one_eval_command_per_arm(corpus, tmp_path, capsys):
  assert study.main(_args(corpus, tmp_path, "--seeds", "0,1", "--print")) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  train = [l for l in lines if "train.py" in l]
  evals = [l for l in lines if "eval.py" in l]
  assert len(train) == len(evals) == 4  # 2 arms x 2 seeds
  assert "--stage tokenizer" in lines[0] and "--stage collect" in lines[-1]
  # Arms differ only in the attention; every arm reads the one shared tokenizer.
  strip = lambda l: " ".join(w for w in l.split() if "attention.pattern" not in w
                             and "workdir" not in w)
  assert strip(train[0]) == strip(train[1])
  assert "--config.model.qk_norm=True" in train[0] and "--config.data.retrieval_mix=0.0" in train[0]
  assert all(study.tokenizer_file(study.parse_args(_args(corpus, tmp_path))) in l for l in train)
  assert not (tmp_path / "tokenizer").exists()  # --print runs nothing


def test_tokenizer_stage_split_digits(corpus, tmp_path):
  from focaljax.data import tokenizer as tokenizer_lib
  for style in tokenizer_lib.DIGIT_STYLES:  # --digits spells the table's keys again
    assert study.parse_args(_args(corpus, tmp_path, "--digits", style)).digits == style
  assert study.main(_args(corpus, tmp_path, "--stage", "tokenizer", "--digits", "digits")) == 0
  tok = tokenizer_lib.Tokenizer.load(str(tmp_path / "tokenizer"))
  pieces = [tok.decode([i]).strip() for i in tok.encode(" 50054")]
  assert [p for p in pieces if p] == list("50054")  # " 5" may stay two tokens in a 300-token BPE


def test_study_end_to_end(corpus, tmp_path, capsys):
  out = tmp_path / "study.json"
  assert study.main(_args(corpus, tmp_path, "--out", str(out))) == 0
  result = json.loads(out.read_text())
  runs = {r["arm"]: r for r in result["runs"]}
  assert set(runs) == {"softmax_rope", "dilution_nope"}
  for r in runs.values():
    assert r["trained"] and r["steps"] == 2 and r["tokens"] == 2 * 8 * 64
    assert r["val_loss"] > 0 and r["tokens_per_s"] > 0 and r["train_s"] > 0
    assert r["longdoc_beyond"] is not None and len(r["longdoc"]["mean"]) == 5
  assert {c["verdict"] for c in result["claims"]} >= {"n/a (arm or result missing)"}
  gap = next(c for c in result["claims"] if "in-domain cost" in c["claim"])
  assert set(gap["deltas"]) == {"0"}
  table = capsys.readouterr().out
  assert "| softmax_rope |" in table and "| dilution_nope |" in table and "| claim |" in table
  # Re-running skips every finished stage (resumable) and reproduces the same results.
  assert study.main(_args(corpus, tmp_path, "--out", str(out))) == 0
  assert "train done, skipped" in capsys.readouterr().out
  assert json.loads(out.read_text())["runs"][0]["val_loss"] == runs["softmax_rope"]["val_loss"]
  # Other arguments over the same root are refused, not answered with the old runs.
  assert study.main(_args(corpus, tmp_path, "--out", str(out), "--steps", "4")) == 2
  assert "train.steps 2 -> 4" in capsys.readouterr().err
  assert study.main(_args(corpus, tmp_path, "--stage", "tokenizer", "--vocab", "320")) == 2
  assert "was trained as train:300, not train:320" in capsys.readouterr().err
  with pytest.raises(SystemExit):   # argparse's one line
    study.parse_args(_args(corpus, tmp_path, "--seeds", "a,b"))


def test_time_limit_stops_and_the_same_command_resumes(corpus, tmp_path, capsys):
  argv = _args(corpus, tmp_path, "--arms", "softmax_rope", "--steps", "300", "--suites", "val")
  # Past the limit train.py gets SIGTERM (it saves and exits); the study says it is unfinished.
  assert study.main(argv + ["--time_limit", "6"]) == 3
  wd = study.workdir(study.parse_args(argv), "softmax_rope", 0)
  assert not study.trained(wd)
  assert study.main(argv) == 0 and study.trained(wd) and study.evaluated(study.parse_args(argv), wd)


def test_claims_pair_seeds_and_give_verdicts():
  run = lambda **kw: {"val_loss": 3.0, **kw}
  runs = {("softmax_rope", 0): run(), ("softmax_rope", 1): run(),
          ("focal", 0): run(val_loss=2.9), ("focal", 1): run(val_loss=3.1),
          ("focal_learned", 0): run(val_loss=2.8), ("focal_learned", 1): run(val_loss=2.95),
          ("dilution_nope", 0): run(val_loss=3.05, longdoc_beyond=3.2, longdoc_drift=0.01),
          ("softmax_nope", 0): run(val_loss=3.2, longdoc_beyond=5.0, longdoc_drift=0.02),
          ("hybrid", 0): run(val_loss=2.7)}
  claims = study.report.claims(runs)
  one = "undecided at this budget: one seed"
  # focal, focal learned, focal passkey in and past the context (no results), dilution flat,
  # softmax-NoPE degrades, long-book NLL, keyword, passkey vs NoPE and vs RoPE (no results),
  # dilution gap, hybrid: a single seed decides nothing.
  missing = "n/a (arm or result missing)"
  assert [c["verdict"] for c in claims] == [
      "undecided at this budget: seeds disagree (1/2 support it)", "held", missing, missing, one,
      one, one, missing, missing, missing, one, one]
  assert claims[4]["deltas"] == {"0": pytest.approx(0.01)}  # no reference: the arm's own value
  assert claims[6]["deltas"] == {"0": pytest.approx(-1.8)}  # seed 1 has no NoPE arms: unpaired
  assert claims[-1]["deltas"] == {"0": pytest.approx(2.7 - 2.8)}  # vs focal_learned, the best
  # focal learned: deltas -0.2 and -0.05, mean -0.125, sd 0.106, t(1) 12.706 -> half 0.953
  assert claims[1]["interval"] == pytest.approx([-0.125 - 0.953, -0.125 + 0.953], abs=1e-3)
  assert claims[4]["interval"] is None


def test_retrieval_claims_wait_for_retrieval_inside_the_context():
  run = lambda inside, beyond: {"passkey_in_context": inside, "passkey_beyond": beyond,
                                "passkey": {"chance": None}}
  vs_rope = lambda runs: next(c for c in study.report.claims(runs)
                              if c["key"] == "passkey_beyond" and c["reference"] == "softmax_rope"
                              and c["arm"] == "dilution_nope")
  none = {(a, s): run(0.0, 0.0) for a in ("dilution_nope", "softmax_rope") for s in (0, 1)}
  assert vs_rope(none)["verdict"].startswith("undecided at this budget: neither arm retrieves")
  formed = {**none, ("dilution_nope", 0): run(0.9, 0.6), ("dilution_nope", 1): run(1.0, 0.4)}
  assert vs_rope(formed)["verdict"] == "held"
  one = {**none, ("dilution_nope", 0): run(0.9, 0.0)}  # formed in seed 0 only: seed 1 says nothing
  assert vs_rope(one)["verdict"] == "undecided at this budget: one seed"


def test_figures_draw_validation_curves_and_loss_by_position(tmp_path):
  pytest.importorskip("matplotlib")
  run = lambda arm, shift: {"arm": arm, "seed": 0, "seq_len": 64,
                            "val_curve": [[1, 5.0 + shift], [2, 4.0 + shift]],
                            "longdoc": {"ranges": [[0, 64], [64, 128]], "mean": [4.0, 4.1 + shift]}}
  written = study.report.figures({"runs": [run("softmax_rope", 0.0), run("focal", 0.2)]},
                                 str(tmp_path), stem="pilot", log=lambda _: None)
  assert [os.path.basename(p) for p in written] == ["pilot_val_loss.png", "pilot_longdoc.png"]
  assert all(os.path.getsize(p) > 1000 for p in written)


def test_include_joins_earlier_runs_of_the_same_tokenizer_only(corpus, tmp_path):
  (tmp_path / "tokenizer").mkdir()
  (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
  earlier = lambda **kw: json.dumps({"size": "small", "runs": [
      {"arm": "softmax_rope", "seed": 0, "val_loss": 3.0},
      {"arm": "softmax_rope", "seed": 5, "val_loss": 3.1},
      {"arm": "focal", "seed": 0, "val_loss": 2.9}], **kw})
  sha = study._sha256(str(tmp_path / "tokenizer" / "tokenizer.json"))  # pylint: disable=protected-access
  (tmp_path / "a.json").write_text(earlier(tokenizer_sha256=sha))
  args = study.parse_args(_args(corpus, tmp_path, "--include", str(tmp_path / "a.json")))
  runs = study.included_runs(args)
  assert sorted(runs) == [("softmax_rope", 0)]  # only the arms and seeds asked for
  assert runs[("softmax_rope", 0)]["included_from"] == str(tmp_path / "a.json")
  (tmp_path / "b.json").write_text(earlier(tokenizer_sha256="0" * 64))
  with pytest.raises(SystemExit, match="another tokenizer"):
    study.included_runs(study.parse_args(_args(corpus, tmp_path, "--include",
                                               str(tmp_path / "b.json"))))


@pytest.mark.parametrize("text,match", [(None, "No such file"), ("{bad", "Expecting"),
                                        ("{}", "not a study JSON")])
def test_report_of_a_bad_study_json_is_one_line(tmp_path, capsys, text, match):
  path = tmp_path / "study.json"
  if text is not None:
    path.write_text(text)
  with pytest.raises(SystemExit) as e:
    study.report.main([str(path)])
  assert e.value.code == 2 and match in capsys.readouterr().err
