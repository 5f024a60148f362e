"""The optimizer step inside backward under DistributedDataParallel (issue 46, item 1): each of
DDP's gradient buckets is stepped with one fused step as soon as its all-reduce is done.

    model = DistributedDataParallel(net, device_ids=[rank])
    opt = fusedopt_torch.AdamW(model.parameters(), lr=3e-4)
    fusedopt_torch.ddp_step_in_backward(model, opt)       # registers DDP's comm hook
    for x in data:
        model(x).loss.backward()   # all-reduces and steps bucket by bucket; every .grad is None after
        scheduler.step()           # no opt.step(), no opt.zero_grad()

    # gradient accumulation: DDP's own no_sync() (no all-reduce, no step) before the last micro-batch
    with model.no_sync():
        model(x0).loss.backward()
    model(x1).loss.backward()      # all-reduces the accumulated gradients and steps

How: ``register_comm_hook`` replaces DDP's all-reduce of a bucket with a hook that, on autograd's
thread as DDP calls it, scales the bucket's flat buffer by 1/world (as DDP's own reduction does,
before the sum), all-reduces it (``dist.all_reduce(async_op=True)``), waits for it and runs one
``optimizer.step()`` over exactly the bucket's parameters, with the reduced gradients (the
gradients of the other parameters hidden meanwhile: in_backward._step_members, the mechanism of
step_in_backward), then sets their gradients to None. The hook returns a completed future of the
bucket's buffer (DDP's contract), and ``reducer._set_optimizer_in_backward()`` (what torch's own
optimizer-in-backward registers) tells DDP not to write the gradients back at the end of backward.
On CUDA the wait and the step are queued on a side stream: the all-reduce's Work.wait() there makes
that stream wait for it (NCCL: the host does not block; gloo: the host waits, then the stream waits
for gloo's copy back to the device, which gloo's future, a CPU one, would not order) while
backward's kernels go on on their own stream, and a callback at the end of backward makes the
caller's stream wait for the side stream before the next forward reads the parameters. On the CPU
(gloo) the hook waits for the all-reduce on the host.
Every element's update is the ordinary step's: the parameters are bit-identical to the ordinary
DDP loop ``backward(); opt.step(); opt.zero_grad()`` where the world size is a power of two (1/world
is exact; elsewhere the same holds when DDP divides the same way, docs/memory.md).

Refused: find_unused_parameters=True (a parameter unused on every rank keeps no gradient under
DDP, which a hook cannot know before the bucket's reduction is over), DDP's mixed_precision, a
module on several devices, an optimizer whose parameters are not exactly the ones DDP reduces, and
what step_in_backward refuses (LAMB's max_grad_norm, rules reading a reduction's total,
Schedule-Free). Not detectable from the hook, so do not combine them: GradScaler, clip_grad_norm_,
DDP's join() for uneven inputs (its divisor is not the world size), a second comm hook (DDP raises),
static_graph=True with a parameter that no rank uses (DDP zeroes its part of the bucket: it is
stepped with a zero gradient, where the ordinary loop leaves its gradient None and skips it).
The hook stays for the DDP model's life (DDP cannot unregister one): wrap the module in a new DDP
to step it the ordinary way again. docs/memory.md.
"""

import contextlib

import torch

from .in_backward import _check_optimizer, _hooked, _optimizer_params, _step_members

__all__ = ["DDPStepInBackward", "ddp_step_in_backward"]


def _ddp_parameters(ddp_model):
    """The parameters DDP reduces: the module's, less the ones it ignores, that take gradients."""
    params = getattr(ddp_model, "_module_parameters", None)
    if params is None:
        ignore = getattr(ddp_model, "parameters_to_ignore", set())
        params = [p for n, p in ddp_model.module.named_parameters() if n not in ignore]
    seen, out = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _comm_hook(stepper, bucket):
    # DDP checks a comm hook's signature by the name `bucket`; `stepper` is the state it passes.
    return stepper._on_bucket(bucket)


