"""Differentiable dispatch and combine (docs/DESIGN.md, 'Gradients').

The ops of csrc/schemas.h mutate the workspace (``Tensor(a!)``), and
``torch.library.register_autograd`` refuses an op that mutates an argument.
So training goes through ops defined here with ``torch.library.custom_op``
that mutate no argument as far as the dispatcher knows: each runs the
workspace ops inside its kernel and returns fresh tensors, and autograd is
registered on them, so eager training, ``torch.compile`` (AOTAutograd traces
the backward as calls of these ops) and opcheck see the same backward. Four
for the rank-major layout (the expert-major four follow the same scheme; see
their section below):

- ``dispatch_owned``: a dispatch whose received planes come back as new
  tensors (padding rows zeroed) with the receive counts; the round stays open
  for the combine.
- ``combine_owned``: the combine that closes that round.
- ``dispatch_round``: a whole round, a dispatch of one payload then a combine
  of one fp32 zero per row (which closes the round): the backward of ``combine_owned`` (the output gradient goes to
  the rows that made each token's sum).
- ``combine_round``: a whole round, a dispatch of the expert ids alone (which
  lays the routes again from the ids saved by the forward) then a combine of
  each of the given planes (repeated combines of the round): the backward of
  ``dispatch_owned`` (each received row's gradient goes back to its source
  token, summed over its destination ranks in the combine's fixed ascending
  rank order), one combine per dtype of the payloads that require grad, so
  that each gradient travels in its own dtype.

``dispatch_round`` and ``combine_round`` are each other's adjoint and each
other's backward (a ``combine_round`` of several planes: a ``dispatch_round``
of each plane's gradient), which gives second-order gradients too. A backward is a whole round of its own, so it is correct
whatever runs between two backward calls; it costs one more exchange per
backward than a bare combine or dispatch would. Its dispatch carries the
number of the exchange whose backward it is (a round tag: the count of the
dispatches and combines the rank has made, which the C++ ops keep;
fastpath.round_tag_of_last_exchange), which the peers compare with its rows'
sizes: ranks whose backwards run the rounds of different
exchanges at the same place fail there instead of pairing them.

Eager calls do not go through the dispatcher: a custom op's Python call
(its argument defaults filled from the schema, pytrees, the generated
autograd function) costs more than the exchange itself at small sizes. In
eager mode (no tracing, no dispatch mode, no functorch transform, plain
tensors) :func:`_call` runs the op's Python function under an
``autograd.Function`` whose forward and backward are the op's own
``setup_context`` and backward: the same computation and the same gradients,
whichever path a call takes. Traced calls (``torch.compile``, ``make_fx``,
``FakeTensorMode``, opcheck) call the ops.

The rank-major four's bodies are C++, one call each (``_C.dispatch_owned``,
``_C.combine_owned``, ``_C.dispatch_round``, ``_C.combine_round``;
csrc/module.cpp): their workspace ops called through the C++ dispatcher as
``_C.dispatch`` and ``_C.combine`` call them, the received planes copied out
with their padding rows zeroed, the tallies put back, without grad mode and
below ADInplaceOrView, and without the GIL (simulated ranks are threads that
wait for each other inside an op). At small sizes the Python bodies' dozen
torch calls an op cost more than the exchange. Each op's Python function
calls its C++ body, eager or traced, wherever no ``__torch_function__``
override could want to see the calls inside it (``direct_call_ok``); under
one it runs the Python body below, the same calls with the same results.

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

import dataclasses
import functools
import inspect
import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _C, expert_major, layout
from .arguments import COMBINE_DTYPES, dispatch_args
from .expert_major import ExpertMajorDispatch
from .fastpath import (
    ROUND_TAG_ANY,
    checkpoint_forward,
    direct_call_ok,
    expect_tensor_list,
    expect_tensors,
    expect_traced_ints,
    last_dispatch,
    note_backward_round,
    note_dispatch,
    refuse_combine_after_backward,
    refuse_forward_ad,
    round_tag_of_last_exchange,
    tracing,
)

_ops = torch.ops.moe_a2a
# The payload dtypes that get gradients: the combine's.
GRAD_DTYPES = COMBINE_DTYPES

# `route`: the arguments every op here takes after (..., ids, workspace), in
# this order: ep_rank, ep_size, max_num_tokens, runtime_max, top_k,
# num_experts, the rank-mask words, timeout_s, mailbox, enable_pdl.


# ---- the Python bodies ----------------------------------------------------------------------------------
# The rank-major ops run these where a __torch_function__ override could want
# to see their calls (elsewhere their C++ bodies, which make the same calls);
# the expert-major ops' bodies always use the helpers here. The workspace ops
# are called as the eager public functions call them:
# through _C (the same operators through the C++ dispatcher, so dispatch
# modes, backends and the profiler see them) where no __torch_function__
# override could want to see the call, else through torch.ops. _C skips the
# per-argument schema matching of a torch.ops call from Python, about 5 us a
# call on the CPU, and a training step makes six.


def _dispatch(ids: Tensor, payloads: list[Tensor], workspace: Tensor, route: tuple, round_tag: int) -> None:
    """The dispatch of ``payloads`` by ``ids``; ``round_tag``: a backward
    round's (:func:`~torch_moe_a2a.fastpath.round_tag_of_last_exchange`), 0
    for a forward's."""
    ep_rank, ep_size, max_num_tokens, runtime_max, top_k, num_experts, mask, timeout_s, mailbox, pdl = route
    if direct_call_ok(ids, workspace, *payloads):
        _C.dispatch(ids, payloads, workspace, ep_rank, ep_size, max_num_tokens, runtime_max, top_k, num_experts,
                    None, 0, mask, timeout_s, mailbox, pdl, round_tag, False)
        return
    _ops.dispatch.default(ids, payloads, workspace, ep_rank, ep_size, max_num_tokens, runtime_max, top_k,
                          num_experts, None, 0, mask, timeout_s, mailbox, pdl, round_tag)


def _combine(payload: Tensor, local_num_tokens: int, workspace: Tensor, offset: int, route: tuple) -> Tensor:
    ep_rank, ep_size, max_num_tokens, runtime_max, top_k, _, mask, timeout_s, mailbox, pdl = route
    if direct_call_ok(payload, workspace):
        return _C.combine(payload, local_num_tokens, workspace, ep_rank, ep_size, max_num_tokens, runtime_max, top_k,
                          offset, payload.shape[2:], payload.dtype, payload.dtype, mask, timeout_s, mailbox, pdl, 0,
                          None, 1.0, 2, None)
    return _ops.combine.default(payload, local_num_tokens, workspace, ep_rank, ep_size, max_num_tokens, runtime_max,
                                top_k, offset, payload.shape[2:], payload.dtype, payload.dtype, mask, timeout_s,
                                mailbox, pdl, 0, None, 1.0, 2)


class _Unrecorded:
    """Where the ops here call the workspace ops: without grad mode (those
    refuse payloads that require grad under it) and below ADInplaceOrView, so
    that the workspace's version counter stays put. To autograd the ops here
    mutate nothing, and a compiled graph saves the workspace for its backward
    with its version: an exchange between the forward and the backward (a
    later layer's, or a simulated peer's on the shared tensor) must not make
    that backward fail with "modified by an inplace operation".

    A class with the grad mode set directly, not a generator context manager
    around ``torch.no_grad()``: every op here enters it, and the generator and
    no_grad's own Python cost more than the two switches (a few microseconds
    an op)."""

    __slots__ = ("_grad_enabled", "_below")

    def __enter__(self) -> None:
        self._grad_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        self._below = torch._C._AutoDispatchBelowADInplaceOrView()
        self._below.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._below.__exit__(*exc)
        torch._C._set_grad_enabled(self._grad_enabled)


# The header's two tallies that a backward's round puts back, int64 words a
# whole number of words apart: one strided view holds both, so saving them is
# one clone and putting them back one copy.
_TALLY_STEP, _TALLY_GAP = divmod(layout.HDR_DROPPED_PAIR_COUNT - layout.HDR_INVALID_EXPERT_COUNT, 8)
assert _TALLY_STEP > 0 and _TALLY_GAP == 0 and layout.HDR_INVALID_EXPERT_COUNT % 8 == 0


class _TalliesKept:
    """Where a backward's round runs its exchange: the forward's dispatch has
    counted its expert ids >= num_experts and its dropped pairs (the rank's
    header: moe_a2a_get_invalid_expert_count, moe_a2a_get_dropped_pair_count),
    and the round's dispatch of the same ids would count them again, so the
    counters are put back as the round found them, on the stream (no host
    sync; only the rank's own kernels write them). A class, not a generator
    context manager, and one view of both words: each backward enters it."""

    __slots__ = ("_words", "_saved")

    def __init__(self, workspace: Tensor, rank: int):
        first = layout.HDR_INVALID_EXPERT_COUNT
        span = layout.HDR_DROPPED_PAIR_COUNT + 8 - first
        self._words = workspace[rank, first:first + span].view(torch.int64)[::_TALLY_STEP]

    def __enter__(self) -> None:
        self._saved = self._words.clone()

    def __exit__(self, *exc: Any) -> None:
        self._words.copy_(self._saved)


def _row_bytes(t: Tensor) -> int:
    return t.element_size() * math.prod(t.shape[1:])


def _owned_planes(workspace: Tensor, payloads: list[Tensor], route: tuple) -> tuple[list[Tensor], Tensor, int]:
    """New tensors with this rank's receive planes of the dispatch of
    ``payloads`` that just ran, padding rows zeroed (whatever bytes they held,
    so an expert that multiplies them by a zero gradient gets no NaN), the
    int32 receive counts (the header's: a caller that keeps them clones them
    before its combine, the round's last reader of them) and the round's
    combine offset."""
    ep_rank, ep_size, runtime_max = route[0], route[1], route[3]
    call = layout.call_layout(ep_size, runtime_max, 0, [_row_bytes(p) for p in payloads])
    counts = _rank_words(workspace, ep_rank, layout.HDR_RECV_COUNTS, ep_size, torch.int32)
    valid = (torch.arange(runtime_max, device=workspace.device) < counts.unsqueeze(1)).unsqueeze(2)
    row = _row_start(workspace, ep_rank)
    planes = [_zeroed_plane(workspace, row + offset, (ep_size, runtime_max), valid, payload)
              for payload, offset in zip(payloads, call.payload_offsets)]
    return planes, counts, call.combine_offset


# The views here are built with fewer view calls than layout.region_view's
# four (select, narrow, two dtype and shape views): an exchange of the
# training path reads four to six regions, and on the host each view call
# costs about a microsecond.


def _row_start(workspace: Tensor, rank: int) -> int:
    """Where rank ``rank``'s row starts in the uint8 workspace's storage (bytes)."""
    return workspace.storage_offset() + rank * workspace.stride(0)


def _rank_words(workspace: Tensor, rank: int, offset: int, n: int, dtype: torch.dtype) -> Tensor:
    """The ``[n]`` ``dtype`` view at byte ``offset`` of rank ``rank``'s row (layout.region_view's)."""
    return workspace[rank, offset:offset + n * dtype.itemsize].view(dtype)


