"""Pure-PyTorch oracle: an independent statement of the format (encoder and decoder), and dense float64 decode and
prefill attention. Slow and obviously correct; tests compare the C++/CUDA kernels with it."""

from __future__ import annotations

import torch

from . import format as fmt


def lane_coords(is_v: bool) -> list[tuple[int, int]]:
    """(token, dim) of each of the 512 positions of a block, read off the mma.sync.m16n8k16 A-operand fragments:
    lane 4g+t holds, in order, the values it feeds to the tensor cores (docs/FORMAT.md): word m (positions 2m, 2m+1)
    is register m % 4 of the A fragment of the block's 16-dim half m // 4."""
    coords = []
    for g in range(8):
        for t in range(4):
            if is_v:  # A of Vᵀ·Pᵀ: rows dims g (+8) of each 16-dim half, columns tokens 2t, 2t+1 (+8)
                coords += [(8 * tb + 2 * t + b, 16 * h + 8 * db + g)
                           for h in range(2) for tb in range(2) for db in range(2) for b in range(2)]
            else:  # A of K·Qᵀ: rows tokens g (+8), columns dims 2t, 2t+1 (+8) of each 16-dim half
                coords += [(g + 8 * tb, 16 * h + 8 * db + 2 * t + b)
                           for h in range(2) for db in range(2) for tb in range(2) for b in range(2)]
    return coords


