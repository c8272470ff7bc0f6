"""The expert-major receive layout (docs/DESIGN.md, 'Expert-major layout'):
dispatch into ``[num_local_experts, max_tokens_per_expert, *]`` workspace
views with per-expert counts, ready for a grouped GEMM, and the weighted
combine from that layout.

Two operators: ``dispatch_expert_major`` (the rank-major dispatch of the user
payloads, the expert ids and the router weights as payloads, then
``expert_major_build``, a local pass that regroups the received rows by local
expert, deterministically, in the own row; on CUDA a small call writes each
pair's row into its expert-major row in one kernel instead, with the same
result) and ``combine_expert_major`` (the combine protocol, pulling each
(token, expert) pair's row through the pair map of the expert's rank).
Everything runs on the device, on the current stream: no host sync,
CUDA-graph capturable, traceable by ``torch.compile``.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import torch

from . import layout
from .arguments import ID_DTYPES, data_address, dispatch_args, rank_mask_words
from .backend import MoeAlltoAllBackend, check_backend, pdl_default
from .fastpath import (
    check_output_first,
    expect_ints,
    expect_tensor_list,
    expect_tensors,
    note_plain_dispatch,
    refuse_combine_after_backward,
    tracing,
    wants_grad,
)
from .metainfo import call_timeout, check_rank, check_rank_index, metainfo_values

_ops = torch.ops.moe_a2a


class ExpertMajorDispatch(NamedTuple):
    """What an expert-major dispatch returns; pass it whole to :func:`moe_a2a_combine_expert_major`.

    Every tensor is a view of this rank's workspace row, valid until this
    rank's last combine of the round starts (as the rank-major receive views).

    Attributes:
        output_payloads: per input payload, ``[num_local_experts,
            max_tokens_per_expert, *payload.shape[1:]]`` of its dtype: row
            ``[e, i]`` (``i < expert_counts[e]``) is the payload row of the
            i-th (token, top-k slot) pair routed to local expert ``e``, pairs
            ordered by source rank, then source token index, then top-k slot.
            Rows ``i >= expert_counts[e]`` are padding (unspecified).
        expert_counts: int32 ``[num_local_experts]``: valid rows per expert.
        local_expert_ids: int32 ``[num_local_experts, max_tokens_per_expert]``:
            ``e`` in every valid row of expert ``e``, -1 in padding rows.
        router_weights: fp32 ``[num_local_experts, max_tokens_per_expert]``:
            the pair's router weight (0 in padding rows), or None when the
            dispatch was given none.
        combine_payload_offset: byte offset (relative to a row) of the
            expert-major combine region ``[num_local_experts,
            max_tokens_per_expert, *]``.
        eplb_gathered_stats: as for the rank-major dispatch.
        local_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts,
            max_tokens_per_expert, dispatch_end: the call's sizes, for the combine
            (``dispatch_end``: the rank-major layout's end, where the
            expert-major regions begin).
    """

    output_payloads: list[torch.Tensor]
    expert_counts: torch.Tensor
    local_expert_ids: torch.Tensor
    router_weights: Optional[torch.Tensor]
    combine_payload_offset: int
    eplb_gathered_stats: Optional[torch.Tensor]
    local_num_tokens: int
    runtime_max_tokens_per_rank: int
    top_k: int
    num_experts: int
    max_tokens_per_expert: int
    dispatch_end: int


def default_max_tokens_per_expert(ep_size: int, runtime_max_tokens_per_rank: int, top_k: int,
                                  num_experts: int) -> int:
    """The default rows per local expert: the most pairs one expert can get
    when each token names distinct experts, every token of every rank
    (``ep_size * runtime_max_tokens_per_rank``); with fewer experts than
    ``top_k``, where no token can, every slot of every token (``ep_size *
    runtime_max_tokens_per_rank * top_k``), so that the default drops no pair."""
    per_token = top_k if num_experts < top_k else 1
    return ep_size * runtime_max_tokens_per_rank * per_token


def default_rows_per_expert(ep_size: int, runtime_max_tokens_per_rank: int, max_num_tokens: int, top_k: int,
                            num_experts: int) -> int:
    """:func:`default_max_tokens_per_expert` of a dispatch given no
    ``max_tokens_per_expert``, after checking ``runtime_max_tokens_per_rank``:
    the default is ``ep_size`` times it, whose error would name
    ``max_tokens_per_expert``."""
    if not isinstance(runtime_max_tokens_per_rank, numbers.Integral) or isinstance(runtime_max_tokens_per_rank, bool) \
            or not 1 <= runtime_max_tokens_per_rank <= max_num_tokens:
        raise ValueError(f"runtime_max_tokens_per_rank must be an int in [1, max_num_tokens={max_num_tokens}], "
                         f"got {runtime_max_tokens_per_rank!r}")
    return _default_within_limit(ep_size, int(runtime_max_tokens_per_rank), top_k, num_experts,
                                 "ep_size * runtime_max_tokens_per_rank")


def _default_within_limit(ep_size: int, tokens: int, top_k: int, num_experts: int, what: str) -> int:
    """:func:`default_max_tokens_per_expert`, refused where it passes the
    layout's rows per expert: the op's error would name
    ``max_tokens_per_expert``, which the caller never passed. Other bad sizes
    are left to the op's checks."""
    rows = default_max_tokens_per_expert(ep_size, tokens, top_k, num_experts)
    if type(ep_size) is int and type(num_experts) is int and 1 <= ep_size <= num_experts:
        local = layout.max_local_experts(num_experts, ep_size)
        limit = layout.MAX_EXPERT_MAJOR_ROWS // local
        if local <= layout.MAX_LOCAL_EXPERTS and rows > limit:
            times_top_k = " * top_k" if num_experts < top_k else ""
            raise ValueError(f"max_tokens_per_expert was not given, and its default, {what}{times_top_k} = {rows}, "
                             f"is more than the {limit} rows per expert the layout holds with {local} experts per "
                             f"rank: pass max_tokens_per_expert <= {limit} (pairs beyond it are dropped and counted)")
    return rows


