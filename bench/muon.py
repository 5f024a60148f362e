#!/usr/bin/env python3
"""Muon, fused (issue 43): fusedopt_torch.Muon against torch.optim.Muon and a batched PyTorch Muon,
and the loss curve of a small GPT-2-like model trained with each.

Speed, float32 parameters and gradients on cuda:0, two workloads of 2-D matrices:

  gpt2    GPT-2 small's 48 hidden matrices (12 x (768,2304), (768,768), (768,3072), (3072,768))
  small   200 small matrices (50 each of (256,256), (512,256), (256,512), (1024,256))

and per workload these variants of one optimizer step (lr 0.02, torch.optim.Muon's defaults):

  fusedopt             fusedopt_torch.Muon, eager: a fused pass, Newton-Schulz batched per shape
                       (strided-batched GEMMs), a fused pass
  fusedopt_graph       the same step captured in a CUDA graph and replayed
  fusedopt_ns0         fusedopt_torch.Muon with ns_steps=0: the fused passes alone, for the share
                       of the step outside the GEMMs (t(ns0) / t(fusedopt))
  torch                torch.optim.Muon, eager (one matrix at a time)
  batched_torch        BatchedMuon below: per shape, torch.stack of the gradients, the elementwise
                       part and the update under torch.compile, Newton-Schulz with torch.bmm and
                       torch.baddbmm on the stacked bfloat16 tensor (eager if the compile fails)
  batched_torch_graph  the same step captured in a CUDA graph and replayed

Timing as in bench/torch_peers.py (its Timer and measure()): a sleep kernel holds the stream
while the host enqueues a round of steps, CUDA events between steps; reported are the median
GPU time per step and the median host time per step() call, and the speedup over torch.optim.Muon
on each. A sanity check runs one step of fusedopt, torch and batched_torch from identical inputs
and reports the largest parameter difference to torch relative to the largest update (bfloat16
Newton-Schulz: they agree to bfloat16 roundings, not bitwise).

Loss curve (unless --skip-curve): a GPT-2-like causal LM (d_model 256, 4 layers, 4 heads, seq 128,
batch 32, untied lm_head, bf16 autocast) on a token stream from a fixed random order-2 Markov
chain, --steps steps from the same initialisation and data order with (i) fusedopt_torch.
MuonWithAdamW, (ii) torch.optim.Muon on the same hidden matrices + torch.optim.AdamW on the rest,
(iii) torch.optim.AdamW alone. The curves go to docs/muon_loss.png (when matplotlib is there), the
losses and final losses (mean of the last 20 steps) to the JSON.

Usage, from the repository root on the GPU machine:
  python3 bench/muon.py [--skip-curve] [--skip-speed] [--steps 1000] [--budget 400] [--out FILE]
The JSON goes to --out, or to $OUT/muon.json when $OUT is set.
"""

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback

import torch
import torch._dynamo  # noqa: F401 - reset() and config below
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "integrations", "pytorch"))
import torch_peers as peers  # noqa: E402
from plot_quality import smooth  # noqa: E402

import fusedopt_torch as ft  # noqa: E402
from fusedopt_torch.muon import default_use_muon  # noqa: E402

LR = 0.02
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
WORKLOADS = {
    "gpt2": ("GPT-2 small's 48 hidden matrices", [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12),
    "small": ("200 small matrices", [(256, 256)] * 50 + [(512, 256)] * 50 + [(256, 512)] * 50 + [(1024, 256)] * 50),
}
VARIANTS = ["fusedopt", "fusedopt_graph", "fusedopt_ns0", "torch", "batched_torch", "batched_torch_graph"]
COMPILE_MARGIN_S = 60  # a compile of a workload's functions is started only with this much time left


# ---- the batched PyTorch Muon ----------------------------------------------------------------


def _make_pre(momentum, nesterov, eps, transpose):
    """The elementwise part of one shape's matrices: momentum, Nesterov, bfloat16, the transposition
    to rows <= cols and the division by each matrix's Frobenius norm (torch.optim.Muon's order)."""

    def pre(grads, buf):
        g = torch.stack(grads)
        buf.lerp_(g, 1 - momentum)
        x = (g.lerp(buf, momentum) if nesterov else buf).bfloat16()
        if transpose:
            x = x.mT
        x = x / torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=eps)
        return x.contiguous()

    return pre


