"""fusedopt_torch.CAME against yangluo7/CAME's algorithm (`came_pytorch/CAME.py`), written here as
a plain PyTorch optimizer (ReferenceCAME: the same state names, shapes and dtypes, tensor by
tensor, in the gradient's dtype upcast to float32 for 16-bit parameters), on the CPU (the host
backend) and, where there is one, the GPU.

Tolerances: each parameter and each state tensor within TOLERANCE_PER_STEP of its tensor's
largest magnitude times the step number: 256 x 2^-24 for float32 (and for the float32 state of
bfloat16 parameters), 256 x 2^-53 for float64 (exp_avg and the instability cancel,
beta1 m + (1 - beta1) U and U - m: tests/units/test_came_unit.py measured exp_avg within 31
float32 roundings of its largest magnitude one step from the same values, against a float64
reading of CAME.py; here both sides round), 2^-7 (one bfloat16 rounding of the largest element)
for bfloat16 parameters (CAME.py rounds a 16-bit parameter after its weight decay and
after its update, fusedopt once; either may round the other way when the float32 updates differ
in their last bits). The reference's means are
float sums in its own order, fusedopt's double sums rounded once; torch's rsqrt on the GPU is not
correctly rounded. The worst differences measured are printed with -s. 'step' counts must be
equal; 'RMS' (the reference's, never read by its algorithm) is not kept by fusedopt_torch.CAME.
"""
import copy
import functools

import pytest
import torch

import fusedopt_torch as ft
from fusedopt_torch.came import CAME
import optimizer_testing
from optimizer_testing import assert_refused_under_capture, relative, replay_beside_eager, set_grads, twin_of

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# a matrix around the 64 x 64 tiles, a vector, a 3-D batch, one element, a scalar, R > C over
# several row tiles, a 4-D batch of 1 x 5 matrices, an empty vector
SHAPES = [(64, 33), (7,), (3, 5, 9), (1,), (), (300, 2), (2, 2, 1, 5), (0,)]
# (parameters, state) per step, relative to each tensor's largest magnitude
TOLERANCE_PER_STEP = {torch.float32: (256 * 2.0 ** -24, 256 * 2.0 ** -24),
                      torch.float64: (256 * 2.0 ** -53, 256 * 2.0 ** -53),
                      torch.bfloat16: (2.0 ** -7, 256 * 2.0 ** -24)}


class ReferenceCAME(torch.optim.Optimizer):
    """CAME.py's algorithm, one tensor at a time, in PyTorch (its constructor's asserts too)."""

    def __init__(self, params, lr=None, eps=(1e-30, 1e-16), clip_threshold=1.0, betas=(0.9, 0.999, 0.9999),
                 weight_decay=0.0):
        assert lr > 0.0
        assert all(0.0 <= beta <= 1.0 for beta in betas)
        super().__init__(params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold, betas=betas,
                                      weight_decay=weight_decay))

    @staticmethod
    def rms(x):
        return x.norm(2) / (x.numel() ** 0.5)

    @staticmethod
    def approximation(row, col):
        """rsqrt(row / mean(row)) along the rows times rsqrt(col) along the columns."""
        r = (row / row.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1)
        return r * col.unsqueeze(-2).rsqrt()

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            eps1, eps2 = group["eps"]
            beta1, beta2, beta3 = group["betas"]
            lr = group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.dtype in (torch.float16, torch.bfloat16):
                    grad = grad.float()
                if grad.is_sparse:
                    raise RuntimeError("CAME does not support sparse gradients.")
                st = self.state[p]
                factored = grad.dim() >= 2
                if len(st) == 0:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(grad)
                    if factored:
                        rows, cols = grad.shape[:-1], grad.shape[:-2] + grad.shape[-1:]
                        st["exp_avg_sq_row"] = grad.new_zeros(rows)
                        st["exp_avg_sq_col"] = grad.new_zeros(cols)
                        st["exp_avg_res_row"] = grad.new_zeros(rows)
                        st["exp_avg_res_col"] = grad.new_zeros(cols)
                    else:
                        st["exp_avg_sq"] = torch.zeros_like(grad)
                    st["RMS"] = 0
                st["step"] += 1
                st["RMS"] = self.rms(p)
                squared = grad * grad + eps1
                if factored:
                    st["exp_avg_sq_row"].mul_(beta2).add_(squared.mean(dim=-1), alpha=1.0 - beta2)
                    st["exp_avg_sq_col"].mul_(beta2).add_(squared.mean(dim=-2), alpha=1.0 - beta2)
                    update = self.approximation(st["exp_avg_sq_row"], st["exp_avg_sq_col"]) * grad
                else:
                    st["exp_avg_sq"].mul_(beta2).add_(squared, alpha=1.0 - beta2)
                    update = st["exp_avg_sq"].rsqrt() * grad
                update = update / (self.rms(update) / group["clip_threshold"]).clamp(min=1.0)
                exp_avg = st["exp_avg"]
                exp_avg.mul_(beta1).add_(update, alpha=1.0 - beta1)
                instability = (update - exp_avg) ** 2 + eps2
                if factored:
                    st["exp_avg_res_row"].mul_(beta3).add_(instability.mean(dim=-1), alpha=1.0 - beta3)
                    st["exp_avg_res_col"].mul_(beta3).add_(instability.mean(dim=-2), alpha=1.0 - beta3)
                    update = self.approximation(st["exp_avg_res_row"], st["exp_avg_res_col"]) * exp_avg
                else:
                    update = exp_avg.clone()
                if group["weight_decay"] != 0:
                    p.add_(p, alpha=-group["weight_decay"] * lr)
                p.add_(-(update * lr))


