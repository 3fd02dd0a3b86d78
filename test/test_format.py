"""Lossless round trip and the exact bytes of the format, on the CPU kernels."""

import pathlib
import re

import pytest
import torch

import torch_zipkv
from torch_zipkv import format as fmt
from torch_zipkv import ops, reference

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"

from conftest import ZERO_BLOCKS, bits, compressible_kv, random_kv, store, zero_block_pages  # noqa: E402


def assert_round_trip(kv: torch.Tensor, allow_compress: bool = True) -> torch_zipkv.CompressedKV:
    ckv = torch_zipkv.compress(kv, allow_compress=allow_compress)
    assert torch.equal(bits(torch_zipkv.decompress(ckv)), bits(kv))
    return ckv


def patterns_as_pages(p: torch.Tensor, heads=1, head_dim=64, page_size=16) -> torch.Tensor:
    """int16 bit patterns -> bf16 pages [n, 2, page_size, heads, head_dim] (length must divide evenly)."""
    return p.view(torch.bfloat16).reshape(-1, 2, page_size, heads, head_dim)


@pytest.mark.parametrize("head_dim", fmt.HEAD_DIMS)
@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_random_round_trip_and_bytes_match_reference(gen, page_size, head_dim):
    kv = random_kv(3, page_size, 2, head_dim, gen)
    kv[1, 0, 5, 1, 7] = 1e-30  # one raw K block beside compressed ones (exponent 27: far below the others)
    kv[2] = compressible_kv(1, page_size, 2, head_dim, gen)[0]  # exponents 124..130
    kv[2, 1, 3, 0, 40] = 0.0  # one zero-aware V block
    ckv = assert_round_trip(kv)
    data, meta = reference.encode(kv)
    assert torch.equal(ckv.data, data) and torch.equal(ckv.meta, meta)
    assert 0 < ckv.compressed_block_fraction < 1
    assert ((ckv.descriptors() > fmt.DESC_RAW) & (ckv.descriptors() <= fmt.DESC_LAST)).any()


def test_every_bf16_pattern_round_trips(gen):
    every = torch.arange(-32768, 32768, dtype=torch.int16)
    for order in (every, every[torch.randperm(every.numel(), generator=gen)]):
        for head_dim in fmt.HEAD_DIMS:
            assert_round_trip(patterns_as_pages(order, head_dim=head_dim))
    # Sorted, each block spans one or two exponents and compresses; shuffled, none can.
    assert torch_zipkv.compress(patterns_as_pages(every)).compressed_block_fraction == 1.0
    shuffled = every[torch.randperm(every.numel(), generator=gen)]
    assert torch_zipkv.compress(patterns_as_pages(shuffled)).compressed_block_fraction == 0.0


def test_head_dims_are_one_list():
    """format.h's ZIPKV_FOR_EACH_HEAD_DIM is format.HEAD_DIMS: the compiled check names that list, and each head dim
    has the file that instantiates its CUDA decode kernel (paged_decode_hd<D>.cu), no other has one."""
    kv = torch.zeros(1, 2, 16, 1, 96, dtype=torch.bfloat16)
    storage = torch.zeros(16, dtype=torch.uint8), torch.zeros(1, 2, 1, 3, dtype=torch.int32), torch.zeros(2).long()
    with pytest.raises(ValueError, match=re.escape(f"zipkv.compress_pages: head_dim must be one of {fmt.HEAD_DIMS}")):
        ops.compress_pages(kv, torch.zeros(1, dtype=torch.int32), *storage)
    listed = re.search(r"#define ZIPKV_FOR_EACH_HEAD_DIM\(X\)((?: X\(\d+\))+)\n", (CSRC / "format.h").read_text())
    assert tuple(int(d) for d in re.findall(r"\d+", listed.group(1))) == fmt.HEAD_DIMS
    files = sorted(int(p.stem.removeprefix("paged_decode_hd")) for p in (CSRC / "cuda").glob("paged_decode_hd*.cu"))
    assert files == sorted(fmt.HEAD_DIMS)


