"""What the ops hand to the C ABI, checked without a GPU: the ops' implementations run on CPU tensors
against a stand-in library that records the FtFwdParams / FtBwdParams it receives (pointers, element
strides, geometry, workspaces) and can fail the call. Host memory is readable at the recorded
addresses, so workspace contents (zeroed semaphores, zeroed gradients) are checked at call time. The
stand-in also answers ft_fwd_split_accum_bytes (the tail split's scratch size) with a chosen value.
"""
import ctypes
import math
import sys

import pytest
import torch

import flashtile
from flashtile import _lib, interface, ops

BC = sys.modules["flashtile.build_config"]
BF16 = torch.bfloat16


class StandInLibrary:
    """Records each call's params struct (a copy) and what the buffers held at call time."""

    def __init__(self, rc=_lib.OK, error="", split_bytes=0):
        self.rc, self.error = rc, error
        self.fwd_calls, self.bwd_calls = [], []
        self.split_bytes, self.split_queries = split_bytes, []

    def ft_fwd_split_accum_bytes(self, device, head_dim, head_dim_v):
        self.split_queries.append((device, head_dim, head_dim_v))
        return self.split_bytes

    def ft_mha_fwd(self, params_ref, stream):
        p = params_ref._obj
        assert isinstance(p, _lib.FtFwdParams)
        self.fwd_calls.append((_lib.FtFwdParams.from_buffer_copy(p), stream.value))
        return self.rc

    def ft_mha_bwd(self, params_ref, stream):
        p = params_ref._obj
        assert isinstance(p, _lib.FtBwdParams)
        seen = {}
        if p.dq_semaphore:
            n = self.semaphore_len
            seen["semaphore"] = list((ctypes.c_int32 * n).from_address(p.dq_semaphore))
        for name in ("dq", "dk", "dv", "dout"):
            n = self.numel[name]
            # 16-bit elements; zero is all-zero bits in bf16 and fp16.
            seen[name] = torch.tensor(list((ctypes.c_int16 * n).from_address(getattr(p, name))), dtype=torch.int16)
        if p.dlse:
            seen["dlse"] = torch.tensor(list((ctypes.c_float * self.numel["lse"]).from_address(p.dlse)))
        self.bwd_calls.append((_lib.FtBwdParams.from_buffer_copy(p), stream.value, seen))
        return self.rc

    def ft_last_error(self):
        return self.error.encode()


@pytest.fixture
def lib(monkeypatch):
    stand_in = StandInLibrary()
    monkeypatch.setattr(_lib, "lib", lambda: stand_in)
    monkeypatch.setattr(ops, "_current_stream", lambda device: 0x5EED)
    # Caches that hold what the stand-in answered (the split scratch's size) or allocated start empty.
    for cache in ("_fwd_plans", "_bwd_plans", "_split_accum_sizes", "_kept_counters", "_kept_split_accums"):
        monkeypatch.setattr(ops, cache, {})
    return stand_in


def _rand(*shape, dtype=BF16):
    return torch.randn(*shape).to(dtype)


def _fwd_args(q, k, v, cu_q=None, cu_k=None, used_q=None, used_k=None, max_q=None, max_k=None, scale=0.125,
              causal=False, left=-1, right=-1, softcap=0.0, path=_lib.PATHS["ampere"]):
    max_q = q.shape[1] if max_q is None else max_q
    max_k = k.shape[1] if max_k is None else max_k
    return (q, k, v, cu_q, cu_k, used_q, used_k, max_q, max_k, scale, causal, left, right, softcap, path)


def _bwd(lib, dout, q, k, v, out, lse, dlse=None, *, deterministic=False, **kw):
    args = _fwd_args(q, k, v, **kw)
    lib.numel = {"dq": q.numel(), "dk": k.numel(), "dv": v.numel(), "dout": dout.numel(), "lse": lse.numel()}
    max_q = args[7]
    batch = args[3].shape[0] - 1 if args[3] is not None else q.shape[0]
    lib.semaphore_len = batch * q.shape[-2] * math.ceil(max_q / _lib.BWD_SEMAPHORE_ROWS)
    return ops._bwd_impl(dout, q, k, v, out, lse, dlse, *args[3:14], deterministic, args[14])


