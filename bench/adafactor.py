#!/usr/bin/env python3
"""fusedopt_torch.Adafactor against torch.optim.Adafactor (foreach and for-loop), and
fusedopt_torch.CAME against yangluo7/CAME's CAME.py (as tests/test_came.py transcribes it: one
tensor at a time), one step, float32 parameters and gradients on cuda:0, over GPT-2 small's 148
parameters (124M elements: embeddings, matrices, biases and norms) and over 200 small matrices
(256 x 256 .. 1024 x 256).

Timing as bench/torch_peers.py (its Timer, measure() and timed()): median GPU time per step and
median host time per step() call; the fraction of a 1 GiB device-to-device copy measured in the
same run, at the minimum bytes of a step (parameter and gradient read, parameter written: 12 bytes
per element; the statistics are rows and columns). fusedopt's step is three passes over the
tensors (the factored sums of grad^2, the RMS of the parameter and of the update, the update):
24 bytes per element. CAME's minimum adds exp_avg read and written (20 bytes per element); its step
is three passes (37 bytes per element).

Usage, from the repository root on the GPU machine:
  python3 bench/adafactor.py [--optimizers adafactor,came] [--variants fusedopt,...] [--out FILE]
      (JSON to --out, or $OUT/adafactor.json)
  ncu --profile-from-start off ... python3 bench/adafactor.py --profile
      (one fusedopt step over GPT-2 small's tensors between cudaProfilerStart and Stop, after two
      unprofiled steps that build and warm the plan: its kernels alone for Nsight Compute)
"""
import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integrations", "pytorch"))
import torch_peers as peers  # noqa: E402

import fusedopt_torch as ft  # noqa: E402


def gpt2_shapes():
    shapes = [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,), (768, 3072), (3072,),
                   (3072, 768), (768,)]
    return shapes + [(768,), (768,)]


def small_shapes():
    return [s for _ in range(50) for s in ((256, 256), (512, 256), (256, 512), (1024, 256))]


def profile_one_step(device, optimizers):
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=gen).requires_grad_() for s in gpt2_shapes()]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen)
    for name in optimizers:
        opt = ft.Adafactor(params, lr=1e-2) if name == "adafactor" else ft.CAME(params, lr=1e-4)
        for _ in range(2):
            opt.step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        opt.step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def variants_of(optimizer):
    """(the variants: name -> constructor over a parameter list, the minimum bytes per element)."""
    if optimizer == "adafactor":
        return {"fusedopt": lambda ps: ft.Adafactor(ps, lr=1e-2),
                "torch_foreach": lambda ps: torch.optim.Adafactor(ps, lr=1e-2, foreach=True),
                "torch_for_loop": lambda ps: torch.optim.Adafactor(ps, lr=1e-2, foreach=False)}, 12
    reference = peers.test_module("test_came").ReferenceCAME  # CAME.py's step, in PyTorch
    return {"fusedopt": lambda ps: ft.CAME(ps, lr=2e-4),
            "came_py": lambda ps: reference(ps, lr=2e-4)}, 20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ["OUT"], "adafactor.json") if os.environ.get("OUT") else None)
    parser.add_argument("--profile", action="store_true", help="one fusedopt step of each optimizer between cudaProfilerStart/Stop")
    parser.add_argument("--optimizers", default="adafactor,came")
    parser.add_argument("--variants", default=None,
                        help="comma-separated references to time beside fusedopt, which is always timed "
                             "(default: all of them)")
    args = parser.parse_args()
    device = torch.device("cuda")
    if args.profile:
        return profile_one_step(device, args.optimizers.split(","))
    timer = peers.Timer(device)
    copy_bps = peers.copy_bandwidth(timer, device)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbps=copy_bps / 1e9, rows=[])
    print(f"copy: {copy_bps / 1e9:.0f} GB/s on {result['device']}")
    print("| optimizer | workload | variant | GPU us/step | host us/step | % of the copy (minimum bytes) | "
          "fusedopt's speedup |")
    print("|---|---|---|---:|---:|---:|---:|")
    for optimizer, (name, shapes) in ((o, w) for o in args.optimizers.split(",") for w in
                                      (("GPT-2 small, 148 tensors", gpt2_shapes()),
                                       ("200 small matrices", small_shapes()))):
        variants, minimum_bytes = variants_of(optimizer)
        if args.variants:
            variants = {k: v for k, v in variants.items() if k in args.variants.split(",") or k == "fusedopt"}
        gen = torch.Generator(device=device).manual_seed(0)
        n = sum(torch.Size(s).numel() for s in shapes)
        times = {}
        for variant, make in variants.items():
            params = [torch.randn(s, device=device, generator=gen).requires_grad_() for s in shapes]
            for p in params:
                p.grad = torch.randn(p.shape, device=device, generator=gen)
            try:
                opt = make(params)
                r = peers.timed(timer, opt.step, copy_bps, n, minimum_bytes)
            except Exception as e:  # recorded, never fatal
                r = dict(error=f"{type(e).__name__}: {e}")
            times[variant] = r
            result["rows"].append(dict(optimizer=optimizer, workload=name, variant=variant, elements=n,
                                       minimum_bytes=minimum_bytes, **r))
            del params, opt
            torch.cuda.empty_cache()
        for variant, r in times.items():
            if "error" in r:
                print(f"| {optimizer} | {name} | {variant} | {r['error']} | | | |")
                continue
            speedup = r["gpu_us"] / times["fusedopt"]["gpu_us"] if "gpu_us" in times["fusedopt"] else float("nan")
            print(f"| {optimizer} | {name} | {variant} | {r['gpu_us']:.1f} | {r['host_us']:.1f} | {r['pct_copy']:.1f} | "
                  f"{speedup:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
