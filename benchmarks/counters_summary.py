"""Summarize Nsight Compute's hardware counters for benchmarks/fanout_ceiling.cu.

`./dev gpu counters` (scripts/gpu_check.sh) profiles the fan-out program's
one-grid kernels with `ncu --csv --page raw --print-units base --metrics
<METRICS>` and pipes the CSV through this script, which prints one line per
variant: the median over its launches of the time, the DRAM bytes read and
written, the DRAM rate and its share of the DRAM's sustained peak, and the
L2's busiest-unit share. The question it answers (docs/performance.md,
'Hardware counters'): whether a pattern moves more DRAM bytes than it counts,
and how close to the DRAM's peak its bytes flow. Standard library only.

Usage: python benchmarks/counters_summary.py counters.csv
"""

import csv
import re
import statistics
import sys

# The metrics scripts/gpu_check.sh asks ncu for (one source: it reads this line).
METRICS = (
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__bytes.sum.per_second",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
)

# Launches of one variant: fanout_ceiling.cu's median_ms runs a warm-up launch
# and then kReps (10) timed ones.
LAUNCHES_PER_VARIANT = 11

# fanout_ceiling.cu's kernels in launch order (consecutive launches of one
# kernel beyond LAUNCHES_PER_VARIANT start its next variant): what each group
# of launches measures.
VARIANTS = {
    "copy_kernel": ["copy kernel (uint4 per thread)"],
    "fill_kernel": ["write only (uint4 stores)"],
    "fanout_registers<0>": ["fan-out, chunk per CTA", "fan-out, interleaved"],
    "fanout_registers<1>": ["  its writes only"],
    "fanout_registers<2>": ["  its reads only"],
}


def short_name(kernel: str) -> str:
    """`void <unnamed>::fanout_registers<0>(const unsigned char *, ...)` -> `fanout_registers<0>`."""
    name = re.sub(r"\(.*", "", kernel).strip()
    return name.split("::")[-1]


def main(path: str) -> None:
    with open(path, newline="") as f:
        rows = list(csv.reader(line for line in f if line.startswith('"')))
    if len(rows) < 3:
        sys.exit(f"{path}: no profiled kernels")
    head, data = rows[0], rows[2:]  # rows[1]: units (base units: ns, byte, byte/s, %)
    col = {h: i for i, h in enumerate(head)}
    missing = [m for m in METRICS if m not in col]
    if missing:
        sys.exit(f"{path}: metrics missing: {', '.join(missing)}")

    def value(row: list[str], metric: str) -> float:
        return float(row[col[metric]].replace(",", ""))

    # Consecutive launches of one kernel, up to LAUNCHES_PER_VARIANT, form a variant.
    groups: list[tuple[str, list[list[str]]]] = []
    for row in data:
        name = short_name(row[col["Kernel Name"]])
        if groups and groups[-1][0] == name and len(groups[-1][1]) < LAUNCHES_PER_VARIANT:
            groups[-1][1].append(row)
        else:
            groups.append((name, [row]))
    seen: dict[str, int] = {}
    print(f"{'variant':34s} {'launches':>8s} {'us':>8s} {'DRAM rd MB':>10s} {'DRAM wr MB':>10s} "
          f"{'DRAM GB/s':>9s} {'% DRAM peak':>11s} {'% L2 peak':>9s}")
    for name, launches in groups:
        k = seen.get(name, 0)
        seen[name] = k + 1
        labels = VARIANTS.get(name, [])
        label = labels[k] if k < len(labels) else f"{name} #{k + 1}"

        def median(metric: str) -> float:
            return statistics.median(value(r, metric) for r in launches)

        print(f"{label:34s} {len(launches):8d} {median('gpu__time_duration.sum') / 1e3:8.1f} "
              f"{median('dram__bytes_read.sum') / 1e6:10.1f} {median('dram__bytes_write.sum') / 1e6:10.1f} "
              f"{median('dram__bytes.sum.per_second') / 1e9:9.1f} "
              f"{median('dram__throughput.avg.pct_of_peak_sustained_elapsed'):11.1f} "
              f"{median('lts__throughput.avg.pct_of_peak_sustained_elapsed'):9.1f}")


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(__doc__)
    elif len(sys.argv) == 2 and sys.argv[1] == "--metrics":
        print(",".join(METRICS))
    elif len(sys.argv) == 2:
        main(sys.argv[1])
    else:
        sys.exit(__doc__)
