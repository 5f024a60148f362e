"""fusedopt_torch against torch.optim (and Python references of LAMB and Lion).

Runs under pytest, or as a plain script (`python3 tests/test_parity.py`) where pytest is not
installed. CUDA cases skip cleanly without a GPU (or without the extension's CUDA kernels); the
same cases run on CPU tensors through fusedopt's host backend.

Figures: every parity case prints a line `PARITY <case> <device> <dtype> max_rel=<x>` (run
pytest with -s to see them); `FUSEDOPT_TORCH_PARITY_JSON=path` also writes them as JSON.

Relative difference, per tensor: max over its elements of |fusedopt - reference| divided by
max over its elements of |reference| (parameters start at magnitudes U(0.1, 1)); the figure is
the worst tensor. Elementwise ratios are not used: an element that crosses zero makes any
one-ulp difference of a step arbitrarily large relative to itself.
"""

import atexit
import copy
import inspect
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fusedopt_torch as ft  # noqa: E402

try:
    if os.environ.get("FUSEDOPT_TORCH_NO_PYTEST") == "1":
        raise ImportError("plain-script mode requested")
    import pytest

    parametrize = pytest.mark.parametrize

    def skip(reason):
        pytest.skip(reason)
except ImportError:  # plain-script mode
    pytest = None

    class Skipped(Exception):
        pass

    def skip(reason):
        raise Skipped(reason)

    def parametrize(names, values):
        def mark(f):
            f._all_cases = [(names, list(values))] + getattr(f, "_all_cases", [])
            return f

        return mark


HAS_CUDA = torch.cuda.is_available() and ft.with_cuda()
DEVICES = ["cpu", "cuda"]
STEPS = int(os.environ.get("FUSEDOPT_TORCH_STEPS", "100"))
FP32_TOL = 1e-5
# Low precision: states in the parameter dtype as torch keeps them; fusedopt rounds once per
# stored value, torch.optim (foreach=False) after every operation, so the two trajectories
# drift apart by a few units of the format over 100 steps. Measured worst cases are printed.
# See low_precision_check: LOW_TOL bounds the distance to the emulated trajectory.
LOW_TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
FIGURES = []


def _write_figures():
    path = os.environ.get("FUSEDOPT_TORCH_PARITY_JSON")
    if path and FIGURES:
        with open(path, "w") as f:
            json.dump(FIGURES, f, indent=1)


atexit.register(_write_figures)


def need_device(device):
    if device == "cuda" and not HAS_CUDA:
        skip("no CUDA device (or fusedopt_torch built without CUDA)")


def record(case, device, dtype, value, tol):
    name = str(dtype).replace("torch.", "")
    print(f"PARITY {case} {device} {name} max_rel={value:.3e} tol={tol:.0e}", flush=True)
    FIGURES.append(dict(case=case, device=device, dtype=name, max_rel=value, tol=tol))


def max_rel(a, b):
    worst = 0.0
    for x, y in zip(a, b):
        x, y = x.detach().double(), y.detach().double()
        d = ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
        worst = max(worst, d)
    return worst


def max_rel_global(a, b):
    """max |a - b| over every element of every tensor / max |b| over all of them."""
    num = max((x.detach().double() - y.detach().double()).abs().max().item() for x, y in zip(a, b))
    den = max(y.detach().double().abs().max().item() for y in b)
    return num / max(den, 1e-30)


def linear_closure(opt, weight, bias, inp):
    """torch's test_optim closure: zero the gradients, the squared output of a linear layer,
    backward; returns the loss."""

    def closure():
        opt.zero_grad()
        loss = (weight.mv(inp) + bias).pow(2).sum()
        loss.backward()
        return loss

    return closure


SIZES = [1, 7, 64, 1000, 4099]


def make_params(device, dtype=torch.float32, seed=0, sizes=SIZES):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        x = torch.rand(n, generator=g) * 0.9 + 0.1
        x = torch.where(torch.rand(n, generator=g) < 0.5, -x, x)
        out.append(x.to(device=device, dtype=dtype))
    return out


def grads_for(step, params, seed=1):
    g = torch.Generator().manual_seed(seed * 100003 + step)
    return [(torch.randn(p.numel(), generator=g) * 0.1).to(device=p.device, dtype=p.dtype).view_as(p) for p in params]


def accepts(cls, kwargs):
    sig = inspect.signature(cls.__init__).parameters
    return all(k in sig for k in kwargs)


