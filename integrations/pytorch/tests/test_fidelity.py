"""Regression tests of issue 15 rows 11-15 and issue 12 items 5-6: fusedopt_torch against
torch.optim where torch's layout, errors or behaviour matter more than the numbers.

CPU cases run everywhere; CUDA cases skip without a GPU. Tests that need torch 2.x options skip on
older torch (the local CPU torch may be 1.13).
"""

import copy
import os
import re
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedopt_torch as ft  # noqa: E402
from test_amp import grads_of, make_params  # noqa: E402
from test_parity import DEVICES, accepts, linear_closure, max_rel, need_device, reference_class  # noqa: E402

TOL = 1e-5

# (fusedopt class, torch.optim name, kwargs): every torch optimizer fusedopt has, with its options on.
FAMILIES = [
    (ft.SGD, "SGD", dict(lr=1e-2)),
    (ft.SGD, "SGD", dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)),
    (ft.Adam, "Adam", dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    (ft.AdamW, "AdamW", dict(lr=1e-2)),
    (ft.Adagrad, "Adagrad", dict(lr=1e-2, initial_accumulator_value=0.1, weight_decay=0.1)),
    (ft.RMSprop, "RMSprop", dict(lr=1e-3, momentum=0.5, centered=True)),
    (ft.RAdam, "RAdam", dict(lr=1e-2)),
    (ft.NAdam, "NAdam", dict(lr=1e-2, weight_decay=0.1)),
    (ft.Adamax, "Adamax", dict(lr=1e-2)),
    (ft.Adadelta, "Adadelta", dict(lr=0.5)),
]
IDS = [f"{c.__name__}-{'-'.join(k for k in kw if k != 'lr') or 'default'}" for c, _, kw in FAMILIES]


def torch_cls(name, kwargs):
    cls = reference_class(name)
    if cls is None or not accepts(cls, kwargs):
        pytest.skip(f"torch {torch.__version__}'s {name} lacks an option of {sorted(kwargs)}")
    extra = dict(foreach=False) if accepts(cls, {"foreach": None}) else {}
    return lambda p: cls(p, **kwargs, **extra)


def run_both(make_ref, make_ours, params_ref, params_ours, grads, steps=20):
    ref, ours = make_ref(params_ref), make_ours(params_ours)
    for t in range(steps):
        for a, b, g in zip(params_ref, params_ours, grads(t)):
            a.grad = g.clone() if g is not None else None
            b.grad = g.clone() if g is not None else None
        ref.step()
        ours.step()
    return ref, ours


def layout_params(kind, device):
    """(params built the same way twice, a grad function): non-dense, transposed, channels_last."""
    g = torch.Generator().manual_seed(0)
    if kind == "sliced":  # torch's test_forloop_goes_right_direction(contiguous=False): gaps in memory
        base = [torch.randn(10, 5, 2, generator=g), torch.randn(10, 2, generator=g)]

        def make():
            return [torch.nn.Parameter(base[0].clone().to(device)[..., 0]), torch.nn.Parameter(
                base[1].clone().to(device)[..., 0])]
    elif kind == "transposed":
        base = [torch.randn(5, 10, generator=g), torch.randn(7, 3, generator=g)]

        def make():
            return [torch.nn.Parameter(b.clone().to(device).t()) for b in base]
    else:  # channels_last
        base = [torch.randn(2, 3, 4, 5, generator=g)]

        def make():
            return [torch.nn.Parameter(base[0].clone().to(device).contiguous(memory_format=torch.channels_last))]
    return make


# ---- row 11: non-contiguous parameters ------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["sliced", "transposed", "channels_last"])
@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_noncontiguous_params_match_torch(family, kind, device):
    """Autograd's gradients (same strides as a dense parameter, contiguous for a sliced one)."""
    need_device(device)
    ours_cls, name, kwargs = family
    torch_cls(name, kwargs)  # skips where the local torch lacks an option
    make = layout_params(kind, device)
    a, b = make(), make()
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(p.shape, generator=gen) for _ in range(20) for p in a]

    def backward(params, t):
        loss = sum((p * inputs[t * len(params) + i].to(device)).sin().sum() for i, p in enumerate(params))
        loss.backward()

    ref, ours = torch_cls(name, kwargs)(a), ours_cls(b, **kwargs)
    for t in range(20):
        ref.zero_grad()
        ours.zero_grad()
        backward(a, t)
        backward(b, t)
        assert [x.grad.stride() for x in a] == [y.grad.stride() for y in b]
        ref.step()
        ours.step()
    assert max_rel(b, a) <= TOL
    assert [p.stride() for p in a] == [p.stride() for p in b]  # stepped in place, layout kept
    if kind != "sliced":
        assert ours._views == [], "dense parameters with same-strided gradients are stepped in place"


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_gradient_with_other_strides_than_param(family):
    """A dense parameter whose .grad has other strides (set by hand): stepped as torch does."""
    ours_cls, name, kwargs = family
    make_ref = torch_cls(name, kwargs)
    base = torch.randn(6, 4)
    a, b = [torch.nn.Parameter(base.clone())], [torch.nn.Parameter(base.clone())]
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(4, 6, generator=gen).t() for _ in range(10)]  # strides (1, 6) for a (6, 4) param
    ref, ours = make_ref(a), ours_cls(b, **kwargs)
    for t in range(10):
        if t == 5:  # a contiguous gradient again: back to the direct route (still correct either way)
            grads[t] = grads[t].contiguous()
        a[0].grad, b[0].grad = grads[t].clone(), grads[t].clone()
        ref.step()
        ours.step()
    assert max_rel(b, a) <= TOL


