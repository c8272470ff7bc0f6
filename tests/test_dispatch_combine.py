"""dispatch -> toy MoE -> combine through SimulatedEP, bitwise against the reference."""

import dataclasses
import random

import pytest
import torch
from conftest import (
    Case,
    PayloadSpec,
    assert_bytes_equal,
    combine_again,
    combine_payload_in_workspace,
    dispatch_claims,
    header_i32,
    make_generator,
    make_inputs,
    make_sim,
    random_tensor,
    round_trip,
    with_expert_outputs_scaled,
)

import torch_moe_a2a as a2a
from torch_moe_a2a import layout, reference

FP8 = torch.float8_e4m3fn
EXTRA_POOL = [
    PayloadSpec(FP8, (32,)),  # fp8 scales-like row
    PayloadSpec(torch.int32, (5,)),
    PayloadSpec(torch.uint8, (7,)),  # odd row size
    PayloadSpec(torch.float16, (3,)),
    PayloadSpec(torch.float32, (4, 3)),  # 3-D payload
    PayloadSpec(torch.bfloat16, (96,)),
    PayloadSpec(torch.uint8, (1,)),
]

HAND_PICKED = [
    Case(1, (9,), 1, 1),
    Case(1, (0,), 2, 4, runtime_max=3),  # single rank, no tokens
    Case(2, (5, 0), 3, 5, extras=(PayloadSpec(FP8, (64,)),)),  # a rank with 0 tokens, odd top_k
    Case(2, (0, 0), 2, 4, runtime_max=4),  # nobody has tokens
    Case(3, (7, 2, 11), 22, 37, hidden=128, runtime_max=16, max_num_tokens=20),  # top_k 22, E % R != 0
    Case(4, (16, 3, 0, 9), 5, 7, hidden=96, hidden_dtype=torch.float16, extras=tuple(EXTRA_POOL[:5])),  # 8 payloads
    Case(8, (4, 0, 6, 1, 0, 8, 2, 5), 3, 13, hidden=64, hidden_dtype=torch.float32, runtime_max=10),
    Case(5, (12, 12, 12, 12, 12), 1, 5, hidden=256, extras=(PayloadSpec(torch.float32, (4, 3)),)),
    Case(6, (3, 8, 1, 0, 2, 8), 5, 6, hidden=72, extras=(PayloadSpec(torch.uint8, (7,)),)),  # top_k > experts/rank
    Case(2, (64, 33), 8, 16, hidden=512, max_num_tokens=64),
    Case(3, (4, 9, 2), 2, 8, extras=(PayloadSpec(torch.int32, ()), PayloadSpec(torch.float16, (2, 2, 2)))),  # 1-D payload
    # Payloads of 0 bytes per token between others ("any trailing shape"): empty planes, nothing copied.
    Case(3, (6, 0, 10), 3, 9, extras=(PayloadSpec(torch.float16, (0,)), PayloadSpec(torch.uint8, (5,)),
                                      PayloadSpec(torch.float32, (3, 0)))),
    Case(2, (7, 4), 2, 6, hidden=0),  # a hidden state and combine row of 0 bytes: the exchange only synchronizes
]


