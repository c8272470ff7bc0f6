"""``python -m torch_moe_a2a bench --graph all-ranks``: the latency a decode step
pays per op, one op per CUDA-graph replay, next to its launch floor and,
with ``--peer flashinfer``, FlashInfer's ``moe_a2a_*`` timed the same way in
the same run (docs/performance.md, 'Per-replay latency').

The method, for every point (ep simulated ranks, T tokens per rank):

- the ranks share one plain zeroed ``[ep, size]`` workspace, one CUDA stream
  per rank; one CUDA graph holds every rank's call of one op, each rank's
  branch forked from the capturing stream and joined back into it, behind one
  root node (so the device releases the branches together);
- ops: ``dispatch``; ``combine`` (the expert outputs in a tensor of their own,
  staged into the workspace); ``combine-ws`` (already in the workspace);
  ``round-trip`` (each rank's dispatch then its staged combine in one graph);
- an op's replay is timed with CUDA events on the current stream, behind a
  spin kernel that keeps the device busy while the host queues the replays
  (device time, not host launch time); dispatch and combine alternate, so
  the partner op's graph is replayed untimed before or after it; the median
  of ``--iters`` replays after ``--warmup``;
- floor: the same graph shape with an empty kernel per rank (two for the
  round trip), measured in the same run; ``above`` = op - floor;
- inputs: seeded random routing and payloads of the preset (DeepSeek-V3:
  hidden 7168 bf16, int32 ids and fp32 weights [T, 8], 256 experts); every
  point is checked against the reference before and after its replays, and
  a point whose replays recorded a timed-out wait fails.

Each library runs in a worker process of its own (``python -m
torch_moe_a2a.bench.replay``), points in order, one JSON line per event. A
watchdog in the parent kills a worker whose point makes no progress for
``POINT_TIMEOUT_S`` (FlashInfer's kernels wait without a bound: its combine
deadlocks when its CTAs of all ranks cannot be resident at once), reports
the point as hung and starts a fresh worker at the next point.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from . import targets
from .common import (
    COPY_BYTES,
    PRESETS,
    SEED,
    Clock,
    Point,
    capture_graph,
    combine_mismatch,
    copy_bandwidth,
    device_name,
    expert_owner,
    first_line,
    fmt,
    format_table,
    geomean,
    make_set,
    op_bytes_for,
    preset_names,
    recv_mismatch,
    reference_payloads,
    write_json,
)

# The grid of the decode-latency targets (bench/targets.py) and two large points.
GRID_EP = (1, 2, 4, 8)
GRID_TOKENS = (1, 4, 16, 32, 64, 128)
LARGE_POINTS = ((1, 4096), (8, 4096))
REPLAY_OPS = ("dispatch", "combine", "combine-ws", "round-trip")
DEFAULT_REPLAYS = 30
DEFAULT_WARMUP_REPLAYS = 5
# A point that neither finishes nor reports within this many seconds is hung;
# a worker gets WORKER_START_S to import its library and say it is ready.
POINT_TIMEOUT_S = 30.0
WORKER_START_S = 300.0
# Our kernels' bounded waits in the workers: a rank whose peer's branch never
# runs gives up well before the watchdog would.
WORKER_WAIT_TIMEOUT_S = 5.0
# CUDA does not promise that the branches of one graph run concurrently
# (simulate.py's docstring): now and then a replay runs a rank's branch only
# after a peer's, which waits for it (ours: until WORKER_WAIT_TIMEOUT_S, then
# an error; FlashInfer's: hung). Such a point is measured again, this many
# times, in a fresh worker with fresh graphs; the result says how often.
POINT_RETRIES = 1
# The spin kernel in front of the timed replays lasts this many times the
# host's time to queue them (measured on the warmup replays), at least MIN_HEAD_START_S.
HEAD_START_MARGIN = 2.0
MIN_HEAD_START_S = 200e-6
MAX_HEAD_START_S = 0.5

# The worker's command line (not ``-m`` of this module: that would load it twice).
WORKER_ENTRY = "import sys; from torch_moe_a2a.bench.replay import worker_main; sys.exit(worker_main(sys.argv[1:]))"

LIBRARIES = ("ours", "flashinfer")
LIBRARY_FACTORIES = {
    "ours": "torch_moe_a2a.bench.replay:OursRanks",
    "flashinfer": "torch_moe_a2a.bench.peer_flashinfer:FlashInferRanks",
}


# ---------------------------------------------------------------------------
# the libraries: every rank's calls of one op, on the current stream
# ---------------------------------------------------------------------------


class A2ARanks:
    """Every simulated rank's calls of one library's FlashInfer-style functional
    API (``api``: a module with ``moe_a2a_get_workspace_size_per_rank``,
    ``moe_a2a_initialize``, ``moe_a2a_dispatch``, ``moe_a2a_combine`` and
    ``moe_a2a_wrap_payload_tensor_in_workspace``) at one point, through the
    same code for every library.

    The ranks share one plain zeroed ``[ep, size]`` workspace and have a CUDA
    stream each. ``dispatch(r)`` / ``combine(r, in_workspace)`` enqueue rank
    r's call on the current stream (the harness forks the rank streams);
    combines write into the preallocated ``outputs[r]``.
    """

    name = "?"

    def __init__(self, point: Point, device: torch.device, api: Any):
        self.point, self.api = point, api
        p, ep, T = point.preset, point.ep, point.tokens
        gen_cpu = torch.Generator().manual_seed(SEED)
        gen_dev = torch.Generator(device=device).manual_seed(SEED)
        self.set = make_set(point, device, gen_cpu, gen_dev, expert_owner(p.num_experts, ep))
        size = api.moe_a2a_get_workspace_size_per_rank(ep, T, point.dispatch_row_bytes, point.combine_row_bytes)
        self.workspace = torch.zeros((ep, size), dtype=torch.uint8, device=device)
        self.metainfo = [api.moe_a2a_initialize(self.workspace, r, ep, T) for r in range(ep)]
        self.streams = [torch.cuda.Stream(device) for _ in range(ep)] if device.type == "cuda" else []
        self.caches: list[dict] = [{} for _ in range(ep)]
        self.outputs = [torch.empty((T, p.hidden), dtype=p.dtype, device=device) for _ in range(ep)]
        self.received: list[Any] = [None] * ep  # each rank's receive views of its last dispatch
        self.offsets: list[Optional[int]] = [None] * ep  # combine_payload_offset, from the first dispatch
        self.ws_views: list[Any] = [None] * ep
        torch.cuda.synchronize(device)

    def dispatch(self, r: int) -> None:
        p, T, s = self.point.preset, self.point.tokens, self.set
        views, offset, _ = self.api.moe_a2a_dispatch(s.ids[r], s.payloads[r], self.workspace, self.metainfo[r], T, r,
                                                     self.point.ep, p.top_k, p.num_experts,
                                                     recv_view_cache=self.caches[r])
        self.received[r] = views
        if self.offsets[r] is None:
            self.offsets[r] = int(offset)
            nbytes = self.point.ep * T * self.point.combine_row_bytes
            self.ws_views[r] = self.api.moe_a2a_wrap_payload_tensor_in_workspace(
                self.workspace[r], [self.point.ep, T], self.offsets[r], self.offsets[r] + nbytes, p.dtype)

    def combine(self, r: int, in_workspace: bool, payload: Optional[torch.Tensor] = None) -> None:
        p, T = self.point.preset, self.point.tokens
        if payload is None:
            payload = self.ws_views[r] if in_workspace else self.set.expert_out[r]
        self.api.moe_a2a_combine(payload, T, self.workspace, self.metainfo[r], T, r, self.point.ep, p.top_k,
                                 self.offsets[r], payload_in_workspace=in_workspace, output=self.outputs[r])

    def run(self, fn: Callable[[int], None]) -> None:
        """Every rank's ``fn`` eagerly, each on its stream, forked from and joined into the current one."""
        current = torch.cuda.current_stream()
        for r, stream in enumerate(self.streams):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                fn(r)
        for stream in self.streams:
            current.wait_stream(stream)

    def check(self) -> Optional[str]:
        """Round trips whose experts return the received hidden rows, of both
        combine kinds: every output must be its token's hidden row times its
        number of distinct destination ranks (exact in fp32 whatever the slot
        order, which FlashInfer's atomics decide). An error or None."""
        point, s = self.point, self.set
        hidden = [s.payloads[r][0] for r in range(point.ep)]
        expected = [(hidden[r].float() * s.destinations[r].to(hidden[r].device).unsqueeze(-1)).to(point.preset.dtype)
                    for r in range(point.ep)]
        staged = [torch.empty_like(s.expert_out[r]) for r in range(point.ep)]
        for in_workspace in (False, True):
            self.run(self.dispatch)
            for r in range(point.ep):
                (self.ws_views[r] if in_workspace else staged[r]).copy_(self.received[r][0])
            self.run(lambda r: self.combine(r, in_workspace, None if in_workspace else staged[r]))
            error, _ = combine_mismatch([o.clone() for o in self.outputs], expected)
            if error is not None:
                return f"{'combine-ws' if in_workspace else 'combine'} of the received rows: {error}"
        return self.errors()

    def check_outputs(self) -> Optional[str]:
        """After the replays: the state they left still gives right round trips."""
        return self.check()

    def errors(self) -> Optional[str]:
        """A timed-out wait a rank recorded (where the library records one), or None."""
        return None

    def sends(self) -> int:
        """(token, distinct destination) pairs of the point's routing, all ranks."""
        return int(self.set.destinations.sum())

    @staticmethod
    def environment(ep: int, tokens: int) -> dict:
        """Environment variables a worker for this point needs (points that need
        the same share a worker)."""
        return {}


