"""Compiles fusedopt_jax's XLA FFI handlers into a shared library per platform, cached by the hash
of everything it is compiled from, safely across processes.

No jax here: run as ``python -m fusedopt_jax._build --platform cpu|cuda --ffi-include DIR`` it
builds without importing jax (the run-gpu script builds first; a compile check needs only XLA's
FFI headers). The package calls :func:`build` with ``jax.ffi.include_dir()``.

Library (``libfusedopt_jax_<platform>.so``): csrc/unit.cc six times (one optimizer kind each,
compiled in parallel: nvcc for CUDA, the C++ compiler for the CPU), csrc/device.cc (the CUDA
runtime calls, or their CPU no-ops) and csrc/handler.cc (the FFI handler, the only file that sees
XLA's headers, compiled by the C++ compiler on both platforms). The CUDA runtime is linked
statically (nvcc's default), so the library does not depend on where jax's CUDA wheels put theirs.

Cache: ``$FUSEDOPT_JAX_CACHE`` (default ``$XDG_CACHE_HOME/fusedopt_jax`` or ``~/.cache/fusedopt_jax``),
``<platform>-<key>/libfusedopt_jax_<platform>.so``; the key hashes the sources, fusedopt's headers,
XLA's FFI headers, the commands and the compilers' ``--version``. A build happens in a private
folder renamed into place when it succeeded, under a lock (concurrent processes wait for one build).

Environment:
  FUSEDOPT_JAX_CACHE        the cache folder
  FUSEDOPT_JAX_NVCC         nvcc (default: $CUDA_HOME/bin/nvcc, nvcc on PATH, /usr/local/cuda/bin/nvcc)
  FUSEDOPT_JAX_CUDA_ARCHS   CUDA architectures, comma-separated (default: this machine's GPUs as
                            nvidia-smi reports them, else 90); PTX of the newest is embedded too
  FUSEDOPT_JAX_JOBS         parallel compiles (default: the cores)
  CXX                       the C++ compiler (default g++)
  FUSEDOPT_JAX_VERBOSE      1: print the commands
"""

import argparse
import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CSRC = PACKAGE.parent / "csrc"
INCLUDE = Path(os.environ.get("FUSEDOPT_JAX_INCLUDE", PACKAGE.parent.parent.parent / "include"))
NUM_KINDS = 6
BUILD_VERSION = 1


class BuildError(RuntimeError):
    """The library did not compile; `log` holds the compiler's output."""

    def __init__(self, message, log=""):
        super().__init__(message)
        self.log = log


def cache_root() -> Path:
    root = os.environ.get("FUSEDOPT_JAX_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "fusedopt_jax")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def nvcc() -> str:
    explicit = os.environ.get("FUSEDOPT_JAX_NVCC")
    if explicit:
        return explicit
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    raise BuildError("fusedopt_jax: nvcc was not found (set CUDA_HOME or FUSEDOPT_JAX_NVCC): the CUDA handler is "
                     "compiled on first use with the CUDA toolkit")


def cxx() -> str:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "c++"


@functools.lru_cache(maxsize=None)
def _local_archs():
    """The compute capabilities of this machine's GPUs as nvidia-smi reports them ("9.0" -> "90"),
    sorted and without repeats; empty when nvidia-smi is absent or says nothing usable."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = set()
    for line in out.splitlines():
        major, dot, minor = line.strip().partition(".")
        if dot and major.isdigit() and minor.isdigit():
            found.add(major + minor)
    return tuple(sorted(found, key=int))


def archs():
    """FUSEDOPT_JAX_CUDA_ARCHS, else this machine's GPUs, else 90 (Hopper)."""
    explicit = os.environ.get("FUSEDOPT_JAX_CUDA_ARCHS")
    if explicit is not None:
        chosen = [a.strip() for a in explicit.split(",") if a.strip()]
        bad = [a for a in chosen if not a.isdigit()]
        if bad or not chosen:
            raise BuildError(f"fusedopt_jax: FUSEDOPT_JAX_CUDA_ARCHS must be compute capabilities such as 80,90 "
                             f"(comma-separated digits), not {explicit!r}")
        return sorted(set(chosen), key=int)
    return list(_local_archs()) or ["90"]


def _gencode_flags():
    """Machine code for every architecture, and PTX of the newest one, which the driver compiles
    for a newer GPU than any listed."""
    chosen = archs()
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in chosen[:-1]]
    return flags + [f"-gencode=arch=compute_{chosen[-1]},code=[sm_{chosen[-1]},compute_{chosen[-1]}]"]