def _random_cases(n: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        ep = rng.randint(1, 8)
        top_k = rng.choice([1, 2, 3, 4, 5, 8, 9, 22])
        num_experts = max(ep, top_k) + rng.randint(0, 20)
        tokens = tuple(rng.choice([0, rng.randint(1, 24)]) for _ in range(ep))
        T = max(1, max(tokens)) + rng.choice([0, 0, 3])
        hidden_dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
        hidden = rng.choice([64, 96, 128, 200])
        extras = tuple(rng.sample(EXTRA_POOL, rng.randint(0, 4)))
        cases.append(
            Case(ep, tokens, top_k, num_experts, hidden, hidden_dtype, extras, runtime_max=T, max_num_tokens=T + rng.randint(0, 5))
        )
    return cases


CASES = HAND_PICKED + _random_cases(16, seed=20240611)


@pytest.mark.parametrize("payload_in_workspace", [False, True], ids=["staged", "in_ws"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_round_trip_matches_reference(case, payload_in_workspace, device):
    gen = make_generator(case)
    sim = make_sim(case, device)
    round_trip(sim, case, make_inputs(case, gen), gen, payload_in_workspace=payload_in_workspace)


VARIANT_CASE = Case(4, (11, 0, 7, 16), 3, 10, hidden=128, hidden_dtype=torch.float32, runtime_max=16)


@pytest.mark.parametrize("payload_in_workspace", [False, True], ids=["staged", "in_ws"])
@pytest.mark.parametrize("use_output", [False, True], ids=["fresh", "output"])
@pytest.mark.parametrize("hidden_dtype,output_dtype", [
    (torch.float32, torch.bfloat16),
    (torch.float32, None),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, None),
    (torch.float16, torch.bfloat16),
])
def test_combine_variants(hidden_dtype, output_dtype, use_output, payload_in_workspace, device):
    case = dataclasses.replace(VARIANT_CASE, hidden_dtype=hidden_dtype)
    gen = make_generator(7)
    sim = make_sim(case, device)
    rt = round_trip(
        sim,
        case,
        make_inputs(case, gen),
        gen,
        payload_in_workspace=payload_in_workspace,
        use_output=use_output,
        output_dtype=output_dtype,
    )
    expected_dtype = hidden_dtype if output_dtype is None else output_dtype
    assert all(o.dtype == expected_dtype for o in rt.outputs)


def test_routing_contract(device):
    """Independent of reference.py: recv counts and arrival order follow DESIGN.md
    section 3 (contiguous expert ranges, one copy per distinct destination,
    increasing source token index), computed here from first principles."""
    ep, E, top_k, n = 3, 8, 3, 12  # ranks own experts [0,3) [3,6) [6,8)
    owner = [0, 0, 0, 1, 1, 1, 2, 2]
    gen = make_generator(11)
    ids = []
    for s in range(ep):
        # Duplicated owners inside one token: must still arrive once per rank.
        ids.append(torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(n)]).to(torch.int32))
    # Payload: (source rank, token index) so arrival order is readable.
    tags = [torch.stack([torch.full((n,), s), torch.arange(n)], 1).to(torch.int32) for s in range(ep)]
    case = Case(ep, (n,) * ep, top_k, E, extras=(PayloadSpec(torch.int32, (2,)),))
    sim = make_sim(case, device)

    def fn(rank):
        return a2a.moe_a2a_dispatch(
            ids[rank].to(device), [tags[rank].to(device)], sim.workspace, sim.metainfo[rank], n, rank, ep, top_k, E
        )

    results = sim.run(fn)
    for d in range(ep):
        counts = a2a.moe_a2a_get_recv_counts(sim.workspace, sim.metainfo[d], d).cpu()
        assert counts.dtype == torch.int32 and tuple(counts.shape) == (ep,)
        recv = results[d][0][0].cpu()
        for s in range(ep):
            expected = [t for t in range(n) if d in {owner[e] for e in ids[s][t].tolist()}]
            assert counts[s].item() == len(expected)
            got = recv[s, : len(expected)]
            assert got[:, 0].tolist() == [s] * len(expected)
            assert got[:, 1].tolist() == expected
    # Complete the round so the workspace ends consistent.
    sim.run(
        lambda r: a2a.moe_a2a_combine(
            torch.ones(ep, n, 8, device=device), n, sim.workspace, sim.metainfo[r], n, r, ep, top_k, results[r][1]
        )
    )


