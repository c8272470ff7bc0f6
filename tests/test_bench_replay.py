"""``bench --graph all-ranks``: the worker protocol and its watchdog (CPU), and
on CUDA a short run of ours against the reference."""

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
    assert "1.50x" in table and "4.0" in table and "8.0" in table, table
    summary = replay._summary(ours, peer, [(2, 4)], copy_gbps=4000.0)
    assert "dispatch   decode grid: geomean 1.50x, min 1.50x over 1 points" in summary, summary


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA graphs need a GPU")
def test_all_ranks_replays_of_ours_cuda():
    run = replay.run_library("ours", "deepseek-v3", [(1, 4), (2, 16)], 2, 5)
    for key, result in run.results.items():
        assert result["status"] == "ok", (key, result)
        for op in replay.REPLAY_OPS:
            assert result["ops"][op] > 0 and result["floor"][op] > 0
