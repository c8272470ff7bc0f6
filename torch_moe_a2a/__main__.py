"""``python -m torch_moe_a2a COMMAND [options]``: the command line.

demo: EP round trips (dispatch -> toy MoE -> combine on every rank), checked
bitwise against the plain-PyTorch reference; exits 1 on a mismatch. In one
process the ranks are simulated (``SimulatedEP``); launched by ``torchrun``
(RANK and WORLD_SIZE set) every process is one rank of a ``MoeAlltoAll`` over
the default group: on ``cuda:LOCAL_RANK`` (modulo the GPU count) with a CUDA
virtual-memory workspace, or on the CPU with a shared-memory one.
bench: ``torch_moe_a2a.bench.single``.
bench-dist: one rank per process under ``torchrun`` (``torchrun
--nproc-per-node N -m torch_moe_a2a bench-dist``): ``torch_moe_a2a.bench.distributed``.

Every command is an argparse subcommand; a bad argument ends in argparse's
message and exit code 2, never in a traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import __version__, layout
from .bench import distributed as bench_distributed
from .bench import single as bench_single
from .bench.common import NO_CUDA, int_at_least, int_in_range, start_process_group

PROG = "python -m torch_moe_a2a"
DISTRIBUTION = "torch-moe-a2a"
DEFAULT_SIMULATED_RANKS = 4


def package_version() -> str:
    """The running package's version (its build's, from pyproject.toml), with
    where it runs from when that is not the installed distribution."""
    try:
        installed = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return f"{__version__} (a source tree; {DISTRIBUTION} is not installed)"
    return __version__ if installed == __version__ else f"{__version__} (the installed distribution is {installed})"


def _add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ep", type=int_in_range(1, layout.MAX_RANKS, "ep_size"), default=None,
                   help=f"simulated ranks, 1..{layout.MAX_RANKS} (default {DEFAULT_SIMULATED_RANKS}); under "
                   "torchrun the world size (must match if given)")
    p.add_argument("--tokens", type=int_in_range(1, layout.MAX_NUM_TOKENS, "tokens"), default=64,
                   help="tokens per rank (default 64)")
    # At most a row of MAX_ROW_BYTES bf16 elements (2**27: larger rows the ops refuse).
    p.add_argument("--hidden", type=int_in_range(1, 1 << 27, "hidden"), default=256,
                   help="hidden size, bf16 (default 256)")
    p.add_argument("--top-k", type=int_in_range(1, layout.MAX_TOP_K, "top_k"), default=4,
                   help=f"experts per token, 1..{layout.MAX_TOP_K} and at most --experts (default 4)")
    p.add_argument("--experts", type=int_at_least(1, "num_experts"), default=16,
                   help="number of experts, at least ep_size (default 16)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda if available, else cpu")
    p.add_argument("--rounds", type=int_at_least(1, "rounds"), default=3,
                   help="round trips, each checked; time is the fastest (default 3)")
    p.add_argument("--seed", type=int_in_range(-(2**63), 2**63 - 1, "seed"), default=0,
                   help="seed of the random tokens and routes (default 0)")
    p.add_argument("--init-method", default="env://",
                   help="torch.distributed rendezvous under torchrun (default env://: MASTER_ADDR/MASTER_PORT); "
                        "without torchrun the ranks are simulated in this process and it is not used")


def _check_demo_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, ep: int) -> None:
    """The checks that need more than one argument, or torch: argparse errors (exit 2), before any work."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: {NO_CUDA}")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} > --experts {args.experts}: a token's experts are distinct")
    if args.experts < ep:
        parser.error(f"--experts {args.experts} < ep_size {ep}: every rank owns at least one expert")


@dataclass
class _Problem:
    """Every rank's inputs (CPU) and the reference exchange over all ranks."""

    ids: list  # [rank] int32 [n, top_k]
    payloads: list  # [rank] [hidden bf16 [n, H], ids int32 [n, top_k], weights fp32 [n, top_k]]
    ref: object  # reference.RefDispatch
    ref_out: list  # [rank] bf16 [n, H]
    dispatch_row: int  # bytes per token
    combine_row: int


