"""Every bad argument of DESIGN.md section 6 raises a clear error before any kernel
runs and leaves the workspace bytes unchanged. Calls are single-rank (ep_size 1)
or fail validation, so nothing waits; a short timeout turns a missing check into
a fast failure instead of a wait."""

import contextlib
import math
import re
import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import (
    Case,
    PayloadSpec,
    assert_bytes_equal,
    assert_ws_unchanged,
    ep_mapping,
    header_i32,
    make_generator,
    make_inputs,
    make_sim,
    random_tensor,
    round_trip,
    ws_snapshot,
)

import torch_moe_a2a as a2a
from torch_moe_a2a import layout, reference
from torch_moe_a2a.layout import MAX_TIMEOUT_S

BAD = (ValueError, RuntimeError)


@pytest.fixture(autouse=True)
def _short_timeout(monkeypatch):
    monkeypatch.setenv("MOE_A2A_TIMEOUT_S", "1")


@dataclass
class Env:
    case: Case
    workspace: torch.Tensor
    metainfo: torch.Tensor
    ids: torch.Tensor
    payloads: list
    device: str
    eplb_n: int

    def dispatch_args(self) -> dict:
        return dict(
            token_selected_experts=self.ids,
            input_payloads=list(self.payloads),
            workspace=self.workspace,
            metainfo=self.metainfo,
            runtime_max_tokens_per_rank=self.case.T,
            ep_rank=0,
            ep_size=self.case.ep_size,
            top_k=self.case.top_k,
            num_experts=self.case.num_experts,
        )


def make_env(device, *, ep_size=1, eplb_n=0, seed=0) -> Env:
    case = Case(ep_size, (6,) * ep_size, 4, 8, hidden=64, runtime_max=8, max_num_tokens=10,
                extras=(PayloadSpec(torch.float8_e4m3fn, (32,)),))
    size = a2a.moe_a2a_get_workspace_size_per_rank(ep_size, case.max_tokens, case.dispatch_bytes, case.combine_bytes, eplb_n)
    workspace = torch.zeros(ep_size, size, dtype=torch.uint8, device=device)
    metainfo = a2a.moe_a2a_initialize(workspace, 0, ep_size, case.max_tokens, eplb_n)
    inputs = make_inputs(case, make_generator(seed)).to(device)
    return Env(case, workspace, metainfo, inputs.ids[0], inputs.payloads[0], device, eplb_n)


def expect_error(workspace, fn, exc=BAD, match=None):
    snap = ws_snapshot(workspace)
    with pytest.raises(exc, match=match):
        fn()
    assert_ws_unchanged(workspace, snap)


# ---- dispatch --------------------------------------------------------------------------------


def _set(**kw):
    return lambda env, args: args.update(kw)


def _ids(fn):
    return lambda env, args: args.update(token_selected_experts=fn(env))


def _payloads(fn):
    return lambda env, args: args.update(input_payloads=fn(env))


def _noncontiguous(env):
    wide = torch.cat([env.payloads[0], env.payloads[0]], dim=1)
    return [wide[:, ::2], *env.payloads[1:]]


def _grown_payload(env):
    # 40x the per-token bytes the workspace was sized for.
    big = random_tensor((env.ids.shape[0], env.case.dispatch_bytes * 10), torch.float32, make_generator(1))
    return [big.to(env.device)]


def _other_workspace_dtype(env, args):
    args["workspace"] = env.workspace.view(torch.float32)


DISPATCH_BAD = [
    ("ids_int16", _ids(lambda e: e.ids.to(torch.int16)), r"(?i)token_selected_experts must be torch.int32 or torch.int64"),
    ("ids_1d", _ids(lambda e: e.ids[:, 0].contiguous()), r"(?i)token_selected_experts|top_k|dim|shape"),
    ("ids_wrong_top_k", _ids(lambda e: torch.cat([e.ids, e.ids[:, :1]], 1)), r"(?i)token_selected_experts|top_k"),
    ("top_k_0", _set(top_k=0), r"(?i)top_k"),
    ("top_k_23", lambda env, args: args.update(
        top_k=23, num_experts=30, token_selected_experts=torch.arange(23, dtype=torch.int32, device=env.device)
        .repeat(6, 1)), r"(?i)top_k"),
    ("ep_size_0", _set(ep_size=0), r"(?i)ep_size|workspace"),
    ("ep_size_65", _set(ep_size=65, num_experts=65), r"(?i)ep_size|workspace"),
    ("ep_rank_neg", _set(ep_rank=-1), r"(?i)ep_rank"),
    ("ep_rank_1", _set(ep_rank=1), r"(?i)ep_rank"),
    ("num_experts_0", _set(num_experts=0), r"(?i)num_experts"),
    ("runtime_max_0", _set(runtime_max_tokens_per_rank=0), r"(?i)runtime_max_tokens_per_rank"),
    ("runtime_max_gt_max", _set(runtime_max_tokens_per_rank=11), r"(?i)runtime_max_tokens_per_rank|max_num_tokens"),
    ("runtime_max_lt_local", _set(runtime_max_tokens_per_rank=5), r"(?i)runtime_max_tokens_per_rank|local"),
    ("payloads_9", _payloads(lambda e: [e.payloads[2]] * 9), r"(?i)payload"),
    ("payloads_0", _payloads(lambda e: []), r"(?i)payload"),
    ("payload_leading_dim", _payloads(lambda e: [e.payloads[0][:5], *e.payloads[1:]]), r"(?i)payload|local_num_tokens|leading"),
    ("payload_noncontiguous", _payloads(_noncontiguous), r"(?i)contiguous"),
    ("workspace_too_small", _payloads(_grown_payload), r"(?i)workspace|size|small|bytes"),
    ("workspace_dtype", _other_workspace_dtype, r"(?i)workspace|uint8|dtype"),
    ("workspace_1d", lambda env, args: args.update(workspace=env.workspace.view(-1)), r"(?i)workspace"),
    ("metainfo_garbage", lambda env, args: args.update(metainfo=torch.zeros(layout.META_COUNT, dtype=torch.int64)),
     r"(?i)metainfo|initiali[sz]"),
    ("mask_without_enable", lambda env, args: args.update(active_rank_mask=a2a.moe_a2a_active_rank_mask([0], 1)),
     r"(?i)mask"),
    ("own_rank_masked", lambda env, args: args.update(
        enable_rank_mask=True, active_rank_mask=a2a.moe_a2a_active_rank_mask([], 1)), r"(?i)mask|own|ep_rank"),
    ("mask_wrong_dtype", lambda env, args: args.update(
        enable_rank_mask=True, active_rank_mask=torch.ones(1, dtype=torch.int32)), r"(?i)mask"),
    ("eplb_without_init", lambda env, args: args.update(
        eplb_local_stats=torch.ones(4, dtype=torch.int32, device=env.device)), r"(?i)eplb"),
    ("cake_backend", _set(backend="cake"), r"(?i)cake|capability|blackwell"),
    ("unknown_backend", _set(backend="nccl"), r"(?i)backend"),
    # Arguments of the wrong Python type are named (the C++ fast path's own text would not).
    ("runtime_max_float", _set(runtime_max_tokens_per_rank=8.0), r"runtime_max_tokens_per_rank must be an int"),
    ("top_k_str", _set(top_k="4"), r"top_k must be an int"),
    ("payload_none", _payloads(lambda e: [e.payloads[0], None]), r"input_payloads\[1\] must be a tensor"),
    ("payloads_a_tensor", _payloads(lambda e: e.payloads[0]), r"input_payloads must be a list of tensors"),
    ("ids_none", _set(token_selected_experts=None), r"token_selected_experts must be a tensor, got NoneType"),
    ("workspace_none", _set(workspace=None), r"workspace must be a tensor, got NoneType"),
]


