"""flashnpu: an RTL model of a register-level, 3D-stacked NPU running FlashAttention."""

from .config import DEFAULT, NPUConfig, small_config

__all__ = ["DEFAULT", "NPUConfig", "small_config"]
__version__ = "0.1.0"
