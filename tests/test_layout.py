"""The Python layout mirror (torch_moe_a2a.layout) equals the C++ one (protocol.h,
exposed through torch.ops.moe_a2a.constants / call_layout / workspace_size_per_rank)."""

import pathlib
import random
import re

import pytest
import torch

import torch_moe_a2a as a2a
from torch_moe_a2a import layout

ops = torch.ops.moe_a2a

ROW_BYTES_LISTS = [
    [2048],
    [1],
    [1, 3, 7],
    [4096, 4, 88, 1, 17, 6, 128, 2],
    [1] * layout.MAX_PAYLOADS,
    [129, 255, 31],
]


def test_constants_match_cpp():
    cpp = [int(v) for v in ops.constants()]
    py = list(layout.CONSTANTS.values())
    names = list(layout.CONSTANTS)
    assert len(cpp) == len(py), f"C++ emits {len(cpp)} constants, layout.CONSTANTS has {len(py)}"
    wrong = [f"{n}: python {p} != C++ {c}" for n, p, c in zip(names, py, cpp) if p != c]
    assert not wrong, "; ".join(wrong)


def test_public_constants():
    assert a2a.MOE_A2A_RANK_MASK_WORDS == layout.MOE_A2A_RANK_MASK_WORDS == 1
    # Contract limits (DESIGN.md section 3).
    assert (layout.MAX_RANKS, layout.MAX_TOP_K, layout.MAX_PAYLOADS, layout.ALIGN) == (64, 22, 8, 128)


def _as_list(call: layout.CallLayout) -> list[int]:
    return [call.route_offset, call.eplb_offset, *call.payload_offsets, call.combine_offset]


