#!/usr/bin/env bash
# flashinfer_peer.sh -- carry FlashInfer 0.7.2.post1's MoE all-to-all functions
# (flashinfer.comm.trtllm_moe_alltoall.moe_a2a_*) to a GPU machine that has no
# network and no package index, so the benchmark can time them beside ours.
#
#   bash scripts/flashinfer_peer.sh prepare   # on any x86-64 Linux box with pip,
#                                             # nvcc (CUDA 13) and a python that
#                                             # has torch (CPU build is enough)
#   bash scripts/flashinfer_peer.sh env       # on the GPU machine: prints the
#                                             # shell lines to eval there
#
# Typical use on the GPU machine (the repo root is the working directory):
#   eval "$(bash scripts/flashinfer_peer.sh env)" && python3 -c \
#     'import flashinfer.comm.trtllm_moe_alltoall as m; print(m.moe_a2a_dispatch)'
#
# `prepare` writes $FI_PEER_DIR (default: <repo>/.peer, git-ignored through
# .git/info/exclude) with:
#   site/flashinfer/...   the ~22 pure-Python files of the flashinfer 0.7.2.post1
#                         wheel that this import path loads, byte-for-byte as in
#                         the wheel. flashinfer/__init__.py, flashinfer/comm/__init__.py
#                         and flashinfer/jit/__init__.py are deliberately left
#                         out: they import the whole library (35 MB of Python plus
#                         nvidia-cutlass-dsl, cuda-tile, nccl4py, ...). Without
#                         them those three directories are PEP 420 namespace
#                         packages, so `import flashinfer.comm.trtllm_moe_alltoall`
#                         runs only the modules that one needs.
#   site/flashinfer/data/aot/mnnvl_moe_alltoall/mnnvl_moe_alltoall.so
#                         the JIT module gen_moe_alltoall_module("legacy") built
#                         ahead of time for sm_90a, with FlashInfer's own ninja
#                         generator and flags. FlashInfer's jit/env.py looks for
#                         <package>/data/aot/<name>/<name>.so first
#                         (FLASHINFER_AOT_DIR) and loads it without compiling.
#   site/tvm_ffi, site/apache_tvm_ffi-*.dist-info
#                         apache-tvm-ffi 0.1.15.post2, the cp312 wheel unpacked
#                         whole (the device's python is 3.12).
#   build/                provenance: the build.ninja FlashInfer generated, the
#                         wheel METADATA, the module's fatbin entries, sha256
#                         sums of what was carried.
#   README.txt            what is in it.
# Everything else this import path needs is already in the device image
# (torch, cuda-bindings, nvidia-ml-py, filelock, jinja2, packaging, numpy).
#
# Environment knobs for `prepare` (all optional):
#   FI_PEER_DIR     output folder (default <repo>/.peer)
#   FI_PEER_WHEELS  folder holding the two wheels (default <repo>/.whl); any
#                   wheel missing there is fetched with `pip download`
#   FI_PEER_PYTHON  build-side python with torch (default <repo>/.venv/bin/python,
#                   else python3)
#   CUDA_HOME       CUDA 13 toolkit (default: dirname of nvcc's bin, else /usr/local/cuda)
#   MAX_JOBS        ninja parallelism for the prebuild
#   FI_PEER_KEEP=1  keep the scratch folder (printed) instead of deleting it
#   FI_PEER_BUILD_DIR  use (and keep) this scratch folder; a rerun then only
#                   relinks/reuses what ninja built before
set -euo pipefail

FI_VERSION=0.7.2.post1
TVM_FFI_VERSION=0.1.15.post2
MODULE=mnnvl_moe_alltoall          # name FlashInfer gives gen_moe_alltoall_module("legacy")
ARCH_LIST=9.0                      # -> -gencode=arch=compute_90a,code=sm_90a (H200)

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEER=${FI_PEER_DIR:-$REPO/.peer}

