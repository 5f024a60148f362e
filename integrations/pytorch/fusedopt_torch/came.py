"""CAME, fused: ``fusedopt_torch.CAME`` (yangluo7/CAME's ``came_pytorch.CAME``: its constructor,
algorithm and state_dict).

A step of a parameter group runs the library's CAME plan (fusedopt/rules/came.hpp,
fusedopt/factored.hpp) over every tensor of the group at once: one factored pass (the row and
column means of grad^2 + eps1, folded into exp_avg_sq_row and exp_avg_sq_col, or exp_avg_sq below
two dimensions), one reduction pass (each tensor's RMS(update), for the clipping), one factored
pass (the instability (update - exp_avg)^2 + eps2 folded into exp_avg_res_row and
exp_avg_res_col, the new exp_avg stored) and the update (the parameter from exp_avg). CAME.py runs the same algorithm one tensor at a time, with two
norms per tensor; here nothing is read back.

The plans live in a unit (csrc/came_unit.hpp) compiled on first use into fusedopt_torch's cache
and called through ctypes (_came_unit.py): no core, no torch in the unit.
"""
import torch

from . import _came_unit
from ._unit_engine import UnitBucket, UnitEngine, UnitOptimizer, state_tensors_fit

__all__ = ["CAME"]

_NOT_CAPTURABLE = "its step counts are kept on the host, as CAME.py's: construct it with capturable=True"


def _check_options(lr, eps, betas):
    """CAME.py's checks (its asserts: lr > 0, each beta in [0, 1]) as ValueErrors, and the
    lengths of eps and betas it indexes."""
    if lr is None:
        raise ValueError("fusedopt_torch.CAME: lr is required (CAME.py's default, None, fails its check lr > 0)")
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not lr > 0.0:
        raise ValueError(f"fusedopt_torch.CAME: lr must be positive, not {lr}")
    if len(eps) != 2:
        raise ValueError(f"fusedopt_torch.CAME: eps must be two values (for the squared gradient and the "
                         f"instability), not {eps}")
    if len(betas) != 3:
        raise ValueError(f"fusedopt_torch.CAME: betas must be three values (for the update, the squared gradient "
                         f"and the instability), not {betas}")
    if not all(0.0 <= beta <= 1.0 for beta in betas):
        raise ValueError(f"fusedopt_torch.CAME: each beta must be in [0, 1], not {betas}")


def _state_dtype(dtype):
    """The dtype of exp_avg and of the statistics: CAME.py creates them from the gradient, upcast
    to float32 when it is float16 or bfloat16."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _state_shapes(p):
    """CAME.py's state tensors of p, name to shape, in its order of creation."""
    shape = tuple(p.shape)
    if p.dim() >= 2:
        row, col = shape[:-1], shape[:-2] + shape[-1:]
        return dict(exp_avg=shape, exp_avg_sq_row=row, exp_avg_sq_col=col, exp_avg_res_row=row, exp_avg_res_col=col)
    return dict(exp_avg=shape, exp_avg_sq=shape)


_STATE_KEYS = ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col", "exp_avg_sq")


def _state(p, st, on_device=False):
    """p's state as the plan binds it, created as CAME.py creates it when empty (zeros on p's
    device; 'step' 0), else checked: (exp_avg, sq_row or exp_avg_sq, sq_col, res_row, res_col),
    None where CAME.py keeps none. A capturable CUDA parameter's 'step' (`on_device`) is a float32
    tensor on its device (a captured graph advances it)."""
    shapes = _state_shapes(p)
    dtype = _state_dtype(p.dtype)
    if len(st) == 0:
        st["step"] = 0
        for key, shape in shapes.items():
            st[key] = torch.zeros(shape, dtype=dtype, device=p.device)
    if on_device and p.device.type == "cuda" and not (torch.is_tensor(st["step"]) and st["step"].device == p.device):
        st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32, device=p.device)
    if not state_tensors_fit([st.get(key) for key in shapes], shapes.values(), dtype, p.device):
        raise RuntimeError(f"fusedopt_torch.CAME: {', '.join(shapes)} must be contiguous tensors of CAME.py's shapes, "
                           f"on their parameter's device, of dtype {dtype}")
    if p.dim() >= 2:
        return st["exp_avg"], st["exp_avg_sq_row"], st["exp_avg_sq_col"], st["exp_avg_res_row"], st["exp_avg_res_col"]
    return st["exp_avg"], st["exp_avg_sq"], None, None, None


class _Bucket(UnitBucket):
    """The parameters of one group with one device and dtype, their plan (over those of them
    that are not empty) and their states, whose 'step' counts every step (on the device, in
    stream order, for a capturable CUDA bucket)."""

    __slots__ = ("states", "counted_on_device")

    def __init__(self, params, device, dtype, states, counted_on_device):
        super().__init__(params, device, dtype)
        self.states = states
        self.counted_on_device = counted_on_device