def test_forloop_goes_right_direction_noncontiguous():
    """PyTorch's test_forloop_goes_right_direction(contiguous=False), which segfaulted: every family."""
    for ours_cls, _, kwargs in FAMILIES + [(ft.LAMB, None, dict(lr=1e-2)), (ft.Lion, None, dict(lr=1e-3))]:
        weight = torch.nn.Parameter(torch.randn(10, 5, 2)[..., 0])
        bias = torch.nn.Parameter(torch.randn(10, 2)[..., 0])
        inp = torch.randn(5)
        opt = ours_cls([weight, bias], **kwargs)

        closure = linear_closure(opt, weight, bias, inp)

        initial = closure().item()
        for _ in range(20):
            closure()
            opt.step()
        assert closure().item() < initial, ours_cls.__name__


def test_engine_rejects_non_dense_and_undefined_tensors_cleanly():
    """The cause of the segfault class: set_groups checks every tensor before keeping it."""
    e = ft.extension().Engine(ft.extension().Family.adam, ft._ext.builtin_provider("adam"), True)
    with pytest.raises(RuntimeError, match="not dense"):
        e.set_groups([([torch.randn(4, 2)[:, 0]], [None], [0])])
    with pytest.raises(RuntimeError, match="must be dense with the parameter's strides"):
        e.set_groups([([torch.randn(4, 2)], [[torch.randn(2, 4).t()]], [0])])
    assert e.plans() == 0


# ---- row 12: complex parameters ---------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_complex_params_step_their_real_view(family, device):
    """torch's test_complex: a complex optimizer equals one over view_as_real copies, bit for bit,
    with a real parameter mixed in; and torch's own result where torch runs it."""
    need_device(device)
    ours_cls, name, kwargs = family
    gen = torch.Generator().manual_seed(3)
    cplx = [torch.randn(10, 5, dtype=torch.complex64, generator=gen).to(device).requires_grad_(),
            torch.randn(10, dtype=torch.complex64, generator=gen).to(device).requires_grad_(),
            torch.randn(10, 5, generator=gen).to(device).requires_grad_()]
    real = [(torch.view_as_real(p) if p.is_complex() else p).detach().clone().requires_grad_() for p in cplx]
    ref_c = [p.detach().clone().requires_grad_() for p in cplx]
    o_c, o_r = ours_cls(cplx, **kwargs), ours_cls(real, **kwargs)
    for _ in range(3):
        for pc, pr in zip(cplx, real):
            g = torch.randn(pr.shape, generator=gen).to(device)
            pr.grad = g
            pc.grad = torch.view_as_complex(g.clone()) if pc.is_complex() else g.clone()
        o_c.step()
        o_r.step()
    for pc, pr in zip(cplx, real):
        assert torch.equal(torch.view_as_real(pc) if pc.is_complex() else pc, pr)
    # torch's layout: complex states, complex Adagrad sum started at (v + vj).
    for p in cplx[:2]:
        for k, v in o_c.state[p].items():
            if k not in ("step", "mu_product"):
                assert v.is_complex() and v.shape == p.shape, k
    cls = reference_class(name)
    if accepts(cls, kwargs):
        try:
            ref = cls(ref_c, **kwargs)
            for pc, pr in zip(cplx, ref_c):
                pr.grad = None
            ours2 = ours_cls([p.detach().clone().requires_grad_() for p in ref_c], **kwargs)
            gen2 = torch.Generator().manual_seed(4)
            for _ in range(3):
                for pr, po in zip(ref_c, ours2.param_groups[0]["params"]):
                    g = torch.randn(pr.shape, dtype=pr.dtype, generator=gen2).to(device)
                    pr.grad, po.grad = g.clone(), g.clone()
                ref.step()
                ours2.step()
        except (RuntimeError, TypeError) as e:  # older torch without complex support for this optimizer
            pytest.skip(f"torch {torch.__version__} cannot step complex {name}: {e}")
        got = [torch.view_as_real(p) if p.is_complex() else p for p in ours2.param_groups[0]["params"]]
        want = [torch.view_as_real(p) if p.is_complex() else p for p in ref_c]
        assert max_rel(got, want) <= TOL


