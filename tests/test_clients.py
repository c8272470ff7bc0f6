"""The real FlashInfer clients' call sequences, reproduced from their source
and run on torch-moe-a2a: SGLang 0.5.23's FlashInfer token dispatcher and
FlashInfer 0.7.2.post1's ``moe_ep`` NVLink one-sided wrapper (the path vLLM
0.33.0 takes). One process per rank, the workspace mapped over a FlashInfer
``CommBackend`` written on torch.distributed; every received row and every
output is checked against the reference computed in each process from the
same seeded inputs of all ranks."""

from __future__ import annotations

import copy
import datetime
import gc
import io
import pickle
import threading

import pytest
import torch
import torch.distributed as dist
from conftest import (
    MnnvlConfig,
    TorchDistributedCommBackend,
    assert_bytes_equal,
    ep_mapping,
    make_generator,
    random_values,
    run_ranks,
)

import torch_moe_a2a as a2a
from torch_moe_a2a import layout, moe_ep, reference
from torch_moe_a2a.moe_ep import BootstrapConfig, MoEEpCommParams, NVLinkOneSidedConfig

HIDDEN = 96
TOP_K = 4
NUM_EXPERTS = 10  # not divisible by 3 ranks
ONE_SIDED_EXPERTS = 12  # NVLinkOneSidedAlltoAll needs num_experts divisible by the EP size
MAX_TOKENS = 12
INVALID_ID = -1
# Decode steps: tokens per rank (uneven, zeros included), for up to 3 ranks.
STEPS = [(5, 0, 7), (12, 3, 1), (0, 0, 2), (1, 1, 1)]
MASKED_RANK = 1  # taken out by the rank mask in the vLLM sequence's last step


def _inputs(seed: str, tokens: list[int], extra_width: int = 0, num_experts: int = NUM_EXPERTS) -> tuple[list, list]:
    """Every rank's (ids, [hidden bf16, (scale uint8), ids, weights fp32]) for one step."""
    gen = make_generator(seed)
    ids, payloads = [], []
    for n in tokens:
        routing = reference.random_routing(n, TOP_K, num_experts, gen, negative_fraction=0.1)
        hidden = torch.randn((n, HIDDEN), generator=gen).to(torch.bfloat16)
        weights = torch.rand((n, TOP_K), generator=gen)
        extra = [torch.randint(0, 256, (n, extra_width), dtype=torch.uint8, generator=gen)] if extra_width else []
        ids.append(routing)
        payloads.append([hidden, *extra, routing, weights])
    return ids, payloads


def _expert_outputs(recv_hidden, recv_ids, recv_weights, counts, rank, world, num_experts=NUM_EXPERTS):
    """The rank's toy experts (reference.toy_moe), as the MoE would compute them:
    on the CPU, as _check_step's reference does, then on the rows' device (a
    GPU sums each row's top-k scales in another order, and a last bit of
    difference can survive the bf16 rounding and the combine's sum)."""
    return reference.toy_moe(recv_hidden.cpu(), recv_ids.cpu(), recv_weights.cpu(), counts.cpu(), ep_rank=rank,
                             ep_size=world, num_experts=num_experts).to(recv_hidden.device)


def _check_step(what, rank, world, ids, payloads, runtime_max, recv, counts, out, *, id_index, active=None,
                num_experts=NUM_EXPERTS):
    """recv (this rank's receive views), counts and out against the reference."""
    ref = reference.reference_dispatch(ids, payloads, ep_size=world, num_experts=num_experts,
                                       runtime_max_tokens_per_rank=runtime_max, active_ranks=active)
    assert torch.equal(counts.cpu(), ref.recv_counts[rank]), f"{what}: counts"
    for i, (view, expected) in enumerate(zip(recv, ref.recv[rank])):
        for s in range(world):
            n = int(ref.recv_counts[rank][s])
            assert_bytes_equal(view[s, :n].cpu(), expected[s, :n], f"{what}: payload {i} from rank {s}")
    # Sanitized: every padding row of the expert-id payload holds the invalid id.
    padding = torch.arange(runtime_max) >= ref.recv_counts[rank].long().unsqueeze(1)
    assert bool((recv[id_index].cpu()[padding] == INVALID_ID).all()), f"{what}: expert-id padding not sanitized"
    expert_out = [_expert_outputs(ref.recv[d][0], ref.recv[d][id_index], ref.recv[d][id_index + 1],
                                  ref.recv_counts[d], d, world, num_experts) for d in range(world)]
    expected = reference.reference_combine(expert_out, ref, [x.shape[0] for x in ids])
    assert_bytes_equal(out.cpu(), expected[rank], f"{what}: combine output")


def _sglang_sequence(rank, world, device):
    """sglang/srt/layers/moe/token_dispatcher/flashinfer.py (SGLang 0.5.23),
    FlashinferDispatcher: one MoeAlltoAll per MoE layer; two layers here."""
    group = dist.group.WORLD
    # flashinfer.py:250: workspace sized for bf16 hidden states + int32 ids + fp32 weights.
    size = a2a.moe_a2a_get_workspace_size_per_rank(
        ep_size=world, max_num_tokens=MAX_TOKENS, total_dispatch_payload_size_per_token=HIDDEN * 2 + TOP_K * 8,
        combine_payload_size_per_token=HIDDEN * 2)
    # flashinfer.py:257-266: the pure-EP Mapping and the MnnvlConfig; gpus_per_node is the
    # host's device count, 0 on a host without a GPU.
    mapping = a2a.Mapping(rank=rank, tp_size=world, moe_ep_size=world, world_size=world,
                          gpus_per_node=torch.cuda.device_count(), pp_size=1, cp_size=1)
    mnnvl_config = MnnvlConfig(comm_backend=TorchDistributedCommBackend(group))
    # flashinfer.py:274: MoeAlltoAll(...) per layer; same geometry: one workspace.
    layers = [a2a.MoeAlltoAll(mapping=mapping, max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=NUM_EXPERTS,
                              workspace_size_per_rank=size, mnnvl_config=mnnvl_config, device=device)
              for _ in range(2)]
    assert layers[0].workspace is layers[1].workspace and layers[0].metainfo is layers[1].metainfo
    for step, tokens in enumerate(STEPS):
        tokens = list(tokens[:world])
        # flashinfer.py:520-529: runtime_max is the max over the DP ranks' token counts.
        runtime_max = max(1, max(tokens))
        for layer, moe in enumerate(layers):
            in_workspace = (step + layer) % 2 == 1  # flashinfer.py:564: payload_in_workspace for cutlass runners
            ids, payloads = _inputs(f"sglang-{world}-{step}-{layer}", tokens)
            mine = [p.to(device) for p in payloads[rank]]
            # flashinfer.py:540: dispatch with sanitize of the expert-id payload (index 1).
            recv = moe.dispatch(mine[1], mine, runtime_max, invalid_token_expert_id=INVALID_ID,
                                expert_id_payload_index=1)
            counts = moe.recv_counts.clone()
            x_recv, ids_recv, w_recv = recv
            expert_out = _expert_outputs(x_recv, ids_recv, w_recv, counts, rank, world)
            if in_workspace:
                # flashinfer.py:568: the experts write into the combine region.
                moe_output = moe.get_combine_payload_tensor_in_workspace(runtime_max, HIDDEN, torch.bfloat16)
                moe_output.view(-1, HIDDEN).copy_(expert_out.view(-1, HIDDEN))
                hidden = moe_output.view(-1, HIDDEN)
            else:
                hidden = expert_out.view(-1, HIDDEN)
            recv_copy = [v.clone() for v in recv]  # copied before the combine: peers may overwrite after
            # flashinfer.py:626: combine of the [ep_size, runtime_max, H] view.
            out = moe.combine(hidden.view(world, runtime_max, HIDDEN), runtime_max, payload_in_workspace=in_workspace)
            _check_step(f"sglang step {step} layer {layer}", rank, world, ids, payloads, runtime_max, recv_copy,
                        counts, out, id_index=1)
    for moe in layers:
        moe.check()


def _moe_ep_sequence(rank, world, device):
    """flashinfer/moe_ep/backends/split/comm/nvlink_one_sided/communication.py
    (FlashInfer 0.7.2.post1), NVLinkOneSidedAlltoAll, as vLLM 0.33.0's
    FlashInferNVLinkOneSidedManager (vllm/distributed/device_communicators/all2all.py)
    drives it: EPLB stats, a rank mask, a scale payload, output=, checkpointing."""
    group = dist.group.WORLD
    eplb_n = NUM_EXPERTS
    scale_width = HIDDEN // 32
    # nvlink_common.py:90-97: the pure-EP Mapping and the MnnvlConfig over the EP group.
    mapping = a2a.Mapping(world_size=world, rank=rank, gpus_per_node=world, tp_size=world, moe_ep_size=world)
    mnnvl_config = MnnvlConfig(comm_backend=TorchDistributedCommBackend(group))
    # communication.py:75: sizes from the dispatch row (hidden, scales, ids, weights) and a >= 16-bit combine row.
    size = a2a.moe_a2a_get_workspace_size_per_rank(world, MAX_TOKENS, HIDDEN * 2 + scale_width + TOP_K * 8,
                                                   HIDDEN * 2, eplb_n, backend="trtllm")
    # communication.py:90: MoeAlltoAll(mapping, ...).
    moe = a2a.MoeAlltoAll(mapping, max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=NUM_EXPERTS,
                          workspace_size_per_rank=size, mnnvl_config=mnnvl_config, eplb_stats_num_experts=eplb_n,
                          enable_rank_mask=True, backend="trtllm", device=device)
    everyone = a2a.moe_a2a_active_rank_mask(range(world), world)
    steps = [(tokens, None) for tokens in STEPS[:3]] + [(STEPS[3], MASKED_RANK)]
    for step, (tokens, masked) in enumerate(steps):
        if step == 2:
            # all2all.py:899-919: checkpoint_prepare(), then checkpoint_restore(a new communicator).
            moe.checkpoint_prepare()
            moe.checkpoint_prepare()  # idempotent
            with pytest.raises(RuntimeError, match="checkpoint_prepare"):
                moe.dispatch(torch.zeros((0, TOP_K), dtype=torch.int32, device=device), [], 1)
            moe.checkpoint_restore(TorchDistributedCommBackend(group))
            moe.checkpoint_restore(TorchDistributedCommBackend(group))  # idempotent
        tokens = list(tokens[:world])
        active = [r for r in range(world) if r != masked]
        if rank not in active:
            continue  # a masked-off rank takes no part (FlashInfer: nobody waits for it)
        mask = everyone if masked is None else a2a.moe_a2a_active_rank_mask(active, world)
        tokens_per_rank = max(1, max(tokens))
        ids, payloads = _inputs(f"moe-ep-{world}-{step}", tokens, extra_width=scale_width)
        mine = [p.to(device) for p in payloads[rank]]
        stats = torch.arange(eplb_n, dtype=torch.int32, device=device) * (rank + 1) + step
        # communication.py:158: dispatch(topk_ids, [hidden, scale, ids, weights], ...), expert ids at index 2.
        recv = moe.dispatch(mine[2], mine, tokens_per_rank, invalid_token_expert_id=INVALID_ID,
                            expert_id_payload_index=2, eplb_local_stats=stats, active_rank_mask=mask)
        gathered = moe.eplb_gathered_stats.clone()
        for r in active:
            expected = torch.arange(eplb_n, dtype=torch.int32) * (r + 1) + step
            assert torch.equal(gathered[r].cpu(), expected), f"moe_ep step {step}: EPLB stats of rank {r}"
        counts = moe.recv_counts.clone()
        flat = [t.flatten(0, 1) for t in recv]  # communication.py:168
        expert_out = _expert_outputs(recv[0], recv[2], recv[3], counts, rank, world)
        # communication.py:185: get_combine_input_buffer, the experts write into it.
        buffer = moe.get_combine_payload_tensor_in_workspace(tokens_per_rank, HIDDEN, torch.bfloat16).flatten(0, 1)
        use_buffer = step % 2 == 0
        expert_output = buffer if use_buffer else torch.empty_like(buffer)
        expert_output.copy_(expert_out.view(-1, HIDDEN))
        recv_copy = [t.view(world, tokens_per_rank, *t.shape[1:]).clone() for t in flat]
        output = torch.full((tokens[rank], HIDDEN), float("nan"), dtype=torch.bfloat16, device=device)
        # communication.py:214-218: in-workspace detection by data_ptr, combine(..., output=, active_rank_mask=).
        in_workspace = expert_output.data_ptr() == buffer.data_ptr()
        combined = moe.combine(expert_output.view(world, tokens_per_rank, -1), tokens_per_rank,
                               payload_in_workspace=in_workspace, output=output, use_low_precision=False,
                               active_rank_mask=mask)
        assert combined is output
        _check_step(f"moe_ep step {step}", rank, world, ids, payloads, tokens_per_rank, recv_copy, counts, output,
                    id_index=2, active=active)


