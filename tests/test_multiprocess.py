"""One rank per process on the CPU: allocate_workspace(group=...) maps one
shared-memory file into every process; round trips through the functional API
and through MoeAlltoAll(group=...) match the reference computed here."""

import datetime
import os
import re
import signal
import stat
import time

import pytest
import torch
import torch.distributed as dist
from conftest import (
    RANK_START_METHOD,
    Case,
    PayloadSpec,
    assert_bytes_equal,
    ep_mapping,
    make_generator,
    make_inputs,
    open_fds,
    start_ranks,
)

import torch_moe_a2a as a2a
from torch_moe_a2a import reference
from torch_moe_a2a import workspace as ws_module
from torch_moe_a2a.workspace import SHARED_FILE_PREFIX

SHM_DIR = "/dev/shm"
SHM_PREFIX = "torch_moe_a2a"
# How the workspace's anonymous file shows in /proc/<pid>/maps and /proc/<pid>/fd.
MEMFD_PREFIX = "/memfd:" + SHARED_FILE_PREFIX

CASES = {
    2: Case(2, (9, 4), 3, 6, hidden=64, runtime_max=12, extras=(PayloadSpec(torch.float8_e4m3fn, (32,)),)),
    4: Case(4, (5, 0, 11, 8), 4, 10, hidden=128, runtime_max=11, max_num_tokens=16,
            extras=(PayloadSpec(torch.uint8, (7,)),)),
}
ROUNDS = 2  # functional API, then MoeAlltoAll


def _shm_entries() -> set:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)} if os.path.isdir(SHM_DIR) else set()


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        case = CASES[world]
        gen = make_generator(world)
        inputs = [make_inputs(case, gen) for _ in range(ROUNDS)]  # every process builds all ranks' inputs
        size = a2a.moe_a2a_get_workspace_size_per_rank(world, case.max_tokens, case.dispatch_bytes,
                                                       case.combine_bytes)
        results = []

        # Round 1: functional API on allocate_workspace(group=...).
        workspace = a2a.allocate_workspace(size, group=dist.group.WORLD)
        assert tuple(workspace.shape) == (world, size) and workspace.dtype == torch.uint8
        # Mapped, with one descriptor of the file on every member, the one
        # Python's mmap keeps (rank 0's creation descriptor is closed before
        # allocate_workspace returns anywhere).
        with open("/proc/self/maps") as maps:
            mapped = [line.strip() for line in maps if MEMFD_PREFIX in line]
        assert mapped, "the workspace file is not mapped"
        held = [v for v in open_fds().values() if MEMFD_PREFIX in v]
        assert len(held) == 1, held
        # No barrier after the local initialize (DESIGN section 5: no peer writes
        # into a row before its owner zeroed it): the last rank initializes
        # late, after its peers' first dispatches started.
        if rank == world - 1:
            time.sleep(0.3)
        metainfo = a2a.moe_a2a_initialize(workspace, rank, world, case.max_tokens)
        x = inputs[0]
        recv, offset, _ = a2a.moe_a2a_dispatch(x.ids[rank], x.payloads[rank], workspace, metainfo, case.T, rank,
                                               world, case.top_k, case.num_experts)
        counts = a2a.moe_a2a_get_recv_counts(workspace, metainfo, rank).clone()
        recv = [v.clone() for v in recv]
        expert_out = reference.toy_moe(recv[0], recv[1], recv[2], counts, ep_rank=rank, ep_size=world,
                                       num_experts=case.num_experts)
        out = a2a.moe_a2a_combine(expert_out, case.tokens[rank], workspace, metainfo, case.T, rank, world,
                                  case.top_k, offset)
        results.append({"recv": recv, "counts": counts, "out": out})

        # Round 2: MoeAlltoAll with its own workspace over the group.
        moe = a2a.MoeAlltoAll(ep_mapping(rank, world), case.max_tokens, case.top_k, case.num_experts,
                              workspace_size_per_rank=size, group=dist.group.WORLD, device="cpu")
        x = inputs[1]
        recv = moe.dispatch(x.ids[rank], x.payloads[rank], case.T)
        counts = moe.recv_counts.clone()
        recv = [v.clone() for v in recv]
        expert_out = reference.toy_moe(recv[0], recv[1], recv[2], counts, ep_rank=rank, ep_size=world,
                                       num_experts=case.num_experts)
        out = moe.combine(expert_out, case.T)
        # A repeated combine of the same dispatch (FlashInfer's semantics), of other rows.
        again = moe.combine(_doubled(expert_out), case.T)
        results.append({"recv": recv, "counts": counts, "out": out, "again": again})
        moe.check()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _doubled(t: torch.Tensor) -> torch.Tensor:
    return (t.float() * 2).to(t.dtype)


