"""CUDA-only tests: what the device grid of the other files (every test there
also runs with device="cuda") does not cover.

- large simulated exchanges (FlashInfer's DeepSeek-V3 shape and the ep 4 x 1024
  tokens case it cannot run): the persistent grids of all ranks must be
  co-resident (no deadlock) and the results bitwise equal to the reference;
- the CUDA backend bitwise equal to the CPU backend on the same inputs;
- programmatic dependent launch on and off, with our kernels back to back;
- torch.library.opcheck with CUDA tensors and enable_pdl=True, alloc_mailbox included;
- CUDA-graph capture of a full round trip of every simulated rank, replayed
  with fresh inputs, and torch.compile(mode="reduce-overhead");
- the error paths that only exist on CUDA: the host mailbox, a timeout that
  must not hang the host or kill the context, misuse detected on the device.

Simulated ranks share one GPU and one host thread, so nothing may make the
host wait for the device (a synchronize; possibly also a first-time kernel
load, which can need a context synchronization under CUDA lazy loading, or a
cudaMalloc) while a rank's kernel waits for a peer the host has not launched
yet. The tests launch one op on every rank before anything else
(SimulatedEP.dispatch / .combine), or run the exact sequence step by step
first and preallocate every buffer before launching it back to back.
"""

from __future__ import annotations

import ctypes
import logging
import re
import time
import warnings
from typing import Optional

import pytest
import torch
from conftest import (
    Case,
    PayloadSpec,
    assert_bytes_equal,
    combine_payload_in_workspace,
    ep_mapping,
    header_i32,
    make_generator,
    make_inputs,
    make_sim,
    poison_padding,
    round_trip,
)

import torch_moe_a2a as a2a
from torch_moe_a2a import layout, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = "cuda"
ops = torch.ops.moe_a2a

# Bound on every wait for a peer here: a broken protocol fails in seconds
# instead of the suite's 20 s, and no legitimate wait comes near it.
TIMEOUT_S = 10.0
TIMEOUT_FROM_ENV = -1.0  # the ops' timeout_s meaning "read MOE_A2A_TIMEOUT_S"
PAYLOAD_NAMES = ("hidden", "expert ids", "router weights")


# ---- comparisons on the device ------------------------------------------------------------------


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    # reshape(-1) first: a size-1 dimension may carry any stride, which view(uint8) refuses.
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same shape, dtype and bytes, compared on ``actual``'s device (a CPU copy only on failure)."""
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if not torch.equal(_flat_bytes(actual), _flat_bytes(expected.to(actual.device))):
        assert_bytes_equal(actual, expected, what)  # names the first differing byte
        raise AssertionError(f"{what}: bytes differ")


def assert_valid_rows_equal(got: torch.Tensor, expected: torch.Tensor, counts: torch.Tensor, what: str) -> None:
    """Rows ``[s, j]`` with ``j < counts[s]`` of two ``[ep_size, T, *]`` tensors hold the same bytes
    (padding rows are unspecified); compared on ``got``'s device."""
    assert tuple(got.shape) == tuple(expected.shape), f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype} != {expected.dtype}"
    ep, T = got.shape[:2]
    device = got.device
    a = _flat_bytes(got).view(ep, T, -1)
    b = _flat_bytes(expected.to(device)).view(ep, T, -1)
    valid = torch.arange(T, device=device)[None, :] < counts.to(device).long()[:, None]
    bad = (a != b).any(dim=-1) & valid
    if bool(bad.any()):
        s, j = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} valid rows differ, the first is row {j} from rank {s}")


def mailbox_words(metainfo: torch.Tensor):
    """The rank's host error mailbox (pinned memory the kernels write), as int64 words indexed
    like metainfo from META_MAILBOX_CODE: [code, missing words..., timeout_ms]."""
    address = int(metainfo[layout.META_MAILBOX_ADDR])
    assert address != 0, "a CUDA workspace's metainfo must hold a mailbox address"
    count = layout.META_MAILBOX_DETAIL - layout.META_MAILBOX_CODE + 1
    return (ctypes.c_int64 * count).from_address(address)


def _mailbox_record(metainfo: torch.Tensor) -> tuple[int, list[int], int]:
    words = mailbox_words(metainfo)
    first_missing = layout.META_MAILBOX_MISSING - layout.META_MAILBOX_CODE
    missing = [w % (1 << 64) for w in words[first_missing : first_missing + layout.MOE_A2A_RANK_MASK_WORDS]]
    return words[0], missing, words[layout.META_MAILBOX_DETAIL - layout.META_MAILBOX_CODE]


# ---- large simulated exchanges -------------------------------------------------------------------

HIDDEN = 7168  # DeepSeek-V3
TOP_K = 8
EXPERTS = 256


