"""Which implementation runs each operation: the one place that asks what hardware this is.

`choose(op, requested, ...)` maps an operation, the platform, and the call's dtype, shape and
packing to a `Choice`: the implementation, the Pallas backend, block sizes and interpret mode.
`requested` is the user's `model.attention.implementation` for attention ("auto", or one
forced); the glue passes and the loss take "auto" from the model (tests force "pallas").

  op                       cpu     tpu          gpu                      hopper
  focal_attention          xla     pallas/tpu   cudnn                    cudnn
    float32 q, k, v                             pallas/triton            pallas/mosaic
    packed rows, T >=                           16K: pallas/triton       2K: pallas/mosaic
    T, S the kernels cannot tile                cudnn (16-bit) or xla    cudnn (16-bit) or xla
    sliding window         xla     xla          cudnn (16-bit) or xla    cudnn (16-bit) or xla
  dilution_attention,      xla     pallas/tpu   pallas/triton            pallas/mosaic
    _prefill
  dilution_decode_step     xla     xla          pallas/triton            pallas/mosaic
  qk_norm_rope, swiglu,    xla     xla          pallas (Triton kernels; qk_norm_rope needs a
  add_norm                                      power-of-two head dim, add_norm a d_model >= 16)
  cross_entropy            optax   optax        explicit                 explicit
  condense (FocusLLM)      xla     xla          pallas                   pallas  (pallas raises on TPU)

Why: cuDNN's fused attention is the fastest focal path for unpacked 16-bit rows, but takes only
16-bit inputs and gets packed rows as a dense [B, 1, T, T] mask, which the Mosaic kernel's
segment masking beats from 2K on Hopper; elsewhere the Triton kernel lost at 2K, and from 16K the
mask takes 256 MiB a row. The Pallas and tokamax focal kernels have no sliding window: a call
with one that requests them (or auto) runs on cuDNN (16-bit, GPUs) or the reference. Dilution
trains and prefills on TPU through its Mosaic TPU port (decode there runs the reference); the glue
kernels are Triton only: off GPUs Pallas runs in interpret mode (CPU tests) or, on TPU, gives
way to XLA. The explicit
cross-entropy's one-pass reduction wins on GPUs and lowers slowly on CPU. Numbers:
docs/performance.md.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "xla", "pallas", "cudnn", "tokamax")   # model.attention.implementation
ATTENTION = ("focal_attention", "dilution_attention", "dilution_prefill", "dilution_decode_step")
GLUE = ("qk_norm_rope", "swiglu", "add_norm")

# Packed rows (segment ids) from this length on go to the Pallas focal kernel instead of cuDNN.
_PACKED_PAST_CUDNN = {"hopper": 2048, "gpu": 16384}


@dataclasses.dataclass(frozen=True)
class Choice:
  implementation: str            # xla | pallas | cudnn | tokamax; the loss: optax | explicit
  backend: str | None = None     # Pallas: triton | mosaic | tpu
  block_sizes: object = None     # dilution_attention: the kernels' BlockSizes; None: their default
  interpret: bool = False        # Pallas interpret mode (no GPU or TPU)


def platform() -> str:
  """"hopper" (an sm_90 GPU: H100, H200), "gpu", "tpu" or "cpu"."""
  backend = jax.default_backend()
  if backend in ("gpu", "cuda", "rocm"):
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    return "hopper" if capability.startswith("9.") else "gpu"
  return backend if backend == "tpu" else "cpu"


# Dense bf16 peak FLOP/s per device (datasheets), by device kind: MFU's denominator.
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "v5p": 459e12, "v5e": 197e12,
               "v5 lite": 197e12, "v4": 275e12, "v6": 918e12, "B200": 2250e12}


def peak_flops() -> float | None:
  """The device's dense bf16 peak FLOP/s, or None for a chip not in the table."""
  kind = jax.devices()[0].device_kind.lower()
  return next((f for key, f in _PEAK_FLOPS.items() if key.lower() in kind), None)


def _gpu(where: str) -> bool:
  return where in ("hopper", "gpu")


def unavailable(requested: str) -> str | None:
  """Why attention implementation `requested` cannot run on this machine; None when it can.
  Asked before a run writes anything (its config may have been checked on another machine)."""
  if requested == "cudnn" and not _gpu(platform()):
    return "'cudnn' needs an NVIDIA GPU; use 'xla', 'pallas' or 'auto'"
  if requested == "tokamax" and importlib.util.find_spec("tokamax") is None:
    return "'tokamax' needs the optional tokamax package (pip install tokamax; GPU/TPU)"
  return None


def _pallas(where: str, **kw) -> Choice:
  backend = {"hopper": "mosaic", "tpu": "tpu"}.get(where, "triton")
  return Choice("pallas", backend, interpret=where == "cpu", **kw)


def _sixteen_bit(dtype) -> bool:
  return dtype is not None and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)


def _tiles_fit(seq_len, kv_len, head_dim, dtype) -> bool:
  if None in (seq_len, head_dim, dtype):
    return True
  from pallas_kernels import focal  # pylint: disable=import-outside-toplevel
  return focal.tiles_fit(seq_len, seq_len if kv_len is None else kv_len, head_dim, dtype)