# More than two processes start as many interpreters: slow (CI runs this file 20 times besides).
@pytest.mark.parametrize("world", [w if w <= 2 else pytest.param(w, marks=pytest.mark.slow) for w in sorted(CASES)])
def test_multiprocess_round_trip(world, tmp_path):
    # Two ranks spawned, not forked from the fork server: a forked rank ends
    # in os._exit, a spawned one as torchrun's ranks do, through the atexit
    # hooks and interpreter finalization (where a gloo group destroyed too
    # late aborts the process), so this test checks that exit too; once is
    # enough (a spawned rank imports torch, seconds of CPU).
    method = "spawn" if world == 2 else RANK_START_METHOD
    context = start_ranks(_worker, (world, str(tmp_path / "init"), str(tmp_path)), world, join=False,
                          start_method=method)
    pids = [p.pid for p in context.processes]
    while not context.join():
        pass
    # Files are named after the creating process: only ours count (other test
    # runs may share /dev/shm).
    leftover = [n for n in _shm_entries() if any(f"_{pid}_" in n for pid in pids)]
    assert not leftover, f"shared-memory files left behind: {leftover}"

    case = CASES[world]
    gen = make_generator(world)
    inputs = [make_inputs(case, gen) for _ in range(ROUNDS)]
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for round_, x in enumerate(inputs):
        ref = reference.reference_dispatch(x.ids, x.payloads, ep_size=world, num_experts=case.num_experts,
                                           runtime_max_tokens_per_rank=case.T)
        expert_out = [reference.toy_moe(ref.recv[r][0], ref.recv[r][1], ref.recv[r][2], ref.recv_counts[r],
                                        ep_rank=r, ep_size=world, num_experts=case.num_experts)
                      for r in range(world)]
        expected = reference.reference_combine(expert_out, ref, list(case.tokens))
        for r in range(world):
            res = got[r][round_]
            assert torch.equal(res["counts"], ref.recv_counts[r]), f"round {round_} rank {r} counts"
            for i, (v, rv) in enumerate(zip(res["recv"], ref.recv[r])):
                for s in range(world):
                    n = int(ref.recv_counts[r][s])
                    assert_bytes_equal(v[s, :n], rv[s, :n], f"round {round_} rank {r} payload {i} from {s}")
            assert_bytes_equal(res["out"], expected[r], f"round {round_} rank {r} output")
        if "again" in got[0][round_]:
            again = reference.reference_combine([_doubled(e) for e in expert_out], ref, list(case.tokens))
            for r in range(world):
                assert_bytes_equal(got[r][round_]["again"], again[r], f"round {round_} rank {r} repeated combine")


def test_shared_workspace_file_mode(tmp_path, monkeypatch):
    """The shared-memory file is created 0600 and without a name in any
    directory (observed where it is created, in a single-process group), and
    once allocate_workspace returned, the descriptor number the peers
    learned leads to it no more (only the mapping's own descriptor is left)."""
    created = []
    real_create = ws_module._create_shared_file

    def spy(nbytes):
        fd = real_create(nbytes)
        st = os.fstat(fd)
        created.append((fd, stat.S_IMODE(st.st_mode), st.st_nlink, os.readlink(f"/proc/self/fd/{fd}")))
        return fd

    monkeypatch.setattr(ws_module, "_create_shared_file", spy)
    shm_before = _shm_entries()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        ws = a2a.allocate_workspace(4096, group=dist.group.WORLD)
        assert tuple(ws.shape) == (1, 4096) and int(ws.count_nonzero()) == 0
        ws[0, :16] = 7  # writable
    finally:
        dist.destroy_process_group()
    assert len(created) == 1, created
    fd, mode, links, target = created[0]
    assert mode == 0o600, oct(mode)
    assert links == 0 and target.startswith(MEMFD_PREFIX), (links, target)
    assert _shm_entries() == shm_before
    try:
        still = os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:
        still = None
    assert still is None or MEMFD_PREFIX not in still, still


