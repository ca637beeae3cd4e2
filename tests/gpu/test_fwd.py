"""Forward-pass accuracy on the GPU against the float32 reference, with FlashAttention-3's tolerance rule.

Every kernel result must satisfy max|out - ref_fp32| <= 2 * max|ref_lowp - ref_fp32| + floor
(flashtile.testing.check_close), where ref_lowp is the same math done naively in the input dtype; the
LSE is checked the same way, and rows that see no key must give exactly 0 and lse = -inf. Inputs are
fresh N(0, 1) tensors (seeded per test); outputs are poisoned through the allocator (see
poison_allocator) so that any element the kernel fails to write is NaN and fails the check.

Covered: every built dtype and head dim, the "ampere" and "auto" paths, causal, local windows,
softcap, MHA/GQA/MQA, batch 1 and 3, odd and unequal sequence lengths, fully masked rows, varlen
(empty sequences included), seqused_q/k, KV caches, head dims inside a bucket, strided views, the
qkv-packed layout, determinism, and forward calls with inputs that require grad (the backward pass
itself is tested in test_bwd.py).
"""
import zlib

import pytest
import torch

import flashtile
from flashtile import (KernelNotBuiltError, LibraryNotAvailableError, flash_attn_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_func, flash_attn_with_kvcache)
from flashtile.build_config import HEAD_DIM_BUCKETS, find_kernels
from flashtile.reference import attention_ref
from flashtile.testing import check_close, generate_cu_seqlens, random_qkv

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _built_head_dims():
    try:
        return [tuple(hd) for hd in flashtile.build_config()["head_dims"]]
    except LibraryNotAvailableError:
        return [(128, 128)]  # placeholder: every GPU test is skipped without the library


HEAD_DIMS = _built_head_dims()
HDIM_IDS = [f"d{d}" if d == dv else f"d{d}x{dv}" for d, dv in HEAD_DIMS]


def require_built(dtype_name, d, dv, *, band=False, softcap=False, path="auto"):
    if not find_kernels(op="fwd", dtype=dtype_name, head_dim=d, head_dim_v=dv, band=band, softcap=softcap, path=path):
        pytest.skip(f"not built: fwd {dtype_name} hdim {d}x{dv} band={band} softcap={softcap} path={path}")


@pytest.fixture
def seed(request):
    """A different, reproducible seed for every test (and parameter set)."""
    return zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF


# ---- output poisoning --------------------------------------------------------------------------------

