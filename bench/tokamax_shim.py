"""What tokamax 0.0.12 needs to run under jax 0.11 in this repo's benchmarks (never in focaljax).

tokamax 0.0.12 is the newest release on the GPU machine's index (0.0.17, which the issue's anchors
used, is not there; 0.1.0 is an empty placeholder). Two things stop it there:
- it reads absl flags, which parse sys.argv on first use and reject a benchmark's own flags
  (`--impls ...`: UnrecognizedFlagError, twenty-eighth session);
- it calls `plgpu.kernel` with `out_shape=` / `scratch_shapes=`, aliases jax 0.10 deprecated and
  0.11 removed (0.11.2 passes them on to Mesh: "Mesh.__init__() got an unexpected keyword argument
  'out_shape'"). `prepare` maps them to `out_type=` / `scratch_types=`; a no-op where they exist.
"""
from __future__ import annotations

import inspect
import sys


def prepare() -> None:
  """Call before the first tokamax call of a process; safe to call again."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(sys.argv[:1])
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  kernel = plgpu.kernel
  if "out_shape" in inspect.signature(kernel).parameters or getattr(kernel, "_aliased", False):
    return

  def aliased(*args, out_shape=None, scratch_shapes=None, **kwargs):
    if out_shape is not None:
      kwargs["out_type"] = out_shape
    if scratch_shapes is not None:
      kwargs["scratch_types"] = scratch_shapes
    return kernel(*args, **kwargs)

  aliased._aliased = True
  plgpu.kernel = aliased
