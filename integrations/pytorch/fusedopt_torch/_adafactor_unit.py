"""The adafactor unit (csrc/adafactor_unit.hpp): its source, its compile (through _build, into the
same cache as every unit) and its ctypes binding (_c_unit.py). No torch here, so the host unit is
testable without torch (tests/units/test_adafactor_unit.py).

One unit per backend and element dtype: the parameters, gradients and statistics share it, as
torch keeps row_var, col_var and variance in the gradient's dtype."""
import ctypes

try:  # as part of the package, or run as a file (tests/units, CMake) without importing torch
    from . import _c_unit
except ImportError:  # pragma: no cover
    import _c_unit  # type: ignore


def source(backend: str, dtype: str) -> str:
    """The unit's source: csrc/adafactor_unit.hpp for one backend and element dtype."""
    return _c_unit.unit_source("adafactor", "Adafactor", backend, dtype)


class Hyper(ctypes.Structure):
    """csrc/adafactor_unit.hpp's fusedopt_adafactor_hyper, field for field. eps1 < 0 is torch's
    None (finfo of the unit's dtype); a non-null pointer (backend memory: a double for lr, an
    int64 for the 1-based step) replaces its value and is read when the step runs."""

    _fields_ = [("lr", ctypes.c_double), ("beta2_decay", ctypes.c_double), ("eps1", ctypes.c_double),
                ("eps2", ctypes.c_double), ("d", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("lr_pointer", ctypes.c_void_p), ("step", ctypes.c_int64), ("step_pointer", ctypes.c_void_p),
                ("maximize", ctypes.c_int32)]


_MAKE_ARGTYPES = [_c_unit.POINTERS, _c_unit.POINTERS, _c_unit.INT64S, _c_unit.INT64S, _c_unit.INT64S,
                  _c_unit.POINTERS, _c_unit.POINTERS, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                  ctypes.c_char_p, ctypes.c_size_t]


class Plan(_c_unit.Plan):
    """An adafactor plan of `unit` over tensors given by addresses (params, grads), element
    counts (`sizes`), torch shapes (`shapes`: tuples, () for a 0-D tensor) and the addresses of
    their statistics: `rows` (row_var, or variance below two dimensions) and `cols` (col_var;
    None below two dimensions). `threads` for the host (0: OpenMP's default), `stream` for CUDA
    (built on the current device, which the caller sets). The plan owns the statistics' table
    and the factored pass's workspace."""

    def __init__(self, unit, params, grads, sizes, shapes, rows, cols, threads=0, stream=0):
        super().__init__(unit, grads)
        array = _c_unit.array
        self._made(array(ctypes.c_void_p, params), self._grads, array(ctypes.c_int64, sizes),
                   array(ctypes.c_int64, [d for shape in shapes for d in shape]),
                   array(ctypes.c_int64, [len(shape) for shape in shapes]), array(ctypes.c_void_p, rows),
                   array(ctypes.c_void_p, cols), self.count, threads, stream)


def unit(backend: str, dtype: str, archs=()):
    """The adafactor unit for (backend, dtype, archs), compiled into the cache on first use."""
    return _c_unit.load(("adafactor", backend, dtype, tuple(archs)), f"adafactor_{dtype}", source(backend, dtype),
                        backend, archs, f"Adafactor's step for {dtype} parameters", Hyper, _MAKE_ARGTYPES)
