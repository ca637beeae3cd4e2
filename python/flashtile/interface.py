"""The public API, signature-compatible with FlashAttention-3's `flash_attn_interface`.

Each function validates its arguments (_validate.py), checks that a kernel for the request was built
(build_config.py), then calls the `flashtile::fwd` custom op, whose autograd runs `flashtile::bwd`
(`deterministic=True` makes that backward pass bitwise reproducible). Features that are not
implemented yet raise NotImplementedError naming the feature; nothing falls back to a slower path
silently.
Extensions beyond FA3 are keyword-only arguments whose defaults keep FA3's behaviour:
  path: "auto" (Hopper kernels on sm_90 when built, else the Ampere path) | "ampere" | "hopper".
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from . import _lib
from . import _validate as V
from .build_config import require_kernel
from .ops import _eager, _remember
from .ops import attention as _fwd_op
from .ops import attention_eager as _fwd_op_eager


def _resolve_path(path: str) -> int:
    if path not in _lib.PATHS:
        raise ValueError(f"flashtile: path must be one of {sorted(_lib.PATHS)}, got {path!r}")
    return _lib.PATHS[path]


def _check_unsupported(qv, attention_chunk, num_splits) -> None:
    if qv is not None:
        V.not_implemented("qv (extra query-value term)")
    if attention_chunk:
        V.not_implemented("attention_chunk")
    if num_splits is not None and num_splits > 1:
        V.not_implemented(f"split-KV (num_splits={num_splits})")


# Calls whose tensor metadata and arguments were validated before -> the op's validated scalar
# arguments. Validation reads metadata only, so an equal key passes the same checks; base addresses (the
# one per-call property) are checked by the op itself. Eager calls only (traced calls keep every check
# visible to the tracer).
_validated: dict = {}


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _validated_key(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal, window_size, softcap, path, deterministic, pack_gqa, num_splits):
    try:
        return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape,
                v.stride(), v.dtype, v.device, _meta(cu_seqlens_q), _meta(cu_seqlens_k), _meta(seqused_q),
                _meta(seqused_k), max_seqlen_q, max_seqlen_k, softmax_scale, bool(causal), tuple(window_size),
                float(softcap), path, bool(deterministic), pack_gqa, num_splits)
    except (AttributeError, TypeError, ValueError):
        return None  # not tensors / odd arguments: the full checks report them


def _forward(q, k, v, *, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
             softmax_scale, causal, window_size, softcap, descales, path, deterministic=False, pack_gqa=None,
             num_splits=0, names=("k", "v", "seqused_k")):
    """Shared validation + dispatch for the padded and packed layouts. num_splits: None or <= 0 (as in
    FA3, the library's choice: it may split the last partial wave's tiles along the keys) or 1 (never
    split); larger values are rejected by the callers (_check_unsupported). names: what the caller
    calls k, v and seqused_k, for error messages (flash_attn_with_kvcache has k and v arguments of its
    own, the keys to append)."""
    key = None
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        V._fail("pack_gqa", f"must be None (heuristic), True or False, got {pack_gqa!r}")
    pack = 0 if pack_gqa is None else (1 if pack_gqa else -1)
    if num_splits is None or num_splits <= 0:
        splits = 0
    elif num_splits == 1:
        splits = 1
    else:
        V._fail("num_splits", f"must be None, 0 (the library's choice) or 1 (never split), got {num_splits!r}")
    if descales == (None, None, None) and _eager(q, k, v):
        key = _validated_key(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                             softmax_scale, causal, window_size, softcap, path, deterministic, pack, splits)
        args = _validated.get(key) if key is not None else None
        if args is not None:
            return _fwd_op_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *args)
    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    k_name, v_name, seqused_k_name = names
    V.check_tensor("q", q, 3 if varlen_q else 4)
    V.check_tensor(k_name, k, 3 if varlen_k else 4)
    V.check_tensor(v_name, v, 3 if varlen_k else 4)
    dtype = V.dtype_name(q, k, v, ("q", k_name, v_name))
    nheads, d = q.shape[-2], q.shape[-1]
    nheads_k, dv = k.shape[-2], v.shape[-1]
    V.check_head_dims(d, dv)
    if k.shape[-1] != d:
        V._fail(k_name, f"head dim ({k.shape[-1]}) must equal q's ({d})")
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        V._fail(v_name, f"shape {tuple(v.shape)} must match {k_name}'s {tuple(k.shape)} except the last dim")
    V.check_heads(nheads, nheads_k, k_name)
    if varlen_q:
        batch = cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor) and cu_seqlens_q.dim() == 1 else -1
        if batch < 0:
            V._fail("cu_seqlens_q", "must be a 1-D int32 tensor of length batch + 1")
        V.check_int32_vector("cu_seqlens_q", cu_seqlens_q, batch + 1)
        if max_seqlen_q is None or max_seqlen_q < 0:
            V._fail("max_seqlen_q", f"must be given as an int >= 0 with cu_seqlens_q, got {max_seqlen_q}")
    else:
        batch = q.shape[0]
        max_seqlen_q = q.shape[1]
    if varlen_k:
        V.check_int32_vector("cu_seqlens_k", cu_seqlens_k, batch + 1)
        if max_seqlen_k is None or max_seqlen_k < 0:
            V._fail("max_seqlen_k", f"must be given as an int >= 0 with cu_seqlens_k, got {max_seqlen_k}")
    else:
        if k.shape[0] != batch:
            V._fail(k_name, f"batch size {k.shape[0]} must equal q's ({batch})")
        max_seqlen_k = k.shape[1]
    V.check_int32_vector("seqused_q", seqused_q, batch)
    V.check_int32_vector(seqused_k_name, seqused_k, batch)
    left, right = V.check_window(window_size)
    softcap = float(softcap)
    V.check_softcap(softcap)
    V.check_descales(batch, nheads_k, q, descales)
    for name, t in (("q", q), (k_name, k), (v_name, v)):
        V.check_alignment(name, t)
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    V.check_softmax_scale(float(softmax_scale))
    if causal:
        right = 0
    band = causal or left >= 0 or right >= 0
    path_id = _resolve_path(path)
    V.check_same_device({"q": q, k_name: k, v_name: v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
                         "seqused_q": seqused_q, seqused_k_name: seqused_k})
    if not torch.compiler.is_compiling():
        # Reads build_config.json: not traceable; under torch.compile the op itself reports a missing kernel.
        require_kernel(op="fwd", dtype=dtype, head_dim=d, head_dim_v=dv, band=band, softcap=softcap > 0, path=path)
    args = (int(max_seqlen_q), int(max_seqlen_k), float(softmax_scale), bool(causal), left, right, softcap, path_id,
            bool(deterministic), pack, splits)
    if key is not None:
        _remember(_validated, key, args)
    return _fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *args)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=0,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False, *, path="auto"):
    """Attention over q (batch, seqlen_q, nheads, d), k/v (batch, seqlen_k, nheads_k, d[_v]).

    causal masks are bottom-right aligned; window_size=(left, right) keeps keys j with
    i + sk - sq - left <= j <= i + sk - sq + right (-1 = unbounded); rows that see no key give 0 and
    lse -inf (the logsumexp of no scores; FA2/FA3 store +inf there).
    Returns out, or (out, softmax_lse) with lse (batch, nheads, seqlen_q) if return_attn_probs.
    Differentiable (w.r.t. q, k, v, through out and lse); deterministic=True makes the backward pass
    bitwise reproducible (dq accumulated in a fixed order; somewhat slower).
    num_splits defaults to 0 (FA3: 1), which lets flashtile split the last partial wave's tiles along the
    keys (equal to the unsplit result up to fp32 rounding, deterministic run to run); 1 never splits.
    """
    _check_unsupported(qv, attention_chunk, num_splits)
    out, lse = _forward(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, descales=(q_descale, k_descale, v_descale),
                        path=path, deterministic=deterministic, pack_gqa=pack_gqa, num_splits=num_splits)
    return (out, lse) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                           k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                           num_splits=0, pack_gqa=None, deterministic=False, sm_margin=0,
                           return_attn_probs=False, *, path="auto"):
    """Packed variable-length batches: q (total_q, nheads, d), k/v (total_k, nheads_k, d[_v]),
    cu_seqlens_* int32 (batch + 1). max_seqlen_q/k must bound every sequence. Zero-length sequences
    are allowed. Returns out (total_q, nheads, d_v), or (out, lse) with lse (nheads, total_q).
    Differentiable like flash_attn_func (deterministic: bitwise reproducible backward pass); gradients
    of rows outside every sequence are 0. num_splits defaults to 0 (FA3: 1) as in flash_attn_func (the
    tail split applies to fixed-length batches only, so packed calls run unsplit either way).
    """
    _check_unsupported(qv, attention_chunk, num_splits)
    if cu_seqlens_q is None or cu_seqlens_k is None:
        V._fail("cu_seqlens_q/cu_seqlens_k", "are required by flash_attn_varlen_func")
    out, lse = _forward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                        seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                        descales=(q_descale, k_descale, v_descale), path=path, deterministic=deterministic,
                        pack_gqa=pack_gqa, num_splits=num_splits)
    return (out, lse) if return_attn_probs else out


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None,
                              v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                              deterministic=False, num_heads_q=None, sm_margin=0, return_attn_probs=False, *,
                              path="auto"):
    """qkv (batch, seqlen, 3, nheads, d), or (batch, seqlen, nheads_q + 2 * nheads_k, d) with num_heads_q
    for GQA. q, k and v are strided views of qkv (no copies)."""
    V.check_tensor("qkv", qkv, qkv.dim() if isinstance(qkv, torch.Tensor) and qkv.dim() in (4, 5) else 5)
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            V._fail("qkv", f"must have shape (batch, seqlen, 3, nheads, d), got {tuple(qkv.shape)}")
        q, k, v = qkv.unbind(dim=2)
    else:
        if num_heads_q is None:
            V._fail("num_heads_q", "is required when qkv has shape (batch, seqlen, nheads_q + 2 * nheads_k, d)")
        if not hasattr(num_heads_q, "__index__") or num_heads_q <= 0:
            # 0 would pass every later check and return an empty output (q with no heads).
            V._fail("num_heads_q", f"must be a positive int, got {num_heads_q!r}")
        nk2 = qkv.shape[2] - num_heads_q
        if nk2 <= 0 or nk2 % 2:
            V._fail("num_heads_q", f"({num_heads_q}) leaves {nk2} heads for k and v; expected an even positive count")
        q, k, v = qkv.split([num_heads_q, nk2 // 2, nk2 // 2], dim=2)
    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, q_descale=q_descale,
                           k_descale=k_descale, v_descale=v_descale, window_size=window_size,
                           attention_chunk=attention_chunk, softcap=softcap, deterministic=deterministic,
                           sm_margin=sm_margin, return_attn_probs=return_attn_probs, path=path)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None, cache_batch_idx=None,
                            cache_leftpad=None, page_table=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
                            max_seqlen_q=None, rotary_seqlens=None, q_descale=None, k_descale=None,
                            v_descale=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                            attention_chunk=0, softcap=0.0, rotary_interleaved=True, scheduler_metadata=None,
                            num_splits=0, pack_gqa=None, sm_margin=0, return_softmax_lse=False, *, path="auto"):
    """Attention of q against a KV cache (batch_cache, seqlen_cache, nheads_k, d) whose valid length per
    batch element is cache_seqlens. Implemented: contiguous caches, int or int32-tensor cache_seqlens,
    causal/local/softcap/GQA, varlen q. Not yet: appending k/v, rotary, paged caches (page_table),
    cache_batch_idx, cache_leftpad, split-KV."""
    for name, val in (("appending new keys/values (k, v)", k if k is not None else v),
                      ("rotary embedding (rotary_cos/rotary_sin)", rotary_cos if rotary_cos is not None else rotary_sin),
                      ("paged KV cache (page_table)", page_table), ("cache_batch_idx", cache_batch_idx),
                      ("cache_leftpad", cache_leftpad), ("scheduler_metadata", scheduler_metadata),
                      ("cu_seqlens_k_new", cu_seqlens_k_new), ("rotary_seqlens", rotary_seqlens)):
        if val is not None:
            V.not_implemented(f"flash_attn_with_kvcache: {name}")
    _check_unsupported(qv, attention_chunk, num_splits)
    V.check_tensor("k_cache", k_cache, 4)
    V.check_tensor("v_cache", v_cache, 4)
    batch = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else q.shape[0]
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= k_cache.shape[1]:
            V._fail("cache_seqlens", f"({cache_seqlens}) must be in [0, {k_cache.shape[1]}]")
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=k_cache.device)
    if k_cache.shape[0] != batch:
        V._fail("k_cache", f"batch size {k_cache.shape[0]} must equal q's ({batch}) without cache_batch_idx")
    out, lse = _forward(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=None, seqused_q=None,
                        seqused_k=cache_seqlens, max_seqlen_q=max_seqlen_q, max_seqlen_k=None,
                        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                        descales=(q_descale, k_descale, v_descale), path=path, deterministic=False,
                        pack_gqa=pack_gqa, num_splits=num_splits, names=("k_cache", "v_cache", "cache_seqlens"))
    return (out, lse) if return_softmax_lse else out


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merges split-KV partial results: out_partial (num_splits, ..., nheads, d) fp32 and lse_partial
    (num_splits, ..., nheads) fp32 (FA3 layout: (num_splits, batch, seqlen, nheads[, d])).
    Returns (out, lse) with lse (..., nheads). Computed with PyTorch ops (exact; not a fused kernel)."""
    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flashtile: {name} must be a torch.Tensor")
        if t.dtype != torch.float32:
            V._fail(name, f"must be torch.float32, got {t.dtype}")
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        V._fail("lse_partial", f"shape {tuple(lse_partial.shape)} must equal out_partial's without the last dim "
                               f"{tuple(out_partial.shape[:-1])}")
    lse = torch.logsumexp(lse_partial, dim=0)
    # Splits that saw no key have lse -inf; a row where all did gets weight 0 everywhere (output 0).
    safe = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)
    weights = torch.exp(lse_partial - safe.unsqueeze(0))
    merged = (weights.unsqueeze(-1) * out_partial).sum(dim=0)
    dtype = out_dtype or (out.dtype if out is not None else out_partial.dtype)
    if out is not None:
        if tuple(out.shape) != tuple(merged.shape):
            V._fail("out", f"must have shape {tuple(merged.shape)}, got {tuple(out.shape)}")
        out.copy_(merged)
        return out, lse
    return merged.to(dtype), lse


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens: torch.Tensor, qkv_dtype=torch.bfloat16, headdim_v=None,
                           cu_seqlens_q=None, cu_seqlens_k_new=None, cache_leftpad=None, page_size=None,
                           max_seqlen_k_new=0, causal=False, window_size=(-1, -1), attention_chunk=0,
                           has_softcap=False, num_splits=0, pack_gqa=None, sm_margin=0):
    """Precomputed split-KV schedule for flash_attn_with_kvcache (FA3). Not available yet."""
    V.not_implemented("get_scheduler_metadata (split-KV scheduling)")
