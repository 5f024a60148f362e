"""Prodigy, fused: ``fusedopt_torch.Prodigy`` (konstmish/prodigy's ``prodigyopt.Prodigy``: its
constructor, checks, algorithm and state_dict, for one parameter group and slice_p = 1).

A step runs the library's Prodigy plan (fusedopt/rules/prodigy.hpp) over every tensor of the
group at once: one reduction pass (the sums of grad (p0 - p) and of |s| over all tensors, in
double) and the update, with d, d_max and d_numerator kept in the plan's memory (device memory
for CUDA tensors) and advanced by the step itself. The reference runs one tensor at a time and
reads two values back to the host per tensor (``.item()``); here nothing is read back.

The plans live in a unit (csrc/prodigy_unit.hpp) compiled on first use into fusedopt_torch's
cache and called through ctypes (_prodigy_unit.py): no core, no torch in the unit.
"""
import torch

from . import _ext, _prodigy_unit
from ._unit_engine import (BUILT_BEFORE_CAPTURE, DTYPE_NAMES, DeviceCount, UnitEngine, UnitOptimizer, capturable,
                           on_device, refuse_capture)

__all__ = ["Prodigy"]


def _check_options(lr, betas, beta3, eps, d0, fsdp_in_use, slice_p):
    """The reference's checks and messages, then what this implementation does not do."""
    if not 0.0 < d0:
        raise ValueError("Invalid d0 value: {}".format(d0))
    if not 0.0 < lr:
        raise ValueError("Invalid learning rate: {}".format(lr))
    if not 0.0 < eps:
        raise ValueError("Invalid epsilon value: {}".format(eps))
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError("Invalid beta parameter at index 0: {}".format(betas[0]))
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError("Invalid beta parameter at index 1: {}".format(betas[1]))
    if beta3 is not None and not 0.0 <= beta3 < 1.0:
        raise ValueError(f"fusedopt_torch.Prodigy: beta3 must be None or in [0, 1), not {beta3}")
    if fsdp_in_use:
        raise ValueError("fusedopt_torch.Prodigy: fsdp_in_use=True is not supported (d's sums are not reduced "
                         "across processes)")
    if slice_p != 1:
        raise ValueError(f"fusedopt_torch.Prodigy: slice_p must be 1, not {slice_p} (the reference's sums over "
                         "every slice_p-th element are not implemented)")


def _prodigy_tensors(p, st, with_exp_avg):
    """p's state as the plan binds it, (p0, s, exp_avg or None, exp_avg_sq), from the
    reference's state (created as the reference creates it when empty; a 0-d p0, the
    reference's for an all-zero parameter, made a full one; exp_avg created where beta1 became
    positive)."""
    if "step" not in st:
        st["step"] = 0
        st["s"] = torch.zeros_like(p.flatten(), memory_format=torch.contiguous_format)
        st["p0"] = p.detach().flatten().clone(memory_format=torch.contiguous_format)
        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
    if with_exp_avg and "exp_avg" not in st:
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
    if st["p0"].dim() == 0:
        st["p0"] = st["p0"].expand(p.numel()).contiguous()
    tensors = (st["p0"], st["s"], st["exp_avg"] if with_exp_avg else None, st["exp_avg_sq"])
    for t in tensors:
        if t is not None and (t.numel() != p.numel() or t.dtype != p.dtype or t.device != p.device
                              or not t.is_contiguous()):
            raise RuntimeError("fusedopt_torch.Prodigy: p0, s, exp_avg and exp_avg_sq must be contiguous tensors of "
                               "their parameter's number of elements, on its device and of its dtype")
    return tensors


_NOT_CAPTURABLE = ("its step count k is kept on the host, in the group, as the reference's: construct it with "
                   "capturable=True")


class _Bucket:
    """The group's parameters with a gradient (one device and dtype), their plan, the gradient
    addresses it is bound to, and the steps run since the parameters' state['step'] was
    last written. A capturable CUDA bucket counts its steps in `counter` (the group's k, a
    DeviceCount read by the step when it runs); `counted` is its value when the group's k was
    last written from it."""

    __slots__ = ("params", "device", "dtype", "plan", "grads", "unwritten_steps", "counter", "counted")

    def __init__(self, params):
        self.params, self.device, self.dtype = params, params[0].device, params[0].dtype
        self.plan = self.grads = self.counter = None
        self.unwritten_steps = self.counted = 0