def test_consecutive_round_trips_reuse_workspace(device):
    """Several rounds on one workspace with a different runtime_max and payload
    list each time (so grids of other sizes on CUDA); epochs advance by one per
    round on every rank, and every flag word by exactly one call's shares
    (protocol.h: flags count shares, whatever the grid that added them)."""
    base = Case(4, (16, 16, 16, 16), 4, 11, hidden=128, max_num_tokens=32,
                extras=(PayloadSpec(FP8, (64,)), PayloadSpec(torch.int32, (3,))))
    sim = make_sim(base, device)
    gen = make_generator(3)
    rounds = [
        (8, base.extras),
        (32, ()),
        (3, (PayloadSpec(torch.uint8, (5,)),)),
        (17, base.extras),
        (32, (PayloadSpec(torch.float32, (4, 3)), PayloadSpec(torch.uint8, (7,)))),
    ]
    for i, (T, extras) in enumerate(rounds, start=1):
        case = dataclasses.replace(base, extras=extras, runtime_max=T)
        assert case.dispatch_bytes <= base.dispatch_bytes
        tokens = [int(torch.randint(0, T + 1, (), generator=gen)) for _ in range(4)]
        round_trip(sim, case, make_inputs(case, gen, tokens), gen, runtime_max=T,
                   payload_in_workspace=bool(i % 2))
        for r in range(4):
            assert header_i32(sim.workspace, r, layout.HDR_DISPATCH_EPOCH) == i
            assert header_i32(sim.workspace, r, layout.HDR_COMBINE_EPOCH) == i
            flags = [header_i32(sim.workspace, r, base + 4 * p) for base in (layout.HDR_DISPATCH_FLAGS,
                                                                             layout.HDR_COMBINE_FLAGS) for p in range(4)]
            flags.append(header_i32(sim.workspace, r, layout.HDR_PULL_DONE))
            assert flags == [i * layout.FLAG_SHARES] * 9, (i, r, flags)


def test_repeated_combines_between_dispatches(device):
    """FlashInfer's semantics (docs/DESIGN.md section 3): after one dispatch
    every rank combines 1-3 times, each a collective over the same routes, of
    the same rows in place or of other rows staged (so a repeated combine
    stages over a region the peers pulled the one before from: protocol.h,
    combine step 0); with T shrinking and growing, so that dispatch step 0b
    waits for the last combine of a round. Each combine against the
    reference; the epochs count dispatches, the combine flags and pull_done
    every combine."""
    base = Case(4, (16, 16, 16, 16), 4, 11, hidden=128, max_num_tokens=32)
    sim = make_sim(base, device)
    gen = make_generator("repeated combines")
    combines = 0
    for i, (T, repeats) in enumerate([(8, 3), (32, 1), (3, 2), (17, 3), (32, 2)], start=1):
        case = dataclasses.replace(base, runtime_max=T)
        tokens = [int(torch.randint(0, T + 1, (), generator=gen)) for _ in range(4)]
        in_ws = bool(i % 2)
        rt = round_trip(sim, case, make_inputs(case, gen, tokens), gen, runtime_max=T, payload_in_workspace=in_ws)
        for k in range(1, repeats):
            if in_ws and k == 1:
                combine_again(sim, case, rt, gen, payload_in_workspace=True, use_output=True)
            else:
                combine_again(sim, case, with_expert_outputs_scaled(rt, float(k + 1)), gen)
        combines += repeats
        for r in range(4):
            assert header_i32(sim.workspace, r, layout.HDR_DISPATCH_EPOCH) == i
            assert header_i32(sim.workspace, r, layout.HDR_COMBINE_EPOCH) == i
            assert header_i32(sim.workspace, r, layout.HDR_COMBINE_COUNT) == combines
            flags = [header_i32(sim.workspace, r, layout.HDR_DISPATCH_FLAGS + 4 * p) for p in range(4)]
            assert flags == [i * layout.FLAG_SHARES] * 4, (i, r, flags)
            flags = [header_i32(sim.workspace, r, layout.HDR_COMBINE_FLAGS + 4 * p) for p in range(4)]
            flags.append(header_i32(sim.workspace, r, layout.HDR_PULL_DONE))
            assert flags == [combines * layout.FLAG_SHARES] * 5, (i, r, flags)


def test_zero_column_payload_is_a_payload_tensor(device):
    """A payload tensor of 0 columns (row_shape with a 0: no data pointer) is
    staged as the tensor it is, not taken for a payload already in the
    workspace: as a repeated combine after a staged one it returns its
    [local_num_tokens, 0] rows (it was refused as 'payload_in_workspace after
    a combine that staged'), and the combines around it and the next round
    stay exact."""
    case = Case(3, (6, 0, 5), 2, 7, hidden=40, runtime_max=6)
    gen = make_generator("zero-column payload")
    sim = make_sim(case, device)
    rt = round_trip(sim, case, make_inputs(case, gen), gen)

    def empty_combine(r):
        payload = torch.empty(case.ep_size, rt.runtime_max, 0, dtype=case.hidden_dtype, device=device)
        return a2a.moe_a2a_combine(payload, rt.tokens[r], sim.workspace, sim.metainfo[r], rt.runtime_max, r,
                                   case.ep_size, case.top_k, rt.offsets[r])

    outs = sim.run(empty_combine)
    for r in range(case.ep_size):
        assert outs[r].shape == (rt.tokens[r], 0) and outs[r].dtype == case.hidden_dtype
    combine_again(sim, case, rt, gen)
    sim.run(empty_combine)
    combine_again(sim, case, rt, gen)
    round_trip(sim, case, make_inputs(case, gen), gen)


