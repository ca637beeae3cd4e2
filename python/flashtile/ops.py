"""torch.library custom ops: the boundary between PyTorch and the compiled library.

`flashtile::fwd` allocates the outputs, fills the C ABI struct from tensor metadata and enqueues the
kernel on the current torch stream of the tensors' device (so CUDA-graph capture works). Each op has
a fake implementation (shapes only) for torch.compile/export and an autograd registration.
Arguments arrive validated (interface.py).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import _lib, _validate

_DTYPES = {torch.float16: _lib.DTYPE_FP16, torch.bfloat16: _lib.DTYPE_BF16}


class KernelError(RuntimeError):
    """The compiled library rejected or failed a launch."""


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _out_shapes(q: torch.Tensor, v: torch.Tensor, varlen: bool):
    dv = v.shape[-1]
    if varlen:
        total_q, h = q.shape[0], q.shape[1]
        return (total_q, h, dv), (h, total_q)
    b, sq, h = q.shape[0], q.shape[1], q.shape[2]
    return (b, sq, h, dv), (b, h, sq)


@torch.library.custom_op("flashtile::fwd", mutates_args=(), device_types="cuda")
def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
        seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],
        max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
        window_left: int, window_right: int, softcap: float, path: int) -> tuple[torch.Tensor, torch.Tensor]:
    varlen = cu_seqlens_q is not None
    out_shape, lse_shape = _out_shapes(q, v, varlen)
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if k.numel() == 0 or max_seqlen_k == 0:
        # No key anywhere: every row is empty (and TMA cannot describe a zero-row tensor).
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    for name, t in (("q", q), ("k", k), ("v", v)):
        _validate.check_data_alignment(name, t)

    p = _lib.FtFwdParams()
    p.q, p.k, p.v, p.out, p.lse = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()
    if varlen:
        batch = cu_seqlens_q.shape[0] - 1
        p.q_batch_stride, p.q_row_stride, p.q_head_stride = 0, q.stride(0), q.stride(1)
        p.o_batch_stride, p.o_row_stride, p.o_head_stride = 0, out.stride(0), out.stride(1)
        p.lse_batch_stride, p.lse_head_stride = 0, lse.stride(0)
    else:
        batch = q.shape[0]
        p.q_batch_stride, p.q_row_stride, p.q_head_stride = q.stride(0), q.stride(1), q.stride(2)
        p.o_batch_stride, p.o_row_stride, p.o_head_stride = out.stride(0), out.stride(1), out.stride(2)
        p.lse_batch_stride, p.lse_head_stride = lse.stride(0), lse.stride(1)
    if cu_seqlens_k is not None:
        p.k_batch_stride, p.k_row_stride, p.k_head_stride = 0, k.stride(0), k.stride(1)
        p.v_batch_stride, p.v_row_stride, p.v_head_stride = 0, v.stride(0), v.stride(1)
    else:
        p.k_batch_stride, p.k_row_stride, p.k_head_stride = k.stride(0), k.stride(1), k.stride(2)
        p.v_batch_stride, p.v_row_stride, p.v_head_stride = v.stride(0), v.stride(1), v.stride(2)
    p.cu_seqlens_q, p.cu_seqlens_k = _ptr(cu_seqlens_q), _ptr(cu_seqlens_k)
    p.seqused_q, p.seqused_k = _ptr(seqused_q), _ptr(seqused_k)
    p.batch, p.seqlen_q, p.seqlen_k = batch, max_seqlen_q, max_seqlen_k
    p.rows_q = q.shape[0] if varlen else q.shape[1]
    p.rows_k = k.shape[0] if cu_seqlens_k is not None else k.shape[1]
    p.num_heads, p.num_heads_k = q.shape[-2], k.shape[-2]
    p.head_dim, p.head_dim_v = q.shape[-1], v.shape[-1]
    p.softmax_scale, p.softcap = softmax_scale, softcap
    p.window_left, p.window_right, p.is_causal = window_left, window_right, int(causal)
    p.dtype, p.path, p.device = _DTYPES[q.dtype], path, q.device.index
    stream = torch.cuda.current_stream(q.device).cuda_stream
    lib = _lib.lib()
    rc = lib.ft_mha_fwd(ctypes.byref(p), ctypes.c_void_p(stream))
    if rc != _lib.OK:
        msg = _lib.last_error()
        if rc == _lib.NOT_BUILT:
            from .build_config import KernelNotBuiltError, build_config, describe
            raise KernelNotBuiltError(f"flashtile: {msg}. This build has: {describe(build_config())}")
        raise KernelError(f"flashtile forward failed (status {rc}): {msg}")
    return out, lse


@fwd.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_left, window_right, softcap, path):
    out_shape, lse_shape = _out_shapes(q, v, cu_seqlens_q is not None)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    ctx.save_for_backward(q, k, v, *output)


def _fwd_backward(ctx, dout, dlse):
    raise NotImplementedError(
        "flashtile: the attention backward pass is not implemented in this version (forward only); "
        "call the forward under torch.no_grad() or with inputs that do not require grad")


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)