def special_block(gen, specials: torch.Tensor, exponent_base: int) -> torch.Tensor:
    """512 values with exponents in [base, base + 15] (compressible), then `specials` sprinkled in."""
    e = torch.randint(exponent_base, exponent_base + 16, (512,), generator=gen)
    f = torch.randint(0, 128, (512,), generator=gen)
    s = torch.randint(0, 2, (512,), generator=gen)
    v = (s << 15) | (e << 7) | f
    idx = torch.randperm(512, generator=gen)[: specials.numel()]
    v[idx] = specials.to(torch.int64) & 0xFFFF
    return v.to(torch.int32).to(torch.int16)


@pytest.mark.parametrize(
    "name, specials, base",
    [
        ("+-0", [0x0000, 0x8000], 0),  # e = 0: compressible beside tiny values only
        ("subnormals", [0x0001, 0x807F, 0x0040], 0),
        ("inf", [0x7F80, 0xFF80], 240),
        ("nan payloads", [0x7FC0, 0x7F81, 0xFFFF, 0xFFC1, 0x7FFF], 240),
        ("max finite", [0x7F7F, 0xFF7F], 240),
    ],
)
def test_special_values_round_trip_and_still_compress(gen, name, specials, base):
    blocks = torch.stack([special_block(gen, torch.tensor(specials), base) for _ in range(4)])
    kv = patterns_as_pages(blocks.flatten(), head_dim=64)  # 4 blocks = 1 page of K and V
    ckv = assert_round_trip(kv)
    assert ckv.compressed_block_fraction == 1.0, name


def test_exact_zeros_among_normal_values_make_their_block_zero_aware(gen):
    kv = compressible_kv(2, 16, 1, 64, gen)  # exponents 124..130: base 124 without the zeros
    kv[0, 0, 3, 0, 10] = 0.0
    kv[1, 1, 9, 0, 40] = -0.0
    kv[1, 0, 2, 0, 1] = 2.0**-133  # a subnormal (e = 0) counts as a zero too
    ckv = assert_round_trip(kv)
    desc = ckv.descriptors()
    zero_aware = [(0, 0, 0, 0), (1, 1, 0, 1), (1, 0, 0, 0)]
    for at in zero_aware:
        assert desc[at] == fmt.DESC_ZERO + 124 // 2, at
    assert (desc < fmt.DESC_RAW).sum() == desc.numel() - len(zero_aware)
    data, meta = reference.encode(kv)
    assert torch.equal(ckv.data, data) and torch.equal(ckv.meta, meta)


@pytest.mark.parametrize("emin, spread, zero_aware", [(100, 13, True), (100, 14, False), (101, 12, True),
                                                      (101, 13, False), (4, 13, True), (240, 13, True),
                                                      (242, 13, False), (240, 15, False)])
def test_zero_aware_rule_at_its_edges(gen, emin, spread, zero_aware):
    """With a zero among them, values of exponents emin..emin + spread are zero-aware iff every exponent of the
    values with e >= 2 is <= base + 13 (base = emin rounded down to even) and base <= 240 (base / 2 + 7 <= 127),
    raw otherwise (the plain rule fails: the zero's exponent is 0). NaN and Inf (e = 255) are ordinary values."""
    e = torch.full((1, 2, 16, 1, 64), emin)
    e[..., 0, 0, 0] = emin + spread  # one outlier and one zero in each block
    e[..., 0, 0, 32] = emin + spread
    f = torch.randint(0, 128, e.shape, generator=gen)
    kv = ((e << 7) | f).to(torch.int32).to(torch.int16).view(torch.bfloat16)
    kv[..., 5, 0, 3] = 0.0
    kv[..., 5, 0, 35] = -0.0
    ckv = assert_round_trip(kv)
    expected = fmt.DESC_ZERO + (emin & ~1) // 2 if zero_aware else fmt.DESC_RAW
    assert (ckv.descriptors() == expected).all()
    data, meta = reference.encode(kv)
    assert torch.equal(ckv.data, data) and torch.equal(ckv.meta, meta)


