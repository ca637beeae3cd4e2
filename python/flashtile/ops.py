"""torch.library custom ops: the boundary between PyTorch and the compiled library.

`flashtile::fwd` allocates the outputs, fills the C ABI struct from tensor metadata and enqueues the
kernel on the current torch stream of the tensors' device (so CUDA-graph capture works).
`flashtile::bwd` does the same for the backward pass; its fp32 workspaces (dq accumulator, softmax
row sums, log2-scaled LSE, deterministic-mode semaphores) come from torch's caching allocator too.
Each op has a fake implementation (shapes only) for torch.compile/export; `flashtile::fwd`'s
autograd registration calls `flashtile::bwd`. Arguments arrive validated (interface.py).
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch

from . import _lib, _validate
from .build_config import head_dim_bucket

_DTYPES = {torch.float16: _lib.DTYPE_FP16, torch.bfloat16: _lib.DTYPE_BF16}


class KernelError(RuntimeError):
    """The compiled library rejected or failed a launch."""


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) element strides of a (b, s, h, d) tensor, or of a packed (total, h, d) one
    (batch stride 0: the kernels ignore it there)."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    """(batch, head) strides of lse: (b, h, sq) padded, (h, total_q) varlen; the row stride is 1."""
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def _out_shapes(q: torch.Tensor, v: torch.Tensor, varlen: bool):
    dv = v.shape[-1]
    if varlen:
        total_q, h = q.shape[0], q.shape[1]
        return (total_q, h, dv), (h, total_q)
    b, sq, h = q.shape[0], q.shape[1], q.shape[2]
    return (b, sq, h, dv), (b, h, sq)


def _batch(q: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor]) -> int:
    return cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else q.shape[0]


def _check_data_alignment(q, k, v) -> None:
    """Base addresses, the one per-call property a cached plan cannot vouch for."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _validate.check_data_alignment(name, t)


