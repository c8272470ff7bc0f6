"""`python -m torch_moe_a2a`'s command line: help, unknown commands, the
version, and bad arguments ending in argparse's message and exit code 2,
never in a traceback."""

import dataclasses
import importlib.metadata
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import torch_moe_a2a
from torch_moe_a2a import __main__ as cli

COMMANDS = ("demo", "bench", "bench-dist")


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The real entry point, in a process of its own."""
    return subprocess.run([sys.executable, "-m", "torch_moe_a2a", *args], capture_output=True, text=True, timeout=120)


def _main(capsys, *args: str) -> subprocess.CompletedProcess:
    """``cli.main`` in this process (no interpreter start per case): the same
    exit code, stdout and stderr as ``_cli``, where argparse's exit counts as the code."""
    try:
        code = cli.main(list(args))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def _assert_clean_usage_error(proc: subprocess.CompletedProcess, message: str) -> None:
    """Exit code 2, argparse's 'error:' line with ``message`` last on stderr, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "error:" in last and message in last, proc.stderr


def test_help_lists_every_command_on_stdout():
    proc = _cli("--help")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    for name in COMMANDS:
        # One line per command: its name, then its summary on the same line.
        line = next((ln for ln in lines if ln.split()[:1] == [name]), None)
        assert line is not None, proc.stdout
        assert cli.COMMANDS[name].summary in line, line


@pytest.mark.parametrize("args", [["--version"], ["--help"]])
def test_import_and_cli_load_no_dynamo(args):
    """`import torch_moe_a2a` (and so --version and --help) leaves torch._dynamo
    unimported: it takes longer to import than the rest of the package
    (benchmarks/import_time.py); torch.compile imports it when it is used."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "torch_moe_a2a", *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "torch_moe_a2a.api" in imported, "-X importtime printed nothing recognizable"
    assert not [name for name in imported if name.startswith("torch._dynamo")], "torch._dynamo imported"


def test_unknown_command_names_it_and_lists_the_commands():
    proc = _cli("frobnicate", "--ep", "2")
    assert proc.returncode == 2, proc
    assert "unknown command 'frobnicate'" in proc.stderr
    assert all(name in proc.stderr for name in COMMANDS), proc.stderr
    assert "Traceback" not in proc.stderr


def test_no_command_fails_with_the_help(capsys):
    proc = _main(capsys)
    assert proc.returncode == 2 and all(name in proc.stderr for name in COMMANDS), proc


