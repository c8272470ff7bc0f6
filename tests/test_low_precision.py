"""Low-precision combine (e4m3 rows, plain and block-scaled) and quantized
combine outputs (MXFP8, MXFP4, NVFP4 in the linear, 128x4 and 8x4 scale
layouts): bitwise against the plain-PyTorch reference (torch_moe_a2a/reference.py,
written from the formats' specifications), on every device; so CPU and CUDA
are bitwise equal too."""

import pytest
import torch
from conftest import (
    Case,
    assert_bytes_equal,
    assert_ws_unchanged,
    combine_again,
    make_generator,
    make_inputs,
    make_sim,
    random_bytes,
    round_trip,
    ws_snapshot,
)

import torch_moe_a2a as a2a
from torch_moe_a2a import reference

FP8 = torch.float8_e4m3fn
BLOCK_SCALED = "e4m3_block_scaled"
FORMATS = {  # name: (output_dtype, scales dtype, block)
    "mxfp8": (FP8, torch.uint8, 32),
    "mxfp4": (torch.uint8, torch.uint8, 32),
    "nvfp4": (torch.uint8, FP8, 16),
}
LAYOUTS = {"128x4": a2a.SfLayout.layout_128x4, "8x4": a2a.SfLayout.layout_8x4, "linear": a2a.SfLayout.layout_linear}

LP_CASES = [
    Case(2, (5, 3), 2, 4, hidden=64, runtime_max=6),
    Case(3, (7, 0, 11), 22, 37, hidden=200, runtime_max=16, max_num_tokens=20),  # a partial block of 72
    Case(4, (16, 3, 0, 9), 5, 7, hidden=256, hidden_dtype=torch.float16),
    Case(8, (4, 0, 6, 1, 0, 8, 2, 5), 3, 13, hidden=128, hidden_dtype=torch.float32, runtime_max=10),
    Case(1, (6,), 1, 2, hidden=96),
    # Block scales in groups of 16 blocks: two groups, the last of 200 elements
    # (a partial block of 72); fp32 rows of two groups; an odd row of 129.
    Case(2, (3, 4), 2, 4, hidden=2248, runtime_max=5),
    Case(2, (4, 2), 2, 4, hidden=2560, runtime_max=5),  # whole blocks of 16-bit elements
    Case(2, (2, 3), 2, 4, hidden=2100, hidden_dtype=torch.float32),
    Case(1, (4,), 1, 2, hidden=129),
]


def _lp_kwargs(mode):
    return lambda rank: dict(use_low_precision=True, low_precision_block_scales=mode == BLOCK_SCALED)


# "region": the combine region's view passed as a tensor (FlashInfer's
# payload_in_workspace=False), converted in place as with the flag; on CUDA a
# small call's rows went by steps to different warps, whose codes overwrote
# elements that another step had not loaded yet.
@pytest.mark.parametrize("payload", ["staged", "in_ws", "region"])
@pytest.mark.parametrize("mode", ["e4m3", BLOCK_SCALED])
@pytest.mark.parametrize("case", LP_CASES, ids=str)
def test_low_precision_matches_reference(case, mode, payload, device):
    gen = make_generator(case)
    rt = round_trip(make_sim(case, device), case, make_inputs(case, gen), gen, payload_in_workspace=payload == "in_ws",
                    region_as_tensor=payload == "region", combine_kwargs=_lp_kwargs(mode), low_precision=mode)
    assert all(o.dtype == torch.bfloat16 for o in rt.outputs)


