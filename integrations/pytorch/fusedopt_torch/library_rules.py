"""The optimizers people train with beyond torch.optim's list, as fused fusedopt_torch classes:
each is the library's rule (include/fusedopt/rules/) stepped through ``fusedopt_torch.rule`` with
a ``rule=`` expression, so it compiles on demand like any user rule, runs as one fused kernel
over every parameter of a group (CUDA, or the host backend for CPU tensors) and has the
built-ins' conventions: param groups, state_dict, LR schedulers, capturable CUDA graphs,
GradScaler's fused protocol, float16/bfloat16 parameters.

    opt = fusedopt_torch.AdEMAMix(model.parameters(), lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0)

The groups hold each hyperparameter by its own name: ``betas=(b1, b2)`` becomes ``beta1`` and
``beta2`` (the classes take torch's tuples; schedulers that change ``lr`` work unchanged).
The formulas, references and parity of each rule: docs/optimizers.md and docs/rules.md.
"""

import torch

from .rules import rule

__all__ = ["Rprop", "ASGD", "AdEMAMix", "AdEMAMix8bit", "Adan", "ADOPT", "StableAdamW", "CAdamW", "CWDAdamW", "ScheduleFreeAdamW",
           "ScheduleFreeSGD"]


def _library_rule(name, cpp_type, hypers, states, elementwise, wrap=None, overrides=None, eight_bit=False):
    """A rule class running `cpp_type` (a fusedopt::rules type with one member per hyperparameter,
    of the same name, set to the hyperparameter or to the C++ expression `overrides` gives); `wrap`
    turns that rule `r` into another expression (a modifier), which may name any hyperparameter."""
    overrides = overrides or {}
    if set(overrides) - set(hypers):
        raise ValueError(f"{name}: overrides of unknown hyperparameters {sorted(set(overrides) - set(hypers))}")
    assignments = "".join(f"r.{h} = {overrides.get(h, h)}; " for h in hypers)
    made = wrap.format(r="r") if wrap else "r"
    expression = f"[&] {{ {cpp_type} r; {assignments}return {made}; }}()"
    return rule(name, hypers=hypers, states=states, rule=expression, elementwise=elementwise, eight_bit=eight_bit)


def _pair(value, what, n=2):
    value = tuple(value)
    if len(value) != n:
        raise ValueError(f"{what} must have {n} values, not {len(value)}")
    return value


def _betas(betas, n=2):
    """`betas` as n floats in [0, 1), with torch's message for one out of range."""
    betas = _pair(betas, "betas", n)
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    return tuple(float(b) for b in betas)


def _check(cls, lr, kwargs, capturable=False):
    """torch's checks of lr, and the references' implementation switches: foreach is accepted and
    means nothing here (the step is one fused kernel); differentiable=True is refused; any other
    name is an error."""
    foreach = kwargs.pop("foreach", None)
    if kwargs.pop("differentiable", False):
        raise NotImplementedError(f"{cls}: differentiable=True is not supported (the step is a fused kernel)")
    if kwargs:
        raise TypeError(f"{cls}() got unexpected keyword arguments {sorted(kwargs)}")
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


_RpropRule = _library_rule(
    "_RpropRule", "fo::rules::rprop",
    hypers=dict(lr=1e-2, etaminus=0.5, etaplus=1.2, step_size_min=1e-6, step_size_max=50.0, maximize=False),
    states=dict(prev=0.0, step_size=0.0), elementwise=True)


class Rprop(_RpropRule):
    """torch.optim.Rprop's arguments and state (prev, step_size). Element for element as torch's
    ``_single_tensor_rprop`` for float32 and float64 parameters (the sign of grad * prev as
    rounded: an underflowed product keeps the step size); float16/bfloat16 parameters are
    computed in float (torch computes them in their own type)."""

    def __init__(self, params, lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50), *, capturable=False, maximize=False,
                 fused=None, **kwargs):
        _check("Rprop", lr, kwargs, capturable)
        etaminus, etaplus = _pair(etas, "etas")
        if not 0.0 < etaminus < 1.0 < etaplus:
            raise ValueError(f"Invalid eta values: {etaminus}, {etaplus}")
        lo, hi = _pair(step_sizes, "step_sizes")
        super().__init__(params, lr=lr, etaminus=float(etaminus), etaplus=float(etaplus), step_size_min=float(lo),
                         step_size_max=float(hi), maximize=bool(maximize), capturable=capturable, fused=fused)