class _ProdigyEngine(UnitEngine):
    """The Prodigy plan of the (one) parameter group: rebuilt when its set of parameters with a
    gradient, their addresses or whether exp_avg is bound (beta1 > 0) change, gradients rebound
    when they move (_unit_engine.UnitEngine). d, d_max and d_numerator live in the plan: set
    from the group's values when it is built, written back into the group by `store` (which
    synchronises), as are the parameters' step counts."""

    name = "Prodigy"

    def step(self, group, state):
        params = [p for p in group["params"] if p.grad is not None]
        # The reference skips a group of lr 0, so that its d_denom is 0 and it returns.
        if not params or float(group["lr"]) == 0.0:
            return
        previous = self.groups.get(0)
        counted_on_device = capturable(group) and params[0].device.type == "cuda"
        known = self.group_plans(0, params, state, (group["betas"][0] > 0, counted_on_device))
        bucket = known.buckets[0]
        if known is not previous and previous is not None:
            self._store_bucket(previous.buckets[0], group, state)
        with on_device(bucket.device) as stream:
            if known is not previous:  # a new plan (never under capture: plan_buckets refuses it)
                bucket.plan.set_state(float(group["d"]), float(group["d_max"]), float(group["d_numerator"]), stream)
                if counted_on_device:
                    bucket.counted = int(group["k"])
                    bucket.counter = DeviceCount(bucket.counted, bucket.device)
            if bucket.counter is None and bucket.device.type == "cuda":
                refuse_capture(self.name, _NOT_CAPTURABLE)
            grads = [p.grad.data_ptr() for p in params]
            if grads != bucket.grads:
                bucket.plan.rebind_grads(grads, stream)
                bucket.grads = grads
            beta1, beta2 = group["betas"]
            beta3 = group["beta3"]
            hyper = _prodigy_unit.Hyper(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                                        beta3=-1.0 if beta3 is None else float(beta3), eps=float(group["eps"]),
                                        weight_decay=float(group["weight_decay"]), d0=float(group["d0"]),
                                        d_coef=float(group["d_coef"]), growth_rate=float(group["growth_rate"]),
                                        step=int(group["k"]) + 1, decouple=int(bool(group["decouple"])),
                                        use_bias_correction=int(bool(group["use_bias_correction"])),
                                        safeguard_warmup=int(bool(group["safeguard_warmup"])))
            if bucket.counter is not None:  # k + 1 read on the device: a replayed graph counts its steps
                hyper.step_pointer = bucket.counter.advance()
            bucket.plan.run(hyper, stream)  # refused options raise before anything is written
        if bucket.counter is None:
            group["k"] += 1
            bucket.unwritten_steps += 1

    def store(self, group, state):
        """Writes d, d_max and d_numerator (read from the plan: synchronises its stream) into the
        group and the steps run since the last store into the parameters' state['step']."""
        known = self.groups.get(0)
        if known is not None:
            self._store_bucket(known.buckets[0], group, state)

    def _store_bucket(self, bucket, group, state):
        with on_device(bucket.device) as stream:
            group["d"], group["d_max"], group["d_numerator"] = bucket.plan.state(stream)
        if bucket.counter is not None:  # the steps counted on the device since the last store
            done = bucket.counter.value() - bucket.counted
            bucket.counted += done
            group["k"] += done
            bucket.unwritten_steps += done
        for p in bucket.params:
            state[p]["step"] += bucket.unwritten_steps
        bucket.unwritten_steps = 0

    def plan_buckets(self, params, state, key):
        with_exp_avg, _ = key  # (beta1 > 0, counted on the device): the counter is set up by step()
        if len({(p.device, p.dtype) for p in params}) > 1:
            raise RuntimeError("fusedopt_torch.Prodigy: the parameters of a group must share one device and dtype "
                               "(d is estimated from sums over all of them, in one plan)")
        if any(hasattr(p, "_fsdp_flattened") for p in params):
            raise RuntimeError("fusedopt_torch.Prodigy: FSDP's flattened parameters are not supported (d's sums are "
                               "not reduced across processes)")
        bucket = _Bucket(params)
        tensors = [_prodigy_tensors(p, state[p], with_exp_avg) for p in params]
        cuda = bucket.device.type == "cuda"
        with on_device(bucket.device) as stream:
            if cuda:
                refuse_capture(self.name, BUILT_BEFORE_CAPTURE)
            unit = _prodigy_unit.unit("cuda" if cuda else "host", DTYPE_NAMES[bucket.dtype], with_exp_avg,
                                      (_ext.arch_of(bucket.device.index),) if cuda else ())
            bucket.grads = [p.grad.data_ptr() for p in params]
            column = lambda i: [t[i].data_ptr() if t[i] is not None else None for t in tensors]  # noqa: E731
            bucket.plan = _prodigy_unit.Plan(unit, [p.data_ptr() for p in params], bucket.grads, column(0), column(1),
                                             column(2), column(3), [p.numel() for p in params], 0, stream)
        self.builds += 1
        return [bucket]


