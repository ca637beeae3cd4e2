"""Argument validation for the public API: every check runs before any kernel and raises an error
that names the argument and what was expected.

Checks use only metadata (dtype, shape, strides, device), so they also run under FakeTensorMode and
torch.compile. Device checks come last so that the other checks can be exercised with CPU tensors.
"""
from __future__ import annotations

import math
import operator
from typing import Optional, Sequence

import torch

SUPPORTED_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
HEAD_DIM_PAIRS = {(192, 128)}  # (qk, v) combinations beyond qk == v


def _fail(name: str, msg: str) -> None:
    raise ValueError(f"flashtile: {name} {msg}")


def check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flashtile: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(name, f"must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        _fail(name, f"must have a contiguous last dimension (stride(-1) == 1), got strides {tuple(t.stride())}")


def dtype_name(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names: Sequence[str] = ("q", "k", "v")) -> str:
    for name, t in zip(names, (q, k, v)):
        if t.dtype in FP8_DTYPES:
            raise NotImplementedError(
                f"flashtile: FP8 attention ({name}.dtype={t.dtype}) is not implemented in this version; "
                "use float16 or bfloat16")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"flashtile: {name} must be float16 or bfloat16, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"flashtile: {', '.join(names)} must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return SUPPORTED_DTYPES[q.dtype]


def check_head_dims(d: int, dv: int) -> None:
    for name, x in (("q/k head dim", d), ("v head dim", dv)):
        if x % 8 != 0 or x <= 0:
            _fail(name, f"must be a positive multiple of 8, got {x}")
        if x > 256:
            _fail(name, f"must be <= 256, got {x}")
    if d != dv and (_bucket(d), _bucket(dv)) not in HEAD_DIM_PAIRS:
        _fail("v head dim", f"({dv}) must equal the q/k head dim ({d}) or form one of the pairs "
                            f"{sorted(HEAD_DIM_PAIRS)} (qk, v)")


def _bucket(d: int) -> int:
    for b in (64, 96, 128, 192, 256):
        if d <= b:
            return b
    return 0


def check_alignment(name: str, t: torch.Tensor) -> None:
    """16-byte vector loads need every non-unit stride and the base address to be 16-byte aligned."""
    elems = 16 // t.element_size()
    for dim, (size, stride) in enumerate(zip(t.shape[:-1], t.stride()[:-1])):
        if size > 1 and stride % elems != 0:
            _fail(name, f"stride({dim}) = {stride} must be a multiple of {elems} elements (16 bytes)")

def check_data_alignment(name: str, t: torch.Tensor) -> None:
    """Base address check: eager only (ops.fwd runs it), since traced tensors have no address."""
    if t.data_ptr() % 16 != 0:
        _fail(name, "data pointer must be 16-byte aligned")


def check_heads(nheads: int, nheads_k: int, name: str = "k") -> None:
    if nheads_k <= 0 or nheads % nheads_k != 0:
        _fail(name, f"has {nheads_k} heads; the number of query heads ({nheads}) must be a multiple of it")


def check_window(window_size: Sequence[int]) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        _fail("window_size", f"must be a (left, right) pair, got {window_size!r}")
    try:
        left, right = (operator.index(x) for x in window_size)  # int(2.5) would quietly narrow the window
    except TypeError:
        _fail("window_size", f"entries must be integers, got {tuple(window_size)!r}")
    if left < -1 or right < -1:
        _fail("window_size", f"entries must be >= -1 (-1 = unbounded), got {tuple(window_size)}")
    return left, right


def check_softcap(softcap: float) -> None:
    # NaN fails every comparison, so the kernels would silently run without softcap; inf makes every
    # score NaN (softcap * tanh(s / softcap) = inf * 0).
    if not (math.isfinite(softcap) and softcap >= 0):
        _fail("softcap", f"must be >= 0 and finite (0 disables it), got {softcap}")


def check_softmax_scale(scale: float) -> None:
    # The kernels mask scores with -inf before scaling and keep row maxima in the scaled domain, which
    # holds for a positive scale only (0 would turn masked scores into NaN, a negative one into +inf).
    if not (math.isfinite(scale) and scale > 0):
        _fail("softmax_scale", f"must be a finite number > 0, got {scale}")


def check_int32_vector(name: str, t: Optional[torch.Tensor], length: int) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flashtile: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        _fail(name, f"must be torch.int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != length:
        _fail(name, f"must have shape ({length},), got {tuple(t.shape)}")
    if t.stride(0) != 1 and length > 1:
        _fail(name, "must be contiguous")


def check_descales(batch: int, nheads_k: int, q: torch.Tensor, descales) -> None:
    for name, t in zip(("q_descale", "k_descale", "v_descale"), descales):
        if t is None:
            continue
        if q.dtype not in FP8_DTYPES:
            _fail(name, f"only applies to float8 inputs (q is {q.dtype})")
        if tuple(t.shape) != (batch, nheads_k):
            _fail(name, f"must have shape (batch, nheads_k) = {(batch, nheads_k)}, got {tuple(t.shape)}")
        if t.dtype != torch.float32:
            _fail(name, f"must be torch.float32, got {t.dtype}")


def check_same_device(tensors: dict) -> torch.device:
    """All tensors on one CUDA device."""
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cuda":
            _fail(name, f"must be on a CUDA device, got {t.device}")
        if device is None:
            device = t.device
        elif t.device != device:
            _fail(name, f"is on {t.device} but q is on {device}; all tensors must share one device")
    return device


def not_implemented(feature: str) -> None:
    raise NotImplementedError(f"flashtile: {feature} is not implemented in this version")
