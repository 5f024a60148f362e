"""fusedopt_torch.Prodigy against konstmish/prodigy's Prodigy.step (prodigyopt/prodigy.py, one group,
slice_p = 1), written here in plain PyTorch one tensor at a time in float64, in the reference's
order of operations (the package is not a dependency), on the CPU (the host backend) and,
where there is one, the GPU.

Two comparisons:
- step by step (teacher forcing): each step of the reference starts from fusedopt's tensors and
  from its d, d_max and d_numerator (read through state_dict()), so each value is within a few
  roundings of one step: TOLERANCE[dtype] of its tensor's largest magnitude (each of s,
  exp_avg, exp_avg_sq and the update rounds two or three times, with coefficients rounded to
  the dtype), d, d_max and d_numerator within SCALAR_TOLERANCE[dtype] (double sums of the
  dtype's values, but d's denominator sums |s| rounded to the dtype); the parameters within
  TOLERANCE of their largest magnitude plus 2 SCALAR_TOLERANCE of the update's (d's error
  carried into the update, which can exceed the parameter);
- a whole trajectory in float64: 12 steps from the same start, parameters within 1e-11 of their
  largest magnitude and d within 1e-8 (the difference p0 - p of d's numerator is a few d0
  where d is small, so its roundings count 1e5 times more than the parameters').
The worst differences measured are printed with -s.
"""
import copy
import functools
import math

import pytest
import torch

from fusedopt_torch.prodigy import Prodigy
import optimizer_testing
from optimizer_testing import assert_refused_under_capture, relative, replay_beside_eager, twin_of

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# a matrix, a vector, a 3-D tensor, one element
SHAPES = [(64, 33), (7,), (3, 5, 9), (1,)]
TOLERANCE = {torch.float32: 16 * 2.0 ** -24, torch.bfloat16: 8 * 2.0 ** -8}
SCALAR_TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 8 * 2.0 ** -8}
STEPS = 12
make_params = functools.partial(optimizer_testing.make_params, shapes=SHAPES)

OPTIONS = [dict(),  # the reference's defaults
           dict(weight_decay=0.1),  # decoupled
           dict(weight_decay=0.1, decouple=False),
           dict(use_bias_correction=True, safeguard_warmup=True),
           dict(beta3=0.9, growth_rate=1.02, d_coef=2.0, lr=0.5),
           dict(betas=(0.0, 0.999), eps=1e-6, weight_decay=0.05, decouple=False)]
IDS = ["defaults", "decoupled-decay", "coupled-decay", "bias-correction-safeguard", "beta3-growth-rate",
       "beta1-zero"]


def reference_step(params, grads, states, scalars, k, o):
    """prodigy.py's Prodigy.step for one group and slice_p = 1, in place over float64 `params`
    and `states` (dicts: s, p0, exp_avg (beta1 > 0), exp_avg_sq), from `scalars` (d, d_max,
    d_numerator) and group['k'] = k; the scalars after it (unchanged where it returns early)."""
    o = {**dict(lr=1.0, betas=(0.9, 0.999), beta3=None, eps=1e-8, weight_decay=0, decouple=True,
                use_bias_correction=False, safeguard_warmup=False, d0=1e-6, d_coef=1.0, growth_rate=float("inf")), **o}
    beta1, beta2 = o["betas"]
    beta3 = math.sqrt(beta2) if o["beta3"] is None else o["beta3"]
    d, d_max, d_numerator = scalars
    lr, d0, decay = o["lr"], o["d0"], o["weight_decay"]
    bias_correction = ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1)) if o["use_bias_correction"] else 1
    dlr = d * lr * bias_correction
    d_numerator *= beta3
    delta_numerator = d_denom = 0.0
    grads = [g.clone() for g in grads]
    for p, grad, state in zip(params, grads, states):
        if decay != 0 and not o["decouple"]:
            grad.add_(p, alpha=decay)
        s, p0 = state["s"], state["p0"]
        sliced_grad = grad.flatten()
        delta_numerator += (d / d0) * dlr * torch.dot(sliced_grad, p0 - p.flatten()).item()
        if beta1 > 0:
            state["exp_avg"].mul_(beta1).add_(grad, alpha=d * (1 - beta1))
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=d * d * (1 - beta2))
        s.mul_(beta3).add_(sliced_grad, alpha=(d / d0) * d if o["safeguard_warmup"] else (d / d0) * dlr)
        d_denom += s.abs().sum().item()
    if d_denom == 0:
        return scalars
    global_d_numerator = d_numerator + delta_numerator
    d_hat = o["d_coef"] * global_d_numerator / d_denom
    if d == d0:
        d = max(d, d_hat)
    d_max = max(d_max, d_hat)
    d = min(d_max, d * o["growth_rate"])
    for p, grad, state in zip(params, grads, states):
        denom = state["exp_avg_sq"].sqrt().add_(d * o["eps"])
        if decay != 0 and o["decouple"]:
            p.add_(p, alpha=-decay * dlr)
        if beta1 > 0:
            p.addcdiv_(state["exp_avg"], denom, value=-dlr)
        else:
            p.addcdiv_(grad, denom, value=-dlr * d)
    return d, d_max, global_d_numerator


