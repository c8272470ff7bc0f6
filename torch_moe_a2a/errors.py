"""Error records: the text of a record (one source, csrc/ops.cpp's
``describe_error``) and :func:`check_errors`, which reads every rank's record."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import _C, layout
from .fastpath import expect_tensors
from .layout import MOE_A2A_RANK_MASK_WORDS

_U64 = 1 << 64

def describe_error(ep_rank: int, code: int, missing_words: Sequence[int], detail: int) -> str:
    """The message of an error record: ``describe_error`` of csrc/ops.cpp, the text the
    ops raise, e.g. ``"rank 0: peers [1] did not arrive within 2.0 s (dispatch); the
    workspace stays failed ..."``.

    missing_words: the ``MOE_A2A_RANK_MASK_WORDS`` words of the peer mask (unsigned); detail:
    the timeout in ms, for ``ERROR_RUNTIME_MAX_MISMATCH`` this rank's runtime_max_tokens_per_rank,
    for ``ERROR_COMBINE_MISMATCH`` the bits of ``layout.COMBINE_MISMATCH_FIELDS`` that differ,
    for ``ERROR_PAYLOAD_MISMATCH`` ``layout.PAYLOAD_MISMATCH_BACKWARD_ROUND`` where the call was a
    backward's round (else 0), for ``ERROR_SANITIZE_MISMATCH`` the last dispatch's
    runtime_max_tokens_per_rank.
    """
    return _C.describe_error(ep_rank, code, [int(w) % _U64 for w in missing_words], detail)


def _header_field(headers: torch.Tensor, offset: int, dtype: torch.dtype) -> list[int]:
    """One header field of every row of ``headers`` ([rows, >= the field's end] uint8) as ints."""
    return headers[:, offset : offset + dtype.itemsize].view(dtype)[:, 0].tolist()


def check_errors(workspace: torch.Tensor) -> None:
    """Raise RuntimeError if any rank's header holds an error record (a timed-out wait,
    a dispatch whose peers passed another runtime_max_tokens_per_rank or other
    payloads, or, on CUDA, dispatch and combine out of alternation and a combine
    that does not match its dispatch: the CPU refuses those two before it
    touches the workspace, so nothing is recorded).

    Reads the header of every row of ``workspace`` (``[ep_size, size_per_rank]``
    uint8); uninitialized rows are skipped. On CUDA this copies the headers to
    the host (a sync with the current stream). The message names the rank and
    the peers, as the op's error does.

    Args:
        workspace: the ``[ep_size, size_per_rank]`` uint8 workspace.

    Raises:
        ValueError: ``workspace`` not a tensor, or not of that dtype and shape.
        RuntimeError: a rank's error record, described.
    """
    expect_tensors("check_errors", workspace=workspace)
    raise_first_record(workspace, "check_errors")


def raise_first_record(workspace: torch.Tensor, fn: str, ranks: Optional[Sequence[int]] = None) -> None:
    """check_errors of the rows of ``ranks`` only (None: every row), for ``fn``."""
    records = _records(workspace, fn)
    for rank in range(len(records)) if ranks is None else ranks:
        if records[rank] is not None:
            raise RuntimeError(records[rank])


def row_error(workspace: torch.Tensor, ep_rank: int) -> Optional[str]:
    """The description of rank ``ep_rank``'s error record, or None where its
    row holds none (or is not initialized); the text :func:`check_errors`
    raises. On CUDA a sync with the current stream, as there.

    Args:
        workspace: the ``[ep_size, size_per_rank]`` uint8 workspace.
        ep_rank: the row to read, in ``[0, ep_size)``.

    Returns:
        The record's message, or None.

    Raises:
        ValueError: ``workspace`` not a uint8 ``[ep_size, size_per_rank]``
            tensor, or ``ep_rank`` not one of its rows.
    """
    expect_tensors("row_error", workspace=workspace)
    records = _records(workspace, "row_error")
    if isinstance(ep_rank, bool) or not isinstance(ep_rank, int) or not 0 <= ep_rank < len(records):
        raise ValueError(f"row_error: ep_rank must be a row of the workspace, in [0, {len(records)}), got {ep_rank!r}")
    return records[ep_rank]


def _records(workspace: torch.Tensor, fn: str) -> list[Optional[str]]:
    """Every row's error record, described (None: no record, or a row not initialized)."""
    if workspace.dim() != 2 or workspace.dtype != torch.uint8:
        raise ValueError(
            f"{fn}: workspace must be a uint8 [ep_size, size_per_rank] tensor, got {workspace.dtype} "
            f"{tuple(workspace.shape)}"
        )
    if workspace.shape[1] < layout.HEADER_BYTES:
        raise ValueError(f"{fn}: workspace rows must hold at least the {layout.HEADER_BYTES}-byte header "
                         f"(size_per_rank from moe_a2a_get_workspace_size_per_rank), got {workspace.shape[1]} bytes")
    # The error record lies among the fixed words, which end where the flags begin.
    headers = workspace[:, : layout.HDR_DISPATCH_FLAGS].to("cpu")
    magic = _header_field(headers, layout.HDR_MAGIC, torch.int64)
    codes = _header_field(headers, layout.HDR_ERROR_CODE, torch.int32)
    details = _header_field(headers, layout.HDR_ERROR_DETAIL, torch.int32)
    missing = [
        _header_field(headers, layout.HDR_ERROR_MISSING + 8 * w, torch.int64)
        for w in range(MOE_A2A_RANK_MASK_WORDS)
    ]
    records: list[Optional[str]] = []
    for rank in range(workspace.shape[0]):
        code = codes[rank] & 0xFFFFFFFF
        initialized = magic[rank] % (1 << layout.INIT_TAG_SHIFT) == layout.MAGIC
        if initialized and code != layout.ERROR_NONE:
            words = [m[rank] % _U64 for m in missing]
            records.append(describe_error(rank, code, words, details[rank] & 0xFFFFFFFF))
        else:
            records.append(None)
    return records
