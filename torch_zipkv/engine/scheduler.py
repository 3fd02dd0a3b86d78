"""The engine's scheduler: requests, the FCFS queue, admission against the KV cache's promises, what each step
prefills and decodes, finishing, and the outputs each step reports. Host only: no model, no device tensors, so it
can be driven and tested with a bare :class:`~torch_zipkv.CompressedPagedKVCache` (or anything with its
``add_sequence`` / ``free_sequence``, and ``match_prefix`` / ``cache_pages`` / ``seq_len`` / ``page_size`` with
prefix caching)."""

from __future__ import annotations

from collections import deque
from typing import Callable

from ..cache import CacheFullError
from ..page_pool import page_hashes
from .params import RequestOutput, SamplingParams


class Request:
    """One request's life: waiting -> prefill -> decode -> finished (a ``kv_source`` request skips prefill)."""

    __slots__ = ("rid", "prompt", "params", "seed", "kv_source", "seq_id", "slot", "state", "prefilled", "launched",
                 "tokens", "emitted", "reason", "stops", "keys", "cached", "salt")

    def __init__(self, rid: int, prompt: list[int], params: SamplingParams, seed: int, kv_source=None,
                 cache_salt: str | bytes | None = None):
        self.rid, self.prompt, self.params, self.seed, self.kv_source = rid, prompt, params, seed, kv_source
        self.salt = cache_salt or b""  # the prefix cache's namespace: requests find only pages of the same salt
        self.seq_id: int | None = None  # in the paged cache, once admitted
        self.slot: int | None = None  # row of the runner's device tables, once admitted
        self.state = "waiting"
        self.prefilled = 0  # prompt tokens in the cache
        self.launched = 0  # tokens whose sampling is queued on the device
        self.tokens: list[int] = []  # tokens read back
        self.emitted = 0  # tokens already reported
        self.reason: str | None = None
        self.stops = frozenset(params.stop_token_ids)
        self.keys: list[bytes] = []  # the chained keys of the prompt's full pages (prefix caching)
        self.cached = 0  # prompt tokens found in the prefix cache at admission: never prefilled

    @property
    def wants_decode(self) -> bool:
        return self.state == "decode" and self.launched < self.params.max_new_tokens


