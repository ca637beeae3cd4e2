"""Tests for flashtile.testing: the tolerance rule, poisoning, and the input generators."""

import math

import pytest
import torch

from flashtile.testing import check_close, eps, generate_cu_seqlens, poison_like, random_qkv, tolerance


def _refs(seed=0, shape=(2, 5, 3, 8)):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(*shape, generator=g)
    low = ref.bfloat16()  # the low-precision result differs from the reference by rounding only
    return ref, low


def test_eps_values():
    assert eps(torch.bfloat16) == 0.0078125
    assert eps(torch.float16) == 2.0**-10
    assert eps(torch.float32) == 2.0**-23
    if hasattr(torch, "float8_e4m3fn"):
        assert eps(torch.float8_e4m3fn) == 0.125
    with pytest.raises(TypeError):
        eps(torch.int32)


def test_tolerance_formula():
    ref = torch.tensor([0.5, -3.0, 1.0])
    low = torch.tensor([0.5, -3.0, 1.01])
    # 2 * max lowp error + 2 * eps(bf16) * max|ref|
    assert tolerance(ref, low, dtype=torch.bfloat16) == pytest.approx(2 * 0.01 + 2 * 2.0**-7 * 3.0, rel=1e-5)
    # The floor never drops below 2 * eps, however small the reference.
    tiny = torch.full((4,), 1e-3)
    assert tolerance(tiny, tiny, dtype=torch.float16) == pytest.approx(2 * 2.0**-10)
    assert tolerance(ref, low, dtype=torch.bfloat16, factor=3.0) == pytest.approx(3 * 0.01 + 2 * 2.0**-7 * 3.0, rel=1e-4)


def test_passes_on_exact_and_on_lowp():
    ref, low = _refs()
    check_close("exact", ref.clone(), ref, low)
    check_close("lowp", low, ref, low)
    check_close("fp64 ref", ref.bfloat16(), ref.double(), low)


def test_fails_on_perturbed_element():
    ref, low = _refs()
    tol = tolerance(ref, low, dtype=torch.bfloat16)
    out = ref.clone()
    out[1, 2, 0, 5] += 1.5 * tol
    with pytest.raises(AssertionError, match=r"perturbed.*exceeds tolerance.*\(1, 2, 0, 5\)"):
        check_close("perturbed", out, ref, low)
    out[1, 2, 0, 5] = ref[1, 2, 0, 5] + 0.5 * tol
    check_close("within", out, ref, low)


def test_floor_applies_when_lowp_is_exact():
    ref = torch.tensor([0.0, 0.25, -0.5])
    floor = 2 * 2.0**-7
    check_close("floor ok", ref + 0.9 * floor, ref, ref.bfloat16())
    with pytest.raises(AssertionError, match="exceeds tolerance"):
        check_close("floor bad", ref + 1.1 * floor, ref, ref.bfloat16())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_fails_on_nonfinite(bad):
    ref, low = _refs()
    out = ref.clone()
    out[0, 0, 1, 3] = bad
    with pytest.raises(AssertionError, match=r"non-finite.*\(0, 0, 1, 3\)"):
        check_close("nan", out, ref, low)


def test_poisoned_output_fails():
    ref, low = _refs()
    with pytest.raises(AssertionError):
        check_close("unwritten", poison_like(low), ref, low)


def test_mask_restricts_comparison():
    ref, low = _refs()
    out = ref.clone()
    out[1, 4] = math.nan  # e.g. a padding row the kernel leaves unwritten
    out[0, 1, 2, 0] += 10.0
    elem_mask = torch.ones_like(ref, dtype=torch.bool)
    elem_mask[1, 4] = False
    elem_mask[0, 1, 2, 0] = False
    check_close("element mask", out, ref, low, mask=elem_mask)
    # A (batch, seqlen) row mask covers the leading dims.
    out[0, 1, 2, 0] = ref[0, 1, 2, 0]
    row_mask = torch.ones(2, 5, dtype=torch.bool)
    row_mask[1, 4] = False
    check_close("row mask", out, ref, low, mask=row_mask)
    row_mask[1, 4] = True
    with pytest.raises(AssertionError):
        check_close("row mask", out, ref, low, mask=row_mask)
    with pytest.raises(ValueError, match="mask"):
        check_close("bad mask", out, ref, low, mask=torch.ones(3, dtype=torch.bool))


def test_nonfinite_reference_must_match():
    ref = torch.tensor([[1.0, -math.inf], [0.5, 2.0]])
    low = ref.clone()
    check_close("lse", ref.clone(), ref, low, dtype=torch.bfloat16)
    for wrong in (math.inf, 0.0, math.nan):
        out = ref.clone()
        out[0, 1] = wrong
        with pytest.raises(AssertionError, match=r"not finite.*\(0, 1\)"):
            check_close("lse", out, ref, low, dtype=torch.bfloat16)


def test_shape_mismatch_fails():
    ref, low = _refs()
    with pytest.raises(AssertionError, match="shape"):
        check_close("shape", ref[:, :4], ref, low)


def test_explicit_dtype_sets_floor():
    ref = torch.zeros(4)
    out = ref + 0.2  # inside the float8_e4m3 floor (0.25), far outside bf16's
    with pytest.raises(AssertionError):
        check_close("bf16 floor", out, ref, ref.bfloat16())
    if hasattr(torch, "float8_e4m3fn"):
        check_close("fp8 floor", out, ref, ref.bfloat16(), dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_poison_like(dtype):
    t = torch.randn(3, 4, 5).to(dtype)
    p = poison_like(t)
    assert p.shape == t.shape and p.dtype == dtype and p.device == t.device
    assert torch.isnan(p).all()
    with pytest.raises(TypeError):
        poison_like(torch.zeros(3, dtype=torch.int32))


def test_random_qkv():
    q, k, v = random_qkv(2, 7, 13, 8, 2, 64, dtype=torch.bfloat16, seed=1)
    assert q.shape == (2, 7, 8, 64) and k.shape == (2, 13, 2, 64) and v.shape == (2, 13, 2, 64)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    for t in (q, k, v):
        assert (t != 0).float().mean() > 0.99 and torch.isfinite(t).all()
        assert 0.8 < t.float().std().item() < 1.2
    q2, k2, v2 = random_qkv(2, 7, 13, 8, 2, 64, dtype=torch.bfloat16, seed=1)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
    q3, _, _ = random_qkv(2, 7, 13, 8, 2, 64, dtype=torch.bfloat16, seed=2)
    assert not torch.equal(q, q3)
    _, _, vd = random_qkv(1, 3, 5, 4, 4, 192, dv=128, dtype=torch.float16)
    assert vd.shape == (1, 5, 4, 128) and vd.dtype == torch.float16
    qg, _, _ = random_qkv(1, 2, 2, 2, 1, 8, dtype=torch.float32, requires_grad=True)
    assert qg.requires_grad and qg.is_leaf
    with pytest.raises(ValueError, match="nheads_k"):
        random_qkv(1, 2, 2, 3, 2, 8)


def test_generate_cu_seqlens():
    cu = generate_cu_seqlens([3, 0, 5, 1])
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 8, 9]
    assert generate_cu_seqlens([]).tolist() == [0]
    assert generate_cu_seqlens([7], device="cpu").device.type == "cpu"
    with pytest.raises(ValueError, match="non-negative"):
        generate_cu_seqlens([2, -1])
