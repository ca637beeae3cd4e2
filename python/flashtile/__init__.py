"""flashtile: exact attention for NVIDIA GPUs with a FlashAttention-3-compatible API.

Importing is cheap and works without a GPU or the compiled library; the library loads on first use.
"""
from .build_config import KernelNotBuiltError, build_config
from .interface import (
    flash_attn_combine,
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    get_scheduler_metadata,
)
from ._lib import LibraryNotAvailableError

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "get_scheduler_metadata",
    "build_config",
    "KernelNotBuiltError",
    "LibraryNotAvailableError",
]
