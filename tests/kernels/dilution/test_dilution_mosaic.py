"""The Hopper (Mosaic GPU) dilution kernels on CPU: B1 (pallas_kernels/dilution/mosaic_b1.py), F2 and
F1 (dilution_mgpu_fwd.py; F1 is focal_mgpu's forward with V := K) and B2 (dilution_mgpu_b2.py).

Invariants: in GPU interpret mode (threads, SMEM, TMA and barriers simulated, race detector on)
each kernel's outputs equal its Triton counterpart's on the same inputs (bf16, segments, several
super-blocks and key blocks); BlockSizes b1/f2/f1/b2_impl="mosaic" route the op's passes to them;
both lower through Mosaic GPU for CUDA at D = 64 and 128 (layouts and SMEM checked without a
GPU); float32 inputs are refused naming the field. The compiled comparisons run in
test_dilution_kernel.py's TestCompiledGPU (variants mosaic, machine_f1, machine_b2).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.focal import reference

from pallas_kernels.dilution import reference as dilution_reference
from pallas_kernels.dilution import api as dilution
from pallas_kernels.dilution import triton_bwd as dilution_bwd
from pallas_kernels.dilution import triton_fwd as dilution_fwd
from pallas_kernels.dilution import mosaic_b1 as dilution_mgpu
from pallas_kernels.dilution import mosaic_b2 as dilution_mgpu_b2
from pallas_kernels.dilution import mosaic_fwd as dilution_mgpu_fwd
from pallas_kernels.focal import triton as focal_flash
from pallas_kernels import mosaic_common as mgpu_compat

SLOW = pytest.mark.slow  # extra configurations: deselected unless -m slow (pyproject)

R = 128   # checkpoint rows: several super-blocks at T = 256..384 with 64-row tiles
BS = dilution.BlockSizes(block_q_stats=64, block_k_stats=64, block_q=32, block_k=64,
                         block_k_fwd=64, ckpt_rows=R)


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
# fp16; and two batch rows with two kv heads (the H200 timings run B = 2, 12 heads).
CASES = [(256, False, 64, jnp.bfloat16, 1, 2, 1), (384, True, 64, jnp.bfloat16, 1, 2, 1),
         (256, True, 128, jnp.float16, 1, 2, 1), (256, True, 64, jnp.bfloat16, 2, 4, 2)]


def _b1_both(T, N, K, *, segments, D=64, dtype=jnp.bfloat16, B=1, mask_pieces=3, ckpt_rows=R,
             **fields):
  """(Mosaic B1, Triton B1) outputs on the inputs of a real forward; asserts no interpreter
  races. fields: reverse_sweep's lean, skip_masks, chain."""
  q, k, v, seg, do = _qkv(T, N, K, segments=segments, D=D, dtype=dtype, B=B)
  scale, eps = 0.125, 1e-9
  bs = dataclasses.replace(BS, ckpt_rows=ckpt_rows)
  out, (lse, _, ssum, _, ckpt) = dilution._forward(q, k, v, seg, scale, eps, bs, True,
                                                   training=True)
  dbar = jnp.einsum("BTND,BTND->BNT", do.astype(jnp.float32), out)
  args = (q, k, v, seg, lse, ssum, dbar, do, ckpt)
  want = dilution_bwd.reverse_sweep(*args, scale=scale, eps=eps, bs=bs, interpret=True)
  with mgpu_compat.cached_interpreter_threads():
    got = jax.block_until_ready(dilution_mgpu.reverse_sweep(
        *args, scale=scale, eps=eps, ckpt_rows=ckpt_rows, mask_pieces=mask_pieces, **fields,
        interpret=True))
  assert not mgpu_compat.interpret_races_found()
  return got, want


def _assert_b1_close(got, want):
  # dq and dk contract the 16-bit W in both kernels; the probabilities differ by exp2 vs exp.
  for name, a, b, tol in zip(("dq", "ghat", "dk", "dv"), got, want, (2e-3, 1e-5, 2e-3, 2e-4)):
    assert a.shape == b.shape and a.dtype == jnp.float32, name
    assert _rel(a, b) < tol, (name, _rel(a, b))


