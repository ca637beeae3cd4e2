"""Tests for flashtile.reference.attention_ref against independent float64 math.

The oracle here builds every mask entry one (query, key) pair at a time and does the softmax row by
row, so it shares no code path with the vectorised reference. Hard-coded masks from the
FlashAttention-3 documentation pin the bottom-right alignment itself.
"""

import math

import pytest
import torch

from flashtile import reference as reference_module
from flashtile.reference import attention_mask, attention_ref


def _visible(i, j, sq, sk, causal, window):
    wl, wr = window
    if causal:
        wr = 0
    if j >= sk:
        return False
    if wl >= 0 and j < i + sk - sq - wl:
        return False
    if wr >= 0 and j > i + sk - sq + wr:
        return False
    return True


def naive_attention(q, k, v, *, scale=None, causal=False, window=(-1, -1), softcap=0.0, q_lens=None, k_lens=None):
    """Padded-layout oracle. Rows i >= q_lens[b] and fully masked rows give 0 output and -inf lse."""
    q, k, v = q.double(), k.double(), v.double()
    b, sq, h, d = q.shape
    sk, hk, dv = v.shape[1], v.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b, sq, h, dv, dtype=torch.float64)
    lse = torch.full((b, h, sq), -math.inf, dtype=torch.float64)
    for bi in range(b):
        sql = sq if q_lens is None else q_lens[bi]
        skl = sk if k_lens is None else k_lens[bi]
        for hi in range(h):
            kh = hi // (h // hk)
            for i in range(sql):
                keys = [j for j in range(sk) if _visible(i, j, sql, skl, causal, window)]
                if not keys:
                    continue
                s = torch.stack([torch.dot(q[bi, i, hi], k[bi, j, kh]) * scale for j in keys])
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                w = torch.exp(s - s.max())
                out[bi, i, hi] = (w[:, None] * v[bi, keys, kh]).sum(0) / w.sum()
                lse[bi, hi, i] = s.max() + torch.log(w.sum())
    return out, lse


def _qkv(b, sq, sk, h, hk, d, dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hk, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hk, dv, generator=g).to(dtype)
    return q, k, v


def _assert_matches(out, lse, ref_out, ref_lse, atol=1e-5):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=0)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.all(lse[~finite] == -math.inf)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=atol, rtol=0)


@pytest.mark.parametrize("d", [8, 16])
@pytest.mark.parametrize("h,hk", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("sk", [1, 5, 13])
@pytest.mark.parametrize("sq", [1, 7, 13])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_naive(sq, sk, h, hk, d, causal):
    q, k, v = _qkv(2, sq, sk, h, hk, d)
    out, lse = attention_ref(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == torch.float32 and out.shape == (2, sq, h, d)
    assert lse.dtype == torch.float32 and lse.shape == (2, h, sq)
    _assert_matches(out, lse, *naive_attention(q, k, v, causal=causal))


def test_head_dim_v_differs():
    q, k, v = _qkv(2, 7, 13, 4, 2, 16, dv=8)
    out, lse = attention_ref(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 7, 4, 8)
    _assert_matches(out, lse, *naive_attention(q, k, v, causal=True))


def _probe_mask(sq, sk, **kwargs):
    """Recover the visibility mask through attention_ref: zero q gives uniform weights over visible keys
    and one-hot v rows tag each key, so out[i, j] = 1/|visible(i)| exactly where key j is visible."""
    q = torch.zeros(1, sq, 1, 4)
    k = torch.randn(1, sk, 1, 4)
    v = torch.eye(sk).reshape(1, sk, 1, sk)
    out, lse = attention_ref(q, k, v, return_lse=True, **kwargs)
    return out[0, :, 0] > 0, out[0, :, 0], lse[0, 0]


def test_fa3_docstring_causal_sq_lt_sk():
    expect = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(attention_mask(2, 5, causal=True), expect)
    mask, out, _ = _probe_mask(2, 5, causal=True)
    assert torch.equal(mask, expect)
    torch.testing.assert_close(out[0], torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0]))


