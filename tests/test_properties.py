"""Property-based tests: hypothesis draws whole problems (ep_size, per-rank
token counts with zeros, top_k, num_experts not divisible by ep_size, payload
counts, dtypes and trailing shapes, expert ids with negative and out-of-range
values, int32 and int64 ids, rank masks, rounds on one workspace) and checks
every dispatch and combine, rank-major and expert-major, bitwise against the
reference on simulated ranks; then the differentiable functions over the same
problems, their gradients against the reference exchanges of the gradients
(bitwise; the expert-major pair weights' dot products within fp32 rounding).
A failure is shrunk to a small problem.

By default each test runs a fixed, derandomized set of examples, so CI sees
the same cases on every run. ``MOE_A2A_PROPERTY_EXAMPLES=N`` runs N examples
per test, drawn afresh on every run (a failure prints the
``@reproduce_failure(...)`` decorator that replays it): for long runs, on the
CPU or on a GPU.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from conftest import (
    assert_bytes_equal,
    make_generator,
    poison_call_regions,
    poison_padding,
    random_tensor,
    random_values,
)

import torch_moe_a2a as a2a
from torch_moe_a2a import layout, reference

# Python environments that ./dev did not make (a GPU image's) may lack it: the [test] extra has it.
pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install hypothesis: the test extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_EXAMPLES = os.environ.get("MOE_A2A_PROPERTY_EXAMPLES")
PROPERTY_SETTINGS = settings(
    max_examples=int(_EXAMPLES) if _EXAMPLES else 100,
    derandomize=not _EXAMPLES,
    deadline=None,  # simulated ranks wait for each other: times vary with the machine's load
    database=None,  # nothing written into the checkout
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]
PAYLOAD_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8, torch.uint8,
                  torch.int32, torch.int64, torch.bool]
COMBINE_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@dataclass(frozen=True)
class Problem:
    ep_size: int
    rounds: tuple[tuple[int, ...], ...]  # local_num_tokens of every rank, per round
    runtime_max: int
    max_num_tokens: int
    top_k: int
    num_experts: int
    ids_dtype: torch.dtype
    distinct_ids: bool  # the top_k ids of a token are distinct (else repeats are drawn)
    negative_fraction: float
    out_of_range_fraction: float
    payloads: tuple[tuple[torch.dtype, tuple[int, ...]], ...]  # dtype and trailing shape of each dispatch payload
    combine_dtype: torch.dtype
    combine_shape: tuple[int, ...]
    output_dtype: Optional[torch.dtype]
    active: Optional[tuple[int, ...]]  # None: every rank; else the ranks of the mask, the others never call
    seed: int
    # expert-major only
    weights: bool = False
    max_tokens_per_expert: Optional[int] = None
    # combines after each round's dispatch (FlashInfer's repeated combines), each of other expert outputs
    combines: tuple[int, ...] = ()

    def combines_of(self, round_index: int) -> int:
        return self.combines[round_index] if self.combines else 1

    def row_bytes(self, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
        return math.prod(shape) * dtype.itemsize

    @property
    def dispatch_bytes(self) -> int:
        return sum(self.row_bytes(d, s) for d, s in self.payloads)

    @property
    def combine_bytes(self) -> int:
        return self.row_bytes(self.combine_dtype, self.combine_shape)


@st.composite
def problems(draw, expert_major: bool) -> Problem:
    ep = draw(st.integers(1, 8))
    top_k = draw(st.one_of(st.integers(1, 8), st.just(layout.MAX_TOP_K)))
    least = max(ep, top_k)
    num_experts = draw(st.integers(least, least + 2 * ep + 1))
    runtime_max = draw(st.integers(1, 12))
    rounds = draw(st.lists(st.tuples(*[st.integers(0, runtime_max)] * ep), min_size=1, max_size=3))
    payloads = draw(st.lists(st.tuples(st.sampled_from(PAYLOAD_DTYPES),
                                       st.lists(st.integers(0, 6), max_size=2).map(tuple)),
                             min_size=1, max_size=layout.MAX_PAYLOADS))
    combine_dtype = draw(st.sampled_from(COMBINE_DTYPES))
    outputs = [None, combine_dtype, torch.bfloat16] + ([torch.float32] if expert_major else [])
    active = None
    if ep > 1 and draw(st.booleans()):
        active = tuple(draw(st.lists(st.sampled_from(range(ep)), min_size=1, max_size=ep, unique=True).map(sorted)))
    return Problem(
        ep_size=ep,
        rounds=tuple(rounds),
        runtime_max=runtime_max,
        max_num_tokens=runtime_max + draw(st.integers(0, 3)),
        top_k=top_k,
        num_experts=num_experts,
        ids_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        # the expert-major layout keeps one pair per (token, expert): its ids are distinct
        distinct_ids=expert_major or draw(st.booleans()),
        negative_fraction=draw(st.sampled_from([0.0, 0.1, 0.5])),
        out_of_range_fraction=draw(st.sampled_from([0.0, 0.1, 0.5])),
        payloads=tuple(payloads),
        combine_dtype=combine_dtype,
        combine_shape=tuple(draw(st.lists(st.integers(1, 8), min_size=1, max_size=2))),
        output_dtype=draw(st.sampled_from(outputs)),
        active=active,
        seed=draw(st.integers(0, 2**32 - 1)),
        weights=expert_major and draw(st.booleans()),
        max_tokens_per_expert=draw(st.one_of(st.none(), st.integers(1, ep * runtime_max))) if expert_major else None,
        combines=tuple(draw(st.lists(st.integers(1, 3), min_size=len(rounds), max_size=len(rounds)))),
    )


def expert_ids(p: Problem, n: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, top_k]`` ids of ``p.ids_dtype``: drawn experts, some replaced by
    negative values (no expert) and by values >= num_experts (skipped and
    counted), over the whole range of the dtype."""
    if p.distinct_ids:
        ids = torch.stack([torch.randperm(p.num_experts, generator=gen)[: p.top_k] for _ in range(n)]) if n else \
            torch.empty(0, p.top_k, dtype=torch.int64)
    else:
        ids = torch.randint(0, p.num_experts, (n, p.top_k), generator=gen)
    ids = ids.to(p.ids_dtype)
    lo, hi = torch.iinfo(p.ids_dtype).min, torch.iinfo(p.ids_dtype).max
    u = torch.rand(ids.shape, generator=gen)
    negative = u < p.negative_fraction
    out_of_range = (u >= p.negative_fraction) & (u < p.negative_fraction + p.out_of_range_fraction)
    # half of them at the edges (-1, num_experts, the dtype's extremes), half anywhere in range
    neg = torch.where(torch.rand(ids.shape, generator=gen) < 0.5, torch.full_like(ids, -1),
                      torch.randint(lo, 0, ids.shape, generator=gen, dtype=torch.int64).to(p.ids_dtype))
    big = torch.where(torch.rand(ids.shape, generator=gen) < 0.5, torch.full_like(ids, p.num_experts),
                      torch.randint(p.num_experts, hi, ids.shape, generator=gen, dtype=torch.int64).to(p.ids_dtype))
    return torch.where(negative, neg, torch.where(out_of_range, big, ids))


