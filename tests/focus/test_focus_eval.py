"""FocusLLM evaluation: the passkey protocol's inputs and scoring, loss-by-position ranges,
eval.py's --focus_adapter end to end, and the decode benchmark's smoke run."""

import copy
import dataclasses
import itertools
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import test_focus_train  # tests/ is on sys.path under pytest: its hand-made base workdir
from focaljax.model import attention as attn_lib
from focaljax.train import checkpoint
from focaljax.focus import model as focus
from focaljax.focus import evaluate as focus_eval
from focaljax.focus import generate as focus_generate
from focaljax.focus import train as focus_train
from focaljax.model import decoder as model_lib
from focaljax.data import retrieval
from focaljax.data import tokenizer as tokenizer_lib

REPO = pathlib.Path(__file__).resolve().parents[2]
CTX = 64


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.bundled()


@pytest.fixture(scope="module")
def tiny(tok):
  """(base, adapter, cfg): a 64-token-context base over the bundled vocabulary, a perturbed
  adapter (so the candidate path matters), chunks of 16."""
  cfg = model_lib.ModelConfig(
      vocab_size=tok.vocab_size, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
      head_dim=8, d_ff=64, max_seq_len=CTX,
      attention=attn_lib.AttentionConfig(layers=attn_lib.parse_pattern("softmax:rope", 2)))
  base = model_lib.Transformer(cfg, nnx.Rngs(0))
  leaves, tree = jax.tree.flatten(focus.init_adapter(base))
  keys = jax.random.split(jax.random.key(5), len(leaves))
  adapter = jax.tree.unflatten(tree, [w + 0.3 * jnp.std(w) * jax.random.normal(k, w.shape)
                                      for w, k in zip(leaves, keys)])
  return base, adapter, focus.FocusConfig(chunk_size=16, prompt_len=8)


def test_local_window_leaves_whole_chunks():
  assert focus_eval.local_len_for(4096, 1024, 1024) == 1024
  assert focus_eval.local_len_for(200, 16, 32) == 24 and (200 - 24) % 16 == 0
  assert focus_eval.local_len_for(20, 16, 32) == 20   # all local, no memory
  # 2x a 2K context with 1K chunks and a 512-token window: only 1024 leaves whole chunks.
  assert focus_eval.local_len_for(4096, 1024, 512, min_len=12, max_len=2042) == 1024
  with pytest.raises(ValueError, match="chunk_size 1024"):
    focus_eval.local_len_for(4096, 1024, 512, min_len=12, max_len=1000)


def _window_by_search(length, chunk, local_len, min_len, max_len):
  if length <= local_len:
    return length   # all local, no memory
  fits = [t for t in range(1, length + 1) if (length - t) % chunk == 0]
  below = max([t for t in fits if t <= local_len], default=0)
  up = min([t for t in fits if t >= min_len], default=length + 1)
  return below if below >= min_len else up if up <= min(length, max_len or length) else None


def test_local_window_is_the_largest_leaving_whole_chunks():
  # Once the remainder went the wrong way: 128 tokens, chunk 16, window 20 left 120 of memory.
  assert focus_eval.local_len_for(128, 16, 20) == 16
  assert focus_eval.local_len_for(2048, 512, 500) == 512   # none <= 500 but 0: the next one up
  for length, chunk, local_len, min_len, max_len in itertools.product(
      range(1, 140, 3), (1, 2, 7, 16, 33), range(2, 80, 7), (1, 20), (None, 40)):
    want = _window_by_search(length, chunk, local_len, min_len, max_len)
    if want is None:
      with pytest.raises(ValueError, match=f"chunk_size {chunk} before it with {min_len} <= "):
        focus_eval.local_len_for(length, chunk, local_len, min_len, max_len)
    else:
      got = focus_eval.local_len_for(length, chunk, local_len, min_len, max_len)
      assert got == want and (length - got) % chunk == 0, (length, chunk, local_len, got)


