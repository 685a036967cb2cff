"""Focal attention kernels: `focal_attention(..., backend="triton" | "mosaic" | "tpu")`.

`BlockSizes` tiles the Triton kernels, `MosaicBlockSizes` the Hopper Mosaic GPU ones; the spec is
`reference.attention`.
"""

from pallas_kernels.focal.api import BACKENDS, focal_attention
from pallas_kernels.focal.mosaic import BlockSizes as MosaicBlockSizes
from pallas_kernels.focal.triton import BlockSizes

__all__ = ["BACKENDS", "BlockSizes", "MosaicBlockSizes", "focal_attention"]
