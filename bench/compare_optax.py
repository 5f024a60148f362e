"""fusedopt_jax against Optax under jax.jit on W1-W4 (bench/workloads.hpp): step time and compile time.

Cases: adamw_fp32 (float32 parameters and states) and adamw_bf16 (bfloat16 parameters, float32
moments: optax.adamw(mu_dtype=float32) with its nu cast to float32, which Optax keeps; fusedopt_jax's
state_dtype=float32). Variants:
  optax            jit(update + apply_updates), nothing donated
  optax_donated    the same with params and state donated
  fj_optax_form    fusedopt_jax's update (one custom call) + optax.apply_updates, donated
  fj_fused         fusedopt_jax's fused step (params and state in place), donated
  floor            (only when asked for) a donated step that returns its inputs: the host cost of
                   calling a program over the same arrays, under which neither can go
  fj_fused_graph   (only when asked for) fj_fused through the command-buffer-compatible handler
                   (fusedopt_jax's COMMAND_BUFFERS: XLA may record the calls into a CUDA graph)

Time: wall time per step, three ways, after warm-up: "in a loop" runs 10 steps inside one jitted
lax.fori_loop (the call's dispatch of every leaf spread over 10 steps), "marginal" (--long-loop N)
runs the same program for N steps a call too and takes (T(N) - T(10)) / (N - 10): what a step
adds inside a jitted training step, without any dispatch (the headline figure on W3, where the
dispatch of 8000 arrays is 50 ms a call whatever the optimizer), "per
call" calls the step once a step (jax dispatches every leaf: about 1-2 us an array), both through
the AOT Compiled object and through the jitted function (jax's C++ dispatch, what a loop calls);
jax.block_until_ready after the last step of each timed batch. Device time (--device-time N,
default 20): N per-call steps under jax.profiler.trace, the kernels' and copies' durations on the
GPU's streams summed and divided by N (the device's work a step, without the gaps the host leaves
between kernels: what the step costs where a training step keeps the GPU busy). Compile: lower + compile of the
jitted step. Memory: the device's bytes in use after the
loop and, with --isolate (each case in a process of its own), its peak.

Usage: python3 bench/compare_optax.py [--workloads W1,W3] [--cases adamw_fp32] [--variants optax_donated,fj_fused]
       [--isolate] [--leaves N] [--no-loop | --loop-only] [--long-loop 60] [--device-time 20] [--json out.json]
       [--min-seconds 0.3]
--leaves N takes each workload's first N tensors (how the per-call time grows with the leaf
count); --no-loop measures per call alone (W3's looped programs take minutes to compile).
Needs jax with a GPU (runs on whatever jax's default backend is), optax and fusedopt_jax
(integrations/jax on PYTHONPATH).
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import WORKLOADS  # noqa: E402  (bench/workloads.py: W1-W4 as bench/workloads.hpp)

CASES = ("adamw_fp32", "adamw_bf16")
VARIANTS = ("optax", "optax_donated", "fj_optax_form", "fj_fused")
# Not in the default set: "floor", a donated step that returns its inputs (no device work), the
# host cost of calling a program over the same arrays: what neither Optax nor fusedopt can go under.
EXTRA_VARIANTS = ("floor", "fj_fused_graph")
TARGETS = {("W3", "adamw_fp32"): 3.0, ("W2", "adamw_bf16"): 1.3, ("W2", "adamw_fp32"): 1.1, ("W4", "adamw_fp32"): 1.0}


def _persistent_compile_cache(jax):
    """Turns on jax's persistent compilation cache (JAX_COMPILATION_CACHE_DIR, or build/xla-cache
    beside this repository) for every program: the step is compiled once for the AOT timing and
    then loaded, not compiled again, at the jitted function's first call (W3: 75 s saved)."""
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "xla-cache")
        jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def profiled_device_time(jax, run, steps):
    """The device's time a step: `run(steps)` under jax.profiler.trace (a Perfetto trace), the
    durations of every event on the GPU's "Stream" lines summed and divided by `steps`. Returns
    (us a step, events a step, {line: us a step}, [(kernel, us a step)] of the five longest)."""
    import glob
    import gzip
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            run(steps)
        found = glob.glob(os.path.join(folder, "**", "*perfetto_trace.json.gz"), recursive=True)
        if not found:
            raise RuntimeError(f"jax.profiler wrote no Perfetto trace under {folder}")
        with gzip.open(found[0], "rt") as f:
            data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    lines, kernels, count = {}, {}, 0
    for e in events:
        if e.get("ph") != "X" or "GPU" not in processes.get(e.get("pid"), "").upper():
            continue
        line = threads.get((e.get("pid"), e.get("tid")), "?")
        dur = float(e.get("dur", 0.0))
        lines[line] = lines.get(line, 0.0) + dur
        if line.startswith("Stream"):
            kernels[e.get("name", "?")] = kernels.get(e.get("name", "?"), 0.0) + dur
            count += 1
    if not kernels:
        raise RuntimeError(f"no GPU stream events in the trace; lines: {sorted(lines)[:10]}, "
                           f"processes: {sorted(set(processes.values()))[:10]}")
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:5]
    return (sum(kernels.values()) / steps, count / steps, {k: v / steps for k, v in lines.items()},
            [(name[:120], us / steps) for name, us in top])


