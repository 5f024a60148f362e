#!/usr/bin/env python3
"""From install to the first step: what fusedopt_jax costs a user before it steps.

Each figure is a fresh Python process, timed from its start (wall clock) to the end of its first
jitted AdamW step over a small float32 pytree (jax's import and the program's compile included):

  optax       optax.adamw: what the same first step costs without fusedopt_jax
  fj_cold     fusedopt_jax.adamw's fused step with an empty cache (FUSEDOPT_JAX_CACHE): the
              handler and the one unit the step needs compiled (beside each other), then the step
  fj_warm     the same in a second process: everything from the cache
  fj_bf16     a third process, bfloat16 parameters with float32 states: that one unit compiled

and, last, `python -m fusedopt_jax._build --units all` into the same cache: every unit at once
(what a machine that steps every kind and form builds ahead).

Usage: python3 bench/first_step_jax.py [--platform cuda|cpu] [--cache DIR] [--out FILE]
Needs jax and optax, and integrations/jax on PYTHONPATH (set here).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(os.path.dirname(HERE), "integrations", "jax")

STEP = r"""
import sys, time
import jax, jax.numpy as jnp, optax
impl, dtype = sys.argv[1], jnp.dtype(sys.argv[2])
params = {f"w{i}": jnp.ones((256, 64 + i), dtype) for i in range(8)}
grads = jax.tree.map(lambda x: x * 0.5, params)
if impl == "optax":
    tx = optax.adamw(1e-3, weight_decay=0.01)
    def step(p, g, s):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
else:
    import fusedopt_jax as fj
    tx = fj.adamw(1e-3, weight_decay=0.01, state_dtype=jnp.float32)
    step = tx.step
p, s = jax.jit(step, donate_argnums=(0, 2))(params, grads, tx.init(params))
jax.block_until_ready(p)
"""


def timed(args, env):
    t0 = time.monotonic()
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} failed:\n{done.stderr[-3000:]}")
    return seconds, done


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platform", default=None, help="JAX_PLATFORMS for the processes (default: jax's choice)")
    ap.add_argument("--cache", help="the (fresh) cache folder; default a temporary one")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "first_step_jax.json"))
    args = ap.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="fusedopt_jax_first_step_")
    env = dict(os.environ, FUSEDOPT_JAX_CACHE=cache,
               PYTHONPATH=os.pathsep.join([PACKAGE] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if args.platform:
        env["JAX_PLATFORMS"] = args.platform
    rows = {}
    for name, impl, dtype in (("optax", "optax", "float32"), ("fj_cold", "fj", "float32"), ("fj_warm", "fj", "float32"),
                              ("fj_bf16", "fj", "bfloat16")):
        rows[name], _ = timed([sys.executable, "-c", STEP, impl, dtype], env)
        print(f"{name}: {rows[name]:.1f} s", flush=True)
    rows["libraries_after_the_steps"] = sorted(os.path.basename(p) for p in
                                               subprocess.run(["find", cache, "-name", "*.so"], capture_output=True,
                                                              text=True).stdout.split())
    platform = "cpu" if args.platform == "cpu" else "cuda"
    rows["all_units"], done = timed([sys.executable, "-m", "fusedopt_jax._build", "--platform", platform, "--units",
                                     "all"], env)
    print(f"all_units: {rows['all_units']:.1f} s ({done.stdout.strip().splitlines()[-1]})", flush=True)
    rows.update(cache=cache, cores=os.cpu_count(), platform=platform)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
