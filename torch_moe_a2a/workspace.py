"""Workspace allocation (DESIGN.md sections 2 and 5).

The workspace is a ``[ep_size, size_per_rank]`` uint8 tensor whose row ``r`` is
rank ``r``'s memory, readable and writable by every rank:

- simulated ranks in one process: a plain zeroed tensor on one device;
- one rank per process on the CPU: one anonymous shared-memory file (memfd)
  mapped by every process of a ``torch.distributed`` group;
- one rank per process on CUDA: CUDA virtual memory. Each process creates its
  own row, exports it (a POSIX file descriptor passed over a Unix socket, or a
  fabric handle gathered through the group), imports its peers' rows and maps
  all rows contiguously (``torch.ops.moe_a2a.vmm_*``, csrc/cuda/vmm.cpp).

The multi-process paths are collective, over a ``torch.distributed`` group
or a FlashInfer ``CommBackend`` alike (:mod:`torch_moe_a2a.collective`). Every step that can fail in one
process ends with a status exchange through the group, so when one member
fails, every member raises an error naming the failed ranks instead of waiting
for it in the next step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import secrets
import socket
import struct
import tempfile
import weakref
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from . import layout
from .collective import Collective, allgather_ints, as_collective

_log = logging.getLogger(__name__)

# Handle types of a multi-process CUDA workspace (the names csrc/cuda/vmm.cpp takes).
POSIX_FD = "posix_fd"
FABRIC = "fabric"
# MOE_A2A_HANDLE_TYPE=posix_fd|fabric forces one; unset, empty or "auto" lets
# choose_handle_type decide. Every member of a group must set the same.
HANDLE_TYPE_ENV = "MOE_A2A_HANDLE_TYPE"
_AUTO = ("", "auto")
# How the override travels in the bootstrap's int gather.
_OVERRIDE_CODES = {None: 0, POSIX_FD: 1, FABRIC: 2}
_FABRIC_HANDLE_BYTES = 64  # sizeof(CUmemFabricHandle)

# Bound on every socket wait of the descriptor exchange: peers are at most
# one collective step apart, so only a peer that stopped runs into it.
_SOCKET_TIMEOUT_S = 60.0
# A descriptor message: the sender's group rank, then the receiver's token
# (which only the group's members learned, through the group).
_TOKEN_BYTES = 16
_FD_MESSAGE = struct.Struct(f"<i{_TOKEN_BYTES}s")
# Linux limits a Unix socket path to 107 bytes (sun_path holds 108 with the NUL).
_SOCKET_PATH_MAX = 107
_SOCKET_NAME = "socket"

# The longest message of a member's failure in a step's status exchange.
_STATUS_BYTES = 2048
# The status a member reports after a step.
_OK, _BAD_VALUE, _FAILED = 0, 1, 2


def _zeros_plane_aligned(ep_size: int, size_per_rank: int, device: torch.device) -> torch.Tensor:
    """A zeroed ``[ep_size, size_per_rank]`` uint8 tensor whose first byte is
    ``layout.PLANE_ALIGN``-aligned in memory, so that the payload planes (that
    aligned inside a row, and rows are multiples of it) are too: DESIGN.md
    has planes start 128-byte aligned. CUDA allocations already are; CPU ones
    are 64-byte aligned, so the CPU tensor is a view into a slightly larger
    buffer (which it keeps alive)."""
    if device.type != "cpu":
        workspace = torch.zeros((ep_size, size_per_rank), dtype=torch.uint8, device=device)
        if workspace.data_ptr() % layout.PLANE_ALIGN == 0:
            return workspace
        del workspace
    nbytes = ep_size * size_per_rank
    buffer = torch.zeros(nbytes + layout.PLANE_ALIGN, dtype=torch.uint8, device=device)
    skip = -buffer.data_ptr() % layout.PLANE_ALIGN
    return buffer[skip : skip + nbytes].view(ep_size, size_per_rank)


def allocate_workspace(
    size_per_rank: int,
    *,
    group: Any = None,
    ep_size: Optional[int] = None,
    device: Union[torch.device, str, None] = None,
) -> torch.Tensor:
    """Return a zeroed ``[ep_size, size_per_rank]`` uint8 workspace.

    size_per_rank: bytes per rank, a multiple of ``layout.ALIGN`` (the value of
    ``moe_a2a_get_workspace_size_per_rank``).

    Without ``group``: ``ep_size`` simulated ranks in this process share one
    zeroed tensor on ``device`` (default CPU), its first byte aligned so that
    every payload plane is 256-byte aligned in memory (on the CPU a view into
    a buffer 256 bytes larger).

    With ``group`` (a ``torch.distributed`` process group, or an object with
    FlashInfer's ``CommBackend`` interface: :mod:`torch_moe_a2a.collective`;
    ``ep_size`` defaults to, and must equal, its size): a collective call; row ``r`` is
    the memory of group rank ``r`` in every process. The members must agree
    on ``size_per_rank`` and on the kind of ``device``, CPU or CUDA
    (ValueError naming the ranks otherwise); when a
    member fails, every member raises (ValueError for bad arguments,
    RuntimeError otherwise), naming the failed ranks.

    - ``device`` CPU (default): every member maps the same shared-memory
      file, an anonymous one (memfd, mode 0600) that group rank 0 creates
      and the peers open through rank 0's ``/proc/<pid>/fd`` entry, so the
      members must be processes of one user on one host that see each
      other's /proc. It never has a name in a directory: nothing is left
      behind when a process dies, during this call or later. Each member's
      mapping keeps a descriptor of it (Python's mmap does), which /proc
      lets only processes of the same user open.
    - ``device`` CUDA (one rank per process; several processes may share a
      GPU): each member creates its row on its device with ``cuMemCreate``,
      the members trade the rows (fabric handles through the group where
      every member's driver can, else POSIX file descriptors over private
      Unix sockets, which needs all members on one host; see
      :func:`choose_handle_type` and ``MOE_A2A_HANDLE_TYPE``), and each maps
      all rows into one address range with read/write access for its device.
      A row is whole allocations, so rows lie ``size_per_rank`` rounded up to
      :func:`cuda_workspace_granularity` apart: the result is the
      ``[ep_size, size_per_rank]`` view of them (``stride(0)`` is the rounded
      size; the ops accept such padded rows and never touch the padding).
      A ``torch.distributed`` group's bootstrap collectives use CPU tensors,
      or tensors on ``device`` for an NCCL-only group.

    Ownership: the returned tensor owns the mapping; the memory is released
    with its last reference (views included). A member's row lives on until
    every member has released the workspace. Every row is zero when this
    returns on any member (each member zeroes its own row before the final
    exchange): no peer can write into a row before its owner cleared it. Each
    rank still calls ``moe_a2a_initialize`` on its own row and synchronizes
    the group before any peer's dispatch (``MoeAlltoAll`` does both).

    Args:
        size_per_rank: bytes per rank, a positive multiple of ``layout.ALIGN``.
        group: a ``torch.distributed`` group or a ``CommBackend`` to map the
            workspace over, or None for simulated ranks in this process.
        ep_size: the number of rows: required without ``group`` (an int in
            ``[1, layout.MAX_RANKS]``); with ``group``, None or the group's size.
        device: where the workspace lives (default CPU); with ``group``, a
            CPU or CUDA device.

    Returns:
        The zeroed ``[ep_size, size_per_rank]`` uint8 workspace.

    Raises:
        ValueError: ``size_per_rank`` not a positive int multiple of
            ``layout.ALIGN``; without ``group``, ``ep_size`` not an int in
            ``[1, layout.MAX_RANKS]``; with ``group``, a group size outside
            that range, a ``device`` neither CPU nor CUDA, an ``ep_size``
            other than the group's size, members that disagree on
            ``size_per_rank`` or on the kind of device, and for a CUDA
            workspace a ``MOE_A2A_HANDLE_TYPE`` that is unknown, differs
            between members or asks for fabric handles where a member cannot
            have them (with ``group``, every member raises when any member's
            arguments are bad).
        RuntimeError: a CUDA ``device`` where torch sees none; with
            ``group``, any other failure of a member (a build without CUDA
            for a CUDA workspace, the driver, the exchange of the rows),
            raised on every member and naming the failed ranks.
    """
    if group is None:
        _check_size(size_per_rank)
        if isinstance(ep_size, bool) or not isinstance(ep_size, int) or not 1 <= ep_size <= layout.MAX_RANKS:
            raise ValueError(f"ep_size must be an int in [1, {layout.MAX_RANKS}] without a group, got {ep_size!r}")
        # A tensor's bytes are counted in int64 (the CPU buffer has PLANE_ALIGN
        # bytes more): beyond that torch.zeros fails to unpack its size.
        if ep_size * size_per_rank + layout.PLANE_ALIGN > (1 << 63) - 1:
            raise ValueError(f"allocate_workspace: ep_size * size_per_rank = {ep_size} * {size_per_rank} bytes is "
                             f"more than a tensor holds (2**63 - 1 bytes)")
        device = torch.device("cpu" if device is None else device)
        check_device_visible("allocate_workspace", device)
        return _zeros_plane_aligned(ep_size, size_per_rank, device)

    # A member must not raise alone: the others would wait in the next
    # collective until the group's timeout. Every member checks its own
    # arguments, then every member raises if any member's were bad.
    parsed = _workspace_device(device)
    coll = as_collective(group, parsed if parsed is not None else _fallback_device())
    if not 1 <= coll.size <= layout.MAX_RANKS:  # the same on every member
        raise ValueError(f"group size {coll.size} out of range [1, {layout.MAX_RANKS}]")
    with _collective_step("the argument check", coll):
        _check_size(size_per_rank)
        if parsed is None:
            raise ValueError(f"unsupported workspace device {device!r} (cpu or cuda)")
        check_device_visible("allocate_workspace", parsed)
        if ep_size is not None and ep_size != coll.size:
            raise ValueError(f"ep_size {ep_size} differs from the group size {coll.size}")
    device = parsed
    # The CPU and CUDA paths make different collectives: members of both kinds would wait on each other.
    agreed = allgather_ints([size_per_rank, int(device.type == "cuda")], coll)
    sizes = [v[0] for v in agreed]
    if len(set(sizes)) != 1:
        raise ValueError(f"group members disagree on size_per_rank ({_describe_by_value(sizes)})")
    kinds = ["cuda" if v[1] else "cpu" for v in agreed]
    if len(set(kinds)) != 1:
        raise ValueError(f"group members disagree on the workspace device ({_describe_by_value(kinds)})")
    if device.type == "cuda":
        return _cuda_vmm_workspace(coll, size_per_rank, device)
    return _shared_cpu_workspace(coll, size_per_rank)


def release_workspace_memory(workspace: torch.Tensor, group: Any) -> None:
    """Give back the memory of a multi-process workspace, keeping its addresses (collective).

    ``workspace``: what :func:`allocate_workspace` returned with ``group``.
    Every member finishes its work on the device, then the group
    synchronizes, each member unmaps every row and releases its handles
    (CUDA: the reserved address range stays, so captured CUDA graphs and
    views keep their addresses; CPU: the shared file's pages are freed), and
    the group synchronizes again. Until :func:`restore_workspace_memory`, any
    access to the workspace is invalid (CUDA: an illegal address).

    Raises:
        ValueError: ``workspace`` is not a multi-process workspace of this process.
    """
    coll = as_collective(group, workspace.device)
    kind = _multiprocess_kind(workspace)
    if workspace.is_cuda:
        torch.cuda.synchronize(workspace.device)
    coll.barrier()  # no member still reads or writes a peer's row
    with _collective_step("releasing the workspace memory", coll):
        if kind == "cuda":
            _vmm_ops().vmm_unmap(workspace.device.index, workspace.untyped_storage().data_ptr())
        elif coll.rank == 0:  # one hole punch frees the shared file for every member
            _cpu_mapping(workspace).madvise(mmap.MADV_REMOVE)
    coll.barrier()


def restore_workspace_memory(workspace: torch.Tensor, group: Any) -> None:
    """Give a released workspace fresh, zeroed memory at its old addresses (collective).

    The inverse of :func:`release_workspace_memory`, over ``group`` (the same
    ranks in the same order; it may be another communicator object). CUDA:
    every member creates and trades a new row as :func:`allocate_workspace`
    does and maps the rows into the reserved range; CPU: the freed pages of
    the shared file read as zeros again. Every row is zero when this returns;
    the rows still need ``moe_a2a_initialize`` (``MoeAlltoAll.checkpoint_restore``
    does it).

    Raises:
        ValueError: ``workspace`` is not a multi-process workspace of this
            process, or ``group``'s size differs from its rows.
    """
    coll = as_collective(group, workspace.device)
    kind = _multiprocess_kind(workspace)
    if coll.size != workspace.shape[0]:
        raise ValueError(f"the group has {coll.size} members, the workspace {workspace.shape[0]} rows")
    if kind == "cuda":
        index = workspace.device.index
        ops = _vmm_ops()
        row_stride = workspace.stride(0)
        handles, _ = _trade_rows(coll, ops, index, row_stride)
        with _collective_step("mapping the rows", coll):
            rows, handles = handles, [None] * coll.size
            ops.vmm_remap(index, workspace.untyped_storage().data_ptr(), rows)  # owns every handle, also on failure
            workspace[coll.rank].zero_()
            torch.cuda.synchronize(index)
    else:
        coll.barrier()


def cuda_workspace_granularity(device: Union[torch.device, str, int, None] = None) -> int:
    """Bytes a row of a multi-process CUDA workspace on ``device`` (default:
    the current CUDA device) is rounded up to: the driver's recommended
    allocation granularity (2 MiB on current GPUs), for every handle type the
    device may use. A ``size_per_rank`` that is a multiple of it gives a
    contiguous workspace. RuntimeError without CUDA support.

    Args:
        device: a CUDA device, its index, or None for the current CUDA device.

    Returns:
        The granularity in bytes: the least common multiple of the
        descriptor handles' and, where the device supports them and the
        driver reports one, the fabric handles' granularity.

    Raises:
        RuntimeError: a build of torch_moe_a2a without CUDA, or no CUDA
            device visible to torch.
        ValueError: ``device`` not a CUDA device.
    """
    ops = _vmm_ops()
    index = _cuda_index(device)
    unit = int(ops.vmm_granularity(index, POSIX_FD))
    if ops.vmm_fabric_supported(index):
        try:
            unit = math.lcm(unit, int(ops.vmm_granularity(index, FABRIC)))
        except RuntimeError:
            # Fabric handles are unusable here, so allocate_workspace will
            # not use them either: only the descriptor granularity matters.
            pass
    return unit


def choose_handle_type(
    overrides: Sequence[Optional[str]],
    fabric_supported: Sequence[bool],
    fabric_works: Sequence[bool],
) -> str:
    """The handle type of a group's CUDA workspace (``"posix_fd"`` or
    ``"fabric"``), from facts every member gathered; index ``r`` = group rank.

    overrides[r]: rank r's ``MOE_A2A_HANDLE_TYPE`` (``"posix_fd"``,
    ``"fabric"``, or None for automatic).
    fabric_supported[r]: rank r's device reports
    ``CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED``.
    fabric_works[r]: rank r created and exported its row as a fabric handle
    and imported every peer's (False where it was not tried).

    ``allocate_workspace`` asks twice: with ``fabric_works`` all True, to
    decide whether to try fabric handles, then with the outcome. Automatic:
    fabric handles when they work on every rank (they also reach GPUs on
    other hosts over NVLink, and need no socket), else POSIX file
    descriptors. A pure function, so every member decides alike: raises
    ValueError (on every member) when the members disagree on the override,
    or it asks for fabric handles where some rank cannot have them.
    """
    n = len(overrides)
    if n == 0 or len(fabric_supported) != n or len(fabric_works) != n:
        raise ValueError(
            f"one entry per rank expected, got {n} overrides, {len(fabric_supported)} fabric_supported, "
            f"{len(fabric_works)} fabric_works"
        )
    if len(set(overrides)) != 1:
        raise ValueError(f"group members disagree on {HANDLE_TYPE_ENV} ({_describe_by_value(overrides)})")
    override = overrides[0]
    if override not in _OVERRIDE_CODES:
        raise ValueError(f"unknown handle type {override!r}; expected {POSIX_FD!r}, {FABRIC!r} or None")
    if override == POSIX_FD:
        return POSIX_FD
    unsupported = [r for r in range(n) if not fabric_supported[r]]
    failing = [r for r in range(n) if fabric_supported[r] and not fabric_works[r]]
    if override == FABRIC:
        if unsupported:
            raise ValueError(
                f"{HANDLE_TYPE_ENV}={FABRIC}, but the CUDA devices of ranks {unsupported} do not support "
                "fabric handles"
            )
        if failing:
            raise ValueError(
                f"{HANDLE_TYPE_ENV}={FABRIC}, but fabric handles failed on ranks {failing} (they need an IMEX "
                "channel the user can open, /dev/nvidia-caps-imex-channels/channel*)"
            )
        return FABRIC
    return FABRIC if not unsupported and not failing else POSIX_FD


# ---- failures of a collective step ------------------------------------------------


# A member's outcome of a step: None, or (status kind, message).
_Failure = Optional[tuple[int, str]]


def gather_failures(error: Optional[BaseException], coll: Collective) -> list[_Failure]:
    """Collective: every member's outcome of a step, None or (kind, message)."""
    if error is None:
        status = bytes([_OK])
    else:
        kind = _BAD_VALUE if isinstance(error, ValueError) else _FAILED
        status = bytes([kind]) + f"{type(error).__name__}: {error}".encode()[: _STATUS_BYTES - 1]
    return [None if raw[0] == _OK else (raw[0], raw[1:].decode(errors="replace")) for raw in coll.allgather(status)]


