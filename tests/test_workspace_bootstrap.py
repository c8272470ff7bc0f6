"""The multi-process CUDA workspace's bootstrap, on the CPU (no GPU needed):
the handle-type choice, the descriptor and fabric-handle exchanges between
processes (with the vmm_* ops faked by files), the collective error
reporting, and the clear error of a build without CUDA."""

import datetime
import gc
import os
import re
import socket
import tempfile
import weakref

import pytest
import torch
import torch.distributed as dist
from conftest import TorchDistributedCommBackend, ep_mapping, open_fds, run_ranks

import torch_moe_a2a as a2a
from torch_moe_a2a import workspace as ws
from torch_moe_a2a.collective import as_collective
from torch_moe_a2a.workspace import FABRIC, HANDLE_TYPE_ENV, POSIX_FD, choose_handle_type

# ---- choose_handle_type --------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,supported,works,expected",
    [
        # automatic: fabric only where it works on every rank
        ([None, None], [True, True], [True, True], FABRIC),
        ([None, None], [True, True], [True, False], POSIX_FD),
        ([None, None], [True, False], [True, False], POSIX_FD),
        ([None, None, None], [False, False, False], [False, False, False], POSIX_FD),
        ([None], [True], [True], FABRIC),
        ([None], [False], [False], POSIX_FD),
        # overrides
        ([POSIX_FD] * 3, [True] * 3, [True] * 3, POSIX_FD),
        ([POSIX_FD, POSIX_FD], [False, False], [False, False], POSIX_FD),
        ([FABRIC, FABRIC], [True, True], [True, True], FABRIC),
    ],
)
def test_choose_handle_type(overrides, supported, works, expected):
    assert choose_handle_type(overrides, supported, works) == expected


@pytest.mark.parametrize(
    "overrides,supported,works,match",
    [
        ([POSIX_FD, None], [True, True], [True, True],
         r"disagree on MOE_A2A_HANDLE_TYPE \(ranks \[0\]: posix_fd; ranks \[1\]: None\)"),
        ([FABRIC, FABRIC, POSIX_FD], [True] * 3, [True] * 3, r"disagree on MOE_A2A_HANDLE_TYPE"),
        ([FABRIC, FABRIC, FABRIC], [True, False, False], [True, False, False],
         r"devices of ranks \[1, 2\] do not support"),
        ([FABRIC, FABRIC], [True, True], [False, True], r"fabric handles failed on ranks \[0\].*IMEX"),
        (["shm", "shm"], [True, True], [True, True], r"unknown handle type 'shm'"),
        ([None, None], [True], [True, True], r"one entry per rank"),
        ([], [], [], r"one entry per rank"),
    ],
)
def test_choose_handle_type_rejects(overrides, supported, works, match):
    with pytest.raises(ValueError, match=match):
        choose_handle_type(overrides, supported, works)


def test_choose_handle_type_probe_then_outcome():
    """allocate_workspace asks first with every fabric attempt assumed to work
    (whether to try), then with the outcome; an unsupported device stops the
    attempt before it starts."""
    supported = [True, True, True]
    assert choose_handle_type([None] * 3, supported, [True] * 3) == FABRIC
    assert choose_handle_type([None] * 3, supported, [True, True, False]) == POSIX_FD
    assert choose_handle_type([None] * 3, [True, False, True], [True] * 3) == POSIX_FD


@pytest.mark.parametrize(
    "value,expected", [(None, None), ("", None), ("auto", None), ("AUTO", None), ("posix_fd", POSIX_FD),
                       (" fabric ", FABRIC)]
)
def test_handle_type_override(value, expected, monkeypatch):
    if value is None:
        monkeypatch.delenv(HANDLE_TYPE_ENV, raising=False)
    else:
        monkeypatch.setenv(HANDLE_TYPE_ENV, value)
    assert ws._handle_type_override() == expected


def test_handle_type_override_rejects_unknown(monkeypatch):
    monkeypatch.setenv(HANDLE_TYPE_ENV, "ipc")
    with pytest.raises(ValueError, match=r"MOE_A2A_HANDLE_TYPE='ipc'; expected 'posix_fd', 'fabric' or 'auto'"):
        ws._handle_type_override()


