"""torch-moe-a2a: MoE all-to-all dispatch/combine as PyTorch custom operators.

Importing the package loads the extension ``torch_moe_a2a._C``, which registers
``torch.ops.moe_a2a.*``, and exports the FlashInfer-compatible API
(DESIGN.md section 2). It first checks that the extension was built against the
running torch (``_build_info``, written by the build), and raises ImportError
saying how to rebuild when not.
"""

import importlib

import torch  # libtorch must be loaded before the extension

from ._build_check import check_build_info

try:
    _build_info = importlib.import_module(f"{__name__}._build_info")
except ModuleNotFoundError as e:
    if e.name != f"{__name__}._build_info":
        raise
    _build_info = None
check_build_info(_build_info, str(torch.__version__))
__version__: str = _build_info.version

from . import _C  # noqa: E402,F401  (registers torch.ops.moe_a2a)
from .api import (  # noqa: E402
    SfLayout,
    check_errors,
    get_moe_alltoall_module,
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
from .autograd import (  # noqa: E402
    checkpoint_context,
    checkpoint_policy,
    moe_a2a_combine_differentiable,
    moe_a2a_combine_expert_major_differentiable,
    moe_a2a_dispatch_differentiable,
    moe_a2a_dispatch_expert_major_differentiable,
)
from .expert_major import (  # noqa: E402
    ExpertMajorDispatch,
    moe_a2a_combine_expert_major,
    moe_a2a_dispatch_expert_major,
    moe_a2a_get_dropped_pair_count,
    moe_a2a_get_workspace_size_per_rank_expert_major,
)
from .flashinfer_patch import patch_flashinfer, unpatch_flashinfer  # noqa: E402
from .layout import MOE_A2A_RANK_MASK_WORDS  # noqa: E402
from .mapping import Mapping  # noqa: E402
from .mnnvl import MnnvlConfig, TorchDistBackend  # noqa: E402
from .moe_alltoall import MoeAlltoAll  # noqa: E402
from .moe_ep import NVLinkOneSidedAlltoAll  # noqa: E402
from .simulate import RankGraphs, SimulatedEP  # noqa: E402
from .workspace import allocate_workspace, cuda_workspace_granularity  # noqa: E402

__all__ = [
    "__version__",
    "ExpertMajorDispatch",
    "MOE_A2A_RANK_MASK_WORDS",
    "Mapping",
    "MnnvlConfig",
    "MoeAlltoAll",
    "NVLinkOneSidedAlltoAll",
    "SfLayout",
    "RankGraphs",
    "SimulatedEP",
    "TorchDistBackend",
    "allocate_workspace",
    "check_errors",
    "checkpoint_context",
    "checkpoint_policy",
    "cuda_workspace_granularity",
    "get_moe_alltoall_module",
    "local_expert_range",
    "moe_a2a_active_rank_mask",
    "moe_a2a_combine",
    "moe_a2a_combine_differentiable",
    "moe_a2a_combine_expert_major",
    "moe_a2a_combine_expert_major_differentiable",
    "moe_a2a_dispatch",
    "moe_a2a_dispatch_differentiable",
    "moe_a2a_dispatch_expert_major",
    "moe_a2a_dispatch_expert_major_differentiable",
    "moe_a2a_get_dropped_pair_count",
    "moe_a2a_get_invalid_expert_count",
    "moe_a2a_get_recv_counts",
    "moe_a2a_get_workspace_size_per_rank",
    "moe_a2a_get_workspace_size_per_rank_expert_major",
    "moe_a2a_initialize",
    "moe_a2a_sanitize_expert_ids",
    "moe_a2a_wrap_payload_tensor_in_workspace",
    "patch_flashinfer",
    "unpatch_flashinfer",
]