def _vllm_one_sided_sequence(rank, world, device):
    """vLLM's FlashInferNVLinkOneSidedPrepareAndFinalize
    (vllm/model_executor/layers/fused_moe/prepare_finalize/flashinfer_nvlink_one_sided.py,
    vllm-project/vllm 055e47c) on torch_moe_a2a.NVLinkOneSidedAlltoAll. vLLM
    makes these calls on FlashInfer's MoeAlltoAll through its all2all manager;
    NVLinkOneSidedAlltoAll.dispatch and .combine take the same payloads, sizes
    and output: prepare's runtime max over the ranks' token counts (lines
    92-96), int32 ids (71-72), payloads [x, x_sf when quantized, ids, weights]
    (112-117), dispatched with -1 as the invalid id (120-126), the receive
    rows viewed [ep_size * T, *] (139-141); finalize's expert output viewed
    [ep_size, T, hidden] (164-166) and combined into `output` (168-172). Odd
    steps write the expert output into get_combine_input_buffer instead
    (FlashInfer's zero-copy path)."""
    num_experts = ONE_SIDED_EXPERTS
    scale_width = HIDDEN // 32
    params = MoEEpCommParams(num_experts=num_experts, top_k=TOP_K, max_tokens_per_rank=MAX_TOKENS,
                             hidden_size=HIDDEN, invalid_expert_id=INVALID_ID)
    comm = a2a.NVLinkOneSidedAlltoAll(BootstrapConfig(world_size=world, rank=rank, process_group=dist.group.WORLD),
                                      params, NVLinkOneSidedConfig(extra_payload_bytes_per_token=scale_width),
                                      device=device)
    for step, tokens in enumerate(STEPS):
        tokens = list(tokens[:world])
        quantized = step % 2 == 0  # x_sf travels as the second payload
        runtime_max = max(1, max(tokens))  # every rank at 0 tokens: vLLM runs no MoE step, FlashInfer needs T > 0
        ids, payloads = _inputs(f"one-sided-{world}-{step}", tokens, scale_width if quantized else 0, num_experts)
        mine = [p.to(device) for p in payloads[rank]]
        x, x_sf, topk_ids, topk_weights = mine[0], mine[1] if quantized else None, mine[-2], mine[-1]
        got = comm.dispatch(x, topk_ids, topk_weights, hidden_states_scale=x_sf, max_tokens_per_rank=runtime_max)
        assert got.tokens_per_rank == runtime_max and (got.hidden_states_scale is not None) == quantized
        recv_x = got.hidden_states.view(-1, got.hidden_states.shape[-1])
        recv_ids = got.topk_ids.view(-1, got.topk_ids.shape[-1])
        recv_w = got.topk_weights.view(-1, got.topk_weights.shape[-1])
        recv = [recv_x] + ([got.hidden_states_scale] if quantized else []) + [recv_ids, recv_w]
        recv_copy = [t.view(world, runtime_max, -1).clone() for t in recv]
        counts = comm.alltoall.recv_counts.clone()
        experts = _expert_outputs(recv_copy[0], recv_copy[-2], recv_copy[-1], counts, rank, world, num_experts)
        fused = comm.get_combine_input_buffer(torch.bfloat16) if step % 2 else torch.empty_like(recv_x)
        fused.copy_(experts.view(-1, HIDDEN))
        output = torch.full((tokens[rank], HIDDEN), float("nan"), dtype=torch.bfloat16, device=device)
        assert comm.combine(fused.view(world, runtime_max, HIDDEN), output=output) is output
        _check_step(f"one-sided step {step}", rank, world, ids, payloads, runtime_max, recv_copy, counts, output,
                    id_index=len(recv) - 2, num_experts=num_experts)
    comm.destroy()


def _moe_ep_factory_sequence(rank, world, device):
    """FlashInfer's moe_ep as its CFT release's multi-rank test
    (tests/moe_ep/test_moe_ep_communication_multirank.py) builds and drives
    it: create_communication with an NVLinkOneSidedConfig of EPLB stats, a
    rank mask, CFT off and a wait bound; the instance's own
    active_rank_mask; two steps, then the instance's checkpoint_prepare and
    checkpoint_restore, then a step with one rank masked off."""
    num_experts = ONE_SIDED_EXPERTS
    params = MoEEpCommParams(num_experts=num_experts, top_k=TOP_K, max_tokens_per_rank=MAX_TOKENS,
                             hidden_size=HIDDEN, invalid_expert_id=INVALID_ID)
    config = NVLinkOneSidedConfig(eplb_stats_num_experts=num_experts, enable_rank_mask=True, cft=False,
                                  timeout_sec=60)
    comm = moe_ep.create_communication(BootstrapConfig(world_size=world, rank=rank), params, config, device=device)
    assert isinstance(comm, moe_ep.NVLinkOneSidedAlltoAll) and comm.config is config and not comm.cft_enabled
    assert comm.alltoall.timeout_s == 60
    for step, tokens in enumerate(STEPS):
        if step == 2:
            comm.checkpoint_prepare()
            comm.checkpoint_prepare()  # a second call does nothing, as FlashInfer's
            comm.checkpoint_restore(TorchDistributedCommBackend(dist.group.WORLD))
        tokens = list(tokens[:world])
        active = [r for r in range(world) if step < 3 or r != MASKED_RANK]
        if rank not in active:
            continue
        mask = comm.active_rank_mask(active)
        runtime_max = max(1, max(tokens))
        ids, payloads = _inputs(f"factory-{world}-{step}", tokens, num_experts=num_experts)
        x, topk_ids, topk_weights = (p.to(device) for p in payloads[rank])
        stats = torch.arange(num_experts, dtype=torch.int32, device=device) * (rank + 1) + step
        got = comm.dispatch(x, topk_ids, topk_weights, max_tokens_per_rank=runtime_max, eplb_local_stats=stats,
                            active_rank_mask=mask)
        for r in active:
            expected = torch.arange(num_experts, dtype=torch.int32) * (r + 1) + step
            assert torch.equal(got.eplb_gathered_stats[r].cpu(), expected), f"factory step {step}: stats of rank {r}"
        recv = [t.view(world, runtime_max, -1).clone() for t in (got.hidden_states, got.topk_ids, got.topk_weights)]
        counts = comm.alltoall.recv_counts.clone()
        experts = _expert_outputs(recv[0], recv[1], recv[2], counts, rank, world, num_experts)
        output = comm.combine(experts.view(-1, HIDDEN), active_rank_mask=mask)
        _check_step(f"factory step {step}", rank, world, ids, payloads, runtime_max, recv, counts, output,
                    id_index=1, active=active, num_experts=num_experts)
    comm.destroy()


def _clients_worker(rank, world, init_file, device):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        _sglang_sequence(rank, world, device)
        _moe_ep_sequence(rank, world, device)
        _vllm_one_sided_sequence(rank, world, device)
        _moe_ep_factory_sequence(rank, world, device)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_client_call_sequences(world, device, tmp_path):
    run_ranks(_clients_worker, world, (str(tmp_path / "init"), device), report_dir=tmp_path, timeout_s=300)


