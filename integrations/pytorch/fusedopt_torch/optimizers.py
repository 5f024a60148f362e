"""torch.optim.Optimizer subclasses that step through fusedopt plans.

Each class takes its torch.optim counterpart's constructor arguments and defaults (LAMB: apex's
FusedLAMB; Lion: lion-pytorch's), keeps torch's parameter groups and torch's per-parameter state
layout, and runs every step as one fused fusedopt launch per (group, device, dtype) bucket.

State: ``self.state[p]`` holds torch's tensors ('exp_avg', 'exp_avg_sq', ...), updated in place
by the kernels. The step counts live in the extension (one counter per bucket, not one tensor
per parameter); ``state_dict()`` writes them into torch's ``state[p]['step']`` entries (float32
CPU tensors, as torch's non-capturable optimizers keep them) and ``load_state_dict`` reads them
back. Read ``state[p]['step']`` after ``state_dict()``: between two calls it is not refreshed.

The 8-bit classes (Adam8bit, AdamW8bit, Lion8bit, SGD8bit) keep the moments of large parameters
as uint8 tensors of fusedopt's 8-bit blockwise storage instead (_EightBitStates, quantize_state).
"""

import functools
import sys

import torch
from torch.optim import Optimizer

from . import _codegen, _ext

# The frameworks that read _step_supports_amp_scaling only to refuse gradient clipping (see the property).
_UNSCALING_FRAMEWORKS = ("lightning.", "pytorch_lightning.", "lightning_fabric.")

_LAYOUT = _codegen.LAYOUT_BITS  # csrc/plans.hpp's layout bits, by option

# csrc/plans.hpp's dtype of a parameter's (real) dtype.
_DTYPE_INDEX = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}


def _hyper(group, **fields):
    """The group's hyperparameters as the extension's Hyper (csrc/plans.hpp's `hyper`), by field
    name, in one call (`_C.Hyper.of`): lr from the group, the low-precision options where the
    group has them, the others as given (numbers, and booleans for the options). A tensor lr or
    Tensor betas are passed to the engine apart (FusedOptimizer.step's lrs and betas) and read on
    the device: no synchronisation, capturable; their fields keep the defaults here."""
    if "kahan" in group:
        fields.update(kahan=bool(group["kahan"]), stochastic_rounding=bool(group["stochastic_rounding"]))
    if group.get("master_weights", False):
        fields.update(master_weights=True)
    return _ext.load().Hyper.of(lr=group["lr"], **fields)


def _scalar_dtype():
    """torch.optim.optimizer._get_scalar_dtype: the dtype of state['step'] (and NAdam's mu_product)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _is_dense(t):
    """Whether t's elements fill its memory without gaps or overlaps (any order of the dimensions):
    at::Tensor::is_non_overlapping_and_dense, which the extension requires of every tensor it steps."""
    if t.numel() <= 1 or t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _is_dtensor(t):
    """Whether t is a DTensor (FSDP2's parameters), without importing torch.distributed.tensor:
    while that module is not loaded, no tensor can be one."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls is not None and isinstance(t, cls)


def _same(a, b):
    """a == b, by identity first (DTensor placements and meshes: Python __eq__ methods)."""
    return a is b or a == b


def _sharded_like(g, p):
    """Whether gradient g is a DTensor sharded as DTensor parameter p is (same mesh and
    placements): at every step for every FSDP2 parameter, so identity is tried first."""
    return ((type(g) is type(p) or _is_dtensor(g)) and _same(g.placements, p.placements)
            and _same(g.device_mesh, p.device_mesh))


def _engine_view(t):
    """The plain real tensor the engine steps for t: a DTensor's local shard, a complex tensor's
    real view (as torch steps both)."""
    if _is_dtensor(t):
        t = t._local_tensor
    return torch.view_as_real(t.detach()) if t.is_complex() else t


def _graph_break(fn):
    """torch.compile runs fn eagerly (a clean graph break in a compiled training step; a compiled
    opt.step runs): the step mutates the optimizer and calls the extension, which dynamo cannot
    trace. torch.optim marks its own untraceable methods the same way (torch._disable_dynamo,
    which imports dynamo at the first call only); older torch has no dynamo."""
    disable = getattr(torch, "_disable_dynamo", None)
    return disable(fn) if disable is not None else fn


def _step_hooks(fn):
    """torch.optim.Optimizer wraps every class's step once (profile_hook_step): at each call a
    record_function range and the loops over the step pre- and post-hooks. This wrapper does the
    same, in torch's order, but enters the range only while a profiler records and skips the loops
    when no hook is registered: 54-92 us less host time per step on the H100 machine
    (docs/performance.md). Marked `hooked` so that torch does not wrap it again. Where torch has
    no step hooks (before 2.0) torch's own wrapper is kept."""
    from torch.optim import optimizer as torch_optimizer

    global_pre = getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
    global_post = getattr(torch_optimizer, "_global_optimizer_post_hooks", None)
    profiler_enabled = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
    if global_pre is None or global_post is None or profiler_enabled is None:
        return fn

    @functools.wraps(fn)
    def step(*args, **kwargs):
        self = args[0]  # the hooks see (self, ...) as torch's wrapper passes them
        if type(self).step is not step:
            # A subclass's own step, which torch wrapped (with the hooks) and which calls this one.
            return fn(*args, **kwargs)
        if not profiler_enabled():
            if not (global_pre or global_post or self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks):
                return fn(*args, **kwargs)
            return _run_with_hooks(fn, self, args, kwargs, global_pre, global_post)
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            return _run_with_hooks(fn, self, args, kwargs, global_pre, global_post)

    step.hooked = True
    return step


def _run_with_hooks(fn, self, args, kwargs, global_pre, global_post):
    """torch's profile_hook_step body: pre-hooks (global first) may replace the arguments, then
    the step, the profiler's entry point, and the post-hooks (the optimizer's first)."""
    for pre_hook in list(global_pre.values()) + list(self._optimizer_step_pre_hooks.values()):
        result = pre_hook(self, args, kwargs)
        if result is not None:
            if isinstance(result, tuple) and len(result) == 2:
                args, kwargs = result
            else:
                raise RuntimeError(f"{fn} must return None or a tuple of (new_args, new_kwargs), but got {result}.")
    out = fn(*args, **kwargs)
    self._optimizer_step_code()
    for post_hook in list(self._optimizer_step_post_hooks.values()) + list(global_post.values()):
        post_hook(self, args, kwargs)
    return out


def _torch_total_norm(grads, norm_type, error_if_nonfinite, foreach):
    """torch.nn.utils.get_total_norm (torch 2.6 and newer), or the same computation before it:
    the norm of the per-tensor norms, on the first gradient's device."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        return get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    first = grads[0].device
    norms = [torch.linalg.vector_norm(g, norm_type).to(first) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    _check_finite_norm(total, norm_type, error_if_nonfinite)
    return total


def _check_finite_norm(total, norm_type, error_if_nonfinite):
    """torch's error for a non-finite total norm under error_if_nonfinite (a synchronisation)."""
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
                           "it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                           "norm anyway, set `error_if_nonfinite=False`")


def _clip_divisor(total_norm, max_norm, grad_scale):
    """What the step divides the gradients by (GradScaler's grad_scale slot) to clip them as
    torch.nn.utils.clip_grad_norm_ would: the coefficient computed as torch computes it, from
    the norm in float32 (torch computes it in the gradients' dtype: the same for float32 ones,
    and float16 would overflow on gradients GradScaler has scaled), and the scale of gradients
    GradScaler has not unscaled (`grad_scale`, or None), whose norm is then the scaled one. Where no clipping is needed the divisor is
    exactly 1 (or grad_scale), so the step's bits are those of an unclipped step."""
    if grad_scale is not None:
        scale = grad_scale.to(device=total_norm.device, dtype=total_norm.dtype)
        coef = torch.clamp(max_norm / (total_norm / scale + 1e-6), max=1.0)
        return grad_scale / coef.to(device=grad_scale.device, dtype=torch.float32)
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    return torch.reciprocal(coef.to(torch.float32))


def _check_common(lr=None, eps=None, weight_decay=None, betas=None):
    # torch's constructor checks, with torch's messages.
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if lr is not None and not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if eps is not None and not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if betas is not None:
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if weight_decay is not None and not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _check_fused_flags(fused, foreach, differentiable):
    # torch (Adam, AdamW, SGD, Adagrad) raises these after Optimizer.__init__, in this order.
    if fused:
        if differentiable:
            raise RuntimeError("`fused` does not support `differentiable`")
        if foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


def _check_low_precision(kahan, stochastic_rounding, master_weights=False):
    chosen = [name for name, on in (("kahan", kahan), ("stochastic_rounding", stochastic_rounding),
                                    ("master_weights", master_weights)) if on]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} are ways to keep low-precision updates: choose one")