class OursRanks(A2ARanks):
    """torch-moe-a2a, checked also against the reference bitwise (its slot
    order is deterministic) and for recorded timeouts."""

    name = "torch-moe-a2a"

    def __init__(self, point: Point, device: torch.device):
        import torch_moe_a2a

        super().__init__(point, device, torch_moe_a2a)

    def check(self) -> Optional[str]:
        error = super().check()
        if error is not None:
            return error
        from ..api import moe_a2a_get_recv_counts
        from ..reference import reference_combine, reference_dispatch

        point, s = self.point, self.set
        ep, T = point.ep, point.tokens
        ref = reference_dispatch(s.ids, reference_payloads(s.payloads), ep_size=ep,
                                 num_experts=point.preset.num_experts, runtime_max_tokens_per_rank=T)
        self._expected = reference_combine(s.expert_out, ref, [T] * ep)
        names = [name for name, _, _ in point.payload_rows()]
        self.run(self.dispatch)
        for d in range(ep):
            counts = moe_a2a_get_recv_counts(self.workspace, self.metainfo[d], d).cpu()
            if not torch.equal(counts, ref.recv_counts[d].cpu()):
                return f"rank {d}: receive counts {counts.tolist()} differ from the reference"
            bad = recv_mismatch(self.received[d], ref.recv[d], counts, names)
            if bad is not None:
                return f"rank {d}: received {bad} differs from the reference"
        self.run(lambda r: self.combine(r, False))
        error, _ = combine_mismatch([o.clone() for o in self.outputs], self._expected)
        return None if error is None else f"combine: {error}"

    def check_outputs(self) -> Optional[str]:
        """The outputs the last replayed round trip left, against the reference, then check()."""
        error, _ = combine_mismatch([o.clone() for o in self.outputs], self._expected)
        return f"replayed round trip: {error}" if error is not None else self.check()

    def errors(self) -> Optional[str]:
        from ..errors import check_errors

        try:
            check_errors(self.workspace)
        except RuntimeError as e:
            return first_line(e)
        return None


