"""What the capturable tests of the ctypes-unit optimizers share (test_adafactor.py, test_came.py,
test_prodigy.py): one step captured in a CUDA graph and replayed beside an eager optimizer, and
a step under capture refused without capturable=True. Imported inside the tests (bench scripts
load those files for their references, without this folder on sys.path)."""
import pytest
import torch


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