def _load_keeping_float32(optimizer, state_dict, kept, load):
    """``load(state_dict)`` (torch's load_state_dict, which casts every floating state to its
    parameter's dtype) with the states ``kept(saved_group, key)`` names set apart and restored
    in float32 instead, on their parameter's device."""
    group_of = {i: g for g in state_dict["param_groups"] for i in g["params"]}
    aside, others = {}, {}
    for i, entries in state_dict["state"].items():
        group = group_of.get(i, {})
        aside[i] = {k: v for k, v in entries.items() if isinstance(v, torch.Tensor) and kept(group, k)}
        others[i] = {k: v for k, v in entries.items() if k not in aside[i]}
    saved = [i for g in state_dict["param_groups"] for i in g["params"]]
    load({**state_dict, "state": others})
    targets = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in zip(saved, targets):
        for key, value in aside.get(i, {}).items():
            optimizer.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)


def _reject_unsupported(name, differentiable=False):
    if differentiable:
        raise NotImplementedError(f"fusedopt_torch.{name}: differentiable=True is not supported")


class _View:
    """A parameter the engine cannot step in place as it is: complex (the engine steps its real
    view, as torch does), not dense (sliced with gaps: the engine steps a dense copy), or whose
    gradient has another layout or dtype than the parameter (the engine reads a dense copy of it).
    `proxy` is the tensor the engine holds; its .grad is set before every step. `sharded`: the
    parameter is a DTensor (FSDP2), `complex`: a complex one (facts _sync_in needs at every step,
    found once here)."""

    __slots__ = ("param", "real", "proxy", "grad_buffer", "copy_param", "sharded", "complex")

    def __init__(self, param, real, proxy, grad_buffer, copy_param):
        self.param, self.real, self.proxy = param, real, proxy
        self.grad_buffer, self.copy_param = grad_buffer, copy_param
        self.sharded, self.complex = _is_dtensor(param), param.is_complex()