# -ffp-contract=off / -fmad=false: every multiply and add rounded on its own, as the rules are
# written (Optax's operations one by one) and as fusedopt's host and CUDA backends agree to the bit.
CXX_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off", "-fno-math-errno", "-DNDEBUG"]


def _nvcc_flags():
    return ["-O3", "-std=c++17", "-fmad=false", "-Xcompiler=-fPIC,-fvisibility=hidden,-fno-math-errno",
            "-DNDEBUG"] + _gencode_flags()


def _cuda_include():
    return Path(nvcc()).resolve().parent.parent / "include"


def commands(platform: str, ffi_include: Path, work: Path):
    """(compile commands, link command) for `platform` ('cpu' or 'cuda'), outputs under `work`."""
    cuda = platform == "cuda"
    define = f"-DFUSEDOPT_JAX_CUDA={1 if cuda else 0}"
    inc = [f"-I{INCLUDE}", f"-I{CSRC}"]
    compiles = []
    objects = []
    for k in range(NUM_KINDS):
        obj = work / f"unit{k}.o"
        if cuda:
            compiles.append([nvcc()] + _nvcc_flags() + [define, f"-DFUSEDOPT_JAX_KIND={k}", "-x", "cu", "-c"] + inc +
                            [str(CSRC / "unit.cc"), "-o", str(obj)])
        else:
            compiles.append([cxx()] + CXX_FLAGS + [define, f"-DFUSEDOPT_JAX_KIND={k}", "-c"] + inc +
                            [str(CSRC / "unit.cc"), "-o", str(obj)])
        objects.append(obj)
    obj = work / "device.o"
    if cuda:
        compiles.append([nvcc()] + _nvcc_flags() + [define, "-x", "cu", "-c"] + inc + [str(CSRC / "device.cc"), "-o", str(obj)])
    else:
        compiles.append([cxx()] + CXX_FLAGS + [define, "-c"] + inc + [str(CSRC / "device.cc"), "-o", str(obj)])
    objects.append(obj)
    obj = work / "handler.o"
    compiles.append([cxx()] + CXX_FLAGS + [define, "-c"] + inc + [f"-I{ffi_include}", str(CSRC / "handler.cc"), "-o", str(obj)])
    objects.append(obj)
    output = work / f"libfusedopt_jax_{platform}.so"
    if cuda:
        link = [nvcc(), "-shared", "-cudart", "static"] + _gencode_flags()
        link += [str(o) for o in objects] + ["-o", str(output)]
    else:
        link = [cxx(), "-shared"] + [str(o) for o in objects] + ["-o", str(output)]
    return compiles, link, output


def _version(tool):
    try:
        return subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except OSError as e:
        raise BuildError(f"fusedopt_jax: cannot run the compiler {tool}: {e}") from e


def build_key(platform: str, ffi_include: Path) -> str:
    h = hashlib.sha256(f"fusedopt_jax build {BUILD_VERSION} {platform}".encode())
    for folder, patterns in ((INCLUDE, ("*.hpp", "*.cuh", "*.inl", "*.h")), (CSRC, ("*.hpp", "*.cc", "*.h"))):
        for p in sorted({p for pattern in patterns for p in Path(folder).rglob(pattern)}):
            h.update(str(p.relative_to(folder)).encode())
            h.update(p.read_bytes())
    api = Path(ffi_include) / "xla" / "ffi" / "api"
    for name in ("ffi.h", "api.h", "c_api.h"):
        if (api / name).exists():
            h.update((api / name).read_bytes())
    compiles, link, _ = commands(platform, Path(ffi_include), Path("/work"))
    h.update(json.dumps([c[1:] for c in compiles] + [link[1:]]).encode())
    h.update(_version(cxx()).encode())
    if platform == "cuda":
        h.update(_version(nvcc()).encode())
    return h.hexdigest()[:24]


