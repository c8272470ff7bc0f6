"""Misuse across ranks and calls: every mistake gets a clear error (or, where
nothing is wrong with the data, the correct result), the workspace is left as
it was (or, for an error recorded in it, says how to recover), nothing hangs,
and the correct calls that follow give the reference result."""

import dataclasses
import math
import re
import signal
import sys
import threading
import time

import pytest
import torch
from conftest import (
    Case,
    Inputs,
    PayloadSpec,
    assert_bytes_equal,
    assert_ws_unchanged,
    check_dispatch,
    combine_again,
    ep_mapping,
    header_i32,
    make_generator,
    make_inputs,
    make_sim,
    poison_padding,
    random_tensor,
    round_trip,
    ws_snapshot,
)
from torch.utils.dlpack import from_dlpack, to_dlpack

import torch_moe_a2a as a2a
from torch_moe_a2a import layout, reference
from torch_moe_a2a.metainfo import call_timeout, metainfo_values
from torch_moe_a2a.moe_ep import BootstrapConfig, MoEEpCommParams, NVLinkOneSidedConfig

CASE = Case(3, (5, 0, 7), 2, 5, hidden=32, runtime_max=8, extras=(PayloadSpec(torch.uint8, (3,)),))


@pytest.fixture(autouse=True)
def _bounded_waits(monkeypatch):
    # A missing check must fail fast, not wait out the suite's 20 s.
    monkeypatch.setenv("MOE_A2A_TIMEOUT_S", "5")


def refused(workspace, fn, exc, *fragments):
    """``fn()`` raises ``exc`` whose text holds every fragment; the workspace bytes are unchanged."""
    snap = ws_snapshot(workspace)
    with pytest.raises(exc) as info:
        fn()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    assert_ws_unchanged(workspace, snap)
    return str(info.value)


def dispatch_all(sim, case, dev, T=None):
    T = case.T if T is None else T
    return sim.run(lambda r: a2a.moe_a2a_dispatch(dev.ids[r], dev.payloads[r], sim.workspace, sim.metainfo[r], T, r,
                                                  case.ep_size, case.top_k, case.num_experts))


def close_round(sim, case, inputs, results, gen):
    """The combine of an open round on every rank, after the dispatch
    ``results`` of ``inputs``: receive rows and counts checked against the
    reference; rank r's experts return its received hidden states times r + 1
    (padding poisoned); outputs bitwise equal to the reference's."""
    ep, T, device = case.ep_size, case.T, sim.workspace.device
    recv = [[v.cpu().clone() for v in res[0]] for res in results]
    counts = [a2a.moe_a2a_get_recv_counts(sim.workspace, sim.metainfo[r], r).cpu().clone() for r in range(ep)]
    ref = reference.reference_dispatch(inputs.ids, inputs.payloads, ep_size=ep, num_experts=case.num_experts,
                                       runtime_max_tokens_per_rank=T)
    specs = [PayloadSpec(p.dtype, tuple(p.shape[1:])) for p in inputs.payloads[0]]
    check_dispatch(recv, counts, ref, specs, T, range(ep))

    def moe(r, hidden):
        return (hidden.float() * (r + 1)).to(hidden.dtype)

    payloads = [poison_padding(moe(r, recv[r][0]), counts[r], gen).to(device) for r in range(ep)]
    # poisoned output buffers: the combine must write every byte
    outputs = [random_tensor((n, *recv[0][0].shape[2:]), recv[0][0].dtype, gen).to(device) for n in case.tokens]
    outs = sim.run(lambda r: a2a.moe_a2a_combine(payloads[r], case.tokens[r], sim.workspace, sim.metainfo[r], T, r,
                                                 ep, case.top_k, results[r][1], output=outputs[r]))
    expected = reference.reference_combine([moe(r, ref.recv[r][0]) for r in range(ep)], ref, list(case.tokens))
    for r in range(ep):
        assert_bytes_equal(outs[r].cpu(), expected[r], f"rank {r} combine output")


# ---- num_experts < top_k -----------------------------------------------------------------------------


def _with_repeats(case, gen):
    """make_inputs' payloads with each token's ids drawn with replacement from
    the case's experts: with fewer experts than top_k every token repeats one."""
    inputs = make_inputs(case, gen)
    ids = [torch.randint(0, case.num_experts, tuple(i.shape), generator=gen, dtype=torch.int32) for i in inputs.ids]
    return Inputs(ids, [[p[0], i.clone(), *p[2:]] for p, i in zip(inputs.payloads, ids)])


@pytest.mark.parametrize("top_k,num_experts", [(4, 3), (22, 3)])
def test_fewer_experts_than_top_k(top_k, num_experts, device):
    """DESIGN section 3's limits ask num_experts >= ep_size only: a token may
    name an expert in several slots, and with fewer experts than top_k every
    token does. The round trip equals the reference (a rank gets each token
    once, whatever its slots), and the expert-major sizing and dispatch
    accept such calls (their results: test_expert_major's repeats case)."""
    case = dataclasses.replace(CASE, top_k=top_k, num_experts=num_experts)
    gen = make_generator(("repeats", top_k))
    sim = make_sim(case, device)
    round_trip(sim, case, _with_repeats(case, gen), gen)
    assert a2a.moe_a2a_get_workspace_size_per_rank_expert_major(3, 8, 16, 16, num_experts, top_k) > 0
    assert a2a.MoeAlltoAll(ep_mapping(0, 3), 8, top_k, num_experts, workspace=sim.workspace).top_k == top_k


# ---- the dispatch/combine alternation ------------------------------------------------------------


def _bad_combine(change):
    def call(sim, case, results, device):
        args = dict(payload=torch.zeros(case.ep_size, case.T, case.hidden, dtype=case.hidden_dtype, device=device),
                    local_num_tokens=case.tokens[0], workspace=sim.workspace, metainfo=sim.metainfo[0],
                    runtime_max_tokens_per_rank=case.T, ep_rank=0, ep_size=case.ep_size, top_k=case.top_k,
                    combine_payload_offset=results[0][1])
        args.update(change(args))
        return a2a.moe_a2a_combine(**args)
    return call


BAD_COMBINES = {
    "local_num_tokens": (_bad_combine(lambda a: dict(local_num_tokens=a["local_num_tokens"] - 1)),
                         "combine must use the dispatch's sizes"),
    "top_k": (_bad_combine(lambda a: dict(top_k=a["top_k"] + 1)), "combine must use the dispatch's sizes"),
    "offset": (_bad_combine(lambda a: dict(combine_payload_offset=a["combine_payload_offset"] + 128)),
               "combine_payload_offset must be the one the dispatch returned"),
    "payload_shape": (_bad_combine(lambda a: dict(payload=a["payload"][:, 1:])), "payload must be ["),
    # Below the checks against the dispatch: the messages say what a combine takes.
    "runtime_max": (_bad_combine(lambda a: dict(runtime_max_tokens_per_rank=a["local_num_tokens"] - 1)),
                    "a combine takes its dispatch's local_num_tokens and runtime_max_tokens_per_rank, and one of "
                    "them is not the dispatch's"),
    "offset_unaligned": (_bad_combine(lambda a: dict(combine_payload_offset=a["combine_payload_offset"] + 1)),
                         "pass the offset the dispatch returned"),
}


@pytest.mark.parametrize("bad", list(BAD_COMBINES))
def test_refused_combine_then_dispatch_says_how_to_close_the_round(bad, device):
    """A refused combine leaves the round open: a dispatch then is refused with
    a text that says what to do, and the combine that closes the round, then a
    new round, give the reference results."""
    if device == "cuda":
        pytest.skip("CUDA records sequence errors in the workspace (test_protocol); the CPU refuses at once")
    gen = make_generator(("refused combine", bad))
    sim = make_sim(CASE, device)
    inputs = make_inputs(CASE, gen)
    dev = inputs.to(device)
    results = dispatch_all(sim, CASE, dev)
    call, text = BAD_COMBINES[bad]
    refused(sim.workspace, lambda: call(sim, CASE, results, device), ValueError, text)
    refused(sim.workspace, lambda: a2a.moe_a2a_dispatch(dev.ids[0], dev.payloads[0], sim.workspace, sim.metainfo[0],
                                                        CASE.T, 0, CASE.ep_size, CASE.top_k, CASE.num_experts),
            RuntimeError, "dispatch called twice without a combine in between",
            "call the combine that closes the open round", "or moe_a2a_initialize on every rank to start over")
    close_round(sim, CASE, inputs, results, gen)
    round_trip(sim, CASE, make_inputs(CASE, gen), gen)


def test_combine_without_dispatch_says_to_dispatch_first(device):
    """A combine with no dispatch since initialize is refused (a combine after
    a combine is no misuse: FlashInfer's repeated combines)."""
    if device == "cuda":
        pytest.skip("CUDA records sequence errors in the workspace (test_protocol); the CPU refuses at once")
    gen = make_generator("combine first")
    offset = round_trip(make_sim(CASE, device), CASE, make_inputs(CASE, gen), gen).offsets[0]  # a twin's: the same
    sim = make_sim(CASE, device)
    payload = torch.zeros(CASE.ep_size, CASE.T, CASE.hidden, dtype=CASE.hidden_dtype, device=device)
    refused(sim.workspace, lambda: a2a.moe_a2a_combine(payload, CASE.tokens[0], sim.workspace, sim.metainfo[0], CASE.T,
                                                       0, CASE.ep_size, CASE.top_k, offset),
            RuntimeError, "combine called without a preceding dispatch", "call moe_a2a_dispatch first")
    round_trip(sim, CASE, make_inputs(CASE, gen), gen)


@pytest.mark.parametrize("offset", [0, 16, 4096])
def test_combine_without_dispatch_and_its_offset_names_the_dispatch(device, offset):
    """A first combine with an offset that no dispatch returned (0: the
    caller never dispatched) is refused on the host with a message that names
    the dispatch, on either device, and changes nothing."""
    gen = make_generator(("combine first, offset", offset))
    sim = make_sim(CASE, device)
    payload = torch.zeros(CASE.ep_size, CASE.T, CASE.hidden, dtype=CASE.hidden_dtype, device=device)
    refused(sim.workspace, lambda: a2a.moe_a2a_combine(payload, CASE.tokens[0], sim.workspace, sim.metainfo[0], CASE.T,
                                                       0, CASE.ep_size, CASE.top_k, offset),
            ValueError, "must be the offset that this rank's preceding moe_a2a_dispatch returned",
            f"got {offset}; pass the offset the dispatch returned (a combine needs a preceding dispatch: without "
            "one, call moe_a2a_dispatch first)")
    round_trip(sim, CASE, make_inputs(CASE, gen), gen)


@pytest.mark.parametrize("first", ["e4m3 in place", "plain in place"])
def test_payload_in_workspace_after_a_staged_combine_is_refused(device, first):
    """A combine that stages leaves no payload in the combine region: an e4m3
    combine converts the rows there (in place over a payload that lives
    there), a plain one copies only the rows its peers pull (its own tokens'
    rows it reads from the tensor). A later combine of the round that reads
    the region as its payload would sum e4m3 bytes as bf16, or another
    combine's rows, so it is refused (at once on the CPU, recorded on CUDA),
    also after a plain staged combine. Combines that stage a tensor go on
    working, and the next round reads its payload in place again."""
    case = Case(2, (5, 3), 2, 4, hidden=64, runtime_max=6)
    gen = make_generator(f"in place after {first}")
    sim = make_sim(case, device)
    e4m3 = first.startswith("e4m3")
    rt = round_trip(sim, case, make_inputs(case, gen), gen, payload_in_workspace=True,
                    low_precision="e4m3" if e4m3 else None,
                    combine_kwargs=(lambda rank: dict(use_low_precision=True)) if e4m3 else None)
    tensors = dataclasses.replace(rt, payloads={r: rt.ref_expert_out[r].to(device) for r in range(case.ep_size)})
    if not e4m3:
        combine_again(sim, case, rt, gen, payload_in_workspace=True)  # nothing staged yet: in place again
        combine_again(sim, case, tensors, gen)
    in_place = [dict(payload_in_workspace=True), dict(payload_in_workspace=True, use_low_precision=True)]
    if device == "cpu":
        for staged_last in ("first", "e4m3 tensor", "plain tensor"):
            if staged_last == "e4m3 tensor":
                combine_again(sim, case, tensors, gen, combine_kwargs=lambda rank: dict(use_low_precision=True),
                              low_precision="e4m3")
            elif staged_last == "plain tensor":
                combine_again(sim, case, tensors, gen)
            for kwargs in in_place:
                refused(sim.workspace, lambda kwargs=kwargs: a2a.moe_a2a_combine(
                    rt.payloads[0], case.tokens[0], sim.workspace, sim.metainfo[0], case.T, 0, case.ep_size,
                    case.top_k, rt.offsets[0], **kwargs), ValueError,
                    "after a combine of the same dispatch that staged its payload", "pass the payload as a tensor")
        again = round_trip(sim, case, make_inputs(case, gen), gen, payload_in_workspace=True)
        combine_again(sim, case, again, gen, payload_in_workspace=True)
        return
    sim.run(lambda r: a2a.moe_a2a_combine(rt.payloads[r], case.tokens[r], sim.workspace, sim.metainfo[r], case.T, r,
                                          case.ep_size, case.top_k, rt.offsets[r], payload_in_workspace=True))
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="after a combine of the same dispatch that staged its payload"):
        a2a.check_errors(sim.workspace)


def test_expert_major_combine_after_rank_major_dispatch_says_how_to_close_the_round(device):
    if device == "cuda":
        pytest.skip("CUDA records sequence errors in the workspace (test_protocol); the CPU refuses at once")
    gen = make_generator("expert-major combine")
    case = CASE
    em_size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(case.ep_size, case.max_tokens, case.dispatch_bytes,
                                                                   case.combine_bytes, case.num_experts, case.top_k)
    sim = a2a.SimulatedEP(case.ep_size, case.max_tokens, dispatch_bytes_per_token=0, combine_bytes_per_token=0,
                          device=device, workspace_size_per_rank=em_size)
    inputs = make_inputs(case, gen)
    # The payloads an expert-major dispatch of the hidden states sends (it
    # appends the ids), so that the two layouts end at the same offset.
    inputs.payloads = [[ps[0], ps[1]] for ps in inputs.payloads]
    dev = inputs.to(device)
    results = dispatch_all(sim, case, dev)
    # The same dispatch, expert-major, on a twin workspace: its combine's arguments.
    other = a2a.SimulatedEP(case.ep_size, case.max_tokens, dispatch_bytes_per_token=0, combine_bytes_per_token=0,
                            device=device, workspace_size_per_rank=em_size)
    em = other.run(lambda r: a2a.moe_a2a_dispatch_expert_major(dev.ids[r], [dev.payloads[r][0]], other.workspace,
                                                               other.metainfo[r], case.T, r, case.ep_size,
                                                               case.top_k, case.num_experts))
    experts = torch.zeros_like(em[0].output_payloads[0])
    refused(sim.workspace, lambda: a2a.moe_a2a_combine_expert_major(experts, em[0], sim.workspace, sim.metainfo[0], 0,
                                                                    case.ep_size),
            ValueError, "needs an expert-major dispatch before it",
            "close this round with moe_a2a_combine")
    close_round(sim, case, inputs, results, gen)


