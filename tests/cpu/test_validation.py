"""Argument validation of the public API, flash_attn_combine, and importing without the library.

Every bad argument must raise before any kernel runs, with a message that names the argument. The
checks use only metadata and run the device check last, so CPU tensors exercise all the others (a
fully valid call on CPU tensors stops at the device check). flash_attn_combine is plain PyTorch and
is checked numerically against an unsplit softmax in float64.
"""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import flashtile
from flashtile import _lib, interface
from flashtile import flash_attn_combine as combine
from flashtile import (flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                       flash_attn_with_kvcache, get_scheduler_metadata)

BC = sys.modules["flashtile.build_config"]  # the module (flashtile.build_config is the function)
LOAD_LIBRARY = _lib.lib  # the real loader, kept before the autouse stub below replaces it

B, SQ, SK, H, HK, D = 2, 5, 7, 4, 2, 128
BF16 = torch.bfloat16
FP8 = getattr(torch, "float8_e4m3fn", None)
ON_CPU = r"must be on a CUDA device"


@pytest.fixture(autouse=True)
def no_kernel(monkeypatch):
    """Reaching the op or loading the library during validation is a failure."""
    def fail(*args, **kwargs):
        raise AssertionError("validation let the call through to the kernel")

    monkeypatch.setattr(interface, "_fwd_op", fail)
    monkeypatch.setattr(_lib, "lib", fail)


def t(*shape, dtype=BF16):
    return torch.randn(*shape).to(dtype)


def qkv(b=B, sq=SQ, sk=SK, h=H, hk=HK, d=D, dv=None, dtype=BF16):
    dv = d if dv is None else dv
    return t(b, sq, h, d, dtype=dtype), t(b, sk, hk, d, dtype=dtype), t(b, sk, hk, dv, dtype=dtype)


def varlen(lens_q=(3, 0, 4), lens_k=(5, 2, 0), h=H, hk=HK, d=D):
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = t(sum(lens_q), h, d), t(sum(lens_k), hk, d), t(sum(lens_k), hk, d)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                max_seqlen_k=max(lens_k))


def padded(**kw):
    q, k, v = qkv(**{n: kw.pop(n) for n in list(kw) if n in ("b", "sq", "sk", "h", "hk", "d", "dv", "dtype")})
    return flash_attn_func(q, k, v, **kw)


def with_(fn, **over):
    """Call fn(**args) with some of the base arguments replaced."""
    def call(base):
        args = dict(base)
        args.update(over)
        return fn(**args)
    return call


def non_contig_last(b, s, h, d):
    x = t(b, s, d, h).transpose(-1, -2)  # (b, s, h, d), stride(-1) == h
    assert x.stride(-1) != 1
    return x


def misaligned_batch_stride(b, s, h, d):
    buf = t(b * (s * h * d + 4))
    return buf.as_strided((b, s, h, d), (s * h * d + 4, h * d, d, 1))


def _q(**kw):
    return qkv(**kw)[0]


