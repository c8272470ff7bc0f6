"""The shared memory of a multi-process CPU workspace: a private file that no
other process can open, and nothing left behind when a member is killed
(SIGKILL, which no cleanup code sees) at any point of allocate_workspace or
after it; the survivors raise instead of waiting forever."""

import datetime
import os
import signal
import stat
import subprocess

import pytest
import torch.distributed as dist
from conftest import Case, TorchDistributedCommBackend, make_generator, make_inputs, open_fds, run_ranks

import torch_moe_a2a as a2a
from torch_moe_a2a import reference
from torch_moe_a2a import workspace as ws_module
from torch_moe_a2a.workspace import SHARED_FILE_PREFIX

SHM_DIR = "/dev/shm"
MEMFD_PREFIX = "/memfd:" + SHARED_FILE_PREFIX
WORLD = 2
CASE = Case(WORLD, (9, 4), 3, 6, hidden=64, runtime_max=12)
# The ops' bound on a wait for a peer in the runs where one is killed after setup.
OP_TIMEOUT_S = 3.0
# An unprivileged user that is not this one (tests run as root here; 65534 is nobody).
OTHER_UID = 65534


def _shm_entries() -> set:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(SHARED_FILE_PREFIX)} if os.path.isdir(SHM_DIR) else set()


def _shared_file_fds() -> list:
    return [v for v in open_fds().values() if MEMFD_PREFIX in v]


def test_shared_file_is_private():
    """The file has mode 0600 and no name in any directory; the own user
    opens it through /proc/<pid>/fd (as the peers do), another user cannot."""
    shm_before = _shm_entries()
    fd = ws_module._create_shared_file(8192)
    path = f"/proc/{os.getpid()}/fd/{fd}"
    try:
        st = os.fstat(fd)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
        assert st.st_nlink == 0 and st.st_size == 8192
        assert os.readlink(path).startswith(MEMFD_PREFIX)
        assert _shm_entries() == shm_before
        with open(path, "rb") as f:  # what a peer does
            assert f.read() == bytes(8192)
        if os.geteuid() == 0:
            other = subprocess.run(["cat", path], user=OTHER_UID, capture_output=True, text=True, timeout=60)
            assert other.returncode != 0 and "Permission denied" in other.stderr, (other.returncode, other.stderr)
    finally:
        os.close(fd)
    assert not os.path.exists(path) or MEMFD_PREFIX not in os.readlink(path)


class KillingCommBackend(TorchDistributedCommBackend):
    """A CommBackend whose process kills itself (SIGKILL) just before its
    ``kill_before``-th collective call (1-based; None: never)."""

    def __init__(self, group, kill_before):
        super().__init__(group)
        self.calls = 0
        self.kill_before = kill_before

    def _tick(self):
        self.calls += 1
        if self.calls == self.kill_before:
            os.kill(os.getpid(), signal.SIGKILL)

    def allgather(self, data):
        self._tick()
        return super().allgather(data)

    def barrier(self):
        self._tick()
        super().barrier()


# Where the victim dies: before the n-th collective call of allocate_workspace
# (1: the argument check, 2: the sizes, 3: creating the file, 4: rank 0 sends
# where it is, 5: the mapping step, 6: the last barrier), or after it returned.
KILL_POINTS = {"file created": 4, "file mapped": 5, "descriptor closed": 6, "after setup": None}


def _worker(rank, world, init_file, out_dir, victim, point):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    kill_before = KILL_POINTS[point] if rank == victim else None
    comm = KillingCommBackend(dist.group.WORLD, kill_before)
    size = a2a.moe_a2a_get_workspace_size_per_rank(world, CASE.max_tokens, CASE.dispatch_bytes, CASE.combine_bytes)
    outcome = "returned"
    try:
        workspace = a2a.allocate_workspace(size, group=comm)
        if rank == victim and point == "after setup":  # every member has its workspace now
            os.kill(os.getpid(), signal.SIGKILL)
        metainfo = a2a.moe_a2a_initialize(workspace, rank, world, CASE.max_tokens, timeout_s=OP_TIMEOUT_S)
        x = make_inputs(CASE, make_generator(world))
        a2a.moe_a2a_dispatch(x.ids[rank], x.payloads[rank], workspace, metainfo, CASE.T, rank, world,
                             CASE.top_k, CASE.num_experts)
    except Exception as e:  # what the test expects of a survivor
        outcome = f"raised {type(e).__name__}: {e}"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{len(_shared_file_fds())}\n{outcome}")
    # A group with a dead member: no teardown (it could wait for the dead).
    os._exit(0)


