// The torch_zipkv on-device format, version 5 (kFormatVersion; docs/FORMAT.md is the prose version of this file).
//
// Everything that decides where a byte lives is here, as inline functions shared by the CPU (.cpp) and CUDA (.cu)
// kernels, so both produce the same bytes by construction.
//
// Vocabulary (the kernels and torch_zipkv/*.py use each word in this one sense)
//   page    page_size tokens (a multiple of 16) of one layer's K and V, all KV heads.
//   stream  one (page, K|V, kv_head): page_size x head_dim BF16 values, stored as a run of blocks.
//   tile    16 consecutive tokens of a page (of a stream: its head_dim / 32 blocks of those tokens).
//   block   16 tokens x 32 dims of one stream = 512 values, the unit that is stored raw or compressed; never a CUDA
//           thread block, which the kernels call a CTA. (paged_decode's tile table refreshes in rounds of 32 tiles;
//           its kHeadTiles counts MMA N tiles of 8 query heads.)
//   Blocks of a stream are ordered tile-major: block = (token / 16) * (head_dim / 32) + dim / 32.
//
// A block is stored either
//   raw        1024 bytes: the 512 BF16 values (little-endian) in two halves of 512 bytes: the first 8 positions of
//              each lane's 16 (see below) at 16 lane, its last 8 at 512 + 16 lane (raw_index), or
//   compressed  768 bytes: 512 low bytes (position order), then 256 bytes of codes (4 bytes per 8 positions).
// BF16 = s | e (8 bits) | f (7 bits). low byte = lowest exponent bit + f, kept verbatim; the high byte is s << 7 | p,
// p = e >> 1 (the exponent pair). A compressed block stores, per value, the sign and a 3-bit code d that indexes the
// block's table of 8 pairs, given by its descriptor (code_table):
//   12-bit      (descriptor b/2, 0..127): b = (min e) & ~1, every e <= b + 15; table b/2 + 0 .. b/2 + 7, d = p - b/2
//               (entries past pair 127, where b/2 > 120, are codes no value takes).
//   zero-aware  (descriptor 0x80 | b/2, b/2 in 1..120; format version 5): values with e <= 1 (+-0 and subnormals, which
//               BF16 RoPE makes in K) take d = 7, table entry 0; the others need b = (min of their e) & ~1 >= 2,
//               every e <= b + 13 and b/2 <= 120; table b/2 + 0 .. b/2 + 6, 0.
// Code word of positions 8q..8q+7 (uint32, little-endian, at code byte 4q): bits 4k..4k+2 hold d[8q+k] (k = 0..7),
// bit 8j + 7 the sign of position 8q+j and bit 8j + 3 that of 8q+4+j (j = 0..3). One byte permute (PRMT) of the
// table with the selector w & 0x7777 then gives the pairs of positions 0..3 in byte order, and their signs are already
// at bits 7, 15, 23, 31 of w: prmt(t0, t1, w & 0x77777777) with its top bits replaced by w's (one LOP3) are their high
// bytes, and prmt(t0, t1, (w & 0x77777777) >> 16) with the top bits of w << 4 those of positions 4..7. Both kinds of
// compressed block take this one rebuild; only the two table words differ.
//
// Position order inside a block (why: the decode kernel feeds mma.sync.m16n8k16 straight from 16-byte loads).
// Lane = 4 g + t of a warp owns positions [16 lane, 16 lane + 16): 16 low bytes (one 16-byte load) and 8 code
// bytes (one 8-byte load), which rebuild the lane's A-operand registers in mma order. Word m of a lane (positions
// 2m, 2m + 1) is register m % 4 of the A fragment of 16-dim half m / 4 of the block, so each 16-byte half of a raw
// lane (and each code word's four rebuilt words) is one mma's A operand as it stands (since format version 3).
//   K (token-major A of S^T = K Q^T; M = 16 tokens, K = 16 dims): lane holds tokens {g, g+8} and, of each 16-dim
//     half, dims {2t, 2t+1, 2t+8, 2t+9}:   pos = 16 lane + 8 (dim / 16) + 4 (w / 8) + 2 (tok / 8) + w % 2,
//     with g = tok % 8, w = dim % 16, t = (w % 8) / 2.
//   V (dim-major A of O^T = V^T P^T; M = 16 dims, K = 16 tokens): lane holds dims {g, g+8, g+16, g+24} and tokens
//     {2t, 2t+1, 2t+8, 2t+9}:              pos = 16 lane + 8 (dim / 16) + 4 (tok / 8) + 2 (dim / 8 % 2) + tok % 2,
//     with g = dim % 8, t = (tok % 8) / 2.
//   (tok in [0, 16) within the tile, dim in [0, 32) within the block.) Consecutive position pairs (2i, 2i+1) are the
//   two halves of one bf16x2 register, low half first.
// A raw block keeps the lane's 32 bytes in two 16-byte pieces 512 bytes apart (format version 2; version 1 kept them
// together): each piece is then one conflict-free 16-byte shared-memory load per lane (32 bytes at a 32-byte stride
// cost a warp 3x the shared-memory wavefronts), and the first piece sits where a compressed block's low bytes sit.
//
// Metadata: int32 meta[num_pages][2][num_kv_heads][meta_words], one row per stream.
//   word 0: stream start in data, in units of 256 bytes (every block size is a multiple of 256), or -1 = no stream
//           (then the rest of the row is not read).
//   word 1: the row's tag, meta_tag(page_size, head_dim): the format version and the geometry the stream was
//           written with. Every reader compares it with the geometry of its call and refuses a row that differs, so
//           a call with the wrong page_size or head_dim (whose meta row width can come out the same) or a row of
//           another format version is an error, never neighbouring bytes read as tokens.
//   bytes 8.. (words 2..): one descriptor byte per block: 0..127 = 12-bit with base b/2, 0x80 = raw,
//   0x81..0xF8 = zero-aware with base b/2 = desc & 0x7F; 0xF9..0xFF are invalid; padding bytes are 0. The byte
//   offset of block i inside its stream is 768 i + 256 * (raw blocks before i).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ZIPKV_HD __host__ __device__ __forceinline__
#else
#define ZIPKV_HD inline
#endif

