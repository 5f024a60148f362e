"""Loads the C++/CUDA extension: a prebuilt ``fusedopt_torch._C`` (``setup.py build_ext``) if
there is one, else a JIT build with ``torch.utils.cpp_extension.load`` into a build directory
(reused by later imports: ninja rebuilds only what changed).

Environment:
  FUSEDOPT_TORCH_BUILD_DIR  where the JIT build goes (default: integrations/pytorch/build/jit-<cpu|cuda>)
  FUSEDOPT_TORCH_CUDA       0: build the CPU path only even where CUDA is available; 1: require CUDA
  FUSEDOPT_TORCH_MARCH      -march of the CPU code (default native; see march())
  TORCH_CUDA_ARCH_LIST      CUDA architectures (torch's variable; default: the visible GPUs', e.g. 9.0)
  MAX_JOBS                  parallel compile jobs (torch's variable; default: all cores)
"""

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent  # integrations/pytorch
CSRC = ROOT / "csrc"
INCLUDE = ROOT.parent.parent / "include"  # fusedopt's headers

_module = None


def cuda_wanted():
    """Whether the extension is built with its CUDA sources."""
    import torch
    from torch.utils import cpp_extension

    flag = os.environ.get("FUSEDOPT_TORCH_CUDA")
    if flag == "0":
        return False
    available = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if flag == "1" and not available:
        raise RuntimeError("FUSEDOPT_TORCH_CUDA=1 but torch has no CUDA or the CUDA toolkit was not found")
    return available


def sources(with_cuda):
    """The extension's sources: binding and host plans (8-bit ones apart), plus, with CUDA, one .cu per
    family (Adam and AdamW: one per dtype, and their dispatch)."""
    files = [CSRC / "binding.cpp", CSRC / "host_plans.cpp", CSRC / "host_8bit_plans.cpp"]
    if with_cuda:
        files += sorted(CSRC.glob("cuda_*.cu"))
    return [str(f) for f in files]


def march():
    """The -march of the host (CPU) code: FUSEDOPT_TORCH_MARCH, default 'native' (the vector width
    of the machine that builds, right for the JIT build); set it to e.g. 'x86-64-v3' (AVX2) or
    'x86-64' (any x86-64) for an extension built to run on other machines; 'none' adds no -march."""
    return os.environ.get("FUSEDOPT_TORCH_MARCH", "native")


def flags(with_cuda):
    """(extra_cflags, extra_cuda_cflags) shared by setup.py and the JIT build.

    The host backend's loops need what fusedopt's CMake target gives its users: OpenMP threads
    (torch's own OpenMP runtime, libgomp, runs them; the thread count is torch.get_num_threads()),
    -fno-math-errno (else GCC does not vectorise sqrt) and the machine's vector width. And
    -ffp-contract=off: with -march=native GCC fuses a * b + c into an FMA where it sees fit, and
    two kernels of one rule (with and without GradScaler's blocks) then round differently; without
    contraction a step's bits do not depend on the kernel, as the library's tests assume."""
    cflags = ["-O3", "-std=c++17", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]
    if march() != "none":
        cflags.append(f"-march={march()}")
    cuda_cflags = ["-O3", "-std=c++17", "-Xcompiler=-fno-math-errno"]
    if with_cuda:
        cflags.append("-DFUSEDOPT_TORCH_WITH_CUDA")
    return cflags, cuda_cflags


def ldflags():
    """Link flags shared by setup.py and the JIT build (OpenMP's runtime)."""
    return ["-fopenmp"]


def build(verbose=False):
    """JIT-builds (or reuses the build of) the extension and returns the module."""
    from torch.utils import cpp_extension

    with_cuda = cuda_wanted()
    build_dir = os.environ.get("FUSEDOPT_TORCH_BUILD_DIR") or str(ROOT / "build" / ("jit-cuda" if with_cuda else "jit-cpu"))
    os.makedirs(build_dir, exist_ok=True)
    cflags, cuda_cflags = flags(with_cuda)
    return cpp_extension.load(
        name="fusedopt_torch_C",
        sources=sources(with_cuda),
        extra_include_paths=[str(INCLUDE), str(CSRC)],
        extra_cflags=cflags,
        extra_cuda_cflags=cuda_cflags,
        extra_ldflags=ldflags(),
        build_directory=build_dir,
        with_cuda=with_cuda,
        verbose=verbose,
    )


def load():
    """The extension module (built on first use)."""
    global _module
    if _module is None:
        try:
            from . import _C  # noqa: F401 - prebuilt by setup.py

            _module = _C
        except ImportError:
            _module = build(verbose=os.environ.get("FUSEDOPT_TORCH_VERBOSE") == "1")
    return _module
