"""CPU offload (issue 46, item 2): fp32 master parameters and every optimizer state in CPU
memory, the step on the CPU through fusedopt's host backend, overlapped with backward.

    model = model.cuda().to(torch.bfloat16)              # or float32 parameters
    opt = fusedopt_torch.CPUOffload(model.parameters(), fusedopt_torch.AdamW, lr=3e-4, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    for x in data:
        loss = model(x).loss
        loss.backward()    # buckets' gradients copied to the host and stepped there while backward runs
        opt.step()         # waits for the last buckets; the next forward runs after the copies back
        opt.zero_grad()    # (the gradients are already freed: None)
        scheduler.step()

What is where: the GPU holds the parameters (any of float32, bfloat16, float16) and, for a
moment, their gradients; 0 bytes of optimizer state. The host holds a float32 master of every
parameter and its gradient's copy (pinned memory: they cross PCIe), and the optimizer's states
(ordinary memory: they never leave the host). With Adam or AdamW (``master_weights``), a 16-bit
parameter's gradient crosses PCIe in its own dtype and the host step reads it so, updates the
float32 master and states and writes the 16-bit parameter into a pinned copy that crosses back:
half the PCIe bytes of float32 copies each way, no conversion kernel on the GPU, and one pass
over the host's memory (28 bytes a parameter). Other optimizers step the float32 master over a
float32 copy of the gradient (converted on the GPU) and the parameter is converted back on the GPU.

How: the parameters of each group are split into buckets of ``bucket_bytes`` of float32 masters,
in the reverse of their order (the order backward finishes their gradients, as DDP assumes).
Each bucket has its own fusedopt optimizer of ``optimizer_class`` over its masters (a fixed set
of tensors: its host plans are built once). A post-accumulate-grad hook counts the bucket's
gradients; when the last one is ready, its gradients are copied device-to-host on a side stream
(converted to float32 on the GPU, after an event recorded on backward's stream) and freed; a
worker thread waits for that copy, steps the bucket's masters on the host (fusedopt's host
backend: OpenMP threads, SIMD, torch.get_num_threads() threads; the GIL released meanwhile) and
copies them back host-to-device on another side stream (converted to the parameter's dtype on
the GPU). So bucket i steps on the host while bucket i+1's gradients are copied and backward goes
on, and bucket i's parameters travel back while bucket i+1 steps. ``step()`` launches what the
hooks did not (buckets with parameters that got no gradient, gradients set by hand), waits for
the worker, and makes the current stream wait for the copies back: no host synchronisation with
the GPU beyond the worker's waits on the device-to-host copies.

With ``overlap=False`` no hooks are registered: ``step()`` copies and steps every bucket
(pipelined the same way), and ``clip_grad_norm_`` is available (torch's clip over the host
copies of the gradients, before any bucket steps).

Gradient accumulation: ``with opt.accumulate(): loss.backward()`` for every micro-batch but the
last (the gradients accumulate on the GPU as usual; the last backward copies their sums). A
second backward that reaches parameters already stepped since the last ``step()`` raises.

What does not work, with errors where they can be detected: GradScaler (scaler.step raises:
use bfloat16 autocast or bfloat16 parameters, which need no scaler); global-norm clipping with
``overlap=True`` (``opt.clip_grad_norm_`` raises; torch.nn.utils.clip_grad_norm_ after backward
finds no gradients: they were freed); optimizers whose step needs every gradient (LAMB's
max_grad_norm, user rules reading a reduction's total) or advances per-step scalars
(Schedule-Free); float64 or complex parameters, parameters on the CPU or on several GPUs.
docs/memory.md, "CPU offload".
"""

import contextlib
import copy
import functools
import inspect
import queue
import threading

import torch
from torch.optim import Optimizer
from .in_backward import refuse_partial_steps

__all__ = ["CPUOffload"]

_ALIGN = 64  # elements: every view of a pinned buffer starts a multiple of 128 bytes into it
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _serve(jobs):
    """The worker thread: runs the queued jobs in order (a job catches its own errors)."""
    while True:
        job = jobs.get()
        try:
            if job is None:
                return
            job()
        finally:
            jobs.task_done()


