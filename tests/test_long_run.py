"""Long runs on one workspace: many round trips (dispatch -> expert
stand-in -> combine) by simulated ranks, with the results checked against
the reference at intervals, across the wrap-around of the flag words (every
2^16 calls) and of the uint32 epochs (every 2^32 calls). On the CPU each rank
is a thread that runs its own round trips; on CUDA each rank is a stream and
the host launches the ranks' calls op by op (SimulatedEP.run), as a
deployment's ranks run theirs.

Counting 2^32 calls takes days, so the runs start from an initialized, idle
workspace whose epoch words and the words coupled to them (the flags and
pull_done, protocol.h: 'Flags count shares') are set to where they stand
after that many calls; the run crosses the wrap halfway.

MOE_A2A_LONG_ROUND_TRIPS=N sets the round trips of each run (default: a few
seconds' worth on two cores; 10,000 on CUDA).
"""

import os
import struct

import pytest
import torch
from conftest import Case, assert_bytes_equal, make_generator, make_inputs, make_sim

import torch_moe_a2a as a2a
from torch_moe_a2a import layout, reference

ROUND_TRIPS = {
    device: int(os.environ.get("MOE_A2A_LONG_ROUND_TRIPS", default))
    for device, default in (("cpu", 5000), ("cuda", 10000))
}
# A check of every result every this many round trips (and after the last).
CHECK_EVERY = 97
EP = 2
# The input sets the runs cycle through: their T differ, so dispatches in
# turn grow the regions beyond the previous call's and wait for the peers'
# pull_done (protocol.h, dispatch step 0b), across the wrap too.
CASES = [
    Case(EP, (5, 3), 2, 6, hidden=32, runtime_max=5, max_num_tokens=12),
    Case(EP, (12, 9), 2, 6, hidden=32, runtime_max=12, max_num_tokens=12),
    Case(EP, (0, 7), 2, 6, hidden=32, runtime_max=7, max_num_tokens=12),
]
EPOCH_WRAP = 1 << 32
# The flag words (epoch * FLAG_SHARES, uint32) wrap every this many calls.
FLAG_WRAP = EPOCH_WRAP // layout.FLAG_SHARES
# The epoch the runs start from, idle after that many calls (the wrap runs
# cross their wrap halfway).
STARTS = {"fresh": 0, "flag wrap": FLAG_WRAP, "epoch wrap": EPOCH_WRAP}


def _start_epoch(start: str, round_trips: int) -> int:
    return STARTS[start] and STARTS[start] - round_trips // 2


def _put_u32(workspace: torch.Tensor, rank: int, offset: int, value: int) -> None:
    workspace[rank, offset : offset + 4] = torch.tensor(list(struct.pack("<I", value % EPOCH_WRAP)), dtype=torch.uint8)


def _get_u32(workspace: torch.Tensor, rank: int, offset: int) -> int:
    return struct.unpack("<I", bytes(workspace[rank, offset : offset + 4].tolist()))[0]


def _set_epochs(workspace: torch.Tensor, epoch: int) -> None:
    """Every row as after ``epoch`` completed round trips of every rank: own
    dispatch and combine epochs and combine count, the dispatch and combine
    flags every rank wrote into it, and its pull_done."""
    target = epoch * layout.FLAG_SHARES
    for r in range(EP):
        _put_u32(workspace, r, layout.HDR_DISPATCH_EPOCH, epoch)
        _put_u32(workspace, r, layout.HDR_COMBINE_EPOCH, epoch)
        _put_u32(workspace, r, layout.HDR_COMBINE_COUNT, epoch)
        _put_u32(workspace, r, layout.HDR_PULL_DONE, target)
        for s in range(EP):
            _put_u32(workspace, r, layout.HDR_DISPATCH_FLAGS + 4 * s, target)
            _put_u32(workspace, r, layout.HDR_COMBINE_FLAGS + 4 * s, target)


def _expected(case, inputs):
    ref = reference.reference_dispatch(inputs.ids, inputs.payloads, ep_size=EP, num_experts=case.num_experts,
                                       runtime_max_tokens_per_rank=case.T)
    # The expert stand-in returns the hidden rows it received.
    out = reference.reference_combine([ref.recv[r][0] for r in range(EP)], ref, list(case.tokens))
    return ref, out


def _check_dispatch(sim, rank: int, recv, ref, label: str) -> None:
    counts = sim.recv_counts(rank).cpu()
    assert torch.equal(counts, ref.recv_counts[rank]), f"{label} rank {rank} counts"
    for v, rv in zip(recv, ref.recv[rank]):
        for s in range(EP):
            n = int(counts[s])
            assert_bytes_equal(v[s, :n].cpu(), rv[s, :n], f"{label} rank {rank} from {s}")