def _focal(requested, where, *, dtype, head_dim, seq_len, kv_len, packed, window) -> Choice:
  if window is not None and requested not in ("xla", "cudnn"):
    requested = "cudnn" if _gpu(where) and _sixteen_bit(dtype) else "xla"
  if requested == "auto":
    if not _gpu(where):
      return Choice("xla") if where == "cpu" else _pallas(where)
    long_packed = packed and seq_len is not None and seq_len >= _PACKED_PAST_CUDNN[where]
    requested = "pallas" if long_packed or not _sixteen_bit(dtype) else "cudnn"
    if requested == "pallas" and not _tiles_fit(seq_len, kv_len, head_dim, dtype):
      requested = "cudnn" if _sixteen_bit(dtype) else "xla"   # lengths the kernels cannot tile
  if requested == "cudnn":
    if not _gpu(where):
      raise NotImplementedError(f"implementation={unavailable('cudnn')}")
    if not _sixteen_bit(dtype):
      raise ValueError(f"implementation='cudnn' takes bfloat16/float16 q, k, v; got {dtype} "
                       "(use 'pallas', 'xla' or 'auto', which sends float32 to 'pallas')")
  return _pallas(where) if requested == "pallas" else Choice(requested)


def _dilution(op, requested, where, *, dtype, head_dim, checkpoint_rows) -> Choice:
  # A library name means the fused kernels here. TPU: training and prefill have a Pallas port,
  # decode runs the reference (its memory is O(S) there too).
  if requested == "xla" or (requested == "auto" and where == "cpu"):
    return Choice("xla")
  if where == "tpu":
    if op == "dilution_decode_step":
      return Choice("xla")
    from pallas_kernels.dilution import tpu  # pylint: disable=import-outside-toplevel
    bs = None
    if op == "dilution_attention" and checkpoint_rows is not None:   # needs ckpt_rows >= block_q
      bs = tpu.TpuBlockSizes(block_q=min(128, checkpoint_rows), ckpt_rows=checkpoint_rows)
    return Choice("pallas", "tpu", block_sizes=bs)
  choice = _pallas(where)
  if op == "dilution_attention" and checkpoint_rows is not None:
    from pallas_kernels import dilution  # pylint: disable=import-outside-toplevel
    bs = dilution.default_block_sizes(choice.backend, head_dim, dtype)
    choice = dataclasses.replace(choice, block_sizes=dataclasses.replace(
        bs, ckpt_rows=checkpoint_rows))
  return choice


def _glue(op, requested, where, *, head_dim, width) -> Choice:
  if requested not in ("auto", "xla", "pallas"):
    raise ValueError(f"{op}: implementation must be 'auto', 'xla' or 'pallas'; got {requested!r}")
  if requested == "auto":
    fits = {"qk_norm_rope": head_dim is None or not head_dim & (head_dim - 1),
            "add_norm": width is not None and width >= 16 and not width & (width - 1)}
    requested = "pallas" if _gpu(where) and fits.get(op, True) else "xla"
  if requested == "xla" or where == "tpu":   # Triton kernels: XLA's passes on TPU
    return Choice("xla")
  return Choice("pallas", "triton", interpret=where == "cpu")


def choose(op: str, requested: str = "auto", *, dtype=None, head_dim: int | None = None,
           seq_len: int | None = None, kv_len: int | None = None, packed: bool = False,
           width: int | None = None, checkpoint_rows: int | None = None,
           window: int | None = None) -> Choice:
  """The implementation of `op` for this call (see the module docstring's table).

  dtype, head_dim, seq_len, kv_len (default seq_len), packed (segment ids present): the
  attention call's; width: d_model
  for add_norm; checkpoint_rows: dilution_attention's demand checkpoints (validated in
  focaljax.config), replacing the kernels' default `BlockSizes.ckpt_rows`; window: the focal
  call's sliding window (None: none).
  """
  where = platform()
  if op in ATTENTION:
    if requested not in IMPLEMENTATIONS:
      raise ValueError(f"{op}: implementation must be one of {list(IMPLEMENTATIONS)}; got "
                       f"{requested!r}")
  if op == "focal_attention":
    return _focal(requested, where, dtype=dtype, head_dim=head_dim, seq_len=seq_len,
                  kv_len=kv_len, packed=packed, window=window)
  if op in ATTENTION:
    return _dilution(op, requested, where, dtype=dtype, head_dim=head_dim,
                     checkpoint_rows=checkpoint_rows)
  if op in GLUE:
    return _glue(op, requested, where, head_dim=head_dim, width=width)
  if op == "cross_entropy":
    if requested == "auto":
      return Choice("explicit" if _gpu(where) else "optax")
    return Choice(requested)
  if op == "condense":   # FocusLLM's candidate and local attentions: the kernels win on GPUs
    if requested not in ("auto", "xla", "pallas"):
      raise ValueError(f"condense: implementation must be 'auto', 'xla' or 'pallas'; got "
                       f"{requested!r}")
    if requested == "auto":
      requested = "pallas" if _gpu(where) else "xla"
    if requested == "pallas" and where == "tpu":
      raise NotImplementedError("the condense kernels are Triton-only (GPU); use "
                                "implementation='xla' on TPU")
    return Choice(requested, interpret=requested == "pallas" and where == "cpu")
  raise ValueError(f"dispatch.choose: unknown op {op!r}")
