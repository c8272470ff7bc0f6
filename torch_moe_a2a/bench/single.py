"""``python -m torch_moe_a2a bench``: throughput and latency of dispatch and combine
with simulated expert parallelism on one device (DESIGN.md section 8).

What is measured, for every point (model preset, ep, tokens per rank):

- ops: ``dispatch``; ``combine`` with the expert outputs in a tensor of their
  own (the op stages them into the workspace); ``combine-ws`` with the expert
  outputs already in the workspace (``payload_in_workspace=True``);
  ``round-trip`` = dispatch + combine (staged, the API's default);
  ``round-trip-ws`` = dispatch + combine-ws (a MoE that writes its expert
  outputs into the workspace: the latency path).
- one step = the call of every simulated rank (:meth:`SimulatedEP.run`: a
  CUDA stream per rank forked from and joined back into the current stream,
  or a thread per rank on the CPU). Dispatch and combine must alternate, so
  an op measured alone is paired with an untimed partner in every iteration.
  A round trip is one step in which each rank calls dispatch, then combine,
  as a rank of a real deployment does on its one stream: no join of all
  ranks between the two ops (a barrier a real deployment does not have; the
  kernels' own flags order them).
- time: CUDA events on the current stream around the step (perf_counter on
  the CPU); the median of ``--iters`` iterations after ``--warmup``. The
  inputs (dispatch payloads, expert outputs) rotate over pre-built sets
  whose bytes together exceed twice the L2 cache where MAX_SETS sets
  suffice, so the cache does not flatter the numbers (points smaller than
  that are latency-bound anyway). ``combine-ws`` reads the one combine
  region of the workspace, as a real MoE leaves it there.
- eager: the ops called from Python step after step, as an eager model
  loop issues them (host launch overhead included where the host is slower
  than the device). graph (CUDA only): one step per op kind and input set
  captured as one CUDA graph per rank (:meth:`SimulatedEP.capture`, as each
  rank of a deployment captures its own) and replayed on the rank streams,
  forked from and joined into the current stream; the baseline's step as
  one graph over all ranks (they never wait for each other). The device is
  given a head start (a spin kernel) so that the timings are device time. A
  replay carries the graph launches and the simulation's fork into and join
  out of the rank streams (about 14 us on the H200 at ep 8), which a rank of
  a real deployment does not pay per op. graph per step (round trips, CUDA
  only): STEPS_PER_GRAPH round trips in a row on every rank's stream, on
  consecutive input sets, captured the same way; its replay time /
  STEPS_PER_GRAPH is the round trip of a rank whose stream runs layer after
  layer inside one graph, as a deployment's captured forward pass does.
- bytes (section 8): dispatch reads each token's payload row once and writes
  it once per distinct destination rank; combine reads one row per (token,
  destination) and writes one row per token; staging (``combine``) adds a
  read and a write of every received row. Counted exactly from the routing
  and summed over all ranks; GB/s = bytes / median time (graph time where
  there is one); the ratio is to the device copy bandwidth (bytes read +
  written by a large ``copy_``) measured in the same run.
- baseline: the same exchange in plain PyTorch as a user would write it
  (:class:`_Baseline`), on the same rank streams, inputs and receive layout,
  timed the same way; speedup = its time / ours.
- host cost: the CPU time of the calling thread (``time.thread_time``,
  the host-cost target's measure: microseconds of CPU time in the Python
  wrapper and op dispatch) around one rank's eager call, ep 1 and 16 tokens so the device
  never makes the host wait; median of many calls. The wall time of the
  same calls (``time.perf_counter``) is reported beside it: it also holds
  the time the thread was not running, which a busy host adds.
- correctness guard: before timing, one round trip of ours and of the
  baseline is compared with :mod:`torch_moe_a2a.reference`; a point whose
  kernels disagree is marked FAIL and not timed. After timing, a graph
  replay must equal the eager call, and no rank may have recorded a
  timed-out wait (:func:`check_errors`), else the point is FAIL too.

Routing: :func:`random_routing` (distinct experts per token). Payloads as a
real MoE sends them: hidden states (bf16, or with ``--fp8`` float8_e4m3fn
plus fp32 scales, one per FP8_BLOCK elements), int32 expert ids and fp32
router weights ``[n, top_k]``. Expert outputs (the combine payload) are bf16.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .. import layout
from ..api import check_errors, moe_a2a_combine, moe_a2a_dispatch, moe_a2a_wrap_payload_tensor_in_workspace
from ..reference import reference_combine, reference_dispatch
from ..simulate import RankGraphs, SimulatedEP
from . import expert_major as bench_expert_major
from . import low_precision, plot, replay, targets
from . import training as bench_training
from .common import (
    BASELINE_OF,
    COPY_BYTES,
    DEFAULT_ITERS,
    DEFAULT_MAX_GIB,
    DEFAULT_WARMUP,
    FP8_BLOCK,
    FP8_DTYPE,
    GIB,
    NO_CUDA,
    OPS,
    PRESETS,
    SEED,
    Clock,
    DistinctValues,
    InputSet,
    OpGraphs,
    Point,
    Preset,
    Progress,
    QuietProgress,
    StopSignals,
    add_preset_argument,
    capture_graph,
    check_output_path,
    combine_mismatch,
    device_name,
    expected_sends,
    expert_owner,
    first_line,
    fmt,
    format_table,
    geomean,
    int_at_least,
    int_in_range,
    invalid_reason,
    l2_bytes,
    make_set,
    new_record,
    num_sets_for,
    op_bytes_for,
    over_max_gib,
    per_device,
    positive_float,
    preset_names,
    recv_mismatch,
    reference_payloads,
    release,
    report_copy_ceiling,
    routes_by_destination,
    set_bytes,
    stopped_line,
    time_ops,
    write_json,
)

# ---------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------

# The default sweep per device type (every preset). On the CPU it is sized to
# take a minute or two on two cores: a thread per simulated rank, so ep 8
# there measures mostly the threads' time-slicing, and 512 tokens or more
# mostly the plain-PyTorch baseline's slow CPU gathers.
DEFAULT_EP = {"cuda": (1, 2, 4, 8), "cpu": (1, 2, 4)}
DEFAULT_TOKENS = {"cuda": (1, 16, 128, 512, 2048, 4096), "cpu": (1, 16, 128)}
DEFAULT_ITERS_FOR = {"cuda": DEFAULT_ITERS, "cpu": 20}
DEFAULT_WARMUP_FOR = {"cuda": DEFAULT_WARMUP, "cpu": 3}
# --smoke: the short run of scripts/gpu_check.sh.
SMOKE_PRESETS = ("deepseek-v3",)
SMOKE_EP = (8,)
SMOKE_TOKENS = (1, 128, 4096)
SMOKE_ITERS = 20
SMOKE_WARMUP = 5

# Round trips per rank stream in the graph of the per-step timing (module
# docstring): a captured forward pass of the presets' models holds 32 to 94 MoE
# layers (Mixtral 32, GPT-OSS-120B 36, DeepSeek-V3 58, Qwen3-235B 94), and the
# simulation's launch of a graph per rank, fork and join (about 14 us at ep 8
# on the H200) add under half a microsecond to each of 32 steps.
STEPS_PER_GRAPH = 32


# Host cost of one eager call: a small point where the device never makes the host wait.
HOST_COST_EP = 1
HOST_COST_TOKENS = 16
HOST_COST_WARMUP = 20
HOST_COST_CALLS = 200

# Graph timing: spin the device before the timed replays so the host can queue
# them ahead of it, for HEAD_START_MARGIN times the host time per iteration of
# the warm-up (a replay of our ops launches one graph per rank), at least
# HOST_ENQUEUE_S per iteration.
HOST_ENQUEUE_S = 50e-6
HEAD_START_MARGIN = 2.0
MAX_HEAD_START_S = 0.5

# Baseline plan: about six int64 tensors of n * top_k entries per rank (dest,
# flat, order, sorted dest, slot, target/token) live at once.
_PLAN_BYTES_PER_ENTRY = 6 * 8


def _num_sets(point: Point, l2_bytes: int) -> int:
    return num_sets_for(set_bytes(point), l2_bytes)


def _memory_bytes(point: Point, n_sets: int, cuda: bool) -> int:
    """Upper estimate of the memory one point needs (device memory; on the CPU all of it)."""
    ep, T, k = point.ep, point.tokens, point.preset.top_k
    drow, crow = point.dispatch_row_bytes, point.combine_row_bytes
    outputs = ep * T * crow  # one combine output per rank
    workspace = ep * layout.workspace_size_per_rank(ep, T, drow, crow, 0)
    sets = n_sets * set_bytes(point)
    baseline_recv = (point.expert_rows + 1) * drow
    # Per step of the baseline: gathered rows (+ the plan) for dispatch; bf16 and
    # fp32 gathered rows, the fp32 accumulator and the output for combine.
    baseline_dispatch = ep * T * k * (drow + _PLAN_BYTES_PER_ENTRY)
    baseline_combine = ep * (T * k * 3 * crow + T * 3 * crow)
    total = workspace + sets + baseline_recv + baseline_dispatch + baseline_combine + 4 * outputs
    if cuda:
        # Graph pools: our combine outputs (combine per set, combine-ws once; the
        # round trips write into preallocated outputs, counted once more); the
        # baseline's graphs of one kind (at most a round trip per set).
        total += (n_sets + 2) * outputs + n_sets * (baseline_dispatch + baseline_combine)
    else:
        # The reference (CPU) shares the memory: its receive planes and copies.
        total += 2 * point.expert_rows * drow + 2 * ep * T * (drow + crow)
    return total


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------


# A timing spread above this (interquartile range over the median of one
# measurement) says the timings are not to be trusted as they stand.
BUSY_SPREAD = 0.25


def _measure(
    clock: Clock,
    n_sets: int,
    warmup: int,
    iters: int,
    timed: Callable[[int], Any],
    before: Optional[Callable[[int], Any]] = None,
    after: Optional[Callable[[int], Any]] = None,
    head_start: bool = False,
    stop: Optional[Callable[[], None]] = None,
    spreads: Optional[list[float]] = None,
) -> float:
    """Median microseconds of ``timed(i)`` over ``iters`` iterations after ``warmup``.

    Iteration ``it`` uses input set ``i = it % n_sets`` and runs ``before(i)``,
    ``timed(i)`` between two marks, ``after(i)``. No host sync until the end.
    ``head_start``: the device spins before the timed iterations while the
    host queues them (module constants). ``stop`` is called before every
    iteration (it raises to end the run): an iteration runs whole, so no
    dispatch is left without its combine while the run still goes on.
    ``spreads`` (when given) gets the iterations' interquartile range over
    their median (timing_spread).
    """
    marks = []
    warmup_start = time.perf_counter()
    for it in range(warmup + iters):
        if stop is not None:
            stop()
        i = it % n_sets
        if it == warmup and head_start:
            host_per_iter = (time.perf_counter() - warmup_start) / warmup if warmup else 0.0
            clock.head_start(min(MAX_HEAD_START_S, iters * max(HOST_ENQUEUE_S, HEAD_START_MARGIN * host_per_iter)))
        if before is not None:
            before(i)
        start = clock.mark() if it >= warmup else None
        timed(i)
        if start is not None:
            marks.append((start, clock.mark()))
        if after is not None:
            after(i)
    times = clock.elapsed_us(marks)
    median = statistics.median(times)
    if spreads is not None:
        spreads.append(timing_spread(times, median))
    return median


def timing_spread(times: list[float], median: float) -> float:
    """The interquartile range of ``times`` over their median (0 for fewer
    than two times): how far a busy machine moved the iterations."""
    if len(times) < 2 or median <= 0:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / median


def _op_bytes(point: Point, sets: list[InputSet]) -> dict[str, float]:
    """Bytes each op moves, counted exactly from each set's routing, averaged over the sets."""
    per_set = [op_bytes_for(point, int(s.destinations.sum())) for s in sets]
    return {op: sum(b[op] for b in per_set) / len(sets) for op in OPS}