@pytest.mark.parametrize("mutate,match", [pytest.param(m, r, id=i) for i, m, r in DISPATCH_BAD])
def test_dispatch_rejects(mutate, match, device):
    env = make_env(device)
    args = env.dispatch_args()
    mutate(env, args)
    exc = ValueError if "backend" in args else BAD
    expect_error(env.workspace, lambda: a2a.moe_a2a_dispatch(**args), exc, match)
    # Nothing advanced: a correct dispatch + combine still works.
    out, off, _ = a2a.moe_a2a_dispatch(**env.dispatch_args())
    a2a.moe_a2a_combine(out[0], 6, env.workspace, env.metainfo, env.case.T, 0, 1, env.case.top_k, off)


@pytest.mark.parametrize("length", [3, 5])
def test_dispatch_rejects_eplb_length_mismatch(length, device):
    env = make_env(device, eplb_n=4)
    args = env.dispatch_args()
    args["eplb_local_stats"] = torch.ones(length, dtype=torch.int32, device=device)
    expect_error(env.workspace, lambda: a2a.moe_a2a_dispatch(**args), BAD, r"(?i)eplb")


def test_dispatch_rejects_eplb_stats_in_the_workspace(device):
    """The gathered stats of an earlier dispatch (a workspace view that the
    peers write during the next call) passed as the next call's local ones:
    refused, as a payload in the workspace is."""
    env = make_env(device, eplb_n=4)
    _, off, gathered = a2a.moe_a2a_dispatch(**dict(env.dispatch_args(),
                                                   eplb_local_stats=torch.ones(4, dtype=torch.int32, device=device)))
    a2a.moe_a2a_combine(torch.zeros(1, env.case.T, env.case.hidden, device=device), 6, env.workspace, env.metainfo,
                        env.case.T, 0, 1, env.case.top_k, off)
    args = dict(env.dispatch_args(), eplb_local_stats=gathered[0])
    expect_error(env.workspace, lambda: a2a.moe_a2a_dispatch(**args), BAD, "eplb_local_stats lies in the workspace")


def test_dispatch_rejects_eplb_wrong_dtype(device):
    env = make_env(device, eplb_n=4)
    args = env.dispatch_args()
    args["eplb_local_stats"] = torch.ones(4, dtype=torch.int64, device=device)
    expect_error(env.workspace, lambda: a2a.moe_a2a_dispatch(**args), BAD, r"(?i)eplb|int32|dtype")


def test_dispatch_rejects_num_experts_below_ep_size(device):
    env = make_env(device, ep_size=2)
    args = env.dispatch_args()
    args.update(num_experts=1, token_selected_experts=torch.zeros(6, 4, dtype=torch.int32, device=device) + 0)
    expect_error(env.workspace, lambda: a2a.moe_a2a_dispatch(**args), BAD, r"(?i)num_experts")


def test_dispatch_rejects_payload_on_other_device(device):
    other = "cpu" if device == "cuda" else ("cuda" if torch.cuda.is_available() else None)
    if other is None:
        pytest.skip("needs a second device")
    env = make_env(device)
    args = env.dispatch_args()
    args["input_payloads"] = [p.to(other) for p in env.payloads]
    expect_error(env.workspace, lambda: a2a.moe_a2a_dispatch(**args), BAD, r"(?i)device")


def test_meta_tensor_among_real_ones_is_refused(device):
    """A meta tensor routes a call to the Meta kernels, which move nothing: with
    a real workspace that is a device mismatch, refused like any other."""
    env = make_env(device)
    meta_payloads = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in env.payloads]
    for change in (dict(input_payloads=meta_payloads),
                   dict(token_selected_experts=torch.empty(env.ids.shape, dtype=torch.int32, device="meta"))):
        args = env.dispatch_args()
        args.update(change)
        expect_error(env.workspace, lambda: a2a.moe_a2a_dispatch(**args), ValueError, r"(?i)device")
    out, off, _ = a2a.moe_a2a_dispatch(**env.dispatch_args())
    c, T, H = env.case, env.case.T, env.case.hidden
    meta_payload = torch.empty((1, T, H), dtype=torch.bfloat16, device="meta")
    expect_error(env.workspace, lambda: a2a.moe_a2a_combine(meta_payload, 6, env.workspace, env.metainfo, T, 0, 1,
                                                            c.top_k, off), ValueError, r"(?i)device")
    real_payload = out[0].clone()
    meta_output = torch.empty((6, H), dtype=torch.bfloat16, device="meta")
    expect_error(env.workspace, lambda: a2a.moe_a2a_combine(real_payload, 6, env.workspace, env.metainfo, T, 0, 1,
                                                            c.top_k, off, output=meta_output), ValueError,
                 r"(?i)device")
    a2a.moe_a2a_combine(real_payload, 6, env.workspace, env.metainfo, T, 0, 1, c.top_k, off)


# ---- combine -------------------------------------------------------------------------------------


@dataclass
class CombineEnv:
    env: Env
    payload: torch.Tensor
    offset: int

    def args(self) -> dict:
        c = self.env.case
        return dict(
            payload=self.payload,
            local_num_tokens=6,
            workspace=self.env.workspace,
            metainfo=self.env.metainfo,
            runtime_max_tokens_per_rank=c.T,
            ep_rank=0,
            ep_size=1,
            top_k=c.top_k,
            combine_payload_offset=self.offset,
        )


def make_combine_env(device) -> CombineEnv:
    env = make_env(device)
    out, off, _ = a2a.moe_a2a_dispatch(**env.dispatch_args())
    return CombineEnv(env, out[0].clone(), off)


def _payload(fn):
    return lambda ce, args: args.update(payload=fn(ce))


def _grad_output(ce):
    """A valid combine output, but a leaf that requires grad."""
    return torch.zeros(6, 64, dtype=torch.bfloat16, device=ce.env.device, requires_grad=True)


COMBINE_BAD = [
    ("payload_rows", _payload(lambda ce: ce.payload[:, :-1].contiguous()), BAD, r"(?i)payload|runtime_max"),
    ("payload_ranks", _payload(lambda ce: torch.cat([ce.payload, ce.payload]).contiguous()), BAD, r"(?i)payload|ep_size"),
    ("payload_2d", _payload(lambda ce: ce.payload[0].contiguous()), BAD, r"(?i)payload|dim|shape"),
    ("payload_int32", _payload(lambda ce: ce.payload.view(torch.int16).to(torch.int32)), ValueError, r"(?i)dtype|payload|int"),
    ("payload_noncontiguous", _payload(lambda ce: torch.cat([ce.payload, ce.payload], 2)[:, :, ::2]), BAD,
     r"(?i)contiguous"),
    ("payload_too_wide", _payload(lambda ce: torch.cat([ce.payload] * 8, 2).contiguous()), BAD,
     r"(?i)workspace|size|payload|bytes"),
    ("local_tokens_gt_T", _set(local_num_tokens=9), BAD, r"(?i)local_num_tokens|runtime_max"),
    ("runtime_max_0", _set(runtime_max_tokens_per_rank=0), BAD, r"(?i)runtime_max_tokens_per_rank"),
    ("runtime_max_gt_max", _set(runtime_max_tokens_per_rank=11), BAD, r"(?i)runtime_max_tokens_per_rank|max_num_tokens"),
    ("offset_past_end", lambda ce, args: args.update(combine_payload_offset=ce.env.workspace.shape[1]), BAD,
     r"(?i)offset|workspace"),
    ("ep_rank_1", _set(ep_rank=1), BAD, r"(?i)ep_rank"),
    ("output_dtype_fp8_without_scales", _set(output_dtype=torch.float8_e4m3fn), ValueError, r"needs output_scales"),
    ("local_tokens_float", _set(local_num_tokens=6.0), ValueError, r"local_num_tokens must be an int"),
    ("output_not_a_tensor", _set(output=[0.0] * 6), ValueError, r"output must be a tensor or None"),
    # An fp8 payload (output_dtype then defaults to it) is named as the payload's fault.
    ("payload_fp8", _payload(lambda ce: ce.payload.to(torch.float8_e4m3fn)), ValueError, r"payload dtype"),
    ("output_dtype_int32", _set(output_dtype=torch.int32), ValueError, r"(?i)output_dtype|dtype"),
    ("low_precision_fp16_output", _set(use_low_precision=True, output_dtype=torch.float16), ValueError,
     r"use_low_precision combines into torch.bfloat16"),
    ("output_scales_unquantized", lambda ce, args: args.update(output_scales=torch.ones(
        6, 2, dtype=torch.uint8, device=ce.env.device)), ValueError, r"not a quantized output"),
    ("output_scales_extent", lambda ce, args: args.update(output_dtype=torch.float8_e4m3fn, output_scales=torch.ones(
        6, 3, dtype=torch.uint8, device=ce.env.device)), ValueError, r"output_scales must hold 12 scales"),
    ("output_rows", lambda ce, args: args.update(output=torch.empty(7, 64, dtype=torch.bfloat16, device=ce.env.device)),
     BAD, r"(?i)output"),
    ("output_dtype_mismatch", lambda ce, args: args.update(output=torch.empty(6, 64, dtype=torch.float32,
                                                                              device=ce.env.device)),
     ValueError, r"output must be torch.bfloat16, the dtype of the call's result \(output_dtype where the call "
     r"takes it\), got torch.float32"),
    # combine writes into output and has no backward (under torch.no_grad it is accepted).
    ("output_requires_grad", lambda ce, args: args.update(output=_grad_output(ce)), ValueError,
     r"output must not require grad"),
    ("output_with_history", lambda ce, args: args.update(output=_grad_output(ce) * 2), ValueError,
     r"output must not require grad"),
    # A payload that requires grad combines as the differentiable combine,
    # which needs a dispatch of payloads that required grad before it (this
    # one's was not: its received rows are workspace views).
    ("payload_requires_grad", _payload(lambda ce: ce.payload.float().requires_grad_().to(ce.payload.dtype)),
     ValueError, r"the payload requires grad, but this rank's last dispatch on the workspace was not"),
    ("mask_without_enable", lambda ce, args: args.update(active_rank_mask=a2a.moe_a2a_active_rank_mask([0], 1)),
     BAD, r"(?i)mask"),
    ("cake_backend", _set(backend="cake"), ValueError, r"(?i)cake|capability|blackwell"),
    ("unknown_backend", _set(backend="nccl"), ValueError, r"(?i)backend"),
    ("payload_none", _set(payload=None), ValueError, r"payload must be a tensor, got NoneType"),
    ("workspace_none", _set(workspace=None), ValueError, r"workspace must be a tensor, got NoneType"),
]


