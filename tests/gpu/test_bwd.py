"""Backward-pass accuracy on the GPU against the float32 reference, with FlashAttention-3's tolerance rule.

For every gradient g of dq, dk, dv (DESIGN.md §5):

    max|g - g_ref_fp32| <= 2 * max|g_lowp - g_ref_fp32| + floor       (flashtile.testing.check_close)

where g_ref_fp32 is autograd through attention_ref in float32 (upcast=True) and g_lowp autograd through
the same math done naively in the input dtype (upcast=False), both with the same random N(0, 1)
upstream gradient dout (and dlse where the loss uses the LSE). Inputs are fresh N(0, 1) tensors seeded
per test; the backward's outputs and workspaces are poisoned through the allocator (poison_allocator)
so that anything the kernels fail to write or clear is NaN and fails the check.

Covered: every built dtype and head dim, MHA/GQA/MQA, causal, local windows, softcap, odd and unequal
sequence lengths (one 4224^2 case per mask), batch 1..9, fully masked rows (their dq is exactly 0),
varlen with empty sequences and rows outside every sequence (checked per sequence against the padded
reference), head dims inside a bucket, seqused_q/k and KV caches, strided and qkv-packed inputs, the LSE's own gradient (dlse),
the band masks' longest-first launch order over (head, batch) sections,
empty problems, each kernel family forced (path="ampere" / "hopper"), a missing backward, deterministic
mode (bitwise identical repeats), the dq postprocess started per head against the serial one, CUDA-graph capture, a finite-difference check against float64, and a
short training run tracking PyTorch SDPA.
"""
import math
import os
import sys
import zlib
from typing import List, NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flashtile import (KernelNotBuiltError, flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                       flash_attn_with_kvcache)
from flashtile.build_config import find_kernels
from flashtile.reference import attention_ref
from flashtile.testing import check_close, generate_cu_seqlens, random_qkv, tolerance

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_fwd import DTYPES, HDIM_IDS, HEAD_DIMS, INNER_HEAD_DIMS, poison_allocator  # noqa: E402  (shared GPU-test helpers)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

SLOW = bool(os.environ.get("FLASHTILE_SLOW_TESTS"))  # opt-in long variants (e.g. 1000 determinism repeats)


def require_built(dtype_name, d, dv, *, band=False, softcap=False, path="auto"):
    """Skip unless both the forward and the backward kernel of this configuration were built."""
    for op in ("fwd", "bwd"):
        if not find_kernels(op=op, dtype=dtype_name, head_dim=d, head_dim_v=dv, band=band, softcap=softcap,
                            path=path):
            pytest.skip(f"not built: {op} {dtype_name} hdim {d}x{dv} band={band} softcap={softcap} path={path}")


@pytest.fixture
def seed(request):
    """A different, reproducible seed for every test (and parameter set)."""
    return zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF


def randn_like(t, seed, dtype=None):
    """N(0, 1) shaped like t, drawn in float32 on the CPU from `seed` (the same on every device)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t.shape, generator=g).to(device=t.device, dtype=dtype or t.dtype)


def _bwd_bytes(leaves, out, lse):
    """Bytes the backward allocates: gradients, dout/dlse copies, the fp32 dq accumulator and LSE rows."""
    return (sum(t.numel() * t.element_size() for t in leaves) + out.numel() * (out.element_size() + 4)
            + 4 * lse.numel() * 4)


# ---- the check ---------------------------------------------------------------------------------------

def _ref_grads(ref, leaves, dout, dlse, upcast):
    """d/d(leaves) of <out, dout> (+ <lse, dlse>) through ref(*leaves, upcast=upcast) -> (out, lse)."""
    xs = [(t.detach().float() if upcast else t.detach().clone()).requires_grad_(True) for t in leaves]
    out, lse = ref(*xs, upcast=upcast)
    outs, gouts = [out], [dout.to(out.dtype)]
    if dlse is not None:
        outs.append(lse)
        gouts.append(dlse.to(lse.dtype))
    grads = torch.autograd.grad(outs, xs, gouts, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, xs)]


class Checked(NamedTuple):
    grads: List[torch.Tensor]  # the kernel's, one per leaf
    ref: List[torch.Tensor]    # float32 reference
    low: List[torch.Tensor]    # low-precision reference
    dout: torch.Tensor


def check_bwd(name, leaves, kernel, ref, *, seed, with_lse=False, names="qkv"):
    """Differentiates kernel(*leaves) -> (out, lse) (flashtile) on poisoned memory and checks each
    leaf's gradient against ref(*leaves, upcast=...) -> (out, lse) (attention_ref) with the tolerance
    rule. The loss is <out, dout>, plus <lse, dlse> with with_lse."""
    xs = [t.detach().clone().requires_grad_(True) for t in leaves]
    out, lse = kernel(*xs)
    dout = randn_like(out, seed + 1)
    dlse = randn_like(lse, seed + 2) if with_lse else None
    poison_allocator(_bwd_bytes(leaves, out, lse))
    if with_lse:
        grads = torch.autograd.grad((out, lse), xs, (dout, dlse))
    else:
        grads = torch.autograd.grad(out, xs, dout)
    for g, x in zip(grads, xs):
        assert g.shape == x.shape and g.dtype == x.dtype and g.device == x.device
    ref_fp32 = _ref_grads(ref, leaves, dout, dlse, upcast=True)
    ref_lowp = _ref_grads(ref, leaves, dout, dlse, upcast=False)
    for n, g, r, low in zip(names, grads, ref_fp32, ref_lowp):
        check_close(f"{name} d{n}", g, r, low)
    return Checked(list(grads), ref_fp32, ref_lowp, dout)


def check_padded(q, k, v, *, seed, name="grad", with_lse=False, path="auto", deterministic=False, **kw):
    """flash_attn_func's gradients w.r.t. q, k, v (padded layout) against attention_ref's."""
    def kernel(q, k, v):
        return flash_attn_func(q, k, v, return_attn_probs=True, path=path, deterministic=deterministic, **kw)

    return check_bwd(name, (q, k, v), kernel, padded_ref(**kw), seed=seed, with_lse=with_lse)


def padded_ref(**kw):
    def ref(q, k, v, upcast):
        return attention_ref(q, k, v, upcast=upcast, return_lse=True, **kw)
    return ref


def assert_matters(name, checked, other_grads):
    """other_grads (dq of the reference for a modified problem) lies outside twice the tolerance around
    the checked reference: a kernel that computed the modified problem instead would have failed."""
    tol = tolerance(checked.ref[0], checked.low[0], dtype=checked.low[0].dtype)
    diff = float((other_grads[0] - checked.ref[0]).abs().max())
    assert diff > 2 * tol, f"{name}: the check cannot tell the two apart (difference {diff:.3g}, tolerance {tol:.3g})"


# ---- the main sweep ----------------------------------------------------------------------------------

SEQLENS = [(1, 1), (113, 203), (239, 1), (799, 3), (1023, 1024)]
LAYOUTS = {"mha-b2": (2, 4, 4), "gqa-b1": (1, 6, 2), "mqa-b3": (3, 4, 1)}  # batch, nheads, nheads_k


@pytest.mark.parametrize("seqlens", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bwd(dtype, hdim, causal, layout, seqlens, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=causal)
    b, h, hk = LAYOUTS[layout]
    sq, sk = seqlens
    q, k, v = random_qkv(b, sq, sk, h, hk, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    dq = check_padded(q, k, v, seed=seed, causal=causal).grads[0]
    if causal and sq > sk:
        # Bottom-right aligned: the first sq - sk query rows see no key; their gradient is exactly 0.
        assert torch.all(dq[:, : sq - sk] == 0)


# Every built head dim, and head dims inside a bucket (e.g. 120 and 104 run on the 128 kernels).
PATH_HEAD_DIMS = HEAD_DIMS + [hd for hd in INNER_HEAD_DIMS if hd not in HEAD_DIMS]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", PATH_HEAD_DIMS, ids=[f"d{a}" if a == b else f"d{a}x{b}" for a, b in PATH_HEAD_DIMS])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("path", ["ampere", "hopper"])
def test_bwd_explicit_path(path, dtype, hdim, causal, seed):
    """Each kernel family forced: its forward feeds its backward (on sm_90 "auto" picks the Hopper
    kernels where built, so the Ampere-path backward is only reached this way). Head dims inside a
    bucket also check that the dq accumulator's bucket columns past the head dim leave the real
    columns exact."""
    if path == "hopper" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper path needs an sm_90 GPU")
    d, dv = hdim
    require_built(dtype, d, dv, band=causal, path=path)
    q, k, v = random_qkv(2, 239, 1023, 6, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    check_padded(q, k, v, seed=seed, causal=causal, path=path)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bwd_long_sequence(causal, seed):
    """One 4224 x 4224 case per mask (the float32 reference backward is the slow part)."""
    d, dv = (128, 128) if (128, 128) in HEAD_DIMS else HEAD_DIMS[0]
    name = "bf16" if find_kernels(op="bwd", dtype="bf16", head_dim=d, head_dim_v=dv, band=causal, softcap=False) \
        else "fp16"
    require_built(name, d, dv, band=causal)
    q, k, v = random_qkv(1, 4224, 4224, 2, 1, d, dv, dtype=DTYPES[name], device="cuda", seed=seed)
    check_padded(q, k, v, seed=seed, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bwd_batch9(dtype, hdim, causal, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=causal)
    q, k, v = random_qkv(9, 65, 129, 2, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    check_padded(q, k, v, seed=seed, causal=causal)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (700, 300))], ids=["causal", "w700_300"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bwd_band_sections(dtype, hdim, causal, window, seed):
    """Band masks at >= 2048 keys (Ampere path: 512) launch the KV-block CTAs longest first over
    sections of (head, batch) pairs (common/block_order.h): 5 pairs make sections of 4 + 1 or
    2 + 2 + 1 (d 64 / 128), and the 2100 keys a ragged last KV block. A KV block that no CTA takes
    leaves its dK / dV poisoned."""
    d, dv = hdim
    require_built(dtype, d, dv, band=True)
    q, k, v = random_qkv(5, 2100, 2100, 2, 1, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    check_padded(q, k, v, seed=seed, causal=causal, window_size=window)


WINDOWS = [((64, 0), False), ((32, 17), False), ((0, 0), False), ((64, -1), True)]


@pytest.mark.parametrize("seqlens", [(113, 203), (300, 129)], ids=["113x203", "300x129"])
@pytest.mark.parametrize("window, causal", WINDOWS, ids=[f"w{w[0]}_{w[1]}{'-causal' if c else ''}" for w, c in WINDOWS])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bwd_local_window(dtype, hdim, window, causal, seqlens, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=True)
    sq, sk = seqlens
    q, k, v = random_qkv(2, sq, sk, 6, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    check_padded(q, k, v, seed=seed, causal=causal, window_size=window)


SOFTCAPS = [(30.0, None), (3.0, 0.5)]  # (softcap, softmax_scale)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("softcap, scale", SOFTCAPS, ids=[f"cap{c:g}-scale{s}" for c, s in SOFTCAPS])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bwd_softcap(dtype, hdim, softcap, scale, causal, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=causal, softcap=True)
    q, k, v = random_qkv(2, 113, 203, 6, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    checked = check_padded(q, k, v, seed=seed, causal=causal, softcap=softcap, softmax_scale=scale)
    if softcap < 10:
        # A cap of 3 on these scores changes the gradients far beyond the tolerance, so a backward that
        # ignores the cap (its tanh' factor) fails.
        uncapped = _ref_grads(padded_ref(causal=causal, softmax_scale=scale), (q, k, v), checked.dout, None,
                              upcast=True)
        assert_matters("softcap", checked, uncapped)


MASKED = [  # (sq, sk, causal, window): the first sq - sk rows see no key
    (300, 100, True, (-1, -1)),
    (200, 64, False, (5, 0)),
]


@pytest.mark.parametrize("sq, sk, causal, window", MASKED,
                         ids=[f"{m[0]}x{m[1]}-" + ("causal" if m[2] else "w%d_%d" % m[3]) for m in MASKED])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bwd_fully_masked_rows(dtype, hdim, sq, sk, causal, window, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=True)
    q, k, v = random_qkv(2, sq, sk, 4, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    # The LSE is used by the loss too: the kernel must ignore dlse on rows that see no key.
    dq = check_padded(q, k, v, seed=seed, causal=causal, window_size=window, with_lse=True).grads[0]
    assert torch.all(dq[:, : sq - sk] == 0)
    assert dq[:, sq - sk:].abs().amax() > 0


# ---- the LSE's own gradient --------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["mha-full", "gqa-causal"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bwd_with_lse_gradient(dtype, hdim, case, seed):
    """loss = <out, dout> + <lse, dlse> (return_attn_probs=True): dlse enters as D = rowsum(dout*out) - dlse."""
    d, dv = hdim
    causal = case == "gqa-causal"
    require_built(dtype, d, dv, band=causal)
    h, hk = (4, 4) if case == "mha-full" else (6, 2)
    q, k, v = random_qkv(2, 239, 203, h, hk, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    checked = check_padded(q, k, v, seed=seed, causal=causal, with_lse=True)
    # The LSE term matters: a backward that drops dlse fails.
    without = _ref_grads(padded_ref(causal=causal), (q, k, v), checked.dout, None, upcast=True)
    assert_matters("dlse", checked, without)


# ---- varlen, seqused, KV cache -----------------------------------------------------------------------

VARLEN = {
    "mixed": ([0, 17, 1, 113, 0, 239, 64, 5], [5, 17, 0, 203, 0, 1, 64, 300]),
    "long": ([1023, 1, 300], [1024, 4096, 129]),
}
GAP_Q, GAP_K = 3, 5  # packed rows after the last sequence, in no sequence


def _per_sequence_ref(lens_q, lens_k, **kw):
    """attention_ref on each sequence separately (padded layout, batch 1), concatenated to the packed
    layout; rows outside every sequence give 0 (and no gradient)."""
    def ref(q, k, v, upcast):
        outs, lses = [], []
        oq = ok = 0
        for lq, lk in zip(lens_q, lens_k):
            o, l = attention_ref(q[None, oq:oq + lq], k[None, ok:ok + lk], v[None, ok:ok + lk], upcast=upcast,
                                 return_lse=True, **kw)
            outs.append(o[0])
            lses.append(l[0])
            oq, ok = oq + lq, ok + lk
        gap = q.shape[0] - oq
        outs.append(torch.zeros(gap, *outs[0].shape[1:], dtype=outs[0].dtype, device=q.device))
        lses.append(torch.full((lses[0].shape[0], gap), -math.inf, dtype=lses[0].dtype, device=q.device))
        return torch.cat(outs), torch.cat(lses, dim=1)
    return ref


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("case", list(VARLEN))
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bwd_varlen(dtype, hdim, case, heads, causal, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=causal)
    lens_q, lens_k = VARLEN[case]
    h, hk = heads
    q, k, v = random_qkv(1, sum(lens_q) + GAP_Q, sum(lens_k) + GAP_K, h, hk, d, dv, dtype=DTYPES[dtype],
                         device="cuda", seed=seed)
    q, k, v = q[0], k[0], v[0]
    cu_q, cu_k = generate_cu_seqlens(lens_q, "cuda"), generate_cu_seqlens(lens_k, "cuda")

    def kernel(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                      return_attn_probs=True)

    dq, dk, dv_ = check_bwd("varlen", (q, k, v), kernel, _per_sequence_ref(lens_q, lens_k, causal=causal),
                            seed=seed).grads
    assert torch.all(dq[sum(lens_q):] == 0) and torch.all(dk[sum(lens_k):] == 0) and torch.all(dv_[sum(lens_k):] == 0)


@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bwd_varlen_window_and_loose_max_seqlen(dtype, hdim, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=True)
    lens_q, lens_k = [3, 130, 0, 77], [200, 5, 9, 77]
    q, k, v = random_qkv(1, sum(lens_q), sum(lens_k), 6, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    cu_q, cu_k = generate_cu_seqlens(lens_q, "cuda"), generate_cu_seqlens(lens_k, "cuda")

    def kernel(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 400, 333, window_size=(32, 17), return_attn_probs=True)

    check_bwd("varlen window", (q[0], k[0], v[0]), kernel,
              _per_sequence_ref(lens_q, lens_k, window_size=(32, 17)), seed=seed, with_lse=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bwd_seqused(dtype, hdim, causal, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=causal)
    lens_q, lens_k = [17, 30, 17, 129], [64, 200, 17, 300]
    used_q = torch.tensor([5, 0, 17, 128], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([10, 200, 0, 257], dtype=torch.int32, device="cuda")
    q, k, v = random_qkv(1, sum(lens_q), sum(lens_k), 6, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    cu_q, cu_k = generate_cu_seqlens(lens_q, "cuda"), generate_cu_seqlens(lens_k, "cuda")
    kw = dict(seqused_q=used_q, seqused_k=used_k, causal=causal)

    def kernel(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_attn_probs=True, **kw)

    def ref(q, k, v, upcast):
        return attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, upcast=upcast, return_lse=True, **kw)

    dq, dk, dv_ = check_bwd("seqused", (q[0], k[0], v[0]), kernel, ref, seed=seed).grads
    # Query rows past seqused_q and keys past seqused_k get exactly 0.
    assert torch.all(dq[5:17] == 0) and torch.all(dq[17:47] == 0)
    assert torch.all(dk[10:64] == 0) and torch.all(dv_[264:281] == 0) and torch.all(dk[281 + 257:] == 0)


@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bwd_kvcache(dtype, hdim, seed):
    """flash_attn_with_kvcache is differentiable too (padded cache, seqused_k from cache_seqlens)."""
    d, dv = hdim
    require_built(dtype, d, dv, band=True)
    q, k_cache, v_cache = random_qkv(3, 17, 300, 8, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    lens = torch.tensor([0, 300, 77], dtype=torch.int32, device="cuda")

    def kernel(q, k, v):
        return flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True, return_softmax_lse=True)

    def ref(q, k, v, upcast):
        return attention_ref(q, k, v, seqused_k=lens, causal=True, upcast=upcast, return_lse=True)

    dq, dk, dv_ = check_bwd("kvcache", (q, k_cache, v_cache), kernel, ref, seed=seed).grads
    assert torch.all(dq[0] == 0) and torch.all(dk[0] == 0) and torch.all(dk[2, 77:] == 0) and torch.all(dv_[2, 77:] == 0)


# ---- layouts -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["seq-major", "head-major", "sliced-head-dim"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
def test_bwd_strided_inputs(hdim, kind, seed):
    """q/k/v as strided views of larger tensors: the gradients reach the underlying storage."""
    d, dv = hdim
    dtype = "bf16" if find_kernels(op="bwd", dtype="bf16", head_dim=d, head_dim_v=dv, band=True, softcap=False) \
        else "fp16"
    require_built(dtype, d, dv, band=True)
    b, sq, sk, h, hk = 3, 239, 300, 6, 2
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device="cuda", dtype=DTYPES[dtype])

    if kind == "seq-major":
        bases = (rand(sq, b, h, d), rand(sk, b, hk, d), rand(sk, b, hk, dv))

        def views(q, k, v):
            return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    elif kind == "head-major":
        bases = (rand(b, h, sq, d), rand(b, hk, sk, d), rand(b, hk, sk, dv))

        def views(q, k, v):
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    else:
        bases = (rand(b, sq, h, d + 64), rand(b, sk, hk, d + 8), rand(b, sk, hk, dv + 24))

        def views(q, k, v):
            return q[..., :d], k[..., :d], v[..., :dv]

    def kernel(*xs):
        return flash_attn_func(*views(*xs), causal=True, return_attn_probs=True)

    def ref(*xs, upcast):
        return attention_ref(*views(*xs), causal=True, upcast=upcast, return_lse=True)

    grads = check_bwd(f"strided {kind}", bases, kernel, ref, seed=seed).grads
    if kind == "sliced-head-dim":
        assert torch.all(grads[0][..., d:] == 0) and torch.all(grads[2][..., dv:] == 0)


@pytest.mark.parametrize("hdim", [hd for hd in HEAD_DIMS if hd[0] == hd[1]] or [(128, 128)],
                         ids=[f"d{hd[0]}" for hd in HEAD_DIMS if hd[0] == hd[1]] or ["d128"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bwd_qkvpacked(dtype, hdim, seed):
    """flash_attn_qkvpacked_func: q, k, v are strided views of one tensor; its gradient assembles theirs."""
    d, _ = hdim
    require_built(dtype, d, d, band=True)
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(2, 300, 3, 4, d, generator=g).to(device="cuda", dtype=DTYPES[dtype])

    def kernel(qkv):
        return flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)

    def ref(qkv, upcast):
        return attention_ref(*qkv.unbind(2), causal=True, upcast=upcast, return_lse=True)

    check_bwd("qkvpacked", (qkv,), kernel, ref, seed=seed, names=["qkv"])
    # GQA packing: (batch, seqlen, nheads_q + 2 * nheads_k, d).
    qkv = torch.randn(2, 129, 6 + 2 * 2, d, generator=g).to(device="cuda", dtype=DTYPES[dtype])

    def kernel_gqa(qkv):
        return flash_attn_qkvpacked_func(qkv, num_heads_q=6, return_attn_probs=True)

    def ref_gqa(qkv, upcast):
        return attention_ref(*qkv.split([6, 2, 2], dim=2), upcast=upcast, return_lse=True)

    check_bwd("qkvpacked gqa", (qkv,), kernel_gqa, ref_gqa, seed=seed + 7, names=["qkv"])


# ---- empty problems, paths ---------------------------------------------------------------------------

def _any_built(band=False):
    for name in DTYPES:
        for d, dv in HEAD_DIMS:
            if all(find_kernels(op=op, dtype=name, head_dim=d, head_dim_v=dv, band=band, softcap=False)
                   for op in ("fwd", "bwd")):
                return name, d, dv
    pytest.skip("no forward + backward kernel built")


@pytest.mark.parametrize("case", ["no-keys", "no-queries"])
def test_bwd_empty_sequences(case):
    name, d, dv = _any_built()
    sq, sk = (17, 0) if case == "no-keys" else (0, 17)
    q, k, v = random_qkv(2, sq, sk, 4, 2, d, dv, dtype=DTYPES[name], device="cuda", seed=3, requires_grad=True)
    out = flash_attn_func(q, k, v)
    dq, dk, dv_ = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert dq.shape == q.shape and dk.shape == k.shape and dv_.shape == v.shape
    assert torch.all(dq == 0) and torch.all(dk == 0) and torch.all(dv_ == 0)


def test_bwd_hopper_path_without_hopper_backward():
    """path="hopper" forces the Hopper kernels; with no Hopper backward built, backward says so."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper path needs an sm_90 GPU")
    for name in DTYPES:
        for d, dv in HEAD_DIMS:
            fwd_ok = find_kernels(op="fwd", dtype=name, head_dim=d, head_dim_v=dv, band=False, softcap=False,
                                  path="hopper")
            bwd_ok = find_kernels(op="bwd", dtype=name, head_dim=d, head_dim_v=dv, band=False, softcap=False,
                                  path="hopper")
            if fwd_ok and not bwd_ok:
                break
        else:
            continue
        break
    else:
        pytest.skip("no Hopper forward without a Hopper backward in this build")
    q, k, v = random_qkv(1, 64, 64, 2, 2, d, dv, dtype=DTYPES[name], device="cuda", seed=5, requires_grad=True)
    out = flash_attn_func(q, k, v, path="hopper")
    with pytest.raises(KernelNotBuiltError, match=r"no backward kernel built for path=hopper.*This build has"):
        out.backward(torch.randn_like(out))
    # The same forward on the automatic path differentiates (through the backward that is built).
    out = flash_attn_func(q, k, v)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(q.grad).all()


