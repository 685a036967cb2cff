"""pallas_kernels/glue/add_norm.py: the residual add + RMSNorm passes against their reference
(forward) and autodiff of it (backward: dh and the gain's gradient), fp32 and bf16, row counts
that split into whole and partial programs; errors naming the field; lowering to Triton;
compiled on a GPU.

Run: python -m pytest -q tests/kernels/glue/test_add_norm.py   (GPU only: -m gpu)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.glue import add_norm as K

ON_GPU = jax.default_backend() == "gpu"


def _rel(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _compare(seed, R, E, dtype, *, interpret):
  ks = jax.random.split(jax.random.key(seed), 5)
  x = (2 * jax.random.normal(ks[0], (R, E))).astype(dtype)
  d = jax.random.normal(ks[1], (R, E)).astype(dtype)
  scale = 1 + 0.1 * jax.random.normal(ks[2], (E,))
  gh = jax.random.normal(ks[3], (R, E)).astype(dtype)
  gy = jax.random.normal(ks[4], (R, E)).astype(dtype)
  h, y = K.add_norm_fwd(x, d, scale, eps=1e-5, interpret=interpret)
  want_h, want_y = K.add_norm_reference(x, d, scale, 1e-5)
  assert h.dtype == y.dtype == dtype and h.shape == y.shape == (R, E)
  np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(want_h, np.float32))
  # bf16: the kernel and the reference may round a value either way (one bf16 ulp, 2^-8).
  assert _rel(y, want_y) < (1e-6 if dtype == jnp.float32 else 4e-3), _rel(y, want_y)
  # The backward's spec: autodiff of the float32 norm of h (h is the add's rounded output).
  ref = lambda h, s: K.add_norm_reference(h, jnp.zeros_like(h), s, 1e-5)[1]  # noqa: E731
  _, vjp = jax.vjp(lambda h, s: ref(h.astype(jnp.float32), s), h, scale)
  dh_norm, want_ds = vjp(gy.astype(jnp.float32))
  want_dh = gh.astype(jnp.float32) + dh_norm
  dh, ds = K.add_norm_bwd(h, scale, gh, gy, eps=1e-5, interpret=interpret)
  assert dh.dtype == dtype and ds.dtype == jnp.float32 and ds.shape == (E,)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  assert _rel(dh, want_dh) < tol and _rel(ds, want_ds) < tol, (_rel(dh, want_dh),
                                                              _rel(ds, want_ds))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("R, E", [(256, 64), (100, 128), (7, 32)])
def test_matches_the_reference_and_its_autodiff(R, E, dtype):
  # 256 rows: two whole programs of 128; 100: programs of 4 rows (blocks of 2); 7: one row each.
  _compare(0, R, E, dtype, interpret=True)


def test_bad_inputs_name_the_field():
  x = jnp.zeros((8, 16))
  with pytest.raises(ValueError, match="one \\[R, E\\] shape"):
    K.add_norm_fwd(x, jnp.zeros((8, 32)), jnp.ones(16), eps=1e-5, interpret=True)
  with pytest.raises(ValueError, match="dtype"):
    K.add_norm_fwd(x, x.astype(jnp.bfloat16), jnp.ones(16), eps=1e-5, interpret=True)
  with pytest.raises(ValueError, match="g_y"):
    K.add_norm_bwd(x, jnp.ones(16), x, jnp.zeros((4, 16)), eps=1e-5, interpret=True)
  with pytest.raises(ValueError, match="E=48"):
    K.add_norm_fwd(jnp.zeros((8, 48)), jnp.zeros((8, 48)), jnp.ones(48), eps=1e-5)


@pytest.mark.parametrize("E", [1024, 2048])
def test_lowers_to_triton(E):
  """Both passes lower through Pallas' Triton backend for CUDA (no GPU needed; PTX is not
  compiled): whole-row blocks, the backward's row loop with its [E] carry."""
  sds = jax.ShapeDtypeStruct
  x, s = sds((4096, E), jnp.bfloat16), sds((E,), jnp.float32)
  for name, fn, args in (
      ("add_norm_fwd", lambda x, d, s: K.add_norm_fwd(x, d, s, eps=1e-5), (x, x, s)),
      ("add_norm_bwd", lambda h, s, gh, gy: K.add_norm_bwd(h, s, gh, gy, eps=1e-5),
       (x, s, x, x))):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and f'name = "{name}"' in text, text[:2000]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the compiled Triton kernels need a GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("R, E", [(16384, 2048), (4096, 1024), (1000, 512)])
def test_compiled_matches_the_reference_and_its_autodiff(R, E, dtype):
  _compare(1, R, E, dtype, interpret=False)