def failed_members(failures: list[_Failure]) -> tuple[list[int], str]:
    """The group ranks whose step failed, and their messages ('rank r: ...; ...')."""
    failed = [r for r, f in enumerate(failures) if f is not None]
    return failed, "; ".join(f"rank {r}: {failures[r][1]}" for r in failed)


def _raise_failures(step: str, failures: list[_Failure], cause: Optional[BaseException]) -> None:
    failed, detail = failed_members(failures)
    if not failed:
        return
    cls = ValueError if all(failures[r][0] == _BAD_VALUE for r in failed) else RuntimeError
    raise cls(f"allocate_workspace: {step} failed on group ranks {failed}: {detail}") from cause


@contextlib.contextmanager
def _collective_step(step: str, coll: Collective) -> Iterator[None]:
    """Run the body locally, then tell every member whether every member
    succeeded: on any failure, every member raises the same error."""
    error = None
    try:
        yield
    except Exception as e:  # reported to every member below
        error = e
    failures = gather_failures(error, coll)
    # The exception must not stay in a local here: it was thrown into this
    # frame, so its traceback holds the frame, which would hold it, a cycle
    # that keeps the caller's frame (and the process group in it) alive until
    # a garbage collection, at any later time: a gloo group destroyed then,
    # after destroy_process_group or at exit, aborts the process.
    cause = [error]
    error = None
    _raise_failures(step, failures, cause.pop())


