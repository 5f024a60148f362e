#!/usr/bin/env python3
"""fusedopt_torch.AdamW against torch's AdamW under FSDP2 (issue 41, item 3; docs/sharded.md,
"Benchmarks on 2 and 4 GPUs"), one process per GPU:

    torchrun --standalone --nproc_per_node N bench/fsdp2.py [--out FILE]

Model: a GPT-2-medium-sized decoder in plain torch.nn (24 layers, d_model 1024, 16 heads, vocab
50257, context 1024, the head tied to the embedding: 354,823,168 parameters in 292 tensors),
trained on synthetic tokens (uniform random ids, a pool of batches drawn per rank from a seeded
generator), batch --batch (default 8) x 1024 tokens per rank. FSDP2 as the common recipe
(torchtitan's): fully_shard on every block, then on the root, with
MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): the sharded parameters, their
gradients and the optimizer states are fp32 DTensors (Shard(0)); forward and backward run in bf16;
gradients are reduce-scattered in fp32. --fp32 leaves mixed precision out (fp32 throughout).

Optimizers, hyperparameters lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight_decay 0.1:
  fusedopt       fusedopt_torch.AdamW (steps the DTensors' local shards)
  torch_fused    torch.optim.AdamW(fused=True)
  torch_foreach  torch.optim.AdamW(foreach=True)
Each round (--rounds, default 2; the optimizers' order rotated each round) builds, per optimizer, a
fresh model from the same seed, then:
  warm-up        --warmup iterations (default 5)
  (a) step       --steps iterations (default 25): forward and backward, torch.cuda.synchronize(),
                 then CUDA events around opt.step() alone (the GPU's time from the call's start to
                 its last kernel, host launch overhead included, as bench/train_loop.py times it;
                 the host time of the call beside it), then zero_grad(set_to_none=True)
  (b) iteration  --steps iterations of the plain loop (forward, backward, step, zero_grad), no
                 synchronisation inside, a CUDA event at every iteration boundary
Reported per optimizer: the median over the steps of all rounds (and each round's, in the JSON),
then the max over the ranks; fusedopt's speedup over each peer (peer time / fusedopt time).

Check (--check-steps, default 3; 0 skips it): three fresh models from the same seed, one per
optimizer; each step runs forward and backward on the fusedopt model only and gives the other two
copies of its gradients (DTensors, same placements), so the optimizers alone differ. After the
steps, per tensor max |p - p_torch_fused| / max |p_torch_fused| over the whole (sharded) tensor,
the max over tensors: for fusedopt, and for torch_foreach (torch's own spread). Passes when
fusedopt's is at most max(1e-5, 3 x torch's spread); a failed check makes the exit status 1 (after
the figures are written).

fusedopt_torch compiles its core and AdamW's CUDA unit on a fresh machine (FUSEDOPT_TORCH_CACHE):
rank 0 does that first (a tiny AdamW step), the other ranks wait at a barrier, then load it.

Rank 0 prints a Markdown table and lines starting with FSDP2 / CHECK (for summaries), and writes
JSON to --out (default $OUT/fsdp2_<N>gpu.json when $OUT is set). NVLink multicast stays off
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are forced here).
"""

import os

# Before torch initialises NCCL: no NVLink multicast on shared hosts (docs/sharded.md).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integrations", "pytorch"))
sys.path.insert(0, HERE)
from train_loop import GPT  # noqa: E402

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch before 2.6
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

OPTIMIZERS = ("fusedopt", "torch_fused", "torch_foreach")
PEERS = ("torch_fused", "torch_foreach")
HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


# ---- the model: bench/train_loop.py's GPT, at GPT-2 medium's size (build) -------------------------


