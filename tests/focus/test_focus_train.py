"""FocusLLM training end to end on a hand-made tiny base, through the training loop: the adapter
learns and is saved apart, the base stays bitwise untouched, SIGTERM saves and resume continues,
and chunks past the base context are refused."""

import hashlib
import json
import os
import re
import shutil
import signal

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from flax import nnx

from configs import focus as focus_config
from focaljax import config as config_lib
from focaljax.data import tokenizer as tokenizer_lib
from focaljax.evaluation import loading as loaded
from focaljax.focus import model as focus
from focaljax.focus import train as focus_train
from focaljax.model import decoder as model_lib
from focaljax.train import checkpoint
from focaljax.train import saved_config


def make_base(path):
  """A trainer-shaped workdir (config.json, tokenizer.json, checkpoints/1/params), random init:
  the smoke size with softmax layers (focus supports no dilution) and a 64-token context."""
  from configs import smoke  # pylint: disable=import-outside-toplevel
  c = smoke.get_config()
  tok = tokenizer_lib.bundled()
  checkpoint.write_config(str(path), c)
  tok.save(path)
  model = model_lib.Transformer(config_lib.model_config(c, tok.vocab_size), nnx.Rngs(0))
  manager = ocp.CheckpointManager(epath.Path(path) / "checkpoints", item_names=("params",))
  params = checkpoint.to_str_keys(nnx.to_pure_dict(nnx.split(model)[1]))
  manager.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))
  manager.wait_until_finished()
  manager.close()
  return c.data.seq_len


def focus_cfg(base_wd, **focus_overrides):
  c = focus_config.get_config("size=small")
  c.seed = 1                  # draws chunk 8 then 16 at steps 0-1, 16 then 8 at steps 2-3
  c.train.update(steps=4, log_every=1, ckpt_every=2, keep_ckpts=2)
  c.optim.update(peak_lr=1e-2, warmup_steps=1)
  c.data.global_batch = 2
  c.focus.update({**dict(base_workdir=str(base_wd), chunk_sizes="8,16", prompt_len=8,
                         local_len=16, num_targets=4, doc_min_tokens=64, doc_max_tokens=600),
                  **focus_overrides})
  return c


def sampler(c, local_batch, tok=None):
  cfg = config_lib.parse(c)
  return focus_train.Sampler(cfg.focus, cfg.data, cfg.seed, tok or tokenizer_lib.bundled(), 0,
                               local_batch)


def train(c, workdir, **kw):
  return focus_train.train(config_lib.parse(c), str(workdir), **kw)


def saved_steps(workdir):
  root = os.path.join(workdir, "checkpoints")
  return sorted(int(d) for d in os.listdir(root) if d.isdigit()) if os.path.isdir(root) else []


def digest(path):
  h = hashlib.sha256()
  for root, _, files in sorted(os.walk(path)):
    for name in sorted(files):
      h.update(os.path.join(root, name).encode())
      h.update(open(os.path.join(root, name), "rb").read())
  return h.hexdigest()


def test_sampler_builds_both_tasks_from_documents(tmp_path):
  make_base(tmp_path / "base")
  cfg = focus_cfg(tmp_path / "base", p_reconstruction=0.5)
  s = sampler(cfg, 16)
  docs = [s._tokens(i) for i in range(len(s.docs))]  # pylint: disable=protected-access
  for step in range(4):
    (chunk, M), b = s.shape(step), s.batch(step)
    assert M == 64 - 17 - (64 - 17) % chunk   # doc_min - local_len - 1, whole chunks
    assert b["memory"].shape == (16, M) and b["tokens"].shape == (16, 17)
    assert 0 < b["reconstruction"].sum() < 16
    for memory, tokens, recon in zip(b["memory"], b["tokens"], b["reconstruction"]):
      # Continuation: memory + tokens is one contiguous stretch of a document. Reconstruction:
      # the tokens are a contiguous span of the memory (the copy target sits in the memory).
      hay, needle = (memory, tokens) if recon else (
          np.concatenate([memory, tokens]), np.concatenate([memory, tokens]))
      assert any(_contains(d, needle) for d in docs) and _contains(hay, needle)
    np.testing.assert_array_equal(s.batch(step)["tokens"], b["tokens"])  # resumable