# (id, thunk, exception, match)
PADDED_CASES = [
    ("float32", lambda: padded(dtype=torch.float32), TypeError, r"\bq must be float16 or bfloat16, got torch\.float32"),
    ("int32", lambda: flash_attn_func(torch.zeros(B, SQ, H, D, dtype=torch.int32), *qkv()[1:]), TypeError,
     r"\bq must be float16 or bfloat16"),
    ("v-float32", lambda: flash_attn_func(*qkv()[:2], t(B, SK, HK, D, dtype=torch.float32)), TypeError,
     r"\bv must be float16 or bfloat16"),
    ("mixed-dtypes", lambda: flash_attn_func(_q(), *qkv(dtype=torch.float16)[1:]), TypeError,
     r"q, k, v must share one dtype"),
    ("not-a-tensor", lambda: flash_attn_func(_q().tolist(), *qkv()[1:]), TypeError, r"\bq must be a torch\.Tensor"),
    ("q-3d", lambda: flash_attn_func(t(SQ, H, D), *qkv()[1:]), ValueError, r"\bq must have 4 dims"),
    ("k-5d", lambda: flash_attn_func(_q(), t(B, SK, HK, D, 1), qkv()[2]), ValueError, r"\bk must have 4 dims"),
    ("q-last-dim-strided", lambda: flash_attn_func(non_contig_last(B, SQ, H, D), *qkv()[1:]), ValueError,
     r"\bq must have a contiguous last dimension"),
    ("v-last-dim-strided", lambda: flash_attn_func(*qkv()[:2], non_contig_last(B, SK, HK, D)), ValueError,
     r"\bv must have a contiguous last dimension"),
    ("hdim-not-multiple-of-8", lambda: padded(d=60), ValueError, r"q/k head dim must be a positive multiple of 8, got 60"),
    ("hdim-over-256", lambda: padded(d=264), ValueError, r"q/k head dim must be <= 256, got 264"),
    ("hdim-v-not-multiple-of-8", lambda: padded(dv=100), ValueError, r"v head dim must be a positive multiple of 8"),
    ("hdim-v-over-256", lambda: padded(dv=272), ValueError, r"v head dim must be <= 256"),
    ("hdim-pair-128x64", lambda: padded(d=128, dv=64), ValueError, r"v head dim \(64\) must equal the q/k head dim \(128\)"),
    ("hdim-pair-64x128", lambda: padded(d=64, dv=128), ValueError, r"v head dim \(128\) must equal the q/k head dim \(64\)"),
    ("hdim-pair-128x120", lambda: padded(d=128, dv=120), ValueError, r"v head dim \(120\)"),
    ("k-hdim", lambda: flash_attn_func(_q(), t(B, SK, HK, 64), t(B, SK, HK, D)), ValueError,
     r"\bk head dim \(64\) must equal q's \(128\)"),
    ("v-seqlen", lambda: flash_attn_func(*qkv()[:2], t(B, SK + 1, HK, D)), ValueError, r"\bv shape .* must match k's"),
    ("v-heads", lambda: flash_attn_func(*qkv()[:2], t(B, SK, HK + 1, D)), ValueError, r"\bv shape .* must match k's"),
    ("heads-not-divisible", lambda: padded(h=6, hk=4), ValueError,
     r"\bk has 4 heads; the number of query heads \(6\) must be a multiple of it"),
    ("more-kv-heads", lambda: padded(h=2, hk=4), ValueError, r"\bk has 4 heads"),
    ("batch", lambda: flash_attn_func(_q(), *qkv(b=B + 1)[1:]), ValueError, r"\bk batch size 3 must equal q's \(2\)"),
    ("window-len-3", lambda: padded(window_size=(1, 2, 3)), ValueError, r"window_size must be a \(left, right\) pair"),
    ("window-int", lambda: padded(window_size=5), ValueError, r"window_size must be a \(left, right\) pair"),
    # int(2.5) would narrow the window to 2 without a word.
    ("window-float", lambda: padded(window_size=(2.5, 0)), ValueError, r"window_size entries must be integers, got \(2\.5, 0\)"),
    ("window-none", lambda: padded(window_size=(None, None)), ValueError, r"window_size entries must be integers"),
    ("window-left-below-minus-1", lambda: padded(window_size=(-2, 0)), ValueError, r"window_size entries must be >= -1"),
    ("window-right-below-minus-1", lambda: padded(window_size=(0, -5)), ValueError, r"window_size entries must be >= -1"),
    ("softcap-negative", lambda: padded(softcap=-1.0), ValueError, r"softcap must be >= 0"),
    # NaN compares false with 0, which the kernels read as "softcap off"; inf turns every score into NaN.
    ("softcap-nan", lambda: padded(softcap=float("nan")), ValueError, r"softcap must be >= 0 and finite .*got nan"),
    ("softcap-inf", lambda: padded(softcap=float("inf")), ValueError, r"softcap must be >= 0 and finite .*got inf"),
    ("scale-zero", lambda: padded(softmax_scale=0.0), ValueError, r"softmax_scale must be a finite number > 0, got 0.0"),
    ("scale-negative", lambda: padded(softmax_scale=-0.125), ValueError, r"softmax_scale must be a finite number > 0"),
    ("scale-nan", lambda: padded(softmax_scale=float("nan")), ValueError, r"softmax_scale must be a finite number > 0, got nan"),
    ("scale-inf", lambda: padded(softmax_scale=float("inf")), ValueError, r"softmax_scale must be a finite number > 0, got inf"),
    ("q-descale-bf16", lambda: padded(q_descale=torch.ones(B, HK)), ValueError, r"q_descale only applies to float8"),
    # Descale shapes are checked only for float8 inputs, which are not implemented: with bf16 the
    # dtype rule is what a wrong shape meets.
    ("v-descale-bad-shape-bf16", lambda: padded(v_descale=torch.ones(3)), ValueError, r"v_descale only applies to float8"),
    ("q-head-stride", lambda: flash_attn_func(t(B, SQ, H, D + 4)[..., :D], *qkv()[1:]), ValueError,
     r"\bq stride\(2\) = 132 must be a multiple of 8 elements"),
    ("k-row-stride", lambda: flash_attn_func(_q(), t(B * SK * 264).as_strided((B, SK, HK, D), (SK * 264, 260, D, 1)),
                                             qkv()[2]), ValueError, r"\bk stride\(1\) = 260 must be a multiple of 8 elements"),
    ("q-batch-stride", lambda: flash_attn_func(misaligned_batch_stride(B, SQ, H, D), *qkv()[1:]), ValueError,
     r"\bq stride\(0\) = 2564 must be a multiple of 8 elements"),
    ("fp16-v-stride", lambda: flash_attn_func(*qkv(dtype=torch.float16)[:2], t(B, SK, HK, D + 12, dtype=torch.float16)[..., :D]),
     ValueError, r"\bv stride\(2\) = 140 must be a multiple of 8 elements"),
    ("path", lambda: padded(path="cuda"), ValueError, r"path must be one of \['ampere', 'auto', 'hopper'\], got 'cuda'"),
    ("cpu-tensors", lambda: padded(), ValueError, r"\bq must be on a CUDA device, got cpu"),
    ("qv", lambda: padded(qv=t(B, SQ, H, D)), NotImplementedError, r"\bqv\b"),
    ("attention-chunk", lambda: padded(attention_chunk=128), NotImplementedError, r"attention_chunk"),
    ("num-splits", lambda: padded(num_splits=2), NotImplementedError, r"split-KV \(num_splits=2\)"),
]
if FP8 is not None:
    PADDED_CASES += [
        ("float8", lambda: padded(dtype=FP8), NotImplementedError, r"FP8 attention \(q\.dtype=torch\.float8_e4m3fn\)"),
        ("float8-v-only", lambda: flash_attn_func(*qkv()[:2], t(B, SK, HK, D, dtype=FP8)), NotImplementedError,
         r"FP8 attention \(v\.dtype="),
        ("float8-with-descales", lambda: padded(dtype=FP8, q_descale=torch.ones(B, HK)), NotImplementedError,
         r"FP8 attention"),
    ]

