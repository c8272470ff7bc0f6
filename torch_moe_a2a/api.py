"""The FlashInfer-compatible public API (DESIGN.md section 2).

Every function here has the parameter names, order, defaults and keyword-only
markers of its ``flashinfer.comm`` namesake, so a user switches by changing the
import. The work is done by the ``torch.ops.moe_a2a`` operators (csrc/schemas.h,
docs/internals.md); this layer

- unpacks the metainfo tensor into the plain ints the ops take, through one
  cached helper that ``torch.compile`` evaluates at trace time
  (:func:`metainfo_values`),
- builds the receive views with ordinary view ops of the workspace from the
  layout arithmetic of :mod:`torch_moe_a2a.layout` (ops never return views),
- checks only what the ops cannot see (the metainfo tensor, the rank-mask
  tensor, FlashInfer's ``output`` checks, options we do not implement); the ops
  validate every argument they receive.

Ownership: the workspace belongs to the caller (or to :class:`MoeAlltoAll`);
every tensor this module returns from dispatch, ``moe_a2a_get_recv_counts``,
``moe_a2a_get_invalid_expert_count`` and ``moe_a2a_wrap_payload_tensor_in_workspace``
is a view of it and stays valid as long as the workspace does. The contents of
the receive views, counts and EPLB stats are only meaningful from the dispatch
that wrote them until this rank's last combine of the round: once it has
started, a peer's next dispatch may overwrite them (DESIGN.md section 5).
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Iterable
from typing import Optional, Sequence, Union

import torch

from . import _C, autograd, layout
from .arguments import (
    ID_DTYPES,
    LAYOUT_LINEAR,
    U64,
    check_flag,
    data_address,
    dispatch_args,
    eplb_length,
    layout_value,
    rank_mask_words,
)
from .backend import MoeAlltoAllBackend, check_backend, pdl_default

# check_errors and describe_error are part of this module's public names too.
from .errors import check_errors, describe_error  # noqa: F401
from .expert_major import moe_a2a_dispatch_expert_major
from .fastpath import (
    BOOL,
    FLOAT,
    INT,
    OPT_TENSOR,
    TENSOR,
    check_output_first,
    direct_call_ok,
    expect_ints,
    expect_tensor_list,
    expect_tensors,
    expect_traced_ints,
    forget_round_tags,
    note_plain_dispatch,
    refuse_combine_after_backward,
    run_dispatch,
    traced_receive_views,
    tracing,
    wants_grad,
    wrong_type,
)
from .layout import MOE_A2A_RANK_MASK_WORDS
from .metainfo import (
    call_timeout,
    check_rank,
    check_rank_index,
    check_rows_contiguous,
    check_timeout,
    metainfo_values,
)

_ops = torch.ops.moe_a2a

# The combine op's low_precision argument (csrc/protocol.h, LowPrecision).
_LOW_PRECISION_OFF, _LOW_PRECISION_E4M3, _LOW_PRECISION_BLOCK_SCALED = 0, 1, 2


class SfLayout(enum.IntEnum):
    """Scale-factor layout of a quantized combine output: FlashInfer's
    ``SfLayout`` (an ``IntEnum`` with the same values; FlashInfer's own members
    and plain ints are understood too).

    Matters only for quantized outputs (``output_scales``): ``layout_linear``
    is row-major ``[local_num_tokens, blocks]``; ``layout_128x4`` and
    ``layout_8x4`` are the swizzled tile layouts of the FP8/FP4 GEMMs
    (csrc/quantize.h states the offsets), their extents padded to whole tiles.
    """

    layout_128x4 = 0
    layout_8x4 = 1
    layout_linear = LAYOUT_LINEAR  # what sf_layout=None means (arguments.layout_value)


# ---------------------------------------------------------------------------
# functional API
# ---------------------------------------------------------------------------


class MoeAlltoAllModule:
    """What :func:`get_moe_alltoall_module` returns: FlashInfer's JIT module's
    sizing entry; its other entries take and return FlashInfer's own metainfo
    and workspace layout, and reading one raises an AttributeError naming
    this package's function instead."""

    # FlashInfer's module entries -> what a caller uses here instead.
    INSTEAD = {
        "moe_a2a_initialize": "torch_moe_a2a.moe_a2a_initialize",
        "moe_a2a_dispatch": "torch_moe_a2a.moe_a2a_dispatch",
        "moe_a2a_combine": "torch_moe_a2a.moe_a2a_combine",
        "moe_a2a_combine_into": "torch_moe_a2a.moe_a2a_combine(..., output=)",
        "moe_a2a_sanitize_expert_ids": "torch_moe_a2a.moe_a2a_sanitize_expert_ids",
        "moe_a2a_get_metainfo_index_pairs": "torch_moe_a2a.layout.META_* (this package's metainfo indices)",
        # An early FlashInfer's name of the combine payload's view in the workspace.
        "moe_a2a_get_combine_payload_tensor": "torch_moe_a2a.moe_a2a_wrap_payload_tensor_in_workspace (or "
                                              "MoeAlltoAll.get_combine_payload_tensor_in_workspace)",
    }

    def moe_a2a_get_aux_data_size(self, ep_size: int, max_num_tokens: int, eplb_stats_num_experts: Optional[int] = 0) -> int:
        """Bytes per rank besides the payload planes, as FlashInfer's entry.

        Args:
            ep_size, max_num_tokens, eplb_stats_num_experts: as for
                :func:`moe_a2a_get_workspace_size_per_rank`.

        Returns:
            What :func:`moe_a2a_get_workspace_size_per_rank` adds to the
            planes' bytes: its value with no payload bytes.

        Raises:
            ValueError: arguments out of range.
        """
        return moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens, 0, 0, eplb_stats_num_experts)

    def __getattr__(self, name: str):
        if name in self.INSTEAD:
            raise AttributeError(f"get_moe_alltoall_module().{name} is an entry of FlashInfer's JIT module, whose "
                                 "arguments and results are FlashInfer's own metainfo and workspace layout; "
                                 f"torch-moe-a2a has none: use {self.INSTEAD[name]}")
        raise AttributeError(f"get_moe_alltoall_module() has no attribute {name!r}")


_MODULE = MoeAlltoAllModule()


def get_moe_alltoall_module(backend: MoeAlltoAllBackend = "trtllm") -> MoeAlltoAllModule:
    """FlashInfer's ``get_moe_alltoall_module``, for its sizing entry
    (``moe_a2a_get_aux_data_size``; FlashInfer's tests size workspaces with
    it). Nothing is compiled or loaded: the operators are registered at import.

    Args:
        backend: ``"trtllm"``; ``"cake"`` is refused as everywhere (:func:`moe_a2a_initialize`).

    Returns:
        The one :class:`MoeAlltoAllModule`.

    Raises:
        ValueError: an unknown backend, or ``"cake"`` off Blackwell.
        NotImplementedError: ``"cake"`` on Blackwell.
    """
    check_backend(backend, None)
    return _MODULE


