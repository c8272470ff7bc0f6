"""torch.library.opcheck on every op of torch.ops.moe_a2a that takes a tensor.

Single rank (ep_size 1) so no call waits. Every opcheck utility runs the op on
copies of the arguments (deepcopy / clone), so each run starts from the same
workspace state: freshly initialized for initialize/dispatch, "dispatched" for
combine / combine_into / sanitize_expert_ids (and the expert-major ops), and the dispatch -> combine
alternation holds on every copy.
"""

import pytest
import torch
from conftest import Case, PayloadSpec, make_generator, make_inputs

import torch_moe_a2a as a2a
from torch_moe_a2a import layout

ops = torch.ops.moe_a2a

# fp8 payloads are left out: SchemaCheckMode compares tensors with ops that have no fp8 CPU kernel.
# The empty payload (0 bytes per token) checks that the ops take one too.
CASE = Case(1, (5,), 3, 6, hidden=64, runtime_max=8, max_num_tokens=8,
            extras=(PayloadSpec(torch.uint8, (16,)), PayloadSpec(torch.float16, (4, 0)),
                    PayloadSpec(torch.float32, (2, 3))))
TIMEOUT_FROM_ENV = -1.0
SWIZZLE_128X4, LINEAR = int(a2a.SfLayout.layout_128x4), int(a2a.SfLayout.layout_linear)


class Env:
    def __init__(self, device):
        self.device = device
        size = a2a.moe_a2a_get_workspace_size_per_rank(1, CASE.max_tokens, CASE.dispatch_bytes, CASE.combine_bytes, 4)
        self.workspace = torch.zeros(1, size, dtype=torch.uint8, device=device)
        self.metainfo = a2a.moe_a2a_initialize(self.workspace, 0, 1, CASE.max_tokens, 4)
        self.mailbox = int(self.metainfo[layout.META_MAILBOX_ADDR])
        inputs = make_inputs(CASE, make_generator(0)).to(device)
        self.ids, self.payloads = inputs.ids[0], inputs.payloads[0]
        self.eplb = torch.arange(1, 5, dtype=torch.int32, device=device)

    def dispatch_args(self, eplb=True):
        return (self.ids, self.payloads, self.workspace, 0, 1, CASE.max_tokens, CASE.T, CASE.top_k,
                CASE.num_experts, self.eplb if eplb else None, 4, [], TIMEOUT_FROM_ENV, self.mailbox, False)

    def dispatched(self):
        """Run one dispatch for real; returns the call's layout."""
        ops.dispatch.default(*self.dispatch_args())
        return layout.call_layout(1, CASE.T, 4, [s.row_bytes for s in CASE.payload_specs()])

    def combine_args(self, offset, payload):
        return (payload, CASE.tokens[0], self.workspace, 0, 1, CASE.max_tokens, CASE.T, CASE.top_k, offset,
                [CASE.hidden], CASE.hidden_dtype, CASE.hidden_dtype, [], TIMEOUT_FROM_ENV, self.mailbox, False,
                0, None, 1.0, LINEAR)

    def quantized_combine_args(self, offset, payload, low_precision, output_dtype, scales):
        """combine_args with a quantized output: the 128x4 layout's padded scales are written too."""
        args = list(self.combine_args(offset, payload))
        args[11], args[16], args[17], args[19] = output_dtype, low_precision, scales, SWIZZLE_128X4
        args[18] = 3.0
        return tuple(args)


def _opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                                "test_aot_dispatch_static", "test_aot_dispatch_dynamic"))


