"""PyTorch Lightning's Trainer with fusedopt_torch optimizers (issue 41): mixed precision with
gradient clipping trains as with torch.optim.AdamW, while plain GradScaler loops keep the fused
protocol (FusedOptimizer._step_supports_amp_scaling). Skipped where lightning is not installed."""

import pytest
import torch

import fusedopt_torch as ft

L = pytest.importorskip("lightning")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (16-mixed precision)")


class Tiny(L.LightningModule):
    def __init__(self, make_optimizer):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
        self.make_optimizer = make_optimizer

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def train(make_optimizer, precision="16-mixed", clip=1.0, steps=20):
    torch.manual_seed(0)
    model = Tiny(make_optimizer)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(640, 32, generator=gen), torch.randn(640, 1, generator=gen) * 10
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    trainer = L.Trainer(max_steps=steps, precision=precision, gradient_clip_val=clip, accelerator="gpu", devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, data)
    return [p.detach().float().cpu() for p in model.parameters()]


@pytest.mark.parametrize("clip", [1.0, None], ids=["clip", "no-clip"])
def test_16_mixed_trains_as_torch_adamw(clip):
    """Lightning refuses gradient clipping with an optimizer that unscales internally; fusedopt's
    default (fused=None) lets it unscale and clip, then steps through the fused protocol."""
    ours = train(lambda p: ft.AdamW(p, lr=1e-2), clip=clip)
    theirs = train(lambda p: torch.optim.AdamW(p, lr=1e-2), clip=clip)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_bf16_mixed_and_user_rules():
    rule = ft.rule("LightningSGD", hypers=dict(lr=0.1), body="param -= lr * grad;")
    ours = train(lambda p: rule(p, lr=0.05), precision="bf16-mixed")
    theirs = train(lambda p: torch.optim.SGD(p, lr=0.05), precision="bf16-mixed")
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_fused_true_behaves_as_torch_fused():
    """fused=True claims the protocol to everyone, as torch's fused AdamW: Lightning then refuses
    clipping for both, with the same message."""
    for make in (lambda p: ft.AdamW(p, lr=1e-2, fused=True), lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True)):
        with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
            train(make, clip=1.0, steps=2)


def test_plain_gradscaler_loops_keep_the_fused_protocol():
    p = [torch.zeros(3, device="cuda", requires_grad=True)]
    assert ft.AdamW(p)._step_supports_amp_scaling  # as GradScaler reads it
    assert not ft.AdamW(p, fused=False)._step_supports_amp_scaling
    assert not ft.Lion(p)._step_supports_amp_scaling
