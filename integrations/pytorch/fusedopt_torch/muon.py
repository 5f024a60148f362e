"""Muon, fused (issue 43): ``fusedopt_torch.Muon`` (torch.optim.Muon's constructor, semantics and
state_dict) and ``fusedopt_torch.MuonWithAdamW`` (the form models train with: Muon for the hidden
2-D matrices, AdamW for embeddings, head, norms and biases, in one ``step()``).

A step of a parameter group runs the library's muon plan (fusedopt/cuda/muon.cuh, host/muon.hpp):
one fused pass over every matrix (momentum, Nesterov, the cast to the Newton-Schulz dtype, each
matrix's Frobenius norm), Newton-Schulz batched over the matrices of one shape (cuBLAS
strided-batched GEMMs on the GPU), one fused pass (weight decay, the shape's lr ratio, the
update). torch.optim.Muon runs the same algorithm one matrix at a time. docs/muon.md has the
design and the tolerances (bfloat16 Newton-Schulz is not bit-reproducible across GEMMs).

The plans live in a unit (csrc/muon_unit.hpp) compiled on first use into fusedopt_torch's cache
and called through ctypes (_muon_unit.py): no core, no torch in the unit.
"""
import ctypes
import re

import torch

from . import _ext, _muon_unit
from ._unit_engine import DTYPE_NAMES, UnitEngine, UnitOptimizer, on_device
from .optimizers import AdamW

__all__ = ["Muon", "MuonWithAdamW"]

_NS_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _check_muon_options(lr, weight_decay, momentum, ns_coefficients, ns_steps, adjust_lr_fn, ns_dtype):
    """torch.optim.Muon's checks and messages (and fusedopt's own options)."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 <= momentum:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn is not None and adjust_lr_fn not in ("original", "match_rms_adamw"):
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
    _coefficient_table(ns_coefficients, ns_steps)
    if ns_dtype not in _NS_NAMES:
        raise ValueError(f"ns_dtype must be torch.bfloat16 or torch.float32, not {ns_dtype}")


def _coefficient_table(ns_coefficients, ns_steps):
    """The coefficients as (flat list, per_iteration): torch's one (a, b, c) for every iteration,
    or a list of ns_steps triples (Polar Express, Dion: fusedopt's extension)."""
    if not isinstance(ns_steps, int) or isinstance(ns_steps, bool) or ns_steps < 0:
        raise ValueError(f"ns_steps must be a non-negative int, not {ns_steps!r}")
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    values = list(ns_coefficients)
    if values and all(isinstance(v, (tuple, list)) for v in values):
        if len(values) != ns_steps or any(len(v) != 3 for v in values):
            raise ValueError(f"Per-iteration ns_coefficients must be {ns_steps} triples (one per Newton-Schulz step)")
        return [float(x) for v in values for x in v], True
    if len(values) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    return [float(x) for x in values], False


def _check_2d(p):
    if p.ndim != 2:
        raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()}")


class _Bucket:
    """The parameters of one group on one device and of one dtype, and their muon plan."""

    __slots__ = ("params", "device", "dtype", "plan", "grads", "table", "scalars")

    def __init__(self, params, device, dtype):
        self.params, self.device, self.dtype = params, device, dtype
        self.plan = self.grads = self.table = None
        self.scalars = torch.zeros(3, dtype=torch.float64, device=device)