class Scheduler:
    """Requests and their progress over one paged cache ``kv``.

    Admission is FCFS with head-of-line blocking: a request is admitted when ``kv.add_sequence`` can promise its
    whole budget (prompt + ``max_new_tokens``), and nothing overtakes the head, so no request starves. ``max_batch``
    caps the requests admitted at once. ``release(request)`` gives back what the caller attached to an admitted
    request (the runner's table row) when it finishes or is aborted; the scheduler frees its pages.

    With ``prefix_caching``, admission starts a request from the longest run of its prompt's whole pages that the
    cache holds (``match_prefix``), and only the rest is prefilled; at least its last prompt token is, whose logits
    give the first token. Its budget then counts only its own pages (the prefix pages are held, not charged). The
    pages a request fills become findable as soon as they are full in every layer: prompt pages after each prefill
    chunk, generated ones when it ends. So with ``prefill_budget`` (the engine's ``prefill_chunk``) a request is
    admitted only while the running requests' prompt tokens still to prefill are fewer than that: admitted sooner it
    would wait for prefill all the same, and would have looked the cache up before the requests ahead of it cached
    the prefix it may share with them (a burst of requests over one system prompt would each prefill a copy). What
    is found depends only on token ids and on the cache's host state, which every tensor-parallel rank replays
    identically, so every rank finds the same pages. A ``kv_source`` request neither finds nor leaves pages: its
    K/V are not the model's.

    Outputs: :meth:`report` returns each request's new tokens once, and its finished output exactly once."""

    def __init__(self, kv, *, max_batch: int | None = None, release: Callable[[Request], None] = lambda r: None,
                 prefix_caching: bool = False, prefill_budget: int | None = None):
        self.kv, self.max_batch, self.release, self.prefix_caching = kv, max_batch, release, prefix_caching
        self.prefill_budget = prefill_budget
        self.prompt_tokens = 0  # of the requests admitted with prefix caching
        self.cached_tokens = 0  # of those, found in the cache
        self.hits = 0  # requests admitted with a prefix found
        self.requests: dict[int, Request] = {}  # every request not yet reported finished
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, in admission order (prefill or decode)
        self.finished: list[Request] = []  # finished, not yet reported

    # ---- requests ---------------------------------------------------------------------------------------------
    def add(self, rid: int, prompt: list[int], params: SamplingParams, seed: int, kv_source=None,
            cache_salt=None) -> Request:
        req = Request(rid, prompt, params, seed, kv_source, cache_salt)
        self.requests[rid] = req
        self.waiting.append(req)
        return req

    def abort(self, rid: int) -> bool:
        """Finish a waiting or running request with reason "abort"; False if it is unknown or finished already."""
        req = self.requests.get(rid)
        if req is None or req.state == "finished":
            return False
        if req.state == "waiting":
            self.waiting.remove(req)
            req.state, req.reason = "finished", "abort"
            self.finished.append(req)
        else:
            self.finish(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        """Some request is waiting, running, or finished but not yet reported."""
        return bool(self.waiting or self.running or self.finished)

    # ---- a step -----------------------------------------------------------------------------------------------
    def admit(self):
        """Admit waiting requests in order while their budgets fit; yields each one admitted (``seq_id`` set, state
        "prefill"), before the next is tried, so the caller can set it up. A caller that cannot set one up aborts it
        (:meth:`finish`) before it asks for the next."""
        budget = self.prefill_budget if self.prefix_caching else None
        to_prefill = self._to_prefill() if budget is not None else 0
        while self.waiting:
            if self.max_batch is not None and len(self.running) >= self.max_batch:
                return
            if budget is not None and to_prefill >= budget:
                return
            req = self.waiting[0]
            prefix = self._find_prefix(req)
            try:
                req.seq_id = self.kv.add_sequence(prompt_len=len(req.prompt), max_new_tokens=req.params.max_new_tokens,
                                                  **({"prefix": prefix} if self._caches(req) else {}))
            except CacheFullError:
                return
            self.waiting.popleft()
            self.running.append(req)
            req.state = "prefill"
            if self._caches(req):
                req.prefilled = req.cached = len(prefix) * self.kv.page_size
                self.prompt_tokens += len(req.prompt)
                self.cached_tokens += req.cached
                self.hits += bool(prefix)
            yield req
            if req.state == "prefill":  # (the caller has set up a kv_source request as decoding)
                to_prefill += len(req.prompt) - req.prefilled

    def _to_prefill(self) -> int:
        """Prompt tokens the running requests still have to prefill."""
        return sum(len(r.prompt) - r.prefilled for r in self.running if r.state == "prefill")

    def _caches(self, req: Request) -> bool:
        return self.prefix_caching and req.kv_source is None

    def _find_prefix(self, req: Request) -> list[int]:
        """The cached pages ``req`` starts from: the longest run of its prompt's whole pages but the last token's."""
        if not self._caches(req):
            return []
        if not req.keys:
            req.keys = page_hashes(req.prompt, self.kv.page_size, req.salt)
        return self.kv.match_prefix(req.keys[: (len(req.prompt) - 1) // self.kv.page_size])

    def _cache_pages(self, req: Request) -> None:
        """Make ``req``'s full pages findable: of the prompt and of the generated tokens fed back so far (every token
        the cache holds was read back before: it was sampled a step before it was fed)."""
        if self._caches(req) and req.seq_id is not None:
            held = (req.prompt + req.tokens)[: self.kv.seq_len(0, req.seq_id)]
            self.kv.cache_pages(req.seq_id, page_hashes(held, self.kv.page_size, req.salt, previous=req.keys))

    def decoding(self) -> list[Request]:
        """The running requests that decode one token this step."""
        return [r for r in self.running if r.wants_decode]

    def prefill_chunks(self, budget: int) -> list[tuple[Request, int, int]]:
        """``(request, start, n)``: the prompt tokens to prefill this step, at most ``budget`` over all requests, in
        admission order."""
        chunks = []
        for req in self.running:
            if budget == 0:
                break
            if req.state == "prefill":
                n = min(budget, len(req.prompt) - req.prefilled)
                chunks.append((req, req.prefilled, n))
                budget -= n
        return chunks

    def prefilled(self, req: Request, n: int) -> bool:
        """``n`` more prompt tokens of ``req`` are in the cache; True when that completes the prompt (the caller
        then launches its first token: see :meth:`launched`) and the request decodes from the next step."""
        req.prefilled += n
        self._cache_pages(req)
        if req.prefilled < len(req.prompt):
            return False
        req.state = "decode"
        return True

    def launched(self, reqs: list[Request]) -> None:
        """One more token of each of ``reqs`` is being sampled on the device."""
        for r in reqs:
            r.launched += 1

    def read_back(self, reqs: list[Request], tokens: list[int]) -> None:
        """The tokens sampled for ``reqs`` (one each), read back: record them, finish at a stop token or at
        ``max_new_tokens``. A request that finished meanwhile (stopped or aborted) drops its late token."""
        for req, tok in zip(reqs, tokens):
            if req.state == "finished":
                continue
            req.tokens.append(tok)
            if tok in req.stops:
                self.finish(req, "stop")
            elif len(req.tokens) == req.params.max_new_tokens:
                self.finish(req, "length")

    def finish(self, req: Request, reason: str) -> None:
        """Finish an admitted request: free its pages and what ``release`` gives back (the device work queued
        before that reads them runs first: one stream)."""
        if req.seq_id is not None:
            self._cache_pages(req)
            self.kv.free_sequence(req.seq_id)
            req.seq_id = None
        self.release(req)
        if req in self.running:
            self.running.remove(req)
        req.state, req.reason = "finished", reason
        self.finished.append(req)

    def report(self, tokenizer=None) -> list[RequestOutput]:
        """The outputs of running requests with new tokens, then of every request finished since the last report
        (each once; its text decoded once, when ``tokenizer`` is given)."""
        outs = [_output(r, None) for r in self.running if len(r.tokens) > r.emitted]
        for req in self.finished:
            outs.append(_output(req, tokenizer))
            del self.requests[req.rid]
        self.finished = []
        return outs


def _output(req: Request, tokenizer) -> RequestOutput:
    new = req.tokens[req.emitted:]
    req.emitted = len(req.tokens)
    finished = req.state == "finished"
    text = tokenizer.decode(req.tokens, skip_special_tokens=True) if finished and tokenizer is not None else None
    return RequestOutput(request_id=req.rid, prompt_token_ids=req.prompt, new_token_ids=new,
                         token_ids=list(req.tokens), finished=finished, finish_reason=req.reason, text=text)