# ---- row 13: torch's constructor errors -------------------------------------------------------------

# (class, kwargs, exception, message regex): torch 2.11's errors (test_optim.py test_errors /
# common_optimizers.py error inputs).
ERRORS = [
    (ft.Adam, dict(foreach=True, fused=True), RuntimeError, "`fused` and `foreach` cannot be `True` together"),
    (ft.AdamW, dict(foreach=True, fused=True), RuntimeError, "`fused` and `foreach` cannot be `True` together"),
    (ft.SGD, dict(foreach=True, fused=True), RuntimeError, "`fused` and `foreach` cannot be `True` together"),
    (ft.Adagrad, dict(foreach=True, fused=True), RuntimeError, "`fused` and `foreach` cannot be `True` together"),
    (ft.Adam, dict(fused=True, differentiable=True), RuntimeError, "`fused` does not support `differentiable`"),
    (ft.AdamW, dict(fused=True, differentiable=True), RuntimeError, "`fused` does not support `differentiable`"),
    (ft.SGD, dict(fused=True, differentiable=True), RuntimeError, "`fused` does not support `differentiable`"),
    (ft.Adagrad, dict(fused=True, differentiable=True), RuntimeError, "`fused` does not support `differentiable`"),
    (ft.Adam, dict(lr=1e-2, betas=(1.0, 0.0)), ValueError, "Invalid beta parameter at index 0: 1.0"),
    (ft.Adam, dict(lr=1e-2, weight_decay=-1), ValueError, "Invalid weight_decay value: -1"),
    (ft.Adam, dict(lr=torch.tensor(0.001), foreach=True), ValueError,
     "lr as a Tensor is not supported for capturable=False and foreach=True"),
    (ft.Adam, dict(lr=1e-2, betas=(0.9, torch.tensor(0.99))), ValueError,
     "betas must be either both floats or both Tensors"),
    (ft.AdamW, dict(lr=1e-2, betas=(torch.tensor(0.9), 0.99)), ValueError,
     "betas must be either both floats or both Tensors"),
    (ft.Adam, dict(lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True), ValueError,
     r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True"),
    (ft.Adam, dict(lr=torch.tensor([0.001, 0.001])), ValueError, "Tensor lr must be 1-element"),
    (ft.SGD, dict(lr=torch.tensor([0.001, 0.001])), ValueError, "Tensor lr must be 1-element"),
    (ft.NAdam, dict(lr=torch.tensor([0.001, 0.001])), ValueError, "Tensor lr must be 1-element"),
    (ft.SGD, dict(lr=1e-2, momentum=-0.5), ValueError, "Invalid momentum value: -0.5"),
    (ft.Adagrad, dict(lr=1e-2, lr_decay=-0.5), ValueError, "Invalid lr_decay value: -0.5"),
    (ft.RMSprop, dict(lr=1e-2, momentum=-1.0), ValueError, "Invalid momentum value: -1.0"),
    (ft.RAdam, dict(lr=1e-2, betas=(1.0, 0.0)), ValueError, "Invalid beta parameter at index 0: 1.0"),
    (ft.RAdam, dict(lr=1e-2, weight_decay=-1), ValueError, "Invalid weight_decay value: -1"),
    (ft.Adamax, dict(lr=1e-2, betas=(0.0, 1.0)), ValueError, "Invalid beta parameter at index 1: 1.0"),
    (ft.Adadelta, dict(lr=1e-2, rho=1.1), ValueError, "Invalid rho value: 1.1"),
    (ft.NAdam, dict(lr=1e-2, betas=(1.0, 0.0)), ValueError, "Invalid beta parameter at index 0: 1.0"),
    (ft.NAdam, dict(lr=1e-2, momentum_decay=-0.2), ValueError, "Invalid momentum_decay value: -0.2"),
]


@pytest.mark.parametrize("case", ERRORS, ids=[f"{c.__name__}-{i}" for i, (c, *_rest) in enumerate(ERRORS)])
def test_constructor_errors_are_torchs(case):
    cls, kwargs, exc, regex = case
    params = [torch.nn.Parameter(torch.randn(2, 2))]
    with pytest.raises(exc, match=regex):
        cls(params, **kwargs)
    # Where the local torch knows the option, it raises the same (its messages may be older).
    ref = getattr(torch.optim, cls.__name__)
    if accepts(ref, kwargs) and torch.__version__ >= "2.5":
        with pytest.raises(exc, match=regex):
            ref(params, **kwargs)


def test_fused_flag_alone_and_tensor_betas_without_foreach_are_accepted():
    p = [torch.nn.Parameter(torch.randn(3))]
    ft.Adam(p, fused=True)
    ft.SGD(p, fused=True)
    opt = ft.Adam(p, lr=torch.tensor(0.01), betas=(torch.tensor(0.9), torch.tensor(0.99)))
    p[0].grad = torch.ones(3)
    opt.step()


# ---- row 14: the step dtype follows torch.get_default_dtype() ---------------------------------------


@pytest.mark.parametrize("cls", [ft.Adam, ft.Adagrad, ft.NAdam, ft.RAdam])
def test_step_dtype_follows_default_dtype(cls):
    old = torch.get_default_dtype()
    try:
        for default, want in ((torch.float64, torch.float64), (torch.float32, torch.float32)):
            torch.set_default_dtype(default)
            p = torch.nn.Parameter(torch.randn(4, dtype=torch.float32))
            opt = cls([p], lr=1e-2)
            for _ in range(2):
                p.grad = torch.randn(4, dtype=torch.float32)
                opt.step()
            sd = opt.state_dict()
            assert sd["state"][0]["step"].dtype == want
            assert float(sd["state"][0]["step"]) == 2.0
            if cls is ft.NAdam:
                assert sd["state"][0]["mu_product"].dtype == want
    finally:
        torch.set_default_dtype(old)


# ---- row 15: SGD without momentum keeps no state ----------------------------------------------------


def test_sgd_without_momentum_keeps_no_state():
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = ft.SGD(params, lr=0.1), torch.optim.SGD(ref_params, lr=0.1)
    for _ in range(3):
        for p, q in zip(params, ref_params):
            p.grad = torch.ones(5)
            q.grad = torch.ones(5)
        opt.step()
        ref.step()
    assert len(opt.state) == 0
    assert opt.state_dict()["state"] == {}
    if int(torch.__version__.split(".")[0]) >= 2:  # torch 1.13 kept {'momentum_buffer': None} entries
        assert ref.state_dict()["state"] == {}
    assert max_rel(params, ref_params) == 0.0
    # Turning momentum on later creates torch's buffers from the next gradient on.
    opt.param_groups[0]["momentum"] = 0.9
    ref.param_groups[0]["momentum"] = 0.9
    for _ in range(3):
        for p, q in zip(params, ref_params):
            p.grad = torch.ones(5)
            q.grad = torch.ones(5)
        opt.step()
        ref.step()
    assert set(opt.state_dict()["state"][0]) == set(ref.state_dict()["state"][0]) == {"momentum_buffer"}
    assert max_rel(params, ref_params) <= TOL


# ---- issue 12 item 5: NAdam and Adam(decoupled_weight_decay) ----------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_nadam_state_layout_and_mu_product(device):
    need_device(device)
    make_ref = torch_cls("NAdam", dict(lr=2e-3))
    a = [torch.nn.Parameter(torch.randn(7, device=device)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(7, generator=gen).to(device) for _ in a] for _ in range(12)]
    for t in range(12):  # parameter 1 skips steps 3-5: its step and mu_product fall behind
        for i, g in enumerate(grads[t]):
            if i == 1 and 3 <= t < 6:
                grads[t][i] = None
    ref, ours = run_both(make_ref, lambda p: ft.NAdam(p, lr=2e-3), a, b, lambda t: grads[t], steps=12)
    assert max_rel(b, a) <= TOL
    sr, so = ref.state_dict()["state"], ours.state_dict()["state"]
    for i in range(3):
        assert set(sr[i]) == set(so[i]) == {"step", "mu_product", "exp_avg", "exp_avg_sq"}
        assert float(sr[i]["step"]) == float(so[i]["step"])
        assert sr[i]["mu_product"].dtype == so[i]["mu_product"].dtype
        assert abs(float(sr[i]["mu_product"]) - float(so[i]["mu_product"])) <= 1e-6 * abs(float(sr[i]["mu_product"]))
    assert float(so[1]["step"]) == 9.0


def test_nadam_changed_betas_split_buckets_by_mu_product():
    """Two parameters at the same step with different mu_products (beta1 changed while one had no
    gradient) must not share a bucket: each keeps its own product, as torch keeps it per parameter."""
    make_ref = torch_cls("NAdam", dict(lr=2e-3))
    a = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ref, ours = make_ref(a), ft.NAdam(b, lr=2e-3)
    gen = torch.Generator().manual_seed(6)
    schedule = [(0,), (0,), (1,), (1,), (0, 1), (0, 1)]  # parameter 0 steps with beta1 0.9, 1 with 0.8
    for t, who in enumerate(schedule):
        beta1 = 0.9 if t < 2 else 0.8
        for o in (ref, ours):
            o.param_groups[0]["betas"] = (beta1, 0.999)
        for i in range(2):
            g = torch.randn(5, generator=gen) if i in who else None
            a[i].grad = None if g is None else g.clone()
            b[i].grad = None if g is None else g.clone()
        ref.step()
        ours.step()
    assert max_rel(b, a) <= TOL
    mus = [float(ours.state_dict()["state"][i]["mu_product"]) for i in range(2)]
    assert mus[0] != mus[1]


def test_adam_decoupled_weight_decay_is_adamw():
    a = [torch.nn.Parameter(torch.randn(9)) for _ in range(2)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    gen = torch.Generator().manual_seed(7)
    grads = [[torch.randn(9, generator=gen) for _ in a] for _ in range(10)]
    ref, ours = run_both(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
                         lambda p: ft.Adam(p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True), a, b,
                         lambda t: grads[t], steps=10)
    assert max_rel(b, a) <= TOL
    assert ours.param_groups[0]["decoupled_weight_decay"] is True
    assert ft.AdamW(b).param_groups[0]["decoupled_weight_decay"] is True
    # Loading an AdamW state into Adam switches the engine with the groups' option.
    sd = copy.deepcopy(ours.state_dict())
    other = ft.Adam([torch.nn.Parameter(p.detach().clone()) for p in b], lr=1e-2, weight_decay=0.1)
    other.load_state_dict(sd)
    for p, q in zip(other.param_groups[0]["params"], b):
        p.grad = torch.ones(9)
        q.grad = torch.ones(9)
    other.step()
    ours.step()
    assert max_rel(other.param_groups[0]["params"], b) == 0.0


# ---- issue 12 item 6: devices, sparse gradients, gradient dtypes ------------------------------------


SPARSE = [(ft.Adam, "Adam does not support sparse gradients"), (ft.AdamW, "does not support sparse gradients"),
          (ft.RMSprop, "RMSprop does not support sparse gradients"), (ft.RAdam, "RAdam does not support sparse"),
          (ft.NAdam, "NAdam does not support sparse gradients"), (ft.Adamax, "Adamax does not support sparse"),
          (ft.Adadelta, "Adadelta does not support sparse gradients")]


@pytest.mark.parametrize("case", SPARSE, ids=[c.__name__ for c, _ in SPARSE])
def test_sparse_gradients_raise_torchs_error_and_write_nothing(case):
    cls, regex = case
    p, q = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(5))
    opt = cls([p, q])
    q.grad = torch.ones(5)
    opt.step()  # plans built: the sparse gradient arrives later
    before = q.detach().clone()
    p.grad = torch.ones(5).to_sparse()
    with pytest.raises(RuntimeError, match=regex):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(5)) and torch.equal(q.detach(), before)


