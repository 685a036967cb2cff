"""The Hopper Mosaic GPU focal attention (`mosaic`, fused temperature) == reference.attention.

Invariants: on fresh random inputs the kernel's output equals `reference.attention` and its lse
equals log2 Σ_s exp2(log2(e)·scale·q·k) over the visible keys, for causal / non-causal, GQA,
bf16 / fp16, D = 64 / 128, float and per-query temperatures, packed segment ids (three documents
of uneven lengths per row: no query sees another document); gradients through the custom_vjp
(with the Mosaic backward) equal the reference's; every output element is written
(interpret mode fills fresh buffers with NaN); the interpreter's race detector stays quiet;
`supported` names the reason for every input it rejects; `focal_attention(backend="mosaic")`
routes what `supported` accepts here and the rest to the Triton kernels; the kernel lowers to
Mosaic GPU for CUDA without a GPU. On CPU the kernel runs in GPU interpret mode (threads, TMA,
barriers simulated; wgmma replaced by jnp matmuls, see mosaic_common). `TestCompiledGPU` repeats
the comparison compiled at realistic shapes on a Hopper GPU.

Run: python -m pytest -q tests/kernels/focal/test_focal_mosaic.py              (CI subset)
     python -m pytest -q tests/kernels/focal/test_focal_mosaic.py -m slow      (the other cases)
     python -m pytest -q tests/kernels/focal/test_focal_mosaic.py -k Compiled  (Hopper GPU)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.focal as focal
from pallas_kernels.focal import api
from pallas_kernels.focal import mosaic
from pallas_kernels.focal import mosaic_bwd
from pallas_kernels.focal import mosaic_bwd_fused
from pallas_kernels.focal import reference
from tests.kernels import mosaic_interpret

ON_GPU = jax.default_backend() == "gpu"
ON_HOPPER = ON_GPU and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}  # ‖out − ref‖ / ‖ref‖
LSE_TOL = 2e-3  # max |lse − ref| in log2 units (GPU exp2/log run with approx_math)


@pytest.fixture(autouse=True)
def _strict_ranks():
  with jax.numpy_rank_promotion("raise"):
    yield


@pytest.fixture(scope="module")
def _fast_interpreter():
  with mosaic_interpret.cached_interpreter_threads():
    yield


def _inputs(seed, *, B, T, S, N, K, D, dtype, scale):
  kq, kk, kv, ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (B, T, N, D), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (B, S, K, D), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (B, S, K, D), jnp.float32).astype(dtype)
  if scale == "float":
    s = 0.7 * D**-0.5
  else:  # a positive temperature of the given broadcast shape, spread over ~e^±1
    shape = {"BNT": (B, N, T), "B11": (B, 1, 1)}[scale]
    s = D**-0.5 * jnp.exp(0.5 * jax.random.normal(ks, shape, jnp.float32))
  return q, k, v, s


def _packed_segment_ids(seed, B, T):
  """int32 [B, T]: three documents per row with random boundaries (almost surely inside tiles)
  and ids that differ between rows, as the data packer emits them."""
  rng = np.random.default_rng(seed)
  rows = [np.searchsorted(np.sort(rng.choice(np.arange(1, T), 2, replace=False)), np.arange(T),
                          side="right") + 3 * b for b in range(B)]
  return jnp.asarray(np.stack(rows), jnp.int32)


def _lse_reference(q, k, s_BNT, causal, seg_BT=None):
  """log2 Σ_s exp2(log2(e)·s_t·q_t·k_s) over visible keys, float32 [B, N, T]."""
  B, T, N, D = q.shape
  S, K = k.shape[1], k.shape[2]
  k_BSND = jnp.repeat(k, N // K, axis=2).astype(jnp.float32)
  logits = jnp.einsum("BTND,BSND->BNTS", q.astype(jnp.float32), k_BSND,
                      precision=jax.lax.Precision.HIGHEST) * s_BNT[..., None]
  vis = reference.visible_BTS(B, T, S, causal=causal, segment_ids_BT=seg_BT)[:, None]
  return jax.nn.logsumexp(jnp.where(vis, logits, -jnp.inf), axis=-1) / np.log(2.0)


def _rel_norm_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _compare(seed, *, causal, dtype, scale, B=1, T=256, S=None, N=4, K=2, D=64, blocks=None,
             interpret=True, segments=False):
  S = T if S is None else S
  q, k, v, s = _inputs(seed, B=B, T=T, S=S, N=N, K=K, D=D, dtype=dtype, scale=scale)
  seg = _packed_segment_ids(seed, B, T) if segments else None
  blocks = blocks or mosaic.BlockSizes.default(D, dtype)
  s_BNT = reference.scale_BNT(s, B, N, T)
  fwd = jax.jit(lambda q, k, v, s_BNT, seg: mosaic.forward(
      q, k, v, s_BNT, causal=causal, blocks=blocks, interpret=interpret, segment_ids=seg))
  out, lse = fwd(q, k, v, s_BNT, seg)
  if interpret:
    assert not mosaic_interpret.interpret_races_found(), "GPU interpreter reported a data race"
  # The public entry point (jit + custom_vjp) must give the same forward.
  out_api = mosaic.focal_attention(q, k, v, scale=s, causal=causal, segment_ids=seg,
                                       interpret=interpret, block_sizes=blocks)
  with jax.default_matmul_precision("highest"):  # the GPU reference must not use TF32
    want = reference.attention(q, k, v, scale=s, causal=causal, segment_ids_BT=seg)
    want_lse = _lse_reference(q, k, s_BNT, causal, seg)
  assert out.dtype == q.dtype and out.shape == q.shape
  assert lse.dtype == jnp.float32 and lse.shape == (B, N, T)
  # NaN here means an output tile was never written (fresh buffers are NaN-filled / poisoned).
  assert np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(np.asarray(lse)).all()
  np.testing.assert_array_equal(np.asarray(out_api, np.float32), np.asarray(out, np.float32))
  err = _rel_norm_err(out, want)
  assert err < TOL[dtype], f"‖out − ref‖/‖ref‖ = {err:.2e} > {TOL[dtype]}"
  lse_err = float(np.max(np.abs(np.asarray(lse) - np.asarray(want_lse))))
  assert lse_err < LSE_TOL, f"max |lse − ref| = {lse_err:.2e}"


# (causal, dtype, scale, kwargs); defaults B=1, T=S=256, Hq=4, Hkv=2, D=64, default blocks.
CI_CASES = [
    # Causal GQA with a 4-block K/V ring of 3 slots: wrap-around, diagonal and skipped blocks.
    (True, jnp.bfloat16, "BNT",
     dict(blocks=mosaic.BlockSizes(block_kv=64, max_concurrent_steps=3))),
    (False, jnp.float16, "float", dict(N=2, K=1, D=128)),  # MQA, default D=128 tiles
    # Packed documents on every visited block (diagonal or not), GQA, two rows, 3-slot ring.
    (True, jnp.bfloat16, "BNT", dict(B=2, segments=True,
                                     blocks=mosaic.BlockSizes(block_kv=64,
                                                                  max_concurrent_steps=3))),
]
SLOW_CASES = [
    (True, jnp.float16, "B11", dict(N=2, K=2, D=128)),  # MHA
    (False, jnp.bfloat16, "BNT", dict(T=128, S=384, N=2, K=1)),  # T != S, 3 kv blocks, 2 slots
    (True, jnp.bfloat16, "BNT", dict(T=384, S=256, N=2, K=1, D=128,
                                     blocks=mosaic.BlockSizes(block_kv=64))),  # causal T > S
    (True, jnp.float16, "float", dict(B=2, T=128, S=384, N=2, K=1)),  # causal T < S: s <= t
    (True, jnp.bfloat16, "BNT", dict(T=512, N=2, K=1,
                                     blocks=mosaic.BlockSizes(block_q=128, block_kv=64))),
    (False, jnp.float16, "float", dict(N=2, K=1, D=128, segments=True)),  # segments only
]


@pytest.mark.usefixtures("_fast_interpreter")
@pytest.mark.parametrize("i", range(len(CI_CASES)))
def test_matches_reference_interpret(i):
  causal, dtype, scale, kw = CI_CASES[i]
  _compare(100 + i, causal=causal, dtype=dtype, scale=scale, **kw)


@pytest.mark.slow
@pytest.mark.usefixtures("_fast_interpreter")
@pytest.mark.parametrize("i", range(len(SLOW_CASES)))
def test_matches_reference_interpret_slow(i):
  # deselected by pyproject's addopts unless the command line asks for them (-m slow).
  causal, dtype, scale, kw = SLOW_CASES[i]
  _compare(200 + i, causal=causal, dtype=dtype, scale=scale, **kw)


def _compare_grads(seed, *, interpret, B=1, T=256, N=2, K=1, D=64, dtype=jnp.bfloat16,
                   segments=False, block_sizes=None):
  """out and the vjp (dq, dk, dv, d_scale) of focal_attention (custom_vjp: this forward plus
  mosaic_bwd.backward or mosaic_bwd_fused.backward) against jax.vjp of the reference; causal,
  array temperature."""
  q, k, v, s = _inputs(seed, B=B, T=T, S=T, N=N, K=K, D=D, dtype=dtype, scale="BNT")
  seg = _packed_segment_ids(seed, B, T) if segments else None
  do = jax.random.normal(jax.random.key(seed + 1), q.shape, jnp.float32).astype(dtype)

  def out_and_grads(attend):
    out, vjp = jax.vjp(attend, q, k, v, s)
    return (out,) + vjp(do)

  got = jax.jit(lambda: out_and_grads(lambda q, k, v, s: mosaic.focal_attention(
      q, k, v, scale=s, causal=True, segment_ids=seg, interpret=interpret,
      block_sizes=block_sizes)))()
  with jax.default_matmul_precision("highest"):
    want = out_and_grads(lambda q, k, v, s: reference.attention(
        q, k, v, scale=s, causal=True, segment_ids_BT=seg))
  errs = {n: _rel_norm_err(g, w) for n, g, w in zip(["out", "dq", "dk", "dv", "ds"], got, want)}
  bad = {n: e for n, e in errs.items() if not e < 2 * TOL[dtype]}
  assert not bad, f"relative errors above {2 * TOL[dtype]}: {bad} (all: {errs})"


@pytest.mark.usefixtures("_fast_interpreter")
@pytest.mark.parametrize("segments", [pytest.param(False, marks=pytest.mark.slow), True])
def test_gradients_through_custom_vjp_interpret(segments):
  # With segments, the two-kernel backward: the fused one (D=64's default) with segment ids takes
  # ~10 min interpreted here; its own tests cover it (test_focal_mosaic_bwd_fused.py, interpreted
  # and compiled) and test_backward_kernel_choice the routing.
  blocks = mosaic.BlockSizes(max_concurrent_steps=3) if segments else None
  _compare_grads(150, interpret=True, segments=segments, block_sizes=blocks)


@pytest.mark.usefixtures("_fast_interpreter")
def test_out_lo_is_the_rounding_residual():
  """forward(out_lo=True) (dilution's F1 needs the float32 output) leaves out and lse as they
  were and adds out's rounding residual: at most half an ulp of out, and out + lo within float32
  rounding of out's float32 value, i.e. no further from the reference than out's own error."""
  q, k, v, s = _inputs(170, B=1, T=256, S=256, N=4, K=2, D=64, dtype=jnp.bfloat16, scale="BNT")
  seg = jnp.zeros((1, 256), jnp.int32)
  kw = dict(causal=True, blocks=None, interpret=True, segment_ids=seg)
  out, lse = mosaic.forward(q, k, v, s, **kw)
  out2, lse2, lo = mosaic.forward(q, k, v, s, out_lo=True, **kw)
  assert lo.dtype == out.dtype and lo.shape == out.shape
  np.testing.assert_array_equal(np.asarray(out2, np.float32), np.asarray(out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))
  out32, lo32 = np.asarray(out, np.float32), np.asarray(lo, np.float32)
  assert np.any(lo32 != 0)
  assert np.all(np.abs(lo32) <= 2.0**-8 * np.abs(out32) + 1e-30)


def _record_calls(monkeypatch):
  """Replaces both kernels' entries: returns the list of (kernel, kwargs) they were called with."""
  calls = []
  monkeypatch.setattr(mosaic, "focal_attention", lambda q, k, v, **kw: calls.append(
      ("mosaic", kw)) or jnp.zeros(q.shape, q.dtype))
  monkeypatch.setattr(api, "_attention", lambda q, k, v, scale, seg, **kw: calls.append(
      ("triton", dict(kw, segment_ids=seg))) or jnp.zeros(q.shape, q.dtype))
  return calls


def test_mosaic_backend_routes_segments_to_mosaic(monkeypatch):
  """backend="mosaic" hands packed segment ids to this kernel (training always has them) instead
  of falling back to Triton, cast to int32 as the Triton path would, with the given tiles."""
  calls = _record_calls(monkeypatch)
  q, k, v = (jnp.zeros(x.shape, x.dtype) for x in _arrays())
  blocks = mosaic.BlockSizes(max_concurrent_steps=3)
  focal.focal_attention(q, k, v, scale=0.1, segment_ids=jnp.zeros((1, 256), jnp.int16),
                        backend="mosaic", block_sizes=blocks)
  assert [c[0] for c in calls] == ["mosaic"]
  assert calls[0][1]["segment_ids"].dtype == jnp.int32 and calls[0][1]["block_sizes"] == blocks


@pytest.mark.parametrize("kwargs", [dict(dtype=jnp.float32), dict(D=256), dict(T=192)])
def test_mosaic_backend_falls_back_to_triton(monkeypatch, kwargs):
  """A call `supported` rejects runs the Triton kernels, with the Triton default tiles."""
  calls = _record_calls(monkeypatch)
  q, k, v = (jnp.zeros(x.shape, x.dtype) for x in _arrays(**kwargs))
  focal.focal_attention(q, k, v, scale=0.1, backend="mosaic",
                        block_sizes=mosaic.BlockSizes(block_kv=64))
  assert [c[0] for c in calls] == ["triton"]
  assert calls[0][1]["block_sizes"] == focal.BlockSizes.default(q.shape[-1], q.dtype)


@pytest.mark.parametrize("kwargs, match", [
    (dict(backend="cuda"), "backend='cuda'"),
    (dict(backend="mosaic", block_sizes=focal.BlockSizes()), "block_sizes: backend='mosaic'"),
    (dict(block_sizes=mosaic.BlockSizes()), "block_sizes: backend='triton'"),
    (dict(backend="tpu", block_sizes=focal.BlockSizes()), "block_sizes: the 'tpu' backend"),
    (dict(backend="tpu", interpret=True), "interpret: the 'tpu' backend"),
])
def test_focal_attention_rejects_bad_arguments(kwargs, match):
  q, k, v = (jnp.zeros(x.shape, x.dtype) for x in _arrays())
  with pytest.raises(ValueError, match=match):
    focal.focal_attention(q, k, v, scale=0.1, **kwargs)


@pytest.mark.parametrize("D, segments, fused", [(64, False, True), (64, True, True),
                                                (128, False, False), (128, True, False)])
def test_backward_kernel_choice(monkeypatch, D, segments, fused):
  """BlockSizes.default(D): the single-pass backward at D=64, packed segments included, the two
  deterministic kernels at D=128."""
  used = []

  def fake(name):
    def backward(q, k, v, s_BNT, *_, seg_BT=None, **__):
      used.append(name)
      assert (seg_BT is None) == (not segments), "segment ids not handed to the backward"
      return q, k, v, s_BNT
    return backward

  monkeypatch.setattr(mosaic_bwd, "backward", fake("two"))
  monkeypatch.setattr(mosaic_bwd_fused, "backward", fake("fused"))
  q, k, v, s = _inputs(7, B=1, T=256, S=256, N=2, K=1, D=D, dtype=jnp.bfloat16, scale="BNT")
  seg = _packed_segment_ids(7, 1, 256) if segments else None
  jax.vjp(lambda q: mosaic.focal_attention(q, k, v, scale=s, segment_ids=seg,
                                               interpret=True), q)[1](q)
  assert used == ["fused" if fused else "two"]


def _arrays(B=1, T=256, S=256, N=4, K=2, D=64, dtype=jnp.bfloat16, dtype_k=None):
  q = jax.ShapeDtypeStruct((B, T, N, D), dtype)
  k = jax.ShapeDtypeStruct((B, S, K, D), dtype_k or dtype)
  v = jax.ShapeDtypeStruct((B, S, K, D), dtype)
  return q, k, v


@pytest.mark.parametrize("kwargs, seg, reason", [
    (dict(), ((1, 256), jnp.float32), "segment_ids must be int32 [B, T] = (1, 256)"),
    (dict(), ((1, 128), jnp.int32), "segment_ids must be int32 [B, T] = (1, 256)"),
    (dict(S=384), ((1, 256), jnp.int32), "segment_ids need T == S"),
    (dict(dtype=jnp.float32), None, "bfloat16/float16"),
    (dict(dtype_k=jnp.float16), None, "share one dtype"),
    (dict(D=32), None, "head dim D=32"),
    (dict(D=256), None, "head dim D=256"),
    (dict(T=192), None, "T=192 must be a multiple of 2·block_q=128"),
    (dict(S=320), None, "S=320 must be a multiple of block_kv=128"),
    (dict(N=3, K=2), None, "multiple of kv heads"),
])
def test_supported_gives_reasons(kwargs, seg, reason):
  q, k, v = _arrays(**kwargs)
  seg = None if seg is None else jax.ShapeDtypeStruct(*seg)
  why = mosaic.supported(q, k, v, seg, True)
  assert why is not None and reason in why, why
  # The module's entry point refuses with the same reason.
  with pytest.raises(ValueError, match="mosaic.focal_attention"):
    jax.eval_shape(lambda q, k, v, seg: mosaic.focal_attention(
        q, k, v, scale=0.1, segment_ids=seg), q, k, v, seg)


def test_supported_accepts_contract_shapes():
  for D, dtype in [(64, jnp.bfloat16), (128, jnp.float16)]:
    for causal in (True, False):
      assert mosaic.supported(*_arrays(D=D, dtype=dtype, N=8, K=2), None, causal) is None
      seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)
      assert mosaic.supported(*_arrays(D=D, dtype=dtype), seg, causal) is None