def moe_a2a_get_workspace_size_per_rank_expert_major(
    ep_size: int,
    max_num_tokens: int,
    total_dispatch_payload_size_per_token: int,
    combine_payload_size_per_token: int,
    num_experts: int,
    top_k: int,
    max_tokens_per_expert: Optional[int] = None,
    eplb_stats_num_experts: int = 0,
    *,
    backend: MoeAlltoAllBackend = "trtllm",
) -> int:
    """Bytes per rank of a workspace for expert-major calls (a multiple of ``layout.PLANE_ALIGN``).

    Args:
        ep_size, max_num_tokens, eplb_stats_num_experts: as for
            :func:`~torch_moe_a2a.moe_a2a_get_workspace_size_per_rank`.
        total_dispatch_payload_size_per_token: bytes per token of the user
            payloads (the expert ids, up to int64, and fp32 router weights
            that the expert-major dispatch adds are counted here).
        combine_payload_size_per_token: bytes of an expert-output row.
        num_experts, top_k: of the calls.
        max_tokens_per_expert: rows per local expert; default the worst case
            with distinct experts per token, ``ep_size * max_num_tokens``
            (times ``top_k`` with fewer experts than ``top_k``:
            :func:`default_max_tokens_per_expert`).

    Returns:
        Enough for any expert-major call with ``runtime_max_tokens_per_rank <=
        max_num_tokens``, ``top_k`` or fewer experts per token and
        ``max_tokens_per_expert`` or fewer rows per expert (its default
        included), and for any rank-major call of the same payloads.

    Raises:
        ValueError: arguments out of range.
    """
    expect_ints("moe_a2a_get_workspace_size_per_rank_expert_major", ep_size=ep_size, max_num_tokens=max_num_tokens,
                total_dispatch_payload_size_per_token=total_dispatch_payload_size_per_token,
                combine_payload_size_per_token=combine_payload_size_per_token, num_experts=num_experts, top_k=top_k,
                eplb_stats_num_experts=eplb_stats_num_experts,
                **({} if max_tokens_per_expert is None else {"max_tokens_per_expert": max_tokens_per_expert}))
    check_backend(backend, None)
    if max_tokens_per_expert is None:
        max_tokens_per_expert = _default_within_limit(ep_size, max_num_tokens, top_k, num_experts,
                                                      "ep_size * max_num_tokens")
    return _ops.expert_major_workspace_size_per_rank.default(
        ep_size, max_num_tokens, total_dispatch_payload_size_per_token, combine_payload_size_per_token,
        eplb_stats_num_experts, num_experts, top_k, max_tokens_per_expert)


