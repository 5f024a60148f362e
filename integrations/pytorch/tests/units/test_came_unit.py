"""fusedopt_torch.CAME's unit without torch: the host came unit (csrc/came_unit.hpp, compiled by
_build.py into a temporary cache, called through _came_unit.py's ctypes binding) over buffers
(the array module's) laid out as CAME.py's state (exp_avg of the parameter's shape; exp_avg_sq_row and
exp_avg_res_row of shape[:-1], exp_avg_sq_col and exp_avg_res_col of shape[:-2] + shape[-1:];
exp_avg_sq of the parameter's shape below two dimensions) against yangluo7/CAME's
`came_pytorch/CAME.py` read here in float64 (Python's floats; no numpy on the CI machine).

Each step starts the reference from the values the unit holds (teacher forcing), so that every
comparison measures one step's roundoff: R > C over several row tiles, R < C over several column
tiles, a 3-D batch, a matrix crossing the 64 x 64 tiles, a vector and a scalar; 5 steps with new
(rebound) gradients, step 3's ten times larger; the clipping active (CAME.py's defaults clip at
every step: RMS(grad / sqrt((1 - beta2) grad^2)) ~ 31) and not (clip_threshold 1e9); weight
decay on and off; float32, float64 and bfloat16 parameters (exp_avg and the statistics in float32
for bfloat16, as CAME.py keeps them after upcasting the gradient); lr through a pointer (0
included: the statistics move, the parameters do not); the library's errors as RuntimeError with
nothing written.

Tolerances (relative to each tensor's largest magnitude): the statistics and exp_avg within
TOLERANCE of the state type's unit roundoff times a few dozen operations (a fold, a mean read back
rounded, rsqrt, the clipping's division); the parameters' increment likewise, plus the store's
rounding of the new parameter in its own dtype. The worst measured are printed.

    python3 integrations/pytorch/tests/units/test_came_unit.py   (CTest: host_torch_came_unit)
"""

import array
import ctypes
import math
import random
import sys
import unittest
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fusedopt_torch"
sys.path.insert(0, str(PACKAGE))
import _came_unit as cu  # noqa: E402
from unit_testing import UnitTestCase, address, worst  # noqa: E402

SHAPES = [(130, 3), (3, 130), (2, 5, 9), (67, 65), (7,), ()]
STEPS = 5
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float64": 2.0 ** -53}
STORE = {"float32": 2.0 ** -24, "float64": 2.0 ** -53, "bfloat16": 2.0 ** -8}  # a parameter's store
TOLERANCE = 64  # unit roundoffs of the state type, of each tensor's largest magnitude

# (options, whether the update is clipped at some step)
DEFAULTS = dict(lr=1e-3, eps=(1e-30, 1e-16), clip_threshold=1.0, betas=(0.9, 0.999, 0.9999), weight_decay=0.0)
OPTIONS = {"defaults": (DEFAULTS, True),
           "decay": (dict(lr=0.05, eps=(1e-20, 1e-10), clip_threshold=0.5, betas=(0.8, 0.99, 0.999),
                          weight_decay=0.1), True),
           "unclipped": (dict(DEFAULTS, lr=0.01, clip_threshold=1e9), False)}


def elements(shape):
    return math.prod(shape)


def to_bfloat16(values):
    """bfloat16's bits (array 'H') of `values` rounded to nearest even, through float32."""
    bits = array.array("I", array.array("f", values).tobytes())
    return array.array("H", [(b + 0x7FFF + ((b >> 16) & 1)) >> 16 for b in bits])


def from_bfloat16(bits):
    return list(array.array("f", array.array("I", [b << 16 for b in bits]).tobytes()))