# ---------------------------------------------------------------------------
# the harness (in the worker)
# ---------------------------------------------------------------------------


def _all_ranks_graph(lib: Any, per_rank: Callable[[int], None]) -> "torch.cuda.CUDAGraph":
    """One CUDA graph of every rank's ``per_rank(r)``: each on the rank's stream,
    forked from the capturing stream and joined back (``lib.run``), the
    branches behind one root (common.capture_graph)."""
    return capture_graph(lambda: lib.run(per_rank))[0]


def empty_kernel() -> None:
    torch.cuda._sleep(0)  # torch's spin kernel for 0 cycles: a launch and nothing else


def time_replays(clock: Clock, graph: Any, warmup: int, iters: int, before: Optional[Any] = None,
                  after: Optional[Any] = None, check: Optional[Callable[[], Optional[str]]] = None) -> float:
    """Median microseconds of one replay of ``graph``, replaying ``before``/``after``
    untimed around every one. ``check`` runs after the warmup (a rank that
    timed out there fails the point at once instead of after every replay)."""

    def one(marks: Optional[list]) -> None:
        if before is not None:
            before.replay()
        start = clock.mark() if marks is not None else None
        graph.replay()
        if marks is not None:
            marks.append((start, clock.mark()))
        if after is not None:
            after.replay()

    t0 = time.perf_counter()
    for _ in range(warmup):
        one(None)
    clock.sync()
    host_per_replay = (time.perf_counter() - t0) / max(warmup, 1)
    if check is not None:
        error = check()
        if error is not None:
            raise RuntimeError(error)
    clock.head_start(min(MAX_HEAD_START_S, max(MIN_HEAD_START_S, HEAD_START_MARGIN * iters * host_per_replay)))
    marks: list = []
    for _ in range(iters):
        one(marks)
    return statistics.median(clock.elapsed_us(marks))