@pytest.mark.parametrize(
    "ep, tokens, preallocated_output, payload_in_workspace",
    [(8, 4096, True, False), (4, 1024, False, False), (8, 1, False, False), (8, 128, False, True)],
    ids=["ep8-4096tok", "ep4-1024tok", "ep8-1tok", "ep8-128tok-in-ws"],
)
def test_large_round_trips_equal_reference(ep, tokens, preallocated_output, payload_in_workspace):
    """Two rounds of dispatch -> toy MoE -> combine of hidden 7168 bf16, top-8 of 256
    experts, on ep_size streams of one GPU: receive counts, valid receive rows and
    combine outputs bitwise equal to the reference (run on the GPU). The first case
    gives combine preallocated outputs (combine_into), the others let it allocate.
    The last one writes the expert outputs into the workspace (payload_in_workspace):
    its combine claims pull tasks (one counter serves an ep-8 grid) and prefetches
    its own region's first rows; the second round finds the claim counter reset."""
    sim = a2a.SimulatedEP(
        ep,
        tokens,
        dispatch_bytes_per_token=HIDDEN * 2 + TOP_K * 4 + TOP_K * 4,
        combine_bytes_per_token=HIDDEN * 2,
        device=CUDA,
        timeout_s=TIMEOUT_S,
    )
    gen = torch.Generator(device=CUDA).manual_seed(1000 * ep + tokens)
    for round_ in range(2):
        ids = [reference.random_routing(tokens, TOP_K, EXPERTS, gen) for _ in range(ep)]
        payloads = [
            [
                torch.randn((tokens, HIDDEN), generator=gen, device=CUDA, dtype=torch.bfloat16),
                ids[r],
                torch.rand((tokens, TOP_K), generator=gen, device=CUDA) + 0.5,
            ]
            for r in range(ep)
        ]
        results = sim.dispatch(ids, payloads, tokens, TOP_K, EXPERTS)
        ref = reference.reference_dispatch(
            ids, payloads, ep_size=ep, num_experts=EXPERTS, runtime_max_tokens_per_rank=tokens
        )
        for d in range(ep):
            counts = sim.recv_counts(d)
            assert torch.equal(counts, ref.recv_counts[d]), (
                f"round {round_} rank {d}: recv counts {counts.tolist()} != reference {ref.recv_counts[d].tolist()}"
            )
            for i, name in enumerate(PAYLOAD_NAMES):
                assert_valid_rows_equal(results[d][0][i], ref.recv[d][i], counts, f"round {round_} rank {d} {name}")
        expert_out = [
            reference.toy_moe(*results[d][0], sim.recv_counts(d), ep_rank=d, ep_size=ep, num_experts=EXPERTS)
            for d in range(ep)
        ]
        kwargs = {}
        if preallocated_output:
            kwargs["output"] = [torch.empty((tokens, HIDDEN), dtype=torch.bfloat16, device=CUDA) for _ in range(ep)]
        combine_payloads = expert_out
        if payload_in_workspace:
            combine_payloads = [
                combine_payload_in_workspace(sim, d, results[d][1], (ep, tokens, HIDDEN), torch.bfloat16, expert_out[d])
                for d in range(ep)
            ]
            kwargs["payload_in_workspace"] = True
        outs = sim.combine(combine_payloads, [tokens] * ep, tokens, TOP_K, [res[1] for res in results], **kwargs)
        expected = reference.reference_combine(expert_out, ref, [tokens] * ep)
        for r in range(ep):
            assert_same_bytes(outs[r], expected[r], f"round {round_} rank {r} combine output")
        del results, ref, expert_out, combine_payloads, outs, expected
    a2a.check_errors(sim.workspace)


# ---- CUDA equals CPU ------------------------------------------------------------------------------

CROSS_CASES = [
    # top_k 22 (the maximum), fp16 hidden, fp8 / 3-D fp32 / 3-byte rows, a rank with no tokens, bad ids
    (
        Case(4, (9, 0, 14, 5), 22, 40, hidden=96, hidden_dtype=torch.float16, runtime_max=16,
             invalid_fraction=0.1, negative_fraction=0.1,
             extras=(PayloadSpec(torch.float8_e4m3fn, (32,)), PayloadSpec(torch.float32, (2, 3)),
                     PayloadSpec(torch.uint8, (3,)))),
        None,
    ),
    # top_k 1, fp32 hidden combined into bf16, runtime_max below max_num_tokens, 7-byte fp8 rows
    (
        Case(3, (0, 17, 1), 1, 3, hidden=40, hidden_dtype=torch.float32, runtime_max=20, max_num_tokens=24,
             extras=(PayloadSpec(torch.float8_e5m2, (7,)), PayloadSpec(torch.int64, (1,)))),
        torch.bfloat16,
    ),
    # five ranks, two of them without tokens, uneven expert ranges (67 experts)
    (
        Case(5, (33, 0, 0, 12, 64), 8, 67, hidden=200, extras=(PayloadSpec(torch.int16, (5, 2)),)),
        None,
    ),
]


def _route_entries(sim: a2a.SimulatedEP, rank: int, case: Case, n: int) -> list[list[int]]:
    """The route entries (protocol.h) the last dispatch of ``rank`` wrote for each of its ``n``
    tokens, up to the kRouteEnd terminator."""
    offset = layout.call_layout(case.ep_size, case.T, 0, [s.row_bytes for s in case.payload_specs()]).route_offset
    table = layout.region_view(sim.workspace[rank], offset, (case.T, layout.MAX_TOP_K), torch.int32).cpu()
    routes = []
    for row in table[:n].tolist():
        end = row.index(layout.ROUTE_END) if layout.ROUTE_END in row else len(row)
        routes.append(row[:end])
    return routes


def _backend_round(sim: a2a.SimulatedEP, case: Case, inputs, expert_out, output_dtype) -> dict:
    """One dispatch -> combine on every rank of ``sim``; everything observable, as CPU copies."""
    dev = inputs.to(sim.device)
    tokens = [int(t.shape[0]) for t in inputs.ids]
    results = sim.dispatch(dev.ids, dev.payloads, case.T, case.top_k, case.num_experts)
    ep = case.ep_size
    observed = dict(
        recv=[[v.cpu().clone() for v in res[0]] for res in results],
        counts=[sim.recv_counts(r).cpu().clone() for r in range(ep)],
        invalid=[int(a2a.moe_a2a_get_invalid_expert_count(sim.workspace, sim.metainfo[r], r)) for r in range(ep)],
        routes=[_route_entries(sim, r, case, tokens[r]) for r in range(ep)],
    )
    outs = sim.combine([e.to(sim.device) for e in expert_out], tokens, case.T, case.top_k,
                       [res[1] for res in results], output_dtype=output_dtype)
    observed["outs"] = [o.cpu() for o in outs]
    return observed


