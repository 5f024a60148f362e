"""The optimizer step inside backward (issue 46): each parameter is stepped soon after its gradient
is ready, in fused launches over buckets of parameters, and its gradient is freed at once.

    opt = fusedopt_torch.AdamW(model.parameters(), lr=3e-4)
    stepper = fusedopt_torch.step_in_backward(opt)       # hooks every parameter of opt
    for batch in data:
        loss = model(batch).sum()
        loss.backward()          # steps opt's parameters bucket by bucket, frees their gradients
        scheduler.step()         # LR schedulers act on opt as usual; no opt.step(), no zero_grad()

Why: a model's gradients are held only to feed the optimizer; stepping as they arrive frees
their memory during backward (peak memory lower by up to the gradients' bytes) and overlaps the
step with the rest of backward. torch's recipe (one optimizer per parameter, stepped in a
post-accumulate-grad hook) launches once per tensor; here a bucket of parameters whose
gradients are ready is one fused launch of the optimizer's own plans.

How: a post-accumulate-grad hook per parameter puts it into a pending bucket; when the bucket
holds `bucket_bytes` of gradients, ``optimizer.step()`` runs over it (the parameters that have a
gradient at that moment are exactly the bucket's: the others' gradients are not computed yet or
already freed) and sets their gradients to None. The rest is stepped by a callback at the end of
backward. The step of every element is the ordinary step's (the same kernels, on fewer tensors):
parameters are bit-identical to ``backward(); step(); zero_grad()`` for the elementwise
optimizers. The first backward creates the states (the ordinary first step's work); later ones
find the buckets' plans rebuilt in C++ (a change of which parameters have a gradient), no Python.

Gradient accumulation: ``with stepper.accumulate(): loss.backward()`` for every micro-batch but
the last (gradients accumulate, nothing is stepped). What needs every gradient before any step
does not combine with it: LAMB's max_grad_norm and user rules that read a reduction's total over
every tensor are refused here; GradScaler (the hooks would step scaled gradients: use bfloat16
autocast, which needs no scaler) and clip_grad_norm_ (after backward there is nothing left to
clip) cannot be detected from the hooks, so do not use them with it. Per-tensor reductions (LAMB's
trust ratios, StableAdamW, CAdamW) are per bucket as they are per step. Under
DistributedDataParallel: fusedopt_torch.ddp_step_in_backward (ddp_in_backward.py). docs/memory.md.
"""

import contextlib
import weakref

import torch

__all__ = ["StepInBackward", "step_in_backward"]


# Optimizers some StepInBackward or DDPStepInBackward steps: a second one would step them twice.
_hooked = weakref.WeakSet()


def _optimizer_params(optimizer):
    """The optimizer's parameters that take gradients, each once, in its groups' order."""
    seen, params = set(), []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            params.append(p)
    return params


def _step_members(optimizer, params, members):
    """One ``optimizer.step()`` over `members` alone: step() steps every parameter that has a
    gradient, so the gradients of the others among `params` (not yet complete, or accumulating
    from earlier micro-batches) are hidden from it meanwhile and put back after. `params` need
    only hold those that may have a gradient (StepInBackward passes the ones whose gradients
    predate the backward)."""
    in_bucket = {id(p) for p in members}
    hidden = [(p, p.grad) for p in params if p.grad is not None and id(p) not in in_bucket]
    for p, _ in hidden:
        p.grad = None
    try:
        with torch.no_grad():
            optimizer.step()
    finally:
        for p, g in hidden:
            p.grad = g


def refuse_partial_steps(optimizer, who):
    """Raises where a step over part of the parameters (a bucket) is not that part of the whole
    step: what step_in_backward and CPUOffload both refuse."""
    name = type(optimizer).__name__
    spec = getattr(optimizer, "_spec", None)
    if spec is not None and any(f"{r.name}_total" in (spec.body or "") for r in spec.reductions):
        # A reduction's total is over every tensor of the launch: a bucket's would differ.
        raise NotImplementedError(f"{who}: {name} reads a reduction's total over every tensor, which a bucket is not")
    if getattr(optimizer, "_scalars_per_step", False):
        # Schedule-Free advances its group's scalars at every step() call: once per bucket.
        raise NotImplementedError(f"{who}: {name} advances per-step scalars in step(), which a bucket would advance "
                                  "once per bucket")
    if any(g.get("max_grad_norm", 0) for g in optimizer.param_groups):
        # LAMB clips by the norm of every gradient before its step.
        raise NotImplementedError(f"{who}: {name} with max_grad_norm > 0 needs every gradient before any step; set "
                                  "max_grad_norm=0")


