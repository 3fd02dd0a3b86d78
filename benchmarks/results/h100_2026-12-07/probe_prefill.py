"""512 query tokens over 8K at batch 1 and 8, zipkv only (real-like and raw pages), for probe builds.

Usage (GPU box, repository root): python probe_prefill.py TAG OUT.json -- prints one line per case.
"""
import json
import sys

import torch

sys.path.insert(0, "benchmarks")
import bench_decode as bd  # noqa: E402
import bench_prefill as bp  # noqa: E402

tag = sys.argv[1]
gen = torch.Generator().manual_seed(0)
flush = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
streams = bd.real_streams("cuda")
out = []
for q, c, b in [(512, 8192, 1), (512, 8192, 8)]:
    row = bp.run_case(bp.LLAMA, q, c, b, 10, streams, flush, gen, False)
    print(tag, q, c, b, {k: round(v["us"], 1) for k, v in row["results"].items()}, flush=True)
    out.append(row)
with open(sys.argv[2], "w") as f:
    json.dump(out, f)
