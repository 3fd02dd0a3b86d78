"""Every meta row carries the geometry (page_size, head_dim) and format version it was written with (docs/FORMAT.md,
Metadata): a call with another geometry, or a row of another version, is an error on CPU and a refusal (NaN, nothing
written) on CUDA, never neighbouring bytes read as tokens. The reproducers of issue 19 (item 2) are here: (16, 64),
(32, 64) and (16, 128) give meta rows of one width."""

import pytest
import torch

import torch_zipkv
from torch_zipkv import format as fmt
from torch_zipkv import ops, reference

from conftest import random_kv, requires_cuda

bf = torch.bfloat16


def T(*xs):
    return torch.tensor(xs, dtype=torch.int32)


def tag_bytes(page_size: int, head_dim: int) -> list[int]:
    """The tag as docs/FORMAT.md states it, little-endian bytes: head_dim / 32, page_size / 16, 0x80 | 5, 'Z'."""
    return [head_dim // 32, page_size // 16, 0x85, 0x5A]


def word_bytes(word: int) -> list[int]:
    return list((word & 0xFFFFFFFF).to_bytes(4, "little"))


@pytest.fixture
def ckv(gen):
    """Two pages of page_size 16, head_dim 64, one kv head: meta rows 3 words wide, as for (32, 64) and (16, 128)."""
    return torch_zipkv.compress(random_kv(2, 16, 1, 64, gen))


def test_same_row_width_for_the_issue_geometries():
    assert fmt.meta_words(16, 64) == fmt.meta_words(32, 64) == fmt.meta_words(16, 128) == 3


@pytest.mark.parametrize("page_size", [16, 32, 48, 128])
@pytest.mark.parametrize("head_dim", fmt.HEAD_DIMS)
def test_every_writer_tags_rows_with_their_geometry(gen, page_size, head_dim):
    """compress_pages (compressed and raw), the reference encoder, empty_storage and the cache's open-page rows all
    write the tag of their geometry in word 1."""
    kv = random_kv(2, page_size, 2, head_dim, gen)
    want = tag_bytes(page_size, head_dim)
    for allow in (True, False):
        meta = torch_zipkv.compress(kv, allow_compress=allow).meta
        assert {tuple(word_bytes(w)) for w in meta[..., 1].flatten().tolist()} == {tuple(want)}
    _, ref_meta = reference.encode(kv)
    assert {tuple(word_bytes(w)) for w in ref_meta[..., 1].flatten().tolist()} == {tuple(want)}
    _, empty, _ = torch_zipkv.empty_storage(3, page_size, 2, head_dim)
    assert (empty[..., 0] == fmt.NO_STREAM).all()
    assert {tuple(word_bytes(w)) for w in empty[..., 1].flatten().tolist()} == {tuple(want)}
    assert word_bytes(fmt.raw_descriptor_words(page_size, head_dim)[0]) == want
    assert fmt.tag_geometry(fmt.meta_tag(page_size, head_dim)) == (page_size, head_dim)


def test_issue_19_wrong_page_size_in_paged_decode_is_an_error(ckv):
    with pytest.raises(ValueError, match=r"zipkv.paged_decode: meta\[0, K, head 0\] was written for page_size 16 and "
                                         r"head_dim 64, not the call's page_size 32 and head_dim 64 \(its page_size"):
        ops.paged_decode(torch.ones(1, 1, 64, dtype=bf), ckv.data, ckv.meta, T(0, 1), T(0), T(32), 32)


def test_issue_19_wrong_head_dim_in_paged_decode_is_an_error(ckv):
    with pytest.raises(ValueError, match=r"zipkv.paged_decode: meta\[0, K, head 0\] was written for page_size 16 and "
                                         r"head_dim 64, not the call's page_size 16 and head_dim 128 \(its page_size "
                                         r"and q.shape\[2\]\)"):
        torch_zipkv.paged_decode(torch.ones(1, 1, 128, dtype=bf), ckv, T(0, 1), T(0), T(16))


def test_issue_19_wrong_page_size_in_a_compressed_kv_is_an_error(ckv):
    bad = torch_zipkv.CompressedKV(ckv.data, ckv.meta[:1].clone(), page_size=32, head_dim=64)
    message = r"meta\[0, K, head 0\] was written for page_size 16 and head_dim 64, not the"
    with pytest.raises(ValueError, match=r"CompressedKV." + message + r" CompressedKV's page_size 32 and head_dim 64"):
        bad.validate()
    with pytest.raises(ValueError, match=r"zipkv.decompress_pages: " + message + r" call's page_size 32 and head_dim "
                                         r"64 \(out.shape\[2\] and out.shape\[4\]\)"):
        torch_zipkv.decompress(bad)
    with pytest.raises(ValueError, match=r"zipkv.decompress_pages: meta\[0, K, head 0\] was written for page_size 16 "
                                         r"and head_dim 64, not the call's page_size 16 and head_dim 128"):
        ops.decompress_pages(ckv.data, ckv.meta, T(0), 16, 128)


def test_wrong_geometry_in_append_kv_is_an_error_and_writes_nothing(ckv):
    data, meta, cursor = torch_zipkv.empty_storage(2, 16, 1, 64)
    ops.compress_pages(torch.zeros(2, 2, 16, 1, 64, dtype=bf), T(0, 1), data, meta, cursor, allow_compress=False)
    before = data.clone()
    with pytest.raises(ValueError, match=r"zipkv.append_kv: meta\[0, K, head 0\] was written for page_size 16 and "
                                         r"head_dim 64, not the call's page_size 32 and head_dim 64 \(its page_size "
                                         r"and k.shape\[2\]\)"):
        ops.append_kv(torch.ones(1, 1, 64, dtype=bf), torch.ones(1, 1, 64, dtype=bf), T(0), T(20), 32, data, meta)
    with pytest.raises(ValueError, match=r"not the call's page_size 16 and head_dim 128"):
        ops.append_kv(torch.ones(1, 1, 128, dtype=bf), torch.ones(1, 1, 128, dtype=bf), T(0), T(3), 16, data, meta)
    assert torch.equal(data, before)


@pytest.mark.parametrize("word", [
    fmt.meta_tag(16, 64) & ~0x00FF0000 | 0x00840000,  # the same tag with version 4 (before zero-aware blocks)
    fmt.meta_tag(16, 64) & ~0x00FF0000 | 0x00830000,  # and with version 3
    int.from_bytes(bytes([3, 0x80, 0, 0]), "little"),   # a version-3 row's word 1: descriptor bytes, all <= 0x80
    0,
])
def test_a_row_of_another_version_is_refused(ckv, word):
    meta = ckv.meta.clone()
    meta[1, 1, 0, 1] = word - (1 << 32) if word >= 1 << 31 else word
    bad = torch_zipkv.CompressedKV(ckv.data, meta, 16, 64)
    message = r"meta\[1, V, head 0\] is not a row of format version 5"
    with pytest.raises(ValueError, match=message):
        bad.validate()
    with pytest.raises(ValueError, match=r"zipkv.decompress_pages: " + message):
        torch_zipkv.decompress(bad)
    with pytest.raises(ValueError, match=r"zipkv.paged_decode: " + message):
        torch_zipkv.paged_decode(torch.ones(1, 1, 64, dtype=bf), bad, T(0, 1), T(1), T(16))
    torch_zipkv.paged_decode(torch.ones(1, 1, 64, dtype=bf), bad, T(0, 1), T(0), T(16))  # page 0 is intact


@requires_cuda
def test_cuda_refuses_rows_of_another_geometry_or_version(gen):
    """The CUDA kernels cannot raise on device contents: a request reading a row whose tag is not the call's geometry
    and version gets NaN (out and lse), decompress_pages returns its values as 0xFFFF (NaN), append_kv writes
    nothing; requests reading intact rows are unaffected."""
    kv = random_kv(4, 16, 1, 64, gen).cuda()
    ckv = torch_zipkv.compress(kv)
    q = torch.randn(2, 1, 64, generator=gen).to(bf).cuda()
    cuda = lambda *xs: T(*xs).cuda()  # noqa: E731
    # Issue 19's first reproducer: page_size 32 over pages written with 16 (one 32-token page = rows of page 0).
    lse = torch.empty(1, 1, device="cuda")
    out = ops.paged_decode(q[:1], ckv.data, ckv.meta, cuda(0, 1), cuda(0), cuda(32), 32, lse=lse)
    assert out.isnan().all() and lse.isnan().all()
    # Its second: head_dim 128 over head_dim-64 rows.
    out = ops.paged_decode(torch.ones(1, 1, 128, dtype=bf, device="cuda"), ckv.data, ckv.meta, cuda(0, 1), cuda(0),
                           cuda(16), 16)
    assert out.isnan().all()
    # Its third: decompress with page_size 32.
    out = ops.decompress_pages(ckv.data, ckv.meta[:2].clone(), cuda(0, 1), 32, 64)
    assert (out.view(torch.int16) == -1).all()
    # A row of another version poisons exactly the request that reads it.
    meta = ckv.meta.clone()
    meta[2, 0, 0, 1] = fmt.meta_tag(16, 64) & ~0x00FF0000 | 0x00830000
    good = torch_zipkv.paged_decode(q, ckv, cuda(0, 2, 4), cuda(0, 1, 2, 3), cuda(16, 16))
    lse = torch.empty(2, 1, device="cuda")
    out = torch_zipkv.paged_decode(q, torch_zipkv.CompressedKV(ckv.data, meta, 16, 64), cuda(0, 2, 4),
                                   cuda(0, 1, 2, 3), cuda(16, 16), lse=lse)
    assert torch.equal(out[0].view(torch.int16), good[0].view(torch.int16))
    assert out[1].isnan().all() and lse[1].isnan().all()
    dec = ops.decompress_pages(ckv.data, meta, cuda(0, 1, 2, 3), 16, 64)
    assert (dec[2, 0].view(torch.int16) == -1).all()
    assert torch.equal(dec[[0, 1, 3]].view(torch.int16), kv[[0, 1, 3]].view(torch.int16))
    assert torch.equal(dec[2, 1].view(torch.int16), kv[2, 1].view(torch.int16))
    # append_kv with the wrong page_size writes nothing.
    data, meta, cursor = torch_zipkv.empty_storage(2, 16, 1, 64, "cuda")
    ops.compress_pages(torch.zeros(2, 2, 16, 1, 64, dtype=bf, device="cuda"), cuda(0, 1), data, meta, cursor,
                       allow_compress=False)
    before = data.clone()
    ones = torch.ones(1, 1, 64, dtype=bf, device="cuda")
    ops.append_kv(ones, ones, cuda(0), cuda(20), 32, data, meta)
    assert torch.equal(data, before)