def test_fa3_docstring_causal_sq_gt_sk():
    expect = torch.tensor([[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]], dtype=torch.bool)
    assert torch.equal(attention_mask(5, 2, causal=True), expect)
    mask, out, lse = _probe_mask(5, 2, causal=True)
    assert torch.equal(mask, expect)
    assert torch.all(out[:3] == 0)
    assert torch.all(lse[:3] == -math.inf) and torch.all(torch.isfinite(lse[3:]))


@pytest.mark.parametrize(
    "sq,sk,causal,window,expect",
    [
        # [i + sk - sq - wl, i + sk - sq + wr] inclusive, shift sk - sq = 2
        (4, 6, False, (1, 1), [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]]),
        (4, 4, True, (2, -1), [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]]),
        (3, 5, False, (-1, 0), [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
        (3, 5, False, (0, -1), [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 0, 1]]),
        (4, 2, False, (0, 0), [[0, 0], [0, 0], [1, 0], [0, 1]]),
    ],
)
def test_hardcoded_local_masks(sq, sk, causal, window, expect):
    expect = torch.tensor(expect, dtype=torch.bool)
    assert torch.equal(attention_mask(sq, sk, causal=causal, window_size=window), expect)
    mask, _, lse = _probe_mask(sq, sk, causal=causal, window_size=window)
    assert torch.equal(mask, expect)
    assert torch.equal(torch.isinf(lse), ~expect.any(dim=1))


@pytest.mark.parametrize("window", [(2, 0), (0, 2), (3, 1), (-1, 2), (2, -1), (0, 0), (1, 1)])
@pytest.mark.parametrize("sq,sk", [(7, 13), (13, 5), (13, 13), (1, 13)])
@pytest.mark.parametrize("causal", [False, True])
def test_local_window(sq, sk, window, causal):
    q, k, v = _qkv(2, sq, sk, 4, 2, 8, seed=1)
    out, lse = attention_ref(q, k, v, causal=causal, window_size=window, return_lse=True)
    _assert_matches(out, lse, *naive_attention(q, k, v, causal=causal, window=window))


@pytest.mark.parametrize("softcap", [0.5, 5.0, 30.0])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(softcap, causal):
    q, k, v = _qkv(2, 7, 13, 4, 1, 16, seed=2)
    q = q * 3  # push scores into the range where tanh bends
    out, lse = attention_ref(q, k, v, causal=causal, softcap=softcap, return_lse=True)
    _assert_matches(out, lse, *naive_attention(q, k, v, causal=causal, softcap=softcap))
    plain = attention_ref(q, k, v, causal=causal)
    assert not torch.allclose(out, plain, atol=1e-3)


def test_softmax_scale():
    q, k, v = _qkv(2, 7, 5, 4, 4, 16, seed=3)
    out, lse = attention_ref(q, k, v, softmax_scale=0.3, return_lse=True)
    _assert_matches(out, lse, *naive_attention(q, k, v, scale=0.3))
    default = attention_ref(q, k, v)
    torch.testing.assert_close(default, attention_ref(q, k, v, softmax_scale=0.25))


