#!/usr/bin/env bash
# The one GPU script (run through `./dev gpu [stage ...]`, which has already
# built the extension): CUDA tests, compute-sanitizer on a small round trip,
# the smoke benchmark, the CMake library with its CUDA kernels (for C++
# users), and a short table printed last. Stages: tests, sanitizer, bench,
# cmake (default: all four), and, not by default: counters (Nsight
# Compute's DRAM and L2 counters of the fan-out program, about a minute),
# replay (`bench --graph all-ranks`, with `--peer flashinfer` where FlashInfer
# imports; a few minutes), ab (the same benchmark on a short grid, once per
# variant of $MOE_A2A_AB_VARIANTS, side by side: a same-run comparison of
# code paths that environment variables select, or of another source tree
# built in place; about a minute a variant) and profile (Nsight Compute's
# full report of the ep 1 x 128-token kernels, benchmarks/profile_point.py).
# Arguments after `--` go to pytest
# instead of the default selection (the CUDA tests). Full logs go to $OUT
# when it is set, else to build/gpu-logs.
set -uo pipefail
PY=${1:-python3}
shift || true
stages=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do stages+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#stages[@]} -eq 0 ] && stages=(tests sanitizer bench cmake)
# A misspelt stage would run nothing and report every row "not run" with exit 0.
for s in "${stages[@]}"; do
  case "$s" in
  tests | sanitizer | bench | cmake | counters | replay | ab | profile) ;;
  *)
    echo "gpu_check.sh: unknown stage '$s' (stages: tests sanitizer bench cmake counters replay ab profile)" >&2
    exit 2
    ;;
  esac
done
LOG=${OUT:-build/gpu-logs}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 MOE_A2A_TIMEOUT_S=${MOE_A2A_TIMEOUT_S:-20}
# Simulated ranks spin while the host launches their peers: no lazy module loads then.
export CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32

if ! "$PY" - <<'EOF' | tee "$LOG/env.txt"; then
import torch, torch_moe_a2a  # noqa: F401
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__} cuda {torch.version.cuda} | {p.name} sm_{p.major}{p.minor} {p.multi_processor_count} SMs")
print("cuda kernels registered:", torch._C._dispatch_has_kernel_for_dispatch_key("moe_a2a::dispatch", "CUDA"))
EOF
  echo "gpu_check.sh: the environment check above failed (no CUDA device, or the extension does not import)" >&2
  exit 1
fi