def check_device_visible(fn: str, device: torch.device, hint: str = "") -> None:
    """RuntimeError for a CUDA ``device`` where torch sees none (torch's own
    error there is a bare AssertionError); ``hint`` ends the message."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{fn}: device {str(device)!r} was asked for but torch {torch.__version__} sees no CUDA "
                           f"device{hint}")


def _check_size(size_per_rank: Any) -> None:
    if isinstance(size_per_rank, bool) or not isinstance(size_per_rank, int) or size_per_rank <= 0 \
            or size_per_rank % layout.ALIGN:
        raise ValueError(f"size_per_rank must be a positive multiple of {layout.ALIGN}, got {size_per_rank!r}")


def _workspace_device(device: Any) -> Optional[torch.device]:
    """``device`` (default CPU) if a multi-process workspace can live there, else None."""
    try:
        parsed = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError):
        return None
    return parsed if parsed.type in ("cpu", "cuda") else None


def _fallback_device() -> torch.device:
    """The device a member whose own is unusable lends the bootstrap's
    collectives, so that it still takes part in the one that reports it."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _describe_by_value(values: Sequence[Any]) -> str:
    """'ranks [0, 2]: a; ranks [1]: b' for per-rank ``values``."""
    by_value: dict[Any, list[int]] = {}
    for rank, value in enumerate(values):
        by_value.setdefault(value, []).append(rank)
    return "; ".join(f"ranks {ranks}: {value}" for value, ranks in by_value.items())


