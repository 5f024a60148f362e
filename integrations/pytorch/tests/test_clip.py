"""Gradient clipping fused into the step (FusedOptimizer.clip_grad_norm_): the norm is taken
before the step (fusedopt's norm plan for the 2- and inf-norms), the step scales the gradients
by torch's coefficient as it reads them, and the gradients are not written.

CPU cases run everywhere; the GradScaler loops need CUDA.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedopt_torch as ft  # noqa: E402
from test_amp import AMP_FAMILIES, IDS, close_on_cuda, grads_of, make_params, same_bits  # noqa: E402
from test_parity import DEVICES, need_device  # noqa: E402

# grads_of's gradients have norms near 1000: 1.0 clips every step, 1e9 never.
CLIPPING, NOT_CLIPPING = 1.0, 1e9


def coefficient(norm, max_norm):
    """torch.nn.utils.clip_grad_norm_'s coefficient for a total norm."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def torch_clip(grads, max_norm):
    """What torch.nn.utils.clip_grad_norm_ returns and leaves in copies of `grads`."""
    copies = [torch.zeros_like(g).requires_grad_() for g in grads]
    for c, g in zip(copies, grads):
        c.grad = g.clone()
    return torch.nn.utils.clip_grad_norm_(copies, max_norm), [c.grad for c in copies]