def differences(opt, ref, ours, theirs):
    """The worst relative differences of the parameters and of the state; the state's keys (but
    'RMS'), shapes, dtypes and step counts must be the reference's."""
    worst_param = worst_state = 0.0
    for p, q in zip(ours, theirs):
        mine, its = opt.state[p], ref.state[q]
        assert set(mine) - {"RMS"} == set(its) - {"RMS"}, (tuple(p.shape), set(mine), set(its))
        assert mine["step"] == its["step"], (mine["step"], its["step"])
        for key in set(mine) - {"step", "RMS"}:
            assert mine[key].shape == its[key].shape and mine[key].dtype == its[key].dtype, key
            worst_state = max(worst_state, relative(mine[key], its[key]))
        worst_param = max(worst_param, relative(p, q))
    return worst_param, worst_state


make_params = functools.partial(optimizer_testing.make_params, shapes=SHAPES)
step_both = functools.partial(optimizer_testing.step_both, differences=differences, tolerances=TOLERANCE_PER_STEP)

OPTIONS = [dict(lr=2e-4, weight_decay=1e-2),  # the README's
           dict(lr=0.05, weight_decay=0.1, clip_threshold=0.5, betas=(0.8, 0.99, 0.999), eps=(1e-20, 1e-10)),
           dict(lr=0.01, clip_threshold=1e9)]  # never clipped (CAME.py's defaults clip at every step)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("options", OPTIONS, ids=["readme", "decay-clip-betas-eps", "unclipped"])
def test_ten_steps_against_came_py(device, dtype, options):
    ours = make_params(device, dtype)
    theirs = twin_of(ours)
    opt = CAME(ours, **options)
    ref = ReferenceCAME(theirs, **options)
    worst = step_both(opt, ref, ours, theirs, 10)
    assert opt.plan_builds() == 1  # one plan; zero_grad(set_to_none=True)'s new gradients are rebound
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert all(t.dtype == state_dtype for st in opt.state.values() for k, t in st.items() if k != "step")
    print(f"\nCAME {dtype} on {device} {options}: parameters within {worst[0]:.2e}, state within {worst[1]:.2e} of "
          f"each tensor's largest magnitude (bounds {TOLERANCE_PER_STEP[dtype][0]:.2e}, "
          f"{TOLERANCE_PER_STEP[dtype][1]:.2e} a step)")


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trips_with_came_py(device):
    ours = make_params(device, seed=1)
    opt = CAME(ours, lr=0.01, weight_decay=0.01)
    for step in range(1, 4):
        set_grads(ours, step)
        opt.step()
    theirs = twin_of(ours)
    ref = ReferenceCAME(theirs, lr=0.01, weight_decay=0.01)
    # A deep copy, as a checkpoint would be: torch's load_state_dict keeps the tensors it is given.
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # fusedopt's state_dict loads into the reference
    assert opt.state_dict()["param_groups"] == ReferenceCAME(twin_of(ours), lr=0.01, weight_decay=0.01).state_dict()[
        "param_groups"]
    for p, q in zip(ours, theirs):
        assert set(opt.state[p]) == set(ref.state[q]) and opt.state[p]["step"] == ref.state[q]["step"] == 3
        for key in set(opt.state[p]) - {"step"}:
            assert torch.equal(opt.state[p][key], ref.state[q][key]), key
    step_both(opt, ref, ours, theirs, 3, first=4)  # and both continue alike
    back = CAME(ours, lr=0.01, weight_decay=0.01)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))  # the reference's (with its 'RMS') into fusedopt's
    step_both(back, ref, ours, theirs, 3, first=7)
    assert all(s["step"] == 9 for s in back.state_dict()["state"].values())


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_state_stays_float32_through_load_state_dict(device):
    ours = make_params(device, dtype=torch.bfloat16, seed=2)
    opt = CAME(ours, lr=0.01)
    for step in range(1, 3):
        set_grads(ours, step)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    back = CAME(twin_of(ours), lr=0.01)
    back.load_state_dict(saved)  # torch's own load would cast the state to bfloat16
    for st, loaded in zip(opt.state.values(), back.state.values()):
        assert loaded["step"] == st["step"] == 2
        for key in set(st) - {"step"}:
            assert loaded[key].dtype == torch.float32 and torch.equal(loaded[key], st[key]), key


