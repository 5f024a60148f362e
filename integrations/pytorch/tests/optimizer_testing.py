"""What the tests of the ctypes-unit optimizers share (test_adafactor.py, test_came.py,
test_prodigy.py): twin parameters, gradients, the relative difference they are judged by, one
step captured in a CUDA graph and replayed beside an eager optimizer, and a step under capture
refused without capturable=True. (bench/adafactor.py and bench/library_rules.py load those test
files for their references with this folder on sys.path.)"""
import pytest
import torch


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
