"""PyTorch integration on the GPU: CUDA graph capture and replay, torch.compile(fullgraph=True), launches
on the current stream, tensors on a non-current device, and the per-call host overhead.
"""
import sys
import time
import zlib

import pytest
import torch

import flashtile
from flashtile import LibraryNotAvailableError, flash_attn_func
from flashtile.build_config import find_kernels
from flashtile.reference import attention_ref
from flashtile.testing import check_close, random_qkv

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BC = sys.modules["flashtile.build_config"]  # the module (flashtile.build_config is the function)


def _pick(band=True):
    """A built (dtype, d, dv) for the band and no-band kernels, preferring bf16 and hdim 128."""
    try:
        cfg = flashtile.build_config()
    except LibraryNotAvailableError:
        pytest.skip("compiled flashtile library not available")
    hdims = sorted((tuple(hd) for hd in cfg["head_dims"]), key=lambda hd: (hd != (128, 128), hd))
    for name in DTYPES:
        for d, dv in hdims:
            if all(find_kernels(op="fwd", dtype=name, head_dim=d, head_dim_v=dv, band=b, softcap=False)
                   for b in ({False, True} if band else {False})):
                return DTYPES[name], d, dv
    pytest.skip("no forward kernel built")


@pytest.fixture
def seed(request):
    return zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF


def _check_ref(name, out, q, k, v, **kw):
    check_close(name, out, attention_ref(q, k, v, **kw), attention_ref(q, k, v, upcast=False, **kw))


def test_cuda_graph_capture_and_replay(seed):
    dtype, d, dv = _pick()
    shape = (2, 300, 451, 6, 2, d, dv)
    static = [t.clone() for t in random_qkv(*shape, dtype=dtype, device="cuda", seed=seed)]

    # Warm-up on a side stream (loads the library, sets kernel attributes) as CUDA graphs require.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            flash_attn_func(*static, causal=True, return_attn_probs=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = flash_attn_func(*static, causal=True, return_attn_probs=True)

    for i in range(2):
        new = random_qkv(*shape, dtype=dtype, device="cuda", seed=seed + 1 + i)
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        out, lse = flash_attn_func(*new, causal=True, return_attn_probs=True)
        assert torch.equal(g_out, out) and torch.equal(g_lse, lse)
        _check_ref(f"graph replay {i}", g_out, *new, causal=True)


def _attn_block(q, k, v):
    return flash_attn_func(q * 2, k, v, causal=True) + 1


@pytest.mark.timeout(300)
def test_torch_compile_fullgraph_matches_eager(seed):
    dtype, d, dv = _pick()
    torch._dynamo.reset()
    q, k, v = random_qkv(2, 257, 300, 4, 2, d, dv, dtype=dtype, device="cuda", seed=seed)
    eager = _attn_block(q, k, v)
    compiled = torch.compile(_attn_block, fullgraph=True)
    out = compiled(q, k, v)
    assert out.shape == eager.shape and out.dtype == eager.dtype
    assert torch.equal(out, eager)
    attn = flash_attn_func(q * 2, k, v, causal=True)
    assert torch.equal(eager, attn + 1)
    _check_ref("eager attention", attn, q * 2, k, v, causal=True)
    # Another shape: recompiles (or runs a dynamic graph) and stays correct.
    q, k, v = random_qkv(1, 64, 1000, 4, 2, d, dv, dtype=dtype, device="cuda", seed=seed + 1)
    assert torch.equal(compiled(q, k, v), _attn_block(q, k, v))
    torch._dynamo.reset()


@pytest.mark.timeout(300)
def test_torch_compile_fullgraph_before_any_eager_call(seed):
    """Tracing must not depend on state that only an eager call sets up (e.g. the cached build config)."""
    dtype, d, dv = _pick()
    torch._dynamo.reset()
    BC.build_config.cache_clear()
    q, k, v = random_qkv(2, 129, 129, 4, 4, d, dv, dtype=dtype, device="cuda", seed=seed)
    out = torch.compile(_attn_block, fullgraph=True)(q, k, v)
    assert torch.equal(out, _attn_block(q, k, v))
    torch._dynamo.reset()


def test_runs_on_current_stream(seed):
    dtype, d, dv = _pick()
    q, k, v = (t.clone() for t in random_qkv(2, 500, 700, 4, 2, d, dv, dtype=dtype, device="cuda", seed=seed))
    new = random_qkv(2, 500, 700, 4, 2, d, dv, dtype=dtype, device="cuda", seed=seed + 1)
    flash_attn_func(q, k, v)  # load the library outside the timed region
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # The inputs change only after a long sleep on `stream`; a kernel launched anywhere else
        # (e.g. the default stream) would read the old values.
        torch.cuda._sleep(200_000_000)
        for dst, src in zip((q, k, v), new):
            dst.copy_(src)
        out, lse = flash_attn_func(q, k, v, return_attn_probs=True)
    stream.synchronize()
    _check_ref("side-stream out", out, *new)
    torch.cuda.synchronize()


def test_tile_counter_kept_zero_per_stream(seed):
    """Eager forwards share one tile counter per (device, stream) that every launch leaves at zero:
    back-to-back launches of different shapes and masks on two streams at once (each launch draws from
    its stream's counter) stay correct, and both counters read zero afterwards."""
    from flashtile import ops
    dtype, d, dv = _pick()
    shapes = [(2, 700, 700, 4, 2), (1, 1000, 333, 8, 8), (3, 129, 1500, 4, 1)]
    cases = [random_qkv(*shape, d, dv, dtype=dtype, device="cuda", seed=seed + i) for i, shape in enumerate(shapes)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for rep in range(2):
        for stream in streams:
            with torch.cuda.stream(stream):
                for i, qkv in enumerate(cases):
                    for causal in (True, False):
                        outs.append((f"stream {streams.index(stream)} rep {rep} case {i} causal={causal}",
                                     flash_attn_func(*qkv, causal=causal), qkv, causal))
    torch.cuda.synchronize()
    for name, out, qkv, causal in outs:
        _check_ref(name, out, *qkv, causal=causal)
    dev = torch.cuda.current_device()
    for stream in streams:
        assert not ops._kept_counters[(dev, stream.cuda_stream)].any()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs")
def test_tensors_on_non_current_device(seed):
    dtype, d, dv = _pick()
    torch.cuda.set_device(0)
    dev = torch.device("cuda:1")
    q, k, v = random_qkv(2, 300, 451, 6, 2, d, dv, dtype=dtype, device=dev, seed=seed)
    out, lse = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.device == dev and lse.device == dev
    assert torch.cuda.current_device() == 0, "the call changed the current device"
    torch.cuda.synchronize(dev)
    _check_ref("cuda:1 out", out, q, k, v, causal=True)
    # And on a side stream of that device.
    stream = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(stream):
        out2 = flash_attn_func(q, k, v, causal=True)
    stream.synchronize()
    assert torch.equal(out, out2)
    assert torch.cuda.current_device() == 0


def test_host_overhead_per_call():
    dtype, d, dv = _pick(band=False)
    q, k, v = random_qkv(1, 1, 1, 1, 1, d, dv, dtype=dtype, device="cuda", seed=0)
    for _ in range(20):
        flash_attn_func(q, k, v)
    torch.cuda.synchronize()
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        flash_attn_func(q, k, v)
    torch.cuda.synchronize()
    per_call = (time.perf_counter() - t0) / n
    print(f"\nflashtile host overhead: {per_call * 1e6:.1f} us per flash_attn_func call "
          f"(b=1, s=1, h=1, d={d}, {str(dtype).replace('torch.', '')}, {n} calls)")
    assert per_call < 1e-3