def _fill_fwd_params(p: _lib.FtFwdParams, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                     max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                     path, pack_gqa=0, num_splits=0) -> None:
    """The forward call's description (FtFwdParams), shared by the forward and the backward op (the
    scheduler workspaces, tile_counter and split_accum, are the forward's and set per call)."""
    _check_data_alignment(q, k, v)
    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    p.q, p.k, p.v, p.out, p.lse = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()
    p.q_batch_stride, p.q_row_stride, p.q_head_stride = _strides(q, varlen_q)
    p.o_batch_stride, p.o_row_stride, p.o_head_stride = _strides(out, varlen_q)
    p.lse_batch_stride, p.lse_head_stride = _lse_strides(lse, varlen_q)
    p.k_batch_stride, p.k_row_stride, p.k_head_stride = _strides(k, varlen_k)
    p.v_batch_stride, p.v_row_stride, p.v_head_stride = _strides(v, varlen_k)
    _set_seq_pointers(p, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    p.batch, p.seqlen_q, p.seqlen_k = _batch(q, cu_seqlens_q), max_seqlen_q, max_seqlen_k
    p.rows_q = q.shape[0] if varlen_q else q.shape[1]
    p.rows_k = k.shape[0] if varlen_k else k.shape[1]
    p.num_heads, p.num_heads_k = q.shape[-2], k.shape[-2]
    p.head_dim, p.head_dim_v = q.shape[-1], v.shape[-1]
    p.softmax_scale, p.softcap = softmax_scale, softcap
    p.window_left, p.window_right, p.is_causal = window_left, window_right, int(causal)
    p.dtype, p.path, p.device = _DTYPES[q.dtype], path, q.get_device()  # CUDA ordinal
    p.pack_gqa = pack_gqa
    p.num_splits = num_splits


# Calls by their metadata -> (for the forward) the outputs' shapes, an FtFwdParams holding everything
# but the data and workspace pointers, which are filled per call (filling ~40 ctypes fields costs more
# than the rest of the host path), and the bytes of split_accum scratch the call gets (0: none; the size
# comes from the library). out and lse are fresh contiguous tensors whose shapes follow from q and v,
# and the struct reads cu_seqlens_* / seqused_* only through their pointers and cu_seqlens_q's length
# (the batch), so the tensors' metadata and the scalar arguments decide the rest of the struct.
_fwd_plans: dict = {}
_bwd_plans: dict = {}
_PLANS_MAX = 1024


def _remember(plans: dict, key, plan, limit: int = _PLANS_MAX):
    """plans[key] = plan, in a cache cleared whenever it reaches `limit` entries; returns plan."""
    if len(plans) >= limit:
        plans.clear()
    plans[key] = plan
    return plan


def _current_stream(device: torch.device) -> int:
    """The cudaStream_t of torch's current stream on `device` (a separate function so that CPU tests
    can substitute it). torch's raw getter: building the Stream object of torch.cuda.current_stream
    costs ~5 us per call (measured on an H100 host)."""
    return torch._C._cuda_getCurrentRawStream(device.index)


def _launch(entry: str, params: ctypes.Structure, device: torch.device, what: str) -> None:
    """Calls lib.<entry>(&params, stream) and maps a nonzero status to a Python exception."""
    stream = _current_stream(device)
    lib = _lib.lib()
    rc = getattr(lib, entry)(ctypes.byref(params), ctypes.c_void_p(stream))
    if rc != _lib.OK:
        msg = _lib.last_error()
        if rc == _lib.NOT_BUILT:
            from .build_config import KernelNotBuiltError, build_config, describe
            raise KernelNotBuiltError(f"flashtile: {msg}. This build has: {describe(build_config())}")
        raise KernelError(f"flashtile {what} failed (status {rc}): {msg}")


# ---- forward -----------------------------------------------------------------------------------------

# The forward scheduler's workspace (FtFwdParams.tile_counter: FT_FWD_COUNTERS int32, the tile counter
# and the tail split's per-tile counters). Eager calls on the current device share one per (device,
# stream), kept at zero: each launch leaves it zero (tile_counter_zeroed), and the launches on one stream
# run in order, whichever thread enqueues them. A call under stream capture (its graph may be replayed
# beside eager calls on any stream) or for another device than the current one takes a fresh workspace
# from torch's allocator, which the launch clears.
_kept_counters: dict = {}
_KEPT_COUNTERS_MAX = 64
# The tail split's fp32 scratch (FtFwdParams.split_accum, any content), kept per (device, stream) on the
# same terms as the counters and grown to the largest size a call on that stream has needed.
_kept_split_accums: dict = {}
# (device index, head_dim, head_dim_v) -> ft_fwd_split_accum_bytes (a call into the library).
_split_accum_sizes: dict = {}


def _kept_key(device: torch.device):
    """(device index, stream) of the kept workspaces a forward launch on device's current stream uses,
    or None where it takes fresh ones (another device than the current one, stream capture)."""
    if (device.type == "cuda" and device.index == torch._C._cuda_getDevice()
            and not torch._C._cuda_isCurrentStreamCapturing()):
        return device.index, _current_stream(device)
    return None


def _fwd_workspaces(device: torch.device, split_bytes: int):
    """(tile_counter, FtFwdParams.tile_counter_zeroed, split_accum or None) for a forward launch on
    device's current stream; split_accum holds at least split_bytes (None for 0)."""
    key = _kept_key(device)
    if key is not None:
        counter = _kept_counters.get(key)
        if counter is None:
            # A workspace dropped with the cache returns to its own stream's pool, after its launches.
            counter = _remember(_kept_counters, key,
                                torch.zeros(_lib.FWD_COUNTERS, dtype=torch.int32, device=device), _KEPT_COUNTERS_MAX)
        scratch = None
        if split_bytes > 0:
            scratch = _kept_split_accums.get(key)
            if scratch is None or 4 * scratch.numel() < split_bytes:
                # A buffer replaced or dropped returns to its own stream's pool, after its launches.
                scratch = _remember(_kept_split_accums, key, _fp32_scratch(split_bytes, device), _KEPT_COUNTERS_MAX)
        return counter, 1, scratch
    counter = torch.empty(_lib.FWD_COUNTERS, dtype=torch.int32, device=device)
    return counter, 0, (_fp32_scratch(split_bytes, device) if split_bytes > 0 else None)


def _fp32_scratch(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(-(-nbytes // 4), dtype=torch.float32, device=device)


def _split_accum_bytes(device_index: int, head_dim: int, head_dim_v: int) -> int:
    """ft_fwd_split_accum_bytes(device_index, head_dim, head_dim_v), asked of the library once each."""
    key = (device_index, head_dim, head_dim_v)
    nbytes = _split_accum_sizes.get(key)
    if nbytes is None:
        nbytes = _remember(_split_accum_sizes, key, int(_lib.lib().ft_fwd_split_accum_bytes(device_index, head_dim, head_dim_v)))
    return nbytes


def _may_split(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, causal, window_left, window_right, path,
               num_splits) -> bool:
    """Whether the library may split the tail of this forward call (num_splits 0, no band mask,
    fixed-length batches, not the Ampere path): only such calls get split_accum scratch."""
    return (num_splits == 0 and not causal and window_left < 0 and window_right < 0 and cu_seqlens_q is None
            and cu_seqlens_k is None and seqused_q is None and seqused_k is None and path != _lib.PATHS["ampere"])


def _plan_key(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *scalars):
    """What decides a call's struct apart from its data pointers (see _fwd_plans)."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device,
            None if cu_seqlens_q is None else cu_seqlens_q.shape[0], cu_seqlens_k is None, seqused_q is None,
            seqused_k is None, *scalars)


def _set_seq_pointers(p: _lib.FtFwdParams, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) -> None:
    p.cu_seqlens_q, p.cu_seqlens_k = _ptr(cu_seqlens_q), _ptr(cu_seqlens_k)
    p.seqused_q, p.seqused_k = _ptr(seqused_q), _ptr(seqused_k)


def _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_left, window_right, softcap, path, pack_gqa=0, num_splits=0):
    key = _plan_key(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window_left, window_right, softcap, path, pack_gqa, num_splits)
    plan = _fwd_plans.get(key)
    if plan is not None:
        out_shape, lse_shape, template, split_bytes = plan
    else:
        out_shape, lse_shape = _out_shapes(q, v, cu_seqlens_q is not None)
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if plan is not None:
        _check_data_alignment(q, k, v)
        p = _lib.FtFwdParams.from_buffer_copy(template)
        p.q, p.k, p.v, p.out, p.lse = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()
        _set_seq_pointers(p, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    else:
        if out.numel() == 0:
            return out, lse
        if k.numel() == 0 or max_seqlen_k == 0:
            # No key anywhere: every row is empty (and TMA cannot describe a zero-row tensor).
            out.zero_()
            lse.fill_(float("-inf"))
            return out, lse
        p = _lib.FtFwdParams()
        _fill_fwd_params(p, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                         max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, path, pack_gqa,
                         num_splits)
        split_bytes = 0
        if _may_split(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, causal, window_left, window_right, path,
                      num_splits):
            split_bytes = _split_accum_bytes(p.device, p.head_dim, p.head_dim_v)
        _remember(_fwd_plans, key, (out_shape, lse_shape, _lib.FtFwdParams.from_buffer_copy(p), split_bytes))
    # Fresh workspaces are held here until the launch is enqueued (torch's allocator orders their reuse
    # after it on this stream).
    tile_counter, p.tile_counter_zeroed, split_accum = _fwd_workspaces(q.device, split_bytes)
    p.tile_counter = tile_counter.data_ptr()
    if split_accum is not None:  # else the template's NULL and 0 bytes
        p.split_accum, p.split_accum_bytes = split_accum.data_ptr(), split_bytes
    _launch("ft_mha_fwd", p, q.device, "forward")
    return out, lse


@torch.library.custom_op("flashtile::fwd", mutates_args=(), device_types="cuda")
def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
        seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],
        max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
        window_left: int, window_right: int, softcap: float, path: int,
        deterministic: bool = False, pack_gqa: int = 0, num_splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward: (out, lse). `deterministic` is not used by the forward (which is always
    deterministic); it selects the deterministic backward pass of this call. pack_gqa: FtFwdParams's
    (0 heuristic, 1 pack the query heads of a GQA group into one tile, -1 never). num_splits:
    FtFwdParams's (0: the library may split the last partial wave's tiles along the keys, equal up to
    the fp32 rounding of their combine; 1: never split)."""
    return _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, window_left, window_right, softcap, path, pack_gqa, num_splits)


@fwd.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_left, window_right, softcap, path, deterministic=False, pack_gqa=0,
              num_splits=0):
    out_shape, lse_shape = _out_shapes(q, v, cu_seqlens_q is not None)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


# ---- backward ----------------------------------------------------------------------------------------

def _kernel_readable(t: torch.Tensor) -> torch.Tensor:
    """t when the kernels can read it through its own strides (unit last-dim stride, other strides
    positive multiples of 16 bytes, 16-byte aligned base address), else a contiguous copy. Gradients
    from autograd are often expanded (stride 0, e.g. from out.sum()) or otherwise strided views."""
    elems = 16 // t.element_size()
    if (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(n <= 1 or (s > 0 and s % elems == 0) for n, s in zip(t.shape[:-1], t.stride()[:-1]))):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _grad_buffer(like: torch.Tensor, zero: bool) -> torch.Tensor:
    """A contiguous tensor of like's shape and dtype (the layout the fake implementation promises)."""
    make = torch.zeros if zero else torch.empty
    return make(like.shape, dtype=like.dtype, device=like.device)


# Pass the dq_done counters to the backward (False: NULL, the C ABI's other case, where the dq
# postprocess waits for the whole main kernel; the tests compare the two).
_COUNT_DQ_DONE = True
# FtBwdParams.deterministic for deterministic=True: 1, or 2 (the same guarantee without rotated walks,
# whose dq turns need all KV-block CTAs of a (batch, head) resident at once) when
# FLASHTILE_DETERMINISTIC_NO_ROTATION is set to a nonzero value, for processes confined to a part of the
# GPU's SMs (MPS active-thread limits, green contexts).
_DETERMINISTIC_MODE = 2 if os.environ.get("FLASHTILE_DETERMINISTIC_NO_ROTATION", "0") not in ("", "0") else 1


def _bwd_workspace_layout(q: torch.Tensor, batch: int, varlen: bool, num_heads_k: int, lse_numel: int):
    """The backward's fp32 workspaces, carved from one allocation: returns (dq accumulator strides,
    dq_done offset, dsoftmax_sum offset, lse_log2 offset, total), offsets and total in 4-byte elements.
    The dq accumulator (FtBwdParams.dq_accum) starts at 0, head-major so that each head's rows are
    contiguous: (batch, heads, rows, d) or, packed, (heads, rows, d), with the head dim rounded up to its
    bucket and rows padded by FT_BWD_ACCUM_ROW_PAD (per batch element when packed); its strides are
    (batch, row, head), batch 0 when packed. The dq_done counters (batch * num_heads_k int32) follow its
    extent directly, so that the backward clears both with one memset; the softmax row sums and the
    log2-scaled LSE (lse's contiguous layout each) start at 128-byte boundaries after them."""
    pad = _lib.BWD_ACCUM_ROW_PAD
    d = head_dim_bucket(q.shape[-1])
    heads = q.shape[-2]
    if varlen:
        rows = q.shape[0] + pad * batch
        strides = (0, d, rows * d)
        numel = heads * rows * d
    else:
        rows = -(-q.shape[1] // pad) * pad
        strides = (heads * rows * d, d, rows * d)
        numel = batch * heads * rows * d
    align = 32
    done = numel
    dsum = -(-(done + batch * num_heads_k) // align) * align
    lse_log2 = dsum + -(-lse_numel // align) * align
    return strides, done, dsum, lse_log2, lse_log2 + lse_numel


def _bwd_plan(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
              max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, deterministic,
              path):
    """(FtBwdParams with everything but the data and workspace pointers and the mode, workspace layout)
    of one call."""
    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    batch = _batch(q, cu_seqlens_q)
    p = _lib.FtBwdParams()
    _fill_fwd_params(p.fwd, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, path)
    p.do_batch_stride, p.do_row_stride, p.do_head_stride = _strides(dout, varlen_q)
    p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride = _strides(dq, varlen_q)
    p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride = _strides(dk, varlen_k)
    p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride = _strides(dv, varlen_k)
    acc_strides, done, dsum, lse_log2, total = _bwd_workspace_layout(q, batch, varlen_q, k.shape[-2], lse.numel())
    p.dq_accum_batch_stride, p.dq_accum_row_stride, p.dq_accum_head_stride = acc_strides
    semaphores = batch * q.shape[-2] * -(-max_seqlen_q // _lib.BWD_SEMAPHORE_ROWS) if deterministic else 0
    return p, (done, dsum, lse_log2, total, semaphores)


def _bwd_impl(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
              max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, deterministic, path):
    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    batch = _batch(q, cu_seqlens_q)
    if q.numel() == 0 or k.numel() == 0 or batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        # No (query, key) pair anywhere: every gradient is 0, and there is nothing to launch.
        return _grad_buffer(q, zero=True), _grad_buffer(k, zero=True), _grad_buffer(v, zero=True)
    # The kernels leave rows outside every sequence unwritten (varlen gaps, keys past seqused_k; query
    # rows past seqused_q are written, with 0): those gradients are 0, so such buffers start zeroed.
    dq = _grad_buffer(q, zero=varlen_q)
    dk = _grad_buffer(k, zero=varlen_k or seqused_k is not None)
    dv = _grad_buffer(v, zero=varlen_k or seqused_k is not None)
    lse = lse.contiguous()
    dout = _kernel_readable(dout)
    if dlse is not None and (dlse.stride() != lse.stride() or dlse.data_ptr() % 16 != 0):
        dlse = torch.empty_like(lse).copy_(dlse)  # dlse has no strides of its own in the ABI: lse's layout
    args = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            window_left, window_right, softcap, deterministic, path)
    # A call reuses the struct of an earlier call with the same metadata (dq, dk, dv are fresh and
    # contiguous, lse contiguous: their strides follow from the shapes in the key).
    key = _plan_key(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, out.shape, out.stride(), lse.shape,
                    dout.shape, dout.stride(), *args[4:])
    plan = _bwd_plans.get(key)
    if plan is None:
        plan = _bwd_plan(dout, q, k, v, out, lse, dq, dk, dv, *args)
        _remember(_bwd_plans, key, plan)
    else:
        _check_data_alignment(q, k, v)
    template, (done, dsum, lse_log2, total, semaphores) = plan
    # Workspaces (through torch's allocator): one fp32 allocation (the backward clears the dq accumulator
    # and dq_done, and writes the others), and the deterministic mode's zeroed semaphores.
    ws = torch.empty(total, dtype=torch.float32, device=q.device)
    base = ws.data_ptr()
    p = _lib.FtBwdParams.from_buffer_copy(template)
    f = p.fwd
    f.q, f.k, f.v, f.out, f.lse = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()
    _set_seq_pointers(f, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    p.dout, p.dlse = dout.data_ptr(), _ptr(dlse)
    p.dq, p.dk, p.dv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    p.dq_accum, p.dsoftmax_sum, p.lse_log2 = base, base + 4 * dsum, base + 4 * lse_log2
    p.dq_done = base + 4 * done if _COUNT_DQ_DONE else None
    dq_semaphore = None
    if deterministic:
        p.deterministic = _DETERMINISTIC_MODE
        dq_semaphore = torch.zeros(semaphores, dtype=torch.int32, device=q.device)
        p.dq_semaphore = dq_semaphore.data_ptr()
    _launch("ft_mha_bwd", p, q.device, "backward")
    return dq, dk, dv


@torch.library.custom_op("flashtile::bwd", mutates_args=(), device_types="cuda")
def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, dlse: Optional[torch.Tensor],
        cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
        seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],
        max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
        window_left: int, window_right: int, softcap: float, deterministic: bool,
        path: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward: (dq, dk, dv) shaped like (q, k, v), from the forward's inputs, its `out` and
    `lse`, the gradient `dout` of out and (optionally) the gradient `dlse` of lse."""
    return _bwd_impl(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                     max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                     deterministic, path)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
              max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, deterministic, path):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ---- autograd ----------------------------------------------------------------------------------------

_FWD_NUM_INPUTS = 18  # arguments of flashtile::fwd; autograd wants one gradient (or None) for each


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
     window_left, window_right, softcap, path, deterministic, pack_gqa, num_splits) = inputs
    out, lse = output
    # Only tensors are saved: the four Nones of a padded call, saved beside apply()'s 14 non-tensor
    # arguments, measured +20-30 us per backward call (the autograd engine's bookkeeping).
    seq = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    ctx.seq_given = tuple(t is not None for t in seq)
    ctx.save_for_backward(q, k, v, out, lse, *(t for t in seq if t is not None))
    ctx.args = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap)
    ctx.deterministic, ctx.path = deterministic, path
    # An unused output gets None rather than a zero tensor: no dlse buffer when lse is not used.
    ctx.set_materialize_grads(False)


def _eager(*tensors) -> bool:
    """True when plain CUDA tensors are being computed on eagerly (no torch.compile/export tracing, no
    dispatch or function mode, no tensor subclass, meta tensor or functorch transform): the ops' bodies can
    then run without the dispatcher, which costs ~25 µs per call (measured) on top of the op itself."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._is_torch_function_mode_enabled() and not torch._C._are_functorch_transforms_active()
            and all(t is None or (type(t) is torch.Tensor and t.is_cuda) for t in tensors))


def _fwd_backward(ctx, dout, dlse):
    none = (None,) * (_FWD_NUM_INPUTS - 3)
    if dout is None and dlse is None:
        return (None, None, None) + none
    q, k, v, out, lse, *given = ctx.saved_tensors
    given = iter(given)
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = (next(given) if g else None for g in ctx.seq_given)
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    args = (dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *ctx.args,
            ctx.deterministic, ctx.path)
    dq, dk, dv = _bwd_impl(*args) if _eager(dout, q, dlse) else bwd(*args)
    return (dq, dk, dv) + none


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


class _AttentionFunction(torch.autograd.Function):
    """The same forward and backward as flashtile::fwd's registered autograd, for eager calls.

    torch.library's autograd layer costs ~60-110 µs per call on inputs that require grad (measured),
    which dominates short sequences; this runs the ops' bodies directly. torch.compile keeps using the
    op and its registered autograd. The op's arguments after q, k, v arrive as one tuple, so that
    autograd has four inputs to track rather than eighteen.
    """

    @staticmethod
    def forward(ctx, q, k, v, args):
        inputs = (q, k, v, *args)
        output = _fwd_impl(*inputs[:-3], *inputs[-2:])  # deterministic only matters to the backward
        _fwd_setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _fwd_backward(ctx, dout, dlse)[:3] + (None,)


def attention(q, k, v, *args):
    """flashtile::fwd with autograd; args as the op's after q, k, v. Eager calls skip the dispatcher
    (the same Python body runs); traced ones (torch.compile, export, fake tensors) go through the op."""
    if not _eager(q, k, v):
        return fwd(q, k, v, *args)
    return attention_eager(q, k, v, *args)


def attention_eager(q, k, v, *args):
    """attention() for callers that have established _eager(q, k, v)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _AttentionFunction.apply(q, k, v, args)
    return _fwd_impl(q, k, v, *args[:-3], *args[-2:])
