"""The Triton dilution kernels == the XLA reference (pallas_kernels/dilution/reference.py).

Invariants: forward and exact gradients (q, k, v) match the reference (fp32 tight, bf16/fp16 loose),
with GQA, packed segments and a padded length; prefill demand == Σ_i p; prefill + decode steps
reproduce whole-sequence dilution attention; causality by gradient. `TestInterpret` runs in Pallas
interpret mode (CPU); `TestCompiledGPU` repeats the comparisons compiled on a GPU and runs both
backends' defaults at T = 2048 (`-k Compiled`). `test_lowers_to_triton` checks on any host that
every kernel lowers to Triton IR for CUDA, and that B1's key block changes B1's launch alone.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.dilution as dilution
from pallas_kernels.dilution import reference as dilution_reference
from pallas_kernels.dilution import triton_bwd
from pallas_kernels.dilution.triton_bwd import exact_mask_dot
from pallas_kernels.focal import reference

EPS = 1e-9
# Small tiles so T = 64..96 spans several key blocks, row tiles and checkpoint super-blocks; F2
# and B1 tile the keys unlike B2 (16 and 32 vs 32), as the defaults do (128 vs 64).
SMALL = dilution.BlockSizes(block_q_stats=16, block_k_stats=16, block_q=16, block_k=32,
                            block_k_fwd=16, b1_block_k=32, b1_carries="registers", ckpt_rows=64,
                            block_k_decode=16, split_k_decode=32)
# B1's carries in an HBM slice (the D <= 64 default) must give the same gradients.
B1_VARIANTS = {"scratch": dict(b1_carries="scratch")}
# BlockSizes of the compiled T = 2048 test, over each backend's default: the tuned choices of the
# other head dim, and a checkpoint per 64 rows (the Mosaic B1 then rebuilds no carries).
LONG_VARIANTS = {"default": {}, "ckpt64": dict(ckpt_rows=64),
                 "other_d": dict(b1_block_k=64, b1_carries="registers", f2_key_tiles=1,
                                 chain_pieces=False),
                 "other_d128": dict(b1_block_k=128, b1_carries="scratch", f2_key_tiles=2,
                                    chain_pieces=True)}
# B1's key block unlike B2's (on SMALL, T = 96): B1 wider (3 blocks of 32 vs B2's 6 of 16, as
# 128 over 64 on the GPU) and narrower (6 of 16 vs 3 of 32).
B1_TILES = {"b1k32_b2k16_scratch": dict(block_k=16, b1_block_k=32, b1_carries="scratch"),
            "b1k16_b2k32": dict(b1_block_k=16)}
TOL = {jnp.float32: dict(out=2e-5, grad=1e-4), jnp.bfloat16: dict(out=1e-2, grad=2e-2),
       jnp.float16: dict(out=2e-3, grad=4e-3)}


def _inputs(seed, B, T, N, K, D, dtype, *, segments=False):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  # ×1.5: sharper softmax, so tiny bids (the ill-conditioned part of the share) occur.
  q = (1.5 * jax.random.normal(ks[0], (B, T, N, D))).astype(dtype)
  k = (1.5 * jax.random.normal(ks[1], (B, T, K, D))).astype(dtype)
  v = jax.random.normal(ks[2], (B, T, K, D)).astype(dtype)
  seg = None
  if segments:
    # Three packed documents per row, boundaries not aligned to any tile.
    pos = jnp.arange(T)[None, :]
    cut = jnp.array([[T // 3, T // 2 + 5], [7, T - 9]])[:B]
    seg = (pos >= cut[:, :1]).astype(jnp.int32) + (pos >= cut[:, 1:]).astype(jnp.int32)
  return q, k, v, seg


@pytest.fixture(autouse=True)
def _strict_numerics():
  # "highest": on GPU XLA would otherwise run the fp32 reference's einsums in TF32.
  with jax.numpy_rank_promotion("raise"), jax.default_matmul_precision("highest"):
    yield


def _rel(a, b):
  """Max abs error relative to the reference's largest magnitude."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  err = float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30))
  print(f"rel err {err:.3g}")
  return err


