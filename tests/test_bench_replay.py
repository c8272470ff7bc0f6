"""``bench --graph all-ranks``: the worker protocol and its watchdog (CPU), and
on CUDA a short run of ours against the reference."""

import os
import sys
import time

import pytest

from torch_moe_a2a.bench import replay

FAKE_NOTE = "fake library: no kernels here"


class HangsAtTwoTokens:
    """A library whose point with 2 tokens never returns (as a deadlocked kernel) and whose other points fail."""

    name = "fake"

    def __init__(self, point, device):
        if point.tokens == 2:
            time.sleep(3600)
        raise RuntimeError(FAKE_NOTE)


@pytest.fixture
def importable_tests(monkeypatch):
    """The workers import this module by name."""
    tests_dir = str(__import__("pathlib").Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir + ":" + ":".join(p for p in sys.path if p))


@pytest.mark.slow
def test_a_hung_point_is_reported_and_the_next_point_still_runs(importable_tests):
    logged = []
    started = time.monotonic()
    run = replay.run_library(f"{__name__}:HangsAtTwoTokens", "deepseek-v3", [(1, 1), (1, 2), (2, 3)], 0, 1,
                             point_timeout_s=5, log=logged.append, retries=1)
    assert time.monotonic() - started < 120
    assert run.available and run.name == "fake"
    hung = run.results[(1, 2)]
    assert hung["status"] == "hung" and len(hung["earlier"]) == 1 and hung["earlier"][0].startswith("hung"), hung
    for key in ((1, 1), (2, 3)):  # before the hang, and in the fresh worker after it; errors are not retried
        result = run.results[key]
        assert result["status"] == "error" and FAKE_NOTE in result["notes"][0] and "earlier" not in result, result
    assert logged == ["  fake ep 1 T 2: hung, worker killed", "  fake: measuring again (1 of 1): ep 1 T 2",
                      "  fake ep 1 T 2: hung, worker killed"]


def test_a_missing_library_is_reported_not_raised():
    run = replay.run_library("no_such_module_anywhere:Factory", "deepseek-v3", [(1, 1)], 0, 1)
    assert not run.available and "ModuleNotFoundError" in run.reason and run.results == {}


def test_the_peer_table_shows_ratios():
    ours = replay.LibraryRun("torch-moe-a2a", results={(2, 4): {
        "status": "ok", "ops": {op: 10.0 for op in replay.REPLAY_OPS}, "floor": {op: 6.0 for op in replay.REPLAY_OPS}}})
    peer = replay.LibraryRun("flashinfer", results={(2, 4): {
        "status": "ok", "ops": {op: 15.0 for op in replay.REPLAY_OPS}, "floor": {op: 7.0 for op in replay.REPLAY_OPS}}})
    table = replay._table(ours, peer, [(2, 4)])
    assert "1.50x" in table and "4.0" in table and "8.0" in table and "2.00x" in table, table
    summary = replay._summary(ours, peer, [(2, 4)], copy_gbps=4000.0)
    assert ("dispatch   decode grid: geomean 1.50x, min 1.50x over 1 points; above the floor: geomean 2.00x, "
            "min 2.00x") in summary, summary
    assert "dispatch >= 1x flashinfer at every point: min 2.00x (ep 2 T 4) ok" in summary, summary
    assert "round-trip geomean >= 1.3x flashinfer: 2.00x over 1 points ok" in summary, summary


def test_the_decode_targets_name_the_worst_point():
    """Above the floor, ours 4 us everywhere; the peer 5 us, and 3 us at ep 8 T 16:
    every ratio but one is 1.25x, so both decode targets miss, and the worst
    point is named."""
    points = [(1, 1), (8, 16)]

    def run(name, above_us):
        return replay.LibraryRun(name, results={key: {
            "status": "ok", "ops": {op: 6.0 + above_us[key] for op in replay.REPLAY_OPS},
            "floor": {op: 6.0 for op in replay.REPLAY_OPS}} for key in points})

    ours = run("torch-moe-a2a", {(1, 1): 4.0, (8, 16): 4.0})
    peer = run("flashinfer", {(1, 1): 5.0, (8, 16): 3.0})
    summary = replay._summary(ours, peer, points, copy_gbps=4000.0)
    assert "combine >= 1x flashinfer at every point: min 0.75x (ep 8 T 16) MISS" in summary, summary
    assert "round-trip geomean >= 1.3x flashinfer: 0.97x over 2 points MISS" in summary, summary
    assert "combine-ws >= 1x" not in summary, summary  # not a target op


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA graphs need a GPU")
def test_all_ranks_replays_of_ours_cuda():
    run = replay.run_library("ours", "deepseek-v3", [(1, 4), (2, 16)], 2, 5)
    for key, result in run.results.items():
        assert result["status"] == "ok", (key, result)
        for op in replay.REPLAY_OPS:
            assert result["ops"][op] > 0 and result["floor"][op] > 0


@pytest.mark.slow
def test_ab_table_sets_variants_side_by_side(tmp_path):
    """benchmarks/ab_table.py (`./dev gpu ab`): every variant's time above the
    floor per point and op, the peer's where a run timed it, each variant's
    geometric mean against variant 0, and a failed point fails the table."""
    import json
    import pathlib
    import subprocess

    def result(above_us, status="ok"):
        return {"status": status, "ops": {op: 5.0 + above_us for op in replay.REPLAY_OPS},
                "floor": {op: 5.0 for op in replay.REPLAY_OPS}}

    runs = [({"ep1_T1": result(4.0), "ep8_T16": result(8.0)}, None, "MOE_A2A_AB_TREE=/tmp/old"),
            ({"ep1_T1": result(2.0), "ep8_T16": result(4.0)}, {"ep1_T1": result(3.0)}, "X=1")]
    for i, (ours, peer, variant) in enumerate(runs):
        data = {"ours": ours, "peer": None if peer is None else {"available": True, "results": peer}}
        (tmp_path / f"ab-{i}.json").write_text(json.dumps(data))
        (tmp_path / f"ab-{i}.variant").write_text(variant)
    root = pathlib.Path(__file__).parents[1]
    script = root / "benchmarks" / "ab_table.py"
    # A script's own folder heads its sys.path: the package comes from the
    # tree under test, installed or built in place.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "v0: MOE_A2A_AB_TREE=/tmp/old" in out.stdout and "v1: X=1" in out.stdout, out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:2] == ["ep1_T1", "dispatch"]]
    assert rows == [["ep1_T1", "dispatch", "4.00", "2.00", "3.00"]], out.stdout
    assert "v1 against v0, geomean of above-floor ratios: dispatch 2.000x" in out.stdout, out.stdout
    runs[1][0]["ep8_T16"] = result(4.0, status="FAIL")
    (tmp_path / "ab-1.json").write_text(json.dumps({"ours": runs[1][0], "peer": None}))
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env)
    assert out.returncode == 1 and "FAILED: X=1 at ep8_T16" in out.stdout, out.stdout
