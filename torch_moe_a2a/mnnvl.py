"""The names of ``flashinfer.comm.mnnvl`` that callers of ``MoeAlltoAll`` build:
``MnnvlConfig(comm_backend=...)`` and a ``CommBackend`` over
``torch.distributed`` (``TorchDistBackend``), so that
``from flashinfer.comm.mnnvl import MnnvlConfig`` becomes
``from torch_moe_a2a import MnnvlConfig`` without FlashInfer installed.

``MoeAlltoAll(mnnvl_config=)`` reads ``comm_backend`` only; FlashInfer's
``allocation_granularity`` and ``fabric_page_size`` size its own MNNVL
allocation and are carried here, not used (the workspace bootstrap,
:mod:`torch_moe_a2a.workspace`, picks its own granularity).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from .collective import TorchGroupCollective


class CommBackend(Protocol):
    """FlashInfer's ``CommBackend`` interface (an MPI communicator's method
    names): what ``MnnvlConfig.comm_backend`` must provide."""

    def Get_rank(self) -> int: ...

    def Get_size(self) -> int: ...

    def allgather(self, data: Any) -> Any: ...

    def bcast(self, data: Any, root: int) -> Any: ...

    def barrier(self) -> None: ...

    def Split(self, color: int, key: int) -> "CommBackend": ...


@dataclass
class MnnvlConfig:
    """FlashInfer's ``MnnvlConfig``: the communicator ``MoeAlltoAll`` maps its
    workspace over (split into this rank's EP group with ``Split``)."""

    comm_backend: Optional[CommBackend] = None
    allocation_granularity: int = 0
    fabric_page_size: int = 1 << 29


class TorchDistBackend:
    """FlashInfer's ``TorchDistBackend``: a ``CommBackend`` over a
    ``torch.distributed`` group (None: the default group).

    The Python objects travel pickled through tensor all-gathers
    (:class:`~torch_moe_a2a.collective.TorchGroupCollective`), not through
    ``all_gather_object``, which needs NumPy.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized.
    """

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "TorchDistBackend: torch.distributed is not initialized; call torch.distributed.init_process_group() first"
            )
        self._dist = dist
        self._group = group
        # A group whose only backend is NCCL moves CUDA tensors only (TorchGroupCollective picks).
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self._collective = TorchGroupCollective(group, device)

    def Get_rank(self) -> int:
        return self._collective.rank

    def Get_size(self) -> int:
        return self._collective.size

    def allgather(self, data: Any) -> tuple:
        """Every member's ``data`` (any picklable object), indexed by group rank."""
        return tuple(pickle.loads(b) for b in self._collective.allgather(pickle.dumps(data)))

    def bcast(self, data: Any, root: int) -> Any:
        """``data`` of the member whose group rank is ``root`` (as in MPI)."""
        if not 0 <= root < self.Get_size():
            raise ValueError(f"TorchDistBackend.bcast: root {root} not in [0, {self.Get_size()})")
        # Only the root's bytes matter; the others send nothing.
        payload = pickle.dumps(data) if self.Get_rank() == root else b""
        return pickle.loads(self._collective.allgather(payload)[root])

    def barrier(self) -> None:
        self._collective.barrier()

    def Split(self, color: int, key: int) -> "TorchDistBackend":
        """The members of equal ``color``, as a new backend whose ranks follow
        their global ranks (a ``torch.distributed`` group orders its members
        so, whatever order it is given), as FlashInfer's ``TorchDistBackend``
        does; ``key`` is taken for ``CommBackend``'s signature and not used
        (an MPI communicator orders by it). Collective over the whole group:
        every member calls it, and ``new_subgroups_by_enumeration`` creates
        every color's group on every member."""
        everyone = self.allgather((int(color), self._dist.get_rank()))
        colors = sorted({c for c, _ in everyone})
        groups = [sorted(r for c, r in everyone if c == col) for col in colors]
        mine, _ = self._dist.new_subgroups_by_enumeration(groups)
        return TorchDistBackend(mine)