def measure_point(lib: Any, clock: Clock, warmup: int, iters: int, floors: dict) -> dict:
    """Every op of REPLAY_OPS and its floor at one point (``floors``: per ep, filled on first use)."""
    point = lib.point
    result: dict[str, Any] = {"status": "ok", "notes": [], "ops": {}, "floor": {}}
    error = lib.check()
    if error is not None:
        return {**result, "status": "FAIL", "notes": [error]}
    g_dispatch = _all_ranks_graph(lib, lib.dispatch)
    g_combine = _all_ranks_graph(lib, lambda r: lib.combine(r, False))
    g_combine_ws = _all_ranks_graph(lib, lambda r: lib.combine(r, True))

    def round_trip(r: int) -> None:
        lib.dispatch(r)
        lib.combine(r, False)

    g_round_trip = _all_ranks_graph(lib, round_trip)
    if point.ep not in floors:
        g_one = _all_ranks_graph(lib, lambda r: empty_kernel())
        g_two = _all_ranks_graph(lib, lambda r: (empty_kernel(), empty_kernel()))
        floors[point.ep] = {"one": time_replays(clock, g_one, warmup, iters),
                            "two": time_replays(clock, g_two, warmup, iters)}
    ops = result["ops"]
    ops["dispatch"] = time_replays(clock, g_dispatch, warmup, iters, after=g_combine, check=lib.errors)
    ops["combine"] = time_replays(clock, g_combine, warmup, iters, before=g_dispatch, check=lib.errors)
    ops["combine-ws"] = time_replays(clock, g_combine_ws, warmup, iters, before=g_dispatch, check=lib.errors)
    ops["round-trip"] = time_replays(clock, g_round_trip, warmup, iters, check=lib.errors)
    result["floor"] = {op: floors[point.ep]["two" if op == "round-trip" else "one"] for op in REPLAY_OPS}
    # The state the replays left: no recorded timeout, and the last round trip's outputs right.
    clock.sync()
    error = lib.errors() or lib.check_outputs()
    if error is not None:
        return {**result, "status": "FAIL", "notes": [error], "ops": {}}
    result["bytes"] = op_bytes_for(point, lib.sends())
    return result


