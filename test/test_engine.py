"""The continuous-batching engine against transformers' own greedy generate, one request at a time (the oracle), under
arrival orders, prefill chunk sizes and batch limits; admission within the cache's budget; stop tokens; aborts; bad
requests; sampling."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from torch_zipkv import compression_rounds  # noqa: E402
from torch_zipkv.engine import Engine, RequestOutput, SamplingParams  # noqa: E402
from torch_zipkv.engine.sampling import sample  # noqa: E402

from engine_reference import Reference  # noqa: E402
from hf_models import small_model  # noqa: E402

KV_BYTES = 16 << 20
ARCHS = {  # windows small enough to bite within these tests' lengths
    "llama": {},
    "gemma3": {"sliding_window": 16},  # sliding and full layers
    "gemma2": {"sliding_window": 16},  # logit soft cap (eager prefill attention), sliding layers
    "qwen3": {},  # q/k norm
    "mistral": {"sliding_window": 16},  # one window for every layer
}
_MODELS: dict = {}


def model_and_reference(arch: str):
    if arch not in _MODELS:
        model = small_model(arch, **ARCHS[arch])
        _MODELS[arch] = (model, Reference(model))
    return _MODELS[arch]


@pytest.fixture
def llama():
    return model_and_reference("llama")


def prompts_of(rng: random.Random, lengths) -> list[list[int]]:
    return [[rng.randrange(512) for _ in range(n)] for n in lengths]


def run_all(eng: Engine, arrivals: list[tuple[int, list[int], SamplingParams]],
            earlier: list[RequestOutput] = ()) -> dict[int, list[RequestOutput]]:
    """Add each prompt at its step (arrivals: (step, prompt, params)); step until all finish; every output by id.
    Checks the stream's invariants on the way: new tokens extend token_ids, one finished output per request, last.
    ``earlier``: outputs of steps the caller ran before."""
    outs: dict[int, list[RequestOutput]] = {}
    for out in earlier:
        outs.setdefault(out.request_id, []).append(out)
    ids, step = [], 0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            ids.append(eng.add_request(prompt, params))
        for out in eng.step():
            seen = outs.setdefault(out.request_id, [])
            assert not (seen and seen[-1].finished), f"request {out.request_id} reported after it finished"
            before = seen[-1].token_ids if seen else []
            assert out.token_ids == before + out.new_token_ids
            seen.append(out)
        step += 1
        assert step < 10_000
    for rid in ids:
        assert outs[rid][-1].finished and outs[rid][-1].finish_reason in ("stop", "length", "abort"), rid
    return outs


@pytest.mark.parametrize("arch, case", [("llama", 0), ("llama", 1), ("gemma3", 0), ("gemma3", 1), ("gemma2", 0),
                                        ("qwen3", 0), ("mistral", 0)])
def test_greedy_matches_generate(arch, case):
    """Prompts of random lengths (pages crossed, windows passed) arriving at random steps, with random prefill chunks
    and batch limits: every request's greedy tokens are transformers' own (its default cache, one request alone), up to
    bf16 ties."""
    model, ref = model_and_reference(arch)
    rng = random.Random(case)
    prompts = prompts_of(rng, [rng.randint(1, 40) for _ in range(5)])
    new = [rng.randint(1, 12) for _ in prompts]
    eng = Engine(model, max_kv_bytes=KV_BYTES, prefill_chunk=rng.choice([3, 16, 512]),
                 max_batch=rng.choice([None, 1, 2, 3]))
    arrivals = [(rng.randint(0, 8), p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, new)]
    outs = run_all(eng, arrivals)
    assert len(outs) == len(prompts)
    by_prompt = {tuple(o[-1].prompt_token_ids): o[-1] for o in outs.values()}
    for prompt, n in zip(prompts, new):
        final = by_prompt[tuple(prompt)]
        assert final.finish_reason == "length" and len(final.token_ids) == n
        ref.check(prompt, final.token_ids)
    stats = eng.stats()
    assert stats["running"] == stats["waiting"] == 0 and eng.kv.seq_ids == []
    assert 1 <= stats["largest_batch"] <= (eng.max_batch or len(prompts))


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_prefill_chunks_of_several_requests_run_in_one_forward(arch, monkeypatch):
    """The prompt chunks a step prefills, of several requests, run as one forward (their tokens one after another,
    each attending to its own request's pages only): requests of 40, 7, 25 and 3 tokens added at once, 32 prefill
    tokens a step, make steps of 1, 3 and 2 chunks, some ending their prompt and some not. The greedy tokens are
    transformers' own, one request alone (gemma2: soft cap and sliding windows)."""
    model, ref = model_and_reference(arch)
    prompts = prompts_of(random.Random(5), [40, 7, 25, 3])
    eng = Engine(model, max_kv_bytes=KV_BYTES, prefill_chunk=32)
    forwards = []
    prepare = eng.kv.prepare_prefill
    monkeypatch.setattr(eng.kv, "prepare_prefill", lambda seq_ids, q_lens: (forwards.append(list(q_lens)),
                                                                             prepare(seq_ids, q_lens))[1])
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=6))
    assert forwards == [[32], [8, 7, 17], [8, 3]]
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 6
        ref.check(prompt, out.token_ids)


