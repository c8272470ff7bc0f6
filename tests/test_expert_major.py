"""The expert-major layout: dispatch grouped by local expert with per-expert
counts, and the router-weighted combine from it (DESIGN.md, 'Expert-major
layout'), against the plain-PyTorch reference over a random grid of cases
(ep 1..8, uneven and zero token counts, experts not divisible by ranks, top_k
1..22, overflow, dead ranks), bitwise; and an end-to-end MoE layer (router,
real expert weights applied per expert on the expert-major views, combine)
equal to the dense layer within fp32 rounding."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from conftest import (
    assert_bytes_equal,
    assert_ws_unchanged,
    ep_mapping,
    make_generator,
    poison_call_regions,
    random_tensor,
    random_values,
    ws_snapshot,
)

import torch_moe_a2a as a2a
from torch_moe_a2a import expert_major, layout, reference


@dataclass(frozen=True)
class EmCase:
    ep_size: int
    tokens: tuple[int, ...]
    top_k: int
    num_experts: int
    hidden: int = 32
    hidden_dtype: torch.dtype = torch.bfloat16
    max_tokens_per_expert: Optional[int] = None  # None: the default (worst case)
    weights: bool = True
    ids_int64: bool = False
    extra: int = 1  # payloads of random bytes after the hidden state, the j-th 7 + j bytes a token
    active: Optional[tuple[int, ...]] = None  # None: every rank
    output_dtype: Optional[torch.dtype] = None
    in_workspace: bool = False
    repeats: bool = False  # ids drawn with replacement (a token names an expert in several slots)

    @property
    def T(self) -> int:
        return max(1, max(self.tokens))

    @property
    def M(self) -> int:
        if self.max_tokens_per_expert is not None:
            return self.max_tokens_per_expert
        return a2a.expert_major.default_max_tokens_per_expert(self.ep_size, self.T, self.top_k,
                                                               self.num_experts)

    @property
    def user_bytes(self) -> int:
        return self.hidden * self.hidden_dtype.itemsize + sum(7 + j for j in range(self.extra))

    def __str__(self) -> str:
        return (f"ep{self.ep_size}-tok{'_'.join(map(str, self.tokens))}-k{self.top_k}-E{self.num_experts}"
                f"-M{self.max_tokens_per_expert}-w{int(self.weights)}-i64{int(self.ids_int64)}"
                f"-act{self.active}-ws{int(self.in_workspace)}{'-rep' if self.repeats else ''}"
                f"{'' if self.extra == 1 else f'-x{self.extra}'}")


def _grid(count: int, seed: int) -> list[EmCase]:
    rnd = random.Random(seed)
    cases = []
    for n in range(count):
        ep = rnd.choice([1, 2, 3, 4, 5, 8])
        tokens = tuple(rnd.choice([0, 1, 3, 7, 16, 29]) for _ in range(ep))
        top_k = rnd.choice([1, 2, 4, 6, 8, 13, 22])
        num_experts = ep * rnd.choice([1, 2, 3]) + rnd.randrange(0, ep)  # often not divisible
        num_experts = max(num_experts, ep, top_k)  # distinct experts (GRID's repeats cases have fewer)
        T = max(1, max(tokens))
        overflow = n % 3 == 1
        M = max(1, (ep * T) // rnd.choice([4, 8, 16])) if overflow else None
        active = None
        if ep >= 3 and n % 5 == 4:
            dead = rnd.randrange(ep)
            active = tuple(r for r in range(ep) if r != dead)
        cases.append(EmCase(ep, tokens, top_k, num_experts, max_tokens_per_expert=M, weights=n % 4 != 3,
                            ids_int64=n % 6 == 5, active=active, output_dtype=torch.float32 if n % 7 == 6 else None,
                            in_workspace=n % 2 == 1, hidden_dtype=torch.float16 if n % 8 == 7 else torch.bfloat16))
    return cases


GRID = [
    EmCase(1, (5,), 2, 3),
    EmCase(2, (0, 0), 3, 5),  # nobody sends anything
    EmCase(3, (4, 0, 9), 22, 40, max_tokens_per_expert=2),  # top_k 22, heavy overflow
    EmCase(8, (3, 1, 0, 7, 2, 5, 0, 4), 8, 20, active=(0, 1, 2, 4, 5, 6, 7)),
    EmCase(2, (5, 3), 6, 2, repeats=True),  # fewer experts than top_k: every token repeats one
    EmCase(3, (4, 0, 6), 22, 3, max_tokens_per_expert=5, repeats=True, in_workspace=True),
    EmCase(3, (7, 2, 4), 6, 2051, max_tokens_per_expert=2),  # beyond 1024 experts: on CUDA dispatch + build
    # The most payloads (the ids and the weights travel as two more): the
    # one-kernel call on CUDA, then dispatch + build.
    EmCase(3, (4, 0, 6), 5, 9, extra=layout.MAX_PAYLOADS - 1, ids_int64=True),
    EmCase(3, (5, 3, 0), 3, 2051, max_tokens_per_expert=3, extra=layout.MAX_PAYLOADS - 1),
    *_grid(18, 1234),
]


def expert_fn(planes_hidden: torch.Tensor, counts: torch.Tensor, first: int, num_experts: int,
              gen: torch.Generator) -> torch.Tensor:
    """A rank's stand-in experts on the expert-major view (CPU): row [e, i] ->
    hidden * (1 + (first + e) / num_experts) in fp32, cast; padding rows get
    random bytes (the combine must not read them)."""
    L, M = planes_hidden.shape[:2]
    scale = 1.0 + (first + torch.arange(L, dtype=torch.float32)) / num_experts
    out = (planes_hidden.float() * scale.view(L, 1, 1)).to(planes_hidden.dtype)
    pad = torch.arange(M)[None, :] >= counts.long()[:, None]
    garbage = random_tensor(out.shape, out.dtype, gen)
    out[pad] = garbage[pad]
    return out


def em_workspace_size(case: EmCase) -> int:
    return a2a.moe_a2a_get_workspace_size_per_rank_expert_major(
        case.ep_size, case.T, case.user_bytes, case.hidden * case.hidden_dtype.itemsize, case.num_experts,
        case.top_k, case.M)


def make_em_sim(case: EmCase, device) -> a2a.SimulatedEP:
    return a2a.SimulatedEP(case.ep_size, case.T, dispatch_bytes_per_token=0, combine_bytes_per_token=0,
                           device=device, workspace_size_per_rank=em_workspace_size(case))


def em_inputs(case: EmCase, gen: torch.Generator):
    ids, payloads, weights = [], [], []
    for n in case.tokens:
        if case.repeats:
            routing = torch.randint(0, case.num_experts, (n, case.top_k), generator=gen, dtype=torch.int32)
        else:
            routing = reference.random_routing(n, case.top_k, case.num_experts, gen, invalid_fraction=0.05,
                                               negative_fraction=0.05)
        ids.append(routing.long() if case.ids_int64 else routing)
        p = [random_values((n, case.hidden), case.hidden_dtype, gen)]
        p += [random_tensor((n, 7 + j), torch.uint8, gen) for j in range(case.extra)]
        payloads.append(p)
        weights.append(torch.rand((n, case.top_k), generator=gen) + 0.25)
    return ids, payloads, (weights if case.weights else None)


def em_round(sim: a2a.SimulatedEP, case: EmCase, gen: torch.Generator, dropped_before: list[int],
             combines: int = 1, use_output: bool = False) -> list[int]:
    """One expert-major dispatch -> experts -> ``combines`` combines on every
    active rank (repeated combines: of the same rows in place, or of the
    expert outputs times k staged), each checked against the reference
    (bitwise); ``use_output``: into poisoned ``output=`` tensors. Returns
    each rank's dropped count."""
    ep, device = case.ep_size, sim.workspace.device
    active = list(range(ep)) if case.active is None else list(case.active)
    mask_kwargs = {}
    if case.active is not None:
        mask_kwargs = dict(enable_rank_mask=True, active_rank_mask=a2a.moe_a2a_active_rank_mask(active, ep))
    ids, payloads, weights = em_inputs(case, gen)
    poison_call_regions(sim.workspace, gen)
    # On the device before any rank runs: on CUDA no rank's step may make the host wait.
    dev_ids = [t.to(device) for t in ids]
    dev_payloads = [[p.to(device) for p in ps] for ps in payloads]
    dev_weights = None if weights is None else [w.to(device) for w in weights]

    def dispatch(r):
        if r not in active:
            return None
        return a2a.moe_a2a_dispatch(
            dev_ids[r], dev_payloads[r], sim.workspace, sim.metainfo[r], case.T, r, ep, case.top_k, case.num_experts,
            expert_major=True, router_weights=None if dev_weights is None else dev_weights[r],
            max_tokens_per_expert=case.max_tokens_per_expert, **mask_kwargs)

    results = sim.run(dispatch)
    ref = reference.reference_dispatch_expert_major(
        ids, payloads, weights, ep_size=ep, num_experts=case.num_experts, max_tokens_per_expert=case.M,
        active_ranks=case.active)
    dropped = []
    outputs, ref_outputs = {}, []
    for d in range(ep):
        first, last = layout.expert_range(case.num_experts, ep, d)
        L = last - first
        ref_out = expert_fn(ref.planes[d][0], ref.counts[d], first, case.num_experts, make_generator(("pad", d)))
        ref_outputs.append(ref_out)
        if d not in active:
            dropped.append(dropped_before[d])
            continue
        res = results[d]
        assert isinstance(res, a2a.ExpertMajorDispatch)
        counts = res.expert_counts.cpu()
        assert torch.equal(counts, ref.counts[d]), f"rank {d}: counts {counts.tolist()} != {ref.counts[d].tolist()}"
        assert tuple(res.local_expert_ids.shape) == (L, case.M)
        assert torch.equal(res.local_expert_ids.cpu(), ref.local_ids[d]), f"rank {d}: local expert ids"
        if weights is None:
            assert res.router_weights is None
        else:
            assert_bytes_equal(res.router_weights, ref.weights[d], f"rank {d}: router weights")
        for i, view in enumerate(res.output_payloads):
            assert tuple(view.shape) == (L, case.M, *payloads[0][i].shape[1:]) and view.dtype == payloads[0][i].dtype
            for e in range(L):
                c = int(counts[e])
                assert_bytes_equal(view[e, :c], ref.planes[d][i][e, :c], f"rank {d} payload {i} expert {e}")
        count = int(a2a.moe_a2a_get_dropped_pair_count(sim.workspace, sim.metainfo[d], d))
        assert count == dropped_before[d] + ref.dropped[d], f"rank {d}: dropped {count}"
        dropped.append(count)
        # The kernel path's experts run on its own views (equal to the reference's, checked above).
        out = expert_fn(res.output_payloads[0].cpu(), counts, first, case.num_experts, make_generator(("pad", d)))
        if case.in_workspace:
            nbytes = out.numel() * out.element_size()
            view = a2a.moe_a2a_wrap_payload_tensor_in_workspace(
                sim.workspace[d], list(out.shape[:2]), res.combine_payload_offset,
                res.combine_payload_offset + nbytes, out.dtype)
            outputs[d] = view.copy_(out.to(device))
        else:
            outputs[d] = out.to(device)

    def scaled(t: torch.Tensor, k: int) -> torch.Tensor:
        return t if k == 1 else (t.float() * k).to(t.dtype)

    for k in range(1, combines + 1):
        in_place = case.in_workspace and k <= 2

        out_dtype = case.hidden_dtype if case.output_dtype is None else case.output_dtype
        into = {r: random_tensor((case.tokens[r], case.hidden), out_dtype, gen).to(device)
                for r in active} if use_output else {}

        def combine(r, k=k, in_place=in_place):
            if r not in active:
                return None
            return a2a.moe_a2a_combine_expert_major(
                outputs[r] if in_place else scaled(outputs[r], k), results[r], sim.workspace, sim.metainfo[r], r,
                ep, payload_in_workspace=in_place, output_dtype=case.output_dtype, output=into.get(r), **mask_kwargs)

        combined = sim.run(combine)
        for r in into:
            assert combined[r] is into[r], "combine_expert_major(output=) must return output"
        expected = reference.reference_combine_expert_major(
            [scaled(o, 1 if in_place else k) for o in ref_outputs], ref, output_dtype=case.output_dtype)
        for r in active:
            assert_bytes_equal(combined[r].cpu(), expected[r], f"rank {r} combine {k} output")
    return dropped


