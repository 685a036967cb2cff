"""focaljax.dispatch: the one table of which implementation runs each op on each platform."""

import jax.numpy as jnp
import pytest

from focaljax import dispatch

BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.fixture
def on(monkeypatch):
  def set_platform(name):
    monkeypatch.setattr(dispatch, "platform", lambda: name)
  return set_platform


def _focal(**kw):
  c = dispatch.choose("focal_attention", kw.pop("requested", "auto"), **kw)
  return c.implementation, c.backend


def test_platform_names_this_machine():
  assert dispatch.platform() in ("hopper", "gpu", "tpu", "cpu")
  if dispatch.platform() == "cpu":   # the CI machine: auto is the reference everywhere
    assert dispatch.choose("focal_attention", dtype=BF16) == dispatch.Choice("xla")


def test_focal_auto_per_platform(on):
  on("hopper")
  assert _focal(dtype=BF16) == ("cudnn", None)
  assert _focal(dtype=F32) == ("pallas", "mosaic")   # cuDNN takes 16-bit inputs only
  on("gpu")
  assert _focal(dtype=BF16) == ("cudnn", None)
  assert _focal(dtype=F32) == ("pallas", "triton")
  on("tpu")
  assert _focal(dtype=BF16) == ("pallas", "tpu")
  on("cpu")
  assert _focal(dtype=BF16) == ("xla", None)
  assert dispatch.choose("focal_attention", "pallas", dtype=BF16) == dispatch.Choice(
      "pallas", "triton", interpret=True)


def test_focal_auto_sends_long_packed_rows_past_cudnn(on):
  """cuDNN gets packed segments as a dense T x T mask: the Pallas kernels from 2K on Hopper
  (Mosaic), from 16K elsewhere (Triton)."""
  on("hopper")
  assert _focal(dtype=BF16, seq_len=2048, packed=True) == ("pallas", "mosaic")
  assert _focal(dtype=BF16, seq_len=1024, packed=True) == ("cudnn", None)
  assert _focal(dtype=BF16, seq_len=16384, packed=False) == ("cudnn", None)
  on("gpu")
  assert _focal(dtype=BF16, seq_len=16384, packed=True) == ("pallas", "triton")
  assert _focal(dtype=BF16, seq_len=8192, packed=True) == ("cudnn", None)


def test_focal_auto_never_sends_lengths_the_kernels_cannot_tile(on):
  """The Pallas kernels do not pad: a short odd prompt (T = 56) or a key length off the tiles
  runs where any length does, instead of failing in the kernel."""
  for where in ("hopper", "gpu"):
    on(where)
    assert _focal(dtype=F32, head_dim=64, seq_len=64) == ("pallas", _pallas_backend(where))
    assert _focal(dtype=F32, head_dim=64, seq_len=56) == ("xla", None)
    assert _focal(dtype=F32, head_dim=64, seq_len=64, kv_len=100) == ("xla", None)
    assert _focal(dtype=BF16, head_dim=64, seq_len=16400, packed=True) == ("cudnn", None)
    assert _focal(dtype=F32, head_dim=64, seq_len=56, requested="pallas")[0] == "pallas"


def _pallas_backend(where):
  return "mosaic" if where == "hopper" else "triton"


def test_sliding_window_never_reaches_a_kernel_without_one(on):
  """The Pallas and tokamax focal kernels have no window: cuDNN takes it (16-bit, GPU), else the
  reference, whatever else was requested."""
  for where in ("hopper", "gpu"):
    on(where)
    for requested in ("auto", "pallas", "tokamax", "cudnn"):
      assert _focal(requested=requested, dtype=BF16, window=16) == ("cudnn", None)
    assert _focal(dtype=F32, window=16) == ("xla", None)
    assert _focal(dtype=BF16, seq_len=16384, packed=True, window=16) == ("cudnn", None)
  for where in ("tpu", "cpu"):
    on(where)
    for requested in ("auto", "pallas", "tokamax", "xla"):
      assert _focal(requested=requested, dtype=BF16, window=16) == ("xla", None)