@pytest.mark.parametrize("field, value", [
    ("block_q", 32), ("block_kv", 96), ("max_concurrent_steps", 1), ("block_kv_dkv", 0),
    ("fused_backward", 1)])
def test_block_sizes_validate(field, value):
  with pytest.raises(ValueError, match=f"BlockSizes.{field}={value}"):
    mosaic.BlockSizes(**{field: value})


@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("causal, dtype, D", [(True, jnp.bfloat16, 64), (False, jnp.float16, 128)])
def test_lowers_to_mosaic_gpu(causal, dtype, D, segments):
  """Lowers through Pallas' Mosaic GPU backend for CUDA without a GPU: catches layouts and
  primitives the lowering rejects (e.g. int32 segment ids in the row / column layouts) and
  shared-memory overflow before a GPU sees them (ptxas is not run). Checks the installed jax
  only (0.10.2 in CI)."""
  q, k, v = _arrays(B=2, T=1024, S=1024, N=8, K=2, D=D, dtype=dtype)
  s = jax.ShapeDtypeStruct((2, 8, 1024), jnp.float32)
  seg = jax.ShapeDtypeStruct((2, 1024), jnp.int32) if segments else None
  fwd = jax.jit(lambda q, k, v, s, seg: mosaic.forward(
      q, k, v, s, causal=causal, interpret=False, segment_ids=seg, blocks=None))
  text = fwd.trace(q, k, v, s, seg).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_shared_memory_overflow_is_reported():
  # Three 128-row K/V slots at D=128 need ~227 KiB: Mosaic GPU refuses at lowering time.
  q, k, v = _arrays(T=1024, S=1024, D=128)
  s = jax.ShapeDtypeStruct((1, 4, 1024), jnp.float32)
  blocks = mosaic.BlockSizes(max_concurrent_steps=3)
  fwd = jax.jit(lambda q, k, v, s: mosaic.forward(
      q, k, v, s, causal=True, blocks=blocks, interpret=False))
  with pytest.raises(ValueError, match="shared memory"):
    fwd.trace(q, k, v, s).lower(lowering_platforms=("cuda",))