# ---- descriptor messages -------------------------------------------------------------


def _fd_exchange(message: bytes, n_fds: int, token: bytes, received: dict):
    """Send ``message`` with ``n_fds`` pipe descriptors over a socket pair and
    run _check_fd_message on what arrives. Returns (result or exception, the
    received fds, whether each is still open)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    try:
        socket.send_fds(a, [message], [r] * n_fds)
        got, fds, flags, _ = socket.recv_fds(b, ws._FD_MESSAGE.size, 1)
        try:
            result = ws._check_fd_message(got, fds, flags, token, 0, 3, received)
        except RuntimeError as e:
            result = e
        still_open = []
        for fd in fds:
            try:
                os.fstat(fd)
                still_open.append(True)
                os.close(fd)
            except OSError:
                still_open.append(False)
        return result, still_open
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


def test_fd_message_accepted():
    token = b"t" * ws._TOKEN_BYTES
    result, still_open = _fd_exchange(ws._FD_MESSAGE.pack(2, token), 1, token, {})
    assert result == 2 and still_open == [True]  # the caller owns the descriptor now


@pytest.mark.parametrize(
    "sender,token,n_fds,received,match",
    [
        (1, b"x" * ws._TOKEN_BYTES, 1, {}, "wrong token"),
        (0, None, 1, {}, r"sender rank 0"),  # its own rank
        (3, None, 1, {}, r"sender rank 3"),  # out of range
        (1, None, 1, {1: 99}, r"sender rank 1"),  # twice
        (1, None, 0, {}, r"0 descriptors"),
    ],
)
def test_fd_message_refused(sender, token, n_fds, received, match):
    mine = b"m" * ws._TOKEN_BYTES
    message = ws._FD_MESSAGE.pack(sender, mine if token is None else token)
    result, still_open = _fd_exchange(message, n_fds, mine, dict(received))
    assert isinstance(result, RuntimeError) and "unexpected message on the workspace socket" in str(result)
    assert re.search(match, str(result)), str(result)
    assert not any(still_open), "a refused message's descriptor must be closed"


# ---- the exchanges between processes, with faked vmm_* ops ---------------------------------

SIZE = 6 * 128
FAILING_RANK = 1


class FakeVmm:
    """The vmm_* ops of torch.ops.moe_a2a faked on the CPU. An allocation is a
    file holding b"<creator rank>:<size>:<handle type>"; a posix_fd export
    opens it, a fabric export gives its bytes padded to 64; an import reads
    them back, so a handle's identity shows whose row it maps. ``fail``:
    {(op, handle type)} that raise RuntimeError, as a driver error would."""

    def __init__(self, rank: int, directory: str, fail=()):
        self.rank, self.directory, self.fail = rank, directory, set(fail)
        self.live: dict[int, bytes] = {}  # handle -> identity
        self.paths: dict[int, str] = {}
        self._next = 1

    def _new(self, identity: bytes) -> int:
        handle, self._next = self._next, self._next + 1
        self.live[handle] = identity
        return handle

    def _maybe_fail(self, op: str, handle_type: str) -> None:
        if (op, handle_type) in self.fail:
            raise RuntimeError(f"fake {op} failure ({handle_type})")

    def vmm_create(self, index, size, handle_type):
        self._maybe_fail("create", handle_type)
        identity = f"{self.rank}:{size}:{handle_type}".encode()
        path = os.path.join(self.directory, f"row{self.rank}_{handle_type}")
        with open(path, "wb") as f:
            f.write(identity)
        handle = self._new(identity)
        self.paths[handle] = path
        return handle

    def vmm_export(self, handle, handle_type):
        self._maybe_fail("export", handle_type)
        if handle_type == POSIX_FD:
            return [os.open(self.paths[handle], os.O_RDONLY)]
        return list(self.live[handle].ljust(ws._FABRIC_HANDLE_BYTES, b"\0"))

    def vmm_import(self, index, shareable, handle_type):
        self._maybe_fail("import", handle_type)
        if handle_type == POSIX_FD:
            return self._new(os.pread(shareable[0], 256, 0))
        return self._new(bytes(shareable).rstrip(b"\0"))

    def vmm_release(self, handle):
        del self.live[handle]


def _socket_dirs() -> set:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("torch_moe_a2a_")}


class _Later:
    """Stands for the workspace that allocate_workspace maps after an exchange."""


def _trade_then_allocate(ops, coll, handles):
    """What allocate_workspace does: a fabric exchange, then a new object in the same frame."""
    failures = ws._trade_fabric_handles(ops, coll, 0, SIZE, handles)
    later = _Later()
    return failures, later


def _bootstrap_worker(rank, world, init_file, out_dir, row_dir, adapter):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        # The one bootstrap, over either kind of group.
        group = dist.group.WORLD if adapter == "torch" else TorchDistributedCommBackend(dist.group.WORLD)
        coll = as_collective(group)
        results = {}
        dist.barrier()
        fds_before, dirs_before = open_fds(), _socket_dirs()

        ops = FakeVmm(rank, row_dir)
        handles = [None] * world
        ws._trade_file_descriptors(ops, coll, 0, SIZE, handles)
        results["posix"] = [ops.live[h] for h in handles]
        ws._release(ops, handles)
        results["posix_live"] = len(ops.live)

        handles = [None] * world
        results["fabric_failures"] = ws._trade_fabric_handles(ops, coll, 0, SIZE, handles)
        results["fabric"] = [ops.live[h] for h in handles]
        ws._release(ops, handles)

        # No IMEX channel on one rank: its fabric cuMemCreate fails. The
        # failure must not tie the caller's frame (allocate_workspace's,
        # which goes on to hold the workspace) into a reference cycle.
        ops = FakeVmm(rank, row_dir, fail={("create", FABRIC)} if rank == FAILING_RANK else ())
        handles = [None] * world
        gc.disable()
        try:
            results["fabric_create_failures"], later = _trade_then_allocate(ops, coll, handles)
            later_ref = weakref.ref(later)
            del later
            results["caller_locals_freed"] = later_ref() is None
        finally:
            gc.enable()
        ws._release(ops, handles)

        # A peer's fabric handle cannot be imported on one rank.
        ops = FakeVmm(rank, row_dir, fail={("import", FABRIC)} if rank == FAILING_RANK else ())
        handles = [None] * world
        results["fabric_import_failures"] = ws._trade_fabric_handles(ops, coll, 0, SIZE, handles)
        ws._release(ops, handles)
        results["fabric_live"] = len(ops.live)

        # A descriptor import fails on one rank: every rank raises, naming it.
        ops = FakeVmm(rank, row_dir, fail={("import", POSIX_FD)} if rank == FAILING_RANK else ())
        handles = [None] * world
        try:
            ws._trade_file_descriptors(ops, coll, 0, SIZE, handles)
            results["posix_import_error"] = None
        except RuntimeError as e:
            results["posix_import_error"] = str(e)
        ws._release(ops, handles)
        results["failed_live"] = len(ops.live)

        dist.barrier()  # every rank is past its exchanges
        fds_after = open_fds()
        results["leaked_fds"] = {k: v for k, v in fds_after.items() if k not in fds_before}
        results["leaked_dirs"] = sorted(_socket_dirs() - dirs_before)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("adapter", ["torch", "comm_backend"])
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_exchanges_between_processes(world, adapter, tmp_path):
    rows = tmp_path / "rows"
    rows.mkdir()
    run_ranks(_bootstrap_worker, world, (str(tmp_path / "init"), str(tmp_path), str(rows), adapter),
              report_dir=tmp_path, timeout_s=120)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for rank, res in enumerate(got):
        assert res["posix"] == [f"{p}:{SIZE}:{POSIX_FD}".encode() for p in range(world)], f"rank {rank}"
        assert res["fabric_failures"] == [None] * world, f"rank {rank}"
        assert res["fabric"] == [f"{p}:{SIZE}:{FABRIC}".encode() for p in range(world)], f"rank {rank}"
        for key, op in (("fabric_create_failures", "create"), ("fabric_import_failures", "import")):
            failures = res[key]
            assert [f is None for f in failures] == [r != FAILING_RANK for r in range(world)], (key, failures)
            assert f"fake {op} failure (fabric)" in failures[FAILING_RANK], failures
        error = res["posix_import_error"]
        assert error is not None, f"rank {rank} did not raise"
        assert f"passing the file descriptors failed on group ranks [{FAILING_RANK}]" in error, error
        assert "fake import failure (posix_fd)" in error, error
        assert res["posix_live"] == res["fabric_live"] == res["failed_live"] == 0
        assert res["caller_locals_freed"], f"rank {rank}: a failed exchange kept its caller's frame alive"
        assert not res["leaked_fds"], f"rank {rank} leaked descriptors: {res['leaked_fds']}"
        assert not res["leaked_dirs"], f"rank {rank}: socket directories left behind: {res['leaked_dirs']}"


# ---- builds without CUDA -------------------------------------------------------------------

HAS_VMM = hasattr(torch.ops.moe_a2a, "vmm_map")


@pytest.mark.skipif(HAS_VMM, reason="this build has the CUDA workspace ops")
def test_cuda_group_workspace_needs_a_cuda_build(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    # Where torch sees no CUDA device, that is the reason given first.
    why = r"need torch_moe_a2a built with CUDA" if torch.cuda.is_available() else r"sees no CUDA device"
    try:
        with pytest.raises(RuntimeError, match=r"group ranks \[0\].*" + why):
            a2a.allocate_workspace(1 << 21, group=dist.group.WORLD, device="cuda")
        with pytest.raises(RuntimeError, match=why):
            a2a.MoeAlltoAll(ep_mapping(0, 1), 8, 2, 4, hidden_size=64, group=dist.group.WORLD, device="cuda")
        with pytest.raises(RuntimeError, match=r"need torch_moe_a2a built with CUDA"):
            a2a.cuda_workspace_granularity()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("call", ["allocate_workspace", "MoeAlltoAll"])
def test_a_group_this_process_is_not_in_is_named_as_such(call):
    """dist.new_group returns GroupMember.NON_GROUP_MEMBER to the processes
    outside the group; passed on as group=, it is refused as what it is, not
    as an int that is no ProcessGroup."""
    group = dist.GroupMember.NON_GROUP_MEMBER
    with pytest.raises(ValueError, match=r"GroupMember.NON_GROUP_MEMBER .*this process is not a member"):
        if call == "allocate_workspace":
            a2a.allocate_workspace(4096, group=group)
        else:
            a2a.MoeAlltoAll(ep_mapping(0, 2), 8, 2, 4, hidden_size=64, group=group, device="cpu")


def test_a_dead_mappings_callback_leaves_a_newer_mapping_at_its_address(tmp_path):
    """A shared CPU workspace's record (what checkpoint_prepare releases) is
    forgotten when its mapping dies, by a weak-reference callback that runs
    after the memory is unmapped: a workspace another thread mapped at the
    same address in between keeps its record."""

    class Newer:  # stands in for that other thread's mapping
        pass

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    base = None
    try:
        workspace = a2a.allocate_workspace(a2a.moe_a2a_get_workspace_size_per_rank(1, 4, 64, 64),
                                           group=dist.group.WORLD)
        base = workspace.untyped_storage().data_ptr()
        record = ws._CPU_MAPPINGS[base]  # kept, or its callback would die with it
        newer = Newer()
        ws._CPU_MAPPINGS[base] = weakref.ref(newer)
        del workspace
        gc.collect()
        assert record() is None  # the mapping died and its callback ran
        assert ws._CPU_MAPPINGS.get(base) is not None and ws._CPU_MAPPINGS[base]() is newer
    finally:
        ws._CPU_MAPPINGS.pop(base, None)
        dist.destroy_process_group()
