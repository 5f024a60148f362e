"""fusedopt_torch.Adafactor against torch.optim.Adafactor (torch 2.11), on the CPU (the host
backend) and, where there is one, the GPU.

Tolerances: each parameter and each statistic (row_var, col_var, variance) within a few float
roundings per step of its tensor's largest magnitude, TOLERANCE_PER_STEP = 16 x 2^-24 (float32)
or 8 x 2^-8 (bfloat16: torch's means round three times in bfloat16) times the step number. torch's row and column means are a float norm,
squared and divided (three roundings, its own summation order), fusedopt's a double sum rounded
once; torch's rsqrt on the GPU is not correctly rounded; each step's alpha / denom is a sum over
the tensor in either order. The worst differences measured are printed with -s. 'step' counts
must be equal.
"""
import copy
import functools

import pytest
import torch

import fusedopt_torch as ft
from fusedopt_torch.adafactor import Adafactor
import optimizer_testing
from optimizer_testing import assert_refused_under_capture, relative, replay_beside_eager, set_grads, twin_of

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# a matrix around the 64-column tiles, a vector, a 3-D batch, one element, a scalar, R > C over
# several row tiles, a 4-D batch of 1 x 5 matrices
SHAPES = [(64, 33), (7,), (3, 5, 9), (1,), (), (300, 2), (2, 2, 1, 5)]
TOLERANCE_PER_STEP = {torch.float32: (16 * 2.0 ** -24,) * 2, torch.bfloat16: (8 * 2.0 ** -8,) * 2}  # parameters, state


def differences(opt, ref, ours, theirs):
    """The worst relative differences of the parameters and of the statistics; the state's keys
    and step counts must be torch's."""
    worst_param = worst_state = 0.0
    for p, q in zip(ours, theirs):
        mine, torchs = opt.state[p], ref.state[q]
        assert set(mine) == set(torchs), (tuple(p.shape), set(mine), set(torchs))
        assert torch.equal(mine["step"], torchs["step"]), (mine["step"], torchs["step"])
        for key in mine:
            if key != "step":
                assert mine[key].shape == torchs[key].shape and mine[key].dtype == torchs[key].dtype, key
                worst_state = max(worst_state, relative(mine[key], torchs[key]))
        worst_param = max(worst_param, relative(p, q))
    return worst_param, worst_state


make_params = functools.partial(optimizer_testing.make_params, shapes=SHAPES)
step_both = functools.partial(optimizer_testing.step_both, differences=differences, tolerances=TOLERANCE_PER_STEP)

OPTIONS = [dict(),  # torch's defaults
           dict(lr=0.5, weight_decay=0.1, maximize=True, eps=(1e-3, 1e-3)),  # rho_t = 1 / sqrt(t) from step 5
           dict(lr=0.05, beta2_decay=-0.5, eps=(None, 5.0), d=2.0)]  # eps2 above RMS(param), d above 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", OPTIONS, ids=["defaults", "decay-maximize-eps1", "eps2-d"])
def test_ten_steps_against_torch(device, options):
    ours = make_params(device)
    theirs = twin_of(ours)
    opt = Adafactor(ours, **options)
    ref = torch.optim.Adafactor(theirs, **options)
    worst = step_both(opt, ref, ours, theirs, 10)
    assert opt.plan_builds() == 1  # one plan; zero_grad(set_to_none=True)'s new gradients are rebound
    print(f"\nAdafactor float32 on {device} {options}: parameters within {worst[0]:.2e}, statistics within "
          f"{worst[1]:.2e} of each tensor's largest magnitude (bound {TOLERANCE_PER_STEP[torch.float32][0]:.2e} a step)")


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trips_with_torch(device):
    ours = make_params(device, seed=1)
    opt = Adafactor(ours, weight_decay=0.01)
    for step in range(1, 4):
        set_grads(ours, step)
        opt.step()
    theirs = twin_of(ours)
    ref = torch.optim.Adafactor(theirs, weight_decay=0.01)
    # A deep copy, as a checkpoint would be: torch's load_state_dict keeps the tensors it is given.
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # fusedopt's state_dict loads into torch's
    assert opt.state_dict()["param_groups"] == torch.optim.Adafactor(twin_of(ours), weight_decay=0.01).state_dict()[
        "param_groups"]
    for p, q in zip(ours, theirs):
        assert set(opt.state[p]) == set(ref.state[q])
        for key in opt.state[p]:
            assert torch.equal(opt.state[p][key], ref.state[q][key]), key
    step_both(opt, ref, ours, theirs, 3, first=4)  # and both continue alike
    back = Adafactor(ours, weight_decay=0.01)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))  # torch's into fusedopt's
    step_both(back, ref, ours, theirs, 3, first=7)
    assert all(float(s["step"]) == 9 for s in back.state_dict()["state"].values())


