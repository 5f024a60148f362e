#!/usr/bin/env python3
"""The optimizer step inside backward (issue 46) on a GPT-2-small-shaped model (transformers'
GPT2LMHeadModel, 124M parameters; --model 1b: 1.01B, d 2048, 18 layers; float32 parameters,
bfloat16 autocast, batch 8 x 512 tokens by default: --batch, --tokens; --checkpointing: transformers'
activation checkpointing, so that the gradients, not the activations, make the peak),
in one process on the GPU machine, one iteration = forward + backward + the step:

  ordinary          fusedopt_torch.AdamW: backward(); step(); zero_grad(set_to_none=True)
  in_backward       fusedopt_torch.step_in_backward(AdamW): backward() alone (buckets of 32 MiB)
  torch_per_param   torch's recipe: one torch.optim.AdamW(fused=True) per parameter, stepped and
                    zeroed in a post-accumulate-grad hook
  no_step           forward and backward alone, the gradients dropped (set to None) after: each
                    mode's step costs its iteration less this one's (medians, and fastest ones)

Per mode: median iteration time over --iterations (after two warm-up iterations that create the
states), the optimizer's host time per iteration (step() and zero_grad(), or the hooks' bucket
steps: on autograd's thread, where they delay backward's next launches), peak memory of an iteration (torch.cuda.max_memory_allocated after a reset), and the
gradients' bytes for scale. (That the two fusedopt modes step the same bits is
integrations/pytorch/tests/test_in_backward.py's.)

Usage: python3 bench/in_backward.py [--model gpt2-small|1b] [--iterations 20] [--batch 8] [--tokens 512]
                                    [--checkpointing] [--untied] [--no-autocast-cache] [--profile N]
                                    [--interleave] [--out FILE]
  --interleave: the ordinary loop and step_in_backward alternated iteration by iteration on one
  model and optimizer; their ratio by medians and by the median of adjacent pairs
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integrations", "pytorch"))
import fusedopt_torch as ft  # noqa: E402


# GPT-2 small, and a 1.01B decoder of bench/offload.py's shapes (d 2048, 18 layers, 16 heads),
# where the gradients (3.8 GiB) are a larger share of the peak than GPT-2 small's logits.
MODELS = {"gpt2-small": dict(n_layer=12, n_embd=768, n_head=12), "1b": dict(n_layer=18, n_embd=2048, n_head=16)}


def make_model(name, checkpointing=False, untied=False, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_positions=1024, vocab_size=50257, tie_word_embeddings=not untied, **MODELS[name])
    model = GPT2LMHeadModel(config).cuda()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    model.train()
    return model


def forward_backward(model, tokens, cache):
    """Forward under bf16 autocast (its weight cache on or off) and backward: what every mode runs."""
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache):
        loss = model(tokens, labels=tokens).loss
    loss.backward()


def run(mode, iterations, tokens, name, checkpointing=False, cache=True, profile=0, untied=False):
    model = make_model(name, checkpointing, untied)
    params = [p for p in model.parameters() if p.requires_grad]
    step = opt = None
    host = [0.0]  # seconds of host time in the optimizer's calls (step(), or the hooks' bucket steps)

    def timed(call):
        def wrapper():
            start = time.perf_counter()
            call()
            host[0] += time.perf_counter() - start
        return wrapper
    hooks = []  # removed at the end: hooks live in C++, where the collector does not see their cycles
    if mode == "no_step":
        def step():
            for p in params:
                p.grad = None
    elif mode == "ordinary":
        opt = ft.AdamW(params, lr=1e-4, weight_decay=0.1)

        @timed
        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif mode == "in_backward":
        opt = ft.AdamW(params, lr=1e-4, weight_decay=0.1)
        stepper = ft.step_in_backward(opt, bucket_bytes=32 << 20)
        stepper._flush = timed(stepper._flush)  # the hooks call it through the instance
        hooks.append(stepper)
    else:
        per_param = {p: torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, fused=True) for p in params}

        def hook(p):
            per_param[p].step()
            per_param[p].zero_grad(set_to_none=True)

        for p in params:
            hooks.append(p.register_post_accumulate_grad_hook(hook))
    def iteration():
        forward_backward(model, tokens, cache)
        if step is not None:
            step()

    times, peaks = [], []
    engine_before = None
    gc.disable()  # the collector runs between iterations, not inside one (its pauses are not the modes')
    for k in range(iterations + 2):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if k == 2:
            host[0] = 0.0
            engine_before = opt._engine.host_times() if opt is not None else None
        start = time.perf_counter()
        iteration()
        torch.cuda.synchronize()
        if k >= 2:
            times.append(time.perf_counter() - start)
            peaks.append(torch.cuda.max_memory_allocated())
    gc.enable()
    if profile and mode == "in_backward":
        # Backward on this thread (not autograd's device threads), so that the profiler sees the hooks.
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        with torch.autograd.set_multithreading_enabled(False):
            profiler.enable()
            for _ in range(profile):
                iteration()
            torch.cuda.synchronize()
            profiler.disable()
        print(f"-- cProfile of {profile} in_backward iterations (backward on the main thread), by own time:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    for h in hooks:
        h.remove()
    row = dict(iteration_ms=statistics.median(times) * 1e3, iteration_ms_min=min(times) * 1e3,
               optimizer_host_ms=host[0] / iterations * 1e3, iterations_ms=[round(t * 1e3, 2) for t in times],
               peak_mib=max(peaks) / 2**20, grad_mib=grad_bytes / 2**20)
    if opt is not None:  # plans built over all iterations (none after the first ones)
        row.update(plan_rebuilds=opt.plan_rebuilds(), plan_reuses=opt.plan_reuses())
        # The engine's own clocks (csrc/engine.cpp, host_times) over the timed iterations: its
        # steps (one per bucket inside backward) and the C++ host time of each phase, per iteration.
        after = opt._engine.host_times()
        row["engine_steps_per_iteration"] = (after["steps"] - engine_before["steps"]) / iterations
        row["engine_host_ms_per_iteration"] = {k[:-3]: round((after[k] - engine_before[k]) / iterations / 1e6, 3)
                                               for k in after if k.endswith("_ns")}
    return model, row


def run_interleaved(iterations, tokens, name, checkpointing=False, cache=True, untied=False):
    """The ordinary loop and the step inside backward in turn, iteration by iteration, on one model
    and one optimizer (the hooks registered for the in_backward iterations, removed for the
    ordinary ones): both modes see the same host and GPU conditions, which drift on a shared
    machine by more than the difference measured (single runs of a mode have varied by 10-30%)."""
    model = make_model(name, checkpointing, untied)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = ft.AdamW(params, lr=1e-4, weight_decay=0.1)
    times = {"ordinary": [], "in_backward": []}
    peaks = {"ordinary": [], "in_backward": []}
    stepper = None
    gc.disable()
    for k in range(2 * iterations + 4):
        mode = "ordinary" if k % 2 == 0 else "in_backward"
        if mode == "in_backward":
            stepper = ft.step_in_backward(opt, bucket_bytes=32 << 20)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        forward_backward(model, tokens, cache)
        if mode == "ordinary":
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if stepper is not None:
            stepper.remove()
            stepper = None
        if k >= 4:  # two warm-up iterations of each mode
            times[mode].append(elapsed)
            peaks[mode].append(torch.cuda.max_memory_allocated())
    gc.enable()
    pairs = [b / a for a, b in zip(times["ordinary"], times["in_backward"])]
    rows = {mode: dict(iteration_ms=statistics.median(t) * 1e3, iteration_ms_min=min(t) * 1e3,
                       iterations_ms=[round(x * 1e3, 2) for x in t], peak_mib=max(peaks[mode]) / 2**20)
            for mode, t in times.items()}
    rows["in_backward"]["time_vs_ordinary_pairs_median"] = statistics.median(pairs)
    rows["in_backward"]["time_vs_ordinary"] = rows["in_backward"]["iteration_ms"] / rows["ordinary"]["iteration_ms"]
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2-small")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--untied", action="store_true",
                        help="lm_head its own parameter (Llama's layout), not the embedding's: a tied embedding's "
                             "gradient is summed over both uses and held from the start of backward to its end")
    parser.add_argument("--no-autocast-cache", dest="cache", action="store_false",
                        help="autocast without its cache of bfloat16 weight copies (which holds 2 bytes per "
                             "parameter from forward to the end of autocast)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the timing, N in_backward iterations under cProfile (backward on the main thread)")
    parser.add_argument("--interleave", action="store_true",
                        help="the ordinary loop and step_in_backward alternated iteration by iteration on one model "
                             "(their ratio without the drift between separate runs); no torch_per_param row")
    parser.add_argument("--out")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, 50257, (args.batch, args.tokens), device="cuda", generator=gen)
    rows = {}
    if args.interleave:
        rows = run_interleaved(args.iterations, tokens, args.model, args.checkpointing, args.cache, args.untied)
        for mode, r in rows.items():
            print(f"{mode:16s} iteration {r['iteration_ms']:7.2f} ms (min {r['iteration_ms_min']:.2f}), peak "
                  f"{r['peak_mib']:8.1f} MiB (interleaved)", flush=True)
        r = rows["in_backward"]
        print(f"in_backward: iteration {r['time_vs_ordinary']:.4f}x the ordinary loop's by medians, "
              f"{r['time_vs_ordinary_pairs_median']:.4f}x by the median of adjacent pairs", flush=True)
    for mode in () if args.interleave else ("no_step", "ordinary", "in_backward", "torch_per_param"):
        model, rows[mode] = run(mode, args.iterations, tokens, args.model, args.checkpointing, args.cache,
                                args.profile, args.untied)
        r = rows[mode]
        print(f"{mode:16s} iteration {r['iteration_ms']:7.2f} ms (min {r['iteration_ms_min']:.2f}; optimizer's host "
              f"time {r['optimizer_host_ms']:.2f} ms), peak "
              f"{r['peak_mib']:8.1f} MiB (gradients {r['grad_mib']:.1f} MiB)"
              + (f", plans built {r['plan_rebuilds']}, reused {r['plan_reuses']}" if "plan_rebuilds" in r else ""), flush=True)
        if "engine_host_ms_per_iteration" in r:
            print(f"  engine: {r['engine_steps_per_iteration']:.1f} steps an iteration, C++ host ms an iteration "
                  + ", ".join(f"{k} {v}" for k, v in r["engine_host_ms_per_iteration"].items()), flush=True)
        del model
        gc.collect()  # the hooks make cycles (parameter -> hook -> optimizer -> parameter)
        torch.cuda.empty_cache()
        print(f"  left allocated after {mode}: {torch.cuda.memory_allocated() / 2**20:.1f} MiB", flush=True)
    base = rows["ordinary"]
    for mode in () if args.interleave else ("in_backward", "torch_per_param"):
        r = rows[mode]
        r["memory_saved_of_gradients"] = (base["peak_mib"] - r["peak_mib"]) / base["grad_mib"]
        r["time_vs_ordinary"] = r["iteration_ms"] / base["iteration_ms"]
        print(f"{mode}: peak lower by {100 * r['memory_saved_of_gradients']:.1f}% of the gradients' bytes, iteration "
              f"{r['time_vs_ordinary']:.3f}x the ordinary loop's")
    if not args.interleave:
        # What each mode's step adds to forward and backward (issue 46: the step inside backward
        # against torch's per-parameter recipe), by medians and by the fastest iterations.
        bare = rows["no_step"]
        for mode in ("ordinary", "in_backward", "torch_per_param"):
            r = rows[mode]
            r["step_ms"] = r["iteration_ms"] - bare["iteration_ms"]
            r["step_ms_by_min"] = r["iteration_ms_min"] - bare["iteration_ms_min"]
            print(f"{mode}: the step adds {r['step_ms']:.2f} ms (medians), {r['step_ms_by_min']:.2f} ms (fastest)")
        ours, theirs = rows["in_backward"], rows["torch_per_param"]
        for key in ("step_ms", "step_ms_by_min"):
            if ours[key] > 0:
                print(f"torch_per_param's step / in_backward's ({key}): {theirs[key] / ours[key]:.2f}x")
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, model=args.model, batch=args.batch,
                  tokens=args.tokens, checkpointing=args.checkpointing, autocast_cache=args.cache, untied=args.untied,
                  interleaved=args.interleave,
                  rows=rows)
    out = args.out or (os.path.join(os.environ["OUT"], "in_backward.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
