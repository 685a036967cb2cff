"""The Hopper (Mosaic GPU) B1 reverse sweep, pallas_kernels/dilution_mgpu.py, on CPU.

Invariants: in GPU interpret mode (threads, SMEM, TMA and barriers simulated, race detector on) its
four outputs equal the Triton B1's on the same forward (bf16, segments, several super-blocks and
key blocks); the whole op's gradients with BlockSizes(b1_impl="mosaic") match the XLA reference;
the kernel lowers through Mosaic GPU for CUDA at D = 64 and 128 (layouts and SMEM checked without a
GPU); float32 inputs are refused naming the field. The compiled comparison runs in
test_dilution_kernel.py's TestCompiledGPU (variant b1_mosaic).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dilution, dilution_bwd, dilution_mgpu, mgpu_compat, reference

R = 128   # checkpoint rows: several super-blocks at T = 256..384 with 64-row tiles
BS = dilution.BlockSizes(block_q_stats=64, block_k_stats=64, block_q=32, block_k=64,
                         block_k_fwd=64, ckpt_rows=R)


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30))


def _qkv(T, N, K, *, segments, seed=0, D=64):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = (1.5 * jax.random.normal(ks[0], (1, T, N, D))).astype(jnp.bfloat16)
  k = (1.5 * jax.random.normal(ks[1], (1, T, K, D))).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (1, T, K, D)).astype(jnp.bfloat16)
  pos = jnp.arange(T)[None]
  seg = ((pos >= T // 3).astype(jnp.int32) + (pos >= T // 2 + 5) if segments
         else jnp.zeros((1, T), jnp.int32))
  return q, k, v, seg, jax.random.normal(ks[3], (1, T, N, D)).astype(jnp.bfloat16)


@pytest.mark.parametrize("T, segments", [(256, False), (384, True)])
def test_matches_the_triton_b1_interpret(T, segments):
  q, k, v, seg, do = _qkv(T, 2, 1, segments=segments)
  scale, eps = 0.125, 1e-9
  out, (lse, _, ssum, _, ckpt) = dilution._forward(q, k, v, seg, scale, eps, BS, True,
                                                   training=True)
  dbar = jnp.einsum("BTND,BTND->BNT", do.astype(jnp.float32), out)
  args = (q, k, v, seg, lse, ssum, dbar, do, ckpt)
  want = dilution_bwd.reverse_sweep(*args, scale=scale, eps=eps, bs=BS, interpret=True)
  with mgpu_compat.cached_interpreter_threads():
    got = jax.block_until_ready(dilution_mgpu.reverse_sweep(*args, scale=scale, eps=eps,
                                                            ckpt_rows=R, interpret=True))
  assert not mgpu_compat.interpret_races_found()
  # dq and dk contract the 16-bit W in both kernels; the probabilities differ by exp2 vs exp.
  for name, a, b, tol in zip(("dq", "ghat", "dk", "dv"), got, want, (2e-3, 1e-5, 2e-3, 2e-4)):
    assert a.shape == b.shape and a.dtype == jnp.float32, name
    assert _rel(a, b) < tol, (name, _rel(a, b))


def test_gradients_match_the_reference_interpret():
  q, k, v, seg, _ = _qkv(256, 4, 2, segments=True, seed=1)   # GQA: 2 query heads per kv head
  bs = dataclasses.replace(BS, b1_impl="mosaic")
  f = lambda q, k, v: dilution.dilution_attention(q, k, v, scale=0.125, segment_ids=seg,
                                                  block_sizes=bs, interpret=True)
  g = lambda q, k, v: reference.dilution_attention(
      *(x.astype(jnp.float32) for x in (q, k, v)), scale=0.125, segment_ids_BT=seg)[0]
  w = jax.random.normal(jax.random.PRNGKey(2), q.shape)
  with mgpu_compat.cached_interpreter_threads():
    ga = jax.grad(lambda *a: (f(*a).astype(jnp.float32) * w).sum(), (0, 1, 2))(q, k, v)
  gb = jax.grad(lambda *a: (g(*a) * w).sum(), (0, 1, 2))(q, k, v)
  for a, b in zip(ga, gb):
    assert _rel(a, b) < 2e-2


@pytest.mark.parametrize("D", [64, 128])
def test_lowers_to_mosaic_gpu(D):
  S = jax.ShapeDtypeStruct
  q, kv = S((2, 2048, 4, D), jnp.bfloat16), S((2, 2048, 2, D), jnp.bfloat16)
  rows = S((2, 4, 2048), jnp.float32)
  fn = jax.jit(lambda *a: dilution_mgpu.reverse_sweep(*a, scale=D**-0.5, eps=1e-9,
                                                      ckpt_rows=1024, interpret=False))
  text = fn.trace(q, kv, kv, S((2, 2048), jnp.int32), rows, rows, rows, q,
                  S((2, 4, 2, 2048), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_refuses_what_it_cannot_run():
  q = jnp.zeros((1, 128, 2, 64), jnp.float32)
  bs = dilution.BlockSizes(b1_impl="mosaic")
  grad = jax.grad(lambda q: dilution.dilution_attention(q, q[:, :, :1], q[:, :, :1],
                                                        block_sizes=bs, interpret=True).sum())
  with pytest.raises(ValueError, match="b1_impl='mosaic': 16-bit"):
    grad(q)
  with pytest.raises(ValueError, match="b1_impl"):
    dilution.BlockSizes(b1_impl="cuda").validate(64)
