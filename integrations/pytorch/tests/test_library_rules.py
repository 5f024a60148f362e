"""fusedopt_torch's classes of the library's newer rules (fusedopt_torch/library_rules.py) against
straightforward PyTorch references of the official algorithms, written here from the reference
repositories (torch.optim.Rprop itself for Rprop): 12 steps of float32 parameters of several
shapes, CPU and CUDA, every parameter and state within a few float32 roundings per step; options
switched on; a state_dict round trip continues as the uninterrupted run; a captured CUDA graph
replays as eager steps; bfloat16 parameters step; bad arguments are refused."""

import copy
import math

import pytest
import torch

import fusedopt_torch as ft

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SHAPES = [(64, 33), (7,), (3, 5, 9), (1,), (1000,)]
STEPS = 12


def make_params(device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_() for s in SHAPES]


def grads_of(params, step):
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen).to(device=p.device, dtype=p.dtype) for p in params]


def set_grads(params, step):
    """Gives `params` the gradients of `step` (grads_of) and returns them."""
    grads = grads_of(params, step)
    for p, g in zip(params, grads):
        p.grad = g
    return grads


# ---- references (plain PyTorch, one tensor at a time, as the reference repositories) ---------

class Reference:
    """A reference optimizer over detached float32 copies: step(grads) updates self.params
    (bench/library_rules.py times them with clone_grads False, as the references step p.grad)."""

    clone_grads = True

    def __init__(self, params, **options):
        self.params = [p.detach().clone() for p in params]
        self.options = options
        self.state = [dict() for _ in params]
        self.k = 0

    def step(self, grads):
        self.k += 1
        for p, g, s in zip(self.params, grads, self.state):
            self.update(p, g.clone() if self.clone_grads else g, s, self.k)

    # Where the official repository also has a multi-tensor form (torch._foreach_* over every
    # tensor), the subclass's step_foreach is it, written from that form with the same
    # operations in the same order as update(): bench/library_rules.py times it beside the
    # single-tensor loop, test_foreach_reference checks that it steps the same values.

    def foreach_grads(self, grads):
        return [g.clone() for g in grads] if self.clone_grads else list(grads)

    def foreach_states(self, make):
        """Each tensor's state dict, made by make(p, s) where it is empty; the dicts in order."""
        for p, s in zip(self.params, self.state):
            if not s:
                make(p, s)
        return self.state


