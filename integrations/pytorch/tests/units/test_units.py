"""fusedopt_torch's units without torch: generated sources compile, user rules give the bits of
the built-in rules they restate, reductions and dtype policies work, compiler errors are told in
the user's own lines, and the cache compiles a unit once (across processes too) and keeps no
entry of a failed compile.

    python3 integrations/pytorch/tests/units/test_units.py HARNESS   (CTest runs it: host_units)

HARNESS is the unit_harness executable (unit_harness.cpp). Host units only: CUDA units are
checked by the PyTorch suite on a GPU machine (run-gpu).
"""

import array
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fusedopt_torch"
sys.path.insert(0, str(PACKAGE))
import _build  # noqa: E402
import _codegen as cg  # noqa: E402

HARNESS = None
SIZES = [1, 3, 16, 17, 255, 1000, 4097]
ADAMW, FLOAT32, FLOAT64 = 2, 0, 1
STEPS = 5

# AdamW restated as a user rule's body, in the library's order of operations (rules::adamw:
# decoupled decay, moments, bias corrections folded into two per-step constants): the same bits.
ADAMW_SPEC = dict(
    hypers=[cg.Hyper("lr", "float", 1e-3), cg.Hyper("beta1", "float", 0.9), cg.Hyper("beta2", "float", 0.999),
            cg.Hyper("eps", "float", 1e-8), cg.Hyper("weight_decay", "float", 1e-2)],
    states=[cg.State("exp_avg"), cg.State("exp_avg_sq")],
    constants=[("decay", "weight_decay != 0 ? 1 - lr * weight_decay : 1.0"),
               ("one_minus_beta1", "1 - beta1"), ("one_minus_beta2", "1 - beta2"),
               ("correction2", "sqrt(1 - pow(beta2, step))"),
               ("scaled_eps", "eps * correction2"),
               ("step_scale", "correction2 / (1 - pow(beta1, step))"),
               ("neg_lr", "-lr")],
    body=textwrap.dedent("""\
        param *= decay;
        exp_avg += one_minus_beta1 * (grad - exp_avg);
        exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad;
        param += exp_avg / (sqrt(exp_avg_sq) + scaled_eps) * step_scale * neg_lr;
    """))
HYPERS_NAMED = "lr=1e-3,beta1=0.9,beta2=0.999,eps=1e-8,weight_decay=0.01"
HYPERS_USER = "u0=1e-3,u1=0.9,u2=0.999,u3=1e-8,u4=0.01"


def run(unit, family, dtype, states, hypers, layout=0, float_states=0, steps=STEPS):
    with tempfile.NamedTemporaryFile(suffix=".bin") as out:
        subprocess.run([HARNESS, str(unit), str(family), str(dtype), str(layout), str(float_states), str(states),
                        str(steps), hypers, out.name], check=True)
        values = array.array("d")
        values.frombytes(Path(out.name).read_bytes())
    n = sum(SIZES)
    initial, grads = values[:n], [values[n + s * n:n + (s + 1) * n] for s in range(steps)]
    rest = values[n + steps * n:]
    final, state_values = rest[:n], [rest[n + k * n:n + (k + 1) * n] for k in range(states)]
    return initial, grads, final, state_values


def spec(name, **kwargs):
    s = cg.RuleSpec(name=name, **{**dict(hypers=[], states=[]), **kwargs})
    s.validate()
    return s


def user_unit(s, dtype=FLOAT32):
    return _build.build_unit(f"test-{s.name}", cg.rule_source(s, "host", cg.Only(dtype, 0, False)), "host")