def _demo_problem(args: argparse.Namespace, ep: int) -> _Problem:
    """Seeded inputs of every rank and the reference: the same in every process."""
    from .reference import (
        random_routing,
        reference_combine,
        reference_dispatch,
        toy_moe,
    )

    n, hidden, top_k, num_experts = args.tokens, args.hidden, args.top_k, args.experts
    gen = torch.Generator().manual_seed(args.seed)
    ids = [random_routing(n, top_k, num_experts, gen) for _ in range(ep)]
    xs = [torch.randn((n, hidden), generator=gen).to(torch.bfloat16) for _ in range(ep)]
    ws = [torch.rand((n, top_k), generator=gen).softmax(dim=-1) for _ in range(ep)]
    payloads = [[xs[r], ids[r], ws[r]] for r in range(ep)]
    ref = reference_dispatch(ids, payloads, ep_size=ep, num_experts=num_experts, runtime_max_tokens_per_rank=n)
    ref_expert_out = [
        toy_moe(*ref.recv[r], ref.recv_counts[r], ep_rank=r, ep_size=ep, num_experts=num_experts) for r in range(ep)
    ]
    ref_out = reference_combine(ref_expert_out, ref, [n] * ep)
    return _Problem(ids, payloads, ref, ref_out, hidden * 2 + top_k * 4 + top_k * 4, hidden * 2)


def _rank_matches(problem: _Problem, rank: int, recv: list, count: torch.Tensor, out: torch.Tensor) -> bool:
    """Rank ``rank``'s receive counts, valid receive rows and combine output equal the reference, bitwise."""
    ref = problem.ref
    count = count.cpu()
    good = torch.equal(count, ref.recv_counts[rank]) and torch.equal(out.cpu(), problem.ref_out[rank])
    for s in range(count.numel()):
        c = int(count[s])
        good = good and all(torch.equal(v[s, :c].cpu(), rv[s, :c]) for v, rv in zip(recv, ref.recv[rank]))
    return good


def _print_report(title: str, problem: _Problem, n: int, ok: list[bool], round_ms: list[float]) -> int:
    print(title)
    print(f"{'rank':>4} {'tokens':>6} {'recv':>6} {'bytes sent':>11} {'round ms':>8}  check")
    for r in range(len(ok)):
        sent_rows = sum(len(pairs) for pairs in problem.ref.routes[r])  # dispatch: one row per distinct destination
        recv_rows = int(problem.ref.recv_counts[r].sum())  # combine: one row back per received token
        sent = sent_rows * problem.dispatch_row + recv_rows * problem.combine_row
        print(f"{r:>4} {n:>6} {recv_rows:>6} {sent:>11} {round_ms[r]:>8.3f}  {'OK' if ok[r] else 'MISMATCH'}")
    if not all(ok):
        print("FAILED: outputs differ from the reference", file=sys.stderr)
        return 1
    print("all ranks match the reference bitwise")
    return 0


def _demo_device(choice: str) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if choice == "auto" else choice)


def demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return demo_distributed(parser, args)

    from . import SimulatedEP
    from .reference import toy_moe

    ep = DEFAULT_SIMULATED_RANKS if args.ep is None else args.ep
    _check_demo_arguments(parser, args, ep)
    device = _demo_device(args.device)
    n, top_k, num_experts = args.tokens, args.top_k, args.experts
    problem = _demo_problem(args, ep)

    sim = SimulatedEP(ep, n, dispatch_bytes_per_token=problem.dispatch_row,
                      combine_bytes_per_token=problem.combine_row, device=device)
    dev_ids = [t.to(device) for t in problem.ids]
    dev_payloads = [[t.to(device) for t in p] for p in problem.payloads]

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
            ok[r] = ok[r] and _rank_matches(problem, r, dispatched[r][0], counts[r], outs[r])

    title = (f"torch-moe-a2a demo: ep {ep}, {n} tokens/rank, hidden {args.hidden} bf16, top-{top_k} of "
             f"{num_experts} experts, device {device}, {args.rounds} rounds")
    return _print_report(title, problem, n, ok, [best_ms] * ep)