# ---------------------------------------------------------------------------
# the two implementations
# ---------------------------------------------------------------------------


class _Ours:
    """Steps of torch-moe-a2a over all simulated ranks (ranks on their own streams/threads)."""

    def __init__(self, point: Point, sets: list[InputSet], device: torch.device):
        self.point, self.sets = point, sets
        p, ep, T = point.preset, point.ep, point.tokens
        self.sim = SimulatedEP(ep, T, dispatch_bytes_per_token=point.dispatch_row_bytes,
                               combine_bytes_per_token=point.combine_row_bytes, device=device)
        # Runs each op's per-rank function: sim.run, or sim.capture inside capture().
        self._run: Callable[[Callable[[int], Any]], list] = self.sim.run
        # A recv_view_cache per rank, as a latency-minded caller passes one.
        self.caches: list[dict] = [{} for _ in range(ep)]
        # Same for every call of this point (checked against dispatch's return in the guard).
        self.offset = layout.call_layout(ep, T, 0, point.row_bytes()).combine_offset
        nbytes = ep * T * point.combine_row_bytes
        self.ws_views = [
            moe_a2a_wrap_payload_tensor_in_workspace(self.sim.workspace[r], [ep, T], self.offset,
                                                     self.offset + nbytes, p.dtype)
            for r in range(ep)
        ]
        self.rt_out = [torch.empty((T, p.hidden), dtype=p.dtype, device=device) for _ in range(ep)]

    # One rank's call of each op (set i), through SimulatedEP's per-rank calls.
    def _dispatch_rank(self, i: int, r: int) -> tuple:
        p, T, s = self.point.preset, self.point.tokens, self.sets[i]
        return self.sim.dispatch_rank(r, s.ids[r], s.payloads[r], T, p.top_k, p.num_experts,
                                      recv_view_cache=self.caches[r])

    def _combine_rank(self, i: int, r: int, output: Optional[Tensor] = None) -> Tensor:
        p, T, s = self.point.preset, self.point.tokens, self.sets[i]
        return self.sim.combine_rank(r, s.expert_out[r], T, T, p.top_k, self.offset, output=output)

    def _combine_ws_rank(self, r: int, output: Optional[Tensor] = None) -> Tensor:
        p, T = self.point.preset, self.point.tokens
        return self.sim.combine_rank(r, self.ws_views[r], T, T, p.top_k, self.offset, payload_in_workspace=True,
                                     output=output)

    def capture(self, step: Callable[[], Any]) -> tuple[RankGraphs, Any]:
        """One CUDA graph per rank of ``step()``, one call of an op of this class
        (one ``sim.run``), whose per-rank function is captured on each rank's
        stream (SimulatedEP.capture), and what ``step()`` returned (tensors the
        replays rewrite). Not one graph over all ranks: its branches may run one
        after another, and a rank that waits for a later branch's peer then
        times out (simulate.py's docstring)."""
        captured: list[RankGraphs] = []

        def run(fn: Callable[[int], Any]) -> list:
            graphs, results = self.sim.capture(fn)
            captured.append(graphs)
            return results

        self._run = run
        try:
            result = step()
        finally:
            self._run = self.sim.run
        if len(captured) != 1:
            raise RuntimeError(f"_Ours.capture: a step must run the ranks once, it ran them {len(captured)} times")
        return captured[0], result

    def dispatch(self, i: int) -> list:
        return self._run(lambda r: self._dispatch_rank(i, r))

    def combine(self, i: int) -> list[Tensor]:
        return self._run(lambda r: self._combine_rank(i, r))

    def combine_ws(self, i: int = 0) -> list[Tensor]:
        """Combine with the payload already in the workspace (the same views for every set)."""
        return self._run(self._combine_ws_rank)

    def _round_trip_rank(self, i: int, r: int, ws: bool) -> Tensor:
        """Rank r's dispatch of set i, then its combine (with the payload in the
        workspace if ``ws``) into its preallocated output ``rt_out[r]``."""
        self._dispatch_rank(i, r)
        return self._combine_ws_rank(r, self.rt_out[r]) if ws else self._combine_rank(i, r, self.rt_out[r])

    def round_trip(self, i: int) -> list[Tensor]:
        """Each rank: dispatch, then combine (one step: no join of the ranks in
        between) into the rank's preallocated output (a rank's combine must not
        wait for an allocation while its dispatch waits for a peer that the host
        has not launched yet)."""
        return self._run(lambda r: self._round_trip_rank(i, r, ws=False))

    def round_trip_ws(self, i: int) -> list[Tensor]:
        """Each rank: dispatch, then combine with the payload in the workspace (a MoE
        that writes its expert outputs there: the latency path), as round_trip."""
        return self._run(lambda r: self._round_trip_rank(i, r, ws=True))

    def round_trips(self, first: int, steps: int, ws: bool) -> list[Tensor]:
        """Each rank: ``steps`` round trips (round_trip_ws if ``ws``, else round_trip)
        in a row on its stream, on input sets first, first + 1, ... (mod the
        number of sets), with no join of the ranks between them; returns the
        last round trip's outputs (``rt_out``)."""
        def rank(r: int) -> Tensor:
            for k in range(steps):
                out = self._round_trip_rank((first + k) % len(self.sets), r, ws)
            return out

        return self._run(rank)