class FusedOptimizer(Optimizer):
    """Base class: the engine, the plan cache and torch-compatible state handling.

    Subclasses set ``_family`` (a name of ``_C.Family``), ``_step_key`` ('step' when torch keeps a step count, else None)
    and implement ``_state_keys(group)``, ``_hyper(group)`` and optionally ``_new_state``.
    """

    _family = None
    _step_key = "step"
    _mu_key = None  # NAdam: 'mu_product', a per-parameter scalar state the engine keeps per bucket
    _sparse_error = None  # torch's message for sparse gradients; None: torch supports them, fusedopt does not
    # GradScaler's fused protocol (SGD, Adam, AdamW, Adagrad, as torch's fused optimizers, and user
    # rules): the scaler sets self.grad_scale and self.found_inf and calls step(); the kernel
    # divides the gradients by grad_scale and skips the step where found_inf is set, on the device.
    # What GradScaler sees is the property _step_supports_amp_scaling (the `fused` option).
    _amp_protocol = False
    _elementwise = True  # False: the rule needs whole tensors (LAMB's trust ratios), so no DTensor shards
    # True: the engine runs the step with the GIL released (Engine.step_released): set on the
    # optimizers fusedopt_torch.CPUOffload steps on its worker thread while backward's hooks run.
    _release_gil = False

    def __init__(self, params, defaults):
        self._engine = None
        self._engine_family = None
        self._dirty = True  # the engine's groups must be (re)set from Python
        self._engine_ahead = False  # the engine's step counts are newer than self.state's
        self._aux_steps = {}  # step counts of families without torch 'step' entries
        self._views = []  # _View of every parameter the engine steps through a proxy
        self._param_of = {}  # proxy -> parameter
        self._pending_clip = None  # (norm in float32, max_norm) of clip_grad_norm_, applied by the next step
        self._grad_norm = None  # the extension's GradNorm of clip_grad_norm_, made at its first call
        super().__init__(params, defaults)
        # The engine (and the core it needs) is made at the first step: nothing is compiled or
        # loaded before, and the first step compiles the units it needs beside the core.

    @property
    def _step_supports_amp_scaling(self):
        """Whether this optimizer takes GradScaler's fused protocol (torch's attribute, read by
        GradScaler and by frameworks). ``fused=True``: yes, as torch's fused optimizers; ``fused=False``:
        no, as torch's foreach ones (GradScaler unscales the gradients and synchronises to check
        them); ``fused=None`` (the default): yes for GradScaler, while to PyTorch Lightning the
        optimizer reports that it does not unscale internally, so that Lightning's AMP plugin
        unscales the gradients itself where it clips them (it refuses gradient clipping with an
        optimizer that unscales internally), then still steps through the fused protocol, with
        Lightning's found_inf and no synchronisation (docs/pytorch.md, "Mixed precision and
        gradient clipping in Lightning")."""
        if not self._amp_protocol:
            return False
        fused = self.defaults.get("fused")
        if fused is None:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            return not caller.startswith(_UNSCALING_FRAMEWORKS)
        return bool(fused)

    def _provider(self, family):
        """The provider of the engine's units (_ext.Provider): the built-in family's."""
        return _ext.builtin_provider(family)

    def _layout_bits(self, group, p):
        """The layout (csrc/plans.hpp's bits) the engine will ask a unit for p of `group`: what the
        first step compiles beside the core. A guess that misses costs only time."""
        return 0

    def _tensor_hypers(self, group):
        """A user rule's hyperparameters given as Tensors: [(index, tensor)] (built-ins: none)."""
        return None

    def _accepts(self, p):
        """Whether the optimizer steps p's dtype (a user rule may take fewer): what to prefetch."""
        return True

    # ---- what subclasses define ---------------------------------------------------------------

    def _state_keys(self, group):
        """Torch's state keys the group's options need, in the engine's slot order."""
        raise NotImplementedError

    def _keeps_state(self, group):
        """Whether torch keeps per-parameter state for the group (SGD without momentum keeps none)."""
        return True

    def _new_state(self, p, group, key):
        """A fresh state tensor, as torch creates it."""
        return torch.zeros_like(p, memory_format=torch.preserve_format)

    def _hyper(self, group):
        raise NotImplementedError

    def _first_step(self, p, group, state):
        """Step count of a parameter whose state was just created or loaded without a count."""
        return 0

    def _wanted_family(self):
        """The engine family the parameter groups need now (Adam: AdamW's with decoupled_weight_decay)."""
        return self._family

    # ---- torch.optim.Optimizer ---------------------------------------------------------------

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        self._dirty = True

    @_step_hooks
    @_graph_break
    def step(self, closure=None):
        """One step of every parameter that has a gradient; returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        family = self._wanted_family()
        if family != self._engine_family:
            if self._engine is None:
                self._prefetch_units(family)
            self._make_engine(family)
        hypers = [self._hyper(g) for g in self.param_groups]
        grad_scale = found_inf = None
        # Hyperparameters given as tensors, read on the device (no synchronisation, capturable).
        lrs, betas, user_tensors = [], [], []
        for g in self.param_groups:
            lr, b = g.get("lr"), g.get("betas")
            lrs.append(lr if isinstance(lr, torch.Tensor) else None)
            betas.append(b if b is not None and isinstance(b[0], torch.Tensor) else None)
            user_tensors.append(self._tensor_hypers(g) or [])
        if not any(user_tensors):
            user_tensors = []
        on_device = any(g.get("capturable", False) for g in self.param_groups)
        if self._amp_protocol:
            grad_scale = getattr(self, "grad_scale", None)
            found_inf = getattr(self, "found_inf", None)
        clip, self._pending_clip = self._pending_clip, None
        if clip is not None:
            grad_scale = _clip_divisor(*clip, grad_scale)
        with torch.no_grad():
            done = False
            engine_step = self._engine.step
            if self._release_gil:
                engine_step = getattr(self._engine, "step_released", engine_step)
            if not self._dirty and (not self._views or self._sync_in()):
                try:
                    done = engine_step(hypers, grad_scale, found_inf, lrs, on_device, betas, user_tensors)
                except RuntimeError:
                    # A gradient of another layout than its parameter's, or a sparse one: nothing
                    # was written (the engine checks every tensor before it runs a plan).
                    if not self._needs_reroute():
                        raise
            if not done:
                self._rebuild()
                if self._views and not self._sync_in():
                    raise RuntimeError("fusedopt_torch: internal error: a rebuilt proxy refused its gradient")
                if not engine_step(hypers, grad_scale, found_inf, lrs, on_device, betas, user_tensors):
                    raise RuntimeError("fusedopt_torch: internal error: the engine refused a rebuilt parameter set")
            if self._views:
                self._sync_out()
        self._engine_ahead = True
        return loss

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """torch.nn.utils.clip_grad_norm_ over the gradients of every parameter of the
        optimizer's groups, fused into the next step() where the optimizer takes GradScaler's
        fused protocol (SGD, Adam, AdamW, Adagrad and their 8-bit classes): the total norm is
        taken now (one read of the gradients: fusedopt's norm plan for the 2- and inf-norms,
        else torch's get_total_norm) and returned, and the next step() scales the gradients
        by torch's coefficient min(1, max_norm / (norm + 1e-6)) in registers as it reads them.
        The gradients themselves are not written (torch's clip reads them once more and writes
        them), so ``p.grad`` still holds the unclipped values after the step. Nothing
        synchronises with the host (unless ``error_if_nonfinite``), so the pair can be captured
        in a CUDA graph.

        Call it between backward() and step(), as torch's; a second call before the step
        raises. Under torch.amp.GradScaler either after ``scaler.unscale_(opt)`` (the norm is of
        the unscaled gradients, as with torch's clip) or without it: then the returned norm is
        of the scaled gradients, and the step divides it by the scale before it clips. Other
        optimizers, DTensor gradients (FSDP2: the norm is over the whole mesh) and float64 or
        complex128 ones (clipped in double by torch) run torch.nn.utils.clip_grad_norm_ itself
        (the gradients are clipped in place, nothing is left for the step). docs/pytorch.md,
        "Gradient clipping"."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        # Double gradients: the protocol's divisor is a float, torch clips them in double.
        double = (torch.float64, torch.complex128)
        if not self._amp_protocol or any(_is_dtensor(g) or g.dtype in double for g in grads):
            params = [p for g in self.param_groups for p in g["params"]]
            kwargs = {} if foreach is None else {"foreach": foreach}  # torch before 2.0 has no foreach
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, **kwargs)
        if self._pending_clip is not None:
            raise RuntimeError(f"fusedopt_torch.{type(self).__name__}.clip_grad_norm_: called twice before a step "
                               "(the first clip is applied by the next step(), which has not run)")
        if not grads:
            return torch.tensor(0.0)
        total_norm, coefficient_norm = self._total_norm(grads, float(norm_type), error_if_nonfinite, foreach)
        self._pending_clip = (coefficient_norm, float(max_norm))
        return total_norm

    def _total_norm(self, grads, norm_type, error_if_nonfinite, foreach):
        """The total norm as clip_grad_norm_ returns it, and the same in float32 for the
        coefficient (the norm of float16 gradients GradScaler has scaled overflows float16).
        For the 2- and inf-norms of real gradients of one device and dtype: fusedopt's norm
        plan (one reduction over every gradient, its few launches kept and rebound across steps
        like the step's plans; torch's value up to the order of the additions, returned in the
        gradients' dtype); otherwise torch's get_total_norm, which launches and stacks per
        tensor (0.8-1.3 ms of host time for GPT-2 small's 148 gradients on the H200)."""
        if norm_type in (2.0, float("inf")) and all(type(g) is torch.Tensor and not g.is_complex() for g in grads):
            if self._grad_norm is None:
                self._grad_norm = _ext.load().GradNorm(_ext.norm_provider())
            total = self._grad_norm.compute(grads, norm_type == float("inf"))  # float64
            if total is not None:
                _check_finite_norm(total, norm_type, error_if_nonfinite)
                returned = total.to(grads[0].dtype)
                return returned, returned if returned.dtype == torch.float32 else total.float()
        total = _torch_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        return total, total.float()  # the same tensor for float32

    def zero_grad(self, *args, **kwargs):
        if self._pending_clip is not None:  # written only then: torch.compile traces zero_grad
            self._pending_clip = None  # a clip belongs to the gradients it measured
        super().zero_grad(*args, **kwargs)

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
        self.__dict__.setdefault("_engine_family", None)
        self.__dict__.setdefault("_aux_steps", {})
        self.__dict__.setdefault("_pending_clip", None)
        self.__dict__["_grad_norm"] = None
        self._views, self._param_of = [], {}
        self._engine_ahead = False
        self._dirty = True

    def __getstate__(self):
        self._pull_steps()
        state = super().__getstate__()
        transient = ("_engine", "_engine_family", "_views", "_param_of", "_pending_clip", "_grad_norm")
        state = {k: v for k, v in state.items() if k not in transient}
        return state

    # ---- internals ---------------------------------------------------------------------------

    def plan_rebuilds(self):
        """How many times plans were built (one per group whose set of parameters with a gradient changed)."""
        return self._engine.rebuilds() if self._engine is not None else 0

    def plan_reuses(self):
        """How many times a group's kept plans of a set of parameters with a gradient seen before were
        swapped back in instead of built (step_in_backward's buckets in turn, experts coming and going)."""
        return self._engine.reuses() if self._engine is not None else 0

    def plan_rebinds(self):
        """How many times a group's plans followed moved tensors (new gradients under set_to_none=True)."""
        return self._engine.rebinds() if self._engine is not None else 0

    def _make_engine(self, family):
        if self._engine is not None:
            self._pull_steps()
        core = _ext.load()
        self._engine = core.Engine(getattr(core.Family, family), self._provider(family), self._amp_protocol)
        self._engine_family = family
        self._engine_ahead = False
        self._dirty = True

    def _prefetch_units(self, family):
        """Starts compiling, in the background, the units the first step will ask for (each
        (device, dtype, layout) of the parameters with a gradient): the core, when it must be
        compiled too, compiles meanwhile."""
        provider = self._provider(family)
        amp = self._amp_protocol and getattr(self, "grad_scale", None) is not None
        seen = set()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or not (p.is_cuda or p.is_cpu) or not self._accepts(p):
                    continue
                dtype = _DTYPE_INDEX.get(_engine_view(p).dtype)
                if dtype is None:
                    continue
                key = (p.get_device() if p.is_cuda else -1, dtype, self._layout_bits(group, p))
                if key not in seen:
                    seen.add(key)
                    provider.prefetch(*key, amp=amp)

    def _get_step(self, p, group, state):
        if self._step_key is not None:
            s = state.get(self._step_key)
            if s is None:
                return self._first_step(p, group, state)
            return int(s.item()) if isinstance(s, torch.Tensor) else int(s)
        s = self._aux_steps.get(p)
        return self._first_step(p, group, state) if s is None else s

    def _set_scalar(self, p, key, value):
        """state[p][key] = value, in place where torch's scalar tensor exists (torch updates it in place)."""
        state = self.state[p]
        old = state.get(key)
        if isinstance(old, torch.Tensor) and old.numel() == 1 and old.is_floating_point():
            old.fill_(value)
        else:
            device = p.device if key == self._mu_key else None  # torch's places: see _rebuild
            state[key] = torch.tensor(float(value), dtype=_scalar_dtype(), device=device)

    def _set_step(self, p, value):
        if self._step_key is not None:
            self._set_scalar(p, self._step_key, value)
        else:
            self._aux_steps[p] = value

    def _pull_steps(self):
        if self._engine is None or not self._engine_ahead:
            return
        param_of = self._param_of
        for group_steps in self._engine.steps():
            for t, s in group_steps:
                self._set_step(param_of.get(t, t), s)
        if self._mu_key is not None:
            for group_mus in self._engine.mu_products():
                for t, m in group_mus:
                    self._set_scalar(param_of.get(t, t), self._mu_key, m)
        self._engine_ahead = False

    def _check_low_precision_param(self, group, p):
        """kahan and master_weights need bfloat16 or float16 parameters, stochastic_rounding bfloat16 ones."""
        if group.get("kahan", False):
            option, allowed = "kahan=True", (torch.bfloat16, torch.float16)
        elif group.get("master_weights", False):
            option, allowed = "master_weights=True", (torch.bfloat16, torch.float16)
        elif group.get("stochastic_rounding", False):
            option, allowed = "stochastic_rounding=True", (torch.bfloat16,)
        else:
            return
        if p.dtype not in allowed:
            names = " or ".join(str(d).replace("torch.", "") for d in allowed)
            raise ValueError(f"fusedopt_torch.{type(self).__name__}: {option} is for {names} parameters, but a "
                             f"parameter of its group is {str(p.dtype).replace('torch.', '')} (give it a group "
                             "without the option)")

    def _sparse_message(self):
        if self._sparse_error is not None:
            return self._sparse_error
        return (f"fusedopt_torch.{type(self).__name__} does not support sparse gradients "
                f"(torch.optim.{type(self).__name__} does: use it for sparse parameters)")

    def _check_sparse(self, g):
        if g is not None and g.is_sparse:
            if self._sparse_error is not None:
                raise RuntimeError(self._sparse_error)
            raise NotImplementedError(self._sparse_message())

    def _needs_reroute(self):
        """After an engine error: whether a gradient now needs another route than the one its
        parameter got at the last rebuild (then nothing was written and a rebuild fixes it).
        Raises torch's error for sparse gradients."""
        viewed = {id(v.param) for v in self._views}
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                self._check_sparse(g)
                if id(p) not in viewed and (g.stride() != p.stride() or g.dtype != p.dtype):
                    return True
        return False

    def _sync_in(self):
        """Points every proxy at its parameter's gradient (a view or a dense copy) and copies
        non-dense parameters into their dense proxies. False: a gradient needs another route.
        Runs at every step over every proxy (FSDP2: every parameter; GPT-2 medium's 292
        DTensors took 0.76 ms a step on an H200 host), so the per-proxy facts are _View's and a
        DTensor gradient's placements and mesh are compared by identity first."""
        for v in self._views:
            g = v.param.grad
            if g is None:
                if v.proxy.grad is not None:
                    v.proxy.grad = None
                continue
            if g.is_sparse:
                self._check_sparse(g)
            if v.sharded:
                if not _sharded_like(g, v.param):
                    self._check_placements(v.param, g)  # raises
                g = g._local_tensor
                if v.complex and g.is_complex():
                    g = torch.view_as_real(g.detach())
            else:  # complex or not dense (rare): the general route
                g = _engine_view(g)
            if v.grad_buffer is None:
                if g.dtype != v.proxy.dtype or g.stride() != v.proxy.stride() or g.device != v.proxy.device:
                    self._dirty = True
                    return False
                v.proxy.grad = g
            else:
                v.grad_buffer.copy_(g)
                if v.proxy.grad is not v.grad_buffer:
                    v.proxy.grad = v.grad_buffer
            if v.copy_param:
                v.proxy.copy_(v.real)
        return True

    def _check_placements(self, p, g):
        """A DTensor parameter (FSDP2) is stepped shard by shard: its gradient must be sharded
        the same way, and the rule must be elementwise (no norm over the whole tensor)."""
        if not _is_dtensor(p):
            return
        if not self._elementwise:
            raise NotImplementedError(f"fusedopt_torch.{type(self).__name__} does not support DTensor (FSDP2) "
                                      "parameters: its trust ratios need norms over whole tensors, not shards")
        if g is not None and not _sharded_like(g, p):
            raise NotImplementedError("fusedopt_torch: a DTensor parameter's gradient must be a DTensor with the "
                                      f"parameter's mesh and placements ({p.placements}), not "
                                      f"{getattr(g, 'placements', 'a plain tensor')}")

    def _sync_out(self):
        for v in self._views:
            if v.copy_param and v.param.grad is not None:
                v.real.copy_(v.proxy)

    def _route(self, p, state, keys):
        """The tensor the engine steps for p and the state tensors it binds (torch's, or their
        real views for complex parameters). Normalises the layout of state tensors that differ
        from the tensor stepped (torch does not care about a state's strides)."""
        g = p.grad
        self._check_placements(p, g)
        real = _engine_view(p)
        gr = None if g is None else _engine_view(g)
        dense = _is_dense(real)
        grad_ok = gr is None or (gr.dtype == real.dtype and gr.stride() == real.stride() and gr.device == real.device)
        if dense:
            proxy, copy_param = (p if real is p and grad_ok else real.detach()), False
        else:
            proxy, copy_param = torch.empty(real.shape, dtype=real.dtype, device=real.device), True
        if state is not None:
            for k in keys:
                s = state[k]
                # 8-bit states (uint8) are flat storage, with no strides to match.
                if s.dtype != torch.uint8 and _engine_view(s).stride() != proxy.stride():
                    fresh = (torch.empty_like(p, dtype=s.dtype) if dense
                             else torch.empty(p.shape, dtype=s.dtype, device=p.device))
                    state[k] = fresh.copy_(s)
        if proxy is not p:
            grad_buffer = None if (dense and grad_ok) else torch.empty_like(proxy)
            self._views.append(_View(p, real, proxy, grad_buffer, copy_param))
            self._param_of[proxy] = p
        states = None
        if state is not None:
            states = [_engine_view(state[k]) for k in keys]
        return proxy, states

    def _rebuild(self):
        self._pull_steps()
        self._views, self._param_of = [], {}
        groups, mus, single = [], [], True
        for group in self.param_groups:
            keys = self._state_keys(group)
            keeps = self._keeps_state(group)
            proxies, states, steps, group_mus = [], [], [], []
            for p in group["params"]:
                self._check_sparse(p.grad)
                self._check_low_precision_param(group, p)
                if not keeps:
                    # No torch state (SGD without momentum): nothing to create, nothing to count.
                    proxy, _ = self._route(p, None, ())
                    proxies.append(proxy)
                    states.append([] if p.grad is not None else None)
                    steps.append(0)
                    group_mus.append(1.0)
                    continue
                state = self.state.get(p)
                if p.grad is not None or state:
                    if state is None:
                        state = self.state[p]
                    fresh = False
                    for k in keys:
                        if state.get(k) is None:
                            state[k] = self._new_state(p, group, k)
                            fresh = True
                    if self._step_key is not None and self._step_key not in state:
                        # torch keeps it on the parameter's device when capturable
                        device = p.device if group.get("capturable", False) else None
                        state[self._step_key] = torch.tensor(0.0, dtype=_scalar_dtype(), device=device)
                    if self._mu_key is not None and self._mu_key not in state:
                        # torch keeps mu_product on the parameter's device (step on the CPU)
                        state[self._mu_key] = torch.tensor(1.0, dtype=_scalar_dtype(), device=p.device)
                    # A state tensor created now starts from the first step (SGD's buffer).
                    step = 0 if fresh and self._step_key is None else self._get_step(p, group, state)
                    if self._step_key is None:
                        self._aux_steps[p] = step
                    proxy, st = self._route(p, state, keys)
                    states.append(st)
                    steps.append(step)
                    if self._mu_key is not None:
                        mu = state[self._mu_key]
                        single = single and not (isinstance(mu, torch.Tensor) and mu.dtype == torch.float64)
                        group_mus.append(float(mu))
                    else:
                        group_mus.append(1.0)
                else:
                    proxy, _ = self._route(p, None, keys)
                    states.append(None)
                    steps.append(0)
                    group_mus.append(1.0)
                proxies.append(proxy)
            groups.append((proxies, states, steps))
            mus.append(group_mus)
        self._engine.set_groups(groups)
        if self._mu_key is not None:
            self._engine.set_mu_products(mus, single)
        self._dirty = False


# ---- torch.optim counterparts ------------------------------------------------------------------


class SGD(FusedOptimizer):
    """torch.optim.SGD (momentum, dampening, nesterov, weight decay, maximize).

    Torch keeps no step count for SGD; the engine counts steps only to start the momentum buffer
    with the first gradient, as torch does when it creates the buffer.
    """

    _family = "sgd"
    _step_key = None
    _amp_protocol = True

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *, maximize=False,
                 foreach=None, differentiable=False, fused=None):
        _check_common(lr=lr)
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=foreach, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)
        _check_fused_flags(fused, foreach, differentiable)
        _reject_unsupported("SGD", differentiable=differentiable)

    def _state_keys(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _layout_bits(self, group, p):
        return _LAYOUT["momentum"] if group["momentum"] != 0 else 0

    def _keeps_state(self, group):
        return group["momentum"] != 0

    def _first_step(self, p, group, state):
        # A loaded torch state with a buffer continues it; no buffer: the next step is the first.
        return 1 if state.get("momentum_buffer") is not None else 0

    def _hyper(self, group):
        return _hyper(group, momentum=group["momentum"], dampening=group["dampening"],
                      weight_decay=group["weight_decay"], nesterov=bool(group["nesterov"]), maximize=bool(group.get("maximize", False)))


class Adam(FusedOptimizer):
    """torch.optim.Adam (amsgrad, weight decay, maximize, decoupled_weight_decay).

    As in torch 2.11, ``decoupled_weight_decay=True`` is AdamW's formula: the groups then run on
    the AdamW engine (every group must agree on the option).

    For bfloat16 or float16 parameters (pure low-precision training), two options torch does not
    have keep the updates that rounding the parameter would lose: ``kahan=True`` keeps a
    compensation state ``state[p]['kahan_comp']`` of the parameter's dtype, updated in the same
    pass (fusedopt.rules.with_kahan: 2 more bytes read and written per bf16 parameter), and
    ``stochastic_rounding=True`` rounds each new bfloat16 parameter stochastically (no state).
    ``master_weights=True`` keeps a float32 master copy ``state[p]['master']`` (created from the
    parameter at its first step) and every moment in float32; the step runs on the master, and
    the parameter is stored as the master rounded to nearest (fusedopt.rules.with_master: the
    parameter is written, never read; apex's ``FusedAdam(master_weights=True)``): 12 bytes of
    state per parameter (16 with AMSGrad), and the master's bits are those of the same
    optimizer's float32 step (on the CPU; on CUDA within the last bits).
    """

    _family = "adam"
    _name = "Adam"
    _amp_protocol = True
    _sparse_error = "Adam does not support sparse gradients, please consider SparseAdam instead"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *, foreach=None,
                 maximize=False, capturable=False, differentiable=False, fused=None, decoupled_weight_decay=False,
                 kahan=False, stochastic_rounding=False, master_weights=False):
        _check_low_precision(kahan, stochastic_rounding, master_weights)
        if isinstance(lr, torch.Tensor):
            if foreach and not capturable:
                raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        _check_common(lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        if not ((isinstance(betas[0], float) and isinstance(betas[1], float))
                or (isinstance(betas[0], torch.Tensor) and isinstance(betas[1], torch.Tensor))):
            raise ValueError("betas must be either both floats or both Tensors")
        for i in (0, 1):
            if isinstance(betas[i], torch.Tensor):
                if not capturable and foreach:
                    raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
                if betas[i].numel() != 1:
                    raise ValueError(f"Tensor betas[{i}] must be 1-element")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        if kahan or stochastic_rounding:  # absent otherwise: state_dict()'s groups stay torch's
            defaults.update(kahan=kahan, stochastic_rounding=stochastic_rounding)
        if master_weights:
            defaults.update(master_weights=True)
        super().__init__(params, defaults)
        _check_fused_flags(fused, foreach, differentiable)
        _reject_unsupported(self._name, differentiable)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            if isinstance(self, AdamW):
                group["decoupled_weight_decay"] = True  # as torch's AdamW.__setstate__ (AdamW8bit too)
            else:
                group.setdefault("decoupled_weight_decay", False)
        self._dirty = True

    def _wanted_family(self):
        flags = {bool(g.get("decoupled_weight_decay", False)) for g in self.param_groups}
        if len(flags) > 1:
            raise NotImplementedError(f"fusedopt_torch.{self._name}: decoupled_weight_decay must be the same in "
                                      "every parameter group (one engine per optimizer)")
        return "adamw" if flags == {True} else "adam"

    def _state_keys(self, group):
        keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")
        if group.get("master_weights", False):
            return keys + ("master",)
        return keys + ("kahan_comp",) if group.get("kahan", False) else keys

    def _layout_bits(self, group, p):
        low = p.dtype in (torch.bfloat16, torch.float16)
        return ((_LAYOUT["amsgrad"] if group["amsgrad"] else 0)
                | (_LAYOUT["kahan"] if group.get("kahan", False) and low else 0)
                | (_LAYOUT["master"] if group.get("master_weights", False) and low else 0))

    def _new_state(self, p, group, key):
        if not group.get("master_weights", False):
            return super()._new_state(p, group, key)
        if key == "master":
            return p.detach().to(dtype=torch.float32, copy=True, memory_format=torch.preserve_format)
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    def load_state_dict(self, state_dict):
        # master_weights: every state but the step count (torch's to place) stays float32 (torch
        # would cast them to the parameter's dtype).
        if not any(g.get("master_weights", False) for g in state_dict["param_groups"]):
            return super().load_state_dict(state_dict)
        return _load_keeping_float32(self, state_dict, lambda group, key: group.get("master_weights", False)
                                     and key != self._step_key, super().load_state_dict)

    def _hyper(self, group):
        b1, b2 = group["betas"]
        return _hyper(group, beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                      amsgrad=bool(group["amsgrad"]), maximize=bool(group.get("maximize", False)))


class AdamW(Adam):
    """torch.optim.AdamW (decoupled weight decay, default 1e-2): Adam(decoupled_weight_decay=True)."""

    _family = "adamw"
    _name = "AdamW"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None, kahan=False,
                 stochastic_rounding=False, master_weights=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         foreach=foreach, maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True, kahan=kahan,
                         stochastic_rounding=stochastic_rounding, master_weights=master_weights)


