"""FocusLLM's options around the paper's defaults: the candidate layouts ("sequential" reads as a
preceding context, in chunk order), the first-token sink, the log_count bias and the frozen
candidate path. Helpers from test_focus (tests/ is on sys.path under pytest)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from focaljax.model import attention as attn_lib
from focaljax.focus import model as focus
from focaljax.focus import generate as focus_generate
from focaljax.model import decoder as model_lib
from test_focus import jitted, perturbed, split, tiny_base, tokens


def test_sequential_candidates_read_as_a_preceding_context():
  """"sequential": candidate keys at 0..C-1 and local tokens from C, exactly the base over [C
  tokens | local window] when the candidates are the base's own k/v of those C tokens."""
  base = tiny_base(qk_norm=True)
  theta = base.cfg.rope_theta
  prefix, local = tokens(20, (2, 5)), tokens(21, (2, 9))
  caches = focus.frozen_prefill(base, prefix, 5, theta)
  # The caches hold rotated keys: rotating back by -position gives the pre-RoPE keys.
  back = -jnp.broadcast_to(jnp.arange(5), (2, 5))
  kv = [(model_lib.apply_rope(c["k"], back, theta) if b.attn.spec.position is
         attn_lib.Position.ROPE else c["k"], c["v"]) for b, c in zip(base.blocks, caches)]
  local_fn = lambda seq: focus.local_logits(base, local, kv, theta, sequential_positions=seq)
  full = base(jnp.concatenate([prefix, local], 1))[:, 5:]
  np.testing.assert_allclose(local_fn(True), full, atol=1e-5, rtol=1e-5)
  assert float(jnp.abs(local_fn(False) - full).max()) > 1e-2   # "shared" is another layout


def test_the_sink_is_the_memory_s_first_token_as_the_base_reads_it():
  """sink "first_token": key 0 of the candidate block is the memory's first token as the frozen
  base caches it at position 0 (no context: a document start); alone before the window in the
  "sequential" layout, the local decoder is then exactly the base over [that token | window]."""
  base = tiny_base(qk_norm=True)
  theta = base.cfg.rope_theta
  adapter = perturbed(focus.init_adapter(base))
  cfg = focus.FocusConfig(chunk_size=8, prompt_len=4, sink="first_token")
  memory, local = tokens(26, (2, 24)), tokens(27, (2, 9))
  _, kv, caches = focus.condense(adapter, base, memory, local[:, -4:], 1, cfg)
  with_sink = focus.with_sink(kv, caches, cfg.sink)
  own = focus.frozen_prefill(base, memory[:, :1], 1, theta)
  for (k, v), (k0, v0), c in zip(with_sink, kv, own):
    assert k.shape == (2, 4) + k0.shape[2:]                   # 3 chunks + the sink
    np.testing.assert_allclose(k[:, 0, 0], c["k"][:, 0], atol=1e-6)
    np.testing.assert_allclose(v[:, 0, 0], c["v"][:, 0], atol=1e-6)
    np.testing.assert_array_equal(k[:, 1:], k0)
  sink_only = [(k[:, :1, 0], v[:, :1, 0]) for k, v in with_sink]
  full = base(jnp.concatenate([memory[:, :1], local], 1))[:, 1:]
  np.testing.assert_allclose(focus.local_logits(base, local, sink_only, theta,
                                                sequential_positions=True), full,
                             atol=1e-5, rtol=1e-5)
  # The config refuses a bad name, and the sink with a candidate bias (one bias per block).
  with pytest.raises(ValueError, match="sink"):
    focus.FocusConfig(chunk_size=8, sink="bos")
  with pytest.raises(ValueError, match="sink"):
    focus.FocusConfig(chunk_size=8, sink="first_token", candidate_bias="log_count")


def test_log_count_bias_makes_copies_of_the_candidates_weigh_as_one():
  """candidate_bias "log_count": every candidate present twice gives the same local decoder as
  once (C copies of a key weigh as one key); without the bias the copies weigh double. In the
  "shared" layout, where every candidate sits at one position, so that copies are exact."""
  base = tiny_base()
  adapter = perturbed(focus.init_adapter(base))
  cfg = focus.FocusConfig(chunk_size=8, prompt_len=4, candidate_positions="shared")
  memory, local = tokens(24, (2, 24)), tokens(25, (2, 10))
  _, kv, _ = focus.condense(adapter, base, memory, local[:, -4:], 1, cfg)
  once = [(k[:, :, 0], v[:, :, 0]) for k, v in kv]
  twice = [(jnp.concatenate([k, k], 1), jnp.concatenate([v, v], 1)) for k, v in once]
  run = lambda kv, bias: focus.local_logits(base, local, kv, base.cfg.rope_theta,
                                            candidate_bias=bias)
  np.testing.assert_allclose(run(twice, "log_count"), run(once, "log_count"), atol=1e-5, rtol=1e-5)
  assert float(jnp.abs(run(twice, "none") - run(once, "none")).max()) > 1e-3
  assert float(jnp.abs(run(once, "log_count") - run(once, "none")).max()) > 1e-3
  # The config carries it to focus.logits; a bad name is refused naming the field.
  biased = dataclasses.replace(cfg, candidate_bias="log_count")
  np.testing.assert_allclose(focus.logits(adapter, base, memory, local, biased),
                             run(once, "log_count"), atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="candidate_bias"):
    focus.FocusConfig(chunk_size=8, candidate_bias="log")


