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

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

import torch

from .api import moe_a2a_get_workspace_size_per_rank
from .arguments import ID_DTYPES
from .fastpath import expect_ints, expect_tensors
from .mapping import Mapping
from .moe_alltoall import MoeAlltoAll


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
    ``kernel`` (the field newer FlashInfer added, second as there) is the
    :class:`~torch_moe_a2a.MoeAlltoAll` ``backend``: ``"trtllm"``;
    ``"cake"`` is refused as ``backend="cake"`` is.
    """

    backend_name: str = "nvlink_one_sided"
    kernel: str = "trtllm"
    extra_payload_bytes_per_token: int = 0
    eplb_stats_num_experts: int = 0
    enable_rank_mask: bool = False
    use_low_precision_combine: bool = False
    comm_backend: Any = None


class NVLinkOneSidedAlltoAll:
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
            ``extra_payload_bytes_per_token``, a communicator of another rank
            or size, or what :class:`~torch_moe_a2a.MoeAlltoAll` refuses.
    """

    backend_name: ClassVar[str] = "nvlink_one_sided"
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
        self.bootstrap = bootstrap
        self.params = params
        self.ep_rank = int(bootstrap.rank)
        self.ep_size = int(bootstrap.world_size)
        if params.num_experts % self.ep_size != 0:
            raise ValueError(f"NVLinkOneSidedAlltoAll requires num_experts ({params.num_experts}) divisible by the "
                             f"EP size ({self.ep_size})")
        self.num_local_experts = params.num_experts // self.ep_size
        expect_ints("NVLinkOneSidedConfig", extra_payload_bytes_per_token=self.config.extra_payload_bytes_per_token,
                    eplb_stats_num_experts=self.config.eplb_stats_num_experts)
        if self.config.extra_payload_bytes_per_token < 0:
            raise ValueError("extra_payload_bytes_per_token must be non-negative")
        # FlashInfer's config before its `kernel` field has none: the default kernels.
        self.alltoall_backend = getattr(self.config, "kernel", NVLinkOneSidedAlltoAll.alltoall_backend)
        comm = self.config.comm_backend
        if comm is None:
            comm = getattr(bootstrap, "process_group", None)  # None: MoeAlltoAll takes the default group
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
        )
        self._tokens_per_rank: Optional[int] = None
        self._combine_buffer: Optional[torch.Tensor] = None

    @classmethod
    def is_platform_supported(cls) -> bool:
        """True: the workspace lives in CUDA virtual memory shared over NVLink or
        between processes of one host, or in CPU shared memory."""
        return True

    def is_workload_feasible(self, max_tokens_per_rank: int) -> bool:
        """Whether a step whose busiest rank dispatches ``max_tokens_per_rank`` tokens fits the workspace."""
        return max_tokens_per_rank <= self.params.max_tokens_per_rank

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
            RuntimeError: before :meth:`dispatch` (where a call failed: its
                error record, which asks for ``alltoall.reset()``).
            ValueError: ``expert_output`` not a tensor, neither 2-D nor 3-D, or 2-D with
                another row count than ``ep_size * tokens_per_rank``; what
                :meth:`MoeAlltoAll.combine` refuses.
        """
        alltoall = self.alltoall
        tokens_per_rank = self._tokens_per_rank
        if tokens_per_rank is None:
            alltoall._raise_out_of_order("NVLinkOneSidedAlltoAll.combine", "combine called before dispatch; call "
                                         "dispatch first: each combine closes the round of one dispatch")
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
        return combined

    def destroy(self) -> None:
        """Let go of the :class:`~torch_moe_a2a.MoeAlltoAll` (its workspace is
        shared by instances of one geometry and cached process-wide:
        :meth:`MoeAlltoAll.clear_workspace_cache`). Idempotent."""
        self._alltoall = None
        self._tokens_per_rank = None
        self._combine_buffer = None


__all__ = ["BootstrapConfig", "MoEEpCommParams", "MoEEpDispatchResult", "NVLinkOneSidedAlltoAll",
           "NVLinkOneSidedConfig"]