def run_one(workload, case, variant, min_seconds, leaves=0, looped_too=True, per_call_too=True, long_loop=0,
            device_steps=20):
    import jax
    _persistent_compile_cache(jax)
    import jax.numpy as jnp
    import optax

    import fusedopt_jax as fj

    sizes = WORKLOADS[workload][1]()
    if leaves:  # the first `leaves` tensors alone: how the time grows with the leaf count
        sizes = sizes[:leaves]
    pdtype = jnp.float32 if case == "adamw_fp32" else jnp.bfloat16
    # The leaves are made on the host and placed once: eager jax compiles each primitive once per
    # shape, and W3's 2000 distinct shapes made thousands of small compiles (minutes) before a step.
    rng = np.random.default_rng(0)
    host = {f"p{i:04d}": rng.standard_normal(n, dtype=np.float32) for i, n in enumerate(sizes)}
    params = {k: jnp.asarray(v.astype(pdtype)) for k, v in host.items()}
    grads = {k: jnp.asarray((v * 0.01).astype(pdtype)) for k, v in host.items()}
    del host
    kwargs = dict(learning_rate=1e-3, weight_decay=1e-2)
    if variant.startswith("fj"):
        fj.register()
        from fusedopt_jax import _core
        _core.COMMAND_BUFFERS = variant == "fj_fused_graph"  # read when the step is traced
        tx = fj.adamw(**kwargs, state_dtype=None if pdtype == jnp.float32 else jnp.float32)
    else:
        tx = optax.adamw(**kwargs, mu_dtype=None if pdtype == jnp.float32 else jnp.float32)
    def init(p):  # under jit: one compile instead of one per leaf shape
        s = tx.init(p)
        if pdtype != jnp.float32 and not variant.startswith("fj"):
            s = (s[0]._replace(nu=jax.tree.map(lambda x: x.astype(jnp.float32), s[0].nu)),) + s[1:]
        return s
    state = jax.jit(init)(params)

    if variant in ("fj_fused", "fj_fused_graph"):
        def step(p, g, s):
            return tx.step(p, g, s)
    elif variant == "floor":
        def step(p, g, s):
            del g
            return p, s
    else:
        def step(p, g, s):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s
    donate = () if variant == "optax" else (0, 2)
    jitted = jax.jit(step, donate_argnums=donate)
    compile_s, copies, custom_calls, fusions = float("nan"), -1, -1, -1
    if per_call_too:
        t0 = time.perf_counter()
        compiled = jitted.lower(params, grads, state).compile()
        compile_s = time.perf_counter() - t0
        hlo = compiled.as_text()
        copies = sum(1 for line in hlo.splitlines() if " copy(" in line or "copy-start" in line)
        custom_calls = hlo.count("custom-call(") + hlo.count("custom_call_target")
        fusions = sum(1 for line in hlo.splitlines() if " fusion(" in line)
    def timed(fn, steps_per_call=1, warmup=3):  # wall seconds a call of fn, and the steps timed
        nonlocal params, state
        for _ in range(warmup):
            params, state = fn(params, grads, state)
        jax.block_until_ready((params, state))
        calls, elapsed = 0, 0.0
        batch = 5
        while elapsed < min_seconds and calls * steps_per_call < 2000:
            t0 = time.perf_counter()
            for _ in range(batch):
                params, state = fn(params, grads, state)
            jax.block_until_ready((params, state))
            elapsed += time.perf_counter() - t0
            calls += batch
            batch = min(batch * 2, 200)
        return elapsed / calls, calls * steps_per_call

    def per_call(fn):  # wall time a step, fn called once a step
        call_s, steps = timed(fn)
        return call_s * 1e6, steps

    # Two ways to call the same program: the AOT `Compiled` object, and the jitted function
    # itself (what a training loop calls: jax's C++ dispatch path; its first call loads the
    # program from the persistent compilation cache).
    dispatch_us = jit_dispatch_us = jit_first_s = float("nan")
    steps = 0
    if per_call_too:
        dispatch_us, steps = per_call(compiled)
        t0 = time.perf_counter()
        params, state = jitted(params, grads, state)
        jax.block_until_ready((params, state))
        jit_first_s = time.perf_counter() - t0
        jit_dispatch_us, _ = per_call(jitted)
    device_us, device_events, device_detail = float("nan"), float("nan"), {}
    if per_call_too and device_steps > 0:
        def run(n):
            nonlocal params, state
            for _ in range(n):
                params, state = jitted(params, grads, state)
            jax.block_until_ready((params, state))
        try:
            device_us, device_events, lines, top = profiled_device_time(jax, run, device_steps)
            device_detail = dict(device_lines_us=lines, device_top_kernels_us=top)
        except Exception as e:  # the wall times stand without it
            device_detail = dict(device_error=f"{type(e).__name__}: {e}"[:1000])
            print(f"  device time: {device_detail['device_error']}", flush=True)
    # Printed now: on W3 (2000 leaves) the looped program's compile below takes minutes for Optax.
    print(f"  {workload} {case} {variant}: {len(sizes)} leaves, compile {compile_s:.2f} s, per call "
          f"{dispatch_us:.1f} us (Compiled) / {jit_dispatch_us:.1f} us (jit; its first call {jit_first_s:.2f} s), "
          f"device {device_us:.1f} us ({device_events:.0f} kernels and copies)"
          + ("; compiling the loop ..." if looped_too else ""), flush=True)
    elements = sum(sizes)
    row = dict(workload=workload, case=case, variant=variant, tensors=len(sizes), elements=elements,
               step_us=float("nan"), dispatch_step_us=dispatch_us, jit_dispatch_step_us=jit_dispatch_us,
               jit_first_call_s=jit_first_s, device_step_us=device_us, device_events_per_step=device_events,
               **device_detail, loop_copies=-1, steps=steps, compile_s=compile_s,
               loop_compile_s=float("nan"), hlo_copies=copies, hlo_fusions=fusions, hlo_custom_calls=custom_calls,
               backend=jax.default_backend(), device=str(jax.devices()[0].device_kind))

    def memory():  # the device's bytes in use now and its peak (--isolate: this case's alone)
        try:
            stats = jax.devices()[0].memory_stats() or {}
        except Exception:
            stats = {}
        return dict(bytes_in_use=stats.get("bytes_in_use"), peak_bytes_in_use=stats.get("peak_bytes_in_use"))

    if not looped_too:
        row.update(memory())
        return row
    # The same steps LOOP at a time inside one jitted program (a lax.fori_loop over the donated
    # (params, state) carry): what a training step that runs the update inside its own jit pays,
    # without jax's per-call dispatch of every leaf (about 1-2 us an array, which the per-call
    # loop above measures too). The trip count is an operand, so that one program also runs
    # `long_loop` steps a call: the difference between the two, per step, is a step's marginal
    # cost in the loop, without the call's dispatch (on W3, 8000 arrays: 50 ms a call, 5 ms of
    # each of 10 steps).
    loop = 10
    looped = jax.jit(lambda p, g, s, n: jax.lax.fori_loop(0, n, lambda i, c: step(c[0], g, c[1]), (p, s)),
                     donate_argnums=donate)
    t0 = time.perf_counter()
    looped_compiled = looped.lower(params, grads, state, jnp.int32(loop)).compile()
    loop_compile_s = time.perf_counter() - t0
    loop_copies = sum(1 for line in looped_compiled.as_text().splitlines() if " copy(" in line or "copy-start" in line)

    def per_loop_call(n):  # wall time a call of n steps
        trips = jnp.int32(n)
        return timed(lambda p, g, s: looped_compiled(p, g, s, trips), steps_per_call=n, warmup=1)

    call_s, _ = per_loop_call(loop)
    if long_loop > loop:
        long_call_s, _ = per_loop_call(long_loop)
        row.update(loop_marginal_us=(long_call_s - call_s) / (long_loop - loop) * 1e6, long_loop=long_loop)
    row.update(step_us=call_s / loop * 1e6, loop_copies=loop_copies, loop_compile_s=loop_compile_s,
               **memory())
    return row


