"""The metainfo tensor ``moe_a2a_initialize`` returns, read into plain ints
once per tensor (a constant to ``torch.compile``), and the rank checks
against it."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from . import layout
from .compile_marks import constant_result
from .fastpath import forget_round_tags

# (ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts, size_per_rank, mailbox,
#  timeout_s: initialize's, or ENV_TIMEOUT where it gave none)
MetaValues = tuple[int, int, int, int, int, int, float]
# The ops' timeout_s for "use MOE_A2A_TIMEOUT_S, else the default".
ENV_TIMEOUT = -1.0
# id(metainfo) -> (weak reference to it, its values). The weak reference both
# detects a reused id and drops the entry when the tensor dies.
_META_CACHE: dict[int, tuple[weakref.ref, MetaValues]] = {}


def _drop_dead_entry(cache: dict, key: int, ref: weakref.ref) -> None:
    """Weak-reference callback of the id-keyed caches: forget the entry of a dead
    tensor (unless a new tensor with the same id already replaced it)."""
    entry = cache.get(key)
    if entry is not None and entry[0] is ref:
        del cache[key]


def _read_metainfo(metainfo: Any) -> MetaValues:
    if not (
        isinstance(metainfo, torch.Tensor)
        and metainfo.dtype == torch.int64
        and metainfo.device.type == "cpu"
        and tuple(metainfo.shape) == (layout.META_COUNT,)
    ):
        what = (
            f"{metainfo.dtype} {tuple(metainfo.shape)} on {metainfo.device}"
            if isinstance(metainfo, torch.Tensor)
            else type(metainfo).__name__
        )
        raise ValueError(
            f"metainfo must be the CPU int64 [{layout.META_COUNT}] tensor returned by "
            f"moe_a2a_initialize, got {what}"
        )
    if is_fake(metainfo):
        # Its values configure the call (ranks, sizes, the mailbox): a trace
        # needs them as constants, which a fake tensor does not hold.
        raise ValueError(
            "metainfo is a fake tensor (an input of a make_fx or FakeTensorMode trace): its values are the "
            "call's configuration, which a trace needs as constants; pass the real tensor moe_a2a_initialize "
            "returned from outside the traced function (close over it); torch.compile takes it as an argument"
        )
    v = metainfo.tolist()
    if v[layout.META_MAGIC] != layout.MAGIC or v[layout.META_VERSION] != layout.VERSION:
        raise ValueError(
            "metainfo was not returned by torch_moe_a2a.moe_a2a_initialize "
            f"(magic {v[layout.META_MAGIC]:#x}, version {v[layout.META_VERSION]}; expected "
            f"{layout.MAGIC:#x}, {layout.VERSION})"
        )
    timeout_us = v[layout.META_TIMEOUT_US]
    if not 0 <= timeout_us <= layout.MAX_TIMEOUT_S * 1_000_000:
        # Initialize writes 0 (no timeout of its own) or a checked timeout_s:
        # another value was written by hand, and a huge one would make every
        # wait unbounded.
        raise ValueError(
            f"metainfo's timeout word is {timeout_us} us, outside [0, {layout.MAX_TIMEOUT_S} s]: metainfo is "
            "written by moe_a2a_initialize only (its timeout_s= sets this word)"
        )
    return (
        v[layout.META_EP_RANK],
        v[layout.META_EP_SIZE],
        v[layout.META_MAX_NUM_TOKENS],
        v[layout.META_EPLB_N],
        v[layout.META_SIZE_PER_RANK],
        v[layout.META_MAILBOX_ADDR],
        timeout_us / 1e6 if timeout_us > 0 else ENV_TIMEOUT,
    )


@constant_result
def metainfo_values(metainfo: torch.Tensor, key: int) -> MetaValues:
    """The metainfo values as Python ints; ``key`` must be ``id(metainfo)``.

    Eager: a dict lookup after the first call. ``torch.compile``: dynamo calls
    this with the real tensor at trace time and bakes the result into the
    graph; the ``id(metainfo)`` argument makes it guard on the tensor's
    identity, so another metainfo recompiles instead of reusing stale values.
    Metainfo is never written after ``moe_a2a_initialize`` (the mailbox lives
    elsewhere), so its values are constants for the life of the tensor.
    """
    entry = _META_CACHE.get(key)
    if entry is not None and entry[0]() is metainfo:
        return entry[1]
    values = _read_metainfo(metainfo)
    ref = weakref.ref(metainfo, lambda r, key=key: _drop_dead_entry(_META_CACHE, key, r))
    _META_CACHE[key] = (ref, values)
    return values


def check_timeout(timeout_s: Any, fn: str = "") -> None:
    """A bound on a wait: None, or a positive number of seconds up to layout.MAX_TIMEOUT_S.

    Raises:
        ValueError: anything else (zero or less would read as the op's
            "not set" and wait for MOE_A2A_TIMEOUT_S or 30 s instead).
    """
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
                                      and 0 < timeout_s <= layout.MAX_TIMEOUT_S):
        raise ValueError(f"{fn + ': ' if fn else ''}timeout_s must be a positive number of seconds up to "
                         f"{layout.MAX_TIMEOUT_S:.0e} or None, got {timeout_s!r}")


def call_timeout(meta: MetaValues, timeout_s) -> float:
    """The op's ``timeout_s`` for a call: the call's own, else the metainfo's
    (``moe_a2a_initialize(timeout_s=)``), else ``ENV_TIMEOUT``.

    Raises:
        ValueError: the call's own is not None or a positive finite number.
    """
    if timeout_s is None:
        return meta[6]
    check_timeout(timeout_s)
    return timeout_s


def check_rows_contiguous(rows: torch.Tensor, workspace: torch.Tensor, prefix: str = "", also: str = "") -> None:
    """Whether each row of the 2-D ``rows`` (``workspace``, or a view of it
    with a leading dimension added) is adjacent bytes, as every view of a row
    as another dtype and every kernel needs.

    Raises:
        ValueError: it is not (a transposed or strided view), naming
            ``workspace``'s strides, after ``prefix``; ``also`` ends the hint.
    """
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        raise ValueError(f"{prefix}the workspace's rows must be contiguous (stride 1 within a row), got strides "
                         f"{tuple(workspace.stride())} for shape {tuple(workspace.shape)}: pass the workspace that "
                         f"allocate_workspace returned{also}")


def check_rank(meta: MetaValues, ep_rank: int, ep_size: int, workspace: torch.Tensor) -> None:
    """A call's ep_rank, ep_size and workspace against its metainfo.

    Raises:
        ValueError: ep_rank or ep_size other than the metainfo's, a workspace
            whose rows are not contiguous, or one whose rows have another
            size than the one it was initialized with
            (the metainfo of another workspace: the op would wait for peers that
            never come, or read a layout that is not there).
    """
    if type(ep_rank) is bool or type(ep_size) is bool:  # True == 1 would pass the comparison
        raise ValueError(f"ep_rank and ep_size must be ints, got ({ep_rank!r}, {ep_size!r})")
    if meta[0] != ep_rank or meta[1] != ep_size:
        raise ValueError(
            f"ep_rank/ep_size ({ep_rank}, {ep_size}) do not match the metainfo "
            f"({meta[0]}, {meta[1]}) given by moe_a2a_initialize"
        )
    if workspace.dim() == 2:
        # A transposed or strided view: its row length is not the row's bytes either.
        check_rows_contiguous(workspace, workspace)
    if workspace.dim() == 2 and workspace.shape[1] != meta[4]:
        if workspace.dtype != torch.uint8:  # a view as another dtype: its row length is not the bytes'
            raise ValueError(f"workspace must be the uint8 [ep_size, size_per_rank] tensor, got {workspace.dtype}")
        raise ValueError(
            f"the metainfo belongs to a workspace of {meta[4]} bytes per rank, this workspace has "
            f"{workspace.shape[1]}: pass the metainfo that moe_a2a_initialize returned for this workspace"
        )


def check_rank_index(meta: MetaValues, ep_rank: int, workspace: Optional[torch.Tensor] = None) -> None:
    """A getter's ep_rank: any rank of the workspace (the header it reads is
    that rank's); and ``workspace``, when given, the metainfo's: ep_size rows
    of the size it was initialized with (else the getter reads another
    workspace's words, or fails on a row that is not there).

    Raises:
        ValueError: either is not.
    """
    if workspace is not None and (not isinstance(workspace, torch.Tensor) or workspace.dim() != 2
                                  or tuple(workspace.shape) != (meta[1], meta[4])):
        raise ValueError(f"the metainfo belongs to a workspace of [{meta[1]}, {meta[4]}] bytes (ep_size x bytes per "
                         f"rank), got {tuple(getattr(workspace, 'shape', ()))}: pass the metainfo that "
                         "moe_a2a_initialize returned for this workspace")
    if type(ep_rank) is bool or not 0 <= ep_rank < meta[1]:
        raise ValueError(f"ep_rank must be in [0, {meta[1]}) (the metainfo's ep_size), got {ep_rank}")


def reinitialize_row(workspace: torch.Tensor, metainfo: torch.Tensor) -> None:
    """``moe_a2a_initialize`` of ``metainfo``'s rank again, with the sizes and the
    error mailbox it holds (the op clears the mailbox), so that ``metainfo``, and
    the CUDA graphs that baked it in, stay valid. Enqueued on the current stream."""
    ep_rank, ep_size, max_num_tokens, eplb_n, _, mailbox, _ = metainfo_values(metainfo, id(metainfo))
    torch.ops.moe_a2a.initialize.default(workspace, ep_rank, ep_size, max_num_tokens, eplb_n, mailbox)
    forget_round_tags(workspace, ep_rank)
