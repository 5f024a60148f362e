"""The transformations: Optax-compatible GradientTransformations whose update is one XLA FFI custom
call for the whole pytree (csrc/handler.cc), and their fused form `step`, which updates the
parameters and states in place (aliased buffers; donate them to jax.jit).

Every per-step value (the learning rate or a schedule's value, the betas, the bias corrections
of the step count) goes to the call in one float32[16] operand computed by jax.numpy exactly as
Optax computes it, never as a static attribute: a new learning rate does not recompile.
"""

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _build

TARGET = "fusedopt_jax_step"
# The same handler registered command-buffer compatible (csrc/handler.cc): XLA may record its
# calls into a CUDA graph and replay them without running the handler's host code.
GRAPH_TARGET = "fusedopt_jax_step_graph"

# csrc/runner.hpp `kind`
_SGD, _SGD_MOMENTUM, _ADAM, _LION, _LAMB, _CLIP_ADAM = range(6)
# csrc/optax_rules.hpp `hyper_index`
_HYPER = ("step_size", "b1", "one_minus_b1", "b2", "one_minus_b2", "eps", "eps_root", "weight_decay", "bc1", "bc2",
          "max_norm", "nesterov")
_HYPER_SIZE = 16
_SUPPORTED = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

_lock = threading.Lock()  # the dicts below; never held while a compiler runs
_registered = {}  # platform -> the handler library's path
_libraries = {}  # platform -> the loaded handler library
_units = {}  # platform -> the units loaded into it
_building = {}  # (platform, unit or None for the handler) -> the Future of its build
_pool = None  # the builds' threads, made on the first build


def _platform_of(name: str) -> str:
    return "cuda" if name in ("gpu", "cuda") else "cpu"


def _start_build(key, fn, *args):
    """The build of `key`, started now or shared with a thread that started it (under _lock)."""
    global _pool
    if _pool is None:
        jobs = int(os.environ.get("FUSEDOPT_JAX_JOBS", "0")) or (os.cpu_count() or 1)
        _pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="fusedopt_jax_build")
    future = _building.get(key)
    if future is None:
        future = _building[key] = _pool.submit(fn, *args)
    return future


def register(platform: Optional[str] = None, units=()) -> str:
    """Builds (once, cached) and registers the FFI handler for `platform` ('cpu' or 'cuda'; default:
    jax's default backend), and builds and loads `units` into it: ``"all"`` (every optimizer kind,
    form and dtype combination, 46 libraries compiled in parallel) or unit tuples
    (``_build.unit_of``'s arguments). Returns the handler library's path. Every update calls it
    with the units its step needs (the first step over a new combination compiles one unit); call
    it ahead, with ``units="all"`` where programs run that were not traced in this process
    (deserialized). Threads share a build; one whose units are loaded never waits for another's."""
    platform = _platform_of(platform or jax.default_backend())
    if isinstance(units, str) and units != "all":
        raise ValueError(f"fusedopt_jax: units must be 'all' or (kind, inplace, param, state1, state2) tuples, "
                         f"not {units!r}")
    units = _build.all_units() if units == "all" else sorted({_build.unit_of(*u) for u in units})
    with _lock:
        loaded = _units.setdefault(platform, set())
        missing = [u for u in units if u not in loaded]
        if platform in _registered and not missing:
            return _registered[platform]
        # The handler and the units compile at once (a first step waits for the longest).
        handler = None if platform in _registered else _start_build((platform, None), _build.build, platform,
                                                                       jax.ffi.include_dir())
        builds = [(u, _start_build((platform, u), _build.build_unit, platform, u)) for u in missing]
    try:
        handler_path = handler.result() if handler is not None else None
        paths = [(u, future.result()) for u, future in builds]
    finally:  # a failed build is tried again by the next call
        with _lock:
            for key in [k for k, f in _building.items() if f.done()]:
                del _building[key]
    with _lock:
        if platform not in _registered:
            library = ctypes.cdll.LoadLibrary(str(handler_path))
            xla_platform = "CUDA" if platform == "cuda" else "cpu"
            if platform == "cuda":
                plain, graph = library.FusedoptJaxStepCuda, library.FusedoptJaxStepCudaGraph
            else:  # no command buffers on the CPU: one handler under both names
                plain = graph = library.FusedoptJaxStepCpu
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(plain), platform=xla_platform)
            jax.ffi.register_ffi_target(GRAPH_TARGET, jax.ffi.pycapsule(graph), platform=xla_platform)
            library.FusedoptJaxHandlerCalls.restype = ctypes.c_long
            library.FusedoptJaxHandlerBinds.restype = ctypes.c_long
            library.FusedoptJaxAddUnit.restype = ctypes.c_int
            _registered[platform] = str(handler_path)
            _libraries[platform] = library  # keeps it loaded
        library = _libraries[platform]
        for unit, path in paths:
            if unit in loaded:  # another thread loaded it meanwhile
                continue
            message = ctypes.create_string_buffer(1024)
            if library.FusedoptJaxAddUnit(str(path).encode(), message, len(message)) != 0:
                raise _build.BuildError(f"fusedopt_jax: the unit {_build.unit_name(unit)} did not load: "
                                        f"{message.value.decode(errors='replace')}")
            loaded.add(unit)
        return _registered[platform]


