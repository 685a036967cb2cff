"""pallas_kernels/glue/norm_rope.py: the QK-norm + RoPE forward kernel against its reference and the
backward kernel against autodiff of the reference (dx and the gain's gradient), fp32 and bf16,
head dims 64/128 and a row count that needs padding; in interpret mode on CPU and compiled
(Triton) on a GPU.

Run: python -m pytest -q tests/kernels/glue/test_norm_rope.py   (GPU only: -m gpu)
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.glue import norm_rope as nr

ON_GPU = jax.default_backend() == "gpu"


def _rel(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _compare(seed, R, N, D, dtype, *, interpret):
  """Each pass at its own default tile: what the model runs."""
  ks = jax.random.split(jax.random.key(seed), 4)
  x = (3 * jax.random.normal(ks[0], (R, N, D))).astype(dtype)
  scale = 1 + 0.1 * jax.random.normal(ks[1], (D,))
  angle = 60 * jax.random.uniform(ks[2], (R, D // 2))  # many periods: every sign of cos/sin
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  g = jax.random.normal(ks[3], (R, N, D)).astype(dtype)
  ref = lambda x, s: nr.norm_rope_reference(x, s, cos, sin, 1e-5).astype(jnp.float32)  # noqa: E731
  _, vjp = jax.vjp(ref, x, scale)
  want_dx, want_ds = vjp(g.astype(jnp.float32))
  y = nr.norm_rope_fwd(x, scale, cos, sin, eps=1e-5, interpret=interpret)
  want_y = nr.norm_rope_reference(x, scale, cos, sin, 1e-5)
  assert y.dtype == dtype and y.shape == x.shape
  # bf16: the kernel and the reference may round a value either way (one bf16 ulp, 2^-8).
  assert _rel(y, want_y) < (1e-6 if dtype == jnp.float32 else 4e-3), _rel(y, want_y)
  dx, ds = nr.norm_rope_bwd(x, scale, cos, sin, g, eps=1e-5, interpret=interpret)
  assert dx.dtype == dtype and ds.dtype == jnp.float32 and ds.shape == (D,)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  assert _rel(dx, want_dx) < tol and _rel(ds, want_ds) < tol, (_rel(dx, want_dx),
                                                              _rel(ds, want_ds))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("R, N, D", [(128, 3, 64), (100, 2, 128), (12, 2, 16)])
def test_matches_autodiff_of_the_reference(R, N, D, dtype):
  # 100 rows: blocks of 4 would divide them, so the kernel pads to blocks of 8; 12 rows: 4 again;
  # 128 rows: whole blocks of either pass's tile.
  _compare(0, R, N, D, dtype, interpret=True)


def test_bad_shapes_name_the_field():
  x = jnp.zeros((8, 2, 16))
  with pytest.raises(ValueError, match="cos/sin"):
    nr.norm_rope_bwd(x, jnp.ones(16), jnp.zeros((8, 4)), jnp.zeros((8, 4)), x, eps=1e-5,
                     interpret=True)
  with pytest.raises(ValueError, match="D=15"):
    x = jnp.zeros((8, 2, 15))
    nr.norm_rope_bwd(x, jnp.ones(15), jnp.zeros((8, 7)), jnp.zeros((8, 7)), x, eps=1e-5,
                     interpret=True)
  with pytest.raises(ValueError, match="norm_rope_fwd: want cos/sin"):
    nr.norm_rope_fwd(jnp.zeros((8, 2, 16)), jnp.ones(16), jnp.zeros((8, 4)), jnp.zeros((8, 4)),
                     eps=1e-5, interpret=True)
  with pytest.raises(ValueError, match="want g"):
    nr.norm_rope_bwd(jnp.zeros((8, 2, 16)), jnp.ones(16), jnp.zeros((8, 8)), jnp.zeros((8, 8)),
                     jnp.zeros((8, 3, 16)), eps=1e-5, interpret=True)


@pytest.mark.parametrize("D", [64, 128])
def test_lowers_to_triton(D):
  """The kernel lowers through Pallas' Triton backend for CUDA (no GPU needed; PTX is not
  compiled): the half-row slices, row and column reductions and 1-D stores are all expressible."""
  sds = jax.ShapeDtypeStruct
  x, t = sds((4096, 8, D), jnp.bfloat16), sds((4096, D // 2), jnp.float32)
  fn = lambda x, s, c, sn, g: nr.norm_rope_bwd(x, s, c, sn, g, eps=1e-5)  # noqa: E731
  text = jax.jit(fn).trace(x, sds((D,), jnp.float32), t, t, x).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text and 'name = "norm_rope_bwd"' in text, text[:2000]
  fn = lambda x, s, c, sn: nr.norm_rope_fwd(x, s, c, sn, eps=1e-5)  # noqa: E731
  text = jax.jit(fn).trace(x, sds((D,), jnp.float32), t, t).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text and 'name = "norm_rope_fwd"' in text, text[:2000]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the compiled Triton kernel needs a GPU")
class TestCompiledGPU:

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
  @pytest.mark.parametrize("R, N, D", [(16384, 16, 128), (4096, 8, 64), (1000, 4, 128)])
  def test_matches_autodiff_of_the_reference(self, R, N, D, dtype):
    _compare(1, R, N, D, dtype, interpret=False)
