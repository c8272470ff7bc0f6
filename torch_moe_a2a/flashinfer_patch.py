"""Route an installed FlashInfer's MoE all-to-all to torch-moe-a2a, unchanged callers included.

:func:`patch_flashinfer` replaces ``MoeAlltoAll`` and the ``moe_a2a_*``
functions of ``flashinfer.comm.trtllm_moe_alltoall`` with this package's, in
that module and in every module already imported that holds FlashInfer's
originals as attributes (``flashinfer.comm``, and a client such as SGLang's
FlashInfer token dispatcher that imported them by name). Modules imported
later read the replaced attributes, and FlashInfer's ``flashinfer.moe_ep``
looks ``MoeAlltoAll`` up when it builds one, so vLLM's path picks it up too
(until FlashInfer's CFT release, whose ``moe_ep`` runs kernels of its own:
there ``torch_moe_a2a.moe_ep`` stands for it).
The convention is liger-kernel's ``apply_liger_kernel_to_*``: call it once,
early, before the model is built.
"""

from __future__ import annotations

import importlib
import sys
import threading
from types import ModuleType
from typing import Any

from . import api
from .moe_alltoall import MoeAlltoAll

# The module that defines FlashInfer's MoE all-to-all API.
FLASHINFER_MODULE = "flashinfer.comm.trtllm_moe_alltoall"

# FlashInfer's names and what replaces each.
REPLACEMENTS: dict[str, Any] = {
    "MoeAlltoAll": MoeAlltoAll,
    "moe_a2a_initialize": api.moe_a2a_initialize,
    "moe_a2a_dispatch": api.moe_a2a_dispatch,
    "moe_a2a_combine": api.moe_a2a_combine,
    "moe_a2a_sanitize_expert_ids": api.moe_a2a_sanitize_expert_ids,
    "moe_a2a_wrap_payload_tensor_in_workspace": api.moe_a2a_wrap_payload_tensor_in_workspace,
    "moe_a2a_get_workspace_size_per_rank": api.moe_a2a_get_workspace_size_per_rank,
    "moe_a2a_active_rank_mask": api.moe_a2a_active_rank_mask,
}

_lock = threading.Lock()
# What patch_flashinfer replaced: (module, name, FlashInfer's original).
_replaced: list[tuple[ModuleType, str, Any]] = []


def _flashinfer_module() -> ModuleType:
    try:
        return importlib.import_module(FLASHINFER_MODULE)
    # Not only ImportError: FlashInfer's comm modules load CUDA libraries at
    # import, which fail with OSError or RuntimeError on a machine without
    # them; the caller's `except ImportError` (README) must see that too.
    except Exception as e:
        raise ImportError(
            f"patch_flashinfer needs FlashInfer installed: importing {FLASHINFER_MODULE} failed ({e}). Without "
            "FlashInfer, import the same names from torch_moe_a2a instead"
        ) from e


def patch_flashinfer() -> list[str]:
    """Make FlashInfer's ``MoeAlltoAll`` and ``moe_a2a_*`` functions this package's.

    Idempotent: a second call replaces only what appeared since (a module
    imported in between that took FlashInfer's originals by name). Undo with
    :func:`unpatch_flashinfer`.

    Returns:
        ``"module.name"`` for every attribute replaced by this call.

    Raises:
        ImportError: FlashInfer (``flashinfer.comm.trtllm_moe_alltoall``) does
            not import (whatever its import raised, a missing CUDA library
            too, is the cause), or lacks one of the names it replaces
            (``REPLACEMENTS``; ``moe_a2a_active_rank_mask`` came with
            FlashInfer's rank masks): then nothing is patched.
    """
    source = _flashinfer_module()
    with _lock:
        originals = {name: obj for module, name, obj in _replaced if module is source}
        for name in REPLACEMENTS:
            if name not in originals:
                if not hasattr(source, name):
                    raise ImportError(f"{FLASHINFER_MODULE} has no {name}: not a FlashInfer version this "
                                      "package patches")
                originals[name] = getattr(source, name)
        done = []
        for module in [source, *(m for m in list(sys.modules.values()) if isinstance(m, ModuleType))]:
            for name, replacement in REPLACEMENTS.items():
                if module.__dict__.get(name) is originals[name] and originals[name] is not replacement:
                    setattr(module, name, replacement)
                    _replaced.append((module, name, originals[name]))
                    done.append(f"{module.__name__}.{name}")
        return done


def unpatch_flashinfer() -> list[str]:
    """Put FlashInfer's originals back where :func:`patch_flashinfer` replaced them.

    Attributes changed again since (by someone else) are left alone. A call
    with nothing patched does nothing.

    Returns:
        ``"module.name"`` for every attribute restored.
    """
    with _lock:
        done = []
        for module, name, original in reversed(_replaced):
            if module.__dict__.get(name) is REPLACEMENTS[name]:
                setattr(module, name, original)
                done.append(f"{module.__name__}.{name}")
        _replaced.clear()
        return done


def flashinfer_patched() -> bool:
    """Whether FlashInfer's module currently holds this package's ``MoeAlltoAll``."""
    module = sys.modules.get(FLASHINFER_MODULE)
    return module is not None and module.__dict__.get("MoeAlltoAll") is MoeAlltoAll