def _strides3(t, varlen=False):
    return (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def _fields(p, prefix, n=3):
    names = ("batch", "row", "head")[:n] if n == 3 else ("batch", "head")
    return tuple(getattr(p, f"{prefix}_{s}_stride") for s in names)


# ---- the forward struct ------------------------------------------------------------------------------

def test_fwd_params_padded(lib):
    q = _rand(3, 17, 6, 128)
    kv = _rand(3, 40, 2, 2, 128)
    k, v = kv[:, :, 0], kv[:, :, 1]  # strided views of one packed tensor
    out, lse = ops._fwd_impl(*_fwd_args(q, k, v, scale=0.3, causal=True, left=8, right=0, softcap=5.0))
    ((p, stream),) = lib.fwd_calls
    assert stream == 0x5EED
    assert (p.q, p.k, p.v, p.out, p.lse) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
    assert _fields(p, "q") == q.stride()[:3] and _fields(p, "k") == k.stride()[:3] and _fields(p, "v") == v.stride()[:3]
    assert _fields(p, "o") == out.stride()[:3] and _fields(p, "lse", 2) == lse.stride()[:2]
    assert not (p.cu_seqlens_q or p.cu_seqlens_k or p.seqused_q or p.seqused_k)
    # The scheduler workspace: a buffer of its own, distinct from every tensor of the call.
    assert p.tile_counter and p.tile_counter not in (p.q, p.k, p.v, p.out, p.lse)
    assert p.tile_counter_zeroed == 0  # not a CUDA tensor on the current device: a fresh counter, cleared by the launch
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.rows_q, p.rows_k) == (3, 17, 40, 17, 40)
    assert (p.num_heads, p.num_heads_k, p.head_dim, p.head_dim_v) == (6, 2, 128, 128)
    assert (p.softmax_scale, p.softcap) == (pytest.approx(0.3), 5.0)
    assert (p.window_left, p.window_right, p.is_causal) == (8, 0, 1)
    assert (p.dtype, p.path, p.device) == (_lib.DTYPE_BF16, _lib.PATHS["ampere"], -1)  # CPU: no device index
    assert p.pack_gqa == 0  # heuristic
    assert p.num_splits == 0 and p.reserved == 0  # the library may split the tail (where it can)
    assert not p.split_accum and p.split_accum_bytes == 0  # a band mask: never split, no scratch
    assert out.shape == (3, 17, 6, 128) and lse.shape == (3, 6, 17)


@pytest.mark.parametrize("pack", [1, -1])
def test_fwd_params_pack_gqa(lib, pack):
    q, k, v = _rand(2, 5, 8, 64), _rand(2, 40, 2, 64), _rand(2, 40, 2, 64)
    ops._fwd_impl(*_fwd_args(q, k, v), pack)
    ((p, _),) = lib.fwd_calls
    assert p.pack_gqa == pack


def _struct_fields(p):
    return {name: getattr(p, name) for name, _ in type(p)._fields_}


def test_fwd_params_template_reuse(lib):
    """A second call with the same metadata reuses the cached struct: identical fields except the
    data pointers, which are the new tensors'; different arguments miss the cache."""
    q1, k1, v1 = _rand(2, 33, 4, 64), _rand(2, 50, 2, 64), _rand(2, 50, 2, 64)
    q2, k2, v2 = (t.clone() for t in (q1, k1, v1))
    out1, lse1 = ops._fwd_impl(*_fwd_args(q1, k1, v1, causal=True, right=0))
    out2, lse2 = ops._fwd_impl(*_fwd_args(q2, k2, v2, causal=True, right=0))
    ops._fwd_impl(*_fwd_args(q2, k2, v2, causal=False))
    (p1, _), (p2, _), (p3, _) = lib.fwd_calls
    f1, f2 = _struct_fields(p1), _struct_fields(p2)
    per_call = {"q", "k", "v", "out", "lse", "tile_counter"}
    assert {n for n in f1 if f1[n] != f2[n]} <= per_call
    assert (p2.q, p2.k, p2.v, p2.out, p2.lse) == (q2.data_ptr(), k2.data_ptr(), v2.data_ptr(), out2.data_ptr(),
                                                  lse2.data_ptr())
    assert p2.tile_counter  # a scheduler counter of the call's own, never the template's
    assert (p1.is_causal, p3.is_causal) == (1, 0)


def test_fwd_params_template_checks_base_address(lib):
    """The cached path still rejects a misaligned base address (same shape and strides)."""
    q, k, v = _rand(1, 16, 2, 64), _rand(1, 16, 2, 64), _rand(1, 16, 2, 64)
    ops._fwd_impl(*_fwd_args(q, k, v))
    shifted = torch.empty(q.numel() + 1, dtype=BF16)[1:].view(q.shape)
    assert shifted.stride() == q.stride() and shifted.data_ptr() % 16 != 0
    with pytest.raises(ValueError, match=r"q data pointer must be 16-byte aligned"):
        ops._fwd_impl(*_fwd_args(shifted, k, v))


def test_fwd_params_varlen(lib):
    fp16 = torch.float16
    q, k, v = _rand(11, 4, 64, dtype=fp16), _rand(23, 2, 64, dtype=fp16), _rand(23, 2, 64, dtype=fp16)
    cu_q = torch.tensor([0, 5, 5, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 20, 23], dtype=torch.int32)
    used_k = torch.tensor([3, 10, 1], dtype=torch.int32)
    out, lse = ops._fwd_impl(*_fwd_args(q, k, v, cu_q, cu_k, None, used_k, max_q=6, max_k=17))
    ((p, _),) = lib.fwd_calls
    assert _fields(p, "q") == (0, q.stride(0), q.stride(1)) and _fields(p, "k") == (0, k.stride(0), k.stride(1))
    assert _fields(p, "o") == (0, out.stride(0), out.stride(1)) and _fields(p, "lse", 2) == (0, lse.stride(0))
    assert (p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_k) == (cu_q.data_ptr(), cu_k.data_ptr(), used_k.data_ptr())
    assert not p.seqused_q
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.rows_q, p.rows_k) == (3, 6, 17, 11, 23)
    assert p.dtype == _lib.DTYPE_FP16
    assert out.shape == (11, 4, 64) and lse.shape == (4, 11)