def handler_calls(platform: Optional[str] = None) -> int:
    """How many times the handler of `platform` (default: jax's default backend) has run in this
    process: a step replayed from a CUDA graph (COMMAND_BUFFERS) does not run it."""
    platform = _platform_of(platform or jax.default_backend())
    register(platform)
    return int(_libraries[platform].FusedoptJaxHandlerCalls())


def handler_binds(platform: Optional[str] = None) -> int:
    """How many of the handler's calls in this process bound their leaves anew (a new plan, or
    a plan rebound to other addresses): a jitted, donated step's calls stop binding after its
    first executions."""
    platform = _platform_of(platform or jax.default_backend())
    register(platform)
    return int(_libraries[platform].FusedoptJaxHandlerBinds())


def _register_for(leaves, units):
    # Where the step may run: jax's default backend, the device jax.default_device chose, the
    # leaves' devices where they are concrete (a tracer has none), and every platform whose
    # handler is registered (fusedopt_jax.register("cpu") before a step traced under jit).
    platforms = {_platform_of(jax.default_backend())} | set(_registered)
    chosen = getattr(jax.config, "jax_default_device", None)
    if chosen is not None:
        platforms.add(_platform_of(chosen if isinstance(chosen, str) else getattr(chosen, "platform", "")))
    for x in leaves:
        try:
            platforms.update(_platform_of(d.platform) for d in x.devices())
        except Exception:
            pass
    for p in platforms:
        register(p, units)


def _f32(x):
    return jnp.asarray(x, dtype=jnp.float32)


def _one_minus(b):
    # Optax writes (1 - decay) * g: with a Python float the difference is taken in double and the
    # product's constant is float32 of it; with an array (inject_hyperparams) in the array's type.
    if isinstance(b, (int, float)):
        return np.float32(1.0 - b)
    return 1 - jnp.asarray(b)


def _bias_correction(decay, count):
    return (1 - decay ** count)  # optax.tree.bias_correction's expression


def _increment(count):
    inc = getattr(optax, "safe_increment", None) or optax.safe_int32_increment
    return inc(count)


def _is_schedule(lr):
    return callable(lr)


def _step_size(learning_rate, schedule_state):
    """-learning_rate as optax.scale_by_learning_rate computes it (the schedule at the count
    before the increment)."""
    if _is_schedule(learning_rate):
        return -1 * learning_rate(schedule_state.count)
    if isinstance(learning_rate, (int, float)):
        return np.float32(-1 * learning_rate)
    return -1 * jnp.asarray(learning_rate)


