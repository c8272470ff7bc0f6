"""Gradients through dispatch and combine, rank-major and expert-major
(docs/DESIGN.md, 'Gradients'), on simulated ranks: gradcheck of a whole
exchange, an MoE model of nn.Linear experts whose gradients and training
steps equal the dense model's, opcheck of the ops, torch.compile of a
training step.

The backward of every rank's exchange is a collective, so each rank runs its
own forward and backward in its own thread (SimulatedEP.run)."""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import os
import re
import threading
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import assert_bytes_equal, start_ranks
from torch import nn
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

import torch_moe_a2a as a2a
from torch_moe_a2a import autograd as a2a_autograd
from torch_moe_a2a import errors, fastpath, reference
from torch_moe_a2a.autograd import (
    moe_a2a_combine_differentiable,
    moe_a2a_combine_expert_major_differentiable,
    moe_a2a_dispatch_differentiable,
    moe_a2a_dispatch_expert_major_differentiable,
)


def make_sim(ep_size: int, max_tokens: int, hidden: int, top_k: int, timeout_s: float = 20,
             device="cpu", eplb_stats_num_experts: int = 0) -> a2a.SimulatedEP:
    # Payloads: fp32 hidden, int32 ids, fp32 weights; the combine's rows fp32 hidden.
    return a2a.SimulatedEP(ep_size, max_tokens, dispatch_bytes_per_token=4 * hidden + 8 * top_k + 256,
                           combine_bytes_per_token=4 * hidden + 256, timeout_s=timeout_s, device=device,
                           eplb_stats_num_experts=eplb_stats_num_experts)


def make_em_sim(ep_size: int, max_tokens: int, hidden: int, top_k: int, num_experts: int,
                max_tokens_per_expert=None, timeout_s: float = 20, device="cpu",
                eplb_stats_num_experts: int = 0) -> a2a.SimulatedEP:
    """A workspace for expert-major calls of an fp32 hidden payload: the
    combine's rows hold the dispatch backward's fp32 row, the hidden
    gradient beside a column per top-k slot (docs/DESIGN.md, 'Gradients')."""
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(ep_size, max_tokens, 4 * hidden, 4 * (hidden + top_k),
                                                                num_experts, top_k, max_tokens_per_expert,
                                                                eplb_stats_num_experts)
    return a2a.SimulatedEP(ep_size, max_tokens, dispatch_bytes_per_token=0, combine_bytes_per_token=0,
                           workspace_size_per_rank=size, timeout_s=timeout_s, device=device,
                           eplb_stats_num_experts=eplb_stats_num_experts)


def exchange(sim, rank, ids, x, w, num_experts, runtime_max, expert, mask=None):
    """Dispatch ``[x, ids, w]``, run ``expert(recv_x, recv_ids, recv_w, counts)`` on the received rows, combine."""
    kwargs = dict(enable_rank_mask=mask is not None, active_rank_mask=mask)
    top_k = ids.shape[1]
    recv, offset, counts = moe_a2a_dispatch_differentiable(ids, [x, ids, w], sim.workspace, sim.metainfo[rank],
                                                           runtime_max, rank, sim.ep_size, top_k, num_experts,
                                                           **kwargs)
    y = expert(*recv, counts)
    return moe_a2a_combine_differentiable(y, ids, sim.workspace, sim.metainfo[rank], runtime_max, rank, sim.ep_size,
                                          top_k, num_experts, offset, **kwargs)


# ---- gradcheck -----------------------------------------------------------------------------------------


def dyadic(shape, gen, denominator=8):
    """fp32 values k / denominator with |k| <= 16: sums and products of a few
    of them and of gradcheck's eps = 2**-8 are exact in fp32, so the finite
    differences of an exchange are exact (the combine sums in fp32; fp64
    payloads have no combine)."""
    return torch.randint(-16, 17, shape, generator=gen).float() / denominator


# gradcheck warns about fp32 inputs; dyadic() is why fp32 is exact here.
@pytest.mark.filterwarnings("ignore:Input #.* is not a double precision")
@pytest.mark.parametrize("ep_size,tokens,top_k,num_experts", [(1, 3, 2, 2), (2, 4, 2, 4), (3, 3, 3, 8)])
def test_gradcheck_exchange(ep_size, tokens, top_k, num_experts):
    """Every rank gradchecks and gradgradchecks its own dispatch -> toy
    experts -> combine with respect to its hidden rows and router weights, all
    ranks at once (their calls line up: same shapes, same sequence of
    evaluations; a rank's output depends on its own inputs only, so the peers'
    perturbations do not leak in)."""
    hidden, gen = 3, torch.Generator().manual_seed(ep_size * 100 + top_k)
    sim = make_sim(ep_size, tokens, hidden, top_k)
    ids = [reference.random_routing(tokens, top_k, num_experts, gen, negative_fraction=0.2) for _ in range(ep_size)]
    xs = [dyadic((tokens, hidden), gen).requires_grad_() for _ in range(ep_size)]
    ws = [dyadic((tokens, top_k), gen, 4).requires_grad_() for _ in range(ep_size)]

    def check(rank):
        def expert(recv_x, recv_ids, recv_w, counts):
            return reference.toy_moe(recv_x, recv_ids, recv_w, counts, ep_rank=rank, ep_size=ep_size,
                                     num_experts=num_experts)

        def fn(x, w):
            return exchange(sim, rank, ids[rank], x, w, num_experts, tokens, expert)

        # Second order (the round ops' own backwards, each other), with dyadic
        # output gradients so that it is exact too.
        grad_out = dyadic((tokens, hidden), torch.Generator().manual_seed(rank))
        return (torch.autograd.gradcheck(fn, (xs[rank], ws[rank]), eps=2.0**-8, atol=1e-6, rtol=1e-6)
                and torch.autograd.gradgradcheck(fn, (xs[rank], ws[rank]), (grad_out,), eps=2.0**-8, atol=1e-6,
                                                 rtol=1e-6))

    assert sim.run(check) == [True] * ep_size


def expert_major_exchange(sim, rank, ids, x, w, num_experts, runtime_max, expert, mask=None,
                          max_tokens_per_expert=None):
    """Expert-major dispatch of ``[x]`` with router weights ``w``, ``expert(planes_x, counts)`` on the received
    planes, weighted combine."""
    kwargs = dict(enable_rank_mask=mask is not None, active_rank_mask=mask)
    dispatched = moe_a2a_dispatch_expert_major_differentiable(
        ids, [x], sim.workspace, sim.metainfo[rank], runtime_max, rank, sim.ep_size, ids.shape[1], num_experts,
        router_weights=w, max_tokens_per_expert=max_tokens_per_expert, **kwargs)
    y = expert(dispatched.output_payloads[0], dispatched.expert_counts)
    return moe_a2a_combine_expert_major_differentiable(y, dispatched, ids, sim.workspace, sim.metainfo[rank], rank,
                                                       sim.ep_size, **kwargs)


def scaled_experts(rank, ep_size, num_experts):
    """Stand-in experts on expert-major planes: local expert ``e``'s rows times
    a dyadic factor of its global id (exact in fp32)."""
    first = a2a.local_expert_range(num_experts, ep_size, rank)[0]

    def expert(plane, counts):
        scale = (1 + first + torch.arange(plane.shape[0], dtype=plane.dtype)) / 4
        return plane * scale.view(-1, *([1] * (plane.dim() - 1)))

    return expert


# (ep_size, tokens per rank, top_k, num_experts, masked-off rank, max_tokens_per_expert, a repeated expert)
EM_GRADCHECK_CASES = [
    (1, (3,), 2, 2, None, None, False),
    (2, (4, 0), 2, 4, None, None, False),  # a rank with no tokens
    (3, (3, 2, 3), 3, 8, 1, None, False),  # rank 1 masked off
    (2, (4, 3), 2, 3, None, 2, False),  # pairs beyond max_tokens_per_expert dropped
    (2, (3, 3), 3, 4, None, None, True),  # a token with one expert in two slots: two pairs
]


# gradcheck warns about fp32 inputs; dyadic() is why fp32 is exact here.
@pytest.mark.filterwarnings("ignore:Input #.* is not a double precision")
@pytest.mark.parametrize("ep_size,tokens,top_k,num_experts,masked,max_tokens_per_expert,repeated",
                         EM_GRADCHECK_CASES)
def test_gradcheck_expert_major_exchange(ep_size, tokens, top_k, num_experts, masked, max_tokens_per_expert,
                                         repeated):
    """As test_gradcheck_exchange, through the expert-major dispatch and the
    weighted combine, with respect to the hidden rows and the router weights.
    Every rank's inputs have the same size (its tokens' rows, then rows that
    bypass the exchange) so that all ranks evaluate in step."""
    hidden, T = 3, max(tokens)
    gen = torch.Generator().manual_seed(ep_size * 100 + top_k + sum(tokens))
    sim = make_em_sim(ep_size, T, hidden, top_k, num_experts, max_tokens_per_expert)
    ids = [reference.random_routing(n, top_k, num_experts, gen, negative_fraction=0.2) for n in tokens]
    if repeated:
        for i in ids:
            i[0, 1] = i[0, 0] if i[0, 0] >= 0 else 0
    xs = [dyadic((T, hidden), gen).requires_grad_() for _ in range(ep_size)]
    ws = [dyadic((T, top_k), gen, 4).requires_grad_() for _ in range(ep_size)]
    active = [r for r in range(ep_size) if r != masked]
    mask = None if masked is None else a2a.moe_a2a_active_rank_mask(active, ep_size)

    def check(rank):
        if rank == masked:
            return True
        n, expert = tokens[rank], scaled_experts(rank, ep_size, num_experts)

        def fn(x, w):
            out = expert_major_exchange(sim, rank, ids[rank], x[:n], w[:n], num_experts, T, expert, mask,
                                        max_tokens_per_expert)
            return torch.cat([out, x[n:]])

        grad_out = dyadic((T, hidden), torch.Generator().manual_seed(rank))
        return (torch.autograd.gradcheck(fn, (xs[rank], ws[rank]), eps=2.0**-8, atol=1e-6, rtol=1e-6)
                and torch.autograd.gradgradcheck(fn, (xs[rank], ws[rank]), (grad_out,), eps=2.0**-8, atol=1e-6,
                                                 rtol=1e-6))

    assert sim.run(check) == [True] * ep_size


# ---- an MoE model against the dense one ----------------------------------------------------------------


class Dense(nn.Module):
    """Router, top-k softmax weights, ``num_experts`` nn.Linear experts: the
    whole layer on one rank, the oracle."""

    def __init__(self, hidden, num_experts, top_k):
        super().__init__()
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_experts))
        self.top_k = top_k

    def route(self, x):
        weights, ids = self.router(x).softmax(dim=-1).topk(self.top_k, dim=-1)
        return weights, ids.to(torch.int32)

    def forward(self, x, dropped=range(0)):
        """``dropped``: experts whose tokens are dropped (those of a masked-off rank)."""
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            if e in dropped:
                continue
            coef = (weights * (ids == e)).sum(dim=-1, keepdim=True)
            out = out + coef * expert(x)
        return out


class ExpertParallel(nn.Module):
    """One rank's share of a :class:`Dense` layer: the router replicated, the
    experts this rank owns; tokens go to their experts' ranks and back."""

    def __init__(self, dense, sim, rank, mask=None):
        super().__init__()
        self.router = dense.router
        self.top_k = dense.top_k
        self.num_experts = len(dense.experts)
        self.owned = a2a.local_expert_range(self.num_experts, sim.ep_size, rank)
        self.experts = nn.ModuleList(dense.experts[e] for e in self.owned)
        self.route = dense.route
        self.sim, self.rank, self.mask = sim, rank, mask

    def local_experts(self, recv_x, recv_ids, recv_w, counts):
        out = torch.zeros_like(recv_x)
        for e, expert in zip(self.owned, self.experts):
            coef = (recv_w * (recv_ids == e)).sum(dim=-1, keepdim=True)
            out = out + coef * expert(recv_x)
        return out

    def forward(self, x, runtime_max):
        weights, ids = self.route(x)
        return exchange(self.sim, self.rank, ids, x, weights, self.num_experts, runtime_max, self.local_experts,
                        self.mask)


class ExpertMajorParallel(ExpertParallel):
    """:class:`ExpertParallel` through the expert-major layout: each local
    expert's nn.Linear on its plane of received rows, the router weights
    applied by the combine."""

    def forward(self, x, runtime_max):
        weights, ids = self.route(x)

        def experts(plane, counts):
            return torch.stack([expert(rows) for expert, rows in zip(self.experts, plane)])

        return expert_major_exchange(self.sim, self.rank, ids, x, weights, self.num_experts, runtime_max, experts,
                                     self.mask)


class Model(nn.Module):
    """Two MoE layers sharing one workspace, with residuals: the second
    layer's exchanges run while the first layer's experts still hold their
    inputs for the backward."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x, *args):
        for layer in self.layers:
            x = x + layer(x, *args)
        return x


def dense_model(hidden, num_experts, top_k, seed):
    torch.manual_seed(seed)
    return Model([Dense(hidden, num_experts, top_k) for _ in range(2)])


def rank_copies(dense, sim, mask=None, parallel=ExpertParallel):
    """Each rank's expert-parallel model (layers of class ``parallel``) over a
    deep copy of ``dense`` (its own router and experts)."""
    models = []
    for rank in range(sim.ep_size):
        mine = copy.deepcopy(dense)
        models.append(Model([parallel(layer, sim, rank, mask) for layer in mine.layers]))
    return models


def training_data(tokens, hidden, steps, gen, device="cpu"):
    """Every step's inputs and targets, a list per rank."""
    batches = [[torch.randn(n, hidden, generator=gen).to(device) for n in tokens] for _ in range(steps)]
    targets = [[torch.randn(n, hidden, generator=gen).to(device) for n in tokens] for _ in range(steps)]
    return batches, targets


@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
@pytest.mark.parametrize("ep_size,tokens,top_k,num_experts,masked", [
    (2, (5, 7), 2, 4, None),
    (3, (4, 0, 6), 2, 6, None),  # a rank with no tokens
    (4, (3, 3, 3, 3), 3, 4, None),
    (3, (4, 0, 5), 2, 6, 1),  # rank 1 masked off: its experts' shares are dropped
])
def test_moe_training_steps_equal_dense(ep_size, tokens, top_k, num_experts, masked, layout, device):
    """Three SGD steps of the expert-parallel model (every rank its tokens)
    give the dense model's loss and parameters: the router's gradients summed
    over the ranks (a data-parallel all-reduce, here a plain sum), each
    expert's from its owner. On CUDA each rank's forward and backward run on
    its own stream, the host launching rank after rank."""
    hidden, steps, lr = 8, 3, 0.1
    gen = torch.Generator().manual_seed(sum(tokens))
    dense = dense_model(hidden, num_experts, top_k, seed=ep_size).to(device)
    if layout == "rank-major":
        sim, parallel = make_sim(ep_size, max(tokens), hidden, top_k, device=device), ExpertParallel
    else:
        sim = make_em_sim(ep_size, max(tokens), hidden, top_k, num_experts, device=device)
        parallel = ExpertMajorParallel
    active = [r for r in range(ep_size) if r != masked]
    mask = None if masked is None else a2a.moe_a2a_active_rank_mask(active, ep_size)
    dropped = range(0) if masked is None else a2a.local_expert_range(num_experts, ep_size, masked)
    models = rank_copies(dense, sim, mask, parallel)
    batches, targets = training_data(tokens, hidden, steps, gen, device)
    dense_opt = torch.optim.SGD(dense.parameters(), lr=lr)
    for step in range(steps):
        x = torch.cat(batches[step]).requires_grad_()
        dense_opt.zero_grad()
        dense_loss = ((dense(x, dropped) - torch.cat(targets[step])) ** 2).sum()
        dense_loss.backward()

        def rank_step(rank):
            if rank == masked:
                return torch.zeros((), device=device), torch.zeros(0, hidden, device=device)
            model = models[rank]
            model.zero_grad()
            xr = batches[step][rank].clone().requires_grad_()
            loss = ((model(xr, max(tokens)) - targets[step][rank]) ** 2).sum()
            loss.backward()
            return loss.detach(), xr.grad

        results = sim.run(rank_step)
        torch.testing.assert_close(sum(loss for loss, _ in results), dense_loss.detach(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.cat([g for _, g in results]), x.grad, rtol=1e-4, atol=1e-4)
        for layer, dense_layer in zip(zip(*[m.layers for m in models]), dense.layers):
            router_grad = sum(rank_layer.router.weight.grad for rank_layer in layer if rank_layer.rank != masked)
            torch.testing.assert_close(router_grad, dense_layer.router.weight.grad, rtol=1e-4, atol=1e-4)
            for rank_layer in layer:
                for e, expert in zip(rank_layer.owned, rank_layer.experts):
                    for p, q in zip(expert.parameters(), dense_layer.experts[e].parameters()):
                        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
        dense_opt.step()
        with torch.no_grad():
            for rank_layers, dense_layer in zip(zip(*[m.layers for m in models]), dense.layers):
                for rank_layer in rank_layers:
                    if rank_layer.rank == masked:
                        continue
                    # The data-parallel router: every rank steps with the summed gradient.
                    rank_layer.router.weight.copy_(dense_layer.router.weight)
                    for e, expert in zip(rank_layer.owned, rank_layer.experts):
                        for p, q in zip(expert.parameters(), dense_layer.experts[e].parameters()):
                            p.sub_(lr * p.grad)
                            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4)


# ---- opcheck and torch.compile -------------------------------------------------------------------------


def _one_rank_route(sim, ids, hidden_rows):
    return a2a_autograd._route_args("test", ids, [hidden_rows], sim.workspace, sim.metainfo[0], ids.shape[0], 0, 1,
                                    ids.shape[1], 4, None, False, None, None)


