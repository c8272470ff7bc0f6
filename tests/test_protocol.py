"""Protocol behaviour: determinism, sanitize, EPLB, rank mask, bad expert ids,
timeouts and misuse of the dispatch/combine alternation."""

import dataclasses
import re
import time

import pytest
import torch
from conftest import (
    Case,
    PayloadSpec,
    assert_bytes_equal,
    assert_ws_unchanged,
    check_dispatch,
    make_generator,
    make_inputs,
    make_sim,
    poison_call_regions,
    random_tensor,
    random_values,
    round_trip,
    ws_snapshot,
)

import torch_moe_a2a as a2a
from torch_moe_a2a import layout

CASE = Case(4, (9, 0, 14, 5), 3, 10, hidden=64, runtime_max=16,
            extras=(PayloadSpec(torch.float8_e4m3fn, (32,)), PayloadSpec(torch.uint8, (3,))))


def _wait_for_device(device):
    if device == "cuda":
        torch.cuda.synchronize()


# ---- determinism -------------------------------------------------------------


def test_determinism_across_fresh_workspaces(device):
    """Two identical runs (two rounds each) on fresh workspaces give identical
    bytes in the valid receive rows and in the outputs."""
    runs = []
    for _ in range(2):
        gen = make_generator(99)
        sim = make_sim(CASE, device)
        runs.append([round_trip(sim, CASE, make_inputs(CASE, gen), gen, poison=False) for _ in range(2)])
    for a, b in zip(*runs):
        for r in range(CASE.ep_size):
            assert torch.equal(a.counts[r], b.counts[r])
            for i, (va, vb) in enumerate(zip(a.recv[r], b.recv[r])):
                for s in range(CASE.ep_size):
                    n = int(a.counts[r][s])
                    assert_bytes_equal(va[s, :n], vb[s, :n], f"rank {r} payload {i} from {s}")
            assert_bytes_equal(a.outputs[r], b.outputs[r], f"rank {r} output")


# ---- sanitize_expert_ids ------------------------------------------------------------


@pytest.mark.parametrize("case", [CASE, Case(1, (5,), 2, 3, runtime_max=8), Case(2, (0, 7), 22, 30, runtime_max=7)], ids=str)
def test_sanitize_expert_ids(case, device):
    gen = make_generator(case)
    sim = make_sim(case, device)
    inputs = make_inputs(case, gen)
    poison_call_regions(sim.workspace, gen)
    dev = inputs.to(device)
    T, ep = case.T, case.ep_size
    results = sim.run(lambda r: a2a.moe_a2a_dispatch(
        dev.ids[r], dev.payloads[r], sim.workspace, sim.metainfo[r], T, r, ep, case.top_k, case.num_experts))
    invalid = -7
    for r in range(ep):
        ids_view = results[r][0][1]
        before = ids_view.cpu().clone()
        others_before = [v.cpu().clone() for i, v in enumerate(results[r][0]) if i != 1]
        a2a.moe_a2a_sanitize_expert_ids(ids_view, sim.workspace, sim.metainfo[r], r, invalid)
        _wait_for_device(device)
        after = ids_view.cpu()
        counts = a2a.moe_a2a_get_recv_counts(sim.workspace, sim.metainfo[r], r).cpu()
        for s in range(ep):
            n = int(counts[s])
            assert torch.equal(after[s, :n], before[s, :n]), f"rank {r}: valid rows from {s} changed"
            assert (after[s, n:] == invalid).all(), f"rank {r}: padding rows from {s} not sanitized"
        others_after = [v.cpu() for i, v in enumerate(results[r][0]) if i != 1]
        for b, a in zip(others_before, others_after):
            assert_bytes_equal(a, b, f"rank {r}: sanitize touched another payload")
    # The round still completes.
    sim.run(lambda r: a2a.moe_a2a_combine(
        torch.ones(ep, T, case.hidden, dtype=case.hidden_dtype, device=device), case.tokens[r], sim.workspace,
        sim.metainfo[r], T, r, ep, case.top_k, results[r][1]))


# ---- EPLB ------------------------------------------------------------------------------


@pytest.mark.parametrize("eplb_n", [1, 10, 33])
def test_eplb_gathered_stats(eplb_n, device):
    gen = make_generator(eplb_n)
    sim = make_sim(CASE, device, eplb_n=eplb_n)
    stats = [torch.randint(1, 1 << 30, (eplb_n,), dtype=torch.int32, generator=gen) for _ in range(CASE.ep_size)]
    rt = round_trip(sim, CASE, make_inputs(CASE, gen), gen, eplb_stats=stats)
    expected = torch.stack(stats)
    for r in range(CASE.ep_size):
        got = rt.dispatch_results[r][2]
        assert got is not None
        assert got.dtype == torch.int32 and tuple(got.shape) == (CASE.ep_size, eplb_n)
        assert got.untyped_storage().data_ptr() == sim.workspace.untyped_storage().data_ptr(), "not a workspace view"
        row = sim.workspace[r]
        assert row.data_ptr() <= got.data_ptr() < row.data_ptr() + row.numel(), "not in the own row"
        assert torch.equal(rt.eplb[r], expected), f"rank {r}"
    # A call without stats on the same workspace returns None.
    rt = round_trip(sim, CASE, make_inputs(CASE, gen), gen)
    assert all(res[2] is None for res in rt.dispatch_results)


# ---- rank mask ----------------------------------------------------------------------------


@pytest.mark.parametrize("dies_after", [0, 1])
@pytest.mark.parametrize("dead", [0, 2])
def test_rank_mask_dead_rank(dead, dies_after, device):
    """One rank stops calling (from the start, or after a round with every
    rank); the others mask it off, return without waiting for it, and drop
    the tokens routed to it (reference with active_ranks): its receive
    counts read 0 on the others, whatever an earlier round left there, so
    none of its old rows passes for received."""
    gen = make_generator(dead)
    sim = make_sim(CASE, device, timeout_s=None)
    for _ in range(dies_after):
        round_trip(sim, CASE, make_inputs(CASE, gen), gen)
    active = [r for r in range(CASE.ep_size) if r != dead]
    start = time.monotonic()
    for _ in range(2):
        rt = round_trip(sim, CASE, make_inputs(CASE, gen), gen, active_ranks=active)
        assert rt.outputs[dead] is None
    assert time.monotonic() - start < 10, "masked ranks must not be waited for"
    for r in active:
        assert int(a2a.moe_a2a_get_recv_counts(sim.workspace, sim.metainfo[r], r)[dead]) == 0, f"rank {r}"


