"""Public attention operators (the contract in CONTRACT.md) and their implementation table.

Shapes: q [B, T, Hq, D]; k, v [B, S, Hkv, D] (Hq % Hkv == 0); outputs [B, T, Hq, D] in q.dtype.
`implementation` is chosen from `IMPLEMENTATIONS[op]`; "xla" is the pure-JAX reference in
`pallas_kernels.focal.reference` (the spec), "pallas" the fused kernels (compiled on GPU/TPU, interpret
mode on CPU); for focal also "cudnn" (`jax.nn.dot_product_attention`, NVIDIA GPUs) and "tokamax"
(`tokamax.dot_product_attention`, an optional GPU/TPU extra), both with an array temperature
folded into q.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from focaljax import sharding
from pallas_kernels.focal import reference
from pallas_kernels.dilution import reference as dilution_reference


def _interpret() -> bool:
  # Kernels compile on GPU/TPU; everywhere else they run in Pallas interpret mode.
  return jax.default_backend() not in ("gpu", "cuda", "rocm", "tpu")


def _per_device(kernel):
  """Under an ambient mesh, runs a Pallas attention kernel on each device's block of rows and
  heads (jax.shard_map): a pallas_call has no partitioning rule, so XLA would otherwise gather q,
  k and v whole onto every device. Rows split by the "batch" rule's axes and heads by the "heads"
  rule's, each only where the devices divide them (both Hq and Hkv for heads, which keeps every
  query head with its KV group); an array scale is broadcast to [B, Hq, T] and split the same
  way. Without a mesh the kernel runs as is."""
  @functools.wraps(kernel)
  def wrapped(q, k, v, *, scale, segment_ids, **static):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      return kernel(q, k, v, scale=scale, segment_ids=segment_ids, **static)
    B, T, Hq, _ = q.shape
    rows = sharding.dividing_axes(mesh, "batch", B)
    heads = sharding.dividing_axes(mesh, "heads", math.gcd(Hq, k.shape[2]))
    if rows is None and heads is None:
      return kernel(q, k, v, scale=scale, segment_ids=segment_ids, **static)
    qkv = P(rows, None, heads, None)
    array_scale = not isinstance(scale, (int, float))
    operands, specs = [q, k, v], [qkv, qkv, qkv]
    if array_scale:
      operands.append(reference.scale_BNT(scale, B, Hq, T))
      specs.append(P(rows, heads, None))
    if segment_ids is not None:
      operands.append(segment_ids)
      specs.append(P(rows, None))

    def local(q, k, v, *rest):
      rest = list(rest)
      s = rest.pop(0) if array_scale else scale
      seg = rest.pop(0) if segment_ids is not None else None
      return kernel(q, k, v, scale=s, segment_ids=seg, **static)
    return jax.shard_map(local, in_specs=tuple(specs), out_specs=qkv, check_vma=False)(*operands)
  return wrapped


# ------------------------------------------------------------------ focal / softmax attention


def _focal_xla(q, k, v, *, scale, causal, segment_ids):
  return reference.attention(q, k, v, scale=scale, causal=causal, segment_ids_BT=segment_ids)


@_per_device
def _focal_pallas(q, k, v, *, scale, causal, segment_ids):
  from pallas_kernels.focal import triton as focal_flash  # pylint: disable=import-outside-toplevel
  return focal_flash.focal_attention(q, k, v, scale=scale, causal=causal,
                                     segment_ids=segment_ids, interpret=_interpret())


def _fold_scale(q, scale):
  """(q', float scale): library kernels take a Python float, so an array temperature is folded
  into q. The gradient to `scale` then flows through plain JAX, and the KV cache stays
  independent of it."""
  if isinstance(scale, (int, float)):
    return q, float(scale)
  B, T, N, _ = q.shape
  s_BNT = reference.scale_BNT(scale, B, N, T)
  return (q.astype(jnp.float32) * s_BNT.transpose(0, 2, 1)[..., None]).astype(q.dtype), 1.0


def _segment_mask(segment_ids):
  if segment_ids is None:
    return None
  return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def _focal_cudnn(q, k, v, *, scale, causal, segment_ids):
  if jax.default_backend() != "gpu":
    raise NotImplementedError("implementation='cudnn' needs an NVIDIA GPU; use 'xla' or 'pallas'")
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"implementation='cudnn' takes bfloat16/float16 q, k, v; got {q.dtype} "
                     "(use 'pallas', 'xla' or 'auto', which sends float32 to 'pallas')")
  q, s = _fold_scale(q, scale)
  return jax.nn.dot_product_attention(q, k, v, scale=s, is_causal=causal,
                                      mask=_segment_mask(segment_ids), implementation="cudnn")


def _focal_tokamax(q, k, v, *, scale, causal, segment_ids):
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise NotImplementedError("implementation='tokamax' needs the optional tokamax package "
                              f"(pip install tokamax; GPU/TPU); importing it failed: {e}") from e
  q, s = _fold_scale(q, scale)
  return tokamax.dot_product_attention(q, k, v, mask=_segment_mask(segment_ids), scale=s,
                                       is_causal=causal)


# ----------------------------------------------------------------------- dilution attention


def _dilution_xla(q, k, v, *, scale, eps, segment_ids, checkpoint_rows):
  del checkpoint_rows   # the reference keeps its [T, T] intermediates; nothing to checkpoint
  return dilution_reference.dilution_attention(q, k, v, scale=scale, eps=eps, segment_ids_BT=segment_ids)[0]


@_per_device
def _dilution_pallas(q, k, v, *, scale, eps, segment_ids, checkpoint_rows):
  from pallas_kernels.dilution import api as dilution  # pylint: disable=import-outside-toplevel
  bs = None   # the kernels' defaults (BlockSizes.ckpt_rows: 1024)
  if checkpoint_rows is not None:
    bs = dataclasses.replace(dilution.default_block_sizes(q.shape[-1], q.dtype, _interpret()),
                             ckpt_rows=checkpoint_rows)
  return dilution.dilution_attention(q, k, v, scale=scale, eps=eps, segment_ids=segment_ids,
                                     block_sizes=bs, interpret=_interpret())


def _prefill_xla(q, k, v, *, scale, eps):
  return dilution_reference.dilution_attention(q, k, v, scale=scale, eps=eps)


def _prefill_pallas(q, k, v, *, scale, eps):
  from pallas_kernels.dilution import api as dilution  # pylint: disable=import-outside-toplevel
  return dilution.dilution_prefill(q, k, v, scale=scale, eps=eps, interpret=_interpret())


def _decode_xla(q, k_cache, v_cache, demand, length, *, scale, eps):
  return dilution_reference.dilution_decode_step(q, k_cache, v_cache, demand, length, scale=scale, eps=eps)


def _decode_pallas(q, k_cache, v_cache, demand, length, *, scale, eps):
  from pallas_kernels.dilution import api as dilution  # pylint: disable=import-outside-toplevel
  return dilution.dilution_decode_step(q, k_cache, v_cache, demand, length, scale=scale, eps=eps,
                                       interpret=_interpret())


IMPLEMENTATIONS: dict[str, dict[str, Callable]] = {
    "focal_attention": {"xla": _focal_xla, "pallas": _focal_pallas, "cudnn": _focal_cudnn,
                        "tokamax": _focal_tokamax},
    "dilution_attention": {"xla": _dilution_xla, "pallas": _dilution_pallas},
    "dilution_prefill": {"xla": _prefill_xla, "pallas": _prefill_pallas},
    "dilution_decode_step": {"xla": _decode_xla, "pallas": _decode_pallas},
}


def _impl(op: str, implementation: str) -> Callable:
  table = IMPLEMENTATIONS[op]
  if implementation not in table:
    raise ValueError(f"{op}: implementation must be one of {sorted(table)}; got {implementation!r}")
  return table[implementation]


def _call(op, implementation, *args, **kwargs):
  return _impl(op, implementation)(*args, **kwargs)


def _default_scale(q, scale):
  return q.shape[-1] ** -0.5 if scale is None else scale


def focal_attention(q, k, v, *, scale, causal=True, segment_ids=None, implementation="xla"):
  """softmax(scale · q·kᵀ) over the visible keys, times v.

  `scale`: a Python float, or an array broadcastable to [B, Hq, T] (per sequence, head or query);
  gradients flow to an array scale (this is how a learned temperature trains).
  """
  reference.check_qkv(q, k, v)
  return _call("focal_attention", implementation, q, k, v, scale=scale, causal=causal,
               segment_ids=segment_ids)


def dilution_attention(q, k, v, *, scale=None, eps=1e-9, segment_ids=None, implementation="xla",
                       checkpoint_rows=None):
  """Causal dilution attention: p = causal softmax; share = p / (committed + p + eps) with
  committed the exclusive column cumsum of p over queries; rows renormalised; out = A @ v.

  `checkpoint_rows` (Pallas): rows R between the demand checkpoints the backward keeps, a power
  of two >= 64; they take ceil(T / R)·T·4 bytes per batch row and query head. None: the kernels'
  1024. 64 lets the Hopper backward skip rebuilding its carries (H200: 0-8% faster end to end).
  """
  reference.check_qkv(q, k, v)
  if checkpoint_rows is not None:
    check_checkpoint_rows(checkpoint_rows, "checkpoint_rows")
  return _call("dilution_attention", implementation, q, k, v, scale=_default_scale(q, scale),
               eps=eps, segment_ids=segment_ids, checkpoint_rows=checkpoint_rows)


def check_checkpoint_rows(rows, field: str) -> None:
  """Raises ValueError naming `field` unless rows is a power of two >= 64 (the kernels' tile)."""
  if not isinstance(rows, int) or rows < 64 or rows & (rows - 1):
    raise ValueError(f"{field}: must be a power of two >= 64 (64, 128, ..., 1024, ...); "
                     f"got {rows!r}")


def dilution_prefill(q, k, v, *, scale=None, eps=1e-9, implementation="xla"):
  """Dilution over a whole prompt; returns (out, demand float32 [B, Hq, S] = Σ_i p[i, j])."""
  reference.check_qkv(q, k, v)
  return _call("dilution_prefill", implementation, q, k, v, scale=_default_scale(q, scale), eps=eps)


def dilution_decode_step(q, k_cache, v_cache, demand, length, *, scale=None, eps=1e-9,
                         implementation="xla"):
  """One cached step for the query at position length-1 (q [B, Hq, D]); returns (out, demand)."""
  if q.ndim != 3:
    raise ValueError(f"q must be [B, Hq, D] for a decode step; got {q.shape}")
  return _call("dilution_decode_step", implementation, q, k_cache, v_cache, demand, length,
               scale=_default_scale(q, scale), eps=eps)

