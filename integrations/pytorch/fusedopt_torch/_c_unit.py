"""What the units called through ctypes share (_muon_unit.py, _adafactor_unit.py; csrc/c_unit.hpp
on the C++ side): the element types, loading a unit's entry points, a plan's handle with its
error buffer, and one loaded unit per key. No torch here: tensors are addresses, the stream a
``cudaStream_t`` as an int.

A unit named ``fusedopt_<name>`` exports ``fusedopt_<name>_make`` (its own arguments),
``_run(plan, hyper*, stream, error, size)``, ``_rebind_grads(plan, grads, n, stream, error, size)``
and ``_destroy(plan)``."""
import ctypes
import threading

try:  # as part of the package, or run as a file (tests/units, CMake) without importing torch
    from . import _build
except ImportError:  # pragma: no cover
    import _build  # type: ignore

ELEMENT_TYPES = {"float32": "float", "float64": "double", "float16": "::fusedopt::half",
                 "bfloat16": "::fusedopt::bfloat16"}
ERROR_SIZE = 2048
POINTERS = ctypes.POINTER(ctypes.c_void_p)
INT64S = ctypes.POINTER(ctypes.c_int64)


def unit_source(name, optimizer, backend, dtype, **defines):
    """csrc/<name>_unit.hpp's source for one backend and parameter dtype: FUSEDOPT_<NAME>_UNIT_CUDA,
    FUSEDOPT_<NAME>_UNIT_T and each of `defines` as FUSEDOPT_<NAME>_UNIT_<KEY>, in that order. A
    dtype the units do not compile is a ValueError naming `optimizer`."""
    if dtype not in ELEMENT_TYPES:
        raise ValueError(f"fusedopt_torch.{optimizer}: parameters of dtype {dtype} are not supported "
                         f"(supported: {', '.join(ELEMENT_TYPES)})")
    prefix = f"FUSEDOPT_{name.upper()}_UNIT"
    values = dict(CUDA=1 if backend == "cuda" else 0, T=ELEMENT_TYPES[dtype], **defines)
    return "".join(f"#define {prefix}_{key} {value}\n" for key, value in values.items()) + f'#include "{name}_unit.hpp"\n'


def array(kind, values):
    """A ctypes array of `values` (one element at least: a valid address when empty)."""
    return (kind * max(1, len(values)))(*values)


class Unit:
    """A loaded unit: its `lib` with the entry points' signatures set (`make_argtypes` for its make)."""

    def __init__(self, path, name, hyper, make_argtypes):
        lib = ctypes.CDLL(str(path))
        self.make = getattr(lib, f"fusedopt_{name}_make")
        self.make.restype = ctypes.c_void_p
        self.make.argtypes = make_argtypes
        self.run = getattr(lib, f"fusedopt_{name}_run")
        self.run.restype = ctypes.c_int
        self.run.argtypes = [ctypes.c_void_p, ctypes.POINTER(hyper), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        self.rebind_grads = getattr(lib, f"fusedopt_{name}_rebind_grads")
        self.rebind_grads.restype = ctypes.c_int
        self.rebind_grads.argtypes = [ctypes.c_void_p, POINTERS, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p,
                                      ctypes.c_size_t]
        self.destroy = getattr(lib, f"fusedopt_{name}_destroy")
        self.destroy.restype = None
        self.destroy.argtypes = [ctypes.c_void_p]
        self.lib = lib
        self.path = path


class Plan:
    """A plan of a unit: `make(*args, error, ERROR_SIZE)` is called by the subclass through
    `_made`; run, rebind_grads and close are common. Raises RuntimeError with the library's
    message when the library refuses something."""

    def __init__(self, unit, grads):
        self.unit = unit
        self.count = len(grads)
        self._grads = array(ctypes.c_void_p, grads)  # reused by rebind_grads: no allocation per step
        self._error = ctypes.create_string_buffer(ERROR_SIZE)
        self.handle = None

    def _made(self, *args):
        self.handle = self.unit.make(*args, self._error, ERROR_SIZE)
        if not self.handle:
            self._raise()

    def _raise(self):
        raise RuntimeError(self._error.value.decode(errors="replace"))

    def run(self, hyper, stream=0):
        if self.unit.run(self.handle, ctypes.byref(hyper), stream, self._error, ERROR_SIZE):
            self._raise()

    def rebind_grads(self, grads, stream=0):
        for t, g in enumerate(grads):
            self._grads[t] = g
        if self.unit.rebind_grads(self.handle, self._grads, self.count, stream, self._error, ERROR_SIZE):
            self._raise()

    def close(self):
        if getattr(self, "handle", None):
            self.unit.destroy(self.handle)
            self.handle = None

    def __del__(self):
        self.close()


_lock = threading.Lock()
_loaded = {}


def load(key, name, source, backend, archs, what, hyper, make_argtypes, libs=()):
    """The unit of `source` (one per key), compiled into the cache on first use and loaded once."""
    with _lock:
        found = _loaded.get(key)
    if found is not None:
        return found
    path = _build.build_unit(name, source, backend, archs, what=what, libs=libs)
    loaded = Unit(path, key[0], hyper, make_argtypes)
    with _lock:
        return _loaded.setdefault(key, loaded)