@pytest.mark.parametrize("dead", [0, 2])
def test_a_rank_masked_off_between_dispatch_and_combine(dead, device):
    """The mask is a call's: where a peer dies after the dispatch, the others
    combine with it masked off, without waiting for it, and its rows drop
    out of their sums: the reference of a round that masks it off from the
    dispatch on (its rows of the other destinations keep their slots)."""
    from torch_moe_a2a import reference

    gen = make_generator(("masked between", dead))
    sim = make_sim(CASE, device, timeout_s=None)
    inputs = make_inputs(CASE, gen)
    rt = round_trip(sim, CASE, inputs, gen)  # the expert outputs of these inputs' routes, checked
    live = [r for r in range(CASE.ep_size) if r != dead]
    dev = inputs.to(device)
    T, ep = CASE.T, CASE.ep_size
    offsets = [int(res[1]) for res in sim.run(lambda r: a2a.moe_a2a_dispatch(
        dev.ids[r], dev.payloads[r], sim.workspace, sim.metainfo[r], T, r, ep, CASE.top_k, CASE.num_experts))]
    mask = a2a.moe_a2a_active_rank_mask(live, ep)
    start = time.monotonic()
    got = sim.run(lambda r: a2a.moe_a2a_combine(
        rt.payloads[r], rt.tokens[r], sim.workspace, sim.metainfo[r], T, r, ep, CASE.top_k, offsets[r],
        enable_rank_mask=True, active_rank_mask=mask) if r in live else None)
    assert time.monotonic() - start < 10, "a masked-off rank must not be waited for"
    ref = reference.reference_dispatch(inputs.ids, inputs.payloads, ep_size=ep, num_experts=CASE.num_experts,
                                       runtime_max_tokens_per_rank=T, active_ranks=live)
    want = reference.reference_combine(rt.ref_expert_out, ref, rt.tokens)
    for r in live:
        assert_bytes_equal(got[r].cpu(), want[r], f"rank {r}")
    # Not the full round's sums: the dead rank's rows were in those.
    assert any(not torch.equal(want[r], rt.ref_outputs[r]) for r in live if rt.tokens[r] > 0)


def test_active_rank_mask_own_rank_must_be_set(device):
    case = Case(2, (3, 3), 1, 2)
    sim = make_sim(case, device)
    gen = make_generator(1)
    inputs = make_inputs(case, gen).to(device)
    snap = ws_snapshot(sim.workspace)
    with pytest.raises((ValueError, RuntimeError), match=r"(?i)mask|own|ep_rank"):
        a2a.moe_a2a_dispatch(inputs.ids[0], inputs.payloads[0], sim.workspace, sim.metainfo[0], 3, 0, 2, 1, 2,
                             enable_rank_mask=True, active_rank_mask=a2a.moe_a2a_active_rank_mask([1], 2))
    assert_ws_unchanged(sim.workspace, snap)


# ---- out-of-range and negative expert ids ------------------------------------------------------


@pytest.mark.parametrize("invalid_fraction,negative_fraction", [(0.2, 0.0), (0.0, 0.3), (0.15, 0.15)])
def test_bad_expert_ids_are_skipped_and_counted(invalid_fraction, negative_fraction, device):
    case = dataclasses.replace(CASE, invalid_fraction=invalid_fraction, negative_fraction=negative_fraction)
    gen = make_generator(case)
    sim = make_sim(case, device)
    inputs = make_inputs(case, gen)
    all_ids = torch.cat(inputs.ids)
    if invalid_fraction:
        assert (all_ids >= case.num_experts).any(), "test data must contain out-of-range ids"
    if negative_fraction:
        assert (all_ids < 0).any(), "test data must contain negative ids"
    totals = [0] * case.ep_size
    for _ in range(2):  # the count is cumulative since initialize
        rt = round_trip(sim, case, inputs, gen)
        for r in range(case.ep_size):
            totals[r] += rt.ref.invalid_counts[r]
            expected = int((inputs.ids[r] >= case.num_experts).sum())
            assert rt.ref.invalid_counts[r] == expected
            got = a2a.moe_a2a_get_invalid_expert_count(sim.workspace, sim.metainfo[r], r)
            assert int(got) == totals[r], f"rank {r}"


@pytest.mark.parametrize("value,enabled", [("1", True), ("0", False), ("", False), ("true", True), (" On ", True),
                                           ("false", False), ("off", False), ("No", False), ("2", None),
                                           ("debug", None)])
def test_debug_mode_values(value, enabled, monkeypatch, device):
    """MOE_A2A_DEBUG reads as a flag: 1/true/yes/on check the ids on the host
    (an id >= num_experts refused before any kernel runs), 0/false/no/off
    and unset do not (the op skips and counts it); anything else is refused
    naming the variable."""
    monkeypatch.setenv("MOE_A2A_DEBUG", value)
    case = Case(1, (6,), 2, 4)
    sim = make_sim(case, device)
    inputs = make_inputs(case, make_generator(f"debug {value}")).to(device)
    ids = inputs.ids[0].clone()
    ids[3, 1] = case.num_experts

    def dispatch():
        return a2a.moe_a2a_dispatch(ids, inputs.payloads[0], sim.workspace, sim.metainfo[0], 6, 0, 1, 2, 4)

    if enabled is None or enabled:
        message = (rf"MOE_A2A_DEBUG must be 1 or 0 .*, got {re.escape(repr(value))}" if enabled is None else
                   rf"MOE_A2A_DEBUG: token_selected_experts\[3, 1\] = {case.num_experts} is >= num_experts")
        snap = ws_snapshot(sim.workspace)
        with pytest.raises(ValueError, match=message):
            dispatch()
        assert_ws_unchanged(sim.workspace, snap)
    else:
        out = dispatch()
        a2a.moe_a2a_combine(out[0][0], 6, sim.workspace, sim.metainfo[0], 6, 0, 1, 2, out[1])
        assert int(a2a.moe_a2a_get_invalid_expert_count(sim.workspace, sim.metainfo[0], 0)) == 1


def test_debug_mode_rejects_out_of_range_ids(monkeypatch, device):
    monkeypatch.setenv("MOE_A2A_DEBUG", "1")
    case = Case(1, (6,), 2, 4)
    sim = make_sim(case, device)
    gen = make_generator(2)
    inputs = make_inputs(case, gen).to(device)
    ids = inputs.ids[0].clone()
    ids[3, 1] = case.num_experts  # one past the end
    snap = ws_snapshot(sim.workspace)
    with pytest.raises(ValueError, match=r"(?i)expert"):
        a2a.moe_a2a_dispatch(ids, inputs.payloads[0], sim.workspace, sim.metainfo[0], 6, 0, 1, 2, 4)
    assert_ws_unchanged(sim.workspace, snap)
    # Negative ids are legal ("no expert") even in debug mode.
    ids[3, 1] = -1
    out = a2a.moe_a2a_dispatch(ids, inputs.payloads[0], sim.workspace, sim.metainfo[0], 6, 0, 1, 2, 4)
    a2a.moe_a2a_combine(out[0][0], 6, sim.workspace, sim.metainfo[0], 6, 0, 1, 2, out[1])


