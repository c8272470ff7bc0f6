"""Differentiable dispatch and combine (docs/DESIGN.md, 'Gradients').

The ops of csrc/schemas.h mutate the workspace (``Tensor(a!)``), and
``torch.library.register_autograd`` refuses an op that mutates an argument.
So training goes through four ops defined here with ``torch.library.custom_op``
that mutate no argument as far as the dispatcher knows: each runs the
workspace ops inside its kernel and returns fresh tensors, and autograd is
registered on them, so eager training, ``torch.compile`` (AOTAutograd traces
the backward as calls of these ops) and opcheck see the same backward:

- ``dispatch_owned``: a dispatch whose received planes come back as new
  tensors (padding rows zeroed) with the receive counts; the round stays open
  for the combine.
- ``combine_owned``: the combine that closes that round.
- ``dispatch_round``: a whole round, a dispatch of one payload then a combine
  of one fp32 zero per row (which closes the round): the backward of ``combine_owned`` (the output gradient goes to
  the rows that made each token's sum).
- ``combine_round``: a whole round, a dispatch of the expert ids alone (which
  lays the routes again from the ids saved by the forward) then a combine of
  the given rows: the backward of ``dispatch_owned`` (each received row's
  gradient goes back to its source token, summed over its destination ranks in
  the combine's fixed ascending rank order).

``dispatch_round`` and ``combine_round`` are each other's adjoint and each
other's backward, which gives second-order gradients too. A backward is a whole round of its own, so it is correct
whatever runs between two backward calls; it costs one more exchange per
backward than a bare combine or dispatch would.

The workspace stays an ordinary argument (no workspace copy under
``torch.compile``); the ops write into it where the dispatcher does not look,
which is sound because no traced op reads the workspace between them: what a
caller needs comes back as new tensors (a training graph holds no workspace
view). They are marked as side effects so
that a traced graph keeps every exchange. The ops are opaque to the compiler;
their order is their data dependencies' (forward: dispatch, experts, combine;
backward: the reverse), the same on every rank.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from torch import Tensor

from . import layout
from .arguments import dispatch_args

_ops = torch.ops.moe_a2a
# The payload dtypes that get gradients: the combine's.
GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# `route`: the arguments every op here takes after (..., ids, workspace), in
# this order: ep_rank, ep_size, max_num_tokens, runtime_max, top_k,
# num_experts, the rank-mask words, timeout_s, mailbox, enable_pdl.


def _dispatch(ids: Tensor, payloads: list[Tensor], workspace: Tensor, route: tuple) -> None:
    ep_rank, ep_size, max_num_tokens, runtime_max, top_k, num_experts, mask, timeout_s, mailbox, pdl = route
    _ops.dispatch.default(ids, payloads, workspace, ep_rank, ep_size, max_num_tokens, runtime_max, top_k,
                          num_experts, None, 0, mask, timeout_s, mailbox, pdl)


def _combine(payload: Tensor, local_num_tokens: int, workspace: Tensor, offset: int, route: tuple) -> Tensor:
    ep_rank, ep_size, max_num_tokens, runtime_max, top_k, _, mask, timeout_s, mailbox, pdl = route
    return _ops.combine.default(payload, local_num_tokens, workspace, ep_rank, ep_size, max_num_tokens, runtime_max,
                                top_k, offset, payload.shape[2:], payload.dtype, payload.dtype, mask, timeout_s,
                                mailbox, pdl, 0, None, 1.0, 2)


@contextlib.contextmanager
def _unrecorded():
    """Where the ops here call the workspace ops: without grad mode (those
    refuse payloads that require grad under it) and below ADInplaceOrView, so
    that the workspace's version counter stays put. To autograd the ops here
    mutate nothing, and a compiled graph saves the workspace for its backward
    with its version: an exchange between the forward and the backward (a
    later layer's, or a simulated peer's on the shared tensor) must not make
    that backward fail with "modified by an inplace operation"."""
    with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
        yield


def _row_bytes(t: Tensor) -> int:
    return t.element_size() * math.prod(t.shape[1:])


def _owned_planes(workspace: Tensor, payloads: list[Tensor], route: tuple) -> tuple[list[Tensor], Tensor, int]:
    """New tensors with this rank's receive planes of the dispatch of
    ``payloads`` that just ran, padding rows zeroed (whatever bytes they held,
    so an expert that multiplies them by a zero gradient gets no NaN), the
    int32 receive counts and the round's combine offset."""
    ep_rank, ep_size, runtime_max = route[0], route[1], route[3]
    call = layout.call_layout(ep_size, runtime_max, 0, tuple(_row_bytes(p) for p in payloads))
    row = workspace.select(0, ep_rank)
    counts = layout.region_view(row, layout.HDR_RECV_COUNTS, (ep_size,), torch.int32).clone()
    valid = (torch.arange(runtime_max, device=workspace.device) < counts.unsqueeze(1)).unsqueeze(2)
    planes = []
    for payload, offset in zip(payloads, call.payload_offsets):
        # Zeroed as bytes: one path for every dtype (all-zero bytes are a zero of each).
        plane = layout.region_view(row, offset, (ep_size, runtime_max, _row_bytes(payload)), torch.uint8)
        plane = torch.where(valid, plane, 0).view(payload.dtype)
        planes.append(plane.view(ep_size, runtime_max, *payload.shape[1:]))
    return planes, counts, call.combine_offset


