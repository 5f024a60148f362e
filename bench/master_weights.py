#!/usr/bin/env python3
"""CUDA step time of AdamW(master_weights=True) (docs/pytorch.md, "Low-precision parameters"):
fusedopt_torch over bf16 GPT-2-small-shaped parameters against fusedopt_torch's AdamW and torch's
fused AdamW over float32 ones (each 28 bytes an element), and a device copy of those bytes, in
one run. Best of 5 rounds of 50 steps after 5, CUDA events.

Usage: python3 bench/master_weights.py (a CUDA machine; seconds)
"""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "integrations", "pytorch"))
from train_loop import GPT  # noqa: E402

import fusedopt_torch as ft  # noqa: E402

BYTES = 28  # per element: AdamW over float32, or over bf16 with a float32 master


def step_us(step, reps=50):
    for _ in range(5):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(reps):
            step()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def main():
    torch.manual_seed(0)
    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in GPT(vocab=50257, d=768, layers=12, heads=12, context=1024).parameters()]
    n = sum(torch.Size(s).numel() for s in shapes)

    def params(dtype):
        ps = [torch.nn.Parameter((torch.randn(s, device="cuda") * 0.02).to(dtype)) for s in shapes]
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-3
        return ps

    src = torch.empty(n * BYTES // 2 // 4, device="cuda")  # read and written: BYTES an element
    dst = torch.empty_like(src)
    copy = step_us(lambda: dst.copy_(src))
    rows = [("device copy of the same bytes", copy)]

    for name, make in (("fusedopt AdamW(master_weights) bf16", lambda: ft.AdamW(params(torch.bfloat16),
                                                                                  master_weights=True)),
                       ("fusedopt AdamW float32", lambda: ft.AdamW(params(torch.float32))),
                       ("torch AdamW(fused=True) float32", lambda: torch.optim.AdamW(params(torch.float32), fused=True))):
        opt = make()
        rows.append((name, step_us(opt.step)))
        del opt
    print(f"{torch.cuda.get_device_name()}, {n / 1e6:.1f}M elements in {len(shapes)} tensors, {BYTES} bytes an element")
    for name, us in rows:
        print(f"{name:40s} {us:8.1f} us  {copy / us:6.1%} of the copy")


if __name__ == "__main__":
    main()
