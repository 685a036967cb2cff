"""The decoder: parameter count, cached generation == full forward, remat, NTK, logical axes,
the custom backward passes (RMSNorm, QK-norm + RoPE, the vocabulary projection) against autodiff,
and the model with the glue passes (QK-norm + RoPE, the residual add + RMSNorm) in Pallas against
the plain XLA path (interpreted on CPU, compiled on a GPU: -m gpu)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from focaljax import dispatch
from focaljax import sharding
from focaljax.model import attention as A
from focaljax.model import decoder as M
from focaljax.model import norm_rope

ON_GPU = jax.default_backend() == "gpu"


def _cfg(pattern="softmax", **kw):
  ac = A.AttentionConfig(layers=A.parse_pattern(pattern, kw.pop("num_layers", 2)),
                         learned=kw.pop("learned", False))
  base = dict(vocab_size=96, d_model=32, num_layers=len(ac.layers), num_heads=4, num_kv_heads=2,
              head_dim=8, d_ff=64, max_seq_len=16, attention=ac)
  base.update(kw)
  return M.ModelConfig(**base)


@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=True, qk_norm=True, qkv_bias=True),
                                dict(pattern="focal", learned=True, num_layers=3)])
def test_param_count_matches_formula(kw):
  cfg = _cfg(**kw)
  params = nnx.to_pure_dict(nnx.split(M.Transformer(cfg, nnx.Rngs(0)))[1])
  assert sum(x.size for x in jax.tree.leaves(params)) == M.param_count(cfg)


_LLAMA3 = M.Llama3Scaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64)


@pytest.mark.parametrize("pattern,learned,kw", [
    ("softmax:rope", False, {}), ("focal", True, {}), ("softmax:rope,dilution:none", False, {}),
    ("focal", True, dict(sliding_window=4, qkv_bias=True, rope_scaling=_LLAMA3))])
def test_cached_generation_reproduces_full_forward(pattern, learned, kw):
  window = kw.pop("sliding_window", None)
  cfg = _cfg(pattern, learned=learned, num_layers=2, qk_norm=True, **kw)
  cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention,
                                                               sliding_window=window))
  model = M.Transformer(cfg, nnx.Rngs(1))
  tokens = jax.random.randint(jax.random.key(2), (2, 14), 0, 96)
  full = model(tokens, rope_length=14)
  caches = model.init_cache(2, 14)
  logits, caches = model.forward_cached(tokens[:, :9], caches, 0, rope_length=14)
  outs = [logits]
  for t in range(9, 14):
    logits, caches = model.forward_cached(tokens[:, t:t + 1], caches, t, rope_length=14)
    outs.append(logits)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("policy", list(M.REMAT_POLICIES))
def test_remat_changes_nothing(policy):
  cfg = _cfg("softmax:rope,dilution:none")
  graphdef, state = nnx.split(M.Transformer(cfg, nnx.Rngs(3)))
  cfg_r = _cfg("softmax:rope,dilution:none", remat=True, remat_policy=policy)
  graphdef_r, _ = nnx.split(M.Transformer(cfg_r, nnx.Rngs(3)))
  params = nnx.to_pure_dict(state)
  tokens = jax.random.randint(jax.random.key(4), (2, 16), 0, 96)
  loss = lambda g, p: nnx.merge(g, p)(tokens).std()
  l0, g0 = jax.value_and_grad(lambda p: loss(graphdef, p))(params)
  l1, g1 = jax.value_and_grad(lambda p: loss(graphdef_r, p))(params)
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g0, g1)


def test_llama3_scaling_keeps_short_wavelengths_and_stretches_long_ones():
  """Wavelengths 2π/f under original/high_freq_factor (16 positions) keep f, those over
  original/low_freq_factor (64) get f/factor, and factor 1 changes nothing."""
  positions, D = jnp.ones((1, 1)), 64
  plain = jnp.arctan2(*M.rope_tables(positions, 10000.0, D)[::-1])[0, 0]
  scaled = jnp.arctan2(*M.rope_tables(positions, 10000.0, D, _LLAMA3)[::-1])[0, 0]
  wavelength = 2 * np.pi / plain
  np.testing.assert_allclose(scaled[wavelength < 16], plain[wavelength < 16], rtol=1e-6)
  np.testing.assert_allclose(scaled[wavelength > 64], plain[wavelength > 64] / 4, rtol=1e-6)
  middle = (wavelength > 16) & (wavelength < 64)
  assert middle.any() and (scaled[middle] < plain[middle]).all()
  assert (scaled[middle] > plain[middle] / 4).all()
  unit = dataclasses.replace(_LLAMA3, factor=1.0)
  np.testing.assert_allclose(M.rope_tables(positions, 10000.0, D, unit)[0],
                             M.rope_tables(positions, 10000.0, D)[0], rtol=1e-6)


def test_dynamic_ntk_only_past_trained_context():
  cfg = _cfg()
  assert M.rope_theta(cfg, 16) == cfg.rope_theta
  assert M.rope_theta(cfg, 64) == pytest.approx(cfg.rope_theta * 4 ** (8 / 6))


def test_causal_by_gradient_through_the_model():
  cfg = _cfg("softmax:rope,dilution:none,focal", learned=True, num_layers=3)
  model = M.Transformer(cfg, nnx.Rngs(5))
  graphdef, state = nnx.split(model)
  params = nnx.to_pure_dict(state)
  x = jax.random.normal(jax.random.key(6), (1, 12, 32))
  t = 6

  def f(x):
    m = nnx.merge(graphdef, params)
    pos = jnp.arange(12)[None]
    h = x
    for block in m.blocks:
      h = block(h, pos, None, 10000.0)
    return h[0, t].sum()
  g = jax.grad(f)(x)
  np.testing.assert_array_equal(g[0, t + 1:], 0)


def test_every_param_has_logical_axes_with_rules():
  cfg = _cfg("focal", learned=True, qk_norm=True, tie_embeddings=False)
  _, state = nnx.split(M.Transformer(cfg, nnx.Rngs(0)))
  axes = sharding.param_axes(state)
  flat = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
  shapes = jax.tree.leaves(nnx.to_pure_dict(state))
  assert len(flat) == len(shapes)
  for a, p in zip(flat, shapes):
    assert len(a) == p.ndim
    sharding.spec(tuple(a))  # raises if a name has no rule
  with pytest.raises(KeyError, match="no rule"):
    sharding.spec(("nonexistent",))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_matmul_gradients_match_autodiff(dtype):
  """head_matmul's custom backward (16-bit GEMMs for 16-bit activations) == autodiff of the float32
  einsum: exactly for float32, within bf16 rounding of the logit gradient for bfloat16."""
  kx, kw, kg = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(kx, (2, 8, 32), jnp.float32).astype(dtype)
  w = (0.2 * jax.random.normal(kw, (32, 50), jnp.float32)).astype(dtype)
  g = jax.random.normal(kg, (2, 8, 50), jnp.float32)
  plain = lambda x, w: jnp.einsum("BTE,EV->BTV", x, w, preferred_element_type=jnp.float32)
  out, vjp = jax.vjp(M.head_matmul, x, w)
  want_out, want_vjp = jax.vjp(plain, x, w)
  np.testing.assert_array_equal(out, want_out)
  assert out.dtype == jnp.float32
  tol = 0 if dtype == jnp.float32 else 2e-2
  for got, want in zip(vjp(g), want_vjp(g)):
    assert got.dtype == want.dtype == dtype
    err = jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32))
    assert err <= tol, err


def _all_eqns(jaxpr):
  """Every equation of a jaxpr and of the jaxprs nested in its equations' parameters."""
  for e in jaxpr.eqns:
    yield e
    for p in e.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _all_eqns(inner)