def detached_copy(t):
    """t in float64 on the CPU, never sharing t's memory (.double().cpu() of a CPU float64 tensor
    is the tensor itself, which the reference would then update in place)."""
    return t.detach().to(device="cpu", dtype=torch.float64, copy=True)


def noisy_quadratic_grads(params, targets, step):
    """New gradient tensors (set_to_none's) of 0.5 |p - target|^2 with noise: descending them
    moves the parameters along the gradients seen before, which makes d grow."""
    gen = torch.Generator().manual_seed(1000 + step)
    for p, target in zip(params, targets):
        noise = 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64)
        p.grad = (p.detach().double().cpu() - target + noise).to(device=p.device, dtype=p.dtype)


def scalars_of(opt):
    """The group's d, d_max and d_numerator, current after state_dict()."""
    group = opt.state_dict()["param_groups"][0]
    return group["d"], group["d_max"], group["d_numerator"]


def targets_of(params, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]


def teacher_forced(device, dtype, options, steps=STEPS):
    """`steps` steps of fusedopt's Prodigy, each checked against the reference's step from the
    same values; the worst differences (tensors, scalars) and the optimizer."""
    params = make_params(device, dtype)
    targets = targets_of(params)
    opt = Prodigy(params, **options)
    worst = [0.0, 0.0]
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        noisy_quadratic_grads(params, targets, step)
        scalars, k = scalars_of(opt), opt.param_groups[0]["k"]
        theirs = [detached_copy(p) for p in params]
        before = [q.clone() for q in theirs]
        states = [{key: detached_copy(t) for key, t in opt.state[p].items() if key != "step"} for p in params]
        if step == 1:  # the reference's initial state
            states = [dict(s=torch.zeros(p.numel(), dtype=torch.float64), p0=q.flatten().clone(),
                           exp_avg_sq=torch.zeros_like(q)) for p, q in zip(params, theirs)]
            if options.get("betas", (0.9, 0.999))[0] > 0:
                for state, q in zip(states, theirs):
                    state["exp_avg"] = torch.zeros_like(q)
        want = reference_step(theirs, [p.grad.double().cpu() for p in params], states, scalars, k, options)
        opt.step()
        got = scalars_of(opt)
        for name, g, w in zip(("d", "d_max", "d_numerator"), got, want):
            difference = abs(g - w) / max(abs(w), 1e-300)
            worst[1] = max(worst[1], difference)
            assert difference <= SCALAR_TOLERANCE[dtype], (step, name, g, w)
        for p, q, q0, state in zip(params, theirs, before, states):
            mine = opt.state[p]
            assert set(mine) == set(state) | {"step"}, (set(mine), set(state))
            assert mine["step"] == step
            for key, value in [("param", p)] + [(key, mine[key]) for key in state]:
                want_value = q if key == "param" else state[key]
                assert value.shape == want_value.shape and value.dtype == dtype, key
                worst[0] = max(worst[0], relative(value, want_value))
                bound = TOLERANCE[dtype]
                if key == "param":
                    # The update is dlr d grad / denom (or dlr exp_avg / denom): d's relative error
                    # (within SCALAR_TOLERANCE: its sums are of values rounded to the dtype) enters
                    # it twice, which matters where the update is larger than the parameter (a
                    # one-element tensor once d has grown).
                    update = (q - q0).abs().max().item()
                    bound += 2 * SCALAR_TOLERANCE[dtype] * update / max(q.abs().max().item(), 1e-30)
                assert relative(value, want_value) <= bound, (step, key, tuple(p.shape))
        assert opt.param_groups[0]["k"] == step
    return worst, opt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_steps_against_reference(device, options):
    worst, opt = teacher_forced(device, torch.float32, options)
    assert opt.plan_builds() == 1  # one plan; zero_grad(set_to_none=True)'s new gradients are rebound
    print(f"\nProdigy float32 on {device} {options}: tensors within {worst[0]:.2e} of their largest magnitude, "
          f"d, d_max, d_numerator within {worst[1]:.2e} a step")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_float64_trajectory_against_reference(device, options):
    params = make_params(device, torch.float64)
    theirs = [detached_copy(p) for p in params]
    states = [dict(s=torch.zeros(p.numel(), dtype=torch.float64), p0=q.flatten().clone(), exp_avg_sq=torch.zeros_like(q),
                   exp_avg=torch.zeros_like(q)) for p, q in zip(params, theirs)]
    targets = targets_of(params)
    opt = Prodigy(params, **options)
    d0 = options.get("d0", 1e-6)
    scalars, ds = (d0, d0, 0.0), []
    worst = [0.0, 0.0]
    for step in range(1, STEPS + 1):
        noisy_quadratic_grads(params, targets, step)
        scalars = reference_step(theirs, [p.grad.cpu() for p in params], states, scalars, step - 1, options)
        opt.step()
        got = scalars_of(opt)
        ds.append(got[0])
        worst[1] = max(worst[1], abs(got[0] - scalars[0]) / scalars[0])
        assert abs(got[0] - scalars[0]) <= 1e-8 * scalars[0], (step, got[0], scalars[0])
        for p, q in zip(params, theirs):
            worst[0] = max(worst[0], relative(p, q))
            assert relative(p, q) <= 1e-11, (step, tuple(p.shape))
    assert all(a <= b for a, b in zip(ds, ds[1:]))  # d never decreases
    if not options:
        assert ds[-1] > 100 * d0  # and grows on the noisy quadratic
    print(f"\nProdigy float64 on {device} {options}: parameters within {worst[0]:.2e}, d within {worst[1]:.2e} after "
          f"{STEPS} steps; d {ds[0]:.2e} -> {ds[-1]:.2e}")


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_parameters(device):
    # d0 = 1e-2: steps of d0 move bfloat16 parameters (1e-6 is below their rounding: d would stay d0).
    worst, opt = teacher_forced(device, torch.bfloat16, dict(weight_decay=0.1, d0=1e-2))
    assert all(t.dtype == torch.bfloat16 for st in opt.state.values() for k, t in st.items() if k != "step")
    print(f"\nProdigy bfloat16 on {device}: tensors within {worst[0]:.2e}, d, d_max, d_numerator within "
          f"{worst[1]:.2e} a step (bounds {TOLERANCE[torch.bfloat16]:.2e}, {SCALAR_TOLERANCE[torch.bfloat16]:.2e})")


