"""``bench --combine-variants`` and ``bench --low-precision-error``: the
low-precision combine and the quantized combine outputs.

--combine-variants: simulated EP (DeepSeek-V3's layer by default: hidden
7168, 256 experts, top-8) at each --ep and --tokens; per combine variant
(bf16; e4m3 rows; e4m3 rows with block scales; MXFP8 / MXFP4 / NVFP4 outputs
fused into the combine; the bf16 combine followed by a quantizer as the
unfused baseline: on CUDA the reference quantizer of torch_moe_a2a.reference
under torch.compile, the plain one where that does not compile and on the
CPU) the time of the combine of all ranks, the bytes the CUDA kernels move
(staging reads the payload rows and writes the staged rows; the pull reads
one row per (token, destination), staged or, for the own rank's rows of the
bf16 and e4m3 transports, the payload's, and writes the output and its
scales) and their
rate as a ratio to the device's copy bandwidth measured in the same run
(bytes read + written by one large copy). On CUDA the time is
``bench --graph all-ranks``'s: the median per replay of one CUDA graph of
every rank's combine, each replay after an untimed replay of the dispatch's
graph, beside the floor (the same graph of an empty kernel per rank); on the
CPU eager wall time. The bf16 combine runs first; every other variant's last
outputs are checked against it (the fused formats bitwise against the
reference quantizer of its output, the e4m3 transports within e4m3's error),
and a FAIL fails the run. Outputs are allocated before the timed calls:
nothing allocates while a simulated peer's kernel spins. The rows print as
each point is measured; a point over --max-gib is skipped with the reason; a
stop signal (SIGINT, SIGTERM) ends the run between two points, keeping the
points measured. The speed targets (target_lines) close the output.

--low-precision-error: the relative error of both e4m3 transports against the
bf16 combine on activations with and without outliers (docs/internals.md
holds the table of record).
"""

from __future__ import annotations

import functools
import statistics
from typing import Callable, Optional

import torch

from .. import layout, reference
from ..api import SfLayout, moe_a2a_combine, moe_a2a_dispatch
from ..simulate import SimulatedEP
from .common import (
    COPY_BYTES,
    DEFAULT_MAX_GIB,
    GIB,
    PRESETS,
    Clock,
    StopSignals,
    capture_graph,
    copy_bandwidth,
    device_name,
    format_row,
    format_table,
    over_max_gib,
    release,
    stopped_line,
)
from .common import fmt as cell

DEFAULT_PRESET = "deepseek-v3"
# Default points: the targets' on CUDA, a few seconds' worth on the CPU.
DEFAULT_EP = {"cuda": (8,), "cpu": (2,)}
DEFAULT_TOKENS = {"cuda": (128, 4096), "cpu": (1, 16)}
# name: (combine keyword arguments, quantized format or None, whether fused)
VARIANTS: dict[str, tuple[dict, Optional[str], bool]] = {
    "bf16": ({}, None, True),
    "e4m3": (dict(use_low_precision=True), None, True),
    "e4m3-block-scaled": (dict(use_low_precision=True, low_precision_block_scales=True), None, True),
    "mxfp8": ({}, "mxfp8", True),
    "mxfp8-unfused": ({}, "mxfp8", False),
    "mxfp4": ({}, "mxfp4", True),
    "nvfp4": ({}, "nvfp4", True),
    "nvfp4-unfused": ({}, "nvfp4", False),
}
_FORMATS = {"mxfp8": (torch.float8_e4m3fn, torch.uint8, 32), "mxfp4": (torch.uint8, torch.uint8, 32),
            "nvfp4": (torch.uint8, torch.float8_e4m3fn, 16)}
NVFP4_GLOBAL_SCALE = 448.0 * 6.0 / 8.0
HEADER = ["ep", "tokens", "variant", "us", "floor us", "bytes moved", "ratio to copy", "vs bf16", "check"]
LEFT = {2, 8}  # left-aligned columns
# Rows print as each point is measured, so the widths are fixed before the
# first: the time columns room for up to 10 s (a wider cell shifts its row only).
WIDEST_US = "9999999.9"


# The speed targets (ep 8, DeepSeek-V3, per replay): a variant's time over
# bf16's; e4m3 transports at least these many times faster than the bf16
# combine, fused outputs at most FUSED_MAX_OVER_BF16 of its time and at least
# FUSED_MIN_OVER_UNFUSED times faster than the bf16 combine and a quantizer.
TARGET_EP = 8
LARGE_TOKENS = 4096
MIN_SPEEDUP = {("e4m3", True): 1.3, ("e4m3", False): 1.0, ("e4m3-block-scaled", True): 1.2}
FUSED_MAX_OVER_BF16 = 1.05
FUSED_MIN_OVER_UNFUSED = 1.3