def _make_post(decay, step, transpose):
    """The update of one shape's matrices: p *= decay, then p -= step * O (O back to the shape)."""

    def post(params, x):
        o = x.mT if transpose else x
        torch._foreach_mul_(params, decay)
        torch._foreach_add_(params, list(o.unbind(0)), alpha=-step)

    return post


def newton_schulz(x, coefficients, steps):
    """torch.optim.Muon's quintic iteration on a stack of [n, rows, cols] matrices (rows <= cols)."""
    a, b, c = coefficients
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    return x


class BatchedMuon:
    """torch.optim.Muon's algorithm (adjust_lr_fn "original") batched over the matrices of each shape,
    as Dion and physicsnemo batch it: the momentum buffers of a shape live in one stacked tensor,
    the gradients are stacked at every step and the update is unbound back onto the parameters."""

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=NS_COEFFICIENTS, eps=1e-7, ns_steps=5, compile=True):
        self.ns_coefficients, self.ns_steps = ns_coefficients, ns_steps
        by_shape = {}
        for p in params:
            by_shape.setdefault(tuple(p.shape), []).append(p)
        wrap = (lambda f: torch.compile(f, dynamic=False)) if compile else (lambda f: f)
        self.groups = []
        for (rows, cols), ps in by_shape.items():
            transpose = rows > cols
            ratio = math.sqrt(max(1.0, rows / cols))
            self.groups.append(dict(
                params=ps,
                buf=torch.zeros((len(ps), rows, cols), dtype=ps[0].dtype, device=ps[0].device),
                pre=wrap(_make_pre(momentum, nesterov, eps, transpose)),
                post=wrap(_make_post(1 - lr * weight_decay, lr * ratio, transpose))))

    @torch.no_grad()
    def step(self):
        for g in self.groups:
            x = g["pre"]([p.grad for p in g["params"]], g["buf"])
            g["post"](g["params"], newton_schulz(x, self.ns_coefficients, self.ns_steps))


def allow_recompiles():
    """One compiled function per shape and workload: more cache entries than dynamo's default 8
    (the limits' names before torch 2.6 second)."""
    config = torch._dynamo.config
    for names in (("recompile_limit", "cache_size_limit"), ("accumulated_recompile_limit", "accumulated_cache_size_limit")):
        name = next((n for n in names if hasattr(config, n)), None)
        if name:
            setattr(config, name, max(getattr(config, name), 256))


# ---- speed -------------------------------------------------------------------------------------


def make_matrices(shapes, seed=1):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    params = []
    for shape in shapes:
        p = nn.Parameter(torch.randn(shape, device="cuda", generator=g) * 0.02)
        p.grad = torch.randn(shape, device="cuda", generator=g) * 1e-3
        params.append(p)
    return params