def _load_library(spec: str) -> Any:
    module, _, attr = LIBRARY_FACTORIES.get(spec, spec).partition(":")
    return getattr(importlib.import_module(module), attr)


def _emit(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def worker_main(argv: list[str]) -> int:
    """The worker: ``LIBRARY PRESET WARMUP ITERS EP:T ...`` (LIBRARY: a name of
    LIBRARY_FACTORIES or ``module:factory``); one JSON line per event on stdout."""
    spec, preset, warmup, iters, *points = argv
    try:
        factory = _load_library(spec)
    except Exception as e:  # noqa: BLE001 - reported to the parent as the library's absence
        _emit({"event": "unavailable", "reason": f"{type(e).__name__}: {first_line(e)}"})
        return 0
    # (The CPU only where a test drives the worker's protocol: the replays need CUDA.)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    _emit({"event": "ready", "name": getattr(factory, "name", spec)})
    clock = Clock(device)
    floors: dict = {}
    for text in points:
        ep, tokens = (int(v) for v in text.split(":"))
        _emit({"event": "start", "point": [ep, tokens]})
        point = Point(PRESETS[preset], ep, tokens, fp8=False)
        try:
            lib = factory(point, device)
            result = measure_point(lib, clock, int(warmup), int(iters), floors)
        except Exception as e:  # noqa: BLE001 - one broken point must not hide the others
            result = {"status": "error", "notes": [f"{type(e).__name__}: {first_line(e)}"], "ops": {}, "floor": {}}
        lib = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        _emit({"event": "result", "point": [ep, tokens], **result})
    return 0


# ---------------------------------------------------------------------------
# the parent: workers, watchdog, table
# ---------------------------------------------------------------------------


@dataclass
class LibraryRun:
    name: str
    available: bool = True
    reason: str = ""
    results: Optional[dict] = None  # (ep, T) -> result


def run_library(spec: str, preset: str, points: list[tuple[int, int]], warmup: int, iters: int,
                point_timeout_s: float = POINT_TIMEOUT_S, log: Callable[[str], None] = print,
                retries: int = POINT_RETRIES) -> LibraryRun:
    """Every point of ``points`` through worker processes of library ``spec``
    (a name of LIBRARY_FACTORIES or ``module:factory``), consecutive points
    of the same ``factory.environment`` sharing a worker (in the order
    of their first point): a worker that
    stalls on a point is killed, the point reported hung, and a fresh worker
    goes on with the next point. A point that failed or hung is measured
    again, up to ``retries`` times (POINT_RETRIES); its result lists the
    earlier attempts under "earlier"."""
    run = LibraryRun(spec, results={})
    try:
        factory = _load_library(spec)
        reason = factory.unavailable() if hasattr(factory, "unavailable") else None
    except Exception as e:  # noqa: BLE001 - the library's absence is a result
        reason = f"{type(e).__name__}: {first_line(e)}"
    if reason is not None:
        run.available, run.reason = False, reason
        return run
    run.name = getattr(factory, "name", spec)
    environment = getattr(factory, "environment", lambda ep, tokens: {})
    groups: list[tuple[dict, list[tuple[int, int]]]] = []
    for key in points:
        extra = environment(*key)
        same = [g for g in groups if g[0] == extra]
        if same:
            same[0][1].append(key)
        else:
            groups.append((extra, [key]))
    for extra, group in groups:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MOE_A2A_TIMEOUT_S": str(WORKER_WAIT_TIMEOUT_S),
               "CUDA_MODULE_LOADING": "EAGER", **extra}
        _run_workers(run, spec, preset, group, warmup, iters, env, point_timeout_s, log)
        for attempt in range(1, retries + 1):
            again = [k for k in group if _retryable(run.results.get(k, {})) and run.available]
            if not again:
                break
            failed = {k: run.results.pop(k) for k in again}
            log(f"  {run.name}: measuring again ({attempt} of {retries}): "
                + ", ".join(f"ep {e} T {t}" for e, t in again))
            _run_workers(run, spec, preset, again, warmup, iters, env, point_timeout_s, log)
            for key in again:
                earlier = failed[key].get("earlier", []) + [failed[key]["status"] + ": " + "; ".join(failed[key]["notes"])]
                run.results[key]["earlier"] = earlier
        if not run.available:
            break
    return run


