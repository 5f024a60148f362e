"""Adafactor, fused: ``fusedopt_torch.Adafactor`` (torch.optim.Adafactor's constructor, checks,
algorithm and state_dict).

A step of a parameter group runs the library's Adafactor plan (fusedopt/rules/adafactor.hpp,
fusedopt/factored.hpp): one factored pass (the row and column sums of grad^2 of every tensor,
folded into torch's row_var and col_var, or its variance below two dimensions), one reduction
pass (each tensor's RMS(param) and RMS(update)) and the update, over every tensor of the group
at once. torch.optim.Adafactor runs the same algorithm one tensor at a time and reads three
values back to the host per tensor (``.item()``); here nothing is read back.

The plans live in a unit (csrc/adafactor_unit.hpp) compiled on first use into fusedopt_torch's
cache and called through ctypes (_adafactor_unit.py): no core, no torch in the unit.
"""
import torch

from . import _adafactor_unit
from ._unit_engine import DeviceCount, UnitBucket, UnitEngine, UnitOptimizer, state_tensors_fit

__all__ = ["Adafactor"]


def _scalar_dtype():
    """torch.optim.optimizer._get_scalar_dtype: the dtype of state['step']."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _check_options(lr, beta2_decay, eps, d, weight_decay):
    """torch.optim.Adafactor's checks and messages."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 >= beta2_decay:
        raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}")
    if eps[0] is not None and not 0.0 <= eps[0]:
        raise ValueError(f"epsilon1 should be >= 0 but is: {eps[0]}")
    if not 0.0 <= eps[1]:
        raise ValueError(f"epsilon2 should be >= 0 but is: {eps[1]}")
    if not 1.0 <= d:
        raise ValueError(f"Clipping threshold d should be >= 1 but is: {d}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight_decay should be >= 0 but is: {weight_decay}")


def _torch_shapes(p):
    """torch's shapes of p's statistics: (row_var, col_var) for two or more dimensions, else
    (variance,)."""
    if p.dim() <= 1:
        return (list(p.shape),)
    row_shape, col_shape = list(p.shape), list(p.shape)
    row_shape[-1] = 1
    col_shape[-2] = 1
    return row_shape, col_shape


def _step_device(p, on_device):
    """Where state['step'] lives: the parameter's device for a capturable CUDA step (a captured
    graph advances it), else the CPU, as torch.optim.Adafactor keeps it."""
    return p.device if on_device and p.device.type == "cuda" else torch.device("cpu")