VARLEN_CASES = [
    ("cu-q-int64", with_(flash_attn_varlen_func, cu_seqlens_q=torch.tensor([0, 3, 3, 7])), ValueError,
     r"cu_seqlens_q must be torch\.int32, got torch\.int64"),
    ("cu-k-int64", with_(flash_attn_varlen_func, cu_seqlens_k=torch.tensor([0, 5, 7, 7])), ValueError,
     r"cu_seqlens_k must be torch\.int32, got torch\.int64"),
    ("cu-k-length", with_(flash_attn_varlen_func, cu_seqlens_k=torch.tensor([0, 5, 7], dtype=torch.int32)), ValueError,
     r"cu_seqlens_k must have shape \(4,\), got \(3,\)"),
    ("cu-q-2d", with_(flash_attn_varlen_func, cu_seqlens_q=torch.tensor([[0, 3], [3, 7]], dtype=torch.int32)),
     ValueError, r"cu_seqlens_q must be a 1-D int32 tensor of length batch \+ 1"),
    ("cu-k-2d", with_(flash_attn_varlen_func, cu_seqlens_k=torch.zeros(4, 1, dtype=torch.int32)), ValueError,
     r"cu_seqlens_k must have shape \(4,\)"),
    ("cu-q-list", with_(flash_attn_varlen_func, cu_seqlens_q=[0, 3, 3, 7]), ValueError, r"cu_seqlens_q must be a 1-D"),
    ("cu-q-missing", with_(flash_attn_varlen_func, cu_seqlens_q=None), ValueError, r"cu_seqlens_q/cu_seqlens_k are required"),
    ("max-seqlen-q-missing", with_(flash_attn_varlen_func, max_seqlen_q=None), ValueError,
     r"max_seqlen_q must be given as an int >= 0 with cu_seqlens_q"),
    ("max-seqlen-q-negative", with_(flash_attn_varlen_func, max_seqlen_q=-1), ValueError, r"max_seqlen_q must be given"),
    ("max-seqlen-k-missing", with_(flash_attn_varlen_func, max_seqlen_k=None), ValueError, r"max_seqlen_k must be given"),
    ("seqused-k-length", with_(flash_attn_varlen_func, seqused_k=torch.zeros(2, dtype=torch.int32)), ValueError,
     r"seqused_k must have shape \(3,\), got \(2,\)"),
    ("seqused-q-dtype", with_(flash_attn_varlen_func, seqused_q=torch.zeros(3, dtype=torch.int64)), ValueError,
     r"seqused_q must be torch\.int32"),
    ("seqused-k-strided", with_(flash_attn_varlen_func, seqused_k=torch.zeros(6, dtype=torch.int32)[::2]), ValueError,
     r"seqused_k must be contiguous"),
    ("q-4d", with_(flash_attn_varlen_func, q=t(1, 7, H, D)), ValueError, r"\bq must have 3 dims"),
    ("k-4d", with_(flash_attn_varlen_func, k=t(1, 7, HK, D)), ValueError, r"\bk must have 3 dims"),
    ("window", with_(flash_attn_varlen_func, window_size=(3,)), ValueError, r"window_size must be a \(left, right\) pair"),
    ("softcap", with_(flash_attn_varlen_func, softcap=-0.5), ValueError, r"softcap must be >= 0"),
    ("k-descale", with_(flash_attn_varlen_func, k_descale=torch.ones(3, HK)), ValueError, r"k_descale only applies to float8"),
    ("qv", with_(flash_attn_varlen_func, qv=t(7, H, D)), NotImplementedError, r"\bqv\b"),
    ("num-splits", with_(flash_attn_varlen_func, num_splits=4), NotImplementedError, r"split-KV"),
    ("cpu-tensors", with_(flash_attn_varlen_func), ValueError, ON_CPU),
]


def kvcache_base():
    q, k_cache, v_cache = qkv(sq=1, sk=16)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=5)