def test_wrappers_say_how_to_recover():
    """MoeAlltoAll and NVLinkOneSidedAlltoAll keep their own alternation: their
    refusals say what to do too, and a refused combine leaves the round open
    for the correct one."""
    a2a.MoeAlltoAll.clear_workspace_cache()
    gen = make_generator("wrappers")
    x = torch.randn((5, 64), generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 4, (5, 2), generator=gen, dtype=torch.int32)
    moe = a2a.MoeAlltoAll(a2a.Mapping(), 8, 2, 4, hidden_size=64, device="cpu")
    snap = ws_snapshot(moe.workspace)
    with pytest.raises(RuntimeError, match="called before dispatch .*; call dispatch first"):
        moe.combine(torch.zeros(1, 8, 64, dtype=torch.bfloat16), 8)
    assert_ws_unchanged(moe.workspace, snap)  # refused before any byte changed
    (recv,) = moe.dispatch(ids, [x], 8)
    snap = ws_snapshot(moe.workspace)
    with pytest.raises(RuntimeError, match="called twice without combine; call combine to close the open round"):
        moe.dispatch(ids, [x], 8)
    assert_ws_unchanged(moe.workspace, snap)  # refused before any byte changed
    snap = ws_snapshot(moe.workspace)
    with pytest.raises(ValueError, match="combine must use the dispatch's runtime_max_tokens_per_rank=8, got 7"):
        moe.combine(recv[:, :7].clone(), 7)  # another runtime_max_tokens_per_rank than the dispatch's
    assert_ws_unchanged(moe.workspace, snap)  # refused before any byte changed
    out = moe.combine((recv.float() * 3).to(torch.bfloat16), 8)  # one rank: the only destination is this rank
    assert torch.equal(out, (x.float() * 3).to(torch.bfloat16))
    out = moe.combine((recv.float() * 5).to(torch.bfloat16), 8)  # FlashInfer's repeated combine
    assert torch.equal(out, (x.float() * 5).to(torch.bfloat16))
    twin = a2a.MoeAlltoAll(a2a.Mapping(), 8, 2, 4, hidden_size=64, device="cpu")  # shares moe's workspace
    assert twin.workspace.data_ptr() == moe.workspace.data_ptr()
    (twin_recv,) = twin.dispatch(ids, [x], 8)
    snap = ws_snapshot(moe.workspace)
    with pytest.raises(RuntimeError, match="dispatched after this instance's last dispatch.*; dispatch again"):
        moe.combine((recv.float() * 3).to(torch.bfloat16), 8)
    assert_ws_unchanged(moe.workspace, snap)  # refused before any byte changed
    twin.combine(twin_recv, 8)
    # A dispatch ends the repeated combines of the round before it, even one
    # refused: a combine after it would combine that round's routes.
    (recv,) = moe.dispatch(ids, [x], 8)
    moe.combine(recv, 8)
    with pytest.raises(ValueError, match="contiguous"):
        moe.dispatch(ids, [x[:, ::2]], 8)
    with pytest.raises(RuntimeError, match="called before dispatch .*; call dispatch first"):
        moe.combine(recv, 8)
    (recv,) = moe.dispatch(ids, [x], 8)
    assert torch.equal(moe.combine(recv, 8), x)

    params = MoEEpCommParams(num_experts=4, top_k=2, max_tokens_per_rank=8, hidden_size=64)
    comm = a2a.NVLinkOneSidedAlltoAll(BootstrapConfig(world_size=1, rank=0), params, NVLinkOneSidedConfig(),
                                      device="cpu")
    with pytest.raises(RuntimeError, match="combine called before dispatch; call dispatch first"):
        comm.combine(torch.zeros(8, 64, dtype=torch.bfloat16))
    got = comm.dispatch(x, ids, None, max_tokens_per_rank=6)
    with pytest.raises(RuntimeError, match="called twice without an intervening combine; call combine"):
        comm.dispatch(x, ids, max_tokens_per_rank=6)
    out = comm.combine((got.hidden_states.float() * 3).to(torch.bfloat16))
    assert torch.equal(out, (x.float() * 3).to(torch.bfloat16))
    comm.destroy()


def test_a_dispatch_that_does_not_fit_says_which_call_sizes_it(device):
    """A dispatch whose planes exceed the workspace's row is refused before it
    writes, naming the sizes and the calls that size a workspace."""
    hidden, tokens, top_k, experts = 256, 64, 4, 8
    gen = make_generator("undersized dispatch")
    size = a2a.moe_a2a_get_workspace_size_per_rank(1, tokens, hidden, hidden * 2)
    workspace = torch.zeros(1, size, dtype=torch.uint8, device=device)
    metainfo = a2a.moe_a2a_initialize(workspace, 0, 1, tokens)
    x = torch.randn((tokens, hidden * 4), generator=gen).to(torch.bfloat16).to(device)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen, dtype=torch.int32).to(device)
    refused(workspace, lambda: a2a.moe_a2a_dispatch(ids, [x], workspace, metainfo, tokens, 0, 1, top_k, experts),
            ValueError, "workspace too small: this call needs ", f"bytes per rank, the workspace has {size} (nothing was "
            "written); moe_a2a_get_workspace_size_per_rank (expert-major: moe_a2a_get_workspace_size_per_rank_expert_"
            "major) of the bytes per token of every payload the workspace is for gives the size it needs")