_ASGDRule = _library_rule(
    "_ASGDRule", "fo::rules::asgd",
    hypers=dict(lr=1e-2, lambd=1e-4, alpha=0.75, t0=1e6, weight_decay=0.0, maximize=False, double_scalars=False),
    states=dict(ax=0.0), elementwise=True)


class ASGD(_ASGDRule):
    """torch.optim.ASGD's arguments and semantics (``_single_tensor_asgd``: eta and mu are functions
    of the step, formed per step in the kernel's preparation in torch's float32 rounding, or
    float64 under a float64 default dtype). The state holds ``ax`` (the average); ``state_dict()``
    adds torch's per-parameter ``eta`` and ``mu``, so that torch.optim.ASGD loads it."""

    def __init__(self, params, lr=1e-2, lambd=1e-4, alpha=0.75, t0=1e6, weight_decay=0.0, *, maximize=False,
                 capturable=False, fused=None, **kwargs):
        _check("ASGD", lr, kwargs, capturable)
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, lr=lr, lambd=float(lambd), alpha=float(alpha), t0=float(t0),
                         weight_decay=float(weight_decay), maximize=bool(maximize),
                         double_scalars=torch.get_default_dtype() == torch.float64, capturable=capturable,
                         fused=fused)

    def state_dict(self):
        saved = super().state_dict()
        for group, saved_group in zip(self.param_groups, saved["param_groups"]):
            lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
            dtype = torch.float64 if group["double_scalars"] else torch.float32
            for p, index in zip(group["params"], saved_group["params"]):
                entry = saved["state"].get(index)
                if not entry or "step" not in entry:
                    continue
                step = float(entry["step"])
                device = p.device if group["capturable"] else "cpu"
                entry["eta"] = torch.as_tensor(lr / ((1 + group["lambd"] * lr * step) ** group["alpha"]), dtype=dtype,
                                               device=device)
                entry["mu"] = torch.as_tensor(1 / max(1, step - group["t0"]), dtype=dtype, device=device)
        return saved

    def load_state_dict(self, state_dict):
        # eta and mu follow from the step: torch's entries are dropped, not kept beside ours.
        state_dict = dict(state_dict, state={i: {k: v for k, v in s.items() if k not in ("eta", "mu")}
                                             for i, s in state_dict["state"].items()})
        return super().load_state_dict(state_dict)


_ADEMAMIX = dict(
    hypers=dict(lr=1e-3, beta1=0.9, beta2=0.999, beta3=0.9999, alpha=2.0, beta3_warmup=0, alpha_warmup=0, eps=1e-8,
                weight_decay=0.0, maximize=False),
    states=dict(exp_avg=0.0, exp_avg_slow=0.0, exp_avg_sq=0.0), elementwise=True)
_AdEMAMixRule = _library_rule("_AdEMAMixRule", "fo::rules::ademamix", **_ADEMAMIX)
_AdEMAMix8bitRule = _library_rule("_AdEMAMix8bitRule", "fo::rules::ademamix", eight_bit=True, **_ADEMAMIX)


def _ademamix_hypers(lr, betas, alpha, beta3_warmup, alpha_warmup, weight_decay, eps, maximize):
    """AdEMAMix's constructor arguments checked, as the rule's hyperparameters."""
    b1, b2, b3 = _betas(betas, 3)
    if not 0.0 <= alpha:
        raise ValueError(f"Invalid alpha value: {alpha}")
    return dict(lr=lr, beta1=b1, beta2=b2, beta3=b3, alpha=float(alpha), beta3_warmup=int(beta3_warmup or 0),
                alpha_warmup=int(alpha_warmup or 0), eps=float(eps), weight_decay=float(weight_decay),
                maximize=bool(maximize))


