"""The wall time of `import torch` and of `import torch_moe_a2a`, each in a
fresh interpreter, measured alternately in one run (so both see the same
machine load and file cache), and their ratio. The README's import figure
comes from here.

Usage: python benchmarks/import_time.py [--runs 10]
"""

import argparse
import statistics
import subprocess
import sys
import time

STATEMENTS = {"torch": "import torch", "torch_moe_a2a": "import torch_moe_a2a"}


def _seconds(statement: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True)
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10, help="timed runs of each import (default 10, after one untimed)")
    args = p.parse_args()
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")
    for statement in STATEMENTS.values():
        _seconds(statement)  # the file cache warm for both
    times: dict[str, list[float]] = {name: [] for name in STATEMENTS}
    for _ in range(args.runs):
        for name, statement in STATEMENTS.items():
            times[name].append(_seconds(statement))
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"import {name:<14} median {medians[name]:.2f} s (min {min(t):.2f}, max {max(t):.2f}, {len(t)} runs)")
    print(f"ratio torch_moe_a2a / torch: {medians['torch_moe_a2a'] / medians['torch']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