class Adagrad(FusedOptimizer):
    """torch.optim.Adagrad (lr_decay, weight decay, initial_accumulator_value, maximize).

    As torch, the state ('step', 'sum') is created for every parameter in the constructor.
    """

    _family = "adagrad"
    _amp_protocol = True

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None):
        _check_common(lr=lr, eps=eps, weight_decay=weight_decay)
        if not 0.0 <= lr_decay:
            raise ValueError(f"Invalid lr_decay value: {lr_decay}")
        if not 0.0 <= initial_accumulator_value:
            raise ValueError(f"Invalid initial_accumulator_value value: {initial_accumulator_value}")
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, foreach=foreach, maximize=maximize,
                        differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)
        _check_fused_flags(fused, foreach, differentiable)
        _reject_unsupported("Adagrad", differentiable=differentiable)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                state["sum"] = self._new_state(p, group, "sum")

    def _state_keys(self, group):
        return ("sum",)

    def _new_state(self, p, group, key):
        value = group["initial_accumulator_value"]
        if torch.is_complex(p):
            value = complex(value, value)  # as torch: the real view starts at the value in both parts
        return torch.full_like(p, value, memory_format=torch.preserve_format)

    def _hyper(self, group):
        return _hyper(group, eps=group["eps"], weight_decay=group["weight_decay"], lr_decay=group["lr_decay"],
                      maximize=bool(group.get("maximize", False)))