# The B = 2 GQA case runs slow (CI time): test_two_mask_pieces_stay_close[lean_skip] covers two
# rows and GQA on the Hopper default's path, and TestCompiledGPU every default compiled.
@pytest.mark.parametrize("T, segments, D, dtype, B, N, K",
                         [c if i == 2 else pytest.param(*c, marks=SLOW)
                          for i, c in enumerate(CASES)])
def test_matches_the_triton_b1_interpret(T, segments, D, dtype, B, N, K):
  _assert_b1_close(*_b1_both(T, N, K, segments=segments, D=D, dtype=dtype, B=B))


@SLOW   # not a default (the memory bound); compiled-tested as machine_ckpt64
def test_b1_with_a_checkpoint_per_row_tile_interpret():
  """ckpt_rows = 64 (one row tile per super-block): the Mosaic B1 skips its carry rebuild and
  streams each row tile once; the Triton B1 still rebuilds. Both must agree."""
  _assert_b1_close(*_b1_both(256, 4, 2, segments=True, B=2, ckpt_rows=64))


# BlockSizes fields of the Mosaic B1/F2 that must not change results: mosaic_lean (position
# vectors, the reordered products, XLA's per-query rows; its approx_math does not apply when
# interpreted, see test_lean_matches_compiled) and mosaic_skip_masks (no mask below the diagonal
# within one segment; B = 2: the second row's cuts leave such tiles, and without segments every
# tile below the diagonal is one), and mosaic_chain_pieces (the mask products' pieces in one wgmma
# group).
LEAN = {"plain": {}, "lean": dict(lean=True),
        "lean_skip": dict(lean=True, skip_masks=True, chain=True, B=2)}


@pytest.mark.parametrize("fields", ["lean_skip", pytest.param("lean", marks=SLOW),
                                    pytest.param("plain", marks=SLOW)])
def test_two_mask_pieces_stay_close(fields):
  """BlockSizes.b1_mask_pieces=2: the in-tile prefix/suffix products from two bf16 pieces (~16
  significant bits) instead of three stay within bf16-input noise of the Triton B1 (LEAN: also
  with the fields that must not change it)."""
  got, want = _b1_both(384, 2, 1, segments=True, mask_pieces=2, **LEAN[fields])
  # Measured: dq 5.0e-4, ĝ 2.6e-6, dk 5.8e-4, dv 8.9e-4 (three pieces: dv < 2e-4); bf16's own
  # rounding is 3.9e-3.
  for name, a, b, tol in zip(("dq", "ghat", "dk", "dv"), got, want, (2e-3, 1e-5, 2e-3, 2e-3)):
    assert _rel(a, b) < tol, (name, _rel(a, b))
  for field, bad, D in (("b1_mask_pieces", 1, 64), ("f2_mask_pieces", 1, 64),
                        ("f2_key_tiles", 3, 64), ("f2_key_tiles", 4, 128)):
    with pytest.raises(ValueError, match=field):
      dilution.BlockSizes(**{field: bad}).validate(D)
  with pytest.raises(ValueError, match="mosaic_registers"):
    dilution.BlockSizes(mosaic_registers=250).validate(64)


@pytest.mark.parametrize("T, segments, D, dtype, B, N, K, pieces, tiles, ckpt_rows",
                         [pytest.param(*c, 3, 1, R, marks=SLOW) for c in CASES[:2]]
                         + [c + (3, 1, R) for c in CASES[2:]] + [
                             pytest.param(384, True, 64, jnp.bfloat16, 1, 2, 1, 2, 1, R,
                                          marks=SLOW),
                             (384, True, 64, jnp.bfloat16, 1, 4, 2, 3, 2, R),
                             (256, False, 64, jnp.float16, 1, 2, 1, 3, 4, R),
                             (256, True, 128, jnp.bfloat16, 1, 2, 1, 2, 2, R),
                             (256, True, 64, jnp.bfloat16, 2, 4, 2, 2, 2, 64)])
