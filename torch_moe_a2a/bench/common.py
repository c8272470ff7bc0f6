"""What the single-device and the distributed benchmark share: the model
shapes and points, the inputs and their byte counts, the clock and the
CUDA-graph replays, the correctness comparisons, and the output (progress,
tables, JSON, stop signals).

Every name here is public to the other modules of ``torch_moe_a2a.bench``;
this module imports only public names of the rest of ``torch_moe_a2a``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from .. import layout
from ..reference import random_routing

# ---------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """The MoE layer shape that decides what dispatch and combine move."""

    name: str
    hidden: int
    num_experts: int
    top_k: int
    dtype: torch.dtype = torch.bfloat16  # hidden states and expert outputs


PRESETS = {
    p.name: p
    for p in (
        Preset("deepseek-v3", 7168, 256, 8),
        Preset("qwen3-235b", 4096, 128, 8),
        Preset("gpt-oss-120b", 2880, 128, 4),
        Preset("mixtral", 4096, 8, 2),
    )
}
DEFAULT_ITERS = 100
DEFAULT_WARMUP = 10
# --max-gib default per device type: the memory a point may need.
DEFAULT_MAX_GIB = {"cuda": 60.0, "cpu": 4.0}
GIB = 1 << 30
MIB = 1 << 20

OPS = ("dispatch", "combine", "combine-ws", "round-trip", "round-trip-ws")
# The baseline has one combine; both of our combine variants are compared with it.
BASELINE_OF = {"dispatch": "dispatch", "combine": "combine", "combine-ws": "combine", "round-trip": "round-trip",
               "round-trip-ws": "round-trip"}

FP8_DTYPE = torch.float8_e4m3fn
FP8_BLOCK = 128  # elements per fp32 scale of the fp8 hidden states

SEED = 0
# Input sets: together at least L2_ROTATE_FACTOR x the L2 cache, MIN..MAX sets
# when one set is smaller than that (one set when it is larger on its own).
L2_BYTES_DEFAULT = 60 * 10**6  # H200; used when the device does not report its L2 size, and on the CPU
L2_ROTATE_FACTOR = 2
MIN_SETS = 3
MAX_SETS = 8

# Combine results may differ from the reference by rounding only if the sum
# order differs (ours should be bitwise equal; the baseline's index_add_ is
# not ordered): torch.testing's bf16 tolerances.
COMBINE_RTOL = 1.6e-2
COMBINE_ATOL = 1e-5

# Device copy bandwidth (the ceiling): a copy_ of COPY_BYTES (read once, written once).
COPY_BYTES = {"cuda": 2 * GIB, "cpu": 256 * MIB}
COPY_WARMUP = 2
COPY_REPEATS = 10

# Clock.head_start calibrates the spin kernel's clock rate on this many cycles.
SLEEP_CALIBRATION_CYCLES = 10**7


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Point:
    """One measured configuration: ``ep`` ranks with ``tokens`` tokens each."""

    preset: Preset
    ep: int
    tokens: int
    fp8: bool

    def payload_rows(self) -> list[tuple[str, torch.dtype, int]]:
        """``(name, dtype, elements per row)`` of each dispatch payload, in dispatch order."""
        p = self.preset
        rows = [("hidden", FP8_DTYPE if self.fp8 else p.dtype, p.hidden)]
        if self.fp8:
            rows.append(("scales", torch.float32, ceil_div(p.hidden, FP8_BLOCK)))
        rows += [("expert_ids", torch.int32, p.top_k), ("weights", torch.float32, p.top_k)]
        return rows

    def row_bytes(self) -> list[int]:
        return [dtype.itemsize * elems for _, dtype, elems in self.payload_rows()]

    @property
    def dispatch_row_bytes(self) -> int:
        return sum(self.row_bytes())

    @property
    def combine_row_bytes(self) -> int:
        return self.preset.hidden * self.preset.dtype.itemsize

    @property
    def expert_rows(self) -> int:
        """Rows of the expert outputs of all ranks: ``[dest][src][T]``."""
        return self.ep * self.ep * self.tokens

    def label(self) -> str:
        return f"{self.preset.name}{' fp8' if self.fp8 else ''} ep {self.ep} x {self.tokens} tok"


def invalid_reason(point: Point) -> Optional[str]:
    """Why the kernels refuse this point (the layout's limits), or None."""
    p = point.preset
    if not 1 <= point.ep <= layout.MAX_RANKS:
        return f"ep {point.ep} outside [1, {layout.MAX_RANKS}]"
    if p.num_experts < point.ep:
        return f"{p.num_experts} experts < ep {point.ep}"
    if not 1 <= point.tokens <= layout.MAX_NUM_TOKENS:
        return f"tokens {point.tokens} outside [1, {layout.MAX_NUM_TOKENS}]"
    if p.top_k > min(p.num_experts, layout.MAX_TOP_K):
        return f"top_k {p.top_k} > min(num_experts, {layout.MAX_TOP_K})"
    return None


def set_bytes(point: Point) -> int:
    """Bytes of one input set: every rank's dispatch payloads and expert outputs."""
    return point.ep * point.tokens * point.dispatch_row_bytes + (point.expert_rows + 1) * point.combine_row_bytes


def num_sets_for(one_set_bytes: int, l2_bytes: int) -> int:
    """Input sets of ``one_set_bytes`` each that together exceed L2_ROTATE_FACTOR x the L2 cache."""
    target = L2_ROTATE_FACTOR * l2_bytes
    if one_set_bytes >= target:
        return 1
    return min(MAX_SETS, max(MIN_SETS, ceil_div(target, one_set_bytes)))


def l2_bytes(device: torch.device) -> int:
    """The L2 cache the input sets must overflow (the default where the device does not say, and on the CPU)."""
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or L2_BYTES_DEFAULT
    return L2_BYTES_DEFAULT


def new_record(point: Point) -> dict:
    """The JSON record of one point before it is measured."""
    p = point.preset
    return {
        "preset": p.name, "ep": point.ep, "tokens_per_rank": point.tokens, "hidden": p.hidden,
        "num_experts": p.num_experts, "top_k": p.top_k, "fp8": point.fp8, "status": "ok", "notes": [], "ops": {},
    }


# ---------------------------------------------------------------------------
# timing and CUDA graphs
# ---------------------------------------------------------------------------


class Clock:
    """Time marks on the current stream (CUDA events) or on the host (CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._cycles_per_s: Optional[float] = None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_us(self, marks: list[tuple[Any, Any]]) -> list[float]:
        """Microseconds between each pair of marks (waits for the device)."""
        self.sync()
        if self.cuda:
            return [start.elapsed_time(end) * 1e3 for start, end in marks]
        return [(end - start) * 1e6 for start, end in marks]

    def head_start(self, seconds: float) -> None:
        """CUDA: keep the current stream busy for about ``seconds`` (a spin kernel).

        torch.cuda._sleep is torch's own spin kernel (private to torch, not to
        this package): the one way to occupy the stream without a kernel of our own.
        """
        if not self.cuda or seconds <= 0:
            return
        if self._cycles_per_s is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(SLEEP_CALIBRATION_CYCLES)
            end.record()
            end.synchronize()
            self._cycles_per_s = SLEEP_CALIBRATION_CYCLES / (start.elapsed_time(end) * 1e-3)
        torch.cuda._sleep(int(seconds * self._cycles_per_s))


def time_ops(measure: Callable[..., float], steps: Any, **options: Any) -> dict[str, float]:
    """The median of every op in OPS, timed by ``measure(timed, before=, after=,
    **options)`` in OPS order; ``steps`` has a method per op that runs one step
    of input set i (``single._Ours``, ``distributed._OursRank``, or their
    ``OpGraphs``). Dispatch and combine must alternate, so dispatch is timed
    with an untimed combine after it and each combine with an untimed
    dispatch before it."""
    return {
        "dispatch": measure(steps.dispatch, after=steps.combine, **options),
        "combine": measure(steps.combine, before=steps.dispatch, **options),
        "combine-ws": measure(steps.combine_ws, before=steps.dispatch, **options),
        "round-trip": measure(steps.round_trip, **options),
        "round-trip-ws": measure(steps.round_trip_ws, **options),
    }


_graph_roots: dict[torch.device, Tensor] = {}


def capture_graph(step: Callable[[], Any]) -> tuple["torch.cuda.CUDAGraph", Any]:
    """One CUDA graph of ``step()`` and what ``step()`` returned (tensors the replays rewrite):
    the plain-PyTorch baseline's graphs (its ranks never wait for each other) and
    ``bench --graph all-ranks``'s graphs of every rank's call of one op.

    The rank streams fork from and join into the capture stream (SimulatedEP.run).
    The graph starts with one memset node that every rank's branch depends on:
    a graph whose branches are roots has them launched by the driver one after
    another, about 4.5 us apart on the H200 (ep 8: 32 us before the last rank
    starts), while branches behind one root are released by the device within
    about a microsecond. A single-GPU rank of a real deployment has one stream,
    so the stagger is an artifact of the simulation that the timings must not carry.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    root = _graph_roots.setdefault(device, torch.empty(1, dtype=torch.int32, device=device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        root.zero_()
        result = step()
    return graph, result


class OpGraphs:
    """One CUDA graph per op kind and input set (combine-ws: one for all sets),
    captured by ``capture`` from the steps of ``ours`` (``single._Ours`` or
    ``distributed._OursRank``, each with its own capture);
    its methods replay them, with the names of the steps (for time_ops)."""

    def __init__(self, ours: Any, n_sets: int, capture: Callable[[Callable[[], Any]], tuple[Any, Any]]):
        sets = range(n_sets)
        self._dispatch = [capture(lambda i=i: ours.dispatch(i))[0] for i in sets]
        self._combine = [capture(lambda i=i: ours.combine(i)) for i in sets]  # (graph, outputs it rewrites)
        self._round_trip = [capture(lambda i=i: ours.round_trip(i))[0] for i in sets]
        self._combine_ws = capture(ours.combine_ws)[0]
        self._round_trip_ws = [capture(lambda i=i: ours.round_trip_ws(i))[0] for i in sets]

    def dispatch(self, i: int) -> None:
        self._dispatch[i].replay()

    def combine(self, i: int) -> Any:
        """Replays set i's combine; the outputs it rewrote."""
        graph, outputs = self._combine[i]
        graph.replay()
        return outputs

    def combine_ws(self, i: int = 0) -> None:
        self._combine_ws.replay()

    def round_trip(self, i: int) -> None:
        self._round_trip[i].replay()

    def round_trip_ws(self, i: int) -> None:
        self._round_trip_ws[i].replay()


def release(device: torch.device) -> None:
    """Give back what the last point held (its graphs and tensors) before the next one."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def copy_bandwidth(clock: Clock, device: torch.device, nbytes: int) -> float:
    """GB/s of a ``copy_`` of ``nbytes`` (every benchmark's ceiling), counting bytes read + written;
    median of COPY_REPEATS after COPY_WARMUP."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(COPY_WARMUP):
        dst.copy_(src)
    marks = []
    for _ in range(COPY_REPEATS):
        start = clock.mark()
        dst.copy_(src)
        marks.append((start, clock.mark()))
    us = statistics.median(clock.elapsed_us(marks))
    del src, dst
    release(device)
    return 2 * nbytes / (us * 1e-6) / 1e9


def report_copy_ceiling(clock: Clock, device: torch.device, nbytes: int) -> float:
    """:func:`copy_bandwidth`, printed as a run's ceiling line; GB/s."""
    gbps = copy_bandwidth(clock, device, nbytes)
    print(f"copy ceiling: {gbps:.1f} GB/s (copy_ of {nbytes / MIB:.0f} MiB, bytes read + written, median of "
          f"{COPY_REPEATS})", flush=True)
    return gbps


def copy_ratio(rec: dict, copy_gbps: Optional[float]) -> Optional[float]:
    """A record's rate (its ``ours_bytes`` in its ``ours_us``) over the copy
    ceiling, None where not measured."""
    ours, nbytes = rec.get("ours_us"), rec.get("ours_bytes")
    if ours is None or nbytes is None or not copy_gbps:
        return None
    return nbytes / (ours * 1e-6) / 1e9 / copy_gbps


# ---------------------------------------------------------------------------
# inputs and byte counts
# ---------------------------------------------------------------------------


@dataclass
class InputSet:
    """One set of every rank's inputs.

    ids[r]: int32 ``[T, top_k]`` (routing, also sent as a payload).
    payloads[r]: rank r's dispatch payloads (``Point.payload_rows`` order).
    expert_flat: bf16 ``[ep * ep * T + 1, H]``, every rank's expert outputs;
    the last row is zero (the baseline's "nowhere" row).
    expert_out[d]: contiguous ``[ep, T, H]`` view of expert_flat, rank d's
    combine payload (row ``[s, j]``: output for the j-th token from s).
    destinations: CPU int64 ``[ep, T]``, distinct destination ranks per token.
    """

    ids: list[Tensor]
    payloads: list[list[Tensor]]
    expert_flat: Tensor
    expert_out: list[Tensor]
    destinations: Tensor


def expert_owner(num_experts: int, ep: int) -> Tensor:
    """CPU int64 ``[num_experts]``: the rank owning each expert, from the
    layout's contiguous ranges (the table the kernels and the reference use)."""
    counts = torch.tensor(layout.experts_per_rank(num_experts, ep))
    return torch.repeat_interleave(torch.arange(ep), counts)


def distinct_destinations(ids: Tensor, owner: Tensor) -> Tensor:
    """int64 ``[n]``: distinct owner ranks of each token's (valid, distinct) experts."""
    dest = owner[ids.long()].sort(dim=1).values
    return 1 + (dest[:, 1:] != dest[:, :-1]).sum(dim=1)


def quantize_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x [n, H]`` -> (float8_e4m3fn ``[n, H]``, fp32 scales ``[n, ceil(H / FP8_BLOCK)]``).

    One scale per block of FP8_BLOCK elements (the last block may be partial:
    gpt-oss-120b's 2880 is 22.5 blocks).
    """
    n, h = x.shape
    blocks = ceil_div(h, FP8_BLOCK)
    padded = torch.nn.functional.pad(x.float(), (0, blocks * FP8_BLOCK - h)).view(n, blocks, FP8_BLOCK)
    scales = padded.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny) / torch.finfo(FP8_DTYPE).max
    q = (padded / scales.unsqueeze(-1)).view(n, blocks * FP8_BLOCK)[:, :h]
    return q.to(FP8_DTYPE).contiguous(), scales


def make_set(point: Point, device: torch.device, gen_cpu: torch.Generator, gen_dev: torch.Generator,
             owner: Tensor) -> InputSet:
    """One seeded input set of every rank (the same in every process that uses the same generators)."""
    p, ep, T = point.preset, point.ep, point.tokens
    ids_cpu = [random_routing(T, p.top_k, p.num_experts, gen_cpu) for _ in range(ep)]
    ids, payloads = [], []
    for r in range(ep):
        rank_ids = ids_cpu[r].to(device)
        weights = torch.rand((T, p.top_k), generator=gen_dev, device=device).softmax(dim=-1)
        hidden = torch.randn((T, p.hidden), generator=gen_dev, device=device, dtype=p.dtype)
        if point.fp8:
            q, scales = quantize_fp8(hidden)
            rank_payloads = [q, scales, rank_ids, weights]
        else:
            rank_payloads = [hidden, rank_ids, weights]
        ids.append(rank_ids)
        payloads.append(rank_payloads)
    expert_flat = torch.randn((point.expert_rows + 1, p.hidden), generator=gen_dev, device=device, dtype=p.dtype)
    expert_flat[-1].zero_()
    per_dest = expert_flat[: point.expert_rows].view(ep, ep, T, p.hidden)
    expert_out = [per_dest[d] for d in range(ep)]
    destinations = torch.stack([distinct_destinations(i, owner) for i in ids_cpu])
    return InputSet(ids, payloads, expert_flat, expert_out, destinations)


def routes_by_destination(ids: Tensor, owner: Tensor, ep: int) -> tuple[Tensor, Tensor, Tensor]:
    """The (token, distinct destination) pairs of ``ids`` (int ``[n, top_k]``,
    valid ids) sorted by destination, as a plain-PyTorch exchange plans them.

    Returns (sorted_dest, order, counts): int64 ``[n * top_k]`` destination of
    each sorted entry (``ep`` = "nowhere": a token's repeated destination,
    sorted last); int64 ``[n * top_k]`` flat ``[n, top_k]`` index of each
    sorted entry (``order // top_k`` is its token; tokens ascend within a
    destination); int64 ``[ep + 1]`` entries per destination (the last:
    nowhere). On ``ids``' device, no host sync.
    """
    dest = owner[ids.long()].sort(dim=1).values
    repeated = torch.zeros_like(dest, dtype=torch.bool)
    repeated[:, 1:] = dest[:, 1:] == dest[:, :-1]
    flat = dest.masked_fill(repeated, ep).reshape(-1)  # ep: "nowhere", sorts last
    order = torch.argsort(flat, stable=True)  # by destination, tokens ascending within one
    counts = torch.zeros(ep + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    return flat[order], order, counts


def op_bytes_for(point: Point, sends: float) -> dict[str, float]:
    """Bytes each op moves (DESIGN.md section 8), summed over ranks, when the
    ranks send ``sends`` (token, distinct destination) pairs in all."""
    drow, crow = point.dispatch_row_bytes, point.combine_row_bytes
    tokens = point.ep * point.tokens
    dispatch = drow * (tokens + sends)  # every row read once, written once per destination
    combine_ws = crow * (sends + tokens)  # every received row read once, every output row written once
    combine = combine_ws + 2 * crow * sends  # staging: read + write of every received row
    return {"dispatch": dispatch, "combine": combine, "combine-ws": combine_ws,
            "round-trip": dispatch + combine, "round-trip-ws": dispatch + combine_ws}


def expected_sends(point: Point) -> float:
    """The expected (token, distinct destination) pairs of random routing
    (top_k distinct experts, uniform): per token, the ranks whose contiguous
    range holds at least one of its experts."""
    p = point.preset
    all_ways = math.comb(p.num_experts, p.top_k)
    per_token = sum(1 - math.comb(p.num_experts - n, p.top_k) / all_ways
                    for n in layout.experts_per_rank(p.num_experts, point.ep))
    return point.ep * point.tokens * per_token


def reference_payloads(payloads: list[list[Tensor]]) -> list[list[Tensor]]:
    """Every rank's payloads as the reference takes them: fp8 rows as their
    bytes (compared bytewise anyway, and the reference's row moves need no fp8 kernels)."""
    return [[pl.view(torch.uint8) if pl.dtype == FP8_DTYPE else pl for pl in rank] for rank in payloads]


# ---------------------------------------------------------------------------
# correctness comparisons
# ---------------------------------------------------------------------------


def _byte_rows(t: Tensor) -> Tensor:
    """CPU uint8 ``[ep, T, row bytes]`` of a ``[ep, T, *]`` tensor."""
    t = t.detach().cpu().contiguous()
    return t.reshape(t.shape[0], t.shape[1], -1).view(torch.uint8)


def recv_mismatch(views: list[Tensor], ref_views: list[Tensor], counts: Tensor, names: list[str]) -> Optional[str]:
    """First payload whose valid rows (``[s, j]``, ``j < counts[s]``) differ in any byte, or None."""
    for name, ours, ref in zip(names, views, ref_views):
        ours, ref = _byte_rows(ours), _byte_rows(ref)
        for s, count in enumerate(counts.tolist()):
            if not torch.equal(ours[s, :count], ref[s, :count]):
                return name
    return None


def combine_mismatch(outs: list[Tensor], expected: list[Tensor],
                     ranks: Optional[list[int]] = None) -> tuple[Optional[str], bool]:
    """(error or None, bitwise equal) of every rank's combine output against the reference.

    ``ranks``: the rank of each entry, for the message (default 0, 1, ...).
    """
    bitwise = True
    for r, out, exp in zip(range(len(outs)) if ranks is None else ranks, outs, expected):
        out, exp = out.detach().cpu(), exp.cpu()  # the reference ran on the inputs' device
        if out.shape != exp.shape or out.dtype != exp.dtype:
            return f"rank {r}: combine output {out.dtype} {tuple(out.shape)}, expected {exp.dtype} " \
                   f"{tuple(exp.shape)}", False
        if torch.equal(out, exp):
            continue
        bitwise = False
        if not torch.allclose(out.float(), exp.float(), rtol=COMBINE_RTOL, atol=COMBINE_ATOL):
            diff = (out.float() - exp.float()).abs().nan_to_num(float("inf")).max().item()
            return f"rank {r}: combine differs from the reference (max |diff| {diff:.3g})", False
    return None, bitwise


def wall_us(clock: Clock, fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Median microseconds of ``fn()`` over ``iters`` calls after ``warmup``,
    each from a synced device until the device finished it."""
    times = []
    for i in range(warmup + iters):
        clock.sync()
        t0 = time.perf_counter()
        fn()
        clock.sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def sweep(eps: list[int], tokens: list[int], preset: str, measure: Callable[[Point], dict],
          stop: Optional["StopSignals"] = None) -> list[dict]:
    """``measure(point)`` for every point of ``eps`` x ``tokens`` of ``preset``
    (no fp8), in that order; a point that raises becomes a record with status
    'error' and the exception's first line as its note. Every record gets its
    ``ep`` and ``tokens``. ``stop`` (the caller's, active): a signal ends the
    sweep between two points, the records measured by then returned (a
    second signal, or Ctrl-C where no handler is set, ends the point in
    progress); its ``signum`` tells the caller."""
    records = []
    with contextlib.nullcontext() if stop is None else stop.ends_sweep():
        for ep in eps:
            for T in tokens:
                if stop is not None:
                    stop.check()
                try:
                    rec = measure(Point(PRESETS[preset], ep, T, fp8=False))
                except Exception as e:  # noqa: BLE001 - one broken point must not hide the others
                    rec = {"status": "error", "notes": [f"{type(e).__name__}: {first_line(e)}"]}
                rec.update(ep=ep, tokens=T)
                records.append(rec)
    return records


def stopped_line(stop: Optional["StopSignals"], planned: int, done: int) -> Optional[str]:
    """The line that says a signal ended a run, and how many points it left; None if none did."""
    if stop is None or stop.signum is None:
        return None
    return f"stopped by {signal.Signals(stop.signum).name}: {planned - done} points not run"


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (table cells and notes hold one line)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------


def add_preset_argument(p: argparse.ArgumentParser, default: str) -> None:
    """--preset, repeatable, 'all' for every preset; ``default`` names what is run without it."""
    p.add_argument("--preset", action="append", choices=[*PRESETS, "all"],
                   help=f"model shape (repeatable; 'all' = every preset; default {default}): "
                   + ", ".join(f"{n} (hidden {x.hidden}, {x.num_experts} experts, top-{x.top_k})"
                               for n, x in PRESETS.items()))


def preset_names(chosen: Optional[list[str]], default: list[str]) -> list[str]:
    """The presets a --preset list names, in order, without repeats; ``default`` without one."""
    if not chosen:
        return default
    return list(PRESETS) if "all" in chosen else list(dict.fromkeys(chosen))


# What --device cuda says where torch has no CUDA device (demo, bench, bench-dist alike).
NO_CUDA = "CUDA was asked for but torch sees no CUDA device"


def start_process_group(prog: str, backend: str, init_method: str, rank: int, world: int, **options: Any) -> bool:
    """``torch.distributed.init_process_group``, or one line on stderr and
    False where the rendezvous cannot start (no ``MASTER_ADDR`` with
    ``env://``, an init method torch does not know): a command's user gets
    what to do, not torch's traceback."""
    import torch.distributed as dist

    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, **options)
    except (ValueError, RuntimeError) as e:
        print(f"{prog}: the process group did not start ({first_line(e)}); run under torchrun, which sets "
              "MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE, or pass --init-method (e.g. file:///tmp/rdv)",
              file=sys.stderr)
        return False
    return True


def int_in_range(low: int, high: Optional[int], what: str) -> Callable[[str], int]:
    """An argparse ``type`` that takes an int in ``low..high`` (no upper bound
    if ``high`` is None); its error names ``what`` and the range, and argparse
    prints it after the option's name, so a bad value never reaches the kernels'
    own checks (whose errors are tracebacks)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"in {low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{what} must be {bounds}, got {value}")
        return value

    return parse


class DistinctValues(argparse.Action):
    """An argparse action for a list option (``nargs="+"``) that keeps each
    value once, in the order first given: ``--tokens 16 16`` measures the
    point once, not twice."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, list(dict.fromkeys(values)))


def int_at_least(low: int, what: str) -> Callable[[str], int]:
    return int_in_range(low, None, what)


def positive_float(what: str) -> Callable[[str], float]:
    """An argparse ``type`` for a float > 0."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got {text!r}") from None
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"{what} must be a finite number > 0, got {text}")
        return value

    return parse


def check_output_path(parser: argparse.ArgumentParser, option: str, path: Optional[str]) -> None:
    """An argparse error now for an output file that could not be written at
    the end of the run (a missing or read-only folder), rather than an
    OSError after the sweep."""
    if path is None:
        return
    if path in ("", "-"):  # "-" is no stdout here: the table goes there
        parser.error(f"{option} {path!r}: give a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"{option} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        parser.error(f"{option} {path}: folder {folder} is not writable")
    if os.path.isdir(path):
        parser.error(f"{option} {path}: is a folder")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------


class Progress:
    """Progress of a sweep on stderr.

    On a terminal: a tqdm bar with the points done, the phase of the current
    point and an estimate of the time left. Otherwise (a log file, a pipe):
    one plain line per finished point, no carriage-return frames and no time
    estimate, so a log reads as a list of what was done.
    """

    def __init__(self, total: int, stream: Any = None):
        self.total, self.done = total, 0
        self.stream = sys.stderr if stream is None else stream
        self._started = time.perf_counter()
        self._bar = None
        if _is_terminal(self.stream):
            # Imported here: only an interactive run draws the bar.
            from tqdm import tqdm

            self._bar = tqdm(total=total, file=self.stream, unit="point", dynamic_ncols=True,
                             bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")

    def phase(self, label: str, what: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(f"{label}: {what}", refresh=True)

    def step(self, label: str) -> None:
        """Point ``label`` is done (measured, skipped or failed)."""
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        else:
            elapsed = time.perf_counter() - self._started
            self.stream.write(f"[{self.done}/{self.total}] {label} done ({elapsed:.1f} s so far)\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class QuietProgress:
    """The progress of a process that does not report (the distributed ranks other than 0)."""

    def phase(self, label: str, what: str) -> None:
        pass

    def step(self, label: str) -> None:
        pass

    def close(self) -> None:
        pass


def _is_terminal(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def fmt(x: Optional[float], spec: str, suffix: str = "") -> str:
    """A table cell: ``x`` formatted, or '-' where there is no value."""
    return "-" if x is None else f"{x:{spec}}{suffix}"


def format_row(cells: list[str], widths: list[int], left: set[int]) -> str:
    """One line of a table: each cell padded to its column's width, columns in ``left`` left-aligned."""
    return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()


def format_table(header: list[str], rows: list[list[str]], left: set[int]) -> str:
    """Columns padded to their widest cell, a rule under the header; columns in ``left`` left-aligned."""
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines = [format_row(r, widths, left) for r in [header, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def over_max_gib(need: int, max_bytes: int) -> str:
    """Why a point needing ``need`` bytes is skipped under ``--max-gib``."""
    return f"needs ~{need / GIB:.1f} GiB > --max-gib {max_bytes / GIB:g}"


def geomean(values: list[float]) -> Optional[float]:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def write_json(path: str, data: dict) -> None:
    """Write ``data`` to ``path`` through ``path.partial`` and a rename: a
    reader (or a run stopped while writing) never sees half a file."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(partial, path)


# ---------------------------------------------------------------------------
# stop signals
# ---------------------------------------------------------------------------


class Interrupted(BaseException):
    """A stop signal arrived; raised by ``StopSignals.check`` at a safe point.

    A BaseException, as KeyboardInterrupt is: the benchmarks catch Exception
    around a point or a phase to report its failure and go on, and a stop
    must pass through those handlers.
    """

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class StopSignals:
    """While active (a ``with`` block), SIGINT and SIGTERM only set a flag;
    ``check()`` raises ``Interrupted`` once one arrived.

    The sweep calls ``check()`` between steps, never inside one: a step
    launches every simulated rank, and a rank left unlaunched would keep its
    peers spinning until the kernels' timeout. A second signal while the
    first is pending raises KeyboardInterrupt at once (a way out of a step
    that hangs). Outside the main thread signal handlers cannot be set, and
    nothing changes.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> "StopSignals":
        try:
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread
            self.__exit__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def check(self) -> None:
        if self.signum is not None:
            raise Interrupted(self.signum)

    @contextlib.contextmanager
    def ends_sweep(self) -> Iterator[None]:
        """A sweep's block, which a stop leaves quietly: the point in progress
        is dropped and the ones before it stand. ``check()``'s Interrupted
        ends it; so does KeyboardInterrupt (a second signal, or Ctrl-C where
        no handler is set), recorded as SIGINT unless a signal came first."""
        try:
            yield
        except Interrupted:
            pass
        except KeyboardInterrupt:
            self.signum = self.signum or signal.SIGINT

    @property
    def exit_code(self) -> int:
        """The shell's code for a death by the signal (128 + its number): non-zero, and says which."""
        return 128 + self.signum if self.signum is not None else 0


def per_device(defaults: dict) -> str:
    """'A on CUDA, B on the CPU' for a help text, from ``{"cuda": A, "cpu": B}``."""
    def text(v: Any) -> str:
        return " ".join(map(str, v)) if isinstance(v, tuple) else str(v)

    return f"{text(defaults['cuda'])} on CUDA, {text(defaults['cpu'])} on the CPU"