def test_gqa_head_mapping():
    # MQA with nheads_k = 2: query heads 0-1 read kv head 0, heads 2-3 read kv head 1.
    q, k, v = _qkv(1, 5, 7, 4, 2, 8, seed=4)
    out = attention_ref(q, k, v)
    for h in range(4):
        single = attention_ref(q[:, :, h : h + 1], k[:, :, h // 2 : h // 2 + 1], v[:, :, h // 2 : h // 2 + 1])
        torch.testing.assert_close(out[:, :, h : h + 1], single, atol=1e-6, rtol=0)


def test_lse_against_logsumexp():
    q, k, v = _qkv(2, 13, 13, 4, 2, 16, seed=5)
    _, lse = attention_ref(q, k, v, causal=True, window_size=(4, -1), return_lse=True)
    mask = attention_mask(13, 13, causal=True, window_size=(4, -1))
    kk = k.double().repeat_interleave(2, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) / math.sqrt(16)
    expect = torch.logsumexp(s.masked_fill(~mask, -math.inf), dim=-1)
    torch.testing.assert_close(lse.double(), expect, atol=1e-5, rtol=0)


def _pad(x, lengths, cu):
    """(total, h, d) -> (b, max_len, h, d), zero-padded."""
    n = max(lengths) if lengths else 0
    out = torch.zeros(len(lengths), max(n, 1), *x.shape[1:], dtype=x.dtype)
    for b, L in enumerate(lengths):
        out[b, :L] = x[cu[b] : cu[b] + L]
    return out


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1))])
def test_varlen(causal, window):
    lens_q = [3, 0, 7, 1, 4]
    lens_k = [5, 4, 0, 6, 4]
    cu_q = torch.tensor([0, 3, 3, 10, 11, 15], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9, 9, 15, 19], dtype=torch.int32)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(15, 4, 8, generator=g)
    k = torch.randn(19, 2, 8, generator=g)
    v = torch.randn(19, 2, 8, generator=g)
    out, lse = attention_ref(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal, window_size=window, return_lse=True
    )
    assert out.shape == (15, 4, 8) and lse.shape == (4, 15)
    for b in range(5):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lens_q[b] == 0:
            continue
        ref_o, ref_l = naive_attention(q[None, qs], k[None, ks], v[None, ks], causal=causal, window=window)
        _assert_matches(out[qs], lse[:, qs], ref_o[0], ref_l[0])
        if lens_k[b] > 0:
            padded_o, padded_l = attention_ref(
                q[None, qs], k[None, ks], v[None, ks], causal=causal, window_size=window, return_lse=True
            )
            torch.testing.assert_close(out[qs], padded_o[0], atol=1e-6, rtol=0)
            torch.testing.assert_close(lse[:, qs], padded_l[0], atol=1e-6, rtol=0)
    # The sequence with no keys: every row fully masked.
    assert torch.all(out[3:10] == 0) and torch.all(lse[:, 3:10] == -math.inf)

    # Same batch through the padded layout with padding masks.
    qp, kp, vp = _pad(q, lens_q, cu_q.tolist()), _pad(k, lens_k, cu_k.tolist()), _pad(v, lens_k, cu_k.tolist())
    qmask = torch.arange(qp.shape[1])[None, :] < torch.tensor(lens_q)[:, None]
    kmask = torch.arange(kp.shape[1])[None, :] < torch.tensor(lens_k)[:, None]
    po, pl = attention_ref(
        qp, kp, vp, query_padding_mask=qmask, key_padding_mask=kmask, causal=causal, window_size=window,
        return_lse=True,
    )
    for b in range(5):
        L, c = lens_q[b], int(cu_q[b])
        torch.testing.assert_close(out[c : c + L], po[b, :L], atol=1e-6, rtol=0)
        torch.testing.assert_close(lse[:, c : c + L], pl[b, :, :L], atol=1e-6, rtol=0)


def test_varlen_rows_past_last_sequence():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    q = torch.randn(7, 2, 8)  # rows 5 and 6 belong to no sequence
    k = torch.randn(5, 2, 8)
    out, lse = attention_ref(q, k, k.clone(), cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True)
    assert torch.all(out[5:] == 0) and torch.all(lse[:, 5:] == -math.inf)
    assert torch.all(torch.isfinite(lse[:, :5]))


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k(causal):
    q, k, v = _qkv(3, 5, 13, 4, 2, 8, seed=7)
    used = [13, 4, 0]
    out, lse = attention_ref(q, k, v, causal=causal, seqused_k=torch.tensor(used, dtype=torch.int32), return_lse=True)
    _assert_matches(out, lse, *naive_attention(q, k, v, causal=causal, k_lens=used))
    # Equivalent to cutting k/v down to the used length.
    o1 = attention_ref(q[1:2], k[1:2, :4], v[1:2, :4], causal=causal)
    torch.testing.assert_close(out[1:2], o1, atol=1e-6, rtol=0)
    assert torch.all(out[2] == 0) and torch.all(lse[2] == -math.inf)