@pytest.mark.parametrize("round_tag", [0, 7])
@pytest.mark.parametrize("op", ["dispatch_round", "combine_round", "dispatch_em_round", "combine_em_round"])
def test_opcheck_round_ops(op, round_tag):
    """opcheck's autograd, FakeTensor and AOTAutograd checks on a rank of
    its own (each call a whole round), with a round tag (which a one-rank
    round meets in its own signature) and with none (0, the default, which
    the dispatcher leaves out of the call's arguments, and the backward's
    gradients follow). Not test_schema: the ops write into the
    workspace where the dispatcher does not look (torch_moe_a2a/autograd.py
    says why that is sound). dispatch_owned, combine_owned and their
    expert-major twins are half rounds, which opcheck's repeated calls of one
    op would break; the gradchecks and the compiled steps below run them."""
    gen = torch.Generator().manual_seed(3)
    tokens, top_k, hidden, num_experts = 5, 2, 6, 4
    ids = reference.random_routing(tokens, top_k, num_experts, gen, negative_fraction=0.3)
    if op in ("dispatch_round", "combine_round"):
        sim = make_sim(1, tokens, hidden, top_k)
        route = _one_rank_route(sim, ids, torch.empty(tokens, hidden))
        if op == "dispatch_round":
            rows = torch.randn((tokens, hidden), generator=gen, requires_grad=True)
        else:  # two planes of two dtypes: the round's repeated combines
            rows = [torch.randn((1, tokens, hidden), generator=gen, requires_grad=True),
                    torch.randn((1, tokens, 2), generator=gen).half().requires_grad_()]
        args = (rows, ids, sim.workspace, *route, round_tag)
    else:
        M = 3  # fewer rows than pairs for an expert: some dropped
        sim = make_em_sim(1, tokens, hidden, top_k, num_experts, M)
        route = _one_rank_route(sim, ids, torch.empty(tokens, hidden))
        rows, values = ((tokens, hidden), (tokens, top_k)) if op == "dispatch_em_round" else \
            ((num_experts, M, hidden), (num_experts, M))
        args = (torch.randn(rows, generator=gen, requires_grad=True),
                torch.randn(values, generator=gen, requires_grad=True), ids, sim.workspace, M, *route, round_tag)
    torch.library.opcheck(getattr(torch.ops.moe_a2a, op).default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def compiled_train_step(x, w, ids, workspace, metainfo, runtime_max, rank, ep_size, top_k, num_experts):
    """An exchange whose stand-in expert is one multiply per element, exact in any evaluation order."""
    recv, offset, _ = moe_a2a_dispatch_differentiable(ids, [x, ids, w], workspace, metainfo, runtime_max, rank,
                                                      ep_size, top_k, num_experts)
    y = recv[0] * recv[2][..., :1]
    return moe_a2a_combine_differentiable(y, ids, workspace, metainfo, runtime_max, rank, ep_size, top_k,
                                          num_experts, offset)


def compiled_train_step_expert_major(x, w, ids, workspace, metainfo, runtime_max, rank, ep_size, top_k,
                                     num_experts):
    """The expert-major exchange with the router weights applied by the
    combine; its stand-in expert one multiply per element."""
    dispatched = moe_a2a_dispatch_expert_major_differentiable(ids, [x], workspace, metainfo, runtime_max, rank,
                                                              ep_size, top_k, num_experts, router_weights=w)
    y = dispatched.output_payloads[0] * 1.5
    return moe_a2a_combine_expert_major_differentiable(y, dispatched, ids, workspace, metainfo, rank, ep_size)


class _Forwarding(TorchDispatchMode):
    """A dispatch mode that changes nothing but makes the differentiable
    functions call their ops through the dispatcher (autograd._call)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_eager_calls_skip_the_dispatcher_and_equal_its_results(layout, device):
    """Eager forward and backward run the ops' Python functions (no
    moe_a2a::*_owned or *_round op on the profile, the workspace ops inside
    them are there) and give bitwise the outputs, first and second order
    gradients of the same step through the dispatcher."""
    tokens, top_k, num_experts, hidden = 6, 2, 4, 8
    gen = torch.Generator().manual_seed(12)
    if layout == "rank-major":
        sim, step = make_sim(1, tokens, hidden, top_k, device=device), compiled_train_step
        ops = ("dispatch_owned", "combine_owned", "dispatch_round", "combine_round")
    else:
        sim, step = make_em_sim(1, tokens, hidden, top_k, num_experts, device=device), compiled_train_step_expert_major
        ops = ("dispatch_em_owned", "combine_em_owned", "dispatch_em_round", "combine_em_round")
    ids = reference.random_routing(tokens, top_k, num_experts, gen).to(device)
    x0 = torch.randn(tokens, hidden, generator=gen).to(device)
    w0 = torch.rand(tokens, top_k, generator=gen).to(device)
    grad_out = torch.randn(tokens, hidden, generator=gen).to(device)

    def run():
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = step(x, w, ids, sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k, num_experts)
        gx, gw = torch.autograd.grad(out, (x, w), grad_out, create_graph=True)
        ggx = torch.autograd.grad((gx * gx).sum() + (gw * gw).sum(), x)[0]
        return [t.detach() for t in (out, gx, gw, ggx)]

    def profiled(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            result = fn()
        return result, {e.name for e in prof.events()}

    eager, eager_names = profiled(run)
    with _Forwarding():
        dispatched, dispatched_names = profiled(run)
    for op in ops:
        assert f"moe_a2a::{op}" not in eager_names, f"{op} went through the dispatcher in eager mode"
        assert f"moe_a2a::{op}" in dispatched_names, f"{op} did not run under the dispatch mode"
    workspace_op = "moe_a2a::dispatch" if layout == "rank-major" else "moe_a2a::dispatch_expert_major"
    assert workspace_op in eager_names and workspace_op in dispatched_names
    for got, want in zip(eager, dispatched):
        assert torch.equal(got, want)


@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_compiled_training_step_equals_eager(layout):
    """torch.compile(fullgraph=True) of the forward (AOTAutograd traces the
    backward as calls of the round ops): outputs and the hidden rows'
    gradients bitwise equal to eager, the router weights' (a sum over the row,
    in Inductor's order) to rounding, every rank compiling its own graph in its
    own thread."""
    torch._dynamo.reset()
    ep_size, tokens, top_k, num_experts, hidden = 2, (6, 3), 2, 4, 8
    gen = torch.Generator().manual_seed(5)
    # A rank waits inside an exchange while its peer compiles (the backward
    # too, at its first call): seconds on a loaded machine.
    if layout == "rank-major":
        sim, step = make_sim(ep_size, max(tokens), hidden, top_k, timeout_s=120), compiled_train_step
    else:
        sim = make_em_sim(ep_size, max(tokens), hidden, top_k, num_experts, timeout_s=120)
        step = compiled_train_step_expert_major
    ids = [reference.random_routing(n, top_k, num_experts, gen) for n in tokens]
    xs = [torch.randn(n, hidden, generator=gen) for n in tokens]
    ws = [torch.rand(n, top_k, generator=gen) for n in tokens]
    targets = [torch.randn(n, hidden, generator=gen) for n in tokens]

    def run(step):
        def rank_step(rank):
            x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
            out = step(x, w, ids[rank], sim.workspace, sim.metainfo[rank], max(tokens), rank, ep_size, top_k,
                       num_experts)
            (out * targets[rank]).sum().backward()
            return out.detach(), x.grad, w.grad

        return sim.run(rank_step)

    eager = run(step)
    compiled = torch.compile(step, fullgraph=True)
    for _ in range(2):
        for (out, x_grad, w_grad), (out_e, x_grad_e, w_grad_e) in zip(run(compiled), eager):
            assert torch.equal(out, out_e) and torch.equal(x_grad, x_grad_e)
            torch.testing.assert_close(w_grad, w_grad_e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_compiled_training_step_copies_no_workspace(layout):
    """The compiled forward and backward call the layout's four ops on the
    caller's workspace: no buffer of the workspace's size, no copy into it."""
    torch._dynamo.reset()
    tokens, top_k, num_experts, hidden = 5, 2, 4, 8
    gen = torch.Generator().manual_seed(6)
    if layout == "rank-major":
        sim, step = make_sim(1, tokens, hidden, top_k), compiled_train_step
        ops = ("dispatch_owned", "combine_owned", "dispatch_round", "combine_round")
    else:
        sim, step = make_em_sim(1, tokens, hidden, top_k, num_experts), compiled_train_step_expert_major
        ops = ("dispatch_em_owned", "combine_em_owned", "dispatch_em_round", "combine_em_round")
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    w = torch.rand(tokens, top_k, generator=gen, requires_grad=True)
    compiled = torch.compile(step, fullgraph=True)

    def forward_backward():
        out = compiled(x, w, ids, sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k, num_experts)
        out.sum().backward()
        return out

    _, codes = run_and_get_code(forward_backward)
    text = "\n".join(codes)
    for op in ops:
        assert f"moe_a2a.{op}" in text, f"{op} must be called from the compiled code"
    rows, size = sim.workspace.shape
    for line in text.splitlines():
        if re.search(r"empty_strided|empty\(|\.clone\(|copy_\(", line):
            assert not re.search(rf"\b({size}|{rows * size})\b", line), f"workspace-sized buffer: {line.strip()}"
    assert x.grad is not None and w.grad is not None


# ---- activation checkpointing --------------------------------------------------------------------------


def _checkpointed(fn, context_fn=None):
    """``fn`` under non-reentrant activation checkpointing, with ``context_fn`` if given."""
    from torch.utils.checkpoint import checkpoint

    def wrapped(*args):
        kwargs = {} if context_fn is None else {"context_fn": context_fn}
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return wrapped


def test_checkpoint_policy_saves_exactly_the_exchanges():
    """Every moe_a2a op is saved, every other op left to recomputation; a
    policy of one's own decides the other ops and is never asked about an
    exchange."""
    from torch.utils.checkpoint import CheckpointPolicy

    ops = torch.ops.moe_a2a
    for op in (ops.dispatch_owned.default, ops.combine_owned.default, ops.dispatch_round.default,
               ops.combine_round.default, ops.dispatch_em_owned.default, ops.combine_em_round.default,
               ops.dispatch.default, ops.combine.default):
        assert a2a.checkpoint_policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    for op in (torch.ops.aten.mm.default, torch.ops.aten.mul.Tensor):
        assert a2a.checkpoint_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE, op

    asked = []

    def mine(ctx, op, *args, **kwargs):
        asked.append(op)
        return CheckpointPolicy.MUST_SAVE

    tokens, top_k, num_experts, hidden = 4, 2, 4, 8
    sim = make_sim(1, tokens, hidden, top_k)
    gen = torch.Generator().manual_seed(21)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    w = torch.rand(tokens, top_k, generator=gen, requires_grad=True)
    context = functools.partial(a2a.checkpoint_context, mine)
    out = _checkpointed(compiled_train_step, context)(x, w, ids, sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k,
                                                      num_experts)
    out.sum().backward()
    assert asked and all(op.namespace == "aten" for op in asked), asked


def _partial_layer(layout, sim, ids, x, w, tokens, top_k, num_experts, context_fn):
    """Dispatch and expert under checkpointing (``context_fn`` None: plain
    checkpointing), the combine outside it; returns the output."""
    if layout == "rank-major":
        def region(x, w):
            recv, offset, _ = moe_a2a_dispatch_differentiable(ids, [x, ids, w], sim.workspace, sim.metainfo[0], tokens,
                                                              0, 1, top_k, num_experts)
            return recv[0] * recv[2][..., :1], offset

        y, offset = _checkpointed(region, context_fn)(x, w)
        return moe_a2a_combine_differentiable(y, ids, sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k,
                                              num_experts, offset)

    def region(x, w):
        dispatched = moe_a2a_dispatch_expert_major_differentiable(ids, [x], sim.workspace, sim.metainfo[0], tokens, 0,
                                                                  1, top_k, num_experts, router_weights=w)
        return dispatched.output_payloads[0] * 1.5, dispatched

    y, dispatched = _checkpointed(region, context_fn)(x, w)
    return moe_a2a_combine_expert_major_differentiable(y, dispatched, ids, sim.workspace, sim.metainfo[0], 0, 1)


@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_a_checkpointed_dispatch_without_its_combine(layout, device):
    """A checkpointed region that holds a dispatch and its expert but not the
    combine: its recomputation re-runs the dispatch alone, which the next
    exchange refuses with an error that names checkpoint_context (on the CPU,
    which refuses it at once; CUDA records it for a later call); with
    context_fn=checkpoint_context the dispatch is saved, and the output and
    the gradients are bitwise those of the layer without checkpointing."""
    tokens, top_k, num_experts, hidden = 5, 2, 4, 8
    sim = make_sim(1, tokens, hidden, top_k, device=device) if layout == "rank-major" else \
        make_em_sim(1, tokens, hidden, top_k, num_experts, device=device)
    gen = torch.Generator().manual_seed(22)
    ids = reference.random_routing(tokens, top_k, num_experts, gen).to(device)
    x0 = torch.randn(tokens, hidden, generator=gen).to(device)
    w0 = torch.rand(tokens, top_k, generator=gen).to(device)
    target = torch.randn(tokens, hidden, generator=gen).to(device)

    def run(checkpointing, context_fn=None):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        if checkpointing:
            out = _partial_layer(layout, sim, ids, x, w, tokens, top_k, num_experts, context_fn)
        else:
            step = compiled_train_step if layout == "rank-major" else compiled_train_step_expert_major
            out = step(x, w, ids, sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k, num_experts)
        (out * target).sum().backward()
        return out.detach(), x.grad, w.grad

    want = run(False)
    if device == "cpu":
        with pytest.raises(RuntimeError, match="checkpoint_context"):
            run(True)
        sim.reset()
    for got, expected in zip(run(True, a2a.checkpoint_context), want):
        assert torch.equal(got, expected)


def _two_layer_exchanges(layout, tokens, hidden, top_k, num_experts, gen, device="cpu"):
    """One rank's differentiable exchanges for two layers of one workspace, in
    ``layout``: ``dispatch(x, i)`` -> (rows, what combine needs) and
    ``combine(y, routed, i)``, layer ``i``'s ids (and, expert-major, router
    weights) drawn from ``gen``."""
    sim = make_sim(1, tokens, hidden, top_k, device=device) if layout == "rank-major" else \
        make_em_sim(1, tokens, hidden, top_k, num_experts, device=device)
    ids = [reference.random_routing(tokens, top_k, num_experts, gen).to(device) for _ in range(2)]
    w = [torch.rand(tokens, top_k, generator=gen).to(device) for _ in range(2)]

    def dispatch(x, i):
        if layout == "rank-major":
            (rows,), offset, _ = moe_a2a_dispatch_differentiable(ids[i], [x], sim.workspace, sim.metainfo[0], tokens,
                                                                 0, 1, top_k, num_experts)
            return rows, offset
        dispatched = moe_a2a_dispatch_expert_major_differentiable(ids[i], [x], sim.workspace, sim.metainfo[0], tokens,
                                                                  0, 1, top_k, num_experts, router_weights=w[i])
        return dispatched.output_payloads[0], dispatched

    def combine(y, routed, i):
        if layout == "rank-major":
            return moe_a2a_combine_differentiable(y, ids[i], sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k,
                                                  num_experts, routed)
        return moe_a2a_combine_expert_major_differentiable(y, routed, ids[i], sim.workspace, sim.metainfo[0], 0, 1)

    return dispatch, combine


@pytest.mark.parametrize("region", ["combine", "combine-and-next-dispatch"])
@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_checkpoint_context_on_a_combine_without_its_dispatch(layout, region, device):
    """Two layers; a region under context_fn=checkpoint_context holds layer
    1's expert and combine but not its dispatch (and, in the second form,
    layer 2's dispatch too). The recomputation hands the saved exchanges
    back, after layer 2's dispatch and backward rounds: the combine's checks
    against the rank's last dispatch are not made there (they would compare
    with layer 2's ids). Outputs and gradients are bitwise those without
    checkpointing."""
    tokens, top_k, num_experts, hidden = 5, 2, 4, 8
    gen = torch.Generator().manual_seed(23 + 2 * (layout == "expert-major") + (region == "combine"))
    dispatch, combine = _two_layer_exchanges(layout, tokens, hidden, top_k, num_experts, gen, device)
    x0 = torch.randn(tokens, hidden, generator=gen).to(device)
    weight0 = torch.randn(hidden, hidden, generator=gen).to(device)

    def experts_and_combine(rows, routed, weight, i):
        return combine(torch.tanh(rows @ weight), routed, i)

    def run(checkpointing):
        x, weight = x0.clone().requires_grad_(), weight0.clone().requires_grad_()
        rows, routed = dispatch(x, 0)
        later = {}

        def block(rows, x):
            h = x + experts_and_combine(rows, routed, weight, 0)
            if region == "combine-and-next-dispatch":
                later["rows"], later["routed"] = dispatch(h, 1)
            return h

        h = _checkpointed(block, a2a.checkpoint_context)(rows, x) if checkpointing else block(rows, x)
        rows2, routed2 = (later["rows"], later["routed"]) if later else dispatch(h, 1)
        out = h + experts_and_combine(rows2, routed2, weight, 1)
        out.square().sum().backward()
        return out.detach(), x.grad, weight.grad

    want = run(False)
    for got, expected in zip(run(True), want):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("checkpointing", ["non-reentrant", "reentrant", "selective, recomputing everything"])
@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_eager_checkpoint_of_a_combine_without_its_dispatch_names_the_fix(layout, checkpointing):
    """An eager checkpointed region that holds a combine but not its
    dispatch, without checkpoint_context: the recomputation's combine, after
    the later layer's backward rounds, is refused, and the error says it is a
    checkpointed region's recomputation and names checkpoint_context (it
    spoke of combines after a backward, or of a compiled step's partitioner,
    with nothing compiled)."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    tokens, top_k, num_experts, hidden = 5, 2, 4, 8
    gen = torch.Generator().manual_seed(31)
    dispatch, combine = _two_layer_exchanges(layout, tokens, hidden, top_k, num_experts, gen)
    x = torch.randn(tokens, hidden, generator=gen).requires_grad_()
    weight = torch.randn(hidden, hidden, generator=gen).requires_grad_()

    def experts_and_combine(rows, routed, i):
        return combine(torch.tanh(rows @ weight), routed, i)

    rows, routed = dispatch(x, 0)
    if checkpointing == "selective, recomputing everything":
        def context_fn():
            return create_selective_checkpoint_contexts(lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)

        h = x + checkpoint(experts_and_combine, rows, routed, 0, use_reentrant=False, context_fn=context_fn)
        error, match = RuntimeError, "recomputed in the backward without its dispatch .* a selective checkpointing policy"
    else:
        h = x + checkpoint(experts_and_combine, rows, routed, 0, use_reentrant=checkpointing == "reentrant")
        error, match = ValueError, "here, inside a backward, a checkpointed region's recomputation of a combine"
    rows2, routed2 = dispatch(h, 1)
    out = h + experts_and_combine(rows2, routed2, 1)
    with pytest.raises(error, match=match + ".*context_fn=torch_moe_a2a.checkpoint_context"):
        out.square().sum().backward()