def test_f2_matches_the_triton_f2_interpret(T, segments, D, dtype, B, N, K, pieces, tiles,
                                            ckpt_rows, **fields):
  """pieces: BlockSizes.f2_mask_pieces (2: the in-tile prefix from two bf16 pieces, ~16 bits);
  tiles: BlockSizes.f2_key_tiles (64-key tiles per CTA, N and S summed over them); ckpt_rows 64:
  a checkpoint per row tile; fields: key_sweep's lean, skip_masks, chain (BlockSizes.mosaic_lean,
  mosaic_skip_masks, mosaic_chain_pieces)."""
  q, k, v, seg, _ = _qkv(T, N, K, segments=segments, D=D, dtype=dtype, B=B)
  bs = dataclasses.replace(BS, ckpt_rows=ckpt_rows)
  lse, _ = dilution_fwd.row_stats(q, k, seg, scale=0.125, bs=bs, with_pk=False, interpret=True)
  want = dilution_fwd.key_sweep(q, k, v, seg, lse, scale=0.125, eps=1e-9, bs=bs,
                                with_ckpt=True, interpret=True)
  with mgpu_compat.cached_interpreter_threads():
    got = jax.block_until_ready(dilution_mgpu_fwd.key_sweep(
        q, k, v, seg, lse, scale=0.125, eps=1e-9, ckpt_rows=ckpt_rows, with_ckpt=True,
        mask_pieces=pieces, key_tiles=tiles, **fields, interpret=True))
  assert not mgpu_compat.interpret_races_found()
  # N contracts the 16-bit σ in both kernels, so a σ whose 16-bit rounding flips moves N by one
  # bf16 ulp (3.9e-3) of σ·v. Flips come from exp2 vs exp (and the CPU's own exp: 2.6e-4 with
  # three pieces on an AMD host, < 2e-4 on earlier ones) and, with two pieces, from σ moving by
  # ~2⁻¹⁶ (measured 1.3e-3 at D = 128). S, total and the checkpoints are float32 sums of the
  # unrounded σ, so they hold the pieces' exactness to 1e-5; the key tiles change only the order
  # of float32 sums (1.3e-7).
  for name, a, b, tol in zip(("N", "S", "total", "ckpt"), got, want, (3e-3, 1e-5, 1e-5, 1e-5)):
    assert a.shape == b.shape and a.dtype == jnp.float32, name
    assert _rel(a, b) < tol, (name, _rel(a, b))


def _op_grad_lowered_for_cuda(bs, *, T):
  """The StableHLO text of dilution_attention's forward + backward with `bs`, lowered for CUDA."""
  q, kv = jnp.zeros((1, T, 2, 64), jnp.bfloat16), jnp.zeros((1, T, 1, 64), jnp.bfloat16)
  grad = jax.grad(lambda q, k, v: dilution.dilution_attention(
      q, k, v, scale=0.125, block_sizes=bs).astype(jnp.float32).sum(), (0, 1, 2))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # jax >= 0.11 warns that Pallas-Triton is deprecated
    return jax.jit(grad).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()


def test_f2_key_tiles_through_the_op():
  """dilution_attention with the Mosaic F2 over 2 key tiles per CTA: T = 200 is padded to a
  multiple of 128 (BlockSizes.pad_multiple), the interpreted op's output matches the reference
  (bf16 output rounding: one ulp at |out| ~ 2.6 is 7.8e-3, 3e-3 relative), and the op, forward
  and backward, lowers for CUDA with it. (Interpreted inside the jitted op this hung 2 of 3 runs
  until conftest.py sized XLA's CPU pool with PJRT_NPROC; it says why.)"""
  bs = dataclasses.replace(BS, f2_impl="mosaic", f2_key_tiles=2)
  assert bs.pad_multiple(training=False) == 128 and bs.pad_multiple() == 128
  q, k, v, seg, _ = _qkv(200, 2, 1, segments=True)
  with mgpu_compat.cached_interpreter_threads():
    got = dilution.dilution_attention(q, k, v, scale=0.125, segment_ids=seg, block_sizes=bs,
                                      interpret=True)
  want = dilution_reference.dilution_attention(*(x.astype(jnp.float32) for x in (q, k, v)), scale=0.125,
                                      segment_ids_BT=seg)[0]
  assert got.shape == q.shape and _rel(got, want) < 5e-3, _rel(got, want)
  text = _op_grad_lowered_for_cuda(bs, T=200)
  assert "mosaic_gpu" in text and 'name = "dilution_key_sweep"' not in text


