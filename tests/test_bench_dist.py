"""`torchrun -m torch_moe_a2a bench-dist` end to end with two CPU processes
(gloo, the shared-memory workspace): every op timed, the correctness checks
passed, and the per-GPU send bytes equal a count made here from the same
seeded routing through the reference's routes."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from conftest import run_ranks

from torch_moe_a2a.bench import common, distributed
from torch_moe_a2a.reference import random_routing, reference_dispatch

WORLD = 2
PRESET = "mixtral"
TOKENS = (1, 3)
STOP_TOKENS = (1, 2, 3, 4, 5, 6)  # a sweep that a signal after its first point leaves unfinished
RANK_TIMEOUT_S = 120.0
SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "multi_gpu.sh")


def _bench_rank(rank, world, init_file, out_dir, tokens=TOKENS):
    """What torchrun would start: bench-dist with RANK/WORLD_SIZE/LOCAL_RANK set."""
    import contextlib
    import io
    import pathlib

    from torch_moe_a2a.__main__ import main

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["bench-dist", "--device", "cpu", "--init-method", f"file://{init_file}", "--preset", PRESET,
                   "--tokens", *map(str, tokens), "--iters", "2", "--warmup", "1",
                   "--json", str(pathlib.Path(out_dir, "bench.json"))])
    pathlib.Path(out_dir, f"rank{rank}.out").write_text(f"{rc}\n{printed.getvalue()}")


def _expected_send_bytes(preset: common.Preset, world: int, tokens: int, n_sets: int) -> dict[str, list[float]]:
    """Per op, each rank's bytes to other ranks, mean over the input sets, from
    the reference's routes of the benchmark's routing (its seeded CPU
    generator draws every rank's routing, set after set)."""
    gen = torch.Generator().manual_seed(common.SEED)
    dispatch_row = preset.hidden * preset.dtype.itemsize + 2 * 4 * preset.top_k  # hidden, int32 ids, fp32 weights
    combine_row = preset.hidden * preset.dtype.itemsize
    sent = [0] * world  # dispatch rows to other ranks, by source
    returned = [0] * world  # combine rows back to other ranks, by destination
    for _ in range(n_sets):
        ids = [random_routing(tokens, preset.top_k, preset.num_experts, gen) for _ in range(world)]
        ref = reference_dispatch(ids, [[i] for i in ids], ep_size=world, num_experts=preset.num_experts,
                                 runtime_max_tokens_per_rank=tokens)
        for src, routes in enumerate(ref.routes):
            for token_routes in routes:
                for dest, _slot in token_routes:
                    if dest != src:
                        sent[src] += 1
                        returned[dest] += 1
    dispatch = [dispatch_row * n / n_sets for n in sent]
    combine = [combine_row * n / n_sets for n in returned]
    both = [d + c for d, c in zip(dispatch, combine)]
    return {"dispatch": dispatch, "combine": combine, "combine-ws": combine, "round-trip": both,
            "round-trip-ws": both}


@pytest.mark.slow
def test_bench_dist_two_cpu_processes(tmp_path):
    run_ranks(_bench_rank, WORLD, (str(tmp_path / "init"), str(tmp_path)), report_dir=tmp_path,
              timeout_s=RANK_TIMEOUT_S, env={"MOE_A2A_TIMEOUT_S": "20"})
    outputs = [(tmp_path / f"rank{r}.out").read_text().split("\n", 1) for r in range(WORLD)]
    assert [int(rc) for rc, _ in outputs] == [0] * WORLD, outputs
    table = outputs[0][1]
    assert outputs[1][1] == "", "only rank 0 prints"
    assert f"{WORLD} processes (one rank each)" in table and "backend gloo" in table, table

    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["world"] == WORLD and data["device_type"] == "cpu" and data["NCCL_NVLS_ENABLE"] == "0"
    assert data["all_to_all_single_unavailable"] is None  # gloo has it: baseline and ceiling run
    points = data["points"]
    assert [(p["ep"], p["tokens_per_rank"]) for p in points] == [(WORLD, t) for t in TOKENS]
    preset = common.PRESETS[PRESET]
    for p in points:
        assert p["status"] == "ok" and p["notes"] == [], p  # ours matched the reference bitwise
        assert p["baseline_ok"] is True  # so did the all_to_all_single baseline
        assert set(p["ops"]) == set(common.OPS)
        expected = _expected_send_bytes(preset, WORLD, p["tokens_per_rank"], p["input_sets"])
        for op, m in p["ops"].items():
            assert m["send_bytes_by_rank"] == pytest.approx(expected[op]), op
            assert m["send_bytes"] == pytest.approx(sum(expected[op]) / WORLD), op
            assert len(m["eager_us_by_rank"]) == WORLD and min(m["eager_us_by_rank"]) > 0, op
            assert m["eager_us"] == max(m["eager_us_by_rank"]), op
            assert m["graph_us"] is None, op  # CUDA only
            assert m["baseline_eager_us"] > 0 and m["ceiling_us"] > 0, op
            assert m["GBps_per_gpu"] == pytest.approx(m["send_bytes"] / (m["eager_us"] * 1e-6) / 1e9), op
            # The ceiling moved at least as many bytes per rank as we did (chunks rounded up).
            assert m["send_bytes"] <= m["ceiling_bytes_per_gpu"] < m["send_bytes"] + 16 * WORLD, op
            assert m["speedup_eager"] == pytest.approx(m["baseline_eager_us"] / m["eager_us"]), op
    for op in common.OPS:
        assert re.search(rf"^{PRESET}\s+{WORLD}\s+{TOKENS[-1]}\s+{op}\s+\d", table, re.M), table

    summary = subprocess.run([sys.executable, "-m", "torch_moe_a2a", "bench-dist", "--summary",
                              str(tmp_path / "bench.json")], capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    assert re.search(rf"^{PRESET}\s+{WORLD}\s+{TOKENS[0]}\s+dispatch\s", summary.stdout, re.M), summary.stdout


@pytest.mark.slow
def test_bench_dist_stopped_under_torchrun_keeps_the_points_done(tmp_path):
    """torchrun given SIGINT (Ctrl-C) after the first point passes it on to
    both workers: they end the sweep after the point in progress, and rank 0
    prints the table and the line that says what stopped it and writes --json
    with the points done."""
    js = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           "-m", "torch_moe_a2a", "bench-dist", "--device", "cpu", "--preset", PRESET,
           "--tokens", *map(str, STOP_TOKENS), "--iters", "2", "--warmup", "1", "--json", str(js)]
    with open(tmp_path / "out.txt", "w") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "MOE_A2A_TIMEOUT_S": "20"})
        try:
            progress = []
            for line in proc.stderr:  # rank 0's progress: one line per finished point
                progress.append(line)
                if " done " in line:
                    proc.send_signal(signal.SIGINT)
                    break
            proc.stderr.read()
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert progress and progress[-1].startswith(f"[1/{len(STOP_TOKENS)}] {PRESET} ep {WORLD} x 1 tok done"), progress
    _assert_stopped(js, (tmp_path / "out.txt").read_text(), signal.SIGINT)