def test_opcheck_alloc_mailbox(device):
    env = Env(device)
    if device == "cuda":
        # A fresh mailbox per call: the compiled-vs-eager checks compare the
        # returned addresses, which differ by design.
        torch.library.opcheck(ops.alloc_mailbox.default, (env.workspace,),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    else:
        _opcheck(ops.alloc_mailbox.default, (env.workspace,))


def test_opcheck_initialize(device):
    env = Env(device)
    _opcheck(ops.initialize.default, (env.workspace, 0, 1, CASE.max_tokens, 4, env.mailbox))


@pytest.mark.parametrize("eplb", [False, True])
def test_opcheck_dispatch(eplb, device):
    env = Env(device)
    _opcheck(ops.dispatch.default, env.dispatch_args(eplb))


@pytest.mark.parametrize("in_workspace", [False, True])
def test_opcheck_combine(in_workspace, device):
    env = Env(device)
    lay = env.dispatched()
    payload = torch.randn(1, CASE.T, CASE.hidden, generator=make_generator(1)).to(CASE.hidden_dtype).to(device)
    if in_workspace:
        view = layout.region_view(env.workspace[0], lay.combine_offset, tuple(payload.shape), payload.dtype)
        view.copy_(payload)
        payload = None
    _opcheck(ops.combine.default, env.combine_args(lay.combine_offset, payload))


def test_opcheck_combine_into(device):
    env = Env(device)
    lay = env.dispatched()
    payload = torch.randn(1, CASE.T, CASE.hidden, generator=make_generator(2)).to(CASE.hidden_dtype).to(device)
    output = torch.empty(CASE.tokens[0], CASE.hidden, dtype=CASE.hidden_dtype, device=device)
    _opcheck(ops.combine_into.default, (*env.combine_args(lay.combine_offset, payload), output))


def test_opcheck_sanitize_expert_ids(device):
    env = Env(device)
    lay = env.dispatched()
    ids_offset = lay.payload_offsets[1]  # payload 1 carries the expert ids
    _opcheck(ops.sanitize_expert_ids.default,
             (env.workspace, 0, 1, CASE.max_tokens, CASE.T, ids_offset, CASE.top_k, -1, 4, 0, False))


def test_opcheck_check_expert_ids(device):
    env = Env(device)
    _opcheck(ops.check_expert_ids.default, (env.ids, CASE.num_experts))


@pytest.mark.parametrize("low_precision", [1, 2], ids=["e4m3", "e4m3_block_scaled"])
def test_opcheck_combine_low_precision(low_precision, device):
    env = Env(device)
    lay = env.dispatched()
    payload = torch.randn(1, CASE.T, CASE.hidden, generator=make_generator(3)).to(CASE.hidden_dtype).to(device)
    args = list(env.combine_args(lay.combine_offset, payload))
    args[11], args[16] = torch.bfloat16, low_precision
    _opcheck(ops.combine.default, tuple(args))


# NVFP4 (uint8 data, float8 scales) is left out, as fp8 payloads are above:
# SchemaCheckMode compares the fp8 scales with ops that have no fp8 CPU kernel.
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_in_ws"])
def test_opcheck_combine_quantized(fmt, device):
    env = Env(device)
    lay = env.dispatched()
    payload = torch.randn(1, CASE.T, CASE.hidden, generator=make_generator(4)).to(CASE.hidden_dtype).to(device)
    out_dtype = torch.uint8 if fmt == "mxfp4" else torch.float8_e4m3fn
    scales = torch.zeros(128 * 4, dtype=torch.uint8, device=device)  # 5 rows x 2 blocks, padded to 128 x 4
    if fmt == "mxfp8_in_ws":
        view = layout.region_view(env.workspace[0], lay.combine_offset, tuple(payload.shape), payload.dtype)
        view.copy_(payload)
        payload = None
    _opcheck(ops.combine.default, env.quantized_combine_args(lay.combine_offset, payload, 0, out_dtype, scales))


def test_opcheck_combine_into_quantized(device):
    env = Env(device)
    lay = env.dispatched()
    payload = torch.randn(1, CASE.T, CASE.hidden, generator=make_generator(5)).to(CASE.hidden_dtype).to(device)
    scales = torch.zeros(128 * 4, dtype=torch.uint8, device=device)
    output = torch.empty(CASE.tokens[0], CASE.hidden // 2, dtype=torch.uint8, device=device)
    args = env.quantized_combine_args(lay.combine_offset, payload, 1, torch.uint8, scales)
    _opcheck(ops.combine_into.default, (*args, output))


class ExpertMajorEnv:
    """One rank sized for expert-major calls (CASE's hidden states and extras
    as user payloads, its int32 ids and fp32 weights routed), dispatched."""

    M = 6

    def __init__(self, device, dispatched=True):
        self.device = device
        user = [s.row_bytes for s in CASE.payload_specs()]
        self.user_rows = [user[0], *user[3:]]
        size = a2a.moe_a2a_get_workspace_size_per_rank_expert_major(
            1, CASE.max_tokens, sum(self.user_rows), CASE.combine_bytes, CASE.num_experts, CASE.top_k, self.M)
        self.workspace = torch.zeros(1, size, dtype=torch.uint8, device=device)
        self.metainfo = a2a.moe_a2a_initialize(self.workspace, 0, 1, CASE.max_tokens)
        self.mailbox = int(self.metainfo[layout.META_MAILBOX_ADDR])
        inputs = make_inputs(CASE, make_generator(5)).to(device)
        p = inputs.payloads[0]
        self.ids = inputs.ids[0]
        # The user payloads, the ids, the fp32 weights: an expert-major dispatch's.
        self.payloads = [p[0], *p[3:], p[1], p[2]]
        if dispatched:
            ops.dispatch.default(*self.dispatch_args()[:15])
        self.dispatch_end = layout.call_layout(1, CASE.T, 0, [*self.user_rows, CASE.top_k * 4, CASE.top_k * 4])
        self.dispatch_end = self.dispatch_end.combine_offset

    def dispatch_args(self):
        """dispatch_expert_major's arguments (dispatch's are the first 15)."""
        return (self.ids, self.payloads, self.workspace, 0, 1, CASE.max_tokens, CASE.T, CASE.top_k, CASE.num_experts,
                None, 0, [], TIMEOUT_FROM_ENV, self.mailbox, False, self.M, self.user_rows, True)

    def build_args(self):
        return (self.workspace, 0, 1, CASE.max_tokens, CASE.T, CASE.top_k, CASE.num_experts, self.M, 0,
                self.user_rows, 4, True, self.mailbox, False)

    def combine_args(self, payload):
        em = layout.expert_major_layout(self.dispatch_end, 1, CASE.T, CASE.top_k, CASE.num_experts, self.M,
                                        self.user_rows)
        return (payload, CASE.tokens[0], self.workspace, 0, 1, CASE.max_tokens, CASE.T, CASE.top_k, CASE.num_experts,
                self.M, self.dispatch_end, em.combine_offset, [CASE.hidden], CASE.hidden_dtype, torch.float32, [],
                TIMEOUT_FROM_ENV, self.mailbox, False)


def test_opcheck_expert_major_build(device):
    env = ExpertMajorEnv(device)
    _opcheck(ops.expert_major_build.default, env.build_args())


def test_opcheck_dispatch_expert_major(device):
    env = ExpertMajorEnv(device, dispatched=False)
    _opcheck(ops.dispatch_expert_major.default, env.dispatch_args())


def test_opcheck_combine_expert_major(device):
    env = ExpertMajorEnv(device)
    ops.expert_major_build.default(*env.build_args())
    payload = torch.randn(CASE.num_experts, env.M, CASE.hidden, generator=make_generator(6)).to(CASE.hidden_dtype)
    _opcheck(ops.combine_expert_major.default, env.combine_args(payload.to(device)))


def test_opcheck_combine_expert_major_into(device):
    env = ExpertMajorEnv(device)
    ops.expert_major_build.default(*env.build_args())
    payload = torch.randn(CASE.num_experts, env.M, CASE.hidden, generator=make_generator(7)).to(CASE.hidden_dtype)
    output = torch.empty(CASE.tokens[0], CASE.hidden, dtype=torch.float32, device=device)
    _opcheck(ops.combine_expert_major_into.default, (*env.combine_args(payload.to(device)), output))
