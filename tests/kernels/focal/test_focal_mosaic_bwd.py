"""mosaic_bwd (Hopper Mosaic GPU flash-attention backward, per-query temperature) == the spec.

Invariant: given the forward's out and base-2 lse (computed here in XLA from the spec),
`mosaic_bwd.backward` returns the same dq, dk, dv and d_scale as jax.vjp of
`pallas_kernels.focal.reference.attention` with an array scale, on fresh random inputs: causal and
not, GQA, bf16 and fp16, D = 64 and 128, square and mixed tiles, with and without packed segment ids
(three documents of uneven lengths per row; gradients never cross a document boundary). On CPU the
kernels run in jax's GPU interpret mode (threads, SMEM, TMA, barriers simulated) with the race
detector on, each kernel checked race-free separately; `mosaic_interpret.cached_interpreter_threads`
keeps the file near a minute on 2 cores. `TestCompiledGPU` repeats the comparison compiled at
training-like shapes on a Hopper GPU (compute capability 9.x).

Run: python -m pytest -q tests/kernels/focal/test_focal_mosaic_bwd.py            (CPU, ~60 s)
     python -m pytest -q tests/kernels/focal/test_focal_mosaic_bwd.py -k Compiled   (Hopper GPU)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.focal import mosaic_bwd as fb
from pallas_kernels.focal import mosaic_dkv
from pallas_kernels.focal import reference
from tests.kernels import mosaic_interpret

SLOW = pytest.mark.slow  # extra configurations: deselected unless -m slow (pyproject)

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3}  # max|err| / max|ref|, per output


def _on_hopper() -> bool:
  if jax.default_backend() != "gpu":
    return False
  cc = getattr(jax.devices()[0], "compute_capability", "")
  return str(cc).startswith("9")


@dataclasses.dataclass(frozen=True)
class Blocks:
  """The fields `backward` reads (mosaic.BlockSizes has the same ones)."""
  block_q_dq: int = 64
  block_kv_dq: int = 64
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  max_concurrent_steps: int = 2


# block_q != block_kv on both kernels (the causal block-range arithmetic) and a 3-slot ring.
MIXED = Blocks(block_q_dq=64, block_kv_dq=128, block_q_dkv=128, block_kv_dkv=64,
               max_concurrent_steps=3)


@pytest.fixture(autouse=True)
def _strict_ranks_and_fast_interpreter():
  with jax.numpy_rank_promotion("raise"), mosaic_interpret.cached_interpreter_threads():
    yield


def _packed_segment_ids(seed, B, T):
  """int32 [B, T]: three documents per row with random boundaries (almost surely inside tiles)
  and ids that differ between rows, as the data packer emits them."""
  rng = np.random.default_rng(seed)
  rows = [np.searchsorted(np.sort(rng.choice(np.arange(1, T), 2, replace=False)), np.arange(T),
                          side="right") + 3 * b for b in range(B)]
  return jnp.asarray(np.stack(rows), jnp.int32)


def _problem(seed, *, B, T, N, K, D, dtype, causal, seg_BT=None):
  """Inputs, the forward residuals (out, base-2 lse) and the reference gradients."""
  kq, kk, kv, ks, kdo = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(kq, (B, T, N, D), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (B, T, K, D), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (B, T, K, D), jnp.float32).astype(dtype)
  # A positive temperature spread over ~e^±1 around 1/√D, different for every query.
  s_BNT = D**-0.5 * jnp.exp(0.5 * jax.random.normal(ks, (B, N, T), jnp.float32))
  do = jax.random.normal(kdo, (B, T, N, D), jnp.float32).astype(dtype)
  out, vjp = jax.vjp(lambda q, k, v, s: reference.attention(
      q, k, v, scale=s, causal=causal, segment_ids_BT=seg_BT), q, k, v, s_BNT)
  want = vjp(do)
  G = N // K
  logits_BKGTS = jnp.einsum("BTKGD,BSKD->BKGTS", q.reshape(B, T, K, G, D), k,
                            preferred_element_type=jnp.float32)
  logits_BKGTS = logits_BKGTS * s_BNT.reshape(B, K, G, T)[..., None]
  vis_BTS = reference.visible_BTS(B, T, T, causal=causal, segment_ids_BT=seg_BT)
  lse_BKGT = jax.nn.logsumexp(jnp.where(vis_BTS[:, None, None], logits_BKGTS, -jnp.inf),
                              axis=-1)
  lse_BNT = (lse_BKGT * math.log2(math.e)).reshape(B, N, T)  # base 2, as the forward saves it
  return (q, k, v, s_BNT, out, lse_BNT, do), want


def _assert_close(got, want, dtype):
  for name, g, w in zip(("dq", "dk", "dv", "d_scale"), got, want):
    assert g.shape == w.shape, (name, g.shape, w.shape)
    expected_dtype = jnp.float32 if name == "d_scale" else dtype
    assert g.dtype == expected_dtype, (name, g.dtype)
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.all(np.isfinite(g)), name
    err = np.abs(g - w).max() / np.abs(w).max()
    assert err < TOL[dtype], f"{name}: max|err|/max|ref| = {err:.3g} >= {TOL[dtype]}"


def _interpreted(args, *, causal, blocks, seg_BT=None):
  """Runs the two kernels one at a time (the race detector's verdict is per kernel launch)."""
  q, k, v, s_BNT, out, lse_BNT, do = args
  c_BNT, delta_BNT = fb.backward_rows(s_BNT, out, do)
  kw = dict(causal=causal, blocks=blocks, interpret=True, seg_BT=seg_BT)
  rows = (q, k, v, do, c_BNT, lse_BNT, delta_BNT)
  dq, ds_BNT = jax.block_until_ready(fb.dq_call(*rows, **kw))
  assert not mosaic_interpret.interpret_races_found(), "dq kernel: race detected"
  dk, dv = jax.block_until_ready(mosaic_dkv.dkv_call(*rows, **kw))
  assert not mosaic_interpret.interpret_races_found(), "dk/dv kernel: race detected"
  return dq, dk, dv, ds_BNT


@pytest.mark.parametrize("dtype, causal, N, K, D, blocks", [
    (jnp.bfloat16, True, 2, 1, 64, Blocks()),
    (jnp.float16, False, 4, 2, 128, Blocks()),
    pytest.param(jnp.bfloat16, False, 2, 2, 64, Blocks(max_concurrent_steps=3), marks=SLOW),
    (jnp.bfloat16, True, 4, 2, 128, MIXED),
    pytest.param(jnp.float16, True, 4, 1, 64, Blocks(), marks=SLOW),
])
def test_matches_reference(dtype, causal, N, K, D, blocks):
  args, want = _problem(1, B=1, T=256, N=N, K=K, D=D, dtype=dtype, causal=causal)
  _assert_close(_interpreted(args, causal=causal, blocks=blocks), want, dtype)


@pytest.mark.parametrize("dtype, causal, B, N, K, D, blocks", [
    # Two packed rows, GQA, mixed tiles and a 3-slot ring: ids resident and streamed both ways.
    (jnp.bfloat16, True, 2, 4, 2, 64, MIXED),
    (jnp.float16, False, 1, 2, 1, 128, Blocks()),  # every tile masked by segments alone
])
def test_matches_reference_segments(dtype, causal, B, N, K, D, blocks):
  seg_BT = _packed_segment_ids(7, B, 256)
  args, want = _problem(7, B=B, T=256, N=N, K=K, D=D, dtype=dtype, causal=causal, seg_BT=seg_BT)
  _assert_close(_interpreted(args, causal=causal, blocks=blocks, seg_BT=seg_BT), want, dtype)


def test_backward_output_types():
  """`backward` (the custom_vjp hook: `_check`, the XLA rows, both kernels) returns the contract's
  shapes and dtypes; traced only (the kernels' numbers are checked above), so it is cheap."""
  args, _ = _problem(2, B=1, T=256, N=2, K=1, D=64, dtype=jnp.bfloat16, causal=True)
  shapes = jax.eval_shape(lambda *a: fb.backward(*a, causal=True, blocks=Blocks(),
                                                 interpret=True), *args)
  q, k = args[0], args[1]
  assert [(x.shape, x.dtype) for x in shapes] == [
      (q.shape, q.dtype), (k.shape, k.dtype), (k.shape, k.dtype), ((1, 2, 256), jnp.float32)]


@pytest.mark.parametrize("change, match", [
    (dict(block_q_dq=96), "block_q_dq=96"),
    (dict(block_kv_dkv=256), r"2·blocks.block_kv_dkv=256"),
    (dict(max_concurrent_steps=0), "max_concurrent_steps"),
])
def test_bad_blocks_raise(change, match):
  args, _ = _problem(3, B=1, T=256, N=2, K=1, D=64, dtype=jnp.bfloat16, causal=True)
  with pytest.raises(ValueError, match=match):
    fb.backward(*args, causal=True, blocks=dataclasses.replace(Blocks(), **change),
                interpret=True)


@pytest.mark.parametrize("field", ["dtype", "head_dim", "lse", "seg_dtype", "seg_shape"])
def test_bad_inputs_raise(field):
  q, k, v, s_BNT, out, lse_BNT, do = _problem(
      4, B=1, T=256, N=2, K=1, D=64, dtype=jnp.bfloat16, causal=True)[0]
  seg_BT = None
  if field.startswith("seg"):
    seg_BT = jnp.zeros((1, 256) if field == "seg_dtype" else (1, 128),
                       jnp.float32 if field == "seg_dtype" else jnp.int32)
    match = "seg_BT must be int32"
  elif field == "dtype":
    q, match = q.astype(jnp.float32), "dtype"
  elif field == "head_dim":
    q, k, v, out, do = (x[..., :32] for x in (q, k, v, out, do))
    match = "head dim D=32"
  else:
    lse_BNT, match = lse_BNT[:, :1], "lse_BNT"
  with pytest.raises(ValueError, match=match):
    fb.backward(q, k, v, s_BNT, out, lse_BNT, do, causal=True, blocks=Blocks(), interpret=True,
                seg_BT=seg_BT)


@pytest.mark.parametrize("causal, D", [(True, 64), (False, 128), (True, 128)])
def test_lowers_to_mosaic_gpu_with_segments(causal, D):
  """Both kernels with segment ids lower through Pallas' Mosaic GPU backend for CUDA without a
  GPU (int32 ids in the row and column layouts, the extra TMA arrivals, shared memory)."""
  B, T, N, K = 2, 1024, 8, 2
  q = jax.ShapeDtypeStruct((B, T, N, D), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((B, T, K, D), jnp.bfloat16)
  rows = jax.ShapeDtypeStruct((B, N, T), jnp.float32)
  seg = jax.ShapeDtypeStruct((B, T), jnp.int32)
  blocks = Blocks(max_concurrent_steps=3 if D == 64 else 2)
  bwd = jax.jit(lambda q, k, v, s, out, lse, do, seg: fb.backward(
      q, k, v, s, out, lse, do, causal=causal, blocks=blocks, interpret=False, seg_BT=seg))
  text = bwd.trace(q, k, k, rows, q, rows, q, seg).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="compiled Mosaic GPU kernels need a Hopper GPU")
class TestCompiledGPU:
  """The same invariant compiled on a Hopper GPU at training-like shapes."""

  @pytest.mark.parametrize("D", [64, 128])
  @pytest.mark.parametrize("causal", [True, False])
  def test_matches_reference(self, D, causal):
    args, want = _problem(5, B=2, T=2048, N=8, K=2, D=D, dtype=jnp.bfloat16, causal=causal)
    blocks = Blocks(max_concurrent_steps=3 if D == 64 else 2)
    got = jax.jit(lambda *a: fb.backward(*a, causal=causal, blocks=blocks, interpret=False))(
        *args)
    _assert_close(got, want, jnp.bfloat16)

  @pytest.mark.parametrize("D", [64, 128])
  @pytest.mark.parametrize("causal", [True, False])
  def test_segments(self, D, causal):
    seg_BT = _packed_segment_ids(8, 2, 2048)
    args, want = _problem(8, B=2, T=2048, N=8, K=2, D=D, dtype=jnp.bfloat16, causal=causal,
                          seg_BT=seg_BT)
    blocks = Blocks(max_concurrent_steps=3 if D == 64 else 2)
    got = jax.jit(lambda *a: fb.backward(*a, causal=causal, blocks=blocks, interpret=False,
                                         seg_BT=seg_BT))(*args)
    _assert_close(got, want, jnp.bfloat16)

  def test_through_forward_custom_vjp(self):
    """With the Mosaic forward saving out and lse, jax.grad reaches these kernels."""
    from pallas_kernels.focal import mosaic  # pylint: disable=import-outside-toplevel
    args, want = _problem(6, B=2, T=2048, N=8, K=2, D=128, dtype=jnp.bfloat16, causal=True)
    q, k, v, s_BNT, _, _, do = args
    _, vjp = jax.vjp(lambda q, k, v, s: mosaic.focal_attention(q, k, v, scale=s, causal=True),
                     q, k, v, s_BNT)
    _assert_close(vjp(do), want, jnp.bfloat16)
