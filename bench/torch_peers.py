#!/usr/bin/env python3
"""Times PyTorch's optimizers on fusedopt's benchmark workloads: the peers fusedopt must beat.

For each workload (W1..W4 of bench/workloads.hpp, the same shapes, W3 from the same generator
and seed) and optimizer case (Adam fp32; AdamW with bf16 params and grads; SGD with momentum
fp32; the hyperparameters of bench/cases.hpp) it times these variants of torch.optim:

  foreach      foreach=True (multi-tensor kernels, eager)
  fused        fused=True (one fused multi-tensor kernel family, eager)
  fused_graph  fused=True, capturable=True (Adam/AdamW), the step captured once in a CUDA
               graph and replayed (SGD has no capturable flag and needs none)
  compile      torch.compile(opt.step) (a few cases only by default: compiles take time)

Method, as in cuda_bench: a sleep kernel holds the stream while the host enqueues a round of
steps, with a CUDA event after each step, so the event deltas time the device's work per step
and not the launch latency; the host time of each step() call is timed with a wall clock
beside it. Reported: median GPU time per step over all rounds, median host time per step,
bytes at the minimum (each tensor the step must read read once, each written tensor written
once, in torch's own dtypes), GB/s, and the fraction of a 1 GiB device-to-device copy measured
in the same run (bytes read + written). A variant whose host time exceeds its GPU time is
host-bound: a training loop sees the host time.

Note on AdamW bf16: torch keeps the moments in the parameters' dtype (bf16), 14 bytes per
element at the minimum; fusedopt's case keeps them in fp32 (22 bytes). Times are compared
as they are; the byte counts say what each moved.

Every variant runs in try/except (a failure is printed and recorded, never fatal), and the
whole run keeps to --budget seconds (compile variants are skipped first when time runs out).

Usage: python3 bench/torch_peers.py [--out FILE] [--workloads W1,W3] [--optimizers adam_fp32]
       [--variants foreach,fused,fused_graph,compile] [--compile-all] [--budget 230]
The JSON goes to --out, or to $OUT/torch_peers.json when $OUT is set.
"""

import argparse
import gc
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback

import torch

# ---- workloads (bench/workloads.hpp) ---------------------------------------------------------

from workloads import WORKLOADS  # noqa: E402,F401  (bench/workloads.py; other benches take it from here)


def test_module(name):
    """integrations/pytorch/tests/<name>.py loaded as a module, for the references its tests are
    written against (the tests folder on sys.path: the test files import its helpers). Registered
    in sys.modules: torch.compile looks a traced function's module up there by name."""
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integrations", "pytorch",
                         "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    spec = importlib.util.spec_from_file_location(f"{name}_references", os.path.join(tests, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

# ---- optimizer cases (bench/cases.hpp) -------------------------------------------------------

# name: (torch.optim class name, param/grad dtype, constructor kwargs, bytes per element at the
# minimum in torch's own layout, has a capturable flag)
OPTIMIZERS = {
    "adam_fp32": ("Adam", torch.float32, dict(lr=1e-3), 28, True),
    "adamw_bf16": ("AdamW", torch.bfloat16, dict(lr=1e-3, weight_decay=1e-2), 14, True),
    "sgd_momentum_fp32": ("SGD", torch.float32, dict(lr=1e-2, momentum=0.9), 20, False),
}

VARIANTS = ["foreach", "fused", "fused_graph", "compile"]
# (workload, optimizer) pairs timed with torch.compile unless --compile-all: Adam, the case the
# targets of issue 4 are stated for, where compiles stay short (W3's 2000 tensors take minutes).
DEFAULT_COMPILE = {("W1", "adam_fp32"), ("W2", "adam_fp32"), ("W4", "adam_fp32")}


# ---- timing --------------------------------------------------------------------------------