def test_workspace_sized_without_the_dispatch_payloads(device):
    """A workspace sized for the hidden states alone, then dispatched with ids
    and weights as payloads too: the dispatch fits, the combine after it does
    not, and its error says where the rows start, which call sizes both, and
    how to close the round (a combine whose rows fit, which then works)."""
    hidden, tokens, top_k, experts = 256, 128, 4, 8
    gen = make_generator("undersized workspace")
    size = a2a.moe_a2a_get_workspace_size_per_rank(1, tokens, hidden * 2, hidden * 2)
    workspace = torch.zeros(1, size, dtype=torch.uint8, device=device)
    metainfo = a2a.moe_a2a_initialize(workspace, 0, 1, tokens)
    x = torch.randn((tokens, hidden), generator=gen).to(torch.bfloat16).to(device)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen, dtype=torch.int32).to(device)
    weights = torch.rand((tokens, top_k), generator=gen).to(device)
    recv, offset, _ = a2a.moe_a2a_dispatch(ids, [x, ids, weights], workspace, metainfo, tokens, 0, 1, top_k, experts)
    snap = ws_snapshot(workspace)
    with pytest.raises(ValueError, match=r"workspace too small: this combine's rows .* start at byte \d+, after this "
                       r"round's dispatch planes.*moe_a2a_get_workspace_size_per_rank.*close the round with a "
                       r"combine whose rows fit"):
        a2a.moe_a2a_combine(recv[0], tokens, workspace, metainfo, tokens, 0, 1, top_k, offset)
    assert_ws_unchanged(workspace, snap)  # refused before any byte changed
    narrow = recv[0][..., : hidden // 2].contiguous()  # rows of half the bytes fit after the dispatch planes
    out = a2a.moe_a2a_combine(narrow, tokens, workspace, metainfo, tokens, 0, 1, top_k, offset)
    assert torch.equal(out.cpu(), x[:, : hidden // 2].cpu())  # one rank: each token's only destination
    # The way out the error names where no rows would do: a payload of 0 columns only closes the round.
    recv, offset, _ = a2a.moe_a2a_dispatch(ids, [x, ids, weights], workspace, metainfo, tokens, 0, 1, top_k, experts)
    snap = ws_snapshot(workspace)
    with pytest.raises(ValueError, match=r"a payload of 0 columns always fits and only closes the round"):
        a2a.moe_a2a_combine(recv[0], tokens, workspace, metainfo, tokens, 0, 1, top_k, offset)
    assert_ws_unchanged(workspace, snap)  # refused before any byte changed
    empty = torch.zeros(1, tokens, 0, dtype=torch.bfloat16, device=device)
    assert a2a.moe_a2a_combine(empty, tokens, workspace, metainfo, tokens, 0, 1, top_k, offset).shape == (tokens, 0)
    recv, offset, _ = a2a.moe_a2a_dispatch(ids, [x], workspace, metainfo, tokens, 0, 1, top_k, experts)
    assert torch.equal(a2a.moe_a2a_combine(recv[0], tokens, workspace, metainfo, tokens, 0, 1, top_k, offset).cpu(),
                       x.cpu())


def test_expert_major_combine_rows_larger_than_sized(device):
    """An expert-major workspace sized for bf16 expert outputs, combined from
    fp32 ones: the dispatch fits, the combine does not, and its error says
    where the rows start, which call sizes both, and how to close the round
    (a combine whose rows fit, which then works)."""
    hidden, tokens, top_k, experts = 256, 16, 4, 8
    gen = make_generator("undersized expert-major combine")
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(1, tokens, hidden * 2 + top_k * 8, hidden * 2,
                                                               experts, top_k)
    workspace = torch.zeros(1, size, dtype=torch.uint8, device=device)
    metainfo = a2a.moe_a2a_initialize(workspace, 0, 1, tokens)
    x = torch.randn((tokens, hidden), generator=gen).to(torch.bfloat16).to(device)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen, dtype=torch.int32).to(device)
    weights = torch.rand((tokens, top_k), generator=gen).to(device)
    d = a2a.moe_a2a_dispatch(ids, [x], workspace, metainfo, tokens, 0, 1, top_k, experts, expert_major=True,
                             router_weights=weights)
    snap = ws_snapshot(workspace)
    with pytest.raises(ValueError, match=r"workspace too small: this combine's rows \(num_local_experts x "
                       r"max_tokens_per_expert x 1024 bytes\) start at byte \d+, after this round's expert-major "
                       r"planes.*moe_a2a_get_workspace_size_per_rank_expert_major.*close the round with a combine "
                       r"whose rows fit"):
        a2a.moe_a2a_combine_expert_major(d.output_payloads[0].float(), d, workspace, metainfo, 0, 1)
    assert_ws_unchanged(workspace, snap)  # refused before any byte changed
    out = a2a.moe_a2a_combine_expert_major(d.output_payloads[0], d, workspace, metainfo, 0, 1)
    expected = (weights.float().sum(1, keepdim=True) * x.float()).to(torch.bfloat16)
    torch.testing.assert_close(out.float().cpu(), expected.float().cpu(), rtol=2e-2, atol=2e-2)


# ---- timeouts of SimulatedEP and initialize --------------------------------------------------------


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
@pytest.mark.parametrize("where", ["simulated_ep", "call"])
def test_timeout_bounds_direct_calls(where, phase, monkeypatch, device):
    """SimulatedEP(timeout_s=) bounds the functional calls on sim.workspace
    with sim.metainfo (the README's pattern), and a call's own timeout_s
    overrides it; the environment says 60 s. Rank 0 calls alone and times
    out; the error says to re-initialize, after which the ranks work again."""
    monkeypatch.setenv("MOE_A2A_TIMEOUT_S", "60")
    gen = make_generator(("timeout", where, phase))
    sim = make_sim(CASE, device, timeout_s=0.3 if where == "simulated_ep" else 60)
    call_timeout = {"timeout_s": 0.3} if where == "call" else {}
    dev = make_inputs(CASE, gen).to(device)
    offset = dispatch_all(sim, CASE, dev)[0][1] if phase == "combine" else None

    def rank0():
        if phase == "dispatch":
            return a2a.moe_a2a_dispatch(dev.ids[0], dev.payloads[0], sim.workspace, sim.metainfo[0], CASE.T, 0,
                                        CASE.ep_size, CASE.top_k, CASE.num_experts, **call_timeout)
        payload = torch.zeros(CASE.ep_size, CASE.T, CASE.hidden, dtype=CASE.hidden_dtype, device=device)
        return a2a.moe_a2a_combine(payload, CASE.tokens[0], sim.workspace, sim.metainfo[0], CASE.T, 0, CASE.ep_size,
                                   CASE.top_k, offset, **call_timeout)

    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        rank0()
        if device == "cuda":  # the kernel records the timeout; the next look raises it
            torch.cuda.synchronize()
            a2a.check_errors(sim.workspace)
    elapsed = time.monotonic() - start
    assert 0.25 <= elapsed < 5, f"the wait took {elapsed:.2f} s"
    text = str(info.value)
    assert "rank 0: peers [1, 2] did not arrive within 0.3 s" in text, text
    assert "until every rank calls moe_a2a_initialize again" in text, text
    metainfo = [m.clone() for m in sim.metainfo]
    sim.reset()
    assert all(torch.equal(a, b) for a, b in zip(metainfo, sim.metainfo))
    a2a.check_errors(sim.workspace)  # the recorded timeout is cleared
    round_trip(sim, CASE, make_inputs(CASE, gen), gen)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in the main thread (Python's default,
    whatever the test runner installed) for the test's duration."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _ctrl_c_once_ranks_wait(sim, ranks):
    """Starts a thread that sends the main thread SIGINT once each of `ranks`
    has released its dispatch flag to the next rank (each then waits for its
    peers). A rank not yet in its wait when SIGINT comes would find its own
    row failed and refuse its call, leaving the interruption's record in its
    row: the expected codes hold only for ranks that waited."""
    def released(r):  # flags[r] of rank r + 1's header
        return header_i32(sim.workspace, (r + 1) % sim.ep_size, layout.HDR_DISPATCH_FLAGS + 4 * r) != 0

    def send():
        # A rank that raised before its release would leave this loop
        # waiting: after 10 s SIGINT goes anyway, and the test's checks
        # say what the ranks did.
        deadline = time.monotonic() + 10
        while not all(released(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.001)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


@pytest.mark.parametrize("where", ["call", "simulated_ep"])
def test_ctrl_c_ends_a_wait(where, sigint_raises):
    """Ctrl-C during a wait of 60 s raises KeyboardInterrupt at once: in a
    call of the main thread (as one rank per process makes them), the op's
    wait ends and records the interruption in its row; in SimulatedEP.run,
    whose main thread waits for the ranks' threads, every rank's wait ends
    and every rank has returned when it raises. Either way the workspace is
    failed, as after a timeout, until a reset, after which the ranks work."""
    gen = make_generator(("ctrl-c", where))
    sim = make_sim(CASE, "cpu", timeout_s=60)
    x = make_inputs(CASE, gen)
    returned = [False] * CASE.ep_size

    def rank(r):  # rank 2 never comes; in SimulatedEP.run rank 1 dispatches too
        try:
            if r == 0 or (where == "simulated_ep" and r == 1):
                a2a.moe_a2a_dispatch(x.ids[r], x.payloads[r], sim.workspace, sim.metainfo[r], CASE.T, r,
                                     CASE.ep_size, CASE.top_k, CASE.num_experts)
        finally:
            returned[r] = True

    sender = _ctrl_c_once_ranks_wait(sim, [0] if where == "call" else [0, 1])
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as info:
        rank(0) if where == "call" else sim.run(rank)
    elapsed = time.monotonic() - start
    sender.join()
    assert elapsed < 10, f"Ctrl-C ended the wait after {elapsed:.2f} s"
    codes = [header_i32(sim.workspace, r, layout.HDR_ERROR_CODE) for r in range(CASE.ep_size)]
    if where == "call":
        assert codes[0] == layout.ERROR_INTERRUPTED, codes
        if sys.version_info >= (3, 11):  # exceptions take notes from 3.11
            note = " ".join(getattr(info.value, "__notes__", []))
            assert "rank 0: interrupted" in note and "waited for peers [1, 2] in its dispatch" in note, note
            assert "until every rank calls moe_a2a_initialize again" in note, note
    else:
        assert all(returned), returned
        assert codes == [layout.ERROR_PEER_FAILED, layout.ERROR_PEER_FAILED, layout.ERROR_INTERRUPTED], codes
    with pytest.raises(RuntimeError, match="an earlier call on this workspace failed.*rank 0: "):
        a2a.moe_a2a_dispatch(x.ids[0], x.payloads[0], sim.workspace, sim.metainfo[0], CASE.T, 0, CASE.ep_size,
                             CASE.top_k, CASE.num_experts)
    sim.reset()
    round_trip(sim, CASE, make_inputs(CASE, gen), gen)


def test_a_failed_peer_ends_the_wait_early(device):
    """Rank 0 dispatches alone and times out; ranks 1 and 2 then dispatch (rank
    0's rows and flag are there) and combine: rank 0, failed, never combines.
    They stop waiting for it once they see its error record (after a
    millisecond, not their 5-s timeout) and name it as failed, not as late."""
    gen = make_generator("failed peer")
    sim = make_sim(CASE, device)
    round_trip(sim, CASE, make_inputs(CASE, gen), gen)
    dev = make_inputs(CASE, gen).to(device)
    with pytest.raises(RuntimeError, match=r"rank 0: peers \[1, 2\] did not arrive within 0.3 s"):
        a2a.moe_a2a_dispatch(dev.ids[0], dev.payloads[0], sim.workspace, sim.metainfo[0], CASE.T, 0, CASE.ep_size,
                             CASE.top_k, CASE.num_experts, timeout_s=0.3)
        if device == "cuda":
            torch.cuda.synchronize()
            a2a.check_errors(sim.workspace)

    def peers(r):
        if r == 0:
            return None
        recv, offset, _ = a2a.moe_a2a_dispatch(dev.ids[r], dev.payloads[r], sim.workspace, sim.metainfo[r], CASE.T, r,
                                               CASE.ep_size, CASE.top_k, CASE.num_experts)
        return a2a.moe_a2a_combine(recv[0], CASE.tokens[r], sim.workspace, sim.metainfo[r], CASE.T, r, CASE.ep_size,
                                   CASE.top_k, offset)

    start = time.monotonic()
    if device == "cuda":
        sim.run(peers)
        torch.cuda.synchronize()
    else:
        with pytest.raises(RuntimeError, match=r"rank [12]: peers \[0\] failed earlier \(their own calls recorded an "
                                               r"error, so they will not arrive; seen while this rank waited for them "
                                               r"in its combine\); the workspace stays failed"):
            sim.run(peers)
    elapsed = time.monotonic() - start
    assert elapsed < 2.5, f"ranks 1 and 2 waited {elapsed:.2f} s for a failed peer"
    for r in (1, 2):
        assert header_i32(sim.workspace, r, layout.HDR_ERROR_CODE) == layout.ERROR_PEER_FAILED
        assert header_i32(sim.workspace, r, layout.HDR_ERROR_MISSING) == 1
        assert header_i32(sim.workspace, r, layout.HDR_ERROR_DETAIL) == layout.ERROR_COMBINE_TIMEOUT
    sim.reset()
    round_trip(sim, CASE, make_inputs(CASE, gen), gen)


def test_initialize_timeout_is_the_calls_default(device):
    sim = make_sim(CASE, device, timeout_s=2.5)
    meta = metainfo_values(sim.metainfo[1], id(sim.metainfo[1]))
    assert call_timeout(meta, None) == 2.5 and call_timeout(meta, 7.0) == 7.0
    plain = a2a.moe_a2a_initialize(sim.workspace, 1, CASE.ep_size, CASE.max_tokens)
    assert call_timeout(metainfo_values(plain, id(plain)), None) < 0  # the environment's, read by the op


@pytest.mark.parametrize("bad", ["0x1", " 1", "1 ", "inf", "nan", "0", "-1", "1e10", "abc", "1s"])
def test_the_environment_timeout_is_a_plain_number(bad, monkeypatch):
    """MOE_A2A_TIMEOUT_S is read as a plain decimal number of seconds up to
    the bound of every timeout_s (strtod alone took hex, leading blanks and
    'inf'). Read by the op when a call sets no timeout of its own."""
    sim = make_sim(CASE, "cpu")
    sim.metainfo = [a2a.moe_a2a_initialize(sim.workspace, r, CASE.ep_size, CASE.max_tokens)
                    for r in range(CASE.ep_size)]  # no timeout of their own: the environment's
    dev = make_inputs(CASE, make_generator("environment timeout"))
    monkeypatch.setenv("MOE_A2A_TIMEOUT_S", bad)
    refused(sim.workspace, lambda: a2a.moe_a2a_dispatch(dev.ids[0], dev.payloads[0], sim.workspace, sim.metainfo[0],
                                                        CASE.T, 0, CASE.ep_size, CASE.top_k, CASE.num_experts),
            ValueError, "MOE_A2A_TIMEOUT_S must be a positive number of seconds up to 1000000000, got '")
    monkeypatch.setenv("MOE_A2A_TIMEOUT_S", "2.5e1")
    round_trip(sim, CASE, make_inputs(CASE, make_generator("environment timeout, after")), make_generator(3))


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "1", 1e14])
def test_initialize_refuses_a_bad_timeout(bad, device):
    workspace = torch.zeros(1, a2a.moe_a2a_get_workspace_size_per_rank(1, 4, 16, 16), dtype=torch.uint8,
                            device=device)
    refused(workspace, lambda: a2a.moe_a2a_initialize(workspace, 0, 1, 4, timeout_s=bad), ValueError,
            "timeout_s must be a positive number of seconds")


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, 1e14])
def test_a_call_refuses_a_bad_timeout(bad, device):
    """A call's own timeout_s is a positive finite number of seconds: zero or
    less would read as "not set" to the op and wait for the environment's
    bound or 30 s instead of failing at once."""
    sim = make_sim(CASE, device, timeout_s=2.5)
    dev = make_inputs(CASE, make_generator(("call timeout", str(bad)))).to(device)
    payload = torch.zeros(CASE.ep_size, CASE.T, CASE.hidden, device=device)
    ws = sim.workspace
    refused(ws, lambda: a2a.moe_a2a_dispatch(dev.ids[0], dev.payloads[0], ws, sim.metainfo[0], CASE.T, 0,
                                             CASE.ep_size, CASE.top_k, CASE.num_experts, timeout_s=bad),
            ValueError, "timeout_s must be a positive number of seconds")
    results = dispatch_all(sim, CASE, dev)
    refused(ws, lambda: a2a.moe_a2a_combine(payload, CASE.tokens[0], ws, sim.metainfo[0], CASE.T, 0, CASE.ep_size,
                                            CASE.top_k, results[0][1], timeout_s=bad),
            ValueError, "timeout_s must be a positive number of seconds")
    with pytest.raises(ValueError, match="MoeAlltoAll: timeout_s must be a positive number of seconds"):
        a2a.MoeAlltoAll(a2a.Mapping(), 8, 2, 4, hidden_size=64, device="cpu", timeout_s=bad)


# ---- metainfo of another workspace, rank or size ------------------------------------------------------


def test_a_bool_rank_is_refused_before_anything_runs(device):
    """True and False compare equal to 1 and 0, so a bool ep_rank passed the
    metainfo's check; the differentiable and expert-major dispatches then
    failed after their exchange, on a select() of the bool, with the round
    left open. Refused before anything runs, as a rank outside the workspace
    is by the getters."""
    sim = make_sim(CASE, device, timeout_s=2.5)
    dev = make_inputs(CASE, make_generator("bool rank")).to(device)
    ws, ep = sim.workspace, CASE.ep_size
    x = dev.payloads[0][0].float()
    calls = {
        "dispatch": lambda: a2a.moe_a2a_dispatch(dev.ids[0], dev.payloads[0], ws, sim.metainfo[0], CASE.T, False, ep,
                                                 CASE.top_k, CASE.num_experts),
        "differentiable": lambda: a2a.moe_a2a_dispatch_differentiable(dev.ids[0], [x], ws, sim.metainfo[0], CASE.T,
                                                                      False, ep, CASE.top_k, CASE.num_experts),
        "expert-major": lambda: a2a.moe_a2a_dispatch(dev.ids[0], [x], ws, sim.metainfo[0], CASE.T, False, ep,
                                                     CASE.top_k, CASE.num_experts, expert_major=True),
        "ep_size": lambda: a2a.moe_a2a_dispatch(dev.ids[1], dev.payloads[1], ws, sim.metainfo[1], CASE.T, 1, True,
                                                CASE.top_k, CASE.num_experts),
    }
    for name, call in calls.items():
        refused(ws, call, ValueError, "ep_rank and ep_size must be ints, got")
    for getter in (a2a.moe_a2a_get_recv_counts, a2a.moe_a2a_get_invalid_expert_count):
        refused(ws, lambda: getter(ws, sim.metainfo[1], True), ValueError, "ep_rank must be in [0, ")
    round_trip(sim, CASE, make_inputs(CASE, make_generator("bool rank, after")), make_generator(1))


def test_getters_refuse_the_metainfo_of_another_workspace(device):
    """The header getters read a word of the given workspace at the metainfo's
    offsets: with another workspace's metainfo they returned a view of that
    workspace's bytes, or failed on a row that is not there (IndexError)."""
    sim = make_sim(CASE, device)
    other = make_sim(dataclasses.replace(CASE, ep_size=1, tokens=(CASE.tokens[0],)), device)
    for getter in (a2a.moe_a2a_get_recv_counts, a2a.moe_a2a_get_invalid_expert_count,
                   a2a.moe_a2a_get_dropped_pair_count):
        for ws, meta, rank in ((sim.workspace, other.metainfo[0], 0), (other.workspace, sim.metainfo[1], 1)):
            refused(ws, lambda: getter(ws, meta, rank), ValueError, "the metainfo belongs to a workspace of [")
        assert getter(sim.workspace, sim.metainfo[1], 1).device == sim.workspace.device


@pytest.mark.parametrize("bad", ["no", "False", 2, None, 1.0])
def test_yes_no_arguments_take_bools(bad, device):
    """expert_major='no' gave an expert-major dispatch, enable_rank_mask='no'
    switched the mask on: a string reads as yes. Refused, naming the argument."""
    sim = make_sim(CASE, device)
    dev = make_inputs(CASE, make_generator("flags")).to(device)
    ws = sim.workspace
    args = (dev.ids[0], dev.payloads[0], ws, sim.metainfo[0], CASE.T, 0, CASE.ep_size, CASE.top_k, CASE.num_experts)
    refused(ws, lambda: a2a.moe_a2a_dispatch(*args, expert_major=bad), ValueError,
            f"expert_major must be True or False, got {bad!r}")
    refused(ws, lambda: a2a.moe_a2a_dispatch(*args, enable_rank_mask=bad), ValueError,
            f"enable_rank_mask must be True or False, got {bad!r}")
    for name in ("expert_major", "enable_rank_mask"):
        with pytest.raises(ValueError, match=f"MoeAlltoAll: {name} must be True or False"):
            a2a.MoeAlltoAll(ep_mapping(0, 1), 8, 2, 4, hidden_size=64, device="cpu", **{name: bad})
    round_trip(sim, CASE, make_inputs(CASE, make_generator("flags, after")), make_generator(2))


def test_expert_major_dispatch_names_the_argument_at_fault(device):
    """The default max_tokens_per_expert is ep_size * T, so a bad T was
    reported as a bad max_tokens_per_expert; a top_k out of range with
    router_weights as a bad router_weights shape. Each now names itself."""
    T, hidden, top_k, experts = 4, 8, 2, 4
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(1, T, hidden * 4 + top_k * 8, hidden * 4, experts,
                                                                 top_k)
    workspace = torch.zeros(1, size, dtype=torch.uint8, device=device)
    metainfo = a2a.moe_a2a_initialize(workspace, 0, 1, T)
    gen = make_generator("expert-major arguments")
    ids = torch.randint(0, experts, (T, top_k), generator=gen, dtype=torch.int32).to(device)
    x = torch.randn((T, hidden), generator=gen).to(device)
    w = torch.rand((T, top_k), generator=gen).to(device)
    for bad in (4.0, 0, T + 1, None, True):
        refused(workspace, lambda: a2a.moe_a2a_dispatch(ids, [x], workspace, metainfo, bad, 0, 1, top_k, experts,
                                                        expert_major=True),
                ValueError, f"runtime_max_tokens_per_rank must be an int in [1, max_num_tokens={T}], got {bad!r}")
    for bad in (0, 23):
        refused(workspace, lambda: a2a.moe_a2a_dispatch(ids, [x], workspace, metainfo, T, 0, 1, bad, experts,
                                                        expert_major=True, router_weights=w),
                ValueError, f"top_k must be an int in [1, 22], got {bad}")
    d = a2a.moe_a2a_dispatch(ids, [x], workspace, metainfo, T, 0, 1, top_k, experts, expert_major=True,
                             router_weights=w)
    out = a2a.moe_a2a_combine_expert_major(d.output_payloads[0].clone(), d, workspace, metainfo, 0, 1)
    assert out.shape == (T, hidden)


