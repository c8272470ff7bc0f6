"""``MoeAlltoAll``: FlashInfer's stateful wrapper of the functional API
(docs/DESIGN.md section 2), with its workspace cache and checkpointing."""

from __future__ import annotations

import atexit
import numbers
import threading
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence, Union

import torch
import torch.utils.checkpoint

from . import layout
from .api import (
    SfLayout,
    moe_a2a_combine,
    moe_a2a_dispatch,
    moe_a2a_get_recv_counts,
    moe_a2a_get_workspace_size_per_rank,
    moe_a2a_initialize,
    moe_a2a_sanitize_expert_ids,
    moe_a2a_wrap_payload_tensor_in_workspace,
)
from .arguments import COMBINE_DTYPES, check_flag, eplb_length, layout_value
from .backend import MoeAlltoAllBackend, check_backend
from .collective import Collective, TorchGroupCollective, allgather_ints, as_collective, is_comm_backend
from .compile_marks import mark_static_address
from .errors import raise_first_record, row_error
from .expert_major import (
    ExpertMajorDispatch,
    moe_a2a_combine_expert_major,
    moe_a2a_dispatch_expert_major,
    moe_a2a_get_workspace_size_per_rank_expert_major,
)
from .fastpath import tracing, wants_grad
from .mapping import ep_group_color
from .metainfo import check_timeout, reinitialize_row
from .workspace import (
    allocate_workspace,
    failed_members,
    gather_failures,
    release_workspace_memory,
    restore_workspace_memory,
)

# torch.utils.checkpoint's early stop of a non-reentrant recomputation
# (a private class; nothing to catch where a torch lacks it).
_STOP_RECOMPUTATION = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())


@dataclass
class _A2AState:
    phase: str = "idle"  # idle | dispatched | combined (a combine may repeat until the next dispatch)
    local_num_tokens: Optional[int] = None
    combine_payload_offset: Optional[int] = None
    eplb_gathered_stats: Optional[torch.Tensor] = None
    expert_major: Optional[ExpertMajorDispatch] = None  # an expert-major dispatch's result
    round: Optional[int] = 0  # _SharedWorkspace.rounds after this state's dispatch (None: a traced one)
    runtime_max_tokens_per_rank: Optional[int] = None  # the dispatch's
    resets: int = 0  # _SharedWorkspace.resets when this state began


@dataclass(eq=False)
class _SharedWorkspace:
    """One workspace and this rank's metainfo, shared by every instance built
    with the same geometry in this process (FlashInfer's workspace cache)."""

    workspace: torch.Tensor
    metainfo: torch.Tensor
    # The group the memory was mapped over (None: a local tensor), for checkpointing.
    collective: Optional[Collective]
    mapped: bool = True
    # The instance between its dispatch and its combine, if any: instances
    # sharing a workspace take turns, one round trip at a time.
    active: Optional[weakref.ref] = None
    # Dispatches made through the instances sharing it: a repeated combine
    # is the last dispatch's only while no other instance dispatched since.
    rounds: int = 0
    # Re-initializations of the row (reset, checkpoint_restore) through any of
    # the instances: each one ends every instance's open round.
    resets: int = 0
    # The row the instances use and what it was initialized for: _geometry's.
    geometry: tuple = ()
    # The ranks whose rows check() reads: None, every row; after a reset over
    # a group of survivors, theirs (a dead rank's row keeps whatever record
    # it had when it died).
    checked_ranks: Optional[tuple[int, ...]] = None
    # Initializations of the own row that the group's other rows went through
    # and this one did not (its part of a reset refused where others' were
    # not): the next reset makes them up, since each rank's first dispatch
    # after an initialize waits for peers initialized as many times as it.
    initializations_behind: int = 0

    def active_instance(self) -> Optional["MoeAlltoAll"]:
        return None if self.active is None else self.active()

    def __post_init__(self) -> None:
        _LIVE_SHARED_WORKSPACES.add(self)


# Held while MoeAlltoAll.get_workspace looks up and fills the workspace cache.
_WORKSPACE_CACHE_LOCK = threading.Lock()

# Every shared workspace alive, for the exit hook below and _row_in_use.
_LIVE_SHARED_WORKSPACES: "weakref.WeakSet[_SharedWorkspace]" = weakref.WeakSet()


# What a row was initialized for, in _SharedWorkspace.geometry's order.
_GEOMETRY = ("ep_rank", "ep_size", "size_per_rank", "row_stride", "max_num_tokens", "eplb_stats_num_experts", "backend")


def _geometry(workspace: torch.Tensor, ep_rank: int, ep_size: int, max_num_tokens: int, eplb_n: int,
              backend: str) -> tuple:
    return (ep_rank, ep_size, workspace.shape[1], workspace.stride(0), max_num_tokens, eplb_n, backend)


def _row_in_use(workspace: torch.Tensor, ep_rank: int) -> Optional[_SharedWorkspace]:
    """The shared state of the live instances of this process on ``ep_rank``'s
    row of ``workspace``'s memory, through whatever view of it, if any
    (initializing the row again would end their rounds under them: their
    peers' next calls would time out). A meta workspace has no memory."""
    base = workspace.data_ptr()
    if base == 0:
        return None
    row = base + ep_rank * workspace.stride(0)
    for shared in list(_LIVE_SHARED_WORKSPACES):
        w = shared.workspace
        if shared.geometry and w.device == workspace.device and w.data_ptr() + shared.geometry[0] * w.stride(0) == row:
            return shared
    return None


@atexit.register
def _drop_groups_at_exit() -> None:
    """Let go of the groups the shared workspaces were mapped over.

    The cache and the instances would otherwise hold them until interpreter
    finalization, and a gloo group destroyed then, after
    ``destroy_process_group``, may abort the process ("terminate called
    without an active exception"). Dropped here, while Python still runs
    normally, the group goes at once.
    """
    for shared in list(_LIVE_SHARED_WORKSPACES):
        shared.collective = None


class _WorkspaceEntry(dict):
    """An entry of the workspace cache, as FlashInfer's (a dict); its one key
    without a counterpart here says so."""

    def __missing__(self, key: Any) -> Any:
        if key == "mnnvl_mem":
            raise KeyError("mnnvl_mem is FlashInfer's MnnvlMemory object; torch-moe-a2a maps the workspace itself "
                           "(MoeAlltoAll.checkpoint_prepare / checkpoint_restore release and map it again)")
        raise KeyError(key)


def _resolve_device(device: Union[torch.device, str, None]) -> torch.device:
    """The workspace's device: the current CUDA device if there is one, else the CPU; a bare 'cuda' the current one."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"MoeAlltoAll: device must be a torch.device or a device string such as 'cuda:0' or "
                         f"'cpu', got {device!r}") from None
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_int(name: str, value: Any, low: int, high: Optional[int] = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"MoeAlltoAll: {name} must be an int {bound}, got {value!r}")
    return value


def _check_size_per_rank(fn: str, value: Any, header: bool = True) -> None:
    """ValueError naming ``workspace_size_per_rank`` unless it is a size the
    ops take (``header``: at least the header too): the op's own refusal names
    ``workspace.shape[1]``, allocate_workspace's ``size_per_rank``, and a str
    failed on a comparison."""
    low = layout.HEADER_BYTES if header else layout.ALIGN
    if not isinstance(value, int) or isinstance(value, bool) or value < low or value % layout.ALIGN:
        at_least = f" and at least {layout.HEADER_BYTES} (the workspace header)" if header else ""
        raise ValueError(f"{fn}: workspace_size_per_rank must be an int multiple of {layout.ALIGN}{at_least}, got "
                         f"{value!r}; MoeAlltoAll.get_moe_workspace_size_per_rank gives the size for a hidden size, "
                         "or pass hidden_size= without workspace_size_per_rank")


def _mapping_ep(fn: str, mapping: Any) -> tuple[int, int]:
    """``(moe_ep_rank, moe_ep_size)`` of ``mapping``, each an int (a float
    would be truncated, a bool read as 0 or 1).

    Raises:
        ValueError: ``mapping`` without the two, or one of them not an int.
    """
    if not (hasattr(mapping, "moe_ep_rank") and hasattr(mapping, "moe_ep_size")):
        raise ValueError(f"{fn}: mapping must be a Mapping (an object with moe_ep_rank and moe_ep_size), "
                         f"got {type(mapping).__name__}")
    values = []
    for name in ("moe_ep_rank", "moe_ep_size"):
        value = getattr(mapping, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{fn}: mapping.{name} must be an int, got {value!r}")
        values.append(int(value))
    return values[0], values[1]


def _check_payload_layouts(layouts: Optional[Sequence[Any]], num_payloads: int) -> None:
    """FlashInfer's ``output_payload_layouts``: None, or ``LINEAR`` for every payload
    (an enum member named so, or the name), the receive views' only layout here."""
    if layouts is None:
        return
    if len(layouts) != num_payloads:
        raise ValueError(f"MoeAlltoAll.dispatch: output_payload_layouts has {len(layouts)} entries for "
                         f"{num_payloads} payloads")
    for i, entry in enumerate(layouts):
        name = getattr(entry, "name", entry)
        if name != "LINEAR":
            raise NotImplementedError(f"MoeAlltoAll.dispatch: output_payload_layouts[{i}] is {name!r}: only LINEAR "
                                      "(the [ep_size, runtime_max_tokens_per_rank, *] receive views) is supported; "
                                      "pass None and lay the received scales out after the dispatch")


