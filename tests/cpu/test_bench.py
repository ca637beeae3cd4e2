"""CPU tests of the benchmark harness's pure-Python parts: FLOP counts, the shape convention, ratios and the
table, bench.json, argument parsing, the measurement loop's failure handling and its interleaved rounds (with
fake implementations).
No GPU, torch CUDA, JAX or compiled library is needed.
"""
import io
import json
import sys

import pytest

from flashtile.bench import anchors, report
from flashtile.bench import __main__ as cli


# ------------------------------------------------------------------------------------------ conventions

def test_fwd_flops_formula_and_causal_halving():
    # 4 * b * h * s^2 * d with b=4, h=16, s=4096, d=128 is exactly 2^39.
    assert report.fwd_flops(4, 16, 4096, 4096, 128, causal=False) == 2.0 ** 39
    assert report.fwd_flops(4, 16, 4096, 4096, 128, causal=True) == 2.0 ** 38
    assert report.fwd_flops(1, 1, 3, 5, 7, causal=False) == 4 * 3 * 5 * 7


def test_bwd_flops_is_two_and_a_half_forward():
    for causal in (False, True):
        f = report.fwd_flops(2, 8, 1024, 1024, 64, causal)
        assert report.bwd_flops(2, 8, 1024, 1024, 64, causal) == 2.5 * f
    assert report.pass_flops("bwd", 16, 16, 1024, 128, True) == 2.5 * report.pass_flops("fwd", 16, 16, 1024, 128, True)


@pytest.mark.parametrize("seqlen,hdim,expected", [
    (512, 64, (32, 32)), (1024, 128, (16, 16)), (4096, 128, (4, 16)), (16384, 256, (1, 8)),
    (32768, 128, (1, 16)),  # fewer than one sequence per batch still runs one
])
def test_problem_shape_keeps_16k_tokens_and_hidden_2048(seqlen, hdim, expected):
    assert report.problem_shape(seqlen, hdim) == expected


def test_problem_shape_rejects_nonpositive():
    with pytest.raises(ValueError):
        report.problem_shape(0, 128)


def test_tflops_units_and_invalid_times():
    assert report.tflops(1e12, 1.0) == pytest.approx(1000.0)  # 1e12 FLOP in 1 ms = 1000 TFLOP/s
    assert report.tflops(1e12, None) is None
    assert report.tflops(1e12, 0.0) is None
    assert report.tflops(1e12, float("nan")) is None


def test_make_row_fields():
    r = report.make_row("cudnn", 128, 4096, True, "bwd", "bf16", ms=2.0)
    flops = 2.5 * 4 * 4 * 16 * 4096 * 4096 * 128 / 2
    assert (r["batch"], r["nheads"], r["pass"], r["status"]) == (4, 16, "bwd", "ok")
    assert r["flops"] == flops and r["tflops"] == pytest.approx(flops / 2.0 / 1e9)
    bad = report.make_row("fa3", 64, 1024, False, "fwd", "bf16", status="skipped", reason="x" * 1000)
    assert bad["ms"] is None and bad["tflops"] is None and bad["status"] == "skipped"
    assert len(bad["reason"]) == 300 and bad["reason"].endswith("...")
    # "ok" without a usable time is an error, not a silent zero.
    assert report.make_row("fa2", 128, 1024, False, "fwd", "bf16", ms=None)["status"] == "error"
    assert report.make_row("fa2", 128, 1024, False, "fwd", "bf16", ms=1.0, extra={"k": 1})["k"] == 1


# ------------------------------------------------------------------------------------------ ratios/table

def test_ratio_formatting_and_na():
    assert report.fmt_ratio(report.ratio(618.0, 600.0)) == "1.03x"
    assert report.fmt_ratio(report.ratio(None, 600.0)) == "n/a"
    assert report.fmt_ratio(report.ratio(600.0, None)) == "n/a"
    assert report.ratio(600.0, 0.0) is None
    assert report.fmt_tflops(None) == "n/a" and report.fmt_tflops(612.34) == "612.3"