class RMSprop(FusedOptimizer):
    """torch.optim.RMSprop (alpha, centered, momentum, weight decay, maximize)."""

    _family = "rmsprop"
    _sparse_error = "RMSprop does not support sparse gradients"

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False,
                 capturable=False, foreach=None, maximize=False, differentiable=False):
        _check_common(lr=lr, eps=eps, weight_decay=weight_decay)
        if not 0.0 <= momentum:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if not 0.0 <= alpha:
            raise ValueError(f"Invalid alpha value: {alpha}")
        _reject_unsupported("RMSprop", differentiable)
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

    def _layout_bits(self, group, p):
        return (_LAYOUT["momentum"] if group["momentum"] > 0 else 0) | (_LAYOUT["centered"] if group["centered"] else 0)

    def _hyper(self, group):
        return _hyper(group, alpha=group["alpha"], eps=group["eps"], weight_decay=group["weight_decay"],
                      momentum=group["momentum"], centered=bool(group["centered"]), maximize=bool(group.get("maximize", False)))


class RAdam(FusedOptimizer):
    """torch.optim.RAdam (L2 or decoupled weight decay, maximize)."""

    _family = "radam"
    _sparse_error = "RAdam does not support sparse gradients"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, decoupled_weight_decay=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False):
        _check_common(lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        _reject_unsupported("RAdam", differentiable)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach, maximize=maximize,
                        capturable=capturable, decoupled_weight_decay=decoupled_weight_decay,
                        differentiable=differentiable)
        super().__init__(params, defaults)

    def _state_keys(self, group):
        return ("exp_avg", "exp_avg_sq")

    def _hyper(self, group):
        b1, b2 = group["betas"]
        return _hyper(group, beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                      decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)), maximize=bool(group.get("maximize", False)))