class AdEMAMix(_AdEMAMixRule):
    """AdEMAMix (apple/ml-ademamix's PyTorch reference and its arguments; ``beta3_warmup`` and
    ``alpha_warmup`` None for no scheduler). States exp_avg (the reference's exp_avg_fast),
    exp_avg_slow, exp_avg_sq."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=2.0, beta3_warmup=None, alpha_warmup=None,
                 weight_decay=0.0, eps=1e-8, *, maximize=False, capturable=False, fused=None, **kwargs):
        _check("AdEMAMix", lr, kwargs, capturable)
        super().__init__(params, capturable=capturable, fused=fused,
                         **_ademamix_hypers(lr, betas, alpha, beta3_warmup, alpha_warmup, weight_decay, eps, maximize))


class AdEMAMix8bit(_AdEMAMix8bitRule):
    """AdEMAMix with its three EMAs in 8 bits (bitsandbytes' AdEMAMix8bit: exp_avg and
    exp_avg_slow signed, exp_avg_sq unsigned, blocks of 256) for parameters of at least
    ``min_8bit_size`` elements (4096, as bitsandbytes); AdEMAMix's arguments otherwise. Each
    step is AdEMAMix's float step on the dequantized states, requantized in the same pass:
    18.1 bytes an element over float32 parameters where full states move 36."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=2.0, beta3_warmup=None, alpha_warmup=None,
                 weight_decay=0.0, eps=1e-8, *, min_8bit_size=4096, maximize=False, capturable=False, fused=None,
                 **kwargs):
        _check("AdEMAMix8bit", lr, kwargs, capturable)
        super().__init__(params, capturable=capturable, fused=fused, min_8bit_size=min_8bit_size,
                         **_ademamix_hypers(lr, betas, alpha, beta3_warmup, alpha_warmup, weight_decay, eps, maximize))


_AdanRule = _library_rule(
    "_AdanRule", "fo::rules::adan",
    hypers=dict(lr=1e-3, beta1=0.98, beta2=0.92, beta3=0.99, eps=1e-8, weight_decay=0.0, no_prox=False,
                maximize=False),
    states=dict(exp_avg=0.0, exp_avg_sq=0.0, exp_avg_diff=0.0, neg_pre_grad=0.0), elementwise=True)


class Adan(_AdanRule):
    """Adan (sail-sg/Adan's arguments and states; the proximal decay, or the decay before the
    step with no_prox=True). ``max_grad_norm`` > 0 is refused: clip with
    torch.nn.utils.clip_grad_norm_ (or fusedopt_torch.AdamW's fused clip) before the step."""

    def __init__(self, params, lr=1e-3, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.0, max_grad_norm=0.0,
                 no_prox=False, *, maximize=False, capturable=False, fused=None, **kwargs):
        _check("Adan", lr, kwargs, capturable)
        if max_grad_norm:
            raise NotImplementedError("Adan: max_grad_norm > 0 is not supported; clip the gradients before the step")
        b1, b2, b3 = _betas(betas, 3)
        super().__init__(params, lr=lr, beta1=b1, beta2=b2, beta3=b3, eps=float(eps),
                         weight_decay=float(weight_decay), no_prox=bool(no_prox), maximize=bool(maximize),
                         capturable=capturable, fused=fused)


_ADOPTRule = _library_rule(
    "_ADOPTRule", "fo::rules::adopt",
    hypers=dict(lr=1e-3, beta1=0.9, beta2=0.9999, eps=1e-6, clip=True, clip_exp=0.25, weight_decay=0.0, decouple=False,
                maximize=False),
    states=dict(exp_avg=0.0, exp_avg_sq=0.0), elementwise=True)


def _default_clip_lambda(step):
    return step ** 0.25


