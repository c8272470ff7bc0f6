"""Functions ``torch.compile`` evaluates once at trace time and bakes into the
graph as constants (the metainfo values, a device's capabilities, a rank
mask's words)."""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


def constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo``.

    torch's decorator imports ``torch._dynamo`` (about a second, more than
    the rest of this package's import) to set one attribute on ``fn``, which
    dynamo reads when it traces a call. Setting the attribute here leaves the
    import to the first ``torch.compile``; tests/test_compile.py checks that
    the attribute is the one torch's decorator sets.

    Args:
        fn: a function whose result depends only on its arguments' identities
            and values known at trace time.

    Returns:
        ``fn`` itself, marked.
    """
    fn._dynamo_marked_constant = True
    return fn