@pytest.mark.parametrize("ep_size", [1, 3])
def test_staged_combine_reads_its_own_rows_from_the_payload(device, ep_size):
    """protocol.h, combine step 1: a combine that stages a plain payload tensor
    copies into its combine region only the rows its peers pull; its own
    tokens' rows its pull reads from the tensor. With every rank's region
    filled with a poison after the first combine, a second one of the round
    is still exact (combine_again checks bitwise), every peer's plane holds
    the staged rows again and the own plane still holds the poison (at ep 1:
    nothing is staged)."""
    case = Case(ep_size, (6,) * ep_size, 2, 2 * ep_size + 1, hidden=40, runtime_max=6)
    gen = make_generator(f"own rows from the payload, ep {ep_size}")
    sim = make_sim(case, device)
    rt = round_trip(sim, case, make_inputs(case, gen), gen)
    shape, dtype = (ep_size, rt.runtime_max, case.hidden), case.hidden_dtype
    poison = random_tensor(shape, dtype, gen)
    regions = [combine_payload_in_workspace(sim, r, rt.offsets[r], shape, dtype, poison.to(device))
               for r in range(ep_size)]
    combine_again(sim, case, rt, gen)
    for r in range(ep_size):
        region = regions[r].cpu()
        for s in range(ep_size):
            n = int(rt.counts[r][s])
            expected = poison[s] if s == r else torch.cat([rt.payloads[r][s, :n].cpu(), poison[s, n:]])
            assert_bytes_equal(region[s], expected, f"rank {r}'s combine region, plane {s}")


def test_random_rounds_reuse_workspace(device):
    """Thirty rounds on one workspace, each with a random runtime_max, token
    counts (0 included), top_k, payload list (empty payloads included) and
    combine path: the buffer-reuse chain of DESIGN.md section 5 under shapes
    that grow and shrink in any order. Every round against the reference."""
    menu = (PayloadSpec(FP8, (64,)), PayloadSpec(torch.int32, (3,)), PayloadSpec(torch.uint8, (5,)),
            PayloadSpec(torch.float32, (4, 3)), PayloadSpec(torch.float16, (4, 0)))
    base = Case(4, (16, 16, 16, 16), 4, 11, hidden=128, max_num_tokens=32, extras=menu)
    sim = make_sim(base, device)
    gen = make_generator(17)
    for i in range(1, 31):
        T = int(torch.randint(1, 33, (), generator=gen))
        picks = torch.randperm(len(menu), generator=gen)[: int(torch.randint(0, 4, (), generator=gen))]
        case = dataclasses.replace(base, extras=tuple(menu[j] for j in sorted(picks.tolist())), runtime_max=T,
                                   top_k=int(torch.randint(1, 5, (), generator=gen)))
        tokens = [int(torch.randint(0, T + 1, (), generator=gen)) for _ in range(4)]
        round_trip(sim, case, make_inputs(case, gen, tokens), gen, runtime_max=T,
                   payload_in_workspace=bool(torch.randint(0, 2, (), generator=gen)))
        for r in range(4):
            assert header_i32(sim.workspace, r, layout.HDR_DISPATCH_EPOCH) == i
            assert header_i32(sim.workspace, r, layout.HDR_COMBINE_EPOCH) == i


