"""Evaluation suites: shapes and counts on tiny random models, exact prompt lengths, load() and
eval.py end to end on a hand-made workdir."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from flax import nnx

from focaljax.model import attention as attn_lib
from focaljax.train import checkpoint
from focaljax.evaluation import suites as evaluate
from focaljax.evaluation import generate as gen_lib
from focaljax.model import decoder as model_lib
from focaljax.evaluation import retrieval
from focaljax.data import tokenizer as tokenizer_lib

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.bundled()


def tiny(pattern="softmax:rope,dilution:none", vocab=4096, max_seq_len=32):
  cfg = model_lib.ModelConfig(
      vocab_size=vocab, d_model=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16,
      d_ff=64, max_seq_len=max_seq_len,
      attention=attn_lib.AttentionConfig(layers=attn_lib.parse_pattern(pattern, 2)))
  return model_lib.Transformer(cfg, nnx.Rngs(0))


def test_position_ranges_double_and_cover():
  assert evaluate.position_ranges(128, 1024) == [
      [0, 16], [16, 32], [32, 64], [64, 128], [128, 256], [256, 512], [512, 1024]]
  assert evaluate.position_ranges(32, 96)[-1] == [64, 96]


def test_copy_score_reads_each_half_separately():
  """The first reading is scored on the span's own next tokens, the second on the repeat (its
  first target is the span's second token); a random model has no induction, so no gain."""
  model = tiny("softmax:rope", vocab=64)
  spans = np.random.default_rng(0).integers(0, 64, (3, 16)).tolist()
  r = evaluate.copy_score(model, spans)
  assert r["span_len"] == 16 and r["spans"] == 3
  seq = np.concatenate([spans, spans], axis=1)
  nll = np.asarray(gen_lib.token_nll(model, seq[:, :-1], seq[:, 1:]))
  np.testing.assert_allclose(r["first_nll"], nll[:, :15].mean(), rtol=1e-6)
  np.testing.assert_allclose(r["second_nll"], nll[:, 16:].mean(), rtol=1e-6)
  assert abs(r["copy_gain"]) < 0.5


@pytest.mark.parametrize("pattern,curves", [("softmax:rope,dilution:none",
                                              {"full", "doubling", "unscaled"}),
                                             ("dilution:none", {"full"})])
def test_loss_by_position_shapes(pattern, curves):
  model = tiny(pattern, vocab=64)
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, 64, n).tolist() for n in (129, 200, 100, 129)]  # 100 is too short
  r = evaluate.loss_by_position(model, docs, trained_len=32, max_multiplier=4)
  assert r["num_books"] == 3 and r["max_len"] == 128
  assert r["ranges"] == [[0, 4], [4, 8], [8, 16], [16, 32], [32, 64], [64, 128]]
  assert set(r["curves"]) == curves
  for c in r["curves"].values():
    assert np.asarray(c["per_book"]).shape == (3, 6)
    assert len(c["mean"]) == len(c["stderr"]) == 6
    # Random init: every position costs about log(vocab) nats.
    assert all(abs(m - np.log(64)) < 1.0 for m in c["mean"])
  if "doubling" in curves:
    # In-context ranges come from the unscaled pass at trained_len, beyond from the NTK passes.
    np.testing.assert_allclose(r["curves"]["doubling"]["mean"][:4],
                               r["curves"]["unscaled"]["mean"][:4], rtol=1e-5)
    np.testing.assert_allclose(r["curves"]["doubling"]["mean"][5], r["curves"]["full"]["mean"][5])
  json.dumps(r)
  with pytest.raises(ValueError, match="max_multiplier"):
    evaluate.loss_by_position(model, docs, trained_len=32, max_multiplier=16)


@pytest.mark.parametrize("length,depth", [(100, 0.0), (117, 0.5), (128, 1.0)])
def test_prompts_exact_length(tok, length, depth):
  p = retrieval.passkey_prompt(tok, length, depth, 48213)
  assert len(p) == length
  text = tok.decode(p)
  assert text.count("48213") == 2 and text.endswith("The pass key is")
  k = retrieval.keyword_prompt(tok, length, depth, " rain")
  assert len(k) == length and "The secret keyword is rain." in tok.decode(k)
  control = retrieval.keyword_prompt(tok, length, depth, None)
  assert len(control) == length and "secret keyword is" in tok.decode(control[-12:])
  with pytest.raises(ValueError, match="shorter than the prompt"):
    retrieval.passkey_prompt(tok, 20, depth, 48213)


