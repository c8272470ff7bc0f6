"""The collectives the workspace bootstrap needs, over either kind of group.

The bootstrap (:mod:`torch_moe_a2a.workspace`) is written once against
:class:`Collective`: a rank, a size, an all-gather of bytes and a barrier.
Two adapters provide it:

- :class:`TorchGroupCollective` over a ``torch.distributed`` process group
  (tensor collectives only: the ``*_object`` ones need NumPy);
- :class:`CommBackendCollective` over an object with FlashInfer's
  ``CommBackend`` interface (``Get_rank``, ``Get_size``, ``allgather``,
  ``bcast``, ``barrier``, ``Split``), which is how ``MoeAlltoAll(mnnvl_config=)``
  and its real callers (SGLang's ``TorchDistributedCommBackend``, vLLM's
  ``CustomCommunicator``, FlashInfer's ``TorchDistBackend`` / ``MPIBackend``)
  hand over their group.
"""

from __future__ import annotations

import contextlib
import struct
from typing import Any, Iterator, Optional, Protocol, Sequence

import torch

# The methods that make an object a FlashInfer CommBackend for the bootstrap.
COMM_BACKEND_METHODS = ("Get_rank", "Get_size", "allgather")


class Collective(Protocol):
    """What the workspace bootstrap asks of a group.

    ``allgather`` and ``barrier`` are collective: every member calls them in
    the same order.
    """

    rank: int
    size: int

    def allgather(self, data: bytes) -> list[bytes]:
        """Every member's ``data`` (any length), indexed by rank."""
        ...

    def barrier(self) -> None:
        """Return once every member has called it."""
        ...


@contextlib.contextmanager
def _group_call(collective: "Collective", what: str) -> Iterator[None]:
    """A call of the group's own collective ``what``, whose error (gloo's
    'Connection closed by peer' or 'Timed out waiting ... for send
    operation', whatever its type) names neither the rank nor the step: a
    member exited, or did not call within the group's timeout. Raised again
    as a RuntimeError that says so, with the group's first line."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - the group's own error, whatever its type
        text = str(e).strip()
        first = text.splitlines()[0] if text else ""
        raise RuntimeError(
            f"rank {collective.rank} of a group of {collective.size}: the group's {what} failed, so a member did not "
            "take part (it exited, or did not call within the group's timeout); every member makes the same calls "
            f"together (allocate_workspace(group=...), MoeAlltoAll, its reset): {type(e).__name__}: {first}") from e


class TorchGroupCollective:
    """:class:`Collective` over a ``torch.distributed`` group (None: the default group).

    Tensors travel on the CPU, or on ``device`` for a group whose only backend
    is NCCL (it moves CUDA tensors only).
    """

    def __init__(self, group: Any = None, device: Optional[torch.device] = None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        nccl_only = "nccl" in backend and "gloo" not in backend
        self.device = device if nccl_only and device is not None and device.type == "cuda" else torch.device("cpu")

    def _gather(self, values: torch.Tensor) -> list[torch.Tensor]:
        gathered = [torch.empty_like(values) for _ in range(self.size)]
        with _group_call(self, "all_gather"):
            self._dist.all_gather(gathered, values, group=self.group)
        return [t.cpu() for t in gathered]

    def allgather(self, data: bytes) -> list[bytes]:
        # Tensor collectives need one shape on every member: lengths first.
        lengths = [int(t) for t in self._gather(torch.tensor([len(data)], dtype=torch.int64, device=self.device))]
        # On the CPU whatever the default device (a model built under `with
        # torch.device("meta")` builds its MoeAlltoAll there too); moved below.
        buffer = torch.zeros(max(max(lengths), 1), dtype=torch.uint8, device="cpu")
        if data:
            buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return [bytes(t[:n].tolist()) for t, n in zip(self._gather(buffer.to(self.device)), lengths)]

    def barrier(self) -> None:
        with _group_call(self, "barrier"):
            self._dist.barrier(group=self.group)

    def destroyed(self) -> bool:
        """Whether ``destroy_process_group`` ended the group (a group of the
        same ranks made after it is another group: torch no longer knows this one)."""
        if not self._dist.is_initialized():
            return True
        try:
            self._dist.get_rank(self.group)
        except ValueError:  # "... is not registered": destroyed, the default group re-made since
            return True
        return False


class CommBackendCollective:
    """:class:`Collective` over a FlashInfer ``CommBackend`` (its ``allgather``
    of Python objects carries the bytes)."""

    def __init__(self, comm: Any):
        self.comm = comm
        self.rank = int(comm.Get_rank())
        self.size = int(comm.Get_size())
        if not 0 <= self.rank < self.size:
            raise ValueError(f"the CommBackend reports rank {self.rank} of size {self.size}")
        barrier = getattr(comm, "barrier", None)
        self._barrier = barrier if callable(barrier) else None

    def allgather(self, data: bytes) -> list[bytes]:
        with _group_call(self, "allgather"):
            gathered = list(self.comm.allgather(bytes(data)))
        if len(gathered) != self.size or not all(isinstance(g, (bytes, bytearray)) for g in gathered):
            raise RuntimeError(f"the CommBackend's allgather returned {len(gathered)} entries of types "
                               f"{sorted({type(g).__name__ for g in gathered})}; expected {self.size} bytes objects")
        return [bytes(g) for g in gathered]

    def barrier(self) -> None:
        """The backend's barrier; an allgather of nothing where it has none,
        or where it raises NotImplementedError (vLLM's CustomCommunicator
        of some versions): that returns on a member once every member has
        called it, which is what a barrier guarantees."""
        with _group_call(self, "barrier"):
            if self._barrier is not None:
                try:
                    self._barrier()
                    return
                except NotImplementedError:
                    self._barrier = None  # the same backend on every member: all of them fall back alike
            self.comm.allgather(b"")


def is_comm_backend(group: Any) -> bool:
    """Whether ``group`` speaks FlashInfer's CommBackend interface."""
    return all(callable(getattr(group, m, None)) for m in COMM_BACKEND_METHODS)


def as_collective(group: Any, device: Optional[torch.device] = None) -> Collective:
    """The :class:`Collective` of a ``torch.distributed`` group or a CommBackend.

    Raises:
        ValueError: ``group`` is neither; ``torch.distributed``'s
            ``GroupMember.NON_GROUP_MEMBER``, what ``new_group`` returns to a
            process outside the group.
    """
    if isinstance(group, (TorchGroupCollective, CommBackendCollective)):
        return group
    import torch.distributed as dist

    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return TorchGroupCollective(group, device)
    if dist.is_available() and type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER:
        # Else refused below as an int, which names the type, not the mistake.
        raise ValueError(f"group is torch.distributed.GroupMember.NON_GROUP_MEMBER ({group}), what new_group returns "
                         "to a process outside the group: this process is not a member; only the group's members "
                         "map a workspace over it")
    if is_comm_backend(group):
        return CommBackendCollective(group)
    raise ValueError(f"group must be a torch.distributed ProcessGroup or an object with FlashInfer's CommBackend "
                     f"methods ({', '.join(COMM_BACKEND_METHODS)}), got {type(group).__name__}")


def allgather_ints(values: Sequence[int], collective: Collective) -> list[list[int]]:
    """Every member's int64 ``values`` (the same count on every member)."""
    fmt = f"<{len(values)}q"
    return [list(struct.unpack(fmt, raw)) for raw in collective.allgather(struct.pack(fmt, *values))]