class _DeviceBytes:
    """A raw device address range, exposed through __cuda_array_interface__ so torch can write it."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 2}


def poison_allocator(nbytes):
    """Fill every free block of PyTorch's CUDA caching allocator with 0xFF bytes (NaN in fp16, bf16, fp32).

    The op allocates its outputs itself with torch.empty, which hands out a cached free block without
    clearing it; with all free blocks NaN-filled, any output element the kernel does not write stays
    NaN and fails check_close (a real run would see stale, plausible-looking data instead). First a
    block of at least `nbytes` (the coming outputs) is put in each of the allocator's two pools
    (requests <= 1 MiB use the small pool), so the outputs come from cached (poisoned) memory rather
    than from a fresh cudaMalloc.
    """
    device = torch.cuda.current_device()
    torch.cuda.synchronize()
    blocks = [torch.empty(nbytes + (2 << 20), dtype=torch.uint8, device="cuda"),
              torch.empty(1 << 20, dtype=torch.uint8, device="cuda")]
    del blocks
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", device) != device or tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            continue  # other devices, and CUDA graphs' private pools
        for blk in seg["blocks"]:
            if blk["state"] == "inactive":
                torch.as_tensor(_DeviceBytes(blk["address"], blk["size"]), device="cuda").fill_(0xFF)
    torch.cuda.synchronize()


def _out_bytes(q, dv):
    rows = q.numel() // q.shape[-1]
    return rows * dv * q.element_size() + rows * 4


@pytest.mark.parametrize("nbytes", [512, 100_000, 3 << 20, 40 << 20])
def test_poison_allocator_poisons_new_allocations(nbytes):
    keep = torch.randn(1 << 20, device="cuda")  # unrelated live data stays intact
    poison_allocator(nbytes)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        n = max(1, nbytes // torch.tensor([], dtype=dtype).element_size())
        fresh = torch.empty(n, dtype=dtype, device="cuda")
        assert torch.isnan(fresh).all(), f"{dtype}: {int((~torch.isnan(fresh)).sum())} of {n} not poisoned"
        del fresh
    assert torch.isfinite(keep).all()


# ---- helpers -----------------------------------------------------------------------------------------

def _refs(q, k, v, **kw):
    ref, ref_lse = attention_ref(q, k, v, return_lse=True, **kw)
    low, low_lse = attention_ref(q, k, v, upcast=False, return_lse=True, **kw)
    return ref, ref_lse, low, low_lse


def _assert_empty_rows_exact(name, out, lse, ref_lse, varlen=False):
    """Rows with no visible key: output exactly 0 and lse exactly -inf."""
    empty = torch.isneginf(ref_lse)
    rows = empty.transpose(0, 1) if varlen else empty.transpose(1, 2)  # -> out's (rows, heads) layout
    assert torch.all(out[rows] == 0), f"{name}: fully masked rows are not exactly 0"
    assert torch.all(torch.isneginf(lse[empty])), f"{name}: fully masked rows do not have lse -inf"


def _check(name, out, lse, refs, varlen=False):
    ref, ref_lse, low, low_lse = refs
    check_close(name, out, ref, low)
    check_close(f"{name} lse", lse, ref_lse, low_lse)
    _assert_empty_rows_exact(name, out, lse, ref_lse, varlen)


def run_fwd(q, k, v, **kw):
    """flash_attn_func on poisoned memory; returns (out, lse) after checking their layout."""
    dv = v.shape[-1]
    poison_allocator(_out_bytes(q, dv))
    out, lse = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    b, sq, h, _ = q.shape
    assert out.shape == (b, sq, h, dv) and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.device == q.device
    assert out.is_contiguous() and lse.is_contiguous()
    return out, lse


def check_fwd(q, k, v, *, name="out", causal=False, window_size=(-1, -1), softcap=0.0, softmax_scale=None,
              path="auto"):
    out, lse = run_fwd(q, k, v, causal=causal, window_size=window_size, softcap=softcap, softmax_scale=softmax_scale,
                       path=path)
    refs = _refs(q, k, v, causal=causal, window_size=window_size, softcap=softcap, softmax_scale=softmax_scale)
    _check(name, out, lse, refs)
    return out, lse, refs


# ---- the main sweep ----------------------------------------------------------------------------------

SEQLENS = [(1, 1), (1, 4096), (17, 17), (113, 203), (239, 1), (799, 3), (1023, 1024), (4224, 4224)]
LAYOUTS = {"mha-b3": (3, 4, 4), "gqa-b1": (1, 6, 2), "mqa-b3": (3, 4, 1)}  # batch, nheads, nheads_k


@pytest.mark.parametrize("seqlens", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("path", ["ampere", "auto"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd(dtype, hdim, path, causal, layout, seqlens, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=causal, path=path)
    b, h, hk = LAYOUTS[layout]
    sq, sk = seqlens
    q, k, v = random_qkv(b, sq, sk, h, hk, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    out, lse, _ = check_fwd(q, k, v, causal=causal, path=path)
    if causal and sq > sk:
        # Bottom-right aligned: the first sq - sk query rows see no key at all.
        assert torch.all(out[:, : sq - sk] == 0)
        assert torch.all(torch.isneginf(lse[:, :, : sq - sk]))
        assert torch.isfinite(lse[:, :, sq - sk:]).all()


# GQA packing (Hopper forward): the query heads of a group share one tile; groups that divide the tile
# (4, 16) and that do not (6, 7: the last rows of each tile are padding), forced on and off.
PACK_SEQLENS = [(1, 4096), (113, 203), (239, 1), (799, 3), (1023, 1024)]
PACK_HEADS = {"g4-b2": (2, 8, 2), "g6-b1": (1, 12, 2), "g7-b1": (1, 7, 1), "g16-b1": (1, 16, 1)}


@pytest.mark.parametrize("seqlens", PACK_SEQLENS, ids=[f"{a}x{b}" for a, b in PACK_SEQLENS])
@pytest.mark.parametrize("heads", list(PACK_HEADS))
@pytest.mark.parametrize("mask", ["full", "causal", "local"])
@pytest.mark.parametrize("pack", [True, False], ids=["pack", "nopack"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_pack_gqa(dtype, hdim, pack, mask, heads, seqlens, seed):
    d, dv = hdim
    causal, window = mask == "causal", (40, 7) if mask == "local" else (-1, -1)
    require_built(dtype, d, dv, band=mask != "full")
    b, h, hk = PACK_HEADS[heads]
    sq, sk = seqlens
    q, k, v = random_qkv(b, sq, sk, h, hk, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    poison_allocator(_out_bytes(q, dv))
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, pack_gqa=pack, return_attn_probs=True)
    _check("packed out" if pack else "out", out, lse, _refs(q, k, v, causal=causal, window_size=window))


@pytest.mark.parametrize("heads", [(6, 2), (7, 1)], ids=["g3", "g7"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_pack_gqa_bitwise_repeatable(dtype, hdim, heads, seed):
    """Groups that leave padding rows in a packed tile: repeated calls, with other work in between that
    leaves different data in shared memory, give bitwise identical results."""
    d, dv = hdim
    require_built(dtype, d, dv, band=True)
    h, hk = heads
    q, k, v = random_qkv(2, 300, 451, h, hk, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    other = random_qkv(3, 257, 513, 4, 4, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed + 1)
    runs = []
    for i in range(3):
        flash_attn_func(*(t * (i + 1) for t in other), causal=i % 2 == 0)
        runs.append(flash_attn_func(q, k, v, causal=True, pack_gqa=True, return_attn_probs=True))
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])


@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_pack_gqa_varlen(dtype, hdim, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=True)
    lens_q, lens_k = [1, 0, 37, 130, 5], [300, 9, 37, 200, 0]
    q, k, v = _packed(lens_q, lens_k, 8, 2, d, dv, DTYPES[dtype], seed)
    cu_q, cu_k = generate_cu_seqlens(lens_q, "cuda"), generate_cu_seqlens(lens_k, "cuda")
    poison_allocator(_out_bytes(q, dv))
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, pack_gqa=True,
                                      return_attn_probs=True)
    refs = _per_sequence_ref(q, k, v, lens_q, lens_k, causal=True, window_size=(-1, -1))
    _check("packed varlen out", out, lse, refs, varlen=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_long_sequence(dtype, causal, seed):
    """16384 x 16384 with five heads: thousands of tiles, several per CTA (non-causal: pairs of query
    blocks per 2-CTA cluster on Hopper; causal: the dynamic scheduler with (hdim 128) more (head, batch)
    pairs than one L2 section holds, the last section partial). The references are
    computed one head at a time to bound their memory."""
    require_built(dtype, 128, 128, band=causal)
    q, k, v = random_qkv(1, 16384, 16384, 5, 5, 128, 128, dtype=DTYPES[dtype], device="cuda", seed=seed)
    out, lse = run_fwd(q, k, v, causal=causal)
    for h in range(q.shape[2]):
        qh, kh, vh = (t[:, :, h:h + 1] for t in (q, k, v))
        refs = _refs(qh, kh, vh, causal=causal)
        _check(f"head {h}", out[:, :, h:h + 1], lse[:, h:h + 1], refs)
        del refs


@pytest.mark.parametrize("heads", [(16, 16), (16, 4)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_causal_many_pairs(dtype, heads, seed):
    """Causal, 16 x 16 (head, batch) pairs of 1000 queries (last query block partial), MHA and GQA 4:1: on
    Hopper the dynamic scheduler's tile order has lead groups of pairs before its last L2 section
    (d 128), every pair's tiles spread over CTAs."""
    require_built(dtype, 128, 128, band=True)
    h, hk = heads
    q, k, v = random_qkv(16, 1000, 1000, h, hk, 128, 128, dtype=DTYPES[dtype], device="cuda", seed=seed)
    out, lse = run_fwd(q, k, v, causal=True)
    _check("out", out, lse, _refs(q, k, v, causal=True))