def test_with_attention_swaps_the_implementation_only(tiny):
  base = tiny[0]
  own = base.blocks[0].attn.cfg.attention.implementation
  swapped = focus_train.with_attention(base, "cudnn")
  assert swapped.blocks[0].attn.cfg.attention.implementation == "cudnn" != own
  assert base.blocks[0].attn.cfg.attention.implementation == own
  jax.tree.map(np.testing.assert_array_equal, nnx.state(swapped), nnx.state(base))


def test_passkey_feeds_the_official_prompt_and_scores_exact_keys(tiny, tok, monkeypatch):
  base, adapter, cfg = tiny
  seen = []

  def oracle(adapter, base, memory_BM, prompt_BT, cfg, max_new_tokens, readout=False):
    # Answers with the key written in the memory: checks the split and the scoring, not a model.
    seen.append((np.asarray(memory_BM), np.asarray(prompt_BT)))
    key = re.search(r"\nThe pass key is (\d+)\. Remember it\. \1 is the pass key\.\n",
                    tok.decode(np.asarray(memory_BM)[0].tolist()))
    answer = tok.encode(f" {key.group(1) if key else '0'}.")[:max_new_tokens]
    new = np.zeros((1, max_new_tokens), np.int32)
    new[0, :len(answer)] = answer
    out = jnp.asarray(np.concatenate([prompt_BT, new], 1))
    # Every chunk "guesses" each answer token: the readout must score each needle trial 1.
    C = memory_BM.shape[1] // cfg.chunk_size
    tops = np.zeros((1, max_new_tokens, C), np.int32)
    tops[0, :len(answer)] = np.asarray(answer)[:, None]
    # Two layers, each putting half its attention on the candidates, spread evenly.
    mass = np.full((2, 1, C), 0.5 / C, np.float32)
    return (out, {"candidate_top": tops[:, 0], "candidate_top_steps": tops,
                  "candidate_mass": mass}) if readout else out

  monkeypatch.setattr(focus_generate, "generate", oracle)
  r = focus_eval.passkey(adapter, base, cfg, tok, multipliers=(2, 3), seeds=8)
  assert r["lengths"] == [2 * CTX, 3 * CTX] and len(seen) == 16
  trials = [(row, t) for row in r["rows"] for t in row["trials"]]
  for (memory, local), (row, t) in zip(seen, trials):
    assert memory.shape[1] + local.shape[1] == row["length"]
    assert local.shape[1] == row["local_len"] <= CTX // 2 and memory.shape[1] % 16 == 0
    assert tok.decode(local[0].tolist()).endswith(retrieval.PASSKEY_QUESTION)
    text = tok.decode(np.concatenate([memory, local], 1)[0].tolist())
    needle = retrieval.PASSKEY_NEEDLE.format(key=t["key"])
    assert text.count(needle) == 1 and text.startswith(retrieval.PASSKEY_HEAD)
    # Without the needle the text is the task, the official filler repeated, and the question.
    assert retrieval.PASSKEY_FILLER in text.replace(needle, "")
  for row in r["rows"]:
    for t in row["trials"]:
      assert 10_000 <= t["key"] < 100_000 and 0 <= t["depth"] < 1 and t["needle_at"] >= 0
      # Where the needle sits in the memory the oracle finds the key; exact match scores it.
      assert t["correct"] == t["needle_in_memory"], t
  assert r["seeds"] == list(range(8)) and any(t["needle_in_memory"] for t in r["rows"][1]["trials"])
  assert all(a in (None, 1.0) for a in r["accuracy_needle_in_memory"])
  assert all(p is None or len(p) == 5 for p in r["digit_places"])
  # The diagnostic: every needle-in-memory trial reads the needle chunk's guess at the key's
  # first token with a digit; the others do not. This tokenizer spells some keys " ", "8", ...:
  # theirs is read one step later, so a wrong step would score them False.
  spaced = lambda t: tok.decode(tok.encode(f" {t['key']}")[:1]) == " "
  assert any(spaced(t) for row in r["rows"] for t in row["trials"] if t["needle_in_memory"])
  for row, share in zip(r["rows"], r["candidate_readout"]):
    flags = [t["candidate_reads_key"] for t in row["trials"] if "candidate_reads_key" in t]
    assert all(isinstance(f, bool) for f in flags) and all(flags)
    assert all(("candidate_reads_key" in t) == t["needle_in_memory"] for t in row["trials"])
    assert share == (float(np.mean(flags)) if flags else None)
  assert any(share is not None for share in r["candidate_readout"])
  text = focus_eval.format_suite("focus_passkey", r)
  assert "candidate reads key" in text and "digits right by place" in text
  assert "2x accuracy" in text and "95% interval" in text
  # The oracle misses exactly the in-window needles: each is listed by seed, key and place.
  for row in r["rows"]:
    line = next((l for l in text.splitlines() if l.strip().startswith(
        f"{row['multiplier']}x missed:")), "")
    for t in row["trials"]:
      assert (f"s{t['seed']} {t['key']} (window" in line) == (not t["needle_in_memory"])
  # In-window needles, split by whether the dynamic prompt (the window's last P tokens, which
  # every candidate reads) holds them; the oracle misses both kinds.
  for row, inside, before in zip(r["rows"], r["window_in_prompt"], r["window_before_prompt"]):
    P = row["prompt_tokens"]
    assert P == cfg.prompt_tokens(row["local_len"])
    for t in row["trials"]:
      assert t["needle_in_prompt"] == (t["needle_at"] >= row["length"] - P)
    window = [t for t in row["trials"] if not t["needle_in_memory"]]
    assert inside[0] == before[0] == 0 and inside[1] + before[1] == len(window)
  moved = copy.deepcopy(r)
  row = next(row for row in moved["rows"] if any(not t["needle_in_memory"] for t in row["trials"]))
  t = next(t for t in row["trials"] if not t["needle_in_memory"])
  t["needle_in_prompt"] = True
  k = moved["rows"].index(row)
  moved["window_in_prompt"][k] = [0, 1]
  moved["window_before_prompt"][k][1] -= 1
  text = focus_eval.format_suite("focus_passkey", moved)
  assert f"s{t['seed']} {t['key']} (window, in prompt)" in text
  assert (f"{row['multiplier']}x needles in the window: 0/1 within the prompt's last "
          f"{row['prompt_tokens']} tokens, 0/{moved['window_before_prompt'][k][1]} before them"
          in text)
  # The attention diagnostic: half the mass on the candidates; the needle's candidate holds its
  # even share, 1 / chunks.
  for row, mass, share in zip(r["rows"], r["candidate_mass"], r["needle_share"]):
    assert mass == pytest.approx(0.5)
    in_memory = [t for t in row["trials"] if t["needle_in_memory"]]
    assert (share is None) == (not in_memory)
    if in_memory:
      assert share == pytest.approx(1 / row["num_chunks"])
      assert in_memory[0]["needle_mass"] == [pytest.approx(0.5 / row["num_chunks"], abs=1e-5)] * 2
  assert "needle/cand" in focus_eval.format_suite("focus_passkey", r)
  # At 8x the 30 candidates + the 32-token window + the answer pass the 64-token context; that
  # length is skipped and says why, the 2x one still runs.
  r = focus_eval.passkey(adapter, base, cfg, tok, multipliers=(2, 8), seeds=2)
  assert len(seen) == 16 + 2 and "skipped" not in r["rows"][0]
  assert "30 candidates before the local window" in r["rows"][1]["skipped"]
  assert r["accuracy_by_length"][1] is None and not r["rows"][1]["trials"]
  assert "8x skipped" in focus_eval.format_suite("focus_passkey", r)


