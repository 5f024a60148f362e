"""The adafactor unit (csrc/adafactor_unit.hpp): its source, its compile (through _build, into the
same cache as every unit) and its ctypes binding. No torch here: tensors are addresses, the
stream a ``cudaStream_t`` as an int, so the host unit is testable without torch (tests/units).

One unit per backend and element dtype: the parameters, gradients and statistics share it, as
torch keeps row_var, col_var and variance in the gradient's dtype."""
import ctypes
import threading

try:  # as part of the package, or run as a file (tests/units, CMake) without importing torch
    from . import _build
except ImportError:  # pragma: no cover
    import _build  # type: ignore

ELEMENT_TYPES = {"float32": "float", "float64": "double", "float16": "::fusedopt::half",
                 "bfloat16": "::fusedopt::bfloat16"}


def source(backend: str, dtype: str) -> str:
    """The unit's source: csrc/adafactor_unit.hpp for one backend and element dtype."""
    if dtype not in ELEMENT_TYPES:
        raise ValueError(f"fusedopt_torch.Adafactor: parameters of dtype {dtype} are not supported "
                         f"(supported: {', '.join(ELEMENT_TYPES)})")
    return (f"#define FUSEDOPT_ADAFACTOR_UNIT_CUDA {1 if backend == 'cuda' else 0}\n"
            f"#define FUSEDOPT_ADAFACTOR_UNIT_T {ELEMENT_TYPES[dtype]}\n"
            '#include "adafactor_unit.hpp"\n')


class Hyper(ctypes.Structure):
    """csrc/adafactor_unit.hpp's fusedopt_adafactor_hyper, field for field. eps1 < 0 is torch's
    None (finfo of the unit's dtype); a non-null pointer (backend memory: a double for lr, an
    int64 for the 1-based step) replaces its value and is read when the step runs."""

    _fields_ = [("lr", ctypes.c_double), ("beta2_decay", ctypes.c_double), ("eps1", ctypes.c_double),
                ("eps2", ctypes.c_double), ("d", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("lr_pointer", ctypes.c_void_p), ("step", ctypes.c_int64), ("step_pointer", ctypes.c_void_p),
                ("maximize", ctypes.c_int32)]


_ERROR_SIZE = 2048
_pointers = ctypes.POINTER(ctypes.c_void_p)
_int64s = ctypes.POINTER(ctypes.c_int64)


class Unit:
    """A loaded adafactor unit (its four entry points)."""

    def __init__(self, path):
        lib = ctypes.CDLL(str(path))
        lib.fusedopt_adafactor_make.restype = ctypes.c_void_p
        lib.fusedopt_adafactor_make.argtypes = [_pointers, _pointers, _int64s, _int64s, _int64s, _pointers, _pointers,
                                                ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p,
                                                ctypes.c_size_t]
        lib.fusedopt_adafactor_run.restype = ctypes.c_int
        lib.fusedopt_adafactor_run.argtypes = [ctypes.c_void_p, ctypes.POINTER(Hyper), ctypes.c_void_p,
                                               ctypes.c_char_p, ctypes.c_size_t]
        lib.fusedopt_adafactor_rebind_grads.restype = ctypes.c_int
        lib.fusedopt_adafactor_rebind_grads.argtypes = [ctypes.c_void_p, _pointers, ctypes.c_int64, ctypes.c_void_p,
                                                        ctypes.c_char_p, ctypes.c_size_t]
        lib.fusedopt_adafactor_destroy.restype = None
        lib.fusedopt_adafactor_destroy.argtypes = [ctypes.c_void_p]
        self.lib = lib
        self.path = path


def _array(kind, values):
    return (kind * max(1, len(values)))(*values)


class Plan:
    """An adafactor plan of `unit` over tensors given by addresses (params, grads), element
    counts (`sizes`), torch shapes (`shapes`: tuples, () for a 0-D tensor) and the addresses of
    their statistics: `rows` (row_var, or variance below two dimensions) and `cols` (col_var;
    None below two dimensions). `threads` for the host (0: OpenMP's default), `stream` for CUDA
    (built on the current device, which the caller sets). The plan owns the statistics' table
    and the factored pass's workspace. Raises RuntimeError with the library's message when the
    library refuses it."""

    def __init__(self, unit, params, grads, sizes, shapes, rows, cols, threads=0, stream=0):
        self.unit = unit
        self.count = len(params)
        self._grads = _array(ctypes.c_void_p, grads)  # reused by rebind_grads: no allocation per step
        dims = _array(ctypes.c_int64, [d for shape in shapes for d in shape])
        ndims = _array(ctypes.c_int64, [len(shape) for shape in shapes])
        error = ctypes.create_string_buffer(_ERROR_SIZE)
        self.handle = unit.lib.fusedopt_adafactor_make(_array(ctypes.c_void_p, params), self._grads,
                                                        _array(ctypes.c_int64, sizes), dims, ndims,
                                                        _array(ctypes.c_void_p, rows), _array(ctypes.c_void_p, cols),
                                                        self.count, threads, stream, error, _ERROR_SIZE)
        if not self.handle:
            raise RuntimeError(error.value.decode(errors="replace"))
        self._error = error

    def run(self, hyper, stream=0):
        if self.unit.lib.fusedopt_adafactor_run(self.handle, ctypes.byref(hyper), stream, self._error, _ERROR_SIZE):
            raise RuntimeError(self._error.value.decode(errors="replace"))

    def rebind_grads(self, grads, stream=0):
        for t, g in enumerate(grads):
            self._grads[t] = g
        if self.unit.lib.fusedopt_adafactor_rebind_grads(self.handle, self._grads, self.count, stream, self._error,
                                                          _ERROR_SIZE):
            raise RuntimeError(self._error.value.decode(errors="replace"))

    def close(self):
        if getattr(self, "handle", None):
            self.unit.lib.fusedopt_adafactor_destroy(self.handle)
            self.handle = None

    def __del__(self):
        self.close()


_lock = threading.Lock()
_loaded = {}


def unit(backend: str, dtype: str, archs=()) -> Unit:
    """The adafactor unit for (backend, dtype, archs), compiled into the cache on first use."""
    key = (backend, dtype, tuple(archs))
    with _lock:
        found = _loaded.get(key)
    if found is not None:
        return found
    path = _build.build_unit(f"adafactor_{dtype}", source(backend, dtype), backend, archs,
                             what=f"Adafactor's step for {dtype} parameters")
    loaded = Unit(path)
    with _lock:
        return _loaded.setdefault(key, loaded)
