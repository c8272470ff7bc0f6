"""patch_flashinfer / unpatch_flashinfer against a stand-in FlashInfer module
tree laid out as FlashInfer 0.7.2.post1's (flashinfer.comm re-exporting the
names of flashinfer.comm.trtllm_moe_alltoall; flashinfer.moe_ep importing
MoeAlltoAll when it builds one), with a client module that imported the names
first; and against the real package where it imports."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

import torch_moe_a2a as a2a
from torch_moe_a2a import flashinfer_patch

NAMES = sorted(flashinfer_patch.REPLACEMENTS)

STAND_IN = {
    "flashinfer/__init__.py": "",
    "flashinfer/comm/__init__.py": "from .trtllm_moe_alltoall import (\n"
    + "".join(f"    {n},\n" for n in NAMES) + ")\n",
    "flashinfer/comm/trtllm_moe_alltoall.py": "".join(
        f"class {n}:\n    pass\n" if n == "MoeAlltoAll" else f"def {n}(*args, **kwargs):\n    return 'flashinfer'\n"
        for n in NAMES),
    "flashinfer/moe_ep/__init__.py": textwrap.dedent("""
        def build(*args, **kwargs):
            # As flashinfer/moe_ep's NVLinkOneSidedAlltoAll: the import runs when it builds one.
            from ..comm.trtllm_moe_alltoall import MoeAlltoAll
            return MoeAlltoAll
        """),
    "client_dispatcher.py": "from flashinfer.comm import MoeAlltoAll, moe_a2a_get_workspace_size_per_rank\n",
}


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    for path, text in STAND_IN.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")] + ["client_dispatcher"]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield
    a2a.unpatch_flashinfer()
    for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")] + ["client_dispatcher"]:
        sys.modules.pop(name, None)


def test_patch_routes_every_holder_and_unpatch_restores(stand_in):
    source = importlib.import_module("flashinfer.comm.trtllm_moe_alltoall")
    comm = importlib.import_module("flashinfer.comm")
    client = importlib.import_module("client_dispatcher")  # imported FlashInfer's names before the patch
    originals = {n: getattr(source, n) for n in NAMES}

    done = a2a.patch_flashinfer()
    for module in (source, comm):
        for name in NAMES:
            assert getattr(module, name) is flashinfer_patch.REPLACEMENTS[name], (module.__name__, name)
            assert f"{module.__name__}.{name}" in done
    assert client.MoeAlltoAll is a2a.MoeAlltoAll
    assert client.moe_a2a_get_workspace_size_per_rank is a2a.moe_a2a_get_workspace_size_per_rank
    assert importlib.import_module("flashinfer.moe_ep").build() is a2a.MoeAlltoAll
    assert flashinfer_patch.flashinfer_patched()

    assert a2a.patch_flashinfer() == []  # idempotent
    late = importlib.import_module("flashinfer.comm")  # a module imported after the patch reads ours
    assert late.MoeAlltoAll is a2a.MoeAlltoAll

    restored = a2a.unpatch_flashinfer()
    assert len(restored) == len(done)
    for module in (source, comm):
        for name in NAMES:
            assert getattr(module, name) is originals[name]
    assert client.MoeAlltoAll is originals["MoeAlltoAll"]
    assert not flashinfer_patch.flashinfer_patched()
    assert a2a.unpatch_flashinfer() == []  # nothing left to undo
    assert a2a.patch_flashinfer()  # and it patches again after an unpatch


def test_unpatch_leaves_attributes_someone_else_changed(stand_in):
    source = importlib.import_module("flashinfer.comm.trtllm_moe_alltoall")
    a2a.patch_flashinfer()
    mine = object()
    source.moe_a2a_dispatch = mine
    restored = a2a.unpatch_flashinfer()
    assert source.moe_a2a_dispatch is mine
    assert "flashinfer.comm.trtllm_moe_alltoall.moe_a2a_dispatch" not in restored


def test_patch_without_flashinfer_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer raises ImportError
    with pytest.raises(ImportError, match="patch_flashinfer needs FlashInfer installed"):
        a2a.patch_flashinfer()


@pytest.mark.parametrize("error", ["OSError('libcuda.so.1: cannot open shared object file')",
                                   "RuntimeError('no CUDA driver')"], ids=["OSError", "RuntimeError"])
def test_patch_with_a_flashinfer_that_fails_to_import_raises_import_error(stand_in, tmp_path, error):
    """A FlashInfer whose all-to-all module fails at import (a CUDA library
    missing on this machine) is reported as the ImportError the docstring and
    the README's example catch, with the cause named, and nothing is patched."""
    (tmp_path / "flashinfer/comm/trtllm_moe_alltoall.py").write_text(f"raise {error}\n")
    with pytest.raises(ImportError, match=r"patch_flashinfer needs FlashInfer installed: importing "
                                          r"flashinfer\.comm\.trtllm_moe_alltoall failed") as info:
        a2a.patch_flashinfer()
    assert error.split("(")[0] == type(info.value.__cause__).__name__
    assert not flashinfer_patch.flashinfer_patched()


def test_patch_refuses_an_unknown_flashinfer(stand_in, tmp_path):
    (tmp_path / "flashinfer/comm/__init__.py").write_text("")
    (tmp_path / "flashinfer/comm/trtllm_moe_alltoall.py").write_text("def moe_a2a_dispatch():\n    pass\n")
    with pytest.raises(ImportError, match="has no MoeAlltoAll"):
        a2a.patch_flashinfer()


def _real_flashinfer():
    try:
        return importlib.import_module(flashinfer_patch.FLASHINFER_MODULE)
    except Exception:  # not installed, or its CUDA dependencies missing on this machine
        return None


@pytest.mark.skipif(_real_flashinfer() is None, reason="FlashInfer's MoE all-to-all does not import here")
def test_patch_real_flashinfer():
    import flashinfer.comm

    module = _real_flashinfer()
    originals = {n: getattr(module, n) for n in NAMES}
    try:
        a2a.patch_flashinfer()
        assert flashinfer.comm.MoeAlltoAll is a2a.MoeAlltoAll
        assert module.moe_a2a_dispatch is a2a.moe_a2a_dispatch
    finally:
        a2a.unpatch_flashinfer()
    assert all(getattr(module, n) is originals[n] for n in NAMES)