def _mnnvl_config_worker(rank, world, init_file):
    """FlashInfer's own torch.distributed CommBackend in an MnnvlConfig, as
    code switching from ``flashinfer.comm.mnnvl`` builds it: the backend's
    collectives, its Split into the EP groups, then a round trip over them."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        comm = a2a.TorchDistBackend()  # the default group, as FlashInfer's default
        assert (comm.Get_rank(), comm.Get_size()) == (rank, world)
        assert comm.allgather(("rank", rank)) == tuple(("rank", r) for r in range(world))
        assert comm.bcast(f"from {rank}", root=world - 1) == f"from {world - 1}"
        gen = make_generator(("mnnvl config", rank))
        ids = torch.randint(0, 4, (5, 2), generator=gen, dtype=torch.int32)
        hidden = torch.randn((5, 64), generator=gen).to(torch.bfloat16)
        # moe_ep over the whole tensor-parallel group: one EP group of `world` ranks;
        # moe_tp instead: each rank an EP group of its own (Split by color).
        for moe_sizes, ep_size in ((dict(moe_ep_size=world), world), (dict(moe_tp_size=world), 1)):
            a2a.MoeAlltoAll.clear_workspace_cache()
            mapping = a2a.Mapping(world_size=world, rank=rank, tp_size=world, **moe_sizes)
            moe = a2a.MoeAlltoAll(mapping, 8, 2, 4, hidden_size=64, mnnvl_config=a2a.MnnvlConfig(comm_backend=comm),
                                  device="cpu")
            assert (moe.ep_rank, moe.ep_size, moe.workspace.shape[0]) == (mapping.moe_ep_rank, ep_size, ep_size)
            (recv,) = moe.dispatch(ids, [hidden], 5)
            out = moe.combine(recv * 2, 5)
            # Each token is summed once per EP rank it reached (experts 0-1 on EP rank 0 when ep_size is 2).
            reached = (ids * ep_size // 4).sort(dim=1).values.diff(dim=1).ne(0).sum(dim=1) + 1
            torch.testing.assert_close(out, (hidden.float() * 2 * reached[:, None]).to(torch.bfloat16), rtol=0, atol=0)
        a2a.MoeAlltoAll.clear_workspace_cache()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_mnnvl_config_and_torch_dist_backend(tmp_path):
    """``MnnvlConfig`` and ``TorchDistBackend`` as ``flashinfer.comm.mnnvl``
    has them (vLLM and SGLang build ``MnnvlConfig(comm_backend=...)``; the
    names were not exported, so code switching its imports had to write its
    own)."""
    assert a2a.MnnvlConfig().comm_backend is None and a2a.MnnvlConfig().fabric_page_size == 1 << 29
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        a2a.TorchDistBackend()
    run_ranks(_mnnvl_config_worker, 2, (str(tmp_path / "init"),), report_dir=tmp_path, timeout_s=300)


class _UnimplementedBarrierCommBackend(TorchDistributedCommBackend):
    """vLLM's CustomCommunicator of some versions (mnnvl_compat.py): bcast and
    barrier raise NotImplementedError."""

    def bcast(self, data, root: int = 0):
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError


class _AllgatherOnlyCommBackend:
    """vLLM's CustomCommunicator of earlier versions: Get_rank, Get_size,
    allgather and Split, no bcast or barrier."""

    def __init__(self, group):
        self._inner = TorchDistributedCommBackend(group)
        self.Get_rank, self.Get_size, self.allgather = self._inner.Get_rank, self._inner.Get_size, self._inner.allgather

    def Split(self, color: int, key: int):
        return self


def _barrierless_worker(rank, world, init_file, kind):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        backend = {"unimplemented": _UnimplementedBarrierCommBackend,
                   "absent": _AllgatherOnlyCommBackend}[kind]
        a2a.MoeAlltoAll.clear_workspace_cache()
        moe = a2a.MoeAlltoAll(ep_mapping(rank, world), 8, 2, 4, hidden_size=64,
                              mnnvl_config=MnnvlConfig(comm_backend=backend(dist.group.WORLD)), device="cpu")
        ids = torch.tensor([[0, 3], [1, 2]], dtype=torch.int32)
        hidden = torch.full((2, 64), float(rank + 1)).to(torch.bfloat16)
        for step in range(3):
            if step == 1:
                moe.reset()
            if step == 2:
                moe.checkpoint_prepare()
                moe.checkpoint_restore(backend(dist.group.WORLD))
            (recv,) = moe.dispatch(ids, [hidden], 2)
            out = moe.combine(recv * 2, 2)
            # Every token reaches both ranks (experts 0-1 on rank 0, 2-3 on rank 1): twice its doubled value.
            assert torch.equal(out, hidden * 4), (kind, step)
        a2a.MoeAlltoAll.clear_workspace_cache()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["unimplemented", "absent"])
def test_a_comm_backend_without_a_barrier(kind, tmp_path):
    """A CommBackend whose barrier raises NotImplementedError, or that has
    none (vLLM's, by version): its allgather stands in for it, through
    construction, a round trip, reset() and checkpoint_prepare/restore."""
    run_ranks(_barrierless_worker, 2, (str(tmp_path / "init"), kind), report_dir=tmp_path, timeout_s=300)


# ---- in one process ---------------------------------------------------------------------


def _ep1(device, **kwargs):
    size = kwargs.pop("workspace_size_per_rank", None)
    return a2a.MoeAlltoAll(a2a.Mapping(), 8, 2, 4, workspace_size_per_rank=size, hidden_size=64, device=device,
                           **kwargs)


def test_instances_of_one_geometry_share_a_workspace(device):
    a2a.MoeAlltoAll.clear_workspace_cache()
    first, second = _ep1(device), _ep1(device)
    assert first.workspace is second.workspace and first.metainfo is second.metainfo
    other = _ep1(device, workspace_size_per_rank=first.workspace_size_per_rank + layout.PLANE_ALIGN)
    assert other.workspace is not first.workspace  # SGLang's namespaces: another size, another workspace
    eplb = _ep1(device, eplb_stats_num_experts=4)
    assert eplb.workspace is not first.workspace
    # Instances sharing a workspace take turns.
    ids = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    hidden = torch.randn((1, 64), device=device).to(torch.bfloat16)
    first.dispatch(ids, [hidden], 1)
    with pytest.raises(RuntimeError, match="another MoeAlltoAll sharing this workspace"):
        second.dispatch(ids, [hidden], 1)
    # Nor may the other combine (it advised a dispatch first, which the open round refuses).
    with pytest.raises(RuntimeError, match="MoeAlltoAll.combine called before dispatch on this instance, while another "
                                           "MoeAlltoAll sharing this workspace is between its dispatch and combine"):
        second.combine(torch.zeros((1, 1, 64), dtype=torch.bfloat16, device=device), 1)
    out = first.combine(first.get_combine_payload_tensor_in_workspace(1, 64, torch.bfloat16), 1,
                        payload_in_workspace=True)
    assert out.shape == (1, 64)
    second.dispatch(ids, [hidden], 1)
    second.combine(torch.zeros((1, 1, 64), dtype=torch.bfloat16, device=device), 1)
    # A reset through one instance ends the other's open round (its combine
    # raised 'without a preceding dispatch', its dispatch 'called twice').
    first.dispatch(ids, [hidden], 1)
    second.reset()
    with pytest.raises(RuntimeError, match="MoeAlltoAll.combine called before dispatch"):
        first.combine(torch.zeros((1, 1, 64), dtype=torch.bfloat16, device=device), 1)
    first.dispatch(ids, [hidden], 1)
    assert first.combine(torch.ones((1, 1, 64), dtype=torch.bfloat16, device=device), 1).sum() == 64
    a2a.MoeAlltoAll.clear_workspace_cache()
    assert _ep1(device).workspace is not first.workspace


def test_checkpoint_needs_a_group(device):
    moe = _ep1(device)
    with pytest.raises(RuntimeError, match="needs a workspace mapped over a group"):
        moe.checkpoint_prepare()


def test_a_group_workspace_built_under_the_meta_device(tmp_path):
    """Large models are built under ``with torch.device("meta")`` (deferred
    initialization), their MoeAlltoAll with them: mapped over a group there,
    the workspace is the CPU one it is elsewhere and round-trips (the
    bootstrap's exchange keeps its buffers on the CPU, whatever the default
    device)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        a2a.MoeAlltoAll.clear_workspace_cache()
        with torch.device("meta"):
            moe = a2a.MoeAlltoAll(a2a.Mapping(), 8, 2, 4, hidden_size=64, device="cpu", group=dist.group.WORLD)
        assert moe.workspace.device.type == "cpu" and moe.metainfo.device.type == "cpu"
        gen = make_generator("meta-group")
        ids = torch.randint(0, 4, (8, 2), generator=gen, dtype=torch.int32)
        hidden = torch.randn((8, 64), generator=gen).to(torch.bfloat16)
        (recv,) = moe.dispatch(ids, [hidden], 8)
        torch.testing.assert_close(moe.combine(recv * 2, 8), hidden * 2, rtol=0, atol=0)
    finally:
        a2a.MoeAlltoAll.clear_workspace_cache()
        dist.destroy_process_group()


def test_checkpoint_refused_between_dispatch_and_combine(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        a2a.MoeAlltoAll.clear_workspace_cache()
        comm = TorchDistributedCommBackend(dist.group.WORLD)
        moe = a2a.MoeAlltoAll(a2a.Mapping(), 8, 2, 4, hidden_size=64, mnnvl_config=MnnvlConfig(comm), device="cpu")
        ids = torch.tensor([[0, 3]], dtype=torch.int32)
        hidden = torch.randn((1, 64)).to(torch.bfloat16)
        moe.dispatch(ids, [hidden], 1)
        with pytest.raises(RuntimeError, match="between a dispatch and its combine"):
            moe.checkpoint_prepare()
        # One destination rank (this one): the output is its payload row.
        payload = (hidden * 2).view(1, 1, 64)
        assert torch.equal(moe.combine(payload, 1), payload[0])
        moe.checkpoint_prepare()
        # Another instance on the released rows would initialize freed memory, outside the release.
        with pytest.raises(RuntimeError, match=r"whose checkpoint_prepare\(\) released its memory"):
            a2a.MoeAlltoAll(a2a.Mapping(), 8, 2, 4, hidden_size=64, workspace=moe.workspace)
        with pytest.raises(RuntimeError, match="rank/size 0/2 differ"):
            moe.checkpoint_restore(_FakeComm(0, 2))
        moe.checkpoint_restore(comm)
        # The shared file's pages were given back: past the header, the memory reads zeros again.
        assert int(moe.workspace[0, layout.HEADER_BYTES:].count_nonzero()) == 0
        moe.dispatch(ids, [hidden], 1)
        assert torch.equal(moe.combine(hidden.view(1, 1, 64), 1), hidden)
    finally:
        a2a.MoeAlltoAll.clear_workspace_cache()
        dist.destroy_process_group()


class _FakeComm:
    """A CommBackend of another size (checkpoint_restore must refuse it before any collective)."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def allgather(self, data):
        raise AssertionError("no collective expected")

    bcast = barrier = Split = allgather


class _ClosedComm(_FakeComm):
    """A CommBackend whose peer has gone: its collectives fail as gloo's do."""

    def allgather(self, data):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                           "[127.0.0.1]:19341")

    barrier = allgather


def test_a_failed_group_collective_names_the_rank_and_the_calls():
    """The group's own error names neither the rank nor what it was doing:
    allocate_workspace's first collective says both, with gloo's first line."""
    with pytest.raises(RuntimeError, match=r"^rank 1 of a group of 2: the group's allgather failed, so a member did "
                                           r"not take part \(it exited.*allocate_workspace\(group=\.\.\.\).*"
                                           r"RuntimeError: \[\.\./third_party/gloo.*Connection closed by peer"):
        a2a.allocate_workspace(1024, group=_ClosedComm(1, 2))


def test_mnnvl_config_needs_a_comm_backend():
    with pytest.raises(ValueError, match="CommBackend"):
        a2a.MoeAlltoAll(a2a.Mapping(), 8, 2, 4, hidden_size=64, mnnvl_config=MnnvlConfig(None), device="cpu")
    with pytest.raises(ValueError, match="not both"):
        a2a.MoeAlltoAll(a2a.Mapping(), 8, 2, 4, hidden_size=64, mnnvl_config=MnnvlConfig(_FakeComm(0, 1)),
                        group=_FakeComm(0, 1), device="cpu")


def test_mapping_must_match_the_communicator():
    comm = _FakeComm(0, 2)
    comm.Split = lambda color, key: comm
    with pytest.raises(ValueError, match=r"differ from the group's \(rank, size\) = \(0, 2\)"):
        a2a.MoeAlltoAll(ep_mapping(1, 4), 8, 2, 4, hidden_size=64,
                        mnnvl_config=MnnvlConfig(comm), device="cpu")


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("width", [24, 100, 21504])
def test_sanitize_any_width(width, id_dtype, device):
    """FlashInfer's single-GPU sanitize test: int32 payloads of any width (and
    int64 ones, written in their own width)."""
    gen = make_generator(f"wide-{width}")
    tokens = 3
    size = a2a.moe_a2a_get_workspace_size_per_rank(1, 4, width * 8 + TOP_K * 4, 64)
    workspace = a2a.allocate_workspace(size, ep_size=1, device=device)
    metainfo = a2a.moe_a2a_initialize(workspace, 0, 1, 4)
    ids = reference.random_routing(tokens, TOP_K, 8, gen).to(device)
    wide = torch.randint(-2**40 if id_dtype == torch.int64 else -1000, 1000, (tokens, width), dtype=id_dtype,
                         generator=gen).to(device)
    recv, _, _ = a2a.moe_a2a_dispatch(ids, [wide], workspace, metainfo, 4, 0, 1, TOP_K, 8)
    info = torch.iinfo(id_dtype)
    for invalid in (info.min, info.max, -7):  # the dtype's extremes, then the id checked
        a2a.moe_a2a_sanitize_expert_ids(recv[0], workspace, metainfo, 0, invalid)
        assert bool((recv[0][0, tokens:] == invalid).all())
    assert torch.equal(recv[0][0, :tokens].cpu(), wide.cpu())
    for outside in (info.min - 1, info.max + 1):
        with pytest.raises(ValueError, match=rf"invalid_expert_id must fit in the ids' dtype {id_dtype} .* got {outside}"):
            a2a.moe_a2a_sanitize_expert_ids(recv[0], workspace, metainfo, 0, outside)


# ---- FlashInfer's other behaviours ----------------------------------------------------------


def test_sf_layout_is_flashinfers_int_enum():
    import enum

    assert issubclass(a2a.SfLayout, enum.IntEnum)
    assert {m.name: int(m) for m in a2a.SfLayout} == {"layout_128x4": 0, "layout_8x4": 1, "layout_linear": 2}


@pytest.mark.parametrize("path", ["functional", "moe_alltoall"])
def test_sf_layout_none_is_linear_as_in_flashinfer(path, device):
    """FlashInfer's combine op takes Optional[SfLayout] and reads None as
    linear; its moe_a2a_combine and MoeAlltoAll.combine pass sf_layout
    through. An MXFP8 combine with sf_layout=None gives the bytes of one with
    layout_linear (scales poisoned before each)."""
    from torch_moe_a2a.arguments import LAYOUT_LINEAR

    assert LAYOUT_LINEAR == a2a.SfLayout.layout_linear
    gen = make_generator(("sf_layout None", path))
    tokens, T, hidden, top_k, num_experts = 5, 8, 64, 2, 4
    x = random_values((tokens, hidden), torch.bfloat16, gen).to(device)
    ids = reference.random_routing(tokens, top_k, num_experts, gen).to(device)
    if path == "moe_alltoall":
        moe = a2a.MoeAlltoAll(ep_mapping(0, 1), T, top_k, num_experts, hidden_size=hidden, device=device)
    else:
        size = a2a.moe_a2a_get_workspace_size_per_rank(1, T, hidden * 2 + top_k * 4, hidden * 2)
        workspace = a2a.allocate_workspace(size, ep_size=1, device=device)
        metainfo = a2a.moe_a2a_initialize(workspace, 0, 1, T)
    results = []
    for sf_layout in (a2a.SfLayout.layout_linear, None):
        scales = torch.full((tokens, hidden // 32), 0xAB, dtype=torch.uint8, device=device)
        if path == "moe_alltoall":
            recv = moe.dispatch(ids, [x, ids], T)
            out = moe.combine(recv[0].clone(), T, False, torch.float8_e4m3fn, scales, 1.0, sf_layout)
        else:
            recv, offset, _ = a2a.moe_a2a_dispatch(ids, [x, ids], workspace, metainfo, T, 0, 1, top_k, num_experts)
            out = a2a.moe_a2a_combine(recv[0].clone(), tokens, workspace, metainfo, T, 0, 1, top_k, offset, False,
                                      torch.float8_e4m3fn, scales, 1.0, sf_layout)
        results.append((out.view(torch.uint8).cpu(), scales.cpu()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert not bool((results[1][1] == 0xAB).any()), "the scales were not written"


def test_rank_mask_enabled_needs_a_mask(device):
    size = a2a.moe_a2a_get_workspace_size_per_rank(1, 4, 64 * 2 + 8, 128)
    workspace = a2a.allocate_workspace(size, ep_size=1, device=device)
    metainfo = a2a.moe_a2a_initialize(workspace, 0, 1, 4)
    ids = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="active_rank_mask must be given when enable_rank_mask=True"):
        a2a.moe_a2a_dispatch(ids, [ids], workspace, metainfo, 1, 0, 1, 2, 4, enable_rank_mask=True)
    with pytest.raises(ValueError, match="active_rank_mask must be given when enable_rank_mask=True"):
        a2a.moe_a2a_combine(torch.zeros((1, 1, 64), dtype=torch.bfloat16, device=device), 1, workspace, metainfo, 1,
                            0, 1, 2, 0, enable_rank_mask=True)
    moe = a2a.MoeAlltoAll(a2a.Mapping(), 4, 2, 4, hidden_size=64, enable_rank_mask=True, device=device)
    with pytest.raises(ValueError, match="active_rank_mask must be given"):
        moe.dispatch(ids, [ids], 1)


# ---- Mapping ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, expected", [
    # world 8, tp 4, pp 2: rank 6 is tp_rank 2 of pp group 1.
    (dict(world_size=8, rank=6, tp_size=4, pp_size=2), dict(tp_rank=2, pp_rank=1, cp_rank=0, moe_tp_size=4,
                                                           moe_ep_size=1, moe_ep_rank=0, moe_tp_rank=2)),
    # tp 8 split as moe_tp 2 x moe_ep 4: rank 5 is moe_ep_rank 1 of moe_tp group 1.
    (dict(world_size=8, rank=5, tp_size=8, moe_tp_size=2), dict(moe_ep_size=4, moe_ep_rank=1, moe_tp_rank=1)),
    (dict(world_size=16, rank=13, gpus_per_node=8, tp_size=8, pp_size=2, moe_ep_size=4),
     dict(moe_tp_size=2, tp_rank=5, pp_rank=1, moe_ep_rank=1, moe_tp_rank=1, node_rank=1, local_rank=5,
          moe_ep_group=[12, 13, 14, 15])),
    (dict(world_size=8, rank=3, tp_size=4, cp_size=2), dict(cp_rank=0, tp_rank=3, attn_tp_size=8)),
    (dict(world_size=8, rank=7, tp_size=4, cp_size=2), dict(cp_rank=1, tp_rank=3, pp_rank=0)),
    (dict(), dict(world_size=1, rank=0, moe_ep_size=1, moe_ep_rank=0, moe_tp_size=1)),
])
def test_mapping_derivations(kwargs, expected):
    mapping = a2a.Mapping(**kwargs)
    for name, value in expected.items():
        assert getattr(mapping, name) == value, name
    assert a2a.Mapping.from_dict(mapping.to_dict()) == mapping
    assert hash(a2a.Mapping.from_dict(mapping.to_dict())) == hash(mapping)


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=8, rank=0, tp_size=4), r"world_size 8 must equal tp_size \* pp_size \* cp_size"),
    (dict(world_size=4, rank=0, tp_size=4, moe_tp_size=2, moe_ep_size=4), r"tp_size 4 must equal moe_tp_size"),
    (dict(world_size=4, rank=0, tp_size=4, moe_ep_size=3), r"not divisible by 3"),
    (dict(world_size=4, rank=4, tp_size=4), r"rank must be an int in \[0, 4\)"),
    (dict(world_size=0), r"world_size must be a positive int"),
    (dict(world_size=2, tp_size=2, gpus_per_node=-1), r"gpus_per_node must be a non-negative int, got -1"),
    (dict(world_size=4, tp_size=2, cp_size=2, attn_cp_size=2), r"attn_cp_size must be 1"),
])
def test_mapping_refuses_inconsistent_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        a2a.Mapping(**kwargs)