# benchmarks/NAME.cu for this device, into build/NAME.
build_program() {
  local arch nvcc
  arch=$("$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"{p.major}{p.minor}")')
  nvcc=$("$PY" -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or "/usr/local/cuda")')/bin/nvcc
  mkdir -p build
  "$nvcc" -O3 -std=c++17 -gencode=arch=compute_$arch,code=sm_$arch "benchmarks/$1.cu" -o "build/$1"
}
build_fanout() { build_program fanout_ceiling; }

status() { if [ "$1" -eq 0 ]; then echo PASS; elif [ "$1" -eq 255 ]; then echo "not run"; else echo "FAIL($1)"; fi; }
rc_tests=255 rc_mem=255 rc_race=255 rc_bench=255 rc_cmake=255 rc_counters=255 rc_replay=255 rc_profile=255 rc_ab=255
tests_line=""
has() { for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

if has tests; then
  # A hung test must not hold the GPU indefinitely: per-test limit where pytest-timeout exists.
  limit=()
  "$PY" -c 'import pytest_timeout' >/dev/null 2>&1 && limit=(--timeout 240)  # the plugin loads itself through its entry point
  # By default only the tests that touch CUDA (device-parametrized ones on
  # cuda, tests/test_cuda.py, the multi-process CUDA tests, the benchmark):
  # CI runs the CPU ones, and the device time is scarce (about 220 s instead
  # of 420 s on the H200). Arguments after `--` replace the selection.
  selection=("$@")
  [ ${#selection[@]} -eq 0 ] && selection=(-k "cuda or bench" --durations=15)
  "$PY" -m pytest -q -rfE -p no:cacheprovider "${limit[@]}" tests "${selection[@]}" 2>&1 | tee "$LOG/pytest.txt"
  rc_tests=${PIPESTATUS[0]}
  tests_line=$(grep -E '[0-9]+ (passed|failed)' "$LOG/pytest.txt" | tail -n 1)
fi

if has sanitizer; then
  # compute-sanitizer (memcheck, racecheck) on two simulated round trips: a
  # small one (dispatch chunks of at most 32 tokens) and one whose chunks are
  # longer, the large calls' path (dispatch.cu kWhole: counts and routes
  # published between CTAs, copy tasks claimed from counters).
  san() {
    { timeout 240 compute-sanitizer --tool "$1" --error-exitcode 99 \
        "$PY" -m torch_moe_a2a demo --device cuda --ep 2 --tokens 16 --hidden 256 &&
      timeout 240 compute-sanitizer --tool "$1" --error-exitcode 99 \
        "$PY" -m torch_moe_a2a demo --device cuda --ep 2 --tokens 1024 --hidden 64; } >"$LOG/sanitizer-$1.txt" 2>&1
  }
  if command -v compute-sanitizer >/dev/null 2>&1; then
    san memcheck; rc_mem=$?
    san racecheck; rc_race=$?
  else
    rc_mem=127 rc_race=127
  fi
fi

if has bench; then
  timeout 400 "$PY" -m torch_moe_a2a bench --smoke --json "$LOG/bench-smoke.json" >"$LOG/bench.txt" 2>"$LOG/bench-progress.txt"
  rc_bench=$?
  # The bare dispatch-shaped copy (docs/performance.md, 'The dispatch pattern's own
  # ceiling'), same device, same run.
  if build_fanout >"$LOG/fanout.txt" 2>&1; then
    timeout 120 build/fanout_ceiling >>"$LOG/fanout.txt" 2>&1 || rc_bench=1
  else
    rc_bench=1
  fi
  # The flag exchange's own latency (docs/performance.md, 'What limits the
  # decode latency'), same device, same run.
  if build_program latency_floor >"$LOG/latency-floor.txt" 2>&1; then
    timeout 120 build/latency_floor >>"$LOG/latency-floor.txt" 2>&1 || rc_bench=1
  else
    rc_bench=1
  fi
fi

if has counters; then
  # Hardware counters (Nsight Compute) of the fan-out program's one-grid
  # kernels: DRAM bytes read and written against the bytes each pattern
  # counts, and the share of the DRAM's peak they flow at (docs/performance.md,
  # 'Hardware counters'). Clocks left as they are (--clock-control none).
  if command -v ncu >/dev/null 2>&1 && build_fanout >"$LOG/counters.txt" 2>&1; then
    timeout 300 ncu --clock-control none --metrics "$("$PY" benchmarks/counters_summary.py --metrics)" \
      -k 'regex:copy_kernel|fill_kernel|fanout_registers' --csv --page raw --print-units base \
      build/fanout_ceiling >"$LOG/counters.csv" 2>>"$LOG/counters.txt" &&
      "$PY" benchmarks/counters_summary.py "$LOG/counters.csv" >>"$LOG/counters.txt" 2>&1
    rc_counters=$?
  else
    rc_counters=127
  fi
fi

if has replay; then
  peer=()
  "$PY" -c 'import flashinfer.comm.trtllm_moe_alltoall' >"$LOG/peer-import.txt" 2>&1 && peer=(--peer flashinfer)
  timeout 540 "$PY" -m torch_moe_a2a bench --graph all-ranks "${peer[@]}" --json "$LOG/replay.json" \
    >"$LOG/replay.txt" 2>&1
  rc_replay=$?
fi

if has ab; then
  # Variants separated by ';', each a list of NAME=VALUE assignments for that
  # run (MOE_A2A_AB_TREE=DIR: import the library from DIR, a tree built in
  # place, run from there; MOE_A2A_AB_PEER=flashinfer: that run times the peer
  # too); the grid from MOE_A2A_AB_EP and MOE_A2A_AB_TOKENS.
  # The table prints the time above the launch floor of each op and variant.
  IFS=';' read -r -a variants <<<"${MOE_A2A_AB_VARIANTS:-}"
  [ ${#variants[@]} -eq 0 ] && variants=("")
  rc_ab=0
  i=0
  for variant in "${variants[@]}"; do
    (
      # shellcheck disable=SC2086  # the variant is a list of assignments
      [ -n "$variant" ] && export $variant
      cd "${MOE_A2A_AB_TREE:-.}" &&
        timeout 300 "$PY" -m torch_moe_a2a bench --graph all-ranks --iters 20 --ep ${MOE_A2A_AB_EP:-1 4 8} \
          --tokens ${MOE_A2A_AB_TOKENS:-1 16 128} ${MOE_A2A_AB_PEER:+--peer "$MOE_A2A_AB_PEER"} \
          --json "$LOG/ab-$i.json" >"$LOG/ab-$i.txt" 2>&1
    ) || rc_ab=1
    echo "$variant" >"$LOG/ab-$i.variant"
    i=$((i + 1))
  done
  "$PY" benchmarks/ab_table.py "$LOG" >"$LOG/ab-table.txt" 2>&1 || rc_ab=1
fi

if has profile; then
  # Nsight Compute's sections (duration, throughput, occupancy, warp stalls
  # with their source lines: the build has -lineinfo) of the rounds' kernels
  # after the first (module loads and the checks' launches skipped).
  if command -v ncu >/dev/null 2>&1; then
    for tokens in 1 128; do
      timeout 240 ncu --clock-control none --set full --import-source yes -k 'regex:dispatch_kernel|combine_kernel' \
        --launch-skip 12 --launch-count 4 --print-details all \
        "$PY" benchmarks/profile_point.py --ep 1 --tokens "$tokens" --rounds 4 >"$LOG/profile-$tokens.txt" 2>&1 ||
        rc_profile=1
    done
    [ "$rc_profile" -eq 255 ] && rc_profile=0
  else
    rc_profile=127
  fi
fi

if has cmake; then
  # CMakeLists.txt's library with -DMOE_A2A_WITH_CUDA=ON, then its round trip
  # on cpu and cuda (tests/test_cmake_library.py, which must not skip here).
  cuda_home=$("$PY" -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or "/usr/local/cuda")')
  prefix=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
  # torch's CMake config takes the architectures from TORCH_CUDA_ARCH_LIST
  # (it ignores CMAKE_CUDA_ARCHITECTURES).
  arch_list=${TORCH_CUDA_ARCH_LIST:-$("$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"{p.major}.{p.minor}")')}
  # As setup.py: a compiler without a shared libstdc++ breaks beside torch's.
  cxx=${CXX:-c++}
  libstdcxx=$("$cxx" -print-file-name=libstdc++.so 2>/dev/null)
  [[ "$libstdcxx" == /* ]] || cxx=/usr/bin/g++
  if command -v cmake >/dev/null 2>&1; then
    { TORCH_CUDA_ARCH_LIST=$arch_list cmake -S . -B build/cmake-cuda -DMOE_A2A_WITH_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_CUDA_HOST_COMPILER="$cxx" \
        -DCMAKE_CUDA_COMPILER="$cuda_home/bin/nvcc" &&
      cmake --build build/cmake-cuda -j "$(nproc)" &&
      MOE_A2A_CMAKE_LIB=build/cmake-cuda/libtorch_moe_a2a_ops.so \
        "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cmake_library.py; } >"$LOG/cmake.txt" 2>&1
    rc_cmake=$?
  else
    echo "cmake not found" >"$LOG/cmake.txt"
    rc_cmake=127
  fi
fi

echo
echo "================ GPU check ================"
printf '%-28s %s\n' "tests" "$(status $rc_tests)  $tests_line"
printf '%-28s %s\n' "compute-sanitizer memcheck" "$(status $rc_mem)"
printf '%-28s %s\n' "compute-sanitizer racecheck" "$(status $rc_race)"
printf '%-28s %s\n' "smoke benchmark" "$(status $rc_bench)"
printf '%-28s %s\n' "CMake library (CUDA)" "$(status $rc_cmake)  $(grep -E '[0-9]+ (passed|failed)' "$LOG/cmake.txt" 2>/dev/null | tail -n 1)"
printf '%-28s %s\n' "hardware counters (ncu)" "$(status $rc_counters)"
printf '%-28s %s\n' "per-replay benchmark" "$(status $rc_replay)"
printf '%-28s %s\n' "profile (ncu)" "$(status $rc_profile)"
printf '%-28s %s\n' "A/B of variants" "$(status $rc_ab)"
if has bench; then
  echo "-------------------------------------------"
  # The smoke table, then its summary and targets (the benchmark prints them in that order).
  tail -n 40 "$LOG/bench.txt"
  # Redirected, the progress is one line per point: the last points it reached.
  tail -n 5 "$LOG/bench-progress.txt"
  echo "-------------------------------------------"
  cat "$LOG/fanout.txt"
  echo "-------------------------------------------"
  cat "$LOG/latency-floor.txt"
fi
if has counters; then
  echo "-------------------------------------------"
  tail -n 8 "$LOG/counters.txt"
fi
if has profile; then
  echo "-------------------------------------------"
  for f in "$LOG"/profile-*.txt; do
    echo "$f"
    grep -E '^\s+(Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per Thread|Grid Size|Block Size)\b' "$f" | sort | uniq -c | head -n 16
  done
fi
if has replay; then
  echo "-------------------------------------------"
  tail -n 130 "$LOG/replay.txt"
fi
if has ab; then
  echo "-------------------------------------------"
  cat "$LOG/ab-table.txt"
fi
for rc in $rc_tests $rc_mem $rc_race $rc_bench $rc_cmake $rc_counters $rc_replay $rc_profile $rc_ab; do
  [ "$rc" -eq 0 ] || [ "$rc" -eq 255 ] || exit 1
done