def test_every_bf16_pattern_round_trips_beside_zeros(gen):
    """All 65,536 patterns, each 16-value run of them sharing its block with 496 values of one exponent pair and a
    zero: every pattern lands in a zero-aware, plain or raw block somewhere; all round-trip bit for bit."""
    every = torch.arange(-32768, 32768, dtype=torch.int16)
    for e_fill in (4, 120, 240):
        blocks = []
        for start in range(0, every.numel(), 16):
            fill = ((e_fill << 7) | torch.randint(0, 128, (512,), generator=gen)).to(torch.int16)
            fill[:16] = every[start : start + 16]
            fill[16] = 0
            blocks.append(fill[torch.randperm(512, generator=gen)])
        kv = patterns_as_pages(torch.cat(blocks), head_dim=64)
        ckv = assert_round_trip(kv)
        desc = ckv.descriptors()
        assert ((desc > fmt.DESC_RAW) & (desc <= fmt.DESC_LAST)).any() and (desc == fmt.DESC_RAW).any()
        data, meta = reference.encode(kv)
        assert torch.equal(ckv.data, data) and torch.equal(ckv.meta, meta)


def test_blocks_of_zeros_take_the_kind_the_rule_gives(gen):
    """Blocks of +-0 alone, with subnormals, with values at each zero-aware limit, with +-Inf or NaN payloads: each
    round-trips bit for bit and takes the descriptor written out in ZERO_BLOCKS; the bytes are the reference's."""
    for head_dim in fmt.HEAD_DIMS:
        kv, want = zero_block_pages(gen, head_dim)
        ckv = assert_round_trip(kv)
        desc = ckv.descriptors()  # [pages, 2, heads, blocks]
        for page, name in enumerate(ZERO_BLOCKS):
            assert (desc[page] == want[page]).all(), (head_dim, name, desc[page].unique().tolist())
        data, meta = reference.encode(kv)
        assert torch.equal(ckv.data, data) and torch.equal(ckv.meta, meta)


@pytest.mark.parametrize("emin, spread, compressible", [(100, 15, True), (101, 15, False), (101, 14, True),
                                                        (100, 16, False), (0, 15, True), (240, 15, True)])
def test_compressibility_rule_at_its_edges(gen, emin, spread, compressible):
    """base = emin rounded down to even; compressible iff every exponent <= base + 15."""
    e = torch.full((1, 2, 16, 1, 64), emin)
    e[..., 0, 0, 0] = emin + spread  # one outlier in each block: token 0 of dims 0 and 32 of K and V
    e[..., 0, 0, 32] = emin + spread
    f = torch.randint(0, 128, e.shape, generator=gen)
    kv = ((e << 7) | f).to(torch.int32).to(torch.int16).view(torch.bfloat16)
    ckv = assert_round_trip(kv)
    expected = (emin & ~1) >> 1 if compressible else fmt.DESC_RAW
    assert (ckv.descriptors() == expected).all()


def test_allow_compress_false_stores_raw_and_sizes_add_up(gen):
    kv = compressible_kv(4, 16, 2, 128, gen)
    raw = assert_round_trip(kv, allow_compress=False)
    comp = torch_zipkv.compress(kv)
    nb = fmt.blocks_per_stream(16, 128)
    meta_bytes = 4 * 2 * 2 * fmt.meta_words(16, 128) * 4  # int32 words
    assert raw.compressed_block_fraction == 0.0 and comp.compressed_block_fraction == 1.0
    assert raw.nbytes == 4 * 2 * 2 * nb * 1024 + meta_bytes == raw.raw_nbytes + meta_bytes
    assert raw.raw_nbytes == 4 * fmt.raw_page_bytes(16, 2, 128) == kv.numel() * 2
    assert comp.nbytes == 4 * 2 * 2 * nb * 768 + meta_bytes
    assert comp.num_pages == 4 and comp.page_size == 16 and comp.num_kv_heads == 2 and comp.head_dim == 128


