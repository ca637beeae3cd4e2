"""Command line of the attention benchmark: `python -m flashtile.bench`.

Times flashtile and the anchors (cuDNN and FlashAttention-2 through torch SDPA, FlashAttention-3 through JAX)
in one run on the same GPU and the same inputs, shows a progress bar on stderr, prints a table of TFLOP/s and
ratios on stdout, and writes bench.json and bench.png under --out. With --rounds N each shape is measured N times,
interleaved across the implementations, and every point is the median of its rounds.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import shlex
import sys
import warnings

from . import report

DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_HDIMS = (64, 128, 256)
QUICK_SEQLENS = (1024, 4096)
QUICK_HDIMS = (128,)


def _int_list(text: str):
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _positive_int(text: str):
    try:
        val = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if val <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return val


def _impl_list(text: str):
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in report.IMPLS]
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"unknown implementation(s) {bad or text!r}; choose from "
                                         f"{','.join(report.IMPLS)}")
    return list(dict.fromkeys(vals))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashtile.bench",
        description="Attention forward/backward TFLOP/s of flashtile against cuDNN, FlashAttention-2 (torch SDPA) "
                    f"and FlashAttention-3 (JAX), {report.TOTAL_TOKENS} tokens per batch, hidden {report.HIDDEN}.",
    )
    p.add_argument("--impls", type=_impl_list, default=None,
                   help=f"comma-separated subset of {','.join(report.IMPLS)} (default: all available here)")
    p.add_argument("--path", choices=("auto", "ampere", "hopper"), default="auto",
                   help="flashtile kernel path, passed as path= unless auto (default auto)")
    p.add_argument("--fwd-only", action="store_true", help="skip the backward pass")
    p.add_argument("--seqlens", type=_int_list, default=None,
                   help=f"comma-separated sequence lengths (default {','.join(map(str, DEFAULT_SEQLENS))})")
    p.add_argument("--hdims", type=_int_list, default=None,
                   help=f"comma-separated head dims (default {','.join(map(str, DEFAULT_HDIMS))})")
    p.add_argument("--causal", choices=("0", "1", "both"), default="both",
                   help="0: non-causal, 1: causal, both (default)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="input dtype (default bf16)")
    p.add_argument("--quick", action="store_true",
                   help=f"seqlens {','.join(map(str, QUICK_SEQLENS))} and hdim {','.join(map(str, QUICK_HDIMS))} "
                        "(explicit --seqlens/--hdims still win)")
    p.add_argument("--out", default="./bench_out", help="directory for bench.json and bench.png (default ./bench_out)")
    p.add_argument("--warmup", type=float, default=25, help="warm-up per torch measurement, ms (default 25)")
    p.add_argument("--rep", type=float, default=100, help="timed span per torch measurement, ms (default 100)")
    p.add_argument("--timer", choices=("flush", "loop"), default="flush",
                   help="torch implementations: flush (L2 flushed before each timed call, default) or loop (30 "
                        "calls back to back between CUDA events, median of 5: FA3's protocol)")
    p.add_argument("--rounds", type=_positive_int, default=1,
                   help="measure each shape this many times, interleaved across the implementations, and report "
                        "the median per point (one GPU's single points vary by a few %% between runs; default 1)")
    p.add_argument("--no-plot", action="store_true", help="do not write bench.png")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and resolve defaults: seqlens, hdims and causal become concrete lists."""
    args = build_parser().parse_args(argv)
    if args.seqlens is None:
        args.seqlens = list(QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS)
    if args.hdims is None:
        args.hdims = list(QUICK_HDIMS if args.quick else DEFAULT_HDIMS)
    args.causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    return args


def shapes(args):
    """(hdim, seqlen, causal) in run order."""
    return [(d, s, c) for d in args.hdims for s in args.seqlens for c in args.causals]


def _config(args) -> dict:
    return {"dtype": args.dtype, "seqlens": args.seqlens, "hdims": args.hdims, "causal": args.causals,
            "fwd_only": args.fwd_only, "path": args.path, "warmup_ms": args.warmup, "rep_ms": args.rep,
            "timer": args.timer, "rounds": args.rounds, "total_tokens": report.TOTAL_TOKENS,
            "hidden": report.HIDDEN}


def _timing(args, torch_timer: str) -> dict:
    """How each number was taken; the rounds are named only when there are several, so one round reads as
    before."""
    rounds = f", median of {args.rounds} interleaved rounds" if args.rounds > 1 else ""
    if args.timer == "loop":
        torch = "CUDA events around 30 back-to-back calls (no L2 flush), median of 5 loops"
    else:
        torch = f"{torch_timer}, median, L2 flushed per call, warm-up {args.warmup} ms, timed {args.rep} ms"
    return {
        "torch": torch + rounds,
        "fa3": f"host perf_counter around 30 calls + block_until_ready (JAX runs on its own stream), median of 5"
               f"{rounds}",
    }