# The integer dtype of each word width, for a plane zeroed as words.
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _zeroed_plane(workspace: Tensor, start: int, leading: tuple[int, int], valid: Tensor, payload: Tensor) -> Tensor:
    """A new tensor with the plane of ``payload``'s rows at byte ``start`` of
    the workspace's storage, ``[*leading, *payload.shape[1:]]``, the rows where
    ``valid`` ([*leading, 1] bool) is False zeroed."""
    shape = (*leading, *payload.shape[1:])
    row_bytes = _row_bytes(payload)
    if row_bytes == 0:  # no bytes to view as the dtype (a size of 0 in the row's shape)
        return torch.zeros(shape, dtype=payload.dtype, device=workspace.device)
    # Zeroed as words, one path for every dtype (all-zero bytes are a zero of
    # each): the widest integer words that divide the row and its start, for
    # on the CPU a where over bytes runs ten times slower than over int64s.
    width = math.gcd(row_bytes, start, 8)
    plane = workspace.as_strided((*leading, row_bytes), (leading[1] * row_bytes, row_bytes, 1), start)
    if width > 1:
        plane = plane.view(_WORDS[width])
    return torch.where(valid, plane, 0).view(payload.dtype).view(shape)


# ---- the eager path -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Eager:
    """What the eager path needs of an op: its Python function, its autograd
    (as registered), and the positions of its tensor and tensor-list
    arguments (an ``autograd.Function`` sees tensors only as direct
    arguments)."""

    impl: Callable
    setup_context: Callable
    backward: Callable
    tensor_args: tuple[int, ...]  # Tensor and List[Tensor] arguments, in order
    list_args: tuple[int, ...]  # the List[Tensor] ones
    # Whether the backward needs a tensor for every output's gradient
    # (autograd's zeros where an output got none); else it takes None.
    materialize_grads: bool


_IMPLS: dict[Any, Callable] = {}
_EAGER: dict[Any, _Eager] = {}


def _custom_op(name: str, dispatcher_check: Optional[Callable[[Tensor, int], None]] = None) -> Callable:
    """``torch.library.custom_op`` of ``moe_a2a::name`` (mutating no argument),
    keeping the Python function for the eager path. ``dispatcher_check``
    (given the call's ``workspace`` and ``ep_rank``) runs before the function
    where the call comes through the dispatcher (traced, or from a compiled
    graph), not on the eager path, which checks before it calls."""

    def wrap(fn: Callable):
        registered = fn
        if dispatcher_check is not None:
            names = list(inspect.signature(fn).parameters)
            at_workspace, at_rank = names.index("workspace"), names.index("ep_rank")

            @functools.wraps(fn)
            def registered(*args):
                dispatcher_check(args[at_workspace], args[at_rank])
                return fn(*args)

        op = torch.library.custom_op(f"moe_a2a::{name}", mutates_args=())(registered)
        _IMPLS[op] = fn
        return op

    return wrap


def _register_autograd(op, backward: Callable, setup_context: Callable, what: str,
                       materialize_grads: bool = True) -> None:
    """``op.register_autograd``, and the same autograd for the eager path,
    which hands ``backward`` None for an output without a gradient unless
    ``materialize_grads`` (the registered autograd always hands it zeros).
    ``what``: the backward's exchanges, for the note on an error they raise."""
    backward = _noted_backward(backward, what)
    op.register_autograd(_given_arguments_only(backward), setup_context=setup_context)
    types = [str(a.type) for a in op._opoverload._schema.arguments]
    tensors = tuple(i for i, t in enumerate(types) if t in ("Tensor", "List[Tensor]"))
    lists = tuple(i for i, t in enumerate(types) if t == "List[Tensor]")
    _EAGER[op] = _Eager(_IMPLS[op], setup_context, backward, tensors, lists, materialize_grads)


def _given_arguments_only(backward: Callable) -> Callable:
    """``backward`` as the registered autograd calls it: the dispatcher
    leaves trailing arguments that equal their default (a round op's
    ``round_tag`` of ROUND_TAG_ANY) out of the op's arguments, and torch wants a
    gradient for each argument given, no more (``ctx.needs_input_grad`` has
    one entry each)."""

    def given(ctx, *grads):
        result = backward(ctx, *grads)
        return result[:len(ctx.needs_input_grad)] if isinstance(result, tuple) else result

    return given


def _noted_backward(backward: Callable, what: str) -> Callable:
    """``backward``, whose RuntimeErrors (an exchange's: a timeout, a round
    out of order) get a note that a backward raised them: their messages
    name the dispatch or combine that failed, which the caller did not call."""

    def noted(ctx, *grads):
        try:
            return backward(ctx, *grads)
        except RuntimeError as e:
            e.add_note(f"(raised in the backward of {what}; a backward exchanges too, so every rank runs the same "
                       "backward sequence, and not while a round of its own is open: after a dispatch, before "
                       "its combine)")
            raise

    return noted


class _EagerFunction(torch.autograd.Function):
    """An op of this module in eager mode: the forward calls its Python
    function and its ``setup_context``, the backward its registered backward.
    ``apply`` gets the op's arguments as they are, then their tensors (the
    tensor lists' flattened): only the tensors as direct arguments, each of
    the others once inside ``args`` (apply's cost grows with its arguments,
    which are mostly the route's ints)."""

    @staticmethod
    def forward(ctx, entry: _Eager, args: tuple, *tensors):
        # The op's arguments with the tensors apply handed over.
        args, at, lengths = list(args), 0, []
        for i in entry.tensor_args:
            if i in entry.list_args:
                n = len(args[i])
                args[i] = list(tensors[at:at + n])
                lengths.append(n)
                at += n
            else:
                args[i] = tensors[at]
                at += 1
        output = entry.impl(*args)
        entry.setup_context(ctx, tuple(args), output)
        ctx.entry, ctx.lengths, ctx.list_output = entry, tuple(lengths), isinstance(output, list)
        if not entry.materialize_grads:
            ctx.set_materialize_grads(False)
        outputs = tuple(output) if ctx.list_output else (output,)
        integral = [t for t in outputs if not t.is_floating_point()]
        if integral:
            ctx.mark_non_differentiable(*integral)
        return outputs if ctx.list_output else output

    @staticmethod
    def backward(ctx, *grads):
        entry = ctx.entry
        result = entry.backward(ctx, list(grads) if ctx.list_output else grads[0])
        result = result if isinstance(result, tuple) else (result,)
        flat: list[Optional[Tensor]] = []
        for i in entry.tensor_args:
            g = result[i]
            if i in entry.list_args:
                flat.extend([None] * ctx.lengths[entry.list_args.index(i)] if g is None else g)
            else:
                flat.append(g)
        return None, None, *flat


def _traced() -> bool:
    """Whether calls are being traced or transformed (torch.compile, a
    dispatch mode such as FakeTensorMode or make_fx's, a functorch transform):
    then the ops run as ops (a dispatch mode sees them), and the eager
    bookkeeping is skipped unless :func:`_recorded` says otherwise."""
    return (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            or torch._C._are_functorch_transforms_active())


def _recorded() -> bool:
    """Whether this call keeps the eager bookkeeping: eager, or under selective
    checkpointing's forward mode (not its recomputation: checkpoint_forward)."""
    return not _traced() or checkpoint_forward()


def _plain(t: Tensor) -> bool:
    return type(t) is Tensor or type(t) is torch.nn.Parameter


def _call(op, *args):
    """``op(*args)``; in eager mode through :class:`_EagerFunction` (or the
    op's Python function alone where no input requires grad), the same
    computation without the dispatcher's Python cost."""
    if torch._C._are_functorch_transforms_active():
        # Else torch's error about autograd.Function's setup_context, which names nothing of ours.
        raise NotImplementedError(
            "the differentiable exchanges do not support torch.func transforms (grad, vjp, jacrev, vmap, ...): "
            "they are collectives that every rank runs once, writing a shared workspace; compute gradients with "
            "torch.autograd (loss.backward() or torch.autograd.grad)")
    entry = _EAGER[op]
    if _traced():
        return op(*args)
    tensors = []
    for i in entry.tensor_args:
        if i in entry.list_args:
            tensors.extend(args[i])
        else:
            tensors.append(args[i])
    refuse_forward_ad("the differentiable exchanges", tensors)
    requires_grad = False
    for t in tensors:
        if isinstance(t, Tensor):
            if not _plain(t):
                return op(*args)
            requires_grad = requires_grad or t.requires_grad
    if requires_grad and torch.is_grad_enabled():
        return _EagerFunction.apply(entry, args, *tensors)
    return entry.impl(*args)


# ---- the ops -------------------------------------------------------------------------------------------


# The graph task (torch._C._current_graph_task_id: -1 outside a backward) in
# which each rank's last forward dispatch ran, by workspace address and rank;
# a backward's round removes the entry (it closed that dispatch's round). A
# forward combine runs inside a backward only as a recomputation, which must
# have recomputed its dispatch in that backward, with no backward round in
# between: a compiled step's partitioner may recompute a combine whose
# dispatch lies outside the checkpointed region, and that combine would run
# as one of a later round (wrong gradients: compiled calls make no host
# checks). The dispatch and round ops' bodies note at every call; the
# combine ops check where called through the dispatcher (_custom_op's
# dispatcher_check): eager calls (through _call) are checked before, against
# the ids of the rank's last dispatch, and a combine that passes there is right.
_FORWARD_DISPATCH_TASK: dict[tuple[int, int], int] = {}


def _note_forward_dispatch(workspace: Tensor, rank: int) -> None:
    _FORWARD_DISPATCH_TASK[(workspace.data_ptr(), rank)] = torch._C._current_graph_task_id()


def _note_backward_round(workspace: Tensor, rank: int) -> None:
    _FORWARD_DISPATCH_TASK.pop((workspace.data_ptr(), rank), None)


def _refuse_recomputed_combine_alone(fn: str) -> Callable[[Tensor, int], None]:
    """The dispatcher_check of a forward combine op (``fn``: the function it serves)."""

    def check(workspace: Tensor, rank: int) -> None:
        task = torch._C._current_graph_task_id()
        if task != -1 and _FORWARD_DISPATCH_TASK.get((workspace.data_ptr(), rank)) != task:
            raise RuntimeError(_RECOMPUTED_COMBINE_ALONE.format(fn=fn))

    return check


_RECOMPUTED_COMBINE_ALONE = (
    "{fn}: a combine recomputed in the backward without its dispatch (a checkpointed region that holds the combine "
    "but not its dispatch, whose combine the recomputation runs again: a selective checkpointing policy that "
    "recomputes it, or a compiled step's partitioner): it would run as a combine of a later round and give wrong "
    "gradients. Checkpoint with context_fn=torch_moe_a2a.checkpoint_context, which saves the exchanges' outputs, or "
    "put the dispatch in the region too")


@_custom_op("dispatch_owned")
def dispatch_owned(token_selected_experts: Tensor, input_payloads: list[Tensor], workspace: Tensor, ep_rank: int,
                   ep_size: int, max_num_tokens: int, runtime_max_tokens_per_rank: int, top_k: int,
                   num_experts: int, active_rank_mask: list[int], timeout_s: float, mailbox: int,
                   enable_pdl: bool) -> list[Tensor]:
    """The dispatch op; returns ``[*planes, recv_counts]`` (new tensors, see :func:`_owned_planes`)."""
    _note_forward_dispatch(workspace, ep_rank)
    if direct_call_ok(token_selected_experts, workspace, *input_payloads):
        received = _C.dispatch_owned(token_selected_experts, input_payloads, workspace, ep_rank, ep_size,
                                     max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts,
                                     active_rank_mask, timeout_s, mailbox, enable_pdl)
    else:
        route = (ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts,
                 active_rank_mask, timeout_s, mailbox, enable_pdl)
        with _Unrecorded():
            _dispatch(token_selected_experts, input_payloads, workspace, route, 0)
            planes, counts, _ = _owned_planes(workspace, input_payloads, route)
            received = [*planes, counts.clone()]
    return received