def test_compressed_and_raw_give_the_same_tokens(llama):
    """compress=False keeps every page raw and is otherwise the same engine: the same tokens (the decode kernel reads
    both exactly), and the compressed engine's pages really compress."""
    model, _ = llama
    prompts = prompts_of(random.Random(5), [40, 33, 17])
    params = SamplingParams(max_new_tokens=10)
    a = Engine(model, max_kv_bytes=KV_BYTES, compress_every=1)
    got = [o.token_ids for o in a.generate(prompts, params)]
    b = Engine(model, max_kv_bytes=KV_BYTES, compress=False)
    raw = []
    for o in b.stream(prompts, params):
        if o.finished:
            raw.append(o)
        assert b.kv.stats()["stored_bytes"] == b.kv.stats()["raw_bytes"]
    assert got == [o.token_ids for o in sorted(raw, key=lambda o: o.request_id)]


def test_a_compression_backlog_is_taken_on_at_the_next_steps(llama, monkeypatch):
    """A compression call that leaves full pages waiting (more than two rounds' worth: here rounds of 2 pages) is
    followed by one at each next step until none wait, not left for the next scheduled call; the tokens are
    transformers'."""
    model, ref = llama
    eng = Engine(model, max_kv_bytes=KV_BYTES, prefill_chunk=512, compress_every=4)
    monkeypatch.setattr(compression_rounds, "ROUND_BYTES", 2 * eng.kv._store.page_bytes)
    prompt = prompts_of(random.Random(8), [200])[0]  # 12 full pages in each layer after its prefill
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=16))
    backlog, final = [], None
    while eng.has_unfinished():
        for out in eng.step():
            final = out if out.finished else final
        backlog.append(eng.kv.compression_backlog())
    full = 12 * eng.kv.num_layers  # a call starts 2 rounds of 2 pages: 4
    # steps 1-3 (prefill, decode): no call; step 4's call; steps 5-7: one each, for the backlog (page 13 fills later)
    assert backlog[:7] == [full] * 3 + [full - 4, full - 8, full - 12, full - 16], backlog
    assert min(backlog[7:]) == 0, backlog
    assert final.request_id == rid
    ref.check(prompt, final.token_ids)


def test_kv_source_matches_prefill(llama):
    """A request whose K/V comes from kv_source (here transformers' own prefill of prompt[:-1]) decodes the tokens
    of a request prefilled by the engine, up to bf16 ties."""
    from transformers import DynamicCache

    from torch_zipkv.integrations.transformers import cache_kwarg

    model, ref = llama
    prompt = prompts_of(random.Random(2), [37])[0]
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt[:-1]]), use_cache=True, **{cache_kwarg(model): cache})
    kv = [(layer.keys[0].transpose(0, 1).contiguous(), layer.values[0].transpose(0, 1).contiguous())
          for layer in cache.layers]
    eng = Engine(model, max_kv_bytes=KV_BYTES)
    calls = []

    def source(layer):
        calls.append(layer)
        return kv[layer]

    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=12), kv_source=source)
    outs = run_all(eng, [])
    final = outs[rid][-1]
    assert calls == [0, 1] and eng.stats()["prefilled_tokens"] == 0
    ref.check(prompt, final.token_ids)
    assert len(final.token_ids) == 12