# ---- timeouts ------------------------------------------------------------------------------------


def _timeout_message(rank, peers, seconds):
    return rf"rank {rank}: peers \[{', '.join(map(str, peers))}\] did not arrive within {seconds}"


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_timeout_names_missing_peer_and_recovers(phase, monkeypatch, device):
    case = Case(2, (4, 6), 2, 4, runtime_max=6)
    gen = make_generator(phase)
    sim = make_sim(case, device)
    inputs = make_inputs(case, gen)
    dev = inputs.to(device)
    T, ep = case.T, case.ep_size
    offset = None
    if phase == "combine":
        results = sim.run(lambda r: a2a.moe_a2a_dispatch(
            dev.ids[r], dev.payloads[r], sim.workspace, sim.metainfo[r], T, r, ep, case.top_k, case.num_experts))
        offset = results[0][1]
    monkeypatch.setenv("MOE_A2A_TIMEOUT_S", "1")
    pattern = _timeout_message(0, [1], r"1(\.0)? s")

    def call_rank0():
        if phase == "dispatch":
            return a2a.moe_a2a_dispatch(dev.ids[0], dev.payloads[0], sim.workspace, sim.metainfo[0], T, 0, ep,
                                        case.top_k, case.num_experts)
        payload = torch.ones(ep, T, case.hidden, dtype=case.hidden_dtype, device=device)
        return a2a.moe_a2a_combine(payload, case.tokens[0], sim.workspace, sim.metainfo[0], T, 0, ep,
                                   case.top_k, offset)

    start = time.monotonic()
    if device == "cpu":
        with pytest.raises(RuntimeError, match=pattern):
            call_rank0()
    else:
        call_rank0()
        torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    assert 0.9 <= elapsed <= 2.5, f"timeout took {elapsed:.2f} s"
    with pytest.raises(RuntimeError, match=pattern):
        a2a.check_errors(sim.workspace)
    # The failed rank refuses further work until initialized again.
    with pytest.raises(RuntimeError, match=pattern):
        call_rank0()
    monkeypatch.setenv("MOE_A2A_TIMEOUT_S", "20")
    for r in range(ep):
        sim.metainfo[r] = a2a.moe_a2a_initialize(sim.workspace, r, ep, case.max_tokens)
    a2a.check_errors(sim.workspace)  # clean again
    round_trip(sim, case, inputs, gen)


# ---- misuse of the alternation ----------------------------------------------------------------------


def _single_rank(device, gen):
    case = Case(1, (5,), 2, 3)
    sim = make_sim(case, device)
    inputs = make_inputs(case, gen).to(device)
    return case, sim, inputs


def _expect_protocol_error(device, fn, workspace, match):
    """CPU refuses at once; CUDA detects on the device and reports through the
    mailbox on the next call / check_errors."""
    if device == "cpu":
        with pytest.raises(RuntimeError, match=match):
            fn()
    else:
        try:
            fn()
        except RuntimeError as e:
            assert re.search(match, str(e)), str(e)
            return
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match=match):
            a2a.check_errors(workspace)


def test_two_dispatches_in_a_row_is_refused(device):
    case, sim, inputs = _single_rank(device, make_generator(1))
    dispatch = lambda: a2a.moe_a2a_dispatch(inputs.ids[0], inputs.payloads[0], sim.workspace, sim.metainfo[0],
                                            5, 0, 1, 2, 3)
    dispatch()
    _expect_protocol_error(device, dispatch, sim.workspace, r"(?i)dispatch")


def test_combine_without_dispatch_is_refused(device):
    case, sim, inputs = _single_rank(device, make_generator(2))
    offset = layout.call_layout(1, 5, 0, [s.row_bytes for s in case.payload_specs()]).combine_offset
    payload = torch.ones(1, 5, case.hidden, dtype=case.hidden_dtype, device=device)
    combine = lambda: a2a.moe_a2a_combine(payload, 5, sim.workspace, sim.metainfo[0], 5, 0, 1, 2, offset)
    _expect_protocol_error(device, combine, sim.workspace, r"combine called without a preceding dispatch|or combine "
                                                           r"without a preceding dispatch")


def test_combine_twice_is_a_repeated_combine(device):
    """FlashInfer's semantics: a second combine after one dispatch combines
    again; one whose sizes are not the dispatch's is refused, as a first
    combine would be (at once on the CPU, recorded on CUDA)."""
    case, sim, inputs = _single_rank(device, make_generator(3))
    out = a2a.moe_a2a_dispatch(inputs.ids[0], inputs.payloads[0], sim.workspace, sim.metainfo[0], 5, 0, 1, 2, 3)
    payload = torch.ones(1, 5, case.hidden, dtype=case.hidden_dtype, device=device)
    first = a2a.moe_a2a_combine(payload, 5, sim.workspace, sim.metainfo[0], 5, 0, 1, 2, out[1])
    second = a2a.moe_a2a_combine(payload * 3, 5, sim.workspace, sim.metainfo[0], 5, 0, 1, 2, out[1])
    assert torch.equal(second.cpu(), (first.float() * 3).to(first.dtype).cpu())
    other = lambda: a2a.moe_a2a_combine(payload[:, :4].contiguous(), 4, sim.workspace, sim.metainfo[0], 4, 0, 1, 2,
                                        out[1])
    if device == "cpu":
        with pytest.raises(ValueError, match="combine must use the dispatch's sizes"):
            other()
        return
    other()
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="combine was called with another local_num_tokens, "
                                           "runtime_max_tokens_per_rank than its dispatch"):
        a2a.check_errors(sim.workspace)


def test_timeout_s_of_simulated_ep(device):
    """SimulatedEP(timeout_s=1) bounds the waits (the environment says 20 s): rank
    1 fails validation before it waits, rank 0 times out waiting for it, and run()
    re-raises the first exception once both finished."""
    case = Case(2, (4, 6), 2, 4, runtime_max=6)
    sim = make_sim(case, device, timeout_s=1.0)
    inputs = make_inputs(case, make_generator(0)).to(device)
    bad_ids = [inputs.ids[0], inputs.ids[1].to(torch.int16)]  # rank 1: wrong dtype
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"int32 or torch.int64"):
        sim.dispatch(bad_ids, inputs.payloads, 6, 2, 4)
    _wait_for_device(device)
    assert 0.9 <= time.monotonic() - start <= 2.5
    with pytest.raises(RuntimeError, match=_timeout_message(0, [1], r"1(\.0)? s")):
        a2a.check_errors(sim.workspace)