def test_moe_alltoall_combine_view_checks_its_arguments(device):
    """get_combine_payload_tensor_in_workspace: a T other than the round's
    dispatch's gave a view of the wrong rows (above max_num_tokens too), a
    float hidden_size or a dtype's name failed deep in torch; a hidden_size
    too large for the workspace failed in the wrap, naming a byte slice."""
    moe = a2a.MoeAlltoAll(ep_mapping(0, 1), 8, 2, 4, hidden_size=64, device=device)
    ids = torch.randint(0, 4, (4, 2), dtype=torch.int32, device=device)
    moe.dispatch(ids, [torch.ones(4, 64, dtype=torch.bfloat16, device=device)], 4)
    get = moe.get_combine_payload_tensor_in_workspace
    for args, match in (((5, 64, torch.bfloat16), "runtime_max_tokens_per_rank must be the round's dispatch's (4), "
                                                  "got 5"),
                        ((True, 64, torch.bfloat16), "runtime_max_tokens_per_rank must be the round's dispatch's"),
                        ((4, 64.0, torch.bfloat16), "hidden_size must be a positive int, got 64.0"),
                        ((4, -8, torch.bfloat16), "hidden_size must be a positive int, got -8"),
                        ((4, 64, "bfloat16"), "dtype must be a torch.dtype, got 'bfloat16'"),
                        # A view the combine then refused.
                        ((4, 64, torch.float64), "dtype must be torch.bfloat16, torch.float16 or torch.float32"),
                        # Rows beyond the workspace's row: the wrap's "slice ... does not lie within one row".
                        ((4, 1 << 20, torch.bfloat16), "a [1, 4, 1048576] torch.bfloat16 payload (8388608 bytes) "
                                                       "does not fit this rank's combine region"),
                        ((4, 1024, torch.float32), "size the workspace for this hidden_size and dtype")):
        refused(moe.workspace, lambda: get(*args), ValueError, match)
    view = get(4, 64, torch.bfloat16)
    view.fill_(1)
    out = moe.combine(view, 4, payload_in_workspace=True)
    assert torch.equal(out.cpu(), torch.ones(4, 64, dtype=torch.bfloat16))


def test_moe_alltoall_expert_major_combine_view_checks_its_t(device):
    """After an expert-major dispatch any T was taken ('x' too), where the
    combine insists on the dispatch's."""
    moe = a2a.MoeAlltoAll(ep_mapping(0, 1), 8, 2, 4, hidden_size=64, device=device, expert_major=True)
    ids = torch.randint(0, 4, (4, 2), dtype=torch.int32, device=device)
    moe.dispatch(ids, [torch.ones(4, 64, dtype=torch.bfloat16, device=device)], 4)
    for bad in (5, "x"):
        refused(moe.workspace, lambda: moe.get_combine_payload_tensor_in_workspace(bad, 64, torch.bfloat16),
                ValueError, "runtime_max_tokens_per_rank must be the round's dispatch's (4)")
    view = moe.get_combine_payload_tensor_in_workspace(4, 64, torch.bfloat16)
    assert view.shape[0] == 4 and view.shape[2] == 64  # [num_local_experts, max_tokens_per_expert, hidden]
    moe.combine(view, 4, payload_in_workspace=True)


def test_simulated_ranks_on_cuda_without_cuda_say_so():
    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device")
    with pytest.raises(RuntimeError, match="SimulatedEP: device 'cuda' was asked for but torch .* sees no CUDA device"):
        a2a.SimulatedEP(2, 4, dispatch_bytes_per_token=64, combine_bytes_per_token=64, device="cuda")


def test_moe_alltoall_refuses_a_non_int_invalid_id_before_it_dispatches(device):
    """A float or str invalid_token_expert_id used to pass the pre-check and
    fail in the sanitize op after the dispatch, leaving the instance in its
    dispatched state with no receive views."""
    moe = a2a.MoeAlltoAll(ep_mapping(0, 1), 8, 2, 4, hidden_size=64, device=device)
    ids = torch.randint(0, 4, (4, 2), dtype=torch.int32, device=device)
    x = torch.ones(4, 64, dtype=torch.bfloat16, device=device)
    for bad in (2.5, 2.0, "x", True):
        refused(moe.workspace, lambda: moe.dispatch(ids, [x, ids], 4, invalid_token_expert_id=bad,
                                                    expert_id_payload_index=1),
                ValueError, "invalid_token_expert_id must be an int that fits in torch.int32, got")
    recv = moe.dispatch(ids, [x, ids], 4, invalid_token_expert_id=-1, expert_id_payload_index=1)
    assert tuple(recv[1].shape) == (1, 4, 2)
    moe.combine(torch.ones(1, 4, 64, dtype=torch.bfloat16, device=device), 4)


def _other_metainfo(sim, *, ep_size=CASE.ep_size, max_num_tokens=CASE.max_tokens, extra_bytes=0):
    """Rank 0's metainfo of another workspace with rows of sim's size plus ``extra_bytes``."""
    other = a2a.SimulatedEP(ep_size, max_num_tokens, dispatch_bytes_per_token=0, combine_bytes_per_token=0,
                            device=sim.device, workspace_size_per_rank=sim.workspace.shape[1] + extra_bytes)
    return other.metainfo[0]


METAINFO_BAD = {
    # (metainfo, the call's ep_rank, the call's ep_size), what the error says
    "rows_of_another_size": (lambda sim: (_other_metainfo(sim, extra_bytes=256), 0, CASE.ep_size),
                             "the metainfo belongs to a workspace of"),
    "another_max_num_tokens": (lambda sim: (_other_metainfo(sim, max_num_tokens=CASE.max_tokens + 1), 0,
                                            CASE.ep_size),
                               "metainfo does not match the workspace"),
    "another_ep_size": (lambda sim: (_other_metainfo(sim, ep_size=4), 0, 4), "workspace.shape[0] must equal ep_size=4"),
    "another_ep_size_call_says_the_workspaces": (lambda sim: (_other_metainfo(sim, ep_size=2), 0, CASE.ep_size),
                                                 "do not match the metainfo"),
    # another rank's
    "another_rank": (lambda sim: (sim.metainfo[1], 0, CASE.ep_size), "do not match the metainfo"),
    # its timeout word written by hand: a huge one made every wait unbounded
    "timeout_word_huge": (lambda sim: (_with_timeout_word(sim.metainfo[0], 2**63 - 1), 0, CASE.ep_size),
                          "metainfo's timeout word is 9223372036854775807 us, outside [0, 1000000000 s]"),
    "timeout_word_negative": (lambda sim: (_with_timeout_word(sim.metainfo[0], -5), 0, CASE.ep_size),
                              "metainfo's timeout word is -5 us"),
}


def _with_timeout_word(metainfo, value):
    edited = metainfo.clone()
    edited[layout.META_TIMEOUT_US] = value
    return edited


@pytest.mark.parametrize("op", ["dispatch", "combine"])
@pytest.mark.parametrize("bad", list(METAINFO_BAD))
def test_metainfo_of_another_workspace_is_refused(bad, op, device):
    if device == "cuda" and bad == "another_max_num_tokens":
        pytest.skip("the header's max_num_tokens lies in device memory: the CUDA host path compares what the "
                    "metainfo and the workspace's shape hold, without a synchronization")
    gen = make_generator(("metainfo", bad, op))
    sim = make_sim(CASE, device)
    inputs = make_inputs(CASE, gen)
    dev = inputs.to(device)
    make, text = METAINFO_BAD[bad]
    metainfo, rank, ep_size = make(sim)
    results = dispatch_all(sim, CASE, dev) if op == "combine" else None

    def call():
        if op == "dispatch":
            return a2a.moe_a2a_dispatch(dev.ids[0], dev.payloads[0], sim.workspace, metainfo, CASE.T, rank, ep_size,
                                        CASE.top_k, CASE.num_experts)
        payload = torch.zeros(ep_size, CASE.T, CASE.hidden, dtype=CASE.hidden_dtype, device=device)
        return a2a.moe_a2a_combine(payload, CASE.tokens[0], sim.workspace, metainfo, CASE.T, rank, ep_size,
                                   CASE.top_k, results[0][1])

    refused(sim.workspace, call, ValueError, text)
    if op == "combine":
        close_round(sim, CASE, inputs, results, gen)
    round_trip(sim, CASE, make_inputs(CASE, gen), gen)


def test_metainfo_of_a_workspace_of_the_same_geometry_works(device):
    """The metainfo holds sizes and a rank, no address on the CPU: one of
    another workspace of the same geometry is as good as the own one."""
    gen = make_generator("same geometry")
    sim, twin = make_sim(CASE, device), make_sim(CASE, device)
    sim.metainfo = twin.metainfo
    round_trip(sim, CASE, make_inputs(CASE, gen), gen)


# ---- payload layouts --------------------------------------------------------------------------------


def _with_payload(i, make):
    def change(sim, dev, results):
        payloads = list(dev.payloads[0])
        payloads[i] = make(payloads[i], sim, results)
        return dict(input_payloads=payloads)
    return change


def _strided(t, sim, results):
    wide = torch.stack([t, t], dim=-1)
    return wide[..., 0]


def _expanded(t, sim, results):
    return t[:1].expand(t.shape)


def _transposed_ids(sim, dev, results):
    return dict(token_selected_experts=dev.ids[0].t().contiguous().t())


def _in_workspace(t, sim, results):
    # a receive view of the previous dispatch, this rank's rows from itself
    return results[0][0][0][0, : t.shape[0]]


DISPATCH_LAYOUT_BAD = {
    "strided": (_with_payload(0, _strided), "input_payloads[0] must be contiguous"),
    "expanded": (_with_payload(0, _expanded), "input_payloads[0] must be contiguous"),
    "ids_transposed": (_transposed_ids, "token_selected_experts must be contiguous"),
    "payload_in_workspace": (_with_payload(0, _in_workspace), "input_payloads[0] lies in the workspace"),
    "ids_in_workspace": (lambda sim, dev, results: dict(
        token_selected_experts=results[0][0][1][0, : dev.ids[0].shape[0]]),
        "token_selected_experts lies in the workspace"),
    "meta_device": (_with_payload(0, lambda t, sim, results: torch.empty_like(t, device="meta")),
                    "; input_payloads[0] on meta): every tensor argument must be on the workspace's device"),
}


@pytest.mark.parametrize("bad", list(DISPATCH_LAYOUT_BAD))
def test_dispatch_refuses_payload_layouts(bad, device):
    """After a first round (whose receive views the workspace cases pass back),
    a dispatch with a bad layout is refused on one rank before it writes;
    then every rank's correct dispatch and combine give the reference."""
    gen = make_generator(("layout", bad))
    sim = make_sim(CASE, device)
    inputs = make_inputs(CASE, gen)
    dev = inputs.to(device)
    results = dispatch_all(sim, CASE, dev)
    close_round(sim, CASE, inputs, results, gen)
    change, text = DISPATCH_LAYOUT_BAD[bad]
    args = dict(token_selected_experts=dev.ids[0], input_payloads=dev.payloads[0], workspace=sim.workspace,
                metainfo=sim.metainfo[0], runtime_max_tokens_per_rank=CASE.T, ep_rank=0, ep_size=CASE.ep_size,
                top_k=CASE.top_k, num_experts=CASE.num_experts)
    args.update(change(sim, dev, results))
    refused(sim.workspace, lambda: a2a.moe_a2a_dispatch(**args), ValueError, text)
    round_trip(sim, CASE, make_inputs(CASE, gen), gen)


def test_combine_output_in_the_workspace_is_refused(device):
    gen = make_generator("output in workspace")
    sim = make_sim(CASE, device)
    inputs = make_inputs(CASE, gen)
    dev = inputs.to(device)
    results = dispatch_all(sim, CASE, dev)
    output = results[0][0][0][0, : CASE.tokens[0]]  # a receive view of this round
    payload = torch.zeros(CASE.ep_size, CASE.T, CASE.hidden, dtype=CASE.hidden_dtype, device=device)
    refused(sim.workspace, lambda: a2a.moe_a2a_combine(payload, CASE.tokens[0], sim.workspace, sim.metainfo[0], CASE.T,
                                                       0, CASE.ep_size, CASE.top_k, results[0][1], output=output),
            ValueError, "output lies in the workspace")
    close_round(sim, CASE, inputs, results, gen)


@pytest.mark.parametrize("where", ["header", "receive_view"])
def test_combine_output_scales_in_the_workspace_is_refused(where, device):
    """A quantized combine's output_scales inside the workspace (the own
    row's header, or a receive view of this round) would overwrite words the
    ranks use; it is refused before anything runs, and the round then closes
    as usual."""
    gen = make_generator(("output_scales in workspace", where))
    sim = make_sim(CASE, device)
    inputs = make_inputs(CASE, gen)
    dev = inputs.to(device)
    results = dispatch_all(sim, CASE, dev)
    n = CASE.tokens[0]
    blocks = CASE.hidden // 32  # MXFP8: a ue8m0 scale per 32 elements, linear layout
    if where == "header":
        scales = sim.workspace[0, : n * blocks].view(n, blocks)
    else:
        # the first bytes of this rank's received hidden rows from itself
        scales = results[0][0][0][0, :n].view(torch.uint8).reshape(-1)[: n * blocks].view(n, blocks)
    payload = random_tensor((CASE.ep_size, CASE.T, CASE.hidden), CASE.hidden_dtype, gen).to(device)
    refused(sim.workspace, lambda: a2a.moe_a2a_combine(payload, n, sim.workspace, sim.metainfo[0], CASE.T, 0,
                                                       CASE.ep_size, CASE.top_k, results[0][1],
                                                       output_dtype=torch.float8_e4m3fn, output_scales=scales),
            ValueError, "output_scales lies in the workspace")
    close_round(sim, CASE, inputs, results, gen)


