#!/usr/bin/env bash
# Several GPUs, one process per GPU: build the extension, run the
# multi-process CUDA tests with one GPU per rank, then the distributed
# benchmark (torchrun ... -m torch_moe_a2a bench-dist) for ep 2, 4 and 8 as
# far as the GPUs go, and print a short table last. Logs go to $OUT when it
# is set, else to build/multi-gpu-logs.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
usage: scripts/multi_gpu.sh [options]

Default (a machine with 2 or more GPUs): one process per GPU.
  1. build the extension (python3 -m pip install --no-build-isolation --no-deps -e .)
  2. tests/test_multiprocess_cuda.py with MOE_A2A_TEST_ONE_GPU_PER_RANK=1
     (round trips vs the reference, rank mask, killed process, ... for 2, 4, 8 ranks)
  3. for each ep: torchrun --standalone --nproc-per-node EP -m torch_moe_a2a bench-dist
     (dispatch/combine vs all_to_all_single and NCCL's all-to-all on equal bytes)
  4. a short table: every stage's status, then bench-dist --summary of every launch

options:
  --dry-run          one GPU: EP processes share cuda:0 (CUDA_VISIBLE_DEVICES=0); the tests
                     run as on a one-GPU machine; bench-dist checks correctness, its
                     timings are NOT meaningful (the processes time-slice the GPU)
  --cpu              no GPU: CPU processes (gloo, a shared-memory workspace); the CPU
                     multi-process tests; a smoke test of this script and the CPU path
  --ep "N ..."       process counts (default: those of 2 4 8 the GPUs allow; --dry-run
                     2 4 8; --cpu 2)
  --tokens "T ..."   tokens per rank (default 128 4096; --cpu 1 16)
  --preset NAME      bench-dist preset (default deepseek-v3; --cpu mixtral)
  --iters N          timed iterations (default 100; --dry-run and --cpu 5)
  --warmup N         untimed iterations first (default 10; --dry-run and --cpu 1)
  --python PY        the Python with torch (default: .venv/bin/python where ./dev made
                     .venv, else python3)
  --no-build         skip step 1
  --no-tests         skip step 2
  --no-bench         skip step 3
  -h, --help         this text

Environment: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are always exported: NVLink multicast stays off (on
shared GPU hosts a program using it can take the GPUs out of service).
MOE_A2A_TIMEOUT_S (default 20) bounds every wait for a peer. Logs: $OUT, else
build/multi-gpu-logs.
EOF
}

die_usage() { echo "scripts/multi_gpu.sh: $1" >&2; usage >&2; exit 2; }
is_count() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
is_count_list() { local x; [ -n "$1" ] || return 1; for x in $1; do is_count "$x" || return 1; done; }
need_value() { [ $# -ge 2 ] || die_usage "$1 needs a value"; }

# The environment ./dev made, where there is one (./dev run puts it first on PATH too).
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
mode=gpus ep_list="" tokens="" preset="" iters="" warmup=""
do_build=1 do_tests=1 do_bench=1
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) [ "$mode" = cpu ] && die_usage "--dry-run and --cpu exclude each other"; mode=dry-run ;;
    --cpu) [ "$mode" = dry-run ] && die_usage "--dry-run and --cpu exclude each other"; mode=cpu ;;
    --ep) need_value "$@"; is_count_list "$2" || die_usage "--ep takes process counts, got '$2'"; ep_list=$2; shift ;;
    --tokens) need_value "$@"; is_count_list "$2" || die_usage "--tokens takes token counts, got '$2'"; tokens=$2; shift ;;
    --preset) need_value "$@"; preset=$2; shift ;;
    --iters) need_value "$@"; is_count "$2" || die_usage "--iters must be >= 1, got '$2'"; iters=$2; shift ;;
    --warmup) need_value "$@"; [[ "$2" =~ ^[0-9]+$ ]] || die_usage "--warmup must be >= 0, got '$2'"; warmup=$2; shift ;;
    --python) need_value "$@"; PY=$2; shift ;;
    --no-build) do_build=0 ;;
    --no-tests) do_tests=0 ;;
    --no-bench) do_bench=0 ;;
    -h|--help) usage; exit 0 ;;
    *) die_usage "unknown argument '$1'" ;;
  esac
  shift
done

# NVLink multicast off, also for every process started from here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 MOE_A2A_TIMEOUT_S=${MOE_A2A_TIMEOUT_S:-20}
# A stage that runs longer has hung.
TEST_LIMIT_S=300 BENCH_LIMIT_S=900
LOG=${OUT:-build/multi-gpu-logs}
mkdir -p "$LOG"

case "$mode" in
  gpus) default_iters=100 default_warmup=10 default_preset=deepseek-v3 default_tokens="128 4096" device=cuda ;;
  dry-run) export CUDA_VISIBLE_DEVICES=0
           default_iters=5 default_warmup=1 default_preset=deepseek-v3 default_tokens="128 4096" device=cuda ;;
  cpu) default_iters=5 default_warmup=1 default_preset=mixtral default_tokens="1 16" device=cpu ;;
esac
iters=${iters:-$default_iters} warmup=${warmup:-$default_warmup}
preset=${preset:-$default_preset} tokens=${tokens:-$default_tokens}

status() { if [ "$1" -eq 0 ]; then echo PASS; elif [ "$1" -eq 255 ]; then echo "not run"; else echo "FAIL($1)"; fi; }
rc_build=255 rc_tests=255 tests_line=""