@pytest.mark.parametrize("case", GRID, ids=str)
def test_expert_major_matches_reference(case, device):
    if device == "cuda" and case.ep_size > 8:
        pytest.skip("simulated ranks on one GPU")
    sim = make_em_sim(case, device)
    gen = make_generator(str(case))
    dropped = [0] * case.ep_size
    # A second round on the same workspace: buffer reuse, cumulative drop
    # counts, and three combines of its dispatch (FlashInfer's repeated
    # combines), into output= tensors.
    for combines, use_output in ((1, False), (3, True)):
        dropped = em_round(sim, case, gen, dropped, combines, use_output)


def test_expert_major_then_rank_major_rounds(device):
    """Expert-major and rank-major round trips alternate on one workspace."""
    case = EmCase(3, (6, 2, 5), 4, 7, max_tokens_per_expert=3)
    sim = make_em_sim(case, device)
    gen = make_generator(7)
    dropped = em_round(sim, case, gen, [0] * 3)
    ids, payloads, _ = em_inputs(case, gen)

    def rank_major(r):
        dev = sim.workspace.device
        recv, offset, _ = a2a.moe_a2a_dispatch(ids[r].to(dev), [payloads[r][0].to(dev)], sim.workspace,
                                               sim.metainfo[r], case.T, r, 3, case.top_k, case.num_experts)
        return a2a.moe_a2a_combine(recv[0].clone(), ids[r].shape[0], sim.workspace, sim.metainfo[r], case.T, r, 3,
                                   case.top_k, offset)

    outs = sim.run(rank_major)
    ref = reference.reference_dispatch(ids, [[p[0]] for p in payloads], ep_size=3, num_experts=case.num_experts,
                                       runtime_max_tokens_per_rank=case.T)
    expected = reference.reference_combine([r[0] for r in ref.recv], ref, list(case.tokens))
    for r in range(3):
        assert_bytes_equal(outs[r].cpu(), expected[r], f"rank {r} rank-major after expert-major")
    em_round(sim, case, gen, dropped)


