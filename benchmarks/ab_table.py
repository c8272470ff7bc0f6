"""Side-by-side table of the `./dev gpu ab` runs (scripts/gpu_check.sh): every
variant's `bench --graph all-ranks --json` in LOG/ab-<i>.json, its assignments in
LOG/ab-<i>.variant. Prints, per point and op, the microseconds above the launch
floor of each variant (and of the peer, where a run timed one), then the
geometric mean of each variant's ratio to variant 0 per op (> 1: faster than
variant 0).

    python benchmarks/ab_table.py LOG
"""

from __future__ import annotations

import json
import pathlib
import sys

from torch_moe_a2a.bench.common import geomean
from torch_moe_a2a.bench.replay import REPLAY_OPS as OPS
from torch_moe_a2a.bench.replay import above_floor as above


def main(log: str) -> int:
    runs = []
    for path in sorted(pathlib.Path(log).glob("ab-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        variant = path.with_suffix(".variant")
        name = variant.read_text().strip() if variant.exists() else path.stem
        runs.append((name or "(default)", json.loads(path.read_text())))
    if not runs:
        print("no ab-*.json under", log)
        return 1
    for i, (name, _) in enumerate(runs):
        print(f"v{i}: {name}")
    peer = next((r["peer"] for _, r in runs if r.get("peer") and r["peer"].get("available")), None)
    points = sorted(runs[0][1]["ours"], key=lambda k: tuple(int(v) for v in k[2:].split("_T")))
    header = ["point", "op"] + [f"v{i}" for i in range(len(runs))] + (["peer"] if peer else [])
    print("us above the launch floor (per replay, median)")
    print("  ".join(f"{h:>11}" for h in header))
    ratios: dict = {(i, op): [] for i in range(1, len(runs)) for op in OPS}
    for key in points:
        for op in OPS:
            values = [above(r["ours"].get(key, {}), op) for _, r in runs]
            row = [key, op] + ["-" if v is None else f"{v:.2f}" for v in values]
            if peer:
                p = above(peer["results"].get(key, {}), op)
                row.append("-" if p is None else f"{p:.2f}")
            print("  ".join(f"{c:>11}" for c in row))
            for i in range(1, len(runs)):
                if values[0] and values[i]:
                    ratios[(i, op)].append(values[0] / values[i])
    for i in range(1, len(runs)):
        line = ", ".join(f"{op} {geomean(r):.3f}x" for op in OPS if (r := ratios[(i, op)]))
        print(f"v{i} against v0, geomean of above-floor ratios: {line}")
    failed = [(name, k) for name, r in runs for k, v in r["ours"].items() if v.get("status") != "ok"]
    for name, key in failed:
        print(f"FAILED: {name} at {key}")
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