def run_pair(make_ref, make_ours, device, dtype, steps=STEPS, sizes=SIZES, ref_dtype=None):
    """Same params and grads into both optimizers for `steps` steps; returns (ref params, ours)."""
    base = make_params(device, dtype, sizes=sizes)
    a = [torch.nn.Parameter(p.clone().to(ref_dtype or dtype)) for p in base]
    b = [torch.nn.Parameter(p.clone()) for p in base]
    ref, ours = make_ref(a), make_ours(b)
    for t in range(steps):
        gs = grads_for(t, b)
        for x, y, g in zip(a, b, gs):
            x.grad = g.clone().to(x.dtype)
            y.grad = g.clone()
        ref.step()
        ours.step()
    return a, b, ref, ours


# (name, torch class name, fusedopt class, kwargs)
CASES = [
    ("sgd", "SGD", ft.SGD, dict(lr=1e-2)),
    ("sgd_momentum", "SGD", ft.SGD, dict(lr=1e-2, momentum=0.9)),
    ("sgd_dampening_wd", "SGD", ft.SGD, dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-2)),
    ("sgd_nesterov_maximize", "SGD", ft.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, maximize=True)),
    ("adam", "Adam", ft.Adam, dict(lr=1e-3)),
    ("adam_wd_amsgrad", "Adam", ft.Adam, dict(lr=1e-2, weight_decay=1e-2, amsgrad=True)),
    ("adam_maximize", "Adam", ft.Adam, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, maximize=True)),
    ("adamw", "AdamW", ft.AdamW, dict(lr=1e-3)),
    ("adamw_amsgrad", "AdamW", ft.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    ("adagrad", "Adagrad", ft.Adagrad, dict(lr=1e-2)),
    ("adagrad_options", "Adagrad", ft.Adagrad,
     dict(lr=1e-2, lr_decay=1e-3, weight_decay=1e-2, initial_accumulator_value=0.1)),
    ("rmsprop", "RMSprop", ft.RMSprop, dict(lr=1e-3)),
    ("rmsprop_momentum", "RMSprop", ft.RMSprop, dict(lr=1e-3, momentum=0.9)),
    ("rmsprop_centered", "RMSprop", ft.RMSprop, dict(lr=1e-3, centered=True)),
    ("rmsprop_all", "RMSprop", ft.RMSprop, dict(lr=1e-3, momentum=0.9, centered=True, weight_decay=1e-2, alpha=0.9)),
    ("radam", "RAdam", ft.RAdam, dict(lr=1e-3)),
    ("radam_wd", "RAdam", ft.RAdam, dict(lr=1e-3, weight_decay=1e-2)),
    ("radam_decoupled", "RAdam", ft.RAdam, dict(lr=1e-3, weight_decay=1e-2, decoupled_weight_decay=True)),
    ("adamax", "Adamax", ft.Adamax, dict(lr=2e-3)),
    ("adamax_wd", "Adamax", ft.Adamax, dict(lr=2e-3, weight_decay=1e-2)),
    ("adadelta", "Adadelta", ft.Adadelta, dict()),
    ("adadelta_options", "Adadelta", ft.Adadelta, dict(lr=0.5, rho=0.95, weight_decay=1e-2)),
    ("nadam", "NAdam", ft.NAdam, dict(lr=2e-3)),
    ("nadam_options", "NAdam", ft.NAdam, dict(lr=2e-3, betas=(0.8, 0.99), weight_decay=1e-2, momentum_decay=6e-3)),
    ("nadam_decoupled", "NAdam", ft.NAdam, dict(lr=2e-3, weight_decay=1e-1, decoupled_weight_decay=True)),
    ("nadam_maximize", "NAdam", ft.NAdam, dict(lr=2e-3, weight_decay=1e-2, maximize=True)),
    ("adam_decoupled", "Adam", ft.Adam, dict(lr=1e-3, weight_decay=1e-1, decoupled_weight_decay=True)),
]