@_custom_op("combine_owned", _refuse_recomputed_combine_alone("moe_a2a_combine_differentiable"))
def combine_owned(payload: Tensor, token_selected_experts: Tensor, workspace: Tensor, combine_payload_offset: int,
                  ep_rank: int, ep_size: int, max_num_tokens: int, runtime_max_tokens_per_rank: int, top_k: int,
                  num_experts: int, active_rank_mask: list[int], timeout_s: float, mailbox: int,
                  enable_pdl: bool) -> Tensor:
    """The combine op closing the round ``dispatch_owned`` opened; ``[local_num_tokens, *row]`` of payload's dtype."""
    if direct_call_ok(payload, token_selected_experts, workspace):
        out = _C.combine_owned(payload, token_selected_experts, workspace, combine_payload_offset, ep_rank, ep_size,
                               max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts, active_rank_mask,
                               timeout_s, mailbox, enable_pdl)
    else:
        route = (ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts,
                 active_rank_mask, timeout_s, mailbox, enable_pdl)
        with _Unrecorded():
            out = _combine(payload, token_selected_experts.shape[0], workspace, combine_payload_offset, route)
    return out


@_custom_op("dispatch_round")
def dispatch_round(rows: Tensor, token_selected_experts: Tensor, workspace: Tensor, ep_rank: int, ep_size: int,
                   max_num_tokens: int, runtime_max_tokens_per_rank: int, top_k: int, num_experts: int,
                   active_rank_mask: list[int], timeout_s: float, mailbox: int, enable_pdl: bool,
                   round_tag: int = ROUND_TAG_ANY) -> Tensor:
    """A dispatch of ``rows`` ``[local_num_tokens, *row]`` carrying
    ``round_tag`` (its forward exchange's: fastpath.round_tag_of_last_exchange;
    ROUND_TAG_ANY, the default, for an exchange not known: a compiled
    backward's) then a combine of one fp32
    zero per row (closing the round); returns the received plane
    ``[ep_size, runtime_max_tokens_per_rank, *row]``, padding rows zero."""
    _note_backward_round(workspace, ep_rank)
    if direct_call_ok(rows, token_selected_experts, workspace):
        plane = _C.dispatch_round(rows, token_selected_experts, workspace, ep_rank, ep_size, max_num_tokens,
                                  runtime_max_tokens_per_rank, top_k, num_experts, active_rank_mask, timeout_s,
                                  mailbox, enable_pdl, round_tag)
    else:
        route = (ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts,
                 active_rank_mask, timeout_s, mailbox, enable_pdl)
        with _Unrecorded(), _TalliesKept(workspace, ep_rank):
            _dispatch(token_selected_experts, [rows], workspace, route, round_tag)
            (plane,), _, offset = _owned_planes(workspace, [rows], route)
            nothing = torch.zeros((ep_size, runtime_max_tokens_per_rank, 1), dtype=torch.float32, device=rows.device)
            _combine(nothing, rows.shape[0], workspace, offset, route)
    note_backward_round(workspace, ep_rank)
    return plane


@_custom_op("combine_round")
def combine_round(payloads: list[Tensor], token_selected_experts: Tensor, workspace: Tensor, ep_rank: int,
                  ep_size: int, max_num_tokens: int, runtime_max_tokens_per_rank: int, top_k: int, num_experts: int,
                  active_rank_mask: list[int], timeout_s: float, mailbox: int, enable_pdl: bool,
                  round_tag: int = ROUND_TAG_ANY) -> list[Tensor]:
    """A dispatch of the expert ids alone (the routes of these ids) carrying
    ``round_tag`` (as :func:`dispatch_round`'s) then a combine of each of
    ``payloads`` (at least one, each ``[ep_size,
    runtime_max_tokens_per_rank, *row]``; after the first, the round's
    repeated combines); returns their sums, ``[local_num_tokens, *row]`` each."""
    _note_backward_round(workspace, ep_rank)
    if direct_call_ok(token_selected_experts, workspace, *payloads):
        sums = _C.combine_round(payloads, token_selected_experts, workspace, ep_rank, ep_size, max_num_tokens,
                                runtime_max_tokens_per_rank, top_k, num_experts, active_rank_mask, timeout_s,
                                mailbox, enable_pdl, round_tag)
    else:
        if not payloads:  # without a combine the round would stay open
            raise ValueError("combine_round needs at least one payload")
        route = (ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts,
                 active_rank_mask, timeout_s, mailbox, enable_pdl)
        ids = token_selected_experts
        offset = layout.call_layout(ep_size, runtime_max_tokens_per_rank, 0, (_row_bytes(ids),)).combine_offset
        with _Unrecorded(), _TalliesKept(workspace, ep_rank):
            _dispatch(ids, [ids], workspace, route, round_tag)
            sums = [_combine(payload, ids.shape[0], workspace, offset, route) for payload in payloads]
    note_backward_round(workspace, ep_rank)
    return sums


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
def _(payloads, token_selected_experts, workspace, *route):
    return [p.new_empty((token_selected_experts.shape[0], *p.shape[2:])) for p in payloads]


# ---- their autograd ------------------------------------------------------------------------------------
# Saved: the expert ids (save_for_backward, so an in-place change of them is
# caught) and the plain ints. The workspace is kept as an attribute, not saved:
# the backward needs its memory, never its old contents, so no version check
# applies (the plain functions' exchanges move its version counter). Each node
# also keeps the round tag of its exchange (fastpath.round_tag_of_last_exchange:
# the workspace ops that the op's body called have just counted it), which its
# backward's rounds carry: the round ops' last argument.

_ROUTE_GRADS = (None,) * 10  # the route arguments' gradients


def _list_route_grads(route: tuple) -> tuple:
    """The route arguments' gradients for an op with a tensor-list argument or
    result: its gradients' structure must match the arguments' pytree, where an
    empty rank mask is an empty list."""
    return (*_ROUTE_GRADS[:6], None if route[6] else [], *_ROUTE_GRADS[7:])


def _keep_route(ctx, ids: Tensor, workspace: Tensor, route: tuple) -> None:
    ctx.save_for_backward(ids)
    ctx.workspace = workspace
    ctx.route = route
    ctx.round_tag = round_tag_of_last_exchange(workspace, route[0])


def _backward_tag(ctx) -> int:
    """The round tag that ``ctx``'s backward rounds carry: its node's, or
    ROUND_TAG_ANY where the backward is traced (compiled autograd), whose
    graph would hold the number as a constant."""
    return ROUND_TAG_ANY if torch.compiler.is_compiling() else ctx.round_tag


def _setup_dispatch_owned(ctx, inputs, output):
    ids, payloads, workspace, *route = inputs
    _keep_route(ctx, ids, workspace, tuple(route))
    ctx.payloads = [(p.dtype, tuple(p.shape[1:])) for p in payloads]
    ctx.differentiated = [i for i, p in enumerate(payloads) if _differentiated(p)]


def _differentiated(payload: Tensor) -> bool:
    """Whether a dispatch's backward combines this payload's gradient: a
    floating payload that requires grad (a router weight sent beside the rows
    without a gradient of its own would otherwise widen every gradient row to
    fp32)."""
    return payload.requires_grad and payload.dtype in GRAD_DTYPES


def _dtype_groups(ctx) -> dict[torch.dtype, list[int]]:
    """The payloads that require grad by dtype (in order of first appearance),
    their indices in order: one combine of the backward each."""
    groups: dict[torch.dtype, list[int]] = {}
    for i in ctx.differentiated:
        groups.setdefault(ctx.payloads[i][0], []).append(i)
    return groups


def _backward_dispatch_owned(ctx, grads):
    """The gradients of the payloads that require grad in one
    ``combine_round``: a combine per dtype, each packing that dtype's
    gradients as the rows of one payload (the combine sums in fp32 and casts
    once, so this rounds as one combine per payload would), so that a bf16
    hidden state's gradient travels as bf16 beside fp32 router weights'."""
    (ids,) = ctx.saved_tensors
    route = ctx.route
    ep_size, runtime_max = route[1], route[3]
    groups = _dtype_groups(ctx)
    result: list[Optional[Tensor]] = [None] * len(ctx.payloads)
    if groups:
        packed = []
        for dtype, members in groups.items():
            parts = []
            for i in members:
                shape = (ep_size, runtime_max, math.prod(ctx.payloads[i][1]))
                g = grads[i]
                parts.append(ids.new_zeros(shape, dtype=dtype) if g is None else g.reshape(shape))
            packed.append(parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=2))
        sums = _call(combine_round, packed, ids, ctx.workspace, *route, _backward_tag(ctx))
        for members, summed in zip(groups.values(), sums):
            start = 0
            for i in members:
                width = math.prod(ctx.payloads[i][1])
                result[i] = summed[:, start:start + width].reshape(ids.shape[0], *ctx.payloads[i][1])
                start += width
    return None, result, None, *_list_route_grads(route)


def _setup_combine_owned(ctx, inputs, output):
    payload, ids, workspace, _, *route = inputs
    _keep_route(ctx, ids, workspace, tuple(route))


def _backward_combine_owned(ctx, grad):
    (ids,) = ctx.saved_tensors
    plane = _call(dispatch_round, grad.contiguous(), ids, ctx.workspace, *ctx.route, _backward_tag(ctx))
    return plane, None, None, None, *_ROUTE_GRADS


def _setup_round(ctx, inputs, output):
    # Last, the round's own tag (every caller here gives it; the dispatcher
    # fills in its default): the exchange it belongs to, not this node's.
    _, ids, workspace, *route, _ = inputs
    _keep_route(ctx, ids, workspace, tuple(route))


def _backward_dispatch_round(ctx, grad):
    (ids,) = ctx.saved_tensors
    (summed,) = _call(combine_round, [grad.contiguous()], ids, ctx.workspace, *ctx.route, _backward_tag(ctx))
    return summed, None, None, *_ROUTE_GRADS, None


def _backward_combine_round(ctx, grads):
    (ids,) = ctx.saved_tensors
    tag = _backward_tag(ctx)
    planes = [_call(dispatch_round, g.contiguous(), ids, ctx.workspace, *ctx.route, tag) for g in grads]
    return planes, None, None, *_list_route_grads(ctx.route), None


# The dispatches' backwards take None for a plane without a gradient (and
# ignore the integer outputs'): no zeros filled for the ids' plane and the counts.
_register_autograd(dispatch_owned, _backward_dispatch_owned, _setup_dispatch_owned,
                   "moe_a2a_dispatch_differentiable (a dispatch of the saved expert ids, then a combine of the "
                   "received rows' gradients)", materialize_grads=False)
_register_autograd(combine_owned, _backward_combine_owned, _setup_combine_owned,
                   "moe_a2a_combine_differentiable (a dispatch of the output's gradient, then a combine that closes "
                   "its round)")
_register_autograd(dispatch_round, _backward_dispatch_round, _setup_round, "a backward's dispatch (a double backward)")
_register_autograd(combine_round, _backward_combine_round, _setup_round, "a backward's combine (a double backward)")


