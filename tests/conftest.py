"""Shared fixtures and helpers of the test suite.

Every test builds seeded random inputs on the CPU (identical on every device),
runs the kernels on the device under test and compares the results with the
plain-PyTorch oracle ``torch_moe_a2a.reference``. Receive planes and output
buffers are poisoned with random bytes before a kernel runs, so a row the kernel
forgot to write fails the comparison instead of passing on leftover data.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import pathlib
import sys
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

# A broken protocol must fail the suite, not hang it. Tests that exercise the
# timeout itself set a much shorter value.
os.environ.setdefault("MOE_A2A_TIMEOUT_S", "20")
# Simulated ranks spin on one GPU while the host launches their peers: a lazy
# module load on some kernel's first use could stall that host thread behind
# a spinning kernel. Load every module when CUDA starts instead.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
# ...and every simulated rank's stream on a hardware queue of its own.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import pytest
import torch

import torch_moe_a2a as a2a
from torch_moe_a2a import layout, reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


# ---- random data -------------------------------------------------------------


def make_generator(seed) -> torch.Generator:
    """A CPU generator seeded from an int or, stably across processes, from any
    object's str (Python's hash() of a str is salted per process)."""
    if not isinstance(seed, int):
        seed = zlib.crc32(str(seed).encode())
    return torch.Generator().manual_seed(seed)


def random_bytes(shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    """uint8 tensor of ``shape`` with every byte drawn uniformly (never a zero fill)."""
    return torch.randint(0, 256, tuple(shape), dtype=torch.uint8, generator=gen)


def random_tensor(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A CPU tensor of ``shape``/``dtype`` made of random bytes: for float dtypes
    that includes NaN and Inf bit patterns, which is the point for data that is
    only moved (compared bytewise), never summed."""
    shape = tuple(shape)
    itemsize = dtype.itemsize
    if len(shape) == 0:
        raise ValueError("payload rows need at least one dimension")
    if math.prod(shape) == 0:  # no bytes to draw (a byte view of an empty tensor has no strides to divide)
        return torch.empty(shape, dtype=dtype)
    raw = random_bytes(shape[:-1] + (shape[-1] * itemsize,), gen)
    return raw.view(dtype)


def random_values(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Finite random values (for tensors that are summed: hidden states, weights)."""
    return torch.randn(tuple(shape), generator=gen).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (CPU, contiguous), so fp8 and NaN patterns compare exactly."""
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:  # counts as contiguous whatever its strides, which view() may then refuse
        return torch.empty(0, dtype=torch.uint8)
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8)


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = as_bytes(actual), as_bytes(expected)
    if not torch.equal(a, e):
        diff = (a != e).nonzero()
        first = tuple(diff[0].tolist())
        raise AssertionError(
            f"{what}: {diff.shape[0]} bytes differ, first at byte index {first} "
            f"(got {a[first].item()}, expected {e[first].item()})"
        )


# ---- problem descriptions ----------------------------------------------------


@dataclass(frozen=True)
class PayloadSpec:
    """One extra dispatch payload: dtype and per-token trailing shape."""

    dtype: torch.dtype
    trailing: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.trailing) * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.trailing)}"


@dataclass(frozen=True)
class Case:
    """One expert-parallel problem. Payload 0 is the hidden state, payload 1 the
    expert ids (int32 [n, top_k]), payload 2 the router weights (fp32 [n, top_k]),
    then ``extras``: the layout the toy MoE of the reference consumes."""

    ep_size: int
    tokens: tuple[int, ...]  # local_num_tokens of every rank
    top_k: int
    num_experts: int
    hidden: int = 64
    hidden_dtype: torch.dtype = torch.bfloat16
    extras: tuple[PayloadSpec, ...] = ()
    runtime_max: Optional[int] = None  # default: max(tokens), at least 1
    max_num_tokens: Optional[int] = None  # default: runtime_max
    invalid_fraction: float = 0.0
    negative_fraction: float = 0.0

    def __post_init__(self):
        assert len(self.tokens) == self.ep_size

    @property
    def T(self) -> int:
        return self.runtime_max if self.runtime_max is not None else max(1, max(self.tokens))

    @property
    def max_tokens(self) -> int:
        return self.max_num_tokens if self.max_num_tokens is not None else self.T

    def payload_specs(self) -> list[PayloadSpec]:
        return [
            PayloadSpec(self.hidden_dtype, (self.hidden,)),
            PayloadSpec(torch.int32, (self.top_k,)),
            PayloadSpec(torch.float32, (self.top_k,)),
            *self.extras,
        ]

    @property
    def dispatch_bytes(self) -> int:
        return sum(s.row_bytes for s in self.payload_specs())

    @property
    def combine_bytes(self) -> int:
        return self.hidden * self.hidden_dtype.itemsize

    def __str__(self) -> str:
        extras = "+".join(str(s) for s in self.extras) or "none"
        return (
            f"ep{self.ep_size}-tok{'_'.join(map(str, self.tokens))}-T{self.T}-k{self.top_k}"
            f"-E{self.num_experts}-h{self.hidden}{str(self.hidden_dtype).removeprefix('torch.')}-x{extras}"
        )


