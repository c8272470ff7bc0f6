#!/usr/bin/env python3
"""Smoke test of FlashInfer 0.7.2.post1's MoE all-to-all on one GPU.

Run on the GPU machine with the environment from scripts/flashinfer_peer.sh:

    eval "$(bash scripts/flashinfer_peer.sh env)" && python3 scripts/flashinfer_peer_smoke.py

Two expert-parallel ranks (ep_size=2) are simulated in this one process. They
share one zeroed [ep_size, size_per_rank] uint8 CUDA workspace, each rank
initialized with moe_a2a_initialize. Each rank's kernels go on its own CUDA
stream, rank 0's then rank 1's with no synchronization in between: FlashInfer's
dispatch and combine kernels spin-wait for the peer's flag, so the two ranks'
kernels must run at the same time.

Payloads are shaped like DeepSeek-V3: hidden 7168 bf16, top-8 int32 expert
ids and fp32 weights, 256 experts (128 per rank), 16 tokens per rank. The
"experts" return the received hidden rows unchanged, so the combine output of
a token is its hidden row times the number of distinct ranks its 8 experts
live on (combine sums one row per distinct destination rank, in fp32, and
casts to bf16; no routing weights are applied). Two rounds run on the same
workspace without re-zeroing it: round 1 passes the expert output as a
separate tensor (payload_in_workspace=False), round 2 writes it into the
workspace's combine region first (payload_in_workspace=True).

Prints PASS or FAIL and the time of the import and of the first calls. Exit
status 0 on PASS, 1 on FAIL, 3 if the watchdog fires (a hang).
"""

import os
import sys
import threading
import time

WATCHDOG_S = 120.0


def _watchdog() -> None:
    time.sleep(WATCHDOG_S)
    print(f"FAIL: watchdog: not finished after {WATCHDOG_S:.0f} s (kernels hung?)", flush=True)
    os._exit(3)


threading.Thread(target=_watchdog, name="watchdog", daemon=True).start()

EP_SIZE = 2
NUM_TOKENS = 16  # per rank; also max_num_tokens and runtime_max_tokens_per_rank
HIDDEN = 7168
TOP_K = 8
NUM_EXPERTS = 256
EXPERTS_PER_RANK = NUM_EXPERTS // EP_SIZE


