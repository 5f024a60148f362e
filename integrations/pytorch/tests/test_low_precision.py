"""Low-precision parameters (issue 16 item 3): Adam/AdamW(kahan=True) keeps a compensation state
of the parameter's dtype and tracks the fp32 trajectory far closer than plain bfloat16;
stochastic_rounding=True is unbiased where round-to-nearest loses every update; both are
refused for parameters they do not apply to; the compensation travels in state_dict().
master_weights=True (issue 46) steps a float32 master with float32 moments: its bits are those
of the same optimizer's float32 step, and the parameter is the master rounded to nearest."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fusedopt_torch as ft  # noqa: E402
from test_parity import DEVICES, need_device  # noqa: E402


def weights(device, dtype, n=20000, seed=0):
    g = torch.Generator().manual_seed(seed)
    # bfloat16 values: the fp32 yardstick starts where the bf16 runs start
    return (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).to(device=device, dtype=dtype)


def train(opt_of, device, dtype, steps=100, seed=3):
    """Trains one tensor with the same gradients (drawn in bf16, so every run sees the same ones):
    the fp32 copy's trajectory is the yardstick."""
    p = torch.nn.Parameter(weights(device, dtype))
    opt = opt_of([p])
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        p.grad = (torch.randn(p.numel(), generator=g) * 0.1).to(torch.bfloat16).to(device=device, dtype=dtype)
        opt.step()
    return p, opt


def distance(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


KW = dict(lr=1e-4, weight_decay=0.1)  # updates of ~1e-4 on weights of ~0.02: below a bf16 ulp there


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [ft.Adam, ft.AdamW], ids=["Adam", "AdamW"])
def test_kahan_tracks_fp32_far_closer_than_plain_bf16(cls, device):
    need_device(device)
    reference, _ = train(lambda ps: cls(ps, **KW), device, torch.float32)
    plain, _ = train(lambda ps: cls(ps, **KW), device, torch.bfloat16)
    kahan, opt = train(lambda ps: cls(ps, kahan=True, **KW), device, torch.bfloat16)
    d_plain, d_kahan = distance(plain, reference), distance(kahan, reference)
    print(f"LOW_PRECISION {cls.__name__} {device} kahan {d_kahan:.2e} plain bf16 {d_plain:.2e}")
    assert d_kahan < 0.25 * d_plain
    assert d_kahan < 5e-3  # about one bfloat16 rounding of the weights
    comp = opt.state[kahan]["kahan_comp"]
    assert comp.dtype == torch.bfloat16 and comp.shape == kahan.shape and comp.abs().max() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_moves_bf16_where_nearest_rounding_cannot(device):
    """A constant gradient: AdamW moves every weight by about lr a step. Weights in [2^-6, 2^-5)
    have a bfloat16 ulp of 2^-13 (1.2e-4), so steps of lr = 2e-5 round back to the weight with
    round-to-nearest, and move it by an ulp with probability ~0.16 with stochastic rounding."""
    need_device(device)
    n, steps, lr = 20000, 100, 2e-5
    g = torch.Generator().manual_seed(4)
    start = (torch.rand(n, generator=g) * 0.0147 + 0.0157).to(device)

    def run(dtype, **kw):
        p = torch.nn.Parameter(start.to(dtype).clone())
        opt = ft.AdamW([p], lr=lr, weight_decay=0.0, **kw)
        for _ in range(steps):
            p.grad = torch.full_like(p, 0.1)
            opt.step()
        return (p.detach().double() - start.to(dtype).double()).mean().item(), p

    fp32, _ = run(torch.float32)
    plain, _ = run(torch.bfloat16)
    sr, p_sr = run(torch.bfloat16, stochastic_rounding=True)
    _, p_again = run(torch.bfloat16, stochastic_rounding=True)
    print(f"LOW_PRECISION AdamW SR {device}: mean move over {steps} steps fp32 {fp32:.3e}, "
          f"bf16 nearest {plain:.3e}, bf16 stochastic {sr:.3e}")
    assert torch.equal(p_sr, p_again)  # the same bits for the same steps (seeded by step, tensor, element)
    assert abs(plain) < 0.01 * abs(fp32)  # nearest rounding loses every update
    assert abs(sr - fp32) < 0.05 * abs(fp32)  # stochastic rounding is unbiased: 20000 weights average it


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("option", ["kahan", "master_weights"])
def test_low_precision_state_dict_round_trip(option, device):
    need_device(device)
    p1 = torch.nn.Parameter(weights(device, torch.bfloat16, n=300))
    p2 = torch.nn.Parameter(p1.detach().clone())

    def make(p):
        return ft.AdamW([p], **{option: True}, **KW)

    o1, o2 = make(p1), make(p2)
    g = torch.Generator().manual_seed(9)
    grads = [(torch.randn(300, generator=g) * 0.1).to(device=device, dtype=torch.bfloat16) for _ in range(10)]
    for t in range(5):
        p1.grad, p2.grad = grads[t].clone(), grads[t].clone()
        o1.step()
        o2.step()
    saved = o2.state_dict()
    assert saved["param_groups"][0][option] is True
    float_keys = ("exp_avg", "exp_avg_sq", "master")
    if option == "kahan":
        assert saved["state"][0]["kahan_comp"].dtype == torch.bfloat16
    else:
        assert all(saved["state"][0][k].dtype == torch.float32 for k in float_keys)
        # The updates (~1e-4 on weights of ~0.02) are below a bf16 ulp: only the master holds them.
        assert not torch.equal(saved["state"][0]["master"], p2.detach().float())
    o3 = make(p2)
    o3.load_state_dict(saved)
    if option == "master_weights":  # torch would cast the states to bfloat16: they stay float32
        assert all(o3.state[p2][k].dtype == torch.float32 for k in float_keys)
    for t in range(5, 10):
        p1.grad, p2.grad = grads[t].clone(), grads[t].clone()
        o1.step()
        o3.step()
    assert torch.equal(p1, p2)
    for k, v in o1.state[p1].items():
        if k != "step":  # (the engine keeps the counts until state_dict() asks)
            assert torch.equal(v, o3.state[p2][k]), k
    # torch's AdamW takes the state dict too (it ignores the extra state entry and the options).
    plain = torch.nn.Parameter(p2.detach().clone())
    torch_opt = torch.optim.AdamW([plain], **KW)
    torch_opt.load_state_dict(saved)
    plain.grad = grads[0].clone()
    torch_opt.step()


