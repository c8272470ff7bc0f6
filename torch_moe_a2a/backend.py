"""The backend names and what the device decides: FlashInfer's ``backend``
argument (``"trtllm"``; ``"cake"`` only on Blackwell) and the default of
``enable_pdl``. Capabilities are queried once per device and are constants to
``torch.compile``."""

from __future__ import annotations

from typing import Literal, Union

import torch

from .compile_marks import constant_result

MoeAlltoAllBackend = Literal["trtllm", "cake"]

# FlashInfer's opt-in backend exists only for these compute capabilities.
_CAKE_CAPABILITIES = ((10, 0), (10, 3))
# Programmatic dependent launch needs Hopper or newer.
_PDL_MIN_CAPABILITY = (9, 0)

_CAPABILITIES: dict[int, tuple[int, int]] = {}


@constant_result
def _cuda_capability(device_index: int) -> tuple[int, int]:
    """Compute capability of a CUDA device, queried once per device."""
    cap = _CAPABILITIES.get(device_index)
    if cap is None:
        cap = _CAPABILITIES[device_index] = tuple(torch.cuda.get_device_capability(device_index))
    return cap


def check_backend(backend: str, where: Union[torch.Tensor, torch.device, None]) -> None:
    """Accept ``"trtllm"``; refuse ``"cake"`` and unknown names with a clear error.

    ``"cake"`` is judged on the device of ``where`` (a tensor or a device), or
    on the current CUDA device when ``where`` is None (functions without a
    tensor argument; DESIGN.md section 3).
    """
    if backend == "trtllm":
        return
    if backend != "cake":
        raise ValueError(f"unknown MoE all-to-all backend {backend!r}; expected 'trtllm' or 'cake'")
    if isinstance(where, torch.Tensor):
        where = where.device
    if where is None and torch.cuda.is_available():
        where = torch.device("cuda", torch.cuda.current_device())
    capability = None
    if where is not None and where.type == "cuda":
        capability = _cuda_capability(where.index if where.index is not None else torch.cuda.current_device())
    if capability not in _CAKE_CAPABILITIES:
        found = f"compute capability {capability}" if capability else f"device {where or 'cpu (no CUDA device)'}"
        raise ValueError(f'backend="cake" requires compute capability 10.0 or 10.3, got {found}')
    raise NotImplementedError(
        'backend="cake" (FlashInfer\'s generated Blackwell kernels) is not implemented by '
        'torch-moe-a2a; use backend="trtllm"'
    )


def pdl_default(tensor: torch.Tensor) -> bool:
    """FlashInfer's ``enable_pdl=None``: on for CUDA devices of capability >= 9.0."""
    if not tensor.is_cuda:
        return False
    return _pdl_capable(tensor.get_device())


@constant_result
def _pdl_capable(device_index: int) -> bool:
    # A bool, not the capability tuple: dynamo cannot compare baked tuples.
    return _cuda_capability(device_index) >= _PDL_MIN_CAPABILITY
