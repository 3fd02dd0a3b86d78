"""Python mirror of csrc/format.h: the constants and geometry of the on-device format (docs/FORMAT.md).

test/test_format.py checks that these agree with the compiled kernels' bytes and with format.h's head-dim list.
"""

from __future__ import annotations

import torch

FORMAT_VERSION = 5  # 5: zero-aware compressed blocks; 4: a tag word in every meta row (docs/FORMAT.md, Versioning)
TILE_TOKENS = 16  # tokens of one tile, and of one block
BLOCK_DIMS = 32  # dims of one block
BLOCK_VALUES = TILE_TOKENS * BLOCK_DIMS  # 512
RAW_BLOCK_BYTES = 2 * BLOCK_VALUES  # 1024
COMP_BLOCK_BYTES = BLOCK_VALUES + BLOCK_VALUES // 2  # 768: low bytes, then 4-bit codes
STREAM_ALIGN = 256  # meta word 0 counts stream starts in these units
DESC_RAW = 0x80
DESC_ZERO = 0x80  # 0x80 | b/2: a zero-aware compressed block (1 <= b/2 <= 120)
DESC_LAST = 0xF8  # the largest valid descriptor; 0xF9..0xFF are invalid
NO_STREAM = -1
MAX_PAGE_SIZE = 128
META_HEADER_WORDS = 2  # a meta row's stream offset and tag; its descriptor bytes follow
META_MAGIC = 0x5A  # the tag's top byte
# The head dims the format and every kernel support: the one list on the Python side (format.h's
# ZIPKV_FOR_EACH_HEAD_DIM is the C++ side's). Tests and benchmarks that cover every head dim iterate over it.
HEAD_DIMS = (64, 128, 256)


def geometry_error(page_size: int, head_dim: int) -> str | None:
    """What is wrong with this page size and head dim for the format (the kernels' message), or None if nothing."""
    if not (page_size > 0 and page_size % TILE_TOKENS == 0 and page_size <= MAX_PAGE_SIZE):
        return f"page_size must be a multiple of {TILE_TOKENS} in [{TILE_TOKENS}, {MAX_PAGE_SIZE}], got {page_size}"
    if head_dim not in HEAD_DIMS:
        return f"head_dim must be one of {HEAD_DIMS}, got {head_dim}"
    return None


def check_geometry(page_size: int, head_dim: int) -> None:
    """Raises ValueError unless the format supports this page size and head dim."""
    error = geometry_error(page_size, head_dim)
    if error is not None:
        raise ValueError(error)


def blocks_per_stream(page_size: int, head_dim: int) -> int:
    """Blocks in one (page, K|V, kv head) stream."""
    return (page_size // TILE_TOKENS) * (head_dim // BLOCK_DIMS)


def meta_words(page_size: int, head_dim: int) -> int:
    """int32 words of one meta row: the stream offset, the tag, then one descriptor byte per block, padded to a
    word."""
    return META_HEADER_WORDS + (blocks_per_stream(page_size, head_dim) + 3) // 4


def meta_tag(page_size: int, head_dim: int) -> int:
    """Word 1 of every meta row holding a stream written for this geometry by this format version, as an int32
    value. Bytes (little-endian): head_dim / 32, page_size / 16, 0x80 | FORMAT_VERSION, META_MAGIC."""
    tag = META_MAGIC << 24 | (0x80 | FORMAT_VERSION) << 16 | (page_size // TILE_TOKENS) << 8 | head_dim // BLOCK_DIMS
    return tag - (1 << 32) if tag >= 1 << 31 else tag


def tag_geometry(tag: int) -> tuple[int, int] | None:
    """(page_size, head_dim) a meta row with this tag was written for, or None if it is not a tag of this format
    version."""
    tag &= 0xFFFFFFFF
    if tag >> 16 != META_MAGIC << 8 | 0x80 | FORMAT_VERSION:
        return None
    return (tag >> 8 & 0xFF) * TILE_TOKENS, (tag & 0xFF) * BLOCK_DIMS


def raw_page_bytes(page_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one page (K and V of every kv head) in BF16. Stored with every block raw a page takes exactly this
    much, the most it can take: ``num_pages * raw_page_bytes(...)`` bytes of data always hold ``num_pages`` pages."""
    return 2 * page_size * num_kv_heads * head_dim * 2


def raw_descriptor_words(page_size: int, head_dim: int) -> list[int]:
    """Meta row words 1.. of a stream whose blocks are all raw (the tag, then 0x80 per block, zero padding), as int32
    values. With word 0 pointing at room for the raw stream, that row makes an open page that ``append_kv`` can
    fill."""
    nb = blocks_per_stream(page_size, head_dim)
    raw = bytes([DESC_RAW] * nb + [0] * (4 * (meta_words(page_size, head_dim) - META_HEADER_WORDS) - nb))
    return [meta_tag(page_size, head_dim)] + [int.from_bytes(raw[i : i + 4], "little", signed=True)
                                              for i in range(0, len(raw), 4)]


def descriptors(meta, page_size: int, head_dim: int):
    """The block descriptors of meta rows (int32 [..., meta_words]) as uint8 [..., blocks]."""
    return meta[..., META_HEADER_WORDS:].contiguous().view(torch.uint8)[..., : blocks_per_stream(page_size, head_dim)]
