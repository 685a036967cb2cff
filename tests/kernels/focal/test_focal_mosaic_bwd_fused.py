"""mosaic_bwd_fused (single-pass FA3-style Hopper backward, dq by reduce-add) == the spec.

Invariant: `mosaic_bwd_fused.backward` returns the same dq, dk, dv and d_scale as jax.vjp of
`pallas_kernels.focal.reference.attention` with an array scale, within test_focal_mosaic_bwd's
tolerances and on its inputs (`_problem`, `_assert_close` and `Blocks` are imported from there, so
both backwards answer to one spec): causal and not, GQA (G = 2), D = 64 and 128, square and mixed
tiles, bf16 and fp16. On CPU the kernel runs in GPU interpret mode with the race detector on (the
interpreter has no TMA reduce-add: dq goes through per-kv-tile slabs summed in XLA, see the kernel
docstring); `test_lowers_for_cuda` lowers the compiled path (reduce-add, transposed-lhs wgmma,
aliased float32 accumulator) for CUDA without a GPU. `TestCompiledGPU` runs it on a Hopper GPU.

Run: python -m pytest -q tests/kernels/focal/test_focal_mosaic_bwd_fused.py              (CPU)
     python -m pytest -q tests/kernels/focal/test_focal_mosaic_bwd_fused.py -k Compiled  (GPU)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.focal import mosaic_bwd_fused as fused
from tests.kernels import mosaic_interpret
import test_focal_mosaic_bwd as base  # tests/ is on sys.path under pytest

SLOW = pytest.mark.slow  # extra configurations: deselected unless -m slow (pyproject)

Blocks = base.Blocks


@pytest.fixture(autouse=True)
def _strict_ranks_and_fast_interpreter():
  with jax.numpy_rank_promotion("raise"), mosaic_interpret.cached_interpreter_threads():
    yield


@pytest.mark.parametrize("dtype, causal, N, K, D, blocks", [
    (jnp.bfloat16, True, 2, 1, 64, Blocks()),
    (jnp.bfloat16, False, 4, 2, 128, Blocks()),
    pytest.param(jnp.bfloat16, True, 4, 2, 128, Blocks(), marks=SLOW),
    # block_q != block_kv both ways (the causal block-range arithmetic), and a 3-slot ring.
    (jnp.bfloat16, True, 2, 1, 64, Blocks(block_q_dkv=128, block_kv_dkv=64)),
    pytest.param(jnp.float16, False, 4, 2, 64, Blocks(block_q_dkv=64, block_kv_dkv=128,
                                                      max_concurrent_steps=3), marks=SLOW),
])
def test_matches_reference(dtype, causal, N, K, D, blocks):
  args, want = base._problem(1, B=1, T=256, N=N, K=K, D=D, dtype=dtype, causal=causal)
  got = jax.block_until_ready(fused.backward(*args, causal=causal, blocks=blocks, interpret=True))
  assert not mosaic_interpret.interpret_races_found(), "fused kernel: race detected"
  base._assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype, causal, B, N, K, D, blocks", [
    (jnp.bfloat16, True, 2, 4, 2, 64, Blocks()),
    (jnp.bfloat16, True, 1, 2, 1, 128, Blocks()),
    pytest.param(jnp.float16, False, 1, 2, 2, 128, Blocks(), marks=SLOW),
])
def test_matches_reference_segments(dtype, causal, B, N, K, D, blocks):
  """Packed segment ids (a key's gradient only from queries of its segment): the same invariant
  as mosaic_bwd's segment test, on its inputs."""
  seg_BT = base._packed_segment_ids(9, B, 256)
  args, want = base._problem(9, B=B, T=256, N=N, K=K, D=D, dtype=dtype, causal=causal,
                             seg_BT=seg_BT)
  got = jax.block_until_ready(fused.backward(*args, causal=causal, blocks=blocks, interpret=True,
                                             seg_BT=seg_BT))
  assert not mosaic_interpret.interpret_races_found(), "fused kernel, segments: race detected"
  base._assert_close(got, want, dtype)


def test_backward_output_types():
  """The contract's shapes and dtypes; traced only (cheap)."""
  args, _ = base._problem(2, B=1, T=256, N=2, K=1, D=64, dtype=jnp.bfloat16, causal=True)
  shapes = jax.eval_shape(lambda *a: fused.backward(*a, causal=True, blocks=Blocks(),
                                                 interpret=True), *args)
  q, k = args[0], args[1]
  assert [(x.shape, x.dtype) for x in shapes] == [
      (q.shape, q.dtype), (k.shape, k.dtype), (k.shape, k.dtype), ((1, 2, 256), jnp.float32)]


@pytest.mark.parametrize("D, blocks, change, match", [
    (128, Blocks(), dict(max_concurrent_steps=3), "max_concurrent_steps=3"),  # 242 KB > 224 KB
    (64, Blocks(), dict(block_kv_dkv=96), "block_kv_dkv=96"),       # mosaic_bwd.check
])
def test_bad_blocks_raise(D, blocks, change, match):
  args, _ = base._problem(3, B=1, T=256, N=2, K=1, D=D, dtype=jnp.bfloat16, causal=True)
  with pytest.raises(ValueError, match=match):
    fused.backward(*args, causal=True, blocks=dataclasses.replace(blocks, **change),
                interpret=True)


@pytest.mark.parametrize("D, steps, causal, segments", [
    (64, 3, True, False), (128, 2, False, False), (128, 2, True, False), (64, 3, True, True),
    (128, 2, True, True)])
def test_lowers_for_cuda(D, steps, causal, segments):
  """The compiled kernel (not the interpreter's stand-ins) passes Pallas → Mosaic GPU lowering on
  the installed jax, and the float32 accumulator is aliased in place (no copy)."""
  q = jax.ShapeDtypeStruct((2, 2048, 8, D), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 2048, 2, D), jnp.bfloat16)
  rows = jax.ShapeDtypeStruct((2, 8, 2048), jnp.float32)
  blocks = Blocks(max_concurrent_steps=steps)
  seg = jax.ShapeDtypeStruct((2, 2048), jnp.int32) if segments else None
  fn = jax.jit(lambda *a, seg_BT=None: fused.backward(*a, causal=causal, blocks=blocks,
                                                   interpret=False, seg_BT=seg_BT))
  hlo = fn.trace(q, k, k, rows, q, rows, q, seg_BT=seg).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "output_operand_aliases" in hlo