class Storage:
    """A parameter dtype's buffers (the array module's): `make(values)` stores float64 values,
    `read(buffer)` gives them back as Python floats; `state(n)` a zero buffer of the state's
    dtype."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.state_code = "d" if cu.STATE_DTYPES[dtype] == "float64" else "f"

    def make(self, values):
        if self.dtype == "bfloat16":
            return to_bfloat16(values)
        return array.array("f" if self.dtype == "float32" else "d", values)

    def read(self, buffer):
        return from_bfloat16(buffer) if self.dtype == "bfloat16" else list(buffer)

    def state(self, n):
        return array.array(self.state_code, [0.0] * n)


def geometry(shape):
    """(matrices, R, C) of a tensor of two or more dimensions."""
    rows, cols = shape[-2], shape[-1]
    return elements(shape) // (rows * cols), rows, cols


def means(x, shape):
    """x.mean(dim=-1) and x.mean(dim=-2), flat."""
    matrices, rows, cols = geometry(shape)
    row_means, col_means = [], []
    for m in range(matrices):
        base = m * rows * cols
        row_means += [sum(x[base + r * cols:base + (r + 1) * cols]) / cols for r in range(rows)]
        col_means += [sum(x[base + r * cols + c] for r in range(rows)) / rows for c in range(cols)]
    return row_means, col_means


def approximation(row, col, shape):
    """CAME.py's _approx_sq_grad: rsqrt(row / mean(row)) (unsqueezed) times rsqrt(col), flat."""
    matrices, rows, cols = geometry(shape)
    out = []
    for m in range(matrices):
        mean = sum(row[m * rows:(m + 1) * rows]) / rows
        for r in range(rows):
            factor = 1.0 / math.sqrt(row[m * rows + r] / mean)
            out += [factor * (1.0 / math.sqrt(col[m * cols + c])) for c in range(cols)]
    return out


def average(stat, value, beta):
    """stat.mul_(beta).add_(value, alpha=1 - beta)."""
    return [s * beta + (1.0 - beta) * v for s, v in zip(stat, value)]


def rms(x):
    return math.sqrt(sum(v * v for v in x)) / math.sqrt(len(x))


def reference_step(p, grad, st, shape, o):
    """One tensor's CAME.step in float64 (flat lists): the new parameter; `st` (CAME.py's state
    names) updated; whether the update was clipped."""
    eps1, eps2 = o["eps"]
    beta1, beta2, beta3 = o["betas"]
    factored = len(shape) >= 2
    update = [g * g + eps1 for g in grad]
    if factored:
        row_means, col_means = means(update, shape)
        st["exp_avg_sq_row"] = average(st["exp_avg_sq_row"], row_means, beta2)
        st["exp_avg_sq_col"] = average(st["exp_avg_sq_col"], col_means, beta2)
        update = [a * g for a, g in zip(approximation(st["exp_avg_sq_row"], st["exp_avg_sq_col"], shape), grad)]
    else:
        st["exp_avg_sq"] = average(st["exp_avg_sq"], update, beta2)
        update = [1.0 / math.sqrt(s) * g for s, g in zip(st["exp_avg_sq"], grad)]
    divisor = max(rms(update) / o["clip_threshold"], 1.0)
    update = [u / divisor for u in update]
    st["exp_avg"] = average(st["exp_avg"], update, beta1)
    res = [(u - m) ** 2 + eps2 for u, m in zip(update, st["exp_avg"])]
    if factored:
        row_means, col_means = means(res, shape)
        st["exp_avg_res_row"] = average(st["exp_avg_res_row"], row_means, beta3)
        st["exp_avg_res_col"] = average(st["exp_avg_res_col"], col_means, beta3)
        update = [a * m for a, m in zip(approximation(st["exp_avg_res_row"], st["exp_avg_res_col"], shape),
                                        st["exp_avg"])]
    else:
        update = list(st["exp_avg"])
    if o["weight_decay"] != 0:
        p = [x + x * (-o["weight_decay"] * o["lr"]) for x in p]
    return [x - u * o["lr"] for x, u in zip(p, update)], divisor > 1.0


