"""``python -m torch_moe_a2a bench --expert-major``: the expert-major round trip
against the rank-major one plus the permutation a user writes in plain PyTorch
today (docs/DESIGN.md section 8).

For every point (ep simulated ranks, T tokens per rank, the preset's
payloads: hidden states, int32 expert ids, fp32 router weights):

- ours: ``moe_a2a_dispatch(expert_major=True, router_weights=...)``, a
  stand-in expert (each local expert's rows times 1, written into buffers
  allocated up front), ``moe_a2a_combine_expert_major`` (weights applied in
  the combine); eager, and on CUDA per replay of one graph holding every
  rank's round trip (bench/replay.py's method, launch floor beside it);
- baseline: the rank-major dispatch of the same payloads, then on every rank
  the permutation (the receive counts to the host, the valid rows gathered,
  the local (row, slot) pairs found with ``nonzero`` and sorted by expert
  with a stable sort, the stand-in expert, each pair weighted and summed
  back per row with ``index_add_``, scattered into the ``[ep, T, H]``
  combine payload), then the rank-major combine; eager only (its host syncs
  cannot live in a graph).
- time: the median over ``--iters`` round trips after ``--warmup``, each
  round trip's wall time until the device finished (both eager paths pay
  the same host launches); graph replays by CUDA events, as bench/replay.py.
- check: ours against the reference bitwise; the baseline within bf16
  rounding of ours (it rounds each rank's partial sum to bf16 before the
  combine adds them).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import Tensor

from .. import layout
from ..api import moe_a2a_dispatch, moe_a2a_get_recv_counts, moe_a2a_get_workspace_size_per_rank
from ..expert_major import moe_a2a_combine_expert_major, moe_a2a_get_workspace_size_per_rank_expert_major
from ..reference import reference_combine_expert_major, reference_dispatch_expert_major
from ..simulate import SimulatedEP
from .common import (
    COMBINE_ATOL,
    COMBINE_RTOL,
    SEED,
    Clock,
    Point,
    capture_graph,
    expert_owner,
    fmt,
    format_table,
    make_set,
    sweep,
    wall_us,
)

DEFAULT_EP = {"cuda": (1, 4, 8), "cpu": (1, 2)}
DEFAULT_TOKENS = {"cuda": (1, 16, 128), "cpu": (1, 16)}
DEFAULT_ITERS = {"cuda": 30, "cpu": 5}
DEFAULT_WARMUP = {"cuda": 5, "cpu": 1}


class ExpertMajorPoint:
    """Both round trips of one point, every rank's buffers allocated up front."""

    def __init__(self, point: Point, device: torch.device):
        self.point, self.device = point, device
        p, ep, T = point.preset, point.ep, point.tokens
        gen_cpu = torch.Generator().manual_seed(SEED)
        gen_dev = torch.Generator(device=device).manual_seed(SEED)
        self.set = make_set(point, device, gen_cpu, gen_dev, expert_owner(p.num_experts, ep))
        hidden_row = p.hidden * p.dtype.itemsize
        size = max(
            moe_a2a_get_workspace_size_per_rank_expert_major(ep, T, hidden_row, hidden_row, p.num_experts, p.top_k),
            moe_a2a_get_workspace_size_per_rank(ep, T, point.dispatch_row_bytes, point.combine_row_bytes),
        )
        self.sim = SimulatedEP(ep, T, dispatch_bytes_per_token=0, combine_bytes_per_token=0, device=device,
                               workspace_size_per_rank=size)
        self.ranges = [layout.expert_range(p.num_experts, ep, r) for r in range(ep)]
        M = ep * T
        self.expert_out = [torch.empty((hi - lo, M, p.hidden), dtype=p.dtype, device=device) for lo, hi in self.ranges]
        self.payloads = [torch.empty((ep, T, p.hidden), dtype=p.dtype, device=device) for _ in range(ep)]
        self.outputs = [torch.empty((T, p.hidden), dtype=p.dtype, device=device) for _ in range(ep)]
        self.dispatched: list[Any] = [None] * ep
        self.received: list[Any] = [None] * ep
        self.offsets: list[int] = [0] * ep

    # ---- ours ----
    def _hidden(self, r: int) -> Tensor:
        return self.set.payloads[r][0]

    def ours_dispatch(self, r: int) -> None:
        p, T = self.point.preset, self.point.tokens
        s = self.set
        self.dispatched[r] = moe_a2a_dispatch(
            s.ids[r], [self._hidden(r)], self.sim.workspace, self.sim.metainfo[r], T, r, self.point.ep, p.top_k,
            p.num_experts, expert_major=True, router_weights=s.payloads[r][2])
        torch.mul(self.dispatched[r].output_payloads[0], 1.0, out=self.expert_out[r])  # the stand-in expert

    def ours_combine(self, r: int) -> Tensor:
        return moe_a2a_combine_expert_major(self.expert_out[r], self.dispatched[r], self.sim.workspace,
                                            self.sim.metainfo[r], r, self.point.ep)

    def ours_round_trip(self) -> list[Tensor]:
        # Every rank's dispatch, then every rank's combine: nothing allocates
        # while a peer's kernel spins (SimulatedEP's rule).
        self.sim.run(self.ours_dispatch)
        return self.sim.run(self.ours_combine)

    # ---- baseline ----
    def base_dispatch(self, r: int) -> None:
        p, T, s = self.point.preset, self.point.tokens, self.set
        views, offset, _ = self.sim.dispatch_rank(r, s.ids[r], s.payloads[r], T, p.top_k, p.num_experts)
        self.received[r], self.offsets[r] = views, offset

    def permute(self, r: int) -> None:
        """What a user writes today between the rank-major dispatch and combine."""
        ep = self.point.ep
        hidden, ids, weights = self.received[r]
        counts = moe_a2a_get_recv_counts(self.sim.workspace, self.sim.metainfo[r], r).tolist()  # host sync
        rows = torch.cat([hidden[s, :counts[s]] for s in range(ep)])
        row_ids = torch.cat([ids[s, :counts[s]] for s in range(ep)])
        row_w = torch.cat([weights[s, :counts[s]] for s in range(ep)])
        lo, hi = self.ranges[r]
        row, slot = ((row_ids >= lo) & (row_ids < hi)).nonzero(as_tuple=True)  # host sync
        order = torch.argsort(row_ids[row, slot] - lo, stable=True)
        row, slot = row[order], slot[order]
        y = rows[row] * 1.0  # the stand-in expert on the expert-grouped rows
        summed = torch.zeros((rows.shape[0], rows.shape[1]), dtype=torch.float32, device=rows.device)
        summed.index_add_(0, row, y.float() * row_w[row, slot].unsqueeze(-1))
        starts = [sum(counts[:s]) for s in range(ep)]
        for s in range(ep):
            self.payloads[r][s, :counts[s]] = summed[starts[s]:starts[s] + counts[s]].to(self.payloads[r].dtype)

    def base_combine(self, r: int) -> None:
        p, T = self.point.preset, self.point.tokens
        self.sim.combine_rank(r, self.payloads[r], T, T, p.top_k, self.offsets[r], output=self.outputs[r])

    def base_round_trip(self) -> list[Tensor]:
        self.sim.run(self.base_dispatch)
        for r in range(self.point.ep):
            with self._rank_stream(r):
                self.permute(r)
        self.sim.run(self.base_combine)
        return self.outputs

    def _rank_stream(self, r: int) -> Any:
        return torch.cuda.stream(self.sim.streams[r]) if self.sim.streams else contextlib.nullcontext()

    # ---- checks ----
    def check(self) -> Optional[str]:
        point, s = self.point, self.set
        ref = reference_dispatch_expert_major([i.cpu() for i in s.ids], [[self._hidden(r).cpu()] for r in range(point.ep)],
                                              [s.payloads[r][2].cpu() for r in range(point.ep)], ep_size=point.ep,
                                              num_experts=point.preset.num_experts,
                                              max_tokens_per_expert=point.ep * point.tokens)
        expected = reference_combine_expert_major([(pl[0].float() * 1.0).to(point.preset.dtype) for pl in ref.planes],
                                                  ref)
        ours = [o.cpu() for o in self.ours_round_trip()]
        for r in range(point.ep):
            if not torch.equal(ours[r].view(torch.uint8), expected[r].view(torch.uint8)):
                return f"ours, rank {r}: differs from the reference"
        base = [o.cpu() for o in self.base_round_trip()]
        for r in range(point.ep):
            if not torch.allclose(base[r].float(), ours[r].float(), rtol=COMBINE_RTOL, atol=COMBINE_ATOL):
                return f"baseline, rank {r}: differs from ours beyond bf16 rounding"
        return None