# ---- the ops -------------------------------------------------------------------------------------------


@torch.library.custom_op("moe_a2a::dispatch_owned", mutates_args=())
def dispatch_owned(token_selected_experts: Tensor, input_payloads: list[Tensor], workspace: Tensor, ep_rank: int,
                   ep_size: int, max_num_tokens: int, runtime_max_tokens_per_rank: int, top_k: int,
                   num_experts: int, active_rank_mask: list[int], timeout_s: float, mailbox: int,
                   enable_pdl: bool) -> list[Tensor]:
    """The dispatch op; returns ``[*planes, recv_counts]`` (new tensors, see :func:`_owned_planes`)."""
    route = (ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts, active_rank_mask,
             timeout_s, mailbox, enable_pdl)
    with _unrecorded():
        _dispatch(token_selected_experts, input_payloads, workspace, route)
        planes, counts, _ = _owned_planes(workspace, input_payloads, route)
    return [*planes, counts]


@torch.library.custom_op("moe_a2a::combine_owned", mutates_args=())
def combine_owned(payload: Tensor, token_selected_experts: Tensor, workspace: Tensor, combine_payload_offset: int,
                  ep_rank: int, ep_size: int, max_num_tokens: int, runtime_max_tokens_per_rank: int, top_k: int,
                  num_experts: int, active_rank_mask: list[int], timeout_s: float, mailbox: int,
                  enable_pdl: bool) -> Tensor:
    """The combine op closing the round ``dispatch_owned`` opened; ``[local_num_tokens, *row]`` of payload's dtype."""
    route = (ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts, active_rank_mask,
             timeout_s, mailbox, enable_pdl)
    with _unrecorded():
        return _combine(payload, token_selected_experts.shape[0], workspace, combine_payload_offset, route)


@torch.library.custom_op("moe_a2a::dispatch_round", mutates_args=())
def dispatch_round(rows: Tensor, token_selected_experts: Tensor, workspace: Tensor, ep_rank: int, ep_size: int,
                   max_num_tokens: int, runtime_max_tokens_per_rank: int, top_k: int, num_experts: int,
                   active_rank_mask: list[int], timeout_s: float, mailbox: int, enable_pdl: bool) -> Tensor:
    """A dispatch of ``rows`` ``[local_num_tokens, *row]`` then a combine of one
    fp32 zero per row (closing the round); returns the received plane
    ``[ep_size, runtime_max_tokens_per_rank, *row]``, padding rows zero."""
    route = (ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts, active_rank_mask,
             timeout_s, mailbox, enable_pdl)
    with _unrecorded():
        _dispatch(token_selected_experts, [rows], workspace, route)
        (plane,), _, offset = _owned_planes(workspace, [rows], route)
        nothing = torch.zeros((ep_size, runtime_max_tokens_per_rank, 1), dtype=torch.float32, device=rows.device)
        _combine(nothing, rows.shape[0], workspace, offset, route)
    return plane