def _unaligned(t, gen):
    """``t``'s values in a contiguous tensor that starts 1 element past an aligned allocation."""
    flat = random_tensor((t.numel() + 1,), t.dtype, gen)
    view = flat[1:].view(t.shape)
    return view.copy_(t)


@pytest.mark.parametrize("layout", ["unaligned", "overlapping", "same_tensor_twice"])
def test_dispatch_payload_layouts_that_are_fine(layout, device):
    """Contiguous payloads at any address, payloads that overlap each other or
    are the same tensor twice: read only, so the result is the reference's."""
    gen = make_generator(("fine layout", layout))
    case = Case(3, (5, 0, 7), 2, 5, hidden=32, runtime_max=8,
                extras=(PayloadSpec(torch.uint8, (3,)), PayloadSpec(torch.uint8, (3,))))
    sim = make_sim(case, device)
    inputs = make_inputs(case, gen)
    for ps in inputs.payloads:
        if layout == "unaligned":
            ps[:] = [_unaligned(p, gen) for p in ps]
        elif layout == "overlapping":
            # extras 3 and 4: two contiguous windows of one buffer, one byte apart
            n = ps[3].shape[0]
            flat = random_tensor((3 * n + 1,), torch.uint8, gen)
            ps[3], ps[4] = flat[: 3 * n].view(n, 3), flat[1:].view(n, 3)
        else:
            ps[4] = ps[3]
    round_trip(sim, case, inputs, gen)


# ---- arguments of the wrong kind, named --------------------------------------------------------------


def _em_differentiable_round(device, seed: str, requires_grad: bool = False):
    """An open expert-major round of one rank (T 4, hidden 8, top-2 of 4
    experts, distinct experts per token, so each pair brings its row back
    once): (workspace, metainfo, ids, hidden rows, top_k, the dispatch)."""
    T, hidden, top_k, experts = 4, 8, 2, 4
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(1, T, hidden * 4 + top_k * 8, 4 * top_k + hidden * 4,
                                                                experts, top_k)
    workspace = torch.zeros(1, size, dtype=torch.uint8, device=device)
    metainfo = a2a.moe_a2a_initialize(workspace, 0, 1, T)
    gen = make_generator(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(T)]).int().to(device)
    h = torch.randn((T, hidden), generator=gen).to(device).requires_grad_(requires_grad)
    d = a2a.moe_a2a_dispatch_expert_major_differentiable(ids, [h], workspace, metainfo, T, 0, 1, top_k, experts)
    return workspace, metainfo, ids, h, top_k, d


def test_check_errors_refuses_a_non_tensor_workspace(device):
    """check_errors(None) failed on None.dim() (AttributeError)."""
    sim = make_sim(CASE, device)
    for bad, got in ((None, "NoneType"), ([sim.workspace], "list")):
        refused(sim.workspace, lambda: a2a.check_errors(bad), ValueError,
                f"check_errors: workspace must be a tensor, got {got}")
    a2a.check_errors(sim.workspace)
    round_trip(sim, CASE, make_inputs(CASE, make_generator("check_errors, after")), make_generator(3))