def run_steps(opt, params, targets, steps):
    for step in steps:
        opt.zero_grad(set_to_none=True)
        noisy_quadratic_grads(params, targets, step)
        opt.step()


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trips(device):
    ours = make_params(device, seed=1)
    targets = targets_of(ours)
    opt = Prodigy(ours, weight_decay=0.01)
    run_steps(opt, ours, targets, range(1, 5))
    saved = copy.deepcopy(opt.state_dict())  # a checkpoint
    group = saved["param_groups"][0]
    assert {"d", "d0", "d_max", "d_numerator", "k", "d_coef", "growth_rate", "slice_p"} <= set(group)
    assert group["k"] == 4 and group["d"] > group["d0"] and group["d"] == opt.param_groups[0]["d"]
    assert all(set(s) == {"step", "s", "p0", "exp_avg", "exp_avg_sq"} and s["step"] == 4
               for s in saved["state"].values())
    theirs = twin_of(ours)
    back = Prodigy(theirs, weight_decay=0.01)
    back.load_state_dict(saved)
    assert back.param_groups[0]["d"] == group["d"]
    run_steps(opt, ours, targets, range(5, 9))  # both continue alike: the loaded d is the plan's
    run_steps(back, theirs, targets, range(5, 9))
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
    assert scalars_of(back) == scalars_of(opt)
    assert back.state_dict()["param_groups"][0]["k"] == 8


@pytest.mark.parametrize("device", DEVICES)
def test_a_zero_dim_p0_loads(device):
    # The reference keeps p0 as a 0-d zero for a parameter that is all zeros.
    ours = [torch.zeros(5, 3, device=device, requires_grad=True)]
    targets = [torch.ones(5, 3, dtype=torch.float64)]
    opt = Prodigy(ours)
    run_steps(opt, ours, targets, range(1, 3))
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["p0"] = torch.tensor(0.0)
    theirs = twin_of(ours)
    back = Prodigy(theirs)
    back.load_state_dict(saved)
    run_steps(opt, ours, targets, range(3, 5))
    run_steps(back, theirs, targets, range(3, 5))
    assert torch.equal(ours[0], theirs[0])


