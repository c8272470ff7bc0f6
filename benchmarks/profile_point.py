"""One point's ops, eagerly and a few times over, for a profiler (Nsight
Compute in `./dev gpu profile`, scripts/gpu_check.sh): each round runs a
dispatch, a staged combine, a dispatch and a combine with the payload in the
workspace, on every simulated rank (torch_moe_a2a.bench.replay.OursRanks,
the benchmark's own inputs and checks). Only ep 1 under ncu: ncu serializes
kernels, and a rank's kernel waiting for a peer's would time out.

Usage: python benchmarks/profile_point.py [--ep 1] [--tokens 128] [--rounds 4] [--preset deepseek-v3]
"""

import argparse

import torch

from torch_moe_a2a.bench.common import PRESETS, Point
from torch_moe_a2a.bench.replay import OursRanks


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--preset", choices=sorted(PRESETS), default="deepseek-v3")
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    lib = OursRanks(Point(PRESETS[args.preset], args.ep, args.tokens, fp8=False), device)
    error = lib.check()
    if error is not None:
        print(f"FAIL: {error}")
        return 1
    for _ in range(args.rounds):
        lib.run(lib.dispatch)
        lib.run(lambda r: lib.combine(r, False))
        lib.run(lib.dispatch)
        lib.run(lambda r: lib.combine(r, True))
    torch.cuda.synchronize(device)
    error = lib.errors()
    print("FAIL: " + error if error else f"ok: ep {args.ep} x {args.tokens} tokens, {args.rounds} rounds")
    return 1 if error else 0


if __name__ == "__main__":
    raise SystemExit(main())
