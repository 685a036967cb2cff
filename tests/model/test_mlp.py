"""SwiGLU: swiglu_pallas's custom VJP (the Pallas passes, interpreted here) == autodiff of
silu(g)·u (values, both gradients, saturated gates), and the model's loss and gradients do not
depend on which implementation runs the activation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from focaljax.model import attention as A
from focaljax.model import decoder as M
from focaljax.model import mlp
from test_model import assert_same_loss_and_grads, force_glue, loss_and_grads


def _swiglu(g, u):
  return mlp.swiglu_pallas(g, u, True)


def _reference(g, u):
  return jax.nn.silu(g) * u


def _rel_err(got, want):
  got, want = got.astype(jnp.float32), want.astype(jnp.float32)
  return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def _inputs(dtype, shape=(2, 8, 48), scale=3.0):
  kg, ku, kd = jax.random.split(jax.random.key(0), 3)
  g = scale * jax.random.normal(kg, shape, jnp.float32)
  # Saturated gates in both directions: sigmoid → 0 or 1, exp(−g) overflows for g ≪ 0.
  g = g.at[..., :4].set(jnp.array([-30.0, 30.0, -100.0, 100.0]))
  u = jax.random.normal(ku, shape, jnp.float32)
  dh = jax.random.normal(kd, shape, jnp.float32)
  return g.astype(dtype), u.astype(dtype), dh.astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_pallas_matches_autodiff(dtype):
  """float32: equal to rounding. bfloat16: within bf16 rounding (the passes compute in float32 and
  round once; autodiff rounds inside the sigmoid and at each product). No NaN or inf anywhere."""
  g, u, dh = _inputs(dtype)
  out, vjp = jax.jit(lambda g, u: jax.vjp(_swiglu, g, u))(g, u)
  want, want_vjp = jax.vjp(_reference, g, u)
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  assert out.dtype == want.dtype == dtype
  assert _rel_err(out, want) <= tol, _rel_err(out, want)
  grads = vjp(dh)
  for got, ref in zip(grads, want_vjp(dh)):
    assert got.dtype == ref.dtype == dtype
    assert bool(jnp.isfinite(got.astype(jnp.float32)).all())
    assert _rel_err(got, ref) <= tol, _rel_err(got, ref)
  # Against float32 autodiff on the same (upcast) values, only the final rounding is left
  # (bf16 autodiff's d_gate is ~3x farther off: it also rounds inside).
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  truth, truth_vjp = jax.vjp(_reference, f32(g), f32(u))
  for got, ref in zip((out, *grads), (truth, *truth_vjp(f32(dh)))):
    assert _rel_err(got, ref) <= tol / 4, _rel_err(got, ref)


def test_swiglu_saturated_gates_exactly():
  """silu(g) → 0 and its slope → 0 for g ≪ 0; silu(g) → g and its slope → 1 for g ≫ 0."""
  g = jnp.array([-1e4, -100.0, -30.0, 30.0, 100.0, 1e4], jnp.float32)
  u = jnp.ones_like(g)
  out, vjp = jax.vjp(_swiglu, g, u)
  d_gate, d_up = vjp(jnp.ones_like(g))
  np.testing.assert_allclose(out, [0, 0, 0, 30, 100, 1e4], atol=1e-11, rtol=1e-6)
  np.testing.assert_allclose(d_gate, [0, 0, 0, 1, 1, 1], atol=1e-11, rtol=1e-6)
  np.testing.assert_allclose(d_up, out)


def test_swiglu_saves_only_gate_and_up():
  """The residuals are the two inputs, nothing derived: the backward recomputes the sigmoid."""
  g, u, _ = _inputs(jnp.bfloat16)
  _, vjp = jax.vjp(_swiglu, g, u)
  residuals = jax.tree.leaves(vjp)
  assert len(residuals) == 2 and all(r.shape == g.shape and r.dtype == g.dtype
                                     for r in residuals), residuals


def _cfg(**kw):
  ac = A.AttentionConfig(layers=A.parse_pattern("softmax:rope,dilution:none", 2))
  return M.ModelConfig(vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, d_ff=64, max_seq_len=16, attention=ac, **kw)


def test_model_is_the_same_with_the_swiglu_passes(monkeypatch):
  """Whole-model float32 loss and gradients with the activation through the Pallas passes ==
  autodiff of jax.nn.silu(gate) * up."""
  tokens = jax.random.randint(jax.random.key(9), (2, 12), 0, 96)
  want = loss_and_grads(M.Transformer(_cfg(), nnx.Rngs(7)), tokens)
  force_glue(monkeypatch, "pallas", ("swiglu",))
  calls, real = [], mlp.swiglu_pallas
  monkeypatch.setattr(mlp, "swiglu_pallas", lambda *a: calls.append(a) or real(*a))
  got = loss_and_grads(M.Transformer(_cfg(), nnx.Rngs(7)), tokens)
  assert calls   # the passes ran
  assert_same_loss_and_grads(want, got)
