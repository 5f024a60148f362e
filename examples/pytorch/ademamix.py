"""AdEMAMix (Pagliardini, Ablin, Grangier 2024: "The AdEMAMix Optimizer: Better, Faster, Older") as a
fusedopt_torch user rule: a fast and a slow EMA of the gradient mixed by alpha, with the paper's
alpha and beta3 warmups (apple/ml-ademamix's schedulers), one fused kernel over every parameter.

    python3 examples/pytorch/ademamix.py        # trains a small model for a few steps
"""

import fusedopt_torch

AdEMAMix = fusedopt_torch.rule(
    "AdEMAMix",
    hypers=dict(lr=1e-3, beta1=0.9, beta2=0.999, beta3=0.9999, alpha=2.0, beta3_warmup=0, alpha_warmup=0, eps=1e-8,
                weight_decay=0.0),
    states=dict(exp_avg_fast=0.0, exp_avg_slow=0.0, exp_avg_sq=0.0),
    constants=dict(
        alpha_t="alpha_warmup > 0 ? alpha * min(1.0, double(step) / alpha_warmup) : alpha",
        # beta3's half-life interpolated from beta1's to beta3's over beta3_warmup steps.
        a3="beta3_warmup > 0 ? min(1.0, double(step) / beta3_warmup) : 1.0",
        beta3_t="beta3_warmup > 0 ? pow(0.5, 1.0 / ((1 - a3) * (log(0.5) / log(beta1 + 1e-8) - 1)"
                " + a3 * (log(0.5) / log(beta3 + 1e-8) - 1) + 1)) : beta3",
        bias_correction1="1 - pow(beta1, step)",
        bias_correction2_sqrt="sqrt(1 - pow(beta2, step))"),
    body="""
        exp_avg_fast = beta1 * exp_avg_fast + (1 - beta1) * grad;
        exp_avg_slow = beta3_t * exp_avg_slow + (1 - beta3_t) * grad;
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad;
        T const denom = sqrt(exp_avg_sq) / bias_correction2_sqrt + eps;
        T const update = (exp_avg_fast / bias_correction1 + alpha_t * exp_avg_slow) / denom;
        param -= lr * (update + weight_decay * param);
    """,
    doc="AdEMAMix (apple/ml-ademamix's arguments, betas given apart as beta1, beta2, beta3).")

if __name__ == "__main__":
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).to(device)
    opt = AdEMAMix(model.parameters(), lr=1e-3, alpha=5.0, beta3_warmup=100, alpha_warmup=100, weight_decay=0.01)
    x, y = torch.randn(512, 64, device=device), torch.randn(512, 1, device=device)
    for step in range(200):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
