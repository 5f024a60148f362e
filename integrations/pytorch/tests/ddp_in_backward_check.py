"""fusedopt_torch.ddp_step_in_backward against the ordinary DDP loop, one process per rank
(torchrun --nproc_per_node=2 ddp_in_backward_check.py MODE), run by tests/test_ddp_in_backward.py.

MODE: gloo-cpu (CPU tensors), gloo-cuda (CUDA tensors through gloo: the ranks may share one GPU,
so the CUDA path of the hook, its side stream, runs on a one-GPU machine), nccl (one GPU per rank).

Each case trains two copies of one model from the same weights on the same per-rank batches:
DDP with the ordinary loop ``backward(); opt.step(); opt.zero_grad(set_to_none=True)`` and DDP
with ddp_step_in_backward, the same fusedopt_torch optimizer class and arguments, and compares
every parameter and every optimizer state bit for bit after every iteration (the world is 2: the
1/world scaling is exact on both sides). Cases: AdamW with two parameter groups and a StepLR
(then its state_dict loaded into an ordinary optimizer, one more ordinary step on both sides);
gradient_as_bucket_view=True; static_graph=True; accumulation over 3 micro-batches with DDP's
no_sync(); Adam(amsgrad), SGD(nesterov), Lion; the refusals. Also checked: every gradient is None
after backward, DDP's buckets after the first iteration are several (bucket_cap_mb=0.25, the model
has 2 MiB of parameters), each one fused step.

Rank 0 prints one line per case and writes a JSON summary to $FUSEDOPT_DDP_IN_BACKWARD_JSON when set;
a case passes only where it passed on every rank; the exit status is 0 only when all passed.
"""

import contextlib
import copy
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fusedopt_torch as ft  # noqa: E402


def make_model(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(),
                               torch.nn.Linear(512, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 8)).to(device)


def batch(rank, k, device):
    gen = torch.Generator().manual_seed(1000 * rank + k)
    return torch.randn(16, 32, generator=gen).to(device), torch.randn(16, 8, generator=gen).to(device)


# test_in_backward.py's groups and optimizers (the same cases as the step in backward alone).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_in_backward import OPTIMIZERS as _IN_BACKWARD, groups  # noqa: E402

OPTIMIZERS = {name: _IN_BACKWARD[name] for name in ("AdamW", "Adam_amsgrad", "SGD_nesterov", "Lion")}


def differences(model_a, opt_a, model_b, opt_b):
    """The first difference between the two sides (None: every parameter and state bit-identical)."""
    for (name, a), b in zip(model_a.module.named_parameters(), model_b.module.parameters()):
        if not torch.equal(a, b):
            return f"parameter {name} differs by {(a - b).abs().max().item():.3e}"
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    if sa.keys() != sb.keys():
        return f"state keys differ: {sorted(sa)} vs {sorted(sb)}"
    for i in sa:
        for k, v in sa[i].items():
            w = sb[i].get(k)
            same = torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
            if not same:
                return f"state {k} of parameter {i} differs"
    return None


def run_case(name, rank, device, opt_name="AdamW", iterations=5, micro=1, ddp_kw=None, second=None, sched=False,
             round_trip=False):
    """Both sides through `iterations` iterations of `micro` micro-batches (all but the last
    under no_sync()); returns the case's row."""
    make_opt = OPTIMIZERS[opt_name]
    second = dict(lr=5e-3) if second is None else second
    device_ids = [device.index] if device.type == "cuda" else None
    ordinary = DDP(make_model(device), device_ids=device_ids)
    inside = DDP(make_model(device), device_ids=device_ids, bucket_cap_mb=0.25, **(ddp_kw or {}))
    opt_a = make_opt(groups(ordinary.module, **second))
    opt_b = make_opt(groups(inside.module, **second))
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5) if sched else None
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=2, gamma=0.5) if sched else None
    stepper = ft.ddp_step_in_backward(inside, opt_b)
    buckets, problems = [], []
    for k in range(iterations):
        data = [batch(rank, micro * k + j, device) for j in range(micro)]
        for j, (x, y) in enumerate(data):
            last = j == micro - 1
            with ordinary.no_sync() if not last else contextlib.nullcontext():
                (F.mse_loss(ordinary(x), y) / micro).backward()
        opt_a.step()
        opt_a.zero_grad(set_to_none=True)
        for j, (x, y) in enumerate(data):
            last = j == micro - 1
            with inside.no_sync() if not last else contextlib.nullcontext():
                (F.mse_loss(inside(x), y) / micro).backward()
            if not last and any(p.grad is None for p in inside.parameters()):
                problems.append(f"iteration {k}: a gradient is missing after a no_sync micro-batch")
        buckets.append(stepper.buckets)
        if any(p.grad is not None for p in inside.parameters()):
            problems.append(f"iteration {k}: a gradient was not freed")
        if sched:
            sched_a.step()
            sched_b.step()
        # Every rank runs every iteration whatever it finds: the collectives must stay in step.
        diff = differences(ordinary, opt_a, inside, opt_b)
        if diff is not None and not any("differs" in m for m in problems):
            problems.append(f"iteration {k}: {diff}")
    if max(buckets[1:], default=0) < 2:
        problems.append(f"DDP's buckets per backward {buckets}: expected several after the first iteration")
    if round_trip:
        # The state_dict taken inside backward, loaded into an ordinary optimizer over a copy of
        # the model: one more ordinary step there equals one more on the ordinary side.
        saved = copy.deepcopy(opt_b.state_dict())
        copy_model = DDP(make_model(device), device_ids=device_ids)
        copy_model.module.load_state_dict(inside.module.state_dict())
        fresh = make_opt(groups(copy_model.module, **second))
        fresh.load_state_dict(saved)
        x, y = batch(rank, 999, device)
        for model, opt in ((ordinary, opt_a), (copy_model, fresh)):
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        diff = differences(ordinary, opt_a, copy_model, fresh)
        if diff is not None:
            problems.append(f"after the state_dict round trip: {diff}")
    return dict(case=name, ok=not problems, buckets=buckets, error="; ".join(problems)[:400] if problems else "")