def test_a_plain_expert_major_dispatch_refusal_names_its_differentiable_form():
    """A combine that needs a gradient after a plain expert-major dispatch
    names the expert-major differentiable dispatch (it named the rank-major one)."""
    tokens, top_k, num_experts, hidden = 4, 2, 4, 8
    sim = make_em_sim(1, tokens, hidden, top_k, num_experts)
    ids = reference.random_routing(tokens, top_k, num_experts, torch.Generator().manual_seed(5))
    got = a2a.moe_a2a_dispatch_expert_major(ids, [torch.randn(tokens, hidden)], sim.workspace, sim.metainfo[0],
                                            tokens, 0, 1, top_k, num_experts,
                                            router_weights=torch.rand(tokens, top_k))
    y = got.output_payloads[0].clone().requires_grad_()
    with pytest.raises(ValueError, match=r"\(or call moe_a2a_dispatch_expert_major_differentiable\)"):
        a2a.moe_a2a_combine_expert_major(y, got, sim.workspace, sim.metainfo[0], 0, 1)
    a2a.moe_a2a_combine_expert_major(y.detach(), got, sim.workspace, sim.metainfo[0], 0, 1)


CHECKPOINTINGS = ["none", "early-stop", "no-early-stop", "checkpoint_context", "reentrant"]


@pytest.mark.parametrize("checkpointing", CHECKPOINTINGS)
@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
@pytest.mark.parametrize("api", ["plain", "MoeAlltoAll"])
def test_checkpointed_layers_of_the_plain_functions_and_moe_alltoall(api, layout, checkpointing):
    """A layer of the plain functions, or of MoeAlltoAll, with payloads that
    require grad, checkpointed whole: non-reentrant with torch's early stop
    (the recomputation stops inside the combine, once the combine has saved
    the last tensor the backward needs) and without it, with
    context_fn=checkpoint_context (a dispatch mode, which the plain functions
    take as eager), and reentrant. Three steps in a row, each output and
    gradient bitwise those of the layer without checkpointing (the combine
    is the layer's last op that saves a tensor)."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    tokens, top_k, num_experts, hidden = 5, 2, 4, 8
    expert_major = layout == "expert-major"
    gen = torch.Generator().manual_seed(29)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    if api == "MoeAlltoAll":
        moe = a2a.MoeAlltoAll(a2a.Mapping(world_size=1, rank=0, moe_ep_size=1), tokens, top_k, num_experts,
                              hidden_size=hidden, dtype=torch.float32, expert_major=expert_major)

        def layer(x, w):
            if expert_major:
                dispatched = moe.dispatch(ids, [x], tokens, router_weights=w)
                return moe.combine(dispatched.output_payloads[0] * 1.5, tokens)
            (recv,) = moe.dispatch(ids, [x * w[:, :1]], tokens)
            return moe.combine(recv * 1.5, tokens)
    else:
        sim = make_sim(1, tokens, hidden, top_k) if not expert_major else \
            make_em_sim(1, tokens, hidden, top_k, num_experts)

        def layer(x, w):
            if expert_major:
                dispatched = a2a.moe_a2a_dispatch(ids, [x], sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k,
                                                  num_experts, expert_major=True, router_weights=w)
                return a2a.moe_a2a_combine_expert_major(dispatched.output_payloads[0] * 1.5, dispatched,
                                                        sim.workspace, sim.metainfo[0], 0, 1)
            (recv,), offset, _ = a2a.moe_a2a_dispatch(ids, [x * w[:, :1]], sim.workspace, sim.metainfo[0], tokens,
                                                      0, 1, top_k, num_experts)
            return a2a.moe_a2a_combine(recv * 1.5, tokens, sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k,
                                       offset)

    def step(x0, w0, target, how):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with set_checkpoint_early_stop(how != "no-early-stop"):
            if how == "none":
                out = layer(x, w)
            elif how == "reentrant":
                out = checkpoint(layer, x, w, use_reentrant=True)
            else:
                context = {"context_fn": a2a.checkpoint_context} if how == "checkpoint_context" else {}
                out = checkpoint(layer, x, w, use_reentrant=False, **context)
            (out * target).sum().backward()
        return out.detach(), x.grad, w.grad

    for _ in range(3):
        x0, w0 = torch.randn(tokens, hidden, generator=gen), torch.rand(tokens, top_k, generator=gen)
        target = torch.randn(tokens, hidden, generator=gen)
        want = step(x0, w0, target, "none")
        for name, got, expected in zip(("output", "x.grad", "w.grad"), step(x0, w0, target, checkpointing), want):
            assert_bytes_equal(got, expected, name)


@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_compiled_checkpointed_training_step(layout):
    """torch.compile(fullgraph=True) of a checkpointed exchange: the
    partitioner recomputes the dispatch in the backward (its expert saved the
    received rows) without the combine, which is refused naming
    checkpoint_context; with context_fn=checkpoint_context the compiled
    output and gradients equal eager's without checkpointing."""
    torch._dynamo.reset()
    tokens, top_k, num_experts, hidden = 5, 2, 4, 8
    if layout == "rank-major":
        sim, step = make_sim(1, tokens, hidden, top_k), compiled_train_step
    else:
        sim, step = make_em_sim(1, tokens, hidden, top_k, num_experts), compiled_train_step_expert_major
    gen = torch.Generator().manual_seed(23)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    x0 = torch.randn(tokens, hidden, generator=gen)
    w0 = torch.rand(tokens, top_k, generator=gen)

    def run(fn):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = fn(x, w, ids, sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k, num_experts)
        out.sum().backward()
        return out.detach(), x.grad, w.grad

    want = run(step)
    with pytest.raises(RuntimeError, match="checkpoint_context"):
        run(torch.compile(_checkpointed(step), backend="aot_eager", fullgraph=True))
    sim.reset()
    torch._dynamo.reset()
    got = run(torch.compile(_checkpointed(step, a2a.checkpoint_context), backend="aot_eager", fullgraph=True))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_compiled_checkpointed_combine_without_its_dispatch(layout):
    """torch.compile of two layers, layer 1's expert and combine in a
    checkpointed region without its dispatch, the backward reading the
    combine's output: the partitioner recomputes the combine in the backward,
    where it would run as a combine of layer 2's round (wrong gradients, and
    compiled calls make no host checks). The combine op refuses to run
    inside a backward that did not recompute its dispatch; with
    context_fn=checkpoint_context the gradients are eager's."""
    torch._dynamo.reset()
    tokens, top_k, num_experts, hidden = 5, 2, 4, 8
    sim = make_sim(1, tokens, hidden, top_k) if layout == "rank-major" else \
        make_em_sim(1, tokens, hidden, top_k, num_experts)
    gen = torch.Generator().manual_seed(24)
    ids = [reference.random_routing(tokens, top_k, num_experts, gen) for _ in range(2)]
    x0 = torch.randn(tokens, hidden, generator=gen)
    weight0 = torch.randn(hidden, hidden, generator=gen) / 3

    def layer(x, i, weight, context_fn):
        ws, meta = sim.workspace, sim.metainfo[0]
        if layout == "rank-major":
            (rows,), offset, _ = moe_a2a_dispatch_differentiable(ids[i], [x], ws, meta, tokens, 0, 1, top_k,
                                                                 num_experts)

            def experts_and_combine(rows, weight):
                return moe_a2a_combine_differentiable(torch.tanh(rows @ weight), ids[i], ws, meta, tokens, 0, 1,
                                                      top_k, num_experts, offset)
        else:
            dispatched = moe_a2a_dispatch_expert_major_differentiable(ids[i], [x], ws, meta, tokens, 0, 1, top_k,
                                                                      num_experts)
            rows = dispatched.output_payloads[0]

            def experts_and_combine(rows, weight):
                return moe_a2a_combine_expert_major_differentiable(torch.tanh(rows @ weight), dispatched, ids[i], ws,
                                                                   meta, 0, 1)
        if context_fn is False:
            return experts_and_combine(rows, weight)
        return _checkpointed(experts_and_combine, context_fn)(rows, weight)

    def model(x, weight, context_fn):
        c1 = layer(x, 0, weight, context_fn)
        return c1 * layer(x + c1, 1, weight, False)  # the product's backward reads c1

    def run(fn, context_fn):
        x, weight = x0.clone().requires_grad_(), weight0.clone().requires_grad_()
        fn(x, weight, context_fn).sum().backward()
        return x.grad, weight.grad

    want = run(model, False)
    with pytest.raises(RuntimeError, match="recomputed in the backward without its dispatch"):
        run(torch.compile(model, backend="aot_eager", fullgraph=True), None)
    sim.reset()
    torch._dynamo.reset()
    got = run(torch.compile(model, backend="aot_eager", fullgraph=True), a2a.checkpoint_context)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


# ---- determinism and the collective backward -----------------------------------------------------------


def _layer_gradients(sim, ids, xs, ws, targets, num_experts, skip_backward=()):
    """Every rank's (x.grad, w.grad) of one toy-expert exchange; ranks in ``skip_backward`` run the forward only."""
    runtime_max = max(x.shape[0] for x in xs)

    def rank_step(rank):
        x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()

        def expert(recv_x, recv_ids, recv_w, counts):
            return reference.toy_moe(recv_x, recv_ids, recv_w, counts, ep_rank=rank, ep_size=sim.ep_size,
                                     num_experts=num_experts)

        out = exchange(sim, rank, ids[rank], x, w, num_experts, runtime_max, expert)
        if rank not in skip_backward:
            (out * targets[rank]).sum().backward()
        return x.grad, w.grad

    return sim.run(rank_step)


def _random_layer(ep_size, tokens, top_k, num_experts, hidden, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = [reference.random_routing(n, top_k, num_experts, gen, negative_fraction=0.1) for n in tokens]
    xs = [torch.randn(n, hidden, generator=gen).to(dtype) for n in tokens]
    ws = [torch.rand(n, top_k, generator=gen) for n in tokens]
    targets = [torch.randn(n, hidden, generator=gen).to(dtype) for n in tokens]
    return ids, xs, ws, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_are_bitwise_deterministic(dtype):
    """The same inputs twice (the second time after other traffic on the
    workspace) give bitwise identical gradients; a bf16 payload's gradient is
    bf16, the fp32 router weights' fp32 (packed with it into one fp32 combine)."""
    ep_size, tokens, top_k, num_experts, hidden = 3, (7, 2, 5), 3, 6, 16
    sim = make_sim(ep_size, max(tokens), hidden, top_k)
    layer = _random_layer(ep_size, tokens, top_k, num_experts, hidden, dtype, seed=11)
    first = _layer_gradients(sim, *layer, num_experts)
    _layer_gradients(sim, *_random_layer(ep_size, tokens, top_k, num_experts, hidden, dtype, seed=12), num_experts)
    second = _layer_gradients(sim, *layer, num_experts)
    for (x_grad, w_grad), (x_grad2, w_grad2) in zip(first, second):
        assert x_grad.dtype == dtype and w_grad.dtype == torch.float32
        assert torch.equal(x_grad, x_grad2) and torch.equal(w_grad, w_grad2)


def _expert_major_layer(sim, ids, xs, ws, targets, num_experts, max_tokens_per_expert):
    """Every rank's expert-major exchange of ``xs`` (scaled_experts) and its
    backward with output gradient ``targets``: the gradients of the inputs and
    of the dispatch's and the combine's tensors, and those tensors."""
    runtime_max = max(x.shape[0] for x in xs)

    def rank_step(rank):
        x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
        got = moe_a2a_dispatch_expert_major_differentiable(
            ids[rank], [x], sim.workspace, sim.metainfo[rank], runtime_max, rank, sim.ep_size, ids[rank].shape[1],
            num_experts, router_weights=w, max_tokens_per_expert=max_tokens_per_expert)
        plane, pair_weights = got.output_payloads[0], got.router_weights
        y = scaled_experts(rank, sim.ep_size, num_experts)(plane, got.expert_counts)
        for t in (plane, pair_weights, y):
            t.retain_grad()
        out = moe_a2a_combine_expert_major_differentiable(y, got, ids[rank], sim.workspace, sim.metainfo[rank], rank,
                                                          sim.ep_size)
        out.backward(targets[rank])
        return SimpleNamespace(out=out.detach(), x_grad=x.grad, w_grad=w.grad, plane=plane.detach(),
                               plane_grad=plane.grad, y=y.detach(), y_grad=y.grad, counts=got.expert_counts,
                               pair_weights=pair_weights.detach(), pair_weights_grad=pair_weights.grad)

    return sim.run(rank_step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_tokens_per_expert", [None, 3])
def test_expert_major_gradients_equal_the_reference(dtype, max_tokens_per_expert):
    """The expert-major exchange's values and gradients against
    torch_moe_a2a.reference (invalid and negative ids, a rank without tokens,
    pairs dropped beyond max_tokens_per_expert): the received planes and the
    output bitwise; the expert outputs' gradient w * grad bitwise; the pair
    weights' the fp32 dot products; the hidden rows' gradient bitwise the
    reference's unweighted expert-major combine of the planes' gradients (its
    fixed order); each router weight's bitwise its pair's (found through the
    reference's dispatch of (rank, token) rows with the slot index as weight).
    The same inputs again, after other traffic, give bitwise the same."""
    ep_size, tokens, top_k, num_experts, hidden = 3, (7, 0, 5), 3, 6, 16
    M = max_tokens_per_expert or a2a.expert_major.default_max_tokens_per_expert(ep_size, max(tokens), top_k,
                                                                                num_experts)
    sim = make_em_sim(ep_size, max(tokens), hidden, top_k, num_experts, max_tokens_per_expert)
    ids, xs, ws, targets = _random_layer(ep_size, tokens, top_k, num_experts, hidden, dtype, seed=31)
    got = _expert_major_layer(sim, ids, xs, ws, targets, num_experts, max_tokens_per_expert)

    def ref_dispatch(payloads, weights):
        return reference.reference_dispatch_expert_major(ids, payloads, weights, ep_size=ep_size,
                                                         num_experts=num_experts, max_tokens_per_expert=M)

    ref = ref_dispatch([[x] for x in xs], ws)
    outs = reference.reference_combine_expert_major([g.y for g in got], ref)
    grads = ref_dispatch([[t] for t in targets], None)
    x_grads = reference.reference_combine_expert_major([g.plane_grad for g in got], ref_dispatch([[x] for x in xs],
                                                                                                  None))
    sources = [torch.stack([torch.full((n,), s), torch.arange(n)], dim=1).int() for s, n in enumerate(tokens)]
    slots = [torch.arange(top_k, dtype=torch.float32).expand(n, top_k) for n in tokens]
    pairs = ref_dispatch([[s] for s in sources], slots)
    w_grads = [torch.zeros(n, top_k) for n in tokens]
    for r, g in enumerate(got):
        valid = torch.arange(M) < g.counts.unsqueeze(1)
        assert torch.equal(g.counts, ref.counts[r]) and torch.equal(g.plane, ref.planes[r][0])
        assert g.plane.untyped_storage().data_ptr() != sim.workspace.untyped_storage().data_ptr()
        assert torch.equal(g.pair_weights, ref.weights[r]) and torch.equal(g.out, outs[r])
        G = grads.planes[r][0].float()
        want_y_grad = torch.where(valid.unsqueeze(2), ref.weights[r].unsqueeze(2) * G, 0.0).to(dtype)
        assert torch.equal(g.y_grad, want_y_grad)
        dots = torch.where(valid, (G * torch.where(valid.unsqueeze(2), g.y, 0).float()).sum(dim=2), 0.0)
        torch.testing.assert_close(g.pair_weights_grad, dots, rtol=1e-6, atol=1e-6)
        assert torch.equal(g.x_grad, x_grads[r])
        for (s, t), k, value in zip(pairs.planes[r][0][valid].tolist(), pairs.weights[r][valid].long().tolist(),
                                    g.pair_weights_grad[valid]):
            w_grads[s][t, k] = value
    for g, want in zip(got, w_grads):
        assert torch.equal(g.w_grad, want)
    _expert_major_layer(sim, *_random_layer(ep_size, tokens, top_k, num_experts, hidden, dtype, seed=32),
                        num_experts, max_tokens_per_expert)
    again = _expert_major_layer(sim, ids, xs, ws, targets, num_experts, max_tokens_per_expert)
    for g, h in zip(got, again):
        assert torch.equal(g.x_grad, h.x_grad) and torch.equal(g.w_grad, h.w_grad)


def test_a_rank_that_skips_the_backward_times_out_its_peers():
    """The backward is a collective: rank 1 runs the forward only, so rank
    0's backward waits for it until the timeout and raises naming it."""
    ep_size, tokens, top_k, num_experts, hidden = 2, (4, 4), 2, 4, 8
    sim = make_sim(ep_size, max(tokens), hidden, top_k, timeout_s=0.5)
    layer = _random_layer(ep_size, tokens, top_k, num_experts, hidden, torch.float32, seed=13)
    with pytest.raises(RuntimeError, match=r"peers \[1\] did not arrive") as raised:
        _layer_gradients(sim, *layer, num_experts, skip_backward={1})
    # The message names a dispatch or a combine; a note says a backward ran it.
    assert any(note.startswith("(raised in the backward of moe_a2a_") for note in raised.value.__notes__)


def test_a_backward_while_the_round_is_open_says_so():
    """A backward of the dispatch's received rows before the round's combine:
    its own dispatch meets the open round, and the error's note says that a
    backward raised it (the message speaks of two dispatches; the caller
    called one)."""
    sim = make_sim(1, 8, 8, 2)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3]], dtype=torch.int32)
    x = torch.randn(4, 8, requires_grad=True)
    (received,), offset, _ = a2a.moe_a2a_dispatch_differentiable(ids, [x], sim.workspace, sim.metainfo[0], 4, 0, 1,
                                                                  2, 4)
    with pytest.raises(RuntimeError, match="dispatch called twice without a combine") as raised:
        received.sum().backward()
    assert raised.value.__notes__ == [
        "(raised in the backward of moe_a2a_dispatch_differentiable (a dispatch of the saved expert ids, then a "
        "combine of the received rows' gradients); a backward exchanges too, so every rank runs the same backward "
        "sequence, and not while a round of its own is open: after a dispatch, before its combine)"]
    # A combine with another runtime_max_tokens_per_rank than the dispatch's
    # is refused by the received plane's shape, and says whose size it is.
    with pytest.raises(ValueError, match=r"got shape \[1, 4, 8\] \(runtime_max_tokens_per_rank must be the "
                                         r"dispatch's: its receive planes"):
        a2a.moe_a2a_combine_differentiable(received, ids, sim.workspace, sim.metainfo[0], 8, 0, 1, 2, 4, offset)
    out = a2a.moe_a2a_combine_differentiable(received, ids, sim.workspace, sim.metainfo[0], 4, 0, 1, 2, 4, offset)
    out.sum().backward()
    assert x.grad is not None