@pytest.mark.parametrize("case, output_dtype", CROSS_CASES, ids=[str(c) for c, _ in CROSS_CASES])
def test_cuda_equals_cpu(case, output_dtype):
    """The same two rounds on a CPU and a CUDA SimulatedEP: identical receive counts, valid
    receive rows, route entries, invalid-id counts and combine outputs, and both equal to
    the reference. The expert outputs (reference toy MoE, random padding rows) are computed
    once and fed to both backends."""
    gen = make_generator(case)
    sims = {device: make_sim(case, device, timeout_s=TIMEOUT_S) for device in ("cpu", CUDA)}
    invalid_total = [0] * case.ep_size
    for round_ in range(2):
        inputs = make_inputs(case, gen)
        tokens = [int(t.shape[0]) for t in inputs.ids]
        ref = reference.reference_dispatch(inputs.ids, inputs.payloads, ep_size=case.ep_size,
                                           num_experts=case.num_experts, runtime_max_tokens_per_rank=case.T)
        invalid_total = [a + b for a, b in zip(invalid_total, ref.invalid_counts)]
        expert_out = [
            poison_padding(
                reference.toy_moe(*ref.recv[r][:3], ref.recv_counts[r], ep_rank=r, ep_size=case.ep_size,
                                  num_experts=case.num_experts),
                ref.recv_counts[r],
                gen,
            )
            for r in range(case.ep_size)
        ]
        got = {device: _backend_round(sim, case, inputs, expert_out, output_dtype) for device, sim in sims.items()}
        cpu, cuda = got["cpu"], got[CUDA]
        expected = reference.reference_combine(expert_out, ref, tokens, output_dtype=output_dtype)
        for r in range(case.ep_size):
            where = f"round {round_} rank {r}"
            assert torch.equal(cuda["counts"][r], cpu["counts"][r]), (
                f"{where}: CUDA recv counts {cuda['counts'][r].tolist()} != CPU {cpu['counts'][r].tolist()}"
            )
            assert torch.equal(cpu["counts"][r], ref.recv_counts[r]), f"{where}: CPU recv counts != reference"
            for i, (view_cuda, view_cpu) in enumerate(zip(cuda["recv"][r], cpu["recv"][r])):
                assert_valid_rows_equal(view_cuda, view_cpu, cpu["counts"][r], f"{where} payload {i}: CUDA vs CPU")
                assert_valid_rows_equal(view_cpu, ref.recv[r][i], cpu["counts"][r], f"{where} payload {i}: CPU vs ref")
            assert cuda["invalid"][r] == cpu["invalid"][r] == invalid_total[r], (
                f"{where}: invalid expert counts CUDA {cuda['invalid'][r]}, CPU {cpu['invalid'][r]}, "
                f"reference {invalid_total[r]}"
            )
            ref_routes = [[(d << layout.ROUTE_RANK_SHIFT) | slot for d, slot in pairs] for pairs in ref.routes[r]]
            assert cpu["routes"][r] == ref_routes, f"{where}: CPU route entries differ from the reference"
            assert cuda["routes"][r] == cpu["routes"][r], f"{where}: CUDA route entries differ from the CPU's"
            assert_bytes_equal(cpu["outs"][r], expected[r], f"{where}: CPU combine output vs reference")
            assert_bytes_equal(cuda["outs"][r], cpu["outs"][r], f"{where}: CUDA combine output vs CPU")
    for sim in sims.values():
        a2a.check_errors(sim.workspace)


# ---- programmatic dependent launch ---------------------------------------------------------------

# PDL is used with any number of simulated ranks (register.cpp: a kernel lets
# its dependents launch only after its last wait, so a dependent's waiting CTAs
# never hold slots a peer needs). Back to back, a rank's kernels really follow
# each other on its stream. Per rank count: the case, then every round's
# tokens per rank (one rank sends nothing in the last round of the multi-rank cases).
PDL_CASES = {
    1: (Case(1, (20,), 3, 9, hidden=128, runtime_max=24, extras=(PayloadSpec(torch.float8_e4m3fn, (16,)),)),
        [(20,), (24,), (1,)]),
    3: (Case(3, (20, 7, 24), 3, 9, hidden=128, runtime_max=24,
             extras=(PayloadSpec(torch.float8_e4m3fn, (16,)),)),
        [(20, 7, 24), (24, 24, 1), (1, 0, 13)]),
    8: (Case(8, (24,) * 8, 4, 32, hidden=256, runtime_max=24), [(24,) * 8, (5, 24, 1, 7, 0, 3, 24, 11), (1,) * 8]),
}
INVALID_ID = -7