@pytest.mark.parametrize("row_bytes", [0, 4096, layout.HEADER_BYTES - 1])
def test_check_errors_names_the_header_size_for_short_rows(row_bytes):
    """Rows shorter than the header were refused with the expected form,
    which the tensor had, without the size they lacked."""
    with pytest.raises(ValueError, match=rf"check_errors: workspace rows must hold at least the "
                                         rf"{layout.HEADER_BYTES}-byte header .*, got {row_bytes} bytes"):
        a2a.check_errors(torch.zeros(2, row_bytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"check_errors: workspace must be a uint8 \[ep_size, size_per_rank\] "
                                         r"tensor, got torch.int32 \(2, 4096\)"):
        a2a.check_errors(torch.zeros(2, 4096, dtype=torch.int32))


def test_differentiable_functions_refuse_non_tensors(device):
    """A None among the payloads of a differentiable dispatch, or as the
    payload of a differentiable combine, failed on its .dtype, .shape or
    .element_size() (AttributeError). Refused before anything runs, naming
    the argument (and the payload's index)."""
    sim = make_sim(CASE, device)
    dev = make_inputs(CASE, make_generator("differentiable non-tensors")).to(device)
    ws, ep = sim.workspace, CASE.ep_size
    x = dev.payloads[0][0].float()
    route = (ws, sim.metainfo[0], CASE.T, 0, ep, CASE.top_k, CASE.num_experts)
    for dispatch in (a2a.moe_a2a_dispatch_differentiable, a2a.moe_a2a_dispatch_expert_major_differentiable):
        refused(ws, lambda: dispatch(dev.ids[0], [x, None], *route), ValueError,
                f"{dispatch.__name__}: input_payloads[1] must be a tensor, got NoneType")
        refused(ws, lambda: dispatch(dev.ids[0], None, *route), ValueError,
                f"{dispatch.__name__}: input_payloads must be a list of tensors (a list or tuple), got NoneType")
    refused(ws, lambda: a2a.moe_a2a_combine_differentiable(None, dev.ids[0], *route, 0), ValueError,
            "moe_a2a_combine_differentiable: payload must be a tensor, got NoneType")
    round_trip(sim, CASE, make_inputs(CASE, make_generator("differentiable, after")), make_generator(4))

    # The expert-major combine, inside an open round: refused, then the round closes.
    workspace, metainfo, ids, h, top_k, d = _em_differentiable_round(device, "expert-major differentiable non-tensors")
    refused(workspace, lambda: a2a.moe_a2a_combine_expert_major_differentiable(None, d, ids, workspace, metainfo, 0, 1),
            ValueError, "moe_a2a_combine_expert_major_differentiable: expert_outputs must be a tensor, got NoneType")
    out = a2a.moe_a2a_combine_expert_major_differentiable(d.output_payloads[0], d, ids, workspace, metainfo, 0, 1)
    assert torch.allclose(out.cpu(), h.cpu() * top_k)


@pytest.mark.parametrize("kind", [float, str, type(None)])
def test_differentiable_functions_take_int_sizes(kind, device):
    """A float or a str among the sizes, ranks or the combine offset of a
    differentiable function reached the ops as pybind's TypeError listing
    their signatures (or a select()'s, for the expert-major combine's rank),
    and an expert-major dispatch given a float runtime_max_tokens_per_rank
    (or 0) blamed max_tokens_per_expert, its default. Each refused before
    anything runs, naming the argument, as the plain functions do (a rank or
    size that differs from the metainfo's by value is named by its check)."""
    sim = make_sim(CASE, device)
    dev = make_inputs(CASE, make_generator("differentiable int sizes")).to(device)
    ws, ep = sim.workspace, CASE.ep_size
    x = dev.payloads[0][0].float().requires_grad_()
    sizes = dict(runtime_max_tokens_per_rank=CASE.T, ep_rank=0, ep_size=ep, top_k=CASE.top_k,
                 num_experts=CASE.num_experts)
    for name, value in sizes.items():
        bad = kind() if kind is type(None) else kind(value)
        args = list({**sizes, name: bad}.values())
        named = kind is float or name not in ("ep_rank", "ep_size")
        for dispatch in (a2a.moe_a2a_dispatch_differentiable, a2a.moe_a2a_dispatch_expert_major_differentiable,
                         a2a.moe_a2a_dispatch, a2a.moe_a2a_dispatch_expert_major):
            fn = dispatch.__name__  # the plain functions run as the differentiable ones, under their own names
            refused(ws, lambda: dispatch(dev.ids[0], [x], ws, sim.metainfo[0], *args), ValueError,
                    f"{fn}: {name} must be an int, got {bad!r}" if named else "do not match the metainfo")
        refused(ws, lambda: a2a.moe_a2a_combine_differentiable(x[None].expand(ep, -1, -1), dev.ids[0], ws,
                                                               sim.metainfo[0], *args, 0), ValueError,
                f"moe_a2a_combine_differentiable: {name} must be an int, got {bad!r}" if named
                else "do not match the metainfo")
    bad = kind() if kind is type(None) else kind(0)
    refused(ws, lambda: a2a.moe_a2a_combine_differentiable(x[None].expand(ep, -1, -1), dev.ids[0], ws,
                                                           sim.metainfo[0], *sizes.values(), bad), ValueError,
            f"moe_a2a_combine_differentiable: combine_payload_offset must be an int, got {bad!r}")
    refused(ws, lambda: a2a.moe_a2a_dispatch_expert_major_differentiable(
        dev.ids[0], [x], ws, sim.metainfo[0], 0, 0, ep, CASE.top_k, CASE.num_experts), ValueError,
        f"runtime_max_tokens_per_rank must be an int in [1, max_num_tokens={CASE.max_tokens}], got 0")
    # The plain combine of a payload that requires grad (it runs as the differentiable one).
    refused(ws, lambda: a2a.moe_a2a_combine(x[None].expand(ep, -1, -1), bad, ws, sim.metainfo[0], CASE.T, 0, ep,
                                            CASE.top_k, 0), ValueError,
            f"moe_a2a_combine: local_num_tokens must be an int, got {bad!r}")
    round_trip(sim, CASE, make_inputs(CASE, make_generator("differentiable int sizes, after")), make_generator(5))

    # The expert-major combine's rank, inside an open round: refused, then the round closes.
    workspace, metainfo, ids, h, top_k, d = _em_differentiable_round(device, "expert-major differentiable int rank",
                                                                     requires_grad=True)
    if kind is float:  # (others differ from the metainfo's by value)
        for name, rank, size_ in (("ep_rank", 0.0, 1), ("ep_size", 0, 1.0)):
            refused(workspace, lambda: a2a.moe_a2a_combine_expert_major_differentiable(
                d.output_payloads[0], d, ids, workspace, metainfo, rank, size_), ValueError,
                f"moe_a2a_combine_expert_major_differentiable: {name} must be an int")
    out = a2a.moe_a2a_combine_expert_major_differentiable(d.output_payloads[0], d, ids, workspace, metainfo, 0, 1)
    assert torch.allclose(out.detach().cpu(), h.detach().cpu() * top_k)


def test_plain_functions_with_grad_name_themselves(device):
    """The plain functions given tensors that require grad run as the
    differentiable ones, and their argument errors named the differentiable
    function, which the caller never called. Each names itself now."""
    sim = make_sim(CASE, device)
    dev = make_inputs(CASE, make_generator("plain with grad, names")).to(device)
    ws, ep = sim.workspace, CASE.ep_size
    xs = [dev.payloads[r][0].clone().requires_grad_() for r in range(ep)]  # bf16 rows, as the workspace is sized
    got = sim.run(lambda r: a2a.moe_a2a_dispatch(dev.ids[r], [xs[r]], ws, sim.metainfo[r], CASE.T, r, ep, CASE.top_k,
                                                 CASE.num_experts))
    # Inside the open round: a combine with a float top_k, refused before anything runs.
    refused(ws, lambda: a2a.moe_a2a_combine(got[0][0][0], dev.ids[0].shape[0], ws, sim.metainfo[0], CASE.T, 0, ep,
                                            float(CASE.top_k), got[0][1]), ValueError,
            "moe_a2a_combine: top_k must be an int")
    outs = sim.run(lambda r: a2a.moe_a2a_combine(got[r][0][0], dev.ids[r].shape[0], ws, sim.metainfo[r], CASE.T, r,
                                                 ep, CASE.top_k, got[r][1]))
    assert all(o.requires_grad for o in outs)

    workspace, metainfo, ids, h, top_k, d = _em_differentiable_round(device, "plain expert-major with grad, names",
                                                                     requires_grad=True)
    message = refused(workspace, lambda: a2a.moe_a2a_combine_expert_major(d.output_payloads[0], d, workspace,
                                                                          metainfo, 0.0, 1), ValueError,
                      "moe_a2a_combine_expert_major: ep_rank must be an int")
    assert "differentiable" not in message.split(":")[0]
    out = a2a.moe_a2a_combine_expert_major(d.output_payloads[0], d, workspace, metainfo, 0, 1)
    assert torch.allclose(out.detach().cpu(), h.detach().cpu() * top_k)


@pytest.mark.parametrize("policy", ["must_save", torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE])
def test_checkpoint_context_takes_a_callable_policy(policy):
    """A policy that is not a function (a CheckpointPolicy value, a str) was
    accepted, and the checkpointed region's first op then failed on calling
    it ("'str' object is not callable"), in the forward. Refused at once,
    naming policy."""
    with pytest.raises(ValueError, match=r"checkpoint_context: policy must be a function \(ctx, op, \*args, "
                                         r"\*\*kwargs\) -> CheckpointPolicy, or None, got"):
        a2a.checkpoint_context(policy)
    assert len(a2a.checkpoint_context(lambda ctx, op, *args, **kwargs: None)) == 2


def test_dispatch_takes_a_list_or_tuple_of_payloads(device):
    """input_payloads=None failed on a star-unpacking ("Value after * must be
    an iterable"), a generator was used up by a first look at it and reported
    as "got 0 tensors", a None among the payloads with a recv_view_cache
    failed on its .shape. Each refused, naming input_payloads."""
    sim = make_sim(CASE, device)
    dev = make_inputs(CASE, make_generator("payload containers")).to(device)
    ws = sim.workspace
    args = (ws, sim.metainfo[0], CASE.T, 0, CASE.ep_size, CASE.top_k, CASE.num_experts)
    for kwargs in (dict(), dict(recv_view_cache={}), dict(expert_major=True)):
        fn = "moe_a2a_dispatch_expert_major" if kwargs.get("expert_major") else "moe_a2a_dispatch"
        for bad, got in ((None, "NoneType"), ((p for p in dev.payloads[0]), "generator"),
                         (dev.payloads[0][0], "Tensor")):
            refused(ws, lambda: a2a.moe_a2a_dispatch(dev.ids[0], bad, *args, **kwargs), ValueError,
                    f"{fn}: input_payloads must be a list of tensors (a list or tuple), got {got}")
        refused(ws, lambda: a2a.moe_a2a_dispatch(dev.ids[0], [dev.payloads[0][0], None], *args, **kwargs),
                ValueError, f"{fn}: input_payloads[1] must be a tensor, got NoneType")
    # A tuple is as good as a list.
    inputs = make_inputs(CASE, make_generator("payload containers, after"))
    inputs.payloads = [tuple(ps) for ps in inputs.payloads]
    round_trip(sim, CASE, inputs, make_generator(5))


@pytest.mark.parametrize("bad, text", [
    ([0.7, "1"], "active_ranks[0] must be an int rank, got 0.7"),
    ([1, "0"], "active_ranks[1] must be an int rank, got '0'"),
    ("01", "active_ranks must be an iterable of int ranks or a 1-D integer tensor, got str"),
    (None, "active_ranks must be an iterable of int ranks or a 1-D integer tensor, got NoneType"),
    (0, "active_ranks must be an iterable of int ranks or a 1-D integer tensor, got int"),
    ([True], "active_ranks[0] must be an int rank, got True"),
    ([0, 2], "active_ranks[1]: rank 2 out of range [0, 2)"),
    ([-1], "active_ranks[0]: rank -1 out of range [0, 2)"),
    (torch.zeros(2, 1, dtype=torch.int64), "active_ranks must be a 1-D integer tensor of ranks, got torch.int64 (2, 1)"),
    (torch.tensor(0), "active_ranks must be a 1-D integer tensor of ranks, got torch.int64 ()"),
    (torch.tensor([0.7]), "active_ranks must be a 1-D integer tensor of ranks, got torch.float32 (1,)"),
    (torch.tensor([True]), "active_ranks must be a 1-D integer tensor of ranks, got torch.bool (1,)"),
], ids=["float_and_str", "str_element", "str", "none", "int", "bool", "out_of_range", "negative", "tensor_2d",
        "tensor_0d", "float_tensor", "bool_tensor"])
def test_active_rank_mask_takes_int_ranks(bad, text):
    """[0.7, '1'] and '01' gave the mask of ranks {0, 1} (int() of each),
    None, 0 or a 2-D tensor a TypeError. Refused, naming active_ranks."""
    with pytest.raises(ValueError) as info:
        a2a.moe_a2a_active_rank_mask(bad, 2)
    assert text in str(info.value)
    for ep_size in (True, 2.0, "2"):
        with pytest.raises(ValueError, match=f"ep_size must be an int, got {ep_size!r}"):
            a2a.moe_a2a_active_rank_mask([0], ep_size)
    for good in ([0, 1], (1, 0), range(2), torch.tensor([1, 0], dtype=torch.int32), torch.tensor([0, 1])):
        assert int(a2a.moe_a2a_active_rank_mask(good, 2).view(torch.int64)[0]) == 0b11


def test_mapping_refuses_non_int_fields():
    """Mapping's int fields are ints: -1.0 compared equal to "not given" and
    was derived over, a float rank passed with enable_attention_dp (its
    derived ranks became floats); MoeAlltoAll truncated a mapping's float
    moe_ep_rank and moe_ep_size (0.9 and 1.5 gave rank 0 of 1)."""
    for kwargs, text in ((dict(rank=0.5, enable_attention_dp=True), "Mapping: rank must be an int, got 0.5"),
                         (dict(rank=True, enable_attention_dp=True), "Mapping: rank must be an int, got True"),
                         (dict(rank=0.0), "Mapping: rank must be an int in [0, 1), got 0.0"),
                         (dict(moe_ep_size=-1.0), "Mapping: moe_ep_size must be a positive int, got -1.0"),
                         (dict(world_size=2, tp_size=2, moe_tp_size=-1.0),
                          "Mapping: moe_tp_size must be a positive int, got -1.0"),
                         (dict(moe_cluster_size=-1.0), "Mapping: moe_cluster_size must be a positive int, got -1.0"),
                         (dict(attn_tp_size=-1.0), "Mapping: attn_tp_size must be a positive int, got -1.0"),
                         (dict(moe_ep_size=True), "Mapping: moe_ep_size must be a positive int, got True")):
        with pytest.raises(ValueError) as info:
            a2a.Mapping(**kwargs)
        assert text in str(info.value), kwargs
    assert a2a.Mapping(world_size=2, rank=1, tp_size=2, moe_ep_size=-1, moe_tp_size=2).moe_ep_size == 1
    # FlashInfer's layout (the MoE groups split the tensor-parallel group): the error says what to pass.
    with pytest.raises(ValueError, match=r"is not divisible by 4 \(the MoE groups split the tensor-parallel group: "
                                         r"for expert parallelism over 4 ranks pass tp_size=4"):
        a2a.Mapping(world_size=4, rank=1, moe_ep_size=4)
    assert a2a.Mapping(world_size=4, rank=1, tp_size=4, moe_ep_size=4).moe_ep_rank == 1
    assert a2a.Mapping(rank=3, enable_attention_dp=True).rank == 3  # the range check is FlashInfer's to skip
    for ep_rank, ep_size, text in ((0.9, 1.5, "mapping.moe_ep_rank must be an int, got 0.9"),
                                   (0, 1.0, "mapping.moe_ep_size must be an int, got 1.0"),
                                   (False, 1, "mapping.moe_ep_rank must be an int, got False")):
        mapping = dataclasses.make_dataclass("M", ["moe_ep_rank", "moe_ep_size"])(ep_rank, ep_size)
        with pytest.raises(ValueError, match=f"MoeAlltoAll: {text}"):
            a2a.MoeAlltoAll(mapping, 8, 2, 4, hidden_size=64, device="cpu")
        with pytest.raises(ValueError, match=f"MoeAlltoAll.get_workspace: {text}"):
            a2a.MoeAlltoAll.get_workspace(4096, 0, 1, 8, mapping, device="cpu")


# A given size is checked against the header's bound (hidden_size without dtype sizes nothing then, as in FlashInfer).
SIZE_BOUND = (f"MoeAlltoAll: workspace_size_per_rank must be an int multiple of 128 and at least {layout.HEADER_BYTES} "
              "(the workspace header)")


@pytest.mark.parametrize("bad, text", [
    (dict(hidden_size=0), "MoeAlltoAll: hidden_size must be an int >= 1, got 0"),
    (dict(hidden_size=True), "MoeAlltoAll: hidden_size must be an int >= 1, got True"),
    (dict(hidden_size="8"), "MoeAlltoAll: hidden_size must be an int >= 1, got '8'"),
    (dict(hidden_size=32.0), "MoeAlltoAll: hidden_size must be an int >= 1, got 32.0"),
    (dict(dtype="bfloat16"), "MoeAlltoAll: dtype must be a torch.dtype or None, got 'bfloat16'"),
    (dict(workspace="ws"), "MoeAlltoAll: workspace must be a tensor or None, got str"),
    (dict(mapping=None), "MoeAlltoAll: mapping must be a Mapping (an object with moe_ep_rank and moe_ep_size), "
                         "got NoneType"),
    (dict(num_experts=0), "MoeAlltoAll: num_experts must be an int >= "),
    (dict(top_k=0), "MoeAlltoAll: top_k must be an int in [1, 22], got 0"),
    (dict(workspace_size_per_rank="1048576"), f"{SIZE_BOUND}, got '1048576'"),
    (dict(workspace_size_per_rank=1048576.0), f"{SIZE_BOUND}, got 1048576.0"),
    (dict(workspace_size_per_rank=1048577), f"{SIZE_BOUND}, got 1048577"),
], ids=["hidden_0", "hidden_bool", "hidden_str", "hidden_float", "dtype_str", "workspace_str", "mapping_none",
        "no_experts", "top_k_0", "size_str", "size_float", "size_unaligned"])
def test_moe_alltoall_refuses_bad_arguments_before_it_allocates(bad, text, device):
    """MoeAlltoAll accepted hidden_size=0 or True; '8' failed on a str
    concatenation, dtype='bfloat16', workspace='ws' and mapping=None on an
    attribute. Refused, naming the argument, before a row of a given
    workspace is initialized or a workspace allocated."""
    sim = make_sim(CASE, device)
    cached = dict(a2a.MoeAlltoAll._WORKSPACE_CACHE)
    sizes = dict(max_num_tokens=CASE.max_tokens, top_k=CASE.top_k, num_experts=CASE.num_experts,
                 hidden_size=CASE.hidden)
    # Rank 0 of the simulated ranks, on their workspace.
    kwargs = {**sizes, "mapping": ep_mapping(0, CASE.ep_size), "workspace": sim.workspace, **bad}
    refused(sim.workspace, lambda: a2a.MoeAlltoAll(**kwargs), ValueError, text)
    # One rank with a workspace of its own.
    kwargs = {**sizes, "mapping": ep_mapping(0, 1), "device": device, **bad}
    with pytest.raises(ValueError) as info:
        a2a.MoeAlltoAll(**kwargs)
    assert text in str(info.value)
    assert a2a.MoeAlltoAll._WORKSPACE_CACHE == cached
    round_trip(sim, CASE, make_inputs(CASE, make_generator(("moe_alltoall arguments", text))), make_generator(6))


@pytest.mark.parametrize("bad", ["1048576", 1048576.0, True, 0, 1048577, layout.HEADER_BYTES - layout.ALIGN])
@pytest.mark.parametrize("call", ["constructor", "get_workspace"])
def test_moe_alltoall_names_a_bad_workspace_size_per_rank(bad, call, device):
    """Without hidden_size, a workspace_size_per_rank the ops do not take was
    refused as allocate_workspace's size_per_rank or the op's
    workspace.shape[1], names the caller never used; a str, beside
    hidden_size, failed on a comparison (TypeError)."""
    cached = dict(a2a.MoeAlltoAll._WORKSPACE_CACHE)
    text = (f"workspace_size_per_rank must be an int multiple of {layout.ALIGN} and at least {layout.HEADER_BYTES} "
            f"(the workspace header), got {bad!r}; MoeAlltoAll.get_moe_workspace_size_per_rank")
    with pytest.raises(ValueError) as info:
        if call == "constructor":
            a2a.MoeAlltoAll(ep_mapping(0, 1), 8, 2, 4, workspace_size_per_rank=bad, device=device)
        else:
            a2a.MoeAlltoAll.get_workspace(bad, 0, 1, 8, ep_mapping(0, 1), device=device)
    assert str(info.value).startswith(f"MoeAlltoAll{'.get_workspace' if call == 'get_workspace' else ''}: {text}")
    assert a2a.MoeAlltoAll._WORKSPACE_CACHE == cached
    # Beside hidden_size and dtype, a str is named too; a size too small for them is refused with the size they
    # need. Without dtype hidden_size is not read, as in FlashInfer: the header bound stands.
    with pytest.raises(ValueError, match="MoeAlltoAll: workspace_size_per_rank must be an int multiple of 128, got '8'"):
        a2a.MoeAlltoAll(ep_mapping(0, 1), 8, 2, 4, workspace_size_per_rank="8", hidden_size=64, dtype=torch.bfloat16,
                        device=device)
    with pytest.raises(ValueError, match=r"workspace_size_per_rank 1024 is too small for hidden_size 64 .* needed"):
        a2a.MoeAlltoAll(ep_mapping(0, 1), 8, 2, 4, workspace_size_per_rank=1024, hidden_size=64, dtype=torch.bfloat16,
                        device=device)
    with pytest.raises(ValueError, match=r"MoeAlltoAll: workspace_size_per_rank must be an int multiple of 128 and "
                                         r"at least \d+ \(the workspace header\), got 1024"):
        a2a.MoeAlltoAll(ep_mapping(0, 1), 8, 2, 4, workspace_size_per_rank=1024, hidden_size=64, device=device)


# ---- arguments of the wrong kind ----------------------------------------------------------------------


def _dispatch_call(sim, dev, **changed):
    """Rank 0's dispatch of CASE with ``changed`` arguments (by name)."""
    args = dict(token_selected_experts=dev.ids[0], input_payloads=dev.payloads[0], workspace=sim.workspace,
                metainfo=sim.metainfo[0], runtime_max_tokens_per_rank=CASE.T, ep_rank=0, ep_size=CASE.ep_size,
                top_k=CASE.top_k, num_experts=CASE.num_experts)
    return lambda: a2a.moe_a2a_dispatch(**{**args, **changed})


@pytest.mark.parametrize("name, bad, text", [
    ("runtime_max_tokens_per_rank", True, "moe_a2a_dispatch: runtime_max_tokens_per_rank must be an int, got True"),
    ("top_k", True, "moe_a2a_dispatch: top_k must be an int, got True"),
    ("num_experts", True, "moe_a2a_dispatch: num_experts must be an int, got True"),
    ("recv_view_cache", 5, "moe_a2a_dispatch: recv_view_cache must be a dict or None, got int"),
], ids=["T_bool", "top_k_bool", "num_experts_bool", "cache_int"])
def test_dispatch_refuses_arguments_of_the_wrong_kind(name, bad, text, device):
    """True counted as 1 (a top_k of 1 for a 2-wide id tensor was refused as
    'must be 2-D [local_num_tokens, top_k=1]'), and a recv_view_cache that is
    not a dict failed on its .get."""
    sim = make_sim(CASE, device)
    dev = make_inputs(CASE, make_generator(("dispatch kinds", name))).to(device)
    refused(sim.workspace, _dispatch_call(sim, dev, **{name: bad}), ValueError, text)
    round_trip(sim, CASE, make_inputs(CASE, make_generator(("dispatch kinds, after", name))), make_generator(7))


@pytest.mark.parametrize("name, bad, text", [
    ("local_num_tokens", True, "moe_a2a_combine: local_num_tokens must be an int, got True"),
    ("top_k", True, "moe_a2a_combine: top_k must be an int, got True"),
    ("use_low_precision", "no", "moe_a2a_combine: use_low_precision must be True or False, got 'no'"),
    ("use_low_precision", 0.5, "moe_a2a_combine: use_low_precision must be True or False, got 0.5"),
    ("low_precision_block_scales", "yes", "moe_a2a_combine: low_precision_block_scales must be True or False"),
    ("output_dtype", "bfloat16", "moe_a2a_combine: output_dtype must be a torch.dtype or None, got 'bfloat16'"),
    # Listed torch.float16 among the dtypes a combine takes (none but the payload's and bf16 here).
    ("output_dtype", torch.int32, "output_dtype must be the payload dtype (torch.bfloat16), got torch.int32"),
    ("sf_layout", True, "sf_layout must be an SfLayout"),
], ids=["tokens_bool", "top_k_bool", "low_precision_str", "low_precision_float", "block_scales_str",
        "output_dtype_str", "output_dtype_int", "sf_layout_bool"])
def test_combine_refuses_arguments_of_the_wrong_kind(name, bad, text, device):
    """use_low_precision='no' ran the lossy e4m3 combine (any truthy value
    did), output_dtype='bfloat16' failed in pybind with a cut message, True
    counted as 1 elsewhere (sf_layout=True: layout_8x4). Refused, naming the
    argument, with the round still open for the right combine."""
    sim = make_sim(CASE, device)
    inputs = make_inputs(CASE, make_generator(("combine kinds", name)))
    dev = inputs.to(device)
    results = dispatch_all(sim, CASE, dev)
    recv, offset = results[0][0][0], results[0][1]
    args = dict(payload=recv.clone(), local_num_tokens=CASE.tokens[0], workspace=sim.workspace,
                metainfo=sim.metainfo[0], runtime_max_tokens_per_rank=CASE.T, ep_rank=0, ep_size=CASE.ep_size,
                top_k=CASE.top_k, combine_payload_offset=offset)
    refused(sim.workspace, lambda: a2a.moe_a2a_combine(**{**args, name: bad}), ValueError, text)
    close_round(sim, CASE, inputs, results, make_generator(8))


def test_expert_major_combine_names_a_bad_output_dtype(device):
    """A raw dispatcher error ('Expected a value of type int for argument
    output_dtype') before; the round stays open for the right combine."""
    case = Case(1, (4,), 2, 4, hidden=16, runtime_max=4)
    inputs = make_inputs(case, make_generator("em output_dtype")).to(device)
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(1, 4, 64, 64, 4, 2)
    sim = a2a.SimulatedEP(1, 4, dispatch_bytes_per_token=0, combine_bytes_per_token=0, device=device,
                          workspace_size_per_rank=size)
    x = inputs.payloads[0][0]
    got = a2a.moe_a2a_dispatch(inputs.ids[0], [x], sim.workspace, sim.metainfo[0], 4, 0, 1, 2, 4, expert_major=True)
    y = got.output_payloads[0].clone()
    refused(sim.workspace, lambda: a2a.moe_a2a_combine_expert_major(y, got, sim.workspace, sim.metainfo[0], 0, 1,
                                                                     output_dtype="bfloat16"),
            ValueError, "moe_a2a_combine_expert_major: output_dtype must be a torch.dtype or None, got 'bfloat16'")
    # It listed torch.float16 among the dtypes, which a bf16 payload's combine refuses.
    refused(sim.workspace, lambda: a2a.moe_a2a_combine_expert_major(y, got, sim.workspace, sim.metainfo[0], 0, 1,
                                                                     output_dtype=torch.int32),
            ValueError, "output_dtype must be the expert_outputs dtype (torch.bfloat16), torch.bfloat16 or "
                        "torch.float32, got torch.int32")
    out = a2a.moe_a2a_combine_expert_major(y, got, sim.workspace, sim.metainfo[0], 0, 1)
    assert out.shape == x.shape


@pytest.mark.parametrize("call, text", [
    (lambda: a2a.moe_a2a_get_workspace_size_per_rank(True, 8, 64, 64),
     "moe_a2a_get_workspace_size_per_rank: ep_size must be an int, got True"),
    (lambda: a2a.moe_a2a_get_workspace_size_per_rank(2, 8.0, 64, 64),
     "moe_a2a_get_workspace_size_per_rank: max_num_tokens must be an int, got 8.0"),
    (lambda: a2a.moe_a2a_get_workspace_size_per_rank(2, 8, "64", 64),
     "total_dispatch_payload_size_per_token must be an int, got '64'"),
    (lambda: a2a.moe_a2a_get_workspace_size_per_rank_expert_major(2, 8, 64, 64, 8, 2.0),
     "moe_a2a_get_workspace_size_per_rank_expert_major: top_k must be an int, got 2.0"),
    (lambda: a2a.moe_a2a_get_workspace_size_per_rank_expert_major(2, 8, 64, 64, 8, 2, max_tokens_per_expert=True),
     "moe_a2a_get_workspace_size_per_rank_expert_major: max_tokens_per_expert must be an int, got True"),
    (lambda: a2a.moe_a2a_initialize(torch.zeros(1, 1 << 20, dtype=torch.uint8), 0, 1, True),
     "moe_a2a_initialize: max_num_tokens must be an int, got True"),
    (lambda: a2a.allocate_workspace(1024, ep_size=True), "ep_size must be an int in [1, 64] without a group, got True"),
], ids=["size_ep_bool", "size_float", "size_str", "em_size_float", "em_size_bool", "init_bool", "alloc_ep_bool"])
def test_sizing_functions_name_an_argument_of_the_wrong_kind(call, text):
    """Raw dispatcher errors ('Expected a value of type int ... Declaration:
    ...') for a float or a str, a bool counted as 1 (a workspace for one rank,
    a metainfo saying max_num_tokens 1), or a TypeError of torch's view()."""
    with pytest.raises(ValueError) as info:
        call()
    assert text in str(info.value)


def test_wrap_payload_tensor_names_its_bad_arguments():
    """A dtype that is not a torch.dtype, a leading shape with -1 in it, or a
    slice that is not whole rows of the dtype at an aligned address failed
    in torch's view() with its own words."""
    ws = torch.zeros(2, 1024, dtype=torch.uint8)
    wrap = a2a.moe_a2a_wrap_payload_tensor_in_workspace
    for args, text in ((([1, 4], 0, 64, "float32"), "dtype must be a torch.dtype, got 'float32'"),
                       (([-1, 4], 0, 64, torch.float32), "leading_shape must be a list of positive ints, got [-1, 4]"),
                       (([1, 4], 1, 65, torch.float32), "slice [1, 65) does not start at an address aligned for "
                                                          "torch.float32 (4-byte elements)"),
                       (([1, 4], 0, 60, torch.float32), "slice [0, 60) of 60 bytes is not a whole number of [1, 4] "
                                                        "rows of torch.float32: its length must be a multiple of "
                                                        "4 x 4 bytes"),
                       (([2**40], 0, 64, torch.float32), "slice [0, 64) of 64 bytes is not a whole number of "
                                                         "[1099511627776] rows"),
                       (([1, 4], 0.0, 64, torch.float32), "slice_start must be an int, got 0.0")):
        with pytest.raises(ValueError) as info:
            wrap(ws, *args)
        assert text in str(info.value), (args, str(info.value))
    assert wrap(ws, [1, 4], 1024 + 64, 1024 + 128, torch.float32).shape == (1, 4, 4)
    # Rows whose bytes are not adjacent (a strided or transposed workspace)
    # failed in torch's view() ("self.stride(-1) must be 1 to view Byte as ...").
    for strided in (ws[:, ::2], ws[0, ::2], ws.t()):
        with pytest.raises(ValueError, match=r"the workspace's rows must be contiguous \(stride 1 within a row\)"):
            wrap(strided, [1, 4], 0, 64, torch.float32)


@pytest.mark.parametrize("view", ["transposed", "strided"])
def test_a_workspace_whose_rows_are_not_contiguous_is_named(view, device):
    """A transposed workspace was refused as the metainfo of a workspace of
    "2 bytes per rank", a strided one as one of half its size."""
    sim = make_sim(CASE, device)
    dev = make_inputs(CASE, make_generator("strided view")).to(device)
    ws = sim.workspace.t() if view == "transposed" else sim.workspace[:, ::2]
    refused(sim.workspace, _dispatch_call(sim, dev, workspace=ws), ValueError,
            "the workspace's rows must be contiguous (stride 1 within a row), got strides")


def test_a_workspace_viewed_as_another_dtype_is_named(device):
    """A float view of the workspace was refused as the metainfo of another
    workspace (its rows are a quarter as long in elements)."""
    sim = make_sim(CASE, device)
    dev = make_inputs(CASE, make_generator("float view")).to(device)
    refused(sim.workspace, _dispatch_call(sim, dev, workspace=sim.workspace.view(torch.float32)), ValueError,
            "workspace must be the uint8 [ep_size, size_per_rank] tensor, got torch.float32")


def test_moe_alltoall_checks_its_group_and_device_on_a_cached_workspace():
    """The workspace cache answered before the group was looked at: a group
    that is none was accepted once a workspace of the geometry was cached. A
    device string torch does not know was torch's own RuntimeError."""
    a2a.MoeAlltoAll.clear_workspace_cache()
    sizes = dict(mapping=ep_mapping(0, 1), max_num_tokens=8, top_k=2, num_experts=4, hidden_size=16, device="cpu")
    a2a.MoeAlltoAll(**sizes)
    with pytest.raises(ValueError, match="group must be a torch.distributed ProcessGroup"):
        a2a.MoeAlltoAll(**sizes, group="not a group")
    with pytest.raises(ValueError, match="MoeAlltoAll: device must be a torch.device or a device string"):
        a2a.MoeAlltoAll(**{**sizes, "device": "xyz"})
    a2a.MoeAlltoAll.clear_workspace_cache()


def test_a_combine_of_the_other_layout_says_so():
    """A rank-major combine after an expert-major dispatch (here given its
    combine_payload_offset), and an expert-major combine given an earlier
    round's ExpertMajorDispatch, name what is wrong (not a bad
    combine_payload_offset, which the second caller never passed); each
    refusal leaves the round open."""
    ep, T, H, k, E = 1, 8, 16, 2, 4
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(ep, T, H * 4, H * 4, E, k)
    sim = a2a.SimulatedEP(ep, T, dispatch_bytes_per_token=0, combine_bytes_per_token=0,
                          workspace_size_per_rank=size, timeout_s=5)
    ids = torch.tensor([[0, 1]] * T, dtype=torch.int32)
    x = torch.randn(T, H, generator=make_generator("layouts"))
    em = a2a.moe_a2a_dispatch_expert_major(ids, [x], sim.workspace, sim.metainfo[0], T, 0, ep, k, E)
    snap = ws_snapshot(sim.workspace)
    with pytest.raises(ValueError, match=r"rank 0: moe_a2a_combine: the last dispatch's rows are laid out "
                                         r"expert-major .*: close its round with moe_a2a_combine_expert_major \(a "
                                         r"rank-major combine would stage or read rows where the expert-major regions "
                                         r"begin"):
        a2a.moe_a2a_combine(torch.zeros(ep, T, H), T, sim.workspace, sim.metainfo[0], T, 0, ep, k,
                            em.combine_payload_offset)
    assert_ws_unchanged(sim.workspace, snap)  # refused before any byte changed
    a2a.moe_a2a_combine_expert_major(em.output_payloads[0], em, sim.workspace, sim.metainfo[0], 0, ep)
    # A rank-major round (other sizes, so another layout), then the stale expert-major result.
    got = a2a.moe_a2a_dispatch(ids[:4], [x[:4]], sim.workspace, sim.metainfo[0], 4, 0, ep, k, E)
    snap = ws_snapshot(sim.workspace)
    with pytest.raises(ValueError, match=r"the expert-major combine needs an expert-major dispatch before it"):
        a2a.moe_a2a_combine_expert_major(em.output_payloads[0], em, sim.workspace, sim.metainfo[0], 0, ep)
    assert_ws_unchanged(sim.workspace, snap)  # refused before any byte changed
    a2a.moe_a2a_combine(got[0][0], 4, sim.workspace, sim.metainfo[0], 4, 0, ep, k, got[1])
    # Expert-major rounds of other sizes, then of other payloads: an earlier round's result after a dispatch.
    em2 = a2a.moe_a2a_dispatch_expert_major(ids[:4], [x[:4]], sim.workspace, sim.metainfo[0], 4, 0, ep, k, E)
    snap = ws_snapshot(sim.workspace)
    with pytest.raises(ValueError, match=r"must be given the last dispatch's ExpertMajorDispatch, not an earlier one "
                                         r"\(combine must use the dispatch's sizes: the dispatch had \(local_num_tokens=4"):
        a2a.moe_a2a_combine_expert_major(em.output_payloads[0], em, sim.workspace, sim.metainfo[0], 0, ep)
    assert_ws_unchanged(sim.workspace, snap)  # refused before any byte changed
    a2a.moe_a2a_combine_expert_major(em2.output_payloads[0], em2, sim.workspace, sim.metainfo[0], 0, ep)
    em3 = a2a.moe_a2a_dispatch_expert_major(ids[:4], [x[:4, :8].contiguous()], sim.workspace, sim.metainfo[0], 4, 0, ep, k, E)
    snap = ws_snapshot(sim.workspace)
    with pytest.raises(ValueError, match=r"must be given the last dispatch's ExpertMajorDispatch: the last dispatch "
                                         rf"had \(max_tokens_per_expert=4, combine_payload_offset="
                                         rf"{em3.combine_payload_offset}\), the one given has \(max_tokens_per_expert=4, "
                                         rf"combine_payload_offset={em2.combine_payload_offset}\)"):
        a2a.moe_a2a_combine_expert_major(em2.output_payloads[0], em2, sim.workspace, sim.metainfo[0], 0, ep)
    assert_ws_unchanged(sim.workspace, snap)  # refused before any byte changed
    a2a.moe_a2a_combine_expert_major(em3.output_payloads[0], em3, sim.workspace, sim.metainfo[0], 0, ep)
    em4 = a2a.moe_a2a_dispatch_expert_major(ids[:4], [x[:4], x[:4]], sim.workspace, sim.metainfo[0], 4, 0, ep, k, E)
    assert em4.dispatch_end != em3.dispatch_end
    snap = ws_snapshot(sim.workspace)
    with pytest.raises(ValueError, match=r"must be given the last dispatch's ExpertMajorDispatch: the one given is "
                                         rf"laid out for another dispatch \(dispatch_end {em3.dispatch_end}, the last "
                                         rf"dispatch's {em4.dispatch_end}\)"):
        a2a.moe_a2a_combine_expert_major(em3.output_payloads[0], em3, sim.workspace, sim.metainfo[0], 0, ep)
    assert_ws_unchanged(sim.workspace, snap)  # refused before any byte changed
    a2a.moe_a2a_combine_expert_major(em4.output_payloads[0], em4, sim.workspace, sim.metainfo[0], 0, ep)


def _em_in_place(sim, dispatched, r):
    """Rank r's expert outputs in place: the view of its combine region that
    the expert-major dispatch ``dispatched`` (its ExpertMajorDispatch) lays out."""
    view, offset = dispatched.output_payloads[0], dispatched.combine_payload_offset
    return a2a.moe_a2a_wrap_payload_tensor_in_workspace(sim.workspace[r], list(view.shape[:2]), offset,
                                                         offset + view.numel() * view.element_size(), view.dtype)


# The region-staged refusal names its reason first (not the ExpertMajorDispatch's dispatch).
REGION_STAGED = r"^(rank \d+: )?payload_in_workspace after a combine of the same dispatch that staged its payload"


def test_expert_major_payload_in_workspace_after_a_staged_combine_is_refused(device):
    """As for the rank-major combine: an expert-major combine that staged a
    tensor (with a peer to pull, ep 2) wrote its rows over the region, so a
    later combine of the round that reads the region in place is refused (at
    once on the CPU, with that reason first, where the message began by
    blaming the ExpertMajorDispatch, which was the last dispatch's; recorded
    on CUDA); in place before any staging works."""
    ep, T, H, k, E = 2, 4, 16, 2, 4
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(ep, T, H * 2, H * 2, E, k)
    sim = a2a.SimulatedEP(ep, T, dispatch_bytes_per_token=0, combine_bytes_per_token=0, device=device,
                          workspace_size_per_rank=size, timeout_s=5)
    gen = make_generator("em in place after staged")
    ids = [torch.randint(0, E, (T, k), dtype=torch.int32, generator=gen).to(device) for _ in range(ep)]
    x = [torch.randn(T, H, generator=gen).to(torch.bfloat16).to(device) for _ in range(ep)]
    got = sim.run(lambda r: a2a.moe_a2a_dispatch_expert_major(ids[r], [x[r]], sim.workspace, sim.metainfo[r], T, r,
                                                              ep, k, E))

    buffers = [_em_in_place(sim, got[r], r).copy_(got[r].output_payloads[0]) for r in range(ep)]
    sim.run(lambda r: a2a.moe_a2a_combine_expert_major(buffers[r], got[r], sim.workspace, sim.metainfo[r], r, ep,
                                                       payload_in_workspace=True))
    tensors = [got[r].output_payloads[0].clone() for r in range(ep)]
    sim.run(lambda r: a2a.moe_a2a_combine_expert_major(tensors[r], got[r], sim.workspace, sim.metainfo[r], r, ep))
    message = "after a combine of the same dispatch that staged its payload"
    if device == "cpu":
        text = refused(sim.workspace, lambda: a2a.moe_a2a_combine_expert_major(
            buffers[0], got[0], sim.workspace, sim.metainfo[0], 0, ep, payload_in_workspace=True), ValueError, message,
            "pass the payload as a tensor")
        assert re.match(REGION_STAGED, text), text
        return
    sim.run(lambda r: a2a.moe_a2a_combine_expert_major(buffers[r], got[r], sim.workspace, sim.metainfo[r], r, ep,
                                                       payload_in_workspace=True))
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match=message):
        a2a.check_errors(sim.workspace)