def test_ranks_whose_payloads_require_grad_differently_are_told_so():
    """The dispatch's backward combines the gradients of the payloads that
    require grad: where rank 0's hidden states require grad and rank 1's do
    not, the backward combines' rows differ and the error says what must
    match."""
    ep_size, tokens, top_k, num_experts, hidden = 2, 4, 2, 4, 8
    sim = a2a.SimulatedEP(ep_size, tokens, dispatch_bytes_per_token=4 * hidden + 16 * top_k,
                          combine_bytes_per_token=4 * hidden + 4 * top_k, timeout_s=5.0)
    gen = torch.Generator().manual_seed(14)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    xs = [torch.randn(tokens, hidden, generator=gen) for _ in range(ep_size)]
    ws = [torch.rand(tokens, top_k, generator=gen) for _ in range(ep_size)]

    def step(rank):
        x = xs[rank].clone().requires_grad_(rank == 0)
        w = ws[rank].clone().requires_grad_()
        (rx, _, rw), offset, _ = a2a.moe_a2a_dispatch_differentiable(ids, [x, ids, w], sim.workspace,
                                                                     sim.metainfo[rank], tokens, rank, ep_size,
                                                                     top_k, num_experts)
        out = a2a.moe_a2a_combine_differentiable(rx * rw.sum(-1, keepdim=True), ids, sim.workspace,
                                                 sim.metainfo[rank], tokens, rank, ep_size, top_k, num_experts,
                                                 offset)
        out.sum().backward()

    with pytest.raises(RuntimeError, match="called the same combine with other rows.*require grad alike"):
        sim.run(step)


# ---- the backward's rounds know their forward exchange ----------------------------------------------


def _parallel_layers(layout, sim, rank, ids, ws, num_experts):
    """Rank ``rank``'s two MoE layers on ``sim``'s workspace, fed by one input:
    ``layer(x, i)`` is layer ``i``'s differentiable exchange of ``x``, routed
    by ``ids[i]`` (expert-major: with router weights ``ws[i]``), around a
    stand-in expert of its own (the rows times 1.5, layer 1's times 2). The
    two layers' backward rounds have rows of the same sizes."""
    tokens, top_k = ids[0].shape

    def layer(x, i):
        scale = 1.5 + i / 2
        if layout == "rank-major":
            (rows,), offset, _ = moe_a2a_dispatch_differentiable(ids[i], [x], sim.workspace, sim.metainfo[rank], tokens,
                                                                 rank, sim.ep_size, top_k, num_experts)
            return moe_a2a_combine_differentiable(rows * scale, ids[i], sim.workspace, sim.metainfo[rank], tokens, rank,
                                                  sim.ep_size, top_k, num_experts, offset)
        dispatched = moe_a2a_dispatch_expert_major_differentiable(ids[i], [x], sim.workspace, sim.metainfo[rank],
                                                                  tokens, rank, sim.ep_size, top_k, num_experts,
                                                                  router_weights=ws[i])
        return moe_a2a_combine_expert_major_differentiable(dispatched.output_payloads[0] * scale, dispatched, ids[i],
                                                           sim.workspace, sim.metainfo[rank], rank, sim.ep_size)

    return layer


def _backward_mismatch_message(rank):
    """The error rank ``rank`` of two gets where the ranks' backwards run the
    rounds of other exchanges: the CPU dispatch of a backward round and the
    CUDA combine after it both name that cause."""
    return (rf"^rank {rank}: peers \[{1 - rank}\] called another exchange than this rank's backward exchange: "
            r".* the peers ran the backward of another exchange \(every rank must run the same backward sequence")


@pytest.mark.parametrize("mismatch", ["each rank leaves another layer's output unused",
                                      "the ranks call backward on their outputs in other orders"])
@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_ranks_that_run_the_backward_of_other_exchanges_fail(layout, mismatch, device):
    """Two layers' exchanges on one workspace, fed by one input, whose
    backward rounds have rows of the same sizes. Rank 0's loss leaves layer
    0's output unused and rank 1's layer 1's, or rank 0 calls backward on
    layer 0's loss, then layer 1's, and rank 1 the reverse: at the first
    backward round rank 0 runs one layer's where rank 1 runs the other's. A
    backward round carries the identity of its forward exchange, which its
    dispatch sends beside its rows' sizes, so every rank fails there (before
    its timeout) with an error that names the cause; the rounds were paired
    by their sizes alone, and the gradients were wrong, with no error."""
    ep_size, tokens, top_k, num_experts, hidden = 2, 4, 2, 4, 8
    gen = torch.Generator().manual_seed(63 + 2 * (layout == "expert-major") + (mismatch[0] == "e"))
    sim = make_sim(ep_size, tokens, hidden, top_k, timeout_s=5, device=device) if layout == "rank-major" else \
        make_em_sim(ep_size, tokens, hidden, top_k, num_experts, timeout_s=5, device=device)
    ids = [[reference.random_routing(tokens, top_k, num_experts, gen).to(device) for _ in range(2)]
           for _ in range(ep_size)]
    ws = [[torch.rand(tokens, top_k, generator=gen).to(device) for _ in range(2)] for _ in range(ep_size)]
    xs = [torch.randn(tokens, hidden, generator=gen).to(device) for _ in range(ep_size)]

    def step(rank, ep_sim=sim):
        layer = _parallel_layers(layout, ep_sim, rank, ids[rank], ws[rank], num_experts)
        x = xs[rank].clone().requires_grad_()
        losses = [layer(x, i).square().sum() for i in range(2)]
        if ep_sim is not sim:  # the one-rank warm-up: both losses, as a correct program
            order = (0, 1)
        elif mismatch.startswith("each rank"):
            order = (1 - rank,)
        else:
            order = (0, 1) if rank == 0 else (1, 0)
        try:
            for i in order:
                losses[i].backward()
        except RuntimeError as e:
            return str(e)
        return None

    if device == "cuda":
        # The step's kernels launched once on one rank (SimulatedEP.run: a
        # kernel's first launch waits for every stream's work).
        one = make_sim(1, tokens, hidden, top_k, device=device) if layout == "rank-major" else \
            make_em_sim(1, tokens, hidden, top_k, num_experts, device=device)
        assert one.run(lambda rank: step(rank, one)) == [None]
    first = sim.run(step)
    if device == "cuda":
        torch.cuda.synchronize()
    for rank in range(ep_size):
        message = _backward_mismatch_message(rank)
        if device == "cpu":  # the CPU raises at once, in the backward
            assert first[rank] is not None and re.search(message, first[rank]), f"rank {rank}: {first[rank]}"
        record = errors.row_error(sim.workspace, rank)
        assert record is not None and re.search(message, record), f"rank {rank}: {record}"
    sim.reset()


def test_a_step_compiled_on_one_rank_and_eager_on_another_trains():
    """Dynamo may run a frame compiled on one rank and eagerly on another
    (past its recompile limit on one rank only): the compiled backward's
    rounds carry the tag of an exchange not known (-1) and the eager one's
    its number, and the two pair by their rows' sizes (-1 pairs with any
    backward round), with the gradients of two eager ranks."""
    torch._dynamo.reset()
    ep_size, tokens, top_k, num_experts, hidden = 2, 4, 2, 4, 8
    gen = torch.Generator().manual_seed(71)
    # The compile runs inside rank 0's step while rank 1 waits in its dispatch.
    sim = make_sim(ep_size, tokens, hidden, top_k, timeout_s=300)
    ids = [reference.random_routing(tokens, top_k, num_experts, gen) for _ in range(ep_size)]
    xs = [torch.randn(tokens, hidden, generator=gen) for _ in range(ep_size)]
    ws = [torch.rand(tokens, top_k, generator=gen) for _ in range(ep_size)]
    targets = [torch.randn(tokens, hidden, generator=gen) for _ in range(ep_size)]
    compiled = torch.compile(compiled_train_step, fullgraph=True)

    def step(rank, steps):
        x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
        out = steps[rank](x, w, ids[rank], sim.workspace, sim.metainfo[rank], tokens, rank, ep_size, top_k,
                          num_experts)
        (out * targets[rank]).sum().backward()
        return x.grad, w.grad

    want = sim.run(functools.partial(step, steps=[compiled_train_step] * ep_size))
    got = sim.run(functools.partial(step, steps=[compiled, compiled_train_step]))
    for grads, expected in zip(got, want):
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()


def _round(layout, sim, rank, ids, x, w, num_experts, runtime_max, differentiable):
    """Rank ``rank``'s dispatch of ``x`` (expert-major: with router weights
    ``w``) and combine of its received rows times 2, through the
    differentiable functions or the plain ones: the same exchange on the
    wire. Returns the combine's output."""
    tokens, top_k = ids.shape
    args = (sim.workspace, sim.metainfo[rank])
    if layout == "rank-major":
        if differentiable:
            (rows,), offset, _ = moe_a2a_dispatch_differentiable(ids, [x], *args, runtime_max, rank, sim.ep_size,
                                                                 top_k, num_experts)
            return moe_a2a_combine_differentiable(rows * 2, ids, *args, runtime_max, rank, sim.ep_size, top_k,
                                                  num_experts, offset)
        (rows,), offset, _ = a2a.moe_a2a_dispatch(ids, [x], *args, runtime_max, rank, sim.ep_size, top_k,
                                                  num_experts)
        return a2a.moe_a2a_combine(rows * 2, tokens, *args, runtime_max, rank, sim.ep_size, top_k, offset)
    if differentiable:
        d = moe_a2a_dispatch_expert_major_differentiable(ids, [x], *args, runtime_max, rank, sim.ep_size, top_k,
                                                         num_experts, router_weights=w)
        return moe_a2a_combine_expert_major_differentiable(d.output_payloads[0] * 2, d, ids, *args, rank, sim.ep_size)
    d = a2a.moe_a2a_dispatch_expert_major(ids, [x], *args, runtime_max, rank, sim.ep_size, top_k, num_experts,
                                          router_weights=w)
    return a2a.moe_a2a_combine_expert_major(d.output_payloads[0] * 2, d, *args, rank, sim.ep_size)


@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_an_evaluation_round_plain_on_one_rank_and_differentiable_on_another_then_training(layout):
    """Under torch.no_grad() rank 0 evaluates through the differentiable
    functions and rank 1 through the plain ones, the same exchange on the
    wire; then both run the same training step. The ops count every
    dispatch and combine, whichever function made it, so the ranks' counts
    agree, the training step's backward rounds carry the same round tags on
    both ranks, and its gradients are the dense model's. Where only the
    differentiable functions counted, the counts differed from then on and
    every later backward round failed on every rank ("called another
    exchange than this rank's backward exchange") until the ranks were
    initialized again."""
    ep_size, tokens, top_k, num_experts, hidden = 2, (5, 3), 2, 4, 8
    dense = dense_model(hidden, num_experts, top_k, seed=85)
    gen = torch.Generator().manual_seed(85 + (layout == "expert-major"))
    ids = [reference.random_routing(n, top_k, num_experts, gen) for n in tokens]
    ws = [torch.rand(n, top_k, generator=gen) for n in tokens]
    xs = [torch.randn(n, hidden, generator=gen) for n in tokens]
    targets = [torch.randn(n, hidden, generator=gen) for n in tokens]
    if layout == "rank-major":
        sim, parallel = make_sim(ep_size, max(tokens), hidden, top_k, timeout_s=10), ExpertParallel
    else:
        sim = make_em_sim(ep_size, max(tokens), hidden, top_k, num_experts, timeout_s=10)
        parallel = ExpertMajorParallel
    models = rank_copies(dense, sim, parallel=parallel)
    x = torch.cat(xs).requires_grad_()
    ((dense(x) - torch.cat(targets)) ** 2).sum().backward()

    def rank_step(rank):
        with torch.no_grad():
            _round(layout, sim, rank, ids[rank], xs[rank], ws[rank], num_experts, max(tokens),
                   differentiable=rank == 0)
        x = xs[rank].clone().requires_grad_()
        ((models[rank](x, max(tokens)) - targets[rank]) ** 2).sum().backward()
        return x.grad

    x_grads = sim.run(rank_step)
    _dense_gradients_agree(dense.layers, [m.layers for m in models], x.grad, x_grads)


@pytest.mark.parametrize("python_bodies", [False, True], ids=["c_bodies", "python_bodies"])
@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_every_dispatch_and_combine_counts_once_plain_or_differentiable(layout, python_bodies, monkeypatch):
    """The count behind the round tags (fastpath.round_tag_of_last_exchange,
    _C.exchange_count) moves by one per dispatch and per combine: by 2 for
    a round of the plain functions and for one of the differentiable ones
    under torch.no_grad(), by 6 for a training round (its dispatch and
    combine, the combine's backward round: a dispatch and a combine, the
    dispatch's: a dispatch and a combine of the fp32 gradients), whether the
    rank-major training ops run their C++ bodies or their Python ones; a
    differentiable node keeps the count its exchange reached. The rank's
    initialization starts the count again."""
    if python_bodies:
        monkeypatch.setattr(a2a_autograd, "direct_call_ok", lambda *tensors: False)
    tokens, top_k, num_experts, hidden = 5, 2, 4, 8
    gen = torch.Generator().manual_seed(87)
    sim = make_sim(1, tokens, hidden, top_k) if layout == "rank-major" else \
        make_em_sim(1, tokens, hidden, top_k, num_experts)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    w = torch.rand(tokens, top_k, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)

    def count():
        assert fastpath.round_tag_of_last_exchange(sim.workspace, 0) == a2a._C.exchange_count(sim.workspace, 0)
        return a2a._C.exchange_count(sim.workspace, 0)

    assert count() == 0
    with torch.no_grad():
        plain = _round(layout, sim, 0, ids, x, w, num_experts, tokens, differentiable=False)
        assert count() == 2
        differentiable = _round(layout, sim, 0, ids, x, w, num_experts, tokens, differentiable=True)
        assert count() == 4
    assert torch.equal(plain, differentiable)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = _round(layout, sim, 0, ids, xg, wg, num_experts, tokens, differentiable=True)
    assert count() == 6 and out.grad_fn is not None
    out.square().sum().backward()
    assert count() == 10 and xg.grad is not None
    sim.reset()
    assert count() == 0


@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_repeated_combines_backward_on_every_rank_alike(layout, device):
    """A round of two differentiable combines (the rows times 1.5 and times
    2), both outputs in the loss: each combine's backward round carries its
    own combine's tag, every rank runs them in the same order, and the
    inputs' gradients are those of one combine of the rows times 3.5."""
    ep_size, tokens, top_k, num_experts, hidden = 2, 4, 2, 4, 8
    gen = torch.Generator().manual_seed(79)
    sim = make_sim(ep_size, tokens, hidden, top_k, device=device) if layout == "rank-major" else \
        make_em_sim(ep_size, tokens, hidden, top_k, num_experts, device=device)
    ids = [reference.random_routing(tokens, top_k, num_experts, gen).to(device) for _ in range(ep_size)]
    ws = [torch.rand(tokens, top_k, generator=gen).to(device) for _ in range(ep_size)]
    xs = [torch.randn(tokens, hidden, generator=gen).to(device) for _ in range(ep_size)]

    def step(rank, scales):
        x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
        kwargs = dict(workspace=sim.workspace, metainfo=sim.metainfo[rank], ep_rank=rank, ep_size=ep_size)
        if layout == "rank-major":
            (rows,), offset, _ = moe_a2a_dispatch_differentiable(ids[rank], [x * w[:, :1]],
                                                                 runtime_max_tokens_per_rank=tokens, top_k=top_k,
                                                                 num_experts=num_experts, **kwargs)
            outs = [moe_a2a_combine_differentiable(rows * scale, ids[rank], runtime_max_tokens_per_rank=tokens,
                                                   top_k=top_k, num_experts=num_experts, combine_payload_offset=offset,
                                                   **kwargs) for scale in scales]
        else:
            d = moe_a2a_dispatch_expert_major_differentiable(ids[rank], [x], runtime_max_tokens_per_rank=tokens,
                                                             top_k=top_k, num_experts=num_experts, router_weights=w,
                                                             **kwargs)
            outs = [moe_a2a_combine_expert_major_differentiable(d.output_payloads[0] * scale, d, ids[rank], **kwargs)
                    for scale in scales]
        sum(out.square().sum() / scale for out, scale in zip(outs, scales)).backward()
        return x.grad, w.grad

    want = sim.run(functools.partial(step, scales=(3.5,)))
    for grads, expected in zip(sim.run(functools.partial(step, scales=(1.5, 2.0))), want):
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_a_rank_masked_off_for_a_step_trains_again_after_its_reinitialization():
    """A rank masked off for a step makes no exchange, so its count of
    exchanges stops while its peers' goes on; it rejoins through a
    collective re-initialization (SimulatedEP.reset), which starts every
    rank's count again: the next step's backward rounds carry the same tags
    on every rank, and its gradients are those of the step before."""
    ep_size, tokens, top_k, num_experts, hidden = 3, 4, 2, 6, 8
    gen = torch.Generator().manual_seed(73)
    sim = make_sim(ep_size, tokens, hidden, top_k)
    ids = [reference.random_routing(tokens, top_k, num_experts, gen) for _ in range(ep_size)]
    xs = [torch.randn(tokens, hidden, generator=gen) for _ in range(ep_size)]
    ws = [torch.rand(tokens, top_k, generator=gen) for _ in range(ep_size)]

    def step(rank, mask=None):
        if mask is not None and rank == ep_size - 1:  # masked off: no call
            return None
        x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
        out = exchange(sim, rank, ids[rank], x, w, num_experts, tokens,
                       lambda recv_x, recv_ids, recv_w, counts: recv_x * recv_w[..., :1], mask)
        out.square().sum().backward()
        return x.grad, w.grad

    want = sim.run(step)
    sim.run(functools.partial(step, mask=a2a.moe_a2a_active_rank_mask(range(ep_size - 1), ep_size)))
    sim.reset()
    for grads, expected in zip(sim.run(step), want):
        assert torch.equal(grads[0], expected[0]) and torch.equal(grads[1], expected[1])


