"""The muon unit (csrc/muon_unit.hpp): its source, its compile (through _build, into the same
cache as every unit) and its ctypes binding (_c_unit.py). No torch here, so the host unit is
testable without torch (tests/units/test_muon_unit.py).

One unit per backend, element dtype and Newton-Schulz dtype: a CUDA unit links cuBLAS and cuBLASLt
from the toolkit that compiles it (the library's ``fusedopt::cublas``)."""
import ctypes

try:  # as part of the package, or run as a file (tests/units) without importing torch
    from . import _c_unit
except ImportError:  # pragma: no cover
    import _c_unit  # type: ignore

NS_TYPES = {"bfloat16": "::fusedopt::bfloat16", "float32": "float"}


def source(backend: str, dtype: str, ns: str) -> str:
    """The unit's source: csrc/muon_unit.hpp for one backend, element dtype and NS dtype."""
    if ns not in NS_TYPES:
        raise ValueError(f"fusedopt_torch.Muon: ns_dtype must be bfloat16 or float32, not {ns}")
    return _c_unit.unit_source("muon", "Muon", backend, dtype, NS=NS_TYPES[ns])


class Hyper(ctypes.Structure):
    """csrc/muon_unit.hpp's fusedopt_muon_hyper, field for field."""

    _fields_ = [("lr", ctypes.c_double), ("weight_decay", ctypes.c_double), ("momentum", ctypes.c_double),
                ("eps", ctypes.c_double), ("lr_pointer", ctypes.c_void_p), ("weight_decay_pointer", ctypes.c_void_p),
                ("momentum_pointer", ctypes.c_void_p), ("coefficients", ctypes.c_void_p),
                ("per_iteration", ctypes.c_int32), ("ns_steps", ctypes.c_int32), ("nesterov", ctypes.c_int32),
                ("match_rms_adamw", ctypes.c_int32)]


_MAKE_ARGTYPES = [_c_unit.POINTERS, _c_unit.POINTERS, _c_unit.POINTERS, _c_unit.INT64S, _c_unit.INT64S,
                  _c_unit.INT64S, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]


class Plan(_c_unit.Plan):
    """A muon plan of `unit` over matrices given by addresses (params, grads, buffers), element
    counts (`sizes`) and shapes [(rows, cols)]; `threads` for the host (0: OpenMP's default),
    `stream` for CUDA (built on the current device, which the caller sets)."""

    def __init__(self, unit, params, grads, buffers, sizes, shapes, threads=0, stream=0):
        super().__init__(unit, grads)
        array = _c_unit.array
        self._made(array(ctypes.c_void_p, params), self._grads, array(ctypes.c_void_p, buffers),
                   array(ctypes.c_int64, sizes), array(ctypes.c_int64, [r for r, _ in shapes]),
                   array(ctypes.c_int64, [c for _, c in shapes]), self.count, threads, stream)

    def matrix(self, t):
        """The address of matrix t in the plan's workspace (the update O of the last step, in NS)."""
        return self.unit.lib.fusedopt_muon_matrix(self.handle, t)


def unit(backend: str, dtype: str, ns: str, archs=()):
    """The muon unit for (backend, dtype, ns, archs), compiled into the cache on first use."""
    loaded = _c_unit.load(("muon", backend, dtype, ns, tuple(archs)), f"muon_{dtype}_{ns}", source(backend, dtype, ns),
                          backend, archs, f"Muon's step for {dtype} parameters, Newton-Schulz in {ns}", Hyper,
                          _MAKE_ARGTYPES, ("-lcublas", "-lcublasLt") if backend == "cuda" else ())
    loaded.lib.fusedopt_muon_matrix.restype = ctypes.c_void_p
    loaded.lib.fusedopt_muon_matrix.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    return loaded