def test_rank_calls_of_simulated_ep(device):
    """A round trip through the per-rank calls that SimulatedEP.capture takes
    (dispatch_rank, toy MoE, combine_rank, each rank's step under run()) against the
    reference: receive counts, valid receive rows and outputs, bitwise, with the call
    regions and the outputs poisoned first. On the CPU, capture() refuses clearly."""
    from torch_moe_a2a import reference

    case = Case(3, (5, 0, 7), 2, 6, hidden=32, runtime_max=7)
    ep, T, tokens = case.ep_size, case.T, list(case.tokens)
    sim = make_sim(case, device)
    gen = make_generator("rank calls")
    x = make_inputs(case, gen)
    dev = x.to(device)
    poison_call_regions(sim.workspace, gen)
    outs = [random_tensor((n, case.hidden), case.hidden_dtype, gen).to(device) for n in tokens]

    def rank_step(r):
        recv, offset, _ = sim.dispatch_rank(r, dev.ids[r], dev.payloads[r], T, case.top_k, case.num_experts)
        counts = sim.recv_counts(r)
        moe = reference.toy_moe(*recv[:3], counts, ep_rank=r, ep_size=ep, num_experts=case.num_experts)
        sim.combine_rank(r, moe, tokens[r], T, case.top_k, offset, output=outs[r])
        return [v.clone() for v in recv], counts.clone(), moe

    results = sim.run(rank_step)
    ref = reference.reference_dispatch(x.ids, x.payloads, ep_size=ep, num_experts=case.num_experts,
                                       runtime_max_tokens_per_rank=T)
    check_dispatch([res[0] for res in results], [res[1] for res in results], ref, case.payload_specs(), T,
                   range(ep))
    expected = reference.reference_combine([res[2].cpu() for res in results], ref, tokens)
    for r in range(ep):
        assert_bytes_equal(outs[r].cpu(), expected[r], f"rank {r} combine output")
    if device == "cpu":
        with pytest.raises(RuntimeError, match="CUDA graphs need simulated ranks on a CUDA device"):
            sim.capture(lambda r: None)


# ---- free-running ranks: no barrier between rounds ---------------------------------------------------


def _free_running(sim, rounds, device):
    """Every rank runs all rounds back to back in its own thread (stream), with no
    host synchronization between rounds: the protocol alone must keep the buffers
    of consecutive rounds apart. Returns outputs[rank][round] on the CPU."""
    from torch_moe_a2a import reference

    dev_rounds = [(case, inputs.to(device)) for case, inputs in rounds]

    def rank_loop(r):
        outs = []
        for case, x in dev_rounds:
            ep, T = case.ep_size, case.T
            recv, off, _ = a2a.moe_a2a_dispatch(x.ids[r], x.payloads[r], sim.workspace, sim.metainfo[r], T, r, ep,
                                                case.top_k, case.num_experts)
            counts = a2a.moe_a2a_get_recv_counts(sim.workspace, sim.metainfo[r], r)
            y = reference.toy_moe(recv[0], recv[1], recv[2], counts, ep_rank=r, ep_size=ep,
                                  num_experts=case.num_experts)
            outs.append(a2a.moe_a2a_combine(y, case.tokens[r], sim.workspace, sim.metainfo[r], T, r, ep, case.top_k,
                                            off))
        return outs

    results = sim.run(rank_loop)
    return [[o.cpu() for o in per_rank] for per_rank in results]


def _expected(case, inputs):
    from torch_moe_a2a import reference

    ref = reference.reference_dispatch(inputs.ids, inputs.payloads, ep_size=case.ep_size,
                                       num_experts=case.num_experts, runtime_max_tokens_per_rank=case.T)
    expert_out = [reference.toy_moe(ref.recv[r][0], ref.recv[r][1], ref.recv[r][2], ref.recv_counts[r], ep_rank=r,
                                    ep_size=case.ep_size, num_experts=case.num_experts) for r in range(case.ep_size)]
    return reference.reference_combine(expert_out, ref, list(case.tokens))


def _check_free_running(sim, rounds, device):
    outs = _free_running(sim, rounds, device)
    bad = []
    for i, (case, inputs) in enumerate(rounds):
        for r, exp in enumerate(_expected(case, inputs)):
            if not torch.equal(outs[r][i].view(torch.uint8), exp.view(torch.uint8)):
                bad.append(f"round {i} (T={case.T}) rank {r}")
    assert not bad, f"{len(bad)} wrong outputs: {bad[:8]}"


def _skip_free_running_on_cuda(device):
    if device == "cuda":
        # One host thread launches every simulated rank: a free-running rank's
        # later rounds (allocations, host waits) can block that thread before
        # the peers its spinning kernels wait for are launched. Free-running
        # ranks need one process per rank (the multi-process CUDA workspace).
        pytest.skip("free-running simulated ranks need a host thread per rank")


def _free_rounds(device):
    # CUDA: SimulatedEP.run enqueues all of rank 0's rounds before rank 1's first
    # one, so keep the launch queue well below its depth.
    return 40 if device == "cpu" else 12


def test_free_running_ranks_same_layout(device):
    _skip_free_running_on_cuda(device)
    gen = make_generator(31)
    rounds = []
    for i in range(_free_rounds(device)):
        case = Case(3, (0, 4, 4) if i % 2 == 0 else (40, 4, 4), 1, 3, hidden=512, runtime_max=48)
        rounds.append((case, make_inputs(case, gen)))
    _check_free_running(make_sim(rounds[1][0], device), rounds, device)


@pytest.mark.parametrize("grow", ["runtime_max", "payload_bytes"])
def test_free_running_ranks_changing_layout(grow, device):
    """Round n has a small layout, round n+1 a larger one (a larger runtime_max, or
    the same runtime_max with more payload bytes), so round n+1's receive planes
    cover the bytes of round n's combine region. A fast rank (no tokens in round
    n) starts dispatch n+1 while a slower peer may still be pulling round n's
    expert outputs from a third rank's combine region: the protocol must not let
    that dispatch overwrite them."""
    _skip_free_running_on_cuda(device)
    gen = make_generator(grow)
    big_extra = (PayloadSpec(torch.uint8, (4096,)),)
    rounds = []
    for i in range(_free_rounds(device)):
        small = i % 2 == 0
        tokens = (0, 4, 4) if small else (40, 4, 4)
        if grow == "runtime_max":
            case = Case(3, tokens, 1, 3, hidden=512, runtime_max=4 if small else 48, max_num_tokens=48)
        else:
            case = Case(3, tokens, 1, 3, hidden=512, runtime_max=48, extras=() if small else big_extra)
        rounds.append((case, make_inputs(case, gen)))
    _check_free_running(make_sim(rounds[1][0], device), rounds, device)


