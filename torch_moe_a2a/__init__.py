"""torch-moe-a2a: MoE all-to-all dispatch/combine as PyTorch custom operators.

Importing the package loads the extension ``torch_moe_a2a._C``, which registers
``torch.ops.moe_a2a.*``, and exports the FlashInfer-compatible API
(DESIGN.md section 2).
"""

import torch  # noqa: F401  (libtorch must be loaded before the extension)

from . import _C  # noqa: F401  (registers torch.ops.moe_a2a)
from .api import (
    SfLayout,
    check_errors,
    local_expert_range,
    moe_a2a_active_rank_mask,
    moe_a2a_combine,
    moe_a2a_dispatch,
    moe_a2a_get_invalid_expert_count,
    moe_a2a_get_recv_counts,
    moe_a2a_get_workspace_size_per_rank,
    moe_a2a_initialize,
    moe_a2a_sanitize_expert_ids,
    moe_a2a_wrap_payload_tensor_in_workspace,
)
from .flashinfer_patch import patch_flashinfer, unpatch_flashinfer
from .layout import MOE_A2A_RANK_MASK_WORDS
from .mapping import Mapping
from .moe_alltoall import MoeAlltoAll
from .simulate import RankGraphs, SimulatedEP
from .workspace import allocate_workspace, cuda_workspace_granularity

__all__ = [
    "MOE_A2A_RANK_MASK_WORDS",
    "Mapping",
    "MoeAlltoAll",
    "SfLayout",
    "RankGraphs",
    "SimulatedEP",
    "allocate_workspace",
    "check_errors",
    "cuda_workspace_granularity",
    "local_expert_range",
    "moe_a2a_active_rank_mask",
    "moe_a2a_combine",
    "moe_a2a_dispatch",
    "moe_a2a_get_invalid_expert_count",
    "moe_a2a_get_recv_counts",
    "moe_a2a_get_workspace_size_per_rank",
    "moe_a2a_initialize",
    "moe_a2a_sanitize_expert_ids",
    "moe_a2a_wrap_payload_tensor_in_workspace",
    "patch_flashinfer",
    "unpatch_flashinfer",
]
