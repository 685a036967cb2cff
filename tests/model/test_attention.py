"""Invariants of the attention variants: causality by gradient, limits, the learned temperature."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from focaljax import config as config_lib
from focaljax.model import attention as A
from focaljax.model import decoder as M
from focaljax import ops

VARIANTS = ("softmax", "focal", "dilution")


def _qkv(seed, B=2, T=12, N=4, K=2, D=8, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (B, T, N, D), dtype), jax.random.normal(ks[1], (B, T, K, D), dtype),
          jax.random.normal(ks[2], (B, T, K, D), dtype))


def _attend(variant, q, k, v, scale, seg=None):
  spec = A.LayerSpec(A.Variant(variant), A.Position.NONE)
  cfg = A.AttentionConfig(layers=(spec,))
  return A.FAMILY[spec.variant].attend(cfg, q, k, v, scale, seg)


@pytest.mark.parametrize("variant", VARIANTS)
def test_causal_by_gradient(variant):
  q, k, v = _qkv(0)
  scale = jax.random.uniform(jax.random.key(9), (2, 1, 12), minval=0.1, maxval=0.5)
  t = 5
  f = lambda q, k, v, s: _attend(variant, q, k, v, s)[:, t].sum()
  grads = jax.grad(f, argnums=(0, 1, 2, 3))(q, k, v, scale)
  for g in grads[:3]:  # a column cumsum can leak the future through any of q, k, v
    np.testing.assert_array_equal(g[:, t + 1:], 0)
    assert np.abs(g[:, : t + 1]).sum() > 0
  if variant != "dilution":
    np.testing.assert_array_equal(grads[3][..., t + 1:], 0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_segments_isolate_documents(variant):
  q, k, v = _qkv(1)
  seg = jnp.array([[1] * 5 + [2] * 7, [1] * 12])
  out = _attend(variant, q, k, v, 0.3, seg)
  # Changing document 1 leaves document 2's outputs untouched.
  q2, k2, v2 = (x.at[0, :5].set(x[0, :5] * -3.0 + 1.0) for x in (q, k, v))
  out2 = _attend(variant, q2, k2, v2, 0.3, seg)
  np.testing.assert_allclose(out[0, 5:], out2[0, 5:], rtol=1e-6, atol=1e-6)
  # Document 2 alone gives the same outputs as inside the packed row.
  alone = _attend(variant, q[:1, 5:], k[:1, 5:], v[:1, 5:], 0.3)
  np.testing.assert_allclose(out[0, 5:], alone[0], rtol=1e-5, atol=1e-5)


def test_focal_with_unit_temperature_is_softmax():
  q, k, v = _qkv(2)
  D = q.shape[-1]
  cfg = A.AttentionConfig(layers=(), temperature=1.0)
  focal = ops.focal_attention(q, k, v, scale=A.FAMILY[A.Variant.FOCAL].scale(cfg, D, None))
  softmax = ops.focal_attention(q, k, v, scale=D**-0.5)
  np.testing.assert_allclose(focal, softmax, rtol=1e-6)
  # t < 1 sharpens: the attention entropy drops.
  sharp = A.FAMILY[A.Variant.FOCAL].scale(A.AttentionConfig(layers=(), temperature=0.4), D, None)
  assert sharp == pytest.approx(1 / (0.4 * D**0.5))


def test_dilution_of_uniform_softmax_is_not_softmax():
  q, k, v = _qkv(3)
  a = ops.dilution_attention(q, k, v)
  b = ops.focal_attention(q, k, v, scale=q.shape[-1] ** -0.5)
  assert not np.allclose(a, b, atol=1e-3)
  np.testing.assert_allclose(a[:, 0], jnp.repeat(v[:, 0], 2, axis=1), rtol=1e-5)  # row 0 sees only key 0


def test_dilution_checkpoint_rows_change_memory_not_values():
  """model.attention.checkpoint_rows reaches the Pallas op: a checkpoint every 64 rows (4 super-
  blocks at T = 256) gives the default's output and gradients; the kernels refuse a bad value."""
  q, k, v = _qkv(4, B=1, T=256, N=2, K=1, D=64)
  w = jax.random.normal(jax.random.key(5), q.shape)

  def loss(rows, q, k, v):
    spec = A.LayerSpec(A.Variant.DILUTION, A.Position.NONE)
    cfg = A.AttentionConfig(layers=(spec,), implementation="pallas", checkpoint_rows=rows)
    return (A.FAMILY[spec.variant].attend(cfg, q, k, v, 0.125, None) * w).sum()

  want, got = (jax.value_and_grad(functools.partial(loss, r), (0, 1, 2))(q, k, v)
               for r in (None, 64))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
  with pytest.raises(ValueError, match="ckpt_rows=100 must be a power of two"):
    ops.dilution_attention(q, k, v, implementation="pallas", checkpoint_rows=100)