def test_needle_depth_moves_needle(tok):
  early = tok.decode(retrieval.passkey_prompt(tok, 200, 0.0, 11111))
  late = tok.decode(retrieval.passkey_prompt(tok, 200, 1.0, 11111))
  assert early.index("11111") < late.index("11111")


def test_candidate_loglik_matches_teacher_forcing(tok):
  model = tiny()
  prompts = np.random.default_rng(1).integers(1, 4096, (3, 20)).astype(np.int32)
  cands = [tok.encode(c) for c in (" gold", " rain", " time")]
  assert [len(c) for c in cands] == [1, 2, 1]  # the multi-token path is exercised
  ll = retrieval.candidate_loglik(model, prompts, cands, batch_size=2)
  for j, c in enumerate(cands):
    seq = np.concatenate([prompts, np.tile(c, (3, 1))], 1)
    nll = np.asarray(gen_lib.token_nll(model, seq[:, :-1], seq[:, 1:], rope_length=20))
    np.testing.assert_allclose(ll[:, j], -nll[:, -len(c):].sum(1), rtol=1e-4, atol=1e-4)


def test_keyword_retrieval_counts(tok):
  model = tiny()
  r = retrieval.keyword_retrieval(model, tok, [64, 96], depths=[0.0, 1.0])
  assert r["rows_per_cell"] == 7 and r["chance"] == pytest.approx(1 / 7)
  assert np.asarray(r["accuracy"]).shape == (2, 2)
  for row in r["accuracy"]:
    for a in row:
      assert 0 <= a <= 1 and (a * 7) == pytest.approx(round(a * 7))  # k of 7 rows passed
  for dq, scored in zip(r["disqualified"], r["scored"]):
    assert len(dq) == 1 and len(scored) == 7 and dq[0] not in scored
  assert 0 <= r["overall"] <= 1 and len(r["mean_gap"]) == 2
  json.dumps(r)


def test_passkey_suite_shapes(tok):
  model = tiny()
  r = retrieval.passkey(model, tok, [64, 100], depths=[0.0, 1.0], seeds=[0, 1])
  assert np.asarray(r["accuracy"]).shape == (2, 2) and r["trials_per_cell"] == 2
  assert r["accuracy"][0] == [None, None]  # 64 tokens cannot hold the task text and needle
  assert 0 <= r["overall"] <= 1
  json.dumps(r)


def test_attention_probe_focal_is_sharper(tok):
  model = tiny(max_seq_len=64)
  r = evaluate.attention_probe(model, tok.encode("The cat sat on the mat. " * 6)[:40], layer=0)
  assert len(r["softmax"]) == len(r["focal"]) == 40
  assert sum(r["focal"]) == pytest.approx(1.0, abs=1e-6)
  assert r["entropy"]["focal"] < r["entropy"]["softmax"]


def test_attention_probe_uses_the_models_temperature(tok):
  """The configured t, or a learned-τ layer's τ/√d (zero w_τ: τ = tau_init); not a fixed 0.4."""
  tokens = tok.encode("The cat sat on the mat. " * 6)[:40]
  cfg = tiny().cfg
  for attention, t in ((dict(temperature=0.3), 0.3), (dict(learned=True), 3.0 / 16**0.5)):
    a = dataclasses.replace(cfg.attention, layers=attn_lib.parse_pattern("focal:rope", 2),
                            tau_min=2.0, tau_max=4.0, tau_init=3.0, **attention)
    model = model_lib.Transformer(dataclasses.replace(cfg, attention=a), nnx.Rngs(0))
    assert evaluate.attention_probe(model, tokens, layer=0)["temperature"] == pytest.approx(t)