@torch.library.custom_op("moe_a2a::combine_round", mutates_args=())
def combine_round(payload: Tensor, token_selected_experts: Tensor, workspace: Tensor, ep_rank: int, ep_size: int,
                  max_num_tokens: int, runtime_max_tokens_per_rank: int, top_k: int, num_experts: int,
                  active_rank_mask: list[int], timeout_s: float, mailbox: int, enable_pdl: bool) -> Tensor:
    """A dispatch of the expert ids alone (the routes of these ids) then a
    combine of ``payload`` ``[ep_size, runtime_max_tokens_per_rank, *row]``;
    returns ``[local_num_tokens, *row]``."""
    route = (ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts, active_rank_mask,
             timeout_s, mailbox, enable_pdl)
    ids = token_selected_experts
    offset = layout.call_layout(ep_size, runtime_max_tokens_per_rank, 0, (_row_bytes(ids),)).combine_offset
    with _unrecorded():
        _dispatch(ids, [ids], workspace, route)
        return _combine(payload, ids.shape[0], workspace, offset, route)


# A traced graph must keep every exchange, also one whose result is unused:
# the peers wait for it.
for _op in (dispatch_owned, combine_owned, dispatch_round, combine_round):
    torch.fx.node.has_side_effect(_op._opoverload)


@dispatch_owned.register_fake
def _(token_selected_experts, input_payloads, workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank,
      top_k, num_experts, active_rank_mask, timeout_s, mailbox, enable_pdl):
    planes = [p.new_empty((ep_size, runtime_max_tokens_per_rank, *p.shape[1:])) for p in input_payloads]
    return [*planes, workspace.new_empty((ep_size,), dtype=torch.int32)]


@combine_owned.register_fake
def _(payload, token_selected_experts, workspace, combine_payload_offset, *route):
    return payload.new_empty((token_selected_experts.shape[0], *payload.shape[2:]))


@dispatch_round.register_fake
def _(rows, token_selected_experts, workspace, ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, *route):
    return rows.new_empty((ep_size, runtime_max_tokens_per_rank, *rows.shape[1:]))


@combine_round.register_fake
def _(payload, token_selected_experts, workspace, *route):
    return payload.new_empty((token_selected_experts.shape[0], *payload.shape[2:]))


# ---- their autograd ------------------------------------------------------------------------------------
# Saved: the expert ids (save_for_backward, so an in-place change of them is
# caught) and the plain ints. The workspace is kept as an attribute, not saved:
# the backward needs its memory, never its old contents, so no version check
# applies (the plain functions' exchanges move its version counter).

_ROUTE_GRADS = (None,) * 10  # the route arguments' gradients


def _keep_route(ctx, ids: Tensor, workspace: Tensor, route: tuple) -> None:
    ctx.save_for_backward(ids)
    ctx.workspace = workspace
    ctx.route = route


def _setup_dispatch_owned(ctx, inputs, output):
    ids, payloads, workspace, *route = inputs
    _keep_route(ctx, ids, workspace, tuple(route))
    ctx.payloads = [(p.dtype, tuple(p.shape[1:])) for p in payloads]