namespace zipkv {

constexpr int kFormatVersion = 5;
constexpr int kTileTokens = 16;
constexpr int kBlockDims = 32;
constexpr int kBlockValues = kTileTokens * kBlockDims;   // 512
constexpr int kLowBytes = kBlockValues;                  // low bytes come first in a compressed block
constexpr int kCodeBytes = kBlockValues / 2;             // 12 bits per value in all
constexpr int kCompBlockBytes = kLowBytes + kCodeBytes;  // 768
constexpr int kRawBlockBytes = 2 * kBlockValues;         // 1024
constexpr int kRawHalfBytes = kRawBlockBytes / 2;        // a raw block's second piece of each lane starts here
constexpr int kStreamAlign = 256;                        // stream offsets are stored in these units
constexpr uint8_t kDescRaw = 0x80;
constexpr uint8_t kDescZero = 0x80;                          // 0x80 | b/2: zero-aware compressed (b/2 >= 1)
constexpr int kMaxZeroHalfBase = 120;                        // b/2 + 7 <= 127 in a zero-aware block
constexpr uint8_t kDescLast = kDescZero | kMaxZeroHalfBase;  // 0xF8, the largest valid descriptor
constexpr int32_t kNoStream = -1;
constexpr int kMaxPageSize = 128;
constexpr int kMetaHeaderWords = 2;  // a meta row's offset and tag words; its descriptors follow
// Tag bytes (little-endian): head_dim / 32, page_size / 16, 0x80 | version, 'Z'. The version byte is one no
// version-3 row could hold in word 1 (its descriptor bytes were <= 0x80), so an older row never passes for a v4 one.
constexpr uint32_t kMetaMagic = 0x5A;

// The head dims the format and every kernel support: the one list on the C++ side (torch_zipkv/format.py HEAD_DIMS is
// the Python side's; test_format.py checks that they agree). X(D) is expanded once per head dim, in this order:
// check_geometry accepts exactly these, and paged_decode dispatches on them (one paged_decode_hd<D>.cu instantiates
// the decode kernel for each; a head dim added here without its file fails to link).
#define ZIPKV_FOR_EACH_HEAD_DIM(X) X(64) X(128) X(256)

#define ZIPKV_HEAD_DIM_ITEM_(D) D,
constexpr int kHeadDims[] = {ZIPKV_FOR_EACH_HEAD_DIM(ZIPKV_HEAD_DIM_ITEM_)};
#undef ZIPKV_HEAD_DIM_ITEM_

constexpr bool head_dim_supported(int64_t head_dim) {
  for (int d : kHeadDims)
    if (head_dim == d) return true;
  return false;
}

// Sizes that every kernel and the Python side agree on.
ZIPKV_HD int blocks_per_stream(int page_size, int head_dim) {
  return (page_size / kTileTokens) * (head_dim / kBlockDims);
}
ZIPKV_HD int meta_words(int page_size, int head_dim) {
  return kMetaHeaderWords + (blocks_per_stream(page_size, head_dim) + 3) / 4;
}
// Word 1 of every meta row that holds a stream written for this geometry by this format version.
ZIPKV_HD int32_t meta_tag(int page_size, int head_dim) {
  return static_cast<int32_t>(kMetaMagic << 24 | (0x80u | kFormatVersion) << 16 |
                              static_cast<uint32_t>(page_size / kTileTokens) << 8 |
                              static_cast<uint32_t>(head_dim / kBlockDims));
}
// The descriptor bytes of a meta row.
ZIPKV_HD const uint8_t* row_descriptors(const int32_t* row) {
  return reinterpret_cast<const uint8_t*>(row + kMetaHeaderWords);
}
ZIPKV_HD int block_bytes(uint8_t desc) { return desc == kDescRaw ? kRawBlockBytes : kCompBlockBytes; }
ZIPKV_HD bool desc_valid(uint8_t desc) { return desc <= kDescLast; }
ZIPKV_HD bool desc_zero_aware(uint8_t desc) { return desc > kDescRaw; }  // of a valid descriptor
// b/2 of a compressed block's descriptor.
ZIPKV_HD int desc_half_base(uint8_t desc) { return desc & 0x7F; }

// Position of (tok, dim) inside its block; tok in [0, 16), dim in [0, 32).
ZIPKV_HD int k_position(int tok, int dim) {
  const int g = tok % 8, w = dim % 16, t = (w % 8) / 2;
  return 16 * (4 * g + t) + 8 * (dim / 16) + 4 * (w / 8) + 2 * (tok / 8) + w % 2;
}
ZIPKV_HD int v_position(int tok, int dim) {
  const int g = dim % 8, t = (tok % 8) / 2;
  return 16 * (4 * g + t) + 8 * (dim / 16) + 4 * (tok / 8) + 2 * (dim / 8 % 2) + tok % 2;
}
// is_v: 0 for K, 1 for V (the page's second index).
ZIPKV_HD int position(int is_v, int tok, int dim) { return is_v ? v_position(tok, dim) : k_position(tok, dim); }

// Index (in 16-bit values) of position p inside a raw block: lane p / 16's values 0..7 in the first half, 8..15 in
// the second.
ZIPKV_HD int raw_index(int p) { return (p % 16 < 8 ? 0 : kRawHalfBytes / 2) + 8 * (p / 16) + p % 8; }

ZIPKV_HD int exponent_of(uint16_t x) { return (x >> 7) & 0xFF; }

// The descriptor of a block, from the min and max exponent of its values and the min exponent of those with
// e >= 2 (above 255 when there is none). Plain 12-bit where it fits (the cheaper rebuild), else zero-aware, else raw.
ZIPKV_HD uint8_t descriptor_for(int emin, int emax, int emin_big) {
  const int base = emin & ~1;
  if (emax - base <= 15) return static_cast<uint8_t>(base >> 1);
  const int zbase = emin_big & ~1;  // emin <= 1 here: some value has e <= 1, and some e >= 2
  if (emax - zbase <= 13 && zbase / 2 <= kMaxZeroHalfBase) return static_cast<uint8_t>(kDescZero | zbase / 2);
  return kDescRaw;
}

// d of a value in a compressed block with this descriptor.
ZIPKV_HD uint32_t code_d(uint16_t value, uint8_t desc) {
  const int e = exponent_of(value);
  if (desc_zero_aware(desc) && e <= 1) return 7;
  return static_cast<uint32_t>(e / 2 - desc_half_base(desc));
}

// The code word of 8 positions (values in position order).
ZIPKV_HD uint32_t encode_group(const uint16_t* v, uint8_t desc) {
  uint32_t w = 0;
  for (int k = 0; k < 8; ++k) w |= code_d(v[k], desc) << (4 * k);
  for (int j = 0; j < 4; ++j)
    w |= static_cast<uint32_t>(v[j] >> 15) << (8 * j + 7) | static_cast<uint32_t>(v[j + 4] >> 15) << (8 * j + 3);
  return w;
}

// The table of a compressed block: the low 7 bits of byte k of t0 (k = 0..3) and of t1 (k = 4..7) are the exponent
// pair that code k stands for; the top bits are not part of it (decode_high_bytes takes the signs from the code word
// instead), which lets the table be desc * 0x01010101 plus offsets with desc's zero-aware bit 7 left in. Code 7 of a
// zero-aware table is pair 0. (Entries past pair 127 of a 12-bit block with b/2 > 120 are never used.)
ZIPKV_HD void code_table(uint8_t desc, uint32_t* t0, uint32_t* t1) {
  *t0 = static_cast<uint32_t>(desc) * 0x01010101u + 0x03020100u;
  *t1 = (*t0 + 0x04040404u) & (desc_zero_aware(desc) ? 0x80FFFFFFu : 0xFFFFFFFFu);
}

// Byte k of the result is byte (sel >> 4k) & 7 of the 8 bytes {x, y} (k = 0..3; the selector's bit 3 of each nibble
// must be 0, its upper 16 bits are ignored): the PRMT instruction.
ZIPKV_HD uint32_t byte_select(uint32_t x, uint32_t y, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(y), "r"(sel));
  return r;
#else
  const uint64_t xy = static_cast<uint64_t>(y) << 32 | x;
  uint32_t r = 0;
  for (int k = 0; k < 4; ++k) r |= static_cast<uint32_t>((xy >> (8 * ((sel >> (4 * k)) & 7))) & 0xFF) << (8 * k);
  return r;
#endif
}