def test_best_anchor_is_best_of_fa3_and_cudnn_only():
    assert report.best_anchor({"fa3": 500.0, "cudnn": 550.0, "fa2": 900.0}) == 550.0
    assert report.best_anchor({"fa3": None, "cudnn": 400.0}) == 400.0
    assert report.best_anchor({"fa2": 300.0}) is None
    r = report.ratios_for({"flashtile": 660.0, "fa3": 600.0, "cudnn": 550.0, "fa2": 330.0}, report.IMPLS)
    assert list(r) == ["cudnn", "fa2", "fa3", "best"]
    assert r["best"] == pytest.approx(1.1) and r["fa2"] == pytest.approx(2.0)


def test_ratio_columns_follow_selected_impls():
    assert report.ratio_columns(["cudnn", "fa2"]) == []  # no flashtile, no ratios
    assert report.ratio_columns(["flashtile", "fa2"]) == ["fa2"]
    assert report.ratio_columns(["flashtile", "fa3"]) == ["fa3", "best"]


def _fake_rows():
    rows = []
    for s in (1024, 4096):
        for p in ("fwd", "bwd"):
            rows.append(report.make_row("flashtile", 128, s, False, p, "bf16", ms=1.0))
            rows.append(report.make_row("cudnn", 128, s, False, p, "bf16", ms=1.25))
            rows.append(report.make_row("fa2", 128, s, False, p, "bf16", ms=2.0))
            rows.append(report.make_row("fa3", 128, s, False, p, "bf16", status="error", reason="XlaRuntimeError: boom"))
    rows.append(report.make_row("flashtile", 64, 1024, True, "fwd", "bf16", status="skipped",
                                reason="NotImplementedError: hdim 64 not built"))
    rows.append(report.make_row("cudnn", 64, 1024, True, "fwd", "bf16", ms=1.0))
    return rows


def _table_row(table, hdim, seqlen, causal, pass_):
    for line in table.splitlines():
        f = line.split()
        if f[:4] == [str(hdim), str(seqlen), str(causal), pass_]:
            return f
    raise AssertionError(f"no row for {hdim} {seqlen} {causal} {pass_} in\n{table}")


def test_table_values_ratios_and_na():
    table = report.format_table(_fake_rows(), list(report.IMPLS), title="NVIDIA H200")
    assert all(len(line) <= 120 for line in table.splitlines())
    # columns: hdim seqlen causal pass | flashtile cudnn fa2 fa3 | ft/cudnn ft/fa2 ft/fa3 ft/best
    f = _table_row(table, 128, 4096, 0, "fwd")
    assert f[5:9] == ["549.8", "439.8", "274.9", "n/a"]  # 2^39 FLOP in 1.0 / 1.25 / 2.0 ms
    assert f[10:14] == ["1.25x", "2.00x", "n/a", "1.25x"]  # best falls back to cuDNN when FA3 failed
    g = _table_row(table, 64, 1024, 1, "fwd")
    assert g[5] == "n/a" and g[10:14] == ["n/a", "n/a", "n/a", "n/a"]
    assert "fa3: 4 n/a (error): XlaRuntimeError: boom" in table
    assert "flashtile: 1 n/a (skipped): NotImplementedError: hdim 64 not built" in table
    # fwd rows of a block come before its bwd rows
    order = [tuple(line.split()[:4]) for line in table.splitlines() if line.split()[:1] == ["128"]]
    assert order == [("128", "1024", "0", "fwd"), ("128", "4096", "0", "fwd"),
                     ("128", "1024", "0", "bwd"), ("128", "4096", "0", "bwd")]


def test_table_without_flashtile_has_no_ratio_columns():
    rows = [r for r in _fake_rows() if r["impl"] in ("cudnn", "fa2")]
    table = report.format_table(rows, ["cudnn", "fa2"])
    assert "ft/" not in table
    f = _table_row(table, 128, 1024, 0, "bwd")
    assert f[4:] == ["|", "274.9", "171.8"]  # 2.5 * 2^37 FLOP in 1.25 / 2.0 ms


