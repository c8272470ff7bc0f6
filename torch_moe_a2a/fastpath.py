"""The eager fast path of dispatch and combine: when no ``__torch_function__``
override and no dispatch mode can want to see the call, one C++ call
(``_C.dispatch`` / ``_C.combine``) runs the op and builds the receive views;
a ``TypeError`` of it is turned into a ``ValueError`` naming the argument.
Traced calls (``torch.compile``, ``make_fx``, ``FakeTensorMode``) build the
views with Python view ops instead."""

from __future__ import annotations

import math
import numbers
import threading
import weakref
from typing import Any, Optional

import torch
from torch.autograd import forward_ad
from torch.utils import checkpoint
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _C, layout

# What an argument of the C++ fast path must be (wrong_type).
TENSOR, OPT_TENSOR, TENSORS, INT, FLOAT, BOOL = (
    "a tensor", "a tensor or None", "a list of tensors", "an int", "a number", "a bool")
# The ops take int64: a Python int outside it would reach the dispatcher,
# whose error ("Expected a value of type 'int' ... found type 'int'") names
# the type it got as the one it wants.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _type_ok(value: Any, kind: str) -> bool:
    if kind == TENSOR:
        return isinstance(value, torch.Tensor)
    if kind == OPT_TENSOR:
        return value is None or isinstance(value, torch.Tensor)
    if kind == TENSORS:  # the container; wrong_type names a bad element
        return isinstance(value, (list, tuple))
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX
    if kind == FLOAT:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, bool)


def expect_tensors(fn: str, **arguments: Any) -> None:
    """ValueError naming the first argument that is not a tensor: the
    arguments the Python layer reads before any op does (the ops' own
    TypeErrors go through wrong_type)."""
    for name, value in arguments.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{fn}: {name} must be a tensor, got {type(value).__name__}")


def expect_ints(fn: str, **arguments: Any) -> None:
    """ValueError naming the first argument that is not an int: not a bool
    (True would count as 1), not a float, not a str, nor beyond int64 (which
    no op takes); the ops check the ranges."""
    for name, value in arguments.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{fn}: {name} must be an int, got {value!r}")
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"{fn}: {name} must fit in int64, got {value}")


def expect_traced_ints(fn: str, **arguments: Any) -> None:
    """:func:`expect_ints` for arguments that a traced call passes as SymInts
    (each counts as an int). Without it a float or a str reached the ops as
    pybind's or the dispatcher's TypeError, which names no function, or
    failed in an argument derived from it, whose name the error then gave."""
    expect_ints(fn, **{name: value for name, value in arguments.items() if not isinstance(value, torch.SymInt)})


def expect_tensor_list(fn: str, name: str, values: Any) -> None:
    """ValueError unless ``values`` is a list or tuple of tensors, naming
    ``name`` (and the index of the first element that is not a tensor). Not
    any iterable: a generator would be used up by the first pass over it."""
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{fn}: {name} must be a list of tensors (a list or tuple), got {type(values).__name__}")
    for i, value in enumerate(values):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{fn}: {name}[{i}] must be a tensor, got {type(value).__name__}")


def check_output_first(fn: str, output: Any, workspace: torch.Tensor) -> None:
    """A combine's ``output``: its type, device and contiguity, checked before
    anything else as FlashInfer does (its tests pass an invalid metainfo with
    a bad output and expect the output's error); the ops check them again for
    direct callers."""
    if not isinstance(output, torch.Tensor):
        raise ValueError(f"{fn}: output must be a tensor or None, got {type(output).__name__}")
    if output.device != workspace.device:
        raise ValueError(f"output must be a {workspace.device.type.upper()} tensor on the workspace's device "
                         f"{workspace.device}, got device={output.device}")
    if not output.is_contiguous():
        raise ValueError(f"output must be contiguous, got stride={output.stride()}")


