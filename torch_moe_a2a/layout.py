"""Python mirror of ``csrc/protocol.h``: limits, metainfo indices, header
offsets and the per-call layout. The Python layer builds every workspace view
from these numbers; ``tests/test_layout.py`` proves they equal the C++ ones
(``torch.ops.moe_a2a.constants`` / ``call_layout`` / ``workspace_size_per_rank``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# ---- limits ----------------------------------------------------------------
MAX_RANKS = 64
MOE_A2A_RANK_MASK_WORDS = (MAX_RANKS + 63) // 64
MAX_TOP_K = 22
MAX_PAYLOADS = 8
# The planes of one call: the user's payloads and, in an expert-major call,
# the expert ids and the router weights, which travel as payloads too.
MAX_CALL_PAYLOADS = MAX_PAYLOADS + 2
MAX_NUM_TOKENS = (1 << 24) - 1
ALIGN = 128
# A low-precision combine's e4m3 rows with block scales (csrc/protocol.h):
# blocks of LOW_PRECISION_BLOCK elements with a scale byte each, in groups of
# LOW_PRECISION_GROUP_BLOCKS blocks LOW_PRECISION_GROUP_PITCH bytes apart.
LOW_PRECISION_BLOCK = 128
LOW_PRECISION_GROUP_BLOCKS = 16
LOW_PRECISION_GROUP_PITCH = LOW_PRECISION_BLOCK * LOW_PRECISION_GROUP_BLOCKS + LOW_PRECISION_GROUP_BLOCKS
PLANE_ALIGN = 256  # payload planes, the combine region, workspace_size_per_rank's multiple
DEFAULT_TIMEOUT_S = 30.0

# ---- route entries -----------------------------------------------------------
ROUTE_RANK_SHIFT = 24
ROUTE_END = -1

# ---- metainfo indices ---------------------------------------------------------
META_MAGIC = 0
META_VERSION = 1
META_EP_RANK = 2
META_EP_SIZE = 3
META_MAX_NUM_TOKENS = 4
META_EPLB_N = 5
META_SIZE_PER_RANK = 6
META_HEADER_BYTES = 7
META_MAILBOX_CODE = 8
META_MAILBOX_MISSING = 9
META_MAILBOX_DETAIL = META_MAILBOX_MISSING + MOE_A2A_RANK_MASK_WORDS
META_MAILBOX_ADDR = META_MAILBOX_DETAIL + 1  # the op's `mailbox` argument
# moe_a2a_initialize's timeout_s in microseconds (0: none), the calls' default
# timeout: it reaches every call that passes the metainfo.
META_TIMEOUT_US = META_MAILBOX_ADDR + 1
META_COUNT = META_TIMEOUT_US + 1
MAGIC = 0x4D6F65413241
VERSION = 1
# A row's init word (HDR_MAGIC) is MAGIC in its low INIT_TAG_SHIFT bits and a
# tag above them (csrc/protocol.h: init_word).
INIT_TAG_SHIFT = 48
# A flag word (dispatch and combine flags, HDR_PULL_DONE) grows by FLAG_SHARES
# per call of its writer: it reads n * FLAG_SHARES (mod 2**32) once calls 1..n
# are complete (csrc/protocol.h: flag_target).
FLAG_SHARES = 1 << 16

# ---- error codes ----------------------------------------------------------------
ERROR_NONE = 0
ERROR_DISPATCH_TIMEOUT = 1
ERROR_COMBINE_TIMEOUT = 2
ERROR_SEQUENCE = 3
ERROR_RUNTIME_MAX_MISMATCH = 4
ERROR_COMBINE_MISMATCH = 5
ERROR_PAYLOAD_MISMATCH = 6
ERROR_COMBINE_ROWS_MISMATCH = 7
ERROR_PEER_FAILED = 8
ERROR_INTERRUPTED = 9  # a wait ended by a signal's exception (Ctrl-C); no peers named: SimulatedEP.run's
ERROR_SANITIZE_MISMATCH = 10  # sanitize given a view that is no plane of the last dispatch (CUDA; detail: its T)
# ERROR_PAYLOAD_MISMATCH's detail where the peers' round tags differ (the
# backward rounds of different exchanges; protocol.h, round_tags_differ).
PAYLOAD_MISMATCH_BACKWARD_ROUND = 1
# What differs for ERROR_COMBINE_MISMATCH: bit i of its detail names
# COMBINE_MISMATCH_FIELDS[i] (protocol.h: CombineMismatch).
COMBINE_MISMATCH_FIELDS = ("local_num_tokens", "runtime_max_tokens_per_rank", "top_k", "combine_payload_offset",
                           "expert-major layout", "payload (the combine region holds a low-precision combine's rows)",
                           "layout (a rank-major combine after an expert-major dispatch)")

# ---- rank header byte offsets ---------------------------------------------------
HDR_MAGIC = 0
HDR_EP_RANK = 8
HDR_EP_SIZE = 12
HDR_MAX_NUM_TOKENS = 16
HDR_EPLB_N = 20
HDR_DISPATCH_EPOCH = 24
HDR_COMBINE_EPOCH = 28
HDR_ERROR_CODE = 32
# A timed-out wait's timeout (ms), this rank's T for ERROR_RUNTIME_MAX_MISMATCH, the
# COMBINE_MISMATCH_FIELDS bits for ERROR_COMBINE_MISMATCH, PAYLOAD_MISMATCH_BACKWARD_ROUND
# or 0 for ERROR_PAYLOAD_MISMATCH.
HDR_ERROR_DETAIL = 36
HDR_ERROR_MISSING = 40
HDR_INVALID_EXPERT_COUNT = 48
HDR_LAST_LOCAL_TOKENS = 56
HDR_LAST_RUNTIME_MAX = 60
HDR_LAST_TOP_K = 64
HDR_PULL_DONE = 68  # uint32: flag_target(n) once combine n pulled (protocol.h, flags count shares)
HDR_COMBINE_CLAIMS = 72  # CUDA grid scratch, uint32 [2]: [n & 1] the pull tasks claimed by combine n
HDR_LAST_DISPATCH_END = 80  # dispatch step 0 (protocol.h)
HDR_DISPATCH_CLAIM0 = 88  # CUDA grid scratch: claim counter 0 of large dispatches
# Expert-major layout (protocol.h, ExpertMajorLayout), own words written by the expert-major dispatch:
HDR_DROPPED_PAIR_COUNT = 96  # int64, cumulative: pairs beyond max_tokens_per_expert
HDR_EXPERT_MAJOR_END = 104  # int64: the last build's expert-major combine offset
HDR_EXPERT_MAJOR_EPOCH = 112  # uint32: the dispatch epoch of the last build
HDR_EXPERT_MAJOR_TOKENS = 116  # int32: the last build's max_tokens_per_expert
HDR_COMBINE_COUNT = 120  # uint32: combines finished since initialize (flag targets of combine flags, pull_done)
HDR_REGION_STAGED = 124  # uint32: 1 while the combine region holds rows a combine staged since the dispatch
HDR_DISPATCH_FLAGS = 128
HDR_COMBINE_FLAGS = HDR_DISPATCH_FLAGS + 4 * MAX_RANKS
HDR_RECV_COUNTS = HDR_COMBINE_FLAGS + 4 * MAX_RANKS
HDR_PEER_RUNTIME_MAX = HDR_RECV_COUNTS + 4 * MAX_RANKS  # int32 [MAX_RANKS]: [s] = T of rank s's latest dispatch
# uint32 [MAX_RANKS][2]: [s] = payload signature of rank s's latest dispatch, then its round tag (protocol.h)
HDR_PEER_PAYLOADS = HDR_PEER_RUNTIME_MAX + 4 * MAX_RANKS
# uint32 [2][MAX_RANKS]: [c & 1][s] = the combine signature of rank s's combine c (protocol.h, the equal-rows check)
HDR_COMBINE_SIGNATURES = HDR_PEER_PAYLOADS + 2 * 4 * MAX_RANKS
HDR_INIT_STALE = HDR_COMBINE_SIGNATURES + 2 * 4 * MAX_RANKS  # uint16 [MAX_RANKS]: protocol.h, dispatch step 0a
HDR_INIT_SEEN = HDR_INIT_STALE + 2 * MAX_RANKS  # uint16 [MAX_RANKS]
MAX_DISPATCH_CTAS = 1024
# CUDA grid scratch of large dispatches: uint64 [MAX_DISPATCH_CTAS * MAX_RANKS], uint32 [MAX_DISPATCH_CTAS]
HDR_DISPATCH_COUNTS = HDR_INIT_SEEN + 2 * MAX_RANKS
HDR_DISPATCH_ROUTED = HDR_DISPATCH_COUNTS + 8 * MAX_DISPATCH_CTAS * MAX_RANKS
# CUDA grid scratch of large dispatches: copy tasks claimed, counter 0 at HDR_DISPATCH_CLAIM0,
# counter c >= 1 at HDR_DISPATCH_CLAIMS + (c - 1) * CLAIM_STRIDE (claim_counter_offset)
CLAIM_COUNTERS = 16
CLAIM_STRIDE = 128
HDR_DISPATCH_CLAIMS = HDR_DISPATCH_ROUTED + 4 * MAX_DISPATCH_CTAS
HEADER_BYTES = HDR_DISPATCH_CLAIMS + CLAIM_STRIDE * (CLAIM_COUNTERS - 1)
MAX_LOCAL_EXPERTS = 1024  # experts per rank of an expert-major call
# The longest bound on a wait, in seconds (about 31 years): the metainfo holds
# a call's in microseconds in an int64, the kernels in nanoseconds.
MAX_TIMEOUT_S = 1_000_000_000
MAX_EXPERT_MAJOR_ROWS = (1 << 31) - 1  # pair rows e * M + i are int32
NO_PAIR = -1

# Names and values that tests/test_layout.py compares with torch.ops.moe_a2a.constants().
# The order is the order in which csrc/ops.cpp emits them.
CONSTANTS = {
    "MAX_RANKS": MAX_RANKS,
    "RANK_MASK_WORDS": MOE_A2A_RANK_MASK_WORDS,
    "MAX_TOP_K": MAX_TOP_K,
    "MAX_PAYLOADS": MAX_PAYLOADS,
    "MAX_CALL_PAYLOADS": MAX_CALL_PAYLOADS,
    "MAX_NUM_TOKENS": MAX_NUM_TOKENS,
    "ALIGN": ALIGN,
    "PLANE_ALIGN": PLANE_ALIGN,
    "ROUTE_RANK_SHIFT": ROUTE_RANK_SHIFT,
    "META_COUNT": META_COUNT,
    "META_MAILBOX_CODE": META_MAILBOX_CODE,
    "META_MAILBOX_MISSING": META_MAILBOX_MISSING,
    "META_MAILBOX_DETAIL": META_MAILBOX_DETAIL,
    "META_MAILBOX_ADDR": META_MAILBOX_ADDR,
    "MAGIC": MAGIC,
    "INIT_TAG_SHIFT": INIT_TAG_SHIFT,
    "VERSION": VERSION,
    "HDR_DISPATCH_EPOCH": HDR_DISPATCH_EPOCH,
    "HDR_COMBINE_EPOCH": HDR_COMBINE_EPOCH,
    "HDR_ERROR_CODE": HDR_ERROR_CODE,
    "HDR_ERROR_DETAIL": HDR_ERROR_DETAIL,
    "HDR_ERROR_MISSING": HDR_ERROR_MISSING,
    "HDR_INVALID_EXPERT_COUNT": HDR_INVALID_EXPERT_COUNT,
    "HDR_LAST_LOCAL_TOKENS": HDR_LAST_LOCAL_TOKENS,
    "HDR_DISPATCH_FLAGS": HDR_DISPATCH_FLAGS,
    "HDR_COMBINE_FLAGS": HDR_COMBINE_FLAGS,
    "HDR_RECV_COUNTS": HDR_RECV_COUNTS,
    "HDR_PEER_RUNTIME_MAX": HDR_PEER_RUNTIME_MAX,
    "HDR_PEER_PAYLOADS": HDR_PEER_PAYLOADS,
    "HDR_INIT_STALE": HDR_INIT_STALE,
    "HDR_INIT_SEEN": HDR_INIT_SEEN,
    "MAX_DISPATCH_CTAS": MAX_DISPATCH_CTAS,
    "HDR_DISPATCH_COUNTS": HDR_DISPATCH_COUNTS,
    "HDR_DISPATCH_ROUTED": HDR_DISPATCH_ROUTED,
    "CLAIM_COUNTERS": CLAIM_COUNTERS,
    "CLAIM_STRIDE": CLAIM_STRIDE,
    "HDR_DISPATCH_CLAIM0": HDR_DISPATCH_CLAIM0,
    "HDR_DISPATCH_CLAIMS": HDR_DISPATCH_CLAIMS,
    "HEADER_BYTES": HEADER_BYTES,
    "LOW_PRECISION_BLOCK": LOW_PRECISION_BLOCK,
    "LOW_PRECISION_GROUP_BLOCKS": LOW_PRECISION_GROUP_BLOCKS,
    "LOW_PRECISION_GROUP_PITCH": LOW_PRECISION_GROUP_PITCH,
    "HDR_DROPPED_PAIR_COUNT": HDR_DROPPED_PAIR_COUNT,
    "HDR_EXPERT_MAJOR_END": HDR_EXPERT_MAJOR_END,
    "HDR_EXPERT_MAJOR_EPOCH": HDR_EXPERT_MAJOR_EPOCH,
    "HDR_EXPERT_MAJOR_TOKENS": HDR_EXPERT_MAJOR_TOKENS,
    "HDR_COMBINE_COUNT": HDR_COMBINE_COUNT,
    "HDR_REGION_STAGED": HDR_REGION_STAGED,
    "MAX_LOCAL_EXPERTS": MAX_LOCAL_EXPERTS,
    "MAX_EXPERT_MAJOR_ROWS": MAX_EXPERT_MAJOR_ROWS,
    "HDR_COMBINE_SIGNATURES": HDR_COMBINE_SIGNATURES,
    "MAX_TIMEOUT_S": MAX_TIMEOUT_S,
}


def claim_counter_offset(c: int) -> int:
    """Header offset of a large dispatch's claim counter ``c`` (protocol.h's twin)."""
    if not 0 <= c < CLAIM_COUNTERS:
        raise ValueError(f"claim counter {c} outside [0, {CLAIM_COUNTERS})")
    return HDR_DISPATCH_CLAIM0 if c == 0 else HDR_DISPATCH_CLAIMS + CLAIM_STRIDE * (c - 1)


def align_up(x: int, a: int = ALIGN) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class CallLayout:
    """Byte offsets, relative to a rank's row, of one call's regions."""

    route_offset: int
    eplb_offset: int  # -1 when the call gathers no EPLB stats
    payload_offsets: tuple[int, ...]
    combine_offset: int  # the combine_payload_offset dispatch returns


def call_layout(ep_size: int, runtime_max_tokens: int, eplb_n: int, payload_row_bytes) -> CallLayout:
    """Mirror of ``moe_a2a::call_layout`` in csrc/protocol.h."""
    off = HEADER_BYTES
    route_offset = off
    off = align_up(off + runtime_max_tokens * MAX_TOP_K * 4)
    eplb_offset = -1
    if eplb_n > 0:
        eplb_offset = off
        off = align_up(off + ep_size * eplb_n * 4)
    offsets = []
    for row_bytes in payload_row_bytes:
        offsets.append(align_up(off, PLANE_ALIGN))
        off = offsets[-1] + ep_size * runtime_max_tokens * row_bytes
    return CallLayout(route_offset, eplb_offset, tuple(offsets), align_up(off, PLANE_ALIGN))


def combine_end(combine_offset: int, ep_size: int, runtime_max_tokens: int, combine_row_bytes: int) -> int:
    return combine_offset + ep_size * runtime_max_tokens * combine_row_bytes


def workspace_size_per_rank(
    ep_size: int, max_num_tokens: int, total_dispatch_bytes: int, combine_bytes: int, eplb_n: int
) -> int:
    """Mirror of ``moe_a2a::workspace_size_per_rank`` in csrc/protocol.h."""
    size = align_up(HEADER_BYTES + max_num_tokens * MAX_TOP_K * 4, PLANE_ALIGN)
    if eplb_n > 0:
        size += align_up(ep_size * eplb_n * 4, PLANE_ALIGN)
    size += align_up(ep_size * max_num_tokens * total_dispatch_bytes, PLANE_ALIGN) + (MAX_PAYLOADS + 1) * PLANE_ALIGN
    size += align_up(ep_size * max_num_tokens * combine_bytes, PLANE_ALIGN)
    return size


def max_local_experts(num_experts: int, ep_size: int) -> int:
    """The most experts one rank owns: the leading size of every expert-major plane."""
    return -(-num_experts // ep_size)


@dataclass(frozen=True)
class ExpertMajorLayout:
    """Byte offsets, relative to a rank's row, of one expert-major call's regions
    (protocol.h, ExpertMajorLayout): they follow the rank-major call's
    ``combine_offset`` (its dispatch_end)."""

    local_experts: int  # planes' leading size (max_local_experts)
    tokens_per_expert: int  # M
    counts_offset: int  # int32 [local_experts]
    pair_map_offset: int  # int32 [ep_size, T, top_k]
    pair_src_offset: int  # int32 [local_experts, M]
    ids_offset: int  # int32 [local_experts, M]
    weights_offset: int  # fp32 [local_experts, M]
    payload_offsets: tuple[int, ...]  # [local_experts, M, *] per user payload
    combine_offset: int  # [local_experts, M, *]: the expert-major combine_payload_offset


def expert_major_layout(dispatch_end: int, ep_size: int, runtime_max_tokens: int, top_k: int, local_experts: int,
                        tokens_per_expert: int, payload_row_bytes) -> ExpertMajorLayout:
    """Mirror of ``moe_a2a::expert_major_layout`` in csrc/protocol.h."""
    rows = local_experts * tokens_per_expert
    off = dispatch_end
    counts = off
    off = align_up(off + local_experts * 4)
    pair_map = off
    off = align_up(off + ep_size * runtime_max_tokens * top_k * 4)
    pair_src = off
    off = align_up(off + rows * 4)
    ids = off
    off = align_up(off + rows * 4)
    weights = off
    off = align_up(off + rows * 4)
    offsets = []
    for row_bytes in payload_row_bytes:
        offsets.append(align_up(off, PLANE_ALIGN))
        off = offsets[-1] + rows * row_bytes
    return ExpertMajorLayout(local_experts, tokens_per_expert, counts, pair_map, pair_src, ids, weights,
                             tuple(offsets), align_up(off, PLANE_ALIGN))


def expert_major_workspace_size_per_rank(
    ep_size: int, max_num_tokens: int, total_dispatch_bytes: int, combine_bytes: int, eplb_n: int, num_experts: int,
    top_k: int, tokens_per_expert: int
) -> int:
    """Mirror of ``moe_a2a::expert_major_workspace_size_per_rank`` in csrc/protocol.h."""
    size = workspace_size_per_rank(ep_size, max_num_tokens, total_dispatch_bytes + top_k * (8 + 4), 0, eplb_n)
    size += (MAX_CALL_PAYLOADS - MAX_PAYLOADS) * PLANE_ALIGN  # the ids' and the weights' planes' pads
    local = max_local_experts(num_experts, ep_size)
    rows = local * tokens_per_expert
    size += align_up(local * 4, PLANE_ALIGN)
    size += align_up(ep_size * max_num_tokens * top_k * 4, PLANE_ALIGN)
    size += 3 * align_up(rows * 4, PLANE_ALIGN)
    size += align_up(rows * total_dispatch_bytes, PLANE_ALIGN) + (MAX_PAYLOADS + 1) * PLANE_ALIGN
    size += align_up(max(rows, ep_size * max_num_tokens) * combine_bytes, PLANE_ALIGN)
    return size


def experts_per_rank(num_experts: int, ep_size: int) -> list[int]:
    """Contiguous expert ranges: the first ``E % R`` ranks own one more expert."""
    base, extra = divmod(num_experts, ep_size)
    return [base + (1 if r < extra else 0) for r in range(ep_size)]


def expert_range(num_experts: int, ep_size: int, rank: int) -> tuple[int, int]:
    """``[first, last)`` experts owned by ``rank``."""
    base, extra = divmod(num_experts, ep_size)
    first = rank * base + min(rank, extra)
    return first, first + base + (1 if rank < extra else 0)


# ---- views ----------------------------------------------------------------------
def region_view(row, offset: int, shape, dtype):
    """View ``shape`` of ``dtype`` at byte ``offset`` of ``row``, one rank's 1-D uint8 row.

    Ordinary view ops only (narrow, view(dtype), view(shape)), so the result
    aliases the workspace and traces under torch.compile. ``offset`` must be a
    multiple of ``dtype``'s size (every region starts ALIGN-aligned).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    return row.narrow(0, offset, nbytes).view(dtype).view(shape)