class _DilutionKernelChecks:
  INTERPRET = True
  BS = SMALL
  T = 96

  def setup_method(self):
    if not self.INTERPRET and jax.default_backend() != "gpu":
      pytest.skip("compiled kernels need a GPU; TestInterpret covers CPU")

  def _attn(self, q, k, v, seg, bs=None):
    return dilution.dilution_attention(q, k, v, scale=q.shape[-1] ** -0.5, eps=EPS,
                                       segment_ids=seg, block_sizes=bs or self.BS,
                                       interpret=self.INTERPRET)

  # Shapes are shared between tests so interpret mode compiles each kernel only a few times.
  @pytest.mark.parametrize("dtype, segments", [(jnp.float32, False), (jnp.float32, True),
                                               (jnp.bfloat16, True), (jnp.float16, True)])
  def test_forward_and_gradients_match_reference(self, dtype, segments):
    self._check_against_reference(dtype, segments, self.BS)

  # GQA (4 query heads on 2 kv heads), packed segments, 6 row tiles × 3 key blocks × 2
  # super-blocks with SMALL; the forward is the default's, so this checks B1's gradients.
  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
  @pytest.mark.parametrize("variant", sorted(B1_VARIANTS))
  def test_b1_variant_gradients_match_reference(self, variant, dtype):
    self._check_against_reference(dtype, True, dataclasses.replace(self.BS,
                                                                   **B1_VARIANTS[variant]))

  # Same GQA + segments case with B1 and B2 tiling the keys differently: they must exchange only
  # whole per-row/per-key buffers (ĝ, dq, dk_main, dv, corr), never a tile-indexed one.
  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
  @pytest.mark.parametrize("tiles", sorted(B1_TILES))
  def test_b1_key_block_unlike_b2_gradients_match_reference(self, tiles, dtype):
    self._check_against_reference(dtype, True, dataclasses.replace(self.BS, **B1_TILES[tiles]))

  def _check_against_reference(self, dtype, segments, bs):
    q, k, v, seg = _inputs(1 + segments, 2, self.T, 4, 2, 64, dtype, segments=segments)
    w = jax.random.normal(jax.random.PRNGKey(9), q.shape)
    scale = q.shape[-1] ** -0.5

    def loss_kernel(q, k, v):
      return (self._attn(q, k, v, seg, bs).astype(jnp.float32) * w).sum()

    def loss_ref(q, k, v):
      # The reference on the same (possibly bf16-rounded) values, in fp32.
      q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
      out = dilution_reference.dilution_attention(q, k, v, scale=scale, segment_ids_BT=seg)[0]
      return (out * w).sum()

    out = self._attn(q, k, v, seg, bs)
    assert out.dtype == dtype and out.shape == q.shape
    ref = dilution_reference.dilution_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                scale=scale, segment_ids_BT=seg)[0]
    assert _rel(out, ref) < TOL[dtype]["out"]
    grads = jax.grad(loss_kernel, (0, 1, 2))(q, k, v)
    grads_ref = jax.grad(loss_ref, (0, 1, 2))(q, k, v)
    for name, g, gr in zip("qkv", grads, grads_ref):
      assert g.dtype == dtype
      assert _rel(g, gr) < TOL[dtype]["grad"], (name, _rel(g, gr))

  @pytest.mark.parametrize("D", [128])
  def test_head_dim_and_padding(self, D):
    # T = 72 is not a block multiple: padded inside, padded rows must not change anything.
    q, k, v, _ = _inputs(3, 1, 72, 2, 1, D, jnp.float32)
    scale = D**-0.5
    f = lambda q, k, v: self._attn(q, k, v, None).sum()
    g = lambda q, k, v: dilution_reference.dilution_attention(q, k, v, scale=scale)[0].sum()
    want = dilution_reference.dilution_attention(q, k, v, scale=scale)[0]
    assert _rel(self._attn(q, k, v, None), want) < 2e-5
    for a, b in zip(jax.grad(f, (0, 1, 2))(q, k, v), jax.grad(g, (0, 1, 2))(q, k, v)):
      assert _rel(a, b) < 1e-4

  def test_causality_by_gradient(self):
    q, k, v, seg = _inputs(4, 2, self.T, 4, 2, 64, jnp.float32, segments=True)
    t = 37
    f = lambda q, k, v: self._attn(q, k, v, seg)[:, t].sum()
    for g in jax.grad(f, (0, 1, 2))(q, k, v):
      np.testing.assert_array_equal(np.asarray(g[:, t + 1:]), 0.0)
      assert np.abs(np.asarray(g[:, :t + 1])).max() > 0

  def test_prefill_demand_is_column_total(self):
    q, k, v, _ = _inputs(5, 2, 64, 4, 2, 64, jnp.float32)
    scale = 64**-0.5
    out, demand = dilution.dilution_prefill(q, k, v, scale=scale, eps=EPS, block_sizes=self.BS,
                                            interpret=self.INTERPRET)
    p = reference.softmax_probs(q, k, scale=scale)  # [B, K, G, T, S]
    np.testing.assert_allclose(demand, p.sum(-2).reshape(2, 4, 64), rtol=1e-5, atol=1e-6)
    assert demand.dtype == jnp.float32
    assert _rel(out, dilution_reference.dilution_attention(q, k, v, scale=scale)[0]) < 2e-5

  def test_prefill_then_decode_reproduces_attention(self):
    B, T, N, K, D, n_prompt, s_max, dtype = 2, 80, 4, 2, 64, 64, 96, jnp.float32
    q, k, v, _ = _inputs(6, B, T, N, K, D, dtype)
    scale = D**-0.5
    kw = dict(scale=scale, eps=EPS, block_sizes=self.BS, interpret=self.INTERPRET)
    out_p, dem_p = dilution.dilution_prefill(q[:, :n_prompt], k[:, :n_prompt], v[:, :n_prompt],
                                             **kw)
    k_cache = jnp.zeros((B, s_max, K, D), dtype).at[:, :T].set(k)
    v_cache = jnp.zeros((B, s_max, K, D), dtype).at[:, :T].set(v)
    demand = jnp.zeros((B, N, s_max), jnp.float32).at[:, :, :n_prompt].set(dem_p)
    outs = [out_p]
    for pos in range(n_prompt, T):
      length = jnp.full((B,), pos + 1, jnp.int32)
      o, demand = dilution.dilution_decode_step(q[:, pos], k_cache, v_cache, demand, length, **kw)
      outs.append(o[:, None])
    full, dem_full = dilution_reference.dilution_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), scale=scale)
    assert _rel(jnp.concatenate(outs, 1), full) < TOL[dtype]["out"]
    np.testing.assert_allclose(demand[:, :, :T], dem_full, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(demand[:, :, T:], 0.0)

  def test_decode_ragged_lengths_match_reference(self):
    B, S, N, K, D = 2, 96, 4, 2, 64
    q, k, v, _ = _inputs(7, B, S, N, K, D, jnp.float32)
    # Nonzero demand beyond `length` too: the kernel must leave those keys untouched.
    demand = jax.random.uniform(jax.random.PRNGKey(8), (B, N, S)) * 3.0
    length = jnp.array([19, 64], jnp.int32)
    scale = D**-0.5
    out, dem = dilution.dilution_decode_step(q[:, 0], k, v, demand, length, scale=scale,
                                             eps=EPS, block_sizes=self.BS,
                                             interpret=self.INTERPRET)
    ref_out, ref_dem = dilution_reference.dilution_decode_step(q[:, 0], k, v, demand, length,
                                                               scale=scale)
    assert _rel(out, ref_out) < 2e-5
    np.testing.assert_allclose(dem, ref_dem, rtol=1e-5, atol=1e-6)


class TestInterpret(_DilutionKernelChecks):
  INTERPRET = True


class TestCompiledGPU(_DilutionKernelChecks):
  INTERPRET = False

  @pytest.mark.parametrize("variant", sorted(LONG_VARIANTS))
  @pytest.mark.parametrize("backend", ["triton", "mosaic"])
  @pytest.mark.parametrize("B, D", [(1, 64), (2, 64), (2, 128)])
  def test_default_blocks_long(self, variant, backend, B, D):
    # Each backend's default tiles (variant "default": block_sizes=None) and R = 1024
    # checkpoints: T = 2048 spans two super-blocks. B = 2 checks the batch indexing (per-row
    # segment cuts); D = 128 has its own tiles.
    q, k, v, seg = _inputs(10, B, 2048, 4, 2, D, jnp.bfloat16, segments=True)
    scale = D ** -0.5
    bs = None
    if variant != "default":
      bs = dataclasses.replace(dilution.default_block_sizes(backend, D, jnp.bfloat16),
                               **LONG_VARIANTS[variant])
    f = lambda q, k, v: dilution.dilution_attention(q, k, v, scale=scale, eps=EPS,
                                                    segment_ids=seg, backend=backend,
                                                    block_sizes=bs)
    g = lambda q, k, v: dilution_reference.dilution_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), scale=scale, segment_ids_BT=seg)[0]
    assert _rel(f(q, k, v), g(q, k, v)) < 3e-2
    w = jax.random.normal(jax.random.PRNGKey(0), q.shape)
    ga = jax.grad(lambda *a: (f(*a).astype(jnp.float32) * w).sum(), (0, 1, 2))(q, k, v)
    gb = jax.grad(lambda *a: (g(*a) * w).sum(), (0, 1, 2))(q, k, v)
    for a, b in zip(ga, gb):
      assert _rel(a, b) < 6e-2

  @pytest.mark.parametrize("backend", ["triton", "mosaic"])
  @pytest.mark.parametrize("D", [64, 128])
  def test_default_prefill_long(self, backend, D):
    """Prefill with each backend's defaults at T = 2000 (padded): output and demand totals."""
    q, k, v, _ = _inputs(11, 1, 2000, 4, 2, D, jnp.bfloat16)
    scale = D ** -0.5
    out, demand = dilution.dilution_prefill(q, k, v, scale=scale, eps=EPS, backend=backend)
    want, want_demand = dilution_reference.dilution_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), scale=scale)
    assert _rel(out, want) < 3e-2
    assert _rel(demand, want_demand) < 1e-3


