"""Dilution attention kernels: training (exact custom VJP), prefill and cached decode.

Entry points in api.py (its docstring: operator, passes, memory, precision); tile sizes and
their defaults in blocks.py; the XLA specification in reference.py.
"""

from pallas_kernels.dilution.api import dilution_attention, dilution_decode_step, dilution_prefill
from pallas_kernels.dilution.blocks import BACKENDS, BlockSizes, default_block_sizes

__all__ = ["BACKENDS", "BlockSizes", "default_block_sizes", "dilution_attention",
           "dilution_decode_step", "dilution_prefill"]