def test_passkey_with_a_model_is_well_formed(tiny, tok):
  base, adapter, cfg = tiny
  lines = []
  r = focus_eval.passkey(adapter, base, cfg, tok, multipliers=(2,), seeds=2, log=lines.append)
  row = r["rows"][0]
  # The row's line carries the diagnostics too, so a run cut short still reports them.
  assert len(lines) == 1 and "needle in memory" in lines[0] and "cand mass" in lines[0]
  assert row["length"] == 128 and row["num_chunks"] * 16 == row["memory_len"] == 96
  assert [t["seed"] for t in row["trials"]] == [0, 1]
  assert all(isinstance(t["output"], str) and isinstance(t["correct"], bool)
             for t in row["trials"])
  assert 0 <= r["accuracy_by_length"][0] <= 1 and r["overall"] == r["accuracy_by_length"][0]
  assert r["candidate_readout"][0] is None or 0 <= r["candidate_readout"][0] <= 1
  assert 0 <= r["candidate_mass"][0] <= 1
  assert all(len(t["candidate_mass"]) == len(base.blocks) for t in row["trials"])
  assert "focus_passkey" in focus_eval.format_suite("focus_passkey", r)
  json.dumps(r)
  # Batched trials (eval.py --focus_passkey_batch) generate what one at a time does.
  batched = focus_eval.passkey(adapter, base, cfg, tok, multipliers=(2,), seeds=3, batch_size=2)
  single = focus_eval.passkey(adapter, base, cfg, tok, multipliers=(2,), seeds=3)
  assert [t["output"] for t in batched["rows"][0]["trials"]] == [
      t["output"] for t in single["rows"][0]["trials"]]


