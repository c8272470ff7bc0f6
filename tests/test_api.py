"""Public API: FlashInfer-compatible signatures, helpers, view caching,
SimulatedEP conveniences and MoeAlltoAll."""

import inspect
import math
import threading

import pytest
import torch
from conftest import (
    Case,
    PayloadSpec,
    assert_bytes_equal,
    ep_mapping,
    make_generator,
    make_inputs,
    make_sim,
    round_trip,
)

import torch_moe_a2a as a2a
from torch_moe_a2a import errors, layout, reference

P = inspect.Parameter
POS, KW = P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY
REQ = P.empty
LINEAR = object()  # placeholder for SfLayout.layout_linear

# (name, kind, default) in order, as FlashInfer declares them (docs/DESIGN.md section 2).
SIGNATURES = {
    "moe_a2a_get_workspace_size_per_rank": [
        ("ep_size", POS, REQ), ("max_num_tokens", POS, REQ), ("total_dispatch_payload_size_per_token", POS, REQ),
        ("combine_payload_size_per_token", POS, REQ), ("eplb_stats_num_experts", POS, 0), ("backend", KW, "trtllm"),
    ],
    "moe_a2a_initialize": [
        ("workspace", POS, REQ), ("ep_rank", POS, REQ), ("ep_size", POS, REQ), ("max_num_tokens", POS, REQ),
        ("eplb_stats_num_experts", POS, 0), ("backend", KW, "trtllm"),
    ],
    "moe_a2a_dispatch": [
        ("token_selected_experts", POS, REQ), ("input_payloads", POS, REQ), ("workspace", POS, REQ),
        ("metainfo", POS, REQ), ("runtime_max_tokens_per_rank", POS, REQ), ("ep_rank", POS, REQ),
        ("ep_size", POS, REQ), ("top_k", POS, REQ), ("num_experts", POS, REQ), ("enable_pdl", POS, None),
        ("eplb_local_stats", POS, None), ("enable_rank_mask", POS, False), ("active_rank_mask", POS, None),
        ("backend", KW, "trtllm"), ("recv_view_cache", KW, None),
    ],
    "moe_a2a_combine": [
        ("payload", POS, REQ), ("local_num_tokens", POS, REQ), ("workspace", POS, REQ), ("metainfo", POS, REQ),
        ("runtime_max_tokens_per_rank", POS, REQ), ("ep_rank", POS, REQ), ("ep_size", POS, REQ), ("top_k", POS, REQ),
        ("combine_payload_offset", POS, REQ), ("payload_in_workspace", POS, False), ("output_dtype", POS, None),
        ("output_scales", POS, None), ("output_scalar_scale", POS, 1.0), ("sf_layout", POS, LINEAR),
        ("output", POS, None), ("use_low_precision", KW, False), ("enable_pdl", KW, None),
        ("enable_rank_mask", KW, False), ("active_rank_mask", KW, None), ("backend", KW, "trtllm"),
    ],
    "moe_a2a_sanitize_expert_ids": [
        ("expert_ids", POS, REQ), ("workspace", POS, REQ), ("metainfo", POS, REQ), ("ep_rank", POS, REQ),
        ("invalid_expert_id", POS, REQ), ("enable_pdl", POS, None), ("backend", KW, "trtllm"),
    ],
    "moe_a2a_wrap_payload_tensor_in_workspace": [
        ("workspace", POS, REQ), ("leading_shape", POS, REQ), ("slice_start", POS, REQ), ("slice_end", POS, REQ),
        ("dtype", POS, REQ),
    ],
    "moe_a2a_active_rank_mask": [("active_ranks", POS, REQ), ("ep_size", POS, REQ)],
}


# Our keyword-only supersets after FlashInfer's parameters (a FlashInfer call never names them).
SUPERSETS = {"moe_a2a_initialize": [("timeout_s", KW, None)],
             "moe_a2a_dispatch": [("timeout_s", KW, None), ("expert_major", KW, False), ("router_weights", KW, None),
                                  ("max_tokens_per_expert", KW, None)],
             "moe_a2a_combine": [("timeout_s", KW, None), ("low_precision_block_scales", KW, False)]}


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_signature_matches_flashinfer(name):
    fn = getattr(a2a, name)
    got = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    expected = SIGNATURES[name] + SUPERSETS.get(name, [])
    assert [g[:2] for g in got] == [e[:2] for e in expected], f"{name}: names/kinds differ"
    for (pname, _, default), (_, _, want) in zip(got, expected):
        if want is LINEAR:
            assert isinstance(default, a2a.SfLayout) and "linear" in default.name, f"{name}.{pname} = {default!r}"
        else:
            assert default == want and type(default) is type(want), f"{name}.{pname}: default {default!r} != {want!r}"


def test_public_names_exported():
    for name in ["MoeAlltoAll", "Mapping", "SfLayout", "MOE_A2A_RANK_MASK_WORDS", "allocate_workspace",
                 "check_errors", "moe_a2a_get_recv_counts", "moe_a2a_get_invalid_expert_count", "SimulatedEP",
                 *SIGNATURES]:
        assert hasattr(a2a, name), name


@pytest.mark.parametrize("active,ep_size,expected", [
    ([0, 1, 3], 4, 0b1011),
    ([], 8, 0),
    (list(range(64)), 64, (1 << 64) - 1),
    ([63], 64, 1 << 63),
    ([5, 5, 2], 6, 0b100100),
])
def test_active_rank_mask_values(active, ep_size, expected):
    mask = a2a.moe_a2a_active_rank_mask(active, ep_size)
    assert mask.device.type == "cpu" and mask.dtype == torch.uint64
    assert tuple(mask.shape) == (a2a.MOE_A2A_RANK_MASK_WORDS,)
    assert int(mask.view(torch.int64)[0]) & ((1 << 64) - 1) == expected
    # A tensor of ranks is accepted too (FlashInfer).
    again = a2a.moe_a2a_active_rank_mask(torch.tensor(active, dtype=torch.int64), ep_size)
    assert torch.equal(again.view(torch.int64), mask.view(torch.int64))


def test_active_rank_mask_rejects_out_of_range():
    with pytest.raises((ValueError, AssertionError)):
        a2a.moe_a2a_active_rank_mask([4], 4)


