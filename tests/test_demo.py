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
    assert proc.returncode == 2 and "demo" in proc.stderr  # the help, commands listed, on stderr


def test_demo_checks_its_arguments_before_any_work(capsys):
    """Arguments the kernels would refuse are argparse errors (the full list: tests/test_cli.py)."""
    from torch_moe_a2a.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["demo", "--ep", "100", "--device", "cpu"])
    assert e.value.code == 2 and "ep_size must be in 1..64, got 100" in capsys.readouterr().err


# ---- one rank per process (torchrun) ------------------------------------------------


def _demo_rank(rank, world, init_file, out_dir):
    """What torchrun would start: the demo with RANK/WORLD_SIZE/LOCAL_RANK set."""
    import contextlib
    import io
    import pathlib

    from torch_moe_a2a.__main__ import main

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["demo", "--device", "cpu", "--init-method", f"file://{init_file}", "--tokens", "16",
                   "--hidden", "64", "--top-k", "3", "--experts", "7", "--rounds", "2"])
    pathlib.Path(out_dir, f"rank{rank}.out").write_text(f"{rc}\n{printed.getvalue()}")


@pytest.mark.slow
def test_demo_one_rank_per_process_cpu(tmp_path):
    """`torchrun --nproc-per-node 2 -m torch_moe_a2a demo` on the CPU: two
    processes, a shared-memory workspace; rank 0 reports both ranks."""
    from conftest import run_ranks

    world = 2
    run_ranks(_demo_rank, world, (str(tmp_path / "init"), str(tmp_path)), report_dir=tmp_path, timeout_s=120,
              env={"MOE_A2A_TIMEOUT_S": "20"})
    outputs = [(tmp_path / f"rank{r}.out").read_text().split("\n", 1) for r in range(world)]
    assert [int(rc) for rc, _ in outputs] == [0] * world, outputs
    report = outputs[0][1]
    assert "2 processes (one rank each)" in report and "device cpu" in report, report
    ok_rows = [line for line in report.splitlines() if re.match(r"\s*\d+\s.*\bOK\s*$", line)]
    assert len(ok_rows) == world and "all ranks match the reference bitwise" in report, report
    assert outputs[1][1] == "", "only rank 0 prints"


def test_demo_under_torchrun_refuses_other_ep(monkeypatch, capsys):
    from torch_moe_a2a.__main__ import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["demo", "--ep", "3", "--device", "cpu"]) == 2
    assert "--ep 3 differs from WORLD_SIZE 2" in capsys.readouterr().err