def _pdl_rounds(case, rounds, fixed_payloads, *, enable_pdl: bool, back_to_back: bool) -> dict:
    """Three rounds on a fresh SimulatedEP with every op's enable_pdl set.

    Round 0 and 2: dispatch, sanitize_expert_ids, copy the receive views, a stand-in MoE
    (hidden * 2, exact), combine. Round 1: dispatch then combine of fixed payloads, so
    that combine 0 -> dispatch 1 -> combine 1 -> dispatch 2 -> sanitize follow each
    other directly on a rank's stream (the dependent-launch edges). back_to_back: each
    rank enqueues all of its rounds at once (no host step between ops); otherwise each
    step runs on every rank before the next one. Every buffer is allocated up front, so
    that nothing allocates while a rank's kernel waits for a peer not yet launched.
    Returns CPU copies: snapshots [round][rank][payload], counts [round][rank], expert
    outputs [round][rank], combine outputs [round][rank].
    """
    ep, T = case.ep_size, case.T
    sim = make_sim(case, CUDA, timeout_s=TIMEOUT_S)
    dev = [x.to(CUDA) for x in rounds]
    fixed = [p.to(CUDA) for p in fixed_payloads]
    specs = case.payload_specs()
    snaps = [[[torch.empty((ep, T, *s.trailing), dtype=s.dtype, device=CUDA) for s in specs] for _ in range(ep)]
             for _ in rounds]
    counts = [[torch.empty(ep, dtype=torch.int32, device=CUDA) for _ in range(ep)] for _ in rounds]
    experts = [[torch.empty((ep, T, case.hidden), dtype=case.hidden_dtype, device=CUDA) for _ in range(ep)]
               for _ in rounds]
    outs = [[torch.empty((int(t.shape[0]), case.hidden), dtype=case.hidden_dtype, device=CUDA) for t in x.ids]
            for x in rounds]
    state: list = [None] * ep  # per rank: (receive views, combine_payload_offset) of its last dispatch

    def dispatch(k):
        def step(r):
            x = dev[k]
            views, offset, _ = a2a.moe_a2a_dispatch(x.ids[r], x.payloads[r], sim.workspace, sim.metainfo[r], T, r,
                                                    ep, case.top_k, case.num_experts, enable_pdl=enable_pdl)
            state[r] = (views, offset)
        return step

    def sanitize(r):
        a2a.moe_a2a_sanitize_expert_ids(state[r][0][1], sim.workspace, sim.metainfo[r], r, INVALID_ID,
                                        enable_pdl=enable_pdl)

    def snapshot(k):
        def step(r):
            for dst, view in zip(snaps[k][r], state[r][0]):
                dst.copy_(view)
            counts[k][r].copy_(sim.recv_counts(r))
        return step

    def moe(k):
        def step(r):
            torch.mul(state[r][0][0], 2, out=experts[k][r])
        return step

    def combine(k, payloads):
        def step(r):
            a2a.moe_a2a_combine(payloads[r], int(dev[k].ids[r].shape[0]), sim.workspace, sim.metainfo[r], T, r, ep,
                                case.top_k, state[r][1], output=outs[k][r], enable_pdl=enable_pdl)
        return step

    steps = [dispatch(0), sanitize, snapshot(0), moe(0), combine(0, experts[0]),
             dispatch(1), combine(1, fixed),
             dispatch(2), sanitize, snapshot(2), moe(2), combine(2, experts[2])]
    if back_to_back:
        sim.run(lambda r: [step(r) for step in steps])
    else:
        for step in steps:
            sim.run(step)
    torch.cuda.synchronize()
    a2a.check_errors(sim.workspace)

    def to_cpu(nested):
        return [to_cpu(x) for x in nested] if isinstance(nested, list) else nested.cpu()

    return dict(snaps=to_cpu(snaps), counts=to_cpu(counts), experts=to_cpu(experts), outs=to_cpu(outs))


@pytest.mark.parametrize("ep", sorted(PDL_CASES))
def test_pdl_on_and_off_give_identical_results(ep):
    """Step by step without PDL (which also loads every kernel the back-to-back runs use),
    then back to back with PDL on and off: all three bitwise equal, and equal to the
    reference (receive rows, counts, sanitized padding, combine outputs)."""
    case, tokens = PDL_CASES[ep]
    gen = make_generator(f"pdl-{ep}")
    rounds = [make_inputs(case, gen, t) for t in tokens]
    fixed = [torch.randn((case.ep_size, case.T, case.hidden), generator=gen).to(case.hidden_dtype)
             for _ in range(case.ep_size)]
    runs = {
        "step by step, PDL off": _pdl_rounds(case, rounds, fixed, enable_pdl=False, back_to_back=False),
        "back to back, PDL on": _pdl_rounds(case, rounds, fixed, enable_pdl=True, back_to_back=True),
        "back to back, PDL off": _pdl_rounds(case, rounds, fixed, enable_pdl=False, back_to_back=True),
    }
    refs = [reference.reference_dispatch(x.ids, x.payloads, ep_size=case.ep_size, num_experts=case.num_experts,
                                         runtime_max_tokens_per_rank=case.T) for x in rounds]
    baseline = runs["step by step, PDL off"]
    for name, run in runs.items():
        for k, (x, ref) in enumerate(zip(rounds, refs)):
            tokens = [int(t.shape[0]) for t in x.ids]
            payloads = fixed if k == 1 else run["experts"][k]
            expected = reference.reference_combine(payloads, ref, tokens)
            for r in range(case.ep_size):
                where = f"{name}, round {k} rank {r}"
                assert_bytes_equal(run["outs"][k][r], expected[r], f"{where}: combine output vs reference")
                assert_bytes_equal(run["outs"][k][r], baseline["outs"][k][r], f"{where}: combine output vs baseline")
                if k == 1:
                    continue  # round 1 keeps no snapshot
                got_counts = run["counts"][k][r]
                assert torch.equal(got_counts, ref.recv_counts[r]), f"{where}: recv counts {got_counts.tolist()}"
                for i, view in enumerate(run["snaps"][k][r]):
                    assert_valid_rows_equal(view, ref.recv[r][i], got_counts, f"{where} payload {i}")
                ids = run["snaps"][k][r][1]
                padding = torch.arange(case.T)[None, :] >= got_counts.long()[:, None]
                assert (ids[padding] == INVALID_ID).all(), f"{where}: sanitize left padding ids unchanged"


