"""fusedopt_torch.step_in_backward (issue 46, item 1): the step inside backward, bucket by bucket,
against the ordinary loop ``backward(); step(); zero_grad(set_to_none=True)`` with the same
optimizer class: every parameter and state bit for bit (CPU and CUDA), with buckets small enough
that a backward takes several, with gradient accumulation, an LR scheduler and two parameter
groups; gradients freed after backward; peak CUDA memory lower by most of the gradients' bytes;
what needs every gradient is refused."""

import copy

import pytest
import torch

import fusedopt_torch as ft

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_model(device, width=64, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                               torch.nn.LayerNorm(width), torch.nn.Linear(width, 8)).to(device)


def batch(device, k):
    gen = torch.Generator().manual_seed(100 + k)
    return torch.randn(16, 32, generator=gen).to(device)


def groups(model, **second):
    params = list(model.parameters())
    return [{"params": params[:3]}, {"params": params[3:], **second}]


OPTIMIZERS = {
    "AdamW": lambda ps: ft.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "Adam_amsgrad": lambda ps: ft.Adam(ps, lr=1e-2, amsgrad=True),
    "SGD_nesterov": lambda ps: ft.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "Lion": lambda ps: ft.Lion(ps, lr=1e-3, weight_decay=0.1),
    "LAMB": lambda ps: ft.LAMB(ps, lr=1e-2, max_grad_norm=0.0),
    "Rprop": lambda ps: ft.Rprop(ps, lr=1e-3),
}


def assert_same(model_a, opt_a, model_b, opt_b):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), f"parameter {name} differs"
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k, v in sa[i].items():
            w = sb[i][k]
            assert (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w), f"state {k} of parameter {i} differs"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bits_as_the_ordinary_loop(name, device):
    ordinary, inside = make_model(device), make_model(device)
    opt_a = OPTIMIZERS[name](groups(ordinary, lr=5e-3))
    opt_b = OPTIMIZERS[name](groups(inside, lr=5e-3))
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=2, gamma=0.5)
    stepper = ft.step_in_backward(opt_b, bucket_bytes=4096)  # several buckets per backward
    for k in range(6):
        x = batch(device, k)
        ordinary(x).pow(2).mean().backward()
        opt_a.step()
        opt_a.zero_grad(set_to_none=True)
        inside(x).pow(2).mean().backward()
        assert all(p.grad is None for p in inside.parameters()), "a gradient was not freed"
        assert stepper.buckets > 1
        sched_a.step()
        sched_b.step()
        assert_same(ordinary, opt_a, inside, opt_b)
    # From the second backward on, every bucket's plans are the kept ones of its membership.
    assert opt_b.plan_reuses() >= 4 * stepper.buckets, (opt_b.plan_reuses(), stepper.buckets, opt_b.plan_rebuilds())
    stepper.remove()


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_accumulation(device):
    ordinary, inside = make_model(device), make_model(device)
    opt_a = ft.AdamW(ordinary.parameters(), lr=1e-2)
    opt_b = ft.AdamW(inside.parameters(), lr=1e-2)
    stepper = ft.step_in_backward(opt_b, bucket_bytes=8192)
    for k in range(4):
        micro = [batch(device, 10 * k + j) for j in range(3)]
        for x in micro:
            (ordinary(x).pow(2).mean() / 3).backward()
        opt_a.step()
        opt_a.zero_grad(set_to_none=True)
        for j, x in enumerate(micro):
            if j < 2:
                with stepper.accumulate():
                    (inside(x).pow(2).mean() / 3).backward()
                assert all(p.grad is not None for p in inside.parameters())
            else:
                (inside(x).pow(2).mean() / 3).backward()
        assert all(p.grad is None for p in inside.parameters())
        assert_same(ordinary, opt_a, inside, opt_b)


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip_and_remove(device):
    ordinary, inside = make_model(device), make_model(device)
    opt_a = ft.AdamW(ordinary.parameters(), lr=1e-2)
    opt_b = ft.AdamW(inside.parameters(), lr=1e-2)
    stepper = ft.step_in_backward(opt_b)
    for k in range(3):
        x = batch(device, k)
        ordinary(x).pow(2).mean().backward()
        opt_a.step()
        opt_a.zero_grad(set_to_none=True)
        inside(x).pow(2).mean().backward()
    saved = copy.deepcopy(opt_b.state_dict())
    stepper.remove()
    # After remove(), the optimizer steps by its own step() again, from the same state.
    fresh = ft.AdamW(inside.parameters(), lr=1e-2)
    fresh.load_state_dict(saved)
    x = batch(device, 9)
    ordinary(x).pow(2).mean().backward()
    opt_a.step()
    inside(x).pow(2).mean().backward()
    assert all(p.grad is not None for p in inside.parameters())
    fresh.step()
    assert_same(ordinary, opt_a, inside, fresh)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_without_the_gradients():
    """Peak memory of backward + step: the ordinary loop holds every gradient at once; inside
    backward, at most a bucket and the layers in flight. Float32, 8 layers of 2048 x 2048."""

    def peak(step_inside):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(8)]).cuda()
        opt = ft.AdamW(model.parameters(), lr=1e-3)
        stepper = ft.step_in_backward(opt, bucket_bytes=16 << 20) if step_inside else None
        x = torch.randn(64, 2048, device="cuda")
        for _ in range(2):  # the states exist from the first step: measure the second
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            model(x).pow(2).mean().backward()
            if stepper is None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), sum(p.numel() * 4 for p in model.parameters())

    ordinary, grad_bytes = peak(False)
    inside, _ = peak(True)
    saved = ordinary - inside
    print(f"IN_BACKWARD peak memory {ordinary / 2**20:.0f} -> {inside / 2**20:.0f} MiB, gradients "
          f"{grad_bytes / 2**20:.0f} MiB ({100 * saved / grad_bytes:.0f}% of them saved)")
    assert saved >= 0.5 * grad_bytes


def test_refused():
    model = make_model("cpu")
    with pytest.raises(NotImplementedError, match="max_grad_norm"):
        ft.step_in_backward(ft.LAMB(model.parameters()))
    with pytest.raises(NotImplementedError, match="per-step scalars"):
        ft.step_in_backward(ft.ScheduleFreeAdamW(model.parameters()))
    with pytest.raises(TypeError, match="fusedopt_torch optimizer"):
        ft.step_in_backward(torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="bucket_bytes"):
        ft.step_in_backward(ft.AdamW(model.parameters()), bucket_bytes=0)
    Totals = ft.rule("TotalsRule", hypers=dict(lr=1e-3), reduce=dict(n=("sum", "T(1)")),
                     body="param -= lr * grad / n_total;")
    with pytest.raises(NotImplementedError, match="total"):
        ft.step_in_backward(Totals(model.parameters()))
    # One stepper per optimizer (a second would step it twice), again after remove().
    opt = ft.AdamW(model.parameters())
    stepper = ft.step_in_backward(opt)
    with pytest.raises(RuntimeError, match="already stepped inside backward"):
        ft.step_in_backward(opt)
    stepper.remove()
    ft.step_in_backward(opt).remove()
