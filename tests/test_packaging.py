"""Packaging: what the build records about itself, the import-time check of the
torch version, and the build backend's finding of the target environment's
torch (build_backend/moe_a2a_build.py), each without building anything.

Runs against whichever torch_moe_a2a is imported: the editable install of
`./dev test`, or the installed wheel when run from outside the source tree
(.ci/run does both).
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import torch_moe_a2a
from torch_moe_a2a import _build_info
from torch_moe_a2a._build_check import check_build_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module_imports(path: str, module: str, is_package: bool) -> set[str]:
    """The package's modules that ``module`` imports when it is imported
    (relative imports outside functions; ``from . import x`` names module x)."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    pending = list(ast.parse(open(path).read()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            parent = ".".join(base[:len(base) - node.level + 1])
            if node.module:
                found.add(f"{parent}.{node.module}")
            else:
                found.update(f"{parent}.{alias.name}" for alias in node.names)
        pending.extend(ast.iter_child_nodes(node))
    return found


def test_package_modules_import_no_cycle():
    """No module of the package imports one that imports it back, directly or
    through others: helpers two modules share live in a third."""
    root = os.path.dirname(torch_moe_a2a.__file__)
    graph = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), os.path.dirname(root))[:-3].replace(os.sep, ".")
                module = rel.removesuffix(".__init__")
                graph[module] = _module_imports(os.path.join(folder, name), module, name == "__init__.py")
    assert "torch_moe_a2a.expert_major" in graph["torch_moe_a2a.api"], "the import scan found nothing"

    def cycle_from(module, path):
        if module in path:
            return path[path.index(module):] + [module]
        for target in sorted(graph.get(module, ())):
            found = cycle_from(target, path + [module])
            if found:
                return found
        return None

    for module in sorted(graph):
        cycle = cycle_from(module, [])
        assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_build_info_matches_running_torch():
    assert _build_info.torch_version == torch.__version__
    assert _build_info.torch_cuda_version == torch.version.cuda
    has_cuda_kernels = torch._C._dispatch_has_kernel_for_dispatch_key("moe_a2a::dispatch", "CUDA")
    assert _build_info.with_cuda == has_cuda_kernels
    assert (_build_info.cuda_arch_list is not None) == _build_info.with_cuda


def test_version_is_the_distribution_version():
    assert torch_moe_a2a.__version__ == importlib.metadata.version("torch-moe-a2a")
    assert torch_moe_a2a.__version__ == _build_info.version
    assert "__version__" in torch_moe_a2a.__all__


def test_check_accepts_the_recorded_torch():
    check_build_info(_build_info, str(torch.__version__))


def test_check_rejects_another_torch():
    fake = types.SimpleNamespace(version="0.1.0", torch_version="2.0.0+cu118")
    with pytest.raises(ImportError) as info:
        check_build_info(fake, "2.13.0+cpu")
    message = str(info.value)
    assert "torch_moe_a2a 0.1.0 was built with torch 2.0.0+cu118, but torch 2.13.0+cpu is running" in message
    assert "pip install --no-build-isolation --no-deps --force-reinstall ." in message
    assert "./dev" in message


def test_check_without_build_says_how_to_build():
    with pytest.raises(ImportError, match=r"torch_moe_a2a is not built.*pip install --no-build-isolation"):
        check_build_info(None, "2.13.0+cpu")


def _run_backend(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter after the backend module is imported and
    the directory holding torch is removed from sys.path, as pip's build
    isolation removes the target environment's site-packages."""
    prelude = textwrap.dedent(
        f"""
        import importlib.util, os, sys
        sys.path.insert(0, {os.path.join(ROOT, "build_backend")!r})
        import moe_a2a_build
        torch_dir = os.path.dirname(os.path.dirname(importlib.util.find_spec("torch").origin))
        if torch_dir not in moe_a2a_build._target_site_dirs():
            sys.exit(77)  # torch is not in a site-packages (e.g. on PYTHONPATH): pip would hide it too
        sys.path[:] = [p for p in sys.path if os.path.realpath(p) != os.path.realpath(torch_dir)]
        importlib.invalidate_caches()
        assert importlib.util.find_spec("torch") is None
        """
    )
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True)


def test_backend_appends_target_site_packages():
    out = _run_backend(
        """
        before = list(sys.path)
        moe_a2a_build._require_target_torch()
        import torch
        # Appended: the build environment's own paths keep precedence.
        assert sys.path[: len(before)] == before and torch_dir in sys.path[len(before) :], sys.path
        assert os.path.dirname(torch.__file__) == os.path.join(torch_dir, "torch")
        print("ok")
        """
    )
    if out.returncode == 77:
        pytest.skip("torch is not installed in a site-packages directory")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_backend_without_torch_says_install_it_first():
    out = _run_backend(
        """
        moe_a2a_build._target_site_dirs = lambda: []
        moe_a2a_build._require_target_torch()
        """
    )
    if out.returncode == 77:
        pytest.skip("torch is not installed in a site-packages directory")
    assert out.returncode == 1
    assert "Install torch first, e.g. `pip install torch==" in out.stderr
    assert "then `pip install .` again" in out.stderr
