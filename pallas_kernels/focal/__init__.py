"""Focal attention kernels: `focal_attention(..., backend="triton" | "mosaic" | "tpu")`."""

from pallas_kernels.focal.api import BACKENDS, focal_attention, tiles_fit
from pallas_kernels.focal.mosaic import BlockSizes as MosaicBlockSizes
from pallas_kernels.focal.triton import BlockSizes

__all__ = ["BACKENDS", "BlockSizes", "MosaicBlockSizes", "focal_attention", "tiles_fit"]