class _MuonEngine(UnitEngine):
    """The muon plans of parameter groups: one per (group, device, dtype), rebuilt when the set of
    parameters with a gradient, their addresses or ns_dtype change, gradients rebound when they
    move (_unit_engine.UnitEngine)."""

    name = "Muon"

    def step(self, groups, state, group_indices):
        for gi, group in zip(group_indices, groups):
            table, per_iteration = _coefficient_table(group["ns_coefficients"], group["ns_steps"])
            params = [p for p in group["params"] if p.grad is not None]
            known = self.group_plans(gi, params, state, group.get("ns_dtype", torch.bfloat16))
            for bucket in known.buckets:
                self._run(bucket, group, table, per_iteration)

    def plan_buckets(self, params, state, ns_dtype):
        members = {}
        for p in params:
            _check_2d(p)
            st = state[p]
            buffer = st.get("momentum_buffer")
            if buffer is None:
                buffer = st["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.contiguous_format)
            if not buffer.is_contiguous() or buffer.shape != p.shape or buffer.dtype != p.dtype:
                raise RuntimeError("fusedopt_torch.Muon: a momentum_buffer must be contiguous, of its parameter's shape "
                                   "and dtype")
            members.setdefault((p.device, p.dtype), []).append(p)
        buckets = []
        for (device, dtype), group in members.items():
            bucket = _Bucket(group, device, dtype)
            cuda = device.type == "cuda"
            with on_device(device) as stream:
                if cuda and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("fusedopt_torch.Muon: the first step of a set of parameters cannot be captured "
                                       "(its plan is built then): run one step before capturing, as for torch's "
                                       "capturable optimizers")
                unit = _muon_unit.unit("cuda" if cuda else "host", DTYPE_NAMES[dtype], _NS_NAMES[ns_dtype],
                                       (_ext.arch_of(device.index),) if cuda else ())
                bucket.grads = [p.grad.data_ptr() for p in group]
                bucket.plan = _muon_unit.Plan(unit, [p.data_ptr() for p in group], bucket.grads,
                                              [state[p]["momentum_buffer"].data_ptr() for p in group],
                                              [p.numel() for p in group], [tuple(p.shape) for p in group], 0, stream)
            self.builds += 1
            buckets.append(bucket)
        return buckets

    def _run(self, bucket, group, table, per_iteration):
        with on_device(bucket.device) as stream:
            grads = [p.grad.data_ptr() for p in bucket.params]
            if grads != bucket.grads:
                bucket.plan.rebind_grads(grads, stream)
                bucket.grads = grads
            if bucket.table is None or bucket.table[0] != table:
                bucket.table = (table, (ctypes.c_double * len(table))(*table))  # kept alive with the plan
            hyper = _muon_unit.Hyper(eps=float(group["eps"]), coefficients=ctypes.addressof(bucket.table[1]),
                                     per_iteration=int(per_iteration), ns_steps=int(group["ns_steps"]),
                                     nesterov=int(bool(group["nesterov"])),
                                     match_rms_adamw=int(group["adjust_lr_fn"] == "match_rms_adamw"))
            values = (group["lr"], group["weight_decay"], group["momentum"])
            if any(isinstance(v, torch.Tensor) for v in values):
                # Tensors are read on the device at every step (a captured graph sees a scheduler's
                # lr): copied in stream order into the plan's three doubles.
                scalars = bucket.scalars
                for k, v in enumerate(values):  # copy_ and fill_ are kernels: capturable
                    scalars[k].copy_(v) if isinstance(v, torch.Tensor) else scalars[k].fill_(float(v))
                base = scalars.data_ptr()
                hyper.lr_pointer, hyper.weight_decay_pointer, hyper.momentum_pointer = base, base + 8, base + 16
            else:
                hyper.lr, hyper.weight_decay, hyper.momentum = (float(v) for v in values)
            bucket.plan.run(hyper, stream)


class Muon(UnitOptimizer):
    """torch.optim.Muon, fused: the same constructor, checks, algorithm and state_dict
    (``state[p]['momentum_buffer']``), for 2-D parameters only.

    Beyond torch: ``ns_dtype`` (torch.bfloat16 as torch, or torch.float32 for an exact-to-float
    iteration), ``ns_coefficients`` may be a list of ``ns_steps`` triples (per-iteration
    coefficients, Polar Express style), parameters may be float32, float64, float16 or bfloat16
    (the buffer has the gradient's dtype, as in torch), and a step can be captured in a CUDA
    graph after a first eager step (lr, weight_decay and momentum given as Tensors are read on
    the device at every replay). CPU tensors step on the host backend.
    """

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 ns_dtype=torch.bfloat16):
        _check_muon_options(lr, weight_decay, momentum, ns_coefficients, ns_steps, adjust_lr_fn, ns_dtype)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        ns_dtype=ns_dtype)
        super().__init__(params, defaults)  # each group checked by add_param_group

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_muon_options(group["lr"], group["weight_decay"], group["momentum"], group["ns_coefficients"],
                            group["ns_steps"], group["adjust_lr_fn"], group.get("ns_dtype", torch.bfloat16))
        for p in group["params"]:
            _check_2d(p)

    def _new_engine(self):  # plans per group, device and dtype
        return _MuonEngine()

    def _engine_step(self):
        self._engine.step(self.param_groups, self.state, range(len(self.param_groups)))

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)  # through __setstate__: new buffers, new plans
        for group in self.param_groups:
            group.setdefault("ns_dtype", torch.bfloat16)  # torch.optim.Muon's state_dict has none


# Names of 2-D parameters that are not hidden matrices (embeddings, output heads): AdamW takes them.
_NOT_HIDDEN = re.compile(r"(^|\.)(wte|wpe|lm_head|head|output|classifier|[^.]*embed[^.]*)(\.|$)")


def default_use_muon(name, p):
    """MuonWithAdamW's default split: Muon for 2-D parameters, but for those whose name says they
    are an embedding or an output head (wte, wpe, lm_head, head, output, classifier, *embed*)."""
    return p.ndim == 2 and (name is None or not _NOT_HIDDEN.search(name))


