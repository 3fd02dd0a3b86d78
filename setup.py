"""Build torch_zipkv's C++/CUDA extension (torch_zipkv._C).

CUDA sources are compiled whenever a CUDA build of torch and nvcc are present, GPU or not, so a GPU-less CI still
proves they compile and register. ZIPKV_WITH_CUDA=1 turns a missing toolkit into an error, =0 builds CPU only.
Install with `pip install --no-build-isolation .` (or `-e .`) so the build uses the torch you run with: the extension
links against that torch's C++ ABI, and a binary built against another release fails to load (docs/install.md).
"""

import glob
import os
import re
import shutil
import subprocess

from setuptools import setup

# Defaults that must be in place before torch.utils.cpp_extension is imported: torch guesses CUDA_HOME from
# `which nvcc` (here /usr/local/bin, which has no libcudart), and with no GPU visible and no arch list its extension
# builder crashes while guessing archs. Our kernels target Hopper (sm_90a).


def cuda_home_of_nvcc_on_path():
    """The toolkit root of the `nvcc` on PATH. nvcc may be a wrapper script, so ask it (-dryrun prints TOP=)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        dry = subprocess.run([nvcc, "-dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=120)
        top = re.search(r"^#\$ TOP=(.*)$", dry.stdout + dry.stderr, re.M)
    except (OSError, subprocess.SubprocessError):
        top = None
    return os.path.realpath(top.group(1).strip() if top else os.path.join(os.path.dirname(nvcc), ".."))


if "CUDA_HOME" not in os.environ and os.environ.get("ZIPKV_WITH_CUDA") != "0":
    home = cuda_home_of_nvcc_on_path()
    if home:
        os.environ["CUDA_HOME"] = home
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")

try:
    import torch  # noqa: E402
except ImportError:
    # pip builds in an isolated environment unless told not to, and torch is not a build requirement (pyproject.toml):
    # the extension must be compiled against the torch it will run with, not one pip would download for the build.
    raise SystemExit(
        "torch_zipkv compiles its ops against the installed torch, and this build cannot import torch: pip is "
        "building in an isolated environment. Install torch first, then build with "
        "`pip install --no-build-isolation .` (or `pip wheel --no-build-isolation .`); see docs/install.md."
    ) from None
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

# The torch the extension is compiled against, for torch_zipkv/__init__.py to check before it loads the binary: a
# binary of another torch release fails with an undefined symbol at best. A generated file (not in git).
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_zipkv", "_build_info.py"), "w") as f:
    f.write(f'"""Written by setup.py: the torch the compiled ops were built against."""\n\nTORCH_VERSION = '
            f'{torch.__version__!r}\n')

with_cuda_env = os.environ.get("ZIPKV_WITH_CUDA")
cuda_available = torch.version.cuda is not None and CUDA_HOME is not None
if with_cuda_env == "1" and not cuda_available:
    raise RuntimeError(
        f"ZIPKV_WITH_CUDA=1 but CUDA cannot be built: torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME}. "
        "Install a CUDA build of torch (e.g. torch==2.14.1) and the CUDA toolkit (nvcc)."
    )
with_cuda = cuda_available if with_cuda_env is None else with_cuda_env == "1"
debug = os.environ.get("DEBUG", "0") == "1"

sources = ["csrc/ops.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]
cxx_flags = ["-O0" if debug else "-O3", "-fopenmp", "-std=c++20"]  # the .cu files' standard too
extra_compile_args = {"cxx": cxx_flags}
if with_cuda:
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    extra_compile_args["nvcc"] = ["-O3", "--expt-relaxed-constexpr", "-std=c++20"] + (
        ["-lineinfo", "-g"] if debug else ["-lineinfo"]
    )
Extension = CUDAExtension if with_cuda else CppExtension


def shared_cxx_runtime():
    """Link arguments that bind the extension to the libstdc++.so this process (and so torch) runs with.

    A g++ built with --with-static-standard-libraries (the GPU box's /opt/gcc) links libstdc++.a into every shared
    object by default. The extension then carries a second, private C++ runtime whose locale was never set up, and
    the first error message that formats an integer (c10::str -> std::ostream << long) segfaults. Naming the loaded
    shared libstdc++ explicitly, before the driver's implicit static one, resolves every std:: symbol from it.
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libstdc++.so" in line}
    except OSError:  # not Linux
        return []
    return sorted(paths)[:1]

setup(
    name="torch_zipkv",
    ext_modules=[
        Extension(
            "torch_zipkv._C",
            sources,
            extra_compile_args=extra_compile_args,
            extra_link_args=["-fopenmp", *shared_cxx_runtime()],
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