@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
@pytest.mark.parametrize("moves", ["runtime_max", "wider_rows", "narrower_rows"])
def test_free_running_combine_of_the_receive_view(layout, moves, device):
    """An expert that returns its input, or writes its output into it, hands the
    dispatch's receive view back as the combine payload. The combine reads the
    own source's rows of its payload after its flags, when a peer that
    finished its combine may already write its next dispatch into this rank's
    row, laid out for another T or other payload rows: those rows are staged
    with the others' when the payload lies in the workspace (protocol.h,
    combine step 1). On CUDA the ranks run free in one graph each (no host
    thread between their rounds), replayed side by side."""
    ep, top_k, num_experts = 3, 1, 6
    rounds = 400 if device == "cpu" else 64
    # Round A: one rank has a token, routed to its own expert. Round B: a peer
    # sends two tokens to that rank, whose rows of B's layout (another T, or
    # rows twice or half as wide) cover the bytes of A's own row there: A's
    # row [2, 0] of 16 bytes under B's rows [1, 0..1] (T 1 -> 2, or 16 -> 32
    # bytes at T 2); A's row [1, 0] of 32 bytes under B's rows [2, 0..1] of 16.
    specs = {  # (T, tokens per rank, hidden, expert) of rounds A and B
        "runtime_max": [(1, (0, 0, 1), 4, 4), (2, (0, 2, 0), 4, 4)],
        "wider_rows": [(2, (0, 0, 1), 4, 4), (2, (0, 2, 0), 8, 4)],
        "narrower_rows": [(2, (0, 1, 0), 8, 2), (2, (0, 0, 2), 4, 2)],
    }[moves]
    gen = make_generator(f"{layout}-{moves}")
    inputs = [[torch.randn(n, hidden, generator=gen).to(device) for n in tokens] for _, tokens, hidden, _ in specs]
    ids = [[torch.full((n, top_k), expert, dtype=torch.int32, device=device) for n in tokens]
           for _, tokens, _, expert in specs]
    weights = [[torch.ones(n, top_k, device=device) for n in tokens] for _, tokens, _, _ in specs]
    sim = a2a.SimulatedEP(ep, 2, dispatch_bytes_per_token=32 + 8 * top_k, combine_bytes_per_token=32, device=device,
                          timeout_s=20)

    def rank_loop(r):
        outs = []
        for i in range(rounds):
            T, tokens, _, _ = specs[i % 2]
            x = inputs[i % 2][r]
            if layout == "expert_major":
                dispatched = a2a.moe_a2a_dispatch(ids[i % 2][r], [x], sim.workspace, sim.metainfo[r], T, r, ep, top_k,
                                                  num_experts, expert_major=True, router_weights=weights[i % 2][r])
                outs.append(a2a.moe_a2a_combine_expert_major(dispatched.output_payloads[0], dispatched,
                                                             sim.workspace, sim.metainfo[r], r, ep))
            else:
                (recv,), offset, _ = a2a.moe_a2a_dispatch(ids[i % 2][r], [x], sim.workspace, sim.metainfo[r], T, r,
                                                          ep, top_k, num_experts)
                outs.append(a2a.moe_a2a_combine(recv, tokens[r], sim.workspace, sim.metainfo[r], T, r, ep, top_k,
                                                offset))
        return outs

    def wrong(results):
        # One destination a token, weight 1: each output is the token itself.
        return [sum(not torch.equal(out.cpu(), inputs[i % 2][r].cpu()) for i, out in enumerate(results[r]))
                for r in range(ep)]

    if device == "cpu":
        assert wrong(sim.run(rank_loop)) == [0] * ep
        return
    graphs, results = sim.capture(rank_loop)
    for replay in range(5):
        graphs.replay()
        torch.cuda.synchronize()
        assert wrong(results) == [0] * ep, f"replay {replay}"


def test_runtime_max_shrinking_between_rounds(device):
    """runtime_max_tokens_per_rank may change from one call to the next
    (DESIGN section 3: equal on all ranks for one call). When it shrinks,
    round n+1's receive planes start where round n's route region was, which
    each rank's combine n reads while it pulls: a fast rank's dispatch n+1
    must not write over a slow rank's routes. Rank 1 (slow) pulls many rows
    of its own tokens; rank 0 (fast) sends one token whose words read as
    route entries naming a valid slot, so an overwrite changes rank 1's
    output instead of failing loudly. The ranks run free (no host
    synchronization between rounds); on CUDA every input and output is
    allocated before the rounds, so no round blocks the launching thread."""
    ep, big, hidden = 2, 64, 1024
    rounds = 40 if device == "cpu" else 12
    sim = a2a.SimulatedEP(ep, big, dispatch_bytes_per_token=hidden * 4, combine_bytes_per_token=hidden * 4,
                          device=device, timeout_s=30)
    gen = make_generator(41)
    fake_route = (1 << layout.ROUTE_RANK_SHIFT) | 7  # "rank 1, slot 7"
    plan = []  # per round: runtime_max, then per rank (ids, payload, expert outputs, output)
    for i in range(rounds):
        T = big if i % 2 == 0 else 1
        own = random_values((T, hidden), torch.float32, gen).to(device)
        bait = torch.full((1, hidden), fake_route, dtype=torch.int32).view(torch.float32).to(device)
        ranks = [(torch.ones((1, 1), dtype=torch.int32, device=device), bait),
                 (torch.ones((T, 1), dtype=torch.int32, device=device), own)]
        plan.append((T, [(ids, x, torch.zeros((ep, T, hidden), device=device), torch.empty_like(x))
                         for ids, x in ranks]))

    def rank_loop(r):
        for T, per_rank in plan:
            ids, x, echo, out = per_rank[r]
            recv, off, _ = a2a.moe_a2a_dispatch(ids, [x], sim.workspace, sim.metainfo[r], T, r, ep, 1, ep)
            echo[1] = recv[0][1]  # rank 1's own tokens back to it, zeros to rank 0
            a2a.moe_a2a_combine(echo, x.shape[0], sim.workspace, sim.metainfo[r], T, r, ep, 1, off, output=out)

    sim.run(rank_loop)
    for i, (T, per_rank) in enumerate(plan):
        _, x, _, out = per_rank[1]
        assert_bytes_equal(out.cpu(), x.cpu(), f"round {i} (T={T}): rank 1's output")
        assert int(torch.count_nonzero(per_rank[0][3])) == 0, f"round {i}: rank 0's output"


