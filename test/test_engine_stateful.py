"""Random programs against the engine (hypothesis, stateful): add requests (good ones, with or without a stop token,
and bad ones the engine must refuse without a trace), step, abort (running, waiting, finished, unknown ids). After
every rule: the stream's invariants hold and the running requests' promises fit the cache. At the end the engine runs
dry: every request got exactly one final output with its reason, and greedy tokens are transformers' own (up to bf16
ties). Small caches and batch limits make requests queue. Derandomized: every run plays the same programs.

PrefixEngineMachine plays the same programs over prompts that share prefixes (prefix caching on, as by default), on
caches small enough that admissions evict cached pages: after every rule no page a running request holds is free or
evictable, the promises of the running requests' own pages fit, and at the end every request has its own tokens."""

from __future__ import annotations

import random

import pytest
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

pytest.importorskip("transformers")

from torch_zipkv.engine import Engine, SamplingParams  # noqa: E402

from engine_reference import Reference  # noqa: E402
from hf_models import small_model  # noqa: E402

_rng = random.Random(11)
PROMPTS = [[_rng.randrange(512) for _ in range(n)] for n in (1, 5, 16, 17, 40, 90)]
MAX_NEW = 8
_MODEL = {}
_SHARED = [_rng.randrange(512) for _ in range(48)]
SHARED_PROMPTS = [_SHARED[:17], _SHARED[:33] + [7], _SHARED[:40], _SHARED + [1, 2, 3], _SHARED[:16] + PROMPTS[4],
                  PROMPTS[5]]


def model_and_reference():
    if not _MODEL:
        model = small_model("llama")
        _MODEL["m"] = (model, Reference(model))
    return _MODEL["m"]