def test_seqused_overrides_padding_mask_and_cu_seqlens():
    q, k, v = _qkv(2, 5, 9, 2, 2, 8, seed=8)
    kmask = torch.ones(2, 9, dtype=torch.bool)
    used = torch.tensor([3, 6], dtype=torch.int32)
    out = attention_ref(q, k, v, key_padding_mask=kmask, seqused_k=used, causal=True)
    torch.testing.assert_close(out, attention_ref(q, k, v, seqused_k=used, causal=True))
    # varlen q with seqused_q: rows past seqused_q are zero, the rest as if the sequence were shorter.
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    qv = q.reshape(10, 2, 8)
    out_v, lse_v = attention_ref(qv, k, v, cu_seqlens_q=cu, seqused_q=torch.tensor([2, 5], dtype=torch.int32),
                                 causal=True, return_lse=True)
    ref_o, ref_l = naive_attention(q, k, v, causal=True, q_lens=[2, 5])
    _assert_matches(out_v, lse_v, ref_o.reshape(10, 2, 8), ref_l.permute(1, 0, 2).reshape(2, 10))


def test_key_and_query_padding_masks():
    q, k, v = _qkv(2, 7, 13, 4, 1, 16, seed=9)
    qlens, klens = [7, 4], [9, 13]
    qmask = torch.arange(7)[None, :] < torch.tensor(qlens)[:, None]
    kmask = torch.arange(13)[None, :] < torch.tensor(klens)[:, None]
    for causal in (False, True):
        out, lse = attention_ref(q, k, v, query_padding_mask=qmask, key_padding_mask=kmask, causal=causal,
                                 return_lse=True)
        _assert_matches(out, lse, *naive_attention(q, k, v, causal=causal, q_lens=qlens, k_lens=klens))
        assert torch.all(out[1, 4:] == 0) and torch.all(lse[1, :, 4:] == -math.inf)


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = _qkv(2, 13, 5, 4, 2, 8, seed=10)
    out, lse = attention_ref(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :8] == 0)
    assert torch.all(lse[:, :, :8] == -math.inf)
    assert torch.all(torch.isfinite(lse[:, :, 8:]))
    assert not torch.isnan(out).any()
    # low precision path too
    out_lp, lse_lp = attention_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, upcast=False,
                                   return_lse=True)
    assert torch.all(out_lp[:, :8] == 0) and not torch.isnan(out_lp).any()
    assert torch.all(lse_lp[:, :, :8] == -math.inf)


def test_fp64_compute():
    q, k, v = _qkv(2, 13, 7, 4, 2, 16, dtype=torch.float64, seed=11)
    out, lse = attention_ref(q, k, v, causal=True, softcap=2.0, compute_dtype=torch.float64, return_lse=True)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    _assert_matches(out, lse, *naive_attention(q, k, v, causal=True, softcap=2.0), atol=1e-12)


def test_upcast_false_low_precision():
    q, k, v = _qkv(2, 13, 13, 4, 2, 16, dtype=torch.bfloat16, seed=12)
    hi = attention_ref(q, k, v, causal=True)
    lo, lse_lo = attention_ref(q, k, v, causal=True, upcast=False, return_lse=True)
    assert hi.dtype == torch.float32 and lo.dtype == torch.bfloat16 and lse_lo.dtype == torch.float32
    diff = (lo.float() - hi).abs().max().item()
    assert 0 < diff < 5e-2
    fp16 = attention_ref(q.half(), k.half(), v.half(), upcast=False)
    assert fp16.dtype == torch.float16


