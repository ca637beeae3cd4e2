"""The `flashtile::fwd` custom op without a GPU: its schema, dispatch registrations, fake (shape)
implementation and autograd registration, and the public API traced under FakeTensorMode.

Meta tensors exercise the fake implementation and autograd directly; FakeTensorMode with "cuda"
fake tensors exercises the path torch.compile/export take (skipped where this torch build cannot make
fake CUDA tensors). Nothing here runs a kernel.
"""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flashtile
from flashtile import _lib, interface, ops

OP = torch.ops.flashtile.fwd.default
BF16 = torch.bfloat16


def _fwd(q, k, v, cu_q=None, cu_k=None, used_q=None, used_k=None, max_q=0, max_k=0, *, scale=0.125,
         causal=False, left=-1, right=-1, softcap=0.0, path=0):
    return torch.ops.flashtile.fwd(q, k, v, cu_q, cu_k, used_q, used_k, max_q, max_k, scale, causal, left, right,
                                   softcap, path)


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
    ]
    assert [str(r.type) for r in schema.returns] == ["Tensor", "Tensor"]
    # A functional op: no input is mutated or aliased by an output.
    assert not schema.is_mutable
    assert all(a.alias_info is None for a in schema.arguments)
    assert all(r.alias_info is None for r in schema.returns)


def test_dispatch_registrations():
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has("flashtile::fwd", "CUDA")
    assert has("flashtile::fwd", "Meta")       # the fake implementation
    assert has("flashtile::fwd", "Autograd")   # the autograd registration
    assert not has("flashtile::fwd", "CPU")    # CUDA only: CPU tensors never reach a kernel


def test_op_on_cpu_tensors_is_not_dispatched():
    q = torch.zeros(1, 2, 1, 64, dtype=BF16)
    with pytest.raises(NotImplementedError):
        _fwd(q, q, q, max_q=2, max_k=2)


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


# ---- autograd registration ---------------------------------------------------------------------------

def test_autograd_outputs_track_inputs_and_backward_raises():
    q = _empty(2, 5, 4, 128, requires_grad=True)
    k, v = _empty(2, 7, 2, 128), _empty(2, 7, 2, 128)
    out, lse = _fwd(q, k, v, max_q=5, max_k=7)
    assert out.requires_grad and out.grad_fn is not None
    assert "flashtile" in type(out.grad_fn).__name__
    with pytest.raises(NotImplementedError, match=r"backward pass is not implemented"):
        out.sum().backward()


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
        out = flashtile.flash_attn_func(q, k, v, window_size=(3, -1), softcap=30.0, softmax_scale=0.5, path="ampere")
        assert out.shape == (2, 5, 6, 128)
    req1, req2 = recorded["require"]
    assert req1 == dict(op="fwd", dtype="bf16", head_dim=192, head_dim_v=128, band=True, softcap=False, path="auto")
    assert req2 == dict(op="fwd", dtype="bf16", head_dim=192, head_dim_v=128, band=True, softcap=True, path="ampere")
    a1, a2 = recorded["op"]
    # (..., max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, path)
    assert a1[7:] == (5, 7, pytest.approx(192 ** -0.5), True, -1, 0, 0.0, _lib.PATHS["auto"])
    assert a2[7:] == (5, 7, 0.5, False, 3, -1, 30.0, _lib.PATHS["ampere"])


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


def test_fake_cuda_outputs_keep_device(fake_cuda):
    with fake_cuda:
        q, k, v = _fake_qkv(2, 3, 4, 2, 1, 64)
        out, lse = _fwd(q, k, v, max_q=3, max_k=4, scale=1 / math.sqrt(64))
        assert out.device == q.device and lse.device == q.device
        assert out.shape == (2, 3, 2, 64) and lse.shape == (2, 2, 3)
