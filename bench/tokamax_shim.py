"""What tokamax 0.0.12 needs to run under current jax in this repo's benchmarks (never in focaljax).

tokamax is an optional anchor of bench/attention.py and bench/train_step.py, pinned to 0.0.12
(bench/device.sh lists its wheels). Two things stop that release under current jax:
- it reads absl flags, which parse sys.argv on first use and reject a benchmark's own flags
  (`--impls ...`: UnrecognizedFlagError);
- it calls `plgpu.kernel` with `out_shape=` / `scratch_shapes=`, aliases jax 0.10 deprecated and
  0.11 removed. `prepare` maps them to `out_type=` / `scratch_types=`; a no-op where they exist.

  python bench/tokamax_shim.py    # applies the shim and imports tokamax: is it usable here?
"""
from __future__ import annotations

import argparse
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


if __name__ == "__main__":
  argparse.ArgumentParser(description=__doc__,
                          formatter_class=argparse.RawTextHelpFormatter).parse_args()
  try:
    prepare()
    import tokamax  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    sys.exit(f"tokamax is not usable here: {e}")
  print("tokamax", getattr(tokamax, "__version__", "?"), "imports with the shim")
