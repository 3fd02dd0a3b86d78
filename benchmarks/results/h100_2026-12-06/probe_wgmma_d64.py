"""Where the wgmma tile kernel goes wrong: one request, one chunk or two, error by row and by dim."""
import math, sys
sys.path.insert(0, "test")
import torch, torch_zipkv
from torch_zipkv import reference
from conftest import random_kv
from test_paged_prefill import prefill_case
from test_paged_prefill_cuda import to_cuda

def run(D, q_len, kv_len, causal, qmode, vmode, raw):
    gen = torch.Generator().manual_seed(0)
    n = (kv_len + 15) // 16
    kv = random_kv(n, 16, 1, D, gen)
    if vmode == "key":  # V[key j] = j / 64 in every dim: out = mean key index weighted
        for j in range(kv_len):
            kv[j // 16, 1, j % 16, 0, :] = j / 64
    if vmode == "dim":  # V[key j][d] = d / 64
        kv[:, 1] = (torch.arange(D) / 64).to(torch.bfloat16)
    raw_pages = torch.full((n,), raw)
    ckv, qo, table, q = prefill_case(kv, raw_pages, [kv_len], [q_len], 1, gen)
    if qmode == "zero":
        q = torch.zeros_like(q)
    scale = 1 / math.sqrt(D)
    lse = torch.empty(q.shape[0], 1, device="cuda")
    out = torch_zipkv.paged_prefill(q.cuda(), qo.cuda(), to_cuda(ckv), *(t.cuda() for t in table), sm_scale=scale,
                                    lse=lse, causal=causal).cpu().double()
    ref, ref_lse = reference.prefill_attention(q, qo, kv, *table, scale, causal=causal)
    e = (out - ref).abs()[:, 0]  # [rows, D]
    le = (lse.cpu().double() - ref_lse).abs()[:, 0]
    bad_rows = (e.amax(1) > 2e-2).nonzero().flatten().tolist()
    bad_dims = (e.amax(0) > 2e-2).nonzero().flatten().tolist()
    bad_lse = (le > 1e-3).nonzero().flatten().tolist()
    print(f"D={D} q={q_len} kv={kv_len} causal={causal} q={qmode} v={vmode} raw={raw}: out max err {e.max():.3g}, "
          f"lse max err {le.max():.3g}; bad rows {len(bad_rows)} {bad_rows[:12]}; bad dims {len(bad_dims)} "
          f"{bad_dims[:16]}; bad lse rows {len(bad_lse)} {bad_lse[:12]}")
    if vmode in ("key", "dim") and bad_rows:
        r = bad_rows[0]
        print("   row", r, "out", [round(x, 3) for x in out[r, 0, :16].tolist()], "ref",
              [round(x, 3) for x in ref[r, 0, :16].tolist()])

for D in (64, 128):
    for args in [(64, 128, False, "rand", "rand", True), (128, 64, False, "rand", "rand", True),
                 (32, 128, False, "rand", "rand", True), (64, 192, False, "rand", "rand", True),
                 (128, 128, False, "zero", "dim", True), (64, 128, False, "zero", "dim", True),
                 (64, 128, False, "rand", "key", True)]:
        try:
            run(D, *args)
        except Exception as ex:
            print("ERR", D, args, ex)
