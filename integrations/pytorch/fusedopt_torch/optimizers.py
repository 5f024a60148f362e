"""torch.optim.Optimizer subclasses that step through fusedopt plans.

Each class takes its torch.optim counterpart's constructor arguments and defaults (LAMB: apex's
FusedLAMB; Lion: lion-pytorch's), keeps torch's parameter groups and torch's per-parameter state
layout, and runs every step as one fused fusedopt launch per (group, device, dtype) bucket.

State: ``self.state[p]`` holds torch's tensors ('exp_avg', 'exp_avg_sq', ...), updated in place
by the kernels. The step counts live in the extension (one counter per bucket, not one tensor
per parameter); ``state_dict()`` writes them into torch's ``state[p]['step']`` entries (float32
CPU tensors, as torch's non-capturable optimizers keep them) and ``load_state_dict`` reads them
back. Read ``state[p]['step']`` after ``state_dict()``: between two calls it is not refreshed.
"""

import torch
from torch.optim import Optimizer

from . import _ext

# Family numbers: csrc/plans.hpp's fusedopt_torch::family.
SGD_F, ADAM_F, ADAMW_F, ADAGRAD_F, RMSPROP_F, LAMB_F, LION_F, RADAM_F, ADAMAX_F, ADADELTA_F = range(10)

# Flag bits of the hyperparameter tuple: csrc/binding.cpp's flag_bits.
AMSGRAD, MAXIMIZE, NESTEROV, CENTERED, DECOUPLED, BIAS_CORRECTION, GRAD_AVERAGING, ADAM_W_MODE, USE_NVLAMB = (
    1 << k for k in range(9))


def _hyper(group, lr=None, beta1=0.0, beta2=0.0, eps=0.0, weight_decay=0.0, momentum=0.0, dampening=0.0, alpha=0.0,
           lr_decay=0.0, rho=0.0, max_grad_norm=0.0, flags=0):
    """The tuple binding.cpp reads (order: its hyper_index)."""
    return [float(group["lr"] if lr is None else lr), float(beta1), float(beta2), float(eps), float(weight_decay),
            float(momentum), float(dampening), float(alpha), float(lr_decay), float(rho), float(max_grad_norm),
            float(flags)]


def _check_common(lr=None, eps=None, weight_decay=None, betas=None):
    # torch's constructor checks, with torch's messages.
    if lr is not None and not isinstance(lr, torch.Tensor) and not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if eps is not None and not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if betas is not None:
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if weight_decay is not None and not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _reject_unsupported(name, capturable=False, differentiable=False):
    if differentiable:
        raise NotImplementedError(f"fusedopt_torch.{name}: differentiable=True is not supported")
    if capturable:
        # A captured step would freeze lr and the step count (they are passed by value).
        raise NotImplementedError(f"fusedopt_torch.{name}: capturable=True is not supported")


