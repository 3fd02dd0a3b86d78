"""HuggingFace transformers integration: ZipKVCache + "zipkv" attention against transformers' own default path
(DynamicCache + SDPA) as the oracle, on the real SmolLM2 and on small random-weight models of other architectures."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch_zipkv  # noqa: E402
from torch_zipkv.integrations.transformers import ZipKVCache, cache_kwarg  # noqa: E402  (registers "zipkv")

from conftest import require_smollm2, requires_cuda  # noqa: E402
from hf_models import padded_batch, small_model, teacher_forced_logits  # noqa: E402
import demo  # noqa: E402  (examples/demo.py: the yardstick it states, its bound and tie rule)
from demo import GAP_BOUND, bf16_step  # noqa: E402

PAGE = 16
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2():
    model, tok = require_smollm2().load_smollm2()
    tok.padding_side = "left"
    return model, tok


def assert_keeps_clear_choices(tokens, logits, ref_tokens, ref_logits, prompt_len: int) -> None:
    """A compiled run against the eager one: every choice that was clear eagerly (top-2 gap > 0.25) is the same, and
    the logits stay within 0.1 while the sequences agree (after a near-tie they may diverge and see other inputs)."""
    assert tokens.shape == ref_tokens.shape
    for t in range(ref_logits.shape[1]):
        top2 = ref_logits[:, t].float().topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.25
        if not torch.equal(tokens[clear, prompt_len + t], ref_tokens[clear, prompt_len + t]):
            raise AssertionError(f"step {t}: a clear choice changed")
        if not torch.equal(tokens[:, : prompt_len + t + 1], ref_tokens[:, : prompt_len + t + 1]):
            break
        assert (logits[:, t].float() - ref_logits[:, t].float()).abs().max() < 0.1, t


def zipkv_cache(model, batch, max_length, max_new_tokens):
    return ZipKVCache.from_model(model, batch_size=batch, max_length=max_length, max_new_tokens=max_new_tokens,
                                 page_size=PAGE)


# ---- SmolLM2 (real weights) -----------------------------------------------------------------------------------
PROMPTS = ["Photosynthesis is the process by which plants",
           "Here is a short story about a cat named Tom:",
           "import numpy as np\n\n# Compute the mean of a list of numbers, then print it to the screen\n"]


def test_smollm2_greedy_generate_matches_default(smollm2):
    """model.generate with ZipKVCache + "zipkv" gives transformers' default greedy tokens (64 new, batch of 3
    left-padded prompts, page 16: prompts and outputs cross pages, full pages compress mid-generation)."""
    assert_greedy_generate_matches_default(*smollm2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_smollm2_greedy_generate_matches_default_on_cuda(smollm2):
    """The same on the GPU: the fused CUDA decode kernel against transformers' CUDA SDPA."""
    model, tok = smollm2
    assert_greedy_generate_matches_default(copy.deepcopy(model).cuda(), tok)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_smollm2_real_kv_prefill_runs_where_the_shared_model_is(smollm2, tmp_path):
    """load_smollm2's model is cached and shared: real_kv's prefill must work when a caller has moved it to the GPU
    (the demo once did, and its real-KV part then failed on mixed devices), give a CPU tensor, and match the CPU
    prefill's K and V to bf16 rounding of a different kernel."""
    import smollm2 as realkv

    model, _ = smollm2
    cpu_kv = realkv.real_kv(64, page_size=16, cache_dir=tmp_path / "cpu")
    try:
        model.cuda()
        gpu_kv = realkv.real_kv(64, page_size=16, cache_dir=tmp_path / "gpu")
    finally:
        model.cpu()
    assert gpu_kv.device.type == "cpu" and gpu_kv.shape == cpu_kv.shape and gpu_kv.dtype == torch.bfloat16
    for layer in range(cpu_kv.shape[0]):  # another kernel's bf16 rounding, grown over the layers: ~1%
        ref = cpu_kv[layer].double()
        assert (gpu_kv[layer].double() - ref).norm() / ref.norm() < 0.05, layer