class _CAMEEngine(UnitEngine):
    """The CAME plans of parameter groups: one per (group, device, dtype), rebuilt when the set
    of parameters with a gradient or their addresses change, gradients rebound when they move
    (_unit_engine.UnitEngine). CAME reads no step count: parameters of one device and dtype step
    together whatever their counts, and each state['step'] (an int, as CAME.py's) is advanced on
    the host."""

    name = "CAME"

    def run_group(self, group, params, buckets):
        for bucket in buckets:
            self._run(bucket, group)

    def plan_buckets(self, params, state, key):
        on_device = key  # capturable(group): plans are made again when it changes
        members, tensors = {}, {}
        for p in params:
            tensors[p] = _state(p, state[p], on_device)
            members.setdefault((p.device, p.dtype), []).append(p)
        buckets = []
        for (device, dtype), group in members.items():
            bucket = _Bucket(group, device, dtype, [state[p] for p in group], on_device and device.type == "cuda")
            if bucket.planned:
                self._make_plan(bucket, [tensors[p] for p in bucket.planned])
            buckets.append(bucket)
        return buckets

    def _make_plan(self, bucket, tensors):
        members = bucket.planned

        def addresses(k):
            return [t[k].data_ptr() if t[k] is not None else None for t in tensors]

        bucket.make_plan(self.name, _came_unit, lambda unit, stream: _came_unit.Plan(
            unit, [p.data_ptr() for p in members], bucket.grads, addresses(0), [p.numel() for p in members],
            [tuple(p.shape) for p in members], addresses(1), addresses(2), addresses(3), addresses(4), 0, stream))
        self.builds += 1

    def _run(self, bucket, group):
        if bucket.plan is not None:
            (eps1, eps2), (beta1, beta2, beta3) = group["eps"], group["betas"]
            hyper = _came_unit.Hyper(eps1=float(eps1), eps2=float(eps2), clip_threshold=float(group["clip_threshold"]),
                                     beta1=float(beta1), beta2=float(beta2), beta3=float(beta3),
                                     weight_decay=float(group["weight_decay"]))
            lr = group["lr"]
            # The library refuses an lr that is not positive as a value; CAME.py steps any lr its
            # group holds (a warmup's 0): such an lr is read through the bucket's scalar.
            bucket.run(self.name, _NOT_CAPTURABLE, hyper, lr, lr_by_value=isinstance(lr, torch.Tensor) or lr > 0,
                       capturable=bucket.counted_on_device)
        if bucket.counted_on_device:
            torch._foreach_add_([st["step"] for st in bucket.states], 1.0)
        else:
            for st in bucket.states:
                st["step"] += 1


class CAME(UnitOptimizer):
    """yangluo7/CAME's CAME (``came_pytorch.CAME``), fused: the same constructor, algorithm and
    state_dict (``state[p]``: 'step', an int; 'exp_avg' of p's shape; for two or more dimensions
    'exp_avg_sq_row' and 'exp_avg_res_row' of shape p.shape[:-1], 'exp_avg_sq_col' and
    'exp_avg_res_col' of shape p.shape[:-2] + p.shape[-1:]; below two dimensions 'exp_avg_sq' of
    p's shape; float32, float64 for float64 parameters: CAME.py's upcast of 16-bit gradients).
    A state_dict of either loads into the other.

    Parameters may be float32, float64, float16 or bfloat16. A group steps its parameters of one
    device and dtype together; CPU tensors step on the host backend.

    ``capturable`` (fusedopt's; CAME.py has none): CAME reads no step count, so a step captured
    in a CUDA graph replays correctly once 'step' is counted on the device: with capturable=True
    a CUDA parameter's 'step' is a float32 tensor on its device, advanced in stream order (a
    float lr is baked into the graph, a Tensor lr read on the device). Build the plans with one
    ordinary step before capturing. Without it a CUDA step under capture raises.

    Where it differs from CAME.py: its constructor's asserts (lr > 0, each beta in [0, 1]) are
    ValueErrors here, and lr=None (its default, which fails its assert with a TypeError) is one
    too; 'RMS' (CAME.py's RMS of the parameter before each step, which its algorithm never
    reads) is not kept (a loaded one stays as it was loaded; CAME.py writes its own at its next
    step); the weight decay and the update are applied in one rounding to the parameter's dtype
    (CAME.py rounds a 16-bit parameter after each); load_state_dict keeps the saved float32 state
    of 16-bit parameters (torch's load_state_dict casts it to the parameter's dtype, and CAME.py
    then continues in that dtype); an empty parameter's state is never written (CAME.py's column
    means of a (0, C) matrix write NaN into its column statistics); parameters and gradients
    must be contiguous and of one dtype.
    """

    def __init__(self, params, lr=None, eps=(1e-30, 1e-16), clip_threshold=1.0, betas=(0.9, 0.999, 0.9999),
                 weight_decay=0.0, *, capturable=False):
        _check_options(lr, eps, betas)
        defaults = dict(lr=lr, eps=eps, clip_threshold=clip_threshold, betas=betas, weight_decay=weight_decay)
        super().__init__(params, defaults, capturable)

    @property
    def supports_memory_efficient_fp16(self):
        """CAME.py's answer to fairseq: yes."""
        return True

    @property
    def supports_flat_params(self):
        """CAME.py's answer to fairseq: no."""
        return False

    def _new_engine(self):  # plans per group, device and dtype
        return _CAMEEngine()

    def _engine_step(self):
        self._engine.step_groups(self.param_groups, self.state)

    def load_state_dict(self, state_dict):
        """torch's, except that the state tensors of float16 and bfloat16 parameters keep the
        saved values in float32 (torch's casts every floating state to the parameter's dtype)."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        super().load_state_dict(state_dict)
        for i, p in zip(ids, params):
            if p.dtype in (torch.float16, torch.bfloat16) and i in saved:
                for key, value in saved[i].items():
                    if key in _STATE_KEYS and torch.is_tensor(value) and value.is_floating_point():
                        self.state[p][key] = value.to(device=p.device, dtype=torch.float32)
