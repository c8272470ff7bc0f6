"""The README's Python examples run as written: each ```python block is saved
as a script and run in a fresh interpreter from an empty directory (so it
uses the installed package, as a reader would). A README edit that breaks
one fails here."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_examples():
    assert len(BLOCKS) >= 4, "the README's Python examples were not found"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path):
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(BLOCKS[index])
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"README example {index} failed:\n{BLOCKS[index]}\n{done.stdout}\n{done.stderr}"