def test_flashtile_accuracy_warning_in_notes():
    rows = [report.make_row("flashtile", 128, 1024, False, "fwd", "bf16", ms=1.0, extra={"max_abs_diff_vs_sdpa": 0.5}),
            report.make_row("flashtile", 128, 4096, False, "fwd", "bf16", ms=1.0, extra={"max_abs_diff_vs_sdpa": 0.004})]
    notes = report.format_notes(rows)
    assert len(notes) == 1 and "s=1024" in notes[0] and "0.5" in notes[0]
    for bad in ("nan", float("nan")):  # NaN output is flagged, not passed (JSON keeps it as a string)
        rows[1]["max_abs_diff_vs_sdpa"] = bad
        assert len(report.format_notes([rows[1]])) == 1


# --------------------------------------------------------------------------------------------- files

def test_write_json(tmp_path):
    rows = _fake_rows()
    meta = {"device": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0", "timestamp": "2026-11-21T12:00:00+00:00",
            "command": "python -m flashtile.bench --quick"}
    path = report.write_json(str(tmp_path / "sub" / "bench.json"), rows, list(report.IMPLS), meta)
    doc = json.loads(open(path).read())
    assert doc["device"] == "NVIDIA H200" and doc["command"].endswith("--quick")
    assert doc["impls"] == list(report.IMPLS)
    assert len(doc["rows"]) == len(rows)
    fa3 = [r for r in doc["rows"] if r["impl"] == "fa3"]
    assert all(r["tflops"] is None and r["status"] == "error" and "boom" in r["reason"] for r in fa3)
    s = [e for e in doc["summary"] if (e["hdim"], e["seqlen"], e["causal"], e["pass"]) == (128, 4096, False, "bwd")]
    assert len(s) == 1
    assert s[0]["ratios"]["cudnn"] == pytest.approx(1.25) and s[0]["ratios"]["fa3"] is None
    assert s[0]["ratios"]["best"] == pytest.approx(1.25)
    assert not (tmp_path / "sub" / "bench.json.tmp").exists()


def test_plot_skipped_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.warns(UserWarning, match="matplotlib"):
        assert report.write_plot(str(tmp_path / "bench.png"), _fake_rows(), list(report.IMPLS)) is False
    assert not (tmp_path / "bench.png").exists()


def test_plot_written_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert report.write_plot(str(path), _fake_rows(), list(report.IMPLS), title="t") is True
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_line_progress():
    buf = io.StringIO()
    bar = report.LineProgress(4, stream=buf)
    bar.set_description("d=128 s=1024 fa3")
    bar.update(1)
    bar.update(1)
    bar.close()
    out = buf.getvalue()
    assert out.count("\r") == 3 and out.endswith("\n") and "\n" not in out[:-1]
    assert "2/4" in out and "d=128 s=1024 fa3" in out


# ------------------------------------------------------------------------------------------------ CLI

def test_parse_defaults():
    a = cli.parse_args([])
    assert a.seqlens == [512, 1024, 2048, 4096, 8192, 16384] and a.hdims == [64, 128, 256]
    assert a.causals == [False, True] and a.dtype == "bf16" and a.path == "auto" and a.impls is None
    assert a.out == "./bench_out" and not a.fwd_only
    assert len(cli.shapes(a)) == 3 * 6 * 2


def test_parse_quick_and_overrides():
    a = cli.parse_args(["--quick"])
    assert a.seqlens == [1024, 4096] and a.hdims == [128]
    assert cli.shapes(a) == [(128, 1024, False), (128, 1024, True), (128, 4096, False), (128, 4096, True)]
    b = cli.parse_args(["--quick", "--seqlens", "2048", "--causal", "1"])
    assert b.seqlens == [2048] and b.hdims == [128] and b.causals == [True]
    c = cli.parse_args(["--impls", "fa3,cudnn,fa3", "--path", "hopper", "--dtype", "fp16", "--fwd-only",
                        "--hdims", "64,256", "--out", "/tmp/x"])
    assert c.impls == ["fa3", "cudnn"] and c.path == "hopper" and c.dtype == "fp16" and c.fwd_only
    assert c.hdims == [64, 256] and c.out == "/tmp/x"


@pytest.mark.parametrize("argv", [["--impls", "fa4"], ["--seqlens", "0"], ["--seqlens", "1k"],
                                  ["--causal", "2"], ["--path", "volta"], ["--dtype", "fp32"],
                                  ["--rounds", "0"], ["--rounds", "-2"], ["--rounds", "1.5"], ["--rounds", "x"],
                                  ["--timer", "sleep"]])
