"""The Pallas TPU dilution kernels (pallas_kernels/dilution/tpu.py) == the XLA reference.

Invariants, in TPU interpret mode on CPU (sequential grid, VMEM scratch and block revisits
checked by the interpreter): the output and the exact gradients of q, k, v match the reference
(fp32 tight, bf16 loose) with GQA, a padded length, one unpacked and one packed batch row, several
key blocks and a partial checkpoint super-block, for block_q below and above block_k; no segment
ids means one segment; causality by gradient; prefill returns the reference's output and demand
totals. On any host, all four passes and the prefill lower to Mosaic TPU.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dilution import reference as dilution_reference
from pallas_kernels.dilution import tpu

EPS = 1e-9
# T = 44 pads to 48. (8, 16, 32): 6 row blocks × 3 key blocks, super-blocks of 4 rows blocks
# (the second partial); (16, 8, 32): row blocks wider than key blocks, 3 row blocks in 2
# super-blocks.
BLOCKS = {jnp.float32: tpu.TpuBlockSizes(block_q=8, block_k=16, ckpt_rows=32),
          jnp.bfloat16: tpu.TpuBlockSizes(block_q=16, block_k=8, ckpt_rows=32)}
TOL = {jnp.float32: dict(out=2e-5, grad=1e-4), jnp.bfloat16: dict(out=1e-2, grad=2e-2)}
B, T, N, K, D = 2, 44, 4, 2, 32


@pytest.fixture(autouse=True)
def _strict_numerics():
  with jax.numpy_rank_promotion("raise"), jax.default_matmul_precision("highest"):
    yield


def _inputs(seed, dtype):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  # ×1.5: sharper softmax, so tiny bids (the ill-conditioned part of the share) occur.
  q = (1.5 * jax.random.normal(ks[0], (B, T, N, D))).astype(dtype)
  k = (1.5 * jax.random.normal(ks[1], (B, T, K, D))).astype(dtype)
  v = jax.random.normal(ks[2], (B, T, K, D)).astype(dtype)
  # Row 0 one document; row 1 three, boundaries on no tile edge.
  pos = jnp.arange(T)
  seg = jnp.stack([jnp.zeros(T, jnp.int32),
                   (pos >= 13).astype(jnp.int32) + (pos >= 29).astype(jnp.int32)])
  return q, k, v, seg, jax.random.normal(ks[3], q.shape)


def _attn(q, k, v, seg, dtype):
  return tpu.dilution_attention(q, k, v, scale=D**-0.5, eps=EPS, segment_ids=seg,
                                block_sizes=BLOCKS[dtype], interpret=True)


def _ref(q, k, v, seg):
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  return dilution_reference.dilution_attention(q, k, v, scale=D**-0.5, eps=EPS,
                                               segment_ids_BT=seg)[0]


def _rel(a, b):
  """Max abs error relative to the reference's largest magnitude."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  err = float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30))
  print(f"rel err {err:.3g}")
  return err


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_and_gradients_match_reference(dtype):
  q, k, v, seg, w = _inputs(1, dtype)
  out = _attn(q, k, v, seg, dtype)
  assert out.dtype == dtype and out.shape == q.shape
  assert _rel(out, _ref(q, k, v, seg)) < TOL[dtype]["out"]
  grads = jax.grad(lambda *a: (_attn(*a, seg, dtype).astype(jnp.float32) * w).sum(),
                   (0, 1, 2))(q, k, v)
  grads_ref = jax.grad(lambda *a: (_ref(*a, seg) * w).sum(), (0, 1, 2))(q, k, v)
  for name, g, gr in zip("qkv", grads, grads_ref):
    assert g.dtype == dtype and g.shape == gr.shape
    assert _rel(g, gr) < TOL[dtype]["grad"], name


def test_causality_by_gradient():
  q, k, v, seg, _ = _inputs(2, jnp.float32)
  t = 21
  f = lambda q, k, v: _attn(q, k, v, seg, jnp.float32)[:, t].sum()
  # q, k AND v: a cumulative quantity can leak the future through any of them.
  for g in jax.grad(f, (0, 1, 2))(q, k, v):
    np.testing.assert_array_equal(np.asarray(g[:, t + 1:]), 0.0)
    assert np.abs(np.asarray(g[:, :t + 1])).max() > 0