@pytest.mark.parametrize("num_targets", [24, 8])   # 8: the answer only (question before them)
def test_sampler_drills_put_the_key_in_memory_and_at_the_targets(tmp_path, num_targets):
  make_base(tmp_path / "base")
  tok = tokenizer_lib.bundled()
  cfg = focus_cfg(tmp_path / "base", p_reconstruction=0.0, retrieval_mix=0.5, local_len=32,
                  num_targets=num_targets, doc_min_tokens=128)
  b = sampler(cfg, 16, tok).batch(0)
  drills = 0
  Q = cfg.focus.num_targets
  for memory, tokens, key_at in zip(b["memory"], b["tokens"], b["key_at"]):
    text = tok.decode(tokens.tolist())
    if "What is the pass key?" not in text:
      assert key_at == -1
      continue
    drills += 1
    key = text.rsplit("The pass key is", 1)[1].strip().rstrip(".")
    # key_at (the loss_key metric) is where the answer starts among the Q targets.
    assert 0 <= key_at < Q
    assert tokens[-Q + key_at] == tok.encode(f" {key}.")[0]
    assert tok.decode(tokens[-Q + key_at:].tolist()) == f" {key}."
    assert f"The pass key is {key}. Remember it." in tok.decode(memory.tolist())
    assert key in tok.decode(tokens[-cfg.focus.num_targets:].tolist())  # supervised targets
    assert key not in text.rsplit("The pass key is", 1)[0]  # only the memory holds the key
  assert 0 < drills < 16
  nll_BQ = np.arange(2 * Q, dtype=np.float32).reshape(2, Q)
  assert focus_train.answer_nll_sum(nll_BQ, np.asarray([Q - 2, -1])) == (Q - 2) + (Q - 1)
  with pytest.raises(config_lib.ConfigError, match="focus.retrieval_mix.*1"):
    config_lib.parse(focus_cfg(tmp_path / "base", retrieval_mix=1.0))
  with pytest.raises(config_lib.ConfigError, match="focus.retrieval_mix.*num_targets"):
    sampler(focus_cfg(tmp_path / "base", p_reconstruction=0.0, retrieval_mix=0.9), 16,
            tok).batch(0)


def test_a_drill_that_cannot_fit_is_refused_up_front_naming_enough(tmp_path):
  # Refused at construction with every key's worst case, not by the first drill drawn: the
  # num_targets it names then serves every draw.
  make_base(tmp_path / "base")
  tok = tokenizer_lib.bundled()
  over = dict(p_reconstruction=0.0, retrieval_mix=0.9, local_len=32, doc_min_tokens=128)
  with pytest.raises(config_lib.ConfigError, match=r"focus.num_targets >= (\d+)") as e:
    sampler(focus_cfg(tmp_path / "base", num_targets=1, **over), 4, tok)
  enough = int(re.search(r"focus.num_targets >= (\d+)", str(e.value)).group(1))
  s = sampler(focus_cfg(tmp_path / "base", num_targets=enough, **over), 4, tok)
  for step in range(30):
    s.batch(step)


def test_a_resume_over_a_base_trained_on_since_is_refused_and_resumes_pinned(tmp_path):
  base_wd, wd = tmp_path / "base", tmp_path / "focus"
  make_base(base_wd)
  cfg = focus_cfg(base_wd)
  cfg.train.steps = 2
  train(cfg, wd)
  shutil.copytree(base_wd / "checkpoints" / "1", base_wd / "checkpoints" / "5")   # trained on
  cfg.train.steps = 3
  with pytest.raises(config_lib.ConfigError, match=r"focus.base_workdir: .* is at step 5, but the "
                     r"adapter .* trained over its step 1; resume with focus.base_workdir=.*"
                     r"/checkpoints/1,"):
    train(cfg, wd)
  cfg.focus.base_workdir = str(base_wd / "checkpoints" / "1")
  assert train(cfg, wd)["step"] == 3
  cfg.model.d_model, cfg.train.steps = 32, 4   # the base's model, not this unused section
  assert train(cfg, wd)["step"] == 4


