"""``python -m torch_moe_a2a demo|bench``.

demo: simulated EP round trip (dispatch -> toy MoE -> combine on every rank),
checked bitwise against the plain-PyTorch reference; exits 1 on a mismatch.
bench: hands its arguments to ``torch_moe_a2a.bench.main``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import Optional

import torch

USAGE = "usage: python -m torch_moe_a2a {demo,bench} [options]   (-h after a command for its options)"


def _demo_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_moe_a2a demo",
        description="Simulated EP round trip (dispatch -> toy MoE -> combine) on every rank, "
        "checked bitwise against the plain-PyTorch reference.",
    )
    p.add_argument("--ep", type=int, default=4, help="simulated ranks (default 4)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank (default 64)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size, bf16 (default 256)")
    p.add_argument("--top-k", type=int, default=4, help="experts per token (default 4)")
    p.add_argument("--experts", type=int, default=16, help="number of experts (default 16)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda if available, else cpu")
    p.add_argument("--rounds", type=int, default=3, help="round trips, each checked; time is the fastest")
    p.add_argument("--seed", type=int, default=0)
    return p


def demo(argv: list[str]) -> int:
    from . import SimulatedEP, moe_a2a_combine, moe_a2a_dispatch, moe_a2a_get_recv_counts
    from .reference import random_routing, reference_combine, reference_dispatch, toy_moe

    args = _demo_parser().parse_args(argv)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    ep, n, hidden, top_k, num_experts = args.ep, args.tokens, args.hidden, args.top_k, args.experts

    gen = torch.Generator().manual_seed(args.seed)
    ids = [random_routing(n, top_k, num_experts, gen) for _ in range(ep)]
    xs = [torch.randn((n, hidden), generator=gen).to(torch.bfloat16) for _ in range(ep)]
    ws = [torch.rand((n, top_k), generator=gen).softmax(dim=-1) for _ in range(ep)]
    payloads = [[xs[r], ids[r], ws[r]] for r in range(ep)]
    dispatch_row = hidden * 2 + top_k * 4 + top_k * 4
    combine_row = hidden * 2

    # The reference exchange, once: the same inputs every round.
    ref = reference_dispatch(ids, payloads, ep_size=ep, num_experts=num_experts, runtime_max_tokens_per_rank=n)
    ref_expert_out = [
        toy_moe(*ref.recv[r], ref.recv_counts[r], ep_rank=r, ep_size=ep, num_experts=num_experts) for r in range(ep)
    ]
    ref_out = reference_combine(ref_expert_out, ref, [n] * ep)

    sim = SimulatedEP(ep, n, dispatch_bytes_per_token=dispatch_row, combine_bytes_per_token=combine_row, device=device)
    dev_ids = [t.to(device) for t in ids]
    dev_payloads = [[t.to(device) for t in p] for p in payloads]

    # Phase by phase, every rank at once: on a GPU one host thread launches
    # all simulated ranks, and a rank's spinning kernel needs its peers
    # launched before the host may wait on anything (an allocation for the
    # toy MoE can wait for the device).
    timer = _CudaTimer(device) if device.type == "cuda" else _CpuTimer()
    best_ms = float("inf")
    ok = [True] * ep
    for _ in range(args.rounds):
        timer.start()
        dispatched = sim.dispatch(dev_ids, dev_payloads, n, top_k, num_experts)
        counts = [sim.recv_counts(r) for r in range(ep)]
        expert_out = [
            toy_moe(*dispatched[r][0], counts[r], ep_rank=r, ep_size=ep, num_experts=num_experts) for r in range(ep)
        ]
        outs = sim.combine(expert_out, [n] * ep, n, top_k, [d[1] for d in dispatched])
        best_ms = min(best_ms, timer.stop())
        for r in range(ep):
            recv, count = dispatched[r][0], counts[r].cpu()
            good = torch.equal(count, ref.recv_counts[r]) and torch.equal(outs[r].cpu(), ref_out[r])
            for s in range(ep):
                c = int(count[s])
                good = good and all(torch.equal(v[s, :c].cpu(), rv[s, :c]) for v, rv in zip(recv, ref.recv[r]))
            ok[r] = ok[r] and good

    print(f"torch-moe-a2a demo: ep {ep}, {n} tokens/rank, hidden {hidden} bf16, top-{top_k} of {num_experts} "
          f"experts, device {device}, {args.rounds} rounds")
    print(f"{'rank':>4} {'tokens':>6} {'recv':>6} {'bytes sent':>11} {'round ms':>8}  check")
    for r in range(ep):
        sent_rows = sum(len(pairs) for pairs in ref.routes[r])  # dispatch: one row per distinct destination
        recv_rows = int(ref.recv_counts[r].sum())  # combine: one row back per received token
        sent = sent_rows * dispatch_row + recv_rows * combine_row
        print(f"{r:>4} {n:>6} {recv_rows:>6} {sent:>11} {best_ms:>8.3f}  {'OK' if ok[r] else 'MISMATCH'}")
    if not all(ok):
        print("FAILED: outputs differ from the reference", file=sys.stderr)
        return 1
    print("all ranks match the reference bitwise")
    return 0


class _CpuTimer:
    """Wall time of one simulated round (all ranks)."""

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        return (time.perf_counter() - self._t0) * 1e3


class _CudaTimer:
    """Device time of one simulated round: events on the current stream, which
    SimulatedEP forks the rank streams from and joins them back into."""

    def __init__(self, device: torch.device) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._device = device

    def start(self) -> None:
        self._start.record()

    def stop(self) -> float:
        self._end.record()
        torch.cuda.synchronize(self._device)
        return self._start.elapsed_time(self._end)


def bench(argv: list[str]) -> int:
    try:
        module = importlib.import_module("torch_moe_a2a.bench")
    except ModuleNotFoundError as e:
        if e.name != "torch_moe_a2a.bench":
            raise
        print("python -m torch_moe_a2a bench: torch_moe_a2a.bench is not available in this installation",
              file=sys.stderr)
        return 2
    return module.main(argv)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"demo": demo, "bench": bench}
    if not argv or argv[0] not in commands:
        print(USAGE, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