def graphed(step):
    """The step captured in a CUDA graph after warm-up steps on a side stream (torch's recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def make_variant(variant, params, compiled):
    """Returns (step function, the objects to keep alive while it is timed)."""
    if variant in ("fusedopt", "fusedopt_graph", "fusedopt_ns0"):
        opt = ft.Muon(params, lr=LR, ns_steps=0 if variant == "fusedopt_ns0" else 5)
    elif variant == "torch":
        opt = torch.optim.Muon(params, lr=LR)
    else:
        opt = BatchedMuon(params, lr=LR, compile=compiled)
    if variant.endswith("_graph"):
        graph = graphed(opt.step)
        return graph.replay, [opt, graph]
    return opt.step, [opt]


def sanity(shapes, row, args):
    """One step of fusedopt, torch and batched_torch from identical inputs: the largest parameter
    difference to torch over the largest update. Also compiles batched_torch's functions for this
    workload (the timed variants reuse dynamo's cache), falling back to eager when that fails or
    would not fit in the time left; returns whether batched_torch is compiled."""
    torch._dynamo.reset()  # this workload's shapes only in the cache
    p0 = [p.detach().clone() for p in make_matrices(shapes)]
    reference = make_matrices(shapes)
    torch.optim.Muon(reference, lr=LR).step()
    update = max((p - q).abs().max().item() for p, q in zip(reference, p0))

    def compare(name, step):
        params = make_matrices(shapes)
        t = time.perf_counter()
        step(params)
        torch.cuda.synchronize()
        row[f"{name}_first_step_s"] = time.perf_counter() - t
        diff = max((p - q).abs().max().item() for p, q in zip(params, reference))
        row[f"{name}_vs_torch"] = dict(max_abs_diff=diff, max_abs_update=update, relative=diff / update)
        print(f"  one step, {name} vs torch.optim.Muon: max |diff| {diff:.3e} = {diff / update:.3%} "
              f"of the max |update| {update:.3e}", flush=True)

    compiled = time.perf_counter() - args.started < args.speed_deadline - COMPILE_MARGIN_S
    if compiled:
        try:
            compare("batched_torch", lambda ps: BatchedMuon(ps, lr=LR, compile=True).step())
            row["batched_compile"] = f"compiled (first step {row['batched_torch_first_step_s']:.1f} s)"
        except Exception as e:  # noqa: BLE001 - eager is the fallback
            compiled = False
            row["batched_compile"] = f"failed, eager: {type(e).__name__}: {e}"[:500]
            print(f"  torch.compile failed, batched_torch runs eager: {e}", flush=True)
            if args.verbose:
                traceback.print_exc()
    else:
        row["batched_compile"] = "not tried (time budget), eager"
    checks = {"fusedopt": lambda ps: ft.Muon(ps, lr=LR).step()}
    if not compiled:
        checks["batched_torch"] = lambda ps: BatchedMuon(ps, lr=LR, compile=False).step()
    for name, step in checks.items():
        try:
            compare(name, step)
        except Exception as e:  # noqa: BLE001 - reported, never fatal
            row[f"{name}_vs_torch"] = dict(error=f"{type(e).__name__}: {e}"[:500])
            print(f"  one step, {name}: FAILED: {e}", flush=True)
            if args.verbose:
                traceback.print_exc()
    return compiled


def run_speed(args, timer, result, save):
    deadline = args.speed_deadline
    for w, (description, shapes) in WORKLOADS.items():
        elements = sum(r * c for r, c in shapes)
        print(f"\n{w}: {description}, {elements:,} elements", flush=True)
        row = dict(workload=w, description=description, matrices=len(shapes), elements=elements, variants={})
        result["speed"].append(row)
        if time.perf_counter() - args.started > deadline:
            row["skipped"] = "time budget"
            continue
        compiled = sanity(shapes, row, args)
        for v in VARIANTS:
            if time.perf_counter() - args.started > deadline:
                row["variants"][v] = dict(skipped="time budget")
                continue
            r = row["variants"][v] = {}
            if v.startswith("batched"):
                r["compiled"] = compiled
            try:
                step, keep = make_variant(v, make_matrices(shapes), compiled)
                r.update(peers.measure(timer, step, 3, 10, 5))
                print(f"  {v:20s} GPU {r['gpu_us']:9.1f} us/step   host {r['host_us']:9.1f} us/step", flush=True)
            except Exception as e:  # noqa: BLE001 - reported, never fatal
                r["error"] = f"{type(e).__name__}: {e}"[:500]
                print(f"  {v:20s} FAILED: {r['error'].splitlines()[0][:200]}", flush=True)
                if args.verbose:
                    traceback.print_exc()
            finally:
                step = keep = None
                gc.collect()
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            save()
        add_ratios(row)
        save()


def add_ratios(row):
    """Speedups over torch.optim.Muon (torch's time / the variant's, GPU and host) and fusedopt's share
    of the step outside the Newton-Schulz GEMMs."""
    variants = row["variants"]
    base = variants.get("torch", {})
    for r in variants.values():
        for kind in ("gpu_us", "host_us"):
            if kind in r and kind in base:
                r[f"speedup_{kind[:-3]}"] = base[kind] / r[kind]
    ns0, full = variants.get("fusedopt_ns0", {}), variants.get("fusedopt", {})
    if "gpu_us" in ns0 and "gpu_us" in full:
        row["fusedopt_share_outside_gemms"] = ns0["gpu_us"] / full["gpu_us"]


def print_speed_tables(result):
    for row in result["speed"]:
        print(f"\n### {row['workload']}: {row['description']} ({row['elements']:,} elements, float32)\n")
        if "skipped" in row:
            print(f"skipped: {row['skipped']}")
            continue
        print("| variant | GPU us/step | host us/step | speedup vs torch (GPU) | speedup vs torch (host) | outside GEMMs |")
        print("|---|---:|---:|---:|---:|---:|")
        for v, r in row["variants"].items():
            if "gpu_us" not in r:
                print(f"| {v} | {r.get('error', r.get('skipped', '?')).splitlines()[0][:60]} | | | | |")
                continue
            share = row.get("fusedopt_share_outside_gemms") if v == "fusedopt" else None
            print(f"| {v} | {r['gpu_us']:.1f} | {r['host_us']:.1f} | {r.get('speedup_gpu', float('nan')):.2f}x | "
                  f"{r.get('speedup_host', float('nan')):.2f}x | {'' if share is None else f'{share:.1%}'} |")
        print()
        for name in ("fusedopt", "batched_torch"):
            check = row.get(f"{name}_vs_torch", {})
            if "relative" in check:
                print(f"one step, {name} vs torch.optim.Muon: max |diff| / max |update| = {check['relative']:.3%}")
        print(f"batched_torch's torch.compile: {row.get('batched_compile')}")


# ---- loss curve ------------------------------------------------------------------------------

VOCAB, D_MODEL, LAYERS, HEADS, SEQ, BATCH = 512, 256, 4, 4, 128, 32
SUCCESSORS, NOISE = 4, 0.1  # the Markov chain's choices per token and its share of uniform noise


def markov_tokens(rows, length, seed):
    """Token rows of a fixed random order-2 chain: the next token is one of SUCCESSORS successors of
    the last token, chosen by the token before it, or uniform noise with probability NOISE; a model
    learns the bigram table first, then the choice (two clear drops in the loss)."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    successors = torch.randint(VOCAB, (VOCAB, SUCCESSORS), device="cuda", generator=g)
    tokens = torch.empty(rows, length, dtype=torch.long, device="cuda")
    tokens[:, :2] = torch.randint(VOCAB, (rows, 2), device="cuda", generator=g)
    for t in range(2, length):
        follow = successors[tokens[:, t - 1], tokens[:, t - 2] % SUCCESSORS]
        noise = torch.randint(VOCAB, (rows,), device="cuda", generator=g)
        tokens[:, t] = torch.where(torch.rand(rows, device="cuda", generator=g) < NOISE, noise, follow)
    return tokens


def entropy_floor():
    """The chain's entropy per token in nats (about the loss a perfect model reaches: successors may repeat)."""
    hit = 1 - NOISE + NOISE / VOCAB
    miss = NOISE / VOCAB
    return -hit * math.log(hit) - (VOCAB - 1) * miss * math.log(miss)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.attn_qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.attn_proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.mlp_fc = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.mlp_proj = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.attn_qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT-2's layout at a small size; wte, wpe and lm_head go to AdamW by default_use_muon's names."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D_MODEL)
        self.wpe = nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias=False)
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def optimizers_for(run, model):
    if run == "fusedopt":
        return [ft.MuonWithAdamW(model.named_parameters(), lr=LR, adamw_lr=3e-3)]
    if run == "torch_muon_adamw":
        named = list(model.named_parameters())
        hidden = [p for n, p in named if default_use_muon(n, p)]
        rest = [p for n, p in named if not default_use_muon(n, p)]
        return [torch.optim.Muon(hidden, lr=LR),
                torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)]
    decayed = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.AdamW([dict(params=decayed, weight_decay=0.1), dict(params=others, weight_decay=0.0)],
                              lr=3e-3, betas=(0.9, 0.95), eps=1e-8)]


