"""Python mirror of csrc/format.h: the constants and geometry of the on-device format (docs/FORMAT.md).

test/test_format.py checks that these agree with the compiled kernels' bytes.
"""

FORMAT_VERSION = 3  # 3: a lane's words in mma A-operand register order (docs/FORMAT.md, Versioning)
TILE_TOKENS = 16  # tokens of one block
BLOCK_DIMS = 32  # dims of one block
BLOCK_VALUES = TILE_TOKENS * BLOCK_DIMS  # 512
RAW_BLOCK_BYTES = 2 * BLOCK_VALUES  # 1024
COMP_BLOCK_BYTES = BLOCK_VALUES + BLOCK_VALUES // 2  # 768: low bytes, then 4-bit codes
STREAM_ALIGN = 256  # meta word 0 counts stream starts in these units
DESC_RAW = 0x80
NO_STREAM = -1
MAX_PAGE_SIZE = 128
HEAD_DIMS = (64, 128, 256)


def check_geometry(page_size: int, head_dim: int) -> None:
    """Raises ValueError unless the format supports this page size and head dim."""
    if not (page_size > 0 and page_size % TILE_TOKENS == 0 and page_size <= MAX_PAGE_SIZE):
        raise ValueError(f"page_size must be a multiple of {TILE_TOKENS} in [16, {MAX_PAGE_SIZE}], got {page_size}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")


def blocks_per_stream(page_size: int, head_dim: int) -> int:
    """Blocks in one (page, K|V, kv head) stream."""
    return (page_size // TILE_TOKENS) * (head_dim // BLOCK_DIMS)


def meta_words(page_size: int, head_dim: int) -> int:
    """int32 words of one meta row: the stream offset, then one descriptor byte per block, padded to a word."""
    return 1 + (blocks_per_stream(page_size, head_dim) + 3) // 4


def raw_descriptor_words(page_size: int, head_dim: int) -> list[int]:
    """Meta row words 1.. of a stream whose blocks are all raw (0x80 per block, zero padding), as int32 values.
    With word 0 pointing at room for the raw stream, that row makes an open page that ``append_kv`` can fill."""
    nb = blocks_per_stream(page_size, head_dim)
    raw = bytes([DESC_RAW] * nb + [0] * (4 * (meta_words(page_size, head_dim) - 1) - nb))
    return [int.from_bytes(raw[i : i + 4], "little", signed=True) for i in range(0, len(raw), 4)]