class MuonWithAdamW(UnitOptimizer):
    """Muon for the hidden 2-D matrices and AdamW for everything else, in one ``step()``: the form
    Muon is trained with (Keller Jordan's MuonWithAuxAdam, Moonlight, modded-nanogpt).

    params: ``model.named_parameters()`` (split by ``default_use_muon``: 2-D weights to Muon, but
    embeddings and heads by name), plain tensors (2-D ones to Muon), or groups (dicts) that may
    say ``use_muon``. Muon groups take Muon's options (``lr``, ``weight_decay``, ``momentum``, ...),
    AdamW groups AdamW's (``lr``, ``betas``, ``eps``, ``weight_decay``): the keyword arguments are
    the defaults of each kind. The AdamW part is fusedopt_torch.AdamW (one fused launch per group
    and dtype); the state_dict holds both parts' states in torch's layouts.
    """

    def __init__(self, params, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 adamw_lr=3e-4, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=0.0,
                 ns_dtype=torch.bfloat16, use_muon=default_use_muon):
        _check_muon_options(lr, weight_decay, momentum, ns_coefficients, ns_steps, adjust_lr_fn, ns_dtype)
        self._muon_defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                   ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                                   adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype)
        self._adamw_defaults = dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)
        self._adamw = None
        super().__init__(self._split(params, use_muon), dict(use_muon=True))

    @staticmethod
    def _split(params, use_muon):
        if isinstance(params, torch.Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                            f"but got {torch.typename(params)}")
        items = list(params)
        if not items:
            raise ValueError("optimizer got an empty parameter list")
        if all(isinstance(i, dict) for i in items):
            groups = []
            for g in items:
                g = dict(g)
                if "use_muon" not in g:
                    ps = list(g["params"]) if not isinstance(g["params"], torch.Tensor) else [g["params"]]
                    g["params"] = ps
                    g["use_muon"] = all(p.ndim == 2 for p in ps)
                groups.append(g)
            return groups
        muon, adamw = [], []
        for item in items:
            name, p = item if isinstance(item, tuple) else (None, item)
            (muon if use_muon(name, p) else adamw).append(p)
        return [g for g in (dict(params=muon, use_muon=True), dict(params=adamw, use_muon=False)) if g["params"]]

    def add_param_group(self, param_group):
        param_group = dict(param_group)
        param_group.setdefault("use_muon", True)
        for k, v in (self._muon_defaults if param_group["use_muon"] else self._adamw_defaults).items():
            param_group.setdefault(k, v)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["use_muon"]:
            _check_muon_options(group["lr"], group["weight_decay"], group["momentum"], group["ns_coefficients"],
                                group["ns_steps"], group["adjust_lr_fn"], group.get("ns_dtype", torch.bfloat16))
            for p in group["params"]:
                _check_2d(p)
        self._link()

    def _link(self):
        """Points the AdamW part at this optimizer's AdamW groups and state (the same objects)."""
        groups = [g for g in self.param_groups if not g["use_muon"]]
        if not groups:
            return
        if self._adamw is None:
            self._adamw = AdamW(groups, **self._adamw_defaults)  # fills AdamW's remaining keys in place
        else:
            for g in groups:
                if not any(g is h for h in self._adamw.param_groups):
                    for k, v in self._adamw.defaults.items():
                        g.setdefault(k, v)
            if len(groups) != len(self._adamw.param_groups) or any(
                    a is not b for a, b in zip(groups, self._adamw.param_groups)):
                self._adamw.param_groups = groups
                self._adamw._dirty = True
        self._adamw.state = self.state

    def _new_engine(self):
        return _MuonEngine()

    def _engine_step(self):
        muon = [(k, g) for k, g in enumerate(self.param_groups) if g["use_muon"]]
        if muon:
            self._engine.step([g for _, g in muon], self.state, [k for k, _ in muon])
        if self._adamw is not None:
            self._adamw.step()

    def state_dict(self):
        if self._adamw is not None:
            self._adamw._pull_steps()  # the AdamW part's step counts, kept by its engine
        return super().state_dict()

    def __getstate__(self):
        if self._adamw is not None:
            self._adamw._pull_steps()
        # torch pickles defaults, state and param_groups: each kind's defaults, for _link.
        return dict(super().__getstate__(), _muon_defaults=self._muon_defaults, _adamw_defaults=self._adamw_defaults)

    def __setstate__(self, state):
        # Also load_state_dict's way of installing the loaded groups: a new AdamW part over them.
        super().__setstate__(state)
        self._adamw = None
        self._link()
