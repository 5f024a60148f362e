#!/usr/bin/env python3
"""From install to the first step: what fusedopt_torch costs a user before it steps.

Each figure is a fresh Python process, timed from its start (wall clock, torch's import apart):

  import            `import fusedopt_torch` after `import torch` (compiles nothing)
  adamw_cold        the first AdamW step on CUDA with an empty cache: the core and the AdamW
                    unit of float32 compiled (beside each other), then the step
  adamw_warm        the same in a second process: everything from the cache
  rule_cold         the first step of a user rule (AdEMAMix, examples/pytorch/ademamix.py) whose
                    unit is not cached (the core is): its compile, then the step
  rule_warm         the same in a second process
  cpu_adamw_cold    the first AdamW step on CPU tensors: the host unit compiled (core cached)

The cache is a fresh temporary folder (FUSEDOPT_TORCH_CACHE), what setup.py built is ignored
(FUSEDOPT_TORCH_PREBUILT=0). Targets (issue 40, a 16-core GPU machine): import <= 2 s,
adamw_cold <= 30 s, adamw_warm <= 2 s, rule_cold <= 30 s.

Usage: python3 bench/first_step.py [--cache DIR] [--skip-cpu] [--out FILE]   ($OUT/first_step.json by default)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PYTORCH = os.path.join(ROOT, "integrations", "pytorch")

PRELUDE = f"""
import sys, time
start = time.perf_counter()
import torch
after_torch = time.perf_counter()
sys.path.insert(0, {PYTORCH!r})
import fusedopt_torch
after_import = time.perf_counter()
"""

STEP = """
device = "{device}"
params = [torch.randn(n, device=device, requires_grad=True) for n in (1 << 20, 4096, 768)]
for p in params:
    p.grad = torch.randn_like(p)
opt = {make}
t = time.perf_counter()
opt.step()
if device == "cuda":
    torch.cuda.synchronize()
done = time.perf_counter()
print("RESULT", after_torch - start, after_import - after_torch, done - t, done - after_torch)
"""

RULE = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("ademamix", {os.path.join(ROOT, 'examples', 'pytorch', 'ademamix.py')!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
"""


def run(code, env):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return dict(error=done.stderr[-3000:], wall_s=wall)
    line = [l for l in done.stdout.splitlines() if l.startswith("RESULT")][-1].split()[1:]
    torch_s, import_s, step_s, after_torch_s = map(float, line)
    return dict(torch_import_s=torch_s, import_s=import_s, first_step_s=step_s, from_import_to_stepped_s=after_torch_s,
                process_wall_s=wall, compiles=done.stderr.count("compiling"),
                log=[l for l in done.stderr.splitlines() if l.startswith("fusedopt_torch:")])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", help="cache folder (default: a fresh temporary one)")
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="fusedopt_torch_cache_")
    env = dict(os.environ, FUSEDOPT_TORCH_CACHE=cache, FUSEDOPT_TORCH_PREBUILT="0")
    import torch  # noqa: F401 - only to say whether CUDA is there

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    rows = {}
    rows["import"] = run(PRELUDE + "print('RESULT', after_torch - start, after_import - after_torch, 0, 0)", env)
    adamw = PRELUDE + STEP.format(device=device, make="fusedopt_torch.AdamW(params, lr=1e-3)")
    rows["adamw_cold"] = run(adamw, env)
    rows["adamw_warm"] = run(adamw, env)
    rule = PRELUDE + RULE + STEP.format(device=device, make="module.AdEMAMix(params, lr=1e-3)")
    rows["rule_cold"] = run(rule, env)
    rows["rule_warm"] = run(rule, env)
    if cuda and not args.skip_cpu:
        rows["cpu_adamw_cold"] = run(PRELUDE + STEP.format(device="cpu", make="fusedopt_torch.AdamW(params, lr=1e-3)"),
                                     env)
    result = dict(device=torch.cuda.get_device_name() if cuda else "cpu", cores=os.cpu_count(), cache=cache, rows=rows)
    print(f"{'':16} {'torch import':>12} {'import':>8} {'first step':>11} {'compiles':>9}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:16} FAILED: {r['error'][-800:]}")
            continue
        print(f"{name:16} {r['torch_import_s']:11.2f}s {r['import_s']:7.2f}s {r['first_step_s']:10.2f}s "
              f"{r['compiles']:9d}")
    out = args.out or (os.path.join(os.environ["OUT"], "first_step.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
