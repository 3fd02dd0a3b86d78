"""Adversarial storage: random corruption of ``data`` and ``meta`` (bit flips, random bytes and words, offsets moved
to and past the end of ``data``, truncation) of mixed raw/compressed pages. Every call either raises ValueError
naming a meta row that really is unusable, or returns a result of the right shape and dtype; it raises exactly when
a row it reads is structurally invalid (no stream, a tag of another format version or geometry, an invalid
descriptor, a stream past the end of ``data``), as
docs/api.md (Errors) says, and a corrupted ``data`` byte changes exactly the block that holds it. ``data`` is sized
exactly to the streams (as ``compress`` leaves it), so a stream that reaches past it is refused, never read.

Seeded and fast (a few seconds on 2 cores): it runs in CI. The CUDA part (skipped without a GPU) checks that the
CUDA kernels turn exactly the same rows into NaN that the CPU kernels refuse."""

import random
import re

import pytest
import torch

import torch_zipkv
from torch_zipkv import format as fmt
from torch_zipkv import ops

from conftest import compressible_kv, random_kv, requires_cuda, store, with_zeros

GEOMETRIES = [(16, 64, 2), (32, 128, 2), (16, 256, 1), (48, 64, 1)]  # page_size, head_dim, kv heads
PAGES = 6
ROW = re.compile(r"meta\[(\d+), ([KV]), head (\d+)\] (holds no stream|has an invalid block descriptor|points past "
                 r"the end of data|is not a row of format version 5|was written for)")


def make_storage(seed: int, page_size: int, head_dim: int, heads: int):
    """Pages like a cache holds them: real-looking values (Gaussian with exact zeros, as BF16 RoPE makes, so some
    blocks are zero-aware and some raw), a page of every-block-compressible values, one of large and tiny values, and
    open pages stored all raw; both kinds of stream in one arena."""
    gen = torch.Generator().manual_seed(seed)
    kv = with_zeros(random_kv(PAGES, page_size, heads, head_dim, gen), gen, rate=1e-2)
    kv[1] = compressible_kv(1, page_size, heads, head_dim, gen)[0]
    kv[2] = kv[2] * torch.logspace(-30, 30, head_dim).to(torch.bfloat16)
    raw_pages = torch.tensor([i % 3 == 0 for i in range(PAGES)])
    return kv, store(kv, raw_pages)