def _row_bytes(t: torch.Tensor) -> int:
    return t.element_size() * math.prod(t.shape[1:])


def moe_a2a_dispatch_expert_major(
    token_selected_experts: torch.Tensor,
    input_payloads: list[torch.Tensor],
    workspace: torch.Tensor,
    metainfo: torch.Tensor,
    runtime_max_tokens_per_rank: int,
    ep_rank: int,
    ep_size: int,
    top_k: int,
    num_experts: int,
    router_weights: Optional[torch.Tensor] = None,
    max_tokens_per_expert: Optional[int] = None,
    enable_pdl: Optional[bool] = None,
    eplb_local_stats: Optional[torch.Tensor] = None,
    enable_rank_mask: bool = False,
    active_rank_mask: Optional[torch.Tensor] = None,
    *,
    backend: MoeAlltoAllBackend = "trtllm",
    timeout_s: Optional[float] = None,
) -> ExpertMajorDispatch:
    """Dispatch each local token to its experts, received grouped by local expert.

    Args:
        token_selected_experts: int32 or int64 ``[local_num_tokens, top_k]``
            (as for :func:`~torch_moe_a2a.moe_a2a_dispatch`); it also travels
            as a payload, which the receiving rank reads to group the rows.
        input_payloads: a list or tuple of 0 to 8 contiguous
            ``[local_num_tokens, *]`` tensors. If any of them or
            ``router_weights`` requires grad under grad mode (eager calls), the
            call runs as
            :func:`~torch_moe_a2a.moe_a2a_dispatch_expert_major_differentiable`
            (new tensors, no EPLB statistics).
        workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size,
            top_k, num_experts, enable_pdl, eplb_local_stats, enable_rank_mask,
            active_rank_mask, backend, timeout_s: as for the rank-major dispatch.
            The workspace must be sized for expert-major calls
            (:func:`moe_a2a_get_workspace_size_per_rank_expert_major`); at most
            ``layout.MAX_LOCAL_EXPERTS`` experts per rank.
        router_weights: ``[local_num_tokens, top_k]`` floating router weights
            (converted to fp32), or None: the combine then sums the pairs
            unweighted.
        max_tokens_per_expert: rows per local expert, the same on every rank;
            default ``ep_size * runtime_max_tokens_per_rank`` (no drops with
            distinct experts per token), times ``top_k`` with fewer experts
            than ``top_k`` (no drops). Pairs beyond it are dropped and
            counted (:func:`moe_a2a_get_dropped_pair_count`).

    Returns:
        :class:`ExpertMajorDispatch` (views of the workspace; see there).

    Raises:
        ValueError: as the rank-major dispatch, and for more payloads than the
            layout takes, weights of another shape, or a workspace too small
            for the expert-major regions (before any kernel runs).
        RuntimeError: as the rank-major dispatch.
    """
    fn = "moe_a2a_dispatch_expert_major"
    check_ids_and_weights(fn, token_selected_experts, workspace, router_weights, top_k)
    if isinstance(input_payloads, (list, tuple)) and wants_grad(fn, f"{fn}_differentiable", router_weights,
                                                                 *input_payloads):
        # Eager, payloads or weights that require grad: the differentiable dispatch.
        from . import autograd  # imports this module

        check_backend(backend, workspace)
        return autograd.dispatch_expert_major_with_grad(
            fn, token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank,
            ep_size, top_k, num_experts, router_weights, max_tokens_per_expert, enable_pdl, eplb_local_stats,
            enable_rank_mask, active_rank_mask, timeout_s)
    if router_weights is not None and router_weights.requires_grad and torch.is_grad_enabled():
        # Named here: the op would name them as the payload they travel as.
        raise ValueError(f"{fn}: router_weights requires grad, but this dispatch has no backward: for training use "
                         "moe_a2a_dispatch_expert_major_differentiable; else call under torch.no_grad() or pass "
                         "router_weights.detach()")
    expect_tensor_list(fn, "input_payloads", input_payloads)
    n = token_selected_experts.shape[0]
    payloads = list(input_payloads) + [token_selected_experts]
    if router_weights is not None:
        payloads.append(router_weights.to(torch.float32).contiguous())
    # The rank-major dispatch of the user payloads, the ids and the weights.
    args, call_eplb_n = dispatch_args(
        fn, token_selected_experts, payloads, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size,
        top_k, num_experts, enable_pdl, eplb_local_stats, enable_rank_mask, active_rank_mask, backend, timeout_s)
    if max_tokens_per_expert is None:
        max_tokens_per_expert = default_rows_per_expert(ep_size, runtime_max_tokens_per_rank,
                                                        metainfo_values(metainfo, id(metainfo))[2], top_k, num_experts)
    user_rows = [_row_bytes(p) for p in input_payloads]
    # Refused before the dispatch runs: what the build would refuse after it.
    check_expert_major_fits(workspace, ep_size, runtime_max_tokens_per_rank, top_k, num_experts,
                            max_tokens_per_expert, call_eplb_n, user_rows, token_selected_experts.element_size(),
                            router_weights is not None)
    _ops.dispatch_expert_major.default(*args, max_tokens_per_expert, user_rows, router_weights is not None)
    call = layout.call_layout(ep_size, runtime_max_tokens_per_rank, call_eplb_n, [_row_bytes(p) for p in payloads])
    dispatch_end = call.combine_offset
    em = layout.expert_major_layout(dispatch_end, ep_size, runtime_max_tokens_per_rank, top_k,
                                    layout.max_local_experts(num_experts, ep_size), max_tokens_per_expert, user_rows)
    local = layout.experts_per_rank(num_experts, ep_size)[ep_rank]
    row = workspace.select(0, ep_rank)
    M = max_tokens_per_expert
    views = [layout.region_view(row, offset, (local, M, *p.shape[1:]), p.dtype)
             for p, offset in zip(input_payloads, em.payload_offsets)]
    counts = layout.region_view(row, em.counts_offset, (local,), torch.int32)
    if not tracing():
        note_plain_dispatch(workspace, ep_rank, token_selected_experts, num_experts, counts)
    ids = layout.region_view(row, em.ids_offset, (local, M), torch.int32)
    weights = None
    if router_weights is not None:
        weights = layout.region_view(row, em.weights_offset, (local, M), torch.float32)
    eplb = None
    if call.eplb_offset >= 0:
        eplb = layout.region_view(row, call.eplb_offset, (ep_size, call_eplb_n), torch.int32)
    return ExpertMajorDispatch(views, counts, ids, weights, em.combine_offset, eplb, n, runtime_max_tokens_per_rank,
                               top_k, num_experts, M, dispatch_end)


