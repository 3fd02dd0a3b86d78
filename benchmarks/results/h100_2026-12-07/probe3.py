"""Probe builds of the prefill kernel (ZIPKV_PREFILL_PROBE bits: 1 no rebuild, 2 no copies, 4 no MMA/softmax,
8 one more staging buffer): zipkv's time for each, FlashInfer in the same run. Usage: probe3.py OUT.json PROBES..."""
import json
import math
import os
import sys

import torch

sys.path.insert(0, "benchmarks")
import bench_decode as bd  # noqa: E402
import bench_prefill as bp  # noqa: E402
import torch_zipkv  # noqa: E402

out_path, probes = sys.argv[1], [int(x) for x in sys.argv[2:]]
gen = torch.Generator().manual_seed(0)
flush = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
streams = bd.real_streams("cuda")
shape = bp.LLAMA
rows = []
for q_len, ctx, batch in [(512, 8192, 1), (512, 8192, 8)]:
    Hq, Hkv, D = shape["Hq"], shape["Hkv"], shape["D"]
    ppr = ctx // bp.PAGE
    n = batch * ppr
    indptr = torch.arange(0, n + 1, ppr, dtype=torch.int32, device="cuda")
    indices = torch.randperm(n, generator=gen).to(torch.int32).cuda()
    last = torch.full((batch,), bp.PAGE, dtype=torch.int32, device="cuda")
    qo = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * q_len, Hq, D, generator=gen).to(torch.bfloat16).cuda()
    scale = 1 / math.sqrt(D)
    kv_real = bd.real_like_pages(n, Hkv, D, streams, gen)
    kv_rand = bd.compressible_randn((n, 2, bp.PAGE, Hkv, D), gen).cuda()
    c_real, c_raw = bd.store(kv_real, True), bd.store(kv_rand, False)
    w, _ = bp.flashinfer_prefill(qo, indptr, indices, last, shape, scale, "cuda")
    ref = w.run(q, kv_real).float()
    out = torch.empty_like(q)
    base = None
    for probe in probes:
        os.environ["ZIPKV_PREFILL_PROBE"] = str(probe)
        f_real = lambda: torch_zipkv.paged_prefill(q, qo, c_real, indptr, indices, last, sm_scale=scale, out=out)  # noqa
        f_raw = lambda: torch_zipkv.paged_prefill(q, qo, c_raw, indptr, indices, last, sm_scale=scale, out=out)  # noqa
        o = f_real().clone()
        torch.cuda.synchronize()
        rel = ((o.float() - ref).norm() / ref.norm()).item()
        if probe == 0:
            base = o
        same = bool(torch.equal(o, base)) if base is not None else None
        t = bd.time_round_robin({"real": f_real, "raw": f_raw, "fi": lambda: w.run(q, kv_real)}, 10, flush)
        us = {k: sorted(v)[len(v) // 2] for k, v in t.items()}
        row = {"probe": probe, "q_len": q_len, "ctx": ctx, "batch": batch, "us": us, "rel_diff_vs_fi": rel,
               "bits_equal_probe0": same}
        print(probe, q_len, ctx, batch, {k: round(v, 1) for k, v in us.items()}, f"rel {rel:.4f} same {same}",
              flush=True)
        rows.append(row)
    os.environ["ZIPKV_PREFILL_PROBE"] = "0"
with open(out_path, "w") as f:
    json.dump(rows, f, indent=1)
