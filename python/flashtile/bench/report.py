"""Pure-Python side of the attention benchmark: problem conventions, FLOP counts, result rows and their
median over rounds, the terminal table, the JSON file, the PNG plot and the progress line.

Nothing here imports torch, JAX or the compiled library, so it runs (and is tested) on any machine.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import time
import warnings
from collections import OrderedDict

TOTAL_TOKENS = 16384
HIDDEN = 2048
IMPLS = ("flashtile", "cudnn", "fa2", "fa3")
ANCHORS = ("cudnn", "fa2", "fa3")
# The targets compare flashtile with the better of these two (DESIGN §7).
BEST_OF = ("fa3", "cudnn")
PASSES = ("fwd", "bwd")
# flashtile outputs further than this from SDPA's (max abs, N(0,1) inputs) are flagged under the table.
MAX_ABS_DIFF_WARN = 5e-2


def problem_shape(seqlen: int, hdim: int, total_tokens: int = TOTAL_TOKENS, hidden: int = HIDDEN):
    """(batch, nheads) for one benchmark shape: a fixed token budget and a fixed hidden size."""
    if seqlen <= 0 or hdim <= 0:
        raise ValueError(f"seqlen and hdim must be positive, got seqlen={seqlen} hdim={hdim}")
    return max(1, total_tokens // seqlen), max(1, hidden // hdim)


def fwd_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, hdim: int, causal: bool) -> float:
    """Two matmuls of 2*sq*sk*d each per head; the causal mask skips half of them."""
    flops = 4.0 * batch * nheads * seqlen_q * seqlen_k * hdim
    return flops / 2 if causal else flops


def bwd_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, hdim: int, causal: bool) -> float:
    """Five matmuls against the forward's two (recomputed S, dV, dP, dQ, dK)."""
    return 2.5 * fwd_flops(batch, nheads, seqlen_q, seqlen_k, hdim, causal)


def pass_flops(pass_: str, batch, nheads, seqlen, hdim, causal) -> float:
    f = fwd_flops if pass_ == "fwd" else bwd_flops
    return f(batch, nheads, seqlen, seqlen, hdim, causal)


def tflops(flops: float, ms):
    """TFLOP/s from a FLOP count and milliseconds; None when there is no valid time."""
    if ms is None or not ms > 0 or math.isinf(ms):
        return None
    return flops / ms / 1e9


def make_row(impl, hdim, seqlen, causal, pass_, dtype, ms=None, status="ok", reason=None, extra=None):
    """One JSON row: one implementation, one shape, one pass (status ok, skipped or error)."""
    batch, nheads = problem_shape(seqlen, hdim)
    flops = pass_flops(pass_, batch, nheads, seqlen, hdim, causal)
    if status == "ok" and tflops(flops, ms) is None:
        status, reason = "error", reason or f"no valid time (ms={ms})"
    ok = status == "ok"
    row = OrderedDict(impl=impl, hdim=hdim, seqlen=seqlen, batch=batch, nheads=nheads, causal=bool(causal),
                      **{"pass": pass_}, dtype=dtype, flops=flops, ms=ms if ok else None,
                      tflops=tflops(flops, ms) if ok else None, status=status,
                      reason=truncate(reason, 300) if reason else None)
    if extra:
        row.update(extra)
    return row