@pytest.mark.parametrize("history", ["fresh", "after_use", "after_failure"])
def test_initialize_after_a_peers_first_dispatch(history, device):
    """initialize is local and zeroes the own row (DESIGN section 3), yet no
    peer writes into a rank's row before that rank has zeroed it (section
    5): the last rank initializes only after its peers' first dispatches
    are under way (on the CPU after a delay; on CUDA its initialize is
    launched after their dispatch kernels), and the round still completes
    and matches the reference. On a zeroed workspace, and initialized again
    (no barrier) after a full round trip, or after a dispatch of rank 0
    alone that timed out (the late rank's row then shows an initialization
    that no call used)."""
    from torch_moe_a2a import reference

    case = Case(3, (6, 9, 4), 2, 6, hidden=128, runtime_max=12)
    ep, late = case.ep_size, case.ep_size - 1
    sim = make_sim(case, device, timeout_s=20)
    gen = make_generator(43)
    inputs = make_inputs(case, gen)
    dev = inputs.to(device)
    if history == "fresh":
        sim.workspace.zero_()  # as allocate_workspace returns it: no row initialized yet
    elif history == "after_use":
        round_trip(sim, case, inputs, gen)
    else:
        try:
            a2a.moe_a2a_dispatch(dev.ids[0], dev.payloads[0], sim.workspace, sim.metainfo[0], case.T, 0, ep,
                              case.top_k, case.num_experts, timeout_s=0.2)
        except RuntimeError as e:  # the CPU raises at once, CUDA at the next call
            assert "did not arrive" in str(e)
    _wait_for_device(device)

    def first_dispatch(r):
        if r == late and device == "cpu":
            time.sleep(0.3)
        sim.metainfo[r] = a2a.moe_a2a_initialize(sim.workspace, r, ep, case.max_tokens)
        return a2a.moe_a2a_dispatch(dev.ids[r], dev.payloads[r], sim.workspace, sim.metainfo[r], case.T, r, ep,
                                    case.top_k, case.num_experts)

    results = sim.run(first_dispatch)
    recv = [[v.cpu().clone() for v in res[0]] for res in results]
    counts = [a2a.moe_a2a_get_recv_counts(sim.workspace, sim.metainfo[r], r).cpu().clone() for r in range(ep)]
    ref = reference.reference_dispatch(inputs.ids, inputs.payloads, ep_size=ep, num_experts=case.num_experts,
                                       runtime_max_tokens_per_rank=case.T)
    check_dispatch(recv, counts, ref, case.payload_specs(), case.T, range(ep))
    outs = sim.run(lambda r: a2a.moe_a2a_combine(results[r][0][0], case.tokens[r], sim.workspace, sim.metainfo[r],
                                                 case.T, r, ep, case.top_k, results[r][1]))
    expected = reference.reference_combine([ref.recv[r][0] for r in range(ep)], ref, list(case.tokens))
    for r in range(ep):
        assert_bytes_equal(outs[r].cpu(), expected[r], f"rank {r} output")