def _multiprocess_kind(workspace: Any) -> str:
    """``"cuda"`` or ``"cpu"`` for a workspace :func:`allocate_workspace` mapped
    over a group in this process; ValueError for any other tensor."""
    if isinstance(workspace, torch.Tensor) and workspace.dim() == 2:
        base = workspace.untyped_storage().data_ptr()
        if workspace.is_cuda and hasattr(torch.ops.moe_a2a, "vmm_map") and torch.ops.moe_a2a.vmm_is_workspace(base):
            return "cuda"
        if workspace.device.type == "cpu" and base in _CPU_MAPPINGS:
            return "cpu"
    raise ValueError("the workspace was not mapped over a group by allocate_workspace in this process "
                     "(a plain tensor has no memory to release and restore)")


# ---- one rank per process on the CPU: shared memory ---------------------------------


def _shared_cpu_workspace(coll: Collective, size_per_rank: int) -> torch.Tensor:
    """Group rank 0 creates an anonymous shared-memory file, every member maps
    it, rank 0 closes its descriptor after every member reported its mapping.

    The file is a memfd: it has no name in any directory, so nothing is left
    behind whichever process dies at whichever point (its memory goes with
    the last descriptor or mapping), and no other process can find it by a
    name. The peers reach it through ``/proc/<pid>/fd/<fd>`` of rank 0's
    creation descriptor, which the kernel lets only a process of the same
    user open (the file is 0600 besides); they check that they opened the
    file rank 0 created (device and inode, which rank 0 sends along).
    """
    total = coll.size * size_per_rank
    fd = -1
    address = b""
    try:
        with _collective_step("creating the shared-memory file", coll):
            if coll.rank == 0:
                fd = _create_shared_file(total)
                st = os.fstat(fd)
                address = _SHARED_FILE_ADDRESS.pack(os.getpid(), fd, st.st_dev, st.st_ino)
        address = coll.allgather(address)[0]
        workspace = None
        with _collective_step("mapping the shared-memory file", coll):
            workspace = _map_shared_file(coll, address, total, fd, size_per_rank)
    finally:
        if fd >= 0:
            os.close(fd)
    # Once this returns on any member, rank 0's creation descriptor, the
    # one whose number the peers learned, is closed.
    coll.barrier()
    return workspace


