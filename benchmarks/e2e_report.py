"""bench_e2e.json for people: a plot of decode tokens/s against batch (one line per system, each system's largest
batch at each KV budget marked, and dashed, the tokens/s each engine would reach at its floor: the bytes a step reads
at the device's read rate) and markdown tables. Kept apart so that the benchmark reads as its measurements.

    python benchmarks/e2e_report.py benchmarks/results/bench_e2e_h200.json   # writes the .png and .md beside it
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
        floors = {run["batch"]: run["batch"] / run["floor"]["floor_ms_per_step"] * 1e3 for run in result["runs"]
                  if run["system"] == system and (run.get("floor") or {}).get("floor_ms_per_step")
                  and "error" not in run}
        if floors:
            fx = sorted(floors)
            ax.plot(fx, [floors[x] for x in fx], color=color, linestyle="--", linewidth=1,
                    label=f"{label}: at its floor")
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


def _fmt(x, spec=".0f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(result: dict) -> str:
    """Per system: largest batch and tok/s there at each budget, tok/s at the fixed batches, ratios against the raw
    engine, wall time per step over GPU kernel time; then the bars."""
    runs = [r for r in result["runs"] if "error" not in r and r.get("tok_s")]
    fixed = sorted({r["batch"] for r in runs if r.get("kind") == "fixed"})
    budgets = result["budgets"]
    head = (["system"] + [f"largest batch, {b}" for b in budgets] + [f"tok/s at largest, {b}" for b in budgets]
            + [f"tok/s at {b}" for b in fixed] + ["wall / GPU kernels"])
    lines = [f"> {result['note']}", ""] if result.get("note") else []
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    raw_fixed = {r["batch"]: r["tok_s"] for r in runs if r["system"] == "raw" and r.get("kind") == "fixed"}
    raw_largest = result["largest_batch"].get("raw", {})
    for system, (_, _, label) in STYLE.items():
        mine = [r for r in runs if r["system"] == system]
        if not mine:
            continue
        largest = result["largest_batch"].get(system, {})
        cells = [label]
        for b in budgets:
            x, raw = largest.get(b, {}), raw_largest.get(b, {})
            ratio = (f" ({x['batch'] / raw['batch']:.2f}×)" if system != "raw" and x.get("batch") and raw.get("batch")
                     else "")
            cells.append(_fmt(x.get("batch"), "d") + ratio)
        for b in budgets:
            x, raw = largest.get(b, {}), raw_largest.get(b, {})
            ratio = (f" ({x['tok_s'] / raw['tok_s']:.2f}×)" if system != "raw" and x.get("tok_s") and raw.get("tok_s")
                     else "")
            cells.append(_fmt(x.get("tok_s")) + ratio)
        for b in fixed:
            t = next((r["tok_s"] for r in mine if r.get("kind") == "fixed" and r["batch"] == b), None)
            ratio = f" ({t / raw_fixed[b]:.2f}×)" if system != "raw" and t and raw_fixed.get(b) else ""
            cells.append(_fmt(t) + ratio)
        over = [r["wall_over_kernel"] for r in mine if "wall_over_kernel" in r]
        cells.append(f"{min(over):.2f}–{max(over):.2f}" if over else "–")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| system | batch | ms/step | floor ms/step | wall / floor | GPU busy / floor | kernels/step |",
              "|---|---|---|---|---|---|---|"]
    for r in runs:
        if r.get("floor") and r["system"] in STYLE:
            where = f" (largest, {r['budget']})" if r.get("kind") == "largest" else ""
            lines.append(f"| {STYLE[r['system']][2]} | {r['batch']}{where} "
                         f"| {r['wall_ms_per_step']:.2f} | {r['floor']['floor_ms_per_step']:.2f} "
                         f"| {r['wall_over_floor']:.3f} | {_fmt(r.get('busy_over_floor'), '.3f')} "
                         f"| {_fmt(r.get('kernels_per_step'))} |")
    prefills = [r for r in result["runs"] if r.get("kind") == "prefill" and "error" not in r]
    if prefills:
        lines += ["", "| system | prefill | prefill tok/s | TTFT, first | TTFT, last |", "|---|---|---|---|---|"]
        for r in prefills:
            lines.append(f"| {STYLE[r['system']][2]} | {r['batch']} x {r['prompt_len']} (chunks of "
                         f"{r['prefill_chunk']}) | {_fmt(r['prefill_tok_s'])} | {min(r['ttft_s']):.3f} s "
                         f"| {max(r['ttft_s']):.3f} s |")
    startup = [(j["system"], j["budget"], j["startup_s"]) for j in result.get("jobs", []) if j.get("startup_s")]
    if startup:
        lines += ["", "Start-up (model build, engine, compilation and the first graph, to the first decoded token): "
                  + ", ".join(f"{STYLE[s][2]} @ {b}: {t:.1f} s" for s, b, t in startup)]
    lines += ["", "| bar | target | measured | |", "|---|---|---|---|"]
    for bar in result.get("bars", []):
        met = "" if bar["met"] is None else ("met" if bar["met"] else "**missed**")
        lines.append(f"| {bar['bar']} | {bar['target']} | {_fmt(bar['measured'], '.3f')} | {met} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    src = pathlib.Path(sys.argv[1])
    data = json.loads(src.read_text())
    plot(data, src.with_suffix(".png"))
    src.with_suffix(".md").write_text(markdown(data))
    print(markdown(data))
