"""The engine's scheduler on its own: no model, no device tensors, a bare CPU CompressedPagedKVCache for admission.
FCFS with head-of-line blocking, max_batch, the prefill budget over requests in admission order, finishing at stop
tokens and lengths, late tokens dropped, aborts, and every output reported exactly once."""

from __future__ import annotations

import pytest

from torch_zipkv import CompressedPagedKVCache
from torch_zipkv.engine import SamplingParams
from torch_zipkv.engine.scheduler import Scheduler


def cache(pages: int) -> CompressedPagedKVCache:
    """One layer of 1 x 64 heads with room for exactly ``pages`` raw pages of 16 tokens."""
    page_bytes = 2 * 16 * 64 * 2
    kv = CompressedPagedKVCache(1, 1, 64, max_bytes=pages * page_bytes + 4096, chunk_bytes=page_bytes,
                                max_pages=pages + 4, device="cpu")
    assert kv.capacity().pages == pages
    return kv


def run_prefill(s: Scheduler, budget: int) -> list[tuple[int, int, int]]:
    """One step's prefill as the engine runs it: the chunks, each one's completion marked."""
    chunks = s.prefill_chunks(budget)
    for req, _, n in chunks:
        if s.prefilled(req, n):
            s.launched([req])
    return [(r.rid, start, n) for r, start, n in chunks]


def test_fcfs_admission_blocks_at_the_head_and_honours_max_batch():
    kv = cache(pages=6)
    released = []
    s = Scheduler(kv, max_batch=3, release=released.append)
    sizes = [(40, 8), (60, 4), (10, 2), (10, 2), (10, 2)]  # 3, 4, 1, 1, 1 pages
    for rid, (n, new) in enumerate(sizes):
        s.add(rid, [1] * n, SamplingParams(max_new_tokens=new), seed=rid)
    assert [r.rid for r in s.admit()] == [0]  # 1 needs 4 of the 3 pages left: it blocks 2, which would fit
    assert [r.state for r in s.running] == ["prefill"] and len(s.waiting) == 4
    s.finish(s.running[0], "abort")
    assert released and released[0].rid == 0 and kv.seq_ids == []
    assert [r.rid for r in s.admit()] == [1, 2, 3]  # max_batch 3 stops 4
    assert [r.rid for r in s.waiting] == [4]


def test_prefill_budget_goes_to_requests_in_admission_order():
    s = Scheduler(cache(pages=20))
    for rid, n in enumerate((30, 20, 5)):
        s.add(rid, list(range(n)), SamplingParams(max_new_tokens=2), seed=0)
    list(s.admit())
    assert run_prefill(s, 25) == [(0, 0, 25)]
    assert run_prefill(s, 25) == [(0, 25, 5), (1, 0, 20)]  # 0 completes, then 1 takes the rest
    assert [r.rid for r in s.decoding()] == [0, 1]
    assert run_prefill(s, 25) == [(2, 0, 5)]
    assert [r.launched for r in s.running] == [1, 1, 1]


def test_read_back_finishes_at_stop_or_length_and_drops_late_tokens():
    kv = cache(pages=8)
    s = Scheduler(kv)
    s.add(0, [5] * 3, SamplingParams(max_new_tokens=3), seed=0)
    s.add(1, [6] * 3, SamplingParams(max_new_tokens=10, stop_token_ids=(99,)), seed=0)
    list(s.admit())
    run_prefill(s, 16)
    a, b = s.running
    s.read_back([a, b], [11, 12])
    assert [(o.request_id, o.new_token_ids, o.finished) for o in s.report()] == [(0, [11], False), (1, [12], False)]
    s.launched([a, b])
    s.read_back([a, b], [21, 99])  # b stops at 99, which it keeps
    s.launched([a])
    s.read_back([a, b], [31, 77])  # b's late token (launched before its stop was read) is dropped
    outs = s.report()
    assert [(o.request_id, o.new_token_ids, o.token_ids, o.finish_reason) for o in outs] == [
        (1, [99], [12, 99], "stop"), (0, [21, 31], [11, 21, 31], "length")]
    assert s.report() == [] and not s.has_unfinished() and kv.seq_ids == [] and s.requests == {}


def test_abort_waiting_running_and_finished():
    kv = cache(pages=2)
    s = Scheduler(kv)
    for rid in range(3):
        s.add(rid, [1] * 16, SamplingParams(max_new_tokens=1), seed=0)  # 2 pages each: one admitted at a time
    assert [r.rid for r in s.admit()] == [0]
    assert s.abort(2) and s.abort(0)  # waiting, running
    assert not s.abort(0) and not s.abort(7)  # finished already, unknown
    outs = s.report()
    assert sorted((o.request_id, o.finish_reason, o.token_ids) for o in outs) == [(0, "abort", []), (2, "abort", [])]
    assert [r.rid for r in s.admit()] == [1] and kv.seq_ids == [s.running[0].seq_id]


@pytest.mark.parametrize("max_new", [1, 4])
def test_each_output_once_and_the_tokens_add_up(max_new):
    s = Scheduler(cache(pages=8))
    s.add(0, [3] * 20, SamplingParams(max_new_tokens=max_new), seed=0)
    list(s.admit())
    got = []
    for step in range(10):
        run_prefill(s, 8)
        got += s.report()
        reqs = s.decoding()
        s.launched(reqs)
        s.read_back([r for r in s.running if r.state == "decode"][:1], [100 + step])
    got += s.report()
    assert sum(o.finished for o in got) == 1 and got[-1].finished
    assert sum((o.new_token_ids for o in got), []) == got[-1].token_ids
    assert len(got[-1].token_ids) == max_new
