"""fusedopt_torch.Prodigy's unit without torch: the host prodigy unit (csrc/prodigy_unit.hpp, compiled
by _build.py into a temporary cache, called through _prodigy_unit.py's ctypes binding) over
float buffers laid out as the reference's state (s and p0 flattened, exp_avg and exp_avg_sq of
the parameter's shape: all contiguous, so one buffer of the element count each) against
konstmish/prodigy's Prodigy.step (prodigyopt/prodigy.py, one group, slice_p = 1) computed here in
double, step by step from the unit's own values (teacher forcing: each step's reference starts
from the unit's tensors and from the d, d_max and d_numerator read back through
fusedopt_prodigy_state, so the tolerances are those of one step): 3 steps over tensors of a few
sizes, with the defaults, with every option, and with beta1 = 0 (the unit without exp_avg); a
first step of zero gradients skipped as the reference skips it; set_state; the library's
errors as RuntimeError with nothing written.

    python3 integrations/pytorch/tests/units/test_prodigy_unit.py   (CTest: host_torch_prodigy_unit)
"""

import ctypes
import math
import random
import sys
import unittest
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fusedopt_torch"
sys.path.insert(0, str(PACKAGE))
import _prodigy_unit as pu  # noqa: E402
from unit_testing import UnitTestCase, address, floats, worst  # noqa: E402

SIZES = [24, 210, 30, 7, 1, 0]
# Each value is a few float roundings of its tensor's largest magnitude after one step (each of
# s, exp_avg, exp_avg_sq and the update takes two or three, coefficients rounded to float); d,
# d_max and d_numerator are double sums of float values, but d's denominator sums |s| of s
# rounded to float.
TENSOR_TOLERANCE = 16 * 2.0 ** -24
SCALAR_TOLERANCE = 1e-6

DEFAULTS = dict(lr=1.0, betas=(0.9, 0.999), beta3=None, eps=1e-8, weight_decay=0.0, decouple=True,
                use_bias_correction=False, safeguard_warmup=False, d0=1e-6, d_coef=1.0, growth_rate=math.inf)
OPTIONS = dict(DEFAULTS, lr=2.0, betas=(0.8, 0.99), beta3=0.9, weight_decay=0.1, use_bias_correction=True, d0=1e-6,
               d_coef=2.0, growth_rate=1.5)
BETA1_ZERO = dict(DEFAULTS, betas=(0.0, 0.99), eps=1e-6, weight_decay=0.1, decouple=False, safeguard_warmup=True,
                  d0=1e-3)


def reference_step(tensors, grads, scalars, k, o):
    """konstmish/prodigy's Prodigy.step in double over `tensors` (dicts of lists: p, s, p0, exp_avg,
    exp_avg_sq), in place, in its order of operations, from `scalars` (d, d_max, d_numerator)
    and its group['k']; the scalars after the step (unchanged where the reference returns
    early: the sum of |s| is 0)."""
    beta1, beta2 = o["betas"]
    beta3 = math.sqrt(beta2) if o["beta3"] is None else o["beta3"]
    d, d_max, d_numerator = scalars
    d0, decay = o["d0"], o["weight_decay"]
    bias_correction = ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1)) if o["use_bias_correction"] else 1
    dlr = d * o["lr"] * bias_correction
    d_numerator *= beta3
    delta_numerator = d_denom = 0.0
    decayed = []
    for t, grad in zip(tensors, grads):
        g = list(grad)
        if decay != 0 and not o["decouple"]:  # grad.add_(p, alpha=decay)
            g = [x + decay * p for x, p in zip(g, t["p"])]
        decayed.append(g)
        delta_numerator += (d / d0) * dlr * sum(x * (p0 - p) for x, p0, p in zip(g, t["p0"], t["p"]))
        if beta1 > 0:
            t["exp_avg"] = [m * beta1 + d * (1 - beta1) * x for m, x in zip(t["exp_avg"], g)]
        t["exp_avg_sq"] = [v * beta2 + d * d * (1 - beta2) * x * x for v, x in zip(t["exp_avg_sq"], g)]
        alpha = (d / d0) * d if o["safeguard_warmup"] else (d / d0) * dlr
        t["s"] = [s * beta3 + alpha * x for s, x in zip(t["s"], g)]
        d_denom += sum(abs(s) for s in t["s"])
    if d_denom == 0:
        return scalars
    global_d_numerator = d_numerator + delta_numerator
    d_hat = o["d_coef"] * global_d_numerator / d_denom
    if d == d0:
        d = max(d, d_hat)
    d_max = max(d_max, d_hat)
    d = min(d_max, d * o["growth_rate"])
    for t, g in zip(tensors, decayed):
        denom = [math.sqrt(v) + d * o["eps"] for v in t["exp_avg_sq"]]
        if decay != 0 and o["decouple"]:
            t["p"] = [p + p * (-decay * dlr) for p in t["p"]]
        if beta1 > 0:
            t["p"] = [p + (-dlr) * m / q for p, m, q in zip(t["p"], t["exp_avg"], denom)]
        else:
            t["p"] = [p + (-dlr * d) * x / q for p, x, q in zip(t["p"], g, denom)]
    return d, d_max, global_d_numerator


