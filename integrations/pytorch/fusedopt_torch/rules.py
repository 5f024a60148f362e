"""Optimizers of your own, fused: ``fusedopt_torch.rule(...)`` turns a few lines of C++ (the update
of one element) into a ``torch.optim.Optimizer`` class that runs them as one fused kernel over
every parameter, with everything the built-in optimizers have (param groups, state_dict in
torch's layout, LR schedulers, capturable CUDA graphs, GradScaler's fused protocol, DTensor
shards, CPU tensors, float16/bfloat16 parameters).

    Sign = fusedopt_torch.rule(
        "SignMomentum",
        hypers=dict(lr=1e-3, beta=0.9, weight_decay=0.0),
        states=dict(momentum_buffer=0.0),
        body='''
            momentum_buffer = beta * momentum_buffer + (1 - beta) * grad;
            param -= lr * (sign(momentum_buffer) + weight_decay * param);
        ''')
    opt = Sign(model.parameters(), lr=3e-4)

The rule is compiled when a step first needs it, for the device and dtype in use, into a cache
(_build.py): seconds the first time, nothing afterwards, in this process or the next.
docs/pytorch.md, "Write your own optimizer", is the guide.
"""

import os
from pathlib import Path

import torch

from . import _build, _codegen, _ext
from .optimizers import _DTYPE_INDEX, FusedOptimizer, _EightBitStates, _is_dtensor, _load_keeping_float32, _signedness

__all__ = ["rule", "State", "RuleOptimizer", "RuleCompileError"]

_DTYPE_NAMES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                "bfloat16": torch.bfloat16}


class RuleCompileError(RuntimeError):
    """A rule did not compile: the message quotes the compiler's errors about the rule's own
    lines (numbered as in the text given) and the library's static_assert messages; `log` holds
    the whole compiler output."""

    def __init__(self, message, log=""):
        super().__init__(message)
        self.log = log


class State:
    """A state tensor of a rule (one per parameter, ``optimizer.state[p][name]``).

    init: what a new state holds: a number (every element), ``"param"`` (a copy of the parameter,
        e.g. Schedule-Free's z), or a callable ``init(p) -> Tensor`` of p's shape.
    dtype: ``"param"`` (the parameter's dtype, as torch's optimizers) or ``"float32"`` (float32
        whatever the parameter's dtype: bfloat16 parameters with float32 moments).
    readonly: the body reads it and never writes it (its store is skipped: fewer bytes).
    """

    def __init__(self, init=0.0, dtype="param", readonly=False):
        if dtype not in ("param", "float32"):
            raise ValueError(f"State dtype must be 'param' or 'float32', not {dtype!r}")
        if not (isinstance(init, (int, float)) and not isinstance(init, bool) or init == "param" or callable(init)):
            raise ValueError(f"State init must be a number, 'param' or a callable, not {init!r}")
        self.init, self.dtype, self.readonly = init, dtype, bool(readonly)

    def __repr__(self):
        return f"State(init={self.init!r}, dtype={self.dtype!r}, readonly={self.readonly})"


def _text(value, what):
    """A C++ text given as a string or a path to a file."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        return Path(value).read_text()
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string of C++ or a path, not {type(value).__name__}")
    return value


def _dedent(text):
    """The text without the indentation common to its lines (a body written in a triple-quoted
    string), so that line 1 is the first line of code and the columns are the user's."""
    import textwrap

    return textwrap.dedent(text).strip("\n") + "\n" if text is not None else None


