"""One rank per process on CUDA: allocate_workspace(group=..., device="cuda")
maps every process's row (CUDA virtual memory) into every process.

Devices (_rank_devices): rank r runs on cuda:r when there are at least as
many GPUs as ranks (one process per GPU: peers' rows are reached through
peer access, NVLink on the machines this is for), else every rank runs on
cuda:0 and the processes time-slice one GPU (a few ms per round trip):
sizes are small and rounds few. MOE_A2A_TEST_ONE_GPU_PER_RANK overrides the
choice: 1 = one GPU per rank (a test with more ranks than GPUs skips), 0 =
every rank on cuda:0. Worlds of 2, 4 and 8 ranks join the parametrizations
where that many GPUs exist, so a one-GPU machine runs the same tests as
before. Each process builds every rank's seeded inputs, computes the
reference exchange itself and compares its own results bitwise (receive
rows and counts, EPLB stats, combine output), with its call regions and
output buffers poisoned first. The parent only starts the processes (spawn:
it hands no CUDA state down), bounds their time, and reports each one's exit
code and error text (conftest.run_ranks).
"""

import datetime
import json
import logging
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from conftest import (
    Case,
    PayloadSpec,
    assert_bytes_equal,
    ep_mapping,
    make_generator,
    make_inputs,
    open_fds,
    poison_padding,
    random_bytes,
    random_tensor,
    run_ranks,
)

import torch_moe_a2a as a2a
from torch_moe_a2a import layout, reference
from torch_moe_a2a.workspace import FABRIC, HANDLE_TYPE_ENV, POSIX_FD

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHARED_DEVICE = "cuda:0"  # every rank's device when the ranks share one GPU
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ONE_GPU_PER_RANK_ENV = "MOE_A2A_TEST_ONE_GPU_PER_RANK"
# Worlds that run one process per GPU where enough GPUs exist (2, 4 and 8, as scripts/multi_gpu.sh runs them).
MULTI_GPU_WORLDS = (2, 4, 8)
CASES = {
    1: Case(1, (7,), 2, 3, hidden=64, runtime_max=8),
    2: Case(2, (9, 4), 3, 6, hidden=64, runtime_max=12, extras=(PayloadSpec(torch.float8_e4m3fn, (32,)),)),
    3: Case(3, (6, 0, 10), 2, 7, hidden=32, runtime_max=10, max_num_tokens=12,
            extras=(PayloadSpec(torch.int16, (3,)),)),
    4: Case(4, (5, 0, 11, 8), 4, 10, hidden=128, runtime_max=11, max_num_tokens=16,
            extras=(PayloadSpec(torch.uint8, (7,)),)),
    8: Case(8, (5, 0, 11, 8, 1, 12, 3, 7), 4, 20, hidden=64, runtime_max=12, max_num_tokens=16,
            extras=(PayloadSpec(torch.float16, (5,)),)),
}
EPLB_N = 5
ROUNDS = 2  # per API (functional, MoeAlltoAll): the second reuses the workspace
MASKED_RANK = 1  # rank mask test: never calls dispatch/combine
VICTIM_RANK = 1  # fault test: dies in the middle
KILLED_EXIT = 17  # the victim's exit code
FAULT_TIMEOUT_S = 3.0  # MOE_A2A_TIMEOUT_S of the fault test
# A survivor raises within: the dispatch wait, maybe a combine wait, and
# time-slicing with the other processes; hanging would take forever.
FAULT_RAISE_WITHIN_S = 2 * FAULT_TIMEOUT_S + 20.0
CYCLES = 100
WARMUP_CYCLES = 3
# Lazily opened driver files may add a descriptor or two once; a leak per
# cycle would add at least CYCLES.
FD_SLACK = 2
PROCESS_TIMEOUT_S = 200.0  # per test: spawn, import, CUDA init and the work
PG_TIMEOUT = datetime.timedelta(seconds=120)

# Environment of the ranks: one rank per process never needs the simulated
# ranks' eager module loading (conftest), which costs every process startup
# time and GPU memory.
RANK_ENV = {"CUDA_MODULE_LOADING": "LAZY", "MOE_A2A_TIMEOUT_S": "20", HANDLE_TYPE_ENV: None,
            # NVLink multicast stays off on shared GPU hosts (it can take their GPUs out of service).
            "NCCL_NVLS_ENABLE": "0"}