def _outliers(scale):
    """Expert outputs with e4m3's edges: beyond 448 or below its subnormals, and
    inf. (No NaN: summed NaNs have no defined bits, a GPU's differ from a CPU's.)"""
    def transform(out):
        out = out.clone()
        flat = out.view(-1)
        n = flat.numel()
        if n:
            g = torch.Generator().manual_seed(n)
            picks = torch.randint(0, n, (max(1, n // 50),), generator=g)
            flat[picks] = (flat[picks].float() * scale).to(out.dtype)
            flat[picks[:1]] = float("inf")
        return out
    return transform


@pytest.mark.parametrize("mode", ["e4m3", BLOCK_SCALED])
@pytest.mark.parametrize("scale", [1e3, 1e-4])
def test_low_precision_edges(mode, scale, device):
    """Saturation at +-448, subnormals and flushes, inf and NaN: the same bits as the reference."""
    case = Case(3, (9, 4, 12), 3, 9, hidden=256, runtime_max=12)
    gen = make_generator(11)
    round_trip(make_sim(case, device), case, make_inputs(case, gen), gen, combine_kwargs=_lp_kwargs(mode),
               low_precision=mode, transform=_outliers(scale))


def _quant_kwargs(fmt, sf_layout, tokens, hidden, device, gen, scales_out, global_scale, low_precision):
    out_dtype, sc_dtype, block = FORMATS[fmt]

    def kwargs(rank):
        extent = reference.scale_layout_extent(int(sf_layout), tokens[rank], hidden // block)
        scales = random_bytes((extent,), gen).view(sc_dtype).to(device)  # poisoned: every entry must be written
        scales_out[rank] = scales
        kw = dict(output_dtype=out_dtype, output_scales=scales, sf_layout=sf_layout, output_scalar_scale=global_scale)
        if low_precision:
            kw.update(use_low_precision=True, low_precision_block_scales=low_precision == BLOCK_SCALED)
        return kw
    return kwargs


def _check_quantized(case, fmt, sf_layout, device, *, payload_in_workspace=False, low_precision=None,
                     global_scale=1.0, transform=None):
    gen = make_generator((case, fmt, int(sf_layout)))
    scales_out = {}
    expected_scales = {}
    tokens = case.tokens

    def expected(rank, ref_out):
        data, scales = reference.reference_quantize(ref_out, fmt, int(sf_layout), global_scale)
        expected_scales[rank] = scales
        return data

    kw = _quant_kwargs(fmt, sf_layout, tokens, case.hidden, device, gen, scales_out, global_scale, low_precision)
    rt = round_trip(make_sim(case, device), case, make_inputs(case, gen), gen,
                    payload_in_workspace=payload_in_workspace, combine_kwargs=kw, low_precision=low_precision,
                    expected=expected, transform=transform)
    for r in range(case.ep_size):
        assert_bytes_equal(scales_out[r].cpu(), expected_scales[r], f"rank {r} output_scales")
    return rt


QUANT_CASES = [
    Case(2, (5, 3), 2, 4, hidden=64, runtime_max=6),
    Case(3, (9, 0, 130), 4, 11, hidden=96, runtime_max=130),  # a second 128-row tile, a rank without tokens
    Case(4, (16, 3, 1, 9), 22, 30, hidden=256, hidden_dtype=torch.float16),
]


@pytest.mark.parametrize("sf_layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("case", QUANT_CASES, ids=str)
def test_quantized_output_matches_reference(case, fmt, sf_layout, device):
    _check_quantized(case, fmt, sf_layout, device, global_scale=448.0 * 6 / 20.0 if fmt == "nvfp4" else 1.0)


@pytest.mark.parametrize("low_precision", [None, "e4m3", BLOCK_SCALED])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_output_variants(fmt, low_precision, device):
    """In the workspace or staged, after a low-precision transport, from fp16 and fp32 payloads."""
    hidden_dtype = torch.float32 if low_precision else torch.bfloat16
    case = Case(3, (7, 12, 2), 3, 9, hidden=128, hidden_dtype=hidden_dtype, runtime_max=12)
    _check_quantized(case, fmt, a2a.SfLayout.layout_128x4, device, payload_in_workspace=True,
                     low_precision=low_precision, global_scale=3.5)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_output_edges(fmt, device):
    """Blocks with huge, tiny and inf values; zero blocks of tokens sent nowhere."""
    case = Case(2, (9, 6), 2, 4, hidden=64, runtime_max=9)
    _check_quantized(case, fmt, a2a.SfLayout.layout_8x4, device, transform=_outliers(1e6))
    _check_quantized(case, fmt, a2a.SfLayout.layout_linear, device, transform=_outliers(1e-30), global_scale=0.01)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_simulated_combine_of_a_quantized_output(fmt, device):
    """SimulatedEP.combine of a quantized output: each rank its own
    output_scales (a per-rank list; one tensor was passed to every rank), and
    on CUDA, where it allocates every rank's output before any rank
    launches, the op's shape (packed fp4: [n, hidden // 2] bytes; it
    allocated [n, hidden], which the op refused). Outputs and scales equal
    those of moe_a2a_combine rank by rank."""
    case = Case(2, (5, 3), 2, 4, hidden=64, runtime_max=6)
    out_dtype, sc_dtype, block = FORMATS[fmt]
    layout_128x4 = a2a.SfLayout.layout_128x4
    gen = make_generator(("simulated combine", fmt))
    inputs = make_inputs(case, gen).to(device)
    sim = make_sim(case, device)
    results = []
    for via_sim in (True, False):
        scales = [torch.zeros(reference.scale_layout_extent(int(layout_128x4), n, case.hidden // block),
                              dtype=torch.uint8, device=device).view(sc_dtype) for n in case.tokens]
        recv = sim.dispatch(inputs.ids, inputs.payloads, case.T, case.top_k, case.num_experts)
        kw = dict(output_dtype=out_dtype, sf_layout=layout_128x4)
        if via_sim:
            outs = sim.combine([r[0][0] for r in recv], list(case.tokens), case.T, case.top_k, [r[1] for r in recv],
                               output_scales=scales, **kw)
        else:
            outs = sim.run(lambda rank: a2a.moe_a2a_combine(
                recv[rank][0][0], case.tokens[rank], sim.workspace, sim.metainfo[rank], case.T, rank, case.ep_size,
                case.top_k, recv[rank][1], output_scales=scales[rank], **kw))
        results.append(([o.cpu() for o in outs], [s.cpu() for s in scales]))
    (sim_outs, sim_scales), (outs, scales) = results
    packed = out_dtype == torch.uint8
    for r in range(case.ep_size):
        assert sim_outs[r].shape == (case.tokens[r], case.hidden // 2 if packed else case.hidden)
        assert_bytes_equal(sim_outs[r], outs[r], f"rank {r} output")
        assert_bytes_equal(sim_scales[r], scales[r], f"rank {r} output_scales")


E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _e2m1_ties(out):
    """Every row: per 16 elements a 6.0 (each block's maximum: scale 1) and
    the e2m1 midpoints, each one bf16 step below, at and above it, both signs."""
    mids = torch.tensor(E2M1_MIDPOINTS, dtype=torch.bfloat16)
    bits = mids.view(torch.int16)
    near = torch.stack([(bits - 1).view(torch.bfloat16), mids, (bits + 1).view(torch.bfloat16)], 1).flatten()
    values = torch.cat([near, -near]).tolist()
    row, hidden = [], out.shape[-1]
    while len(row) < hidden:
        row.append(6.0 if len(row) % 16 == 0 else (values.pop(0) if values else 0.0))
    assert not values, "hidden too small for every tie"
    out = out.clone()
    out[...] = torch.tensor(row, dtype=out.dtype)
    return out


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_quantized_output_e2m1_ties(fmt, device):
    """e2m1 codes at the midpoints between neighbours (a tie goes to the even
    code) and a bf16 step to either side of each: one expert a token at ep 1,
    so every output row is its expert row exactly."""
    case = Case(1, (3,), 1, 2, hidden=64, runtime_max=3)
    _check_quantized(case, fmt, a2a.SfLayout.layout_linear, device, transform=_e2m1_ties)


# FlashInfer's test shapes for its FP8 combine and quantized outputs: world sizes
# 2 to 8, hidden 2048 to 7168, the payload in the workspace or not (few tokens:
# the shapes are what matters here, and the CPU runs them too).
@pytest.mark.parametrize("payload_in_workspace", [False, True], ids=["staged", "in_ws"])
@pytest.mark.parametrize("ep,hidden", [(2, 2048), (4, 4096), pytest.param(8, 7168, marks=pytest.mark.slow),
                                       pytest.param(8, 2880, marks=pytest.mark.slow)])
def test_flashinfer_shapes(ep, hidden, payload_in_workspace, device):
    tokens = tuple((3 * r + 2) % 7 + 1 for r in range(ep))
    case = Case(ep, tokens, 8, 4 * ep, hidden=hidden, runtime_max=8)
    gen = make_generator((ep, hidden))
    round_trip(make_sim(case, device), case, make_inputs(case, gen), gen, payload_in_workspace=payload_in_workspace,
               combine_kwargs=_lp_kwargs("e4m3"), low_precision="e4m3")
    if hidden % 32 == 0:
        for fmt in FORMATS:
            _check_quantized(case, fmt, a2a.SfLayout.layout_128x4, device,
                             payload_in_workspace=payload_in_workspace, global_scale=2.0)


SEQUENCE_CASES = [
    Case(3, (7, 0, 11), 3, 9, hidden=128, runtime_max=12),
    Case(4, (16, 3, 1, 9), 4, 13, hidden=256, hidden_dtype=torch.float16),
    Case(1, (5,), 2, 4, hidden=64),
]


@pytest.mark.parametrize("payload_in_workspace", [False, True], ids=["staged", "in_ws"])
@pytest.mark.parametrize("case", SEQUENCE_CASES, ids=str)
def test_flashinfer_repeated_combine_sequence(case, payload_in_workspace, device):
    """FlashInfer's test_moe_combine_multi_rank_single_gpu: a high-precision
    combine, then the quantized-output combines of the same payload after the
    same dispatch; then (ours) an e4m3 transport of it, in place last, and
    the next round. Every combine bitwise against the reference."""
    gen = make_generator(("flashinfer sequence", case, payload_in_workspace))
    sim = make_sim(case, device)
    rt = round_trip(sim, case, make_inputs(case, gen), gen, payload_in_workspace=payload_in_workspace)
    for fmt, sf_layout in (("mxfp8", a2a.SfLayout.layout_128x4), ("nvfp4", a2a.SfLayout.layout_linear),
                           ("mxfp4", a2a.SfLayout.layout_8x4)):
        global_scale = 2.5
        scales_out, expected_scales = {}, {}

        def expected(rank, ref_out, fmt=fmt, sf_layout=sf_layout, expected_scales=expected_scales):
            data, scales = reference.reference_quantize(ref_out, fmt, int(sf_layout), global_scale)
            expected_scales[rank] = scales
            return data

        kw = _quant_kwargs(fmt, sf_layout, case.tokens, case.hidden, device, gen, scales_out, global_scale, None)
        combine_again(sim, case, rt, gen, payload_in_workspace=payload_in_workspace, combine_kwargs=kw,
                      expected=expected)
        for r in range(case.ep_size):
            assert_bytes_equal(scales_out[r].cpu(), expected_scales[r], f"{fmt}: rank {r} output_scales")
    combine_again(sim, case, rt, gen, payload_in_workspace=payload_in_workspace, use_output=True)
    combine_again(sim, case, rt, gen, payload_in_workspace=payload_in_workspace, combine_kwargs=_lp_kwargs("e4m3"),
                  low_precision="e4m3")
    round_trip(sim, case, make_inputs(case, gen), gen, payload_in_workspace=payload_in_workspace)


# ---- refusals: clear errors before any kernel runs, the workspace untouched ----

def _dispatched(device, hidden=64, hidden_dtype=torch.bfloat16):
    case = Case(1, (5,), 2, 4, hidden=hidden, hidden_dtype=hidden_dtype, runtime_max=8)
    sim = make_sim(case, device)
    inputs = make_inputs(case, make_generator(3)).to(device)
    (_, offset, _), = sim.dispatch(inputs.ids, inputs.payloads, case.T, case.top_k, case.num_experts)
    payload = torch.randn(1, case.T, hidden).to(hidden_dtype).to(device)
    return sim, offset, payload


def _combine(sim, offset, payload, **kwargs):
    return a2a.moe_a2a_combine(payload, 5, sim.workspace, sim.metainfo[0], 8, 0, 1, 2, offset, **kwargs)


def _scales(n, dtype=torch.uint8, device="cpu"):
    return torch.zeros(n, dtype=dtype, device=device)


@pytest.mark.parametrize("kwargs,match", [
    (dict(output_dtype=FP8), "needs output_scales"),
    (dict(output_dtype=torch.uint8), "needs output_scales"),
    (dict(output_dtype=torch.float8_e5m2, output_scales=1), "float8_e4m3fn \\(MXFP8\\) or torch.uint8"),
    (dict(output_scales=10), "is not a quantized output"),
    (dict(output_dtype=FP8, output_scales=(10, FP8)), "needs torch.uint8 \\(ue8m0\\)"),
    (dict(output_dtype=torch.uint8, output_scales=(10, torch.int8)), "torch.uint8 \\(ue8m0: MXFP4\\)"),
    (dict(output_dtype=FP8, output_scales=9), "must hold 10 scales"),
    (dict(output_dtype=FP8, output_scales=10, sf_layout=a2a.SfLayout.layout_128x4), "must hold 512 scales"),
    (dict(output_dtype=torch.uint8, output_scales=(32, FP8), sf_layout=a2a.SfLayout.layout_8x4,
          output_scalar_scale=0.0), "positive finite"),
    (dict(output_dtype=FP8, output_scales=10, sf_layout=7), "sf_layout must be"),
    (dict(output_dtype=FP8, output_scales=10, sf_layout="linear"), "sf_layout must be an SfLayout"),
    (dict(use_low_precision=True, output_dtype=torch.float32), "combines into torch.bfloat16"),
    (dict(low_precision_block_scales=True), "requires use_low_precision=True"),
    # No number: float() raised a TypeError naming neither function nor argument
    # for None, and read "2" and True as scales.
    (dict(output_dtype=torch.uint8, output_scales=(20, FP8), output_scalar_scale=None),
     "moe_a2a_combine: output_scalar_scale .* must be a float, got None"),
    (dict(output_dtype=torch.uint8, output_scales=(20, FP8), output_scalar_scale="2"),
     "moe_a2a_combine: output_scalar_scale .* got '2'"),
    (dict(output_scalar_scale=True), "moe_a2a_combine: output_scalar_scale .* got True"),
    (dict(output_scalar_scale=None), "moe_a2a_combine: output_scalar_scale .* got None"),
])
def test_bad_combinations_raise_before_any_kernel(kwargs, match, device):
    sim, offset, payload = _dispatched(device)
    if "output_scales" in kwargs:
        n = kwargs["output_scales"]
        n, dtype = n if isinstance(n, tuple) else (n, torch.uint8)
        kwargs = dict(kwargs, output_scales=_scales(n, dtype, device))
    before = ws_snapshot(sim.workspace)
    with pytest.raises(ValueError, match=match):
        _combine(sim, offset, payload, **kwargs)
    assert_ws_unchanged(sim.workspace, before)
    _combine(sim, offset, payload)  # the workspace still works: the dispatch is still pending


@pytest.mark.parametrize("hidden,hidden_dtype,kwargs,match", [
    (48, torch.bfloat16, dict(output_dtype=FP8, output_scales=5), "multiple of 32"),
    (64, torch.float32, dict(output_dtype=FP8, output_scales=10), "bfloat16 or torch.float16 payload"),
    (8, torch.bfloat16, dict(use_low_precision=True, low_precision_block_scales=True), "more than the payload row"),
])
def test_bad_rows_raise(hidden, hidden_dtype, kwargs, match, device):
    sim, offset, payload = _dispatched(device, hidden, hidden_dtype)
    kwargs = dict(kwargs)
    if "output_scales" in kwargs:
        kwargs["output_scales"] = _scales(kwargs["output_scales"], device=device)
    before = ws_snapshot(sim.workspace)
    with pytest.raises(ValueError, match=match):
        _combine(sim, offset, payload, **kwargs)
    assert_ws_unchanged(sim.workspace, before)


def test_quantized_output_tensor(device):
    """output= of a quantized combine: the packed shape, written in place."""
    sim, offset, payload = _dispatched(device)
    out = torch.empty(5, 32, dtype=torch.uint8, device=device)
    scales = _scales(10, device=device)
    got = _combine(sim, offset, payload, output_dtype=torch.uint8, output_scales=scales, output=out)
    assert got.data_ptr() == out.data_ptr()
    with pytest.raises(ValueError, match="output must be"):
        sim2, offset2, payload2 = _dispatched(device)
        _combine(sim2, offset2, payload2, output_dtype=torch.uint8, output_scales=scales,
                 output=torch.empty(5, 64, dtype=torch.uint8, device=device))


def test_quantized_output_of_a_misaligned_payload_is_refused(device):
    """A quantized output's pull reads the own rows from the payload with
    16-byte vectors: a payload at 2 bytes past a multiple of 16 failed on CUDA
    with "invalid argument" after the checks, its peers left to time out.
    Refused before anything runs, as a misaligned output is; its aligned copy
    combines."""
    sim, offset, payload = _dispatched(device)
    flat = torch.zeros(payload.numel() + 8, dtype=payload.dtype, device=device)
    misaligned = flat[1:1 + payload.numel()].view(payload.shape).copy_(payload)
    assert misaligned.data_ptr() % 16 == 2
    before = ws_snapshot(sim.workspace)
    with pytest.raises(ValueError, match="a quantized output needs a 16-byte aligned payload, got one at an address 2 "
                                         "bytes past"):
        _combine(sim, offset, misaligned, output_dtype=FP8, output_scales=_scales(10, device=device))
    assert_ws_unchanged(sim.workspace, before)
    _combine(sim, offset, misaligned.clone(), output_dtype=FP8, output_scales=_scales(10, device=device))


def test_workspace_size_covers_low_precision():
    """The sizing function needs nothing more: e4m3 rows (with their block
    scales) fit in the payload rows they replace at every FlashInfer shape."""
    from torch_moe_a2a import layout
    group = layout.LOW_PRECISION_BLOCK * layout.LOW_PRECISION_GROUP_BLOCKS
    for hidden in (2048, 2880, 4096, 7168):
        groups = -(-hidden // group)
        last = hidden - (groups - 1) * group
        staged = (groups - 1) * layout.LOW_PRECISION_GROUP_PITCH + -(-last // 16) * 16 + -(-last // 128)
        assert staged <= 2 * hidden


def test_scaled_variant_error_against_bf16():
    """The block-scaled transport keeps e4m3's relative error on activations
    with outliers beyond e4m3's range, where the plain one saturates (the
    measured figures: docs/internals.md, 'Low precision and quantized outputs')."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(1, 256, 7168, generator=g) * 0.05
    outliers = torch.rand(rows.shape, generator=g) < 0.001
    rows = torch.where(outliers, rows * 2e4, rows).bfloat16()
    exact = rows.float()

    def rel(values):
        return ((values - exact).norm() / exact.norm()).item()

    plain = rel(reference.low_precision_values(rows))
    scaled = rel(reference.low_precision_values(rows, block_scaled=True))
    assert scaled < 0.05 < plain


@pytest.mark.parametrize("mode", ["e4m3", BLOCK_SCALED])
def test_moe_alltoall_low_precision_equals_functional(mode, device):
    """MoeAlltoAll.combine(use_low_precision=True[, low_precision_block_scales=True]),
    vLLM's path with its low-precision switch, gives the functional API's bits."""
    from conftest import ep_mapping

    case = LP_CASES[0]
    gen = make_generator(("moe", mode))
    inputs = make_inputs(case, gen).to(device)
    expert_out = [torch.randn((case.ep_size, case.T, case.hidden), generator=gen).to(case.hidden_dtype).to(device)
                  for _ in range(case.ep_size)]
    kwargs = _lp_kwargs(mode)(0)

    sim = make_sim(case, device)
    moes = [a2a.MoeAlltoAll(ep_mapping(r, case.ep_size), case.max_tokens, case.top_k, case.num_experts,
                            workspace_size_per_rank=sim.workspace.shape[1], workspace=sim.workspace)
            for r in range(case.ep_size)]
    sim.run(lambda r: moes[r].dispatch(inputs.ids[r], inputs.payloads[r], case.T))
    got = sim.run(lambda r: moes[r].combine(expert_out[r], case.T, **kwargs))

    ref_sim = make_sim(case, device)
    offsets = [o for _, o, _ in ref_sim.dispatch(inputs.ids, inputs.payloads, case.T, case.top_k, case.num_experts)]
    expected = ref_sim.combine(expert_out, list(case.tokens), case.T, case.top_k, offsets, **kwargs)
    for r in range(case.ep_size):
        assert_bytes_equal(got[r], expected[r], f"rank {r}")


@pytest.mark.parametrize("mode", ["e4m3", BLOCK_SCALED])
def test_low_precision_nan_rows(mode, device):
    """A NaN in the expert outputs (of either sign) makes the sums that hold it
    NaN, whatever NaN code the staging gives it, and every other sum keeps the
    CPU's bits: the sums of the columns without NaN are compared bitwise with
    the same call on the CPU."""
    case = Case(3, (9, 4, 12), 3, 9, hidden=256, runtime_max=12)
    nan_columns = [3, 130, 255]

    def transform(out):
        out = out.clone()
        out[..., nan_columns[0]] = float("nan")
        out[..., nan_columns[1]] = -float("nan")
        out[..., nan_columns[2]] = float("nan")
        return out

    def outputs(dev):
        gen = make_generator(("nan", mode))
        inputs = make_inputs(case, gen).to(dev)
        sim = make_sim(case, dev)
        offsets = [o for _, o, _ in sim.dispatch(inputs.ids, inputs.payloads, case.T, case.top_k, case.num_experts)]
        expert_out = [transform(torch.randn((case.ep_size, case.T, case.hidden), generator=gen).bfloat16()).to(dev)
                      for _ in range(case.ep_size)]
        return [o.cpu() for o in sim.combine(expert_out, list(case.tokens), case.T, case.top_k, offsets,
                                             **_lp_kwargs(mode)(0))]

    got = outputs(device)
    on_cpu = got if device == "cpu" else outputs("cpu")
    keep = [c for c in range(case.hidden) if c not in nan_columns]
    for r in range(case.ep_size):
        assert torch.isnan(got[r][:, nan_columns].float()).all(), f"rank {r}"
        assert not torch.isnan(got[r][:, keep].float()).any(), f"rank {r}"
        assert_bytes_equal(got[r][:, keep].contiguous(), on_cpu[r][:, keep].contiguous(), f"rank {r}")
