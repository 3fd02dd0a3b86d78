"""How a :class:`~torch_zipkv.cache.CompressedPagedKVCache`'s byte budget divides into arena chunks and meta rows, and
the inverse: the budget that holds a given batch raw (:func:`raw_sizing`). Pure arithmetic, no state.

The budget covers the arena (whole chunks of whole raw pages) and the meta rows of every page id in every layer. A
layer holds up to two partly used chunks (a slot chunk and a packed one), so the default chunk shrinks with the
budget: otherwise a small budget over many layers would spend most of itself on that slack (256 MiB over 32 layers at
4 MiB a chunk: 64 chunks, two a layer).
"""

from __future__ import annotations

import math

from . import format as fmt
from .checks import check_int

__all__ = ["arena_sizing", "raw_sizing"]

CHUNK_BYTES = 4 << 20  # the largest default arena chunk
CHUNKS_PER_LAYER = 32  # a default chunk is at most 1/CHUNKS_PER_LAYER of a layer's share of the budget


def id_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int) -> int:
    """Bytes of the meta rows of one page id, all layers."""
    return num_layers * 2 * num_kv_heads * fmt.meta_words(page_size, head_dim) * 4


def arena_sizing(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, max_bytes: int,
                 chunk_bytes: int | None, max_pages: int | None) -> tuple[int, int, int]:
    """``(chunk_bytes, max_pages, num_chunks)`` of a cache of ``max_bytes`` (arguments checked by the caller):
    ``chunk_bytes`` rounded down to whole raw pages (at least one), by default 4 MiB or less (see the module
    docstring); ``max_pages`` by default enough ids for a full arena of all-compressed pages (3/4 of raw, the least).
    ValueError if no chunk fits or the arena passes the format's or int32's limits."""
    page_bytes = fmt.raw_page_bytes(page_size, num_kv_heads, head_dim)
    if chunk_bytes is None:
        chunk_bytes = min(CHUNK_BYTES, max_bytes // (CHUNKS_PER_LAYER * num_layers))
    chunk_bytes = max(1, chunk_bytes // page_bytes) * page_bytes
    per_id = id_bytes(num_layers, num_kv_heads, head_dim, page_size)
    if max_pages is None:
        per_byte = 1 / (num_layers * page_bytes * 3 / 4)  # page ids per arena byte, all compressed
        num_chunks = int(max_bytes / (1 + per_id * per_byte)) // chunk_bytes
        max_pages = math.ceil(num_chunks * chunk_bytes * per_byte)
    num_chunks = (max_bytes - max_pages * per_id) // chunk_bytes
    if num_chunks < 1 or max_pages < 1:
        raise ValueError(f"max_bytes = {max_bytes} holds no chunk of {chunk_bytes} bytes plus the meta of "
                         f"{max_pages} pages ({per_id} bytes each)")
    if num_chunks * chunk_bytes >= fmt.STREAM_ALIGN << 31:
        raise ValueError("the arena would pass the format's 512 GiB offset limit")
    if num_layers * max_pages >= 1 << 31:
        raise ValueError(f"num_layers * max_pages = {num_layers * max_pages} meta rows: int32 row ids need < 2**31")
    return chunk_bytes, max_pages, num_chunks


def raw_sizing(num_layers: int, num_kv_heads: int, head_dim: int, *, batch_size: int, max_length: int,
               page_size: int = 16) -> dict[str, int]:
    """The inverse of the constructor's sizing: ``max_bytes``, ``chunk_bytes`` and ``max_pages`` for a cache that
    holds ``batch_size`` sequences of up to ``max_length`` tokens each, stored raw (so whatever compresses is
    headroom)::

        sizing = CompressedPagedKVCache.raw_sizing(32, 8, 128, batch_size=8, max_length=4096)
        cache = CompressedPagedKVCache(32, 8, 128, **sizing)

    The promise: ``batch_size`` sequences grow to ``max_length`` tokens each in every layer, stored raw (none
    compressed), whether their budgets were promised by :meth:`add_sequence` or not. Not many more: on the new
    cache ``capacity().pages`` is at least ``pages = batch_size * ceil(max_length / page_size)`` and at most
    ``pages + batch_size`` (``max_pages`` keeps ``batch_size`` page ids spare). Beyond its pages, rounded up to
    whole chunks, every layer has room for two more chunks (one partly used slot chunk and one packed chunk, once
    pages compress). Chunks are the default 4 MiB (in whole pages), or a quarter of a layer's pages (rounded up)
    if less."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("batch_size", batch_size),
                        ("max_length", max_length)):
        check_int(name, value, 1)
    check_int("page_size", page_size)
    check_int("head_dim", head_dim)
    fmt.check_geometry(page_size, head_dim)
    page_bytes = fmt.raw_page_bytes(page_size, num_kv_heads, head_dim)
    pages = batch_size * -(-max_length // page_size)  # per layer
    per_chunk = max(1, min(CHUNK_BYTES // page_bytes, -(-pages // 4)))
    num_chunks = num_layers * (-(-pages // per_chunk) + 2)
    max_pages = pages + batch_size
    return {"max_bytes": num_chunks * per_chunk * page_bytes
            + max_pages * id_bytes(num_layers, num_kv_heads, head_dim, page_size),
            "chunk_bytes": per_chunk * page_bytes, "max_pages": max_pages}
