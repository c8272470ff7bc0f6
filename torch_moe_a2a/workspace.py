"""Workspace allocation (DESIGN.md sections 2 and 5).

The workspace is a ``[ep_size, size_per_rank]`` uint8 tensor whose row ``r`` is
rank ``r``'s memory, readable and writable by every rank:

- simulated ranks in one process: a plain zeroed tensor on one device;
- one rank per process on the CPU: one POSIX shared-memory file mapped by every
  process of a ``torch.distributed`` group;
- one rank per process on CUDA: CUDA virtual memory (not yet implemented).
"""

from __future__ import annotations

import mmap
import os
import secrets
from typing import Any, Optional, Union

import torch

from . import layout

_SHM_DIR = "/dev/shm"


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

    Without ``group``: ``ep_size`` simulated ranks in this process share a plain
    ``torch.zeros`` tensor on ``device`` (default CPU).

    With ``group`` (a ``torch.distributed`` process group; ``ep_size``
    defaults to, and must equal, its size): a collective call. On the CPU,
    every member maps the same shared-memory file, so row ``r`` is the memory
    of group rank ``r`` in every process; the members must agree on
    ``size_per_rank`` (ValueError naming the ranks otherwise). The mapping is
    owned by the returned tensor and released with its last reference; the
    file itself is unlinked before this returns, so nothing is left behind
    even if a process dies later. The rows are zero; each rank still calls
    ``moe_a2a_initialize`` on its own row (``MoeAlltoAll`` does, with the
    barrier that orders it before any peer's dispatch).
    """
    if not isinstance(size_per_rank, int) or size_per_rank <= 0 or size_per_rank % layout.ALIGN:
        raise ValueError(f"size_per_rank must be a positive multiple of {layout.ALIGN}, got {size_per_rank}")
    device = torch.device("cpu" if device is None else device)
    if group is None:
        if ep_size is None or not 1 <= ep_size <= layout.MAX_RANKS:
            raise ValueError(f"ep_size must be in [1, {layout.MAX_RANKS}] without a group, got {ep_size}")
        return torch.zeros((ep_size, size_per_rank), dtype=torch.uint8, device=device)

    import torch.distributed as dist

    group_size = dist.get_world_size(group)
    if ep_size is not None and ep_size != group_size:
        raise ValueError(f"ep_size {ep_size} differs from the group size {group_size}")
    if not 1 <= group_size <= layout.MAX_RANKS:
        raise ValueError(f"group size {group_size} out of range [1, {layout.MAX_RANKS}]")
    if device.type == "cuda":
        raise NotImplementedError("multi-process CUDA workspaces come with the CUDA VMM allocator")
    if device.type != "cpu":
        raise ValueError(f"unsupported workspace device {device}")

    # Tensor collectives, not the *_object ones: those need numpy.
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(group_size)]
    dist.all_gather(gathered, torch.tensor([size_per_rank], dtype=torch.int64), group=group)
    sizes = [int(t) for t in gathered]
    if len(set(sizes)) != 1:
        by_size: dict[int, list[int]] = {}
        for rank, size in enumerate(sizes):
            by_size.setdefault(size, []).append(rank)
        detail = "; ".join(f"ranks {ranks}: {size}" for size, ranks in by_size.items())
        raise ValueError(f"group members disagree on size_per_rank ({detail})")
    return _shared_cpu_workspace(group, group_size, size_per_rank)


def _shared_cpu_workspace(group: Any, group_size: int, size_per_rank: int) -> torch.Tensor:
    """Group rank 0 creates a /dev/shm file, everyone maps it, rank 0 unlinks it after a barrier."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    total = group_size * size_per_rank
    path = ""
    failure = None
    if rank == 0:
        # O_EXCL with a random name: never reuse (or clobber) somebody else's file.
        path = os.path.join(_SHM_DIR, f"torch_moe_a2a_{os.getpid()}_{secrets.token_hex(8)}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as e:
            failure = e
        else:
            try:
                os.ftruncate(fd, total)  # a new file reads as zeros
            except OSError as e:
                os.unlink(path)
                path = ""
                failure = e
            finally:
                os.close(fd)
    # An empty name tells the peers that rank 0 failed, so they raise instead of waiting.
    path = _broadcast_text(path, group)
    if failure is not None:
        raise failure
    if not path:
        raise RuntimeError("group rank 0 could not create the shared-memory workspace file")
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        # frombuffer keeps `mapping` alive for as long as the tensor (and its views) live.
        workspace = torch.frombuffer(mapping, dtype=torch.uint8).view(group_size, size_per_rank)
        dist.barrier(group=group)  # everyone has mapped the file
    finally:
        if rank == 0:
            os.unlink(path)
    return workspace


_MAX_NAME_BYTES = 4096


def _broadcast_text(text: str, group: Any) -> str:
    """Group rank 0's ``text`` on every member (a fixed-size uint8 tensor: no numpy needed)."""
    import torch.distributed as dist

    buffer = torch.zeros(_MAX_NAME_BYTES, dtype=torch.uint8)
    encoded = text.encode()
    if len(encoded) >= _MAX_NAME_BYTES:
        raise ValueError(f"shared-memory file name too long: {text!r}")
    buffer[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    dist.broadcast(buffer, src=dist.get_global_rank(group, 0), group=group)
    return bytes(buffer.tolist()).rstrip(b"\0").decode()
