"""``python -m torch_moe_a2a bench --expert-major``: the expert-major round trip
against the two things a grouped-GEMM user would run without it
(docs/DESIGN.md section 8), in the same run.

For every point (ep simulated ranks, T tokens per rank, the preset's
payloads: hidden states, int32 expert ids, fp32 router weights), three
round trips whose experts are the identity (each returns its input rows, so
only the exchange and its regrouping are timed):

- ours: ``moe_a2a_dispatch(expert_major=True, router_weights=...)`` then
  ``moe_a2a_combine_expert_major`` of the dispatch's own expert-major plane
  (the combine stages its valid rows, as it would a grouped GEMM's output);
- rank-major: the rank-major dispatch of the same payloads, then the staged
  combine of the received rows, in a tensor of their own as an expert's
  output would be (``bench --graph all-ranks``' round trip);
- baseline: the rank-major dispatch, then on every rank the permutation a
  user writes in PyTorch for a grouped GEMM without host syncs (so that it
  can live in a CUDA graph): the received (row, top-k slot) pairs of local
  experts (padding rows and other ranks' experts masked) ordered by expert
  with a stable sort over all ``ep * T * top_k`` pair slots, their rows
  gathered in that order (the grouped GEMM's input), then per received row
  the weighted sum of its pairs' outputs in fp32 (a gather per top-k slot),
  cast into the ``[ep, T, H]`` combine payload; then the rank-major combine.

Time: on CUDA per replay of one graph holding every rank's round trip
(bench/replay.py's method, with the launch floor of two empty kernels per
rank beside it); on the CPU each round trip's wall time (eager). The median
of ``--iters`` after ``--warmup``.

Ratios (the targets of docs/performance.md): ours / rank-major, the price of
the layout over the bare exchange (at most 1.25x; 1.15x from 4096 tokens),
and baseline / ours, what the layout saves over doing it by hand (above 1x).
Ours is also given as a ratio to the device's copy bandwidth measured in the
same run (bytes read + written by one large copy): the bytes of the
expert-major byte model (docs/DESIGN.md section 8, round_trip_bytes) per
second over that ceiling.

Check: ours against the reference bitwise; the baseline within bf16
rounding of ours (it rounds each rank's partial sum to bf16 before the
combine adds them).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .. import layout
from ..api import moe_a2a_dispatch, moe_a2a_get_workspace_size_per_rank
from ..expert_major import (
    moe_a2a_combine_expert_major,
    moe_a2a_get_dropped_pair_count,
    moe_a2a_get_workspace_size_per_rank_expert_major,
)
from ..reference import reference_combine_expert_major, reference_dispatch_expert_major
from ..simulate import SimulatedEP
from .common import (
    COMBINE_ATOL,
    COMBINE_RTOL,
    COPY_BYTES,
    SEED,
    Clock,
    Point,
    StopSignals,
    capture_graph,
    copy_ratio,
    expert_owner,
    fmt,
    format_table,
    geomean,
    make_set,
    release,
    report_copy_ceiling,
    stopped_line,
    sweep,
    wall_us,
)

DEFAULT_EP = {"cuda": (1, 4, 8), "cpu": (1, 2)}
DEFAULT_TOKENS = {"cuda": (1, 16, 64, 128), "cpu": (1, 16)}
DEFAULT_ITERS = {"cuda": 30, "cpu": 5}
DEFAULT_WARMUP = {"cuda": 5, "cpu": 1}
# Targets: ours at most this many times the rank-major round trip (the
# second from LARGE_TOKENS tokens per rank on), and faster than the baseline.
MAX_OVER_RANK_MAJOR = 1.25
MAX_OVER_RANK_MAJOR_LARGE = 1.15
LARGE_TOKENS = 4096
ROUND_TRIPS = ("ours", "rank_major", "baseline")
# An expert-major plane of the worst case (every pair of every rank at one
# expert: ep * T rows per expert) larger than this many bytes per rank would
# not fit beside the other ranks' on one device; such a point bounds the rows
# per expert at CAPACITY_FACTOR times the mean instead, as a prefill
# deployment does (pairs beyond it would be dropped and reported).
MAX_WORST_CASE_PLANE_BYTES = 2 << 30
# A router weight (fp32), which the combine reads per pair.
WEIGHT_BYTES = 4
CAPACITY_FACTOR = 2.0


def rows_per_expert(point: Point) -> int:
    """The expert-major planes' rows per expert at ``point`` (max_tokens_per_expert)."""
    p, ep, T = point.preset, point.ep, point.tokens
    local = layout.max_local_experts(p.num_experts, ep)
    worst = ep * T
    if local * worst * p.hidden * p.dtype.itemsize <= MAX_WORST_CASE_PLANE_BYTES:
        return worst
    return min(worst, math.ceil(CAPACITY_FACTOR * ep * T * p.top_k / p.num_experts))