def build(args, device):
    """A fresh model from seed 0 (the same weights on every rank and for every optimizer), wrapped
    with FSDP2: each block, then the root."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
    kwargs = {}
    if not args.fp32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def make_optimizer(name, params):
    if name == "fusedopt":
        import fusedopt_torch

        return fusedopt_torch.AdamW(params, **HYPER)
    if name == "torch_fused":
        return torch.optim.AdamW(params, fused=True, **HYPER)
    if name == "torch_foreach":
        return torch.optim.AdamW(params, foreach=True, **HYPER)
    raise ValueError(name)


def forward_backward(model, idx):
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    loss.backward()
    return loss


def release():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ---- timing --------------------------------------------------------------------------------------


def run_one(name, args, device, batches):
    """One optimizer, one round: warm-up, (a) the step alone, (b) whole iterations. Times in ms."""
    model = build(args, device)
    opt = make_optimizer(name, model.parameters())
    k = 0

    def batch():
        nonlocal k
        k += 1
        return batches[k % len(batches)]

    for _ in range(args.warmup):
        forward_backward(model, batch())
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

    step_ms, host_ms = [], []
    for _ in range(args.steps):
        forward_backward(model, batch())
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        opt.step()
        host = time.perf_counter() - t0
        stop.record()
        stop.synchronize()
        step_ms.append(start.elapsed_time(stop))
        host_ms.append(host * 1e3)
        opt.zero_grad(set_to_none=True)

    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    torch.cuda.synchronize()
    events[0].record()
    loss = None
    for i in range(args.steps):
        loss = forward_backward(model, batch())
        opt.step()
        opt.zero_grad(set_to_none=True)
        events[i + 1].record()
    torch.cuda.synchronize()
    iter_ms = [events[i].elapsed_time(events[i + 1]) for i in range(args.steps)]

    row = dict(step_ms=step_ms, host_ms=host_ms, iter_ms=iter_ms, final_loss=float(loss))
    if name == "fusedopt":
        row.update(plan_rebuilds=opt.plan_rebuilds(), plan_rebinds=opt.plan_rebinds())
    del model, opt
    release()
    return row


def max_over_ranks(values, device):
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ---- check: the same gradients into every optimizer ----------------------------------------------


def check(args, device, batches):
    models = {name: build(args, device) for name in OPTIMIZERS}
    opts = {name: make_optimizer(name, models[name].parameters()) for name in OPTIMIZERS}
    params = {name: list(models[name].parameters()) for name in OPTIMIZERS}
    for i in range(args.check_steps):
        forward_backward(models["fusedopt"], batches[i % len(batches)])
        for name in PEERS:
            for p, q in zip(params[name], params["fusedopt"]):
                p.grad = None if q.grad is None else q.grad.detach().clone()
        for name in OPTIMIZERS:
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)

    def local(p):
        return p.to_local() if hasattr(p, "to_local") else p

    # Per tensor: max |difference| and max |reference| over the local shards, then over the ranks.
    ref = [local(p).detach() for p in params["torch_fused"]]
    rows = []
    for name in ("fusedopt", "torch_foreach"):
        for p, r in zip(params[name], ref):
            x = local(p).detach()
            rows.append(((x.float() - r.float()).abs().max() if x.numel() else torch.zeros((), device=device),
                         r.float().abs().max() if r.numel() else torch.zeros((), device=device)))
    stacked = torch.stack([torch.stack([d, m]) for d, m in rows]).to(torch.float64)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    n = len(ref)
    rel = (stacked[:, 0] / stacked[:, 1].clamp_min(1e-30)).tolist()
    nonfinite = not bool(torch.isfinite(stacked).all())
    ours, spread = max(rel[:n]), max(rel[n:])
    tolerance = max(1e-5, 3 * spread)
    result = dict(steps=args.check_steps, fusedopt_vs_torch_fused=ours, torch_foreach_vs_torch_fused=spread,
                  tolerance=tolerance, ok=(not nonfinite) and ours <= tolerance)
    del models, opts, params, ref, rows, stacked
    release()
    return result


# ---- main ----------------------------------------------------------------------------------------


def nccl_version():
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def guarded(run, device):
    """run() on every rank; (result, None), or (None, error) on every rank where it raised on any
    (a raise the ranks share, such as an unsupported operation, leaves them in step)."""
    result, error = None, None
    try:
        result = run()
    except Exception as e:  # noqa: BLE001 - reported, and that part is left out
        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"[:300]
    if max_over_ranks([0.0 if error is None else 1.0], device)[0] > 0:
        release()
        return None, error or "failed on another rank"
    return result, None


def median(values):
    return statistics.median(values) if values else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file (default $OUT/fsdp2_<N>gpu.json when $OUT is set)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank (default 8)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=25, help="timed iterations per phase and round (default 25)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--check-steps", type=int, default=3)
    parser.add_argument("--fp32", action="store_true", help="no mixed precision: fp32 forward, backward and reduce")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    args = parser.parse_args()
    names = [n for n in args.optimizers.split(",") if n]
    for n in names:
        if n not in OPTIMIZERS:
            parser.error(f"unknown optimizer {n!r} (of {', '.join(OPTIMIZERS)})")

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    timeout = datetime.timedelta(minutes=5)
    try:
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    except TypeError:  # torch before 2.3
        dist.init_process_group("nccl", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    t_start = time.monotonic()

    def say(text):
        if rank == 0:
            print(text, flush=True)

    say(f"fsdp2: {world} ranks, {torch.cuda.get_device_name(device)}, torch {torch.__version__} (CUDA "
        f"{torch.version.cuda}, NCCL {nccl_version()}); GPT {args.layers} layers, "
        f"d {args.dim}, {args.heads} heads, vocab {args.vocab}, batch {args.batch} x {args.seq} per rank; "
        f"{'fp32' if args.fp32 else 'bf16 params, fp32 reduce, fp32 sharded master weights and states'}")

    # fusedopt_torch compiled (or loaded) by rank 0 alone first: the others then load it.
    if "fusedopt" in names:
        t0 = time.monotonic()
        if rank == 0:
            import fusedopt_torch

            fusedopt_torch.extension()
            p = torch.nn.Parameter(torch.randn(4096, device=device))
            p.grad = torch.randn_like(p)
            fusedopt_torch.AdamW([p], **HYPER).step()
            torch.cuda.synchronize()
        dist.barrier(device_ids=[local_rank])
        say(f"fusedopt_torch ready on rank 0 in {time.monotonic() - t0:.1f} s (compiled or loaded from "
            f"{os.environ.get('FUSEDOPT_TORCH_CACHE', 'the default cache')})")

    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen, device=device) for _ in range(4)]
    with torch.device("meta"):
        count = sum(p.numel() for p in GPT(args.vocab, args.dim, args.layers, args.heads, args.seq).parameters())
    say(f"model: {count:,} parameters")

    checked, errors = None, {}
    if args.check_steps > 0 and "fusedopt" in names and "torch_fused" in names and "torch_foreach" in names:
        t0 = time.monotonic()
        checked, error = guarded(lambda: check(args, device, batches), device)
        if error is not None:
            checked = dict(ok=False, error=error)
            say(f"CHECK FAILED: {error}")
    if checked is not None and "error" not in checked:
        say(f"CHECK fusedopt vs torch fused after {checked['steps']} steps on the same gradients: max rel diff "
            f"{checked['fusedopt_vs_torch_fused']:.2e} (torch foreach vs fused: "
            f"{checked['torch_foreach_vs_torch_fused']:.2e}; tolerance {checked['tolerance']:.1e}): "
            f"{'ok' if checked['ok'] else 'FAILED'} ({time.monotonic() - t0:.1f} s)")

    samples = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            if n in errors:
                continue
            t0 = time.monotonic()
            row, error = guarded(lambda: run_one(n, args, device, batches), device)
            if error is not None:
                errors[n] = error
                say(f"FSDP2 {world} GPUs {n}: FAILED ({error})")
                continue
            samples[n].append(row)
            say(f"round {r + 1} {n}: step {median(row['step_ms']) * 1e3:.1f} us, iteration "
                f"{median(row['iter_ms']):.2f} ms on rank 0 ({time.monotonic() - t0:.1f} s)")

    results = {}
    for n in names:
        rows = samples[n]
        if n in errors or not rows:
            continue
        pooled = {key: [x for row in rows for x in row[key]] for key in ("step_ms", "host_ms", "iter_ms")}
        local = [median(pooled["step_ms"]), median(pooled["host_ms"]), median(pooled["iter_ms"])]
        local += [median(row["step_ms"]) for row in rows] + [median(row["iter_ms"]) for row in rows]
        worst = max_over_ranks(local, device)
        k = len(rows)
        results[n] = dict(step_us=worst[0] * 1e3, step_host_us=worst[1] * 1e3, iteration_ms=worst[2],
                          step_us_rounds=[x * 1e3 for x in worst[3:3 + k]], iteration_ms_rounds=worst[3 + k:3 + 2 * k],
                          final_loss_rank0=rows[-1]["final_loss"])
        for key in ("plan_rebuilds", "plan_rebinds"):
            if key in rows[-1]:
                results[n][key] = rows[-1][key]
    peak = max_over_ranks([torch.cuda.max_memory_allocated(device) / 2**30], device)[0]

    speedup = {}
    if "fusedopt" in results:
        ours = results["fusedopt"]
        for peer in PEERS:
            if peer in results:
                speedup[f"fusedopt_over_{peer}"] = dict(step=results[peer]["step_us"] / ours["step_us"],
                                                        iteration=results[peer]["iteration_ms"] / ours["iteration_ms"])

    if rank == 0:
        print(f"\nFSDP2, {world} GPUs: medians over {args.steps} steps x {args.rounds} rounds, the max over ranks\n")
        print("| optimizer | step (us) | step, host (us) | iteration (ms) | fusedopt speedup, step | "
              "fusedopt speedup, iteration |")
        print("| --- | --- | --- | --- | --- | --- |")
        for n in results:
            r = results[n]
            s = speedup.get("fusedopt_over_" + n)
            step_x = "%.2fx" % s["step"] if s else "-"
            iteration_x = "%.2fx" % s["iteration"] if s else "-"
            print(f"| {n} | {r['step_us']:.1f} | {r['step_host_us']:.1f} | {r['iteration_ms']:.2f} | {step_x} | "
                  f"{iteration_x} |")
        print()
        for n in results:
            r = results[n]
            extra = "".join(", %s %.1f us (fusedopt %.2fx)" % (peer, results[peer]["step_us"],
                                                               speedup["fusedopt_over_" + peer]["step"])
                            for peer in PEERS if n == "fusedopt" and peer in results)
            print(f"FSDP2 {world} GPUs {n}: step {r['step_us']:.1f} us (rounds "
                  f"{', '.join(f'{x:.1f}' for x in r['step_us_rounds'])}), iteration {r['iteration_ms']:.2f} ms "
                  f"(rounds {', '.join(f'{x:.2f}' for x in r['iteration_ms_rounds'])}){extra}")
        print(f"peak memory allocated {peak:.1f} GiB per rank (max over ranks); {time.monotonic() - t_start:.0f} s",
              flush=True)
        out = args.out or (os.path.join(os.environ["OUT"], f"fsdp2_{world}gpu.json") if os.environ.get("OUT") else None)
        if out:
            with open(out, "w") as f:
                json.dump(dict(benchmark="fsdp2", device=torch.cuda.get_device_name(device), world_size=world,
                               torch=torch.__version__, cuda=torch.version.cuda,
                               nccl=nccl_version(), parameters=count,
                               model=dict(layers=args.layers, dim=args.dim, heads=args.heads, vocab=args.vocab,
                                          seq=args.seq, tied_head=True),
                               batch_per_rank=args.batch,
                               recipe="fp32" if args.fp32 else "fully_shard per block and root; MixedPrecisionPolicy("
                                      "param_dtype=bf16, reduce_dtype=fp32); fp32 sharded params, grads, states",
                               hyperparameters={k: list(v) if isinstance(v, tuple) else v for k, v in HYPER.items()},
                               warmup=args.warmup, steps=args.steps, rounds=args.rounds,
                               method="step: CUDA events around opt.step() after torch.cuda.synchronize(); iteration: "
                                      "CUDA events between iterations of the plain loop; medians over steps x rounds, "
                                      "max over ranks",
                               optimizers=results, speedup=speedup, check=checked, errors=errors,
                               peak_memory_gib=peak), f, indent=1)
            print(f"wrote {out}")
    dist.barrier(device_ids=[local_rank])
    dist.destroy_process_group()
    sys.exit(0 if (checked is None or checked["ok"]) and not errors else 1)


if __name__ == "__main__":
    main()