class RefNAdam(torch.optim.Optimizer):
    """torch 2.11's NAdam (_single_tensor_nadam, non-capturable), for torch < 2.0 whose NAdam has a
    bug fixed since (1.13 multiplies mu_t twice into mu_product_next) and lacks options."""

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, momentum_decay=4e-3,
                 decoupled_weight_decay=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      momentum_decay=momentum_decay, decoupled_weight_decay=decoupled_weight_decay,
                                      maximize=maximize, foreach=foreach, capturable=capturable,
                                      differentiable=differentiable))

    @torch.no_grad()
    def step(self, closure=None):
        dt = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, psi, eps = group["lr"], group["weight_decay"], group["momentum_decay"], group["eps"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad if not group["maximize"] else -param.grad
                state = self.state[param]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=dt)
                    state["mu_product"] = torch.tensor(1.0, dtype=dt)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq, mu_product = state["exp_avg"], state["exp_avg_sq"], state["mu_product"]
                if torch.is_complex(param):
                    param, grad = torch.view_as_real(param), torch.view_as_real(grad)
                    exp_avg, exp_avg_sq = torch.view_as_real(exp_avg), torch.view_as_real(exp_avg_sq)
                state["step"] += 1
                step = state["step"].item()
                bias_correction2 = 1 - beta2 ** step
                if wd != 0:
                    if group["decoupled_weight_decay"]:
                        param.mul_(1 - lr * wd)
                    else:
                        grad = grad.add(param, alpha=wd)
                mu = beta1 * (1.0 - 0.5 * (0.96 ** (step * psi)))
                mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * psi)))
                mu_product *= mu
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = exp_avg_sq.div(bias_correction2).sqrt()
                mu_product_next = mu_product.item() * mu_next
                denom.add_(eps)
                param.addcdiv_(grad, denom, value=(-lr * (1.0 - mu) / (1.0 - mu_product.item())))
                param.addcdiv_(exp_avg, denom, value=(-lr * mu_next) / (1.0 - mu_product_next))


def reference_class(name):
    """torch.optim's class, or the reference of torch 2.11's where the local torch's differs."""
    if name == "NAdam" and int(torch.__version__.split(".")[0]) < 2:
        return RefNAdam
    return getattr(torch.optim, name)


def torch_class(name, kwargs):
    cls = reference_class(name)
    extra = {k: v for k, v in kwargs.items()}
    if not accepts(cls, extra):
        skip(f"torch {torch.__version__}'s {name} lacks an option of {sorted(extra)}")
    if accepts(cls, {"foreach": None}):
        extra["foreach"] = False
    return cls, extra


@parametrize("device", DEVICES)
@parametrize("case", CASES)
def test_parity_fp32(case, device):
    need_device(device)
    name, tname, ours, kwargs = case
    cls, ref_kwargs = torch_class(tname, kwargs)
    a, b, _, _ = run_pair(lambda p: cls(p, **ref_kwargs), lambda p: ours(p, **kwargs), device, torch.float32)
    d = max_rel(b, a)
    record(name, device, torch.float32, d, FP32_TOL)
    assert d <= FP32_TOL, f"{name}: max relative difference {d:.3e} > {FP32_TOL}"


LOW_CASES = [c for c in CASES if c[0] in ("sgd_momentum", "adam", "adamw_amsgrad", "adagrad", "rmsprop_all", "radam",
                                          "adamax", "adadelta", "nadam")]


def state_tensors(opt):
    """Every floating state tensor of a torch optimizer or of a reference class below."""
    if isinstance(opt, torch.optim.Optimizer):
        for st in opt.state.values():
            for k, v in st.items():
                if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point():
                    yield v
    else:
        for name in ("m", "v"):
            yield from getattr(opt, name, [])


def low_precision_check(name, make_ref, make_ours, device, dtype, steps=STEPS):
    """fp16/bf16 params and states in the parameter dtype (torch's layout).

    Two references: (1) the *emulated* trajectory: the reference optimizer in fp32, with params
    and states rounded to the low precision after every step: the semantics of fusedopt and of
    torch's fused kernels (compute in float, store rounded); fusedopt must stay within
    LOW_TOL of it. (2) The distance of fusedopt to the pure fp32 trajectory is printed next to
    that of the reference run in the low precision itself (torch.optim foreach=False rounds after
    every operation) and must stay within 5x of it (or 2 LOW_TOL); skipped where torch cannot
    run the dtype.
    """
    base = make_params(device, dtype)
    exact = [torch.nn.Parameter(p.float().clone()) for p in base]
    emul = [torch.nn.Parameter(p.float().clone()) for p in base]
    low = [torch.nn.Parameter(p.clone()) for p in base]
    ours = [torch.nn.Parameter(p.clone()) for p in base]
    o_exact, o_emul, o_ours, o_low = make_ref(exact), make_ref(emul), make_ours(ours), make_ref(low)
    low_ok = True
    with torch.no_grad():
        for t in range(steps):
            gs = grads_for(t, ours)
            for x, e, y, z, g in zip(exact, emul, low, ours, gs):
                x.grad, e.grad, y.grad, z.grad = g.float(), g.float(), g.clone(), g.clone()
            o_exact.step()
            o_emul.step()
            for v in list(emul) + list(state_tensors(o_emul)):
                v.copy_(v.to(dtype).float())
            o_ours.step()
            if low_ok:
                try:
                    o_low.step()
                except RuntimeError as e:  # e.g. torch 1.13 has no fp16 CPU kernel for some ops
                    print(f"  ({name}: the reference cannot run in {dtype} on {device}: {str(e)[:80]})")
                    low_ok = False
    # Normalised over all tensors: a one-element tensor crossing zero is no measure of a format.
    e_emul = max_rel_global(ours, emul)
    e_ours = max_rel_global(ours, exact)
    e_low = max_rel_global(low, exact) if low_ok else float("nan")
    # Storage rounding (fusedopt, torch fused) and per-operation rounding (torch.optim in the
    # dtype) are different random walks: either can end nearer the fp32 trajectory (RMSprop
    # centered fp16: 5.8e-3 against 1.3e-3). Hence only a guard against gross errors here; the
    # emulated trajectory above is the check of the semantics.
    bound = max(5.0 * e_low, 2.0 * LOW_TOL[dtype]) if low_ok else float("inf")
    record(name, device, dtype, e_emul, LOW_TOL[dtype])
    short = str(dtype).replace("torch.", "")
    print(f"  {name} {device} {short}: vs emulated {e_emul:.2e}; distance to fp32: fusedopt {e_ours:.2e}, "
          f"reference in {short} {e_low:.2e}", flush=True)
    FIGURES[-1].update(to_fp32=e_ours, reference_low_to_fp32=e_low)
    assert e_emul <= LOW_TOL[dtype], f"{name} {dtype}: {e_emul:.3e} from the emulated trajectory"
    assert e_ours <= bound, f"{name} {dtype}: {e_ours:.3e} from the fp32 trajectory, bound {bound:.3e}"