def test_low_precision_options_refused_where_they_do_not_apply():
    with pytest.raises(ValueError, match="choose one"):
        ft.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], kahan=True, stochastic_rounding=True)
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="kahan=True is for bfloat16 or float16 parameters"):
        ft.AdamW([p], kahan=True).step()
    half = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    half.grad = torch.ones(3, dtype=torch.float16)
    with pytest.raises(ValueError, match="stochastic_rounding=True is for bfloat16 parameters"):
        ft.AdamW([half], stochastic_rounding=True).step()
    assert torch.equal(p, before) and torch.equal(half, torch.zeros(3, dtype=torch.float16))
    # Without the options a group stays torch's (no extra keys in state_dict()).
    assert "kahan" not in ft.AdamW([torch.nn.Parameter(torch.zeros(3))]).state_dict()["param_groups"][0]


def _same_step_in_float32(cls, device, dtype, amsgrad, steps=6, n=3000, scale=None):
    """cls(master_weights=True) over `dtype` parameters beside cls over float32 copies of them,
    with the same gradients (`dtype` values): (master run, float32 run) after `steps` steps.
    `scale`: GradScaler's fused protocol with that grad_scale (the float32 run gets the
    gradients divided by it)."""
    g = torch.Generator().manual_seed(11)
    shapes = [(n,), (7, 33), (1,), (64, 64)]
    low = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.05).to(device=device, dtype=dtype)) for s in shapes]
    full = [torch.nn.Parameter(p.detach().float()) for p in low]
    kw = dict(lr=3e-3, weight_decay=0.1, amsgrad=amsgrad)
    o_low, o_full = cls(low, master_weights=True, **kw), cls(full, **kw)
    for t in range(steps):
        for a, b in zip(low, full):
            grad = (torch.randn(a.shape, generator=g) * 0.1).to(device=device, dtype=dtype)
            a.grad = grad
            b.grad = grad.float() if scale is None else grad.float() / scale
        if scale is not None:
            o_low.grad_scale = torch.tensor(scale, device=device)
            o_low.found_inf = torch.tensor(0.0, device=device)
        o_low.step()
        o_full.step()
    return (low, o_low), (full, o_full)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
