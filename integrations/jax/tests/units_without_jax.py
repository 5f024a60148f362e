#!/usr/bin/env python3
"""fusedopt_jax's CPU units without jax or XLA (CI): fusedopt_jax/_build.py builds a few units into
a temporary cache, tests/unit_harness.cc steps each over leaves of awkward sizes for three steps,
and the parameters (or Optax's-form updates) and states must equal, bit for bit, a float32
reading of Optax's formulas (each operation rounded once, as the rules are written and compiled
with -ffp-contract=off; bfloat16 rounded to nearest even). Also: a unit makes no runner for
another unit's combination.

    python3 integrations/jax/tests/units_without_jax.py HARNESS

(Not a pytest module: the GPU machine's pytest of integrations/jax/tests tests the same units
through jax.)
"""

import math
import os
import random
import struct
import subprocess
import sys
import tempfile
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fusedopt_jax import _build  # noqa: E402  (imports no jax)

F32, BF16 = 0, 1
SGD, SGD_MOMENTUM, ADAM, LION = 0, 1, 2, 3
SIZES = [1, 3, 16, 17, 255, 1000, 4097]
STEPS = 3
# csrc/optax_rules.hpp's hyper_index
STEP_SIZE, B1, OMB1, B2, OMB2, EPS, EPS_ROOT, WD, BC1, BC2, MAX_NORM, NESTEROV = range(12)


# float32 arithmetic in Python's doubles: +, -, *, / and the square root computed in double and
# rounded once to float32 give float32's correctly rounded result (53 >= 2 x 24 + 2 bits), so
# every operation below is rounded by f32 as the rules round it (no numpy needed).
def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def bf16_bits(x):  # round to nearest even
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16) & 0xFFFF


def stored(values, d):
    """The stored form: array('f') of float32, or array('H') of bfloat16 bits."""
    return array("H", [bf16_bits(x) for x in values]) if d == BF16 else array("f", values)


def loaded(values, d):
    """The float values of a stored array."""
    if d == BF16:
        return [struct.unpack("<f", struct.pack("<I", b << 16))[0] for b in values]
    return list(values)


def hyper_of(kind, step):
    h = [0.0] * 16
    b1, b2 = (0.9, 0.999) if kind != LION else (0.9, 0.99)
    h[STEP_SIZE], h[B1], h[OMB1], h[B2], h[OMB2] = -1e-2, b1, 1.0 - b1, b2, 1.0 - b2
    h[EPS], h[EPS_ROOT], h[WD] = 1e-8, 0.0, 0.1 if kind in (ADAM, LION) else 0.0
    h[BC1], h[BC2] = 1 - f32(b1) ** (step + 1), 1 - f32(b2) ** (step + 1)
    h[NESTEROV] = 1.0 if kind == SGD_MOMENTUM else 0.0
    return [f32(x) for x in h]


def reference(kind, h, p, g, s1, s2):
    """One element's step of Optax's formula in float32, operation by operation: (update, s1, s2)."""
    if kind == ADAM:
        m = f32(f32(h[OMB1] * g) + f32(h[B1] * s1))
        v = f32(f32(h[OMB2] * f32(g * g)) + f32(h[B2] * s2))
        u = f32(f32(m / h[BC1]) / f32(f32(math.sqrt(f32(f32(v / h[BC2]) + h[EPS_ROOT]))) + h[EPS]))
        if h[WD] != 0:
            u = f32(u + f32(h[WD] * p))
        return f32(h[STEP_SIZE] * u), m, v
    if kind == SGD_MOMENTUM:
        t = f32(g + f32(h[B1] * s1))
        u = f32(g + f32(h[B1] * t)) if h[NESTEROV] != 0 else t
        return f32(h[STEP_SIZE] * u), t, s2
    if kind == LION:
        x = f32(f32(h[OMB1] * g) + f32(h[B1] * s1))
        u = 1.0 if x > 0 else (-1.0 if x < 0 else x)
        if h[WD] != 0:
            u = f32(u + f32(h[WD] * p))
        return f32(h[STEP_SIZE] * u), f32(f32(h[OMB2] * g) + f32(h[B2] * s1)), s2
    return f32(h[STEP_SIZE] * g), s1, s2  # SGD