def test_fwd_params_varlen_plan_reuse(lib):
    """Packed calls reuse the struct of an earlier call with the same metadata: each call's own
    cu_seqlens / seqused pointers, everything else identical; another batch count misses the cache."""
    q, k, v = _rand(11, 4, 64), _rand(23, 2, 64), _rand(23, 2, 64)
    cus = [(torch.tensor([0, 5, 5, 11], dtype=torch.int32), torch.tensor([0, 3, 20, 23], dtype=torch.int32),
            torch.tensor([3, 10, 1], dtype=torch.int32)) for _ in range(2)]
    for cu_q, cu_k, used_k in cus:
        ops._fwd_impl(*_fwd_args(q, k, v, cu_q, cu_k, None, used_k, max_q=6, max_k=17))
    cu_q3 = torch.tensor([0, 5, 11], dtype=torch.int32)
    cu_k3 = torch.tensor([0, 3, 23], dtype=torch.int32)
    ops._fwd_impl(*_fwd_args(q, k, v, cu_q3, cu_k3, max_q=6, max_k=20))
    (p1, _), (p2, _), (p3, _) = lib.fwd_calls
    f1, f2 = _struct_fields(p1), _struct_fields(p2)
    per_call = {"q", "k", "v", "out", "lse", "tile_counter", "cu_seqlens_q", "cu_seqlens_k", "seqused_k"}
    assert {n for n in f1 if f1[n] != f2[n]} <= per_call
    for p, (cu_q, cu_k, used_k) in zip((p1, p2), cus):
        assert (p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_k) == (cu_q.data_ptr(), cu_k.data_ptr(), used_k.data_ptr())
        assert not p.seqused_q
    assert (p3.batch, p3.seqlen_k, p3.cu_seqlens_q) == (2, 20, cu_q3.data_ptr()) and not p3.seqused_k


# ---- num_splits and the tail split's workspaces ------------------------------------------------------

SPLIT_BYTES = 3 * 4096 + 2  # not a whole number of floats: the scratch rounds up


def _split_case(d=128, dv=128):
    return _rand(2, 300, 4, d), _rand(2, 500, 2, d), _rand(2, 500, 2, dv)


@pytest.mark.parametrize("num_splits", [0, 1])
def test_fwd_params_num_splits(lib, num_splits):
    q, k, v = _split_case()
    ops._fwd_impl(*_fwd_args(q, k, v), 0, num_splits)
    ((p, _),) = lib.fwd_calls
    assert (p.num_splits, p.reserved) == (num_splits, 0)


def test_fwd_split_accum_for_a_call_that_may_split(lib):
    """A call the library may split (no band mask, fixed-length batches, num_splits 0, not the Ampere
    path) gets scratch of the bytes ft_fwd_split_accum_bytes names for its device and head dims."""
    lib.split_bytes = SPLIT_BYTES
    q, k, v = _split_case(192, 128)
    out, lse = ops._fwd_impl(*_fwd_args(q, k, v, path=_lib.PATHS["auto"]))
    ((p, _),) = lib.fwd_calls
    assert p.num_splits == 0
    assert p.split_accum and p.split_accum_bytes == SPLIT_BYTES
    assert p.split_accum not in (p.q, p.k, p.v, p.out, p.lse, p.tile_counter)
    assert lib.split_queries == [(-1, 192, 128)]  # (device ordinal, head dims); CPU tensors have ordinal -1
    ops._fwd_impl(*_fwd_args(q, k, v, path=_lib.PATHS["hopper"]))
    assert lib.fwd_calls[1][0].split_accum_bytes == SPLIT_BYTES


@pytest.mark.parametrize("case", ["causal", "window-left", "window-right", "varlen", "seqused-q", "seqused-k",
                                  "num-splits-1", "ampere"])
def test_fwd_no_split_accum_where_the_call_cannot_split(lib, case):
    """Band masks, packed or seqused batches, num_splits=1 and the Ampere path never split: NULL
    scratch and 0 bytes, without asking the library for a size."""
    lib.split_bytes = SPLIT_BYTES
    q, k, v = _split_case()
    used = torch.tensor([7, 300], dtype=torch.int32)
    kw, extra = dict(path=_lib.PATHS["auto"]), ()
    if case == "causal":
        kw.update(causal=True)  # the flag alone (the API also sets window_right 0, tested below)
    elif case == "window-left":
        kw.update(left=64)
    elif case == "window-right":
        kw.update(right=0)
    elif case == "varlen":
        q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
        kw.update(cu_q=torch.tensor([0, 300, 600], dtype=torch.int32),
                  cu_k=torch.tensor([0, 500, 1000], dtype=torch.int32), max_q=300, max_k=500)
    elif case == "seqused-q":
        kw.update(used_q=used)
    elif case == "seqused-k":
        kw.update(used_k=used)
    elif case == "num-splits-1":
        extra = (0, 1)
    else:
        kw.update(path=_lib.PATHS["ampere"])
    ops._fwd_impl(*_fwd_args(q, k, v, **kw), *extra)
    ((p, _),) = lib.fwd_calls
    assert not p.split_accum and p.split_accum_bytes == 0
    assert lib.split_queries == []