def demo_distributed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """One rank per process (RANK, WORLD_SIZE and LOCAL_RANK as torchrun sets
    them): a ``MoeAlltoAll`` over the default group; every process checks its
    own rank against the reference, and rank 0 prints every rank's line.
    Returns the same exit code in every process."""
    import torch.distributed as dist

    from . import Mapping, MoeAlltoAll
    from .reference import toy_moe

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.ep is not None and args.ep != world:
        print(f"--ep {args.ep} differs from WORLD_SIZE {world} (one rank per process)", file=sys.stderr)
        return 2
    _check_demo_arguments(parser, args, world)
    device = _demo_device(args.device)
    if device.type == "cuda":
        # One GPU per process when there are enough; else processes share GPUs (time-sliced, slow).
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    n, top_k, num_experts = args.tokens, args.top_k, args.experts
    problem = _demo_problem(args, world)

    # gloo carries the bootstrap and the report: both are CPU tensors.
    if not start_process_group(f"{PROG} demo", "gloo", args.init_method, rank, world):
        return 1
    try:
        mapping = Mapping(world_size=world, rank=rank, tp_size=world, moe_ep_size=world)
        moe = MoeAlltoAll(mapping, n, top_k, num_experts, hidden_size=args.hidden, group=dist.group.WORLD, device=device)
        ids = problem.ids[rank].to(device)
        payloads = [t.to(device) for t in problem.payloads[rank]]
        timer = _CudaTimer(device) if device.type == "cuda" else _CpuTimer()
        best_ms = float("inf")
        ok = True
        for _ in range(args.rounds):
            timer.start()
            recv = moe.dispatch(ids, payloads, n)
            counts = moe.recv_counts
            expert_out = toy_moe(*recv, counts, ep_rank=rank, ep_size=world, num_experts=num_experts)
            # Copies for the check: once this rank's combine is in, a peer's
            # next dispatch may overwrite the receive planes.
            recv, counts = [v.clone() for v in recv], counts.clone()
            out = moe.combine(expert_out, n)
            best_ms = min(best_ms, timer.stop())
            ok = ok and _rank_matches(problem, rank, recv, counts, out)
        moe.check()

        report = torch.tensor([int(ok), round(best_ms * 1e3)], dtype=torch.int64)
        gathered = [torch.empty_like(report) for _ in range(world)]
        dist.all_gather(gathered, report)
        oks = [bool(g[0]) for g in gathered]
        round_ms = [int(g[1]) / 1e3 for g in gathered]
        if rank != 0:
            return 0 if all(oks) else 1
        title = (f"torch-moe-a2a demo: {world} processes (one rank each), {n} tokens/rank, hidden {args.hidden} "
                 f"bf16, top-{top_k} of {num_experts} experts, device {device.type}, {args.rounds} rounds")
        return _print_report(title, problem, n, oks, round_ms)
    finally:
        dist.destroy_process_group()


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


@dataclass(frozen=True)
class _Command:
    summary: str  # the line of the command list
    description: str  # the head of the command's own --help
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.ArgumentParser, argparse.Namespace], int]
    prog: Optional[str] = None  # how the command is launched, where that is not "python -m torch_moe_a2a NAME"


COMMANDS = {
    "demo": _Command(
        "EP round trips checked bitwise against the plain-PyTorch reference",
        "EP round trips (dispatch -> toy MoE -> combine) on every rank, checked bitwise against the "
        "plain-PyTorch reference: simulated ranks in one process, or one rank per process under torchrun "
        "(torchrun --nproc-per-node N -m torch_moe_a2a demo).",
        _add_demo_arguments, demo),
    "bench": _Command(bench_single.SUMMARY, bench_single.DESCRIPTION, bench_single.add_arguments, bench_single.run),
    "bench-dist": _Command(bench_distributed.SUMMARY, bench_distributed.DESCRIPTION,
                           bench_distributed.add_arguments, bench_distributed.run, prog=bench_distributed.PROG),
}


def _command_list() -> str:
    width = max(map(len, COMMANDS))
    return "commands:\n" + "\n".join(f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items())


def build_parser() -> argparse.ArgumentParser:
    """The command line: one argparse subcommand per entry of COMMANDS."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage="%(prog)s [-h] [--version] COMMAND [options]",
        description="torch-moe-a2a: MoE all-to-all dispatch and combine as PyTorch custom operators.\n\n"
        + _command_list(),
        epilog="'COMMAND -h' lists a command's options. Under torchrun (torchrun --nproc-per-node N\n"
        "-m torch_moe_a2a COMMAND), demo and bench-dist run one rank per process.",
        # The command list is laid out by _command_list (one line each), not rewrapped.
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"{DISTRIBUTION} {package_version()}")
    # The list in the description replaces argparse's own, which wraps a long command name onto a line of its own.
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", help=argparse.SUPPRESS)
    for name, command in COMMANDS.items():
        # prog given: argparse would derive it from the custom usage line above.
        p = commands.add_parser(name, help=command.summary, description=command.description,
                                prog=command.prog or f"{PROG} {name}")
        command.add_arguments(p)
        p.set_defaults(run=command.run, command_parser=p)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Run a command; its exit code. Bad arguments exit through argparse (SystemExit 2)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        # argparse's own text ("invalid choice") names neither the problem nor the commands' jobs.
        print(f"{PROG}: unknown command '{argv[0]}'\n{_command_list()}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help(sys.stderr)
        return 2
    if extra:
        # Reported by the command's parser: its usage line is the one that helps.
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.run(args.command_parser, args) or 0
    except (torch.OutOfMemoryError, RuntimeError) as e:
        # Sizes within the options' ranges can still exceed the machine's
        # memory: one line, as for a bad argument (the CPU allocator raises a
        # plain RuntimeError that says so).
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        print(f"{PROG} {args.command}: not enough memory for these sizes ({str(e).splitlines()[0]}); choose "
              "smaller ones", file=sys.stderr)
        return 1


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`... | head`): no traceback. stdout goes to
        # devnull so that the interpreter's last flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)
