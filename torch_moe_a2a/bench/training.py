"""``python -m torch_moe_a2a bench --training``: the exchange of an MoE layer in
training, forward and backward, against what torchtitan does by default
(``all_to_all_single`` of the (token, expert) pairs, sorted by expert, under
autograd; docs/DESIGN.md, 'Gradients').

For every point (ep simulated ranks, T tokens per rank, the preset's hidden
states in its dtype, int32 expert ids, fp32 router weights), every rank's
hidden states require grad and the stand-in expert multiplies each received
row by the summed router weights of its pairs that the rank owns, so that
both paths compute out[t] = x[t] * sum(w[t]) and its gradient
grad_out[t] * sum(w[t]):

- ours: ``moe_a2a_dispatch_differentiable`` of ``[hidden, ids, weights]``,
  the stand-in expert, ``moe_a2a_combine_differentiable``, then
  ``out.backward(grad_out)`` on every rank (the backward runs a combine and
  a dispatch); the forward's ops rank after rank, then the backwards;
- baseline: on every rank the pairs sorted by expert (``argsort``, stable),
  their hidden rows gathered (``index_select``), the counts per destination
  rank to the host, the all-to-all of the rows (``split`` and ``cat`` on one
  device stand for ``all_to_all_single``: the same bytes, its autograd),
  the stand-in expert, the all-to-all back, the pairs summed per token in
  fp32 (``index_add``), then one backward over every rank's output (the
  stand-in joins the ranks' graphs into one);
- time: the median over ``--iters`` forward + backward steps after
  ``--warmup``, each step's wall time until the device finished. Both paths
  are eager: the baseline's host syncs (the split sizes) cannot live in a
  graph, and at training sizes the host's launches are a small part;
- ``--router-grad``: the router weights require grad too, as where the
  routing probabilities travel with the tokens and are differentiated
  through the exchange (DeepEP's and Megatron's pattern); both paths then
  give them their gradient, checked against sum(grad_out * x);
- ceiling: ours as a ratio to the device's copy bandwidth measured in the
  same run (``ours x copy``): the bytes of the step's four exchanges by the
  byte model of docs/DESIGN.md section 8 (:func:`step_bytes`) per second,
  over that bandwidth;
- check: both outputs and both input gradients within bf16 rounding of
  x * sum(w) and grad_out * sum(w).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .. import layout
from ..api import moe_a2a_get_workspace_size_per_rank
from ..autograd import moe_a2a_combine_differentiable, moe_a2a_dispatch_differentiable
from ..simulate import SimulatedEP
from .common import (
    COMBINE_ATOL,
    COMBINE_RTOL,
    COPY_BYTES,
    PRESETS,
    SEED,
    Clock,
    Point,
    StopSignals,
    copy_ratio,
    expert_owner,
    fmt,
    format_table,
    make_set,
    op_bytes_for,
    report_copy_ceiling,
    stopped_line,
    sweep,
    wall_us,
)

DEFAULT_EP = {"cuda": (8,), "cpu": (1, 2)}
DEFAULT_TOKENS = {"cuda": (512, 4096), "cpu": (1, 16)}
DEFAULT_ITERS = {"cuda": 10, "cpu": 3}
DEFAULT_WARMUP = {"cuda": 2, "cpu": 1}


def step_bytes(point: Point, sends: int, router_grad: bool = False) -> int:
    """Bytes of a training step's exchanges, summed over ranks, by the byte
    model of docs/DESIGN.md section 8, when the ranks send ``sends`` (token,
    distinct destination) pairs in all.

    Args:
        point: the ranks, tokens per rank and the preset's rows.
        sends: (token, distinct destination rank) pairs of all ranks.
        router_grad: whether the router weights require grad: the backward's
            round then combines their fp32 gradients too, in a combine of
            their own.

    Returns:
        The forward's dispatch of the hidden states, ids and weights and its
        staged combine of the expert outputs, then the backward's dispatch of
        the output gradient and its staged combine of the received rows'
        gradients: rows of the hidden states' dtype, as the combine's.
        Not counted: what each backward round carries besides (the ids'
        dispatch, one fp32 per row), and the copies of the received planes
        out of the workspace.
    """
    ops = op_bytes_for(point, sends)
    tokens = point.ep * point.tokens
    gradient_dispatch = point.combine_row_bytes * (tokens + sends)
    weights_row = 4 * point.preset.top_k
    # Staged: every received row read and written once more.
    weights_combine = weights_row * (sends + tokens) + 2 * weights_row * sends if router_grad else 0
    return int(ops["round-trip"] + gradient_dispatch + ops["combine"] + weights_combine)


class TrainingPoint:
    """Both paths of one point: inputs, output gradients, the workspace."""

    def __init__(self, point: Point, device: torch.device, router_grad: bool = False):
        self.point, self.device, self.router_grad = point, device, router_grad
        p, ep, T = point.preset, point.ep, point.tokens
        gen_cpu = torch.Generator().manual_seed(SEED)
        gen_dev = torch.Generator(device=device).manual_seed(SEED)
        owner = expert_owner(p.num_experts, ep)
        s = make_set(point, device, gen_cpu, gen_dev, owner)
        self.sends = int(s.destinations.sum())
        self.hidden = [s.payloads[r][0] for r in range(ep)]
        self.ids, self.weights = s.ids, [s.payloads[r][-1] for r in range(ep)]
        self.grad_out = [torch.randn(h.shape, generator=gen_dev, device=device, dtype=h.dtype) for h in self.hidden]
        self.owner = owner.to(device)
        self.ranges = [layout.expert_range(p.num_experts, ep, r) for r in range(ep)]
        row = p.hidden * p.dtype.itemsize
        size = moe_a2a_get_workspace_size_per_rank(ep, T, row + 8 * p.top_k + 256, row + 256)
        self.sim = SimulatedEP(ep, T, dispatch_bytes_per_token=0, combine_bytes_per_token=0, device=device,
                               workspace_size_per_rank=size)
        self.x: list[Any] = [None] * ep
        self.w: list[Any] = [None] * ep
        self.out: list[Any] = [None] * ep
        self.pending: list[Any] = [None] * ep

    def _leaf(self, r: int) -> Tensor:
        """Rank r's hidden states as a new leaf that requires grad (and its
        router weights as one that does with ``router_grad``)."""
        self.x[r] = self.hidden[r].detach().clone().requires_grad_()
        self.w[r] = self.weights[r].detach().clone().requires_grad_(self.router_grad)
        return self.x[r]

    def _stand_in(self, r: int, rows: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        lo, hi = self.ranges[r]
        coef = (weights * ((ids >= lo) & (ids < hi))).sum(dim=-1, keepdim=True)
        return (rows.float() * coef).to(rows.dtype)

    # ---- ours ----
    def _ours_forward(self, r: int) -> None:
        p, ep, T = self.point.preset, self.point.ep, self.point.tokens
        x = self._leaf(r)
        recv, offset, _ = moe_a2a_dispatch_differentiable(self.ids[r], [x, self.ids[r], self.w[r]],
                                                          self.sim.workspace, self.sim.metainfo[r], T, r, ep,
                                                          p.top_k, p.num_experts)
        self.pending[r] = (self._stand_in(r, *recv), offset)

    def _ours_combine(self, r: int) -> None:
        p, ep, T = self.point.preset, self.point.ep, self.point.tokens
        y, offset = self.pending[r]
        self.out[r] = moe_a2a_combine_differentiable(y, self.ids[r], self.sim.workspace, self.sim.metainfo[r], T, r,
                                                     ep, p.top_k, p.num_experts, offset)

    def ours_step(self) -> None:
        # Every rank's dispatch, every rank's combine, every rank's backward:
        # each collective is called by all ranks before the next.
        self.sim.run(self._ours_forward)
        self.sim.run(self._ours_combine)
        self.sim.run(lambda r: self.out[r].backward(self.grad_out[r]))

    # ---- baseline ----
    def base_step(self) -> None:
        # On the current stream, as the benchmark's other baselines: its ranks
        # never wait for each other, and the all-to-all's stand-in reads every
        # rank's rows.
        ep, k = self.point.ep, self.point.preset.top_k
        send, counts, order = [], [], []
        for r in range(ep):
            x = self._leaf(r)
            flat = self.ids[r].reshape(-1).long()
            pairs = torch.argsort(flat, stable=True)
            rows = x.index_select(0, pairs // k)
            counts.append(torch.bincount(self.owner[flat[pairs]], minlength=ep).tolist())  # host sync
            send.append((rows, self.ids[r].reshape(-1)[pairs], self.w[r].reshape(-1)[pairs]))
            order.append(pairs)
        # all_to_all_single on one device: rank d receives every source's d-th split.
        parts = [[t.split(counts[s]) for t in send[s]] for s in range(ep)]
        back = []
        for d in range(ep):
            rows, ids, w = (torch.cat([parts[s][i][d] for s in range(ep)]) for i in range(3))
            back.append(self._stand_in(d, rows, ids.unsqueeze(-1), w.unsqueeze(-1)).split([c[d] for c in counts]))
        for r in range(ep):
            rows = torch.cat([back[d][r] for d in range(ep)])
            out = torch.zeros(self.x[r].shape, dtype=torch.float32, device=self.device)
            # Each pair's row comes back weighted by the stand-in expert: a plain sum per token.
            self.out[r] = out.index_add(0, order[r] // k, rows.float()).to(rows.dtype)
        # One backward over every rank's output: the ranks' graphs are one
        # graph here, joined where the all-to-all's stand-in joins them.
        torch.autograd.backward(self.out, self.grad_out)

    # ---- checks ----
    def check(self, step: Any, name: str) -> Optional[str]:
        step()
        for r in range(self.point.ep):
            scale = self.weights[r].sum(dim=-1, keepdim=True)
            want_out = (self.hidden[r].float() * scale).to(self.hidden[r].dtype)
            want_grad = (self.grad_out[r].float() * scale).to(self.hidden[r].dtype)
            for got, want, what in ((self.out[r], want_out, "output"), (self.x[r].grad, want_grad, "gradient")):
                if got is None or not torch.allclose(got.detach().float(), want.float(), rtol=COMBINE_RTOL,
                                                     atol=COMBINE_ATOL):
                    return f"{name}, rank {r}: {what} differs from x * sum(w) beyond bf16 rounding"
            if self.router_grad:
                # Each weight scales its token's row once, at its expert's rank.
                want_w = (self.grad_out[r].float() * self.hidden[r].float()).sum(dim=-1, keepdim=True)
                got = self.w[r].grad
                if got is None or not torch.allclose(got, want_w.expand_as(got), rtol=COMBINE_RTOL,
                                                     atol=COMBINE_ATOL):
                    return f"{name}, rank {r}: router weights' gradient differs from sum(grad_out * x)"
        return None


def warm_up(device: torch.device, preset: str) -> None:
    """One step of both paths with one rank, before any point: the first
    simulated step of a process on the H200 stalled until its peers'
    timeout (ep 8, whichever point came first; never a later one): some
    first-use initialization on the host waits for the device while a peer's
    kernel spins for a rank not yet launched. One rank waits for no peer."""
    tp = TrainingPoint(Point(PRESETS[preset], 1, 2, fp8=False), device)
    tp.ours_step()
    tp.base_step()
    Clock(device).sync()


def run_point(point: Point, device: torch.device, warmup: int, iters: int, router_grad: bool = False) -> dict:
    """One point: both paths checked, then timed; microseconds per forward + backward step."""
    tp = TrainingPoint(point, device, router_grad)
    for step, name in ((tp.ours_step, "ours"), (tp.base_step, "baseline")):
        error = tp.check(step, name)
        if error is not None:
            return {"status": "FAIL", "notes": [error]}
    clock = Clock(device)
    return {"status": "ok", "notes": [], "ours_us": wall_us(clock, tp.ours_step, warmup, iters),
            "baseline_us": wall_us(clock, tp.base_step, warmup, iters),
            "ours_bytes": step_bytes(point, tp.sends, router_grad)}


def run(device: torch.device, eps: Optional[list[int]], tokens: Optional[list[int]], iters: Optional[int],
        warmup: Optional[int], preset: str = "deepseek-v3", router_grad: bool = False,
        stop: Optional[StopSignals] = None) -> tuple[list[dict], dict]:
    """Every point of eps x tokens (``stop``: as :func:`sweep`'s); prints the
    table; returns the records and the run's facts for --json (copy
    bandwidth, iterations, warmup, preset)."""
    kind = device.type
    eps = list(DEFAULT_EP[kind]) if eps is None else eps
    tokens = list(DEFAULT_TOKENS[kind]) if tokens is None else tokens
    iters = DEFAULT_ITERS[kind] if iters is None else iters
    warmup = DEFAULT_WARMUP[kind] if warmup is None else warmup
    warm_up(device, preset)
    print(f"training exchange, forward + backward, against all_to_all_single of the pairs under autograd: {preset}"
          f"{', router weights requiring grad' if router_grad else ''}, median of {iters} steps after {warmup}, wall "
          "time until the device finished", flush=True)
    # The ceiling of the 'ours x copy' column, measured in this run.
    copy_gbps = report_copy_ceiling(Clock(device), device, COPY_BYTES[kind])
    records = sweep(eps, tokens, preset, lambda point: run_point(point, device, warmup, iters, router_grad), stop)
    rows = []
    for rec in records:
        ep, T = rec["ep"], rec["tokens"]
        ours, base = rec.get("ours_us"), rec.get("baseline_us")
        rec["ours_copy_ratio"] = copy_ratio(rec, copy_gbps)
        rows.append([str(ep), str(T), rec["status"], fmt(ours, ".1f"), fmt(base, ".1f"),
                     fmt(None if ours is None or base is None else base / ours, ".2f", "x"),
                     fmt(rec["ours_copy_ratio"], ".3f"), "; ".join(rec["notes"])])
    print(format_table(["ep", "T", "status", "ours us", "baseline us", "speedup", "ours x copy", "notes"], rows,
                       left={2, 7}))
    stopped = stopped_line(stop, len(eps) * len(tokens), len(records))
    if stopped:
        print(stopped)
    return records, {"copy_bandwidth_GBps": copy_gbps, "iters": iters, "warmup": warmup, "preset": preset,
                     "router_grad": router_grad}