def test_raw_block_keeps_each_lane_as_two_16_byte_pieces():
    # FORMAT.md (since v2): lane L's positions 16L..16L+7 at bytes 16L.., 16L+8..16L+15 at 512 + 16L... Each value
    # here is its own (token, dim) index, so the bytes say where the kernel put every value.
    tok, dim = torch.meshgrid(torch.arange(16), torch.arange(32), indexing="ij")
    ids = (tok * 32 + dim).to(torch.int16)  # [16, 32], all distinct
    kv = ids.view(torch.bfloat16).view(1, 1, 16, 1, 32).expand(1, 2, 16, 1, 32).contiguous()
    kv = torch.cat([kv, kv], dim=-1)  # head_dim 64: two blocks per stream, the second like the first
    ckv = torch_zipkv.compress(kv, allow_compress=False)
    words = ckv.data.view(torch.int16).view(2, 2, 512)  # K|V, block, 16-bit value slots
    for is_v in (0, 1):
        coords = reference.lane_coords(bool(is_v))  # position -> (token, dim)
        for lane in range(32):
            for i in range(16):
                t, d = coords[16 * lane + i]
                slot = (0 if i < 8 else 256) + 8 * lane + i % 8
                assert int(words[is_v, 1, slot]) == t * 32 + d, (is_v, lane, i)


def test_lane_words_are_mma_a_fragments():
    # FORMAT.md v3, stated from the PTX ISA's A fragment of mma.m16n8k16 (lane 4g+t: a0 = (row g, cols 2t, 2t+1),
    # a1 = row g+8, a2 = cols 2t+8.., a3 = both): word m of a lane is register m % 4 of the fragment of 16-dim half
    # m // 4. K's rows are tokens and its columns dims (S^T = K Q^T); V's rows are dims, its columns tokens.
    for is_v in (False, True):
        coords = reference.lane_coords(is_v)
        assert sorted(coords) == [(t, d) for t in range(16) for d in range(32)]
        for lane in range(32):
            g, t = divmod(lane, 4)
            for m in range(8):
                reg, half = m % 4, m // 4
                row, col = g + 8 * (reg % 2), 2 * t + 8 * (reg // 2)
                for b in range(2):  # the two bf16 halves of the register: columns col, col + 1
                    want = (col + b, 16 * half + row) if is_v else (row, 16 * half + col + b)
                    assert coords[16 * lane + 2 * m + b] == want, (is_v, lane, m, b)


def test_mixed_raw_and_compressed_pages_share_one_arena(gen):
    kv = random_kv(6, 16, 2, 64, gen)
    raw_pages = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.bool)
    ckv = store(kv, raw_pages)
    assert torch.equal(bits(torch_zipkv.decompress(ckv)), bits(kv))
    is_raw = (ckv.descriptors() == fmt.DESC_RAW).flatten(1).all(1)
    assert torch.equal(is_raw, raw_pages)


def test_stats_split_k_and_v(gen):
    kv = compressible_kv(2, 16, 1, 64, gen)
    kv[:, 0, 0, 0, 0] = 1e-30  # first K block of each page raw (an exponent far below the others')
    st = torch_zipkv.compress(kv).stats()
    assert st["K"]["compressed_block_fraction"] == 0.5 and st["V"]["compressed_block_fraction"] == 1.0
    assert st["K"]["stored_bytes"] == 2 * (768 + 1024) and st["V"]["ratio"] == 0.75


def test_real_kv_round_trips_and_compresses(real_kv):
    layers = real_kv.shape[0]
    fractions = []
    for layer in range(0, layers, 3):
        ckv = assert_round_trip(real_kv[layer])
        data, meta = reference.encode(real_kv[layer])
        assert torch.equal(ckv.data, data) and torch.equal(ckv.meta, meta)
        fractions.append(ckv.stats())
    # On SmolLM2's real KV about 93% of V blocks and 96% of K blocks compress; without zero-aware blocks 79% of K
    # blocks would (the exact zeros that BF16 RoPE makes: docs/FORMAT.md, Design notes).
    v = sum(f["V"]["compressed_block_fraction"] for f in fractions) / len(fractions)
    k = sum(f["K"]["compressed_block_fraction"] for f in fractions) / len(fractions)
    assert v > 0.8 and 0.9 < k <= 1.0