# ---- opcheck with CUDA tensors --------------------------------------------------------------------

# fp8 payloads are left out, as in test_opcheck.py: SchemaCheckMode compares with ops that lack fp8 kernels.
OPCHECK_CASE = Case(1, (5,), 3, 6, hidden=64, runtime_max=8, max_num_tokens=8,
                    extras=(PayloadSpec(torch.uint8, (16,)), PayloadSpec(torch.float32, (2, 3))))
OPCHECK_EPLB = 4
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                 "test_aot_dispatch_dynamic")
# alloc_mailbox returns a fresh host address on every call, so no two calls (eager or
# traced) can agree; it is called by moe_a2a_initialize, never inside a traced region.
ALLOC_MAILBOX_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _opcheck_args(op_name: str):
    """(op, args, metainfo) of ``op_name`` on a single-rank CUDA workspace with
    enable_pdl=True (metainfo is None for alloc_mailbox). Ops that need a dispatched
    workspace get one dispatch run for real first; every opcheck utility then runs the
    op on copies of the arguments, each starting from that state."""
    case = OPCHECK_CASE
    size = a2a.moe_a2a_get_workspace_size_per_rank(1, case.max_tokens, case.dispatch_bytes, case.combine_bytes,
                                                   OPCHECK_EPLB)
    workspace = torch.zeros(1, size, dtype=torch.uint8, device=CUDA)
    if op_name == "alloc_mailbox":
        return ops.alloc_mailbox.default, (workspace,), None
    metainfo = a2a.moe_a2a_initialize(workspace, 0, 1, case.max_tokens, OPCHECK_EPLB)
    mailbox = int(metainfo[layout.META_MAILBOX_ADDR])
    if op_name == "initialize":
        return ops.initialize.default, (workspace, 0, 1, case.max_tokens, OPCHECK_EPLB, mailbox), metainfo
    inputs = make_inputs(case, make_generator("opcheck")).to(CUDA)
    eplb = torch.arange(1, OPCHECK_EPLB + 1, dtype=torch.int32, device=CUDA)
    dispatch_args = (inputs.ids[0], inputs.payloads[0], workspace, 0, 1, case.max_tokens, case.T, case.top_k,
                     case.num_experts, eplb, OPCHECK_EPLB, [], TIMEOUT_FROM_ENV, mailbox, True)
    if op_name == "dispatch":
        return ops.dispatch.default, dispatch_args, metainfo
    ops.dispatch.default(*dispatch_args)
    call = layout.call_layout(1, case.T, OPCHECK_EPLB, [s.row_bytes for s in case.payload_specs()])
    if op_name == "sanitize_expert_ids":
        ids_offset = call.payload_offsets[1]  # payload 1 carries the expert ids
        args = (workspace, 0, 1, case.max_tokens, case.T, ids_offset, case.top_k, -1, 4, mailbox, True)
        return ops.sanitize_expert_ids.default, args, metainfo
    payload = torch.randn(1, case.T, case.hidden, generator=make_generator("opcheck payload"))
    payload = payload.to(case.hidden_dtype).to(CUDA)
    combine_args = (payload, case.tokens[0], workspace, 0, 1, case.max_tokens, case.T, case.top_k,
                    call.combine_offset, [case.hidden], case.hidden_dtype, case.hidden_dtype, [], TIMEOUT_FROM_ENV,
                    mailbox, True, 0, None, 1.0, int(a2a.SfLayout.layout_linear))
    if op_name == "combine":
        return ops.combine.default, combine_args, metainfo
    assert op_name == "combine_into"
    output = torch.empty(case.tokens[0], case.hidden, dtype=case.hidden_dtype, device=CUDA)
    return ops.combine_into.default, (*combine_args, output), metainfo


@pytest.mark.parametrize("op_name", ["alloc_mailbox", "initialize", "dispatch", "combine", "combine_into",
                                     "sanitize_expert_ids"])
def test_opcheck_cuda(op_name):
    """opcheck with CUDA tensors and enable_pdl=True (the device grid of test_opcheck.py
    runs it with enable_pdl=False). The copies share the rank's host mailbox: no kernel
    of any copy may have recorded an error there."""
    op, args, metainfo = _opcheck_args(op_name)
    utils = ALLOC_MAILBOX_UTILS if op_name == "alloc_mailbox" else OPCHECK_UTILS
    torch.library.opcheck(op, args, test_utils=utils)
    torch.cuda.synchronize()
    if metainfo is not None:
        assert _mailbox_record(metainfo)[0] == layout.ERROR_NONE, "a kernel run by opcheck recorded an error"


# ---- CUDA graphs -----------------------------------------------------------------------------------

GRAPH_CASE = Case(4, (24, 0, 17, 32), 4, 10, hidden=64, runtime_max=32,
                  extras=(PayloadSpec(torch.float8_e4m3fn, (16,)),))
GRAPH_WARMUP = 3
GRAPH_REPLAYS = 100