def _backward_dispatch_owned(ctx, grads):
    """All floating payloads' gradients in one ``combine_round``: packed as the
    rows of one payload of their promoted dtype (the combine sums in fp32 and
    casts once, so this rounds as one combine per payload would)."""
    (ids,) = ctx.saved_tensors
    route = ctx.route
    ep_size, runtime_max = route[1], route[3]
    floating = [i for i, (dtype, _) in enumerate(ctx.payloads) if dtype in GRAD_DTYPES]
    result: list[Optional[Tensor]] = [None] * len(ctx.payloads)
    if floating:
        dtype = ctx.payloads[floating[0]][0]
        for i in floating[1:]:
            dtype = torch.promote_types(dtype, ctx.payloads[i][0])
        parts = []
        for i in floating:
            shape = (ep_size, runtime_max, math.prod(ctx.payloads[i][1]))
            g = grads[i]
            parts.append(ids.new_zeros(shape, dtype=dtype) if g is None else g.reshape(shape).to(dtype))
        summed = combine_round(torch.cat(parts, dim=2), ids, ctx.workspace, *route)
        start = 0
        for i, part in zip(floating, parts):
            width = part.shape[2]
            g = summed[:, start:start + width].reshape(ids.shape[0], *ctx.payloads[i][1])
            result[i] = g.to(ctx.payloads[i][0])
            start += width
    # An op with a tensor-list argument matches its gradients' structure to
    # the arguments' pytree, where an empty rank mask is an empty list.
    route_grads = (*_ROUTE_GRADS[:6], None if route[6] else [], *_ROUTE_GRADS[7:])
    return None, result, None, *route_grads


def _setup_combine_owned(ctx, inputs, output):
    payload, ids, workspace, _, *route = inputs
    _keep_route(ctx, ids, workspace, tuple(route))


def _backward_combine_owned(ctx, grad):
    (ids,) = ctx.saved_tensors
    return dispatch_round(grad.contiguous(), ids, ctx.workspace, *ctx.route), None, None, None, *_ROUTE_GRADS


def _setup_round(ctx, inputs, output):
    _, ids, workspace, *route = inputs
    _keep_route(ctx, ids, workspace, tuple(route))


def _backward_dispatch_round(ctx, grad):
    (ids,) = ctx.saved_tensors
    return combine_round(grad.contiguous(), ids, ctx.workspace, *ctx.route), None, None, *_ROUTE_GRADS


def _backward_combine_round(ctx, grad):
    (ids,) = ctx.saved_tensors
    return dispatch_round(grad.contiguous(), ids, ctx.workspace, *ctx.route), None, None, *_ROUTE_GRADS


dispatch_owned.register_autograd(_backward_dispatch_owned, setup_context=_setup_dispatch_owned)
combine_owned.register_autograd(_backward_combine_owned, setup_context=_setup_combine_owned)
dispatch_round.register_autograd(_backward_dispatch_round, setup_context=_setup_round)
combine_round.register_autograd(_backward_combine_round, setup_context=_setup_round)


# ---- the public functions ------------------------------------------------------------------------------


def _route_args(fn, token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank,
                ep_rank, ep_size, top_k, num_experts, enable_pdl, enable_rank_mask, active_rank_mask,
                timeout_s) -> tuple:
    """The ops' route arguments, after the checks of :func:`~torch_moe_a2a.arguments.dispatch_args`."""
    args, _ = dispatch_args(fn, token_selected_experts, input_payloads, workspace, metainfo,
                            runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts, enable_pdl, None,
                            enable_rank_mask, active_rank_mask, "trtllm", timeout_s)
    return (*args[3:9], list(args[11]), *args[12:])