class Adamax(FusedOptimizer):
    """torch.optim.Adamax (weight decay, maximize)."""

    _family = "adamax"
    _sparse_error = "Adamax does not support sparse gradients"

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, foreach=None, *, maximize=False,
                 differentiable=False, capturable=False):
        _check_common(lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        _reject_unsupported("Adamax", differentiable)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach, maximize=maximize,
                        differentiable=differentiable, capturable=capturable)
        super().__init__(params, defaults)

    def _state_keys(self, group):
        return ("exp_avg", "exp_inf")

    def _hyper(self, group):
        b1, b2 = group["betas"]
        return _hyper(group, beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"], maximize=bool(group.get("maximize", False)))


class Adadelta(FusedOptimizer):
    """torch.optim.Adadelta (rho, weight decay, maximize)."""

    _family = "adadelta"
    _sparse_error = "Adadelta does not support sparse gradients"

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0, foreach=None, *, capturable=False,
                 maximize=False, differentiable=False):
        _check_common(lr=lr, eps=eps, weight_decay=weight_decay)
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"Invalid rho value: {rho}")
        _reject_unsupported("Adadelta", differentiable)
        defaults = dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize, capturable=capturable,
                        foreach=foreach, differentiable=differentiable)
        super().__init__(params, defaults)

    def _state_keys(self, group):
        return ("square_avg", "acc_delta")

    def _hyper(self, group):
        return _hyper(group, rho=group["rho"], eps=group["eps"], weight_decay=group["weight_decay"], maximize=bool(group.get("maximize", False)))