def test_cuda_graph_replays_round_trip_of_all_ranks():
    """dispatch -> toy MoE -> combine of all 4 simulated ranks, each rank's step captured
    once into its own graph (SimulatedEP.capture), then replayed GRAPH_REPLAYS times with
    fresh random inputs copied into the static input buffers; every replay's receive
    counts, valid receive rows and combine outputs are checked against the reference."""
    case = GRAPH_CASE
    ep, T, tokens, specs = case.ep_size, case.T, case.tokens, case.payload_specs()
    sim = make_sim(case, CUDA, timeout_s=TIMEOUT_S)
    gen = torch.Generator(device=CUDA).manual_seed(7)
    static_ids = [torch.empty((n, case.top_k), dtype=torch.int32, device=CUDA) for n in tokens]
    static_payloads = [[torch.empty((n, *s.trailing), dtype=s.dtype, device=CUDA) for s in specs] for n in tokens]
    static_outputs = [torch.empty((n, case.hidden), dtype=case.hidden_dtype, device=CUDA) for n in tokens]

    def fill_inputs():
        for r, n in enumerate(tokens):
            ids = reference.random_routing(n, case.top_k, case.num_experts, gen)
            fresh = [
                torch.randn((n, case.hidden), generator=gen, device=CUDA).to(case.hidden_dtype),
                ids,
                torch.rand((n, case.top_k), generator=gen, device=CUDA) + 0.5,
                torch.randint(0, 256, (n, 16), dtype=torch.uint8, generator=gen, device=CUDA).view(specs[3].dtype),
            ]
            static_ids[r].copy_(ids)
            for dst, src in zip(static_payloads[r], fresh):
                dst.copy_(src)

    def check(recv, expert_out, what):
        ref = reference.reference_dispatch(static_ids, static_payloads, ep_size=ep, num_experts=case.num_experts,
                                           runtime_max_tokens_per_rank=T)
        for d in range(ep):
            counts = sim.recv_counts(d)
            assert torch.equal(counts, ref.recv_counts[d]), (
                f"{what}: rank {d} recv counts {counts.tolist()} != reference {ref.recv_counts[d].tolist()}"
            )
            for i in range(len(specs)):
                assert_valid_rows_equal(recv[d][i], ref.recv[d][i], counts, f"{what}: rank {d} payload {i}")
        expected = reference.reference_combine(expert_out, ref, list(tokens))
        for r in range(ep):
            assert_same_bytes(static_outputs[r], expected[r], f"{what}: rank {r} combine output")

    def rank_step(r):
        """Rank r's whole step on its stream, as a rank of a deployment captures it."""
        recv, offset, _ = sim.dispatch_rank(r, static_ids[r], static_payloads[r], T, case.top_k, case.num_experts)
        expert_out = reference.toy_moe(*recv[:3], sim.recv_counts(r), ep_rank=r, ep_size=ep,
                                       num_experts=case.num_experts)
        sim.combine_rank(r, expert_out, tokens[r], T, case.top_k, offset, output=static_outputs[r])
        return recv, expert_out

    # Eager warm-up of the same per-rank step (on a side stream, as before any capture).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(GRAPH_WARMUP):
            fill_inputs()
            results = sim.run(rank_step)
            check([res[0] for res in results], [res[1] for res in results], f"eager warm-up {i}")
    torch.cuda.current_stream().wait_stream(side)

    graphs, captured = sim.capture(rank_step)
    assert len(graphs.graphs) == ep
    recv, expert_out = [c[0] for c in captured], [c[1] for c in captured]
    for i in range(GRAPH_REPLAYS):
        fill_inputs()
        graphs.replay()
        check(recv, expert_out, f"replay {i}")
    torch.cuda.synchronize()
    a2a.check_errors(sim.workspace)


# ---- torch.compile(mode="reduce-overhead") ----------------------------------------------------------
#
# Single rank only. Simulated ranks in one process cannot go through CUDA-graph
# trees: their warm-up and recording call torch.cuda.synchronize() (under a
# process-wide lock), which waits for a rank's kernel that waits for a peer whose
# call has not been made yet, so it deadlocks until the timeout. One process per
# GPU, the real deployment, has no such peer on its device.

COMPILE_CASE = Case(1, (13,), 4, 9, hidden=96, runtime_max=16, max_num_tokens=16)
COMPILE_CALLS = 6  # warm-up, recording, then replays


def _stand_in_moe(recv):
    """Exact in any evaluation order (one multiply per element, one cast), so compiled and
    eager agree bitwise; reads only the receive views (no write into the workspace)."""
    hidden, weights = recv[0], recv[2]
    return (hidden.float() * weights[..., :1]).to(hidden.dtype)