def assert_greedy_generate_matches_default(model, tok):
    """Greedy generation from the compressed cache against transformers' default path. The only allowed departure
    is at a bf16 tie: where the default path's two best logits are at most one bf16 step apart (the step at the
    second one: ties are frequent, logits near 20 have a 0.125 step, near 35 a 0.25 step), any other rounding of the
    same math can pick the other token, transformers' own eager attention included; from there on the texts differ
    and are not compared."""
    inp = tok(PROMPTS, return_tensors="pt", padding=True).to(model.device)
    L = inp.input_ids.shape[1]
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    model.set_attn_implementation("sdpa")
    ref = model.generate(**inp, **kw)
    cache = zipkv_cache(model, len(PROMPTS), L + NEW_TOKENS, NEW_TOKENS)
    torch_zipkv.enable(model)
    try:
        got = model.generate(**inp, **{cache_kwarg(model): cache}, **kw)
    finally:
        model.set_attn_implementation("sdpa")
    assert got.sequences.shape == ref.sequences.shape == (len(PROMPTS), L + NEW_TOKENS)
    ref_logits = torch.stack(ref.logits, 1).float()
    matched = 0
    for b in range(len(PROMPTS)):
        diff = (got.sequences[b, L:] != ref.sequences[b, L:]).nonzero()
        if len(diff):
            step = int(diff[0])
            top2 = ref_logits[b, step].topk(2).values
            assert top2[0] - top2[1] <= bf16_step(top2[1]), (
                f"prompt {b}: token {step} differs from the default path where its margin was "
                f"{float(top2[0] - top2[1])} at {float(top2[0])} (not a bf16 tie)")
        matched += int(diff[0]) if len(diff) else NEW_TOKENS
    assert matched >= NEW_TOKENS, "fewer than 64 tokens in all agreed before a tie"
    stats = cache.stats()
    assert stats["sequences"] == len(PROMPTS)
    # Every full page but those filled by the last step has been compressed, and compression saved bytes.
    tokens = int(inp.attention_mask.sum() + len(PROMPTS) * (NEW_TOKENS - 1))
    assert stats["tokens"] == model.config.num_hidden_layers * tokens
    assert stats["stored_bytes"] < 0.9 * stats["raw_bytes"]