@parametrize("device", DEVICES)
@parametrize("dtype", [torch.float16, torch.bfloat16])
@parametrize("case", LOW_CASES)
def test_parity_low_precision(case, dtype, device):
    need_device(device)
    name, tname, ours, kwargs = case
    cls, ref_kwargs = torch_class(tname, kwargs)
    low_precision_check(name, lambda p: cls(p, **ref_kwargs), lambda p: ours(p, **kwargs), device, dtype)


@parametrize("dtype", [torch.float16, torch.bfloat16])
@parametrize("tname", ["Adam", "AdamW", "SGD", "Adagrad"])
def test_parity_low_precision_vs_torch_fused(tname, dtype):
    """On the GPU torch's fused kernels compute in float like fusedopt: a closer reference."""
    need_device("cuda")
    cls = getattr(torch.optim, tname)
    if not accepts(cls, {"fused": True}):
        skip(f"torch {torch.__version__}'s {tname} has no fused=True")
    kwargs = dict(lr=1e-2, momentum=0.9) if tname == "SGD" else dict(lr=1e-2)
    ours = getattr(ft, tname)
    try:
        a, b, _, _ = run_pair(lambda p: cls(p, fused=True, **kwargs), lambda p: ours(p, **kwargs), "cuda", dtype)
    except RuntimeError as e:
        skip(f"torch fused {tname} in {dtype}: {e}")
    d = max_rel(b, a)
    record(f"{tname.lower()}_vs_fused", "cuda", dtype, d, LOW_TOL[dtype])
    assert d <= LOW_TOL[dtype]


# ---- LAMB and Lion against Python references of the published algorithms ---------------------


class RefLAMB:
    """apex FusedLAMB's algorithm (global-norm clip with torch's coefficient), fp32 torch ops."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False):
        self.params = list(params)
        self.__dict__.update(lr=lr, bc=bias_correction, b1=betas[0], b2=betas[1], eps=eps, wd=weight_decay,
                             adam_w_mode=adam_w_mode, grad_averaging=grad_averaging, max_grad_norm=max_grad_norm,
                             use_nvlamb=use_nvlamb)
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        grads = [p.grad for p in self.params]
        if self.max_grad_norm and self.max_grad_norm > 0:
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
            coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
            grads = [g * coef for g in grads]
        b3 = 1 - self.b1 if self.grad_averaging else 1.0
        bc1 = 1 - self.b1 ** self.t if self.bc else 1.0
        bc2 = 1 - self.b2 ** self.t if self.bc else 1.0
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            if not self.adam_w_mode and self.wd != 0:
                g = g + self.wd * p
            m.mul_(self.b1).add_(g, alpha=b3)
            v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            u = (m / bc1) / ((v / bc2).sqrt() + self.eps)
            if self.adam_w_mode and self.wd != 0:
                u = u + self.wd * p
            pn, un = p.double().norm().item(), u.double().norm().item()
            ratio = pn / un if (pn > 0 and un > 0 and (self.use_nvlamb or self.wd != 0)) else 1.0
            p.add_(u, alpha=-self.lr * ratio)


class RefLion:
    """lion-pytorch's update (Chen et al. 2023, Algorithm 2)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        self.params = list(params)
        self.lr, self.b1, self.b2, self.wd = lr, betas[0], betas[1], weight_decay
        self.m = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.m):
            p.mul_(1 - self.lr * self.wd)
            update = (m * self.b1).add(p.grad, alpha=1 - self.b1).sign_()
            p.add_(update, alpha=-self.lr)
            m.mul_(self.b2).add_(p.grad, alpha=1 - self.b2)