# Rank 0 -> peers: its process id, the descriptor number, and the file's device and inode.
_SHARED_FILE_ADDRESS = struct.Struct("<qqQQ")
# memfd names show in /proc/<pid>/maps as "/memfd:<name> (deleted)".
SHARED_FILE_PREFIX = "torch_moe_a2a_"


def _create_shared_file(nbytes: int) -> int:
    """A new anonymous shared-memory file of ``nbytes`` zero bytes, mode 0600; its descriptor.

    Raises:
        OSError: the kernel refused the file or its size.
    """
    fd = os.memfd_create(f"{SHARED_FILE_PREFIX}{os.getpid()}_{secrets.token_hex(8)}", os.MFD_CLOEXEC)
    try:
        # memfd_create gives mode 0777: only the owner may open it through /proc.
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)  # a new file reads as zeros
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map_shared_file(coll: Collective, address: bytes, total: int, own_fd: int, size_per_rank: int) -> torch.Tensor:
    """Map rank 0's shared file (``own_fd`` on rank 0; on a peer, opened
    through rank 0's /proc entry named by ``address``) as the
    ``[coll.size, size_per_rank]`` workspace."""
    if coll.rank == 0:
        fd = os.dup(own_fd)
    else:
        pid, number, dev, ino = _SHARED_FILE_ADDRESS.unpack(address)
        path = f"/proc/{pid}/fd/{number}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise RuntimeError(
                f"cannot open group rank 0's shared-memory file {path}: {e}. A CPU workspace needs every "
                "member on one host, run by one user, in one PID namespace (each opens the file through "
                "rank 0's /proc entry)"
            ) from e
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino, st.st_size) != (dev, ino, total):
            os.close(fd)
            raise RuntimeError(f"{path} is not group rank 0's shared-memory file (another file under that number)")
    try:
        mapping = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    # frombuffer keeps `mapping` alive for as long as the tensor (and its views) live.
    workspace = torch.frombuffer(mapping, dtype=torch.uint8).view(coll.size, size_per_rank)
    base = workspace.untyped_storage().data_ptr()
    _CPU_MAPPINGS[base] = weakref.ref(mapping, lambda ref, base=base: _forget_mapping(base, ref))
    return workspace