def test_no_segment_ids_is_one_segment():
  q, k, v, _, _ = _inputs(3, jnp.float32)
  q, k, v = q[:1, :32], k[:1, :32], v[:1, :32]
  out = tpu.dilution_attention(q, k, v, scale=D**-0.5, eps=EPS,
                               block_sizes=BLOCKS[jnp.float32], interpret=True)
  assert _rel(out, _ref(q, k, v, None)) < TOL[jnp.float32]["out"]


def test_lowers_to_mosaic_tpu():
  """Default blocks, bf16, GQA: forward and backward lower to Mosaic TPU kernels on any host."""
  q = jnp.zeros((1, 1024, 2, 128), jnp.bfloat16)
  kv = jnp.zeros((1, 1024, 1, 128), jnp.bfloat16)
  grad = jax.grad(lambda q, k, v: tpu.dilution_attention(
      q, k, v, scale=0.125, eps=EPS).astype(jnp.float32).sum(), (0, 1, 2))
  text = jax.jit(grad).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).as_text()
  assert set(re.findall(r'kernel_name = "(\w+)"', text)) == {
      "dilution_tpu_row_stats", "dilution_tpu_demand", "dilution_tpu_bwd_rows",
      "dilution_tpu_bwd_keys"}
  prefill = jax.jit(lambda q, k, v: tpu.dilution_prefill(q, k, v, scale=0.125, eps=EPS))
  text = prefill.trace(q, kv, kv).lower(lowering_platforms=("tpu",)).as_text()
  assert set(re.findall(r'kernel_name = "(\w+)"', text)) == {
      "dilution_tpu_row_stats", "dilution_tpu_demand"}


def test_bad_block_sizes_name_the_field():
  q = jnp.zeros((1, 64, 2, 32), jnp.float32)
  for bs, match in ((tpu.TpuBlockSizes(block_q=12), "block_q=12"),
                    (tpu.TpuBlockSizes(block_q=64, ckpt_rows=32), "ckpt_rows=32"),
                    (tpu.TpuBlockSizes(block_k=64), "block_k=64 must be a multiple of 128")):
    with pytest.raises(ValueError, match=match):
      tpu.dilution_attention(q, q, q, scale=0.125, eps=EPS, block_sizes=bs)
  with pytest.raises(ValueError, match="T \\(64\\) must equal S \\(32\\)"):
    tpu.dilution_attention(q, q[:, :32], q[:, :32], scale=0.125, eps=EPS, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefill_matches_reference_output_and_demand(dtype):
  """Prefill: F1 and F2 without checkpoints; the demand totals come from the last row block."""
  q, k, v, _, _ = _inputs(4, dtype)
  out, demand = tpu.dilution_prefill(q, k, v, scale=D**-0.5, eps=EPS, block_sizes=BLOCKS[dtype],
                                     interpret=True)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  out_ref, demand_ref = dilution_reference.dilution_attention(f32(q), f32(k), f32(v),
                                                              scale=D**-0.5, eps=EPS)
  assert out.dtype == dtype and out.shape == q.shape
  assert demand.dtype == jnp.float32 and demand.shape == (B, N, T)
  assert _rel(out, out_ref) < TOL[dtype]["out"]
  assert _rel(demand, demand_ref) < TOL[dtype]["out"]


def test_ops_prefill_runs_the_tpu_kernels_where_dispatch_picks_them(monkeypatch):
  """focaljax.ops.dilution_prefill (the model's cached prefill) calls the TPU prefill."""
  from focaljax import dispatch, ops  # pylint: disable=import-outside-toplevel
  calls = []

  def choose(op, *args, **kwargs):
    del args, kwargs
    calls.append(op)
    return dispatch.Choice("pallas", "tpu", interpret=True)

  monkeypatch.setattr(dispatch, "choose", choose)
  q, k, v, _, _ = _inputs(5, jnp.float32)
  out, demand = ops.dilution_prefill(q, k, v, implementation="auto")
  out_ref, demand_ref = dilution_reference.dilution_attention(q, k, v, scale=D**-0.5, eps=EPS)
  assert calls == ["dilution_prefill"]
  assert _rel(out, out_ref) < TOL[jnp.float32]["out"]
  assert _rel(demand, demand_ref) < TOL[jnp.float32]["out"]
