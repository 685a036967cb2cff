"""Public attention operators and how each implementation runs them.

Shapes: q [B, T, Hq, D]; k, v [B, S, Hkv, D] (Hq % Hkv == 0); outputs [B, T, Hq, D] in q.dtype.
`implementation`: "xla", the pure-JAX references in `pallas_kernels.{focal,dilution}.reference`
(the spec); "pallas", the fused kernels (compiled on GPU/TPU, interpret mode on CPU); for focal
also "cudnn" (`jax.nn.dot_product_attention`, NVIDIA GPUs) and "tokamax"
(`tokamax.dot_product_attention`, an optional GPU/TPU extra), both with an array temperature
folded into q; "auto", whatever `focaljax.dispatch.choose` picks for this platform and call.
A sliding window (focal only) runs on the reference or cuDNN: `choose` routes it there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from focaljax import dispatch
from focaljax import sharding
from pallas_kernels.dilution import reference as dilution_reference
from pallas_kernels.focal import reference

_QKV = ("batch", None, "heads", None)
_ROWS = ("batch", None)


def _per_device(kernel, q, k, v, scale, segment_ids):
  """kernel(q, k, v, scale, segment_ids) on each device's rows and heads (sharding.per_device);
  an array scale is broadcast to [B, Hq, T] and split the same way."""
  if isinstance(scale, (int, float)):
    return sharding.per_device(lambda q, k, v, seg: kernel(q, k, v, scale, seg),
                               (_QKV, _QKV, _QKV, _ROWS), _QKV)(q, k, v, segment_ids)
  B, T, Hq, _ = q.shape
  return sharding.per_device(kernel, (_QKV, _QKV, _QKV, ("batch", "heads", None), _ROWS), _QKV)(
      q, k, v, reference.scale_BNT(scale, B, Hq, T), segment_ids)


# ------------------------------------------------------------------ focal / softmax attention


def _focal_xla(q, k, v, *, scale, causal, segment_ids, window, choice):
  del choice
  if window is None:
    return reference.attention(q, k, v, scale=scale, causal=causal, segment_ids_BT=segment_ids)
  # The reference with its visibility narrowed to keys t - window < s <= t (HF's sliding window).
  B, T, S, N, K, D = reference.check_qkv(q, k, v)
  vis_BTS = reference.visible_BTS(B, T, S, causal=causal, segment_ids_BT=segment_ids)
  vis_BTS &= (jnp.arange(T)[:, None] - jnp.arange(S)[None] < window)[None]
  logits_BKGTS = jnp.einsum("BTKGD,BSKD->BKGTS", q.reshape(B, T, K, N // K, D), k,
                            preferred_element_type=jnp.float32)
  logits_BKGTS *= reference.scale_BNT(scale, B, N, T).reshape(B, K, N // K, T, 1)
  logits_BKGTS = jnp.where(vis_BTS[:, None, None], logits_BKGTS, reference.MASK_VALUE)
  return reference.combine(jax.nn.softmax(logits_BKGTS, axis=-1), v, q.dtype)


def _focal_pallas(q, k, v, *, scale, causal, segment_ids, window, choice):
  del window   # dispatch.choose never sends a window here
  from pallas_kernels import focal  # pylint: disable=import-outside-toplevel

  def kernel(q, k, v, s, seg):
    return focal.focal_attention(q, k, v, scale=s, causal=causal, segment_ids=seg,
                                 backend=choice.backend, block_sizes=choice.block_sizes,
                                 interpret=choice.interpret)
  return _per_device(kernel, q, k, v, scale, segment_ids)


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


def _focal_cudnn(q, k, v, *, scale, causal, segment_ids, window, choice):
  del choice
  q, s = _fold_scale(q, scale)
  return jax.nn.dot_product_attention(
      q, k, v, scale=s, is_causal=causal, mask=_segment_mask(segment_ids), implementation="cudnn",
      local_window_size=None if window is None else (window - 1, 0))


def _focal_tokamax(q, k, v, *, scale, causal, segment_ids, window, choice):
  del choice, window   # dispatch.choose never sends a window here
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise NotImplementedError("implementation='tokamax' needs the optional tokamax package "
                              f"(pip install tokamax; GPU/TPU); importing it failed: {e}") from e
  q, s = _fold_scale(q, scale)
  return tokamax.dot_product_attention(q, k, v, mask=_segment_mask(segment_ids), scale=s,
                                       is_causal=causal)


_FOCAL = {"xla": _focal_xla, "pallas": _focal_pallas, "cudnn": _focal_cudnn,
          "tokamax": _focal_tokamax}


def _default_scale(q, scale):
  return q.shape[-1] ** -0.5 if scale is None else scale


def _choose(op, implementation, q, k, *, packed=False, checkpoint_rows=None, window=None):
  return dispatch.choose(op, implementation, dtype=q.dtype, head_dim=q.shape[-1],
                         seq_len=q.shape[1], kv_len=k.shape[1], packed=packed,
                         checkpoint_rows=checkpoint_rows, window=window)


def focal_attention(q, k, v, *, scale, causal=True, segment_ids=None, implementation="xla",
                    window=None):
  """softmax(scale · q·kᵀ) over the visible keys, times v.

  `scale`: a Python float, or an array broadcastable to [B, Hq, T] (per sequence, head or query);
  gradients flow to an array scale (this is how a learned temperature trains). `window`: causal
  only, query t sees at most the `window` keys t-window < s <= t (itself included).
  """
  reference.check_qkv(q, k, v)
  if window is not None and not (causal and window > 0):
    raise ValueError(f"window={window}: a sliding window needs causal=True and window > 0")
  choice = _choose("focal_attention", implementation, q, k, packed=segment_ids is not None,
                   window=window)
  return _FOCAL[choice.implementation](q, k, v, scale=scale, causal=causal,
                                       segment_ids=segment_ids, window=window, choice=choice)


def dilution_attention(q, k, v, *, scale=None, eps=1e-9, segment_ids=None, implementation="xla",
                       checkpoint_rows=None):
  """Causal dilution attention: p = causal softmax; share = p / (committed + p + eps) with
  committed the exclusive column cumsum of p over queries; rows renormalised; out = A @ v.

  `checkpoint_rows` (Pallas): rows between the demand checkpoints the backward keeps, a power of
  two >= 64, ceil(T / R)·T·4 bytes per batch row and query head; None: the kernels' default.
  """
  reference.check_qkv(q, k, v)
  scale = _default_scale(q, scale)
  choice = _choose("dilution_attention", implementation, q, k, packed=segment_ids is not None,
                   checkpoint_rows=checkpoint_rows)
  if choice.implementation == "xla":
    return dilution_reference.dilution_attention(q, k, v, scale=scale, eps=eps,
                                                 segment_ids_BT=segment_ids)[0]
  from pallas_kernels import dilution  # pylint: disable=import-outside-toplevel

  def kernel(q, k, v, s, seg):
    if choice.backend == "tpu":
      from pallas_kernels.dilution import tpu  # pylint: disable=import-outside-toplevel
      return tpu.dilution_attention(q, k, v, scale=s, eps=eps, segment_ids=seg,
                                    block_sizes=choice.block_sizes, interpret=choice.interpret)
    return dilution.dilution_attention(q, k, v, scale=s, eps=eps, segment_ids=seg,
                                       backend=choice.backend, block_sizes=choice.block_sizes,
                                       interpret=choice.interpret)
  return _per_device(kernel, q, k, v, scale, segment_ids)


def dilution_prefill(q, k, v, *, scale=None, eps=1e-9, implementation="xla"):
  """Dilution over a whole prompt; returns (out, demand float32 [B, Hq, S] = Σ_i p[i, j])."""
  reference.check_qkv(q, k, v)
  scale = _default_scale(q, scale)
  choice = _choose("dilution_prefill", implementation, q, k)
  if choice.implementation == "xla":
    return dilution_reference.dilution_attention(q, k, v, scale=scale, eps=eps)
  if choice.backend == "tpu":
    from pallas_kernels.dilution import tpu  # pylint: disable=import-outside-toplevel
    return tpu.dilution_prefill(q, k, v, scale=scale, eps=eps, block_sizes=choice.block_sizes,
                                interpret=choice.interpret)
  from pallas_kernels import dilution  # pylint: disable=import-outside-toplevel
  return dilution.dilution_prefill(q, k, v, scale=scale, eps=eps, backend=choice.backend,
                                   block_sizes=choice.block_sizes, interpret=choice.interpret)


def dilution_decode_step(q, k_cache, v_cache, demand, length, *, scale=None, eps=1e-9,
                         implementation="xla"):
  """One cached step for the query at position length-1 (q [B, Hq, D]); returns (out, demand)."""
  if q.ndim != 3:
    raise ValueError(f"q must be [B, Hq, D] for a decode step; got {q.shape}")
  scale = _default_scale(q, scale)
  choice = dispatch.choose("dilution_decode_step", implementation, dtype=q.dtype,
                           head_dim=q.shape[-1])
  if choice.implementation == "xla":
    return dilution_reference.dilution_decode_step(q, k_cache, v_cache, demand, length,
                                                   scale=scale, eps=eps)
  from pallas_kernels import dilution  # pylint: disable=import-outside-toplevel
  return dilution.dilution_decode_step(q, k_cache, v_cache, demand, length, scale=scale, eps=eps,
                                       block_sizes=choice.block_sizes, interpret=choice.interpret)