# (what rank 1 passes, what every member's error names) where rank 0's arguments are good.
BAD_MEMBER_ARGUMENTS = {
    "size": ({"size_per_rank": 8192 + 8}, r"size_per_rank must be a positive multiple of 128, got 8200"),
    "ep_size": ({"ep_size": 3}, r"ep_size 3 differs from the group size 2"),
    "device": ({"device": "meta"}, r"unsupported workspace device 'meta'"),
}


def _bad_member_worker(rank: int, init_file: str, out_dir: str, case: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        kwargs = {"size_per_rank": 8192}
        if rank == 1:
            kwargs.update(BAD_MEMBER_ARGUMENTS[case][0] if case in BAD_MEMBER_ARGUMENTS else {"device": case})
        start = time.monotonic()
        try:
            a2a.allocate_workspace(group=dist.group.WORLD, **kwargs)
            outcome = "returned"
        except (ValueError, RuntimeError) as e:
            outcome = f"{type(e).__name__}: {e}"
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(f"{time.monotonic() - start:.3f}\n{outcome}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", sorted(BAD_MEMBER_ARGUMENTS))
def test_bad_arguments_on_one_member_raise_on_every_member(case, tmp_path):
    """allocate_workspace(group=...) with bad arguments on rank 1 only: both
    members raise at once (no member left waiting in a collective until the
    group's timeout), with an error that names rank 1 and its problem."""
    start_ranks(_bad_member_worker, (str(tmp_path / "init"), str(tmp_path), case), 2)
    pattern = BAD_MEMBER_ARGUMENTS[case][1]
    for rank in range(2):
        seconds, message = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        assert float(seconds) < 20, f"rank {rank} waited {seconds} s"
        assert "the argument check failed on group ranks [1]" in message, message
        assert re.search(pattern, message), message


def test_members_of_two_device_kinds_raise_on_every_member(tmp_path):
    """Rank 1 asks for a CUDA workspace, rank 0 for a CPU one: the two paths
    make different collectives, so both members raise at once, naming rank 1
    (without a CUDA device: its argument check; with one: the disagreement)."""
    start_ranks(_bad_member_worker, (str(tmp_path / "init"), str(tmp_path), "cuda"), 2)
    if torch.cuda.is_available():
        pattern = r"ValueError: group members disagree on the workspace device \(ranks \[0\]: cpu; ranks \[1\]: cuda\)"
    else:
        pattern = (r"RuntimeError: allocate_workspace: the argument check failed on group ranks \[1\]: .*device "
                   r"'cuda' was asked for but torch .* sees no CUDA device")
    for rank in range(2):
        seconds, message = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        assert float(seconds) < 20, f"rank {rank} waited {seconds} s"
        assert re.search(pattern, message), message


@pytest.mark.parametrize("case", sorted(BAD_MEMBER_ARGUMENTS))
def test_a_refused_allocation_keeps_no_reference_cycle(case, tmp_path):
    """The error of a failed collective step leaves no reference cycle behind
    that holds the group: otherwise the group lives until some later garbage
    collection, and a gloo group destroyed then (after destroy_process_group,
    or at exit) aborts the process ("terminate called without an active
    exception"), which made the bad-arguments test above fail now and then."""
    import gc
    import weakref

    from conftest import TorchDistributedCommBackend

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        comm = TorchDistributedCommBackend(dist.group.WORLD)
        alive = weakref.ref(comm)
        kwargs = {"size_per_rank": 8192, **BAD_MEMBER_ARGUMENTS[case][0]}
        gc.disable()
        try:
            # Not pytest.raises: its record of the exception would hold the frames.
            try:
                a2a.allocate_workspace(group=comm, **kwargs)
                message = "returned"
            except ValueError as e:
                message = str(e)
            assert "the argument check failed on group ranks [0]" in message, message
            del comm
            assert alive() is None, "a reference cycle keeps the group of a failed allocate_workspace alive"
        finally:
            gc.enable()
    finally:
        dist.destroy_process_group()


_HOLD_GROUP_UNTIL_EXIT = """
import atexit, sys, weakref
import torch.distributed as dist
import torch_moe_a2a as a2a

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
group = dist.group.WORLD
moe = a2a.MoeAlltoAll(a2a.Mapping(world_size=1, rank=0, tp_size=1, moe_ep_size=1), 4, 2, 4, hidden_size=8,
                      group=group, device="cpu")
alive = weakref.ref(group)
del group
dist.destroy_process_group()
held = alive() is not None  # by the workspace cache and by moe
atexit._run_exitfuncs()
print(held, alive() is not None)
"""


def test_no_group_outlives_the_exit_hooks(tmp_path):
    """The workspace cache and the instances hold the group their workspace
    was mapped over; the exit hook lets go of it while Python still runs. A
    gloo group held into interpreter finalization, after destroy_process_group,
    aborts the process now and then ("terminate called without an active
    exception"), which made the torchrun demo test fail now and then."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _HOLD_GROUP_UNTIL_EXIT, str(tmp_path / "init")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False"], proc.stdout + proc.stderr


def _ranks_reached(ids: torch.Tensor, experts_per_rank: int) -> torch.Tensor:
    """Per token, the distinct ranks its expert ids reach (ids all valid)."""
    return (ids // experts_per_rank).sort(dim=1).values.diff(dim=1).ne(0).sum(dim=1) + 1


def _small_round(name: str, rank: int, world: int) -> tuple:
    """(tokens, hidden, top_k, num_experts, x, ids) of a small bf16 round with
    int32 ids, seeded by ``name`` and the rank."""
    tokens, hidden, top_k, num_experts = 6, 32, 2, 2 * world
    gen = make_generator(f"{name} {rank}")
    x = torch.randn((tokens, hidden), generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, num_experts, (tokens, top_k), generator=gen, dtype=torch.int32)
    return tokens, hidden, top_k, num_experts, x, ids


def _failed_combine_worker(rank: int, world: int, init_file: str, wrapper: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        tokens, hidden, top_k, num_experts, x, ids = _small_round("failed combine", rank, world)
        if wrapper == "MoeAlltoAll":
            moe = a2a.MoeAlltoAll(ep_mapping(rank, world), tokens, top_k, num_experts, hidden_size=hidden,
                                  group=dist.group.WORLD, device="cpu", timeout_s=10)
            alltoall = moe

            def dispatch():
                return moe.dispatch(ids, [x], tokens)[0]

            def combine(rows):
                return moe.combine(rows, tokens)
        else:
            from torch_moe_a2a.moe_ep import BootstrapConfig, MoEEpCommParams, NVLinkOneSidedAlltoAll

            params = MoEEpCommParams(num_experts=num_experts, top_k=top_k, max_tokens_per_rank=tokens,
                                     hidden_size=hidden)
            moe = NVLinkOneSidedAlltoAll(BootstrapConfig(world_size=world, rank=rank, process_group=dist.group.WORLD),
                                         params, device="cpu")
            alltoall = moe.alltoall

            def dispatch():
                return moe.dispatch(x, ids).hidden_states.view(world, tokens, hidden)

            def combine(rows):
                return moe.combine(rows)

        def record(what):
            return rf"an earlier call on this workspace failed, and its record stands: .*{what}.*MoeAlltoAll.reset\(\)"

        rows = dispatch()
        # Rank 1 combines fp32 rows, rank 0 bf16 ones: every rank's combine fails and records it.
        with pytest.raises(RuntimeError, match="called the same combine with other rows"):
            combine(rows.float() if rank == 1 else rows)
        # The workspace stays failed: the next dispatch says so and asks for the
        # re-initialization, not for a combine, which would fail on the record too.
        with pytest.raises(RuntimeError, match=rf"{wrapper}.dispatch: {record('other rows')}"):
            dispatch()
        alltoall.reset()
        # A dispatch that failed (rank 1 sends rows of half the size) leaves no
        # round open: the combine after it raises the record too, not "call dispatch first".
        full_x, x = x, (x[:, : hidden // 2].contiguous() if rank == 1 else x)
        with pytest.raises(RuntimeError, match="called dispatch with other payloads"):
            dispatch()
        x = full_x
        with pytest.raises(RuntimeError, match=rf"{wrapper}.combine: {record('other payloads')}"):
            combine(rows)
        alltoall.reset()
        rows = dispatch()
        out = combine((rows.float() * 3).to(torch.bfloat16))
        expected = (x.float() * 3 * _ranks_reached(ids, num_experts // world)[:, None]).to(torch.bfloat16)
        assert torch.equal(out, expected)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _group_with_survivors(rank: int, world: int, init_file: str, name: str, tokens: int, hidden: int, top_k: int,
                           num_experts: int):
    """The default gloo group of ``world`` processes, the group of ranks 0
    and 1 (made while every process lives: new_group is collective), and the
    rank's bf16 hidden states and int32 ids."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    survivors = dist.new_group([0, 1])
    gen = make_generator(f"{name} {rank}")
    x = torch.randn((tokens, hidden), generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, num_experts, (tokens, top_k), generator=gen, dtype=torch.int32)
    return survivors, x, ids


def _survivors_worker(rank: int, world: int, init_file: str) -> None:
    tokens, hidden, top_k, num_experts = 6, 32, 2, 2 * world
    survivors, x, ids = _group_with_survivors(rank, world, init_file, "survivors", tokens, hidden, top_k, num_experts)
    try:
        moe = a2a.MoeAlltoAll(ep_mapping(rank, world), tokens, top_k, num_experts, hidden_size=hidden,
                              group=dist.group.WORLD, device="cpu", timeout_s=2, enable_rank_mask=True)
        unmasked = a2a.MoeAlltoAll(ep_mapping(rank, world), tokens, top_k, num_experts, hidden_size=hidden,
                                   group=dist.group.WORLD, device="cpu", timeout_s=2)
        assert unmasked.workspace is moe.workspace

        def round_trip(active):
            mask = a2a.moe_a2a_active_rank_mask(active, world)
            rows = moe.dispatch(ids, [x], tokens, active_rank_mask=mask)[0]
            out = moe.combine((rows.float() * 3).to(torch.bfloat16), tokens, active_rank_mask=mask)
            # Each token's row times 3 from every distinct active rank its experts reach.
            reached = torch.stack([(ids // (num_experts // world) == r).any(dim=1) for r in active]).sum(dim=0)
            assert torch.equal(out, (x.float() * 3 * reached[:, None]).to(torch.bfloat16))

        round_trip([0, 1, 2])
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        # Rank 2 is gone: a call that waits for it times out, naming it, and
        # the instance's group can no longer synchronize a reset.
        with pytest.raises(RuntimeError, match=r"peers \[2\] did not arrive") as error:
            round_trip([0, 1, 2])
        # The killed rank's row was initialized in its own process: no hint for ranks of one process.
        assert "thread each" not in str(error.value) and "initialized their rows" not in str(error.value)
        with pytest.raises(ValueError, match="enable_rank_mask=True"):
            unmasked.reset(group=survivors)
        with pytest.raises(RuntimeError, match=r"the group's barrier failed.*reset\(group=\.\.\.\)"):
            moe.reset()
        # Its survivors reset together and go on with it masked off.
        moe.reset(group=survivors)
        round_trip([0, 1])
        round_trip([0, 1])
        dist.barrier(group=survivors)
    finally:
        dist.destroy_process_group()


def _failed_then_dead_worker(rank: int, world: int, init_file: str) -> None:
    tokens, hidden, top_k, num_experts = 4, 32, 2, 2 * world
    survivors, x, ids = _group_with_survivors(rank, world, init_file, "failed then dead", tokens, hidden, top_k,
                                              num_experts)
    moe = a2a.MoeAlltoAll(ep_mapping(rank, world), tokens, top_k, num_experts, hidden_size=hidden,
                          group=dist.group.WORLD, device="cpu", timeout_s=0.5, enable_rank_mask=True)
    if rank == 2:
        # Its dispatch alone times out and records the error in its row; then the process dies.
        with pytest.raises(RuntimeError, match=r"rank 2: peers \[0, 1\] did not arrive"):
            moe.dispatch(ids, [x], tokens, active_rank_mask=a2a.moe_a2a_active_rank_mask([0, 1, 2], world))
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    with pytest.raises(RuntimeError, match=r"rank 2: peers \[0, 1\] did not arrive"):
        moe.check()  # rank 2's record, read from its row
    moe.reset(group=survivors)
    moe.check()  # the survivors' rows only
    mask = a2a.moe_a2a_active_rank_mask([0, 1], world)
    rows = moe.dispatch(ids, [x], tokens, active_rank_mask=mask)[0]
    moe.combine(rows.clone(), tokens, active_rank_mask=mask)
    moe.check()
    with pytest.raises(RuntimeError, match=r"rank 2: peers \[0, 1\] did not arrive"):
        a2a.check_errors(moe.workspace)  # the plain function reads every row
    dist.barrier(group=survivors)
    # A group with a dead member: no teardown (it could wait for the dead); a
    # failure above leaves through run_ranks' entry, which exits at once too.
    os._exit(0)


@pytest.mark.slow  # three processes
def test_check_after_a_survivors_reset_reads_their_rows(tmp_path):
    """A rank whose call failed (its record in its row) and whose process then
    died: after the survivors' reset(group=...), MoeAlltoAll.check() reads
    their rows only, so the dead rank's old record no longer fails every
    check; check_errors(workspace) still reads every row."""
    from conftest import run_ranks

    run_ranks(_failed_then_dead_worker, 3, (str(tmp_path / "init"),), report_dir=tmp_path, timeout_s=120,
              exit_codes={2: -signal.SIGKILL})


@pytest.mark.slow  # three processes
def test_survivors_of_a_dead_peer_reset_and_go_on_masking_it_off(tmp_path):
    """A peer process killed (SIGKILL) after a round trip: the survivors' next
    call times out naming it, they reset over a group of their own
    (reset(group=...); the instance's group includes the dead process) and
    their round trips with the dead rank masked off match the reference. An
    instance without rank masks refuses such a reset."""
    from conftest import run_ranks

    run_ranks(_survivors_worker, 3, (str(tmp_path / "init"),), report_dir=tmp_path, timeout_s=120,
              exit_codes={2: -signal.SIGKILL})


@pytest.mark.parametrize("wrapper", ["MoeAlltoAll", "NVLinkOneSidedAlltoAll"])
def test_calls_after_a_failed_one_ask_for_reset(wrapper, tmp_path):
    """A combine that failed (here: the ranks combined rows of other dtypes)
    leaves the round open and the workspace failed: the wrapper's next
    dispatch raises the error record, which asks for a re-initialization
    (reset()), instead of asking for the combine that closes the round.
    Likewise a combine after a failed dispatch raises the record, not "call
    dispatch first". After reset() on every rank (NVLinkOneSidedAlltoAll:
    through its alltoall) the round trip works again."""
    from conftest import run_ranks

    run_ranks(_failed_combine_worker, 2, (str(tmp_path / "init"), wrapper), report_dir=tmp_path, timeout_s=120)


def _reset_refused_on_one_member_worker(rank: int, world: int, init_file: str) -> None:
    import threading

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        tokens, hidden, top_k, num_experts, x, ids = _small_round("reset refused", rank, world)
        moe = a2a.MoeAlltoAll(ep_mapping(rank, world), tokens, top_k, num_experts, hidden_size=hidden,
                              group=dist.group.WORLD, device="cpu", timeout_s=5)
        caught = []
        if rank == 0:
            # Another thread of rank 0 inside a dispatch, which waits for rank 1 (which resets instead).
            def dispatch():
                try:
                    moe.dispatch(ids, [x], tokens)
                except RuntimeError as e:
                    caught.append(str(e))

            worker = threading.Thread(target=dispatch)
            worker.start()
            time.sleep(1.0)  # inside its wait, which lasts timeout_s
        refused = r"MoeAlltoAll.reset: the re-initialization failed on group ranks \[0\], so every member raises"
        with pytest.raises(RuntimeError, match=refused):
            moe.reset()
        if rank == 0:
            worker.join()
            assert len(caught) == 1 and "peers [1] did not arrive" in caught[0], caught
        # Both members raised: the group's collectives are still in step, and a second reset works.
        moe.reset()
        rows = moe.dispatch(ids, [x], tokens)[0]
        out = moe.combine((rows.float() * 3).to(torch.bfloat16), tokens)
        expected = (x.float() * 3 * _ranks_reached(ids, num_experts // world)[:, None]).to(torch.bfloat16)
        assert torch.equal(out, expected)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_reset_refused_on_one_member_raises_on_every_member(tmp_path):
    """MoeAlltoAll.reset() while another thread of one member is inside a call:
    that member's re-initialization is refused, and every member raises (a
    member that raised alone would leave its peers' next collective paired
    with another of its own); a second reset() on every member, once the
    call returned, re-initializes, and round trips work again."""
    from conftest import run_ranks

    run_ranks(_reset_refused_on_one_member_worker, 2, (str(tmp_path / "init"),), report_dir=tmp_path, timeout_s=120)


def _round_is_right(moe, rank: int, world: int, what: str) -> None:
    """One round trip of ``_small_round``'s inputs through ``moe``, checked."""
    tokens, hidden, top_k, num_experts, x, ids = _small_round(what, rank, world)
    rows = moe.dispatch(ids, [x], tokens)[0]
    out = moe.combine((rows.float() * 3).to(torch.bfloat16), tokens)
    expected = (x.float() * 3 * _ranks_reached(ids, num_experts // world)[:, None]).to(torch.bfloat16)
    assert torch.equal(out, expected), what


def _reset_group_adopted_worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        first = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=2))
        tokens, hidden, top_k, num_experts, _, _ = _small_round("adopted", rank, world)
        moe = a2a.MoeAlltoAll(ep_mapping(rank, world), tokens, top_k, num_experts, hidden_size=hidden, group=first,
                              device="cpu", timeout_s=10)
        _round_is_right(moe, rank, world, "first group")
        # The instance's group fails: rank 1 comes to a reset after the group's timeout, whose barrier then
        # times out on rank 0, which leaves the gloo group broken.
        if rank == 1:
            time.sleep(4)
        with pytest.raises(RuntimeError, match="the group's barrier failed"):
            moe.reset()
        # Every member resets over a new group of all of them.
        second = dist.new_group(list(range(world)))
        moe.reset(group=second)
        _round_is_right(moe, rank, world, "after reset(group=)")
        # Later collective steps without a group go over the group of that reset, not the failed one.
        moe.reset()
        _round_is_right(moe, rank, world, "after reset()")
        moe.checkpoint_prepare()
        moe.checkpoint_restore(second)
        _round_is_right(moe, rank, world, "after checkpointing")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_reset_over_a_new_group_makes_it_the_workspaces(tmp_path):
    """reset(group=) over a new group of every member, once the instance's
    group failed (a timed-out barrier broke it): later plain resets and
    checkpoint_prepare synchronize over that group. They went on using the
    broken one, so the workspace could be neither reset again nor released."""
    from conftest import run_ranks

    run_ranks(_reset_group_adopted_worker, 2, (str(tmp_path / "init"),), report_dir=tmp_path, timeout_s=120)


def _mask_after_survivors_reset_worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        tokens, hidden, top_k, num_experts, x, ids = _small_round("survivor mask", rank, world)
        moe = a2a.MoeAlltoAll(ep_mapping(rank, world), tokens, top_k, num_experts, hidden_size=hidden,
                              group=dist.group.WORLD, device="cpu", timeout_s=10, enable_rank_mask=True)
        everyone = a2a.moe_a2a_active_rank_mask(list(range(world)), world)
        rows = moe.dispatch(ids, [x], tokens, active_rank_mask=everyone)[0]
        moe.combine(rows, tokens, active_rank_mask=everyone)
        alone = dist.new_group([0])  # collective over the default group: every rank makes it
        if rank == 0:
            # Rank 0 goes on as the only survivor (rank 1 stands for a process that exited).
            moe.reset(group=alone)
            start = time.monotonic()
            with pytest.raises(ValueError, match=r"MoeAlltoAll.dispatch: active_rank_mask holds ranks \[1\], which "
                                                 r"were not in the last reset\(group=...\) of this workspace "
                                                 r"\(its members: \[0\]\)"):
                moe.dispatch(ids, [x], tokens, active_rank_mask=everyone)
            assert time.monotonic() - start < 5, "refused before the exchange, not after its timeout"
            # A plain reset goes over the survivors' group, and still knows whose rows count.
            moe.reset()
            with pytest.raises(ValueError, match="which were not in the last reset"):
                moe.dispatch(ids, [x], tokens, active_rank_mask=everyone)
            own = a2a.moe_a2a_active_rank_mask([0], world)
            rows = moe.dispatch(ids, [x], tokens, active_rank_mask=own)[0]
            out = moe.combine((rows.float() * 3).to(torch.bfloat16), tokens, active_rank_mask=own)
            reached = (ids < num_experts // world).any(dim=1).to(torch.float32)  # rank 0's experts only
            assert torch.equal(out, (x.float() * 3 * reached[:, None]).to(torch.bfloat16))
            moe.check()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_mask_holding_a_rank_outside_the_survivors_reset_is_refused(tmp_path):
    """After reset(group=survivors), a call whose active_rank_mask still holds
    a rank outside that group is refused at once, naming it; it waited for
    that rank until the timeout, then spoke of initializations. A later plain
    reset goes over the survivors' group and keeps reading their rows only."""
    from conftest import run_ranks

    run_ranks(_mask_after_survivors_reset_worker, 2, (str(tmp_path / "init"),), report_dir=tmp_path, timeout_s=120)


def _restarted_member_worker(rank: int, world: int, init_file: str) -> None:
    for attempt in range(2):
        dist.init_process_group("gloo", init_method=f"file://{init_file}-{attempt}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        if attempt == 1 and rank == 1:
            a2a.MoeAlltoAll.clear_workspace_cache()  # a restarted process: nothing cached
        tokens, hidden, top_k, num_experts, _, _ = _small_round("restart", rank, world)
        moe = a2a.MoeAlltoAll(ep_mapping(rank, world), tokens, top_k, num_experts, hidden_size=hidden,
                              group=dist.group.WORLD, device="cpu", timeout_s=10)
        _round_is_right(moe, rank, world, f"group {attempt}")
        dist.barrier()
        del moe
        dist.destroy_process_group()


def test_a_member_restarted_with_a_new_group_shares_a_new_workspace(tmp_path):
    """An elastic restart: every member destroys its process group and joins
    a new one of the same ranks, one of them a fresh process. The survivor's
    MoeAlltoAll of the same geometry allocates anew with the newcomer; the
    workspace cache, keyed by the group's ranks, handed it the workspace of
    the destroyed group, while the newcomer waited alone in its allocation."""
    from conftest import run_ranks

    run_ranks(_restarted_member_worker, 2, (str(tmp_path / "init"),), report_dir=tmp_path, timeout_s=120)


def _two_groups_worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        # Global rank 0 is rank 0 of 2 in both groups, whose other members differ.
        groups = {"A": dist.new_group([0, 1]), "B": dist.new_group([0, 2])}
        members = {"A": (0, 1), "B": (0, 2)}
        tokens, hidden, top_k, num_experts = 5, 16, 2, 4
        instances = {}
        for name in ("A", "B"):
            if rank in members[name]:
                place = members[name].index(rank)
                instances[name] = a2a.MoeAlltoAll(ep_mapping(place, 2), tokens, top_k, num_experts,
                                                  hidden_size=hidden, group=groups[name], device="cpu", timeout_s=10)
        if rank == 0:
            assert instances["A"].workspace.data_ptr() != instances["B"].workspace.data_ptr(), \
                "the instance over group B took the workspace mapped over group A"
        for name, moe in instances.items():
            gen = make_generator(f"two groups {name} {rank}")
            x = torch.randn((tokens, hidden), generator=gen).to(torch.bfloat16)
            ids = torch.randint(0, num_experts, (tokens, top_k), generator=gen, dtype=torch.int32)
            (rows,) = moe.dispatch(ids, [x], tokens)
            out = moe.combine((rows.float() * 3).to(torch.bfloat16), tokens)
            expected = (x.float() * 3 * _ranks_reached(ids, num_experts // 2)[:, None]).to(torch.bfloat16)
            assert torch.equal(out, expected), f"group {name}"
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_instances_over_groups_of_other_members_do_not_share_a_workspace(tmp_path):
    """A process that is rank 0 of 2 in two groups of other members (global
    ranks [0, 1] and [0, 2]) builds a MoeAlltoAll of one geometry over each:
    each maps its own workspace over its group, and both round trips give the
    reference output. The workspace cache keyed by the geometry alone gave
    the second instance the first group's workspace: global rank 2 waited
    alone in the allocation, and rank 0's round trip over group B wrote into
    rank 1's memory."""
    from conftest import run_ranks

    run_ranks(_two_groups_worker, 3, (str(tmp_path / "init"),), report_dir=tmp_path, timeout_s=120)