def aggregate_rounds(rows):
    """One row from the rows of one (implementation, shape, pass) measured in several rounds.

    ms is the median of the ok rounds (statistics.median: the mean of the middle two for an even count), with
    the per-round times in rounds_ms (None where a round failed) and spread = (max - min) / median (None with
    fewer than two ok rounds); other fields come from the first ok round. Without an ok round it is the first
    round's failure. A single row comes back unchanged, so one round gives the rows (and keys) it always gave.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("aggregate_rounds needs at least one row")
    if len(rows) == 1:
        return rows[0]
    ok = [r for r in rows if r["status"] == "ok"]
    times = [r["ms"] for r in ok]
    row = OrderedDict(ok[0] if ok else rows[0])
    if ok:
        row["ms"] = statistics.median(times)
        row["tflops"] = tflops(row["flops"], row["ms"])
    row["rounds_ms"] = [r["ms"] if r["status"] == "ok" else None for r in rows]
    row["spread"] = (max(times) - min(times)) / row["ms"] if len(times) >= 2 else None
    return row


def rounds_of(rows) -> int:
    """How many rounds the rows are medians of (1 for rows without rounds_ms)."""
    return max((len(r.get("rounds_ms") or ()) for r in rows), default=1) or 1


def truncate(text, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: max(0, width - 3)] + "..."


# --------------------------------------------------------------------------------------------- ratios

def ratio(num, den):
    if num is None or den is None or not den > 0:
        return None
    return num / den


def fmt_ratio(r) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def fmt_tflops(t) -> str:
    return "n/a" if t is None else f"{t:.1f}"


def best_anchor(values: dict, names=BEST_OF):
    """Largest TFLOP/s among the named anchors that produced a number (None if none did)."""
    got = [values.get(n) for n in names if values.get(n) is not None]
    return max(got) if got else None


def group_rows(rows):
    """{(hdim, seqlen, causal, pass): {impl: tflops or None}} in table order."""
    order = {p: i for i, p in enumerate(PASSES)}
    keys = sorted({(r["hdim"], r["seqlen"], r["causal"], r["pass"]) for r in rows},
                  key=lambda k: (k[0], k[2], order.get(k[3], 9), k[1]))
    groups = OrderedDict((k, {}) for k in keys)
    for r in rows:
        groups[(r["hdim"], r["seqlen"], r["causal"], r["pass"])][r["impl"]] = r["tflops"]
    return groups


def ratio_columns(impls):
    """Ratio columns worth showing: flashtile against each selected anchor, then against the best of FA3/cuDNN."""
    if "flashtile" not in impls:
        return []
    cols = [a for a in ANCHORS if a in impls]
    if any(a in impls for a in BEST_OF):
        cols.append("best")
    return cols


def ratios_for(values: dict, impls):
    ft = values.get("flashtile")
    out = OrderedDict()
    for c in ratio_columns(impls):
        den = best_anchor(values) if c == "best" else values.get(c)
        out[c] = ratio(ft, den)
    return out


def summarize(rows, impls):
    """Per (hdim, seqlen, causal, pass): TFLOP/s of each implementation and flashtile's ratios."""
    out = []
    for (d, s, c, p), vals in group_rows(rows).items():
        out.append(OrderedDict(hdim=d, seqlen=s, causal=c, **{"pass": p},
                               tflops={i: vals.get(i) for i in impls},
                               ratios=ratios_for(vals, impls)))
    return out


# ---------------------------------------------------------------------------------------------- table

def format_table(rows, impls, title: str = "", width: int = 120) -> str:
    """The terminal table: TFLOP/s per implementation and flashtile's ratios, then notes on missing cells."""
    impls = [i for i in IMPLS if i in impls] + [i for i in impls if i not in IMPLS]
    rcols = ratio_columns(impls)
    head = f"{'hdim':>4} {'seqlen':>6} {'causal':>6} {'pass':>4} |"
    head += "".join(f" {i:>9}" for i in impls)
    if rcols:
        head += " |" + "".join(f" {'ft/' + c:>9}" for c in rcols)
    lines = []
    if title:
        lines.append(truncate(title, width))
    legend = "TFLOP/s (higher is better)"
    rounds = rounds_of(rows)
    if rounds > 1:
        legend += f", median of {rounds} rounds"
    if rcols:
        legend += f"; ft/X = flashtile / X; best = best of {'/'.join(BEST_OF)} that ran"
    lines += [legend, head, "-" * len(head)]
    prev = None
    for (d, s, c, p), vals in group_rows(rows).items():
        block = (d, c, p)
        if prev is not None and block != prev:
            lines.append("")
        prev = block
        line = f"{d:>4} {s:>6} {int(c):>6} {p:>4} |" + "".join(f" {fmt_tflops(vals.get(i)):>9}" for i in impls)
        if rcols:
            line += " |" + "".join(f" {fmt_ratio(r):>9}" for r in ratios_for(vals, impls).values())
        lines.append(line)
    notes = format_notes(rows, width)
    if notes:
        lines += ["", "notes:"] + notes
    return "\n".join(lines)