def wrong_type(fn: str, error: TypeError, **arguments: tuple[Any, str]) -> ValueError:
    """The ValueError for a TypeError of _C.dispatch / _C.combine: the first
    argument of the wrong kind, named (pybind's own text lists signatures and
    whole tensors)."""
    for name, (value, kind) in arguments.items():
        if not _type_ok(value, kind):
            if kind == INT and isinstance(value, int) and not isinstance(value, bool):
                return ValueError(f"{fn}: {name} must fit in int64, got {value}")
            return ValueError(f"{fn}: {name} must be {kind}, got {type(value).__name__}")
        if kind == TENSORS:
            for i, item in enumerate(value):
                if not isinstance(item, torch.Tensor):
                    return ValueError(f"{fn}: {name}[{i}] must be a tensor, got {type(item).__name__}")
    return ValueError(f"{fn}: an argument has the wrong type ({str(error).splitlines()[0]})")


def direct_call_ok(*tensors: Optional[torch.Tensor]) -> bool:
    """Eager calls may skip torch.ops' Python argument matching (_C.dispatch,
    _C.combine: the same operators through the C++ dispatcher, dispatch modes
    and backends included) unless a __torch_function__ override (a tensor
    subclass, a TorchFunctionMode) could want to see the call."""
    return not torch.overrides.has_torch_function(tensors)


# Per (workspace address, rank): the expert ids and num_experts of the
# rank's last eager dispatch, plain or differentiable (and, expert-major, its
# counts tensor). A differentiable combine's backward lays its routes from
# the ids and num_experts it is given, its forward follows the ones the
# dispatch wrote: others than the dispatch's would give a right output and
# wrong gradients, so it checks them against these (plain dispatches record
# theirs once a differentiable one has: note_plain_dispatch). Held strongly:
# ids made for the call (`ids.int()`) are gone by the combine. As the table
# grows, entries whose workspace tensor is gone are dropped (an entry stays
# valid while its address is in use, whatever view of the workspace a call
# passes).
# The ids' version counter is kept too (fastpath._version): ids written in
# place since (the same tensor object, other routes) are refused like other
# ids where the combine needs a backward.
# A backward's round since the dispatch (note_backward_round) marks the entry
# with the workspace's version counter then: that round closed the
# dispatch's, which no combine may follow any more, as long as no recorded
# dispatch (which clears the mark) nor any other write through the
# dispatcher (a compiled dispatch's, which records nothing) moved the counter.
_LAST_DISPATCH: dict[tuple[int, int], list] = {}  # [weakref of the workspace's base, ids, counts, num_experts, plain, version,
#                                                    the workspace's version at a backward's round since, or None]
_LAST_DISPATCH_PURGE_AT = [64]
# Held while a dispatch updates the table. Simulated ranks dispatch from
# threads of their own: one rank's purge could find a dead entry that
# another rank was bringing back to life (a new workspace at a freed one's
# address) and drop it after the update, and that rank's combine then found
# no differentiable dispatch.
_LAST_DISPATCH_LOCK = threading.Lock()


def note_dispatch(workspace: torch.Tensor, rank: int, ids: torch.Tensor, num_experts: int,
                  counts: Optional[torch.Tensor] = None, plain: bool = False) -> None:
    """Records ``ids``, ``num_experts`` (and ``counts``) as those of ``rank``'s
    last dispatch on ``workspace``, and whether it was ``plain`` (its received
    rows workspace views). On every eager dispatch: an existing entry is
    updated in place."""
    key = (workspace.data_ptr(), rank)
    version = _version(ids)
    with _LAST_DISPATCH_LOCK:
        entry = _LAST_DISPATCH.get(key)
        owner = _owner(workspace)
        if entry is not None:
            if entry[0]() is not owner:  # another view of it, or a new workspace at a freed one's address
                entry[0] = weakref.ref(owner)
            entry[1] = ids
            entry[2] = counts
            entry[3] = num_experts
            entry[4] = plain
            entry[5] = version
            entry[6] = None
            return
        _LAST_DISPATCH[key] = [weakref.ref(owner), ids, counts, num_experts, plain, version, None]
        if len(_LAST_DISPATCH) >= _LAST_DISPATCH_PURGE_AT[0]:
            for gone in [k for k, e in _LAST_DISPATCH.items() if e[0]() is None]:
                del _LAST_DISPATCH[gone]
            _LAST_DISPATCH_PURGE_AT[0] = 2 * len(_LAST_DISPATCH) + 64