@pytest.mark.parametrize("cls", [ft.SGD, ft.Adagrad])
def test_sparse_gradients_of_sgd_adagrad_not_supported(cls):
    """torch's SGD and Adagrad step sparse gradients; fusedopt says so instead of guessing."""
    p = torch.nn.Parameter(torch.ones(5))
    opt = cls([p], lr=0.1)
    p.grad = torch.ones(5).to_sparse()
    with pytest.raises(NotImplementedError, match="does not support sparse gradients"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(5))


@pytest.mark.parametrize("family", FAMILIES[:4] + FAMILIES[7:8], ids=IDS[:4] + IDS[7:8])
def test_gradient_of_another_dtype(family):
    """param.data swapped to float64 after its float32 grad was set (the only way torch allows):
    torch's behaviour where torch steps it, else torch's kind of error; never wrong memory."""
    ours_cls, name, kwargs = family
    make_ref = torch_cls(name, kwargs)
    a, b = torch.nn.Parameter(torch.randn(6)), None
    b = torch.nn.Parameter(a.detach().clone())
    start = a.detach().clone()
    ref, ours = make_ref([a]), ours_cls([b], **kwargs)
    g = torch.randn(6)
    for x in (a, b):
        x.grad = g.clone()
        x.data = x.data.double()
    try:
        ref.step()
    except RuntimeError:
        # torch raises (torch 2.11's AdamW: lerp of float64 and float32); fusedopt may raise too,
        # or step the gradient converted to the parameter's dtype (docs/pytorch.md): then it must
        # equal torch's step of that converted gradient.
        try:
            ours.step()
        except RuntimeError:
            return
        c = torch.nn.Parameter(start.double())
        c.grad = g.double()
        make_ref([c]).step()
        assert b.dtype == torch.float64
        assert max_rel([b], [c]) <= TOL
        return
    ours.step()
    assert b.dtype == torch.float64
    assert max_rel([b], [a]) <= TOL


