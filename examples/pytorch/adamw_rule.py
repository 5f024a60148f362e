"""torch.optim.AdamW written as a fusedopt_torch user rule, in fusedopt's order of operations (the
bias corrections folded into two per-step constants, as fusedopt.rules.adamw): its steps have the
bits of fusedopt_torch.AdamW's (tests/test_rules.py checks it), and its speed (bench/custom_rules.py).
"""

import fusedopt_torch

AdamWRule = fusedopt_torch.rule(
    "AdamWRule",
    hypers=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2),
    states=dict(exp_avg=0.0, exp_avg_sq=0.0),
    constants=dict(decay="weight_decay != 0 ? 1 - lr * weight_decay : 1.0",
                   one_minus_beta1="1 - beta1",
                   one_minus_beta2="1 - beta2",
                   correction2="sqrt(1 - pow(beta2, step))",
                   scaled_eps="eps * correction2",
                   step_scale="correction2 / (1 - pow(beta1, step))",
                   neg_lr="-lr"),
    body="""
        param *= decay;
        exp_avg += one_minus_beta1 * (grad - exp_avg);
        exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad;
        param += exp_avg / (sqrt(exp_avg_sq) + scaled_eps) * step_scale * neg_lr;
    """)