class AdEMAMixReference(Reference):
    """apple/ml-ademamix, pytorch/ademamix.py."""

    def update(self, p, grad, s, step):
        o = self.options
        lr, (beta1, beta2, beta3_final), eps, lmbda = o["lr"], o["betas"], o.get("eps", 1e-8), o.get("weight_decay", 0.0)
        alpha_final, alpha_warmup, beta3_warmup = o.get("alpha", 2.0), o.get("alpha_warmup"), o.get("beta3_warmup")
        if not s:
            s["exp_avg_fast"] = torch.zeros_like(p) if beta1 != 0.0 else None
            s["exp_avg_slow"] = torch.zeros_like(p)
            s["exp_avg_sq"] = torch.zeros_like(p)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        alpha, beta3 = alpha_final, beta3_final
        if alpha_warmup is not None and step < alpha_warmup:
            a = step / float(alpha_warmup)
            alpha = a * alpha_final
        if beta3_warmup is not None and step < beta3_warmup:
            f = lambda beta, eps=1e-8: math.log(0.5) / math.log(beta + eps) - 1  # noqa: E731
            a = step / float(beta3_warmup)
            beta3 = math.pow(0.5, 1 / ((1.0 - a) * f(beta1) + a * f(beta3_final) + 1))
        if beta1 != 0.0:
            s["exp_avg_fast"].mul_(beta1).add_(grad, alpha=1 - beta1)
            fast = s["exp_avg_fast"]
        else:
            fast = grad
        s["exp_avg_slow"].mul_(beta3).add_(grad, alpha=1 - beta3)
        s["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (s["exp_avg_sq"].sqrt() / math.sqrt(bias_correction2)).add_(eps)
        update = (fast.div(bias_correction1) + alpha * s["exp_avg_slow"]) / denom
        update.add_(p, alpha=lmbda)
        p.add_(-lr * update)

    def states(self, i):
        s = self.state[i]
        return {"exp_avg": s["exp_avg_fast"], "exp_avg_slow": s["exp_avg_slow"], "exp_avg_sq": s["exp_avg_sq"]}


class AdanReference(Reference):
    """sail-sg/Adan, adan.py (_single_tensor_adan, max_grad_norm = 0)."""

    def update(self, p, grad, s, step):
        o = self.options
        lr, (beta1, beta2, beta3), eps = o["lr"], o.get("betas", (0.98, 0.92, 0.99)), o.get("eps", 1e-8)
        wd, no_prox = o.get("weight_decay", 0.0), o.get("no_prox", False)
        if not s:
            s.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), exp_avg_diff=torch.zeros_like(p))
        if "neg_pre_grad" not in s or step == 1:
            s["neg_pre_grad"] = grad.clone().mul_(-1.0)
        bias_correction1 = 1.0 - beta1 ** step
        bias_correction2 = 1.0 - beta2 ** step
        bias_correction3_sqrt = math.sqrt(1.0 - beta3 ** step)
        neg = s["neg_pre_grad"]
        neg.add_(grad)
        s["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
        s["exp_avg_diff"].mul_(beta2).add_(neg, alpha=1 - beta2)
        neg.mul_(beta2).add_(grad)
        s["exp_avg_sq"].mul_(beta3).addcmul_(neg, neg, value=1 - beta3)
        denom = (s["exp_avg_sq"].sqrt() / bias_correction3_sqrt).add_(eps)
        step_size_diff = lr * beta2 / bias_correction2
        step_size = lr / bias_correction1
        if no_prox:
            p.mul_(1 - lr * wd)
            p.addcdiv_(s["exp_avg"], denom, value=-step_size)
            p.addcdiv_(s["exp_avg_diff"], denom, value=-step_size_diff)
        else:
            p.addcdiv_(s["exp_avg"], denom, value=-step_size)
            p.addcdiv_(s["exp_avg_diff"], denom, value=-step_size_diff)
            p.div_(1 + lr * wd)
        neg.zero_().add_(grad, alpha=-1.0)

    def step_foreach(self, grads):
        """sail-sg/Adan, adan.py (_multi_tensor_adan, max_grad_norm = 0)."""
        self.k += 1
        step, o, grads = self.k, self.options, self.foreach_grads(grads)
        lr, (beta1, beta2, beta3), eps = o["lr"], o.get("betas", (0.98, 0.92, 0.99)), o.get("eps", 1e-8)
        wd, no_prox = o.get("weight_decay", 0.0), o.get("no_prox", False)
        states = self.foreach_states(lambda p, s: s.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                                                           exp_avg_diff=torch.zeros_like(p)))
        for s, g in zip(states, grads):
            if "neg_pre_grad" not in s or step == 1:
                s["neg_pre_grad"] = g.clone().mul_(-1.0)
        params = self.params
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        diffs, neg = [s["exp_avg_diff"] for s in states], [s["neg_pre_grad"] for s in states]
        bias_correction1 = 1.0 - beta1 ** step
        bias_correction2 = 1.0 - beta2 ** step
        bias_correction3_sqrt = math.sqrt(1.0 - beta3 ** step)
        torch._foreach_add_(neg, grads)
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(diffs, beta2)
        torch._foreach_add_(diffs, neg, alpha=1 - beta2)
        torch._foreach_mul_(neg, beta2)
        torch._foreach_add_(neg, grads)
        torch._foreach_mul_(exp_avg_sqs, beta3)
        torch._foreach_addcmul_(exp_avg_sqs, neg, neg, value=1 - beta3)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction3_sqrt)
        torch._foreach_add_(denom, eps)
        step_size_diff = lr * beta2 / bias_correction2
        step_size = lr / bias_correction1
        if no_prox:
            torch._foreach_mul_(params, 1 - lr * wd)
        torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)
        torch._foreach_addcdiv_(params, diffs, denom, value=-step_size_diff)
        if not no_prox:
            torch._foreach_div_(params, 1 + lr * wd)
        torch._foreach_zero_(neg)
        torch._foreach_add_(neg, grads, alpha=-1.0)

    def states(self, i):
        return dict(self.state[i])