@pytest.mark.parametrize("cls", [ft.Adam, ft.AdamW], ids=["Adam", "AdamW"])
def test_master_weights_step_the_float32_master(cls, amsgrad, dtype, device):
    need_device(device)
    (low, o_low), (full, o_full) = _same_step_in_float32(cls, device, dtype, amsgrad)
    keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    for a, b in zip(low, full):
        state = o_low.state[a]
        assert state["master"].dtype == torch.float32 and all(state[k].dtype == torch.float32 for k in keys)
        assert torch.equal(a.detach(), state["master"].to(dtype)), "the parameter is the master rounded to nearest"
        assert o_low.state[a]["step"].item() == o_full.state[b]["step"].item()
        pairs = [(state["master"], b.detach())] + [(state[k], o_full.state[b][k]) for k in keys]
        if device == "cpu":
            # The host units do not contract a * b + c: the same float arithmetic, the same bits.
            assert all(torch.equal(x, y) for x, y in pairs), "the master's step is the float32 step, bit for bit"
        else:
            # Two CUDA kernels of one rule may contract a * b + c differently (nvcc's -fmad=true:
            # docs/cuda.md): the last bits of a step can differ.
            for x, y in pairs:
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
def test_master_weights_under_grad_scaler_protocol(device):
    """float16 parameters with a float32 master under GradScaler's fused protocol (apex's
    FusedAdam(master_weights=True) use): the gradients divided by grad_scale, a step with
    found_inf set changes nothing."""
    need_device(device)
    (low, o_low), (full, _) = _same_step_in_float32(ft.AdamW, device, torch.float16, False, steps=3, scale=1024.0)
    for a, b in zip(low, full):
        torch.testing.assert_close(o_low.state[a]["master"], b.detach(), rtol=1e-6 if device != "cpu" else 0, atol=0)
    before = [(a.detach().clone(), {k: v.clone() for k, v in o_low.state[a].items()}) for a in low]
    for a in low:
        a.grad = torch.full_like(a, float("inf"))
    o_low.grad_scale = torch.tensor(1024.0, device=device)
    o_low.found_inf = torch.tensor(1.0, device=device)
    o_low.step()
    for a, (p_before, s_before) in zip(low, before):
        assert torch.equal(a.detach(), p_before)
        for k in ("exp_avg", "exp_avg_sq", "master"):
            assert torch.equal(o_low.state[a][k], s_before[k]), k


def test_master_weights_refused_where_they_do_not_apply():
    bf16 = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    for other in ("kahan", "stochastic_rounding"):
        with pytest.raises(ValueError, match="choose one"):
            ft.AdamW([bf16], master_weights=True, **{other: True})
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="master_weights=True is for bfloat16 or float16 parameters"):
        ft.AdamW([p], master_weights=True).step()
    assert torch.equal(p, torch.zeros(3)) and not ft.AdamW([p]).state
    assert "master_weights" not in ft.AdamW([p]).state_dict()["param_groups"][0]


def _mixed_params(device, seed=5):
    """bfloat16 matrices (their group with master_weights) and float32 vectors (a group without)."""
    g = torch.Generator().manual_seed(seed)
    low = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.05).to(device=device, dtype=torch.bfloat16))
           for s in ((40, 24), (24, 8), (300,))]
    full = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.05).to(device)) for s in ((24,), (8,))]
    return low, full


def _backward(low, full, k):
    """loss = sum(p * c) with gradients c (bf16 values for every parameter)."""
    g = torch.Generator().manual_seed(50 + k)
    loss = 0
    for p in low + full:
        c = (torch.randn(p.shape, generator=g) * 0.1).to(torch.bfloat16).float().to(p.device)
        loss = loss + (p.float() * c).sum()
    loss.backward()


