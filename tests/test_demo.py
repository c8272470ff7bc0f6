"""`python -m torch_moe_a2a demo` runs, checks every rank and says so."""

import os
import re
import subprocess
import sys

import pytest


@pytest.mark.parametrize("ep", [1, 3])
def test_demo_cli(ep, device):
    cmd = [sys.executable, "-m", "torch_moe_a2a", "demo", "--ep", str(ep), "--tokens", "16", "--hidden", "64",
           "--top-k", "3", "--experts", "7", "--rounds", "2", "--device", device]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MOE_A2A_TIMEOUT_S": "20"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ok_rows = [line for line in proc.stdout.splitlines() if re.match(r"\s*\d+\s.*\bOK\s*$", line)]
    assert len(ok_rows) == ep, proc.stdout
    assert "MISMATCH" not in proc.stdout


def test_cli_without_command_fails():
    proc = subprocess.run([sys.executable, "-m", "torch_moe_a2a"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "demo" in proc.stderr