@pytest.mark.parametrize("shift", [0, 1, -1, 3], ids=lambda k: f"shift{k}")
@pytest.mark.parametrize("kind", ["rank-major", "e4m3", "e4m3-block-scaled", "expert-major"])
def test_a_payload_overlapping_the_combine_region_elsewhere_is_refused(device, kind, shift):
    """A payload tensor that is a view of the rank's own combine region,
    shifted by ``shift`` rows from its start: the combine stages the rows its
    peer pulls (ep 2) into that region, converted to e4m3 with low precision,
    so a shifted view had rows overwritten before they were read (a wrong
    sum, no error). Refused before anything is written; the region itself
    (shift 0) stages onto itself and combines as a tensor's copy of it."""
    ep, T, H, k, E = 2, 4, 64, 2, 4
    if kind == "expert-major":
        size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(ep, T, H * 2, H * 2, E, k)
        sim = a2a.SimulatedEP(ep, T, workspace_size_per_rank=size, device=device, timeout_s=5)
    else:
        sim = a2a.SimulatedEP(ep, T, dispatch_bytes_per_token=H * 2, combine_bytes_per_token=(H + 8) * 2,
                              device=device, timeout_s=5)
    gen = make_generator(f"overlap {kind} {shift}")
    ids = [torch.randint(0, E, (T, k), dtype=torch.int32, generator=gen).to(device) for _ in range(ep)]
    x = [torch.randn(T, H, generator=gen).to(torch.bfloat16).to(device) for _ in range(ep)]
    options = {"e4m3": dict(use_low_precision=True),
               "e4m3-block-scaled": dict(use_low_precision=True, low_precision_block_scales=True)}.get(kind, {})
    if kind == "expert-major":
        got = sim.run(lambda r: a2a.moe_a2a_dispatch_expert_major(ids[r], [x[r]], sim.workspace, sim.metainfo[r], T,
                                                                  r, ep, k, E))
        rows = [g.output_payloads[0] * 2 for g in got]
        offsets = [g.combine_payload_offset for g in got]

        def combine(r, payload):
            return a2a.moe_a2a_combine_expert_major(payload, got[r], sim.workspace, sim.metainfo[r], r, ep)
    else:
        got = sim.run(lambda r: a2a.moe_a2a_dispatch(ids[r], [x[r]], sim.workspace, sim.metainfo[r], T, r, ep, k, E))
        rows = [g[0][0] * 2 for g in got]
        offsets = [g[1] for g in got]

        def combine(r, payload):
            return a2a.moe_a2a_combine(payload, T, sim.workspace, sim.metainfo[r], T, r, ep, k, offsets[r], **options)

    def view_of(r):
        start = offsets[r] + shift * H * 2
        return a2a.moe_a2a_wrap_payload_tensor_in_workspace(sim.workspace[r], list(rows[r].shape[:2]), start,
                                                            start + rows[r].nbytes, torch.bfloat16)

    if shift == 0:
        # The region first (before a combine of the round stages into it), then tensors: the same sums.
        views = [view_of(r).copy_(rows[r]) for r in range(ep)]
        in_place = sim.run(lambda r: combine(r, views[r]))
        copies = sim.run(lambda r: combine(r, rows[r].clone()))
        for r in range(ep):
            assert torch.equal(in_place[r], copies[r]), f"rank {r}"
        return
    want = sim.run(lambda r: combine(r, rows[r].clone()))  # a combine may repeat: the reference
    view = view_of(0)
    view.copy_(rows[0])
    refused(sim.workspace, lambda: combine(0, view), ValueError,
            "payload" if kind != "expert-major" else "expert_outputs",
            f"overlaps this rank's combine region, into which the combine stages it, at another place than its start "
            f"({shift * H * 2} bytes from it)")
    again = sim.run(lambda r: combine(r, rows[r].clone()))  # the round goes on
    for r in range(ep):
        assert torch.equal(again[r], want[r]), f"rank {r}"