class ADOPTReference(Reference):
    """iShohei220/adopt, adopt.py (_single_tensor_adopt; its step counter starts at 0)."""

    def update(self, p, grad, s, step):
        o = self.options
        lr, (beta1, beta2), eps = o["lr"], o.get("betas", (0.9, 0.9999)), o.get("eps", 1e-6)
        wd, decouple = o.get("weight_decay", 0.0), o.get("decouple", False)
        clip_lambda = o.get("clip_lambda", lambda t: t ** 0.25)
        if not s:
            s.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        t = step - 1
        if wd != 0 and not decouple:
            grad = grad.add(p, alpha=wd)
        if t == 0:
            s["exp_avg_sq"].addcmul_(grad, grad)
            return
        if wd != 0 and decouple:
            p.add_(p, alpha=-lr * wd)
        denom = torch.clamp(s["exp_avg_sq"].sqrt(), eps)
        normed = grad.div(denom)
        if clip_lambda is not None:
            clip = clip_lambda(t)
            normed.clamp_(-clip, clip)
        s["exp_avg"].lerp_(normed, 1 - beta1)
        p.add_(s["exp_avg"], alpha=-lr)
        s["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

    def step_foreach(self, grads):
        """iShohei220/adopt, adopt.py (_multi_tensor_adopt of the version with clip_lambda)."""
        self.k += 1
        o, grads, params = self.options, self.foreach_grads(grads), self.params
        lr, (beta1, beta2), eps = o["lr"], o.get("betas", (0.9, 0.9999)), o.get("eps", 1e-6)
        wd, decouple = o.get("weight_decay", 0.0), o.get("decouple", False)
        clip_lambda = o.get("clip_lambda", lambda t: t ** 0.25)
        states = self.foreach_states(lambda p, s: s.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)))
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        t = self.k - 1
        if wd != 0 and not decouple:
            grads = torch._foreach_add(grads, params, alpha=wd)
        if t == 0:
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads)
            return
        if wd != 0 and decouple:
            torch._foreach_add_(params, params, alpha=-lr * wd)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_clamp_min_(denom, eps)
        normed = torch._foreach_div(grads, denom)
        if clip_lambda is not None:
            clip = clip_lambda(t)
            torch._foreach_clamp_min_(normed, -clip)
            torch._foreach_clamp_max_(normed, clip)
        torch._foreach_lerp_(exp_avgs, normed, 1 - beta1)
        torch._foreach_add_(params, exp_avgs, alpha=-lr)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)

    def states(self, i):
        return dict(self.state[i])


class StableAdamWReference(Reference):
    """optimi, stableadamw.py (_single_stableadamw, no Kahan summation)."""

    def update(self, p, grad, s, step):
        o = self.options
        lr, (beta1, beta2), eps, wd = o["lr"], o.get("betas", (0.9, 0.99)), o.get("eps", 1e-6), o.get("weight_decay", 1e-2)
        decouple_lr, max_lr = o.get("decouple_lr", False), o.get("max_lr")
        if not s:
            s.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        beta1_comp = 1 - ((beta1 - beta1 ** step) / (1 - beta1 ** step))
        beta2_hat = (beta2 - beta2 ** step) / (1 - beta2 ** step)
        s["exp_avg"].lerp_(grad, weight=beta1_comp)
        s["exp_avg_sq"].mul_(beta2_hat).addcmul_(grad, grad, value=1 - beta2_hat)
        rms = grad.pow(2).div_(s["exp_avg_sq"].clamp(min=eps ** 2)).mean().sqrt()
        lr_t = lr / rms.clamp(min=1)  # a 0-d tensor: no synchronisation per tensor
        if wd != 0:
            p.mul_(1 - (lr_t / (max_lr or lr) if decouple_lr else lr_t) * wd)
        p.sub_(lr_t * s["exp_avg"] / s["exp_avg_sq"].sqrt().add_(eps))

    def states(self, i):
        return dict(self.state[i])