def _blocks(kv: torch.Tensor) -> torch.Tensor:
    """bf16 [n, 2, P, H, D] -> int64 bit patterns [n, 2, H, blocks, 512] in position order."""
    n, _, P, H, D = kv.shape
    u = kv.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    u = u.view(n, 2, P // 16, 16, H, D // 32, 32).permute(0, 1, 4, 2, 5, 3, 6)  # n, 2, H, tiles, spans, tok, dim
    u = u.reshape(n, 2, H, -1, 16 * 32)
    out = torch.empty_like(u)
    for is_v in (0, 1):
        src = torch.tensor([tok * 32 + dim for tok, dim in lane_coords(bool(is_v))])
        out[:, is_v] = u[:, is_v][..., src]
    return out


def encode(kv: torch.Tensor, compress: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes (uint8 [nbytes]) and meta (int32 [n, 2, H, W]) that compress_pages writes at cursor 0."""
    n, _, P, H, D = kv.shape
    v = _blocks(kv)
    e = (v >> 7) & 0xFF
    base = e.amin(-1) & ~1
    plain = e.amax(-1) - base <= 15  # 12-bit: every exponent in [base, base + 15]
    # Zero-aware 12-bit: values with e <= 1 take d = 7 (high byte: the sign alone); the others need a window of 14
    # from their own even base, which must leave base / 2 + 7 <= 127.
    small = e <= 1
    zbase = torch.where(small, 256, e).amin(-1) & ~1
    zero = ~plain & small.any(-1) & (e.amax(-1) - zbase <= 13) & (zbase <= 240)
    comp = (plain | zero) & compress
    low = v & 0xFF
    half = torch.where(plain, base >> 1, zbase >> 1).unsqueeze(-1)
    d = torch.where(zero.unsqueeze(-1) & small, 7, (e >> 1) - half)
    s, d = (x.view(*x.shape[:-1], 64, 8) for x in (v >> 15, d))  # 8-position groups
    # One little-endian uint32 per group: d of position k at bits 4k..4k+2; the sign of position j at bit 8j + 7 and
    # that of j + 4 at bit 8j + 3 (j < 4).
    shift_d = torch.arange(8) * 4
    shift_s = torch.tensor([7, 15, 23, 31, 3, 11, 19, 27])
    words = ((d << shift_d) | (s << shift_s)).sum(-1)  # disjoint bits: the sum is the OR
    codes = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], -1)
    comp_bytes = torch.cat([low, codes.flatten(-2)], -1)  # [..., 768]
    # Raw: each lane's 16 positions as two 8-value pieces, the first pieces of all lanes, then the second ones.
    raw_order = v.view(*v.shape[:-1], 32, 2, 8).transpose(-3, -2).flatten(-3)
    raw_bytes = torch.stack([raw_order & 0xFF, raw_order >> 8], -1).flatten(-2)  # [..., 1024] little-endian
    chunks, meta = [], torch.zeros(n, 2, H, fmt.meta_words(P, D), dtype=torch.int32)
    desc = torch.where(comp, torch.where(plain, base >> 1, 0x80 | (zbase >> 1)), 0x80)
    offset = 0
    for i in range(n):
        for kvi in range(2):
            for h in range(H):
                meta[i, kvi, h, 0] = offset // fmt.STREAM_ALIGN
                for b in range(desc.shape[-1]):
                    block = comp_bytes[i, kvi, h, b] if comp[i, kvi, h, b] else raw_bytes[i, kvi, h, b]
                    chunks.append(block)
                    offset += block.numel()
    # Word 1, the tag: bytes head_dim / 32, page_size / 16, 0x80 | version 5, 'Z' (0x5A).
    meta[..., 1] = torch.tensor([D // 32, P // 16, 0x85, 0x5A], dtype=torch.uint8).view(torch.int32)
    desc_bytes = torch.zeros(n, 2, H, (fmt.meta_words(P, D) - 2) * 4, dtype=torch.uint8)
    desc_bytes[..., : desc.shape[-1]] = desc.to(torch.uint8)
    meta[..., 2:] = desc_bytes.view(torch.int32)
    data = torch.cat(chunks).to(torch.uint8) if chunks else torch.empty(0, dtype=torch.uint8)
    return data, meta


def decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    sm_scale: float,
    *,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 decode attention over natural pages kv (bf16 [pages, 2, P, H, D]); returns (out, lse) with
    out float64 [batch, Hq, D] (zeros for a request with no pages) and lse float64 [batch, Hq] (-inf there).
    ``window_left`` >= 0 keeps each request's last window_left + 1 tokens; ``logits_soft_cap`` > 0 caps the
    logits with cap * tanh(logit / cap). A query head whose every logit is -inf attends to nothing, like a request
    with no pages: zeros and lse -inf (softmax alone would give 0 / 0 = NaN), as the kernels do."""
    batch, hq, dim = q.shape
    heads = kv.shape[3]
    out = torch.zeros(batch, hq, dim, dtype=torch.float64)
    lse = torch.full((batch, hq), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        pages = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long().cpu()
        if pages.numel() == 0:
            continue
        tokens = kv[pages].double().cpu().permute(1, 0, 2, 3, 4).reshape(2, -1, heads, dim)  # [2, L, H, D]
        length = (pages.numel() - 1) * kv.shape[2] + int(kv_last_page_len[b])
        first = max(0, length - window_left - 1) if window_left >= 0 else 0
        k = tokens[0, first:length].repeat_interleave(hq // heads, dim=1)  # [L, Hq, D]
        v = tokens[1, first:length].repeat_interleave(hq // heads, dim=1)
        logits = torch.einsum("hd,lhd->hl", q[b].double().cpu(), k) * sm_scale
        if logits_soft_cap > 0:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        lse[b] = torch.logsumexp(logits, -1)
        probs = torch.where(lse[b].isneginf()[:, None], 0.0, torch.softmax(logits, -1))
        out[b] = torch.einsum("hl,lhd->hd", probs, v)
    return out, lse


def prefill_attention(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    sm_scale: float,
    *,
    causal: bool = True,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 attention of many query tokens per request (q bf16 [nnz_q, Hq, D], request b's tokens
    q[qo_indptr[b]:qo_indptr[b + 1]]) over natural pages kv (bf16 [pages, 2, P, H, D]) that hold them: query token i
    of a request of q_len tokens over kv_len sits at position kv_len - q_len + i. ``causal`` keeps keys at positions
    <= its own, ``window_left`` >= 0 keys at positions >= its own - window_left. Returns (out float64 [nnz_q, Hq, D],
    lse float64 [nnz_q, Hq]); a row with no key, or only -inf logits, gets zeros and -inf."""
    nnz, hq, dim = q.shape
    heads, page_size = kv.shape[3], kv.shape[2]
    out = torch.zeros(nnz, hq, dim, dtype=torch.float64)
    lse = torch.full((nnz, hq), float("-inf"), dtype=torch.float64)
    for b in range(qo_indptr.numel() - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        pages = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long().cpu()
        if q1 == q0:
            continue
        length = (pages.numel() - 1) * page_size + int(kv_last_page_len[b]) if pages.numel() else 0
        tokens = kv[pages].double().cpu().permute(1, 0, 2, 3, 4).reshape(2, -1, heads, dim)[:, :length]
        k = tokens[0].repeat_interleave(hq // heads, dim=1)  # [L, Hq, D]
        v = tokens[1].repeat_interleave(hq // heads, dim=1)
        logits = torch.einsum("ihd,lhd->hil", q[q0:q1].double().cpu(), k) * sm_scale  # [Hq, q_len, L]
        if logits_soft_cap > 0:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        pos = torch.arange(length - (q1 - q0), length)[:, None]
        key = torch.arange(length)[None, :]
        keep = torch.ones(q1 - q0, length, dtype=torch.bool)
        if causal:
            keep &= key <= pos
        if window_left >= 0:
            keep &= key >= pos - window_left
        logits = logits.masked_fill(~keep, float("-inf"))
        row_lse = torch.logsumexp(logits, -1)  # [Hq, q_len]
        probs = torch.where(row_lse.isneginf()[..., None], 0.0, torch.softmax(logits, -1))
        out[q0:q1] = torch.einsum("hil,lhd->ihd", probs, v)
        lse[q0:q1] = row_lse.T
    return out, lse