def note_plain_dispatch(workspace: torch.Tensor, rank: int, ids: torch.Tensor, num_experts: int,
                        counts: Optional[torch.Tensor] = None) -> None:
    """note_dispatch for a plain (not differentiable) dispatch, once a
    differentiable one has recorded anything: a process that never trains
    pays one test per call."""
    if _LAST_DISPATCH:
        note_dispatch(workspace, rank, ids, num_experts, counts, plain=True)


def _entry(workspace: torch.Tensor, rank: int) -> Optional[list]:
    """``rank``'s entry for ``workspace``: None where there is none, or where
    it is another workspace's at the address this one now has (a freed one's,
    which the CUDA caching allocator hands out again at once): that entry
    says nothing of this workspace's rounds."""
    entry = _LAST_DISPATCH.get((workspace.data_ptr(), rank))
    if entry is None:
        return None
    recorded = entry[0]()
    if recorded is None:
        return None
    # The same tensor (or a view of it) first: one identity test.
    same = recorded is _owner(workspace) or recorded.untyped_storage().data_ptr() == workspace.untyped_storage().data_ptr()
    return entry if same else None


def _owner(workspace: torch.Tensor) -> torch.Tensor:
    """The tensor whose life is the workspace memory's: a view's base (a
    view passed for one call dies with it, its base does not)."""
    return workspace if workspace._base is None else workspace._base


def note_backward_round(workspace: torch.Tensor, rank: int) -> None:
    """Marks ``rank``'s last recorded dispatch on ``workspace`` as followed by
    a backward's round (a backward exchanges in whole rounds of its own),
    which closed that dispatch's round."""
    entry = _entry(workspace, rank)
    if entry is not None:
        entry[6] = workspace._version


def refuse_combine_after_backward(fn: str, workspace: torch.Tensor, rank: int, traced: bool) -> None:
    """Refuses a combine after a backward's round on ``rank``'s row, before
    any new dispatch: to the workspace it is a repeated combine of that
    round, laid out for the backward's rows, not the forward's (refused there
    with a message about offsets or weights, or, where the two layouts agree,
    run on the backward's routes and weights). A dispatch that records
    nothing (compiled, or a CUDA graph's replay) after the backward: a
    compiled one moves the workspace's version counter, which ends the
    refusal; a replayed one does not, and the eager combine after it is
    refused. ``traced``: :func:`tracing`'s answer for this call, which the
    caller has (traced, nothing is checked: a fake workspace has no address,
    and the table gets no guard). A process whose dispatches were never
    recorded (no differentiable one) pays one test more.

    Raises:
        ValueError: a backward's round ran since ``rank``'s last dispatch.
    """
    if traced or not _LAST_DISPATCH:
        return
    entry = _entry(workspace, rank)
    if entry is not None and entry[6] is not None and entry[6] == workspace._version:
        # Inside a backward (autograd's graph task), a combine can only be a
        # checkpointed region's recomputation, of a region without the dispatch.
        hint = ("here, inside a backward, a checkpointed region's recomputation of a combine without its dispatch: "
                "checkpoint with context_fn=torch_moe_a2a.checkpoint_context (which saves the exchanges' outputs), or "
                "put the dispatch in the region too" if torch._C._current_graph_task_id() != -1 else
                "dispatch again to combine again")
        raise ValueError(
            f"{fn}: a backward ran since this rank's last dispatch (a differentiable dispatch's or combine's "
            "backward exchanges in whole rounds of its own on the workspace), which closed that dispatch's round: "
            f"every combine of a round comes before its backward (loss.backward()); {hint}")