def _check_offloadable(probe):
    """The checks of step_in_backward: a bucket's step must be the whole step's on its tensors."""
    refuse_partial_steps(probe, "CPUOffload")
    if any(g.get("kahan", False) or g.get("stochastic_rounding", False) for g in probe.param_groups):
        raise ValueError("CPUOffload: the masters are float32; kahan and stochastic_rounding are for bfloat16 or "
                         "float16 parameters stepped as they are")


def _pinned_views(tensors, dtype, zero=False):
    """Views of one pinned buffer of `dtype` shaped as `tensors` (the pinned allocator rounds every
    allocation up to a power of two: one large one wastes the least)."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += (t.numel() + _ALIGN - 1) // _ALIGN * _ALIGN
    flat = (torch.zeros if zero else torch.empty)(max(total, 1), dtype=dtype, pin_memory=True)
    return [flat[start:start + t.numel()].view(t.shape) for t, start in zip(tensors, offsets)]


class _Bucket:
    """Parameters of one group stepped together: their masters and gradients' host copies (views
    of the group's pinned buffers), the tensors the fusedopt optimizer steps (`stepped`: the
    masters, or with master weights the parameters' 16-bit host copies, whose state 'master' is
    the master), that optimizer (`inner`: the indices of each of its groups, the float32 masters'
    first, then the 16-bit copies' with master weights), and this iteration's progress."""

    __slots__ = ("group_index", "params", "positions", "masters", "grads", "stepped", "optimizer", "inner",
                 "expected", "ready", "launched", "copied", "gathered", "versions")

    def __init__(self, group_index, params, positions, masters, grads, stepped, optimizer, inner):
        self.group_index = group_index
        self.params, self.positions, self.masters, self.grads = params, positions, masters, grads
        self.stepped, self.optimizer, self.inner = stepped, optimizer, inner
        self.expected = sum(1 for p in params if p.requires_grad)
        self.ready = 0
        self.launched = False  # gradients copied this iteration (stepped, or gathered for a clip)
        self.copied = []  # indices of the parameters whose gradients were copied
        self.gathered = None  # (copied event, ready event) of gradients copied but not stepped yet
        self.versions = [p._version for p in params]


class CPUOffload(Optimizer):
    """An optimizer whose fp32 master parameters and states live in CPU memory and whose step runs
    on the CPU through fusedopt's host backend, overlapped with backward (see the module's text).

    ``params``: CUDA parameters (float32, bfloat16 or float16, one device) or parameter groups,
    as for any torch optimizer. ``optimizer_class``: a fusedopt_torch optimizer class (default
    fusedopt_torch.AdamW; AdamW8bit keeps 8-bit moments on the host), built over each bucket's
    masters with ``**kwargs``. ``bucket_bytes``: float32 master bytes per bucket (64 MiB: 16M
    parameters). ``overlap``: copy and step each bucket during backward (post-accumulate-grad
    hooks); False: in ``step()``.

    torch.optim's interface: ``param_groups`` (the CUDA parameters and the hyperparameters, read
    by the buckets' optimizers at every step: LR schedulers work), ``step()``, ``zero_grad()``,
    ``state_dict()`` / ``load_state_dict()`` (torch's format, the states as CPU tensors, plus
    ``'master_params'``: the float32 masters of parameters that are not float32), ``state[p]``
    (the host state of p; its 'step' is refreshed by ``state_dict()``). ``master(p)`` is p's
    float32 master. A change made to a parameter outside the optimizer (in place, e.g.
    ``model.load_state_dict``) is copied into its master before its next step."""

    def __init__(self, params, optimizer_class=None, *, bucket_bytes=64 << 20, overlap=True, **kwargs):
        from .optimizers import AdamW, FusedOptimizer

        if optimizer_class is None:
            optimizer_class = AdamW
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, FusedOptimizer)):
            raise TypeError(f"CPUOffload: optimizer_class must be a fusedopt_torch optimizer class (AdamW, "
                            f"AdamW8bit, ...), not {optimizer_class!r}")
        if int(bucket_bytes) <= 0:
            raise ValueError(f"CPUOffload: bucket_bytes must be positive, not {bucket_bytes}")
        if not torch.cuda.is_available():
            raise RuntimeError("CPUOffload: offloads the step of CUDA parameters, and CUDA is not available")
        if "master_weights" in kwargs:
            raise ValueError("CPUOffload keeps float32 masters itself (16-bit parameters go through master_weights "
                             "where the optimizer class has it): do not pass master_weights")
        # The class's defaults, and its own checks of the arguments (torch's messages).
        probe = optimizer_class([torch.zeros(1)], **kwargs)
        _check_offloadable(probe)
        # 16-bit gradients in and 16-bit parameters out of the host step (Adam, AdamW).
        self._master_weights = "master_weights" in inspect.signature(optimizer_class.__init__).parameters
        self.optimizer_class = optimizer_class
        self.bucket_bytes = int(bucket_bytes)
        self.overlap = bool(overlap)
        self._kwargs = dict(kwargs)
        self._buckets = []
        self._where = {}  # parameter -> (bucket, index in the bucket)
        self._handles = []
        self._device = None
        self._d2h = self._h2d = None  # side streams: gradients out, parameters back
        self._written = None  # event recorded after each bucket's copies back (one stream: the last wins)
        self._wrote = False  # copies back issued since the last step()
        self._accumulating = False
        self._error = None  # the worker's exception, raised by step()
        self._jobs = queue.Queue()
        self._worker = None
        super().__init__(params, dict(probe.defaults))
        self.state = _StateView(self)

    # ---- torch.optim.Optimizer ---------------------------------------------------------------

    def add_param_group(self, param_group):
        super().add_param_group(param_group)  # torch's checks and defaults
        self._add_buckets(len(self.param_groups) - 1)

    @property
    def _step_supports_amp_scaling(self):
        # Read by GradScaler.step: the gradients it scaled were stepped, or are about to be,
        # without its unscale and inf check.
        raise RuntimeError("CPUOffload does not support torch.amp.GradScaler (the buckets step during backward, "
                           "before any inf check): use bfloat16 autocast or bfloat16 parameters, which need no "
                           "scaler")

    def step(self, closure=None):
        """Completes the step: copies and steps the buckets the hooks did not launch, waits for
        the worker, and makes the current stream wait for the parameters' copies back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            for b in self._buckets:
                if b.gathered is not None:
                    copied, ready = b.gathered
                    b.gathered = None
                    self._submit(b, copied, ready)
                elif not b.launched:
                    self._launch(b, gather=False)
        finally:
            try:
                self._drain()  # also after a failed launch: what was queued completes first; raises its error
            finally:
                if self._wrote:
                    torch.cuda.current_stream(self._device).wait_event(self._written)
                    self._wrote = False
                for b in self._buckets:
                    b.ready, b.launched, b.copied, b.gathered = 0, False, [], None
                    b.versions = [p._version for p in b.params]
        return loss

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none=set_to_none)
        for b in self._buckets:
            if b.gathered is not None:  # copied for a clip, not stepped: forgotten with the gradients
                b.gathered, b.launched, b.copied = None, False, []

    def state_dict(self):
        """torch's format over the CUDA parameters' indices: the hyperparameters of every group
        and the host states (CPU tensors, not copies), plus 'master_params' {index: float32
        master} for the parameters that are not float32 (their masters hold more than they)."""
        self._drain()
        for b in self._buckets:
            b.optimizer._pull_steps()
        state, groups, masters, start = {}, [], {}, 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(start, start + len(group["params"])))
            for j, p in enumerate(group["params"]):
                b, i = self._where[p]
                # Without 'master' (master weights' state): the masters travel in 'master_params'.
                entries = {k: v for k, v in b.optimizer.state.get(b.stepped[i], {}).items() if k != "master"}
                if entries:
                    state[start + j] = entries
                if p.dtype != torch.float32:
                    masters[start + j] = b.masters[i]
            start += len(group["params"])
            groups.append(packed)
        out = {"state": state, "param_groups": groups}
        if masters:
            out["master_params"] = masters
        return out

    def load_state_dict(self, state_dict):
        """Loads torch's format (this class's state_dict, or that of a fusedopt_torch or torch
        optimizer over the same parameters): hyperparameters, states (to the host, float32), and
        the masters of 'master_params' (written to the parameters too)."""
        self._drain()
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for group, saved in zip(self.param_groups, saved_groups):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                                 "optimizer's group")
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        states = state_dict["state"]
        saved_masters = state_dict.get("master_params", {})
        for b in self._buckets:
            saved = saved_groups[b.group_index]
            ids = [saved["params"][j] for j in b.positions]
            hyper = {k: v for k, v in saved.items() if k != "params"}
            inner_groups = [dict(hyper, **self._inner_options(b, indices), params=[ids[i] for i in indices])
                            for indices in b.inner]
            # Copies: torch's load keeps a CPU tensor of the right dtype as it is (shared with the caller's).
            own = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in states[i].items()
                       if k != "master"} for i in ids if i in states}
            b.optimizer.load_state_dict({"state": own, "param_groups": inner_groups})
            for i, saved_id in enumerate(ids):
                if saved_id in saved_masters:
                    b.masters[i].copy_(saved_masters[saved_id])
                    with torch.no_grad():
                        b.params[i].data.copy_(b.masters[i])
                self._refresh_host_copy(b, i)
                if b.stepped[i] in b.optimizer.state:
                    self._link_master(b, i)
            b.versions = [p._version for p in b.params]

    def __getstate__(self):
        raise TypeError("CPUOffload cannot be pickled or deep-copied: save its state_dict()")

    # ---- beyond torch.optim --------------------------------------------------------------------

    def master(self, p):
        """The float32 master of CUDA parameter p (a CPU tensor in pinned memory)."""
        b, i = self._where[p]
        return b.masters[i]

    @staticmethod
    def _inner_options(b, indices):
        """The options of the bucket optimizer's group of `indices`: master weights for 16-bit copies."""
        return {} if b.stepped[indices[0]] is b.masters[indices[0]] else {"master_weights": True}

    @staticmethod
    def _link_master(b, i):
        """With master weights: the pinned master is the state 'master' of parameter i's host copy."""
        if b.stepped[i] is not b.masters[i]:
            b.optimizer.state[b.stepped[i]]["master"] = b.masters[i]

    @staticmethod
    def _refresh_host_copy(b, i):
        """With master weights: parameter i's 16-bit host copy (what crosses back) takes the master's rounding."""
        if b.stepped[i] is not b.masters[i]:
            b.stepped[i].copy_(b.masters[i])

    @property
    def buckets(self):
        """How many buckets (each one host step and one copy each way per iteration)."""
        return len(self._buckets)

    @contextlib.contextmanager
    def accumulate(self):
        """Within: backward accumulates the gradients on the GPU and copies and steps nothing
        (micro-batches before the last)."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield self
        finally:
            self._accumulating = previous

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """torch.nn.utils.clip_grad_norm_ over the host copies of the gradients (float32, or with
        master weights the 16-bit parameters' own dtype), before any bucket steps: call it between
        backward() and step(), with ``overlap=False`` (with overlap the buckets step during
        backward). Returns the total norm (a CPU tensor)."""
        if self.overlap:
            raise RuntimeError("CPUOffload(overlap=True) steps each bucket during backward: no moment has every "
                               "gradient before a step. Construct it with overlap=False to clip (the norm is "
                               "taken over the host copies of the gradients)")
        for b in self._buckets:
            if not b.launched:
                self._launch(b, gather=True)
        for b in self._buckets:
            if b.gathered is not None:
                b.gathered[0].synchronize()
        held = []  # in the groups' order, as torch's clip over the parameters sums them
        for group in self.param_groups:
            for p in group["params"]:
                b, i = self._where[p]
                if b.gathered is not None and i in b.copied:
                    b.stepped[i].grad = b.grads[i]  # (16-bit gradients with master weights)
                    held.append(b.stepped[i])
        try:
            kwargs = {} if foreach is None else {"foreach": foreach}
            return torch.nn.utils.clip_grad_norm_(held, max_norm, norm_type, error_if_nonfinite, **kwargs)
        finally:
            for h in held:
                h.grad = None

    def remove_hooks(self):
        """Takes the post-accumulate-grad hooks away (they and the optimizer keep each other
        alive until then, as step_in_backward's) and stops the worker thread."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._worker is not None:
            self._jobs.put(None)
            self._worker = None

    # ---- internals ---------------------------------------------------------------------------

    def _add_buckets(self, group_index):
        group = self.param_groups[group_index]
        params = list(group["params"])
        for p in params:
            if not p.is_cuda:
                raise ValueError(f"CPUOffload: every parameter must be a CUDA tensor, not one on {p.device}")
            if p.dtype not in _DTYPES:
                raise ValueError(f"CPUOffload: parameters must be float32, bfloat16 or float16 (float32 masters), not "
                                 f"{p.dtype}")
            if self._device is None:
                self._device = p.device
            elif p.device != self._device:
                raise ValueError(f"CPUOffload: every parameter must be on one device ({self._device}), not {p.device}")
        if self._d2h is None and self._device is not None:
            with torch.cuda.device(self._device):
                self._d2h, self._h2d = torch.cuda.Stream(), torch.cuda.Stream()
                self._written = torch.cuda.Event()
        masters = _pinned_views(params, torch.float32)
        for m, p in zip(masters, params):
            m.copy_(p.detach())
        # The dtype a parameter's gradient and its stepped host tensor have: the parameter's own
        # with master weights (16-bit in, 16-bit out), else float32 (the master itself).
        wire = [p.dtype if self._master_weights and p.dtype != torch.float32 else torch.float32 for p in params]
        grads, stepped = [None] * len(params), list(masters)
        for dtype in set(wire):
            js = [j for j in range(len(params)) if wire[j] == dtype]
            for j, g in zip(js, _pinned_views([params[j] for j in js], dtype, zero=True)):
                grads[j] = g
            if dtype != torch.float32:
                for j, h in zip(js, _pinned_views([params[j] for j in js], dtype)):
                    stepped[j] = h
        # Buckets in the reverse order of the group's parameters.
        order, chunk, chunk_bytes = list(range(len(params)))[::-1], [], 0
        chunks = []
        for j in order:
            chunk.append(j)
            chunk_bytes += 4 * params[j].numel()
            if chunk_bytes >= self.bucket_bytes:
                chunks.append(chunk)
                chunk, chunk_bytes = [], 0
        if chunk:
            chunks.append(chunk)
        hyper = {k: v for k, v in group.items() if k != "params"}
        for chunk in chunks:
            # One group of the optimizer for the float32 masters, one with master weights for the
            # 16-bit parameters' host copies.
            inner = [[i for i, j in enumerate(chunk) if (wire[j] != torch.float32) == low] for low in (False, True)]
            inner = [indices for indices in inner if indices]
            b = _Bucket(group_index, [params[j] for j in chunk], chunk, [masters[j] for j in chunk],
                        [grads[j] for j in chunk], [stepped[j] for j in chunk], None, inner)
            b.optimizer = self.optimizer_class(
                [dict(hyper, **self._inner_options(b, indices), params=[b.stepped[i] for i in indices])
                 for indices in inner], **self._kwargs)
            b.optimizer._release_gil = True  # its host step runs on the worker thread without the GIL
            for i in range(len(chunk)):
                self._refresh_host_copy(b, i)  # the host copies' first values
            self._buckets.append(b)
            for i, p in enumerate(b.params):
                self._where[p] = (b, i)
                if self.overlap and p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._ready))

    def _ready(self, p):
        """A parameter's gradient is complete (autograd's thread): launches its bucket when the
        bucket's last gradient is."""
        if self._accumulating:
            return
        b, _ = self._where[p]
        if b.launched:
            raise RuntimeError("CPUOffload: a backward reached parameters already stepped since the last step(); "
                               "call opt.step() after each backward, and run the backward of every micro-batch but "
                               "the last under `with opt.accumulate():`")
        b.ready += 1
        if b.ready >= b.expected:
            self._launch(b, gather=False)

    def _launch(self, b, gather):
        """Copies the bucket's gradients to the host (side stream, after what is queued on the
        current stream now) and frees them; then queues its step (or keeps it for a clip)."""
        b.launched = True
        b.copied = [i for i, p in enumerate(b.params) if p.grad is not None]
        if not b.copied:
            return
        for i in b.copied:
            g = b.params[i].grad
            if g.is_sparse:
                raise RuntimeError("CPUOffload does not support sparse gradients")
        # Parameters changed outside the optimizer since its last step (a checkpoint loaded
        # into the model): their masters take the new values first (current stream, blocking).
        for i, p in enumerate(b.params):
            if p._version != b.versions[i]:
                b.masters[i].copy_(p.detach())
                self._refresh_host_copy(b, i)
                b.versions[i] = p._version
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self._device))
        self._d2h.wait_event(ready)
        with torch.cuda.stream(self._d2h):
            for i in b.copied:
                p = b.params[i]
                g = p.grad
                b.grads[i].copy_(g, non_blocking=True)  # (converted to float32 on the GPU first where it is 16-bit)
                g.record_stream(self._d2h)  # its memory is not reused before the copy is done
                p.grad = None
            copied = torch.cuda.Event()
            copied.record(self._d2h)
        if gather:
            b.gathered = (copied, ready)
        else:
            self._submit(b, copied, ready)

    def _submit(self, b, copied, ready):
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=_serve, args=(self._jobs,), name="fusedopt-offload", daemon=True)
            self._worker.start()
        self._jobs.put(functools.partial(self._run_bucket, b, copied, ready))

    def _run_bucket(self, b, copied, ready):
        """The worker's part: waits for the gradients, steps the masters, copies them back."""
        if self._error is not None:
            return  # an earlier bucket failed: step() raises it
        try:
            copied.synchronize()  # the GIL is released while waiting
            for i in b.copied:
                b.stepped[i].grad = b.grads[i]
                if "master" not in b.optimizer.state.get(b.stepped[i], ()):
                    self._link_master(b, i)  # its first step: the state starts at the master
            try:
                group = self.param_groups[b.group_index]
                for inner_group in b.optimizer.param_groups:
                    for k, v in group.items():
                        if k != "params":
                            inner_group[k] = v
                b.optimizer.step()
            finally:
                for i in b.copied:
                    b.stepped[i].grad = None
            with torch.cuda.device(self._device), torch.cuda.stream(self._h2d), torch.no_grad():
                self._h2d.wait_event(ready)  # after every use of the parameters queued before their gradients
                for i in b.copied:
                    # .data: a write autograd does not count (backward may still be running); the
                    # master converted on the GPU, or the 16-bit host copy as it is
                    b.params[i].data.copy_(b.stepped[i], non_blocking=True)
                self._written.record(self._h2d)
                self._wrote = True
        except BaseException as e:  # noqa: B902 - handed to step()
            self._error = e

    def _drain(self):
        """Waits for the queued buckets; raises the worker's error."""
        self._jobs.join()
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"CPUOffload: a host step failed: {error}") from error


class _StateView:
    """``CPUOffload.state``: the host state of each CUDA parameter (its bucket's optimizer's state
    of its master), read-only."""

    def __init__(self, offload):
        self._offload = offload

    def __getitem__(self, p):
        b, i = self._offload._where[p]
        return b.optimizer.state[b.stepped[i]]

    def get(self, p, default=None):
        where = self._offload._where.get(p)
        if where is None:
            return default
        b, i = where
        return b.optimizer.state.get(b.stepped[i], default)

    def __contains__(self, p):
        where = self._offload._where.get(p)
        return where is not None and bool(where[0].optimizer.state.get(where[0].stepped[where[1]]))

    def __iter__(self):
        for b in self._offload._buckets:
            for p, s in zip(b.params, b.stepped):
                if b.optimizer.state.get(s):
                    yield p

    def __len__(self):
        return sum(1 for _ in self)

    def items(self):
        return ((p, self[p]) for p in self)

    def values(self):
        return (self[p] for p in self)

    def keys(self):
        return iter(self)