def rule(name, *, hypers, body=None, rule=None, states=None, source="", constants=None, reduce=None, amp=True,
         dtypes=("float32", "float64", "float16", "bfloat16"), elementwise=None, eight_bit=False, doc=None):
    """A torch.optim.Optimizer class running a rule of your own as fusedopt's fused step.

    name: the class's name (an identifier).
    hypers: {name: default} of the hyperparameters, in the order the body sees them (at most 32).
        A float default makes a float (per group; a one-element Tensor is read on the device at
        every step, so a captured CUDA graph sees a scheduler's new value); an int an integer; a
        bool a flag. Include ``lr`` for LR schedulers.
    body: the C++ statements that update ONE element (a string, or a path to a file), with in
        scope: ``param`` (assign to update the parameter), ``grad`` (a copy: writes stay local),
        each state by name (assign to update it), each hyperparameter, ``step`` (the 1-based step
        count, an int64), each constant and each reduction (below). Values are of type ``T``:
        float for float32/float16/bfloat16 parameters, double for float64. Functions: sqrt, abs,
        exp, log, tanh, pow, sign, min, max, clamp, where(cond, a, b). Write ``T(0.5)`` rather
        than ``0.5`` to stay in float.
    rule: instead of body, a C++ expression making a fusedopt rule from library blocks and your
        own (declared in `source`), e.g. ``"fo::chain(fo::rules::add_weight_decay{weight_decay},
        my_block{lr})"``; float hyperparameters are ``fo::scalar<double>`` there.
    states: {name: State or init value} of the per-parameter states, in order (library slot
        names such as exp_avg bind the library's slots, others are declared).
    source: C++ put before the rule (helper functions, structs for `rule`).
    constants: {name: expression} computed once per step in double from the hyperparameters and
        ``step`` (bias corrections: ``"1 - pow(beta1, step)"``), in order, each seeing the ones
        before; seen by the body as T.
    reduce: {name: expression or ("sum"|"max", expression)}: a reduction pass before the update,
        over the elements as the body would see them at its start; the body sees ``name`` (the
        result over the element's tensor) and ``name_total`` (over every tensor of the launch:
        one parameter group, device and dtype). No host synchronisation. Such rules do not take
        DTensor shards (a shard is not its tensor).
    amp: take GradScaler's fused protocol (gradients unscaled and the step skipped on inf/NaN
        inside the launch), as torch's fused optimizers do.
    dtypes: the parameter dtypes the rule accepts; others are refused before any step.
    elementwise: whether the rule may step DTensor (FSDP2) shards alone; default: a body
        without reductions is, a `rule` expression is not (it may reduce).
    eight_bit: keep the states of parameters of at least ``min_8bit_size`` elements (a
        constructor argument and group option, default 4096) as 8-bit blockwise states, as the
        built-in 8-bit optimizers do (docs/quantized_states.md): uint8 tensors the step
        dequantizes as it loads and quantizes as it stores, in the same pass. Unsigned for the
        library's never-negative slots (exp_avg_sq, ...), signed otherwise. Every state then,
        each with init 0 and not float32 or read-only; float32, float16 and bfloat16
        parameters (float64 ones and smaller tensors keep full states).
    doc: the class's docstring.

    Returns the class; its constructor is ``Class(params, **hypers)``, plus torch's ``fused``
    (GradScaler's protocol: FusedOptimizer._step_supports_amp_scaling) and ``capturable`` (the step
    count kept on the device, for CUDA graphs). Raises ValueError for an invalid spec now,
    RuleCompileError at the first step if the C++ does not compile.
    """
    if not isinstance(hypers, dict):
        raise TypeError("hypers must be a dict {name: default}")
    spec_hypers = []
    for h, default in hypers.items():
        if isinstance(default, bool):
            kind = "bool"
        elif isinstance(default, int):
            kind = "int"
        elif isinstance(default, float) or (isinstance(default, torch.Tensor) and default.numel() == 1):
            kind = "float"
        else:
            raise TypeError(f"rule {name}: hyperparameter {h!r} has default {default!r}: give a float, an int, a bool "
                            "or a one-element Tensor")
        spec_hypers.append(_codegen.Hyper(h, kind, default))
    state_specs = {}
    for s, value in (states or {}).items():
        state_specs[s] = value if isinstance(value, State) else State(init=value)
    if eight_bit:
        nonzero = [s for s, v in state_specs.items() if not (isinstance(v.init, (int, float)) and v.init == 0)]
        if nonzero:
            raise ValueError(f"rule {name}: with eight_bit=True every state starts at 0; {nonzero} do not")
    reductions = []
    for r, value in (reduce or {}).items():
        op, expr = ("sum", value) if isinstance(value, str) else tuple(value)
        reductions.append(_codegen.Reduce(r, op, expr))
    spec = _codegen.RuleSpec(
        name=name, hypers=spec_hypers,
        states=[_codegen.State(s, float32=v.dtype == "float32", readonly=v.readonly) for s, v in state_specs.items()],
        body=_dedent(_text(body, "body")), expression=_text(rule, "rule"), source=_dedent(_text(source, "source")) or "",
        constants=[(c, e) for c, e in (constants or {}).items()], reductions=reductions, amp=bool(amp),
        eight_bit=bool(eight_bit))
    try:
        spec.validate()
    except _codegen.RuleSpecError as e:
        raise ValueError(str(e)) from None
    accepted = tuple(_DTYPE_NAMES[d] if isinstance(d, str) else d for d in dtypes)
    if elementwise is None:
        elementwise = spec.body is not None and not spec.reductions
    attributes = dict(_spec=spec, _states=state_specs, _dtypes=accepted, _elementwise=bool(elementwise),
                      _amp_protocol=bool(amp), __doc__=doc or f"The user rule {name} (fusedopt_torch.rule).",
                      __module__=__name__)
    if eight_bit:
        attributes["_moment_signed"] = _signedness(state_specs)
        return type(name, (_EightBitStates, RuleOptimizer), attributes)
    return type(name, (RuleOptimizer,), attributes)