def test_prefetched_batches_are_the_steps_own(tmp_path):
  make_base(tmp_path / "base")
  s = sampler(focus_cfg(tmp_path / "base", p_reconstruction=0.5), 4)
  fresh = sampler(focus_cfg(tmp_path / "base", p_reconstruction=0.5), 4)
  ahead = focus_train.prefetch(s, 3, 9, depth=2)
  got = [next(ahead) for _ in range(4)]
  ahead.close()   # stopping early (SIGTERM, stop_at) leaves no worker behind
  assert [s for s, _ in got] == [3, 4, 5, 6]
  for step, b in got:   # worker threads and the short-document skip change no sample
    for k, v in fresh.batch(step).items():
      np.testing.assert_array_equal(b[k], v)
  assert list(focus_train.prefetch(s, 5, 5)) == []


def _contains(hay, needle):
  n = len(needle)
  return any(np.array_equal(hay[i:i + n], needle) for i in range(len(hay) - n + 1))


def test_memory_lengths_are_drawn_per_step_and_validated(tmp_path):
  make_base(tmp_path / "base")
  cfg = focus_cfg(tmp_path / "base", memory_tokens="32,47", doc_min_tokens=64)
  s = sampler(cfg, 4)
  default = sampler(focus_cfg(tmp_path / "base"), 4)
  seen = set()
  for step in range(24):
    (chunk, M), b = s.shape(step), s.batch(step)
    assert M in {chunk * (32 // chunk), chunk * (47 // chunk)} and b["memory"].shape == (4, M)
    assert chunk == default.shape(step)[0]   # the chunk-size stream is unchanged by the lengths
    seen.add((chunk, M))
  assert seen == {(8, 32), (8, 40), (16, 32)}
  # Longer than the shortest document admits (47 + local 16 + 1 = 64 is the most).
  with pytest.raises(config_lib.ConfigError, match="focus.memory_tokens.*48.*doc_min_tokens=64"):
    config_lib.parse(focus_cfg(tmp_path / "base", memory_tokens="48"))
  # Shorter than one chunk plus a reconstruction span.
  with pytest.raises(config_lib.ConfigError, match="focus.memory_tokens.*16.*need >= 17"):
    config_lib.parse(focus_cfg(tmp_path / "base", memory_tokens="16"))
  with pytest.raises(config_lib.ConfigError, match="focus.memory_tokens.*comma list"):
    config_lib.parse(focus_cfg(tmp_path / "base", memory_tokens="20,x"))


def test_train_over_several_memory_lengths(tmp_path):
  """Each (chunk size, memory length) a step draws has its compiled step (configs/focus_drills.py
  stages 2-3 list two lengths)."""
  make_base(tmp_path / "base")
  c = focus_cfg(tmp_path / "base", memory_tokens="32,47", doc_min_tokens=64)
  c.train.update(steps=4, ckpt_every=4)
  drawn = [sampler(c, 2).shape(step) for step in range(4)]
  assert (8, 32) in drawn and (8, 40) in drawn   # both lengths of one chunk size
  train(c, tmp_path / "focus")
  assert saved_steps(tmp_path / "focus") == [4]


def test_train_saves_adapter_keeps_base_and_resumes(tmp_path, monkeypatch):
  base_wd, wd = tmp_path / "base", tmp_path / "focus"
  assert make_base(base_wd) == 64
  before, base_digest = loaded.load(str(base_wd)), digest(base_wd)
  init = focus.init_adapter(before.model)
  cfg = focus_cfg(base_wd)

  # SIGTERM while step 2's batch is built: the loop saves step 2 and exits. Batches are built on
  # the training thread here, so the signal lands at a known step.
  monkeypatch.setattr(focus_train, "PREFETCH", 0)
  batch = focus_train.Sampler.batch
  def batch_then_sigterm(self, step):
    if step == 1:
      os.kill(os.getpid(), signal.SIGTERM)
    return batch(self, step)
  monkeypatch.setattr(focus_train.Sampler, "batch", batch_then_sigterm)
  first = train(cfg, wd)
  monkeypatch.setattr(focus_train.Sampler, "batch", batch)
  assert first["preempted"] and first["step"] == 2 and np.isfinite(first["loss"])
  assert saved_steps(wd) == [2]
  monkeypatch.setattr(focus_train, "PREFETCH", 2)   # the resumed run samples on worker threads
  second = train(cfg, wd)
  assert second["start_step"] == 2 and second["step"] == 4 and np.isfinite(second["loss"])
  assert saved_steps(wd) == [2, 4]
  logged = [json.loads(line) for line in open(wd / "metrics.jsonl")]
  assert [m["step"] for m in logged] == [1, 2, 3, 4]
  assert {m["chunk_size"] for m in logged} == {8, 16}    # both buckets compiled and ran
  assert all(np.isfinite(m["loss"]) for m in logged)
  assert all(0 <= m["host_wait_frac"] <= 1 for m in logged)
  assert (wd / "config.json").is_file()

  # The base: its workdir bytes and its params are exactly as before.
  assert digest(base_wd) == base_digest
  after = loaded.load(str(base_wd))
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.split(after.model)[1]),
               nnx.to_pure_dict(nnx.split(before.model)[1]))

  # The adapter: saved under the workdir, reloadable, trained away from its copy-init.
  adapter, saved_cfg, meta = focus_train.load(str(wd), after.model)
  assert meta["step"] == 4 and meta["base_workdir"] == str(base_wd) and meta["local_len"] == 16
  assert saved_cfg == focus.FocusConfig(chunk_size=16, prompt_len=8)
  changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), adapter, init)
  # The last layer's candidate q and o shape only the candidate's final hidden state, which
  # nothing reads (candidates contribute keys/values): they get no gradient. All else trains.
  last = max(changed)
  assert not changed[last]["wq"] and not changed[last]["wo"], changed
  del changed[last]["wq"], changed[last]["wo"]
  assert all(jax.tree.leaves(changed)), changed
  # Resume continued from step 2's adapter, not from the copy: step 2's save differs from both.
  at_2 = focus_train.load(str(wd / "checkpoints" / "2"), after.model)[0]
  assert any(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), at_2, adapter)))