def _forget_mapping(base: int, ref: weakref.ref) -> None:
    """Weak-reference callback of a dead mapping: forget its entry, unless a
    newer mapping at the same address replaced it (the memory is unmapped
    before the callback runs, so another thread may map a workspace there
    first)."""
    if _CPU_MAPPINGS.get(base) is ref:
        del _CPU_MAPPINGS[base]


# Storage address -> weak reference to the mapping of a shared CPU workspace
# (release_workspace_memory punches its pages out).
_CPU_MAPPINGS: dict[int, weakref.ref] = {}


def _cpu_mapping(workspace: torch.Tensor) -> mmap.mmap:
    mapping = _CPU_MAPPINGS[workspace.untyped_storage().data_ptr()]()
    if mapping is None:  # the workspace outlives its mapping: cannot happen while frombuffer holds it
        raise RuntimeError("the shared-memory workspace's mapping is gone")
    return mapping


# ---- one rank per process on CUDA: virtual memory ----------------------------------------


def _vmm_ops() -> Any:
    """torch.ops.moe_a2a, checked to have the vmm_* ops (builds with CUDA only)."""
    ops = torch.ops.moe_a2a
    if not hasattr(ops, "vmm_map"):
        raise RuntimeError(
            "multi-process CUDA workspaces need torch_moe_a2a built with CUDA, but this build has the CPU "
            "kernels only (rebuild with a CUDA build of torch and nvcc available)"
        )
    return ops


def _cuda_index(device: Union[torch.device, str, int, None]) -> int:
    if not torch.cuda.is_available():
        raise RuntimeError("a multi-process CUDA workspace needs a CUDA device, but torch sees none")
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def _handle_type_override() -> Optional[str]:
    value = os.environ.get(HANDLE_TYPE_ENV, "").strip().lower()
    if value in _AUTO:
        return None
    if value not in (POSIX_FD, FABRIC):
        raise ValueError(f"{HANDLE_TYPE_ENV}={value!r}; expected {POSIX_FD!r}, {FABRIC!r} or 'auto'")
    return value