def test_the_op_runs_both_when_asked():
  """BlockSizes(b1_impl/f2_impl="mosaic") route dilution_attention's forward and backward (and
  prefill's forward) to these kernels: their launches appear in the CUDA lowering. (Their output
  and gradients against the reference run compiled, test_dilution_kernel.TestCompiledGPU; here
  only the routing is checked.)"""
  q, kv = jnp.zeros((1, 256, 2, 64), jnp.bfloat16), jnp.zeros((1, 256, 1, 64), jnp.bfloat16)
  bs = dataclasses.replace(BS, b1_impl="mosaic", f2_impl="mosaic")
  grad = jax.grad(lambda q, k, v: dilution.dilution_attention(
      q, k, v, scale=0.125, block_sizes=bs).astype(jnp.float32).sum(), (0, 1, 2))
  prefill = lambda q, k, v: dilution.dilution_prefill(q, k, v, scale=0.125, block_sizes=bs)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # jax >= 0.11 warns that Pallas-Triton is deprecated
    for fn, triton_kernels in ((grad, ("row_stats", "dk_correction")), (prefill, ("row_stats",))):
      text = jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
      # F1 and B2 stay Triton launches (named); F2 and B1 are Mosaic GPU calls instead.
      assert "mosaic_gpu" in text
      assert all(f'name = "dilution_{name}"' in text for name in triton_kernels)
      assert 'name = "dilution_key_sweep"' not in text
      assert 'name = "dilution_reverse_sweep"' not in text


@pytest.mark.parametrize("D, mask_pieces, registers, tiles, ckpt_rows, lean", [
    (64, 3, 232, 1, 1024, False), (128, 3, 232, 1, 1024, False), (64, 2, 232, 2, 1024, False),
    (128, 2, 232, 2, 1024, False), (64, 2, 256, 4, 1024, False), (64, 2, 256, 2, 64, False),
    (128, 2, 256, 1, 64, False), (64, 2, 256, 2, 1024, True), (128, 2, 256, 1, 1024, True)])