class Timer:
    """Device timing with CUDA events behind a sleep kernel (or a wall clock on the CPU)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.cycles_per_second = None
        if self.cuda:
            # torch.cuda._sleep spins for a number of clock cycles: calibrate it once.
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)
            torch.cuda.synchronize()
            start.record()
            torch.cuda._sleep(20_000_000)
            stop.record()
            stop.synchronize()
            self.cycles_per_second = 20_000_000 / (start.elapsed_time(stop) * 1e-3)

    def hold(self, seconds):
        """Keeps the device busy for about `seconds`, so what follows queues up behind it."""
        if self.cuda:
            torch.cuda._sleep(int(min(seconds, 0.25) * self.cycles_per_second))

    def round(self, step, count, hold_seconds):
        """Runs `count` steps; returns (device seconds per step, host seconds per step call)."""
        host = []
        if not self.cuda:
            device = []
            for _ in range(count):
                t = time.perf_counter()
                step()
                host.append(time.perf_counter() - t)
                device.append(host[-1])
            return device, host
        events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
        self.hold(hold_seconds)
        events[0].record()
        for k in range(count):
            t = time.perf_counter()
            step()
            host.append(time.perf_counter() - t)
            events[k + 1].record()
        events[-1].synchronize()
        return [events[k].elapsed_time(events[k + 1]) * 1e-3 for k in range(count)], host

    def synchronize(self):
        if self.cuda:
            torch.cuda.synchronize()


def measure(timer, step, warmup, steps_per_round, rounds):
    """Median device and host time per step of `step` after `warmup` calls."""
    for _ in range(warmup):
        step()
    timer.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        step()
    host_estimate = (time.perf_counter() - t) / 3
    timer.synchronize()
    # Hold the device long enough for the host to enqueue the whole round.
    hold = 1.5 * host_estimate * steps_per_round + 100e-6
    device, host = [], []
    for _ in range(rounds):
        d, h = timer.round(step, steps_per_round, hold)
        device += d
        host += h
    return {
        "gpu_us": statistics.median(device) * 1e6,
        "gpu_us_min": min(device) * 1e6,
        "host_us": statistics.median(host) * 1e6,
        "samples": len(device),
    }


def timed(timer, step, copy_bps, n, bytes_per_element):
    """measure() of `step` (3 warm-up calls, 5 rounds of 10) and its fraction of the copy
    (pct_copy) at `bytes_per_element` over `n` elements."""
    r = measure(timer, step, 3, 10, 5)
    r["pct_copy"] = 100 * bytes_per_element * n / (r["gpu_us"] * 1e-6) / copy_bps
    return r


def copy_bandwidth(timer, device, repetitions=20):
    """Bytes per second (read + write) of a 1 GiB device-to-device copy."""
    n = 1 << 28
    a = torch.rand(n, device=device)
    b = torch.empty_like(a)
    r = measure(timer, lambda: b.copy_(a), 3, 5, max(1, repetitions // 5))
    return 2 * 4 * n / (r["gpu_us"] * 1e-6)


# ---- one variant ---------------------------------------------------------------------------


def random_nonzero(n, dtype, device, lo, hi, signed, generator):
    """Uniform magnitudes in [lo, hi) with a random sign: never zero."""
    x = torch.rand(n, device=device, generator=generator) * (hi - lo) + lo
    if signed:
        x = torch.where(torch.rand(n, device=device, generator=generator) < 0.5, -x, x)
    return x.to(dtype)


def make_params(sizes, dtype, device, seed):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    params = []
    for n in sizes:
        p = torch.nn.Parameter(random_nonzero(n, dtype, device, 1e-2, 1.0, True, g))
        p.grad = random_nonzero(n, dtype, device, 1e-4, 1e-2, True, g)
        params.append(p)
    return params


def make_step(variant, optimizer, params, device):
    """Returns (step function, the objects to keep alive); compiles or captures as needed."""
    cls_name, _, kwargs, _, has_capturable = OPTIMIZERS[optimizer]
    cls = getattr(torch.optim, cls_name)
    if variant == "foreach":
        opt = cls(params, foreach=True, **kwargs)
        return opt.step, [opt]
    if variant == "fused":
        opt = cls(params, fused=True, **kwargs)
        return opt.step, [opt]
    if variant == "fused_graph":
        if device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        extra = dict(capturable=True) if has_capturable else {}
        opt = cls(params, fused=True, **extra, **kwargs)
        # Warm up on a side stream (states are created lazily), then capture one step.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                opt.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            opt.step()
        return graph.replay, [opt, graph]
    if variant == "compile":
        importlib.import_module("torch._dynamo").reset()  # forget earlier compiles and their guards
        opt = cls(params, **kwargs)

        @torch.compile(fullgraph=False)
        def compiled_step():
            opt.step()

        return compiled_step, [opt]
    raise ValueError(f"unknown variant {variant}")


def report_failure(row, error, verbose):
    """Records a variant's failure in its row and prints it (never fatal: the run goes on)."""
    row["error"] = f"{type(error).__name__}: {error}".strip()[:500]
    print(f"  {row['workload']} {row['optimizer']:18s} {row['variant']:12s} FAILED: "
          f"{row['error'].splitlines()[0][:200]}", flush=True)
    if verbose:
        traceback.print_exc()