def _cuda_vmm_workspace(coll: Collective, size_per_rank: int, device: torch.device) -> torch.Tensor:
    """The steps: check locally, agree on the handle type, trade the rows
    (fabric handles, or descriptors), map, zero the own row; each ends with a
    collective status exchange (_collective_step)."""
    ops = index = row_stride = None
    with _collective_step("checking the CUDA device", coll):
        ops = _vmm_ops()
        index = _cuda_index(device)
        torch.cuda.init()
        unit = cuda_workspace_granularity(index)
        row_stride = -(-size_per_rank // unit) * unit  # whole allocations per row
    handles, handle_type = _trade_rows(coll, ops, index, row_stride)
    workspace = None
    try:
        with _collective_step("mapping the rows", coll):
            rows, handles = handles, [None] * coll.size
            rows_mapped = ops.vmm_map(index, row_stride, rows)  # owns every handle from here, also on failure
            workspace = rows_mapped[:, :size_per_rank]  # shares (and keeps alive) the mapping
            # Peers write into this row only after allocate_workspace returned
            # on them, which is after the exchange that closes this step.
            workspace[coll.rank].zero_()
            torch.cuda.synchronize(index)
    finally:
        _release(ops, handles)
    _log.info("allocate_workspace: group rank %d of %d mapped %d rows of %d bytes on cuda:%d (%s handles)",
              coll.rank, coll.size, coll.size, size_per_rank, index, handle_type)
    return workspace


def _trade_rows(coll: Collective, ops: Any, index: int, row_stride: int) -> tuple[list[Optional[int]], str]:
    """Create this member's row of ``row_stride`` bytes on CUDA device
    ``index``, trade it with every member and import theirs (collective).

    Returns the allocation handles by row (this process owns them; the caller
    maps or releases them) and the handle type the members agreed on.
    """
    override, fabric_supported = None, False
    with _collective_step("checking the handle types", coll):
        override = _handle_type_override()
        fabric_supported = bool(ops.vmm_fabric_supported(index))
    facts = allgather_ints([_OVERRIDE_CODES[override], int(fabric_supported)], coll)
    names = {code: name for name, code in _OVERRIDE_CODES.items()}
    overrides = [names[f[0]] for f in facts]
    supported = [bool(f[1]) for f in facts]

    handles: list[Optional[int]] = [None] * coll.size  # allocation handles this process owns, by row
    try:
        handle_type = choose_handle_type(overrides, supported, [True] * coll.size)
        if handle_type == FABRIC:
            failures = _trade_fabric_handles(ops, coll, index, row_stride, handles)
            works = [f is None for f in failures]
            try:
                handle_type = choose_handle_type(overrides, supported, works)
            except ValueError as e:
                reasons = "; ".join(f"rank {r}: {f}" for r, f in enumerate(failures) if f is not None)
                raise ValueError(f"{e} ({reasons})") from None
            if handle_type != FABRIC:
                _log.info("fabric handles failed (%s); using POSIX file descriptors",
                          "; ".join(f"rank {r}: {f}" for r, f in enumerate(failures) if f is not None))
                _release(ops, handles)
        if handle_type == POSIX_FD:
            _trade_file_descriptors(ops, coll, index, row_stride, handles)
    except BaseException:
        _release(ops, handles)
        raise
    return handles, handle_type


def _release(ops: Any, handles: list[Optional[int]]) -> None:
    """Release the handles this process still owns (cleanup: never raises)."""
    for i, handle in enumerate(handles):
        if handle is None:
            continue
        handles[i] = None
        try:
            ops.vmm_release(handle)
        except RuntimeError as e:
            _log.warning("allocate_workspace: releasing a row's allocation handle failed: %s", e)


def _trade_fabric_handles(
    ops: Any, coll: Collective, index: int, size: int, handles: list[Optional[int]]
) -> list[Optional[str]]:
    """Create this rank's row with a fabric handle, gather every member's
    handle through the group and import the peers' rows into ``handles``.
    Returns, per rank, None where all of that worked, else why not."""
    exported = b""
    error = None
    try:
        handles[coll.rank] = ops.vmm_create(index, size, FABRIC)
        exported = bytes(ops.vmm_export(handles[coll.rank], FABRIC))
        if len(exported) != _FABRIC_HANDLE_BYTES:
            raise RuntimeError(f"a fabric handle has {_FABRIC_HANDLE_BYTES} bytes, the export gave {len(exported)}")
    except Exception as e:  # typically no IMEX channel: the peers learn it below
        error = e
    failures = [None if f is None else f[1] for f in gather_failures(error, coll)]
    # An exception left in a local ties this frame, and through it the
    # caller's (which will hold the workspace), into a reference cycle: the
    # workspace would outlive its last reference until the garbage collector runs.
    error = None
    peer_handles = coll.allgather(exported)
    if any(failures):
        return failures
    error = None
    try:
        for peer, shareable in enumerate(peer_handles):
            if peer != coll.rank:
                handles[peer] = ops.vmm_import(index, list(shareable), FABRIC)
    except Exception as e:
        error = e
    failures = [None if f is None else f[1] for f in gather_failures(error, coll)]
    error = None  # no cycle (above)
    return failures


def _socket_directory() -> str:
    """A new private (0700) directory for this rank's socket, in the temp
    directory unless a socket path there would be too long."""
    base = tempfile.gettempdir()
    # mkdtemp adds 8 random characters to the prefix.
    if len(os.path.join(base, "torch_moe_a2a_" + "x" * 8, _SOCKET_NAME)) > _SOCKET_PATH_MAX:
        base = "/tmp"
    return tempfile.mkdtemp(prefix="torch_moe_a2a_", dir=base)


def _trade_file_descriptors(
    ops: Any, coll: Collective, index: int, size: int, handles: list[Optional[int]]
) -> None:
    """Create this rank's row with a POSIX file descriptor handle, send the
    descriptor to every peer over its Unix socket (SCM_RIGHTS), receive
    theirs and import their rows into ``handles``.

    Each rank listens on a socket in a private directory (0700, the socket
    0600) that the peers learn through the group together with a random
    token; a descriptor message carries the sender's rank and the receiver's
    token, so a message from outside the group is refused. Every socket,
    directory and descriptor is gone when this returns (the imported
    handles keep the rows alive).
    """
    n = len(handles)
    directory = None
    listener = None
    own_fd = -1
    connections: dict[int, socket.socket] = {}
    received: dict[int, int] = {}
    token = secrets.token_bytes(_TOKEN_BYTES)
    try:
        address = b""
        with _collective_step("creating the row and its socket", coll):
            handles[coll.rank] = ops.vmm_create(index, size, POSIX_FD)
            (own_fd,) = ops.vmm_export(handles[coll.rank], POSIX_FD)
            directory = _socket_directory()
            path = os.path.join(directory, _SOCKET_NAME)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # keeps message boundaries
            listener.bind(path)
            os.chmod(path, 0o600)
            listener.listen(n)
            listener.settimeout(_SOCKET_TIMEOUT_S)
            address = token + path.encode()
        peers = coll.allgather(address)
        tokens = [p[:_TOKEN_BYTES] for p in peers]
        paths = [p[_TOKEN_BYTES:].decode() for p in peers]

        # Connect to everyone before anyone waits for a message: a rank that
        # cannot reach a peer (another host) makes every rank fail here.
        with _collective_step("connecting to the peers' sockets", coll):
            for peer in range(n):
                if peer == coll.rank:
                    continue
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                connections[peer] = conn
                conn.settimeout(_SOCKET_TIMEOUT_S)
                try:
                    conn.connect(paths[peer])
                except OSError as e:
                    raise RuntimeError(
                        f"cannot reach rank {peer}'s socket {paths[peer]}: {e}. POSIX file descriptors pass "
                        "between processes of one host only; ranks on several hosts need fabric handles "
                        f"({HANDLE_TYPE_ENV}={FABRIC}, with an IMEX channel)"
                    ) from e

        with _collective_step("passing the file descriptors", coll):
            for peer, conn in connections.items():
                socket.send_fds(conn, [_FD_MESSAGE.pack(coll.rank, tokens[peer])], [own_fd])
            while len(received) < n - 1:
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(_SOCKET_TIMEOUT_S)
                    message, fds, flags, _ = socket.recv_fds(conn, _FD_MESSAGE.size, 1)
                    sender = _check_fd_message(message, fds, flags, token, coll.rank, n, received)
                    received[sender] = fds[0]
            for peer, fd in received.items():
                handles[peer] = ops.vmm_import(index, [fd], POSIX_FD)
    finally:
        for conn in connections.values():
            conn.close()
        for fd in [own_fd, *received.values()]:
            if fd >= 0:
                os.close(fd)
        if listener is not None:
            listener.close()
        if directory is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, _SOCKET_NAME))
            os.rmdir(directory)


def _check_fd_message(
    message: bytes, fds: list[int], flags: int, token: bytes, rank: int, n: int, received: dict[int, int]
) -> int:
    """The sender of a well-formed descriptor message for this rank; else
    closes what arrived and raises RuntimeError."""
    problem = None
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC) or len(message) != _FD_MESSAGE.size or len(fds) != 1:
        problem = f"{len(message)} bytes, {len(fds)} descriptors, flags {flags:#x}"
    else:
        sender, their_token = _FD_MESSAGE.unpack(message)
        if their_token != token:
            problem = "a wrong token (not from a member of this group)"
        elif not 0 <= sender < n or sender == rank or sender in received:
            problem = f"sender rank {sender} (expected each peer of {n} ranks once)"
    if problem is None:
        return sender
    for fd in fds:
        os.close(fd)
    raise RuntimeError(f"rank {rank}: unexpected message on the workspace socket: {problem}")