def _worlds(*base: int) -> list[int]:
    """``base`` (what a one-GPU machine runs) plus each of MULTI_GPU_WORLDS
    that this machine has a GPU per rank for."""
    return sorted(set(base) | {w for w in MULTI_GPU_WORLDS if 1 < w <= GPUS})


def _rank_devices(world: int) -> tuple[str, ...]:
    """Each rank's device: cuda:r with a GPU per rank, else cuda:0 for all
    (MOE_A2A_TEST_ONE_GPU_PER_RANK: 1 forces the first, skipping where the
    GPUs are too few; 0 forces the second)."""
    mode = os.environ.get(ONE_GPU_PER_RANK_ENV, "").strip()
    if mode not in ("", "0", "1"):
        raise ValueError(f"{ONE_GPU_PER_RANK_ENV}={mode!r}; expected 1, 0 or unset")
    if mode == "1" and world > GPUS:
        pytest.skip(f"{ONE_GPU_PER_RANK_ENV}=1: {world} ranks need {world} GPUs, {GPUS} visible")
    if mode != "0" and world <= GPUS:
        return tuple(f"cuda:{r}" for r in range(world))
    return (SHARED_DEVICE,) * world


# ---- in the rank processes ---------------------------------------------------------------


def _init(rank: int, world: int, init_file: str, devices: tuple[str, ...], backend: str = "gloo") -> torch.device:
    """Logging, this rank's device (``devices[rank]``, made current) and the process group."""
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(name)s: %(message)s")
    logging.getLogger("torch_moe_a2a").setLevel(logging.INFO)  # which handle type, on failure
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=PG_TIMEOUT)
    return device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _workspace_size(case: Case, device: torch.device) -> tuple[int, int]:
    """(bytes the case needs per rank, that rounded up to the CUDA granularity)."""
    need = a2a.moe_a2a_get_workspace_size_per_rank(case.ep_size, case.max_tokens, case.dispatch_bytes,
                                                   case.combine_bytes, EPLB_N)
    unit = a2a.cuda_workspace_granularity(device) if device.type == "cuda" else layout.ALIGN
    return need, -(-need // unit) * unit


def _check_fresh_workspace(workspace: torch.Tensor, rank: int, world: int, size: int, device: torch.device) -> None:
    """Shape, layout, device, and a zero own row (the peers' rows may already
    be initialized: allocate_workspace may have returned on them first)."""
    assert tuple(workspace.shape) == (world, size) and workspace.dtype == torch.uint8
    assert workspace.device == device, f"workspace on {workspace.device}, expected {device}"
    assert workspace.is_contiguous() and workspace.stride() == (size, 1)
    nonzero = int(workspace[rank].count_nonzero())
    assert nonzero == 0, f"a fresh workspace's own row has {nonzero} nonzero bytes"


def _poison_own_call_region(workspace: torch.Tensor, rank: int, gen: torch.Generator) -> None:
    """Random bytes over this rank's per-call region. The caller makes sure no
    peer is inside a dispatch/combine pair (barrier before, sync + barrier after)."""
    region = workspace[rank, layout.HEADER_BYTES:]
    region.copy_(random_bytes(region.shape, gen).to(workspace.device))


class _Inputs:
    """Every rank's seeded inputs for ROUNDS rounds of one API, and EPLB stats."""

    def __init__(self, case: Case, seed: str, eplb: bool):
        gen = make_generator(seed)
        self.rounds = [make_inputs(case, gen) for _ in range(ROUNDS)]
        self.stats = [
            [torch.randint(1, 1 << 30, (EPLB_N,), dtype=torch.int32, generator=gen) for _ in range(case.ep_size)]
            if eplb else None
            for _ in range(ROUNDS)
        ]


def _check_round(case: Case, x, stats, rank: int, recv, counts, eplb, out, what: str, active=None) -> None:
    """This rank's results of one round (CPU copies) against the reference
    over all ranks, computed here."""
    world = case.ep_size
    ref = reference.reference_dispatch(x.ids, x.payloads, ep_size=world, num_experts=case.num_experts,
                                       runtime_max_tokens_per_rank=case.T, active_ranks=active)
    assert torch.equal(counts, ref.recv_counts[rank].to(torch.int32)), (
        f"{what}: rank {rank} recv counts {counts.tolist()} != reference {ref.recv_counts[rank].tolist()}"
    )
    for i, (spec, view, expected) in enumerate(zip(case.payload_specs(), recv, ref.recv[rank])):
        assert tuple(view.shape) == (world, case.T, *spec.trailing), f"{what}: payload {i} shape {tuple(view.shape)}"
        for s in range(world):
            n = int(ref.recv_counts[rank][s])
            assert_bytes_equal(view[s, :n], expected[s, :n], f"{what}: rank {rank} payload {i} rows from {s}")
    if stats is not None:
        assert eplb is not None and torch.equal(eplb, torch.stack(stats)), f"{what}: rank {rank} EPLB stats {eplb}"
    expert_out = [reference.toy_moe(*ref.recv[r][:3], ref.recv_counts[r], ep_rank=r, ep_size=world,
                                    num_experts=case.num_experts) for r in range(world)]
    expected_out = reference.reference_combine(expert_out, ref, list(case.tokens))[rank]
    assert_bytes_equal(out, expected_out, f"{what}: rank {rank} combine output")


def _expert_output(case: Case, rank: int, recv, counts, gen, device) -> torch.Tensor:
    """The toy MoE of this rank's received rows (on the CPU copies: it is not
    under test), padding rows poisoned: combine must read valid rows only."""
    out = reference.toy_moe(recv[0], recv[1], recv[2], counts, ep_rank=rank, ep_size=case.ep_size,
                            num_experts=case.num_experts)
    return poison_padding(out, counts, gen).to(device)


def _functional_round(case, x, stats, rank, workspace, metainfo, device, gen, what, mask=None):
    """dispatch -> toy MoE -> combine through the functional API, into a
    poisoned output buffer; returns the CPU copies _check_round takes."""
    mask_kwargs = {} if mask is None else dict(enable_rank_mask=True, active_rank_mask=mask)
    recv, offset, eplb = a2a.moe_a2a_dispatch(
        x.ids[rank].to(device), [p.to(device) for p in x.payloads[rank]], workspace, metainfo, case.T, rank,
        case.ep_size, case.top_k, case.num_experts,
        eplb_local_stats=None if stats is None else stats[rank].to(device), **mask_kwargs)
    counts = a2a.moe_a2a_get_recv_counts(workspace, metainfo, rank).cpu().clone()
    recv = [v.cpu().clone() for v in recv]
    eplb = None if eplb is None else eplb.cpu().clone()
    payload = _expert_output(case, rank, recv, counts, gen, device)
    output = random_tensor((case.tokens[rank], case.hidden), case.hidden_dtype, gen).to(device)
    out = a2a.moe_a2a_combine(payload, case.tokens[rank], workspace, metainfo, case.T, rank, case.ep_size,
                              case.top_k, offset, output=output, **mask_kwargs)
    assert out.data_ptr() == output.data_ptr(), f"{what}: combine(output=) must return output"
    return recv, counts, eplb, out.cpu()


def _moe_round(case, x, stats, rank, moe, device, gen, mask=None):
    mask_kwargs = {} if mask is None else dict(active_rank_mask=mask)
    recv = moe.dispatch(x.ids[rank].to(device), [p.to(device) for p in x.payloads[rank]], case.T,
                        eplb_local_stats=None if stats is None else stats[rank].to(device), **mask_kwargs)
    counts = moe.recv_counts.cpu().clone()
    recv = [v.cpu().clone() for v in recv]
    eplb = None if moe.eplb_gathered_stats is None else moe.eplb_gathered_stats.cpu().clone()
    out = moe.combine(_expert_output(case, rank, recv, counts, gen, device), case.T, **mask_kwargs)
    return recv, counts, eplb, out.cpu()


def _quiesce_and_poison(workspace, rank, device, gen) -> None:
    """Between rounds: nobody is inside a dispatch/combine pair (every rank
    synced on its last outputs before the first barrier), this rank's call
    region gets random bytes, and nobody dispatches before it is written."""
    dist.barrier()
    _poison_own_call_region(workspace, rank, gen)
    _sync(device)
    dist.barrier()


def _done(out_dir: str, rank: int, **facts) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)