def release(keep, device):
    """Drops a variant's optimizer, graph and compiled function before the next one runs."""
    if keep:
        keep.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_variant(args, timer, device, copy_bps, workload, optimizer, variant, params):
    sizes = [p.numel() for p in params]
    elements = sum(sizes)
    bytes_per_step = OPTIMIZERS[optimizer][3] * elements
    row = dict(workload=workload, optimizer=optimizer, variant=variant, tensors=len(sizes), elements=elements,
               bytes_per_step=bytes_per_step)
    step = keep = None
    try:
        t0 = time.perf_counter()
        step, keep = make_step(variant, optimizer, params, device)
        warmup = 5
        if variant == "compile":
            # The first call compiles, the second recompiles once the lazily created state
            # exists: time them apart from the steps.
            step()
            step()
            timer.synchronize()
            row["compile_s"] = time.perf_counter() - t0
        row.update(measure(timer, step, warmup, args.steps_per_round, args.rounds))
        row["GBps"] = bytes_per_step / (row["gpu_us"] * 1e-6) * 1e-9
        row["pct_copy"] = 100.0 * bytes_per_step / (row["gpu_us"] * 1e-6) / copy_bps
        row["host_bound"] = row["host_us"] > row["gpu_us"]
        row["setup_s"] = time.perf_counter() - t0
        print(f"  {workload} {optimizer:18s} {variant:12s} {row['gpu_us']:10.1f} us/step  "
              f"{row['pct_copy']:5.1f}% copy  host {row['host_us']:9.1f} us", flush=True)
    except Exception as e:  # noqa: BLE001 - every failure is reported, none is fatal
        report_failure(row, e, args.verbose)
    finally:
        step = None
        release(keep, device)
    return row


# ---- main ----------------------------------------------------------------------------------