def _moved_bytes(variant: str, recv_rows: int, own_rows: int, tokens: int, hidden: int, ep: int) -> int:
    """Bytes the CUDA kernels read and write for one combine of every rank:
    recv_rows received rows in all, own_rows of them each rank's own. The
    own rows of bf16 and e4m3 transports are read once by the pull from the
    payload, not staged (the bench's bf16 rows of whole 16-byte vectors);
    block-scaled rows are all staged."""
    kwargs, fmt, fused = VARIANTS[variant]
    staged_elem = 1 if kwargs.get("use_low_precision") else 2
    unstaged = own_rows
    if kwargs.get("low_precision_block_scales"):
        staged_elem += 1 / 128  # a scale byte a block of 128 (protocol.h's groups' alignment left out)
        unstaged = 0
    staged = recv_rows - unstaged
    staging = staged * hidden * 2 + int(staged * hidden * staged_elem)
    pull_in = int(staged * hidden * staged_elem) + unstaged * hidden * 2
    if fmt is None:
        out = tokens * ep * hidden * 2
    else:
        out_dtype, _, block = _FORMATS[fmt]
        data = hidden if out_dtype == torch.float8_e4m3fn else hidden // 2
        out = tokens * ep * (data + hidden // block)
        if not fused:  # the bf16 output written, read back by the quantizer, then the quantized one
            out += 2 * tokens * ep * hidden * 2
    return staging + pull_in + out


def _quantizer(device: torch.device) -> tuple[Callable, str]:
    """The unfused variants' quantizer and its name: on CUDA the reference
    quantizer under torch.compile (what a user would run after a bf16
    combine), the plain-PyTorch one where that does not compile (and on the
    CPU, whose timings are eager)."""
    if device.type == "cuda":
        try:
            compiled = torch.compile(reference.reference_quantize, dynamic=False)
            x = torch.zeros(1, 32, dtype=torch.bfloat16, device=device)
            compiled(x, "mxfp8", int(SfLayout.layout_128x4), 1.0)
            return compiled, "torch.compile of the reference quantizer"
        except Exception as e:  # noqa: BLE001 - no compiler backend: the plain quantizer, said in the header
            return reference.reference_quantize, f"plain-PyTorch reference quantizer (torch.compile failed: " \
                                                 f"{type(e).__name__})"
    return reference.reference_quantize, "plain-PyTorch reference quantizer"


def _memory_bytes(ep: int, tokens: int, hidden: int, top_k: int) -> int:
    """Upper estimate of the memory one point needs (device memory; on the CPU
    all of it): every simulated rank's workspace, the payloads and routing,
    the experts' outputs (``ep * tokens`` rows per rank) and four bf16
    outputs per rank (a variant's outputs, the previous variant's until
    replaced, the bf16 combine's kept for the checks, the unfused quantizer's
    output)."""
    dispatch_row, combine_row = hidden * 2 + top_k * 4, hidden * 2
    workspace = ep * layout.workspace_size_per_rank(ep, tokens, dispatch_row, combine_row, 0)
    return workspace + ep * tokens * (dispatch_row + (ep + 4) * combine_row)


def run_variants(device: torch.device, eps: list[int], tokens_list: list[int], iters: int, warmup: int,
                 variants: Optional[list[str]] = None, preset: str = DEFAULT_PRESET, max_gib: Optional[float] = None,
                 stop: Optional[StopSignals] = None,
                 emit: Callable[[str], None] = functools.partial(print, flush=True)) -> tuple[list[dict], dict]:
    """Time each variant at each (ep, tokens); returns one record per variant
    measured, and the run's facts for --json (copy bandwidth, iterations,
    warmup, preset).
    The bf16 combine runs first whether asked for or not: the others are
    checked against its outputs and compared with its time. A point needing
    more than ``max_gib`` (default DEFAULT_MAX_GIB of the device) is skipped.
    ``stop`` (the caller's, active): a signal ends the run between two points,
    the points measured by then reported as usual; its ``signum`` tells the caller.
    ``emit`` flushes by default: a run into a pipe or a log shows each row as it comes."""
    variants = ["bf16", *(v for v in (variants or list(VARIANTS)) if v != "bf16")]
    stop = StopSignals() if stop is None else stop
    max_bytes = int((DEFAULT_MAX_GIB[device.type] if max_gib is None else max_gib) * GIB)
    clock = Clock(device)
    shape = PRESETS[preset]
    hidden, experts, top_k = shape.hidden, shape.num_experts, shape.top_k
    # The copy within the budget too, as the sweep's.
    copy_bps = copy_bandwidth(clock, device, min(COPY_BYTES[device.type], max_bytes // 4)) * 1e9
    quantize, quantizer_name = _quantizer(device) if any(not VARIANTS[v][2] for v in variants) else (None, "")
    method = ("per replay of a CUDA graph of every rank's combine (bench --graph all-ranks's method), after a "
              "replay of the dispatch's; floor: the same graph of empty kernels" if device.type == "cuda"
              else "eager wall time of every rank's combine (no launch floor on the CPU)")
    emit(f"combine variants: {device_name(device)}, torch {torch.__version__}; {preset} (hidden {hidden}, "
         f"{experts} experts, top-{top_k}); copy bandwidth {copy_bps / 1e9:.1f} GB/s (read + written); "
         f"{method}; median of {iters} after {warmup}" + (f"; unfused: {quantizer_name}" if quantize else ""))
    # The other columns' cells fit in their header's width.
    widest = [str(max(eps)), str(max(tokens_list)), max(variants, key=len), WIDEST_US, WIDEST_US, "", "", "", ""]
    widths = [max(len(h), len(w)) for h, w in zip(HEADER, widest)]
    header = format_row(HEADER, widths, LEFT)
    emit(header)
    emit("-" * len(header))
    points = [(ep, tokens) for ep in eps for tokens in tokens_list]
    records = []
    done = 0
    with stop.ends_sweep():
        for ep, tokens in points:
            stop.check()
            need = _memory_bytes(ep, tokens, hidden, top_k)
            if need > max_bytes:
                rows = [[str(ep), str(tokens), "-", "-", "-", "-", "-", "-",
                         "skipped: " + over_max_gib(need, max_bytes)]]
            else:
                rows = []
                try:
                    records += _run_point(device, clock, ep, tokens, hidden, experts, top_k, iters, warmup,
                                          variants, copy_bps, rows, quantize)
                finally:
                    release(device)  # freeing device memory between two ranks' launches would stall them
            for row in rows:
                emit(format_row(row, widths, LEFT))
            done += 1
    emit("vs bf16: the bf16 combine's time over the variant's (above 1x: faster); bytes moved: what the CUDA "
         "kernels read and write (staging, pull, output); ratio to copy: those bytes per second over the copy "
         "bandwidth; check: the outputs against the bf16 combine's (module docstring)"
         + ("" if device.type == "cuda" else "; targets: CUDA runs only"))
    for line in target_lines(records):
        emit(line)
    stopped = stopped_line(stop, len(points), done)
    if stopped:
        emit(stopped)
    return records, {"copy_bandwidth_GBps": copy_bps / 1e9, "iters": iters, "warmup": warmup, "preset": preset}


def target_lines(records: list[dict]) -> list[str]:
    """The speed targets of the points measured at ep TARGET_EP on CUDA, one
    line each with ok or MISS (none on the CPU)."""
    lines = []
    by = {(r["ep"], r["tokens"], r["variant"]): r for r in records if r.get("floor_us") is not None}
    for (ep, tokens, name), rec in sorted(by.items()):
        bf16 = by.get((ep, tokens, "bf16"))
        if ep != TARGET_EP or bf16 is None or name == "bf16":
            continue
        speedup = bf16["us"] / rec["us"]
        large = tokens >= LARGE_TOKENS
        if (name, large) in MIN_SPEEDUP:
            bound = MIN_SPEEDUP[(name, large)]
            lines.append(f"target {name} >= {bound:g}x bf16 at {tokens} tokens: {speedup:.2f}x "
                         f"{'ok' if speedup >= bound else 'MISS'}")
        kwargs, fmt, fused = VARIANTS[name]
        if fmt in ("mxfp8", "nvfp4") and fused and large:
            over = rec["us"] / bf16["us"]
            lines.append(f"target {name} <= {FUSED_MAX_OVER_BF16:g}x the bf16 combine's time at {tokens} tokens: "
                         f"{over:.2f}x {'ok' if over <= FUSED_MAX_OVER_BF16 else 'MISS'}")
            unfused = by.get((ep, tokens, f"{fmt}-unfused"))
            if unfused is not None:
                gain = unfused["us"] / rec["us"]
                lines.append(f"target {name} >= {FUSED_MIN_OVER_UNFUSED:g}x faster than {fmt}-unfused at {tokens} "
                             f"tokens: {gain:.2f}x {'ok' if gain >= FUSED_MIN_OVER_UNFUSED else 'MISS'}")
    return lines


def _run_point(device, clock, ep, tokens, hidden, experts, top_k, iters, warmup, variants, copy_bps, rows,
               quantize):
    gen = torch.Generator().manual_seed(ep * 100003 + tokens)
    sim = SimulatedEP(ep, tokens, dispatch_bytes_per_token=hidden * 2 + top_k * 4,
                      combine_bytes_per_token=hidden * 2, device=device)
    ids = [reference.random_routing(tokens, top_k, experts, gen).to(device) for _ in range(ep)]
    hid = [torch.randn(tokens, hidden, generator=gen).bfloat16().to(device) for _ in range(ep)]
    state = {}
    cuda = device.type == "cuda"
    # The experts' outputs, a tensor of their own per rank (as a GEMM's would
    # be), here the received rows: a receive view given to the combine would
    # have its own rows staged too (the peers' next dispatch may write there).
    expert_out = [torch.empty((ep, tokens, hidden), dtype=torch.bfloat16, device=device) for _ in range(ep)]

    def dispatch(r):
        recv, offset, _ = moe_a2a_dispatch(ids[r], [hid[r]], sim.workspace, sim.metainfo[r], tokens, r, ep, top_k,
                                           experts)
        expert_out[r].copy_(recv[0])  # in the dispatch's untimed graph
        state[r] = (expert_out[r], offset)

    g_dispatch, floor_us = None, None
    if cuda:
        from .replay import empty_kernel, time_replays

        sim.run(dispatch)  # the round the first variant's eager combine closes
        g_dispatch = capture_graph(lambda: sim.run(dispatch))[0]
        floor_us = time_replays(clock, capture_graph(lambda: sim.run(lambda r: empty_kernel()))[0], warmup, iters)
    results = []
    base_us = None
    bf16_out: Optional[list] = None  # the bf16 combine's outputs, what the other variants are checked against
    for name in variants:
        kwargs, fmt, fused = VARIANTS[name]
        scales = {}
        if fmt is not None:
            _, sc_dtype, block = _FORMATS[fmt]
            extent = reference.scale_layout_extent(int(SfLayout.layout_128x4), tokens, hidden // block)
            scales = {r: torch.zeros(extent, dtype=torch.uint8, device=device).view(sc_dtype) for r in range(ep)}

        # Every output allocated here: under SimulatedEP.run on CUDA nothing may
        # allocate while a peer's kernel spins (an allocation can wait for the
        # device, and the peer for a launch the host has not made yet).
        if fmt is not None and fused:
            out_dtype = _FORMATS[fmt][0]
            out_elems = hidden if out_dtype == torch.float8_e4m3fn else hidden // 2
            outputs = [torch.empty((tokens, out_elems), dtype=out_dtype, device=device) for _ in range(ep)]
        else:
            outputs = [torch.empty((tokens, hidden), dtype=torch.bfloat16, device=device) for _ in range(ep)]

        def combine(r):
            recv, offset = state[r]
            kw = dict(kwargs)
            if fmt is not None and fused:
                kw.update(output_dtype=_FORMATS[fmt][0], output_scales=scales[r], sf_layout=SfLayout.layout_128x4,
                          output_scalar_scale=NVFP4_GLOBAL_SCALE if fmt == "nvfp4" else 1.0)
            moe_a2a_combine(recv, tokens, sim.workspace, sim.metainfo[r], tokens, r, ep, top_k, offset,
                            output=outputs[r], **kw)

        def quantize_output(r):
            # The unfused baseline: the bf16 combine's output through the quantizer.
            quantize(outputs[r], fmt, int(SfLayout.layout_128x4), NVFP4_GLOBAL_SCALE if fmt == "nvfp4" else 1.0)

        if cuda:
            def step(r):
                combine(r)
                if fmt is not None and not fused:
                    quantize_output(r)  # on the rank's stream after its own combine: no peer waits for it

            if fmt is not None and not fused:
                quantize_output(0)  # compiled for this shape now, not between two ranks' launches
            sim.run(step)
            graph = capture_graph(lambda: sim.run(step))[0]
            us = time_replays(clock, graph, warmup, iters, before=g_dispatch)
            clock.sync()
        else:
            marks = []
            for i in range(warmup + iters):
                sim.run(dispatch)
                start = clock.mark()
                sim.run(combine)
                if fmt is not None and not fused:
                    sim.run(quantize_output)  # after every rank's combine: no combine waits behind it
                end = clock.mark()
                if i >= warmup:
                    marks.append((start, end))
            us = statistics.median(clock.elapsed_us(marks))
        if name == "bf16":
            bf16_out = [o.clone() for o in outputs]
        check = _check_variant(name, outputs, scales, bf16_out)
        counts = [sim.recv_counts(r) for r in range(ep)]
        recv_rows = sum(int(c.sum()) for c in counts)
        own_rows = sum(int(c[r]) for r, c in enumerate(counts))
        moved = _moved_bytes(name, recv_rows, own_rows, tokens, hidden, ep)
        ratio = moved / (us * 1e-6) / copy_bps
        if name == "bf16":
            base_us = us
        rows.append([str(ep), str(tokens), name, f"{us:.1f}", cell(floor_us, ".1f"), f"{moved / 1e6:.1f} MB",
                     f"{ratio:.2f}", "" if base_us is None else f"{base_us / us:.2f}x", check])
        results.append(dict(ep=ep, tokens=tokens, variant=name, us=us, floor_us=floor_us, bytes=moved,
                            ratio_to_copy=ratio, check=check))
    return results


# e4m3 rows carry 3 mantissa bits: relative L2 error about 0.03 on Gaussian
# rows (docs/internals.md); a wrong kernel is far above this.
E4M3_CHECK_REL_ERROR = 0.1


def _check_variant(name: str, outputs: list, scales: dict, bf16_out: list) -> str:
    """'ok', or what is wrong with a variant's last outputs: the fused formats
    bitwise against the reference quantizer of the bf16 combine's output (the
    kernels quantize that sum), the e4m3 transports within e4m3's error of it."""
    if name == "bf16":
        return "ok"
    kwargs, fmt, fused = VARIANTS[name]
    for r, (out, ref) in enumerate(zip(outputs, bf16_out)):
        if fmt is None:
            err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
            if not err <= E4M3_CHECK_REL_ERROR:
                return f"FAIL: rank {r} relative error {err:.3g} against bf16"
        elif not fused:
            if not torch.equal(out.view(torch.uint8), ref.view(torch.uint8)):
                return f"FAIL: rank {r} bf16 output differs from the bf16 variant's"
        else:
            data, sc = reference.reference_quantize(ref, fmt, int(SfLayout.layout_128x4),
                                                    NVFP4_GLOBAL_SCALE if fmt == "nvfp4" else 1.0)
            got_sc = scales[r].view(torch.uint8)[: sc.numel()]
            if not torch.equal(out.view(torch.uint8), data.view(torch.uint8)) or \
                    not torch.equal(got_sc, sc.view(torch.uint8)):
                return f"FAIL: rank {r} differs from the reference quantizer"
    return "ok"


def error_table(seed: int = 0, tokens: int = 512, hidden: int = 7168, destinations: int = 4) -> str:
    """The relative L2 error of the bf16 sum of ``destinations`` rows, each
    through an e4m3 transport, against the bf16 combine of the same rows."""
    g = torch.Generator().manual_seed(seed)
    cases = {
        "N(0, 1)": (1.0, 0.0, 1.0),
        "N(0, 0.02)": (0.02, 0.0, 1.0),
        "N(0, 0.002)": (0.002, 0.0, 1.0),
        "N(0, 100)": (100.0, 0.0, 1.0),
        "N(0, 1), 0.1% outliers x1000": (1.0, 1e-3, 1e3),
        "N(0, 0.02), 0.1% outliers x1e4": (0.02, 1e-3, 1e4),
    }
    rows = []
    for name, (sigma, fraction, factor) in cases.items():
        x = torch.randn(destinations, tokens, hidden, generator=g) * sigma
        if fraction:
            x = torch.where(torch.rand(x.shape, generator=g) < fraction, x * factor, x)
        x = x.bfloat16()
        exact = x.float().sum(0).bfloat16().float()

        def rel(values: torch.Tensor) -> str:
            got = values.sum(0).bfloat16().float()
            return f"{((got - exact).norm() / exact.norm()).item():.4f}"

        rows.append([name, rel(reference.low_precision_values(x)),
                     rel(reference.low_precision_values(x, block_scaled=True))])
    return format_table(["activations", "e4m3 (FlashInfer)", "e4m3, power-of-two scale per 128"], rows, {0})