# Round tags. Per (workspace address, rank), the C++ ops count every
# dispatch and combine the rank makes on its row since it was initialized
# (csrc/ops.h, count_exchange: plain or differentiable, eager or compiled,
# forward and backward rounds alike, each counted by the operator's host
# code once it ran or was launched; a backward round counts as its dispatch
# and its combines). Every rank makes the same exchanges in the same order
# (they are collectives), so the n-th is the same exchange on every rank,
# and its number identifies it: the autograd node of a differentiable
# exchange keeps it (round_tag_of_last_exchange), and its backward rounds
# carry it as their round tag, which the dispatch writes beside its
# signature for its peers to compare. Ranks whose backwards run the rounds
# of different exchanges at the same place then fail there, where their
# rows' sizes alone paired them (wrong gradients, no error). Exchanges are
# counted whether or not they get a backward: which ones do follows from
# requires_grad, which may differ between ranks where no backward depends
# on it (a gradient that is None on one rank only, under create_graph), and
# whichever function made them: one rank may make an exchange with the plain
# functions where another makes it with the differentiable ones (under
# torch.no_grad(), the same exchange), and a frame may run compiled on one
# rank and eagerly on another (Dynamo's recompile limit), where a plain
# call runs as the C++ op without this module. A CUDA graph's replays count
# nothing (the host does not run them; every rank replays the same graphs).
# Initialization starts the count again (forget_round_tags): it is
# collective, so a rank that missed calls (masked off) or a workspace new at
# a freed one's address starts where its peers do.

# The round tag of a backward round whose exchange is not known (a traced
# one's): it pairs with the backward round of any exchange (protocol.h,
# kRoundTagAny), never with a call that is no backward round (tag 0).
ROUND_TAG_ANY = -1


def round_tag_of_last_exchange(workspace: torch.Tensor, rank: int) -> int:
    """The round tag of the autograd node of the exchange that a
    differentiable op's body has just made on ``rank``'s row of
    ``workspace`` (the node's ``setup_context``): the number of the rank's
    last dispatch or combine there, 1, 2, ... (``_C.exchange_count``), which
    the node's backward rounds carry. :data:`ROUND_TAG_ANY` where the node is
    traced (torch.compile; a fake or functional workspace: make_fx,
    AOTAutograd): a number read while tracing would be a constant of the
    graph. Such a round pairs with the backward round of any exchange
    (protocol.h, round_tags_differ), so a compiled backward's round pairs
    with an eager one of the same exchange (a frame that Dynamo compiled on
    one rank and runs eagerly on another, past its recompile limit) by its
    rows' sizes. A host counter: no device access."""
    if torch.compiler.is_compiling() or not _real(workspace):
        return ROUND_TAG_ANY
    return _C.exchange_count(workspace, rank)


def forget_round_tags(workspace: torch.Tensor, rank: int) -> None:
    """Starts ``rank``'s count of exchanges on ``workspace`` again (round
    tags from 1): its row is initialized (every rank's is, before their next
    exchange)."""
    if _real(workspace):
        _C.forget_exchange_count(workspace, rank)


def _real(workspace: torch.Tensor) -> bool:
    """Whether ``workspace`` is memory of this process (not a fake or
    functional tensor of a trace, which has no address)."""
    return type(workspace) is torch.Tensor or type(workspace) is torch.nn.Parameter


def _version(t: torch.Tensor) -> Optional[int]:
    """``t``'s version counter, which every in-place write to its storage
    through any view moves; None for an inference tensor, which has none."""
    return None if t.is_inference() else t._version


def _written_since(t: torch.Tensor, version: Optional[int]) -> bool:
    """Whether ``t`` was written in place since its counter read ``version``,
    as far as the counter tells: only where the tensor is its whole storage
    (for a part of a larger one, a write to another part moves it too). The
    storage is looked at here, off the dispatch's path: only once the
    counter moved."""
    return (version is not None and t._version != version
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def last_dispatch(workspace: torch.Tensor,
                  rank: int) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor], int, bool, bool]]:
    """The ids, counts (expert-major; else None), num_experts and plainness
    of ``rank``'s last eager dispatch on ``workspace``, and whether the ids
    were written in place since; None if none is recorded (none, or only
    plain ones since the process started)."""
    entry = _entry(workspace, rank)
    if entry is None:
        return None
    return entry[1], entry[2], entry[3], entry[4], _written_since(entry[1], entry[5])


