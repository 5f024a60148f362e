#!/usr/bin/env python3
"""A user's own optimizer three ways, in one process, on W1-W4 (bench/torch_peers.py's workloads,
float32): AdEMAMix (examples/pytorch/ademamix.py)

  fusedopt_rule     the user rule through fusedopt_torch (one fused launch per step)
  foreach           the same algorithm written with torch._foreach_* (eager), as a user would
  foreach_compile   that code under torch.compile (the bias corrections and schedules as 0-d
                    tensors, so that steps do not recompile)

and, as the reference points, fusedopt_torch.AdamW and AdamW restated as a user rule
(examples/pytorch/adamw_rule.py), whose fractions of the copy must agree within 2 points.

Per row: GPU time per step (median of rounds, CUDA events behind a sleep kernel: torch_peers'
Timer), host time per step() call, the fraction of a device-to-device copy measured in the same
run at the bytes the algorithm must move (AdEMAMix float32: 36 per element; AdamW: 28), and the
time to the first step: the user rule's compile (a name not in the cache, the core cached) or
torch.compile's first call. torch.compile runs in a subprocess with a time limit
(--compile-limit, default 240 s): a compile that does not finish is reported so.

Usage: python3 bench/custom_rules.py [--workloads W1,W2,W3,W4] [--compile-limit 240] [--out FILE]
"""

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "integrations", "pytorch"))
import torch_peers as peers  # noqa: E402

import fusedopt_torch  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, beta3=0.9999, alpha=5.0, eps=1e-8, weight_decay=0.01)
BYTES = {"ademamix": 36, "adamw": 28}


def example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", "pytorch", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ademamix_foreach(params, grads, m1, m2, nu, bc1, sqrt_bc2, lr, b1, b2, b3, alpha, eps, wd):
    """AdEMAMix with torch._foreach_* ops (no warmups): what a user writes without fusedopt. bc1 and
    sqrt_bc2 are 0-d tensors (1 - beta1^t, sqrt(1 - beta2^t))."""
    torch._foreach_lerp_(m1, grads, 1 - b1)
    torch._foreach_lerp_(m2, grads, 1 - b3)
    torch._foreach_mul_(nu, b2)
    torch._foreach_addcmul_(nu, grads, grads, value=1 - b2)
    denom = torch._foreach_sqrt(nu)
    torch._foreach_div_(denom, sqrt_bc2)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(m1, bc1)
    torch._foreach_add_(update, m2, alpha=alpha)
    torch._foreach_div_(update, denom)
    torch._foreach_add_(update, params, alpha=wd)
    torch._foreach_add_(params, update, alpha=-lr)


class ForeachAdEMAMix:
    """State and step of the foreach version (compiled or not)."""

    def __init__(self, params, compiled):
        self.params = [p.detach() for p in params]
        self.grads = [p.grad for p in params]
        self.m1, self.m2, self.nu = ([torch.zeros_like(p) for p in self.params] for _ in range(3))
        self.t = 0
        self.bc1 = torch.ones((), device=params[0].device)
        self.sqrt_bc2 = torch.ones((), device=params[0].device)
        self.fn = torch.compile(ademamix_foreach) if compiled else ademamix_foreach

    def step(self):
        self.t += 1
        self.bc1.fill_(1 - HYPER["beta1"] ** self.t)
        self.sqrt_bc2.fill_(math.sqrt(1 - HYPER["beta2"] ** self.t))
        h = HYPER
        self.fn(self.params, self.grads, self.m1, self.m2, self.nu, self.bc1, self.sqrt_bc2, h["lr"], h["beta1"],
                h["beta2"], h["beta3"], h["alpha"], h["eps"], h["weight_decay"])


COMPILE_CHILD = """
import sys, time, json, torch
sys.argv = ["custom_rules.py"]
sys.path.insert(0, {here!r})
import custom_rules as c, torch_peers as peers
params = peers.make_params(peers.WORKLOADS[{w!r}][1](), torch.float32, torch.device("cuda"), 1)
opt = c.ForeachAdEMAMix(params, True)
t = time.perf_counter(); opt.step(); torch.cuda.synchronize(); first = time.perf_counter() - t
timer = peers.Timer(torch.device("cuda"))
r = peers.timed(timer, opt.step, {copy}, {n}, c.BYTES["ademamix"])
r["first_step_s"] = first
print("RESULT", json.dumps(r))
"""