def _round_trip_worker(rank, world, init_file, out_dir, devices):
    device = _init(rank, world, init_file, devices)
    try:
        case = CASES[world]
        functional = _Inputs(case, f"functional-{world}", eplb=True)
        wrapped = _Inputs(case, f"moe-{world}", eplb=True)
        gen = make_generator(f"poison-{world}-{rank}")
        need, size = _workspace_size(case, device)
        try:
            workspace = a2a.allocate_workspace(size, group=dist.group.WORLD, device=device)
        except ValueError as e:
            if f"{HANDLE_TYPE_ENV}={FABRIC}" in str(e):  # fabric handles forced where there are none
                _done(out_dir, rank, fabric_unavailable=str(e))
                return
            raise
        _check_fresh_workspace(workspace, rank, world, size, device)
        metainfo = a2a.moe_a2a_initialize(workspace, rank, world, case.max_tokens, EPLB_N)
        for i in range(ROUNDS):
            _quiesce_and_poison(workspace, rank, device, gen)  # also orders initialize before any dispatch
            x, stats = functional.rounds[i], functional.stats[i]
            got = _functional_round(case, x, stats, rank, workspace, metainfo, device, gen, f"functional round {i}")
            _check_round(case, x, stats, rank, *got, f"functional round {i}")
        a2a.check_errors(workspace)

        # MoeAlltoAll allocates the size it is given and synchronizes its initialization; on
        # CUDA its rows lie the size rounded up to the granularity apart (padded rows).
        moe = a2a.MoeAlltoAll(ep_mapping(rank, world), case.max_tokens, case.top_k, case.num_experts,
                              workspace_size_per_rank=need, eplb_stats_num_experts=EPLB_N,
                              group=dist.group.WORLD, device=device)
        assert moe.workspace_size_per_rank == need and tuple(moe.workspace.shape) == (world, need)
        assert moe.workspace.stride() == (size, 1), f"rows {moe.workspace.stride(0)} bytes apart, expected {size}"
        assert moe.workspace.device == device
        if device.type == "cuda":
            assert int(torch.ops.moe_a2a.vmm_live_workspaces()) == 2  # the functional one is alive too
        for i in range(ROUNDS):
            _quiesce_and_poison(moe.workspace, rank, device, gen)
            x, stats = wrapped.rounds[i], wrapped.stats[i]
            got = _moe_round(case, x, stats, rank, moe, device, gen)
            _check_round(case, x, stats, rank, *got, f"MoeAlltoAll round {i}")
        moe.check()
        dist.barrier()
        _done(out_dir, rank, size=size)
    finally:
        dist.destroy_process_group()