def test_parse_rejects_bad_values(argv, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(argv)


def test_parse_rounds():
    assert cli.parse_args([]).rounds == 1
    assert cli.parse_args(["--rounds", "5"]).rounds == 5


def test_timer_protocols():
    assert cli.parse_args([]).timer == "flush"
    loop = cli.parse_args(["--timer", "loop"])
    assert cli._config(loop)["timer"] == "loop"
    assert cli._timing(loop, "do_bench")["torch"].startswith("CUDA events around 30 back-to-back calls")
    assert "flushed" in cli._timing(cli.parse_args([]), "do_bench")["torch"]
    assert anchors.make_torch_timer(25, 100, "loop") is anchors.loop_median


def test_rounds_in_config_and_timing_text(monkeypatch):
    one, three = cli.parse_args(["--quick"]), cli.parse_args(["--quick", "--rounds", "3"])
    assert cli._config(one)["rounds"] == 1 and cli._config(three)["rounds"] == 3
    # the timing text names the rounds only when there are several, so one round reads as before
    assert cli._timing(one, "do_bench")["torch"] == "do_bench, median, L2 flushed per call, warm-up 25 ms, timed 100 ms"
    assert "interleaved" not in cli._timing(one, "do_bench")["fa3"]
    t = cli._timing(three, "do_bench")
    assert t["torch"].endswith("timed 100 ms, median of 3 interleaved rounds")
    assert t["fa3"].endswith("median of 5, median of 3 interleaved rounds")
    # and the metadata run() writes carries them (the GPU queries faked)
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    meta = cli._meta(three, ["--quick", "--rounds", "3"], [], {})
    assert meta["config"]["rounds"] == 3 and meta["config"]["seqlens"] == [1024, 4096]
    assert "median of 3 interleaved rounds" in meta["timing"]["torch"]
    assert meta["command"].endswith("--quick --rounds 3")
    assert "interleaved" not in cli._meta(one, ["--quick"], [], {})["timing"]["torch"]


# ---------------------------------------------------------------------------------------- anchors/loop

def test_flashtile_kwargs_and_fa3_support():
    assert anchors.flashtile_kwargs("auto") == {}
    assert anchors.flashtile_kwargs("hopper") == {"path": "hopper"}
    assert anchors.fa3_unsupported(128, "bf16") is None and anchors.fa3_unsupported(128, "fp16") is None
    assert "hdim 64" in anchors.fa3_unsupported(64, "bf16")
    with pytest.raises(ValueError):
        anchors.build(["flashtile", "fa4"])
    assert [i.name for i in anchors.build(["fa3", "fa2", "cudnn", "flashtile"])] == ["fa3", "fa2", "cudnn", "flashtile"]


def test_failure_classification():
    assert anchors.failure(NotImplementedError("bwd not built")).status == "skipped"
    t = anchors.failure(RuntimeError("x" * 1000))
    assert t.status == "error" and t.reason.startswith("RuntimeError: x") and len(t.reason) == anchors.REASON_WIDTH


def test_flashtile_path_typeerror_is_explained():
    impl = anchors.FlashtileImpl("ampere")
    t = impl.explain(anchors.failure(TypeError("flash_attn_func() got an unexpected keyword argument 'path'")))
    assert "does not take path='ampere'" in t.reason
    t = anchors.FlashtileImpl("auto").explain(anchors.failure(TypeError("bad 'path'")))
    assert "does not take" not in t.reason


class _FakeImpl:
    def __init__(self, name, behaviour):
        self.name, self.behaviour = name, behaviour

    def measure(self, inp, causal, fwd_only, timer):
        if self.behaviour == "raise":
            raise RuntimeError("wrapper bug")
        if self.behaviour == "nobwd":
            return {"fwd": anchors.Timing(ms=1.0),
                    "bwd": anchors.Timing(status="skipped", reason="NotImplementedError: no bwd")}
        return {p: anchors.Timing(ms=timer(None)) for p in (("fwd",) if fwd_only else ("fwd", "bwd"))}


class _NullBar:
    def __init__(self):
        self.n, self.descs = 0, []

    def set_description(self, d):
        self.descs.append(d)

    def update(self, n=1):
        self.n += n


def test_collect_keeps_going_and_records_reasons():
    impls = [(_FakeImpl("flashtile", "nobwd"), None), (_FakeImpl("cudnn", "ok"), None),
             (_FakeImpl("fa2", "raise"), None), (_FakeImpl("fa3", "ok"), "jax is not installed")]
    made, freed, bar = [], [], _NullBar()
    todo = [(128, 1024, False), (128, 2048, True)]
    rows = list(cli.collect(todo, impls, dtype="bf16", fwd_only=False, timer=lambda fn: 2.0,
                            make_inputs=lambda b, s, h, d: made.append((b, s, h, d)) or object(),
                            after_shape=lambda: freed.append(1), bar=bar))
    assert made == [(16, 1024, 16, 128), (8, 2048, 16, 128)] and len(freed) == 2
    assert bar.n == 8 and len(rows) == 2 * 4 * 2
    by = {(r["impl"], r["seqlen"], r["pass"]): r for r in rows}
    assert by[("cudnn", 2048, "bwd")]["ms"] == 2.0 and by[("cudnn", 2048, "bwd")]["status"] == "ok"
    assert by[("flashtile", 1024, "bwd")]["status"] == "skipped" and by[("flashtile", 1024, "fwd")]["ms"] == 1.0
    assert by[("fa2", 1024, "fwd")]["status"] == "error" and "wrapper bug" in by[("fa2", 1024, "fwd")]["reason"]
    assert by[("fa3", 1024, "fwd")]["reason"] == "jax is not installed"


def test_collect_input_failure_and_fwd_only():
    def boom(b, s, h, d):
        raise MemoryError("CUDA out of memory")
    rows = list(cli.collect([(256, 16384, False)], [(_FakeImpl("cudnn", "ok"), None)], dtype="fp16",
                            fwd_only=True, timer=lambda fn: 1.0, make_inputs=boom, after_shape=lambda: None,
                            bar=_NullBar()))
    assert len(rows) == 1 and rows[0]["pass"] == "fwd" and rows[0]["status"] == "error"
    assert "out of memory" in rows[0]["reason"] and rows[0]["dtype"] == "fp16"


# ---------------------------------------------------------------------------------------------- rounds

def _round_rows(*results, impl="cudnn", seqlen=4096, extra=None):
    """Rows of one (impl, shape, pass), one per round: a number is an ok round's ms, a string a failure."""
    return [report.make_row(impl, 128, seqlen, False, "fwd", "bf16", ms=x, extra=extra) if not isinstance(x, str)
            else report.make_row(impl, 128, seqlen, False, "fwd", "bf16", status=x.split(":")[0], reason=x)
            for x in results]


def test_aggregate_rounds_median_odd_and_even():
    r = report.aggregate_rounds(_round_rows(3.0, 1.0, 2.0, extra={"transfer": "dlpack"}))
    assert r["ms"] == 2.0 and r["tflops"] == pytest.approx(2.0 ** 39 / 2.0 / 1e9)
    assert r["rounds_ms"] == [3.0, 1.0, 2.0] and r["spread"] == pytest.approx(1.0)  # (3 - 1) / 2
    assert r["status"] == "ok" and r["reason"] is None and r["transfer"] == "dlpack"
    r = report.aggregate_rounds(_round_rows(1.0, 4.0, 2.0, 3.0))
    assert r["ms"] == 2.5 and r["tflops"] == pytest.approx(2.0 ** 39 / 2.5 / 1e9)  # mean of the middle two
    assert r["spread"] == pytest.approx(3.0 / 2.5)


def test_aggregate_rounds_ignores_failed_rounds():
    r = report.aggregate_rounds(_round_rows(2.0, "error: RuntimeError: boom", 4.0))
    assert r["status"] == "ok" and r["reason"] is None and r["ms"] == 3.0
    assert r["rounds_ms"] == [2.0, None, 4.0] and r["spread"] == pytest.approx(2.0 / 3.0)
    r = report.aggregate_rounds(_round_rows("error: RuntimeError: boom", 5.0))
    assert r["status"] == "ok" and r["ms"] == 5.0 and r["rounds_ms"] == [None, 5.0]
    assert r["spread"] is None  # one ok round has no spread


def test_aggregate_rounds_all_failed_keeps_first_failure():
    r = report.aggregate_rounds(_round_rows("error: RuntimeError: first", "skipped: NotImplementedError: second"))
    assert r["status"] == "error" and r["reason"] == "error: RuntimeError: first"
    assert r["ms"] is None and r["tflops"] is None and r["rounds_ms"] == [None, None] and r["spread"] is None


def test_aggregate_single_round_is_the_row_unchanged():
    row = _round_rows(2.0)[0]
    assert report.aggregate_rounds([row]) is row and "rounds_ms" not in row and "spread" not in row
    with pytest.raises(ValueError):
        report.aggregate_rounds([])


class _RecordingImpl:
    """Returns the next of its per-call times (a string raises) and logs each call in a shared list."""

    def __init__(self, name, log, times=None):
        self.name, self.log, self.times, self.inputs = name, log, list(times or []), []

    def measure(self, inp, causal, fwd_only, timer):
        self.log.append(self.name)
        self.inputs.append(inp)
        ms = self.times.pop(0) if self.times else 1.0
        if isinstance(ms, str):
            raise RuntimeError(ms)
        passes = ("fwd",) if fwd_only else ("fwd", "bwd")
        return {p: anchors.Timing(ms=ms * (2 if p == "bwd" else 1)) for p in passes}


def _collect(impls, todo=((128, 1024, False),), **kw):
    made, freed, bar = [], [], _NullBar()
    kw = {"dtype": "bf16", "fwd_only": False, "timer": None, **kw}
    rows = list(cli.collect(list(todo), impls, make_inputs=lambda b, s, h, d: made.append((s, d)) or object(),
                            after_shape=lambda: freed.append(1), bar=bar, **kw))
    return rows, made, freed, bar


def test_collect_rounds_rotate_the_order_and_share_the_inputs():
    log = []
    a, b, c = (_RecordingImpl(n, log, times) for n, times in
               (("flashtile", [1.0, 4.0, 2.0, 3.0]), ("cudnn", [2.0, 2.0, 2.0, 2.0]), ("fa2", [5.0, "boom", 3.0, 4.0])))
    rows, made, freed, bar = _collect([(a, None), (b, None), (c, None)], rounds=4)
    # round r starts at implementation r % 3
    assert log == ["flashtile", "cudnn", "fa2", "cudnn", "fa2", "flashtile",
                   "fa2", "flashtile", "cudnn", "flashtile", "cudnn", "fa2"]
    assert made == [(1024, 128)] and len(freed) == 1 and bar.n == 3 * 4
    assert all(inp is a.inputs[0] for impl in (a, b, c) for inp in impl.inputs)  # one set of inputs per shape
    assert "round 2/4" in bar.descs[3] and "cudnn" in bar.descs[3]
    # rows in the order of impls, not of the last round
    assert [(r["impl"], r["pass"]) for r in rows] == [(i, p) for i in ("flashtile", "cudnn", "fa2")
                                                      for p in ("fwd", "bwd")]
    by = {(r["impl"], r["pass"]): r for r in rows}
    # flashtile's k-th call is in its k-th round whatever the rotation; fa2's second round raised
    assert by[("flashtile", "fwd")]["ms"] == 2.5 and by[("flashtile", "fwd")]["rounds_ms"] == [1.0, 4.0, 2.0, 3.0]
    assert by[("flashtile", "bwd")]["ms"] == 5.0 and by[("flashtile", "bwd")]["spread"] == pytest.approx(6.0 / 5.0)
    assert by[("cudnn", "fwd")]["ms"] == 2.0 and by[("cudnn", "fwd")]["spread"] == 0.0
    assert by[("fa2", "fwd")]["ms"] == 4.0 and by[("fa2", "fwd")]["rounds_ms"] == [5.0, None, 3.0, 4.0]
    assert by[("fa2", "fwd")]["status"] == "ok"


def test_collect_rounds_over_shapes_and_failures():
    log = []
    ok, bad = _RecordingImpl("cudnn", log), _RecordingImpl("fa2", log, ["x"] * 10)
    impls = [(ok, None), (bad, None), (_RecordingImpl("fa3", log), "jax is not installed")]
    rows, made, freed, bar = _collect(impls, todo=[(128, 1024, False), (64, 2048, True)], rounds=2, fwd_only=True)
    assert made == [(1024, 128), (2048, 64)] and len(freed) == 2 and bar.n == 2 * 3 * 2
    # the rotation starts over with each shape; the unavailable fa3 is never called
    assert log == ["cudnn", "fa2", "fa2", "cudnn"] * 2
    assert len(rows) == 2 * 3 and all(r["pass"] == "fwd" for r in rows)
    fa2 = [r for r in rows if r["impl"] == "fa2"]
    assert all(r["status"] == "error" and "RuntimeError: x" in r["reason"] and r["rounds_ms"] == [None, None]
               for r in fa2)
    fa3 = [r for r in rows if r["impl"] == "fa3"]
    assert all(r["status"] == "skipped" and r["reason"] == "jax is not installed" for r in fa3)


def test_collect_one_round_gives_the_rows_it_always_gave():
    log = []
    impls = [(_RecordingImpl("flashtile", log, [1.0]), None), (_RecordingImpl("cudnn", log, ["boom"]), None)]
    rows, _, _, bar = _collect(impls, rounds=1)
    expected = [report.make_row("flashtile", 128, 1024, False, "fwd", "bf16", ms=1.0),
                report.make_row("flashtile", 128, 1024, False, "bwd", "bf16", ms=2.0)]
    assert rows[:2] == expected and [list(r) for r in rows] == [list(expected[0])] * 4  # same keys, same order
    assert rows[2]["status"] == "error" and rows[2]["reason"] == "RuntimeError: boom"
    assert bar.n == 2 and bar.descs == ["d=128 s=1024 full flashtile", "d=128 s=1024 full cudnn"]
    # rounds=1 is the default, and rows still come out right after each measurement (a Ctrl-C keeps them)
    log.clear()
    impls = [(_RecordingImpl("flashtile", log), None), (_RecordingImpl("cudnn", log), None)]
    gen = cli.collect([(128, 1024, False)], impls, dtype="bf16", fwd_only=False, timer=None,
                      make_inputs=lambda *a: object(), after_shape=lambda: None, bar=_NullBar())
    assert next(gen)["impl"] == "flashtile" and log == ["flashtile"]


def test_one_round_json_has_no_round_fields(tmp_path):
    rows, _, _, _ = _collect([(_RecordingImpl("cudnn", []), None)])
    doc = json.loads(open(report.write_json(str(tmp_path / "bench.json"), rows, ["cudnn"], {})).read())
    assert all("rounds_ms" not in r and "spread" not in r for r in doc["rows"])
    rows, _, _, _ = _collect([(_RecordingImpl("cudnn", [], [1.0, 3.0]), None)], rounds=2)
    doc = json.loads(open(report.write_json(str(tmp_path / "bench.json"), rows, ["cudnn"], {})).read())
    assert doc["rows"][0]["rounds_ms"] == [1.0, 3.0] and doc["rows"][0]["spread"] == pytest.approx(1.0)


def test_table_names_the_rounds_and_the_largest_spread():
    one = report.format_table(_fake_rows(), list(report.IMPLS))
    assert "median of" not in one and "spread" not in one
    rows = [report.aggregate_rounds(_round_rows(*ms, impl=impl, seqlen=s))
            for s, ft, cu in ((1024, (1.0, 1.1, 1.2), (2.0, 2.0, 2.0)), (4096, (1.0, 1.05, 1.0), (2.0, 2.1, 2.0)))
            for impl, ms in (("flashtile", ft), ("cudnn", cu))]
    table = report.format_table(rows, ["flashtile", "cudnn"], title="NVIDIA H200")
    assert all(len(line) <= 120 for line in table.splitlines())
    assert "TFLOP/s (higher is better), median of 3 rounds" in table
    assert "flashtile: largest spread (max - min) / median over 3 rounds 18.2% (d=128 s=1024 causal=0 fwd)" in table
    assert "cudnn: largest spread (max - min) / median over 3 rounds 5.0% (d=128 s=4096 causal=0 fwd)" in table
    assert _table_row(table, 128, 1024, 0, "fwd")[5] == f"{2.0 ** 37 / 1.1 / 1e9:.1f}"  # the median's