def test_smollm2_teacher_forced_logits_match_default(smollm2):
    """Fed the default path's own greedy tokens for 64 steps, the "zipkv" path's logits stay within bf16
    tolerance of the default's at every step, and its argmax is the default's token except at bf16 ties. The
    tolerance is what transformers' eager attention itself departs from SDPA by, times 1.5 (demo.YARDSTICK)."""
    model, tok = smollm2
    inp = tok(PROMPTS, return_tensors="pt", padding=True)
    L = inp.input_ids.shape[1]
    model.set_attn_implementation("sdpa")
    seq = model.generate(**inp, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    forced = seq[:, L:-1]
    ref = teacher_forced_logits(model, "sdpa", inp.input_ids, inp.attention_mask, forced)
    assert torch.equal(ref.argmax(-1), seq[:, L:]), "the teacher-forced default path must reproduce generate()"
    eager = teacher_forced_logits(model, "eager", inp.input_ids, inp.attention_mask, forced)
    cache = zipkv_cache(model, len(PROMPTS), L + NEW_TOKENS, NEW_TOKENS)
    got = teacher_forced_logits(model, "zipkv", inp.input_ids, inp.attention_mask, forced, cache)
    model.set_attn_implementation("sdpa")
    tol = GAP_BOUND * float((eager - ref).abs().max())
    err = (got - ref).abs().amax(-1)  # [B, steps]
    assert float(err.max()) <= tol, f"zipkv logits off by {float(err.max())}, eager-vs-sdpa tolerance {tol}"
    assert float(err[:, 0].max()) == 0.0, "prefill runs transformers' own SDPA: its logits must be identical"
    top2 = ref.topk(2, -1).values
    tie = (top2[..., 0] - top2[..., 1]) <= bf16_step(top2[..., 1])
    agree = got.argmax(-1) == seq[:, L:]
    assert bool((agree | tie).all()), f"argmax departs outside ties at {(~(agree | tie)).nonzero().tolist()}"
    assert cache.stats()["stored_bytes"] < cache.stats()["raw_bytes"]


# ---- other architectures (small random-weight configs) --------------------------------------------------------
def reference_and_tolerance(model, ids, mask, forced):
    """transformers' default path (DynamicCache + SDPA) as the reference, and 1.5x its distance to transformers'
    eager attention as the tolerance (at least 4e-3). A model without SDPA (Gemma 2: softcapping) is referenced by
    its eager attention, and the tolerance is 1.5x how far that strays from the same model run in float32."""
    eager = teacher_forced_logits(model, "eager", ids, mask, forced)
    if model._supports_sdpa:
        ref = teacher_forced_logits(model, "sdpa", ids, mask, forced)
    else:
        ref, eager = eager, teacher_forced_logits(model.float(), "eager", ids, mask, forced)
        model.bfloat16()
    return ref, max(GAP_BOUND * float((eager - ref).abs().max()), 4e-3)


def assert_zipkv_logits_match(model, arch: str, gen, lengths, steps: int) -> ZipKVCache:
    """Prefill of a left-padded batch of prompts of ``lengths`` real tokens, then ``steps`` teacher-forced decode
    steps: the "zipkv" logits are within :func:`reference_and_tolerance`'s tolerance. Returns the cache."""
    ids, mask, forced = padded_batch(gen, lengths, steps)
    ref, tol = reference_and_tolerance(model, ids, mask, forced)
    cache = ZipKVCache.from_model(model, batch_size=len(lengths), max_length=max(lengths) + steps + 1,
                                  max_new_tokens=steps + 1, page_size=PAGE)
    got = teacher_forced_logits(model, "zipkv", ids, mask, forced, cache)
    err = float((got - ref).abs().max())
    assert err <= tol, f"{arch}: zipkv logits off by {err}, tolerance {tol}"
    return cache


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "mistral", "gemma3", "gemma2"])
def test_random_model_logits_match_default(arch, gen):
    """Prefill of a left-padded batch (24 and 15 real tokens) and 20 decode steps across page boundaries: the "zipkv"
    logits stay as close to DynamicCache + SDPA as transformers' eager attention is (x1.5), and full pages compress."""
    cache = assert_zipkv_logits_match(small_model(arch), arch, gen, [24, 15], 20)
    stats = cache.stats()
    assert stats["tokens"] == 2 * (24 + 15 + 2 * 20)  # 2 layers x (prompts + 20 steps of 2 sequences), no pads
    assert stats["stored_bytes"] < stats["raw_bytes"]
    for layer in range(2):
        k, v = cache.kv.gather(layer, cache.seq_ids[1])
        assert k.shape == v.shape == (15 + 20, 2, 64)


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "mistral"])
def test_sliding_window_past_the_window(arch, gen):
    """Sequences grow far past a 16-token window (prompts of 37 and 11 tokens, 30 steps): logits match the default
    path, which attends to the window only, and the sliding layers keep only the pages the window touches."""
    cache = assert_zipkv_logits_match(small_model(arch, sliding_window=16), arch, gen, [37, 11], 30)
    windows = cache.kv.sliding_window
    assert windows.count(16) >= 1 and set(windows) <= {16, None}
    cache.kv.compress_full_pages()
    for layer, w in enumerate(windows):
        pages = cache.stats()["layers"][layer]["pages"]
        if w is None:
            assert pages == -(-67 // PAGE) + -(-41 // PAGE)  # every page of 37 + 30 and 11 + 30 tokens
        else:  # the pages holding the last 16 tokens (a window's tokens span at most 2 pages)
            assert pages == sum(-(-n // PAGE) - (n - 16) // PAGE for n in (67, 41))
            assert cache.kv.kept_from(layer, cache.seq_ids[0]) == (67 - 16) // PAGE * PAGE


def test_one_token_prompts(gen):
    """A prompt of one token is a prefill too (the first call into an empty cache), not a decode step."""
    cache = assert_zipkv_logits_match(small_model("qwen3"), "qwen3", gen, [1, 1], 18)
    assert cache.stats()["tokens"] == 2 * 2 * (1 + 18)


@torch.no_grad()
def continued_logits(model, impl: str, ids, mask, forced, more, cache=None) -> torch.Tensor:
    """:func:`teacher_forced_logits`, then one more model call of ``more`` [B, M] tokens per row into the same cache
    (a conversation's next turn), then one decode step: the logits of every position of that call and of the step,
    float [B, T + 1 + M + 1, vocab]."""
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache(config=model.config)
    first = teacher_forced_logits(model, impl, ids, mask, forced, cache)
    kw = {cache_kwarg(model): cache}
    mask = torch.cat([mask, mask.new_ones(mask.shape[0], forced.shape[1])], 1)
    pos = (mask.long().cumsum(-1) - 1)[:, -1:]
    more_mask = torch.cat([mask, mask.new_ones(mask.shape[0], more.shape[1])], 1)
    more_pos = pos + 1 + torch.arange(more.shape[1], device=more.device)
    logits = [model(input_ids=more, attention_mask=more_mask, position_ids=more_pos, **kw).logits]
    step_mask = torch.cat([more_mask, more_mask.new_ones(mask.shape[0], 1)], 1)
    logits.append(model(input_ids=more[:, -1:], attention_mask=step_mask, position_ids=more_pos[:, -1:] + 1,
                        **kw).logits)
    return torch.cat([first, *logits], 1).float()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3"])
def test_prefill_into_a_non_empty_cache_continues(arch, device, gen):
    """A second multi-token call on the same cache (a conversation's next turn: 23 tokens after a left-padded prompt
    and 5 decode steps, with a 16-token window for the sliding layers, Gemma 2's soft cap) attends to the stored
    tokens from the pages in place (zipkv::paged_prefill): its logits, and the next decode step's, match
    transformers' default cache doing the same, within :func:`reference_and_tolerance`'s tolerance."""
    model = small_model(arch, **({} if arch == "qwen3" else {"sliding_window": 16})).to(device)
    ids, mask, forced = (t.to(device) for t in padded_batch(gen, [24, 15], 5))
    more = torch.randint(0, 512, (2, 23), generator=gen).to(device)
    _, tol = reference_and_tolerance(model, ids, mask, forced)
    impl = "sdpa" if model._supports_sdpa else "eager"
    ref = continued_logits(model, impl, ids, mask, forced, more)
    cache = ZipKVCache.from_model(model, batch_size=2, max_length=64, max_new_tokens=40, page_size=PAGE)
    got = continued_logits(model, "zipkv", ids, mask, forced, more, cache)
    err = float((got - ref).abs().max())
    assert err <= 2 * tol, f"{arch}: zipkv logits off by {err}, tolerance {2 * tol}"
    assert cache.stats()["tokens"] == 2 * (24 + 15 + 2 * (5 + 23 + 1))  # no pads stored, every new token
    assert int(cache.get_seq_length()) == 24 + 5 + 23 + 1


class FollowTokens(transformers.LogitsProcessor):
    """Makes generate take ``tokens`` [B, N], one column a step, whatever its own logits say."""

    def __init__(self, tokens):
        self.tokens, self.step = tokens, 0

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -float("inf")).scatter_(1, self.tokens[:, self.step:self.step + 1], 0.0)
        self.step += 1
        return forced


def test_smollm2_second_generate_continues_the_conversation(smollm2):
    """A second model.generate on the same ZipKVCache continues the conversation: the first turn's output and the
    next turn's text are prefilled into the cache that holds the first turn. Held to demo.YARDSTICK's logit bound
    at every step of both turns: transformers' default cache with SDPA, and with eager attention for the yardstick,
    made to follow the "zipkv" path's tokens through the same two generate calls, give the logits it is compared
    with. (Comparing free-running token streams instead fails on a choice whose margin, 1.5 bf16 steps, is smaller
    than eager's own departure from SDPA.)"""
    from transformers import DynamicCache

    model, tok = smollm2
    inp = tok(PROMPTS, return_tensors="pt", padding=True)
    L = inp.input_ids.shape[1]
    more = tok([" Tell me more, in simple words please."] * len(PROMPTS), return_tensors="pt").input_ids
    turns = [dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True,
                  return_dict_in_generate=True) for n in (8, 32)]

    def two_turns(cache, follow=None):
        """Both turns on ``cache``: (sequences [B, L + 8 + |more| + 32], logits [B, 40, vocab])."""
        out1 = model.generate(**inp, **{cache_kwarg(model): cache}, **turns[0],
                              **({"logits_processor": [FollowTokens(follow[:, L:])]} if follow is not None else {}))
        ids2 = torch.cat([out1.sequences, more], 1)
        mask2 = torch.cat([inp.attention_mask, torch.ones(len(PROMPTS), ids2.shape[1] - L, dtype=torch.long)], 1)
        out2 = model.generate(input_ids=ids2, attention_mask=mask2, **{cache_kwarg(model): cache}, **turns[1],
                              **({"logits_processor": [FollowTokens(follow[:, -32:])]} if follow is not None else {}))
        return out2.sequences, torch.stack(out1.logits + out2.logits, 1).float()

    cache = zipkv_cache(model, len(PROMPTS), L + 8 + more.shape[1] + 32, 8 + more.shape[1] + 32)
    torch_zipkv.enable(model)
    try:
        tokens, got = two_turns(cache)
    finally:
        model.set_attn_implementation("sdpa")
    assert tokens.shape == (len(PROMPTS), L + 8 + more.shape[1] + 32)
    ref_tokens, ref = two_turns(DynamicCache(config=model.config), follow=tokens)
    model.set_attn_implementation("eager")
    try:
        eager_tokens, eager = two_turns(DynamicCache(config=model.config), follow=tokens)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(ref_tokens, tokens) and torch.equal(eager_tokens, tokens), "the default path did not follow"
    tol = GAP_BOUND * float((eager - ref).abs().max())
    err = (got - ref).abs().amax(-1)  # [B, 40]
    assert float(err.max()) <= tol, f"zipkv logits off by {float(err.max())}, eager-vs-sdpa tolerance {tol}"
    assert float(err[:, 0].max()) == 0.0, "the first prefill runs transformers' own SDPA: its logits must be identical"
    real = int(inp.attention_mask.sum()) + len(PROMPTS) * (8 + more.shape[1] + 31)
    assert cache.stats()["tokens"] == model.config.num_hidden_layers * real


def test_a_batch_that_does_not_fit_leaves_the_cache_empty(gen):
    model = torch_zipkv.enable(small_model("qwen3"))
    ids, mask, _ = padded_batch(gen, [40, 40], 0)
    cache = ZipKVCache.from_model(model, batch_size=1, max_length=48, max_new_tokens=8)  # room for one sequence
    with pytest.raises(torch_zipkv.CacheFullError):
        model(input_ids=ids, attention_mask=mask, **{cache_kwarg(model): cache})
    assert cache.stats()["sequences"] == 0 and cache.get_seq_length() == 0
    logits = teacher_forced_logits(model, "zipkv", ids[:1], mask[:1], ids[:1, :3], cache)  # the cache still works
    assert logits.isfinite().all() and cache.stats()["sequences"] == 1


def test_compressing_every_few_steps_gives_the_same_bits(gen):
    """Pages read raw for a few more steps rebuild the same BF16 as compressed ones (lossless): compressing every
    step or every 3rd gives bit-identical logits, and by the end every full page is compressed either way."""
    model = small_model("qwen3")
    ids, mask, forced = padded_batch(gen, [24, 15], 20)
    runs = []
    for every in (1, 3):
        cache = ZipKVCache.from_model(model, batch_size=2, max_length=48, max_new_tokens=24, compress_every=every)
        runs.append(teacher_forced_logits(model, "zipkv", ids, mask, forced, cache))
        cache.kv.compress_full_pages()
        assert cache.stats()["stored_bytes"] < cache.stats()["raw_bytes"]
    assert torch.equal(runs[0], runs[1])
    with pytest.raises(ValueError, match="compress_every"):
        ZipKVCache.from_model(model, max_length=32, compress_every=0)


def test_cache_with_another_window_than_the_model_raises(gen):
    model = small_model("gemma3", sliding_window=16)
    ids, mask, forced = padded_batch(gen, [20], 2)
    kv = torch_zipkv.CompressedPagedKVCache(2, 2, 64, max_bytes=1 << 24, device="cpu")  # no window: frees nothing
    with pytest.raises(ValueError, match="sliding_window=16"):
        teacher_forced_logits(model, "zipkv", ids, mask, forced, ZipKVCache(kv))


def test_wrong_attention_implementation_raises(gen):
    model = small_model("qwen3")
    ids, mask, forced = padded_batch(gen, [20], 2)
    cache = ZipKVCache.from_model(model, max_length=32, page_size=PAGE)
    with pytest.raises(RuntimeError, match="attn_implementation='zipkv'"):
        teacher_forced_logits(model, "sdpa", ids, mask, forced, cache)


def test_zipkv_attention_on_the_default_cache_is_sdpa(gen):
    """"zipkv" attention handed transformers' own cache (no ZipKVCache) is SDPA: the decode steps of a left-padded
    batch keep the mask that skips the pads, so the logits are SDPA's, bit for bit."""
    model = small_model("qwen3")
    ids, mask, forced = padded_batch(gen, [24, 15], 8)
    want = teacher_forced_logits(model, "sdpa", ids, mask, forced)
    assert torch.equal(teacher_forced_logits(model, "zipkv", ids, mask, forced), want)


def test_bad_arguments_raise():
    model = small_model("qwen3")
    with pytest.raises(ValueError, match="max_bytes and max_length"):
        ZipKVCache.from_model(model)
    with pytest.raises(ValueError, match="batch_size"):
        ZipKVCache.from_model(model, batch_size=0, max_length=32)
    with pytest.raises(ValueError, match="max_new_tokens"):
        ZipKVCache.from_model(model, max_length=32, max_new_tokens=64)
    with pytest.raises(TypeError, match="kv must be"):
        ZipKVCache(object())
    with pytest.raises(TypeError, match="model must be"):
        torch_zipkv.enable(object())
    with pytest.raises(TypeError, match="^cache must be a ZipKVCache or None, got DynamicCache"):
        torch_zipkv.generate(torch_zipkv.enable(model), torch.zeros(1, 4, dtype=torch.long), max_new_tokens=2,
                             cache=transformers.DynamicCache(config=model.config))
    # A float32 model is refused up front (test_hf_models_supported.py); one converted after its cache was built is
    # still refused at its first forward, before anything is stored.
    cache = ZipKVCache.from_model(model, max_length=32, page_size=PAGE)
    model32 = model.float()
    with pytest.raises(ValueError, match="bfloat16"):
        teacher_forced_logits(model32, "zipkv", torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long),
                              torch.zeros(1, 0, dtype=torch.long), cache)
    assert cache.stats()["sequences"] == 0