def adamw_direction(options, grad, s, step):
    """torch.optim.AdamW's update before the learning rate, m_hat / (sqrt(v_hat) + eps), its
    moments in `s` (created at the first step) advanced."""
    (beta1, beta2), eps = options.get("betas", (0.9, 0.999)), options.get("eps", 1e-8)
    if not s:
        s.update(exp_avg=torch.zeros_like(grad), exp_avg_sq=torch.zeros_like(grad))
    s["exp_avg"].lerp_(grad, 1 - beta1)
    s["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    denom = (s["exp_avg_sq"].sqrt() / math.sqrt(bias_correction2)).add_(eps)
    return s["exp_avg"] / bias_correction1 / denom


class CAdamWReference(Reference):
    """C-AdamW (kyleliang919/C-Optim, c_adamw.py): torch's AdamW update masked where exp_avg
    disagrees in sign with the gradient, scaled by 1 / max(mean of the mask, 1e-3) per tensor."""

    def update(self, p, grad, s, step):
        lr, wd = self.options["lr"], self.options.get("weight_decay", 1e-2)
        update = adamw_direction(self.options, grad, s, step)
        p.mul_(1 - lr * wd)
        mask = (s["exp_avg"] * grad > 0).to(grad.dtype)
        mask = mask / mask.mean().clamp_(min=1e-3)
        p.add_(update * mask, alpha=-lr)

    def states(self, i):
        return dict(self.state[i])


class CWDAdamWReference(CAdamWReference):
    """AdamW with Cautious Weight Decay (arXiv 2510.12402, Algorithm 1 on torch's AdamW): the
    decoupled decay applied only where the update and the parameter agree in sign."""

    def update(self, p, grad, s, step):
        lr, wd = self.options["lr"], self.options.get("weight_decay", 1e-2)
        if self.options.get("maximize", False):
            grad = -grad
        update = adamw_direction(self.options, grad, s, step)
        p.copy_(torch.where(update * p >= 0, p * (1 - lr * wd), p))
        p.add_(update, alpha=-lr)


class ScheduleFreeAdamWReference(Reference):
    """facebookresearch/schedule_free, adamw_schedulefree.py (AdamWScheduleFree.step)."""

    def schedule(self):
        """This step's lr and ckp1 (the group's scalars advanced, as the reference's step does)."""
        o = self.options
        warmup_steps, r, weight_lr_power = o.get("warmup_steps", 0), o.get("r", 0.0), o.get("weight_lr_power", 2.0)
        if self.k == 0:
            self.lr_max, self.weight_sum = -1.0, 0.0
        k = self.k
        sched = (k + 1) / warmup_steps if k < warmup_steps else 1.0
        lr = o["lr"] * sched
        self.lr_max = max(lr, self.lr_max)
        weight = ((k + 1) ** r) * (self.lr_max ** weight_lr_power)
        self.weight_sum = self.weight_sum + weight
        ckp1 = weight / self.weight_sum if self.weight_sum else 0.0
        return lr, ckp1

    def step(self, grads):
        o = self.options
        (beta1, beta2), eps, decay = o.get("betas", (0.9, 0.999)), o.get("eps", 1e-8), o.get("weight_decay", 0.0)
        k = self.k
        bias_correction2 = 1 - beta2 ** (k + 1)
        lr, ckp1 = self.schedule()
        adaptive_y_lr = lr * (beta1 * (1 - ckp1) - 1)
        for y, grad, s in zip(self.params, grads, self.state):
            grad = grad.clone() if self.clone_grads else grad
            if not s:
                s.update(z=y.clone(), exp_avg_sq=torch.zeros_like(y))
            s["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = s["exp_avg_sq"].div(bias_correction2).sqrt_().add_(eps)
            grad_normalized = grad.div_(denom)
            grad_normalized.add_(y, alpha=decay)
            y.lerp_(end=s["z"], weight=ckp1)
            y.add_(grad_normalized, alpha=adaptive_y_lr)
            s["z"].sub_(grad_normalized, alpha=lr)
        self.k = k + 1

    def step_foreach(self, grads):
        """adamw_schedulefree.py's foreach branch (the reference's default)."""
        o = self.options
        (beta1, beta2), eps, decay = o.get("betas", (0.9, 0.999)), o.get("eps", 1e-8), o.get("weight_decay", 0.0)
        k, grads, y = self.k, self.foreach_grads(grads), self.params
        bias_correction2 = 1 - beta2 ** (k + 1)
        lr, ckp1 = self.schedule()
        states = self.foreach_states(lambda p, s: s.update(z=p.clone(), exp_avg_sq=torch.zeros_like(p)))
        z, exp_avg_sqs = [s["z"] for s in states], [s["exp_avg_sq"] for s in states]
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denom = torch._foreach_div(exp_avg_sqs, bias_correction2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        torch._foreach_div_(grads, denom)
        torch._foreach_add_(grads, y, alpha=decay)
        torch._foreach_lerp_(y, z, weight=ckp1)
        torch._foreach_add_(y, grads, alpha=lr * (beta1 * (1 - ckp1) - 1))
        torch._foreach_sub_(z, grads, alpha=lr)
        self.k = k + 1

    def eval(self, beta1):
        for y, s in zip(self.params, self.state):
            y.lerp_(end=s["z"], weight=1 - 1 / beta1)

    def states(self, i):
        return dict(self.state[i])


class ScheduleFreeSGDReference(ScheduleFreeAdamWReference):
    """facebookresearch/schedule_free, sgd_schedulefree.py (SGDScheduleFree.step)."""

    def step(self, grads):
        o = self.options
        momentum, wd = o.get("momentum", 0.9), o.get("weight_decay", 0.0)
        k = self.k
        lr, ckp1 = self.schedule()
        for y, grad, s in zip(self.params, grads, self.state):
            grad = grad.clone() if self.clone_grads else grad
            if not s:
                s["z"] = y.clone()
            if wd != 0:
                grad.add_(y, alpha=wd)
            y.lerp_(end=s["z"], weight=ckp1)
            y.add_(grad, alpha=lr * (momentum * (1 - ckp1) - 1))
            s["z"].sub_(grad, alpha=lr)
        self.k = k + 1

    def step_foreach(self, grads):
        """sgd_schedulefree.py's foreach branch (the reference's default)."""
        o = self.options
        momentum, wd = o.get("momentum", 0.9), o.get("weight_decay", 0.0)
        k, grads, y = self.k, self.foreach_grads(grads), self.params
        lr, ckp1 = self.schedule()
        z = [s["z"] for s in self.foreach_states(lambda p, s: s.update(z=p.clone()))]
        if wd != 0:
            torch._foreach_add_(grads, y, alpha=wd)
        torch._foreach_lerp_(y, z, weight=ckp1)
        torch._foreach_add_(y, grads, alpha=lr * (momentum * (1 - ckp1) - 1))
        torch._foreach_sub_(z, grads, alpha=lr)
        self.k = k + 1


class TorchReference(Reference):
    """A torch.optim class itself (foreach=False: its single-tensor loop)."""

    def __init__(self, params, cls, **options):
        super().__init__(params)
        for p in self.params:
            p.requires_grad_()
        self.opt = cls(self.params, foreach=False, **options)

    def step(self, grads):
        for p, g in zip(self.params, grads):
            p.grad = g.clone()
        self.opt.step()

    def states(self, i):
        return {k: v for k, v in self.opt.state[self.params[i]].items() if k not in ("step", "eta", "mu")}


# (class, reference factory, options) per case: defaults and the options switched on.
CASES = {
    "rprop": (ft.Rprop, lambda ps, **o: TorchReference(ps, torch.optim.Rprop, **o), dict(lr=1e-2)),
    "rprop_options": (ft.Rprop, lambda ps, **o: TorchReference(ps, torch.optim.Rprop, **o),
                      dict(lr=3e-3, etas=(0.3, 1.5), step_sizes=(1e-4, 0.02), maximize=True)),
    "asgd": (ft.ASGD, lambda ps, **o: TorchReference(ps, torch.optim.ASGD, **o), dict(lr=1e-2)),
    "asgd_averaging": (ft.ASGD, lambda ps, **o: TorchReference(ps, torch.optim.ASGD, **o),
                       dict(lr=1e-2, lambd=1e-2, alpha=0.5, t0=3, weight_decay=0.01, maximize=True)),
    "ademamix": (ft.AdEMAMix, AdEMAMixReference, dict(lr=1e-2, betas=(0.9, 0.999, 0.9999))),
    "ademamix_schedulers": (ft.AdEMAMix, AdEMAMixReference,
                            dict(lr=1e-2, betas=(0.9, 0.999, 0.999), alpha=5.0, alpha_warmup=8, beta3_warmup=6,
                                 weight_decay=0.1)),
    "adan": (ft.Adan, AdanReference, dict(lr=1e-2, betas=(0.98, 0.92, 0.99))),
    "adan_no_prox": (ft.Adan, AdanReference, dict(lr=1e-2, weight_decay=0.05, no_prox=True)),
    "adan_prox": (ft.Adan, AdanReference, dict(lr=1e-2, weight_decay=0.05)),
    "adopt": (ft.ADOPT, ADOPTReference, dict(lr=1e-2)),
    "adopt_decoupled": (ft.ADOPT, ADOPTReference, dict(lr=1e-2, weight_decay=0.1, decouple=True)),
    "adopt_l2_noclip": (ft.ADOPT, ADOPTReference, dict(lr=1e-2, weight_decay=0.1, clip_lambda=None)),
    "stable_adamw": (ft.StableAdamW, StableAdamWReference, dict(lr=1e-2)),
    "stable_adamw_decouple_lr": (ft.StableAdamW, StableAdamWReference,
                                 dict(lr=1e-2, weight_decay=1e-3, decouple_lr=True, max_lr=2e-2, betas=(0.8, 0.9))),
    "cadamw": (ft.CAdamW, CAdamWReference, dict(lr=1e-2)),
    "cwd_adamw": (ft.CWDAdamW, CWDAdamWReference, dict(lr=1e-2, weight_decay=0.5)),
    "cwd_adamw_maximize": (ft.CWDAdamW, CWDAdamWReference, dict(lr=1e-2, weight_decay=0.1, maximize=True)),
    "schedule_free_adamw": (ft.ScheduleFreeAdamW, ScheduleFreeAdamWReference,
                            dict(lr=1e-2, warmup_steps=5, weight_decay=0.01)),
    "schedule_free_adamw_r": (ft.ScheduleFreeAdamW, ScheduleFreeAdamWReference,
                              dict(lr=1e-2, r=0.5, weight_lr_power=1.0)),
    "schedule_free_sgd": (ft.ScheduleFreeSGD, ScheduleFreeSGDReference, dict(lr=0.1, warmup_steps=3, weight_decay=0.01)),
}


FOREACH_CASES = sorted(case for case, (_, make, _) in CASES.items() if hasattr(make, "step_foreach"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", FOREACH_CASES)
def test_foreach_reference(case, device):
    """A reference's multi-tensor form (bench/library_rules.py's foreach row) steps the
    values of its single-tensor loop: the same operations, batched."""
    _, make_reference, options = CASES[case]
    params = make_params(device)
    loop, batched = make_reference(params, **options), make_reference(params, **options)
    for step in range(STEPS):
        grads = grads_of(params, step)
        loop.step(grads)
        batched.step_foreach(grads)
    # Within roundings rather than bit for bit: the foreach kernels may contract a * b + c into
    # an FMA where the single-tensor kernels do not.
    for i, (p, q) in enumerate(zip(batched.params, loop.params)):
        assert_close_to(p, q, f"{case} param {i}", STEPS)
        for key, value in loop.states(i).items():
            assert_close_to(batched.states(i)[key], value, f"{case} state {key} of param {i}", STEPS)


def assert_close_to(actual, expected, name, steps):
    """Each step's arithmetic is a few float32 roundings of the element's magnitude; the fused
    kernel orders (and contracts) them differently from the reference's separate kernels."""
    actual = actual.detach().to(torch.float64).cpu()
    expected = expected.detach().to(torch.float64).cpu()
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{name}: {m}", rtol=4e-6 * steps, atol=4e-6 * steps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_against_reference(case, device):
    cls, make_reference, options = CASES[case]
    params = make_params(device)
    opt = cls(params, **options)
    ref = make_reference(params, **options)
    for step in range(STEPS):
        grads = grads_of(params, step)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref.step(grads)
    for i, (p, q) in enumerate(zip(params, ref.params)):
        assert_close_to(p, q, f"{case} param {i}", STEPS)
        for key, value in ref.states(i).items():
            assert_close_to(opt.state[p][key], value, f"{case} state {key} of param {i}", STEPS)
    if cls in (ft.ScheduleFreeAdamW, ft.ScheduleFreeSGD):
        beta = options.get("betas", (0.9,))[0] if cls is ft.ScheduleFreeAdamW else options.get("momentum", 0.9)
        opt.eval()
        ref.eval(beta)
        for i, (p, q) in enumerate(zip(params, ref.params)):
            assert_close_to(p, q, f"{case} x (eval) of param {i}", STEPS)
        with pytest.raises(RuntimeError, match="train"):
            opt.step()
        opt.train()
        opt.step()


@pytest.mark.parametrize("case", ["asgd_averaging", "ademamix", "adan", "adopt", "rprop", "stable_adamw", "cadamw",
                                  "cwd_adamw", "schedule_free_adamw"])
def test_state_dict_round_trip(case):
    device = DEVICES[-1]
    cls, _, options = CASES[case]
    a, b = make_params(device), make_params(device)
    oa = cls(a, **options)
    for step in range(4):
        set_grads(a, step)
        oa.step()
    saved = copy.deepcopy(oa.state_dict())
    with torch.no_grad():
        for p, q in zip(a, b):
            q.copy_(p)
    ob = cls(b, **options)
    ob.load_state_dict(saved)
    for step in range(4, 8):
        for params in (a, b):
            set_grads(params, step)
        oa.step()
        ob.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["asgd_averaging", "ademamix_schedulers", "adan_no_prox", "adopt", "rprop", "stable_adamw",
                                  "cadamw", "cwd_adamw", "schedule_free_adamw", "schedule_free_adamw_r",
                                  "schedule_free_sgd"])
def test_cuda_graph(case):
    cls, _, options = CASES[case]
    pc, pd = make_params("cuda"), make_params("cuda")
    lr = options["lr"]
    lr_c = torch.tensor(lr, device="cuda")
    c = cls(pc, **{**options, "lr": lr_c}, capturable=True)
    d = cls(pd, **{**options, "lr": lr})
    for step in range(2):
        for params in (pc, pd):
            set_grads(params, step)
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
    for k, value in enumerate((lr, lr / 2, lr * 2)):
        for p, q, g in zip(pc, pd, grads_of(pc, 10 + k)):
            p.grad.copy_(g)
            q.grad = g.clone()
        lr_c.fill_(value)
        for group in d.param_groups:
            group["lr"] = value
        graph.replay()
        d.step()
    torch.cuda.synchronize()
    for p, q in zip(pc, pd):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["ademamix", "adan", "adopt", "rprop", "stable_adamw", "cadamw", "cwd_adamw",
                                  "schedule_free_adamw", "schedule_free_sgd"])
def test_bfloat16_params(case, device):
    cls, make_reference, options = CASES[case]
    params = make_params(device, torch.bfloat16)
    ref = make_reference(make_params(device), **options)
    opt = cls(params, **options)
    for step in range(4):
        grads = set_grads(params, step)
        opt.step()
        ref.step([g.float() for g in grads])
    for p, q in zip(params, ref.params):
        assert p.dtype == torch.bfloat16 and torch.isfinite(p).all()
        torch.testing.assert_close(p.float(), q, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("device", DEVICES)
def test_asgd_state_dict_loads_into_torch(device):
    """ASGD's state_dict carries torch's eta and mu: torch.optim.ASGD continues from it, and ours
    from torch's."""
    a, b = make_params(device), make_params(device)
    options = dict(lr=1e-2, lambd=1e-2, t0=2)
    ours = ft.ASGD(a, **options)
    for step in range(4):
        set_grads(a, step)
        ours.step()
    with torch.no_grad():
        for p, q in zip(a, b):
            q.copy_(p)
    theirs = torch.optim.ASGD(b, foreach=False, **options)
    theirs.load_state_dict(ours.state_dict())
    back = ft.ASGD(make_params(device), **options)
    back.load_state_dict(theirs.state_dict())
    for step in range(4, 7):
        for params in (a, b):
            set_grads(params, step)
        ours.step()
        theirs.step()
    for p, q in zip(a, b):
        assert_close_to(p, q, "ASGD continued by torch", 7)
        assert_close_to(ours.state[p]["ax"], theirs.state[q]["ax"], "ASGD's ax continued by torch", 7)
    assert set(back.state[back.param_groups[0]["params"][0]]) == {"step", "ax"}


def test_lr_scheduler_and_groups():
    device = DEVICES[-1]
    a, b = make_params(device), make_params(device)
    oa = ft.Adan([{"params": a[:2], "lr": 1e-2}, {"params": a[2:], "lr": 5e-3, "weight_decay": 0.1}])
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=2, gamma=0.5)
    refs = [AdanReference(b[:2], lr=1e-2), AdanReference(b[2:], lr=5e-3, weight_decay=0.1)]
    for step in range(6):
        grads = set_grads(a, step)
        oa.step()
        refs[0].step(grads[:2])
        refs[1].step(grads[2:])
        sa.step()
        refs[0].options["lr"] = oa.param_groups[0]["lr"]
        refs[1].options["lr"] = oa.param_groups[1]["lr"]
    for p, q in zip(a, refs[0].params + refs[1].params):
        assert_close_to(p, q, "Adan with groups and StepLR", 6)


def test_bad_arguments():
    ps = make_params("cpu")
    with pytest.raises(ValueError, match="eta"):
        ft.Rprop(ps, etas=(1.5, 1.2))
    with pytest.raises(ValueError, match="beta"):
        ft.AdEMAMix(ps, betas=(0.9, 1.0, 0.9999))
    with pytest.raises(ValueError, match="betas"):
        ft.Adan(ps, betas=(0.9, 0.9))
    with pytest.raises(NotImplementedError, match="max_grad_norm"):
        ft.Adan(ps, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="clip_lambda"):
        ft.ADOPT(ps, clip_lambda=lambda t: t ** 0.5)
    with pytest.raises(ValueError, match="Momentum"):
        ft.ScheduleFreeSGD(ps, momentum=1.0)
    with pytest.raises(TypeError, match="unexpected"):
        ft.CAdamW(ps, amsgrad=True)
    with pytest.raises(ValueError, match="weight_decay"):
        ft.CWDAdamW(ps, weight_decay=-0.1)
    with pytest.raises(TypeError, match="unexpected"):
        ft.CWDAdamW(ps, amsgrad=True)
    with pytest.raises(NotImplementedError, match="differentiable"):
        ft.StableAdamW(ps, differentiable=True)