class FusedOptimizer(Optimizer):
    """Base class: the engine, the plan cache and torch-compatible state handling.

    Subclasses set ``_family``, ``_step_key`` ('step' when torch keeps a step count, else None)
    and implement ``_state_keys(group)``, ``_hyper(group)`` and optionally ``_new_state``.
    """

    _family = None
    _step_key = "step"

    def __init__(self, params, defaults):
        self._engine = None
        self._dirty = True  # the engine's groups must be (re)set from Python
        self._engine_ahead = False  # the engine's step counts are newer than self.state's
        self._aux_steps = {}  # step counts of families without torch 'step' entries
        super().__init__(params, defaults)
        self._engine = _ext.load().Engine(self._family)

    # ---- what subclasses define ---------------------------------------------------------------

    def _state_keys(self, group):
        """Torch's state keys the group's options need, in the engine's slot order."""
        raise NotImplementedError

    def _new_state(self, p, group, key):
        """A fresh state tensor, as torch creates it."""
        return torch.zeros_like(p, memory_format=torch.preserve_format)

    def _hyper(self, group):
        raise NotImplementedError

    def _first_step(self, p, group, state):
        """Step count of a parameter whose state was just created or loaded without a count."""
        return 0

    # ---- torch.optim.Optimizer ---------------------------------------------------------------

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        self._dirty = True

    def step(self, closure=None):
        """One step of every parameter that has a gradient; returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hypers = [self._hyper(g) for g in self.param_groups]
        if self._dirty or not self._engine.step(hypers):
            self._rebuild()
            if not self._engine.step(hypers):
                raise RuntimeError("fusedopt_torch: internal error: the engine refused a rebuilt parameter set")
        self._engine_ahead = True
        return loss

    def state_dict(self):
        self._pull_steps()
        return super().state_dict()

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._engine_ahead = False  # the loaded counts win
        self._aux_steps.clear()
        self._dirty = True

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_engine", None)
        self.__dict__.setdefault("_aux_steps", {})
        self._engine_ahead = False
        self._dirty = True
        if self._engine is None and self._family is not None:
            self._engine = _ext.load().Engine(self._family)

    def __getstate__(self):
        self._pull_steps()
        state = super().__getstate__()
        state = {k: v for k, v in state.items() if k not in ("_engine",)}
        return state

    # ---- internals ---------------------------------------------------------------------------

    def plan_rebuilds(self):
        """How many times plans were built (one per group whose set of parameters with a gradient changed)."""
        return self._engine.rebuilds()

    def plan_rebinds(self):
        """How many times a group's plans followed moved tensors (new gradients under set_to_none=True)."""
        return self._engine.rebinds()

    def _get_step(self, p, group, state):
        if self._step_key is not None:
            s = state.get(self._step_key)
            if s is None:
                return self._first_step(p, group, state)
            return int(s.item()) if isinstance(s, torch.Tensor) else int(s)
        s = self._aux_steps.get(p)
        return self._first_step(p, group, state) if s is None else s

    def _set_step(self, p, value):
        if self._step_key is not None:
            self.state[p][self._step_key] = torch.tensor(float(value), dtype=torch.float32)
        else:
            self._aux_steps[p] = value

    def _pull_steps(self):
        if self._engine is None or not self._engine_ahead:
            return
        for group_steps in self._engine.steps():
            for p, s in group_steps:
                self._set_step(p, s)
        self._engine_ahead = False

    def _rebuild(self):
        self._pull_steps()
        groups = []
        for group in self.param_groups:
            keys = self._state_keys(group)
            params, states, steps = [], [], []
            for p in group["params"]:
                state = self.state.get(p)
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                if p.grad is not None or state:
                    if state is None:
                        state = self.state[p]
                    fresh = False
                    for k in keys:
                        if state.get(k) is None:
                            state[k] = self._new_state(p, group, k)
                            fresh = True
                    if self._step_key is not None and self._step_key not in state:
                        state[self._step_key] = torch.tensor(0.0, dtype=torch.float32)
                    # A state tensor created now starts from the first step (SGD's buffer).
                    step = 0 if fresh and self._step_key is None else self._get_step(p, group, state)
                    if self._step_key is None:
                        self._aux_steps[p] = step
                    states.append([state[k] for k in keys])
                    steps.append(step)
                else:
                    states.append(None)
                    steps.append(0)
                params.append(p)
            groups.append((params, states, steps))
        self._engine.set_groups(groups)
        self._dirty = False


# ---- torch.optim counterparts ------------------------------------------------------------------