def _round_trips(sim, variants, start: int, count: int) -> list:
    """``count`` round trips on every rank, the input sets in turn; returns
    per rank the round trips whose results it checked. Raises
    AssertionError naming the first round trip whose results differ from
    the reference."""
    checks = [i for i in range(count) if i % CHECK_EVERY == 0 or i == count - 1]
    checked = set(checks)
    if sim.streams is None:

        def rank_loop(rank: int) -> list:
            for i in range(count):
                case, inputs, ref, out_ref = variants[i % len(variants)]
                recv, offset, _ = sim.dispatch_rank(rank, inputs.ids[rank], inputs.payloads[rank], case.T,
                                                    case.top_k, case.num_experts)
                check = i in checked
                if check:
                    _check_dispatch(sim, rank, recv, ref, f"round trip {start + i + 1}")
                out = sim.combine_rank(rank, recv[0].clone(), case.tokens[rank], case.T, case.top_k, offset)
                if check:
                    assert_bytes_equal(out, out_ref[rank], f"round trip {start + i + 1} rank {rank} output")
            return checks

        return sim.run(rank_loop)

    # CUDA: every rank's dispatch, then every rank's combine; a check syncs
    # the host with the ranks' streams after the op it checks.
    for i in range(count):
        case, inputs, ref, out_ref = variants[i % len(variants)]
        dispatched = sim.run(
            lambda rank: sim.dispatch_rank(rank, inputs.ids[rank], inputs.payloads[rank], case.T, case.top_k,
                                           case.num_experts)
        )
        check = i in checked
        if check:
            for rank, (recv, _, _) in enumerate(dispatched):
                _check_dispatch(sim, rank, recv, ref, f"round trip {start + i + 1}")
        outs = sim.run(
            lambda rank: sim.combine_rank(rank, dispatched[rank][0][0].clone(), case.tokens[rank], case.T,
                                          case.top_k, dispatched[rank][1])
        )
        if check:
            for rank, out in enumerate(outs):
                assert_bytes_equal(out.cpu(), out_ref[rank], f"round trip {start + i + 1} rank {rank} output")
    return [checks] * EP


@pytest.mark.slow
@pytest.mark.parametrize("start", sorted(STARTS))
def test_long_run(device, start):
    """ROUND_TRIPS[device] round trips on one workspace, starting idle at
    _start_epoch(start): every checked result equals the reference, and the
    epochs and flags end where that many calls after the start put them
    (wrapped for the wrap runs)."""
    round_trips = ROUND_TRIPS[device]
    gen = make_generator(round_trips)
    variants = []
    for case in CASES:
        inputs = make_inputs(case, gen)
        variants.append((case, inputs.to(device), *_expected(case, inputs)))
    sim = make_sim(CASES[1], device, timeout_s=60.0)
    # One round trip first, so that the workspace is as after calls: the
    # rows in use, the peers' init tags seen, the last call's sizes noted.
    _round_trips(sim, variants[1:2], 0, 1)
    if device == "cuda":
        torch.cuda.synchronize()
    first = _start_epoch(start, round_trips)
    if first:
        _set_epochs(sim.workspace, first)
    else:
        first = 1
    checked = _round_trips(sim, variants, first, round_trips)
    if device == "cuda":
        torch.cuda.synchronize()
    assert all(c == checked[0] for c in checked) and checked[0][-1] == round_trips - 1, checked

    end = first + round_trips
    if start != "fresh":
        wrap = FLAG_WRAP if start == "flag wrap" else EPOCH_WRAP
        assert first < wrap < end, (first, end)  # the run crossed the wrap
    for r in range(EP):
        assert _get_u32(sim.workspace, r, layout.HDR_DISPATCH_EPOCH) == end % EPOCH_WRAP
        assert _get_u32(sim.workspace, r, layout.HDR_COMBINE_EPOCH) == end % EPOCH_WRAP
        assert _get_u32(sim.workspace, r, layout.HDR_COMBINE_COUNT) == end % EPOCH_WRAP
        target = end * layout.FLAG_SHARES % EPOCH_WRAP
        assert _get_u32(sim.workspace, r, layout.HDR_PULL_DONE) == target
        for s in range(EP):
            assert _get_u32(sim.workspace, r, layout.HDR_DISPATCH_FLAGS + 4 * s) == target
            assert _get_u32(sim.workspace, r, layout.HDR_COMBINE_FLAGS + 4 * s) == target


def test_sanitize_after_the_dispatch_that_wraps_the_epoch(device):
    """The dispatch whose epoch wraps to 0 is a dispatch like any other:
    sanitize took epoch 0 for 'no dispatch since initialize' and refused its
    ids view (the CUDA kernel would have failed the rank)."""
    case = CASES[1]
    host_inputs = make_inputs(case, make_generator("sanitize at the wrap"))
    inputs = host_inputs.to(device)
    sim = make_sim(case, device, timeout_s=60.0)
    variant = [(case, inputs, *_expected(case, host_inputs))]
    _round_trips(sim, variant, 0, 1)
    if device == "cuda":
        torch.cuda.synchronize()
    _set_epochs(sim.workspace, EPOCH_WRAP - 1)
    dispatched = sim.run(lambda r: sim.dispatch_rank(r, inputs.ids[r], inputs.payloads[r], case.T, case.top_k,
                                                     case.num_experts))
    for r, (recv, _, _) in enumerate(dispatched):
        a2a.moe_a2a_sanitize_expert_ids(recv[1], sim.workspace, sim.metainfo[r], r, -1)
    if device == "cuda":
        torch.cuda.synchronize()
    a2a.check_errors(sim.workspace)
    for r, (recv, _, _) in enumerate(dispatched):
        assert _get_u32(sim.workspace, r, layout.HDR_DISPATCH_EPOCH) == 0
        count = int(sim.recv_counts(r)[0])
        assert bool((recv[1][0, count:] == -1).all()), f"rank {r}: padding rows sanitized"
    sim.run(lambda r: sim.combine_rank(r, dispatched[r][0][0].clone(), case.tokens[r], case.T, case.top_k,
                                       dispatched[r][1]))