def main() -> int:
    t_start = time.perf_counter()
    import torch

    t_torch = time.perf_counter()
    import flashinfer.comm.trtllm_moe_alltoall as fi

    t_import = time.perf_counter()
    print(f"import torch: {t_torch - t_start:.3f} s; "
          f"import flashinfer.comm.trtllm_moe_alltoall: {t_import - t_torch:.3f} s", flush=True)

    if not torch.cuda.is_available():
        print("FAIL: no CUDA device")
        return 1
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    print(f"device: {torch.cuda.get_device_name(dev)}, capability "
          f"{torch.cuda.get_device_capability(dev)}, torch {torch.__version__}", flush=True)

    # Where FlashInfer resolves the module (prebuilt, not JIT-compiled).
    from flashinfer.jit.comm import gen_moe_alltoall_module

    spec = gen_moe_alltoall_module("legacy")
    print(f"module {spec.name}: prebuilt={spec.is_aot} path={spec.get_library_path()} "
          f"FLASHINFER_DISABLE_JIT={os.environ.get('FLASHINFER_DISABLE_JIT')}", flush=True)
    if not spec.is_aot:
        print("FAIL: FlashInfer does not see the prebuilt module (would JIT-compile)")
        return 1

    # First call: loads the .so through FlashInfer.
    dispatch_bytes_per_token = HIDDEN * 2 + TOP_K * 4 + TOP_K * 4
    combine_bytes_per_token = HIDDEN * 2
    t0 = time.perf_counter()
    size_per_rank = fi.moe_a2a_get_workspace_size_per_rank(
        EP_SIZE, NUM_TOKENS, dispatch_bytes_per_token, combine_bytes_per_token)
    t_first = time.perf_counter() - t0
    print(f"first call (moe_a2a_get_workspace_size_per_rank, loads the module): {t_first:.3f} s; "
          f"size_per_rank={size_per_rank}", flush=True)

    names, values = fi.get_moe_alltoall_module().moe_a2a_get_metainfo_index_pairs()
    meta_index = {str(n): int(v) for n, v in zip(names, values)}
    recv_counters_index = meta_index["MOE_A2A_RECV_COUNTERS_OFFSET_INDEX"]

    # ---- inputs ---------------------------------------------------------
    gen = torch.Generator(device="cpu").manual_seed(1234)
    hidden, expert_ids, weights = [], [], []
    for rank in range(EP_SIZE):
        h = torch.randn(NUM_TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
        ids = torch.empty(NUM_TOKENS, TOP_K, dtype=torch.int32)
        for t in range(NUM_TOKENS):
            if t % 4 == 0:
                # All 8 experts on one rank: exercises the single-destination case.
                owner = (t // 4 + rank) % EP_SIZE
                pick = torch.randperm(EXPERTS_PER_RANK, generator=gen)[:TOP_K] + owner * EXPERTS_PER_RANK
            else:
                pick = torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K]
            ids[t] = pick.to(torch.int32)
        w = torch.softmax(torch.randn(NUM_TOKENS, TOP_K, generator=gen), dim=-1)
        hidden.append(h.to(dev))
        expert_ids.append(ids.to(dev))
        weights.append(w.to(dev))

    # Reference routing: distinct destination ranks per token.
    dest_ranks = []  # [rank][token] -> sorted list of destination ranks
    for rank in range(EP_SIZE):
        owners = (expert_ids[rank].cpu() // EXPERTS_PER_RANK).tolist()
        dest_ranks.append([sorted(set(row)) for row in owners])

    # ---- workspace and per-rank initialization ---------------------------
    workspace = torch.zeros(EP_SIZE, size_per_rank, dtype=torch.uint8, device=dev)
    t0 = time.perf_counter()
    metainfo = [fi.moe_a2a_initialize(workspace, rank, EP_SIZE, NUM_TOKENS) for rank in range(EP_SIZE)]
    torch.cuda.synchronize()
    print(f"moe_a2a_initialize x{EP_SIZE}: {time.perf_counter() - t0:.3f} s", flush=True)
    streams = [torch.cuda.Stream(device=dev) for _ in range(EP_SIZE)]

    failures = []

    def check(cond: bool, what: str) -> None:
        if not cond:
            failures.append(what)
            print(f"  mismatch: {what}", flush=True)

    for round_idx, in_workspace in ((1, False), (2, True)):
        torch.cuda.synchronize()
        # Dispatch: rank 0 then rank 1, each on its own stream, no sync between.
        t0 = time.perf_counter()
        recv, combine_offset = [], []
        for rank in range(EP_SIZE):
            with torch.cuda.stream(streams[rank]):
                payloads, offset, _ = fi.moe_a2a_dispatch(
                    expert_ids[rank],
                    [hidden[rank], expert_ids[rank], weights[rank]],
                    workspace,
                    metainfo[rank],
                    NUM_TOKENS,
                    rank,
                    EP_SIZE,
                    TOP_K,
                    NUM_EXPERTS,
                )
            recv.append(payloads)
            combine_offset.append(offset)
        torch.cuda.synchronize()
        t_dispatch = time.perf_counter() - t0

        # Check what each rank received from each source rank.
        for rank in range(EP_SIZE):
            meta = metainfo[rank]
            off = int(meta[recv_counters_index])
            counts = workspace[rank, off:off + 4 * EP_SIZE].view(torch.int32).tolist()
            recv_h, recv_ids, recv_w = recv[rank]
            for src in range(EP_SIZE):
                expected = [t for t in range(NUM_TOKENS) if rank in dest_ranks[src][t]]
                check(counts[src] == len(expected),
                      f"round {round_idx}: rank {rank} got {counts[src]} tokens from rank {src}, "
                      f"expected {len(expected)}")
                n = min(counts[src], len(expected))
                if n == 0:
                    continue
                # Match received rows to source tokens (slot order is not defined).
                rows = recv_h[src, :n]
                eq = (rows[:, None, :] == hidden[src][None, :, :]).all(dim=-1)  # [n, T]
                matched = [int(torch.nonzero(eq[i]).flatten()[0]) if bool(eq[i].any()) else -1
                           for i in range(n)]
                check(sorted(matched) == expected,
                      f"round {round_idx}: rank {rank} rows from rank {src} are tokens "
                      f"{sorted(matched)}, expected {expected}")
                for i, t in enumerate(matched):
                    if t < 0:
                        continue
                    check(torch.equal(recv_ids[src, i], expert_ids[src][t]),
                          f"round {round_idx}: rank {rank} expert ids of token {t} from rank {src}")
                    check(torch.equal(recv_w[src, i], weights[src][t]),
                          f"round {round_idx}: rank {rank} weights of token {t} from rank {src}")

        # "Experts": output = received hidden rows. Then combine, rank 0 then
        # rank 1 on their own streams, no sync between.
        expert_out = []
        for rank in range(EP_SIZE):
            if in_workspace:
                view = fi.moe_a2a_wrap_payload_tensor_in_workspace(
                    workspace[rank, :],
                    [EP_SIZE, NUM_TOKENS],
                    combine_offset[rank],
                    combine_offset[rank] + EP_SIZE * NUM_TOKENS * HIDDEN * 2,
                    torch.bfloat16,
                )
                view.copy_(recv[rank][0])
                expert_out.append(view)
            else:
                expert_out.append(recv[rank][0].clone())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outputs = []
        for rank in range(EP_SIZE):
            with torch.cuda.stream(streams[rank]):
                out = fi.moe_a2a_combine(
                    expert_out[rank],
                    NUM_TOKENS,
                    workspace,
                    metainfo[rank],
                    NUM_TOKENS,
                    rank,
                    EP_SIZE,
                    TOP_K,
                    combine_offset[rank],
                    payload_in_workspace=in_workspace,
                )
            outputs.append(out)
        torch.cuda.synchronize()
        t_combine = time.perf_counter() - t0

        # Reference: hidden * number of distinct destination ranks (fp32, then bf16).
        for rank in range(EP_SIZE):
            n_dest = torch.tensor([len(d) for d in dest_ranks[rank]], dtype=torch.float32, device=dev)
            ref = (hidden[rank].float() * n_dest[:, None]).to(torch.bfloat16)
            got = outputs[rank]
            ok = tuple(got.shape) == (NUM_TOKENS, HIDDEN) and got.dtype == torch.bfloat16 \
                and torch.equal(got, ref)
            diff = (got.float() - ref.float()).abs().max().item() if got.shape == ref.shape else float("nan")
            check(ok, f"round {round_idx}: rank {rank} combine output differs from reference "
                      f"(max abs diff {diff})")
        print(f"round {round_idx} (payload_in_workspace={in_workspace}): dispatch x{EP_SIZE} "
              f"{t_dispatch * 1e3:.1f} ms, combine x{EP_SIZE} {t_combine * 1e3:.1f} ms "
              f"(wall, incl. launch{'; first use loads kernels' if round_idx == 1 else ''})",
              flush=True)

    total = time.perf_counter() - t_start
    if failures:
        print(f"FAIL: {len(failures)} mismatches (total {total:.2f} s)")
        return 1
    print(f"PASS: ep_size={EP_SIZE}, tokens/rank={NUM_TOKENS}, hidden={HIDDEN} bf16, top_k={TOP_K}, "
          f"experts={NUM_EXPERTS}; import {t_import - t_torch:.2f} s, first call {t_first:.2f} s, "
          f"total {total:.2f} s")
    return 0


if __name__ == "__main__":
    try:
        rc = main()
    except Exception as exc:  # report instead of a bare traceback
        import traceback

        traceback.print_exc()
        print(f"FAIL: {type(exc).__name__}: {exc}")
        rc = 1
    sys.stdout.flush()
    os._exit(rc)
