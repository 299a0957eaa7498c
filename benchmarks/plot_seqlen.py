"""Plot effective TFLOP/s against sequence length from a bench_attention.py sweep (runs anywhere).

    python benchmarks/bench_attention.py --shapes sweep --baselines default flash cudnn sage --out sweep.json  # GPU
    python benchmarks/plot_seqlen.py sweep.json benchmarks/results/seqlen.png
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import SWEEP  # noqa: E402

LABELS = {"sdpa_default": "SDPA default (cuDNN)", "sdpa_flash": "FlashAttention-2 (SDPA flash)",
          "sdpa_cudnn": "cuDNN (SDPA cudnn)", "sageattention": "SageAttention", "fsattn[default]": "fsattn"}


def series(rows):
    """{method: [(seq_len, tflops), ...]} over the sweep's shapes, errors left out."""
    out = {}
    for row in rows:
        shape = SWEEP.get(row["shape"])
        if shape is None or "tflops" not in row:
            continue
        out.setdefault(row["method"], []).append((shape.seq_q, row["tflops"]))
    return {m: sorted(points) for m, points in out.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results")
    parser.add_argument("png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.results) as f:
        data = json.load(f)
    lines = series(data["rows"])
    if not lines:
        raise SystemExit(f"{args.results} has no rows of the sweep shapes ({', '.join(SWEEP)})")
    env = data.get("environment", {})
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for method, points in lines.items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=LABELS.get(method, method), linewidth=2.2 if "fsattn" in method else 1.4)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (queries = keys), 12 heads x 128, batch 1")
    ax.set_ylabel("effective TFLOP/s (4·S²·H·D / time)")
    ax.set_title(f"{env.get('gpu', '?')}, torch {env.get('torch', '?')}, Triton {env.get('triton', '?')}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