@pytest.mark.parametrize("bad", ["wrong shape", "raises"])
def test_a_bad_kv_source_aborts_only_its_request(llama, bad):
    """A kv_source that returns a wrong tensor (ValueError) or raises (here OSError) fails the step that admits its
    request with that error: the request ends with reason "abort" (reported once, at a later step), its pages and
    budget come back, and the requests beside it finish with their own tokens."""
    model, ref = llama
    eng = Engine(model, max_kv_bytes=KV_BYTES)
    prompts = prompts_of(random.Random(5), [9, 12])
    free_pages = eng.kv.capacity().pages
    good = eng.add_request(prompts[0], SamplingParams(max_new_tokens=5))

    def source(layer):
        if bad == "raises":
            raise OSError("cannot read the K/V file")
        return torch.zeros(3, 1, 64, dtype=torch.bfloat16), torch.zeros(3, 1, 64, dtype=torch.bfloat16)

    broken = eng.add_request(prompts[1], SamplingParams(max_new_tokens=5), kv_source=source)
    error, match = (OSError, "cannot read") if bad == "raises" else (ValueError, "kv_source\\(0\\) must return bf16 k")
    with pytest.raises(error, match=match):
        eng.step()
    outs = run_all(eng, [])
    assert [o.finish_reason for o in outs[broken]] == ["abort"] and outs[broken][0].token_ids == []
    assert outs[good][-1].finish_reason == "length"
    ref.check(prompts[0], outs[good][-1].token_ids)
    assert not eng.has_unfinished() and eng.kv.seq_ids == []
    assert eng.kv.capacity().pages == free_pages  # nothing leaked


def test_generate_leaves_other_requests_outputs_for_step(llama):
    """Every output reaches the caller exactly once: a request added before generate() and finishing inside it is
    reported by the next step(), with all its tokens; generate() returns only its own prompts' outputs."""
    model, ref = llama
    eng = Engine(model, max_kv_bytes=KV_BYTES)
    a = eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=4))
    outs = eng.generate([[4, 5, 6]], SamplingParams(max_new_tokens=12))
    assert [o.request_id for o in outs] == [a + 1]
    later = []
    while eng.has_unfinished():
        later += eng.step()
    mine = [o for o in later if o.request_id == a]
    assert sum(o.finished for o in mine) == 1 and mine[-1].finish_reason == "length"
    assert sum((o.new_token_ids for o in mine), []) == mine[-1].token_ids and len(mine[-1].token_ids) == 4
    ref.check([1, 2, 3], mine[-1].token_ids)


def test_generate_takes_any_iterable_and_refuses_a_bad_prompt_before_queueing(llama):
    model, ref = llama
    eng = Engine(model, max_kv_bytes=KV_BYTES)
    prompts = prompts_of(random.Random(6), [5, 8])
    outs = eng.generate((p for p in prompts), SamplingParams(max_new_tokens=3))
    assert [len(o.token_ids) for o in outs] == [3, 3]
    for p, o in zip(prompts, outs):
        ref.check(p, o.token_ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.generate([[1, 2], [1, 9999]])
    assert not eng.has_unfinished()  # the good prompt beside the bad one was not queued either
    with pytest.raises(TypeError, match="wrap it in a list"):
        eng.generate([1, 2, 3])


def test_sampling_params_at_the_device_math_limits(llama):
    """Values that float32 sampling cannot take as given mean their limit: top_k beyond any int64 keeps every token
    (no overflow, the request runs), top_p that rounds to 0 in float32 and a subnormal temperature are greedy."""
    model, ref = llama
    eng = Engine(model, max_kv_bytes=KV_BYTES)
    prompt = prompts_of(random.Random(4), [11])[0]
    greedy = eng.generate([prompt], SamplingParams(max_new_tokens=6))[0].token_ids
    huge_k = eng.generate([prompt], SamplingParams(max_new_tokens=6, temperature=1.0, top_k=2 ** 63, seed=1))[0]
    all_k = eng.generate([prompt], SamplingParams(max_new_tokens=6, temperature=1.0, seed=1))[0]
    assert huge_k.token_ids == all_k.token_ids and huge_k.finish_reason == "length"
    assert not eng.has_unfinished() and eng.kv.seq_ids == []
    for params in (SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1e-46, seed=2),
                   SamplingParams(max_new_tokens=6, temperature=1e-39, seed=3),
                   SamplingParams(max_new_tokens=6, temperature=1e-300, seed=3)):
        assert eng.generate([prompt], params)[0].token_ids == greedy, params
    assert SamplingParams(temperature=1e-39).greedy and not SamplingParams(temperature=1e-37).greedy
    assert SamplingParams(temperature=1e300).temperature == torch.finfo(torch.float32).max
    ref.check(prompt, greedy)


