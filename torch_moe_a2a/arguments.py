"""The argument checks and conversions that the rank-major functions
(:mod:`torch_moe_a2a.api`) and the expert-major ones
(:mod:`torch_moe_a2a.expert_major`) share: the timeout, the rank mask, the
``MOE_A2A_DEBUG`` id check and the dispatch op's arguments."""

from __future__ import annotations

import enum
import operator
import os
from typing import Any, Optional, Sequence

import torch

from .backend import check_backend, pdl_default
from .compile_marks import constant_result
from .fastpath import expect_tensor_list, expect_tensors
from .layout import MOE_A2A_RANK_MASK_WORDS
from .metainfo import call_timeout, check_rank, metainfo_values

U64 = 1 << 64
_I64_SIGN = 1 << 63
# Expert-id dtypes dispatch reads and sanitize writes (int64: torch.topk's indices).
ID_DTYPES = (torch.int32, torch.int64)
# Payload dtypes the combine sums.
COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# SfLayout.layout_linear's value (api.SfLayout, FlashInfer's): what sf_layout=None means.
LAYOUT_LINEAR = 2


def eplb_length(value: Any) -> Any:
    """An EPLB stats length as given: ``None`` is 0, no EPLB (TensorRT-LLM's
    convention for its ``eplb_stats_num_experts``); anything else is returned
    for the caller's own check."""
    return 0 if value is None else value