@pytest.mark.parametrize("differs", ["runtime_max", "payload_rows", "eplb", "num_experts"])
def test_calls_differing_between_ranks_are_reported(differs, device):
    """runtime_max_tokens_per_rank must be equal on all ranks for one call
    (DESIGN section 3), and so must the payload list; a rank cannot check
    that before it writes, but every rank learns the peers' T and payload
    signature with their flags: a call where they differ fails on every rank,
    naming the peers, instead of leaving wrong rows (the CPU dispatch raises
    at once; on CUDA the combine's kernel records it and the next call
    raises). Rank 2 differs: a smaller T (its planes then lie inside ranks 0
    and 1's route regions, so their copies may read overwritten routes: they
    stop at an entry outside the call rather than write beyond the
    workspace), a narrower hidden state, EPLB stats that the others do not
    send (its planes then start after an EPLB region), or another
    num_experts (its ids map to other ranks: rows would reach ranks that do
    not own their experts). After a re-initialization the ranks work again."""
    case = Case(3, (24, 20, 8), 2, 6, hidden=256, runtime_max=24)
    Ts = (24, 24, 8) if differs == "runtime_max" else (24, 24, 24)
    ep, eplb_n = case.ep_size, 4
    gen = make_generator(47)
    sim = make_sim(case, device, timeout_s=20, eplb_n=eplb_n)
    dev = make_inputs(case, gen).to(device)
    if differs == "payload_rows":
        dev.payloads[2][0] = dev.payloads[2][0][:, : case.hidden // 2].contiguous()
    stats = torch.arange(eplb_n, dtype=torch.int32, device=device)

    def dispatch(r):
        eplb = stats if differs == "eplb" and r == 2 else None
        num_experts = case.num_experts + 2 if differs == "num_experts" and r == 2 else case.num_experts
        return a2a.moe_a2a_dispatch(dev.ids[r], dev.payloads[r], sim.workspace, sim.metainfo[r], Ts[r], r, ep,
                                    case.top_k, num_experts, eplb_local_stats=eplb)

    def message(r):
        peers = "2" if r < 2 else "0, 1"
        if differs == "runtime_max":
            return (rf"rank {r}: peers \[{peers}\] called dispatch with another runtime_max_tokens_per_rank than "
                    rf"this rank's {Ts[r]} \(it must be equal on all ranks for one call\)")
        return (rf"rank {r}: peers \[{peers}\] called dispatch with other payloads than this rank's \(their "
                rf"number, row sizes or eplb_local_stats differ\), another num_experts, another active_rank_mask or, "
                rf"expert-major, another max_tokens_per_expert, or, where the ids travel as a payload \(the "
                rf"expert-major dispatch, a differentiable function's backward\), expert ids of another width "
                rf"\(they must be the same on all ranks for one call; with the differentiable functions, a rank "
                rf"that skipped a backward, whose exchanges are collectives, meets its peers' backward exchange "
                rf"here, and so do ranks that ran the backward of other exchanges, or in another order: a "
                rf"backward's exchange carries the identity of its forward exchange\)")

    def round_of_calls(r):
        """The rank's dispatch and combine; the first error's text, or None."""
        try:
            _, offset, _ = dispatch(r)
            payload = torch.ones(ep, Ts[r], case.hidden, dtype=case.hidden_dtype, device=device)
            a2a.moe_a2a_combine(payload, case.tokens[r], sim.workspace, sim.metainfo[r], Ts[r], r, ep, case.top_k,
                                offset)
        except RuntimeError as e:
            return str(e)
        return None

    first = sim.run(round_of_calls)
    _wait_for_device(device)
    for r in range(ep):
        if device == "cpu":
            assert first[r] is not None and re.search(message(r), first[r]), f"rank {r}: {first[r]}"
        # The rank stays failed: its next call raises the recorded error (on CUDA: from the mailbox).
        with pytest.raises(RuntimeError, match=message(r)):
            dispatch(r)
    with pytest.raises(RuntimeError, match=message(0)):
        a2a.check_errors(sim.workspace)
    for r in range(ep):
        sim.metainfo[r] = a2a.moe_a2a_initialize(sim.workspace, r, ep, case.max_tokens, eplb_n)
    a2a.check_errors(sim.workspace)
    round_trip(sim, case, make_inputs(case, gen), gen)


def test_expert_ids_of_another_width_on_a_peer_are_reported(device):
    """The expert-major dispatch sends the ids as a payload of their own, so
    int32 ids on one rank and int64 on another are payloads of two row sizes:
    every rank fails, and the error names the ids' width."""
    ep, T, top_k, num_experts, hidden = 2, 3, 2, 4, 8
    gen = make_generator("id-width")
    ids = [torch.randint(0, num_experts, (T, top_k), generator=gen).to(dtype).to(device)
           for dtype in (torch.int32, torch.int64)]
    x = [torch.randn(T, hidden, generator=gen).to(device) for _ in range(ep)]
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(ep, T, 4 * hidden * 4, 4 * hidden * 4, num_experts,
                                                                 top_k)
    sim = a2a.SimulatedEP(ep, T, workspace_size_per_rank=size, device=device, timeout_s=20)

    def round_of_calls(r):
        try:
            d = a2a.moe_a2a_dispatch_expert_major(ids[r], [x[r]], sim.workspace, sim.metainfo[r], T, r, ep, top_k,
                                                  num_experts)
            out = torch.empty(T, hidden, device=device)
            a2a.moe_a2a_combine_expert_major(d.output_payloads[0].clone(), d, sim.workspace, sim.metainfo[r], r, ep,
                                             output=out)
        except RuntimeError as e:
            return str(e)
        return None

    _assert_every_rank_failed(sim, sim.run(round_of_calls),
                              r"called dispatch with other payloads than this rank's .* expert ids of another width",
                              device)


def _assert_every_rank_failed(sim, errors, message, device):
    """Each rank's round of calls failed with ``message``: on the CPU its
    call raised it (``errors[r]``, the text of what it raised, None where
    nothing); on CUDA the device recorded it. The workspace holds the
    record either way (check_errors)."""
    _wait_for_device(device)
    for r, error in enumerate(errors):
        if device == "cpu":
            assert error is not None and re.search(message, error), f"rank {r}: {error}"
    with pytest.raises(RuntimeError, match=message):
        a2a.check_errors(sim.workspace)


@pytest.mark.parametrize("tags, pair", [
    ((0, 0), True),     # no backward rounds
    ((5, 5), True),     # the backward rounds of one exchange
    ((-1, 5), True),    # one of an exchange not known (a compiled backward's) and one of a known exchange
    ((-1, -1), True),
    ((5, 7), False),    # the backward rounds of two exchanges
    ((5, 0), False),    # a backward round against a call that is none (a rank that skipped a backward)
    ((-1, 0), False),
])
def test_round_tags_pair_the_rounds_of_one_exchange(tags, pair, device):
    """The dispatch op's round_tag (a differentiable function's backward
    round: its exchange's number, -1 where that is not known, 0 for any other
    call) travels beside the payload signature: dispatches of rows of the
    same sizes pair unless their round tags say they are not one exchange's
    round, where every rank fails naming that cause; a negative tag other
    than -1 is refused before anything runs."""
    from torch_moe_a2a.metainfo import metainfo_values

    ep, T, top_k, num_experts, hidden = 2, 3, 2, 4, 8
    gen = make_generator(("round tags", tags))
    ids = [torch.randint(0, num_experts, (T, top_k), generator=gen, dtype=torch.int32).to(device) for _ in range(ep)]
    x = [torch.randn(T, hidden, generator=gen).to(torch.bfloat16).to(device) for _ in range(ep)]
    sim = a2a.SimulatedEP(ep, T, dispatch_bytes_per_token=2 * hidden, combine_bytes_per_token=2 * hidden, device=device,
                          timeout_s=20)
    offset = layout.call_layout(ep, T, 0, [2 * hidden]).combine_offset
    outputs = [torch.empty(T, hidden, dtype=torch.bfloat16, device=device) for _ in range(ep)]

    def round_of_calls(r):
        _, _, max_num_tokens, _, _, mailbox, timeout_s = metainfo_values(sim.metainfo[r], id(sim.metainfo[r]))
        try:
            torch.ops.moe_a2a.dispatch.default(ids[r], [x[r]], sim.workspace, r, ep, max_num_tokens, T, top_k,
                                               num_experts, None, 0, [], timeout_s, mailbox, False, tags[r])
            payload = torch.ones(ep, T, hidden, dtype=torch.bfloat16, device=device)
            a2a.moe_a2a_combine(payload, T, sim.workspace, sim.metainfo[r], T, r, ep, top_k, offset,
                                output=outputs[r])
        except RuntimeError as e:
            return str(e)
        return None

    got = sim.run(round_of_calls)
    if pair:
        _wait_for_device(device)
        assert got == [None, None]
        a2a.check_errors(sim.workspace)
        return
    _assert_every_rank_failed(sim, got, r"called another exchange than this rank's backward exchange", device)


def test_a_round_tag_below_minus_one_is_refused():
    from torch_moe_a2a.metainfo import metainfo_values

    sim = a2a.SimulatedEP(1, 2, dispatch_bytes_per_token=32, combine_bytes_per_token=32)
    _, _, max_num_tokens, _, _, mailbox, timeout_s = metainfo_values(sim.metainfo[0], id(sim.metainfo[0]))
    ids = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"round_tag must be 0 \(no backward round\), -1 .* got -2"):
        torch.ops.moe_a2a.dispatch.default(ids, [torch.zeros(2, 8)], sim.workspace, 0, 1, max_num_tokens, 2, 1, 1,
                                           None, 0, [], timeout_s, mailbox, False, -2)


def test_ranks_with_different_rank_masks_are_reported(device):
    """Every active rank passes the same active_rank_mask for a call; rank 0
    masks rank 2 off while ranks 1 and 2 keep it. The mask joins the
    equal-payloads check: ranks 0 and 1, which receive each other's rows,
    name each other's mask (not a peer that "did not arrive"), and rank 2,
    whose wait for rank 0 cannot end, finds rank 0 failed."""
    case = Case(3, (4, 4, 4), 2, 6, hidden=64, runtime_max=4)
    ep = case.ep_size
    sim = make_sim(case, device, timeout_s=20)
    dev = make_inputs(case, make_generator(59)).to(device)
    everyone = a2a.moe_a2a_active_rank_mask([0, 1, 2], ep)
    masks = [everyone] * ep

    def dispatch(r):
        return a2a.moe_a2a_dispatch(dev.ids[r], dev.payloads[r], sim.workspace, sim.metainfo[r], case.T, r, ep,
                                    case.top_k, case.num_experts, enable_rank_mask=True, active_rank_mask=masks[r])

    def round_of_calls(r):
        """The rank's dispatch and combine (on CUDA the combine's kernel makes
        the check); the first error's text, or None."""
        try:
            _, offset, _ = dispatch(r)
            payload = torch.ones(ep, case.T, case.hidden, dtype=case.hidden_dtype, device=device)
            a2a.moe_a2a_combine(payload, case.tokens[r], sim.workspace, sim.metainfo[r], case.T, r, ep, case.top_k,
                                offset, enable_rank_mask=True, active_rank_mask=masks[r])
        except RuntimeError as e:
            return str(e)
        return None

    # A first round with equal masks: the first dispatch's wait for the
    # peers' initializations (which a failed peer ends too) lies behind.
    assert sim.run(round_of_calls) == [None] * ep
    masks = [a2a.moe_a2a_active_rank_mask([0, 1], ep), everyone, everyone]
    mismatch = r"called dispatch with other payloads than this rank's .*another active_rank_mask"
    expected = [rf"rank 0: peers \[1\] {mismatch}", rf"rank 1: peers \[0\] {mismatch}",
                r"rank 2: peers \[0\] failed earlier"]
    first = sim.run(round_of_calls)
    _wait_for_device(device)
    for r in range(ep):
        if device == "cpu":
            assert first[r] is not None and re.search(expected[r], first[r]), f"rank {r}: {first[r]}"
        with pytest.raises(RuntimeError, match=expected[r]):  # the rank stays failed
            dispatch(r)