def test_plain_zeroed_workspace_rank_by_rank(device):
    """DESIGN.md section 2: a plain torch.zeros workspace initialized rank by rank
    through the functional API works (driven by threads here)."""
    case = Case(3, (5, 9, 0), 4, 9, hidden=64)
    size = a2a.moe_a2a_get_workspace_size_per_rank(3, case.max_tokens, case.dispatch_bytes, case.combine_bytes)
    workspace = torch.zeros(3, size, dtype=torch.uint8, device=device)
    metainfo = [a2a.moe_a2a_initialize(workspace, r, 3, case.max_tokens) for r in range(3)]
    for m in metainfo:
        assert m.device.type == "cpu" and m.dtype == torch.int64 and tuple(m.shape) == (layout.META_COUNT,)
    sim = make_sim(case, device)
    # Reuse SimulatedEP only as the thread runner; point it at our workspace.
    sim.workspace, sim.metainfo = workspace, metainfo
    gen = make_generator(5)
    round_trip(sim, case, make_inputs(case, gen), gen)


# The CUDA dispatch routes a CTA's chunk of at most 32 tokens with one warp's
# ballots, a longer one with a scan over warps in rounds of 512 tokens; a CTA
# gets one chunk per 16 KiB of rows (kernels.cuh: kMinBytesPerCta). These cases
# put chunks on both sides of 32 and past 512, with out-of-range and negative
# ids, one also with a rank masked off (on the CPU they are ordinary cases).
# 416-byte rows (96 fp32 + 4 ids + 4 weights): 64 tokens -> 2 CTAs of 32; 66 and 65 -> 2 CTAs of 33.
NEAR_ONE_WARP = Case(3, (64, 66, 65), 4, 12, hidden=96, hidden_dtype=torch.float32, invalid_fraction=0.1,
                     negative_fraction=0.1)
# 16-byte rows: 1100 and 1030 tokens -> 2 CTAs of 550 and 515, two rounds each.
PAST_ONE_ROUND = Case(2, (1100, 1030), 1, 4, hidden=4, invalid_fraction=0.05, negative_fraction=0.05)


@pytest.mark.parametrize("case,active_ranks", [
    (NEAR_ONE_WARP, None),
    (NEAR_ONE_WARP, (0, 2)),
    (PAST_ONE_ROUND, None),
], ids=["near-one-warp", "near-one-warp-masked", "past-one-round"])
def test_routing_on_both_sides_of_the_one_warp_chunk(case, active_ranks, device):
    gen = make_generator(case)
    sim = make_sim(case, device)
    inputs = make_inputs(case, gen)
    for _ in range(2):
        round_trip(sim, case, inputs, gen, active_ranks=active_ranks)
    for r in range(case.ep_size) if active_ranks is None else active_ranks:
        expected = 2 * int((inputs.ids[r] >= case.num_experts).sum())
        assert expected > 0, "test data must contain out-of-range ids"
        assert int(a2a.moe_a2a_get_invalid_expert_count(sim.workspace, sim.metainfo[r], r)) == expected, f"rank {r}"


# The CUDA combine pulls (token, segment) items by warp task, the warps of the
# grid taking the tasks in turn. A warp pulls more than one task only when the
# grid is capped by residency (one CTA per 16 KiB of rows otherwise gives every
# task a warp of its own): with 8 KiB rows (eight 1 KiB items) that is a cap
# below tokens / 2 CTAs a rank, 100 to 150 here: 65 on an H200
# ((132 * 2 - 1) / 4), and below 100 on any GPU of fewer than 200
# multiprocessors. A token goes to 2 to 4 ranks (8 of 16 experts, 4 a rank).
# Three round trips back to back, outputs poisoned before each: a task
# skipped or pulled twice fails the comparison.
MULTI_ROUND_PULL = Case(4, (300, 200, 257, 264), 8, 16, hidden=4096)


@pytest.mark.slow
@pytest.mark.parametrize("payload_in_workspace", [False, True], ids=["staged", "in_ws"])
def test_pull_tasks_past_the_first_round(payload_in_workspace, device):
    gen = make_generator(MULTI_ROUND_PULL)
    sim = make_sim(MULTI_ROUND_PULL, device)
    for _ in range(3):
        round_trip(sim, MULTI_ROUND_PULL, make_inputs(MULTI_ROUND_PULL, gen), gen,
                   payload_in_workspace=payload_in_workspace)


