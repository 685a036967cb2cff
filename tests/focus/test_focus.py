"""FocusLLM wrapper: identities at init, positions in range, no leakage, batched = sequential
chunks, incremental generation = recomputation (both candidate paths), the adapter on disk,
chunks spread over a mesh."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from focaljax.model import attention as attn_lib
from focaljax.focus import model as focus
from focaljax.focus import generate as focus_generate
from focaljax.focus import train as focus_train
from focaljax.evaluation import generate as gen_lib
from focaljax.model import decoder as model_lib
from focaljax.train import checkpoint

V = 97
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_base(pattern="softmax:rope,focal:rope", max_seq_len=32, qk_norm=False, seed=0,
              head_dim=8):
  cfg = model_lib.ModelConfig(
      vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=head_dim,
      d_ff=64,
      max_seq_len=max_seq_len, qk_norm=qk_norm,
      attention=attn_lib.AttentionConfig(layers=attn_lib.parse_pattern(pattern, 2)))
  return model_lib.Transformer(cfg, nnx.Rngs(seed))


def perturbed(adapter, scale=0.3, seed=5):
  """An adapter that differs from the base copy, so the candidate path matters."""
  leaves, tree = jax.tree.flatten(adapter)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [w + scale * jnp.std(w) * jax.random.normal(k, w.shape)
                                   for w, k in zip(leaves, keys)])


def tokens(seed, shape, lo=1, hi=V):
  return jax.random.randint(jax.random.key(seed), shape, lo, hi)


def split(base, adapter):
  """(graphdef, params): params = {"base": pure dict, "adapter": adapter}, the trainer's view."""
  graphdef, state = nnx.split(base)
  return graphdef, {"base": nnx.to_pure_dict(state), "adapter": adapter}


def jitted(graphdef, fn, **kwargs):
  """fn(adapter, base, *args, **kwargs) -> jitted f(params, *args): one compile per shape."""
  return jax.jit(lambda p, *a: fn(p["adapter"], nnx.merge(graphdef, p["base"]), *a, **kwargs))