def check_ids_and_weights(fn: str, token_selected_experts: torch.Tensor, workspace: torch.Tensor,
                          router_weights: Optional[torch.Tensor], top_k: int) -> None:
    """The expert ids and the router weights of an expert-major dispatch: ids
    a 2-D int32 or int64 tensor, weights None or floating ``[local_num_tokens, top_k]``.

    Raises:
        ValueError: either of them of another type, dtype or shape.
    """
    expect_tensors(fn, token_selected_experts=token_selected_experts, workspace=workspace)
    if token_selected_experts.dtype not in ID_DTYPES or token_selected_experts.dim() != 2:
        raise ValueError("token_selected_experts must be a 2-D int32 or int64 [local_num_tokens, top_k] tensor, got "
                         f"{token_selected_experts.dtype} {tuple(token_selected_experts.shape)}")
    n = token_selected_experts.shape[0]
    if router_weights is not None:
        # top_k first: the weights' shape names it.
        if not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool) or not 1 <= top_k <= layout.MAX_TOP_K:
            raise ValueError(f"top_k must be an int in [1, {layout.MAX_TOP_K}], got {top_k!r}")
        if not isinstance(router_weights, torch.Tensor) or tuple(router_weights.shape) != (n, top_k) \
                or not router_weights.dtype.is_floating_point:
            raise ValueError(f"router_weights must be a floating [local_num_tokens={n}, top_k={top_k}] tensor, got "
                             f"{getattr(router_weights, 'dtype', type(router_weights))} "
                             f"{tuple(getattr(router_weights, 'shape', ()))}")