def test_logits_backward_has_no_float32_vocab_gemm():
  """With bf16 compute, no dot in the loss gradient takes a float32 [.., V] operand (XLA would run
  it in float32: the two largest GEMMs of a small model's backward)."""
  cfg = _cfg()
  graphdef, state = nnx.split(M.Transformer(cfg, nnx.Rngs(0)))
  tokens = jnp.zeros((2, 16), jnp.int32)

  def loss(state):
    model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(jnp.bfloat16), state))
    return model(tokens, dtype=jnp.bfloat16).sum()

  jaxpr = jax.make_jaxpr(jax.grad(loss))(state)
  V = cfg.vocab_size
  dots = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
  vocab_dots = [e for e in dots if any(V in v.aval.shape for v in e.invars)]
  assert vocab_dots, "expected the logit GEMMs in the jaxpr"
  assert all(v.aval.dtype == jnp.bfloat16 for e in vocab_dots for v in e.invars), vocab_dots


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(2, 8, 32), (3, 5, 2, 8), (4096, 3, 16)])
def test_rms_norm_backward_matches_autodiff(shape, dtype):
  """rms_norm's custom VJP (float32 throughout, the gain gradient summed in two stages: 4096·3
  rows take 1024-row blocks, 15 and 16 rows smaller ones) == autodiff of the same forward."""
  kx, ks, kg = jax.random.split(jax.random.key(5), 3)
  x = (3 * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
  scale = 1 + 0.1 * jax.random.normal(ks, shape[-1:], jnp.float32)
  g = jax.random.normal(kg, shape, jnp.float32).astype(dtype)
  out, vjp = jax.vjp(lambda x, s: M.rms_norm(x, s, 1e-5), x, scale)
  want, want_vjp = jax.vjp(lambda x, s: M._rms_norm(x, s, 1e-5), x, scale)  # pylint: disable=protected-access
  np.testing.assert_array_equal(out, want)
  # autodiff rounds the cotangent to x's dtype at the output cast as well; the custom VJP does not.
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  for got, ref in zip(vjp(g), want_vjp(g)):
    assert got.dtype == ref.dtype
    err = jnp.linalg.norm((got - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32))
    assert err <= tol, err


def _rel_err(got, want):
  got, want = got.astype(jnp.float32), want.astype(jnp.float32)
  return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
def test_qk_norm_rope_matches_the_separate_pair(D, dtype):
  """qk_norm_rope (one custom VJP, one Pallas pass each way, interpreted here) == autodiff of
  apply_rope(_rms_norm(x)): exactly up to float32 rounding, within bf16 rounding for bfloat16
  (the pair rounds between norm and rotation, the fused function only at the end). Positions are
  offset per row and θ NTK-scaled, so every frequency turns through many periods."""
  B, T, N, eps = 2, 12, 3, 1e-5
  kx, ks, kg = jax.random.split(jax.random.key(8), 3)
  x = (3 * jax.random.normal(kx, (B, T, N, D), jnp.float32)).astype(dtype)
  scale = 1 + 0.1 * jax.random.normal(ks, (D,), jnp.float32)
  g = jax.random.normal(kg, (B, T, N, D), jnp.float32).astype(dtype)
  positions_BT = jnp.array([[1000], [37]]) + jnp.arange(T)
  theta = 10000.0 * 4 ** (D / (D - 2))
  cos, sin = M.rope_tables(positions_BT, theta, D)
  rms = M._rms_norm  # pylint: disable=protected-access
  fused = lambda x, s: M.qk_norm_rope(x, s, cos, sin, eps, True)  # noqa: E731
  pair = lambda x, s: M.apply_rope(rms(x, s, eps), positions_BT, theta)  # noqa: E731
  out, vjp = jax.jit(lambda x, s: jax.vjp(fused, x, s))(x, scale)
  want, want_vjp = jax.vjp(pair, x, scale)
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  assert out.dtype == dtype and _rel_err(out, want) <= tol
  for got, ref in zip(vjp(g), want_vjp(g)):
    assert got.dtype == ref.dtype
    assert _rel_err(got, ref) <= tol, _rel_err(got, ref)


def loss_and_grads(model, tokens):
  """(loss, grads over the whole state) of a float32 model; the loss is the logits' std."""
  graphdef, state = nnx.split(model)
  loss = lambda st: nnx.merge(graphdef, st)(tokens).std()  # noqa: E731
  return jax.jit(jax.value_and_grad(loss))(state)


def assert_same_loss_and_grads(a, b):
  """Two backward implementations of one model give one training signal (test_mlp uses it)."""
  np.testing.assert_allclose(a[0], b[0], rtol=1e-6)
  for x, y in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1])):   # atol: see the norm test
    np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6)


