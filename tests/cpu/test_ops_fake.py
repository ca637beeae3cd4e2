"""The `flashtile::fwd` and `flashtile::bwd` custom ops without a GPU: their schemas, dispatch
registrations, fake (shape) implementations and the autograd registration (fwd's backward calls bwd),
and the public API traced under FakeTensorMode, forward and backward.

Meta tensors exercise the fake implementation and autograd directly; FakeTensorMode with "cuda"
fake tensors exercises the path torch.compile/export take (skipped where this torch build cannot make
fake CUDA tensors). Nothing here runs a kernel.
"""
import contextlib
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import flashtile
from flashtile import _lib, interface, ops

OP = torch.ops.flashtile.fwd.default
BWD_OP = torch.ops.flashtile.bwd.default
BF16 = torch.bfloat16


def _fwd(q, k, v, cu_q=None, cu_k=None, used_q=None, used_k=None, max_q=0, max_k=0, *, scale=0.125,
         causal=False, left=-1, right=-1, softcap=0.0, path=0, deterministic=False):
    return torch.ops.flashtile.fwd(q, k, v, cu_q, cu_k, used_q, used_k, max_q, max_k, scale, causal, left, right,
                                   softcap, path, deterministic)


def _bwd(dout, q, k, v, out, lse, dlse=None, cu_q=None, cu_k=None, used_q=None, used_k=None, max_q=0, max_k=0, *,
         scale=0.125, causal=False, left=-1, right=-1, softcap=0.0, deterministic=False, path=0):
    return torch.ops.flashtile.bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, used_q, used_k, max_q, max_k, scale,
                                   causal, left, right, softcap, deterministic, path)


def _empty(*shape, dtype=BF16, device="meta", requires_grad=False):
    return torch.empty(*shape, dtype=dtype, device=device, requires_grad=requires_grad)


# ---- schema and registrations ------------------------------------------------------------------------

def test_schema():
    schema = OP._schema
    args = [(a.name, str(a.type)) for a in schema.arguments]
    assert args == [
        ("q", "Tensor"), ("k", "Tensor"), ("v", "Tensor"),
        ("cu_seqlens_q", "Optional[Tensor]"), ("cu_seqlens_k", "Optional[Tensor]"),
        ("seqused_q", "Optional[Tensor]"), ("seqused_k", "Optional[Tensor]"),
        ("max_seqlen_q", "int"), ("max_seqlen_k", "int"), ("softmax_scale", "float"), ("causal", "bool"),
        ("window_left", "int"), ("window_right", "int"), ("softcap", "float"), ("path", "int"),
        ("deterministic", "bool"), ("pack_gqa", "int"), ("num_splits", "int"),
    ]
    # deterministic (used by the backward only), pack_gqa (0: heuristic) and num_splits (0: the library
    # may split the tail) have defaults, so a graph that omits them stays valid.
    assert schema.arguments[-3].default_value is False
    assert schema.arguments[-2].default_value == 0
    assert schema.arguments[-1].default_value == 0
    assert all(a.default_value is None for a in schema.arguments[:-3])
    assert [str(r.type) for r in schema.returns] == ["Tensor", "Tensor"]
    # A functional op: no input is mutated or aliased by an output.
    assert not schema.is_mutable
    assert all(a.alias_info is None for a in schema.arguments)
    assert all(r.alias_info is None for r in schema.returns)


def test_bwd_schema():
    schema = BWD_OP._schema
    args = [(a.name, str(a.type)) for a in schema.arguments]
    assert args == [
        ("dout", "Tensor"), ("q", "Tensor"), ("k", "Tensor"), ("v", "Tensor"), ("out", "Tensor"), ("lse", "Tensor"),
        ("dlse", "Optional[Tensor]"),
        ("cu_seqlens_q", "Optional[Tensor]"), ("cu_seqlens_k", "Optional[Tensor]"),
        ("seqused_q", "Optional[Tensor]"), ("seqused_k", "Optional[Tensor]"),
        ("max_seqlen_q", "int"), ("max_seqlen_k", "int"), ("softmax_scale", "float"), ("causal", "bool"),
        ("window_left", "int"), ("window_right", "int"), ("softcap", "float"), ("deterministic", "bool"),
        ("path", "int"),
    ]
    assert [str(r.type) for r in schema.returns] == ["Tensor", "Tensor", "Tensor"]
    assert not schema.is_mutable
    assert all(a.alias_info is None for a in schema.arguments)
    assert all(r.alias_info is None for r in schema.returns)