def test_bwd_expanded_upstream_gradient(seed):
    """out.sum().backward() sends an expanded (stride-0) dout, which the op copies before the kernel."""
    name, d, dv = _any_built(band=True)
    q, k, v = random_qkv(2, 129, 300, 4, 2, d, dv, dtype=DTYPES[name], device="cuda", seed=seed)
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    flash_attn_func(*xs, causal=True, deterministic=True).sum().backward()
    ys = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = flash_attn_func(*ys, causal=True, deterministic=True)
    out.backward(torch.ones_like(out))
    for x, y in zip(xs, ys):
        assert torch.equal(x.grad, y.grad)


def test_repeated_calls_on_the_same_buffers(seed):
    """Calls whose metadata repeats reuse their parameter structs (python/flashtile/ops.py plans): calls
    on the same buffers with new contents (written in place) must read the new contents, and views of
    one buffer with other shapes or strides (the same base pointer) must not take another view's
    struct. Forward and backward, both masks, three rounds."""
    name, d, dv = _any_built(band=True)
    if not all(find_kernels(op=op, dtype=name, head_dim=d, head_dim_v=dv, band=False, softcap=False)
               for op in ("fwd", "bwd")):
        pytest.skip("needs the forward and backward kernels with and without a mask")
    dtype, b, s, h, hk = DTYPES[name], 2, 600, 4, 2
    q, k, v = (t.clone() for t in random_qkv(b, s, s, h, hk, d, dv, dtype=dtype, device="cuda", seed=seed))
    dout = torch.empty(b, s, h, dv, dtype=dtype, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for rnd in range(3):
        for t in (q, k, v, dout):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype))
        for causal in (True, False):
            xs = [t.detach().requires_grad_(True) for t in (q, k, v)]  # the same storage every round
            out = flash_attn_func(*xs, causal=causal)
            check_close(f"round {rnd} causal={causal} out", out, attention_ref(q, k, v, causal=causal),
                        attention_ref(q, k, v, causal=causal, upcast=False))
            grads = torch.autograd.grad(out, xs, dout)
            ref = padded_ref(causal=causal)
            refs = zip(_ref_grads(ref, (q, k, v), dout, None, True), _ref_grads(ref, (q, k, v), dout, None, False))
            for n, g, (r, low) in zip("qkv", grads, refs):
                check_close(f"round {rnd} causal={causal} d{n}", g, r, low)
        # The same storage seen with fewer rows and with every other head: other shapes and strides.
        for view_name, view in (("rows", (q[:, : s // 2], k[:, : s // 3], v[:, : s // 3])),
                                ("heads", (q[:, :, ::2], k[:, :, :1], v[:, :, :1]))):
            check_close(f"round {rnd} view {view_name}", flash_attn_func(*view, causal=True),
                        attention_ref(*view, causal=True), attention_ref(*view, causal=True, upcast=False))


# ---- determinism -------------------------------------------------------------------------------------

REPEATS = [50, pytest.param(1000, marks=pytest.mark.skipif(not SLOW, reason="FLASHTILE_SLOW_TESTS=1 runs it"))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("repeats", REPEATS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
def test_bwd_deterministic(hdim, causal, repeats, seed):
    """deterministic=True: repeated backward passes give bitwise identical dq, dk, dv (GQA: dK/dV sum
    over query heads, dq over key blocks)."""
    d, dv = hdim
    name = "bf16" if find_kernels(op="bwd", dtype="bf16", head_dim=d, head_dim_v=dv, band=causal, softcap=False) \
        else "fp16"
    require_built(name, d, dv, band=causal)
    q, k, v = random_qkv(2, 1023, 1024, 6, 2, d, dv, dtype=DTYPES[name], device="cuda", seed=seed)
    first = check_padded(q, k, v, seed=seed, causal=causal, deterministic=True).grads
    xs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = flash_attn_func(*xs, causal=causal, deterministic=True)
    dout = randn_like(out, seed + 1)
    for i in range(repeats):
        grads = torch.autograd.grad(out, xs, dout, retain_graph=True)
        for n, g, f in zip("qkv", grads, first):
            assert torch.equal(g, f), f"repeat {i}: d{n} differs"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
def test_bwd_deterministic_varlen(hdim, causal, monkeypatch, seed):
    """Packed sequences in deterministic mode: 20 repeats bitwise identical and close to the default
    mode. Without a mask the kernel walks rotated where a sequence has at most as many KV blocks as
    query blocks and plain elsewhere (here both in one call: 64 queries on 1000 keys, 1 on 700); the
    mode without rotated walks (FtBwdParams.deterministic = 2) repeats bitwise too."""
    from flashtile import ops
    d, dv = hdim
    name = "bf16" if find_kernels(op="bwd", dtype="bf16", head_dim=d, head_dim_v=dv, band=causal, softcap=False) \
        else "fp16"
    require_built(name, d, dv, band=causal)
    lens_q, lens_k = [300, 0, 1, 700, 64], [129, 5, 700, 700, 1000]
    q, k, v = random_qkv(1, sum(lens_q), sum(lens_k), 8, 2, d, dv, dtype=DTYPES[name], device="cuda", seed=seed)
    xs = [t[0].clone().requires_grad_(True) for t in (q, k, v)]
    cu_q, cu_k = generate_cu_seqlens(lens_q, "cuda"), generate_cu_seqlens(lens_k, "cuda")

    def grads(deterministic):
        out = flash_attn_varlen_func(*xs, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                     deterministic=deterministic)
        return out, torch.autograd.grad(out, xs, randn_like(out, seed + 1), retain_graph=True)

    out, first = grads(True)
    dout = randn_like(out, seed + 1)
    for i in range(20):
        again = torch.autograd.grad(out, xs, dout, retain_graph=True)
        for n, g, f in zip("qkv", again, first):
            assert torch.equal(g, f), f"repeat {i}: d{n} differs"
    for n, g, f in zip("qkv", grads(False)[1], first):
        torch.testing.assert_close(g.float(), f.float(), atol=2e-2, rtol=2e-2, msg=lambda m: f"d{n}: {m}")
    monkeypatch.setattr(ops, "_DETERMINISTIC_MODE", 2)
    plain = grads(True)[1]
    for n, g, f, r in zip("qkv", grads(True)[1], plain, first):
        assert torch.equal(g, f), f"deterministic = 2: d{n} differs between two calls"
        torch.testing.assert_close(f.float(), r.float(), atol=2e-2, rtol=2e-2, msg=lambda m: f"d{n}: {m}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
def test_bwd_dq_done_overlap(hdim, causal, monkeypatch, seed):
    """The dq postprocess of a (batch, KV head) starts once that head's main-kernel CTAs have counted
    their landed adds into dq_done, while later heads still run; with no counters passed (the C ABI's
    dq_done = NULL) it waits for the whole main kernel. On grids of several waves (GQA 4:1, padded and
    packed with empty sequences) both give bitwise the same gradients in deterministic mode, and the
    default mode matches them to accumulation-order rounding."""
    from flashtile import ops
    d, dv = hdim
    name = "bf16" if find_kernels(op="bwd", dtype="bf16", head_dim=d, head_dim_v=dv, band=causal, softcap=False) \
        else "fp16"
    require_built(name, d, dv, band=causal)
    q, k, v = random_qkv(4, 2048, 2048, 32, 8, d, dv, dtype=DTYPES[name], device="cuda", seed=seed)
    lens = [3000, 0, 1, 2047, 1900]
    cu = generate_cu_seqlens(lens, "cuda")
    packed = [t.reshape(-1, *t.shape[2:])[:sum(lens)] for t in (q, k, v)]

    def grads(deterministic, varlen):
        xs = [t.detach().clone().requires_grad_(True) for t in (packed if varlen else (q, k, v))]
        if varlen:
            out = flash_attn_varlen_func(*xs, cu, cu, max(lens), max(lens), causal=causal, deterministic=deterministic)
        else:
            out = flash_attn_func(*xs, causal=causal, deterministic=deterministic)
        return torch.autograd.grad(out, xs, randn_like(out, seed + 1))

    for varlen in (False, True):
        counted = grads(True, varlen)
        monkeypatch.setattr(ops, "_COUNT_DQ_DONE", False)
        after_main = grads(True, varlen)
        monkeypatch.setattr(ops, "_COUNT_DQ_DONE", True)
        for n, g, f in zip("qkv", counted, after_main):
            assert torch.equal(g, f), f"varlen={varlen}: d{n} with dq_done counted differs from the serial postprocess"
        for n, g, f in zip("qkv", grads(False, varlen), counted):
            torch.testing.assert_close(g.float(), f.float(), atol=2e-2, rtol=2e-2, msg=lambda m: f"d{n}: {m}")


# ---- CUDA graphs -------------------------------------------------------------------------------------

def test_bwd_cuda_graph_capture_and_replay(seed):
    """Forward + backward captured in one CUDA graph (workspaces come from torch's allocator, the
    kernels run on the capturing stream) and replayed on new inputs: bitwise the eager results."""
    name, d, dv = _any_built(band=True)
    shape = (2, 300, 451, 6, 2, d, dv)
    static = [t.clone().requires_grad_(True) for t in random_qkv(*shape, dtype=DTYPES[name], device="cuda", seed=seed)]
    static_dout = torch.randn(2, 300, 6, dv, device="cuda").to(DTYPES[name])

    def step():
        out = flash_attn_func(*static, causal=True, deterministic=True)
        return torch.autograd.grad(out, static, static_dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_grads = step()

    for i in range(2):
        new = random_qkv(*shape, dtype=DTYPES[name], device="cuda", seed=seed + 1 + i)
        with torch.no_grad():
            for dst, src in zip(static, new):
                dst.copy_(src)
            static_dout.normal_()
        graph.replay()
        torch.cuda.synchronize()
        xs = [t.clone().requires_grad_(True) for t in new]
        eager = torch.autograd.grad(flash_attn_func(*xs, causal=True, deterministic=True), xs, static_dout)
        for n, g, e in zip("qkv", g_grads, eager):
            assert torch.equal(g, e), f"replay {i}: d{n} differs from eager"


# ---- finite differences against float64 --------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bwd_finite_difference(causal, seed):
    """The kernel's gradient at bf16 inputs against central differences of the float64 reference loss
    L = <attention(q, k, v), dout> at the very same (bf16-valued) inputs.

    Along the kernel's own gradient direction u = g/|g| the difference quotient is <g_true, u>, so the
    relative error |<g_true, u> - |g|| / |g| is at most |g - g_true| / |g|: the normwise error of a
    bf16 gradient, whose elements carry ~2**-8 relative rounding (and P, dS are rounded to bf16 inside
    the kernel). 2e-2 leaves a margin of a few times that. Random unit directions u give <g_true, u>
    of size ~|g| / sqrt(n); their error <g - g_true, u> ~ |g - g_true| / sqrt(n), checked at
    4 sigma of the same 2e-2 normwise bound.
    """
    d, dv = min(HEAD_DIMS)
    name = "bf16" if find_kernels(op="bwd", dtype="bf16", head_dim=d, head_dim_v=dv, band=causal, softcap=False) \
        else "fp16"
    require_built(name, d, dv, band=causal)
    q, k, v = random_qkv(1, 5, 5, 2, 1, d, dv, dtype=DTYPES[name], device="cuda", seed=seed, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=causal)
    dout = randn_like(out, seed + 1)
    grads = [g.double() for g in torch.autograd.grad(out, (q, k, v), dout)]

    x0 = [t.detach().double() for t in (q, k, v)]
    dout64 = dout.double()

    def loss(xs):
        return float((attention_ref(*xs, causal=causal, compute_dtype=torch.float64) * dout64).sum())

    def directional(dirs, eps=1e-4):
        plus = loss([x + eps * u for x, u in zip(x0, dirs)])
        minus = loss([x - eps * u for x, u in zip(x0, dirs)])
        return (plus - minus) / (2 * eps)

    def unit(dirs, label="direction"):
        norm = math.sqrt(sum(float((u * u).sum()) for u in dirs))
        assert norm > 0 and math.isfinite(norm), f"{label}: the kernel's gradient is {norm}"
        return [u / norm for u in dirs]

    g_norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    assert g_norm > 0
    # Along the gradient, all of it and one tensor at a time.
    for label, dirs in [("qkv", grads)] + [(n, [g if i == j else torch.zeros_like(g) for j, g in enumerate(grads)])
                                           for i, n in enumerate("qkv")]:
        u = unit(dirs, f"d{label}")
        fd = directional(u)
        kd = sum(float((g * w).sum()) for g, w in zip(grads, u))
        assert abs(fd - kd) <= 2e-2 * abs(kd), f"d{label}: finite difference {fd:.6g}, kernel {kd:.6g}"
    # Random directions.
    n = sum(g.numel() for g in grads)
    gen = torch.Generator().manual_seed(seed + 3)
    for i in range(4):
        u = unit([torch.randn(g.shape, generator=gen, dtype=torch.float64).to(g.device) for g in grads])
        fd = directional(u)
        kd = sum(float((g * w).sum()) for g, w in zip(grads, u))
        assert abs(fd - kd) <= 4 * 2e-2 * g_norm / math.sqrt(n), (
            f"random direction {i}: finite difference {fd:.6g}, kernel {kd:.6g}, |g| {g_norm:.4g}")


# ---- training ----------------------------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, d_model, n_heads, head_dim, attn):
        super().__init__()
        self.n_heads, self.head_dim, self.attn = n_heads, head_dim, attn
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * n_heads * head_dim)
        self.proj = nn.Linear(n_heads * head_dim, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        b, s, _ = x.shape
        # q, k, v: strided (b, s, h, d) views of the fused projection.
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.n_heads, self.head_dim).unbind(2)
        x = x + self.proj(self.attn(q, k, v).reshape(b, s, -1))
        return x + self.mlp(self.ln2(x))


class _TinyLM(nn.Module):
    def __init__(self, vocab, seqlen, n_heads, head_dim, n_layers, attn):
        super().__init__()
        d_model = n_heads * head_dim
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seqlen, d_model) * 0.02)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, head_dim, attn) for _ in range(n_layers))
        self.ln, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def _flashtile_attn(q, k, v):
    return flash_attn_func(q, k, v, causal=True)


def _sdpa_attn(q, k, v):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


@pytest.mark.timeout(300)
def test_training_tracks_sdpa(seed):
    """A 2-layer transformer (2 heads of the smallest built head dim) trained for 20 AdamW steps on a
    fixed random batch under bf16 autocast, once with flashtile and once with PyTorch SDPA from the
    same initialization: the first step's parameter gradients agree, the loss curves track within
    5% at every step, and the loss falls."""
    d = min((d for d, dv in HEAD_DIMS if d == dv), default=None)
    if d is None:
        pytest.skip("no square head dim built")
    require_built("bf16", d, d, band=True)
    vocab, seqlen, batch, steps = 256, 128, 8, 20
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (batch, seqlen + 1), generator=g).cuda()
    torch.manual_seed(seed)
    init = _TinyLM(vocab, seqlen, 2, d, 2, None).state_dict()

    def train(attn):
        model = _TinyLM(vocab, seqlen, 2, d, 2, attn).cuda()
        model.load_state_dict(init)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, first_grads = [], None
        for _ in range(steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(data[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), data[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            if first_grads is None:
                first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            losses.append(loss.item())
        return losses, first_grads

    ft_losses, ft_grads = train(_flashtile_attn)
    ref_losses, ref_grads = train(_sdpa_attn)
    for n, ref in ref_grads.items():
        rel = float((ft_grads[n] - ref).norm() / ref.norm())
        assert rel < 0.05, f"step-0 gradient of {n}: relative difference {rel:.3g} from SDPA's"
    for i, (a, b) in enumerate(zip(ft_losses, ref_losses)):
        assert math.isfinite(a) and abs(a - b) / b < 0.05, f"step {i}: loss {a:.4f} vs SDPA {b:.4f}"
    assert ft_losses[-1] < 0.75 * ft_losses[0], f"loss did not fall: {ft_losses}"