REF_CASES = [
    ("lamb", RefLAMB, ft.LAMB, dict(lr=1e-3)),
    ("lamb_no_clip", RefLAMB, ft.LAMB, dict(lr=1e-3, max_grad_norm=0.0)),
    ("lamb_l2_nvlamb", RefLAMB, ft.LAMB, dict(lr=1e-3, adam_w_mode=False, use_nvlamb=True, max_grad_norm=0.0)),
    ("lamb_no_wd", RefLAMB, ft.LAMB, dict(lr=1e-3, weight_decay=0.0, grad_averaging=False)),
    ("lion", RefLion, ft.Lion, dict(lr=1e-4)),
    ("lion_wd", RefLion, ft.Lion, dict(lr=3e-4, betas=(0.95, 0.98), weight_decay=0.1)),
]


@parametrize("device", DEVICES)
@parametrize("case", REF_CASES)
def test_parity_reference(case, device):
    need_device(device)
    name, ref, ours, kwargs = case
    a, b, _, _ = run_pair(lambda p: ref(p, **kwargs), lambda p: ours(p, **kwargs), device, torch.float32)
    d = max_rel(b, a)
    record(name, device, torch.float32, d, FP32_TOL)
    assert d <= FP32_TOL, f"{name}: max relative difference {d:.3e} > {FP32_TOL}"


@parametrize("device", DEVICES)
@parametrize("dtype", [torch.float16, torch.bfloat16])
@parametrize("case", [REF_CASES[0], REF_CASES[4]])
def test_lamb_lion_low_precision(case, dtype, device):
    need_device(device)
    name, ref, ours, kwargs = case
    low_precision_check(name, lambda p: ref(p, **kwargs), lambda p: ours(p, **kwargs), device, dtype)


# ---- state dicts, groups, schedulers, training, rebuilds, errors ------------------------------

SD_CASES = [c for c in CASES if c[0] in ("sgd_momentum", "adam_wd_amsgrad", "adamw", "adagrad_options", "rmsprop_all",
                                         "radam", "adamax", "adadelta", "nadam_options")]


@parametrize("device", DEVICES)
@parametrize("direction", ["torch_to_fusedopt", "fusedopt_to_torch"])
@parametrize("case", SD_CASES)
def test_state_dict_round_trip(case, direction, device):
    """10 steps in one library, state_dict into the other, 10 more steps: same as 20 steps in one."""
    need_device(device)
    name, tname, ours_cls, kwargs = case
    cls, ref_kwargs = torch_class(tname, kwargs)
    make_torch = lambda p: cls(p, **ref_kwargs)  # noqa: E731
    make_ours = lambda p: ours_cls(p, **kwargs)  # noqa: E731
    first, second = (make_torch, make_ours) if direction == "torch_to_fusedopt" else (make_ours, make_torch)
    base = make_params(device)
    straight = [torch.nn.Parameter(p.clone()) for p in base]
    switched = [torch.nn.Parameter(p.clone()) for p in base]
    opt_straight = first(straight)
    opt_a = first(switched)
    for t in range(20):
        if t == 10:
            sd = copy.deepcopy(opt_a.state_dict())
            opt_a = second(switched)
            opt_a.load_state_dict(sd)
        for x, y, g in zip(straight, switched, grads_for(t, straight)):
            x.grad, y.grad = g.clone(), g.clone()
        opt_straight.step()
        opt_a.step()
    d = max_rel(switched, straight)
    record(f"state_dict_{direction}_{name}", device, torch.float32, d, FP32_TOL)
    assert d <= FP32_TOL
    # The layout is torch's: same keys per parameter.
    ref_sd = opt_straight.state_dict() if direction == "fusedopt_to_torch" else opt_a.state_dict()
    other = opt_a.state_dict() if direction == "fusedopt_to_torch" else opt_straight.state_dict()
    for k in ref_sd["state"]:
        assert set(ref_sd["state"][k]) == set(other["state"][k]), (ref_sd["state"][k].keys(), other["state"][k].keys())