def check_flag(name: str, value) -> None:
    """A yes/no argument: a bool (or an int 0 or 1); a string such as 'no'
    would read as yes.

    Raises:
        ValueError: anything else.
    """
    if not (isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def rank_mask_words(enable_rank_mask: bool, active_rank_mask: Optional[torch.Tensor]) -> Sequence[int]:
    """The op's ``active_rank_mask``: ``()`` for "every rank", else the words as signed int64."""
    if enable_rank_mask is not False:
        check_flag("enable_rank_mask", enable_rank_mask)
    if active_rank_mask is None:
        if enable_rank_mask:
            # FlashInfer's contract: opting into the mask without saying which
            # ranks are alive is a caller's bug, not "every rank".
            raise ValueError("active_rank_mask must be given when enable_rank_mask=True "
                             "(see moe_a2a_active_rank_mask)")
        return ()
    if not enable_rank_mask:
        raise ValueError("active_rank_mask requires enable_rank_mask=True")
    if not (
        isinstance(active_rank_mask, torch.Tensor)
        and active_rank_mask.dtype == torch.uint64
        and active_rank_mask.device.type == "cpu"
        and tuple(active_rank_mask.shape) == (MOE_A2A_RANK_MASK_WORDS,)
    ):
        raise ValueError(
            f"active_rank_mask must be a CPU uint64 tensor of shape [{MOE_A2A_RANK_MASK_WORDS}] "
            "(see moe_a2a_active_rank_mask)"
        )
    if torch.compiler.is_compiling():
        return _mask_words_at_trace_time(active_rank_mask, id(active_rank_mask))
    return _signed_words(active_rank_mask)


def _signed_words(active_rank_mask: torch.Tensor) -> list[int]:
    return [w - U64 if w >= _I64_SIGN else w for w in active_rank_mask.tolist()]


@constant_result
def _mask_words_at_trace_time(active_rank_mask: torch.Tensor, key: int) -> list[int]:
    """torch.compile: the mask's words, read once at trace time and baked into the
    graph; ``key`` (``id(active_rank_mask)``) makes dynamo guard on the tensor's
    identity, so a new mask tensor (``moe_a2a_active_rank_mask`` returns a new
    one) recompiles. Changing a mask tensor in place is not seen by a compiled graph."""
    return _signed_words(active_rank_mask)


# MOE_A2A_DEBUG is read at every call (tests set it at run time), from
# os.environ's underlying dict where it has one: os.environ.get costs about a
# microsecond per call (key and value encoding), a twentieth of a dispatch
# wrapper's whole host budget.
_ENVIRON_DATA = getattr(os.environ, "_data", None)
_DEBUG_KEY = "MOE_A2A_DEBUG"
_DEBUG_RAW_KEY = os.environ.encodekey(_DEBUG_KEY) if hasattr(os.environ, "encodekey") else None


# Its values, as a flag reads: "false" or "off" enabled the check when every
# value other than "" and "0" did.
_DEBUG_VALUES = {"": False, "0": False, "false": False, "no": False, "off": False,
                 "1": True, "true": True, "yes": True, "on": True}


def _debug_enabled() -> bool:
    """Whether MOE_A2A_DEBUG asks for the host check of the ids.

    Raises:
        ValueError: a value that is none of 1/0, true/false, yes/no, on/off
            (any case, spaces around them ignored).
    """
    if isinstance(_ENVIRON_DATA, dict) and _DEBUG_RAW_KEY is not None:
        raw = _ENVIRON_DATA.get(_DEBUG_RAW_KEY)
        value = "0" if raw is None else os.environ.decodevalue(raw)
    else:
        value = os.environ.get(_DEBUG_KEY, "0")
    enabled = _DEBUG_VALUES.get(value)
    if enabled is None:
        enabled = _DEBUG_VALUES.get(value.strip().lower())
        if enabled is None:
            raise ValueError(f"MOE_A2A_DEBUG must be 1 or 0 (or true/false, yes/no, on/off), got {value!r}")
    return enabled


# MOE_A2A_DEBUG=1: refuse expert ids >= num_experts on the host before each
# dispatch, eager or traced (the op reads the ids when the graph runs; a
# sync on CUDA, skipped inside a CUDA-graph capture). It returns nothing and
# mutates nothing, so traced graphs would drop it without this mark.
_check_expert_ids = torch.ops.moe_a2a.check_expert_ids.default
torch.fx.node.has_side_effect(_check_expert_ids)


def dispatch_args(fn, token_selected_experts, input_payloads, workspace, metainfo, runtime_max_tokens_per_rank,
                  ep_rank, ep_size, top_k, num_experts, enable_pdl, eplb_local_stats, enable_rank_mask,
                  active_rank_mask, backend, timeout_s) -> tuple[tuple, int]:
    """The dispatch op's arguments (csrc/schemas.h's order) from a functional
    call's, after the checks only the Python layer can make (the op checks the rest).

    Args:
        fn: the public function's name, for the errors.
        the rest: those of :func:`~torch_moe_a2a.moe_a2a_dispatch`.

    Returns:
        ``(args, eplb_n)``: the op's arguments and the EPLB length of this call
        (0 without ``eplb_local_stats``).

    Raises:
        ValueError: a non-tensor where a tensor belongs, ``input_payloads``
            not a list or tuple, a metainfo of another rank, a bad rank mask;
            with ``MOE_A2A_DEBUG=1`` an expert id ``>= num_experts``.
        NotImplementedError: ``backend="cake"`` on Blackwell.
    """
    if not (isinstance(token_selected_experts, torch.Tensor) and isinstance(workspace, torch.Tensor)):
        # Inline test first: the call costs the per-call path half a microsecond.
        expect_tensors(fn, token_selected_experts=token_selected_experts, workspace=workspace)
    if not isinstance(input_payloads, (list, tuple)):
        # A generator would be used up by the fast path's first look at it (the op then sees none).
        expect_tensor_list(fn, "input_payloads", input_payloads)
    check_backend(backend, workspace)
    meta = metainfo_values(metainfo, id(metainfo))
    check_rank(meta, ep_rank, ep_size, workspace)
    _, _, max_num_tokens, eplb_n, _, mailbox, _ = meta
    mask = rank_mask_words(enable_rank_mask, active_rank_mask)
    if enable_pdl is None:
        enable_pdl = pdl_default(workspace)
    if _debug_enabled():  # under torch.compile: read when the call is traced
        _check_expert_ids(token_selected_experts, num_experts)
    args = (token_selected_experts, input_payloads, workspace, ep_rank, ep_size, max_num_tokens,
            runtime_max_tokens_per_rank, top_k, num_experts, eplb_local_stats, eplb_n, mask,
            call_timeout(meta, timeout_s), mailbox, enable_pdl)
    return args, (eplb_n if eplb_local_stats is not None else 0)


def layout_value(sf_layout: Any) -> int:
    """An ``sf_layout``'s int value: SfLayout's, FlashInfer's own enum's or a
    plain int's; None is the linear layout, as FlashInfer's combine reads it
    (its op takes ``Optional[SfLayout]``, and its ``moe_a2a_combine`` and
    ``MoeAlltoAll.combine`` pass the argument through). A symbolic int
    (torch.compile made the argument dynamic) is specialized: a layout is a
    choice of code, not a size.

    Raises:
        ValueError: anything else (a bool too: the op would read True as layout 1).
    """
    if sf_layout is None:
        return LAYOUT_LINEAR
    value = sf_layout.value if isinstance(sf_layout, enum.Enum) else sf_layout
    if isinstance(value, torch.SymInt):
        value = int(value)
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"sf_layout must be an SfLayout (layout_128x4, layout_8x4, layout_linear), its int "
                         f"value 0, 1 or 2, or None (linear), got {sf_layout!r}") from None


def data_address(t: torch.Tensor) -> int:
    """Where ``t``'s first element lies: ``data_ptr()`` reads 0 for a tensor
    without elements, whose storage and offset still say where it is."""
    if t.numel():
        return t.data_ptr()
    return t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
