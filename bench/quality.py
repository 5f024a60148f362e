#!/usr/bin/env python3
"""Training quality of low-precision optimizer variants on real text (issue 16 item 4).

A small GPT (bench/train_loop.py's architecture) learns bytes of real text: the Python sources
of an installed package (torch's by default), split into a training and a held-out part. Each
variant trains the same model from the same weights on the same batches, with AdamW (lr warmed
up then decayed by a cosine, weight decay 0.1, betas 0.9/0.95), and records the training loss of
every step and the held-out loss at the end:

  fp32 torch          fp32 parameters, torch.optim.AdamW(fused=True): the yardstick
  fp32 fusedopt       fp32 parameters, fusedopt_torch.AdamW
  bf16                bfloat16 parameters (model.to(torch.bfloat16)), fusedopt_torch.AdamW
  bf16 kahan          the same with kahan=True (a bf16 compensation state)
  bf16 stochastic     the same with stochastic_rounding=True
  fp32 8bit           fp32 parameters, fusedopt_torch.AdamW8bit (8-bit moments of the tensors of
                      at least 4096 elements, min_8bit_size's default, as bitsandbytes')
  bf16 8bit, bf16 8bit kahan   (not run by default) bfloat16 parameters with AdamW8bit, plain or kahan=True

Prints a table (final losses as the mean of the last 50 steps' training losses, and the
held-out loss) and writes the curves to --out (JSON); bench/plot_quality.py draws them.

Usage: python3 bench/quality.py [--steps 1000] [--device cuda] [--out quality.json]
"""

import argparse
import glob
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "integrations", "pytorch"))
from train_loop import GPT  # noqa: E402


def corpus(package, limit_mb):
    """The bytes of the package's .py files, in a fixed order, up to limit_mb."""
    root = os.path.dirname(__import__(package).__file__)
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= limit_mb << 20:
            break
    return torch.frombuffer(bytes(data[: limit_mb << 20]), dtype=torch.uint8).long()


def lr_at(step, steps, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(name, params, lr):
    kw = dict(lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    if name == "fp32 torch":
        return torch.optim.AdamW(params, fused=True, **kw)
    import fusedopt_torch

    extra = dict(kahan=True) if name.endswith("kahan") else dict(stochastic_rounding=True) if name.endswith(
        "stochastic") else {}
    cls = fusedopt_torch.AdamW8bit if "8bit" in name else fusedopt_torch.AdamW
    return cls(params, **kw, **extra)


def run(name, args, data, initial, device):
    torch.manual_seed(0)
    model = GPT(256, args.dim, args.layers, args.dim // 64, args.seq).to(device)
    model.load_state_dict(initial)
    if name.startswith("bf16"):
        model = model.to(torch.bfloat16)
    opt = make_optimizer(name, list(model.parameters()), args.lr)
    train, held = data[: -args.held_out], data[-args.held_out:]
    gen = torch.Generator().manual_seed(1)
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        at = torch.randint(0, train.numel() - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([train[i : i + args.seq + 1] for i in at.tolist()]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        chunks = held[: (held.numel() // (args.seq + 1)) * (args.seq + 1)].view(-1, args.seq + 1)[:256].to(device)
        logits = model(chunks[:, :-1])
        held_loss = F.cross_entropy(logits.float().reshape(-1, 256), chunks[:, 1:].reshape(-1)).item()
    final = sum(losses[-50:]) / len(losses[-50:])
    return dict(variant=name, losses=losses, final_train=final, held_out=held_loss, seconds=seconds)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--package", default="torch")
    p.add_argument("--corpus-mb", type=int, default=16)
    p.add_argument("--held-out", type=int, default=1 << 20)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--variants", default="fp32 torch,fp32 fusedopt,fp32 8bit,bf16,bf16 kahan,bf16 stochastic")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    data = corpus(args.package, args.corpus_mb)
    torch.manual_seed(0)
    initial = {k: v.clone() for k, v in GPT(256, args.dim, args.layers, args.dim // 64, args.seq).state_dict().items()}
    n = sum(v.numel() for v in initial.values())
    print(f"quality: {data.numel() / 1e6:.1f} MB of {args.package}'s Python sources, GPT {args.layers} layers d {args.dim} "
          f"({n / 1e6:.1f}M parameters), {args.steps} steps of {args.batch} x {args.seq} bytes, peak lr {args.lr}, "
          f"torch {torch.__version__}, {device}", flush=True)
    rows = []
    for name in args.variants.split(","):
        rows.append(run(name, args, data, initial, device))
        r = rows[-1]
        print(f"  {name:16s} final train loss {r['final_train']:.4f}  held-out {r['held_out']:.4f}  ({r['seconds']:.0f} s)",
              flush=True)
    base = next((r for r in rows if r["variant"] == "fp32 torch"), rows[0])
    print("\n| variant | final train loss (mean of last 50 steps) | vs fp32 torch | held-out loss | vs fp32 torch |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['final_train']:.4f} | {100 * (r['final_train'] / base['final_train'] - 1):+.2f}% | "
              f"{r['held_out']:.4f} | {100 * (r['held_out'] / base['held_out'] - 1):+.2f}% |")
    out = args.out or (os.path.join(os.environ["OUT"], "quality.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(dict(args=vars(args), torch=torch.__version__, rows=rows), f)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