class Units(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cache = tempfile.TemporaryDirectory()
        os.environ["FUSEDOPT_TORCH_CACHE"] = cls.cache.name
        os.environ["FUSEDOPT_TORCH_QUIET"] = "1"

    @classmethod
    def tearDownClass(cls):
        cls.cache.cleanup()

    def builtin(self, dtype):
        return _build.build_unit("test-adamw", cg.builtin_source("host", ["adamw"], cg.Only(dtype, 0, False)), "host")

    def test_user_adamw_has_the_builtin_bits(self):
        for dtype in (FLOAT32, FLOAT64):
            with self.subTest(dtype=dtype):
                builtin = run(self.builtin(dtype), ADAMW, dtype, 2, HYPERS_NAMED)
                user = run(user_unit(spec("AdamWBody", **ADAMW_SPEC), dtype), USER, dtype, 2, HYPERS_USER)
                self.assertEqual(builtin[0].tobytes(), user[0].tobytes())  # the same inputs
                self.assertEqual(builtin[2].tobytes(), user[2].tobytes(), "parameters differ")
                for k in range(2):
                    self.assertEqual(builtin[3][k].tobytes(), user[3][k].tobytes(), f"state {k} differs")
                self.assertNotEqual(builtin[0].tobytes(), builtin[2].tobytes())  # it did step

    def test_expression_rule_runs_library_blocks(self):
        s = spec("AdamWExpression", hypers=ADAMW_SPEC["hypers"], states=ADAMW_SPEC["states"],
                 expression="[&] { fo::rules::adamw r; r.lr = lr; r.beta1 = beta1; r.beta2 = beta2; r.eps = eps; "
                            "r.weight_decay = weight_decay; return r; }()")
        builtin = run(self.builtin(FLOAT32), ADAMW, FLOAT32, 2, HYPERS_NAMED)
        user = run(user_unit(s), USER, FLOAT32, 2, HYPERS_USER)
        self.assertEqual(builtin[2].tobytes(), user[2].tobytes())

    def test_reduction_per_tensor_and_total(self):
        # param -= lr * grad / sqrt(sum of grad^2 over its tensor) + (largest |grad| over all tensors) * 1e-3
        s = spec("Normalized", hypers=[cg.Hyper("lr", "float", 0.1)],
                 reductions=[cg.Reduce("grad_sq", "sum", "grad * grad"), cg.Reduce("grad_max", "max", "abs(grad)")],
                 body="param -= lr * grad / sqrt(grad_sq) + grad_max_total * T(1e-3);")
        initial, grads, final, _ = run(user_unit(s, FLOAT64), USER, FLOAT64, 0, "u0=0.1", steps=1)
        g = grads[0]
        start, expected = 0, []
        largest = max(abs(x) for x in g)
        for n in SIZES:
            norm = math.sqrt(sum(x * x for x in g[start:start + n]))
            expected += [p - (0.1 * x / norm + largest * 1e-3) for p, x in zip(initial[start:start + n], g[start:start + n])]
            start += n
        for k, (a, b) in enumerate(zip(final, expected)):
            self.assertAlmostEqual(a, b, delta=1e-12 * (1 + abs(b)), msg=f"element {k}")

    def test_float32_states_of_float64_parameters(self):
        s = spec("Ema", hypers=[cg.Hyper("beta", "float", 0.5)], states=[cg.State("ema", float32=True)],
                 body="ema = beta * ema + (1 - beta) * grad; param -= ema;")
        initial, grads, final, states = run(user_unit(s, FLOAT64), USER, FLOAT64, 1, "u0=0.5", float_states=1,
                                            steps=1)
        # The state is stored in float32 (0.5 * grad rounded once); the body computes in double,
        # so the parameter steps by the value before that rounding.
        for p0, g, p1, e in zip(initial, grads[0], final, states[0]):
            self.assertEqual(e, array.array("f", [0.5 * g])[0])
            self.assertEqual(p1, p0 - 0.5 * g)

    def test_errors_quote_the_users_lines(self):
        s = spec("Broken", hypers=[cg.Hyper("lr", "float", 0.1)],
                 body="param -= lr * grad;\nparam += undefined_name * lr;\n")
        with self.assertRaises(_build.BuildError) as caught:
            user_unit(s)
        message = cg.compile_error_message(s, caught.exception.log)
        self.assertIn("Broken body, line 2", message)
        self.assertIn("undefined_name", message)
        self.assertIn("param += undefined_name * lr;", message)
        # No broken entry is left in the cache: only the failed compile's log.
        entries = [p.name for p in Path(os.environ["FUSEDOPT_TORCH_CACHE"]).iterdir() if p.name.startswith("test-Broken")]
        self.assertTrue(all(n.endswith(".lock") for n in entries), entries)
        self.assertTrue(Path(caught.exception.log_path).exists())

    def test_unbound_slot_shows_the_librarys_static_assert(self):
        source = textwrap.dedent("""\
            struct uses_exp_avg {
              template <class E> FUSEDOPT_HOST_DEVICE void operator()(E& e, fo::step_info const&) const {
                e[fo::slot::param] -= e[fo::slot::exp_avg];
              }
            };
        """)
        s = spec("Unbound", source=source, expression="uses_exp_avg{}")
        with self.assertRaises(_build.BuildError) as caught:
            user_unit(s)
        message = cg.compile_error_message(s, caught.exception.log)
        self.assertIn("this rule uses a slot that is not bound", message)

    def test_invalid_specs_are_refused_before_compiling(self):
        for kwargs in (dict(body="param -= grad;", expression="x"), dict(),
                       dict(body="", hypers=[cg.Hyper("grad", "float", 1.0)]),
                       dict(body="", states=[cg.State("class")]),
                       dict(body="", hypers=[cg.Hyper("sqrt", "float", 1.0)]),
                       dict(body="", hypers=[cg.Hyper("a", "complex", 1.0)]),
                       dict(body="", hypers=[cg.Hyper("a", "float", 1.0)], states=[cg.State("a")])):
            with self.subTest(kwargs=kwargs), self.assertRaises(cg.RuleSpecError):
                spec("Bad", **kwargs)

    def test_cache_compiles_once_across_processes(self):
        s = spec("Shared", body="param -= T(0.5) * grad;")
        source = cg.rule_source(s, "host", cg.Only(FLOAT32, 0, False))
        script = (f"import sys; sys.path.insert(0, {str(PACKAGE)!r}); import _build; "
                  f"print(_build.build_unit('test-shared', open({repr(self.write(source))}).read(), 'host'))")
        env = dict(os.environ, FUSEDOPT_TORCH_QUIET="0")
        procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for _ in range(3)]
        results = [p.communicate() for p in procs]
        self.assertTrue(all(p.returncode == 0 for p in procs), results)
        paths = {out.strip() for out, _ in results}
        self.assertEqual(len(paths), 1)
        compiles = sum(err.count("compiling") for _, err in results)
        self.assertEqual(compiles, 1, results)
        # A later process finds it: no compile.
        again = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
        self.assertEqual(again.stdout.strip(), paths.pop())
        self.assertNotIn("compiling", again.stderr)

    def test_split_compile_threads_and_the_cache_key(self):
        # nvcc's --split-compile takes the cores the process's other compiles leave; it is not part
        # of a unit's cache key (the kernels are the same), and a bad thread count is refused.
        saved = os.environ.pop("FUSEDOPT_TORCH_NVCC_THREADS", None)
        # A CUDA unit's key where nvcc runs here (CI's machines have it), else a host unit's.
        backend = "cuda" if os.access(_build.nvcc(), os.X_OK) else "host"
        try:
            key = _build.unit_key("test-key", "source", backend, ["90"])
            os.environ["FUSEDOPT_TORCH_NVCC_THREADS"] = "1"
            self.assertEqual(_build.split_compile_flags("nvcc-that-is-not-asked", 1), [])
            self.assertEqual(_build.unit_key("test-key", "source", backend, ["90"]), key)
            os.environ["FUSEDOPT_TORCH_NVCC_THREADS"] = "many"
            with self.assertRaisesRegex(ValueError, "FUSEDOPT_TORCH_NVCC_THREADS must be a number"):
                _build.split_compile_flags("nvcc-that-is-not-asked", 1)
            os.environ["FUSEDOPT_TORCH_NVCC_THREADS"] = "4"
            self.assertEqual(_build.split_compile_flags(sys.executable, 1), [])  # a tool without the option
            del os.environ["FUSEDOPT_TORCH_NVCC_THREADS"]
            cores = len(os.sched_getaffinity(0))
            self.assertEqual(_build.split_compile_flags("nvcc-that-is-not-asked", cores), [])  # no core left
        finally:
            os.environ.pop("FUSEDOPT_TORCH_NVCC_THREADS", None)
            if saved is not None:
                os.environ["FUSEDOPT_TORCH_NVCC_THREADS"] = saved

    def write(self, text):
        path = Path(self.cache.name) / "source.txt"
        path.write_text(text)
        return str(path)


USER = len(cg.FAMILIES)  # plans.hpp: the built-in families, then user


def main():
    global HARNESS
    if len(sys.argv) < 2:
        sys.exit("usage: test_units.py HARNESS [unittest arguments]")
    HARNESS = sys.argv.pop(1)
    unittest.main()


if __name__ == "__main__":
    main()
