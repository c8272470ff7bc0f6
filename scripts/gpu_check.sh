#!/usr/bin/env bash
# The one GPU script (run through `./dev gpu`, which has already built the
# extension): CUDA tests, compute-sanitizer on a small round trip, the smoke
# benchmark, and a short table printed last. Full logs go to $OUT (the device
# tool's return folder) when it is set, else to build/gpu-logs.
set -uo pipefail
PY=${1:-python3}
shift || true
LOG=${OUT:-build/gpu-logs}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 MOE_A2A_TIMEOUT_S=${MOE_A2A_TIMEOUT_S:-20}
# Simulated ranks spin while the host launches their peers: no lazy module loads then.
export CUDA_MODULE_LOADING=EAGER

"$PY" - <<'EOF' | tee "$LOG/env.txt"
import torch, torch_moe_a2a  # noqa: F401
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__} cuda {torch.version.cuda} | {p.name} sm_{p.major}{p.minor} {p.multi_processor_count} SMs")
print("cuda kernels registered:", torch._C._dispatch_has_kernel_for_dispatch_key("moe_a2a::dispatch", "CUDA"))
EOF

status() { if [ "$1" -eq 0 ]; then echo PASS; else echo "FAIL($1)"; fi; }

# 1. Tests: the whole suite (CPU and CUDA parametrizations).
"$PY" -m pytest -q -p no:cacheprovider tests "$@" 2>&1 | tee "$LOG/pytest.txt"
rc_tests=${PIPESTATUS[0]}
tests_line=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|passed|failed' "$LOG/pytest.txt" | tail -n 1)

# 2. compute-sanitizer on a small simulated round trip (memcheck, racecheck).
san() {
  timeout 300 compute-sanitizer --tool "$1" --error-exitcode 99 \
    "$PY" -m torch_moe_a2a demo --device cuda --ep 2 --tokens 16 --hidden 256 >"$LOG/sanitizer-$1.txt" 2>&1
}
if command -v compute-sanitizer >/dev/null 2>&1; then
  san memcheck; rc_mem=$?
  san racecheck; rc_race=$?
else
  rc_mem=127; rc_race=127
fi

# 3. Smoke benchmark (its table is printed at the end).
"$PY" -m torch_moe_a2a bench --smoke --json "$LOG/bench-smoke.json" >"$LOG/bench.txt" 2>"$LOG/bench-progress.txt"
rc_bench=$?

echo
echo "================ GPU check ================"
printf '%-28s %s\n' "tests" "$(status $rc_tests)  $tests_line"
printf '%-28s %s\n' "compute-sanitizer memcheck" "$(status $rc_mem)"
printf '%-28s %s\n' "compute-sanitizer racecheck" "$(status $rc_race)"
printf '%-28s %s\n' "smoke benchmark" "$(status $rc_bench)"
echo "-------------------------------------------"
tail -n 30 "$LOG/bench.txt"
[ $rc_tests -eq 0 ] && [ $rc_mem -eq 0 ] && [ $rc_race -eq 0 ] && [ $rc_bench -eq 0 ]