# The flashinfer files `import flashinfer.comm.trtllm_moe_alltoall` and the
# moe_a2a_* calls load (found by tracing sys.modules; `prepare` re-checks it).
FI_FILES=(
  flashinfer/_build_meta.py
  flashinfer/version.py
  flashinfer/api_logging.py
  flashinfer/fi_trace.py
  flashinfer/compilation_context.py
  flashinfer/cuda_utils.py
  flashinfer/tllm_enums.py
  flashinfer/utils.py
  flashinfer/comm/abstractions.py
  flashinfer/comm/comm_backend.py
  flashinfer/comm/dlpack_utils.py
  flashinfer/comm/fd_exchange.py
  flashinfer/comm/mapping.py
  flashinfer/comm/mnnvl.py
  flashinfer/comm/trtllm_moe_alltoall.py
  flashinfer/jit/_cuda_architecture.py
  flashinfer/jit/comm.py
  flashinfer/jit/core.py
  flashinfer/jit/cpp_ext.py
  flashinfer/jit/env.py
  flashinfer/jit/spdlog.py
  flashinfer/jit/utils.py
)

die() { echo "flashinfer_peer: $*" >&2; exit 1; }

# put_if_changed FILE: write stdin to FILE unless FILE already holds exactly that.
put_if_changed() {
  local tmp
  tmp=$(mktemp)
  cat > "$tmp"
  if cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mv "$tmp" "$1"; fi
}

# ---------------------------------------------------------------------------
# env: print the lines that make the carried folder importable. They are
# printed, not run, so the caller evals them in its own shell.
# ---------------------------------------------------------------------------
cmd_env() {
  local so="$PEER/site/flashinfer/data/aot/$MODULE/$MODULE.so"
  if [[ ! -f "$so" || ! -d "$PEER/site/tvm_ffi" ]]; then
    # A line that fails, so `eval "$(... env)" && cmd` stops here.
    printf 'echo "flashinfer_peer: %s is missing or incomplete (run bash scripts/flashinfer_peer.sh prepare on a machine with pip, then copy .peer to this one)" >&2; false\n' "$PEER"
    return 0
  fi
  cat <<EOF
export PYTHONPATH="$PEER/site\${PYTHONPATH:+:\$PYTHONPATH}"
export FLASHINFER_CUDA_ARCH_LIST=$ARCH_LIST
export FLASHINFER_DISABLE_JIT=1
export FLASHINFER_NO_DOWNLOAD=1
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer_peer_ws
export TVM_FFI_CACHE_DIR=/tmp/flashinfer_peer_ws/tvm-ffi
export CUDA_HOME="\${CUDA_HOME:-/usr/local/cuda}"
EOF
  # What each line does:
  #  PYTHONPATH                 puts site/ (flashinfer subset + tvm_ffi) first.
  #  FLASHINFER_CUDA_ARCH_LIST  target set FlashInfer assumes (sm_90a); keeps it
  #                             from probing the GPU at import time.
  #  FLASHINFER_DISABLE_JIT     if the prebuilt .so ever failed to load, raise
  #                             MissingJITCacheError instead of compiling (no
  #                             sources are carried anyway).
  #  FLASHINFER_NO_DOWNLOAD     never fetch cubins (none are needed here).
  #  FLASHINFER_WORKSPACE_BASE  FlashInfer's cache/log dir (it creates
  #                             <base>/.cache/flashinfer/... at import).
  #  TVM_FFI_CACHE_DIR          tvm-ffi's cache dir (unused with torch >= 2.10).
  #  CUDA_HOME                  only read by FlashInfer's JIT paths.
}

