#!/usr/bin/env python3
"""The library's newer optimizers through fusedopt_torch against their PyTorch references, in one
process, on W1-W4 (bench/torch_peers.py's workloads, float32; issue 42):

  fusedopt     the fusedopt_torch class (fusedopt_torch/library_rules.py): one fused launch per
               step, plus one reduction pass for StableAdamW and CAdamW (CWDAdamW: none)
  reference    the reference algorithm one tensor at a time (the classes of
               integrations/pytorch/tests/test_library_rules.py, written from the official
               repositories; torch.optim.Rprop with foreach=False for Rprop)
  foreach      torch.optim.Rprop / ASGD with foreach=True; for Adan, ADOPT and Schedule-Free
               AdamW / SGD, whose official repositories also have a multi-tensor form, that form
               (the references' step_foreach: torch._foreach_* over every tensor; the others'
               official code is a single-tensor loop)
  compiled     with --compile: the reference's step under torch.compile (default options, after
               three warm-up calls that compile it), on W1, W2 and W4 (W3's 2000 tensors make a
               graph of tens of thousands of operations); a failure to compile is recorded in
               the row, not raised

Rprop's and ASGD's references are torch.optim's own (foreach=False); Prodigy's is
konstmish/prodigy's step as tests/test_prodigy.py writes it (two `.item()` per tensor; it also
clones each gradient first, 8 bytes an element that prodigy.py does not move).

Per row: GPU time per step (median of rounds, CUDA events behind a sleep kernel: torch_peers'
Timer), host time per step() call, and fusedopt's fraction of a device-to-device copy measured
in the same run at the bytes it must move per element, counting every pass (BYTES below).

Usage: python3 bench/library_rules.py [--workloads W1,W2,W3,W4] [--optimizers a,b] [--compile] [--out FILE]
"""

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "integrations", "pytorch"))
import torch_peers as peers  # noqa: E402

import fusedopt_torch as ft  # noqa: E402


# Bytes per float32 element: param read and written (8), grad read (4), each state read and
# written (8); a reduction pass reads what it needs once more (StableAdamW: grad and exp_avg_sq;
# CAdamW: grad and exp_avg, whose sign its mask compares: the compiler drops the loads the
# count does not need, exp_avg_sq's and the decoupled decay's param).
# ASGD: param and ax read and written, grad read. Prodigy: its reduction pass reads grad, p0, param
# and s (16 B), its update reads param, grad, s and both moments and writes param, s and the
# moments (36 B).
BYTES = {"Rprop": 28, "ASGD": 20, "AdEMAMix": 36, "Adan": 44, "ADOPT": 28, "StableAdamW": 28 + 8, "CAdamW": 28 + 8,
         "CWDAdamW": 28, "ScheduleFreeAdamW": 28, "ScheduleFreeSGD": 20, "Prodigy": 16 + 36}
TORCH_PEERS = {"Rprop": torch.optim.Rprop, "ASGD": torch.optim.ASGD}
OPTIONS = {"Rprop": dict(lr=1e-3), "ASGD": dict(lr=1e-3), "Prodigy": dict(lr=1.0),
           "AdEMAMix": dict(lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, weight_decay=0.01),
           "Adan": dict(lr=1e-3, weight_decay=0.02), "ADOPT": dict(lr=1e-3), "StableAdamW": dict(lr=1e-3),
           "CAdamW": dict(lr=1e-3), "CWDAdamW": dict(lr=1e-3, weight_decay=0.1), "ScheduleFreeAdamW": dict(lr=1e-3, warmup_steps=100),
           "ScheduleFreeSGD": dict(lr=1e-2, warmup_steps=100)}


def prodigy_reference_step(prodigy, params, options):
    """tests/test_prodigy.py's reference_step over `params` (their .grad), its state and scalars
    carried from call to call as the reference's group keeps them."""
    states = [dict(s=torch.zeros_like(p), p0=p.detach().clone(), exp_avg=torch.zeros_like(p),
                   exp_avg_sq=torch.zeros_like(p)) for p in params]
    d0 = 1e-6
    carried = dict(scalars=(d0, d0, 0.0), k=0)
    tensors = [p.detach() for p in params]
    grads = [p.grad for p in params]

    def step():
        carried["scalars"] = prodigy.reference_step(tensors, grads, states, carried["scalars"], carried["k"], options)
        carried["k"] += 1
    return step