def format_notes(rows, width: int = 120):
    """One line per (implementation, reason) that left cells n/a, the largest spread between rounds of each
    implementation (when there were rounds), and any flagged flashtile output."""
    seen = OrderedDict()
    for r in rows:
        if r["status"] != "ok":
            key = (r["impl"], r["status"], r.get("reason") or "no reason recorded")
            seen[key] = seen.get(key, 0) + 1
    lines = ["  " + truncate(f"{impl}: {n} n/a ({status}): {reason}", width - 2)
             for (impl, status, reason), n in seen.items()]
    widest = OrderedDict()  # impl -> its row with the largest spread, to tell how far one point moved
    for r in rows:
        if r.get("spread") is not None and (r["impl"] not in widest or r["spread"] > widest[r["impl"]]["spread"]):
            widest[r["impl"]] = r
    for impl, r in widest.items():
        lines.append("  " + truncate(f"{impl}: largest spread (max - min) / median over {len(r['rounds_ms'])} rounds "
                                     f"{r['spread']:.1%} (d={r['hdim']} s={r['seqlen']} causal={int(r['causal'])} "
                                     f"{r['pass']})", width - 2))
    for r in rows:
        diff = r.get("max_abs_diff_vs_sdpa")
        if diff is None:
            continue
        if isinstance(diff, str) or not diff <= MAX_ABS_DIFF_WARN:  # a string holds nan/inf
            shown = diff if isinstance(diff, str) else f"{diff:.3g}"
            lines.append("  " + truncate(f"WARNING flashtile d={r['hdim']} s={r['seqlen']} causal={int(r['causal'])}: "
                                         f"max |out - sdpa| = {shown} (> {MAX_ABS_DIFF_WARN})", width - 2))
    return lines


# ----------------------------------------------------------------------------------------------- files

def write_json(path, rows, impls, meta: dict) -> str:
    """bench.json: run metadata, every row (failures with their reason) and the ratio summary."""
    doc = OrderedDict(meta)
    doc["impls"] = list(impls)
    doc["rows"] = _finite(rows)
    doc["summary"] = _finite(summarize(rows, impls))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=1, allow_nan=False, default=str)
        fh.write("\n")
    os.replace(tmp, path)
    return path


def _finite(obj):
    """Non-finite floats as strings, so the file stays strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _finite(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _color(impl: str, k: int) -> str:
    return f"C{IMPLS.index(impl)}" if impl in IMPLS else f"C{len(IMPLS) + k}"


def _seqlen_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def write_plot(path, rows, impls, title: str = "") -> bool:
    """bench.png: TFLOP/s vs seqlen, one subplot per (hdim, causal, pass), one line per implementation.

    Returns False (with a warning) when matplotlib is not installed.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: skipping the plot", stacklevel=2)
        return False
    hdims = sorted({r["hdim"] for r in rows})
    panels = sorted({(r["pass"], r["causal"]) for r in rows}, key=lambda k: (PASSES.index(k[0]), k[1]))
    if not hdims or not panels:
        return False
    fig, axes = plt.subplots(len(hdims), len(panels), figsize=(4.2 * len(panels), 3.2 * len(hdims)),
                             squeeze=False)
    for i, d in enumerate(hdims):
        for j, (p, c) in enumerate(panels):
            ax = axes[i][j]
            sel = [r for r in rows if r["hdim"] == d and r["pass"] == p and r["causal"] == c]
            seqlens = sorted({r["seqlen"] for r in sel})
            for k, impl in enumerate(impls):
                pts = sorted((r["seqlen"], r["tflops"]) for r in sel if r["impl"] == impl and r["tflops"] is not None)
                if pts:
                    # One colour per implementation across all panels; flashtile drawn on top and thicker.
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=impl,
                            color=_color(impl, k), lw=2.5 if impl == "flashtile" else 1.5,
                            zorder=3 if impl == "flashtile" else 2)
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens)
            ax.set_xticklabels([_seqlen_label(s) for s in seqlens])
            ax.set_title(f"hdim {d}, {'causal' if c else 'non-causal'}, {p}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -------------------------------------------------------------------------------------------- progress

class LineProgress:
    """A one-line progress bar on stderr for when tqdm is not installed."""

    def __init__(self, total: int, stream=None):
        self.total, self.n, self.desc = max(1, total), 0, ""
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()

    def set_description(self, desc: str):
        self.desc = desc
        self._draw()

    def update(self, n: int = 1):
        self.n += n
        self._draw()

    def _draw(self):
        cols = shutil.get_terminal_size((100, 20)).columns
        frac = min(1.0, self.n / self.total)
        bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
        text = f"[{bar}] {self.n}/{self.total} {time.perf_counter() - self.t0:5.0f}s {self.desc}"
        self.stream.write("\r" + text[: cols - 1].ljust(cols - 1))
        self.stream.flush()

    def close(self):
        self.stream.write("\n")
        self.stream.flush()


def make_progress(total: int):
    """tqdm on stderr when it is installed, else LineProgress; both offer set_description/update/close."""
    try:
        from tqdm import tqdm
    except ImportError:
        return LineProgress(total)
    return tqdm(total=total, file=sys.stderr, dynamic_ncols=True, leave=True)