def test_wrap_payload_tensor_in_workspace(device):
    ws = torch.zeros(3, 4096, dtype=torch.uint8, device=device)
    # Row form: offsets relative to the row (how MoeAlltoAll uses it).
    view = a2a.moe_a2a_wrap_payload_tensor_in_workspace(ws[1], [2, 4], 256, 256 + 2 * 4 * 6 * 4, torch.float32)
    assert tuple(view.shape) == (2, 4, 6) and view.dtype == torch.float32
    assert view.data_ptr() == ws[1].data_ptr() + 256
    values = torch.arange(48, dtype=torch.float32, device=device).reshape(2, 4, 6)
    view.copy_(values)
    assert_bytes_equal(ws[1, 256 : 256 + 192], values.view(torch.uint8).reshape(-1), "written bytes")
    assert int(ws[0].count_nonzero()) == 0 and int(ws[2].count_nonzero()) == 0
    # 2-D form: offsets from the start of the whole workspace.
    view2 = a2a.moe_a2a_wrap_payload_tensor_in_workspace(ws, [2, 4], 4096 + 256, 4096 + 256 + 192, torch.float32)
    assert view2.data_ptr() == view.data_ptr() and torch.equal(view2, values)
    # Padded rows (a multi-process CUDA workspace): the flat offset counts the row stride.
    padded = torch.zeros(3, 4096 + 512, dtype=torch.uint8, device=device)[:, :4096]
    view3 = a2a.moe_a2a_wrap_payload_tensor_in_workspace(padded, [2, 4], 2 * 4608 + 256, 2 * 4608 + 448,
                                                         torch.float32)
    assert view3.data_ptr() == padded[2].data_ptr() + 256
    with pytest.raises(ValueError, match="one row"):
        a2a.moe_a2a_wrap_payload_tensor_in_workspace(padded, [2, 4], 4096 - 64, 4096 + 128, torch.float32)


def test_initialize_touches_only_its_row(device):
    size = a2a.moe_a2a_get_workspace_size_per_rank(3, 8, 64, 32)
    ws = torch.full((3, size), 0xAB, dtype=torch.uint8, device=device)
    meta = a2a.moe_a2a_initialize(ws, 1, 3, 8)
    assert meta.dtype == torch.int64 and meta.device.type == "cpu" and tuple(meta.shape) == (layout.META_COUNT,)
    assert int(meta[layout.META_EP_RANK]) == 1 and int(meta[layout.META_EP_SIZE]) == 3
    assert bool((ws[0] == 0xAB).all()) and bool((ws[2] == 0xAB).all()), "initialize wrote into a peer's row"
    assert int(ws[1, layout.HEADER_BYTES:].count_nonzero()) == 0, "own row's per-call region not zeroed"
    assert int(ws[1, layout.HDR_DISPATCH_EPOCH:layout.HDR_ERROR_MISSING].count_nonzero()) == 0
    assert int(ws[1, layout.HDR_DISPATCH_FLAGS:layout.HEADER_BYTES].count_nonzero()) == 0


def test_recv_view_cache(device):
    case = Case(1, (5,), 2, 4, hidden=64, max_num_tokens=8, extras=(PayloadSpec(torch.float32, (4, 3)),))
    sim = make_sim(case, device)
    gen = make_generator(1)
    inputs = make_inputs(case, gen).to(device)
    cache = {}

    def step(payloads, T=5):
        out, off, _ = a2a.moe_a2a_dispatch(inputs.ids[0], payloads, sim.workspace, sim.metainfo[0], T, 0, 1, 2, 4,
                                           recv_view_cache=cache)
        a2a.moe_a2a_combine(torch.ones(1, T, 64, dtype=torch.bfloat16, device=device), 5, sim.workspace,
                            sim.metainfo[0], T, 0, 1, 2, off)
        return out

    first = step(inputs.payloads[0])
    second = step(inputs.payloads[0])
    assert all(a is b for a, b in zip(first, second)), "cached views must be reused"
    assert_bytes_equal(second[0][0, :5], inputs.payloads[0][0], "cached view sees fresh data")
    # Same bytes per row, other trailing shape: [4, 3] fp32 -> [12] fp32 and [3, 4].
    for trailing in [(12,), (3, 4)]:
        reshaped = [*inputs.payloads[0][:3], inputs.payloads[0][3].reshape(5, *trailing)]
        third = step(reshaped)
        assert tuple(third[3].shape) == (1, 5, *trailing)
        assert third[3] is not second[3]
    # Other dtype, same bytes: fp32 [n, 2] weights -> int32 [n, 2].
    redtyped = [inputs.payloads[0][0], inputs.payloads[0][1], inputs.payloads[0][2].view(torch.int32),
                inputs.payloads[0][3]]
    fourth = step(redtyped)
    assert fourth[2].dtype == torch.int32 and fourth[2] is not second[2]
    # Other runtime_max -> other views.
    fifth = step(inputs.payloads[0], T=7)
    assert tuple(fifth[0].shape) == (1, 7, 64)
    # Another workspace clears the cache (FlashInfer semantics): no stale views.
    other = make_sim(case, device)
    out, off, _ = a2a.moe_a2a_dispatch(inputs.ids[0], inputs.payloads[0], other.workspace, other.metainfo[0], 5, 0,
                                       1, 2, 4, recv_view_cache=cache)
    assert out[0].untyped_storage().data_ptr() == other.workspace.untyped_storage().data_ptr()
    assert not any(isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() ==
                   sim.workspace.untyped_storage().data_ptr() for v in cache.values())


def test_receive_views_are_workspace_views(device):
    case = Case(2, (3, 4), 2, 4, extras=(PayloadSpec(torch.uint8, (7,)),))
    sim = make_sim(case, device)
    gen = make_generator(4)
    rt = round_trip(sim, case, make_inputs(case, gen), gen)
    for r, res in enumerate(rt.dispatch_results):
        row = sim.workspace[r]
        views, offset, _ = res
        assert isinstance(offset, int)
        specs = case.payload_specs()
        lay = layout.call_layout(2, case.T, 0, [s.row_bytes for s in specs])
        assert offset == lay.combine_offset
        for v, off in zip(views, lay.payload_offsets):
            assert v.data_ptr() == row.data_ptr() + off, "receive view must alias the own row at the layout offset"
            assert v.data_ptr() % 128 == 0, "payload planes start 128-byte aligned (DESIGN.md section 3)"


def test_allocated_workspace_puts_planes_aligned_in_memory(device):
    """allocate_workspace's first byte is layout.PLANE_ALIGN-aligned whatever
    the allocator gives (CPU allocations are only 64-byte aligned), so every
    plane, aligned inside a row, is aligned in memory; the tensor is zeroed
    and contiguous."""
    size = layout.workspace_size_per_rank(2, 3, 64, 32, 0)
    for _ in range(16):
        ws = a2a.allocate_workspace(size, ep_size=2, device=device)
        assert ws.data_ptr() % layout.PLANE_ALIGN == 0
        assert tuple(ws.shape) == (2, size) and ws.is_contiguous() and ws.dtype == torch.uint8
        assert int(ws.count_nonzero()) == 0


