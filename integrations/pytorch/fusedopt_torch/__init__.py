"""fusedopt_torch: drop-in torch.optim optimizers running fused fusedopt steps.

    import fusedopt_torch
    opt = fusedopt_torch.AdamW(model.parameters(), lr=3e-4)   # torch.optim.AdamW's arguments

CUDA tensors step through fusedopt's CUDA backend (one launch per parameter group and dtype,
plans cached across steps), CPU tensors through its host backend. See docs/pytorch.md.
"""

from .optimizers import (LAMB, SGD, SGD8bit, Adadelta, Adagrad, Adam, Adam8bit, Adamax, AdamW,  # noqa: F401
                         AdamW8bit, FusedOptimizer, Lion, Lion8bit, NAdam, RAdam, RMSprop, dequantize_state,
                         quantize_state)
from . import _ext


def extension():
    """The compiled extension module (built on first use)."""
    return _ext.load()


def with_cuda():
    """Whether the extension was built with its CUDA kernels."""
    return bool(_ext.load().with_cuda)


__all__ = ["FusedOptimizer", "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "RAdam", "NAdam", "Adamax", "Adadelta", "LAMB", "Lion",
           "Adam8bit", "AdamW8bit", "Lion8bit", "SGD8bit", "quantize_state", "dequantize_state", "extension", "with_cuda"]