# ---------------------------------------------------------------------------
# prepare: download, strip, prebuild, assemble.
# ---------------------------------------------------------------------------
cmd_prepare() {
  # --- tools --------------------------------------------------------------
  local py=${FI_PEER_PYTHON:-}
  if [[ -z "$py" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then py=$REPO/.venv/bin/python; else py=$(command -v python3); fi
  fi
  "$py" -c 'import torch' 2>/dev/null \
    || die "$py cannot import torch (FlashInfer's build code needs it; a CPU build will do). Set FI_PEER_PYTHON."
  # (`nvcc` on PATH may be a wrapper script outside the toolkit, so prefer
  # /usr/local/cuda and only then the resolved location of nvcc.)
  local nvcc cuda_home
  if [[ -n "${CUDA_HOME:-}" ]]; then cuda_home=$CUDA_HOME
  elif [[ -x /usr/local/cuda/bin/nvcc ]]; then cuda_home=/usr/local/cuda
  elif nvcc=$(command -v nvcc); then cuda_home=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
  else die "no nvcc found (set CUDA_HOME)"; fi
  [[ -x "$cuda_home/bin/nvcc" && -f "$cuda_home/include/cuda_runtime_api.h" ]] \
    || die "$cuda_home is not a CUDA toolkit (set CUDA_HOME)"
  "$cuda_home/bin/nvcc" --version | grep -q "release 13\." \
    || echo "flashinfer_peer: warning: nvcc is not CUDA 13; the device runs CUDA 13.0 (driver 580)" >&2
  command -v c++ >/dev/null || die "no c++ host compiler"

  # Scratch folder (global, so the EXIT trap still sees it). With
  # FI_PEER_BUILD_DIR set, that folder is used and kept, and a rerun lets
  # ninja reuse the objects it built before.
  if [[ -n "${FI_PEER_BUILD_DIR:-}" ]]; then
    work=$FI_PEER_BUILD_DIR
    mkdir -p "$work"
  else
    work=$(mktemp -d "${TMPDIR:-/tmp}/flashinfer_peer.XXXXXX")
    if [[ "${FI_PEER_KEEP:-0}" == 1 ]]; then
      echo "flashinfer_peer: scratch folder kept: $work"
    else
      trap 'rm -rf "$work"' EXIT
    fi
  fi
  echo "flashinfer_peer: scratch $work, python $py, CUDA $cuda_home"

  # --- 1. wheels ------------------------------------------------------------
  local whl_dir=${FI_PEER_WHEELS:-$REPO/.whl}
  local fi_whl tvm_whl
  fi_whl=$(ls "$whl_dir"/flashinfer_python-"$FI_VERSION"-py3-none-any.whl 2>/dev/null | head -1 || true)
  if [[ -z "$fi_whl" ]]; then
    "$py" -m pip download -q --no-deps --only-binary=:all: "flashinfer-python==$FI_VERSION" -d "$work/whl"
    fi_whl=$(ls "$work"/whl/flashinfer_python-"$FI_VERSION"-*.whl | head -1)
  fi
  tvm_whl=$(ls "$whl_dir"/apache_tvm_ffi-"$TVM_FFI_VERSION"-cp312-cp312-*x86_64*.whl 2>/dev/null | head -1 || true)
  if [[ -z "$tvm_whl" ]]; then
    # The device's interpreter: CPython 3.12 on x86-64 glibc.
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
      "apache-tvm-ffi==$TVM_FFI_VERSION" -d "$work/whl"
    tvm_whl=$(ls "$work"/whl/apache_tvm_ffi-"$TVM_FFI_VERSION"-cp312-*.whl | head -1)
  fi
  echo "flashinfer_peer: wheels $fi_whl, $tvm_whl"

  # Build-side python packages FlashInfer's build code imports (tvm_ffi for
  # the build python's own version, plus whatever of filelock/jinja2/packaging
  # it lacks), and for the checks at the end (nvidia-ml-py, cuda-bindings).
  local buildpy=$work/buildpy
  local need=("apache-tvm-ffi==$TVM_FFI_VERSION")
  "$py" -c 'import filelock' 2>/dev/null || need+=(filelock)
  "$py" -c 'import jinja2' 2>/dev/null || need+=(jinja2)
  "$py" -c 'import packaging' 2>/dev/null || need+=(packaging)
  "$py" -c 'import pynvml' 2>/dev/null || need+=(nvidia-ml-py)
  "$py" -c 'from cuda.bindings import driver' 2>/dev/null || need+=("cuda-bindings>=13,<14")
  local path_extra
  path_extra=$(dirname "$py")
  PATH="$path_extra:$PATH" command -v ninja >/dev/null || need+=(ninja)
  if [[ ! -f "$buildpy/.complete" ]]; then   # a reused build folder skips this
    rm -rf "$buildpy"
    "$py" -m pip install -q --target "$buildpy" "${need[@]}"
    touch "$buildpy/.complete"
  fi
  [[ -d "$buildpy/bin" ]] && path_extra=$buildpy/bin:$path_extra

  # --- 2. unpack flashinfer (scratch copy, used only to build) --------------
  # The scratch copy drops the three __init__.py files (see the header) so
  # FlashInfer's jit code can be imported without the whole library.
  unzip -q -o "$fi_whl" 'flashinfer/*' -d "$work/fi"
  rm -f "$work/fi/flashinfer/__init__.py" "$work/fi/flashinfer/comm/__init__.py" "$work/fi/flashinfer/jit/__init__.py"

  # --- 3. build-time stubs (never carried) ----------------------------------
  # tensorrt_llm/common/cudaUtils.h includes cublasLt.h/cublas_v2.h only to
  # name cublasStatus_t values in an error-string helper; this module makes no
  # cuBLAS calls. The toolkit here may lack cuBLAS headers, so provide the enum.
  mkdir -p "$work/stubinc" "$work/stublib"
  # (Written through put_if_changed so a reused build folder keeps their
  # mtimes and ninja does not recompile.)
  put_if_changed "$work/stubinc/cublas_v2.h" <<'EOF'
/* Build-time stand-in for cuBLAS's cublas_v2.h: the headers the real one
 * pulls in (cudaUtils.h relies on them, e.g. for <math.h>) and the status
 * enum that tensorrt_llm/common/cudaUtils.h names (values as in cuBLAS). */
#pragma once
#include <driver_types.h>
#include <cuComplex.h>
#include <cuda_fp16.h>
#include <library_types.h>
typedef enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
  CUBLAS_STATUS_LICENSE_ERROR = 16
} cublasStatus_t;
EOF
  printf '/* Build-time stand-in for cublasLt.h. */\n#pragma once\n#include "cublas_v2.h"\n' \
    | put_if_changed "$work/stubinc/cublasLt.h"
  # FlashInfer links with -lcuda. A build box without a GPU driver has no
  # libcuda.so, so link against an empty one named like the driver's
  # (soname libcuda.so.1); the real driver library satisfies it on the GPU.
  # The module's objects reference no cu* driver symbols directly.
  echo 'void flashinfer_peer_libcuda_stub(void) {}' > "$work/stublib/stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$work/stublib/libcuda.so" "$work/stublib/stub.c"
  ln -sf libcuda.so "$work/stublib/libcuda.so.1"

  # --- 4. prebuild with FlashInfer's own generator --------------------------
  # gen_moe_alltoall_module("legacy").build() writes build.ninja with the
  # flags FlashInfer's JIT uses on an sm_90 device (FLASHINFER_CUDA_ARCH_LIST
  # 9.0 -> compute_90a/sm_90a) and runs ninja. The only additions are the
  # -isystem for the cuBLAS stub headers and -L for the libcuda stub.
  local ws=$work/ws
  (
    export PATH="$path_extra:$PATH"
    export PYTHONPATH="$work/fi:$buildpy"
    export PYTHONDONTWRITEBYTECODE=1
    export CUDA_HOME=$cuda_home
    export FLASHINFER_CUDA_ARCH_LIST=$ARCH_LIST
    export FLASHINFER_WORKSPACE_BASE=$ws
    export FLASHINFER_EXTRA_CFLAGS="-isystem $work/stubinc"
    export FLASHINFER_EXTRA_CUDAFLAGS="-isystem $work/stubinc"
    export FLASHINFER_EXTRA_LDFLAGS="-L$work/stublib"
    "$py" - <<'EOF'
import time
from flashinfer.jit.comm import gen_moe_alltoall_module
spec = gen_moe_alltoall_module("legacy")
t = time.time()
spec.build(verbose=True)
print(f"flashinfer_peer: built {spec.jit_library_path} in {time.time() - t:.0f} s", flush=True)
EOF
  )
  local built
  built=$(ls "$ws"/.cache/flashinfer/"$FI_VERSION"/*/cached_ops/"$MODULE/$MODULE.so")
  # The module must not depend on the build python (it talks to Python only
  # through libtvm_ffi); check it names no libpython and no Py* symbols.
  if readelf -d "$built" | grep -q 'libpython'; then die "$built links libpython"; fi
  if nm -D --undefined-only "$built" | grep -q ' U Py'; then die "$built needs Python C-API symbols"; fi

  # --- 5. assemble the carried folder ---------------------------------------
  local new=$PEER.new
  rm -rf "$new"
  mkdir -p "$new/site" "$new/build"
  (cd "$work" && unzip -q "$fi_whl" "${FI_FILES[@]}" -d "$new/site")
  mkdir -p "$new/site/flashinfer/data/aot/$MODULE"
  cp "$built" "$new/site/flashinfer/data/aot/$MODULE/$MODULE.so"
  unzip -q "$tvm_whl" -d "$new/site"
  cp "$(dirname "$built")/build.ninja" "$new/build/build.ninja"
  unzip -q -p "$fi_whl" "flashinfer_python-$FI_VERSION.dist-info/METADATA" > "$new/build/flashinfer_python-METADATA"
  "$cuda_home/bin/nvcc" --version > "$new/build/nvcc-version.txt"
  # List the device code in the module's fatbin (kind and SM of each entry;
  # expected: ELF for SM 90 only, no PTX), read from the fatbin headers.
  "$py" - "$built" > "$new/build/fatbin-entries.txt" <<'EOF'
import struct, subprocess, sys
so = sys.argv[1]
sec = [l.split() for l in subprocess.run(["objdump", "-h", so], capture_output=True, text=True).stdout.splitlines()]
sec = next(l for l in sec if len(l) > 5 and l[1] == ".nv_fatbin")
size, off = int(sec[2], 16), int(sec[5], 16)
fb = open(so, "rb").read()[off:off + size]
p = 0
while p + 16 <= len(fb):
    magic, _, hsz, bsz = struct.unpack_from("<IHHQ", fb, p)
    if magic != 0xBA55ED50:
        break
    q, end = p + hsz, p + hsz + bsz
    while q < end:
        kind, _, ehs, psz = struct.unpack_from("<HHIQ", fb, q)
        arch = struct.unpack_from("<I", fb, q + 28)[0]
        print(f"{ {1: 'PTX', 2: 'ELF'}.get(kind, kind)} sm_{arch} ({psz} bytes, compressed)")
        q += ehs + psz
    p = end
EOF
  grep -q "ELF sm_90" "$new/build/fatbin-entries.txt" || die "no sm_90 code in $built"
  # Every carried flashinfer file must be byte-identical to the wheel's
  # (RECORD lists sha256 of each file in urlsafe base64).
  "$py" - "$fi_whl" "$new/site" "${FI_FILES[@]}" <<'EOF'
import base64, csv, hashlib, io, sys, zipfile
whl, site, files = sys.argv[1], sys.argv[2], sys.argv[3:]
z = zipfile.ZipFile(whl)
rec = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
digests = {row[0]: row[1] for row in csv.reader(io.TextIOWrapper(z.open(rec))) if row and row[1]}
for f in files:
    got = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(open(f"{site}/{f}", "rb").read()).digest()).rstrip(b"=").decode()
    if digests.get(f) != got:
        sys.exit(f"flashinfer_peer: {f} does not match the wheel's RECORD")
print(f"flashinfer_peer: {len(files)} flashinfer files match the wheel's RECORD")
EOF

  # --- 6. check the import path here (CPU only) -----------------------------
  # Import through the carried tree with the build python's tvm_ffi first on
  # the path (the carried one is for 3.12), then let FlashInfer resolve and
  # load the prebuilt module and call its host-only entry points. Loading it
  # needs libcudart.so.13 (from CUDA_HOME) and a libcuda.so.1 (the stub).
  (
    export PYTHONPATH="$buildpy:$new/site"
    export PYTHONDONTWRITEBYTECODE=1
    export LD_LIBRARY_PATH="$cuda_home/lib64:$work/stublib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export FLASHINFER_CUDA_ARCH_LIST=$ARCH_LIST
    export FLASHINFER_DISABLE_JIT=1
    export FLASHINFER_NO_DOWNLOAD=1
    export FLASHINFER_WORKSPACE_BASE=$work/ws_check
    "$py" - "$new/site" <<'EOF'
import os, sys
site = os.path.realpath(sys.argv[1])
import flashinfer.comm.trtllm_moe_alltoall as m
from flashinfer.jit.comm import gen_moe_alltoall_module
spec = gen_moe_alltoall_module("legacy")
assert spec.is_aot, "FlashInfer does not see the prebuilt module"
lib = os.path.realpath(spec.get_library_path())
assert lib.startswith(site), lib
size = m.moe_a2a_get_workspace_size_per_rank(2, 16, 7168 * 2 + 8 * 4 + 8 * 4, 7168 * 2)
names, values = m.get_moe_alltoall_module().moe_a2a_get_metainfo_index_pairs()
outside = sorted(k for k, v in sys.modules.items()
                 if k.startswith("flashinfer") and getattr(v, "__file__", None)
                 and not os.path.realpath(v.__file__).startswith(site))
assert not outside, outside
print("flashinfer_peer: import + AOT load OK on this host:", lib)
print("flashinfer_peer: workspace size per rank (ep 2, T 16, DeepSeek-V3 payloads):", size)
print("flashinfer_peer: metainfo fields:", dict(zip(names, values)))
EOF
  )

  # --- 7. README, checksums, swap into place --------------------------------
  (cd "$new" && find site -type f ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum > build/SHA256SUMS)
  cat > "$new/README.txt" <<EOF
FlashInfer $FI_VERSION MoE all-to-all, carried for an offline sm_90 (H200) machine
==============================================================================
Made by: bash scripts/flashinfer_peer.sh prepare   ($(date -u +%Y-%m-%dT%H:%MZ), host $(uname -m))
Use:     eval "\$(bash scripts/flashinfer_peer.sh env)" && python3 -c \\
           'import flashinfer.comm.trtllm_moe_alltoall as m; print(m.moe_a2a_dispatch)'

site/            the PYTHONPATH entry
  flashinfer/    ${#FI_FILES[@]} .py files from flashinfer_python-$FI_VERSION-py3-none-any.whl,
                 unmodified (checked against the wheel's RECORD): exactly the
                 modules that flashinfer.comm.trtllm_moe_alltoall and its
                 moe_a2a_* calls load. Everything else of the wheel is left out,
                 INCLUDING flashinfer/__init__.py, flashinfer/comm/__init__.py and
                 flashinfer/jit/__init__.py (they import the whole library and
                 its optional dependencies). So flashinfer, flashinfer.comm and
                 flashinfer.jit are namespace packages here: import submodules
                 by full name (flashinfer.comm.trtllm_moe_alltoall); the
                 top-level names of flashinfer/__init__.py do not exist.
  flashinfer/data/aot/$MODULE/$MODULE.so
                 FlashInfer's JIT module gen_moe_alltoall_module("legacy")
                 (csrc/trtllm_moe_alltoall.cu + nv_internal moeAlltoAllKernels.cu
                 + 4 nv_internal common .cpp), prebuilt with FlashInfer's own
                 generator for -gencode=arch=compute_90a,code=sm_90a with
                 $("$cuda_home/bin/nvcc" --version | grep release | sed 's/^ *//').
                 FlashInfer's jit/env.py resolves <package>/data/aot/<name>/<name>.so
                 first (FLASHINFER_AOT_DIR) and loads it with tvm_ffi.load_module;
                 nothing is compiled. Device code: $(tr '\n' ';' < "$new/build/fatbin-entries.txt")
                 NEEDED: $(readelf -d "$built" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')
                 (libcudart.so.13 is the one torch cu130 has already loaded;
                 the TVMFFI* symbols come from the libtvm_ffi.so that tvm_ffi
                 loads). Python-version independent: no libpython, no Py*
                 symbols. Built with a two-header cuBLAS enum stub (no cuBLAS
                 is used) and linked against an empty libcuda stub; neither is
                 carried.
  tvm_ffi/, apache_tvm_ffi-$TVM_FFI_VERSION.dist-info/
                 $(basename "$tvm_whl") unpacked whole, unmodified.
build/           provenance only (not imported): build.ninja as FlashInfer
                 generated it (paths are the build host's), the wheel's METADATA
                 (license Apache-2.0), nvcc version, fatbin entries of the
                 module, SHA256SUMS of site/.
No stubs of Python modules are used. Needed from the device image: torch
(>= 2.10, for the DLPack C exchange API), cuda-bindings (cuda.bindings.driver),
nvidia-ml-py (pynvml), filelock, jinja2, packaging, numpy.
EOF
  rm -rf "$PEER"
  mv "$new" "$PEER"
  # Ignored by git (a checkout's own exclude file, not the project's
  # .gitignore): untracked, not ignored, it would travel with every device
  # call whether carried or not, and show in `git status`.
  local exclude
  if [[ "$PEER" == "$REPO/.peer" ]] && exclude=$(git -C "$REPO" rev-parse --git-path info/exclude 2>/dev/null); then
    [[ "$exclude" = /* ]] || exclude=$REPO/$exclude
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '.peer/' "$exclude" 2>/dev/null || echo '.peer/' >>"$exclude"
  fi
  du -sh "$PEER"
  echo "flashinfer_peer: done -> $PEER"
}

case "${1:-}" in
  env) cmd_env ;;
  prepare) cmd_prepare ;;
  *) echo "usage: bash scripts/flashinfer_peer.sh prepare|env" >&2; exit 2 ;;
esac
