"""Builds torch_moe_a2a._C: the torch.ops.moe_a2a operator library.

CPU and Meta kernels always; the CUDA kernels too when torch was built with
CUDA and nvcc is available (CUDA_HOME). The extension is compiled against the
torch of the environment it is installed into (build_backend/moe_a2a_build.py
makes that torch importable under build isolation); torch_moe_a2a/_build_info.py,
written next to it, records which torch that was.
"""

import glob
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def has_shared_libstdcxx(compiler: str) -> bool:
    out = subprocess.run([compiler, "-print-file-name=libstdc++.so"], capture_output=True, text=True)
    return out.returncode == 0 and os.path.isabs(out.stdout.strip())


def use_compiler_with_shared_libstdcxx() -> None:
    """A toolchain without a shared libstdc++ (the GPU image's CXX=/opt/gcc/bin/g++)
    links a private static copy into the extension; beside the shared one that
    torch uses, it breaks the iostream locale facets (seen: a segfault formatting
    an int into an error message). Fall back to the system g++ then."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None or has_shared_libstdcxx(compiler):
        return
    system = shutil.which("g++", path="/usr/bin")
    if system is not None and has_shared_libstdcxx(system):
        print(f"setup.py: {compiler} has no shared libstdc++; building with {system}")
        os.environ["CXX"] = system


use_compiler_with_shared_libstdcxx()


def put_environment_scripts_on_path() -> None:
    """torch compiles with ninja only when ninja is on PATH; otherwise it falls
    back to a backend that recompiles every object on every build. pip runs
    setup.py with the target environment's interpreter but leaves PATH alone,
    so the ninja of an environment that is not activated (./dev's .venv) is
    missed unless another ninja happens to be on PATH."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts) is not None:
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


put_environment_scripts_on_path()


def sources(pattern: str) -> list[str]:
    # Relative paths: setuptools rejects absolute source paths in editable builds.
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def cuda_arch_list() -> str:
    return os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0")


def gencode_flags() -> list[str]:
    """nvcc -gencode flags for TORCH_CUDA_ARCH_LIST ("9.0", "8.0;9.0+PTX", ...)."""
    flags = []
    for arch in cuda_arch_list().replace(",", ";").replace(" ", ";").split(";"):
        if not arch:
            continue
        ptx = arch.endswith("+PTX")
        number = arch.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode=arch=compute_{number},code=sm_{number}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{number},code=compute_{number}")
    return flags


# No -std flag: torch's BuildExtension adds the standard its headers need
# (C++20 for torch 2.13, whose headers warn under C++17).
# at::parallel_for runs the copies on OpenMP threads: compile and link with it
# (MOE_A2A_OPENMP=0 builds without, for diagnosing runtime conflicts).
openmp = ["-fopenmp"] if os.environ.get("MOE_A2A_OPENMP", "1") != "0" else []
# -g0 overrides the -g of Python's CFLAGS (they come first on the command line):
# release builds carry no debug information, which is most of a -g build's size.
# -ffp-contract=off: the expert-major combine rounds each weight * row product
# to fp32 before it adds it, as the reference and the CUDA kernel do; a fused
# multiply-add (GCC contracts by default where the target has one) would
# change the bits.
cxx_flags = ["-O3", "-g0", "-ffp-contract=off", *openmp]
link_flags = list(openmp)
ext_sources = sources("csrc/*.cpp") + sources("csrc/cpu/*.cpp") + sources("meta_kernels/*.cpp")
include_dirs = [os.path.join(ROOT, "csrc")]

with_cuda = torch.version.cuda is not None and CUDA_HOME is not None
if with_cuda:
    extension = CUDAExtension(
        name="torch_moe_a2a._C",
        sources=ext_sources + sources("csrc/cuda/*.cu") + sources("csrc/cuda/*.cpp"),
        include_dirs=include_dirs,
        define_macros=[("MOE_A2A_WITH_CUDA", None)],
        extra_compile_args={
            "cxx": cxx_flags,
            # -lineinfo: profilers map samples to source lines; the machine code is the same.
            "nvcc": ["-O3", "-Xcompiler", "-g0", "-lineinfo", "--expt-relaxed-constexpr", *gencode_flags()],
        },
        extra_link_args=link_flags,
    )
else:
    extension = CppExtension(
        name="torch_moe_a2a._C",
        sources=ext_sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )


def build_tag() -> str:
    """Names this environment's object folder: objects compiled for one
    interpreter, torch and CUDA must not be reused, or overwritten, by a build
    in another environment sharing the source tree."""
    key = "\n".join([sys.prefix, platform.python_version(), torch.__version__, str(torch.version.cuda)])
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class IncrementalBuildExtension(BuildExtension):
    """pip's editable builds compile in a fresh temporary folder; a fixed one
    per environment (build/temp-<tag>, git-ignored) lets ninja skip objects
    that are up to date."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(ROOT, "build", f"temp-{build_tag()}")

    def run(self):
        super().run()
        # Next to the built extension: in the source tree for in-place
        # (editable) builds, in the build folder that becomes the wheel otherwise.
        package_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(extension.name)))
        self.write_build_info(os.path.join(package_dir, "_build_info.py"))

    def write_build_info(self, path: str) -> None:
        fields = {
            "version": self.distribution.get_version(),
            "torch_version": str(torch.__version__),
            "torch_cuda_version": torch.version.cuda,
            "with_cuda": with_cuda,
            "cuda_arch_list": cuda_arch_list() if with_cuda else None,
        }
        with open(path, "w") as f:
            f.write("# Written by setup.py's build_ext: the build this extension comes from.\n")
            f.writelines(f"{name} = {value!r}\n" for name, value in fields.items())


# Name, version and dependencies live in pyproject.toml.
setup(
    packages=["torch_moe_a2a", "torch_moe_a2a.bench"],
    ext_modules=[extension],
    cmdclass={"build_ext": IncrementalBuildExtension},
)