class NAdam(FusedOptimizer):
    """torch.optim.NAdam (momentum_decay, L2 or decoupled weight decay, maximize).

    State as torch's: 'step', 'mu_product' (scalar tensors of torch's step dtype), 'exp_avg',
    'exp_avg_sq'. The engine keeps mu_product per bucket, advancing it with torch's rounding (in
    the bucket's memory, advanced by the step itself, under capturable=True); like 'step' it is
    written back into ``state`` by ``state_dict()``.
    """

    _family = "nadam"
    _mu_key = "mu_product"
    _sparse_error = "NAdam does not support sparse gradients"

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, momentum_decay=4e-3,
                 decoupled_weight_decay=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False):
        _check_common(lr=lr, eps=eps, weight_decay=None, betas=betas)
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not 0.0 <= momentum_decay:
            raise ValueError(f"Invalid momentum_decay value: {momentum_decay}")
        _reject_unsupported("NAdam", differentiable)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum_decay=momentum_decay,
                        decoupled_weight_decay=decoupled_weight_decay, maximize=maximize, foreach=foreach,
                        capturable=capturable, differentiable=differentiable)
        super().__init__(params, defaults)

    def _state_keys(self, group):
        return ("exp_avg", "exp_avg_sq")

    def _hyper(self, group):
        b1, b2 = group["betas"]
        return _hyper(group, beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                      momentum_decay=group["momentum_decay"],
                      decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)), maximize=bool(group.get("maximize", False)))


# ---- optimizers torch does not have ---------------------------------------------------------------


class LAMB(FusedOptimizer):
    """LAMB with apex.optimizers.FusedLAMB's arguments and defaults.

    ``max_grad_norm > 0`` clips the gradients by their global norm first (apex's default 1.0;
    the coefficient is torch's clip_grad_norm_'s ``max_norm / (norm + 1e-6)``, apex divides by
    ``norm / max_norm``). The norm is taken over the parameters of one (group, device, dtype)
    bucket, not over all groups as apex does: identical with one group. State: 'step',
    'exp_avg', 'exp_avg_sq' per parameter (apex counts steps per group).
    """

    _family = "lamb"
    _sparse_error = "LAMB does not support sparse gradients"
    _elementwise = False

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

    def _layout_bits(self, group, p):
        return _LAYOUT["clip"] if (group["max_grad_norm"] or 0.0) > 0 else 0

    def _hyper(self, group):
        b1, b2 = group["betas"]
        return _hyper(group, beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                      max_grad_norm=group["max_grad_norm"] or 0.0, bias_correction=bool(group["bias_correction"]),
                      grad_averaging=bool(group["grad_averaging"]), adam_w_mode=bool(self.adam_w_mode),
                      use_nvlamb=bool(self.use_nvlamb))


class Lion(FusedOptimizer):
    """Lion (Chen et al. 2023) with lion-pytorch's arguments: lr 1e-4, betas (0.9, 0.99),
    decoupled weight_decay 0. State: 'exp_avg' (no step count, as lion-pytorch)."""

    _family = "lion"
    _step_key = None
    _sparse_error = "Lion does not support sparse gradients"

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
        return _hyper(group, beta1=b1, beta2=b2, weight_decay=group["weight_decay"], maximize=bool(group.get("maximize", False)))


# ---- 8-bit states (bitsandbytes' names) -----------------------------------------------------------

# The library's slots that 8-bit states keep with the unsigned map, never negative
# (include/fusedopt/slots.hpp's accepts_unsigned_quantization): the plans bind them so, and
# Python quantizes them alike; every other state takes the signed map.
_UNSIGNED_SLOTS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "exp_inf", "sum_sq", "square_avg", "acc_delta"})


def _signedness(keys):
    """{state: whether its 8-bit form takes the signed map} for the given state names."""
    return {k: k not in _UNSIGNED_SLOTS for k in keys}


# The moments the built-in 8-bit optimizers quantize (first moments and momentum signed).
_MOMENT_SIGNED = _signedness(("exp_avg", "exp_avg_sq", "momentum_buffer"))


_BLOCK = 256  # elements per block of an 8-bit state (csrc/plans.hpp's quantized_block_elements)


def _blocks(numel):
    return (numel + _BLOCK - 1) // _BLOCK


def _state_bytes(numel):
    """The bytes of an 8-bit state of `numel` elements (csrc/plans.hpp's quantized_state_bytes,
    which families.hpp checks against the library's): the blocks' float32 scales padded to a
    multiple of 256 bytes, then 256 codes a block."""
    return (4 * _blocks(numel) + 255) // 256 * 256 + _blocks(numel) * _BLOCK


def _codes_start(numel):
    """Where an 8-bit state's codes start: after its blocks' scales (padded to a multiple of 256 bytes)."""
    return _state_bytes(numel) - _blocks(numel) * _BLOCK


def _zero_state(numel, is_signed, device=None):
    """An 8-bit state of `numel` zeros: every scale 0 and every code that of 0 (127 in the signed map)."""
    state = torch.zeros(_state_bytes(numel), dtype=torch.uint8, device=device)
    if is_signed:
        state[_codes_start(numel):] = 127
    return state


def _from_records(records, numel):
    """An 8-bit state saved by fusedopt_torch before 2026-11-26, ``[blocks, 260]`` records (each
    a float32 scale, then 256 codes in element order), in today's layout: the same scales and
    codes, so the same values bit for bit."""
    blocks, start = records.shape[0], _codes_start(numel)
    state = torch.zeros(_state_bytes(numel), dtype=torch.uint8, device=records.device)
    # The scale of block b 4 (b + 1) bytes before the codes: the scales reversed.
    state[start - 4 * blocks:start] = records[:, :4].flip(0).reshape(-1)
    # Element 128 g + 4 l + k of a block at byte 8 l + 4 g + k of its codes: [g][l][k] -> [l][g][k].
    state[start:] = records[:, 4:].reshape(blocks, 2, 32, 4).permute(0, 2, 1, 3).reshape(-1)
    return state


def quantize_state(values, is_signed):
    """The 8-bit state of `values` (any floating tensor) in fusedopt's blockwise8 layout: a 1-D
    uint8 tensor on values' device; for n = values.numel() and B = ceil(n / 256) blocks of the
    flattened values, 4 B float32 scales (little-endian; block b's at the 4 (b + 1)-th byte
    before the codes) after padding to a multiple of 256 bytes, then 256 codes a block, each
    block's in lane order (element 128 g + 4 l + k at byte 8 l + 4 g + k). The bits are those a
    step stores (fusedopt's quantizer on its host backend; a block with a non-finite value stays
    zero). `is_signed`: the signed map (exp_avg, momentum_buffer), else the unsigned one
    (exp_avg_sq). docs/pytorch.md, "8-bit states"."""
    state = _zero_state(values.numel(), is_signed, values.device)
    _ext.load().quantize_state(values, state, is_signed, _ext.support_unit())
    return state


def dequantize_state(state, shape, is_signed, dtype=torch.float32):
    """The values of an 8-bit state (quantize_state's format) as a step reads them, in `shape`."""
    shape = torch.Size(shape)
    return _ext.load().dequantize_state(state, shape.numel(), is_signed, _ext.support_unit()).view(shape).to(dtype)