def moe_a2a_dispatch_differentiable(
    token_selected_experts: Tensor,
    input_payloads: list[Tensor],
    workspace: Tensor,
    metainfo: Tensor,
    runtime_max_tokens_per_rank: int,
    ep_rank: int,
    ep_size: int,
    top_k: int,
    num_experts: int,
    enable_pdl: Optional[bool] = None,
    enable_rank_mask: bool = False,
    active_rank_mask: Optional[Tensor] = None,
    *,
    timeout_s: Optional[float] = None,
) -> tuple[list[Tensor], int, Tensor]:
    """:func:`~torch_moe_a2a.moe_a2a_dispatch` for training: differentiable,
    with received rows the caller owns.

    Args:
        token_selected_experts, input_payloads, workspace, metainfo,
            runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts,
            enable_pdl, enable_rank_mask, active_rank_mask, timeout_s: as for
            :func:`~torch_moe_a2a.moe_a2a_dispatch` (no EPLB statistics).
            Payloads may require grad; bf16, fp16 and fp32 payloads get a
            gradient, other dtypes none (and may not require grad).

    Returns:
        ``(received, combine_payload_offset, recv_counts)``: ``received[i]``
        a new ``[ep_size, runtime_max_tokens_per_rank, *input_payloads[i].shape[1:]]``
        tensor (the receive plane, rows ``j >= recv_counts[s]`` zero) that no
        later exchange overwrites, so an expert may save it for its backward;
        the combine offset for :func:`moe_a2a_combine_differentiable`; a new
        int32 ``[ep_size]`` tensor of the rows received from each rank.
        The backward is a combine of the received rows' gradients over the
        same routes (a collective: every rank runs it).

    Raises:
        ValueError: as :func:`~torch_moe_a2a.moe_a2a_dispatch`; a payload
            that requires grad and is not bf16, fp16 or fp32.
        RuntimeError: peers that did not arrive within the timeout.
    """
    for i, p in enumerate(input_payloads):
        if isinstance(p, Tensor) and p.requires_grad and p.dtype not in GRAD_DTYPES:
            raise ValueError(f"moe_a2a_dispatch_differentiable: input_payloads[{i}] requires grad but is {p.dtype}; "
                             "gradients flow back through a combine, whose dtypes are bf16, fp16 and fp32")
    route = _route_args("moe_a2a_dispatch_differentiable", token_selected_experts, input_payloads, workspace, metainfo,
                        runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts, enable_pdl,
                        enable_rank_mask, active_rank_mask, timeout_s)
    *received, counts = dispatch_owned(token_selected_experts, list(input_payloads), workspace, *route)
    row_bytes = tuple(_row_bytes(p) for p in input_payloads)
    offset = layout.call_layout(ep_size, runtime_max_tokens_per_rank, 0, row_bytes).combine_offset
    return received, offset, counts


def moe_a2a_combine_differentiable(
    payload: Tensor,
    token_selected_experts: Tensor,
    workspace: Tensor,
    metainfo: Tensor,
    runtime_max_tokens_per_rank: int,
    ep_rank: int,
    ep_size: int,
    top_k: int,
    num_experts: int,
    combine_payload_offset: int,
    enable_pdl: Optional[bool] = None,
    enable_rank_mask: bool = False,
    active_rank_mask: Optional[Tensor] = None,
    *,
    timeout_s: Optional[float] = None,
) -> Tensor:
    """:func:`~torch_moe_a2a.moe_a2a_combine` for training: differentiable.

    Args:
        payload: ``[ep_size, runtime_max_tokens_per_rank, *row_shape]`` bf16,
            fp16 or fp32 (padding rows are ignored and get a zero gradient).
        token_selected_experts: the ids of the preceding
            :func:`moe_a2a_dispatch_differentiable` (its routes; the backward
            dispatches the output gradient along them).
        the rest: as for that dispatch; ``combine_payload_offset`` is the offset it returned.

    Returns:
        ``[local_num_tokens, *row_shape]`` of the payload's dtype: as
        :func:`~torch_moe_a2a.moe_a2a_combine` (fp32 sums in ascending rank
        order, cast once). A new tensor.

    Raises:
        ValueError, RuntimeError: as :func:`~torch_moe_a2a.moe_a2a_combine`.
    """
    route = _route_args("moe_a2a_combine_differentiable", token_selected_experts, [payload], workspace, metainfo,
                        runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts, enable_pdl,
                        enable_rank_mask, active_rank_mask, timeout_s)
    return combine_owned(payload, token_selected_experts, workspace, combine_payload_offset, *route)
