"""focaljax/train/loss.py: the explicit cross-entropy against optax's (the spec), value and gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from focaljax.train import loss as L


@pytest.mark.parametrize("shape", [(2, 8, 50), (3, 37)])
def test_cross_entropy_matches_optax(shape):
  """loss.cross_entropy's value and logit gradient == optax's
  integer-label cross-entropy under autodiff (the spec), float32, on fresh random logits; and its
  backward has no scatter (the one-hot is an iota compare)."""
  kl, kt, kg = jax.random.split(jax.random.key(11), 3)
  logits = 4 * jax.random.normal(kl, shape, jnp.float32)
  targets = jax.random.randint(kt, shape[:-1], 0, shape[-1])
  g = jax.random.normal(kg, shape[:-1], jnp.float32)
  spec = L.CROSS_ENTROPIES["optax"]
  out, vjp = jax.vjp(lambda l: L.cross_entropy(l, targets), logits)
  want, want_vjp = jax.vjp(lambda l: spec(l, targets), logits)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(vjp(g)[0], want_vjp(g)[0], rtol=1e-5, atol=1e-6)
  jaxpr = jax.make_jaxpr(jax.grad(lambda l: L.cross_entropy(l, targets).sum()))(logits)
  assert "scatter" not in str(jaxpr)  # nested jaxprs print inline


def test_one_pass_logsumexp_handles_masked_entries():
  """-inf logits (a masked vocabulary) add nothing, even where a whole block of them is combined."""
  x = 10 * jax.random.normal(jax.random.key(12), (3, 1000), jnp.float32)
  x = x.at[0, :999].set(-jnp.inf).at[1, 500:].set(-jnp.inf)
  got = L._logsumexp_one_pass(x)  # pylint: disable=protected-access
  np.testing.assert_allclose(got, jax.nn.logsumexp(x, axis=-1), rtol=1e-6)
