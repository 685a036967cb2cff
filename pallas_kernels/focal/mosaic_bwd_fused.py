"""Single-pass Hopper (Mosaic GPU) backward of focal flash attention: dq, dk, dv and d_scale.

FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608) §3 / Algorithm 3: one kernel over kv
blocks that also produces dq, by adding each tile's dq contribution into a float32 accumulator in
global memory. 5 matmuls per tile pair instead of the 7 of focal_mgpu_bwd's two kernels (which
recompute q·kᵀ and dO·vᵀ in their dq pass). Same signature and math as `focal_mgpu_bwd.backward`
(r = q·kᵀ float32, c = LOG2E·s, lse in base 2, delta = rowsum(dO·O) from `backward_rows`):
  p = exp2(c·r − lse), dP = dO·vᵀ, dx = p ⊙ (dP − delta)     (dx = dL/dlogits)
  dv_s = Σ_t p_ts dO_t;  dk_s = Σ_t s_t dx_ts q_t;  acc_t = Σ_s dx_ts k_s   (in the kernel)
  dq_t = s_t·acc_t;  d_scale_t = Σ_s dx_ts r_ts = q_t·acc_t               (XLA epilogue)
The epilogue reads acc once for both: d_scale costs the kernel nothing. acc sums the 16-bit dx
that the tensor cores see, so d_scale carries that rounding (focal_mgpu_bwd's dq kernel sums
dx·r in float32 instead; both stay within the tests' tolerance).

Kernel `_kernel`, grid (Hkv, S / (W·block_kv_dkv), B), W = 2 compute warpgroups + 1 TMA producer
(FA3 §3.1 warp specialisation, 240 / 24 registers). Compute warpgroup w keeps its k, v tile
[bkv, D] in SMEM and dk, dv [bkv, D] float32 in registers; the producer streams q, dO [bq, D] and
the rows (c, lse, delta) through a ring of `max_concurrent_steps` slots, for each of the G query
heads of this kv head in turn, from the first q block at or below the CTA's diagonal (causal) to
the end (the ring, skip and mask logic of focal_mgpu_bwd's dk/dv kernel). Per step, [bkv, bq]
tiles ("KQ"):
  r = k·qᵀ;  dv += p·dO and dP = v·dOᵀ (issued together);  dk += (s ⊙ dx)·q (dx from registers);
  dx → SMEM tile ds (16-bit, stored while the dk wgmma runs);  acc_QD = dsᵀ·k (transposed SMEM
  lhs) → float32 SMEM tile → TMA reduce-add into acc[b, q block, n] (`mgpu_compat.
  copy_smem_to_gmem_add`). The reduce of step j reads its SMEM tile while step j+1 computes; the
  warpgroup waits for that read only before overwriting the tile (wait_read_only).
Both warpgroups of a CTA, and the CTAs of every kv block, add into the same dq rows: the TMA
reduce is atomic per element, but the order of the float32 additions is not fixed, so dq and
d_scale are not bitwise reproducible (dk, dv are). acc is zero-filled by XLA and handed to the
kernel as a GMEM Ref (aliased in place), which is why the launch goes through
`mgpu_compat.ref_kernel`.

SMEM (16-bit inputs, C = max_concurrent_steps): W·2·bkv·D·2 (k, v) + C·(2·bq·D·2 + 3·bq·4) (ring)
+ W·bkv·bq·2 (ds) + W·bq·D·4 (float32 dq tile). D=128, bq = bkv = 64, C = 2: 210 KB of the 227 KB
a CTA may use; C = 3 does not fit at D = 128 (ValueError). D=64, C = 3: 130 KB.
Registers per compute warpgroup: dk + dv (2·bkv·D/128 per thread, 128 at D=128) plus the [bkv, bq]
tiles; the dq tile (bq·D/128) is live only after dk's wgmma, when p and dP are dead.

blocks.joint_dq (D = 128 only; FlashAttention-3's dQ split): each warpgroup still computes S, dP,
dK and dV for its own keys, but dq is computed jointly. Both warpgroups store their dS tile
(double-buffered by step parity, [2, W, bkv, bq]) and meet at a barrier (`ds_ready`, one phase per
step). Then warpgroup w computes dq's columns [w·D/W, (w+1)·D/W) over all W·bkv keys of the CTA
(W transposed-lhs wgmmas into one scoped accumulator, `mgpu_compat.mma_t_sum`, against column
slices of the k tiles) and reduce-adds that [bq, D/W] tile. Per 128 keys and q block that is one
[bq, D] float32 reduce instead of two, and the dq SMEM tile halves: D=128, bq = bkv = 64, C = 2:
194 KB. Causal blocks above a warpgroup's
keys run masked instead of skipped (the other warpgroup needs its zero dS), and a last barrier
(`done`) keeps a warpgroup from staging dk in its k tile while the other's last dq wgmma reads it.
Compiled on the H200 it passes its tests but runs 0.67–0.78× the two-kernel backward at 4K–16K
(twenty-fifth session; not profiled: the per-step barrier that couples the warpgroups is the
likely cost), so focal_mgpu leaves it off.

blocks.dq_halves (D = 128 only; no coupling between warpgroups): each warpgroup computes its dq
tile in two 64-column halves, each a wgmma against a column half of its own k tile, its own
float32 SMEM tile and its own reduce-add. Same SMEM and traffic as the whole tile; the second
half's wgmma runs while the first half's reduce reads SMEM, and the live accumulator is
bq·D/256 registers per thread, not bq·D/128, beside dk and dv's 128. Compiled on the H200 it
passes its tests but ptxas spills more (600 bytes against 516 at 232 registers) and it ran 2%
slower than the whole tile (twenty-sixth session), so focal_mgpu leaves it off. At D = 128 every
variant of this kernel spills (the dk/dv kernel too); at D = 64 none does.

blocks.dkv_step="lean" (`focal_mgpu_dkv.dv_and_dx`): dx from the 16-bit p, the temperature row
reloaded; at D = 128 ptxas spills 312 bytes instead of 440 and the kernel ran 5–15% faster on
the H200 (twenty-seventh session), level with the two kernels at 4K–8K, still behind at 2K and 16K.
blocks.pingpong_backward: the two compute warpgroups take turns at the tensor cores
(`focal_mgpu_dkv.visit_q_blocks`); not with joint_dq (ValueError). Compiled tests pass on the
H200; no faster (twenty-eighth session: 4.77 against 4.10 ms at (24,16,2K,128), 3.71 with "lean").

Segment ids (optional, as focal_mgpu_dkv's): each warpgroup's key ids stay resident and each q
block's ids join its ring slot; a tile masks where the ids differ. Compiled on the H200 at D 64
and 128 (twenty-fifth session); `focal_mgpu` routes packed batches here wherever
BlockSizes.fused_backward is set (the D = 64 default).

Ablation (benchmarks only; `bench/focal_mgpu_bwd.py --ablate`): a blocks object with an `ablate`
tuple leaves stages out so their cost reads as a difference of kernel times: "dq" (no dsᵀ·k,
store or reduce), "reduce" (the dq tile is stored but never reduced), "wait" (no wait for the
previous reduce's read: a race). dq is then wrong; focal_mgpu's BlockSizes has no such field.

Contract: focal_mgpu_bwd's (`_check`; this kernel reads blocks.block_q_dkv, blocks.block_kv_dkv,
blocks.max_concurrent_steps and, if present, blocks.joint_dq, blocks.dq_halves,
blocks.dkv_step and blocks.pingpong_backward) plus the SMEM budget above.
Causal: s visible to t iff s <= t.

On CPU pass interpret=True (GPU interpret mode, race detector on). The interpreters of 0.10.2 and
0.11.2 have no TMA reductions, so there acc gets a leading axis with one slab per kv tile
(S / bkv): each warpgroup copies its dq tiles into its own slab (every (slab, q block, head) at
most once) and XLA sums the slabs. Everything else is the compiled code path, race-checked; but
0.10.2's interpreter performs SMEM->GMEM copies synchronously, so it cannot flag a missing
wait_read_only before the dq tile is reused (0.11.2's tracks those reads).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.focal import mosaic_bwd as fb
from pallas_kernels.focal import mosaic_dkv as focal_mgpu_dkv
from pallas_kernels import mosaic_common as mc

W = fb.W  # compute warpgroups per CTA
# 227 KB per CTA on Hopper, less the ~3 KB Mosaic keeps for itself (focal_mgpu's docstring).
SMEM_BUDGET = 224 * 1024


def smem_bytes(*, bq: int, bkv: int, D: int, steps: int, itemsize: int = 2,
               joint_dq: bool = False) -> int:
  """SMEM the fused kernel allocates (barriers aside); see the module docstring. joint_dq: two
  dS buffers per warpgroup, and a dq tile of D/W columns."""
  ds_buffers, dq_cols = (2, D // W) if joint_dq else (1, D)
  return (W * 2 * bkv * D * itemsize + steps * (2 * bq * D * itemsize + 3 * bq * 4)
          + ds_buffers * W * bkv * bq * itemsize + W * bq * dq_cols * 4)


def _kernel(q_ref, k_ref, v_ref, do_ref, c_ref, lse_ref, delta_ref, acc_ref, dk_ref, dv_ref,
            k_s, v_s, q_s, do_s, c_s, lse_s, delta_s, ds_s, dq_s, res_bar, q_bar, q_free,
            schedule, *joint_bars, seg, causal, bq, bkv, n_q, group, steps, joint_dq, dq_halves,
            interpret, mode="plain", pingpong_on=False, ablate=()):
  b, kv_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
  cta_k0 = lax.axis_index("kv_seq") * (W * bkv)
  # First q block that sees any key of this CTA (causal); per head the CTA visits [i_lo, n_q).
  i_lo = jnp.minimum(lax.div(cta_k0, jnp.int32(bq)), n_q) if causal else jnp.int32(0)
  per_head = n_q - i_lo
  wgmma_layout = plgpu.Layout.WGMMA
  col_layout = wgmma_layout.reduce(0)  # per-query vectors run along axis 1 of [bkv, bq] tiles
  # seg: None or (ids [B, T] GMEM, resident key ids [W, bkv], ring of q ids [steps, bq]), as in
  # focal_mgpu_dkv.
  seg_ref, segk_s, segq_s = seg or (None, None, None)
  # joint_bars: (both dS stored, one per step parity; both warpgroups done) with joint_dq only.
  ds_ready, done = joint_bars if joint_dq else (None, None)

  @pl.when(wg < W)
  def _compute():
    plgpu.set_max_registers(mc.COMPUTE_REGISTERS, action="increase")
    k0 = cta_k0 + wg * bkv
    rows = (b, pl.ds(k0, bkv), kv_head)
    bar = res_bar.at[wg]
    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_s.at[wg], bar)
    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_s.at[wg], bar)
    if seg:
      plgpu.copy_gmem_to_smem(seg_ref.at[b, pl.ds(k0, bkv)], segk_s.at[wg], bar)
    plgpu.barrier_wait(bar)
    if seg:
      segk_K = mc.load(segk_s.at[wg], layout=wgmma_layout.reduce(1), interpret=interpret)
    # Interpreted: this warpgroup's own slab, or with joint_dq the CTA's, of which each
    # warpgroup writes its own columns (no TMA reduction there; module docstring).
    slab = lax.axis_index("kv_seq") if joint_dq else lax.div(k0, jnp.int32(bkv))
    acc = acc_ref.at[slab] if interpret else acc_ref
    dq_QD_s = dq_s.at[wg]
    shape_KQ = (bkv, bq)
    phase = functools.partial(fb.schedule_phase, schedule) if pingpong_on else None

    def reduce_dq(acc_tile, tile_s, dst, *, pending):
      """Float32 dq tile → its SMEM tile → TMA reduce-add into dst. The reduce that last read
      tile_s must be done first: at most `pending` newer reduces may still be reading."""
      if "wait" not in ablate:
        plgpu.wait_smem_to_gmem(pending, wait_read_only=True)
      tile_s[...] = acc_tile
      plgpu.commit_smem()
      if "reduce" not in ablate:
        mc.copy_smem_to_gmem_add(tile_s, dst, interpret=interpret)

    def joint_dq_step(buf, i, n):
      """dq rows of q block i, columns [w·D/W, (w+1)·D/W) for warpgroup w: dsᵀ·k over all the
      CTA's keys, both warpgroups' dS tiles of this step (FlashAttention-3's split of the dQ
      wgmma); the column slice must be static, hence one branch per warpgroup."""
      cols_n = k_s.shape[-1] // W
      for w in range(W):
        @pl.when(wg == w)
        def _():
          cols = pl.ds(w * cols_n, cols_n)
          acc_Qd = mc.mma_t_sum([(ds_s.at[buf, j], k_s.at[j, :, cols]) for j in range(W)],
                                interpret=interpret)
          reduce_dq(acc_Qd, dq_QD_s, acc.at[b, pl.ds(i * bq, bq), n, cols], pending=0)

    def dq_halves_step(ds_KQ_s, i, n):
      """dq rows of q block i in two column halves, each its own wgmma, SMEM tile and reduce:
      half 1's wgmma runs while half 0's reduce reads, and the accumulator holds bq·D/256
      registers per thread instead of bq·D/128."""
      cols_n = k_s.shape[-1] // 2
      for h in range(2):
        cols = pl.ds(h * cols_n, cols_n)
        acc_Qd = mc.mma_t(ds_KQ_s, k_s.at[wg, :, cols], interpret=interpret)
        # The reduce that last read this half is the older of the two in flight.
        reduce_dq(acc_Qd, dq_QD_s.at[h], acc.at[b, pl.ds(i * bq, bq), n, cols], pending=1)

    def step(t, carry, *, g, masked):
      dk_KD, dv_KD = carry
      i = i_lo + t
      slot = lax.rem(g * per_head + t, steps)
      # joint_dq: dS double-buffered by step parity, so a warpgroup writes step t+1's tile while
      # the other may still read step t's (it has passed step t's ds_ready before step t+1's).
      buf = lax.rem(g * per_head + t, 2) if joint_dq else None
      ds_KQ_s = ds_s.at[buf, wg] if joint_dq else ds_s.at[wg]
      plgpu.barrier_wait(q_bar.at[slot])
      r_KQ = mc.mma(k_s.at[wg], q_s.at[slot], transpose_b=True, interpret=interpret,
                    during=phase)
      c_Q = mc.load(c_s.at[slot], layout=col_layout, interpret=interpret)
      lse_Q = mc.load(lse_s.at[slot], layout=col_layout, interpret=interpret)
      x_KQ = r_KQ * fb._bcast(c_Q, shape_KQ, 1) - fb._bcast(lse_Q, shape_KQ, 1)
      if masked:
        s = mc.iota(jnp.int32, shape_KQ, 0, wgmma_layout, interpret=interpret) + k0
        tq = mc.iota(jnp.int32, shape_KQ, 1, wgmma_layout, interpret=interpret) + i * bq
        x_KQ = jnp.where(s <= tq, x_KQ, -jnp.inf)
      if seg:
        segq_Q = mc.load(segq_s.at[slot], layout=col_layout, interpret=interpret)
        same_KQ = fb._bcast(segk_K, shape_KQ, 0) == fb._bcast(segq_Q, shape_KQ, 1)
        x_KQ = jnp.where(same_KQ, x_KQ, -jnp.inf)
      dv_KD, dx_KQ, c_Q = focal_mgpu_dkv.dv_and_dx(
          jnp.exp2(x_KQ), c_Q, dv_KD, v_tile=v_s.at[wg], do_tile=do_s.at[slot],
          c_tile=c_s.at[slot], delta_tile=delta_s.at[slot], mode=mode, interpret=interpret,
          phase=phase)

      def store_ds():  # overlapped with the dk wgmma; the last step's dsᵀ·k was awaited
        ds_KQ_s[...] = dx_KQ.astype(ds_KQ_s.dtype)
        plgpu.commit_smem()  # visible to the wgmma below (async proxy)

      # dk contracts over queries: the temperature scales each query's column first.
      dxs_KQ = (dx_KQ * fb._bcast(c_Q * fb.LN2, shape_KQ, 1)).astype(q_s.dtype)
      dk_KD = mc.mma(dxs_KQ, q_s.at[slot], acc=dk_KD, during=store_ds, interpret=interpret)
      plgpu.barrier_arrive(q_free.at[slot])  # q, dO and rows of this slot are no longer read
      n = kv_head * group + g
      if joint_dq:
        plgpu.barrier_arrive(ds_ready.at[buf])  # this warpgroup's dS of the step is in SMEM
        plgpu.barrier_wait(ds_ready.at[buf])
        joint_dq_step(buf, i, n)
        return dk_KD, dv_KD
      if "dq" in ablate:
        return dk_KD, dv_KD
      if dq_halves:
        dq_halves_step(ds_KQ_s, i, n)
        return dk_KD, dv_KD
      acc_QD = mc.mma_t(ds_KQ_s, k_s.at[wg], interpret=interpret)
      reduce_dq(acc_QD, dq_QD_s, acc.at[b, pl.ds(i * bq, bq), n], pending=0)
      return dk_KD, dv_KD

    dk_KD, dv_KD = focal_mgpu_dkv.visit_q_blocks(
        step, causal=causal, group=group, per_head=per_head, steps=steps, k0=k0, bq=bq, bkv=bkv,
        i_lo=i_lo, q_bar=q_bar, q_free=q_free, D=k_s.shape[-1], interpret=interpret,
        skip_above=not joint_dq, phase=phase, wg=wg)
    if joint_dq:  # the other warpgroup's last dsᵀ·k reads this one's k tile: wait for it
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)
    # k, v tiles are free: the last dsᵀ·k wgmma was awaited. The wait also covers the last dq
    # reduce.
    focal_mgpu_dkv.write_dk_dv(dk_KD, dv_KD, k_s.at[wg], v_s.at[wg], dk_ref.at[rows],
                               dv_ref.at[rows])

  @pl.when(wg == W)
  def _producer():
    focal_mgpu_dkv.stream_q_rows(
        (q_ref, do_ref, c_ref, lse_ref, delta_ref), (q_s, do_s, c_s, lse_s, delta_s), q_bar,
        q_free, b=b, kv_head=kv_head, group=group, i_lo=i_lo, per_head=per_head, bq=bq,
        steps=steps, seg=None if seg is None else (seg_ref, segq_s))


def _joint_dq(blocks) -> bool:
  return getattr(blocks, "joint_dq", False)  # benchmark/test Blocks may lack the field


def _dq_halves(blocks) -> bool:
  return getattr(blocks, "dq_halves", False)


def _check_smem(q, blocks):
  D, itemsize = q.shape[-1], jnp.dtype(q.dtype).itemsize
  if _joint_dq(blocks) and D != 128:
    # D/W = 32 columns would be 64-byte slices of a 128-byte-swizzled k tile.
    raise ValueError(f"blocks.joint_dq=True needs head dim D=128 (a 64-column half of k per "
                     f"warpgroup); got D={D}")
  need = smem_bytes(bq=blocks.block_q_dkv, bkv=blocks.block_kv_dkv, D=D,
                    steps=blocks.max_concurrent_steps, itemsize=itemsize,
                    joint_dq=_joint_dq(blocks))
  if _dq_halves(blocks) and _joint_dq(blocks):
    raise ValueError("blocks.dq_halves and blocks.joint_dq are two ways to split dq's columns; "
                     "set at most one")
  if _joint_dq(blocks) and focal_mgpu_dkv.pingpong(blocks):
    # The joint dq's per-step barrier between the warpgroups and the half-phase offset of the
    # ping-pong schedule would wait on each other.
    raise ValueError("blocks.pingpong_backward and blocks.joint_dq cannot be combined; set at "
                     "most one")
  if _dq_halves(blocks) and D != 128:
    raise ValueError(f"blocks.dq_halves=True needs head dim D=128 (64-column halves of the "
                     f"swizzled k tile); got D={D}")
  if need > SMEM_BUDGET:
    raise ValueError(
        f"fused backward needs {need / 1024:.1f} KB of SMEM > {SMEM_BUDGET // 1024} KB at D={D} "
        f"with blocks.block_q_dkv={blocks.block_q_dkv}, blocks.block_kv_dkv="
        f"{blocks.block_kv_dkv}, blocks.max_concurrent_steps={blocks.max_concurrent_steps}; "
        f"lower max_concurrent_steps or the blocks")


# jit: a Ref with a memory space exists only while tracing (NotImplementedError eagerly).
@functools.partial(jax.jit, static_argnames=("causal", "blocks", "interpret"))
def fused_call(q, k, v, do, c_BNT, lse_BNT, delta_BNT, *, causal: bool, blocks, interpret,
               seg_BT=None):
  """The kernel: (acc [B,T,Hq,D] float32 = Σ_s dx_ts k_s, dk, dv [B,S,Hkv,D] k.dtype).
  Inputs as `backward`'s after `focal_mgpu_bwd.backward_rows`; do in q.dtype; blocks hashable."""
  B, T, N, D = q.shape
  S, K = k.shape[1], k.shape[2]
  flag, params = fb._launch_params(interpret)
  bq, bkv = blocks.block_q_dkv, blocks.block_kv_dkv
  joint = _joint_dq(blocks)
  halves = _dq_halves(blocks) and not joint
  n_q = T // bq
  steps = max(1, min(blocks.max_concurrent_steps, n_q))  # more slots than blocks load nothing
  # Interpreted: one slab per kv tile (per CTA with joint_dq).
  acc_shape = (S // (W * bkv if joint else bkv), *q.shape) if flag else q.shape
  acc_ref = jax.new_ref(jnp.zeros(acc_shape, jnp.float32), memory_space=plgpu.GMEM)
  # 128-byte swizzle: 64 16-bit or 32 float32 elements per row (the wgmma / TMA tile).
  f32_tile = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
  segments = seg_BT is not None
  operands = (q, k, v, do, c_BNT, lse_BNT, delta_BNT, acc_ref) + ((seg_BT,) if segments else ())
  seg_scratch = [plgpu.SMEM((W, bkv), jnp.int32),             # resident key ids
                 plgpu.SMEM((steps, bq), jnp.int32)] if segments else []  # q ids ring
  joint_bars = [plgpu.Barrier(num_arrivals=W, num_barriers=2),  # both dS of a step stored
                plgpu.Barrier(num_arrivals=W)] if joint else []  # both warpgroups done
  dk, dv = mc.ref_kernel(
      mc.with_segments(
          functools.partial(_kernel, causal=causal, bq=bq, bkv=bkv, n_q=n_q, group=N // K,
                            steps=steps, joint_dq=joint, dq_halves=halves, interpret=flag,
                            mode=focal_mgpu_dkv.step_mode(blocks),
                            pingpong_on=focal_mgpu_dkv.pingpong(blocks),
                            ablate=getattr(blocks, "ablate", ())),
          n_in=len(operands), n_seg_scratch=2, segments=segments),
      out_type=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      scratch_types=[
          fb._tile_smem((W, bkv, D), k.dtype), fb._tile_smem((W, bkv, D), k.dtype),  # k, v → dk, dv
          fb._tile_smem((steps, bq, D), q.dtype), fb._tile_smem((steps, bq, D), q.dtype),  # q, dO
          *[plgpu.SMEM((steps, bq), jnp.float32) for _ in range(3)],     # c, lse, delta ring
          fb._tile_smem((2, W, bkv, bq) if joint else (W, bkv, bq), q.dtype),  # ds = dx, 16-bit
          plgpu.SMEM((W, 2, bq, D // 2) if halves else (W, bq, D // W if joint else D),
                     jnp.float32, transforms=f32_tile),           # dq tile to reduce
          plgpu.Barrier(num_arrivals=2 + segments, num_barriers=W),   # resident tiles landed
          plgpu.Barrier(num_arrivals=5 + segments, num_barriers=steps),  # q, dO, rows landed
          plgpu.Barrier(num_arrivals=W, num_barriers=steps),      # slot released by both wgs
          plgpu.Barrier(num_arrivals=W),       # ping-pong schedule (with pingpong_backward)
          *joint_bars,
          *seg_scratch,
      ],
      grid=(K, S // (W * bkv), B), grid_names=("heads", "kv_seq", "batch"),
      num_threads=W + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=params, name=focal_mgpu_dkv.kernel_name("focal_mgpu_bwd_fused", blocks))(*operands)
  acc = acc_ref[...]
  return (acc.sum(axis=0) if flag else acc), dk, dv


def epilogue(q, s_BNT, acc_BTND):
  """(dq [B,T,Hq,D] q.dtype, d_scale [B,Hq,T] float32) from the kernel's float32 acc: one
  memory-bound XLA fusion. Multiply-and-sum, not einsum, so no TF32 dot touches d_scale."""
  s_BTN = jnp.swapaxes(s_BNT, 1, 2)
  dq = (acc_BTND * s_BTN[..., None]).astype(q.dtype)
  ds_BTN = jnp.sum(q.astype(jnp.float32) * acc_BTND, axis=-1)
  return dq, jnp.swapaxes(ds_BTN, 1, 2)


def backward(q, k, v, s_BNT, out, lse_BNT, do, *, causal: bool, blocks, interpret, seg_BT=None):
  """Returns (dq [B,T,Hq,D] q.dtype, dk, dv [B,S,Hkv,D] k.dtype, d_scale [B,Hq,T] float32),
  as `focal_mgpu_bwd.backward` (same arguments, segment ids included; blocks e.g.
  focal_mgpu.BlockSizes, of which this kernel uses block_q_dkv, block_kv_dkv,
  max_concurrent_steps and joint_dq; hashable, e.g. frozen)."""
  fb._check(q, k, v, s_BNT, lse_BNT, do, blocks, seg_BT)
  _check_smem(q, blocks)
  c_BNT, delta_BNT = fb.backward_rows(s_BNT, out, do)
  acc_BTND, dk, dv = fused_call(q, k, v, do.astype(q.dtype), c_BNT, lse_BNT, delta_BNT,
                                causal=causal, blocks=blocks, interpret=interpret, seg_BT=seg_BT)
  dq, ds_BNT = epilogue(q, s_BNT, acc_BTND)
  return dq, dk, dv, ds_BNT
