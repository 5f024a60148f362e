"""fusedopt_torch under torchrun: FSDP2, DDP and ZeroRedundancyOptimizer against torch's own
optimizers (tests/distributed_check.py, one process per GPU), with one rank (FSDP2's DTensor
parameters then hold whole tensors as one shard) and with two. Each is skipped without as many GPUs."""

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("ranks", [1, 2])
def test_fsdp2_ddp_and_zero_under_torchrun(tmp_path, ranks):
    if not torch.cuda.is_available() or torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPU(s)")
    out = tmp_path / "distributed.json"
    env = dict(os.environ, FUSEDOPT_DISTRIBUTED_JSON=str(out))
    # NVLink multicast can take shared GPUs down: keep it off (DEVELOPERS.md).
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                           os.path.join(HERE, "distributed_check.py")],
                          env=env, capture_output=True, text=True, timeout=600)
    print(done.stdout[-4000:])
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == ranks
    rows = result["rows"]
    assert {r["case"] for r in rows} >= {"fsdp2 AdamW", "fsdp2 AdamW against unsharded torch AdamW", "ddp AdamW", "zero AdamW",
                                         "fsdp2 LAMB refuses DTensor"}
    assert all(r["ok"] for r in rows), rows
