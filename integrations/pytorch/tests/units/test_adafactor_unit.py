"""fusedopt_torch.Adafactor's unit without torch: the host adafactor unit (csrc/adafactor_unit.hpp,
compiled by _build.py into a temporary cache, called through _adafactor_unit.py's ctypes
binding) over float buffers laid out as torch's state (row_var (..., R, 1) and col_var
(..., 1, C) are (..., R) and (..., C) in memory; variance for fewer than two dimensions)
against torch.optim.Adafactor's algorithm (`_single_tensor_adafactor`, torch 2.11) computed here
in double: a 2-D (one crossing the factored pass's 64-column tiles), a 3-D, a 1-D and a 0-D
tensor, 3 steps; options through pointers; gradients rebound; the library's errors as
RuntimeError with nothing written.

    python3 integrations/pytorch/tests/units/test_adafactor_unit.py   (CTest: host_torch_adafactor_unit)
"""

import ctypes
import math
import random
import sys
import unittest
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fusedopt_torch"
sys.path.insert(0, str(PACKAGE))
import _adafactor_unit as au  # noqa: E402
from unit_testing import UnitTestCase, address, floats, worst  # noqa: E402

SHAPES = [(4, 6), (3, 70), (2, 3, 5), (7,), ()]
FLOAT_EPS = 2.0 ** -23  # torch.finfo(torch.float32).eps: eps1's None


def elements(shape):
    return math.prod(shape)


def row_count(shape):
    """Elements of row_var (or of variance, below two dimensions)."""
    return elements(shape) // shape[-1] if len(shape) >= 2 else elements(shape)


def col_count(shape):
    return elements(shape) // shape[-2] if len(shape) >= 2 else 0


def lerp(start, end, weight):
    """torch's lerp (its switch of formula at weight 0.5)."""
    return start + weight * (end - start) if abs(weight) < 0.5 else end - (end - start) * (1 - weight)