def test_small_and_large_calls_share_the_dispatch_scratch(device):
    """On CUDA an expert-major call of at most 1024 experts and a T that the
    small rank-major call takes runs one kernel whose ranks exchange their
    pair counts through the header words a large rank-major dispatch uses
    for its own CTAs (protocol.h); with more experts the dispatch and the
    build run. Both kinds of expert-major call, a large rank-major round
    between them and again after it, on one workspace: every result equal
    to the reference."""
    small = EmCase(2, (8, 5), 4, 16, max_tokens_per_expert=9)
    large = EmCase(2, (6, 8), 8, 1030, max_tokens_per_expert=9)  # more experts than the one-kernel call takes
    tokens, hidden, top_k = 5000, 4, 2  # on an H200 a large rank-major call (chunks of more than a warp's tokens)
    rank_major = a2a.moe_a2a_get_workspace_size_per_rank(2, tokens, 4 * hidden + 4 * top_k, 4 * hidden)
    size = max(em_workspace_size(small), em_workspace_size(large), rank_major)
    sim = a2a.SimulatedEP(2, tokens, dispatch_bytes_per_token=0, combine_bytes_per_token=0, device=device,
                          workspace_size_per_rank=size)
    gen = make_generator(31)
    dropped = em_round(sim, small, gen, [0, 0])
    ids = [reference.random_routing(tokens, top_k, 8, gen) for _ in range(2)]
    xs = [torch.randn(tokens, hidden, generator=gen) for _ in range(2)]

    def rank_major_round(r):
        dev = sim.workspace.device
        recv, offset, _ = a2a.moe_a2a_dispatch(ids[r].to(dev), [xs[r].to(dev)], sim.workspace, sim.metainfo[r],
                                               tokens, r, 2, top_k, 8)
        return a2a.moe_a2a_combine(recv[0].clone(), tokens, sim.workspace, sim.metainfo[r], tokens, r, 2, top_k,
                                   offset)

    outs = sim.run(rank_major_round)
    ref = reference.reference_dispatch(ids, [[x] for x in xs], ep_size=2, num_experts=8,
                                       runtime_max_tokens_per_rank=tokens)
    expected = reference.reference_combine([r[0] for r in ref.recv], ref, [tokens, tokens])
    for r in range(2):
        assert_bytes_equal(outs[r].cpu(), expected[r], f"rank {r} rank-major round")
    dropped = em_round(sim, large, gen, dropped)
    em_round(sim, small, gen, dropped)


def _direct_op_env(device):
    """One rank sized for expert-major calls of a 16-element fp32 hidden payload, top-2 of 4 experts."""
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(1, 4, 64, 64, 4, 2, 4)
    workspace = torch.zeros(1, size, dtype=torch.uint8, device=device)
    metainfo = a2a.moe_a2a_initialize(workspace, 0, 1, 4)
    gen = make_generator(41)
    ids = reference.random_routing(4, 2, 4, gen).to(device)
    x = torch.randn(4, 16, generator=gen).to(device)
    w = torch.rand(4, 2, generator=gen).to(device)
    return workspace, int(metainfo[layout.META_MAILBOX_ADDR]), ids, x, w


@pytest.mark.parametrize("what", ["row size", "payload count", "ids", "weights dtype"])
def test_dispatch_expert_major_op_checks_its_payloads_against_its_rows(what, device):
    """The op lays out the expert-major planes by payload_row_bytes and (on
    CUDA, for small calls) copies the rows by the tensors: payloads that do
    not match what it is told are refused before anything is written (an
    understated row size would copy past the planes)."""
    workspace, mailbox, ids, x, w = _direct_op_env(device)
    payloads, rows, has_weights = [x, ids, w], [64], True
    if what == "row size":
        rows = [32]
    elif what == "payload count":
        payloads = [x, ids]
    elif what == "ids":
        payloads = [x, ids[:, :1].contiguous(), w]
    else:
        payloads = [x, ids, w.double()]
    before = workspace.clone()
    with pytest.raises(ValueError, match="dispatch_expert_major: input_payloads"):
        torch.ops.moe_a2a.dispatch_expert_major.default(ids, payloads, workspace, 0, 1, 4, 4, 2, 4, None, 0, [], 5.0,
                                                        mailbox, False, 4, rows, has_weights)
    assert torch.equal(workspace, before)