def force_glue(monkeypatch, implementation, ops=dispatch.GLUE):
  """Makes dispatch.choose pick `implementation` for the glue ops named (on CPU, "pallas" runs
  the kernels in interpret mode)."""
  real = dispatch.choose
  monkeypatch.setattr(dispatch, "choose", lambda op, requested="auto", **kw: real(
      op, implementation if op in ops else requested, **kw))
  # The blocks' shared jit keeps its traces by shape: a fresh one for this test traces the
  # changed choice (monkeypatch puts the shared one back afterwards).
  shared = M._block_call
  monkeypatch.setattr(M, "_block_call", jax.jit(
      lambda *a, **k: shared.__wrapped__(*a, **k),
      static_argnames=("graphdef", "method", "policy", "static")))


def test_model_is_the_same_with_the_qk_norm_rope_passes(monkeypatch):
  """Whole-model float32 loss and gradients with QK-norm + RoPE through the Pallas passes ==
  the separate rms_norm and apply_rope; the passes run only in RoPE layers with QK-norm."""
  tokens = jax.random.randint(jax.random.key(9), (2, 12), 0, 96)
  pattern = "softmax:rope,dilution:none"
  want = loss_and_grads(M.Transformer(_cfg(pattern, qk_norm=True), nnx.Rngs(7)), tokens)
  force_glue(monkeypatch, "pallas", ("qk_norm_rope",))
  calls = []
  monkeypatch.setattr(M, "qk_norm_rope", lambda *a: calls.append(a) or norm_rope.qk_norm_rope(*a))
  assert_same_loss_and_grads(
      want, loss_and_grads(M.Transformer(_cfg(pattern, qk_norm=True), nnx.Rngs(7)), tokens))
  assert len(calls) == 2   # q and k of the RoPE layer, traced once
  loss_and_grads(M.Transformer(_cfg(pattern, qk_norm=False), nnx.Rngs(7)), tokens)
  assert len(calls) == 2