def test_sequential_positions_follow_chunk_order_and_fit_the_context():
  base = tiny_base()
  adapter = perturbed(focus.init_adapter(base))
  cfg = focus.FocusConfig(chunk_size=8, prompt_len=4, candidate_positions="sequential")
  memory, local = tokens(22, (2, 32)), tokens(23, (2, 10))
  graphdef, params = split(base, adapter)
  got = jitted(graphdef, focus.logits, cfg=cfg)(params, memory, local)
  # One chunk at a time, concatenated in chunk order: candidate c sits at position c.
  kvs = [focus.condense(adapter, base, memory[:, 8 * c: 8 * c + 8], local[:, -4:], 1, cfg)[1]
         for c in range(4)]
  local_fn = lambda order, seq: focus.local_logits(
      base, local, [(jnp.concatenate([kvs[c][i][0][:, :, 0] for c in order], 1),
                     jnp.concatenate([kvs[c][i][1][:, :, 0] for c in order], 1))
                    for i in range(2)], base.cfg.rope_theta, sequential_positions=seq)
  np.testing.assert_allclose(got, local_fn(range(4), True), atol=1e-5, rtol=1e-5)
  assert float(jnp.abs(got - local_fn(range(3, -1, -1), True)).max()) > 1e-3
  shared = jitted(graphdef, focus.logits, cfg=focus.FocusConfig(chunk_size=8, prompt_len=4,
                                                                candidate_positions="shared"))
  assert float(jnp.abs(got - shared(params, memory, local)).max()) > 1e-3
  # 20 chunks + a 14-token window = 34 positions > the base's 32: refused; "shared" fits.
  long_memory, window = tokens(24, (1, 160)), tokens(25, (1, 14))
  with pytest.raises(ValueError, match="candidate_positions='sequential'.*max_seq_len=32"):
    focus.logits(adapter, base, long_memory, window, cfg)
  with pytest.raises(ValueError, match="candidate_positions='sequential'"):
    focus_generate.prefill(adapter, base, long_memory[:, :96], window[:, :10], cfg, 12)
  shared(params, long_memory, window)
  with pytest.raises(ValueError, match="candidate_positions must be one of.*'sequential'"):
    focus.FocusConfig(chunk_size=8, candidate_positions="official")


def test_the_frozen_candidate_path_keeps_the_base_s_candidate():
  """candidate_path "frozen": the adapter holds only wk/wv; the candidate's hidden state is the
  base's whatever the adapter (its own reading of the chunk survives training), the local
  decoder's candidate k/v are the adapter's, copy-initialised it is the "adapter" path, and only
  wk/wv get gradient (every layer's: each feeds the local decoder)."""
  base = tiny_base(qk_norm=True)
  cfg = focus.FocusConfig(chunk_size=8, prompt_len=4, candidate_path="frozen")
  copy = focus.init_adapter(base, "frozen")
  assert all(sorted(w) == ["wk", "wv"] for w in copy.values())
  memory, local = tokens(30, (2, 24)), tokens(31, (2, 9))
  h_ref, kv_ref, _ = focus.condense(focus.init_adapter(base), base, memory, local[:, -4:], 2,
                                    dataclasses.replace(cfg, candidate_path="adapter"))
  h0, kv0, _ = focus.condense(copy, base, memory, local[:, -4:], 2, cfg)
  moved = perturbed(copy, scale=1.0)
  h1, kv1, _ = focus.condense(moved, base, memory, local[:, -4:], 2, cfg)
  for h in (h0, h1):
    np.testing.assert_allclose(h, h_ref, atol=1e-5, rtol=1e-5)
  for (k, v), (k0, v0), (k1, v1) in zip(kv_ref, kv0, kv1):
    np.testing.assert_allclose(k0, k, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(v0, v, atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(k1 - k).max()) > 1e-3 and float(jnp.abs(v1 - v).max()) > 1e-3
  np.testing.assert_allclose(
      focus.logits(copy, base, memory, local, cfg),
      focus.logits(focus.init_adapter(base), base, memory, local,
                   dataclasses.replace(cfg, candidate_path="adapter")), atol=1e-5, rtol=1e-5)
  grads = jax.grad(lambda a: focus.loss(a, base, memory, local, cfg, 3))(moved)
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
  with pytest.raises(ValueError, match="candidate_path"):
    focus.FocusConfig(chunk_size=8, candidate_path="frozen_q")
  with pytest.raises(ValueError, match="candidate_path"):
    focus.init_adapter(base, "none")