def refusals(device):
    device_ids = [device.index] if device.type == "cuda" else None
    problems = []

    def expect(error, match, make):
        try:
            make()
            problems.append(f"not refused: {match}")
        except error as e:
            if match not in str(e):
                problems.append(f"{error.__name__} without '{match}': {e}")
        except Exception as e:  # noqa: BLE001 - reported
            problems.append(f"{type(e).__name__} instead of {error.__name__} ({match}): {e}")

    # Every DDP construction is collective: every rank builds the same ones in the same order.
    plain = DDP(make_model(device), device_ids=device_ids)
    expect(TypeError, "fusedopt_torch optimizer", lambda: ft.ddp_step_in_backward(plain, torch.optim.AdamW(plain.parameters())))
    expect(NotImplementedError, "max_grad_norm", lambda: ft.ddp_step_in_backward(plain, ft.LAMB(plain.parameters())))
    expect(ValueError, "exactly the parameters", lambda: ft.ddp_step_in_backward(
        plain, ft.AdamW(list(plain.parameters())[:2])))
    expect(TypeError, "DistributedDataParallel", lambda: ft.ddp_step_in_backward(
        plain.module, ft.AdamW(plain.parameters())))
    unused = DDP(make_model(device), device_ids=device_ids, find_unused_parameters=True)
    expect(NotImplementedError, "find_unused_parameters", lambda: ft.ddp_step_in_backward(unused, ft.AdamW(unused.parameters())))
    hooked = DDP(make_model(device), device_ids=device_ids)
    opt = ft.AdamW(hooked.parameters())
    ft.ddp_step_in_backward(hooked, opt)
    other = DDP(make_model(device), device_ids=device_ids)
    expect(RuntimeError, "already stepped inside backward", lambda: ft.ddp_step_in_backward(other, opt))
    expect(RuntimeError, "already stepped inside backward", lambda: ft.step_in_backward(opt))
    return dict(case="refusals", ok=not problems, error="; ".join(problems)[:400])


def guarded(name, run):
    """One case; an exception fails the case (with its message) instead of the whole check."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - reported, and the case fails
        return dict(case=name, ok=False, error=f"{type(e).__name__}: {e}"[:400])


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "gloo-cpu"
    backend = "nccl" if mode == "nccl" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    if mode == "gloo-cpu":
        device = torch.device("cpu")
    else:
        index = local % torch.cuda.device_count()  # gloo-cuda: the ranks may share a GPU
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    rows = []

    def report(row):
        rows.append(row)
        if rank == 0:
            print(f"case {row['case']}: {'ok' if row['ok'] else 'FAILED'} {row}", flush=True)

    cases = [
        ("AdamW two groups StepLR state_dict", dict(opt_name="AdamW", iterations=6, sched=True, round_trip=True)),
        ("AdamW gradient_as_bucket_view", dict(opt_name="AdamW", ddp_kw=dict(gradient_as_bucket_view=True))),
        ("AdamW static_graph", dict(opt_name="AdamW", ddp_kw=dict(static_graph=True))),
        ("AdamW no_sync accumulation", dict(opt_name="AdamW", iterations=4, micro=3)),
        ("AdamW no_sync accumulation gradient_as_bucket_view",
         dict(opt_name="AdamW", iterations=3, micro=2, ddp_kw=dict(gradient_as_bucket_view=True))),
        ("Adam_amsgrad", dict(opt_name="Adam_amsgrad", iterations=4)),
        ("SGD_nesterov", dict(opt_name="SGD_nesterov", iterations=4, sched=True)),
        ("Lion", dict(opt_name="Lion", iterations=4)),
    ]
    for name, kw in cases:
        report(guarded(name, lambda name=name, kw=kw: run_case(name, rank, device, **kw)))
    report(guarded("refusals", lambda: refusals(device)))

    # Every rank's verdicts: a case passes only where it passed on all ranks.
    verdicts = torch.tensor([1.0 if r["ok"] else 0.0 for r in rows], device=device if backend == "nccl" else "cpu")
    dist.all_reduce(verdicts, op=dist.ReduceOp.MIN)
    for r, v in zip(rows, verdicts.tolist()):
        r["ok"] = bool(v)
    if rank == 0:
        for r in rows:
            print(f"DDP_IN_BACKWARD {mode} {r['case']}: {'ok' if r['ok'] else 'FAILED'} "
                  f"(buckets per backward {r.get('buckets')}) {r.get('error', '')}", flush=True)
        out = os.environ.get("FUSEDOPT_DDP_IN_BACKWARD_JSON")
        if out:
            with open(out, "w") as f:
                json.dump(dict(mode=mode, world=world, torch=torch.__version__, rows=rows), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
