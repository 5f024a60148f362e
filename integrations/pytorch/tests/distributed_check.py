"""fusedopt_torch across ranks, one process per GPU (torchrun --nproc_per_node=N, N >= 2).

Each case trains the same small model from the same weights, each rank on its own batches, with
fusedopt_torch and with torch's optimizers in the same run, then compares the full parameters:
- FSDP2 (fully_shard, DTensor parameters sharded across the ranks): fusedopt_torch.AdamW / Adam /
  SGD(momentum) against torch's fused and foreach optimizers on the same sharding; LAMB refuses
  DTensor parameters clearly; the optimizer state is a DTensor and state_dict() carries the steps.
- DDP: fusedopt_torch.AdamW on a DistributedDataParallel model against torch fused AdamW.
- ZeroRedundancyOptimizer(optimizer_class=fusedopt_torch.AdamW) against
  ZeroRedundancyOptimizer(optimizer_class=torch.optim.AdamW).
Passes when fusedopt's distance from torch fused is within 3x torch's own fused-vs-foreach spread
(plus 1e-6 relative), as the single-GPU parity tests require. Rank 0 prints one line per case
and writes a JSON summary to $FUSEDOPT_DISTRIBUTED_JSON when set; the exit status is 0 only when
every case passed on every rank.

Run by tests/test_distributed.py (skipped with fewer than two GPUs). On shared multi-GPU hosts set
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


def compare(name, wrap, ours, fused, foreach, rank, device):
    m_ours, opt_ours = train(wrap, ours, rank, device)
    m_fused, _ = train(wrap, fused, rank, device)
    m_foreach, _ = train(wrap, foreach, rank, device)
    p_ours, p_fused, p_foreach = full(m_ours), full(m_fused), full(m_foreach)
    spread = rel_distance(p_foreach, p_fused)
    distance = rel_distance(p_ours, p_fused)
    ok = distance <= 3 * spread + 1e-6
    return dict(case=name, ours_vs_fused=distance, torch_foreach_vs_fused=spread, ok=ok), m_ours, opt_ours


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

    kw_adamw = dict(lr=1e-2, weight_decay=0.1)
    for name, ours, ref, kw in (
        ("fsdp2 AdamW", ft.AdamW, torch.optim.AdamW, kw_adamw),
        ("fsdp2 Adam amsgrad", ft.Adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
        ("fsdp2 SGD momentum nesterov", ft.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
    ):
        row, model, opt = compare(name, fsdp2, lambda p, c=ours, k=kw: c(p, **k),
                                  lambda p, c=ref, k=kw: c(p, fused=True, **k),
                                  lambda p, c=ref, k=kw: c(p, foreach=True, **k), rank, device)
        params = list(model.parameters())
        row["dtensor_params"] = all(isinstance(p, DTensor) for p in params)
        sd = opt.state_dict()
        state0 = opt.state[params[0]]
        row["dtensor_state"] = all(isinstance(v, DTensor) for k, v in state0.items() if k != "step")
        row["steps"] = float(sd["state"][0]["step"]) if "step" in sd["state"][0] else None
        # torch's SGD keeps no step count; the others must have counted every step.
        row["ok"] = row["ok"] and row["dtensor_params"] and row["dtensor_state"] and row["steps"] in (None, STEPS)
        rows.append(row)

    # LAMB's trust ratios need whole tensors: a DTensor parameter is refused with a clear error.
    model = fsdp2(make_model(device))
    lamb = ft.LAMB(model.parameters(), lr=1e-2)
    x, y = batches(rank, device)[0]
    F.mse_loss(model(x), y).backward()
    try:
        lamb.step()
        refused = False
    except NotImplementedError as e:
        refused = "DTensor" in str(e)
    rows.append(dict(case="fsdp2 LAMB refuses DTensor", ok=refused))

    from torch.nn.parallel import DistributedDataParallel as DDP

    def ddp(model):
        return DDP(model, device_ids=[local])

    row, _, _ = compare("ddp AdamW", ddp, lambda p: ft.AdamW(p, **kw_adamw),
                        lambda p: torch.optim.AdamW(p, fused=True, **kw_adamw),
                        lambda p: torch.optim.AdamW(p, foreach=True, **kw_adamw), rank, device)
    rows.append(row)

    from torch.distributed.optim import ZeroRedundancyOptimizer as Zero

    row, _, _ = compare("zero AdamW", ddp, lambda p: Zero(p, optimizer_class=ft.AdamW, **kw_adamw),
                        lambda p: Zero(p, optimizer_class=torch.optim.AdamW, fused=True, **kw_adamw),
                        lambda p: Zero(p, optimizer_class=torch.optim.AdamW, foreach=True, **kw_adamw), rank, device)
    rows.append(row)

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