def print_table(rows, copy_bps):
    print()
    print(f"torch peers (GPU time per step, median; copy bandwidth {copy_bps * 1e-9:.0f} GB/s read + write)")
    header = f"{'workload':8s} {'optimizer':18s} {'variant':12s} {'us/step':>10s} {'GB/s':>8s} {'% copy':>7s} {'host us':>10s}"
    print(header)
    print("-" * len(header))
    for r in rows:
        if "error" in r:
            print(f"{r['workload']:8s} {r['optimizer']:18s} {r['variant']:12s} {'failed':>10s}  {r['error'].splitlines()[0][:60]}")
        elif "skipped" in r:
            print(f"{r['workload']:8s} {r['optimizer']:18s} {r['variant']:12s} {'skipped':>10s}  {r['skipped']}")
        else:
            flag = " host-bound" if r["host_bound"] else ""
            print(f"{r['workload']:8s} {r['optimizer']:18s} {r['variant']:12s} {r['gpu_us']:10.1f} {r['GBps']:8.0f} "
                  f"{r['pct_copy']:6.1f}% {r['host_us']:10.1f}{flag}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file (default: $OUT/torch_peers.json when $OUT is set)")
    parser.add_argument("--workloads", default="W1,W2,W3,W4")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--compile-all", action="store_true", help="torch.compile every case (slow: minutes)")
    parser.add_argument("--budget", type=float, default=230.0, help="seconds for everything; later variants are skipped")
    parser.add_argument("--steps-per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of this script")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink every tensor (smoke tests only)")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = parser.parse_args()

    started = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("torch_peers: no CUDA device visible to torch, nothing to measure")
        return 0
    workloads = [w for w in args.workloads.split(",") if w]
    optimizers = [o for o in args.optimizers.split(",") if o]
    variants = [v for v in args.variants.split(",") if v]
    for name, known in (("workload", WORKLOADS), ("optimizer", OPTIMIZERS)):
        for x in workloads if name == "workload" else optimizers:
            if x not in known:
                parser.error(f"unknown {name} {x}; known: {', '.join(known)}")
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v}; known: {', '.join(VARIANTS)}")

    timer = Timer(device)
    copy_bps = copy_bandwidth(timer, device) if device.type == "cuda" else float("nan")
    context = dict(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        copy_GBps=copy_bps * 1e-9,
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        method="median CUDA-event time per step, launches queued behind a sleep kernel",
    )
    print(f"torch {context['torch']} (CUDA {context['cuda']}) on {context['gpu']}; "
          f"device-to-device copy {copy_bps * 1e-9:.0f} GB/s (read + write)", flush=True)

    for w in workloads:
        sizes = WORKLOADS[w][1]()
        print(f"  {w}: {WORKLOADS[w][0]}: {len(sizes)} tensors, {sum(sizes):,} elements", flush=True)

    out = args.out or (os.path.join(os.environ["OUT"], "torch_peers.json") if os.environ.get("OUT") else None)

    def save(rows, final=False):
        """Writes what is measured so far: a run cut short by a timeout still leaves its rows."""
        if not out:
            return
        context["total_s"] = time.perf_counter() - started
        context["complete"] = final
        with open(out + ".tmp", "w") as f:
            json.dump(dict(context=context, results=rows), f, indent=1)
        os.replace(out + ".tmp", out)

    def scaled(sizes):
        return [max(1, int(n * args.scale)) for n in sizes] if args.scale != 1.0 else sizes

    rows = []
    deferred = []  # compile variants run last, so that the budget cuts them first
    for w in workloads:
        sizes = scaled(WORKLOADS[w][1]())
        for o in optimizers:
            eager = [v for v in variants if v != "compile"]
            if "compile" in variants and (args.compile_all or (w, o) in DEFAULT_COMPILE):
                deferred.append((w, o))
            if not eager:
                continue
            if time.perf_counter() - started > args.budget:
                rows += [dict(workload=w, optimizer=o, variant=v, skipped="time budget") for v in eager]
                continue
            try:
                params = make_params(sizes, OPTIMIZERS[o][1], device, seed=1)
            except Exception as e:  # noqa: BLE001
                rows += [dict(workload=w, optimizer=o, variant=v, error=f"setup: {type(e).__name__}: {e}") for v in eager]
                print(f"  {w} {o}: setup FAILED: {e}", flush=True)
                continue
            for v in eager:
                if time.perf_counter() - started > args.budget:
                    rows.append(dict(workload=w, optimizer=o, variant=v, skipped="time budget"))
                    continue
                rows.append(run_variant(args, timer, device, copy_bps, w, o, v, params))
                save(rows)
            del params
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for w, o in deferred:
        # A compile takes tens of seconds: start one only with a minute to spare.
        if time.perf_counter() - started > args.budget - 60:
            rows.append(dict(workload=w, optimizer=o, variant="compile", skipped="time budget"))
            continue
        try:
            params = make_params(scaled(WORKLOADS[w][1]()), OPTIMIZERS[o][1], device, seed=1)
            rows.append(run_variant(args, timer, device, copy_bps, w, o, "compile", params))
            save(rows)
            del params
        except Exception as e:  # noqa: BLE001
            rows.append(dict(workload=w, optimizer=o, variant="compile", error=f"setup: {type(e).__name__}: {e}"))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    save(rows, final=True)
    print_table(rows, copy_bps)
    print(f"total {context['total_s']:.0f} s")
    if out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