def tracing() -> bool:
    """Whether this call is being traced: by torch.compile, or under a
    dispatch mode (make_fx, FakeTensorMode, ...), which must see every view
    op and gets none of the views built outside it (cached, or made eagerly)."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def checkpoint_mode() -> bool:
    """Whether the current dispatch mode is selective activation
    checkpointing's (torch.utils.checkpoint with a ``context_fn``): it runs
    the ops eagerly and saves their outputs, or hands the saved ones back in
    the recomputation, so the eager bookkeeping (the last dispatch's ids,
    which the combine checks) runs there too, and the plain functions given
    tensors that require grad run as the differentiable ones, as in eager
    mode."""
    return _in_dispatch_mode(_CHECKPOINT_MODES)


def checkpoint_forward() -> bool:
    """Whether the current dispatch mode is selective activation
    checkpointing's forward one, which runs the exchanges and saves their
    outputs. Its recomputation hands them back (checkpoint_policy saves
    them): no exchange runs there, so there is nothing to record or check,
    and its checks would compare with the rank's current last dispatch, a
    later layer's where the region holds a combine without its dispatch."""
    return _in_dispatch_mode(_FORWARD_MODES)


def _in_dispatch_mode(modes: tuple) -> bool:
    """Whether the current dispatch mode is one of ``modes`` (empty: none)."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False  # (and no dispatch-stack query, which Dynamo cannot trace)
    return bool(modes) and isinstance(_get_current_dispatch_mode(), modes)


# Selective checkpointing's dispatch modes (private classes of torch.utils.checkpoint; none where a torch lacks
# them): the forward's, which saves outputs, and the recomputation's, which hands them back.
_FORWARD_MODES = tuple(m for m in (getattr(checkpoint, "_CachingTorchDispatchMode", None),) if m is not None)
_CHECKPOINT_MODES = _FORWARD_MODES + tuple(m for m in (getattr(checkpoint, "_CachedTorchDispatchMode", None),)
                                           if m is not None)


def refuse_forward_ad(fn: str, tensors: Any) -> None:
    """Refuses tensors that carry a forward-mode tangent, before any exchange runs.

    Raises:
        NotImplementedError: inside ``torch.autograd.forward_ad.dual_level()``,
            one of ``tensors`` is a dual tensor: the exchanges have a backward
            (reverse mode) only, and the tangent would otherwise be dropped
            without a word, or torch would raise after the exchange ran,
            leaving the round open.
    """
    if forward_ad._current_level < 0:  # no dual level open: one attribute read
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"{fn}: forward-mode AD (torch.autograd.forward_ad) is not supported: the exchanges are "
                "collectives with a reverse-mode backward only; pass the primal (forward_ad.unpack_dual(x).primal) "
                "and compute gradients with torch.autograd (loss.backward() or torch.autograd.grad)")


def wants_grad(fn: str, differentiable: str, *tensors: Any) -> bool:
    """Whether an eager call under grad mode got a tensor that requires grad:
    the plain functions then run as the differentiable ones (autograd.py).
    Grad mode first: under inference it is one call.

    Raises:
        ValueError: such a call traced (torch.compile, make_fx, ...): traced,
            the plain functions run the ops, which have no backward, so the
            gradient would be lost without a word; it names ``fn`` and
            ``differentiable``.
        NotImplementedError: a tensor with a forward-mode tangent (:func:`refuse_forward_ad`).
    """
    refuse_forward_ad(fn, tensors)
    if not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)):
        return False
    if tracing() and not checkpoint_mode():
        raise ValueError(f"{fn}: a tensor that requires grad, in a traced call (torch.compile, make_fx, ...), where "
                         f"the plain functions have no backward and the gradient would be lost: use {differentiable}, "
                         f"or call under torch.no_grad() (or pass .detach())")
    return True


def run_dispatch(fn: str, args: tuple, build_views: bool, traced: bool) -> Optional[tuple]:
    """Run the dispatch op on ``args`` (:func:`~torch_moe_a2a.arguments.dispatch_args`):
    through ``_C.dispatch`` when :func:`direct_call_ok`, else through ``torch.ops``.

    Args:
        fn: the public function's name, for the errors.
        args: the op's arguments.
        build_views: whether an eager call also builds the receive views.
        traced: :func:`tracing`'s answer for this call (the caller has it).

    Returns:
        ``(output_payloads, combine_payload_offset, eplb_gathered_stats)`` of
        an eager call with ``build_views``; None otherwise (traced calls build
        theirs with :func:`traced_receive_views`).

    Raises:
        ValueError: an argument of the wrong type, named; what the op raises.
    """
    # args: (ids, payloads, workspace, ep_rank, ep_size, max_num_tokens, runtime_max, top_k, num_experts,
    # eplb_local_stats, eplb_n, mask, timeout_s, mailbox, enable_pdl); indexed, not unpacked: a
    # dispatch's host cost is counted in tenths of a microsecond.
    if not traced and direct_call_ok(args[0], args[2], args[9], *args[1]):
        # One C++ call runs the op and builds every view (protocol.h's call_layout); round tag 0: no backward's.
        try:
            return _C.dispatch(*args, 0, build_views)
        except TypeError as e:
            (ids, payloads, workspace, ep_rank, ep_size, _, runtime_max, top_k, num_experts, eplb_local_stats, _, _,
             timeout_s, _, enable_pdl) = args
            raise wrong_type(fn, e, token_selected_experts=(ids, TENSOR), input_payloads=(payloads, TENSORS),
                             workspace=(workspace, TENSOR), runtime_max_tokens_per_rank=(runtime_max, INT),
                             ep_rank=(ep_rank, INT), ep_size=(ep_size, INT), top_k=(top_k, INT),
                             num_experts=(num_experts, INT), eplb_local_stats=(eplb_local_stats, OPT_TENSOR),
                             timeout_s=(timeout_s, FLOAT), enable_pdl=(enable_pdl, BOOL)) from None
    # Not the fast path: the op's own error for a payload that is not a tensor names no argument.
    expect_tensor_list(fn, "input_payloads", args[1])
    torch.ops.moe_a2a.dispatch.default(*args)
    if traced or not build_views:
        return None
    call_eplb_n = args[10] if args[9] is not None else 0
    return _C.receive_views(args[2], args[3], args[4], args[6], call_eplb_n, args[1])


def traced_receive_views(
    workspace: torch.Tensor, ep_rank: int, ep_size: int, runtime_max: int, eplb_n: int, payloads: list[torch.Tensor]
) -> tuple[list[torch.Tensor], int, Optional[torch.Tensor]]:
    """Dispatch's return values when traced (:func:`tracing`): the receive
    views built with plain view ops relative to the workspace's row
    (layout.region_view), which trace; eager calls use the C++
    ``_C.receive_views`` instead (view ops too, from the same layout, with the
    offsets of the workspace at hand)."""
    row_bytes = tuple(p.element_size() * math.prod(p.shape[1:]) for p in payloads)
    call = layout.call_layout(ep_size, runtime_max, eplb_n, row_bytes)
    row = workspace.select(0, ep_rank)
    views = []
    for payload, offset in zip(payloads, call.payload_offsets):
        view = layout.region_view(row, offset, (ep_size, runtime_max, *payload.shape[1:]), payload.dtype)
        view._moe_a2a_row_offset = offset  # sanitize cannot trace storage_offset()
        views.append(view)
    eplb = None
    if call.eplb_offset >= 0:
        eplb = layout.region_view(row, call.eplb_offset, (ep_size, eplb_n), torch.int32)
    return views, call.combine_offset, eplb