class Prodigy(UnitOptimizer):
    r"""konstmish/prodigy's Prodigy (``prodigyopt.Prodigy``), fused: the same constructor, checks,
    algorithm and state_dict (the group's 'd', 'd0', 'd_max', 'd_numerator', 'k' and options;
    ``state[p]``: 'step' (an int), 's' and 'p0' of p.numel() elements, 'exp_avg' (beta1 > 0) and
    'exp_avg_sq' of p's shape, in p's dtype), for one parameter group whose parameters share one
    device and dtype, with slice_p = 1 and without FSDP (each refused with an error).

    Parameters may be float32, float64, float16 or bfloat16 (the state in the parameter's dtype,
    as the reference keeps it; d's sums in double). CPU tensors step on the host backend.

    d, d_max and d_numerator live in the plan's memory (device memory for CUDA tensors), where
    the step reads and advances them without synchronising. The group's 'd', 'd_max' and
    'd_numerator' and the parameters' 'step' are written when ``state_dict()`` is called (which
    reads them back, synchronising the device) or the optimizer is pickled or copied; between
    steps they may be stale. 'k' is kept current at every step (with capturable, written as the
    others). The plan reads the group's values when it is built: at the first step, when the
    set of parameters with a gradient changes, and after ``load_state_dict``, whose d, d_max and
    d_numerator the next step resumes from; changing them in the group otherwise has no effect.

    ``capturable`` (fusedopt's; the reference has none): CUDA parameters count k in device
    memory, which the step reads when it runs, so that a step captured in a CUDA graph replays
    with the right count and bias correction (d already lives on the device); 'k' and the
    parameters' 'step' are then written when ``state_dict()`` is called. Build the plan with one
    ordinary step before capturing. Without it a CUDA step under capture raises.

    Where it differs from the reference: the coupled weight decay (decouple=False) is added to
    the gradient inside the step, not into ``p.grad``; 'p0' is always a full copy (the
    reference's is a 0-d zero for an all-zero parameter, which loads here); the group keeps no
    'd_denom' or 'd_hat' (which the reference writes for logging and never reads); a step whose
    gradients are all zero before any other (the reference's d_denom == 0, where it returns
    early) still counts in 'k' and 'step', which changes later steps only with
    use_bias_correction; nothing is printed; beta3 must be None or in [0, 1).
    """

    def __init__(self, params, lr=1.0, betas=(0.9, 0.999), beta3=None, eps=1e-8, weight_decay=0, decouple=True,
                 use_bias_correction=False, safeguard_warmup=False, d0=1e-6, d_coef=1.0, growth_rate=float('inf'),
                 fsdp_in_use=False, slice_p=1, *, capturable=False):
        _check_options(lr, betas, beta3, eps, d0, fsdp_in_use, slice_p)
        defaults = dict(lr=lr, betas=betas, beta3=beta3, eps=eps, weight_decay=weight_decay, d=d0, d0=d0, d_max=d0,
                        d_numerator=0.0, d_coef=d_coef, k=0, growth_rate=growth_rate,
                        use_bias_correction=use_bias_correction, decouple=decouple, safeguard_warmup=safeguard_warmup,
                        fsdp_in_use=fsdp_in_use, slice_p=slice_p)
        super().__init__(params, defaults, capturable)

    @property
    def supports_memory_efficient_fp16(self):
        """The reference's answer to fairseq: no."""
        return False

    @property
    def supports_flat_params(self):
        """The reference's answer to fairseq: yes."""
        return True

    def add_param_group(self, param_group):
        """torch's, for the first group only: the reference estimates one d for all its groups
        (sums over every group, group 0's options), which a plan per group would not."""
        if self.param_groups:
            raise ValueError("fusedopt_torch.Prodigy takes one parameter group (the reference shares one d across "
                             "its groups)")
        super().add_param_group(param_group)

    def _new_engine(self):  # one plan over the group
        return _ProdigyEngine()

    def _engine_step(self):
        self._engine.step(self.param_groups[0], self.state)

    def state_dict(self):
        """torch's, with the group's d, d_max, d_numerator and the parameters' 'step' read from
        the plan first (synchronising the device)."""
        self._engine.store(self.param_groups[0], self.state)
        return super().state_dict()

    def __getstate__(self):
        self._engine.store(self.param_groups[0], self.state)
        return super().__getstate__()
