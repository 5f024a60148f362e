"""fusedopt_torch's compiled parts: the core (csrc/engine.cpp and binding.cpp: the engine, no
kernels) and the units of kernels it runs, compiled when a step first needs them.

``import fusedopt_torch`` compiles nothing. The first step of an optimizer loads the core (a
prebuilt ``fusedopt_torch._C`` from ``pip install``/``setup.py``, else a JIT build into the cache,
once per torch version) and asks, through its provider, for the unit of each (device, dtype,
layout) it meets: one installed ahead of time where there is one, else compiled into the cache
for that dtype and layout alone (_build.py). Where the core must be compiled too, the units the
first step will need are compiled beside it, in parallel.

Environment (besides _build.py's):
  FUSEDOPT_TORCH_CUDA       0: no CUDA in the core even where CUDA is available; 1: require it
  FUSEDOPT_TORCH_PREBUILT   0: ignore what setup.py built (the core and the units): compile on demand
  TORCH_CUDA_ARCH_LIST      CUDA architectures of units (default: each device's own)
  MAX_JOBS                  parallel compiles (default: the number of cores)
"""

import hashlib
import importlib.util
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import _build, _codegen

_HERE = Path(__file__).resolve().parent
CSRC = _build.CSRC
INCLUDE = _build.INCLUDE
PREBUILT = _HERE / "_units"

_module = None
_lock = threading.Lock()
_units = {}  # path -> unit address
_archs = {}  # device index -> architecture ('90')
_pool = None


def cuda_wanted():
    """Whether the core is built with CUDA (torch has CUDA and the toolkit is found)."""
    import torch

    flag = os.environ.get("FUSEDOPT_TORCH_CUDA")
    if flag == "0":
        return False
    try:
        _build.nvcc()
        toolkit = True
    except _build.BuildError:
        toolkit = False
    available = torch.version.cuda is not None and toolkit
    if flag == "1" and not available:
        raise RuntimeError("FUSEDOPT_TORCH_CUDA=1 but torch has no CUDA or the CUDA toolkit was not found")
    return available


# The core's translation units (csrc/), compiled in parallel: the core is the critical path of a
# first step from an empty cache (docs/decisions.md, "The core in two translation units").
CORE_SOURCES = ("binding.cpp", "engine.cpp")


def core_flags(with_cuda, full_headers=False):
    """The core's compile flags (setup.py and the JIT build). Without `full_headers` it includes
    ATen and torch's pybind11 casters alone, not torch/extension.h's C++ frontend."""
    flags = ["-O2", "-std=c++17"]
    if with_cuda:
        flags.append("-DFUSEDOPT_TORCH_WITH_CUDA")
    if full_headers:
        flags.append("-DFUSEDOPT_TORCH_FULL_HEADERS")
    return flags


def load():
    """The core module: the prebuilt ``fusedopt_torch._C`` where installed, else the JIT build."""
    global _module
    if _module is None:
        with _lock:
            if _module is None:
                try:
                    if os.environ.get("FUSEDOPT_TORCH_PREBUILT") == "0":
                        raise ImportError("FUSEDOPT_TORCH_PREBUILT=0")
                    from . import _C  # noqa: F401 - setup.py's build

                    _module = _C
                except ImportError:
                    _module = _jit_core()
    return _module


def _core_key(with_cuda):
    import torch

    h = hashlib.sha256(_build.library_digest().encode())
    h.update(f"{torch.__version__} {torch.version.cuda} {sys.version} {with_cuda} "
             f"{_build.compiler_id(_build.cxx())}".encode())
    return h.hexdigest()[:20]


