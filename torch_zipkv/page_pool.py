"""Who holds which page: the cache's sequences (their page ids, lengths and budgets), the page ids, and the pages
shared between sequences (prefix caching). Host only: numpy, dicts and lists, no tensors.

A page id names the same ``page_size`` tokens in every layer, so sharing a page id shares that token range in every
layer at once. What may be shared, and how it is found:

- **Full pages only.** A page is cached (:meth:`PagePool.register`) once it is full in every layer and present in
  every layer (a sliding window has not freed it); full pages are never written again, so every holder reads the
  same bytes. A sequence's partial last page is never cached, and a sequence that starts from a cached prefix opens
  its first own page right after it: nothing is ever copied on write.
- **Found by content, through a chain of hashes** (:func:`page_hashes`): page j's key is a 128-bit BLAKE2b digest of
  page j-1's key and page j's token ids, page 0's of a namespace (anything besides the token ids that changes K/V: a
  model, an adapter). So a key names a page's tokens *and everything before them*: the same tokens at another
  position, after another prefix or under another namespace never match. Why a hash chain and not a radix tree
  (SGLang's): only whole pages are shared, so a tree's token-level edges buy nothing here; a page is one dict entry,
  a lookup one probe per page, and eviction drops one entry without restructuring a tree (an evicted parent leaves
  its children unreachable, not wrong: their keys still name their content). Keys are bytes computed from token ids
  only, identical in every process, so every tensor-parallel rank finds the same pages. 128 bits make a collision
  (a wrong page served) about 2**-64 likely after 2**32 pages: vLLM's choice for the same reason (sha256).
- **Reference counts.** ``refs[page]`` counts the running sequences that hold it. A page whose last holder leaves is
  freed at once unless it is cached; a cached page nobody holds is *evictable*: it stays, in an LRU order, until its
  room is needed (:meth:`PagePool.evict`, least recently released first; a sequence's pages are released last page
  first, so a chain loses its tail before its head). Held pages are never evicted.

What this part does not decide: where the bytes live (``arena.py``) and what fits (``cache.py``, which counts
evictable pages as room it can promise, and evicts them when it admits a sequence that needs their room).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from .checks import is_int

HASH_BYTES = 16  # BLAKE2b digest size of a page key


def page_hashes(token_ids: Sequence[int], page_size: int, namespace: bytes | str = b"",
                previous: Sequence[bytes] = ()) -> list[bytes]:
    """The chained keys of the full pages of ``token_ids`` (``len(token_ids) // page_size`` of them). ``previous``:
    keys already computed for the leading pages of the same tokens (they are kept, and the chain goes on from the
    last of them); ``namespace``: what else changes the pages' K/V (a model or adapter name), str or bytes."""
    if isinstance(namespace, str):
        namespace = namespace.encode()
    if not isinstance(namespace, bytes):
        raise TypeError(f"namespace must be bytes or str, got {type(namespace).__name__}")
    keys = list(previous)
    full = len(token_ids) // page_size
    if len(keys) >= full:
        return keys[:full]
    last = keys[-1] if keys else hashlib.blake2b(b"zipkv-prefix:" + namespace, digest_size=HASH_BYTES).digest()
    tokens = np.asarray(token_ids[len(keys) * page_size: full * page_size], dtype=np.int64)
    for page in tokens.reshape(-1, page_size):
        last = hashlib.blake2b(last + page.tobytes(), digest_size=HASH_BYTES).digest()
        keys.append(last)
    return keys


class Seq:
    """A running sequence: its page ids in token order (``pages[:num_ids]``, the first ``shared`` of them a cached
    prefix it started from), its row in the length tables, and ``budget``: the page index its promise reaches (pages
    ``shared .. budget - 1`` are promised in every layer; the prefix was never charged)."""

    __slots__ = ("row", "pages", "num_ids", "budget", "shared")

    def __init__(self, row: int, budget: int, prefix: np.ndarray):
        self.row, self.budget, self.shared = row, budget, len(prefix)
        self.pages = np.empty(max(8, budget), dtype=np.int32)  # grows by doubling
        self.pages[: len(prefix)] = prefix
        self.num_ids = len(prefix)

    def push(self, page: int) -> None:
        if self.num_ids == len(self.pages):
            self.pages = np.concatenate([self.pages, np.empty_like(self.pages)])
        self.pages[self.num_ids] = page
        self.num_ids += 1


class PagePool:
    """The sequences of a cache of ``num_layers`` layers and ``max_pages`` page ids, and who holds each page id.

    ``len`` / ``dropped`` [rows, layers]: tokens appended per sequence row and layer, and its leading pages a sliding
    window freed there. ``free_ids``: a stack of page ids that hold nothing; ``reserved_ids``: how many of them are
    promised to running sequences' budgets. Cached pages hold an id until they are evicted."""

    def __init__(self, num_layers: int, max_pages: int):
        self.seqs: dict[int, Seq] = {}
        self._next_seq_id = 0
        self.len = np.zeros((16, num_layers), dtype=np.int64)
        self.dropped = np.zeros((16, num_layers), dtype=np.int64)
        self._free_rows = list(range(15, -1, -1))
        self.free_ids = list(range(max_pages - 1, -1, -1))
        self.reserved_ids = 0
        self.refs = np.zeros(max_pages, dtype=np.int32)  # running sequences holding each page id
        self.key_of: dict[int, bytes] = {}  # cached page -> its key
        self.page_of: dict[bytes, int] = {}  # key -> cached page
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, least recently used first

    # ---- sequences -----------------------------------------------------------------------------------------------
    def seq(self, seq_id) -> Seq:
        """The running sequence ``seq_id``: TypeError for a non-int, ValueError for an unknown id."""
        if not is_int(seq_id):
            raise TypeError(f"seq_id must be an int, got {type(seq_id).__name__} {seq_id!r}")
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise ValueError(f"seq_id {seq_id!r} is not a running sequence of this cache") from None

    def add(self, budget: int, prefix: np.ndarray) -> int:
        """A new sequence promised pages up to index ``budget``, starting from the cached pages ``prefix`` (held from
        now on, full in every layer: its lengths start after them). The caller charged the budget's other pages."""
        if not self._free_rows:
            old = len(self.len)
            self.len = np.concatenate([self.len, np.zeros_like(self.len)])
            self.dropped = np.concatenate([self.dropped, np.zeros_like(self.dropped)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        seq = Seq(self._free_rows.pop(), budget, prefix)
        self.len[seq.row] = 0
        self.dropped[seq.row] = 0
        self.hold(prefix)
        self.reserved_ids += budget - len(prefix)
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        self.seqs[seq_id] = seq
        return seq_id

    def remove(self, seq_id: int) -> np.ndarray:
        """Drop a sequence: its unused promise of ids, and its hold on its pages, last page first. Returns the page
        ids that now hold nothing (their ids are free again; the caller frees their bytes). Cached pages nobody holds
        become evictable instead."""
        seq = self.seqs.pop(seq_id)
        self.reserved_ids -= max(0, seq.budget - seq.num_ids)
        self._free_rows.append(seq.row)
        pages = seq.pages[: seq.num_ids][::-1]
        self.refs[pages] -= 1
        unheld = pages[self.refs[pages] == 0]
        cached = np.fromiter((p in self.key_of for p in unheld.tolist()), dtype=bool, count=len(unheld))
        for p in unheld[cached].tolist():
            self.evictable[p] = None
        freed = unheld[~cached]
        self.free_ids.extend(freed.tolist())
        return freed

    def hold(self, pages: np.ndarray) -> None:
        self.refs[pages] += 1
        for p in pages.tolist():
            self.evictable.pop(p, None)

    # ---- page ids --------------------------------------------------------------------------------------------------
    def ids_short(self, beyond: int) -> bool:
        """Whether ``beyond`` ids outside every promise cannot be taken now (evictable pages are not taken for
        them)."""
        return beyond > len(self.free_ids) - self.reserved_ids

    def give_ids(self, need: list[tuple[Seq, int]]) -> None:
        """Page ``j`` of each ``(seq, j)`` gets a free id (in this order; the caller checked :meth:`ids_short`)."""
        for s, j in need:
            p = self.free_ids.pop()
            s.push(p)
            self.refs[p] = 1
            if j < s.budget:
                self.reserved_ids -= 1

    def leave_windows(self, layers: np.ndarray, windows: np.ndarray, page_size: int) -> list[tuple[int, np.ndarray]]:
        """In each sliding-window layer of ``layers`` (attending to its last ``windows`` tokens), each sequence's pages
        that end before its window are no longer its own (``dropped``): returns the ``(layer, pages)`` to free there,
        those the sequence alone holds and no one may find (a shared or cached page stays whole for the others)."""
        if not len(layers) or not self.seqs:
            return []
        seqs = list(self.seqs.values())
        rows = np.array([s.row for s in seqs])
        keep = np.maximum(0, self.len[rows][:, layers] - windows) // page_size
        dropped = self.dropped[rows][:, layers]
        out = []
        for i, w in np.argwhere(keep > dropped).tolist():  # a pair turns up once every page_size steps
            pages = seqs[i].pages[dropped[i, w]: keep[i, w]]
            private = np.fromiter((p not in self.key_of for p in pages.tolist()), dtype=bool, count=len(pages))
            out.append((int(layers[w]), pages[private & (self.refs[pages] == 1)]))
            self.dropped[rows[i], layers[w]] = keep[i, w]
        return out

    def growth(self, reserve: int, page_size: int) -> tuple[np.ndarray, int]:
        """Raw pages per layer [layers] and page ids that the running sequences need to grow ``reserve`` tokens
        each beyond their pages and budgets."""
        extra, extra_ids = np.zeros(self.len.shape[1], dtype=np.int64), 0
        if reserve and self.seqs:
            seqs = list(self.seqs.values())
            lens = self.len[[s.row for s in seqs]]
            budget = np.array([s.budget for s in seqs])[:, None]
            want = -(-(lens + reserve) // page_size)
            extra = np.maximum(0, want - np.maximum(-(-lens // page_size), budget)).sum(0)
            have_ids = np.maximum([s.num_ids for s in seqs], budget[:, 0])
            extra_ids = int(np.maximum(0, want.max(1) - have_ids).sum())
        return extra, extra_ids

    def tokens(self, page_size: int) -> np.ndarray:
        """Tokens the running sequences keep, per layer [layers] (a sliding window's freed pages are gone)."""
        rows = [s.row for s in self.seqs.values()]
        return (self.len[rows] - self.dropped[rows] * page_size).sum(0)

    # ---- the prefix cache ----------------------------------------------------------------------------------------
    def check_prefix(self, prefix, budget: int) -> np.ndarray:
        """``prefix`` (a sequence's first pages, for :meth:`add`) as int32 page ids, checked: distinct cached pages,
        at most ``budget`` of them."""
        try:
            ids = list(prefix)
        except TypeError:
            raise TypeError(f"prefix must be a sequence of page ids, got {type(prefix).__name__}") from None
        for p in ids:
            if not is_int(p):
                raise TypeError(f"prefix must hold page ids (ints), got {type(p).__name__} {p!r}")
            if int(p) not in self.key_of:
                raise ValueError(f"prefix page {p!r} is not a cached page of this cache (match_prefix finds them)")
        if len(set(ids)) != len(ids) or len(ids) > budget:
            raise ValueError(f"prefix must name distinct cached pages, at most the budget's {budget}, got {ids}")
        return np.array(ids, dtype=np.int32)

    def match(self, keys: Iterable[bytes]) -> list[int]:
        """The cached pages of the longest run of ``keys`` from the first."""
        pages = []
        for key in keys:
            p = self.page_of.get(key)
            if p is None:
                break
            pages.append(p)
        return pages

    def register(self, seq: Seq, keys: Iterable[bytes], whole: np.ndarray) -> int:
        """Cache page j of ``seq`` under ``keys[j]`` where ``whole[j]`` (full and present in every layer; pages past
        ``whole`` are not): skipped where the page is cached already or another page holds the key (the first
        stays). Returns how many were cached."""
        keys = list(keys)
        for key in keys:
            if not isinstance(key, bytes):
                raise TypeError(f"keys must hold bytes (page_hashes), got {type(key).__name__}")
        added = 0
        for p, key, ok in zip(seq.pages.tolist(), keys, whole.tolist()):
            if not ok or p in self.key_of or key in self.page_of:
                continue
            self.key_of[p], self.page_of[key] = key, p
            added += 1
        return added

    def fewest_to_evict(self, lru: np.ndarray, pages: int, room_after) -> int:
        """The fewest of ``lru`` (from the first) whose eviction leaves room to promise ``pages`` more page ids and,
        by ``room_after(ids)`` (raw pages every layer could take once ``ids`` are evicted), ``pages`` more pages;
        evicting all of them must."""
        k = max(0, pages - (len(self.free_ids) - self.reserved_ids))  # for the ids
        if room_after(lru[:0]) < pages:
            lo, hi = 1, len(lru)  # room grows with every page evicted: binary search
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if room_after(lru[:mid]) >= pages else (mid + 1, hi)
            k = max(k, lo)
        return k

    def lru(self, keep: Iterable[int] = ()) -> np.ndarray:
        """The evictable pages, least recently used first, but those of ``keep``."""
        keep = set(keep)
        return np.fromiter((p for p in self.evictable if p not in keep), dtype=np.int64)

    def evict(self, pages: np.ndarray) -> None:
        """Forget evictable ``pages``: they are no longer found, and their ids are free (the caller frees their
        bytes)."""
        for p in pages.tolist():
            del self.evictable[p]
            del self.page_of[self.key_of.pop(p)]
        self.free_ids.extend(pages.tolist())

    def prefix_pages(self) -> dict[str, np.ndarray]:
        """Page ids ``cached`` (findable), ``shared`` (held by two sequences or more), ``evictable`` (cached, held by
        none)."""
        return {"cached": np.fromiter(self.key_of, dtype=np.int64), "shared": (self.refs > 1).nonzero()[0],
                "evictable": np.fromiter(self.evictable, dtype=np.int64)}