def state_sizes(shape):
    """CAME.py's state for a parameter of `shape`: each name's number of elements (exp_avg of
    the shape; the rows of shape[:-1], the columns of shape[:-2] + shape[-1:])."""
    n = elements(shape)
    if len(shape) >= 2:
        row, col = n // shape[-1], n // shape[-2]
        return {"exp_avg": n, "exp_avg_sq_row": row, "exp_avg_sq_col": col, "exp_avg_res_row": row,
                "exp_avg_res_col": col}
    return {"exp_avg": n, "exp_avg_sq": n}


def hyper_of(o, lr_pointer=None):
    hyper = cu.Hyper(lr=o["lr"], eps1=o["eps"][0], eps2=o["eps"][1], clip_threshold=o["clip_threshold"],
                     beta1=o["betas"][0], beta2=o["betas"][1], beta3=o["betas"][2], weight_decay=o["weight_decay"])
    if lr_pointer is not None:
        hyper.lr, hyper.lr_pointer = -1.0, lr_pointer  # the value must not be read
    return hyper


def address_of(buffer):
    return address(buffer) if buffer is not None else None


class Tensors:
    """Parameters, CAME.py's initial (zero) state and a plan over them, for one dtype."""

    def __init__(self, unit, storage, seed, shapes=SHAPES):
        self.storage, self.shapes = storage, shapes
        self.rng = random.Random(seed)
        self.params = [storage.make([self.rng.uniform(-1, 1) for _ in range(elements(s))]) for s in shapes]
        self.states = [{k: storage.state(n) for k, n in state_sizes(s).items()} for s in shapes]
        self.grads = [storage.make([0.0] * elements(s)) for s in shapes]
        sts = self.states
        self.plan = cu.Plan(unit, [address(p) for p in self.params], [address(g) for g in self.grads],
                            [address(st["exp_avg"]) for st in sts], [elements(s) for s in shapes], shapes,
                            [address_of(st.get("exp_avg_sq_row", st.get("exp_avg_sq"))) for st in sts],
                            [address_of(st.get("exp_avg_sq_col")) for st in sts],
                            [address_of(st.get("exp_avg_res_row")) for st in sts],
                            [address_of(st.get("exp_avg_res_col")) for st in sts], threads=2)

    def new_grads(self, scale):
        """New gradient buffers (zero_grad(set_to_none=True)'s), rebound into the plan."""
        self.grads = [self.storage.make([self.rng.uniform(-scale, scale) for _ in range(elements(s))])
                      for s in self.shapes]
        self.plan.rebind_grads([address(g) for g in self.grads])

    def snapshot(self):
        """Everything the unit holds, as Python floats."""
        return ([self.storage.read(p) for p in self.params], [{k: list(v) for k, v in st.items()} for st in self.states])