def check_expert_major_fits(workspace, ep_size, T, top_k, num_experts, M, eplb_n, user_rows, id_bytes,
                            has_weights) -> None:
    """The expert-major layout's limits and fit, checked before the dispatch
    writes anything (the build's op checks them again)."""
    local = layout.max_local_experts(num_experts, ep_size) if num_experts >= ep_size >= 1 else 1
    if local > layout.MAX_LOCAL_EXPERTS:
        raise ValueError(f"the expert-major layout takes at most {layout.MAX_LOCAL_EXPERTS} experts per rank, got "
                         f"num_experts={num_experts} over ep_size={ep_size}")
    if not isinstance(M, int) or isinstance(M, bool) or not 1 <= M <= layout.MAX_EXPERT_MAJOR_ROWS // local:
        raise ValueError(f"max_tokens_per_expert must be an int in [1, {layout.MAX_EXPERT_MAJOR_ROWS // local}], "
                         f"got {M!r}")
    if len(user_rows) > layout.MAX_PAYLOADS:
        raise ValueError(f"an expert-major dispatch takes at most {layout.MAX_PAYLOADS} payloads, got "
                         f"{len(user_rows)}")
    rows = list(user_rows) + [top_k * id_bytes] + ([top_k * 4] if has_weights else [])
    if not 1 <= T <= layout.MAX_NUM_TOKENS or not 1 <= top_k <= layout.MAX_TOP_K:
        return  # the dispatch names these
    if ep_size * T * top_k > layout.MAX_EXPERT_MAJOR_ROWS:
        raise ValueError(f"an expert-major dispatch counts a local expert's pairs of the call in 32 bits: ep_size * "
                         f"runtime_max_tokens_per_rank * top_k = {ep_size * T * top_k} exceeds "
                         f"{layout.MAX_EXPERT_MAJOR_ROWS}; dispatch fewer tokens a call, or rank-major")
    call = layout.call_layout(ep_size, T, eplb_n, rows)
    em = layout.expert_major_layout(call.combine_offset, ep_size, T, top_k, local, M, user_rows)
    if em.combine_offset > workspace.shape[1]:
        raise ValueError(f"workspace too small: this expert-major call needs {em.combine_offset} bytes per rank "
                         f"before its combine region, the workspace has {workspace.shape[1]} "
                         "(moe_a2a_get_workspace_size_per_rank_expert_major gives the size)")


