"""dispatch -> small MoE -> combine under torch.compile(fullgraph=True): equal to
eager bitwise, and the generated code never copies the workspace (DESIGN.md
section 4)."""

import re

import pytest
import torch
from conftest import Case, PayloadSpec, assert_bytes_equal, ep_mapping, make_generator, make_inputs, make_sim
from torch._inductor.utils import run_and_get_code

import torch_moe_a2a as a2a


def moe_step(ids, payloads, workspace, metainfo, T, ep_rank, ep_size, top_k, num_experts, local_num_tokens):
    """One layer's exchange with a stand-in MoE that is exact in any evaluation
    order (one multiply per element, then one cast), so eager and compiled agree
    bitwise. payload_in_workspace=False: a traced write into a workspace view would
    make Inductor copy the workspace."""
    recv, offset, _ = a2a.moe_a2a_dispatch(ids, payloads, workspace, metainfo, T, ep_rank, ep_size, top_k,
                                           num_experts)
    hidden, weights = recv[0], recv[2]
    expert_out = (hidden.float() * weights[..., :1]).to(hidden.dtype)
    return a2a.moe_a2a_combine(expert_out, local_num_tokens, workspace, metainfo, T, ep_rank, ep_size, top_k,
                               offset)


def wrapped_step(ids, payloads, workspace, metainfo, T, ep_rank, ep_size, top_k, num_experts, local_num_tokens):
    """moe_step through FlashInfer's functional zero-copy path: the expert
    outputs written into the buffer moe_a2a_wrap_payload_tensor_in_workspace
    gives for the combine region (traced, a copy of its bytes), then combined
    with payload_in_workspace=True."""
    recv, offset, _ = a2a.moe_a2a_dispatch(ids, payloads, workspace, metainfo, T, ep_rank, ep_size, top_k,
                                           num_experts)
    hidden, weights = recv[0], recv[2]
    expert_out = (hidden.float() * weights[..., :1]).to(hidden.dtype)
    end = offset + ep_size * T * expert_out.shape[-1] * expert_out.element_size()
    buf = a2a.moe_a2a_wrap_payload_tensor_in_workspace(workspace[ep_rank], [ep_size, T], offset, end,
                                                       expert_out.dtype)
    buf.copy_(expert_out)
    return a2a.moe_a2a_combine(buf, local_num_tokens, workspace, metainfo, T, ep_rank, ep_size, top_k, offset,
                               payload_in_workspace=True)


def _assert_no_workspace_copy(codes, workspace):
    rows, size = workspace.shape
    text = "\n".join(codes)
    assert "moe_a2a.dispatch" in text and "moe_a2a.combine" in text, "the ops must be called from the compiled code"
    for line in text.splitlines():
        if re.search(r"empty_strided|empty\(|\.clone\(|copy_\(", line):
            assert not re.search(rf"\b({size}|{rows * size})\b", line), f"workspace-sized buffer or copy: {line.strip()}"
    assert "aten.copy_" not in text, "the compiled code writes into the workspace with copy_"


def test_compiled_single_rank_equals_eager(device):
    torch._dynamo.reset()
    # With a payload of 0 bytes per token: its receive view is traced too.
    case = Case(1, (13,), 4, 9, hidden=96, runtime_max=16, max_num_tokens=16,
                extras=(PayloadSpec(torch.float16, (0,)),))
    sim = make_sim(case, device)
    inputs = make_inputs(case, make_generator(0)).to(device)
    args = (inputs.ids[0], inputs.payloads[0], sim.workspace, sim.metainfo[0], case.T, 0, 1, case.top_k,
            case.num_experts, 13)
    eager = moe_step(*args).cpu()
    compiled = torch.compile(moe_step, fullgraph=True)
    out, codes = run_and_get_code(compiled, *args)
    assert_bytes_equal(out, eager, "compiled vs eager")
    _assert_no_workspace_copy(codes, sim.workspace)
    # Run again (no recompilation needed) on the same workspace: still equal.
    assert_bytes_equal(compiled(*args), eager, "second compiled call")


