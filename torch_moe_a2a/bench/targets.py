"""The speed targets the benchmarks judge their numbers against.

Single device (``bench``, H200, simulated ep 8, DeepSeek-V3, CUDA-graph
timings): copy-bandwidth ratios at TARGET_RATIO_TOKENS, round trips with
the payload in the workspace (per step of the multi-step graph and per
replay), and the host cost of every eager call. Checked only in a CUDA run
that measured their points.

Decode latency (``bench --graph all-ranks --peer flashinfer``, per replay,
time above the launch floor of the same run): the peer's time over ours at
least DECODE_MIN_RATIO at every point of the decode grid for
DECODE_TARGET_OPS, and the geometric mean of the round trip's at least
DECODE_ROUND_TRIP_GEOMEAN.

Distributed (``bench-dist``, one GPU per process): dispatch and combine at
DIST_CEILING_RATIO x NCCL's all-to-all bandwidth at DIST_CEILING_TOKENS
tokens per rank, and DIST_SPEEDUP x faster than the all_to_all_single
baseline at DIST_SPEEDUP_TOKENS (eager against eager: both called from Python).
"""

from __future__ import annotations

from typing import Optional

from .common import fmt, geomean

TARGET_PRESET = "deepseek-v3"
TARGET_EP = 8
TARGET_RATIO_TOKENS = 4096
TARGET_MIN_COPY_RATIO = {"dispatch": 0.90, "combine-ws": 0.85}
TARGET_ROUND_TRIP_US = {128: 60.0, 1: 15.0}
TARGET_HOST_US = 20.0

DECODE_TARGET_OPS = ("dispatch", "combine", "round-trip")
DECODE_MIN_RATIO = 1.0
DECODE_ROUND_TRIP_GEOMEAN = 1.3

DIST_TARGET_OPS = ("dispatch", "combine", "combine-ws")
DIST_CEILING_RATIO = 0.85
DIST_CEILING_TOKENS = 4096
DIST_SPEEDUP = 3.0
DIST_SPEEDUP_TOKENS = 128


def _verdict(value: Optional[float], bound: float, at_least: bool) -> str:
    if value is None:
        return "n/a"
    return "ok" if (value >= bound if at_least else value <= bound) else "MISS"


def single_device(records: list[dict], host: dict[str, float], device_type: str) -> list[str]:
    """One line per single-device target whose point this CUDA run measured
    (none on the CPU): the value and ok or MISS, under a heading line."""
    if device_type != "cuda":
        return []

    def ops_at(tokens: int) -> Optional[dict]:
        for r in records:
            if (r["preset"], r["fp8"], r["ep"], r["tokens_per_rank"], r["status"]) == (
                    TARGET_PRESET, False, TARGET_EP, tokens, "ok") and r["ops"]:
                return r["ops"]
        return None

    lines = []
    ops = ops_at(TARGET_RATIO_TOKENS)
    for op, ratio in TARGET_MIN_COPY_RATIO.items():
        if ops is not None:
            got = ops[op]["copy_ratio"]
            lines.append(f"{op} >= {ratio:.2f} x copy at {TARGET_RATIO_TOKENS} tok: {fmt(got, '.3f')} "
                         f"{_verdict(got, ratio, at_least=True)}")
    for tokens, limit in TARGET_ROUND_TRIP_US.items():
        ops = ops_at(tokens)
        if ops is not None:
            step, replay = ops["round-trip-ws"]["graph_step_us"], ops["round-trip-ws"]["graph_us"]
            lines.append(f"round-trip-ws <= {limit:g} us at {tokens} tok: "
                         f"{fmt(step, '.1f')} us per step {_verdict(step, limit, at_least=False)}, "
                         f"{fmt(replay, '.1f')} us per replay {_verdict(replay, limit, at_least=False)}")
    if host:
        worst = max(host.values())
        lines.append(f"host cost <= {TARGET_HOST_US:g} us CPU time per eager call: at most {worst:.1f} us "
                     f"{_verdict(worst, TARGET_HOST_US, at_least=False)}")
    if not lines:
        return []
    return [f"targets ({TARGET_PRESET} at ep {TARGET_EP}, graph timings; host cost as above):",
            *("  " + line for line in lines)]