def make_workdir(path, arg="size=small", step=3):
  """A trainer-shaped workdir by hand: config.json, tokenizer.json, checkpoints/<step>/params."""
  from configs import base  # pylint: disable=import-outside-toplevel
  from focaljax import config as config_lib  # pylint: disable=import-outside-toplevel
  c = base.get_config(arg)
  c.model.attention.pattern = "softmax:rope,dilution:none"
  tok = tokenizer_lib.bundled()
  checkpoint.write_config(str(path), c)
  tok.save(path)
  model = model_lib.Transformer(config_lib.model_config(c, tok.vocab_size), nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.split(model)[1])
  manager = ocp.CheckpointManager(epath.Path(path) / "checkpoints", item_names=("params",))
  str_keys = checkpoint.to_str_keys(params)
  manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(str_keys)))
  manager.wait_until_finished()
  manager.close()
  return model


def test_load_matches_original(tmp_path, tok):
  from focaljax.evaluation.loading import load  # pylint: disable=import-outside-toplevel
  original = make_workdir(tmp_path)
  tokens = jnp.asarray([tok.encode("It was a bright cold day in April, and the clocks")])
  want = gen_lib.logits(original, tokens)
  for path in (tmp_path, tmp_path / "checkpoints" / "3"):
    m = load(str(path))
    assert m.step == 3 and m.config == original.cfg
    np.testing.assert_allclose(m.logits(tokens), want, rtol=1e-6, atol=1e-6)
  # str in -> text out; token list in -> tokens out; the same seed gives the same continuation.
  prompt = tok.encode("It was a bright")
  ids = m.generate(prompt, max_new_tokens=5, temperature=0.7, seed=1, stop_at_eos=False)
  assert ids.shape == (len(prompt) + 5,) and ids[:len(prompt)].tolist() == prompt
  text = m.generate("It was a bright", max_new_tokens=5, temperature=0.7, seed=1,
                    stop_at_eos=False)
  assert text == tok.decode(ids[len(prompt):].tolist())
  # Ids the embedding would clamp silently are refused.
  for bad, match in (([m.config.vocab_size, 1], "must lie in"), ([-1, 1], "must lie in"),
                     ([1.7, 2.2], "must be integers")):
    with pytest.raises(ValueError, match=match):
      m.generate(bad, max_new_tokens=2)
  with pytest.raises(ValueError, match="must lie in"):
    m.logits([[1, m.config.vocab_size]])
  with pytest.raises(ValueError, match=r"must be \[T\] or \[B, T\]; got shape \(2, 2, 4\)"):
    m.logits(np.ones((2, 2, 4), np.int32))
  with pytest.raises(ValueError, match="max_new_tokens must be an int, got 2.5"):
    m.generate("It was", max_new_tokens=2.5)
  # NaN sampled nothing, inf at random, a string raised Python's comparison error.
  for temperature in (float("nan"), float("inf"), -1.0, "0.5"):
    with pytest.raises(ValueError, match="temperature"):
      m.generate("It was", max_new_tokens=2, temperature=temperature)
  for bad, match in ((["It was", "The fox"], "call once each"),
                     ([[1, 2, 3], [4, 5]], "rows of one length"), ([], "input is empty")):
    with pytest.raises(ValueError, match=match):
      m.logits(bad) if bad == [] else m.generate(bad, max_new_tokens=2)
  with pytest.raises(ValueError, match="the prompt is empty"):
    m.generate("", max_new_tokens=2)
  with pytest.raises(FileNotFoundError, match="neither a focaljax workdir"):
    load(str(tmp_path / "nowhere"))
  with pytest.raises(FileNotFoundError, match="no checkpoint at step 7; saved steps: 3$"):
    load(str(tmp_path / "checkpoints" / "7"))


def test_load_runs_auto_attention_whatever_the_run_forced(tmp_path, tok):
  # cudnn (trained in bf16) refused float32 inference, pallas the lengths its tiles do not fit.
  from focaljax.evaluation.loading import load  # pylint: disable=import-outside-toplevel
  original = make_workdir(tmp_path)
  path = tmp_path / "config.json"
  saved = json.loads(path.read_text())
  saved["model"]["attention"]["implementation"] = "cudnn"
  saved["train"]["compute_dtype"] = "bfloat16"
  path.write_text(json.dumps(saved))
  m = load(str(tmp_path))
  assert m.config.attention.implementation == "auto"
  tokens = jnp.asarray([tok.encode("It was a bright cold day")])
  np.testing.assert_allclose(m.logits(tokens), gen_lib.logits(original, tokens), rtol=1e-6,
                             atol=1e-6)


