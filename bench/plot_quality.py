#!/usr/bin/env python3
"""Draws bench/quality.py's loss curves (a JSON file) into a PNG: the training loss of every
variant, smoothed over 25 steps, and the last 40% of the run enlarged.

Usage: python3 bench/plot_quality.py quality.json docs/quality.png
"""

import json
import sys


def smooth(values, width=25):
    """The moving average of `values` over `width` steps (fewer at the start); bench/muon.py's
    loss curves use it too, hence matplotlib is imported in main() only."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def main():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    source, target = sys.argv[1], sys.argv[2]
    with open(source) as f:
        result = json.load(f)
    args = result["args"]
    fig, (whole, tail) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in result["rows"]:
        y = smooth(r["losses"])
        label = f"{r['variant']} ({r['final_train']:.4f})"
        whole.plot(y, label=label, linewidth=1)
        start = int(len(y) * 0.6)
        tail.plot(range(start, len(y)), y[start:], label=label, linewidth=1)
    whole.set_title(f"GPT {args['layers']}x{args['dim']} on {args['package']}'s sources, AdamW")
    tail.set_title("last 40% of the steps")
    for ax in (whole, tail):
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (25-step mean)")
        ax.grid(alpha=0.3)
    tail.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
