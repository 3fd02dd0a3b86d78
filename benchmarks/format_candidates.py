"""Denser block modes for the format, measured on SmolLM2's real KV before any kernel is written (issue 21, step 1).

    python benchmarks/format_candidates.py [--out DIR]      # CPU only; prints a table, writes format_candidates.json

Every candidate keeps the 16 x 32 block (one mma tile) and the lane-ordered positions, so the decode kernel keeps
its structure; each block takes the cheapest mode of the candidate's set that holds it losslessly. Sizes:
- raw 1024 bytes; v3 12-bit 768 (8 low bits verbatim + sign + 3-bit d = (e - b) >> 1, b = min e & ~1: a window of 16
  exponents);
- 12z: 768, d = 7 means "e in {0, 1}" (±0 and subnormals: the high byte is the sign alone), window 14 + zeros;
- 11: 704 (2-bit d: a window of 8 exponents); 11z: 704, d = 3 means e in {0, 1} (window 6 + zeros);
- 11l: 11 plus a 2-bit per-lane base offset (in units of 2 exponents, 8 bytes a block: 712 -> 720 aligned to 16);
- 10: 640 (1-bit d, window 4); 10z: 640, d = 1 means zero... (window 2 + zeros);
- 12t / 11t / 10t: the 3-, 2- or 1-bit code indexes a table of 8, 4 or 2 exponent pairs (e >> 1) kept with the
  block (784, 720, 656 bytes): any block with that few distinct pairs fits (zeros, outliers, gaps);
- escapes (+esc k): a block may also take a mode with up to k values outside its window, each stored as 4 bytes
  (position, high byte) after the block, rounded up to 16 bytes;
- per-lane 11 / 12: each lane's 16 values take 2-bit codes where they span <= 4 pair levels, 3-bit otherwise, with
  a header per block for the lanes' modes and windows; and fixed-rate floors: an ideal mixed-radix code of each
  group's pair levels (a block, a lane, a code word), with and without the header that places them.
Metadata: v4's 8-byte row header (offset, tag) + one descriptor byte per block, per stream, words of 4. "entropy" is
the order-0 entropy of the high byte of each block (sign + exponent) plus the 8 verbatim low bits: a floor for any
coder that keeps the low byte verbatim.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))  # smollm2.py: real KV

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from torch_zipkv import reference  # noqa: E402


def load_blocks() -> tuple[np.ndarray, torch.Tensor]:
    """uint16 [layers, pages, 2, heads, blocks, 512] bit patterns in position order, and the kv they come from
    (bf16 [layers, pages, 2, 16, heads, 64])."""
    import smollm2 as realkv

    kv = realkv.real_kv(2048, page_size=16)
    blocks = torch.stack([reference._blocks(kv[i]) for i in range(kv.shape[0])])  # int64 [L, n, 2, H, nb, 512]
    return blocks.numpy().astype(np.uint16), kv


def channel_offset_sizes(kv: torch.Tensor) -> np.ndarray:
    """int [L, n, 2, H, nb]: block bytes when each value's exponent pair is coded less a per-(layer, K|V, head,
    channel) offset (its channel's largest pair over all tokens; stored once per layer, not counted), each block
    taking the cheapest of 11 (2-bit codes), 11z, 12, 12z and raw. A page-16 block is 16 tokens x 32 channels of a
    stream, so its values' order does not matter here."""
    x = kv.view(torch.int16).numpy().astype(np.int32) & 0xFFFF
    e = (x >> 7) & 0xFF
    L, n, _, T, H, D = e.shape
    zero = e <= 1
    p = e >> 1
    off = np.where(zero, -1, p).max(axis=(1, 3))  # [L, 2, H, D]
    q = p - off[:, None, :, None, :, :]
    def blocks(a):
        return a.reshape(L, n, 2, T, H, D // 32, 32).transpose(0, 1, 2, 4, 5, 3, 6).reshape(L, n, 2, H, D // 32, T * 32)

    qb, zb = blocks(q), blocks(zero)
    big = 1 << 20
    span_all = qb.max(-1) - qb.min(-1) + 1
    lo, hi = np.where(zb, big, qb).min(-1), np.where(zb, -big, qb).max(-1)
    span_nonzero = np.where(hi < lo, 0, hi - lo + 1)
    size = np.full(span_all.shape, 1024)
    for bytes_, span, nonzero_only in ((768, 7, True), (768, 8, False), (704, 3, True), (704, 4, False)):
        size = np.where((span_nonzero if nonzero_only else span_all) <= span, bytes_, size)
    return size


def window_fit(e: np.ndarray, span: int, zeros: bool, lane_bits: int = 0) -> np.ndarray:
    """bool [...]: the block's exponents (e [..., 512]) fit a window of `span` exponents from an even base (values
    with e <= 1 exempt when zeros), optionally with a per-lane base offset of lane_bits bits in units of 2."""
    big = 1 << 20
    if zeros:
        e = np.where(e <= 1, -1, e)
    lo = np.where(e < 0, big, e)
    if lane_bits:
        lanes = lo.reshape(*e.shape[:-1], 32, 16)
        hi_l = e.reshape(*e.shape[:-1], 32, 16).max(-1)
        lo_l = lanes.min(-1)
        base = (lo_l.min(-1) & ~1)[..., None]  # block base: the smallest lane's
        off = np.clip((np.where(lo_l == big, base, lo_l) - base) // 2, 0, (1 << lane_bits) - 1)
        return ((hi_l < 0) | (hi_l - (base + 2 * off) < span)).all(-1)
    base = lo.min(-1) & ~1
    hi = e.max(-1)
    return (hi < 0) | (hi - base < span)


def distinct_pairs(e: np.ndarray) -> np.ndarray:
    """int [...]: how many distinct e >> 1 values (exponent pairs) each block holds."""
    pairs = np.sort(e >> 1, axis=-1)
    return 1 + (np.diff(pairs, axis=-1) != 0).sum(-1)


def escapes_needed(e: np.ndarray, span: int, zeros: bool) -> np.ndarray:
    """int [...]: the fewest values outside any even-based window of `span` exponents (zeros exempt when zeros)."""
    if zeros:
        e = np.where(e <= 1, -1, e)
    counts = np.zeros((*e.shape[:-1], 256), dtype=np.int32)
    flat = e.reshape(-1, e.shape[-1])
    cflat = counts.reshape(-1, 256)
    valid = flat >= 0
    rows = np.repeat(np.arange(flat.shape[0]), flat.shape[1])[valid.ravel()]
    np.add.at(cflat, (rows, flat[valid]), 1)
    csum = np.concatenate([np.zeros((cflat.shape[0], 1), np.int32), cflat.cumsum(-1)], -1)
    total = valid.sum(-1)
    best = np.full(cflat.shape[0], 1 << 30)
    for b in range(0, 256, 2):
        inside = csum[:, min(256, b + span)] - csum[:, b]
        best = np.minimum(best, total - inside)
    return best.reshape(e.shape[:-1])


def pair_levels(e: np.ndarray, group: int) -> np.ndarray:
    """int [..., 512 / group]: how many code levels each group of `group` consecutive positions needs when it codes
    its exponent pairs (e >> 1) from its smallest to its largest, values with e <= 1 (zeros, subnormals) as one more
    level."""
    z = (e <= 1).reshape(*e.shape[:-1], -1, group)
    p = (e >> 1).reshape(*e.shape[:-1], -1, group)
    lo = np.where(z, 1 << 20, p).min(-1)
    hi = np.where(z, -1, p).max(-1)
    return np.where(hi < 0, 0, hi - np.minimum(lo, hi) + 1) + z.any(-1)


def entropy_bytes(v: np.ndarray) -> np.ndarray:
    """Order-0 entropy (bytes) of each block's high bytes, plus its 512 verbatim low bytes."""
    hi = (v >> 8).reshape(-1, v.shape[-1])
    out = np.empty(hi.shape[0])
    for i in range(hi.shape[0]):
        c = np.bincount(hi[i], minlength=256)
        p = c[c > 0] / hi.shape[1]
        out[i] = 512 - (p * np.log2(p)).sum() * hi.shape[1] / 8
    return out.reshape(v.shape[:-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    v, kv = load_blocks()
    shape = tuple(kv.shape)
    e = ((v >> 7) & 0xFF).astype(np.int32)
    L, n, _, H, nb, _ = v.shape
    raw_bytes = v.size * 2
    meta_bytes = L * n * 2 * H * (8 + 4 * -(-nb // 4))
    modes = {  # name: (bytes, fits [L, n, 2, H, nb])
        "raw": (1024, np.ones(e.shape[:-1], bool)),
        "12": (768, window_fit(e, 16, False)),
        "12z": (768, window_fit(e, 14, True)),
        "11": (704, window_fit(e, 8, False)),
        "11z": (704, window_fit(e, 6, True)),
        "11l": (720, window_fit(e, 8, False, lane_bits=2)),
        "11lz": (720, window_fit(e, 6, True, lane_bits=2)),
        "10": (640, window_fit(e, 4, False)),
        "10z": (640, window_fit(e, 2, True)),
        # Table modes: the code indexes a per-block table of e >> 1 values (8, 4 or 2 entries, stored with the block,
        # padded to 16 bytes), rebuilt with one byte permute (PRMT) per 4 values: any set of that many exponent
        # pairs fits, zeros and outliers included.
        "12t": (784, distinct_pairs(e) <= 8),
        "11t": (720, distinct_pairs(e) <= 4),
        "10t": (656, distinct_pairs(e) <= 2),
    }
    esc = {(span, z): escapes_needed(e, span, z) for span, z in ((16, False), (14, True), (8, False), (6, True))}

    def esc_mode(size, span, z, k, each=4, unit=16):
        need = esc[(span, z)]
        extra = np.where(need > 0, -(-each * need // unit) * unit, 0)
        return np.where(need <= k, size + extra, 1 << 20)

    def block_share(sizes: np.ndarray) -> dict:
        """Each block size (bytes) and the fraction of blocks that take it."""
        return {int(x): float(c / sizes.size) for x, c in zip(*np.unique(sizes, return_counts=True))}

    def kv_ratios(best, total_bytes=None) -> dict:
        """ratio_with_meta of total_bytes (default: the blocks' bytes) plus the metadata; K's and V's blocks alone."""
        total = best.sum() if total_bytes is None else total_bytes
        return {"ratio_with_meta": float((total + meta_bytes) / raw_bytes),
                "K": float(best[:, :, 0].sum() / (v[:, :, 0].size * 2)),
                "V": float(best[:, :, 1].sum() / (v[:, :, 1].size * 2))}

    def evaluate(names, esc_modes=()):
        best = np.full(e.shape[:-1], 1 << 20)
        for name in names:
            size, fits = modes[name]
            best = np.where(fits, np.minimum(best, size), best)
        for m in esc_modes:
            best = np.minimum(best, esc_mode(*m))
        return {**kv_ratios(best), "block_sizes": block_share(best)}

    candidates = {
        "v3 (12, raw)": evaluate(["raw", "12"]),
        "12 + 12z": evaluate(["raw", "12", "12z"]),
        "11 + 12": evaluate(["raw", "12", "11"]),
        "11 + 12 + 12z": evaluate(["raw", "12", "12z", "11"]),
        "11 + 11z + 12 + 12z": evaluate(["raw", "12", "12z", "11", "11z"]),
        "11l + 12 + 12z": evaluate(["raw", "12", "12z", "11l"]),
        "11 + 11l + 11z + 11lz + 12 + 12z": evaluate(["raw", "12", "12z", "11", "11l", "11z", "11lz"]),
        "10 + 10z + 11 + 11z + 12 + 12z": evaluate(["raw", "12", "12z", "11", "11z", "10", "10z"]),
        "12t + 12": evaluate(["raw", "12", "12t"]),
        "11t + 12t + 12": evaluate(["raw", "12", "12t", "11t"]),
        "10t + 11t + 12t + 12": evaluate(["raw", "12", "12t", "11t", "10t"]),
        "11 + 11t + 12 + 12t": evaluate(["raw", "12", "12t", "11", "11t"]),
        "12 + 12z, <= 4 escapes": evaluate(["raw", "12", "12z"], [(768, 16, False, 4), (768, 14, True, 4)]),
        "11 + 12 + 12z, <= 4 escapes (11)": evaluate(["raw", "12", "12z", "11"],
                                                      [(704, 8, False, 4), (704, 6, True, 4)]),
        "11 + 12 + 12z, <= 16 escapes": evaluate(["raw", "12", "12z", "11"],
                                                 [(704, 8, False, 16), (704, 6, True, 16), (768, 16, False, 16),
                                                  (768, 14, True, 16)]),
    }
    # Escapes of 2 bytes (9-bit position + 7-bit e >> 1: the sign and the lowest exponent bit stay in their planes).
    for k in (8, 16, 32, 64):
        candidates[f"11 + 12 + 12z, <= {k} escapes of 2 bytes"] = evaluate(
            ["raw", "12", "12z"], [(704, 8, False, k, 2), (704, 6, True, k, 2), (768, 16, False, k, 2),
                                   (768, 14, True, k, 2)])
    # The same lists packed: a block ends on a 2- or 4-byte boundary instead of 16. A byte count only: the next block
    # then starts where 16-byte lane loads and bulk copies cannot read it (the page-end layout below keeps it aligned).
    for unit in (2, 4):
        candidates[f"11 + 12 + 12z, <= 32 escapes of 2 bytes, blocks in {unit}-byte units"] = evaluate(
            ["raw", "12", "12z"], [(704, 8, False, 32, 2, unit), (704, 6, True, 32, 2, unit),
                                   (768, 16, False, 32, 2, unit), (768, 14, True, 32, 2, unit)])
    # The same, with every block's fixed part (704 or 768 bytes) where the lane loads want it, 16-byte aligned, and the
    # escape lists of all of a page's blocks gathered after them, the page padded to 16 bytes once. A block's escape
    # count (<= 32) needs a byte of metadata; at d 64 and page 16 it fits the descriptor word's 2 unused bytes, so
    # none is counted.
    fixed, esc_bytes, total = np.full(e.shape[:-1], 1024), np.zeros(e.shape[:-1], np.int64), np.full(e.shape[:-1], 1024)
    for size, span, z in ((704, 6, True), (704, 8, False), (768, 14, True), (768, 16, False)):
        need = esc[(span, z)]
        t = np.where(need <= 32, size + 2 * need, 1 << 20)
        better = t < total
        fixed, esc_bytes, total = (np.where(better, size, fixed), np.where(better, 2 * need, esc_bytes),
                                   np.minimum(t, total))
    page_bytes = fixed.sum(axis=(2, 3, 4)) + -(-esc_bytes.sum(axis=(2, 3, 4)) // 16) * 16
    candidates["11 + 12 + 12z, <= 32 escapes of 2 bytes, lists at the page's end"] = {
        **kv_ratios(total, page_bytes.sum()), "escaped_blocks": float((esc_bytes > 0).mean()),
        "mean_escapes_per_block": float(esc_bytes.mean() / 2)}
    # A table of the 4 most frequent exponent pairs (2-bit codes; 4 bytes of table) + 2-byte escapes for the rest.
    pairs = e >> 1
    counts = np.stack([(pairs == x).sum(-1) for x in range(128)], -1)
    top4 = -np.sort(-counts, axis=-1)[..., :4].sum(-1)
    need_t = 512 - top4
    for k in (16, 32):
        t_size = np.where(need_t <= k, 720 + np.where(need_t > 0, -(-2 * need_t // 16) * 16, 0), 1 << 20)
        best = np.full(e.shape[:-1], 1 << 20)
        for name in ("raw", "12", "12z"):
            size, fits = modes[name]
            best = np.where(fits, np.minimum(best, size), best)
        for m in ((704, 8, False, k, 2), (704, 6, True, k, 2), (768, 16, False, k, 2), (768, 14, True, k, 2)):
            best = np.minimum(best, esc_mode(*m))
        best = np.minimum(best, t_size)
        candidates[f"11t (top-4 table) + 11 + 12 + 12z, <= {k} escapes of 2 bytes"] = {
            **kv_ratios(best), "block_sizes": block_share(best)}
    # Half blocks (256 values: one 16-dim half, one mma A operand per lane): each half its own mode and base.
    halves = e.reshape(*e.shape[:-1], 32, 2, 8).swapaxes(-3, -2).reshape(*e.shape[:-1], 2, 256)
    half_best = np.full(halves.shape[:-1], 1 << 20)
    for size, span, z in ((512, 16, False), (384 + 0, 16, False), (384, 14, True), (352, 8, False), (352, 6, True)):
        if size == 512:
            fits = np.ones(halves.shape[:-1], bool)
        else:
            fits = window_fit(halves, span, z)
        half_best = np.where(fits, np.minimum(half_best, size), half_best)
    hb = half_best.sum(-1)
    candidates["half blocks: 11 + 11z + 12 + 12z (2 descriptors a block)"] = {
        **kv_ratios(hb, hb.sum() + hb.size), "block_sizes": block_share(half_best)}
    # Fixed-rate floors: each group of positions (a block, a lane's 16, a code word's 8) codes its pair levels in
    # log2(levels) bits a value (an ideal mixed-radix code), plus sign and low byte; "+ header" adds the fewest bits
    # that say which levels a group uses inside its block's (log2 of the (first, count) choices: B (B + 1) / 2 for a
    # block of B levels). No fixed-rate code at that granularity, whatever its kernel, stores less.
    block_levels = np.maximum(pair_levels(e, 512), 1)
    for group, label in ((512, "a block"), (16, "a lane's 16 values"), (8, "a code word's 8 values")):
        lev = pair_levels(e, group)
        best = (group * np.minimum(16.0, 9 + np.log2(np.maximum(lev, 1))) / 8).sum(-1)
        header = 0 if group == 512 else (512 // group) * np.log2(block_levels * (block_levels + 1) / 2)[..., 0] / 8
        for name, b in (("", best), (" + header", best + header)):
            candidates[f"fixed-rate floor, levels per {label}{name}"] = {
                **kv_ratios(b), "groups_within_4_levels": float((lev <= 4).mean())}
            if group == 512:
                break
    # Per-lane 11/12: a lane whose pairs span <= 4 levels takes 2-bit codes (11 bits a value), others 3-bit (12) in a
    # block that fits 8 levels (raw otherwise); the lane's mode and window offset need a header (4 bits a lane: 16
    # bytes a block; 8 if packed tighter), and code sizes vary by lane (offsets by ballot + popc).
    lane_lev, block_lev = pair_levels(e, 16), pair_levels(e, 512)[..., 0]
    lane_bytes = np.where(lane_lev <= 4, 22, 24).sum(-1)
    for header in (0, 8, 16):
        best = np.where(block_lev <= 8, lane_bytes + header, 1024)
        candidates[f"per-lane 11 / 12 + {header}-byte header"] = kv_ratios(best)
    # Exponents relative to their channel (K has outlier channels): the spans that stay are across tokens.
    chan = channel_offset_sizes(kv)
    candidates["11 + 11z + 12 + 12z, pairs less a per-channel offset"] = {
        **kv_ratios(chan), "block_sizes": block_share(chan)}
    ent = entropy_bytes(v)
    candidates["entropy floor (order 0, high byte)"] = kv_ratios(ent)
    print(f"SmolLM2 real KV {shape}: {e.shape[:-1]} blocks; metadata {meta_bytes / raw_bytes:.4f} of BF16")
    print(f"{'candidate':40} {'K+V+meta':>9} {'K':>7} {'V':>7}  fraction of blocks by size (bytes)")
    for name, r in candidates.items():
        used = " ".join(f"{k}:{x:.3f}" for k, x in r.get("block_sizes", {}).items() if x)
        print(f"{name:40} {r['ratio_with_meta']:9.4f} {r['K']:7.4f} {r['V']:7.4f}  {used}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "format_candidates.json").write_text(json.dumps(
            {"benchmark": "format_candidates", "command": "python " + " ".join(sys.argv), "kv_shape": list(shape),
             "candidates": candidates}, indent=1))


if __name__ == "__main__":
    main()