def compiled_row(workload, copy_bps, n, limit):
    code = COMPILE_CHILD.format(here=HERE, w=workload, copy=copy_bps, n=n)
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return dict(error=f"torch.compile did not finish within {limit} s", first_step_s=None)
    if done.returncode != 0:
        return dict(error=done.stderr[-1500:], wall_s=time.perf_counter() - start)
    return json.loads([l for l in done.stdout.splitlines() if l.startswith("RESULT")][-1][7:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="W1,W2,W3,W4")
    parser.add_argument("--compile-limit", type=float, default=240)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    timer = peers.Timer(device)
    copy_bps = peers.copy_bandwidth(timer, device)
    AdEMAMix = example("ademamix").AdEMAMix
    AdamWRule = example("adamw_rule").AdamWRule
    # A rule of a fresh name: its unit is not in the cache, so its first step compiles it.
    spec = AdEMAMix._spec
    Fresh = fusedopt_torch.rule(f"AdEMAMixBench{os.getpid()}", hypers={h.name: h.default for h in spec.hypers},
                                states=dict(AdEMAMix._states), constants=dict(spec.constants), body=spec.body)
    rows = []
    compiled_fresh = False
    for w in args.workloads.split(","):
        sizes = peers.WORKLOADS[w][1]()
        n = sum(sizes)
        row = dict(workload=w, elements=n)
        kw = dict(lr=HYPER["lr"], beta1=HYPER["beta1"], beta2=HYPER["beta2"], beta3=HYPER["beta3"],
                  alpha=HYPER["alpha"], eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])
        params = peers.make_params(sizes, torch.float32, device, 1)
        opt = (Fresh if not compiled_fresh else AdEMAMix)(params, **kw)
        t = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        row_first = time.perf_counter() - t
        compiled_fresh = True
        row["fusedopt_rule"] = dict(peers.timed(timer, opt.step, copy_bps, n, BYTES["ademamix"]), first_step_s=row_first)
        del opt
        eager = ForeachAdEMAMix(params, False)
        row["foreach"] = peers.timed(timer, eager.step, copy_bps, n, BYTES["ademamix"])
        del eager, params
        torch.cuda.empty_cache()
        row["foreach_compile"] = compiled_row(w, copy_bps, n, args.compile_limit)
        for name, cls in (("fusedopt_adamw", fusedopt_torch.AdamW), ("fusedopt_adamw_rule", AdamWRule)):
            params = peers.make_params(sizes, torch.float32, device, 1)
            opt = cls(params, lr=1e-3, weight_decay=1e-2)
            row[name] = peers.timed(timer, opt.step, copy_bps, n, BYTES["adamw"])
            del opt, params
            torch.cuda.empty_cache()
        rule = row["fusedopt_rule"]["gpu_us"]
        for peer in ("foreach", "foreach_compile"):
            if "gpu_us" in row[peer]:
                row[f"speedup_vs_{peer}"] = row[peer]["gpu_us"] / rule
        rows.append(row)
        c = row["foreach_compile"]
        print(f"{w}: rule {rule:9.1f} us ({row['fusedopt_rule']['pct_copy']:5.1f}% copy, first step "
              f"{row['fusedopt_rule']['first_step_s']:.1f} s) | foreach {row['foreach']['gpu_us']:9.1f} us "
              f"({row['foreach']['pct_copy']:5.1f}%) | compile "
              + (f"{c['gpu_us']:9.1f} us ({c['pct_copy']:5.1f}%, first step {c['first_step_s']:.1f} s)"
                 if "gpu_us" in c else c.get("error", "")[:200])
              + f" | AdamW {row['fusedopt_adamw']['pct_copy']:5.1f}% vs as a rule {row['fusedopt_adamw_rule']['pct_copy']:5.1f}%",
              flush=True)
    result = dict(device=torch.cuda.get_device_name(), copy_gbps=copy_bps / 1e9, rows=rows)
    out = args.out or (os.path.join(os.environ["OUT"], "custom_rules.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
