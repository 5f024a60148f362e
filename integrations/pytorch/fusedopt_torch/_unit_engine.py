"""What the optimizers over ctypes units share (muon.py, adafactor.py, came.py): torch's checks of a
parameter and its gradient, the device and stream a unit's plan runs on, the per-group
bookkeeping that makes a step cheap on the host when the parameters are those of the last step,
and a bucket of one device and dtype whose plan rebinds moved gradients and reads an lr given as
a Tensor on the device (adafactor.py, came.py)."""
import contextlib

import torch

from . import _ext

DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
               torch.bfloat16: "bfloat16"}


def check_grad(p, name):
    """torch's error for a sparse gradient, and fusedopt's for one a plan cannot bind."""
    g = p.grad
    if g.is_sparse:
        raise RuntimeError(f"{name} does not support sparse gradients")
    if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
        raise RuntimeError(f"fusedopt_torch.{name}: a gradient of shape {tuple(g.shape)}, {g.dtype} on {g.device} for a "
                           f"parameter of shape {tuple(p.shape)}, {p.dtype} on {p.device}")
    if not g.is_contiguous():
        raise RuntimeError(f"fusedopt_torch.{name}: gradients must be contiguous")


def check_param(p, name):
    """torch's error for a complex parameter, then fusedopt's for one a plan cannot bind."""
    if torch.is_complex(p):
        raise RuntimeError(f"{name} does not support complex parameters")
    check_grad(p, name)
    if p.dtype not in DTYPE_NAMES:
        raise RuntimeError(f"fusedopt_torch.{name}: parameters of dtype {p.dtype} are not supported")
    if p.device.type not in ("cuda", "cpu"):
        raise RuntimeError(f"fusedopt_torch.{name}: tensors on {p.device} are not supported (CUDA or CPU)")
    if not p.is_contiguous():
        raise RuntimeError(f"fusedopt_torch.{name}: parameters must be contiguous")


@contextlib.contextmanager
def on_device(device):
    """The context a plan is made and run in: `device` current (CUDA), and its current stream as
    an int (0 on the CPU)."""
    if device.type != "cuda":
        yield 0
        return
    with torch.cuda.device(device):
        yield torch.cuda.current_stream(device).cuda_stream


