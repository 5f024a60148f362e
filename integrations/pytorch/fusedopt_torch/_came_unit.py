"""The came unit (csrc/came_unit.hpp): its source, its compile (through _build, into the same cache
as every unit) and its ctypes binding (_c_unit.py). No torch here, so the host unit is testable
without torch (tests/units/test_came_unit.py).

One unit per backend and parameter dtype: the parameters and gradients are of that dtype,
exp_avg and the statistics of its arithmetic type (float32 for float32, float16 and bfloat16,
float64 for float64), as yangluo7/CAME's CAME.py creates its state from the gradient upcast to
float."""
import ctypes

try:  # as part of the package, or run as a file (tests/units, CMake) without importing torch
    from . import _c_unit
except ImportError:  # pragma: no cover
    import _c_unit  # type: ignore

# The dtype of exp_avg and of the statistics, per parameter dtype.
STATE_DTYPES = {"float32": "float32", "float64": "float64", "float16": "float32", "bfloat16": "float32"}


def source(backend: str, dtype: str) -> str:
    """The unit's source: csrc/came_unit.hpp for one backend and parameter dtype."""
    return _c_unit.unit_source("came", "CAME", backend, dtype)


class Hyper(ctypes.Structure):
    """csrc/came_unit.hpp's fusedopt_came_hyper, field for field: CAME.py's options, eps and betas
    unpacked. A non-null lr_pointer (backend memory: a double) replaces lr and is read when the
    step runs."""

    _fields_ = [("lr", ctypes.c_double), ("eps1", ctypes.c_double), ("eps2", ctypes.c_double),
                ("clip_threshold", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("beta3", ctypes.c_double), ("weight_decay", ctypes.c_double), ("lr_pointer", ctypes.c_void_p)]


_MAKE_ARGTYPES = [_c_unit.POINTERS, _c_unit.POINTERS, _c_unit.POINTERS, _c_unit.INT64S, _c_unit.INT64S,
                  _c_unit.INT64S, _c_unit.POINTERS, _c_unit.POINTERS, _c_unit.POINTERS, _c_unit.POINTERS,
                  ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]


class Plan(_c_unit.Plan):
    """A came plan of `unit` over tensors given by addresses (params, grads, exp_avgs), element
    counts (`sizes`), torch shapes (`shapes`: tuples, () for a 0-D tensor) and the addresses of
    their statistics: `sq_rows` (exp_avg_sq_row, or exp_avg_sq below two dimensions),
    `sq_cols` (exp_avg_sq_col), `res_rows` and `res_cols` (exp_avg_res_row and _col); the last
    three None below two dimensions. `threads` for the host (0: OpenMP's default), `stream` for
    CUDA (built on the current device, which the caller sets). The plan owns the statistics'
    tables and the factored passes' workspaces."""

    def __init__(self, unit, params, grads, exp_avgs, sizes, shapes, sq_rows, sq_cols, res_rows, res_cols, threads=0,
                 stream=0):
        super().__init__(unit, grads)
        array = _c_unit.array
        pointers = lambda values: array(ctypes.c_void_p, values)  # noqa: E731
        self._made(pointers(params), self._grads, pointers(exp_avgs), array(ctypes.c_int64, sizes),
                   array(ctypes.c_int64, [d for shape in shapes for d in shape]),
                   array(ctypes.c_int64, [len(shape) for shape in shapes]), pointers(sq_rows), pointers(sq_cols),
                   pointers(res_rows), pointers(res_cols), self.count, threads, stream)


def unit(backend: str, dtype: str, archs=()):
    """The came unit for (backend, dtype, archs), compiled into the cache on first use."""
    return _c_unit.load(("came", backend, dtype, tuple(archs)), f"came_{dtype}", source(backend, dtype), backend,
                        archs, f"CAME's step for {dtype} parameters", Hyper, _MAKE_ARGTYPES)