@pytest.mark.parametrize("setup", ["ep1", "peer_masked"])
def test_expert_major_in_place_after_a_payload_tensor_is_refused_whoever_pulls(setup, device):
    """An expert-major combine of a payload tensor copies nothing where no
    peer pulls (ep 1, or every peer masked off); a later in-place combine of
    the round was accepted there and returned what the region held, no
    payload of this round (zeros for rows the caller never wrote), where at
    ep 2 it is refused (the test above). Refused whoever pulls, as the
    rank-major combine's."""
    ep = 1 if setup == "ep1" else 2
    T, H, k, E = 4, 16, 2, 4
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(ep, T, H * 2, H * 2, E, k)
    sim = a2a.SimulatedEP(ep, T, dispatch_bytes_per_token=0, combine_bytes_per_token=0, device=device,
                          workspace_size_per_rank=size, timeout_s=5)
    gen = make_generator(("em in place after a tensor", setup))
    mask = dict(enable_rank_mask=True, active_rank_mask=a2a.moe_a2a_active_rank_mask([0], ep)) \
        if setup == "peer_masked" else {}
    ids = [torch.randint(0, E, (T, k), dtype=torch.int32, generator=gen).to(device) for _ in range(ep)]
    x = [torch.randn(T, H, generator=gen).to(torch.bfloat16).to(device) for _ in range(ep)]
    # Rank 1, masked off, calls nothing.
    each = sim.run if setup == "ep1" else (lambda fn: [fn(0)])

    got = each(lambda r: a2a.moe_a2a_dispatch_expert_major(ids[r], [x[r]], sim.workspace, sim.metainfo[r], T, r, ep,
                                                            k, E, **mask))
    each(lambda r: a2a.moe_a2a_combine_expert_major(got[r].output_payloads[0].clone() + 5, got[r], sim.workspace,
                                                    sim.metainfo[r], r, ep, **mask))
    message = "after a combine of the same dispatch that staged its payload"
    if device == "cpu":
        text = refused(sim.workspace, lambda: a2a.moe_a2a_combine_expert_major(
            _em_in_place(sim, got[0], 0), got[0], sim.workspace, sim.metainfo[0], 0, ep, payload_in_workspace=True,
            **mask), ValueError, message, "pass the payload as a tensor")
        assert re.match(REGION_STAGED, text), text
        return
    # On CUDA the kernel refuses at once (it waits for no peer) and records it.
    each(lambda r: a2a.moe_a2a_combine_expert_major(_em_in_place(sim, got[r], r), got[r], sim.workspace,
                                                    sim.metainfo[r], r, ep, payload_in_workspace=True, **mask))
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match=message):
        a2a.check_errors(sim.workspace)


@pytest.mark.parametrize("layout_kind", ["rank-major", "expert-major"])
def test_an_output_sharing_memory_with_the_payload_is_refused(layout_kind, device):
    """The pull reads payload rows after it stored the first outputs (the own
    rows from the payload tensor itself): an output= that overlaps the payload
    summed what it had written. Refused, the workspace untouched."""
    T, H, k, E = 4, 8, 2, 4
    gen = make_generator(("aliased output", layout_kind))
    ids = torch.tensor([[-1, -1], [0, 1], [2, 3], [1, 1]], dtype=torch.int32).to(device)
    x = torch.randn(T, H, generator=gen).to(device)
    if layout_kind == "rank-major":
        size = a2a.moe_a2a_get_workspace_size_per_rank(1, T, H * 4, H * 4)
        sim = a2a.SimulatedEP(1, T, dispatch_bytes_per_token=0, combine_bytes_per_token=0, device=device,
                              workspace_size_per_rank=size)
        (rx,), off, _ = a2a.moe_a2a_dispatch(ids, [x], sim.workspace, sim.metainfo[0], T, 0, 1, k, E)
        payload = rx.clone()

        def combine(output):
            return a2a.moe_a2a_combine(payload, T, sim.workspace, sim.metainfo[0], T, 0, 1, k, off, output=output)
    else:
        size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(1, T, H * 4, H * 4, E, k)
        sim = a2a.SimulatedEP(1, T, dispatch_bytes_per_token=0, combine_bytes_per_token=0, device=device,
                              workspace_size_per_rank=size)
        got = a2a.moe_a2a_dispatch_expert_major(ids, [x], sim.workspace, sim.metainfo[0], T, 0, 1, k, E)
        payload = got.output_payloads[0].clone()

        def combine(output):
            return a2a.moe_a2a_combine_expert_major(payload, got, sim.workspace, sim.metainfo[0], 0, 1, output=output)

    message = f"output must not share memory with {'the payload' if layout_kind == 'rank-major' else 'expert_outputs'}"
    refused(sim.workspace, lambda: combine(payload.view(-1, H)[:T]), ValueError, message)
    # The same memory through another storage object (DLPack; NumPy's
    # from_numpy makes one too): the payload's first rows, and rows that
    # overlap only its last one (the payload inside a larger buffer).
    n = payload.numel()
    buffer = torch.zeros(n + T * H, dtype=payload.dtype, device=device)
    buffer[:n].copy_(payload.view(-1))
    payload = buffer[:n].view(payload.shape)
    alias = from_dlpack(to_dlpack(buffer))
    assert alias.untyped_storage()._cdata != buffer.untyped_storage()._cdata
    refused(sim.workspace, lambda: combine(alias[:T * H].view(T, H)), ValueError, message)
    refused(sim.workspace, lambda: combine(alias[n - H:n - H + T * H].view(T, H)), ValueError, message)
    assert combine(alias[n:].view(T, H)).data_ptr() == buffer[n:].data_ptr()  # the bytes after it: apart
    out = combine(torch.empty(T, H, device=device))
    assert tuple(out.shape) == (T, H)


def test_expert_major_combine_of_an_earlier_dispatch_names_the_dispatch(device):
    """An expert-major combine given an earlier round's ExpertMajorDispatch
    (another max_tokens_per_expert) with this round's expert outputs was
    refused blaming the outputs' shape alone; the message now says which
    argument sets the shape. The round then closes with its own dispatch."""
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(1, 8, 128, 128, 4, 2)
    ws = torch.zeros(1, size, dtype=torch.uint8, device=device)
    meta = a2a.moe_a2a_initialize(ws, 0, 1, 8)
    gen = make_generator("expert-major combine, earlier dispatch")
    x = torch.randn((4, 32), generator=gen).to(device)
    ids = torch.randint(0, 4, (4, 2), generator=gen, dtype=torch.int32).to(device)
    old = a2a.moe_a2a_dispatch_expert_major(ids, [x], ws, meta, 8, 0, 1, 2, 4, max_tokens_per_expert=2)
    a2a.moe_a2a_combine_expert_major(old.output_payloads[0].clone(), old, ws, meta, 0, 1)
    new = a2a.moe_a2a_dispatch_expert_major(ids, [x], ws, meta, 8, 0, 1, 2, 4)
    assert new.max_tokens_per_expert != old.max_tokens_per_expert
    refused(ws, lambda: a2a.moe_a2a_combine_expert_major(new.output_payloads[0].clone(), old, ws, meta, 0, 1),
            ValueError, "expert_outputs must be [num_local_experts, max_tokens_per_expert, *row_shape]",
            "(max_tokens_per_expert is the ExpertMajorDispatch's given: where these are the outputs of the last "
            "dispatch's experts, pass that dispatch's ExpertMajorDispatch)")
    out = a2a.moe_a2a_combine_expert_major(new.output_payloads[0].clone(), new, ws, meta, 0, 1)
    assert torch.equal(out, x + x)  # identity experts, both pairs of each token kept, no weights