def table(rows):
    out = ["| workload | case | variant | step in a loop (us) | vs optax_donated | marginal step in a loop (us) | vs "
           "optax_donated | device time a step (us) | vs optax_donated | step per call (us): Compiled / jit | compile (s) | HLO copies (call / loop) | fusions | "
           "peak MiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    def base_of(key):
        return {(r["workload"], r["case"]): r.get(key, nan) for r in rows if r["variant"] == "optax_donated"}
    base, base_marginal, base_device = base_of("step_us"), base_of("loop_marginal_us"), base_of("device_step_us")
    def ratio(b, x):
        return f"{b / x:.2f}x" if b == b and x == x and b and x else "-"
    for r in rows:
        key = (r["workload"], r["case"])
        marginal = r.get("loop_marginal_us", nan)
        device = r.get("device_step_us", nan)
        peak = r.get("peak_bytes_in_use")
        out.append(f"| {r['workload']} | {r['case']} | {r['variant']} | {r['step_us']:.1f} | "
                   f"{ratio(base.get(key, nan), r['step_us'])} | {marginal:.1f} | "
                   f"{ratio(base_marginal.get(key, nan), marginal)} | {device:.1f} | "
                   f"{ratio(base_device.get(key, nan), device)} | "
                   f"{r['dispatch_step_us']:.1f} / {r.get('jit_dispatch_step_us', nan):.1f} | {r['compile_s']:.2f} | "
                   f"{r['hlo_copies']} / {r['loop_copies']} | {r['hlo_fusions']} | "
                   f"{'-' if peak is None else f'{peak / 2**20:.0f}'} |")
    lines = ["", "Targets (issue 45, fj_fused against optax_donated; in a loop of 10 / marginal / device time):"]
    for (w, c), t in TARGETS.items():
        fused = [r for r in rows if (r["workload"], r["case"], r["variant"]) == (w, c, "fj_fused")]
        if fused and base.get((w, c)):
            s = base[(w, c)] / fused[0]["step_us"]
            m = base_marginal.get((w, c), nan) / fused[0].get("loop_marginal_us", nan)
            d = base_device.get((w, c), nan) / fused[0].get("device_step_us", nan)
            verdict = lambda x: "met" if x >= t else ("NOT met" if x == x else "-")  # noqa: E731
            lines.append(f"- {w} {c}: {s:.2f}x / {m:.2f}x / {d:.2f}x (target >= {t}x): {verdict(s)} / {verdict(m)} / "
                         f"{verdict(d)}")
    return "\n".join(out + lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="W1,W2,W3,W4")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--min-seconds", type=float, default=0.3)
    ap.add_argument("--isolate", action="store_true", help="each case in a process of its own (peak memory)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--leaves", type=int, default=0, help="the first N tensors of each workload alone (0: all)")
    ap.add_argument("--no-loop", action="store_true", help="per call only: skip the looped program (minutes to "
                    "compile on W3)")
    ap.add_argument("--loop-only", action="store_true", help="skip the per-call timing (and its compile)")
    ap.add_argument("--long-loop", type=int, default=0, help="also run N steps a call in the loop: the marginal "
                    "cost of a step in the loop, without the call's dispatch ((T(N) - T(10)) / (N - 10))")
    ap.add_argument("--device-time", type=int, default=20, help="profile N per-call steps (jax.profiler) for the "
                    "device's time a step; 0: skip")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        w, c, v = args.one.split(":")
        print("ROW " + json.dumps(run_one(w, c, v, args.min_seconds, args.leaves, not args.no_loop,
                                         not args.loop_only, args.long_loop, args.device_time)), flush=True)
        return
    unknown = set(args.variants.split(",")) - set(VARIANTS + EXTRA_VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}: {', '.join(VARIANTS + EXTRA_VARIANTS)}")
    rows = []
    for w in args.workloads.split(","):
        for c in args.cases.split(","):
            for v in args.variants.split(","):
                try:
                    if args.isolate:
                        done = subprocess.run([sys.executable, __file__, "--one", f"{w}:{c}:{v}", "--min-seconds",
                                               str(args.min_seconds), "--leaves", str(args.leaves),
                                               "--long-loop", str(args.long_loop),
                                               "--device-time", str(args.device_time)]
                                              + (["--no-loop"] if args.no_loop else [])
                                              + (["--loop-only"] if args.loop_only else []), capture_output=True, text=True,
                                              env=dict(os.environ))
                        row = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]
                        if not row:
                            raise RuntimeError(done.stderr[-2000:])
                        rows.append(row[0])
                    else:
                        rows.append(run_one(w, c, v, args.min_seconds, args.leaves, not args.no_loop,
                                           not args.loop_only, args.long_loop, args.device_time))
                    r = rows[-1]
                    print(f"{w} {c} {v}: {r['step_us']:.1f} us/step in a loop "
                          f"(marginal {r.get('loop_marginal_us', float('nan')):.1f}), {r['dispatch_step_us']:.1f} per call, "
                          f"device {r.get('device_step_us', float('nan')):.1f}, "
                          f"compile {r['compile_s']:.2f} s (loop {r['loop_compile_s']:.2f} s), {r['hlo_copies']} / {r['loop_copies']} copies",
                          flush=True)
                except Exception as e:  # keep the other cases
                    print(f"{w} {c} {v}: FAILED {type(e).__name__}: {str(e)[:500]}", flush=True)
                    rows.append(dict(workload=w, case=c, variant=v, error=f"{type(e).__name__}: {e}"[:2000],
                                     step_us=float("nan"), compile_s=float("nan"), hlo_copies=-1, hlo_fusions=-1))
    print(table([r for r in rows if "error" not in r]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