def round_inputs(p: Problem, tokens: tuple[int, ...], gen: torch.Generator):
    ids = [expert_ids(p, n, gen) for n in tokens]
    payloads = [[random_tensor((n, *shape), dtype, gen) for dtype, shape in p.payloads] for n in tokens]
    return ids, payloads


def mask_kwargs(p: Problem) -> dict:
    if p.active is None:
        return {}
    return dict(enable_rank_mask=True, active_rank_mask=a2a.moe_a2a_active_rank_mask(list(p.active), p.ep_size))


def output_buffers(p: Problem, tokens, device, gen) -> list[torch.Tensor]:
    """Every rank's combine output, poisoned: the combine must write every byte."""
    dtype = p.combine_dtype if p.output_dtype is None else p.output_dtype
    return [random_tensor((n, *p.combine_shape), dtype, gen).to(device) for n in tokens]


def check_rank_major(p: Problem, device: str) -> None:
    ep, T = p.ep_size, p.runtime_max
    active = list(range(ep)) if p.active is None else list(p.active)
    gen = make_generator(p.seed)
    sim = a2a.SimulatedEP(ep, p.max_num_tokens, dispatch_bytes_per_token=p.dispatch_bytes,
                          combine_bytes_per_token=p.combine_bytes, device=device)
    invalid = [0] * ep
    for round_index, tokens in enumerate(p.rounds):
        ids, payloads = round_inputs(p, tokens, gen)
        poison_call_regions(sim.workspace, gen)
        dev_ids = [t.to(device) for t in ids]
        dev_payloads = [[t.to(device) for t in ps] for ps in payloads]
        results = sim.run(lambda r: None if r not in active else a2a.moe_a2a_dispatch(
            dev_ids[r], dev_payloads[r], sim.workspace, sim.metainfo[r], T, r, ep, p.top_k, p.num_experts,
            **mask_kwargs(p)))
        ref = reference.reference_dispatch(ids, payloads, ep_size=ep, num_experts=p.num_experts,
                                           runtime_max_tokens_per_rank=T, active_ranks=p.active)
        counts = {}
        for d in active:
            counts[d] = a2a.moe_a2a_get_recv_counts(sim.workspace, sim.metainfo[d], d).cpu()
            assert torch.equal(counts[d], ref.recv_counts[d]), f"rank {d}: counts {counts[d].tolist()}"
            for i, (dtype, shape) in enumerate(p.payloads):
                view = results[d][0][i]
                assert tuple(view.shape) == (ep, T, *shape) and view.dtype == dtype, f"rank {d} payload {i}"
                for s in range(ep):
                    c = int(ref.recv_counts[d][s])
                    assert_bytes_equal(view[s, :c], ref.recv[d][i][s, :c], f"rank {d} payload {i} from {s}")
            invalid[d] += ref.invalid_counts[d]
            got = int(a2a.moe_a2a_get_invalid_expert_count(sim.workspace, sim.metainfo[d], d))
            assert got == invalid[d], f"rank {d}: invalid count {got} != {invalid[d]}"
        for k in range(p.combines_of(round_index)):
            ref_expert_out = [random_values((ep, T, *p.combine_shape), p.combine_dtype, gen) for _ in range(ep)]
            expert_out = {d: poison_padding(ref_expert_out[d], counts[d], gen).to(device) for d in active}
            outputs = output_buffers(p, tokens, device, gen)
            combined = sim.run(lambda r: None if r not in active else a2a.moe_a2a_combine(
                expert_out[r], tokens[r], sim.workspace, sim.metainfo[r], T, r, ep, p.top_k, results[r][1],
                output_dtype=p.output_dtype, output=outputs[r], **mask_kwargs(p)))
            expected = reference.reference_combine(ref_expert_out, ref, list(tokens), output_dtype=p.output_dtype)
            for r in active:
                assert combined[r] is outputs[r]
                assert_bytes_equal(combined[r].cpu(), expected[r], f"rank {r} combine {k} output")