def _statistics(p, st, on_device=False):
    """p's statistics as the plan binds them, (row_var, col_var) or (variance, None), from torch's
    state (created as torch's _init_group creates it when empty, the step count made a tensor
    where a loaded state holds a number, as torch's __setstate__ does, and moved to where a
    capturable step keeps it: `on_device`)."""
    shapes = _torch_shapes(p)
    if len(st) == 0:
        st["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
        if len(shapes) == 2:
            st["row_var"], st["col_var"] = (p.grad.new_zeros(shape) for shape in shapes)
        else:
            st["variance"] = torch.zeros_like(p.grad, memory_format=torch.contiguous_format)
    if not torch.is_tensor(st["step"]):
        st["step"] = torch.tensor(float(st["step"]), dtype=_scalar_dtype())
    st["step"] = st["step"].to(_step_device(p, on_device))
    stats = (st["row_var"], st["col_var"]) if len(shapes) == 2 else (st["variance"],)
    if not state_tensors_fit(stats, shapes, p.dtype, p.device):
        raise RuntimeError("fusedopt_torch.Adafactor: row_var, col_var and variance must be contiguous tensors "
                           "of torch's shapes, on their parameter's device and of its dtype")
    return stats if len(stats) == 2 else (stats[0], None)


def _shared_steps(state, params):
    """The parameters' state['step'] tensors made to share one storage, each keeping its
    identity, value, dtype and device (Tensor.set_ onto an element of one stacked tensor), so
    that a step advances all of them with one op: torch._foreach_add_ over CPU scalar tensors
    costs about 2.6 us of host time per tensor (200 tensors: 0.5 ms, twice the GPU's whole step
    over 200 small matrices). Returns the stacked tensor, or the list of the counts where their
    dtypes, devices or shapes differ (a loaded state may mix them), to be advanced one by one."""
    steps = [state[p]["step"] for p in params]
    if len({(s.dtype, s.device, s.shape) for s in steps}) != 1:
        return steps
    counts = torch.stack([s.detach() for s in steps])
    storage = counts.untyped_storage() if hasattr(counts, "untyped_storage") else counts.storage()
    for i, s in enumerate(steps):
        s.set_(storage, counts.storage_offset() + i * counts.stride(0), s.shape, s.stride())
    return counts


_NOT_CAPTURABLE = "its step count is kept on the host, as torch.optim.Adafactor's: construct it with capturable=True"


class _Bucket(UnitBucket):
    """The parameters of one group with one device, dtype and step count, and their plan (over
    those of them that are not empty: an empty tensor only counts its steps). A capturable CUDA
    bucket counts its steps in `counter` (a DeviceCount, which the plan reads when it runs)
    instead of `step`. `steps`: the parameters' state['step'], as _shared_steps returns them."""

    __slots__ = ("steps", "step", "counter")

    def __init__(self, params, device, dtype, step, counted_on_device):
        super().__init__(params, device, dtype)
        self.step = step
        self.steps = None
        self.counter = DeviceCount(step, device) if counted_on_device else None


class _AdafactorEngine(UnitEngine):
    """The Adafactor plans of parameter groups: one per (group, device, dtype, step count),
    rebuilt when the set of parameters with a gradient or their addresses change, gradients
    rebound when they move (_unit_engine.UnitEngine). The step counts are read from state['step']
    when the plans are built and kept here; state['step'] is advanced with them, one torch op per
    bucket and step."""

    name = "Adafactor"

    def run_group(self, group, params, buckets):
        eps1, eps2 = group["eps"]
        if eps1 is None:  # torch: finfo of the first parameter's dtype, for the whole group
            eps1 = torch.finfo(params[0].dtype).eps
        for bucket in buckets:
            self._run(bucket, group, float(eps1), float(eps2))

    def plan_buckets(self, params, state, key):
        on_device = key  # capturable(group): plans are made again when it changes
        members, stats = {}, {}
        for p in params:
            stats[p] = _statistics(p, state[p], on_device)
            step = int(state[p]["step"].item())
            members.setdefault((p.device, p.dtype, step), []).append(p)
        buckets = []
        for (device, dtype, step), group in members.items():
            bucket = _Bucket(group, device, dtype, step, on_device and device.type == "cuda")
            bucket.steps = _shared_steps(state, group)
            if bucket.planned:
                self._make_plan(bucket, [stats[p] for p in bucket.planned])
            buckets.append(bucket)
        return buckets

    def _make_plan(self, bucket, stats):
        members = bucket.planned
        bucket.make_plan(self.name, _adafactor_unit, lambda unit, stream: _adafactor_unit.Plan(
            unit, [p.data_ptr() for p in members], bucket.grads, [p.numel() for p in members],
            [tuple(p.shape) for p in members], [row.data_ptr() for row, _ in stats],
            [col.data_ptr() if col is not None else None for _, col in stats], 0, stream))
        self.builds += 1

    def _run(self, bucket, group, eps1, eps2):
        if bucket.plan is not None:
            hyper = _adafactor_unit.Hyper(beta2_decay=float(group["beta2_decay"]), eps1=eps1, eps2=eps2,
                                          d=float(group["d"]), weight_decay=float(group["weight_decay"]),
                                          step=bucket.step + 1, maximize=int(bool(group["maximize"])))
            if bucket.counter is not None:
                hyper.step_pointer = bucket.counter.advance()
            bucket.run(self.name, _NOT_CAPTURABLE, hyper, group["lr"], capturable=bucket.counter is not None)
        bucket.step += 1  # the host's count (unused by a capturable bucket's plan)
        if torch.is_tensor(bucket.steps):
            bucket.steps.add_(1.0)
        else:
            torch._foreach_add_(bucket.steps, 1.0)


class Adafactor(UnitOptimizer):
    """torch.optim.Adafactor, fused: the same constructor, checks, algorithm and state_dict
    (``state[p]``: 'step', a CPU scalar tensor of torch's step dtype, the tensors of the
    parameters that step together sharing one storage; 'row_var' and 'col_var' of shapes
    p.shape[:-1] + (1,) and p.shape[:-2] + (1, p.shape[-1]) for two or more dimensions, else
    'variance' of p's shape; in the parameter's dtype).

    Parameters may be float32, float64, float16 or bfloat16 (the statistics in the parameter's
    dtype, as torch keeps them). ``foreach`` is accepted and kept in the groups, as torch's, and
    changes nothing: torch's two implementations compute the same algorithm. A group steps its
    parameters of one device, dtype and step count together; parameters whose step counts differ
    (one had no gradient at some step) step in separate plans, each with its own count, as torch
    counts them per parameter. The counts are read from state['step'] when the plans are built
    (the first step, a new set of parameters with a gradient, load_state_dict) and state['step']
    is advanced at every step (one torch op per plan). CPU tensors step on the host backend.

    ``capturable`` (fusedopt's; torch's Adafactor has none and is not capturable): CUDA
    parameters keep state['step'] on their device and each plan counts its steps in device
    memory, which the step reads when it runs, so that a step captured in a CUDA graph and
    replayed advances and uses the right count (nothing is read back; a float lr is baked into
    the graph, a Tensor lr is read on the device). Build the plans with one ordinary step before
    capturing (a plan is built outside a capture). Without it a CUDA step under capture raises.
    """

    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0, *,
                 foreach=None, maximize=False, capturable=False):
        _check_options(lr, beta2_decay, eps, d, weight_decay)
        defaults = dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay, foreach=foreach,
                        maximize=maximize)
        super().__init__(params, defaults, capturable)

    def _new_engine(self):  # plans per group, device, dtype and step count
        return _AdafactorEngine()

    def _engine_step(self):
        self._engine.step_groups(self.param_groups, self.state)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("foreach", None)