def _clear_module_cache() -> None:
    """``get_moe_alltoall_module.cache_clear()``, which FlashInfer's function
    has (its module is cached per device) and callers written against it
    call: there is nothing to clear here, the one module is no build."""


get_moe_alltoall_module.cache_clear = _clear_module_cache  # type: ignore[attr-defined]


def moe_a2a_get_workspace_size_per_rank(
    ep_size: int,
    max_num_tokens: int,
    total_dispatch_payload_size_per_token: int,
    combine_payload_size_per_token: int,
    eplb_stats_num_experts: Optional[int] = 0,
    *,
    backend: MoeAlltoAllBackend = "trtllm",
) -> int:
    """Bytes per rank of a workspace for these sizes (a multiple of ``layout.PLANE_ALIGN``, so
    that as the row stride it gives every rank's planes the same alignment).

    Enough for any call with ``runtime_max_tokens_per_rank <= max_num_tokens``,
    any list of up to ``MAX_PAYLOADS`` payloads whose per-token bytes add up to
    ``total_dispatch_payload_size_per_token`` (alignment pads included) and a
    combine row of ``combine_payload_size_per_token`` bytes.

    Args:
        ep_size: ranks in the EP group, 1..``layout.MAX_RANKS`` (64).
        max_num_tokens: the most tokens one rank dispatches in a call,
            1..``layout.MAX_NUM_TOKENS`` (2**24 - 1).
        total_dispatch_payload_size_per_token: bytes of one token's rows over
            all dispatch payloads, in ``[0, MAX_PAYLOADS * 2**28]``.
        combine_payload_size_per_token: bytes of one token's combine payload
            row, in ``[0, 2**28]``.
        eplb_stats_num_experts: length of the EPLB stats a dispatch gathers
            (0 or None: none), in ``[0, 2**26]``.
        backend: ``"trtllm"``; ``"cake"`` is refused as everywhere (:func:`moe_a2a_initialize`).

    Returns:
        The bytes per rank: the ``size_per_rank`` of the workspace
        (:func:`~torch_moe_a2a.allocate_workspace`).

    Raises:
        ValueError: an argument that is not an int (a bool or a float
            included) or is outside its range above; an unknown backend, or
            ``"cake"`` off Blackwell.
        NotImplementedError: ``"cake"`` on Blackwell.
    """
    eplb_stats_num_experts = eplb_length(eplb_stats_num_experts)
    expect_ints("moe_a2a_get_workspace_size_per_rank", ep_size=ep_size, max_num_tokens=max_num_tokens,
                total_dispatch_payload_size_per_token=total_dispatch_payload_size_per_token,
                combine_payload_size_per_token=combine_payload_size_per_token,
                eplb_stats_num_experts=eplb_stats_num_experts)
    check_backend(backend, None)
    return _ops.workspace_size_per_rank.default(
        ep_size,
        max_num_tokens,
        total_dispatch_payload_size_per_token,
        combine_payload_size_per_token,
        eplb_stats_num_experts,
    )


def moe_a2a_initialize(
    workspace: torch.Tensor,
    ep_rank: int,
    ep_size: int,
    max_num_tokens: int,
    eplb_stats_num_experts: Optional[int] = 0,
    *,
    backend: MoeAlltoAllBackend = "trtllm",
    timeout_s: Optional[float] = None,
) -> torch.Tensor:
    """Zero row ``ep_rank`` of ``workspace``, write its header; return the metainfo.

    Local, as in FlashInfer: it touches only this rank's row, so a plain
    ``[ep_size, size_per_rank]`` uint8 tensor can be initialized rank by rank.
    The ranks may initialize in any order, with no barrier before the first
    dispatch, on a zeroed workspace (``allocate_workspace``, ``torch.zeros``),
    and when every rank initializes again after use or after a failure once
    no rank is still inside a call on the workspace (every rank's last call
    returned or raised and its kernels finished: a barrier before
    re-initializing): a rank's first dispatch after initialize writes into a
    peer's row only once that row shows an initialization newer than the one
    this rank last used or saw (the init word, written last; csrc/protocol.h,
    dispatch step 0a). A rank initialized twice with no call in between
    leaves a row that cannot be told from a new one: then also barrier
    between every rank's initialize and the first dispatch
    (:class:`MoeAlltoAll` always does, across processes).

    Args:
        workspace: ``[ep_size, size_per_rank]`` uint8, zeroed before first use.
        ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts: as in
            FlashInfer (``eplb_stats_num_experts=None``: 0, as TensorRT-LLM passes it).
        backend: FlashInfer's backend name; only ``"trtllm"`` is implemented.
        timeout_s: ours, keyword-only: the default bound on the waits of every
            call that passes the returned metainfo (a call's own ``timeout_s``
            overrides it); None: ``MOE_A2A_TIMEOUT_S``, else 30 s.

    Returns:
        A new CPU int64 ``[META_COUNT]`` tensor (layout.META_*), owned by the
        caller and read-only by convention; pass it to every later call for
        this rank. It holds the address of the rank's host error mailbox (CUDA).

    Raises:
        ValueError: bad arguments, a workspace too small, ``timeout_s`` not a
            positive number of seconds up to 1e9.
    """
    expect_tensors("moe_a2a_initialize", workspace=workspace)
    eplb_stats_num_experts = eplb_length(eplb_stats_num_experts)
    expect_ints("moe_a2a_initialize", ep_rank=ep_rank, ep_size=ep_size, max_num_tokens=max_num_tokens,
                eplb_stats_num_experts=eplb_stats_num_experts)
    check_timeout(timeout_s)
    check_backend(backend, workspace)
    mailbox = _ops.alloc_mailbox.default(workspace)
    _ops.initialize.default(workspace, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts, mailbox)
    forget_round_tags(workspace, ep_rank)
    values = [0] * layout.META_COUNT
    values[layout.META_MAGIC] = layout.MAGIC
    values[layout.META_VERSION] = layout.VERSION
    values[layout.META_EP_RANK] = ep_rank
    values[layout.META_EP_SIZE] = ep_size
    values[layout.META_MAX_NUM_TOKENS] = max_num_tokens
    values[layout.META_EPLB_N] = eplb_stats_num_experts
    values[layout.META_SIZE_PER_RANK] = workspace.shape[1]
    values[layout.META_HEADER_BYTES] = layout.HEADER_BYTES
    values[layout.META_MAILBOX_ADDR] = mailbox
    # At least 1 us: 0 means "none".
    values[layout.META_TIMEOUT_US] = 0 if timeout_s is None else max(1, round(timeout_s * 1e6))
    # On the CPU whatever torch.set_default_device (or a `with torch.device(...)`
    # block around model construction) says: the ops read it on the host.
    metainfo = torch.tensor(values, dtype=torch.int64, device="cpu")
    metainfo_values(metainfo, id(metainfo))  # warm the cache
    return metainfo