def round_trip_bytes(point: Point, sends: int, pairs: int) -> int:
    """Bytes the expert-major round trip moves, summed over ranks, by the byte
    model of docs/DESIGN.md section 8.

    Args:
        point: the ranks, tokens per rank and the preset's rows.
        sends: (token, distinct destination rank) pairs of all ranks.
        pairs: (token, expert) pairs kept at their experts' ranks.

    Returns:
        The dispatch's (each row of hidden state, ids and weights read once and
        written once per destination), the build's (each received row read,
        each pair's row written), the combine's (a row and a weight read per
        pair, a row written per token) and the staging's (each pair's row read
        and written: the round trip's combine is not in place) bytes, added up.
    """
    drow, crow = point.dispatch_row_bytes, point.combine_row_bytes
    tokens = point.ep * point.tokens
    dispatch = drow * (tokens + sends)
    build = drow * sends + crow * pairs
    combine = (crow + WEIGHT_BYTES) * pairs + crow * tokens
    staging = 2 * crow * pairs
    return dispatch + build + combine + staging


class ExpertMajorPoint:
    """The three round trips of one point, every rank's buffers allocated up front."""

    def __init__(self, point: Point, device: torch.device):
        self.point, self.device = point, device
        p, ep, T = point.preset, point.ep, point.tokens
        gen_cpu = torch.Generator().manual_seed(SEED)
        gen_dev = torch.Generator(device=device).manual_seed(SEED)
        self.set = make_set(point, device, gen_cpu, gen_dev, expert_owner(p.num_experts, ep))
        hidden_row = p.hidden * p.dtype.itemsize
        self.max_tokens_per_expert = rows_per_expert(point)
        size = max(
            moe_a2a_get_workspace_size_per_rank_expert_major(ep, T, hidden_row, hidden_row, p.num_experts, p.top_k,
                                                             max_tokens_per_expert=self.max_tokens_per_expert),
            moe_a2a_get_workspace_size_per_rank(ep, T, point.dispatch_row_bytes, point.combine_row_bytes),
        )
        self.sim = SimulatedEP(ep, T, dispatch_bytes_per_token=0, combine_bytes_per_token=0, device=device,
                               workspace_size_per_rank=size)
        self.ranges = [layout.expert_range(p.num_experts, ep, r) for r in range(ep)]
        self.payloads = [torch.empty((ep, T, p.hidden), dtype=p.dtype, device=device) for _ in range(ep)]
        # The rank-major round trip's expert outputs, a tensor of their own per
        # rank as a GEMM's would be (a receive view given to the combine would
        # have its own rows staged too): the received rows, copied in check().
        self.expert_rows = [torch.empty((ep, T, p.hidden), dtype=p.dtype, device=device) for _ in range(ep)]
        self.outputs = {name: [torch.empty((T, p.hidden), dtype=p.dtype, device=device) for _ in range(ep)]
                        for name in ROUND_TRIPS}
        self.dispatched: list[Any] = [None] * ep
        self.received: list[Any] = [None] * ep
        self.offsets: list[int] = [0] * ep
        # The baseline's index tensors, allocated up front: the flat pair slots
        # [ep * T * top_k] and the token index of a received row.
        self.pair_index = torch.arange(ep * T * p.top_k, device=device)
        self.row_index = torch.arange(T, device=device)
        # False once the baseline ran out of device memory (its gathers of every
        # pair slot: 3.5 GiB a rank at ep 8 x 4096 with DeepSeek-V3): the point
        # then measures the other two.
        self.baseline_fits = True

    # ---- the round trips' steps, one rank each ----
    def ours_dispatch(self, r: int) -> None:
        p, T, s = self.point.preset, self.point.tokens, self.set
        self.dispatched[r] = moe_a2a_dispatch(
            s.ids[r], [s.payloads[r][0]], self.sim.workspace, self.sim.metainfo[r], T, r, self.point.ep, p.top_k,
            p.num_experts, expert_major=True, router_weights=s.payloads[r][2],
            max_tokens_per_expert=self.max_tokens_per_expert)

    def ours_combine(self, r: int) -> None:
        dispatched = self.dispatched[r]  # the identity expert: its own plane is the experts' output
        moe_a2a_combine_expert_major(dispatched.output_payloads[0], dispatched, self.sim.workspace,
                                     self.sim.metainfo[r], r, self.point.ep, output=self.outputs["ours"][r])

    def rank_major_dispatch(self, r: int) -> None:
        p, T, s = self.point.preset, self.point.tokens, self.set
        views, offset, _ = self.sim.dispatch_rank(r, s.ids[r], s.payloads[r], T, p.top_k, p.num_experts)
        self.received[r], self.offsets[r] = views, offset

    def _rank_major_combine(self, r: int, payload: Tensor, output: Tensor) -> None:
        p, T = self.point.preset, self.point.tokens
        self.sim.combine_rank(r, payload, T, T, p.top_k, self.offsets[r], output=output)

    def rank_major_combine(self, r: int) -> None:
        self._rank_major_combine(r, self.expert_rows[r], self.outputs["rank_major"][r])

    def permute(self, r: int) -> None:
        """What a user writes between the rank-major dispatch and combine to feed a grouped GEMM, graph-safe."""
        p, ep, T, K = self.point.preset, self.point.ep, self.point.tokens, self.point.preset.top_k
        hidden, ids, weights = self.received[r]
        counts = self.sim.recv_counts(r)
        lo, hi = self.ranges[r]
        valid = (self.row_index.unsqueeze(0) < counts.unsqueeze(1)).unsqueeze(-1)  # [ep, T, 1]
        local = valid & (ids >= lo) & (ids < hi)
        key = torch.where(local, ids - lo, hi - lo).reshape(-1)  # other slots: after every expert
        order = torch.argsort(key, stable=True)
        grouped = hidden.reshape(ep * T, p.hidden)[self.pair_index[order] // K]  # rows by expert: the GEMM's input
        expert_out = grouped  # the identity expert
        # Back per received row: the grouped position of each (row, slot), its weight (0: not a local pair).
        position = torch.empty_like(order).scatter_(0, order, self.pair_index).view(ep * T, K)
        w = torch.where(local, weights, 0.0).view(ep * T, K)
        summed = torch.zeros((ep * T, p.hidden), dtype=torch.float32, device=hidden.device)
        for k in range(K):
            summed += expert_out[position[:, k]].float() * w[:, k:k + 1]
        self.payloads[r].copy_(summed.view(ep, T, p.hidden))

    def baseline_combine(self, r: int) -> None:
        self._rank_major_combine(r, self.payloads[r], self.outputs["baseline"][r])

    def steps(self, name: str) -> list[Callable[[int], None]]:
        """Round trip ``name``'s steps of one rank, in order."""
        if name == "ours":
            return [self.ours_dispatch, self.ours_combine]
        if name == "rank_major":
            return [self.rank_major_dispatch, self.rank_major_combine]
        return [self.rank_major_dispatch, self.permute, self.baseline_combine]

    def run(self, name: str) -> list[Tensor]:
        """Every rank's round trip ``name`` eagerly, step by step over all ranks:
        nothing allocates while a peer's kernel spins (SimulatedEP's rule)."""
        for step in self.steps(name):
            self.sim.run(step)
        return self.outputs[name]

    def graph(self, name: str) -> Any:
        """One CUDA graph of every rank's round trip ``name`` (a branch per rank)."""
        steps = self.steps(name)

        def rank(r: int) -> None:
            for step in steps:
                step(r)

        return capture_graph(lambda: self.sim.run(rank))[0]

    # ---- checks ----
    def check(self) -> Optional[str]:
        point, s = self.point, self.set
        ref = reference_dispatch_expert_major([i.cpu() for i in s.ids], [[s.payloads[r][0].cpu()] for r in range(point.ep)],
                                              [s.payloads[r][2].cpu() for r in range(point.ep)], ep_size=point.ep,
                                              num_experts=point.preset.num_experts,
                                              max_tokens_per_expert=self.max_tokens_per_expert)
        expected = reference_combine_expert_major([planes[0] for planes in ref.planes], ref)
        ours = [o.cpu() for o in self.run("ours")]
        for r in range(point.ep):
            if not torch.equal(ours[r].view(torch.uint8), expected[r].view(torch.uint8)):
                return f"ours, rank {r}: differs from the reference"
        if self.baseline_fits:
            try:
                base = [o.cpu() for o in self.run("baseline")]
            except torch.OutOfMemoryError:
                # After every rank's dispatch: the combine closes that round.
                self.baseline_fits = False
                release(self.device)
                self.sim.run(self.baseline_combine)
            else:
                for r in range(point.ep):
                    if not torch.allclose(base[r].float(), ours[r].float(), rtol=COMBINE_RTOL, atol=COMBINE_ATOL):
                        return f"baseline, rank {r}: differs from ours beyond bf16 rounding"
        self.sim.run(self.rank_major_dispatch)
        for r in range(point.ep):
            self.expert_rows[r].copy_(self.received[r][0])
        self.sim.run(self.rank_major_combine)
        dropped = sum(int(moe_a2a_get_dropped_pair_count(self.sim.workspace, self.sim.metainfo[r], r))
                      for r in range(point.ep))
        return None if dropped == 0 else f"ours: {dropped} pairs dropped beyond {self.max_tokens_per_expert} per expert"


def run_point(point: Point, device: torch.device, warmup: int, iters: int) -> dict:
    """One point: the three round trips in microseconds (CUDA: per replay, and the floor)."""
    from . import replay

    em = ExpertMajorPoint(point, device)
    error = em.check()
    if error is not None:
        return {"status": "FAIL", "notes": [error]}
    clock = Clock(device)
    sends = int(em.set.destinations.sum())
    pairs = sum(int((ids >= 0).sum()) for ids in em.set.ids)  # every one kept: check() counted no drop
    result: dict[str, Any] = {"status": "ok", "notes": [], "ours_bytes": round_trip_bytes(point, sends, pairs)}
    if em.max_tokens_per_expert < point.ep * point.tokens:
        result["notes"].append(f"{em.max_tokens_per_expert} rows per expert ({CAPACITY_FACTOR:g}x the mean)")
    if device.type != "cuda":
        for name in ROUND_TRIPS:
            result[f"{name}_us"] = wall_us(clock, lambda: em.run(name), warmup, iters)
        return result

    # One graph at a time, given back before the next is captured: each keeps a
    # memory pool of its own. The baseline's last, which may not fit where its
    # eager run did (capturing runs nothing on the workspace).
    for name in [n for n in ROUND_TRIPS if em.baseline_fits or n != "baseline"]:
        try:
            graph = em.graph(name)
        except torch.OutOfMemoryError:
            if name != "baseline":
                raise
            em.baseline_fits = False
            release(device)
            continue
        result[f"{name}_us"] = replay.time_replays(clock, graph, warmup, iters)
        del graph
        release(device)
    if not em.baseline_fits:
        result["notes"].append("baseline: out of device memory, not measured")
    floor = capture_graph(lambda: em.sim.run(lambda r: (replay.empty_kernel(), replay.empty_kernel())))[0]
    result["floor_us"] = replay.time_replays(clock, floor, warmup, iters)
    # The replays left the last round trip's outputs: still the reference's.
    clock.sync()
    error = em.check()
    if error is not None:
        return {**result, "status": "FAIL", "notes": [f"after the replays: {error}"]}
    return result


def ratios(rec: dict) -> tuple[Optional[float], Optional[float]]:
    """(ours / rank-major, baseline / ours) of one record, None where not measured."""
    ours, rank_major, base = rec.get("ours_us"), rec.get("rank_major_us"), rec.get("baseline_us")
    over = None if ours is None or rank_major is None else ours / rank_major
    saved = None if ours is None or base is None else base / ours
    return over, saved


def run(device: torch.device, eps: Optional[list[int]], tokens: Optional[list[int]], iters: Optional[int],
        warmup: Optional[int], preset: str = "deepseek-v3",
        stop: Optional[StopSignals] = None) -> tuple[list[dict], dict]:
    """Every point of eps x tokens (``stop``: as :func:`sweep`'s); prints the
    table and the targets; returns the records and the run's facts for
    --json (copy bandwidth, iterations, warmup, preset)."""
    kind = device.type
    eps = list(DEFAULT_EP[kind]) if eps is None else eps
    tokens = list(DEFAULT_TOKENS[kind]) if tokens is None else tokens
    iters = DEFAULT_ITERS[kind] if iters is None else iters
    warmup = DEFAULT_WARMUP[kind] if warmup is None else warmup
    method = ("per replay of a graph of every rank's round trip" if kind == "cuda"
              else "eager wall time (no launch floor on the CPU)")
    print(f"expert-major round trip against rank-major, and against rank-major + a graph-safe PyTorch permutation: "
          f"{preset}, identity experts, {method}, median of {iters} after {warmup}", flush=True)
    # The ceiling of the ratio column, measured in this run.
    copy_gbps = report_copy_ceiling(Clock(device), device, COPY_BYTES[kind])
    def measure(point: Point) -> dict:
        try:
            return run_point(point, device, warmup, iters)
        finally:
            # The point's graphs and buffers go now, not in a garbage collection
            # between two ranks' launches of the next point: freeing device memory
            # synchronizes the device, and a rank's kernel launched before it
            # would wait for peers launched after it.
            release(device)

    records = sweep(eps, tokens, preset, measure, stop)
    # Each ratio where it was measured (a point whose baseline ran out of
    # memory still has ours / rank-major).
    rows, over_held, saved_held, over_all, saved_all = [], 0, 0, [], []
    for rec in records:
        over, saved = ratios(rec)
        rec["ours_copy_ratio"] = copy_ratio(rec, copy_gbps)  # for --json, beside the bytes and the time
        limit = MAX_OVER_RANK_MAJOR_LARGE if rec["tokens"] >= LARGE_TOKENS else MAX_OVER_RANK_MAJOR
        if over is not None:
            over_all.append(over)
            over_held += over <= limit
        if saved is not None:
            saved_all.append(saved)
            saved_held += saved > 1.0
        rows.append([str(rec["ep"]), str(rec["tokens"]), rec["status"], fmt(rec.get("floor_us"), ".1f"),
                     fmt(rec.get("ours_us"), ".1f"), fmt(rec.get("rank_major_us"), ".1f"),
                     fmt(rec.get("baseline_us"), ".1f"), fmt(over, ".2f", "x"), fmt(saved, ".2f", "x"),
                     fmt(rec["ours_copy_ratio"], ".3f"), "; ".join(rec["notes"])])
    print(format_table(["ep", "T", "status", "floor us", "ours us", "rank-major us", "baseline us",
                        "ours / rank-major", "baseline / ours", "ours x copy", "notes"], rows, left={2, 10}))
    if over_all:
        print(f"target ours / rank-major <= {MAX_OVER_RANK_MAJOR}x (<= {MAX_OVER_RANK_MAJOR_LARGE}x from "
              f"{LARGE_TOKENS} tokens): held at {over_held} of {len(over_all)} points; geomean "
              f"{geomean(over_all):.2f}x")
    if saved_all:
        print(f"target baseline / ours > 1x: held at {saved_held} of {len(saved_all)} points; geomean "
              f"{geomean(saved_all):.2f}x")
    stopped = stopped_line(stop, len(eps) * len(tokens), len(records))
    if stopped:
        print(stopped)
    return records, {"copy_bandwidth_GBps": copy_gbps, "iters": iters, "warmup": warmup, "preset": preset}