def test_version_is_the_packages(capsys):
    proc = _main(capsys, "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"torch-moe-a2a {torch_moe_a2a.__version__}"), proc.stdout
    try:
        installed = importlib.metadata.version("torch-moe-a2a")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed == torch_moe_a2a.__version__:
        assert proc.stdout == f"torch-moe-a2a {installed}\n", proc.stdout


def test_version_from_a_source_tree_says_so(monkeypatch):
    """Run from a clone without an install, the version is still the
    package's, and the output says that no distribution is installed."""
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert cli.package_version() == f"{torch_moe_a2a.__version__} (a source tree; torch-moe-a2a is not installed)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["demo", "bench"])
def test_device_cuda_without_cuda_is_a_usage_error(command):
    # Its own process: the error must reach the user as argparse's text, nothing after it.
    _assert_clean_usage_error(_cli(command, "--device", "cuda"), "CUDA was asked for but torch sees no CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_dev_gpu_without_cuda_fails_in_one_line():
    """`./dev gpu` stops before building or testing anything: one line on stderr, exit 1."""
    dev = pathlib.Path(__file__).parents[1] / "dev"
    proc = subprocess.run([str(dev), "gpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == "", proc
    assert proc.stderr.count("\n") == 1 and "sees no CUDA device" in proc.stderr, proc.stderr


def test_gpu_check_refuses_an_unknown_stage(tmp_path):
    """`./dev gpu test` (for `tests`) ran no stage, printed every row "not
    run" and exited 0: an unknown stage now fails at once, naming the
    stages, before any GPU work."""
    script = pathlib.Path(__file__).parents[1] / "scripts" / "gpu_check.sh"
    proc = subprocess.run(["bash", str(script), sys.executable, "tests", "test"], capture_output=True, text=True,
                          timeout=60, env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert "unknown stage 'test' (stages: tests sanitizer bench cmake" in proc.stderr, proc.stderr


def test_ep_out_of_range_is_a_usage_error(capsys):
    _assert_clean_usage_error(_cli("demo", "--ep", "100"), "ep_size must be in 1..64, got 100")
    _assert_clean_usage_error(_main(capsys, "bench", "--ep", "0"), "ep must be in 1..64, got 0")


@pytest.mark.parametrize("args, message", [
    (["demo", "--top-k", "9", "--experts", "8"], "--top-k 9 > --experts 8"),
    (["demo", "--ep", "8", "--experts", "4", "--top-k", "2"], "--experts 4 < ep_size 8"),
    (["demo", "--tokens", "0"], "tokens must be in 1.."),
    (["demo", "--ep", "two"], "ep_size must be an integer, got 'two'"),
    (["bench", "--iters", "0"], "iters must be >= 1, got 0"),
    (["bench-dist", "--warmup", "-1"], "warmup must be >= 0, got -1"),
    # Reported by the command's parser (its usage), not the top-level one.
    (["bench", "--preset", "mixtral", "deepseek-v3"], "python -m torch_moe_a2a bench: error: unrecognized arguments"),
    (["--bogus"], "python -m torch_moe_a2a: error: unrecognized arguments: --bogus"),
    (["bench", "--json", "/no/such/folder/bench.json"], "--json /no/such/folder/bench.json: folder /no/such/folder"),
    # A plot not named *.png: a matplotlib traceback after the sweep ('.txt'), or a '.png' added unsaid.
    (["bench", "--plot", "bench.txt"], "--plot bench.txt: the plot is a PNG; give a path ending in .png"),
    (["bench", "--plot", "bench"], "--plot bench: the plot is a PNG; give a path ending in .png"),
    # The modes that replace the sweep are one at a time and refuse the sweep's options.
    (["bench", "--expert-major", "--training"], "--expert-major and --training are modes of their own: pick one"),
    (["bench", "--training", "--combine-variants"], "--training and --combine-variants are modes of their own"),
    (["bench", "--expert-major", "--fp8"], "--expert-major takes no --fp8, --smoke, --plot or --graph"),
    (["bench", "--combine-variants", "--smoke"], "--combine-variants takes no --fp8, --smoke, --plot or --graph"),
    # Values that failed after parsing, in tracebacks: an int(inf), a seed beyond 64 bits, a row beyond the ops'.
    (["bench", "--max-gib", "inf"], "--max-gib must be a finite number > 0, got inf"),
    (["demo", "--seed", str(2**64)], "seed must be in -9223372036854775808..9223372036854775807"),
    (["demo", "--hidden", str(2**40)], "hidden must be in 1..134217728"),
    # Ignored before: these modes skip no point by memory, and the error table reads no sizes and writes no JSON.
    (["bench", "--expert-major", "--max-gib", "1"], "--expert-major takes no --max-gib"),
    (["bench", "--training", "--max-gib", "0.5"], "--training takes no --max-gib"),
    (["bench", "--graph", "all-ranks", "--max-gib", "2"], "--graph all-ranks takes no --max-gib"),
    (["bench", "--low-precision-error", "--ep", "2"], "--low-precision-error prints a fixed table: it takes no --ep"),
    (["bench", "--low-precision-error", "--json", "out.json", "--iters", "3"], "it takes no --iters, --json"),
    # Ignored before: --smoke ran its own points.
    (["bench", "--smoke", "--ep", "2"], "--smoke runs its own points: it takes no --ep, --tokens or --preset"),
    (["bench", "--smoke", "--preset", "mixtral"], "--smoke runs its own points"),
    # Ignored before: the modes of one preset measured the first, a "-" or "" path wrote a file "-" or nothing.
    (["bench", "--training", "--preset", "mixtral", "--preset", "qwen3-235b"],
     "--training measures one preset, got --preset mixtral qwen3-235b"),
    (["bench", "--expert-major", "--preset", "all"], "--expert-major measures one preset, got --preset all"),
    (["bench", "--graph", "all-ranks", "--preset", "mixtral", "--preset", "gpt-oss-120b"],
     "--graph all-ranks measures one preset"),
    (["bench", "--json", "-"], "--json '-': give a file path"),
    (["bench", "--plot", ""], "--plot '': give a file path"),
])
def test_bad_arguments_are_usage_errors(args, message, capsys):
    _assert_clean_usage_error(_main(capsys, *args), message)


@pytest.mark.parametrize("content", [None, "{}", "not json"], ids=["missing", "other_json", "not_json"])
def test_bench_dist_summary_of_a_file_that_is_not_its_json_fails_in_one_line(content, tmp_path, capsys):
    path = tmp_path / "summary.json"
    if content is not None:
        path.write_text(content)
    proc = _main(capsys, "bench-dist", "--summary", str(path))
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc
    assert err[0].startswith(f"bench-dist --summary: {path} is not a --json file of bench-dist"), err


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                 "tried to allocate 34359738368 bytes."),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB"),
], ids=["cpu", "cuda"])
def test_sizes_beyond_the_memory_fail_in_one_line(error, monkeypatch, capsys):
    """Sizes within the options' ranges can still exceed the machine's memory
    (demo --hidden 134217728: 16 GiB a payload): one line, no traceback; any
    other error still raises."""
    def run(parser, args):
        raise error

    monkeypatch.setitem(cli.COMMANDS, "demo", dataclasses.replace(cli.COMMANDS["demo"], run=run))
    proc = _main(capsys, "demo", "--device", "cpu")
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(err) == 1 and "demo: not enough memory for these sizes" in err[0], proc
    monkeypatch.setitem(cli.COMMANDS, "demo", dataclasses.replace(cli.COMMANDS["demo"], run=lambda p, a: 1 / 0))
    with pytest.raises(ZeroDivisionError):
        _main(capsys, "demo", "--device", "cpu")


def test_a_reader_that_went_away_ends_the_command_quietly():
    """`python -m torch_moe_a2a ... | head`: output into a pipe whose reader
    is gone ends the command with exit code 1 and no traceback (it printed
    BrokenPipeError's)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # before the command writes anything
    try:
        proc = subprocess.run([sys.executable, "-m", "torch_moe_a2a", "demo", "--device", "cpu", "--ep", "2",
                               "--tokens", "4"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
                              cwd=pathlib.Path(__file__).parents[1])
    finally:
        os.close(write_end)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc


@pytest.mark.parametrize("command", [("demo",), ("bench-dist", "--device", "cpu"), ("demo", "--init-method", "bogus")])
def test_a_rendezvous_that_cannot_start_is_one_line(command):
    """RANK and WORLD_SIZE set but no MASTER_ADDR (a launch without
    torchrun), or an init method torch does not know: one line that says
    what to do, exit code 1, where torch's traceback was printed."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(RANK="0", WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, "-m", "torch_moe_a2a", *command], capture_output=True, text=True,
                          timeout=120, env=env, cwd=pathlib.Path(__file__).parents[1])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc
    assert proc.stderr.count("\n") == 1 and "the process group did not start" in proc.stderr, proc.stderr
    assert "run under torchrun" in proc.stderr
