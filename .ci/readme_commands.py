"""Print the README's shell commands that CI runs, one a line, in the README's
order: every line of its ```bash blocks but the ones below, each of which must
still be in the README (so this list cannot outlive a README edit).

Usage (from the repository root): python3 .ci/readme_commands.py
"""

import pathlib
import re
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

# README lines CI does not run, and why.
NOT_RUN = {
    "./dev test": "the quick part of CI's first step",
    "pip install --no-build-isolation --no-deps .": "the build without isolation, which ./dev makes (editable)",
    "./dev run torchrun --nproc-per-node 8 -m torch_moe_a2a demo --device cuda": "needs CUDA",
    'eval "$(bash scripts/flashinfer_peer.sh env)"': "the FlashInfer comparison needs CUDA",
    "./dev run python3 -m torch_moe_a2a bench --graph all-ranks --peer flashinfer": "needs CUDA",
}


def _command(line: str) -> str:
    """The line without its trailing comment (two spaces, then '#')."""
    return re.split(r"\s{2,}#", line, maxsplit=1)[0].strip()


def main() -> int:
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    commands = [_command(line) for block in blocks for line in block.splitlines()]
    commands = [c for c in commands if c and not c.startswith("#")]
    stale = [c for c in NOT_RUN if c not in commands]
    if stale:
        print(f"{__file__}: not in README.md any more: {stale}", file=sys.stderr)
        return 1
    for command in commands:
        if command not in NOT_RUN:
            print(command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