def test_fwd_no_split_accum_where_the_device_has_no_split_kernel(lib):
    q, k, v = _split_case()
    ops._fwd_impl(*_fwd_args(q, k, v, path=_lib.PATHS["auto"]))
    ((p, _),) = lib.fwd_calls
    assert not p.split_accum and p.split_accum_bytes == 0
    assert lib.split_queries == [(-1, 128, 128)]


def test_fwd_split_accum_size_is_asked_once_per_device_and_head_dim(lib):
    """The size query goes to the library once per (device, head dims); a plan remembers the call's
    bytes, and its template keeps no per-call pointer."""
    lib.split_bytes = SPLIT_BYTES
    auto = _lib.PATHS["auto"]
    q, k, v = _split_case()
    ops._fwd_impl(*_fwd_args(q, k, v, path=auto))
    ops._fwd_impl(*_fwd_args(q, k, v, path=auto))       # the plan
    q2, k2, v2 = _rand(1, 64, 2, 128), _rand(1, 64, 2, 128), _rand(1, 64, 2, 128)
    ops._fwd_impl(*_fwd_args(q2, k2, v2, path=auto))    # another plan, the same head dims
    assert lib.split_queries == [(-1, 128, 128)]
    q3, k3, v3 = _rand(1, 64, 2, 64), _rand(1, 64, 2, 64), _rand(1, 64, 2, 64)
    ops._fwd_impl(*_fwd_args(q3, k3, v3, path=auto))
    assert lib.split_queries == [(-1, 128, 128), (-1, 64, 64)]
    assert all(p.split_accum and p.split_accum_bytes == SPLIT_BYTES for p, _ in lib.fwd_calls)
    templates = [plan[2] for plan in ops._fwd_plans.values()]
    assert len(templates) == 3 and not any(t.split_accum or t.split_accum_bytes or t.tile_counter for t in templates)
    assert [plan[3] for plan in ops._fwd_plans.values()] == [SPLIT_BYTES] * 3


def test_fwd_workspaces_fresh():
    """Off the current device or under stream capture (CPU tensors take this path): a fresh scheduler
    workspace of FT_FWD_COUNTERS int32 that the launch clears, and fresh fp32 split scratch."""
    counter, zeroed, scratch = ops._fwd_workspaces(torch.device("cpu"), 4 * 25 + 1)
    assert counter.dtype == torch.int32 and counter.numel() == _lib.FWD_COUNTERS == 1024 and zeroed == 0
    assert scratch.dtype == torch.float32 and scratch.numel() == 26
    counter, zeroed, scratch = ops._fwd_workspaces(torch.device("cpu"), 0)
    assert counter.numel() == _lib.FWD_COUNTERS and zeroed == 0 and scratch is None