# Hopper forward without a band mask on an even number of query blocks: 2-CTA clusters sharing K/V
# through multicast. Last query block partial, keys not a multiple of the tile, more block pairs than
# resident clusters (b 3 x h 8 x 4 pairs), and a shape with one key.
CLUSTER_SEQLENS = [(1000, 777), (256, 4096), (130, 1)]


@pytest.mark.parametrize("seqlens", CLUSTER_SEQLENS, ids=[f"{a}x{b}" for a, b in CLUSTER_SEQLENS])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_cluster_pairs(dtype, hdim, seqlens, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=False)
    sq, sk = seqlens
    q, k, v = random_qkv(3, sq, sk, 8, 8, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    out, lse, _ = check_fwd(q, k, v)
    out2, lse2 = run_fwd(q, k, v)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


# Hopper forward at d <= 128 with 2k-4k query rows (the tile policy's tall tile: 192 rows on three
# consumer warpgroups, chosen by hopper_fwd_tall from seqlen_q 2k, with or without a band mask):
# an odd number of query blocks (4000 rows: 21 blocks, the cluster-less kernel) and an even one (4224
# rows: 22 blocks, 2-CTA clusters), a partial block (without a mask the last one, whose rows past
# seqlen_q are computed and not written; under a causal or local mask the first one, the query blocks
# starting q_shift rows before the sequence: 4100 / 2050 / 4097 rows, whose leading rows load as zeros
# and are not written), fewer keys than queries under the bottom-right causal mask (4000 x 500: the
# shifted first block sees no key and is written as an empty tile), more keys than queries (the
# leading rows see keys), a local window, GQA packing (q_per_tile 48 rows of 4 heads, no shift) and
# varlen sequences on both sides of the threshold.
TALL_CASES = {
    "full-odd": dict(sq=4000, sk=3001, h=2, hk=2, causal=False),
    "full-even": dict(sq=4224, sk=4224, h=2, hk=1, causal=False),
    # The last query block with its third warpgroup's rows (2048: 128 of 192) or its second and third
    # warpgroups' rows (2160: 48 of 192) all past seqlen_q, without a mask: computed, and none written.
    "full-tail": dict(sq=2048, sk=2048, h=3, hk=3, causal=False),
    "full-tail2": dict(sq=2160, sk=2100, h=4, hk=2, causal=False),
    "causal": dict(sq=4100, sk=3900, h=2, hk=2, causal=True),
    "causal-2k": dict(sq=2050, sk=2050, h=2, hk=2, causal=True),
    "causal-few-keys": dict(sq=4000, sk=500, h=2, hk=2, causal=True),
    "causal-more-keys": dict(sq=2050, sk=3000, h=2, hk=1, causal=True),
    "local": dict(sq=4097, sk=4097, h=2, hk=2, window_size=(300, 40)),
    "pack": dict(sq=4096, sk=4096, h=8, hk=2, causal=True, pack_gqa=True),
    # Shifted query blocks across batch elements (the leading rows' negative coordinates must read
    # zeros, not the previous element's rows, and write nothing), no shift at a multiple of 192 under a
    # causal mask, and a shifted local window without a right edge.
    "causal-batch": dict(b=3, sq=2050, sk=2050, h=2, hk=2, causal=True),
    "causal-aligned": dict(b=2, sq=2304, sk=2304, h=2, hk=2, causal=True),
    "local-batch": dict(b=2, sq=2100, sk=2300, h=2, hk=1, window_size=(500, 0)),
}

# Query rows from which the forward takes the tall tile (hopper_fwd_tall in common/tile_policy.h): every
# case above must reach it, or it tests the 128-row tile instead.
TALL_MIN_SEQLEN_Q = 2048


def _tall_head_dims(dtype, band):
    dims = [(d, dv) for d, dv in HEAD_DIMS if max(d, dv) <= 128
            and find_kernels(op="fwd", dtype=dtype, head_dim=d, head_dim_v=dv, band=band, softcap=False)]
    if not dims:
        pytest.skip(f"not built: fwd {dtype} with a head dim <= 128, band={band}")
    return dims


@pytest.mark.parametrize("case", list(TALL_CASES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_tall_tile(dtype, case, seed):
    c = dict(TALL_CASES[case])
    sq, sk, h, hk, b = c.pop("sq"), c.pop("sk"), c.pop("h"), c.pop("hk"), c.pop("b", 1)
    assert sq >= TALL_MIN_SEQLEN_Q, f"case {case} runs the 128-row tile"
    pack = c.pop("pack_gqa", None)
    for d, dv in _tall_head_dims(dtype, band=c.get("causal", False) or "window_size" in c):
        q, k, v = random_qkv(b, sq, sk, h, hk, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
        out, lse = run_fwd(q, k, v, pack_gqa=pack, **c)
        _check(f"d{d}x{dv} out", out, lse, _refs(q, k, v, **c))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_tall_tile_varlen(dtype, causal, seed):
    lens_q, lens_k = [4500, 0, 700, 2200], [4000, 5, 700, 2500]
    for d, dv in _tall_head_dims(dtype, band=causal):
        _check_varlen_causal(f"d{d}x{dv} varlen out", lens_q, lens_k, 4, 2, d, dv, dtype, seed, causal)


# Tail split (Hopper forward without a band mask, fixed-length batches): the tiles of the grid's last
# partial wave run in parts along the keys, and the part that finishes last combines them. Cases: a
# grid smaller than one wave (every tile split; GQA packed and not), 2-CTA clusters (an even number of
# query blocks), one whole wave plus one tile (133 heads of one query block), and the tall tile.
# num_splits=1 turns the split off; the split result must pass the same check, repeat bitwise across
# calls with other work in between (each launch leaves the split counters at zero), and differ from
# the unsplit one in the LSE's last bits somewhere (the parts' log-sum-exp), so the split ran. Head dims
# above 128 (O staged over V) do not split: there both must be the same.
SPLIT_CASES = {
    "small-grid": dict(b=1, sq=333, sk=3000, h=3, hk=1, pack_gqa=False),
    "small-grid-pack": dict(b=1, sq=333, sk=3000, h=3, hk=1, pack_gqa=True),
    "clusters": dict(b=2, sq=512, sk=1536, h=4, hk=4),
    "wave-plus-one": dict(b=1, sq=128, sk=1031, h=133, hk=133),
    "tall": dict(b=1, sq=4000, sk=700, h=2, hk=2),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_tail_split(dtype, hdim, case, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=False)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the tail split is the Hopper forward's")
    c = dict(SPLIT_CASES[case])
    b, sq, sk, h, hk = (c.pop(x) for x in ("b", "sq", "sk", "h", "hk"))
    q, k, v = random_qkv(b, sq, sk, h, hk, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    refs = _refs(q, k, v)
    other = random_qkv(2, 200, 700, 4, 4, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed + 1)
    runs = []
    for i in range(3):
        flash_attn_func(*(t * (i + 1) for t in other))
        out, lse = run_fwd(q, k, v, **c)
        _check(f"split run {i}", out, lse, refs)
        runs.append((out, lse))
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])
    out1, lse1 = run_fwd(q, k, v, num_splits=1, **c)
    _check("unsplit", out1, lse1, refs)
    if max(d, dv) <= 128:
        assert not torch.equal(lse1, runs[0][1]), "num_splits=0 gave the unsplit LSE bit for bit: no split ran"
    else:
        assert torch.equal(out1, runs[0][0]) and torch.equal(lse1, runs[0][1])


WINDOWS = [((64, 0), False), ((32, 17), False), ((0, 0), False), ((-1, 5), False), ((7, -1), False),
           ((64, -1), True)]
WINDOW_SEQLENS = [(113, 203), (239, 1), (300, 129), (1023, 1024)]


@pytest.mark.parametrize("seqlens", WINDOW_SEQLENS, ids=[f"{a}x{b}" for a, b in WINDOW_SEQLENS])
@pytest.mark.parametrize("window, causal", WINDOWS, ids=[f"w{w[0]}_{w[1]}{'-causal' if c else ''}" for w, c in WINDOWS])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_local_window(dtype, hdim, window, causal, seqlens, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=True)
    sq, sk = seqlens
    q, k, v = random_qkv(3, sq, sk, 6, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    check_fwd(q, k, v, causal=causal, window_size=window)


SOFTCAPS = [(30.0, None), (30.0, 0.5), (3.0, None)]  # (softcap, softmax_scale)


@pytest.mark.parametrize("seqlens", [(113, 203), (1023, 1024)], ids=["113x203", "1023x1024"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("softcap, scale", SOFTCAPS, ids=[f"cap{c:g}-scale{s}" for c, s in SOFTCAPS])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_softcap(dtype, hdim, softcap, scale, causal, seqlens, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=causal, softcap=True)
    sq, sk = seqlens
    q, k, v = random_qkv(2, sq, sk, 6, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    _, _, (_, ref_lse, _, low_lse) = check_fwd(q, k, v, causal=causal, softcap=softcap, softmax_scale=scale)
    if softcap < 10:
        # A cap of 3 on unit-variance scores moves the LSE far beyond its tolerance, so a kernel ignoring
        # it fails (with cap 30 the move can be within tolerance for small head dims).
        _, uncapped_lse = attention_ref(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
        tol = 2 * (low_lse - ref_lse).abs().max().item() + 2 * torch.finfo(torch.float32).eps * ref_lse.abs().max().item()
        assert (uncapped_lse - ref_lse).abs().max().item() > 10 * tol


@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_softcap_with_window(dtype, hdim, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=True, softcap=True)
    q, k, v = random_qkv(2, 300, 129, 4, 1, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    check_fwd(q, k, v, window_size=(32, 17), softcap=3.0)


@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_softmax_scale(dtype, hdim, seed):
    d, dv = hdim
    require_built(dtype, d, dv)
    q, k, v = random_qkv(2, 113, 203, 4, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    check_fwd(q, k, v, softmax_scale=0.3)


# ---- fully masked rows -------------------------------------------------------------------------------

MASKED = [  # (sq, sk, causal, window): the first sq - sk rows see no key
    (300, 100, True, (-1, -1)),
    (257, 3, True, (-1, -1)),
    (200, 64, False, (5, 0)),
    (130, 129, False, (0, 0)),
]


@pytest.mark.parametrize("sq, sk, causal, window", MASKED,
                         ids=[f"{m[0]}x{m[1]}-" + ("causal" if m[2] else "w%d_%d" % m[3]) for m in MASKED])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_fully_masked_rows(dtype, hdim, sq, sk, causal, window, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=True)
    q, k, v = random_qkv(2, sq, sk, 4, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    out, lse, (_, ref_lse, _, _) = check_fwd(q, k, v, causal=causal, window_size=window)
    n_empty = sq - sk
    assert n_empty > 0 and torch.isneginf(ref_lse[:, :, :n_empty]).all()
    assert torch.all(out[:, :n_empty] == 0) and torch.isneginf(lse[:, :, :n_empty]).all()


@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_empty_key_sequence(dtype, hdim):
    """seqlen_k == 0: every row sees no key."""
    d, dv = hdim
    require_built(dtype, d, dv)
    q = torch.randn(2, 17, 4, d, device="cuda").to(DTYPES[dtype])
    k = torch.empty(2, 0, 2, d, dtype=DTYPES[dtype], device="cuda")
    v = torch.empty(2, 0, 2, dv, dtype=DTYPES[dtype], device="cuda")
    out, lse = run_fwd(q, k, v)
    assert torch.all(out == 0) and torch.isneginf(lse).all()


# ---- varlen, seqused, KV cache -----------------------------------------------------------------------

VARLEN = {
    "mixed": ([0, 17, 1, 113, 0, 239, 64, 5], [5, 17, 0, 203, 0, 1, 64, 300]),
    "long": ([1023, 1, 300], [1024, 4096, 129]),
}


def _per_sequence_ref(q, k, v, lens_q, lens_k, **kw):
    """attention_ref called on each sequence separately, concatenated to the packed layout."""
    parts = []
    oq = ok = 0
    for lq, lk in zip(lens_q, lens_k):
        qi, ki, vi = q[oq:oq + lq][None], k[ok:ok + lk][None], v[ok:ok + lk][None]
        parts.append(_refs(qi, ki, vi, **kw))
        oq, ok = oq + lq, ok + lk
    ref = torch.cat([p[0][0] for p in parts])
    ref_lse = torch.cat([p[1][0] for p in parts], dim=1)
    low = torch.cat([p[2][0] for p in parts])
    low_lse = torch.cat([p[3][0] for p in parts], dim=1)
    return ref, ref_lse, low, low_lse


def _packed(lens_q, lens_k, h, hk, d, dv, dtype, seed):
    q, k, v = random_qkv(1, sum(lens_q), sum(lens_k), h, hk, d, dv, dtype=dtype, device="cuda", seed=seed)
    return q[0], k[0], v[0]


def _check_varlen_causal(name, lens_q, lens_k, h, hk, d, dv, dtype, seed, causal):
    """Packed sequences without a window, against attention_ref per sequence; returns (out, lse)."""
    q, k, v = _packed(lens_q, lens_k, h, hk, d, dv, DTYPES[dtype], seed)
    cu_q, cu_k = generate_cu_seqlens(lens_q, "cuda"), generate_cu_seqlens(lens_k, "cuda")
    poison_allocator(_out_bytes(q, dv))
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                      return_attn_probs=True)
    _check(name, out, lse, _per_sequence_ref(q, k, v, lens_q, lens_k, causal=causal, window_size=(-1, -1)),
           varlen=True)
    return out, lse


@pytest.mark.parametrize("window", [(-1, -1), (32, 17)], ids=["nowindow", "w32_17"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("case", list(VARLEN))
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_varlen(dtype, hdim, case, heads, causal, window, seed):
    d, dv = hdim
    band = causal or window != (-1, -1)
    require_built(dtype, d, dv, band=band)
    lens_q, lens_k = VARLEN[case]
    h, hk = heads
    q, k, v = _packed(lens_q, lens_k, h, hk, d, dv, DTYPES[dtype], seed)
    cu_q, cu_k = generate_cu_seqlens(lens_q, "cuda"), generate_cu_seqlens(lens_k, "cuda")
    poison_allocator(_out_bytes(q, dv))
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                      window_size=window, return_attn_probs=True)
    assert out.shape == (sum(lens_q), h, dv) and out.dtype == q.dtype
    assert lse.shape == (h, sum(lens_q)) and lse.dtype == torch.float32
    refs = _per_sequence_ref(q, k, v, lens_q, lens_k, causal=causal, window_size=window)
    _check("varlen out", out, lse, refs, varlen=True)


# Sequences without keys among ones with keys: "tail", the last one keyless (persistent CTAs take an
# active tile, then only tiles whose rows see no key, written on the way, before the walk ends);
# "middle", keyless runs between active sequences (a CTA walks past several tiles without work in a
# row, then takes an active one).
KEYLESS = {"tail": ([700, 300, 450], [700, 250, 0]), "middle": ([640, 900, 700, 300, 1000, 200], [640, 0, 0, 300, 0, 513])}


@pytest.mark.parametrize("case", list(KEYLESS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_varlen_keyless(dtype, hdim, causal, case, seed):
    """More tiles than SMs, with sequences whose rows see no key (KEYLESS)."""
    d, dv = hdim
    require_built(dtype, d, dv, band=causal)
    lens_q, lens_k = KEYLESS[case]
    out, lse = _check_varlen_causal("varlen out", lens_q, lens_k, 48, 8, d, dv, dtype, seed, causal)
    start = 0
    for lq, lk in zip(lens_q, lens_k):
        if lk == 0:
            assert torch.all(out[start:start + lq] == 0) and torch.isneginf(lse[:, start:start + lq]).all()
        start += lq


@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_varlen_loose_max_seqlen(dtype, hdim, seed):
    """max_seqlen_q/k only need to bound the sequences."""
    d, dv = hdim
    require_built(dtype, d, dv, band=True)
    lens_q, lens_k = [3, 130, 0, 77], [200, 5, 9, 77]
    q, k, v = _packed(lens_q, lens_k, 6, 2, d, dv, DTYPES[dtype], seed)
    cu_q, cu_k = generate_cu_seqlens(lens_q, "cuda"), generate_cu_seqlens(lens_k, "cuda")
    poison_allocator(_out_bytes(q, dv))
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 400, 333, causal=True, return_attn_probs=True)
    _check("varlen out", out, lse, _per_sequence_ref(q, k, v, lens_q, lens_k, causal=True), varlen=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_seqused(dtype, hdim, causal, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=causal)
    lens_q, lens_k = [17, 30, 17, 129], [64, 200, 17, 300]
    used_q = torch.tensor([5, 0, 17, 128], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([10, 200, 0, 257], dtype=torch.int32, device="cuda")
    q, k, v = _packed(lens_q, lens_k, 6, 2, d, dv, DTYPES[dtype], seed)
    cu_q, cu_k = generate_cu_seqlens(lens_q, "cuda"), generate_cu_seqlens(lens_k, "cuda")
    poison_allocator(_out_bytes(q, dv))
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seqused_q=used_q,
                                      seqused_k=used_k, causal=causal, return_attn_probs=True)
    refs = _refs(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k, causal=causal)
    _check("seqused out", out, lse, refs, varlen=True)
    # Rows past seqused_q are outputs too: 0 and -inf.
    assert torch.all(out[5:17] == 0) and torch.all(out[17:47] == 0)
    assert torch.isneginf(lse[:, 5:47]).all()


@pytest.mark.parametrize("sq", [1, 17], ids=["decode", "sq17"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cache_seqlens", ["int", "tensor"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_kvcache(dtype, hdim, cache_seqlens, causal, sq, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=causal)
    b, s_cache = 3, 300
    q, k_cache, v_cache = random_qkv(b, sq, s_cache, 8, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    if cache_seqlens == "int":
        lens, arg = torch.full((b,), 150, dtype=torch.int32, device="cuda"), 150
    else:
        lens = torch.tensor([0, s_cache, 77], dtype=torch.int32, device="cuda")
        arg = lens
    poison_allocator(_out_bytes(q, dv))
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=arg, causal=causal, return_softmax_lse=True)
    assert out.shape == (b, sq, 8, dv) and lse.shape == (b, 8, sq)
    _check("kvcache out", out, lse, _refs(q, k_cache, v_cache, seqused_k=lens, causal=causal))


@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_kvcache_varlen_q(dtype, hdim, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=True)
    lens_q = [1, 5, 0, 33]
    lens = torch.tensor([40, 0, 300, 33], dtype=torch.int32, device="cuda")
    q = _packed(lens_q, [1], 8, 2, d, dv, DTYPES[dtype], seed)[0]
    _, k_cache, v_cache = random_qkv(4, 1, 300, 8, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed + 1)
    cu_q = generate_cu_seqlens(lens_q, "cuda")
    poison_allocator(_out_bytes(q, dv))
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, cu_seqlens_q=cu_q, max_seqlen_q=33,
                                       causal=True, return_softmax_lse=True)
    assert out.shape == (39, 8, dv) and lse.shape == (8, 39)
    refs = _refs(q, k_cache, v_cache, cu_seqlens_q=cu_q, seqused_k=lens, causal=True)
    _check("kvcache varlen out", out, lse, refs, varlen=True)


# ---- head dims inside a bucket -----------------------------------------------------------------------

def _inner_head_dims():
    """For each built bucket, head dims below it that map to it (e.g. 120 and 104 for 128)."""
    prev = dict(zip(HEAD_DIM_BUCKETS, (0,) + HEAD_DIM_BUCKETS))
    out = []
    for d, dv in HEAD_DIMS:
        for c in ((d - 8, dv - 8), (prev[d] + 8 if prev[d] else 32, prev[dv] + 8 if prev[dv] else 32)):
            if c not in out:
                out.append(c)
    return out


INNER_HEAD_DIMS = _inner_head_dims()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", INNER_HEAD_DIMS, ids=[f"d{a}x{b}" for a, b in INNER_HEAD_DIMS])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_head_dim_inside_bucket(dtype, hdim, causal, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=causal)
    q, k, v = random_qkv(2, 113, 203, 6, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    check_fwd(q, k, v, causal=causal)


# ---- strided inputs ----------------------------------------------------------------------------------

def _strided(kind, b, sq, sk, h, hk, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device="cuda", dtype=dtype)

    if kind == "sliced-head-dim":  # q from a wider tensor, k/v from one packed kv tensor
        q = rand(b, sq, h, d + 64)[..., :d]
        if d == dv:
            kv = rand(b, sk, 2, hk, d)
            k, v = kv[:, :, 0], kv[:, :, 1]
        else:
            k, v = rand(b, sk, hk, d + 8)[..., :d], rand(b, sk, hk, dv + 24)[..., :dv]
    elif kind == "seq-major":  # (seqlen, batch, heads, d) storage
        q = rand(sq, b, h, d).transpose(0, 1)
        k, v = rand(sk, b, hk, d).transpose(0, 1), rand(sk, b, hk, dv).transpose(0, 1)
    elif kind == "head-major":  # (batch, heads, seqlen, d) storage
        q = rand(b, h, sq, d).transpose(1, 2)
        k, v = rand(b, hk, sk, d).transpose(1, 2), rand(b, hk, sk, dv).transpose(1, 2)
    else:
        raise ValueError(kind)
    assert not q.is_contiguous() and q.stride(-1) == 1
    return q, k, v


@pytest.mark.parametrize("kind", ["sliced-head-dim", "seq-major", "head-major"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_strided_inputs(dtype, hdim, causal, kind, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=causal)
    q, k, v = _strided(kind, 3, 239, 300, 6, 2, d, dv, DTYPES[dtype], seed)
    out, lse, _ = check_fwd(q, k, v, causal=causal)
    # Strides change addressing only: the contiguous copies give bitwise the same result.
    out_c, lse_c = flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal,
                                   return_attn_probs=True)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


@pytest.mark.parametrize("hdim", [hd for hd in HEAD_DIMS if hd[0] == hd[1]] or [(128, 128)],
                         ids=[f"d{hd[0]}" for hd in HEAD_DIMS if hd[0] == hd[1]] or ["d128"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_qkvpacked(dtype, hdim, seed):
    d, _ = hdim
    require_built(dtype, d, d, band=True)
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(2, 300, 3, 4, d, generator=g).to(device="cuda", dtype=DTYPES[dtype])
    out, lse = flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    q, k, v = qkv.unbind(2)
    _check("qkvpacked out", out, lse, _refs(q, k, v, causal=True))
    out_u, lse_u = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out, out_u) and torch.equal(lse, lse_u)
    # GQA packing: (batch, seqlen, nheads_q + 2 * nheads_k, d).
    qkv = torch.randn(2, 129, 6 + 2 * 2, d, generator=g).to(device="cuda", dtype=DTYPES[dtype])
    out = flash_attn_qkvpacked_func(qkv, num_heads_q=6)
    q, k, v = qkv.split([6, 2, 2], dim=2)
    ref, low = attention_ref(q, k, v), attention_ref(q, k, v, upcast=False)
    check_close("qkvpacked gqa out", out, ref, low)


# ---- argument checks that need CUDA tensors ----------------------------------------------------------

def _any_built():
    for name in DTYPES:
        for d, dv in HEAD_DIMS:
            if find_kernels(op="fwd", dtype=name, head_dim=d, head_dim_v=dv, band=False, softcap=False):
                return name, d, dv
    pytest.skip("no forward kernel built")


def test_misaligned_data_pointer_rejected():
    name, d, dv = _any_built()
    base = torch.randn(1, 16, 2, d + 8, device="cuda").to(DTYPES[name])
    q = base[..., 4:4 + d]  # strides fine, address 8 bytes off
    k, v = torch.randn(1, 16, 2, d, device="cuda").to(DTYPES[name]), torch.randn(1, 16, 2, dv, device="cuda").to(DTYPES[name])
    with pytest.raises(ValueError, match=r"\bq data pointer must be 16-byte aligned"):
        flash_attn_func(q, k, v)


def test_mixed_devices_rejected():
    name, d, dv = _any_built()
    q, k, v = random_qkv(1, 8, 8, 2, 2, d, dv, dtype=DTYPES[name], device="cuda", seed=0)
    with pytest.raises(ValueError, match=r"\bk must be on a CUDA device, got cpu"):
        flash_attn_func(q, k.cpu(), v)
    with pytest.raises(ValueError, match=r"\bcu_seqlens_k must be on a CUDA device"):
        flash_attn_varlen_func(q[0], k[0], v[0], generate_cu_seqlens([8], "cuda"), generate_cu_seqlens([8]), 8, 8)


def test_not_built_configuration_raises_before_kernel():
    cfg = flashtile.build_config()
    built = {(k["dtype"], k["head_dim"], k["head_dim_v"], k["softcap"], k["path"]) for k in cfg["kernels"]
             if k["op"] == "fwd"}
    candidates = [(n, hd[0], hd[1], False, "auto") for n in DTYPES for hd in [(64, 64), (96, 96), (128, 128),
                                                                             (192, 128), (256, 256)]]
    candidates += [(n, d, dv, True, "auto") for n in DTYPES for d, dv in HEAD_DIMS]
    candidates += [(n, d, dv, False, "hopper") for n in DTYPES for d, dv in HEAD_DIMS]
    for name, d, dv, softcap, path in candidates:
        if not any(b[:4] == (name, d, dv, softcap) and (path == "auto" or b[4] == path) for b in built):
            break
    else:
        pytest.skip("every candidate configuration is built")
    q, k, v = random_qkv(1, 8, 8, 2, 2, d, dv, dtype=DTYPES[name], device="cuda", seed=0)
    # The message lists what was built (ops in sorted order: the backward kernels come first).
    with pytest.raises(KernelNotBuiltError, match=r"This build .* has: .*\bfwd \w+ \w+ hdim "):
        flash_attn_func(q, k, v, softcap=5.0 if softcap else 0.0, path=path)


# ---- determinism and autograd ------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fwd_deterministic(dtype, hdim, causal, seed):
    d, dv = hdim
    require_built(dtype, d, dv, band=causal)
    q, k, v = random_qkv(2, 1023, 1024, 6, 2, d, dv, dtype=DTYPES[dtype], device="cuda", seed=seed)
    out1, lse1 = run_fwd(q, k, v, causal=causal)
    out2, lse2 = run_fwd(q, k, v, causal=causal)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


def test_forward_with_inputs_requiring_grad():
    """The outputs join the autograd graph (the backward itself: test_bwd.py), hold the same values as
    without grad, and no_grad calls record nothing."""
    name, d, dv = _any_built()
    q, k, v = random_qkv(1, 17, 17, 2, 2, d, dv, dtype=DTYPES[name], device="cuda", seed=1, requires_grad=True)
    out, lse = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.requires_grad and out.grad_fn is not None and lse.grad_fn is not None
    out_d, lse_d = flash_attn_func(q.detach(), k.detach(), v.detach(), return_attn_probs=True)
    assert not out_d.requires_grad
    assert torch.equal(out.detach(), out_d) and torch.equal(lse.detach(), lse_d)
    with torch.no_grad():
        out = flash_attn_func(q, k, v)
    assert not out.requires_grad
    ref = attention_ref(q.detach(), k.detach(), v.detach())
    check_close("no_grad out", out, ref, attention_ref(q.detach(), k.detach(), v.detach(), upcast=False))