def check_same_step(params_a, params_b, device, t):
    """The same bits on the CPU; on CUDA within close_on_cuda (two kernels compiled apart)."""
    for x, y in zip(params_a, params_b):
        if device == "cpu":
            assert same_bits(x, y), t
        else:
            close_on_cuda(x, y, t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", AMP_FAMILIES, ids=IDS)
def test_fused_clip_is_the_step_on_gradients_divided_by_the_inverse_coefficient(family, device):
    """The bits of stepping gradients divided (in double, rounded to float) by 1 / coefficient,
    torch's coefficient of the returned norm (torch's to 1e-6); p.grad is left as it was."""
    cls, _, kw = family
    need_device(device)
    params_a, params_b = make_params(device), make_params(device)
    a, b = cls(params_a, **kw), cls(params_b, **kw)
    for t in range(6):
        grads = grads_of(t, params_a)
        for p in params_a:
            p.grad = None
        for p, g in zip(params_a, grads):
            p.grad = g.clone()
        norm = a.clip_grad_norm_(CLIPPING)
        torch.testing.assert_close(norm, torch_clip(grads, CLIPPING)[0], rtol=1e-6, atol=0)
        a.step()
        assert all(same_bits(p.grad, g) for p, g in zip(params_a, grads)), "the gradients were written"
        divisor = torch.reciprocal(coefficient(norm, CLIPPING).float())
        assert divisor.item() > 1.0  # it clipped
        for p, g in zip(params_b, grads):
            p.grad = (g.double() / divisor.double()).float()
        b.step()
        check_same_step(params_a, params_b, device, t)


@pytest.mark.parametrize("device", DEVICES)
def test_a_clip_that_does_not_bind_gives_the_unclipped_bits(device):
    need_device(device)
    params_a, params_b = make_params(device), make_params(device)
    a, b = ft.AdamW(params_a, lr=1e-2, weight_decay=0.1), ft.AdamW(params_b, lr=1e-2, weight_decay=0.1)
    for t in range(4):
        grads = grads_of(t, params_a)
        for p, q, g in zip(params_a, params_b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        a.clip_grad_norm_(NOT_CLIPPING)
        a.step()
        b.step()
        check_same_step(params_a, params_b, device, t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("groups", [1, 2])
def test_matches_torch_clip_grad_norm_and_torch_adamw(device, groups):
    """The user's loop: torch's clip_grad_norm_ over all parameters (two groups: weight decay on
    and off, as HF Trainer makes them) and torch.optim.AdamW, against opt.clip_grad_norm_."""
    need_device(device)
    params_a, params_b = make_params(device), make_params(device)

    def grouped(params):
        if groups == 1:
            return [{"params": params}]
        return [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]

    ours = ft.AdamW(grouped(params_a), lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(grouped(params_b), lr=1e-2, weight_decay=0.1, foreach=False)
    for t in range(8):
        grads = grads_of(t, params_a)
        for p, q, g in zip(params_a, params_b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        norm_a = ours.clip_grad_norm_(CLIPPING)
        norm_b = torch.nn.utils.clip_grad_norm_(params_b, CLIPPING)
        torch.testing.assert_close(norm_a, norm_b, rtol=1e-6, atol=0)
        ours.step()
        ref.step()
        ours.zero_grad()
        ref.zero_grad()
    for x, y in zip(params_a, params_b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_a_second_clip_before_the_step_raises_and_zero_grad_forgets_a_clip():
    params = make_params("cpu")
    opt = ft.Adam(params, lr=1e-2)
    for p, g in zip(params, grads_of(0, params)):
        p.grad = g
    opt.clip_grad_norm_(CLIPPING)
    with pytest.raises(RuntimeError, match="twice before a step"):
        opt.clip_grad_norm_(CLIPPING)
    opt.zero_grad()
    for p, g in zip(params, grads_of(1, params)):
        p.grad = g
    before = [p.detach().clone() for p in params]
    opt.step()  # not clipped: the clip was forgotten with its gradients
    ref_params = [b.clone().requires_grad_() for b in before]
    ref = ft.Adam(ref_params, lr=1e-2)
    for p, g in zip(ref_params, grads_of(1, params)):
        p.grad = g
    ref.step()
    assert all(same_bits(x, y) for x, y in zip(params, ref_params))
    assert opt.clip_grad_norm_(CLIPPING) is not None  # nothing pending after zero_grad and the step


def test_no_gradients_give_a_zero_norm_and_nothing_pending():
    params = make_params("cpu")
    opt = ft.AdamW(params, lr=1e-2)
    assert opt.clip_grad_norm_(CLIPPING).item() == 0.0
    assert opt._pending_clip is None


@pytest.mark.parametrize("cls, dtype", [(ft.Lion, torch.float32), (ft.RMSprop, torch.float32),
                                        (ft.NAdam, torch.float32), (ft.AdamW, torch.float64)])
def test_optimizers_without_the_fused_protocol_and_float64_clip_in_place_with_torch(cls, dtype):
    """Lion, RMSprop, NAdam...: torch's clip_grad_norm_ itself (the gradients are written); and
    float64 gradients, which torch clips with a float64 coefficient (the protocol's divisor is a
    float)."""
    params = make_params("cpu", dtype)
    grads = grads_of(0, params)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt = cls(params, lr=1e-3)
    norm = opt.clip_grad_norm_(CLIPPING)
    expected_norm, expected_grads = torch_clip(grads, CLIPPING)
    torch.testing.assert_close(norm, expected_norm, rtol=0, atol=0)
    assert all(same_bits(p.grad, g) for p, g in zip(params, expected_grads))
    assert opt._pending_clip is None


def test_error_if_nonfinite_raises_as_torch():
    params = make_params("cpu")
    opt = ft.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    params[1].grad[3] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_norm_(CLIPPING, error_if_nonfinite=True)


@pytest.mark.parametrize("unscale_first", [False, True])
def test_gradscaler_loop_matches_torch_fused_with_its_clip(unscale_first):
    """fp16 GradScaler loop: torch's fused SGD with momentum (whose step scales with the
    gradient, unlike Adam's) after scaler.unscale_ and clip_grad_norm_, against fusedopt's fused
    clip with and without scaler.unscale_ (then the norm is of the scaled gradients, and the
    step divides it by the scale). The two models drift apart by rounding (fp16 activations),
    so the norms agree to 1e-3 and the parameters to 1e-4."""
    need_device("cuda")
    torch.manual_seed(0)
    model_a = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda()
    model_b = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda()
    model_b.load_state_dict(model_a.state_dict())
    ours = ft.SGD(model_a.parameters(), lr=1e-2, momentum=0.9)
    ref = torch.optim.SGD(model_b.parameters(), lr=1e-2, momentum=0.9, fused=True)
    scaler_a, scaler_b = torch.amp.GradScaler("cuda"), torch.amp.GradScaler("cuda")
    norms, clipped = {}, 0
    for t in range(20):
        x = torch.randn(32, 64, device="cuda") * (1e4 if t == 5 else 1.0)  # step 5 overflows fp16: skipped
        y = torch.randn(32, 8, device="cuda")
        for model, opt, scaler, fused in ((model_a, ours, scaler_a, True), (model_b, ref, scaler_b, False)):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            if not fused or unscale_first:
                scaler.unscale_(opt)
            scale = scaler.get_scale()
            norm = opt.clip_grad_norm_(0.5) if fused else torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            norms[fused] = norm / (1.0 if not fused or unscale_first else scale)  # the unscaled norm
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        assert scaler_a.get_scale() == scaler_b.get_scale(), t
        if torch.isfinite(norms[False]):
            torch.testing.assert_close(norms[True], norms[False], rtol=1e-3, atol=0)
            clipped += bool(norms[False] > 0.5)
    assert clipped >= 10  # the clip bound at most steps
    for x, y in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not hasattr(torch.nn.utils, "get_total_norm"), reason="torch.nn.utils.get_total_norm: torch 2.6")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_norm_is_torchs(device, dtype):
    """clip_grad_norm_'s norm against torch.nn.utils.get_total_norm: fusedopt's plan for the
    2-norm (to the order of the additions) and the inf-norm (exact), in the gradients' dtype,
    over moved gradients too (the plan is rebound); torch's function for the 1-norm, complex
    gradients and gradients of two dtypes."""
    need_device(device)
    params = make_params(device, dtype)
    opt = ft.AdamW(params, lr=1e-2)
    tol = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 1e-2}[dtype]
    for t in range(3):
        for p, g in zip(params, grads_of(t, params)):
            p.grad = g  # new tensors: new addresses
        grads = [p.grad for p in params]
        for norm_type, rtol in ((2.0, tol), (float("inf"), 0.0), (1.0, 0.0)):
            ours, for_coefficient = opt._total_norm(grads, norm_type, False, None)
            assert ours.dtype == dtype and ours.device == grads[0].device and for_coefficient.dtype == torch.float32
            torch.testing.assert_close(ours, torch.nn.utils.get_total_norm(grads, norm_type), rtol=rtol, atol=0)
    assert opt._grad_norm is not None  # the plan served
    for gs in ([g.to(torch.complex64) for g in grads], grads + [grads[0].to(torch.float16)]):
        torch.testing.assert_close(opt._total_norm(gs, 2.0, False, None)[0], torch.nn.utils.get_total_norm(gs, 2.0),
                                   rtol=0, atol=0)


def test_float16_parameters_under_gradscaler_without_unscale_stay_finite():
    """float16 parameters under GradScaler (whose unscale_ refuses float16 gradients, so the
    fused protocol is their only way): the norm of the scaled gradients overflows float16, so
    the coefficient is taken from the norm in float32; the step divides by scale / coefficient."""
    need_device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda().half()
    opt = ft.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(10):
        x, y = torch.randn(32, 64, device="cuda").half(), torch.randn(32, 8, device="cuda").half()
        scaler.scale(torch.nn.functional.mse_loss(model(x).float(), y.float())).backward()
        opt.clip_grad_norm_(0.5)
        assert opt._pending_clip[0].dtype == torch.float32
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