def reference_step(refs, prodigy, name, params, options, foreach=False):
    """A fresh reference's step over `params` (their .grad), with its own state: the
    single-tensor loop, or with `foreach` its multi-tensor form (None where it has none).
    torch.optim's own class for Rprop and ASGD, tests/test_prodigy.py's step for Prodigy, the
    classes of tests/test_library_rules.py for the others."""
    if name in TORCH_PEERS:
        return TORCH_PEERS[name](params, foreach=foreach, **options).step
    if name == "Prodigy":
        return None if foreach else prodigy_reference_step(prodigy, params, options)
    cls = getattr(refs, f"{name}Reference")
    if foreach and not hasattr(cls, "step_foreach"):
        return None
    ref = cls([], **options)
    ref.params = [p.detach() for p in params]
    ref.state = [dict() for _ in params]
    ref.clone_grads = False
    step, grads = ref.step_foreach if foreach else ref.step, [p.grad for p in params]
    return lambda: step(grads)


def compiled(step):
    """torch.compile(step), compiled by three calls (a second one may recompile with the step
    count dynamic); a string saying why where it does not compile."""
    try:
        fn = torch.compile(step)
        for _ in range(3):
            fn()
        return fn
    except Exception as e:  # noqa: BLE001 (a peer that does not compile is a row, not a crash)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="W1,W2,W3,W4")
    parser.add_argument("--optimizers", default=",".join(BYTES))
    parser.add_argument("--compile", action="store_true", help="also the reference under torch.compile (W1, W2, W4)")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    timer = peers.Timer(device)
    copy_bps = peers.copy_bandwidth(timer, device)
    refs = peers.test_module("test_library_rules")
    prodigy = peers.test_module("test_prodigy")
    rows = []
    print(f"copy {copy_bps / 1e9:.0f} GB/s; GPU us per step (fusedopt's % of the copy), host us per step() call")
    for w in args.workloads.split(","):
        sizes = peers.WORKLOADS[w][1]()
        n = sum(sizes)
        for name in args.optimizers.split(","):
            options = OPTIONS[name]
            row = dict(workload=w, optimizer=name, elements=n, bytes_per_element=BYTES[name])
            params = peers.make_params(sizes, torch.float32, device, 1)
            opt = getattr(ft, name)(params, **options)
            opt.step()  # compiles (or loads) the unit, creates the states
            row["fusedopt"] = peers.timed(timer, opt.step, copy_bps, n, BYTES[name])
            del opt
            peers_of = {"reference": reference_step(refs, prodigy, name, params, options)}
            foreach = reference_step(refs, prodigy, name, params, options, foreach=True)
            if foreach is not None:
                peers_of["foreach"] = foreach
            if args.compile and w != "W3":
                fn = compiled(reference_step(refs, prodigy, name, params, options))  # a fresh one
                if isinstance(fn, str):
                    row["compiled_error"] = fn
                else:
                    peers_of["compiled"] = fn
            for variant, step in peers_of.items():
                step()
                row[variant] = peers.timed(timer, step, copy_bps, n, BYTES[name])
                row[f"speedup_vs_{variant}"] = row[variant]["gpu_us"] / row["fusedopt"]["gpu_us"]
            if args.compile:
                torch._dynamo.reset()  # each optimizer's graphs apart
            del peers_of, params
            torch.cuda.empty_cache()
            rows.append(row)
            f = row["fusedopt"]
            text = " | ".join(f"{v} {row[v]['gpu_us']:9.1f} us ({row[f'speedup_vs_{v}']:.1f}x)"
                              for v in ("reference", "foreach", "compiled") if v in row)
            if "compiled_error" in row:
                text += f" | compiled: {row['compiled_error']}"
            print(f"{w} {name:18s} fusedopt {f['gpu_us']:9.1f} us ({f['pct_copy']:5.1f}% copy, host "
                  f"{f['host_us']:.0f} us) | {text}", flush=True)
    result = dict(device=torch.cuda.get_device_name(), copy_gbps=copy_bps / 1e9, rows=rows)
    out = args.out or (os.path.join(os.environ["OUT"], "library_rules.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