def _expect_ranks_done(tmp_path, world) -> list[dict]:
    results = []
    for r in range(world):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} exited without its result"
        results.append(json.loads(path.read_text()))
    return results


@pytest.mark.parametrize("handle_type", ["auto", POSIX_FD, FABRIC])
@pytest.mark.parametrize("world", _worlds(2, 4))
def test_round_trips_match_reference(world, handle_type, tmp_path):
    """Functional API and MoeAlltoAll, each two rounds on one workspace, with
    EPLB stats: every rank's receive rows and counts, gathered stats and
    combine output equal the reference bitwise. MOE_A2A_HANDLE_TYPE=fabric
    skips where fabric handles are unavailable (every rank must agree)."""
    env = {**RANK_ENV, HANDLE_TYPE_ENV: None if handle_type == "auto" else handle_type}
    run_ranks(_round_trip_worker, world, (str(tmp_path / "init"), str(tmp_path), _rank_devices(world)),
              report_dir=tmp_path, timeout_s=PROCESS_TIMEOUT_S, env=env)
    results = _expect_ranks_done(tmp_path, world)
    unavailable = [r for r, res in enumerate(results) if "fabric_unavailable" in res]
    if unavailable:
        assert unavailable == list(range(world)), f"only ranks {unavailable} refused fabric handles: {results}"
        pytest.skip(f"fabric handles unavailable: {results[0]['fabric_unavailable']}")