@dataclass
class Inputs:
    """Per-rank CPU inputs of one dispatch."""

    ids: list[torch.Tensor]  # [rank] int32 [n, top_k]
    payloads: list[list[torch.Tensor]]  # [rank][payload]

    def to(self, device) -> "Inputs":
        return Inputs(
            [t.to(device) for t in self.ids], [[p.to(device) for p in ps] for ps in self.payloads]
        )


def make_inputs(case: Case, gen: torch.Generator, tokens: Optional[Sequence[int]] = None) -> Inputs:
    """Seeded inputs for ``case`` (``tokens`` overrides the per-rank token counts)."""
    tokens = case.tokens if tokens is None else tokens
    ids, payloads = [], []
    for n in tokens:
        routing = reference.random_routing(
            n,
            case.top_k,
            case.num_experts,
            gen,
            invalid_fraction=case.invalid_fraction,
            negative_fraction=case.negative_fraction,
        )
        assert routing.dtype == torch.int32 and tuple(routing.shape) == (n, case.top_k)
        hidden = random_values((n, case.hidden), case.hidden_dtype, gen)
        weights = torch.rand((n, case.top_k), generator=gen) + 0.5  # never zero
        extras = [random_tensor((n, *s.trailing), s.dtype, gen) for s in case.extras]
        ids.append(routing)
        payloads.append([hidden, routing.clone(), weights, *extras])
    return Inputs(ids, payloads)


def make_sim(case: Case, device, *, eplb_n: int = 0, timeout_s=None, dispatch_bytes=None) -> a2a.SimulatedEP:
    return a2a.SimulatedEP(
        case.ep_size,
        case.max_tokens,
        dispatch_bytes_per_token=case.dispatch_bytes if dispatch_bytes is None else dispatch_bytes,
        combine_bytes_per_token=case.combine_bytes,
        eplb_stats_num_experts=eplb_n,
        device=device,
        timeout_s=timeout_s,
    )


# ---- poisoning -----------------------------------------------------------------


def poison_call_regions(workspace: torch.Tensor, gen: torch.Generator) -> None:
    """Fill every row's per-call region (everything after the rank header) with
    random bytes. Only legal while no rank is inside a dispatch/combine pair."""
    region = workspace[:, layout.HEADER_BYTES :]
    region.copy_(random_bytes(region.shape, gen).to(workspace.device))