def test_mapping_of_a_host_without_a_gpu():
    """SGLang's and vLLM's FlashInfer paths pass gpus_per_node=torch.cuda.device_count(),
    0 on a host without a GPU: the mapping is made (as FlashInfer's is) and only the
    node and local ranks, which need the GPUs of a node, raise."""
    mapping = a2a.Mapping(rank=1, tp_size=4, moe_ep_size=4, world_size=4, gpus_per_node=0, pp_size=1, cp_size=1)
    assert (mapping.moe_ep_rank, mapping.moe_ep_size, mapping.moe_ep_group) == (1, 4, [0, 1, 2, 3])
    assert a2a.Mapping.from_dict(mapping.to_dict()) == mapping
    for rank_of in (lambda: mapping.local_rank, lambda: mapping.node_rank, lambda: mapping.get_local_rank(3)):
        with pytest.raises(ValueError, match="gpus_per_node 0"):
            rank_of()


def test_mapping_cp_with_moe_ep_is_not_implemented():
    with pytest.raises(NotImplementedError):
        a2a.Mapping(world_size=4, rank=0, tp_size=2, cp_size=2, moe_ep_size=2)


@pytest.mark.parametrize("rank", [-1, 4, 5, 1.5, "1"])
def test_mapping_rank_checks_as_flashinfers(rank):
    """FlashInfer's tests/comm/test_mapping_rank.py (flashinfer-ai/flashinfer
    62bb4395): a bad rank is refused in FlashInfer's words, in the
    constructor and on assignment, and an assignment that raised leaves the
    mapping and its groups unchanged; a good assignment moves the groups."""
    with pytest.raises(ValueError, match="Rank should be an integer between 0 and 3"):
        a2a.Mapping(world_size=4, tp_size=2, pp_size=2, rank=rank)
    mapping = a2a.Mapping(world_size=4, tp_size=2, pp_size=2, rank=1)
    with pytest.raises(ValueError, match="Rank should be an integer between 0 and 3"):
        mapping.rank = rank
    assert mapping.rank == 1 and mapping.tp_group == [0, 1] and mapping.pp_group == [1, 3]
    mapping.rank = 3
    assert mapping.tp_group == [2, 3] and mapping.pp_group == [1, 3] and mapping.tp_rank == 1
    with pytest.raises(ValueError, match="Rank should be an integer between 0 and 0"):
        a2a.Mapping(rank=-1)
    # enable_attention_dp skips the range check, on assignment too.
    dp = a2a.Mapping(world_size=4, tp_size=2, pp_size=2, rank=4, enable_attention_dp=True)
    dp.rank = 5
    assert dp.rank == 5