def check(harness, kind, inplace, param, state1, state2, rng):
    unit = _build.unit_of(kind, inplace, param, state1, state2)
    _, _, param, state1, state2 = unit
    states = _build.KIND_STATES[kind]
    update = BF16 if (param, state1, state2) == (BF16, BF16, BF16) else F32
    library = _build.build_unit("cpu", unit)
    p0 = [stored([rng.gauss(0, 1) for _ in range(n)], param) for n in SIZES]
    grads = [[stored([rng.gauss(0, 0.1) for _ in range(n)], param) for n in SIZES] for _ in range(STEPS)]
    s1 = [stored([rng.gauss(0, 0.01) for _ in range(n)], state1) for n in SIZES]
    s2 = [stored([abs(rng.gauss(0, 1e-3)) for _ in range(n)], state2) for n in SIZES]
    hypers = [hyper_of(kind, t) for t in range(STEPS)]
    with tempfile.TemporaryDirectory() as folder:
        source, result = Path(folder) / "in.bin", Path(folder) / "out.bin"
        with open(source, "wb") as out:
            out.write(array("q", [kind, int(inplace), param, state1, state2, update, len(SIZES), STEPS]).tobytes())
            out.write(array("q", SIZES).tobytes())
            out.write(array("f", [x for h in hypers for x in h]).tobytes())
            for x in p0 + [g for step in grads for g in step] + (s1 if states > 0 else []) + (s2 if states > 1 else []):
                out.write(x.tobytes())
        done = subprocess.run([harness, str(library), str(source), str(result)], capture_output=True, text=True)
        if done.returncode != 0:
            raise AssertionError(f"{_build.unit_name(unit)}: the harness failed: {done.stderr}")
        data = result.read_bytes()
    # The reference, step by step from the stored values.
    p = [loaded(x, param) for x in p0]
    m1 = [loaded(x, state1) for x in s1]
    m2 = [loaded(x, state2) for x in s2]
    updates = None
    for t in range(STEPS):
        updates = []
        for i in range(len(SIZES)):
            g = loaded(grads[t][i], param)
            step = [reference(kind, hypers[t], p[i][j], g[j], m1[i][j], m2[i][j]) for j in range(SIZES[i])]
            m1[i] = loaded(stored([a for _, a, _ in step], state1), state1)
            m2[i] = loaded(stored([b for _, _, b in step], state2), state2)
            if inplace:
                p[i] = loaded(stored([f32(x + u) for x, (u, _, _) in zip(p[i], step)], param), param)
            updates.append([u for u, _, _ in step])
    expected = [stored(x, param) for x in p] if inplace else [stored(u, update) for u in updates]
    expected += [stored(x, state1) for x in m1] if states > 0 else []
    expected += [stored(x, state2) for x in m2] if states > 1 else []
    want = b"".join(x.tobytes() for x in expected)
    if data != want:
        wrong = sum(a != b for a, b in zip(data, want)) if len(data) == len(want) else -1
        raise AssertionError(f"{_build.unit_name(unit)}: {wrong} bytes differ from the float32 reading of Optax's "
                             f"formula (of {len(want)})")
    print(f"{_build.unit_name(unit)}: {STEPS} steps over {len(SIZES)} leaves bit for bit", flush=True)
    return library


def main():
    harness = sys.argv[1]
    os.environ.setdefault("FUSEDOPT_JAX_QUIET", "1")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["FUSEDOPT_JAX_CACHE"] = cache
        rng = random.Random(0)
        cases = [(ADAM, True, F32, F32, F32), (ADAM, False, F32, F32, F32), (ADAM, True, BF16, F32, F32),
                 (SGD_MOMENTUM, True, F32, F32, F32), (LION, False, BF16, BF16, BF16)]
        _build.build_units("cpu", [_build.unit_of(*c) for c in cases])  # in parallel
        libraries = [check(harness, *c, rng) for c in cases]
        # A unit makes no runner for another combination: the float32 AdamW unit asked for bf16.
        with tempfile.TemporaryDirectory() as folder:
            source = Path(folder) / "in.bin"
            source.write_bytes(array("q", [ADAM, 1, BF16, F32, F32, F32, 0, 0]).tobytes())
            done = subprocess.run([harness, str(libraries[0]), str(source), str(Path(folder) / "out.bin")],
                                  capture_output=True, text=True)
            assert done.returncode != 0 and "makes no runner" in done.stderr, done.stderr
        print("a unit refuses another combination's group")


if __name__ == "__main__":
    main()