KVCACHE_CASES = [
    ("page-table", with_(flash_attn_with_kvcache, page_table=torch.zeros(B, 1, dtype=torch.int32)), NotImplementedError,
     r"paged KV cache \(page_table\)"),
    ("append-kv", with_(flash_attn_with_kvcache, k=t(B, 1, HK, D), v=t(B, 1, HK, D)), NotImplementedError,
     r"appending new keys/values \(k, v\)"),
    ("append-k-only", with_(flash_attn_with_kvcache, k=t(B, 1, HK, D)), NotImplementedError, r"appending new keys/values"),
    ("rotary", with_(flash_attn_with_kvcache, rotary_cos=t(16, D // 2), rotary_sin=t(16, D // 2)), NotImplementedError,
     r"rotary embedding"),
    ("cache-batch-idx", with_(flash_attn_with_kvcache, cache_batch_idx=torch.arange(B, dtype=torch.int32)),
     NotImplementedError, r"cache_batch_idx"),
    ("cache-leftpad", with_(flash_attn_with_kvcache, cache_leftpad=torch.zeros(B, dtype=torch.int32)),
     NotImplementedError, r"cache_leftpad"),
    ("qv", with_(flash_attn_with_kvcache, qv=t(B, 1, H, D)), NotImplementedError, r"\bqv\b"),
    ("num-splits", with_(flash_attn_with_kvcache, num_splits=3), NotImplementedError, r"split-KV"),
    ("cache-seqlens-too-long", with_(flash_attn_with_kvcache, cache_seqlens=17), ValueError,
     r"cache_seqlens \(17\) must be in \[0, 16\]"),
    ("cache-seqlens-negative", with_(flash_attn_with_kvcache, cache_seqlens=-1), ValueError, r"cache_seqlens"),
    # Errors name this function's arguments: k and v are its keys to append, seqused_k is not one of them.
    ("cache-seqlens-dtype", with_(flash_attn_with_kvcache, cache_seqlens=torch.full((B,), 5)), ValueError,
     r"^flashtile: cache_seqlens must be torch\.int32, got torch\.int64"),
    ("cache-seqlens-length", with_(flash_attn_with_kvcache, cache_seqlens=torch.full((B + 1,), 5, dtype=torch.int32)),
     ValueError, r"^flashtile: cache_seqlens must have shape \(2,\), got \(3,\)"),
    ("k-cache-float32", with_(flash_attn_with_kvcache, k_cache=t(B, 16, HK, D, dtype=torch.float32)), TypeError,
     r"^flashtile: k_cache must be float16 or bfloat16"),
    ("v-cache-fp16", with_(flash_attn_with_kvcache, v_cache=t(B, 16, HK, D, dtype=torch.float16)), TypeError,
     r"^flashtile: q, k_cache, v_cache must share one dtype"),
    ("k-cache-heads", with_(flash_attn_with_kvcache, k_cache=t(B, 16, 3, D), v_cache=t(B, 16, 3, D)), ValueError,
     r"^flashtile: k_cache has 3 heads"),
    ("k-cache-hdim", with_(flash_attn_with_kvcache, k_cache=t(B, 16, HK, 64)), ValueError,
     r"^flashtile: k_cache head dim \(64\) must equal q's \(128\)"),
    ("v-cache-seqlen", with_(flash_attn_with_kvcache, v_cache=t(B, 17, HK, D)), ValueError,
     r"^flashtile: v_cache shape \(2, 17, 2, 128\) must match k_cache's \(2, 16, 2, 128\)"),
    ("k-cache-row-stride", with_(flash_attn_with_kvcache, k_cache=t(B, 16, HK, D + 4)[..., :D]), ValueError,
     r"^flashtile: k_cache stride\(2\) = 132 must be a multiple of 8 elements"),
    ("cache-batch", with_(flash_attn_with_kvcache, k_cache=t(B + 1, 16, HK, D), v_cache=t(B + 1, 16, HK, D)),
     ValueError, r"k_cache batch size 3 must equal q's \(2\)"),
    ("k-cache-3d", with_(flash_attn_with_kvcache, k_cache=t(16, HK, D)), ValueError, r"k_cache must have 4 dims"),
    ("v-cache-3d", with_(flash_attn_with_kvcache, v_cache=t(16, HK, D)), ValueError, r"v_cache must have 4 dims"),
    ("float32", with_(flash_attn_with_kvcache, q=t(B, 1, H, D, dtype=torch.float32)), TypeError,
     r"\bq must be float16 or bfloat16"),
    ("window", with_(flash_attn_with_kvcache, window_size=(-3, 0)), ValueError, r"window_size entries must be >= -1"),
    ("cpu-tensors", with_(flash_attn_with_kvcache), ValueError, ON_CPU),
]


def qkvpacked_base():
    return dict(qkv=t(B, SQ, 3, H, D))


QKVPACKED_CASES = [
    ("not-3", with_(flash_attn_qkvpacked_func, qkv=t(B, SQ, 2, H, D)), ValueError,
     r"qkv must have shape \(batch, seqlen, 3, nheads, d\)"),
    ("3d", with_(flash_attn_qkvpacked_func, qkv=t(B, SQ, 3 * H * D)), ValueError, r"qkv must have 5 dims"),
    ("not-a-tensor", with_(flash_attn_qkvpacked_func, qkv=[1.0]), TypeError, r"qkv must be a torch\.Tensor"),
    ("4d-no-num-heads-q", with_(flash_attn_qkvpacked_func, qkv=t(B, SQ, 8, D)), ValueError, r"num_heads_q is required"),
    ("4d-odd-kv", with_(flash_attn_qkvpacked_func, qkv=t(B, SQ, 7, D), num_heads_q=4), ValueError,
     r"num_heads_q \(4\) leaves 3 heads for k and v"),
    ("4d-no-kv", with_(flash_attn_qkvpacked_func, qkv=t(B, SQ, 4, D), num_heads_q=4), ValueError,
     r"num_heads_q \(4\) leaves 0 heads"),
    # 0 query heads would pass every other check and return an empty output.
    ("4d-zero-q-heads", with_(flash_attn_qkvpacked_func, qkv=t(B, SQ, 8, D), num_heads_q=0), ValueError,
     r"num_heads_q must be a positive int, got 0"),
    ("4d-negative-q-heads", with_(flash_attn_qkvpacked_func, qkv=t(B, SQ, 8, D), num_heads_q=-2), ValueError,
     r"num_heads_q must be a positive int, got -2"),
    ("4d-float-q-heads", with_(flash_attn_qkvpacked_func, qkv=t(B, SQ, 8, D), num_heads_q=4.0), ValueError,
     r"num_heads_q must be a positive int, got 4\.0"),
    ("4d-gqa-not-divisible", with_(flash_attn_qkvpacked_func, qkv=t(B, SQ, 11, D), num_heads_q=5), ValueError,
     r"\bk has 3 heads"),
    ("float32", with_(flash_attn_qkvpacked_func, qkv=t(B, SQ, 3, H, D, dtype=torch.float32)), TypeError,
     r"\bq must be float16 or bfloat16"),
    ("hdim", with_(flash_attn_qkvpacked_func, qkv=t(B, SQ, 3, H, 36)), ValueError, r"head dim must be a positive multiple of 8"),
    ("softcap", with_(flash_attn_qkvpacked_func, softcap=-2.0), ValueError, r"softcap must be >= 0"),
    ("attention-chunk", with_(flash_attn_qkvpacked_func, attention_chunk=64), NotImplementedError, r"attention_chunk"),
    ("path", with_(flash_attn_qkvpacked_func, path="sm90"), ValueError, r"path must be one of"),
    ("cpu-5d", with_(flash_attn_qkvpacked_func), ValueError, ON_CPU),
    ("cpu-4d-gqa", with_(flash_attn_qkvpacked_func, qkv=t(B, SQ, 8, D), num_heads_q=4), ValueError, ON_CPU),
]


def _check_raises(thunk, exc, match):
    with pytest.raises(exc, match=match) as info:
        thunk()
    assert str(info.value).startswith("flashtile: "), str(info.value)


@pytest.mark.parametrize("thunk, exc, match", [c[1:] for c in PADDED_CASES], ids=[c[0] for c in PADDED_CASES])
def test_flash_attn_func_rejects(thunk, exc, match):
    _check_raises(thunk, exc, match)


@pytest.mark.parametrize("call, exc, match", [c[1:] for c in VARLEN_CASES], ids=[c[0] for c in VARLEN_CASES])
def test_flash_attn_varlen_func_rejects(call, exc, match):
    _check_raises(lambda: call(varlen()), exc, match)


@pytest.mark.parametrize("call, exc, match", [c[1:] for c in KVCACHE_CASES], ids=[c[0] for c in KVCACHE_CASES])
def test_flash_attn_with_kvcache_rejects(call, exc, match):
    _check_raises(lambda: call(kvcache_base()), exc, match)


@pytest.mark.parametrize("call, exc, match", [c[1:] for c in QKVPACKED_CASES], ids=[c[0] for c in QKVPACKED_CASES])
def test_flash_attn_qkvpacked_func_rejects(call, exc, match):
    _check_raises(lambda: call(qkvpacked_base()), exc, match)


def test_kvcache_varlen_q_needs_max_seqlen_q():
    q = t(6, H, D)
    cu = torch.tensor([0, 1, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"max_seqlen_q must be given"):
        flash_attn_with_kvcache(q, t(2, 16, HK, D), t(2, 16, HK, D), cache_seqlens=4, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match=ON_CPU):
        flash_attn_with_kvcache(q, t(2, 16, HK, D), t(2, 16, HK, D), cache_seqlens=4, cu_seqlens_q=cu, max_seqlen_q=5)


def test_get_scheduler_metadata_not_implemented():
    with pytest.raises(NotImplementedError, match=r"get_scheduler_metadata"):
        get_scheduler_metadata(2, 1, 128, H, HK, D, torch.zeros(2, dtype=torch.int32))


# Valid requests must pass every check except the device one: no false rejections.
VALID = [
    ("mha", dict()),
    ("gqa-causal", dict(h=6, hk=2, causal=True)),
    ("mqa-window", dict(h=4, hk=1, window_size=(16, 0))),
    ("window-list", dict(window_size=[-1, 3])),
    ("window-int-likes", dict(window_size=(torch.tensor(8), np.int64(0)))),
    ("softcap-scale", dict(softcap=30.0, softmax_scale=0.1)),
    ("hdim-64", dict(d=64)),
    ("hdim-80", dict(d=80)),
    ("hdim-8", dict(d=8)),
    ("hdim-256", dict(d=256)),
    ("hdim-192x128", dict(d=192, dv=128)),
    ("hdim-176x120", dict(d=176, dv=120)),
    ("fp16", dict(dtype=torch.float16)),
    ("path-ampere", dict(path="ampere")),
    ("path-hopper", dict(path="hopper")),
    ("fa3-args", dict(num_splits=1, pack_gqa=True, deterministic=True, sm_margin=4, return_attn_probs=True)),
    ("pack-gqa-off", dict(h=8, hk=2, pack_gqa=False)),
    ("num-splits-0", dict(num_splits=0)),
    ("attention-chunk-0", dict(attention_chunk=0)),
    ("seqlen-1", dict(sq=1, sk=1)),
    ("empty-k", dict(sk=0)),
]


@pytest.mark.parametrize("pack_gqa", [1, "yes", 0.0])
def test_pack_gqa_must_be_none_or_bool(pack_gqa):
    with pytest.raises(ValueError, match="pack_gqa"):
        padded(h=8, hk=2, pack_gqa=pack_gqa)


@pytest.mark.parametrize("kw", [c[1] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_arguments_reach_the_device_check(kw):
    with pytest.raises(ValueError, match=ON_CPU):
        padded(**kw)


def test_valid_varlen_and_views_reach_the_device_check():
    with pytest.raises(ValueError, match=ON_CPU):
        flash_attn_varlen_func(**varlen(), seqused_q=torch.tensor([3, 0, 4], dtype=torch.int32),
                               seqused_k=torch.tensor([1, 2, 0], dtype=torch.int32), causal=True)
    # Strided views whose non-unit strides are multiples of 16 bytes are accepted.
    base = t(B, SQ, H, D + 64)
    kv = t(B, SK, 2, HK, D)
    with pytest.raises(ValueError, match=ON_CPU):
        flash_attn_func(base[..., :D], kv[:, :, 0], kv[:, :, 1])
    with pytest.raises(ValueError, match=ON_CPU):
        flash_attn_func(t(SQ, B, H, D).transpose(0, 1), t(B, HK, SK, D).transpose(1, 2), t(B, SK, HK, D))
    with pytest.raises(ValueError, match=ON_CPU):
        flash_attn_with_kvcache(*qkv(sq=3, sk=16), cache_seqlens=torch.tensor([0, 16], dtype=torch.int32), causal=True)


def test_device_check_names_each_tensor():
    q, k, v = qkv()
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\bq must be on a CUDA device, got cpu"):
        flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match=r"\bq must be on a CUDA device"):
        flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 3, 3)


# ---- flash_attn_combine ---------------------------------------------------------------------------

def _split_attention(num_splits, batch, seqlen, nheads, d, nkeys, *, masked_rows=(), masked_splits=(), seed=0):
    """Partial (out, lse) per key chunk in float64 and the unsplit result.

    masked_rows: (b, s, h) rows that see no key at all; masked_splits: (split, b, s, h) chunks that see
    no key for that row. Empty chunks get lse = -inf and out = 0, as a split-KV kernel writes them.
    """
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, seqlen, nheads, nkeys, generator=g, dtype=torch.float64) * 3
    v = torch.randn(batch, seqlen, nheads, nkeys, d, generator=g, dtype=torch.float64)
    visible = torch.ones_like(scores, dtype=torch.bool)
    bounds = torch.linspace(0, nkeys, num_splits + 1).round().long().tolist()
    for (b, s, h) in masked_rows:
        visible[b, s, h] = False
    for (i, b, s, h) in masked_splits:
        visible[b, s, h, bounds[i]:bounds[i + 1]] = False
    scores = scores.masked_fill(~visible, -math.inf)

    out_p = torch.zeros(num_splits, batch, seqlen, nheads, d, dtype=torch.float64)
    lse_p = torch.full((num_splits, batch, seqlen, nheads), -math.inf, dtype=torch.float64)
    for i in range(num_splits):
        s = scores[..., bounds[i]:bounds[i + 1]]
        has = torch.isfinite(s).any(-1)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(has, lse, torch.zeros_like(lse)).unsqueeze(-1))
        o = torch.einsum("bshk,bshkd->bshd", p, v[..., bounds[i]:bounds[i + 1], :])
        out_p[i] = torch.where(has.unsqueeze(-1), o, torch.zeros_like(o))
        lse_p[i] = torch.where(has, lse, torch.full_like(lse, -math.inf))

    has = torch.isfinite(scores).any(-1)
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - torch.where(has, lse, torch.zeros_like(lse)).unsqueeze(-1))
    out = torch.where(has.unsqueeze(-1), torch.einsum("bshk,bshkd->bshd", p, v), torch.zeros(1, dtype=torch.float64))
    lse = torch.where(has, lse, torch.full_like(lse, -math.inf))
    return out_p, lse_p, out, lse


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_combine_matches_unsplit_softmax(num_splits):
    masked_rows = [(0, 1, 2), (1, 0, 0)]
    # Rows where some (not all) splits see no key; with one split that would mask the whole row.
    masked_splits = [(0, 0, 0, 1), (num_splits - 1, 1, 2, 0), (0, 0, 2, 3)] if num_splits > 1 else []
    out_p, lse_p, out_ref, lse_ref = _split_attention(num_splits, 2, 3, 4, 16, 37, masked_rows=masked_rows,
                                                      masked_splits=masked_splits, seed=num_splits)
    out, lse = combine(out_p.float(), lse_p.float())
    assert out.shape == (2, 3, 4, 16) and out.dtype == torch.float32
    assert lse.shape == (2, 3, 4) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), out_ref, rtol=1e-5, atol=1e-6)
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse.double()[finite], lse_ref[finite], rtol=1e-6, atol=1e-6)
    # A row whose every split saw no key: output exactly 0 and lse -inf (no NaN).
    for (b, s, h) in masked_rows:
        assert torch.all(out[b, s, h] == 0)
        assert lse[b, s, h].item() == -math.inf
    assert not torch.isnan(out).any()
    assert int(finite.sum()) == lse_ref.numel() - len(masked_rows)