def _indexable(t: Tensor) -> Tensor:
    """``t`` as a 2-D tensor for index ops: fp8 as uint8 (same bytes; index kernels may lack fp8)."""
    if t.dtype == FP8_DTYPE:
        t = t.view(torch.uint8)
    return t.reshape(t.shape[0], -1)


class _Baseline:
    """The same exchange in plain PyTorch, as a user without this library would write it.

    Per source rank ``s`` (on its own stream/thread, like ours): destination
    ranks from expert ids (owner table), repeated destinations of a token
    marked "nowhere", a stable argsort by destination, per-destination counts
    and their exclusive cumsum (each destination's segment of the sorted
    list), then ``index_select`` of the payload rows and ``index_copy_`` into
    each destination's receive buffer at ``[s, slot]``; the counts matrix
    (``torch.stack``, the all-gather of counts) gives every receiver its
    counts. The receive buffers use our layout (``[ep, T, row]`` per
    destination, one flat tensor for all with a trailing "nowhere" row) so
    both implementations move the same rows. Combine gathers the expert rows
    back with the same indices and sums them with ``index_add_`` into fp32,
    then casts. No host syncs, so it can be captured in a CUDA graph.
    """

    def __init__(self, point: Point, sets: list[InputSet], sim: SimulatedEP, device: torch.device):
        self.point, self.sets, self.sim = point, sets, sim
        self.owner = expert_owner(point.preset.num_experts, point.ep).to(device)
        self.nowhere = point.expert_rows  # index of the trailing row of every flat buffer
        self.recv_flat = [
            torch.zeros((point.expert_rows + 1, _indexable(pl).shape[1]), dtype=_indexable(pl).dtype, device=device)
            for pl in sets[0].payloads[0]
        ]
        self.plans: list[Optional[list]] = [None] * len(sets)  # per set, for combine timed alone

    def recv_views(self, d: int) -> list[Tensor]:
        """Destination ``d``'s receive buffers ``[ep, T, row]``, one per payload."""
        ep, T = self.point.ep, self.point.tokens
        return [buf[: self.nowhere].view(ep, ep, T, -1)[d] for buf in self.recv_flat]

    def _plan(self, s: int, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(target row in the flat buffers, source token, int64 counts ``[ep]``), entries sorted by destination."""
        ep, T = self.point.ep, self.point.tokens
        n, k = ids.shape
        sorted_dest, order, counts = routes_by_destination(ids, self.owner, ep)
        segment_start = torch.cumsum(counts, 0) - counts
        slot = torch.arange(n * k, device=ids.device) - segment_start[sorted_dest]
        target = torch.where(sorted_dest < ep, sorted_dest * (ep * T) + s * T + slot, self.nowhere)
        return target, order // k, counts[:ep]

    def _dispatch_rank(self, s: int, ids: Tensor, payloads: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        target, token, counts = self._plan(s, ids)
        for buf, payload in zip(self.recv_flat, payloads):
            buf.index_copy_(0, target, _indexable(payload).index_select(0, token))
        return target, token, counts

    def dispatch(self, i: int) -> tuple[list, Tensor]:
        """Returns (per-rank plans, int64 counts ``[src, dst]``: column d = d's receive counts)."""
        s = self.sets[i]
        plans = self.sim.run(lambda r: self._dispatch_rank(r, s.ids[r], s.payloads[r]))
        return plans, torch.stack([plan[2] for plan in plans])

    def combine(self, i: int, plans: Optional[list] = None) -> list[Tensor]:
        plans = self.plans[i] if plans is None else plans
        expert_flat, T = self.sets[i].expert_flat, self.point.tokens

        def rank(s: int) -> Tensor:
            target, token, _ = plans[s]
            rows = expert_flat.index_select(0, target)  # the "nowhere" row is zero
            acc = torch.zeros((T, expert_flat.shape[1]), dtype=torch.float32, device=expert_flat.device)
            return acc.index_add_(0, token, rows.float()).to(expert_flat.dtype)

        return self.sim.run(rank)

    def round_trip(self, i: int) -> list[Tensor]:
        plans, _ = self.dispatch(i)
        return self.combine(i, plans)


# ---------------------------------------------------------------------------
# correctness guard
# ---------------------------------------------------------------------------


def _check_ours(ours: _Ours, ref, expected: list[Tensor], names: list[str]) -> tuple[bool, list[str]]:
    """One round trip of each combine kind on set 0 against the reference; (ok, notes)."""
    ep, s0, sim = ours.point.ep, ours.sets[0], ours.sim
    # Run the whole sequence first (dispatch and combine must alternate), then compare.
    results = ours.dispatch(0)
    recv = [[v.cpu() for v in results[d][0]] for d in range(ep)]
    counts = [sim.recv_counts(d).cpu() for d in range(ep)]
    outs = ours.combine(0)
    ours.dispatch(0)
    for r in range(ep):
        ours.ws_views[r].copy_(s0.expert_out[r])  # what an MoE writing into the workspace leaves there
    outs_ws = ours.combine_ws()
    # The round trips (each rank's two calls in one step) on the same inputs.
    outs_rt = [o.clone() for o in ours.round_trip(0)]
    outs_rt_ws = [o.clone() for o in ours.round_trip_ws(0)]

    errors, notes = [], []
    for d in range(ep):
        if results[d][1] != ours.offset:
            errors.append(f"rank {d}: combine_payload_offset {results[d][1]} != layout's {ours.offset}")
        elif not torch.equal(counts[d], ref.recv_counts[d].cpu()):
            errors.append(f"rank {d}: recv counts {counts[d].tolist()} != reference {ref.recv_counts[d].tolist()}")
        else:
            bad = recv_mismatch(recv[d], ref.recv[d], counts[d], names)
            if bad is not None:
                errors.append(f"rank {d}: received {bad} differs from the reference")
    for what, got in (("combine", outs), ("combine-ws", outs_ws), ("round-trip", outs_rt),
                      ("round-trip-ws", outs_rt_ws)):
        error, bitwise = combine_mismatch(got, expected)
        if error is not None:
            errors.append(f"{what}: {error}")
        elif not bitwise:
            notes.append(f"{what} within tolerance of the reference but not bitwise equal")
    return not errors, errors[:1] + notes


def _check_baseline(base: _Baseline, ref, expected: list[Tensor], names: list[str]) -> Optional[str]:
    """The baseline's round trip on set 0 against the reference; stores set 0's plan. Error or None."""
    ep = base.point.ep
    plans, counts = base.dispatch(0)
    base.plans[0] = plans
    outs = base.combine(0)
    counts = counts.cpu()
    for d in range(ep):
        if not torch.equal(counts[:, d].to(torch.int32), ref.recv_counts[d].cpu()):
            return f"baseline rank {d}: recv counts differ from the reference"
        bad = recv_mismatch(base.recv_views(d), ref.recv[d], counts[:, d], names)
        if bad is not None:
            return f"baseline rank {d}: received {bad} differs from the reference"
    error, _ = combine_mismatch(outs, expected)
    return None if error is None else f"baseline {error}"


# ---------------------------------------------------------------------------
# one point
# ---------------------------------------------------------------------------


@dataclass
class _Context:
    device: torch.device
    clock: Clock
    iters: int
    warmup: int
    max_bytes: int
    l2_bytes: int
    copy_gbps: float
    progress: Any  # Progress, or QuietProgress before the sweep
    graphs: bool  # also time CUDA-graph replays (CUDA only)
    stop: Callable[[], None] = lambda: None  # raises Interrupted once a stop signal arrived


def _run_point(point: Point, ctx: _Context) -> dict:
    record = new_record(point)
    device, clock, cuda = ctx.device, ctx.clock, ctx.device.type == "cuda"
    label = point.label()

    reason = invalid_reason(point)
    if reason is not None:
        record.update(status="skipped", notes=[reason])
        return record
    n_sets = _num_sets(point, ctx.l2_bytes)
    need = _memory_bytes(point, n_sets, cuda)
    record.update(input_sets=n_sets, memory_estimate_gib=need / GIB)
    if need > ctx.max_bytes:
        record.update(status="skipped", notes=[over_max_gib(need, ctx.max_bytes)])
        return record
    if cuda:
        free = torch.cuda.mem_get_info(device)[0]
        if need > free:
            record.update(status="skipped", notes=[f"needs ~{need / GIB:.1f} GiB > {free / GIB:.1f} GiB free"])
            return record

    ctx.progress.phase(label, "inputs")
    gen_cpu = torch.Generator().manual_seed(SEED)
    gen_dev = torch.Generator(device=device).manual_seed(SEED)
    owner = expert_owner(point.preset.num_experts, point.ep)
    sets = [make_set(point, device, gen_cpu, gen_dev, owner) for _ in range(n_sets)]
    op_bytes = _op_bytes(point, sets)
    ours = _Ours(point, sets, device)
    base = _Baseline(point, sets, ours.sim, device)

    ctx.progress.phase(label, "check")
    names = [name for name, _, _ in point.payload_rows()]
    ref = reference_dispatch(sets[0].ids, reference_payloads(sets[0].payloads), ep_size=point.ep,
                             num_experts=point.preset.num_experts, runtime_max_tokens_per_rank=point.tokens)
    expected = reference_combine(sets[0].expert_out, ref, [point.tokens] * point.ep)
    ok, notes = _check_ours(ours, ref, expected, names)
    record["notes"] += notes
    try:
        base_error = _check_baseline(base, ref, expected, names)
    except Exception as e:  # noqa: BLE001 - a broken baseline must not hide our numbers
        base_error = f"baseline: {type(e).__name__}: {first_line(e)}"
    del ref, expected
    if not ok:
        record["status"] = "FAIL"
        return record
    if base_error is not None:
        record["notes"].append(base_error)
    base_ok = base_error is None
    record["baseline_ok"] = base_ok
    for i in range(1, n_sets if base_ok else 0):
        base.plans[i] = base.dispatch(i)[0]

    spreads: list[float] = []

    def measure(timed, before=None, after=None, head_start=False) -> float:
        return _measure(clock, n_sets, ctx.warmup, ctx.iters, timed, before, after, head_start, ctx.stop, spreads)

    graph_us, step_us, base_eager_us, base_graph_us = {}, {}, {}, {}
    ctx.progress.phase(label, "eager")
    eager_us = time_ops(measure, ours)
    if base_ok:
        ctx.progress.phase(label, "baseline eager")
        base_eager_us["dispatch"] = measure(base.dispatch)
        base_eager_us["combine"] = measure(base.combine)
        base_eager_us["round-trip"] = measure(base.round_trip)

    if ctx.graphs:
        release(device)
        ctx.progress.phase(label, "graph")
        try:
            op_graphs = OpGraphs(ours, n_sets, ours.capture)
            graph_us = time_ops(measure, op_graphs, head_start=True)
            # The replays must compute what the (reference-checked) eager calls compute.
            op_graphs.dispatch(0)
            replayed = op_graphs.combine(0)
            ours.dispatch(0)
            eager_out = ours.combine(0)
            mismatch = [] if all(torch.equal(g, e) for g, e in zip(replayed, eager_out)) else ["combine"]
            op_graphs = replayed = eager_out = None
            release(device)
            for op, ws in (("round-trip", False), ("round-trip-ws", True)):
                g_steps = [ours.capture(lambda i=i: ours.round_trips(i, STEPS_PER_GRAPH, ws)) for i in range(n_sets)]
                step_us[op] = measure(lambda i: g_steps[i][0].replay(), head_start=True) / STEPS_PER_GRAPH
                # The graph whose last step is on set 0 against the eager round trip on set 0.
                last_on_0 = g_steps[(1 - STEPS_PER_GRAPH) % n_sets]
                last_on_0[0].replay()
                got = [o.clone() for o in last_on_0[1]]
                eager_out = ours.round_trip_ws(0) if ws else ours.round_trip(0)
                if not all(torch.equal(g, e) for g, e in zip(got, eager_out)):
                    mismatch.append(f"{op} ({STEPS_PER_GRAPH} steps per graph)")
                g_steps = got = eager_out = None
            if mismatch:
                graph_us.clear()
                step_us.clear()
                record["status"] = "FAIL"
                record["notes"].append(f"graph replay of {', '.join(mismatch)} differs from the eager call")
        except Exception as e:  # noqa: BLE001 - reported in the row; eager numbers stand
            graph_us.clear()
            step_us.clear()
            record["notes"].append(f"graph: {type(e).__name__}: {first_line(e)}")
        op_graphs = replayed = eager_out = g_steps = None
        release(device)
        if base_ok:
            ctx.progress.phase(label, "baseline graph")
            # One kind at a time: the baseline's graph pools hold its temporaries.
            for op, step in (("dispatch", base.dispatch), ("combine", base.combine), ("round-trip", base.round_trip)):
                try:
                    graphs = [capture_graph(lambda i=i: step(i))[0] for i in range(n_sets)]
                    base_graph_us[op] = measure(lambda i: graphs[i].replay(), head_start=True)
                except Exception as e:  # noqa: BLE001 - reported in the row
                    record["notes"].append(f"baseline graph {op}: {type(e).__name__}: {first_line(e)}")
                graphs = None
                release(device)

    # A timed-out wait leaves its record in the workspace: a kernel that gave up
    # early must not pass for a fast one (graph replays raise nothing themselves).
    try:
        check_errors(ours.sim.workspace)
    except RuntimeError as e:
        record["status"] = "FAIL"
        record["notes"].append(first_line(e))
        return record

    record["timing_spread"] = max(spreads)  # the widest of the point's measurements
    for op in OPS:
        best = graph_us.get(op, eager_us[op])
        gbps = op_bytes[op] / (best * 1e-6) / 1e9
        b_eager, b_graph = base_eager_us.get(BASELINE_OF[op]), base_graph_us.get(BASELINE_OF[op])
        record["ops"][op] = {
            "bytes": op_bytes[op],
            "eager_us": eager_us[op],
            "graph_us": graph_us.get(op),
            "graph_step_us": step_us.get(op),
            "GBps": gbps,
            "GBps_from": "graph" if op in graph_us else "eager",
            "copy_ratio": gbps / ctx.copy_gbps,
            "baseline_eager_us": b_eager,
            "baseline_graph_us": b_graph,
            "speedup_eager": None if b_eager is None else b_eager / eager_us[op],
            "speedup_graph": None if b_graph is None or op not in graph_us else b_graph / graph_us[op],
        }
    return record


# ---------------------------------------------------------------------------
# ceiling and host cost
# ---------------------------------------------------------------------------


def _host_cost(preset: Preset, fp8: bool, device: torch.device, clock: Clock,
               stop: Callable[[], None]) -> tuple[dict[str, float], dict[str, float]]:
    """Median host microseconds of one eager call per op (ep 1: nothing to wait
    for): (CPU time of this thread, wall time)."""
    point = Point(preset, HOST_COST_EP, HOST_COST_TOKENS, fp8)
    gen_cpu = torch.Generator().manual_seed(SEED)
    gen_dev = torch.Generator(device=device).manual_seed(SEED)
    s = make_set(point, device, gen_cpu, gen_dev, expert_owner(preset.num_experts, point.ep))
    ours = _Ours(point, [s], device)
    sim, T, k, E = ours.sim, point.tokens, preset.top_k, preset.num_experts
    ws, meta = sim.workspace, sim.metainfo[0]
    cache: dict = {}
    calls = {
        "dispatch": lambda: moe_a2a_dispatch(s.ids[0], s.payloads[0], ws, meta, T, 0, 1, k, E),
        "combine": lambda: moe_a2a_combine(s.expert_out[0], T, ws, meta, T, 0, 1, k, ours.offset),
        "dispatch (recv_view_cache)": lambda: moe_a2a_dispatch(s.ids[0], s.payloads[0], ws, meta, T, 0, 1, k, E,
                                                                recv_view_cache=cache),
        "combine-ws": lambda: moe_a2a_combine(ours.ws_views[0], T, ws, meta, T, 0, 1, k, ours.offset,
                                              payload_in_workspace=True),
    }
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    wall: dict[str, list[float]] = {name: [] for name in calls}
    for it in range(HOST_COST_WARMUP + HOST_COST_CALLS):
        stop()  # between rounds: each round ends with a combine
        for name, call in calls.items():  # dispatch, combine, dispatch, combine: the alternation holds
            start = time.perf_counter()  # outside: the CPU clock's reads cost a syscall each
            start_cpu = time.thread_time()
            call()
            elapsed_cpu = time.thread_time() - start_cpu
            elapsed = time.perf_counter() - start
            if it >= HOST_COST_WARMUP:
                cpu[name].append(elapsed_cpu * 1e6)
                wall[name].append(elapsed * 1e6)
    clock.sync()
    return ({name: statistics.median(t) for name, t in cpu.items()},
            {name: statistics.median(t) for name, t in wall.items()})


# ---------------------------------------------------------------------------
# the time a sweep will take
# ---------------------------------------------------------------------------

# The up-front estimate: a model of what each point runs (its steps, their
# bytes at the copy bandwidth, the host's cost per call, the input sets).
# The CPU constants are fitted to runs on two cores (the default sweep's
# total within 10%, single points within a factor of about two); the CUDA
# ones come from the H200 figures of docs/performance.md (copy ratios, the shortest
# round trips) and have not been compared with a GPU run's wall times yet.
# Every point's own time lands in --json (wall_s), and the summary prints
# the sweep's time beside the estimate.
EST_THREAD_US = 130.0  # CPU: one rank's thread started and joined, per step
EST_BASELINE_RANK_STEP_US = {"cpu": 200.0, "cuda": 150.0}  # the baseline's ~15 torch calls per rank and step
EST_BASELINE_EFFICIENCY = {"cpu": 0.25, "cuda": 0.5}  # its gathers and fp32 sums against a copy
EST_OURS_EFFICIENCY = {"cpu": 1.0, "cuda": 0.8}  # our ops against a copy
EST_KERNEL_US = 10.0  # CUDA: the shortest op on the device
EST_SETUP_S = 0.2  # every point: workspace, reference, checks
EST_SETUP_S_PER_RANK = {"cpu": 0.15, "cuda": 0.02}
EST_SETUP_BYTES_PER_S = {"cpu": 4e7, "cuda": 2e9}  # seeded random inputs
EST_CAPTURE_US_PER_CALL = 20.0  # CUDA: one rank's op call captured into a graph
# Per iteration of _time_ops: the number of rank calls and of steps (SimulatedEP.run
# calls), and how many times each op's bytes move (dispatch and each combine timed
# with their partners, the two round trips).
_OURS_CALLS, _OURS_STEPS = 10, 8
_OURS_BYTES = {"dispatch": 5, "combine": 3, "combine-ws": 2}
# The baseline's measurements per iteration: dispatch, combine, a round trip (two steps).
_BASELINE_STEPS = 4


def _estimate_point_s(point: Point, ctx: "_Context", host_us: float) -> float:
    """Seconds that ``_run_point`` will take for ``point`` (0 for one it will skip
    without measuring). ``host_us``: one eager call's host wall time (CUDA)."""
    if invalid_reason(point) is not None:
        return 0.0
    dev, cuda = ctx.device.type, ctx.device.type == "cuda"
    n_sets = _num_sets(point, ctx.l2_bytes)
    if _memory_bytes(point, n_sets, cuda) > ctx.max_bytes:
        return 0.0
    ep, n = point.ep, ctx.iters + ctx.warmup
    bw = ctx.copy_gbps * 1e9
    op_bytes = op_bytes_for(point, expected_sends(point))
    ours_bytes = sum(times * op_bytes[op] for op, times in _OURS_BYTES.items())
    # The baseline gathers a row per (token, expert), not per destination, and sums in fp32.
    base_bytes = 2 * ep * point.tokens * point.preset.top_k * (point.dispatch_row_bytes + 4 * point.combine_row_bytes)
    ours_data = ours_bytes / (bw * EST_OURS_EFFICIENCY[dev])
    base_data = base_bytes / (bw * EST_BASELINE_EFFICIENCY[dev])
    base_host = _BASELINE_STEPS * ep * EST_BASELINE_RANK_STEP_US[dev] * 1e-6
    setup = (EST_SETUP_S + EST_SETUP_S_PER_RANK[dev] * ep
             + n_sets * set_bytes(point) / EST_SETUP_BYTES_PER_S[dev])
    if not cuda:
        # A thread per rank and step; the ranks' copies share the memory bandwidth.
        ours_host = _OURS_STEPS * ep * EST_THREAD_US * 1e-6
        return setup + n * (ours_host + ours_data + base_host + base_data)
    # CUDA eager: the host launches every rank's calls, the device runs them meanwhile.
    ours_device = max(_OURS_CALLS * EST_KERNEL_US * 1e-6, ours_data)
    eager = n * (max(_OURS_CALLS * ep * host_us * 1e-6, ours_device) + max(base_host, base_data))
    # Graphs: the same device time; the two multi-step graphs run STEPS_PER_GRAPH round trips a replay.
    round_trips = sum(op_bytes[op] for op in ("round-trip", "round-trip-ws")) / (bw * EST_OURS_EFFICIENCY[dev])
    graphs = n * (ours_device + STEPS_PER_GRAPH * max(2 * EST_KERNEL_US * 1e-6, round_trips) + base_data)
    captures = n_sets * ep * (_OURS_CALLS + 4 * STEPS_PER_GRAPH) * EST_CAPTURE_US_PER_CALL * 1e-6
    # Every graph measurement first spins the device while the host queues the replays.
    head_starts = (len(OPS) + 2 + 3) * min(MAX_HEAD_START_S, ctx.iters * max(HOST_ENQUEUE_S, HEAD_START_MARGIN
                                                                             * ep * host_us * 1e-6))
    return setup + eager + graphs + captures + head_starts


def _estimate_line(points: list[Point], ctx: "_Context", host_wall: dict[str, float]) -> tuple[str, float]:
    """The up-front line (points, skips, seconds) and the estimated seconds."""
    host_us = max(host_wall.values()) if host_wall else 20.0
    seconds = [_estimate_point_s(p, ctx, host_us) for p in points]
    skipped = sum(1 for t in seconds if t == 0.0)
    total = sum(seconds)
    skips = f", {skipped} to be skipped (invalid or over --max-gib)" if skipped else ""
    return (f"sweep: {len(points)} points{skips}, estimated {_duration(total)} "
            f"(rough: from the copy bandwidth above and the host cost measured before the sweep)"), total


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min"


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------


def _table(records: list[dict]) -> str:
    header = ["preset", "ep", "tok/rank", "op", "eager us", "graph us", "graph us/step", "GB/s", "x copy",
              "base eager us", "base graph us", "speedup eager", "speedup graph", "check"]
    rows = []
    for rec in records:
        name = rec["preset"] + (" fp8" if rec["fp8"] else "")
        if not rec["ops"]:
            note = "; ".join(rec["notes"])
            rows.append([name, str(rec["ep"]), str(rec["tokens_per_rank"]), "-", *["-"] * 9,
                         f"{rec['status']}: {note}" if note else rec["status"]])
            continue
        check = "ok~" if any("not bitwise" in n for n in rec["notes"]) else "ok"
        if rec["status"] != "ok":
            check = f"{rec['status']}: {'; '.join(rec['notes'])}"
        if not rec.get("baseline_ok", True):
            check += ", base FAIL"
        for op, m in rec["ops"].items():
            rows.append([
                name, str(rec["ep"]), str(rec["tokens_per_rank"]), op,
                fmt(m["eager_us"], ".1f"), fmt(m["graph_us"], ".1f"), fmt(m.get("graph_step_us"), ".1f"),
                fmt(m["GBps"], ".1f"),
                fmt(m["copy_ratio"], ".3f"), fmt(m["baseline_eager_us"], ".1f"),
                fmt(m["baseline_graph_us"], ".1f"), fmt(m["speedup_eager"], ".2f", "x"),
                fmt(m["speedup_graph"], ".2f", "x"), check,
            ])
    return format_table(header, rows, left={0, 3, len(header) - 1})  # text columns left-aligned


def _legend(device_type: str) -> str:
    """What the table's ops and columns are."""
    graph = ("graph us: per replay of a CUDA graph of the op; graph us/step: per step of a graph of many steps"
             if device_type == "cuda" else "graph columns: CUDA graphs, so '-' on the CPU")
    return ("ops: combine stages the expert outputs from a tensor of their own; combine-ws finds them in the "
            "workspace already (payload_in_workspace=True); round-trip(-ws): dispatch, then that combine. "
            f"base: the plain-PyTorch exchange of the same bytes. {graph}.")


def _summary(records: list[dict], copy_gbps: Optional[float], host: dict[str, float],
             host_wall: dict[str, float], interrupted: bool, device_type: str) -> str:
    measured = [r for r in records if r["ops"] and r["status"] == "ok"]
    failed = [r for r in records if r["status"] in ("FAIL", "error")]
    skipped = [r for r in records if r["status"] == "skipped"]
    lines = [f"summary: {len(measured)} points ok, {len(failed)} FAIL/error, {len(skipped)} skipped"
             f"{' (interrupted)' if interrupted else ''}; copy ceiling {fmt(copy_gbps, '.1f')} GB/s"]
    for op in OPS:
        rows = [(r, r["ops"][op]) for r in measured]
        if not rows:
            continue
        best_rec, best = max(rows, key=lambda rm: rm[1]["copy_ratio"])
        se = geomean([m["speedup_eager"] for _, m in rows if m["speedup_eager"]])
        sg = geomean([m["speedup_graph"] for _, m in rows if m["speedup_graph"]])
        lines.append(
            f"  {op:<13} best {best['copy_ratio']:.3f} x copy ({best['GBps']:.1f} GB/s, {best_rec['preset']} "
            f"ep {best_rec['ep']} x {best_rec['tokens_per_rank']} tok); speedup over plain PyTorch (geomean) "
            f"eager {fmt(se, '.2f', 'x')}, graph {fmt(sg, '.2f', 'x')}"
        )
    spread = [(r, r["timing_spread"]) for r in measured if r.get("timing_spread") is not None]
    if spread:
        r, worst = max(spread, key=lambda rs: rs[1])
        lines.append(f"  timing spread: interquartile range up to {100 * worst:.0f}% of the median ({r['preset']} ep "
                     f"{r['ep']} x {r['tokens_per_rank']} tok)"
                     + (f"; above {100 * BUSY_SPREAD:.0f}%: the machine was busy or the iterations too few, rerun "
                        "on an idle machine or raise --iters" if worst > BUSY_SPREAD else ""))
    if host:
        lines.append("  host cost per eager call (CPU time; wall time in brackets): "
                     + ", ".join(f"{k} {v:.1f} us ({host_wall[k]:.1f})" for k, v in host.items()))
    for r in failed:
        lines.append(f"  {r['status']}: {r['preset']} ep {r['ep']} x {r['tokens_per_rank']} tok: "
                     f"{'; '.join(r['notes'])}")
    lines += targets.single_device(records, host, device_type)
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


PROG = "python -m torch_moe_a2a bench"
SUMMARY = "dispatch/combine speed, simulated EP on one device"
DESCRIPTION = ("Dispatch/combine bandwidth and latency with simulated EP on one device (a stream per rank on CUDA, "
               "a thread per rank on the CPU), next to a plain-PyTorch implementation of the same exchange.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``bench`` (also used by ``python -m torch_moe_a2a``'s subcommand)."""
    add_preset_argument(p, default="all")
    p.add_argument("--ep", type=int_in_range(1, layout.MAX_RANKS, "ep"), nargs="+", action=DistinctValues, default=None,
                   help=f"simulated ranks, 1..{layout.MAX_RANKS} each (default {per_device(DEFAULT_EP)})")
    p.add_argument("--tokens", type=int_in_range(1, layout.MAX_NUM_TOKENS, "tokens"), nargs="+", action=DistinctValues,
                   default=None,
                   help=f"tokens per rank (default {per_device(DEFAULT_TOKENS)})")
    p.add_argument("--iters", type=int_at_least(1, "iters"), default=None,
                   help=f"timed iterations per measurement (default {per_device(DEFAULT_ITERS_FOR)}; "
                   f"--smoke {SMOKE_ITERS}; --expert-major {per_device(bench_expert_major.DEFAULT_ITERS)}; "
                   f"--training {per_device(bench_training.DEFAULT_ITERS)} steps)")
    p.add_argument("--warmup", type=int_at_least(0, "warmup"), default=None,
                   help=f"untimed iterations first (default {per_device(DEFAULT_WARMUP_FOR)}; --smoke {SMOKE_WARMUP}; "
                   f"--expert-major {per_device(bench_expert_major.DEFAULT_WARMUP)}; "
                   f"--training {per_device(bench_training.DEFAULT_WARMUP)} steps)")
    p.add_argument("--fp8", action="store_true",
                   help=f"hidden states as float8_e4m3fn plus fp32 scales per {FP8_BLOCK} elements")
    p.add_argument("--json", metavar="PATH", help="write every number (and the copy bandwidth, device, torch) here")
    p.add_argument("--plot", metavar="PATH",
                   help="write a PNG of bandwidth ratio and latency vs tokens, ours and the plain-PyTorch baseline "
                   f"(needs matplotlib: {plot.INSTALL_HINT})")
    p.add_argument("--smoke", action="store_true",
                   help=f"short run: {', '.join(SMOKE_PRESETS)}, ep {' '.join(map(str, SMOKE_EP))}, tokens "
                   f"{' '.join(map(str, SMOKE_TOKENS))}, {SMOKE_ITERS} iterations")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda if available, else cpu")
    p.add_argument("--max-gib", type=positive_float("--max-gib"), default=None,
                   help="skip points needing more memory than this (default 60 on CUDA, 4 on the CPU); the "
                   "sweep and --combine-variants")
    p.add_argument("--graph", choices=("per-rank", "all-ranks"), default="per-rank",
                   help="per-rank (default): the sweep above, one CUDA graph per rank; all-ranks (CUDA): the "
                   "latency per replay of one graph holding every rank's call of one op, next to its launch "
                   f"floor (default points: ep {' '.join(map(str, replay.GRID_EP))} x tokens "
                   f"{' '.join(map(str, replay.GRID_TOKENS))}, and "
                   f"{', '.join(f'ep {e} x {t}' for e, t in replay.LARGE_POINTS)}; "
                   f"--iters default {replay.DEFAULT_REPLAYS}, --warmup {replay.DEFAULT_WARMUP_REPLAYS})")
    p.add_argument("--peer", choices=replay.LIBRARIES[1:], default=None,
                   help="with --graph all-ranks: also time that library's moe_a2a functions (FlashInfer's) the "
                   "same way in the same run, and print the ratio per op (skipped with a note when it is not "
                   "importable)")
    p.add_argument("--combine-variants", nargs="*", choices=list(low_precision.VARIANTS), default=None,
                   metavar="VARIANT",
                   help="instead: time the combine's variants (default all: "
                   f"{', '.join(low_precision.VARIANTS)}) on the first --preset (default "
                   f"{low_precision.DEFAULT_PRESET}) at --ep (default {per_device(low_precision.DEFAULT_EP)}) and "
                   f"--tokens (default {per_device(low_precision.DEFAULT_TOKENS)}): per replay of a graph of "
                   "every rank's combine on CUDA (beside the "
                   "launch floor), eager wall time on the CPU; with the bytes they move as ratios to the copy "
                   "bandwidth, and the speed targets")
    p.add_argument("--expert-major", action="store_true",
                   help="instead: the expert-major round trip (dispatch(expert_major=True), combine_expert_major) "
                   "against the rank-major one and against the rank-major one plus the PyTorch permutation a "
                   "grouped-GEMM user writes, per replay of a graph on CUDA (beside the launch floor), eager wall "
                   f"time on the CPU, at --ep (default {per_device(bench_expert_major.DEFAULT_EP)}) and --tokens "
                   f"(default {per_device(bench_expert_major.DEFAULT_TOKENS)}), first --preset (default "
                   "deepseek-v3); ours also as a ratio to the copy bandwidth")
    p.add_argument("--training", action="store_true",
                   help="instead: the exchange's forward and backward (the differentiable dispatch and combine) "
                   "against all_to_all_single of the (token, expert) pairs under autograd, at --ep (default "
                   f"{per_device(bench_training.DEFAULT_EP)}) and --tokens (default "
                   f"{per_device(bench_training.DEFAULT_TOKENS)}), first --preset (default deepseek-v3); ours "
                   "also as a ratio to the copy bandwidth")
    p.add_argument("--router-grad", action="store_true",
                   help="with --training: the router weights require grad too, as where the routing probabilities "
                   "travel with the tokens (DeepEP, Megatron); both paths give them their gradient")
    p.add_argument("--low-precision-error", action="store_true",
                   help="instead: print the error of the e4m3 combine transports against bf16 (CPU, no timing)")


def _device_alive(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return True
    except Exception:  # noqa: BLE001 - a broken context is the answer
        return False


def main(argv: Optional[list[str]] = None) -> int:
    """``bench`` on its own: parse ``argv`` (default sys.argv[1:]) and run."""
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_arguments(parser)
    return run(parser, parser.parse_args(sys.argv[1:] if argv is None else argv))


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the benchmark; returns 0, or 1 when a point failed its correctness
    check or errored. Argument errors go through ``parser.error`` (exit 2)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: {NO_CUDA}")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    if args.plot and (why := plot.unavailable()) is not None:
        parser.error(why)  # before the run, not after it
    modes = [name for name, on in (("--expert-major", args.expert_major), ("--training", args.training),
                                   ("--combine-variants", args.combine_variants is not None),
                                   ("--low-precision-error", args.low_precision_error)) if on]
    if len(modes) > 1:
        parser.error(f"{' and '.join(modes)} are modes of their own: pick one")
    if modes and (args.fp8 or args.smoke or args.plot or args.graph != "per-rank"):
        parser.error(f"{modes[0]} takes no --fp8, --smoke, --plot or --graph")
    # Options a mode does not read are refused, not ignored: a --max-gib meant
    # to keep a run within memory, or a --json file never written.
    if args.router_grad and not args.training:
        parser.error("--router-grad is an option of --training")
    if args.max_gib is not None and (args.expert_major or args.training or args.graph == "all-ranks"):
        parser.error(f"{modes[0] if modes else '--graph all-ranks'} takes no --max-gib: it skips no point by its "
                     "memory (pick smaller --ep and --tokens)")
    if args.low_precision_error:
        given = [flag for flag, value in (("--ep", args.ep), ("--tokens", args.tokens), ("--iters", args.iters),
                                          ("--warmup", args.warmup), ("--preset", args.preset),
                                          ("--json", args.json), ("--max-gib", args.max_gib)) if value is not None]
        if given:
            parser.error(f"--low-precision-error prints a fixed table: it takes no {', '.join(given)}")
    if args.smoke and (args.ep is not None or args.tokens is not None or args.preset is not None):
        parser.error("--smoke runs its own points: it takes no --ep, --tokens or --preset")  # they were ignored
    if args.peer and args.graph != "all-ranks":
        parser.error("--peer needs --graph all-ranks")
    one_preset = modes[0] if modes else "--graph all-ranks" if args.graph == "all-ranks" else None
    if one_preset is not None and len(preset_names(args.preset, default=[])) > 1:
        parser.error(f"{one_preset} measures one preset, got --preset {' '.join(args.preset)}")
    if args.graph == "all-ranks":
        if device.type != "cuda":
            parser.error("--graph all-ranks needs CUDA")
        if args.plot or args.smoke or args.fp8:
            parser.error("--graph all-ranks takes no --plot, --smoke or --fp8")
        check_output_path(parser, "--json", args.json)
        return replay.run(args)
    check_output_path(parser, "--json", args.json)
    check_output_path(parser, "--plot", args.plot)
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        # Checked before the run: matplotlib would pick the format from the
        # name after it (a traceback for '.txt', a '.png' added to a bare name).
        parser.error(f"--plot {args.plot}: the plot is a PNG; give a path ending in .png")
    if args.low_precision_error:
        print(low_precision.error_table(), flush=True)
        return 0
    if args.expert_major or args.training:
        preset = preset_names(args.preset, default=["deepseek-v3"])[0]
        # A stop signal ends the run between two points, as the sweep's (below).
        with StopSignals() as stop:
            if args.expert_major:
                records, facts = bench_expert_major.run(device, args.ep, args.tokens, args.iters, args.warmup, preset,
                                                        stop=stop)
            else:
                records, facts = bench_training.run(device, args.ep, args.tokens, args.iters, args.warmup, preset,
                                                    args.router_grad, stop=stop)
        return _mode_end(args, device, stop, records, facts, all(r["status"] == "ok" for r in records))
    if args.combine_variants is not None:
        # A stop signal ends the run between two points, as the sweep's (below).
        with StopSignals() as stop:
            records, facts = low_precision.run_variants(
                device, list(low_precision.DEFAULT_EP[device.type]) if args.ep is None else args.ep,
                list(low_precision.DEFAULT_TOKENS[device.type]) if args.tokens is None else args.tokens,
                DEFAULT_ITERS_FOR[device.type] if args.iters is None else args.iters,
                DEFAULT_WARMUP_FOR[device.type] if args.warmup is None else args.warmup,
                args.combine_variants or None,
                preset=preset_names(args.preset, default=[low_precision.DEFAULT_PRESET])[0], max_gib=args.max_gib,
                stop=stop)
        return _mode_end(args, device, stop, records, facts, all(r["check"] == "ok" for r in records))
    if args.smoke:
        names, eps, tokens = list(SMOKE_PRESETS), list(SMOKE_EP), list(SMOKE_TOKENS)
        iters = SMOKE_ITERS if args.iters is None else args.iters
        warmup = SMOKE_WARMUP if args.warmup is None else args.warmup
    else:
        names = preset_names(args.preset, default=list(PRESETS))
        eps = list(DEFAULT_EP[device.type]) if args.ep is None else args.ep
        tokens = list(DEFAULT_TOKENS[device.type]) if args.tokens is None else args.tokens
        iters = DEFAULT_ITERS_FOR[device.type] if args.iters is None else args.iters
        warmup = DEFAULT_WARMUP_FOR[device.type] if args.warmup is None else args.warmup
    max_gib = DEFAULT_MAX_GIB[device.type] if args.max_gib is None else args.max_gib
    points = [Point(PRESETS[n], e, t, args.fp8) for n in names for e in eps for t in tokens]
    started_at = datetime.datetime.now().astimezone()

    clock = Clock(device)
    l2 = l2_bytes(device)
    steps = "a CUDA stream per rank" if device.type == "cuda" else "a thread per rank"
    print(f"torch-moe-a2a bench: {device_name(device)}, torch {torch.__version__}; simulated EP ({steps}); "
          f"median of {iters} iterations after {warmup}", flush=True)
    copy_bytes = min(COPY_BYTES[device.type], int(max_gib * GIB) // 4)
    copy_gbps: Optional[float] = None
    host: dict[str, float] = {}
    host_wall: dict[str, float] = {}
    records: list[dict] = []
    progress: Optional[Progress] = None
    estimate_s = 0.0
    sweep_start = time.perf_counter()
    # SIGINT and SIGTERM stop the run between two steps; what was measured by
    # then is reported as usual (table, summary, --json, --plot), and the exit
    # code says which signal stopped it.
    with StopSignals() as stop:
        with stop.ends_sweep():
            try:
                copy_gbps = report_copy_ceiling(clock, device, copy_bytes)
                stop.check()
                # The progress display starts with the sweep; the host cost and the estimate come first.
                ctx = _Context(device, clock, iters, warmup, int(max_gib * GIB), l2, copy_gbps, QuietProgress(),
                               graphs=device.type == "cuda", stop=stop.check)
                try:
                    host, host_wall = _host_cost(PRESETS[names[0]], args.fp8, device, clock, stop.check)
                except Exception as e:  # noqa: BLE001 - reported; the sweep still runs
                    print(f"host cost: {type(e).__name__}: {first_line(e)}", flush=True)
                line, estimate_s = _estimate_line(points, ctx, host_wall)
                print(line, flush=True)
                ctx.progress = progress = Progress(len(points))
                sweep_start = time.perf_counter()
                for point in points:
                    stop.check()
                    started = time.perf_counter()
                    try:
                        record = _run_point(point, ctx)
                    except Exception as e:  # noqa: BLE001 - one broken point must not hide the others
                        record = new_record(point)
                        record.update(status="error", notes=[f"{type(e).__name__}: {first_line(e)}"], ops={})
                    # What the next run's estimate can be checked against.
                    record["wall_s"] = time.perf_counter() - started
                    records.append(record)
                    progress.step(point.label())
                    _release_quietly(device)
                    if not _device_alive(device):
                        record["notes"].append("the CUDA context is broken; the sweep stops here")
                        break
            finally:
                if progress is not None:
                    progress.close()
        sweep_s = time.perf_counter() - sweep_start
        interrupted = stop.signum is not None

        # Table, then summary, in every mode: the summary (and its targets) is the last thing on the screen.
        summary = _summary(records, copy_gbps, host, host_wall, interrupted, device.type)
        summary += f"\n  time: {_duration(sweep_s)} for {len(records)} of {len(points)} points (estimated " \
                   f"{_duration(estimate_s)} for all)"
        stopped = stopped_line(stop, len(points), len(records))
        if stopped:
            summary += f"\n  {stopped}"
        print(_table(records))
        print(_legend(device.type))
        print()
        print(summary)
        sys.stdout.flush()

        data = {
            "device": device_name(device), "device_type": device.type, "torch": torch.__version__,
            "date": started_at.isoformat(timespec="seconds"),
            "copy_bandwidth_GBps": copy_gbps, "copy_bytes": copy_bytes, "l2_bytes": l2,
            "iters": iters, "warmup": warmup, "fp8": args.fp8, "max_gib": max_gib,
            "host_cost_us": host, "host_wall_us": host_wall, "interrupted": interrupted,
            "stopped_by": signal.Signals(stop.signum).name if interrupted else None,
            "points_planned": len(points), "sweep_s": sweep_s, "estimated_sweep_s": estimate_s,
            "points": records, "targets": targets.single_device(records, host, device.type),
        }
        if args.json:
            write_json(args.json, data)
        if args.plot:
            plot.plot(data, args.plot)
            print(f"plot: {os.path.abspath(args.plot)}")
    if interrupted:
        return stop.exit_code
    failed = any(r["status"] in ("FAIL", "error") for r in records)
    return 1 if failed else 0


def _mode_end(args: argparse.Namespace, device: torch.device, stop: StopSignals, records: list[dict], facts: dict,
              ok: bool) -> int:
    """The end of a mode of its own (--expert-major, --training,
    --combine-variants): its --json (the run's facts, whether a signal
    stopped it, the records), then its exit code: the signal's, else 1 where
    a point failed."""
    interrupted = stop.signum is not None
    if args.json:
        write_json(args.json, {"device": device_name(device), "torch": torch.__version__, **facts,
                               "interrupted": interrupted,
                               "stopped_by": signal.Signals(stop.signum).name if interrupted else None,
                               "records": records})
    if interrupted:
        return stop.exit_code
    return 0 if ok else 1


def _release_quietly(device: torch.device) -> None:
    try:
        release(device)
    except Exception:  # noqa: BLE001 - _device_alive reports a broken context next
        pass