def _assert_stopped(js, printed: str, signum: int) -> None:
    """--json and rank 0's output of a sweep that a signal ended after its first point or later."""
    data = json.loads(js.read_text())
    assert data["interrupted"] is True and data["stopped_by"] == signal.Signals(signum).name, data
    planned = len(STOP_TOKENS)
    assert data["points_planned"] == planned and 1 <= len(data["points"]) < planned, len(data["points"])
    assert all(p["status"] == "ok" for p in data["points"]), data["points"]
    not_run = planned - len(data["points"])
    assert f"stopped by {signal.Signals(signum).name}: {not_run} points not run" in printed, printed
    assert printed.index("round-trip-ws") < printed.index("stopped by "), printed


def _stopped_rank(rank, world, init_file, out_dir):
    """_bench_rank, where rank 1 alone gets SIGTERM as its first point ends."""
    from torch_moe_a2a.bench import distributed

    run_point = distributed._run_point

    def first_point_then_signal(point, ctx):
        record = run_point(point, ctx)
        if rank == 1 and point.tokens == STOP_TOKENS[0]:
            os.kill(os.getpid(), signal.SIGTERM)
        return record

    distributed._run_point = first_point_then_signal
    _bench_rank(rank, world, init_file, out_dir, tokens=STOP_TOKENS)