def test_bad_fields_name_the_field():
  for field, value in (("b1_carries", "shared"), ("b1_block_k", 48), ("b1_block_k", 8),
                       ("ckpt_rows", 32), ("ckpt_rows", 96), ("f2_key_tiles", 4),
                       ("chain_pieces", 1), ("split_k_decode", 64)):
    with pytest.raises(ValueError, match=field):
      dilution.BlockSizes(**{field: value}).validate(64, mosaic=True)
  with pytest.raises(ValueError, match="ckpt_rows=64 must be a power of two >= 128"):
    dilution.BlockSizes(block_q=128, ckpt_rows=64).validate(64, mosaic=False)
  with pytest.raises(ValueError, match="backend"):
    dilution.default_block_sizes("cuda", 64, jnp.bfloat16)
  q = jnp.zeros((1, 64, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match="backend"):
    dilution.dilution_attention(q, q, q, scale=0.125, eps=EPS, backend="tpu", interpret=True)


def test_defaults_and_padding():
  # B1's tile: 128 keys with scratch carries at D <= 64, 64 keys in registers above; the Mosaic
  # F2 takes two key tiles and chains its mask pieces at D = 64 only. Both backends share them.
  for backend in dilution.BACKENDS:
    d64 = dilution.default_block_sizes(backend, 64, jnp.bfloat16)
    assert d64 == dilution.BlockSizes() == dilution.default_block_sizes(backend, 32, jnp.float32)
    assert (d64.b1_block_k, d64.b1_carries, d64.f2_key_tiles, d64.chain_pieces) == (
        128, "scratch", 2, True)
    d128 = dilution.default_block_sizes(backend, 128, jnp.float16)
    assert (d128.b1_block_k, d128.b1_carries, d128.f2_key_tiles, d128.chain_pieces) == (
        64, "registers", 1, False)
  # Training pads T to a multiple of every key block; prefill runs neither B1 nor B2; the Mosaic
  # passes take 128-row / 128-key CTAs.
  bs = dilution.BlockSizes(b1_block_k=256)
  bs.validate(64, mosaic=False)
  assert bs.pad_multiple(False) == 256 and bs.pad_multiple(False, training=False) == 128
  assert bs.pad_multiple(True) == 128 and SMALL.pad_multiple(False) == 32
  q = jnp.zeros((1, 384, 2, 64), jnp.float32)  # 384 = 3·128: not a multiple of 256
  with pytest.raises(ValueError, match="b1_block_k=256"):
    triton_bwd.reverse_sweep(q, q, q, None, None, None, None, None, None, scale=0.125,
                             eps=EPS, bs=bs, interpret=True)
  with pytest.raises(ValueError, match="block_k=256"):
    triton_bwd.dk_correction(q, q, None, None, None, scale=0.125,
                             bs=dataclasses.replace(bs, block_k=256), interpret=True)


def test_exact_mask_dot_matches_fp32_product():
  """B1's in-tile suffix: 0/1 mask · fp32 values via bf16 pieces is as accurate as IEEE fp32."""
  T, S = 64, 32
  rng = np.random.default_rng(0)
  # Magnitudes 1e-6..1e3 with random signs: a plain bf16 product would be off by ~4e-3.
  x_TS = (rng.choice([-1.0, 1.0], (T, S)) * 10.0 ** rng.uniform(-6, 3, (T, S))).astype(np.float32)
  later_TT = np.triu(np.ones((T, T), np.float32), k=1)
  exact_TS = later_TT.astype(np.float64) @ x_TS.astype(np.float64)
  bound_TS = later_TT @ np.abs(x_TS).astype(np.float64) + 1e-30  # condition: Σ|x| per entry
  got_TS = np.asarray(exact_mask_dot(jnp.asarray(later_TT), jnp.asarray(x_TS)), np.float64)
  ieee_TS = np.asarray(jnp.dot(later_TT, x_TS, precision="highest"), np.float64)
  bf16_TS = np.asarray(jnp.dot(later_TT.astype(jnp.bfloat16), x_TS.astype(jnp.bfloat16),
                               preferred_element_type=jnp.float32), np.float64)
  err = lambda a: float((np.abs(a - exact_TS) / bound_TS).max())
  print(f"rel err: split {err(got_TS):.3g}, ieee {err(ieee_TS):.3g}, bf16 {err(bf16_TS):.3g}")
  assert err(got_TS) < 1e-6 and err(ieee_TS) < 1e-6
  assert err(bf16_TS) > 1e-3  # the test can tell a precision loss apart

def test_lowers_to_triton():
  """Every kernel (forward, backward, prefill, decode) lowers to Triton IR for CUDA, here too."""
  q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
  kv = jnp.zeros((1, 256, 1, 64), jnp.bfloat16)
  seg = jnp.zeros((1, 256), jnp.int32)
  grad = jax.grad(lambda q, k, v: dilution.dilution_attention(
      q, k, v, scale=0.125, eps=EPS, segment_ids=seg).astype(jnp.float32).sum(), (0, 1, 2))
  decode = lambda q, k, v: dilution.dilution_decode_step(
      q[:, 0], k, v, jnp.zeros((1, 2, 256)), 100, scale=0.125, eps=EPS)
  prefill = lambda q, k, v: dilution.dilution_prefill(q, k, v, scale=0.125, eps=EPS)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # jax >= 0.11 warns that Pallas-Triton is deprecated
    for fn in (grad, prefill, decode):
      text = jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
      assert "__gpu$xla.gpu.triton" in text


def test_b1_tile_reaches_only_the_reverse_sweep():
  """b1_block_k changes B1's launch (grid) and leaves B2's and the forward's; B1 runs 8 warps."""
  q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
  kv = jnp.zeros((1, 256, 1, 64), jnp.bfloat16)
  bs = dilution.default_block_sizes("triton", 64, jnp.bfloat16)
  grad = jax.grad(lambda q, k, v: dilution.dilution_attention(
      q, k, v, scale=0.125, eps=EPS, block_sizes=bs).astype(jnp.float32).sum(), (0, 1, 2))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    text = jax.jit(grad).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  launches = re.findall(r'grid_x = (\d+)[^\n]*?name = "dilution_(\w+)", num_stages = \d+ : i32, '
                        r'num_warps = (\d+)', text)
  # (programs along T, warps): T/128 and 8 for B1; T/64 and 4 for B2 (D = 64).
  assert dict((name, (int(g), int(w))) for g, name, w in launches) == {
      "row_stats": (4, 4), "key_sweep": (2, 4), "reverse_sweep": (2, 8),
      "dk_correction": (4, 4)}