def relative(got, want):
    return abs(got - want) / max(abs(want), 1e-300)


def hyper_of(o, step):
    beta1, beta2 = o["betas"]
    return pu.Hyper(lr=o["lr"], beta1=beta1, beta2=beta2, beta3=-1.0 if o["beta3"] is None else o["beta3"],
                    eps=o["eps"], weight_decay=o["weight_decay"], d0=o["d0"], d_coef=o["d_coef"],
                    growth_rate=o["growth_rate"], step=step, decouple=int(o["decouple"]),
                    use_bias_correction=int(o["use_bias_correction"]), safeguard_warmup=int(o["safeguard_warmup"]))


class Tensors:
    """Parameters, a target, the reference's initial state (p0 = p, zeros) and a plan over them."""

    KEYS = ("p", "s", "p0", "exp_avg", "exp_avg_sq")

    def __init__(self, unit, with_exp_avg, seed):
        self.rng = random.Random(seed)
        self.with_exp_avg = with_exp_avg
        self.buffers = []
        for n in SIZES:
            p = floats(self.rng.uniform(-1, 1) for _ in range(n))
            zeros = lambda: floats([0.0] * n)  # noqa: E731
            self.buffers.append(dict(p=p, s=zeros(), p0=floats(p), exp_avg=zeros() if with_exp_avg else None,
                                     exp_avg_sq=zeros()))
        self.targets = [[self.rng.uniform(-1, 1) for _ in range(n)] for n in SIZES]
        self.grads = [floats([0.0] * n) for n in SIZES]
        column = lambda key: [address(b[key]) if b[key] is not None else None for b in self.buffers]  # noqa: E731
        self.plan = pu.Plan(unit, column("p"), [address(g) for g in self.grads], column("p0"), column("s"),
                            column("exp_avg"), column("exp_avg_sq"), SIZES, threads=2)

    def new_grads(self, zero=False):
        """New gradient buffers (zero_grad(set_to_none=True)'s), rebound: those of a noisy
        quadratic, 0.5 |p - target|^2, whose descent makes d grow."""
        self.grads = [floats(0.0 if zero else p - target + self.rng.uniform(-0.1, 0.1) for p, target in zip(b["p"], ts))
                      for b, ts in zip(self.buffers, self.targets)]
        self.plan.rebind_grads([address(g) for g in self.grads])

    def values(self):
        """The unit's tensors in double, as the reference's starting point."""
        return [{key: list(map(float, b[key])) for key in self.KEYS if b[key] is not None} for b in self.buffers]

    def snapshot(self):
        return [[list(b[key]) for key in self.KEYS if b[key] is not None] for b in self.buffers]