def _lr_state_after(learning_rate, lr_state):
    if _is_schedule(learning_rate):
        return optax.ScaleByScheduleState(count=_increment(lr_state.count))
    return lr_state


def _hyper(**values):
    entries = [_f32(values.get(name, 0.0)) for name in _HYPER]
    entries += [_f32(0.0)] * (_HYPER_SIZE - len(entries))
    return jnp.stack(entries)


def _flatten(treedef, tree, what):
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(f"fusedopt_jax: the {what} do not have the parameters' pytree structure: {e}") from None


class _Where:
    """Names leaf i by its path in an error message (computed only when formatted)."""

    def __init__(self, tree, i):
        self.tree, self.i = tree, i

    def __format__(self, spec):
        path = jax.tree_util.tree_flatten_with_path(self.tree)[0][self.i][0]
        return f"leaf {self.i} ({jax.tree_util.keystr(path)})"


def _call(kind, hyper, params, grads, states, inplace):
    """One FFI call over every leaf. Returns (first results: new params or updates, new states)."""
    p_leaves, treedef = jax.tree.flatten(params)
    g_leaves = _flatten(treedef, grads, "gradients")
    s_leaves = [_flatten(treedef, s, f"optimizer state ({name})") for name, s in states]
    n = len(p_leaves)
    if n == 0:
        return params, [s for _, s in states]
    p_leaves = [jnp.asarray(x) for x in p_leaves]
    g_leaves = [jnp.asarray(x) for x in g_leaves]
    s_leaves = [[jnp.asarray(x) for x in leaves] for leaves in s_leaves]
    first_types, leaf_types = [], []
    for i, (p, g) in enumerate(zip(p_leaves, g_leaves)):
        where = _Where(params, i)
        if p.dtype not in _SUPPORTED:
            raise TypeError(f"fusedopt_jax: {where}: parameter dtype {p.dtype} is not supported (float32 or bfloat16)")
        if g.dtype != p.dtype:
            raise TypeError(f"fusedopt_jax: {where}: gradient dtype {g.dtype} differs from the parameter's {p.dtype}")
        if g.shape != p.shape:
            raise ValueError(f"fusedopt_jax: {where}: gradient shape {g.shape} differs from the parameter's {p.shape}")
        types = [p.dtype]
        for (name, _), leaves in zip(states, s_leaves):
            s = leaves[i]
            if s.shape != p.shape:
                raise ValueError(f"fusedopt_jax: {where}: state {name} has shape {s.shape}, the parameter {p.shape}")
            if s.dtype not in _SUPPORTED or (p.dtype == jnp.float32 and s.dtype != jnp.float32):
                raise TypeError(f"fusedopt_jax: {where}: state {name} dtype {s.dtype} is not supported with a {p.dtype} "
                                "parameter (float32, or bfloat16 with a bfloat16 parameter)")
            types.append(s.dtype)
        leaf_types.append(types)
        promoted = jnp.bfloat16 if all(t == jnp.bfloat16 for t in types) else jnp.float32
        first_types.append(p.dtype if inplace else jnp.dtype(promoted))
    # The handler runs a plan per combination of element types, and a plan's reduction sees its
    # own leaves only: clip + AdamW's norm must be global (clip_adamw clips mixed pytrees first).
    if kind == _CLIP_ADAM and len({tuple(t) for t, p in zip(leaf_types, p_leaves) if p.size}) > 1:
        raise RuntimeError("fusedopt_jax: internal: a fused clip over several dtype combinations (clip_adamw clips "
                           "those with Optax's clip_by_global_norm first)")
    # The units the handler will look for: one per combination of element types in the call.
    code = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1}
    units = set()
    for types in leaf_types:
        t = [code[jnp.dtype(x)] for x in types] + [code[jnp.dtype(types[0])]] * (3 - len(types))
        units.add(_build.unit_of(kind, inplace, *t))
    _register_for(p_leaves + g_leaves, units)
    k = len(states)
    first_out, state_outs = [], [[] for _ in range(k)]
    per_call = _leaves_per_call(kind, n)
    for lo in range(0, n, per_call):
        part = slice(lo, min(lo + per_call, n))
        m = part.stop - lo
        results = [jax.ShapeDtypeStruct(p.shape, t) for p, t in zip(p_leaves[part], first_types[part])]
        for leaves in s_leaves:
            results += [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in leaves[part]]
        # Operands: hyper, params, grads, states; results: params or updates, states.
        aliases = {1 + (2 + j) * m + i: (1 + j) * m + i for j in range(k) for i in range(m)}
        if inplace:
            aliases.update({1 + i: i for i in range(m)})
        operands = [hyper] + p_leaves[part] + g_leaves[part] + [x for leaves in s_leaves for x in leaves[part]]
        outs = jax.ffi.ffi_call(GRAPH_TARGET if COMMAND_BUFFERS else TARGET, results, input_output_aliases=aliases)(
            *operands, kind=np.int64(kind), inplace=bool(inplace), n=np.int64(m), first=np.int64(lo))
        first_out += outs[:m]
        for j in range(k):
            state_outs[j] += outs[(1 + j) * m:(2 + j) * m]
    return treedef.unflatten(first_out), [treedef.unflatten(leaves) for leaves in state_outs]


