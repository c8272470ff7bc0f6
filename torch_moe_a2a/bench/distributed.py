"""``torchrun --nproc-per-node N -m torch_moe_a2a bench-dist``: dispatch and
combine with one rank per process (one GPU each, peers over NVLink), next to
the same exchange done with ``torch.distributed.all_to_all_single`` and to
NCCL's own all-to-all on equal bytes (DESIGN.md section 8).

What is measured, for every point (model preset, tokens per rank; ep is the
world size of the launch):

- ops (``common.OPS``): ``dispatch``; ``combine`` (expert outputs in a tensor
  of their own, staged by the op); ``combine-ws`` (payload already in the
  workspace); ``round-trip`` = dispatch + combine; ``round-trip-ws`` =
  dispatch + combine-ws. The functional API on ``allocate_workspace(group=
  default group)``: CUDA virtual memory on ``cuda:LOCAL_RANK``, or one
  shared-memory file on the CPU (gloo).
- time: each rank times its own calls, CUDA events on its stream
  (``perf_counter`` on the CPU). Before every timed iteration the device is
  synchronized and the ranks meet in ``dist.barrier``, so they start
  together; with NCCL a one-element ``all_reduce`` queued right before the
  start mark also lines the GPUs up (processes wake from a barrier tens of
  microseconds apart, as long as a small exchange takes). A spin kernel
  queued before that ``all_reduce`` keeps the GPU busy while the host queues
  the alignment and the timed call, as it would be busy with the layers
  before an exchange in a model: without it the timing also holds the host
  tail of NCCL's ``all_reduce`` call (on two H200s, 128 tokens: 77 to 123 us
  eager against 18 to 23 us graph for our ops). What the host spends per
  call is the single-device ``bench``'s host-cost column; a call that synchronizes with the
  host (the baseline's split sizes) still waits for the GPU. The reported time
  is the max over ranks of each rank's median over ``--iters`` iterations
  after ``--warmup``: an exchange is done when its slowest rank is.
  Dispatch and combine must alternate, so an op timed alone is paired with
  an untimed partner in every iteration.
- eager: the ops called from Python; graph (CUDA): each rank captures its own
  calls in CUDA graphs (graphs are per process) and replays them.
- bytes: per-GPU send bytes = the bytes a rank sends to OTHER ranks over the
  link (section 8's accounting restricted to remote destinations): dispatch,
  one payload row per (token, distinct destination rank other than its own);
  combine, one combine row back per row it received from another rank (the
  staging copy of ``combine`` is local and not counted). The mean over ranks
  (and input sets) is reported, every rank's value is in ``--json``; GB/s per
  GPU = mean send bytes / time (graph time where there is one).
- baseline (:class:`_A2ABaseline`): the same exchange with
  ``all_to_all_single``: the counts exchange, the split sizes to the host,
  the payload exchange (all payloads of a row packed into one byte row), and
  for combine the reverse exchange plus the fp32 sum per token that our
  combine computes. Eager only (the host needs the split sizes, so it cannot
  be captured). speedup = baseline time / ours (eager / eager; baseline
  eager / our graph).
- ceiling (:class:`_Ceiling`): ``all_to_all_single`` with an even split of
  the same bytes (each rank sends the op's mean send bytes, in equal chunks
  to every peer): over NCCL, the link's all-to-all bandwidth. x ceiling =
  our GB/s per GPU / the ceiling's. Op -> baseline and ceiling:
  ``common.BASELINE_OF`` (both combines against one).
- correctness: before timing, one round trip of ours (dispatch, combine,
  dispatch, combine-ws) and of the baseline on input set 0 is compared with
  :mod:`torch_moe_a2a.reference` on every rank (each rank its own receive
  rows and output); a point that fails is FAIL and not timed. After timing,
  a graph replay must equal the eager result and no rank may have recorded a
  timed-out wait.

Inputs: the single-device benchmark's (``common.make_set``), seeded and built
identically in every process (every process builds every rank's inputs for
the reference, then keeps its own). Input sets rotate so that one GPU's
inputs exceed its L2 cache twice where ``common.MAX_SETS`` sets suffice.

Processes sharing a GPU (more ranks on a host than GPUs, e.g. the one-GPU dry
run of scripts/multi_gpu.sh): gloo carries everything (NCCL refuses two ranks
on one GPU) and the processes' kernels time-slice the GPU, so the timings are
not meaningful and are labelled so. NCCL_NVLS_ENABLE defaults to 0 here:
NVLink multicast stays off (on shared hosts it can take the GPUs out of
service).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import signal
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import layout
from ..api import (
    check_errors,
    moe_a2a_combine,
    moe_a2a_dispatch,
    moe_a2a_get_recv_counts,
    moe_a2a_get_workspace_size_per_rank,
    moe_a2a_initialize,
    moe_a2a_wrap_payload_tensor_in_workspace,
)
from ..collective import TorchGroupCollective
from ..reference import reference_combine, reference_dispatch
from ..workspace import allocate_workspace, cuda_workspace_granularity
from . import targets
from .common import (
    BASELINE_OF,
    DEFAULT_ITERS,
    DEFAULT_MAX_GIB,
    DEFAULT_WARMUP,
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
    Progress,
    QuietProgress,
    StopSignals,
    add_preset_argument,
    check_output_path,
    combine_mismatch,
    device_name,
    expert_owner,
    first_line,
    fmt,
    format_table,
    int_at_least,
    int_in_range,
    invalid_reason,
    l2_bytes,
    make_set,
    new_record,
    num_sets_for,
    over_max_gib,
    per_device,
    positive_float,
    preset_names,
    recv_mismatch,
    reference_payloads,
    release,
    routes_by_destination,
    set_bytes,
    start_process_group,
    stopped_line,
    time_ops,
    write_json,
)

DEFAULT_PRESET = "deepseek-v3"
# Per device type: CPU processes move a 4096-token point's bytes through gloo
# for minutes, so their defaults are a short run's.
DEFAULT_TOKENS = {"cuda": (128, 4096), "cpu": (16, 128)}
DEFAULT_ITERS_FOR = {"cuda": DEFAULT_ITERS, "cpu": 20}
DEFAULT_WARMUP_FOR = {"cuda": DEFAULT_WARMUP, "cpu": 3}
LAUNCH_HINT = "torchrun --nproc-per-node N -m torch_moe_a2a bench-dist [options]"

# NVLink multicast stays off: on shared GPU hosts a program using it can take
# the GPUs out of service (device notes). NCCL reads it when a communicator starts.
NVLS_ENV = "NCCL_NVLS_ENABLE"
NVLS_OFF = "0"
# The default group: gloo moves the CPU tensors (workspace bootstrap, barriers,
# results), NCCL the CUDA tensors (baseline, ceiling, GPU alignment) when every
# rank has a GPU of its own; gloo alone when ranks share GPUs or run on the CPU.
BACKEND_GPU_PER_RANK = "cpu:gloo,cuda:nccl"
BACKEND_GLOO = "gloo"
# A collective that waits longer than this has lost a rank.
PG_TIMEOUT = datetime.timedelta(seconds=600)

# A spin kernel this long before every timed iteration (CUDA): far more than
# the host needs to queue the alignment all_reduce, two events and one eager
# call or graph replay.
HEAD_START_S = 200e-6
# Ceiling chunks (bytes to each peer) are rounded up to this many bytes.
CEILING_CHUNK_ALIGN = 16
# One rank's text (errors, notes) in a gather.
TEXT_BYTES = 4096


# ---------------------------------------------------------------------------
# the process: rank, device, group
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Process:
    """This process's place in the launch."""

    rank: int
    world: int
    device: torch.device
    gpus_visible: int
    ranks_per_gpu: int  # processes of this host on one GPU (1: a GPU each)
    backend: str

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def nccl(self) -> bool:
        """CUDA tensors go through NCCL (one GPU per rank)."""
        return self.cuda and "nccl" in self.backend

    @property
    def timings_meaningful(self) -> bool:
        """False when processes time-slice a GPU."""
        return self.ranks_per_gpu == 1

    @property
    def targets_apply(self) -> bool:
        """The targets are about GPUs, one per process."""
        return self.cuda and self.timings_meaningful