CURVE_RUNS = {
    "fusedopt": "fusedopt_torch.MuonWithAdamW",
    "torch_muon_adamw": "torch.optim.Muon + torch.optim.AdamW",
    "torch_adamw": "torch.optim.AdamW",
}


def train(run, data, steps, seed):
    """Losses of every step (read back once at the end) and the seconds of steps 2..steps (the first
    step compiles or loads kernels)."""
    torch.manual_seed(seed)
    model = TinyGPT().cuda()
    opts = optimizers_for(run, model)
    losses = []
    start = None
    for s in range(steps):
        batch = data[s * BATCH:(s + 1) * BATCH]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        for opt in opts:
            opt.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if s == 0:
            torch.cuda.synchronize()
            start = time.perf_counter()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return torch.stack(losses).float().cpu().tolist(), seconds


def plot(curve, path):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is missing: no plot (the losses are in the JSON)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for run, r in curve["runs"].items():
        if "losses" in r:
            ax.plot(smooth(r["losses"], 20), linewidth=1.2,
                    label=f"{CURVE_RUNS[run]} (final {r['final_loss']:.4f}, {r['ms_per_step']:.1f} ms/step)")
    ax.axhline(curve["entropy_floor"], color="gray", linestyle=":", linewidth=1, label="entropy of the data")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (20-step moving average)")
    ax.set_title(f"GPT-2-like LM ({LAYERS}x{D_MODEL}, seq {SEQ}, batch {BATCH}), {curve['steps']} steps, "
                 f"{curve['device']}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_curve(args, result, save):
    steps = args.steps
    curve = result["curve"] = dict(
        model=dict(vocab=VOCAB, d_model=D_MODEL, layers=LAYERS, heads=HEADS, seq=SEQ, batch=BATCH),
        data=f"order-2 Markov chain, {SUCCESSORS} successors per token, {NOISE:.0%} uniform noise",
        entropy_floor=entropy_floor(), steps=steps, device=torch.cuda.get_device_name(), runs={})
    data = markov_tokens(steps * BATCH, SEQ + 1, seed=1234)
    print(f"\nloss curve: {steps} steps, data entropy {curve['entropy_floor']:.3f} nats/token", flush=True)
    for run in CURVE_RUNS:
        if time.perf_counter() - args.started > args.budget:
            curve["runs"][run] = dict(skipped="time budget")
            print(f"  {run:18s} skipped: time budget", flush=True)
            continue
        try:
            losses, seconds = train(run, data, steps, seed=0)
            tail = losses[-20:]
            r = curve["runs"][run] = dict(optimizer=CURVE_RUNS[run], final_loss=sum(tail) / len(tail),
                                          seconds=seconds, ms_per_step=1e3 * seconds / max(1, steps - 1),
                                          losses=losses)
            print(f"  {run:18s} final loss {r['final_loss']:.4f}  {seconds:6.1f} s ({r['ms_per_step']:.1f} ms/step)",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - reported, never fatal
            curve["runs"][run] = dict(error=f"{type(e).__name__}: {e}"[:500])
            print(f"  {run:18s} FAILED: {e}", flush=True)
            if args.verbose:
                traceback.print_exc()
        gc.collect()
        torch.cuda.empty_cache()
        save()
    fused, reference = curve["runs"].get("fusedopt", {}), curve["runs"].get("torch_muon_adamw", {})
    if "final_loss" in fused and "final_loss" in reference:
        rel = (fused["final_loss"] - reference["final_loss"]) / reference["final_loss"]
        curve["fusedopt_vs_torch_relative"] = rel
        curve["within_0.5pct"] = abs(rel) <= 0.005
        print(f"  fusedopt vs torch Muon+AdamW final loss: {rel:+.3%} (target within 0.5%: "
              f"{'yes' if abs(rel) <= 0.005 else 'NO'})")
    try:
        curve["png"] = plot(curve, os.path.join(ROOT, "docs", "muon_loss.png"))
        if curve["png"]:
            print(f"  wrote {curve['png']}")
    except Exception as e:  # noqa: BLE001 - reported, never fatal
        curve["plot_error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"  plot FAILED: {e}")
    save()


# ---- main --------------------------------------------------------------------------------------


def git_commit():
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=400.0, help="seconds for everything; later parts are skipped")
    parser.add_argument("--out", help="JSON file (default: $OUT/muon.json when $OUT is set)")
    parser.add_argument("--steps", type=int, default=1000, help="training steps of each loss curve")
    parser.add_argument("--skip-curve", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = parser.parse_args()
    args.started = time.perf_counter()
    # The speed part leaves time for the curve: its three runs take well under 130 s at 1000 steps
    # on an H200.
    args.speed_deadline = args.budget - (0 if args.skip_curve else 0.12 * args.steps + 10)
    if not torch.cuda.is_available():
        print("muon.py: no CUDA device visible to torch, nothing to measure")
        return 0
    torch.cuda.set_device(0)
    allow_recompiles()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                  commit=git_commit(), date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), lr=LR,
                  method="median CUDA-event time per step behind a sleep kernel (torch_peers.measure: 3 warm-up "
                         "steps, 5 rounds of 10), median host time per step() call",
                  speed=[])
    print(f"torch {result['torch']} (CUDA {result['cuda']}) on {result['device']}, commit {result['commit']}", flush=True)
    out = args.out or (os.path.join(os.environ["OUT"], "muon.json") if os.environ.get("OUT") else None)

    def save():
        """Writes what is measured so far: a run cut short still leaves its results."""
        if out:
            result["total_s"] = time.perf_counter() - args.started
            with open(out + ".tmp", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(out + ".tmp", out)

    if not args.skip_speed:
        run_speed(args, peers.Timer(torch.device("cuda")), result, save)
        print_speed_tables(result)
    if not args.skip_curve:
        run_curve(args, result, save)
    save()
    print(f"\ntotal {time.perf_counter() - args.started:.0f} s")
    if out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
