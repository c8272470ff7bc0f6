"""The benchmark runs end to end (CPU here, CUDA when present), checks its own
points against the reference, and reports every op with consistent bytes."""

import io
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from torch_moe_a2a.bench import common, plot, single, targets
from torch_moe_a2a.reference import random_routing

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_bench_runs_and_reports_every_op(device, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = single.main(["--device", device, "--preset", "mixtral", "--ep", "1", "2", "--tokens", "1", "3",
                     "--iters", "2", "--warmup", "1", "--json", str(out)])
    assert rc == 0, capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["copy_bandwidth_GBps"] > 0
    assert set(data["host_cost_us"]) >= {"dispatch", "combine"}
    assert all(v > 0 for v in data["host_cost_us"].values())
    # CPU time and wall time of the same calls: the thread runs within its wall time.
    assert set(data["host_wall_us"]) == set(data["host_cost_us"])
    assert all(0 < data["host_cost_us"][k] <= data["host_wall_us"][k] * 1.05 + 1.0 for k in data["host_wall_us"])
    points = data["points"]
    assert [(p["ep"], p["tokens_per_rank"]) for p in points] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    preset = common.PRESETS["mixtral"]
    dispatch_row = preset.hidden * preset.dtype.itemsize + 2 * 4 * preset.top_k  # hidden + int32 ids + fp32 weights
    combine_row = preset.hidden * preset.dtype.itemsize
    for p in points:
        assert p["status"] == "ok", p["notes"]
        ops = p["ops"]
        assert set(ops) == set(common.OPS)
        for op, m in ops.items():
            assert m["eager_us"] > 0 and m["GBps"] > 0, op
            assert (m["graph_us"] is not None) == (device == "cuda"), op
            # Per step of a multi-step graph: the round trips, on CUDA.
            assert (m["graph_step_us"] is not None) == (device == "cuda" and op.startswith("round-trip")), op
            if m["graph_step_us"] is not None:
                assert m["graph_step_us"] > 0, op
        b = {op: m["bytes"] for op, m in ops.items()}
        assert b["round-trip"] == pytest.approx(b["dispatch"] + b["combine"])
        assert b["round-trip-ws"] == pytest.approx(b["dispatch"] + b["combine-ws"])
        if p["ep"] == 1:
            # One rank owns every expert: each token is sent once, received once.
            tokens = p["tokens_per_rank"]
            assert b["dispatch"] == 2 * tokens * dispatch_row
            assert b["combine-ws"] == 2 * tokens * combine_row
            assert b["combine"] == 4 * tokens * combine_row
    assert all(p["timing_spread"] >= 0 for p in points)
    table = capsys.readouterr().out
    assert "round-trip-ws" in table and "summary: 4 points ok, 0 FAIL/error" in table
    assert "timing spread: interquartile range up to" in table
    # The estimate comes before the first row of the table.
    assert table.index("sweep: 4 points, estimated") < table.index("round-trip-ws")
    assert data["estimated_sweep_s"] > 0 and data["sweep_s"] > 0
    assert all(p["wall_s"] > 0 for p in points)


def test_timing_spread_and_its_busy_hint():
    assert single.timing_spread([10.0], 10.0) == 0.0
    assert single.timing_spread([10.0, 10.0, 10.0, 10.0], 10.0) == 0.0
    # Quartiles 10 and 15 (inclusive method) around a median of 12.5.
    assert single.timing_spread([10.0, 10.0, 15.0, 15.0, 10.0, 15.0], 12.5) == pytest.approx(0.4)
    records = []
    for spread, ep in ((0.05, 1), (0.4, 2)):
        r = common.new_record(common.Point(common.PRESETS["mixtral"], ep, 3, False))
        r["timing_spread"] = spread
        r["ops"] = {op: {"copy_ratio": 0.5, "GBps": 1.0, "speedup_eager": 1.0, "speedup_graph": None}
                    for op in common.OPS}
        records.append(r)
    text = single._summary(records, 10.0, {}, {}, False, "cpu")
    assert "timing spread: interquartile range up to 40% of the median (mixtral ep 2 x 3 tok)" in text
    assert "the machine was busy or the iterations too few" in text
    calm = single._summary(records[:1], 10.0, {}, {}, False, "cpu")
    assert "up to 5% of the median" in calm and "busy" not in calm


def test_default_cpu_sweep_is_sized_for_a_small_machine():
    """The CPU defaults (every preset) are estimated at two minutes at most
    on a machine of two cores' copy bandwidth and host cost."""
    ctx = single._Context(torch.device("cpu"), None, single.DEFAULT_ITERS_FOR["cpu"],
                          single.DEFAULT_WARMUP_FOR["cpu"], int(common.DEFAULT_MAX_GIB["cpu"] * common.GIB),
                          common.L2_BYTES_DEFAULT, 8.0, None, graphs=False)
    points = [common.Point(p, ep, t, False) for p in common.PRESETS.values()
              for ep in single.DEFAULT_EP["cpu"] for t in single.DEFAULT_TOKENS["cpu"]]
    _, seconds = single._estimate_line(points, ctx, {"dispatch": 20.0})
    assert 20 < seconds < 120, seconds


def test_op_graphs_and_time_ops_pair_every_op_with_its_partner():
    """OpGraphs captures each step of every input set once and replays the
    matching capture; time_ops times the ops in OPS order, dispatch with an
    untimed combine after it, each combine with an untimed dispatch before it.
    CPU stand-ins for the CUDA graphs (the CUDA runs use the same calls)."""
    ran = []

    class Steps:
        def dispatch(self, i):
            ran.append(("dispatch", i))

        def combine(self, i):
            ran.append(("combine", i))
            return [f"combine output of set {i}"]

        def combine_ws(self, i=0):
            ran.append(("combine_ws", i))

        def round_trip(self, i):
            ran.append(("round_trip", i))

        def round_trip_ws(self, i):
            ran.append(("round_trip_ws", i))

    class Graph:
        def __init__(self, step):
            self.replay = step

    def capture(step):
        return Graph(step), step()

    graphs = common.OpGraphs(Steps(), 2, capture)
    assert ran == [("dispatch", 0), ("dispatch", 1), ("combine", 0), ("combine", 1), ("round_trip", 0),
                   ("round_trip", 1), ("combine_ws", 0), ("round_trip_ws", 0), ("round_trip_ws", 1)]
    ran.clear()
    assert graphs.combine(1) == ["combine output of set 1"] and ran == [("combine", 1)]

    timed = []

    def measure(step, before=None, after=None, **options):
        parts = []  # (role, the step that ran) in the order they ran
        for role, call in (("before", before), ("timed", step), ("after", after)):
            if call is not None:
                ran.clear()
                call(1)
                parts.append((role, *ran))
        timed.append((parts, options))
        return float(len(timed))

    assert common.time_ops(measure, graphs, head_start=True) == {op: float(k + 1) for k, op in enumerate(common.OPS)}
    assert [t[0] for t in timed] == [
        [("timed", ("dispatch", 1)), ("after", ("combine", 1))],
        [("before", ("dispatch", 1)), ("timed", ("combine", 1))],
        [("before", ("dispatch", 1)), ("timed", ("combine_ws", 0))],  # one region for every set
        [("timed", ("round_trip", 1))],
        [("timed", ("round_trip_ws", 1))],
    ]
    assert all(options == {"head_start": True} for _, options in timed)


def _target_record(tokens: int, ops: dict) -> dict:
    return {"preset": targets.TARGET_PRESET, "fp8": False, "ep": targets.TARGET_EP, "tokens_per_rank": tokens,
            "status": "ok", "notes": [], "ops": ops}


def test_targets_are_judged_from_the_measured_points():
    """The speed targets in the summary: the ratios at 4096 tokens, both round
    trip times, the host cost; ok or MISS each, n/a where a time is missing,
    nothing on the CPU or for points the run did not measure."""
    big = _target_record(targets.TARGET_RATIO_TOKENS,
                         {"dispatch": {"copy_ratio": 0.791}, "combine-ws": {"copy_ratio": 0.989}})
    small = _target_record(128, {"round-trip-ws": {"graph_step_us": 59.5, "graph_us": 66.0}})
    one = _target_record(1, {"round-trip-ws": {"graph_step_us": None, "graph_us": 14.0}})
    other = dict(_target_record(128, {}), ep=4)  # not the target's ep: ignored
    host = {"dispatch": 12.4, "combine-ws": 21.0}
    lines = targets.single_device([other, big, small, one], host, "cuda")
    assert lines[0].startswith("targets (deepseek-v3 at ep 8")
    body = [line.strip() for line in lines[1:]]
    assert body == [
        "dispatch >= 0.90 x copy at 4096 tok: 0.791 MISS",
        "combine-ws >= 0.85 x copy at 4096 tok: 0.989 ok",
        "round-trip-ws <= 60 us at 128 tok: 59.5 us per step ok, 66.0 us per replay MISS",
        "round-trip-ws <= 15 us at 1 tok: - us per step n/a, 14.0 us per replay ok",
        "host cost <= 20 us CPU time per eager call: at most 21.0 us MISS",
    ]
    assert targets.single_device([big, small, one], host, "cpu") == []
    assert targets.single_device([other], {}, "cuda") == []


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_plain_lines_unless_on_a_terminal():
    """Redirected (a log, a pipe): one line per point, no carriage returns and
    no time estimate; on a terminal: tqdm's bar with the time left."""
    log = io.StringIO()
    progress = common.Progress(2, stream=log)
    progress.phase("mixtral ep 1 x 1 tok", "eager")
    progress.step("mixtral ep 1 x 1 tok")
    progress.step("mixtral ep 1 x 16 tok")
    progress.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert [line.split(" done")[0] for line in lines] == ["[1/2] mixtral ep 1 x 1 tok", "[2/2] mixtral ep 1 x 16 tok"]

    tty = _Terminal()
    progress = common.Progress(2, stream=tty)
    progress.phase("mixtral ep 1 x 1 tok", "eager")
    progress.step("mixtral ep 1 x 1 tok")
    progress.close()
    frames = tty.getvalue()
    assert "\r" in frames and "1/2" in frames and "mixtral ep 1 x 1 tok: eager" in frames
    assert re.search(r"\[\d\d:\d\d<", frames), frames  # elapsed < remaining


def _bench_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch_moe_a2a", "bench", "--device", "cpu", *args]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_keeps_the_points_done(signum, tmp_path):
    """A small CPU sweep stopped after its first point: the JSON holds the
    points done so far, the table and the summary are printed, and the exit
    code is the signal's (128 + its number)."""
    out, js = tmp_path / "out.txt", tmp_path / "bench.json"
    with open(out, "w") as stdout:
        proc = subprocess.Popen(_bench_cmd("--preset", "mixtral", "--ep", "1", "2", "4", "--tokens", "1", "16", "128",
                                           "--json", str(js)),
                                stdout=stdout, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "MOE_A2A_TIMEOUT_S": "20"})
        try:
            progress = []
            for line in proc.stderr:  # redirected: one line per finished point
                progress.append(line)
                if " done " in line:
                    proc.send_signal(signum)
                    break
            rest = proc.stderr.read()
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert progress and progress[-1].startswith("[1/9] mixtral ep 1 x 1 tok done"), progress
    assert rc == 128 + signum, (rc, rest)
    data = json.loads(js.read_text())
    assert data["interrupted"] is True and data["stopped_by"] == signal.Signals(signum).name
    assert data["points_planned"] == 9 and 1 <= len(data["points"]) < 9, len(data["points"])
    assert all(p["status"] == "ok" and set(p["ops"]) == set(common.OPS) for p in data["points"])
    printed = out.read_text()
    assert printed.index("round-trip-ws") < printed.index("summary: ") < printed.index("stopped by ")
    assert f"summary: {len(data['points'])} points ok" in printed and "(interrupted)" in printed