// Bits 0-6 of x and bit 7 of y, in each byte: one LOP3 on the GPU (the compiler does not find it in the C++ form).
ZIPKV_HD uint32_t take_signs(uint32_t x, uint32_t y) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, 0x80808080, 0xD8;" : "=r"(r) : "r"(x), "r"(y));  // (a & ~c) | (b & c)
  return r;
#else
  return (x & 0x7F7F7F7Fu) | (y & 0x80808080u);
#endif
}

// High bytes of the 8 positions of one code word of a compressed block with table (t0, t1): positions 0..3 in *h0,
// 4..7 in *h1 (byte j = position j).
ZIPKV_HD void decode_high_bytes(uint32_t w, uint32_t t0, uint32_t t1, uint32_t* h0, uint32_t* h1) {
  const uint32_t sel = w & 0x77777777u;
  *h0 = take_signs(byte_select(t0, t1, sel), w);
  *h1 = take_signs(byte_select(t0, t1, sel >> 16), w << 4);
}

// Byte offset of block i inside a stream whose descriptors are desc[0..].
ZIPKV_HD int block_offset(const uint8_t* desc, int i) {
  int off = 0;
  for (int k = 0; k < i; ++k) off += block_bytes(desc[k]);
  return off;
}

// Meta row status, shared so CPU kernels can raise and CUDA kernels can refuse to touch a bad row.
enum StreamStatus : int {
  kStreamOk = 0,
  kStreamMissing = 1,
  kStreamBadDescriptor = 2,
  kStreamOutOfRange = 3,
  kStreamOtherGeometry = 4,  // a tag of this version for another page_size or head_dim
  kStreamOtherVersion = 5,   // not a tag of this version (another format version, or corrupted)
};