@pytest.mark.parametrize("dim", ["tp_size", "pp_size", "cp_size"])
def test_mapping_auto_parallel_in_flashinfers_words(dim):
    """FlashInfer's tests/comm/test_mapping.py and test_mapping_validation.py:
    with auto_parallel a size other than 1 is refused, the message naming
    "auto parallel" and the size."""
    with pytest.raises(ValueError, match="auto parallel") as info:
        a2a.Mapping(world_size=1, rank=0, auto_parallel=True, **{dim: 4})
    assert dim in str(info.value)
    mapping = a2a.Mapping(world_size=1, rank=0, tp_size=1, pp_size=1, cp_size=1, auto_parallel=True)
    assert (mapping.tp_rank, mapping.pp_rank, mapping.cp_rank) == (0, 0, 0)


def test_mapping_groups_and_helpers_as_flashinfers():
    """The groups and helpers of FlashInfer's Mapping (flashinfer/comm/mapping.py,
    from TensorRT-LLM's), which code written against it reads: the examples
    of its docstring (16 ranks, tp 8 as moe_tp 2 x moe_ep 4, pp 2)."""
    m = a2a.Mapping(world_size=16, rank=13, gpus_per_node=8, tp_size=8, pp_size=2, moe_ep_size=4)
    assert m.tp_groups == [list(range(0, 8)), list(range(8, 16))]
    assert m.pp_groups == [[i, i + 8] for i in range(8)]
    assert m.moe_tp_groups == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert m.moe_ep_groups == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert (m.tp_group, m.pp_group, m.cp_group) == (list(range(8, 16)), [5, 13], [13])
    assert (m.moe_tp_group, m.moe_ep_group, m.moe_cluster_group) == ([9, 13], [12, 13, 14, 15], [12, 13, 14, 15])
    assert (m.has_tp(), m.has_pp(), m.has_cp(), m.has_moe_tp(), m.has_moe_ep(), m.has_moe_cluster()) == (
        True, True, False, True, True, False)
    assert (m.is_first_pp_rank(), m.is_last_pp_rank(), m.is_second_last_pp_rank()) == (False, True, False)
    assert (m.prev_pp_rank(), m.next_pp_rank(), m.get_node_rank(13), m.get_local_rank(13)) == (5, 5, 1, 5)
    assert m.pp_layers(7) == [4, 5, 6] and m.ep_experts(16) == [4, 5, 6, 7]
    # Experts that do not divide: FlashInfer's split would leave 2 of 10 out; the dispatch's ranges have them.
    with pytest.raises(ValueError, match="local_expert_range"):
        m.ep_experts(10)
    assert a2a.local_expert_range(10, 4, 1) == range(3, 6)
    cp = a2a.Mapping(world_size=8, rank=5, tp_size=2, pp_size=2, cp_size=2)
    assert cp.cp_groups == [[0, 2], [1, 3], [4, 6], [5, 7]] and cp.cp_group == [5, 7]


def test_ep_group_split_of_a_larger_world():
    """MoeAlltoAll splits a job-wide CommBackend into this rank's EP group:
    with moe_tp 2 x moe_ep 4 in tp 8 (x pp 2), the ranks of one color are exactly
    one moe_ep group, ordered by moe_ep_rank."""
    from torch_moe_a2a.mapping import ep_group_color

    groups: dict[int, list[tuple[int, int]]] = {}
    for rank in range(16):
        m = a2a.Mapping(world_size=16, rank=rank, tp_size=8, pp_size=2, moe_tp_size=2, moe_ep_size=4)
        color, key = ep_group_color(m)
        assert key == m.moe_ep_rank
        groups.setdefault(color, []).append((key, rank))
    assert len(groups) == 4 and all(sorted(k for k, _ in g) == [0, 1, 2, 3] for g in groups.values())
    for members in groups.values():
        ranks = [r for _, r in sorted(members)]
        m = a2a.Mapping(world_size=16, rank=ranks[0], tp_size=8, pp_size=2, moe_tp_size=2, moe_ep_size=4)
        assert ranks == m.moe_ep_group



