#!/usr/bin/env python3
"""Where the host time of one optimizer step goes (issue 11's host-call target).

GPT-2 small's 148 parameter tensors (fp32, CUDA) without the model: two gradient sets made once,
so a "moved" step (the set alternates, as zero_grad(set_to_none=True) makes it) allocates
nothing. Per configuration the host time of the call (perf_counter, after a synchronize) is
measured over --steps calls, median; "cold" first streams through --cold-mb of host memory, as
a forward and backward pass between two steps do to the caches.

Rows: fusedopt_torch.AdamW's step(); the extension's engine.step alone (the C++ part, the same
arguments step() passes); the Python part of step() without the call (the hyperparameter
objects); torch's fused and foreach AdamW. Fixed and moved gradients, warm and cold.

Usage: python3 bench/step_probe.py [--steps 400] [--cold-mb 64] [--only fusedopt_moved]
(--only runs one configuration for a profiler: perf record -g python3 bench/step_probe.py --only ...).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

from train_loop import calibration_work

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integrations", "pytorch"))


def gpt2_shapes(vocab=50257, d=768, layers=12, context=1024):
    shapes = [(vocab, d), (context, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--cold-mb", type=int, default=64)
    ap.add_argument("--only", default="")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (the figures are for CUDA)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    params = [torch.zeros(s, device=dev, requires_grad=True) for s in gpt2_shapes()]
    grads = [[torch.randn(s, device=dev) * 1e-3 for s in gpt2_shapes()] for _ in range(2)]
    cold = torch.empty(args.cold_mb << 20, dtype=torch.uint8)

    calibration = []

    def timed(call, moved, flush):
        times = []
        for i in range(args.steps):
            for p, g in zip(params, grads[i % 2 if moved else 0]):
                p.grad = g
            sync()
            if flush:
                cold.add_(1)  # one pass over host memory, as a forward/backward pass does
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            calibration_work()  # the same yardstick as bench/train_loop.py's, after the call
            calibration.append(time.perf_counter() - t1)
        sync()
        return statistics.median(times) * 1e6

    import fusedopt_torch

    kwargs = dict(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
    opt = fusedopt_torch.AdamW(params, **kwargs)
    for p, g in zip(params, grads[0]):
        p.grad = g
    opt.step()  # states and plans made
    groups = opt.param_groups

    def engine_step():
        hypers = [opt._hyper(g) for g in groups]
        opt._engine.step(hypers, None, None, [None] * len(groups), False)

    def python_part():
        [opt._hyper(g) for g in groups]

    configs = {}
    for moved in (False, True):
        for flush in (False, True):
            tag = ("moved" if moved else "fixed") + ("_cold" if flush else "")
            configs[f"fusedopt_{tag}"] = (opt.step, moved, flush)
            configs[f"engine_{tag}"] = (engine_step, moved, flush)
    configs["hypers_only"] = (python_part, False, False)
    # The layers around the step: torch.optim's hook wrapper (opt.step), dynamo's disable
    # wrapper under it, the function itself.
    import inspect

    dynamo_layer = getattr(type(opt).step, "__wrapped__", None)
    raw = inspect.unwrap(type(opt).step)
    if dynamo_layer is not None and dynamo_layer is not raw:
        configs["step_without_hooks_fixed"] = (lambda: dynamo_layer(opt), False, False)
    configs["step_raw_fixed"] = (lambda: raw(opt), False, False)
    fused = torch.optim.AdamW(params, **dict(kwargs, **({"fused": True} if dev.type == "cuda" else {})))
    foreach = torch.optim.AdamW(params, foreach=True, **kwargs)
    for moved in (False, True):
        for flush in (False, True):
            tag = ("moved" if moved else "fixed") + ("_cold" if flush else "")
            configs[f"torch_fused_{tag}"] = (fused.step, moved, flush)
    configs["torch_foreach_fixed"] = (foreach.step, False, False)

    rows = {}
    engine_phases = {}
    for name, (call, moved, flush) in configs.items():
        if args.only and name != args.only:
            continue
        before = opt._engine.host_times()
        rows[name] = timed(call, moved, flush)
        after = opt._engine.host_times()
        steps = after["steps"] - before["steps"]
        phases = ""
        if steps > 0:
            # The engine's own clocks (csrc/engine.cpp, host_times): mean per step.
            engine_phases[name] = {k[:-3]: round((after[k] - before[k]) / steps / 1e3, 1) for k in after if k.endswith("_ns")}
            if "table_uploads" in after:
                engine_phases[name]["table_uploads"] = round((after["table_uploads"] - before["table_uploads"]) / steps, 2)
            phases = "  engine: " + ", ".join(f"{k} {v}" for k, v in engine_phases[name].items())
        print(f"{name:28s} {rows[name]:9.1f} us{phases}", flush=True)
    rows["engine_phases_us"] = engine_phases
    rows["calibration_us"] = statistics.median(calibration) * 1e6
    print(f"calibration (bench/train_loop.py's yardstick after each call) {rows['calibration_us']:.1f} us")
    if not args.only:
        import cProfile
        import io
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        timed(opt.step, True, False)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
        print("cProfile of fusedopt_moved, by own time:")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-2500:])
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "step_probe.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