def test_refuses_chunks_past_the_base_context_and_dry_runs(tmp_path):
  make_base(tmp_path / "base")
  # 64 + prompt 8 + 3 later query points = 75 positions > the base's 64.
  with pytest.raises(config_lib.ConfigError, match="focus.chunk_sizes.*data.seq_len=64"):
    config_lib.parse(focus_cfg(tmp_path / "base", chunk_sizes="8,64"))
  with pytest.raises(config_lib.ConfigError, match="focus.base_workdir"):
    config_lib.parse(focus_cfg(tmp_path / "nowhere"))
  # Bases FocusLLM cannot read: refused at the config, naming the layer.
  saved = (tmp_path / "base" / "config.json").read_text()
  for edit, match in ((lambda j: j["model"]["attention"].update(pattern="softmax,dilution"),
                       "layer 1 is dilution;"),
                      (lambda j: j["model"]["attention"].update(pattern="focal", learned=True),
                       "layer 0 is focal with a learned τ;"),
                      (lambda j: j["model"].update(qkv_bias=True), "model.qkv_bias is True;"),
                      (lambda j: j.update(focus={}), "is a FocusLLM adapter run, not a base")):
    j = json.loads(saved)
    edit(j)
    (tmp_path / "base" / "config.json").write_text(json.dumps(j))
    with pytest.raises(config_lib.ConfigError, match=f"focus.base_workdir: .*{match}"):
      config_lib.parse(focus_cfg(tmp_path / "base"))
  (tmp_path / "base" / "config.json").write_text(saved)
  # A memory shorter than the window needs only room for a reconstruction span, when there is one.
  short = dict(chunk_sizes="16", memory_tokens="16", local_len=32)
  with pytest.raises(config_lib.ConfigError, match="need >= 33 .*reconstruction span"):
    config_lib.parse(focus_cfg(tmp_path / "base", **short))
  config_lib.parse(focus_cfg(tmp_path / "base", p_reconstruction=0.0, **short))
  with pytest.raises(config_lib.ConfigError, match="focus.candidate_path.*'frozen'"):
    config_lib.parse(focus_cfg(tmp_path / "base", candidate_path="base"))
  # model.* is the base's: its own num_kv_heads (ignored) does not bound mesh.tensor.
  c = focus_cfg(tmp_path / "base")
  c.model.num_kv_heads, c.mesh.tensor = 1, 2
  config_lib.parse(c)
  with pytest.raises(config_lib.ConfigError, match="train.eval_every.*no validation loop"):
    c = focus_cfg(tmp_path / "base")
    c.train.eval_every = 2
    config_lib.parse(c)
  # 576 memory tokens = 72 chunks, whose candidates alone fill more than 64 positions.
  with pytest.raises(config_lib.ConfigError, match="focus.doc_min_tokens.*72 candidates"):
    config_lib.parse(focus_cfg(tmp_path / "base", chunk_sizes="8", doc_min_tokens=600))
  out = train(focus_cfg(tmp_path / "base", chunk_sizes="8"), tmp_path / "wd", dry_run=True)
  assert out["dry_run"] and set(out["memory"]) == {(8, 40)}   # (chunk size, memory length)
  assert saved_steps(tmp_path / "wd") == []