def test_fwd_workspaces_kept_per_stream(lib, monkeypatch):
    """Eager calls on the current device keep one zeroed scheduler workspace and one split scratch per
    (device, stream); the scratch is replaced by a larger one when a call needs more."""
    stream = {"id": 1}
    monkeypatch.setattr(ops, "_kept_key", lambda device: (0, stream["id"]))
    cpu = torch.device("cpu")
    counter, zeroed, s1 = ops._fwd_workspaces(cpu, 100)
    assert zeroed == 1 and counter.numel() == _lib.FWD_COUNTERS and not counter.any()
    assert s1.numel() == 25 and ops._kept_counters[(0, 1)] is counter and ops._kept_split_accums[(0, 1)] is s1
    c2, _, s2 = ops._fwd_workspaces(cpu, 40)  # fits the kept scratch
    assert c2 is counter and s2 is s1
    c3, _, s3 = ops._fwd_workspaces(cpu, 400)  # does not: a larger one replaces it
    assert c3 is counter and s3.numel() == 100 and ops._kept_split_accums[(0, 1)] is s3
    c4, _, s4 = ops._fwd_workspaces(cpu, 0)
    assert c4 is counter and s4 is None and ops._kept_split_accums[(0, 1)] is s3
    stream["id"] = 2  # another stream: workspaces of its own
    c5, _, s5 = ops._fwd_workspaces(cpu, 40)
    assert c5 is not counter and s5 is not s3 and s5.numel() == 10
    # What a launch gets.
    lib.split_bytes = SPLIT_BYTES
    q, k, v = _split_case()
    ops._fwd_impl(*_fwd_args(q, k, v, path=_lib.PATHS["auto"]))
    ((p, _),) = lib.fwd_calls
    assert (p.tile_counter, p.tile_counter_zeroed) == (c5.data_ptr(), 1)
    assert p.split_accum == ops._kept_split_accums[(0, 2)].data_ptr() and p.split_accum_bytes == SPLIT_BYTES
    assert ops._kept_split_accums[(0, 2)].numel() == -(-SPLIT_BYTES // 4)


@pytest.mark.parametrize("grad", [False, True])
def test_eager_attention_passes_pack_gqa_and_num_splits(lib, grad):
    """ops.attention_eager (and its autograd.Function) hands pack_gqa and num_splits to the forward and
    keeps deterministic for the backward."""
    q, k, v = _split_case()
    if grad:
        q.requires_grad_(True)
    args = _fwd_args(q, k, v, path=_lib.PATHS["auto"])[3:] + (True, -1, 1)  # deterministic, pack_gqa, num_splits
    out, lse = ops.attention_eager(q, k, v, *args)
    ((p, _),) = lib.fwd_calls
    assert (p.pack_gqa, p.num_splits, p.path) == (-1, 1, _lib.PATHS["auto"])
    assert out.requires_grad is grad
    if grad:
        assert out.grad_fn.deterministic is True and out.grad_fn.path == _lib.PATHS["auto"]


# ---- the public API down to the struct ----------------------------------------------------------------

@pytest.fixture
def api(lib, monkeypatch):
    """The public API on CPU tensors, run eagerly down to the stand-in library (device and kernel
    checks switched off)."""
    monkeypatch.setattr(interface, "_eager", lambda *t: True)
    monkeypatch.setattr(ops, "_eager", lambda *t: True)
    monkeypatch.setattr(interface.V, "check_same_device", lambda tensors: None)
    monkeypatch.setattr(interface, "require_kernel", lambda **kw: None)
    monkeypatch.setattr(interface, "_validated", {})
    lib.split_bytes = SPLIT_BYTES
    return lib


def test_api_num_splits(api):
    """flash_attn_func's num_splits defaults to 0 (the library's tail split, with scratch where the
    call may split); 1 never splits; None and 0 mean the default; more than 1 is not implemented."""
    q, k, v = _split_case()
    flashtile.flash_attn_func(q, k, v)
    flashtile.flash_attn_func(q, k, v, num_splits=1)
    flashtile.flash_attn_func(q, k, v, num_splits=None)
    flashtile.flash_attn_func(q, k, v, num_splits=0)
    flashtile.flash_attn_func(q, k, v, num_splits=1)  # the validated-call cache keeps them apart
    flashtile.flash_attn_func(q, k, v, causal=True)
    ps = [p for p, _ in api.fwd_calls]
    assert [p.num_splits for p in ps] == [0, 1, 0, 0, 1, 0]
    assert [p.split_accum_bytes for p in ps] == [SPLIT_BYTES, 0, SPLIT_BYTES, SPLIT_BYTES, 0, 0]
    assert [bool(p.split_accum) for p in ps] == [True, False, True, True, False, False]
    with pytest.raises(NotImplementedError, match=r"split-KV \(num_splits=2\)"):
        flashtile.flash_attn_func(q, k, v, num_splits=2)
    assert len(api.fwd_calls) == 6


def test_api_num_splits_other_entry_points(api):
    q, k, v = _split_case()
    flashtile.flash_attn_qkvpacked_func(torch.stack((q, q, q), dim=2))  # FA3's has no num_splits: the default
    qp, kp = q.flatten(0, 1), k.flatten(0, 1)
    cu_q = torch.tensor([0, 300, 600], dtype=torch.int32)
    cu_k = torch.tensor([0, 500, 1000], dtype=torch.int32)
    flashtile.flash_attn_varlen_func(qp, kp, kp, cu_q, cu_k, 300, 500)
    flashtile.flash_attn_varlen_func(qp, kp, kp, cu_q, cu_k, 300, 500, num_splits=1)
    flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=400)
    flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=400, num_splits=1)
    ps = [p for p, _ in api.fwd_calls]
    assert [p.num_splits for p in ps] == [0, 0, 1, 0, 1]
    # Packed batches and KV caches (seqused_k) are never split: no scratch.
    assert ps[0].split_accum and ps[0].split_accum_bytes == SPLIT_BYTES
    assert not any(p.split_accum or p.split_accum_bytes for p in ps[1:])


def test_api_num_splits_defaults():
    import inspect
    for fn in (flashtile.flash_attn_func, flashtile.flash_attn_varlen_func, flashtile.flash_attn_with_kvcache):
        assert inspect.signature(fn).parameters["num_splits"].default == 0, fn.__name__


# ---- the backward struct -----------------------------------------------------------------------------

def _padded_case(b=2, sq=70, sk=33, h=6, hk=2, d=128, dv=128):
    q, k, v = _rand(b, sq, h, d), _rand(b, sk, hk, d), _rand(b, sk, hk, dv)
    out, lse = _rand(b, sq, h, dv), torch.randn(b, h, sq)
    return q, k, v, out, lse


