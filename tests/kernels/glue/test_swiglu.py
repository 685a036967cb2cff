"""pallas_kernels/glue/swiglu.py: the SwiGLU activation's forward and backward kernels against the
reference and its autodiff, fp32 and bf16, sizes that do and do not fill a tile, extreme gates;
in interpret mode on CPU, lowered to Triton for CUDA, and compiled on a GPU.

Run: python -m pytest -q tests/kernels/glue/test_swiglu.py   (GPU only: -m gpu)
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.glue import swiglu as sw

ON_GPU = jax.default_backend() == "gpu"


def _rel(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _compare(shape, dtype, *, interpret):
  kg, ku, kd = jax.random.split(jax.random.key(3), 3)
  g = (4 * jax.random.normal(kg, shape)).astype(dtype)
  g = g.at[..., :2].set(jnp.array([-200.0, 200.0], dtype))  # σ under/overflow stays finite
  u = jax.random.normal(ku, shape).astype(dtype)
  dh = jax.random.normal(kd, shape).astype(dtype)
  h = sw.swiglu_fwd(g, u, interpret=interpret)
  ref = lambda g, u: sw.swiglu_reference(g, u).astype(jnp.float32)  # noqa: E731
  want, vjp = jax.vjp(ref, g, u)
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  assert h.dtype == dtype and h.shape == shape and _rel(h, want) < tol
  dg, du = sw.swiglu_bwd(g, u, dh, interpret=interpret)
  want_dg, want_du = vjp(dh.astype(jnp.float32))
  assert dg.dtype == du.dtype == dtype and bool(jnp.isfinite(dg).all())
  assert _rel(dg, want_dg) < tol and _rel(du, want_du) < tol, (_rel(dg, want_dg),
                                                              _rel(du, want_du))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(2, 8, 1024), (3, 5, 344)])  # a whole tile; a padded one
def test_matches_the_reference_and_its_autodiff(shape, dtype):
  _compare(shape, dtype, interpret=True)


def test_shapes_must_agree():
  with pytest.raises(ValueError, match="one shape"):
    sw.swiglu_fwd(jnp.zeros((2, 8)), jnp.zeros((2, 4)), interpret=True)


def test_lowers_to_triton():
  """Both kernels lower through Pallas' Triton backend for CUDA (no GPU needed)."""
  x = jax.ShapeDtypeStruct((8, 2048, 5504), jnp.bfloat16)
  for fn, args, name in [(lambda g, u: sw.swiglu_fwd(g, u), (x, x), "swiglu_fwd"),
                         (lambda g, u, d: sw.swiglu_bwd(g, u, d), (x, x, x), "swiglu_bwd")]:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and f'name = "{name}"' in text


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the compiled Triton kernels need a GPU")
class TestCompiledGPU:

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
  @pytest.mark.parametrize("shape", [(8, 2048, 5504), (3, 5, 344)])
  def test_matches_the_reference_and_its_autodiff(self, shape, dtype):
    _compare(shape, dtype, interpret=False)