@pytest.mark.parametrize("device", DEVICES)
def test_a_parameter_without_gradient_is_skipped(device):
    ours = make_params(device, shapes=[(8, 5), (6,), (4, 3)])
    theirs = twin_of(ours)
    opt, ref = CAME(ours, lr=0.01), ReferenceCAME(theirs, lr=0.01)
    tolerance = TOLERANCE_PER_STEP[torch.float32]
    for step in range(1, 7):
        set_grads(ours, step)
        set_grads(theirs, step)
        if step in (2, 3):  # the matrix (8, 5) and then the vector have none
            ours[step - 2].grad = theirs[step - 2].grad = None
        before = [p.detach().clone() for p in ours]
        opt.step()
        ref.step()
        if step in (2, 3):
            assert torch.equal(ours[step - 2], before[step - 2])
        d = differences(opt, ref, ours, theirs)
        assert d[0] <= tolerance[0] * step and d[1] <= tolerance[1] * step, (step, d)
    assert sorted(opt.state[p]["step"] for p in ours) == [5, 5, 6]


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_lr_and_a_schedulers_zero(device):
    ours = make_params(device)
    theirs = twin_of(ours)
    opt = CAME(ours, lr=torch.tensor(0.02))  # read on the device, where the step runs
    ref = ReferenceCAME(theirs, lr=torch.tensor(0.02))
    step_both(opt, ref, ours, theirs, 3)
    for o in (opt, ref):  # a warmup's lr of 0: the state moves, the parameters do not
        o.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in ours]
    step_both(opt, ref, ours, theirs, 2, first=4)
    assert all(torch.equal(p, b) for p, b in zip(ours, before))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_capturable_step_replayed_from_a_cuda_graph():
    # capturable=True: one ordinary step builds the plans, one step is captured, and each replay
    # gives the bits of an eager fusedopt step (the same kernels), with 'step' counted on the
    # device. Without capturable, a captured step raises.
    graphed = make_params("cuda")
    eager = twin_of(graphed)
    opt = CAME(graphed, lr=0.01, weight_decay=0.01, capturable=True)
    ref = CAME(eager, lr=0.01, weight_decay=0.01)
    set_grads(graphed, 1)
    set_grads(eager, 1)
    opt.step()
    ref.step()

    def same_as_eager(step):
        for p, q in zip(graphed, eager):
            assert torch.equal(p, q), (step, tuple(p.shape))
            for key in set(ref.state[q]) - {"step"}:
                assert torch.equal(opt.state[p][key], ref.state[q][key]), (step, key)

    replay_beside_eager(opt, ref, 6, same_as_eager)
    assert all(opt.state[p]["step"].device.type == "cuda" and float(opt.state[p]["step"]) == 7 for p in graphed)
    assert "capturable" not in CAME(twin_of(graphed), lr=0.01).param_groups[0]
    assert_refused_under_capture(CAME(twin_of(graphed), lr=0.01))


def test_errors():
    matrix = torch.zeros(4, 4, requires_grad=True)
    for options in (dict(), dict(lr=0.0), dict(lr=-1.0), dict(lr=1e-3, betas=(1.5, 0.999, 0.9999)),
                    dict(lr=1e-3, betas=(0.9, -0.1, 0.9999))):
        with pytest.raises((AssertionError, TypeError)):  # CAME.py's asserts (lr=None: None > 0.0)
            ReferenceCAME([matrix], **options)
        with pytest.raises(ValueError):
            CAME([matrix], **options)
    with pytest.raises(ValueError):
        CAME([matrix], lr=torch.tensor([0.1, 0.2]))
    for make_bad in (lambda: torch.zeros(3, dtype=torch.complex64, requires_grad=True),
                     lambda: torch.zeros(4, 4, requires_grad=True)):
        p = make_bad()
        p.grad = torch.ones_like(p) if p.is_complex() else torch.ones(4, 4).to_sparse()
        with pytest.raises(RuntimeError, match="CAME does not support"):
            CAME([p], lr=1e-3).step()
    sliced = torch.zeros(4, 8)[:, ::2].requires_grad_()
    sliced.grad = torch.ones(4, 4)
    with pytest.raises(RuntimeError, match="contiguous"):
        CAME([sliced], lr=1e-3).step()
    p = torch.zeros(4, 4, requires_grad=True)
    p.grad = torch.ones(4, 4)
    opt = CAME([p], lr=1e-3)
    opt.state[p].update(step=0, exp_avg=torch.zeros(4, 4, dtype=torch.float64))  # not of CAME.py's dtype
    with pytest.raises(RuntimeError, match="exp_avg"):
        opt.step()


def test_exported():
    assert ft.CAME is CAME
    assert CAME([torch.zeros(2, requires_grad=True)], lr=1e-3).supports_memory_efficient_fp16
