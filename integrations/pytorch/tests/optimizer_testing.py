"""What the tests of the ctypes-unit optimizers share (test_adafactor.py, test_came.py,
test_prodigy.py): parameters and their twins, gradients, the relative difference they are judged
by, steps of an optimizer and its reference compared after each, one step captured in a CUDA
graph and replayed beside an eager optimizer, and a step under capture refused without
capturable=True. (bench/adafactor.py and bench/library_rules.py load those test
files for their references with this folder on sys.path.)"""
import pytest
import torch


def make_params(device, dtype=torch.float32, shapes=(), seed=0):
    """Parameters of `shapes`, standard normal from `seed` (the same values on every device)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_() for s in shapes]


def twin_of(params):
    return [p.detach().clone().requires_grad_() for p in params]


def set_grads(params, step, scale=1.0):
    """The same gradients for every list of the same shapes (new tensors: set_to_none's)."""
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = (scale * torch.randn(p.shape, generator=gen)).to(device=p.device, dtype=p.dtype)


def relative(a, b):
    """|a - b|'s largest element over b's largest magnitude (0 for empty tensors)."""
    if b.numel() == 0:
        return 0.0
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def step_both(opt, ref, ours, theirs, steps, first=1, *, differences, tolerances):
    """`steps` steps of `opt` over `ours` and of the reference `ref` over `theirs` on the same
    gradients (new tensors every step, ten times larger every fourth), compared after each by
    `differences(opt, ref, ours, theirs)` -> (parameters', state's worst relative difference),
    each within its bound of tolerances[dtype] times the step number; the worst differences."""
    worst = [0.0, 0.0]
    tolerance = tolerances[ours[0].dtype]
    for step in range(first, first + steps):
        opt.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        scale = 10.0 if step % 4 == 0 else 1.0  # larger gradients: clipping and eps bounds move
        set_grads(ours, step, scale)
        set_grads(theirs, step, scale)
        opt.step()
        ref.step()
        d = differences(opt, ref, ours, theirs)
        worst = [max(w, x) for w, x in zip(worst, d)]
        assert d[0] <= tolerance[0] * step and d[1] <= tolerance[1] * step, (step, d)
    return worst


def replay_beside_eager(graphed, eager, steps, check):
    """Captures one step of `graphed` (whose plans an ordinary step built before), then `steps`
    times: a replay, a step of `eager`, check(step) with steps counted from 2."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # on torch's capture stream: nothing runs until a replay
        graphed.step()
    for step in range(2, 2 + steps):
        graph.replay()
        eager.step()
        torch.cuda.synchronize()
        check(step)


def assert_refused_under_capture(opt):
    """`opt` (not capturable), after an ordinary step over gradients of ones that builds its
    plans, raises under capture with a message that names capturable=True."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(RuntimeError, match="capturable=True"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            opt.step()