@pytest.mark.parametrize("op", ["flashtile::fwd", "flashtile::bwd"])
def test_dispatch_registrations(op):
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has(op, "CUDA")
    assert has(op, "Meta")       # the fake implementation
    assert not has(op, "CPU")    # CUDA only: CPU tensors never reach a kernel
    if op == "flashtile::fwd":
        assert has(op, "Autograd")   # the autograd registration


def test_op_on_cpu_tensors_is_not_dispatched():
    q = torch.zeros(1, 2, 1, 64, dtype=BF16)
    with pytest.raises(NotImplementedError):
        _fwd(q, q, q, max_q=2, max_k=2)
    lse = torch.zeros(1, 1, 2)
    with pytest.raises(NotImplementedError):
        _bwd(q, q, q, q, q, lse, max_q=2, max_k=2)


# ---- fake implementation -----------------------------------------------------------------------------

PADDED = [  # b, sq, sk, h, hk, d, dv
    (2, 5, 7, 4, 2, 128, 128),
    (1, 1, 4096, 8, 1, 64, 64),
    (3, 17, 3, 6, 6, 192, 128),
    (2, 0, 9, 4, 4, 256, 256),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("b, sq, sk, h, hk, d, dv", PADDED)
def test_fake_padded_shapes_meta(dtype, b, sq, sk, h, hk, d, dv):
    q, k, v = _empty(b, sq, h, d, dtype=dtype), _empty(b, sk, hk, d, dtype=dtype), _empty(b, sk, hk, dv, dtype=dtype)
    out, lse = _fwd(q, k, v, max_q=sq, max_k=sk)
    assert out.shape == (b, sq, h, dv) and out.dtype == dtype and out.device.type == "meta"
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.device.type == "meta"


@pytest.mark.parametrize("d, dv", [(128, 128), (192, 128), (64, 64)])
def test_fake_varlen_shapes_meta(d, dv):
    total_q, total_k, h, hk = 11, 23, 6, 2
    q, k, v = _empty(total_q, h, d), _empty(total_k, hk, d), _empty(total_k, hk, dv)
    cu_q = torch.empty(4, dtype=torch.int32, device="meta")
    cu_k = torch.empty(4, dtype=torch.int32, device="meta")
    out, lse = _fwd(q, k, v, cu_q, cu_k, max_q=7, max_k=12)
    assert out.shape == (total_q, h, dv) and out.dtype == BF16
    assert lse.shape == (h, total_q) and lse.dtype == torch.float32
    # Varlen q against a padded KV cache (seqused_k), as flash_attn_with_kvcache does.
    kc, vc = _empty(3, 40, hk, d), _empty(3, 40, hk, dv)
    used = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse = _fwd(q, kc, vc, cu_q, None, None, used, max_q=7, max_k=40)
    assert out.shape == (total_q, h, dv) and lse.shape == (h, total_q)


def test_fake_impl_matches_registered_function():
    q, k, v = _empty(2, 5, 4, 192), _empty(2, 9, 2, 192), _empty(2, 9, 2, 128)
    out, lse = ops._fwd_fake(q, k, v, None, None, None, None, 5, 9, 0.1, True, -1, 0, 0.0, 0)
    assert out.shape == (2, 5, 4, 128) and out.dtype == BF16
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    out2, lse2 = _fwd(q, k, v, max_q=5, max_k=9, causal=True, right=0)
    assert out2.shape == out.shape and lse2.shape == lse.shape


BWD_PADDED = [  # b, sq, sk, h, hk, d, dv
    (2, 5, 7, 4, 2, 128, 128),   # GQA
    (1, 1, 4096, 8, 1, 64, 64),  # MQA
    (3, 17, 3, 6, 6, 192, 128),
    (2, 0, 9, 4, 4, 256, 256),
]


def _bwd_inputs(q, k, v, lse_shape, dtype):
    out = _empty(*q.shape[:-1], v.shape[-1], dtype=dtype, device=q.device)
    return torch.empty_like(out), out, torch.empty(lse_shape, dtype=torch.float32, device=q.device)


@pytest.mark.parametrize("dlse", [False, True], ids=["no-dlse", "dlse"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("b, sq, sk, h, hk, d, dv", BWD_PADDED)
def test_fake_bwd_padded_shapes_meta(dtype, b, sq, sk, h, hk, d, dv, dlse):
    q, k, v = _empty(b, sq, h, d, dtype=dtype), _empty(b, sk, hk, d, dtype=dtype), _empty(b, sk, hk, dv, dtype=dtype)
    dout, out, lse = _bwd_inputs(q, k, v, (b, h, sq), dtype)
    dq, dk, dv_ = _bwd(dout, q, k, v, out, lse, torch.empty_like(lse) if dlse else None, max_q=sq, max_k=sk,
                       deterministic=dlse)
    for g, like in ((dq, q), (dk, k), (dv_, v)):
        assert g.shape == like.shape and g.dtype == dtype and g.device.type == "meta"
        assert g.is_contiguous()


@pytest.mark.parametrize("d, dv", [(128, 128), (192, 128), (64, 64)])
def test_fake_bwd_varlen_shapes_meta(d, dv):
    total_q, total_k, h, hk = 11, 23, 6, 2
    q, k, v = _empty(total_q, h, d), _empty(total_k, hk, d), _empty(total_k, hk, dv)
    cu_q = torch.empty(4, dtype=torch.int32, device="meta")
    cu_k = torch.empty(4, dtype=torch.int32, device="meta")
    dout, out, lse = _bwd_inputs(q, k, v, (h, total_q), BF16)
    dq, dk, dv_ = _bwd(dout, q, k, v, out, lse, None, cu_q, cu_k, max_q=7, max_k=12)
    assert (dq.shape, dk.shape, dv_.shape) == ((total_q, h, d), (total_k, hk, d), (total_k, hk, dv))
    # Varlen q against a padded KV cache with seqused_k.
    kc, vc = _empty(3, 40, hk, d), _empty(3, 40, hk, dv)
    used = torch.empty(3, dtype=torch.int32, device="meta")
    dq, dk, dv_ = _bwd(dout, q, kc, vc, out, lse, torch.empty_like(lse), cu_q, None, None, used, max_q=7, max_k=40)
    assert (dq.shape, dk.shape, dv_.shape) == ((total_q, h, d), (3, 40, hk, d), (3, 40, hk, dv))


def test_fake_bwd_impl_matches_registered_function():
    q, k, v = _empty(2, 5, 4, 192), _empty(2, 9, 2, 192), _empty(2, 9, 2, 128)
    dout, out, lse = _bwd_inputs(q, k, v, (2, 4, 5), BF16)
    direct = ops._bwd_fake(dout, q, k, v, out, lse, None, None, None, None, None, 5, 9, 0.1, True, -1, 0, 0.0,
                           False, 0)
    via_op = _bwd(dout, q, k, v, out, lse, max_q=5, max_k=9, causal=True, right=0)
    assert [g.shape for g in direct] == [g.shape for g in via_op] == [q.shape, k.shape, v.shape]


def test_fake_bwd_strided_inputs_give_contiguous_grads():
    """Gradients are always contiguous, whatever the layout of q/k/v (the real op allocates them so)."""
    q = _empty(5, 2, 4, 128).transpose(0, 1)  # (2, 5, 4, 128), seq-major storage
    kv = _empty(2, 7, 2, 2, 128)
    k, v = kv[:, :, 0], kv[:, :, 1]
    dout, out, lse = _bwd_inputs(q, k, v, (2, 4, 5), BF16)
    dq, dk, dv = _bwd(dout, q, k, v, out, lse, max_q=5, max_k=7)
    assert dq.shape == q.shape and dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous()


# ---- autograd registration ---------------------------------------------------------------------------

class _RecordBwd(TorchDispatchMode):
    """Records every flashtile::bwd call (its arguments) made while the mode is active."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is BWD_OP:
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


def _leaf(*shape, dtype=BF16, device="meta"):
    return torch.empty(*shape, dtype=dtype, device=device, requires_grad=True)


def _grads(outputs, inputs, grad_outputs):
    with _RecordBwd() as rec:
        grads = torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True)
    return grads, rec.calls


def test_autograd_outputs_track_inputs():
    q = _empty(2, 5, 4, 128, requires_grad=True)
    k, v = _empty(2, 7, 2, 128), _empty(2, 7, 2, 128)
    out, lse = _fwd(q, k, v, max_q=5, max_k=7)
    assert out.requires_grad and out.grad_fn is not None
    assert "flashtile" in type(out.grad_fn).__name__


@pytest.mark.parametrize("deterministic", [False, True])
def test_autograd_calls_bwd_with_the_forward_arguments(deterministic):
    q, k, v = _leaf(2, 5, 6, 192), _leaf(2, 7, 2, 192), _leaf(2, 7, 2, 128)
    out, lse = _fwd(q, k, v, max_q=5, max_k=7, scale=0.3, causal=True, left=4, right=0, softcap=30.0, path=1,
                    deterministic=deterministic)
    dout, dlse = torch.empty_like(out), torch.empty_like(lse)
    (dq, dk, dv), calls = _grads((out, lse), (q, k, v), (dout, dlse))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == BF16
    (args,) = calls
    assert args[0] is dout and args[1] is q and args[2] is k and args[3] is v
    assert args[4].shape == out.shape and args[5].shape == lse.shape and args[6] is dlse
    assert args[7:11] == (None, None, None, None)
    assert args[11:] == (5, 7, 0.3, True, 4, 0, 30.0, deterministic, 1)


def test_autograd_unused_outputs():
    """An output the loss does not use sends no gradient: dlse is None then (no buffer is made), and
    a loss of lse alone gets a zero dout."""
    q, k, v = _leaf(2, 5, 4, 64), _leaf(2, 9, 1, 64), _leaf(2, 9, 1, 64)
    out, lse = _fwd(q, k, v, max_q=5, max_k=9)
    dout = torch.empty_like(out)
    (dq, dk, dv), calls = _grads(out, (q, k, v), dout)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert calls[0][0] is dout and calls[0][6] is None
    dlse = torch.empty_like(lse)
    (dq, dk, dv), calls = _grads(lse, (q, k, v), dlse)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert calls[0][0].shape == out.shape and calls[0][0].dtype == out.dtype and calls[0][6] is dlse


def test_autograd_only_some_inputs_require_grad():
    q = _leaf(1, 3, 2, 64)
    k, v = _empty(1, 4, 2, 64), _empty(1, 4, 2, 64)
    out, _ = _fwd(q, k, v, max_q=3, max_k=4)
    (dq,), calls = _grads(out, (q,), torch.empty_like(out))
    assert dq.shape == q.shape and len(calls) == 1
    q = _empty(1, 3, 2, 64)
    v = _leaf(1, 4, 2, 64)
    out, _ = _fwd(q, k, v, max_q=3, max_k=4)
    (dv,), _ = _grads(out, (v,), torch.empty_like(out))
    assert dv.shape == v.shape


def test_autograd_varlen_passes_sequence_tensors():
    total_q, total_k, h, hk, d = 11, 23, 6, 2, 128
    q, k, v = _leaf(total_q, h, d), _leaf(total_k, hk, d), _leaf(total_k, hk, d)
    cu_q = torch.empty(4, dtype=torch.int32, device="meta")
    cu_k = torch.empty(4, dtype=torch.int32, device="meta")
    used_k = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse = _fwd(q, k, v, cu_q, cu_k, None, used_k, max_q=7, max_k=12, causal=True, right=0)
    (dq, dk, dv), calls = _grads(out, (q, k, v), torch.empty_like(out))
    assert (dq.shape, dk.shape, dv.shape) == ((total_q, h, d), (total_k, hk, d), (total_k, hk, d))
    (args,) = calls
    assert args[7] is cu_q and args[8] is cu_k and args[9] is None and args[10] is used_k
    assert args[11:13] == (7, 12)


def test_backward_through_autograd_backward_accumulates_grads():
    q, k, v = _leaf(2, 5, 4, 96), _leaf(2, 6, 4, 96), _leaf(2, 6, 4, 96)
    out, lse = _fwd(q, k, v, max_q=5, max_k=6)
    with _RecordBwd() as rec:
        (out.float().sum() + lse.sum()).backward()
    assert len(rec.calls) == 1
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_no_grad_outputs_without_grad_fn():
    q = _empty(1, 3, 2, 64, requires_grad=True)
    k = v = _empty(1, 3, 2, 64)
    with torch.no_grad():
        out, lse = _fwd(q, k, v, max_q=3, max_k=3)
    assert out.grad_fn is None and not out.requires_grad
    out, lse = _fwd(q.detach(), k, v, max_q=3, max_k=3)
    assert out.grad_fn is None


# ---- public API under FakeTensorMode with fake CUDA tensors ------------------------------------------

@pytest.fixture
def fake_cuda():
    mode = FakeTensorMode()
    try:
        with mode:
            torch.empty(1, device="cuda")
    except Exception as e:  # noqa: BLE001 - depends on how this torch build was compiled
        pytest.skip(f"this torch build cannot make fake CUDA tensors: {e}")
    return mode


@pytest.fixture
def recorded(monkeypatch):
    """Records the kernel requests and op arguments the API produces; any request counts as built."""
    calls = {"require": [], "op": []}

    def require_kernel(**kw):
        calls["require"].append(kw)
        return ("fake",)

    real_op = interface._fwd_op

    def op(*args):
        calls["op"].append(args)
        return real_op(*args)

    monkeypatch.setattr(interface, "require_kernel", require_kernel)
    monkeypatch.setattr(interface, "_fwd_op", op)
    monkeypatch.setattr(_lib, "lib", lambda: pytest.fail("the library was loaded under FakeTensorMode"))
    return calls


def _fake_qkv(b, sq, sk, h, hk, d, dv=None, dtype=BF16):
    dv = d if dv is None else dv
    return (torch.empty(b, sq, h, d, dtype=dtype, device="cuda"), torch.empty(b, sk, hk, d, dtype=dtype, device="cuda"),
            torch.empty(b, sk, hk, dv, dtype=dtype, device="cuda"))


def test_api_padded_under_fake_mode(fake_cuda, recorded):
    with fake_cuda:
        q, k, v = _fake_qkv(2, 5, 7, 6, 2, 192, 128)
        out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        assert out.shape == (2, 5, 6, 128) and out.dtype == BF16 and out.device.type == "cuda"
        assert lse.shape == (2, 6, 5) and lse.dtype == torch.float32
        out = flashtile.flash_attn_func(q, k, v, window_size=(3, -1), softcap=30.0, softmax_scale=0.5, path="ampere",
                                        pack_gqa=True)
        assert out.shape == (2, 5, 6, 128)
    req1, req2 = recorded["require"]
    assert req1 == dict(op="fwd", dtype="bf16", head_dim=192, head_dim_v=128, band=True, softcap=False, path="auto")
    assert req2 == dict(op="fwd", dtype="bf16", head_dim=192, head_dim_v=128, band=True, softcap=True, path="ampere")
    a1, a2 = recorded["op"]
    # (..., max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, path,
    #  deterministic, pack_gqa (0 heuristic, 1 on, -1 off), num_splits (0: the library's tail split))
    assert a1[7:] == (5, 7, pytest.approx(192 ** -0.5), True, -1, 0, 0.0, _lib.PATHS["auto"], False, 0, 0)
    assert a2[7:] == (5, 7, 0.5, False, 3, -1, 30.0, _lib.PATHS["ampere"], False, 1, 0)


@pytest.mark.parametrize("window, causal, band", [((-1, -1), False, False), ((-1, -1), True, True),
                                                  ((0, -1), False, True), ((-1, 0), False, True),
                                                  ((8, 8), True, True)])
def test_api_band_flag(fake_cuda, recorded, window, causal, band):
    with fake_cuda:
        q, k, v = _fake_qkv(1, 4, 4, 2, 2, 64, dtype=torch.float16)
        flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window)
    (req,) = recorded["require"]
    assert req["band"] is band and req["dtype"] == "fp16" and req["softcap"] is False
    (args,) = recorded["op"]
    assert args[10] is causal and args[11] == window[0] and args[12] == (0 if causal else window[1])


def test_api_varlen_kvcache_qkvpacked_under_fake_mode(fake_cuda, recorded):
    with fake_cuda:
        q = torch.empty(11, 4, 128, dtype=BF16, device="cuda")
        k = v = torch.empty(23, 2, 128, dtype=BF16, device="cuda")
        cu_q = torch.empty(4, dtype=torch.int32, device="cuda")
        cu_k = torch.empty(4, dtype=torch.int32, device="cuda")
        out, lse = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 12, return_attn_probs=True)
        assert out.shape == (11, 4, 128) and lse.shape == (4, 11)

        qc, kc, vc = _fake_qkv(3, 1, 64, 8, 2, 128)
        out, lse = flashtile.flash_attn_with_kvcache(qc, kc, vc, cache_seqlens=10, causal=True, return_softmax_lse=True)
        assert out.shape == (3, 1, 8, 128) and lse.shape == (3, 8, 1)
        used = torch.empty(3, dtype=torch.int32, device="cuda")
        q5 = torch.empty(5, 4, 128, dtype=BF16, device="cuda")
        out = flashtile.flash_attn_with_kvcache(q5, kc, vc, cache_seqlens=used, cu_seqlens_q=cu_q, max_seqlen_q=3)
        assert out.shape == (5, 4, 128)

        qkv = torch.empty(2, 9, 3, 4, 64, dtype=BF16, device="cuda")
        assert flashtile.flash_attn_qkvpacked_func(qkv).shape == (2, 9, 4, 64)
        qkv = torch.empty(2, 9, 8, 64, dtype=BF16, device="cuda")
        out, lse = flashtile.flash_attn_qkvpacked_func(qkv, num_heads_q=4, return_attn_probs=True)
        assert out.shape == (2, 9, 4, 64) and lse.shape == (2, 4, 9)
    ops_args = recorded["op"]
    assert ops_args[0][7:9] == (6, 12)
    # kvcache: padded cache, seqused_k from cache_seqlens, max_seqlen_k = cache capacity.
    assert ops_args[1][6] is not None and ops_args[1][6].shape == (3,) and ops_args[1][6].dtype == torch.int32
    assert ops_args[1][7:9] == (1, 64)
    assert ops_args[2][3] is not None and ops_args[2][4] is None and ops_args[2][7:9] == (3, 64)


def test_api_validation_runs_under_fake_mode(fake_cuda, recorded):
    with fake_cuda:
        q, k, v = _fake_qkv(2, 5, 7, 4, 3, 128)
        with pytest.raises(ValueError, match=r"\bk has 3 heads"):
            flashtile.flash_attn_func(q, k, v)
        q, k, v = _fake_qkv(2, 5, 7, 4, 2, 128)
        with pytest.raises(ValueError, match=r"stride\(2\) = 132"):
            q = torch.empty(2, 5, 4, 132, dtype=BF16, device="cuda").as_strided((2, 5, 4, 128), (5 * 4 * 132, 4 * 132, 132, 1))
            flashtile.flash_attn_func(q, k, v)
    assert recorded["op"] == []


def test_kvcache_device_check_names_cache_seqlens(fake_cuda, recorded):
    """flash_attn_with_kvcache's cache lengths are checked under its own argument name (the op calls
    them seqused_k)."""
    with fake_cuda:
        q, k_cache, v_cache = _fake_qkv(2, 1, 16, 4, 2, 128)
        lens = torch.tensor([3, 16], dtype=torch.int32)  # on the CPU
        with pytest.raises(ValueError, match=r"^flashtile: cache_seqlens must be on a CUDA device, got cpu"):
            flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)
    assert recorded["op"] == []


def test_fake_cuda_outputs_keep_device(fake_cuda):
    with fake_cuda:
        q, k, v = _fake_qkv(2, 3, 4, 2, 1, 64)
        out, lse = _fwd(q, k, v, max_q=3, max_k=4, scale=1 / math.sqrt(64))
        assert out.device == q.device and lse.device == q.device
        assert out.shape == (2, 3, 2, 64) and lse.shape == (2, 2, 3)


def test_api_passes_deterministic_through(fake_cuda, recorded):
    with fake_cuda:
        q, k, v = _fake_qkv(2, 5, 7, 4, 2, 128)
        flashtile.flash_attn_func(q, k, v, deterministic=True)
        flashtile.flash_attn_func(q, k, v)
        qp = torch.empty(11, 4, 128, dtype=BF16, device="cuda")
        kp = torch.empty(23, 2, 128, dtype=BF16, device="cuda")
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        flashtile.flash_attn_varlen_func(qp, kp, kp, cu, cu, 6, 12, deterministic=True)
        flashtile.flash_attn_varlen_func(qp, kp, kp, cu, cu, 6, 12)
        qkv = torch.empty(2, 9, 3, 4, 64, dtype=BF16, device="cuda")
        flashtile.flash_attn_qkvpacked_func(qkv, deterministic=True)
        flashtile.flash_attn_qkvpacked_func(qkv.flatten(2, 3), num_heads_q=4)
        flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=3)
    # deterministic is the op's last argument; the KV-cache API has none (False).
    assert [a[15] for a in recorded["op"]] == [True, False, True, False, True, False, False]
    assert all(type(a[15]) is bool for a in recorded["op"])


def test_api_passes_num_splits_through(fake_cuda, recorded):
    """num_splits reaches the op as its last argument: 0 (flashtile's default, the library's tail split)
    unless 1 (never split) is asked for; None and 0 are the default."""
    with fake_cuda:
        q, k, v = _fake_qkv(2, 5, 7, 4, 2, 128)
        flashtile.flash_attn_func(q, k, v)
        flashtile.flash_attn_func(q, k, v, num_splits=1)
        flashtile.flash_attn_func(q, k, v, num_splits=None)
        qp = torch.empty(11, 4, 128, dtype=BF16, device="cuda")
        kp = torch.empty(23, 2, 128, dtype=BF16, device="cuda")
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        flashtile.flash_attn_varlen_func(qp, kp, kp, cu, cu, 6, 12)
        flashtile.flash_attn_varlen_func(qp, kp, kp, cu, cu, 6, 12, num_splits=1)
        flashtile.flash_attn_qkvpacked_func(torch.empty(2, 9, 3, 4, 64, dtype=BF16, device="cuda"))
        flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=3)
        flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=3, num_splits=1)
        with pytest.raises(NotImplementedError, match=r"split-KV \(num_splits=2\)"):
            flashtile.flash_attn_func(q, k, v, num_splits=2)
    assert [a[17] for a in recorded["op"]] == [0, 1, 0, 0, 1, 0, 0, 1]
    assert all(type(a[17]) is int and len(a) == 18 for a in recorded["op"])


@pytest.fixture(params=["meta", "fake-cuda"])
def api_device(request, monkeypatch):
    """Where the public API's backward is traced: meta tensors (the device check, which wants CUDA,
    switched off), or fake CUDA tensors under FakeTensorMode (what torch.compile's AOTAutograd traces;
    the autograd engine needs a CUDA build of torch for those, even fake)."""
    if request.param == "meta":
        monkeypatch.setattr(interface.V, "check_same_device", lambda tensors: None)
        yield "meta", contextlib.nullcontext()
        return
    if torch.version.cuda is None:
        pytest.skip("autograd on fake CUDA tensors needs a CUDA build of torch (this one aborts)")
    yield "cuda", request.getfixturevalue("fake_cuda")


def test_api_backward(api_device, recorded):
    """The public API's outputs differentiate through flashtile::bwd, gradients shaped like the inputs."""
    device, mode = api_device
    with mode:
        q = torch.empty(2, 5, 6, 192, dtype=BF16, device=device, requires_grad=True)
        k = torch.empty(2, 7, 2, 192, dtype=BF16, device=device, requires_grad=True)
        v = torch.empty(2, 7, 2, 128, dtype=BF16, device=device, requires_grad=True)
        out, lse = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True, return_attn_probs=True)
        with _RecordBwd() as rec:
            dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (torch.ones_like(out), torch.ones_like(lse)))
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        assert dq.device.type == device and dq.dtype == BF16
        (args,) = rec.calls
        assert args[11:] == (5, 7, pytest.approx(192 ** -0.5), True, -1, 0, 0.0, True, _lib.PATHS["auto"])

        # qkv-packed: q, k, v are views of one tensor; their gradients are assembled into qkv's.
        qkv = torch.empty(2, 9, 3, 4, 64, dtype=BF16, device=device, requires_grad=True)
        flashtile.flash_attn_qkvpacked_func(qkv).sum().backward()
        assert qkv.grad.shape == qkv.shape
        qkv = torch.empty(2, 9, 8, 64, dtype=BF16, device=device, requires_grad=True)
        flashtile.flash_attn_qkvpacked_func(qkv, num_heads_q=4).sum().backward()
        assert qkv.grad.shape == qkv.shape

        qp = torch.empty(11, 4, 128, dtype=BF16, device=device, requires_grad=True)
        kp = torch.empty(23, 2, 128, dtype=BF16, device=device, requires_grad=True)
        cu = torch.empty(4, dtype=torch.int32, device=device)
        out = flashtile.flash_attn_varlen_func(qp, kp, kp, cu, cu, 6, 12)
        with _RecordBwd() as rec:
            dq, dkv = torch.autograd.grad(out, (qp, kp), torch.ones_like(out))
        assert dq.shape == qp.shape and dkv.shape == kp.shape
        (args,) = rec.calls
        assert args[6] is None and args[7] is cu and args[8] is cu and args[18] is False
