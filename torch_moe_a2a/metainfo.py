"""The metainfo tensor ``moe_a2a_initialize`` returns, read into plain ints
once per tensor (a constant to ``torch.compile``), and the rank checks
against it."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from . import layout
from .compile_marks import constant_result

# (ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts, size_per_rank, mailbox)
MetaValues = tuple[int, int, int, int, int, int]
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
    v = metainfo.tolist()
    if v[layout.META_MAGIC] != layout.MAGIC or v[layout.META_VERSION] != layout.VERSION:
        raise ValueError(
            "metainfo was not returned by torch_moe_a2a.moe_a2a_initialize "
            f"(magic {v[layout.META_MAGIC]:#x}, version {v[layout.META_VERSION]}; expected "
            f"{layout.MAGIC:#x}, {layout.VERSION})"
        )
    return (
        v[layout.META_EP_RANK],
        v[layout.META_EP_SIZE],
        v[layout.META_MAX_NUM_TOKENS],
        v[layout.META_EPLB_N],
        v[layout.META_SIZE_PER_RANK],
        v[layout.META_MAILBOX_ADDR],
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


def check_rank(meta: MetaValues, ep_rank: int, ep_size: int) -> None:
    if meta[0] != ep_rank or meta[1] != ep_size:
        raise ValueError(
            f"ep_rank/ep_size ({ep_rank}, {ep_size}) do not match the metainfo "
            f"({meta[0]}, {meta[1]}) given by moe_a2a_initialize"
        )


def check_rank_index(meta: MetaValues, ep_rank: int) -> None:
    """A getter's ep_rank: any rank of the workspace (the header it reads is that rank's)."""
    if not 0 <= ep_rank < meta[1]:
        raise ValueError(f"ep_rank must be in [0, {meta[1]}) (the metainfo's ep_size), got {ep_rank}")