def test_base_attention_replaces_the_trained_implementation(tmp_path):
  """A base trained with cudnn (the GPU's auto) is adapted with the reference attention, same
  weights: cuDNN would refuse the float32 chunk caches of a float32 adapter run."""
  make_base(tmp_path / "base")
  c = saved_config.read(str(tmp_path / "base"))
  c.model.attention.implementation = "cudnn"
  c.train.compute_dtype = "bfloat16"   # as such a run trained: cuDNN takes 16-bit inputs
  checkpoint.write_config(str(tmp_path / "base"), c)
  plain = loaded.load(str(tmp_path / "base")).model
  swapped = focus_train.with_attention(plain, "xla")
  assert plain.blocks[0].attn.cfg.attention.implementation == "auto"   # load's, not the run's
  assert swapped.blocks[0].attn.cfg.attention.implementation == "xla"
  jax.tree.map(np.testing.assert_array_equal, nnx.state(swapped), nnx.state(plain))


def test_the_frozen_candidate_path_trains_only_the_window_s_keys_and_values(tmp_path):
  """focus.candidate_path="frozen": the saved adapter holds wk/wv only, every one of them trains,
  its config records the path, and resuming under the other path is refused (other leaves)."""
  base_wd, wd = tmp_path / "base", tmp_path / "focus"
  make_base(base_wd)
  base = loaded.load(str(base_wd)).model
  init = focus.init_adapter(base, "frozen")
  cfg = focus_cfg(base_wd, candidate_path="frozen")
  cfg.train.steps = 2
  train(cfg, wd)
  adapter, saved_cfg, _ = focus_train.load(str(wd), base)
  assert saved_cfg.candidate_path == "frozen"
  assert all(sorted(w) == ["wk", "wv"] for w in adapter.values())
  changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), adapter, init)
  assert all(jax.tree.leaves(changed)), changed
  other = focus_cfg(base_wd)
  other.train.steps = 3
  with pytest.raises(config_lib.ConfigError, match="focus.candidate_path.*'frozen'"):
    train(other, wd)
