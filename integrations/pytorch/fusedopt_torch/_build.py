"""Compiles fusedopt_torch's units (_codegen.py's sources) into a cache, once per source,
compiler and library version, safely across processes.

No torch here either: units are plain shared libraries, compiled by nvcc (CUDA) or the C++
compiler (host) from the library's headers, and loaded by the core (csrc/binding.cpp's
``_C.load_unit``).

Cache: ``$FUSEDOPT_TORCH_CACHE`` (default ``$XDG_CACHE_HOME/fusedopt_torch`` or
``~/.cache/fusedopt_torch``), one folder per unit, ``<name>-<key>/unit.so``, where the key hashes
the source, the flags, the compiler's ``--version`` and the library (every header and this
package's generator). A unit is compiled in a private folder and renamed into place when it
built: a failed or interrupted compile leaves no entry (its log is kept under ``failed/``).
Processes that need the same unit at once take a lock on ``<name>-<key>.lock``: one compiles,
the others wait and load its result (torchrun ranks). Threads of one process share a build.

Environment:
  FUSEDOPT_TORCH_CACHE    the cache folder
  FUSEDOPT_TORCH_NVCC     nvcc (default: $CUDA_HOME/bin/nvcc, nvcc on PATH, /usr/local/cuda/bin/nvcc)
  CXX                     the host compiler of host units (default g++, else c++)
  FUSEDOPT_TORCH_MARCH    -march of host units (default native; 'none' adds none)
  FUSEDOPT_TORCH_HOST_OPT the optimisation flag of host units (default -O3; CI's test of units: -O1)
  FUSEDOPT_TORCH_NVCC_THREADS  threads nvcc may optimise a CUDA unit's kernels with
                          (--split-compile; default: the cores over the compiles running in this
                          process; 1 turns it off)
  FUSEDOPT_TORCH_VERBOSE  1: print every compiler command and its output
  FUSEDOPT_TORCH_QUIET    1: do not announce compiles on stderr
"""

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

try:  # as part of the package, or run as a file (tests/python, CMake) without importing torch
    from . import _codegen
except ImportError:  # pragma: no cover
    import _codegen  # type: ignore

CSRC = _codegen.CSRC
INCLUDE = _codegen.INCLUDE

# Bumped when the way units are compiled changes in a way the key would not see.
BUILD_VERSION = 1


class BuildError(RuntimeError):
    """A unit did not compile. `log` holds the compiler's output, `log_path` where it is kept,
    `source` the unit's source."""

    def __init__(self, message, log="", log_path=None, source=""):
        super().__init__(message)
        self.log = log
        self.log_path = log_path
        self.source = source


def cache_root() -> Path:
    root = os.environ.get("FUSEDOPT_TORCH_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "fusedopt_torch")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


_lock = threading.Lock()
_digest = None
_compiler_ids = {}
_building = {}  # key -> Future of the unit's path (builds of this process)
_compiling = 0  # compiles running in this process (_build_locked)
_split_support = {}  # nvcc path -> whether it takes --split-compile


def library_digest() -> str:
    """A hash of everything a unit compiles from: the library's headers, the package's C++
    sources and the generator's version (computed once per process: a few ms)."""
    global _digest
    if _digest is None:
        h = hashlib.sha256(f"generator {_codegen.GENERATOR_VERSION} build {BUILD_VERSION}".encode())
        for folder, patterns in ((INCLUDE, ("*.hpp", "*.cuh", "*.inl", "*.h")), (CSRC, ("*.hpp", "*.cuh", "*.cpp"))):
            files = sorted({p for pattern in patterns for p in folder.rglob(pattern)})
            for p in files:
                h.update(str(p.relative_to(folder)).encode())
                h.update(p.read_bytes())
        _digest = h.hexdigest()
    return _digest


def nvcc() -> str:
    explicit = os.environ.get("FUSEDOPT_TORCH_NVCC")
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
    raise BuildError("fusedopt_torch: nvcc was not found (set CUDA_HOME or FUSEDOPT_TORCH_NVCC): CUDA kernels are "
                     "compiled on first use with the CUDA toolkit")


def cxx() -> str:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "c++"


def split_compile_flags(tool: str, running: int):
    """nvcc's --split-compile for a CUDA unit compiled while `running` compiles (itself included)
    run in this process: the kernels of a unit are optimised (cicc, ptxas) on the cores the other
    compiles leave, not one after another. A user rule's first step compiles one unit while the
    machine's other cores wait (docs/decisions.md, "nvcc optimises a unit's kernels in
    parallel"). Not a cache key input: the kernels are the same (the PTX differs at most in the
    order of a commutative operation's operands)."""
    threads = os.environ.get("FUSEDOPT_TORCH_NVCC_THREADS")
    if threads:
        try:
            threads = int(threads)
        except ValueError:
            raise ValueError(f"fusedopt_torch: FUSEDOPT_TORCH_NVCC_THREADS must be a number of threads, not "
                             f"{threads!r}") from None
    else:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        threads = cores // max(1, running)
    if threads <= 1:
        return []
    if tool not in _split_support:
        try:
            out = subprocess.run([tool, "--help"], capture_output=True, text=True, timeout=60)
            _split_support[tool] = "--split-compile" in out.stdout
        except OSError:
            _split_support[tool] = False
    return [f"--split-compile={threads}"] if _split_support[tool] else []


def compiler_id(path: str) -> str:
    """The compiler's ``--version`` (its identity in the cache key), asked once per process."""
    if path not in _compiler_ids:
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
            _compiler_ids[path] = out.stdout.strip()
        except OSError as e:
            raise BuildError(f"fusedopt_torch: cannot run the compiler {path}: {e}") from e
    return _compiler_ids[path]


def march() -> str:
    return os.environ.get("FUSEDOPT_TORCH_MARCH", "native")


def includes():
    return [f"-I{INCLUDE}", f"-I{CSRC}"]


def host_command(source: Path, output: Path, libs=()):
    """The host compiler's command for a host unit: OpenMP (as fusedopt's CMake target gives its
    users), -fno-math-errno (the library's loops vectorise without it since issue 47, a user
    rule's exp, log or pow do not), -ffp-contract=off (a step's bits do not depend on which
    kernel of a rule runs, as the library's tests assume), the machine's vector width, hidden
    symbols but the entry point (units never see each other's templates)."""
    flags = [os.environ.get("FUSEDOPT_TORCH_HOST_OPT", "-O3"), "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden",
             "-fno-math-errno", "-ffp-contract=off", "-fopenmp", "-DNDEBUG"]
    if march() != "none":
        flags.append(f"-march={march()}")
    return [cxx()] + flags + includes() + [str(source), "-o", str(output)] + list(libs)


def cuda_command(source: Path, output: Path, archs, libs=()):
    """nvcc's command for a CUDA unit: SASS for each of `archs` ('90' for sm_90), the CUDA
    runtime shared (torch's, once loaded), hidden symbols but the entry point."""
    if not archs:
        raise BuildError("fusedopt_torch: a CUDA unit needs an architecture")
    tool = nvcc()
    lib = Path(tool).resolve().parent.parent / "lib64"
    flags = ["-O3", "-std=c++17", "--shared", "-Xcompiler=-fPIC,-fvisibility=hidden,-fno-math-errno", "-cudart",
             "shared", "-DNDEBUG", f"-Xlinker=-rpath,{lib}"]
    for a in archs:
        flags.append(f"-gencode=arch=compute_{a},code=sm_{a}")
    return [tool] + flags + includes() + [str(source), "-o", str(output)] + list(libs)


def _command(backend, source, output, archs, libs=()):
    return host_command(source, output, libs) if backend == "host" else cuda_command(source, output, archs, libs)


def unit_key(name: str, source: str, backend: str, archs=(), libs=()) -> str:
    tool = cxx() if backend == "host" else nvcc()
    probe = _command(backend, Path("unit"), Path("unit.so"), list(archs), libs)
    inputs = dict(name=name, source=source, backend=backend, command=probe[1:], compiler=compiler_id(tool),
                  library=library_digest())
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]


