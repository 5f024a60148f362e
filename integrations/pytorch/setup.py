"""Builds fusedopt_torch._C ahead of time:

    cd integrations/pytorch && python3 setup.py build_ext --inplace     # or: pip install .

CUDA kernels are built where torch has CUDA and the toolkit is found (FUSEDOPT_TORCH_CUDA=0: CPU
only). FUSEDOPT_TORCH_CUDA_OBJECTS=DIR links the .o files of the csrc/cuda_*.cu sources compiled
beforehand (run-gpu does that with nvcc in parallel where ninja is missing) instead of compiling
them here. Without this step `import fusedopt_torch` JIT-builds the same extension
(fusedopt_torch/_ext.py).
"""

import glob
import os
import sys

from setuptools import setup
from torch.utils import cpp_extension

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fusedopt_torch import _ext  # noqa: E402  (only paths and flags; builds nothing)

with_cuda = _ext.cuda_wanted()
objects_dir = os.environ.get("FUSEDOPT_TORCH_CUDA_OBJECTS")
cflags, cuda_cflags = _ext.flags(with_cuda)
sources = _ext.sources(with_cuda)
extra_objects = []
if with_cuda and objects_dir:
    sources = [s for s in sources if not s.endswith(".cu")]
    extra_objects = sorted(glob.glob(os.path.join(objects_dir, "*.o")))
Extension = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
ext = Extension(
    name="fusedopt_torch._C",
    sources=[os.path.relpath(s, os.path.dirname(os.path.abspath(__file__))) for s in sources],
    include_dirs=[str(_ext.INCLUDE), str(_ext.CSRC)],
    extra_compile_args={"cxx": cflags, "nvcc": cuda_cflags} if with_cuda else cflags,
    extra_objects=extra_objects,
    extra_link_args=_ext.ldflags(),
)
setup(
    name="fusedopt_torch",
    version="0.1.0",
    description="torch.optim optimizers running fused fusedopt steps",
    packages=["fusedopt_torch"],
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