def _launch_env() -> Optional[tuple[int, int, int, int]]:
    """(rank, world, local rank, local world) from torchrun's variables, or None outside torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return rank, world, local_rank, local_world


def _process(choice: str, rank: int, world: int, local_rank: int, local_world: int) -> Process:
    """The device (cuda:LOCAL_RANK, modulo the GPUs when there are fewer) and the backend."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return Process(rank, world, torch.device("cpu"), 0, 1, BACKEND_GLOO)
    gpus = torch.cuda.device_count()
    ranks_per_gpu = -(-local_world // gpus)
    backend = BACKEND_GPU_PER_RANK if ranks_per_gpu == 1 else BACKEND_GLOO
    return Process(rank, world, torch.device("cuda", local_rank % gpus), gpus, ranks_per_gpu, backend)


def _meet(proc: Process) -> None:
    """Every rank here with an idle device (host barrier through gloo)."""
    if proc.cuda:
        torch.cuda.synchronize(proc.device)
    dist.barrier()


def _stop_agreed(stop: StopSignals) -> Optional[int]:
    """The signal that stopped any rank (the largest number where several
    did), the same answer on every rank; None while none has. A collective:
    every rank asks after the same point, so all of them end the sweep there
    (a rank that stopped alone would leave its peers waiting in the next
    point's exchange until the timeout)."""
    flag = torch.tensor([stop.signum or 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) or None


def _gather_floats(values: list[float]) -> Tensor:
    """float64 ``[world, len(values)]``: every rank's ``values``."""
    mine = torch.tensor(values, dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return torch.stack(gathered)


def _gather_text(text: str) -> list[str]:
    """Every rank's ``text`` (cut to TEXT_BYTES bytes)."""
    data = text.encode()[:TEXT_BYTES]
    return [raw.decode(errors="replace") for raw in TorchGroupCollective().allgather(data)]


def _by_rank(texts: list[str]) -> list[str]:
    """'rank r: text' for every rank with a non-empty text."""
    return [f"rank {r}: {t}" for r, t in enumerate(texts) if t]


# ---------------------------------------------------------------------------
# bytes
# ---------------------------------------------------------------------------


def _pair_counts(ids: list[Tensor], owner: Tensor) -> Tensor:
    """CPU int64 ``[ep, ep]``: ``[s, d]`` = tokens of rank ``s`` with an expert
    on rank ``d`` (each token counted once per rank): rows ``d`` receives from ``s``."""
    ep = len(ids)
    counts = torch.zeros((ep, ep), dtype=torch.int64)
    for s, rank_ids in enumerate(ids):
        hit = torch.zeros((rank_ids.shape[0], ep), dtype=torch.bool)
        hit.scatter_(1, owner[rank_ids.cpu().long()], True)
        counts[s] = hit.sum(dim=0)
    return counts


def _send_bytes(point: Point, pair_counts: list[Tensor]) -> dict[str, list[float]]:
    """Per op, the bytes each rank sends to other ranks (mean over the input sets)."""
    ep = point.ep
    remote = [c * (1 - torch.eye(ep, dtype=torch.int64)) for c in pair_counts]
    dispatch = torch.stack([r.sum(dim=1) for r in remote]).double().mean(dim=0) * point.dispatch_row_bytes
    combine = torch.stack([r.sum(dim=0) for r in remote]).double().mean(dim=0) * point.combine_row_bytes
    per_op = {"dispatch": dispatch, "combine": combine, "combine-ws": combine,
              "round-trip": dispatch + combine, "round-trip-ws": dispatch + combine}
    return {op: b.tolist() for op, b in per_op.items()}


def _rank_set_bytes(point: Point) -> int:
    """Bytes of one input set that one rank touches: its payloads and expert outputs."""
    return point.tokens * point.dispatch_row_bytes + point.ep * point.tokens * point.combine_row_bytes


def _rank_memory_bytes(point: Point, n_sets: int) -> int:
    """Upper estimate of the memory one rank needs at its peak (device memory on CUDA).

    Two stages: the check (every rank's inputs, the reference's receive
    planes of every rank and its sums), then the timing (this rank's inputs
    and the baseline's expert rows, the own workspace row, the larger of the
    baseline's and the ceiling's buffers, combine outputs in graph pools).
    """
    ep, T, k = point.ep, point.tokens, point.preset.top_k
    drow, crow = point.dispatch_row_bytes, point.combine_row_bytes
    check = n_sets * set_bytes(point) + point.expert_rows * drow + 2 * ep * T * crow
    sent_rows = T * min(k, ep)  # a token goes to each destination rank once
    baseline = 2 * sent_rows * drow + ep * T * drow + 3 * sent_rows * crow + 3 * T * crow
    ceiling = 2 * ep * (sent_rows * (drow + crow) // (ep - 1) + 1)  # send + receive buffers
    timing = (n_sets * 2 * _rank_set_bytes(point) + layout.workspace_size_per_rank(ep, T, drow, crow, 0)
              + max(baseline, ceiling) + (3 * n_sets + 1) * T * crow)
    return max(check, timing)


# ---------------------------------------------------------------------------
# one rank's inputs and the two implementations
# ---------------------------------------------------------------------------


@dataclass
class _RankInputs:
    """One input set, the part this rank uses.

    ids: int32 ``[T, top_k]``; payloads: ``Point.payload_rows`` order;
    expert_out: ``[ep, T, H]`` combine payload (row ``[s, j]``: output for the
    j-th token received from s); expert_rows: the same rows packed in the
    baseline's receive order, ``[rows received, H]``.
    """

    ids: Tensor
    payloads: list[Tensor]
    expert_out: Tensor
    expert_rows: Tensor


def _rank_inputs(s: InputSet, rank: int, pair_counts: Tensor) -> _RankInputs:
    mine = s.expert_out[rank]  # a view of every rank's expert outputs: copy what is kept
    received = pair_counts[:, rank].tolist()
    rows = torch.cat([mine[src, :n] for src, n in enumerate(received)])
    return _RankInputs(s.ids[rank], s.payloads[rank], mine.clone(), rows)


class _OursRank:
    """This rank's torch-moe-a2a calls on a workspace shared with the other processes."""

    def __init__(self, point: Point, rank: int, inputs: list[_RankInputs], workspace: Tensor, metainfo: Tensor):
        self.point, self.rank, self.inputs = point, rank, inputs
        self.workspace, self.metainfo = workspace, metainfo
        self.cache: dict = {}  # recv_view_cache, as a latency-minded caller passes one
        ep, T = point.ep, point.tokens
        self.offset = layout.call_layout(ep, T, 0, point.row_bytes()).combine_offset
        nbytes = ep * T * point.combine_row_bytes
        self.ws_view = moe_a2a_wrap_payload_tensor_in_workspace(workspace[rank], [ep, T], self.offset,
                                                                self.offset + nbytes, point.preset.dtype)

    def dispatch(self, i: int) -> tuple:
        p, x = self.point, self.inputs[i]
        return moe_a2a_dispatch(x.ids, x.payloads, self.workspace, self.metainfo, p.tokens, self.rank, p.ep,
                                p.preset.top_k, p.preset.num_experts, recv_view_cache=self.cache)

    def combine(self, i: int) -> Tensor:
        p = self.point
        return moe_a2a_combine(self.inputs[i].expert_out, p.tokens, self.workspace, self.metainfo, p.tokens,
                               self.rank, p.ep, p.preset.top_k, self.offset)

    def combine_ws(self, i: int = 0) -> Tensor:
        """Combine with the payload already in the workspace (the same view for every set)."""
        p = self.point
        return moe_a2a_combine(self.ws_view, p.tokens, self.workspace, self.metainfo, p.tokens, self.rank, p.ep,
                               p.preset.top_k, self.offset, payload_in_workspace=True)

    def round_trip(self, i: int) -> Tensor:
        self.dispatch(i)
        return self.combine(i)

    def round_trip_ws(self, i: int) -> Tensor:
        self.dispatch(i)
        return self.combine_ws()


def _byte_columns(t: Tensor) -> Tensor:
    """uint8 ``[n, row bytes]`` of a ``[n, *]`` tensor (the same bytes)."""
    return t.contiguous().reshape(t.shape[0], -1).view(torch.uint8)


@dataclass
class _Plan:
    """One rank's routing as all_to_all_single needs it.

    token: int64 ``[rows sent]`` (device), the source token of each sent row,
    rows grouped by destination rank in rank order, tokens ascending within
    one. send_counts / recv_counts: rows to / from each rank (host ints, the
    split sizes).
    """

    token: Tensor
    send_counts: list[int]
    recv_counts: list[int]


class _A2ABaseline:
    """The same exchange with ``torch.distributed.all_to_all_single``, as a user
    without this library would write it.

    dispatch: destinations from the expert ids (owner table, a token's
    repeated destinations dropped) sorted by rank (``common.routes_by_destination``),
    the per-destination counts exchanged with one all_to_all_single and
    brought to the host (the split sizes), the payload rows gathered in that
    order and packed into one byte row each, then one all_to_all_single with
    those splits. The receiver gets ``[rows received, row bytes]``: rows from
    rank 0 first, each source's in token order (our receive layout without
    the padding). combine: the expert outputs of those rows go back through
    the reverse all_to_all_single and are summed per token in fp32
    (``index_add_``), then cast: what our combine computes.
    """

    def __init__(self, point: Point, inputs: list[_RankInputs], owner: Tensor, device: torch.device):
        self.point, self.inputs = point, inputs
        self.owner = owner.to(device)
        self.device = device
        self.plans: list[Optional[_Plan]] = [None] * len(inputs)  # per set, for combine timed alone

    def plan(self, ids: Tensor) -> _Plan:
        ep, k = self.point.ep, self.point.preset.top_k
        _, order, counts = routes_by_destination(ids, self.owner, ep)
        send = counts[:ep].contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)  # the counts exchange
        send_counts, recv_counts = send.tolist(), recv.tolist()  # the host needs the split sizes
        return _Plan(order[: sum(send_counts)] // k, send_counts, recv_counts)

    def dispatch(self, i: int) -> tuple[Tensor, _Plan]:
        """(received rows, uint8 ``[sum recv_counts, dispatch row bytes]``; the plan)."""
        x = self.inputs[i]
        plan = self.plan(x.ids)
        rows = torch.cat([_byte_columns(p).index_select(0, plan.token) for p in x.payloads], dim=1)
        received = torch.empty((sum(plan.recv_counts), rows.shape[1]), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(received, rows, plan.recv_counts, plan.send_counts)
        return received, plan

    def combine(self, i: int, plan: Optional[_Plan] = None) -> Tensor:
        """``[T, H]``: the sum of every destination's expert output of each token."""
        plan = self.plans[i] if plan is None else plan
        expert_rows = self.inputs[i].expert_rows
        back = torch.empty((plan.token.numel(), expert_rows.shape[1]), dtype=expert_rows.dtype, device=self.device)
        dist.all_to_all_single(back, expert_rows, plan.send_counts, plan.recv_counts)
        acc = torch.zeros((self.point.tokens, back.shape[1]), dtype=torch.float32, device=self.device)
        return acc.index_add_(0, plan.token, back.float()).to(expert_rows.dtype)

    def round_trip(self, i: int) -> Tensor:
        _, plan = self.dispatch(i)
        return self.combine(i, plan)

    def padded_views(self, received: Tensor, recv_counts: list[int]) -> list[Tensor]:
        """The received rows as uint8 ``[ep, T, row bytes]`` per payload, padding zero (for the check)."""
        ep, T = self.point.ep, self.point.tokens
        views, column = [], 0
        for width in self.point.row_bytes():
            view = torch.zeros((ep, T, width), dtype=torch.uint8, device=received.device)
            start = 0
            for s, n in enumerate(recv_counts):
                view[s, :n] = received[start : start + n, column : column + width]
                start += n
            views.append(view)
            column += width
        return views


class _Ceiling:
    """all_to_all_single with an even split: ``send_bytes`` (at least) from
    each rank, in equal chunks to every peer; the link's all-to-all."""

    def __init__(self, ep: int, send_bytes: float, device: torch.device):
        per_peer = math.ceil(send_bytes / (ep - 1))
        chunk = -(-per_peer // CEILING_CHUNK_ALIGN) * CEILING_CHUNK_ALIGN
        self.remote_bytes = chunk * (ep - 1)  # bytes over the link; the chunk to itself is a local copy
        self.send = torch.ones(ep * chunk, dtype=torch.uint8, device=device)
        self.recv = torch.empty_like(self.send)

    def run(self, i: int = 0) -> None:
        dist.all_to_all_single(self.recv, self.send)


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------


class Timer:
    """Times one rank's part of a collective step (see the module docstring)."""

    def __init__(self, proc: Process, clock: Clock, iters: int, warmup: int):
        self.proc, self.clock, self.iters, self.warmup = proc, clock, iters, warmup
        self._align = torch.zeros(1, device=proc.device) if proc.nccl else None

    def measure(self, n_sets: int, timed: Callable[[int], Any], before: Optional[Callable[[int], Any]] = None,
                after: Optional[Callable[[int], Any]] = None) -> float:
        """This rank's median microseconds of ``timed(i)``; iteration ``it`` uses set ``it % n_sets``."""
        marks = []
        for it in range(self.warmup + self.iters):
            i = it % n_sets
            if before is not None:
                before(i)
            _meet(self.proc)
            self.clock.head_start(HEAD_START_S)
            if self._align is not None:
                dist.all_reduce(self._align)  # the GPUs leave it together
            start = self.clock.mark()
            timed(i)
            end = self.clock.mark()
            if it >= self.warmup:
                marks.append((start, end))
            if after is not None:
                after(i)
        return statistics.median(self.clock.elapsed_us(marks))


def _capture(step: Callable[[], Any]) -> tuple["torch.cuda.CUDAGraph", Any]:
    """A CUDA graph of ``step()`` and what it returned (tensors the replays rewrite).

    thread_local: the process group's background threads query CUDA events,
    which a global-mode capture would turn into errors.
    """
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        result = step()
    return graph, result


# ---------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------


@dataclass
class _Expected:
    """The reference's results for this rank on input set 0 (on the device)."""

    recv: list[Tensor]  # [payload] [ep, T, *]
    recv_counts: Tensor  # int32 [ep]
    out: Tensor  # [T, H]


def _reference(point: Point, s: InputSet, rank: int) -> _Expected:
    ref = reference_dispatch(s.ids, reference_payloads(s.payloads), ep_size=point.ep,
                             num_experts=point.preset.num_experts, runtime_max_tokens_per_rank=point.tokens)
    out = reference_combine(s.expert_out, ref, [point.tokens] * point.ep)
    return _Expected(ref.recv[rank], ref.recv_counts[rank], out[rank])


def _check_ours(ours: _OursRank, expected: _Expected, names: list[str]) -> tuple[list[str], list[str], Tensor]:
    """One round trip of each combine kind on set 0; (errors, notes, the combine output)."""
    rank = ours.rank
    recv, offset, _ = ours.dispatch(0)
    # Copies before this rank's combine: after it a peer's next dispatch may overwrite the planes.
    counts = moe_a2a_get_recv_counts(ours.workspace, ours.metainfo, rank).cpu()
    recv = [v.cpu() for v in recv]
    out = ours.combine(0)
    ours.dispatch(0)
    ours.ws_view.copy_(ours.inputs[0].expert_out)  # what an MoE writing into the workspace leaves there
    out_ws = ours.combine_ws()

    errors, notes = [], []
    if offset != ours.offset:
        errors.append(f"combine_payload_offset {offset} != layout's {ours.offset}")
    elif not torch.equal(counts, expected.recv_counts.cpu()):
        errors.append(f"recv counts {counts.tolist()} != reference {expected.recv_counts.tolist()}")
    else:
        bad = recv_mismatch(recv, expected.recv, counts, names)
        if bad is not None:
            errors.append(f"received {bad} differs from the reference")
    for what, got in (("combine", out), ("combine-ws", out_ws)):
        error, bitwise = combine_mismatch([got], [expected.out], [rank])
        if error is not None:
            errors.append(f"{what}: {error}")
        elif not bitwise:
            notes.append(f"{what} within tolerance of the reference but not bitwise equal")
    return errors, notes, out


def _check_baseline(base: _A2ABaseline, expected: _Expected, names: list[str], rank: int) -> Optional[str]:
    """The baseline's round trip on set 0 against the reference; stores set 0's plan. Error or None."""
    received, plan = base.dispatch(0)
    base.plans[0] = plan
    out = base.combine(0)
    if plan.recv_counts != expected.recv_counts.tolist():
        return f"baseline recv counts {plan.recv_counts} != reference {expected.recv_counts.tolist()}"
    counts = torch.tensor(plan.recv_counts)
    bad = recv_mismatch(base.padded_views(received, plan.recv_counts), expected.recv, counts, names)
    if bad is not None:
        return f"baseline: received {bad} differs from the reference"
    error, _ = combine_mismatch([out], [expected.out], [rank])
    return None if error is None else f"baseline {error}"


def _check_same_inputs(s: InputSet) -> None:
    """Raise on every rank if the ranks built different inputs from the same
    seed (device generators of different GPU models may differ)."""
    tensors = [*s.ids, *[p for rank_pl in s.payloads for p in rank_pl], s.expert_flat]
    mine = [float(t.contiguous().view(torch.uint8).sum(dtype=torch.int64)) for t in tensors]
    everyone = _gather_floats(mine)
    differ = [r for r in range(everyone.shape[0]) if not torch.equal(everyone[r], everyone[0])]
    if differ:
        raise RuntimeError(f"ranks {differ} built other inputs than rank 0 from the same seed (device random "
                           "generators differ between these GPUs): the correctness check would be meaningless")


# ---------------------------------------------------------------------------
# one point
# ---------------------------------------------------------------------------


@dataclass
class _Context:
    proc: Process
    timer: Timer
    max_bytes: int
    l2_bytes: int
    a2a_unavailable: Optional[str]  # why the baseline and the ceiling cannot run, or None
    progress: Any


def _fits(point: Point, n_sets: int, ctx: _Context) -> Optional[str]:
    """Why the point does not fit this launch's memory (the same text on every rank), or None."""
    need = _rank_memory_bytes(point, n_sets)
    reason = ""
    if need > ctx.max_bytes:
        reason = over_max_gib(need, ctx.max_bytes)
    elif ctx.proc.cuda:
        share = torch.cuda.mem_get_info(ctx.proc.device)[0] // ctx.proc.ranks_per_gpu
        if need > share:
            reason = f"needs ~{need / GIB:.1f} GiB > {share / GIB:.1f} GiB free per process on its GPU"
    texts = _by_rank(_gather_text(reason))
    return "; ".join(texts) if texts else None


def _run_point(point: Point, ctx: _Context) -> dict:
    """Every rank runs this in step; every rank returns the same record."""
    proc, timer = ctx.proc, ctx.timer
    device, rank, ep = proc.device, proc.rank, point.ep
    record = new_record(point)
    label = point.label()
    reason = invalid_reason(point)
    if reason is not None:
        record.update(status="skipped", notes=[reason])
        return record
    n_sets = num_sets_for(_rank_set_bytes(point), ctx.l2_bytes)
    record.update(input_sets=n_sets, memory_estimate_gib=_rank_memory_bytes(point, n_sets) / GIB)
    reason = _fits(point, n_sets, ctx)
    if reason is not None:
        record.update(status="skipped", notes=[reason])
        return record

    ctx.progress.phase(label, "inputs")
    gen_cpu = torch.Generator().manual_seed(SEED)
    gen_dev = torch.Generator(device=device).manual_seed(SEED)
    owner = expert_owner(point.preset.num_experts, ep)
    sets = [make_set(point, device, gen_cpu, gen_dev, owner) for _ in range(n_sets)]
    _check_same_inputs(sets[0])
    pair_counts = [_pair_counts(s.ids, owner) for s in sets]
    send = _send_bytes(point, pair_counts)
    expected = _reference(point, sets[0], rank)
    inputs = [_rank_inputs(s, rank, c) for s, c in zip(sets, pair_counts)]
    del sets  # every other rank's inputs
    gc.collect()

    ctx.progress.phase(label, "workspace")
    size = moe_a2a_get_workspace_size_per_rank(ep, point.tokens, point.dispatch_row_bytes, point.combine_row_bytes)
    if proc.cuda:
        # A multiple of the allocation granularity gives contiguous rows (no padding between them).
        unit = cuda_workspace_granularity(device)
        size = -(-size // unit) * unit
    workspace = allocate_workspace(size, group=dist.group.WORLD, device=device)
    metainfo = moe_a2a_initialize(workspace, rank, ep, point.tokens)
    _meet(proc)  # every row initialized before any dispatch
    ours = _OursRank(point, rank, inputs, workspace, metainfo)
    base = _A2ABaseline(point, inputs, owner, device)

    ctx.progress.phase(label, "check")
    names = [name for name, _, _ in point.payload_rows()]
    errors, notes, eager_out = _check_ours(ours, expected, names)
    base_error = None
    if ctx.a2a_unavailable is None:
        base_error = _check_baseline(base, expected, names, rank)
    del expected
    errors = _by_rank(_gather_text("; ".join(errors)))
    record["notes"] += _by_rank(_gather_text("; ".join(notes)))
    if errors:
        record.update(status="FAIL", notes=record["notes"] + errors)
        return record
    base_errors = _by_rank(_gather_text(base_error or ""))
    base_ok = ctx.a2a_unavailable is None and not base_errors
    record["baseline_ok"] = base_ok
    record["notes"] += base_errors
    if base_ok:
        for i in range(1, n_sets):
            base.plans[i] = base.dispatch(i)[1]

    def measure(timed, before=None, after=None) -> float:
        return timer.measure(n_sets, timed, before, after)

    mine: dict[str, float] = {}  # this rank's medians, "kind/op"
    ctx.progress.phase(label, "eager")
    mine.update({f"eager/{op}": us for op, us in time_ops(measure, ours).items()})
    if base_ok:
        ctx.progress.phase(label, "all_to_all_single baseline")
        mine["baseline/dispatch"] = measure(base.dispatch)
        mine["baseline/combine"] = measure(base.combine)
        mine["baseline/round-trip"] = measure(base.round_trip)
    ceiling_bytes: dict[str, int] = {}  # per kind: bytes each rank sent over the link
    if ctx.a2a_unavailable is None:
        ctx.progress.phase(label, "all-to-all ceiling")
        for kind in dict.fromkeys(BASELINE_OF.values()):
            mean_bytes = sum(send[kind]) / ep
            if mean_bytes > 0:  # (nothing to send: no bandwidth to compare with)
                ceiling = _Ceiling(ep, mean_bytes, device)
                mine[f"ceiling/{kind}"] = measure(ceiling.run)
                ceiling_bytes[kind] = ceiling.remote_bytes
                del ceiling

    if proc.cuda:
        _meet(proc)
        release(device)
        ctx.progress.phase(label, "graph")
        graph_us, graph_notes, replay_differs = _measure_graphs(ours, n_sets, measure, eager_out, proc)
        mine.update({f"graph/{op}": us for op, us in graph_us.items()})
        record["notes"] += graph_notes
        if replay_differs:
            record["status"] = "FAIL"

    # A timed-out wait leaves its record in the workspace: a kernel that gave up
    # early must not pass for a fast one (graph replays raise nothing themselves).
    _meet(proc)
    timeout_error = ""
    try:
        check_errors(workspace)
    except RuntimeError as e:
        timeout_error = first_line(e)
    timeouts = _by_rank(_gather_text(timeout_error))
    if timeouts:
        record.update(status="FAIL", notes=record["notes"] + timeouts)
        return record

    keys = sorted(mine)
    gathered = _gather_floats([mine[k] for k in keys])  # the keys are the same on every rank
    by_rank = {k: gathered[:, j].tolist() for j, k in enumerate(keys)}
    record["ops"] = _op_results(send, by_rank, ceiling_bytes, ep)
    return record


def _measure_graphs(ours: _OursRank, n_sets: int, measure: Callable, eager_out: Tensor,
                    proc: Process) -> tuple[dict[str, float], list[str], bool]:
    """(this rank's median graph replay time per op, notes, whether a replay
    differed from the eager call on some rank); the same notes and verdict
    on every rank.

    Every rank captures first; only if every rank captured all graphs does
    any replay (a replay waits for the peers' replays)."""
    error = ""
    try:
        graphs = OpGraphs(ours, n_sets, _capture)
    except Exception as e:  # noqa: BLE001 - reported; the eager numbers stand
        error = f"{type(e).__name__}: {first_line(e)}"
    failures = _by_rank(_gather_text(error))
    if failures:
        return {}, ["graph capture failed, no graph timings: " + "; ".join(failures)], False
    graph_us = time_ops(measure, graphs)
    # The replays must compute what the (reference-checked) eager calls computed.
    _meet(proc)
    graphs.dispatch(0)
    same = torch.equal(graphs.combine(0), eager_out)
    failures = _by_rank(_gather_text("" if same else "graph replay of combine differs from the eager call"))
    return graph_us, failures, bool(failures)


def _op_results(send: dict[str, list[float]], by_rank: dict[str, list[float]], ceiling_bytes: dict[str, int],
                ep: int) -> dict[str, dict]:
    """The record's ops: times (max over ranks), bytes, bandwidths and ratios."""
    ops = {}
    for op in OPS:
        kind = BASELINE_OF[op]
        eager = max(by_rank[f"eager/{op}"])
        graph = max(by_rank[f"graph/{op}"]) if f"graph/{op}" in by_rank else None
        best = eager if graph is None else graph
        send_bytes = sum(send[op]) / ep
        gbps = send_bytes / (best * 1e-6) / 1e9 if send_bytes > 0 else None
        ceiling_us = max(by_rank[f"ceiling/{kind}"]) if f"ceiling/{kind}" in by_rank else None
        ceiling_gbps = None
        if ceiling_us is not None:
            ceiling_gbps = ceiling_bytes[kind] / (ceiling_us * 1e-6) / 1e9
        base = max(by_rank[f"baseline/{kind}"]) if f"baseline/{kind}" in by_rank else None
        ops[op] = {
            "send_bytes": send_bytes,
            "send_bytes_by_rank": send[op],
            "eager_us": eager,
            "eager_us_by_rank": by_rank[f"eager/{op}"],
            "graph_us": graph,
            "graph_us_by_rank": by_rank.get(f"graph/{op}"),
            "GBps_per_gpu": gbps,
            "GBps_from": "eager" if graph is None else "graph",
            "ceiling_us": ceiling_us,
            "ceiling_bytes_per_gpu": ceiling_bytes.get(kind),
            "ceiling_GBps_per_gpu": ceiling_gbps,
            "ceiling_ratio": None if gbps is None or ceiling_gbps is None else gbps / ceiling_gbps,
            "baseline_eager_us": base,
            "baseline_eager_us_by_rank": by_rank.get(f"baseline/{kind}"),
            "speedup_eager": None if base is None else base / eager,
            "speedup_graph": None if base is None or graph is None else base / graph,
        }
    return ops


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------


def _table(records: list[dict], applies: bool) -> str:
    header = ["preset", "ep", "tok/rank", "op", "eager us", "graph us", "send MB/GPU", "GB/s/GPU", "ceiling GB/s",
              "x ceiling", "base us", "speedup eager", "speedup graph", "check", "target"]
    rows = []
    for rec in records:
        name = rec["preset"] + (" fp8" if rec["fp8"] else "")
        notes = "; ".join(rec["notes"])
        check = f"{rec['status']}: {notes}" if notes else rec["status"]  # notes on a point's first row only
        if not rec["ops"]:
            rows.append([name, str(rec["ep"]), str(rec["tokens_per_rank"]), "-", *["-"] * 9, check, ""])
            continue
        for op, m in rec["ops"].items():
            rows.append([
                name, str(rec["ep"]), str(rec["tokens_per_rank"]), op, fmt(m["eager_us"], ".1f"),
                fmt(m["graph_us"], ".1f"), fmt(m["send_bytes"] / 1e6, ".3f"), fmt(m["GBps_per_gpu"], ".1f"),
                fmt(m["ceiling_GBps_per_gpu"], ".1f"), fmt(m["ceiling_ratio"], ".3f"),
                fmt(m["baseline_eager_us"], ".1f"), fmt(m["speedup_eager"], ".2f", "x"),
                fmt(m["speedup_graph"], ".2f", "x"), check, targets.distributed_row(rec, op, applies),
            ])
            check = rec["status"]
    return format_table(header, rows, left={0, 3, 13, 14})


def summary(paths: list[str]) -> int:
    """``bench-dist --summary``: one short table over the --json files of several launches."""
    header = ["preset", "ep", "tok/rank", "op", "us", "GB/s/GPU", "x ceiling", "speedup eager", "speedup graph",
              "target"]
    rows, lines = [], []
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
            applies, meaningful, points = data["targets_apply"], data["timings_meaningful"], data["points"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            # One line, not a traceback: a path that is not a --json file of bench-dist.
            print(f"bench-dist --summary: {path} is not a --json file of bench-dist ({type(e).__name__}: {e})",
                  file=sys.stderr)
            return 2
        if not meaningful:
            lines.append(f"{path}: {data['world']} processes on {data['gpus_visible']} GPU(s): timings not meaningful")
        for rec in points:
            name = rec["preset"] + (" fp8" if rec["fp8"] else "")
            if rec["status"] != "ok":
                rows.append([name, str(rec["ep"]), str(rec["tokens_per_rank"]), "-", *["-"] * 5,
                             f"{rec['status']}: {'; '.join(rec['notes'])}"])
                continue
            for op in ("dispatch", "combine", "combine-ws", "round-trip-ws"):
                m = rec["ops"][op]
                best = m["graph_us"] if m["graph_us"] is not None else m["eager_us"]
                rows.append([name, str(rec["ep"]), str(rec["tokens_per_rank"]), op, fmt(best, ".1f"),
                             fmt(m["GBps_per_gpu"], ".1f"), fmt(m["ceiling_ratio"], ".3f"),
                             fmt(m["speedup_eager"], ".2f", "x"), fmt(m["speedup_graph"], ".2f", "x"),
                             targets.distributed_row(rec, op, applies)])
    if not rows:
        print("bench-dist summary: no points", file=sys.stderr)
        return 1
    print(format_table(header, rows, left={0, 3, 9}))
    for line in lines:
        print(line)
    return 0


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


PROG = "torchrun --nproc-per-node N -m torch_moe_a2a bench-dist"
SUMMARY = "dispatch/combine speed, one rank per process (torchrun)"
DESCRIPTION = ("Dispatch/combine with one rank per process (cuda:LOCAL_RANK, or CPU processes with gloo), next to "
               "the same exchange with torch.distributed.all_to_all_single and NCCL's all-to-all on equal bytes "
               "(the link ceiling). ep = the number of processes. Rank 0 prints the table.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``bench-dist`` (also used by ``python -m torch_moe_a2a``'s subcommand)."""
    add_preset_argument(p, default=DEFAULT_PRESET)
    p.add_argument("--tokens", type=int_in_range(1, layout.MAX_NUM_TOKENS, "tokens"), nargs="+", action=DistinctValues,
                   default=None, help=f"tokens per rank (default {per_device(DEFAULT_TOKENS)})")
    p.add_argument("--iters", type=int_at_least(1, "iters"), default=None,
                   help=f"timed iterations per measurement (default {per_device(DEFAULT_ITERS_FOR)})")
    p.add_argument("--warmup", type=int_at_least(0, "warmup"), default=None,
                   help=f"untimed iterations first (default {per_device(DEFAULT_WARMUP_FOR)})")
    p.add_argument("--fp8", action="store_true", help="hidden states as float8_e4m3fn plus fp32 scales")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes every number here")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda:LOCAL_RANK if there is a GPU, else CPU processes (gloo, shared memory)")
    p.add_argument("--max-gib", type=positive_float("--max-gib"), default=None,
                   help="skip points needing more memory per rank than this (default 60 on CUDA, 4 on the CPU)")
    p.add_argument("--init-method", default="env://",
                   help="torch.distributed rendezvous (default env://: MASTER_ADDR/MASTER_PORT from torchrun)")
    p.add_argument("--summary", nargs="+", metavar="JSON",
                   help="no benchmark: print one short table over these --json files (no torchrun needed)")


def _probe_all_to_all(proc: Process) -> Optional[str]:
    """None when all_to_all_single works on the default group for tensors on
    this device (uneven splits, checked), else why not (the same on every rank)."""
    rank, world = proc.rank, proc.world
    error = ""
    try:
        send = torch.full((world * (world + 1) // 2,), rank, dtype=torch.uint8, device=proc.device)
        recv = torch.empty(world * (rank + 1), dtype=torch.uint8, device=proc.device)
        dist.all_to_all_single(recv, send, [rank + 1] * world, [d + 1 for d in range(world)])
        expected = torch.arange(world, dtype=torch.uint8).repeat_interleave(rank + 1)
        if not torch.equal(recv.cpu(), expected):
            error = "all_to_all_single returned wrong data"
    except (RuntimeError, NotImplementedError, ValueError) as e:
        error = f"{type(e).__name__}: {first_line(e)}"
    failures = _by_rank(_gather_text(error))
    return "; ".join(failures) if failures else None


def main(argv: Optional[list[str]] = None) -> int:
    """``bench-dist`` on its own: parse ``argv`` (default sys.argv[1:]) and run."""
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_arguments(parser)
    return run(parser, parser.parse_args(sys.argv[1:] if argv is None else argv))


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run as one rank of a torchrun launch; returns 0, or 1 when a point
    failed its check or errored (the same on every rank); 2 on a launch
    without torchrun. Argument errors go through ``parser.error`` (exit 2)."""
    if args.summary:
        return summary(args.summary)
    launch = _launch_env()
    if launch is None:
        print(f"bench-dist runs one rank per process: launch it with {LAUNCH_HINT} (RANK and WORLD_SIZE are not "
              "set). One process with simulated ranks: python -m torch_moe_a2a bench", file=sys.stderr)
        return 2
    rank, world, local_rank, local_world = launch
    if world < 2:
        print(f"bench-dist measures an exchange between processes: WORLD_SIZE is {world}, launch 2 or more "
              "(python -m torch_moe_a2a bench measures one process)", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: {NO_CUDA}")
    if rank == 0:  # the one that writes it (another host may not have the folder); torchrun ends the others
        check_output_path(parser, "--json", args.json)

    proc = _process(args.device, rank, world, local_rank, local_world)
    if proc.cuda:
        torch.cuda.set_device(proc.device)
    os.environ.setdefault(NVLS_ENV, NVLS_OFF)
    if not start_process_group("bench-dist", proc.backend, args.init_method, rank, world, timeout=PG_TIMEOUT):
        return 1
    try:
        return _run(args, proc)
    finally:
        dist.destroy_process_group()


def _run(args: argparse.Namespace, proc: Process) -> int:
    device, world = proc.device, proc.world
    # The defaults of the device the processes run on (add_arguments).
    if args.tokens is None:
        args.tokens = list(DEFAULT_TOKENS[device.type])
    if args.iters is None:
        args.iters = DEFAULT_ITERS_FOR[device.type]
    if args.warmup is None:
        args.warmup = DEFAULT_WARMUP_FOR[device.type]
    names = preset_names(args.preset, default=[DEFAULT_PRESET])
    points = [Point(PRESETS[n], world, t, args.fp8) for n in names for t in args.tokens]
    max_gib = DEFAULT_MAX_GIB[device.type] if args.max_gib is None else args.max_gib
    l2 = l2_bytes(device)
    leader = proc.rank == 0
    clock = Clock(device)
    a2a_unavailable = _probe_all_to_all(proc)

    where = f"{device_name(device)} (cuda:LOCAL_RANK)" if proc.cuda else device_name(device)
    lines = [f"torch-moe-a2a bench-dist: {world} processes (one rank each), {where}, backend {proc.backend}, "
             f"torch {torch.__version__}, {NVLS_ENV}={os.environ.get(NVLS_ENV)}; time = max over ranks of each "
             f"rank's median of {args.iters} iterations after {args.warmup}"]
    if not proc.timings_meaningful:
        lines.append(f"NOTE: {proc.ranks_per_gpu} processes share each GPU ({proc.gpus_visible} visible): their "
                     "kernels time-slice it, so the timings are NOT meaningful (correctness only)")
    if not proc.cuda:
        lines.append("NOTE: CPU processes: the timings are of the CPU backend, not of a GPU link")
    if a2a_unavailable is not None:
        lines.append(f"NOTE: baseline and ceiling skipped: all_to_all_single does not work on backend "
                     f"{proc.backend} for {device.type} tensors ({a2a_unavailable})")
    if leader:
        print("\n".join(lines), flush=True)

    progress = Progress(len(points)) if leader else QuietProgress()
    timer = Timer(proc, clock, args.iters, args.warmup)
    ctx = _Context(proc, timer, int(max_gib * GIB), l2, a2a_unavailable, progress)
    records = []
    # SIGINT or SIGTERM (torchrun passes the one it gets on to every worker)
    # ends the sweep after the point in progress, on every rank at the same
    # point; what was measured is reported as usual and the exit code says
    # which signal stopped it. A second signal drops the point in progress at
    # once (a way out of a step that hangs; torchrun's SIGKILL comes 30 s
    # after its signal): rank 0 reports the points before it without another
    # collective.
    agreed: Optional[int] = None
    with StopSignals() as stop, stop.ends_sweep():
        try:
            for point in points:
                records.append(_run_point(point, ctx))
                progress.step(point.label())
                _meet(proc)
                release(device)
                # Not into stop.signum: a signal that lands during the
                # agreement stays pending for the next point's.
                agreed = _stop_agreed(stop)
                if agreed is not None:
                    break
        finally:
            progress.close()
    # The agreed signal; else a second signal's, which ended a point (no
    # agreement then); a signal after the last point's agreement stopped nothing.
    stop.signum = agreed if agreed is not None else stop.signum if len(records) < len(points) else None

    if leader:
        print(_table(records, proc.targets_apply))
        print()
        print(targets.distributed_line(records, proc.targets_apply))
        stopped = stopped_line(stop, len(points), len(records))
        if stopped:
            print(stopped)
        sys.stdout.flush()
        if args.json:
            write_json(args.json, {
                "tool": "bench-dist", "world": world, "device": device_name(device),
                "device_type": device.type, "backend": proc.backend, "torch": torch.__version__,
                "gpus_visible": proc.gpus_visible, "ranks_per_gpu": proc.ranks_per_gpu,
                "timings_meaningful": proc.timings_meaningful, "targets_apply": proc.targets_apply,
                NVLS_ENV: os.environ.get(NVLS_ENV),
                "iters": args.iters, "warmup": args.warmup, "fp8": args.fp8, "max_gib": max_gib,
                "l2_bytes": l2, "all_to_all_single_unavailable": a2a_unavailable, "notes": lines[1:],
                "targets": targets.distributed_json(),
                "interrupted": stop.signum is not None,
                "stopped_by": signal.Signals(stop.signum).name if stop.signum is not None else None,
                "points_planned": len(points),
                "points": records,
            })
    if stop.signum is not None:
        return stop.exit_code
    failed = any(r["status"] in ("FAIL", "error") for r in records)
    return 1 if failed else 0