def test_params_of_one_group_on_cpu_and_cuda():
    need_device("cuda")
    base = [torch.randn(8), torch.randn(8)]
    a = [torch.nn.Parameter(base[0].clone()), torch.nn.Parameter(base[1].clone().cuda())]
    b = [torch.nn.Parameter(base[0].clone()), torch.nn.Parameter(base[1].clone().cuda())]
    gen = torch.Generator().manual_seed(8)
    grads = [[torch.randn(8, generator=gen).to(p.device) for p in a] for _ in range(10)]
    ref, ours = run_both(lambda p: torch.optim.AdamW(p, lr=1e-2), lambda p: ft.AdamW(p, lr=1e-2), a, b,
                         lambda t: grads[t], steps=10)
    assert max_rel([b[0], b[1].cpu()], [a[0], a[1].cpu()]) <= TOL
    assert ours._engine.plans() == 2  # one bucket per device


def test_params_of_one_group_on_two_gpus():
    need_device("cuda")
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU")
    a = [torch.nn.Parameter(torch.randn(8, device="cuda:0")), torch.nn.Parameter(torch.randn(8, device="cuda:1"))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    gen = torch.Generator().manual_seed(9)
    grads = [[torch.randn(8, generator=gen).to(p.device) for p in a] for _ in range(10)]
    ref, ours = run_both(lambda p: torch.optim.Adam(p, lr=1e-2), lambda p: ft.Adam(p, lr=1e-2), a, b,
                         lambda t: grads[t], steps=10)
    assert max_rel([p.cpu() for p in b], [p.cpu() for p in a]) <= TOL
    assert ours._engine.plans() == 2


def test_step_hooks_and_profiler_range_as_torch():
    """fusedopt runs torch's step pre- and post-hooks (global and per optimizer, in torch's order,
    a pre-hook may replace the arguments) and records torch's profiler range, though it skips
    torch's per-call wrapper when there is nothing to run."""
    if not hasattr(torch.optim.Optimizer, "register_step_pre_hook"):
        pytest.skip(f"torch {torch.__version__} has no step hooks")
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def hooked_log(cls):
        p = torch.nn.Parameter(torch.ones(4))
        opt = cls([p], lr=0.1)
        log = []
        handles = [
            register_optimizer_step_pre_hook(lambda o, a, k: log.append(("global pre", len(a), dict(k)))),
            opt.register_step_pre_hook(lambda o, a, k: log.append(("pre", o is opt))),
            opt.register_step_post_hook(lambda o, a, k: log.append(("post", len(a)))),
            register_optimizer_step_post_hook(lambda o, a, k: log.append(("global post",))),
        ]
        p.grad = torch.ones(4)
        opt.step()
        closure_calls = []
        # A pre-hook that supplies a closure: the step must run it.
        swap = opt.register_step_pre_hook(lambda o, a, k: (a, dict(k, closure=lambda: closure_calls.append(1))))
        opt.step()
        for h in handles + [swap]:
            h.remove()
        opt.step()  # no hooks left
        return log, closure_calls, p.detach().clone()

    theirs, ours = hooked_log(torch.optim.AdamW), hooked_log(ft.AdamW)
    assert ours[0] == theirs[0] and ours[1] == theirs[1] == [1]
    assert torch.allclose(ours[2], theirs[2])

    p = torch.nn.Parameter(torch.ones(4))
    opt = ft.AdamW([p], lr=0.1)
    p.grad = torch.ones(4)
    with torch.profiler.profile() as prof:
        opt.step()
    assert any(e.name == "Optimizer.step#AdamW.step" for e in prof.events())


def test_no_warnings_from_proxies():
    """Proxies hold gradients of their own: no 'non-leaf .grad' warnings in the user's log."""
    p = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))
    q = torch.nn.Parameter(torch.randn(6, 2)[:, 0])
    opt = ft.Adam([p, q])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
            opt.step()
    assert re.search("Adam", repr(opt))