def test_no_memory_equals_base():
  base = tiny_base(qk_norm=True)
  adapter = perturbed(focus.init_adapter(base))
  local = tokens(1, (2, 12))
  cfg = focus.FocusConfig(chunk_size=8)
  graphdef, params = split(base, adapter)
  no_memory = jnp.zeros((2, 0), jnp.int32)
  got = jitted(graphdef, focus.logits, cfg=cfg)(params, no_memory, local)
  np.testing.assert_allclose(got, gen_lib.logits(base, local), atol=1e-5, rtol=1e-5)
  nll = jitted(graphdef, focus.target_nll, cfg=cfg, num_targets=5)(params, no_memory, local)
  ref = gen_lib.logits(base, local[:, :-1])[:, -5:]
  ref_nll = jax.nn.logsumexp(ref, -1) - jnp.take_along_axis(ref, local[:, -5:, None], -1)[..., 0]
  np.testing.assert_allclose(nll, ref_nll, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pattern", ["softmax:rope,focal:rope", "focal:rope,softmax:none"])
def test_copy_init_candidate_is_base_hidden_state(pattern):
  base = tiny_base(pattern, qk_norm=True)
  adapter = focus.init_adapter(base)
  cfg = focus.FocusConfig(chunk_size=8, prompt_len=6)
  memory, prompt = tokens(2, (2, 24)), tokens(3, (2, 6))
  graphdef, params = split(base, adapter)
  h_BCQE, _, _ = jitted(graphdef, focus.condense, num_candidates=1, cfg=cfg)(
      params, memory, prompt)
  for c in range(3):
    seq = jnp.concatenate([memory[:, 8 * c: 8 * c + 8], prompt], 1)
    np.testing.assert_allclose(base._logits(h_BCQE[:, c])[:, 0], base(seq)[:, -1],
                               atol=1e-5, rtol=1e-5)


def test_positions_stay_inside_trained_context(monkeypatch):
  base = tiny_base(max_seq_len=32)
  adapter = perturbed(focus.init_adapter(base))
  seen = []
  rope = model_lib.apply_rope

  def recording_rope(x, positions, theta, *scaling):
    # Runs inside jit: the callback reports the traced positions' maximum at run time.
    jax.debug.callback(lambda m: seen.append(int(m)), jnp.max(positions))
    assert theta == base.cfg.rope_theta   # never NTK-scaled
    return rope(x, positions, theta, *scaling)

  monkeypatch.setattr(model_lib, "apply_rope", recording_rope)
  cfg = focus.FocusConfig(chunk_size=16, prompt_len=8)
  memory = tokens(4, (1, 5 * 32))        # 5× the trained context: 10 chunks, 10 candidates
  local = tokens(5, (1, 20))
  graphdef, params = split(base, adapter)
  jitted(graphdef, focus.logits, cfg=cfg)(params, memory, local)
  jitted(graphdef, focus.target_nll, cfg=cfg, num_targets=4)(params, memory, local)
  # A prompt length no other test uses, so the jitted generation traces with the recording RoPE.
  focus_generate.generate(adapter, base, memory, local[:, :15], cfg, max_new_tokens=4)
  jax.effects_barrier()
  assert len(seen) > 20 and max(seen) < base.cfg.max_seq_len, (len(seen), max(seen))
  with pytest.raises(ValueError, match="chunk_size"):
    focus.logits(adapter, base, memory, local, focus.FocusConfig(chunk_size=32, prompt_len=8))
  with pytest.raises(ValueError, match="local window"):
    focus.logits(adapter, base, memory, tokens(6, (1, 40)), cfg)


def test_objective_does_not_leak_targets():
  base = tiny_base()
  graphdef, params = split(base, perturbed(focus.init_adapter(base)))
  cfg = focus.FocusConfig(chunk_size=8, prompt_len=6)
  memory = tokens(7, (1, 16), hi=40)                  # memory ids < 40, local ids unique >= 40
  seq = (40 + jax.random.permutation(jax.random.key(8), V - 40)[:15])[None]
  T, Q = 14, 6
  first = T - Q

  nll = jitted(graphdef, focus.target_nll, cfg=cfg, num_targets=Q)
  # d nll_q / d embedding table, for every target q at once: [Q, V, E].
  jac = jax.jit(jax.jacrev(lambda p: nll(p, memory, seq)[0]))(params)["base"]["embed"]
  for q in range(Q):
    g_embed = jac[q]
    i = first + q                                    # the query point; target seq[i + 1]
    later = np.asarray(seq[0, i + 1:])
    seen = np.asarray(seq[0, i - 3: i + 1])           # the dynamic prompt's last tokens
    assert np.all(np.asarray(g_embed)[later] == 0.0), (q, later)
    assert np.all(np.abs(np.asarray(g_embed)[seen]).sum(-1) > 0), q

  # The paper's objective (score every local position with the final candidates) does leak: the
  # prediction at position i moves with the embedding of its own target x_{i+1}.
  logits = jitted(graphdef, focus.logits, cfg=cfg)
  i = T - 3
  g_embed = jax.jit(jax.grad(lambda p: logits(p, memory, seq[:, :T])[0, i].sum()))(
      params)["base"]["embed"]
  assert np.abs(np.asarray(g_embed)[int(seq[0, i + 1])]).sum() > 0


def test_each_target_is_scored_as_generation_predicts_it():
  """target_nll[b, q] is the NLL of x_{i+1}, i = first + q, from focus.logits on the window ending
  at i with the dynamic prompt grown by q tokens (as generation grows it; see the generation test):
  each training row is read at its own query point (local_logits' at_B)."""
  base = tiny_base()
  graphdef, params = split(base, perturbed(focus.init_adapter(base)))
  cfg = focus.FocusConfig(chunk_size=16, prompt_len=6)
  memory, seq = tokens(11, (2, 32)), tokens(12, (2, 15))
  T, Q = 14, 5
  nll = jitted(graphdef, focus.target_nll, cfg=cfg, num_targets=Q)(params, memory, seq)
  for q in range(Q):
    i = T - Q + q
    grown = dataclasses.replace(cfg, prompt_len=6 + q)
    last = jax.nn.log_softmax(jitted(graphdef, focus.logits, cfg=grown)(params, memory,
                                                                       seq[:, :i + 1])[:, -1])
    want = -np.take_along_axis(np.asarray(last), np.asarray(seq[:, i + 1])[:, None], 1)[:, 0]
    np.testing.assert_allclose(nll[:, q], want, rtol=1e-5, atol=1e-5)


def test_batched_chunks_equal_one_at_a_time():
  base = tiny_base()
  adapter = perturbed(focus.init_adapter(base))
  cfg = focus.FocusConfig(chunk_size=8, prompt_len=4)
  memory, span = tokens(11, (2, 32)), tokens(12, (2, 6))
  graphdef, params = split(base, adapter)
  condense = jitted(graphdef, focus.condense, num_candidates=3, cfg=cfg)
  h, kv, _ = condense(params, memory, span)
  for c in range(4):
    h_c, kv_c, _ = condense(params, memory[:, 8 * c: 8 * c + 8], span)
    np.testing.assert_allclose(h[:, c], h_c[:, 0], atol=1e-5, rtol=1e-5)
    for (k, v), (k_c, v_c) in zip(kv, kv_c):
      np.testing.assert_allclose(k[:, c], k_c[:, 0], atol=1e-5, rtol=1e-5)
      np.testing.assert_allclose(v[:, c], v_c[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["adapter", "frozen"])
def test_incremental_generation_equals_recomputation(path):
  base = tiny_base(qk_norm=True)
  adapter = perturbed(focus.init_adapter(base, path), scale=1.0)
  cfg = focus.FocusConfig(chunk_size=8, prompt_len=4, candidate_path=path)
  memory, prompt = tokens(13, (2, 24)), tokens(14, (2, 10))
  graphdef, params = split(base, adapter)
  state, logits_BV = focus_generate.prefill(adapter, base, memory, prompt, cfg, max_new_tokens=4)
  for t in range(4):
    # From scratch: the dynamic prompt is the last 4 + t tokens (it grows; its start is fixed).
    so_far = state["tokens"][:, :10 + t]
    grown = dataclasses.replace(cfg, prompt_len=4 + t)
    ref = jitted(graphdef, focus.logits, cfg=grown)(params, memory, so_far)[:, -1]
    np.testing.assert_allclose(logits_BV, ref, atol=1e-5, rtol=1e-5)
    if t < 3:
      state, logits_BV = focus_generate.step(adapter, base, state, jnp.argmax(logits_BV, -1))
  out = focus_generate.generate(adapter, base, memory, prompt, cfg, max_new_tokens=4)
  np.testing.assert_array_equal(out[:, :13], state["tokens"])
  assert out.shape == (2, 14) and out.dtype == jnp.int32
  # The readout: each chunk's candidate (prompt = the last 4 prompt tokens) through the LM head.
  out2, readout = focus_generate.generate(adapter, base, memory, prompt, cfg, max_new_tokens=4,
                                          readout=True)
  np.testing.assert_array_equal(out2, out)
  h_BCQE, kv, _ = focus.condense(adapter, base, memory, prompt[:, -4:], 1, cfg)
  top_BC = readout["candidate_top"]
  np.testing.assert_array_equal(top_BC, jnp.argmax(base._logits(h_BCQE[:, :, 0]), axis=-1))
  assert top_BC.shape == (2, 3)
  # Per new token s, the candidates of the grown prompt (as generation builds them, above).
  tops = readout["candidate_top_steps"]
  assert tops.shape == (2, 4, 3)
  np.testing.assert_array_equal(tops[:, 0], top_BC)
  for t in (1, 3):
    grown = dataclasses.replace(cfg, prompt_len=4 + t)
    h_t, _, _ = focus.condense(adapter, base, memory, out[:, 6:10 + t], 1, grown)
    np.testing.assert_array_equal(tops[:, t], jnp.argmax(base._logits(h_t[:, :, 0]), axis=-1))
  # The attention diagnostic is local_logits' at the last prompt token, which predicts out[:, 10].
  logits_BV, mass_LBC = focus.local_logits(
      base, prompt, [(k[:, :, 0], v[:, :, 0]) for k, v in kv], base.cfg.rope_theta,
      at_B=jnp.full((2,), 9), candidate_mass=True)
  np.testing.assert_array_equal(jnp.argmax(logits_BV, -1), out[:, 10])
  np.testing.assert_allclose(readout["candidate_mass"], mass_LBC, rtol=1e-5, atol=1e-6)
  assert readout["candidate_mass"].shape == (len(base.blocks), 2, 3)
  assert float(mass_LBC.min()) >= 0


def test_adapter_round_trip_and_unsupported_layers(tmp_path):
  base = tiny_base()
  adapter = perturbed(focus.init_adapter(base))
  cfg = focus.FocusConfig(chunk_size=8, prompt_len=4, candidate_path="adapter")
  meta = focus_train.meta(cfg, trained_prompt_len=2, local_len=16, base_workdir="/base")
  checkpoint.save_params(str(tmp_path), 3, adapter, meta)
  for path in (tmp_path, tmp_path / "checkpoints" / "3"):
    loaded, cfg2, meta2 = focus_train.load(str(path), base)
    assert cfg2 == cfg and meta2["base_workdir"] == "/base" and meta2["step"] == 3
    jax.tree.map(np.testing.assert_array_equal, loaded, adapter)
  with pytest.raises(ValueError, match="does not fit this base.*/base"):
    focus_train.load(str(tmp_path), tiny_base(head_dim=16))
  with pytest.raises(FileNotFoundError, match="neither a FocusLLM run"):
    focus_train.load(str(tmp_path / "nowhere"), base)
  with pytest.raises(NotImplementedError, match="dilution"):
    focus.init_adapter(tiny_base("softmax:rope,dilution:none"))


_SHARDED = """
import json, sys
from flax import nnx
import jax, jax.numpy as jnp
from focaljax import sharding
from focaljax.focus import model as focus
from test_focus import tiny_base, perturbed, tokens, split, jitted
base = tiny_base(qk_norm=True, head_dim=16)  # the kernels take head dims >= 16
graphdef, params = split(base, perturbed(focus.init_adapter(base)))
memory, local = tokens(2, (1, 64)), tokens(3, (1, 12))
cfg = focus.FocusConfig(chunk_size=8, implementation=sys.argv[1])
ref = jitted(graphdef, focus.logits, cfg=cfg)(params, memory, local)
cond = jax.jit(lambda p, m, s: focus.condense(p["adapter"], nnx.merge(graphdef, p["base"]), m, s,
                                              1, cfg))
with jax.set_mesh(sharding.make_mesh(-1, 1, 1)):
  got = jitted(graphdef, focus.logits, cfg=cfg)(params, memory, local)
  k = cond(params, memory, local[:, -4:])[2][0]["k"]
  jaxpr = str(jax.make_jaxpr(lambda p: focus.logits(p["adapter"], nnx.merge(graphdef, p["base"]),
                                                    memory, local, cfg))(params))
print(json.dumps({"err": float(jnp.abs(got - ref).max()), "shard_map": "shard_map" in jaxpr,
                  "shards": len({str(s.index) for s in k.addressable_shards})}))
"""


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_chunks_of_one_document_spread_over_a_mesh(implementation):
  """B = 1 with 8 chunks on 8 simulated devices: each device condenses one chunk, same logits
  (the Pallas kernels through shard_map, in interpret mode here)."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([REPO, os.path.dirname(__file__)]))
  out = subprocess.run([sys.executable, "-c", _SHARDED, implementation], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["shards"] == 8
  assert result["err"] < 1e-4
  assert result["shard_map"] == (implementation == "pallas")  # kernels run per device
