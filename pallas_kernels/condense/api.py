"""FocusLLM condensing attention (Pallas, Triton lowering): candidates and the local decoder.

Specs in `condense.reference`, kernel bodies in `condense.triton`. Letters: R rows, Q candidates
per row, S cached keys, T local tokens, C visible candidates, N / K query / kv heads, D.
candidate_attention  softmax over cached keys s < visible_len[r, q] plus the candidate's own key.
  Split-K, grid (R, K, S / split_k): all Q·G queries of a kv head in one tile, carrying acc, m, l
  f32; XLA merges the splits and the self key. Backward on the same grid: per-split dq, and dk/dv
  only when the cache is differentiated.
local_attention  softmax over [every candidate | local keys s <= t]. FlashAttention-2, grid
  (T / block_q, R, N), carrying acc [block_q, D], m, l; saves lse. Backward: a dq pass and focal's
  Triton dk/dv kernel (causal over the local keys, non-causal over the candidates).
Memory: residuals are the inputs, out and lse. S, T, C are padded to multiples of 16 (a copy).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.custom_derivatives import SymbolicZero
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.condense import triton as kern
# The specs, importable from here too (callers name them api.*_reference).
from pallas_kernels.condense.reference import (  # noqa: F401  pylint: disable=unused-import
    candidate_attention_reference, candidate_mass_reference, local_attention_reference)
from pallas_kernels.focal import triton as ff

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles (powers of two >= 16; clipped to the largest power of two dividing the length)."""
  block_k: int = 64        # candidate: cached keys per inner step
  split_k: int = 256       # candidate: cached keys per program (a multiple of block_k)
  block_q: int = 64        # local forward
  block_kv: int = 64
  block_q_dkv: int = 64    # local dk/dv pass
  block_kv_dkv: int = 64
  block_q_dq: int = 64     # local dq pass
  block_kv_dq: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for f in dataclasses.fields(self):
      b = getattr(self, f.name)
      if f.name.startswith(("block", "split")) and (b < 16 or b & (b - 1)):
        raise ValueError(f"BlockSizes.{f.name}={b} must be a power of two >= 16")
    if self.split_k < self.block_k:
      raise ValueError(f"BlockSizes.split_k={self.split_k} must be >= block_k={self.block_k}")

  def fit(self, name: str, length: int) -> int:
    """The largest power of two <= `name` dividing `length` (a multiple of 16)."""
    b = getattr(self, name)
    while length % b:
      b //= 2
    return b

  def warps(self, rows: int, d: int) -> int:
    # The f32 accumulator [rows, D] lives in registers: big candidate tiles get more warps.
    return max(self.num_warps, 8) if rows * d >= 8192 else self.num_warps


@dataclasses.dataclass(frozen=True)
class _Static:
  scale: float
  blocks: BlockSizes
  interpret: bool
  n_cand: int = 0      # local: real candidates (C before padding)


def _check(q, kvs: dict, heads_axis: int = 2):
  N, D = q.shape[2], q.shape[3]
  for name, x in kvs.items():
    if x.dtype != q.dtype or q.dtype not in _DTYPES:
      raise ValueError(f"{name} must share q's dtype among float32/bfloat16/float16; got "
                       f"q {q.dtype}, {name} {x.dtype}")
    if x.ndim != 4 or x.shape[0] != q.shape[0] or x.shape[3] != D or N % x.shape[heads_axis]:
      raise ValueError(f"{name} must be [R={q.shape[0]}, *, K, D={D}] with N={N} divisible by "
                       f"K; got {x.shape}")
  if D < 16 or D > 256 or D & (D - 1):
    raise ValueError(f"head dim D={D} must be a power of two in [16, 256]")


def _pad_axis(x, axis: int, to: int):
  if x is None or x.shape[axis] == to:
    return x
  cfg = [(0, 0)] * x.ndim
  cfg[axis] = (0, to - x.shape[axis])
  return jnp.pad(x, cfg)