def _poison_allocator(*shapes_dtypes):
  """Leaves NaN in device memory of the output sizes, so an unwritten output tile (which the
  allocator is likely to hand back from this freed memory) shows up as NaN, not stale zeros."""
  for shape, dtype in shapes_dtypes:
    x = jnp.full(shape, jnp.nan, dtype)
    x.block_until_ready()
    x.delete()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="compiled Mosaic GPU kernels need a Hopper GPU (sm_90)")
class TestCompiledGPU:
  """The comparison compiled for the GPU at realistic shapes, default and alternative tiles."""

  @pytest.mark.parametrize("D", [64, 128])
  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  @pytest.mark.parametrize("causal", [True, False])
  def test_matches_reference(self, D, dtype, causal):
    B, T, N, K = 2, 2048, 8, 2
    _poison_allocator(((B, T, N, D), dtype), ((B, N, T), jnp.float32))
    _compare(300 + D, causal=causal, dtype=dtype, scale="BNT", B=B, T=T, N=N, K=K, D=D,
             interpret=False)

  @pytest.mark.parametrize("D", [64, 128])
  @pytest.mark.parametrize("causal", [True, False])
  def test_segments(self, D, causal):
    _poison_allocator(((2, 2048, 8, D), jnp.bfloat16), ((2, 8, 2048), jnp.float32))
    _compare(600 + D, causal=causal, dtype=jnp.bfloat16, scale="BNT", B=2, T=2048, N=8, K=2,
             D=D, interpret=False, segments=True)

  @pytest.mark.parametrize("D", [64, 128])
  @pytest.mark.parametrize("segments", [False, True])
  def test_gradients_through_custom_vjp(self, D, segments):
    _compare_grads(500 + D, interpret=False, B=2, T=2048, N=8, K=2, D=D, segments=segments)

  @pytest.mark.parametrize("blocks, D", [
      (mosaic.BlockSizes(block_kv=64, max_concurrent_steps=4), 128),
      (mosaic.BlockSizes(block_q=128, block_kv=64, max_concurrent_steps=2), 64),
  ])
  def test_other_tiles(self, blocks, D):
    _poison_allocator(((2, 2048, 8, D), jnp.bfloat16), ((2, 8, 2048), jnp.float32))
    _compare(400, causal=True, dtype=jnp.bfloat16, scale="BNT", B=2, T=2048, N=8, K=2, D=D,
             blocks=blocks, interpret=False)
