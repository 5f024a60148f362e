"""The muon unit (csrc/muon_unit.hpp): its source, its compile (through _build, into the same
cache as every unit) and its ctypes binding. No torch here: tensors are addresses, the stream a
``cudaStream_t`` as an int, so the host unit is testable without torch (tests/python).

One unit per backend, element dtype and Newton-Schulz dtype: a CUDA unit links cuBLAS and cuBLASLt
from the toolkit that compiles it (the library's ``fusedopt::cublas``)."""
import ctypes
import threading

try:  # as part of the package, or run as a file (tests/python) without importing torch
    from . import _build
except ImportError:  # pragma: no cover
    import _build  # type: ignore

ELEMENT_TYPES = {"float32": "float", "float64": "double", "float16": "::fusedopt::half",
                 "bfloat16": "::fusedopt::bfloat16"}
NS_TYPES = {"bfloat16": "::fusedopt::bfloat16", "float32": "float"}


def source(backend: str, dtype: str, ns: str) -> str:
    """The unit's source: csrc/muon_unit.hpp for one backend, element dtype and NS dtype."""
    if dtype not in ELEMENT_TYPES:
        raise ValueError(f"fusedopt_torch.Muon: parameters of dtype {dtype} are not supported "
                         f"(supported: {', '.join(ELEMENT_TYPES)})")
    if ns not in NS_TYPES:
        raise ValueError(f"fusedopt_torch.Muon: ns_dtype must be bfloat16 or float32, not {ns}")
    return (f"#define FUSEDOPT_MUON_UNIT_CUDA {1 if backend == 'cuda' else 0}\n"
            f"#define FUSEDOPT_MUON_UNIT_T {ELEMENT_TYPES[dtype]}\n"
            f"#define FUSEDOPT_MUON_UNIT_NS {NS_TYPES[ns]}\n"
            '#include "muon_unit.hpp"\n')


class Hyper(ctypes.Structure):
    """csrc/muon_unit.hpp's fusedopt_muon_hyper, field for field."""

    _fields_ = [("lr", ctypes.c_double), ("weight_decay", ctypes.c_double), ("momentum", ctypes.c_double),
                ("eps", ctypes.c_double), ("lr_pointer", ctypes.c_void_p), ("weight_decay_pointer", ctypes.c_void_p),
                ("momentum_pointer", ctypes.c_void_p), ("coefficients", ctypes.c_void_p),
                ("per_iteration", ctypes.c_int32), ("ns_steps", ctypes.c_int32), ("nesterov", ctypes.c_int32),
                ("match_rms_adamw", ctypes.c_int32)]


_ERROR_SIZE = 2048
_pointers = ctypes.POINTER(ctypes.c_void_p)
_sizes = ctypes.POINTER(ctypes.c_int64)


class Unit:
    """A loaded muon unit (its five entry points)."""

    def __init__(self, path):
        lib = ctypes.CDLL(str(path))
        lib.fusedopt_muon_make.restype = ctypes.c_void_p
        lib.fusedopt_muon_make.argtypes = [_pointers, _pointers, _pointers, _sizes, _sizes, _sizes, ctypes.c_int64,
                                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.fusedopt_muon_run.restype = ctypes.c_int
        lib.fusedopt_muon_run.argtypes = [ctypes.c_void_p, ctypes.POINTER(Hyper), ctypes.c_void_p, ctypes.c_char_p,
                                          ctypes.c_size_t]
        lib.fusedopt_muon_rebind_grads.restype = ctypes.c_int
        lib.fusedopt_muon_rebind_grads.argtypes = [ctypes.c_void_p, _pointers, ctypes.c_int64, ctypes.c_void_p,
                                                   ctypes.c_char_p, ctypes.c_size_t]
        lib.fusedopt_muon_matrix.restype = ctypes.c_void_p
        lib.fusedopt_muon_matrix.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib.fusedopt_muon_destroy.restype = None
        lib.fusedopt_muon_destroy.argtypes = [ctypes.c_void_p]
        self.lib = lib
        self.path = path


def _array(kind, values):
    return (kind * max(1, len(values)))(*values)


class Plan:
    """A muon plan of `unit` over matrices given by addresses (params, grads, buffers), element
    counts (`sizes`) and shapes [(rows, cols)]; `threads` for the host (0: OpenMP's default), `stream` for CUDA
    (built on the current device, which the caller sets). Raises RuntimeError with the
    library's message when the library refuses it."""

    def __init__(self, unit, params, grads, buffers, sizes, shapes, threads=0, stream=0):
        self.unit = unit
        self.count = len(params)
        self._grads = _array(ctypes.c_void_p, grads)  # reused by rebind_grads: no allocation per step
        rows = _array(ctypes.c_int64, [r for r, _ in shapes])
        cols = _array(ctypes.c_int64, [c for _, c in shapes])
        error = ctypes.create_string_buffer(_ERROR_SIZE)
        self.handle = unit.lib.fusedopt_muon_make(_array(ctypes.c_void_p, params), self._grads,
                                                   _array(ctypes.c_void_p, buffers), _array(ctypes.c_int64, sizes),
                                                   rows, cols, self.count, threads,
                                                   stream, error, _ERROR_SIZE)
        if not self.handle:
            raise RuntimeError(error.value.decode(errors="replace"))
        self._error = error

    def run(self, hyper, stream=0):
        if self.unit.lib.fusedopt_muon_run(self.handle, ctypes.byref(hyper), stream, self._error, _ERROR_SIZE):
            raise RuntimeError(self._error.value.decode(errors="replace"))

    def rebind_grads(self, grads, stream=0):
        for t, g in enumerate(grads):
            self._grads[t] = g
        if self.unit.lib.fusedopt_muon_rebind_grads(self.handle, self._grads, self.count, stream, self._error,
                                                     _ERROR_SIZE):
            raise RuntimeError(self._error.value.decode(errors="replace"))

    def matrix(self, t):
        """The address of matrix t in the plan's workspace (the update O of the last step, in NS)."""
        return self.unit.lib.fusedopt_muon_matrix(self.handle, t)

    def close(self):
        if getattr(self, "handle", None):
            self.unit.lib.fusedopt_muon_destroy(self.handle)
            self.handle = None

    def __del__(self):
        self.close()


_lock = threading.Lock()
_loaded = {}


def unit(backend: str, dtype: str, ns: str, archs=()) -> Unit:
    """The muon unit for (backend, dtype, ns, archs), compiled into the cache on first use."""
    key = (backend, dtype, ns, tuple(archs))
    with _lock:
        found = _loaded.get(key)
    if found is not None:
        return found
    libs = ("-lcublas", "-lcublasLt") if backend == "cuda" else ()
    path = _build.build_unit(f"muon_{dtype}_{ns}", source(backend, dtype, ns), backend, archs,
                             what=f"Muon's step for {dtype} parameters, Newton-Schulz in {ns}", libs=libs)
    loaded = Unit(path)
    with _lock:
        return _loaded.setdefault(key, loaded)
