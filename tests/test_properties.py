"""Property-based tests: hypothesis draws whole problems (ep_size, per-rank
token counts with zeros, top_k, num_experts not divisible by ep_size, payload
counts, dtypes and trailing shapes, expert ids with negative and out-of-range
values, int32 and int64 ids, rank masks, rounds on one workspace) and checks
every dispatch and combine, rank-major and expert-major, bitwise against the
reference on simulated ranks; a failure is shrunk to a small problem.

By default each test runs a fixed, derandomized set of examples, so CI sees
the same cases on every run. ``MOE_A2A_PROPERTY_EXAMPLES=N`` runs N examples
per test, drawn afresh on every run (hypothesis prints the seed of a failure,
``@seed(...)`` replays it): for long runs, on the CPU or on a GPU.
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
    max_examples=int(_EXAMPLES) if _EXAMPLES else 250,
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
    # expert-major: the ids and the router weights travel as payloads too
    most_payloads = layout.MAX_PAYLOADS - (2 if expert_major else 0)
    payloads = draw(st.lists(st.tuples(st.sampled_from(PAYLOAD_DTYPES),
                                       st.lists(st.integers(0, 6), max_size=2).map(tuple)),
                             min_size=1, max_size=most_payloads))
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
