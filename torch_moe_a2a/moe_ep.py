"""FlashInfer's ``flashinfer.moe_ep`` NVLink one-sided communication
(``NVLinkOneSidedAlltoAll``, FlashInfer's successor to ``MoeAlltoAll``) on this
package's :class:`~torch_moe_a2a.MoeAlltoAll`, without FlashInfer installed:
the class with FlashInfer's constructor and methods, and the small types its
constructor takes and its dispatch returns. ``from torch_moe_a2a.moe_ep import
...`` stands for ``from flashinfer.moe_ep import ...``; FlashInfer's own
``BootstrapConfig``, ``MoEEpCommParams`` and ``NVLinkOneSidedConfig`` are
accepted too (they are read by attribute).

The contract is FlashInfer's rank-major one: ``dispatch`` returns ``ep_size *
tokens_per_rank`` receive rows, each token at most once per rank with its
whole top-k routing (rows without a token have every id set to
``invalid_expert_id``); the expert computation applies the weights and sums
over this rank's experts, one output row per received row; ``combine`` sums
each token's rows from its ranks on its source rank.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

import torch

from .api import moe_a2a_active_rank_mask, moe_a2a_get_workspace_size_per_rank
from .arguments import ID_DTYPES
from .fastpath import expect_ints, expect_tensors
from .mapping import Mapping
from .moe_alltoall import MoeAlltoAll

logger = logging.getLogger(__name__)

# FlashInfer's bound on NVLinkOneSidedConfig.timeout_sec: a day.
MAX_TIMEOUT_SEC = 24 * 60 * 60


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# Bytes of one token's activations in each of FlashInfer's dispatch formats
# (``flashinfer.fused_moe.QuantFormat`` names): the values and their per-block
# scale factors (a per-tensor scale does not travel with the tokens).
DISPATCH_BYTES_PER_TOKEN = {
    "BF16": lambda hidden: 2 * hidden,
    "FP16": lambda hidden: 2 * hidden,
    "FP8PerTensor": lambda hidden: hidden,
    "DeepSeekFp8": lambda hidden: hidden + 4 * _ceil_div(hidden, 128),
    "MXFP8": lambda hidden: hidden + _ceil_div(hidden, 32),
    "NVFP4": lambda hidden: _ceil_div(hidden, 2) + _ceil_div(hidden, 16),
    "MXFP4": lambda hidden: _ceil_div(hidden, 2) + _ceil_div(hidden, 32),
}


@dataclass
class BootstrapConfig:
    """FlashInfer's ``BootstrapConfig``: where this rank sits in the EP group.

    ``NVLinkOneSidedAlltoAll`` reads ``world_size``, ``rank`` and
    ``process_group`` (the ``torch.distributed`` group the workspace is mapped
    over when the config names no ``comm_backend``; None: the default group).
    The other fields are FlashInfer's other backends' and are accepted as they are.

    Raises:
        ValueError: ``world_size`` or ``rank`` not an int, ``world_size < 1``,
            ``rank`` outside ``[0, world_size)``, a negative ``device``.
    """

    world_size: int
    rank: int
    stream: int = 0
    auto_bootstrap: bool = True
    device: Optional[int] = field(default=None, kw_only=True)
    nccl_comm: Optional[int] = None
    process_group: Any = field(default=None, compare=False, hash=False)
    tcp_store: Any = None

    def __post_init__(self) -> None:
        expect_ints("BootstrapConfig", world_size=self.world_size, rank=self.rank)
        if self.world_size <= 0:
            raise ValueError(f"world_size must be positive, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} not in [0, {self.world_size})")
        if self.device is not None and self.device < 0:
            raise ValueError(f"device must be non-negative, got {self.device}")


@dataclass(frozen=True)
class MoEEpCommParams:
    """FlashInfer's ``MoEEpCommParams``: the EP sizing every backend shares.

    ``dtype`` is the unquantized token row's (default bf16), also what the
    experts hand to ``combine``; ``dispatch_format`` the activations' format
    as dispatched (a ``QuantFormat`` or its name, one of
    :data:`DISPATCH_BYTES_PER_TOKEN`), None for unquantized ``dtype`` rows.

    Raises:
        ValueError: a size that is not a positive int, ``top_k > num_experts``,
            ``invalid_expert_id`` a valid expert or beyond int32, a ``dtype``
            that is not a torch.dtype, an unknown ``dispatch_format``.
    """

    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    hidden_size: int
    dtype: Optional[torch.dtype] = None
    dispatch_format: Any = None
    invalid_expert_id: int = -1

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "max_tokens_per_rank", "hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MoEEpCommParams.{name} must be a positive int, got {value!r}")
        # FlashInfer's MoEEpCommParams refuses it too (the ops below accept fewer experts than top_k).
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEEpCommParams.top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        expect_ints("MoEEpCommParams", invalid_expert_id=self.invalid_expert_id)
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"MoEEpCommParams.dtype must be a torch.dtype or None, got {self.dtype!r}")
        if not -(2**31) <= self.invalid_expert_id < 2**31:  # the received ids are int32
            raise ValueError(f"MoEEpCommParams.invalid_expert_id must fit int32 (the ids travel as int32), got "
                             f"{self.invalid_expert_id}")
        if 0 <= self.invalid_expert_id < self.num_experts:
            raise ValueError(f"MoEEpCommParams.invalid_expert_id must lie outside [0, num_experts="
                             f"{self.num_experts}), got {self.invalid_expert_id}")
        if self.dispatch_format is not None and self._format_name() not in DISPATCH_BYTES_PER_TOKEN:
            raise ValueError(f"MoEEpCommParams.dispatch_format must be one of {sorted(DISPATCH_BYTES_PER_TOKEN)} "
                             f"(or None), got {self.dispatch_format!r}")

    def _format_name(self) -> str:
        return getattr(self.dispatch_format, "name", self.dispatch_format)

    @property
    def token_dtype(self) -> torch.dtype:
        """``dtype``, bf16 when None."""
        return torch.bfloat16 if self.dtype is None else self.dtype

    @property
    def dispatch_bytes_per_token(self) -> int:
        """Bytes of one token's dispatched activations, scale factors included."""
        if self.dispatch_format is None:
            return self.hidden_size * self.token_dtype.itemsize
        return DISPATCH_BYTES_PER_TOKEN[self._format_name()](self.hidden_size)


