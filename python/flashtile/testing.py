"""Test helpers: the accuracy rule every kernel result must pass, input generators, output poisoning.

The tolerance rule (FlashAttention-3's). For a kernel output `out`, the float32 reference `ref_fp32`
(attention_ref with upcast=True) and the same math done naively in the input dtype `ref_lowp`
(attention_ref with upcast=False):

    max|out - ref_fp32| <= factor * max|ref_lowp - ref_fp32| + floor
    floor = 2 * eps(dtype) * max(1, max|ref_fp32|)

where eps(dtype) = torch.finfo(dtype).eps, the gap between 1.0 and the next representable value:
bfloat16 2**-7 = 0.0078125, float16 2**-10 = 0.000977, float32 2**-23, float8_e4m3fn 2**-3 = 0.125
(float8_e5m2 2**-2). `dtype` is the input (low-precision) dtype; check_close takes it from ref_lowp
unless told otherwise. The floor keeps the rule meaningful when the low-precision torch result happens
to be exact (e.g. outputs that are exactly 0), scaled to the magnitude of the reference. Maxima are
taken over the compared elements only (see `mask`), in float32, on out's device. Where the reference
is not finite (lse = -inf for fully masked rows), out must hold the very same value.
"""

import math
from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = ["eps", "tolerance", "check_close", "poison_like", "random_qkv", "generate_cu_seqlens"]

Tensor = torch.Tensor


def eps(dtype: torch.dtype) -> float:
    """torch.finfo(dtype).eps for a floating-point dtype (float8 included)."""
    if not dtype.is_floating_point:
        raise TypeError(f"eps is defined for floating-point dtypes only, got {dtype}")
    return float(torch.finfo(dtype).eps)


def tolerance(ref_fp32: Tensor, ref_lowp: Tensor, *, dtype: torch.dtype, factor: float = 2.0) -> float:
    """factor * max|ref_lowp - ref_fp32| + 2 * eps(dtype) * max(1, max|ref_fp32|), over finite entries."""
    ref = ref_fp32.detach().float()
    low = ref_lowp.detach().to(device=ref.device, dtype=torch.float32)
    if ref.shape != low.shape:
        raise ValueError(f"ref_fp32 {tuple(ref.shape)} and ref_lowp {tuple(low.shape)} must have the same shape")
    finite = torch.isfinite(ref) & torch.isfinite(low)
    lowp_err = _max_or_zero((low - ref).abs()[finite])
    ref_max = _max_or_zero(ref.abs()[torch.isfinite(ref)])
    return factor * lowp_err + 2.0 * eps(dtype) * max(1.0, ref_max)


