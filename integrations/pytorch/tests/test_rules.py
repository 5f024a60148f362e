"""User rules (fusedopt_torch.rule) through PyTorch: a rule restating AdamW has the built-in
AdamW's bits (CPU and CUDA, float32 and bfloat16, with param groups, schedulers, state_dict,
GradScaler's fused protocol and CUDA graphs); the examples (AdEMAMix, Schedule-Free AdamW) follow
straightforward torch references of the papers' algorithms; reductions and float32 states work;
errors are refused before anything is written; importing compiles nothing."""

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusedopt_torch as ft

ROOT = Path(__file__).resolve().parents[3]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / "pytorch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


AdamWRule = example("adamw_rule").AdamWRule
# AdamW from the library's own blocks (a rule= expression): the built-in's code, so its bits on
# every device, whatever nvcc contracts into FMAs.
AdamWBlocks = ft.rule(
    "AdamWBlocks", hypers=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2),
    states=dict(exp_avg=0.0, exp_avg_sq=0.0),
    rule="[&] { fo::rules::adamw r; r.lr = lr; r.beta1 = beta1; r.beta2 = beta2; r.eps = eps; "
         "r.weight_decay = weight_decay; return r; }()")
AdEMAMix = example("ademamix").AdEMAMix
ScheduleFreeAdamW = example("schedule_free").ScheduleFreeAdamW

SHAPES = [(1000,), (64, 33), (17,), (4097,), (3, 5, 7)]


def make_params(device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_() for s in SHAPES]


def set_grads(params, step):
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device=p.device, dtype=p.dtype)


def groups(params, **second):
    return [{"params": params[:2]}, {"params": params[2:], **second}]


def same(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                                              b.view(torch.uint8) if b.dtype != torch.bool else b)


def assert_same_state(opt_a, params_a, opt_b, params_b, keys=("exp_avg", "exp_avg_sq"), bits=True):
    """The same bits (`bits`), or within a few roundings (a body restating a rule on CUDA: nvcc
    contracts multiply-adds into FMAs per kernel, so two spellings of one formula may round
    differently; the host units are compiled with -ffp-contract=off)."""
    check = same if bits else (lambda a, b: torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-7))
    for pa, pb in zip(params_a, params_b):
        assert check(pa.detach(), pb.detach())
        for k in keys:
            assert check(opt_a.state[pa][k], opt_b.state[pb][k]), k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cls", [AdamWRule, AdamWBlocks], ids=["body", "blocks"])
def test_adamw_rule_has_the_builtin_bits(cls, device, dtype):
    pa, pb = make_params(device, dtype), make_params(device, dtype)
    a = cls(groups(pa, lr=3e-3, weight_decay=0.1), lr=1e-3)
    b = ft.AdamW(groups(pb, lr=3e-3, weight_decay=0.1), lr=1e-3)
    sa, sb = torch.optim.lr_scheduler.StepLR(a, 3, 0.5), torch.optim.lr_scheduler.StepLR(b, 3, 0.5)
    for t in range(8):
        set_grads(pa, t)
        set_grads(pb, t)
        a.step()
        b.step()
        sa.step()
        sb.step()
        a.zero_grad(set_to_none=True)
        b.zero_grad(set_to_none=True)
    assert_same_state(a, pa, b, pb, bits=device == "cpu" or cls is AdamWBlocks)
    state = a.state_dict()["state"][0]
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"] and float(state["step"]) == 8


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip_continues_bit_for_bit(device):
    pa = make_params(device)
    a = AdamWRule(pa, lr=1e-2)
    for t in range(3):
        set_grads(pa, t)
        a.step()
    pb = [p.detach().clone().requires_grad_() for p in pa]
    b = AdamWRule(pb, lr=0.5)  # the loaded groups' lr wins
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for t in range(3, 6):
        set_grads(pa, t)
        set_grads(pb, t)
        a.step()
        b.step()
    assert_same_state(a, pa, b, pb)
    # torch's own AdamW takes the checkpoint too (the same state layout).
    torch.optim.AdamW(pb).load_state_dict(b.state_dict())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gradscaler_fused_protocol_and_cuda_graph():
    pa, pb = make_params("cuda"), make_params("cuda")
    a, b = AdamWRule(pa, lr=1e-2), ft.AdamW(pb, lr=1e-2)
    assert a._step_supports_amp_scaling
    scale = torch.tensor(1024.0, device="cuda")
    for t in range(4):
        set_grads(pa, t)
        set_grads(pb, t)
        for opt, ps in ((a, pa), (b, pb)):
            for p in ps:
                p.grad.mul_(scale)
            opt.grad_scale = scale
            opt.found_inf = torch.tensor(1.0 if t == 2 else 0.0, device="cuda")  # step 2 is skipped
            opt.step()
    assert_same_state(a, pa, b, pb)
    # Captured steps with a Tensor lr, replayed with new values: as eager steps with those values.
    pc, pd = make_params("cuda"), make_params("cuda")
    lr_c, lr_d = torch.tensor(1e-3, device="cuda"), torch.tensor(1e-3, device="cuda")
    c, d = AdamWRule(pc, lr=lr_c, capturable=True), AdamWRule(pd, lr=lr_d, capturable=True)
    set_grads(pc, 10)
    set_grads(pd, 10)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up steps: compile, states, plans
            c.step()
            d.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c.step()
    for k, value in enumerate((2e-3, 5e-4, 1e-3)):
        gen = torch.Generator().manual_seed(k)
        fresh = [torch.randn(p.shape, generator=gen).cuda() for p in pc]
        for p, q, f in zip(pc, pd, fresh):
            p.grad.copy_(f)
            q.grad = f.clone()
        lr_c.fill_(value)
        lr_d.fill_(value)
        graph.replay()
        d.step()
    torch.cuda.synchronize()
    assert_same_state(c, pc, d, pd)