class ADOPT(_ADOPTRule):
    """ADOPT (iShohei220/adopt's arguments). ``clip_lambda`` is the reference's default
    (step ** 0.25) or None; another power of the step is given as ``clip_exp`` (the bound is
    step ** clip_exp); any other callable is refused (the bound is computed in the kernel)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.9999), eps=1e-6, clip_lambda=_default_clip_lambda,
                 weight_decay=0.0, decouple=False, *, clip_exp=None, maximize=False, capturable=False, fused=None,
                 **kwargs):
        _check("ADOPT", lr, kwargs, capturable)
        b1, b2 = _betas(betas)
        if clip_lambda is not None and clip_lambda is not _default_clip_lambda:
            raise ValueError("ADOPT: clip_lambda must be the default (step ** 0.25) or None; give another power of the "
                             "step as clip_exp")
        clip = clip_lambda is not None or clip_exp is not None
        super().__init__(params, lr=lr, beta1=b1, beta2=b2, eps=float(eps), clip=clip,
                         clip_exp=float(0.25 if clip_exp is None else clip_exp), weight_decay=float(weight_decay),
                         decouple=bool(decouple), maximize=bool(maximize), capturable=capturable, fused=fused)


_StableAdamWRule = _library_rule(
    "_StableAdamWRule", "fo::rules::stable_adamw",
    hypers=dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=1e-2, eps=1e-6, decouple_lr=False, max_lr=0.0,
                maximize=False),
    states=dict(exp_avg=0.0, exp_avg_sq=0.0), elementwise=False)


class StableAdamW(_StableAdamWRule):
    """StableAdamW (optimi's StableAdamW; transformers' ``optim="stable_adamw"``): AdamW whose
    learning rate is divided, per tensor, by max(1, RMS(grad^2 / max(v, eps^2))). One reduction
    pass over the gradient and v (no host synchronisation); not for DTensor shards (the RMS is
    the whole tensor's)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=1e-2, eps=1e-6, decouple_lr=False,
                 max_lr=None, *, maximize=False, capturable=False, fused=None, **kwargs):
        if kwargs.pop("kahan_sum", None):
            raise NotImplementedError("StableAdamW: kahan_sum is not supported (fusedopt_torch.AdamW(kahan=True) is "
                                      "AdamW with Kahan-summed bfloat16 parameters)")
        _check("StableAdamW", lr, kwargs, capturable)
        b1, b2 = _betas(betas)
        super().__init__(params, lr=lr, beta1=b1, beta2=b2, weight_decay=float(weight_decay),
                         eps=float(eps), decouple_lr=bool(decouple_lr), max_lr=float(max_lr or 0.0),
                         maximize=bool(maximize), capturable=capturable, fused=fused)


_CAdamWRule = _library_rule(
    "_CAdamWRule", "fo::rules::adamw",
    hypers=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, maximize=False),
    states=dict(exp_avg=0.0, exp_avg_sq=0.0), elementwise=False, wrap="fo::rules::cautious<fo::rules::adamw, fo::rules::cautious_sign_of::exp_avg>({r})")


class CAdamW(_CAdamWRule):
    """C-AdamW (Cautious AdamW: kyleliang919/C-Optim, timm's ``cadamw``): torch.optim.AdamW's
    update kept only where exp_avg agrees in sign with the gradient (C-Optim's ``exp_avg * grad
    > 0``), scaled per tensor by 1 / max(mean of the mask, 1e-3). One counting pass over grad
    and exp_avg (no host synchronisation); not for DTensor shards."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, maximize=False,
                 capturable=False, fused=None, **kwargs):
        _check("CAdamW", lr, kwargs, capturable)
        b1, b2 = _betas(betas)
        super().__init__(params, lr=lr, beta1=b1, beta2=b2, eps=float(eps),
                         weight_decay=float(weight_decay), maximize=bool(maximize), capturable=capturable,
                         fused=fused)


_CWDAdamWRule = _library_rule(
    "_CWDAdamWRule", "fo::rules::adamw",
    hypers=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, maximize=False),
    states=dict(exp_avg=0.0, exp_avg_sq=0.0), elementwise=True, overrides=dict(weight_decay="0.0"),
    wrap="fo::rules::cautious_weight_decay<fo::rules::adamw>({r}, weight_decay)")


class CWDAdamW(_CWDAdamWRule):
    """AdamW with Cautious Weight Decay (Chen et al. 2025, arXiv 2510.12402): torch.optim.AdamW's
    step, its decoupled decay ``param *= 1 - lr weight_decay`` applied only where the update and
    the parameter agree in sign (update x param >= 0). Elementwise: one fused launch, AdamW's
    bytes."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, maximize=False,
                 capturable=False, fused=None, **kwargs):
        _check("CWDAdamW", lr, kwargs, capturable)
        b1, b2 = _betas(betas)
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, lr=lr, beta1=b1, beta2=b2, eps=float(eps),
                         weight_decay=float(weight_decay), maximize=bool(maximize), capturable=capturable,
                         fused=fused)


