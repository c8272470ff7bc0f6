"""The marks ``torch.compile`` reads, set without importing ``torch._dynamo``.

torch's own functions (``torch.compiler.assume_constant_result``,
``torch._dynamo.mark_static_address``) import ``torch._dynamo``, which takes
longer than the rest of this package's import, to set one attribute that
dynamo reads when it traces. Setting the attribute here leaves the import to
the first ``torch.compile``; tests/test_compile.py checks that each mark is
the attribute torch's function sets.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result``: dynamo calls ``fn`` once at
    trace time and bakes its result into the graph (the metainfo values, a
    device's capabilities, a rank mask's words).

    Args:
        fn: a function whose result depends only on its arguments' identities
            and values known at trace time.

    Returns:
        ``fn`` itself, marked.
    """
    fn._dynamo_marked_constant = True
    return fn


def mark_static_address(t: torch.Tensor) -> None:
    """``torch._dynamo.mark_static_address(t)`` (unguarded): compiled graphs
    take ``t``'s address as fixed, so CUDA-graph trees accept the ops'
    in-place writes into it (docs/DESIGN.md section 4).

    Args:
        t: the tensor, marked in place.

    Raises:
        TypeError: ``t`` is not a tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"mark_static_address expects a tensor, got {type(t).__name__}")
    t._dynamo_static_input_type = "unguarded"