// Whether tag (a row's word 1) is this version's tag for (page_size, head_dim): kStreamOk, kStreamOtherGeometry
// or kStreamOtherVersion.
ZIPKV_HD int tag_status(int32_t tag, int page_size, int head_dim) {
  const int32_t want = meta_tag(page_size, head_dim);
  if (tag == want) return kStreamOk;
  return (tag & 0xFFFF0000) == (want & 0xFFFF0000) ? kStreamOtherGeometry : kStreamOtherVersion;
}

// Validates one meta row of a call with this page_size and head_dim against a data buffer of data_bytes; on
// success sets *start (bytes) and *nbytes.
ZIPKV_HD int read_stream(const int32_t* row, int page_size, int head_dim, int64_t data_bytes, int64_t* start,
                         int* nbytes) {
  if (row[0] < 0) return kStreamMissing;
  const int tag = tag_status(row[1], page_size, head_dim);
  if (tag != kStreamOk) return tag;
  const int nblocks = blocks_per_stream(page_size, head_dim);
  const uint8_t* desc = row_descriptors(row);
  int total = 0;
  for (int i = 0; i < nblocks; ++i) {
    if (!desc_valid(desc[i])) return kStreamBadDescriptor;
    total += block_bytes(desc[i]);
  }
  *start = static_cast<int64_t>(row[0]) * kStreamAlign;
  *nbytes = total;
  return *start + total <= data_bytes ? kStreamOk : kStreamOutOfRange;
}

