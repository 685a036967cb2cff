"""The focal and dilution references against naive per-element loops (numpy, float64)."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.focal import reference

from pallas_kernels.dilution import reference as dilution_reference


def _inputs(seed, B=2, T=7, N=4, K=2, D=8):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, T, N, D)).astype(np.float32)
  k = rng.normal(size=(B, T, K, D)).astype(np.float32)
  v = rng.normal(size=(B, T, K, D)).astype(np.float32)
  return q, k, v


def _naive(q, k, v, scale_BNT, causal, seg, dilution=False, eps=1e-9):
  B, T, N, D = q.shape
  K = k.shape[2]
  out = np.zeros((B, T, N, D))
  demand = np.zeros((B, N, T))
  for b in range(B):
    for n in range(N):
      kh = n // (N // K)
      p = np.zeros((T, T))
      for i in range(T):
        vis = [j for j in range(T)
               if (not causal or j <= i) and (seg is None or seg[b, i] == seg[b, j])]
        z = np.array([scale_BNT[b, n, i] * np.dot(q[b, i, n], k[b, j, kh]) for j in vis],
                     np.float64)
        e = np.exp(z - z.max())
        for j, pj in zip(vis, e / e.sum()):
          p[i, j] = pj
      a = p.copy()
      if dilution:
        for i in range(T):
          committed = p[:i].sum(0)
          share = p[i] / (committed + p[i] + eps)
          a[i] = share / (share.sum() + eps)
      out[b, :, n] = a @ v[b, :, kh].astype(np.float64)
      demand[b, n] = p.sum(0)
  return out, demand


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("segments", [False, True])
def test_attention_matches_loop(causal, segments):
  q, k, v = _inputs(1)
  B, T, N, _ = q.shape
  seg = np.array([[1, 1, 1, 2, 2, 3, 3], [1, 1, 1, 1, 1, 1, 2]]) if segments else None
  scale = np.random.default_rng(2).uniform(0.1, 0.6, size=(B, N, T)).astype(np.float32)
  got = reference.attention(q, k, v, scale=scale, causal=causal, segment_ids_BT=seg)
  want, _ = _naive(q, k, v, scale, causal, seg)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("segments", [False, True])
def test_dilution_matches_loop(segments):
  q, k, v = _inputs(3)
  B, T, N, D = q.shape
  seg = np.array([[1, 1, 2, 2, 2, 2, 3], [1, 1, 1, 1, 2, 2, 2]]) if segments else None
  out, demand = dilution_reference.dilution_attention(q, k, v, scale=0.4, segment_ids_BT=seg)
  want, want_demand = _naive(q, k, v, np.full((B, N, T), 0.4), True, seg, dilution=True)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(demand, want_demand, rtol=2e-5, atol=2e-5)


def test_decode_steps_reproduce_full_dilution():
  q, k, v = _inputs(4, T=9)
  B, T, N, D = q.shape
  full, _ = dilution_reference.dilution_attention(q, k, v)
  n = 4
  out_p, demand_p = dilution_reference.dilution_attention(q[:, :n], k[:, :n], v[:, :n])
  demand = jnp.zeros((B, N, T)).at[:, :, :n].set(demand_p)
  outs = [out_p]
  for t in range(n, T):
    o, demand = dilution_reference.dilution_decode_step(q[:, t], k, v, demand, t + 1)
    outs.append(o[:, None])
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-5, atol=1e-5)


def test_bad_shapes_raise():
  q, k, v = _inputs(5)
  with pytest.raises(ValueError, match="multiple of kv heads"):
    reference.attention(q[:, :, :3], k, v, scale=1.0)
  with pytest.raises(ValueError, match="broadcast"):
    reference.attention(q, k, v, scale=jnp.ones((3, 3)))