def _import(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _jit_core():
    """The core from the cache, compiled there first (torch's cpp_extension, whose lock makes
    concurrent processes build it once). A later process imports the built library directly."""
    with_cuda = cuda_wanted()
    key = _core_key(with_cuda)
    folder = _build.cache_root() / f"core-{key}"
    marker = folder / "core.json"
    if marker.exists():
        try:
            built = json.loads(marker.read_text())
            if Path(built["library"]).exists():
                return _import(built["name"], built["library"])
        except (OSError, ValueError, KeyError, ImportError):
            pass  # built again below
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    name = f"fusedopt_torch_core_{key[:12]}"
    verbose = os.environ.get("FUSEDOPT_TORCH_VERBOSE") == "1"
    _build._announce("compiling the core (once per torch version and library) ...")
    start = time.monotonic()
    common = dict(sources=[str(CSRC / source) for source in CORE_SOURCES],
                  extra_include_paths=[str(INCLUDE), str(CSRC)], build_directory=str(folder), with_cuda=with_cuda,
                  verbose=verbose)
    full = False
    try:
        module = cpp_extension.load(name=name, extra_cflags=core_flags(with_cuda), **common)
    except Exception as light_failure:  # a torch whose headers the light set does not suit
        _build._announce(f"the core did not compile with the light headers ({light_failure}); trying torch/extension.h")
        full = True
        module = cpp_extension.load(name=name, extra_cflags=core_flags(with_cuda, True), **common)
    seconds = time.monotonic() - start
    marker.write_text(json.dumps(dict(name=module.__name__, library=module.__file__, seconds=seconds,
                                      full_headers=full)))
    _build._announce(f"compiled the core in {seconds:.1f} s")
    return module


def core_seconds():
    """How long the JIT build of the core took (its marker), None where prebuilt or unknown."""
    for marker in _build.cache_root().glob("core-*/core.json"):
        try:
            built = json.loads(marker.read_text())
            if _module is not None and built.get("library") == getattr(_module, "__file__", None):
                return built["seconds"]
        except (OSError, ValueError, KeyError):
            continue
    return None


# ---- units ----------------------------------------------------------------------------------------


def arch_of(device):
    """The CUDA architecture units are compiled for on `device` ('90' on an H100 or H200):
    TORCH_CUDA_ARCH_LIST's first where set, else the device's own."""
    if device not in _archs:
        listed = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split()
        if listed:
            _archs[device] = listed[0].replace(".", "").replace("+PTX", "")
        else:
            import torch

            major, minor = torch.cuda.get_device_capability(device)
            _archs[device] = f"{major}{minor}"
    return _archs[device]


def load_unit(path):
    """The address of the unit at `path` (loaded once per process)."""
    path = str(path)
    address = _units.get(path)
    if address is None:
        address = _units[path] = load().load_unit(path)
    return address


def pool():
    """The threads that compile units in the background (MAX_JOBS, default: the cores)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=int(os.environ.get("MAX_JOBS") or os.cpu_count() or 4),
                                   thread_name_prefix="fusedopt_torch_compile")
    return _pool


_manifest = None


def prebuilt_units():
    """The units installed ahead of time (setup.py): manifest entries whose library digest is
    this one's, with their paths; none under FUSEDOPT_TORCH_PREBUILT=0."""
    global _manifest
    if _manifest is None:
        _manifest = []
        path = PREBUILT / "manifest.json"
        if os.environ.get("FUSEDOPT_TORCH_PREBUILT") != "0" and path.exists():
            manifest = json.loads(path.read_text())
            if manifest.get("library") == _build.library_digest():
                _manifest = [dict(u, path=str(PREBUILT / u["file"])) for u in manifest["units"]]
    return _manifest


class Provider:
    """What an engine asks for the unit of a (device, dtype, layout) it meets (csrc/engine.cpp's
    engine provider): an installed unit that covers it, else one compiled for exactly that
    (cached on disk, loaded once per process). `source(backend, only)` gives a unit's
    (name, source, words); `covers(entry)` says whether an installed unit serves it."""

    def __init__(self, source, covers=None):
        self._source = source
        self._covers = covers
        self._addresses = {}
        self._futures = {}
        self._lock = threading.Lock()

    def _target(self, device, dtype, layout, amp):
        backend = "host" if device < 0 else "cuda"
        archs = () if device < 0 else (arch_of(device),)
        return backend, archs, _codegen.Only(dtype, layout, bool(amp))

    def _path(self, backend, archs, only):
        if self._covers is not None:
            for entry in prebuilt_units():
                quantized = bool((only.layout or 0) & _codegen.LAYOUT_BITS["quantized"])
                if entry["backend"] == backend and all(a in entry.get("archs", []) for a in archs) and \
                        entry.get("dtype") in (None, only.dtype) and entry.get("quantized") in (None, quantized) \
                        and self._covers(entry):
                    return Path(entry["path"])
        name, source, words = self._source(backend, only)
        return _build.build_unit(name, source, backend, archs, what=words)

    def prefetch(self, device, dtype, layout=0, amp=False):
        """Starts compiling the unit of (device, dtype, layout, amp) in the background (the
        first step, while the core is built)."""
        target = self._target(device, dtype, layout, amp)
        with self._lock:
            if target not in self._futures:
                self._futures[target] = pool().submit(self._path, *target)

    def __call__(self, device, dtype, layout, float_states=0, amp=False):
        key = (device, dtype, layout, float_states, bool(amp))
        address = self._addresses.get(key)
        if address is None:
            target = self._target(device, dtype, layout, amp)
            with self._lock:
                future = self._futures.get(target)
            path = future.result() if future is not None else self._path(*target)
            address = self._addresses[key] = load_unit(path)
        return address


def _builtin_source(family):
    names = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad", "rmsprop": "RMSprop",
             "lamb": "LAMB", "lion": "Lion", "radam": "RAdam", "adamax": "Adamax", "adadelta": "Adadelta",
             "nadam": "NAdam"}

    def source(backend, only):
        words = f"{names[family]} ({_codegen.DTYPES[only.dtype]}, layout {only.layout}{', GradScaler' if only.amp else ''})"
        return f"{family}-{only.tag()}", _codegen.builtin_source(backend, [family], only), words

    return source


_providers = {}


def builtin_provider(family):
    """The provider of a built-in family's units (one per family, shared by its optimizers)."""
    if family not in _providers:
        _providers[family] = Provider(_builtin_source(family),
                                      covers=lambda e, f=family: e["kind"] == "plan" and f in e["families"])
    return _providers[family]


class _NormProvider(Provider):
    """Units of clip_grad_norm_'s norm plans (engine-less: `(device, dtype)`)."""

    def __init__(self):
        super().__init__(lambda backend, only: (f"norm-{_codegen.DTYPES[only.dtype]}",
                                                _codegen.norm_source(backend, only.dtype),
                                                f"gradient norm ({_codegen.DTYPES[only.dtype]})"),
                         covers=lambda e: e["kind"] == "norm")

    def __call__(self, device, dtype):
        return super().__call__(device, dtype, 0, 0, False)


_norm_provider = None


def norm_provider():
    global _norm_provider
    if _norm_provider is None:
        _norm_provider = _NormProvider()
    return _norm_provider


def support_unit():
    """The address of the host unit of 8-bit state conversions."""
    for entry in prebuilt_units():
        if entry["kind"] == "support":
            return load_unit(entry["path"])
    path = _build.build_unit("support", _codegen.support_source(), "host", what="8-bit state conversions")
    return load_unit(path)