def _rank_mask_worker(rank, world, init_file, out_dir, devices):
    device = _init(rank, world, init_file, devices)
    try:
        case = CASES[world]
        active = [r for r in range(world) if r != MASKED_RANK]
        mask = a2a.moe_a2a_active_rank_mask(active, world)
        functional = _Inputs(case, f"mask-functional-{world}", eplb=False)
        wrapped = _Inputs(case, f"mask-moe-{world}", eplb=False)
        gen = make_generator(f"mask-poison-{world}-{rank}")
        _, size = _workspace_size(case, device)
        workspace = a2a.allocate_workspace(size, group=dist.group.WORLD, device=device)
        metainfo = a2a.moe_a2a_initialize(workspace, rank, world, case.max_tokens)
        moe = a2a.MoeAlltoAll(ep_mapping(rank, world), case.max_tokens, case.top_k, case.num_experts,
                              workspace_size_per_rank=size, enable_rank_mask=True, group=dist.group.WORLD,
                              device=device)
        for i in range(ROUNDS):
            _quiesce_and_poison(workspace, rank, device, gen)
            if rank != MASKED_RANK:  # the masked rank takes part in the barriers only
                x = functional.rounds[i]
                got = _functional_round(case, x, None, rank, workspace, metainfo, device, gen,
                                        f"masked functional round {i}", mask=mask)
                _check_round(case, x, None, rank, *got, f"masked functional round {i}", active=active)
        for i in range(ROUNDS):
            _quiesce_and_poison(moe.workspace, rank, device, gen)
            if rank != MASKED_RANK:
                x = wrapped.rounds[i]
                got = _moe_round(case, x, None, rank, moe, device, gen, mask=mask)
                _check_round(case, x, None, rank, *got, f"masked MoeAlltoAll round {i}", active=active)
        dist.barrier()
        _done(out_dir, rank)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", _worlds(3))
def test_rank_mask_excludes_a_silent_process(world, tmp_path):
    """Rank 1 maps the workspace but never calls dispatch or combine; the
    others mask it out and still match the reference without it."""
    run_ranks(_rank_mask_worker, world, (str(tmp_path / "init"), str(tmp_path), _rank_devices(world)),
              report_dir=tmp_path, timeout_s=PROCESS_TIMEOUT_S, env=RANK_ENV)
    _expect_ranks_done(tmp_path, world)


def _killed_rank_worker(rank, world, init_file, out_dir, devices, kill_point):
    device = _init(rank, world, init_file, devices)
    case = CASES[world]
    inputs = _Inputs(case, f"kill-{world}", eplb=False)
    gen = make_generator(f"kill-poison-{world}-{rank}")
    _, size = _workspace_size(case, device)
    workspace = a2a.allocate_workspace(size, group=dist.group.WORLD, device=device)
    metainfo = a2a.moe_a2a_initialize(workspace, rank, world, case.max_tokens)
    _quiesce_and_poison(workspace, rank, device, gen)
    x = inputs.rounds[0]
    got = _functional_round(case, x, None, rank, workspace, metainfo, device, gen, "round before the fault")
    _check_round(case, x, None, rank, *got, "round before the fault")
    dist.barrier()  # the last collective: from here on the group has a dead member

    x = inputs.rounds[1]
    if rank == VICTIM_RANK and kill_point == "before_dispatch":
        os._exit(KILLED_EXIT)
    start = time.monotonic()
    error = None
    try:
        recv, offset, _ = a2a.moe_a2a_dispatch(
            x.ids[rank].to(device), [p.to(device) for p in x.payloads[rank]], workspace, metainfo, case.T, rank,
            world, case.top_k, case.num_experts)
        if rank == VICTIM_RANK:  # kill_point "after_dispatch": launched, not waited for
            os._exit(KILLED_EXIT)
        _sync(device)
        a2a.check_errors(workspace)  # a timed-out dispatch surfaces here
        counts = a2a.moe_a2a_get_recv_counts(workspace, metainfo, rank).cpu().clone()
        recv = [v.cpu().clone() for v in recv]
        payload = _expert_output(case, rank, recv, counts, gen, device)
        a2a.moe_a2a_combine(payload, case.tokens[rank], workspace, metainfo, case.T, rank, world, case.top_k,
                            offset)
        _sync(device)
        a2a.check_errors(workspace)  # ... or a timed-out combine here
    except RuntimeError as e:
        error = str(e)
    _done(out_dir, rank, error=error, seconds=time.monotonic() - start)
    # No destroy_process_group: its peers include a dead process.


