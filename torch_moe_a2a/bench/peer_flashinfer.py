"""FlashInfer's ``moe_a2a_*`` functions as ``bench --graph all-ranks --peer
flashinfer`` times them: the same harness, inputs and checks as ours
(:class:`~torch_moe_a2a.bench.replay.A2ARanks`), FlashInfer's functional API
under it (same signatures). FlashInfer is an optional dependency; README.md,
'Comparing with FlashInfer', says how to install it for this.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from .common import Point
from .replay import A2ARanks

MODULE = "flashinfer.comm.trtllm_moe_alltoall"
# FlashInfer's combine launches one CTA per token on every rank, and every
# CTA waits for the peers: simulated ranks on one GPU deadlock unless all
# ep * T CTAs are resident at once. Its block size is read once per process
# from this variable (default 256 threads); smaller blocks fit more CTAs.
COMBINE_BLOCK_SIZE_VARIABLE = "TLLM_MOE_A2A_COMBINE_BLOCK_SIZE"
# (most CTAs of all ranks, block size): the smallest block size of FlashInfer's
# own choices that seen fitting on an H200 (132 SMs); above the last bound
# no block size fits, and the watchdog reports the hang.
COMBINE_BLOCKS = ((256, 256), (512, 64), (1024, 32))


class FlashInferRanks(A2ARanks):
    name = "flashinfer"

    def __init__(self, point: Point, device: torch.device):
        super().__init__(point, device, importlib.import_module(MODULE))

    @staticmethod
    def unavailable() -> Optional[str]:
        """Why FlashInfer cannot be timed here, or None."""
        try:
            importlib.import_module(MODULE)
        except Exception as e:  # noqa: BLE001 - any failure to import means "not available"
            return f"import {MODULE}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return None

    @staticmethod
    def environment(ep: int, tokens: int) -> dict:
        if ep == 1:
            return {}  # no peer to wait for: the default block size runs at any size
        ctas = ep * max(tokens, 1)
        for most, block in COMBINE_BLOCKS:
            if ctas <= most:
                return {} if block == 256 else {COMBINE_BLOCK_SIZE_VARIABLE: str(block)}
        return {COMBINE_BLOCK_SIZE_VARIABLE: str(COMBINE_BLOCKS[-1][1])}