@dataclass(frozen=True)
class MoEEpDispatchResult:
    """FlashInfer's ``MoEEpDispatchResult``: the receive rows of one dispatch,
    every tensor ``[ep_size * tokens_per_rank, *]``, views of the workspace
    valid until the matching ``combine``."""

    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: Optional[torch.Tensor]
    tokens_per_rank: int
    hidden_states_scale: Optional[torch.Tensor] = None
    eplb_gathered_stats: Optional[torch.Tensor] = None


@dataclass
class NVLinkOneSidedConfig:
    """FlashInfer's ``NVLinkOneSidedConfig``: the options of :class:`NVLinkOneSidedAlltoAll`.

    ``extra_payload_bytes_per_token`` reserves workspace for more per-token
    bytes than activations and routing; ``eplb_stats_num_experts`` makes
    dispatch all-gather that many EPLB statistics; ``enable_rank_mask`` makes
    dispatch and combine take an ``active_rank_mask``;
    ``use_low_precision_combine`` sends the combine's rows as e4m3;
    ``comm_backend`` (a FlashInfer ``CommBackend`` or a ``torch.distributed``
    group) maps the workspace, by default the bootstrap's process group.
    ``kernel`` (a field of FlashInfer's config from its ``kernel`` choice
    until its CFT release, second as there) is the
    :class:`~torch_moe_a2a.MoeAlltoAll` ``backend``: ``"trtllm"``;
    ``"cake"`` is refused as ``backend="cake"`` is.

    The fields of FlashInfer's CFT release: ``cft`` (None, True or False)
    and ``cft_max_tokens_for_dispatch`` / ``_combine`` (ints >= 0, checked
    as FlashInfer checks them) choose its counted NVLink writes, which need
    compute capability 10.0 and a fabric this library does not program:
    they are accepted, and every step takes the one-sided path (a true
    ``cft`` logs a warning that says so, as FlashInfer does where a rank
    cannot have them; :attr:`NVLinkOneSidedAlltoAll.cft_enabled` is False). ``timeout_sec``
    (an int in ``[1, 86400]``) bounds every wait for a peer, as
    :class:`~torch_moe_a2a.MoeAlltoAll`'s ``timeout_s``: an expired wait
    records the error and returns (FlashInfer's traps the kernel). None,
    ours: ``MOE_A2A_TIMEOUT_S``, else 30 s (FlashInfer's default is 300 s;
    its configs' value is taken).
    """

    backend_name: str = "nvlink_one_sided"
    kernel: str = "trtllm"
    extra_payload_bytes_per_token: int = 0
    eplb_stats_num_experts: int = 0
    enable_rank_mask: bool = False
    use_low_precision_combine: bool = False
    comm_backend: Any = None
    cft: Optional[bool] = None
    cft_max_tokens_for_dispatch: int = 128
    cft_max_tokens_for_combine: int = 128
    timeout_sec: Optional[int] = None