def test_admission_within_budget_and_fcfs(llama):
    """A cache with room for about two requests' budgets: six requests are served a few at a time, admitted in arrival
    order (a big request at the head is not overtaken by later small ones that would fit), every running request's
    promise fits the cache all along, and the tokens are those of requests served alone."""
    model, ref = llama
    eng = Engine(model, max_kv_bytes=640 << 10, kv_chunk_bytes=64 << 10)
    pages = eng.kv.capacity().pages  # per layer, in the empty cache
    assert 20 <= pages <= 40
    rng = random.Random(7)
    new = 6
    big = (pages - 4) * 16 - new  # all but 4 pages of the cache
    prompts = prompts_of(rng, [big, 60, 20, 20, 5, 5])  # 5, 2, 2, 1, 1 pages: the last two would fit beside it
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=new)) for p in prompts]
    first_step, finish_step, step, order = {}, {}, 0, []
    while eng.has_unfinished():
        for out in eng.step():
            first_step.setdefault(out.request_id, step)
            if out.finished:
                order.append(out.request_id)
                finish_step[out.request_id] = step
                ref.check(prompts[ids.index(out.request_id)], out.token_ids)
        step += 1
        running = [r.rid for r in eng.scheduler.running]
        promised = sum(-(-(len(prompts[ids.index(i)]) + new) // 16) for i in running)
        assert promised <= pages, "running requests were promised more than the cache holds"
        s = eng.kv.stats()
        assert s["stored_bytes"] <= s["num_chunks"] * s["chunk_bytes"]
    assert [first_step[i] for i in ids] == sorted(first_step[i] for i in ids), "a later request overtook"
    assert min(first_step[i] for i in ids[1:]) > finish_step[ids[0]], "a request ran beside the one that filled it"
    assert sorted(order) == ids


def test_reclaim_moves_pages_while_requests_wait_and_changes_no_token(llama, monkeypatch):
    """Engine(reclaim=True) compacts after compression calls while requests wait (pages of running requests move
    between chunks): every request's tokens are the reclaim=False engine's and transformers' own, and compaction
    really moved pages."""
    model, ref = llama
    rng = random.Random(11)
    prefix = prompts_of(rng, [48])[0]
    prompts = [prefix + p for p in prompts_of(rng, [20 + 7 * i for i in range(10)])]
    params = SamplingParams(max_new_tokens=24)
    with pytest.raises(TypeError, match="reclaim must be a bool"):
        Engine(model, max_kv_bytes=KV_BYTES, reclaim=1)
    outs = {}
    for reclaim in (False, True):
        eng = Engine(model, max_kv_bytes=640 << 10, kv_chunk_bytes=16 << 10, compress_every=2, reclaim=reclaim)
        moved, compact = [], eng.kv.compact
        monkeypatch.setattr(eng.kv, "compact", lambda *a, **k: moved.append(compact(*a, **k)) or moved[-1])
        outs[reclaim] = [o.token_ids for o in eng.generate(prompts, params)]
        assert (sum(moved) > 0) == reclaim and eng.stats()["largest_batch"] < len(prompts)  # requests waited
    assert outs[True] == outs[False]
    for prompt, tokens in zip(prompts, outs[True]):
        ref.check(prompt, tokens)


def test_stop_token_finishes_and_drops_the_late_token(llama):
    """A stop token ends the request with reason "stop", the stop token last; the token the engine launched before it
    read the stop token back (one step late) is never reported."""
    model, ref = llama
    prompt = prompts_of(random.Random(3), [12])[0]
    tokens, _ = ref(prompt, 10)
    stop = tokens[4]
    cut = tokens.index(stop) + 1
    eng = Engine(model, max_kv_bytes=KV_BYTES)
    other = prompts_of(random.Random(4), [9])[0]
    outs = eng.generate([prompt, other], [SamplingParams(max_new_tokens=10, stop_token_ids=[stop]),
                                          SamplingParams(max_new_tokens=10)])
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] == stop
    ref.check(prompt, outs[0].token_ids)
    assert len(outs[0].token_ids) <= cut
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 10
    ref.check(other, outs[1].token_ids)


def test_abort_waiting_and_running(llama):
    """Aborting a waiting and a running request ends each with reason "abort" at the next step, frees its pages, and
    leaves the other requests' tokens as they would be alone."""
    model, ref = llama
    prompts = prompts_of(random.Random(8), [10, 30, 14])
    eng = Engine(model, max_kv_bytes=KV_BYTES, max_batch=2)
    a, b, c = (eng.add_request(p, SamplingParams(max_new_tokens=8)) for p in prompts)
    earlier = eng.step() + eng.step()
    assert eng.abort(b) is True  # running
    assert eng.abort(c) is True  # waiting (max_batch 2)
    assert eng.abort(c) is False  # already aborted
    outs = run_all(eng, [], earlier)
    assert outs[b][-1].finish_reason == outs[c][-1].finish_reason == "abort"
    assert outs[a][-1].finish_reason == "length"
    ref.check(prompts[0], outs[a][-1].token_ids)
    assert eng.kv.seq_ids == [] and eng.abort(a) is False
    with pytest.raises(KeyError, match="no request with id 99"):
        eng.abort(99)


def test_bad_requests_raise_and_the_engine_keeps_serving(llama):
    model, ref = llama
    eng = Engine(model, max_kv_bytes=KV_BYTES)
    good = eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=4))
    earlier = eng.step()
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        eng.add_request([])
    with pytest.raises(ValueError, match="max length 512"):
        eng.add_request([1] * 500, SamplingParams(max_new_tokens=13))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([1, 512])
    with pytest.raises(TypeError, match="prompt_ids must hold ints"):
        eng.add_request([1, 2.0])
    with pytest.raises(TypeError, match="needs the engine's tokenizer"):
        eng.add_request("hello")
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        eng.add_request([1], {"max_new_tokens": 3})
    with pytest.raises(TypeError, match="request_id must be an int"):
        eng.abort("0")
    small = Engine(model, max_kv_bytes=384 << 10, kv_chunk_bytes=64 << 10)  # 16 pages
    with pytest.raises(ValueError, match="more than the whole KV cache holds"):
        small.add_request([1] * 250, SamplingParams(max_new_tokens=10))
    outs = run_all(eng, [], earlier)
    assert outs[good][-1].finish_reason == "length"
    ref.check([1, 2, 3], outs[good][-1].token_ids)
    assert eng.stats()["running"] == 0


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=1.5), TypeError, "max_new_tokens must be an int"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature="hot"), TypeError, "temperature"),
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(seed=1.0), TypeError, "seed"),
    (dict(stop_token_ids=[1, "a"]), TypeError, "stop_token_ids"),
    (dict(stop_token_ids=5), TypeError, "stop_token_ids"),
])
def test_bad_sampling_params(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_engine_arguments_are_checked(llama):
    model, _ = llama
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        Engine(model, max_kv_bytes=KV_BYTES, prefill_chunk=0)
    with pytest.raises(TypeError, match="max_batch"):
        Engine(model, max_kv_bytes=KV_BYTES, max_batch=2.0)
    for name in ("max_batch", "prefill_chunk", "compress_every", "max_kv_bytes", "kv_chunk_bytes"):
        with pytest.raises(TypeError, match=f"{name} must be"):  # a bool is not an int
            Engine(model, **{"max_kv_bytes": KV_BYTES, name: True})
    with pytest.raises(ValueError, match="max_kv_bytes must be None or an int >= 1, got -1"):  # not the cache's name
        Engine(model, max_kv_bytes=-1)
    with pytest.raises(TypeError, match="compress must be a bool"):
        Engine(model, max_kv_bytes=KV_BYTES, compress=1)
    with pytest.raises(ValueError, match="bfloat16"):
        Engine(small_model("llama").float(), max_kv_bytes=KV_BYTES)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        Engine(torch.nn.Linear(2, 2), max_kv_bytes=KV_BYTES)


# ---- sampling ---------------------------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(llama):
    model, _ = llama
    prompts = prompts_of(random.Random(9), [7, 19])
    sampled = [SamplingParams(max_new_tokens=8, temperature=1.5, seed=s) for s in (1, 2)]
    runs = [[o.token_ids for o in Engine(model, max_kv_bytes=KV_BYTES).generate(prompts, sampled)] for _ in range(2)]
    assert runs[0] == runs[1]
    greedy = Engine(model, max_kv_bytes=KV_BYTES).generate(prompts, SamplingParams(max_new_tokens=8))
    top1 = Engine(model, max_kv_bytes=KV_BYTES).generate(
        prompts, SamplingParams(max_new_tokens=8, temperature=1.5, top_k=1, seed=3))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top1]
    assert runs[0] != [o.token_ids for o in greedy]  # temperature 1.5 on random weights: not the argmax path