@pytest.mark.parametrize("differs", ["dtype", "row_size", "low_precision", "block_scales"])
def test_combines_differing_between_ranks_are_reported(differs, device):
    """The ranks pull each other's combine rows as their own call lays them
    out, so one combine must have the same rows on all ranks (payload dtype,
    row size, transport); rank 2's differs. Every rank learns its peers'
    combine signatures with their combine flags: the call raises on every
    rank, naming the peers, instead of summing misread rows. A repeated
    combine of the round with other rows on every rank is fine (FlashInfer's
    bf16-then-quantized sequence), and after a re-initialization the ranks
    work again. The CPU's check: the CUDA combine does not make it
    (protocol.h)."""
    if device != "cpu":
        pytest.skip("the CUDA combine does not check its peers' rows (protocol.h, the equal-rows check)")
    case = Case(3, (24, 20, 8), 2, 6, hidden=256, runtime_max=24)
    ep, T = case.ep_size, case.T
    gen = make_generator(53)
    sim = make_sim(case, device, timeout_s=20)
    dev = make_inputs(case, gen).to(device)
    hidden = case.hidden // 2 if differs == "row_size" else case.hidden

    def combine_args(r, odd):
        """Rank r's payload and keyword arguments; `odd`: rank 2's rows."""
        dtype = torch.float16 if differs == "dtype" and odd else torch.bfloat16
        payload = torch.ones(ep, T, hidden if odd else case.hidden, dtype=dtype, device=device)
        return payload, {"use_low_precision": differs in ("low_precision", "block_scales") and odd,
                         "low_precision_block_scales": differs == "block_scales" and odd}

    def combine(r, offset, odd):
        payload, kwargs = combine_args(r, odd)
        return a2a.moe_a2a_combine(payload, case.tokens[r], sim.workspace, sim.metainfo[r], T, r, ep, case.top_k,
                                   offset, **kwargs)

    def message(r):
        peers = "2" if r < 2 else "0, 1"
        return (rf"rank {r}: peers \[{peers}\] called the same combine with other rows than this rank's \(their "
                rf"payload dtype, row size or use_low_precision differ")

    def round_of_calls(r):
        """The rank's dispatch, a combine with rows that agree, a second one that do not; the error's text."""
        _, offset, _ = a2a.moe_a2a_dispatch(dev.ids[r], dev.payloads[r], sim.workspace, sim.metainfo[r], T, r, ep,
                                            case.top_k, case.num_experts)
        combine(r, offset, odd=True)  # the same rows on every rank: agreed
        try:
            combine(r, offset, odd=r == 2)
        except RuntimeError as e:
            return str(e)
        return None

    first = sim.run(round_of_calls)
    for r in range(ep):
        assert first[r] is not None and re.search(message(r), first[r]), f"rank {r}: {first[r]}"
        with pytest.raises(RuntimeError, match=message(r)):
            a2a.moe_a2a_dispatch(dev.ids[r], dev.payloads[r], sim.workspace, sim.metainfo[r], T, r, ep, case.top_k,
                                 case.num_experts)
    for r in range(ep):
        sim.metainfo[r] = a2a.moe_a2a_initialize(sim.workspace, r, ep, case.max_tokens)
    a2a.check_errors(sim.workspace)
    round_trip(sim, case, make_inputs(case, gen), gen)


# ---- padded rows ------------------------------------------------------------------

PAD_BYTES = 3 * layout.ALIGN  # between rows, as a multi-process CUDA workspace pads rows to whole allocations
PAD_FILL = 0xA5


@pytest.mark.parametrize("eplb_n", [0, 5])
def test_workspace_with_padded_rows(device, eplb_n):
    """A workspace whose rows lie further apart than their size (the
    [ep_size, size_per_rank] view of a wider buffer): two round trips equal the
    reference, EPLB rows land in the right rows, and the padding between rows
    is never written, not even by initialize."""
    gen = make_generator("padded rows")
    sim = make_sim(CASE, device, eplb_n=eplb_n)
    size = sim.workspace.shape[1]
    wide = torch.full((CASE.ep_size, size + PAD_BYTES), PAD_FILL, dtype=torch.uint8, device=device)
    sim.workspace = wide[:, :size]
    assert sim.workspace.stride(0) == size + PAD_BYTES and not sim.workspace.is_contiguous()
    sim.metainfo = [a2a.moe_a2a_initialize(sim.workspace, r, CASE.ep_size, CASE.max_tokens, eplb_n)
                    for r in range(CASE.ep_size)]
    stats = [torch.randint(0, 100, (eplb_n,), dtype=torch.int32, generator=gen) for _ in range(CASE.ep_size)]
    for _ in range(2):
        rt = round_trip(sim, CASE, make_inputs(CASE, gen), gen, eplb_stats=stats if eplb_n else None)
        if eplb_n:
            for r in range(CASE.ep_size):
                assert torch.equal(rt.eplb[r], torch.stack(stats)), f"rank {r} gathered stats"
    _wait_for_device(device)
    assert bool((wide[:, size:] == PAD_FILL).all()), "a padding byte between rows was written"


def test_workspace_with_overlapping_rows_is_refused():
    """Rows closer than their size (or not contiguous) would alias: refused before anything runs."""
    size = a2a.moe_a2a_get_workspace_size_per_rank(2, 4, 64, 64)
    flat = torch.zeros(size + layout.ALIGN, dtype=torch.uint8)
    overlapping = flat.as_strided((2, size), (layout.ALIGN, 1))
    with pytest.raises(ValueError, match=r"rows must be contiguous bytes .* do not overlap"):
        a2a.moe_a2a_initialize(overlapping, 0, 2, 4)
    strided = torch.zeros(2, 2 * size, dtype=torch.uint8)[:, ::2]
    with pytest.raises(ValueError, match=r"rows must be contiguous bytes"):
        a2a.moe_a2a_initialize(strided, 0, 2, 4)