@pytest.mark.slow
def test_bench_dist_one_rank_stopped_stops_every_rank_at_the_same_point(tmp_path):
    """A signal that reaches one worker alone ends the sweep on every rank
    after the same point (no rank left waiting in the next point's exchange);
    bench-dist returns the signal's exit code (128 + its number) on every rank, and rank 0,
    which got no signal, reports the points done and what stopped them."""
    run_ranks(_stopped_rank, WORLD, (str(tmp_path / "init"), str(tmp_path)), report_dir=tmp_path,
              timeout_s=RANK_TIMEOUT_S, env={"MOE_A2A_TIMEOUT_S": "20"})
    outputs = [(tmp_path / f"rank{r}.out").read_text().split("\n", 1) for r in range(WORLD)]
    assert [int(rc) for rc, _ in outputs] == [128 + signal.SIGTERM] * WORLD, outputs
    _assert_stopped(tmp_path / "bench.json", outputs[0][1], signal.SIGTERM)
    assert len(json.loads((tmp_path / "bench.json").read_text())["points"]) == 1


def test_bench_dist_outside_torchrun_says_how_to_launch(monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.main(["--device", "cpu"]) == 2
    assert "torchrun --nproc-per-node N -m torch_moe_a2a bench-dist" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.main(["--device", "cpu"]) == 2
    assert "WORLD_SIZE is 1" in capsys.readouterr().err


def test_launcher_help_and_bad_arguments():
    help_ = subprocess.run(["bash", SCRIPT, "--help"], capture_output=True, text=True, timeout=30)
    assert help_.returncode == 0 and "--dry-run" in help_.stdout and "NCCL_NVLS_ENABLE=0" in help_.stdout, help_
    for bad in (["--no-such-option"], ["--ep"], ["--ep", "2 x"], ["--iters", "0"], ["--dry-run", "--cpu"]):
        proc = subprocess.run(["bash", SCRIPT, *bad], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and "usage:" in proc.stderr, (bad, proc.returncode, proc.stderr)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs the script asks for")
def test_launcher_counts_the_gpus_before_it_builds(tmp_path):
    # One process per GPU on a machine with fewer than two: told at once, nothing built.
    proc = subprocess.run(["bash", SCRIPT, "--python", sys.executable], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 1 and "GPU(s) visible; one process per GPU needs 2 or more" in proc.stderr, proc
    assert not (tmp_path / "build.txt").exists(), sorted(p.name for p in tmp_path.iterdir())


class _RecordingClock:
    """A stand-in for common.Clock that records what the timer asks of it."""

    def __init__(self):
        self.calls = []

    def head_start(self, seconds):
        self.calls.append(("head_start", seconds))

    def mark(self):
        self.calls.append(("mark",))
        return len(self.calls)

    def elapsed_us(self, marks):
        return [float(end - start) for start, end in marks]


def test_every_timed_iteration_starts_behind_a_head_start(tmp_path):
    """Eager calls and graph replays alike: each iteration queues the spin
    kernel before its start mark, so the host's work before the call (the
    alignment collective) is not inside the time (the distributed module's docstring)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        proc = distributed.Process(0, 1, torch.device("cpu"), 0, 1, "gloo")
        clock = _RecordingClock()
        timer = distributed.Timer(proc, clock, iters=3, warmup=2)
        timed = []
        median = timer.measure(2, lambda i: (timed.append(i), clock.calls.append(("timed", i))))
    finally:
        dist.destroy_process_group()
    iteration = [("head_start", distributed.HEAD_START_S), ("mark",), "timed", ("mark",)]
    assert len(clock.calls) == 5 * len(iteration)
    for it in range(5):
        calls = clock.calls[it * 4 : it * 4 + 4]
        assert [c if c[0] != "timed" else "timed" for c in calls] == iteration, f"iteration {it}: {calls}"
    assert timed == [0, 1, 0, 1, 0]
    assert median == 2.0  # start mark, timed call, end mark
