"""The prodigy unit (csrc/prodigy_unit.hpp): its source, its compile (through _build, into the same
cache as every unit) and its ctypes binding (_c_unit.py), with the two entry points of its own
that read and set the plan's d, d_max and d_numerator. No torch here, so the host unit is
testable without torch (tests/units/test_prodigy_unit.py).

One unit per backend, element dtype and whether exp_avg is bound (beta1 > 0: the reference
creates no exp_avg with beta1 = 0): the parameters, gradients and their state share the dtype,
as the reference keeps s, p0, exp_avg and exp_avg_sq in the parameter's."""
import ctypes

try:  # as part of the package, or run as a file (tests/units, CMake) without importing torch
    from . import _c_unit
except ImportError:  # pragma: no cover
    import _c_unit  # type: ignore


def source(backend: str, dtype: str, with_exp_avg: bool = True) -> str:
    """The unit's source: csrc/prodigy_unit.hpp for one backend, element dtype and binding of exp_avg."""
    return _c_unit.unit_source("prodigy", "Prodigy", backend, dtype, EXP_AVG=1 if with_exp_avg else 0)


class Hyper(ctypes.Structure):
    """csrc/prodigy_unit.hpp's fusedopt_prodigy_hyper, field for field. beta3 < 0 is the
    reference's None (sqrt(beta2)); step is the reference's group['k'] + 1, or, where
    step_pointer is set (backend memory: an int64), read there when the step runs."""

    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("beta3", ctypes.c_double), ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("d0", ctypes.c_double), ("d_coef", ctypes.c_double), ("growth_rate", ctypes.c_double),
                ("step", ctypes.c_int64), ("decouple", ctypes.c_int32), ("use_bias_correction", ctypes.c_int32),
                ("safeguard_warmup", ctypes.c_int32), ("step_pointer", ctypes.c_void_p)]


_MAKE_ARGTYPES = [_c_unit.POINTERS, _c_unit.POINTERS, _c_unit.POINTERS, _c_unit.POINTERS, _c_unit.POINTERS,
                  _c_unit.POINTERS, _c_unit.INT64S, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p,
                  ctypes.c_size_t]
_STATE_ARGTYPES = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_double), ctypes.c_void_p, ctypes.c_char_p,
                   ctypes.c_size_t]


class Plan(_c_unit.Plan):
    """A prodigy plan of `unit` over tensors given by addresses: params, grads and their state
    p0s, ss, exp_avgs (ignored by a unit without exp_avg: None each) and exp_avg_sqs, `sizes[t]`
    elements each. `threads` for the host (0: OpenMP's default), `stream` for CUDA (built on the
    current device, which the caller sets). The plan owns d, d_max and d_numerator (device
    memory for CUDA): `state()` reads them, `set_state()` sets them."""

    def __init__(self, unit, params, grads, p0s, ss, exp_avgs, exp_avg_sqs, sizes, threads=0, stream=0):
        super().__init__(unit, grads)
        self._scalars = (ctypes.c_double * 3)()
        array = _c_unit.array
        self._made(array(ctypes.c_void_p, params), self._grads, array(ctypes.c_void_p, p0s),
                   array(ctypes.c_void_p, ss), array(ctypes.c_void_p, exp_avgs), array(ctypes.c_void_p, exp_avg_sqs),
                   array(ctypes.c_int64, sizes), self.count, threads, stream)

    def state(self, stream=0):
        """(d, d_max, d_numerator) after the steps enqueued on `stream` (CUDA: synchronises it)."""
        if self.unit.lib.fusedopt_prodigy_state(self.handle, self._scalars, stream, self._error, _c_unit.ERROR_SIZE):
            self._raise()
        return tuple(self._scalars)

    def set_state(self, d, d_max, d_numerator, stream=0):
        """Sets (d, d_max, d_numerator), in `stream`'s order, for the steps run after it."""
        self._scalars[:] = (d, d_max, d_numerator)
        if self.unit.lib.fusedopt_prodigy_set_state(self.handle, self._scalars, stream, self._error,
                                                    _c_unit.ERROR_SIZE):
            self._raise()


def unit(backend: str, dtype: str, with_exp_avg: bool = True, archs=()):
    """The prodigy unit for (backend, dtype, with_exp_avg, archs), compiled into the cache on first use."""
    name = f"prodigy_{dtype}" if with_exp_avg else f"prodigy_{dtype}_beta1_0"
    loaded = _c_unit.load(("prodigy", backend, dtype, with_exp_avg, tuple(archs)), name,
                          source(backend, dtype, with_exp_avg), backend, archs,
                          f"Prodigy's step for {dtype} parameters", Hyper, _MAKE_ARGTYPES)
    for entry in (loaded.lib.fusedopt_prodigy_state, loaded.lib.fusedopt_prodigy_set_state):
        entry.restype = ctypes.c_int
        entry.argtypes = _STATE_ARGTYPES
    return loaded
