"""fusedopt_torch.ddp_step_in_backward (issue 46, item 1: DDP through a comm hook that steps each
bucket after its all-reduce) against the ordinary DDP loop, bit for bit, with two ranks under
torchrun (tests/ddp_in_backward_check.py): gloo on CPU tensors (any machine with torch), gloo on
CUDA tensors (the two ranks may share one GPU: the hook's CUDA path, its side stream), NCCL (one GPU
per rank: skipped with fewer than 2 GPUs). Cases: two parameter groups and a StepLR, a state_dict
round trip, gradient_as_bucket_view, static_graph, no_sync() accumulation, four optimizer classes,
the refusals."""

import json
import os
import subprocess
import sys

import pytest
import torch

import fusedopt_torch as ft

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {"AdamW two groups StepLR state_dict", "AdamW gradient_as_bucket_view", "AdamW static_graph",
         "AdamW no_sync accumulation", "AdamW no_sync accumulation gradient_as_bucket_view", "Adam_amsgrad",
         "SGD_nesterov", "Lion", "refusals"}


def _warm(device):
    """Loads (or compiles into the cache) the units the ranks will step with, in this process
    first: the two ranks then find them instead of waiting on one compile."""
    model = torch.nn.Linear(8, 8).to(device)
    for opt in (ft.AdamW(model.parameters(), lr=1e-3), ft.Adam(model.parameters(), lr=1e-3, amsgrad=True),
                ft.SGD(model.parameters(), lr=1e-3, momentum=0.9, nesterov=True), ft.Lion(model.parameters(), lr=1e-3)):
        model(torch.ones(2, 8, device=device)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode", ["gloo-cpu", "gloo-cuda", "nccl"])
def test_bits_as_the_ordinary_ddp_loop(tmp_path, mode):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if mode.startswith("gloo") and not dist.is_gloo_available():
        pytest.skip("gloo is not available")
    if mode == "gloo-cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if mode == "nccl" and (not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available()):
        pytest.skip("needs 2 GPUs and NCCL")
    _warm("cpu" if mode == "gloo-cpu" else "cuda")
    out = tmp_path / "ddp_in_backward.json"
    env = dict(os.environ, FUSEDOPT_DDP_IN_BACKWARD_JSON=str(out))
    # NVLink multicast can take shared GPUs down: keep it off (as tests/test_distributed.py does).
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(HERE, "ddp_in_backward_check.py"), mode],
                          env=env, capture_output=True, text=True, timeout=300)
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["mode"] == mode
    rows = result["rows"]
    assert {r["case"] for r in rows} >= CASES
    assert all(r["ok"] for r in rows), rows


def test_refuses_a_plain_module():
    # No process group needed: the type is checked first.
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        ft.ddp_step_in_backward(model, ft.AdamW(model.parameters()))