class MoeAlltoAll:
    """Stateful wrapper of the functional API, FlashInfer's ``MoeAlltoAll``.

    Remembers what dispatch returned for the matching combine and enforces
    the order dispatch -> combine (repeatable before the next dispatch, on
    every rank alike; FlashInfer's class allows one, its functional
    ``moe_a2a_combine`` more) -> dispatch with a clear RuntimeError.

    Args:
        mapping: where this rank sits: :class:`~torch_moe_a2a.Mapping`,
            FlashInfer's ``Mapping``, or any object with ``moe_ep_rank`` and
            ``moe_ep_size``.
        max_num_tokens: the most tokens one rank dispatches in a call.
        top_k: experts per token, 1..22.
        num_experts: experts in all, ``>= ep_size``.
        workspace_size_per_rank: bytes per rank; default from ``hidden_size``
            (:meth:`get_moe_workspace_size_per_rank`).
        hidden_size: sizes the workspace when ``workspace_size_per_rank`` is not given (and see ``dtype``).
        mnnvl_config: FlashInfer's ``MnnvlConfig`` (any object with a
            ``comm_backend`` speaking FlashInfer's ``CommBackend`` interface):
            as in FlashInfer, ``comm_backend.Split(color, moe_ep_rank)`` gives
            this rank's EP group, over which the workspace is mapped.
        eplb_stats_num_experts: length of the EPLB stats :meth:`dispatch`
            gathers (0 or None: none).
        enable_rank_mask: whether :meth:`dispatch` / :meth:`combine` take an
            ``active_rank_mask`` (then they must).
        backend: ``"trtllm"`` (``"cake"`` is refused, as off Blackwell in FlashInfer).
        workspace: a pre-allocated ``[ep_size, size_per_rank]`` uint8
            workspace shared with other instances of this process (simulated
            ranks). This instance initializes its own row only; a rank's first
            dispatch waits until every peer's row is initialized, so on a zeroed
            workspace the instances may be constructed in any order (on CUDA,
            with every rank's phase launched before anything waits: README).
            Where a live instance of this process already uses this rank's row
            of that memory, the new one shares it, as instances built from the
            workspace cache do, and initializes nothing (:meth:`reset` does).
        group: a ``torch.distributed`` group or a ``CommBackend`` to map the
            workspace over (default: the default group when
            ``torch.distributed`` is initialized and ``ep_size > 1``).
        device: where an allocated workspace lives (default: the current
            CUDA device if there is one, else the CPU).
        timeout_s: the bound on every wait of a dispatch or combine for a peer (default:
            ``MOE_A2A_TIMEOUT_S``, else 30 s).
        dtype: the hidden states' dtype, for sizing from ``hidden_size``
            (default 16-bit, as FlashInfer sizes). With ``hidden_size``,
            ``dtype`` and ``workspace_size_per_rank`` all given, a size too
            small for ``hidden_size`` hidden states of ``dtype`` (plus int32
            ids and fp32 weights) is refused here rather than at the first
            call; without ``dtype``, as in FlashInfer, ``hidden_size`` is not
            read when ``workspace_size_per_rank`` is given (a size made for
            quantized hidden states is taken).
        expert_major: ours: :meth:`dispatch` receives grouped by local
            expert and returns an :class:`~torch_moe_a2a.ExpertMajorDispatch`,
            :meth:`combine` weights and sums from that layout
            (:func:`~torch_moe_a2a.moe_a2a_dispatch_expert_major`); sizing
            from ``hidden_size`` uses
            :meth:`get_moe_workspace_size_per_rank_expert_major`.
        max_tokens_per_expert: ours, with ``expert_major``: rows per local
            expert (default the worst case with distinct experts per token,
            ``ep_size * runtime_max_tokens_per_rank``; sizing: ``ep_size *
            max_num_tokens``; each times ``top_k`` with fewer experts than
            ``top_k``).

    Workspace ownership. Without ``workspace=``, instances of one geometry
    (``workspace_size_per_rank``, ``ep_rank``, ``ep_size``,
    ``max_num_tokens``, ``eplb_stats_num_experts``, ``backend``, device, and
    the members of a ``torch.distributed`` group) share one workspace and
    one metainfo, as FlashInfer's do: the first allocates
    it (collectively over the group: every rank constructs its instances in
    the same order), the process-wide cache owns it, and the rest reuse it;
    instances sharing it take turns (a dispatch while another instance is
    between its dispatch and combine raises). The memory lives until
    :meth:`clear_workspace_cache` has dropped the cache's reference and the
    last instance and view are gone. Allocation with a group maps every
    member's row into every member (:func:`~torch_moe_a2a.allocate_workspace`),
    initializes the rows and synchronizes the group (the initialization
    finished on the device, then a barrier), so no peer writes into a row
    before its owner zeroed it. Without a group (``ep_size == 1``) it is a
    plain zeroed tensor.

    Copies: ``copy.copy`` and ``copy.deepcopy`` of an instance (or of a
    model that holds one) give a new instance on the same workspace, as one
    built with the same geometry would share it, with no round open; a
    private copy of the workspace would be memory no peer writes into, and
    its calls would wait for peers that never come. Pickling
    (``torch.save`` of a model that holds one included) raises TypeError:
    the workspace is memory mapped into this process and its peers.

    The workspace is marked static (as ``torch._dynamo.mark_static_address`` does) so
    CUDA-graph trees (``mode="reduce-overhead"``) accept the in-place
    mutations of the ops (docs/DESIGN.md section 4).

    Raises:
        ValueError: arguments out of range or of the wrong type (``mapping``
            without int ``moe_ep_rank`` and ``moe_ep_size``, ``hidden_size``
            not a positive int, ``workspace_size_per_rank`` not an int
            multiple of ``layout.ALIGN`` of at least ``layout.HEADER_BYTES``,
            ``dtype`` not a ``torch.dtype``, ``workspace`` not a tensor),
            ``mapping`` inconsistent with the group,
            ``workspace=`` together with a group, a workspace too small, a
            ``workspace=`` row that a live instance of this process uses with
            another geometry (rank, size, row size and stride,
            ``max_num_tokens``, EPLB length, backend), through any view.
        RuntimeError: a ``workspace=`` row whose instance's
            :meth:`checkpoint_prepare` released it.
        NotImplementedError: ``backend="cake"`` on a Blackwell device.
    """

    # (workspace_size_per_rank, ep_rank, ep_size, max_num_tokens,
    # eplb_stats_num_experts, backend, device, group members) -> get_workspace's entry.
    _WORKSPACE_CACHE: ClassVar[dict[tuple, "_WorkspaceEntry"]] = {}

    def __init__(
        self,
        mapping: Any,
        max_num_tokens: int,
        top_k: int,
        num_experts: int,
        workspace_size_per_rank: Optional[int] = None,
        hidden_size: Optional[int] = None,
        mnnvl_config: Any = None,
        eplb_stats_num_experts: Optional[int] = 0,
        enable_rank_mask: bool = False,
        *,
        backend: MoeAlltoAllBackend = "trtllm",
        workspace: Optional[torch.Tensor] = None,
        group: Any = None,
        device: Union[torch.device, str, None] = None,
        timeout_s: Optional[float] = None,
        dtype: Optional[torch.dtype] = None,
        expert_major: bool = False,
        max_tokens_per_expert: Optional[int] = None,
    ):
        self.ep_rank, self.ep_size = _mapping_ep("MoeAlltoAll", mapping)
        # The limits of every later call, checked before anything is allocated or initialized.
        _check_int("ep_size", self.ep_size, 1, layout.MAX_RANKS)
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"MoeAlltoAll: moe_ep_rank {self.ep_rank} out of range [0, {self.ep_size})")
        _check_int("max_num_tokens", max_num_tokens, 1, layout.MAX_NUM_TOKENS)
        _check_int("top_k", top_k, 1, layout.MAX_TOP_K)
        # DESIGN section 3's bound: an expert per rank at least (fewer experts than top_k are allowed).
        _check_int("num_experts", num_experts, max(1, self.ep_size))
        eplb_stats_num_experts = eplb_length(eplb_stats_num_experts)
        _check_int("eplb_stats_num_experts", eplb_stats_num_experts, 0)
        if hidden_size is not None:
            _check_int("hidden_size", hidden_size, 1)
        # With hidden_size and dtype both given, a size below what they need is refused below, naming them.
        checks_hidden = hidden_size is not None and dtype is not None
        if workspace_size_per_rank is not None:
            _check_size_per_rank("MoeAlltoAll", workspace_size_per_rank, header=not checks_hidden)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(f"MoeAlltoAll: dtype must be a torch.dtype or None, got {dtype!r}")
        if workspace is not None and not isinstance(workspace, torch.Tensor):
            raise ValueError(f"MoeAlltoAll: workspace must be a tensor or None, got {type(workspace).__name__}")
        check_timeout(timeout_s, "MoeAlltoAll")
        check_flag("MoeAlltoAll: expert_major", expert_major)
        check_flag("MoeAlltoAll: enable_rank_mask", enable_rank_mask)
        if mnnvl_config is not None and group is not None:
            raise ValueError("MoeAlltoAll: pass mnnvl_config= or group=, not both")
        if workspace is not None and (group is not None or mnnvl_config is not None):
            raise ValueError("MoeAlltoAll: workspace= is a workspace of simulated ranks in this process; "
                             "it takes no group or mnnvl_config")

        if mnnvl_config is not None:
            comm = getattr(mnnvl_config, "comm_backend", None)
            if not is_comm_backend(comm) or not callable(getattr(comm, "Split", None)):
                raise ValueError("MoeAlltoAll: mnnvl_config.comm_backend must speak FlashInfer's CommBackend "
                                 f"interface (Get_rank, Get_size, allgather and Split; barrier where it has one), "
                                 f"got {type(comm).__name__} (FlashInfer's MPI default is not used here)")
            group = comm.Split(*ep_group_color(mapping))

        if workspace is not None:
            if workspace.dim() != 2 or workspace.shape[0] != self.ep_size:
                raise ValueError(
                    f"workspace must be [ep_size={self.ep_size}, size_per_rank], got {tuple(workspace.shape)}"
                )
            if workspace_size_per_rank is not None and workspace_size_per_rank != workspace.shape[1]:
                raise ValueError(
                    f"workspace_size_per_rank {workspace_size_per_rank} differs from the workspace's "
                    f"{workspace.shape[1]} bytes per rank"
                )
            workspace_size_per_rank = workspace.shape[1]
            device = workspace.device
        device = _resolve_device(device)
        check_backend(backend, device)

        if workspace_size_per_rank is None and hidden_size is None:
            raise ValueError("hidden_size must be provided if workspace_size_per_rank is not provided")
        if max_tokens_per_expert is not None and not expert_major:
            raise ValueError("MoeAlltoAll: max_tokens_per_expert is an option of expert_major=True")
        if (workspace_size_per_rank is None or checks_hidden) and expert_major:
            needed = self.get_moe_workspace_size_per_rank_expert_major(
                self.ep_size, top_k, max_num_tokens, hidden_size, num_experts, max_tokens_per_expert,
                eplb_stats_num_experts=eplb_stats_num_experts, backend=backend, dtype=dtype)
        elif workspace_size_per_rank is None or checks_hidden:
            needed = self.get_moe_workspace_size_per_rank(
                self.ep_size, top_k, max_num_tokens, hidden_size, 0, eplb_stats_num_experts, backend=backend,
                dtype=dtype)
        if workspace_size_per_rank is None:
            workspace_size_per_rank = needed
        elif checks_hidden and workspace_size_per_rank < needed:
            # Without dtype, as in FlashInfer, a given size is taken whatever
            # hidden_size says: it may be sized for quantized hidden states.
            raise ValueError(f"MoeAlltoAll: workspace_size_per_rank {workspace_size_per_rank} is too small for "
                             f"hidden_size {hidden_size} of {dtype.itemsize}-byte elements with top_k {top_k} and "
                             f"max_num_tokens {max_num_tokens}: {needed} bytes per rank needed")
        self.workspace_size_per_rank = workspace_size_per_rank
        self.max_num_tokens = max_num_tokens
        self.top_k = top_k
        self.num_experts = num_experts
        self.eplb_stats_num_experts = eplb_stats_num_experts
        self.enable_eplb = eplb_stats_num_experts > 0
        self.enable_rank_mask = enable_rank_mask
        self.expert_major = bool(expert_major)
        self.max_tokens_per_expert = max_tokens_per_expert
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self._backend = backend

        if workspace is None:
            self._shared = self.get_workspace(workspace_size_per_rank, self.ep_rank, self.ep_size, max_num_tokens,
                                              mapping, eplb_stats_num_experts, backend=backend, group=group,
                                              device=device)["shared"]
        else:
            self._shared = self._shared_row(workspace, max_num_tokens, eplb_stats_num_experts, backend)
        mark_static_address(self.workspace)
        self._recv_counts = moe_a2a_get_recv_counts(self.workspace, self.metainfo, self.ep_rank)
        self._recv_view_cache: dict = {"_workspace": self.workspace}
        self._forget_round()

    def __copy__(self) -> "MoeAlltoAll":
        """A new instance on this one's workspace, as the class docstring says.

        Returns:
            An instance of this geometry and options sharing the workspace and
            the metainfo, with no round open (its first call is a dispatch).
        """
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        # Per-instance state: the open round and the receive views of its dispatches.
        copied._recv_view_cache = {"_workspace": self.workspace}
        copied._forget_round()
        return copied

    def __deepcopy__(self, memo: dict) -> "MoeAlltoAll":
        """As :meth:`__copy__`: the workspace is the ranks' meeting place, not data to duplicate."""
        return self.__copy__()

    def __reduce_ex__(self, protocol: int) -> Any:
        """Pickling is refused.

        Raises:
            TypeError: always; the workspace is memory of this process and its peers.
        """
        raise TypeError("MoeAlltoAll cannot be pickled: its workspace is memory mapped into this process (and its "
                        "peers); build an instance in the process that needs one, and leave it out of what "
                        "torch.save stores (a state_dict, not the module)")

    def _shared_row(self, workspace: torch.Tensor, max_num_tokens: int, eplb_n: int,
                    backend: MoeAlltoAllBackend) -> _SharedWorkspace:
        """The shared state of this rank's row of ``workspace=``: a live
        instance's, where one of this process uses it, else a new one over the
        row, initialized here."""
        geometry = _geometry(workspace, self.ep_rank, self.ep_size, max_num_tokens, eplb_n, backend)
        in_use = _row_in_use(workspace, self.ep_rank)
        if in_use is None:
            metainfo = moe_a2a_initialize(workspace, self.ep_rank, self.ep_size, max_num_tokens, eplb_n,
                                          backend=backend)
            return _SharedWorkspace(workspace, metainfo, None, geometry=geometry)
        if in_use.geometry != geometry:
            raise ValueError(
                f"MoeAlltoAll: rank {self.ep_rank}'s row of this workspace is in use by another instance of "
                f"this process, initialized for {dict(zip(_GEOMETRY, in_use.geometry))}, not "
                f"{dict(zip(_GEOMETRY, geometry))}; reinitializing it would end that instance's rounds under it")
        if not in_use.mapped:
            raise RuntimeError(f"MoeAlltoAll: rank {self.ep_rank}'s row of this workspace belongs to an instance "
                               "whose checkpoint_prepare() released its memory; call checkpoint_restore first")
        return in_use

    @classmethod
    def get_workspace(
        cls,
        workspace_size_per_rank: int,
        ep_rank: int,
        ep_size: int,
        max_num_tokens: int,
        mapping: Any,
        eplb_stats_num_experts: Optional[int] = 0,
        *,
        backend: MoeAlltoAllBackend = "trtllm",
        group: Any = None,
        device: Union[torch.device, str, None] = None,
    ) -> dict:
        """FlashInfer's workspace cache: the workspace of this geometry, allocated
        and initialized by the first call (collectively over ``group``: every
        rank calls it in the same order), the same one after, also for
        threads of this process that call it at once.

        Args:
            workspace_size_per_rank, ep_rank, ep_size, max_num_tokens,
                eplb_stats_num_experts, backend: the geometry, as for the constructor.
            mapping: this rank's place (any object with ``moe_ep_rank`` and
                ``moe_ep_size``), which must be ``ep_rank`` of ``ep_size``.
            group: ours, keyword-only: a ``torch.distributed`` group or a
                FlashInfer ``CommBackend`` to map the workspace over (default:
                the default group when ``torch.distributed`` is initialized and
                ``ep_size > 1``). A group's members are part of the geometry;
                a CommBackend's are not known here, as in FlashInfer.
            device: ours, keyword-only: where the workspace lives (default: the
                current CUDA device if there is one, else the CPU).

        Returns:
            FlashInfer's dict: ``workspace``, ``metainfo`` (this rank's),
            ``workspace_size_per_rank``, ``max_num_tokens``, ``ep_rank``,
            ``ep_size``, ``eplb_stats_num_experts``; ``shared`` (ours) is what
            the instances hold. FlashInfer's ``mnnvl_mem`` (its memory object)
            has no counterpart: reading it raises a KeyError that says so.

        Raises:
            ValueError: ``mapping`` without int ``moe_ep_rank`` and ``moe_ep_size``, or ``mapping`` or the group
                of another rank or size; ``workspace_size_per_rank`` not an int multiple of ``layout.ALIGN`` of at
                least ``layout.HEADER_BYTES``; ``ep_size > 1`` without a group.
        """
        if _mapping_ep("MoeAlltoAll.get_workspace", mapping) != (ep_rank, ep_size):
            raise ValueError(f"MoeAlltoAll.get_workspace: the mapping's (moe_ep_rank, moe_ep_size) = "
                             f"({mapping.moe_ep_rank}, {mapping.moe_ep_size}) differ from ({ep_rank}, {ep_size})")
        _check_size_per_rank("MoeAlltoAll.get_workspace", workspace_size_per_rank)
        # None and 0 are one geometry (one cache entry): no EPLB.
        eplb_stats_num_experts = eplb_length(eplb_stats_num_experts)
        device = _resolve_device(device)
        if group is None and ep_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            group = torch.distributed.group.WORLD
        # The group is checked before the cache is: a cached workspace of this
        # geometry would have hidden a group that is none, or of another rank.
        coll = None
        if group is not None:
            coll = as_collective(group, device)
            if (coll.rank, coll.size) != (ep_rank, ep_size):
                raise ValueError(f"MoeAlltoAll: the mapping's (moe_ep_rank, moe_ep_size) = ({ep_rank}, "
                                 f"{ep_size}) differ from the group's (rank, size) = ({coll.rank}, {coll.size})")
        key = (workspace_size_per_rank, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts, backend, device,
               _group_members(coll))
        # Threads that build instances of one geometry at once (layers built by
        # a thread pool) must find one workspace: the lookup and the allocation
        # are one step, else each thread that missed the cache allocated its own.
        with _WORKSPACE_CACHE_LOCK:
            entry = cls._WORKSPACE_CACHE.get(key)
            if entry is not None and _group_destroyed(entry["shared"].collective):
                # The group the workspace was mapped over is gone (destroy_process_group, then a new group of the
                # same ranks: an elastic restart, whose new members allocate anew): this rank allocates with them.
                del cls._WORKSPACE_CACHE[key]
                entry = None
            if entry is not None:
                return entry
            if coll is None and ep_size > 1:
                raise ValueError(
                    f"ep_size {ep_size} > 1 needs a shared workspace: pass workspace= (simulated "
                    "ranks in this process), group= or mnnvl_config= (one rank per process)"
                )
            workspace = allocate_workspace(workspace_size_per_rank, group=coll, ep_size=ep_size, device=device)
            metainfo = moe_a2a_initialize(workspace, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts,
                                          backend=backend)
            if coll is not None:
                _synchronize(workspace)
                coll.barrier()
            entry = cls._WORKSPACE_CACHE[key] = _WorkspaceEntry(
                workspace_size_per_rank=workspace_size_per_rank, max_num_tokens=max_num_tokens, ep_rank=ep_rank,
                ep_size=ep_size, eplb_stats_num_experts=eplb_stats_num_experts, workspace=workspace,
                metainfo=metainfo, shared=_SharedWorkspace(workspace, metainfo, coll, geometry=_geometry(
                    workspace, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts, backend)))
            return entry

    @classmethod
    def clear_workspace_cache(cls) -> None:
        """Drop the process-wide cache's references to the shared workspaces.

        Instances built before keep theirs; the memory goes when the last of
        them and of the views is gone. Instances built after allocate anew
        (collectively: call this on every rank at the same point).
        """
        cls._WORKSPACE_CACHE.clear()

    @property
    def workspace(self) -> torch.Tensor:
        """The ``[ep_size, size_per_rank]`` uint8 workspace (shared; see the class docstring)."""
        return self._shared.workspace

    @property
    def metainfo(self) -> torch.Tensor:
        """This rank's metainfo (:func:`~torch_moe_a2a.moe_a2a_initialize`), shared with the workspace."""
        return self._shared.metainfo

    @staticmethod
    def get_moe_workspace_size_per_rank(
        ep_size: int,
        top_k: int,
        max_num_tokens: int,
        hidden_size: int,
        extra_payload_bytes_per_token: int = 0,
        eplb_stats_num_experts: Optional[int] = 0,
        *,
        backend: MoeAlltoAllBackend = "trtllm",
        dtype: Optional[torch.dtype] = None,
    ) -> int:
        """FlashInfer's sizing: hidden states plus int32 expert ids and fp32 router
        weights per token (and ``extra_payload_bytes_per_token``) for dispatch,
        hidden states for combine; hidden states of ``dtype`` (ours; default
        16-bit, FlashInfer's assumption).

        Args:
            ep_size, top_k, max_num_tokens: as for the instance.
            hidden_size: elements of a hidden state.
            extra_payload_bytes_per_token: bytes of further dispatch payloads a token.
            eplb_stats_num_experts: as for the instance (None: 0).
            backend: ``"trtllm"`` (or ``"cake"`` on Blackwell, refused).
            dtype: the hidden states' dtype (None: 16-bit).

        Returns:
            The bytes per rank (:func:`~torch_moe_a2a.moe_a2a_get_workspace_size_per_rank`).

        Raises:
            ValueError: as :func:`~torch_moe_a2a.moe_a2a_get_workspace_size_per_rank`.
        """
        hidden_bytes = hidden_size * (2 if dtype is None else dtype.itemsize)
        dispatch_bytes = hidden_bytes + top_k * 4 + top_k * 4 + extra_payload_bytes_per_token
        return moe_a2a_get_workspace_size_per_rank(
            ep_size, max_num_tokens, dispatch_bytes, hidden_bytes, eplb_stats_num_experts, backend=backend
        )

    @staticmethod
    def get_moe_workspace_size_per_rank_expert_major(
        ep_size: int,
        top_k: int,
        max_num_tokens: int,
        hidden_size: int,
        num_experts: int,
        max_tokens_per_expert: Optional[int] = None,
        extra_payload_bytes_per_token: int = 0,
        eplb_stats_num_experts: int = 0,
        *,
        backend: MoeAlltoAllBackend = "trtllm",
        dtype: Optional[torch.dtype] = None,
    ) -> int:
        """Sizing for ``expert_major=True`` instances: hidden states of ``dtype``
        (default 16-bit) and ``extra_payload_bytes_per_token`` dispatched, hidden
        states combined, ``max_tokens_per_expert`` rows per expert (default
        ``ep_size * max_num_tokens``, times ``top_k`` with fewer experts than
        ``top_k``); the expert ids and router weights that
        travel too are counted
        (:func:`~torch_moe_a2a.moe_a2a_get_workspace_size_per_rank_expert_major`)."""
        hidden_bytes = hidden_size * (2 if dtype is None else dtype.itemsize)
        return moe_a2a_get_workspace_size_per_rank_expert_major(
            ep_size, max_num_tokens, hidden_bytes + extra_payload_bytes_per_token, hidden_bytes, num_experts, top_k,
            max_tokens_per_expert, eplb_stats_num_experts, backend=backend)

    @property
    def eplb_gathered_stats(self) -> Optional[torch.Tensor]:
        """int32 ``[ep_size, eplb_stats_num_experts]`` view from the last dispatch (None when it
        gathered none); None from the round's first :meth:`combine` on (FlashInfer's)."""
        return self._state.eplb_gathered_stats

    @property
    def recv_counts(self) -> torch.Tensor:
        """int32 ``[ep_size]`` workspace view: rows received from each rank by the last dispatch."""
        if tracing():
            # A view made outside the graph would be a second graph input aliasing
            # the mutated workspace with another dtype, which AOTAutograd refuses
            # (and a constant to make_fx).
            return moe_a2a_get_recv_counts(self.workspace, self.metainfo, self.ep_rank)
        return self._recv_counts

    def check(self) -> None:
        """Raise RuntimeError if any rank of the workspace recorded an error
        (:func:`check_errors`); after :meth:`reset` over a group of survivors,
        any of the survivors (the ranks masked off keep their rows as they
        were).

        Returns:
            None, where no rank's row holds an error record (it reads the
            rows' headers: a device-to-host copy on CUDA).

        Raises:
            RuntimeError: the first record found, described as the ops
                raise it; the workspace's memory released by
                :meth:`checkpoint_prepare`.
        """
        self._check_mapped("check")
        raise_first_record(self.workspace, "MoeAlltoAll.check", self._shared.checked_ranks)

    def _check_mapped(self, what: str) -> None:
        """Raises if the workspace is released; forgets a round that a re-initialization ended."""
        if not self._shared.mapped:
            raise RuntimeError(f"MoeAlltoAll.{what}: the workspace's memory was released by checkpoint_prepare(); "
                               "call checkpoint_restore(comm_backend) first")
        if self._state.resets != self._shared.resets:  # through another instance sharing the workspace
            self._forget_round()

    def _forget_round(self) -> None:
        """No round open on this instance (its next call is a dispatch), as of
        the row's current initialization."""
        self._state = _A2AState(resets=self._shared.resets)

    def _raise_out_of_order(self, fn: str, message: str) -> None:
        """Refuse ``fn``, called out of the order dispatch -> combine: with
        ``message`` where nothing failed (a refused call changed nothing),
        but with the own row's error record where a call failed (a peer that
        did not arrive, rows that differ): the workspace then stays failed,
        and neither the dispatch nor the combine that ``message`` asks for
        works before a re-initialization of every rank (:meth:`reset`).

        Raises:
            RuntimeError: always.
        """
        record = row_error(self.workspace, self.ep_rank)
        if record is not None:
            raise RuntimeError(f"{fn}: an earlier call on this workspace failed, and its record stands: {record}")
        raise RuntimeError(message)

    def _check_abandoned_round(self, fn: str) -> None:
        """Refuse ``fn`` where the instance that opened the workspace's round
        was deleted before its combine: no instance can close that round (the
        op would ask for the combine, this class for a dispatch first).

        Raises:
            RuntimeError: such a round is open; it names :meth:`reset`.
        """
        if self._shared.active is not None and self._shared.active() is None:
            raise RuntimeError(f"{fn}: the MoeAlltoAll that made the last dispatch on this workspace was deleted (or "
                               "garbage collected) before its combine, and no other instance can close its round; "
                               "call reset() on every rank, once no rank is inside a call, to start over")

    def _round_open(self) -> bool:
        """Whether this instance's last dispatch awaits its first combine (a
        re-initialization through any instance sharing the row ended it)."""
        self._check_mapped("dispatch")
        return self._state.phase == "dispatched"

    def _refuse_ranks_outside_the_reset(self, fn: str, active_rank_mask: Optional[torch.Tensor]) -> None:
        """After a reset over a group of survivors, a call whose mask holds a
        rank outside that group would wait for it until the timeout (its row
        was not initialized with theirs), with an error about initializations:
        refused before it runs. Eager calls only (a trace reads the mask once)."""
        survivors = self._shared.checked_ranks
        if survivors is None or torch.compiler.is_compiling() or not (
                isinstance(active_rank_mask, torch.Tensor) and active_rank_mask.dtype == torch.uint64
                and tuple(active_rank_mask.shape) == (layout.MOE_A2A_RANK_MASK_WORDS,)):
            return  # no mask, or one the call's own checks refuse
        words = active_rank_mask.tolist()  # uint64: unsigned Python ints
        outside = [r for r in range(self.ep_size) if (words[r // 64] >> (r % 64)) & 1 and r not in survivors]
        if outside:
            raise ValueError(f"{fn}: active_rank_mask holds ranks {outside}, which were not in the last "
                             f"reset(group=...) of this workspace (its members: {list(survivors)}): their rows "
                             "are not initialized with the members', so the call would wait for them until the "
                             "timeout. Mask them off, or bring every rank back with a reset over a group of all "
                             "of them")

    def _row_initialized(self, checked_ranks: Optional[tuple[int, ...]] = None) -> None:
        """After the own row's re-initialization: every instance's round on it
        is over, and check() reads the rows of ``checked_ranks`` (None: every row)."""
        self._shared.checked_ranks = checked_ranks
        self._shared.resets += 1
        self._forget_round()
        self._shared.active = None

    def dispatch(
        self,
        token_selected_experts: torch.Tensor,
        input_payloads: list[torch.Tensor],
        runtime_max_tokens_per_rank: int,
        invalid_token_expert_id: Optional[int] = None,
        expert_id_payload_index: Optional[int] = None,
        eplb_local_stats: Optional[torch.Tensor] = None,
        active_rank_mask: Optional[torch.Tensor] = None,
        enable_pdl: Optional[bool] = None,
        *,
        router_weights: Optional[torch.Tensor] = None,
        output_payload_layouts: Optional[Sequence[Any]] = None,
    ) -> Union[list[torch.Tensor], ExpertMajorDispatch]:
        """:func:`~torch_moe_a2a.moe_a2a_dispatch` on this instance's workspace.

        Args:
            token_selected_experts, input_payloads, runtime_max_tokens_per_rank,
                eplb_local_stats, active_rank_mask, enable_pdl: as in the
                functional dispatch (``active_rank_mask`` required when the
                instance was built with ``enable_rank_mask=True``).
            invalid_token_expert_id: when given, the padding rows of the
                received expert-id payload ``input_payloads[expert_id_payload_index]``
                (an int32 or int64 payload of any width; the index is a list
                index, -1 the last payload, as in FlashInfer) are overwritten with it
                (:func:`~torch_moe_a2a.moe_a2a_sanitize_expert_ids`). Not with
                ``expert_major`` (its ``local_expert_ids`` have -1 padding).
            router_weights: ours, ``expert_major`` instances only:
                ``[local_num_tokens, top_k]`` router weights for the combine
                to apply (None: unweighted).
            output_payload_layouts: FlashInfer's keyword (vLLM passes it): None,
                or one layout per payload, each ``LINEAR`` (FlashInfer's
                ``MoeA2APayloadLayout.LINEAR``, or its name), the receive
                views' layout.

        Returns:
            The receive views, one per payload: ``[ep_size,
            runtime_max_tokens_per_rank, *]`` views of the workspace, valid until
            this rank's last :meth:`combine` of the round starts; for an ``expert_major`` instance the
            :class:`~torch_moe_a2a.ExpertMajorDispatch`. Where a payload
            requires grad under grad mode, new tensors instead, with
            gradients, as the functional dispatch returns them then.

        Raises:
            RuntimeError: two dispatches without a combine (where a call
                failed: its error record, which asks for :meth:`reset`),
                another instance sharing the workspace between its dispatch
                and combine, a round that a deleted instance left open (which
                asks for :meth:`reset`), or the workspace released by
                :meth:`checkpoint_prepare`.
            ValueError: arguments the functional dispatch refuses; EPLB stats or
                a rank mask the instance was not built for;
                ``output_payload_layouts`` not one per payload.
            NotImplementedError: an ``output_payload_layouts`` entry other than
                ``LINEAR`` (FlashInfer's ``R128C4`` scale tiles).
        """
        self._check_mapped("dispatch")
        if self._state.phase == "dispatched":
            self._raise_out_of_order("MoeAlltoAll.dispatch", "MoeAlltoAll.dispatch called twice without combine; call "
                                     "combine to close the open round (a refused combine changed nothing)")
        # A dispatch ends the last round's combines, refused or not: a combine
        # after a refused dispatch would combine the round before it.
        if self._state.phase == "combined":
            self._forget_round()
        _check_payload_layouts(output_payload_layouts, len(input_payloads))
        self._check_abandoned_round("MoeAlltoAll.dispatch")
        other = self._shared.active_instance()
        if other is not None and other is not self:
            raise RuntimeError("MoeAlltoAll.dispatch: another MoeAlltoAll sharing this workspace is between its "
                               "dispatch and combine; instances of one geometry share one workspace and take turns")
        if invalid_token_expert_id is not None:
            _check_sanitize_request(input_payloads, expert_id_payload_index, invalid_token_expert_id)
            if wants_grad("MoeAlltoAll.dispatch", "moe_a2a_dispatch_differentiable", *input_payloads):
                # Such a dispatch returns new tensors (the differentiable one's), which the sanitizing of the
                # workspace's ids would not reach.
                raise ValueError("MoeAlltoAll.dispatch: invalid_token_expert_id is not taken with payloads that "
                                 "require grad (the dispatch then returns new tensors, padding rows zero); leave it "
                                 "at None, or dispatch under torch.no_grad()")
        if eplb_local_stats is not None and not self.enable_eplb:
            raise ValueError("eplb_local_stats given but the instance was constructed with eplb_stats_num_experts=0")
        if active_rank_mask is not None and not self.enable_rank_mask:
            raise ValueError("active_rank_mask requires the instance to be constructed with enable_rank_mask=True")
        self._refuse_ranks_outside_the_reset("MoeAlltoAll.dispatch", active_rank_mask)
        if self.expert_major:
            if invalid_token_expert_id is not None:
                raise ValueError("invalid_token_expert_id sanitizes rank-major receive views; an expert_major "
                                 "instance's local_expert_ids already hold -1 in padding rows")
            got = moe_a2a_dispatch_expert_major(
                token_selected_experts, input_payloads, self.workspace, self.metainfo, runtime_max_tokens_per_rank,
                self.ep_rank, self.ep_size, self.top_k, self.num_experts, router_weights, self.max_tokens_per_expert,
                enable_pdl, eplb_local_stats, self.enable_rank_mask, active_rank_mask, backend=self._backend,
                timeout_s=self.timeout_s)
            self._state = _A2AState("dispatched", got.local_num_tokens, got.combine_payload_offset,
                                    got.eplb_gathered_stats, got, self._next_round(), runtime_max_tokens_per_rank,
                                    self._shared.resets)
            self._shared.active = weakref.ref(self)
            return got
        if router_weights is not None:
            raise ValueError("router_weights is an option of expert_major=True instances")
        recv, combine_payload_offset, eplb_gathered_stats = moe_a2a_dispatch(
            token_selected_experts,
            input_payloads,
            self.workspace,
            self.metainfo,
            runtime_max_tokens_per_rank,
            self.ep_rank,
            self.ep_size,
            self.top_k,
            self.num_experts,
            enable_pdl,
            eplb_local_stats,
            self.enable_rank_mask,
            active_rank_mask,
            backend=self._backend,
            recv_view_cache=self._recv_view_cache,
            timeout_s=self.timeout_s,
        )
        self._state = _A2AState(
            "dispatched",
            token_selected_experts.shape[0],
            combine_payload_offset,
            eplb_gathered_stats,
            round=self._next_round(),
            runtime_max_tokens_per_rank=runtime_max_tokens_per_rank,
            resets=self._shared.resets,
        )
        self._shared.active = weakref.ref(self)
        if invalid_token_expert_id is not None:
            moe_a2a_sanitize_expert_ids(
                recv[expert_id_payload_index],
                self.workspace,
                self.metainfo,
                self.ep_rank,
                invalid_token_expert_id,
                enable_pdl,
                backend=self._backend,
            )
        return recv

    def combine(
        self,
        payload: torch.Tensor,
        runtime_max_tokens_per_rank: int,
        payload_in_workspace: bool = False,
        output_dtype: Optional[torch.dtype] = None,
        output_scales: Optional[torch.Tensor] = None,
        output_scalar_scale: float = 1.0,
        sf_layout: SfLayout = SfLayout.layout_linear,
        output: Optional[torch.Tensor] = None,
        *,
        use_low_precision: bool = False,
        active_rank_mask: Optional[torch.Tensor] = None,
        enable_pdl: Optional[bool] = None,
        low_precision_block_scales: bool = False,
    ) -> torch.Tensor:
        """:func:`~torch_moe_a2a.moe_a2a_combine` for the tokens of the last :meth:`dispatch`
        (``low_precision_block_scales``: ours, as there). It may be called
        again before the next dispatch (on every rank alike), each time
        combining the payload given then over the same routes; a dispatch
        call ends that, also one that raises (in eager mode).

        Args:
            payload: this rank's expert outputs for the received rows:
                ``[ep_size, runtime_max_tokens_per_rank, *row_shape]`` as for
                the functional combine, or after an expert-major dispatch
                ``[num_local_experts, max_tokens_per_expert, *row_shape]`` as
                for :func:`~torch_moe_a2a.moe_a2a_combine_expert_major`.
            runtime_max_tokens_per_rank: the dispatch's.
            payload_in_workspace: whether ``payload`` is the view
                :meth:`get_combine_payload_tensor_in_workspace` returned,
                read in place.
            output_dtype, output: as in the functional combine.
            output_scales, output_scalar_scale, sf_layout, use_low_precision,
                low_precision_block_scales: as in the functional combine;
                rank-major dispatches only (after an expert-major one,
                ``sf_layout`` without ``output_scales`` is taken and, as
                there, changes nothing).
            active_rank_mask: required when the instance was built with
                ``enable_rank_mask=True``, refused otherwise.
            enable_pdl: programmatic dependent launch (None: on for compute capability 9.0+).

        Returns:
            ``[local_num_tokens, *payload.shape[2:]]``: a new tensor, or
            ``output``; differentiable where the payload requires grad under
            grad mode (after a dispatch of payloads that did), as the
            functional combine.

        Raises:
            RuntimeError: no dispatch before it, or a refused one since the
                last (where a call failed: its
                error record, which asks for :meth:`reset`; where a deleted
                instance left its round open, that), another instance
                sharing the workspace dispatched since this instance's
                dispatch, or the workspace released by
                :meth:`checkpoint_prepare`; what the
                functional combine raises (peers that did not arrive within
                the timeout).
            ValueError: another ``runtime_max_tokens_per_rank`` than the
                dispatch's, an ``active_rank_mask`` the instance was not built
                for, or arguments the functional combine refuses.
            NotImplementedError: after an expert-major dispatch, a
                low-precision or quantized combine (the expert-major combine
                has neither).
        """
        self._check_mapped("combine")
        self._check_round("combine")
        if runtime_max_tokens_per_rank != self._state.runtime_max_tokens_per_rank:
            # Checked here: the op would report the dispatch's local_num_tokens,
            # which this method's caller never passes, against the new T.
            raise ValueError("MoeAlltoAll.combine must use the dispatch's runtime_max_tokens_per_rank="
                             f"{self._state.runtime_max_tokens_per_rank}, got {runtime_max_tokens_per_rank}")
        if active_rank_mask is not None and not self.enable_rank_mask:
            raise ValueError("active_rank_mask requires the instance to be constructed with enable_rank_mask=True")
        self._refuse_ranks_outside_the_reset("MoeAlltoAll.combine", active_rank_mask)
        dispatched = self._state.expert_major
        if dispatched is not None:
            # The flags first, as the functional combine checks them: 'no' is
            # truthy and would read as a request for the low-precision combine.
            for name, flag in (("use_low_precision", use_low_precision),
                               ("low_precision_block_scales", low_precision_block_scales)):
                if flag is not False and flag is not True:
                    check_flag(f"MoeAlltoAll.combine: {name}", flag)
            # Checked as the rank-major combine checks it, and as there of no
            # effect without output_scales (refused below).
            layout_value(sf_layout)
            if output_scales is not None or use_low_precision or low_precision_block_scales:
                raise NotImplementedError("MoeAlltoAll.combine after an expert-major dispatch: use_low_precision, "
                                          "low_precision_block_scales and quantized outputs exist for the rank-major "
                                          "combine only")
        try:
            if dispatched is not None:
                out = moe_a2a_combine_expert_major(
                    payload, dispatched, self.workspace, self.metainfo, self.ep_rank, self.ep_size,
                    payload_in_workspace, output_dtype, enable_pdl=enable_pdl, enable_rank_mask=self.enable_rank_mask,
                    active_rank_mask=active_rank_mask, backend=self._backend, timeout_s=self.timeout_s, output=output)
            else:
                out = moe_a2a_combine(
                    payload,
                    self._state.local_num_tokens,
                    self.workspace,
                    self.metainfo,
                    runtime_max_tokens_per_rank,
                    self.ep_rank,
                    self.ep_size,
                    self.top_k,
                    self._state.combine_payload_offset,
                    payload_in_workspace,
                    output_dtype,
                    output_scales,
                    output_scalar_scale,
                    sf_layout,
                    output,
                    use_low_precision=use_low_precision,
                    enable_pdl=enable_pdl,
                    enable_rank_mask=self.enable_rank_mask,
                    active_rank_mask=active_rank_mask,
                    backend=self._backend,
                    timeout_s=self.timeout_s,
                    low_precision_block_scales=low_precision_block_scales,
                )
        except _STOP_RECOMPUTATION:
            # Non-reentrant checkpointing's early stop, raised by a saved
            # tensor's hook once the recomputed combine has run: the round
            # was combined, as in the forward.
            self._combined()
            raise
        self._combined()
        return out

    def _next_round(self) -> Optional[int]:
        """A dispatch's round number (_SharedWorkspace.rounds): a new one in
        eager calls; None under torch.compile, which must not read the
        counter: eager dispatches advance it, and a traced read would be a
        guard that fails at every step after one (a recompilation a step,
        then the recompile limit). What it catches, another instance's
        dispatch between this one's dispatch and combine, is an eager check
        of eager rounds, as the ids checks are."""
        if tracing():
            return None
        self._shared.rounds += 1
        return self._shared.rounds

    def _combined(self) -> None:
        """After a combine: the round stays open for repeated combines; the
        EPLB view is FlashInfer's, valid until the combine."""
        self._state.phase = "combined"
        self._state.eplb_gathered_stats = None
        self._shared.active = None

    def _check_round(self, what: str) -> None:
        """Raises unless this instance's last dispatch is the workspace's last one."""
        if self._state.phase == "idle":
            self._check_abandoned_round(f"MoeAlltoAll.{what}")
            other = self._shared.active_instance()
            if other is not None and other is not self:
                # Its dispatch would be refused too, while that round is open.
                raise RuntimeError(f"MoeAlltoAll.{what} called before dispatch on this instance, while another "
                                   "MoeAlltoAll sharing this workspace is between its dispatch and combine: combine "
                                   "through the instance that dispatched (instances of one geometry share one "
                                   "workspace and take turns)")
            self._raise_out_of_order(f"MoeAlltoAll.{what}", f"MoeAlltoAll.{what} called before dispatch (a combine "
                                     "combines the rows of the last dispatch); call dispatch first")
        # Not traced, nor after a traced dispatch: _next_round.
        if not tracing() and self._state.round is not None and self._state.round != self._shared.rounds:
            raise RuntimeError(f"MoeAlltoAll.{what}: another MoeAlltoAll sharing this workspace dispatched after "
                               "this instance's last dispatch, whose routes and rows are gone; dispatch again")

    def get_combine_payload_tensor_in_workspace(
        self,
        runtime_max_tokens_per_rank: int,
        hidden_size: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """``[ep_size, runtime_max_tokens_per_rank, hidden_size]`` view of this rank's combine region
        (``[num_local_experts, max_tokens_per_expert, hidden_size]`` after an expert-major dispatch).

        Write the expert outputs into it and call :meth:`combine` with
        ``payload_in_workspace=True`` to skip the staging copy. Valid from
        :meth:`dispatch` to the round's last :meth:`combine` (rows rewritten
        between two combines of a round race the peers' reads of the earlier
        one: pass a new payload as a tensor instead). After a combine of the
        round that staged its payload (a tensor, or ``use_low_precision``)
        the region holds the staged rows, and a combine from it is refused:
        pass the payload as a tensor. Under ``torch.compile`` it is a
        tensor of its own, which combine then stages (see
        :func:`~torch_moe_a2a.moe_a2a_wrap_payload_tensor_in_workspace`).

        Args:
            runtime_max_tokens_per_rank: the round's dispatch's (checked for
                an expert-major dispatch too, whose view does not use it).
            hidden_size: elements of a payload row, a positive int.
            dtype: the payload's dtype: bf16, fp16 or fp32.

        Returns:
            The view of this rank's workspace row at the dispatch's
            ``combine_payload_offset`` (under ``torch.compile`` a copy, as
            above).

        Raises:
            RuntimeError: called before :meth:`dispatch`, after another
                instance's dispatch on the shared workspace, or with the
                workspace released.
            ValueError: ``runtime_max_tokens_per_rank`` other than the
                round's dispatch's, ``hidden_size`` not a positive int,
                ``dtype`` not one the combine sums (bf16, fp16, fp32), a
                view larger than the combine region up to the row's end.
        """
        fn = "MoeAlltoAll.get_combine_payload_tensor_in_workspace"
        self._check_mapped("get_combine_payload_tensor_in_workspace")
        self._check_round("get_combine_payload_tensor_in_workspace")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{fn}: dtype must be a torch.dtype, got {dtype!r}")
        if dtype not in COMBINE_DTYPES:  # a view of another dtype the combine refuses
            raise ValueError(f"{fn}: dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
        if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size < 1:
            raise ValueError(f"{fn}: hidden_size must be a positive int, got {hidden_size!r}")
        # Expert-major too: the view's shape does not use it, but the combine insists on it.
        dispatched_t = self._state.runtime_max_tokens_per_rank
        if isinstance(runtime_max_tokens_per_rank, bool) or runtime_max_tokens_per_rank != dispatched_t:
            raise ValueError(f"{fn}: runtime_max_tokens_per_rank must be the round's dispatch's ({dispatched_t}), "
                             f"got {runtime_max_tokens_per_rank!r}")
        offset = self._state.combine_payload_offset
        leading = [self.ep_size, runtime_max_tokens_per_rank]
        if self._state.expert_major is not None:
            leading = list(self._state.expert_major.local_expert_ids.shape)
        nbytes = leading[0] * leading[1] * hidden_size * dtype.itemsize
        # Else the wrap below refused a slice "not within one row", naming neither hidden_size nor the fix.
        room = self.workspace.shape[1] - offset
        if nbytes > room:
            raise ValueError(f"{fn}: a {[*leading, hidden_size]} {dtype} payload ({nbytes} bytes) does not fit this "
                             f"rank's combine region, {room} bytes from the dispatch's combine_payload_offset "
                             f"{offset} to the end of the {self.workspace.shape[1]}-byte row: size the workspace "
                             "for this hidden_size and dtype (MoeAlltoAll(hidden_size=, dtype=) or "
                             "get_moe_workspace_size_per_rank)")
        return moe_a2a_wrap_payload_tensor_in_workspace(
            self.workspace[self.ep_rank], leading, offset, offset + nbytes, dtype
        )

    # ---- checkpointing (FlashInfer's checkpoint_prepare / checkpoint_restore) ----

    def _check_checkpointable(self, what: str) -> Collective:
        coll = self._shared.collective
        if coll is None:
            raise RuntimeError(f"MoeAlltoAll.{what} needs a workspace mapped over a group (mnnvl_config= or "
                               "group=); this instance's is a tensor of this process, with no memory to hand back")
        if self._shared.active_instance() is not None:
            raise RuntimeError(f"MoeAlltoAll.{what}: cannot release or remap the workspace between a dispatch and "
                               "its combine")
        return coll

    def checkpoint_prepare(self) -> None:
        """Release the workspace's memory, keeping its addresses (collective; idempotent).

        Every rank finishes its work on the device, the group synchronizes,
        and each rank unmaps the rows (CUDA: the address range stays reserved,
        so CUDA graphs captured on the workspace stay valid for after
        :meth:`checkpoint_restore`; CPU: the shared pages are freed). Every
        instance sharing the workspace is released with it; until the
        restore, their dispatch, combine and views raise or must not be
        touched. A second call is a no-op.

        Raises:
            RuntimeError: between a dispatch and its combine (of any instance
                sharing the workspace), or on a workspace not mapped over a group.
        """
        if not self._shared.mapped:
            return
        coll = self._check_checkpointable("checkpoint_prepare")
        release_workspace_memory(self.workspace, coll)
        self._shared.mapped = False

    def checkpoint_restore(self, comm_backend: Any) -> None:
        """Map fresh memory at the old addresses and re-initialize (collective; idempotent).

        Args:
            comm_backend: a FlashInfer ``CommBackend`` (or ``torch.distributed``
                group) of the same ranks in the same order as the workspace's
                group; it becomes the workspace's group.

        The metainfo stays the same object with the same values, so CUDA
        graphs captured before :meth:`checkpoint_prepare` replay unchanged. A
        call on a mapped workspace is a no-op.

        Raises:
            RuntimeError: ``comm_backend``'s rank or size differ from this
                rank's place in the workspace, or between a dispatch and its combine.
        """
        if self._shared.mapped:
            return
        self._check_checkpointable("checkpoint_restore")
        coll = as_collective(comm_backend, self.workspace.device)
        if (coll.rank, coll.size) != (self.ep_rank, self.ep_size):
            raise RuntimeError(f"MoeAlltoAll.checkpoint_restore: the communicator's rank/size {coll.rank}/"
                               f"{coll.size} differ from the workspace's {self.ep_rank}/{self.ep_size}")
        _synchronize(self.workspace)
        restore_workspace_memory(self.workspace, coll)
        self._initialize_own_row()
        coll.barrier()
        self._shared.initializations_behind = 0  # fresh memory: every row's count starts again
        self._shared.collective = coll
        self._shared.mapped = True
        self._row_initialized()

    def reset(self, *, group: Any = None) -> None:
        """Re-initialize the workspace after a failure (a timed-out peer), collectively.

        With a group: every rank calls it; the group synchronizes (no rank is
        still inside a call), each rank re-initializes its own row (clearing
        its error record), and the group synchronizes again (waits bounded
        by the group's own timeout, not ``timeout_s``: docs/DESIGN.md section 6). On a ``workspace=``
        of simulated ranks: this rank's row only, and the caller makes sure
        no rank is inside a call (every rank's last call returned and its
        kernels finished) before any rank resets. The metainfo stays the same.
        It ends the open round of every instance sharing the workspace (their
        next call is a dispatch).

        Args:
            group: ours, keyword-only: the members that reset together when
                some of the instance's group cannot (a process that exited,
                whose peers' calls timed out naming it): a ``torch.distributed``
                group or a FlashInfer ``CommBackend`` of the survivors, this
                process among them, which synchronize in place of the
                instance's group. Every survivor calls it; their later calls
                mask the others off (``active_rank_mask``), so the instance
                must have been built with ``enable_rank_mask=True`` when the
                group is smaller than ``ep_size``, and :meth:`check` reads the
                survivors' rows only. A group of every member stands in for
                an instance's group that failed (a collective of it that
                timed out leaves a gloo group broken). Once the reset
                succeeded, the group is the workspace's: later resets (without
                ``group``) and checkpointing of every instance sharing it
                synchronize over it. Default: the instance's group.

        Raises:
            RuntimeError: the workspace was released by :meth:`checkpoint_prepare`;
                the group's first barrier failed (a member that exited), with
                the group's error as the cause: nothing was re-initialized; a
                member's re-initialization was refused (another thread of its
                process inside a call): every member raises, naming it, and
                every member calls reset() again once that call returned.
            ValueError: ``group`` neither kind of group, a group of more members
                than ``ep_size``, or one of fewer without ``enable_rank_mask``.
        """
        self._check_mapped("reset")
        coll = self._shared.collective
        if group is not None:
            coll = as_collective(group, self.workspace.device)
            if coll.size > self.ep_size or (coll.size < self.ep_size and not self.enable_rank_mask):
                raise ValueError(f"MoeAlltoAll.reset: group has {coll.size} members for an instance of ep_size "
                                 f"{self.ep_size}; a group of survivors resets an instance built with "
                                 "enable_rank_mask=True, whose calls then mask the others off")
        _synchronize(self.workspace)
        if coll is not None:
            try:
                coll.barrier()
            except Exception as e:  # the group's own error (gloo: 'Connection closed by peer') names no way out
                raise RuntimeError("MoeAlltoAll.reset: the group's barrier failed, so nothing was re-initialized: "
                                   "every member must call reset(); where a member exited, its survivors reset "
                                   "over a group of their own, reset(group=...); where the group itself failed "
                                   "(one of its collectives timed out, which leaves a gloo group broken), every "
                                   "member resets over a new group of all of them, reset(group=...)") from e
        # Which rows check() reads from now on: a group of survivors says whose
        # (given here, or the workspace's since such a reset).
        checked = None
        if coll is not None and coll.size < self.ep_size:
            checked = tuple(sorted(v[0] for v in allgather_ints([self.ep_rank], coll)))
        if coll is None:
            self._initialize_own_row()
        else:
            self._initialize_own_rows_together(coll)
        if group is not None:
            # The group that reset together stands in for the one that failed
            # from now on: later resets and checkpointing of every instance
            # sharing the workspace synchronize over it.
            self._shared.collective = coll
        self._row_initialized(checked if checked is not None and len(checked) < self.ep_size else None)

    def _initialize_own_row(self) -> None:
        """moe_a2a_initialize of the own row with the metainfo's mailbox (so the
        metainfo, which CUDA graphs baked in, stays valid), finished on the device."""
        reinitialize_row(self.workspace, self.metainfo)
        _synchronize(self.workspace)

    def _initialize_own_rows_together(self, coll: Collective) -> None:
        """Every member of ``coll`` initializes its own row, then every member
        learns whether all did (a status exchange, in place of a barrier). A
        member refused locally (another thread of its process inside a call)
        must not raise alone: its peers would go on, and their next collective
        would pair with another of its. So every member raises then, and the
        members refused make up the initialization in their next reset."""
        shared = self._shared
        behind, done, error = shared.initializations_behind, 0, None
        try:
            for _ in range(1 + behind):
                self._initialize_own_row()
                done += 1
        except Exception as e:  # every member hears of it below
            error = e
        failures = gather_failures(error, coll)
        # No exception left in a local: its traceback would hold this frame (gather_failures' users say why).
        cause = [error]
        error = None
        failed, detail = failed_members(failures)
        shared.initializations_behind = 0
        if failed:
            # Each row's count of initializations stays where its member left
            # it: the rows that went furthest set what the others make up.
            ahead = max(v[0] for v in allgather_ints([done - behind], coll))
            shared.initializations_behind = ahead - (done - behind)
            raise RuntimeError(f"MoeAlltoAll.reset: the re-initialization failed on group ranks {failed}, so every "
                               f"member raises ({detail}); call reset() again on every member once that is "
                               "resolved") from cause.pop()


def _group_destroyed(coll: Optional[Collective]) -> bool:
    """Whether a cached workspace's ``torch.distributed`` group was destroyed
    (False for no group and for a CommBackend, which does not tell)."""
    return isinstance(coll, TorchGroupCollective) and coll.destroyed()


def _group_members(coll: Optional[Collective]) -> Optional[tuple[int, ...]]:
    """The global ranks of a ``torch.distributed`` group, part of the workspace
    cache's key: a process may be rank r of n in several groups (of other
    members), and a workspace mapped over one of them is not the other's.
    None for no group and for a CommBackend, whose members it does not tell
    (FlashInfer's cache, keyed by the geometry alone)."""
    if isinstance(coll, TorchGroupCollective):
        return tuple(torch.distributed.get_process_group_ranks(coll.group))
    return None


def _synchronize(workspace: torch.Tensor) -> None:
    """Wait for the queued work on the workspace's device (before a barrier lets a peer in)."""
    if workspace.is_cuda:
        torch.cuda.current_stream(workspace.device).synchronize()


def _check_sanitize_request(input_payloads: list, index: Optional[int], invalid_id: int) -> None:
    """MoeAlltoAll.dispatch's sanitize arguments, checked before the dispatch
    runs: a refusal after it would leave the peers' rows written and no
    receive views returned."""
    if index is None:
        raise ValueError("expert_id_payload_index is required when invalid_token_expert_id is set")
    n = len(input_payloads)
    # A list index, as FlashInfer uses it (recv_tensors[expert_id_payload_index]): -1 names the last payload.
    if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not -n <= index < n:
        raise ValueError(f"expert_id_payload_index must index input_payloads ({-n}..{n - 1}), got {index!r}")
    ids = input_payloads[index]
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 2:
        raise ValueError("expert_id_payload_index must name an int32 or int64 [local_num_tokens, width] payload, "
                         f"got {ids.dtype} {tuple(ids.shape)}")
    bits = 8 * ids.element_size()
    if not isinstance(invalid_id, int) or isinstance(invalid_id, bool) or not (
            -(2 ** (bits - 1)) <= invalid_id < 2 ** (bits - 1)):
        raise ValueError(f"invalid_token_expert_id must be an int that fits in {ids.dtype}, got {invalid_id!r}")


__all__ = ["MoeAlltoAll"]
