"""The picture of bench_e2e.json: decode tokens/s against batch, one line per system, each system's largest batch at
each KV budget marked. Kept apart from the benchmark so that the numbers, not the drawing, are what it reads first.

    python benchmarks/e2e_plot.py benchmarks/results/bench_e2e_h200.json [out.png]
"""

from __future__ import annotations

import json
import pathlib
import sys

STYLE = {"zipkv": ("tab:blue", "o", "engine, compressed"), "raw": ("tab:orange", "s", "engine, compression off"),
         "transformers": ("tab:gray", "^", "transformers generate_batch")}


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on the GPU box or in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for index, (system, (color, marker, label)) in enumerate(STYLE.items()):
        points = {}  # batch -> tok/s (the same batch measured under two budgets: the last one drawn wins)
        for run in result["runs"]:
            if run["system"] == system and run.get("tok_s") and "error" not in run:
                points[run["batch"]] = run["tok_s"]
        if not points:
            continue
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], color=color, marker=marker, label=label)
        for largest in result["largest_batch"].get(system, {}).values():
            b = largest.get("batch")
            if b in points:
                ax.plot([b], [points[b]], color=color, marker="*", markersize=16, markeredgecolor="black")
                ax.annotate(f"{largest['budget']}: {b}", (b, points[b]), textcoords="offset points",
                            xytext=(6, -14 - 10 * index),
                            fontsize=8, color=color)
    ax.set_xlabel("running batch (requests of %d prompt + %d new tokens)" % (result["prompt_len"],
                                                                           result["new_tokens"]))
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{result['model_name']}, {result['device_name']}\n"
                 f"★ = largest batch each system admits at a KV budget", fontsize=10)
    ax.grid(alpha=0.3)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    src = pathlib.Path(sys.argv[1])
    plot(json.loads(src.read_text()), pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png"))