def _meta(args, argv, impls, unavailable, interrupted=False) -> dict:
    import torch
    meta = {
        "device": torch.cuda.get_device_name(),
        "capability": "sm_%d%d" % torch.cuda.get_device_capability(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, "-m", "flashtile.bench", *argv]),
        "config": _config(args),
        "unavailable": unavailable,
        "interrupted": interrupted,
    }
    try:
        import triton
        meta["triton"] = triton.__version__
        torch_timer = "triton.testing.do_bench"
    except ImportError:
        torch_timer = "per-call CUDA events (triton not installed)"
    meta["timing"] = _timing(args, torch_timer)
    try:
        import flashtile
        meta["flashtile"] = getattr(flashtile, "__version__", None)
    except Exception:
        pass
    for impl in impls:
        meta.update(getattr(impl, "versions", dict)())
    return meta


def collect(todo, impls, *, dtype, fwd_only, timer, make_inputs, after_shape, bar, rounds=1):
    """Time every (implementation, shape, pass) and yield its row; failures become rows with a reason.

    impls: (implementation, reason it is unavailable or None) pairs. One set of inputs per shape, shared by all
    implementations and dropped (after_shape) before the next shape is made. With rounds > 1 every implementation
    is measured once per round on those inputs, round r starting at implementation r % len(impls), so that none
    always runs first after the inputs are made or last before they are dropped; each row is then the median of
    its rounds (report.aggregate_rounds).
    """
    from . import anchors
    passes = ("fwd",) if fwd_only else report.PASSES
    n = len(impls)
    for d, s, c in todo:
        b, h = report.problem_shape(s, d)
        inp, input_error = None, None
        try:
            inp = make_inputs(b, s, h, d)
        except Exception as exc:
            input_error = report.truncate(f"making inputs failed: {type(exc).__name__}: {exc}", 300)
        results = [[] for _ in impls]  # per implementation, one {pass: Timing} per round
        done = 0  # implementations whose rows have been yielded, in the order of impls
        for r in range(rounds):
            for k in range(n):
                i = (r + k) % n
                impl, why = impls[i]
                desc = f"d={d} s={s} {'causal' if c else 'full'} {impl.name}"
                bar.set_description(desc + (f" round {r + 1}/{rounds}" if rounds > 1 else ""))
                if why or inp is None:
                    res = {p: anchors.Timing(status="skipped" if why else "error", reason=why or input_error)
                           for p in passes}
                else:
                    try:
                        res = impl.measure(inp, c, fwd_only, timer)
                    except Exception as exc:  # a bug in one wrapper must not end the run
                        res = {p: anchors.failure(exc) for p in passes}
                results[i].append(res)
                # Rows go out as soon as they are complete (a Ctrl-C keeps them); with one round that is right
                # after each measurement, as before rounds existed.
                while done < n and len(results[done]) == rounds:
                    for p in passes:
                        ts = [res.get(p) or anchors.Timing(status="error", reason="no result") for res in results[done]]
                        yield report.aggregate_rounds(
                            [report.make_row(impls[done][0].name, d, s, c, p, dtype, t.ms, t.status, t.reason, t.extra)
                             for t in ts])
                    done += 1
                bar.update(1)
        del inp
        after_shape()


def run(args, argv) -> int:
    import torch
    from . import anchors

    if not torch.cuda.is_available():
        print("flashtile.bench needs a CUDA GPU; torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    names = args.impls or list(report.IMPLS)
    impls, unavailable = [], {}
    for impl in anchors.build(names, args.path):
        why = impl.unavailable()
        if why:
            unavailable[impl.name] = why
            print(f"warning: {impl.name} unavailable: {why}", file=sys.stderr)
        # Asked-for implementations stay in the table (as n/a with the reason); the default drops them.
        if not why or args.impls:
            impls.append((impl, why))
    if not impls:
        print("nothing to run: no implementation is available", file=sys.stderr)
        return 2
    impl_names = [i.name for i, _ in impls]
    timer = anchors.make_torch_timer(args.warmup, args.rep, args.timer)

    def free_gpu():
        gc.collect()
        torch.cuda.empty_cache()

    todo = shapes(args)
    bar = report.make_progress(len(todo) * len(impls) * args.rounds)
    rows, interrupted = [], False
    try:
        for row in collect(todo, impls, dtype=args.dtype, fwd_only=args.fwd_only, timer=timer,
                           make_inputs=lambda b, s, h, d: anchors.make_inputs(b, s, h, d, args.dtype),
                           after_shape=free_gpu, bar=bar, rounds=args.rounds):
            rows.append(row)
    except KeyboardInterrupt:
        # Hours of measurements should survive a Ctrl-C: report what was measured.
        interrupted = True
    finally:
        bar.close()
    if interrupted:
        print("interrupted: reporting the shapes measured so far", file=sys.stderr)
        if not rows:
            return 130

    meta = _meta(args, argv, [i for i, _ in impls], unavailable, interrupted)
    title = f"{meta['device']} ({meta['capability']}), {args.dtype}, {report.TOTAL_TOKENS} tokens, " \
            f"hidden {report.HIDDEN}, torch {meta['torch']}"
    print(report.format_table(rows, impl_names, title=title))
    os.makedirs(args.out, exist_ok=True)
    json_path = report.write_json(os.path.join(args.out, "bench.json"), rows, impl_names, meta)
    written = [json_path]
    if not args.no_plot:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = report.write_plot(os.path.join(args.out, "bench.png"), rows, impl_names, title=title)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
        if ok:
            written.append(os.path.join(args.out, "bench.png"))
    print("wrote " + ", ".join(written), file=sys.stderr)
    return 130 if interrupted else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run(parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