class CAMEUnit(UnitTestCase):
    @classmethod
    def make_units(cls):
        cls.units = {dtype: cu.unit("host", dtype) for dtype in ("float32", "float64", "bfloat16")}

    def check_steps(self, dtype, o, lr_pointer=False):
        """STEPS steps of the unit, each against the reference from the unit's values; the worst
        differences (parameters' increments, state) and whether any update was clipped."""
        storage = Storage(dtype)
        tensors = Tensors(self.units[dtype], storage, seed=1)
        roundoff = UNIT_ROUNDOFF[cu.STATE_DTYPES[dtype]]
        lr_value = (ctypes.c_double * 1)(o["lr"])
        measured, clipped = [0.0, 0.0], False
        for step in range(1, STEPS + 1):
            tensors.new_grads(10.0 if step == 3 else 1.0)
            params, states = tensors.snapshot()
            grads = [storage.read(g) for g in tensors.grads]
            tensors.plan.run(hyper_of(o, ctypes.addressof(lr_value) if lr_pointer else None))
            got_params, got_states = tensors.snapshot()
            for t, shape in enumerate(SHAPES):
                want, was_clipped = reference_step(params[t], grads[t], states[t], shape, o)
                clipped = clipped or was_clipped
                for key, value in states[t].items():
                    d = worst(got_states[t][key], value)
                    measured[1] = max(measured[1], d)
                    self.assertLessEqual(d, TOLERANCE * roundoff, (dtype, shape, step, key))
                # The increment, within the state type's roundoff, and the new value's store.
                scale = max(max(abs(w - x) for w, x in zip(want, params[t])), 1e-300)
                d = max(abs(g - w) - STORE[dtype] * abs(w) for g, w in zip(got_params[t], want)) / scale
                measured[0] = max(measured[0], d)
                self.assertLessEqual(d, TOLERANCE * roundoff, (dtype, shape, step, "param"))
        tensors.plan.close()
        return measured, clipped

    def test_against_came_py(self):
        for dtype in ("float32", "float64", "bfloat16"):
            for name, (o, clips) in OPTIONS.items():
                with self.subTest(dtype=dtype, options=name):
                    measured, clipped = self.check_steps(dtype, o)
                    self.assertEqual(clipped, clips)
                    roundoff = UNIT_ROUNDOFF[cu.STATE_DTYPES[dtype]]
                    print(f"\n  {dtype} {name}: parameters' increments within {measured[0] / roundoff:.1f}, state "
                          f"within {measured[1] / roundoff:.1f} unit roundoffs of each tensor's largest magnitude "
                          f"(bound {TOLERANCE})", end="", file=sys.stderr)

    def test_lr_through_a_pointer(self):
        self.check_steps("float32", dict(DEFAULTS, lr=0.05, weight_decay=0.1), lr_pointer=True)

    def test_lr_zero_through_a_pointer(self):
        # CAME.py steps whatever lr its group holds (a warmup's 0): the state moves, the parameters do not.
        tensors = Tensors(self.units["float32"], Storage("float32"), seed=3)
        lr_value = (ctypes.c_double * 1)(0.0)
        tensors.new_grads(1.0)
        params, _ = tensors.snapshot()
        tensors.plan.run(hyper_of(dict(DEFAULTS, weight_decay=0.1), ctypes.addressof(lr_value)))
        got_params, got_states = tensors.snapshot()
        for p, q, st in zip(params, got_params, got_states):
            self.assertEqual(p, q)
            self.assertTrue(all(x != 0 for v in st.values() for x in v))

    def test_errors(self):
        tensors = Tensors(self.units["float32"], Storage("float32"), seed=2)
        tensors.new_grads(1.0)
        before = tensors.snapshot()
        for options, message in ((dict(lr=0.0), "came: lr"), (dict(lr=-1.0), "came: lr"),
                                 (dict(betas=(1.5, 0.999, 0.9999)), "came: beta1"),
                                 (dict(betas=(0.9, -0.1, 0.9999)), "came: beta2"),
                                 (dict(betas=(0.9, 0.999, 1.01)), "came: beta3")):
            with self.subTest(**options), self.assertRaisesRegex(RuntimeError, message):
                tensors.plan.run(hyper_of(dict(DEFAULTS, **options)))
        after = tensors.snapshot()
        self.assertEqual(after, before)
        error = ctypes.create_string_buffer(256)  # the unit checks the count of gradients itself
        plan = tensors.plan
        self.assertEqual(self.units["float32"].lib.fusedopt_came_rebind_grads(plan.handle, plan._grads, 2, None, error,
                                                                              256), 1)
        self.assertIn(b"number of gradients", error.value)
        p, g, st = address(tensors.params[0]), address(tensors.grads[0]), tensors.states[0]
        rows, cols = address(st["exp_avg_sq_row"]), address(st["exp_avg_sq_col"])
        with self.assertRaisesRegex(RuntimeError, "tensor 0 has 389 elements, not the product"):
            cu.Plan(self.units["float32"], [p], [g], [address(st["exp_avg"])], [389], [(130, 3)],
                    [rows], [cols], [rows], [cols])
        with self.assertRaisesRegex(RuntimeError, "needs its statistics"):  # no exp_avg_res_col
            cu.Plan(self.units["float32"], [p], [g], [address(st["exp_avg"])], [390], [(130, 3)],
                    [rows], [cols], [rows], [None])
        with self.assertRaisesRegex(ValueError, "dtype"):
            cu.source("host", "int8")


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
