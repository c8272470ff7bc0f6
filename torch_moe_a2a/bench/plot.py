"""``bench --plot``: bandwidth ratio and latency against tokens per rank, per
op, for torch-moe-a2a and the plain-PyTorch baseline, from the same dict that
``--json`` writes.

matplotlib is an optional dependency (``pip install matplotlib``, the ``plot`` extra):
it is imported only when a plot is drawn.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

from .common import BASELINE_OF, OPS

INSTALL_HINT = "pip install matplotlib (the plot extra of pyproject.toml)"
MISSING = f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}"


def available() -> bool:
    """Whether matplotlib is installed (the tests' skip condition)."""
    return importlib.util.find_spec("matplotlib") is not None


def unavailable() -> Optional[str]:
    """Why no plot can be drawn, or None where matplotlib's Agg backend
    imports: checked before a run, so that a missing or broken matplotlib is
    not found only after the sweep."""
    if not available():
        return MISSING
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display (as figure())
        import matplotlib.pyplot  # noqa: F401
    except Exception as e:  # a broken install raises anything from ImportError to AttributeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return (f"--plot needs matplotlib, which is installed but does not import "
                f"({type(e).__name__}{': ' + first if first else ''}); reinstall it: {INSTALL_HINT}")
    return None


# The line style of each ep, in ascending ep order (styles repeat past the last).
EP_STYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (8, 2)))
# Ours and the baseline share a series' colour and style; these tell them apart.
OURS = {"marker": "o", "alpha": 1.0, "linewidth": 1.6}
BASELINE = {"marker": "x", "alpha": 0.45, "linewidth": 1.0}


def title(data: dict) -> str:
    """The figure's title: what ran where, and when."""
    when = (data.get("date") or "date unknown").replace("T", " ")
    return f"torch-moe-a2a bench: {data.get('device', 'unknown device')}, {when} (torch {data.get('torch', '?')})"


def _best_us(m: dict, prefix: str = "") -> Optional[float]:
    """The graph time where there is one, else the eager time (``prefix`` 'baseline_' for the baseline)."""
    graph = m.get(f"{prefix}graph_us")
    return graph if graph is not None else m.get(f"{prefix}eager_us")


def plot(data: dict, path: str) -> None:
    """Write ``figure(data)`` to ``path`` as a PNG."""
    import matplotlib.pyplot as plt

    fig = figure(data)
    fig.savefig(path, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def figure(data: dict):  # -> matplotlib.figure.Figure (matplotlib is imported only here)
    """Per op, the ratio to the copy bandwidth (top) and the latency (bottom)
    against tokens per rank: one colour per model (preset, and fp8), one line
    style per ep, ours with round markers and the plain-PyTorch baseline faint
    with crosses; one legend for every panel says so. The baseline's ratio is
    the op's bytes over the baseline's time: the bandwidth it would have
    reached moving what our op moves."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    copy_gbps = data.get("copy_bandwidth_GBps")
    measured = [r for r in data["points"] if r["ops"] and r["status"] == "ok"]
    series: dict[tuple, list[dict]] = {}
    for r in measured:
        series.setdefault((f"{r['preset']}{' fp8' if r['fp8'] else ''}", r["ep"]), []).append(r)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour_of = {model: colours[k % len(colours)] for k, model in enumerate(sorted({m for m, _ in series}))}
    style_of = {ep: EP_STYLES[k % len(EP_STYLES)] for k, ep in enumerate(sorted({ep for _, ep in series}))}
    fig, axes = plt.subplots(2, len(OPS), figsize=(4.5 * len(OPS), 8.5), squeeze=False)
    for col, op in enumerate(OPS):
        ratio_ax, latency_ax = axes[0][col], axes[1][col]
        for (model, ep), recs in sorted(series.items()):
            line = {"color": colour_of[model], "linestyle": style_of[ep]}
            recs = sorted(recs, key=lambda r: r["tokens_per_rank"])
            tokens = [r["tokens_per_rank"] for r in recs]
            m = [r["ops"][op] for r in recs]
            ratio_ax.plot(tokens, [x["copy_ratio"] for x in m], **line, **OURS)
            latency_ax.plot(tokens, [_best_us(x) for x in m], **line, **OURS)
            base_us = [_best_us(x, "baseline_") for x in m]
            if any(t is not None for t in base_us):
                # A missing baseline time (its check failed) is a gap in the line, not a zero.
                base_ratio = [None if t is None or not copy_gbps else x["bytes"] / (t * 1e-6) / 1e9 / copy_gbps
                              for x, t in zip(m, base_us)]
                ratio_ax.plot(tokens, [float("nan") if v is None else v for v in base_ratio], **line, **BASELINE)
                latency_ax.plot(tokens, [float("nan") if t is None else t for t in base_us], **line, **BASELINE)
        ratio_ax.set_title(op if BASELINE_OF[op] == op else f"{op} (baseline: {BASELINE_OF[op]})")
        ratio_ax.set_ylabel("bandwidth / copy bandwidth")
        latency_ax.set_ylabel("latency, us (graph, else eager)")
        for ax in (ratio_ax, latency_ax):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens per rank")
            ax.grid(True, alpha=0.3)
        latency_ax.set_yscale("log")
    # One legend for all panels, by what each encoding means (not one entry per line).
    handles = [Line2D([], [], color=colour, label=model) for model, colour in colour_of.items()]
    handles += [Line2D([], [], color="black", linestyle=style, label=f"ep {ep}") for ep, style in style_of.items()]
    handles += [Line2D([], [], color="black", label="torch-moe-a2a", **OURS),
                Line2D([], [], color="black", label="plain PyTorch baseline", **BASELINE)]
    fig.suptitle(title(data))
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize="small", frameon=False)
    return fig