def _dense_gradients_agree(dense_layers, rank_layers, x_grad, x_grads):
    """The ranks' gradients against the dense layers': each rank's input
    gradient its rows of ``x_grad``, the router's summed over the ranks (a
    data-parallel all-reduce), each expert's from its owner."""
    torch.testing.assert_close(torch.cat(x_grads), x_grad, rtol=1e-5, atol=1e-5)
    for dense_layer, layers in zip(dense_layers, zip(*rank_layers)):
        if dense_layer.router.weight.grad is None:  # a layer no loss used
            assert all(layer.router.weight.grad is None for layer in layers)
            continue
        torch.testing.assert_close(sum(layer.router.weight.grad for layer in layers), dense_layer.router.weight.grad,
                                   rtol=1e-5, atol=1e-5)
        for layer in layers:
            for e, expert in zip(layer.owned, layer.experts):
                for p, q in zip(expert.parameters(), dense_layer.experts[e].parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)


# Every rank's backward sequence over two layers fed by one input, with the
# checkpointing of each layer (CHECKPOINTINGS); not a second backward of a
# region under selective checkpointing, which torch refuses.
SAME_BACKWARD_SEQUENCES = [
    (sequence, checkpointing)
    for sequence in ("layer 0's output unused on every rank", "backward calls in the forward's order",
                     "one loss's backward twice (retain_graph)")
    for checkpointing in CHECKPOINTINGS
    if not (sequence.startswith("one loss") and checkpointing == "checkpoint_context")
]


@pytest.mark.parametrize("sequence,checkpointing", SAME_BACKWARD_SEQUENCES)
@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_ranks_that_run_the_same_backward_sequence_get_the_dense_gradients(layout, sequence, checkpointing, device):
    """Two MoE layers of one workspace fed by one input, each with a loss of
    its own, every rank running the same backward sequence, which is not the
    reverse of the forward: layer 1's loss alone (layer 0's output unused),
    layer 0's loss then layer 1's, or layer 0's loss twice with retain_graph;
    each layer whole under activation checkpointing of every kind (whose
    recomputation re-runs the layer's exchanges inside the backward, or hands
    their saved outputs back). The round tags of the ranks' backward rounds
    agree, and the gradients are the dense layers' on all tokens."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    ep_size, tokens, top_k, num_experts, hidden = 2, (5, 3), 2, 4, 8
    dense = dense_model(hidden, num_experts, top_k, seed=67).to(device)
    gen = torch.Generator().manual_seed(67)
    xs = [torch.randn(n, hidden, generator=gen).to(device) for n in tokens]
    targets = [[torch.randn(n, hidden, generator=gen).to(device) for n in tokens] for _ in range(2)]
    if layout == "rank-major":
        sim, parallel = make_sim(ep_size, max(tokens), hidden, top_k, device=device), ExpertParallel
    else:
        sim = make_em_sim(ep_size, max(tokens), hidden, top_k, num_experts, device=device)
        parallel = ExpertMajorParallel
    models = rank_copies(dense, sim, parallel=parallel)

    def run_sequence(losses):
        if sequence.startswith("layer 0's output unused"):
            losses[1].backward()
        elif sequence.startswith("backward calls"):
            losses[0].backward()
            losses[1].backward()
        else:
            losses[0].backward(retain_graph=True)
            losses[0].backward()

    x = torch.cat(xs).requires_grad_()
    run_sequence([((layer(x) - torch.cat(t)) ** 2).sum() for layer, t in zip(dense.layers, targets)])

    def rank_step(rank):
        x = xs[rank].clone().requires_grad_()
        with set_checkpoint_early_stop(checkpointing != "no-early-stop"):
            outs = []
            for layer in models[rank].layers:
                if checkpointing == "none":
                    outs.append(layer(x, max(tokens)))
                elif checkpointing == "reentrant":
                    outs.append(checkpoint(layer, x, max(tokens), use_reentrant=True))
                else:
                    context = {"context_fn": a2a.checkpoint_context} if checkpointing == "checkpoint_context" else {}
                    outs.append(checkpoint(layer, x, max(tokens), use_reentrant=False, **context))
            run_sequence([((out - t[rank]) ** 2).sum() for out, t in zip(outs, targets)])
        return x.grad

    x_grads = sim.run(rank_step)
    _dense_gradients_agree(dense.layers, [m.layers for m in models], x.grad, x_grads)


# ---- one rank per process ------------------------------------------------------------------------------

# tokens per rank, top_k, num_experts, hidden, steps, learning rate, model seed
PROCESS_CASE = ((6, 3), 2, 4, 8, 3, 0.1, 21)


def _train_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """A rank of PROCESS_CASE's model in its own process (gloo; the workspace
    shared through allocate_workspace): SGD steps with the router's gradients
    all-reduced (data parallel), the experts' from the exchanges."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        tokens, top_k, num_experts, hidden, steps, lr, seed = PROCESS_CASE
        size = a2a.moe_a2a_get_workspace_size_per_rank(world, max(tokens), 4 * hidden + 8 * top_k + 256,
                                                       4 * hidden + 256)
        workspace = a2a.allocate_workspace(size, group=dist.group.WORLD)
        metainfo = a2a.moe_a2a_initialize(workspace, rank, world, max(tokens))
        # What ExpertParallel reads of a SimulatedEP.
        ep = SimpleNamespace(workspace=workspace, metainfo={rank: metainfo}, ep_size=world)
        dense = dense_model(hidden, num_experts, top_k, seed)
        model = Model([ExpertParallel(layer, ep, rank) for layer in dense.layers])
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        batches, targets = training_data(tokens, hidden, steps, torch.Generator().manual_seed(seed))
        for step in range(steps):
            optimizer.zero_grad()
            ((model(batches[step][rank], max(tokens)) - targets[step][rank]) ** 2).sum().backward()
            for layer in model.layers:
                dist.all_reduce(layer.router.weight.grad)
            optimizer.step()
        torch.save(dense.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_processes_train_as_one(tmp_path):
    """Two processes train PROCESS_CASE's model; every rank's router and owned
    experts end where the dense model's SGD steps on all tokens take them."""
    world = 2
    start_ranks(_train_worker, (world, str(tmp_path / "init"), str(tmp_path)), world)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    tokens, top_k, num_experts, hidden, steps, lr, seed = PROCESS_CASE
    dense = dense_model(hidden, num_experts, top_k, seed)
    optimizer = torch.optim.SGD(dense.parameters(), lr=lr)
    batches, targets = training_data(tokens, hidden, steps, torch.Generator().manual_seed(seed))
    for step in range(steps):
        optimizer.zero_grad()
        ((dense(torch.cat(batches[step])) - torch.cat(targets[step])) ** 2).sum().backward()
        optimizer.step()
    want = dense.state_dict()
    for rank in range(world):
        for layer in range(len(dense.layers)):
            key = f"layers.{layer}.router.weight"
            torch.testing.assert_close(got[rank][key], want[key], rtol=1e-4, atol=1e-4)
            for e in a2a.local_expert_range(num_experts, world, rank):
                for name in ("weight", "bias"):
                    key = f"layers.{layer}.experts.{e}.{name}"
                    torch.testing.assert_close(got[rank][key], want[key], rtol=1e-4, atol=1e-4)


def test_a_payload_that_requires_grad_must_have_a_combine_dtype():
    """fp64 has no combine, so no way back for its gradient: refused before any exchange."""
    sim = make_sim(1, 2, 4, 1)
    ids = torch.zeros(2, 1, dtype=torch.int32)
    x = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"input_payloads\[0\] requires grad but is torch.float64"):
        moe_a2a_dispatch_differentiable(ids, [x], sim.workspace, sim.metainfo[0], 2, 0, 1, 1, 1)
    em_sim = make_em_sim(1, 2, 4, 1, 1)
    with pytest.raises(ValueError, match=r"input_payloads\[0\] requires grad but is torch.float64"):
        moe_a2a_dispatch_expert_major_differentiable(ids, [x], em_sim.workspace, em_sim.metainfo[0], 2, 0, 1, 1, 1)
    # The workspace is untouched: a dispatch still opens the round.
    recv, offset, counts = moe_a2a_dispatch_differentiable(ids, [x.detach().float()], sim.workspace,
                                                           sim.metainfo[0], 2, 0, 1, 1, 1)
    assert counts.tolist() == [2] and torch.equal(recv[0][0], torch.zeros(2, 4))


@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_a_combine_with_other_ids_than_its_dispatch_is_refused(layout):
    """The combine's backward dispatches the output gradient along the routes
    of the ids it is given: ids other than the dispatch's (and, expert-major,
    another round's ExpertMajorDispatch) would give a right output and wrong
    gradients, so they are refused; equal ids in another tensor are not."""
    tokens, top_k, num_experts, hidden = 4, 2, 4, 8
    gen = torch.Generator().manual_seed(21)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    other = (ids + 1) % num_experts
    x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    w = torch.rand(tokens, top_k, generator=gen, requires_grad=True)
    if layout == "rank-major":
        sim = make_sim(1, tokens, hidden, top_k)
        recv, offset, _ = moe_a2a_dispatch_differentiable(ids, [x], sim.workspace, sim.metainfo[0], tokens, 0, 1,
                                                          top_k, num_experts)

        def combine(ids_given):
            return moe_a2a_combine_differentiable(recv[0] * 2, ids_given, sim.workspace, sim.metainfo[0], tokens, 0,
                                                  1, top_k, num_experts, offset)
    else:
        sim = make_em_sim(1, tokens, hidden, top_k, num_experts)
        stale = moe_a2a_dispatch_expert_major_differentiable(ids, [x], sim.workspace, sim.metainfo[0], tokens, 0, 1,
                                                             top_k, num_experts, router_weights=w)
        moe_a2a_combine_expert_major_differentiable(stale.output_payloads[0], stale, ids, sim.workspace,
                                                    sim.metainfo[0], 0, 1).sum().backward()
        got = moe_a2a_dispatch_expert_major_differentiable(ids, [x], sim.workspace, sim.metainfo[0], tokens, 0, 1,
                                                           top_k, num_experts, router_weights=w)
        with pytest.raises(ValueError, match="dispatched must be the ExpertMajorDispatch of this rank's preceding"):
            moe_a2a_combine_expert_major_differentiable(got.output_payloads[0], stale, ids, sim.workspace,
                                                        sim.metainfo[0], 0, 1)

        def combine(ids_given):
            return moe_a2a_combine_expert_major_differentiable(got.output_payloads[0] * 2, got, ids_given,
                                                               sim.workspace, sim.metainfo[0], 0, 1)
    with pytest.raises(ValueError, match="token_selected_experts must be the expert ids of this rank's preceding"):
        combine(other)
    out = combine(ids.clone())  # a refused combine changed nothing; equal ids are the same routes
    out = combine(ids.long())  # in the other id width too (the dispatch's are int32)
    x.grad = None
    out.sum().backward()
    want = 2 * (w.detach().sum(dim=1, keepdim=True) if layout == "expert-major" else torch.ones(tokens, 1))
    torch.testing.assert_close(x.grad, want.expand(tokens, hidden))


@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_inference_tensors_that_the_backward_would_save_are_refused_before_the_exchange(layout):
    """Expert ids (or, expert-major, router weights) made under
    torch.inference_mode() cannot be saved for the backward, which autograd
    finds only once the op has run: the exchange made, the round left open,
    every rank's next step refused. They are refused before anything runs,
    with the workspace untouched; the same step with ordinary tensors then
    trains."""
    tokens, top_k, num_experts, hidden = 4, 2, 4, 8
    gen = torch.Generator().manual_seed(23)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    with torch.inference_mode():
        ids_inference = ids.clone()
    x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    w = torch.rand(tokens, top_k, generator=gen)
    if layout == "rank-major":
        sim = make_sim(1, tokens, hidden, top_k)

        def dispatch(ids_given):
            return moe_a2a_dispatch_differentiable(ids_given, [x], sim.workspace, sim.metainfo[0], tokens, 0, 1,
                                                   top_k, num_experts)

        def combine(recv, offset, ids_given):
            return moe_a2a_combine_differentiable(recv[0] * 2, ids_given, sim.workspace, sim.metainfo[0], tokens, 0,
                                                  1, top_k, num_experts, offset)
    else:
        sim = make_em_sim(1, tokens, hidden, top_k, num_experts)

        def dispatch(ids_given):
            return moe_a2a_dispatch_expert_major_differentiable(ids_given, [x], sim.workspace, sim.metainfo[0],
                                                                tokens, 0, 1, top_k, num_experts, router_weights=w)

        def combine(got, ids_given):
            return moe_a2a_combine_expert_major_differentiable(got.output_payloads[0] * 2, got, ids_given,
                                                               sim.workspace, sim.metainfo[0], 0, 1)
    before = sim.workspace.clone()
    with pytest.raises(ValueError, match=r"token_selected_experts is an inference tensor .*\.clone\(\)"):
        dispatch(ids_inference)
    assert torch.equal(sim.workspace, before)
    got = dispatch(ids)
    args = (got[0], got[1]) if layout == "rank-major" else (got,)
    with pytest.raises(ValueError, match="token_selected_experts is an inference tensor"):
        combine(*args, ids_inference)  # equal ids, but not savable
    if layout == "expert-major":
        with torch.inference_mode():
            weights = got.router_weights.clone()  # fp32: the tensor the node would save
        with pytest.raises(ValueError, match="router_weights is an inference tensor"):
            combine(got._replace(router_weights=weights), ids)
    out = combine(*args, ids)  # the refusals changed nothing: the round's combine closes it
    out.sum().backward()
    want = 2 * (w.sum(dim=1, keepdim=True) if layout == "expert-major" else torch.ones(tokens, 1))
    torch.testing.assert_close(x.grad, want.expand(tokens, hidden))


def test_a_combine_is_checked_against_the_last_dispatch_plain_or_differentiable():
    """The ids are checked against the rank's last dispatch, whatever tensor
    held them: ids made for the dispatch call (gone by the combine) are
    checked too, and after a plain dispatch its ids, not an earlier
    differentiable round's. After a plain dispatch a combine whose payload
    needs a gradient is refused: the plain dispatch's received rows are
    workspace views, and the backward's exchange overwrote them before the
    expert's backward read what it saved (a Linear expert's weight gradient
    came from the output gradient's rows, with no error)."""
    tokens, top_k, num_experts, hidden = 5, 2, 4, 8
    gen = torch.Generator().manual_seed(22)
    ids_a = reference.random_routing(tokens, top_k, num_experts, gen)
    ids_b = (ids_a + 1) % num_experts
    x = torch.randn(tokens, hidden, generator=gen)  # no gradient: autograd keeps no reference to the ids
    sim = make_sim(1, tokens, hidden, top_k)
    args = (sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k, num_experts)

    def expert_rows(recv):
        return (recv[0] * 2).detach().requires_grad_()

    # The gradient of the expert rows along ids_b's routes, from a differentiable round of ids_b.
    recv, offset, _ = moe_a2a_dispatch_differentiable(ids_b, [x], *args)
    want = expert_rows(recv)
    first = moe_a2a_combine_differentiable(want, ids_b, *args, offset)
    first.sum().backward()

    recv, offset, _ = moe_a2a_dispatch_differentiable(ids_a.clone(), [x], *args)
    with pytest.raises(ValueError, match="token_selected_experts must be the expert ids of this rank's preceding"):
        moe_a2a_combine_differentiable(expert_rows(recv), ids_b, *args, offset)
    moe_a2a_combine_differentiable(expert_rows(recv), ids_a, *args, offset).sum().backward()

    recv, offset, _ = a2a.moe_a2a_dispatch(ids_b, [x], *args)  # plain
    with pytest.raises(ValueError, match="token_selected_experts must be the expert ids of this rank's preceding"):
        moe_a2a_combine_differentiable(recv[0] * 2, ids_a, *args, offset)
    with pytest.raises(ValueError, match="preceding dispatch on the workspace was not a differentiable one"):
        moe_a2a_combine_differentiable(expert_rows(recv), ids_b.clone(), *args, offset)
    out = moe_a2a_combine_differentiable(recv[0] * 2, ids_b.clone(), *args, offset)  # needs no gradient: runs
    assert torch.equal(out, first.detach())