def check_expert_major(p: Problem, device: str) -> None:
    ep, T = p.ep_size, p.runtime_max
    active = list(range(ep)) if p.active is None else list(p.active)
    gen = make_generator(p.seed)
    M = p.max_tokens_per_expert
    if M is None:
        M = a2a.expert_major.default_max_tokens_per_expert(ep, T, p.top_k, p.num_experts)
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(
        ep, p.max_num_tokens, p.dispatch_bytes, p.combine_bytes, p.num_experts, p.top_k, M)
    sim = a2a.SimulatedEP(ep, p.max_num_tokens, dispatch_bytes_per_token=0, combine_bytes_per_token=0,
                          device=device, workspace_size_per_rank=size)
    dropped = [0] * ep
    for round_index, tokens in enumerate(p.rounds):
        ids, payloads = round_inputs(p, tokens, gen)
        weights = [torch.rand((n, p.top_k), generator=gen) + 0.25 for n in tokens] if p.weights else None
        poison_call_regions(sim.workspace, gen)
        dev_ids = [t.to(device) for t in ids]
        dev_payloads = [[t.to(device) for t in ps] for ps in payloads]
        dev_weights = None if weights is None else [w.to(device) for w in weights]
        results = sim.run(lambda r: None if r not in active else a2a.moe_a2a_dispatch(
            dev_ids[r], dev_payloads[r], sim.workspace, sim.metainfo[r], T, r, ep, p.top_k, p.num_experts,
            expert_major=True, router_weights=None if dev_weights is None else dev_weights[r],
            max_tokens_per_expert=p.max_tokens_per_expert, **mask_kwargs(p)))
        ref = reference.reference_dispatch_expert_major(ids, payloads, weights, ep_size=ep, num_experts=p.num_experts,
                                                        max_tokens_per_expert=M, active_ranks=p.active)
        expert_counts = {}
        for d in active:
            first, last = layout.expert_range(p.num_experts, ep, d)
            L = last - first
            res = results[d]
            counts = res.expert_counts.cpu()
            assert torch.equal(counts, ref.counts[d]), f"rank {d}: counts {counts.tolist()}"
            assert torch.equal(res.local_expert_ids.cpu(), ref.local_ids[d]), f"rank {d}: local expert ids"
            if p.weights:
                assert_bytes_equal(res.router_weights, ref.weights[d], f"rank {d}: router weights")
            for i, (dtype, shape) in enumerate(p.payloads):
                view = res.output_payloads[i]
                assert tuple(view.shape) == (L, M, *shape) and view.dtype == dtype, f"rank {d} payload {i}"
                for e in range(L):
                    c = int(counts[e])
                    assert_bytes_equal(view[e, :c], ref.planes[d][i][e, :c], f"rank {d} payload {i} expert {e}")
            dropped[d] += ref.dropped[d]
            got = int(a2a.moe_a2a_get_dropped_pair_count(sim.workspace, sim.metainfo[d], d))
            assert got == dropped[d], f"rank {d}: dropped {got} != {dropped[d]}"
            expert_counts[d] = counts
        for k in range(p.combines_of(round_index)):
            ref_expert_out, expert_out = [], {}
            for d in range(ep):
                first, last = layout.expert_range(p.num_experts, ep, d)
                clean = random_values((last - first, M, *p.combine_shape), p.combine_dtype, gen)
                ref_expert_out.append(clean)
                if d not in active:
                    continue
                # padding rows (i >= counts[e]) poisoned: the combine reads valid rows only
                pad = torch.arange(M)[None, :] >= expert_counts[d].long()[:, None]
                poisoned = clean.clone()
                poisoned[pad] = random_tensor(clean.shape, clean.dtype, gen)[pad]
                expert_out[d] = poisoned.to(device)
            outputs = output_buffers(p, tokens, device, gen) if k % 2 else [None] * ep
            combined = sim.run(lambda r: None if r not in active else a2a.moe_a2a_combine_expert_major(
                expert_out[r], results[r], sim.workspace, sim.metainfo[r], r, ep, output_dtype=p.output_dtype,
                output=outputs[r], **mask_kwargs(p)))
            expected = reference.reference_combine_expert_major(ref_expert_out, ref, output_dtype=p.output_dtype)
            for r in active:
                assert outputs[r] is None or combined[r] is outputs[r]
                assert_bytes_equal(combined[r].cpu(), expected[r], f"rank {r} combine {k} output")