def _retryable(result: dict) -> bool:
    """A point whose ranks did not all run: hung (a peer without a bound on its
    waits), or one of ours gave up waiting for a peer (its timeout record)."""
    return result.get("status") == "hung" or any("did not arrive" in n for n in result.get("notes", []))


def _run_workers(run: LibraryRun, spec: str, preset: str, points: list[tuple[int, int]], warmup: int, iters: int,
                 env: dict, point_timeout_s: float, log: Callable[[str], None]) -> None:
    todo = list(points)
    while todo:
        cmd = [sys.executable, "-c", WORKER_ENTRY, spec, preset, str(warmup), str(iters),
               *(f"{e}:{t}" for e, t in todo)]
        # stderr to a file: a pipe nobody reads would stall a chatty worker.
        stderr_file = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr_file, text=True, env=env)
        lines = _Lines(proc.stdout)
        current: Optional[tuple[int, int]] = None
        deadline = time.monotonic() + WORKER_START_S
        while True:
            line = lines.next(deadline)
            if line is None:  # stalled: the point in progress is hung
                proc.kill()
                proc.wait()
                stuck = current if current is not None else todo[0]
                run.results[stuck] = {"status": "hung", "ops": {}, "floor": {},
                                      "notes": [f"no progress in {point_timeout_s:.0f} s; worker killed"]}
                log(f"  {run.name} ep {stuck[0]} T {stuck[1]}: hung, worker killed")
                todo.remove(stuck)
                break
            if line == "":  # the worker exited
                proc.wait()
                stderr_file.seek(0)
                last_lines = stderr_file.read().strip().splitlines()[-3:]
                note = f"worker exited with {proc.returncode}: " + " | ".join(last_lines)
                # The point in progress failed; a worker that died between points takes the rest with it.
                for key in [current] if current is not None else list(todo):
                    run.results[key] = {"status": "error", "ops": {}, "floor": {}, "notes": [note]}
                    todo.remove(key)
                break
            event = json.loads(line)
            kind = event["event"]
            if kind == "unavailable":
                run.available, run.reason = False, event["reason"]
                proc.wait()
                return
            if kind == "ready":
                run.name = event["name"]
            elif kind == "start":
                current = tuple(event["point"])
            elif kind == "result":
                key = tuple(event["point"])
                run.results[key] = {k: v for k, v in event.items() if k not in ("event", "point")}
                todo.remove(key)
                current = None
            deadline = time.monotonic() + point_timeout_s
        stderr_file.close()


class _Lines:
    """The worker's stdout lines, read by a thread (a select() on the pipe
    would miss lines already in the reader's buffer): ``next(deadline)`` is
    the next line, '' once the worker closed its stdout, None when
    ``deadline`` passed first."""

    def __init__(self, stream: Any):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put("")

    def next(self, deadline: float) -> Optional[str]:
        try:
            return self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None


