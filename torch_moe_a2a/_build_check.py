"""The check, made before the extension is loaded, that it was compiled
against the running torch: one compiled against another torch fails to load
with an undefined symbol, or loads and misbehaves."""

from __future__ import annotations

from types import ModuleType
from typing import Optional

REBUILD = (
    "`pip install --no-build-isolation --no-deps --force-reinstall .` in the "
    "torch-moe-a2a source tree, or `./dev test` there for the editable development install"
)


def check_build_info(build_info: Optional[ModuleType], running_torch: str) -> None:
    """Raises ImportError when there is no build (``build_info`` None: no
    torch_moe_a2a/_build_info.py) or it was made for another torch version."""
    if build_info is None:
        raise ImportError(
            "torch_moe_a2a is not built: torch_moe_a2a/_build_info.py, written with the "
            f"extension torch_moe_a2a._C, is missing. Build it against this torch (torch {running_torch}): {REBUILD}."
        )
    built = build_info.torch_version
    if built != running_torch:
        raise ImportError(
            f"torch_moe_a2a {build_info.version} was built with torch {built}, but torch "
            f"{running_torch} is running: the extension only works with the torch it was "
            f"compiled against. Rebuild it against this torch: {REBUILD}."
        )
