"""fusedopt_torch: drop-in torch.optim optimizers running fused fusedopt steps, and optimizers of
your own written as a few lines of C++ (fusedopt_torch.rule).

    import fusedopt_torch
    opt = fusedopt_torch.AdamW(model.parameters(), lr=3e-4)   # torch.optim.AdamW's arguments

CUDA tensors step through fusedopt's CUDA backend (one launch per parameter group and dtype,
plans cached across steps), CPU tensors through its host backend. Importing compiles nothing:
the first step compiles (or loads from the cache) the kernels of the dtypes it meets. See
docs/pytorch.md.
"""

from .optimizers import (LAMB, SGD, SGD8bit, Adadelta, Adagrad, Adam, Adam8bit, Adamax, AdamW,  # noqa: F401
                         AdamW8bit, FusedOptimizer, Lion, Lion8bit, NAdam, RAdam, RMSprop, dequantize_state,
                         quantize_state)
from . import _ext
from .rules import RuleCompileError, RuleOptimizer, State, rule  # noqa: F401
from .in_backward import StepInBackward, step_in_backward  # noqa: F401
from .ddp_in_backward import DDPStepInBackward, ddp_step_in_backward  # noqa: F401
from .offload import CPUOffload  # noqa: F401
from .library_rules import (ADOPT, ASGD, AdEMAMix, AdEMAMix8bit, Adan, CAdamW, CWDAdamW, Rprop,  # noqa: F401
                            ScheduleFreeAdamW, ScheduleFreeSGD, StableAdamW)
from .muon import Muon, MuonWithAdamW  # noqa: F401
from .adafactor import Adafactor  # noqa: F401
from .came import CAME  # noqa: F401
from .prodigy import Prodigy  # noqa: F401


def extension():
    """The core module (loaded, or compiled into the cache, on first use)."""
    return _ext.load()


def with_cuda():
    """Whether the core was built with CUDA (its kernels are compiled on demand)."""
    return bool(_ext.load().with_cuda)


__all__ = ["FusedOptimizer", "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "RAdam", "NAdam", "Adamax", "Adadelta", "LAMB", "Lion",
           "Adam8bit", "AdamW8bit", "Lion8bit", "SGD8bit", "quantize_state", "dequantize_state", "extension", "with_cuda", "rule", "State", "RuleOptimizer",
           "RuleCompileError", "Rprop", "ASGD", "AdEMAMix", "AdEMAMix8bit", "Adan", "ADOPT", "StableAdamW", "CAdamW", "CWDAdamW", "ScheduleFreeAdamW",
           "ScheduleFreeSGD", "step_in_backward", "StepInBackward", "ddp_step_in_backward", "DDPStepInBackward",
           "CPUOffload", "Muon", "MuonWithAdamW", "Adafactor",
           "CAME", "Prodigy"]