def test_simulated_ep_helpers(device):
    """SimulatedEP.dispatch / combine / recv_counts drive all ranks."""
    case = Case(3, (4, 0, 6), 2, 5, hidden=64)
    sim = make_sim(case, device)
    assert tuple(sim.workspace.shape)[0] == 3 and sim.workspace.dtype == torch.uint8
    assert len(sim.metainfo) == 3
    gen = make_generator(9)
    inputs = make_inputs(case, gen)
    dev = inputs.to(device)
    results = sim.dispatch(dev.ids, dev.payloads, case.T, case.top_k, case.num_experts)
    assert len(results) == 3
    from torch_moe_a2a import reference

    ref = reference.reference_dispatch(inputs.ids, inputs.payloads, ep_size=3, num_experts=5,
                                       runtime_max_tokens_per_rank=case.T)
    for r in range(3):
        assert torch.equal(sim.recv_counts(r).cpu(), ref.recv_counts[r].to(torch.int32))
    expert_out = [reference.toy_moe(ref.recv[r][0], ref.recv[r][1], ref.recv[r][2], ref.recv_counts[r], ep_rank=r,
                                    ep_size=3, num_experts=5) for r in range(3)]
    outs = sim.combine([e.to(device) for e in expert_out], list(case.tokens), case.T, case.top_k,
                       [res[1] for res in results])
    expected = reference.reference_combine(expert_out, ref, list(case.tokens))
    for r in range(3):
        assert_bytes_equal(outs[r], expected[r], f"rank {r}")


def test_simulated_ep_reraises_first_exception(device):
    sim = make_sim(Case(2, (1, 1), 1, 2), device)

    def fn(rank):
        if rank == 1:
            raise KeyError("boom")
        return rank

    with pytest.raises(KeyError, match="boom"):
        sim.run(fn)
    assert sim.run(lambda r: r * 10) == [0, 10]


def test_simulated_ranks_run_in_the_callers_grad_mode(device):
    """Grad and inference modes are per thread: CPU ranks run in threads of
    their own, which took the default modes, so a layer run under
    torch.no_grad() still recorded its graph."""
    sim = make_sim(Case(2, (1, 1), 1, 2), device)

    def modes(rank):
        return torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    assert sim.run(modes) == [(True, False)] * 2
    with torch.no_grad():
        assert sim.run(modes) == [(False, False)] * 2
    with torch.inference_mode():
        assert sim.run(modes) == [(False, True)] * 2
    assert sim.run(modes) == [(True, False)] * 2


# ---- MoeAlltoAll ---------------------------------------------------------------------------------------


def _instances(sim, case, **kwargs):
    """One MoeAlltoAll per simulated rank, all sharing sim's workspace (each
    initializes its own row; all are built before any rank dispatches)."""
    return [
        a2a.MoeAlltoAll(ep_mapping(r, case.ep_size), case.max_tokens, case.top_k, case.num_experts,
                        workspace_size_per_rank=sim.workspace.shape[1], workspace=sim.workspace, **kwargs)
        for r in range(case.ep_size)
    ]


@pytest.mark.parametrize("payload_in_workspace", [False, True], ids=["staged", "in_ws"])
def test_moe_alltoall_round_trips(payload_in_workspace, device):
    from torch_moe_a2a import reference

    case = Case(3, (7, 0, 12), 3, 7, hidden=64, runtime_max=12, max_num_tokens=16,
                extras=(PayloadSpec(torch.float8_e4m3fn, (16,)),))
    sim = make_sim(case, device, eplb_n=5)
    moes = _instances(sim, case, eplb_stats_num_experts=5)
    assert all(m.workspace is sim.workspace for m in moes)
    # Marked static for CUDA-graph trees (DESIGN.md section 4), on every device.
    assert getattr(sim.workspace, "_dynamo_static_input_type", None) is not None
    gen = make_generator(case)
    invalid = -3
    for round_ in range(3):
        T = [12, 16, 9][round_]
        tokens = [min(t, T) for t in case.tokens]
        inputs = make_inputs(case, gen, tokens)
        dev = inputs.to(device)
        stats = [torch.randint(0, 100, (5,), dtype=torch.int32, generator=gen) for _ in range(3)]

        def dispatch(r):
            return moes[r].dispatch(dev.ids[r], dev.payloads[r], T, invalid_token_expert_id=invalid,
                                    expert_id_payload_index=1, eplb_local_stats=stats[r].to(device))

        recv = sim.run(dispatch)
        ref = reference.reference_dispatch(inputs.ids, inputs.payloads, ep_size=3, num_experts=case.num_experts,
                                           runtime_max_tokens_per_rank=T)
        expert_out = []
        for r in range(3):
            counts = moes[r].recv_counts.cpu()
            assert torch.equal(counts, ref.recv_counts[r])
            assert torch.equal(moes[r].eplb_gathered_stats.cpu(), torch.stack(stats))
            ids_view = recv[r][1].cpu()
            for s in range(3):
                n = int(counts[s])
                for i in (0, 2, 3):
                    assert_bytes_equal(recv[r][i][s, :n], ref.recv[r][i][s, :n], f"rank {r} payload {i}")
                assert torch.equal(ids_view[s, :n], ref.recv[r][1][s, :n])
                assert (ids_view[s, n:] == invalid).all(), "invalid_token_expert_id must sanitize padding"
            out = reference.toy_moe(recv[r][0].cpu(), ids_view, recv[r][2].cpu(), counts, ep_rank=r, ep_size=3,
                                    num_experts=case.num_experts)
            expert_out.append(out)
        ref_expert = [reference.toy_moe(ref.recv[r][0], ref.recv[r][1], ref.recv[r][2], ref.recv_counts[r],
                                        ep_rank=r, ep_size=3, num_experts=case.num_experts) for r in range(3)]
        payloads = []
        for r in range(3):
            if payload_in_workspace:
                view = moes[r].get_combine_payload_tensor_in_workspace(T, case.hidden, case.hidden_dtype)
                assert tuple(view.shape) == (3, T, case.hidden)
                view.copy_(expert_out[r].to(device))
                payloads.append(view)
            else:
                payloads.append(expert_out[r].to(device))
        outs = sim.run(lambda r: moes[r].combine(payloads[r], T, payload_in_workspace=payload_in_workspace))
        expected = reference.reference_combine(ref_expert, ref, tokens)
        for r in range(3):
            assert_bytes_equal(outs[r], expected[r], f"round {round_} rank {r}")
        assert all(m.eplb_gathered_stats is None for m in moes), "stats are only valid until combine"
    for m in moes:
        m.check()


