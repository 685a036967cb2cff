"""The Hopper (Mosaic GPU) dilution kernels on CPU: B1 (mosaic_b1.py), F2 and F1 (mosaic_fwd.py;
F1 is focal's Mosaic forward with V := K) and B2 (mosaic_b2.py).

Invariants: in GPU interpret mode (threads, SMEM, TMA and barriers simulated, race detector on)
each kernel's outputs equal its Triton counterpart's on the same inputs (bf16, segments, several
super-blocks and key blocks) within the two bf16 mask pieces' rounding, with and without chained
pieces; backend="mosaic" runs the op's four passes on them and falls back to Triton for float32
and other head dims; they lower through Mosaic GPU for CUDA at D = 64 and 128 (layouts and SMEM
checked without a GPU). The compiled comparisons run in test_dilution_triton.py's TestCompiledGPU
(backend "mosaic").
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.dilution as dilution
from pallas_kernels.dilution import api
from pallas_kernels.dilution import mosaic_b1
from pallas_kernels.dilution import mosaic_b2
from pallas_kernels.dilution import mosaic_fwd
from pallas_kernels.dilution import reference as dilution_reference
from pallas_kernels.dilution import triton_bwd
from pallas_kernels.dilution import triton_fwd
from tests.kernels import mosaic_interpret

SLOW = pytest.mark.slow  # extra configurations: deselected unless -m slow (pyproject)

R = 128   # checkpoint rows: several super-blocks at T = 256..384 with 64-row tiles
BS = dilution.BlockSizes(block_q_stats=64, block_k_stats=64, block_q=32, block_k=64,
                         block_k_fwd=64, b1_block_k=64, b1_carries="registers", ckpt_rows=R)
TRITON_KERNELS = ("row_stats", "key_sweep", "reverse_sweep", "dk_correction")


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30))


def _qkv(T, N, K, *, segments, seed=0, D=64, dtype=jnp.bfloat16, B=1):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = (1.5 * jax.random.normal(ks[0], (B, T, N, D))).astype(dtype)
  k = (1.5 * jax.random.normal(ks[1], (B, T, K, D))).astype(dtype)
  v = jax.random.normal(ks[2], (B, T, K, D)).astype(dtype)
  pos = jnp.arange(T)[None] + 37 * jnp.arange(B)[:, None]   # each row its own segment cuts
  seg = ((pos >= T // 3).astype(jnp.int32) + (pos >= T // 2 + 5) if segments
         else jnp.zeros((B, T), jnp.int32))
  return q, k, v, seg, jax.random.normal(ks[3], (B, T, N, D)).astype(dtype)


# (T, segments, D, dtype, B, N, K): 2 or 3 super-blocks, packed documents, the other head dim and
# fp16; and two batch rows with two kv heads.
CASES = [(256, False, 64, jnp.bfloat16, 1, 2, 1), (384, True, 64, jnp.bfloat16, 1, 2, 1),
         (256, True, 128, jnp.float16, 1, 2, 1), (256, True, 64, jnp.bfloat16, 2, 4, 2)]


def _b1_both(T, N, K, *, segments, D=64, dtype=jnp.bfloat16, B=1, ckpt_rows=R, chain=True):
  """(Mosaic B1, Triton B1) outputs on the inputs of a real forward; asserts no interpreter
  races."""
  q, k, v, seg, do = _qkv(T, N, K, segments=segments, D=D, dtype=dtype, B=B)
  scale, eps = 0.125, 1e-9
  bs = dataclasses.replace(BS, ckpt_rows=ckpt_rows)
  out, (lse, _, ssum, _, ckpt) = api._forward(q, k, v, seg, scale, eps, bs, False, True,
                                              training=True)
  dbar = jnp.einsum("BTND,BTND->BNT", do.astype(jnp.float32), out)
  args = (q, k, v, seg, lse, ssum, dbar, do, ckpt)
  want = triton_bwd.reverse_sweep(*args, scale=scale, eps=eps, bs=bs, interpret=True)
  with mosaic_interpret.cached_interpreter_threads():
    got = jax.block_until_ready(mosaic_b1.reverse_sweep(
        *args, scale=scale, eps=eps, ckpt_rows=ckpt_rows, chain=chain, interpret=True))
  assert not mosaic_interpret.interpret_races_found()
  return got, want


def _assert_b1_close(got, want):
  # dq and dk contract the 16-bit W in both kernels; the probabilities differ by exp2 vs exp; the
  # in-tile products keep ~16 bits (two pieces). Measured at D = 64: dq 5.0e-4, ĝ 2.6e-6,
  # dk 5.8e-4, dv 8.9e-4; bf16's own rounding is 3.9e-3.
  for name, a, b, tol in zip(("dq", "ghat", "dk", "dv"), got, want, (2e-3, 1e-5, 2e-3, 2e-3)):
    assert a.shape == b.shape and a.dtype == jnp.float32, name
    assert _rel(a, b) < tol, (name, _rel(a, b))


# chain: the mask products' pieces in one wgmma group (BlockSizes.chain_pieces). CI runs the D = 128
# default (unchained) and two batch rows chained (the second row's cuts leave tiles below the
# diagonal within one segment, which `visible_all` runs unmasked); TestCompiledGPU runs every
# default compiled.
@pytest.mark.parametrize("T, segments, D, dtype, B, N, K, chain", [
    pytest.param(*CASES[0], True, marks=SLOW), pytest.param(*CASES[1], False, marks=SLOW),
    (*CASES[2], False), pytest.param(*CASES[3], True, marks=SLOW),
    (384, True, 64, jnp.bfloat16, 2, 2, 1, True)])
def test_b1_matches_the_triton_b1_interpret(T, segments, D, dtype, B, N, K, chain):
  _assert_b1_close(*_b1_both(T, N, K, segments=segments, D=D, dtype=dtype, B=B, chain=chain))


@SLOW   # compiled-tested as TestCompiledGPU's ckpt64
def test_b1_with_a_checkpoint_per_row_tile_interpret():
  """ckpt_rows = 64 (one row tile per super-block): the Mosaic B1 skips its carry rebuild and
  streams each row tile once; the Triton B1 still rebuilds. Both must agree."""
  _assert_b1_close(*_b1_both(256, 4, 2, segments=True, B=2, ckpt_rows=64))


@pytest.mark.parametrize("T, segments, D, dtype, B, N, K, tiles, ckpt_rows, chain", [
    pytest.param(*CASES[0], 1, R, True, marks=SLOW), pytest.param(*CASES[1], 1, R, False,
                                                                  marks=SLOW),
    (*CASES[2], 1, R, False), (*CASES[3], 2, R, True),
    (384, True, 64, jnp.bfloat16, 1, 4, 2, 2, R, False),
    (256, False, 64, jnp.float16, 1, 2, 1, 1, R, True),
    (256, True, 128, jnp.bfloat16, 1, 2, 1, 2, R, False),
    (256, True, 64, jnp.bfloat16, 2, 4, 2, 2, 64, True),
    pytest.param(256, False, 64, jnp.bfloat16, 2, 4, 2, 2, R, True, marks=SLOW)])
def test_f2_matches_the_triton_f2_interpret(T, segments, D, dtype, B, N, K, tiles, ckpt_rows,
                                            chain):
  """tiles: BlockSizes.f2_key_tiles (64-key tiles per CTA, N and S summed over them; two check
  visible_all's key block index 2·jk + g); ckpt_rows 64: a checkpoint per row tile; chain:
  BlockSizes.chain_pieces."""
  q, k, v, seg, _ = _qkv(T, N, K, segments=segments, D=D, dtype=dtype, B=B)
  bs = dataclasses.replace(BS, ckpt_rows=ckpt_rows)
  lse, _ = triton_fwd.row_stats(q, k, seg, scale=0.125, bs=bs, with_pk=False, interpret=True)
  want = triton_fwd.key_sweep(q, k, v, seg, lse, scale=0.125, eps=1e-9, bs=bs, with_ckpt=True,
                              interpret=True)
  with mosaic_interpret.cached_interpreter_threads():
    got = jax.block_until_ready(mosaic_fwd.key_sweep(
        q, k, v, seg, lse, scale=0.125, eps=1e-9, ckpt_rows=ckpt_rows, with_ckpt=True,
        key_tiles=tiles, chain=chain, interpret=True))
  assert not mosaic_interpret.interpret_races_found()
  # N contracts the 16-bit σ in both kernels, so a σ whose 16-bit rounding flips moves N by one
  # bf16 ulp (3.9e-3) of σ·v. Flips come from exp2 vs exp, the CPU's own exp and σ moving by
  # ~2⁻¹⁶ with two pieces (measured 1.3e-3 at D = 128). S, total and the checkpoints are float32
  # sums of the unrounded σ, so they hold to 1e-5; the key tiles change only the order of float32
  # sums (1.3e-7).
  for name, a, b, tol in zip(("N", "S", "total", "ckpt"), got, want, (3e-3, 1e-5, 1e-5, 1e-5)):
    assert a.shape == b.shape and a.dtype == jnp.float32, name
    assert _rel(a, b) < tol, (name, _rel(a, b))


def _lowered_for_cuda(fn, *args):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # jax >= 0.11 warns that Pallas-Triton is deprecated
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _op_grad(backend, bs=None, **kw):
  return jax.grad(lambda q, k, v: dilution.dilution_attention(
      q, k, v, scale=0.125, eps=1e-9, backend=backend, block_sizes=bs, **kw
  ).astype(jnp.float32).sum(), (0, 1, 2))


def test_the_mosaic_backend_through_the_op():
  """backend="mosaic" with the D = 64 default (two key tiles per F2 CTA, chained pieces): T = 200
  is padded to 256 (128-row CTAs), the interpreted op's output matches the reference (bf16 output
  rounding: one ulp at |out| ~ 2.6 is 7.8e-3, 3e-3 relative) and its three gradients (dq carries
  F1's pk, dk B2's correction) the Triton op's."""
  bs = dataclasses.replace(dilution.default_block_sizes("mosaic", 64, jnp.bfloat16), ckpt_rows=R)
  assert bs.pad_multiple(True) == 128
  q, k, v, seg, _ = _qkv(200, 2, 1, segments=True)
  w = jax.random.normal(jax.random.PRNGKey(5), q.shape)

  def run(backend, b):
    def loss(q, k, v):
      out = dilution.dilution_attention(q, k, v, scale=0.125, eps=1e-9, segment_ids=seg,
                                        backend=backend, block_sizes=b, interpret=True)
      return (out.astype(jnp.float32) * w).sum(), out
    return jax.grad(loss, (0, 1, 2), has_aux=True)(q, k, v)

  with mosaic_interpret.cached_interpreter_threads():
    got, out = run("mosaic", bs)
  want = dilution_reference.dilution_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                               scale=0.125, segment_ids_BT=seg)[0]
  assert out.shape == q.shape and _rel(out, want) < 5e-3, _rel(out, want)
  for a, b in zip(got, run("triton", BS)[0]):
    assert _rel(a, b) < 1e-2, _rel(a, b)


