"""fusedopt_torch ahead of time: the core (fusedopt_torch._C) and every built-in unit of kernels.

    cd integrations/pytorch && python3 setup.py build_ext --inplace     # or: pip install .

Without this step nothing is lost: ``import fusedopt_torch`` compiles nothing, and a step compiles
the core and the units it needs into a cache (fusedopt_torch/_ext.py, _build.py). This build is
what packagers and CI use: the core as a torch extension, then every built-in unit (each family,
the largest one dtype per unit; every layout and GradScaler's kernels; the norm plans; the 8-bit
conversions) into ``fusedopt_torch/_units/`` with a manifest, compiled in parallel (MAX_JOBS,
default: the cores) and reported one line per unit. CUDA units are built where torch has CUDA
and nvcc is found (FUSEDOPT_TORCH_CUDA=0: CPU only), for TORCH_CUDA_ARCH_LIST (default: the
visible GPUs', else 9.0). FUSEDOPT_TORCH_AOT_UNITS=0 builds the core alone.
"""

import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from torch.utils import cpp_extension

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "fusedopt_torch"))
import _build  # noqa: E402  (paths, flags and the compiler; imports no torch)
import _codegen  # noqa: E402

sys.path.pop(0)


def cuda_wanted():
    import torch

    if os.environ.get("FUSEDOPT_TORCH_CUDA") == "0":
        return False
    try:
        _build.nvcc()
    except _build.BuildError:
        if os.environ.get("FUSEDOPT_TORCH_CUDA") == "1":
            raise
        return False
    return torch.version.cuda is not None


def archs():
    listed = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split()
    if listed:
        return sorted({a.replace(".", "").replace("+PTX", "") for a in listed})
    import torch

    if torch.cuda.is_available():
        return sorted({"%d%d" % torch.cuda.get_device_capability(d) for d in range(torch.cuda.device_count())})
    return ["90"]


def build_units(folder: Path, with_cuda: bool):
    """Every built-in unit into `folder`, in parallel, one line each; the manifest last."""
    folder.mkdir(parents=True, exist_ok=True)
    jobs = []
    for backend in ("cuda", "host") if with_cuda else ("host",):
        # CUDA: one unit per family and dtype; the host compiles a family in seconds.
        for name, (source, covers) in _codegen.aot_units(backend, fine=backend == "cuda").items():
            jobs.append((backend, name, source, covers))
    # The longest first (CUDA, the families with the most layouts, 16-bit dtypes: Kahan and
    # stochastic rounding), so that the last job to start is a short one.
    weight = {"adam": 4, "adamw": 4, "rmsprop": 3, "sgd": 3, "nadam": 2, "lamb": 2}
    jobs.sort(key=lambda j: (j[0] != "cuda", -weight.get((j[3]["families"] or ["norm"])[0], 1),
                             j[3]["dtype"] not in (2, 3)))
    cuda_archs = archs() if with_cuda else []
    workers = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 4)
    print(f"fusedopt_torch: compiling {len(jobs)} units of kernels with {workers} jobs "
          f"(CUDA architectures {cuda_archs or 'none'})", flush=True)
    sources = folder / "sources"
    sources.mkdir(exist_ok=True)

    def compile_one(job):
        backend, name, source, covers = job
        src = sources / f"{backend}_{name}{_codegen.extension(backend)}"
        src.write_text(source)
        out = folder / f"{backend}_{name}.so"
        command = (_build.host_command(src, out) if backend == "host" else _build.cuda_command(src, out, cuda_archs))
        start = time.monotonic()
        done = __import__("subprocess").run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"fusedopt_torch: unit {backend} {name} did not compile:\n{' '.join(command)}\n"
                               f"{done.stdout}{done.stderr}")
        entry = dict(file=out.name, backend=backend, archs=cuda_archs if backend == "cuda" else [], **covers)
        return entry, time.monotonic() - start

    entries = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(compile_one, job): job for job in jobs}
        for k, future in enumerate(as_completed(futures), 1):
            entry, seconds = future.result()
            entries.append(entry)
            print(f"fusedopt_torch: [{k}/{len(jobs)}] {entry['backend']} {entry['file']} in {seconds:.0f} s", flush=True)
    manifest = dict(library=_build.library_digest(), units=sorted(entries, key=lambda e: e["file"]))
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


class BuildExtension(cpp_extension.BuildExtension):
    """torch's build of the core, then the units beside the package."""

    def run(self):
        super().run()
        if os.environ.get("FUSEDOPT_TORCH_AOT_UNITS") == "0":
            return
        package = Path(self.get_ext_fullpath("fusedopt_torch._C")).parent
        build_units(package / "_units", WITH_CUDA)


class BuildPy(build_py):
    """The package with the headers its on-demand compiles need (an installed package has no
    checkout beside it)."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "fusedopt_torch"
        for source, name in ((_build.INCLUDE, "_include"), (_build.CSRC, "_csrc")):
            shutil.rmtree(target / name, ignore_errors=True)
            shutil.copytree(source, target / name)


WITH_CUDA = cuda_wanted()
Extension = cpp_extension.CUDAExtension if WITH_CUDA else cpp_extension.CppExtension
# The core's flags are _ext.core_flags' (repeated here: _ext imports the package, which imports torch).
core_flags = ["-O2", "-std=c++17"] + (["-DFUSEDOPT_TORCH_WITH_CUDA"] if WITH_CUDA else [])
core = Extension(
    name="fusedopt_torch._C",
    sources=["csrc/binding.cpp", "csrc/engine.cpp"],  # _ext.CORE_SOURCES
    include_dirs=[str(_build.INCLUDE), str(_build.CSRC)],
    extra_compile_args={"cxx": core_flags, "nvcc": []} if WITH_CUDA else core_flags,
)
setup(
    name="fusedopt_torch",
    version="0.2.0",
    description="torch.optim optimizers running fused fusedopt steps, and optimizers of your own",
    packages=["fusedopt_torch"],
    ext_modules=[core],
    cmdclass={"build_ext": BuildExtension, "build_py": BuildPy},
)
