"""Short-query prefill at forced split counts (ZIPKV_PROBE_SPLITS, branch exp/short-splits) against zipkv's own
decode of the same pages; real-like pages, Llama-3.1-8B shape, 8K context. Prints and writes JSON to argv[1]."""
import json, math, os, statistics, sys
sys.path.insert(0, "benchmarks")
import torch
import bench_decode as bd
import torch_zipkv

PAGE, Hq, Hkv, D, ctx = bd.PAGE, 32, 8, 128, 8192
gen = torch.Generator().manual_seed(0)
flush = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
streams = bd.real_streams("cuda")
rows = []
for q_len, batch, splits in ((8, 48, (0, 1, 2)), (8, 34, (0, 1, 2)), (8, 96, (0, 1, 2)), (4, 48, (0, 1, 2)), (2, 96, (0, 1, 2)), (8, 16, (0, 1, 2, 4))):
    n = batch * ctx // PAGE
    indptr = torch.arange(0, n + 1, ctx // PAGE, dtype=torch.int32, device="cuda")
    indices = torch.randperm(n, generator=gen).to(torch.int32).cuda()
    last = torch.full((batch,), PAGE, dtype=torch.int32, device="cuda")
    qo = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * q_len, Hq, D, generator=gen).to(torch.bfloat16).cuda()
    ckv = bd.store(bd.real_like_pages(n, Hkv, D, streams, gen), True)
    plan = torch_zipkv.prefill_plan(q, qo, ckv, indices)
    fns, outs = {}, {}
    for s in splits:
        def f(s=s, out=torch.empty_like(q)):
            if s:
                os.environ["ZIPKV_PROBE_SPLITS"] = str(s)
            else:
                os.environ.pop("ZIPKV_PROBE_SPLITS", None)
            r = torch_zipkv.paged_prefill(q, qo, ckv, indptr, indices, last, sm_scale=1 / math.sqrt(D), out=out)
            os.environ.pop("ZIPKV_PROBE_SPLITS", None)
            return r
        outs[s] = f().clone()
        fns[f"splits_{s or 'plan'}"] = f
    q1 = q[q_len - 1 :: q_len].contiguous()
    fns["decode"] = lambda out1=torch.empty_like(q1): torch_zipkv.paged_decode(q1, ckv, indptr, indices, last,
                                                                               sm_scale=1 / math.sqrt(D), out=out1)
    same = all(torch.equal(outs[0].float().nan_to_num(), o.float().nan_to_num()) or
               (outs[0].float() - o.float()).abs().max().item() < 2e-2 for o in outs.values())
    t = bd.time_round_robin(fns, 30, flush)
    med = {k: statistics.median(v) for k, v in t.items()}
    row = {"q_len": q_len, "batch": batch, "plan": plan, "outputs_agree": same,
           "us": med, "vs_decode": {k: v / med["decode"] for k, v in med.items()}}
    rows.append(row)
    print(q_len, batch, plan["num_splits"], plan["rows_per_cta"], same,
          " ".join(f"{k}={v:.1f}({v / med['decode']:.3f})" for k, v in med.items()), flush=True)
    del ckv, fns, outs
    torch.cuda.empty_cache()
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