class SGD(FusedOptimizer):
    """torch.optim.SGD (momentum, dampening, nesterov, weight decay, maximize).

    Torch keeps no step count for SGD; the engine counts steps only to start the momentum buffer
    with the first gradient, as torch does when it creates the buffer.
    """

    _family = SGD_F
    _step_key = None

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *, maximize=False,
                 foreach=None, differentiable=False, fused=None):
        _check_common(lr=lr)
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        _reject_unsupported("SGD", differentiable=differentiable)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=foreach, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)

    def _state_keys(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _first_step(self, p, group, state):
        # A loaded torch state with a buffer continues it; no buffer: the next step is the first.
        return 1 if state.get("momentum_buffer") is not None else 0

    def _hyper(self, group):
        flags = (NESTEROV if group["nesterov"] else 0) | (MAXIMIZE if group.get("maximize", False) else 0)
        return _hyper(group, momentum=group["momentum"], dampening=group["dampening"],
                      weight_decay=group["weight_decay"], flags=flags)


class Adam(FusedOptimizer):
    """torch.optim.Adam (amsgrad, weight decay, maximize)."""

    _family = ADAM_F
    _name = "Adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *, foreach=None,
                 maximize=False, capturable=False, differentiable=False, fused=None, decoupled_weight_decay=False):
        _check_common(lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        _reject_unsupported(self._name, capturable, differentiable)
        if decoupled_weight_decay and type(self) is Adam:
            raise NotImplementedError("fusedopt_torch.Adam: decoupled_weight_decay=True: use fusedopt_torch.AdamW")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)

    def _state_keys(self, group):
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")

    def _hyper(self, group):
        b1, b2 = group["betas"]
        flags = (AMSGRAD if group["amsgrad"] else 0) | (MAXIMIZE if group.get("maximize", False) else 0)
        return _hyper(group, beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"], flags=flags)


class AdamW(Adam):
    """torch.optim.AdamW (decoupled weight decay, default 1e-2)."""

    _family = ADAMW_F
    _name = "AdamW"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         foreach=foreach, maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused)


class Adagrad(FusedOptimizer):
    """torch.optim.Adagrad (lr_decay, weight decay, initial_accumulator_value, maximize).

    As torch, the state ('step', 'sum') is created for every parameter in the constructor.
    """

    _family = ADAGRAD_F

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None):
        _check_common(lr=lr, eps=eps, weight_decay=weight_decay)
        if not 0.0 <= lr_decay:
            raise ValueError(f"Invalid lr_decay value: {lr_decay}")
        if not 0.0 <= initial_accumulator_value:
            raise ValueError(f"Invalid initial_accumulator_value value: {initial_accumulator_value}")
        _reject_unsupported("Adagrad", differentiable=differentiable)
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, foreach=foreach, maximize=maximize,
                        differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["sum"] = self._new_state(p, group, "sum")

    def _state_keys(self, group):
        return ("sum",)

    def _new_state(self, p, group, key):
        value = group["initial_accumulator_value"]
        return torch.full_like(p, value, memory_format=torch.preserve_format)

    def _hyper(self, group):
        flags = MAXIMIZE if group.get("maximize", False) else 0
        return _hyper(group, eps=group["eps"], weight_decay=group["weight_decay"], lr_decay=group["lr_decay"],
                      flags=flags)


class RMSprop(FusedOptimizer):
    """torch.optim.RMSprop (alpha, centered, momentum, weight decay, maximize)."""

    _family = RMSPROP_F

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False,
                 capturable=False, foreach=None, maximize=False, differentiable=False):
        _check_common(lr=lr, eps=eps, weight_decay=weight_decay)
        if not 0.0 <= momentum:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if not 0.0 <= alpha:
            raise ValueError(f"Invalid alpha value: {alpha}")
        _reject_unsupported("RMSprop", capturable, differentiable)
        defaults = dict(lr=lr, momentum=momentum, alpha=alpha, eps=eps, centered=centered, weight_decay=weight_decay,
                        capturable=capturable, foreach=foreach, maximize=maximize, differentiable=differentiable)
        super().__init__(params, defaults)

    def _state_keys(self, group):
        keys = ["square_avg"]
        if group["momentum"] > 0:
            keys.append("momentum_buffer")
        if group["centered"]:
            keys.append("grad_avg")
        return tuple(keys)

    def _hyper(self, group):
        flags = (CENTERED if group["centered"] else 0) | (MAXIMIZE if group.get("maximize", False) else 0)
        return _hyper(group, alpha=group["alpha"], eps=group["eps"], weight_decay=group["weight_decay"],
                      momentum=group["momentum"], flags=flags)