def test_smoke_prints_the_table_then_the_summary(tmp_path):
    """--smoke (scripts/gpu_check.sh's run) prints like every mode: table
    first, summary last. Its points are skipped here (--max-gib), which is
    enough for the order and keeps the test short."""
    proc = subprocess.run(_bench_cmd("--smoke", "--max-gib", "0.01", "--json", str(tmp_path / "smoke.json")),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("preset "))
    summary = next(i for i, line in enumerate(lines) if line.startswith("summary: "))
    legend = next(i for i, line in enumerate(lines) if line.startswith("ops: combine stages"))
    rows = [line for line in lines[header + 2:legend] if line.strip()]
    assert header < legend < summary and len(rows) == len(single.SMOKE_TOKENS), proc.stdout
    assert all(line.startswith("deepseek-v3") and "skipped" in line for line in rows), rows
    assert not any(line.startswith("deepseek-v3") for line in lines[summary:]), proc.stdout


@pytest.mark.parametrize("module", ["bench", "bench-dist"])
def test_repeated_points_are_measured_once(module):
    # --ep 2 1 2 and --tokens 4 4 1: each point once, in the order first given.
    import argparse

    from torch_moe_a2a.bench import distributed

    parser = argparse.ArgumentParser()
    (single if module == "bench" else distributed).add_arguments(parser)
    argv = ["--tokens", "4", "4", "1"] + (["--ep", "2", "1", "2"] if module == "bench" else [])
    args = parser.parse_args(argv)
    assert args.tokens == [4, 1]
    if module == "bench":
        assert args.ep == [2, 1]


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(plot, "available", lambda: False)
    with pytest.raises(SystemExit) as e:
        single.main(["--device", "cpu", "--plot", str(tmp_path / "bench.png")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "pip install matplotlib" in err and "Traceback" not in err
    assert not (tmp_path / "bench.png").exists()


@pytest.mark.skipif(not plot.available(), reason="matplotlib is not installed (the [plot] extra)")
def test_plot_with_a_broken_matplotlib_stops_before_the_run(monkeypatch, tmp_path, capsys):
    # matplotlib found, its pyplot failing to import: refused before the sweep, not found after it.
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(SystemExit) as e:
        single.main(["--device", "cpu", "--plot", str(tmp_path / "bench.png")])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert "installed but does not import (ModuleNotFoundError" in err and "pip install matplotlib" in err, err
    assert "Traceback" not in err and "torch-moe-a2a bench:" not in out
    assert not (tmp_path / "bench.png").exists()


def _plot_record(preset: str, fp8: bool, ep: int, tokens: int, scale: float) -> dict:
    ops = {op: {"bytes": 1e6 * tokens, "copy_ratio": 0.5 * scale, "eager_us": 100.0 * tokens, "graph_us": None,
                "baseline_eager_us": 300.0 * tokens, "baseline_graph_us": None} for op in common.OPS}
    return {"preset": preset, "fp8": fp8, "ep": ep, "tokens_per_rank": tokens, "status": "ok", "ops": ops}


@pytest.mark.skipif(not plot.available(), reason="matplotlib is not installed (the [plot] extra)")
def test_plot_colours_models_styles_eps_and_explains_both_in_one_legend(tmp_path):
    """Five models x three eps (more series than the ten-colour cycle): one
    colour per model, one line style per ep, the baseline marked apart from
    ours, and one legend for the figure that names every model, ep and both
    libraries."""
    models = [("deepseek-v3", False), ("deepseek-v3", True), ("qwen3-235b", False), ("gpt-oss-120b", False),
              ("mixtral", False)]
    eps = (1, 2, 4)
    data = {"device": "cpu x86_64 (2 threads)", "date": "2026-12-01T10:00:00+00:00", "torch": torch.__version__,
            "copy_bandwidth_GBps": 10.0,
            "points": [_plot_record(preset, fp8, ep, t, t / 16) for preset, fp8 in models for ep in eps
                       for t in (1, 16)]}
    title = plot.title(data)
    assert "cpu x86_64 (2 threads)" in title and "2026-12-01 10:00:00" in title
    fig = plot.figure(data)
    assert fig._suptitle.get_text() == title
    for ax in fig.axes:
        lines = ax.get_lines()
        assert len(lines) == 2 * len(models) * len(eps)  # ours and the baseline of every series
        ours = [ln for ln in lines if ln.get_marker() == plot.OURS["marker"]]
        baseline = [ln for ln in lines if ln.get_marker() == plot.BASELINE["marker"]]
        assert len(ours) == len(baseline) == len(models) * len(eps)
        assert all(ln.get_alpha() < 1 for ln in baseline) and all(ln.get_alpha() == 1 for ln in ours)
        # In plot order (sorted models, then eps): a colour per model, a style per ep.
        colours = [ln.get_color() for ln in ours]
        styles = [ln.get_linestyle() for ln in ours]
        per_model = [set(colours[i:i + len(eps)]) for i in range(0, len(colours), len(eps))]
        assert all(len(c) == 1 for c in per_model) and len(set.union(*per_model)) == len(models)
        assert len(set(styles[:len(eps)])) == len(eps) and styles == styles[:len(eps)] * len(models)
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == (sorted(f"{p}{' fp8' if fp8 else ''}" for p, fp8 in models) + [f"ep {ep}" for ep in eps]
                      + ["torch-moe-a2a", "plain PyTorch baseline"])
    path = tmp_path / "bench.png"
    plot.plot(data, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not plot.available(), reason="matplotlib is not installed (the [plot] extra)")
def test_bench_plot_says_where_it_wrote(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative path, printed absolute
    rc = single.main(["--device", "cpu", "--preset", "mixtral", "--ep", "1", "--tokens", "1", "--iters", "1",
                      "--warmup", "0", "--plot", "bench.png"])
    assert rc == 0
    assert f"plot: {tmp_path / 'bench.png'}" in capsys.readouterr().out.splitlines()
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name, ep", [("mixtral", 2), ("deepseek-v3", 8), ("gpt-oss-120b", 3)])
def test_expected_sends_match_the_routing(name, ep):
    """The estimate's expected (token, destination) pairs against a count over
    the benchmark's own seeded routing."""
    point = common.Point(common.PRESETS[name], ep, 2048, False)
    p, gen = point.preset, torch.Generator().manual_seed(common.SEED)
    owner = common.expert_owner(p.num_experts, ep)
    counted = sum(int(common.distinct_destinations(random_routing(point.tokens, p.top_k, p.num_experts, gen),
                                                   owner).sum()) for _ in range(ep))
    assert common.expected_sends(point) == pytest.approx(counted, rel=0.03)


def test_combine_variants_report_every_variant(device, tmp_path, capsys):
    """--combine-variants: a row per variant with its time, bytes and ratio to copy; the records in --json."""
    path = tmp_path / "variants.json"
    rc = single.main(["--device", device, "--combine-variants", "--ep", "2", "--tokens", "3", "--iters", "1",
                      "--warmup", "0", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    from torch_moe_a2a.bench import low_precision
    for name in low_precision.VARIANTS:
        assert f" {name} " in out
    import json
    records = json.loads(path.read_text())["records"]
    assert [r["variant"] for r in records] == list(low_precision.VARIANTS)
    assert all(r["us"] > 0 and r["bytes"] > 0 and r["check"] == "ok" for r in records), records
    bf16, e4m3 = records[0], records[1]
    assert e4m3["bytes"] < bf16["bytes"]  # half the pulled bytes


def test_combine_variants_check_their_outputs(monkeypatch, capsys):
    """A variant whose output is wrong is reported FAIL and fails the run."""
    from torch_moe_a2a.bench import low_precision

    reference_quantize = low_precision.reference.reference_quantize

    def off_by_one(x, fmt, *args):
        data, scales = reference_quantize(x, fmt, *args)
        return data, scales + 1  # what a kernel with a wrong scale would write

    monkeypatch.setattr(low_precision.reference, "reference_quantize", off_by_one)
    rc = single.main(["--device", "cpu", "--combine-variants", "mxfp4", "--ep", "1", "--tokens", "2",
                      "--iters", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL: rank 0 differs from the reference quantizer" in out, out


def test_combine_variants_skip_points_over_max_gib(tmp_path, capsys):
    """--max-gib: a point needing more is skipped with the sweep's reason, the others run."""
    path = tmp_path / "variants.json"
    rc = single.main(["--device", "cpu", "--combine-variants", "bf16", "--ep", "1", "--tokens", "1", "128",
                      "--max-gib", "0.005", "--iters", "1", "--warmup", "0", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert re.search(r"^ 1\s+128\s+-\s.*skipped: needs ~\d+\.\d GiB > --max-gib 0\.005$", out, re.M), out
    records = json.loads(path.read_text())["records"]
    assert [(r["tokens"], r["variant"], r["check"]) for r in records] == [(1, "bf16", "ok")]


def test_combine_variants_print_rows_as_measured(monkeypatch):
    """The table's header first, then each point's rows before the next point
    runs; the legend after the last row."""
    from torch_moe_a2a.bench import low_precision

    lines: list[str] = []
    printed_before: list[list[str]] = []  # what was printed when each point started
    run_point = low_precision._run_point

    def spy(*args):
        printed_before.append(list(lines))
        return run_point(*args)

    monkeypatch.setattr(low_precision, "_run_point", spy)
    records, facts = low_precision.run_variants(torch.device("cpu"), [1], [1, 2], 1, 0, ["bf16"], emit=lines.append)
    assert facts["copy_bandwidth_GBps"] > 0 and facts["iters"] == 1 and facts["warmup"] == 0
    assert [r["tokens"] for r in records] == [1, 2]

    def rows(printed, tokens):
        return [line for line in printed if re.match(rf"^ 1\s+{tokens}\s+bf16\s", line)]

    assert printed_before[0][-2].startswith("ep  tokens  variant") and not rows(printed_before[0], 1)
    assert len(rows(printed_before[1], 1)) == 1 and not rows(printed_before[1], 2)
    legend = next(i for i, line in enumerate(lines) if line.startswith("vs bf16: "))
    assert lines.index(rows(lines, 2)[0]) < legend, lines


def test_combine_variants_interrupted_keep_the_points_measured(monkeypatch, tmp_path, capsys):
    """Ctrl-C during the second point: the first point's rows and records
    stand, a line says the run stopped, and the exit code is SIGINT's (128 + 2)."""
    from torch_moe_a2a.bench import low_precision

    run_point = low_precision._run_point
    calls = []

    def interrupted_second(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return run_point(*args)

    monkeypatch.setattr(low_precision, "_run_point", interrupted_second)
    path = tmp_path / "variants.json"
    rc = single.main(["--device", "cpu", "--combine-variants", "bf16", "e4m3", "--ep", "1", "--tokens", "1", "2", "3",
                      "--iters", "1", "--warmup", "0", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 128 + signal.SIGINT, out
    assert len(calls) == 2
    assert re.search(r"^ 1\s+1\s+bf16\s.*ok$", out, re.M) and re.search(r"^ 1\s+1\s+e4m3\s.*ok$", out, re.M), out
    assert not re.search(r"^ 1\s+[23]\s", out, re.M), out
    assert out.index("vs bf16: ") < out.index("stopped by SIGINT: 2 points not run"), out
    data = json.loads(path.read_text())
    assert data["interrupted"] is True
    assert [(r["tokens"], r["variant"]) for r in data["records"]] == [(1, "bf16"), (1, "e4m3")]


@pytest.mark.parametrize("mode", ["--training", "--expert-major"])
def test_modes_interrupted_keep_the_points_measured(mode, monkeypatch, tmp_path, capsys):
    """Ctrl-C during the second point of --training or --expert-major: the
    first point's row and record stand, a line says the run stopped, --json
    has the run's copy bandwidth, and the exit code is SIGINT's (128 + 2)."""
    from torch_moe_a2a.bench import expert_major, training

    module = training if mode == "--training" else expert_major
    run_point = module.run_point
    calls = []

    def interrupted_second(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return run_point(*args, **kwargs)

    monkeypatch.setattr(module, "run_point", interrupted_second)
    path = tmp_path / "mode.json"
    rc = single.main([mode, "--device", "cpu", "--preset", "mixtral", "--ep", "1", "--tokens", "1", "2", "3",
                      "--iters", "1", "--warmup", "0", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 128 + signal.SIGINT, out
    assert len(calls) == 2
    assert re.search(r"^ *1\s+1\s+ok\s", out, re.M) and not re.search(r"^ *1\s+[23]\s", out, re.M), out
    assert "stopped by SIGINT: 2 points not run" in out, out
    data = json.loads(path.read_text())
    assert data["interrupted"] is True and data["stopped_by"] == "SIGINT"
    assert data["copy_bandwidth_GBps"] > 0 and data["iters"] == 1 and data["warmup"] == 0 and data["preset"] == "mixtral"
    assert [(r["ep"], r["tokens"], r["status"]) for r in data["records"]] == [(1, 1, "ok")]


def test_combine_variants_targets():
    """The speed targets: each e4m3 transport's speedup over bf16 at its bound,
    the fused outputs' time against bf16's and their gain over the unfused
    variant, each ok or MISS; only at ep 8 and only for CUDA records (with a floor)."""
    from torch_moe_a2a.bench import low_precision

    def rec(ep, tokens, variant, us, floor=5.0):
        return dict(ep=ep, tokens=tokens, variant=variant, us=us, floor_us=floor)

    records = [rec(8, 4096, "bf16", 2000.0), rec(8, 4096, "e4m3", 1500.0), rec(8, 4096, "e4m3-block-scaled", 1700.0),
               rec(8, 4096, "mxfp8", 2080.0), rec(8, 4096, "mxfp8-unfused", 2600.0),
               rec(8, 128, "bf16", 80.0), rec(8, 128, "e4m3", 90.0),
               rec(4, 4096, "bf16", 900.0), rec(4, 4096, "e4m3", 2000.0),
               rec(8, 16, "bf16", 30.0, None), rec(8, 16, "e4m3", 60.0, None)]
    lines = low_precision.target_lines(records)
    assert lines == [
        "target e4m3 >= 1x bf16 at 128 tokens: 0.89x MISS",
        "target e4m3 >= 1.3x bf16 at 4096 tokens: 1.33x ok",
        "target e4m3-block-scaled >= 1.2x bf16 at 4096 tokens: 1.18x MISS",
        "target mxfp8 <= 1.05x the bf16 combine's time at 4096 tokens: 1.04x ok",
        "target mxfp8 >= 1.3x faster than mxfp8-unfused at 4096 tokens: 1.25x MISS",
    ], lines


@pytest.mark.parametrize("variant,expected", [
    # staged rows read, written and pulled (2 bytes each); the own rows read once by the pull
    ("bf16", lambda rows, own, tokens, h: (rows - own) * h * 6 + own * h * 2 + tokens * h * 2),
    # e4m3 staging reads 2 bytes and writes 1, the pull reads 1; the own rows as bf16
    ("e4m3", lambda rows, own, tokens, h: (rows - own) * h * 4 + own * h * 2 + tokens * h * 2),
    # block-scaled rows all staged, with a scale byte per 128 elements
    ("e4m3-block-scaled", lambda rows, own, tokens, h: rows * h * 2 + 2 * rows * (h + h // 128) + tokens * h * 2),
    # a fused MXFP8 output: a byte an element and one scale per 32
    ("mxfp8", lambda rows, own, tokens, h: (rows - own) * h * 6 + own * h * 2 + tokens * (h + h // 32)),
])
@pytest.mark.parametrize("rows,own", [(40, 40), (40, 5), (40, 0)])
def test_combine_variants_byte_model(variant, expected, rows, own):
    """The ratio-to-copy column's bytes: staged rows read, written and pulled,
    the own rows (but block-scaled ones) pulled from the payload, the output."""
    from torch_moe_a2a.bench import low_precision
    tokens, hidden = 3, 256  # tokens of each of ep = 2 ranks
    moved = low_precision._moved_bytes(variant, rows, own, tokens, hidden, 2)
    assert moved == expected(rows, own, 2 * tokens, hidden)


@pytest.mark.slow
def test_low_precision_error_table(capsys):
    assert single.main(["--low-precision-error"]) == 0
    out = capsys.readouterr().out
    assert "outliers" in out and "power-of-two scale per 128" in out


def test_expert_major_bench_cpu(capsys):
    """bench --expert-major on the CPU: the three round trips checked and timed at every point."""
    from torch_moe_a2a.bench.single import main

    rc = main(["--expert-major", "--device", "cpu", "--preset", "mixtral", "--ep", "1", "3", "--tokens", "4",
               "--iters", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:3].strip().isdigit()]
    assert rc == 0 and len(rows) == 2 and all(r[2] == "ok" for r in rows), out
    assert all(float(r[i]) > 0 for r in rows for i in (4, 5, 6)), out  # ours, rank-major, baseline
    assert all(r[7].endswith("x") and r[8].endswith("x") for r in rows), out  # the two ratios
    assert "target ours / rank-major <= 1.25x" in out and "target baseline / ours > 1x" in out and "held at" in out, out


def test_expert_major_bench_reports_a_wrong_baseline(monkeypatch, capsys):
    from torch_moe_a2a.bench import expert_major
    from torch_moe_a2a.bench.single import main

    permute = expert_major.ExpertMajorPoint.permute

    def wrong(self, r):
        permute(self, r)
        self.payloads[r].mul_(2)

    monkeypatch.setattr(expert_major.ExpertMajorPoint, "permute", wrong)
    rc = main(["--expert-major", "--device", "cpu", "--preset", "mixtral", "--ep", "2", "--tokens", "3",
               "--iters", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL" in out and "baseline, rank 0: differs from ours" in out, out


def test_training_bench_cpu(capsys):
    """bench --training on the CPU: both paths' outputs and gradients checked and timed at every point."""
    from torch_moe_a2a.bench.single import main

    rc = main(["--training", "--device", "cpu", "--preset", "mixtral", "--ep", "1", "3", "--tokens", "5",
               "--iters", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:3].strip().isdigit()]
    assert rc == 0 and len(rows) == 2 and all(r[2] == "ok" for r in rows), out
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows), out  # ours, baseline
    # Ours against the copy ceiling of the same run (DESIGN.md section 8).
    assert "copy ceiling:" in out and "ours x copy" in out, out
    assert all(float(r[6]) > 0 for r in rows), out


def test_training_bench_router_grad_cpu(capsys):
    """bench --training --router-grad: the router weights require grad on
    both paths, their gradients checked against sum(grad_out * x)."""
    from torch_moe_a2a.bench.single import main

    rc = main(["--training", "--router-grad", "--device", "cpu", "--preset", "mixtral", "--ep", "2", "--tokens", "5",
               "--iters", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:3].strip().isdigit()]
    assert rc == 0 and "router weights requiring grad" in out and len(rows) == 1 and rows[0][2] == "ok", out


def test_training_bench_reports_a_wrong_router_gradient(monkeypatch, capsys):
    from torch_moe_a2a.bench import training
    from torch_moe_a2a.bench.single import main

    step = training.TrainingPoint.ours_step

    def wrong(self):
        step(self)
        if self.router_grad:  # (the one-rank warm-up's weights need none)
            self.w[-1].grad.mul_(2)

    monkeypatch.setattr(training.TrainingPoint, "ours_step", wrong)
    rc = main(["--training", "--router-grad", "--device", "cpu", "--preset", "mixtral", "--ep", "2", "--tokens", "3",
               "--iters", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    assert rc == 1 and "ours, rank 1: router weights' gradient differs" in out, out


def test_router_grad_is_an_option_of_training(capsys):
    from torch_moe_a2a.bench.single import main

    with pytest.raises(SystemExit) as info:
        main(["--router-grad", "--device", "cpu"])
    assert info.value.code == 2 and "--router-grad is an option of --training" in capsys.readouterr().err


def test_training_byte_model():
    """The training step's bytes, term by term (docs/DESIGN.md section 8)."""
    from torch_moe_a2a.bench import training
    from torch_moe_a2a.bench.common import PRESETS, Point

    point = Point(PRESETS["mixtral"], 2, 5, fp8=False)
    drow = 4096 * 2 + 2 * 4 + 2 * 4  # hidden bf16, int32 ids, fp32 weights
    row = 4096 * 2  # the expert outputs' rows, and the gradients' both ways
    tokens, sends = 2 * 5, 13
    expected = (drow * (tokens + sends)  # forward dispatch: every row read once, written once per destination
                + row * (sends + tokens) + 2 * row * sends  # forward combine, staged
                + row * (tokens + sends)  # the output gradient dispatched
                + row * (sends + tokens) + 2 * row * sends)  # the received rows' gradients combined, staged
    assert training.step_bytes(point, sends) == expected
    weights = 2 * 4  # top-2 fp32 router weights: their gradients combined (staged) in a combine of their own
    assert training.step_bytes(point, sends, router_grad=True) == expected + weights * (sends + tokens) + 2 * weights * sends


def test_training_bench_reports_a_wrong_gradient(monkeypatch, capsys):
    from torch_moe_a2a.bench import training
    from torch_moe_a2a.bench.single import main

    step = training.TrainingPoint.ours_step

    def wrong(self):
        step(self)
        self.x[0].grad.mul_(2)

    monkeypatch.setattr(training.TrainingPoint, "ours_step", wrong)
    rc = main(["--training", "--device", "cpu", "--preset", "mixtral", "--ep", "2", "--tokens", "3",
               "--iters", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL" in out and "ours, rank 0: gradient differs" in out, out


def test_expert_major_bench_reports_its_rate_against_the_copy_ceiling(tmp_path, capsys):
    """bench --expert-major measures the copy ceiling in the same run and gives
    every point's rate as a ratio to it (DESIGN.md section 8)."""
    from torch_moe_a2a.bench.single import main

    path = tmp_path / "expert_major.json"
    rc = main(["--expert-major", "--device", "cpu", "--preset", "mixtral", "--ep", "1", "2", "--tokens", "3",
               "--iters", "1", "--warmup", "0", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0 and "copy ceiling:" in out and "ours x copy" in out, out
    rows = [line.split() for line in out.splitlines() if line[:3].strip().isdigit()]
    assert len(rows) == 2 and all(float(r[9]) > 0 for r in rows), out  # the ratio beside the two others
    import json

    records = json.loads(path.read_text())["records"]
    assert all(r["ours_bytes"] > 0 and r["ours_copy_ratio"] > 0 for r in records), records


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_major_byte_model(ep):
    """The expert-major round trip's bytes, term by term (docs/DESIGN.md section 8)."""
    from torch_moe_a2a.bench import expert_major
    from torch_moe_a2a.bench.common import PRESETS, Point

    point = Point(PRESETS["mixtral"], ep, 5, fp8=False)
    drow = 4096 * 2 + 2 * 4 + 2 * 4  # hidden bf16, int32 ids, fp32 weights
    crow = 4096 * 2
    tokens, sends, pairs = ep * 5, 7 * ep, 10 * ep
    expected = (drow * (tokens + sends)  # dispatch: every row read once, written once per destination
                + drow * sends + crow * pairs  # build: each received row read, each pair's row written
                + (crow + 4) * pairs + crow * tokens  # combine: a row and a weight per pair read, a row per token written
                + 2 * crow * pairs)  # staging: each pair's row read and written
    assert expert_major.round_trip_bytes(point, sends, pairs) == expected