def reference_step(param, grad, row, col, shape, t, o):
    """One tensor's step of torch's `_single_tensor_adafactor` in double, in place."""
    n = len(param)
    g = [-x for x in grad] if o["maximize"] else list(grad)
    eps1 = FLOAT_EPS if o["eps1"] is None else o["eps1"]
    one_minus_beta2 = float(t) ** o["beta2_decay"]
    rho = min(o["lr"], 1 / math.sqrt(t))
    alpha = max(o["eps2"], math.sqrt(sum(x * x for x in param)) / math.sqrt(n)) * rho
    if o["weight_decay"] != 0:
        param[:] = [x * (1 - o["lr"] * o["weight_decay"]) for x in param]
    if len(shape) >= 2:
        rows, cols = shape[-2], shape[-1]
        v = [0.0] * n
        for m in range(n // (rows * cols)):
            at = lambda r, c: (m * rows + r) * cols + c  # noqa: E731
            for r in range(rows):
                row[m * rows + r] = lerp(row[m * rows + r], sum(g[at(r, c)] ** 2 for c in range(cols)) / cols,
                                         one_minus_beta2)
            for c in range(cols):
                col[m * cols + c] = lerp(col[m * cols + c], sum(g[at(r, c)] ** 2 for r in range(rows)) / rows,
                                         one_minus_beta2)
            mean = max(sum(row[m * rows:(m + 1) * rows]) / rows, eps1)
            for r in range(rows):
                for c in range(cols):
                    v[at(r, c)] = row[m * rows + r] * col[m * cols + c] / mean
    else:
        row[:] = [lerp(s, x * x, one_minus_beta2) for s, x in zip(row, g)]
        v = list(row)
    update = [x / math.sqrt(max(s, eps1 * eps1)) for s, x in zip(v, g)]
    denom = max(1.0, math.sqrt(sum(u * u for u in update)) / (math.sqrt(n) * o["d"]))
    param[:] = [x - alpha / denom * u for x, u in zip(param, update)]


DEFAULTS = dict(lr=1e-2, beta2_decay=-0.8, eps1=None, eps2=1e-3, d=1.0, weight_decay=0.0, maximize=False)


def hyper_of(o, step):
    return au.Hyper(lr=o["lr"], beta2_decay=o["beta2_decay"], eps1=-1.0 if o["eps1"] is None else o["eps1"],
                    eps2=o["eps2"], d=o["d"], weight_decay=o["weight_decay"], step=step, maximize=int(o["maximize"]))


class AdafactorUnit(UnitTestCase):
    @classmethod
    def make_units(cls):
        cls.unit = au.unit("host", "float32")

    def tensors(self, seed):
        """Parameters, zero statistics (torch's initial state) and the plan over them."""
        rng = random.Random(seed)
        params = [floats(rng.uniform(-1, 1) for _ in range(elements(s))) for s in SHAPES]
        rows = [floats([0.0] * row_count(s)) for s in SHAPES]
        cols = [floats([0.0] * col_count(s)) if len(s) >= 2 else None for s in SHAPES]
        grads = [floats([0.0] * elements(s)) for s in SHAPES]
        plan = au.Plan(self.unit, [address(p) for p in params], [address(g) for g in grads],
                       [elements(s) for s in SHAPES], SHAPES, [address(r) for r in rows],
                       [address(c) if c is not None else None for c in cols], threads=2)
        return rng, params, rows, cols, plan

    def check_steps(self, o, pointers=False):
        rng, params, rows, cols, plan = self.tensors(1)
        exact = [[list(map(float, t)) for t in ts] for ts in (params, rows)]
        exact_cols = [list(map(float, c)) if c is not None else [] for c in cols]
        lr_value = (ctypes.c_double * 1)(o["lr"])
        step_value = (ctypes.c_int64 * 1)(0)
        measured = [0.0, 0.0]  # parameters, statistics
        for step in range(1, 4):
            # New gradient tensors every step (zero_grad(set_to_none=True)): rebound. Step 3's
            # are ten times larger, so that the update's clipping and eps2 move.
            scale = 10.0 if step == 3 else 1.0
            grads = [floats(rng.uniform(-scale, scale) for _ in range(elements(s))) for s in SHAPES]
            plan.rebind_grads([address(g) for g in grads])
            hyper = hyper_of(o, step)
            if pointers:
                hyper.lr, hyper.step = -1.0, 0  # must not be read
                step_value[0] = step
                hyper.lr_pointer, hyper.step_pointer = ctypes.addressof(lr_value), ctypes.addressof(step_value)
            plan.run(hyper)
            for t, shape in enumerate(SHAPES):
                reference_step(exact[0][t], list(map(float, grads[t])), exact[1][t], exact_cols[t], shape, step, o)
                stats = [(rows[t], exact[1][t])] + ([(cols[t], exact_cols[t])] if cols[t] is not None else [])
                for got, want in stats:
                    measured[1] = max(measured[1], worst(got, want))
                    # Stored in float after a fold in float: a few roundings of the tensor's largest.
                    self.assertLessEqual(worst(got, want), 1e-6, (shape, step))
                measured[0] = max(measured[0], worst(params[t], exact[0][t]))
                # The update reads the stored (rounded) statistics: a few roundings of the step.
                self.assertLessEqual(worst(params[t], exact[0][t]), 2e-6 * step, (shape, step))
        plan.close()
        return measured

    def test_defaults_against_torch_algorithm(self):
        measured = self.check_steps(DEFAULTS)
        print(f"\n  defaults: parameters within {measured[0]:.2e}, statistics within {measured[1]:.2e} "
              "of each tensor's largest magnitude", file=sys.stderr)

    def test_options_against_torch_algorithm(self):
        # lr 0.6: rho_t = 1 / sqrt(3) at step 3; decay, maximize, eps1 given, d above 1.
        o = dict(DEFAULTS, lr=0.6, beta2_decay=-0.5, eps1=1e-3, eps2=1e-2, d=1.5, weight_decay=0.1, maximize=True)
        measured = self.check_steps(o)
        print(f"\n  options: parameters within {measured[0]:.2e}, statistics within {measured[1]:.2e}",
              file=sys.stderr)

    def test_pointers(self):
        self.check_steps(dict(DEFAULTS, lr=0.05, weight_decay=0.1), pointers=True)

    def test_errors(self):
        _, params, rows, cols, plan = self.tensors(2)
        snapshot = lambda: [list(t) for t in params + rows] + [list(c) for c in cols if c is not None]  # noqa: E731
        before = snapshot()
        for options, message in ((dict(beta2_decay=0.5), "adafactor: beta2_decay"), (dict(d=0.5), "adafactor: d"),
                                 (dict(lr=-1.0), "adafactor: lr"), (dict(eps2=-1.0), "adafactor: eps2"),
                                 (dict(weight_decay=-0.1), "adafactor: weight_decay"),
                                 (dict(eps1=float("nan")), "adafactor: eps1")):
            with self.subTest(**options), self.assertRaisesRegex(RuntimeError, message):
                plan.run(hyper_of(dict(DEFAULTS, **options), 1))
        with self.assertRaisesRegex(RuntimeError, "step"):
            plan.run(hyper_of(DEFAULTS, 0))  # steps are 1-based
        self.assertEqual(snapshot(), before)
        error = ctypes.create_string_buffer(256)  # the unit checks the count of gradients itself
        self.assertEqual(self.unit.lib.fusedopt_adafactor_rebind_grads(plan.handle, plan._grads, 2, None, error, 256), 1)
        self.assertIn(b"number of gradients", error.value)
        with self.assertRaisesRegex(RuntimeError, "tensor 0 has 25 elements, not the product"):
            au.Plan(self.unit, [address(params[0])], [address(params[1])], [25], [(4, 6)], [address(rows[0])],
                    [address(cols[0])])
        with self.assertRaisesRegex(RuntimeError, "needs its statistics"):
            au.Plan(self.unit, [address(params[0])], [address(params[1])], [24], [(4, 6)], [address(rows[0])], [None])
        with self.assertRaisesRegex(ValueError, "dtype"):
            au.source("host", "int8")


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
