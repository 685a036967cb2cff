"""Cached decoding equals recomputing the full forward; sampling stays in the nucleus."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from focaljax.model import attention as attn_lib
from focaljax.evaluation import generate as gen_lib
from focaljax.model import decoder as model_lib


def tiny_model(pattern="softmax:rope,dilution:none,focal:rope", *, learned=True, vocab=97,
               max_seq_len=8, seed=0):
  layers = attn_lib.parse_pattern(pattern, 3)
  cfg = model_lib.ModelConfig(
      vocab_size=vocab, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
      d_ff=64, max_seq_len=max_seq_len,
      attention=attn_lib.AttentionConfig(layers=layers, learned=learned, tau_init=2.0,
                                         tau_min=1.0, tau_max=4.0))
  model = model_lib.Transformer(cfg, nnx.Rngs(seed))
  if learned:
    # Nonzero w_τ so the learned temperature varies by token and the cached prefix sum matters.
    for block in model.blocks:
      if hasattr(block.attn, "w_tau"):
        block.attn.w_tau[...] = jax.random.normal(jax.random.key(1), (32,)) * 0.5
  return model


def greedy_by_recompute(model, prompt_BT, max_new):
  """Full forward at every step. A fixed-size buffer keeps one compiled shape: the model is
  causal, so the not-yet-generated zeros after position t cannot change the logits at t."""
  B, T = prompt_BT.shape
  buf = np.zeros((B, T + max_new), np.int32)
  buf[:, :T] = prompt_BT
  for t in range(T, T + max_new):
    logits = gen_lib.logits(model, buf, rope_length=T + max_new)
    buf[:, t] = np.argmax(np.asarray(logits[:, t - 1]), -1)
  return buf


@pytest.mark.parametrize("pattern,learned", [
    ("softmax:rope,dilution:none,focal:rope", True),   # every family, learned τ
    ("dilution:rope", False),
])
def test_greedy_cached_equals_recompute(pattern, learned):
  model = tiny_model(pattern, learned=learned)
  prompt = jax.random.randint(jax.random.key(2), (2, 6), 1, 97)
  # 6 + 10 > max_seq_len = 8: the RoPE layers run NTK-scaled, like long-context evaluation.
  cached = gen_lib.generate(model, prompt, max_new_tokens=10)
  reference = greedy_by_recompute(model, prompt, 10)
  np.testing.assert_array_equal(np.asarray(cached), np.asarray(reference))
  assert cached.shape == (2, 16) and cached.dtype == jnp.int32


def test_top_p_samples_only_from_nucleus():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
  kept = gen_lib._nucleus(logits, 0.7)
  # 0.5 + 0.3 reaches 0.7: exactly the first two survive.
  assert np.isfinite(np.asarray(kept[0])).tolist() == [True, True, False, False]
  picks = jax.random.categorical(jax.random.key(0), kept, axis=-1)
  assert set(np.asarray(picks).tolist()) == {0, 1}
  np.testing.assert_allclose(np.mean(np.asarray(picks) == 0), 0.5 / 0.8, atol=0.03)
  # A nucleus below the top token's mass keeps the top token alone.
  assert np.isfinite(np.asarray(gen_lib._nucleus(logits[:1], 0.1))).sum() == 1


def test_top_p_below_float32_range_is_greedy():
  # 1e-40 passes the (0, 1] check but is 0 as float32: it kept no token and sampled id 0.
  model = tiny_model("softmax:rope", learned=False)
  prompt = jax.random.randint(jax.random.key(3), (2, 4), 1, 97)
  kw = dict(max_new_tokens=5, temperature=1.0, rng=jax.random.key(1))
  np.testing.assert_array_equal(np.asarray(gen_lib.generate(model, prompt, top_p=1e-40, **kw)),
                                np.asarray(gen_lib.generate(model, prompt, max_new_tokens=5)))


def test_generate_top_p_stays_in_nucleus():
  model = tiny_model("softmax:rope", learned=False)
  prompt = jnp.ones((8, 4), jnp.int32)
  out = gen_lib.generate(model, prompt, max_new_tokens=1, temperature=1.0, top_p=0.3,
                         rng=jax.random.key(5))
  logits = gen_lib.logits(model, prompt, rope_length=5)[:, -1]
  allowed = np.isfinite(np.asarray(gen_lib._nucleus(logits, 0.3)))
  for b in range(8):
    assert allowed[b, int(out[b, -1])]


def test_sampling_reproducible_and_seed_dependent():
  model = tiny_model()
  prompt = jax.random.randint(jax.random.key(4), (3, 5), 1, 97)
  kw = dict(max_new_tokens=12, temperature=1.5, top_p=0.95)
  a = gen_lib.generate(model, prompt, rng=jax.random.key(7), **kw)
  b = gen_lib.generate(model, prompt, rng=jax.random.key(7), **kw)
  c = gen_lib.generate(model, prompt, rng=jax.random.key(8), **kw)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_eos_pads_finished_rows():
  model = tiny_model("softmax:rope", learned=False)
  prompt = jax.random.randint(jax.random.key(6), (2, 4), 1, 97)
  free = np.asarray(gen_lib.generate(model, prompt, max_new_tokens=6))
  eos = int(free[0, 5])  # the second generated token of row 0 becomes "eos"
  out = np.asarray(gen_lib.generate(model, prompt, max_new_tokens=6, eos_id=eos))
  first = int(np.argmax(free[0, 4:] == eos)) + 4
  assert (out[0, first:] == eos).all()
  np.testing.assert_array_equal(out[0, :first], free[0, :first])


def test_bad_arguments_raise():
  model = tiny_model("softmax:rope", learned=False)
  with pytest.raises(ValueError, match="top_p"):
    gen_lib.generate(model, jnp.ones((1, 3), jnp.int32), max_new_tokens=2, top_p=0.0)
  with pytest.raises(ValueError, match="max_new_tokens"):
    gen_lib.generate(model, jnp.ones((1, 3), jnp.int32), max_new_tokens=0)