@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_params_padded(lib, deterministic):
    q, k, v, out, lse = _padded_case()
    dout, dlse = _rand(*out.shape), torch.randn(lse.shape)
    dq, dk, dv = _bwd(lib, dout, q, k, v, out, lse, dlse, deterministic=deterministic, scale=0.2, causal=True,
                      right=0, path=_lib.PATHS["auto"])
    ((p, stream, seen),) = lib.bwd_calls
    assert stream == 0x5EED and not lib.fwd_calls
    # The forward description, exactly as the forward op fills it.
    f = p.fwd
    assert (f.q, f.k, f.v, f.out, f.lse) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
    assert _fields(f, "q") == q.stride()[:3] and _fields(f, "o") == out.stride()[:3]
    assert _fields(f, "lse", 2) == lse.stride()[:2]
    assert (f.batch, f.seqlen_q, f.seqlen_k, f.rows_q, f.rows_k, f.num_heads, f.num_heads_k) == (2, 70, 33, 70, 33, 6, 2)
    assert (f.softmax_scale, f.is_causal, f.window_left, f.window_right, f.path) == (
        pytest.approx(0.2), 1, -1, 0, _lib.PATHS["auto"])
    # Gradients: contiguous, shaped like q/k/v, returned as passed.
    for g, like, name in ((dq, q, "dq"), (dk, k, "dk"), (dv, v, "dv")):
        assert g.shape == like.shape and g.dtype == like.dtype and g.is_contiguous()
        assert getattr(p, name) == g.data_ptr()
        assert _fields(p, name) == g.stride()[:3]
    # dout and dlse are read in place when the kernels can.
    assert p.dout == dout.data_ptr() and _fields(p, "do") == dout.stride()[:3]
    assert p.dlse == dlse.data_ptr()
    # Workspaces: distinct, 16-byte aligned; dq_accum is head-major, padded to whole 128-row tiles.
    ws = [p.dq_accum, p.dsoftmax_sum, p.lse_log2]
    assert len(set(ws)) == 3 and all(a % 16 == 0 for a in ws)
    assert _fields(p, "dq_accum") == (6 * 128 * 128, 128, 128 * 128)
    assert p.dq_done == p.dq_accum + 2 * 6 * 128 * 128 * 4  # batch * heads * rows * d floats, then the counters
    if deterministic:
        assert p.deterministic == ops._DETERMINISTIC_MODE == 1 and p.dq_semaphore
        assert seen["semaphore"] == [0] * (2 * 6 * 3)  # batch * heads * ceil(70 / 32), zeroed
    else:
        assert p.deterministic == 0 and not p.dq_semaphore
    assert p.reserved == 0


def test_bwd_copies_what_the_kernels_cannot_read(lib):
    q, k, v, out, lse = _padded_case()
    dout = _rand(1, 1, 6, 128).expand(out.shape)  # what out.sum().backward() sends: stride-0 dims
    dlse = torch.randn(2, 70, 6).transpose(1, 2)   # not lse's layout (dlse has no strides of its own)
    _bwd(lib, dout, q, k, v, out, lse, dlse)
    ((p, _, seen),) = lib.bwd_calls
    assert p.dout != dout.data_ptr() and p.dout % 16 == 0
    assert _fields(p, "do") == (70 * 6 * 128, 6 * 128, 128)
    assert p.dlse != dlse.data_ptr() and p.dlse % 16 == 0
    # The copies hold the values, in the layouts the struct describes (read at call time).
    assert torch.equal(seen["dout"].view(BF16), dout.reshape(-1))
    assert torch.equal(seen["dlse"], dlse.reshape(-1))  # lse's (b, h, sq) order, not dlse's storage order


def test_bwd_strided_dout_with_aligned_strides_is_read_in_place(lib):
    q, k, v, out, lse = _padded_case()
    dout = _rand(2, 6, 70, 128).transpose(1, 2)  # head-major storage: strides are multiples of 8 elements
    _bwd(lib, dout, q, k, v, out, lse)
    ((p, _, _),) = lib.bwd_calls
    assert p.dout == dout.data_ptr() and _fields(p, "do") == dout.stride()[:3]
    assert not p.dlse


def test_bwd_misaligned_dout_is_copied(lib):
    q, k, v, out, lse = _padded_case()
    base = _rand(out.numel() + 4)
    dout = base[4:].view(out.shape)  # contiguous, but 8 bytes off a 16-byte boundary
    assert dout.is_contiguous() and dout.data_ptr() % 16 != 0
    _bwd(lib, dout, q, k, v, out, lse)
    ((p, _, _),) = lib.bwd_calls
    assert p.dout != dout.data_ptr() and p.dout % 16 == 0