# Schedule-Free: the element update is fused; the reference's per-group scalars (the scheduled lr,
# lr_max, the weight sum, c) are computed on the host at each step exactly as the reference's Python
# floats, and passed as hyperparameters: no synchronisation. With capturable=True they are float64
# tensors on the device instead, advanced by torch ops a captured graph replays, and passed as
# tensor hyperparameters (read on the device). GradScaler's fused protocol is refused (a step it
# skipped inside the kernel would still advance the scalars): GradScaler skips step() instead.
_ScheduleFreeAdamWRule = rule(
    "_ScheduleFreeAdamWRule",
    hypers=dict(lr=0.0025, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, lr_t=0.0, c=0.0, bias_correction2=1.0),
    states=dict(z="param", exp_avg_sq=0.0), amp=False,
    body="""
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad;
        T const direction = grad / (sqrt(exp_avg_sq / bias_correction2) + eps) + weight_decay * param;
        param += c * (z - param);
        param += lr_t * (beta1 * (1 - c) - 1) * direction;
        z -= lr_t * direction;
    """)

_ScheduleFreeSGDRule = rule(
    "_ScheduleFreeSGDRule",
    hypers=dict(lr=1.0, momentum=0.9, weight_decay=0.0, lr_t=0.0, c=0.0),
    states=dict(z="param"), amp=False,
    body="""
        T const direction = grad + weight_decay * param;
        param += c * (z - param);
        param += lr_t * (momentum * (1 - c) - 1) * direction;
        z -= lr_t * direction;
    """)


class _ScheduleFree:
    """train()/eval() and the per-group scalars of facebookresearch/schedule_free's classes."""

    _beta_key = "beta1"
    _scalars_per_step = True  # step() advances the group's scalars (step_in_backward refuses it)

    # The group's running values of the schedule (the reference's floats; float64 tensors on the
    # parameters' device with capturable=True) and the hyperparameters the step reads from them.
    _running = ("k", "lr_max", "weight_sum")
    _computed = ("lr_t", "c", "scheduled_lr")

    def _init_schedule(self, warmup_steps, r, weight_lr_power):
        for g in self.param_groups:
            g.update(warmup_steps=int(warmup_steps), r=float(r), weight_lr_power=float(weight_lr_power), k=0,
                     lr_max=-1.0, weight_sum=0.0, train_mode=True)

    def _schedule(self, g):
        """Advances the group's schedule; returns k before the step (a float64 tensor where the
        group is capturable)."""
        if g["capturable"]:
            return self._schedule_on_device(g)
        k = g["k"]
        lr = g["lr"].item() if isinstance(g["lr"], torch.Tensor) else g["lr"]
        lr_t = lr * ((k + 1) / g["warmup_steps"] if k < g["warmup_steps"] else 1.0)
        g["lr_max"] = max(lr_t, g["lr_max"])
        weight = (k + 1) ** g["r"] * g["lr_max"] ** g["weight_lr_power"]
        g["weight_sum"] += weight
        g["scheduled_lr"] = lr_t
        g.update(lr_t=lr_t, c=weight / g["weight_sum"] if g["weight_sum"] else 0.0, k=k + 1)
        return k

    def _device_scalars(self, g, names):
        """The group's values `names` as float64 tensors on its parameters' device, made so once,
        by fill kernels (then updated in place: a captured step writes the same memory at every
        replay)."""
        device = g["params"][0].device
        for name in names:
            v = g.get(name, 0.0)
            if not (isinstance(v, torch.Tensor) and v.device == device and v.dtype == torch.float64):
                g[name] = torch.full((), float(v), dtype=torch.float64, device=device)

    def _schedule_on_device(self, g):
        """The reference's schedule in torch ops on the group's device (capturable=True): the same
        double arithmetic (pow taken by the device), nothing read back; a float lr is baked into
        a captured graph, a Tensor lr (on the device) is read at every replay."""
        self._device_scalars(g, self._running + self._computed)
        k = g["k"].clone()
        one = k + 1
        lr = g["lr"]
        lr = lr.to(torch.float64) if isinstance(lr, torch.Tensor) else torch.full_like(k, float(lr))
        lr_t = lr * torch.where(k < g["warmup_steps"], one / g["warmup_steps"], 1.0) if g["warmup_steps"] > 0 else lr
        g["lr_max"].copy_(torch.maximum(lr_t, g["lr_max"]))
        weight = one ** g["r"] * g["lr_max"] ** g["weight_lr_power"]
        g["weight_sum"].add_(weight)
        g["c"].copy_(torch.where(g["weight_sum"] != 0, weight / g["weight_sum"], 0.0))
        g["lr_t"].copy_(lr_t)
        g["scheduled_lr"].copy_(lr_t)
        g["k"].add_(1)
        return k

    def step(self, closure=None):
        for g in self.param_groups:
            if not g["train_mode"]:
                raise RuntimeError(f"{type(self).__name__}: call optimizer.train() before a step (the parameters hold "
                                   "x, the average, after eval())")
        for g in self.param_groups:  # as the reference: every group's k advances at every step
            self._advance(g)
        return super().step(closure)

    def _swap(self, to_train):
        for g in self.param_groups:
            if g["train_mode"] == to_train:
                continue
            beta = g[self._beta_key]
            weight = 1 - beta if to_train else 1 - 1 / beta
            params = [p for p in g["params"] if "z" in self.state[p]]
            if params:
                with torch.no_grad():
                    torch._foreach_lerp_(params, [self.state[p]["z"] for p in params], weight)
            g["train_mode"] = to_train

    def train(self):
        """The parameters become y, where gradients are taken (the reference's train())."""
        self._swap(True)

    def eval(self):
        """The parameters become x, the average to evaluate (the reference's eval())."""
        self._swap(False)