def test_loss_by_position_ranges(tiny):
  base, adapter, cfg = tiny
  rng = np.random.default_rng(0)
  docs = [rng.integers(1, 4000, n).tolist() for n in (256, 100, 300)]   # 100 is too short
  r = focus_eval.loss_by_position(adapter, base, cfg, docs, max_multiplier=4, num_targets=4,
                                  windows=3)
  assert r["num_books"] == 2 and r["max_len"] == 256 and r["local_len"] == 32
  assert r["ranges"] == [[0, 64], [64, 128], [128, 256]]
  for (a, b), ends, chunks in zip(r["ranges"], r["window_ends"], r["memory_chunks"]):
    assert ends and all(a <= p - 3 and p < b and p >= 32 for p in ends)   # targets in range
    assert chunks == [(p - 32) // 16 for p in ends]
    assert len(set(chunks)) == 1   # one memory length (one compile) per range
  c = r["curves"]
  for name in ("focus", "base", "gain"):
    assert np.isfinite(np.asarray(c[name]["per_book"])).all()
    assert len(c[name]["mean"]) == len(c[name]["stderr"]) == 3
  np.testing.assert_allclose(c["gain"]["mean"], np.subtract(c["base"]["mean"],
                                                            c["focus"]["mean"]), atol=1e-6)
  assert abs(c["base"]["mean"][0] - np.log(base.cfg.vocab_size)) < 1.5   # random init
  # The books run as one batch: each book's value is what it gets alone.
  one = focus_eval.loss_by_position(adapter, base, cfg, docs[2:], max_multiplier=4, num_targets=4,
                                    windows=3)
  np.testing.assert_allclose(one["curves"]["focus"]["per_book"][0], c["focus"]["per_book"][1],
                             rtol=1e-4)
  json.dumps(r)
  with pytest.raises(ValueError, match="max_multiplier"):
    focus_eval.loss_by_position(adapter, base, cfg, docs, max_multiplier=8)


def test_eval_py_focus_adapter_end_to_end(tmp_path, tiny):
  test_focus_train.make_base(tmp_path / "base")
  from focaljax.evaluation import loading as loaded  # pylint: disable=import-outside-toplevel
  run = tmp_path / "focus_run"   # what a FocusLLM run writes: checkpoints/<step>/ with its meta
  # Trained with an 8-token prompt and a 16-token window, served with 6 (focus.eval_prompt_len);
  # the flag says 4.
  served = dataclasses.replace(tiny[2], prompt_len=6)
  checkpoint.save_params(str(run), 1, focus.init_adapter(
      loaded.load(str(tmp_path / "base")).model), focus_train.meta(
          served, trained_prompt_len=8, local_len=16, base_workdir=str(tmp_path / "base")))
  books = tmp_path / "books.jsonl"
  text = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 40
  books.write_text(json.dumps({"text": text}))
  cmd = [sys.executable, str(REPO / "eval.py"), f"--workdir={tmp_path / 'base'}",
         f"--focus_adapter={run}", "--focus_multipliers=2", "--passkey_seeds=2",
         "--max_multiplier=2", "--max_books=1", f"--books={books}", "--focus_prompt_len=4"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((run / "eval" / "focus_results.json").read_text())
  assert results["meta"]["suites"] == list(focus_eval.FOCUS_SUITES)
  for suite in focus_eval.FOCUS_SUITES:
    assert "skipped" not in results[suite], results[suite]
    assert (run / "eval" / f"{suite}.json").exists() and f"== {suite}" in proc.stdout
  assert results["focus_passkey"]["lengths"] == [128] and results["meta"]["local_len"] == 16
  # --focus_prompt_len overrides the adapter's dynamic prompt (8 in its focus.json).
  assert results["meta"]["focus"]["prompt_len"] == results["focus_passkey"]["prompt_len"] == 4
  assert results["focus_passkey"]["rows"][0]["local_len"] == 16   # the adapter's training window
  assert results["focus_longdoc"]["ranges"] == [[0, 64], [64, 128]]
  assert not (tmp_path / "base" / "eval").exists()   # the base workdir stays untouched
  assert "warning: the adapter was trained on" not in proc.stdout   # its own base


def test_eval_py_with_a_language_model_as_the_adapter_is_one_line(tmp_path):
  test_focus_train.make_base(tmp_path / "base")
  proc = subprocess.run([sys.executable, str(REPO / "eval.py"), f"--workdir={tmp_path / 'base'}",
                         f"--focus_adapter={tmp_path / 'base'}"], capture_output=True, text=True,
                        cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
      f"error: {tmp_path / 'base'}: its checkpoints hold no FocusLLM adapter (a language "
      "model's workdir?)"], proc.stderr[-2000:]


def test_an_adapter_step_that_was_not_saved_lists_the_saved_ones(tmp_path):
  (tmp_path / "run" / "checkpoints" / "4").mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match="no checkpoint at step 7; saved steps: 4$"):
    focus_train.resolve(str(tmp_path / "run" / "checkpoints" / "7"))


def test_serving_config_takes_the_flags_over_the_adapter_s_own():
  cfg = focus.FocusConfig(512, prompt_len=504)   # as its run serves it (focus.eval_prompt_len)
  assert focus_eval.serving_config(cfg, {"local_len": 512}) == (cfg, 512)
  assert focus_eval.serving_config(cfg, {}) == (cfg, None)   # no window recorded: ctx // 2
  served, local = focus_eval.serving_config(cfg, {"local_len": 512}, prompt_len=128,
                                            local_len=64)
  assert (served.prompt_len, served.chunk_size, local) == (128, 512, 64)   # eval.py's flags win


def test_decode_bench_smoke(tmp_path):
  out = tmp_path / "bench.json"
  cmd = [sys.executable, str(REPO / "bench" / "focus_decode.py"), "--smoke", "--multipliers=8",
         "--new_tokens=3", "--modes=batched,sequential,local,base", f"--out={out}"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads(out.read_text())["rows"]
  assert [r["mode"] for r in rows] == ["batched", "sequential", "local", "base"]
  assert rows[2]["num_chunks"] == 0   # the window alone: no memory
  for r in rows:
    assert "error" not in r and r["tok_per_s"] > 0 and r["length"] == 8 * 64, r


def test_wilson_interval():
  lo, hi = focus_eval.wilson_interval(8, 10)
  assert lo == pytest.approx(0.490, abs=1e-3) and hi == pytest.approx(0.943, abs=1e-3)
  assert focus_eval.wilson_interval(10, 10)[1] == pytest.approx(1.0)
  assert focus_eval.wilson_interval(0, 0) is None
  assert focus_eval.wilson_interval(0, 10)[0] == 0.0   # not a rounding -1e-17 ('-0.00')


def test_digit_places_count_from_the_first_digit():
  assert focus_eval.digit_places(" 36566.", 86556) == [False, True, True, False, True]
  assert focus_eval.digit_places(" 8655", 86556) == [True] * 4 + [False]   # cut short
  assert focus_eval.digit_places("\n     1\n", 86556) == [False] * 5