def _mixed_optimizer(low, full):
    return ft.AdamW([{"params": low, "master_weights": True}, {"params": full, "lr": 1e-3}], lr=3e-3, weight_decay=0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_master_weights_in_one_group_of_two(device):
    """A group of bf16 parameters with master_weights beside a float32 group: the masters and the
    float32 parameters follow AdamW over float32 copies (CPU: bit for bit)."""
    need_device(device)
    low, full = _mixed_params(device)
    ref = [torch.nn.Parameter(p.detach().float()) for p in low + full]
    opt = _mixed_optimizer(low, full)
    opt_ref = ft.AdamW([{"params": ref[:3]}, {"params": ref[3:], "lr": 1e-3}], lr=3e-3, weight_decay=0.1)
    for k in range(5):
        for o, (a, b) in ((opt, (low, full)), (opt_ref, (ref[:3], ref[3:]))):
            _backward(a, b, k)
            o.step()
            o.zero_grad(set_to_none=True)
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in low)
    assert "master" not in opt.state[full[0]] and opt.state[full[0]]["exp_avg"].dtype == torch.float32
    for p in low:
        assert torch.equal(p.detach(), opt.state[p]["master"].to(torch.bfloat16))
    for m, r in zip([opt.state[p]["master"] for p in low] + [p.detach() for p in full], ref):
        if device == "cpu":
            assert torch.equal(m, r.detach())
        else:
            torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
def test_master_weights_inside_backward(device):
    """The same optimizer stepped inside backward (step_in_backward, several buckets) gives the
    ordinary loop's bits, masters and moments included."""
    need_device(device)
    if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        pytest.skip("step_in_backward needs torch >= 2.1 (post-accumulate-grad hooks)")
    (low_a, full_a), (low_b, full_b) = _mixed_params(device), _mixed_params(device)
    opt_a, opt_b = _mixed_optimizer(low_a, full_a), _mixed_optimizer(low_b, full_b)
    stepper = ft.step_in_backward(opt_b, bucket_bytes=1024)
    try:
        for k in range(5):
            _backward(low_a, full_a, k)
            opt_a.step()
            opt_a.zero_grad(set_to_none=True)
            _backward(low_b, full_b, k)
            assert all(p.grad is None for p in low_b + full_b), "a gradient was not freed"
        assert stepper.buckets > 1
        for a, b in zip(low_a + full_a, low_b + full_b):
            assert torch.equal(a, b)
        # Through state_dict(): it refreshes the 'step' entries, which steps leave as they were.
        state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
        assert state_a.keys() == state_b.keys()
        for index, state in state_a.items():
            assert state.keys() == state_b[index].keys()
            for key, value in state.items():
                assert torch.equal(value, state_b[index][key]), (index, key)
    finally:
        stepper.remove()


@pytest.mark.parametrize("device", DEVICES)
def test_master_weights_with_the_fused_clip(device):
    """opt.clip_grad_norm_ fused into a master_weights step: the masters follow AdamW over float32
    copies clipped the same way (the norm taken over the same gradient values)."""
    need_device(device)
    g = torch.Generator().manual_seed(21)
    low = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.05).to(device=device, dtype=torch.bfloat16))
           for s in ((40, 24), (300,))]
    full = [torch.nn.Parameter(p.detach().float()) for p in low]
    o_low, o_full = ft.AdamW(low, master_weights=True, lr=1e-2), ft.AdamW(full, lr=1e-2)
    for _ in range(4):
        for a, b in zip(low, full):
            a.grad = (torch.randn(a.shape, generator=g) * 3).to(device=device, dtype=torch.bfloat16)
            b.grad = a.grad.float()
        o_low.clip_grad_norm_(1.0)  # norms of about 100: every step clipped
        o_full.clip_grad_norm_(1.0)
        o_low.step()
        o_full.step()
    for a, b in zip(low, full):
        if device == "cpu":
            assert torch.equal(o_low.state[a]["master"], b.detach())
        else:
            torch.testing.assert_close(o_low.state[a]["master"], b.detach(), rtol=1e-6, atol=1e-9)
        assert torch.equal(a.detach(), o_low.state[a]["master"].to(torch.bfloat16))