def test_bwd_params_varlen_and_zeroed_gradients(lib):
    h, hk, d = 4, 2, 64
    cu_q = torch.tensor([0, 5, 5, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 20, 23], dtype=torch.int32)
    q, k, v = _rand(13, h, d), _rand(25, hk, d), _rand(25, hk, d)  # rows past cu[-1]: gaps
    out, lse = _rand(13, h, d), torch.randn(h, 13)
    dq, dk, dv = _bwd(lib, _rand(13, h, d), q, k, v, out, lse, cu_q=cu_q, cu_k=cu_k, max_q=6, max_k=17,
                      deterministic=True)
    ((p, _, seen),) = lib.bwd_calls
    f = p.fwd
    assert (f.batch, f.seqlen_q, f.seqlen_k, f.rows_q, f.rows_k) == (3, 6, 17, 13, 25)
    assert (f.cu_seqlens_q, f.cu_seqlens_k) == (cu_q.data_ptr(), cu_k.data_ptr())
    for name, heads in (("do", h), ("dq", h), ("dk", hk), ("dv", hk)):
        assert _fields(p, name) == (0, heads * d, d), name  # packed rows: batch stride 0
    assert _fields(p, "dq_accum") == (0, d, (13 + 3 * 128) * d)  # head-major: (heads, rows, d)
    # Rows outside every sequence are not written by the kernels: the gradients start zeroed.
    assert not (seen["dq"].any() or seen["dk"].any() or seen["dv"].any())
    assert seen["semaphore"] == [0] * (3 * h * 1)


def test_bwd_seqused_k_zeroes_dk_dv(lib):
    q, k, v, out, lse = _padded_case(b=2, sq=9, sk=40, h=4, hk=1)
    used_k = torch.tensor([10, 0], dtype=torch.int32)
    _bwd(lib, _rand(*out.shape), q, k, v, out, lse, used_k=used_k)
    ((p, _, seen),) = lib.bwd_calls
    assert p.fwd.seqused_k == used_k.data_ptr()
    assert not (seen["dk"].any() or seen["dv"].any())


@pytest.mark.parametrize("case", ["empty-q", "empty-k", "max-seqlen-k-0", "max-seqlen-q-0", "batch-0"])
def test_bwd_empty_problems_launch_nothing(lib, case):
    h, hk, d = 4, 2, 64
    kw = {}
    if case == "empty-q":
        q, k, v = _rand(2, 0, h, d), _rand(2, 9, hk, d), _rand(2, 9, hk, d)
    elif case == "empty-k":
        q, k, v = _rand(2, 5, h, d), _rand(2, 0, hk, d), _rand(2, 0, hk, d)
    elif case == "max-seqlen-k-0":
        q, k, v = _rand(7, h, d), _rand(3, hk, d), _rand(3, hk, d)
        kw = dict(cu_q=torch.tensor([0, 7], dtype=torch.int32), cu_k=torch.tensor([0, 0], dtype=torch.int32),
                  max_q=7, max_k=0)
    elif case == "max-seqlen-q-0":
        q, k, v = _rand(3, h, d), _rand(8, hk, d), _rand(8, hk, d)
        kw = dict(cu_q=torch.tensor([0, 0], dtype=torch.int32), cu_k=torch.tensor([0, 8], dtype=torch.int32),
                  max_q=0, max_k=8)
    else:
        q, k, v = _rand(3, h, d), _rand(8, hk, d), _rand(8, hk, d)
        kw = dict(cu_q=torch.tensor([0], dtype=torch.int32), cu_k=torch.tensor([0], dtype=torch.int32),
                  max_q=0, max_k=0)
    varlen = "cu_q" in kw
    out = _rand(*q.shape)
    lse = torch.randn(h, q.shape[0]) if varlen else torch.randn(q.shape[0], h, q.shape[1])
    dq, dk, dv = _bwd(lib, torch.ones_like(out), q, k, v, out, lse, **kw)
    assert not lib.bwd_calls
    for g, like in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == like.shape and g.dtype == like.dtype and g.is_contiguous()
        assert torch.all(g == 0)


# ---- error mapping -----------------------------------------------------------------------------------

def test_bwd_not_built_raises_kernel_not_built_error(lib, monkeypatch):
    cfg = dict(kernel_set="test", archs=["80"], kernels=[
        dict(name="ampere_fwd_bf16_hd128x128_none", op="fwd", path="ampere", dtype="bf16", head_dim=128,
             head_dim_v=128, mask="none", softcap=False)])
    monkeypatch.setattr(_lib, "installed_build_config", lambda: cfg)
    BC.build_config.cache_clear()
    try:
        lib.rc, lib.error = _lib.NOT_BUILT, "no backward kernel built for path=hopper dtype=bf16"
        q, k, v, out, lse = _padded_case()
        with pytest.raises(flashtile.KernelNotBuiltError,
                           match=r"no backward kernel built for path=hopper.*This build has: fwd ampere bf16"):
            _bwd(lib, _rand(*out.shape), q, k, v, out, lse, path=_lib.PATHS["hopper"])
    finally:
        BC.build_config.cache_clear()


@pytest.mark.parametrize("rc", [_lib.INVALID_ARGUMENT, _lib.UNSUPPORTED_DEVICE, _lib.CUDA_ERROR])
def test_bwd_failure_raises_kernel_error(lib, rc):
    lib.rc, lib.error = rc, "something broke"
    q, k, v, out, lse = _padded_case()
    with pytest.raises(ops.KernelError, match=rf"backward failed \(status {rc}\): something broke"):
        _bwd(lib, _rand(*out.shape), q, k, v, out, lse)
    lib.bwd_calls.clear()
    with pytest.raises(ops.KernelError, match=rf"forward failed \(status {rc}\): something broke"):
        ops._fwd_impl(*_fwd_args(q, k, v))


