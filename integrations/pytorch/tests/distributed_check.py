"""fusedopt_torch across ranks, one process per GPU (torchrun --nproc_per_node=N, N >= 1).

Each case trains the same small model from the same weights, each rank on its own batches, with
fusedopt_torch and with torch's optimizers in the same run, then compares the full parameters:
- FSDP2 (fully_shard, DTensor parameters sharded across the ranks): fusedopt_torch.AdamW / Adam /
  SGD(momentum) against torch's optimizers on the same sharding, and AdamW against the same model
  trained unsharded on one GPU with torch.optim.AdamW on all ranks' batches; LAMB refuses
  DTensor parameters clearly; the optimizer state is a DTensor and state_dict() carries the steps.
- DDP: fusedopt_torch.AdamW on a DistributedDataParallel model against torch fused AdamW.
- ZeroRedundancyOptimizer(optimizer_class=fusedopt_torch.AdamW) against
  ZeroRedundancyOptimizer(optimizer_class=torch.optim.AdamW).
Passes when fusedopt's distance from torch's reference (fused; for SGD foreach, as torch 2.11's
fused SGD has no DTensor sharding strategy) is within 3x torch's own spread between two of its
variants (plus 1e-6 relative), as the single-GPU parity tests require. A case that raises fails
alone, with its message. Rank 0 prints one line per case
and writes a JSON summary to $FUSEDOPT_DISTRIBUTED_JSON when set; the exit status is 0 only when
every case passed on every rank.

Run by tests/test_distributed.py with one rank and with two (each skipped without as many GPUs). On shared multi-GPU hosts set
NCCL_NVLS_ENABLE=0 (the test wrapper does).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fusedopt_torch as ft  # noqa: E402

STEPS = 8


def make_model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 48),
                               torch.nn.LayerNorm(48)).to(device)


def batches(rank, device):
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(16, 64, generator=gen).to(device), torch.randn(16, 48, generator=gen).to(device))
            for _ in range(STEPS)]


def full(model):
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


def rel_distance(a, b):
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))


def train(wrap, make_opt, rank, device):
    model = wrap(make_model(device))
    opt = make_opt(model.parameters())
    for x, y in batches(rank, device):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def compare(name, wrap, ours, reference, other, rank, device):
    """fusedopt's distance from torch's `reference` against torch's own spread (`other` against
    `reference`)."""
    m_ours, opt_ours = train(wrap, ours, rank, device)
    m_ref, _ = train(wrap, reference, rank, device)
    m_other, _ = train(wrap, other, rank, device)
    p_ours, p_ref, p_other = full(m_ours), full(m_ref), full(m_other)
    spread = rel_distance(p_other, p_ref)
    distance = rel_distance(p_ours, p_ref)
    ok = distance <= 3 * spread + 1e-6
    return dict(case=name, ours_vs_torch=distance, torch_spread=spread, ok=ok), m_ours, opt_ours


def guarded(name, run):
    """One case; an exception fails the case (with its message) instead of the whole check."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - reported, and the case fails
        return dict(case=name, ok=False, error=f"{type(e).__name__}: {e}"[:300])


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    rows = []

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    def fsdp2(model):
        for layer in model:
            if isinstance(layer, (torch.nn.Linear, torch.nn.LayerNorm)):
                fully_shard(layer)
        fully_shard(model)
        return model

    def report(row):
        rows.append(row)
        if rank == 0:
            print(f"case {row['case']}: {'ok' if row['ok'] else 'FAILED'} {row}", flush=True)

    kw_adamw = dict(lr=1e-2, weight_decay=0.1)
    # torch's references: fused and foreach; SGD: foreach and for-loop, as torch 2.11's fused SGD
    # has no DTensor sharding strategy (aten._fused_sgd_ raises under FSDP2).
    for name, ours, ref, kw, variants in (
        ("fsdp2 AdamW", ft.AdamW, torch.optim.AdamW, kw_adamw, ("fused", "foreach")),
        ("fsdp2 Adam amsgrad", ft.Adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True), ("fused", "foreach")),
        ("fsdp2 SGD momentum nesterov", ft.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True),
         ("foreach", "forloop")),
    ):
        flags = {"fused": dict(fused=True), "foreach": dict(foreach=True), "forloop": dict(foreach=False)}

        def run(name=name, ours=ours, ref=ref, kw=kw, variants=variants):
            row, model, opt = compare(name, fsdp2, lambda p: ours(p, **kw),
                                      lambda p: ref(p, **flags[variants[0]], **kw),
                                      lambda p: ref(p, **flags[variants[1]], **kw), rank, device)
            row["torch_reference"] = "/".join(variants)
            params = list(model.parameters())
            row["dtensor_params"] = all(isinstance(p, DTensor) for p in params)
            sd = opt.state_dict()
            state0 = opt.state[params[0]]
            row["dtensor_state"] = all(isinstance(v, DTensor) for k, v in state0.items() if k != "step")
            row["steps"] = float(sd["state"][0]["step"]) if "step" in sd["state"][0] else None
            # torch's SGD keeps no step count; the others must have counted every step.
            row["ok"] = row["ok"] and row["dtensor_params"] and row["dtensor_state"] and row["steps"] in (None, STEPS)
            return row

        report(guarded(name, run))

    def against_unsharded():
        # The yardstick: the same model trained unsharded on one GPU with torch.optim on
        # every rank's batches at once (FSDP2 averages the ranks' gradients of equal batches, the
        # mean over the concatenated batch). fusedopt under FSDP2 must be as close to it as torch
        # fused AdamW under FSDP2 is.
        everything = [batches(r, device) for r in range(world)]
        whole = [(torch.cat([everything[r][i][0] for r in range(world)]), torch.cat([everything[r][i][1] for r in range(world)]))
                 for i in range(STEPS)]
        plain = make_model(device)
        opt = torch.optim.AdamW(plain.parameters(), foreach=False, **kw_adamw)
        for x, y in whole:
            opt.zero_grad(set_to_none=True)
            F.mse_loss(plain(x), y).backward()
            opt.step()
        reference = [p.detach() for p in plain.parameters()]
        ours = full(train(fsdp2, lambda p: ft.AdamW(p, **kw_adamw), rank, device)[0])
        torch_fused = full(train(fsdp2, lambda p: torch.optim.AdamW(p, fused=True, **kw_adamw), rank, device)[0])
        distance, spread = rel_distance(ours, reference), rel_distance(torch_fused, reference)
        return dict(case="fsdp2 AdamW against unsharded torch AdamW", ours_vs_torch=distance, torch_spread=spread,
                    ok=distance <= 3 * spread + 1e-6)

    report(guarded("fsdp2 AdamW against unsharded torch AdamW", against_unsharded))

    def lamb_refuses():
        # LAMB's trust ratios need whole tensors: a DTensor parameter is refused with a clear error.
        model = fsdp2(make_model(device))
        lamb = ft.LAMB(model.parameters(), lr=1e-2)
        x, y = batches(rank, device)[0]
        F.mse_loss(model(x), y).backward()
        try:
            lamb.step()
            return dict(case="fsdp2 LAMB refuses DTensor", ok=False, error="stepped")
        except NotImplementedError as e:
            return dict(case="fsdp2 LAMB refuses DTensor", ok="DTensor" in str(e))

    report(guarded("fsdp2 LAMB refuses DTensor", lamb_refuses))

    from torch.nn.parallel import DistributedDataParallel as DDP

    def ddp(model):
        return DDP(model, device_ids=[local])

    report(guarded("ddp AdamW", lambda: compare(
        "ddp AdamW", ddp, lambda p: ft.AdamW(p, **kw_adamw), lambda p: torch.optim.AdamW(p, fused=True, **kw_adamw),
        lambda p: torch.optim.AdamW(p, foreach=True, **kw_adamw), rank, device)[0]))

    from torch.distributed.optim import ZeroRedundancyOptimizer as Zero

    report(guarded("zero AdamW", lambda: compare(
        "zero AdamW", ddp, lambda p: Zero(p, optimizer_class=ft.AdamW, **kw_adamw),
        lambda p: Zero(p, optimizer_class=torch.optim.AdamW, fused=True, **kw_adamw),
        lambda p: Zero(p, optimizer_class=torch.optim.AdamW, foreach=True, **kw_adamw), rank, device)[0]))

    # Every rank's verdicts: a case passes only where it passed on all ranks.
    verdicts = torch.tensor([1.0 if r["ok"] else 0.0 for r in rows], device=device)
    dist.all_reduce(verdicts, op=dist.ReduceOp.MIN)
    for r, v in zip(rows, verdicts.tolist()):
        r["ok"] = bool(v)
    if rank == 0:
        for r in rows:
            extra = ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                              if k not in ("case", "ok"))
            print(f"DISTRIBUTED {r['case']}: {'ok' if r['ok'] else 'FAILED'} ({world} ranks; {extra})", flush=True)
        out = os.environ.get("FUSEDOPT_DISTRIBUTED_JSON")
        if out:
            with open(out, "w") as f:
                json.dump(dict(world=world, torch=torch.__version__, rows=rows), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