@pytest.mark.parametrize("path", ["functional", "functional_in_workspace", "moe_alltoall"])
def test_compiled_two_simulated_ranks_equal_eager(path, device):
    """moe_step, wrapped_step, or moe_alltoall_step with its buffer from
    get_combine_payload_tensor_in_workspace (traced, both buffers are copies of
    the region). A compiled step that copied the workspace would run the ops on
    a private copy, and the ranks would time out waiting for each other."""
    if device == "cuda":
        # Each rank runs (and first compiles) its whole step on the one host
        # thread that launches every simulated rank: rank 1's compilation
        # synchronizes the device while rank 0's dispatch spins for rank 1.
        pytest.skip("a compiled multi-rank step per rank needs a host thread per rank on CUDA")
    torch._dynamo.reset()
    case = Case(2, (7, 12), 3, 6, hidden=64, runtime_max=12)
    sim = make_sim(case, device)
    inputs = make_inputs(case, make_generator(1)).to(device)
    if path != "moe_alltoall":
        step = moe_step if path == "functional" else wrapped_step

        def args(r):
            return (inputs.ids[r], inputs.payloads[r], sim.workspace, sim.metainfo[r], case.T, r, 2, case.top_k,
                    case.num_experts, case.tokens[r])
    else:
        step = moe_alltoall_step
        moes = [a2a.MoeAlltoAll(ep_mapping(r, 2), case.max_tokens, case.top_k, case.num_experts,
                                workspace=sim.workspace, timeout_s=10.0) for r in range(2)]

        def args(r):
            return (moes[r], inputs.ids[r], inputs.payloads[r], case.T)

    eager = [o.cpu() for o in sim.run(lambda r: step(*args(r)))]
    compiled = torch.compile(step, fullgraph=True)
    # Each rank compiles its own graph (ep_rank and metainfo differ) from its own
    # thread, while its peer waits inside the op.
    for _ in range(2):
        outs = sim.run(lambda r: compiled(*args(r)))
        for r in range(2):
            assert_bytes_equal(outs[r], eager[r], f"rank {r}")


def moe_alltoall_step(moe, ids, payloads, T):
    """moe_step through MoeAlltoAll, the expert outputs written where
    get_combine_payload_tensor_in_workspace says (FlashInfer's zero-copy path)."""
    recv = moe.dispatch(ids, payloads, T)
    hidden, weights = recv[0], recv[2]
    expert_out = (hidden.float() * weights[..., :1]).to(hidden.dtype)
    buf = moe.get_combine_payload_tensor_in_workspace(T, expert_out.shape[-1], expert_out.dtype)
    buf.copy_(expert_out)
    return moe.combine(buf, T, payload_in_workspace=True)