@pytest.mark.parametrize("mode", ["causal", "token", "sequence"])
def test_learned_tau_modes(mode):
  cfg = A.AttentionConfig(layers=(), learned=True, tau_mean=A.TauMean(mode), tau_min=5.0,
                          tau_max=10.0, tau_init=7.5)
  a = jnp.array([[1.0, -1.0, 2.0, 0.5, 0.5, -2.0]])
  seg = jnp.array([[1, 1, 1, 2, 2, 2]])
  tau = M.learned_tau(a, cfg, seg)
  want = {"token": a[0],
          "causal": jnp.array([1.0, 0.0, 2 / 3, 0.5, 0.5, -1 / 3]),
          "sequence": jnp.array([2 / 3] * 3 + [-1 / 3] * 3)}[mode]
  np.testing.assert_allclose(tau[0], jnp.clip(want + 7.5, 5.0, 10.0), rtol=1e-6)
  if mode != "sequence":  # causal modes: τ_t never depends on later tokens
    g = jax.grad(lambda a: M.learned_tau(a, cfg, seg)[0, 1])(a)
    np.testing.assert_array_equal(g[0, 2:], 0)


def test_learned_tau_gets_gradient_at_init():
  from flax import nnx
  ac = A.AttentionConfig(layers=A.parse_pattern("focal", 2), learned=True)
  cfg = M.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=4,
                      head_dim=8, d_ff=64, max_seq_len=16, attention=ac)
  model = M.Transformer(cfg, nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  params = nnx.to_pure_dict(state)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)

  def loss(p):
    return nnx.merge(graphdef, p)(tokens).mean()
  g = jax.grad(loss)(params)
  for i in range(2):
    assert float(jnp.abs(g["blocks"][i]["attn"]["w_tau"]).sum()) > 0


def test_pattern_parsing_and_errors():
  specs = A.parse_pattern("softmax:rope,dilution", 4)
  assert [s.variant.value for s in specs] == ["softmax", "dilution"] * 2
  assert [s.position.value for s in specs] == ["rope", "none"] * 2
  with pytest.raises(ValueError, match="unknown variant 'flash'"):
    A.parse_pattern("flash", 2)
  with pytest.raises(ValueError, match="unknown position mode 'alibi'"):
    A.parse_pattern("softmax:alibi", 2)



def test_sliding_window_sees_the_last_w_keys_and_keeps_the_temperature():
  """Query t sees keys t-W < s <= t: by gradient none further back; W >= T is plain causal; W = 1
  is v itself. A per-query focal scale still applies inside the window."""
  q, k, v = _qkv(3)
  scale = jax.random.uniform(jax.random.key(4), (2, 1, 12), minval=0.1, maxval=0.5)
  attend = functools.partial(ops.focal_attention, scale=scale)
  t, W = 9, 4
  for g in jax.grad(lambda k, v: attend(q, k, v, window=W)[:, t].sum(), argnums=(0, 1))(k, v):
    np.testing.assert_array_equal(g[:, : t - W + 1], 0)
    np.testing.assert_array_equal(g[:, t + 1:], 0)
    assert np.abs(g[:, t - W + 1: t + 1]).min(axis=(0, 2, 3)).all()
  np.testing.assert_allclose(attend(q, k, v, window=12), attend(q, k, v), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(attend(q, k, v, window=1), jnp.repeat(v, 2, axis=2), rtol=1e-6)
  assert np.abs(attend(q, k, v, window=W) - ops.focal_attention(q, k, v, scale=0.3, window=W)
                ).max() > 1e-3


def test_sliding_window_is_refused_for_dilution_layers():
  c = base.get_config("pattern=softmax:rope,dilution:none")
  c.model.sliding_window = 16
  with pytest.raises(config_lib.ConfigError, match="model.sliding_window: 16 needs softmax/focal"):
    config_lib.validate(c)
  c.model.attention.pattern = "focal"
  config_lib.validate(c)