def test_descale_float8():
    b, sq, sk, h, hk, d = 2, 7, 13, 4, 2, 16
    q, k, v = _qkv(b, sq, sk, h, hk, d, seed=13)
    g = torch.Generator().manual_seed(14)
    qd, kd, vd = (torch.rand(b, hk, generator=g) + 0.5 for _ in range(3))
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None:
        q8, k8, v8 = q.to(fp8), k.to(fp8), v.to(fp8)
    else:
        q8, k8, v8 = q, k, v
    out, lse = attention_ref(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True, return_lse=True)
    # Dequantize by hand: q head h belongs to kv group h // (h / hk).
    qf = q8.double() * qd.double().repeat_interleave(h // hk, dim=1)[:, None, :, None]
    kf = k8.double() * kd.double()[:, None, :, None]
    vf = v8.double() * vd.double()[:, None, :, None]
    _assert_matches(out, lse, *naive_attention(qf, kf, vf, causal=True))
    # Without descales the result differs, so the scales are really applied.
    assert not torch.allclose(attention_ref(q8, k8, v8, causal=True), out, atol=1e-3)
    lo = attention_ref(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True, upcast=False)
    assert lo.dtype == (torch.bfloat16 if fp8 is not None else torch.float32)
    assert (lo.float() - out).abs().max().item() < 5e-2


def test_chunked_rows_match_unchunked(monkeypatch):
    q, k, v = _qkv(2, 37, 29, 4, 2, 8, seed=15)
    full, lse_full = attention_ref(q, k, v, causal=True, window_size=(5, 3), return_lse=True)
    monkeypatch.setattr(reference_module, "_CHUNK_ELEMENTS", 4 * 29 * 3)  # 3 rows per chunk
    chunked, lse_chunked = attention_ref(q, k, v, causal=True, window_size=(5, 3), return_lse=True)
    # Not bitwise: the matmul may block differently for other row counts.
    torch.testing.assert_close(chunked, full, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse_chunked, lse_full, atol=1e-6, rtol=0)


def test_long_sequence_is_fast_enough():
    q, k, v = _qkv(2, 1024, 1024, 4, 4, 128, seed=16)
    out, lse = attention_ref(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 1024, 4, 128) and torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(k=torch.randn(1, 4, 3, 8), v=torch.randn(1, 4, 3, 8)), "multiple of nheads_k"),
        (dict(k=torch.randn(1, 4, 2, 16), v=torch.randn(1, 4, 2, 8)), "same head dim"),
        (dict(key_padding_mask=torch.ones(1, 5, dtype=torch.bool)), "key_padding_mask"),
        (dict(seqused_k=torch.tensor([9])), "seqused_k"),
        (dict(q_descale=torch.ones(1, 4)), "q_descale"),
        (dict(compute_dtype=torch.float16), "compute_dtype"),
        (dict(window_size=(1, 2, 3)), "window_size"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    args = dict(q=torch.randn(1, 3, 4, 8), k=torch.randn(1, 4, 2, 8), v=torch.randn(1, 4, 2, 8))
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(ValueError, match=match):
        attention_ref(q, k, v, **args)


def test_bad_varlen_arguments_raise():
    q, k = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        attention_ref(q, k, k, cu_seqlens_q=torch.tensor([0, 3, 2], dtype=torch.int32),
                      cu_seqlens_k=torch.tensor([0, 2, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="query_padding_mask"):
        attention_ref(q, k, k, cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32),
                      cu_seqlens_k=torch.tensor([0, 5], dtype=torch.int32),
                      query_padding_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="4-D"):
        attention_ref(q, k, k)


# ---- gradients: the GPU backward tests differentiate attention_ref with autograd ---------------------

def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _grads(fn, q, k, v, dout, dlse):
    """d/d(q, k, v) of <out, dout> + <lse, dlse> (lse terms only where lse is finite)."""
    q, k, v = _leaves(q, k, v)
    out, lse = fn(q, k, v)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout.to(out.dtype), dlse.to(lse.dtype)), allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, (q, k, v))]


@pytest.mark.parametrize("causal,window,softcap", [
    (False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (False, (2, 1), 0.0), (True, (-1, -1), 2.0), (False, (3, 0), 5.0),
])
def test_gradients_match_naive(causal, window, softcap):
    """Autograd through attention_ref (float64) equals autograd through the per-row oracle, out and
    lse both differentiated, with fully masked rows (sq > sk with causal) giving exactly 0 and no NaN."""
    q, k, v = _qkv(2, 7, 5, 4, 2, 8, dtype=torch.float64, seed=21)
    g = torch.Generator().manual_seed(22)
    dout = torch.randn(2, 7, 4, 8, generator=g, dtype=torch.float64)
    dlse = torch.randn(2, 4, 7, generator=g, dtype=torch.float64)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    ref = _grads(lambda q, k, v: attention_ref(q, k, v, compute_dtype=torch.float64, return_lse=True, **kw),
                 q, k, v, dout, dlse)
    oracle = _grads(lambda q, k, v: naive_attention(q, k, v, causal=causal, window=window, softcap=softcap),
                    q, k, v, dout, dlse)
    for name, a, b in zip("qkv", ref, oracle):
        assert torch.isfinite(a).all(), f"d{name} has non-finite entries"
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=f"d{name}")
    if causal:
        assert torch.all(ref[0][:, :2] == 0)  # rows 0 and 1 see no key
    assert ref[0].abs().max() > 0.1 and ref[1].abs().max() > 0.1 and ref[2].abs().max() > 0.1


