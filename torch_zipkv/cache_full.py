""":class:`CacheFullError` and the words it uses to say why: what is free, what is promised, what could be evicted,
and, under tensor parallelism, that the figures are one rank's while the refusal is the group's."""

from __future__ import annotations

__all__ = ["CacheFullError"]


class CacheFullError(RuntimeError):
    """The cache cannot hold what was asked, and nothing was changed. ``requested`` and ``free`` count ``unit``, and
    ``requested > free``, so a scheduler can act on them. Units: "pages per layer" (raw pages in every layer: an
    admission, a decode step), "pages" (raw pages of the one layer an append names) or "page ids"."""

    def __init__(self, message: str, *, requested: int, free: int, unit: str):
        super().__init__(message)
        self.requested, self.free, self.unit = requested, free, unit


def describe_ids(pool, arena, process_group) -> str:
    """The page ids of a :class:`~torch_zipkv.page_pool.PagePool`: free, promised, evictable."""
    return (f"{len(pool.free_ids)} of {len(arena.offset[0])} page ids free, {pool.reserved_ids} of them promised to "
            f"{len(pool.seqs)} running sequences{_evictable(pool)}{_on_this_rank(process_group)}")


def describe_free(pool, arena, process_group) -> str:
    """The room of an :class:`~torch_zipkv.arena.Arena`: free chunks and slots, promised pages, evictable pages."""
    return (f"{len(arena.pool)} of {arena.num_chunks} chunks free, {arena.free_slot_count.sum()} free slots, "
            f"{arena.reserved.sum()} pages promised to {len(pool.seqs)} running sequences{_evictable(pool)}"
            f"{_on_this_rank(process_group)}")


def opened_for(layers: slice, batch, prefill: bool = False) -> str:
    """What pages open for, named as the caller knows it: a decode step or a prefill of all layers, or an append to
    one."""
    if layers == slice(None):
        return f"prepare_prefill: a prefill of sequences {list(batch.key)}" if prefill else \
            f"prepare_step: a decode step of sequences {list(batch.key)}"
    return f"append to layer {layers.start}:"


def _evictable(pool) -> str:
    n = len(pool.evictable)
    return f", {n} evictable cached pages counted as room" if n else ""


def _on_this_rank(process_group) -> str:
    if process_group is None:
        return ""
    import torch.distributed as dist

    return (f", on rank {dist.get_rank(process_group)} of {dist.get_world_size(process_group)}; every rank refuses "
            "what one rank cannot fit")