@pytest.mark.parametrize("mutate,exc,match", [pytest.param(m, e, r, id=i) for i, m, e, r in COMBINE_BAD])
def test_combine_rejects(mutate, exc, match, device):
    ce = make_combine_env(device)
    args = ce.args()
    mutate(ce, args)
    expect_error(ce.env.workspace, lambda: a2a.moe_a2a_combine(**args), exc, match)
    # The pending dispatch is intact: the correct combine still works and is exact
    # (toy check: ep_size 1, every token routed to rank 0 comes back once).
    out = a2a.moe_a2a_combine(**ce.args())
    assert tuple(out.shape) == (6, 64)


def test_a_direct_combine_op_names_the_row_shape_its_payload_must_have():
    """torch.ops.moe_a2a.combine takes the row shape as an argument of its own:
    a payload whose rows differ from it hears which row_shape it must have."""
    T, hidden = 6, 9
    size = a2a.moe_a2a_get_workspace_size_per_rank(2, T, 64, 64)
    workspace = torch.empty(2, size, dtype=torch.uint8, device="meta")
    payload = torch.empty(2, T, 7, dtype=torch.bfloat16, device="meta")
    offset = layout.call_layout(2, T, 0, [64]).combine_offset
    with pytest.raises(ValueError, match=re.escape("payload must be [ep_size, runtime_max_tokens_per_rank, "
                                                   f"*row_shape] with ep_size, runtime_max_tokens_per_rank = 2, "
                                                   f"{T} and row_shape = [{hidden}], got shape [2, {T}, 7]")):
        torch.ops.moe_a2a.combine(payload, 3, workspace, 0, 2, T, T, 2, offset, [hidden], torch.bfloat16,
                                  torch.bfloat16, [], 5.0, 0, False, 0, None, 1.0, 0)


# The bad arguments that the ops (not the Python layer) refuse: torch.compile
# and FakeTensorMode run the Meta kernels instead, which must refuse them too,
# or a compiled call would fail only when its graph first runs.
TRACED_DISPATCH_BAD = {"ids_int16", "ids_1d", "ids_wrong_top_k", "top_k_0", "top_k_23", "num_experts_0",
                       "runtime_max_0", "runtime_max_gt_max", "runtime_max_lt_local", "payloads_9", "payloads_0",
                       "payload_leading_dim", "payload_noncontiguous", "own_rank_masked", "eplb_without_init"}
TRACED_COMBINE_BAD = {"payload_rows", "payload_ranks", "payload_2d", "payload_int32", "payload_noncontiguous",
                      "payload_too_wide", "local_tokens_gt_T", "runtime_max_0", "runtime_max_gt_max",
                      "offset_past_end", "output_dtype_fp8_without_scales", "payload_fp8", "output_dtype_int32",
                      "low_precision_fp16_output", "output_scales_unquantized", "output_scales_extent",
                      "output_rows", "output_dtype_mismatch"}