# The GPUs are counted before the build (minutes), so that a machine without
# enough of them is told at once.
gpus=0
if [ "$mode" != cpu ]; then
  gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  if [ "$mode" = gpus ] && [ "$gpus" -lt 2 ]; then
    echo "scripts/multi_gpu.sh: $gpus GPU(s) visible; one process per GPU needs 2 or more (one GPU: --dry-run)" >&2
    exit 1
  fi
  [ "$gpus" -ge 1 ] || { echo "scripts/multi_gpu.sh: no GPU visible (no GPU: --cpu)" >&2; exit 1; }
fi
if [ -z "$ep_list" ]; then
  case "$mode" in
    gpus) ep_list=""; for n in 2 4 8; do [ "$n" -le "$gpus" ] && ep_list="$ep_list $n"; done ;;
    dry-run) ep_list="2 4 8" ;;
    cpu) ep_list="2" ;;
  esac
fi
if [ "$mode" = gpus ]; then
  for n in $ep_list; do
    [ "$n" -le "$gpus" ] || { echo "scripts/multi_gpu.sh: --ep $n > $gpus GPUs (one process per GPU)" >&2; exit 1; }
  done
fi

if [ "$do_build" -eq 1 ]; then
  "$PY" -m pip install -q --no-build-isolation --no-deps -e . >"$LOG/build.txt" 2>&1
  rc_build=$?
  [ "$rc_build" -eq 0 ] || { tail -n 30 "$LOG/build.txt"; echo "build failed (log: $LOG/build.txt)" >&2; exit 1; }
fi

"$PY" - "$mode" <<'EOF' | tee "$LOG/env.txt"
import sys, torch, torch_moe_a2a  # noqa: F401
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
names = ", ".join(torch.cuda.get_device_name(i) for i in range(n)) or "none"
print(f"mode {sys.argv[1]} | torch {torch.__version__} cuda {torch.version.cuda} | {n} GPU(s): {names}")
EOF
[ "$mode" != cpu ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi topo -m >"$LOG/nvidia-smi-topo.txt" 2>&1

if [ "$do_tests" -eq 1 ]; then
  limit=()
  "$PY" -c 'import pytest_timeout' >/dev/null 2>&1 && limit=(--timeout "$TEST_LIMIT_S")
  case "$mode" in
    gpus) tests=(tests/test_multiprocess_cuda.py); export MOE_A2A_TEST_ONE_GPU_PER_RANK=1 ;;
    dry-run) tests=(tests/test_multiprocess_cuda.py) ;;  # one visible GPU: the ranks share it
    cpu) tests=(tests/test_multiprocess.py tests/test_bench_dist.py) ;;
  esac
  "$PY" -m pytest -q -rfEs -p no:cacheprovider "${limit[@]}" "${tests[@]}" 2>&1 | tee "$LOG/pytest.txt"
  rc_tests=${PIPESTATUS[0]}
  tests_line=$(grep -E '[0-9]+ (passed|failed|skipped)' "$LOG/pytest.txt" | tail -n 1)
  unset MOE_A2A_TEST_ONE_GPU_PER_RANK
fi

bench_rows=() jsons=()
if [ "$do_bench" -eq 1 ]; then
  for n in $ep_list; do
    json="$LOG/bench-dist-ep$n.json"
    rm -f "$json"
    echo "bench-dist: $n processes ($mode), preset $preset, tokens $tokens, $iters iterations ..."
    # shellcheck disable=SC2086 # $tokens is a list of numbers
    # --foreground: the bench stays in the terminal's process group, so that
    # Ctrl-C reaches torchrun, which passes it on to the workers (they end the
    # sweep after the point in progress); torchrun ends its workers on timeout.
    timeout --foreground --kill-after=30 "$BENCH_LIMIT_S" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" \
      -m torch_moe_a2a bench-dist --device "$device" --preset "$preset" --tokens $tokens \
      --iters "$iters" --warmup "$warmup" --json "$json" >"$LOG/bench-dist-ep$n.txt" 2>"$LOG/bench-dist-ep$n.err"
    rc=$?
    bench_rows+=("$(printf '%-28s %s' "bench-dist ep $n" "$(status $rc)")")
    [ -f "$json" ] && jsons+=("$json")
    [ "$rc" -eq 0 ] || { echo "bench-dist ep $n failed ($rc); last lines of its stderr:"; tail -n 20 "$LOG/bench-dist-ep$n.err"; }
  done
fi

echo
echo "================ multi-GPU check ================"
case "$mode" in
  gpus) echo "one process per GPU ($gpus GPUs), ep: $ep_list" ;;
  dry-run) echo "DRY RUN: the processes share cuda:0, timings NOT meaningful (correctness only), ep: $ep_list" ;;
  cpu) echo "CPU processes (gloo, shared memory), ep: $ep_list" ;;
esac
printf '%-28s %s\n' "build" "$(status $rc_build)"
printf '%-28s %s\n' "multi-process tests" "$(status $rc_tests)  $tests_line"
for row in "${bench_rows[@]}"; do echo "$row"; done
if [ ${#jsons[@]} -gt 0 ]; then
  echo "-------------------------------------------------"
  "$PY" -m torch_moe_a2a bench-dist --summary "${jsons[@]}"
fi
echo "logs: $LOG"
[ "$rc_tests" -eq 0 ] || [ "$rc_tests" -eq 255 ] || exit 1
for row in "${bench_rows[@]}"; do [[ "$row" == *PASS ]] || exit 1; done
exit 0