@pytest.mark.parametrize("ep_size", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("eplb_n", [0, 5, 256])
def test_call_layout_matches_cpp(ep_size, eplb_n):
    for T in [1, 7, 64, 1000]:
        for rows in ROW_BYTES_LISTS:
            py = layout.call_layout(ep_size, T, eplb_n, rows)
            cpp = [int(v) for v in ops.call_layout(ep_size, T, eplb_n, rows)]
            assert cpp == _as_list(py), f"T={T} rows={rows}"
            offsets = _as_list(py)
            assert py.route_offset >= layout.HEADER_BYTES
            assert (py.eplb_offset == -1) == (eplb_n == 0)
            for off in offsets:
                assert off == -1 or off % layout.ALIGN == 0, f"offset {off} not {layout.ALIGN}-aligned"
            # Planes and the combine region start PLANE_ALIGN-aligned (stores to rows at
            # 128 mod 256 bytes are slower on an H200: docs/performance.md, 'Design
            # decisions and their measured effect').
            for off in [*py.payload_offsets, py.combine_offset]:
                assert off % layout.PLANE_ALIGN == 0, f"T={T} rows={rows}: region at {off}"
            # Regions are ordered and do not overlap.
            ends = [py.route_offset + T * layout.MAX_TOP_K * 4]
            if eplb_n:
                assert py.eplb_offset >= ends[-1]
                ends.append(py.eplb_offset + ep_size * eplb_n * 4)
            for off, rb in zip(py.payload_offsets, rows):
                assert off >= ends[-1]
                ends.append(off + ep_size * T * rb)
            assert py.combine_offset >= ends[-1]


SIZE_GRID = [
    # ep_size, max_num_tokens, total_dispatch_bytes, combine_bytes, eplb_n
    (1, 1, 1, 2, 0),
    (2, 16, 2048 + 88, 2048, 0),
    (3, 37, 333, 130, 7),
    (8, 64, 1024 + 8 * 22 + 7, 1024, 256),
    (64, 5, 97, 4, 1),
    (5, 1000, 8, 2, 0),
]


@pytest.mark.parametrize("ep_size,max_tokens,dispatch_bytes,combine_bytes,eplb_n", SIZE_GRID)
def test_workspace_size_matches_and_holds_any_split(ep_size, max_tokens, dispatch_bytes, combine_bytes, eplb_n):
    size = a2a.moe_a2a_get_workspace_size_per_rank(ep_size, max_tokens, dispatch_bytes, combine_bytes, eplb_n)
    assert isinstance(size, int)
    assert size == int(ops.workspace_size_per_rank(ep_size, max_tokens, dispatch_bytes, combine_bytes, eplb_n))
    assert size == layout.workspace_size_per_rank(ep_size, max_tokens, dispatch_bytes, combine_bytes, eplb_n)
    assert size % layout.ALIGN == 0 and size % layout.PLANE_ALIGN == 0
    rng = random.Random(f"{ep_size}-{max_tokens}-{dispatch_bytes}")
    splits = [[dispatch_bytes]]
    for _ in range(60):
        parts = rng.randint(1, min(layout.MAX_PAYLOADS, dispatch_bytes))
        cuts = sorted(rng.sample(range(1, dispatch_bytes), parts - 1)) if parts > 1 else []
        bounds = [0, *cuts, dispatch_bytes]
        splits.append([b - a for a, b in zip(bounds, bounds[1:])])
    for rows in splits:
        assert sum(rows) == dispatch_bytes and all(r > 0 for r in rows)
        for T in {max_tokens, rng.randint(1, max_tokens)}:
            for eplb in {0, eplb_n}:  # a call may gather no EPLB stats
                cpp = [int(v) for v in ops.call_layout(ep_size, T, eplb, rows)]
                end = layout.combine_end(cpp[-1], ep_size, T, combine_bytes)
                assert end <= size, f"rows={rows} T={T}: combine ends at {end} > {size}"


def test_workspace_size_grows_with_eplb():
    base = a2a.moe_a2a_get_workspace_size_per_rank(4, 16, 256, 128)
    assert a2a.moe_a2a_get_workspace_size_per_rank(4, 16, 256, 128, 64) >= base + 4 * 64 * 4


@pytest.mark.parametrize("num_experts,ep_size", [(8, 2), (7, 3), (5, 5), (37, 8), (64, 64), (100, 7)])
def test_expert_ranges_contract(num_experts, ep_size):
    # DESIGN.md section 3: the first E % R ranks own E // R + 1 experts, the rest E // R.
    base, extra = divmod(num_experts, ep_size)
    expected, first = [], 0
    for r in range(ep_size):
        n = base + 1 if r < extra else base
        expected.append((first, first + n))
        first += n
    assert [layout.expert_range(num_experts, ep_size, r) for r in range(ep_size)] == expected
    assert layout.experts_per_rank(num_experts, ep_size) == [b - a for a, b in expected]
    assert [a2a.local_expert_range(num_experts, ep_size, r) for r in range(ep_size)] == [range(*e) for e in expected]


@pytest.mark.parametrize("args", [(3, 4, 0), (8, 2, 2), (8, 0, 0), (8, 65, 0), (8.0, 2, 0)])
def test_local_expert_range_refuses(args):
    with pytest.raises(ValueError, match="local_expert_range"):
        a2a.local_expert_range(*args)


def _snake(name: str) -> str:
    """kHdrDispatchFlags -> HDR_DISPATCH_FLAGS."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name[1:]).upper()


def test_every_header_offset_is_mirrored():
    """protocol.h says layout.py mirrors every number of it: every kHdr* offset of
    the rank header (also the ones constants() does not emit) has a twin of the
    same value in layout.py."""
    text = (pathlib.Path(__file__).parents[1] / "csrc" / "protocol.h").read_text()
    values = {
        "kMaxRanks": layout.MAX_RANKS,
        "kMaxDispatchCtas": layout.MAX_DISPATCH_CTAS,
        "kClaimCounters": layout.CLAIM_COUNTERS,
        "kClaimStride": layout.CLAIM_STRIDE,
    }
    missing, wrong = [], []
    for name, expr in re.findall(r"constexpr\s+int64_t\s+(kHdr\w+)\s*=\s*([^;]+);", text):
        value = eval(re.sub(r"\bk\w+", lambda m: str(values[m.group(0)]), expr), {})  # + and * of literals
        values[name] = value
        twin = _snake(name)
        if not hasattr(layout, twin):
            missing.append(twin)
        elif getattr(layout, twin) != value:
            wrong.append(f"{twin}: layout {getattr(layout, twin)} != protocol.h {value}")
    assert len(values) > 10, "protocol.h parse found too few header offsets"
    assert not missing and not wrong, f"missing in layout.py: {missing}; different: {wrong}"


def test_flag_shares_are_mirrored():
    """protocol.h's kFlagShares, the growth of a flag word per call, has its twin."""
    text = (pathlib.Path(__file__).parents[1] / "csrc" / "protocol.h").read_text()
    shift = re.search(r"kFlagShares = uint32_t\(1\) << (\d+);", text)
    assert shift is not None, "protocol.h parse found no kFlagShares"
    assert layout.FLAG_SHARES == 1 << int(shift.group(1))


def test_every_error_code_is_mirrored():
    """protocol.h's ErrorCode values, CombineMismatch bits and payload
    mismatch detail have twins in layout.py (check_errors and describe_error
    read records with them)."""
    text = (pathlib.Path(__file__).parents[1] / "csrc" / "protocol.h").read_text()
    codes = dict(re.findall(r"\b(kError\w+)\s*=\s*(\d+)", text))
    assert len(codes) >= 6, "protocol.h parse found too few error codes"
    wrong = [f"{_snake(n)}: layout {getattr(layout, _snake(n), None)} != protocol.h {v}"
             for n, v in codes.items() if getattr(layout, _snake(n), None) != int(v)]
    assert not wrong, "; ".join(wrong)
    bits = re.findall(r"\bkMismatch\w+\s*=\s*(\d+)", text)
    assert [int(b) for b in bits] == [1 << i for i in range(len(layout.COMBINE_MISMATCH_FIELDS))]
    backward_round = re.search(r"kPayloadMismatchBackwardRound = (\d+);", text)
    assert backward_round is not None and layout.PAYLOAD_MISMATCH_BACKWARD_ROUND == int(backward_round.group(1))


def test_claim_counters_have_words_of_their_own():
    """A large dispatch's claim counters and the combine's two claim words (CUDA
    scratch) share no byte with another header word: counter 0 and the combine's
    words in the header's first line, the other counters each in its own
    CLAIM_STRIDE line at the header's end."""
    offsets = [layout.claim_counter_offset(c) for c in range(layout.CLAIM_COUNTERS)]
    assert offsets[0] >= layout.HDR_LAST_DISPATCH_END + 8 and offsets[0] + 4 <= layout.HDR_DROPPED_PAIR_COUNT
    assert layout.HDR_PULL_DONE + 4 <= layout.HDR_COMBINE_CLAIMS
    assert layout.HDR_COMBINE_CLAIMS >= layout.HDR_LAST_TOP_K + 4
    assert layout.HDR_COMBINE_CLAIMS + 8 <= layout.HDR_LAST_DISPATCH_END
    lines = [o // layout.CLAIM_STRIDE for o in offsets[1:]]
    assert len(set(lines)) == len(lines), "counters 1.. share a line"
    assert all(layout.HDR_DISPATCH_CLAIMS <= o and o + 4 <= layout.HEADER_BYTES and o % 4 == 0 for o in offsets[1:])
    assert layout.HDR_DISPATCH_CLAIMS >= layout.HDR_DISPATCH_ROUTED + 4 * layout.MAX_DISPATCH_CTAS
    for bad in (-1, layout.CLAIM_COUNTERS):
        with pytest.raises(ValueError, match="claim counter"):
            layout.claim_counter_offset(bad)


EM_GRID = [
    # ep_size, max_tokens, user payload rows, combine bytes, num_experts, top_k, max_tokens_per_expert
    (1, 7, (64,), 64, 3, 2, None),
    (3, 33, (256, 7, 0), 128, 10, 8, None),
    (8, 16, (14336,), 14336, 256, 8, 40),
    (5, 1, (3, 5), 2, 23, 22, 1),
    (64, 4, (96, 96, 96, 96, 96, 96), 96, 64 * 1024, 1, None),
]


@pytest.mark.parametrize("ep_size,max_tokens,rows,combine_bytes,num_experts,top_k,M", EM_GRID)
def test_expert_major_layout_matches_cpp_and_fits(ep_size, max_tokens, rows, combine_bytes, num_experts, top_k, M):
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(ep_size, max_tokens, sum(rows), combine_bytes,
                                                                num_experts, top_k, M)
    big_m = ep_size * max_tokens if M is None else M
    assert size == int(ops.expert_major_workspace_size_per_rank(ep_size, max_tokens, sum(rows), combine_bytes, 0,
                                                                num_experts, top_k, big_m))
    assert size == layout.expert_major_workspace_size_per_rank(ep_size, max_tokens, sum(rows), combine_bytes, 0,
                                                               num_experts, top_k, big_m)
    assert size % layout.PLANE_ALIGN == 0
    local = layout.max_local_experts(num_experts, ep_size)
    rng = random.Random(f"em-{ep_size}-{max_tokens}")
    for T in {max_tokens, rng.randint(1, max_tokens)}:
        for k in {top_k, rng.randint(1, top_k)}:
            for m in {big_m, rng.randint(1, big_m)}:
                for id_bytes, weights in ((4, False), (8, True)):
                    routed = list(rows) + [k * id_bytes] + ([k * 4] if weights else [])
                    end = int(ops.call_layout(ep_size, T, 0, routed)[-1])
                    py = layout.expert_major_layout(end, ep_size, T, k, local, m, rows)
                    cpp = [int(v) for v in ops.expert_major_layout(end, ep_size, T, k, local, m, list(rows))]
                    assert cpp == [py.counts_offset, py.pair_map_offset, py.pair_src_offset, py.ids_offset,
                                   py.weights_offset, *py.payload_offsets, py.combine_offset]
                    assert all(o % layout.PLANE_ALIGN == 0 for o in (*py.payload_offsets, py.combine_offset))
                    combine = py.combine_offset + local * m * combine_bytes
                    assert combine <= size, f"T={T} k={k} M={m}: the combine region ends at {combine} > {size}"
                    # ... and a rank-major call of the same payloads fits too.
                    plain = int(ops.call_layout(ep_size, T, 0, list(rows))[-1])
                    assert layout.combine_end(plain, ep_size, T, combine_bytes) <= size


def test_expert_major_sizing_refuses():
    with pytest.raises(ValueError, match="experts per rank"):
        a2a.moe_a2a_get_workspace_size_per_rank_expert_major(1, 4, 64, 64, layout.MAX_LOCAL_EXPERTS + 1, 2)
    with pytest.raises(ValueError, match="max_tokens_per_expert"):
        a2a.moe_a2a_get_workspace_size_per_rank_expert_major(2, 4, 64, 64, 4, 2, 0)
    with pytest.raises(ValueError, match="top_k"):
        a2a.moe_a2a_get_workspace_size_per_rank_expert_major(2, 4, 64, 64, 4, 23)