def _table(ours: LibraryRun, peer: Optional[LibraryRun], points: list[tuple[int, int]]) -> str:
    header = ["ep", "T", "op", "floor us", "ours us", "ours above"]
    if peer is not None:
        header += [f"{peer.name} us", f"{peer.name} above", "ratio", "above ratio"]
    rows = []
    for key in points:
        mine = ours.results.get(key, {})
        theirs = peer.results.get(key, {}) if peer is not None and peer.available else {}
        for op in REPLAY_OPS:
            us, floor = mine.get("ops", {}).get(op), mine.get("floor", {}).get(op)
            row = [str(key[0]), str(key[1]), op, fmt(floor, ".1f"),
                   fmt(us, ".1f") if us is not None else mine.get("status", "-"),
                   fmt(None if us is None or floor is None else us - floor, ".1f")]
            if peer is not None:
                p_us = theirs.get("ops", {}).get(op)
                p_floor = theirs.get("floor", {}).get(op)
                row += [fmt(p_us, ".1f") if p_us is not None else theirs.get("status", "-"),
                        fmt(None if p_us is None or p_floor is None else p_us - p_floor, ".1f"),
                        fmt(None if p_us is None or us is None else p_us / us, ".2f", "x"),
                        fmt(above_ratio(mine, theirs, op), ".2f", "x")]
            rows.append(row)
    return format_table(header, rows, left={2})


def above_floor(result: dict, op: str) -> Optional[float]:
    """Microseconds of ``op`` above its launch floor in one point's result (None where it lacks either)."""
    us, floor = result.get("ops", {}).get(op), result.get("floor", {}).get(op)
    return None if us is None or floor is None else us - floor


def above_ratio(mine: dict, theirs: dict, op: str) -> Optional[float]:
    """The peer's time above its launch floor over ours at one point (None where
    either lacks it, or ours is not above the floor)."""
    ours, peer = above_floor(mine, op), above_floor(theirs, op)
    return None if ours is None or peer is None or ours <= 0 else peer / ours


def ratios(ours: LibraryRun, peer: LibraryRun, points: list[tuple[int, int]], op: str,
           above: bool = False) -> dict[tuple[int, int], float]:
    """The peer's time over ours (``above``: their times above the launch floor)
    at every point of ``points`` both measured."""
    out = {}
    for key in points:
        mine, theirs = ours.results.get(key, {}), peer.results.get(key, {})
        if above:
            ratio = above_ratio(mine, theirs, op)
        else:
            us, p_us = mine.get("ops", {}).get(op), theirs.get("ops", {}).get(op)
            ratio = None if us is None or p_us is None else p_us / us
        if ratio is not None:
            out[key] = ratio
    return out


def _summary(ours: LibraryRun, peer: Optional[LibraryRun], points: list[tuple[int, int]], copy_gbps: float) -> str:
    lines = ["summary (per replay, device time; ratio = peer / ours, > 1: ours faster):"]
    decode = [k for k in points if k[1] <= max(GRID_TOKENS)]
    if peer is not None and peer.available:
        for op in REPLAY_OPS:
            total = list(ratios(ours, peer, decode, op).values())
            above = list(ratios(ours, peer, decode, op, above=True).values())
            if total:
                lines.append(f"  {op:<10} decode grid: geomean {geomean(total):.2f}x, min {min(total):.2f}x "
                             f"over {len(total)} points; above the floor: geomean {fmt(geomean(above), '.2f', 'x')}, "
                             f"min {fmt(min(above, default=None), '.2f', 'x')}")
        missing = [k for k in decode if peer.results.get(k, {}).get("status") not in (None, "ok")]
        if missing:
            lines.append("  peer failed or hung at: " + ", ".join(
                f"ep {e} T {t} ({peer.results[(e, t)]['status']})" for e, t in missing))
    elif peer is not None:
        lines.append(f"  peer {peer.name}: not available ({peer.reason})")
    for key in points:
        if key[1] < 1024:
            continue
        res = ours.results.get(key, {})
        for op in ("dispatch", "combine-ws"):
            us, nbytes = res.get("ops", {}).get(op), res.get("bytes", {}).get(op)
            if us is not None and nbytes is not None and copy_gbps:
                lines.append(f"  ep {key[0]} T {key[1]} {op}: {nbytes / (us * 1e-6) / 1e9:.0f} GB/s = "
                             f"{nbytes / (us * 1e-6) / 1e9 / copy_gbps:.3f} of copy bandwidth")
    for lib in (ours, peer):
        if lib is None or not lib.available:
            continue
        again = [k for k in points if lib.results.get(k, {}).get("earlier")]
        if again:
            lines.append(f"  {lib.name} measured again (graph branches not run concurrently): " + ", ".join(
                f"ep {e} T {t} x{len(lib.results[(e, t)]['earlier'])}" for e, t in again))
    if peer is not None and peer.available:
        lines += targets.decode_lines({op: ratios(ours, peer, decode, op, above=True) for op in REPLAY_OPS},
                                      peer.name)
    failed = [k for k in points if ours.results.get(k, {}).get("status") != "ok"]
    if failed:
        lines.append("  ours failed at: " + ", ".join(f"ep {e} T {t} ({ours.results.get((e, t), {}).get('status')})"
                                                   for e, t in failed))
    return "\n".join(lines)