# The CUDA dispatch of a large call (chunks of more than 32 tokens, dispatch.cu
# kWhole) takes each CTA's first slots from the counts that the CTAs publish of
# their own chunks (step 1a), waits until every chunk is routed, and lets
# the warps of the grid claim copy tasks of any chunk (step 3), from one
# counter or from several for large grids. The second half of every rank's
# tokens has no destination here (ids -1), so the tasks of those chunks end at
# once and their warps go on with the first half. 2 KiB hidden rows are one
# copy task a token, and the residency cap of the grid gives chunks of more
# than 32 tokens. On an H200: 4000 tokens on 65 CTAs a rank at ep 4 (1040
# warps: four counters), 1100-1500 tokens on 32 CTAs at ep 8 (512 warps: one
# counter). Three round trips in a row: a counter left over would skip tasks
# of the next dispatch, whose poisoned receive rows then fail the comparison,
# and wrong counts would put rows in wrong slots.
WHOLE_RANK = {
    "ep4": Case(4, (4000, 3000, 3900, 2500), 8, 16, hidden=1024),
    "ep8": Case(8, (1500, 1100, 1400, 1200, 1300, 1050, 1450, 1150), 8, 32, hidden=1024),
}


def _chunk_counts(ids: torch.Tensor, chunks: int, case: Case) -> torch.Tensor:
    """int64 [chunks, ep_size]: tokens of each chunk (contiguous, ceil(n / chunks)
    tokens) that go to each rank, from the reference's expert owners (DESIGN's
    contiguous ranges)."""
    owner = reference._expert_owner(case.num_experts, case.ep_size, torch.device("cpu"))
    goes = torch.zeros(ids.shape[0], case.ep_size, dtype=torch.bool)
    for k in range(ids.shape[1]):
        valid = ids[:, k] >= 0
        goes[valid, owner[ids[valid, k].long()]] = True
    size = -(-ids.shape[0] // chunks)
    counts = torch.zeros(chunks, case.ep_size, dtype=torch.int64)
    for c in range(chunks):
        counts[c] = goes[c * size : (c + 1) * size].sum(0)
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WHOLE_RANK))
def test_large_dispatch_shares_counts_and_tasks(name, device):
    case = WHOLE_RANK[name]
    gen = make_generator(case)
    sim = make_sim(case, device)
    ep = case.ep_size
    routed_words = slice(layout.HDR_DISPATCH_ROUTED, layout.HDR_DISPATCH_ROUTED + 4 * layout.MAX_DISPATCH_CTAS)
    count_words = slice(layout.HDR_DISPATCH_COUNTS, layout.HDR_DISPATCH_ROUTED)
    # Three calls on CUDA, whose words carry the call's number; one on the
    # CPU, which writes none of them (its round trips are checked elsewhere).
    for call in range(1, 4 if sim.workspace.is_cuda else 2):
        inputs = make_inputs(case, gen)
        for ids, payloads in zip(inputs.ids, inputs.payloads):
            ids[ids.shape[0] // 2 :] = -1
            payloads[1][ids.shape[0] // 2 :] = -1
        round_trip(sim, case, inputs, gen)
        for r in range(ep):
            claims = dispatch_claims(sim.workspace, r)
            assert claims == [0] * layout.CLAIM_COUNTERS, f"rank {r}: claims left over"
            routed = sim.workspace[r, routed_words].cpu().view(torch.int32)
            # On CUDA every CTA published its routes (the path ran); the CPU never writes these words.
            published = int((routed == call).sum())
            assert published > 1 if sim.workspace.is_cuda else published == 0, f"rank {r}: {published} chunks"
            assert int((routed != 0).sum()) == published, f"rank {r}: a routed word of another call"
            # Count words: (epoch << 32) | tokens of chunk c going to rank d, at [c * ep + d].
            counted = sim.workspace[r, count_words].cpu().view(torch.int64)
            assert int(counted[published * ep :].count_nonzero()) == 0, f"rank {r}: count words past the grid"
            if published:
                counted = counted[: published * ep].view(published, ep)
                assert bool(((counted >> 32) == call).all()), f"rank {r}: a count word of another call"
                expected = _chunk_counts(inputs.ids[r], published, case)
                assert torch.equal(counted & 0xFFFFFFFF, expected), f"rank {r}: chunk counts"
