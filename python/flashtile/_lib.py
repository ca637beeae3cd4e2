"""Loading of the compiled library (libflashtile.so) through ctypes, and its C ABI mirror.

The library is loaded on first use, never at import, so `import flashtile` works on machines with no
GPU and no compiled library. Any problem (missing file, unloadable, ABI or build-config mismatch)
raises one LibraryNotAvailableError that says what to do.
"""
from __future__ import annotations

import ctypes
import json
import os
import threading

ABI_VERSION = 8  # must equal FT_ABI_VERSION in common/flash_api.h
BWD_SEMAPHORE_ROWS = 32  # FT_BWD_SEMAPHORE_ROWS: query rows per deterministic-mode dq semaphore
BWD_ACCUM_ROW_PAD = 128  # FT_BWD_ACCUM_ROW_PAD: row padding of the fp32 dq accumulator
FWD_COUNTERS = 1024  # FT_FWD_COUNTERS: int32 elements of FtFwdParams.tile_counter (the forward's scheduler workspace)

# FtStatus
OK, INVALID_ARGUMENT, NOT_BUILT, UNSUPPORTED_DEVICE, CUDA_ERROR = 0, 1, 2, 3, 4
# FtDtype / FtPath
DTYPE_FP16, DTYPE_BF16, DTYPE_E4M3 = 0, 1, 2
PATHS = {"auto": 0, "ampere": 1, "hopper": 2}


class LibraryNotAvailableError(RuntimeError):
    """The compiled flashtile library is missing, cannot be loaded, or does not match this package."""


