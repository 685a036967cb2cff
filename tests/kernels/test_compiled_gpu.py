"""Every kernel compiled on the GPU against its reference: outputs and gradients, fresh inputs.

Invariant: each public entry point (the default tiles the model runs) agrees with its pure-JAX
reference on new random inputs, forward and through its custom VJP, in float32 and bfloat16
(the Mosaic kernels take 16-bit inputs only: bfloat16 and float16 there). Skipped off GPU.
Run: python -m pytest -q tests/kernels -k Compiled
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from focaljax import ops
import pallas_kernels.dilution as dilution
import pallas_kernels.focal as focal
from pallas_kernels.condense import api as condense
from pallas_kernels.condense import reference as condense_ref
from pallas_kernels.dilution import reference as dilution_ref
from pallas_kernels.focal import reference as focal_ref
from pallas_kernels.glue import add_norm as an
from pallas_kernels.glue import norm_rope as nr

ON_GPU = jax.default_backend() == "gpu"
ON_HOPPER = ON_GPU and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")
TOL = {jnp.float32: 2e-3, jnp.bfloat16: 3e-2, jnp.float16: 1e-2}   # ‖got − want‖ / ‖want‖
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def _rel(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def _normal(key, shape, dtype, scale=1.0):
  return (scale * jax.random.normal(key, shape)).astype(dtype)


def _check_fn_and_grads(kernel, reference, args, dtype, seed):
  """kernel(*args) vs reference(*f32 args), then their VJPs for one random cotangent."""
  args32 = [a.astype(jnp.float32) for a in args]
  got, vjp_got = jax.vjp(jax.jit(kernel), *args)
  want, vjp_want = jax.vjp(reference, *args32)
  assert got.dtype == dtype and got.shape == want.shape
  assert _rel(got, want) < TOL[dtype], ("out", _rel(got, want))
  g = _normal(jax.random.key(seed + 1), got.shape, dtype)
  for i, (a, b) in enumerate(zip(vjp_got(g), vjp_want(g.astype(jnp.float32)))):
    assert _rel(a, b) < TOL[dtype], (f"grad of argument {i}", _rel(a, b))


def _segments(B, T, n):
  return jnp.broadcast_to(jnp.repeat(jnp.arange(n, dtype=jnp.int32), T // n), (B, T))


def _qkv(seed, B, T, N, K, D, dtype):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (_normal(kq, (B, T, N, D), dtype), _normal(kk, (B, T, K, D), dtype),
          _normal(kv, (B, T, K, D), dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled kernels need a GPU")
class TestCompiledGPU:

  @pytest.mark.parametrize("backend, dtype, D", [
      ("triton", F32, 64), ("triton", BF16, 128),
      pytest.param("mosaic", BF16, 64, marks=pytest.mark.skipif(not ON_HOPPER, reason="Hopper")),
      pytest.param("mosaic", F16, 128, marks=pytest.mark.skipif(not ON_HOPPER, reason="Hopper")),
  ])
  @pytest.mark.parametrize("segments", [False, True])
  def test_focal(self, backend, dtype, D, segments):
    """Triton fwd/bwd; Mosaic fwd with the fused (D=64) and two-kernel (D=128) backward."""
    B, T, N, K = 2, 1024, 4, 2
    q, k, v = _qkv(11 + D, B, T, N, K, D, dtype)
    scale = D**-0.5 * (1 + 0.1 * jax.random.normal(jax.random.key(5), (B, N, T)))
    seg = _segments(B, T, 4) if segments else None
    kernel = lambda q, k, v, s: focal.focal_attention(  # noqa: E731
        q, k, v, scale=s, causal=True, segment_ids=seg, backend=backend)
    reference = lambda q, k, v, s: focal_ref.attention(  # noqa: E731
        q, k, v, scale=s, causal=True, segment_ids_BT=seg)
    _check_fn_and_grads(kernel, reference, [q, k, v, scale.astype(dtype)], dtype, 7)

  @pytest.mark.parametrize("segments", [False, True])
  def test_cudnn_sliding_window(self, segments):
    """A sliding window runs on cuDNN (local_window_size), packed rows and a per-query scale too."""
    B, T, N, K, D, W = 2, 1024, 4, 2, 64, 100
    q, k, v = _qkv(81, B, T, N, K, D, BF16)
    scale = D**-0.5 * (1 + 0.1 * jax.random.normal(jax.random.key(6), (B, N, T)))
    seg = _segments(B, T, 4) if segments else None
    attend = lambda impl: lambda q, k, v, s: ops.focal_attention(  # noqa: E731
        q, k, v, scale=s, segment_ids=seg, implementation=impl, window=W)
    _check_fn_and_grads(attend("cudnn"), attend("xla"), [q, k, v, scale.astype(BF16)], BF16, 12)

  @pytest.mark.parametrize("backend, dtype, D", [
      ("triton", F32, 64), ("triton", BF16, 128),
      pytest.param("mosaic", BF16, 64, marks=pytest.mark.skipif(not ON_HOPPER, reason="Hopper")),
      pytest.param("mosaic", BF16, 128, marks=pytest.mark.skipif(not ON_HOPPER, reason="Hopper")),
  ])
  @pytest.mark.parametrize("segments", [False, True])
  def test_dilution(self, backend, dtype, D, segments):
    """All four training passes of the backend, through the custom VJP."""
    B, T, N, K = 2, 1024, 4, 2
    q, k, v = _qkv(21 + D, B, T, N, K, D, dtype)
    seg = _segments(B, T, 2) if segments else None
    kernel = lambda q, k, v: dilution.dilution_attention(  # noqa: E731
        q, k, v, scale=D**-0.5, eps=1e-6, segment_ids=seg, backend=backend)
    reference = lambda q, k, v: dilution_ref.dilution_attention(  # noqa: E731
        q, k, v, scale=D**-0.5, eps=1e-6, segment_ids_BT=seg)[0]
    _check_fn_and_grads(kernel, reference, [q, k, v], dtype, 8)

  @pytest.mark.parametrize("backend", ["triton", pytest.param(
      "mosaic", marks=pytest.mark.skipif(not ON_HOPPER, reason="Hopper"))])
  @pytest.mark.parametrize("dtype", [F32, BF16])
  def test_dilution_prefill_and_decode(self, backend, dtype):
    """Prefill (F1 + F2) and one decode step; forward only (neither is differentiable)."""
    B, T, S_max, N, K, D = 2, 512, 1024, 4, 2, 64
    q, k, v = _qkv(31, B, S_max, N, K, D, dtype)
    kw = dict(scale=D**-0.5, eps=1e-6)
    out, demand = jax.jit(lambda q, k, v: dilution.dilution_prefill(
        q, k, v, backend=backend, **kw))(q[:, :T], k[:, :T], v[:, :T])
    want_out, want_demand = dilution_ref.dilution_attention(q[:, :T], k[:, :T], v[:, :T], **kw)
    assert _rel(out, want_out) < TOL[dtype] and _rel(demand, want_demand) < TOL[dtype]
    demand_max = jnp.zeros((B, N, S_max), jnp.float32).at[:, :, :T].set(want_demand)
    length = jnp.full((B,), T + 1, jnp.int32)
    got = jax.jit(lambda *a: dilution.dilution_decode_step(*a, **kw))(
        q[:, T], k, v, demand_max, length)
    want = dilution_ref.dilution_decode_step(q[:, T], k, v, demand_max, length, **kw)
    for a, b in zip(got, want):
      assert _rel(a, b) < TOL[dtype], _rel(a, b)

  @pytest.mark.parametrize("dtype", [F32, BF16])
  def test_condense_candidate(self, dtype):
    R, Q, S, N, K, D = 4, 8, 700, 4, 2, 64
    ks = jax.random.split(jax.random.key(41), 6)
    q, k, v = (_normal(ks[0], (R, Q, N, D), dtype), _normal(ks[1], (R, S, K, D), dtype),
               _normal(ks[2], (R, S, K, D), dtype))
    sk, sv = _normal(ks[3], (R, Q, K, D), dtype), _normal(ks[4], (R, Q, K, D), dtype)
    vlen = jax.random.randint(ks[5], (R, Q), 0, S + 1)
    kernel = lambda q, k, v, sk, sv: condense.candidate_attention(  # noqa: E731
        q, k, v, vlen, sk, sv, scale=D**-0.5)
    reference = lambda q, k, v, sk, sv: condense_ref.candidate_attention_reference(  # noqa: E731
        q, k, v, vlen, sk, sv, scale=D**-0.5)
    _check_fn_and_grads(kernel, reference, [q, k, v, sk, sv], dtype, 9)

  @pytest.mark.parametrize("dtype", [F32, BF16])
  def test_condense_local(self, dtype):
    R, T, C, N, K, D = 4, 256, 40, 4, 2, 64
    ks = jax.random.split(jax.random.key(51), 5)
    args = [_normal(ks[0], (R, T, N, D), dtype), _normal(ks[1], (R, T, K, D), dtype),
            _normal(ks[2], (R, T, K, D), dtype), _normal(ks[3], (R, C, K, D), dtype),
            _normal(ks[4], (R, C, K, D), dtype)]
    _check_fn_and_grads(lambda *a: condense.local_attention(*a, scale=D**-0.5),
                        lambda *a: condense_ref.local_attention_reference(*a, scale=D**-0.5),
                        args, dtype, 10)

  @pytest.mark.parametrize("dtype", [F32, BF16])
  def test_add_norm(self, dtype):
    """The forward pass's (h, y) and the backward pass against autodiff of the reference."""
    R, E = 4096, 2048
    ks = jax.random.split(jax.random.key(61), 5)
    x, d = _normal(ks[0], (R, E), dtype), _normal(ks[1], (R, E), dtype)
    s = 1 + 0.1 * jax.random.normal(ks[2], (E,))
    gh, gy = _normal(ks[3], (R, E), dtype), _normal(ks[4], (R, E), dtype)
    h, y = jax.jit(lambda *a: an.add_norm_fwd(*a, eps=1e-6))(x, d, s)
    want_h, want_y = an.add_norm_reference(x, d, s, 1e-6)
    assert _rel(h, want_h) < TOL[dtype] and _rel(y, want_y) < TOL[dtype]
    ref32 = lambda h, s: an.add_norm_reference(h, jnp.zeros_like(h), s, 1e-6)  # noqa: E731
    _, vjp = jax.vjp(ref32, h.astype(jnp.float32), s)
    want_dh, want_ds = vjp((gh.astype(jnp.float32), gy.astype(jnp.float32)))
    dh, ds = jax.jit(lambda *a: an.add_norm_bwd(*a, eps=1e-6))(h, s, gh, gy)
    assert _rel(dh, want_dh) < TOL[dtype] and _rel(ds, want_ds) < TOL[dtype]

  @pytest.mark.parametrize("dtype", [F32, BF16])
  def test_norm_rope(self, dtype):
    R, N, D = 4096, 8, 128
    ks = jax.random.split(jax.random.key(71), 4)
    x, g = _normal(ks[0], (R, N, D), dtype, 3.0), _normal(ks[1], (R, N, D), dtype)
    s = 1 + 0.1 * jax.random.normal(ks[2], (D,))
    angle = 60 * jax.random.uniform(ks[3], (R, D // 2))
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    y = jax.jit(lambda *a: nr.norm_rope_fwd(*a, eps=1e-5))(x, s, cos, sin)
    assert _rel(y, nr.norm_rope_reference(x, s, cos, sin, 1e-5)) < TOL[dtype]
    ref32 = lambda x, s: nr.norm_rope_reference(x, s, cos, sin, 1e-5)  # noqa: E731
    _, vjp = jax.vjp(ref32, x.astype(jnp.float32), s)
    want_dx, want_ds = vjp(g.astype(jnp.float32))
    dx, ds = jax.jit(lambda *a: nr.norm_rope_bwd(*a, eps=1e-5))(x, s, cos, sin, g)
    assert _rel(dx, want_dx) < TOL[dtype] and _rel(ds, want_ds) < TOL[dtype]