@pytest.mark.parametrize("shape, varlen, batch, expected", [
    ((2, 70, 6, 128), False, 2, (2, 6, 128, 128)),     # head-major, rows rounded up to FT_BWD_ACCUM_ROW_PAD
    ((3, 256, 4, 64), False, 3, (3, 4, 256, 64)),      # already a whole number of tiles
    ((1, 5, 2, 72), False, 1, (1, 2, 128, 96)),        # head dim rounded up to its bucket
    ((13, 4, 64), True, 3, (4, 13 + 3 * 128, 64)),     # packed: batches spaced FT_BWD_ACCUM_ROW_PAD apart
])
def test_bwd_workspace_layout(shape, varlen, batch, expected):
    """One fp32 allocation holds the dq accumulator (head-major, padded to whole tiles), the dq_done
    counters right after its extent (one memset clears both), then the softmax row sums and the
    log2-scaled LSE at 128-byte boundaries, none overlapping."""
    q = torch.empty(shape, dtype=torch.bfloat16)
    lse_numel = 7 * 13 + 5
    strides, done, dsum, lse_log2, total = ops._bwd_workspace_layout(q, batch, varlen, 3, lse_numel)
    acc = torch.empty(expected)  # the accumulator as a contiguous tensor of the expected shape
    if varlen:
        assert strides == (0, acc.stride(1), acc.stride(0))
    else:
        assert strides == (acc.stride(0), acc.stride(2), acc.stride(1))
    assert done == acc.numel()
    regions = [(0, done + batch * 3), (dsum, dsum + lse_numel), (lse_log2, lse_log2 + lse_numel)]
    assert all(a % 32 == 0 for a, _ in regions)
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(regions, regions[1:])) and regions[-1][1] == total


def test_bwd_params_plan_reuse(lib):
    """A second backward with the same metadata reuses the cached struct: identical fields except the
    data and workspace pointers; another mode or mask misses the cache; a misaligned q still fails."""
    q, k, v, out, lse = _padded_case(b=1, sq=40, sk=40, h=2, hk=2, d=64, dv=64)
    dout = _rand(*out.shape)
    per_call = {"dout", "dq", "dk", "dv", "dq_accum", "dsoftmax_sum", "lse_log2", "dq_done", "dq_semaphore",
                "deterministic", "fwd"}
    q1, q2 = q.clone(), q.clone()
    for qi in (q1, q2):
        _bwd(lib, dout, qi, k, v, out, lse, scale=0.3, causal=True, right=0)
    _bwd(lib, dout, q, k, v, out, lse, deterministic=True, scale=0.3, causal=True, right=0)
    _bwd(lib, dout, q, k, v, out, lse, scale=0.3)
    (p1, _, _), (p2, _, _), (p3, _, _), (p4, _, _) = lib.bwd_calls
    f1, f2 = _struct_fields(p1), _struct_fields(p2)
    assert {n for n in f1 if f1[n] != f2[n]} <= per_call
    g1, g2 = _struct_fields(p1.fwd), _struct_fields(p2.fwd)
    assert {n for n in g1 if g1[n] != g2[n]} <= {"q", "k", "v", "out", "lse"}
    assert (p1.fwd.q, p2.fwd.q) == (q1.data_ptr(), q2.data_ptr())  # each call's own q, never the template's
    assert (p1.deterministic, p2.deterministic, p3.deterministic) == (0, 0, ops._DETERMINISTIC_MODE)
    assert not p2.dq_semaphore and p3.dq_semaphore
    assert (p2.fwd.is_causal, p4.fwd.is_causal) == (1, 0)
    shifted = torch.empty(q.numel() + 1, dtype=BF16)[1:].view(q.shape)
    with pytest.raises(ValueError, match=r"q data pointer must be 16-byte aligned"):
        _bwd(lib, dout, shifted, k, v, out, lse, scale=0.3, causal=True, right=0)


def test_bwd_params_deterministic_without_rotation(lib, monkeypatch):
    """FLASHTILE_DETERMINISTIC_NO_ROTATION (read at import into ops._DETERMINISTIC_MODE) makes
    deterministic=True pass 2 (the fixed order without rotated walks); the default mode stays 0."""
    monkeypatch.setattr(ops, "_DETERMINISTIC_MODE", 2)
    q, k, v, out, lse = _padded_case()
    dout = _rand(*out.shape)
    for deterministic, expected in ((True, 2), (False, 0)):
        lib.bwd_calls.clear()
        _bwd(lib, dout, q, k, v, out, lse, deterministic=deterministic, scale=0.2, causal=False, path=_lib.PATHS["auto"])
        ((p, _, _),) = lib.bwd_calls
        assert p.deterministic == expected and bool(p.dq_semaphore) == deterministic