def test_ranks_with_other_rows_per_expert_are_reported(device):
    """max_tokens_per_expert must be the same on every rank of a call (it
    places every expert-major plane): ranks whose M differ are reported as
    dispatching other payloads (CPU: by the dispatch; CUDA: by the combine)."""
    case = EmCase(2, (4, 3), 2, 4, max_tokens_per_expert=4, extra=0, weights=False)
    sim = make_em_sim(case, device)
    ids, payloads, _ = em_inputs(case, make_generator(43))
    dev = sim.workspace.device

    def round_trip(r):
        got = a2a.moe_a2a_dispatch_expert_major(ids[r].to(dev), [payloads[r][0].to(dev)], sim.workspace,
                                                sim.metainfo[r], case.T, r, 2, case.top_k, case.num_experts,
                                                max_tokens_per_expert=4 - r)
        return a2a.moe_a2a_combine_expert_major(got.output_payloads[0].clone(), got, sim.workspace, sim.metainfo[r],
                                                r, 2)

    with pytest.raises(RuntimeError, match="max_tokens_per_expert"):
        sim.run(round_trip)
        if device == "cuda":
            torch.cuda.synchronize()
            a2a.check_errors(sim.workspace)


def test_a_rank_major_combine_after_an_expert_major_dispatch_is_refused(device):
    """A rank-major combine after an expert-major dispatch would stage its rows
    over the expert-major regions that begin at the dispatch's dispatch_end,
    which the round's expert-major combines read: it is refused, before or
    after an expert-major combine of the round. On the CPU before it writes
    anything, and the round's expert-major combines stay the reference's; on
    CUDA the kernel records it at once, waiting for no peer."""
    case = EmCase(3, (6, 2, 5), 4, 7, max_tokens_per_expert=3)
    sim = make_em_sim(case, device)
    gen = make_generator("rank-major after expert-major")
    ids, payloads, weights = em_inputs(case, gen)
    results = sim.run(lambda r: a2a.moe_a2a_dispatch_expert_major(
        ids[r].to(device), [p.to(device) for p in payloads[r]], sim.workspace, sim.metainfo[r], case.T, r,
        case.ep_size, case.top_k, case.num_experts, router_weights=weights[r].to(device),
        max_tokens_per_expert=case.max_tokens_per_expert))
    ref = reference.reference_dispatch_expert_major(ids, payloads, weights, ep_size=case.ep_size,
                                                    num_experts=case.num_experts, max_tokens_per_expert=case.M)
    outputs = [random_values(tuple(ref.planes[d][0].shape), case.hidden_dtype, gen) for d in range(case.ep_size)]
    expected = reference.reference_combine_expert_major(outputs, ref)
    rows = [torch.full((case.ep_size, case.T, case.hidden), 100.0, dtype=case.hidden_dtype, device=device)
            for _ in range(case.ep_size)]

    def rank_major(r):
        return a2a.moe_a2a_combine(rows[r], case.tokens[r], sim.workspace, sim.metainfo[r], case.T, r, case.ep_size,
                                   case.top_k, results[r].dispatch_end)

    def expert_major(r):
        return a2a.moe_a2a_combine_expert_major(outputs[r].to(device), results[r], sim.workspace, sim.metainfo[r], r,
                                                case.ep_size)

    message = ("moe_a2a_combine: the last dispatch's rows are laid out expert-major .*: close its round with "
               "moe_a2a_combine_expert_major")
    if device == "cuda":
        sim.run(rank_major)
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match=message):
            a2a.check_errors(sim.workspace)
        return
    for after_a_combine in (False, True):  # as the round's first combine, then as a repeated one
        if after_a_combine:
            combined = sim.run(expert_major)
            for r in range(case.ep_size):
                assert_bytes_equal(combined[r], expected[r], f"rank {r}")
        snap = ws_snapshot(sim.workspace)
        with pytest.raises(ValueError, match=f"rank 0: {message}"):
            rank_major(0)
        assert_ws_unchanged(sim.workspace, snap)
    combined = sim.run(expert_major)
    for r in range(case.ep_size):
        assert_bytes_equal(combined[r], expected[r], f"rank {r} after the refusals")


# ---- an end-to-end MoE layer ---------------------------------------------------------