def test_backend_routes_the_passes():
  """backend="mosaic" lowers the training op (forward and backward) and prefill for CUDA with no
  Triton launch; float32 inputs and head dims other than 64 and 128 fall back to the Triton
  passes."""
  for D in (64, 128):
    q, kv = jnp.zeros((1, 256, 2, D), jnp.bfloat16), jnp.zeros((1, 256, 1, D), jnp.bfloat16)
    prefill = lambda q, k, v: dilution.dilution_prefill(q, k, v, scale=0.125, eps=1e-9,
                                                        backend="mosaic")
    for fn in (_op_grad("mosaic"), prefill) if D == 64 else (_op_grad("mosaic"),):
      text = _lowered_for_cuda(fn, q, kv, kv)
      assert "mosaic_gpu" in text
      assert not any(f'name = "dilution_{name}"' in text for name in TRITON_KERNELS)
  for D, dtype in ((64, jnp.float32), (32, jnp.bfloat16)):
    q, kv = jnp.zeros((1, 256, 2, D), dtype), jnp.zeros((1, 256, 1, D), dtype)
    text = _lowered_for_cuda(_op_grad("mosaic"), q, kv, kv)
    assert "mosaic_gpu" not in text
    assert all(f'name = "dilution_{name}"' in text for name in TRITON_KERNELS)