# ---- issue 12 item 3: torch.compile -----------------------------------------------------------

def _small_model(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_of_step_and_of_a_training_step(device):
    """torch.compile(opt.step) runs, and a compiled training step that calls opt.step() breaks its
    graph cleanly there: the same parameters as the eager loop."""
    need_device(device)
    if not hasattr(torch, "compile") or not hasattr(torch, "_disable_dynamo"):
        pytest.skip(f"torch {torch.__version__} has no torch.compile")
    from torch import _dynamo
    _dynamo.reset()
    eager_model, model_a, model_b = _small_model(device), _small_model(device), _small_model(device)
    eager, opt_a, opt_b = (ft.AdamW(m.parameters(), lr=1e-2) for m in (eager_model, model_a, model_b))
    x, y = torch.randn(4, 16, device=device), torch.randn(4, 8, device=device)

    compiled_step = torch.compile(opt_a.step)

    @torch.compile(backend="aot_eager")
    def train_step(model, opt):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(4):
        for model, opt in ((eager_model, eager), (model_a, None)):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
        compiled_step()
        opt_a.zero_grad(set_to_none=True)
        train_step(model_b, opt_b)
    for e, a, b in zip(eager_model.parameters(), model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, e)
        torch.testing.assert_close(b, e, rtol=1e-5, atol=1e-6)
    assert opt_b.state_dict()["state"][0]["step"].item() == 4


# ---- issue 12 item 4: FSDP2 (DTensor parameters) ------------------------------------------------

def _one_rank_process_group():
    import socket
    import torch.distributed as dist
    if dist.is_initialized():
        return False
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    return True


def test_fsdp2_dtensor_parameters_step_their_shards():
    """fully_shard(model) then fusedopt_torch.AdamW(model.parameters()): DTensor parameters,
    gradients and states are stepped through their local shards, as torch steps them; LAMB,
    whose trust ratios need whole tensors, refuses them clearly."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no FSDP2")
    import torch.distributed as dist
    owned = _one_rank_process_group()
    try:
        plain, sharded = _small_model("cuda"), _small_model("cuda")
        for layer in sharded:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(sharded)
        assert all(isinstance(p, DTensor) for p in sharded.parameters())
        opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=False)
        opt_sharded = ft.AdamW(sharded.parameters(), lr=1e-2)
        x, y = torch.randn(4, 16, device="cuda"), torch.randn(4, 8, device="cuda")
        for _ in range(5):
            for model, opt in ((plain, opt_plain), (sharded, opt_sharded)):
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        for a, b in zip(plain.parameters(), sharded.parameters()):
            torch.testing.assert_close(b.full_tensor(), a, rtol=1e-5, atol=1e-6)
        opt_sharded.state_dict()  # refreshes state[p]['step'] (docs/pytorch.md)
        state = opt_sharded.state[next(iter(sharded.parameters()))]
        assert isinstance(state["exp_avg"], DTensor) and float(state["step"]) == 5
        lamb = ft.LAMB(sharded.parameters(), lr=1e-2)
        torch.nn.functional.mse_loss(sharded(x), y).backward()
        with pytest.raises(NotImplementedError, match="DTensor"):
            lamb.step()
    finally:
        if owned:
            dist.destroy_process_group()


# ---- issue 12 item 1: capturable=True, a tensor lr, CUDA graphs -----------------------------------

CAPTURABLE = [
    (ft.Adam, dict(amsgrad=True, weight_decay=0.1)),
    (ft.AdamW, dict()),
    (ft.RMSprop, dict(momentum=0.5, centered=True)),
    (ft.RAdam, dict()),
    (ft.Adamax, dict()),
    (ft.Adadelta, dict()),
    (ft.NAdam, dict(weight_decay=0.1, decoupled_weight_decay=True)),
    (ft.AdamW8bit, dict(min_8bit_size=0)),  # 8-bit moments (test_8bit.py)
]
CAPTURABLE_IDS = [c.__name__ for c, _ in CAPTURABLE]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CAPTURABLE, ids=CAPTURABLE_IDS)
def test_capturable_with_a_tensor_lr_equals_a_float_lr(case, device):
    """Eagerly, capturable=True with lr as a tensor (read on the device, step counts on the device)
    gives the bits of a float lr; a scheduler's change of the tensor takes effect; state['step']
    lives on the parameter's device as torch keeps it. NAdam's capturable step is another kernel
    (its product advanced by an after-step hook): on CUDA, where the extension lets nvcc contract
    each kernel into FMAs its own way, it agrees to rounding, not bit for bit."""
    need_device(device)
    cls, kw = case
    params_t, params_f = make_params(device), make_params(device)
    lr = torch.tensor(1e-2, device=device)
    opt_t = cls(params_t, lr=lr, capturable=True, **kw)
    opt_f = cls(params_f, lr=1e-2, **kw)
    for t in range(5):
        if t == 3:
            lr.fill_(5e-3)
            opt_f.param_groups[0]["lr"] = float(torch.tensor(5e-3, device=device))
        for a, b, g in zip(params_t, params_f, grads_of(t, params_t)):
            a.grad, b.grad = g.clone(), g.clone()
        opt_t.step()
        opt_f.step()
        for a, b in zip(params_t, params_f):
            if cls is ft.NAdam and device == "cuda":
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
            else:
                assert torch.equal(a, b), (t, cls.__name__)
    state = opt_t.state_dict()["state"][0]
    assert float(state["step"]) == 5
    assert opt_t.state[params_t[0]]["step"].device == params_t[0].device
    if cls is ft.NAdam:
        # mu_product advanced by the step itself (in the bucket's memory), read back by state_dict
        torch.testing.assert_close(state["mu_product"].cpu(), opt_f.state_dict()["state"][0]["mu_product"].cpu(),
                                   rtol=0 if device == "cpu" else 1e-7, atol=0)
        assert opt_t.state[params_t[0]]["mu_product"].device == params_t[0].device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [ft.Adam, ft.AdamW], ids=["Adam", "AdamW"])
def test_capturable_tensor_betas_equal_float_betas(cls, device):
    """Tensor betas (torch allows them for Adam and AdamW) are read on the device at every step:
    the bits of the same values given as floats, and a change of the tensors takes effect."""
    need_device(device)
    params_t, params_f = make_params(device), make_params(device)
    betas = (torch.tensor(0.8, device=device), torch.tensor(0.99, device=device))
    opt_t = cls(params_t, lr=torch.tensor(1e-2, device=device), betas=betas, capturable=True, weight_decay=0.1)
    opt_f = cls(params_f, lr=1e-2, betas=(float(betas[0]), float(betas[1])), weight_decay=0.1)
    for t in range(5):
        if t == 3:
            betas[0].fill_(0.85)
            opt_f.param_groups[0]["betas"] = (float(betas[0]), float(betas[1]))
        for a, b, g in zip(params_t, params_f, grads_of(t, params_t)):
            a.grad, b.grad = g.clone(), g.clone()
        opt_t.step()
        opt_f.step()
        for a, b in zip(params_t, params_f):
            assert torch.equal(a, b), (t, cls.__name__)


@pytest.mark.parametrize("case", CAPTURABLE, ids=CAPTURABLE_IDS)
def test_whole_training_step_captured_in_a_cuda_graph(case):
    """torch's whole-network recipe (warm-up on a side stream, zero_grad(set_to_none=True),
    torch.cuda.graph around forward, backward and opt.step(), static inputs): each replay equals
    an eager step, an ExponentialLR scheduler changing the lr tensor takes effect in the replays,
    and the step counts advance on the device."""
    if not torch.cuda.is_available() or not ft.with_cuda():
        pytest.skip("needs CUDA")
    cls, kw = case
    torch.manual_seed(0)
    model_g = _small_model("cuda")
    model_e = copy.deepcopy(model_g)
    lr = torch.tensor(1e-2, device="cuda")
    opt_g = cls(model_g.parameters(), lr=lr, capturable=True, **kw)
    opt_e = cls(model_e.parameters(), lr=1e-2, **kw)
    sched_g = torch.optim.lr_scheduler.ExponentialLR(opt_g, gamma=0.7)
    sched_e = torch.optim.lr_scheduler.ExponentialLR(opt_e, gamma=0.7)
    static_x, static_y = torch.randn(8, 16, device="cuda"), torch.randn(8, 8, device="cuda")

    def train_step(model, opt):
        loss = torch.nn.functional.mse_loss(model(static_x), static_y)
        loss.backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for model, opt in ((model_g, opt_g), (model_e, opt_e)):
                opt.zero_grad(set_to_none=True)
                train_step(model, opt)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt_g.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        train_step(model_g, opt_g)
    gen = torch.Generator().manual_seed(5)
    for r in range(6):
        x, y = torch.randn(8, 16, generator=gen).cuda(), torch.randn(8, 8, generator=gen).cuda()
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        opt_e.zero_grad(set_to_none=True)
        train_step(model_e, opt_e)
        sched_g.step()
        sched_e.step()
        torch.cuda.synchronize()
        for a, b in zip(model_g.parameters(), model_e.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"replay {r}: {m}")
    assert float(opt_g.state_dict()["state"][0]["step"]) == 3 + 6


def test_extension_registry_and_hyperparameters_by_name():
    """The families and hyperparameters cross into C++ by name (csrc/plans.hpp's registry)."""
    ext = ft.extension()
    classes = {ft.SGD: "sgd", ft.Adam: "adam", ft.AdamW: "adamw", ft.Adagrad: "adagrad", ft.RMSprop: "rmsprop",
               ft.LAMB: "lamb", ft.Lion: "lion", ft.RAdam: "radam", ft.Adamax: "adamax", ft.Adadelta: "adadelta",
               ft.NAdam: "nadam"}
    assert sorted(ext.Family.__members__) == sorted(list(classes.values()) + ["user"])
    for cls, name in classes.items():
        assert cls._family == name
    h = ext.Hyper()
    h.beta1, h.amsgrad = 0.5, True
    assert (h.beta1, h.amsgrad, h.lr) == (0.5, True, 1e-3)
    with pytest.raises(AttributeError):
        h.no_such_option = 1.0
    # One call per group and step: the fields by name, tensors left to the engine.
    h = ext.Hyper.of(lr=torch.tensor(0.5), beta1=0.5, amsgrad=True, weight_decay=1)
    assert (h.beta1, h.amsgrad, h.lr, h.weight_decay) == (0.5, True, 1e-3, 1.0)
    with pytest.raises(AttributeError, match="no_such_option"):
        ext.Hyper.of(no_such_option=1.0)