def integer_calls(model, kv):
    """Every integer argument of the integration: name -> a call taking one value for it."""
    ids = torch.zeros(1, 4, dtype=torch.long)
    from_model = ZipKVCache.from_model

    def adopt_length(v):
        cache = ZipKVCache(kv)
        sid = kv.add_sequence(prompt_len=4)
        for layer in range(kv.num_layers):
            kv.append(layer, sid, *torch.zeros(2, 4, kv.num_kv_heads, kv.head_dim, dtype=torch.bfloat16))
        try:
            cache.adopt([sid], length=v)
        finally:
            kv.free_sequence(sid)

    return {
        "ZipKVCache max_new_tokens": lambda v: ZipKVCache(kv, max_new_tokens=v),
        "ZipKVCache compress_every": lambda v: ZipKVCache(kv, compress_every=v),
        "from_model batch_size": lambda v: from_model(model, batch_size=v, max_length=32),
        "from_model max_length": lambda v: from_model(model, max_length=v),
        "from_model max_new_tokens": lambda v: from_model(model, max_length=32, max_new_tokens=v),
        "from_model max_bytes": lambda v: from_model(model, max_bytes=v),
        "from_model page_size": lambda v: from_model(model, max_length=32, page_size=v),
        "from_model compress_every": lambda v: from_model(model, max_length=32, compress_every=v),
        "generate max_new_tokens": lambda v: torch_zipkv.generate(model, ids, max_new_tokens=v),
        "generate eos_token_id": lambda v: torch_zipkv.generate(model, ids, max_new_tokens=2, eos_token_id=v),
        "adopt length": adopt_length,
    }