@pytest.mark.parametrize("D, tiles, ckpt_rows, chain", [
    (64, 2, 1024, True), (128, 1, 1024, False), (64, 1, 64, False), (128, 2, 64, True)])
def test_lowers_to_mosaic_gpu(D, tiles, ckpt_rows, chain):
  """B1 and F2 lower for CUDA (Mosaic rejects overflowing shared memory here, so this checks that
  two key tiles fit at D = 128), also with a checkpoint per row tile (B1 rebuilds none)."""
  S = jax.ShapeDtypeStruct
  q, kv = S((2, 2048, 4, D), jnp.bfloat16), S((2, 2048, 2, D), jnp.bfloat16)
  rows, seg = S((2, 4, 2048), jnp.float32), S((2, 2048), jnp.int32)
  b1 = lambda *a: mosaic_b1.reverse_sweep(*a, scale=D**-0.5, eps=1e-9, ckpt_rows=ckpt_rows,
                                          chain=chain)
  text = _lowered_for_cuda(b1, q, kv, kv, seg, rows, rows, rows, q,
                           S((2, 4, 2048 // ckpt_rows, 2048), jnp.float32))
  assert "mosaic_gpu" in text
  f2 = lambda *a: mosaic_fwd.key_sweep(*a, scale=D**-0.5, eps=1e-9, ckpt_rows=ckpt_rows,
                                       with_ckpt=True, key_tiles=tiles, chain=chain)
  assert "mosaic_gpu" in _lowered_for_cuda(f2, q, kv, kv, seg, rows)


F1_CASES = [(256, False, 64, jnp.bfloat16, 1, 2, 1), (256, True, 128, jnp.float16, 1, 2, 1),
            (256, True, 64, jnp.bfloat16, 2, 4, 2)]


@pytest.mark.parametrize("T, segments, D, dtype, B, N, K", F1_CASES)
def test_f1_matches_the_triton_f1_interpret(T, segments, D, dtype, B, N, K):
  """F1 as focal's Mosaic forward with V := K: lse to float32 rounding; pk within 3e-3 of the
  Triton F1's (both round p to 16 bits for the P·K product, and each is ~7e-4 from the float32
  product on these inputs; bf16 pk alone would be up to 2⁻⁹ off)."""
  q, k, _, seg, _ = _qkv(T, N, K, segments=segments, D=D, dtype=dtype, B=B)
  want = triton_fwd.row_stats(q, k, seg, scale=D**-0.5, bs=BS, with_pk=True, interpret=True)
  with mosaic_interpret.cached_interpreter_threads():
    got = jax.block_until_ready(mosaic_fwd.row_stats(q, k, seg, scale=D**-0.5, with_pk=True,
                                                     interpret=True))
  assert not mosaic_interpret.interpret_races_found()
  lse_err = np.abs(np.asarray(got[0]) - np.asarray(want[0])).max()
  assert lse_err < 1e-6 * max(1.0, float(np.abs(np.asarray(want[0])).max())) * 8, lse_err
  assert got[1].dtype == jnp.float32 and _rel(got[1], want[1]) < 3e-3, _rel(got[1], want[1])


@pytest.mark.parametrize("T, segments, D, dtype, B, N, K", F1_CASES)
def test_b2_matches_the_triton_b2_interpret(T, segments, D, dtype, B, N, K):
  """B2 with two compute warpgroups against the Triton B2, on a real lse and a random ĝ: equal to
  float32 and 16-bit-product rounding (both round p·ĝ to 16 bits)."""
  q, k, _, seg, _ = _qkv(T, N, K, segments=segments, D=D, dtype=dtype, B=B)
  lse, _ = triton_fwd.row_stats(q, k, seg, scale=D**-0.5, bs=BS, with_pk=False, interpret=True)
  ghat = jax.random.normal(jax.random.PRNGKey(3), lse.shape, jnp.float32)
  want = triton_bwd.dk_correction(q, k, seg, lse, ghat, scale=D**-0.5, bs=BS, interpret=True)
  with mosaic_interpret.cached_interpreter_threads():
    got = jax.block_until_ready(mosaic_b2.dk_correction(q, k, seg, lse, ghat, scale=D**-0.5,
                                                        interpret=True))
  assert not mosaic_interpret.interpret_races_found()
  assert _rel(got, want) < 1e-3, _rel(got, want)


@pytest.mark.parametrize("D", [64, 128])
def test_b2_lowers_to_mosaic_gpu(D):
  """The two-warpgroup B2 lowers for CUDA (shared memory fits)."""
  S = jax.ShapeDtypeStruct
  q, k = S((2, 2048, 4, D), jnp.bfloat16), S((2, 2048, 2, D), jnp.bfloat16)
  rows = S((2, 4, 2048), jnp.float32)
  b2 = lambda *a: mosaic_b2.dk_correction(*a, scale=D**-0.5)
  assert "mosaic_gpu" in _lowered_for_cuda(b2, q, k, S((2, 2048), jnp.int32), rows, rows)


def test_kernels_refuse_what_they_cannot_run():
  q = jnp.zeros((1, 128, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match="16-bit"):
    mosaic_b2.dk_correction(q, q, None, None, None, scale=0.125)
  q = jnp.zeros((1, 192, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of 128"):
    mosaic_fwd.key_sweep(q, q, q, None, None, scale=0.125, eps=1e-9, ckpt_rows=64,
                         with_ckpt=True, key_tiles=2, chain=True)