def run_point(point: Point, device: torch.device, warmup: int, iters: int) -> dict:
    """One point: ours eager (and per replay on CUDA), the baseline eager; microseconds."""
    from . import replay

    em = ExpertMajorPoint(point, device)
    error = em.check()
    if error is not None:
        return {"status": "FAIL", "notes": [error]}
    clock = Clock(device)
    result = {"status": "ok", "notes": [],
              "ours_eager_us": wall_us(clock, em.ours_round_trip, warmup, iters),
              "baseline_eager_us": wall_us(clock, em.base_round_trip, warmup, iters)}
    if device.type == "cuda":
        def ours_rank(r: int) -> None:
            em.ours_dispatch(r)
            em.outputs[r] = em.ours_combine(r)

        graph = capture_graph(lambda: em.sim.run(ours_rank))[0]
        floor = capture_graph(lambda: em.sim.run(lambda r: (replay.empty_kernel(), replay.empty_kernel())))[0]
        result["ours_graph_us"] = replay.time_replays(clock, graph, warmup, iters)
        result["floor_us"] = replay.time_replays(clock, floor, warmup, iters)
    return result


def run(device: torch.device, eps: Optional[list[int]], tokens: Optional[list[int]], iters: Optional[int],
        warmup: Optional[int], preset: str = "deepseek-v3") -> list[dict]:
    """Every point of eps x tokens; prints the table and returns the records."""
    kind = device.type
    eps = list(DEFAULT_EP[kind]) if eps is None else eps
    tokens = list(DEFAULT_TOKENS[kind]) if tokens is None else tokens
    iters = DEFAULT_ITERS[kind] if iters is None else iters
    warmup = DEFAULT_WARMUP[kind] if warmup is None else warmup
    print(f"expert-major round trip against rank-major + the plain-PyTorch permutation: {preset}, median of {iters} "
          f"after {warmup}", flush=True)
    records = sweep(eps, tokens, preset, lambda point: run_point(point, device, warmup, iters))
    rows = []
    for rec in records:
        ep, T = rec["ep"], rec["tokens"]
        ours, base = rec.get("ours_eager_us"), rec.get("baseline_eager_us")
        rows.append([str(ep), str(T), rec["status"], fmt(rec.get("floor_us"), ".1f"),
                     fmt(rec.get("ours_graph_us"), ".1f"), fmt(ours, ".1f"), fmt(base, ".1f"),
                     fmt(None if ours is None or base is None else base / ours, ".2f", "x"),
                     "; ".join(rec["notes"])])
    print(format_table(["ep", "T", "status", "floor us", "ours graph us", "ours eager us", "baseline eager us",
                        "speedup (eager)", "notes"], rows, left={2, 8}))
    return records