def _round16(n: int) -> int:
  return -(-n // 16) * 16


def _unwrap(x):
  """(value, perturbed) of a symbolic-zeros custom_vjp primal (None stays None, unperturbed)."""
  return (None, False) if x is None else (x.value, x.perturbed)


def _flags(*bits):
  # Static booleans carried through the residuals as the shape of an empty array.
  return jnp.zeros(tuple(2 if b else 1 for b in bits) + (0,), jnp.int8)


def _read(flags):
  return tuple(s == 2 for s in flags.shape[:-1])


def candidate_attention(q_RQND, k_RSKD, v_RSKD, visible_len_RQ, self_k_RQKD=None,
                        self_v_RQKD=None, *, scale: float, interpret: bool = False,
                        block_sizes: BlockSizes | None = None):
  """Q candidate queries per row against its cache: candidate q sees keys s < visible_len_RQ[r, q]
  and its own optional self_k/v [R, Q, K, D]; [R, Q, N, D]."""
  kvs = {"k_RSKD": k_RSKD, "v_RSKD": v_RSKD}
  if (self_k_RQKD is None) != (self_v_RQKD is None):
    raise ValueError("self_k_RQKD and self_v_RQKD must be given together")
  if self_k_RQKD is not None:
    kvs.update(self_k_RQKD=self_k_RQKD, self_v_RQKD=self_v_RQKD)
    if self_k_RQKD.shape[1] != q_RQND.shape[1] or self_v_RQKD.shape != self_k_RQKD.shape:
      raise ValueError(f"self_k/self_v must be [R, Q={q_RQND.shape[1]}, K, D]; got "
                       f"{self_k_RQKD.shape}, {self_v_RQKD.shape}")
  _check(q_RQND, kvs)
  if k_RSKD.shape != v_RSKD.shape:
    raise ValueError(f"k_RSKD {k_RSKD.shape} and v_RSKD {v_RSKD.shape} must match")
  if tuple(visible_len_RQ.shape) != q_RQND.shape[:2] or not jnp.issubdtype(
      visible_len_RQ.dtype, jnp.integer):
    raise ValueError(f"visible_len_RQ must be int [R, Q] = {q_RQND.shape[:2]}; got "
                     f"{visible_len_RQ.dtype}{list(visible_len_RQ.shape)}")
  return _candidate_jit(q_RQND, k_RSKD, v_RSKD, visible_len_RQ, self_k_RQKD, self_v_RQKD,
                        st=_Static(float(scale), block_sizes or BlockSizes(), interpret))


@functools.partial(jax.jit, static_argnames=("st",))
def _candidate_jit(q, k, v, vlen, sk, sv, *, st: _Static):
  S = k.shape[1]
  # Same visibility as the reference for any value; keeps every loop inside the row.
  vlen = jnp.clip(vlen.astype(jnp.int32), 0, S)
  k, v = _pad_axis(k, 1, _round16(S)), _pad_axis(v, 1, _round16(S))
  return _candidate(q, k, v, vlen, sk, sv, st)


def _cand_layout(q, k, st: _Static):
  R, Q, N, D = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  M = Q * G
  Mp = max(16, pl.next_power_of_2(M))
  block = st.blocks.fit("block_k", S)
  split = max(block, min(st.blocks.split_k, pl.next_power_of_2(S)))
  # [R, K, Q, G, ...] -> rows m = q·G + g of each kv head, zero-padded to Mp.
  rows = lambda x: _pad_axis(x.reshape(R, K, M, *x.shape[4:]), 2, Mp)
  unrows = lambda x: x[:, :, :, :M].reshape(*x.shape[:3], Q, G, *x.shape[4:])
  kw = dict(scale=st.scale, split=split, block=block, bs=st.blocks, interpret=st.interpret)
  return (R, Q, N, D, K, G), rows, unrows, kw


def _self_logits(q_RKQGD, sk, st):
  """Base-2 logits of each candidate query against its own key, [R, K, Q, G] f32."""
  return jnp.einsum("RKQGD,RQKD->RKQG", q_RKQGD, sk, preferred_element_type=jnp.float32,
                    precision=jax.lax.Precision.HIGHEST) * (st.scale * ff.LOG2E)


def _cand_forward(q, k, v, vlen, sk, sv, st: _Static):
  (R, Q, N, D, K, G), rows, unrows, kw = _cand_layout(q, k, st)
  q_RKQGD = q.reshape(R, Q, K, G, D).transpose(0, 2, 1, 3, 4)
  len_RM = rows(jnp.broadcast_to(vlen.reshape(R, 1, Q, 1), (R, K, Q, G)))[:, 0]
  acc, m, l = kern.candidate_fwd(rows(q_RKQGD), k, v, len_RM, **kw)
  acc_RKCQGD, m_RKCQG, l_RKCQG = unrows(acc), unrows(m), unrows(l)
  m_RKQG = m_RKCQG.max(2)
  if sk is not None:
    x_RKQG = _self_logits(q_RKQGD, sk, st)
    m_RKQG = jnp.maximum(m_RKQG, x_RKQG)
  w_RKCQG = jnp.exp2(m_RKCQG - m_RKQG[:, :, None])  # empty splits: l = acc = 0
  l_RKQG = (w_RKCQG * l_RKCQG).sum(2)
  acc_RKQGD = (w_RKCQG[..., None] * acc_RKCQGD).sum(2)
  if sk is not None:
    e_RKQG = jnp.exp2(x_RKQG - m_RKQG)
    l_RKQG = l_RKQG + e_RKQG
    acc_RKQGD = acc_RKQGD + e_RKQG[..., None] * sv.transpose(0, 2, 1, 3)[:, :, :, None].astype(
        jnp.float32)
  l_RKQG = jnp.where(l_RKQG == 0.0, 1.0, l_RKQG)   # no visible key: out 0, lse = MASK_VALUE
  out_RKQGD = acc_RKQGD / l_RKQG[..., None]
  out = out_RKQGD.transpose(0, 2, 1, 3, 4).reshape(R, Q, N, D).astype(q.dtype)
  return out, m_RKQG + jnp.log2(l_RKQG)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _candidate(q, k, v, vlen, sk, sv, st: _Static):
  return _cand_forward(q, k, v, vlen, sk, sv, st)[0]


def _candidate_fwd(q, k, v, vlen, sk, sv, st: _Static):
  (q, _), (k, pk), (v, pv), (vlen, _) = _unwrap(q), _unwrap(k), _unwrap(v), _unwrap(vlen)
  (sk, _), (sv, _) = _unwrap(sk), _unwrap(sv)
  out, lse_RKQG = _cand_forward(q, k, v, vlen, sk, sv, st)
  return out, (q, k, v, vlen, sk, sv, out, lse_RKQG, _flags(pk or pv))


def _candidate_bwd(st: _Static, res, do):
  q, k, v, vlen, sk, sv, out, lse_RKQG, flags = res
  (with_dkv,) = _read(flags)
  if isinstance(do, SymbolicZero):
    do = jnp.zeros(out.shape, out.dtype)
  (R, Q, N, D, K, G), rows, unrows, kw = _cand_layout(q, k, st)
  to_rkqg = lambda x: jnp.moveaxis(x.reshape(R, Q, K, G, *x.shape[3:]), 2, 1)
  q_RKQGD, do_RKQGD = to_rkqg(q), to_rkqg(do.astype(q.dtype))
  delta_RKQG = to_rkqg(jnp.einsum("RQND,RQND->RQN", out.astype(jnp.float32),
                                  do.astype(jnp.float32)))
  len_RM = rows(jnp.broadcast_to(vlen.reshape(R, 1, Q, 1), (R, K, Q, G)))[:, 0]
  dq, dk, dv = kern.candidate_bwd(rows(q_RKQGD), k, v, len_RM, rows(lse_RKQG), rows(delta_RKQG),
                                  rows(do_RKQGD), with_dkv=with_dkv, **kw)
  dq_RKQGD = unrows(dq).sum(2)
  dsk = dsv = None
  if sk is not None:
    p_RKQG = jnp.exp2(_self_logits(q_RKQGD, sk, st) - lse_RKQG)
    hi = dict(preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    dp_RKQG = jnp.einsum("RKQGD,RQKD->RKQG", do_RKQGD, sv, **hi)
    ds_RKQG = p_RKQG * (dp_RKQG - delta_RKQG) * st.scale
    dq_RKQGD = dq_RKQGD + ds_RKQG[..., None] * sk.transpose(0, 2, 1, 3)[:, :, :, None]
    dsk = jnp.einsum("RKQG,RKQGD->RQKD", ds_RKQG, q_RKQGD, **hi).astype(sk.dtype)
    dsv = jnp.einsum("RKQG,RKQGD->RQKD", p_RKQG, do_RKQGD, **hi).astype(sv.dtype)
  dq = dq_RKQGD.transpose(0, 2, 1, 3, 4).reshape(R, Q, N, D).astype(q.dtype)
  S = k.shape[1]
  dk = None if dk is None else dk[:, :S]
  dv = None if dv is None else dv[:, :S]
  return dq, dk, dv, None, dsk, dsv


_candidate.defvjp(_candidate_fwd, _candidate_bwd, symbolic_zeros=True)


def local_attention(q_RTND, k_RTKD, v_RTKD, cand_k_RCKD, cand_v_RCKD, *, scale: float,
                    interpret: bool = False, block_sizes: BlockSizes | None = None):
  """Local token t attends to all C candidates (C may be 0) and local tokens s <= t; [R, T, N,
  D]."""
  _check(q_RTND, {"k_RTKD": k_RTKD, "v_RTKD": v_RTKD, "cand_k_RCKD": cand_k_RCKD,
                  "cand_v_RCKD": cand_v_RCKD})
  if k_RTKD.shape != v_RTKD.shape or k_RTKD.shape[1] != q_RTND.shape[1]:
    raise ValueError(f"k_RTKD {k_RTKD.shape} and v_RTKD {v_RTKD.shape} must be [R, T="
                     f"{q_RTND.shape[1]}, K, D]")
  if cand_k_RCKD.shape != cand_v_RCKD.shape or cand_k_RCKD.shape[2] != k_RTKD.shape[2]:
    raise ValueError(f"cand_k_RCKD {cand_k_RCKD.shape} and cand_v_RCKD {cand_v_RCKD.shape} must "
                     f"be [R, C, K={k_RTKD.shape[2]}, D]")
  st = _Static(float(scale), block_sizes or BlockSizes(), interpret, cand_k_RCKD.shape[1])
  return _local_jit(q_RTND, k_RTKD, v_RTKD, cand_k_RCKD, cand_v_RCKD, st=st)


@functools.partial(jax.jit, static_argnames=("st",))
def _local_jit(q, k, v, ck, cv, *, st: _Static):
  T, C = q.shape[1], ck.shape[1]
  Tp = _round16(T)
  q, k, v = (_pad_axis(x, 1, Tp) for x in (q, k, v))
  ck, cv = (None, None) if C == 0 else (_pad_axis(x, 1, _round16(C)) for x in (ck, cv))
  return _local(q, k, v, ck, cv, st)[:, :T]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _local(q, k, v, ck, cv, st: _Static):
  return kern.local_fwd(q, k, v, ck, cv, scale=st.scale, n_cand=st.n_cand, bs=st.blocks,
                        interpret=st.interpret)[0]


def _local_fwd(q, k, v, ck, cv, st: _Static):
  (q, pq), (k, pk), (v, pv), (ck, pck), (cv, pcv) = map(_unwrap, (q, k, v, ck, cv))
  out, lse_RNT = kern.local_fwd(q, k, v, ck, cv, scale=st.scale, n_cand=st.n_cand,
                                bs=st.blocks, interpret=st.interpret)
  return out, (q, k, v, ck, cv, out, lse_RNT, _flags(pq, pk or pv, pck or pcv))


def _local_bwd(st: _Static, res, do):
  q, k, v, ck, cv, out, lse_RNT, flags = res
  need_q, need_kv, need_c = _read(flags)
  if isinstance(do, SymbolicZero):
    do = jnp.zeros(out.shape, out.dtype)
  delta_RNT = jnp.einsum("RTND,RTND->RNT", out.astype(jnp.float32), do.astype(jnp.float32))
  do = do.astype(q.dtype)
  kw = dict(bs=st.blocks, interpret=st.interpret)
  dq = dk = dv = dck = dcv = None
  if need_q:
    dq = kern.local_dq(q, k, v, ck, cv, lse_RNT, delta_RNT, do, scale=st.scale,
                       n_cand=st.n_cand, **kw)
  s_RNT = jnp.full(lse_RNT.shape, st.scale, jnp.float32)   # focal's per-row scale
  if need_kv:
    dk, dv = kern.local_dkv(q, k, v, s_RNT, lse_RNT, delta_RNT, do, causal=True,
                            name="condense_local_dkv", **kw)
  if need_c and ck is not None:
    # Padded candidates (zeros past C) get gradients too; the slice in _local_jit drops them.
    dck, dcv = kern.local_dkv(q, ck, cv, s_RNT, lse_RNT, delta_RNT, do, causal=False,
                              name="condense_local_dkv_cand", **kw)
  return dq, dk, dv, dck, dcv


_local.defvjp(_local_fwd, _local_bwd, symbolic_zeros=True)