class EngineMachine(RuleBasedStateMachine):
    prompts = PROMPTS
    kv_chunk = 64 << 10

    @initialize(chunk=st.sampled_from([4, 16, 512]), max_batch=st.sampled_from([None, 1, 3]),
                kv=st.sampled_from([640 << 10, 4 << 20]))
    def start(self, chunk, max_batch, kv):
        self.model, self.ref = model_and_reference()
        self.eng = Engine(self.model, max_kv_bytes=kv, kv_chunk_bytes=self.kv_chunk, prefill_chunk=chunk,
                          max_batch=max_batch)
        self.pages = self.eng.kv.capacity().pages
        self.requests = {}  # id -> (prompt, params)
        self.outputs = {}  # id -> list of outputs
        self.aborted = set()  # ids abort() accepted

    def take(self, outs) -> None:
        for out in outs:
            seen = self.outputs.setdefault(out.request_id, [])
            assert out.request_id in self.requests
            assert not (seen and seen[-1].finished), f"request {out.request_id} reported after it finished"
            before = seen[-1].token_ids if seen else []
            assert out.token_ids == before + out.new_token_ids
            assert len(out.token_ids) <= self.requests[out.request_id][1].max_new_tokens
            seen.append(out)

    def finished(self, rid) -> bool:
        return bool(self.outputs.get(rid)) and self.outputs[rid][-1].finished

    @rule(prompt=st.sampled_from(range(len(PROMPTS))), new=st.integers(1, MAX_NEW),
          stop_at=st.none() | st.integers(0, 7))
    def add(self, prompt, new, stop_at):
        p = self.prompts[prompt]
        stops = ()
        if stop_at is not None:
            stops = (self.ref(p, MAX_NEW)[0][stop_at],)
        params = SamplingParams(max_new_tokens=new, stop_token_ids=stops)
        rid = self.eng.add_request(p, params)
        assert rid not in self.requests
        self.requests[rid] = (p, params)

    @rule(kind=st.sampled_from(["empty", "too long", "vocab", "never fits"]))
    def add_bad(self, kind):
        before = self.eng.stats()
        prompt, params = {"empty": ([], None), "too long": ([1] * 510, SamplingParams(max_new_tokens=5)),
                          "vocab": ([3, 600], None),
                          "never fits": ([1] * 400, SamplingParams(max_new_tokens=100))}[kind]
        if kind == "never fits" and (400 + 100 + 15) // 16 <= self.pages:
            return  # this cache holds it
        with pytest.raises(ValueError):
            self.eng.add_request(prompt, params)
        assert self.eng.stats() == before

    @rule()
    def step(self):
        self.take(self.eng.step())

    @rule(pick=st.integers(0, 50))
    def abort(self, pick):
        ids = sorted(self.requests)
        if not ids or pick >= 40:
            with pytest.raises(KeyError):
                self.eng.abort(10_000 + pick)
            return
        rid = ids[pick % len(ids)]
        done = self.finished(rid) or rid in self.aborted
        assert self.eng.abort(rid) is (not done)
        if not done:
            self.aborted.add(rid)

    @invariant()
    def promises_fit(self):
        if not hasattr(self, "eng"):
            return
        running = self.eng.scheduler.running
        assert self.eng.max_batch is None or len(running) <= self.eng.max_batch
        promised = sum(-(-(len(r.prompt) + r.params.max_new_tokens) // 16) - r.cached // 16 for r in running)
        assert promised <= self.pages
        assert len(self.eng.kv.seq_ids) == len(running)

    def teardown(self):
        if not hasattr(self, "eng"):
            return
        steps = 0
        while self.eng.has_unfinished():
            self.take(self.eng.step())
            steps += 1
            assert steps < 1000
        for rid, (prompt, params) in self.requests.items():
            final = self.outputs[rid][-1]
            assert final.finished, rid
            if rid in self.aborted:
                assert final.finish_reason == "abort"
            elif final.finish_reason == "stop":
                assert final.token_ids[-1] in params.stop_token_ids
            else:
                assert final.finish_reason == "length" and len(final.token_ids) == params.max_new_tokens
            assert sum(o.finished for o in self.outputs[rid]) == 1
            if final.token_ids:
                self.ref.check(prompt, final.token_ids)
        assert self.eng.kv.seq_ids == [] and self.eng.stats()["waiting"] == 0


EngineMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=16, deadline=None, derandomize=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking: each example runs a model; the failure
# prints its steps as they are
test_engine_programs = EngineMachine.TestCase


class PrefixEngineMachine(EngineMachine):
    prompts = SHARED_PROMPTS
    kv_chunk = 16 << 10  # 2 pages of a layer

    @initialize(chunk=st.sampled_from([4, 16, 512]), max_batch=st.sampled_from([None, 3]),
                kv=st.sampled_from([176 << 10, 640 << 10]))
    def start(self, chunk, max_batch, kv):
        """Then one request of the longest shared prompt runs to its end: its pages stay cached for the program."""
        super().start(chunk, max_batch, kv)
        self.add(3, MAX_NEW, None)
        while self.eng.has_unfinished():
            self.take(self.eng.step())

    @invariant()
    def held_pages_stay(self):
        if not hasattr(self, "eng"):
            return
        kv = self.eng.kv
        pool, arena = kv._pool, kv._arena
        for r in self.eng.scheduler.running:
            seq = kv._seq(r.seq_id)
            held = seq.pages[: seq.num_ids].tolist()
            assert not set(held) & (set(pool.free_ids) | set(pool.evictable)), f"request {r.rid}'s page was freed"
            full = -(-kv.seq_len(0, r.seq_id) // 16)
            assert (arena.offset[:, seq.pages[:full]] >= 0).all()
        assert arena.pool_need() <= len(arena.pool), "the pool can no longer keep the promises"
        cached = kv.stats()["cached_pages"]
        if self.eng.stats()["prefix_hits"]:
            event("a request started from cached pages")
        if cached < getattr(self, "cached", 0):
            event("cached pages were evicted")
        self.cached = cached


PrefixEngineMachine.TestCase.settings = settings(
    max_examples=8, stateful_step_count=16, deadline=None, derandomize=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate])
test_engine_programs_over_shared_prefixes = PrefixEngineMachine.TestCase