@pytest.mark.gpu
@pytest.mark.skipif(not base._on_hopper(), reason="compiled Mosaic GPU kernels need a Hopper GPU")
class TestCompiledGPU:
  """The same invariant compiled on a Hopper GPU at training-like shapes."""

  @pytest.mark.parametrize("D", [64, 128])
  @pytest.mark.parametrize("causal", [True, False])
  def test_matches_reference(self, D, causal):
    args, want = base._problem(5, B=2, T=2048, N=8, K=2, D=D, dtype=jnp.bfloat16, causal=causal)
    blocks = Blocks(max_concurrent_steps=3 if D == 64 else 2)
    got = jax.jit(lambda *a: fused.backward(*a, causal=causal, blocks=blocks, interpret=False))(
        *args)
    base._assert_close(got, want, jnp.bfloat16)

  @pytest.mark.parametrize("D", [64, 128])
  def test_segments_match_reference(self, D):
    seg_BT = base._packed_segment_ids(10, 2, 2048)
    args, want = base._problem(10, B=2, T=2048, N=8, K=2, D=D, dtype=jnp.bfloat16, causal=True,
                               seg_BT=seg_BT)
    blocks = Blocks(max_concurrent_steps=3 if D == 64 else 2)
    got = jax.jit(lambda *a: fused.backward(*a, causal=True, blocks=blocks, interpret=False,
                                         seg_BT=seg_BT))(*args)
    base._assert_close(got, want, jnp.bfloat16)

  def test_matches_two_kernel_backward(self):
    """dk, dv agree with mosaic_bwd's to bf16 rounding; dq, d_scale (float32 atomics in either
    order) to the same tolerance."""
    args, _ = base._problem(6, B=2, T=2048, N=8, K=2, D=128, dtype=jnp.bfloat16, causal=True)
    kw = dict(causal=True, blocks=Blocks(), interpret=False)
    two = jax.jit(lambda *a: base.fb.backward(*a, **kw))(*args)
    one = jax.jit(lambda *a: fused.backward(*a, **kw))(*args)
    base._assert_close(one, two, jnp.bfloat16)