def test_sampler_draws_from_the_softmax():
    """The device sampler (Gumbel-max over a counter-based hash) against the distribution it must draw from: 4,000
    draws of one row per seed, frequencies within 5 sigma of softmax(logits / T); top-k and top-p keep only their
    tokens; greedy rows take the argmax."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 4000
    rows = logits.expand(n, -1)
    ones = torch.ones(n)
    seeds = torch.arange(n, dtype=torch.long) * 7919 % (1 << 32)
    pos = torch.full((n,), 3, dtype=torch.long)

    def draw(temperature, top_k=0, top_p=1.0):
        return sample(rows, ones * temperature, torch.full((n,), top_k), ones * top_p, seeds, pos, any_sampled=True,
                      any_filtered=bool(top_k or top_p < 1))

    for t in (1.0, 0.7):
        p = torch.softmax(logits / t, -1)
        freq = torch.bincount(draw(t), minlength=6).double() / n
        sigma = (p * (1 - p) / n).sqrt()
        assert ((freq - p).abs() <= 5 * sigma + 1e-3).all(), (t, freq, p)
    assert set(draw(1.0, top_k=2).tolist()) == {0, 1}
    p = torch.softmax(logits, -1)  # top_p 0.8: the smallest prefix reaching 0.8 is tokens 0, 1, 2
    assert p[:2].sum() < 0.8 <= p[:3].sum()
    assert set(draw(1.0, top_p=0.8).tolist()) == {0, 1, 2}
    assert set(draw(0.0).tolist()) == {0}
    # the same (seed, position) draws the same token in any batch
    assert torch.equal(draw(1.0)[:10], sample(rows[:10], ones[:10], torch.zeros(10, dtype=torch.long), ones[:10],
                                              seeds[:10], pos[:10], any_sampled=True, any_filtered=False))


def test_smollm2_greedy_matches_generate():
    """SmolLM2 (real weights) with chunked prefill: the engine's greedy tokens are transformers' own, up to ties."""
    import copy

    from conftest import require_smollm2

    model, tok = require_smollm2().load_smollm2()
    model = copy.deepcopy(model)  # load_smollm2's model is shared: the engine switches its attention
    ref = Reference(model)
    prompts = [tok(p).input_ids for p in ("Photosynthesis is the process by which plants",
                                          "Here is a short story about a cat named Tom:",
                                          "import numpy as np\n\n# Compute the mean of a list")]
    eng = Engine(model, max_kv_bytes=256 << 20, prefill_chunk=6, compress_every=2)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=8))
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 8
        ref.check(prompt, out.token_ids)


def test_no_constant_is_written_to_a_tensor_by_indexing(llama, monkeypatch):
    """The cache and the engine never write a Python number into a tensor by indexing (``t[index] = 0``): on CUDA
    that copies the number from pageable memory and waits for the stream to drain, so a step would stall the host
    (``index_fill_`` and ``fill_`` take it as an argument). Checked on CPU over a load that admits, prefills, shares
    a prefix, compresses, samples and ends requests; the GPU test runs the same under torch's sync debug mode."""
    import pathlib
    import sys

    import torch_zipkv

    package = str(pathlib.Path(torch_zipkv.__file__).parent)
    writes, setitem = [], torch.Tensor.__setitem__

    def checked(self, index, value):
        if isinstance(value, (int, float, bool)) and sys._getframe(1).f_code.co_filename.startswith(package):
            frame = sys._getframe(1)
            writes.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")
        return setitem(self, index, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", checked)
    model, _ = llama
    eng = Engine(model, max_kv_bytes=KV_BYTES, prefill_chunk=16, compress_every=2)
    rng = random.Random(11)
    prefix = prompts_of(rng, [40])[0]
    prompts = [prefix + p for p in prompts_of(rng, [5, 17, 30, 9])] + prompts_of(rng, [25, 12])
    params = [SamplingParams(max_new_tokens=n, temperature=0.8 if n % 2 else 0.0, top_k=5) for n in (3, 9, 14, 6, 20,
                                                                                                     11)]
    freed, forget_ids = [], eng.kv._store.forget_ids
    monkeypatch.setattr(eng.kv._store, "forget_ids", lambda ids, zero: (freed.append(len(ids)), forget_ids(ids, zero)))
    finished = [o for o in eng.stream(prompts, params) if o.finished]
    assert len(finished) == len(prompts) and eng.stats()["prefix_hits"] > 0 and sum(freed) > 0
    assert writes == []