def _announce(text):
    if os.environ.get("FUSEDOPT_TORCH_QUIET") != "1":
        print(f"fusedopt_torch: {text}", file=sys.stderr, flush=True)


def build_unit(name: str, source: str, backend: str, archs=(), what: str = "", libs=()) -> Path:
    """The path of the compiled unit `name` of `source` on `backend` ('host' or 'cuda', for the
    architectures `archs`), compiled into the cache first where it is not there. `what` says in
    words what is compiled (announced on stderr); `libs`, what it links besides (the muon
    unit's -lcublas, from the toolkit that compiles it). Raises BuildError on a failed compile."""
    key = unit_key(name, source, backend, archs, libs)
    with _lock:
        future = _building.get(key)
        owner = future is None
        if owner:
            future = _building[key] = Future()
    if not owner:
        return future.result()
    try:
        path = _build_locked(name, key, source, backend, list(archs), what, libs)
    except BaseException as e:
        future.set_exception(e)
        with _lock:
            del _building[key]  # a later call tries again
        raise
    future.set_result(path)
    return path


def _build_locked(name, key, source, backend, archs, what, libs) -> Path:
    global _compiling
    root = cache_root()
    entry = root / f"{name}-{key}"
    unit = entry / "unit.so"
    if unit.exists():
        return unit
    with open(root / f"{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be compiling it: wait for it
        if unit.exists():
            return unit
        work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            src = work / f"unit{_codegen.extension(backend)}"
            src.write_text(source)
            command = _command(backend, src, work / "unit.so", archs, libs)
            with _lock:
                _compiling += 1
                running = _compiling
            try:
                if backend == "cuda":
                    command[1:1] = split_compile_flags(command[0], running)
                _announce(f"compiling {what or name} ({backend}) ...")
                if os.environ.get("FUSEDOPT_TORCH_VERBOSE") == "1":
                    print(" ".join(command), file=sys.stderr, flush=True)
                start = time.monotonic()
                done = subprocess.run(command, capture_output=True, text=True, cwd=work)
                seconds = time.monotonic() - start
            finally:
                with _lock:
                    _compiling -= 1
            log = " ".join(command) + "\n" + done.stdout + done.stderr
            if os.environ.get("FUSEDOPT_TORCH_VERBOSE") == "1":
                print(done.stdout + done.stderr, file=sys.stderr, flush=True)
            if done.returncode != 0:
                failed = root / "failed"
                failed.mkdir(exist_ok=True)
                log_path = failed / f"{name}-{key}.log"
                log_path.write_text(log + "\n---- source ----\n" + source)
                raise BuildError(f"fusedopt_torch: {what or name} did not compile ({backend}); compiler output in "
                                 f"{log_path}", log=log, log_path=log_path, source=source)
            (work / "build.log").write_text(log)
            (work / "key.json").write_text(json.dumps(dict(name=name, backend=backend, archs=archs, seconds=seconds,
                                                           what=what), indent=1))
            if entry.exists():  # a folder without unit.so: an earlier failure's, never the case normally
                shutil.rmtree(entry, ignore_errors=True)
            os.rename(work, entry)
            _announce(f"compiled {what or name} in {seconds:.1f} s")
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)
    return unit


def compile_seconds(path: Path):
    """How long the unit at `path` took to compile (its key.json), or None."""
    try:
        return json.loads((Path(path).parent / "key.json").read_text())["seconds"]
    except (OSError, ValueError, KeyError):
        return None