def test_lse_gradient_is_softmax_weighted_q_gradient():
    """d lse / d q_i = scale * sum_j P_ij k_j: pins the lse path that the dlse GPU test relies on."""
    q, k, v = _qkv(1, 3, 6, 2, 2, 8, dtype=torch.float64, seed=23)
    q = q.requires_grad_(True)
    _, lse = attention_ref(q, k, v, compute_dtype=torch.float64, return_lse=True)
    (dq,) = torch.autograd.grad(lse.sum(), q)
    scale = 8 ** -0.5
    s = torch.einsum("bihd,bjhd->bhij", q.detach(), k) * scale
    p = torch.softmax(s, dim=-1)
    expect = torch.einsum("bhij,bjhd->bihd", p, k) * scale
    torch.testing.assert_close(dq, expect, atol=1e-12, rtol=1e-12)


def test_varlen_gradients_match_per_sequence_gradients():
    lens_q, lens_k = [3, 0, 5, 2], [4, 3, 6, 0]
    cu_q = torch.tensor([0, 3, 3, 8, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 7, 13, 13], dtype=torch.int32)
    g = torch.Generator().manual_seed(24)
    q = torch.randn(12, 4, 8, generator=g, dtype=torch.float64)  # rows 10, 11: in no sequence
    k = torch.randn(13, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(13, 2, 8, generator=g, dtype=torch.float64)
    dout = torch.randn(12, 4, 8, generator=g, dtype=torch.float64)
    dlse = torch.randn(4, 12, generator=g, dtype=torch.float64)
    dq, dk, dv = _grads(lambda q, k, v: attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                                                      compute_dtype=torch.float64, return_lse=True),
                        q, k, v, dout, dlse)
    assert torch.all(dq[10:] == 0) and torch.all(dq[8:10] == 0)  # no sequence; a sequence with no keys
    for b in range(4):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lens_q[b] == 0:
            assert torch.all(dk[ks] == 0) and torch.all(dv[ks] == 0)
            continue
        if lens_k[b] == 0:
            continue
        gq, gk, gv = _grads(lambda q, k, v: attention_ref(q, k, v, causal=True, compute_dtype=torch.float64,
                                                          return_lse=True),
                            q[None, qs], k[None, ks], v[None, ks], dout[None, qs], dlse[None, :, qs])
        torch.testing.assert_close(dq[qs], gq[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(dk[ks], gk[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(dv[ks], gv[0], atol=1e-12, rtol=0)


def test_low_precision_gradients_are_finite_and_close():
    """upcast=False (the tolerance rule's low-precision torch result) differentiates too: finite, exact 0
    on fully masked rows, and near the float64 gradients."""
    q, k, v = _qkv(2, 9, 6, 4, 1, 16, seed=25)
    g = torch.Generator().manual_seed(26)
    dout, dlse = torch.randn(2, 9, 4, 16, generator=g), torch.randn(2, 4, 9, generator=g)
    low = _grads(lambda q, k, v: attention_ref(q, k, v, causal=True, upcast=False, return_lse=True),
                 q.bfloat16(), k.bfloat16(), v.bfloat16(), dout.bfloat16(), dlse)
    ref = _grads(lambda q, k, v: attention_ref(q, k, v, causal=True, compute_dtype=torch.float64, return_lse=True),
                 q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), dout.bfloat16().double(),
                 dlse.double())
    for name, a, b in zip("qkv", low, ref):
        assert a.dtype == torch.bfloat16 and torch.isfinite(a).all(), f"d{name}"
        err = (a.double() - b).abs().max().item()
        assert err <= 0.05 * b.abs().max().item(), f"d{name}: {err}"
    assert torch.all(low[0][:, :3] == 0)