class ScheduleFreeAdamW(_ScheduleFree, _ScheduleFreeAdamWRule):
    """AdamWScheduleFree (facebookresearch/schedule_free): its arguments, its y/z/x, warmup, r and
    weight_lr_power; call train() before training steps and eval() before evaluating. States z and
    exp_avg_sq; the group keeps k, lr_max, weight_sum and scheduled_lr as the reference's (float64
    tensors on the parameters' device with capturable=True: a captured step advances them)."""

    def __init__(self, params, lr=0.0025, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup_steps=0, r=0.0,
                 weight_lr_power=2.0, *, fused=None, capturable=False, **kwargs):
        _check("ScheduleFreeAdamW", lr, kwargs, capturable)
        b1, b2 = _betas(betas)
        super().__init__(params, lr=lr, beta1=b1, beta2=b2, eps=float(eps),
                         weight_decay=float(weight_decay), fused=fused, capturable=capturable)
        self._init_schedule(warmup_steps, r, weight_lr_power)

    def _advance(self, g):
        k = self._schedule(g)
        if g["capturable"]:
            self._device_scalars(g, ("bias_correction2",))
            g["bias_correction2"].copy_(1 - torch.pow(g["beta2"], k + 1))
        else:
            g["bias_correction2"] = 1 - g["beta2"] ** (k + 1)


class ScheduleFreeSGD(_ScheduleFree, _ScheduleFreeSGDRule):
    """SGDScheduleFree (facebookresearch/schedule_free): its arguments; train()/eval() as
    ScheduleFreeAdamW. State z."""

    _beta_key = "momentum"

    def __init__(self, params, lr=1.0, momentum=0.9, weight_decay=0.0, warmup_steps=0, r=0.0, weight_lr_power=2.0,
                 *, fused=None, capturable=False, **kwargs):
        _check("ScheduleFreeSGD", lr, kwargs, capturable)
        if not 0.0 < momentum < 1.0:
            raise ValueError(f"Momentum must be between 0 and 1 exclusive: {momentum}")
        super().__init__(params, lr=lr, momentum=float(momentum), weight_decay=float(weight_decay), fused=fused,
                         capturable=capturable)
        self._init_schedule(warmup_steps, r, weight_lr_power)

    def _advance(self, g):
        self._schedule(g)