def test_state_dict_step_entries():
    params = [torch.nn.Parameter(p) for p in make_params("cpu")]
    opt = ft.Adam(params)
    for t in range(3):
        for p, g in zip(params, grads_for(t, params)):
            p.grad = g
        opt.step()
    sd = opt.state_dict()
    ref = torch.optim.Adam([torch.nn.Parameter(p.detach().clone()) for p in params])
    for i in range(len(params)):
        assert float(sd["state"][i]["step"]) == 3.0
        assert isinstance(sd["state"][i]["step"], torch.Tensor)
        assert set(sd["state"][i]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(sd["param_groups"][0]) >= {"lr", "betas", "eps", "weight_decay", "amsgrad", "params"}
    assert ref.defaults["lr"] == opt.defaults["lr"]


@parametrize("device", DEVICES)
def test_param_groups(device):
    need_device(device)
    base = make_params(device)
    a = [torch.nn.Parameter(p.clone()) for p in base]
    b = [torch.nn.Parameter(p.clone()) for p in base]

    def groups(ps):
        return [dict(params=ps[:2], lr=1e-2, weight_decay=0.1), dict(params=ps[2:4]), dict(params=ps[4:], lr=3e-3,
                                                                                              amsgrad=True)]

    ref = torch.optim.AdamW(groups(a), lr=1e-3, weight_decay=1e-2)
    ours = ft.AdamW(groups(b), lr=1e-3, weight_decay=1e-2)
    for t in range(STEPS):
        for x, y, g in zip(a, b, grads_for(t, a)):
            x.grad, y.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    d = max_rel(b, a)
    record("param_groups_adamw", device, torch.float32, d, FP32_TOL)
    assert d <= FP32_TOL
    assert ours._engine.plans() == 3


@parametrize("device", DEVICES)
def test_scheduler_changes_lr_every_step(device):
    need_device(device)
    base = make_params(device)
    a = [torch.nn.Parameter(p.clone()) for p in base]
    b = [torch.nn.Parameter(p.clone()) for p in base]
    ref, ours = torch.optim.Adam(a, lr=1e-2), ft.Adam(b, lr=1e-2)
    sa = torch.optim.lr_scheduler.LambdaLR(ref, lambda t: 1.0 / (1 + t))
    sb = torch.optim.lr_scheduler.LambdaLR(ours, lambda t: 1.0 / (1 + t))
    for p in b:
        p.grad = torch.zeros_like(p)
    for t in range(30):
        for x, y, g in zip(a, b, grads_for(t, a)):
            x.grad = g.clone()
            y.grad.copy_(g)
        ref.step()
        ours.step()
        sa.step()
        sb.step()
    d = max_rel(b, a)
    assert d <= FP32_TOL
    assert ours.plan_rebuilds() == 1  # lr changes never rebuild


@parametrize("device", DEVICES)
def test_training_loop_matches_torch(device):
    """An MLP on a synthetic regression task: the same loss curve as torch.optim.AdamW.

    Both runs start from the same weights and see the same data; their per-step rounding
    differs in the last bits (fusedopt computes bias corrections in double, torch in float),
    and a training loop amplifies such differences slowly, so the check is tight for the first
    steps and looser over the whole curve.
    """
    need_device(device)
    torch.manual_seed(0)
    x = torch.randn(2048, 16, device=device)
    w_true = torch.randn(16, 1, device=device) / 4
    y = torch.sin(x @ w_true) + 0.1 * torch.randn(2048, 1, device=device)

    def model():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(device)

    curves = {}
    for label, make in (("torch", lambda p: torch.optim.AdamW(p, lr=1e-2)), ("fusedopt", lambda p: ft.AdamW(p, lr=1e-2))):
        net = model()
        opt = make(net.parameters())
        losses = []
        for _ in range(200):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[label] = losses
    t, f = curves["torch"], curves["fusedopt"]
    rel = [abs(a - b) / abs(a) for a, b in zip(t, f)]
    print(f"TRAINING {device} loss {t[0]:.4f} -> {t[-1]:.6f} (torch) / {f[-1]:.6f} (fusedopt); relative loss "
          f"difference: first 20 steps {max(rel[:20]):.1e}, whole curve {max(rel):.1e}, last step {rel[-1]:.1e}",
          flush=True)
    assert t[-1] < 0.2 * t[0]
    assert max(rel[:20]) <= 1e-5
    assert max(rel) <= 1e-2 and rel[-1] <= 1e-3


@parametrize("device", DEVICES)
def test_param_set_change_rebuilds(device):
    """A parameter without gradient is skipped (as torch does) and the plan is rebuilt."""
    need_device(device)
    base = make_params(device)
    a = [torch.nn.Parameter(p.clone()) for p in base]
    b = [torch.nn.Parameter(p.clone()) for p in base]
    ref, ours = torch.optim.Adam(a, lr=1e-2), ft.Adam(b, lr=1e-2)
    # Gradients written into the same tensors step after step, as autograd does when it
    # accumulates into existing .grad tensors: only a change of the set rebuilds.
    held = [torch.zeros_like(p) for p in b]
    for t in range(12):
        gs = grads_for(t, a)
        for i, (x, y, g) in enumerate(zip(a, b, gs)):
            skipped = (4 <= t < 8 and i == 1) or (t < 2 and i == 3)
            x.grad = None if skipped else g.clone()
            y.grad = None if skipped else held[i].copy_(g)
        ref.step()
        ours.step()
    d = max_rel(b, a)
    assert d <= FP32_TOL, d
    # built at t=0 (param 3 without grad), t=2 (param 3 joins), t=4, t=8: 4 plan builds.
    assert ours.plan_rebuilds() == 4, ours.plan_rebuilds()
    sd = ours.state_dict()
    assert [float(sd["state"][i]["step"]) for i in range(5)] == [12.0, 8.0, 12.0, 10.0, 12.0]
    # New gradient tensors (other addresses): the plans follow them (a rebind), no rebuild.
    rebinds = ours.plan_rebinds()
    for p in b:
        p.grad = torch.zeros_like(p)
    ours.step()
    ours.step()
    assert ours.plan_rebuilds() == 4
    assert ours.plan_rebinds() == rebinds + 1


@parametrize("device", DEVICES)
@parametrize("name", ["Adam", "AdamW", "SGD", "LAMB"])
def test_set_to_none_gives_the_same_bits_and_never_rebuilds(name, device):
    """zero_grad(set_to_none=True): new gradient tensors every step. Same bits as gradients
    written into the same tensors; the plans are rebound, never rebuilt."""
    need_device(device)
    base = make_params(device)
    kwargs = {"SGD": dict(lr=0.1, momentum=0.9)}.get(name, dict(lr=1e-2))
    held_params = [torch.nn.Parameter(p.clone()) for p in base]
    none_params = [torch.nn.Parameter(p.clone()) for p in base]
    held, none = getattr(ft, name)(held_params, **kwargs), getattr(ft, name)(none_params, **kwargs)
    buffers = [torch.zeros_like(p) for p in held_params]
    spare = []  # keeps old gradients alive, so that new ones cannot reuse their addresses
    for t in range(8):
        gs = grads_for(t, held_params)
        for p, buf, g in zip(held_params, buffers, gs):
            p.grad = buf.copy_(g)
        none.zero_grad(set_to_none=True)
        for p, g in zip(none_params, gs):
            p.grad = g.clone()
        spare.append([p.grad for p in none_params])
        held.step()
        none.step()
        for x, y in zip(held_params, none_params):
            assert torch.equal(x, y), (name, device, t)
    assert held.plan_rebuilds() == 1 and held.plan_rebinds() == 0
    assert none.plan_rebuilds() == 1, none.plan_rebuilds()
    assert none.plan_rebinds() == 7, none.plan_rebinds()


def test_gradient_of_other_strides_after_a_rebind():
    """A new gradient tensor of other strides, after the plans were bound to dense gradients,
    is stepped as torch steps it (through a dense copy), with nothing half-updated."""
    params = [torch.nn.Parameter(torch.rand(3, 5)), torch.nn.Parameter(torch.rand(4, 6))]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = ft.Adam(params), torch.optim.Adam(refs)
    for p, r in zip(params, refs):
        p.grad = torch.ones_like(p)
        r.grad = torch.ones_like(r)
    opt.step()
    ref.step()
    params[0].grad = torch.ones_like(params[0])  # a new tensor, as set_to_none gives
    params[1].grad = torch.full((6, 4), 0.5).t()  # the same shape, transposed strides
    refs[1].grad = torch.full((4, 6), 0.5)
    opt.step()
    ref.step()
    assert max_rel(params, refs) <= FP32_TOL
    assert float(opt.state_dict()["state"][1]["step"]) == 2.0


def test_zero_grad():
    params = [torch.nn.Parameter(p) for p in make_params("cpu")]
    opt = ft.SGD(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.zero_grad()
    assert all(p.grad is None or not p.grad.any() for p in params)


@parametrize("bad", [
    (ft.Adam, dict(lr=-1.0)), (ft.Adam, dict(betas=(1.0, 0.999))), (ft.Adam, dict(betas=(0.9, -0.1))),
    (ft.Adam, dict(eps=-1e-8)), (ft.AdamW, dict(weight_decay=-0.1)), (ft.SGD, dict(lr=-0.1)),
    (ft.SGD, dict(momentum=-0.5)), (ft.SGD, dict(nesterov=True)), (ft.Adagrad, dict(lr_decay=-1.0)),
    (ft.Adagrad, dict(initial_accumulator_value=-1.0)), (ft.RMSprop, dict(alpha=-0.1)),
    (ft.RMSprop, dict(momentum=-0.1)), (ft.Adadelta, dict(rho=1.5)), (ft.RAdam, dict(betas=(0.9, 1.0))),
    (ft.Adamax, dict(eps=-1.0)), (ft.LAMB, dict(lr=-1.0)), (ft.Lion, dict(lr=0.0)), (ft.Lion, dict(betas=(1.5, 0.9))),
])
def test_bad_arguments_raise_value_error(bad):
    cls, kwargs = bad
    params = [torch.nn.Parameter(torch.zeros(3))]
    raised = False
    try:
        cls(params, **kwargs)
    except ValueError:
        raised = True
    assert raised, f"{cls.__name__}({kwargs}) did not raise ValueError"
    ref = getattr(torch.optim, cls.__name__, None)
    if ref is not None and accepts(ref, kwargs):
        try:
            ref(params, **kwargs)
            raise AssertionError(f"torch.optim.{cls.__name__}({kwargs}) accepts what fusedopt rejects")
        except ValueError:
            pass


def test_bad_value_set_after_construction_raises_before_writing():
    p = torch.nn.Parameter(torch.ones(5))
    opt = ft.Adam([p], lr=1e-3)
    p.grad = torch.ones(5)
    opt.param_groups[0]["lr"] = -1.0
    raised = False
    try:
        opt.step()
    except ValueError:
        raised = True
    assert raised
    assert torch.equal(p.detach(), torch.ones(5))


def test_sparse_gradients_rejected():
    p = torch.nn.Parameter(torch.ones(5))
    opt = ft.Adam([p])
    p.grad = torch.ones(5).to_sparse()
    raised = False
    try:
        opt.step()
    except RuntimeError:
        raised = True
    assert raised


@parametrize("device", DEVICES)
def test_mixed_dtypes_in_one_group(device):
    need_device(device)
    base = make_params(device)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.float64]
    b = [torch.nn.Parameter(p.clone().to(dt)) for p, dt in zip(base, dtypes)]
    single = [torch.nn.Parameter(p.clone().to(dt)) for p, dt in zip(base, dtypes)]
    ours = ft.AdamW(b, lr=1e-2)
    alone = [ft.AdamW([p], lr=1e-2) for p in single]
    for t in range(5):
        for x, y, g in zip(b, single, grads_for(t, b)):
            x.grad, y.grad = g.clone(), g.clone()
        ours.step()
        for o in alone:
            o.step()
    for x, y in zip(b, single):
        assert torch.equal(x, y)
    assert ours._engine.plans() == 4


def test_cuda_uses_current_stream_and_no_extra_memory():
    need_device("cuda")
    params = [torch.nn.Parameter(p) for p in make_params("cuda", sizes=[1 << 20] * 4)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = ft.Adam(params)
    opt.step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base == 0
    assert float(opt.state_dict()["state"][0]["step"]) == 4.0


def _run_as_script():
    """pytest's job where pytest is missing: every test function over every parametrized case."""
    failures, passed, skipped = 0, 0, 0
    for name, f in [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)]:
        combos = [{}]
        for names, values in getattr(f, "_all_cases", []):
            combos = [dict(c, **{names: v}) for c in combos for v in values]
        for c in combos:
            label = name + ("[" + ",".join(f"{k}={_short(v)}" for k, v in c.items()) + "]" if c else "")
            try:
                f(**c)
                passed += 1
            except Skipped as e:  # noqa: F821 - defined in script mode
                skipped += 1
                print(f"SKIP {label}: {e}")
            except Exception as e:  # noqa: BLE001
                failures += 1
                print(f"FAIL {label}: {type(e).__name__}: {e}")
    print(f"{passed} passed, {skipped} skipped, {failures} failed")
    return 1 if failures else 0


def _short(v):
    if isinstance(v, tuple):
        return v[0] if isinstance(v[0], str) else getattr(v[0], "__name__", str(v[0]))
    return str(v).replace("torch.", "")


if __name__ == "__main__":
    if pytest is not None:
        sys.exit(pytest.main([__file__, "-q", "-s"] + sys.argv[1:]))
    sys.exit(_run_as_script())
