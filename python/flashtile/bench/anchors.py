"""The implementations the benchmark times and how each is timed.

- flashtile: flashtile.flash_attn_func, backward through torch.autograd.grad.
- cudnn / fa2: torch SDPA pinned to its cuDNN or flash (FlashAttention-2) backend.
- fa3: FlashAttention-3's SM90 kernels from the flash-attn3-jax wheel, called through their XLA FFI targets
  on the same data (torch tensors handed to JAX through DLPack).

torch and JAX are imported inside functions so that importing this module costs nothing.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from importlib.util import find_spec

from . import report

REASON_WIDTH = 300
FA3_HDIMS = (128,)  # the published flash-attn3-jax wheel carries only these head dims
FA3_DTYPES = ("bf16", "fp16")


@dataclass
class Timing:
    """One pass of one implementation on one shape: milliseconds, or why there are none."""
    ms: float | None = None
    status: str = "ok"  # ok | skipped (unsupported, by design) | error (it should have run)
    reason: str | None = None
    extra: dict = field(default_factory=dict)


def failure(exc: BaseException) -> Timing:
    status = "skipped" if isinstance(exc, NotImplementedError) else "error"
    return Timing(status=status, reason=report.truncate(f"{type(exc).__name__}: {exc}", REASON_WIDTH))


def torch_dtype(name: str):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


# ---------------------------------------------------------------------------------------------- timers

def make_torch_timer(warmup_ms: float = 25, rep_ms: float = 100, protocol: str = "flush"):
    """Median milliseconds of fn() from CUDA events. protocol "flush": L2 flushed before each timed call
    (triton's do_bench when available, else our own loop); "loop": the FA3 anchor's protocol (loop_median)."""
    if protocol == "loop":
        return loop_median
    try:
        from triton.testing import do_bench
    except ImportError:
        return lambda fn: cuda_event_median(fn, warmup_ms, rep_ms)
    return lambda fn: do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def cuda_event_median(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """do_bench's protocol without triton: size the loops from a first estimate, flush L2 before each timed
    call, time each call with its own pair of CUDA events, return the median."""
    import torch
    fn()
    torch.cuda.synchronize()
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(5):
        flush.zero_()
        fn()
    t1.record()
    torch.cuda.synchronize()
    est = max(t0.elapsed_time(t1) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    n = max(1, int(rep_ms / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def loop_median(fn, iters: int = 30, repeats: int = 5) -> float:
    """fn() back to back without flushes, as jax_median times FA3: CUDA events around iters calls, median of
    several such loops. The GPU then runs at the duty cycle FA3's timing gives it (no flush between calls,
    which lowers the average power of short calls); a call whose host path outlasts its kernel is timed at
    the host's pace, as it would run in a loop of the user's."""
    import torch
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(iters):
            fn()
        t1.record()
        torch.cuda.synchronize()
        ts.append(t0.elapsed_time(t1) / iters)
    return statistics.median(ts)


def jax_median(f, *args, iters: int = 30, repeats: int = 5) -> float:
    """JAX runs on its own stream, so time it from the host: N calls then block_until_ready, median of
    several such loops (the FA3 anchor's protocol)."""
    import jax
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            r = f(*args)
        jax.block_until_ready(r)
        ts.append((time.perf_counter() - t0) / iters)
    return statistics.median(ts) * 1e3


# ---------------------------------------------------------------------------------------------- inputs

@dataclass
class Inputs:
    """One problem: q, k, v (leaves with requires_grad) and dout, all (batch, seqlen, nheads, hdim)."""
    q: object
    k: object
    v: object
    dout: object
    hdim: int
    dtype: str


def make_inputs(batch: int, seqlen: int, nheads: int, hdim: int, dtype: str, seed: int = 0) -> Inputs:
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (batch, seqlen, nheads, hdim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch_dtype(dtype), generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    return Inputs(q, k, v, dout, hdim, dtype)


# -------------------------------------------------------------------------------------- implementations

class Impl:
    """Base class: name, a one-time availability check and one measure() per shape."""
    name = "?"

    def unavailable(self):
        """None when this implementation can run here, else the reason it cannot."""
        return None

    def measure(self, inp: Inputs, causal: bool, fwd_only: bool, timer) -> dict:
        raise NotImplementedError


class TorchImpl(Impl):
    """Implementations that take torch tensors: forward timed directly, backward through autograd.grad."""

    def context(self):
        return nullcontext()

    def forward(self, inp: Inputs, causal: bool):
        """Output in (batch, seqlen, nheads, hdim) layout."""
        raise NotImplementedError

    def check(self, inp: Inputs, causal: bool) -> dict:
        """Extra fields for the forward row (e.g. an accuracy check); run once, outside the timing."""
        return {}

    def measure(self, inp, causal, fwd_only, timer):
        import torch
        res = {}
        with self.context():
            try:
                res["fwd"] = Timing(ms=timer(lambda: self.forward(inp, causal)))
                res["fwd"].extra.update(self.check(inp, causal))
            except Exception as exc:
                res["fwd"] = self.explain(failure(exc))
            if fwd_only:
                return res
            if res["fwd"].status != "ok":
                res["bwd"] = Timing(status=res["fwd"].status, reason=res["fwd"].reason)  # no forward, no backward
                return res
            try:
                out = self.forward(inp, causal)
                leaves = (inp.q, inp.k, inp.v)
                res["bwd"] = Timing(ms=timer(lambda: torch.autograd.grad(out, leaves, inp.dout, retain_graph=True)))
                del out
            except Exception as exc:
                res["bwd"] = self.explain(failure(exc))
        return res

    def explain(self, t: Timing) -> Timing:
        return t


class SdpaImpl(TorchImpl):
    """torch.nn.functional.scaled_dot_product_attention pinned to one backend; it takes (b, h, s, d), so it
    gets transposed views of the shared (b, s, h, d) tensors (the layout both backends use internally)."""

    def __init__(self, name: str, backend: str):
        self.name, self.backend = name, backend

    def _backend(self):
        from torch.nn.attention import SDPBackend
        return getattr(SDPBackend, self.backend)

    def unavailable(self):
        try:
            self._backend()
            from torch.nn.attention import sdpa_kernel  # noqa: F401
        except (ImportError, AttributeError) as exc:
            return f"this torch has no SDPBackend.{self.backend}: {exc}"
        return None

    def context(self):
        from torch.nn.attention import sdpa_kernel
        return sdpa_kernel([self._backend()])

    def forward(self, inp, causal):
        import torch.nn.functional as F
        o = F.scaled_dot_product_attention(inp.q.transpose(1, 2), inp.k.transpose(1, 2), inp.v.transpose(1, 2),
                                           is_causal=causal)
        return o.transpose(1, 2)


class FlashtileImpl(TorchImpl):
    name = "flashtile"

    def __init__(self, path: str = "auto"):
        self.path = path

    def unavailable(self):
        try:
            import flashtile
        except Exception as exc:
            return report.truncate(f"import flashtile failed: {type(exc).__name__}: {exc}", REASON_WIDTH)
        if not hasattr(flashtile, "flash_attn_func"):
            return "flashtile has no flash_attn_func"
        return None

    def kwargs(self) -> dict:
        return flashtile_kwargs(self.path)

    def forward(self, inp, causal):
        import flashtile
        out = flashtile.flash_attn_func(inp.q, inp.k, inp.v, causal=causal, **self.kwargs())
        # FA3's interface returns (out, lse) in some versions; time the same call either way.
        return out[0] if isinstance(out, (tuple, list)) else out

    def check(self, inp, causal):
        """Compare with SDPA once per shape, so a fast but wrong kernel shows up next to its numbers."""
        import torch
        import torch.nn.functional as F
        try:
            with torch.no_grad():
                out = self.forward(inp, causal)
                ref = F.scaled_dot_product_attention(inp.q.transpose(1, 2), inp.k.transpose(1, 2),
                                                     inp.v.transpose(1, 2), is_causal=causal).transpose(1, 2)
                diff = (out.float() - ref.float()).abs().max().item()
        except Exception:
            return {}
        return {"max_abs_diff_vs_sdpa": diff if math.isfinite(diff) else str(diff)}

    def explain(self, t):
        if self.path != "auto" and t.reason and t.reason.startswith("TypeError") and "path" in t.reason:
            t.reason = report.truncate(f"flash_attn_func does not take path={self.path!r}: {t.reason}", REASON_WIDTH)
        return t


def flashtile_kwargs(path: str) -> dict:
    """Extra keywords for flashtile.flash_attn_func: path= only when a path was asked for."""
    return {} if path in (None, "", "auto") else {"path": path}


# ------------------------------------------------------------------------------------------------- FA3

def fa3_unsupported(hdim: int, dtype: str):
    """Why the published FA3 JAX build cannot run this shape, or None."""
    if hdim not in FA3_HDIMS:
        return f"hdim {hdim} is not in the flash-attn3-jax build (hdim {', '.join(map(str, FA3_HDIMS))} only)"
    if dtype not in FA3_DTYPES:
        return f"dtype {dtype} not supported by this FA3 binding"
    return None


def _ffi():
    """jax.ffi (jax >= 0.4.38), else its earlier home in jax.extend."""
    import jax
    if hasattr(jax, "ffi"):
        return jax.ffi
    from jax.extend import ffi
    return ffi


def _fa3_fwd(q, k, v, causal):
    """flash_mha_fwd with FA3's argument list: q, k, v, then empty optional tensors."""
    import jax
    import jax.numpy as jnp
    n, l, h, d = q.shape
    lk = k.shape[1]
    e32 = jnp.array([], dtype=jnp.int32)
    ef = jnp.array([], dtype=jnp.float32)
    eq = jnp.zeros((0,), dtype=q.dtype)
    o, lse, _, _ = _ffi().ffi_call(
        "flash_mha_fwd",
        result_shape_dtypes=[jax.ShapeDtypeStruct((n, l, h, d), q.dtype),
                             jax.ShapeDtypeStruct((n, h, l), jnp.float32),
                             jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32),
                             jax.ShapeDtypeStruct((1, 1, 1), jnp.float32)],
        has_side_effect=False, input_layouts=[None] * 21, output_layouts=[None] * 4,
    )(q, k, v, eq, eq, eq, e32, e32, e32, e32, e32, e32, e32, e32, eq, eq, e32, ef, ef, ef, e32,
      max_seqlen_q=l, max_seqlen_q_has_value=True, max_seqlen_k=lk, max_seqlen_k_has_value=True,
      softmax_scale_val=1.0 / math.sqrt(d), softmax_scale_has_value=True, pack_gqa_val=False, pack_gqa_has_value=False,
      is_causal=causal, window_size_left=-1, window_size_right=0 if causal else -1, attention_chunk=0, softcap=0.0,
      is_rotary_interleaved=False, num_splits=1, sm_margin=0)
    return o, lse


def _fa3_bwd(do, q, k, v, o, lse, causal):
    """flash_mha_bwd: dq, dk, dv plus FA3's padded fp32 workspaces (softmax_d, lse_log2)."""
    import jax
    import jax.numpy as jnp
    n, lq, hq, d = q.shape
    lk = k.shape[1]
    r = ((lq + 127) // 128) * 128
    e32 = jnp.array([], dtype=jnp.int32)
    dq, dk, dv, _, _ = _ffi().ffi_call(
        "flash_mha_bwd",
        result_shape_dtypes=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                             jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((n, hq, r), jnp.float32),
                             jax.ShapeDtypeStruct((n, hq, r), jnp.float32)],
        has_side_effect=False, input_layouts=[None] * 10, output_layouts=[None] * 5,
    )(do, q, k, v, o, lse, e32, e32, e32, e32,
      max_seqlen_q_val=lq, max_seqlen_q_has_value=True, max_seqlen_k_val=lk, max_seqlen_k_has_value=True,
      softmax_scale_val=1.0 / math.sqrt(d), softmax_scale_has_value=True, is_causal=causal,
      window_size_left=-1, window_size_right=0 if causal else -1, softcap=0.0, deterministic=False, sm_margin=0)
    return dq, dk, dv


class Fa3JaxImpl(Impl):
    name = "fa3"

    def __init__(self, iters: int = 30, repeats: int = 5):
        self.iters, self.repeats = iters, repeats
        self._load_error = None
        self._loaded = False

    def unavailable(self):
        for mod in ("jax", "flash_attn3_jax_lib"):
            if find_spec(mod) is None:
                return f"{mod} is not installed (pip install flash-attn3-jax)"
        import torch
        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):
            return f"FA3's kernels need sm_90, this GPU is sm_{cap[0]}{cap[1]}"
        return None

    def _load(self):
        """Import JAX once (without letting it preallocate the GPU that torch also uses) and register FA3's
        FFI targets."""
        if self._loaded:
            return self._load_error
        self._loaded = True
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        try:
            import jax
            import flash_attn3_jax_lib.flash_api as flash_api
            for name, target in flash_api.get_ffi_registrations().items():
                _ffi().register_ffi_target(name, target, platform="CUDA")
        except Exception as exc:
            self._load_error = report.truncate(f"loading FA3 through JAX failed: {type(exc).__name__}: {exc}",
                                               REASON_WIDTH)
        return self._load_error

    def versions(self) -> dict:
        if not self._loaded or self._load_error:
            return {}
        import jax
        from importlib.metadata import version, PackageNotFoundError
        out = {"jax": jax.__version__}
        try:
            out["flash_attn3_jax"] = version("flash-attn3-jax")
        except PackageNotFoundError:
            pass
        return out

    @staticmethod
    def to_jax(t):
        """Zero-copy through DLPack; a copy through host memory if this JAX/torch pair refuses."""
        import jax
        import jax.numpy as jnp
        t = t.detach().contiguous()
        try:
            return jax.dlpack.from_dlpack(t), "dlpack"
        except Exception:
            return jnp.asarray(t.float().cpu().numpy()).astype(getattr(jnp, str(t.dtype).split(".")[-1])), "numpy copy"

    def measure(self, inp, causal, fwd_only, timer):
        passes = ("fwd",) if fwd_only else ("fwd", "bwd")
        reason = fa3_unsupported(inp.hdim, inp.dtype)
        if reason:
            return {p: Timing(status="skipped", reason=reason) for p in passes}
        err = self._load()
        if err:
            return {p: Timing(status="error", reason=err) for p in passes}
        import jax
        import torch
        torch.cuda.synchronize()  # torch's pending work must not land inside JAX's host-timed loops
        res = {}
        try:
            (q, how), (k, _), (v, _), (do, _) = (self.to_jax(t) for t in (inp.q, inp.k, inp.v, inp.dout))
            f = jax.jit(lambda q, k, v: _fa3_fwd(q, k, v, causal))
            res["fwd"] = Timing(ms=jax_median(f, q, k, v, iters=self.iters, repeats=self.repeats),
                                extra={"transfer": how})
        except Exception as exc:
            res["fwd"] = failure(exc)
        if fwd_only:
            return res
        if res["fwd"].status != "ok":
            res["bwd"] = Timing(status=res["fwd"].status, reason=res["fwd"].reason)
            return res
        try:
            o, lse = f(q, k, v)
            fb = jax.jit(lambda do, q, k, v, o, lse: _fa3_bwd(do, q, k, v, o, lse, causal))
            res["bwd"] = Timing(ms=jax_median(fb, do, q, k, v, o, lse, iters=self.iters, repeats=self.repeats))
        except Exception as exc:
            res["bwd"] = failure(exc)
        return res


def build(names, path: str = "auto") -> list:
    """Implementation objects for the given names, in the order given."""
    table = {
        "flashtile": lambda: FlashtileImpl(path),
        "cudnn": lambda: SdpaImpl("cudnn", "CUDNN_ATTENTION"),
        "fa2": lambda: SdpaImpl("fa2", "FLASH_ATTENTION"),
        "fa3": lambda: Fa3JaxImpl(),
    }
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; choose from {list(table)}")
    return [table[n]() for n in names]