def test_compiled_moe_alltoall_steps_do_not_recompile(device):
    """A compiled step through a MoeAlltoAll, called step after step: its round
    bookkeeping must not be a guard that every step fails (the round counter
    was, and the twelfth step hit the recompile limit under fullgraph)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # the other tests' graphs counted too
    case = Case(1, (8,), 2, 4, hidden=32, runtime_max=8, max_num_tokens=8)
    moe = a2a.MoeAlltoAll(ep_mapping(0, 1), case.max_tokens, case.top_k, case.num_experts,
                          hidden_size=case.hidden, device=device)
    inputs = make_inputs(case, make_generator("steps")).to(device)
    eager = moe_alltoall_step(moe, inputs.ids[0], inputs.payloads[0], case.T).cpu()
    # dynamic=False: an int that changes is then a guard, not a symbol (as for
    # an instance held by a module or a global under the default).
    compiled = torch.compile(moe_alltoall_step, backend="eager", fullgraph=True, dynamic=False)
    for step in range(12):
        assert_bytes_equal(compiled(moe, inputs.ids[0], inputs.payloads[0], case.T), eager, f"step {step}")
    # Eager steps between compiled ones advance the eager round counter, which
    # traced code must not read either.
    for step in range(12):
        fn = compiled if step % 2 else moe_alltoall_step
        assert_bytes_equal(fn(moe, inputs.ids[0], inputs.payloads[0], case.T), eager, f"alternating step {step}")
    assert counters["stats"]["unique_graphs"] <= 2, counters["stats"]


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("path", ["functional", "moe_alltoall"])
def test_compiled_in_workspace_payload_copies_no_workspace(path, dynamic, device):
    """Traced, the combine buffer (from moe_a2a_wrap_payload_tensor_in_workspace
    or MoeAlltoAll.get_combine_payload_tensor_in_workspace) is a tensor of its
    own that combine stages: the MoE's write is no write into a workspace view,
    so the compiled code copies no workspace. With dynamic=True too, where the
    workspace's stride is a symbol (the buffer's row and offset were a divmod
    of it, which torch.compile refused)."""
    torch._dynamo.reset()
    case = Case(1, (13,), 4, 9, hidden=96, runtime_max=16, max_num_tokens=16)
    inputs = make_inputs(case, make_generator(2)).to(device)
    if path == "functional":
        sim = make_sim(case, device)
        step, workspace = wrapped_step, sim.workspace
        args = (inputs.ids[0], inputs.payloads[0], workspace, sim.metainfo[0], case.T, 0, 1, case.top_k,
                case.num_experts, 13)
    else:
        moe = a2a.MoeAlltoAll(ep_mapping(0, 1), 16, case.top_k, case.num_experts, hidden_size=96, device=device,
                              workspace_size_per_rank=a2a.moe_a2a_get_workspace_size_per_rank(
                                  1, 16, case.dispatch_bytes, case.combine_bytes))
        step, workspace = moe_alltoall_step, moe.workspace
        args = (moe, inputs.ids[0], inputs.payloads[0], case.T)
    eager = step(*args).cpu()
    out, codes = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=dynamic), *args)
    assert_bytes_equal(out, eager, "compiled vs eager")
    _assert_no_workspace_copy(codes, workspace)



def test_debug_mode_checks_ids_in_the_compiled_graph(monkeypatch, device):
    """MOE_A2A_DEBUG=1 (DESIGN.md section 6) checks the ids of a traced
    dispatch too: the compiled code calls check_expert_ids before the dispatch,
    and an id >= num_experts raises there, the workspace untouched."""
    monkeypatch.setenv("MOE_A2A_DEBUG", "1")
    torch._dynamo.reset()
    case = Case(1, (13,), 4, 9, hidden=96, runtime_max=16, max_num_tokens=16)
    sim = make_sim(case, device)
    inputs = make_inputs(case, make_generator(3)).to(device)
    args = [inputs.ids[0], inputs.payloads[0], sim.workspace, sim.metainfo[0], case.T, 0, 1, case.top_k,
            case.num_experts, 13]
    compiled = torch.compile(moe_step, fullgraph=True)
    _, codes = run_and_get_code(compiled, *args)
    text = "\n".join(codes)
    assert text.index("moe_a2a.check_expert_ids") < text.index("moe_a2a.dispatch"), "checked before it dispatches"
    bad = inputs.ids[0].clone()
    bad[7, 2] = case.num_experts
    before = sim.workspace.clone()
    args[0] = bad
    with pytest.raises(ValueError, match=re.escape(
            f"MOE_A2A_DEBUG: token_selected_experts[7, 2] = {case.num_experts} is >= num_experts")):
        compiled(*args)
    assert torch.equal(sim.workspace, before), "the failed call wrote into the workspace"


def test_compiled_step_keeping_a_receive_view_copy(device):
    """The README's advice for receive rows kept past the combine: copy them
    before the combine with an op Inductor keeps (index_select). (A clone()
    there becomes a view of the workspace read after the combine, and the step
    copies the workspace, torch 2.13; a copy after the combine may already
    hold a peer's next dispatch.) The compiled step copies no workspace, equals
    eager, and what it kept is its own memory: a later dispatch of other data
    leaves it as it was."""
    torch._dynamo.reset()
    T, k, E, hidden = 6, 2, 7, 16
    size = a2a.moe_a2a_get_workspace_size_per_rank(1, T, hidden * 4 + k * 4, hidden * 4)
    workspace = torch.zeros((1, size), dtype=torch.uint8, device=device)
    metainfo = a2a.moe_a2a_initialize(workspace, 0, 1, T)
    gen = make_generator(3)
    ids = torch.randint(-1, E, (5, k), generator=gen, dtype=torch.int32).to(device)
    x = torch.randn((5, hidden), generator=gen).to(device)

    def step(ids, x, workspace, metainfo):
        recv, offset, _ = a2a.moe_a2a_dispatch(ids, [x, ids], workspace, metainfo, T, 0, 1, k, E)
        kept = recv[1].index_select(0, torch.arange(recv[1].shape[0], device=recv[1].device))
        out = a2a.moe_a2a_combine(recv[0] * 2, 5, workspace, metainfo, T, 0, 1, k, offset)
        return out, kept

    eager = [t.cpu() for t in step(ids, x, workspace, metainfo)]
    (out, kept), codes = run_and_get_code(torch.compile(step, fullgraph=True), ids, x, workspace, metainfo)
    assert_bytes_equal(out, eager[0], "compiled vs eager output")
    valid = int(a2a.moe_a2a_get_recv_counts(workspace, metainfo, 0)[0])
    assert valid > 0 and torch.equal(kept.cpu()[0, :valid], eager[1][0, :valid]), "the kept receive rows"
    _assert_no_workspace_copy(codes, workspace)
    # Another round with other ids overwrites the receive planes, not what was kept.
    kept_before = kept.clone()
    other = torch.randint(0, E, (5, k), generator=gen, dtype=torch.int32).to(device)
    recv, offset, _ = a2a.moe_a2a_dispatch(other, [x, other], workspace, metainfo, T, 0, 1, k, E)
    a2a.moe_a2a_combine(recv[0], 5, workspace, metainfo, T, 0, 1, k, offset)
    assert not torch.equal(recv[1][0, :valid].cpu(), kept_before[0, :valid].cpu()), "the second round must differ"
    assert torch.equal(kept, kept_before), "the kept rows changed with the workspace"


def quantized_step(ids, payloads, workspace, metainfo, T, ep_rank, ep_size, top_k, num_experts, local_num_tokens,
                   scales, low_precision_block_scales):
    """moe_step with an e4m3 transport and an MXFP8 output in the 128x4 layout."""
    recv, offset, _ = a2a.moe_a2a_dispatch(ids, payloads, workspace, metainfo, T, ep_rank, ep_size, top_k,
                                           num_experts)
    hidden, weights = recv[0], recv[2]
    expert_out = (hidden.float() * weights[..., :1]).to(hidden.dtype)
    return a2a.moe_a2a_combine(expert_out, local_num_tokens, workspace, metainfo, T, ep_rank, ep_size, top_k,
                               offset, output_dtype=torch.float8_e4m3fn, output_scales=scales,
                               sf_layout=a2a.SfLayout.layout_128x4, use_low_precision=True,
                               low_precision_block_scales=low_precision_block_scales)


@pytest.mark.parametrize("block_scales", [False, True])
def test_compiled_low_precision_quantized_equals_eager(block_scales, device):
    torch._dynamo.reset()
    case = Case(1, (13,), 4, 9, hidden=96, runtime_max=16, max_num_tokens=16)
    sim = make_sim(case, device)
    inputs = make_inputs(case, make_generator(2)).to(device)
    scales = [torch.full((128 * 4,), 7, dtype=torch.uint8, device=device) for _ in range(2)]
    args = (inputs.ids[0], inputs.payloads[0], sim.workspace, sim.metainfo[0], case.T, 0, 1, case.top_k,
            case.num_experts, 13)
    eager = quantized_step(*args, scales[0], block_scales).cpu()
    compiled = torch.compile(quantized_step, fullgraph=True)
    out, codes = run_and_get_code(compiled, *args, scales[1], block_scales)
    assert_bytes_equal(out, eager, "compiled vs eager")
    assert_bytes_equal(scales[1], scales[0], "compiled vs eager scales")
    _assert_no_workspace_copy(codes, sim.workspace)


def expert_major_step(ids, payloads, weights, workspace, metainfo, T, ep_rank, ep_size, top_k, num_experts):
    """moe_step in the expert-major layout: a stand-in expert exact in any
    evaluation order on the [num_local_experts, M, H] views, then the weighted combine."""
    got = a2a.moe_a2a_dispatch(ids, payloads, workspace, metainfo, T, ep_rank, ep_size, top_k, num_experts,
                               expert_major=True, router_weights=weights)
    hidden = got.output_payloads[0]
    expert_out = (hidden.float() * 2.0).to(hidden.dtype)
    return a2a.moe_a2a_combine_expert_major(expert_out, got, workspace, metainfo, ep_rank, ep_size)


@pytest.mark.parametrize("ep_size", [1, 2])
def test_compiled_expert_major_equals_eager(ep_size, device):
    if device == "cuda" and ep_size > 1:
        pytest.skip("a compiled multi-rank step per rank needs a host thread per rank on CUDA")
    torch._dynamo.reset()
    case = Case(ep_size, (11, 6)[:ep_size], 3, 7, hidden=64, runtime_max=12)
    size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(ep_size, case.max_tokens, case.combine_bytes,
                                                                case.combine_bytes, case.num_experts, case.top_k)
    sim = a2a.SimulatedEP(ep_size, case.max_tokens, dispatch_bytes_per_token=0, combine_bytes_per_token=0,
                          device=device, workspace_size_per_rank=size)
    inputs = make_inputs(case, make_generator(21)).to(device)

    def args(r):
        return (inputs.ids[r], [inputs.payloads[r][0]], inputs.payloads[r][2], sim.workspace, sim.metainfo[r],
                case.T, r, ep_size, case.top_k, case.num_experts)

    eager = [o.cpu() for o in sim.run(lambda r: expert_major_step(*args(r)))]
    compiled = torch.compile(expert_major_step, fullgraph=True)
    if ep_size == 1:
        out, codes = run_and_get_code(compiled, *args(0))
        assert_bytes_equal(out, eager[0], "compiled vs eager")
        _assert_no_workspace_copy(codes, sim.workspace)
        assert "moe_a2a.dispatch_expert_major" in "\n".join(codes)
    for _ in range(2):
        outs = sim.run(lambda r: compiled(*args(r)))
        for r in range(ep_size):
            assert_bytes_equal(outs[r], eager[r], f"rank {r}")


def test_compile_marks_are_torchs():
    """torch_moe_a2a.compile_marks stands in for torch.compiler.assume_constant_result
    and torch._dynamo.mark_static_address (which import torch._dynamo): each
    must set exactly what torch's sets, or the metainfo, capability and
    rank-mask readers would be traced instead of baked in, and CUDA-graph
    trees would skip graphs that write into the workspace."""
    from torch_moe_a2a.compile_marks import constant_result, mark_static_address

    def ours():
        return 0

    def torchs():
        return 0

    assert constant_result(ours) is ours
    torch.compiler.assume_constant_result(torchs)
    assert vars(torchs) and vars(ours) == vars(torchs)
    ours_t, torchs_t = torch.zeros(2), torch.zeros(2)
    mark_static_address(ours_t)
    torch._dynamo.mark_static_address(torchs_t)
    assert vars(torchs_t) and vars(ours_t) == vars(torchs_t)


def test_sf_layout_as_a_symbolic_int_traces():
    """sf_layout as a plain int that torch.compile makes symbolic (dynamic=True,
    or automatically once it changed) is specialized, not a graph break
    (hasattr on a SymInt is not traceable)."""
    torch._dynamo.reset()
    T, H, k, E = 8, 64, 2, 4
    ws = a2a.allocate_workspace(a2a.moe_a2a_get_workspace_size_per_rank(1, 16, 2 * H + 4 * k, 2 * H), ep_size=1)
    meta = a2a.moe_a2a_initialize(ws, 0, 1, 16)
    gen = make_generator("sf_layout")
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32, generator=gen)

    def step(x, ids, sf_layout):
        (rx, _), off, _ = a2a.moe_a2a_dispatch(ids, [x, ids], ws, meta, T, 0, 1, k, E)
        scales = torch.zeros(128 * 4 if sf_layout == 0 else T * H // 32, dtype=torch.uint8)
        out = a2a.moe_a2a_combine(rx, T, ws, meta, T, 0, 1, k, off, output_dtype=torch.float8_e4m3fn,
                                  output_scales=scales, sf_layout=sf_layout)
        return out.view(torch.uint8), scales

    compiled = torch.compile(step, backend="eager", fullgraph=True, dynamic=True)
    for sf_layout in (0, 2):
        for got, want in zip(compiled(x, ids, sf_layout), step(x, ids, sf_layout)):
            assert torch.equal(got, want), f"sf_layout {sf_layout}"


def test_payload_in_workspace_under_fake_tensor_mode_reads_no_data_pointer():
    """Under FakeTensorMode (no torch.compile) the combine's payload_in_workspace
    check is skipped as when traced: fake tensors have no data pointer (torch
    warns that reading one will become an error)."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    T, H, k, E = 8, 64, 2, 4
    ws = a2a.allocate_workspace(a2a.moe_a2a_get_workspace_size_per_rank(1, T, 2 * H + 4 * k, 2 * H), ep_size=1)
    meta = a2a.moe_a2a_initialize(ws, 0, 1, T)
    x = torch.randn(5, H).to(torch.bfloat16)
    ids = torch.randint(0, E, (5, k), dtype=torch.int32)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mode:
            fws, fx, fids = mode.from_tensor(ws), mode.from_tensor(x), mode.from_tensor(ids)
            (frx, _), off, _ = a2a.moe_a2a_dispatch(fids, [fx, fids], fws, meta, T, 0, 1, k, E)
            buf = a2a.moe_a2a_wrap_payload_tensor_in_workspace(fws[0], [1, T], off, off + T * H * 2, torch.bfloat16)
            buf.copy_(frx * 2)
            out = a2a.moe_a2a_combine(buf, 5, fws, meta, T, 0, 1, k, off, payload_in_workspace=True)
    assert tuple(out.shape) == (5, H) and out.dtype == torch.bfloat16


def test_bad_argument_is_refused_while_traced():
    """The Meta kernels refuse what the real ones refuse: a compiled call with
    a bad argument (here top_k against the ids' columns) fails while it is
    traced, with the op's message, and no graph is built to fail later."""
    T, H, k, E = 8, 64, 2, 4
    ws = a2a.allocate_workspace(a2a.moe_a2a_get_workspace_size_per_rank(1, T, 2 * H + 4 * k, 2 * H), ep_size=1)
    meta = a2a.moe_a2a_initialize(ws, 0, 1, T)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ids = torch.randint(0, E, (5, k), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    def step(ids, x):
        recv, offset, _ = a2a.moe_a2a_dispatch(ids, [x, ids], ws, meta, T, 0, 1, k + 1, E)
        return a2a.moe_a2a_combine(recv[0], 5, ws, meta, T, 0, 1, k + 1, offset)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"token_selected_experts must be 2-D \[local_num_tokens, top_k=3\]"):
        torch.compile(step, backend=backend, fullgraph=True)(ids, x)
    assert graphs == []


@pytest.mark.parametrize("needs_grad", ["dispatch_payload", "combine_payload"])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_plain_calls_traced_with_a_tensor_that_requires_grad(needs_grad, fullgraph):
    """Eager, the plain functions run as the differentiable ones where a
    payload requires grad (a combine's, only after such a dispatch). Traced,
    the plain ops have no backward: the trace refuses the tensor, naming the
    differentiable function, where the dispatch's gradient was lost without
    a word and the combine's compile failed on an in-place check. Under
    no_grad the same trace runs."""
    T, H, k, E = 4, 8, 1, 2
    ws = a2a.allocate_workspace(a2a.moe_a2a_get_workspace_size_per_rank(1, T, 4 * H, 4 * H), ep_size=1)
    meta = a2a.moe_a2a_initialize(ws, 0, 1, T)
    ids = torch.zeros(T, k, dtype=torch.int32)
    w = torch.randn(H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    fn = "moe_a2a_dispatch" if needs_grad == "dispatch_payload" else "moe_a2a_combine"

    def step(x):
        (rx,), offset, _ = a2a.moe_a2a_dispatch(ids, [x], ws, meta, T, 0, 1, k, E)
        return a2a.moe_a2a_combine(rx * 3 if needs_grad == "dispatch_payload" else rx * w, T, ws, meta, T, 0, 1, k,
                                   offset)

    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4), requires_grad=needs_grad == "dispatch_payload")
    torch._dynamo.reset()
    with pytest.raises(Exception, match=rf"{fn}: a tensor that requires grad, in a traced call .*use {fn}_differentiable"):
        torch.compile(step, backend="aot_eager", fullgraph=fullgraph)(x)
    # Without fullgraph the graph before the refused combine ran: its dispatch's round stays open.
    a2a.moe_a2a_initialize(ws, 0, 1, T)
    with torch.no_grad():
        assert torch.equal(torch.compile(step, backend="aot_eager", fullgraph=fullgraph)(x), step(x))