class _CudagraphSkips(logging.Handler):
    """Collects inductor's "skipping cudagraphs due to ..." messages."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _recorded_cudagraphs() -> Optional[int]:
    try:
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        return 0 if manager is None else sum(len(nodes) for nodes in manager.roots.values())
    except Exception:  # noqa: BLE001 - only informative: inductor internals move between releases
        return None


@pytest.mark.parametrize("api", ["MoeAlltoAll", "functional"])
def test_reduce_overhead_compile_equals_eager(api, record_property):
    """A full round trip (dispatch -> stand-in MoE -> combine) under
    torch.compile(mode="reduce-overhead", fullgraph=True) equals eager and the reference
    on every call with fresh inputs. The workspace has a static address: MoeAlltoAll
    marks it; the functional variant calls torch._dynamo.mark_static_address. Whether
    CUDA-graph trees skipped the graph is recorded (a warning and the junit property
    "cudagraphs"), not asserted."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_utils

    torch._dynamo.reset()
    case, T = COMPILE_CASE, COMPILE_CASE.T
    if api == "MoeAlltoAll":
        moe = a2a.MoeAlltoAll(ep_mapping(0, 1), case.max_tokens, case.top_k, case.num_experts,
                              hidden_size=case.hidden, device=CUDA, timeout_s=TIMEOUT_S)

        def step(ids, hidden, weights):
            recv = moe.dispatch(ids, [hidden, ids, weights], T)
            return moe.combine(_stand_in_moe(recv), T)
    else:
        sim = make_sim(case, CUDA, timeout_s=TIMEOUT_S)
        torch._dynamo.mark_static_address(sim.workspace)

        def step(ids, hidden, weights):
            recv, offset, _ = a2a.moe_a2a_dispatch(ids, [hidden, ids, weights], sim.workspace, sim.metainfo[0], T,
                                                   0, 1, case.top_k, case.num_experts)
            return a2a.moe_a2a_combine(_stand_in_moe(recv), ids.shape[0], sim.workspace, sim.metainfo[0], T, 0, 1,
                                       case.top_k, offset)

    skips = _CudagraphSkips()
    cudagraph_utils.cudagraphs_log.addHandler(skips)
    skips_before = counters["inductor"]["cudagraph_skips"]
    try:
        compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
        gen = make_generator(api)
        for i in range(COMPILE_CALLS):
            inputs = make_inputs(case, gen)
            ids, hidden, weights = inputs.ids[0], inputs.payloads[0][0], inputs.payloads[0][2]
            ref = reference.reference_dispatch([ids], [[hidden, ids, weights]], ep_size=1,
                                               num_experts=case.num_experts, runtime_max_tokens_per_rank=T)
            expected = reference.reference_combine([_stand_in_moe(ref.recv[0])], ref, [case.tokens[0]])[0]
            dev = [t.to(CUDA) for t in (ids, hidden, weights)]
            eager = step(*dev).clone()
            torch.compiler.cudagraph_mark_step_begin()
            got = compiled(*dev).clone()  # a CUDA-graph output is overwritten by the next replay
            assert_same_bytes(eager, expected, f"call {i}: eager vs reference")
            assert_same_bytes(got, eager, f"call {i}: compiled vs eager")
    finally:
        cudagraph_utils.cudagraphs_log.removeHandler(skips)
    torch.cuda.synchronize()
    if api == "MoeAlltoAll":
        moe.check()
    else:
        a2a.check_errors(sim.workspace)
    skipped = counters["inductor"]["cudagraph_skips"] - skips_before
    summary = (f"reduce-overhead ({api}): cudagraph skips {skipped}, graphs recorded {_recorded_cudagraphs()}, "
               f"reasons {skips.messages}")
    record_property("cudagraphs", summary)
    warnings.warn(summary)
    torch._dynamo.reset()


# ---- errors that only CUDA reports through the mailbox --------------------------------------------


def test_timeout_does_not_hang_and_is_reported_through_mailbox(monkeypatch):
    """ep 2, MOE_A2A_TIMEOUT_S=1, only rank 0 dispatches: the call returns at once (the
    launch is asynchronous), the device finishes within the timeout, the kernel's error
    record reaches the header and the pinned host mailbox, check_errors and the next op
    on rank 0 raise naming rank 0 and peer [1], and after initialize on both ranks a
    correct round trip runs in the same process (the CUDA context survived)."""
    case = Case(2, (4, 6), 2, 4, runtime_max=6)
    gen = make_generator("cuda timeout")
    sim = make_sim(case, CUDA)  # timeout from the environment, read on every call
    inputs = make_inputs(case, gen)
    dev = inputs.to(CUDA)
    round_trip(sim, case, inputs, gen)  # loads the kernels: the timing below measures the wait only
    torch.cuda.synchronize()

    monkeypatch.setenv("MOE_A2A_TIMEOUT_S", "1")
    pattern = r"rank 0: peers \[1\] did not arrive within 1(\.0)? s \(dispatch\)"

    def dispatch_rank0():
        return a2a.moe_a2a_dispatch(dev.ids[0], dev.payloads[0], sim.workspace, sim.metainfo[0], case.T, 0, 2,
                                    case.top_k, case.num_experts)

    start = time.monotonic()
    _, offset, _ = dispatch_rank0()
    launched = time.monotonic() - start
    torch.cuda.synchronize()
    finished = time.monotonic() - start
    assert launched < 0.5, f"the host waited {launched:.2f} s in a CUDA dispatch (launches must be asynchronous)"
    assert 0.9 <= finished <= 3.0, f"the device needed {finished:.2f} s for a 1 s timeout"

    assert header_i32(sim.workspace, 0, layout.HDR_ERROR_CODE) == layout.ERROR_DISPATCH_TIMEOUT
    assert header_i32(sim.workspace, 1, layout.HDR_ERROR_CODE) == layout.ERROR_NONE, "rank 1 never ran"
    assert _mailbox_record(sim.metainfo[0]) == (layout.ERROR_DISPATCH_TIMEOUT, [1 << 1], 1000)
    assert _mailbox_record(sim.metainfo[1])[0] == layout.ERROR_NONE
    with pytest.raises(RuntimeError, match=pattern):
        a2a.check_errors(sim.workspace)
    # The next op on rank 0 reads the mailbox on the host and refuses to launch.
    with pytest.raises(RuntimeError, match=pattern):
        dispatch_rank0()
    payload = torch.ones(2, case.T, case.hidden, dtype=case.hidden_dtype, device=CUDA)
    with pytest.raises(RuntimeError, match=pattern):
        a2a.moe_a2a_combine(payload, case.tokens[0], sim.workspace, sim.metainfo[0], case.T, 0, 2, case.top_k,
                            offset)

    monkeypatch.setenv("MOE_A2A_TIMEOUT_S", str(TIMEOUT_S))
    for r in range(case.ep_size):
        sim.metainfo[r] = a2a.moe_a2a_initialize(sim.workspace, r, case.ep_size, case.max_tokens)
    a2a.check_errors(sim.workspace)
    round_trip(sim, case, inputs, gen)
    torch.cuda.synchronize()
    a2a.check_errors(sim.workspace)