def test_moe_alltoall_sizes_from_the_hidden_dtype(device):
    """fp32 hidden states: dtype= sizes for them, and a size made for 16-bit
    ones is refused at construction, not at the first combine. Without dtype,
    as in FlashInfer, a given size is taken whatever hidden_size says (one
    made for quantized hidden states, which hidden_size in 16 bits would
    not fit)."""
    a2a.MoeAlltoAll.clear_workspace_cache()
    half = a2a.MoeAlltoAll.get_moe_workspace_size_per_rank(1, 2, 8, 64)
    full = a2a.MoeAlltoAll.get_moe_workspace_size_per_rank(1, 2, 8, 64, dtype=torch.float32)
    assert full > half
    with pytest.raises(ValueError, match=r"workspace_size_per_rank \d+ is too small for hidden_size 64 of 4-byte"):
        a2a.MoeAlltoAll(a2a.Mapping(), 8, 2, 4, workspace_size_per_rank=half, hidden_size=64, dtype=torch.float32,
                        device=device)
    # NVFP4 hidden states (half a byte an element, a scale byte per 16) with their scales, ids and weights.
    quantized = a2a.moe_a2a_get_workspace_size_per_rank(1, 8, 64 // 2 + 64 // 16 + 2 * 8, 64 * 2)
    assert quantized < half
    taken = a2a.MoeAlltoAll(a2a.Mapping(), 8, 2, 4, workspace_size_per_rank=quantized, hidden_size=64, device=device)
    assert taken.workspace_size_per_rank == quantized
    a2a.MoeAlltoAll.clear_workspace_cache()
    moe = a2a.MoeAlltoAll(a2a.Mapping(), 8, 2, 4, hidden_size=64, dtype=torch.float32, device=device)
    assert moe.workspace_size_per_rank == full
    x = torch.randn((8, 64), generator=make_generator("fp32")).to(device)
    ids = torch.tensor([[0, 1]] * 8, dtype=torch.int32, device=device)
    (recv,) = moe.dispatch(ids, [x], 8)
    out = moe.combine(recv.clone(), 8)
    assert torch.equal(out, x)
    a2a.MoeAlltoAll.clear_workspace_cache()


def test_reset_recovers_after_a_timeout():
    """A rank times out waiting for a silent peer; after reset() on every rank
    (no rank inside a call), the pair round-trips again with the same metainfo."""
    import threading

    size = a2a.MoeAlltoAll.get_moe_workspace_size_per_rank(2, TOP_K, 4, HIDDEN)
    workspace = a2a.allocate_workspace(size, ep_size=2)
    ranks = [a2a.MoeAlltoAll(a2a.Mapping(world_size=2, rank=r, tp_size=2, moe_ep_size=2), 4, TOP_K, NUM_EXPERTS,
                             workspace=workspace, timeout_s=0.5) for r in range(2)]
    ids = torch.tensor([[0, 5, 9, 2]], dtype=torch.int32)  # experts on both ranks
    hidden = torch.randn((1, HIDDEN), generator=make_generator("reset")).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"rank 0: peers \[1\] did not arrive"):
        ranks[0].dispatch(ids, [hidden, ids], 1)  # rank 1 never dispatches
    with pytest.raises(RuntimeError, match="did not arrive"):
        ranks[0].check()
    metainfo = [moe.metainfo for moe in ranks]
    for moe in ranks:
        moe.reset()
    ranks[0].check()  # the record is gone
    outputs = [None, None]

    def round_trip(r):
        (recv_x, _) = ranks[r].dispatch(ids, [hidden, ids], 1)
        outputs[r] = ranks[r].combine(recv_x.clone(), 1)

    threads = [threading.Thread(target=round_trip, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = (hidden.float() * 2).to(torch.bfloat16)  # each token reaches both ranks, each returns it
    assert all(torch.equal(out, expected) for out in outputs)
    assert all(moe.metainfo is m for moe, m in zip(ranks, metainfo))


# ---- FlashInfer's names around the workspace --------------------------------------------------


def test_workspace_sizes_as_flashinfers_test():
    """FlashInfer's test_moe_workspace_size_per_rank (tests/comm/test_trtllm_moe_alltoall.py:1537-1586,
    flashinfer-ai/flashinfer fb28d7242) on this package's names: the zero-payload
    size is get_moe_alltoall_module()'s aux data size, the payload planes add
    exactly their bytes, and MoeAlltoAll sizes as its static method does."""
    ep_size, num_tokens, hidden_size, topk = 8, 10, 128, 2
    raw = a2a.moe_a2a_get_workspace_size_per_rank(ep_size, num_tokens, hidden_size * 2 + topk * 4 + topk * 4,
                                                  hidden_size * 2)
    assert raw > 0 and raw == a2a.MoeAlltoAll.get_moe_workspace_size_per_rank(ep_size, topk, num_tokens, hidden_size)
    empty = a2a.moe_a2a_get_workspace_size_per_rank(ep_size, num_tokens, 0, 0)
    assert empty > 0 and empty == a2a.get_moe_alltoall_module().moe_a2a_get_aux_data_size(ep_size, num_tokens)
    full = a2a.moe_a2a_get_workspace_size_per_rank(ep_size, num_tokens, hidden_size, hidden_size)
    assert full - empty == hidden_size * ep_size * num_tokens * 2
    assert (a2a.get_moe_alltoall_module().moe_a2a_get_aux_data_size(ep_size, num_tokens, 16)
            == a2a.moe_a2a_get_workspace_size_per_rank(ep_size, num_tokens, 0, 0, 16))
    a2a.MoeAlltoAll.clear_workspace_cache()
    mapping = a2a.Mapping(rank=0, world_size=1)
    moe = a2a.MoeAlltoAll(mapping, num_tokens, topk, ep_size, hidden_size=hidden_size, device="cpu")
    assert moe.workspace_size_per_rank == a2a.MoeAlltoAll.get_moe_workspace_size_per_rank(
        mapping.moe_ep_size, topk, num_tokens, hidden_size)
    a2a.MoeAlltoAll.clear_workspace_cache()


@pytest.mark.parametrize("name", sorted(a2a.api.MoeAlltoAllModule.INSTEAD))
def test_moe_alltoall_module_names_flashinfers_layout_entries(name):
    module = a2a.get_moe_alltoall_module()
    assert module is a2a.get_moe_alltoall_module("trtllm")
    with pytest.raises(AttributeError, match=f"{name} is an entry of FlashInfer's JIT module.*use torch_moe_a2a"):
        getattr(module, name)
    assert not hasattr(module, name)


def test_moe_alltoall_module_cache_clear_as_in_flashinfer():
    """FlashInfer's get_moe_alltoall_module has cache_clear() (its module is
    cached per device), which callers written against it call before
    rebuilding; ours has it too, and the module after it is the same one."""
    module = a2a.get_moe_alltoall_module()
    assert a2a.get_moe_alltoall_module.cache_clear() is None
    assert a2a.get_moe_alltoall_module() is module
    assert module.moe_a2a_get_aux_data_size(2, 8) > 0


@pytest.mark.parametrize("backend, error", [("cake", ValueError), ("nccl", ValueError)])
def test_moe_alltoall_module_refuses_other_backends(backend, error):
    with pytest.raises(error, match="backend"):
        a2a.get_moe_alltoall_module(backend)


def test_get_workspace_is_the_instances_workspace(device):
    """MoeAlltoAll.get_workspace: FlashInfer's cache entry, the same workspace
    and metainfo the instances of that geometry hold."""
    a2a.MoeAlltoAll.clear_workspace_cache()
    moe = _ep1(device)
    entry = a2a.MoeAlltoAll.get_workspace(moe.workspace_size_per_rank, 0, 1, 8, a2a.Mapping(), device=device)
    assert entry["workspace"] is moe.workspace and entry["metainfo"] is moe.metainfo
    assert {k: entry[k] for k in ("workspace_size_per_rank", "ep_rank", "ep_size", "max_num_tokens",
                                  "eplb_stats_num_experts")} == {
        "workspace_size_per_rank": moe.workspace_size_per_rank, "ep_rank": 0, "ep_size": 1, "max_num_tokens": 8,
        "eplb_stats_num_experts": 0}
    with pytest.raises(KeyError, match="mnnvl_mem is FlashInfer's MnnvlMemory"):
        entry["mnnvl_mem"]
    other = a2a.MoeAlltoAll.get_workspace(moe.workspace_size_per_rank, 0, 1, 4, a2a.Mapping(), device=device)
    assert other["workspace"] is not moe.workspace  # another max_num_tokens, another workspace
    with pytest.raises(ValueError, match=r"mapping's \(moe_ep_rank, moe_ep_size\) = \(0, 1\) differ from \(0, 2\)"):
        a2a.MoeAlltoAll.get_workspace(moe.workspace_size_per_rank, 0, 2, 8, a2a.Mapping(), device=device)
    a2a.MoeAlltoAll.clear_workspace_cache()


@pytest.mark.parametrize("bad", ["device", "contiguity"])
def test_combine_checks_output_before_metainfo(bad, device):
    """FlashInfer's test_moe_a2a_combine_rejects_cpu_output_before_jit and
    ..._noncontiguous_output_before_jit (tests/comm/test_trtllm_moe_alltoall.py:197-243,
    fb28d7242): an empty workspace and metainfo, a bad output; the output's
    error comes first. A CPU workspace has a CPU output: the bad device is
    another one there (FlashInfer's message on CUDA)."""
    workspace = torch.empty(0, device=device)
    if bad == "device":
        output, match = torch.empty((1, 1), device="meta" if device == "cpu" else "cpu"), \
            f"output must be a {device.upper()} tensor"
    else:
        output, match = torch.empty((2, 2), device=device).T, "output must be contiguous"
    payload = torch.empty((1, 1, output.shape[1]), device=device)
    with pytest.raises(ValueError, match=match):
        a2a.moe_a2a_combine(payload, 1, workspace, torch.empty(0), 1, 0, 1, 1, 0, output=output)


# ---- NVLinkOneSidedAlltoAll in one process ---------------------------------------------------


def _one_sided(device, num_experts=4, **config):
    params = MoEEpCommParams(num_experts=num_experts, top_k=2, max_tokens_per_rank=8, hidden_size=64)
    return a2a.NVLinkOneSidedAlltoAll(BootstrapConfig(world_size=1, rank=0), params,
                                      NVLinkOneSidedConfig(**config), device=device)


def test_one_sided_reset_after_an_abandoned_round(device):
    """An instance destroyed between its dispatch and combine (an exception
    unwinding the layer): the next instance of the geometry shares the
    workspace, whose error says to call reset(); the instance has one, and a
    round trip works after it."""
    a2a.MoeAlltoAll.clear_workspace_cache()
    gen = make_generator("one-sided reset")
    x = torch.randn((5, 64), generator=gen).to(torch.bfloat16).to(device)
    ids = torch.randint(0, 4, (5, 2), generator=gen, dtype=torch.int32).to(device)
    first = _one_sided(device)
    first.dispatch(x, ids)
    first.destroy()
    del first
    second = _one_sided(device)
    with pytest.raises(RuntimeError, match="call reset\\(\\) on every rank"):
        second.dispatch(x, ids)
    second.reset()
    got = second.dispatch(x, ids, max_tokens_per_rank=5)
    out = second.combine((got.hidden_states.float() * 2).to(torch.bfloat16))
    assert torch.equal(out, (x.float() * 2).to(torch.bfloat16))
    second.destroy()
    a2a.MoeAlltoAll.clear_workspace_cache()


def test_one_sided_round_trip_and_misuse(device):
    """One rank: every token's only destination is this rank, so the combine
    returns the expert rows; then FlashInfer's refusals, in its words."""
    a2a.MoeAlltoAll.clear_workspace_cache()
    comm = _one_sided(device, eplb_stats_num_experts=4)
    assert comm.num_local_experts == 4 and comm.is_workload_feasible(8) and not comm.is_workload_feasible(9)
    gen = make_generator("one-sided")
    x = torch.randn((5, 64), generator=gen).to(torch.bfloat16).to(device)
    ids = torch.randint(0, 4, (5, 2), generator=gen).to(device)  # int64: sent as int32
    with pytest.raises(RuntimeError, match="combine called before dispatch; call dispatch first"):
        comm.combine(torch.zeros(8, 64, dtype=torch.bfloat16, device=device))
    got = comm.dispatch(x, ids, None, max_tokens_per_rank=6, eplb_local_stats=torch.arange(4, dtype=torch.int32,
                                                                                          device=device))
    assert got.topk_weights is None and got.hidden_states_scale is None and got.tokens_per_rank == 6
    assert got.hidden_states.shape == (6, 64) and got.topk_ids.dtype == torch.int32
    assert torch.equal(got.topk_ids[:5].cpu(), ids.int().cpu()) and bool((got.topk_ids[5:] == -1).all())
    assert torch.equal(got.eplb_gathered_stats.cpu(), torch.arange(4, dtype=torch.int32).view(1, 4))
    with pytest.raises(RuntimeError, match="dispatch called twice without an intervening combine"):
        comm.dispatch(x, ids, max_tokens_per_rank=6)
    with pytest.raises(ValueError, match="expert_output must be 2D or 3D"):
        comm.combine(got.hidden_states.view(-1))
    # Only the valid rows: they viewed as [1, 6, -1] rows of another hidden size, summed into garbage.
    with pytest.raises(ValueError, match=r"expert_output must have one row per received row, \[ep_size \* "
                                         r"tokens_per_rank = 6, hidden\], got shape \(5, 64\)"):
        comm.combine(got.hidden_states[:5])
    out = comm.combine((got.hidden_states.float() * 3).to(torch.bfloat16))
    assert torch.equal(out, (x.float() * 3).to(torch.bfloat16))
    # A second combine of the dispatch: refused by what happened, not as one before any dispatch.
    with pytest.raises(RuntimeError, match="combine called twice after one dispatch: each combine of this class "
                                           "closes its dispatch's round; dispatch again"):
        comm.combine(got.hidden_states)
    with pytest.raises(RuntimeError, match="get_combine_input_buffer called before dispatch"):
        comm.get_combine_input_buffer(torch.bfloat16)
    with pytest.raises(ValueError, match=r"max_tokens_per_rank=9 must be in \(0, 8\]"):
        comm.dispatch(x, ids, max_tokens_per_rank=9)
    with pytest.raises(ValueError, match="topk_ids must be an int32 or int64 tensor, got torch.float32"):
        comm.dispatch(x, ids.float() + 0.9)  # truncated to other experts before
    comm.destroy()
    with pytest.raises(RuntimeError, match="NVLinkOneSidedAlltoAll has been destroyed"):
        comm.dispatch(x, ids)
    a2a.MoeAlltoAll.clear_workspace_cache()


@pytest.mark.parametrize("call, match", [
    (lambda c, x, ids, w: c.dispatch(x, ids, w, max_tokens_per_rank="6"),
     "NVLinkOneSidedAlltoAll.dispatch: max_tokens_per_rank must be an int, got '6'"),
    (lambda c, x, ids, w: c.dispatch(x, ids, w, max_tokens_per_rank=6.0),
     "NVLinkOneSidedAlltoAll.dispatch: max_tokens_per_rank must be an int, got 6.0"),
    (lambda c, x, ids, w: c.dispatch(x.tolist(), ids, w),
     "NVLinkOneSidedAlltoAll.dispatch: hidden_states must be a tensor, got list"),
    (lambda c, x, ids, w: c.dispatch(x, ids, w[:2]),
     r"NVLinkOneSidedAlltoAll.dispatch: topk_weights must have a row per token, \[local_num_tokens=5 "
     r"\(topk_ids' rows\), \*\], got shape \(2, 2\)"),
    (lambda c, x, ids, w: c.dispatch(x, ids, w, hidden_states_scale=torch.ones(4, 2, device=x.device)),
     r"hidden_states_scale must have a row per token, \[local_num_tokens=5"),
    (lambda c, x, ids, w: c.dispatch(x[0], ids, w), r"hidden_states must have a row per token, .* got shape \(64,\)"),
    (lambda c, x, ids, w: c.combine(c.dispatch(x, ids, w).hidden_states.tolist()),
     "NVLinkOneSidedAlltoAll.combine: expert_output must be a tensor, got list"),
], ids=["tokens_str", "tokens_float", "hidden_list", "weights_rows", "scale_rows", "hidden_1d", "combine_list"])
def test_one_sided_names_its_own_arguments(call, match, device):
    """A str max_tokens_per_rank failed on a comparison (TypeError), a float
    was refused as runtime_max_tokens_per_rank, a list expert_output failed on
    .dim() (AttributeError), and the rows were refused as input_payloads[i], a
    list the caller never built. Each now names the argument; the instance
    then makes a round trip."""
    a2a.MoeAlltoAll.clear_workspace_cache()
    comm = _one_sided(device)
    gen = make_generator(("one-sided arguments", match))
    x = torch.randn((5, 64), generator=gen).to(torch.bfloat16).to(device)
    ids = torch.randint(0, 4, (5, 2), generator=gen, dtype=torch.int32).to(device)
    w = torch.rand((5, 2), generator=gen).to(device)
    with pytest.raises(ValueError, match=match):
        call(comm, x, ids, w)
    if "combine" not in match:  # a refused combine leaves its dispatch's round open; a refused dispatch none
        comm.dispatch(x, ids, w)
    got = comm.combine(torch.ones(8, 64, dtype=torch.bfloat16, device=device))  # 8: params.max_tokens_per_rank
    assert torch.equal(got.cpu(), torch.ones(5, 64, dtype=torch.bfloat16))
    comm.destroy()
    a2a.MoeAlltoAll.clear_workspace_cache()


def test_one_sided_int64_ids_beyond_int32_stay_invalid(device):
    """int64 ids travel as int32: one beyond int32 becomes the nearest int32, an
    invalid id too (the plain conversion made 2**32 + 1 expert 1, routed and
    received as such)."""
    a2a.MoeAlltoAll.clear_workspace_cache()
    comm = _one_sided(device)
    x = torch.randn((3, 64), generator=make_generator("wide-ids")).to(torch.bfloat16).to(device)
    ids = torch.tensor([[2**32 + 1, 2], [1, -(2**32) + 3], [2**32 + 1, -(2**32) + 1]], dtype=torch.int64)
    got = comm.dispatch(x, ids.to(device))
    # Tokens 0 and 1 have a valid expert each, so they arrive with their ids clamped; token 2 has none.
    assert int(comm.alltoall.recv_counts[0]) == 2
    assert got.topk_ids[:2].cpu().tolist() == [[2**31 - 1, 2], [1, -(2**31)]]
    out = comm.combine(got.hidden_states)
    assert torch.equal(out[:2].cpu(), x[:2].cpu()) and not bool(out[2].any())
    comm.destroy()
    a2a.MoeAlltoAll.clear_workspace_cache()


@pytest.mark.parametrize("make, match", [
    (lambda: _one_sided("cpu", extra_payload_bytes_per_token=-1), "extra_payload_bytes_per_token must be non-neg"),
    (lambda: a2a.NVLinkOneSidedAlltoAll(BootstrapConfig(world_size=3, rank=0, process_group=_FakeComm(0, 3)),
                                        MoEEpCommParams(num_experts=4, top_k=2, max_tokens_per_rank=8,
                                                        hidden_size=64)), r"num_experts \(4\) divisible by the EP"),
    (lambda: MoEEpCommParams(num_experts=4, top_k=5, max_tokens_per_rank=8, hidden_size=64), "exceeds num_experts"),
    (lambda: MoEEpCommParams(num_experts=4, top_k=2, max_tokens_per_rank=8, hidden_size=64, invalid_expert_id=3),
     "invalid_expert_id must lie outside"),
    (lambda: MoEEpCommParams(num_experts=4, top_k=2, max_tokens_per_rank=0, hidden_size=64),
     "max_tokens_per_rank must be a positive int"),
    (lambda: MoEEpCommParams(num_experts=4, top_k=2, max_tokens_per_rank=8, hidden_size=64, dispatch_format="FP3"),
     "dispatch_format must be one of"),
    (lambda: BootstrapConfig(world_size=2, rank=2), r"rank 2 not in \[0, 2\)"),
    # Raw TypeErrors and AttributeErrors, or accepted (2.0, True), before.
    (lambda: BootstrapConfig(world_size="2", rank=0), "BootstrapConfig: world_size must be an int, got '2'"),
    (lambda: BootstrapConfig(world_size=True, rank=0), "BootstrapConfig: world_size must be an int, got True"),
    (lambda: MoEEpCommParams(num_experts=4, top_k=2, max_tokens_per_rank=8, hidden_size=64, dtype="bf16"),
     "MoEEpCommParams.dtype must be a torch.dtype or None, got 'bf16'"),
    (lambda: MoEEpCommParams(num_experts=4, top_k=2, max_tokens_per_rank=8, hidden_size=64, invalid_expert_id=2**40),
     "invalid_expert_id must fit int32"),
    (lambda: _one_sided("cpu", extra_payload_bytes_per_token="8"),
     "NVLinkOneSidedConfig: extra_payload_bytes_per_token must be an int, got '8'"),
])
def test_one_sided_refuses_what_flashinfer_refuses(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_one_sided_config_kernel(device):
    """NVLinkOneSidedConfig's kernel field (flashinfer/moe_ep/backends/split/comm/
    nvlink_one_sided/config.py, flashinfer-ai/flashinfer 201a959: the
    communication passes it to MoeAlltoAll as backend=): "trtllm" round-trips,
    "cake" is refused as backend="cake" is. It was an unexpected keyword."""
    a2a.MoeAlltoAll.clear_workspace_cache()
    assert NVLinkOneSidedConfig().kernel == "trtllm"
    comm = _one_sided(device, kernel="trtllm")
    x = torch.randn((3, 64), generator=make_generator("kernel")).to(torch.bfloat16).to(device)
    got = comm.dispatch(x, torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32, device=device))
    assert torch.equal(comm.combine(got.hidden_states).cpu(), x.cpu())
    comm.destroy()
    with pytest.raises(ValueError, match='backend="cake" requires compute capability 10.0 or 10.3'):
        _one_sided("cpu", kernel="cake")
    with pytest.raises(ValueError, match="unknown MoE all-to-all backend 'nccl'"):
        _one_sided("cpu", kernel="nccl")
    a2a.MoeAlltoAll.clear_workspace_cache()


def test_moe_ep_registry_as_flashinfer():
    """FlashInfer's moe_ep entry points (core/comm/communication.py): the
    backend registry, create_communication by name or by config (options
    forwarded), and the errors for what names no backend."""
    assert issubclass(a2a.NVLinkOneSidedAlltoAll, moe_ep.MoEEpCommunication)
    assert a2a.NVLinkOneSidedAlltoAll.backend_name == "nvlink_one_sided"
    assert moe_ep.available_communication_backends() == ["nvlink_one_sided"]
    assert moe_ep.is_communication_backend("nvlink_one_sided") and moe_ep.is_communication_backend(
        NVLinkOneSidedConfig())
    assert not moe_ep.is_communication_backend("deepep") and not moe_ep.is_communication_backend(3)
    assert moe_ep.communication_backend_name(NVLinkOneSidedConfig()) == "nvlink_one_sided"
    bootstrap = BootstrapConfig(world_size=1, rank=0)
    params = MoEEpCommParams(num_experts=4, top_k=2, max_tokens_per_rank=8, hidden_size=64)
    a2a.MoeAlltoAll.clear_workspace_cache()
    by_name = moe_ep.create_communication(bootstrap, params, "nvlink_one_sided", device="cpu")
    assert isinstance(by_name, a2a.NVLinkOneSidedAlltoAll) and by_name.config == NVLinkOneSidedConfig()
    x = torch.randn((3, 64), generator=make_generator("registry")).to(torch.bfloat16)
    got = by_name.dispatch(x, torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32))
    assert torch.equal(by_name.combine(got.hidden_states), x)
    by_name.destroy()
    with pytest.raises(KeyError, match=r"unknown communication backend 'deepep'; available: \['nvlink_one_sided'\]"):
        moe_ep.create_communication(bootstrap, params, "deepep")
    with pytest.raises(TypeError, match="backend must be a string or have a .backend_name str attr"):
        moe_ep.create_communication(bootstrap, params, 3)

    @moe_ep.register_communication("test_backend")
    class Custom(moe_ep.MoEEpCommunication):
        @classmethod
        def is_platform_supported(cls):
            return False

        def dispatch(self, hidden_states, topk_ids, topk_weights=None, **kwargs):
            raise AssertionError

        def combine(self, expert_output, *, output=None, **kwargs):
            raise AssertionError

    try:
        assert Custom.backend_name == "test_backend" and moe_ep.is_communication_backend("test_backend")
        assert moe_ep.available_communication_backends() == ["nvlink_one_sided"]  # not on this platform
        with pytest.raises(RuntimeError, match="Custom is not supported on this platform"):
            moe_ep.create_communication(bootstrap, params, "test_backend")
    finally:
        moe_ep._COMMUNICATION_REGISTRY.pop("test_backend")
    a2a.MoeAlltoAll.clear_workspace_cache()


def test_one_sided_cft_release_surface(caplog):
    """The fields and methods of FlashInfer's CFT release of the one-sided
    backend: cft and its token limits accepted (never enabled here; cft=True
    logs why), timeout_sec the wait bound, active_rank_mask of the
    instance's EP size, and the checks FlashInfer makes of each."""
    a2a.MoeAlltoAll.clear_workspace_cache()
    config = NVLinkOneSidedConfig()
    assert (config.cft, config.cft_max_tokens_for_dispatch, config.cft_max_tokens_for_combine,
            config.timeout_sec) == (None, 128, 128, None)
    comm = _one_sided("cpu", timeout_sec=7, cft_max_tokens_for_dispatch=0)
    assert not comm.cft_enabled and comm.alltoall.timeout_s == 7
    assert _one_sided("cpu").alltoall.timeout_s is None  # MOE_A2A_TIMEOUT_S, else 30 s
    assert torch.equal(comm.active_rank_mask([0]), a2a.moe_a2a_active_rank_mask([0], 1))
    assert torch.equal(comm.active_rank_mask(torch.tensor([0.0])), a2a.moe_a2a_active_rank_mask([0], 1))  # int()
    with pytest.raises(ValueError, match=r"rank 1 out of range \[0, 1\)"):
        comm.active_rank_mask([1])
    with caplog.at_level("WARNING", logger="torch_moe_a2a.moe_ep"):
        assert not _one_sided("cpu", cft=None).cft_enabled and not _one_sided("cpu", cft=False).cft_enabled
        assert "CFT" not in caplog.text
        assert not _one_sided("cpu", cft=True).cft_enabled
    assert "CFT counted writes disabled" in caplog.text
    for bad, error, match in [
        (dict(timeout_sec=0), ValueError, r"timeout_sec must be in 1..86400, got 0"),
        (dict(timeout_sec=86401), ValueError, r"timeout_sec must be in 1..86400"),
        (dict(timeout_sec=2.5), TypeError, r"timeout_sec must be an integer number of seconds, got 2.5"),
        (dict(timeout_sec=True), TypeError, r"timeout_sec must be an integer number of seconds"),
        (dict(cft_max_tokens_for_combine=-1), ValueError, r"CFT token-count limits must be non-negative"),
        (dict(cft_max_tokens_for_dispatch=1.0), ValueError, r"cft_max_tokens_for_dispatch must be an int"),
        (dict(eplb_stats_num_experts=5), ValueError, r"eplb_stats_num_experts must be in \[0, num_experts=4\]"),
    ]:
        with pytest.raises(error, match=match):
            _one_sided("cpu", **bad)
    # A single rank has no group: nothing to release (FlashInfer's MNNVL memory always has one).
    with pytest.raises(RuntimeError, match="checkpoint"):
        comm.checkpoint_prepare()
    comm.destroy()
    with pytest.raises(RuntimeError, match="has been destroyed"):
        comm.checkpoint_prepare()
    a2a.MoeAlltoAll.clear_workspace_cache()


@pytest.mark.parametrize("fmt, expected", [(None, 64 * 2), ("NVFP4", 32 + 4), ("MXFP8", 64 + 2),
                                           ("DeepSeekFp8", 64 + 4)])
def test_one_sided_dispatch_bytes_per_token(fmt, expected):
    """MoEEpCommParams.dispatch_bytes_per_token: the values and their block
    scales, by FlashInfer's format names (hidden 64)."""
    params = MoEEpCommParams(num_experts=4, top_k=2, max_tokens_per_rank=8, hidden_size=64, dispatch_format=fmt)
    assert params.dispatch_bytes_per_token == expected


def test_copies_of_an_instance_share_its_workspace():
    """copy.deepcopy of a model that holds a MoeAlltoAll (a reference or EMA
    copy) gives instances on the same workspace, so the copies' round trips
    meet their peers; a copy opens no round of its own; pickling (torch.save
    of the model) is refused with an error that names the class."""
    ep_size, tokens, hidden, num_experts, top_k = 2, 5, 8, 4, 2
    sim = a2a.SimulatedEP(ep_size, tokens, dispatch_bytes_per_token=4 * hidden,
                          combine_bytes_per_token=4 * hidden, timeout_s=5)
    layers = [torch.nn.Module() for _ in range(ep_size)]
    for r, layer in enumerate(layers):
        layer.a2a = a2a.MoeAlltoAll(ep_mapping(r, ep_size), tokens, top_k, num_experts, workspace=sim.workspace,
                                    timeout_s=5)
    copies = copy.deepcopy(layers)
    assert all(c.a2a.workspace is layer.a2a.workspace for c, layer in zip(copies, layers))
    gen = make_generator("deepcopy")
    ids = [torch.randint(0, num_experts, (tokens, top_k), generator=gen, dtype=torch.int32) for _ in range(ep_size)]
    x = [torch.randn(tokens, hidden, generator=gen) for _ in range(ep_size)]

    def round_trip(rank, holders):
        (recv,) = holders[rank].a2a.dispatch(ids[rank], [x[rank]], tokens)
        return holders[rank].a2a.combine(recv * 3, tokens)

    for holders in (copies, layers, copies):
        outs = sim.run(lambda r, holders=holders: round_trip(r, holders))
        for r in range(ep_size):
            reached = (ids[r] // 2).sort(dim=1).values.diff(dim=1).ne(0).sum(dim=1) + 1  # experts 0-1: rank 0
            torch.testing.assert_close(outs[r], x[r] * 3 * reached[:, None], rtol=0, atol=0)

    # A shallow copy taken inside a round has none open: the original closes it.
    moe = _ep1("cpu")
    ids1, hidden1 = torch.tensor([[0, 1]], dtype=torch.int32), torch.ones((1, 64), dtype=torch.bfloat16)
    moe.dispatch(ids1, [hidden1], 1)
    shallow = copy.copy(moe)
    with pytest.raises(RuntimeError, match="MoeAlltoAll.combine called before dispatch"):
        shallow.combine(torch.zeros((1, 1, 64), dtype=torch.bfloat16), 1)
    with pytest.raises(RuntimeError, match="another MoeAlltoAll sharing this workspace"):
        shallow.dispatch(ids1, [hidden1], 1)
    assert moe.combine(torch.ones((1, 1, 64), dtype=torch.bfloat16), 1).sum() == 64
    with pytest.raises(TypeError, match="MoeAlltoAll cannot be pickled"):
        pickle.dumps(moe)
    with pytest.raises(TypeError, match="MoeAlltoAll cannot be pickled"):
        torch.save(layers[0], io.BytesIO())


def test_a_round_left_open_by_a_deleted_instance_asks_for_reset():
    """An instance deleted between its dispatch and its combine (an exception
    in the experts, then the layer built again) leaves the shared workspace's
    round open: the instance that shares it next is told to reset(), which
    starts over, instead of being sent between 'combine first' and
    'dispatch first'."""
    a2a.MoeAlltoAll.clear_workspace_cache()
    gen = make_generator("abandoned-round")
    ids = torch.randint(0, 4, (8, 2), generator=gen, dtype=torch.int32)
    hidden = torch.randn((8, 64), generator=gen).to(torch.bfloat16)
    first = _ep1("cpu")
    first.dispatch(ids, [hidden], 8)
    del first
    gc.collect()
    second = _ep1("cpu")
    for call in (lambda: second.dispatch(ids, [hidden], 8),
                 lambda: second.combine(torch.zeros((1, 8, 64), dtype=torch.bfloat16), 8)):
        with pytest.raises(RuntimeError, match=r"deleted \(or garbage collected\) before its combine.*call reset\(\)"):
            call()
    second.reset()
    (recv,) = second.dispatch(ids, [hidden], 8)
    torch.testing.assert_close(second.combine(recv * 2, 8), hidden * 2, rtol=0, atol=0)
    a2a.MoeAlltoAll.clear_workspace_cache()


def test_threads_building_one_geometry_share_one_workspace():
    """Layers built by a thread pool: instances of one geometry built at once
    in several threads share one workspace, as built one after the other."""
    a2a.MoeAlltoAll.clear_workspace_cache()
    built = [None] * 4
    start = threading.Barrier(len(built))

    def build(i):
        start.wait()
        built[i] = a2a.MoeAlltoAll(a2a.Mapping(), 16, 2, 4, hidden_size=4096, device="cpu")

    threads = [threading.Thread(target=build, args=(i,)) for i in range(len(built))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(m is not None and m.workspace is built[0].workspace for m in built)
    assert all(m.metainfo is built[0].metainfo for m in built)
    a2a.MoeAlltoAll.clear_workspace_cache()


def test_eplb_none_means_no_eplb_as_in_tensorrt_llm(device):
    """TensorRT-LLM passes ``None`` as the EPLB length when EPLB is off
    (tensorrt_llm/_torch/modules/fused_moe/communication/nvlink_one_sided.py,
    NVLinkOneSided: ``get_aux_data_size(ep_size, max_num_tokens, None)`` in
    calculate_required_workspace_size, ``moe_a2a_initialize(..., None)``,
    ``eplb_stats_num_experts = num_experts`` with ``num_experts=None``): on
    this package's sizing, initialize and MoeAlltoAll it is 0, no EPLB."""
    module = a2a.get_moe_alltoall_module()
    assert module.moe_a2a_get_aux_data_size(4, 8, None) == module.moe_a2a_get_aux_data_size(4, 8)
    assert (a2a.moe_a2a_get_workspace_size_per_rank(4, 8, 200, 128, None)
            == a2a.moe_a2a_get_workspace_size_per_rank(4, 8, 200, 128))
    assert (a2a.MoeAlltoAll.get_moe_workspace_size_per_rank(4, 2, 8, 64, 0, None)
            == a2a.MoeAlltoAll.get_moe_workspace_size_per_rank(4, 2, 8, 64))
    size = a2a.moe_a2a_get_workspace_size_per_rank(1, 4, 64 * 2 + 8, 128)
    workspace = a2a.allocate_workspace(size, ep_size=1, device=device)
    metainfo = a2a.moe_a2a_initialize(workspace, 0, 1, 4, None)
    ids = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    hidden = torch.randn((1, 64), device=device).to(torch.bfloat16)
    recv, offset, stats = a2a.moe_a2a_dispatch(ids, [hidden], workspace, metainfo, 1, 0, 1, 2, 4)
    assert stats is None
    out = a2a.moe_a2a_combine(recv[0].clone(), 1, workspace, metainfo, 1, 0, 1, 2, offset)
    assert torch.equal(out, hidden)
    a2a.MoeAlltoAll.clear_workspace_cache()
    moe = _ep1(device, eplb_stats_num_experts=None)
    assert moe.eplb_stats_num_experts == 0 and not moe.enable_eplb
    assert moe.workspace is _ep1(device).workspace  # the geometry of eplb_stats_num_experts=0
    (recv,) = moe.dispatch(ids, [hidden], 1)
    assert moe.eplb_gathered_stats is None
    assert torch.equal(moe.combine(recv.clone(), 1), hidden)
    a2a.MoeAlltoAll.clear_workspace_cache()