@pytest.mark.parametrize("kw", [dict(), dict(remat=True, qk_norm=True),
                                dict(pattern="focal", learned=True, num_layers=3)])
def test_model_is_the_same_with_the_add_norm_passes(kw, monkeypatch):
  """Whole-model float32 loss and gradients (every parameter, the norms' gains included) through
  the add + norm passes == the plain blocks: the deferred adds are the same sums."""
  tokens = jax.random.randint(jax.random.key(9), (2, 12), 0, 96)
  pattern = kw.pop("pattern", "softmax:rope,dilution:none")
  want = loss_and_grads(M.Transformer(_cfg(pattern, **kw), nnx.Rngs(7)), tokens)
  force_glue(monkeypatch, "pallas", ("add_norm",))
  got = loss_and_grads(M.Transformer(_cfg(pattern, **kw), nnx.Rngs(7)), tokens)
  assert_same_loss_and_grads(want, got)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the compiled Triton kernels need a GPU")
def test_compiled_model_is_the_same_with_the_add_norm_passes(monkeypatch):
  """As on CPU, but per parameter to a relative norm, with float32 matmuls at full precision:
  the GPU's reductions sum in another order than XLA's, and at default precision its float32
  GEMMs round their inputs to TF32, which turns those last-bit differences into 4e-5 of a
  gradient's norm."""
  tokens = jax.random.randint(jax.random.key(9), (2, 64), 0, 96)
  results = []
  for implementation in ("xla", "pallas"):
    force_glue(monkeypatch, implementation, ("add_norm",))
    with jax.default_matmul_precision("highest"):
      results.append(loss_and_grads(M.Transformer(_cfg("softmax:rope", d_model=64, head_dim=16,
                                                       max_seq_len=64), nnx.Rngs(7)), tokens))
  (l0, g0), (l1, g1) = results
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    assert _rel_err(a, b) < 1e-5, _rel_err(a, b)