def test_a_differentiable_expert_major_combine_after_a_plain_dispatch_is_refused():
    """A plain expert-major dispatch's planes, counts and weights are
    workspace views: the combine's backward overwrote the counts before it
    read them, so no pair was valid and every expert gradient came out 0.
    Refused where the outputs or the weights need a gradient; a combine that
    needs none still runs."""
    tokens, top_k, num_experts, hidden = 6, 2, 4, 8
    gen = torch.Generator().manual_seed(24)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    sim = make_em_sim(1, tokens, hidden, top_k, num_experts)
    w = torch.randn(hidden, hidden, generator=gen, requires_grad=True)
    got = a2a.moe_a2a_dispatch(ids, [torch.randn(tokens, hidden, generator=gen)], sim.workspace, sim.metainfo[0],
                               tokens, 0, 1, top_k, num_experts, expert_major=True)
    with pytest.raises(ValueError, match="preceding dispatch on the workspace was not a differentiable one"):
        moe_a2a_combine_expert_major_differentiable(got.output_payloads[0] @ w, got, ids, sim.workspace,
                                                    sim.metainfo[0], 0, 1)
    out = moe_a2a_combine_expert_major_differentiable(got.output_payloads[0].clone(), got, ids, sim.workspace,
                                                      sim.metainfo[0], 0, 1)
    assert out.shape == (tokens, hidden) and not out.requires_grad


def test_rebound_router_weights_are_the_rounds_weights_for_its_later_combines():
    """A differentiable expert-major combine given rebound router weights
    (``dispatched._replace(router_weights=...)``), the round's first combine,
    writes them into the workspace, where the peers read each pair's weight:
    the round's later combines, plain ones with the dispatch's own result
    included, apply them too (docs/DESIGN.md, the expert-major combine); the
    next dispatch writes its own."""
    tokens, top_k, num_experts, hidden = 4, 2, 4, 8
    gen = torch.Generator().manual_seed(31)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    w = (torch.rand(tokens, top_k, generator=gen) + 0.25).requires_grad_()
    sim = make_em_sim(1, tokens, hidden, top_k, num_experts)
    args = (sim.workspace, sim.metainfo[0])

    def expected(scale):  # identity experts: each token's weighted sum of its valid pairs' rows
        valid = ((ids >= 0) & (ids < num_experts)).float()
        return ((w.detach() * scale * valid).sum(1, keepdim=True) * x.detach()).to(x.dtype)

    def plain_combine(d):
        with torch.no_grad():
            return a2a.moe_a2a_combine_expert_major(d.output_payloads[0].detach().clone(), d, *args, 0, 1)

    def dispatch():
        return moe_a2a_dispatch_expert_major_differentiable(ids, [x], *args, tokens, 0, 1, top_k, num_experts,
                                                            router_weights=w)

    d = dispatch()
    y = moe_a2a_combine_expert_major_differentiable(d.output_payloads[0] * 1.0,
                                                    d._replace(router_weights=d.router_weights * 2), ids, *args, 0, 1)
    torch.testing.assert_close(y, expected(2))
    torch.testing.assert_close(plain_combine(d), expected(2))
    d = dispatch()
    torch.testing.assert_close(plain_combine(d), expected(1))


def test_a_repeated_differentiable_combine_with_other_router_weights_is_refused():
    """A repeated differentiable expert-major combine whose router weights are
    not the ones an earlier combine of the round applied is refused on the
    CPU (a workspace whose header the host reads): it would write them while
    a peer may still be reading the earlier combine's, which then came out
    wrong on 3-15% of the ranks' steps. A repeat with the same weights runs."""
    ep, tokens, top_k, num_experts, hidden = 2, 4, 2, 4, 8
    gen = torch.Generator().manual_seed(32)
    ids = [reference.random_routing(tokens, top_k, num_experts, gen) for _ in range(ep)]
    xs = [torch.randn(tokens, hidden, generator=gen, requires_grad=True) for _ in range(ep)]
    ws = [(torch.rand(tokens, top_k, generator=gen) + 0.25).requires_grad_() for _ in range(ep)]
    sim = make_em_sim(ep, tokens, hidden, top_k, num_experts)
    got = sim.run(lambda r: moe_a2a_dispatch_expert_major_differentiable(
        ids[r], [xs[r]], sim.workspace, sim.metainfo[r], tokens, r, ep, top_k, num_experts, router_weights=ws[r]))
    halves = [d._replace(router_weights=torch.full_like(d.router_weights, 0.5)) for d in got]

    def combine(dispatched):
        return sim.run(lambda r: moe_a2a_combine_expert_major_differentiable(
            got[r].output_payloads[0] * 1.0, dispatched[r], ids[r], sim.workspace, sim.metainfo[r], r, ep))

    first = combine(halves)
    with pytest.raises(ValueError, match="every combine of a round must apply the same router weights"):
        combine(got)
    again = combine(halves)
    for r in range(ep):
        assert torch.equal(again[r], first[r]), f"rank {r}"


def _plain_and_differentiable(expert_major: bool, plain: bool, device, gen_seed: int = 25, eplb: int = 0):
    """One eager round trip of every rank with inputs that require grad,
    through the plain functions or the differentiable ones (on a workspace
    initialized with ``eplb`` EPLB experts): each rank's output, input
    gradient (and router weights' gradient, expert-major)."""
    ep, tokens, top_k, num_experts, hidden = 2, 5, 2, 4, 8
    gen = torch.Generator().manual_seed(gen_seed)
    sim = (make_em_sim(ep, tokens, hidden, top_k, num_experts, device=device, eplb_stats_num_experts=eplb)
           if expert_major else make_sim(ep, tokens, hidden, top_k, device=device, eplb_stats_num_experts=eplb))
    ids = [reference.random_routing(tokens, top_k, num_experts, gen).to(device) for _ in range(ep)]
    xs = [torch.randn(tokens, hidden, generator=gen).to(device).requires_grad_() for _ in range(ep)]
    ws = [torch.rand(tokens, top_k, generator=gen).to(device).requires_grad_() for _ in range(ep)]
    args = lambda r: (sim.workspace, sim.metainfo[r])  # noqa: E731

    def dispatch(r):
        if expert_major:
            f = a2a.moe_a2a_dispatch_expert_major if plain else moe_a2a_dispatch_expert_major_differentiable
            return f(ids[r], [xs[r]], *args(r), tokens, r, ep, top_k, num_experts, router_weights=ws[r])
        f = a2a.moe_a2a_dispatch if plain else moe_a2a_dispatch_differentiable
        return f(ids[r], [xs[r]], *args(r), tokens, r, ep, top_k, num_experts)

    got = sim.run(dispatch)

    def combine(r):
        if expert_major:
            y = got[r].output_payloads[0] * 3.0
            if plain:
                return a2a.moe_a2a_combine_expert_major(y, got[r], *args(r), r, ep)
            return moe_a2a_combine_expert_major_differentiable(y, got[r], ids[r], *args(r), r, ep)
        y = got[r][0][0] * 3.0
        if plain:
            return a2a.moe_a2a_combine(y, tokens, *args(r), tokens, r, ep, top_k, got[r][1])
        return moe_a2a_combine_differentiable(y, ids[r], *args(r), tokens, r, ep, top_k, num_experts, got[r][1])

    outs = sim.run(combine)
    sim.run(lambda r: outs[r].sum().backward())  # the backward is a collective too
    planes = [g.output_payloads[0] if expert_major else g[0][0] for g in got]
    return sim, outs, xs, ws, planes


def _assert_same_round(expert_major: bool, got: tuple, want: tuple) -> None:
    """Two results of _plain_and_differentiable, ``(outs, xs, ws)`` each: every
    rank's output, input gradient and (expert-major) router weights' gradient
    bitwise equal."""
    for r, (out, x, w, ref_out, ref_x, ref_w) in enumerate(zip(*got, *want)):
        assert_bytes_equal(out.detach(), ref_out.detach(), f"rank {r} output")
        assert_bytes_equal(x.grad, ref_x.grad, f"rank {r} input gradient")
        if expert_major:
            assert_bytes_equal(w.grad, ref_w.grad, f"rank {r} router weights' gradient")


@pytest.mark.parametrize("expert_major", [False, True], ids=["rank_major", "expert_major"])
def test_plain_functions_with_inputs_that_require_grad_are_differentiable(expert_major, device):
    """DESIGN.md section 3: dispatch and combine are differentiable. The plain
    functions, called eagerly under grad mode with payloads (or router
    weights) that require grad, run as the differentiable ones: the same
    outputs and gradients, bitwise, and received rows that are new tensors
    (not workspace views, which the backward's exchange overwrites)."""
    sim, outs, xs, ws, planes = _plain_and_differentiable(expert_major, True, device)
    _assert_same_round(expert_major, (outs, xs, ws), _plain_and_differentiable(expert_major, False, device)[1:4])
    for r in range(len(outs)):
        assert planes[r].untyped_storage().data_ptr() != sim.workspace.untyped_storage().data_ptr()


@pytest.mark.parametrize("plain", [False, True], ids=["differentiable", "plain"])
@pytest.mark.parametrize("expert_major", [False, True], ids=["rank_major", "expert_major"])
def test_training_on_a_workspace_with_eplb_statistics(expert_major, plain, device):
    """A workspace initialized with EPLB statistics trains as one without
    (the exchanges with gradients gather no statistics): outputs and
    gradients bitwise those of the same round on a workspace without them,
    and a plain dispatch after it still gathers every rank's statistics."""
    eplb = 6
    sim, outs, xs, ws, _ = _plain_and_differentiable(expert_major, plain, device, eplb=eplb)
    _assert_same_round(expert_major, (outs, xs, ws), _plain_and_differentiable(expert_major, plain, device)[1:4])
    tokens, top_k, num_experts = 5, 2, 4
    stats = [torch.arange(eplb, dtype=torch.int32, device=device) * 10 + r for r in range(sim.ep_size)]
    ids = reference.random_routing(tokens, top_k, num_experts, torch.Generator().manual_seed(3)).to(device)
    x = torch.zeros(tokens, 8, device=device)

    def round_with_stats(r):
        if expert_major:
            dispatched = a2a.moe_a2a_dispatch_expert_major(ids, [x], sim.workspace, sim.metainfo[r], tokens, r,
                                                           sim.ep_size, top_k, num_experts, eplb_local_stats=stats[r])
            gathered = dispatched.eplb_gathered_stats.clone()
            a2a.moe_a2a_combine_expert_major(dispatched.output_payloads[0], dispatched, sim.workspace,
                                             sim.metainfo[r], r, sim.ep_size)
            return gathered
        (recv,), offset, gathered = a2a.moe_a2a_dispatch(ids, [x], sim.workspace, sim.metainfo[r], tokens, r,
                                                         sim.ep_size, top_k, num_experts, eplb_local_stats=stats[r])
        gathered = gathered.clone()
        a2a.moe_a2a_combine(recv, tokens, sim.workspace, sim.metainfo[r], tokens, r, sim.ep_size, top_k, offset)
        return gathered

    for r, gathered in enumerate(sim.run(round_with_stats)):
        assert torch.equal(gathered, torch.stack(stats)), f"rank {r}"


def test_moe_alltoall_with_payloads_that_require_grad(device):
    """MoeAlltoAll's dispatch and combine go through the plain functions: with
    a payload that requires grad they train as the differentiable ones
    (gradient as the dense sum's), and invalid_token_expert_id, which cleans
    the workspace's ids that such a dispatch does not return, is refused."""
    tokens, top_k, num_experts, hidden = 4, 2, 4, 8
    gen = torch.Generator().manual_seed(28)
    a2a_layer = a2a.MoeAlltoAll(a2a.Mapping(world_size=1, rank=0, moe_ep_size=1), tokens, top_k, num_experts,
                                hidden_size=hidden, dtype=torch.float32, device=device)
    ids = reference.random_routing(tokens, top_k, num_experts, gen).to(device)
    x = torch.randn(tokens, hidden, generator=gen).to(device).requires_grad_()
    with pytest.raises(ValueError, match="invalid_token_expert_id is not taken with payloads that require grad"):
        a2a_layer.dispatch(ids, [x, ids], tokens, invalid_token_expert_id=-1, expert_id_payload_index=1)
    (recv,) = a2a_layer.dispatch(ids, [x], tokens)
    out = a2a_layer.combine(recv * 2.0, tokens)
    out.sum().backward()
    # One rank: each token comes back once, doubled.
    assert_bytes_equal(out.detach(), x.detach() * 2.0, "output")
    assert_bytes_equal(x.grad, torch.full_like(x, 2.0), "input gradient")


def test_plain_combine_with_grad_after_a_plain_dispatch_is_refused():
    """An expert output that requires grad (its parameters do) after a dispatch
    of payloads that did not: the dispatch's received rows are workspace
    views, which the combine's backward would overwrite before the expert's
    backward reads them, so the combine is refused, naming the fix; its
    options that the differentiable combine lacks are refused by name."""
    ep, tokens, top_k, num_experts, hidden = 1, 4, 2, 4, 8
    gen = torch.Generator().manual_seed(27)
    sim = make_sim(ep, tokens, hidden, top_k)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    weight = torch.tensor(2.0, requires_grad=True)
    (recv,), offset, _ = a2a.moe_a2a_dispatch(ids, [x], sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k,
                                              num_experts)
    with pytest.raises(ValueError, match="moe_a2a_combine: the payload requires grad, but this rank's last "
                                         "dispatch on the workspace was not a rank-major dispatch of payloads"):
        a2a.moe_a2a_combine(recv * weight, tokens, sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k, offset)
    with torch.no_grad():
        a2a.moe_a2a_combine(recv * weight, tokens, sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k, offset)
    (recv,), offset, _ = a2a.moe_a2a_dispatch(ids, [x.requires_grad_()], sim.workspace, sim.metainfo[0], tokens, 0,
                                              1, top_k, num_experts)
    with pytest.raises(ValueError, match="moe_a2a_combine: output is not taken with a payload that requires grad"):
        a2a.moe_a2a_combine(recv * weight, tokens, sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k, offset,
                            output=torch.empty(tokens, hidden))
    # The flags are read as the plain combine reads them: 'no' is no flag, 0 is off.
    with pytest.raises(ValueError, match="moe_a2a_combine: use_low_precision must be True or False, got 'no'"):
        a2a.moe_a2a_combine(recv * weight, tokens, sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k, offset,
                            use_low_precision="no")
    out = a2a.moe_a2a_combine(recv * weight, tokens, sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k, offset,
                              use_low_precision=0, low_precision_block_scales=0)
    out.sum().backward()
    assert x.grad is not None and weight.grad is not None