@pytest.mark.parametrize("kill_point", ["before_dispatch", "after_dispatch"])
@pytest.mark.parametrize("world", _worlds(3))
def test_killed_process_makes_survivors_raise(world, kill_point, tmp_path):
    """Rank 1 dies (os._exit) right before or right after launching its
    dispatch of the second round; the survivors' waits time out
    (MOE_A2A_TIMEOUT_S=3) and raise an error naming rank 1 as missing,
    instead of hanging. The parent gets every survivor's error text."""
    env = {**RANK_ENV, "MOE_A2A_TIMEOUT_S": str(FAULT_TIMEOUT_S)}
    run_ranks(_killed_rank_worker, world, (str(tmp_path / "init"), str(tmp_path), _rank_devices(world), kill_point),
              report_dir=tmp_path, timeout_s=PROCESS_TIMEOUT_S, env=env, exit_codes={VICTIM_RANK: KILLED_EXIT})
    assert not (tmp_path / f"rank{VICTIM_RANK}.json").exists(), "the victim was not killed where planned"
    for r in range(world):
        if r == VICTIM_RANK:
            continue
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        error, seconds = res["error"], res["seconds"]
        print(f"survivor rank {r} raised after {seconds:.1f} s: {error}")
        assert error is not None, f"rank {r} did not raise after its peer died"
        found = re.search(r"rank (\d+): peers \[([\d, ]*)\] did not arrive within ([\d.]+) s", error)
        assert found, f"rank {r}: unexpected error text: {error}"
        assert int(found.group(1)) != VICTIM_RANK, error
        assert VICTIM_RANK in [int(p) for p in found.group(2).split(",")], error
        assert float(found.group(3)) == pytest.approx(FAULT_TIMEOUT_S), error
        assert seconds < FAULT_RAISE_WITHIN_S, f"rank {r} took {seconds:.1f} s to raise"


def _survivors_worker(rank, world, init_file, out_dir, devices):
    device = _init(rank, world, init_file, devices)
    survivors = [r for r in range(world) if r != VICTIM_RANK]
    group = dist.new_group(survivors)  # made while every process lives: new_group is collective
    case = CASES[world]
    inputs = _Inputs(case, f"survivors-{world}", eplb=False)
    gen = make_generator(f"survivors-poison-{world}-{rank}")
    _, size = _workspace_size(case, device)
    moe = a2a.MoeAlltoAll(ep_mapping(rank, world), case.max_tokens, case.top_k, case.num_experts,
                          workspace_size_per_rank=size, enable_rank_mask=True, group=dist.group.WORLD,
                          device=device, timeout_s=FAULT_TIMEOUT_S)
    everyone = a2a.moe_a2a_active_rank_mask(list(range(world)), world)
    _quiesce_and_poison(moe.workspace, rank, device, gen)
    got = _moe_round(case, inputs.rounds[0], None, rank, moe, device, gen, mask=everyone)
    _check_round(case, inputs.rounds[0], None, rank, *got, "round before the fault")
    dist.barrier()  # the last collective of the whole group
    if rank == VICTIM_RANK:
        os._exit(KILLED_EXIT)
    x = inputs.rounds[1]
    with pytest.raises(RuntimeError, match=rf"peers \[{VICTIM_RANK}\] did not arrive"):
        moe.dispatch(x.ids[rank].to(device), [p.to(device) for p in x.payloads[rank]], case.T,
                     active_rank_mask=everyone)
        _sync(device)
        moe.check()
    moe.reset(group=group)
    mask = a2a.moe_a2a_active_rank_mask(survivors, world)
    got = _moe_round(case, x, None, rank, moe, device, gen, mask=mask)
    _check_round(case, x, None, rank, *got, "survivors' round", active=survivors)
    moe.check()
    dist.barrier(group=group)
    _done(out_dir, rank)
    # No destroy_process_group: its peers include a dead process.


@pytest.mark.parametrize("world", _worlds(3))
def test_survivors_reset_and_mask_off_a_dead_process(world, tmp_path):
    """Rank 1 exits after a round trip; the survivors' next dispatch times
    out naming it, they reset over a group of their own (made before the
    fault) and their round trip with rank 1 masked off matches the reference."""
    run_ranks(_survivors_worker, world, (str(tmp_path / "init"), str(tmp_path), _rank_devices(world)),
              report_dir=tmp_path, timeout_s=PROCESS_TIMEOUT_S, env=RANK_ENV, exit_codes={VICTIM_RANK: KILLED_EXIT})
    for r in range(world):
        assert (tmp_path / f"rank{r}.json").exists() == (r != VICTIM_RANK), f"rank {r}"


