"""Reference attention in plain PyTorch: the ground truth every kernel is tested against.

`attention_ref` implements FlashAttention-3 forward semantics with explicit, readable math. It depends
only on torch, so it runs on any device, GPU or not, and never touches the compiled library.

Semantics (all exact, all per batch element b):

* scores = (q @ k^T) * softmax_scale, softmax_scale defaulting to 1/sqrt(headdim of q); with
  softcap > 0, scores = softcap * tanh(scores / softcap).
* GQA/MQA: nheads % nheads_k == 0 and query head h reads kv head h // (nheads // nheads_k).
* Lengths: sq_b / sk_b come from cu_seqlens differences (varlen), from the padding masks' row sums
  (padded layout), or from seqused_q / seqused_k, which take precedence over both.
* Key j is visible to query row i iff the key is valid (j < sk_b, or key_padding_mask[b, j]) and, when
  causal or a window is set, i + sk_b - sq_b - wl <= j <= i + sk_b - sq_b + wr (bottom-right
  aligned). causal forces wr = 0; a negative wl or wr leaves that side unbounded.
* A row with no visible key (fully masked) has output exactly 0 and lse = -inf. Query rows that do
  not exist for their element (beyond sq_b, padding, beyond seqused_q, or varlen rows past
  cu_seqlens_q[-1]) are treated the same way: output 0, lse -inf. lse = -inf is the logsumexp of an
  empty set; note that FA2/FA3 kernels store +inf there instead (it makes exp(s - lse) vanish in the
  backward pass), so a caller comparing kernel lse must decide which convention it expects.
* lse is the natural-log logsumexp over visible keys of the scaled, softcapped scores.
* FP8: q/k/v descales have shape (batch, nheads_k); inputs are dequantized as x.float() * descale
  before any math (q_descale[b, g] applies to every query head of kv group g).
* upcast=True does the math in compute_dtype (float32 or float64). upcast=False does the same math
  naively in the input dtype (bfloat16 for float8 inputs, since torch has no float8 matmul): this is
  the "low-precision torch" result of the tolerance rule in flashtile.testing.

Memory stays bounded: the loop runs over batch elements and over chunks of query rows, so no
(seqlen_q x seqlen_k) buffer larger than about 2**25 elements per chunk is ever built.
"""

import math
from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = ["attention_ref", "attention_mask"]

Tensor = torch.Tensor

# Scores elements per chunk (h * rows * seqlen_k); keeps a chunk around 128 MB in float32.
_CHUNK_ELEMENTS = 1 << 25

_LOWP_NATIVE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def attention_mask(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    device: Union[torch.device, str, None] = None,
) -> Tensor:
    """Boolean (seqlen_q, seqlen_k) visibility mask, True = key visible, bottom-right aligned.

    This is the causal/local part of the rule only (no padding): with no causal and no window every
    entry is True.
    """
    wl, wr = _window(causal, window_size)
    return _visible(
        torch.arange(seqlen_q, device=device), seqlen_q, seqlen_k,
        torch.ones(seqlen_k, dtype=torch.bool, device=device), wl, wr,
    )


def attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    query_padding_mask: Optional[Tensor] = None,
    key_padding_mask: Optional[Tensor] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    compute_dtype: torch.dtype = torch.float32,
    upcast: bool = True,
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Exact attention with FlashAttention-3 semantics (see the module docstring).

    Layouts: q (batch, seqlen_q, nheads, d), k (batch, seqlen_k, nheads_k, d), v (batch, seqlen_k,
    nheads_k, dv); with cu_seqlens_q (int, batch + 1) q is (total_q, nheads, d), and with cu_seqlens_k
    k/v are (total_k, nheads_k, d[v]). Each side is chosen independently, so a varlen q may attend to
    a padded k/v (as with a KV cache and seqused_k).

    query_padding_mask (batch, seqlen_q) / key_padding_mask (batch, seqlen_k): bool, True = keep;
    padded layout only. seqused_q / seqused_k (batch,): number of rows of each element that are used.

    Returns out with q's layout and last dim dv, in compute_dtype (upcast=True) or in the input dtype
    (upcast=False; bfloat16 for float8 inputs). With return_lse, also lse: (batch, nheads, seqlen_q)
    padded or (nheads, total_q) varlen, in compute_dtype (float32 when upcast=False).
    """
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype must be torch.float32 or torch.float64, got {compute_dtype}")
    q_varlen, k_varlen = cu_seqlens_q is not None, cu_seqlens_k is not None
    _check_layout("q", q, 3 if q_varlen else 4, "cu_seqlens_q")
    _check_layout("k", k, 3 if k_varlen else 4, "cu_seqlens_k")
    _check_layout("v", v, 3 if k_varlen else 4, "cu_seqlens_k")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree on all but the last dim, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}")
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")

    if q_varlen:
        batch = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    else:
        batch = q.shape[0]
    if k_varlen:
        batch_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    else:
        batch_k = k.shape[0]
    if batch_k != batch:
        raise ValueError(f"q describes {batch} batch elements but k/v describe {batch_k}")
    if q_varlen and query_padding_mask is not None:
        raise ValueError("query_padding_mask is for the padded layout; use cu_seqlens_q/seqused_q with varlen q")
    if k_varlen and key_padding_mask is not None:
        raise ValueError("key_padding_mask is for the padded layout; use cu_seqlens_k/seqused_k with varlen k")
    if not q_varlen:
        _check_shape("query_padding_mask", query_padding_mask, (batch, q.shape[1]))
    if not k_varlen:
        _check_shape("key_padding_mask", key_padding_mask, (batch, k.shape[1]))
    _check_shape("seqused_q", seqused_q, (batch,))
    _check_shape("seqused_k", seqused_k, (batch,))
    for name, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        _check_shape(name, d, (batch, nheads_k))

    wl, wr = _window(causal, window_size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    softcap = float(softcap)
    if upcast:
        work_dtype, lse_dtype = compute_dtype, compute_dtype
    else:
        work_dtype = q.dtype if q.dtype in _LOWP_NATIVE else torch.bfloat16
        lse_dtype = torch.float32
    group = nheads // nheads_k
    device = q.device

    dv = v.shape[-1]
    out = torch.zeros(*q.shape[:-1], dv, dtype=work_dtype, device=device)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=lse_dtype, device=device)  # rows, heads layout for now

    cu_q = cu_seqlens_q.tolist() if q_varlen else None
    cu_k = cu_seqlens_k.tolist() if k_varlen else None
    used_q = seqused_q.tolist() if seqused_q is not None else None
    used_k = seqused_k.tolist() if seqused_k is not None else None
    for b in range(batch):
        q_rows = slice(cu_q[b], cu_q[b + 1]) if q_varlen else b
        k_rows = slice(cu_k[b], cu_k[b + 1]) if k_varlen else b
        qb, kb, vb = q[q_rows], k[k_rows], v[k_rows]
        q_valid = _valid_rows("seqused_q", qb.shape[0], used_q, query_padding_mask, b, device)
        k_valid = _valid_rows("seqused_k", kb.shape[0], used_k, key_padding_mask, b, device)
        if qb.shape[0] == 0 or not bool(q_valid.any()):
            continue
        qb = _dequantize(qb, q_descale, b, group, work_dtype, upcast)
        kb = _dequantize(kb, k_descale, b, 1, work_dtype, upcast)
        vb = _dequantize(vb, v_descale, b, 1, work_dtype, upcast)
        ob, lb = _attend(qb, kb, vb, q_valid, k_valid, scale, softcap, wl, wr, upcast)
        out[q_rows] = ob
        lse[q_rows] = lb.to(lse_dtype)

    if not return_lse:
        return out
    # (b, sq, h) -> (b, h, sq); (total_q, h) -> (h, total_q)
    lse = lse.transpose(-1, -2).contiguous()
    return out, lse


def _window(causal: bool, window_size: Sequence[int]) -> Tuple[int, int]:
    if len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    wl, wr = int(window_size[0]), int(window_size[1])
    if causal:
        wr = 0
    return wl, wr


def _visible(rows: Tensor, sq_len: int, sk_len: int, k_valid: Tensor, wl: int, wr: int) -> Tensor:
    """(len(rows), len(k_valid)) bool: key validity plus the bottom-right aligned window."""
    j = torch.arange(k_valid.shape[0], device=k_valid.device)[None, :]
    i = rows[:, None]
    vis = k_valid[None, :].expand(rows.shape[0], -1)
    shift = sk_len - sq_len
    if wl >= 0:
        vis = vis & (j >= i + shift - wl)
    if wr >= 0:
        vis = vis & (j <= i + shift + wr)
    return vis


def _valid_rows(name: str, n: int, used: Optional[list], padding_mask: Optional[Tensor], b: int, device) -> Tensor:
    if used is not None:
        if not 0 <= used[b] <= n:
            raise ValueError(f"{name}[{b}] = {used[b]} is outside [0, {n}] (rows available for that element)")
        return torch.arange(n, device=device) < used[b]
    if padding_mask is not None:
        return padding_mask[b].to(device=device, dtype=torch.bool)
    return torch.ones(n, dtype=torch.bool, device=device)


def _dequantize(x: Tensor, descale: Optional[Tensor], b: int, group: int, work_dtype: torch.dtype, upcast: bool) -> Tensor:
    """(rows, heads, d) in work_dtype; descale row b is (nheads_k,), repeated over each kv group."""
    if descale is None:
        return x.to(work_dtype)
    s = descale[b].to(device=x.device).repeat_interleave(group)[None, :, None]
    if upcast:
        return x.to(work_dtype) * s.to(work_dtype)
    return (x.float() * s.float()).to(work_dtype)


def _attend(qb, kb, vb, q_valid, k_valid, scale, softcap, wl, wr, upcast):
    """One batch element. qb (sq, h, d), kb (sk, hk, d), vb (sk, hk, dv) -> out (sq, h, dv), lse (sq, h)."""
    sq, h, _ = qb.shape
    sk, hk, dv = vb.shape
    g = h // hk
    sq_len, sk_len = int(q_valid.sum()), int(k_valid.sum())
    out = torch.zeros(sq, h, dv, dtype=qb.dtype, device=qb.device)
    lse = torch.full((sq, h), -math.inf, dtype=torch.float64 if qb.dtype == torch.float64 else torch.float32,
                     device=qb.device)
    if sk == 0:
        return out, lse
    # Group query heads by kv head so GQA needs no copy of k/v: (hk, g, sq, d) @ (hk, 1, d, sk).
    qh = qb.permute(1, 0, 2).reshape(hk, g, sq, -1)
    kt = kb.permute(1, 2, 0).unsqueeze(1)
    vh = vb.permute(1, 0, 2).unsqueeze(1)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, h * sk))
    for r0 in range(0, sq, chunk):
        r1 = min(sq, r0 + chunk)
        rows = torch.arange(r0, r1, device=qb.device)
        vis = _visible(rows, sq_len, sk_len, k_valid, wl, wr) & q_valid[r0:r1, None]
        s = torch.matmul(qh[:, :, r0:r1], kt) * scale
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~vis, -math.inf)
        if upcast:
            o, l = _softmax_pv(s, vh)
        else:
            # Naive low precision: softmax and P @ V in the input dtype, as a plain torch user would.
            p = torch.softmax(s, dim=-1).masked_fill(~vis, 0.0)  # fully masked rows: NaN -> 0
            o = torch.matmul(p.to(vh.dtype), vh)
            l = torch.logsumexp(s.float(), dim=-1)
        out[r0:r1] = o.reshape(h, r1 - r0, dv).transpose(0, 1)
        lse[r0:r1] = l.reshape(h, r1 - r0).transpose(0, 1).to(lse.dtype)
    return out, lse


def _softmax_pv(s: Tensor, vh: Tensor) -> Tuple[Tensor, Tensor]:
    """softmax(s) @ v and logsumexp(s) over the last dim, exact 0 / -inf for all -inf rows."""
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)  # masked entries: exp(-inf) = 0
    denom = p.sum(dim=-1, keepdim=True)
    has_keys = denom > 0
    o = torch.matmul(p, vh)
    o = torch.where(has_keys, o / torch.where(has_keys, denom, torch.ones_like(denom)), torch.zeros_like(o))
    lse = torch.where(has_keys, m + torch.log(denom), torch.full_like(denom, -math.inf))
    return o, lse.squeeze(-1)


def _check_layout(name: str, t: Tensor, ndim: int, cu_name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        expect = "(total, heads, headdim) with " if ndim == 3 else "(batch, seqlen, heads, headdim) without "
        raise ValueError(f"{name} must be {ndim}-D {expect}{cu_name}, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _check_cu_seqlens(name: str, cu: Tensor, total: int) -> int:
    if cu.dim() != 1 or cu.numel() < 1 or cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32 tensor of length batch + 1, got {cu.dtype} {tuple(cu.shape)}")
    vals = cu.tolist()
    if vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])) or vals[-1] > total:
        raise ValueError(f"{name} must start at 0, be non-decreasing and end at <= {total}, got {vals}")
    return len(vals) - 1


def _check_shape(name: str, t: Optional[Tensor], shape: Tuple[int, ...]) -> None:
    if t is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
