"""fusedopt_torch.Muon's unit without torch: the host muon unit (csrc/muon_unit.hpp, compiled
by _build.py into a temporary cache, called through _muon_unit.py's ctypes binding) against
torch.optim.Muon's algorithm computed here in double (docs/muon.md), with Newton-Schulz in
float; options read through pointers; gradients rebound; the library's errors as RuntimeError.

    python3 integrations/pytorch/tests/units/test_muon_unit.py   (CTest runs it: host_torch_muon_unit)
"""

import ctypes
import math
import random
import sys
import unittest
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fusedopt_torch"
sys.path.insert(0, str(PACKAGE))
import _muon_unit as mu  # noqa: E402
from unit_testing import UnitTestCase, address, floats  # noqa: E402

SHAPES = [(3, 5), (5, 3), (4, 4), (1, 1), (3, 5), (2, 7)]
SIZES = [r * c for r, c in SHAPES]
COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def matmul(x, y):
    return [[sum(x[i][k] * y[k][j] for k in range(len(y))) for j in range(len(y[0]))] for i in range(len(x))]


def transpose(x):
    return [list(r) for r in zip(*x)]


def orthogonalise(u, rows, cols, steps, schedule):
    """torch's _zeropower_via_newtonschulz in double (float NS is within 4e-6 of it)."""
    x = [u[r * cols:(r + 1) * cols] for r in range(rows)]
    if rows > cols:
        x = transpose(x)
    norm = max(math.sqrt(sum(v * v for row in x for v in row)), 1e-7)
    x = [[v / norm for v in row] for row in x]
    for i in range(steps):
        a, b, c = schedule[i]
        gram = matmul(x, transpose(x))
        gram2 = matmul(gram, gram)
        poly = [[b * gram[i][j] + c * gram2[i][j] for j in range(len(gram))] for i in range(len(gram))]
        bx = matmul(poly, x)
        x = [[a * x[i][j] + bx[i][j] for j in range(len(x[0]))] for i in range(len(x))]
    if rows > cols:
        x = transpose(x)
    return [v for row in x for v in row]


def reference_step(param, grad, buf, rows, cols, lr, wd, momentum, nesterov, steps, schedule, match_rms):
    buf[:] = [b + (g - b) * (1 - momentum) for b, g in zip(buf, grad)]
    u = [g + (b - g) * momentum for g, b in zip(grad, buf)] if nesterov else list(buf)
    o = orthogonalise(u, rows, cols, steps, schedule)
    ratio = 0.2 * math.sqrt(max(rows, cols)) if match_rms else math.sqrt(max(1.0, rows / cols))
    param[:] = [p * (1 - lr * wd) - lr * ratio * v for p, v in zip(param, o)]


class MuonUnit(UnitTestCase):
    @classmethod
    def make_units(cls):
        cls.unit = mu.unit("host", "float32", "float32")

    def tensors(self, seed):
        rng = random.Random(seed)
        make = lambda n, s: floats(rng.uniform(-s, s) for _ in range(n))  # noqa: E731
        params = [make(r * c, 1) for r, c in SHAPES]
        buffers = [make(r * c, 0.1) for r, c in SHAPES]
        return rng, params, buffers

    def check_steps(self, nesterov, match_rms, schedule=None, pointers=False):
        rng, params, buffers = self.tensors(1)
        grads = [floats(rng.uniform(-1, 1) for _ in range(r * c)) for r, c in SHAPES]
        exact = [[list(map(float, t)) for t in ts] for ts in (params, buffers)]
        plan = mu.Plan(self.unit, [address(p) for p in params], [address(g) for g in grads],
                       [address(b) for b in buffers], SIZES, SHAPES, threads=2)
        steps = 3 if schedule is None else len(schedule)
        per_iteration = schedule is not None
        table = (ctypes.c_double * (3 * steps))(*[v for k in (schedule or [COEFFICIENTS]) for v in k])
        values = (ctypes.c_double * 3)(0.02, 0.1, 0.9)  # lr, weight_decay, momentum through pointers
        hyper = mu.Hyper(lr=0.02, weight_decay=0.1, momentum=0.9, eps=1e-7, coefficients=ctypes.addressof(table),
                         per_iteration=int(per_iteration), ns_steps=steps, nesterov=int(nesterov),
                         match_rms_adamw=int(match_rms))
        if pointers:
            hyper.lr, hyper.weight_decay, hyper.momentum = -1.0, -1.0, -1.0  # must not be read
            base = ctypes.addressof(values)
            hyper.lr_pointer, hyper.weight_decay_pointer, hyper.momentum_pointer = base, base + 8, base + 16
        for step in range(3):
            # New gradient tensors every step (zero_grad(set_to_none=True)): rebound.
            grads = [floats(rng.uniform(-1, 1) for _ in range(r * c)) for r, c in SHAPES]
            plan.rebind_grads([address(g) for g in grads])
            plan.run(hyper)
            for t, (r, c) in enumerate(SHAPES):
                reference_step(exact[0][t], list(map(float, grads[t])), exact[1][t], r, c, 0.02, 0.1, 0.9, nesterov,
                               steps, schedule or [COEFFICIENTS] * steps, match_rms)
                for got, want in zip(buffers[t], exact[1][t]):
                    self.assertAlmostEqual(got, want, delta=1e-6 * (1 + abs(want)))
                for got, want in zip(params[t], exact[0][t]):
                    self.assertAlmostEqual(got, want, delta=2e-5 * (1 + step))
                o = (ctypes.c_float * (r * c)).from_address(plan.matrix(t))
                self.assertTrue(all(math.isfinite(v) for v in o))
        plan.close()

    def test_against_torch_algorithm(self):
        for nesterov in (True, False):
            for match_rms in (False, True):
                with self.subTest(nesterov=nesterov, match_rms=match_rms):
                    self.check_steps(nesterov, match_rms)

    def test_pointers_and_schedule(self):
        schedule = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037)]
        self.check_steps(True, False, schedule=schedule, pointers=True)

    def test_errors(self):
        _, params, buffers = self.tensors(2)
        grads = [floats([0.0] * (r * c)) for r, c in SHAPES]
        lists = ([address(p) for p in params], [address(g) for g in grads], [address(b) for b in buffers])
        with self.assertRaisesRegex(RuntimeError, "tensor 0 has 15 elements, not 4 x 5"):
            mu.Plan(self.unit, *lists, SIZES, [(r + 1, c) for r, c in SHAPES])
        plan = mu.Plan(self.unit, *lists, SIZES, SHAPES)
        before = [list(p) for p in params]
        table = (ctypes.c_double * 3)(*COEFFICIENTS)
        hyper = mu.Hyper(lr=-1.0, weight_decay=0.1, momentum=0.9, eps=1e-7, coefficients=ctypes.addressof(table),
                         ns_steps=5, nesterov=1)
        with self.assertRaisesRegex(RuntimeError, "lr"):
            plan.run(hyper)
        hyper.lr, hyper.ns_steps = 0.1, 100
        with self.assertRaisesRegex(RuntimeError, "ns_steps"):
            plan.run(hyper)
        self.assertEqual([list(p) for p in params], before)
        error = ctypes.create_string_buffer(256)  # the unit checks the count of gradients itself
        self.assertEqual(self.unit.lib.fusedopt_muon_rebind_grads(plan.handle, plan._grads, 2, None, error, 256), 1)
        self.assertIn(b"number of gradients", error.value)
        with self.assertRaisesRegex(ValueError, "dtype"):
            mu.source("host", "int8", "float32")


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