@contextlib.contextmanager
def _fake_mode():
    """FakeTensorMode, with torch's warning for a fake tensor's data pointer an
    error: torch.compile raises there, where FakeTensorMode alone warns."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            yield mode


def _faked(mode, args: dict) -> dict:
    """``args`` with every tensor a fake one, but the metainfo and the rank
    mask, which the Python layer reads as values."""
    def fake(value):
        if isinstance(value, torch.Tensor):
            return mode.from_tensor(value)
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            return [mode.from_tensor(v) for v in value]
        return value
    return {k: v if k in ("metainfo", "active_rank_mask") else fake(v) for k, v in args.items()}


@pytest.mark.parametrize("mutate,match", [pytest.param(m, r, id=i) for i, m, r in DISPATCH_BAD
                                          if i in TRACED_DISPATCH_BAD])
def test_dispatch_rejects_when_traced(mutate, match):
    env = make_env("cpu")
    args = env.dispatch_args()
    mutate(env, args)
    with _fake_mode() as mode:
        fake_args = _faked(mode, args)
        with pytest.raises(BAD, match=match):
            a2a.moe_a2a_dispatch(**fake_args)


@pytest.mark.parametrize("mutate,exc,match", [pytest.param(m, e, r, id=i) for i, m, e, r in COMBINE_BAD
                                              if i in TRACED_COMBINE_BAD])
def test_combine_rejects_when_traced(mutate, exc, match):
    ce = make_combine_env("cpu")
    args = ce.args()
    mutate(ce, args)
    with _fake_mode() as mode:
        fake_args = _faked(mode, args)
        with pytest.raises(exc, match=match):
            a2a.moe_a2a_combine(**fake_args)
    # The same arguments, valid, trace: the check refuses only what the op refuses.
    with _fake_mode() as mode:
        out = a2a.moe_a2a_combine(**_faked(mode, ce.args()))
    assert tuple(out.shape) == (6, 64)


def test_valid_dispatch_traces():
    env = make_env("cpu")
    with _fake_mode() as mode:
        recv, offset, _ = a2a.moe_a2a_dispatch(**_faked(mode, env.dispatch_args()))
    assert [tuple(r.shape) for r in recv] == [(1, env.case.T, *p.shape[1:]) for p in env.payloads]


# ---- initialize, sizes, sanitize, wrap ---------------------------------------------------------------


INIT_BAD = [
    ("workspace_float", lambda ws: (ws.view(torch.float32), 0, 1, 10, 0), r"(?i)workspace|uint8|dtype"),
    ("workspace_1d", lambda ws: (ws.view(-1), 0, 1, 10, 0), r"(?i)workspace"),
    ("ep_rank_out_of_range", lambda ws: (ws, 1, 1, 10, 0), r"(?i)ep_rank"),
    ("ep_size_mismatch", lambda ws: (ws, 0, 2, 10, 0), r"(?i)ep_size|workspace"),
    ("ep_size_65", lambda ws: (ws, 0, 65, 10, 0), r"(?i)ep_size|workspace"),
    ("max_num_tokens_0", lambda ws: (ws, 0, 1, 0, 0), r"(?i)max_num_tokens"),
    ("max_num_tokens_huge", lambda ws: (ws, 0, 1, layout.MAX_NUM_TOKENS + 1, 0), r"(?i)max_num_tokens|workspace"),
    ("eplb_negative", lambda ws: (ws, 0, 1, 10, -1), r"(?i)eplb"),
    # Declared sizes the workspace cannot hold even without payloads.
    ("too_small_for_max_num_tokens", lambda ws: (ws, 0, 1, 1 << 20, 0),
     r"workspace too small for max_num_tokens=1048576 and eplb_stats_num_experts=0"),
    ("too_small_for_eplb", lambda ws: (ws, 0, 1, 10, 1 << 20),
     r"workspace too small for max_num_tokens=10 and eplb_stats_num_experts=1048576"),
    ("workspace_none", lambda ws: (None, 0, 1, 10, 0), r"workspace must be a tensor, got NoneType"),
]


@pytest.mark.parametrize("make_args,match", [pytest.param(f, m, id=i) for i, f, m in INIT_BAD])
def test_initialize_rejects(make_args, match, device):
    env = make_env(device)
    # Give the row recognizable content to prove it is not zeroed by a failed call.
    env.workspace[:, layout.HEADER_BYTES:].fill_(0xA5)
    expect_error(env.workspace, lambda: a2a.moe_a2a_initialize(*make_args(env.workspace)), BAD, match)


def test_initialize_rejects_cake_backend_on_cpu():
    ws = torch.zeros(1, 1 << 16, dtype=torch.uint8)
    expect_error(ws, lambda: a2a.moe_a2a_initialize(ws, 0, 1, 10, backend="cake"), ValueError, r"(?i)cake|capability")
    expect_error(ws, lambda: a2a.moe_a2a_initialize(ws, 0, 1, 10, backend="bogus"), ValueError, r"(?i)backend")


@pytest.mark.parametrize("args,match", [
    ((0, 16, 128, 64), r"(?i)ep_size"),
    ((65, 16, 128, 64), r"(?i)ep_size"),
    ((2, 0, 128, 64), r"(?i)max_num_tokens"),
    ((2, 16, -1, 64), r"(?i)payload|size|bytes"),
    ((2, 16, 128, -1), r"(?i)payload|size|bytes"),
])
def test_workspace_size_rejects(args, match):
    with pytest.raises(BAD, match=match):
        a2a.moe_a2a_get_workspace_size_per_rank(*args)


# Python ints beyond int64, which no op can take, are refused by name (the
# dispatcher's own error said "Expected a value of type 'int' ... found type 'int'").
BEYOND_INT64 = [
    ("size_max_num_tokens", lambda env: a2a.moe_a2a_get_workspace_size_per_rank(2, 2**63, 128, 64), "max_num_tokens"),
    ("size_dispatch_bytes", lambda env: a2a.moe_a2a_get_workspace_size_per_rank(2, 16, 2**64, 64),
     "total_dispatch_payload_size_per_token"),
    ("size_negative", lambda env: a2a.moe_a2a_get_workspace_size_per_rank(2, 16, 128, -2**63 - 1),
     "combine_payload_size_per_token"),
    ("em_size_tokens_per_expert", lambda env: a2a.moe_a2a_get_workspace_size_per_rank_expert_major(
        2, 16, 64, 64, 8, 2, max_tokens_per_expert=2**64), "max_tokens_per_expert"),
    ("initialize", lambda env: a2a.moe_a2a_initialize(env.workspace, 0, 1, 2**64), "max_num_tokens"),
    ("dispatch_top_k", lambda env: a2a.moe_a2a_dispatch(**{**env.dispatch_args(), "top_k": 2**64}), "top_k"),
    ("dispatch_runtime_max", lambda env: a2a.moe_a2a_dispatch(
        **{**env.dispatch_args(), "runtime_max_tokens_per_rank": 2**63}), "runtime_max_tokens_per_rank"),
    ("simulated_ep", lambda env: a2a.SimulatedEP(2, 2**64, dispatch_bytes_per_token=1, combine_bytes_per_token=1),
     "max_num_tokens"),
]


@pytest.mark.parametrize("call,name", [pytest.param(c, n, id=i) for i, c, n in BEYOND_INT64])
def test_ints_beyond_int64_are_named(call, name):
    env = make_env("cpu")
    expect_error(env.workspace, lambda: call(env), ValueError, rf"\b{name} must fit in int64")


def test_combine_int_beyond_int64_is_named():
    ce = make_combine_env("cpu")
    for name in ("local_num_tokens", "combine_payload_offset"):
        args = {**ce.args(), name: 2**64}
        expect_error(ce.env.workspace, lambda: a2a.moe_a2a_combine(**args), ValueError, rf"\b{name} must fit in int64")


@pytest.mark.parametrize("size_per_rank,ep_size", [(2**62, 2), (2**61, 64), (2**63, 1), (2**64, 1)])
def test_allocate_workspace_beyond_a_tensor_is_refused(size_per_rank, ep_size):
    """Rows whose bytes no tensor can hold are refused by name, before
    torch.zeros fails to unpack its size (a TypeError with a C++ trace)."""
    with pytest.raises(ValueError, match=r"allocate_workspace: ep_size \* size_per_rank .* more than a tensor holds"):
        a2a.allocate_workspace(size_per_rank, ep_size=ep_size)


def test_workspace_size_unknown_backend():
    with pytest.raises(ValueError, match=r"(?i)backend"):
        a2a.moe_a2a_get_workspace_size_per_rank(2, 16, 128, 64, backend="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"(?i)cake|capability"):
            a2a.moe_a2a_get_workspace_size_per_rank(2, 16, 128, 64, backend="cake")


def test_sanitize_rejects(device):
    env = make_env(device)
    out, off, _ = a2a.moe_a2a_dispatch(**env.dispatch_args())
    ids_view = out[1]
    foreign = ids_view.clone()  # not a workspace view
    expect_error(env.workspace, lambda: a2a.moe_a2a_sanitize_expert_ids(foreign, env.workspace, env.metainfo, 0, -1),
                 BAD, r"(?i)workspace|expert_ids")
    expect_error(env.workspace, lambda: a2a.moe_a2a_sanitize_expert_ids(out[2], env.workspace, env.metainfo, 0, -1),
                 BAD, r"(?i)int32|dtype|expert_ids")
    expect_error(env.workspace, lambda: a2a.moe_a2a_sanitize_expert_ids(ids_view, env.workspace, env.metainfo, 1, -1),
                 BAD, r"(?i)ep_rank")
    expect_error(env.workspace, lambda: a2a.moe_a2a_sanitize_expert_ids(
        ids_view, env.workspace, env.metainfo, 0, -1, backend="cake"), ValueError, r"(?i)cake|capability")
    expect_error(env.workspace, lambda: a2a.moe_a2a_sanitize_expert_ids(None, env.workspace, env.metainfo, 0, -1),
                 ValueError, r"expert_ids must be a tensor, got NoneType")
    for bad in (True, -1.5, "-1", None):
        expect_error(env.workspace, lambda: a2a.moe_a2a_sanitize_expert_ids(ids_view, env.workspace, env.metainfo, 0,
                                                                            bad),
                     ValueError, rf"moe_a2a_sanitize_expert_ids: invalid_expert_id must be an int, got {bad!r}")
    expect_error(env.workspace, lambda: a2a.moe_a2a_sanitize_expert_ids(ids_view, None, env.metainfo, 0, -1),
                 ValueError, r"workspace must be a tensor, got NoneType")
    # Reshaped views of the plane: more rows than the workspace was initialized for.
    ep, T, k = ids_view.shape
    longer = ids_view.view(ep, T * k, 1)
    assert T * k > env.case.max_tokens
    expect_error(env.workspace, lambda: a2a.moe_a2a_sanitize_expert_ids(longer, env.workspace, env.metainfo, 0, -1),
                 ValueError, r"(?i)runtime_max|max_num_tokens")
    # The raw op, as a C++ caller drives it: its T is bounded by the
    # max_num_tokens it is given, which on the CPU must be the row's.
    offset = ids_view.storage_offset() * ids_view.element_size() - env.workspace.storage_offset()
    max_tokens = env.case.max_tokens
    raw = torch.ops.moe_a2a.sanitize_expert_ids.default
    expect_error(env.workspace, lambda: raw(env.workspace, 0, 1, max_tokens, max_tokens + 1, offset, k, -1, 4, 0, False),
                 ValueError, r"runtime_max_tokens_per_rank must be in \[1, max_num_tokens")
    if device == "cpu":  # a CUDA row's header is on the device: the host takes max_num_tokens on trust
        expect_error(env.workspace, lambda: raw(env.workspace, 0, 1, 4 * max_tokens, T, offset, k, -1, 4, 0, False),
                     ValueError, r"(?i)metainfo does not match the workspace")
    a2a.moe_a2a_combine(out[0], 6, env.workspace, env.metainfo, env.case.T, 0, 1, env.case.top_k, off)
    # Any width is an expert-id payload (FlashInfer sanitizes wide int32 payloads),
    # but not past the end of the row. Last: set_ grows the workspace's
    # storage to hold such a view, which moves the workspace's memory.
    past_end = torch.empty(0, dtype=torch.int32, device=ids_view.device).set_(
        ids_view.untyped_storage(), ids_view.storage_offset(), (1, 1, env.workspace.shape[1]))
    expect_error(env.workspace, lambda: a2a.moe_a2a_sanitize_expert_ids(
        past_end, env.workspace, env.metainfo, 0, -1), ValueError, r"expert_ids must lie within rank 0's row")


def _ids_plane(workspace, offset, shape):
    """An int32 view of rank 0's row at byte ``offset``, as a caller could build one."""
    return torch.empty(0, dtype=torch.int32, device=workspace.device).set_(
        workspace.untyped_storage(), workspace.storage_offset() + offset // 4, shape)


@pytest.mark.parametrize("form", ["more_rows", "earlier_round", "before_dispatch"])
def test_sanitize_refuses_a_view_of_no_plane_of_the_last_dispatch(form, device):
    """A view whose rows are not the last dispatch's T (one kept from a round
    of other sizes, or the plane seen with more rows) would have sanitize
    write padding ids over the dispatch's other planes: refused on the CPU
    with the workspace untouched; the CUDA kernel writes nothing and records
    the error, which the rank's next call raises."""
    env = make_env(device)
    case = env.case
    if form == "before_dispatch":
        offset = layout.call_layout(1, case.T, 0, [s.row_bytes for s in case.payload_specs()]).payload_offsets[1]
        view = _ids_plane(env.workspace, offset, (1, case.T, case.top_k))
        expected_max = 0
    else:
        out, off, _ = a2a.moe_a2a_dispatch(**env.dispatch_args())
        ids_view = out[1]
        if form == "more_rows":
            # The same plane seen with max_num_tokens rows: its end covers the next plane.
            view = ids_view.as_strided((1, case.max_tokens, case.top_k), ids_view.stride())
        else:
            a2a.moe_a2a_combine(out[0].clone(), 6, env.workspace, env.metainfo, case.T, 0, 1, case.top_k, off)
            out, off, _ = a2a.moe_a2a_dispatch(**{**env.dispatch_args(), "runtime_max_tokens_per_rank": 6})
            view = ids_view  # the first round's view: T 8 over a layout for T 6
        expected_max = case.T if form == "more_rows" else 6
    text = (r"expert_ids must be a receive view of this rank's last dispatch .* "
            + ("no dispatch ran since moe_a2a_initialize" if expected_max == 0
               else rf"runtime_max_tokens_per_rank is {expected_max};"))
    if device == "cpu":
        expect_error(env.workspace, lambda: a2a.moe_a2a_sanitize_expert_ids(view, env.workspace, env.metainfo, 0, -1),
                     ValueError, "moe_a2a_sanitize_expert_ids: " + text)
        return
    before = env.workspace[0, layout.HEADER_BYTES:].clone()
    a2a.moe_a2a_sanitize_expert_ids(view, env.workspace, env.metainfo, 0, -1)
    torch.cuda.synchronize()
    assert torch.equal(env.workspace[0, layout.HEADER_BYTES:], before), "the kernel wrote into the row"
    assert header_i32(env.workspace, 0, layout.HDR_ERROR_CODE) == layout.ERROR_SANITIZE_MISMATCH
    with pytest.raises(RuntimeError, match="moe_a2a_sanitize_expert_ids wrote nothing: " + text):
        a2a.moe_a2a_dispatch(**env.dispatch_args())


@pytest.mark.parametrize("view_rank,call_rank", [(1, 0), (0, 1)])
def test_sanitize_names_expert_ids_of_another_ranks_row(view_rank, call_rank, device):
    """A receive view of one rank's row sanitized with another rank's
    metainfo and ep_rank is refused naming expert_ids and the calling rank's
    row (not the op's internal offset); the round then closes as usual."""
    gen = make_generator(("sanitize another row", view_rank))
    case = Case(2, (5, 3), 2, 4, hidden=32, runtime_max=8)
    sim = make_sim(case, device)
    inputs = make_inputs(case, gen)
    dev = inputs.to(device)
    results = sim.run(lambda r: a2a.moe_a2a_dispatch(dev.ids[r], dev.payloads[r], sim.workspace, sim.metainfo[r],
                                                     case.T, r, 2, case.top_k, case.num_experts))
    foreign = results[view_rank][0][1]
    expect_error(sim.workspace, lambda: a2a.moe_a2a_sanitize_expert_ids(
        foreign, sim.workspace, sim.metainfo[call_rank], call_rank, -1), ValueError,
        rf"moe_a2a_sanitize_expert_ids: expert_ids must lie within rank {call_rank}'s row of the workspace")
    sim.run(lambda r: a2a.moe_a2a_combine(results[r][0][0].clone(), case.tokens[r], sim.workspace, sim.metainfo[r],
                                          case.T, r, 2, case.top_k, results[r][1]))
    round_trip(sim, case, make_inputs(case, gen), gen)


def test_wrap_payload_rejects_slice_outside_row(device):
    env = make_env(device)
    size = env.workspace.shape[1]
    with pytest.raises(BAD + (AssertionError,)):
        a2a.moe_a2a_wrap_payload_tensor_in_workspace(env.workspace[0], [1, 2], size - 64, size + 64, torch.bfloat16)


# ---- limits: the largest legal values work ------------------------------------------------------------


@pytest.mark.parametrize("case", [
    Case(1, (7,), 22, 22, hidden=64),  # top_k 22 with exactly 22 experts
    Case(2, (5, 3), 22, 40, hidden=64),
    Case(1, (4,), 2, 4, extras=tuple(PayloadSpec(torch.uint8, (i + 1,)) for i in range(5))),  # 8 payloads
    Case(3, (2, 2, 2), 1, 3),  # num_experts == ep_size
], ids=str)
def test_limits_accepted(case, device):
    assert len(case.payload_specs()) <= layout.MAX_PAYLOADS
    gen = make_generator(case)
    round_trip(make_sim(case, device), case, make_inputs(case, gen), gen)


def test_max_ranks_accepted(device):
    if device == "cuda":
        # Simulated ranks on one GPU spin concurrently on their own streams, and
        # a GPU has MAX_SIMULATED_RANKS_PER_GPU hardware work queues: beyond
        # that, SimulatedEP refuses clearly instead of deadlocking.
        with pytest.raises(ValueError, match=r"(?i)simulated"):
            make_sim(Case(64, (1,) * 64, 2, 64, hidden=16), device)
        ranks = a2a.simulate.MAX_SIMULATED_RANKS_PER_GPU
    else:
        ranks = 64
    case = Case(ranks, tuple(i % 3 for i in range(ranks)), 2, 64, hidden=16)
    gen = make_generator(64)
    round_trip(make_sim(case, device), case, make_inputs(case, gen), gen)


# ---- the ops themselves (C++ callers bypass the Python layer) -------------------------------------------


def _op_dispatch_args(env, **changes):
    args = dict(ids=env.ids, payloads=list(env.payloads), workspace=env.workspace, ep_rank=0, ep_size=1,
                max_num_tokens=env.case.max_tokens, runtime_max=env.case.T, top_k=env.case.top_k,
                num_experts=env.case.num_experts, eplb=None, eplb_n=0, mask=[], timeout_s=-1.0,
                mailbox=int(env.metainfo[layout.META_MAILBOX_ADDR]), enable_pdl=False)
    args.update(changes)
    return tuple(args.values())


OP_DISPATCH_BAD = [
    ("ep_size_0", dict(ep_size=0), r"(?i)ep_size"),
    ("ep_size_65", dict(ep_size=65, num_experts=65), r"(?i)ep_size"),
    ("ep_rank_neg", dict(ep_rank=-1), r"(?i)ep_rank"),
    ("ep_rank_eq_size", dict(ep_rank=1), r"(?i)ep_rank"),
    ("top_k_0", dict(top_k=0), r"(?i)top_k"),
    ("top_k_23", dict(top_k=23), r"(?i)top_k"),
    ("num_experts_0", dict(num_experts=0), r"(?i)num_experts"),
    ("runtime_max_0", dict(runtime_max=0), r"(?i)runtime_max"),
    ("runtime_max_gt_max", dict(runtime_max=11), r"(?i)runtime_max|max_num_tokens"),
    ("max_num_tokens_not_initialized_value", dict(max_num_tokens=9), r"(?i)max_num_tokens|metainfo|initiali"),
    # Statistics of a length the workspace was not initialized with (without
    # statistics the call's eplb_n sizes nothing, and is not checked).
    ("eplb_n_not_initialized_value", dict(eplb=torch.zeros(4, dtype=torch.int32), eplb_n=4),
     r"metainfo does not match the workspace: .*eplb_stats_num_experts=4\), row 0 was initialized with .*"
     r"eplb_stats_num_experts=0\)"),
    ("mask_wrong_words", dict(mask=[1, 1]), r"(?i)mask"),
    ("mask_own_bit_missing", dict(mask=[2]), r"(?i)mask|own|ep_rank"),
    ("timeout_nan", dict(timeout_s=float("nan")), r"(?i)timeout"),
]


# The CUDA backend cannot read a rank's header on the host without a sync, so
# the checks against it (initialized row, metainfo values, the sizes of the
# matching dispatch) run on the CPU backend only; the Python API derives those
# values from metainfo, so only direct op callers can get them wrong.
HEADER_CHECKED = "checked against the row header: CPU backend only (the CUDA header is device memory)"
HEADER_CHECKED_CASES = {"max_num_tokens_not_initialized_value", "eplb_n_not_initialized_value"}


@pytest.mark.parametrize("changes,match,header_checked",
                         [pytest.param(c, m, i in HEADER_CHECKED_CASES, id=i) for i, c, m in OP_DISPATCH_BAD])
def test_dispatch_op_rejects(changes, match, header_checked, device):
    if device == "cuda" and header_checked:
        pytest.skip(HEADER_CHECKED)
    env = make_env(device)
    args = _op_dispatch_args(env, **changes)
    expect_error(env.workspace, lambda: torch.ops.moe_a2a.dispatch.default(*args), BAD, match)


def test_ops_refuse_uninitialized_row(device):
    if device == "cuda":
        pytest.skip(HEADER_CHECKED)
    env = make_env(device)
    env.workspace.zero_()  # the header is gone
    args = _op_dispatch_args(env)
    expect_error(env.workspace, lambda: torch.ops.moe_a2a.dispatch.default(*args), BAD, r"(?i)initiali")


def _other_runtime_max(ce: CombineEnv) -> dict:
    """T 9 instead of the dispatch's 8, with a payload of that T (the dispatch's rows, one padding row more)."""
    padded = torch.cat([ce.payload, ce.payload[:, :1]], dim=1).contiguous()
    return {"runtime_max_tokens_per_rank": ce.env.case.T + 1, "payload": padded}


# (id, the changed combine arguments, what the CPU's ValueError says, the field a CUDA error names).
COMBINE_MISMATCH = [
    ("local_num_tokens", lambda ce: {"local_num_tokens": 5}, r"the combine got \(local_num_tokens=5,",
     "local_num_tokens"),
    ("runtime_max", _other_runtime_max, r"the combine got \(local_num_tokens=6, runtime_max_tokens_per_rank=9,",
     "runtime_max_tokens_per_rank"),
    ("top_k", lambda ce: {"top_k": 3}, r"top_k=3\)", "top_k"),
    # An offset of another call (a stale one, 256 bytes on) would stage the
    # payload where no peer pulls it.
    ("offset", lambda ce: {"combine_payload_offset": ce.offset + 256},
     r"combine_payload_offset must be the one the dispatch returned \({offset}\), got {bad}",
     "combine_payload_offset"),
]


@pytest.mark.parametrize("changes,cpu_match,field", [pytest.param(c, m, f, id=i) for i, c, m, f in COMBINE_MISMATCH])
def test_combine_op_rejects_sizes_other_than_the_dispatch(changes, cpu_match, field, device):
    """The CPU combine refuses at once and the workspace stays usable. The CUDA
    combine's header is device memory: its kernel refuses before it writes
    anything but the error record (kErrorCombineMismatch naming the field),
    which check_errors and the next call raise."""
    ce = make_combine_env(device)
    args = {**ce.args(), **changes(ce)}
    if device == "cpu":
        match = cpu_match.format(offset=ce.offset, bad=args["combine_payload_offset"])
        expect_error(ce.env.workspace, lambda: a2a.moe_a2a_combine(**args), BAD, match)
        a2a.moe_a2a_combine(**ce.args())
        return
    before = ce.env.workspace.cpu()
    a2a.moe_a2a_combine(**args)
    torch.cuda.synchronize()
    after = ce.env.workspace.cpu()
    record = slice(layout.HDR_ERROR_CODE, layout.HDR_ERROR_MISSING + 8 * layout.MOE_A2A_RANK_MASK_WORDS)
    before[0, record] = after[0, record]
    assert torch.equal(after, before), "a refused combine must write nothing but the error record"
    message = rf"rank 0: combine was called with another {field} than its dispatch"
    with pytest.raises(RuntimeError, match=message):
        a2a.check_errors(ce.env.workspace)
    with pytest.raises(RuntimeError, match=message):
        a2a.moe_a2a_combine(**ce.args())


def test_combine_mismatch_record_names_every_field_that_differs():
    """The text check_errors gives a CUDA kernel's kErrorCombineMismatch record: the
    detail's bits name the fields, in the order of layout.COMBINE_MISMATCH_FIELDS."""
    text = a2a.api.describe_error(3, layout.ERROR_COMBINE_MISMATCH, [0] * layout.MOE_A2A_RANK_MASK_WORDS, 0b1001)
    assert text.startswith("rank 3: combine was called with another local_num_tokens, combine_payload_offset "
                           "than its dispatch (it must use the dispatch's sizes and the combine_payload_offset "
                           "it returned); the workspace stays failed"), text


def test_getters_reject_a_rank_outside_the_workspace(device):
    env = make_env(device, ep_size=2)
    for getter in (a2a.moe_a2a_get_recv_counts, a2a.moe_a2a_get_invalid_expert_count):
        for rank in (-1, 2):
            expect_error(env.workspace, lambda: getter(env.workspace, env.metainfo, rank), ValueError, r"ep_rank")
        expect_error(env.workspace, lambda: getter([env.workspace], env.metainfo, 0), ValueError,
                     r"workspace must be a tensor, got list")
    expect_error(env.workspace, lambda: a2a.moe_a2a_wrap_payload_tensor_in_workspace(None, [1, 2], 0, 64, torch.int32),
                 ValueError, r"workspace must be a tensor, got NoneType")


def test_moe_alltoall_checks_sanitize_arguments_before_it_dispatches(device):
    """A refused sanitize request leaves no row written and the instance idle."""
    case = Case(1, (4,), 2, 4)
    moe = a2a.MoeAlltoAll(ep_mapping(0, 1), 8, 2, 4, hidden_size=64, device=device)
    payloads = make_inputs(case, make_generator(0)).to(device).payloads[0]
    ids_index = next(i for i, p in enumerate(payloads) if p.dtype == torch.int32)
    other = next(i for i, p in enumerate(payloads) if p.dtype != torch.int32)
    ids = payloads[ids_index]
    n = len(payloads)
    for index, invalid_id, match in ((None, -1, "required"), (n, -1, "index"), (-n - 1, -1, "index"),
                                     (True, -1, "index"), (1.0, -1, "index"), (other, -1, "int32"),
                                     (ids_index, 2**40, "int32")):
        expect_error(moe.workspace, lambda: moe.dispatch(ids, payloads, 4, invalid_token_expert_id=invalid_id,
                                                         expert_id_payload_index=index), ValueError, match)
    # A list index, as in FlashInfer: negative ones count from the end.
    for index in (ids_index, ids_index - n):
        recv = moe.dispatch(ids, payloads, 8, invalid_token_expert_id=-7, expert_id_payload_index=index)
        assert tuple(recv[ids_index].shape) == (1, 8, ids.shape[1])
        assert torch.equal(recv[ids_index][0, 4:].cpu(), torch.full((4, ids.shape[1]), -7, dtype=ids.dtype))
        moe.combine(torch.ones(1, 8, 64, dtype=torch.bfloat16, device=device), 8)


@pytest.mark.parametrize("top_k,num_experts,match", [
    (0, 4, "top_k"), (23, 64, "top_k"), (True, 4, "top_k"), (2.0, 4, "top_k"), (2, 1, "num_experts"),
])
def test_moe_alltoall_constructor_checks_limits(top_k, num_experts, match, device):
    """Refused before the workspace given to it is initialized."""
    size = a2a.moe_a2a_get_workspace_size_per_rank(2, 8, 256, 128)
    workspace = torch.zeros(2, size, dtype=torch.uint8, device=device)
    snap = ws_snapshot(workspace)
    with pytest.raises(ValueError, match=match):
        a2a.MoeAlltoAll(ep_mapping(0, 2), 8, top_k, num_experts, workspace=workspace)
    assert_ws_unchanged(workspace, snap)


# ---- SimulatedEP's own arguments ------------------------------------------------------------------
# Refused before any rank runs and before anything is written: a per-rank list
# of another length used to fail only the ranks past its end, after their peers
# had waited for them until the timeout, leaving the workspace failed.

SIM_CASE = Case(2, (3, 5), 2, 4, hidden=16)


def _sim_dispatch(sim, case, inputs, device):
    """Every rank's dispatch through sim.dispatch, checked against the reference;
    returns what _sim_combine needs."""
    dev = inputs.to(device)
    results = sim.dispatch(dev.ids, dev.payloads, case.T, case.top_k, case.num_experts)
    ref = reference.reference_dispatch(inputs.ids, inputs.payloads, ep_size=case.ep_size,
                                       num_experts=case.num_experts, runtime_max_tokens_per_rank=case.T)
    for r in range(case.ep_size):
        assert torch.equal(sim.recv_counts(r).cpu(), ref.recv_counts[r].to(torch.int32)), f"rank {r} counts"
    expert_out = [reference.toy_moe(ref.recv[r][0], ref.recv[r][1], ref.recv[r][2], ref.recv_counts[r], ep_rank=r,
                                    ep_size=case.ep_size, num_experts=case.num_experts) for r in range(case.ep_size)]
    return results, ref, expert_out


def _sim_combine(sim, case, dispatched, device):
    """Every rank's combine through sim.combine, checked against the reference."""
    results, ref, expert_out = dispatched
    outs = sim.combine([e.to(device) for e in expert_out], list(case.tokens), case.T, case.top_k,
                       [res[1] for res in results])
    expected = reference.reference_combine(expert_out, ref, list(case.tokens))
    for r in range(case.ep_size):
        assert_bytes_equal(outs[r], expected[r], f"rank {r} combine output")


def _sim_round_trips(sim, case, device, seed):
    """A round through sim.dispatch / sim.combine, then one through round_trip:
    the workspace works with no reset()."""
    gen = make_generator(("sim round", seed))
    _sim_combine(sim, case, _sim_dispatch(sim, case, make_inputs(case, gen), device), device)
    round_trip(sim, case, make_inputs(case, gen), gen)


def _resized(value, delta):
    """``value`` (one entry per rank) with its last entry dropped (delta -1) or repeated (delta +1)."""
    return list(value[:-1]) if delta < 0 else [*value, value[-1]]


@pytest.mark.parametrize("delta", [-1, 1], ids=["short", "long"])
@pytest.mark.parametrize("name", ["token_selected_experts", "input_payloads", "enable_pdl"])
def test_simulated_ep_dispatch_refuses_per_rank_lists_of_another_length(name, delta, device):
    sim = make_sim(SIM_CASE, device)
    dev = make_inputs(SIM_CASE, make_generator("sim dispatch lists")).to(device)
    args = dict(token_selected_experts=dev.ids, input_payloads=dev.payloads,
                runtime_max_tokens_per_rank=SIM_CASE.T, top_k=SIM_CASE.top_k, num_experts=SIM_CASE.num_experts)
    if name == "enable_pdl":
        args["enable_pdl"] = [False] * SIM_CASE.ep_size
    args[name] = _resized(args[name], delta)
    expect_error(sim.workspace, lambda: sim.dispatch(**args), ValueError,
                 rf"^SimulatedEP\.dispatch: {name} must have ep_size=2 entries \(one per rank\), "
                 rf"got {2 + delta}$")
    _sim_round_trips(sim, SIM_CASE, device, (name, delta))


@pytest.mark.parametrize("delta", [-1, 1], ids=["short", "long"])
@pytest.mark.parametrize("name", ["payloads", "local_num_tokens", "combine_payload_offsets", "output"])
def test_simulated_ep_combine_refuses_per_rank_lists_of_another_length(name, delta, device):
    """Refused between a dispatch and its combine: the same round's combine
    then completes, and the next round too."""
    sim = make_sim(SIM_CASE, device)
    inputs = make_inputs(SIM_CASE, make_generator("sim combine lists"))
    dispatched = _sim_dispatch(sim, SIM_CASE, inputs, device)
    results, _, expert_out = dispatched
    args = dict(payloads=[e.to(device) for e in expert_out], local_num_tokens=list(SIM_CASE.tokens),
                runtime_max_tokens_per_rank=SIM_CASE.T, top_k=SIM_CASE.top_k,
                combine_payload_offsets=[res[1] for res in results],
                output=[torch.empty(n, SIM_CASE.hidden, dtype=SIM_CASE.hidden_dtype, device=device)
                        for n in SIM_CASE.tokens])
    args[name] = _resized(args[name], delta)
    expect_error(sim.workspace, lambda: sim.combine(**args), ValueError,
                 rf"^SimulatedEP\.combine: {name} must have ep_size=2 entries \(one per rank\), got {2 + delta}$")
    _sim_combine(sim, SIM_CASE, dispatched, device)
    _sim_round_trips(sim, SIM_CASE, device, (name, delta))


def test_simulated_ep_refuses_a_per_rank_argument_that_is_not_a_list(device):
    """combine(payloads, 5, ...): an int where one local_num_tokens per rank is expected."""
    sim = make_sim(SIM_CASE, device)
    inputs = make_inputs(SIM_CASE, make_generator("sim not a list"))
    dispatched = _sim_dispatch(sim, SIM_CASE, inputs, device)
    results, _, expert_out = dispatched
    expect_error(sim.workspace, lambda: sim.combine([e.to(device) for e in expert_out], 5, SIM_CASE.T,
                                                    SIM_CASE.top_k, [res[1] for res in results]),
                 ValueError, r"^SimulatedEP\.combine: local_num_tokens must be a list or tuple of ep_size=2 entries "
                             r"\(one per rank\), got int$")
    _sim_combine(sim, SIM_CASE, dispatched, device)
    _sim_round_trips(sim, SIM_CASE, device, "not a list")


def _no_workspace(monkeypatch):
    """Make SimulatedEP fail loudly if it allocates its workspace (a check after it)."""
    def allocate(*args, **kwargs):
        raise AssertionError("SimulatedEP allocated its workspace before it checked its arguments")
    monkeypatch.setattr(a2a.simulate, "allocate_workspace", allocate)


@pytest.mark.parametrize("bad", ["3", True, np.int64(3), torch.tensor(3.0), 0, -1.0, math.nan, math.inf],
                         ids=repr)
def test_simulated_ep_checks_timeout_as_initialize_does(bad, device, monkeypatch):
    """SimulatedEP(timeout_s=) used to convert anything float() takes; it now
    refuses what moe_a2a_initialize(timeout_s=) refuses, with its message."""
    size = a2a.moe_a2a_get_workspace_size_per_rank(1, 4, 16, 16)
    expect_error(torch.zeros(1, size, dtype=torch.uint8, device=device),
                 lambda: a2a.moe_a2a_initialize(torch.zeros(1, size, dtype=torch.uint8, device=device), 0, 1, 4,
                                                timeout_s=bad),
                 ValueError, rf"^timeout_s must be a positive number of seconds\b.* or None, got {re.escape(repr(bad))}$")
    with monkeypatch.context() as m:
        _no_workspace(m)
        with pytest.raises(ValueError, match=rf"^SimulatedEP: timeout_s must be a positive number of seconds\b.* "
                                             rf"or None, got {re.escape(repr(bad))}$"):
            make_sim(SIM_CASE, device, timeout_s=bad)
    sim = make_sim(SIM_CASE, device, timeout_s=2)
    assert sim.timeout_s == 2.0 and isinstance(sim.timeout_s, float)
    _sim_round_trips(sim, SIM_CASE, device, ("timeout", repr(bad)))


def test_simulated_ep_refuses_a_timeout_above_the_bound(device, monkeypatch):
    """moe_a2a_initialize stores timeout_s in int64 microseconds: 1e14 s
    overflowed it after the row was initialized. Refused before the workspace
    exists (check_timeout's bound, MAX_TIMEOUT_S); the bound itself works."""
    largest = MAX_TIMEOUT_S
    with monkeypatch.context() as m:
        _no_workspace(m)
        for bad in (1e14, largest * 2):
            with pytest.raises(ValueError, match=rf"^SimulatedEP: timeout_s must be a positive number of seconds "
                                                 rf"up to {re.escape(f'{largest:g}')} or None, got {re.escape(repr(bad))}$"):
                make_sim(SIM_CASE, device, timeout_s=bad)
    _sim_round_trips(make_sim(SIM_CASE, device, timeout_s=largest), SIM_CASE, device, "largest timeout")


SIM_INT_ARGS = ["ep_size", "max_num_tokens", "dispatch_bytes_per_token", "combine_bytes_per_token",
                "eplb_stats_num_experts", "workspace_size_per_rank"]


@pytest.mark.parametrize("name,bad", [
    pytest.param(name, bad, id=f"{name}-{bad!r}") for name in SIM_INT_ARGS for bad in (True, False, 2.0, "2", None)
    # None is the default of the sizes: not given (test_api: one of the two ways to size the workspace).
    if not (name in ("workspace_size_per_rank", "dispatch_bytes_per_token", "combine_bytes_per_token")
            and bad is None)
])
def test_simulated_ep_refuses_sizes_that_are_not_ints(name, bad, device, monkeypatch):
    """A bool or a float used to fail deep in torch (TypeError from a view,
    RuntimeError from the op's schema), or to pass as 1 or 0."""
    args = dict(ep_size=SIM_CASE.ep_size, max_num_tokens=SIM_CASE.max_tokens,
                dispatch_bytes_per_token=SIM_CASE.dispatch_bytes, combine_bytes_per_token=SIM_CASE.combine_bytes,
                eplb_stats_num_experts=0, workspace_size_per_rank=None, device=device)
    args[name] = bad
    with monkeypatch.context() as m:
        _no_workspace(m)
        with pytest.raises(ValueError, match=rf"^SimulatedEP: {name} must be an int, got {re.escape(repr(bad))}$"):
            a2a.SimulatedEP(args.pop("ep_size"), args.pop("max_num_tokens"), **args)
    _sim_round_trips(make_sim(SIM_CASE, device), SIM_CASE, device, (name, repr(bad)))


@pytest.mark.parametrize("bad", [True, False, -1, 2, 1.0, np.int64(0)], ids=repr)
@pytest.mark.parametrize("method", ["recv_counts", "dispatch_rank", "combine_rank"])
def test_simulated_ep_refuses_a_rank_that_is_not_one_of_its_ranks(method, bad, device):
    """sim.recv_counts(True) used to index the workspace with a boolean mask
    (IndexError); a bool is refused where a rank is expected, as a rank
    outside [0, ep_size) is, before anything runs."""
    sim = make_sim(SIM_CASE, device)
    dev = make_inputs(SIM_CASE, make_generator("sim rank")).to(device)
    calls = {
        "recv_counts": lambda: sim.recv_counts(bad),
        "dispatch_rank": lambda: sim.dispatch_rank(bad, dev.ids[0], dev.payloads[0], SIM_CASE.T, SIM_CASE.top_k,
                                                   SIM_CASE.num_experts),
        "combine_rank": lambda: sim.combine_rank(
            bad, torch.zeros(SIM_CASE.ep_size, SIM_CASE.T, SIM_CASE.hidden, dtype=SIM_CASE.hidden_dtype,
                             device=device), SIM_CASE.tokens[0], SIM_CASE.T, SIM_CASE.top_k, 0),
    }
    expect_error(sim.workspace, calls[method], ValueError,
                 rf"^SimulatedEP\.{method}: rank must be an int in \[0, 2\), got {re.escape(repr(bad))}$")
    _sim_round_trips(sim, SIM_CASE, device, (method, repr(bad)))


@pytest.mark.parametrize("form", ["rank-major", "expert-major"])
def test_combine_of_an_output_shaped_payload_names_the_receive_layout(form, device):
    """The combine's payload given as [local_num_tokens, hidden], the shape of
    its output: the shape error read 'row_shape = []' (the trailing
    dimensions of the given tensor) and now says which layout it takes."""
    env = make_env(device)
    case = env.case
    x = env.payloads[0]
    if form == "rank-major":
        out, off, _ = a2a.moe_a2a_dispatch(**env.dispatch_args())
        call = lambda: a2a.moe_a2a_combine(x.clone(), 6, env.workspace, env.metainfo, case.T, 0, 1,  # noqa: E731
                                           case.top_k, off)
        dims = "ep_size, runtime_max_tokens_per_rank"
        close = lambda: a2a.moe_a2a_combine(out[0].clone(), 6, env.workspace, env.metainfo, case.T, 0, 1,  # noqa: E731
                                            case.top_k, off)
    else:
        size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(1, case.max_tokens, case.dispatch_bytes,
                                                                    case.combine_bytes, case.num_experts, case.top_k)
        workspace = torch.zeros(1, size, dtype=torch.uint8, device=device)
        env.metainfo = a2a.moe_a2a_initialize(workspace, 0, 1, case.max_tokens)
        env.workspace = workspace
        d = a2a.moe_a2a_dispatch_expert_major(env.ids, [x], workspace, env.metainfo, case.T, 0, 1, case.top_k,
                                              case.num_experts)
        call = lambda: a2a.moe_a2a_combine_expert_major(x.clone(), d, workspace, env.metainfo, 0, 1)  # noqa: E731
        dims = "num_local_experts, max_tokens_per_expert"
        close = lambda: a2a.moe_a2a_combine_expert_major(d.output_payloads[0].clone(), d, workspace,  # noqa: E731
                                                         env.metainfo, 0, 1)
    expect_error(env.workspace, call, ValueError,
                 rf"row_shape = \[\], got shape \[6, {x.shape[1]}\] \(the combine takes its rows in the dispatch's "
                 rf"receive layout, \[{dims}, \*row\] as the dispatch's output_payloads, not as \[local_num_tokens, "
                 r"\*row\], the shape of its own output\)")
    close()
