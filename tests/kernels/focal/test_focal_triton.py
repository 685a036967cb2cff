"""The Triton focal attention (`focal_attention(backend="triton")`, a differentiable temperature)
== reference.attention.

Invariant: the kernel's output and its gradients to q, k, v and an array `scale` equal the pure-JAX
spec (`pallas_kernels.focal.reference.attention`) on fresh random inputs, for causal / non-causal,
packed segments, GQA, float and array temperatures, and several block shapes; the "tpu" backend
likewise under the TPU interpreter. On CPU the kernels run in Pallas interpret mode;
`TestCompiledGPU` repeats the comparison compiled (Triton) when jax.default_backend() == "gpu".
`test_lowers_to_triton` checks, without a GPU, that every kernel lowers through Pallas' Triton
backend for CUDA (what a GPU will compile).

Run: python -m pytest -q tests/kernels/focal/test_focal_triton.py   (GPU only: -k Compiled)
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.focal as focal
from pallas_kernels.focal import reference

ON_GPU = jax.default_backend() == "gpu"
SMALL = focal.BlockSizes(32, 32, 32, 32, 32, 32)
# Mixed tile shapes exercise the causal block-range arithmetic when block_q != block_kv.
MIXED = focal.BlockSizes(block_q=64, block_kv=32, block_q_dkv=32, block_kv_dkv=64,
                         block_q_dq=64, block_kv_dq=32)
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}  # max|err| / max|ref|


@pytest.fixture(autouse=True)
def _strict_ranks():
  with jax.numpy_rank_promotion("raise"):
    yield


def _inputs(seed, *, B, T, S, N, K, D, dtype, scale, segments):
  kq, kk, kv, ks, kseg, kdo = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(kq, (B, T, N, D), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (B, S, K, D), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (B, S, K, D), jnp.float32).astype(dtype)
  if scale == "float":
    s = 0.7 * D**-0.5
  else:  # a positive temperature of the given broadcast shape, spread over ~e^±1
    shape = {"BNT": (B, N, T), "B11": (B, 1, 1)}[scale]
    s = D**-0.5 * jnp.exp(0.5 * jax.random.normal(ks, shape, jnp.float32))
  seg = None
  if segments:  # random packed documents: ~T/24 boundaries per row
    starts = jax.random.bernoulli(kseg, 1 / 24, (B, T))
    seg = jnp.cumsum(starts, axis=1).astype(jnp.int32)
  do = jax.random.normal(kdo, (B, T, N, D), jnp.float32).astype(dtype)
  return q, k, v, s, seg, do


def _out_and_grads(attend, q, k, v, s, do):
  """(out, dq, dk, dv[, d_scale]) via jax.vjp; a float scale is closed over (no cotangent)."""
  if isinstance(s, float):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, s), q, k, v)
  else:
    out, vjp = jax.vjp(attend, q, k, v, s)
  return (out,) + vjp(do)


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _compare(seed, *, causal, dtype, scale, segments, B=2, T=128, S=None, N=4, K=2, D=64,
             blocks=SMALL, interpret=True):
  S = T if S is None else S
  q, k, v, s, seg, do = _inputs(seed, B=B, T=T, S=S, N=N, K=K, D=D, dtype=dtype, scale=scale,
                                segments=segments)

  def kernel(q, k, v, s):
    return focal.focal_attention(q, k, v, scale=s, causal=causal, segment_ids=seg,
                                 interpret=interpret, block_sizes=blocks)

  def spec(q, k, v, s):
    return reference.attention(q, k, v, scale=s, causal=causal, segment_ids_BT=seg)

  # One jit per side (compiling the whole vjp once beats op-by-op dispatch in interpret mode);
  # `s` is closed over so a Python-float scale stays a float.
  got = jax.jit(lambda q, k, v, do: _out_and_grads(kernel, q, k, v, s, do))(q, k, v, do)
  with jax.default_matmul_precision("highest"):  # the GPU reference must not use TF32 either
    want = jax.jit(lambda q, k, v, do: _out_and_grads(spec, q, k, v, s, do))(q, k, v, do)
  names = ["out", "dq", "dk", "dv", "d_scale"]
  assert got[0].dtype == q.dtype and got[0].shape == q.shape
  if not isinstance(s, float):
    assert got[4].shape == jnp.shape(s)
  errs = {n: _rel_err(g, w) for n, g, w in zip(names, got, want)}
  bad = {n: e for n, e in errs.items() if not e <= TOL[dtype]}
  assert not bad, f"relative errors above {TOL[dtype]}: {bad} (all: {errs})"


CASES = [
    # (causal, dtype, scale, segments, extra kwargs); default B=2, T=S=128, Hq=4, Hkv=2, D=64
    (True, jnp.float32, "BNT", False, {}),
    (False, jnp.float32, "B11", True, {}),
    (True, jnp.float32, "float", True, dict(N=4, K=1)),                    # MQA
    (True, jnp.float32, "BNT", True, dict(blocks=MIXED)),
    (False, jnp.float32, "BNT", False, dict(N=2, K=2, T=64, S=128, blocks=MIXED)),  # MHA, T != S
    (True, jnp.float32, "B11", False, dict(B=1, T=64, S=128, D=128)),      # causal T != S: s <= t
    (True, jnp.bfloat16, "BNT", True, dict(B=1, T=64, D=256)),
    (False, jnp.float16, "float", False, {}),
]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_matches_reference_interpret(i):
  causal, dtype, scale, segments, kw = CASES[i]
  _compare(100 + i, causal=causal, dtype=dtype, scale=scale, segments=segments, **kw)


@pytest.mark.parametrize("kwargs, match", [
    (dict(T=96), "multiple of block_q"),                       # 96 % 64 (clipped 128->96: not 2^k)
    (dict(T=48), "powers of two"),
    (dict(D=48), "head dim"),
    (dict(dtype_k=jnp.bfloat16), "share one dtype"),
    (dict(S=128, segments=True), "T == S"),
])
def test_contract_violations_raise(kwargs, match):
  T, S, D = kwargs.get("T", 64), kwargs.get("S", kwargs.get("T", 64)), kwargs.get("D", 64)
  q = jnp.zeros((1, T, 2, D), jnp.float32)
  k = jnp.zeros((1, S, 2, D), kwargs.get("dtype_k", jnp.float32))
  seg = jnp.zeros((1, T), jnp.int32) if kwargs.get("segments") else None
  blocks = focal.BlockSizes(64, 64, 64, 64, 64, 64)
  with pytest.raises(ValueError, match=match):
    focal.focal_attention(q, k, k, scale=0.1, causal=True, segment_ids=seg, interpret=True,
                          block_sizes=blocks)


@pytest.mark.parametrize("T, S", [(56, 56), (64, 64), (96, 96), (128, 100), (16, 16), (8, 8),
                                  (192, 192), (256, 64)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tiles_fit_is_what_the_kernel_accepts(T, S, dtype):
  q, k = jnp.zeros((1, T, 2, 64), dtype), jnp.zeros((1, S, 2, 64), dtype)
  try:
    focal.focal_attention(q, k, k, scale=0.1, causal=False, interpret=True)
    accepted = True
  except ValueError:
    accepted = False
  assert focal.tiles_fit(T, S, 64, dtype) == accepted


def test_bad_scale_shape_raises():
  q = jnp.zeros((1, 64, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match="scale"):
    focal.focal_attention(q, q, q, scale=jnp.ones((3,)), interpret=True)


@pytest.mark.parametrize("dtype, causal, segments, D", [
    (jnp.bfloat16, True, True, 128), (jnp.bfloat16, True, False, 64),
    (jnp.float16, False, False, 256), (jnp.float32, False, True, 128)])
def test_lowers_to_triton(dtype, causal, segments, D):
  """Forward + backward lower through Pallas' Triton backend for CUDA (no GPU needed): catches
  primitives the Triton lowering lacks before the H200 sees them. PTX compilation is not run."""
  B, T, N, K = 1, 512, 4, 2
  q = jax.ShapeDtypeStruct((B, T, N, D), dtype)
  k = jax.ShapeDtypeStruct((B, T, K, D), dtype)
  s = jax.ShapeDtypeStruct((B, N, T), jnp.float32)
  seg = jax.ShapeDtypeStruct((B, T), jnp.int32) if segments else None

  def loss(q, k, v, s, seg):
    out = focal.focal_attention(q, k, v, scale=s, causal=causal, segment_ids=seg)
    return jnp.sum(out.astype(jnp.float32))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  text = grad.trace(q, k, k, s, seg).lower(lowering_platforms=("cuda",)).as_text()
  names = set(re.findall(r'name = "(focal_flash_[a-z]+)"', text))
  assert names == {"focal_flash_fwd", "focal_flash_dkv", "focal_flash_dq"}, names


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="TPU interpreter check runs on CPU")
def test_tpu_backend_in_tpu_interpret_mode():
  """backend="tpu" (jax's Pallas TPU flash attention, temperature folded into q) under the TPU
  interpreter on CPU: checks the glue, not Mosaic TPU compilation."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=import-outside-toplevel
  q, k, v, s, seg, do = _inputs(11, B=1, T=128, S=128, N=2, K=1, D=64, dtype=jnp.float32,
                                scale="BNT", segments=True)
  with pltpu.force_tpu_interpret_mode():
    got = _out_and_grads(lambda q, k, v, s: focal.focal_attention(
        q, k, v, scale=s, causal=True, segment_ids=seg, backend="tpu"), q, k, v, s, do)
  want = _out_and_grads(lambda q, k, v, s: reference.attention(
      q, k, v, scale=s, causal=True, segment_ids_BT=seg), q, k, v, s, do)
  for g, w in zip(got, want):
    assert _rel_err(g, w) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled Triton kernels need jax.default_backend()=='gpu'")
class TestCompiledGPU:
  """The same comparisons compiled through Triton: the CASES tiles, then the default tiles."""

  @pytest.mark.parametrize("i", range(len(CASES)))
  def test_matches_reference_small_blocks(self, i):
    causal, dtype, scale, segments, kw = CASES[i]
    _compare(200 + i, causal=causal, dtype=dtype, scale=scale, segments=segments,
             interpret=False, **kw)

  @pytest.mark.parametrize("D", [64, 128, 256])
  @pytest.mark.parametrize("dtype, causal, segments", [
      (jnp.bfloat16, True, False), (jnp.bfloat16, True, True), (jnp.float32, False, False)])
  def test_matches_reference_default_blocks(self, D, dtype, causal, segments):
    _compare(300 + D, causal=causal, dtype=dtype, scale="BNT", segments=segments, B=2, T=1024,
             N=8, K=2, D=D, blocks=None, interpret=False)