# ---- allocation itself (CUDA only) ---------------------------------------------------------


def _pattern(cycle: int, rank: int) -> int:
    return 1 + (cycle * 31 + rank * 7) % 255  # never 0


def _allocate_check_free(rank: int, world: int, size: int, device: torch.device, cycle: int) -> None:
    """One cycle: a fresh zero workspace; each rank fills its own row, and
    every rank sees every row's filling at row r = rank r; then it is freed."""
    live = torch.ops.moe_a2a.vmm_live_workspaces
    workspace = a2a.allocate_workspace(size, group=dist.group.WORLD, device=device)
    assert int(live()) == 1, f"cycle {cycle}: {int(live())} live workspaces"
    nonzero = int(workspace.count_nonzero())
    assert nonzero == 0, f"cycle {cycle}: a fresh workspace has {nonzero} nonzero bytes"
    dist.barrier()  # every rank looked at every row before anyone writes
    workspace[rank].fill_(_pattern(cycle, rank))
    torch.cuda.synchronize(device)
    dist.barrier()
    lowest, highest = workspace.amin(dim=1).tolist(), workspace.amax(dim=1).tolist()
    expected = [_pattern(cycle, r) for r in range(world)]
    assert lowest == expected and highest == expected, (
        f"cycle {cycle}: rows hold bytes in {list(zip(lowest, highest))}, expected {expected}"
    )
    dist.barrier()  # every rank read every row
    del workspace
    torch.cuda.synchronize(device)
    assert int(live()) == 0, f"cycle {cycle}: the freed workspace is still registered"


def _cycles_worker(rank, world, init_file, out_dir, devices):
    device = _init(rank, world, init_file, devices)
    try:
        size = a2a.cuda_workspace_granularity(device)
        for cycle in range(WARMUP_CYCLES):  # the first ones set up the context, driver and sockets
            _allocate_check_free(rank, world, size, device, cycle)
        dist.barrier()
        free_before, fds_before = torch.cuda.mem_get_info(device)[0], open_fds()
        for cycle in range(WARMUP_CYCLES, WARMUP_CYCLES + CYCLES):
            _allocate_check_free(rank, world, size, device, cycle)
        dist.barrier()  # every rank freed its last workspace
        free_after, fds_after = torch.cuda.mem_get_info(device)[0], open_fds()
        # Device-wide free memory: a row leaked per cycle would be CYCLES * size per rank.
        assert free_after >= free_before - 8 * size, (
            f"free device memory fell by {(free_before - free_after) / 2**20:.1f} MiB over {CYCLES} cycles "
            f"of {world} rows of {size / 2**20:.1f} MiB"
        )
        new_fds = {k: v for k, v in fds_after.items() if k not in fds_before}
        assert len(fds_after) - len(fds_before) <= FD_SLACK, (
            f"{len(fds_after) - len(fds_before)} more open descriptors after {CYCLES} cycles: {new_fds}"
        )
        dist.barrier()
        _done(out_dir, rank, free_mib=(free_before - free_after) / 2**20, new_fds=new_fds)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", _worlds(2, 4))
def test_allocate_free_cycles_leak_nothing(world, tmp_path):
    """100 allocate/free cycles: every workspace is fresh (zero) and maps row
    r to rank r; device memory and open descriptors do not grow."""
    run_ranks(_cycles_worker, world, (str(tmp_path / "init"), str(tmp_path), _rank_devices(world)),
              report_dir=tmp_path, timeout_s=PROCESS_TIMEOUT_S, env=RANK_ENV)
    for r, res in enumerate(_expect_ranks_done(tmp_path, world)):
        print(f"rank {r}: free memory change {res['free_mib']:.1f} MiB, new descriptors {res['new_fds']}")


def _expect_collective_error(cls, pattern: str, fn) -> None:
    try:
        fn()
    except cls as e:
        assert re.search(pattern, str(e)), f"error text {str(e)!r} does not match {pattern!r}"
        return
    raise AssertionError(f"no {cls.__name__} matching {pattern!r}")