INTEGER_ARGUMENTS = {  # the calls of integer_calls, and a value below each one's range
    "ZipKVCache max_new_tokens": -1, "ZipKVCache compress_every": 0, "from_model batch_size": 0,
    "from_model max_length": 0, "from_model max_new_tokens": -1, "from_model max_bytes": 0,
    "from_model page_size": 8, "from_model compress_every": 0, "generate max_new_tokens": 0,
    "generate eos_token_id": -1, "adopt length": 0}


@pytest.mark.parametrize("call", list(INTEGER_ARGUMENTS))
def test_integer_arguments_follow_the_library_rule(call):
    """torch_zipkv.checks: a bool where an int is meant is a TypeError (True used to pass for 1), so is a float; an int
    out of range is a ValueError; each names the argument. page_size's range is the format's (multiples of 16)."""
    model = torch_zipkv.enable(small_model("qwen3"))
    kv = torch_zipkv.CompressedPagedKVCache(2, 2, 64, max_bytes=1 << 24, device="cpu")
    fn, name = integer_calls(model, kv)[call], call.split()[-1]
    for bad in (True, False, 2.0):
        with pytest.raises(TypeError, match=f"^{name} must be .*int.*, got {type(bad).__name__} {bad!r}$"):
            fn(bad)
    low = INTEGER_ARGUMENTS[call]
    with pytest.raises(ValueError, match=f"^{name} must be .*, got {low}$"):
        fn(low)
    assert kv.seq_ids == []


