"""The operator library that CMakeLists.txt builds for C++ users
(libtorch_moe_a2a_ops.so), loaded by itself, without the Python package.

A fresh interpreter loads the library with torch.ops.load_library (the
package's extension registers the same namespace, so the two cannot share a
process) and drives torch.ops.moe_a2a.* with raw arguments: two simulated
ranks (threads on the CPU, one stream each on CUDA) dispatch random bf16 rows
and combine the received rows unchanged. Checked against a reference written
here: every received row is its source's row in ascending token order, and
the combine of token t is t's row times its number of distinct destination
ranks (0, 1 or 2, exact in bf16).

The library is `build/cmake/libtorch_moe_a2a_ops.so`, or MOE_A2A_CMAKE_LIB.
Without it the test skips, unless MOE_A2A_CMAKE_LIB names it: CI builds the
library after the suite and runs this file again with the variable set, and
`./dev gpu cmake` builds it with the CUDA kernels and does the same on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB_ENV = "MOE_A2A_CMAKE_LIB"
LIB = os.environ.get(LIB_ENV) or os.path.join(ROOT, "build", "cmake", "libtorch_moe_a2a_ops.so")

# Runs in a fresh interpreter: argv = library, device, seed.
SCRIPT = textwrap.dedent(
    """
    import sys, threading
    import torch

    lib, device, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.ops.load_library(lib)
    assert "torch_moe_a2a" not in sys.modules
    ops = torch.ops.moe_a2a
    if device == "cuda" and not torch._C._dispatch_has_kernel_for_dispatch_key("moe_a2a::dispatch", "CUDA"):
        sys.exit("the library has no CUDA kernels (build it with -DMOE_A2A_WITH_CUDA=ON)")

    EP, MAX_TOKENS, T, TOP_K, EXPERTS, HIDDEN, TIMEOUT_S = 2, 48, 40, 3, 6, 72, 10.0
    gen = torch.Generator().manual_seed(seed)
    tokens = [37, 40]
    ids = [torch.randint(-1, EXPERTS, (n, TOP_K), generator=gen, dtype=torch.int32) for n in tokens]
    ids[0][5] = -1  # no destination: combines to zeros
    ids[1][3, 0] = EXPERTS  # out of range: skipped
    rows = [torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16) for n in tokens]
    row_bytes = HIDDEN * 2

    size = ops.workspace_size_per_rank(EP, MAX_TOKENS, row_bytes, row_bytes, 0)
    workspace = torch.zeros(EP, size, dtype=torch.uint8, device=device)
    mailboxes = []
    for r in range(EP):
        mailboxes.append(ops.alloc_mailbox(workspace))
        ops.initialize(workspace, r, EP, MAX_TOKENS, 0, mailboxes[r])
    layout = ops.call_layout(EP, T, 0, [row_bytes])
    plane, combine_offset = layout[2], layout[3]
    dev_ids = [i.to(device) for i in ids]
    dev_rows = [x.to(device) for x in rows]
    received = [workspace[r, plane:plane + EP * T * row_bytes].view(torch.bfloat16).view(EP, T, HIDDEN)
                for r in range(EP)]
    # Everything allocated before the first launch: a CUDA rank's kernel spins
    # until its peer's arrives, and no host call may wait for the device then.
    out = [torch.full((n, HIDDEN), float("nan"), dtype=torch.bfloat16, device=device) for n in tokens]

    def dispatch(r):
        ops.dispatch(dev_ids[r], [dev_rows[r]], workspace, r, EP, MAX_TOKENS, T, TOP_K, EXPERTS, None, 0, [],
                     TIMEOUT_S, mailboxes[r], False)

    def combine(r):
        ops.combine_into(expert_out[r], tokens[r], workspace, r, EP, MAX_TOKENS, T, TOP_K, combine_offset,
                         [HIDDEN], torch.bfloat16, torch.bfloat16, [], TIMEOUT_S, mailboxes[r], False, 0, None, 1.0,
                         2, out[r])

    def every_rank(step):
        if device == "cpu":  # the CPU ops wait for their peers: one thread per rank
            threads = [threading.Thread(target=step, args=(r,)) for r in range(EP)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:  # the CUDA kernels wait on the device: one stream per rank, no host wait between
            streams = [torch.cuda.Stream() for _ in range(EP)]
            for r in range(EP):
                with torch.cuda.stream(streams[r]):
                    step(r)
            torch.cuda.synchronize()

    every_rank(dispatch)
    snapshot = [x.cpu() for x in received]
    # The received rows, unchanged, are the experts' outputs, outside the
    # workspace: the op stages them into the combine region.
    expert_out = [x.clone() for x in received]
    every_rank(combine)

    experts_per_rank = EXPERTS // EP
    for r in range(EP):
        for s in range(EP):
            sent = [t for t in range(tokens[s])
                    if any(0 <= e < EXPERTS and e // experts_per_rank == r for e in ids[s][t].tolist())]
            got = snapshot[r][s, :len(sent)]
            assert torch.equal(got.view(torch.int16), rows[s][sent].view(torch.int16)), (r, s)
    for r in range(EP):
        dests = torch.tensor([len({e // experts_per_rank for e in ids[r][t].tolist() if 0 <= e < EXPERTS})
                              for t in range(tokens[r])])
        expected = (rows[r].float() * dests[:, None]).to(torch.bfloat16)
        expected[dests == 0] = 0  # +0, not the product's -0 for a negative row
        assert torch.equal(out[r].cpu().view(torch.int16), expected.view(torch.int16)), r
    print("cmake library round trip ok", device)
    """
)


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", devices())
def test_cmake_library_round_trip(device):
    if not os.path.exists(LIB):
        if os.environ.get(LIB_ENV):
            pytest.fail(f"{LIB_ENV}={LIB}: no such file")
        pytest.skip(f"the CMake library is not built ({LIB}); see CMakeLists.txt")
    env = dict(os.environ, CUDA_MODULE_LOADING="EAGER")  # no lazy kernel load while a peer spins
    result = subprocess.run([sys.executable, "-c", SCRIPT, LIB, device, "7"], capture_output=True, text=True,
                            timeout=300, env=env)
    if device == "cuda" and "has no CUDA kernels" in result.stderr and not os.environ.get(LIB_ENV):
        pytest.skip("the CMake library was built without its CUDA kernels")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"cmake library round trip ok {device}" in result.stdout