def test_combine_out_and_out_dtype():
    out_p, lse_p, out_ref, _ = _split_attention(3, 1, 5, 2, 8, 20, seed=7)
    merged, _ = combine(out_p.float(), lse_p.float(), out_dtype=torch.bfloat16)
    assert merged.dtype == torch.bfloat16
    torch.testing.assert_close(merged.double(), out_ref, rtol=2**-7, atol=1e-2)
    dst = torch.full((1, 5, 2, 8), math.nan, dtype=torch.float16)
    res, lse = combine(out_p.float(), lse_p.float(), out=dst)
    assert res is dst and dst.dtype == torch.float16
    torch.testing.assert_close(dst.double(), out_ref, rtol=2**-10, atol=1e-3)
    with pytest.raises(ValueError, match=r"\bout must have shape \(1, 5, 2, 8\)"):
        combine(out_p.float(), lse_p.float(), out=torch.empty(1, 5, 2, 4))


def test_combine_rejects_bad_arguments():
    out_p = torch.zeros(2, 3, 4, 8)
    lse_p = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"out_partial must be torch\.float32"):
        combine(out_p.double(), lse_p)
    with pytest.raises(ValueError, match=r"lse_partial must be torch\.float32"):
        combine(out_p, lse_p.half())
    with pytest.raises(ValueError, match=r"lse_partial shape \(2, 3, 5\) must equal"):
        combine(out_p, torch.zeros(2, 3, 5))
    with pytest.raises(TypeError, match=r"out_partial must be a torch\.Tensor"):
        combine(out_p.tolist(), lse_p)