def ademamix_reference(params, steps, lr, betas, alpha, t_alpha, t_beta3, eps, wd):
    """apple/ml-ademamix's algorithm, as the paper writes it, in torch ops."""
    b1, b2, b3 = betas
    state = [dict(m1=torch.zeros_like(p), m2=torch.zeros_like(p), nu=torch.zeros_like(p)) for p in params]
    f = lambda b: torch.log(torch.tensor(0.5, dtype=torch.float64)) / torch.log(torch.tensor(b + 1e-8, dtype=torch.float64)) - 1
    for t in range(1, steps + 1):
        set_grads(params, t)
        alpha_t = alpha * min(1.0, t / t_alpha) if t_alpha else alpha
        if t_beta3:
            a = min(1.0, t / t_beta3)
            beta3_t = float(0.5 ** (1 / ((1 - a) * f(b1) + a * f(b3) + 1)))
        else:
            beta3_t = b3
        with torch.no_grad():
            for p, s in zip(params, state):
                g = p.grad
                s["m1"].mul_(b1).add_(g, alpha=1 - b1)
                s["m2"].mul_(beta3_t).add_(g, alpha=1 - beta3_t)
                s["nu"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = s["nu"].sqrt() / (1 - b2 ** t) ** 0.5 + eps
                update = (s["m1"] / (1 - b1 ** t) + alpha_t * s["m2"]) / denom
                p.add_(update + wd * p, alpha=-lr)


@pytest.mark.parametrize("device", DEVICES)
def test_ademamix_follows_the_paper(device):
    kw = dict(lr=1e-2, alpha=5.0, alpha_warmup=10, beta3_warmup=10, eps=1e-8, weight_decay=0.01)
    pa, pb = make_params(device), make_params(device)
    opt = AdEMAMix(pa, **kw)
    for t in range(1, 21):
        set_grads(pa, t)
        opt.step()
    ademamix_reference(pb, 20, 1e-2, (0.9, 0.999, 0.9999), 5.0, 10, 10, 1e-8, 0.01)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5)


def schedule_free_reference(params, steps, lr, beta1, beta2, eps, wd, warmup, r=0.0, power=2.0):
    """facebookresearch/schedule_free's AdamWScheduleFree step, in torch ops; returns x (eval mode)."""
    z = [p.detach().clone() for p in params]
    v = [torch.zeros_like(p) for p in params]
    lr_max, weight_sum = -1.0, 0.0
    for k in range(steps):
        set_grads(params, k + 1)
        lr_t = lr * ((k + 1) / warmup if k < warmup else 1.0)
        lr_max = max(lr_t, lr_max)
        weight = (k + 1) ** r * lr_max ** power
        weight_sum += weight
        c = weight / weight_sum
        with torch.no_grad():
            for y, zz, vv in zip(params, z, v):
                g = y.grad
                vv.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                gn = g / ((vv / (1 - beta2 ** (k + 1))).sqrt() + eps) + wd * y
                y.lerp_(zz, c)
                y.add_(gn, alpha=lr_t * (beta1 * (1 - c) - 1))
                zz.sub_(gn, alpha=lr_t)
    with torch.no_grad():
        for y, zz in zip(params, z):
            y.lerp_(zz, 1 - 1 / beta1)


@pytest.mark.parametrize("device", DEVICES)
def test_schedule_free_adamw_follows_the_reference(device):
    pa, pb = make_params(device), make_params(device)
    opt = ScheduleFreeAdamW(pa, lr=1e-2, weight_decay=0.01, warmup_steps=5)
    opt.train()
    for t in range(1, 16):
        set_grads(pa, t)
        opt.step()
    opt.eval()
    schedule_free_reference(pb, 15, 1e-2, 0.9, 0.999, 1e-8, 0.01, 5)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="train"):
        opt.step()