def moe_a2a_combine_expert_major(
    expert_outputs: torch.Tensor,
    dispatched: ExpertMajorDispatch,
    workspace: torch.Tensor,
    metainfo: torch.Tensor,
    ep_rank: int,
    ep_size: int,
    payload_in_workspace: bool = False,
    output_dtype: Optional[torch.dtype] = None,
    *,
    enable_pdl: Optional[bool] = None,
    enable_rank_mask: bool = False,
    active_rank_mask: Optional[torch.Tensor] = None,
    backend: MoeAlltoAllBackend = "trtllm",
    timeout_s: Optional[float] = None,
    output: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Return every local token's router-weighted sum of its experts' outputs.

    Args:
        expert_outputs: ``[num_local_experts, max_tokens_per_expert, *row_shape]``
            bf16, fp16 or fp32: row ``[e, i]`` is local expert ``e``'s output for
            its i-th row of ``dispatched`` (padding rows are ignored). If it
            (or ``dispatched.router_weights``) requires grad under grad mode
            (eager calls), the call runs as
            :func:`~torch_moe_a2a.moe_a2a_combine_expert_major_differentiable`
            with the ids of this rank's last dispatch, which must have been a
            differentiable one. With
            ``payload_in_workspace=True`` it is the view of the expert-major
            combine region (:meth:`MoeAlltoAll.get_combine_payload_tensor_in_workspace`,
            or :func:`~torch_moe_a2a.moe_a2a_wrap_payload_tensor_in_workspace` at
            ``dispatched.combine_payload_offset``), read in place; else a
            contiguous tensor whose valid rows the op copies into the workspace.
        dispatched: this rank's :func:`moe_a2a_dispatch_expert_major` result.
        workspace, metainfo, ep_rank, ep_size, enable_pdl, enable_rank_mask,
            active_rank_mask, backend, timeout_s: as for the dispatch.
        payload_in_workspace: whether ``expert_outputs`` is the combine region itself.
        output_dtype: the payload dtype (default), bf16 or fp32.
        output: a contiguous ``[local_num_tokens, *row_shape]`` tensor of
            ``output_dtype`` on the workspace's device, outside the workspace,
            to write the result into (CUDA-graph and simulated-rank callers
            allocate nothing inside a rank's launch); None: a new tensor.

    Returns:
        ``output``, or a new ``[local_num_tokens, *row_shape]`` tensor of ``output_dtype``: for
        each token, starting from fp32 zeros, ``w * row`` (the product rounded
        to fp32) added for each of its pairs in ascending destination rank, then
        local expert, then top-k slot order, cast once; zeros for a token with no
        pair. Dropped pairs contribute nothing. Bitwise the same on every device.
        ``w``: the pair's weight in the workspace, which the dispatch wrote (1
        without router weights), whatever ``dispatched.router_weights`` was
        rebound to since, or which a differentiable combine of the round wrote
        before it (the weights that combine multiplied by).

    Raises:
        ValueError: arguments out of range or not those of the dispatch (on the
            CPU, at once; on CUDA the kernel records it, and this rank's next
            call raises RuntimeError).
        RuntimeError: peers that did not arrive within the timeout.
    """
    expect_tensors("moe_a2a_combine_expert_major", expert_outputs=expert_outputs, workspace=workspace)
    if isinstance(dispatched, ExpertMajorDispatch) and wants_grad(
            "moe_a2a_combine_expert_major", "moe_a2a_combine_expert_major_differentiable", expert_outputs,
            dispatched.router_weights):
        # Eager, outputs or weights that require grad: the differentiable combine.
        from . import autograd  # imports this module

        check_backend(backend, workspace)
        return autograd.combine_expert_major_with_grad(
            "moe_a2a_combine_expert_major", expert_outputs, dispatched, workspace, metainfo, ep_rank, ep_size,
            enable_pdl, enable_rank_mask, active_rank_mask, timeout_s, payload_in_workspace=payload_in_workspace,
            output=output is not None,
            output_dtype=output_dtype is not None and output_dtype != expert_outputs.dtype)
    if output is not None:
        check_output_first("moe_a2a_combine_expert_major", output, workspace)
    if not isinstance(dispatched, ExpertMajorDispatch):
        raise ValueError("dispatched must be the ExpertMajorDispatch that moe_a2a_dispatch_expert_major returned, "
                         f"got {type(dispatched).__name__}")
    check_backend(backend, workspace)
    meta = metainfo_values(metainfo, id(metainfo))
    check_rank(meta, ep_rank, ep_size, workspace)
    refuse_combine_after_backward("moe_a2a_combine_expert_major", workspace, ep_rank, tracing())
    _, _, max_num_tokens, _, _, mailbox, _ = meta
    mask = rank_mask_words(enable_rank_mask, active_rank_mask)
    if enable_pdl is None:
        enable_pdl = pdl_default(workspace)
    timeout_s = call_timeout(meta, timeout_s)
    if expert_outputs.dim() < 2:
        raise ValueError("expert_outputs must be [num_local_experts, max_tokens_per_expert, *], got shape "
                         f"{tuple(expert_outputs.shape)}")
    staged = expert_outputs
    if payload_in_workspace and not torch.compiler.is_compiling():
        _check_in_workspace(expert_outputs, dispatched, workspace, ep_rank)
        staged = None
    # Traced, the payload is always handed to the op, which stages it (a
    # traced write into a workspace view makes Inductor copy the workspace;
    # the kernels skip the copy of the region onto itself).
    if output_dtype is None:
        output_dtype = expert_outputs.dtype
    elif not isinstance(output_dtype, torch.dtype):
        raise ValueError(f"moe_a2a_combine_expert_major: output_dtype must be a torch.dtype or None, got "
                         f"{output_dtype!r}")
    args = (staged, dispatched.local_num_tokens, workspace, ep_rank, ep_size, max_num_tokens,
            dispatched.runtime_max_tokens_per_rank, dispatched.top_k, dispatched.num_experts,
            dispatched.max_tokens_per_expert, dispatched.dispatch_end, dispatched.combine_payload_offset,
            expert_outputs.shape[2:], expert_outputs.dtype, output_dtype, mask, timeout_s, mailbox, enable_pdl)
    if output is None:
        return _ops.combine_expert_major.default(*args)
    _ops.combine_expert_major_into.default(*args, output)
    return output


def _check_in_workspace(payload: torch.Tensor, dispatched: ExpertMajorDispatch, workspace: torch.Tensor,
                        ep_rank: int) -> None:
    """The region view of an in-place combine: where, and its leading shape,
    which the op cannot check (it gets the rows' shape, not the view; the
    kernels would read the region with the view's stride)."""
    expected = workspace.data_ptr() + ep_rank * workspace.stride(0) + dispatched.combine_payload_offset
    if data_address(payload) != expected or not payload.is_contiguous():
        raise ValueError("payload_in_workspace=True requires expert_outputs to be the contiguous view of this "
                         "rank's workspace row at the expert-major combine_payload_offset "
                         "(MoeAlltoAll.get_combine_payload_tensor_in_workspace)")
    lead = (dispatched.local_expert_ids.shape[0], dispatched.max_tokens_per_expert)
    if tuple(payload.shape[:2]) != lead:
        raise ValueError(f"expert_outputs must be [num_local_experts, max_tokens_per_expert, *row_shape] with "
                         f"num_local_experts, max_tokens_per_expert = {lead[0]}, {lead[1]} (the dispatch's), got "
                         f"shape {tuple(payload.shape)}")


def moe_a2a_get_dropped_pair_count(workspace: torch.Tensor, metainfo: torch.Tensor, ep_rank: int) -> torch.Tensor:
    """0-d int64 view of rank ``ep_rank``'s header: (token, local expert) pairs its
    expert-major dispatches dropped beyond ``max_tokens_per_expert`` since
    ``moe_a2a_initialize``.

    Args:
        workspace, metainfo: the workspace and a rank's
            :func:`~torch_moe_a2a.moe_a2a_initialize` result.
        ep_rank: the rank whose count to view, any rank of the workspace.

    Returns:
        The view (not a copy: later expert-major dispatches add to it), valid
        as long as the workspace is.

    Raises:
        ValueError: ``workspace`` not a tensor, or not the metainfo's
            ``[ep_size, size_per_rank]``; a ``metainfo`` that is not
            :func:`~torch_moe_a2a.moe_a2a_initialize`'s; ``ep_rank`` outside
            ``[0, ep_size)`` (a bool included).
    """
    expect_tensors("moe_a2a_get_dropped_pair_count", workspace=workspace)
    check_rank_index(metainfo_values(metainfo, id(metainfo)), ep_rank, workspace)
    return layout.region_view(workspace[ep_rank], layout.HDR_DROPPED_PAIR_COUNT, (), torch.int64)