class ProdigyUnit(UnitTestCase):
    @classmethod
    def make_units(cls):
        cls.units = {True: pu.unit("host", "float32"), False: pu.unit("host", "float32", with_exp_avg=False)}

    def tensors(self, o, seed=1):
        return Tensors(self.units[o["betas"][0] > 0], o["betas"][0] > 0, seed)

    def check_step(self, tensors, o, step, scalars, zero_grads=False):
        """One step of the unit against the reference from the unit's values and `scalars`;
        the scalars the unit then holds, and the worst differences (tensors, scalars)."""
        tensors.new_grads(zero_grads)
        want = tensors.values()
        want_scalars = reference_step(want, [list(map(float, g)) for g in tensors.grads], scalars, step - 1, o)
        tensors.plan.run(hyper_of(o, step))
        got_scalars = tensors.plan.state()
        measured = [0.0, 0.0]
        for b, w in zip(tensors.buffers, want):
            for key, values in w.items():
                measured[0] = max(measured[0], worst(b[key], values))
                self.assertLessEqual(worst(b[key], values), TENSOR_TOLERANCE, (len(values), key, step))
        for name, got, expected in zip(("d", "d_max", "d_numerator"), got_scalars, want_scalars):
            measured[1] = max(measured[1], relative(got, expected))
            self.assertLessEqual(relative(got, expected), SCALAR_TOLERANCE, (name, step, got, expected))
        return got_scalars, measured

    def check_steps(self, o):
        tensors = self.tensors(o)
        scalars = (o["d0"], o["d0"], 0.0)  # the reference's group['d'], ['d_max'], ['d_numerator'] at k = 0
        measured = [0.0, 0.0]
        ds = []
        for step in range(1, 4):
            scalars, m = self.check_step(tensors, o, step, scalars)
            measured = [max(a, b) for a, b in zip(measured, m)]
            ds.append(scalars[0])
        tensors.plan.close()
        return measured, ds

    def report(self, label, measured, ds):
        print(f"\n  {label}: tensors within {measured[0]:.2e} of each one's largest magnitude, d, d_max, "
              f"d_numerator within {measured[1]:.2e}; d {', '.join(f'{d:.3e}' for d in ds)}", file=sys.stderr)

    def test_defaults_against_reference(self):
        measured, ds = self.check_steps(DEFAULTS)
        self.assertEqual(ds[0], DEFAULTS["d0"])  # the first step's numerator is 0: d stays d0
        self.assertGreater(ds[2], ds[1])
        self.report("defaults", measured, ds)

    def test_options_against_reference(self):
        # beta3 given, decoupled decay, bias correction, d_coef and a finite growth rate, which
        # caps step 3's d.
        measured, ds = self.check_steps(OPTIONS)
        self.assertLessEqual(relative(ds[2], ds[1] * OPTIONS["growth_rate"]), 1e-15)
        self.report("options", measured, ds)

    def test_beta1_zero_against_reference(self):
        # The unit without exp_avg; coupled decay; safeguard_warmup.
        measured, ds = self.check_steps(BETA1_ZERO)
        self.report("beta1 = 0", measured, ds)

    def test_zero_first_gradients_are_skipped(self):
        tensors = self.tensors(DEFAULTS, seed=2)
        before = [list(b["p"]) for b in tensors.buffers]
        scalars, _ = self.check_step(tensors, DEFAULTS, 1, (1e-6, 1e-6, 0.0), zero_grads=True)
        self.assertEqual([list(b["p"]) for b in tensors.buffers], before)
        self.assertEqual(scalars, (1e-6, 1e-6, 0.0))  # stored although the first step does not read them
        self.check_step(tensors, DEFAULTS, 2, scalars)

    def test_step_read_through_a_pointer(self):
        # step_pointer (capturable=True's count in backend memory) gives the bits of the same
        # step passed by value; bias correction on, so that the step's value matters.
        by_value, by_pointer = self.tensors(OPTIONS, seed=6), self.tensors(OPTIONS, seed=6)
        count = ctypes.c_int64(0)
        for step in range(1, 4):
            by_value.new_grads()
            by_pointer.new_grads()
            by_value.plan.run(hyper_of(OPTIONS, step))
            count.value = step
            hyper = hyper_of(OPTIONS, 999)  # ignored where the pointer is set
            hyper.step_pointer = ctypes.addressof(count)
            by_pointer.plan.run(hyper)
            self.assertEqual(by_pointer.snapshot(), by_value.snapshot(), step)
            self.assertEqual(by_pointer.plan.state(), by_value.plan.state(), step)

    def test_set_state_resumes(self):
        tensors = self.tensors(OPTIONS, seed=3)
        loaded = (2e-3, 3e-3, 0.25)
        tensors.plan.set_state(*loaded)
        self.assertEqual(tensors.plan.state(), loaded)
        # Step 2 reads the state it was given (step 1 would start from d0); p0 = p at the start.
        self.check_step(tensors, OPTIONS, 2, loaded)

    def test_errors(self):
        tensors = self.tensors(DEFAULTS, seed=4)
        tensors.new_grads()
        before = tensors.snapshot()
        for options, message in ((dict(lr=0.0), "prodigy: lr"), (dict(d0=0.0), "prodigy: d0"),
                                 (dict(eps=0.0), "prodigy: eps"), (dict(betas=(0.9, 1.0)), "prodigy: beta2"),
                                 (dict(betas=(1.0, 0.999)), "prodigy: beta1"), (dict(beta3=1.0), "prodigy: beta3"),
                                 (dict(weight_decay=-0.1), "prodigy: weight_decay")):
            with self.subTest(**options), self.assertRaisesRegex(RuntimeError, message):
                tensors.plan.run(hyper_of(dict(DEFAULTS, **options), 2))
        with self.assertRaisesRegex(RuntimeError, "step"):
            tensors.plan.run(hyper_of(DEFAULTS, 0))  # steps are 1-based
        self.assertEqual(tensors.snapshot(), before)
        without = self.tensors(BETA1_ZERO, seed=5)
        with self.assertRaisesRegex(RuntimeError, "needs slot 'exp_avg'"):
            without.plan.run(hyper_of(DEFAULTS, 1))
        error = ctypes.create_string_buffer(256)  # the unit checks the count of gradients itself
        plan = tensors.plan
        self.assertEqual(self.units[True].lib.fusedopt_prodigy_rebind_grads(plan.handle, plan._grads, 2, None, error,
                                                                            256), 1)
        self.assertIn(b"number of gradients", error.value)
        with self.assertRaisesRegex(ValueError, "dtype"):
            pu.source("host", "int8")


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