def default_points() -> list[tuple[int, int]]:
    return [(e, t) for e in GRID_EP for t in GRID_TOKENS] + list(LARGE_POINTS)


def run(args: argparse.Namespace) -> int:
    """``bench --graph all-ranks``: ours (and ``--peer``) over the points; table, summary, ``--json``."""
    preset = preset_names(args.preset, default=["deepseek-v3"])[0]
    if args.ep is None and args.tokens is None:
        points = default_points()
    else:
        points = [(e, t) for e in (args.ep or GRID_EP) for t in (args.tokens or GRID_TOKENS)]
    iters = DEFAULT_REPLAYS if args.iters is None else args.iters
    warmup = DEFAULT_WARMUP_REPLAYS if args.warmup is None else args.warmup
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"torch-moe-a2a bench --graph all-ranks: {device_name(device)}, torch {torch.__version__}; {preset}; "
          f"one graph per op over all ranks; median of {iters} replays after {warmup}", flush=True)
    ceiling = copy_bandwidth(Clock(device), device, COPY_BYTES["cuda"])
    print(f"copy ceiling: {ceiling:.1f} GB/s", flush=True)
    ours = run_library("ours", preset, points, warmup, iters)
    peer = None
    if args.peer:
        peer = run_library(args.peer, preset, points, warmup, iters)
        if not peer.available:
            print(f"peer {args.peer}: not available ({peer.reason}); only ours is timed", flush=True)
    print(_table(ours, peer, points))
    if peer is not None and peer.available:
        factory = _load_library(args.peer)
        changed = [(k, factory.environment(*k)) for k in points if factory.environment(*k)]
        for key, env in changed:
            print(f"  {peer.name} at ep {key[0]} T {key[1]} ran with "
                  + " ".join(f"{name}={value}" for name, value in env.items()))
    print()
    print(_summary(ours, peer, points, ceiling))
    if args.json:
        key = lambda k: f"ep{k[0]}_T{k[1]}"  # noqa: E731
        write_json(args.json, {
            "mode": "all-ranks", "device": device_name(device), "torch": torch.__version__, "preset": preset,
            "iters": iters, "warmup": warmup, "copy_bandwidth_GBps": ceiling,
            "ours": {key(k): v for k, v in ours.results.items()},
            "peer": None if peer is None else {"name": peer.name, "available": peer.available,
                                               "reason": peer.reason,
                                               "results": {key(k): v for k, v in (peer.results or {}).items()}},
        })
    ok = all(ours.results.get(k, {}).get("status") == "ok" for k in points)
    return 0 if ok else 1