@pytest.mark.parametrize(
    "victim,point",
    [(0, "file created"), (1, "after setup")]
    + [pytest.param(v, p, marks=pytest.mark.slow) for v in range(WORLD) for p in KILL_POINTS
       if (v, p) not in ((0, "file created"), (1, "after setup"))],
)
def test_killed_member_leaves_nothing_behind(victim, point, tmp_path):
    """A member killed at ``point``: every other member raises (a collective
    that lost a member, or the ops' bounded wait for a peer) instead of
    waiting forever, holds no descriptor of the file afterwards but its
    mapping's, and no file
    of the workspace is left in /dev/shm once the processes ended."""
    shm_before = _shm_entries()
    run_ranks(_worker, WORLD, (str(tmp_path / "init"), str(tmp_path), victim, point), report_dir=tmp_path,
              timeout_s=240, exit_codes={victim: -signal.SIGKILL})
    assert _shm_entries() <= shm_before, f"left behind: {sorted(_shm_entries() - shm_before)}"
    for rank in range(WORLD):
        if rank == victim:
            assert not (tmp_path / f"rank{rank}.txt").exists()
            continue
        fds, outcome = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        assert outcome.startswith("raised "), f"rank {rank}: {outcome}"
        if point != "after setup":  # a collective of the setup lost a member: named as such, not as gloo's error
            assert f"raised RuntimeError: rank {rank} of a group of {WORLD}: the group's " in outcome, outcome
        if point == "after setup":  # the victim died before it initialized its row
            assert f"peers [{victim}] did not arrive within" in outcome, outcome
            assert f"peers [{victim}] have not initialized their rows" in outcome, outcome
            assert "thread each" not in outcome, outcome  # the one-thread loop's hint is for ranks of one process
        # A live workspace's mapping keeps one descriptor (Python's mmap does); a failed setup none.
        expected_fds = "1" if point == "after setup" else "0"
        assert fds == expected_fds, f"rank {rank} holds {fds} descriptors of the shared file"


def _round_trip_worker(rank, world, init_file):
    """Sanity of the kill harness: without a kill, the same steps succeed."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        comm = KillingCommBackend(dist.group.WORLD, None)
        size = a2a.moe_a2a_get_workspace_size_per_rank(world, CASE.max_tokens, CASE.dispatch_bytes,
                                                       CASE.combine_bytes)
        workspace = a2a.allocate_workspace(size, group=comm)
        assert comm.calls == max(p for p in KILL_POINTS.values() if p is not None), comm.calls
        metainfo = a2a.moe_a2a_initialize(workspace, rank, world, CASE.max_tokens, timeout_s=60.0)
        x = make_inputs(CASE, make_generator(world))
        a2a.moe_a2a_dispatch(x.ids[rank], x.payloads[rank], workspace, metainfo, CASE.T, rank, world,
                             CASE.top_k, CASE.num_experts)
        counts = a2a.moe_a2a_get_recv_counts(workspace, metainfo, rank).tolist()
        ref = reference.reference_dispatch(x.ids, x.payloads, ep_size=world, num_experts=CASE.num_experts,
                                           runtime_max_tokens_per_rank=CASE.T)
        assert counts == ref.recv_counts[rank].tolist(), (counts, ref.recv_counts[rank])
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_kill_points_are_the_bootstrap_steps(tmp_path):
    """The kill points above count allocate_workspace's collective calls: with
    no kill, it makes exactly that many, and the same steps succeed."""
    run_ranks(_round_trip_worker, WORLD, (str(tmp_path / "init"),), report_dir=tmp_path, timeout_s=240)