def _rule_source(spec):
    def source(backend, only):
        words = f"rule {spec.name} ({_codegen.DTYPES[only.dtype]}{', GradScaler' if only.amp else ''})"
        return f"rule-{spec.name}-{only.tag()}", _codegen.rule_source(spec, backend, only), words

    return source


class _RuleProvider(_ext.Provider):
    """A rule's units; a compile error becomes a RuleCompileError in the user's terms."""

    def __init__(self, spec):
        super().__init__(_rule_source(spec))
        self._spec = spec

    def _path(self, backend, archs, only):
        try:
            return super()._path(backend, archs, only)
        except _build.BuildError as e:
            details = _codegen.compile_error_message(self._spec, e.log)
            raise RuleCompileError(f"fusedopt_torch: rule {self._spec.name} does not compile ({backend}):\n{details}\n"
                                   f"(the whole compiler output: {e.log_path})", e.log) from None


class RuleOptimizer(FusedOptimizer):
    """The base of the classes fusedopt_torch.rule() makes: the rule's hyperparameters as the
    groups' options, its states as torch's per-parameter state (plus 'step')."""

    _family = "user"
    _spec = None
    _states = {}
    _dtypes = ()
    _providers = {}  # per class: every optimizer of a rule shares its units

    def __init__(self, params, fused=None, capturable=False, **kwargs):
        spec = self._spec
        min_8bit_size = kwargs.pop("min_8bit_size", 4096) if spec.eight_bit else None
        known = {h.name for h in spec.hypers}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected hyperparameters {sorted(unknown)} "
                            f"(its hyperparameters: {[h.name for h in spec.hypers]})")
        defaults = {h.name: kwargs.get(h.name, h.default) for h in spec.hypers}
        defaults.update(fused=fused, capturable=capturable)
        self._check_values(defaults, "defaults")
        super().__init__(params, defaults)
        if spec.eight_bit:
            self._set_min_8bit_size(min_8bit_size)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        self._check_values(self.param_groups[-1], f"group {len(self.param_groups) - 1}")

    def _check_values(self, group, where):
        """Refuses a hyperparameter of the wrong type before anything runs."""
        for h in self._spec.hypers:
            value = group.get(h.name)
            if h.kind == "float":
                ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
                    isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point())
                expected = "a float or a one-element floating-point Tensor"
            elif h.kind == "int":
                ok = isinstance(value, int) and not isinstance(value, bool)
                expected = "an int"
            else:
                ok = isinstance(value, bool)
                expected = "a bool"
            if not ok:
                raise TypeError(f"{type(self).__name__}: hyperparameter '{h.name}' ({where}) must be {expected}, not "
                                f"{type(value).__name__} {value!r}")

    @classmethod
    def _rule_provider(cls):
        if cls not in RuleOptimizer._providers:
            RuleOptimizer._providers[cls] = _RuleProvider(cls._spec)
        return RuleOptimizer._providers[cls]

    def _provider(self, family):
        return self._rule_provider()

    def _make_engine(self, family):
        super()._make_engine(family)
        self._engine.set_float_states(self._spec.float_mask)

    def _state_keys(self, group):
        return tuple(self._states)

    def _new_state(self, p, group, key):
        s = self._states[key]
        dtype = torch.float32 if s.dtype == "float32" else p.dtype
        if s.init == "param":
            return p.detach().to(dtype=dtype, copy=True, memory_format=torch.preserve_format)
        if callable(s.init):
            value = s.init(p)
            if not isinstance(value, torch.Tensor) or value.shape != p.shape:
                raise ValueError(f"{type(self).__name__}: state '{key}' init returned {value!r}, not a tensor of the "
                                 f"parameter's shape {tuple(p.shape)}")
            return value.detach().to(device=p.device, dtype=dtype, memory_format=torch.preserve_format).clone()
        return torch.full_like(p, s.init, dtype=dtype, memory_format=torch.preserve_format)

    def _accepts(self, p):
        return (torch.view_as_real(p.detach()).dtype if p.is_complex() else p.dtype) in self._dtypes

    def _rebuild(self):
        for group in self.param_groups:
            self._check_values(group, "a parameter group")
            for p in group["params"]:
                if p.grad is not None and not self._accepts(p):
                    names = ", ".join(str(d).replace("torch.", "") for d in self._dtypes)
                    raise TypeError(f"{type(self).__name__}: the rule takes parameters of dtype {names}, not "
                                    f"{str(p.dtype).replace('torch.', '')}")
                if p.is_complex() and self._spec.float_mask:
                    raise TypeError(f"{type(self).__name__}: complex parameters with float32 states are not supported")
                if _is_dtensor(p) and not self._elementwise:
                    raise NotImplementedError(f"{type(self).__name__}: a rule with reductions (or a rule= expression "
                                              "not declared elementwise) does not take DTensor (FSDP2) shards")
        super()._rebuild()

    def _hyper(self, group):
        values = []
        for h in self._spec.hypers:
            v = group[h.name]
            values.append(0.0 if isinstance(v, torch.Tensor) else float(v))
        lr = group.get("lr", 0.0)
        return _ext.load().Hyper.of(lr=0.0 if isinstance(lr, torch.Tensor) else float(lr), user=values)

    def _tensor_hypers(self, group):
        found = None
        for k, h in enumerate(self._spec.hypers):
            v = group[h.name]
            if isinstance(v, torch.Tensor):
                if h.kind != "float":
                    raise TypeError(f"{type(self).__name__}: hyperparameter '{h.name}' is {h.kind}, not a Tensor")
                found = found or []
                found.append((k, v))
        return found

    def load_state_dict(self, state_dict):
        # torch casts every floating state to its parameter's dtype: float32 states of bfloat16
        # parameters are set apart and restored in float32 instead.
        kept = {k for k, s in self._states.items() if s.dtype == "float32"}
        if not kept:
            return super().load_state_dict(state_dict)
        return _load_keeping_float32(self, state_dict, lambda group, key: key in kept, super().load_state_dict)

    @classmethod
    def compile(cls, device="cuda", dtype=torch.float32, amp=False):
        """Compiles the rule's unit for `device` and `dtype` now, rather than at the first step
        that needs it (from the cache where it is there), and returns its path. Raises
        RuleCompileError."""
        device = torch.device(device)
        index = -1 if device.type == "cpu" else (device.index if device.index is not None
                                                 else torch.cuda.current_device())
        provider = cls._rule_provider()
        return provider._path(*provider._target(index, _DTYPE_INDEX[dtype], 0, amp))