def test_lowers_to_mosaic_gpu(D, mask_pieces, registers, tiles, ckpt_rows, lean):
  """B1 and F2 lower for CUDA (Mosaic rejects overflowing shared memory here, so this checks that
  every key_tiles the F2 accepts fits), also with a checkpoint per row tile (B1 rebuilds none)
  and lean (BlockSizes.mosaic_lean: [64] position vectors, approx_math's rsqrt; with
  mosaic_skip_masks and mosaic_chain_pieces)."""
  S = jax.ShapeDtypeStruct
  q, kv = S((2, 2048, 4, D), jnp.bfloat16), S((2, 2048, 2, D), jnp.bfloat16)
  rows = S((2, 4, 2048), jnp.float32)
  fn = jax.jit(lambda *a: dilution_mgpu.reverse_sweep(*a, scale=D**-0.5, eps=1e-9,
                                                      ckpt_rows=ckpt_rows, mask_pieces=mask_pieces,
                                                      registers=registers, lean=lean,
                                                      skip_masks=lean, chain=lean,
                                                      interpret=False))
  text = fn.trace(q, kv, kv, S((2, 2048), jnp.int32), rows, rows, rows, q,
                  S((2, 4, 2048 // ckpt_rows, 2048), jnp.float32)).lower(
                      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  f2 = jax.jit(lambda *a: dilution_mgpu_fwd.key_sweep(*a, scale=D**-0.5, eps=1e-9,
                                                      ckpt_rows=ckpt_rows, with_ckpt=True,
                                                      mask_pieces=mask_pieces,
                                                      key_tiles=tiles, registers=registers,
                                                      lean=lean, skip_masks=lean, chain=lean))
  text = f2.trace(q, kv, kv, S((2, 2048), jnp.int32), rows).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("segments", [True, pytest.param(False, marks=SLOW)])
def test_f2_lean_interpret(segments):
  """BlockSizes.mosaic_lean and mosaic_skip_masks in F2 (position vectors; approx_math is not
  interpreted) with the Hopper default's other fields at D = 64: two pieces, two key tiles. Two
  key tiles check visible_all's key block index (2·jk + g)."""
  test_f2_matches_the_triton_f2_interpret(256, segments, 64, jnp.bfloat16, 2, 4, 2, 2, 2, R,
                                          lean=True, skip_masks=True, chain=True)


@pytest.mark.skipif(not focal_flash.hopper(), reason="compiled Mosaic GPU: an sm_90 GPU")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("skip_masks", [False, True])
def test_lean_matches_compiled(D, skip_masks):
  """BlockSizes.mosaic_lean compiled (ex2.approx, rsqrt.approx² reciprocals, which interpret mode
  does not run), alone and with mosaic_skip_masks and mosaic_chain_pieces: B1 and F2 within the
  interpret tests' bounds of the same kernels without them."""
  q, k, v, seg, do = _qkv(2048, 4, 2, segments=True, D=D, B=2)
  scale, eps, rows = D**-0.5, 1e-9, 1024
  bs = dataclasses.replace(dilution.BlockSizes.default(D, jnp.bfloat16, hopper=True),
                           ckpt_rows=rows)
  out, (lse, _, ssum, _, ckpt) = dilution._forward(q, k, v, seg, scale, eps, bs, False,
                                                   training=True)
  dbar = jnp.einsum("BTND,BTND->BNT", do.astype(jnp.float32), out)
  args = (q, k, v, seg, lse, ssum, dbar, do, ckpt)
  b1 = [dilution_mgpu.reverse_sweep(*args, scale=scale, eps=eps, ckpt_rows=rows, mask_pieces=2,
                                    lean=lean, skip_masks=skip_masks and lean,
                                    chain=skip_masks and lean)
        for lean in (True, False)]
  for name, a, b, tol in zip(("dq", "ghat", "dk", "dv"), *b1, (2e-3, 1e-5, 2e-3, 2e-3)):
    assert _rel(a, b) < tol, (name, _rel(a, b))
  f2 = [dilution_mgpu_fwd.key_sweep(q, k, v, seg, lse, scale=scale, eps=eps, ckpt_rows=rows,
                                    with_ckpt=True, mask_pieces=2, key_tiles=bs.f2_key_tiles,
                                    lean=lean, skip_masks=skip_masks and lean,
                                    chain=skip_masks and lean)
        for lean in (True, False)]
  for name, a, b, tol in zip(("N", "S", "total", "ckpt"), *f2, (3e-3, 1e-5, 1e-5, 1e-5)):
    assert _rel(a, b) < tol, (name, _rel(a, b))


F1_CASES = [(256, False, 64, jnp.bfloat16, 1, 2, 1), (256, True, 128, jnp.float16, 1, 2, 1),
            (256, True, 64, jnp.bfloat16, 2, 4, 2)]


@pytest.mark.parametrize("T, segments, D, dtype, B, N, K", F1_CASES)
def test_f1_matches_the_triton_f1_interpret(T, segments, D, dtype, B, N, K):
  """F1 as focal_mgpu's forward with V := K: lse to float32 rounding; pk within 3e-3 of the
  Triton F1's (both round p to 16 bits for the P·K product, and each is ~7e-4 from the float32
  product on these inputs; bf16 pk alone would be up to 2⁻⁹ off)."""
  q, k, _, seg, _ = _qkv(T, N, K, segments=segments, D=D, dtype=dtype, B=B)
  want = dilution_fwd.row_stats(q, k, seg, scale=D**-0.5, bs=BS, with_pk=True, interpret=True)
  with mgpu_compat.cached_interpreter_threads():
    got = jax.block_until_ready(dilution_mgpu_fwd.row_stats(q, k, seg, scale=D**-0.5,
                                                            with_pk=True, interpret=True))
  assert not mgpu_compat.interpret_races_found()
  lse_err = np.abs(np.asarray(got[0]) - np.asarray(want[0])).max()
  assert lse_err < 1e-6 * max(1.0, float(np.abs(np.asarray(want[0])).max())) * 8, lse_err
  assert got[1].dtype == jnp.float32 and _rel(got[1], want[1]) < 3e-3, _rel(got[1], want[1])


@pytest.mark.parametrize("T, segments, D, dtype, B, N, K", F1_CASES)
def test_b2_matches_the_triton_b2_interpret(T, segments, D, dtype, B, N, K):
  """B2 with two compute warpgroups (dilution_mgpu_b2) against the Triton B2, on a real lse and
  a random ĝ: equal to float32 and 16-bit-product rounding (both round p·ĝ to 16 bits)."""
  q, k, _, seg, _ = _qkv(T, N, K, segments=segments, D=D, dtype=dtype, B=B)
  lse, _ = dilution_fwd.row_stats(q, k, seg, scale=D**-0.5, bs=BS, with_pk=False, interpret=True)
  ghat = jax.random.normal(jax.random.PRNGKey(3), lse.shape, jnp.float32)
  want = dilution_bwd.dk_correction(q, k, seg, lse, ghat, scale=D**-0.5, bs=BS, interpret=True)
  with mgpu_compat.cached_interpreter_threads():
    got = jax.block_until_ready(dilution_mgpu_b2.dk_correction(q, k, seg, lse, ghat,
                                                               scale=D**-0.5, interpret=True))
  assert not mgpu_compat.interpret_races_found()
  assert _rel(got, want) < 1e-3, _rel(got, want)


@pytest.mark.parametrize("field, triton_kernel", [("f1_impl", "row_stats"),
                                                  ("b2_impl", "dk_correction")])
def test_f1_and_b2_through_the_op(field, triton_kernel):
  """BlockSizes(f1_impl / b2_impl="mosaic"): T = 200 is padded to 256 (128-row or 128-key CTAs);
  the interpreted op's output and all three gradients (dq carries F1's pk, dk B2's correction)
  match the same op with the Triton pass; the op, forward and backward, lowers for CUDA without
  that Triton kernel."""
  bs = dataclasses.replace(BS, **{field: "mosaic"})
  assert bs.pad_multiple() == 128
  q, k, v, seg, _ = _qkv(200, 2, 1, segments=True)
  w = jax.random.normal(jax.random.PRNGKey(5), q.shape)

  def loss(b):
    return lambda q, k, v: (dilution.dilution_attention(
        q, k, v, scale=0.125, segment_ids=seg, block_sizes=b, interpret=True
    ).astype(jnp.float32) * w).sum()

  with mgpu_compat.cached_interpreter_threads():
    got = jax.grad(loss(bs), (0, 1, 2))(q, k, v)
  want = jax.grad(loss(BS), (0, 1, 2))(q, k, v)
  for a, b in zip(got, want):
    assert _rel(a, b) < 1e-2, _rel(a, b)
  text = _op_grad_lowered_for_cuda(bs, T=256)
  assert "mosaic_gpu" in text and f'name = "dilution_{triton_kernel}"' not in text


@pytest.mark.parametrize("D", [64, 128])
def test_b2_lowers_to_mosaic_gpu(D):
  """The two-warpgroup B2 lowers for CUDA at the timed shapes (shared memory fits)."""
  S = jax.ShapeDtypeStruct
  q, k = S((2, 2048, 4, D), jnp.bfloat16), S((2, 2048, 2, D), jnp.bfloat16)
  rows = S((2, 4, 2048), jnp.float32)
  fn = jax.jit(lambda *a: dilution_mgpu_b2.dk_correction(*a, scale=D**-0.5))
  text = fn.trace(q, k, S((2, 2048), jnp.int32), rows, rows).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_refuses_what_it_cannot_run():
  q = jnp.zeros((1, 128, 2, 64), jnp.float32)
  bs = dilution.BlockSizes(b1_impl="mosaic")
  grad = jax.grad(lambda q: dilution.dilution_attention(q, q[:, :, :1], q[:, :, :1],
                                                        block_sizes=bs, interpret=True).sum())
  with pytest.raises(ValueError, match="b1_impl='mosaic': 16-bit"):
    grad(q)
  with pytest.raises(ValueError, match="f2_impl='mosaic': 16-bit"):
    dilution.dilution_attention(q, q[:, :, :1], q[:, :, :1], interpret=True,
                                block_sizes=dilution.BlockSizes(f2_impl="mosaic"))
  for field in ("b1_impl", "f2_impl", "f1_impl", "b2_impl"):
    with pytest.raises(ValueError, match=field):
      dilution.BlockSizes(**{field: "cuda"}).validate(64)
