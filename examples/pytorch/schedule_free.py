"""Schedule-Free AdamW (Defazio et al. 2024: "The Road Less Scheduled"; facebookresearch/schedule_free's
AdamWScheduleFree) as a fusedopt_torch user rule. The element update is the rule; the scalars the
reference keeps on the host (warmup, lr_max, the weight sum and c) are kept here the same way and
passed as hyperparameters every step. train()/eval() move the parameters between y (where
gradients are taken) and x (the average to evaluate).

    python3 examples/pytorch/schedule_free.py   # trains a small model for a few steps
"""

import torch

import fusedopt_torch

_Rule = fusedopt_torch.rule(
    "ScheduleFreeAdamWRule",
    hypers=dict(lr=0.0025, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, lr_t=0.0, c=0.0, bias_correction2=1.0),
    states=dict(z="param", exp_avg_sq=0.0),
    body="""
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad;
        T const step_dir = grad / (sqrt(exp_avg_sq / bias_correction2) + eps) + weight_decay * param;
        param += c * (z - param);                                // y = lerp(y, z, c)
        param += lr_t * (beta1 * (1 - c) - 1) * step_dir;
        z -= lr_t * step_dir;
    """)


class ScheduleFreeAdamW(_Rule):
    """AdamWScheduleFree's arguments: lr, betas (beta1, beta2), eps, weight_decay, warmup_steps, r,
    weight_lr_power. Call train() before training steps and eval() before evaluating."""

    def __init__(self, params, lr=0.0025, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup_steps=0, r=0.0,
                 weight_lr_power=2.0):
        super().__init__(params, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
        for g in self.param_groups:
            g.update(warmup_steps=warmup_steps, r=r, weight_lr_power=weight_lr_power, k=0, lr_max=-1.0,
                     weight_sum=0.0, train_mode=True)

    def step(self, closure=None):
        for g in self.param_groups:
            if not g["train_mode"]:
                raise RuntimeError("ScheduleFreeAdamW: call train() before a step")
            k = g["k"]
            lr_t = g["lr"] * ((k + 1) / g["warmup_steps"] if k < g["warmup_steps"] else 1.0)
            g["lr_max"] = max(lr_t, g["lr_max"])
            weight = (k + 1) ** g["r"] * g["lr_max"] ** g["weight_lr_power"]
            g["weight_sum"] += weight
            g.update(lr_t=lr_t, c=weight / g["weight_sum"] if g["weight_sum"] else 0.0,
                     bias_correction2=1 - g["beta2"] ** (k + 1), k=k + 1)
        return super().step(closure)

    def _swap(self, to_train):
        for g in self.param_groups:
            if g["train_mode"] != to_train:
                w = 1 - g["beta1"] if to_train else 1 - 1 / g["beta1"]
                ps = [p for p in g["params"] if "z" in self.state[p]]
                torch._foreach_lerp_([p.data for p in ps], [self.state[p]["z"] for p in ps], w)
                g["train_mode"] = to_train

    def train(self):
        self._swap(True)

    def eval(self):
        self._swap(False)


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).to(device)
    opt = ScheduleFreeAdamW(model.parameters(), lr=1e-3, warmup_steps=20)
    x, y = torch.randn(512, 64, device=device), torch.randn(512, 1, device=device)
    for step in range(200):
        opt.train()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0:
            opt.eval()
            with torch.no_grad():
                print(f"step {step}: loss at x {torch.nn.functional.mse_loss(model(x), y).item():.4f}")
