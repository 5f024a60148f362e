#!/usr/bin/env python3
"""fusedopt_torch (the extension, as a user gets it) against torch.optim on the same GPU in one run.

Workloads W1-W4 and optimizer cases (adam_fp32, adamw_bf16, sgd_momentum_fp32) are
bench/torch_peers.py's (bench/workloads.hpp, bench/cases.hpp); so are the timing method (CUDA
events behind a sleep kernel; host time of each step() call beside it) and torch's variants
(foreach, fused, fused_graph = fused + capturable under CUDA-graph replay, compile =
torch.compile(opt.step)). Both sides keep states in the parameter dtype (torch's layout), so
AdamW bf16 moves 14 bytes per element on both.

Per row: GPU time per step (median), host time per step() call (median), extra device memory of
one step (torch.cuda.max_memory_allocated during a step minus memory_allocated before it),
% of the copy bandwidth measured in the same run, and for fusedopt the ratio best torch GPU
time / fusedopt GPU time (> 1: fusedopt faster) and torch fused host time / fusedopt host time.

Usage: python3 bench/compare_torch.py [--workloads W1,W3] [--optimizers adam_fp32] [--budget 250]
       [--variants foreach,fused,fused_graph,compile] [--out FILE] [--markdown]
JSON goes to --out, or $OUT/compare_torch.json when $OUT is set.

8-bit states (issue 16): `--variants ...,fusedopt_8bit` adds a row per case with fusedopt_torch's
8-bit class (Adam8bit for adam_fp32, AdamW8bit for adamw_bf16, SGD8bit for sgd_momentum_fp32;
min_8bit_size=0, so every tensor's moments are 8-bit), its % copy counted with the bytes it moves
(16.06 per element for Adam fp32), and the summary's `eight_bit_ratio` = best torch GPU time /
its GPU time (issue 16's target: >= 1.6 on W2 and W4 for AdamW fp32, whose traffic is Adam's).

CPU section (--cpu): CPU tensors, fusedopt_torch (fusedopt's host backend, torch.get_num_threads()
OpenMP threads) beside torch's forloop (foreach=False), foreach and fused CPU optimizers, on W1-W3
for Adam fp32, AdamW bf16, SGD momentum fp32 and Adagrad fp32; wall time per step() (median of
rounds) and the fraction of a multi-threaded 1 GiB torch copy_ measured in the same run. Targets
(issue 11): fusedopt at least as fast as torch fused on W1 and W2, at least 3x on W3.
"""

import argparse
import gc
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "integrations", "pytorch"))
import torch_peers as peers  # noqa: E402

# fusedopt_torch's 8-bit class per case and the bytes per element it moves (docs/quantized_states.md:
# a code per moment read and written, and the blocks' scales, 4 / 256 bytes per moment each way).
EIGHT_BIT = {"adam_fp32": ("Adam8bit", 16 + 4 * 4 / 256), "adamw_bf16": ("AdamW8bit", 10 + 4 * 4 / 256),
             "sgd_momentum_fp32": ("SGD8bit", 14 + 2 * 4 / 256)}
FUSEDOPT_VARIANTS = ("fusedopt", "fusedopt_8bit")  # the rest are torch's

# Issue 6's targets: fusedopt GPU time vs the best torch variant, and host time vs torch fused.
GPU_TARGETS = {"W1": 1.15, "W2": 1.15, "W3": 5.0, "W4": 1.0}
HOST_TARGET = {"W3": 20.0}


