"""Compiles fusedopt_jax's XLA FFI handler and its units into shared libraries, cached by the hash
of everything each is compiled from, safely across processes.

No jax here: run as ``python -m fusedopt_jax._build --platform cpu|cuda --ffi-include DIR [--units
all|none|NAMES]`` it builds without importing jax (the run-gpu script builds first; a compile
check needs only XLA's FFI headers). The package calls :func:`build` with ``jax.ffi.include_dir()``
and :func:`build_units` with the units a traced step needs.

Libraries, per platform (nvcc for CUDA sources, the C++ compiler for the CPU's and for the
handler, which alone sees XLA's headers; the CUDA runtime linked statically, so nothing depends
on where jax's CUDA wheels put theirs):
  - the handler, ``libfusedopt_jax_<platform>.so``: csrc/handler.cc (the FFI handler) and
    csrc/device.cc (the CUDA runtime calls, or their CPU no-ops). It steps nothing by itself;
  - a unit per optimizer kind, form (fused or Optax's) and combination of element types
    (``all_units``: 46), ``libfusedopt_jax_<platform>_<unit>.so``: csrc/unit.cc compiled for that
    one combination, loaded into the handler by ``FusedoptJaxAddUnit``. A first step compiles
    the handler and the units it uses (AdamW over float32: one), not every combination.

Cache: ``$FUSEDOPT_JAX_CACHE`` (default ``$XDG_CACHE_HOME/fusedopt_jax`` or ``~/.cache/fusedopt_jax``),
a folder ``<platform>-<key>/`` per library; the key hashes the sources (fusedopt's headers and
csrc/), XLA's FFI headers (the handler's), the commands and the compilers' ``--version``. A build
happens in a private folder renamed into place when it succeeded, under a lock (concurrent
processes wait for one build).

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
# An installed package carries its sources and fusedopt's headers beside it (setup.py); a
# checkout has them in the tree.
CSRC = PACKAGE / "_csrc" if (PACKAGE / "_csrc").is_dir() else PACKAGE.parent / "csrc"
INCLUDE = Path(os.environ.get("FUSEDOPT_JAX_INCLUDE") or
               (PACKAGE / "_include" if (PACKAGE / "_include").is_dir() else PACKAGE.parent.parent.parent / "include"))
NUM_KINDS = 6
BUILD_VERSION = 2


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


# csrc/runner.hpp's `kind` and `dtype`; the states each kind binds (its states_of).
KIND_NAMES = ("sgd", "sgd_momentum", "adam", "lion", "lamb", "clip_adam")
KIND_STATES = (0, 1, 2, 1, 2, 2)
_DTYPES = ("float32", "bfloat16")


def unit_of(kind: int, inplace: bool, param: int, state1: int, state2: int) -> tuple:
    """The unit (kind, inplace, param, state1, state2) that steps a group of these element types
    (csrc/runner.hpp's `dtype` values: 0 float32, 1 bfloat16): a state the kind does not bind takes
    the parameter's type, as csrc/unit.cc compiles it. Raises ValueError for a combination no unit
    compiles (a float32 parameter with a bfloat16 state)."""
    if not 0 <= kind < len(KIND_NAMES):
        raise ValueError(f"fusedopt_jax: unknown optimizer kind {kind}")
    states = KIND_STATES[kind]
    state1 = state1 if states >= 1 else param
    state2 = state2 if states >= 2 else param
    if any(t not in (0, 1) for t in (param, state1, state2)) or (param == 0 and (state1, state2) != (0, 0)):
        raise ValueError(f"fusedopt_jax: no unit for parameters {param} with states {state1}/{state2} (dtype codes: "
                         "0 float32, 1 bfloat16; a float32 parameter has float32 states)")
    return (kind, bool(inplace), param, state1, state2)


def all_units():
    """Every unit fusedopt_jax can build: 23 combinations of kind and element types, two forms each."""
    units = set()
    for kind in range(len(KIND_NAMES)):
        for inplace in (False, True):
            for param in (0, 1):
                for state1 in (0, 1):
                    for state2 in (0, 1):
                        try:
                            units.add(unit_of(kind, inplace, param, state1, state2))
                        except ValueError:
                            pass
    return sorted(units)


def unit_name(unit) -> str:
    """A unit's file-name part, e.g. adam-fused-bfloat16-float32-float32."""
    kind, inplace, param, state1, state2 = unit
    return "-".join([KIND_NAMES[kind], "fused" if inplace else "optax"] + [_DTYPES[t] for t in (param, state1, state2)])


def _compile(platform: str, source: Path, obj: Path, defines, extra_includes=(), xla=False, openmp=False):
    """One compile: nvcc for a CUDA source, the C++ compiler for the CPU's and for `xla` sources
    (the handler: XLA's headers, no CUDA ones); `openmp` for a CPU unit, whose host plans spread a
    step over OpenMP's threads (OMP_NUM_THREADS; the bits do not depend on their number)."""
    cuda = platform == "cuda"
    inc = [f"-I{INCLUDE}", f"-I{CSRC}"] + [f"-I{d}" for d in extra_includes]
    defines = [f"-DFUSEDOPT_JAX_CUDA={1 if cuda else 0}"] + list(defines)
    if cuda and not xla:
        return [nvcc()] + _nvcc_flags() + defines + ["-x", "cu", "-c"] + inc + [str(source), "-o", str(obj)]
    flags = CXX_FLAGS + (["-fopenmp"] if openmp and not cuda else [])
    return [cxx()] + flags + defines + ["-c"] + inc + [str(source), "-o", str(obj)]


def _link(platform: str, objects, output: Path, libraries=()):
    if platform == "cuda":
        # The CUDA runtime statically: no dependence on where jax's wheels put it. Its symbols are
        # not exported (nm -D lists the library's own entry points alone), so a libcudart.so
        # loaded globally before (torch's) cannot take this library's runtime calls.
        return ([nvcc(), "-shared", "-cudart", "static"] + _gencode_flags() + [str(o) for o in objects] +
                ["-o", str(output)] + list(libraries))
    return [cxx(), "-shared", "-fopenmp"] + [str(o) for o in objects] + ["-o", str(output)] + list(libraries)


def commands(platform: str, ffi_include: Path, work: Path, unit=None):
    """(compile commands, link command, output) under `work`: the handler's library for `platform`
    ('cpu' or 'cuda'; csrc/handler.cc and csrc/device.cc), or with `unit` that unit's library
    (csrc/unit.cc compiled for one kind, form and combination of element types)."""
    if unit is None:
        compiles = [_compile(platform, CSRC / "device.cc", work / "device.o", []),
                    _compile(platform, CSRC / "handler.cc", work / "handler.o", [], [ffi_include], xla=True)]
        output = work / f"libfusedopt_jax_{platform}.so"
        return compiles, _link(platform, [work / "device.o", work / "handler.o"], output, ["-ldl"]), output
    kind, inplace, param, state1, state2 = unit
    defines = [f"-DFUSEDOPT_JAX_KIND={kind}", f"-DFUSEDOPT_JAX_INPLACE={int(inplace)}", f"-DFUSEDOPT_JAX_PARAM={param}",
               f"-DFUSEDOPT_JAX_STATE1={state1}", f"-DFUSEDOPT_JAX_STATE2={state2}"]
    output = work / f"libfusedopt_jax_{platform}_{unit_name(unit)}.so"
    return ([_compile(platform, CSRC / "unit.cc", work / "unit.o", defines, openmp=True)],
            _link(platform, [work / "unit.o"], output), output)


def _version(tool):
    try:
        return subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except OSError as e:
        raise BuildError(f"fusedopt_jax: cannot run the compiler {tool}: {e}") from e


@functools.lru_cache(maxsize=None)
def _sources_digest() -> str:
    """The hash of every source a library is compiled from (fusedopt's headers, csrc/), once a
    process: the package's sources do not change under a running program."""
    h = hashlib.sha256()
    for folder, patterns in ((INCLUDE, ("*.hpp", "*.cuh", "*.inl", "*.h")), (CSRC, ("*.hpp", "*.cc", "*.h"))):
        for p in sorted({p for pattern in patterns for p in Path(folder).rglob(pattern)}):
            h.update(str(p.relative_to(folder)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _compilers_digest(platform: str) -> str:
    text = _version(cxx())
    if platform == "cuda":  # nvcc, its host compiler (g++ on PATH unless -ccbin) and its flags from the environment
        host = shutil.which("g++") or shutil.which("c++")
        text += _version(nvcc()) + (_version(host) if host else "")
        text += os.environ.get("NVCC_PREPEND_FLAGS", "") + "|" + os.environ.get("NVCC_APPEND_FLAGS", "")
    return hashlib.sha256(text.encode()).hexdigest()


def build_key(platform: str, ffi_include: Path, unit=None) -> str:
    h = hashlib.sha256(f"fusedopt_jax build {BUILD_VERSION} {platform}".encode())
    h.update(_sources_digest().encode())
    if unit is None:  # only the handler sees XLA's headers
        api = Path(ffi_include) / "xla" / "ffi" / "api"
        for name in ("ffi.h", "api.h", "c_api.h"):
            if (api / name).exists():
                h.update((api / name).read_bytes())
    compiles, link, _ = commands(platform, Path(ffi_include), Path("/work"), unit)
    h.update(json.dumps([c[1:] for c in compiles] + [link[1:]]).encode())
    h.update(_compilers_digest(platform).encode())
    return h.hexdigest()[:24]


def _announce(text):
    if os.environ.get("FUSEDOPT_JAX_QUIET") != "1":
        print(f"fusedopt_jax: {text}", file=sys.stderr, flush=True)


def _check_platform(platform):
    if platform not in ("cpu", "cuda"):
        raise ValueError(f"fusedopt_jax: unknown platform {platform!r} (cpu or cuda)")


def build(platform: str, ffi_include) -> Path:
    """The path of the handler's library for `platform` ('cpu' or 'cuda'), compiled against the XLA
    FFI headers in `ffi_include` (``jax.ffi.include_dir()``) where the cache does not hold it yet.
    It steps nothing until units are added to it (build_unit, then its FusedoptJaxAddUnit)."""
    _check_platform(platform)
    ffi_include = Path(ffi_include)
    if not (ffi_include / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise BuildError(f"fusedopt_jax: {ffi_include}/xla/ffi/api/ffi.h not found (jax.ffi.include_dir())")
    return _build_entry(platform, ffi_include, None, f"the {platform} handler")


def build_unit(platform: str, unit) -> Path:
    """The path of `unit`'s library (unit_of's tuple) for `platform`, compiled where the cache does
    not hold it yet."""
    _check_platform(platform)
    unit = unit_of(*unit)
    return _build_entry(platform, Path("/unused"), unit, f"the {platform} unit {unit_name(unit)}")


def build_units(platform: str, units, jobs=None):
    """build_unit for each of `units`, in parallel (FUSEDOPT_JAX_JOBS, default the cores); returns
    their paths in order. The first failure is raised after the others finished."""
    units = list(units)
    jobs = jobs or int(os.environ.get("FUSEDOPT_JAX_JOBS", "0")) or (os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(units) or 1))) as pool:
        futures = [pool.submit(build_unit, platform, u) for u in units]
    return [f.result() for f in futures]


def _build_entry(platform: str, ffi_include: Path, unit, what: str) -> Path:
    """One library in the cache (``<platform>-<key>/``): built in a private folder renamed into
    place when it succeeded, under a lock (concurrent processes wait for one build)."""
    key = build_key(platform, ffi_include, unit)
    root = cache_root()
    entry = root / f"{platform}-{key}"
    _, _, output = commands(platform, ffi_include, entry, unit)
    if output.exists():
        return output
    with open(root / f"{platform}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if output.exists():
            return output
        work = Path(tempfile.mkdtemp(prefix=f".{platform}-", dir=root))
        try:
            compiles, link, built = commands(platform, ffi_include, work, unit)
            _announce(f"compiling {what} ...")
            start = time.monotonic()
            with ThreadPoolExecutor(max_workers=len(compiles)) as pool:
                results = list(pool.map(_run, compiles))
            results.append(_run(link) if all(r.returncode == 0 for r in results) else None)
            log = "\n".join(" ".join(r.args) + "\n" + r.stdout + r.stderr for r in results if r is not None)
            (work / "build.log").write_text(log)
            if any(r is None or r.returncode != 0 for r in results):
                failed = root / "failed"
                failed.mkdir(exist_ok=True)
                (failed / f"{platform}-{key}.log").write_text(log)
                raise BuildError(f"fusedopt_jax: {what} did not compile; compiler output in "
                                 f"{failed / f'{platform}-{key}.log'}\n{_tail(log)}", log=log)
            seconds = time.monotonic() - start
            (work / "key.json").write_text(json.dumps(dict(platform=platform, unit=unit and unit_name(unit),
                                                           seconds=seconds), indent=1))
            assert built.exists()
            if entry.exists():
                shutil.rmtree(entry, ignore_errors=True)
            os.rename(work, entry)
            _announce(f"compiled {what} in {seconds:.1f} s")
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)
    return output


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
    parser = argparse.ArgumentParser(description="Build fusedopt_jax's FFI handlers and units into the cache.")
    parser.add_argument("--platform", choices=("cpu", "cuda", "all"), default="all")
    parser.add_argument("--ffi-include", help="XLA FFI headers (default: jax.ffi.include_dir())")
    parser.add_argument("--units", default="all", help="'all' (every unit, in parallel: what a machine that "
                        "steps many kinds wants ahead), 'none' (the handler alone), or names as "
                        "adam-fused-float32-float32-float32, comma-separated")
    args = parser.parse_args(argv)
    include = args.ffi_include
    if include is None:
        import jax  # only here: the build itself needs no jax

        include = jax.ffi.include_dir()
    names = {unit_name(u): u for u in all_units()}
    if args.units == "all":
        units = all_units()
    elif args.units == "none":
        units = []
    else:
        unknown = [n for n in args.units.split(",") if n not in names]
        if unknown:
            parser.error(f"unknown units {unknown}; known: {', '.join(sorted(names))}")
        units = [names[n] for n in args.units.split(",")]
    for platform in (("cpu", "cuda") if args.platform == "all" else (args.platform,)):
        start = time.monotonic()
        path = build(platform, include)
        print(f"{platform}: {path} ({build_seconds(path) or 0:.1f} s to compile)")
        if units:
            paths = build_units(platform, units)
            print(f"{platform}: {len(paths)} units in {paths[0].parent.parent} "
                  f"({sum(build_seconds(p) or 0 for p in paths):.1f} s of compiles, {time.monotonic() - start:.1f} s in all)")


if __name__ == "__main__":
    main()