def _errors_worker(rank, world, init_file, out_dir, devices):
    device = _init(rank, world, init_file, devices)
    try:
        group = dist.group.WORLD
        unit = a2a.cuda_workspace_granularity(device)
        _allocate_check_free(rank, world, unit, device, 0)  # warm up, like the cycles
        fds_before = open_fds()
        _expect_collective_error(
            ValueError, rf"disagree on size_per_rank \(ranks \[0\]: {unit}; ranks \[1\]: {2 * unit}\)",
            lambda: a2a.allocate_workspace(unit * (1 + rank), group=group, device=device))
        os.environ[HANDLE_TYPE_ENV] = POSIX_FD if rank == 0 else "auto"
        _expect_collective_error(
            ValueError, rf"disagree on {HANDLE_TYPE_ENV} \(ranks \[0\]: posix_fd; ranks \[1\]: None\)",
            lambda: a2a.allocate_workspace(unit, group=group, device=device))
        os.environ[HANDLE_TYPE_ENV] = "shm" if rank == 1 else POSIX_FD
        _expect_collective_error(
            ValueError, rf"failed on group ranks \[1\]: rank 1: ValueError: {HANDLE_TYPE_ENV}='shm'",
            lambda: a2a.allocate_workspace(unit, group=group, device=device))
        del os.environ[HANDLE_TYPE_ENV]
        assert int(torch.ops.moe_a2a.vmm_live_workspaces()) == 0
        _allocate_check_free(rank, world, unit, device, 1)  # the group still works
        dist.barrier()
        new_fds = {k: v for k, v in open_fds().items() if k not in fds_before}
        assert len(new_fds) <= FD_SLACK, f"descriptors left open by the failed calls: {new_fds}"
        _done(out_dir, rank)
    finally:
        dist.destroy_process_group()


def test_bad_arguments_raise_on_every_rank(tmp_path):
    """Ranks that disagree on the size or the handle type, a bad
    MOE_A2A_HANDLE_TYPE on one rank: every rank raises the same ValueError
    naming the ranks, nothing leaks, and the group can allocate afterwards."""
    world = 2
    run_ranks(_errors_worker, world, (str(tmp_path / "init"), str(tmp_path), _rank_devices(world)),
              report_dir=tmp_path, timeout_s=PROCESS_TIMEOUT_S, env=RANK_ENV)
    _expect_ranks_done(tmp_path, world)


def _nccl_worker(rank, world, init_file, out_dir, devices):
    device = _init(rank, world, init_file, devices, backend="nccl")
    try:
        case = CASES[world]
        inputs = _Inputs(case, "nccl", eplb=True)
        gen = make_generator("nccl-poison")
        need, size = _workspace_size(case, device)
        moe = a2a.MoeAlltoAll(ep_mapping(rank, world), case.max_tokens, case.top_k, case.num_experts,
                              workspace_size_per_rank=need, eplb_stats_num_experts=EPLB_N,
                              group=dist.group.WORLD, device=device)
        assert int(torch.ops.moe_a2a.vmm_live_workspaces()) == 1, "not a VMM workspace"
        for i in range(ROUNDS):
            _quiesce_and_poison(moe.workspace, rank, device, gen)
            x, stats = inputs.rounds[i], inputs.stats[i]
            got = _moe_round(case, x, stats, rank, moe, device, gen)
            _check_round(case, x, stats, rank, *got, f"nccl round {i}")
        _done(out_dir, rank, size=size)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1] + ([2] if GPUS >= 2 else []))
def test_nccl_group(world, tmp_path):
    """The bootstrap through an NCCL group (collectives on CUDA tensors).
    Two ranks only with a GPU each: NCCL refuses several ranks on one GPU."""
    devices = _rank_devices(world)
    if len(set(devices)) < world:
        pytest.skip(f"NCCL needs a GPU per rank; the ranks share {devices[0]}")
    run_ranks(_nccl_worker, world, (str(tmp_path / "init"), str(tmp_path), devices),
              report_dir=tmp_path, timeout_s=PROCESS_TIMEOUT_S, env=RANK_ENV)
    _expect_ranks_done(tmp_path, world)