@pytest.mark.parametrize("device", DEVICES)
@PROPERTY_SETTINGS
@given(p=problems(expert_major=False))
def test_rank_major_rounds_match_the_reference(device, p):
    check_rank_major(p, device)


@pytest.mark.parametrize("device", DEVICES)
@PROPERTY_SETTINGS
@given(p=problems(expert_major=True))
def test_expert_major_rounds_match_the_reference(device, p):
    check_expert_major(p, device)


# ---- gradients ---------------------------------------------------------------------------------------
# The differentiable functions over the same drawn problems: one combine per
# round (the differentiable combine has no output dtype of its own), then the
# backward of the combine and that of the dispatch, each a collective of its
# own (torch.autograd.grad on every active rank). The floating payloads
# (bf16, fp16, fp32) require grad; the others travel along without one.


def floating(p: Problem) -> list[int]:
    return [i for i, (dtype, _) in enumerate(p.payloads) if dtype in COMBINE_DTYPES]


def backward_bytes(p: Problem) -> tuple[int, int]:
    """Dispatch and combine bytes per token that also fit the backwards'
    rounds: the output gradient dispatched beside the ids (expert-major: and
    the slots), then the floating gradients (expert-major: and a column per
    slot) combined as one fp32 row."""
    packed = 4 * (sum(math.prod(p.payloads[i][1]) for i in floating(p)) + p.top_k)
    return (p.dispatch_bytes + p.combine_bytes + p.top_k * p.ids_dtype.itemsize,
            max(p.combine_bytes, packed) + 4)


