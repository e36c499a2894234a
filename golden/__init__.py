"""Golden model: float64 reference and the bit-exact hardware model.

``reference_attention`` states intent; ``flash_attention_hw`` is what the RTL
must reproduce bit for bit; ``numerics`` defines the arithmetic.
Dependencies point one way: hdl, tb, sim and the driver import golden; golden
imports none of them.
"""

from .compare import ComparisonError, assert_bit_exact, error_stats, tolerance_check
from .flash import GoldenResult, Partial, TileCheckpoint, flash_attention_hw, merge_partials, op_counts
from .reference import check_shapes, plain_fp16_attention, reference_attention, visible_mask

__all__ = [
    "ComparisonError", "assert_bit_exact", "error_stats", "tolerance_check",
    "GoldenResult", "Partial", "TileCheckpoint", "flash_attention_hw", "merge_partials", "op_counts",
    "check_shapes", "plain_fp16_attention", "reference_attention", "visible_mask",
]
