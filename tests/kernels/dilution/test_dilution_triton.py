"""Pallas dilution kernels == the XLA reference (pallas_kernels/focal/reference.py).

Invariants: forward and exact gradients (q, k, v) match the reference (fp32 tight, bf16/fp16 loose),
with GQA, packed segments and a padded length; prefill demand == Σ_i p; prefill + decode steps
reproduce whole-sequence dilution attention; causality by gradient. `TestInterpret` runs in Pallas
interpret mode (CPU); `TestCompiledGPU` repeats the comparisons compiled (Triton) on a GPU.
`test_lowers_to_triton` checks on any host that every kernel lowers to Triton IR for CUDA, and
that the B1-only tile fields (b1_block_k, b1_warps) change B1's launch alone.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.focal import reference

from pallas_kernels.dilution import reference as dilution_reference
from pallas_kernels.dilution import api as dilution
from pallas_kernels.dilution import triton_bwd as dilution_bwd
from pallas_kernels.dilution.triton_bwd import exact_mask_dot

# Small tiles so T = 64..96 spans several key blocks, row tiles and checkpoint super-blocks; F2
# tiles the keys unlike B1/B2 (16 vs 32), as the defaults do (128 vs 64).
SMALL = dilution.BlockSizes(block_q_stats=16, block_k_stats=16, block_q=16, block_k=32,
                            block_k_fwd=16, ckpt_rows=32, block_k_decode=16, split_k_decode=32)
# B1 variants (BlockSizes fields, default off) that must give the same gradients as the default;
# the compiled long test also runs the wider key block that bench/dilution.py times with scratch.
B1_VARIANTS = {"scratch": dict(b1_carries="scratch")}
B1_VARIANTS_LONG = {"default": {}, **B1_VARIANTS,
                    "scratch_k128_w8": dict(b1_carries="scratch", block_k=128, num_warps=8),
                    # B1-only: 128 keys, 8 warps for B1 while B2 keeps 64 keys, 4 warps.
                    "scratch_b1k128_w8": dict(b1_carries="scratch", b1_block_k=128, b1_warps=8),
                    # F2 and B1 on Hopper's wgmma/TMA (dilution_mgpu*.py; CPU tests:
                    # test_dilution_mgpu.py).
                    "mosaic": dict(b1_impl="mosaic", f2_impl="mosaic"),
                    # The Mosaic B1 with two bf16 pieces per in-tile mask product.
                    "mosaic_2p": dict(b1_impl="mosaic", b1_mask_pieces=2),
                    # Both Mosaic passes at 232 registers per compute thread (default 256).
                    "mosaic_r232": dict(b1_impl="mosaic", f2_impl="mosaic", b1_mask_pieces=2,
                                        mosaic_registers=232),
                    # Both Mosaic passes with two bf16 pieces in their in-tile products.
                    "mosaic_f2_2p": dict(b1_impl="mosaic", f2_impl="mosaic", b1_mask_pieces=2,
                                         f2_mask_pieces=2),
                    # The Mosaic F2 with 4 key tiles per CTA (one reduce-add per row tile).
                    "mosaic_f2_k4": dict(b1_impl="mosaic", f2_impl="mosaic", b1_mask_pieces=2,
                                         f2_key_tiles=4),
                    # The D = 128 Hopper default before the twenty-ninth session ("machine" now
                    # runs both Mosaic passes; "mosaic_2p" is the old D = 64 one).
                    "triton_b1": dict(b1_impl="triton", f2_impl="mosaic")}
# The Hopper default with one of F1 (focal_mgpu's forward with V := K) and B2 (dilution_mgpu_b2)
# back on Triton: each Mosaic pass alone (both are the default since the thirty-second session).
# machine_ckpt64: a checkpoint per row tile, so the Mosaic B1 rebuilds no carries.
# machine_lean_off: without BlockSizes.mosaic_lean, mosaic_skip_masks and mosaic_chain_pieces
# (the default before the thirty-fourth session); machine_masked: lean, but every tile masked;
# machine_chain / machine_chain_off: the mask products' bf16 pieces in one wgmma group or awaited
# one by one (BlockSizes.mosaic_chain_pieces: the default at D = 64 since the thirty-fifth
# session, off at 128).
HOPPER_PLUS = {"machine_f1": dict(b2_impl="triton"), "machine_b2": dict(f1_impl="triton"),
               "machine_ckpt64": dict(ckpt_rows=64),
               "machine_lean_off": dict(mosaic_lean=False, mosaic_skip_masks=False,
                                        mosaic_chain_pieces=False),
               "machine_masked": dict(mosaic_skip_masks=False),
               "machine_chain": dict(mosaic_chain_pieces=True),
               "machine_chain_off": dict(mosaic_chain_pieces=False)}
# B1's key block unlike B2's (on SMALL, T = 96): B1 wider (3 blocks of 32 vs B2's 6 of 16, as
# b1_block_k=128 over block_k=64 on the GPU) and narrower (6 of 16 vs 3 of 32); warps only matter
# compiled.
B1_TILES = {"b1k32_b2k16_scratch": dict(block_k=16, b1_block_k=32, b1_warps=8,
                                        b1_carries="scratch"),
            "b1k16_b2k32": dict(b1_block_k=16, b1_warps=2)}
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
    return dilution.dilution_attention(q, k, v, scale=q.shape[-1] ** -0.5, segment_ids=seg,
                                       block_sizes=bs or self.BS, interpret=self.INTERPRET)

  # Shapes are shared between tests so interpret mode compiles each kernel only a few times.
  @pytest.mark.parametrize("dtype, segments", [(jnp.float32, False), (jnp.float32, True),
                                               (jnp.bfloat16, True), (jnp.float16, True)])
  def test_forward_and_gradients_match_reference(self, dtype, segments):
    self._check_against_reference(dtype, segments, self.BS)

  # GQA (4 query heads on 2 kv heads), packed segments, 6 row tiles × 3 key blocks × 3
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
    ref = dilution_reference.dilution_attention(*(x.astype(jnp.float32) for x in (q, k, v)), scale=scale,
                                       segment_ids_BT=seg)[0]
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
    assert _rel(self._attn(q, k, v, None), dilution_reference.dilution_attention(q, k, v, scale=scale)[0]) < 2e-5
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
    out, demand = dilution.dilution_prefill(q, k, v, scale=scale, block_sizes=self.BS,
                                            interpret=self.INTERPRET)
    p = reference.softmax_probs(q, k, scale=scale)  # [B, K, G, T, S]
    np.testing.assert_allclose(demand, p.sum(-2).reshape(2, 4, 64), rtol=1e-5, atol=1e-6)
    assert demand.dtype == jnp.float32
    assert _rel(out, dilution_reference.dilution_attention(q, k, v, scale=scale)[0]) < 2e-5

  def test_prefill_then_decode_reproduces_attention(self):
    B, T, N, K, D, n_prompt, s_max, dtype = 2, 80, 4, 2, 64, 64, 96, jnp.float32
    q, k, v, _ = _inputs(6, B, T, N, K, D, dtype)
    scale = D**-0.5
    kw = dict(scale=scale, block_sizes=self.BS, interpret=self.INTERPRET)
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
    full, dem_full = dilution_reference.dilution_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                  scale=scale)
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
                                             block_sizes=self.BS, interpret=self.INTERPRET)
    ref_out, ref_dem = dilution_reference.dilution_decode_step(q[:, 0], k, v, demand, length, scale=scale)
    assert _rel(out, ref_out) < 2e-5
    np.testing.assert_allclose(dem, ref_dem, rtol=1e-5, atol=1e-6)


class TestInterpret(_DilutionKernelChecks):
  INTERPRET = True


class TestCompiledGPU(_DilutionKernelChecks):
  INTERPRET = False

  @pytest.mark.parametrize("variant", sorted(B1_VARIANTS_LONG) + ["machine", *HOPPER_PLUS])
  @pytest.mark.parametrize("B, D", [(1, 64), (2, 64), (2, 128)])
  def test_default_blocks_long(self, variant, B, D):
    # Default tiles and R = 1024 checkpoints: T = 2048 spans two super-blocks. B = 2 checks the
    # batch indexing (per-row segment cuts); D = 128 has its own Mosaic tiles and spills.
    if D == 128 and variant.startswith("scratch_k128"):
      pytest.skip("the 128-key tiles were only tuned at D = 64")
    if D == 128 and variant == "mosaic_f2_k4":
      pytest.skip("4 key tiles per F2 CTA overflow shared memory at D = 128")
    q, k, v, seg = _inputs(10, B, 2048, 4, 2, D, jnp.bfloat16, segments=True)
    scale = D ** -0.5
    # "machine": no block_sizes, i.e. what the op picks here (dilution.default_block_sizes).
    if variant == "machine":
      bs = None
    elif variant in HOPPER_PLUS:
      bs = dataclasses.replace(dilution.BlockSizes.default(D, jnp.bfloat16, hopper=True),
                               **HOPPER_PLUS[variant])
    else:
      bs = dilution.BlockSizes(**B1_VARIANTS_LONG[variant])
    f = lambda q, k, v: dilution.dilution_attention(q, k, v, scale=scale, segment_ids=seg,
                                                    block_sizes=bs)
    g = lambda q, k, v: dilution_reference.dilution_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), scale=scale, segment_ids_BT=seg)[0]
    assert _rel(f(q, k, v), g(q, k, v)) < 3e-2
    w = jax.random.normal(jax.random.PRNGKey(0), q.shape)
    ga = jax.grad(lambda *a: (f(*a).astype(jnp.float32) * w).sum(), (0, 1, 2))(q, k, v)
    gb = jax.grad(lambda *a: (g(*a) * w).sum(), (0, 1, 2))(q, k, v)
    for a, b in zip(ga, gb):
      assert _rel(a, b) < 6e-2


def test_bad_b1_carries_names_the_field():
  with pytest.raises(ValueError, match="b1_carries"):
    dilution.BlockSizes(b1_carries="shared").validate(64)


@pytest.mark.parametrize("field, value", [("b1_block_k", 48), ("b1_block_k", 8),
                                          ("b1_warps", 3), ("b1_warps", 32)])
def test_bad_b1_tile_names_the_field(field, value):
  with pytest.raises(ValueError, match=field):
    dilution.BlockSizes(**{field: value}).validate(64)


def test_b1_block_k_sets_padding_and_refuses_a_non_dividing_t():
  bs = dilution.BlockSizes(b1_block_k=256, b1_warps=8)
  bs.validate(64)
  assert (bs.keys_b1(), bs.warps_b1(64), bs.warps(64)) == (256, 8, 4)
  assert dilution.BlockSizes().keys_b1() == 64 and dilution.BlockSizes().warps_b1(128) == 8
  # The op's default: B1's measured tile at D <= 64, the plain fields at D = 128.
  d64 = dilution.BlockSizes.default(64)
  assert (d64.b1_carries, d64.keys_b1(), d64.warps_b1(64), d64.block_k) == ("scratch", 128, 8, 64)
  assert dilution.BlockSizes.default(128) == dilution.BlockSizes()
  # On Hopper with 16-bit inputs: all four passes on Mosaic, two mask pieces, lean elementwise
  # code without masks below the diagonal, and at D = 64 the mask products' pieces in one wgmma
  # group and two key tiles per F2 CTA; float32, other head dims and non-Hopper GPUs keep Triton.
  hop = functools.partial(dilution.BlockSizes.default, hopper=True)
  both = dict(b1_impl="mosaic", f2_impl="mosaic", f1_impl="mosaic", b2_impl="mosaic",
              b1_mask_pieces=2, f2_mask_pieces=2, mosaic_lean=True, mosaic_skip_masks=True)
  assert hop(64, jnp.bfloat16) == dataclasses.replace(d64, **both, f2_key_tiles=2,
                                                      mosaic_chain_pieces=True)
  assert hop(128, jnp.float16) == dilution.BlockSizes(**both)
  assert hop(64, jnp.float32) == d64 and hop(32, jnp.bfloat16) == dilution.BlockSizes.default(32)
  assert hop(128, jnp.float32) == dilution.BlockSizes()
  assert dilution.BlockSizes.default(64, jnp.bfloat16) == d64
  # Training pads T to a multiple of both key blocks; prefill runs neither B1 nor B2.
  assert bs.pad_multiple() == 256 and bs.pad_multiple(training=False) == 128
  q = jnp.zeros((1, 384, 2, 64), jnp.float32)  # 384 = 3·128: not a multiple of 256
  with pytest.raises(ValueError, match="b1_block_k=256"):
    dilution_bwd.reverse_sweep(q, q, q, None, None, None, None, None, None, scale=0.125,
                               eps=1e-9, bs=bs, interpret=True)
  with pytest.raises(ValueError, match="block_k=256"):
    dilution_bwd.dk_correction(q, q, None, None, None, scale=0.125,
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
      q, k, v, scale=0.125, segment_ids=seg).astype(jnp.float32).sum(), (0, 1, 2))
  decode = lambda q, k, v: dilution.dilution_decode_step(q[:, 0], k, v,
                                                         jnp.zeros((1, 2, 256)), 100, scale=0.125)
  prefill = lambda q, k, v: dilution.dilution_prefill(q, k, v, scale=0.125)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # jax >= 0.11 warns that Pallas-Triton is deprecated
    for fn in (grad, prefill, decode):
      text = jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
      assert "__gpu$xla.gpu.triton" in text


def test_b1_tile_reaches_only_the_reverse_sweep():
  """b1_block_k / b1_warps change B1's launch (grid, warps) and leave B2's and the forward's."""
  q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
  kv = jnp.zeros((1, 256, 1, 64), jnp.bfloat16)
  bs = dilution.BlockSizes(**B1_VARIANTS_LONG["scratch_b1k128_w8"])
  grad = jax.grad(lambda q, k, v: dilution.dilution_attention(
      q, k, v, scale=0.125, block_sizes=bs).astype(jnp.float32).sum(), (0, 1, 2))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    text = jax.jit(grad).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  launches = re.findall(r'grid_x = (\d+)[^\n]*?name = "dilution_(\w+)", num_stages = \d+ : i32, '
                        r'num_warps = (\d+)', text)
  # (programs along T, warps): T/128 and 8 for B1; T/64 and 4 for B2 (D = 64).
  assert dict((name, (int(g), int(w))) for g, name, w in launches) == {
      "row_stats": (4, 4), "key_sweep": (2, 4), "reverse_sweep": (2, 8),
      "dk_correction": (4, 4)}