class _EightBitStates:
    """The moments of parameters with at least ``min_8bit_size`` elements (a group option,
    default 4096 as bitsandbytes) in 8 bits: ``state[p][key]`` is then a uint8 tensor
    (quantize_state's format) that the engine binds as fusedopt's signed_q8 / unsigned_q8
    storage. Smaller parameters, float64, complex and DTensor ones keep moments of
    the parameter's dtype, as torch does. ``load_state_dict`` converts every moment to the form
    its parameter takes here: full-precision moments (torch.optim's state_dict) are quantized,
    8-bit states kept (or dequantized for a parameter under ``min_8bit_size``; those saved as
    ``[blocks, 260]`` records before 2026-11-26 converted to today's layout first).
    ``_moment_signed``: the 8-bit states by key, and whether each is signed (the map of the
    slot it binds: unsigned for states that are never negative)."""

    _moment_signed = _MOMENT_SIGNED

    def _set_min_8bit_size(self, min_8bit_size):
        """Makes min_8bit_size a default of every group (after the base class's constructor, which
        builds its own defaults). Groups loaded from another optimizer's state_dict lack it: they
        take the default."""
        if not (isinstance(min_8bit_size, int) and min_8bit_size >= 0):
            raise ValueError(f"Invalid min_8bit_size value: {min_8bit_size}")
        self.defaults["min_8bit_size"] = min_8bit_size
        for group in self.param_groups:
            group.setdefault("min_8bit_size", min_8bit_size)

    def _holds_8bit(self, p, group):
        """Whether p's moments are 8-bit (fusedopt computes them in float: not for float64)."""
        return (p.dtype in (torch.float32, torch.float16, torch.bfloat16) and not _is_dtensor(p)
                and p.numel() >= group.get("min_8bit_size", self.defaults["min_8bit_size"]))

    def _new_state(self, p, group, key):
        if key in self._moment_signed and self._holds_8bit(p, group):
            return _zero_state(p.numel(), self._moment_signed[key], p.device)
        return super()._new_state(p, group, key)

    def _layout_bits(self, group, p):
        return super()._layout_bits(group, p) | (_LAYOUT["quantized"] if self._holds_8bit(p, group) else 0)

    def _moment_for(self, p, group, key, value):
        """A loaded moment in the form p's state takes in this optimizer: a new tensor (torch's
        load_state_dict copies the state_dict; the moments are taken from the caller's)."""
        is_signed = self._moment_signed[key]
        if value.dtype == torch.uint8:
            n = p.numel()
            if value.dim() == 2 and tuple(value.shape) == (_blocks(n), 260):
                value = _from_records(value, n)  # saved before 2026-11-26
            elif value.dim() != 1 or value.numel() != _state_bytes(n):
                raise ValueError(f"fusedopt_torch.{type(self).__name__}.load_state_dict: state '{key}' of a "
                                 f"parameter of {n} elements is a uint8 tensor of shape {tuple(value.shape)}, not "
                                 f"an 8-bit state of {_state_bytes(n)} bytes")
            if self._holds_8bit(p, group):
                return value.to(p.device, copy=True)
            return dequantize_state(value.to(p.device), p.shape, is_signed, p.dtype)
        if self._holds_8bit(p, group):
            return quantize_state(value.to(p.device), is_signed)
        return value.to(dtype=p.dtype, device=p.device, copy=True)  # as torch casts its copy of the state

    def load_state_dict(self, state_dict):
        # torch casts every loaded state to its parameter's dtype: the moments are set apart
        # and converted here instead (8-bit states would become floats).
        moments, others = {}, {}
        for i, entries in state_dict["state"].items():
            moments[i] = {k: v for k, v in entries.items() if k in self._moment_signed and isinstance(v, torch.Tensor)}
            others[i] = {k: v for k, v in entries.items() if k not in moments[i]}
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict({**state_dict, "state": others})
        # torch's map from saved ids to parameters (group by group, in order; lengths checked above).
        targets = [(p, g) for g in self.param_groups for p in g["params"]]
        for i, (p, group) in zip(saved_ids, targets):
            for key, value in moments.get(i, {}).items():
                self.state[p][key] = self._moment_for(p, group, key, value)

    def dequantized_state(self, p):
        """``state[p]`` with every 8-bit moment as a tensor of p's shape (float32): what a step reads."""
        return {k: dequantize_state(v, p.shape, self._moment_signed[k])
                if k in self._moment_signed and isinstance(v, torch.Tensor) and v.dtype == torch.uint8 else v
                for k, v in self.state[p].items()}


class Adam8bit(_EightBitStates, Adam):
    """Adam with 8-bit moments (bitsandbytes' Adam8bit; torch.optim.Adam's arguments and
    ``min_8bit_size``). No AMSGrad (NotImplementedError). ``kahan`` and
    ``stochastic_rounding`` as Adam's, for bfloat16 / float16 parameters."""

    _name = "Adam8bit"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 min_8bit_size=4096, foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, kahan=False, stochastic_rounding=False):
        _check_no_amsgrad(self._name, amsgrad)
        # Adam's constructor, also for AdamW8bit (AdamW's passes decoupled_weight_decay=True to it too).
        Adam.__init__(self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                      foreach=foreach, maximize=maximize, capturable=capturable, differentiable=differentiable,
                      fused=fused, decoupled_weight_decay=decoupled_weight_decay, kahan=kahan,
                      stochastic_rounding=stochastic_rounding)
        self._set_min_8bit_size(min_8bit_size)

    def _state_keys(self, group):
        if group["amsgrad"]:
            _check_no_amsgrad(self._name, True)  # set on a group after the constructor
        return super()._state_keys(group)


class AdamW8bit(Adam8bit, AdamW):
    """AdamW with 8-bit moments (bitsandbytes' AdamW8bit; torch.optim.AdamW's arguments and
    ``min_8bit_size``): Adam8bit with decoupled weight decay, default 1e-2."""

    _family = "adamw"
    _name = "AdamW8bit"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 min_8bit_size=4096, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 kahan=False, stochastic_rounding=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         min_8bit_size=min_8bit_size, foreach=foreach, maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused, decoupled_weight_decay=True, kahan=kahan,
                         stochastic_rounding=stochastic_rounding)


class Lion8bit(_EightBitStates, Lion):
    """Lion with an 8-bit exp_avg (bitsandbytes' Lion8bit; Lion's arguments and ``min_8bit_size``)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, min_8bit_size=4096, maximize=False):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        self._set_min_8bit_size(min_8bit_size)


class SGD8bit(_EightBitStates, SGD):
    """SGD with an 8-bit momentum buffer (bitsandbytes' SGD8bit; torch.optim.SGD's arguments and
    ``min_8bit_size``). A momentum is required (in some group), as bitsandbytes': without one
    there is no state; a group without momentum steps as SGD's."""

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 min_8bit_size=4096, maximize=False, foreach=None, differentiable=False, fused=None):
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
                         fused=fused)
        if all(g["momentum"] == 0 for g in self.param_groups):
            raise NotImplementedError("fusedopt_torch.SGD8bit keeps an 8-bit momentum buffer: give it a momentum "
                                      "(use SGD without one)")
        self._set_min_8bit_size(min_8bit_size)


def _check_no_amsgrad(name, amsgrad):
    if amsgrad:
        raise NotImplementedError(f"fusedopt_torch.{name} has no AMSGrad variant (8-bit states): use "
                                  f"{name.replace('8bit', '')} for amsgrad=True")


__all__ = ["FusedOptimizer", "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "RAdam", "NAdam", "Adamax", "Adadelta",
           "LAMB", "Lion", "Adam8bit", "AdamW8bit", "Lion8bit", "SGD8bit", "quantize_state", "dequantize_state"]