def _announce(text):
    if os.environ.get("FUSEDOPT_JAX_QUIET") != "1":
        print(f"fusedopt_jax: {text}", file=sys.stderr, flush=True)


def build(platform: str, ffi_include) -> Path:
    """The path of the library for `platform` ('cpu' or 'cuda'), compiled against the XLA FFI headers
    in `ffi_include` (``jax.ffi.include_dir()``) where the cache does not hold it yet."""
    if platform not in ("cpu", "cuda"):
        raise ValueError(f"fusedopt_jax: unknown platform {platform!r} (cpu or cuda)")
    ffi_include = Path(ffi_include)
    if not (ffi_include / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise BuildError(f"fusedopt_jax: {ffi_include}/xla/ffi/api/ffi.h not found (jax.ffi.include_dir())")
    key = build_key(platform, ffi_include)
    root = cache_root()
    entry = root / f"{platform}-{key}"
    library = entry / f"libfusedopt_jax_{platform}.so"
    if library.exists():
        return library
    with open(root / f"{platform}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():
            return library
        work = Path(tempfile.mkdtemp(prefix=f".{platform}-", dir=root))
        try:
            compiles, link, output = commands(platform, ffi_include, work)
            _announce(f"compiling the {platform} handlers ({len(compiles)} files) ...")
            start = time.monotonic()
            jobs = int(os.environ.get("FUSEDOPT_JAX_JOBS", "0")) or (os.cpu_count() or 1)
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                results = list(pool.map(_run, compiles))
            results.append(_run(link) if all(r.returncode == 0 for r in results) else None)
            log = "\n".join(" ".join(r.args) + "\n" + r.stdout + r.stderr for r in results if r is not None)
            (work / "build.log").write_text(log)
            if any(r is None or r.returncode != 0 for r in results):
                failed = root / "failed"
                failed.mkdir(exist_ok=True)
                (failed / f"{platform}-{key}.log").write_text(log)
                raise BuildError(f"fusedopt_jax: the {platform} handlers did not compile; compiler output in "
                                 f"{failed / f'{platform}-{key}.log'}\n{_tail(log)}", log=log)
            seconds = time.monotonic() - start
            (work / "key.json").write_text(json.dumps(dict(platform=platform, seconds=seconds), indent=1))
            assert output.exists()
            if entry.exists():
                shutil.rmtree(entry, ignore_errors=True)
            os.rename(work, entry)
            _announce(f"compiled the {platform} handlers in {seconds:.1f} s")
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)
    return library


def _run(command):
    if os.environ.get("FUSEDOPT_JAX_VERBOSE") == "1":
        print(" ".join(command), file=sys.stderr, flush=True)
    return subprocess.run(command, capture_output=True, text=True)


def _tail(log, lines=40):
    return "\n".join(log.strip().splitlines()[-lines:])


def build_seconds(path) -> float:
    """How long the library at `path` took to compile (its key.json), or None."""
    try:
        return json.loads((Path(path).parent / "key.json").read_text())["seconds"]
    except (OSError, ValueError, KeyError):
        return None


def main(argv=None):
    parser = argparse.ArgumentParser(description="Build fusedopt_jax's FFI handlers into the cache.")
    parser.add_argument("--platform", choices=("cpu", "cuda", "all"), default="all")
    parser.add_argument("--ffi-include", help="XLA FFI headers (default: jax.ffi.include_dir())")
    args = parser.parse_args(argv)
    include = args.ffi_include
    if include is None:
        import jax  # only here: the build itself needs no jax

        include = jax.ffi.include_dir()
    for platform in (("cpu", "cuda") if args.platform == "all" else (args.platform,)):
        path = build(platform, include)
        print(f"{platform}: {path} ({build_seconds(path) or 0:.1f} s to compile)")


if __name__ == "__main__":
    main()