def test_load_reads_a_workdir_written_before(tmp_path):
  """A config.json from an older focaljax: fields removed since are ignored, fields added since
  take the value such a run had (focaljax.train.saved_config.upgrade)."""
  from focaljax.evaluation.loading import load  # pylint: disable=import-outside-toplevel
  make_workdir(tmp_path)
  path = tmp_path / "config.json"
  saved = json.loads(path.read_text())
  saved["model"].update(fuse_matmuls=True, norm_backward="autodiff", add_norm="pallas")
  saved["train"]["cross_entropy"] = "explicit"
  del saved["data"]["tokenize"], saved["optim"]["mu_dtype"], saved["model"]["remat_policy"]
  path.write_text(json.dumps(saved))
  m = load(str(tmp_path))
  assert m.run.data.tokenize == "stream" and m.run.optim.mu_dtype == "float32"
  assert m.step == 3 and m.config.remat_policy == "nothing"


def test_eval_py_end_to_end(tmp_path):
  make_workdir(tmp_path / "wd")
  books = tmp_path / "books.jsonl"
  text = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 60
  books.write_text("\n".join(json.dumps({"text": text}) for _ in range(2)))
  suites = "longdoc,passkey,keyword,val"  # attention and sample: covered above, compile-heavy
  cmd = [sys.executable, str(REPO / "eval.py"), f"--workdir={tmp_path / 'wd'}",
         f"--suites={suites}", f"--books={books}", "--max_multiplier=2", "--depths=0,1",
         "--passkey_seeds=1", "--max_books=2", "--val_batches=1"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = tmp_path / "wd" / "eval"
  results = json.loads((out / "results.json").read_text())
  for suite in suites.split(","):
    assert (out / f"{suite}.json").is_file()
    assert "skipped" not in results[suite], results[suite]
  assert results["longdoc"]["num_books"] == 2
  assert results["passkey"]["lengths"] == [64, 128]
  assert "== keyword" in proc.stdout and "results:" in proc.stdout


def test_eval_py_exits_1_when_a_suite_has_no_result(tmp_path):
  """A trained length too short for any passkey prompt scores nothing: that is not success."""
  make_workdir(tmp_path / "wd")
  proc = subprocess.run([sys.executable, str(REPO / "eval.py"), f"--workdir={tmp_path / 'wd'}",
                         "--suites=passkey", "--max_multiplier=1", "--passkey_seeds=1"],
                        capture_output=True, text=True, cwd=REPO, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1].startswith("error: no result from suite(s) passkey")
  assert (tmp_path / "wd" / "eval" / "passkey.json").is_file()


def test_eval_py_unreadable_books_are_bad_input(tmp_path):
  """A --books file without the text field is exit 2 and one line, not a skipped suite."""
  make_workdir(tmp_path / "wd")
  (tmp_path / "books.jsonl").write_text(json.dumps({"body": "no text field"}) + "\n")
  proc = subprocess.run([sys.executable, str(REPO / "eval.py"), f"--workdir={tmp_path / 'wd'}",
                         "--suites=longdoc", f"--books={tmp_path / 'books.jsonl'}"],
                        capture_output=True, text=True, cwd=REPO, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
  assert "text" in proc.stderr


def test_eval_py_unknown_suite_is_one_line(tmp_path):
  proc = subprocess.run([sys.executable, str(REPO / "eval.py"), f"--workdir={tmp_path}",
                         "--suites=val,nosuch"], capture_output=True, text=True, cwd=REPO,
                        timeout=120)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines() == [
      "error: --suites: unknown ['nosuch']; allowed: ['val', 'longdoc', 'passkey', 'keyword', "
      "'attention', 'sample', 'copy', 'focus_passkey', 'focus_longdoc']"]


def test_eval_py_on_a_focus_adapter_run_is_one_line(tmp_path):
  # What train.py writes for configs/focus.py: a config.json with a focus section.
  (tmp_path / "checkpoints").mkdir()
  (tmp_path / "config.json").write_text(json.dumps({"focus": {"base_workdir": "runs/base"}}))
  proc = subprocess.run([sys.executable, str(REPO / "eval.py"), f"--workdir={tmp_path}",
                         "--suites=val"], capture_output=True, text=True, cwd=REPO, timeout=120)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [
      f"error: {tmp_path} is a FocusLLM adapter run; evaluate it with python eval.py --workdir "
      f"BASE --focus_adapter {tmp_path}"]


def test_eval_py_focus_adapter_over_an_unreadable_base_is_one_line(tmp_path):
  make_workdir(tmp_path / "wd")   # softmax:rope,dilution:none: FocusLLM reads no dilution layer
  proc = subprocess.run([sys.executable, str(REPO / "eval.py"), f"--workdir={tmp_path / 'wd'}",
                         f"--focus_adapter={tmp_path / 'wd'}"], capture_output=True, text=True,
                        cwd=REPO, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
      f"error: {tmp_path / 'wd'} cannot be a FocusLLM base: layer 1 is dilution; FocusLLM reads "
      "bases of softmax or constant-temperature focal layers"], proc.stderr[-2000:]


@pytest.mark.parametrize("flag,line", [
    ("--max_multiplier=0", "error: flag --max_multiplier=0: 0 is not a positive integer"),
    ("--depths=0,2", "error: flag --depths=['0', '2']: one or more numbers, each in [0, 1]"),
    ("--books=/nonexistent.jsonl", "error: flag --books=/nonexistent.jsonl: no such file"),
    ("--suites=", "error: --suites is empty; name one or more of them, or leave it out for all"),
    ("--suites=focus_longdoc", "error: --suites focus_longdoc needs --focus_adapter"),
    ("--suites=focus_longdoc --focus_adapter=RUN",
     "error: --suites focus_longdoc needs long documents: --books"),
    # Empty lists once ran no length (or a range() of step 0); 0 once meant the trained window.
    ("--depths=", "error: flag --depths=[]: one or more numbers, each in [0, 1]"),
    ("--focus_multipliers=", "error: flag --focus_multipliers=[]: one or more integers, each >= 1"),
    ("--focus_local_len=0", "error: flag --focus_local_len=0: 0 is not integer >= 2"),
    ("--focus_chunk_size=0", "error: flag --focus_chunk_size=0: 0 is not a positive integer"),
    ("--focus_prompt_len=0", "error: flag --focus_prompt_len=0: 0 is not a positive integer"),
    ("--out_dir=/dev/null/eval", "error: flag --out_dir=/dev/null/eval: must be a directory "
     "(made if missing), not a file or under one"),
])
def test_eval_py_bad_flag_values_are_one_line(tmp_path, flag, line):
  # Refused while parsing, not run as a suite that reports itself skipped.
  proc = subprocess.run([sys.executable, str(REPO / "eval.py"), f"--workdir={tmp_path}",
                         *flag.split()],
                        capture_output=True, text=True, cwd=REPO, timeout=120)
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [line], proc.stderr


def test_help_exits_0():
  proc = subprocess.run([sys.executable, str(REPO / "eval.py"), "--help"], capture_output=True,
                        text=True, cwd=REPO, timeout=120)
  assert proc.returncode == 0 and "--focus_adapter" in proc.stdout


def test_rerunning_some_suites_keeps_results_json_whole(tmp_path):
  # The other suites of the same checkpoint stay; another checkpoint's do not.
  meta = lambda step, suites: {"meta": {"workdir": "w", "step": step, "suites": suites}}
  run = lambda tasks, suites, step: evaluate.run_suites(
      tasks, suites, str(tmp_path), meta(step, suites), "results.json", lambda s, r: s,
      lambda line: None)
  tasks = {"val": lambda: {"loss": 1.0}, "copy": lambda: {"acc": 0.5}}
  run(tasks, ["val", "copy"], 3)
  assert set(run(tasks, ["val"], 3)) == {"meta", "val"}
  saved = json.loads((tmp_path / "results.json").read_text())
  assert saved["val"]["loss"] == 1.0 and saved["copy"]["acc"] == 0.5
  assert sorted(saved["meta"]["suites"]) == ["copy", "val"] and (tmp_path / "copy.json").exists()
  run(tasks, ["val"], 4)   # another checkpoint: step 3's copy.json goes with its results
  assert "copy" not in json.loads((tmp_path / "results.json").read_text())
  assert not (tmp_path / "copy.json").exists()