# ---- importing and loading without the compiled library ---------------------------------------------

def _package_parent():
    return os.path.dirname(os.path.dirname(os.path.abspath(flashtile.__file__)))


def test_import_without_library_in_clean_subprocess(tmp_path):
    script = (
        "import flashtile, flashtile._lib as L\n"
        "assert L._lib is None, 'library loaded at import'\n"
        "try:\n"
        "    L.lib()\n"
        "except flashtile.LibraryNotAvailableError as e:\n"
        "    print('LIB:', e)\n"
        "try:\n"
        "    flashtile.build_config()\n"
        "except flashtile.LibraryNotAvailableError as e:\n"
        "    print('CFG:', e)\n"
    )
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": _package_parent(),
           "FLASHTILE_LIBRARY_DIR": str(tmp_path), "HOME": os.environ.get("HOME", str(tmp_path))}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    lib_line = next(line for line in lines if line.startswith("LIB:"))
    cfg_line = next(line for line in lines if line.startswith("CFG:"))
    assert str(tmp_path / "libflashtile.so") in lib_line and "pip install" in lib_line
    assert "FLASHTILE_LIBRARY_DIR" in lib_line
    assert str(tmp_path / "build_config.json") in cfg_line and "pip install" in cfg_line


def test_import_does_not_load_library():
    env = dict(os.environ, PYTHONPATH=_package_parent())
    res = subprocess.run([sys.executable, "-c", "import flashtile, flashtile._lib as L; assert L._lib is None"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


@pytest.fixture
def empty_library_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTILE_LIBRARY_DIR", str(tmp_path))
    monkeypatch.setattr(_lib, "_lib", None)
    BC.build_config.cache_clear()
    yield tmp_path
    BC.build_config.cache_clear()


def test_loader_raises_helpful_error_without_library(empty_library_dir):
    assert _lib.library_path() == str(empty_library_dir / "libflashtile.so")
    with pytest.raises(flashtile.LibraryNotAvailableError, match=r"not found at .*libflashtile\.so") as info:
        LOAD_LIBRARY()
    assert "pip install" in str(info.value) and "FLASHTILE_LIBRARY_DIR" in str(info.value)
    assert _lib._lib is None
    with pytest.raises(flashtile.LibraryNotAvailableError, match=r"build_config\.json is missing"):
        flashtile.build_config()
    assert issubclass(flashtile.LibraryNotAvailableError, RuntimeError)


def test_validation_needs_no_library(empty_library_dir):
    with pytest.raises(TypeError, match=r"\bq must be float16 or bfloat16"):
        padded(dtype=torch.float32)
    with pytest.raises(ValueError, match=ON_CPU):
        padded()


def test_loader_rejects_unloadable_file(empty_library_dir):
    (empty_library_dir / "libflashtile.so").write_bytes(b"not a shared library")
    with pytest.raises(flashtile.LibraryNotAvailableError, match=r"could not be loaded"):
        LOAD_LIBRARY()
    assert _lib._lib is None


def test_validated_calls_are_cached_by_metadata(monkeypatch):
    """Eager padded calls skip re-validation only when every piece of metadata and every argument is
    the same as a call that passed; anything else is validated (and rejected) afresh."""
    calls = []
    for op in ("_fwd_op", "_fwd_op_eager"):  # the cached path calls the op's eager body directly
        monkeypatch.setattr(interface, op, lambda *args: calls.append(args) or (args[0], None))
    monkeypatch.setattr(interface, "_eager", lambda *tensors: True)
    monkeypatch.setattr(interface.V, "check_same_device", lambda tensors: None)
    monkeypatch.setattr(interface, "require_kernel", lambda **kw: ("stand-in",))
    monkeypatch.setattr(interface, "_validated", {})
    q, k, v = (torch.randn(B, s, h, D, dtype=BF16) for s, h in ((SQ, H), (SK, HK), (SK, HK)))
    flash_attn_func(q, k, v, causal=True)
    checks = []
    monkeypatch.setattr(interface.V, "check_tensor", lambda *a: checks.append(a[0]))
    flash_attn_func(q.clone(), k.clone(), v.clone(), causal=True)  # same metadata: served from the cache
    assert checks == [] and calls[0][3:] == calls[1][3:]
    flash_attn_func(q, k, v, causal=False)  # another argument: validated again
    assert checks == ["q", "k", "v"] and calls[2][10] is False
    monkeypatch.undo()
    monkeypatch.setattr(interface, "_eager", lambda *tensors: True)
    for op in ("_fwd_op", "_fwd_op_eager"):
        monkeypatch.setattr(interface, op, lambda *args: (args[0], None))
    with pytest.raises(ValueError, match=r"window_size"):
        flash_attn_func(q, k, v, window_size=(-5, 0))
    with pytest.raises(ValueError, match=r"k batch size"):
        flash_attn_func(q, k[:1], v[:1])


def test_validated_varlen_calls_are_cached_by_metadata(monkeypatch):
    """Packed calls are cached too, by the metadata of cu_seqlens_* / seqused_* and the max_seqlen_*
    values: the same metadata with other contents is served from the cache (validation never reads
    the contents), another length, dtype or max_seqlen is validated (and rejected) afresh."""
    calls = []
    for op in ("_fwd_op", "_fwd_op_eager"):
        monkeypatch.setattr(interface, op, lambda *args: calls.append(args) or (args[0], None))
    monkeypatch.setattr(interface, "_eager", lambda *tensors: True)
    monkeypatch.setattr(interface.V, "check_same_device", lambda tensors: None)
    monkeypatch.setattr(interface, "require_kernel", lambda **kw: ("stand-in",))
    monkeypatch.setattr(interface, "_validated", {})
    q, k, v = (torch.randn(12, h, D, dtype=BF16) for h in (H, HK, HK))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True)
    checks = []
    monkeypatch.setattr(interface.V, "check_tensor", lambda *a: checks.append(a[0]))
    cu2 = torch.tensor([0, 6, 12], dtype=torch.int32)
    flash_attn_varlen_func(q, k, v, cu2, cu2, 7, 7, causal=True)  # same metadata: served from the cache
    assert checks == [] and calls[1][3] is cu2 and calls[0][7:] == calls[1][7:]
    flash_attn_varlen_func(q, k, v, cu, cu, 9, 7, causal=True)  # another max_seqlen_q: validated again
    assert checks == ["q", "k", "v"] and calls[2][7] == 9
    monkeypatch.undo()
    monkeypatch.setattr(interface, "_eager", lambda *tensors: True)
    for op in ("_fwd_op", "_fwd_op_eager"):
        monkeypatch.setattr(interface, op, lambda *args: (args[0], None))
    with pytest.raises(ValueError, match=r"cu_seqlens_k must have shape \(3,\)"):
        flash_attn_varlen_func(q, k, v, cu, cu[:2], 7, 7, causal=True)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be torch.int32"):
        flash_attn_varlen_func(q, k, v, cu.long(), cu, 7, 7, causal=True)