def check_close(
    name: str,
    out: Tensor,
    ref_fp32: Tensor,
    ref_lowp: Tensor,
    *,
    factor: float = 2.0,
    mask: Optional[Tensor] = None,
    dtype: Optional[torch.dtype] = None,
) -> None:
    """Assert `out` passes the tolerance rule against the references; raise AssertionError if not.

    mask: bool, True = compare this element. It either broadcasts to out's shape or matches out's
    leading dims (e.g. a (batch, seqlen_q) row mask for a (batch, seqlen_q, heads, dv) output, or a
    (total_q,) mask for a varlen output). dtype: the dtype of the eps floor, default ref_lowp.dtype.
    """
    if out.shape != ref_fp32.shape or out.shape != ref_lowp.shape:
        raise AssertionError(
            f"{name}: shape mismatch: out {tuple(out.shape)}, ref_fp32 {tuple(ref_fp32.shape)}, "
            f"ref_lowp {tuple(ref_lowp.shape)}"
        )
    dtype = ref_lowp.dtype if dtype is None else dtype
    dev = out.device
    o = out.detach().float()
    ref = ref_fp32.detach().to(device=dev, dtype=torch.float32)
    low = ref_lowp.detach().to(device=dev, dtype=torch.float32)
    sel = torch.ones(o.shape, dtype=torch.bool, device=dev) if mask is None else _expand_mask(mask, o.shape, dev)

    tol = tolerance(ref[sel], low[sel], dtype=dtype, factor=factor)

    ref_finite = torch.isfinite(ref)
    bad_nonfinite = sel & ref_finite & ~torch.isfinite(o)
    if bool(bad_nonfinite.any()):
        idx = _first_index(bad_nonfinite)
        raise AssertionError(
            f"{name}: {int(bad_nonfinite.sum())} non-finite value(s) where the reference is finite; "
            f"first at index {idx}: out={o[idx].item()}, ref={ref[idx].item()}"
        )
    # Non-finite reference entries (lse of fully masked rows) must be matched exactly.
    special = sel & ~ref_finite
    mismatch = special & ~((o == ref) | (torch.isnan(o) & torch.isnan(ref)))
    if bool(mismatch.any()):
        idx = _first_index(mismatch)
        raise AssertionError(
            f"{name}: {int(mismatch.sum())} value(s) differ where the reference is not finite; "
            f"first at index {idx}: out={o[idx].item()}, ref={ref[idx].item()}"
        )

    err = torch.where(sel & ref_finite, (o - ref).abs(), torch.zeros_like(o))
    if err.numel() == 0:
        return
    max_err = float(err.max())
    if max_err > tol:
        idx = _first_index(err == max_err)
        lowp_err = float(torch.where(sel & ref_finite, (low - ref).abs(), torch.zeros_like(low)).max())
        raise AssertionError(
            f"{name}: max |out - ref_fp32| = {max_err:.6g} exceeds tolerance {tol:.6g} "
            f"(factor {factor} * lowp err {lowp_err:.6g} + floor for {dtype}); worst at index {idx}: "
            f"out={o[idx].item():.6g}, ref_fp32={ref[idx].item():.6g}, ref_lowp={low[idx].item():.6g}; "
            f"{int((err > tol).sum())} of {int(sel.sum())} compared elements out of tolerance"
        )


def poison_like(t: Tensor) -> Tensor:
    """A NaN-filled tensor like t, so that any element a kernel fails to write is caught."""
    if not t.is_floating_point():
        raise TypeError(f"poison_like needs a floating-point tensor, got {t.dtype}")
    return torch.full_like(t, math.nan)


def random_qkv(
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    nheads_k: int,
    d: int,
    dv: Optional[int] = None,
    dtype: torch.dtype = torch.bfloat16,
    device: Union[torch.device, str] = "cpu",
    seed: Optional[int] = None,
    requires_grad: bool = False,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Random N(0, 1) q (batch, seqlen_q, nheads, d), k (batch, seqlen_k, nheads_k, d),
    v (batch, seqlen_k, nheads_k, dv or d).

    Values are drawn in float32 on the CPU from a generator seeded with `seed` and then cast and moved,
    so a seed gives the same inputs on every device.
    """
    if nheads_k <= 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be a positive multiple of nheads_k ({nheads_k})")
    dv = d if dv is None else dv
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)

    def make(*shape):
        x = torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
        return x.requires_grad_(requires_grad)

    return (make(batch, seqlen_q, nheads, d), make(batch, seqlen_k, nheads_k, d), make(batch, seqlen_k, nheads_k, dv))


def generate_cu_seqlens(lengths: Sequence[int], device: Union[torch.device, str] = "cpu") -> Tensor:
    """int32 prefix sums of `lengths` with a leading 0: [0, l0, l0 + l1, ...] (length len(lengths) + 1)."""
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"sequence lengths must be non-negative, got {lengths}")
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    if cu[-1] > torch.iinfo(torch.int32).max:
        raise ValueError(f"total length {cu[-1]} does not fit in int32")
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _max_or_zero(x: Tensor) -> float:
    return float(x.max()) if x.numel() > 0 else 0.0


def _expand_mask(mask: Tensor, shape: torch.Size, device) -> Tensor:
    m = mask.to(device=device, dtype=torch.bool)
    if m.dim() < len(shape) and tuple(m.shape) == tuple(shape[: m.dim()]):
        m = m.reshape(*m.shape, *([1] * (len(shape) - m.dim())))
    try:
        return m.expand(shape)
    except RuntimeError:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not fit output shape {tuple(shape)}") from None


def _first_index(flags: Tensor) -> Tuple[int, ...]:
    return tuple(int(i) for i in torch.nonzero(flags)[0].tolist())