def test_generate_loop_gives_model_generate_tokens_and_compiles(gen):
    """torch_zipkv.generate (host work between steps) gives model.generate's tokens with a ZipKVCache exactly;
    compiled (fullgraph), its logits stay close and its tokens agree wherever the eager choice is not near a tie."""
    model = torch_zipkv.enable(small_model("qwen2"))
    ids, mask, _ = padded_batch(gen, [21, 9], 0)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                         **{cache_kwarg(model): ZipKVCache.from_model(model, batch_size=2, max_length=64,
                                                                      max_new_tokens=30)})
    eager, logits = torch_zipkv.generate(model, ids, mask, max_new_tokens=30, return_logits=True)
    assert torch.equal(eager, ref)
    torch._dynamo.reset()
    compiled, clogits = torch_zipkv.generate(model, ids, mask, max_new_tokens=30, compile=True, return_logits=True)
    assert_keeps_clear_choices(compiled, clogits, eager, logits, ids.shape[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA Graphs need a GPU")
def test_generate_on_cuda_eager_and_cuda_graphs(gen):
    """On the GPU: the eager loop gives model.generate's tokens exactly, and the decode step captured as CUDA Graphs
    (mode="reduce-overhead", replayed across page boundaries and compressions: 40 steps, page 16) is really captured
    (no cudagraph skips) and keeps the eager logits and every clear choice."""
    from torch._dynamo.utils import counters

    model = torch_zipkv.enable(small_model("qwen2").cuda())
    ids, mask, _ = padded_batch(gen, [21, 9], 0)
    ids, mask = ids.cuda(), mask.cuda()
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                         **{cache_kwarg(model): ZipKVCache.from_model(model, batch_size=2, max_length=64,
                                                                      max_new_tokens=40)})
    eager, logits = torch_zipkv.generate(model, ids, mask, max_new_tokens=40, return_logits=True)
    assert torch.equal(eager, ref)
    torch._dynamo.reset()
    counters.clear()
    graphed, glogits = torch_zipkv.generate(model, ids, mask, max_new_tokens=40, compile="reduce-overhead",
                                            return_logits=True)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert counters["inductor"]["cudagraph_recorded_non_static_inputs"] > 0, "no CUDA Graph was recorded"
    assert_keeps_clear_choices(graphed, glogits, eager, logits, ids.shape[1])


def test_bf16_step_is_the_spacing_of_bf16():
    """The tie threshold (demo.bf16_step) is the distance from x to the next bf16 value away from 0 (bits + 1)."""
    x = (torch.randn(10_000) * torch.exp2(torch.randint(-20, 20, (10_000,)).float())).to(torch.bfloat16)
    x = x[x != 0]
    up = (x.abs().view(torch.int16) + 1).view(torch.bfloat16).float()
    assert torch.equal(bf16_step(x.float()), up - x.abs().float())


# ---- sequences prefilled outside the model: ZipKVCache.adopt ------------------------------------------------------
@torch.no_grad()
def prefill_elsewhere(model, ids, mask, kv, max_new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """The prompts prefilled by transformers' default path (DynamicCache + SDPA), their real tokens' K/V appended to
    ``kv`` directly: the prompt's last logits (float [B, vocab]) and the sequence ids, one per row."""
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    dynamic = DynamicCache(config=model.config)
    pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, **{cache_kwarg(model): dynamic}).logits
    seq_ids = []
    for row, n in enumerate(mask.sum(1).tolist()):
        seq_ids.append(kv.add_sequence(prompt_len=n, max_new_tokens=max_new_tokens))
        for layer, held in enumerate(dynamic.layers):  # keys [B, H, L, D], left-padded: the last n are real
            k, v = (t[row, :, -n:].transpose(0, 1).contiguous() for t in (held.keys, held.values))
            kv.append(layer, seq_ids[-1], k, v)
    return logits[:, -1].float(), seq_ids


@torch.no_grad()
def decode_steps(model, cache, mask, forced) -> torch.Tensor:
    """One "zipkv" decode step per column of ``forced`` after prompts with ``mask``: float [B, T, vocab]."""
    model.set_attn_implementation("zipkv")
    pos = (mask.long().cumsum(-1) - 1)[:, -1:]
    out = []
    for t in range(forced.shape[1]):
        pos = pos + 1
        out.append(model(input_ids=forced[:, t:t + 1], position_ids=pos, **{cache_kwarg(model): cache}).logits[:, -1])
    return torch.stack(out, 1).float()


@pytest.mark.parametrize("lengths, length, rows", [([24, 15], 24, [0, 1]), ([20, 20], None, [1, 0])])
def test_adopted_sequences_decode_as_if_prefilled_through_the_model(gen, lengths, length, rows):
    """Prompts prefilled elsewhere (DynamicCache + SDPA: the same K/V the "zipkv" prefill stores), appended to the
    paged cache and adopted as the batch rows ``rows`` of the prompts: 20 decode steps across page boundaries give
    the logits of those prompts prefilled through the model into a ZipKVCache, bit for bit (so the same greedy
    tokens), and the cache reads as that one does (positions, tokens, compressed pages). Left-padded prompts give
    the padded length; equal ones default it."""
    model = torch_zipkv.enable(small_model("qwen3"))
    ids, mask, forced = padded_batch(gen, lengths, 20)
    through = zipkv_cache(model, len(lengths), max(lengths) + 21, 21)
    want = teacher_forced_logits(model, "zipkv", ids, mask, forced, through)[rows]
    adopted = zipkv_cache(model, len(lengths), max(lengths) + 21, 21)
    first, seq_ids = prefill_elsewhere(model, ids, mask, adopted.kv, 21)
    adopted.adopt([seq_ids[r] for r in rows], length=length)
    assert adopted.seq_ids == [seq_ids[r] for r in rows] and int(adopted.get_seq_length()) == max(lengths)
    got = decode_steps(model, adopted, mask[rows], forced[rows])
    assert torch.equal(first[rows], want[:, 0]), "the default path's prefill logits are the zipkv prefill's (SDPA)"
    assert torch.equal(got, want[:, 1:])
    assert torch.equal(got.argmax(-1), want[:, 1:].argmax(-1))
    assert int(adopted.get_seq_length()) == int(through.get_seq_length()) == max(lengths) + 20
    for key in ("sequences", "tokens", "stored_bytes"):
        assert adopted.stats()[key] == through.stats()[key], key
    adopted.reset()
    assert adopted.kv.seq_ids == [], "reset frees the adopted sequences: the cache owns them"


def test_adopt_refuses_what_it_cannot_take(gen):
    model = torch_zipkv.enable(small_model("qwen3"))
    ids, mask, _ = padded_batch(gen, [12, 7], 0)
    cache = zipkv_cache(model, 3, 32, 8)
    kv = cache.kv
    _, (a, b) = prefill_elsewhere(model, ids, mask, kv, 8)
    with pytest.raises(ValueError, match=r"^length: the sequences hold different numbers of tokens \(\[12, 7\]\)"):
        cache.adopt([a, b])
    with pytest.raises(ValueError, match="^length must be at least each sequence's length, got 11 for a sequence "
                                         "of 12 tokens"):
        cache.adopt([a, b], length=11)
    with pytest.raises(ValueError, match=r"^seq_ids: 99 is not a running sequence of cache.kv"):
        cache.adopt([a, 99], length=12)
    with pytest.raises(ValueError, match=r"^seq_ids names a sequence more than once: \[0, 1, 0\]"):
        cache.adopt([a, b, a], length=12)
    with pytest.raises(ValueError, match="^seq_ids must name at least one sequence"):
        cache.adopt([])
    with pytest.raises(TypeError, match="^seq_ids must be a list of ints, got int 0"):
        cache.adopt(a)
    with pytest.raises(TypeError, match="^seq_ids must be a list of ints, got an entry bool True"):
        cache.adopt([True])
    half = kv.add_sequence(prompt_len=4)  # appended to layer 0 only: not a prefill
    kv.append(0, half, *torch.zeros(2, 4, kv.num_kv_heads, kv.head_dim, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=rf"^seq_ids: sequence {half} holds \[4, 0\] tokens in layers 0..1"):
        cache.adopt([half])
    assert cache.seq_ids is None and int(cache.get_seq_length()) == 0, "a refused adopt changes nothing"
    cache.adopt([a, b], length=12)
    with pytest.raises(RuntimeError, match="already holds a batch"):
        cache.adopt([half], length=12)
    assert cache.seq_ids == [a, b]
    prefilled = zipkv_cache(model, 2, 32, 8)  # a prefill through the model holds a batch too
    teacher_forced_logits(model, "zipkv", ids, mask, ids[:, :0], prefilled)
    sid = prefilled.kv.add_sequence(prompt_len=1)
    for layer in range(2):
        prefilled.kv.append(layer, sid, *torch.zeros(2, 1, kv.num_kv_heads, kv.head_dim, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="already holds a batch"):
        prefilled.adopt([sid])


def test_num_return_sequences_repeats_the_prompts_before_the_prefill(gen):
    """model.generate(num_return_sequences=2) repeats each prompt before the prefill, so a ZipKVCache sized for the
    repeated batch serves it: sampling from the top token only (top_k=1) gives greedy decoding of the repeated
    prompts, token for token, up to exact ties (transformers' top-k keeps every token equal to the k-th logit, so a
    tied row may sample the other one, seen with transformers 5.17; both runs compute the same logits)."""
    model = torch_zipkv.enable(small_model("qwen2"))
    ids, mask, _ = padded_batch(gen, [14, 9], 0)
    kw = dict(max_new_tokens=12, min_new_tokens=12)
    got = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=1, num_return_sequences=2, **kw,
                         **{cache_kwarg(model): zipkv_cache(model, 4, 14 + 12, 12)})
    want = model.generate(input_ids=ids.repeat_interleave(2, 0), attention_mask=mask.repeat_interleave(2, 0),
                          do_sample=False, output_logits=True, return_dict_in_generate=True, **kw,
                          **{cache_kwarg(model): zipkv_cache(model, 4, 14 + 12, 12)})
    assert got.shape == want.sequences.shape == (4, 14 + 12)
    logits = torch.stack(want.logits, 1)  # [4, 12, vocab]
    for row in range(4):
        diff = (got[row, 14:] != want.sequences[row, 14:]).nonzero()
        if len(diff):  # from the first difference on the rows run apart: it must be an exact tie
            step = int(diff[0])
            assert logits[row, step, got[row, 14 + step]] == logits[row, step].max(), (row, step)


def test_the_yardstick_is_stated_identically():
    """examples/demo.py prints its YARDSTICK, the bound test_smollm2_teacher_forced_logits_match_default checks
    (GAP_BOUND times eager's gap, ties by bf16_step); its docstring and docs/transformers.md state the same sentence
    (the demo once printed a ratio against a bound its docstring and the docs stated otherwise)."""
    import pathlib

    def words(text: str) -> str:
        return " ".join(text.replace("\n>", "\n").split())

    docs = pathlib.Path(__file__).resolve().parents[1] / "docs" / "transformers.md"
    assert GAP_BOUND == 1.5 and f"at most {GAP_BOUND}x eager's" in demo.YARDSTICK
    assert words(demo.YARDSTICK) in words(demo.__doc__)
    assert words(demo.YARDSTICK) in words(docs.read_text())