def test_a_non_contiguous_payload_combines_as_its_contiguous_copy():
    """The rank-major differentiable combine refused a non-contiguous payload
    ('payload must be contiguous') where the expert-major one took it; both
    take it now, with the contiguous copy's output and gradient."""
    tokens, top_k, num_experts, hidden = 5, 2, 4, 8
    gen = torch.Generator().manual_seed(26)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    sim = make_sim(1, tokens, hidden, top_k)
    args = (sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k, num_experts)
    results = []
    for transposed in (False, True):
        recv, offset, _ = moe_a2a_dispatch_differentiable(ids, [x], *args)
        y = (recv[0] * 2).detach().requires_grad_()
        rows = y.transpose(1, 2).contiguous().transpose(1, 2) if transposed else y
        assert rows.is_contiguous() != transposed
        out = moe_a2a_combine_differentiable(rows, ids, *args, offset)
        out.square().sum().backward()
        results.append((out.detach(), y.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_a_combine_with_another_num_experts_than_its_dispatch_is_refused():
    """The backward routes the output gradient by the combine's ids and
    num_experts: with another num_experts than the dispatch's (here 8 against
    4, which puts every expert on rank 0 of 2), the forward's sums are right
    and the gradients of the tokens sent to both ranks are half of what they
    should be. Refused, naming both values; the round then closes normally."""
    ep, tokens, top_k, num_experts, hidden = 2, 4, 2, 4, 8
    gen = torch.Generator().manual_seed(24)
    ids = [reference.random_routing(tokens, top_k, num_experts, gen) for _ in range(ep)]
    xs = [torch.randn(tokens, hidden, generator=gen).requires_grad_() for _ in range(ep)]
    sim = make_sim(ep, tokens, hidden, top_k)

    def round_trip(r):
        args = (sim.workspace, sim.metainfo[r], tokens, r, ep, top_k)
        (y,), offset, _ = moe_a2a_dispatch_differentiable(ids[r], [xs[r]], *args, num_experts)
        try:
            moe_a2a_combine_differentiable(y * 2, ids[r], *args, 2 * num_experts, offset)
        except ValueError as e:
            refused = str(e)
        else:
            refused = None
        moe_a2a_combine_differentiable(y * 2, ids[r], *args, num_experts, offset).sum().backward()
        return refused

    refused = sim.run(round_trip)
    for r in range(ep):
        assert refused[r] is not None and re.search(
            r"num_experts must be that of this rank's preceding dispatch \(4; .*got 8", refused[r]), refused[r]
        # d(sum of 2 * each distinct destination rank's row)/dx: 2 per rank the token went to.
        ranks = [len({int(e) * ep // num_experts for e in row}) for row in ids[r]]
        want = 2 * torch.tensor(ranks, dtype=torch.float32)[:, None].expand(tokens, hidden)
        torch.testing.assert_close(xs[r].grad, want)


@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_ids_written_in_place_after_their_dispatch_are_refused(layout):
    """The combine's backward routes the gradient by the dispatch's ids: the
    same ids tensor written in place between the dispatch and the combine (a
    remap of a reused buffer) gave the right output and wrong gradients of
    the experts' weights, the payloads needing none. Refused, as other ids
    are, by the tensor's version counter; a plain combine closes the round,
    and a dispatch of the new ids then trains."""
    tokens, top_k, num_experts, hidden = 5, 2, 4, 8
    gen = torch.Generator().manual_seed(29)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    weight = torch.tensor(2.0, requires_grad=True)
    if layout == "rank-major":
        sim = make_sim(1, tokens, hidden, top_k)
        args = (sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k)

        def combine(ids, *, plain=False):
            if plain:
                return a2a.moe_a2a_combine(recv[0].detach(), tokens, *args[:5], top_k, offset)
            return moe_a2a_combine_differentiable(recv[0] * weight, ids, *args, num_experts, offset)

        recv, offset, _ = moe_a2a_dispatch_differentiable(ids, [x], *args, num_experts)
    else:
        sim = make_em_sim(1, tokens, hidden, top_k, num_experts)
        args = (sim.workspace, sim.metainfo[0])

        def combine(ids, *, plain=False):
            rows = got.output_payloads[0]
            if plain:
                return a2a.moe_a2a_combine_expert_major(rows.detach(), got, *args, 0, 1)
            return moe_a2a_combine_expert_major_differentiable(rows * weight, got, ids, *args, 0, 1)

        got = moe_a2a_dispatch_expert_major_differentiable(ids, [x], *args, tokens, 0, 1, top_k, num_experts)
    ids.copy_((ids + 1) % num_experts)
    with pytest.raises(ValueError, match="ids of this rank's preceding dispatch .* were written in place since "
                                         "that dispatch: the combine's backward would send the output gradient"):
        combine(ids)
    with pytest.raises(ValueError, match="written in place since"):  # its values put back: still refused
        combine(ids.copy_((ids - 1) % num_experts))
    combine(ids, plain=True)

    def dispatch(ids):
        nonlocal recv, offset, got
        if layout == "rank-major":
            recv, offset, _ = moe_a2a_dispatch_differentiable(ids, [x], *args, num_experts)
        else:
            got = moe_a2a_dispatch_expert_major_differentiable(ids, [x], *args, tokens, 0, 1, top_k, num_experts)

    recv = offset = got = None
    dispatch(ids)
    combine(ids).sum().backward()
    assert weight.grad is not None
    # The ids a row of a larger buffer whose other row is written: the
    # version counter is the buffer's, so it is not read as the ids' writes.
    rows = torch.stack([ids, ids])
    dispatch(rows[0])
    rows[1].copy_((ids + 1) % num_experts)
    combine(rows[0]).sum().backward()


@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_a_backward_counts_no_invalid_id_or_dropped_pair_again(layout, device):
    """The backward's exchanges dispatch the forward's ids again: the header's
    counters of ids >= num_experts and of dropped pairs still count them once."""
    tokens, top_k, num_experts, hidden = 6, 2, 4, 8
    gen = torch.Generator().manual_seed(23)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    ids[0, 0], ids[3, 1] = num_experts, num_experts + 5
    ids = ids.to(device)
    x = torch.randn(tokens, hidden, generator=gen).to(device).requires_grad_()
    w = torch.rand(tokens, top_k, generator=gen).to(device).requires_grad_()
    if layout == "rank-major":
        sim = make_sim(1, tokens, hidden, top_k, device=device)
        recv, offset, _ = moe_a2a_dispatch_differentiable(ids, [x], sim.workspace, sim.metainfo[0], tokens, 0, 1,
                                                          top_k, num_experts)
        out = moe_a2a_combine_differentiable(recv[0] * 2, ids, sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k,
                                             num_experts, offset)
    else:
        sim = make_em_sim(1, tokens, hidden, top_k, num_experts, max_tokens_per_expert=1, device=device)
        got = moe_a2a_dispatch_expert_major_differentiable(ids, [x], sim.workspace, sim.metainfo[0], tokens, 0, 1,
                                                           top_k, num_experts, router_weights=w,
                                                           max_tokens_per_expert=1)
        out = moe_a2a_combine_expert_major_differentiable(got.output_payloads[0] * 2, got, ids, sim.workspace,
                                                          sim.metainfo[0], 0, 1)

    def tallies():
        return (int(a2a.moe_a2a_get_invalid_expert_count(sim.workspace, sim.metainfo[0], 0)),
                int(a2a.moe_a2a_get_dropped_pair_count(sim.workspace, sim.metainfo[0], 0)))

    forward = tallies()
    assert forward[0] == 2 and (forward[1] > 0) == (layout == "expert-major")
    out.sum().backward()
    assert tallies() == forward


@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_a_forward_whose_backward_does_not_fit_is_refused_before_it_runs(layout):
    """The dispatch's backward may need more room than the forward
    (rank-major: the ids' plane beside the widest dtype's gradient rows;
    expert-major: with planes of several dtypes, an fp32 row of their
    gradients and the slots): such a
    forward is refused at once, naming the size, with the workspace untouched
    (a backward refused halfway would leave its round open); without grad the
    same forward runs."""
    tokens, top_k, num_experts, hidden = 256, 8, 16, 64
    gen = torch.Generator().manual_seed(22)
    ids = reference.random_routing(tokens, top_k, num_experts, gen).long()
    xs = [torch.randn(tokens, hidden, generator=gen, dtype=torch.bfloat16, requires_grad=True) for _ in range(4)]
    w = torch.rand(tokens, top_k, generator=gen, requires_grad=True)
    if layout == "rank-major":
        # Sized for the forward's dispatch: four bf16 rows and the fp32
        # weights; the backward's round dispatches the int64 ids, twice the
        # weights' bytes, beside the four rows' bf16 gradients.
        size = a2a.moe_a2a_get_workspace_size_per_rank(1, tokens, 4 * 2 * hidden + 4 * top_k, 0)
        sim = a2a.SimulatedEP(1, tokens, dispatch_bytes_per_token=0, combine_bytes_per_token=0,
                              workspace_size_per_rank=size)

        def dispatch(payloads):
            return moe_a2a_dispatch_differentiable(ids, [*payloads, w], sim.workspace, sim.metainfo[0], tokens, 0, 1,
                                                   top_k, num_experts)
        text = "size the workspace so that its dispatch and combine bytes per token together cover"
    else:
        # Sized for the forward: three bf16 rows and an fp32 one, a bf16 row
        # back; the backward's rows are fp32 (the planes' dtypes differ), the
        # four rows' gradients and a column per slot.
        xs[3] = xs[3].float()
        size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(1, tokens, (3 * 2 + 4) * hidden, 2 * hidden,
                                                                    num_experts, top_k)
        sim = a2a.SimulatedEP(1, tokens, dispatch_bytes_per_token=0, combine_bytes_per_token=0,
                              workspace_size_per_rank=size)

        def dispatch(payloads):
            return moe_a2a_dispatch_expert_major_differentiable(ids, payloads, sim.workspace, sim.metainfo[0], tokens,
                                                                0, 1, top_k, num_experts, router_weights=w)
        text = "size the workspace with combine bytes per token of at least"
    before = sim.workspace.clone()
    with pytest.raises(ValueError, match="workspace too small for the backward of this call") as info:
        dispatch(xs)
    assert text in str(info.value)
    assert torch.equal(sim.workspace, before)
    with torch.no_grad():
        dispatch(xs)  # no backward to come: the forward fits


def test_dispatch_backward_combines_each_gradient_in_its_own_dtype():
    """The dispatch's backward used to combine every floating payload's
    gradient packed in their promoted dtype: fp32 router weights sent beside
    bf16 hidden states widened the hidden gradient's rows to fp32, twice
    their bytes, plus a column per top-k slot, whether the weights required
    grad or not. Now a payload that needs no gradient takes no part, and each
    dtype is a combine of its own (the round's repeated combines): the
    combines' payload shapes (from the profiler) show the bf16 rows alone,
    and with the weights requiring grad a combine of their top-k columns
    beside; the hidden gradient is bitwise the same either way, and the
    weights' gradient is the reference's."""
    # One rank, called on this thread: the profiler records this thread's ops.
    ep_size, tokens, top_k, num_experts, hidden = 1, 6, 2, 4, 16
    gen = torch.Generator().manual_seed(29)
    ids = [reference.random_routing(tokens, top_k, num_experts, gen) for _ in range(ep_size)]
    xs = [torch.randn(tokens, hidden, generator=gen, dtype=torch.bfloat16) for _ in range(ep_size)]
    ws = [torch.rand(tokens, top_k, generator=gen) for _ in range(ep_size)]
    grads = [torch.randn(tokens, hidden, generator=gen, dtype=torch.bfloat16) for _ in range(ep_size)]

    def train(weights_require_grad):
        sim = make_sim(ep_size, tokens, hidden, top_k)
        leaves = [x.clone().requires_grad_() for x in xs]
        weights = [w.clone().requires_grad_(weights_require_grad) for w in ws]

        def step(rank):
            w = weights[rank]
            (rx, _, rw), offset, _ = moe_a2a_dispatch_differentiable(
                ids[rank], [leaves[rank], ids[rank], w], sim.workspace, sim.metainfo[rank], tokens, rank, ep_size,
                top_k, num_experts)
            y = (rx.float() * (1 + rw.sum(-1, keepdim=True))).to(rx.dtype)
            out = moe_a2a_combine_differentiable(y, ids[rank], sim.workspace, sim.metainfo[rank], tokens, rank,
                                                 ep_size, top_k, num_experts, offset)
            out.backward(grads[rank])

        with torch.profiler.profile(record_shapes=True) as prof:
            step(0)
        widths = {e.input_shapes[0][-1] for e in prof.events() if e.name == "moe_a2a::combine"}
        return [x.grad for x in leaves], [w.grad for w in weights], widths

    got, _, widths = train(weights_require_grad=False)
    # The forward's combine and the backward's: rows of hidden elements; the closing combine's one fp32 zero.
    assert widths == {hidden, 1}
    with_weights, weight_grads, widths = train(weights_require_grad=True)
    assert widths == {hidden, 1, top_k}  # the weights' gradient: a combine of its own
    for g, w in zip(got, with_weights):
        assert g.dtype == torch.bfloat16 and torch.equal(g, w)
    # The reference: one rank's exchange moves every row to its own place, so the layer without it.
    w = ws[0].clone().requires_grad_()
    ((xs[0].float() * (1 + w.sum(-1, keepdim=True))).to(torch.bfloat16)).backward(grads[0])
    assert torch.equal(weight_grads[0], w.grad)


def test_expert_major_dispatch_backward_combines_gradients_in_their_dtype():
    """The expert-major form: the backward combined one fp32 row a pair, the
    gradients of every floating plane and a column per top-k slot. A plane
    that needs no gradient now takes no part, and where the planes that do
    share a dtype (a bf16 hidden state) their gradients travel in it, the
    slots' columns in a combine of their own (the combines' payload shapes,
    from the profiler); planes of several dtypes still share one fp32 row.
    The hidden gradient is bitwise the same every way."""
    tokens, top_k, num_experts, hidden, extra = 6, 2, 4, 16, 3
    gen = torch.Generator().manual_seed(31)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.bfloat16)
    side = torch.randn(tokens, extra, generator=gen)
    w = torch.rand(tokens, top_k, generator=gen)
    grad = torch.randn(tokens, hidden, generator=gen, dtype=torch.bfloat16)

    def train(side_requires_grad):
        sim = make_em_sim(1, tokens, hidden + extra, top_k, num_experts)
        leaf = x.clone().requires_grad_()
        with torch.profiler.profile(record_shapes=True) as prof:
            d = moe_a2a_dispatch_expert_major_differentiable(
                ids, [leaf, side.clone().requires_grad_(side_requires_grad)], sim.workspace, sim.metainfo[0], tokens,
                0, 1, top_k, num_experts, router_weights=w)
            y = (d.output_payloads[0].float() * 3).to(torch.bfloat16)
            moe_a2a_combine_expert_major_differentiable(y, d, ids, sim.workspace, sim.metainfo[0], 0, 1).backward(grad)
        widths = {e.input_shapes[0][-1] for e in prof.events() if e.name == "moe_a2a::combine_expert_major"}
        return leaf.grad, widths

    got, widths = train(side_requires_grad=False)
    assert widths == {hidden, 1, top_k}  # the bf16 rows (as the forward's), the closing zero, the slots' columns
    want, wider = train(side_requires_grad=True)
    assert wider == {hidden, 1, hidden + extra + top_k}
    assert torch.equal(got, want)


def test_received_rows_are_new_tensors_with_zero_padding():
    """After a dispatch that filled every receive row with NaN, the
    differentiable dispatch's received planes equal the reference's whole
    (valid rows, and zero padding), the counts too, and share no memory with
    the workspace."""
    ep_size, tokens, top_k, num_experts, hidden, runtime_max = 2, (3, 5), 2, 4, 8, 6
    gen = torch.Generator().manual_seed(17)
    sim = make_sim(ep_size, runtime_max, hidden, top_k)
    full_ids = [reference.random_routing(runtime_max, top_k, num_experts, gen) for _ in range(ep_size)]
    nan = torch.full((runtime_max, hidden), float("nan"))

    def poison(rank):
        recv, offset, _ = a2a.moe_a2a_dispatch(full_ids[rank], [nan, full_ids[rank]], sim.workspace,
                                               sim.metainfo[rank], runtime_max, rank, ep_size, top_k, num_experts)
        a2a.moe_a2a_combine(recv[0].clone(), runtime_max, sim.workspace, sim.metainfo[rank], runtime_max, rank,
                            ep_size, top_k, offset)

    sim.run(poison)
    ids = [reference.random_routing(n, top_k, num_experts, gen) for n in tokens]
    xs = [torch.randn(n, hidden, generator=gen) for n in tokens]

    def dispatch(rank):
        return moe_a2a_dispatch_differentiable(ids[rank], [xs[rank], ids[rank]], sim.workspace, sim.metainfo[rank],
                                               runtime_max, rank, ep_size, top_k, num_experts)

    got = sim.run(dispatch)
    ref = reference.reference_dispatch(ids, [[x, i] for x, i in zip(xs, ids)], ep_size=ep_size,
                                       num_experts=num_experts, runtime_max_tokens_per_rank=runtime_max)
    workspace = sim.workspace.untyped_storage().data_ptr()
    for rank, (received, _, counts) in enumerate(got):
        assert torch.equal(counts, ref.recv_counts[rank])
        for plane, want in zip(received, ref.recv[rank]):
            assert torch.equal(plane, want)
            assert plane.untyped_storage().data_ptr() != workspace


class _PassThrough(torch.overrides.TorchFunctionMode):
    """A torch function mode that changes nothing but makes the training ops
    that run under it take their Python bodies (fastpath.direct_call_ok)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


C_BODIES = ("dispatch_owned", "combine_owned", "dispatch_round", "combine_round")


def test_the_c_bodies_equal_the_python_bodies_bit_for_bit(device, monkeypatch):
    """A training step with first and second order gradients, the training
    ops run by their C++ bodies (_C.dispatch_owned, ...), by their Python
    bodies (direct_call_ok False) and under a torch function mode (the
    forward's ops by their Python bodies: the backward runs without the mode):
    bitwise the same received planes (padding rows zero over poisoned
    workspace bytes, payloads zeroed as words of every width, one of zero
    columns), counts, outputs, gradients and header tallies (ids >=
    num_experts counted once), and the workspace's version counter still
    where it was."""
    ep_size, tokens, top_k, num_experts, runtime_max = 2, (5, 3), 2, 4, 6
    gen = torch.Generator().manual_seed(31)
    # Row bytes 6, 20, 8 (the ids, inserted third), 2 (1-D), 3 and 0: zeroed
    # as words of 2, 4, 8, 2 and 1 bytes, and none.
    shapes = [((3,), torch.bfloat16), ((5,), torch.float32), ((), torch.float16), ((3,), torch.uint8),
              ((0,), torch.float32)]
    ids = [reference.random_routing(n, top_k, num_experts, gen) for n in tokens]
    ids[0][1, 0], ids[1][2, 1] = num_experts, num_experts + 3
    # On the device before the ranks run: on CUDA their steps are issued one
    # after another, and a copy from pageable host memory inside rank 1's step
    # waited for rank 0's kernels, which wait for rank 1.
    ids = [i.to(device) for i in ids]
    inputs = [[(torch.randn(n, *shape, generator=gen) * 4).to(dtype).to(device) for shape, dtype in shapes]
              for n in tokens]
    grad_out = [torch.randn(n, 5, generator=gen).to(device) for n in tokens]
    sim = a2a.SimulatedEP(ep_size, runtime_max, dispatch_bytes_per_token=128, combine_bytes_per_token=128,
                          device=device)
    calls = dict.fromkeys(C_BODIES, 0)
    for name in C_BODIES:
        def counted(*args, _body=getattr(a2a_autograd._C, name), _name=name):
            calls[_name] += 1
            return _body(*args)
        monkeypatch.setattr(a2a_autograd._C, name, counted)

    def step(sim, rank, mode):
        ep_size = sim.ep_size
        with mode:
            i = ids[rank].clone()
            payloads = [p.clone() for p in inputs[rank]]
            payloads.insert(2, i)
            for p in payloads:
                if p.dtype in (torch.bfloat16, torch.float32):  # the fp16 payload needs no gradient
                    p.requires_grad_()
            version = sim.workspace._version
            # The tally read on the rank's stream, not the host: on CUDA the
            # ranks' steps are issued one after another, so a host sync inside
            # one would wait for peers not issued yet.
            tally = a2a.moe_a2a_get_invalid_expert_count(sim.workspace, sim.metainfo[rank], rank)
            counted_before = tally.clone()
            recv, offset, counts = moe_a2a_dispatch_differentiable(i, payloads, sim.workspace, sim.metainfo[rank],
                                                                   runtime_max, rank, ep_size, top_k, num_experts)
            y = recv[1] * recv[0][..., :1].float() + recv[5].sum(-1, keepdim=True)
            out = moe_a2a_combine_differentiable(y, i, sim.workspace, sim.metainfo[rank], runtime_max, rank, ep_size,
                                                 top_k, num_experts, offset)
            leaves = [payloads[0], payloads[1], payloads[5]]
            grads = torch.autograd.grad(out, leaves, grad_out[rank], create_graph=True)
            second = torch.autograd.grad(sum((g.float() * g.float()).sum() for g in grads), leaves[:2])
            assert sim.workspace._version == version
            return [t.detach() for t in (*recv, counts, out, *grads, *second)], tally - counted_before

    def run(sim, mode=contextlib.nullcontext):
        calls.update(dict.fromkeys(C_BODIES, 0))
        # Every receive row (padding included) and the combine region hold NaN bytes.
        sim.workspace[:, a2a.layout.HEADER_BYTES:].fill_(0xFF)
        return sim.run(lambda rank: step(sim, rank, mode()))

    def run_python_bodies(sim):
        with monkeypatch.context() as patched:
            patched.setattr(a2a_autograd, "direct_call_ok", lambda *tensors: False)
            return run(sim)

    if device == "cuda":
        # The step's torch kernels launched once before the ranks run
        # (SimulatedEP.run: a kernel's first launch in a process waits on the
        # device for every stream's work, rank 0's exchange that waits for
        # rank 1 included), by the same step on one rank: the same planes'
        # alignments, so the same kernels.
        one = a2a.SimulatedEP(1, runtime_max, dispatch_bytes_per_token=128, combine_bytes_per_token=128,
                              device=device)
        run(one), run(one, _PassThrough), run_python_bodies(one)
    got = run(sim)
    # A forward's two ops, then a round of each kind in each backward; the
    # second order's backward of the first's combine_round, which combined
    # the bf16 and the fp32 gradients each in a combine of its own, is a
    # dispatch_round of each.
    assert calls == {"dispatch_owned": ep_size, "combine_owned": ep_size, "dispatch_round": 3 * ep_size,
                     "combine_round": 2 * ep_size}, calls
    under_mode = run(sim, _PassThrough)
    assert calls["dispatch_owned"] == calls["combine_owned"] == 0, calls
    python = run_python_bodies(sim)
    assert not any(calls.values()), calls
    for want, what in ((python, "python bodies"), (under_mode, "under a torch function mode")):
        for rank in range(ep_size):
            assert int(got[rank][1]) == int(want[rank][1]) == 1  # one id >= num_experts a rank, counted once
            assert len(got[rank][0]) == len(want[rank][0])
            for k, (g, w) in enumerate(zip(got[rank][0], want[rank][0])):
                assert_bytes_equal(g, w, f"{what}: rank {rank}, result {k}")


@pytest.mark.parametrize("layout", ["rank-major", "expert-major"])
def test_a_payload_of_zero_columns_trains(layout):
    """A payload with a 0 in its row's shape (any trailing shape, DESIGN.md
    section 3) beside the hidden rows: its received planes are zero-size
    tensors of their shape, its gradient too, and the hidden rows' output and
    gradient are bitwise those of the same step without it (its planes were
    viewed as their dtype after the exchange: a torch error, with every rank's
    round left open)."""
    ep_size, tokens, top_k, num_experts, hidden = 2, 4, 2, 4, 8
    gen = torch.Generator().manual_seed(23)
    ids = [reference.random_routing(tokens, top_k, num_experts, gen) for _ in range(ep_size)]
    xs = [torch.randn(tokens, hidden, generator=gen) for _ in range(ep_size)]
    ws = [torch.rand(tokens, top_k, generator=gen) for _ in range(ep_size)]
    sim = (make_sim(ep_size, tokens, hidden, top_k) if layout == "rank-major"
           else make_em_sim(ep_size, tokens, hidden, top_k, num_experts))

    def step(rank, extra):
        x = xs[rank].clone().requires_grad_()
        empty = [torch.zeros(tokens, 3, 0, requires_grad=True)] if extra else []
        if layout == "rank-major":
            recv, offset, _ = moe_a2a_dispatch_differentiable(ids[rank], [x, *empty], sim.workspace,
                                                              sim.metainfo[rank], tokens, rank, ep_size, top_k,
                                                              num_experts)
            planes = recv
            out = moe_a2a_combine_differentiable(recv[0] * 2, ids[rank], sim.workspace, sim.metainfo[rank], tokens,
                                                 rank, ep_size, top_k, num_experts, offset)
        else:
            got = moe_a2a_dispatch_expert_major_differentiable(ids[rank], [x, *empty], sim.workspace,
                                                               sim.metainfo[rank], tokens, rank, ep_size, top_k,
                                                               num_experts, router_weights=ws[rank])
            planes = got.output_payloads
            out = moe_a2a_combine_expert_major_differentiable(planes[0] * 2, got, ids[rank], sim.workspace,
                                                              sim.metainfo[rank], rank, ep_size)
        if extra:
            assert planes[1].shape == (*planes[0].shape[:2], 3, 0)
            out = out + planes[1].sum()  # an empty sum: 0, and a path back to the empty payload
        return out, x, empty

    def run(extra):
        results = sim.run(lambda r: step(r, extra))
        grads = sim.run(lambda r: torch.autograd.grad(results[r][0].sum(), [results[r][1], *results[r][2]]))
        return [res[0].detach() for res in results], grads

    outs, grads = run(False)
    outs_extra, grads_extra = run(True)
    for r in range(ep_size):
        assert torch.equal(outs_extra[r], outs[r]) and torch.equal(grads_extra[r][0], grads[r][0])
        assert grads_extra[r][1].shape == (tokens, 3, 0)


def test_compiled_forwards_then_one_backward():
    """Two compiled forwards on one workspace (two layers compiled apart),
    then one backward: the first graph's saved workspace has not moved under
    the second's exchanges, and the gradients are the eager ones."""
    torch._dynamo.reset()
    tokens, top_k, num_experts, hidden = 4, 2, 4, 8
    gen = torch.Generator().manual_seed(8)
    sim = make_sim(1, tokens, hidden, top_k)
    ids = [reference.random_routing(tokens, top_k, num_experts, gen) for _ in range(2)]
    xs = [torch.randn(tokens, hidden, generator=gen) for _ in range(2)]
    ws = [torch.rand(tokens, top_k, generator=gen) for _ in range(2)]

    def two_layers(step):
        x = [t.clone().requires_grad_() for t in xs]
        w = [t.clone().requires_grad_() for t in ws]
        outs = [step(x[i], w[i], ids[i], sim.workspace, sim.metainfo[0], tokens, 0, 1, top_k, num_experts)
                for i in range(2)]
        (outs[0].sum() + 2 * outs[1].sum()).backward()
        return [t.grad for t in x + w]

    want = two_layers(compiled_train_step)
    got = two_layers(torch.compile(compiled_train_step, fullgraph=True))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("transform", ["grad", "vjp", "vmap"])
def test_torch_func_transforms_are_refused_by_name(transform):
    """torch.func transforms over the differentiable exchanges are refused
    before any exchange runs, naming what to use instead (torch's own error
    spoke of an autograd.Function's setup_context); the workspace then
    round-trips as before."""
    sim = make_sim(1, 4, 8, 2)
    gen = torch.Generator().manual_seed(41)
    ids = reference.random_routing(4, 2, 4, gen)
    x = torch.randn(4, 8, generator=gen)

    def step(x):
        (recv,), offset, _ = moe_a2a_dispatch_differentiable(ids, [x], sim.workspace, sim.metainfo[0], 4, 0, 1, 2, 4)
        return moe_a2a_combine_differentiable(recv * 2, ids, sim.workspace, sim.metainfo[0], 4, 0, 1, 2, 4, offset)

    run = {"grad": lambda: torch.func.grad(lambda x: step(x).sum())(x),
           "vjp": lambda: torch.func.vjp(step, x),
           "vmap": lambda: torch.func.vmap(step)(x.unsqueeze(0))}[transform]
    version = sim.workspace._version
    with pytest.raises(NotImplementedError, match="do not support torch.func transforms .* torch.autograd"):
        run()
    assert sim.workspace._version == version
    x.requires_grad_()
    step(x).sum().backward()  # one rank: each token's row comes back once, times 2
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


@pytest.mark.parametrize("fn", ["differentiable", "plain"])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_forward_mode_ad_is_refused_by_name(fn, requires_grad):
    """A dual tensor (torch.autograd.forward_ad) lost its tangent without a
    word, or, requiring grad too, raised torch's error about a missing jvp
    after the dispatch ran, which left the round open. Refused before any
    exchange runs; the workspace then round-trips as before."""
    import torch.autograd.forward_ad as fwad

    sim = make_sim(1, 4, 8, 2)
    gen = torch.Generator().manual_seed(43)
    ids = reference.random_routing(4, 2, 4, gen)
    x = torch.randn(4, 8, generator=gen)
    dispatch = moe_a2a_dispatch_differentiable if fn == "differentiable" else a2a.moe_a2a_dispatch
    version = sim.workspace._version
    with fwad.dual_level():
        dual = fwad.make_dual(x.clone().requires_grad_(requires_grad), torch.ones_like(x))
        with pytest.raises(NotImplementedError, match=r"forward-mode AD \(torch.autograd.forward_ad\) is not "
                                                      r"supported: .* torch.autograd \(loss.backward\(\)"):
            dispatch(ids, [dual], sim.workspace, sim.metainfo[0], 4, 0, 1, 2, 4)
    assert sim.workspace._version == version
    x.requires_grad_()
    (recv,), offset, _ = moe_a2a_dispatch_differentiable(ids, [x], sim.workspace, sim.metainfo[0], 4, 0, 1, 2, 4)
    moe_a2a_combine_differentiable(recv * 2, ids, sim.workspace, sim.metainfo[0], 4, 0, 1, 2, 4,
                                   offset).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_a_rank_record_survives_another_rank_purging_the_table():
    """Simulated ranks record their dispatches from threads of their own. A
    rank whose new workspace took a freed one's address brings that
    address's dead entry back to life; another rank's insertion purged dead
    entries from a snapshot and could drop the entry after the update: the
    rank's combine then found no differentiable dispatch (a property test
    failed once in CI). Here the update comes, from another thread, right
    in the middle of a purge that has already found the entry dead: the
    record must survive."""
    ids = torch.zeros(1, 1, dtype=torch.int32)
    ws, other = torch.zeros(2, 256, dtype=torch.uint8), torch.zeros(2, 256, dtype=torch.uint8)
    freed = torch.zeros(1)
    dead = weakref.ref(freed)
    del freed
    updater = threading.Thread(target=fastpath.note_dispatch, args=(ws, 0, ids, 8))

    def midway():
        # Evaluated by the purge after the entry it found dead: the other rank's update happens now.
        updater.start()
        updater.join(timeout=0.5)  # (blocked until the purge ends, where the table is locked)
        return None

    table = fastpath._LAST_DISPATCH
    saved, purge_at = dict(table), fastpath._LAST_DISPATCH_PURGE_AT[0]
    try:
        table.clear()
        table[(ws.data_ptr(), 0)] = [dead, ids, None, 8, False]  # a freed workspace's, at ws's address
        table[(-1, 0)] = [midway, None, None, 8, False]
        fastpath._LAST_DISPATCH_PURGE_AT[0] = 0  # the next new key purges
        fastpath.note_dispatch(other, 0, ids, 8)
        updater.join()
        assert fastpath.last_dispatch(ws, 0) is not None
        assert fastpath.last_dispatch(other, 0) is not None
    finally:
        table.clear()
        table.update(saved)
        fastpath._LAST_DISPATCH_PURGE_AT[0] = purge_at


def test_a_freed_workspaces_record_says_nothing_of_a_new_one_at_its_address():
    """The table of last dispatches is keyed by address: a workspace at a
    freed one's address (the CUDA caching allocator hands it out again at
    once) met that one's record, a backward's mark among it, and its eager
    combine was refused as one after a backward it never ran. A record whose
    workspace is gone says nothing; a live one's, through the workspace or a
    view of it, stands."""
    ids = torch.zeros(1, 1, dtype=torch.int32)
    ws = torch.zeros(2, 256, dtype=torch.uint8)
    freed = torch.zeros(1)
    dead = weakref.ref(freed)
    del freed
    table = fastpath._LAST_DISPATCH
    saved = dict(table)
    try:
        table.clear()
        # A freed workspace's record at ws's address, marked by a backward's round at ws's version.
        table[(ws.data_ptr(), 0)] = [dead, ids, None, 8, False, 0, ws._version]
        fastpath.refuse_combine_after_backward("moe_a2a_combine", ws, 0, False)
        assert fastpath.last_dispatch(ws, 0) is None
        fastpath.note_backward_round(ws, 0)  # marks nothing of ws either
        # ws's own record: the mark stands, for ws and for a view of it.
        fastpath.note_dispatch(ws, 0, ids, 8)
        fastpath.note_backward_round(ws, 0)
        for workspace in (ws, ws.view(2, 16, 16).view(2, 256)):
            with pytest.raises(ValueError, match="a backward ran since this rank's last dispatch"):
                fastpath.refuse_combine_after_backward("moe_a2a_combine", workspace, 0, False)
            assert fastpath.last_dispatch(workspace, 0) is not None
    finally:
        table.clear()
        table.update(saved)


@pytest.mark.parametrize("combine", ["plain", "differentiable"])
@pytest.mark.parametrize("form", ["rank-major", "expert-major", "expert-major-ids-only"])
def test_a_combine_after_the_backward_is_refused(form, combine):
    """A backward exchanges in whole rounds of its own, which close the
    forward's round. A combine after it went to the workspace as a repeated
    combine of the backward's round: refused with messages about offsets or
    weights that the caller had right, or, where the backward's layout was
    the forward's (an expert-major forward of ids and weights alone), run on
    the backward's weights (1.0: an unweighted sum, no error). Refused by
    name on every rank; the next round runs as usual."""
    ep, tokens, hidden, top_k, experts = 2, 4, 8, 2, 4
    gen = torch.Generator().manual_seed(47)
    ids = [reference.random_routing(tokens, top_k, experts, gen) for _ in range(ep)]
    xs = [torch.randn(tokens, hidden, generator=gen) for _ in range(ep)]
    ws = [torch.rand(tokens, top_k, generator=gen) for _ in range(ep)]
    sim = make_sim(ep, tokens, hidden, top_k) if form == "rank-major" else make_em_sim(ep, tokens, hidden, top_k,
                                                                                        experts)
    fn = {("rank-major", "plain"): "moe_a2a_combine", ("rank-major", "differentiable"): "moe_a2a_combine_differentiable"}
    name = fn.get((form, combine), "moe_a2a_combine_expert_major" + ("_differentiable" if combine != "plain" else ""))

    def forward(r, x):
        if form == "rank-major":
            (recv,), offset, _ = moe_a2a_dispatch_differentiable(ids[r], [x], sim.workspace, sim.metainfo[r], tokens,
                                                                 r, ep, top_k, experts)
            y = recv * 2
            out = moe_a2a_combine_differentiable(y, ids[r], sim.workspace, sim.metainfo[r], tokens, r, ep, top_k,
                                                 experts, offset)
            again = (lambda: a2a.moe_a2a_combine(y.detach(), tokens, sim.workspace, sim.metainfo[r], tokens, r, ep,
                                                 top_k, offset)) if combine == "plain" else (
                lambda: moe_a2a_combine_differentiable(y, ids[r], sim.workspace, sim.metainfo[r], tokens, r, ep,
                                                       top_k, experts, offset))
            return out, again
        w = ws[r].clone().requires_grad_()
        payloads = [] if form == "expert-major-ids-only" else [x]
        d = moe_a2a_dispatch_expert_major_differentiable(ids[r], payloads, sim.workspace, sim.metainfo[r], tokens, r,
                                                         ep, top_k, experts, router_weights=w)
        y = torch.ones(*d.local_expert_ids.shape, hidden) if not payloads else d.output_payloads[0] * 2
        out = moe_a2a_combine_expert_major_differentiable(y, d, ids[r], sim.workspace, sim.metainfo[r], r, ep)
        plain = d._replace(router_weights=d.router_weights.detach())
        again = (lambda: a2a.moe_a2a_combine_expert_major(y.detach(), plain, sim.workspace, sim.metainfo[r], r,
                                                          ep)) if combine == "plain" else (
            lambda: moe_a2a_combine_expert_major_differentiable(y, d, ids[r], sim.workspace, sim.metainfo[r], r, ep))
        return out, again

    def step(r):
        x = xs[r].clone().requires_grad_()
        out, again = forward(r, x)
        out.sum().backward()
        version = sim.workspace._version
        with torch.no_grad() if combine == "plain" else contextlib.nullcontext():
            with pytest.raises(ValueError, match=rf"^{name}: a backward ran since this rank's last dispatch .* "
                                                 r"every combine of a round comes before its backward"):
                again()
        assert sim.workspace._version == version
        # The next round, forward and backward, as before the refusal.
        x2 = xs[r].clone().requires_grad_()
        out2, _ = forward(r, x2)
        out2.sum().backward()
        return out.detach(), out2.detach()

    for first, second in sim.run(step):
        assert torch.equal(first, second)


def test_an_eager_combine_after_a_compiled_dispatch_follows_the_backward():
    """A training step's backward marks the rank's last recorded dispatch as
    closed; a compiled dispatch records nothing, but moves the workspace's
    version counter, so the eager combine of its round runs (it was refused
    as if it followed the backward)."""
    sim = make_sim(1, 4, 8, 2)
    ws, meta = sim.workspace, sim.metainfo[0]
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]], dtype=torch.int32)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(53), requires_grad=True)
    (recv,), offset, _ = moe_a2a_dispatch_differentiable(ids, [x], ws, meta, 4, 0, 1, 2, 4)
    moe_a2a_combine_differentiable(recv * 2, ids, ws, meta, 4, 0, 1, 2, 4, offset).sum().backward()

    @torch.compile(backend="eager", fullgraph=True)
    def dispatch(ids, x):
        out, offset, _ = a2a.moe_a2a_dispatch(ids, [x], ws, meta, 4, 0, 1, 2, 4)
        return out[0] * 2, offset

    with torch.no_grad():
        y, offset = dispatch(ids, x.detach())
        out = a2a.moe_a2a_combine(y, 4, ws, meta, 4, 0, 1, 2, offset)
    assert torch.equal(out, x.detach() * 2)  # one rank: each token is its only destination, once