class FtFwdParams(ctypes.Structure):
    """Mirror of FtFwdParams (common/flash_api.h); field order and types must match exactly."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("lse", ctypes.c_void_p),
        ("q_batch_stride", ctypes.c_int64), ("q_row_stride", ctypes.c_int64), ("q_head_stride", ctypes.c_int64),
        ("k_batch_stride", ctypes.c_int64), ("k_row_stride", ctypes.c_int64), ("k_head_stride", ctypes.c_int64),
        ("v_batch_stride", ctypes.c_int64), ("v_row_stride", ctypes.c_int64), ("v_head_stride", ctypes.c_int64),
        ("o_batch_stride", ctypes.c_int64), ("o_row_stride", ctypes.c_int64), ("o_head_stride", ctypes.c_int64),
        ("lse_batch_stride", ctypes.c_int64), ("lse_head_stride", ctypes.c_int64),
        ("cu_seqlens_q", ctypes.c_void_p), ("cu_seqlens_k", ctypes.c_void_p),
        ("seqused_q", ctypes.c_void_p), ("seqused_k", ctypes.c_void_p),
        ("tile_counter", ctypes.c_void_p),
        ("batch", ctypes.c_int32), ("seqlen_q", ctypes.c_int32), ("seqlen_k", ctypes.c_int32),
        ("rows_q", ctypes.c_int32), ("rows_k", ctypes.c_int32),
        ("num_heads", ctypes.c_int32), ("num_heads_k", ctypes.c_int32),
        ("head_dim", ctypes.c_int32), ("head_dim_v", ctypes.c_int32),
        ("softmax_scale", ctypes.c_float), ("softcap", ctypes.c_float),
        ("window_left", ctypes.c_int32), ("window_right", ctypes.c_int32), ("is_causal", ctypes.c_int32),
        ("dtype", ctypes.c_int32), ("path", ctypes.c_int32), ("device", ctypes.c_int32),
        ("pack_gqa", ctypes.c_int32), ("tile_counter_zeroed", ctypes.c_int32),
        ("split_accum", ctypes.c_void_p), ("split_accum_bytes", ctypes.c_int64),
        ("num_splits", ctypes.c_int32), ("reserved", ctypes.c_int32),
    ]


class FtBwdParams(ctypes.Structure):
    """Mirror of FtBwdParams (common/flash_api.h); field order and types must match exactly."""

    _fields_ = [
        ("fwd", FtFwdParams),
        ("dout", ctypes.c_void_p), ("dlse", ctypes.c_void_p),
        ("dq", ctypes.c_void_p), ("dk", ctypes.c_void_p), ("dv", ctypes.c_void_p),
        ("dq_accum", ctypes.c_void_p), ("dsoftmax_sum", ctypes.c_void_p), ("lse_log2", ctypes.c_void_p),
        ("dq_semaphore", ctypes.c_void_p), ("dq_done", ctypes.c_void_p),
        ("do_batch_stride", ctypes.c_int64), ("do_row_stride", ctypes.c_int64), ("do_head_stride", ctypes.c_int64),
        ("dq_batch_stride", ctypes.c_int64), ("dq_row_stride", ctypes.c_int64), ("dq_head_stride", ctypes.c_int64),
        ("dk_batch_stride", ctypes.c_int64), ("dk_row_stride", ctypes.c_int64), ("dk_head_stride", ctypes.c_int64),
        ("dv_batch_stride", ctypes.c_int64), ("dv_row_stride", ctypes.c_int64), ("dv_head_stride", ctypes.c_int64),
        ("dq_accum_batch_stride", ctypes.c_int64), ("dq_accum_row_stride", ctypes.c_int64),
        ("dq_accum_head_stride", ctypes.c_int64),
        ("deterministic", ctypes.c_int32), ("reserved", ctypes.c_int32),
    ]


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def library_dir() -> str:
    return os.environ.get("FLASHTILE_LIBRARY_DIR") or os.path.join(os.path.dirname(__file__), "lib")


def library_path() -> str:
    return os.path.join(library_dir(), "libflashtile.so")


def installed_build_config() -> dict:
    """build_config.json installed next to the library (readable without loading it)."""
    path = os.path.join(library_dir(), "build_config.json")
    if not os.path.exists(path):
        raise LibraryNotAvailableError(
            f"flashtile's compiled library is not installed ({path} is missing). Install the package with "
            "`pip install .` from a source checkout (needs the CUDA toolkit) or a prebuilt wheel.")
    with open(path) as f:
        return json.load(f)


def _load() -> ctypes.CDLL:
    path = library_path()
    if not os.path.exists(path):
        raise LibraryNotAvailableError(
            f"flashtile's compiled library was not found at {path}. Install the package with `pip install .` "
            "(builds the CUDA kernels) or set FLASHTILE_LIBRARY_DIR to a folder holding libflashtile.so.")
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise LibraryNotAvailableError(f"flashtile's compiled library at {path} could not be loaded: {e}") from e
    lib.ft_abi_version.restype = ctypes.c_int
    abi = lib.ft_abi_version()
    if abi != ABI_VERSION:
        # Checked before any other symbol is looked up: a library of another ABI may lack some of them.
        raise LibraryNotAvailableError(
            f"flashtile library at {path} has ABI version {abi}, this Python package expects {ABI_VERSION}: "
            "reinstall flashtile so the two come from the same build.")
    lib.ft_fwd_params_size.restype = ctypes.c_int
    lib.ft_bwd_params_size.restype = ctypes.c_int
    lib.ft_build_config.restype = ctypes.c_char_p
    lib.ft_last_error.restype = ctypes.c_char_p
    lib.ft_fwd_split_accum_bytes.restype = ctypes.c_int64
    lib.ft_fwd_split_accum_bytes.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.ft_mha_fwd.restype = ctypes.c_int
    lib.ft_mha_fwd.argtypes = [ctypes.POINTER(FtFwdParams), ctypes.c_void_p]
    lib.ft_mha_bwd.restype = ctypes.c_int
    lib.ft_mha_bwd.argtypes = [ctypes.POINTER(FtBwdParams), ctypes.c_void_p]
    for struct, size_fn in ((FtFwdParams, lib.ft_fwd_params_size), (FtBwdParams, lib.ft_bwd_params_size)):
        if size_fn() != ctypes.sizeof(struct):
            raise LibraryNotAvailableError(
                f"flashtile library at {path} has {struct.__name__} of {size_fn()} bytes, this package "
                f"expects {ctypes.sizeof(struct)}: reinstall flashtile so the two come from the same build.")
    embedded = json.loads(lib.ft_build_config().decode())
    installed = installed_build_config()
    if embedded != installed:
        raise LibraryNotAvailableError(
            f"flashtile library at {path} does not match its build_config.json (a partial reinstall?): "
            "reinstall flashtile.")
    return lib


def lib() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _load()
    return _lib


def embedded_build_config() -> dict:
    """The kernel list compiled into the loaded library."""
    return json.loads(lib().ft_build_config().decode())


def last_error() -> str:
    return lib().ft_last_error().decode(errors="replace")