def extra_memory(step):
    """Device bytes one step allocates beyond what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return max(0, torch.cuda.max_memory_allocated() - before)


def fusedopt_step(optimizer, params, eight_bit=False):
    import fusedopt_torch

    cls_name, _, kwargs, _, _ = peers.OPTIMIZERS[optimizer]
    if eight_bit:
        cls_name, kwargs = EIGHT_BIT[optimizer][0], dict(kwargs, min_8bit_size=0)
    opt = getattr(fusedopt_torch, cls_name)(params, **kwargs)
    return opt.step, [opt]


def run_one(args, timer, copy_bps, workload, optimizer, variant, params):
    sizes = [p.numel() for p in params]
    per_element = EIGHT_BIT[optimizer][1] if variant == "fusedopt_8bit" else peers.OPTIMIZERS[optimizer][3]
    bytes_per_step = per_element * sum(sizes)
    row = dict(workload=workload, optimizer=optimizer, variant=variant, tensors=len(sizes), elements=sum(sizes),
               bytes_per_step=bytes_per_step)
    keep = None
    try:
        t0 = time.perf_counter()
        if variant in FUSEDOPT_VARIANTS:
            step, keep = fusedopt_step(optimizer, params, eight_bit=variant == "fusedopt_8bit")
        else:
            step, keep = peers.make_step(variant, optimizer, params, torch.device("cuda"))
        if variant == "compile":
            step()
            step()
            torch.cuda.synchronize()
            row["compile_s"] = time.perf_counter() - t0
        step()  # states exist before the memory is measured (torch creates them lazily too)
        row["extra_bytes"] = extra_memory(step)
        row.update(peers.measure(timer, step, 5, args.steps_per_round, args.rounds))
        row["pct_copy"] = 100.0 * bytes_per_step / (row["gpu_us"] * 1e-6) / copy_bps
        row["host_bound"] = row["host_us"] > row["gpu_us"]
        if variant in FUSEDOPT_VARIANTS:
            row["plan_rebuilds"] = keep[0].plan_rebuilds()
        print(f"  {workload} {optimizer:18s} {variant:12s} {row['gpu_us']:10.1f} us/step {row['pct_copy']:6.1f}% copy"
              f"  host {row['host_us']:8.1f} us  extra {row['extra_bytes'] / 2**20:8.2f} MiB", flush=True)
    except Exception as e:  # noqa: BLE001 - reported, never fatal
        peers.report_failure(row, e, args.verbose)
    finally:
        step = None
        peers.release(keep, torch.device("cuda"))
    return row


def summarize(rows):
    """One line per (workload, optimizer): fusedopt vs the best torch variant."""
    out = []
    keys = []
    for r in rows:
        if (r["workload"], r["optimizer"]) not in keys:
            keys.append((r["workload"], r["optimizer"]))
    for w, o in keys:
        mine = [r for r in rows if r["workload"] == w and r["optimizer"] == o]
        ours = next((r for r in mine if r["variant"] == "fusedopt" and "gpu_us" in r), None)
        eight = next((r for r in mine if r["variant"] == "fusedopt_8bit" and "gpu_us" in r), None)
        torch_rows = [r for r in mine if r["variant"] not in FUSEDOPT_VARIANTS and "gpu_us" in r]
        best = min(torch_rows, key=lambda r: r["gpu_us"]) if torch_rows else None
        fused = next((r for r in torch_rows if r["variant"] == "fused"), None)
        s = dict(workload=w, optimizer=o)
        if ours and best:
            s.update(fusedopt_gpu_us=ours["gpu_us"], fusedopt_host_us=ours["host_us"],
                     fusedopt_extra_bytes=ours["extra_bytes"], fusedopt_pct_copy=ours["pct_copy"],
                     best_torch=best["variant"], best_torch_gpu_us=best["gpu_us"], best_torch_pct_copy=best["pct_copy"],
                     gpu_ratio=best["gpu_us"] / ours["gpu_us"])
            if fused:
                s.update(torch_fused_host_us=fused["host_us"], host_ratio=fused["host_us"] / ours["host_us"])
            if o == "adam_fp32":
                s["gpu_target"] = GPU_TARGETS.get(w)
                s["host_target"] = HOST_TARGET.get(w)
        if eight and best:
            s.update(eight_bit_gpu_us=eight["gpu_us"], eight_bit_pct_copy=eight["pct_copy"],
                     eight_bit_ratio=best["gpu_us"] / eight["gpu_us"])
        out.append(s)
    return out


def print_tables(rows, summary, copy_bps, markdown=False):
    print()
    print(f"fusedopt_torch vs torch.optim (median GPU time per step; copy {copy_bps * 1e-9:.0f} GB/s read + write)")
    h = f"{'W':3s} {'optimizer':18s} {'variant':12s} {'GPU us':>9s} {'% copy':>7s} {'host us':>9s} {'extra MiB':>9s}"
    print(h)
    print("-" * len(h))
    for r in rows:
        if "error" in r or "skipped" in r:
            print(f"{r['workload']:3s} {r['optimizer']:18s} {r['variant']:12s} {r.get('skipped') or 'failed: ' + r['error'][:50]}")
            continue
        print(f"{r['workload']:3s} {r['optimizer']:18s} {r['variant']:12s} {r['gpu_us']:9.1f} {r['pct_copy']:6.1f}% "
              f"{r['host_us']:9.1f} {r['extra_bytes'] / 2**20:9.2f}")
    print()
    if markdown:
        print("| W | optimizer | fusedopt GPU us | best torch (variant) GPU us | ratio | target | fusedopt host us | "
              "torch fused host us | host ratio | extra MiB |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    else:
        print(f"{'W':3s} {'optimizer':18s} {'fusedopt':>9s} {'best torch':>22s} {'ratio':>6s} {'target':>6s} "
              f"{'host us':>8s} {'fused host':>10s} {'host x':>7s} {'extra':>6s}")
    for s in summary:
        if "gpu_ratio" not in s:
            print(f"{s['workload']:3s} {s['optimizer']:18s} incomplete")
            continue
        tgt = f"{s['gpu_target']:.2f}" if s.get("gpu_target") else "-"
        hx = f"{s['host_ratio']:.1f}" if "host_ratio" in s else "-"
        fh = f"{s['torch_fused_host_us']:.1f}" if "torch_fused_host_us" in s else "-"
        best = f"{s['best_torch_gpu_us']:.1f} ({s['best_torch']})"
        if markdown:
            print(f"| {s['workload']} | {s['optimizer']} | {s['fusedopt_gpu_us']:.1f} | {best} | {s['gpu_ratio']:.2f} | "
                  f"{tgt} | {s['fusedopt_host_us']:.1f} | {fh} | {hx} | {s['fusedopt_extra_bytes'] / 2**20:.2f} |")
        else:
            print(f"{s['workload']:3s} {s['optimizer']:18s} {s['fusedopt_gpu_us']:9.1f} {best:>22s} {s['gpu_ratio']:6.2f} "
                  f"{tgt:>6s} {s['fusedopt_host_us']:8.1f} {fh:>10s} {hx:>7s} {s['fusedopt_extra_bytes'] / 2**20:6.2f}")
    for s in summary:
        if "eight_bit_ratio" in s:
            print(f"8-bit: {s['workload']} {s['optimizer']} {EIGHT_BIT[s['optimizer']][0]} {s['eight_bit_gpu_us']:.1f} us "
                  f"({s['eight_bit_pct_copy']:.1f}% copy), best torch {s['best_torch_gpu_us']:.1f} us: "
                  f"{s['eight_bit_ratio']:.2f}x")


# CPU cases: (torch.optim class, dtype, kwargs, bytes per element at the minimum in torch's layout).
CPU_OPTIMIZERS = {
    "adam_fp32": ("Adam", torch.float32, dict(lr=1e-3), 28),
    "adamw_bf16": ("AdamW", torch.bfloat16, dict(lr=1e-3, weight_decay=1e-2), 14),
    "sgd_momentum_fp32": ("SGD", torch.float32, dict(lr=1e-2, momentum=0.9), 20),
    "adagrad_fp32": ("Adagrad", torch.float32, dict(lr=1e-2), 20),
}
CPU_TARGETS = {"W1": 1.0, "W2": 1.0, "W3": 3.0}


def cpu_copy_bandwidth(repetitions=10):
    """Bytes per second (read + write) of torch's multi-threaded copy_ of 1 GiB on the CPU."""
    a = torch.rand(1 << 28)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(repetitions):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    return 2 * a.numel() * 4 / sorted(times)[len(times) // 2]


def cpu_main(args, started):
    import fusedopt_torch

    cpu = torch.device("cpu")
    copy_bps = cpu_copy_bandwidth()
    print(f"CPU: torch {torch.__version__}, {torch.get_num_threads()} threads; copy_ {copy_bps * 1e-9:.1f} GB/s "
          f"read + write", flush=True)
    timer = peers.Timer(cpu)
    rows = []
    for w in [x for x in args.workloads.split(",") if x and x != "W4"]:
        sizes = peers.WORKLOADS[w][1]()
        for o in [x for x in args.cpu_optimizers.split(",") if x]:
            cls_name, dtype, kwargs, per_element = CPU_OPTIMIZERS[o]
            params = peers.make_params(sizes, dtype, cpu, seed=1)
            for v in ("fusedopt", "fused", "foreach", "forloop"):
                row = dict(workload=w, optimizer=o, variant=v, bytes_per_step=per_element * sum(sizes))
                if time.perf_counter() - started > args.budget:
                    row["skipped"] = "time budget"
                    rows.append(row)
                    continue
                try:
                    if v == "fusedopt":
                        opt = getattr(fusedopt_torch, cls_name)(params, **kwargs)
                    else:
                        flag = dict(fused=dict(fused=True), foreach=dict(foreach=True), forloop=dict(foreach=False))[v]
                        opt = getattr(torch.optim, cls_name)(params, **flag, **kwargs)
                    rounds = 1 if v == "forloop" else args.rounds
                    row.update(peers.measure(timer, opt.step, 2, 5, rounds))
                    row["GBps"] = row["bytes_per_step"] / (row["gpu_us"] * 1e-6) * 1e-9
                    row["pct_copy"] = 100.0 * row["GBps"] * 1e9 / copy_bps
                    print(f"  {w} {o:18s} {v:9s} {row['gpu_us'] / 1e3:9.2f} ms/step {row['GBps']:7.1f} GB/s "
                          f"{row['pct_copy']:6.1f}% copy", flush=True)
                except Exception as e:  # noqa: BLE001 - reported, never fatal
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    print(f"  {w} {o:18s} {v:9s} FAILED {row['error']}", flush=True)
                rows.append(row)
                opt = None
            del params
            gc.collect()
    print(f"\nCPU: fusedopt_torch vs torch.optim (ms per step; copy_ {copy_bps * 1e-9:.1f} GB/s)")
    print("| W | optimizer | fusedopt ms | % copy | torch fused ms | foreach ms | forloop ms | vs fused | target |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w in dict.fromkeys(r["workload"] for r in rows):
        for o in dict.fromkeys(r["optimizer"] for r in rows if r["workload"] == w):
            got = {r["variant"]: r for r in rows if r["workload"] == w and r["optimizer"] == o and "gpu_us" in r}
            ms = {v: (f"{got[v]['gpu_us'] / 1e3:.2f}" if v in got else "-") for v in ("fusedopt", "fused", "foreach", "forloop")}
            ratio = (f"{got['fused']['gpu_us'] / got['fusedopt']['gpu_us']:.2f}x" if "fused" in got and "fusedopt" in got
                     else "-")
            pct = f"{got['fusedopt']['pct_copy']:.1f}" if "fusedopt" in got else "-"
            print(f"| {w} | {o} | {ms['fusedopt']} | {pct} | {ms['fused']} | {ms['foreach']} | {ms['forloop']} | {ratio} | "
                  f"{CPU_TARGETS.get(w, '-')}x |")
    out = args.out or (os.path.join(os.environ["OUT"], "compare_torch_cpu.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(dict(torch=torch.__version__, threads=torch.get_num_threads(), copy_GBps=copy_bps * 1e-9,
                           results=rows), f, indent=1)
        print(f"wrote {out}")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="W1,W2,W3,W4")
    p.add_argument("--optimizers", default=",".join(peers.OPTIMIZERS))
    p.add_argument("--variants", default=",".join(peers.VARIANTS), help="torch variants (fusedopt always runs), and fusedopt_8bit (8-bit states)")
    p.add_argument("--compile-all", action="store_true", help="torch.compile every case, not only Adam W1/W2/W4")
    p.add_argument("--budget", type=float, default=250.0, help="seconds for everything; later rows are skipped")
    p.add_argument("--steps-per-round", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--cpu", action="store_true", help="the CPU section instead of the GPU one")
    p.add_argument("--cpu-optimizers", default=",".join(CPU_OPTIMIZERS))
    args = p.parse_args()
    started = time.perf_counter()
    if args.cpu:
        return cpu_main(args, started)
    if not torch.cuda.is_available():
        print("compare_torch: no CUDA device visible to torch, nothing to measure")
        return 0
    import fusedopt_torch

    if not fusedopt_torch.with_cuda():
        print("compare_torch: fusedopt_torch was built without CUDA")
        return 1
    timer = peers.Timer(torch.device("cuda"))
    copy_bps = peers.copy_bandwidth(timer, torch.device("cuda"))
    context = dict(torch=torch.__version__, cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(),
                   copy_GBps=copy_bps * 1e-9, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   method="torch_peers.measure: median CUDA-event time per step behind a sleep kernel")
    print(f"torch {context['torch']} on {context['gpu']}; copy {copy_bps * 1e-9:.0f} GB/s", flush=True)
    out = args.out or (os.path.join(os.environ["OUT"], "compare_torch.json") if os.environ.get("OUT") else None)
    variants = [v for v in args.variants.split(",") if v]
    rows, deferred = [], []

    def save(final=False):
        if out:
            context["total_s"] = time.perf_counter() - started
            context["complete"] = final
            with open(out, "w") as f:
                json.dump(dict(context=context, results=rows, summary=summarize(rows)), f, indent=1)

    for w in [x for x in args.workloads.split(",") if x]:
        sizes = peers.WORKLOADS[w][1]()
        for o in [x for x in args.optimizers.split(",") if x]:
            if "compile" in variants and (args.compile_all or (w, o) in peers.DEFAULT_COMPILE):
                deferred.append((w, o))
            todo = ["fusedopt"] + [v for v in variants if v != "compile"]
            if time.perf_counter() - started > args.budget:
                rows.extend(dict(workload=w, optimizer=o, variant=v, skipped="time budget") for v in todo)
                continue
            params = peers.make_params(sizes, peers.OPTIMIZERS[o][1], torch.device("cuda"), seed=1)
            for v in todo:
                if time.perf_counter() - started > args.budget:
                    rows.append(dict(workload=w, optimizer=o, variant=v, skipped="time budget"))
                    continue
                rows.append(run_one(args, timer, copy_bps, w, o, v, params))
                save()
            del params
            gc.collect()
            torch.cuda.empty_cache()
    for w, o in deferred:
        if time.perf_counter() - started > args.budget - 45:
            rows.append(dict(workload=w, optimizer=o, variant="compile", skipped="time budget"))
            continue
        params = peers.make_params(peers.WORKLOADS[w][1](), peers.OPTIMIZERS[o][1], torch.device("cuda"), seed=1)
        rows.append(run_one(args, timer, copy_bps, w, o, "compile", params))
        save()
        del params
        gc.collect()
        torch.cuda.empty_cache()
    save(final=True)
    print_tables(rows, summarize(rows), copy_bps, args.markdown)
    print(f"total {time.perf_counter() - started:.0f} s")
    if out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