def poison_padding(payload: torch.Tensor, counts: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``payload`` [ep_size, T, *] with every padding row (j >= counts[s]) replaced
    by random bytes; the valid rows are kept. Returns a new tensor on payload's device."""
    counts = counts.cpu()
    out = payload.cpu().clone()
    garbage = random_tensor(out.shape, out.dtype, gen)
    pad = torch.arange(out.shape[1])[None, :] >= counts[:, None].long()  # [ep_size, T]
    out[pad] = garbage[pad]
    return out.to(payload.device)


# ---- one round trip through SimulatedEP -------------------------------------------


@dataclass
class RoundTrip:
    recv: list[list[torch.Tensor]]  # [rank][payload] CPU copies of the receive views
    counts: list[torch.Tensor]  # [rank] CPU int32 [ep_size]
    offsets: list[int]  # [rank] combine_payload_offset
    eplb: list[Optional[torch.Tensor]]  # [rank] CPU copies of eplb_gathered_stats
    outputs: list[Optional[torch.Tensor]]  # [rank] CPU combine outputs (None for a dead rank)
    ref: reference.RefDispatch
    ref_outputs: list[torch.Tensor]
    dispatch_results: list = field(default_factory=list)  # raw moe_a2a_dispatch results
    # What a further combine of the round needs (combine_again):
    payloads: dict = field(default_factory=dict)  # [rank] the combine payload (on the device; a workspace view in place)
    ref_expert_out: list = field(default_factory=list)  # [rank] the reference's expert outputs
    tokens: list = field(default_factory=list)  # [rank] local_num_tokens
    runtime_max: int = 0
    active: list = field(default_factory=list)  # the ranks that call
    mask_kwargs: dict = field(default_factory=dict)  # the rank-mask arguments of the round's calls


def combine_payload_in_workspace(
    sim: a2a.SimulatedEP, rank: int, offset: int, shape: Sequence[int], dtype: torch.dtype, values: torch.Tensor
) -> torch.Tensor:
    """Rank ``rank``'s combine payload placed in its workspace row (for
    ``payload_in_workspace=True``): the ``shape`` (``[ep_size, T, hidden]``) view
    of ``dtype`` at byte ``offset`` (the dispatch's combine_payload_offset),
    filled with ``values`` (on the workspace's device)."""
    ep, T, hidden = shape
    end = offset + ep * T * hidden * dtype.itemsize
    view = a2a.moe_a2a_wrap_payload_tensor_in_workspace(sim.workspace[rank], [ep, T], offset, end, dtype)
    assert tuple(view.shape) == (ep, T, hidden)
    return view.copy_(values)


def check_dispatch(rt_recv, rt_counts, ref: reference.RefDispatch, specs, runtime_max, ranks) -> None:
    """Receive counts exact, receive views shaped [ep_size, T, *trail], valid rows
    bytewise equal to the reference."""
    ep_size = len(ref.recv_counts)
    for d in ranks:
        assert torch.equal(rt_counts[d].cpu(), ref.recv_counts[d].to(torch.int32)), (
            f"rank {d}: recv counts {rt_counts[d].tolist()} != reference {ref.recv_counts[d].tolist()}"
        )
        for i, spec in enumerate(specs):
            view = rt_recv[d][i]
            assert tuple(view.shape) == (ep_size, runtime_max, *spec.trailing), f"rank {d} payload {i} shape"
            assert view.dtype == spec.dtype
            for s in range(ep_size):
                n = int(ref.recv_counts[d][s])
                assert_bytes_equal(view[s, :n], ref.recv[d][i][s, :n], f"rank {d} payload {i} rows from {s}")


def round_trip(
    sim: a2a.SimulatedEP,
    case: Case,
    inputs: Inputs,
    gen: torch.Generator,
    *,
    runtime_max: Optional[int] = None,
    payload_in_workspace: bool = False,
    region_as_tensor: bool = False,
    output_dtype: Optional[torch.dtype] = None,
    use_output: bool = False,
    eplb_stats: Optional[list[torch.Tensor]] = None,
    active_ranks: Optional[Sequence[int]] = None,
    poison: bool = True,
    combine_kwargs: Optional[Callable[[int], dict]] = None,
    low_precision: Optional[str] = None,
    expected: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None,
    transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> RoundTrip:
    """dispatch -> toy MoE -> combine on every (active) rank of ``sim``, checked
    against the reference at every step (counts, valid receive rows, outputs,
    bitwise). Ranks outside ``active_ranks`` never call (a dead rank).
    ``combine_kwargs(rank)``: more keyword arguments of rank's combine;
    ``low_precision`` goes to reference_combine; ``expected(rank, ref_out)``
    maps the reference's output to the one expected (a quantization);
    ``transform`` is applied to every rank's expert outputs (special values).
    ``region_as_tensor``: the expert outputs written into the combine region,
    whose view is passed as a tensor (``payload_in_workspace`` False)."""
    ep, device = case.ep_size, sim.workspace.device
    T = case.T if runtime_max is None else runtime_max
    tokens = [int(t.shape[0]) for t in inputs.ids]
    active = list(range(ep)) if active_ranks is None else sorted(active_ranks)
    mask_kwargs = {}
    if active_ranks is not None:
        mask_kwargs = dict(enable_rank_mask=True, active_rank_mask=a2a.moe_a2a_active_rank_mask(active, ep))
    dev = inputs.to(device)
    dev_eplb = None if eplb_stats is None else [s.to(device) for s in eplb_stats]
    if poison:
        poison_call_regions(sim.workspace, gen)

    def dispatch(rank):
        if rank not in active:
            return None
        return a2a.moe_a2a_dispatch(
            dev.ids[rank],
            dev.payloads[rank],
            sim.workspace,
            sim.metainfo[rank],
            T,
            rank,
            ep,
            case.top_k,
            case.num_experts,
            eplb_local_stats=None if dev_eplb is None else dev_eplb[rank],
            **mask_kwargs,
        )

    results = sim.run(dispatch)
    recv = [None if r is None else [v.cpu().clone() for v in r[0]] for r in results]
    offsets = [None if r is None else int(r[1]) for r in results]
    eplb = [None if r is None or r[2] is None else r[2].cpu().clone() for r in results]
    counts = [
        a2a.moe_a2a_get_recv_counts(sim.workspace, sim.metainfo[rank], rank).cpu().clone() if rank in active else None
        for rank in range(ep)
    ]

    ref = reference.reference_dispatch(
        inputs.ids,
        inputs.payloads,
        ep_size=ep,
        num_experts=case.num_experts,
        runtime_max_tokens_per_rank=T,
        active_ranks=None if active_ranks is None else active,
    )
    check_dispatch(recv, counts, ref, case.payload_specs(), T, active)

    def moe(rank, views, cnt):
        out = reference.toy_moe(
            views[0], views[1], views[2], cnt, ep_rank=rank, ep_size=ep, num_experts=case.num_experts
        )
        return out if transform is None else transform(out)

    ref_expert_out = [moe(r, ref.recv[r], ref.recv_counts[r]) for r in range(ep)]
    payloads = {}
    for r in active:
        # The kernel path computes its MoE from its own receive views (CPU copies:
        # toy_moe is not under test, so it runs in one place), then its padding
        # rows are poisoned: combine must read valid rows only.
        expert_out = poison_padding(moe(r, recv[r], counts[r]), counts[r], gen)
        if payload_in_workspace or region_as_tensor:
            payloads[r] = combine_payload_in_workspace(
                sim, r, offsets[r], (ep, T, case.hidden), case.hidden_dtype, expert_out.to(device)
            )
        else:
            payloads[r] = expert_out.to(device)

    rt = RoundTrip(recv, counts, offsets, eplb, [], ref, [], results, payloads, ref_expert_out, tokens, T, active,
                   mask_kwargs)
    rt.outputs, rt.ref_outputs = combine_again(
        sim, case, rt, gen, payload_in_workspace=payload_in_workspace, output_dtype=output_dtype,
        use_output=use_output, combine_kwargs=combine_kwargs, low_precision=low_precision, expected=expected)
    return rt


def combine_again(
    sim: a2a.SimulatedEP,
    case: Case,
    rt: "RoundTrip",
    gen: torch.Generator,
    *,
    payload_in_workspace: bool = False,
    output_dtype: Optional[torch.dtype] = None,
    use_output: bool = False,
    combine_kwargs: Optional[Callable[[int], dict]] = None,
    low_precision: Optional[str] = None,
    expected: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None,
) -> tuple[list[Optional[torch.Tensor]], list[torch.Tensor]]:
    """A combine of ``rt``'s dispatch on every active rank (round_trip's, or
    one more: FlashInfer's repeated combines) of the expert outputs in
    ``rt.payloads``, checked bitwise against the reference; returns the
    outputs (CPU copies, None for a dead rank) and the reference's. The
    arguments are round_trip's."""
    ep, device, T, tokens = case.ep_size, sim.workspace.device, rt.runtime_max, rt.tokens
    out_dtype = case.hidden_dtype if output_dtype is None else output_dtype
    outs = {}
    if use_output:
        for r in rt.active:
            outs[r] = random_tensor((tokens[r], case.hidden), out_dtype, gen).to(device)

    def combine(rank):
        if rank not in rt.active:
            return None
        return a2a.moe_a2a_combine(
            rt.payloads[rank],
            tokens[rank],
            sim.workspace,
            sim.metainfo[rank],
            T,
            rank,
            ep,
            case.top_k,
            rt.offsets[rank],
            **{
                "payload_in_workspace": payload_in_workspace,
                "output_dtype": output_dtype,
                "output": outs.get(rank),
                **rt.mask_kwargs,
                **({} if combine_kwargs is None else combine_kwargs(rank)),
            },
        )

    combined = sim.run(combine)
    ref_outputs = reference.reference_combine(rt.ref_expert_out, rt.ref, tokens,
                                              output_dtype=None if expected else output_dtype,
                                              low_precision=low_precision)
    if expected is not None:
        ref_outputs = [expected(r, o) for r, o in enumerate(ref_outputs)]
    outputs = []
    for r in range(ep):
        if r not in rt.active:
            outputs.append(None)
            continue
        got = combined[r]
        if use_output:
            assert got is outs[r] or got.data_ptr() == outs[r].data_ptr(), "combine(output=) must return output"
        assert got.device.type == torch.device(device).type
        outputs.append(got.cpu().clone())
        assert_bytes_equal(outputs[r], ref_outputs[r], f"rank {r} combine output")
    return outputs, ref_outputs


def with_expert_outputs_scaled(rt: "RoundTrip", factor: float) -> "RoundTrip":
    """``rt`` with new payload tensors (never workspace views: rewriting those
    between two combines of a round races the peers' pulls) holding its expert
    outputs times ``factor``, for a repeated combine of other rows."""
    def scaled(t: torch.Tensor) -> torch.Tensor:
        return (t.float() * factor).to(t.dtype)
    return dataclasses.replace(rt, payloads={r: scaled(p) for r, p in rt.payloads.items()},
                               ref_expert_out=[scaled(o) for o in rt.ref_expert_out])


def header_i32(workspace: torch.Tensor, rank: int, offset: int) -> int:
    """The int32 at byte ``offset`` of rank ``rank``'s header."""
    return int(workspace[rank, offset : offset + 4].cpu().view(torch.int32)[0])


def dispatch_claims(workspace: torch.Tensor, rank: int) -> list[int]:
    """The CLAIM_COUNTERS uint32 copy-task counters of a large dispatch in rank ``rank``'s header."""
    return [header_i32(workspace, rank, layout.claim_counter_offset(c)) for c in range(layout.CLAIM_COUNTERS)]


def header_i64(workspace: torch.Tensor, rank: int, offset: int) -> int:
    return int(workspace[rank, offset : offset + 8].cpu().view(torch.int64)[0])


def ws_snapshot(workspace: torch.Tensor) -> torch.Tensor:
    return workspace.detach().cpu().clone()


def assert_ws_unchanged(workspace: torch.Tensor, snapshot: torch.Tensor) -> None:
    now = workspace.detach().cpu()
    if not torch.equal(now, snapshot):
        rows, cols = (now != snapshot).nonzero(as_tuple=True)
        raise AssertionError(f"workspace changed: {rows.numel()} bytes, first at row {rows[0]} byte {cols[0]}")


# ---- one rank per process ------------------------------------------------------------


def ep_mapping(rank: int, world: int) -> "a2a.Mapping":
    """The pure expert-parallel Mapping the real clients build (SGLang's
    FlashinferDispatcher, FlashInfer's moe_ep nvlink_common): every rank of the
    world one EP rank."""
    return a2a.Mapping(world_size=world, rank=rank, gpus_per_node=world, tp_size=world, moe_ep_size=world)


class TorchDistributedCommBackend:
    """A FlashInfer ``CommBackend`` on torch.distributed, written from the
    interface SGLang's ``TorchDistributedCommBackend``
    (sglang/srt/layers/moe/token_dispatcher/flashinfer_utils.py) and vLLM's
    ``CustomCommunicator`` (vllm/distributed/device_communicators/mnnvl_compat.py)
    implement: object collectives (pickled through all_gather_object), and a
    Split that returns the group itself (the group already is the EP group)."""

    def __init__(self, group):
        import torch.distributed as dist

        self._dist = dist
        self._group = group

    def Get_rank(self) -> int:
        return self._group.rank()

    def Get_size(self) -> int:
        return self._group.size()

    def allgather(self, data):
        gathered = [None] * self.Get_size()
        self._dist.all_gather_object(gathered, data, group=self._group)
        return gathered

    def bcast(self, data, root: int = 0):
        objects = [data]
        self._dist.broadcast_object_list(objects, src=root, group=self._group)
        return objects[0]

    def barrier(self) -> None:
        self._dist.barrier(group=self._group)

    def Split(self, color: int, key: int):
        return self


class MnnvlConfig:
    """FlashInfer's ``MnnvlConfig`` as its callers build it: ``MnnvlConfig(comm_backend=...)``."""

    def __init__(self, comm_backend=None):
        self.comm_backend = comm_backend



# Rank processes are forked from a fork server (multiprocessing's
# "forkserver") that imported torch and this package once: spawned ranks
# imported torch each (about 3 s of CPU a rank, most of the multi-process
# tests' time on a CI machine's two cores). The server is a fresh interpreter
# started by this one, not a fork of it, so a rank inherits nothing of this
# process's state (its CUDA context included), as with spawn. Its one other
# thread, numpy's OpenBLAS server, is made fork-safe by OpenBLAS itself.
RANK_START_METHOD = "forkserver"
multiprocessing.get_context(RANK_START_METHOD).set_forkserver_preload(["torch", "torch.distributed", "torch_moe_a2a"])


def start_ranks(fn, args: tuple, nprocs: int, join: bool = True, start_method: str = RANK_START_METHOD):
    """torch.multiprocessing.start_processes(fn, args, nprocs): fn(rank, *args)
    in each of nprocs processes, from the fork server unless ``start_method``
    says otherwise; with join=False the ProcessContext to join."""
    import torch.multiprocessing as mp

    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method=start_method)


def _rank_entry(target, rank: int, world: int, report_dir: str, args: tuple, env: dict) -> None:
    """Runs in a rank process: ``env`` applied to its environment (a forked
    rank has the fork server's), then target(rank, world, *args); on an
    exception its traceback goes to report_dir/rank<r>.err and the process
    exits with code 1 at once (no teardown: a failed rank must not hang in
    it)."""
    try:
        _set_environ(env)
        target(rank, world, *args)
    except BaseException:
        pathlib.Path(report_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _set_environ(values: dict) -> None:
    """os.environ[k] = v for each item; v None: unset k."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def open_fds() -> dict:
    """This process's open file descriptors: {number: what it points to}."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor
            pass
    return fds


def run_ranks(target, world: int, args: tuple, *, report_dir, timeout_s: float, exit_codes: Optional[dict] = None,
              env: Optional[dict] = None, grace_s: float = 30.0) -> None:
    """Run ``target(rank, world, *args)`` (a module-level function) in
    ``world`` fresh processes (from the fork server: nothing of this process's
    CUDA state is inherited; ``env`` changes their environment, value None
    unsets) and wait for all of them,
    at most ``timeout_s`` seconds, and at most ``grace_s`` more once one of
    them failed (its peers may wait for it in a collective). Kills the ones
    still running then. Raises AssertionError naming every rank that hung,
    exited with a code other than ``exit_codes.get(rank, 0)``, or raised (with
    its traceback)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context(RANK_START_METHOD)
    procs = [ctx.Process(target=_rank_entry, args=(target, r, world, str(report_dir), args, env or {}), name=f"rank{r}")
             for r in range(world)]
    expected = {r: (exit_codes or {}).get(r, 0) for r in range(world)}
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode is not None and p.exitcode != expected[r] for r, p in enumerate(procs)):
            deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.1)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join(10)
    problems = []
    for r, p in enumerate(procs):
        if r in hung:
            problems.append(f"rank {r}: still running when the wait ended, killed")
        elif p.exitcode != expected[r]:
            problems.append(f"rank {r}: exit code {p.exitcode}, expected {expected[r]}")
        err = pathlib.Path(report_dir, f"rank{r}.err")
        if err.exists():
            problems.append(f"rank {r} raised:\n{err.read_text()}")
    assert not problems, "\n".join(problems)
