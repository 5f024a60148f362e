"""fusedopt_torch: drop-in torch.optim optimizers running fused fusedopt steps.

    import fusedopt_torch
    opt = fusedopt_torch.AdamW(model.parameters(), lr=3e-4)   # torch.optim.AdamW's arguments

CUDA tensors step through fusedopt's CUDA backend (one launch per parameter group and dtype,
plans cached across steps), CPU tensors through its host backend. See docs/pytorch.md.
"""

from .optimizers import (LAMB, SGD, Adadelta, Adagrad, Adam, Adamax, AdamW, FusedOptimizer, Lion, NAdam,  # noqa: F401
                         RAdam, RMSprop)
from . import _ext


def extension():
    """The compiled extension module (built on first use)."""
    return _ext.load()


def with_cuda():
    """Whether the extension was built with its CUDA kernels."""
    return bool(_ext.load().with_cuda)


__all__ = ["FusedOptimizer", "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "RAdam", "NAdam", "Adamax", "Adadelta", "LAMB", "Lion",
           "extension", "with_cuda"]
