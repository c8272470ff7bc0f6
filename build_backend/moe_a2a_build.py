"""PEP 517 build backend: setuptools.build_meta, compiling against the torch of
the environment that the package is installed into.

torch is deliberately not a build requirement. Under build isolation pip would
resolve it afresh into a temporary environment (the newest release, a CUDA
build by default) instead of the torch the extension will run with, and a C++
extension only works with the torch it was compiled against.

pip runs the backend with the target environment's interpreter and hides that
environment's site-packages (sitecustomize in PYTHONPATH). The hooks below put
those directories back at the END of sys.path, so setup.py imports the
target's torch while setuptools, wheel and ninja still come from the build
environment. Without build isolation torch is importable already and nothing
changes. setup.py runs inside the hook's process, so sys.path is enough: no
Python subprocess of the build needs torch.
"""

import functools
import importlib.util
import os
import site
import sys

from setuptools import build_meta as _setuptools

INSTALL_TORCH_FIRST = (
    "torch-moe-a2a compiles against the torch installed in the environment it is "
    "installed into, and that environment has no torch (looked in: {where}). "
    "Install torch first, e.g. `pip install torch==2.13.0` (PyPI's CUDA build; on a "
    "machine without a GPU the CPU build: `pip install torch==2.13.0 --index-url "
    "https://download.pytorch.org/whl/cpu`), then `pip install .` again. A frontend that builds in an environment "
    "of its own (`python -m build`, uv, pip's venv-isolation feature) cannot show "
    "this backend the target's torch: build without isolation there "
    "(`--no-build-isolation`; `python -m build --no-isolation`)."
)


def _target_site_dirs() -> list[str]:
    """The site-packages of the interpreter running the backend, in the order
    Python itself searches them (user site first, where it applies)."""
    dirs = []
    if sys.prefix == sys.base_prefix:  # a venv does not see the user site
        dirs.append(site.getusersitepackages())
    dirs.extend(site.getsitepackages())
    return [d for d in dirs if os.path.isdir(d)]


def _require_target_torch() -> None:
    if importlib.util.find_spec("torch") is not None:
        return
    searched = _target_site_dirs()
    for d in searched:
        if d not in sys.path:
            sys.path.append(d)
    importlib.invalidate_caches()
    if importlib.util.find_spec("torch") is None:
        raise SystemExit(INSTALL_TORCH_FIRST.format(where=", ".join(searched) or "no site-packages"))


def _with_target_torch(hook):
    @functools.wraps(hook)
    def run(*args, **kwargs):
        _require_target_torch()
        return hook(*args, **kwargs)

    return run


# Every hook runs setup.py, which imports torch.
get_requires_for_build_wheel = _with_target_torch(_setuptools.get_requires_for_build_wheel)
get_requires_for_build_sdist = _with_target_torch(_setuptools.get_requires_for_build_sdist)
get_requires_for_build_editable = _with_target_torch(_setuptools.get_requires_for_build_editable)
prepare_metadata_for_build_wheel = _with_target_torch(_setuptools.prepare_metadata_for_build_wheel)
prepare_metadata_for_build_editable = _with_target_torch(_setuptools.prepare_metadata_for_build_editable)
build_wheel = _with_target_torch(_setuptools.build_wheel)
build_sdist = _with_target_torch(_setuptools.build_sdist)
build_editable = _with_target_torch(_setuptools.build_editable)
