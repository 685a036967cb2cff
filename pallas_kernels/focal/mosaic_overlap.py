"""focal_mgpu's kv loop with FlashAttention-3's intra-warpgroup overlap (`BlockSizes.overlap_softmax`).

The plain loop (focal_mgpu `step`) runs, per kv block j and compute warpgroup,
  S_j = q·k_jᵀ  ->  softmax(S_j)  ->  acc += P_j·v_j
one after the other; only the other warpgroup (ping-pong) fills the tensor cores meanwhile. Here
block j's softmax runs while the same warpgroup's previous p·v is still on the tensor cores
(FA3, Shah et al. 2024, §3.2 "intra-warpgroup overlapping", Algorithm 2):

  prologue   S_0 = q·k_0ᵀ; softmax(S_0) -> P_0, m, l
  j = 1..n-1 issue S_j = q·k_jᵀ, then acc·α_{j-1} + P_{j-1}·v_{j-1}; wait for S_j only
             (wgmma groups retire in issue order); softmax(S_j) -> P_j, m, l, α_j; wait for p·v
  epilogue   acc·α_{n-1} + P_{n-1}·v_{n-1}

Carries per compute warpgroup: acc [block_q, D] f32, m and l [block_q] f32 as in the plain loop,
plus P_{j-1} [block_q, block_kv] in the input dtype and α_{j-1} [block_q] f32: one more 16-bit
tile of registers (32 per thread at block_kv = 128) and the S tile (P_j in float32, exponentiated
in place) live beside the in-flight acc. P_j is rounded to 16 bits only after the p·v retires.
The ping-pong schedule keeps its two rendezvous per block (one while the matmuls run, one after
the softmax), so warpgroup 0's catch-up loop in focal_mgpu still balances it. Barrier order:
K_j is released once S_j is read, V_{j-1} once its p·v has retired; the producer and the ring
(slots, phases) are focal_mgpu's, unchanged.

Measured on the H200 (thirtieth session, BENCHMARKS.md): compiled tests pass and ptxas neither
spills nor serializes, but the forward is level with the plain loop at (24,16,2K,128) and 5-7%
slower at T >= 4K, so `overlap_softmax` is off. With two warpgroups in ping-pong, one's softmax
already runs under the other's matmuls.

The first block is always masked when causal (the mask is the exact s <= t test, so it is also
right for a block wholly below the diagonal); later blocks take focal_mgpu's unmasked / masked
split.
"""

from __future__ import annotations

import functools

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import mosaic_common as mc


def _scaled(acc_QD, alpha_Q):
  return acc_QD * lax.broadcast_in_dim(alpha_Q, acc_QD.shape, [0])


def blocks(carry, *, block_softmax, key_ids, q_smem, k_smem, v_smem, k_barriers, v_barriers,
           k_consumed, v_consumed, schedule_barrier, slot_of, kv_steps, full_steps, causal,
           interpret):
  """Runs kv blocks [0, kv_steps) of one compute warpgroup; carry and result (acc, m, l).

  block_softmax(s_QK, j, m_Q, key ids, masked=) -> (p f32, new max, α); key_ids(slot) -> the
  slot's key segment ids or None. Expects K_0 landed (focal_mgpu waits on it); kv_steps >= 1.
  """
  acc_QD, m_Q, l_Q = carry
  dtype = q_smem.dtype

  def wait_k(j):
    @pl.when(j < kv_steps)
    def _():
      plgpu.barrier_wait(k_barriers.at[slot_of(j)])

  # Prologue: block 0's logits alone.
  segk_K = key_ids(slot_of(0))
  s_QK = mc.mma(q_smem, k_smem.at[slot_of(0)], transpose_b=True, during=schedule_barrier,
                interpret=interpret)
  plgpu.barrier_arrive(k_consumed.at[slot_of(0)])
  p_QK, m_Q, alpha_Q = block_softmax(s_QK, 0, m_Q, segk_K, masked=causal)
  l_Q = l_Q * alpha_Q + p_QK.sum(axis=1)
  p16_QK = p_QK.astype(dtype)
  p16_QK, m_Q, l_Q, alpha_Q = lax.optimization_barrier((p16_QK, m_Q, l_Q, alpha_Q))
  schedule_barrier()
  wait_k(1)

  p_placeholder = mc.layout_cast(jnp.zeros(s_QK.shape, jnp.float32), plgpu.Layout.WGMMA,
                                 interpret=interpret)  # state slot for the f32 P (see mma_then)

  def step(j, carry, *, masked):
    acc_QD, m_Q, l_Q, alpha_Q, p16_QK = carry
    slot, prev = slot_of(j), slot_of(j - 1)
    segk_K = key_ids(slot)
    plgpu.barrier_wait(v_barriers.at[prev])

    def softmax_j(s_QK):  # runs while acc += P_{j-1}·v_{j-1} is still on the tensor cores
      plgpu.barrier_arrive(k_consumed.at[slot])
      p_QK, m_new, alpha_new = block_softmax(s_QK, j, m_Q, segk_K, masked=masked)
      return p_QK, m_new, l_Q * alpha_new + p_QK.sum(axis=1), alpha_new

    acc_QD, (p_QK, m_Q, l_Q, alpha_Q) = mc.mma_then(
        (q_smem, k_smem.at[slot], True), (p16_QK, v_smem.at[prev], _scaled(acc_QD, alpha_Q), False),
        after_first=softmax_j, state=(p_placeholder, m_Q, l_Q, alpha_Q), during=schedule_barrier,
        interpret=interpret)
    # Rounded only now: registers that feed a wgmma (P_j, for the next p·v) must not be written
    # while one is in flight, or ptxas serializes every wgmma of the kernel (warning C7513,
    # H200, thirtieth session; FA3 converts P after its wait too).
    p16_QK = p_QK.astype(dtype)
    plgpu.barrier_arrive(v_consumed.at[prev])
    acc_QD, p16_QK, m_Q, l_Q, alpha_Q = lax.optimization_barrier(
        (acc_QD, p16_QK, m_Q, l_Q, alpha_Q))
    schedule_barrier()
    wait_k(j + 1)
    return acc_QD, m_Q, l_Q, alpha_Q, p16_QK

  carry = (acc_QD, m_Q, l_Q, alpha_Q, p16_QK)
  first_masked = jnp.maximum(full_steps, 1)
  carry = lax.fori_loop(1, first_masked, functools.partial(step, masked=False), carry)
  if causal:
    carry = lax.fori_loop(first_masked, kv_steps, functools.partial(step, masked=True), carry)
  acc_QD, m_Q, l_Q, alpha_Q, p16_QK = carry

  # Epilogue: the last block's p·v.
  last = slot_of(kv_steps - 1)
  plgpu.barrier_wait(v_barriers.at[last])
  acc_QD = mc.mma(p16_QK, v_smem.at[last], acc=_scaled(acc_QD, alpha_Q), during=schedule_barrier,
                  interpret=interpret)
  plgpu.barrier_arrive(v_consumed.at[last])
  schedule_barrier()
  return acc_QD, m_Q, l_Q