def test_two_dispatches_in_a_row_are_refused_on_the_device():
    """ep 1: the second dispatch is refused by the kernel, which records kErrorSequence
    (header and mailbox) and writes nothing else; check_errors and the next call raise a
    clear RuntimeError. MoeAlltoAll refuses on the host, before any kernel runs."""
    case = Case(1, (5,), 2, 3, hidden=64, runtime_max=5)
    sim = make_sim(case, CUDA, timeout_s=TIMEOUT_S)
    gen = make_generator("sequence")
    first, second = make_inputs(case, gen).to(CUDA), make_inputs(case, gen).to(CUDA)

    def dispatch(x):
        return a2a.moe_a2a_dispatch(x.ids[0], x.payloads[0], sim.workspace, sim.metainfo[0], case.T, 0, 1,
                                    case.top_k, case.num_experts)

    _, offset, _ = dispatch(first)
    torch.cuda.synchronize()
    before = sim.workspace.cpu()
    dispatch(second)  # the host cannot know yet; the device refuses
    torch.cuda.synchronize()
    after = sim.workspace.cpu()
    record = slice(layout.HDR_ERROR_CODE, layout.HDR_ERROR_MISSING + 8 * layout.MOE_A2A_RANK_MASK_WORDS)
    before[0, record] = after[0, record]
    assert torch.equal(after, before), "a refused dispatch must write nothing but the error record"

    pattern = r"rank 0: every dispatch must be followed by a combine"
    assert header_i32(sim.workspace, 0, layout.HDR_ERROR_CODE) == layout.ERROR_SEQUENCE
    assert _mailbox_record(sim.metainfo[0])[0] == layout.ERROR_SEQUENCE
    with pytest.raises(RuntimeError, match=pattern):
        a2a.check_errors(sim.workspace)
    payload = torch.ones(1, case.T, case.hidden, dtype=case.hidden_dtype, device=CUDA)
    with pytest.raises(RuntimeError, match=pattern):
        a2a.moe_a2a_combine(payload, case.tokens[0], sim.workspace, sim.metainfo[0], case.T, 0, 1, case.top_k, offset)

    moe = a2a.MoeAlltoAll(ep_mapping(0, 1), case.max_tokens, case.top_k, case.num_experts,
                          hidden_size=case.hidden, device=CUDA, timeout_s=TIMEOUT_S)
    moe.dispatch(first.ids[0], first.payloads[0], case.T)
    with pytest.raises(RuntimeError, match=r"dispatch called twice"):
        moe.dispatch(second.ids[0], second.payloads[0], case.T)
    out = moe.combine(payload, case.T)
    torch.cuda.synchronize()
    moe.check()  # the refusal happened on the host: the device saw a correct sequence
    assert tuple(out.shape) == (case.tokens[0], case.hidden)


def test_mailbox_is_host_memory_read_before_each_call():
    """alloc_mailbox returns a distinct non-zero host address per call; initialize stores
    it in metainfo and zeroes it; an error record found there makes the next op raise on
    the host, before it launches anything."""
    case = Case(1, (5,), 2, 3, hidden=64, runtime_max=5)
    sim = make_sim(case, CUDA, timeout_s=TIMEOUT_S)
    addresses = [ops.alloc_mailbox.default(sim.workspace) for _ in range(3)]
    assert all(a != 0 and a % 8 == 0 for a in addresses), addresses
    assert len(set(addresses)) == len(addresses), f"mailboxes must not be shared: {addresses}"
    metainfo = sim.metainfo[0]
    assert int(metainfo[layout.META_MAILBOX_ADDR]) not in (0, *addresses)

    words = mailbox_words(metainfo)
    words[0] = layout.ERROR_SEQUENCE  # what a kernel records on misuse
    inputs = make_inputs(case, make_generator("mailbox")).to(CUDA)
    torch.cuda.synchronize()
    before = sim.workspace.cpu()
    with pytest.raises(RuntimeError, match=r"rank 0: every dispatch must be followed by a combine"):
        a2a.moe_a2a_dispatch(inputs.ids[0], inputs.payloads[0], sim.workspace, metainfo, case.T, 0, 1, case.top_k,
                             case.num_experts)
    torch.cuda.synchronize()
    assert torch.equal(sim.workspace.cpu(), before), "a call refused through the mailbox launched a kernel"

    ops.initialize.default(sim.workspace, 0, 1, case.max_tokens, 0, int(metainfo[layout.META_MAILBOX_ADDR]))
    assert _mailbox_record(metainfo) == (layout.ERROR_NONE, [0] * layout.MOE_A2A_RANK_MASK_WORDS, 0)
    a2a.moe_a2a_dispatch(inputs.ids[0], inputs.payloads[0], sim.workspace, metainfo, case.T, 0, 1, case.top_k,
                         case.num_experts)
    torch.cuda.synchronize()
    a2a.check_errors(sim.workspace)


def test_check_expert_ids_skips_inside_a_graph_capture():
    """MOE_A2A_DEBUG's check reads the ids on the host: eagerly it raises on an
    id >= num_experts; inside a CUDA-graph capture, where the host cannot
    read them, it does nothing (a sync there would break the capture)."""
    ids = torch.tensor([[0, 5], [1, 2]], dtype=torch.int32, device=CUDA)
    with pytest.raises(ValueError, match=re.escape("token_selected_experts[0, 1] = 5 is >= num_experts (4)")):
        ops.check_expert_ids.default(ids, 4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.check_expert_ids.default(ids, 4)
    graph.replay()
    torch.cuda.synchronize()
