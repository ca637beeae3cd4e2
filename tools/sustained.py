"""Sustained attention throughput of one library build, for A/B comparisons of kernel variants.

Runs back-to-back calls on DESIGN.md §6 shapes (16k tokens, hidden 2048, bf16) and prints TFLOP/s per
shape. Two libraries are compared by running this script in alternating processes with
FLASHTILE_LIBRARY_DIR pointing at each build (rounds in one process are not independent: clocks and
power settle per process). Modes:
  eager  calls from Python for ~SECS seconds between CUDA events (what a user's loop sees);
  graph  a CUDA graph of 20 forward calls replayed (GPU time only: no host path in the figure; the
         backward through autograd does not capture here, for any implementation).
--impl cudnn / fa2 times PyTorch SDPA's cuDNN / flash (FlashAttention-2) backend on the same shapes
instead, --impl fa3 the flash-attn3-jax anchor (JAX runs on its own stream: timed from the host, N calls
then block_until_ready, as the benchmark times it); --path ampere runs flashtile's Ampere path (on
sm_90 too). --causal band (flashtile only) runs the band-mask kernels on the non-causal work
(window_size = (seqlen, seqlen): no key masked), which separates what the band kernels cost from what
the causal work's shape costs.

  python tools/sustained.py LABEL --hdims 64,128 --seqlens 512,2048 --causal both [--bwd] [--mode graph]
"""
import argparse
import sys
import time

import torch

TOKENS, HIDDEN = 16384, 2048


def make_fa3_call(q, k, v, causal, bwd, dout):
    """A callable returning FA3's (JAX) output; causal is a bool."""
    import jax
    from flashtile.bench import anchors

    imp = anchors.Fa3JaxImpl()
    reason = imp.unavailable() or imp._load()
    if reason:
        raise SystemExit(f"fa3: {reason}")
    jq, jk, jv, jdo = (imp.to_jax(t)[0] for t in (q, k, v, dout))
    fwd = jax.jit(lambda q, k, v: anchors._fa3_fwd(q, k, v, causal))
    if not bwd:
        return lambda: fwd(jq, jk, jv)
    o, lse = fwd(jq, jk, jv)
    grad = jax.jit(lambda do, q, k, v, o, lse: anchors._fa3_bwd(do, q, k, v, o, lse, causal))
    return lambda: grad(jdo, jq, jk, jv, o, lse)


def make_call(impl, q, k, v, causal, bwd, dout, path="auto"):
    if impl == "fa3":
        return make_fa3_call(q, k, v, causal, bwd, dout)
    if impl == "flashtile":
        import flashtile

        if causal == "band":
            window = (q.shape[1], q.shape[1])
            fwd = lambda: flashtile.flash_attn_func(q, k, v, window_size=window, path=path)
        else:
            fwd = lambda: flashtile.flash_attn_func(q, k, v, causal=causal, path=path)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.CUDNN_ATTENTION if impl == "cudnn" else SDPBackend.FLASH_ATTENTION

        def fwd():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
    if not bwd:
        return fwd
    out = fwd()  # the backward alone is timed, through autograd
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def time_eager(f, secs):
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    f()
    e1.record()
    torch.cuda.synchronize()
    n = max(10, int(secs * 1000 / max(e0.elapsed_time(e1), 1e-3)))
    e0.record()
    for _ in range(n):
        f()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n


def time_host(f, secs):
    """Milliseconds per call of a JAX callable: one loop of ~secs seconds of calls, timed as the benchmark
    times the FA3 anchor (anchors.jax_median)."""
    import jax
    from flashtile.bench import anchors

    for _ in range(4):
        jax.block_until_ready(f())
    t0 = time.perf_counter()
    jax.block_until_ready(f())
    n = max(10, int(secs / max(time.perf_counter() - t0, 1e-6)))
    return anchors.jax_median(f, iters=n, repeats=1)


def time_graph(f, calls=20, replays=20):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: workspaces and plans are made here
        for _ in range(3):
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            f()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(replays):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / (calls * replays)


def ints(text):
    return [int(x) for x in text.split(",") if x]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("label", help="printed at the start of each line (the build's name)")
    p.add_argument("--hdims", type=ints, default=[64, 128, 256])
    p.add_argument("--seqlens", type=ints, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", choices=("0", "1", "both", "band"), default="both",
                   help="band: the band-mask kernels over all keys (flashtile only)")
    p.add_argument("--bwd", action="store_true", help="time the backward pass (2.5x the forward's FLOPs)")
    p.add_argument("--mode", choices=("eager", "graph"), default="eager")
    p.add_argument("--secs", type=float, default=0.3, help="eager: seconds of calls per shape")
    p.add_argument("--impl", choices=("flashtile", "cudnn", "fa2", "fa3"), default="flashtile")
    p.add_argument("--path", choices=("auto", "ampere", "hopper"), default="auto", help="flashtile's kernel path")
    args = p.parse_args(argv)
    if args.bwd and args.mode == "graph":
        p.error("--mode graph times the forward only")
    if args.impl == "fa3" and args.mode == "graph":
        p.error("--impl fa3 is timed from the host (eager mode)")
    if args.causal == "band" and args.impl != "flashtile":
        p.error("--causal band runs flashtile's band-mask kernels only")
    causals = {"0": [False], "1": [True], "both": [False, True], "band": ["band"]}[args.causal]
    for d in args.hdims:
        for causal in causals:
            for s in args.seqlens:
                b, h = TOKENS // s, HIDDEN // d
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                for t in (q, k, v):
                    t.requires_grad_(args.bwd)
                f = make_call(args.impl, q, k, v, causal, args.bwd, dout, args.path)
                if args.impl == "fa3":
                    ms = time_host(f, args.secs)
                else:
                    ms = time_eager(f, args.secs) if args.mode == "eager" else time_graph(f)
                flops = 4 * b * h * s * s * d * (0.5 if causal is True else 1.0) * (2.5 if args.bwd else 1.0)
                mask = {True: "c", False: "nc", "band": "band"}[causal]
                print(f"{args.label} d{d} {mask} {s} {'bwd' if args.bwd else 'fwd'}: "
                      f"{flops / ms / 1e9:.1f} TFLOP/s ({ms * 1e3:.1f} us)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