# ---- the public functions ------------------------------------------------------------------------------


def _route_args(fn, token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank,
                ep_rank, ep_size, top_k, num_experts, enable_pdl, enable_rank_mask, active_rank_mask,
                timeout_s) -> tuple:
    """The ops' route arguments, after the checks of :func:`~torch_moe_a2a.arguments.dispatch_args`."""
    args, _ = dispatch_args(fn, token_selected_experts, input_payloads, workspace, metainfo,
                            runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts, enable_pdl, None,
                            enable_rank_mask, active_rank_mask, "trtllm", timeout_s)
    # After dispatch_args, whose metainfo check names a bool rank as the plain functions' does.
    if not (type(runtime_max_tokens_per_rank) is int and type(ep_rank) is int and type(ep_size) is int
            and type(top_k) is int and type(num_experts) is int):
        expect_traced_ints(fn, runtime_max_tokens_per_rank=runtime_max_tokens_per_rank, ep_rank=ep_rank,
                           ep_size=ep_size, top_k=top_k, num_experts=num_experts)
    return (*args[3:9], list(args[11]), *args[12:])


def _needs_backward(tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def _refuse_inference_tensors(fn: str, **saved: Optional[Tensor]) -> None:
    """Refuses tensors that the call's autograd node would save for its
    backward but cannot: inference tensors (made under
    ``torch.inference_mode()``). Autograd refuses them only once the op has
    run, its exchange made: the rank's round would stay open, and its next
    call fail on every rank. Checked before anything runs instead; an eager
    check, as the other host checks of these calls (not while
    ``torch.compile`` traces)."""
    if torch.compiler.is_compiling():
        return
    for name, t in saved.items():
        if isinstance(t, Tensor) and t.is_inference():
            raise ValueError(f"{fn}: {name} is an inference tensor (made under torch.inference_mode()), which "
                             f"autograd cannot save for this call's backward; make it outside inference_mode, or "
                             f"pass a clone made outside it ({name}.clone())")


def _round_end(ep_size: int, T: int, dispatch_rows, combine_row: int) -> int:
    """Bytes per rank of a rank-major round: a dispatch of rows of
    ``dispatch_rows`` bytes, then a combine of rows of ``combine_row``."""
    start = layout.call_layout(ep_size, T, 0, tuple(dispatch_rows)).combine_offset
    return layout.combine_end(start, ep_size, T, combine_row)


def _em_round_end(ep_size: int, T: int, top_k: int, num_experts: int, M: int, user_rows, ids_row: int,
                  combine_row: int) -> int:
    """Bytes per rank of an expert-major round of the differentiable ops: a
    dispatch of ``user_rows`` beside the ids and fp32 weights, the build,
    then a combine of rows of ``combine_row`` bytes a pair."""
    local = layout.max_local_experts(num_experts, ep_size)
    start = layout.call_layout(ep_size, T, 0, [*user_rows, ids_row, 4 * top_k]).combine_offset
    em = layout.expert_major_layout(start, ep_size, T, top_k, local, M, list(user_rows))
    return em.combine_offset + local * M * combine_row


def _check_backward_fits(fn: str, workspace: Tensor, needed: int, what: str) -> None:
    """Refuses a forward whose backward would not fit the workspace, before
    anything runs: the backward's dispatch would run and its combine be
    refused, leaving a round open that only moe_a2a_initialize closes."""
    if needed > workspace.shape[1]:
        raise ValueError(f"{fn}: workspace too small for the backward of this call: it needs {needed} bytes per rank, "
                         f"the workspace has {workspace.shape[1]}; {what}")


# The ids of a rank's last dispatch, written in place since (fastpath.last_dispatch).
_IDS_CHANGED = ("{fn}: the expert ids of this rank's preceding dispatch (its token_selected_experts tensor) were "
                "written in place since that dispatch: the combine's backward would send the output gradient along "
                "other routes than the forward's (wrong gradients); keep them unchanged until the combine (change "
                "a clone). To go on, close this round with a combine of a payload that needs no gradient (detached) "
                "and dispatch again")


def _check_combine_ids(fn: str, workspace: Tensor, rank: int, ids: Tensor, num_experts: int,
                       counts: Optional[Tensor] = None, needs_backward: bool = False) -> None:
    """``ids`` and ``num_experts`` (and ``counts``, expert-major) must be those
    of this rank's last dispatch on ``workspace`` (fastpath.note_dispatch: the
    backward lays its routes from ``ids`` and ``num_experts``, the forward
    follows the dispatch's). The same tensor costs nothing, but where the
    combine ``needs_backward`` it must not have been written in place since
    (its version counter; a tensor that is part of a larger storage is not
    checked so); another one is compared by value, in either id width (a
    host sync, off the usual path).
    A combine that ``needs_backward`` must follow a differentiable dispatch:
    a plain one's received rows are workspace views, which the backward's
    exchange overwrites before the payload's own backward reads what it saved
    of them (an expert's input: wrong gradients, with no error)."""
    if not _recorded():
        return
    refuse_combine_after_backward(fn, workspace, rank, tracing())
    last = last_dispatch(workspace, rank)
    if needs_backward and (last is None or last[3]):
        raise ValueError(f"{fn}: this rank's preceding dispatch on the workspace was not a differentiable one (a "
                         "plain dispatch, or none): its received rows are workspace views that this combine's "
                         "backward overwrites before the expert's backward reads what it saved of them (wrong "
                         "gradients); dispatch with the differentiable function, whose received rows are new "
                         "tensors")
    if needs_backward and last is not None and last[4]:
        raise ValueError(_IDS_CHANGED.format(fn=fn))
    dispatched = None if last is None else last[0]
    if dispatched is not None and dispatched is not ids and not (
            dispatched.shape == ids.shape and dispatched.device == ids.device
            and torch.equal(dispatched.long(), ids.long())):
        raise ValueError(f"{fn}: token_selected_experts must be the expert ids of this rank's preceding dispatch "
                         "(the backward dispatches the output gradient along their routes), got other ids (a "
                         "checkpointed region that holds a combine without its dispatch re-runs the combine in the "
                         "backward, after later dispatches: checkpoint with "
                         "context_fn=torch_moe_a2a.checkpoint_context). To go on, close this round with a combine of "
                         "the dispatch's ids and dispatch again")
    if last is not None and num_experts != last[2]:
        raise ValueError(f"{fn}: num_experts must be that of this rank's preceding dispatch ({last[2]}; the "
                         f"backward dispatches the output gradient along its routes), got {num_experts}")
    last_counts = None if last is None else last[1]
    if counts is not None and last_counts is not None and counts is not last_counts:
        raise ValueError(f"{fn}: dispatched must be the ExpertMajorDispatch of this rank's preceding "
                         "expert-major dispatch (its expert_counts are another dispatch's)")


def _check_grad_dtypes(fn: str, input_payloads: list[Tensor]) -> None:
    for i, p in enumerate(input_payloads):
        if isinstance(p, Tensor) and p.requires_grad and p.dtype not in GRAD_DTYPES:
            raise ValueError(f"{fn}: input_payloads[{i}] requires grad but is {p.dtype}; "
                             "gradients flow back through a combine, whose dtypes are bf16, fp16 and fp32")


# ---- activation checkpointing ------------------------------------------------------------------


def checkpoint_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The selective activation checkpointing policy of the exchanges: the
    outputs of every ``torch.ops.moe_a2a`` op are saved, never recomputed.

    A recomputation re-runs the ops of a checkpointed region in the backward,
    and where the backward needs the received rows but not the combine's
    output (an expert that saves its input, or a region that holds a dispatch
    but not its combine) it re-runs the dispatch alone: a dispatch without its
    combine, which every later exchange refuses. ``torch.compile``'s
    partitioner may recompute that way inside a checkpointed region
    (depending on the graph). Saving the exchanges keeps each
    round whole; it costs the received rows' memory, and saves an all-to-all
    in the backward.

    Args:
        ctx: the policy's context (``torch.utils.checkpoint``'s).
        op: the op about to run or be recomputed.
        args, kwargs: its arguments (unused).

    Returns:
        ``CheckpointPolicy.MUST_SAVE`` for an op of the ``moe_a2a`` namespace,
        ``CheckpointPolicy.PREFER_RECOMPUTE`` for any other op.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if _is_exchange_op(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _is_exchange_op(op: Any) -> bool:
    return getattr(op, "namespace", None) == "moe_a2a"


def checkpoint_context(policy: Optional[Callable[..., Any]] = None) -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
    a checkpointed region that holds exchanges saves them (:func:`checkpoint_policy`)
    and recomputes the rest, in eager mode and under ``torch.compile``.

    ``checkpoint(layer, x, use_reentrant=False, context_fn=checkpoint_context)``;
    with a policy of your own for the other ops,
    ``context_fn=functools.partial(checkpoint_context, my_policy)``.

    Args:
        policy: the selective checkpointing policy (``(ctx, op, *args,
            **kwargs) -> CheckpointPolicy``) of every op that is not an
            exchange; None: recompute them (``PREFER_RECOMPUTE``).

    Returns:
        The pair of context managers of
        ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

    Raises:
        ValueError: ``policy`` neither callable nor None (a
            ``CheckpointPolicy`` value, say).
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if policy is None:
        return create_selective_checkpoint_contexts(checkpoint_policy)
    if not callable(policy):
        # Else the first op of the region failed on calling it ("'str' object is not callable"), in the forward.
        raise ValueError("checkpoint_context: policy must be a function (ctx, op, *args, **kwargs) -> "
                         f"CheckpointPolicy, or None, got {policy!r}")

    def combined(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return checkpoint_policy(ctx, op) if _is_exchange_op(op) else policy(ctx, op, *args, **kwargs)

    return create_selective_checkpoint_contexts(combined)


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
        ValueError: as :func:`~torch_moe_a2a.moe_a2a_dispatch`
            (``input_payloads`` not a list or tuple of tensors among them); a
            payload that requires grad and is not bf16, fp16 or fp32.
        RuntimeError: peers that did not arrive within the timeout.
    """
    return _dispatch_differentiable("moe_a2a_dispatch_differentiable", token_selected_experts, input_payloads,
                                    workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size, top_k,
                                    num_experts, enable_pdl, enable_rank_mask, active_rank_mask, timeout_s=timeout_s)


def _dispatch_differentiable(fn: str, token_selected_experts: Tensor, input_payloads: list[Tensor], workspace: Tensor,
                             metainfo: Tensor, runtime_max_tokens_per_rank: int, ep_rank: int, ep_size: int,
                             top_k: int, num_experts: int, enable_pdl: Optional[bool], enable_rank_mask: bool,
                             active_rank_mask: Optional[Tensor],
                             timeout_s: Optional[float]) -> tuple[list[Tensor], int, Tensor]:
    """moe_a2a_dispatch_differentiable, its errors naming ``fn`` (the plain dispatch runs as it)."""
    expect_tensor_list(fn, "input_payloads", input_payloads)
    _check_grad_dtypes(fn, input_payloads)
    route = _route_args(fn, token_selected_experts, input_payloads, workspace, metainfo,
                        runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts, enable_pdl,
                        enable_rank_mask, active_rank_mask, timeout_s)
    floating = [p for p in input_payloads if _differentiated(p)]
    if _needs_backward(floating):
        _refuse_inference_tensors(fn, token_selected_experts=token_selected_experts)
        # The backward (combine_round): the ids' plane, then a combine per
        # dtype of the gradients of the payloads that require grad, each into
        # the same rows after the plane: the widest dtype's row must fit.
        rows: dict[torch.dtype, int] = {}
        for p in floating:
            rows[p.dtype] = rows.get(p.dtype, 0) + _row_bytes(p)
        dtype, row = floating[0].dtype, 0
        for d, r in rows.items():  # the widest (max with a key is not traceable by Dynamo)
            if r > row:
                dtype, row = d, r
        ids_row = _row_bytes(token_selected_experts)
        _check_backward_fits(fn, workspace,
                             _round_end(ep_size, runtime_max_tokens_per_rank, (ids_row,), row),
                             f"it combines the gradients of the payloads that require grad, a combine per dtype "
                             f"(the widest rows: {row} bytes of {dtype}), after the ids' row of {ids_row}: size the "
                             f"workspace so that its dispatch and combine bytes per token together cover "
                             f"{ids_row + row} (moe_a2a_get_workspace_size_per_rank)")
    *received, counts = _call(dispatch_owned, token_selected_experts, list(input_payloads), workspace, *route)
    if _recorded():
        note_dispatch(workspace, ep_rank, token_selected_experts, num_experts)
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
        token_selected_experts: the ids of this rank's preceding dispatch on
            the workspace (its routes; the backward dispatches the output
            gradient along them): :func:`moe_a2a_dispatch_differentiable`,
            or a plain one when ``payload`` needs no gradient (a plain
            dispatch's received rows are workspace views, which the backward
            overwrites).
        the rest: as for that dispatch; ``combine_payload_offset`` is the offset it returned.

    Returns:
        ``[local_num_tokens, *row_shape]`` of the payload's dtype: as
        :func:`~torch_moe_a2a.moe_a2a_combine` (fp32 sums in ascending rank
        order, cast once). A new tensor.

    Raises:
        ValueError: as :func:`~torch_moe_a2a.moe_a2a_combine` (``payload``
            not a tensor among them); ids or num_experts other than those of
            this rank's preceding dispatch; a ``payload`` that needs a
            gradient after a plain dispatch.
        RuntimeError: as :func:`~torch_moe_a2a.moe_a2a_combine`.
    """
    return _combine_differentiable("moe_a2a_combine_differentiable", payload, token_selected_experts, workspace,
                                   metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts,
                                   combine_payload_offset, enable_pdl, enable_rank_mask, active_rank_mask,
                                   timeout_s=timeout_s)


def _combine_differentiable(fn: str, payload: Tensor, token_selected_experts: Tensor, workspace: Tensor,
                            metainfo: Tensor, runtime_max_tokens_per_rank: int, ep_rank: int, ep_size: int, top_k: int,
                            num_experts: int, combine_payload_offset: int, enable_pdl: Optional[bool],
                            enable_rank_mask: bool, active_rank_mask: Optional[Tensor],
                            timeout_s: Optional[float]) -> Tensor:
    """moe_a2a_combine_differentiable, its errors naming ``fn`` (the plain combine runs as it)."""
    expect_tensors(fn, payload=payload)
    if type(combine_payload_offset) is not int:
        expect_traced_ints(fn, combine_payload_offset=combine_payload_offset)
    route = _route_args(fn, token_selected_experts, [payload], workspace, metainfo, runtime_max_tokens_per_rank,
                        ep_rank, ep_size, top_k, num_experts, enable_pdl, enable_rank_mask, active_rank_mask,
                        timeout_s)
    needs_backward = _needs_backward([payload])
    _check_combine_ids(fn, workspace, ep_rank, token_selected_experts, num_experts, needs_backward=needs_backward)
    if needs_backward:
        _refuse_inference_tensors(fn, token_selected_experts=token_selected_experts)
        # The backward (dispatch_round): the gradient's plane, then a combine of one fp32 per row.
        row = payload.element_size() * math.prod(payload.shape[2:])
        _check_backward_fits(fn, workspace, _round_end(ep_size, runtime_max_tokens_per_rank, (row,), 4),
                             f"it dispatches the output gradient (rows of {row} bytes): size the workspace so that "
                             f"its dispatch and combine bytes per token together cover {row + 4} "
                             "(moe_a2a_get_workspace_size_per_rank)")
    # Contiguous as the expert-major combine's: the op takes contiguous rows only.
    return _call(combine_owned, payload.contiguous(), token_selected_experts, workspace, combine_payload_offset,
                 *route)


# ---- expert-major ----------------------------------------------------------------------------------------
# The same scheme over the expert-major layout (docs/DESIGN.md, 'Gradients'),
# with four more ops:
#
# - ``dispatch_em_owned``: an expert-major dispatch whose planes, counts,
#   local expert ids and per-pair router weights come back as new tensors; the
#   round stays open for the combine.
# - ``combine_em_owned``: the weighted combine closing that round, with the
#   per-pair weights an input (written into the workspace's weights region
#   before the combine reads it), so that they get a gradient.
# - ``dispatch_em_round``: a whole round, an expert-major dispatch of one
#   payload with per-slot values as its router weights, then a combine of one
#   fp32 zero per pair: each pair gets its token's row and its slot's value.
# - ``combine_em_round``: a whole round, the adjoint: each token gets the fp32
#   sum of its pairs' rows (ascending destination rank, local expert, top-k
#   slot) and, per top-k slot, the value of the pair of that slot.
#
# The round ops are each other's backward; the backward of ``combine_em_owned``
# is a ``dispatch_em_round`` of the output gradient, that of
# ``dispatch_em_owned`` a ``combine_em_round`` of the planes' gradients.
#
# Finding a pair's top-k slot: the expert-major dispatch writes each pair's
# router weight into the weights region, so a dispatch whose router weights are
# the slot indices (exact in fp32) makes it write every pair's slot there.
# ``combine_em_round`` reads them, then sets that region to 1.0 (an
# unweighted combine), and places each pair's value in its slot's column of an
# fp32 row: every other pair of the token adds an exact zero to that column.


def _dispatch_em(ids: Tensor, payloads: list[Tensor], weights: Tensor, workspace: Tensor, max_tokens_per_expert: int,
                 route: tuple, round_tag: int) -> tuple[int, layout.ExpertMajorLayout]:
    """The expert-major dispatch (``dispatch_expert_major``) of
    ``[*payloads, ids, weights]`` (``weights`` fp32 ``[local_num_tokens,
    top_k]``), carrying ``round_tag`` (as :func:`_dispatch`); returns the
    rank-major dispatch's end and the layout."""
    ep_rank, ep_size, max_num_tokens, runtime_max, top_k, num_experts, mask, timeout_s, mailbox, pdl = route
    user_rows = [_row_bytes(p) for p in payloads]
    _ops.dispatch_expert_major.default(ids, [*payloads, ids, weights], workspace, ep_rank, ep_size, max_num_tokens,
                                       runtime_max, top_k, num_experts, None, 0, mask, timeout_s, mailbox, pdl,
                                       max_tokens_per_expert, user_rows, True, round_tag)
    dispatch_end = layout.call_layout(ep_size, runtime_max, 0, [*user_rows, _row_bytes(ids),
                                                                 _row_bytes(weights)]).combine_offset
    em = layout.expert_major_layout(dispatch_end, ep_size, runtime_max, top_k,
                                    layout.max_local_experts(num_experts, ep_size), max_tokens_per_expert, user_rows)
    return dispatch_end, em


def _combine_em(payload: Tensor, local_num_tokens: int, workspace: Tensor, max_tokens_per_expert: int,
                dispatch_end: int, offset: int, route: tuple) -> Tensor:
    ep_rank, ep_size, max_num_tokens, runtime_max, top_k, num_experts, mask, timeout_s, mailbox, pdl = route
    return _ops.combine_expert_major.default(payload, local_num_tokens, workspace, ep_rank, ep_size, max_num_tokens,
                                             runtime_max, top_k, num_experts, max_tokens_per_expert, dispatch_end,
                                             offset, payload.shape[2:], payload.dtype, payload.dtype, mask,
                                             timeout_s, mailbox, pdl)


def _local_experts(route: tuple) -> int:
    ep_rank, ep_size, num_experts = route[0], route[1], route[5]
    return layout.experts_per_rank(num_experts, ep_size)[ep_rank]


def _valid_pairs(counts: Tensor, max_tokens_per_expert: int) -> Tensor:
    """bool ``[num_local_experts, max_tokens_per_expert]``: the rows that hold a pair."""
    return torch.arange(max_tokens_per_expert, device=counts.device) < counts.unsqueeze(1)


def _owned_em(workspace: Tensor, payloads: list[Tensor], em: layout.ExpertMajorLayout, max_tokens_per_expert: int,
              route: tuple) -> tuple[list[Tensor], Tensor, Tensor, Tensor]:
    """New tensors with this rank's expert-major planes of the dispatch that
    just ran (padding rows zeroed, as in :func:`_owned_planes`), its counts,
    local expert ids and per-pair weights (0 in padding rows)."""
    rank, local, M = route[0], _local_experts(route), max_tokens_per_expert
    counts = _rank_words(workspace, rank, em.counts_offset, local, torch.int32).clone()
    valid = _valid_pairs(counts, M).unsqueeze(2)
    row = _row_start(workspace, rank)
    planes = [_zeroed_plane(workspace, row + offset, (local, M), valid, payload)
              for payload, offset in zip(payloads, em.payload_offsets)]
    ids = _rank_words(workspace, rank, em.ids_offset, local * M, torch.int32).view(local, M).clone()
    weights = _rank_words(workspace, rank, em.weights_offset, local * M, torch.float32).view(local, M).clone()
    return planes, counts, ids, weights


def _slot_indices(ids: Tensor) -> Tensor:
    """fp32 ``[local_num_tokens, top_k]``: each slot's index, as router weights."""
    return torch.arange(ids.shape[1], dtype=torch.float32, device=ids.device).expand(ids.shape).contiguous()


@_custom_op("dispatch_em_owned")
def dispatch_em_owned(token_selected_experts: Tensor, input_payloads: list[Tensor], router_weights: Tensor,
                      workspace: Tensor, max_tokens_per_expert: int, ep_rank: int, ep_size: int, max_num_tokens: int,
                      runtime_max_tokens_per_rank: int, top_k: int, num_experts: int, active_rank_mask: list[int],
                      timeout_s: float, mailbox: int, enable_pdl: bool) -> list[Tensor]:
    """The expert-major dispatch with fp32 ``router_weights``; returns
    ``[*planes, expert_counts, local_expert_ids, pair_weights]`` (new tensors,
    see :func:`_owned_em`)."""
    _note_forward_dispatch(workspace, ep_rank)
    route = (ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts, active_rank_mask,
             timeout_s, mailbox, enable_pdl)
    with _Unrecorded():
        _, em = _dispatch_em(token_selected_experts, input_payloads, router_weights, workspace,
                             max_tokens_per_expert, route, 0)
        planes, counts, ids, weights = _owned_em(workspace, input_payloads, em, max_tokens_per_expert, route)
    return [*planes, counts, ids, weights]


@_custom_op("combine_em_owned", _refuse_recomputed_combine_alone("moe_a2a_combine_expert_major_differentiable"))
def combine_em_owned(expert_outputs: Tensor, pair_weights: Tensor, expert_counts: Tensor,
                     token_selected_experts: Tensor, workspace: Tensor, max_tokens_per_expert: int, dispatch_end: int,
                     combine_payload_offset: int, weights_offset: int, ep_rank: int, ep_size: int,
                     max_num_tokens: int, runtime_max_tokens_per_rank: int, top_k: int, num_experts: int,
                     active_rank_mask: list[int], timeout_s: float, mailbox: int, enable_pdl: bool) -> Tensor:
    """The weighted expert-major combine closing the round ``dispatch_em_owned``
    opened, with ``pair_weights`` fp32 ``[num_local_experts, max_tokens_per_expert]``
    as the pairs' weights; ``[local_num_tokens, *row]`` of the outputs' dtype."""
    route = (ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts, active_rank_mask,
             timeout_s, mailbox, enable_pdl)
    with _Unrecorded():
        # The combine reads each pair's weight from its expert's rank, in the region the build wrote.
        region = layout.region_view(workspace.select(0, ep_rank), weights_offset, tuple(pair_weights.shape),
                                    torch.float32)
        if workspace.device.type == "cpu":
            # A repeated combine (the epochs equal) whose weights are not the
            # ones in the region would write them while a peer may still read
            # the earlier combine's. Seen where the header is host memory.
            dispatch_epoch, combine_epoch = (int(_rank_words(workspace, ep_rank, offset, 1, torch.int32))
                                             for offset in (layout.HDR_DISPATCH_EPOCH, layout.HDR_COMBINE_EPOCH))
            if dispatch_epoch == combine_epoch and not torch.equal(region, pair_weights):
                raise ValueError("moe_a2a_combine_expert_major_differentiable: every combine of a round must "
                                 "apply the same router weights, and this repeated combine's differ from those "
                                 "of the round's earlier combines: it would write them into the workspace while a "
                                 "peer may still read the earlier combine's (a wrong result there). Give the "
                                 "round's combines the same dispatched.router_weights")
        region.copy_(pair_weights)
        out = _combine_em(expert_outputs.contiguous(), token_selected_experts.shape[0], workspace,
                          max_tokens_per_expert, dispatch_end, combine_payload_offset, route)
    return out


@_custom_op("dispatch_em_round")
def dispatch_em_round(rows: Tensor, slot_values: Tensor, token_selected_experts: Tensor, workspace: Tensor,
                      max_tokens_per_expert: int, ep_rank: int, ep_size: int, max_num_tokens: int,
                      runtime_max_tokens_per_rank: int, top_k: int, num_experts: int, active_rank_mask: list[int],
                      timeout_s: float, mailbox: int, enable_pdl: bool, round_tag: int = ROUND_TAG_ANY) -> list[Tensor]:
    """An expert-major dispatch of ``rows`` ``[local_num_tokens, *row]`` with
    ``slot_values`` (fp32 ``[local_num_tokens, top_k]``) as router weights,
    carrying ``round_tag`` (as :func:`dispatch_round`'s),
    then a combine of one fp32 zero per pair (closing the round); returns
    ``[plane, pair_values]``: ``[num_local_experts, max_tokens_per_expert,
    *row]`` (each pair's token row) and fp32 ``[num_local_experts,
    max_tokens_per_expert]`` (each pair's slot value), padding rows zero."""
    _note_backward_round(workspace, ep_rank)
    route = (ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts, active_rank_mask,
             timeout_s, mailbox, enable_pdl)
    M = max_tokens_per_expert
    with _Unrecorded(), _TalliesKept(workspace, ep_rank):
        dispatch_end, em = _dispatch_em(token_selected_experts, [rows], slot_values, workspace, M, route, round_tag)
        (plane,), _, _, pair_values = _owned_em(workspace, [rows], em, M, route)
        nothing = torch.zeros((_local_experts(route), M, 1), dtype=torch.float32, device=rows.device)
        _combine_em(nothing, rows.shape[0], workspace, M, dispatch_end, em.combine_offset, route)
    note_backward_round(workspace, ep_rank)
    return [plane, pair_values]


@_custom_op("combine_em_round")
def combine_em_round(plane: Tensor, pair_values: Tensor, token_selected_experts: Tensor, workspace: Tensor,
                     max_tokens_per_expert: int, ep_rank: int, ep_size: int, max_num_tokens: int,
                     runtime_max_tokens_per_rank: int, top_k: int, num_experts: int, active_rank_mask: list[int],
                     timeout_s: float, mailbox: int, enable_pdl: bool, round_tag: int = ROUND_TAG_ANY) -> list[Tensor]:
    """An expert-major dispatch of the expert ids alone (the routes of these
    ids, the slot indices as router weights) carrying ``round_tag`` (as
    :func:`dispatch_round`'s), then unweighted combines of
    ``plane`` ``[num_local_experts, max_tokens_per_expert, *row]`` in its
    dtype and of ``pair_values`` (fp32 ``[num_local_experts,
    max_tokens_per_expert]``) in a column per top-k slot (one combine of an
    fp32 row of both where the plane is fp32); returns ``[rows, slot_values]``: each token's sum of its
    pairs' rows (``[local_num_tokens, *row]``, summed in fp32, cast once to
    the plane's dtype) and its pairs' values by top-k slot (fp32
    ``[local_num_tokens, top_k]``, 0 for a slot without a kept pair)."""
    _note_backward_round(workspace, ep_rank)
    route = (ep_rank, ep_size, max_num_tokens, runtime_max_tokens_per_rank, top_k, num_experts, active_rank_mask,
             timeout_s, mailbox, enable_pdl)
    ids, M = token_selected_experts, max_tokens_per_expert
    local, n = _local_experts(route), ids.shape[0]
    with _Unrecorded(), _TalliesKept(workspace, ep_rank):
        dispatch_end, em = _dispatch_em(ids, [], _slot_indices(ids), workspace, M, route, round_tag)
        row = workspace.select(0, ep_rank)
        counts = layout.region_view(row, em.counts_offset, (local,), torch.int32)
        weights = layout.region_view(row, em.weights_offset, (local, M), torch.float32)
        in_slot = (weights.long().unsqueeze(2) == torch.arange(top_k, device=weights.device)) \
            & _valid_pairs(counts, M).unsqueeze(2)
        columns = torch.where(in_slot, pair_values.unsqueeze(2), 0.0)
        weights.fill_(1.0)
        width = math.prod(plane.shape[2:])
        rows = plane.reshape(local, M, width)
        if plane.dtype == torch.float32:  # one dtype: one combine
            both = _combine_em(torch.cat([rows, columns], dim=2), n, workspace, M, dispatch_end, em.combine_offset,
                               route)
            summed, slots = both[:, :width].clone(), both[:, width:].clone()
        else:
            # A combine per dtype (the round's repeated combines): the rows in
            # their own, which rounds as the fp32 sum cast once, then the columns.
            summed = _combine_em(rows.contiguous(), n, workspace, M, dispatch_end, em.combine_offset, route)
            slots = _combine_em(columns, n, workspace, M, dispatch_end, em.combine_offset, route)
    note_backward_round(workspace, ep_rank)
    return [summed.reshape(n, *plane.shape[2:]), slots]


for _op in (dispatch_em_owned, combine_em_owned, dispatch_em_round, combine_em_round):
    torch.fx.node.has_side_effect(_op._opoverload)


@dispatch_em_owned.register_fake
def _(token_selected_experts, input_payloads, router_weights, workspace, max_tokens_per_expert, *route):
    local, M = _local_experts(route), max_tokens_per_expert
    planes = [p.new_empty((local, M, *p.shape[1:])) for p in input_payloads]
    return [*planes, workspace.new_empty((local,), dtype=torch.int32), workspace.new_empty((local, M), dtype=torch.int32),
            workspace.new_empty((local, M), dtype=torch.float32)]


@combine_em_owned.register_fake
def _(expert_outputs, pair_weights, expert_counts, token_selected_experts, *rest):
    return expert_outputs.new_empty((token_selected_experts.shape[0], *expert_outputs.shape[2:]))


@dispatch_em_round.register_fake
def _(rows, slot_values, token_selected_experts, workspace, max_tokens_per_expert, *route):
    local, M = _local_experts(route), max_tokens_per_expert
    return [rows.new_empty((local, M, *rows.shape[1:])), rows.new_empty((local, M), dtype=torch.float32)]


@combine_em_round.register_fake
def _(plane, pair_values, token_selected_experts, *rest):
    n, top_k = token_selected_experts.shape
    return [plane.new_empty((n, *plane.shape[2:])), plane.new_empty((n, top_k), dtype=torch.float32)]


# Saved as for the rank-major ops: the expert ids (and the combine's counts,
# outputs and weights, the factors of its gradients), the ints, the workspace
# as an attribute.

def _setup_em(ctx, ids: Tensor, workspace: Tensor, max_tokens_per_expert: int, route: tuple, *saved: Tensor) -> None:
    ctx.save_for_backward(ids, *saved)
    ctx.workspace = workspace
    ctx.route = (max_tokens_per_expert, *route)
    ctx.round_tag = round_tag_of_last_exchange(workspace, route[0])


def _setup_dispatch_em_owned(ctx, inputs, output):
    ids, payloads, _, workspace, M, *route = inputs
    _setup_em(ctx, ids, workspace, M, tuple(route))
    ctx.payloads = [(p.dtype, tuple(p.shape[1:])) for p in payloads]
    ctx.differentiated = [i for i, p in enumerate(payloads) if _differentiated(p)]


def _em_gradient_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """The dtype in which the expert-major dispatch's backward combines the
    gradients of its planes that require grad: theirs where they share one
    (a bf16 hidden state's gradient travels as bf16), else fp32."""
    return dtypes[0] if dtypes and all(d == dtypes[0] for d in dtypes) else torch.float32


def _backward_dispatch_em_owned(ctx, grads):
    """The gradients of the planes whose payloads require grad (as the
    columns of one plane, in their dtype where they share one, else fp32)
    and the pair weights' gradient in one ``combine_em_round``."""
    (ids,) = ctx.saved_tensors
    local, M = _local_experts(ctx.route[1:]), ctx.route[0]
    floating = ctx.differentiated
    dtype = _em_gradient_dtype([ctx.payloads[i][0] for i in floating])
    parts = [ids.new_zeros((local, M, math.prod(ctx.payloads[i][1])), dtype=dtype) if grads[i] is None
             else grads[i].reshape(local, M, -1).to(dtype) for i in floating]
    plane = torch.cat(parts, dim=2) if parts else ids.new_zeros((local, M, 0), dtype=dtype)
    pair_grad = ids.new_zeros((local, M), dtype=torch.float32) if grads[-1] is None else grads[-1]
    summed, slot_grads = _call(combine_em_round, plane, pair_grad.float().contiguous(), ids, ctx.workspace, *ctx.route,
                               _backward_tag(ctx))
    result: list[Optional[Tensor]] = [None] * len(ctx.payloads)
    start = 0
    for i, part in zip(floating, parts):
        width = part.shape[2]
        result[i] = summed[:, start:start + width].reshape(ids.shape[0], *ctx.payloads[i][1]).to(ctx.payloads[i][0])
        start += width
    return None, result, slot_grads, None, None, *_list_route_grads(ctx.route[1:])


def _setup_combine_em_owned(ctx, inputs, output):
    outputs, pair_weights, counts, ids, workspace, M, _, _, _, *route = inputs
    _setup_em(ctx, ids, workspace, M, tuple(route), outputs, pair_weights, counts)


def _backward_combine_em_owned(ctx, grad):
    """``w * grad`` for each pair's output row (the product in fp32, cast to
    the outputs' dtype) and the fp32 dot product of the pair's output row with
    its token's gradient for its weight; zeros in padding rows."""
    ids, outputs, pair_weights, counts = ctx.saved_tensors
    plane, _ = _call(dispatch_em_round, grad.contiguous(), torch.zeros(ids.shape, dtype=torch.float32, device=grad.device),
                     ids, ctx.workspace, *ctx.route, _backward_tag(ctx))
    valid = _valid_pairs(counts, ctx.route[0])
    rows = valid.view(*valid.shape, *([1] * (plane.dim() - 2)))
    weight = pair_weights.view(rows.shape)
    outputs_grad = torch.where(rows, weight * plane.float(), 0.0).to(outputs.dtype)
    products = plane.float() * torch.where(rows, outputs, 0).float()
    weights_grad = torch.where(valid, products.flatten(2).sum(dim=2), 0.0)
    return outputs_grad, weights_grad, None, None, None, None, None, None, None, *_ROUTE_GRADS


def _setup_em_round(ctx, inputs, output):
    _, _, ids, workspace, M, *route, _ = inputs  # last, the round's own tag (as in _setup_round)
    _setup_em(ctx, ids, workspace, M, tuple(route))


def _backward_dispatch_em_round(ctx, grads):
    (ids,) = ctx.saved_tensors
    plane_grad, values_grad = grads
    rows, slots = _call(combine_em_round, plane_grad.contiguous(), values_grad.float().contiguous(), ids, ctx.workspace,
                        *ctx.route, _backward_tag(ctx))
    return rows, slots, None, None, None, *_list_route_grads(ctx.route[1:]), None


def _backward_combine_em_round(ctx, grads):
    (ids,) = ctx.saved_tensors
    rows_grad, slots_grad = grads
    plane, values = _call(dispatch_em_round, rows_grad.contiguous(), slots_grad.float().contiguous(), ids, ctx.workspace,
                          *ctx.route, _backward_tag(ctx))
    return plane, values, None, None, None, *_list_route_grads(ctx.route[1:]), None


_register_autograd(dispatch_em_owned, _backward_dispatch_em_owned, _setup_dispatch_em_owned,
                   "moe_a2a_dispatch_expert_major_differentiable (a dispatch of the saved expert ids, then a "
                   "combine of the planes' gradients)", materialize_grads=False)
_register_autograd(combine_em_owned, _backward_combine_em_owned, _setup_combine_em_owned,
                   "moe_a2a_combine_expert_major_differentiable (a dispatch of the output's gradient, then a combine "
                   "that closes its round)")
_register_autograd(dispatch_em_round, _backward_dispatch_em_round, _setup_em_round,
                   "an expert-major backward's dispatch (a double backward)")
_register_autograd(combine_em_round, _backward_combine_em_round, _setup_em_round,
                   "an expert-major backward's combine (a double backward)")


def moe_a2a_dispatch_expert_major_differentiable(
    token_selected_experts: Tensor,
    input_payloads: list[Tensor],
    workspace: Tensor,
    metainfo: Tensor,
    runtime_max_tokens_per_rank: int,
    ep_rank: int,
    ep_size: int,
    top_k: int,
    num_experts: int,
    router_weights: Optional[Tensor] = None,
    max_tokens_per_expert: Optional[int] = None,
    enable_pdl: Optional[bool] = None,
    enable_rank_mask: bool = False,
    active_rank_mask: Optional[Tensor] = None,
    *,
    timeout_s: Optional[float] = None,
) -> ExpertMajorDispatch:
    """:func:`~torch_moe_a2a.moe_a2a_dispatch_expert_major` for training:
    differentiable, with received rows the caller owns.

    Args:
        token_selected_experts, input_payloads, workspace, metainfo,
            runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts,
            max_tokens_per_expert, enable_pdl, enable_rank_mask,
            active_rank_mask, timeout_s: as for
            :func:`~torch_moe_a2a.moe_a2a_dispatch_expert_major` (no EPLB
            statistics). Payloads may require grad; bf16, fp16 and fp32
            payloads get a gradient, other dtypes none (and may not require grad).
        router_weights: ``[local_num_tokens, top_k]`` floating router weights
            (may require grad), or None: the combine then sums the pairs unweighted.

    Returns:
        :class:`~torch_moe_a2a.ExpertMajorDispatch` whose tensors are new
        (no later exchange overwrites them, so an expert may save them for its
        backward): ``output_payloads`` (padding rows zero), ``expert_counts``,
        ``local_expert_ids``, and ``router_weights`` (fp32, differentiable:
        the weights :func:`moe_a2a_combine_expert_major_differentiable`
        applies) or None. The backward is a combine of the planes' and the
        pair weights' gradients over the same routes (a collective: every
        rank runs it).

    Raises:
        ValueError: as :func:`~torch_moe_a2a.moe_a2a_dispatch_expert_major`
            (``input_payloads`` not a list or tuple of tensors among them); a
            payload that requires grad and is not bf16, fp16 or fp32.
        RuntimeError: peers that did not arrive within the timeout.
    """
    return _dispatch_expert_major_differentiable("moe_a2a_dispatch_expert_major_differentiable",
                                                 token_selected_experts, input_payloads, workspace, metainfo,
                                                 runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts,
                                                 router_weights, max_tokens_per_expert, enable_pdl, enable_rank_mask,
                                                 active_rank_mask, timeout_s=timeout_s)


def _dispatch_expert_major_differentiable(fn: str, token_selected_experts: Tensor, input_payloads: list[Tensor],
                                          workspace: Tensor, metainfo: Tensor, runtime_max_tokens_per_rank: int,
                                          ep_rank: int, ep_size: int, top_k: int, num_experts: int,
                                          router_weights: Optional[Tensor], max_tokens_per_expert: Optional[int],
                                          enable_pdl: Optional[bool], enable_rank_mask: bool,
                                          active_rank_mask: Optional[Tensor],
                                          timeout_s: Optional[float]) -> ExpertMajorDispatch:
    """moe_a2a_dispatch_expert_major_differentiable, its errors naming ``fn``
    (the plain expert-major dispatch runs as it)."""
    expect_tensor_list(fn, "input_payloads", input_payloads)
    _check_grad_dtypes(fn, input_payloads)
    expert_major.check_ids_and_weights(fn, token_selected_experts, workspace, router_weights, top_k)
    n = token_selected_experts.shape[0]
    if type(top_k) is not int:  # the weights' shape below
        expect_traced_ints(fn, top_k=top_k)
    # Without router weights, weights of 1: the build writes those anyway.
    weights = (torch.ones((n, top_k), dtype=torch.float32, device=workspace.device) if router_weights is None
               else router_weights.to(torch.float32).contiguous())
    payloads = list(input_payloads)
    route = _route_args(fn, token_selected_experts, [*payloads, token_selected_experts, weights], workspace,
                        metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts, enable_pdl,
                        enable_rank_mask, active_rank_mask, timeout_s)
    if max_tokens_per_expert is None:
        max_tokens_per_expert = expert_major.default_rows_per_expert(ep_size, runtime_max_tokens_per_rank, route[2],
                                                                     top_k, num_experts)
    expert_major.check_expert_major_fits(workspace, ep_size, runtime_max_tokens_per_rank, top_k, num_experts,
                                         max_tokens_per_expert, 0, [_row_bytes(p) for p in payloads],
                                         token_selected_experts.element_size(), True)
    floating = [p for p in payloads if _differentiated(p)]
    if _needs_backward([*floating, router_weights]):
        _refuse_inference_tensors(fn, token_selected_experts=token_selected_experts)
        # The backward (combine_em_round): the ids and the slots as weights,
        # then the gradients of the planes that require grad and a column per
        # slot: one fp32 row of both, or where the planes share another dtype,
        # their rows in it and the columns, each a combine into the same rows.
        elements = sum(math.prod(p.shape[1:]) for p in floating)
        dtype = _em_gradient_dtype([p.dtype for p in floating])
        row = 4 * (elements + top_k) if dtype == torch.float32 else max(dtype.itemsize * elements, 4 * top_k)
        needed = _em_round_end(ep_size, runtime_max_tokens_per_rank, top_k, num_experts, max_tokens_per_expert, [],
                               _row_bytes(token_selected_experts), row)
        _check_backward_fits(fn, workspace, needed,
                             f"it combines the gradients of the planes that require grad and the pair weights' in "
                             f"rows of up to {row} bytes a pair: size the workspace with combine bytes per token of "
                             f"at least {row} (moe_a2a_get_workspace_size_per_rank_expert_major)")
    *planes, counts, ids, pair_weights = _call(dispatch_em_owned, token_selected_experts, payloads, weights, workspace,
                                               max_tokens_per_expert, *route)
    if _recorded():
        note_dispatch(workspace, ep_rank, token_selected_experts, num_experts, counts)
    row_bytes = [_row_bytes(p) for p in (*payloads, token_selected_experts, weights)]
    dispatch_end = layout.call_layout(ep_size, runtime_max_tokens_per_rank, 0, row_bytes).combine_offset
    em = layout.expert_major_layout(dispatch_end, ep_size, runtime_max_tokens_per_rank, top_k,
                                    layout.max_local_experts(num_experts, ep_size), max_tokens_per_expert,
                                    row_bytes[:len(payloads)])
    return ExpertMajorDispatch(planes, counts, ids, None if router_weights is None else pair_weights,
                               em.combine_offset, None, n, runtime_max_tokens_per_rank, top_k, num_experts,
                               max_tokens_per_expert, dispatch_end)


def moe_a2a_combine_expert_major_differentiable(
    expert_outputs: Tensor,
    dispatched: ExpertMajorDispatch,
    token_selected_experts: Tensor,
    workspace: Tensor,
    metainfo: Tensor,
    ep_rank: int,
    ep_size: int,
    enable_pdl: Optional[bool] = None,
    enable_rank_mask: bool = False,
    active_rank_mask: Optional[Tensor] = None,
    *,
    timeout_s: Optional[float] = None,
) -> Tensor:
    """:func:`~torch_moe_a2a.moe_a2a_combine_expert_major` for training:
    differentiable in the expert outputs and in the pairs' router weights.

    Args:
        expert_outputs: ``[num_local_experts, max_tokens_per_expert, *row_shape]``
            bf16, fp16 or fp32 (padding rows are ignored and get a zero gradient).
        dispatched: this rank's :func:`moe_a2a_dispatch_expert_major_differentiable`
            result; its ``router_weights`` are the weights applied (a tensor
            computed from them may stand in, of the same shape:
            ``dispatched._replace(router_weights=...)``, a NamedTuple's copy
            with that field replaced). They are written into the workspace
            before the combine runs, where the peers read them, so the
            round's later combines apply them too, and every combine of a
            round must apply the same weights: a peer may still be reading
            an earlier combine's when a later one writes its own (refused
            on a CPU workspace; on CUDA the earlier combine's result on the
            peers is then undefined).
        token_selected_experts: the ids of that dispatch (its routes; the
            backward dispatches the output gradient along them).
        workspace, metainfo, ep_rank, ep_size, enable_pdl, enable_rank_mask,
            active_rank_mask, timeout_s: as for that dispatch.

    Returns:
        ``[local_num_tokens, *row_shape]`` of the outputs' dtype: as
        :func:`~torch_moe_a2a.moe_a2a_combine_expert_major`. A new tensor.
        The backward gives each pair's output row ``w * grad`` (in fp32, cast
        to the outputs' dtype) and its weight the fp32 dot product of
        ``grad`` with the row, ``grad`` being its token's output gradient.

    Raises:
        ValueError, RuntimeError: as :func:`~torch_moe_a2a.moe_a2a_combine_expert_major`
            (``expert_outputs`` not a tensor among them); ValueError too for
            ids or a ``dispatched`` other than those of this rank's preceding
            dispatch, and, where the outputs or weights need a gradient, a
            plain dispatch before it (its views the backward overwrites).
    """
    return _combine_expert_major_differentiable("moe_a2a_combine_expert_major_differentiable", expert_outputs,
                                                dispatched, token_selected_experts, workspace, metainfo, ep_rank,
                                                ep_size, enable_pdl, enable_rank_mask, active_rank_mask,
                                                timeout_s=timeout_s)


def _combine_expert_major_differentiable(fn: str, expert_outputs: Tensor, dispatched: ExpertMajorDispatch,
                                         token_selected_experts: Tensor, workspace: Tensor, metainfo: Tensor,
                                         ep_rank: int, ep_size: int, enable_pdl: Optional[bool],
                                         enable_rank_mask: bool, active_rank_mask: Optional[Tensor],
                                         timeout_s: Optional[float]) -> Tensor:
    """moe_a2a_combine_expert_major_differentiable, its errors naming ``fn``
    (the plain expert-major combine runs as it)."""
    expect_tensors(fn, expert_outputs=expert_outputs)
    if not isinstance(dispatched, ExpertMajorDispatch):
        raise ValueError(f"dispatched must be the ExpertMajorDispatch that moe_a2a_dispatch_expert_major_differentiable"
                         f" returned, got {type(dispatched).__name__}")
    d = dispatched
    route = _route_args(fn, token_selected_experts, [expert_outputs], workspace, metainfo,
                        d.runtime_max_tokens_per_rank, ep_rank, ep_size, d.top_k, d.num_experts, enable_pdl,
                        enable_rank_mask, active_rank_mask, timeout_s)
    pairs = tuple(d.local_expert_ids.shape)
    weights = d.router_weights
    if weights is None:
        weights = torch.ones(pairs, dtype=torch.float32, device=workspace.device)
    elif not isinstance(weights, Tensor) or tuple(weights.shape) != pairs or not weights.dtype.is_floating_point:
        raise ValueError(f"dispatched.router_weights must be a floating [num_local_experts, max_tokens_per_expert]="
                         f"{list(pairs)} tensor, got {getattr(weights, 'dtype', type(weights))} "
                         f"{tuple(getattr(weights, 'shape', ()))}")
    needs_backward = _needs_backward([expert_outputs, weights])
    _check_combine_ids(fn, workspace, ep_rank, token_selected_experts, d.num_experts, d.expert_counts,
                       needs_backward)
    pair_weights = weights.to(torch.float32).contiguous()
    if needs_backward:
        # What the node saves beside the outputs (which require grad, so no inference tensors).
        _refuse_inference_tensors(fn, token_selected_experts=token_selected_experts,
                                  router_weights=pair_weights, expert_counts=d.expert_counts)
        # The backward (dispatch_em_round): the gradient's rows beside the ids
        # and the slot values, then a combine of one fp32 per pair.
        row = expert_outputs.element_size() * math.prod(expert_outputs.shape[2:])
        needed = _em_round_end(ep_size, d.runtime_max_tokens_per_rank, d.top_k, d.num_experts,
                               d.max_tokens_per_expert, [row], _row_bytes(token_selected_experts), 4)
        _check_backward_fits(fn, workspace, needed,
                             f"it dispatches the output gradient (rows of {row} bytes) expert-major: size the "
                             "workspace for a dispatch of the outputs' rows (moe_a2a_get_workspace_size_per_rank_"
                             "expert_major)")
    user_rows = [p.element_size() * math.prod(p.shape[2:]) for p in d.output_payloads]
    em = layout.expert_major_layout(d.dispatch_end, ep_size, d.runtime_max_tokens_per_rank, d.top_k,
                                    layout.max_local_experts(d.num_experts, ep_size), d.max_tokens_per_expert,
                                    user_rows)
    return _call(combine_em_owned, expert_outputs, pair_weights, d.expert_counts,
                 token_selected_experts, workspace, d.max_tokens_per_expert, d.dispatch_end,
                 d.combine_payload_offset, em.weights_offset, *route)


# ---- the plain functions with tensors that require grad ----------------------
# The plain functions (moe_a2a_dispatch, moe_a2a_combine and their expert-major
# forms) return and take workspace views and have no backward of their own.
# Called eagerly, under grad mode, with a tensor that requires grad, they run
# as the differentiable functions here instead (fastpath.wants_grad; DESIGN.md section 3,
# 'Gradients'): the dispatch's received rows are then new tensors, and the
# combine takes the expert ids of the rank's last dispatch, which it
# recorded. Traced calls keep the plain ops' refusal, which names the
# differentiable functions: a trace does not record its dispatch's ids.


def _refuse_options_with_grad(fn: str, what: str, **options: Any) -> None:
    """A ValueError naming the first option given (truthy) that the
    differentiable function does not take."""
    for name, given in options.items():
        if given:
            raise ValueError(f"{fn}: {name} is not taken with {what} that requires grad (the call runs as the "
                             "differentiable one, whose result is a new tensor); leave it at its default, or call "
                             "under torch.no_grad()")


def _round_ids(fn: str, workspace: Tensor, rank: int, expert_major: bool) -> tuple[Tensor, int]:
    """The expert ids and num_experts of this rank's last dispatch, which must
    have been a differentiable one of the same layout (a plain dispatch's
    received rows are workspace views, which a backward's exchange overwrites
    before the expert's backward reads what it saved of them)."""
    last = last_dispatch(workspace, rank)
    if last is None or last[3] or (last[1] is not None) != expert_major:
        kind = "an expert-major" if expert_major else "a rank-major"
        raise ValueError(f"{fn}: the payload requires grad, but this rank's last dispatch on the workspace was not "
                         f"{kind} dispatch of payloads that required grad: its received rows are workspace views "
                         "that the combine's backward would overwrite before the expert's backward reads them "
                         "(wrong gradients). Dispatch payloads that require grad (or call "
                         f"{'moe_a2a_dispatch_expert_major_differentiable' if expert_major else 'moe_a2a_dispatch_differentiable'}"
                         "), or combine under torch.no_grad()")
    if last[4]:
        raise ValueError(_IDS_CHANGED.format(fn=fn))
    return last[0], last[2]


def dispatch_with_grad(fn: str, token_selected_experts: Tensor, input_payloads: list[Tensor], workspace: Tensor,
                       metainfo: Tensor, runtime_max_tokens_per_rank: int, ep_rank: int, ep_size: int, top_k: int,
                       num_experts: int, enable_pdl: Optional[bool], eplb_local_stats: Optional[Tensor],
                       enable_rank_mask: bool, active_rank_mask: Optional[Tensor],
                       timeout_s: Optional[float]) -> tuple[list[Tensor], int, None]:
    """moe_a2a_dispatch of payloads that require grad: moe_a2a_dispatch_differentiable,
    its received rows (new tensors, padding zeroed) in the plain result's place."""
    _refuse_options_with_grad(fn, "a payload", eplb_local_stats=eplb_local_stats is not None)
    received, offset, _ = _dispatch_differentiable(
        fn, token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size,
        top_k, num_experts, enable_pdl, enable_rank_mask, active_rank_mask, timeout_s=timeout_s)
    return received, offset, None


def dispatch_expert_major_with_grad(fn: str, token_selected_experts: Tensor, input_payloads: list[Tensor],
                                    workspace: Tensor, metainfo: Tensor, runtime_max_tokens_per_rank: int,
                                    ep_rank: int, ep_size: int, top_k: int, num_experts: int,
                                    router_weights: Optional[Tensor], max_tokens_per_expert: Optional[int],
                                    enable_pdl: Optional[bool], eplb_local_stats: Optional[Tensor],
                                    enable_rank_mask: bool, active_rank_mask: Optional[Tensor],
                                    timeout_s: Optional[float]) -> ExpertMajorDispatch:
    """moe_a2a_dispatch_expert_major of payloads (or router weights) that
    require grad: moe_a2a_dispatch_expert_major_differentiable."""
    _refuse_options_with_grad(fn, "a payload (or router_weights)", eplb_local_stats=eplb_local_stats is not None)
    return _dispatch_expert_major_differentiable(
        fn, token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size,
        top_k, num_experts, router_weights, max_tokens_per_expert, enable_pdl, enable_rank_mask, active_rank_mask,
        timeout_s=timeout_s)


def combine_with_grad(fn: str, payload: Tensor, local_num_tokens: int, workspace: Tensor, metainfo: Tensor,
                      runtime_max_tokens_per_rank: int, ep_rank: int, ep_size: int, top_k: int,
                      combine_payload_offset: int, enable_pdl: Optional[bool], enable_rank_mask: bool,
                      active_rank_mask: Optional[Tensor], timeout_s: Optional[float], **plain_options: Any) -> Tensor:
    """moe_a2a_combine of a payload that requires grad: moe_a2a_combine_differentiable
    over the routes of the rank's last dispatch (``plain_options``: the
    plain combine's options, each refused where given)."""
    _refuse_options_with_grad(fn, "a payload", **plain_options)
    if type(local_num_tokens) is not int:
        expect_traced_ints(fn, local_num_tokens=local_num_tokens)
    ids, num_experts = _round_ids(fn, workspace, ep_rank, expert_major=False)
    if local_num_tokens != ids.shape[0]:
        raise ValueError(f"{fn}: local_num_tokens must be that of this rank's last dispatch ({ids.shape[0]}), "
                         f"got {local_num_tokens}")
    return _combine_differentiable(fn, payload, ids, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size,
                                   top_k, num_experts, combine_payload_offset, enable_pdl, enable_rank_mask,
                                   active_rank_mask, timeout_s=timeout_s)


def combine_expert_major_with_grad(fn: str, expert_outputs: Tensor, dispatched: ExpertMajorDispatch,
                                   workspace: Tensor, metainfo: Tensor, ep_rank: int, ep_size: int,
                                   enable_pdl: Optional[bool], enable_rank_mask: bool,
                                   active_rank_mask: Optional[Tensor], timeout_s: Optional[float],
                                   **plain_options: Any) -> Tensor:
    """moe_a2a_combine_expert_major of expert outputs (or dispatched router
    weights) that require grad: moe_a2a_combine_expert_major_differentiable
    with the expert ids of the rank's last dispatch."""
    _refuse_options_with_grad(fn, "expert_outputs (or router weights)", **plain_options)
    ids, _ = _round_ids(fn, workspace, ep_rank, expert_major=True)
    return _combine_expert_major_differentiable(fn, expert_outputs, dispatched, ids, workspace, metainfo, ep_rank,
                                                ep_size, enable_pdl, enable_rank_mask, active_rank_mask,
                                                timeout_s=timeout_s)