@pytest.mark.parametrize("device", DEVICES)
def test_a_parameter_without_gradient_keeps_d(device):
    # A new set of parameters with a gradient builds a new plan, which resumes from the last d.
    params = make_params(device, seed=2)
    targets = targets_of(params)
    opt = Prodigy(params)
    run_steps(opt, params, targets, range(1, 5))
    d = scalars_of(opt)
    opt.zero_grad(set_to_none=True)
    noisy_quadratic_grads(params, targets, 5)
    params[1].grad = None
    theirs = [detached_copy(p) for p in params]
    states = [{key: detached_copy(t) for key, t in opt.state[p].items() if key != "step"} for p in params]
    grads = [p.grad.double().cpu() for p in params if p.grad is not None]
    keep = [i for i, p in enumerate(params) if p.grad is not None]
    want = reference_step([theirs[i] for i in keep], grads, [states[i] for i in keep], d, 4, {})
    opt.step()
    assert opt.plan_builds() == 2
    got = scalars_of(opt)
    assert abs(got[0] - want[0]) <= SCALAR_TOLERANCE[torch.float32] * want[0]
    assert [opt.state[p]["step"] for p in params] == [5, 4, 5, 5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_capturable_step_replayed_from_a_cuda_graph():
    # capturable=True: one ordinary step builds the plan, one step is captured, and each replay
    # reads k + 1 on the device (bias correction on, so the count matters) and d from the
    # plan's memory: the bits of eager steps; k and 'step' written by state_dict(). Without
    # capturable, a captured step raises.
    options = dict(use_bias_correction=True, weight_decay=0.05)
    graphed = make_params("cuda")
    eager = twin_of(graphed)
    targets = targets_of(graphed)
    opt = Prodigy(graphed, capturable=True, **options)
    ref = Prodigy(eager, **options)
    noisy_quadratic_grads(graphed, targets, 1)
    noisy_quadratic_grads(eager, targets, 1)
    opt.step()
    ref.step()

    def same_as_eager(step):
        for p, q in zip(graphed, eager):
            assert torch.equal(p, q), (step, tuple(p.shape))

    replay_beside_eager(opt, ref, 6, same_as_eager)
    assert scalars_of(opt) == scalars_of(ref)
    assert opt.state_dict()["param_groups"][0]["k"] == ref.state_dict()["param_groups"][0]["k"] == 7
    assert [s["step"] for s in opt.state_dict()["state"].values()] == [7] * len(graphed)
    assert "capturable" not in Prodigy(twin_of(graphed)).param_groups[0]
    assert_refused_under_capture(Prodigy(twin_of(graphed)))


def test_errors():
    p = torch.zeros(4, 4, requires_grad=True)
    for options, message in ((dict(d0=0.0), "Invalid d0 value: 0.0"), (dict(lr=0.0), "Invalid learning rate: 0.0"),
                             (dict(eps=0.0), "Invalid epsilon value: 0.0"),
                             (dict(betas=(1.0, 0.999)), "Invalid beta parameter at index 0: 1.0"),
                             (dict(betas=(0.9, 1.0)), "Invalid beta parameter at index 1: 1.0"),
                             (dict(beta3=1.0), "beta3 must be None or in [0, 1)"),
                             (dict(slice_p=2), "slice_p must be 1"), (dict(fsdp_in_use=True), "fsdp_in_use")):
        with pytest.raises(ValueError) as e:
            Prodigy([p], **options)
        assert message in str(e.value), options
    with pytest.raises(ValueError, match="one parameter group"):
        Prodigy([{"params": [p]}, {"params": [torch.zeros(3, requires_grad=True)]}])
    mixed = [torch.zeros(3, requires_grad=True), torch.zeros(3, dtype=torch.float64, requires_grad=True)]
    for q in mixed:
        q.grad = torch.ones_like(q)
    with pytest.raises(RuntimeError, match="share one device and dtype"):
        Prodigy(mixed).step()
    p.grad = torch.ones(4, 4).to_sparse()
    with pytest.raises(RuntimeError, match="Prodigy does not support sparse gradients"):
        Prodigy([p]).step()


def test_exported():
    import fusedopt_torch as ft
    assert ft.Prodigy is Prodigy