def test_forced_implementations(on):
  on("gpu")
  assert _focal(requested="xla", dtype=F32) == ("xla", None)
  assert _focal(requested="tokamax", dtype=BF16) == ("tokamax", None)
  with pytest.raises(ValueError, match="bfloat16/float16"):
    _focal(requested="cudnn", dtype=F32)
  on("cpu")
  with pytest.raises(NotImplementedError, match="needs an NVIDIA GPU"):
    _focal(requested="cudnn", dtype=BF16)
  with pytest.raises(ValueError, match="implementation must be one of"):
    _focal(requested="triton", dtype=BF16)


@pytest.mark.parametrize("op", ["dilution_attention", "dilution_prefill", "dilution_decode_step"])
def test_dilution_per_platform(on, op):
  """No cuDNN kernels for dilution: a library name means the fused kernels on GPUs; the TPU trains
  and prefills through its Mosaic TPU port and runs the reference for decode."""
  tpu = ("xla", None) if op == "dilution_decode_step" else ("pallas", "tpu")
  want = {("hopper", "auto"): ("pallas", "mosaic"), ("hopper", "cudnn"): ("pallas", "mosaic"),
          ("gpu", "auto"): ("pallas", "triton"), ("tpu", "auto"): tpu,
          ("tpu", "pallas"): tpu, ("cpu", "auto"): ("xla", None),
          ("cpu", "pallas"): ("pallas", "triton")}
  for (where, requested), got in want.items():
    on(where)
    c = dispatch.choose(op, requested, dtype=BF16, head_dim=64)
    assert (c.implementation, c.backend) == got, (where, requested)
    assert c.interpret == (where == "cpu" and got[0] == "pallas")


def test_checkpoint_rows_become_the_kernels_ckpt_rows(on):
  from pallas_kernels import dilution
  on("hopper")
  c = dispatch.choose("dilution_attention", dtype=BF16, head_dim=128, checkpoint_rows=64)
  want = dilution.default_block_sizes("mosaic", 128, BF16)
  assert c.block_sizes.ckpt_rows == 64 and c.block_sizes.b1_block_k == want.b1_block_k
  assert dispatch.choose("dilution_attention", dtype=BF16, head_dim=128).block_sizes is None
  on("tpu")
  c = dispatch.choose("dilution_attention", dtype=BF16, head_dim=128, checkpoint_rows=64)
  assert (c.block_sizes.ckpt_rows, c.block_sizes.block_q) == (64, 64)


def test_glue_per_platform(on):
  for where in ("hopper", "gpu"):
    on(where)
    assert dispatch.choose("swiglu") == dispatch.Choice("pallas", "triton")
    assert dispatch.choose("qk_norm_rope", head_dim=128).implementation == "pallas"
    assert dispatch.choose("qk_norm_rope", head_dim=96).implementation == "xla"
    assert dispatch.choose("add_norm", width=1024).implementation == "pallas"
    assert dispatch.choose("add_norm", width=768).implementation == "xla"   # the kernels' blocks
    assert dispatch.choose("cross_entropy").implementation == "explicit"
  for where in ("tpu", "cpu"):
    on(where)
    for op in dispatch.GLUE:
      assert dispatch.choose(op, head_dim=128, width=1024) == dispatch.Choice("xla")
    assert dispatch.choose("cross_entropy").implementation == "optax"
  assert dispatch.choose("swiglu", "pallas") == dispatch.Choice("pallas", "triton", interpret=True)
  on("tpu")
  assert dispatch.choose("swiglu", "pallas") == dispatch.Choice("xla")   # Triton kernels only


def test_condense(on):
  on("cpu")
  assert dispatch.choose("condense", "pallas").interpret
  on("gpu")
  assert not dispatch.choose("condense", "pallas").interpret
  on("tpu")
  with pytest.raises(NotImplementedError, match="Triton-only"):
    dispatch.choose("condense", "pallas")
  assert dispatch.choose("condense", "xla").implementation == "xla"

