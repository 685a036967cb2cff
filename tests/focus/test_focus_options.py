"""FocusLLM's candidate layout (the candidates read as a preceding context, in chunk order) and
the frozen candidate path. Helpers from test_focus (tests/ is on sys.path under pytest)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from focaljax import dispatch
from focaljax.model import attention as attn_lib
from focaljax.focus import model as focus
from focaljax.focus import generate as focus_generate
from focaljax.model import decoder as model_lib
from test_focus import jitted, perturbed, split, tiny_base, tokens


def test_candidates_read_as_a_preceding_context():
  """Candidate keys at 0..C-1 and local tokens from C: exactly the base over [C tokens | local
  window] when the candidates are the base's own k/v of those C tokens."""
  base = tiny_base(qk_norm=True)
  theta = base.cfg.rope_theta
  prefix, local = tokens(20, (2, 5)), tokens(21, (2, 9))
  caches = focus.frozen_prefill(base, prefix, 5, theta)
  # The caches hold rotated keys: rotating back by -position gives the pre-RoPE keys.
  back = -jnp.broadcast_to(jnp.arange(5), (2, 5))
  kv = [(model_lib.apply_rope(c["k"], back, theta) if b.attn.spec.position is
         attn_lib.Position.ROPE else c["k"], c["v"]) for b, c in zip(base.blocks, caches)]
  full = base(jnp.concatenate([prefix, local], 1))[:, 5:]
  np.testing.assert_allclose(focus.local_logits(base, local, kv, theta), full, atol=1e-5,
                             rtol=1e-5)


def test_candidate_positions_follow_chunk_order_and_fit_the_context():
  base = tiny_base()
  adapter = perturbed(focus.init_adapter(base))
  cfg = focus.FocusConfig(chunk_size=8, prompt_len=4)
  memory, local = tokens(22, (2, 32)), tokens(23, (2, 10))
  graphdef, params = split(base, adapter)
  got = jitted(graphdef, focus.logits, cfg=cfg)(params, memory, local)
  # One chunk at a time, concatenated in chunk order: candidate c sits at position c.
  kvs = [focus.condense(adapter, base, memory[:, 8 * c: 8 * c + 8], local[:, -4:], 1, cfg)[1]
         for c in range(4)]
  local_fn = lambda order: focus.local_logits(
      base, local, [(jnp.concatenate([kvs[c][i][0][:, :, 0] for c in order], 1),
                     jnp.concatenate([kvs[c][i][1][:, :, 0] for c in order], 1))
                    for i in range(2)], base.cfg.rope_theta)
  np.testing.assert_allclose(got, local_fn(range(4)), atol=1e-5, rtol=1e-5)
  assert float(jnp.abs(got - local_fn(range(3, -1, -1))).max()) > 1e-3
  # 20 chunks + a 14-token window = 34 positions > the base's 32: refused.
  long_memory, window = tokens(24, (1, 160)), tokens(25, (1, 14))
  with pytest.raises(ValueError, match="20 candidates before the local window.*max_seq_len=32"):
    focus.logits(adapter, base, long_memory, window, cfg)
  with pytest.raises(ValueError, match="12 candidates before the local window"):
    focus_generate.prefill(adapter, base, long_memory[:, :96], window[:, :10], cfg, 12)


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


def test_condense_auto_is_the_reference_off_gpus_and_explicit_choices_stay():
  assert focus.FocusConfig(chunk_size=8).implementation == "auto"
  assert dispatch.choose("condense", "auto").implementation == (
      "pallas" if dispatch.platform() in ("gpu", "hopper") else "xla")
  assert dispatch.choose("condense", "xla").implementation == "xla"
  assert dispatch.choose("condense", "pallas").implementation == "pallas"
  with pytest.raises(ValueError, match="'auto', 'xla' or 'pallas'"):
    dispatch.choose("condense", "triton")