def padding_zeroed(plane: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``plane`` ``[ep_size or L, rows, *]`` with rows ``j >= counts[s]`` zero,
    the other rows' bytes as they are. Zeroed as bytes: ``torch.where`` over a
    bool plane may turn the random bytes of a bool payload (random_tensor's,
    which the ops move unchanged) into 0 and 1 (torch 2.11 does on the CPU)."""
    if plane.numel() == 0:
        return plane.clone()
    valid = torch.arange(plane.shape[1])[None, :] < counts.cpu().long()[:, None]
    rows = plane.contiguous().reshape(*plane.shape[:2], -1).view(torch.uint8)
    return torch.where(valid.unsqueeze(2), rows, 0).view(plane.dtype).reshape(plane.shape)


def check_rank_major_gradients(p: Problem, device: str) -> None:
    ep, T = p.ep_size, p.runtime_max
    active = list(range(ep)) if p.active is None else list(p.active)
    gen = make_generator(p.seed)
    dispatch_bytes, combine_bytes = backward_bytes(p)
    sim = a2a.SimulatedEP(ep, p.max_num_tokens, dispatch_bytes_per_token=dispatch_bytes,
                          combine_bytes_per_token=combine_bytes, device=device)
    grads = floating(p)
    for tokens in p.rounds:
        ids, payloads = round_inputs(p, tokens, gen)
        poison_call_regions(sim.workspace, gen)
        dev_ids = [t.to(device) for t in ids]
        leaves = [[t.to(device).requires_grad_(i in grads) for i, t in enumerate(ps)] for ps in payloads]
        results = sim.run(lambda r: None if r not in active else a2a.moe_a2a_dispatch_differentiable(
            dev_ids[r], leaves[r], sim.workspace, sim.metainfo[r], T, r, ep, p.top_k, p.num_experts,
            **mask_kwargs(p)))
        ref = reference.reference_dispatch(ids, payloads, ep_size=ep, num_experts=p.num_experts,
                                           runtime_max_tokens_per_rank=T, active_ranks=p.active)
        for d in active:
            received, _, counts = results[d]
            assert torch.equal(counts.cpu(), ref.recv_counts[d]), f"rank {d}: counts {counts.tolist()}"
            for i in range(len(p.payloads)):
                assert_bytes_equal(received[i], padding_zeroed(ref.recv[d][i], counts), f"rank {d} payload {i}")

        # The combine of expert outputs with poisoned padding rows (ignored, zero gradient).
        clean = [random_values((ep, T, *p.combine_shape), p.combine_dtype, gen) for _ in range(ep)]
        expert_out = {d: poison_padding(clean[d], ref.recv_counts[d], gen).to(device).requires_grad_()
                      for d in active}
        combined = sim.run(lambda r: None if r not in active else a2a.moe_a2a_combine_differentiable(
            expert_out[r], dev_ids[r], sim.workspace, sim.metainfo[r], T, r, ep, p.top_k, p.num_experts,
            results[r][1], **mask_kwargs(p)))
        for r, want in enumerate(reference.reference_combine(clean, ref, list(tokens))):
            if r in active:
                assert_bytes_equal(combined[r], want, f"rank {r} combine")

        # Its backward: the output gradient dispatched along the same routes.
        grad_out = [random_values((n, *p.combine_shape), p.combine_dtype, gen) for n in tokens]
        got = sim.run(lambda r: None if r not in active else torch.autograd.grad(
            combined[r], expert_out[r], grad_out[r].to(device))[0])
        ref_grad = reference.reference_dispatch(ids, [[g] for g in grad_out], ep_size=ep, num_experts=p.num_experts,
                                                runtime_max_tokens_per_rank=T, active_ranks=p.active)
        for d in active:
            assert_bytes_equal(got[d], padding_zeroed(ref_grad.recv[d][0], ref.recv_counts[d]),
                               f"rank {d}: expert outputs' gradient")

        # The dispatch's backward: the received rows' gradients (padding rows
        # poisoned: ignored) combined along the same routes, each in its payload's dtype.
        if not grads:
            continue
        grad_recv = [[random_values((ep, T, *p.payloads[i][1]), p.payloads[i][0], gen) for i in grads]
                     for _ in range(ep)]
        got = sim.run(lambda r: None if r not in active else torch.autograd.grad(
            [results[r][0][i] for i in grads], [leaves[r][i] for i in grads],
            [poison_padding(g, ref.recv_counts[r], gen).to(device) for g in grad_recv[r]]))
        for j, i in enumerate(grads):
            want = reference.reference_combine([g[j] for g in grad_recv], ref, list(tokens))
            for r in active:
                assert_bytes_equal(got[r][j], want[r], f"rank {r}: payload {i}'s gradient")


def check_expert_major_gradients(p: Problem, device: str) -> None:
    ep, T = p.ep_size, p.runtime_max
    active = list(range(ep)) if p.active is None else list(p.active)
    gen = make_generator(p.seed)
    M = p.max_tokens_per_expert
    if M is None:
        M = a2a.expert_major.default_max_tokens_per_expert(ep, T, p.top_k, p.num_experts)
    dispatch_bytes, combine_bytes = backward_bytes(p)
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(
        ep, p.max_num_tokens, dispatch_bytes, combine_bytes, p.num_experts, p.top_k, M)
    sim = a2a.SimulatedEP(ep, p.max_num_tokens, dispatch_bytes_per_token=0, combine_bytes_per_token=0,
                          device=device, workspace_size_per_rank=size)
    grads = floating(p)
    for tokens in p.rounds:
        ids, payloads = round_inputs(p, tokens, gen)
        weights = [torch.rand((n, p.top_k), generator=gen) + 0.25 for n in tokens] if p.weights else None
        poison_call_regions(sim.workspace, gen)
        dev_ids = [t.to(device) for t in ids]
        leaves = [[t.to(device).requires_grad_(i in grads) for i, t in enumerate(ps)] for ps in payloads]
        dev_weights = [None if weights is None else w.to(device).requires_grad_() for w in (weights or [None] * ep)]
        results = sim.run(lambda r: None if r not in active else a2a.moe_a2a_dispatch_expert_major_differentiable(
            dev_ids[r], leaves[r], sim.workspace, sim.metainfo[r], T, r, ep, p.top_k, p.num_experts,
            router_weights=dev_weights[r], max_tokens_per_expert=p.max_tokens_per_expert, **mask_kwargs(p)))

        def ref_dispatch(planes, router_weights):
            return reference.reference_dispatch_expert_major(ids, planes, router_weights, ep_size=ep,
                                                             num_experts=p.num_experts, max_tokens_per_expert=M,
                                                             active_ranks=p.active)

        ref = ref_dispatch(payloads, weights)
        for d in active:
            res = results[d]
            assert torch.equal(res.expert_counts.cpu(), ref.counts[d]), f"rank {d}: counts"
            for i in range(len(p.payloads)):
                assert_bytes_equal(res.output_payloads[i], ref.planes[d][i], f"rank {d} payload {i}")
            if p.weights:
                assert_bytes_equal(res.router_weights, ref.weights[d], f"rank {d}: pair weights")

        # The weighted combine of expert outputs with poisoned padding rows
        # (ignored, zero gradient); the backward of the combine alone (the
        # pair weights' gradient stops there).
        clean, expert_out = [], {}
        for d in range(ep):
            first, last = layout.expert_range(p.num_experts, ep, d)
            clean.append(random_values((last - first, M, *p.combine_shape), p.combine_dtype, gen))
            if d in active:
                expert_out[d] = poison_padding(clean[d], ref.counts[d], gen).to(device).requires_grad_()
        combined = sim.run(lambda r: None if r not in active else a2a.moe_a2a_combine_expert_major_differentiable(
            expert_out[r], results[r], dev_ids[r], sim.workspace, sim.metainfo[r], r, ep, **mask_kwargs(p)))
        for r, want in enumerate(reference.reference_combine_expert_major(clean, ref)):
            if r in active:
                assert_bytes_equal(combined[r], want, f"rank {r} combine")
        grad_out = [random_values((n, *p.combine_shape), p.combine_dtype, gen) for n in tokens]
        got = sim.run(lambda r: None if r not in active else torch.autograd.grad(
            combined[r], [expert_out[r]] + ([results[r].router_weights] if p.weights else []),
            grad_out[r].to(device)))
        G = ref_dispatch([[g] for g in grad_out], None)
        for d in active:
            valid = (torch.arange(M)[None, :] < ref.counts[d].long()[:, None]).reshape(-1, M, *[1] * len(p.combine_shape))
            w = ref.weights[d].reshape(valid.shape)
            rows = G.planes[d][0].float()
            want = torch.where(valid, w * rows, 0.0).to(p.combine_dtype)
            assert_bytes_equal(got[d][0], want, f"rank {d}: expert outputs' gradient")
            if p.weights:
                dots = torch.where(valid, rows * torch.where(valid, clean[d], 0).float(), 0.0)
                dots = dots.reshape(*dots.shape[:2], -1).sum(dim=2)
                torch.testing.assert_close(got[d][1].cpu(), dots, rtol=1e-5, atol=1e-5,
                                           msg=lambda m, d=d: f"rank {d}: pair weights' gradient: {m}")

        # The dispatch's backward: the planes' gradients and the pair weights'
        # (padding rows poisoned: ignored) combined back to the sources'
        # tokens, unweighted, in the combine's order.
        if not grads and not p.weights:
            continue
        grad_planes, grad_pairs, outputs = [], [], {}
        for d in range(ep):
            first, last = layout.expert_range(p.num_experts, ep, d)
            grad_planes.append([random_values((last - first, M, *p.payloads[i][1]), p.payloads[i][0], gen)
                                for i in grads])
            grad_pairs.append(random_values((last - first, M), torch.float32, gen))
            if d in active:
                outputs[d] = [results[d].output_payloads[i] for i in grads]
                given = [poison_padding(g, ref.counts[d], gen).to(device) for g in grad_planes[d]]
                if p.weights:
                    outputs[d].append(results[d].router_weights)
                    given.append(poison_padding(grad_pairs[d], ref.counts[d], gen).to(device))
                outputs[d] = (outputs[d], given)
        got = sim.run(lambda r: None if r not in active else torch.autograd.grad(
            outputs[r][0], [leaves[r][i] for i in grads] + ([dev_weights[r]] if p.weights else []), outputs[r][1]))
        unweighted = ref_dispatch(payloads, None)
        for j, i in enumerate(grads):
            want = reference.reference_combine_expert_major([g[j] for g in grad_planes], unweighted)
            for r in active:
                assert_bytes_equal(got[r][j], want[r], f"rank {r}: payload {i}'s gradient")
        if p.weights:
            # Each router weight gets its pair's gradient (0 where the pair was
            # dropped or not sent): the pairs found by a dispatch of (rank,
            # token) rows with the slot index as the weight.
            sources = [torch.stack([torch.full((n,), s), torch.arange(n)], dim=1).int() for s, n in enumerate(tokens)]
            slots = [torch.arange(p.top_k, dtype=torch.float32).expand(n, p.top_k) for n in tokens]
            pairs = ref_dispatch([[s] for s in sources], slots)
            want = [torch.zeros(n, p.top_k) for n in tokens]
            for d in active:
                valid = torch.arange(M)[None, :] < ref.counts[d].long()[:, None]
                for (s, t), k, value in zip(pairs.planes[d][0][valid].tolist(), pairs.weights[d][valid].long().tolist(),
                                            grad_pairs[d][valid]):
                    want[s][t, k] = value
            for r in active:
                assert_bytes_equal(got[r][-1], want[r], f"rank {r}: router weights' gradient")


@pytest.mark.parametrize("device", DEVICES)
@PROPERTY_SETTINGS
@given(p=problems(expert_major=False))
def test_rank_major_gradients_match_the_reference(device, p):
    check_rank_major_gradients(p, device)


@pytest.mark.parametrize("device", DEVICES)
@PROPERTY_SETTINGS
@given(p=problems(expert_major=True))
def test_expert_major_gradients_match_the_reference(device, p):
    check_expert_major_gradients(p, device)