class DDPStepInBackward:
    """The comm hook's state: steps `optimizer` bucket by bucket as DDP reduces `ddp_model`'s
    gradients (see the module's text). ``buckets`` counts the buckets stepped in the last backward.
    Holds the optimizer and DDP's process group, not the DDP model."""

    def __init__(self, ddp_model, optimizer):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        who = "ddp_step_in_backward"
        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError(f"{who}: a torch.nn.parallel.DistributedDataParallel model is needed, not "
                            f"{type(ddp_model).__name__} (without DDP: fusedopt_torch.step_in_backward)")
        _check_optimizer(optimizer, who)
        if ddp_model.find_unused_parameters:
            raise NotImplementedError(f"{who}: find_unused_parameters=True is not supported (DDP leaves the gradient of "
                                      "a parameter unused on every rank None, which a bucket's hook cannot know)")
        if any(isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse for m in ddp_model.module.modules()):
            # DDP gives a sparse gradient a bucket of its own, whose GradBucket.gradients() is empty:
            # its parameter would never be stepped.
            raise NotImplementedError(f"{who}: sparse gradients (Embedding/EmbeddingBag sparse=True) are not supported")
        if getattr(ddp_model, "mixed_precision", None) is not None:
            raise NotImplementedError(f"{who}: DDP's mixed_precision is not supported (use bfloat16 autocast)")
        reducer = ddp_model.reducer
        if not hasattr(reducer, "_set_optimizer_in_backward"):
            raise NotImplementedError(f"{who}: this torch's DDP cannot be told that the optimizer runs in backward "
                                      "(Reducer._set_optimizer_in_backward, torch 2.0 on)")
        managed = _ddp_parameters(ddp_model)
        params = _optimizer_params(optimizer)
        if {id(p) for p in managed} != {id(p) for p in params}:
            ids = {id(p) for p in params}
            missing = sum(id(p) not in ids for p in managed)
            extra = len(params) - (len(managed) - missing)
            raise ValueError(f"{who}: the optimizer must hold exactly the parameters DDP reduces: {missing} of DDP's "
                             f"are not in it, {extra} of its are not reduced by DDP")
        if len({p.device for p in params}) != 1:
            raise NotImplementedError(f"{who}: the parameters must be on one device")
        self.optimizer = optimizer
        self.buckets = 0
        self._params = params
        self._ids = {id(p) for p in params}
        self._group = ddp_model.process_group
        self._world = dist.get_world_size(self._group)
        self._as_view = bool(ddp_model.gradient_as_bucket_view)
        self._streams = {}  # CUDA device -> the side stream the steps run on
        self._queued = False
        ddp_model.register_comm_hook(self, _comm_hook)
        reducer._set_optimizer_in_backward()
        _hooked.add(optimizer)

    def _side_stream(self, device):
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def _on_bucket(self, bucket):
        import torch.distributed as dist

        if not self._queued:
            # At the end of backward: the caller's streams wait for the side streams.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
            self.buckets = 0
        try:
            buffer = bucket.buffer()
            if self._world > 1:
                # DDP's own reduction multiplies each gradient by 1/world as it copies it into the
                # bucket, then sums; with a comm hook it copies without scaling: the same here.
                buffer.mul_(1.0 / self._world)
            work = dist.all_reduce(buffer, group=self._group, async_op=True)
            stream = self._side_stream(buffer.device) if buffer.is_cuda else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                # Work.wait(), not its future's: gloo's future is a CPU one, marked complete with
                # gloo's copy back into `buffer` still queued on gloo's own stream (ordered only
                # before the worker thread's current stream); Work.wait() runs the work's
                # synchronize() here, on this stream (NCCL: this stream waits for the all-reduce,
                # the host does not; gloo: the host waits, then this stream waits for the copy).
                work.wait()
                self._step(bucket.parameters(), bucket.gradients(), stream)
            self.buckets += 1
        except BaseException:
            self._queued = False  # backward fails: its callbacks do not run
            raise
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    def _step(self, params, grads, stream):
        if len(params) != len(grads):
            raise RuntimeError("ddp_step_in_backward: a DDP bucket without a gradient per parameter (a sparse one?)")
        members, copied = [], []
        for p, g in zip(params, grads):
            if id(p) not in self._ids:
                raise RuntimeError("ddp_step_in_backward: DDP reduced a parameter the optimizer does not hold")
            local = p.grad
            if self._as_view:
                # DDP made the gradient a view of the bucket (reduced in place); None where this
                # rank did not use the parameter (DDP would point it at the view at the end).
                if local is None:
                    p.grad = g
            elif local is None or (local.stride() == g.stride() and local.dtype == g.dtype):
                # The reduced gradient, in DDP's bucket: the local one, which DDP would copy it
                # into at the end of backward, is dropped now.
                p.grad = g
            else:
                local.copy_(g)  # a layout the bucket's view has not
                copied.append(local)
            members.append(p)
        try:
            _step_members(self.optimizer, self._params, members)
        finally:
            # Freed (and, without gradient_as_bucket_view, never left a view of DDP's bucket:
            # DDP asserts that such a gradient is not one at the next backward).
            for p in members:
                p.grad = None
        if stream is not None:
            for t in copied:
                t.record_stream(stream)  # freed now, written and read on the side stream

    def _finish(self):
        self._queued = False
        for device, stream in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)


def ddp_step_in_backward(ddp_model, optimizer):
    """Steps `optimizer` (a fusedopt_torch optimizer over exactly the parameters `ddp_model`, a
    DistributedDataParallel, reduces) inside backward from now on: each DDP bucket is all-reduced
    and then stepped with one fused step, and its gradients are freed. Gradient accumulation is
    DDP's ``no_sync()``. Registers DDP's comm hook (one per DDP model, for its life). Returns the
    DDPStepInBackward. docs/memory.md."""
    return DDPStepInBackward(ddp_model, optimizer)