// Encode one block of 512 values (position order) with descriptor desc into dst (768 or 1024 bytes).
ZIPKV_HD void encode_block(const uint16_t* v, uint8_t desc, uint8_t* dst) {
  if (desc == kDescRaw) {
    for (int p = 0; p < kBlockValues; ++p) {
      dst[2 * raw_index(p)] = static_cast<uint8_t>(v[p] & 0xFF);
      dst[2 * raw_index(p) + 1] = static_cast<uint8_t>(v[p] >> 8);
    }
    return;
  }
  for (int p = 0; p < kBlockValues; ++p) dst[p] = static_cast<uint8_t>(v[p] & 0xFF);
  for (int q = 0; q < kBlockValues / 8; ++q) {
    const uint32_t w = encode_group(v + 8 * q, desc);
    for (int j = 0; j < 4; ++j) dst[kLowBytes + 4 * q + j] = static_cast<uint8_t>(w >> (8 * j));
  }
}

// Decode one block (768 or 1024 bytes at src, per desc) into 512 values in position order.
ZIPKV_HD void decode_block(const uint8_t* src, uint8_t desc, uint16_t* v) {
  if (desc == kDescRaw) {
    for (int p = 0; p < kBlockValues; ++p) {
      const int j = raw_index(p);
      v[p] = static_cast<uint16_t>(src[2 * j] | (src[2 * j + 1] << 8));
    }
    return;
  }
  uint32_t t0, t1;
  code_table(desc, &t0, &t1);
  for (int q = 0; q < kBlockValues / 8; ++q) {
    const uint8_t* c = src + kLowBytes + 4 * q;
    const uint32_t w = c[0] | (c[1] << 8) | (c[2] << 16) | (static_cast<uint32_t>(c[3]) << 24);
    uint32_t h[2];
    decode_high_bytes(w, t0, t1, &h[0], &h[1]);
    for (int j = 0; j < 8; ++j) {
      const uint32_t hi = (h[j / 4] >> (8 * (j % 4))) & 0xFF;
      v[8 * q + j] = static_cast<uint16_t>((hi << 8) | src[8 * q + j]);
    }
  }
}

}  // namespace zipkv