class DenseMoE:
    """A softmax-top-k router and SwiGLU-free two-matrix experts, fp32."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, gen: torch.Generator):
        self.gate = torch.randn(hidden, num_experts, generator=gen) / hidden ** 0.5
        self.w1 = torch.randn(num_experts, hidden, ffn, generator=gen) / hidden ** 0.5
        self.w2 = torch.randn(num_experts, ffn, hidden, generator=gen) / ffn ** 0.5
        self.top_k = top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(x @ self.gate, dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    def expert(self, g: int, rows: torch.Tensor) -> torch.Tensor:
        return torch.relu(rows @ self.w1[g]) @ self.w2[g]

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(self.top_k):
                out[t] += weights[t, k] * self.expert(int(ids[t, k]), x[t:t + 1])[0]
        return out


def grouped_experts(moe: DenseMoE, hidden: torch.Tensor, counts: torch.Tensor, first: int) -> torch.Tensor:
    """The grouped matmul on the expert-major views: expert e's first counts[e] rows
    through expert first + e (a loop over experts; padding rows stay 0)."""
    out = torch.zeros_like(hidden)
    for e in range(hidden.shape[0]):
        c = int(counts[e])
        if c:
            out[e, :c] = moe.expert(first + e, hidden[e, :c])
    return out


@pytest.mark.parametrize("ep_size,tokens,num_experts,top_k", [(1, (9,), 4, 2), (4, (5, 0, 11, 3), 10, 3),
                                                                (3, (8, 8, 1), 6, 6)])
def test_moe_layer_equals_dense(ep_size, tokens, num_experts, top_k, device):
    gen = make_generator(("moe", ep_size, tokens))
    hidden, ffn = 24, 40
    moe = DenseMoE(hidden, ffn, num_experts, top_k, gen)
    xs = [torch.randn(n, hidden, generator=gen) for n in tokens]
    T = max(1, max(tokens))
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(ep_size, T, hidden * 4, hidden * 4, num_experts,
                                                                 top_k)
    sim = a2a.SimulatedEP(ep_size, T, dispatch_bytes_per_token=0, combine_bytes_per_token=0, device=device,
                          workspace_size_per_rank=size)

    routed = [moe.route(x) for x in xs]
    dev = [(x.to(device), ids.to(device), w.to(device)) for x, (ids, w) in zip(xs, routed)]

    def dispatch(r):
        x, ids, weights = dev[r]
        return a2a.moe_a2a_dispatch(ids, [x], sim.workspace, sim.metainfo[r], T, r, ep_size, top_k, num_experts,
                                    expert_major=True, router_weights=weights)

    # Phase by phase: on CUDA the host may wait for a rank only once every rank has launched.
    got = sim.run(dispatch)
    ys = []
    for r in range(ep_size):
        first = layout.expert_range(num_experts, ep_size, r)[0]
        y = grouped_experts(moe, got[r].output_payloads[0].cpu(), got[r].expert_counts.cpu(), first)
        ys.append(y.to(device))
    outs = sim.run(lambda r: a2a.moe_a2a_combine_expert_major(ys[r], got[r], sim.workspace, sim.metainfo[r], r,
                                                              ep_size))
    for r in range(ep_size):
        torch.testing.assert_close(outs[r].cpu(), moe.dense(xs[r]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k,num_experts", [(4, 2), (22, 3)])
def test_default_rows_per_expert_keep_every_slot_with_fewer_experts_than_top_k(top_k, num_experts, device):
    """With fewer experts than top_k no token can name distinct experts, and
    the distinct-experts default (ep_size * T rows) dropped pairs at full
    load; the default is then every slot of every token: a routing that puts
    every slot of every token on expert 0 keeps all its pairs."""
    ep, T = 2, 4
    case = EmCase(ep, (T, T), top_k, num_experts, extra=0, repeats=True)
    assert case.M == ep * T * top_k
    sim = make_em_sim(case, device)
    ids = torch.zeros(T, top_k, dtype=torch.int32, device=device)
    x = torch.randn(T, case.hidden, generator=make_generator(("all on one", top_k))).to(case.hidden_dtype).to(device)
    got = sim.run(lambda r: a2a.moe_a2a_dispatch_expert_major(ids, [x], sim.workspace, sim.metainfo[r], T, r, ep,
                                                              top_k, num_experts))
    assert got[0].expert_counts.cpu()[0].item() == ep * T * top_k
    assert [a2a.moe_a2a_get_dropped_pair_count(sim.workspace, sim.metainfo[r], r) for r in range(ep)] == [0, 0]
    outs = sim.run(lambda r: a2a.moe_a2a_combine_expert_major(got[r].output_payloads[0], got[r], sim.workspace,
                                                              sim.metainfo[r], r, ep))
    # Each token's top_k unweighted pairs of its own row: top_k times the row, summed in fp32.
    torch.testing.assert_close(outs[0].float().cpu(), (x.float() * top_k).to(case.hidden_dtype).float().cpu())


# ---- bad input ------------------------------------------------------------------------


def _simple(device, M=None):
    case = EmCase(1, (4,), 2, 3, max_tokens_per_expert=M)
    sim = make_em_sim(case, device)
    gen = make_generator(3)
    ids, payloads, weights = em_inputs(case, gen)
    return case, sim, ids[0].to(device), [p.to(device) for p in payloads[0]], weights[0].to(device)


@pytest.mark.parametrize("case", [EmCase(1, (9,), 4, 6, extra=0), EmCase(3, (2, 7, 0), 3, 7, active=(1,))], ids=str)
def test_combine_stages_only_for_pulling_peers(case, device):
    """A combine of an expert-output tensor with no active peer (ep 1, or every
    peer masked off) writes nothing into its combine region: its own pairs'
    rows are read from the tensor itself (at ep 1 the staging was the
    combine's largest pass). The result stays the reference's, bitwise."""
    sim = make_em_sim(case, device)
    gen = make_generator(str(case))
    active = list(case.active) if case.active is not None else list(range(case.ep_size))
    mask = {}
    if case.active is not None:
        mask = dict(enable_rank_mask=True, active_rank_mask=a2a.moe_a2a_active_rank_mask(active, case.ep_size))
    ids, payloads, weights = em_inputs(case, gen)
    poison_call_regions(sim.workspace, gen)
    results = sim.run(lambda r: a2a.moe_a2a_dispatch(
        ids[r].to(device), [p.to(device) for p in payloads[r]], sim.workspace, sim.metainfo[r], case.T, r,
        case.ep_size, case.top_k, case.num_experts, expert_major=True, router_weights=weights[r].to(device),
        **mask) if r in active else None)
    ref = reference.reference_dispatch_expert_major(ids, payloads, weights, ep_size=case.ep_size,
                                                    num_experts=case.num_experts, max_tokens_per_expert=case.M,
                                                    active_ranks=case.active)
    outputs = [random_values(tuple(ref.planes[d][0].shape), case.hidden_dtype, gen) for d in range(case.ep_size)]
    before = ws_snapshot(sim.workspace)
    combined = sim.run(lambda r: a2a.moe_a2a_combine_expert_major(
        outputs[r].to(device), results[r], sim.workspace, sim.metainfo[r], r, case.ep_size, **mask)
        if r in active else None)
    expected = reference.reference_combine_expert_major(outputs, ref)
    for r in active:
        assert_bytes_equal(combined[r].cpu(), expected[r], f"rank {r}")
        start = results[r].combine_payload_offset
        assert torch.equal(sim.workspace[r, start:].cpu(), before[r, start:]), f"rank {r}: combine region written"


def test_refusals_leave_workspace_untouched(device):
    case, sim, ids, payloads, weights = _simple(device)
    snap = ws_snapshot(sim.workspace)
    args = (ids, payloads, sim.workspace, sim.metainfo[0], case.T, 0, 1, case.top_k, case.num_experts)
    with pytest.raises(ValueError, match="max_tokens_per_expert"):
        a2a.moe_a2a_dispatch_expert_major(*args, max_tokens_per_expert=0)
    with pytest.raises(ValueError, match="router_weights"):
        a2a.moe_a2a_dispatch_expert_major(*args, router_weights=weights[:, :1])
    with pytest.raises(ValueError, match="at most 8 payloads, got 9"):
        a2a.moe_a2a_dispatch_expert_major(ids, [payloads[0]] * 9, *args[2:], router_weights=weights)
    with pytest.raises(ValueError, match="workspace too small"):
        a2a.moe_a2a_dispatch_expert_major(*args, max_tokens_per_expert=case.M * 100)
    with pytest.raises(ValueError, match="expert_major=True"):
        a2a.moe_a2a_dispatch(*args, max_tokens_per_expert=4)
    assert_ws_unchanged(sim.workspace, snap)


def test_combine_output_is_checked(device):
    """output= of the expert-major combine: refused before anything runs
    unless it is a contiguous [local_num_tokens, *row_shape] tensor of
    output_dtype outside the workspace that needs no grad; a good one is
    written and returned."""
    case, sim, ids, payloads, weights = _simple(device)
    got = a2a.moe_a2a_dispatch_expert_major(ids, payloads, sim.workspace, sim.metainfo[0], case.T, 0, 1, case.top_k,
                                            case.num_experts, router_weights=weights)
    y = torch.ones(got.output_payloads[0].shape, dtype=got.output_payloads[0].dtype, device=device)
    view = a2a.moe_a2a_wrap_payload_tensor_in_workspace(sim.workspace[0], [4], 0, 4 * case.hidden * 2,
                                                        torch.bfloat16)
    bad = [
        (torch.empty(3, case.hidden, dtype=torch.bfloat16, device=device), "output must be \\[local_num_tokens"),
        (torch.empty(4, case.hidden, dtype=torch.float16, device=device), "output must be torch.bfloat16"),
        (torch.empty(case.hidden, 4, dtype=torch.bfloat16, device=device).t(), "output must be contiguous"),
        (view, "output lies in the workspace"),
        (torch.empty(4, case.hidden, dtype=torch.bfloat16, device=device, requires_grad=True),
         "output must not require grad"),
        (torch.empty(4, case.hidden, dtype=torch.bfloat16, device="meta"), "on the workspace's device"),
        ([torch.empty(4, case.hidden, dtype=torch.bfloat16, device=device)], "output must be a tensor or None"),
    ]
    snap = ws_snapshot(sim.workspace)
    for output, match in bad:
        with pytest.raises(ValueError, match=match):
            a2a.moe_a2a_combine_expert_major(y, got, sim.workspace, sim.metainfo[0], 0, 1, output=output)
    assert_ws_unchanged(sim.workspace, snap)
    output = torch.full((4, case.hidden), float("nan"), dtype=torch.bfloat16, device=device)
    out = a2a.moe_a2a_combine_expert_major(y, got, sim.workspace, sim.metainfo[0], 0, 1, output=output)
    assert out is output and not bool(torch.isnan(out).any())


@pytest.mark.parametrize("shape", ["fewer rows", "rows flattened", "experts flattened"])
def test_in_place_combine_checks_the_region_views_shape(shape, device):
    """payload_in_workspace=True with a view of the combine region at the
    right address but of another leading shape: refused before anything
    runs (the kernels would read the region with the view's stride: wrong
    sums, or an output of another shape), as the staged combine refuses it."""
    case, sim, ids, payloads, weights = _simple(device)
    got = a2a.moe_a2a_dispatch_expert_major(ids, payloads, sim.workspace, sim.metainfo[0], case.T, 0, 1, case.top_k,
                                            case.num_experts, router_weights=weights)
    L, M = got.local_expert_ids.shape
    H = case.hidden
    dims = {"fewer rows": (L, M - 1, H), "rows flattened": (L, M * H), "experts flattened": (L * M, H)}[shape]
    view = a2a.moe_a2a_wrap_payload_tensor_in_workspace(
        sim.workspace[0], [math.prod(dims)], got.combine_payload_offset,
        got.combine_payload_offset + 2 * math.prod(dims), torch.bfloat16).view(dims)
    snap = ws_snapshot(sim.workspace)
    with pytest.raises(ValueError, match=f"max_tokens_per_expert = {L}, {M} \\(the dispatch's\\), got shape"):
        a2a.moe_a2a_combine_expert_major(view, got, sim.workspace, sim.metainfo[0], 0, 1, payload_in_workspace=True)
    assert_ws_unchanged(sim.workspace, snap)
    # The right view still combines, once the round is closed.
    good = a2a.moe_a2a_wrap_payload_tensor_in_workspace(
        sim.workspace[0], [L * M * H], got.combine_payload_offset, got.combine_payload_offset + 2 * L * M * H,
        torch.bfloat16).view(L, M, H)
    out = a2a.moe_a2a_combine_expert_major(good, got, sim.workspace, sim.metainfo[0], 0, 1, payload_in_workspace=True)
    assert out.shape == (case.T, H)


def test_combine_needs_expert_major_dispatch(device):
    if device == "cuda":
        pytest.skip("the CUDA kernel records the refusal for the next call "
                    "(test_cuda_combine_without_expert_major_build_is_recorded)")
    case, sim, ids, payloads, weights = _simple(device)
    got = a2a.moe_a2a_dispatch_expert_major(ids, payloads, sim.workspace, sim.metainfo[0], case.T, 0, 1, case.top_k,
                                            case.num_experts, router_weights=weights)
    y = torch.zeros(got.output_payloads[0].shape, dtype=got.output_payloads[0].dtype)
    bad = got._replace(max_tokens_per_expert=got.max_tokens_per_expert - 1)
    with pytest.raises(ValueError, match="expert_outputs must be"):
        a2a.moe_a2a_combine_expert_major(y, bad, sim.workspace, sim.metainfo[0], 0, 1)
    with pytest.raises(ValueError, match="max_tokens_per_expert"):
        a2a.moe_a2a_combine_expert_major(y[:, :-1].contiguous(), bad, sim.workspace, sim.metainfo[0], 0, 1)
    out = a2a.moe_a2a_combine_expert_major(y, got, sim.workspace, sim.metainfo[0], 0, 1)
    assert out.shape == (4, case.hidden)
    # A rank-major dispatch has no expert-major build: its combine from the layout is refused.
    recv, offset, _ = a2a.moe_a2a_dispatch(ids, payloads, sim.workspace, sim.metainfo[0], case.T, 0, 1, case.top_k,
                                           case.num_experts)
    stale = got._replace(dispatch_end=offset)
    with pytest.raises(ValueError, match="expert-major dispatch before it"):
        a2a.moe_a2a_combine_expert_major(y, stale, sim.workspace, sim.metainfo[0], 0, 1)


def test_moe_alltoall_expert_major(device):
    case = EmCase(2, (5, 3), 3, 5, hidden=16, extra=0)
    ws_size = a2a.MoeAlltoAll.get_moe_workspace_size_per_rank_expert_major(2, case.top_k, case.T, case.hidden,
                                                                            case.num_experts, dtype=torch.bfloat16)
    sized = a2a.MoeAlltoAll(ep_mapping(0, 1), case.T, case.top_k, case.num_experts, hidden_size=case.hidden,
                            device=device, expert_major=True, max_tokens_per_expert=4)
    assert sized.workspace_size_per_rank == a2a.MoeAlltoAll.get_moe_workspace_size_per_rank_expert_major(
        1, case.top_k, case.T, case.hidden, case.num_experts, 4)
    # The simulation's threads / streams; the instances initialize their own rows of its workspace.
    sim = a2a.SimulatedEP(2, case.T, dispatch_bytes_per_token=0, combine_bytes_per_token=0, device=device,
                          workspace_size_per_rank=ws_size)
    moes = [a2a.MoeAlltoAll(ep_mapping(r, 2), case.T, case.top_k, case.num_experts, workspace=sim.workspace,
                            expert_major=True) for r in range(2)]
    gen = make_generator(11)
    ids, payloads, weights = em_inputs(case, gen)
    dev = [(ids[r].to(device), payloads[r][0].to(device), weights[r].to(device)) for r in range(2)]
    got = sim.run(lambda r: moes[r].dispatch(dev[r][0], [dev[r][1]], case.T, router_weights=dev[r][2]))

    def combine(r):
        buf = moes[r].get_combine_payload_tensor_in_workspace(case.T, case.hidden, torch.bfloat16)
        assert tuple(buf.shape) == tuple(got[r].output_payloads[0].shape)
        buf.copy_(got[r].output_payloads[0])
        return moes[r].combine(buf, case.T, payload_in_workspace=True)

    outs = sim.run(combine)
    ref = reference.reference_dispatch_expert_major(ids, [[p[0]] for p in payloads], weights, ep_size=2,
                                                    num_experts=case.num_experts, max_tokens_per_expert=case.M)
    expected = reference.reference_combine_expert_major([p[0] for p in ref.planes], ref)
    for r in range(2):
        assert_bytes_equal(outs[r].cpu(), expected[r], f"rank {r}")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(use_low_precision=True), NotImplementedError, "rank-major combine only"),
    (dict(output_dtype=torch.float8_e4m3fn, output_scales=torch.zeros(8, dtype=torch.uint8)), NotImplementedError,
     "rank-major combine only"),
    # Not a flag: 'no' read as yes, and the refusal named an option the caller turned off.
    (dict(use_low_precision="no"), ValueError, "MoeAlltoAll.combine: use_low_precision must be True or False"),
    (dict(low_precision_block_scales="off"), ValueError,
     "MoeAlltoAll.combine: low_precision_block_scales must be True or False"),
])
def test_moe_alltoall_expert_major_refuses_low_precision(kwargs, error, match, device):
    """After an expert-major dispatch, MoeAlltoAll.combine refuses the options of
    the rank-major combine before any kernel runs, flags that are no flags as
    the functional combine does; the round stays open for the combine after."""
    case = EmCase(1, (5,), 2, 4, hidden=32, extra=0)
    a2a.MoeAlltoAll.clear_workspace_cache()  # a workspace of its own: no round another test left open
    moe = a2a.MoeAlltoAll(ep_mapping(0, 1), case.T, case.top_k, case.num_experts, hidden_size=case.hidden,
                          device=device, expert_major=True)
    ids, payloads, weights = em_inputs(case, make_generator(("expert-major refusals", match)))
    got = moe.dispatch(ids[0].to(device), [payloads[0][0].to(device)], case.T, router_weights=weights[0].to(device))
    before = ws_snapshot(moe.workspace)
    with pytest.raises(error, match=match):
        moe.combine(got.output_payloads[0], case.T, **kwargs)
    assert_ws_unchanged(moe.workspace, before)
    out = moe.combine(got.output_payloads[0], case.T)
    ref = reference.reference_dispatch_expert_major(ids, [[p[0]] for p in payloads], weights, ep_size=1,
                                                    num_experts=case.num_experts, max_tokens_per_expert=case.M)
    assert_bytes_equal(out.cpu(), reference.reference_combine_expert_major([p[0] for p in ref.planes], ref)[0],
                       "the combine after the refusal")


def test_moe_alltoall_expert_major_takes_sf_layout_as_the_rank_major_combine(device):
    """sf_layout without output_scales changes nothing in a rank-major
    combine; after an expert-major dispatch it was refused as a quantized
    output. It is taken there too (a bad value is refused, as by the
    rank-major combine)."""
    case = EmCase(1, (5,), 2, 4, hidden=32, extra=0)
    a2a.MoeAlltoAll.clear_workspace_cache()
    moe = a2a.MoeAlltoAll(ep_mapping(0, 1), case.T, case.top_k, case.num_experts, hidden_size=case.hidden,
                          device=device, expert_major=True)
    ids, payloads, weights = em_inputs(case, make_generator("expert-major sf_layout"))
    ref = reference.reference_dispatch_expert_major(ids, [[p[0]] for p in payloads], weights, ep_size=1,
                                                    num_experts=case.num_experts, max_tokens_per_expert=case.M)
    want = reference.reference_combine_expert_major([p[0] for p in ref.planes], ref)[0]
    got = moe.dispatch(ids[0].to(device), [payloads[0][0].to(device)], case.T, router_weights=weights[0].to(device))
    before = ws_snapshot(moe.workspace)
    with pytest.raises(ValueError, match="sf_layout must be an SfLayout"):
        moe.combine(got.output_payloads[0], case.T, sf_layout="128x4")
    assert_ws_unchanged(moe.workspace, before)
    out = moe.combine(got.output_payloads[0], case.T, sf_layout=a2a.SfLayout.layout_128x4)
    assert_bytes_equal(out.cpu(), want, "the combine with sf_layout=layout_128x4")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_expert_major_cuda_graph_replays():
    """Each simulated rank's expert-major step (dispatch, a stand-in expert on the
    views, combine) captured into its own CUDA graph and replayed with fresh
    inputs in the static buffers: every replay equal to the reference."""
    case = EmCase(4, (9, 0, 14, 5), 4, 10, max_tokens_per_expert=12, extra=0)
    ep, device = case.ep_size, "cuda"
    sim = a2a.SimulatedEP(ep, case.T, dispatch_bytes_per_token=0, combine_bytes_per_token=0, device=device,
                          workspace_size_per_rank=em_workspace_size(case), timeout_s=10.0)
    static_ids = [torch.empty((n, case.top_k), dtype=torch.int32, device=device) for n in case.tokens]
    static_x = [torch.empty((n, case.hidden), dtype=case.hidden_dtype, device=device) for n in case.tokens]
    static_w = [torch.empty((n, case.top_k), dtype=torch.float32, device=device) for n in case.tokens]
    gen = make_generator(99)

    def fill():
        ids, payloads, weights = em_inputs(case, gen)
        for r in range(ep):
            static_ids[r].copy_(ids[r])
            static_x[r].copy_(payloads[r][0])
            static_w[r].copy_(weights[r])
        return ids, payloads, weights

    # The stand-in expert writes into buffers allocated here: under SimulatedEP.run
    # on CUDA nothing may allocate while a peer's kernel spins (an allocation
    # can wait for the device, and the peer for a launch the host has not made).
    ys = [torch.empty((hi - lo, case.M, case.hidden), dtype=case.hidden_dtype, device=device)
          for lo, hi in (layout.expert_range(case.num_experts, ep, r) for r in range(ep))]
    dispatched = [None] * ep

    def dispatch_step(r):
        got = a2a.moe_a2a_dispatch(static_ids[r], [static_x[r]], sim.workspace, sim.metainfo[r], case.T, r, ep,
                                   case.top_k, case.num_experts, expert_major=True, router_weights=static_w[r],
                                   max_tokens_per_expert=case.M)
        torch.mul(got.output_payloads[0], 3.0, out=ys[r])  # bf16 math in fp32, one rounding: as the reference's
        dispatched[r] = got

    def combine_step(r):
        return a2a.moe_a2a_combine_expert_major(ys[r], dispatched[r], sim.workspace, sim.metainfo[r], r, ep)

    def rank_step(r):
        dispatch_step(r)
        return combine_step(r)

    def check(outs, inputs, what):
        ids, payloads, weights = inputs
        ref = reference.reference_dispatch_expert_major(ids, payloads, weights, ep_size=ep,
                                                        num_experts=case.num_experts, max_tokens_per_expert=case.M)
        ref_ys = [(p[0].float() * 3.0).to(case.hidden_dtype) for p in ref.planes]
        expected = reference.reference_combine_expert_major(ref_ys, ref)
        for r in range(ep):
            assert_bytes_equal(outs[r].cpu(), expected[r], f"{what}: rank {r}")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(2):
            inputs = fill()
            sim.run(dispatch_step)
            check(sim.run(combine_step), inputs, f"eager {i}")
    torch.cuda.current_stream().wait_stream(side)
    graphs, outs = sim.capture(rank_step)
    for i in range(3):
        inputs = fill()
        graphs.replay()
        check(outs, inputs, f"replay {i}")
    torch.cuda.synchronize()
    a2a.check_errors(sim.workspace)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_combine_without_expert_major_build_is_recorded():
    """On CUDA the expert-major combine after a rank-major dispatch (no build of
    its own round) is refused by the kernel, recorded as a combine mismatch
    naming the expert-major layout, and raised by the next call."""
    case, sim, ids, payloads, weights = _simple("cuda")
    got = a2a.moe_a2a_dispatch_expert_major(ids, payloads, sim.workspace, sim.metainfo[0], case.T, 0, 1, case.top_k,
                                            case.num_experts, router_weights=weights)
    y = torch.zeros(got.output_payloads[0].shape, dtype=got.output_payloads[0].dtype, device="cuda")
    a2a.moe_a2a_combine_expert_major(y, got, sim.workspace, sim.metainfo[0], 0, 1)
    recv, offset, _ = a2a.moe_a2a_dispatch(ids, payloads, sim.workspace, sim.metainfo[0], case.T, 0, 1, case.top_k,
                                           case.num_experts)
    a2a.moe_a2a_combine_expert_major(y, got._replace(dispatch_end=offset), sim.workspace, sim.metainfo[0], 0, 1)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="expert-major layout"):
        a2a.check_errors(sim.workspace)


@pytest.mark.parametrize(("ep_size", "num_experts", "top_k", "what"), [
    (64, 65536, 22, "ep_size * max_num_tokens = "),  # 1024 experts a rank
    (16, 16, 22, "ep_size * max_num_tokens * top_k = "),  # fewer experts than top_k: every slot
])
def test_a_default_rows_per_expert_beyond_the_layout_names_the_default(ep_size, num_experts, top_k, what):
    """A workspace size asked without max_tokens_per_expert, whose default
    (ep_size * max_num_tokens, times top_k with fewer experts than top_k)
    passes the layout's rows per expert, was refused naming
    max_tokens_per_expert, which the caller never passed. It names the
    default now and how to pass a smaller one, and a smaller one works."""
    max_num_tokens = layout.MAX_NUM_TOKENS
    local = layout.max_local_experts(num_experts, ep_size)
    limit = layout.MAX_EXPERT_MAJOR_ROWS // local
    with pytest.raises(ValueError, match="max_tokens_per_expert was not given, and its default") as info:
        a2a.moe_a2a_get_workspace_size_per_rank_expert_major(ep_size, max_num_tokens, 64, 64, num_experts, top_k)
    assert what in str(info.value) and f"pass max_tokens_per_expert <= {limit}" in str(info.value)
    assert a2a.moe_a2a_get_workspace_size_per_rank_expert_major(ep_size, max_num_tokens, 64, 64, num_experts, top_k,
                                                                limit) > 0


def test_a_call_whose_pairs_a_32_bit_count_cannot_hold_is_refused():
    """The build counts a local expert's pairs of the call in 32 bits (the
    CUDA build's shared counters; the pair rows e * M + i are int32): a call
    in which one expert may get more (ep_size * T * top_k of them) wrapped
    the count and wrote rows before the planes. Refused by the op, before the
    dispatch writes anything, and by the Python dispatch's own check; one
    token fewer a rank passes to the next check (the workspace's size)."""
    ep_size, top_k, num_experts = 64, 22, 64
    T = layout.MAX_EXPERT_MAJOR_ROWS // (ep_size * top_k) + 1
    workspace = torch.zeros(ep_size, layout.HEADER_BYTES, dtype=torch.uint8)

    def build(runtime_max):
        torch.ops.moe_a2a.expert_major_build(workspace, 0, ep_size, T, runtime_max, top_k, num_experts, 1, 0, [16],
                                             4, False, 0, False)

    message = (r"counts a local expert's pairs of the call in 32 bits: ep_size \* runtime_max_tokens_per_rank \* "
               rf"top_k = {ep_size * T * top_k} exceeds {layout.MAX_EXPERT_MAJOR_ROWS}")
    with pytest.raises(ValueError, match=message):
        build(T)
    with pytest.raises(ValueError, match="workspace too small"):
        build(T - 1)
    with pytest.raises(ValueError, match=message):
        expert_major.check_expert_major_fits(workspace, ep_size, T, top_k, num_experts, 1, 0, [16], 4, False)