def refuse_capture(name, why):
    """fusedopt's error for a step under CUDA graph capture, `why` saying what is kept on the host."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"fusedopt_torch.{name}: a step cannot be captured in a CUDA graph ({why})")


def state_tensors_fit(tensors, shapes, dtype, device):
    """Whether each of `tensors` is a contiguous tensor of its shape in `shapes`, of `dtype`, on
    `device` (what a plan binds of a parameter's state)."""
    return all(torch.is_tensor(t) and tuple(t.shape) == tuple(shape) and t.dtype == dtype and t.device == device
               and t.is_contiguous() for t, shape in zip(tensors, shapes))


BUILT_BEFORE_CAPTURE = "its plans are built outside a capture: run one ordinary step before capturing"


def capturable(group):
    """Whether a parameter group asked for capturable=True (a key of fusedopt's, which the groups
    hold only when asked: otherwise they stay the reference's, for state_dict parity)."""
    return bool(group.get("capturable", False))


class DeviceCount:
    """A step count in device memory (an int64 on `device`), for a capturable plan: advance()
    adds 1 in stream order and returns its address, which the plan reads when the step runs, so
    that a replayed CUDA graph counts its own steps; value() reads it back (synchronising)."""

    __slots__ = ("tensor",)

    def __init__(self, value, device):
        self.tensor = torch.tensor(int(value), dtype=torch.int64, device=device)

    def advance(self):
        self.tensor.add_(1)
        return self.tensor.data_ptr()

    def value(self):
        return int(self.tensor.item())


class UnitBucket:
    """The parameters of one group with one device and dtype that step in one plan of a ctypes
    unit (over those of them that are not empty: an empty tensor has nothing to step), the
    gradients' addresses the plan holds, and one double on the device for an lr given as a
    Tensor (or one the unit refuses as a value). Subclasses add their own slots."""

    __slots__ = ("params", "planned", "device", "dtype", "plan", "grads", "scalars")

    def __init__(self, params, device, dtype):
        self.params, self.device, self.dtype = params, device, dtype
        self.planned = [p for p in params if p.numel() > 0]
        self.plan = self.grads = None
        self.scalars = torch.zeros(1, dtype=torch.float64, device=device)

    def make_plan(self, name, module, make):
        """self.plan = make(unit, stream): `module`'s unit (_adafactor_unit, _came_unit) for the
        bucket's device and dtype, made on its device and current stream, the gradients'
        addresses in self.grads; refused under CUDA graph capture (optimizer `name`)."""
        cuda = self.device.type == "cuda"
        with on_device(self.device) as stream:
            if cuda:
                refuse_capture(name, BUILT_BEFORE_CAPTURE)
            unit = module.unit("cuda" if cuda else "host", DTYPE_NAMES[self.dtype],
                               (_ext.arch_of(self.device.index),) if cuda else ())
            self.grads = [p.grad.data_ptr() for p in self.planned]
            self.plan = make(unit, stream)

    def run(self, name, why, hyper, lr, lr_by_value=True, capturable=False):
        """One step of the plan (if any) with `hyper` (a unit's ctypes structure with lr and
        lr_pointer) on the device's current stream, after rebinding gradients that moved. A
        Tensor lr, or any lr when not `lr_by_value`, is written into self.scalars in stream order
        (no sync) and read by the step through lr_pointer. Refused under CUDA graph capture unless
        `capturable` (everything the step reads per step is then device memory)."""
        if self.plan is None:
            return
        with on_device(self.device) as stream:
            if self.device.type == "cuda" and not capturable:
                refuse_capture(name, why)
            grads = [p.grad.data_ptr() for p in self.planned]
            if grads != self.grads:
                self.plan.rebind_grads(grads, stream)
                self.grads = grads
            if isinstance(lr, torch.Tensor):  # read where the step runs, in stream order: no sync
                self.scalars.copy_(lr.reshape(1))
                hyper.lr_pointer = self.scalars.data_ptr()
            elif not lr_by_value:
                self.scalars.fill_(float(lr))
                hyper.lr_pointer = self.scalars.data_ptr()
            else:
                hyper.lr = float(lr)
            self.plan.run(hyper, stream)  # refused options raise before anything is written


class GroupPlans:
    """A group's parameters with a gradient at the last step, their addresses, the option `key`
    the plans depend on, and the plans' buckets."""

    __slots__ = ("params", "addresses", "grads", "key", "buckets")

    def __init__(self, params, key, buckets):
        self.params, self.key, self.buckets = params, key, buckets
        self.grads = [p.grad for p in params]
        self.addresses = [p.data_ptr() for p in params]


class UnitEngine:
    """Plans per parameter group: `plan_buckets(params, state, key)` (the subclass's) makes them
    when the group's parameters with a gradient, their addresses or `key` changed; otherwise a
    step checks only gradients that are new tensors (zero_grad(set_to_none=True)). `name` is the
    optimizer's, for messages."""

    name = None

    def __init__(self):
        self.groups = {}  # group index -> GroupPlans
        self.builds = 0

    def group_plans(self, index, params, state, key=None):
        known = self.groups.get(index)
        if (known is None or known.key != key or len(params) != len(known.params)
                or any(p is not q for p, q in zip(params, known.params))
                or [p.data_ptr() for p in params] != known.addresses):
            for p in params:
                check_param(p, self.name)
            known = self.groups[index] = GroupPlans(params, key, self.plan_buckets(params, state, key))
        elif any(p.grad is not g for p, g in zip(params, known.grads)):
            for p in params:
                check_grad(p, self.name)
            known.grads = [p.grad for p in params]
        return known

    def step_groups(self, groups, state):
        """One step of every group's parameters with a gradient, through plans keyed by the
        group's capturable option: run_group(group, params, buckets) (the subclass's) runs them."""
        for gi, group in enumerate(groups):
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self.run_group(group, params, self.group_plans(gi, params, state, key=capturable(group)).buckets)

    def run_group(self, group, params, buckets):
        raise NotImplementedError

    def plan_buckets(self, params, state, key):
        raise NotImplementedError


class UnitOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose steps run through a UnitEngine: the subclass gives
    `_new_engine()` and `_engine_step()`; the closure, `plan_builds()` and a new engine after
    __setstate__ are common (torch pickles only defaults, state and param_groups, and
    load_state_dict installs a loaded state through __setstate__: the plans are then built over
    the loaded tensors)."""

    def __init__(self, params, defaults, capturable=False):
        self._engine = self._new_engine()
        if capturable:  # see capturable(group)
            defaults = dict(defaults, capturable=True)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine_step()
        return loss

    def plan_builds(self):
        """How many plans were built (one per bucket of a group, again when its parameters with a
        gradient, their addresses or the options the plans depend on change)."""
        return self._engine.builds

    def __setstate__(self, state):
        super().__setstate__(state)
        self._engine = self._new_engine()

    def _new_engine(self):
        raise NotImplementedError

    def _engine_step(self):
        raise NotImplementedError
