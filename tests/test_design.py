"""docs/DESIGN.md section 2's table of the public API against the code: every
public function (and every class the table spells out) with its exact
signature, so that the contract and the code cannot drift apart."""

from __future__ import annotations

import enum
import inspect
import pathlib
import re

import pytest

import torch_moe_a2a

DESIGN = pathlib.Path(__file__).parents[1] / "docs" / "DESIGN.md"


def _section_2() -> str:
    text = DESIGN.read_text()
    start = text.index("## 2. Public Python API")
    return text[start:text.index("\n## 3.", start)]


def _table_signatures() -> dict[str, str]:
    """``name`` -> ``name(...)`` as written in the first column of section 2's table."""
    found = {}
    for line in _section_2().splitlines():
        if not line.startswith("| `"):
            continue
        first_cell = line.split(" | ")[0]
        for span in re.findall(r"`([A-Za-z_]\w*\(.*?\))`", first_cell):
            found[span[:span.index("(")]] = span
    return found


def _default(value) -> str:
    """A default as DESIGN writes it: strings in double quotes, enum members by name."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _render(name: str, obj) -> str:
    parts, keyword_only = [], False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            keyword_only = True
            continue
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not keyword_only:
            parts.append("*")
            keyword_only = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={_default(p.default)}")
    return f"{name}({', '.join(parts)})"


PUBLIC_FUNCTIONS = sorted(n for n in torch_moe_a2a.__all__ if inspect.isfunction(getattr(torch_moe_a2a, n)))


def test_the_table_is_found():
    table = _table_signatures()
    assert len(table) >= 10 and "moe_a2a_dispatch" in table, table


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS)
def test_every_public_function_has_its_signature_in_design(name):
    table = _table_signatures()
    assert name in table, f"docs/DESIGN.md section 2 has no row for {name}"
    assert table[name] == _render(name, getattr(torch_moe_a2a, name))


def test_every_row_is_public_and_spelled_out_signatures_match():
    """No row for a name the package does not export; a class spelled out
    (not ``Name(...)``) has its constructor's signature."""
    for name, written in _table_signatures().items():
        assert name in torch_moe_a2a.__all__, f"docs/DESIGN.md section 2 names {name}, which is not public"
        obj = getattr(torch_moe_a2a, name)
        if inspect.isclass(obj) and written == f"{name}(...)":
            continue
        assert written == _render(name, obj)


# Paths of the workspace the repository was written in, not of the repository:
# a reader of a clone has no such files.
OUTSIDE_PATHS = re.compile(r"\.\./shared/|\bshared/seed/|\bseed/\w+\.txt")


def test_no_file_names_a_file_outside_the_repository():
    """DESIGN.md section 9: the repository's docs, code and tests refer only to its own files."""
    root = pathlib.Path(__file__).parents[1]
    suffixes = {".md", ".py", ".h", ".cpp", ".cu", ".cuh", ".toml", ".txt", ".sh", ".in"}
    found = []
    for path in sorted(root.rglob("*")):
        parts = path.relative_to(root).parts
        if path.is_file() and path.suffix in suffixes and not any(p.startswith(".") or p == "build" for p in parts):
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if OUTSIDE_PATHS.search(line):
                    found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