@pytest.mark.parametrize("device", DEVICES)
def test_a_parameter_without_gradient_is_skipped(device):
    ours = make_params(device, shapes=[(8, 5), (6,), (4, 3)])
    theirs = twin_of(ours)
    opt, ref = Adafactor(ours), torch.optim.Adafactor(theirs)
    tolerance = TOLERANCE_PER_STEP[torch.float32]
    for step in range(1, 7):
        set_grads(ours, step)
        set_grads(theirs, step)
        if step in (2, 3):  # the matrix (8, 5) and then the vector have none: their steps fall behind
            ours[step - 2].grad = theirs[step - 2].grad = None
        before = [p.detach().clone() for p in ours]
        opt.step()
        ref.step()
        if step in (2, 3):
            assert torch.equal(ours[step - 2], before[step - 2])
        d = differences(opt, ref, ours, theirs)
        assert d[0] <= tolerance[0] * step and d[1] <= tolerance[1] * step, (step, d)
    # The counts differ (5, 5, 6): the group steps in plans of one count each.
    assert sorted(int(opt.state[p]["step"]) for p in ours) == [5, 5, 6]


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_parameters(device):
    ours = make_params(device, dtype=torch.bfloat16)
    theirs = twin_of(ours)
    opt, ref = Adafactor(ours, lr=0.05), torch.optim.Adafactor(theirs, lr=0.05)
    worst = step_both(opt, ref, ours, theirs, 3)
    assert all(s.dtype == torch.bfloat16 for st in opt.state.values() for k, s in st.items() if k != "step")
    print(f"\nAdafactor bfloat16 on {device}: parameters within {worst[0]:.2e}, statistics within {worst[1]:.2e} "
          f"(bound {TOLERANCE_PER_STEP[torch.bfloat16][0]:.2e} a step)")


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_lr_is_the_float_lr(device):
    ours = make_params(device)
    theirs = twin_of(ours)
    opt = Adafactor(ours, lr=torch.tensor(0.2), weight_decay=0.1)  # read on the device, where the step runs
    ref = torch.optim.Adafactor(theirs, lr=torch.tensor(0.2), weight_decay=0.1)
    step_both(opt, ref, ours, theirs, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_capturable_step_replayed_from_a_cuda_graph():
    # capturable=True: one ordinary step builds the plans, one step is captured, and each replay
    # advances the count on the device: the bits of an eager fusedopt step every time (the same
    # kernels; the step count read from device memory instead of passed by value), state['step']
    # on the device and counting the replays. Without capturable, a captured step raises.
    shapes = [(64, 33), (7,), (3, 5, 9), (300, 2)]
    graphed = make_params("cuda", shapes=shapes)
    eager = twin_of(graphed)
    opt = Adafactor(graphed, lr=0.05, weight_decay=0.1, capturable=True)
    ref = Adafactor(eager, lr=0.05, weight_decay=0.1)
    set_grads(graphed, 1)
    set_grads(eager, 1)
    opt.step()
    ref.step()

    def same_as_eager(step):
        for p, q in zip(graphed, eager):
            assert torch.equal(p, q), (step, tuple(p.shape))
            for key in ("row_var", "col_var", "variance"):
                if key in opt.state[p]:
                    assert torch.equal(opt.state[p][key], ref.state[q][key]), (step, key)

    replay_beside_eager(opt, ref, 6, same_as_eager)
    assert all(opt.state[p]["step"].device.type == "cuda" and float(opt.state[p]["step"]) == 7 for p in graphed)
    assert "capturable" not in Adafactor(twin_of(graphed)).param_groups[0]  # torch's groups unless asked
    assert_refused_under_capture(Adafactor(twin_of(graphed)))


def test_errors_as_torch():
    matrix = torch.zeros(4, 4, requires_grad=True)
    for options in (dict(lr=-1.0), dict(lr=torch.tensor([0.1, 0.2])), dict(beta2_decay=0.8), dict(eps=(-1.0, 1e-3)),
                    dict(eps=(None, -1.0)), dict(d=0.5), dict(weight_decay=-0.1)):
        with pytest.raises(ValueError) as theirs:
            torch.optim.Adafactor([matrix], **options)
        with pytest.raises(ValueError) as ours:
            Adafactor([matrix], **options)
        assert str(ours.value) == str(theirs.value), options
    for make_bad in (lambda: torch.zeros(3, dtype=torch.complex64, requires_grad=True),
                     lambda: torch.zeros(4, 4, requires_grad=True)):
        messages = []
        for cls in (torch.optim.Adafactor, Adafactor):
            p = make_bad()
            p.grad = torch.ones_like(p) if p.is_complex() else torch.ones(4, 4).to_sparse()
            with pytest.raises(RuntimeError) as e:
                cls([p]).step()
            messages.append(str(e.value))
        assert messages[0] == messages[1]


def test_exported():
    assert ft.Adafactor is Adafactor