NormalizedSGD = ft.rule(
    "NormalizedSGD", hypers=dict(lr=0.1),
    reduce=dict(grad_sq="grad * grad", largest=("max", "abs(grad)")),
    body="param -= lr * grad / sqrt(grad_sq) + T(1e-3) * largest_total;")


@pytest.mark.parametrize("device", DEVICES)
def test_reductions_per_tensor_and_over_all(device):
    pa, pb = make_params(device), make_params(device)
    opt = NormalizedSGD(pa, lr=0.1)
    for t in range(3):
        set_grads(pa, t)
        set_grads(pb, t)
        opt.step()
        largest = max(p.grad.abs().max() for p in pb)
        with torch.no_grad():
            for p in pb:
                p.sub_(0.1 * p.grad / p.grad.pow(2).sum().sqrt() + 1e-3 * largest)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


FloatMomentum = ft.rule(
    "FloatMomentum", hypers=dict(lr=0.1, beta=0.9),
    states=dict(buf=ft.State(0.0, dtype="float32")),
    body="buf = beta * buf + grad; param -= lr * buf;")


# The units the tests above compile, per device: (rule, dtype, GradScaler's kernel, CUDA only).
# prefetch_units.py compiles them in parallel before a run (one at a time here they took about
# 200 s of the GPU machine's test run).
PREFETCH = [(AdamWRule, torch.float32, False, False), (AdamWRule, torch.bfloat16, False, False),
            (AdamWBlocks, torch.float32, False, False), (AdamWBlocks, torch.bfloat16, False, False),
            (AdamWRule, torch.float32, True, True), (AdEMAMix, torch.float32, False, False),
            (ScheduleFreeAdamW, torch.float32, False, False), (NormalizedSGD, torch.float32, False, False),
            (FloatMomentum, torch.bfloat16, False, False)]


@pytest.mark.parametrize("device", DEVICES)
def test_float32_states_of_bfloat16_parameters(device):
    p = make_params(device, torch.bfloat16)
    opt = FloatMomentum(p)
    for t in range(3):
        set_grads(p, t)
        opt.step()
    assert all(opt.state[q]["buf"].dtype == torch.float32 for q in p)
    saved = copy.deepcopy(opt.state_dict())
    again = FloatMomentum([q.detach().clone().requires_grad_() for q in p])
    again.load_state_dict(saved)  # torch would cast the buffers to bfloat16: kept in float32
    assert all(s["buf"].dtype == torch.float32 for s in again.state.values())
    assert same(list(again.state.values())[0]["buf"], opt.state[p[0]]["buf"])


def test_compile_errors_quote_the_users_lines():
    Broken = ft.rule("BrokenRule", hypers=dict(lr=0.1), body="param -= lr * grad;\nparam += not_declared;\n")
    p = make_params("cpu")
    before = [q.detach().clone() for q in p]
    opt = Broken(p)
    set_grads(p, 0)
    with pytest.raises(ft.RuleCompileError, match=r"BrokenRule body, line 2") as caught:
        opt.step()
    assert "param += not_declared;" in str(caught.value)
    assert all(same(a.detach(), b) for a, b in zip(p, before))  # nothing written


def test_bad_hyperparameters_and_dtypes_are_refused_before_any_write():
    p = make_params("cpu")
    with pytest.raises(TypeError, match="unexpected hyperparameters"):
        AdamWRule(p, learning_rate=1e-3)
    with pytest.raises(TypeError, match="must be a float"):
        AdamWRule(p, lr="fast")
    opt = AdamWRule(p)
    before = [q.detach().clone() for q in p]
    opt.param_groups[0]["beta1"] = "0.9"
    set_grads(p, 0)
    with pytest.raises(TypeError, match="beta1"):
        opt.step()
    assert all(same(a.detach(), b) for a, b in zip(p, before))
    FloatOnly = ft.rule("FloatOnly", hypers=dict(lr=0.1), body="param -= lr * grad;", dtypes=("float32",))
    q = make_params("cpu", torch.float64)
    set_grads(q, 0)
    with pytest.raises(TypeError, match="float32"):
        FloatOnly(q).step()
    with pytest.raises(ValueError, match="not allowed"):
        ft.rule("Bad", hypers=dict(grad=1.0), body="")


def test_import_compiles_nothing(tmp_path):
    env = dict(os.environ, FUSEDOPT_TORCH_CACHE=str(tmp_path), FUSEDOPT_TORCH_PREBUILT="0")
    code = "import fusedopt_torch, torch; fusedopt_torch.AdamW([torch.zeros(3, requires_grad=True)])"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.iterdir()) == [] and "compiling" not in done.stderr