def moe_a2a_wrap_payload_tensor_in_workspace(
    workspace: torch.Tensor,
    leading_shape: list[int],
    slice_start: int,
    slice_end: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """View bytes ``[slice_start, slice_end)`` of ``workspace`` as ``leading_shape + [-1]`` of ``dtype``.

    As in FlashInfer, the offsets count from the start of the given tensor:
    a 2-D ``[ep_size, size_per_rank]`` workspace (offset ``r *
    workspace.stride(0) + o`` is byte ``o`` of row ``r``: ``r * size_per_rank +
    o`` unless the rows are padded) or one 1-D row (for example
    ``workspace[ep_rank]`` with an offset relative to that row, like
    ``combine_payload_offset``). The slice must lie within one row. The result
    aliases the workspace, except under ``torch.compile``: there it is a copy
    of those bytes, taken when it is wrapped. A traced write into a workspace
    view makes Inductor copy the whole workspace and run the ops that follow
    on that private copy (DESIGN.md section 4), where simulated ranks no longer
    see each other's flags; a write into the copy is an ordinary write, and
    :func:`moe_a2a_combine` under ``torch.compile`` stages the payload it is
    given (``payload_in_workspace=True`` included). Inductor drops the copy
    when the caller overwrites it whole, as with the expert outputs of a
    combine payload.

    Args:
        workspace: the ``[ep_size, size_per_rank]`` uint8 workspace, or one
            1-D row of it.
        leading_shape: the leading dimensions of the result, a list or tuple
            (or ``torch.Size``) of positive ints.
        slice_start, slice_end: the byte range ``[slice_start, slice_end)``,
            counted from the start of ``workspace``.
        dtype: the element type of the result.

    Returns:
        ``[*leading_shape, n]`` of ``dtype``, where ``n`` is the slice's
        bytes over ``dtype``'s size times the product of ``leading_shape``:
        a view of the workspace (valid as long as it is), or under
        ``torch.compile`` a copy of those bytes.

    Raises:
        ValueError: ``workspace`` not a tensor, or neither 2-D uint8 nor one
            1-D uint8 row; ``slice_start`` or ``slice_end`` not an int;
            ``dtype`` not a ``torch.dtype``; ``leading_shape`` not a list of
            positive ints; a workspace whose rows are not contiguous;
            ``slice_start < 0`` or ``slice_end < slice_start``; a slice that
            does not lie within one row; outside
            ``torch.compile``, a slice that is not a whole number of
            ``leading_shape`` rows of ``dtype`` or does not start at an
            address aligned for ``dtype``.
    """
    fn = "moe_a2a_wrap_payload_tensor_in_workspace"
    expect_tensors(fn, workspace=workspace)
    expect_ints(fn, slice_start=slice_start, slice_end=slice_end)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{fn}: dtype must be a torch.dtype, got {dtype!r}")
    if not isinstance(leading_shape, (list, tuple, torch.Size)) or any(
            isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1 for d in leading_shape):
        raise ValueError(f"{fn}: leading_shape must be a list of positive ints, got {leading_shape!r}")
    ws = workspace.unsqueeze(0) if workspace.dim() == 1 else workspace
    if ws.dim() != 2 or ws.dtype != torch.uint8:
        raise ValueError(
            f"workspace must be a uint8 [ep_size, size_per_rank] tensor or one row of it, "
            f"got {workspace.dtype} {tuple(workspace.shape)}"
        )
    check_rows_contiguous(ws, workspace, f"{fn}: ", ", or one row of it")
    length = slice_end - slice_start
    if slice_start < 0 or length < 0:
        raise ValueError(f"invalid slice [{slice_start}, {slice_end})")
    # Not divmod: torch.compile with dynamic=True traces the stride as a SymInt, which divmod refuses.
    rank, start = slice_start // ws.stride(0), slice_start % ws.stride(0)
    if rank >= ws.shape[0] or start + length > ws.shape[1]:
        raise ValueError(
            f"slice [{slice_start}, {slice_end}) does not lie within one row of a "
            f"{tuple(ws.shape)} workspace"
        )
    itemsize, rows = dtype.itemsize, math.prod(leading_shape)
    # Not traced: torch.compile cannot trace storage_offset() (the view below refuses such a slice there).
    if not torch.compiler.is_compiling():
        if length % (itemsize * rows):
            raise ValueError(f"{fn}: slice [{slice_start}, {slice_end}) of {length} bytes is not a whole number of "
                             f"{list(leading_shape)} rows of {dtype}: its length must be a multiple of "
                             f"{rows} x {itemsize} bytes")
        if (ws.storage_offset() + ws.stride(0) * rank + start) % itemsize:
            raise ValueError(f"{fn}: slice [{slice_start}, {slice_end}) does not start at an address aligned for "
                             f"{dtype} ({itemsize}-byte elements)")
    view = ws[rank].narrow(0, start, length).view(dtype).view(*leading_shape, -1)
    return view.clone() if torch.compiler.is_compiling() else view


def moe_a2a_active_rank_mask(active_ranks: Union[Sequence[int], torch.Tensor], ep_size: int) -> torch.Tensor:
    """CPU uint64 ``[MOE_A2A_RANK_MASK_WORDS]`` mask with bit ``r`` set for each active rank ``r``.

    Args:
        active_ranks: the ranks that take part in the next dispatch/combine:
            an iterable of ints (a list, tuple, range, ...) or a 1-D integer
            tensor; each in ``[0, ep_size)``.
        ep_size: the expert-parallel size, an int in ``[1, MAX_RANKS]``.

    Returns:
        The mask, for ``active_rank_mask=`` (with ``enable_rank_mask=True``).

    Raises:
        ValueError: ``ep_size`` not an int in range; ``active_ranks`` neither
            an iterable of ints nor a 1-D integer tensor (a str, a float or a
            bool among the ranks, a tensor of another dtype or shape); a rank
            outside ``[0, ep_size)``.
    """
    if isinstance(ep_size, bool) or not isinstance(ep_size, numbers.Integral):
        raise ValueError(f"ep_size must be an int, got {ep_size!r}")
    if not 1 <= ep_size <= layout.MAX_RANKS:
        raise ValueError(f"ep_size {ep_size} out of range [1, {layout.MAX_RANKS}]")
    if isinstance(active_ranks, torch.Tensor):
        dtype = active_ranks.dtype
        if active_ranks.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise ValueError(f"active_ranks must be a 1-D integer tensor of ranks, got {dtype} "
                             f"{tuple(active_ranks.shape)}")
        active_ranks = active_ranks.tolist()
    elif isinstance(active_ranks, (str, bytes)) or not isinstance(active_ranks, Iterable):
        raise ValueError("active_ranks must be an iterable of int ranks or a 1-D integer tensor, got "
                         f"{type(active_ranks).__name__}")
    mask = 0
    for i, rank in enumerate(active_ranks):
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
            raise ValueError(f"active_ranks[{i}] must be an int rank, got {rank!r}")
        rank = int(rank)
        if not 0 <= rank < ep_size:
            raise ValueError(f"active_ranks[{i}]: rank {rank} out of range [0, {ep_size})")
        mask |= 1 << rank
    words = [(mask >> (64 * w)) & (U64 - 1) for w in range(MOE_A2A_RANK_MASK_WORDS)]
    # The CPU mask the docs promise, whatever the default device.
    return torch.tensor(words, dtype=torch.uint64, device="cpu")


def moe_a2a_dispatch(
    token_selected_experts: torch.Tensor,
    input_payloads: list[torch.Tensor],
    workspace: torch.Tensor,
    metainfo: torch.Tensor,
    runtime_max_tokens_per_rank: int,
    ep_rank: int,
    ep_size: int,
    top_k: int,
    num_experts: int,
    enable_pdl: Optional[bool] = None,
    eplb_local_stats: Optional[torch.Tensor] = None,
    enable_rank_mask: bool = False,
    active_rank_mask: Optional[torch.Tensor] = None,
    *,
    backend: MoeAlltoAllBackend = "trtllm",
    recv_view_cache: Optional[dict] = None,
    timeout_s: Optional[float] = None,
    expert_major: bool = False,
    router_weights: Optional[torch.Tensor] = None,
    max_tokens_per_expert: Optional[int] = None,
):
    """Send each local token's payload rows to every rank that owns one of its experts.

    Args:
        token_selected_experts: int32 or int64 (``torch.topk``'s indices, read
            as they are) ``[local_num_tokens, top_k]``, contiguous, on the
            workspace's device. Negative ids are skipped; ids ``>= num_experts``
            are skipped and counted (:func:`moe_a2a_get_invalid_expert_count`).
        input_payloads: a list or tuple of 1 to 8 contiguous tensors
            ``[local_num_tokens, *]`` of any dtype on the workspace's device
            (``expert_major=True``: 0 to 8).
            If any requires grad under grad mode (eager calls), the call runs
            as :func:`~torch_moe_a2a.moe_a2a_dispatch_differentiable` and
            returns its received rows (new tensors), no EPLB statistics; a
            traced call (torch.compile, make_fx) refuses it (ValueError;
            under ``torch.compile(fullgraph=True)`` the cause of Dynamo's
            ``Unsupported`` error).
        workspace, metainfo: the workspace and this rank's
            :func:`moe_a2a_initialize` result.
        runtime_max_tokens_per_rank: the same on every rank, ``>=
            local_num_tokens`` and ``<= max_num_tokens``; so must the payloads'
            number and row sizes be, and whether ``eplb_local_stats`` is given.
        ep_rank, ep_size: as at initialize. top_k: 1..22. num_experts: which
            maps the ids to ranks, the same on every rank.
        enable_pdl: programmatic dependent launch (None: on for compute capability 9.0+).
        eplb_local_stats: int32 ``[eplb_stats_num_experts]`` to all-gather, or None.
        enable_rank_mask, active_rank_mask: FlashInfer's fault tolerance: with
            ``enable_rank_mask=True`` a mask (:func:`moe_a2a_active_rank_mask`)
            is required; tokens routed to a masked-off rank are dropped.
        backend: ``"trtllm"``.
        recv_view_cache: FlashInfer's opaque cache: pass a dict to reuse the
            views across calls (it holds a reference to ``workspace`` and is
            cleared when another workspace is passed). Not used under
            ``torch.compile``, where views cost nothing at run time.
        timeout_s: ours, keyword-only: the bound on this call's waits for its
            peers, a positive number of seconds up to 1e9; None: the metainfo's
            (``moe_a2a_initialize(timeout_s=)``), else ``MOE_A2A_TIMEOUT_S``,
            else 30 s.
        expert_major, router_weights, max_tokens_per_expert: ours,
            keyword-only: ``expert_major=True`` receives the payloads grouped
            by local expert and returns an
            :class:`~torch_moe_a2a.ExpertMajorDispatch` instead of the tuple
            below (:func:`~torch_moe_a2a.moe_a2a_dispatch_expert_major`, which
            takes the other two; ``recv_view_cache`` is not used then).

    Returns:
        ``(output_payloads, combine_payload_offset, eplb_gathered_stats)``:

        - ``output_payloads[i]``: view ``[ep_size, runtime_max_tokens_per_rank,
          *input_payloads[i].shape[1:]]`` of this rank's workspace row, dtype of
          ``input_payloads[i]``; row ``[s, j]`` is the j-th token received from
          rank ``s`` in increasing source token order; rows ``j >=
          recv_counts[s]`` (:func:`moe_a2a_get_recv_counts`) are padding with
          unspecified contents.
        - ``combine_payload_offset``: byte offset, relative to a rank's row, of
          the combine region for the matching :func:`moe_a2a_combine`.
        - ``eplb_gathered_stats``: int32 ``[ep_size, eplb_stats_num_experts]``
          workspace view (row ``r`` = rank ``r``'s ``eplb_local_stats``) when
          ``eplb_local_stats`` is given, else None.

        The views are the workspace's memory (the caller owns neither): their
        contents are this call's until this rank's last combine of the round
        starts, when a peer's next dispatch may overwrite them. Copy what must
        outlive the combine before calling it. No host sync on CUDA: the call
        is enqueued on the current stream.

    Raises:
        ValueError: an argument out of range or of the wrong type (e.g.
            ``input_payloads`` not a list or tuple of tensors), before any
            kernel runs (the workspace untouched).
        RuntimeError: peers that did not arrive within the timeout, or passed
            another ``runtime_max_tokens_per_rank``, other payloads or another ``num_experts`` (CPU: this
            call; CUDA: the kernel records it and the next call raises, as does
            :func:`check_errors`).
    """
    if expert_major is not False:
        check_flag("expert_major", expert_major)
    if expert_major:
        return moe_a2a_dispatch_expert_major(
            token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank,
            ep_size, top_k, num_experts, router_weights, max_tokens_per_expert, enable_pdl, eplb_local_stats,
            enable_rank_mask, active_rank_mask, backend=backend, timeout_s=timeout_s)
    if router_weights is not None or max_tokens_per_expert is not None:
        raise ValueError("router_weights and max_tokens_per_expert are options of expert_major=True")
    if isinstance(input_payloads, (list, tuple)) and wants_grad("moe_a2a_dispatch", "moe_a2a_dispatch_differentiable",
                                                                 *input_payloads):
        # Eager, payloads that require grad: the differentiable dispatch (autograd.py).
        check_backend(backend, workspace if isinstance(workspace, torch.Tensor) else None)
        return autograd.dispatch_with_grad(
            "moe_a2a_dispatch", token_selected_experts, input_payloads, workspace, metainfo,
            runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts, enable_pdl, eplb_local_stats,
            enable_rank_mask, active_rank_mask, timeout_s)
    if bool in (type(runtime_max_tokens_per_rank), type(top_k), type(num_experts)):  # the op reads True as 1
        expect_ints("moe_a2a_dispatch", runtime_max_tokens_per_rank=runtime_max_tokens_per_rank, top_k=top_k,
                    num_experts=num_experts)
    if recv_view_cache is not None and not isinstance(recv_view_cache, dict):
        raise ValueError(f"moe_a2a_dispatch: recv_view_cache must be a dict or None, got "
                         f"{type(recv_view_cache).__name__}")
    args, call_eplb_n = dispatch_args(
        "moe_a2a_dispatch", token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank,
        ep_rank, ep_size, top_k, num_experts, enable_pdl, eplb_local_stats, enable_rank_mask, active_rank_mask,
        backend, timeout_s)
    if tracing():
        run_dispatch("moe_a2a_dispatch", args, False, True)
        return traced_receive_views(workspace, ep_rank, ep_size, runtime_max_tokens_per_rank, call_eplb_n,
                                     input_payloads)

    # The receive views of this call: regions of this rank's own row.
    cache = recv_view_cache
    hit = None
    if cache is not None:
        if cache.get("_workspace") is not workspace:
            cache.clear()
            cache["_workspace"] = workspace
        # Trailing shapes and dtypes fix every offset of the call.
        try:
            key = (ep_rank, ep_size, runtime_max_tokens_per_rank, call_eplb_n,
                   tuple([(p.shape[1:], p.dtype) for p in input_payloads]))
        except AttributeError:  # a payload that is not a tensor, named (the op would name it too)
            expect_tensor_list("moe_a2a_dispatch", "input_payloads", input_payloads)
            raise
        hit = cache.get(key)
    views = run_dispatch("moe_a2a_dispatch", args, hit is None, False)
    note_plain_dispatch(workspace, ep_rank, token_selected_experts, num_experts)
    if hit is not None:
        return list(hit[0]), hit[1], hit[2]
    output_payloads, combine_offset, eplb_gathered_stats = views
    if cache is not None:
        cache[key] = (tuple(output_payloads), combine_offset, eplb_gathered_stats)
    return output_payloads, combine_offset, eplb_gathered_stats


def moe_a2a_combine(
    payload: torch.Tensor,
    local_num_tokens: int,
    workspace: torch.Tensor,
    metainfo: torch.Tensor,
    runtime_max_tokens_per_rank: int,
    ep_rank: int,
    ep_size: int,
    top_k: int,
    combine_payload_offset: int,
    payload_in_workspace: bool = False,
    output_dtype: Optional[torch.dtype] = None,
    output_scales: Optional[torch.Tensor] = None,
    output_scalar_scale: float = 1.0,
    sf_layout: SfLayout = SfLayout.layout_linear,
    output: Optional[torch.Tensor] = None,
    *,
    use_low_precision: bool = False,
    enable_pdl: Optional[bool] = None,
    enable_rank_mask: bool = False,
    active_rank_mask: Optional[torch.Tensor] = None,
    backend: MoeAlltoAllBackend = "trtllm",
    timeout_s: Optional[float] = None,
    low_precision_block_scales: bool = False,
) -> torch.Tensor:
    """Return every local token's sum of the expert outputs of its destination ranks.

    Args:
        payload: ``[ep_size, runtime_max_tokens_per_rank, *row_shape]`` bf16,
            fp16 or fp32; row ``[s, j]`` is this rank's output for the j-th
            token it received from rank ``s`` (padding rows are ignored). With
            ``payload_in_workspace=True`` it is the view
            ``MoeAlltoAll.get_combine_payload_tensor_in_workspace`` returns,
            read in place; else a contiguous tensor whose valid rows the op
            copies into the workspace. If it requires grad under grad mode
            (eager calls), the call runs as
            :func:`~torch_moe_a2a.moe_a2a_combine_differentiable` with the ids
            of this rank's last dispatch, which must have been one of payloads
            that required grad; a traced call refuses it (ValueError, as
            for dispatch).
        local_num_tokens, runtime_max_tokens_per_rank, top_k,
            combine_payload_offset: those of this rank's preceding dispatch
            (the offset it returned).
        workspace, metainfo, ep_rank, ep_size: as for dispatch.
        payload_in_workspace: whether ``payload`` is the combine region itself.
        output_dtype: the payload dtype (default; bf16 with
            ``use_low_precision``) or bf16; or a quantized output, with
            ``output_scales``: ``torch.float8_e4m3fn`` (MXFP8) or
            ``torch.uint8`` (packed fp4, two elements a byte, the even one in
            the low nibble: MXFP4 or NVFP4 by ``output_scales``' dtype).
        output_scales: for a quantized output, the contiguous tensor the
            block scales are written into: ``torch.uint8`` ue8m0 per 32
            elements (MXFP8, MXFP4) or ``torch.float8_e4m3fn`` per 16 (NVFP4),
            ``sf_layout``'s extent exactly (padding included; the combine
            writes zeros into the padding). The quantized rows need 1-D rows
            of a multiple of the block and a bf16 or fp16 payload (any payload
            with ``use_low_precision``); the sum is rounded to the payload
            dtype (bf16 with ``use_low_precision``) and then quantized
            (csrc/quantize.h).
        output_scalar_scale: NVFP4's global scale (> 0); its value is ignored
            otherwise, but it must be a real number in every call.
        sf_layout: the layout of ``output_scales`` (:class:`SfLayout`; None reads as ``layout_linear``, as
            in FlashInfer).
        output: a contiguous ``[local_num_tokens, *row_shape]`` tensor of
            ``output_dtype`` (``[local_num_tokens, hidden // 2]`` for packed
            fp4, 16-byte aligned when quantized) on the workspace's device to
            write into, or None.
        use_low_precision: each rank converts its expert outputs to e4m3
            (round to nearest even, saturating at +-448) in the workspace
            before the peers pull them (half the bytes of bf16 on the link);
            the sums are fp32 and the output bf16 (or quantized). Every
            rank's combine of a round must agree on it, on
            ``low_precision_block_scales`` and on the payload's dtype and row
            shape (the peers read this rank's rows in that form): on the
            CPU a rank whose dtype, row size or transport differs makes every
            rank's combine raise RuntimeError, naming the peers; on CUDA it
            is not detected (the check would cost the small combines 0.2-1
            us) and gives wrong sums. The output format may differ between
            ranks.
        enable_pdl, enable_rank_mask, active_rank_mask, backend, timeout_s: as for dispatch.
        low_precision_block_scales: with ``use_low_precision``, every 128
            elements of a row travel with a power-of-two scale (the smallest
            that keeps the block within +-448), so that rows beyond e4m3's
            range keep e4m3's relative precision: elements within about
            2^14 of their block's largest do; smaller ones lose mantissa bits
            and, below about 2^-18 of it, round to zero (an inf makes the
            block's other elements zero). docs/internals.md, 'Low precision
            and quantized outputs', has the measured error.

    Returns:
        ``[local_num_tokens, *row_shape]`` of ``output_dtype``: for each token
        the fp32 sum, in ascending rank order, of its rows from the distinct
        ranks it was sent to, cast once (or quantized); zeros for a token sent
        nowhere. A new tensor the caller owns, or ``output``. Enqueued on the
        current stream (no host sync on CUDA).

    Raises:
        ValueError: arguments out of range or of the wrong type (an
            ``output_scalar_scale`` that is no real number), bad combinations (a quantized
            ``output_dtype`` without ``output_scales`` or with scales of
            another dtype or extent, rows the block does not divide), or
            sizes and offset that are not those of the preceding dispatch
            (on the CPU, at once; on CUDA the kernel refuses the call and
            records it, and this rank's next call raises RuntimeError).
        RuntimeError: peers that did not arrive within the timeout (as for dispatch).
    """
    if not (isinstance(payload, torch.Tensor) and isinstance(workspace, torch.Tensor)):
        expect_tensors("moe_a2a_combine", payload=payload, workspace=workspace)  # as in dispatch_args
    if output is not None:
        check_output_first("moe_a2a_combine", output, workspace)
    check_backend(backend, workspace)
    if use_low_precision is not False and use_low_precision is not True:  # 'no' would read as yes
        check_flag("moe_a2a_combine: use_low_precision", use_low_precision)
    if low_precision_block_scales is not False and low_precision_block_scales is not True:
        check_flag("moe_a2a_combine: low_precision_block_scales", low_precision_block_scales)
    if wants_grad("moe_a2a_combine", "moe_a2a_combine_differentiable", payload):
        # Eager, a payload that requires grad: the differentiable combine (autograd.py).
        return autograd.combine_with_grad(
            "moe_a2a_combine", payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank,
            ep_size, top_k, combine_payload_offset, enable_pdl, enable_rank_mask, active_rank_mask, timeout_s,
            payload_in_workspace=payload_in_workspace, output=output is not None,
            output_dtype=output_dtype is not None and output_dtype != payload.dtype,
            output_scales=output_scales is not None, use_low_precision=bool(use_low_precision),
            low_precision_block_scales=bool(low_precision_block_scales))
    # By value, so FlashInfer's own SfLayout (or a plain int) is understood too.
    sf_layout = layout_value(sf_layout)
    if bool in (type(local_num_tokens), type(runtime_max_tokens_per_rank), type(top_k),
                type(combine_payload_offset)):  # the op reads True as 1
        expect_ints("moe_a2a_combine", local_num_tokens=local_num_tokens,
                    runtime_max_tokens_per_rank=runtime_max_tokens_per_rank, top_k=top_k,
                    combine_payload_offset=combine_payload_offset)
    if output_dtype is not None and not isinstance(output_dtype, torch.dtype):
        raise ValueError(f"moe_a2a_combine: output_dtype must be a torch.dtype or None, got {output_dtype!r}")
    if type(output_scalar_scale) is not float:  # the usual float costs one test
        output_scalar_scale = _scalar_scale("moe_a2a_combine", output_scalar_scale)
    if low_precision_block_scales and not use_low_precision:
        raise ValueError("low_precision_block_scales=True requires use_low_precision=True")
    low_precision = (_LOW_PRECISION_BLOCK_SCALED if low_precision_block_scales else
                     _LOW_PRECISION_E4M3 if use_low_precision else _LOW_PRECISION_OFF)
    meta = metainfo_values(metainfo, id(metainfo))
    check_rank(meta, ep_rank, ep_size, workspace)
    # Traced (torch.compile, or a dispatch mode such as FakeTensorMode, whose
    # tensors have no data pointer to compare): as described below.
    compiling = tracing()
    refuse_combine_after_backward("moe_a2a_combine", workspace, ep_rank, compiling)
    _, _, max_num_tokens, _, _, mailbox, _ = meta
    timeout_s = call_timeout(meta, timeout_s)
    mask = rank_mask_words(enable_rank_mask, active_rank_mask)
    if enable_pdl is None:
        enable_pdl = pdl_default(workspace)
    # `output`'s shape and dtype are checked by the op (check_combine).
    staged = payload
    if payload_in_workspace and not compiling:
        _check_payload_in_workspace(payload, workspace, ep_rank, ep_size, runtime_max_tokens_per_rank,
                                    combine_payload_offset)
        staged = None
    # Traced, the payload is always handed to the op, which stages it: a traced
    # graph cannot check that it is the combine region, and
    # moe_a2a_wrap_payload_tensor_in_workspace gives a copy of the region there
    # (DESIGN.md section 4: a traced write into a workspace view makes
    # Inductor copy the whole workspace). When it is the region after all,
    # the kernels skip the copy of a region onto itself.
    row_shape = payload.shape[2:]
    if output_dtype is None:
        output_dtype = torch.bfloat16 if use_low_precision else payload.dtype
    args = (
        staged,
        local_num_tokens,
        workspace,
        ep_rank,
        ep_size,
        max_num_tokens,
        runtime_max_tokens_per_rank,
        top_k,
        combine_payload_offset,
        row_shape,
        payload.dtype,
        output_dtype,
        mask,
        timeout_s,
        mailbox,
        enable_pdl,
        low_precision,
        output_scales,
        output_scalar_scale,
        sf_layout,
    )
    if not compiling and direct_call_ok(workspace, payload, output, output_scales):
        try:
            return _C.combine(*args, output)
        except TypeError as e:
            raise wrong_type("moe_a2a_combine", e, payload=(payload, TENSOR), workspace=(workspace, TENSOR),
                              local_num_tokens=(local_num_tokens, INT),
                              runtime_max_tokens_per_rank=(runtime_max_tokens_per_rank, INT),
                              ep_rank=(ep_rank, INT), ep_size=(ep_size, INT), top_k=(top_k, INT),
                              combine_payload_offset=(combine_payload_offset, INT), output=(output, OPT_TENSOR),
                              output_scales=(output_scales, OPT_TENSOR),
                              timeout_s=(timeout_s, FLOAT), enable_pdl=(enable_pdl, BOOL)) from None
    if output is None:
        return _ops.combine.default(*args)
    _ops.combine_into.default(*args, output)
    return output


def _scalar_scale(fn: str, value) -> float:
    """``output_scalar_scale`` as a float: a real number (an int, a numpy
    float, a one-element tensor) converts; None, a bool or a string does not,
    though ``float()`` would read ``True`` and ``"2"`` as scales and raise a
    TypeError that names neither the function nor the argument for None.

    Raises:
        ValueError: ``value`` is not a real number.
    """
    if value is None or isinstance(value, (bool, str, bytes)):
        raise ValueError(f"{fn}: output_scalar_scale (NVFP4's global scale) must be a float, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several elements
        raise ValueError(f"{fn}: output_scalar_scale (NVFP4's global scale) must be a float, got "
                         f"{value!r}") from None


def _check_payload_in_workspace(
    payload: torch.Tensor,
    workspace: torch.Tensor,
    ep_rank: int,
    ep_size: int,
    runtime_max: int,
    combine_payload_offset: int,
) -> None:
    """payload_in_workspace=True: ``payload`` must be the combine region view of this rank's row."""
    expected = workspace.data_ptr() + ep_rank * workspace.stride(0) + combine_payload_offset
    if (
        data_address(payload) != expected
        or payload.dim() < 2
        or tuple(payload.shape[:2]) != (ep_size, runtime_max)
        or not payload.is_contiguous()
    ):
        raise ValueError(
            "payload_in_workspace=True requires payload to be the contiguous [ep_size, "
            "runtime_max_tokens_per_rank, ...] view of this rank's workspace row at "
            "combine_payload_offset: moe_a2a_wrap_payload_tensor_in_workspace(workspace[ep_rank], "
            "[ep_size, runtime_max_tokens_per_rank], combine_payload_offset, combine_payload_offset + its bytes, "
            "dtype) gives it, MoeAlltoAll.get_combine_payload_tensor_in_workspace with the class"
        )


def moe_a2a_sanitize_expert_ids(
    expert_ids: torch.Tensor,
    workspace: torch.Tensor,
    metainfo: torch.Tensor,
    ep_rank: int,
    invalid_expert_id: int,
    enable_pdl: Optional[bool] = None,
    *,
    backend: MoeAlltoAllBackend = "trtllm",
) -> None:
    """Write ``invalid_expert_id`` into the padding rows of a received expert-id view, in place.

    expert_ids: the int32 ``[ep_size, runtime_max_tokens_per_rank, width]``
    view that :func:`moe_a2a_dispatch` returned for an int32 (or int64)
    payload of any width (usually the ``top_k`` expert ids; it must alias
    this rank's row). Rows ``[s, j]`` with ``j >= recv_counts[s]``
    get ``invalid_expert_id`` in every column; valid rows are untouched.

    Args:
        expert_ids: the receive view, as above: contiguous int32 or int64
            ``[ep_size, runtime_max_tokens_per_rank, width]``.
        workspace, metainfo: the workspace and this rank's
            :func:`moe_a2a_initialize` result.
        ep_rank: this rank; must be the metainfo's.
        invalid_expert_id: the id written into the padding rows; must fit
            in ``expert_ids``' dtype.
        enable_pdl: programmatic dependent launch (None: on for compute capability 9.0+).
        backend: ``"trtllm"``.

    Returns:
        None; ``expert_ids`` is written in place. Enqueued on the current
        stream (no host sync on CUDA).

    Raises:
        ValueError: ``expert_ids`` or ``workspace`` not a tensor, or
            ``workspace`` not a ``[ep_size, size_per_rank]`` uint8 workspace; a
            ``metainfo`` that is not :func:`moe_a2a_initialize`'s; ``ep_rank``
            other than the metainfo's; ``expert_ids`` not a contiguous 3-D
            int32 or int64 tensor, its first dimension not the metainfo's
            ``ep_size`` or its second not in ``[1, max_num_tokens]``;
            ``expert_ids`` not a view of ``workspace`` (under
            ``torch.compile``: not a receive view returned by
            :func:`moe_a2a_dispatch`) or not within this rank's row;
            ``invalid_expert_id`` not an int, or outside the ids' dtype (int32 or int64); an unknown
            backend, or ``"cake"`` off Blackwell. CPU also: a row initialized
            with other sizes than the metainfo's; ``expert_ids`` with another
            ``runtime_max_tokens_per_rank`` than this rank's last dispatch
            (as a view kept from an earlier round may have) or outside that
            dispatch's planes, or no dispatch since initialize (which plane
            of the dispatch it is, is not checked).
        RuntimeError: CPU: this rank's row not initialized. Both: an
            earlier call's error record on it. CUDA: where ``expert_ids``
            does not fit the last dispatch, as above, the kernel writes
            nothing and records the error, which this rank's next call
            raises (the workspace stays failed until
            :func:`moe_a2a_initialize`).
        NotImplementedError: ``"cake"`` on Blackwell.
    """
    expect_tensors("moe_a2a_sanitize_expert_ids", expert_ids=expert_ids, workspace=workspace)
    check_backend(backend, workspace)
    meta = metainfo_values(metainfo, id(metainfo))
    if meta[0] != ep_rank:
        raise ValueError(f"moe_a2a_sanitize_expert_ids: ep_rank {ep_rank!r} does not match the metainfo's ep_rank "
                         f"{meta[0]}")
    if type(invalid_expert_id) is not int:  # else the op reads True as 1
        expect_traced_ints("moe_a2a_sanitize_expert_ids", invalid_expert_id=invalid_expert_id)
    if expert_ids.dim() != 3 or expert_ids.dtype not in ID_DTYPES or not expert_ids.is_contiguous():
        raise ValueError(
            "expert_ids must be the contiguous int32 or int64 [ep_size, runtime_max_tokens_per_rank, width] "
            f"view returned by moe_a2a_dispatch, got {expert_ids.dtype} {tuple(expert_ids.shape)}"
        )
    if type(invalid_expert_id) is int:
        # Checked here for int64 ids too: an int outside int64 would fail the
        # op's schema with a message that names neither the argument nor its range.
        info = torch.iinfo(expert_ids.dtype)
        if not info.min <= invalid_expert_id <= info.max:
            raise ValueError(f"moe_a2a_sanitize_expert_ids: invalid_expert_id must fit in the ids' dtype "
                             f"{expert_ids.dtype} ([{info.min}, {info.max}]), got {invalid_expert_id}")
    _, ep_size, max_num_tokens, _, _, mailbox, _ = meta
    if expert_ids.shape[0] != ep_size or not 1 <= expert_ids.shape[1] <= max_num_tokens:
        raise ValueError(
            f"expert_ids must be [ep_size ({ep_size}), runtime_max_tokens_per_rank (1..max_num_tokens = "
            f"{max_num_tokens}), width], got {tuple(expert_ids.shape)}"
        )
    if torch.compiler.is_compiling():
        # Dynamo cannot read storage_offset(); dispatch tagged its views with
        # the offset it built them at.
        offset = getattr(expert_ids, "_moe_a2a_row_offset", None)
        if offset is None:
            raise ValueError("under torch.compile, expert_ids must be a receive view returned by moe_a2a_dispatch")
    else:
        if expert_ids.untyped_storage().data_ptr() != workspace.untyped_storage().data_ptr():
            raise ValueError("expert_ids must be a view of the workspace returned by moe_a2a_dispatch")
        # Byte offset of the plane within the own row (the workspace is uint8:
        # its offsets and strides are bytes).
        row_start = workspace.storage_offset() + ep_rank * workspace.stride(0)
        offset = expert_ids.storage_offset() * expert_ids.element_size() - row_start
        # Checked here, naming expert_ids: the op sees only the offset, an
        # argument this function's caller never passes.
        if offset < 0 or offset + expert_ids.numel() * expert_ids.element_size() > workspace.shape[1]:
            raise ValueError(f"moe_a2a_sanitize_expert_ids: expert_ids must lie within rank {ep_rank}'s row of the "
                             "workspace (a receive view of this rank's moe_a2a_dispatch); it starts at byte "
                             f"{offset} of that {workspace.shape[1]}-byte row and holds "
                             f"{expert_ids.numel() * expert_ids.element_size()} bytes")
    if enable_pdl is None:
        enable_pdl = pdl_default(workspace)
    _ops.sanitize_expert_ids.default(
        workspace,
        ep_rank,
        expert_ids.shape[0],
        max_num_tokens,
        expert_ids.shape[1],
        offset,
        expert_ids.shape[2],
        invalid_expert_id,
        expert_ids.element_size(),
        mailbox,
        enable_pdl,
    )


def local_expert_range(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The experts rank ``ep_rank`` owns: the split dispatch routes by.

    Contiguous ranges (docs/DESIGN.md section 3): the first ``num_experts %
    ep_size`` ranks own ``num_experts // ep_size + 1`` experts, the rest one
    fewer: ``expert_to_rank`` of csrc/protocol.h, which every dispatch test
    checks through the reference's routes.

    Args:
        num_experts: experts in all, ``>= ep_size``.
        ep_size: ranks, 1..64.
        ep_rank: the rank, in ``[0, ep_size)``.

    Returns:
        ``range(first, last)`` of global expert ids; local expert ``i`` is
        global expert ``first + i``.

    Raises:
        ValueError: arguments out of range.
    """
    expect_ints("local_expert_range", num_experts=num_experts, ep_size=ep_size, ep_rank=ep_rank)
    if not 1 <= ep_size <= layout.MAX_RANKS or num_experts < ep_size or not 0 <= ep_rank < ep_size:
        raise ValueError(f"local_expert_range: need 1 <= ep_size <= {layout.MAX_RANKS}, num_experts >= ep_size and "
                         f"0 <= ep_rank < ep_size, got num_experts={num_experts}, ep_size={ep_size}, ep_rank={ep_rank}")
    return range(*layout.expert_range(num_experts, ep_size, ep_rank))


def moe_a2a_get_recv_counts(workspace: torch.Tensor, metainfo: torch.Tensor, ep_rank: int) -> torch.Tensor:
    """int32 ``[ep_size]`` view of rank ``ep_rank``'s header: ``[s]`` = rows received from rank ``s``
    by the last dispatch (0 for masked-off ranks).

    Args:
        workspace, metainfo: the workspace and a rank's :func:`moe_a2a_initialize` result.
        ep_rank: the rank whose counts to view, any rank of the workspace.

    Returns:
        The view (not a copy: the next dispatch writes into it), valid as
        long as the workspace is; its values are those of rank ``ep_rank``'s
        last dispatch until that rank's last combine of the round starts.

    Raises:
        ValueError: ``workspace`` not a tensor, or not the metainfo's
            ``[ep_size, size_per_rank]``; a ``metainfo`` that is not
            :func:`moe_a2a_initialize`'s; ``ep_rank`` outside ``[0, ep_size)``
            (a bool included).
    """
    expect_tensors("moe_a2a_get_recv_counts", workspace=workspace)
    meta = metainfo_values(metainfo, id(metainfo))
    check_rank_index(meta, ep_rank, workspace)
    return layout.region_view(workspace[ep_rank], layout.HDR_RECV_COUNTS, (meta[1],), torch.int32)


def moe_a2a_get_invalid_expert_count(workspace: torch.Tensor, metainfo: torch.Tensor, ep_rank: int) -> torch.Tensor:
    """0-d int64 view of rank ``ep_rank``'s header: expert ids ``>= num_experts`` its dispatches
    skipped since ``moe_a2a_initialize``.

    Args:
        workspace, metainfo: the workspace and a rank's :func:`moe_a2a_initialize` result.
        ep_rank: the rank whose count to view, any rank of the workspace.

    Returns:
        The view (not a copy: later dispatches add to it), valid as long as
        the workspace is.

    Raises:
        ValueError: ``workspace`` not a tensor, or not the metainfo's
            ``[ep_size, size_per_rank]``; a ``metainfo`` that is not
            :func:`moe_a2a_initialize`'s; ``ep_rank`` outside ``[0, ep_size)``
            (a bool included).
    """
    expect_tensors("moe_a2a_get_invalid_expert_count", workspace=workspace)
    check_rank_index(metainfo_values(metainfo, id(metainfo)), ep_rank, workspace)
    return layout.region_view(workspace[ep_rank], layout.HDR_INVALID_EXPERT_COUNT, (), torch.int64)