# Leaves per custom call. XLA's compile and its per-execution handling of one custom call grow
# faster than its operand count (measured on an H200, jax 0.11, 2000 leaves: the fused AdamW
# step compiled in 40.7 s as one call, 11.7 s as calls of 256 leaves, 6.1 s of 64, 8.5 s of 32;
# docs/jax.md), so a large pytree is stepped by several calls of at most this many leaves, each
# its own plan and launch (LAMB's trust ratios are per leaf, so it splits too);
# clip_by_global_norm + AdamW keeps every leaf in one call (its norm is over all of them). 256,
# not fewer: each call costs XLA's thunk and the handler's fixed host work at every execution,
# and inside a jitted loop a 2000-leaf step took 1419 us a step in calls of 64, 817 in calls of
# 256, 710 in calls of 1000 (H200, 2026-11-30; docs/jax.md). 0 or less: one call.
def _leaves_per_call_setting():
    text = os.environ.get("FUSEDOPT_JAX_LEAVES_PER_CALL", "256")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"fusedopt_jax: FUSEDOPT_JAX_LEAVES_PER_CALL must be an integer (leaves per custom call; "
                         f"0 or less: one call), not {text!r}") from None


LEAVES_PER_CALL = _leaves_per_call_setting()


# Whether the calls go to the command-buffer-compatible handler (GRAPH_TARGET), read when a
# step is traced. XLA then records runs of at least --xla_gpu_graph_min_graph_size (default 5)
# consecutive calls into a CUDA graph, calling the handler once per set of buffer addresses, and
# replays the graph at later executions with none of the calls' host work (a pytree of 2000
# leaves: 8 calls of 256 leaves). Off by default until measured on the GPU machine (docs/jax.md).
COMMAND_BUFFERS = os.environ.get("FUSEDOPT_JAX_COMMAND_BUFFERS", "0") == "1"


def _leaves_per_call(kind, n):
    if kind == _CLIP_ADAM or LEAVES_PER_CALL <= 0:
        return max(n, 1)
    return LEAVES_PER_CALL


class FusedTransformation(optax.GradientTransformationExtraArgs):
    """An Optax GradientTransformation (init, update) whose update is one fused call, with the
    fused form `step(params, grads, state) -> (new_params, new_state)` besides: the parameters
    and states are updated in place when their buffers are donated
    (``jax.jit(step, donate_argnums=(0, 2))``). The state is Optax's own pytree, so either form
    can continue a run the other (or Optax's optimizer of the same name) started."""

    def step(self, params, grads, state):
        return self.update.fused_step(params, grads, state)