def test_moe_alltoall_phase_errors(device):
    case = Case(1, (4,), 2, 4)
    moe = a2a.MoeAlltoAll(ep_mapping(0, 1), 8, 2, 4, hidden_size=64, device=device)
    assert moe.workspace.device.type == device and moe.workspace.shape[0] == 1
    inputs = make_inputs(case, make_generator(0)).to(device)
    payload = torch.ones(1, 4, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(RuntimeError, match=r"(?i)dispatch"):
        moe.combine(payload, 4)
    with pytest.raises(RuntimeError, match=r"(?i)dispatch"):
        moe.get_combine_payload_tensor_in_workspace(4, 64, torch.bfloat16)
    moe.dispatch(inputs.ids[0], inputs.payloads[0], 4)
    with pytest.raises(RuntimeError, match=r"(?i)dispatch"):
        moe.dispatch(inputs.ids[0], inputs.payloads[0], 4)
    out = moe.combine(payload, 4)  # the pending dispatch is still usable
    assert tuple(out.shape) == (4, 64)
    again = moe.combine(payload * 2, 4)  # FlashInfer's repeated combine of the same dispatch
    assert torch.equal(again.cpu(), (out * 2).cpu())
    with pytest.raises(ValueError, match=r"(?i)eplb"):
        moe.dispatch(inputs.ids[0], inputs.payloads[0], 4, eplb_local_stats=torch.ones(4, dtype=torch.int32))
    moe.dispatch(inputs.ids[0], inputs.payloads[0], 4)
    moe.combine(payload, 4)


def test_moe_alltoall_on_a_row_in_use_shares_it(device):
    """A second instance on a rank's row that a live instance uses shares that
    row (initializing it again would end the running rounds: the peers' next
    calls timed out); one of another geometry is refused."""
    case = Case(2, (4, 3), 2, 4, hidden=16, extras=())
    sim = make_sim(case, device)
    moes = [a2a.MoeAlltoAll(ep_mapping(r, 2), case.max_tokens, case.top_k, case.num_experts,
                            workspace=sim.workspace, timeout_s=5) for r in range(2)]
    gen = make_generator(case)

    def round_trip(instances):
        inputs = make_inputs(case, gen, list(case.tokens))
        dev = inputs.to(device)
        recv = sim.run(lambda r: instances[r].dispatch(dev.ids[r], dev.payloads[r], case.max_tokens))
        outs = sim.run(lambda r: instances[r].combine(recv[r][0], case.max_tokens))
        for r in range(2):
            assert tuple(outs[r].shape) == (case.tokens[r], case.hidden)

    round_trip(moes)
    again = a2a.MoeAlltoAll(ep_mapping(0, 2), case.max_tokens, case.top_k, case.num_experts,
                            workspace=sim.workspace, timeout_s=5)
    round_trip([again, moes[1]])
    round_trip(moes)
    with pytest.raises(ValueError, match=r"in use by another instance.*max_num_tokens"):
        a2a.MoeAlltoAll(ep_mapping(1, 2), case.max_tokens - 1, case.top_k, case.num_experts,
                        workspace=sim.workspace)
    # A narrower view of the same rows is the same row, of another size.
    with pytest.raises(ValueError, match=r"in use by another instance.*'size_per_rank'"):
        a2a.MoeAlltoAll(ep_mapping(0, 2), case.max_tokens, case.top_k, case.num_experts,
                        workspace=sim.workspace[:, : sim.workspace.shape[1] - 128])
    round_trip(moes)


def test_moe_alltoall_timeout_s(monkeypatch, device):
    """timeout_s per instance beats MOE_A2A_TIMEOUT_S (20 s here)."""
    monkeypatch.setenv("MOE_A2A_TIMEOUT_S", "20")
    case = Case(2, (3, 3), 2, 4)
    sim = make_sim(case, device)
    moes = _instances(sim, case, timeout_s=1.0)
    inputs = make_inputs(case, make_generator(0)).to(device)
    import time

    start = time.monotonic()
    # The message says which settings set the bound.
    pattern = (r"rank 0: peers \[1\] did not arrive within 1(\.0)? s \(dispatch\); the bound is MOE_A2A_TIMEOUT_S, "
               r"or a timeout_s= of the call, of moe_a2a_initialize or of MoeAlltoAll")
    if device == "cpu":
        with pytest.raises(RuntimeError, match=pattern):
            moes[0].dispatch(inputs.ids[0], inputs.payloads[0], 3)
    else:
        moes[0].dispatch(inputs.ids[0], inputs.payloads[0], 3)
        torch.cuda.synchronize()
    assert 0.9 <= time.monotonic() - start <= 2.5
    with pytest.raises(RuntimeError, match=pattern):
        moes[0].check()


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_a_cpu_rank_loop_on_one_thread_is_told_to_use_a_thread_per_rank(monkeypatch, op):
    """The first program many write, every rank's call in turn from one
    thread, waits in rank 0's call for peers it has not called yet (a CPU
    call blocks until its peers arrive); the timeout names the missing peers
    and says how simulated ranks are driven. The record kept in the
    workspace (check_errors) stays the plain one."""
    monkeypatch.setenv("MOE_A2A_TIMEOUT_S", "0.3")
    ep_size, tokens, top_k, num_experts = 3, 4, 2, 6
    workspace = torch.zeros(ep_size, a2a.moe_a2a_get_workspace_size_per_rank(ep_size, tokens, 64, 64),
                            dtype=torch.uint8)
    metainfo = [a2a.moe_a2a_initialize(workspace, r, ep_size, tokens) for r in range(ep_size)]
    gen = make_generator(4)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    x = torch.randn(tokens, 8, generator=gen)
    hint = r"peers \[1, 2\] did not arrive within 0.3 s \(" + op + r"\); .*" + THREAD_HINT + r" \(SimulatedEP.run"
    if op == "combine":
        # Every rank's dispatch from its own thread, then the combines from one.
        offsets = [None] * ep_size

        def dispatch(rank):
            _, offsets[rank], _ = a2a.moe_a2a_dispatch(ids, [x], workspace, metainfo[rank], tokens, rank, ep_size,
                                                       top_k, num_experts)

        threads = [threading.Thread(target=dispatch, args=(r,)) for r in range(ep_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with pytest.raises(RuntimeError, match=hint):
            a2a.moe_a2a_combine(torch.zeros(ep_size, tokens, 8), tokens, workspace, metainfo[0], tokens, 0, ep_size,
                                top_k, offsets[0])
    else:
        with pytest.raises(RuntimeError, match=hint):
            a2a.moe_a2a_dispatch(ids, [x], workspace, metainfo[0], tokens, 0, ep_size, top_k, num_experts)
    with pytest.raises(RuntimeError, match=r"did not arrive within 0.3 s \(" + op + r"\)") as record:
        a2a.check_errors(workspace)
    assert "SimulatedEP.run" not in str(record.value)


def test_two_threads_on_one_rank_are_refused():
    """Two threads dispatching on rank 0 at once: one is refused, naming the
    cause, instead of both passing the sequence check together and returning
    the same rows (one caller's tokens lost). Rank 0's other call then
    completes the round with rank 1."""
    import time

    ep_size, tokens, top_k, num_experts = 2, 4, 2, 4
    sim = a2a.SimulatedEP(ep_size, tokens, dispatch_bytes_per_token=64, combine_bytes_per_token=64, timeout_s=5.0)
    ids = torch.zeros(3, top_k, dtype=torch.int32)
    xs = {"a": torch.full((3, 8), 1.0), "b": torch.full((3, 8), 2.0), "rank 1": torch.full((3, 8), 3.0)}
    got, errors = {}, {}

    def call(name, rank):
        try:
            got[name] = a2a.moe_a2a_dispatch(ids, [xs[name]], sim.workspace, sim.metainfo[rank], tokens, rank,
                                             ep_size, top_k, num_experts)
        except RuntimeError as e:
            errors[name] = str(e)

    zeros = [threading.Thread(target=call, args=(name, 0)) for name in ("a", "b")]
    for t in zeros:
        t.start()
    # Rank 1 comes once one rank-0 call was refused: the other waits for rank 1 until then, so it is inside.
    deadline = time.monotonic() + 4.0
    while not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    one = threading.Thread(target=call, args=("rank 1", 1))
    one.start()
    for t in [*zeros, one]:
        t.join()
    assert len(errors) == 1 and set(got) | set(errors) == {"a", "b", "rank 1"}, (errors, list(got))
    refused = next(iter(errors))
    assert "rank 0: another thread is inside a call on this rank's row" in errors[refused]
    kept = "b" if refused == "a" else "a"
    assert torch.equal(got[kept][0][0][0, :3], xs[kept])  # every id is expert 0: rank 0 receives its own rows


def test_initialize_of_a_row_inside_a_call_is_refused():
    """moe_a2a_initialize of rank 0's row while another thread's dispatch on
    that row waits for rank 1: refused, naming the cause, where it zeroed the
    row under the waiting call (which, with its peers, then waited out the
    timeout); the dispatch completes its round once rank 1 arrives."""
    import time

    ep_size, tokens, top_k, num_experts = 2, 4, 2, 4
    sim = a2a.SimulatedEP(ep_size, tokens, dispatch_bytes_per_token=64, combine_bytes_per_token=64, timeout_s=5.0)
    ids = torch.zeros(3, top_k, dtype=torch.int32)  # every id expert 0: rank 0 receives its own rows

    def dispatch(rank, value):
        return a2a.moe_a2a_dispatch(ids, [torch.full((3, 8), value)], sim.workspace, sim.metainfo[rank], tokens, rank,
                                    ep_size, top_k, num_experts)

    def first_round(rank):
        (recv,), offset, _ = dispatch(rank, 1.0)
        a2a.moe_a2a_combine(recv.clone(), 3, sim.workspace, sim.metainfo[rank], tokens, rank, ep_size, top_k, offset)
        return recv  # rank 0's: its plane of its own rows, a workspace view

    plane = sim.run(first_round)[0][0]  # rank 0's rows from itself
    got = {}
    zero = threading.Thread(target=lambda: got.setdefault(0, dispatch(0, 7.0)))
    zero.start()
    deadline = time.monotonic() + 4.0
    while not torch.equal(plane[:3], torch.full((3, 8), 7.0)) and time.monotonic() < deadline:
        time.sleep(0.01)  # rank 0's dispatch wrote its rows: it is inside, waiting for rank 1
    assert torch.equal(plane[:3], torch.full((3, 8), 7.0)), "rank 0's dispatch was not seen inside its call"
    with pytest.raises(RuntimeError, match="rank 0: another thread is inside a call on this rank's row of the "
                                           "workspace; initialize the row once that call has returned"):
        a2a.moe_a2a_initialize(sim.workspace, 0, ep_size, tokens)
    one = threading.Thread(target=lambda: got.setdefault(1, dispatch(1, 3.0)))
    one.start()
    for t in (zero, one):
        t.join()
    assert set(got) == {0, 1}
    assert torch.equal(got[0][0][0][0, :3], torch.full((3, 8), 7.0))


THREAD_HINT = "need a thread each"
OTHER_INIT_HINT = "hold another initialization of their rows than this rank's: moe_a2a_initialize is collective"


def test_a_late_first_dispatch_fails_at_once_on_a_peer_that_failed(device):
    """Rank 0's first dispatch times out waiting for rank 1, which starts
    late: rank 1's first dispatch then finds rank 0 failed (its error recorded
    since the initialization both ranks made) and ends within the error
    check's delay, naming it, instead of waiting out its own timeout for a
    rank that calls nothing until it is initialized again."""
    import time

    ep_size, tokens, top_k, num_experts = 2, 4, 2, 4
    sim = a2a.SimulatedEP(ep_size, tokens, dispatch_bytes_per_token=64, combine_bytes_per_token=64, device=device,
                          timeout_s=1.0)
    gen = make_generator(7)
    ids = reference.random_routing(tokens, top_k, num_experts, gen).to(device)
    x = torch.randn(tokens, 8, generator=gen).to(device)

    def dispatch(rank):
        a2a.moe_a2a_dispatch(ids, [x], sim.workspace, sim.metainfo[rank], tokens, rank, ep_size, top_k, num_experts)
        if device != "cpu":
            torch.cuda.synchronize()

    if device == "cpu":
        with pytest.raises(RuntimeError, match=r"rank 0: peers \[1\] did not arrive within 1(\.0)? s") as error:
            dispatch(0)
        assert OTHER_INIT_HINT not in str(error.value)  # rank 1 is late, its row initialized with rank 0's
    else:
        dispatch(0)
    start = time.monotonic()
    if device == "cpu":
        with pytest.raises(RuntimeError, match=r"rank 1: peers \[0\] failed earlier .*in its dispatch\)") as error:
            dispatch(1)
        assert THREAD_HINT not in str(error.value)
    else:
        dispatch(1)
    assert time.monotonic() - start < 0.5
    with pytest.raises(RuntimeError, match=r"rank 0: peers \[1\] did not arrive within 1(\.0)? s"):
        a2a.check_errors(sim.workspace)
    assert "failed earlier" in errors.row_error(sim.workspace, 1)




def test_a_sub_millisecond_timeout_is_reported_as_one_millisecond():
    """A timeout of 0.4 ms is recorded in whole milliseconds: as 1 ms (it
    read 'within 0.0 s')."""
    sim = a2a.SimulatedEP(2, 4, dispatch_bytes_per_token=64, combine_bytes_per_token=64, timeout_s=0.0004)
    ids = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"rank 0: peers \[1\] did not arrive within 0\.001 s \(dispatch\)"):
        a2a.moe_a2a_dispatch(ids, [torch.ones(2, 8)], sim.workspace, sim.metainfo[0], 4, 0, 2, 2, 4)


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_a_timeout_between_rank_threads_says_nothing_of_threads(op):
    """Inside SimulatedEP.run every rank has its thread: a peer that skips a
    call (rank 1 here) times its peers out with the plain message, not the
    one-thread loop's hint."""
    ep_size, tokens, top_k, num_experts = 2, 4, 2, 4
    sim = a2a.SimulatedEP(ep_size, tokens, dispatch_bytes_per_token=64, combine_bytes_per_token=64, timeout_s=0.3)
    gen = make_generator(5)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    x = torch.randn(tokens, 8, generator=gen)

    def step(rank):
        if op == "dispatch" and rank == 1:
            return None
        (rows,), offset, _ = a2a.moe_a2a_dispatch(ids, [x], sim.workspace, sim.metainfo[rank], tokens, rank, ep_size,
                                                   top_k, num_experts)
        if rank == 1:
            return None
        return a2a.moe_a2a_combine(rows.clone(), tokens, sim.workspace, sim.metainfo[rank], tokens, rank, ep_size,
                                   top_k, offset)

    with pytest.raises(RuntimeError, match=r"rank 0: peers \[1\] did not arrive within 0.3 s \(" + op + r"\)") as error:
        sim.run(step)
    assert THREAD_HINT not in str(error.value)
    assert OTHER_INIT_HINT not in str(error.value)


def test_a_peer_row_never_initialized_is_named():
    """A rank whose row was never initialized (moe_a2a_initialize forgotten
    for it) keeps its peers' first dispatch waiting: the timeout says so."""
    ep_size, tokens, top_k, num_experts = 3, 4, 2, 6
    workspace = torch.zeros(ep_size, a2a.moe_a2a_get_workspace_size_per_rank(ep_size, tokens, 64, 64),
                            dtype=torch.uint8)
    metainfo = [a2a.moe_a2a_initialize(workspace, r, ep_size, tokens, timeout_s=0.3) for r in (0, 1)]
    gen = make_generator(6)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    x = torch.randn(tokens, 8, generator=gen)
    results = [None, None]

    def dispatch(rank):
        try:
            a2a.moe_a2a_dispatch(ids, [x], workspace, metainfo[rank], tokens, rank, ep_size, top_k, num_experts)
        except RuntimeError as e:
            results[rank] = str(e)

    threads = [threading.Thread(target=dispatch, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank in (0, 1):
        assert results[rank] is not None, f"rank {rank} returned"
        assert f"rank {rank}: peers [2] did not arrive within 0.3 s (dispatch)" in results[rank], results[rank]
        assert "peers [2] have not initialized their rows (moe_a2a_initialize" in results[rank], results[rank]
        assert THREAD_HINT not in results[rank]


@pytest.mark.parametrize("caller", ["re-initialized", "other"])
@pytest.mark.parametrize("collective_first", [False, True], ids=["first-initialize", "after-a-collective-one"])
def test_a_rank_initialized_alone_is_named(caller, collective_first):
    """Rank 1 initializes again alone after a round (its peer does not): a
    dispatch of either rank then waits for a peer whose row holds another
    initialization than its own, and the timeout says so, whether the
    workspace's rows were initialized once before or also again together."""
    ep_size, tokens, top_k, num_experts = 2, 4, 2, 4
    workspace = torch.zeros(ep_size, a2a.moe_a2a_get_workspace_size_per_rank(ep_size, tokens, 64, 64),
                            dtype=torch.uint8)
    gen = make_generator(7)
    ids = reference.random_routing(tokens, top_k, num_experts, gen)
    x = torch.randn(tokens, 8, generator=gen)

    def initialize(ranks):
        return [a2a.moe_a2a_initialize(workspace, r, ep_size, tokens, timeout_s=0.3) for r in ranks]

    def round_of(metainfo):
        def step(rank):
            recv = a2a.moe_a2a_dispatch(ids, [x], workspace, metainfo[rank], tokens, rank, ep_size, top_k,
                                        num_experts)
            a2a.moe_a2a_combine(recv[0][0].clone(), tokens, workspace, metainfo[rank], tokens, rank, ep_size,
                                top_k, recv[1])

        threads = [threading.Thread(target=step, args=(r,)) for r in range(ep_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    metainfo = initialize(range(ep_size))
    round_of(metainfo)
    if collective_first:
        metainfo = initialize(range(ep_size))
        round_of(metainfo)
    metainfo[1] = initialize([1])[0]
    rank = 1 if caller == "re-initialized" else 0
    with pytest.raises(RuntimeError) as error:
        a2a.moe_a2a_dispatch(ids, [x], workspace, metainfo[rank], tokens, rank, ep_size, top_k, num_experts)
    message = str(error.value)
    assert f"rank {rank}: peers [{1 - rank}] did not arrive within 0.3 s (dispatch)" in message, message
    assert f"peers [{1 - rank}] {OTHER_INIT_HINT}" in message, message
    assert THREAD_HINT not in message, message


# (ep_size, runtime_max, eplb_n, payload trailing shapes and dtypes, tokens)
RECEIVE_VIEW_CASES = [
    (1, 1, 0, [((8,), torch.bfloat16)], 1),
    (3, 5, 7, [((16,), torch.float16), ((4,), torch.int32), ((4,), torch.float32)], 5),
    (4, 6, 0, [((2, 3), torch.float8_e4m3fn), ((7,), torch.uint8), ((), torch.int64)], 0),
    (2, 3, 2, [((5, 2, 2), torch.float32)], 2),
]


@pytest.mark.parametrize("case", RECEIVE_VIEW_CASES,
                         ids=[f"ep{c[0]}-T{c[1]}-eplb{c[2]}-{len(c[3])}p" for c in RECEIVE_VIEW_CASES])
def test_eager_receive_views_equal_traced_ones(case, device):
    """The C++ builder of the eager path (_C.receive_views) and the view ops of
    the traced path give the same views: shape, strides, dtype, address, and
    the same storage as the workspace."""
    from torch_moe_a2a import _C
    from torch_moe_a2a.fastpath import traced_receive_views

    ep, T, eplb_n, specs, tokens = case
    payloads = [torch.empty((tokens, *shape), dtype=dtype, device=device) for shape, dtype in specs]
    row_bytes = [p.element_size() * math.prod(p.shape[1:]) for p in payloads]
    size = layout.workspace_size_per_rank(ep, T, sum(row_bytes), 16, eplb_n)
    workspace = torch.zeros((ep, size), dtype=torch.uint8, device=device)
    for rank in range(ep):
        eager = _C.receive_views(workspace, rank, ep, T, eplb_n, payloads)
        traced = traced_receive_views(workspace, rank, ep, T, eplb_n, payloads)
        assert eager[1] == traced[1] == layout.call_layout(ep, T, eplb_n, tuple(row_bytes)).combine_offset
        pairs = list(zip(eager[0], traced[0])) + ([(eager[2], traced[2])] if eplb_n else [])
        assert len(pairs) == len(payloads) + (1 if eplb_n else 0)
        assert (eager[2] is None) == (eplb_n == 0)
        for e, t in pairs:
            assert (e.shape, e.stride(), e.dtype, e.data_ptr()) == (t.shape, t.stride(), t.dtype, t.data_ptr())
            assert e.untyped_storage().data_ptr() == workspace.untyped_storage().data_ptr()
            # Made by view ops (DESIGN.md section 4): a view that shares the
            # workspace's version counter, so autograd sees the ops' writes.
            assert e._is_view()
            version = e._version
            workspace[rank, :1].add_(0)
            assert e._version == version + 1


def test_ops_bump_the_version_of_what_they_write(device):
    """Every op that writes the workspace (and combine_into its output) bumps
    its version counter, as ATen's in-place ops do: a backward that saved a
    receive view which a later dispatch overwrote fails loudly instead of
    computing with the new bytes. Inference tensors have no counter and
    still work outside inference mode."""
    T, k, E, hidden = 4, 2, 4, 6
    size = a2a.moe_a2a_get_workspace_size_per_rank(1, T, hidden * 4 + k * 4, hidden * 4)
    gen = torch.Generator().manual_seed(12)
    ids = torch.randint(0, E, (3, k), generator=gen, dtype=torch.int32).to(device)
    x = torch.randn((3, hidden), generator=gen).to(device)
    ws = torch.zeros((1, size), dtype=torch.uint8, device=device)

    def bumps(call, tensor):
        version = tensor._version
        result = call()
        assert tensor._version == version + 1
        return result

    meta = bumps(lambda: a2a.moe_a2a_initialize(ws, 0, 1, T), ws)
    (rx, rids), offset, _ = bumps(lambda: a2a.moe_a2a_dispatch(ids, [x, ids], ws, meta, T, 0, 1, k, E), ws)
    bumps(lambda: a2a.moe_a2a_sanitize_expert_ids(rids, ws, meta, 0, -1), ws)
    weight = torch.randn((hidden,), generator=gen).to(device).requires_grad_()
    saved = rx * weight  # autograd saves rx, a view of the workspace
    out = torch.empty((3, hidden), device=device)
    bumps(lambda: a2a.moe_a2a_combine(rx, 3, ws, meta, T, 0, 1, k, offset, output=out), out)
    bumps(lambda: a2a.moe_a2a_dispatch(ids, [2 * x, ids], ws, meta, T, 0, 1, k, E), ws)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()
    bumps(lambda: a2a.moe_a2a_combine(rx, 3, ws, meta, T, 0, 1, k, offset), ws)

    with torch.inference_mode():
        frozen = torch.zeros((1, size), dtype=torch.uint8, device=device)
    meta = a2a.moe_a2a_initialize(frozen, 0, 1, T)
    (rx, _), offset, _ = a2a.moe_a2a_dispatch(ids, [x, ids], frozen, meta, T, 0, 1, k, E)
    assert torch.equal(a2a.moe_a2a_combine(rx, 3, frozen, meta, T, 0, 1, k, offset), x)


def test_dispatch_modes_trace_the_receive_views(device):
    """Under a dispatch mode the receive views are built by view ops the mode
    sees: FakeTensorMode gives fake views of the right shapes (and leaves the
    real workspace alone), and make_fx records them from its workspace
    argument, so a graph traced on one workspace runs right on another."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    T, k, E, hidden = 4, 2, 4, 6
    size = a2a.moe_a2a_get_workspace_size_per_rank(1, T, hidden * 4 + k * 4, hidden * 4)

    def fresh(storage_offset=0):
        # A workspace at `storage_offset` bytes into its storage.
        ws = torch.zeros((storage_offset + size,), dtype=torch.uint8, device=device)[storage_offset:].view(1, size)
        return ws, a2a.moe_a2a_initialize(ws, 0, 1, T)

    cache: dict = {}

    def step(ids, x, ws, meta):
        (rx, _), offset, _ = a2a.moe_a2a_dispatch(ids, [x, ids], ws, meta, T, 0, 1, k, E, recv_view_cache=cache)
        return a2a.moe_a2a_combine(rx * 3.0, ids.shape[0], ws, meta, T, 0, 1, k, offset)

    gen = torch.Generator().manual_seed(11)

    def inputs():
        ids = torch.randint(0, E, (3, k), generator=gen, dtype=torch.int32).to(device)
        return ids, torch.randn((3, hidden), generator=gen).to(device)

    ws, meta = fresh()
    before = ws.clone()
    with FakeTensorMode() as mode:
        fake_ws = mode.from_tensor(ws)
        ids = torch.empty((3, k), dtype=torch.int32, device=device)
        x = torch.empty((3, 5, 2), dtype=torch.bfloat16, device=device)
        views, offset, _ = a2a.moe_a2a_dispatch(ids, [x, ids], fake_ws, meta, T, 0, 1, k, E)
        assert all(isinstance(v, FakeTensor) for v in views)
        assert [(tuple(v.shape), v.dtype) for v in views] == [((1, T, 5, 2), torch.bfloat16), ((1, T, k), torch.int32)]
        out = a2a.moe_a2a_combine(views[0].float(), 3, fake_ws, meta, T, 0, 1, k, offset)
        assert isinstance(out, FakeTensor) and tuple(out.shape) == (3, 5, 2) and out.dtype == torch.float32
    assert torch.equal(ws, before)

    # Traced on a workspace whose views the cache already holds from an eager
    # call: the trace must not take them from there (they would be constants).
    ws, meta = fresh()
    step(*inputs(), ws, meta)
    traced = make_fx(step)(*inputs(), ws, meta)
    ids, x = inputs()
    expected = 3.0 * x  # ep 1: every token's one destination is this rank
    for run in (traced, step):
        for storage_offset in (0, 1024):  # views relative to the workspace, not to its storage
            cache.clear()
            got = run(ids, x, *fresh(storage_offset))
            assert torch.equal(got, expected)
    # A fake or symbolic trace makes its inputs fake, the metainfo too, whose
    # values the call needs as constants: the message says to close over it.
    ws, meta = fresh()
    for mode in ("fake", "symbolic"):
        with pytest.raises(ValueError, match="metainfo is a fake tensor .* from outside the traced function "
                                             r"\(close over it\)"):
            make_fx(step, tracing_mode=mode)(*inputs(), ws, meta)
        traced = make_fx(lambda ids, x, ws: step(ids, x, ws, meta), tracing_mode=mode)(*inputs(), ws)
        ids, x = inputs()
        assert torch.equal(traced(ids, x, ws), 3.0 * x)


# ---- the two eager paths --------------------------------------------------------------------

class _OpRecorder(torch.overrides.TorchFunctionMode):
    """Records the moe_a2a operators a call reaches through torch.ops."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if "moe_a2a" in str(getattr(func, "_schema", "")):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


class _NoTorchOps:
    """Stands in for torch.ops.moe_a2a: any use fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"eager call went through torch.ops.moe_a2a.{name}")


@pytest.mark.parametrize("payload_in_workspace", [False, True])
def test_eager_calls_skip_torch_ops(monkeypatch, payload_in_workspace, device):
    """Plain tensors, no TorchFunctionMode: the wrapper calls the operators
    through _C (the C++ dispatcher), never through torch.ops, and the round
    trip (recv_view_cache too) equals the reference."""
    case = Case(3, (5, 0, 7), 3, 9, extras=(PayloadSpec(torch.float16, (2, 3)),))
    sim = make_sim(case, device)
    gen = make_generator("direct")
    monkeypatch.setattr(a2a.api, "_ops", _NoTorchOps())
    round_trip(sim, case, make_inputs(case, gen), gen, payload_in_workspace=payload_in_workspace)
    round_trip(sim, case, make_inputs(case, gen), gen, use_output=True)
    a2a.check_errors(sim.workspace)


def test_torch_function_mode_sees_torch_ops(monkeypatch, device):
    """Under a TorchFunctionMode (entered where each rank calls: modes are
    per thread) the wrapper calls torch.ops, so the mode sees dispatch and
    combine of every rank, with the same results."""
    case = Case(2, (4, 6), 2, 4)
    sim = make_sim(case, device)
    gen = make_generator("mode")
    recorder = _OpRecorder()
    run = sim.run

    def run_under_mode(fn):
        def call(rank):
            with recorder:
                return fn(rank)
        return run(call)

    monkeypatch.setattr(sim, "run", run_under_mode)
    round_trip(sim, case, make_inputs(case, gen), gen)
    round_trip(sim, case, make_inputs(case, gen), gen, use_output=True)
    expected = ["dispatch.default"] * 4 + ["combine.default"] * 2 + ["combine_into.default"] * 2
    assert sorted(recorder.ops) == sorted(expected), recorder.ops


@pytest.mark.parametrize("ep_size", [1, 3])
def test_int64_expert_ids_route_as_int32(ep_size, device):
    """torch.topk's int64 indices dispatch without a conversion: the same
    counts and combine as the int32 ids."""
    case = Case(ep_size, (5, 0, 7)[:ep_size], 4, 10, hidden=32, negative_fraction=0.1, invalid_fraction=0.05)
    x = make_inputs(case, make_generator(f"int64-{ep_size}"))
    results = []
    for id_dtype in (torch.int32, torch.int64):
        ids = [t.to(id_dtype) for t in x.ids]
        # Each round trip is checked against the reference; then against each other.
        results.append(round_trip(make_sim(case, device), case, type(x)(ids, x.payloads),
                                  make_generator(f"poison-{id_dtype}")))
    for a, b in zip(results[0].outputs, results[1].outputs):
        assert_bytes_equal(a, b, "combine output")
    for r in range(ep_size):
        assert torch.equal(results[0].counts[r], results[1].counts[r])


def test_a_default_device_leaves_the_host_tensors_on_the_cpu():
    """Model code builds its layers under ``with torch.device("cuda")`` (or
    ``torch.set_default_device``): the metainfo and the rank mask are still
    the CPU tensors the ops read on the host, and a round trip built there
    works. The meta device stands for the GPU here."""
    gen = make_generator("default-device")
    ep_size, tokens, hidden, num_experts, top_k = 2, 6, 16, 4, 2
    ids = [torch.randint(0, num_experts, (tokens, top_k), generator=gen, dtype=torch.int32) for _ in range(ep_size)]
    x = [torch.randn(tokens, hidden, generator=gen, device="cpu") for _ in range(ep_size)]
    with torch.device("meta"):
        mask = a2a.moe_a2a_active_rank_mask([0, 1], ep_size)
        sim = a2a.SimulatedEP(ep_size, tokens, dispatch_bytes_per_token=4 * hidden,
                              combine_bytes_per_token=4 * hidden, timeout_s=10)
        moe = a2a.MoeAlltoAll(a2a.Mapping(), tokens, top_k, num_experts, hidden_size=hidden, device="cpu",
                              dtype=torch.float32)
    assert mask.device.type == "cpu" and mask.tolist()[0] == 3
    assert all(m.device.type == "cpu" for m in sim.metainfo) and moe.metainfo.device.type == "cpu"

    def rank_round_trip(r):
        recv, offset, _ = sim.dispatch_rank(r, ids[r], [x[r]], tokens, top_k, num_experts)
        return sim.combine_rank(r, recv[0] * 2, tokens, tokens, top_k, offset)

    with torch.device("meta"):
        outs = sim.run(rank_round_trip)
        (recv,) = moe.dispatch(ids[0], [x[0]], tokens)
        out = moe.combine(recv * 2, tokens)
    destinations = [(i // 2).sort(dim=1).values.diff(dim=1).ne(0).sum(dim=1) + 1 for i in ids]  # experts 0-1: rank 0
    for r in range(ep_size):
        torch.testing.assert_close(outs[r], x[r] * 2 * destinations[r][:, None], rtol=0, atol=0)
    torch.testing.assert_close(out, x[0] * 2, rtol=0, atol=0)


def test_output_payload_layouts_as_flashinfers_keyword():
    """vLLM's FlashInfer path passes ``MoeAlltoAll.dispatch(...,
    output_payload_layouts=...)``: None, or FlashInfer's ``MoeA2APayloadLayout``
    per payload, ``R128C4`` tiles for the scales when it asks for them. None and
    all ``LINEAR`` dispatch as without the keyword; another layout, or a list of
    another length, is refused before anything is sent."""
    import enum

    layout = enum.Enum("MoeA2APayloadLayout", ["LINEAR", "R128C4"])
    gen = make_generator("payload-layouts")
    tokens, hidden, num_experts, top_k = 4, 16, 4, 2
    ids = torch.randint(0, num_experts, (tokens, top_k), generator=gen, dtype=torch.int32)
    x = torch.randn(tokens, hidden, generator=gen)
    moe = a2a.MoeAlltoAll(a2a.Mapping(), tokens, top_k, num_experts, hidden_size=hidden, device="cpu",
                          dtype=torch.float32)
    for layouts, error in (([layout.LINEAR, layout.R128C4], NotImplementedError), ([layout.LINEAR], ValueError)):
        with pytest.raises(error, match="output_payload_layouts"):
            moe.dispatch(ids, [x, ids], tokens, output_payload_layouts=layouts)
    for layouts in (None, [layout.LINEAR, "LINEAR"]):
        recv = moe.dispatch(ids, [x, ids], tokens, output_payload_layouts=layouts)
        torch.testing.assert_close(moe.combine(recv[0] * 2, tokens), x * 2, rtol=0, atol=0)


def test_simulated_ep_takes_a_row_size_or_bytes_per_token():
    """A workspace_size_per_rank stands for the bytes per token (the README's
    expert-major examples passed 0 for both beside it); without it both are
    needed, and each is an int where given."""
    size = a2a.moe_a2a_get_workspace_size_per_rank(2, 4, 64, 64)
    assert a2a.SimulatedEP(2, 4, workspace_size_per_rank=size).workspace.shape == (2, size)
    assert a2a.SimulatedEP(2, 4, dispatch_bytes_per_token=64, combine_bytes_per_token=64).workspace.shape == (2, size)
    for kwargs in ({}, {"dispatch_bytes_per_token": 64}, {"combine_bytes_per_token": 64}):
        with pytest.raises(ValueError, match=r"SimulatedEP: dispatch_bytes_per_token and combine_bytes_per_token "
                                             r"size the workspace; give both, or workspace_size_per_rank"):
            a2a.SimulatedEP(2, 4, **kwargs)
    with pytest.raises(ValueError, match=r"dispatch_bytes_per_token must be an int"):
        a2a.SimulatedEP(2, 4, dispatch_bytes_per_token=1.5, workspace_size_per_rank=size)