def _check_optimizer(optimizer, who):
    """What step_in_backward and ddp_step_in_backward refuse: not a fusedopt_torch optimizer, a
    step that a bucket's is not part of (refuse_partial_steps), an optimizer already stepped
    inside backward."""
    from .optimizers import FusedOptimizer

    if not isinstance(optimizer, FusedOptimizer):
        raise TypeError(f"{who}: a fusedopt_torch optimizer is needed, not {type(optimizer).__name__}")
    refuse_partial_steps(optimizer, who)
    if optimizer in _hooked:
        raise RuntimeError(f"{who}: this optimizer is already stepped inside backward (step_in_backward or "
                           "ddp_step_in_backward): a second one would step it twice")


class StepInBackward:
    """Hooks that step `optimizer`'s parameters during backward (see the module's text).
    ``remove()`` takes the hooks away (until then the parameters, their hooks and the optimizer
    keep each other alive: the hooks are held in C++, where Python's collector does not see the
    cycle, as with torch's per-parameter recipe), ``accumulate()`` is the context for
    micro-batches whose gradients must only accumulate, ``buckets`` counts the fused steps of
    the last backward."""

    def __init__(self, optimizer, bucket_bytes=32 << 20):
        _check_optimizer(optimizer, "step_in_backward")
        if int(bucket_bytes) <= 0:
            raise ValueError(f"step_in_backward: bucket_bytes must be positive, not {bucket_bytes}")
        self.optimizer = optimizer
        self.bucket_bytes = int(bucket_bytes)
        self.buckets = 0
        self._pending, self._pending_bytes = [], 0
        # The parameters whose gradients predate the current backward (earlier micro-batches'),
        # found at its first hook: the only gradients besides a bucket's that a step there must
        # hide. Scanning every parameter at every bucket instead cost O(parameters x buckets)
        # Python per backward (a 1B model: about 12 000 .grad reads in 55 buckets).
        self._earlier = []
        self._accumulating = False
        self._flush_queued = False
        self._handles = []
        self._params = _optimizer_params(optimizer)
        for p in self._params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._ready))
        _hooked.add(optimizer)
        self._registered = True

    @contextlib.contextmanager
    def accumulate(self):
        """Within: backward accumulates gradients and steps nothing (micro-batches before the last)."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield self
        finally:
            self._accumulating = previous

    def remove(self):
        """Takes the hooks away: the optimizer is stepped by its own step() again."""
        for h in self._handles:
            h.remove()
        if self._registered:
            _hooked.discard(self.optimizer)
            self._registered = False
        self._handles = []

    def _ready(self, p):
        if self._accumulating:
            return
        if not self._flush_queued:
            # The last bucket of this backward, whatever its size, at the end of backward.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._flush_queued = True
            self.buckets = 0
            self._earlier = [q for q in self._params if q is not p and q.grad is not None]
        self._pending.append(p)
        self._pending_bytes += p.grad.numel() * p.grad.element_size()
        if self._pending_bytes >= self.bucket_bytes:
            self._flush()

    def _finish(self):
        self._flush_queued = False
        self._flush()

    def _flush(self):
        if not self._pending:
            return
        opt = self.optimizer
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        _step_members(opt, self._earlier, pending)
        for p in pending:
            p.grad = None
        if self._earlier:
            self._earlier = [q for q in self._earlier if q.grad is not None]
        self.buckets += 1


def step_in_backward(optimizer, bucket_bytes=32 << 20):
    """Steps `optimizer` (a fusedopt_torch optimizer) inside backward from now on: every bucket of
    `bucket_bytes` of ready gradients is one fused step, and their gradients are freed. Returns the
    StepInBackward (keep it; ``remove()`` ends it). docs/memory.md."""
    return StepInBackward(optimizer, bucket_bytes)