class RAdam(FusedOptimizer):
    """torch.optim.RAdam (L2 or decoupled weight decay, maximize)."""

    _family = RADAM_F

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, decoupled_weight_decay=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False):
        _check_common(lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        _reject_unsupported("RAdam", capturable, differentiable)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach, maximize=maximize,
                        capturable=capturable, decoupled_weight_decay=decoupled_weight_decay,
                        differentiable=differentiable)
        super().__init__(params, defaults)

    def _state_keys(self, group):
        return ("exp_avg", "exp_avg_sq")

    def _hyper(self, group):
        b1, b2 = group["betas"]
        flags = (DECOUPLED if group.get("decoupled_weight_decay", False) else 0) | \
            (MAXIMIZE if group.get("maximize", False) else 0)
        return _hyper(group, beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"], flags=flags)


class Adamax(FusedOptimizer):
    """torch.optim.Adamax (weight decay, maximize)."""

    _family = ADAMAX_F

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, foreach=None, *, maximize=False,
                 differentiable=False, capturable=False):
        _check_common(lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        _reject_unsupported("Adamax", capturable, differentiable)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach, maximize=maximize,
                        differentiable=differentiable, capturable=capturable)
        super().__init__(params, defaults)

    def _state_keys(self, group):
        return ("exp_avg", "exp_inf")

    def _hyper(self, group):
        b1, b2 = group["betas"]
        flags = MAXIMIZE if group.get("maximize", False) else 0
        return _hyper(group, beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"], flags=flags)


class Adadelta(FusedOptimizer):
    """torch.optim.Adadelta (rho, weight decay, maximize)."""

    _family = ADADELTA_F

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0, foreach=None, *, capturable=False,
                 maximize=False, differentiable=False):
        _check_common(lr=lr, eps=eps, weight_decay=weight_decay)
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"Invalid rho value: {rho}")
        _reject_unsupported("Adadelta", capturable, differentiable)
        defaults = dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize, capturable=capturable,
                        foreach=foreach, differentiable=differentiable)
        super().__init__(params, defaults)

    def _state_keys(self, group):
        return ("square_avg", "acc_delta")

    def _hyper(self, group):
        flags = MAXIMIZE if group.get("maximize", False) else 0
        return _hyper(group, rho=group["rho"], eps=group["eps"], weight_decay=group["weight_decay"], flags=flags)


# ---- optimizers torch does not have ---------------------------------------------------------------


class LAMB(FusedOptimizer):
    """LAMB with apex.optimizers.FusedLAMB's arguments and defaults.

    ``max_grad_norm > 0`` clips the gradients by their global norm first (apex's default 1.0;
    the coefficient is torch's clip_grad_norm_'s ``max_norm / (norm + 1e-6)``, apex divides by
    ``norm / max_norm``). The norm is taken over the parameters of one (group, device, dtype)
    bucket, not over all groups as apex does: identical with one group. State: 'step',
    'exp_avg', 'exp_avg_sq' per parameter (apex counts steps per group).
    """

    _family = LAMB_F

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0,
                 use_nvlamb=False):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        _check_common(lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        if max_grad_norm is not None and max_grad_norm < 0:
            raise ValueError(f"Invalid max_grad_norm value: {max_grad_norm}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb
        super().__init__(params, defaults)

    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _state_keys(self, group):
        return ("exp_avg", "exp_avg_sq")

    def _hyper(self, group):
        b1, b2 = group["betas"]
        flags = (BIAS_CORRECTION if group["bias_correction"] else 0) | \
            (GRAD_AVERAGING if group["grad_averaging"] else 0) | (ADAM_W_MODE if self.adam_w_mode else 0) | \
            (USE_NVLAMB if self.use_nvlamb else 0)
        return _hyper(group, beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                      max_grad_norm=group["max_grad_norm"] or 0.0, flags=flags)


class Lion(FusedOptimizer):
    """Lion (Chen et al. 2023) with lion-pytorch's arguments: lr 1e-4, betas (0.9, 0.99),
    decoupled weight_decay 0. State: 'exp_avg' (no step count, as lion-pytorch)."""

    _family = LION_F
    _step_key = None

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False):
        if not lr > 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not all(0.0 <= b <= 1.0 for b in betas):
            raise ValueError(f"Invalid betas: {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)

    def _state_keys(self, group):
        return ("exp_avg",)

    def _hyper(self, group):
        b1, b2 = group["betas"]
        flags = MAXIMIZE if group.get("maximize", False) else 0
        return _hyper(group, beta1=b1, beta2=b2, weight_decay=group["weight_decay"], flags=flags)


__all__ = ["FusedOptimizer", "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "RAdam", "Adamax", "Adadelta", "LAMB",
           "Lion"]