class MoEEpCommunication(abc.ABC):
    """FlashInfer's ``MoEEpCommunication``: the dispatch and combine a MoE layer
    programs against, each backend's contract the module docstring's. One
    instance serves one EP group and one dispatch/combine pair at a time;
    every rank of the group makes the same calls. Backends register with
    :func:`register_communication` and are built by
    :func:`create_communication`.

    Args:
        bootstrap: ``world_size`` ranks, this one ``rank``.
        params: :class:`MoEEpCommParams` (or FlashInfer's).

    Raises:
        RuntimeError: the backend cannot run here (:meth:`is_platform_supported`).
        ValueError: ``num_experts`` not divisible by the EP size.
    """

    backend_name: ClassVar[str]

    def __init__(self, bootstrap: Any, params: Any) -> None:
        if not self.is_platform_supported():
            raise RuntimeError(f"{type(self).__name__} is not supported on this platform.")
        self.bootstrap = bootstrap
        self.params = params
        self.ep_rank = int(bootstrap.rank)
        self.ep_size = int(bootstrap.world_size)
        if params.num_experts % self.ep_size != 0:
            raise ValueError(f"{type(self).__name__} requires num_experts ({params.num_experts}) divisible by the "
                             f"EP size ({self.ep_size})")
        self.num_local_experts = params.num_experts // self.ep_size

    @classmethod
    @abc.abstractmethod
    def is_platform_supported(cls) -> bool:
        """Whether the backend can run on this machine (no collective)."""

    def is_workload_feasible(self, max_tokens_per_rank: int) -> bool:
        """Whether a step whose busiest rank dispatches ``max_tokens_per_rank`` tokens fits the buffers."""
        return max_tokens_per_rank <= self.params.max_tokens_per_rank

    @abc.abstractmethod
    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: Optional[torch.Tensor] = None, **kwargs: Any) -> MoEEpDispatchResult:
        """Send each token to the ranks that own its experts (keywords:
        ``hidden_states_scale``, ``max_tokens_per_rank``, ``eplb_local_stats``)."""

    @abc.abstractmethod
    def combine(self, expert_output: torch.Tensor, *, output: Optional[torch.Tensor] = None,
                **kwargs: Any) -> torch.Tensor:
        """Sum each token's expert outputs over the ranks it was sent to."""

    def get_combine_input_buffer(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """A buffer the experts may write their outputs into for :meth:`combine`, or None (no such buffer)."""
        return None

    def destroy(self) -> None:  # noqa: B027 - FlashInfer's default does nothing
        """Release the backend's resources (collective, idempotent)."""


# Backend name -> class: FlashInfer's registry of communication backends.
_COMMUNICATION_REGISTRY: dict[str, type[MoEEpCommunication]] = {}


def register_communication(name: str) -> Callable[[type[MoEEpCommunication]], type[MoEEpCommunication]]:
    """Class decorator that registers a :class:`MoEEpCommunication` backend as ``name``.

    Args:
        name: the name :func:`create_communication` builds it by (also its ``backend_name``).

    Returns:
        The decorator, which returns the class.
    """

    def decorator(cls: type[MoEEpCommunication]) -> type[MoEEpCommunication]:
        cls.backend_name = name
        _COMMUNICATION_REGISTRY[name] = cls
        return cls

    return decorator


def communication_backend_name(backend: Any) -> str:
    """The registered name a backend string or config object names.

    Args:
        backend: a name, or an object with a ``backend_name`` str.

    Returns:
        The name.

    Raises:
        TypeError: neither.
    """
    name = getattr(backend, "backend_name", backend)
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string or have a .backend_name str attr; got {backend!r}")
    return name


def is_communication_backend(backend: Any) -> bool:
    """Whether ``backend`` (a name or a config object) names a registered backend."""
    try:
        return communication_backend_name(backend) in _COMMUNICATION_REGISTRY
    except TypeError:
        return False


def available_communication_backends() -> list[str]:
    """The registered backends that can run on this machine, sorted."""
    return sorted(name for name, cls in _COMMUNICATION_REGISTRY.items() if cls.is_platform_supported())


def create_communication(bootstrap: Any, params: Any, backend: Any, **options: Any) -> MoEEpCommunication:
    """Build the registered communication backend that ``backend`` names.

    Args:
        bootstrap: :class:`BootstrapConfig` (or FlashInfer's).
        params: :class:`MoEEpCommParams` (or FlashInfer's).
        backend: a backend name (``"nvlink_one_sided"``), or a config object
            with a ``backend_name`` (:class:`NVLinkOneSidedConfig`, or
            FlashInfer's), which the backend gets as ``config``.
        options: further keywords of the backend (``device=`` of
            :class:`NVLinkOneSidedAlltoAll`).

    Returns:
        The backend instance.

    Raises:
        KeyError: no backend of that name is registered.
        TypeError: ``backend`` neither a str nor an object with a ``backend_name`` str.
    """
    name = communication_backend_name(backend)
    cls = _COMMUNICATION_REGISTRY.get(name)
    if cls is None:
        raise KeyError(f"unknown communication backend {name!r}; available: {sorted(_COMMUNICATION_REGISTRY)}")
    if not isinstance(backend, str):
        options["config"] = backend
    return cls(bootstrap, params, **options)


@register_communication("nvlink_one_sided")
class NVLinkOneSidedAlltoAll(MoEEpCommunication):
    """FlashInfer's ``flashinfer.moe_ep.NVLinkOneSidedAlltoAll`` on this package's
    :class:`~torch_moe_a2a.MoeAlltoAll`: one dispatch carries each token's
    activations, their optional scale factors, its int32 expert ids and its
    router weights; received rows beyond a source's token count get
    ``params.invalid_expert_id`` in every id. One instance serves one EP group
    and one dispatch/combine pair at a time; every rank makes the same calls.

    Args:
        bootstrap: :class:`BootstrapConfig` (or FlashInfer's): ``world_size``
            ranks, this one ``rank``.
        params: :class:`MoEEpCommParams` (or FlashInfer's).
        config: :class:`NVLinkOneSidedConfig` (or FlashInfer's); None: the defaults.
        device: ours, keyword-only: where the workspace lives (default: the
            current CUDA device if there is one, else the CPU: CPU processes
            share a shared-memory workspace).

    Raises:
        ValueError: ``num_experts`` not divisible by the EP size (FlashInfer's
            ``num_local_experts`` contract), a negative
            ``extra_payload_bytes_per_token``, ``eplb_stats_num_experts``
            outside ``[0, num_experts]``, ``timeout_sec`` outside ``[1,
            86400]``, a negative CFT token limit,
            a communicator of another rank or size, or what
            :class:`~torch_moe_a2a.MoeAlltoAll` refuses.
        TypeError: ``timeout_sec`` not an int (FlashInfer's type).
    """

    # ``backend_name``: "nvlink_one_sided", set by register_communication.
    # The kernels of the MoeAlltoAll underneath (its ``backend``).
    alltoall_backend: ClassVar[str] = "trtllm"
    # A dispatch/combine pair may be captured in a CUDA graph after an eager warm-up of the same shapes.
    supports_cuda_graph: ClassVar[bool] = True

    def __init__(
        self,
        bootstrap: Any,
        params: Any,
        config: Optional[Any] = None,
        *,
        device: Union[torch.device, str, None] = None,
    ) -> None:
        self.config = NVLinkOneSidedConfig() if config is None else config
        super().__init__(bootstrap, params)
        timeout_s = self._check_config(self.config, params)
        comm = self.config.comm_backend
        if comm is None:
            comm = getattr(bootstrap, "process_group", None)  # None: MoeAlltoAll takes the default group
        # FlashInfer's configs before its `kernel` field and after its CFT release have none: the default kernels.
        self.alltoall_backend = getattr(self.config, "kernel", NVLinkOneSidedAlltoAll.alltoall_backend)
        # The activations, int32 ids and fp32 weights travel; the experts' rows come back at 16 bits or more.
        dispatch_bytes = params.dispatch_bytes_per_token + 8 * params.top_k + self.config.extra_payload_bytes_per_token
        combine_bytes = params.hidden_size * max(params.token_dtype.itemsize, 2)
        mapping = Mapping(world_size=self.ep_size, rank=self.ep_rank, gpus_per_node=self.ep_size,
                          tp_size=self.ep_size, moe_ep_size=self.ep_size)
        self._alltoall: Optional[MoeAlltoAll] = MoeAlltoAll(
            mapping,
            max_num_tokens=params.max_tokens_per_rank,
            top_k=params.top_k,
            num_experts=params.num_experts,
            workspace_size_per_rank=moe_a2a_get_workspace_size_per_rank(
                self.ep_size, params.max_tokens_per_rank, dispatch_bytes, combine_bytes,
                self.config.eplb_stats_num_experts, backend=self.alltoall_backend),
            eplb_stats_num_experts=self.config.eplb_stats_num_experts,
            enable_rank_mask=self.config.enable_rank_mask,
            backend=self.alltoall_backend,
            group=comm,
            device=device,
            timeout_s=timeout_s,
        )
        self._tokens_per_rank: Optional[int] = None
        self._combine_buffer: Optional[torch.Tensor] = None
        self._combined = False  # the last dispatch's round was closed by a combine (for combine's error)

    @staticmethod
    def _check_config(config: Any, params: Any) -> Optional[int]:
        """Refuse what FlashInfer's constructor refuses of ``config``
        (FlashInfer's own configs of any release read by attribute, their
        defaults where a release lacks a field); the wait bound in seconds,
        None for the library's default."""
        expect_ints("NVLinkOneSidedConfig", extra_payload_bytes_per_token=config.extra_payload_bytes_per_token,
                    eplb_stats_num_experts=config.eplb_stats_num_experts)
        if config.extra_payload_bytes_per_token < 0:
            raise ValueError("extra_payload_bytes_per_token must be non-negative")
        if not 0 <= config.eplb_stats_num_experts <= params.num_experts:
            raise ValueError(f"eplb_stats_num_experts must be in [0, num_experts={params.num_experts}], got "
                             f"{config.eplb_stats_num_experts}")
        timeout_sec = getattr(config, "timeout_sec", None)
        if timeout_sec is not None:
            if isinstance(timeout_sec, bool) or not isinstance(timeout_sec, int):
                raise TypeError(f"timeout_sec must be an integer number of seconds, got {timeout_sec!r}")
            if not 0 < timeout_sec <= MAX_TIMEOUT_SEC:
                raise ValueError(f"timeout_sec must be in 1..{MAX_TIMEOUT_SEC}, got {timeout_sec}")
        limits = {name: getattr(config, name, 0) for name in ("cft_max_tokens_for_dispatch",
                                                               "cft_max_tokens_for_combine")}
        expect_ints("NVLinkOneSidedConfig", **limits)
        if any(limit < 0 for limit in limits.values()):
            raise ValueError(f"CFT token-count limits must be non-negative, got {limits}")
        if getattr(config, "cft", None):  # read by truth, as FlashInfer reads it
            logger.warning("NVLink one-sided CFT counted writes disabled: torch-moe-a2a does not implement them "
                           "(they need compute capability 10.0 and FlashInfer's fabric endpoints); every step takes "
                           "the one-sided path")
        return timeout_sec

    @classmethod
    def is_platform_supported(cls) -> bool:
        """True: the workspace lives in CUDA virtual memory shared over NVLink or
        between processes of one host, or in CPU shared memory."""
        return True

    @property
    def cft_enabled(self) -> bool:
        """False: FlashInfer's CFT counted writes are not implemented here
        (:class:`NVLinkOneSidedConfig`); every step takes the one-sided path."""
        return False

    def active_rank_mask(self, active_ranks: Sequence[int]) -> torch.Tensor:
        """The ``active_rank_mask`` of :meth:`dispatch` and :meth:`combine`
        (with ``enable_rank_mask``) for the ranks ``active_ranks``.

        Args:
            active_ranks: the ranks that take part, each read by ``int()`` as
                FlashInfer reads them (ints, 0-d tensors, ...), in ``[0, ep_size)``.

        Returns:
            CPU uint64 mask (:func:`~torch_moe_a2a.moe_a2a_active_rank_mask`).

        Raises:
            ValueError: a rank out of range.
        """
        return moe_a2a_active_rank_mask([int(rank) for rank in active_ranks], self.ep_size)

    def checkpoint_prepare(self) -> None:
        """Release the workspace's memory, keeping its addresses (collective;
        a second call does nothing): :meth:`MoeAlltoAll.checkpoint_prepare`.

        Raises:
            RuntimeError: between :meth:`dispatch` and :meth:`combine`; after
                :meth:`destroy`; a workspace not mapped over a group (one rank
                without one).
        """
        self.alltoall.checkpoint_prepare()

    def checkpoint_restore(self, comm_backend: Any) -> None:
        """Map fresh memory at the old addresses after :meth:`checkpoint_prepare`
        and re-initialize (collective over ``comm_backend``, the EP group's
        ranks in their order; does nothing on a mapped workspace):
        :meth:`MoeAlltoAll.checkpoint_restore`.

        Raises:
            RuntimeError: ``comm_backend`` of another rank or size; after :meth:`destroy`.
        """
        self.alltoall.checkpoint_restore(comm_backend)

    def reset(self, *, group: Any = None) -> None:
        """Re-initialize the workspace after a failure, collectively (ours:
        FlashInfer's class has none): :meth:`MoeAlltoAll.reset`, which the
        errors of a failed or abandoned round ask for; it ends this
        instance's open round.

        Args:
            group: as for :meth:`MoeAlltoAll.reset` (the survivors, where a
                member exited).

        Raises:
            RuntimeError, ValueError: what :meth:`MoeAlltoAll.reset` raises;
                after :meth:`destroy`.
        """
        self.alltoall.reset(group=group)
        self._tokens_per_rank = None
        self._combine_buffer = None
        self._combined = False

    @property
    def alltoall(self) -> MoeAlltoAll:
        """The :class:`~torch_moe_a2a.MoeAlltoAll` underneath (checkpointing, metainfo).

        Raises:
            RuntimeError: after :meth:`destroy`.
        """
        if self._alltoall is None:
            raise RuntimeError("NVLinkOneSidedAlltoAll has been destroyed")
        return self._alltoall

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: Optional[torch.Tensor] = None,
        *,
        hidden_states_scale: Optional[torch.Tensor] = None,
        max_tokens_per_rank: Optional[int] = None,
        eplb_local_stats: Optional[torch.Tensor] = None,
        active_rank_mask: Optional[torch.Tensor] = None,
    ) -> MoEEpDispatchResult:
        """Send each token to the ranks that own its experts.

        Args:
            hidden_states: ``[local_num_tokens, *]`` token rows (quantized or not).
            topk_ids: ``[local_num_tokens, top_k]`` global expert ids (sent as int32; an
                int64 id beyond int32 is sent as the nearest int32, an invalid id as well).
            topk_weights: ``[local_num_tokens, top_k]`` router weights to forward, or None.
            hidden_states_scale: ``[local_num_tokens, *]`` scale factors of quantized rows, or None.
            max_tokens_per_rank: the most tokens any rank dispatches in this step,
                the same on every rank (None: ``params.max_tokens_per_rank``).
            eplb_local_stats: int32 ``[eplb_stats_num_experts]`` to all-gather, or None.
            active_rank_mask: with ``enable_rank_mask``, the mask of
                :func:`~torch_moe_a2a.moe_a2a_active_rank_mask`; tokens routed
                to a masked-off rank are dropped.

        Returns:
            :class:`MoEEpDispatchResult`, rows ``[s * tokens_per_rank + j]`` from rank ``s``.

        Raises:
            RuntimeError: a dispatch without a combine since the last one
                (where a call failed: its error record, which asks for
                ``alltoall.reset()``); after :meth:`destroy`.
            ValueError: ``max_tokens_per_rank`` not an int in ``(0, params.max_tokens_per_rank]``;
                ``topk_ids`` not an integer tensor; ``hidden_states`` (or a given
                ``hidden_states_scale``, ``topk_weights``) not a tensor with a row
                per row of ``topk_ids``; what :meth:`MoeAlltoAll.dispatch` refuses.
        """
        alltoall = self.alltoall
        if self._tokens_per_rank is not None:
            if alltoall._round_open():
                alltoall._raise_out_of_order(
                    "NVLinkOneSidedAlltoAll.dispatch", "dispatch called twice without an intervening combine; call "
                    "combine to close the open round (a refused combine changed nothing)")
            # A re-initialization (alltoall.reset() after a failed call, checkpoint_restore) ended the round.
            self._tokens_per_rank = None
            self._combine_buffer = None
        limit = self.params.max_tokens_per_rank
        tokens_per_rank = limit if max_tokens_per_rank is None else max_tokens_per_rank
        # A str failed on the comparison below; a float or a bool was refused as runtime_max_tokens_per_rank.
        expect_ints("NVLinkOneSidedAlltoAll.dispatch", max_tokens_per_rank=tokens_per_rank)
        if not 0 < tokens_per_rank <= limit:
            raise ValueError(f"max_tokens_per_rank={tokens_per_rank} must be in (0, {limit}]")
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in ID_DTYPES:
            # A float id would be truncated to another expert by the conversion below.
            raise ValueError(f"topk_ids must be an int32 or int64 tensor, got "
                             f"{getattr(topk_ids, 'dtype', type(topk_ids).__name__)}")
        # By this method's names: MoeAlltoAll's refusals name input_payloads[i], a list this caller never built.
        rows = {"hidden_states": hidden_states, "hidden_states_scale": hidden_states_scale,
                "topk_weights": topk_weights}
        for name, value in rows.items():
            if value is None and name != "hidden_states":
                continue
            expect_tensors("NVLinkOneSidedAlltoAll.dispatch", **{name: value})
            if topk_ids.dim() >= 1 and (value.dim() < 1 or value.shape[0] != topk_ids.shape[0]):
                raise ValueError(f"NVLinkOneSidedAlltoAll.dispatch: {name} must have a row per token, [local_num_tokens"
                                 f"={topk_ids.shape[0]} (topk_ids' rows), *], got shape {tuple(value.shape)}")
        if topk_ids.dtype == torch.int64:
            # Clamped, not wrapped: an id beyond int32 stays an invalid one (at
            # least num_experts, or negative) for the routing and the receivers,
            # where the plain conversion made 2**32 + 1 expert 1. No host sync.
            topk_ids = topk_ids.clamp(-(2**31), 2**31 - 1)
        topk_ids = topk_ids.to(torch.int32)
        payloads = [hidden_states] + ([] if hidden_states_scale is None else [hidden_states_scale])
        ids_index = len(payloads)
        payloads += [topk_ids] + ([] if topk_weights is None else [topk_weights])
        recv = alltoall.dispatch(topk_ids, payloads, tokens_per_rank,
                                 invalid_token_expert_id=self.params.invalid_expert_id,
                                 expert_id_payload_index=ids_index, eplb_local_stats=eplb_local_stats,
                                 active_rank_mask=active_rank_mask)
        self._tokens_per_rank = tokens_per_rank
        self._combined = False
        rows = [view.flatten(0, 1) for view in recv]
        return MoEEpDispatchResult(
            hidden_states=rows[0],
            topk_ids=rows[ids_index],
            topk_weights=None if topk_weights is None else rows[ids_index + 1],
            tokens_per_rank=tokens_per_rank,
            hidden_states_scale=None if hidden_states_scale is None else rows[1],
            eplb_gathered_stats=alltoall.eplb_gathered_stats,
        )

    def get_combine_input_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """``[ep_size * tokens_per_rank, hidden_size]`` view of this rank's
        combine region: expert outputs written into it and passed to
        :meth:`combine` skip the staging copy. Valid until :meth:`combine`.

        Args:
            dtype: the expert outputs' dtype: bf16, fp16 or fp32.

        Returns:
            The view (:meth:`MoeAlltoAll.get_combine_payload_tensor_in_workspace`
            flattened to rows; under ``torch.compile`` a copy, which
            :meth:`combine` stages).

        Raises:
            RuntimeError: before :meth:`dispatch` (or after :meth:`destroy`);
                what :meth:`MoeAlltoAll.get_combine_payload_tensor_in_workspace`
                raises (the workspace released, another instance's dispatch on
                the shared workspace since this one's).
            ValueError: ``dtype`` not bf16, fp16 or fp32.
        """
        if self._tokens_per_rank is None:
            raise RuntimeError("get_combine_input_buffer called before dispatch; call dispatch first (the buffer lies "
                               "where that dispatch puts it)")
        buffer = self.alltoall.get_combine_payload_tensor_in_workspace(
            self._tokens_per_rank, self.params.hidden_size, dtype).flatten(0, 1)
        self._combine_buffer = buffer
        return buffer

    def combine(
        self,
        expert_output: torch.Tensor,
        *,
        output: Optional[torch.Tensor] = None,
        active_rank_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Sum each local token's expert outputs over the ranks it was sent to.

        Args:
            expert_output: ``[ep_size * tokens_per_rank, hidden]`` or ``[ep_size,
                tokens_per_rank, hidden]``, one row per received row, already
                weighted and summed over this rank's experts; the buffer of
                :meth:`get_combine_input_buffer` is read in place.
            output: ``[local_num_tokens, hidden]`` to write into, or None.
            active_rank_mask: the mask given to :meth:`dispatch`.

        Returns:
            ``[local_num_tokens, hidden]``: ``output``, or a new tensor.

        Raises:
            RuntimeError: before :meth:`dispatch`, or a second time after one
                (where a call failed: its error record, which asks for
                ``alltoall.reset()``).
            ValueError: ``expert_output`` not a tensor, neither 2-D nor 3-D, or 2-D with
                another row count than ``ep_size * tokens_per_rank``; what
                :meth:`MoeAlltoAll.combine` refuses.
        """
        alltoall = self.alltoall
        tokens_per_rank = self._tokens_per_rank
        if tokens_per_rank is None:
            alltoall._raise_out_of_order(
                "NVLinkOneSidedAlltoAll.combine",
                "combine called twice after one dispatch: each combine of this class closes its dispatch's round; "
                "dispatch again (MoeAlltoAll.combine allows several combines of one dispatch)" if self._combined else
                "combine called before dispatch; call dispatch first: each combine closes the round of one dispatch")
        expect_tensors("NVLinkOneSidedAlltoAll.combine", expert_output=expert_output)  # else an AttributeError
        if expert_output.dim() not in (2, 3):
            raise ValueError(f"expert_output must be 2D or 3D, got shape {tuple(expert_output.shape)}")
        if expert_output.dim() == 2 and expert_output.shape[0] != self.ep_size * tokens_per_rank:
            # A view of fewer rows (the valid ones only, say) would reshape into another hidden size.
            raise ValueError(f"expert_output must have one row per received row, [ep_size * tokens_per_rank = "
                             f"{self.ep_size * tokens_per_rank}, hidden], got shape {tuple(expert_output.shape)}")
        payload = expert_output.view(self.ep_size, tokens_per_rank, -1) if expert_output.dim() == 2 else expert_output
        in_workspace = self._combine_buffer is not None and expert_output.data_ptr() == self._combine_buffer.data_ptr()
        combined = alltoall.combine(payload, tokens_per_rank, payload_in_workspace=in_workspace, output=output,
                                    use_low_precision=self.config.use_low_precision_combine,
                                    active_rank_mask=active_rank_mask)
        self._tokens_per_rank = None
        self._combine_buffer = None
        self._combined = True
        return combined

    def destroy(self) -> None:
        """Let go of the :class:`~torch_moe_a2a.MoeAlltoAll` (its workspace is
        shared by instances of one geometry and cached process-wide:
        :meth:`MoeAlltoAll.clear_workspace_cache`). Idempotent."""
        self._alltoall = None
        self._tokens_per_rank = None
        self._combine_buffer = None


__all__ = ["BootstrapConfig", "MoEEpCommParams", "MoEEpCommunication", "MoEEpDispatchResult", "NVLinkOneSidedAlltoAll",
           "NVLinkOneSidedConfig", "available_communication_backends", "communication_backend_name",
           "create_communication", "is_communication_backend", "register_communication"]