def _transformation(init, run, needs_params=True):
    """`needs_params`: whether update needs the parameters, as the Optax counterpart does (adam
    and sgd do not: there the gradients stand in for them, as a read-only operand whose values
    the rule, without weight decay, never uses)."""
    def update(updates, state, params=None, **extra_args):
        del extra_args
        if params is None:
            if needs_params:
                raise ValueError("fusedopt_jax: update needs the parameters (optax: update(grads, state, params))")
            params = updates
        return run(updates, state, params, False)

    def fused_step(params, grads, state):
        return run(grads, state, params, True)

    update.fused_step = fused_step
    return FusedTransformation(init, update)


def _cast_states(state_dtype, *trees):
    if state_dtype is None:
        return trees
    return tuple(jax.tree.map(lambda x: x.astype(state_dtype), t) for t in trees)


def _check_wd(weight_decay):
    if callable(weight_decay):
        raise NotImplementedError("fusedopt_jax: a weight-decay schedule is not supported (a number or an array)")


def _mixes_dtypes(grads, *states):
    """Whether the non-empty leaves hold more than one combination of gradient and state dtypes
    (the handler runs a plan per combination). The trees are checked by _call afterwards."""
    leaves = [jax.tree.leaves(t) for t in (grads,) + states]
    if len({len(x) for x in leaves}) != 1:
        return False  # _call names the mismatch
    return len({tuple(jnp.result_type(x) for x in column) for column in zip(*leaves) if np.prod(jnp.shape(column[0]))}) > 1


def _adam_like(kind, learning_rate, b1, b2, eps, eps_root, weight_decay, max_norm, reference, state_dtype):
    """adam (weight_decay None), adamw, lamb, clip + adamw: their states are Optax's."""
    _check_wd(weight_decay)

    def init(params):
        state = reference.init(params)
        inner = state[1] if kind == _CLIP_ADAM else state
        adam = inner[0]
        mu, nu = _cast_states(state_dtype, adam.mu, adam.nu)
        inner = (adam._replace(mu=mu, nu=nu),) + tuple(inner[1:])
        return (state[0], inner) if kind == _CLIP_ADAM else inner

    def run(grads, state, params, inplace):
        inner = state[1] if kind == _CLIP_ADAM else state
        adam, lr_state = inner[0], inner[-1]
        call_kind = kind
        if kind == _CLIP_ADAM and _mixes_dtypes(grads, adam.mu, adam.nu):
            # The fused clip's norm is one plan's reduction, and the handler runs a plan per
            # combination of dtypes: over several, Optax's own clip_by_global_norm (XLA: the global
            # norm, then the clipped gradients written), then the fused AdamW step.
            grads, _ = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
            call_kind = _ADAM
        count = _increment(adam.count)
        hyper = _hyper(step_size=_step_size(learning_rate, lr_state), b1=b1, one_minus_b1=_one_minus(b1), b2=b2,
                       one_minus_b2=_one_minus(b2), eps=eps, eps_root=eps_root,
                       weight_decay=0.0 if weight_decay is None else weight_decay,
                       bc1=_bias_correction(b1, count), bc2=_bias_correction(b2, count),
                       max_norm=0.0 if max_norm is None else max_norm)
        first, (mu, nu) = _call(call_kind, hyper, params, grads, [("mu", adam.mu), ("nu", adam.nu)], inplace)
        new_inner = (adam._replace(count=count, mu=mu, nu=nu),) + tuple(inner[1:-1]) + (
            _lr_state_after(learning_rate, lr_state),)
        return first, ((state[0], new_inner) if kind == _CLIP_ADAM else new_inner)

    # Optax's adam needs no parameters; adamw, lamb and the clipped adamw do (their decay and
    # trust ratio read them).
    return _transformation(init, run, needs_params=kind != _ADAM or weight_decay is not None)


def adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *, state_dtype=None):
    """optax.adam (nesterov=False) as one fused call. `state_dtype` (fusedopt_jax's): the dtype of
    both moments (e.g. float32 with bfloat16 parameters); Optax's `mu_dtype` sets the first one."""
    reference = optax.adam(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype)
    return _adam_like(_ADAM, learning_rate, b1, b2, eps, eps_root, None, None, reference, state_dtype)


def adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, weight_decay=1e-4, *,
          state_dtype=None):
    """optax.adamw (no mask, nesterov=False) as one fused call."""
    reference = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                            weight_decay=weight_decay)
    return _adam_like(_ADAM, learning_rate, b1, b2, eps, eps_root, weight_decay, None, reference, state_dtype)


def lamb(learning_rate, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0, weight_decay=0.0, *, state_dtype=None):
    """optax.lamb (no mask) as one fused call: a reduction pass for the per-tensor norms, then the
    update pass."""
    reference = optax.lamb(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay)
    return _adam_like(_LAMB, learning_rate, b1, b2, eps, eps_root, weight_decay, None, reference, state_dtype)


def clip_adamw(learning_rate, max_norm=1.0, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
               weight_decay=1e-4, *, state_dtype=None):
    """optax.chain(optax.clip_by_global_norm(max_norm), optax.adamw(...)) as one fused call (a
    reduction pass for the global norm, then the update pass); its state is that chain's. Over a
    pytree of several dtype combinations (the handler's plans, one per combination, each reduce
    their own leaves) Optax's clip_by_global_norm runs first, then the fused AdamW."""
    reference = optax.chain(optax.clip_by_global_norm(max_norm),
                            optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                                        weight_decay=weight_decay))
    return _adam_like(_CLIP_ADAM, learning_rate, b1, b2, eps, eps_root, weight_decay, max_norm, reference,
                      state_dtype)


def lion(learning_rate, b1=0.9, b2=0.99, mu_dtype=None, weight_decay=1e-3, *, state_dtype=None):
    """optax.lion (hard sign, no mask) as one fused call."""
    _check_wd(weight_decay)
    reference = optax.lion(learning_rate, b1=b1, b2=b2, mu_dtype=mu_dtype, weight_decay=weight_decay)

    def init(params):
        state = reference.init(params)
        (mu,) = _cast_states(state_dtype, state[0].mu)
        return (state[0]._replace(mu=mu),) + tuple(state[1:])

    def run(grads, state, params, inplace):
        lion_state, lr_state = state[0], state[-1]
        hyper = _hyper(step_size=_step_size(learning_rate, lr_state), b1=b1, one_minus_b1=_one_minus(b1), b2=b2,
                       one_minus_b2=_one_minus(b2), weight_decay=weight_decay)
        first, (mu,) = _call(_LION, hyper, params, grads, [("mu", lion_state.mu)], inplace)
        new = (lion_state._replace(count=_increment(lion_state.count), mu=mu),) + tuple(state[1:-1]) + (
            _lr_state_after(learning_rate, lr_state),)
        return first, new

    return _transformation(init, run)


def sgd(learning_rate, momentum=None, nesterov=False, accumulator_dtype=None):
    """optax.sgd as one fused call (optax.trace's momentum, Nesterov or not)."""
    reference = optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov, accumulator_dtype=accumulator_dtype)
    kind = _SGD if momentum is None else _SGD_MOMENTUM

    def run(grads, state, params, inplace):
        lr_state = state[-1]
        hyper = _hyper(step_size=_step_size(learning_rate, lr_state), b1=0.0 if momentum is None else momentum,
                       nesterov=1.0 if nesterov else 0.0)
        if kind == _SGD:
            first, _ = _call(kind, hyper, params, grads, [], inplace)
            first_state = state[0]
        else:
            first, (trace,) = _call(kind, hyper, params, grads, [("trace", state[0].trace)], inplace)
            first_state = state[0]._replace(trace=trace)
        return first, (first_state, _lr_state_after(learning_rate, lr_state))

    return _transformation(reference.init, run, needs_params=False)