def decode_lines(above: dict[str, dict[tuple[int, int], float]], peer: str) -> list[str]:
    """The decode-latency targets from ``above[op][(ep, T)]``, the peer's time
    above the floor over ours at every point both measured: one line each,
    ok or MISS, the worst point named."""
    lines = []
    for op in DECODE_TARGET_OPS:
        ratios = above.get(op, {})
        if not ratios:
            continue
        (ep, tokens), worst = min(ratios.items(), key=lambda kv: kv[1])
        lines.append(f"{op} >= {DECODE_MIN_RATIO:g}x {peer} at every point: min {worst:.2f}x (ep {ep} T {tokens}) "
                     f"{_verdict(worst, DECODE_MIN_RATIO, at_least=True)}")
    round_trips = list(above.get("round-trip", {}).values())
    if round_trips:
        mean = geomean(round_trips)
        lines.append(f"round-trip geomean >= {DECODE_ROUND_TRIP_GEOMEAN:g}x {peer}: {mean:.2f}x over "
                     f"{len(round_trips)} points {_verdict(mean, DECODE_ROUND_TRIP_GEOMEAN, at_least=True)}")
    if not lines:
        return []
    return [f"targets (per replay, time above the launch floor, {peer} / ours):", *("  " + line for line in lines)]


def distributed_row(record: dict, op: str, applies: bool) -> str:
    """The distributed target of one table row ('... ok', '... MISS'; '' where the
    row has none); ``applies``: one GPU per process (else the verdict is marked
    as not applying)."""
    if op not in DIST_TARGET_OPS or record["status"] != "ok" or op not in record["ops"]:
        return ""
    m = record["ops"][op]
    if record["tokens_per_rank"] == DIST_CEILING_TOKENS:
        value, goal, what = m["ceiling_ratio"], DIST_CEILING_RATIO, "x ceiling"
    elif record["tokens_per_rank"] == DIST_SPEEDUP_TOKENS:
        value, goal, what = m["speedup_eager"], DIST_SPEEDUP, "speedup"
    else:
        return ""
    if value is None:
        return f"{what} >= {goal:g}: not measured"
    verdict = "ok" if value >= goal else "MISS"
    return f"{what} >= {goal:g}: {verdict}" + ("" if applies else " (n/a: not a GPU per process)")


def distributed_line(records: list[dict], applies: bool) -> str:
    """One line that counts the distributed targets met and missed over every row."""
    verdicts = []
    for rec in records:
        for op in DIST_TARGET_OPS:
            verdict = distributed_row(rec, op, applies)
            if verdict:
                verdicts.append(verdict)
    missed = sum(": MISS" in v for v in verdicts)
    if not verdicts:
        return f"targets: no point at {DIST_SPEEDUP_TOKENS} or {DIST_CEILING_TOKENS} tokens per rank measured"
    note = "" if applies else " (n/a: the targets are for one GPU per process)"
    return (f"targets (x ceiling >= {DIST_CEILING_RATIO:g} at {DIST_CEILING_TOKENS} tok/rank, speedup >= "
            f"{DIST_SPEEDUP:g} at {DIST_SPEEDUP_TOKENS}; {', '.join(DIST_TARGET_OPS)}): "
            f"{len(verdicts) - missed} ok, {missed} MISS{note}")


def distributed_json() -> dict:
    """The distributed targets as the --json file records them."""
    return {"ops": list(DIST_TARGET_OPS), "ceiling_ratio": DIST_CEILING_RATIO, "ceiling_tokens": DIST_CEILING_TOKENS,
            "speedup_eager": DIST_SPEEDUP, "speedup_tokens": DIST_SPEEDUP_TOKENS}