def invalid_rows(meta: torch.Tensor, page_size: int, head_dim: int, data_bytes: int) -> tuple[torch.Tensor, dict]:
    """The format's rule for a usable meta row (docs/FORMAT.md, Metadata), stated independently of the kernels:
    word 0 >= 0, word 1 the tag of format version 5 for this geometry (bytes head_dim / 32, page_size / 16, 0x85,
    0x5A), descriptors of the stream's nb blocks in 0..0xF8, and the stream (768 bytes per compressed block, 1024 per
    raw one from word 0 * 256 on) inside data. Returns (bool [pages, 2, heads] invalid, reason per row)."""
    nb = (page_size // 16) * (head_dim // 32)
    start = meta[..., 0].long()
    tag = meta[..., 1:2].contiguous().view(torch.uint8).long()  # [..., 4] little-endian bytes
    desc = meta[..., 2:].contiguous().view(torch.uint8)[..., :nb].long()
    missing = start < 0
    other_version = (tag[..., 2] != 0x85) | (tag[..., 3] != 0x5A)
    other_geometry = (tag[..., 0] != head_dim // 32) | (tag[..., 1] != page_size // 16)
    bad_desc = (desc > fmt.DESC_LAST).any(-1)  # 0x00..0x7F 12-bit, 0x80 raw, 0x81..0xF8 zero-aware 12-bit
    size = torch.where(desc == fmt.DESC_RAW, fmt.RAW_BLOCK_BYTES, fmt.COMP_BLOCK_BYTES).sum(-1)
    past = start * fmt.STREAM_ALIGN + size > data_bytes
    invalid = missing | other_version | other_geometry | bad_desc | past
    reason = {}
    for idx in invalid.nonzero().tolist():
        i = tuple(idx)
        reason[i] = ("holds no stream" if missing[i] else "is not a row of format version 5" if other_version[i]
                     else "was written for" if other_geometry[i] else "has an invalid block descriptor" if bad_desc[i]
                     else "points past the end of data")
    return invalid, reason


def check_refusal(error: ValueError, reason: dict) -> None:
    """The error names a row that is invalid, for the reason the format gives."""
    found = ROW.search(str(error))
    assert found, str(error)
    row = (int(found[1]), "KV".index(found[2]), int(found[3]))
    assert reason.get(row) == found[4], (str(error), reason)


def block_owner(ckv: torch_zipkv.CompressedKV) -> torch.Tensor:
    """int64 [data bytes]: the flat index of the block (page, K|V, head, block) each byte of an intact storage
    belongs to, -1 for bytes of no stream."""
    nb = fmt.blocks_per_stream(ckv.page_size, ckv.head_dim)
    owner = torch.full((ckv.data.numel(),), -1, dtype=torch.int64)
    desc = ckv.descriptors().tolist()
    for (page, kv, head), start in zip(torch.cartesian_prod(*(torch.arange(s) for s in ckv.meta.shape[:3])).tolist(),
                                       ckv.meta[..., 0].flatten().tolist()):
        at = start * fmt.STREAM_ALIGN
        for b in range(nb):
            size = fmt.RAW_BLOCK_BYTES if desc[page][kv][head][b] == fmt.DESC_RAW else fmt.COMP_BLOCK_BYTES
            owner[at : at + size] = ((page * 2 + kv) * ckv.num_kv_heads + head) * nb + b
            at += size
    return owner


def changed_blocks(out: torch.Tensor, ref: torch.Tensor, nb: int) -> torch.Tensor:
    """bool [pages * 2 * heads * nb]: the blocks whose values (bit patterns) differ between two decompressions."""
    n, _, P, H, D = ref.shape
    diff = out.view(torch.int16) != ref.view(torch.int16)  # [n, 2, P, H, D]
    diff = diff.view(n, 2, P // 16, 16, H, D // 32, 32).permute(0, 1, 4, 2, 5, 3, 6).flatten(3, 4)
    return diff.flatten(4).any(-1).flatten()


def corrupt(rng: random.Random, ckv: torch_zipkv.CompressedKV, kind: str):
    """A corrupted copy (data, meta) of ckv's storage, by one kind of mistake."""
    data, meta = ckv.data.clone(), ckv.meta.clone()
    nb = fmt.blocks_per_stream(ckv.page_size, ckv.head_dim)
    words = meta.view(-1)
    row = meta.view(-1, meta.shape[-1])[rng.randrange(meta[..., 0].numel())]
    if kind == "data_bits":
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(data.numel())
            data[at] ^= 1 << rng.randrange(8)
    elif kind == "data_bytes":
        at = rng.randrange(data.numel())
        run = data[at : at + rng.randint(1, 64)]
        run.copy_(torch.randint(0, 256, run.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(
            rng.randrange(2**31))))
    elif kind == "meta_bits":
        for _ in range(rng.randint(1, 2)):
            i, bit = rng.randrange(words.numel()), rng.randrange(32)
            words[i] = int(words[i]) ^ (-2**31 if bit == 31 else 1 << bit)  # stays an int32
    elif kind == "meta_word":
        words[rng.randrange(words.numel())] = rng.randrange(-2**31, 2**31)
    elif kind == "meta_start":  # another stream's offset, the last that fits, one unit past it, or anything
        desc = row[2:].contiguous().view(torch.uint8)[:nb]
        size = sum(fmt.RAW_BLOCK_BYTES if d == fmt.DESC_RAW else fmt.COMP_BLOCK_BYTES for d in desc.tolist())
        fits = (data.numel() - size) // fmt.STREAM_ALIGN
        row[0] = rng.choice([rng.choice(meta[..., 0].flatten().tolist()), fits, fits + 1, -1,
                             rng.randrange(-2**31, 2**31)])
    elif kind == "meta_desc":
        row[2:].view(torch.uint8)[rng.randrange(nb)] = rng.randrange(256)
    elif kind == "meta_tag":  # another geometry's tag (as a call with the wrong page_size or head_dim sees it), a
        # version-3 row's word 1 (descriptor bytes), or one random byte
        tags = [fmt.meta_tag(p, d) for p in range(16, 129, 16) for d in fmt.HEAD_DIMS]
        choice = rng.randrange(3)
        if choice == 0:
            row[1] = rng.choice([t for t in tags if t != int(row[1])])
        elif choice == 1:
            row[1] = int.from_bytes(bytes(rng.choice([0x80, rng.randrange(0x80)]) for _ in range(4)), "little",
                                    signed=True)
        else:
            row[1:2].view(torch.uint8)[rng.randrange(4)] = rng.randrange(256)
    elif kind == "truncate":
        data = data[: rng.randrange(data.numel())].clone()  # exactly sized: nothing past it is data's
    return data, meta


KINDS = ("data_bits", "data_bytes", "meta_bits", "meta_word", "meta_start", "meta_desc", "meta_tag", "truncate")


@pytest.fixture
def one_thread():
    """Thousands of calls on a few pages each: on 2 busy cores, waking a thread pool per call costs 20x the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("page_size, head_dim, heads", GEOMETRIES)
def test_random_corruption_is_refused_exactly_when_structural(page_size, head_dim, heads, one_thread):
    P, D, H = page_size, head_dim, heads
    nb = fmt.blocks_per_stream(P, D)
    seed = P * 1000 + D + H
    rng = random.Random(seed)
    kv, ckv = make_storage(seed, P, D, H)
    owner = block_owner(ckv)
    assert (owner >= 0).all()  # the streams fill data exactly
    assert torch.equal(torch_zipkv.decompress(ckv).view(torch.int16), kv.view(torch.int16))
    q = torch.randn(2, 2 * H, D, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    table = (torch.tensor([0, 2, PAGES], dtype=torch.int32), torch.arange(PAGES, dtype=torch.int32),
             torch.tensor([P, P], dtype=torch.int32))  # every page whole: every row is read
    refused = {kind: 0 for kind in KINDS}
    silent_meta = 0  # well-formed meta changes that decode to other values: not detected (docs/api.md)
    for trial in range(150 * len(KINDS)):
        kind = KINDS[trial % len(KINDS)]
        data, meta = corrupt(rng, ckv, kind)
        bad = torch_zipkv.CompressedKV(data, meta, P, D)
        invalid, reason = invalid_rows(meta, P, D, data.numel())
        calls = {
            "validate": bad.validate,
            "decompress": lambda: torch_zipkv.decompress(bad),
            "paged_decode": lambda: torch_zipkv.paged_decode(q, bad, *table),
        }
        results = {}
        for name, call in calls.items():
            try:
                results[name] = call()
            except ValueError as e:
                assert invalid.any(), (kind, name, str(e))
                check_refusal(e, reason)
                continue
            assert not invalid.any(), (kind, name, reason)  # a structurally invalid row is always refused
        if invalid.any():
            refused[kind] += 1
            continue
        out, attn = results["decompress"], results["paged_decode"]
        assert out.shape == kv.shape and out.dtype == torch.bfloat16
        assert attn.shape == q.shape and attn.dtype == torch.bfloat16
        if kind.startswith("data"):  # every byte pattern is a valid block: the changed bytes' blocks change, no other
            hit = torch.zeros(owner.max() + 1, dtype=torch.bool)
            hit[owner[(data != ckv.data).nonzero().flatten()]] = True
            assert torch.equal(changed_blocks(out, kv, nb), hit), kind
        elif not torch.equal(out.view(torch.int16), kv.view(torch.int16)):
            silent_meta += 1
    # Both outcomes happened where both are possible: the test exercised the checks and the documented blind spot.
    assert refused["data_bits"] == refused["data_bytes"] == 0
    assert all(refused[kind] > 0 for kind in KINDS[2:]), refused
    assert silent_meta > 0


def test_offsets_at_and_past_the_end_of_data():
    """The bound check at its edge: a stream that ends exactly at the end of data is read, one that ends a byte past
    it (data one byte short) or a unit of 256 past it is refused by every reader, before any byte is read."""
    kv, ckv = make_storage(7, 16, 128, 2)
    last = int(ckv.meta[..., 0].argmax())  # the row of the stream that ends data
    page, kvi, head = (int(x) for x in torch.unravel_index(torch.tensor(last), ckv.meta.shape[:3]))
    torch_zipkv.decompress(ckv)
    short = torch_zipkv.CompressedKV(ckv.data[:-1].clone(), ckv.meta, 16, 128)
    moved = ckv.meta.clone()
    moved[page, kvi, head, 0] += 1
    for bad in (short, torch_zipkv.CompressedKV(ckv.data, moved, 16, 128)):
        message = rf"meta\[{page}, {'KV'[kvi]}, head {head}\] points past the end of data"
        with pytest.raises(ValueError, match=message):
            bad.validate()
        with pytest.raises(ValueError, match=message):
            torch_zipkv.decompress(bad)
        with pytest.raises(ValueError, match=message):
            ops.decompress_pages(bad.data, bad.meta, torch.tensor([page], dtype=torch.int32), 16, 128)
        with pytest.raises(ValueError, match=message):
            torch_zipkv.paged_decode(torch.ones(1, 2, 128, dtype=torch.bfloat16), bad,
                                     torch.tensor([0, 1], dtype=torch.int32), torch.tensor([page], dtype=torch.int32),
                                     torch.tensor([1], dtype=torch.int32))


@requires_cuda
@pytest.mark.parametrize("page_size, head_dim, heads", [g for g in GEOMETRIES if g[0] == 16])
def test_cuda_poisons_exactly_the_rows_the_cpu_refuses(page_size, head_dim, heads):
    """The CUDA kernels cannot raise on device contents: decompress_pages returns the streams of invalid rows as
    0xFFFF (NaN) and every other page bit for bit as the CPU kernel does; paged_decode returns NaN for exactly the
    (request, kv head) pairs that read an invalid row. (Page size 16: one tile per page, so the CUDA decode checks
    each row whole, as the CPU kernels do.)"""
    P, D, H = page_size, head_dim, heads
    nb = fmt.blocks_per_stream(P, D)
    seed = P * 1000 + D + H + 1
    rng = random.Random(seed)
    kv, ckv = make_storage(seed, P, D, H)
    q = torch.randn(PAGES, 2 * H, D, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).cuda()
    ids = torch.arange(PAGES, dtype=torch.int32)
    table = (torch.arange(PAGES + 1, dtype=torch.int32).cuda(), ids.cuda(),
             torch.full((PAGES,), P, dtype=torch.int32).cuda())  # request i reads page i
    good = ops.paged_decode(q, ckv.data.cuda(), ckv.meta.cuda(), *table, P).cpu().view(torch.int16)
    page_of = block_owner(ckv) // (2 * H * nb)  # the page whose stream holds each byte of the intact data
    for trial in range(20 * len(KINDS)):
        data, meta = corrupt(rng, ckv, KINDS[trial % len(KINDS)])
        invalid, _ = invalid_rows(meta, P, D, data.numel())
        out = ops.decompress_pages(data.cuda(), meta.cuda(), ids.cuda(), P, D).cpu()
        for page in range(PAGES):
            if not invalid[page].any():
                cpu = ops.decompress_pages(data, meta, ids[page : page + 1], P, D)
                assert torch.equal(out[page].view(torch.int16), cpu[0].view(torch.int16))
            for kvi, head in invalid[page].nonzero().tolist():
                assert (out[page, kvi, :, head].view(torch.int16) == -1).all()
        attn = ops.paged_decode(q, data.cuda(), meta.cuda(), *table, P).cpu()
        poisoned = invalid.any(1)  # [pages = requests, heads]: the K or V row of the request's page is invalid
        assert attn.view(PAGES, H, 2, D)[poisoned].isnan().all()
        # Poison stays local: a request whose page (meta rows and stream bytes) is intact decodes as before, bit for
        # bit, whatever the corruption did to the other pages.
        same = torch.zeros(ckv.data.numel(), dtype=torch.bool)
        n = min(data.numel(), ckv.data.numel())
        same[:n] = data[:n] == ckv.data[:n]
        for page in range(PAGES):
            if torch.equal(meta[page], ckv.meta[page]) and same[page_of == page].all():
                assert torch.equal(attn[page].view(torch.int16), good[page]), page
