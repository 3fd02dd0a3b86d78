"""The continuous-batching engine: admission against the cache's capacity, chunked prefill, decode steps (CUDA Graphs
on CUDA), sampling on the device and tokens read back one step late. docs/engine.md explains the design."""

from __future__ import annotations

import hashlib
import random
from collections import deque
from typing import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from ..cache import CacheFullError, CompressedPagedKVCache
from ..distributed import check_process_group, exchange, host_group, tp_group
from ..integrations.transformers import cache_kwarg, enable, kv_geometry
from ..upload import Uploader
from .attention import EngineCache
from .decode_graphs import DecodeGraphs
from ..checks import is_int as _is_int
from .params import RequestOutput, SamplingParams
from .sampling import sample, seed32

_CPU_DEFAULT_KV_BYTES = 256 << 20
_CUDA_DEFAULT_MEMORY_FRACTION = 0.7
_UNLIMITED_BATCH = 1024  # the largest bucket when max_batch is None


class _Request:
    __slots__ = ("rid", "prompt", "params", "kv_source", "seq_id", "slot", "state", "prefilled", "launched",
                 "tokens", "emitted", "reason", "stops")

    def __init__(self, rid: int, prompt: list[int], params: SamplingParams, kv_source):
        self.rid, self.prompt, self.params, self.kv_source = rid, prompt, params, kv_source
        self.seq_id: int | None = None  # in the paged cache, once admitted
        self.slot: int | None = None  # row of the engine's device tables, once admitted
        self.state = "waiting"  # waiting -> prefill -> decode -> finished
        self.prefilled = 0  # prompt tokens in the cache
        self.launched = 0  # tokens whose sampling is queued on the device
        self.tokens: list[int] = []  # tokens read back
        self.emitted = 0  # tokens already reported by step()
        self.reason: str | None = None
        self.stops = frozenset(params.stop_token_ids)

    @property
    def wants_decode(self) -> bool:
        return self.state == "decode" and self.launched < self.params.max_new_tokens


class Engine:
    """Continuous batching over a transformers causal LM whose KV cache lives in one
    :class:`~torch_zipkv.CompressedPagedKVCache`.

    ``model`` is switched to the "zipkv" attention in place (``torch_zipkv.enable``); it must be bfloat16.

    Under tensor parallelism (a model loaded with ``tp_plan="auto"`` under ``torchrun``) every rank builds an engine
    over its shard and runs the same steps: the cache holds the rank's KV heads and agrees on what fits with the other
    ranks, and each :meth:`step` first brings rank 0's :meth:`add_request` and :meth:`abort` calls to every rank
    (docs/engine.md, "Tensor parallelism").

    Args:
        max_kv_bytes / memory_fraction: the KV cache's budget (bytes, or a fraction of the free GPU memory after the
            weights). Neither: 70% of the free GPU memory on CUDA, 256 MiB on CPU.
        compress: compress full pages between steps. False keeps every page raw (the same engine otherwise).
        max_batch: most requests running at once (prefilling or decoding); None: as many as the cache admits.
        prefill_chunk: prompt tokens prefilled per step (over all requests), in chunks of at most this.
        cuda_graphs: replay decode steps as CUDA Graphs (default on CUDA; ignored on CPU).
        tokenizer: for str prompts and ``RequestOutput.text``.
        page_size: tokens per page (a multiple of 16).
        compress_every: steps between compression rounds.
        seed: seeds the draws of requests that give no seed.
        kv_chunk_bytes: the cache's arena chunk (default 4 MiB; smaller for tiny models and budgets).
    """

    def __init__(self, model, *, max_kv_bytes: int | None = None, memory_fraction: float | None = None,
                 compress: bool = True, max_batch: int | None = None, prefill_chunk: int = 512,
                 cuda_graphs: bool | None = None, tokenizer=None, page_size: int = 16, compress_every: int = 8,
                 seed: int = 0, kv_chunk_bytes: int | None = None):
        if not hasattr(model, "config") or not hasattr(model, "set_attn_implementation"):
            raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
        param = next(model.parameters())
        if param.dtype != torch.bfloat16:
            raise ValueError(f"model must be bfloat16 (the cache stores BF16 K/V), got {param.dtype}")
        for name, value, low in (("prefill_chunk", prefill_chunk, 1), ("compress_every", compress_every, 1)):
            if not _is_int(value):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if max_batch is not None:
            if not _is_int(max_batch):
                raise TypeError(f"max_batch must be None or an int, got {type(max_batch).__name__}")
            if max_batch < 1:
                raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not isinstance(compress, bool):
            raise TypeError(f"compress must be a bool, got {type(compress).__name__}")
        self.device = param.device
        on_cuda = self.device.type == "cuda"
        if cuda_graphs is None:
            cuda_graphs = on_cuda
        if max_kv_bytes is None and memory_fraction is None:
            if on_cuda:
                memory_fraction = _CUDA_DEFAULT_MEMORY_FRACTION
            else:
                max_kv_bytes = _CPU_DEFAULT_KV_BYTES

        self.model = enable(model)
        self.tokenizer = tokenizer
        self.compress, self.compress_every = compress, compress_every
        self.prefill_chunk = prefill_chunk
        self.max_batch = max_batch
        config = model.config.get_text_config()
        self.vocab_size = config.vocab_size
        self.max_model_len = getattr(config, "max_position_embeddings", None)
        num_layers, num_kv_heads, head_dim, windows = kv_geometry(model)  # this rank's KV heads under TP
        # Under tensor parallelism: the ranks' host-side group (gloo), for the cache's agreement on what fits and the
        # per-step exchange; host collectives never wait for the device. None for a model that is not sharded.
        tp = tp_group(model)
        self._group = None if tp is None else check_process_group(host_group(tp))
        self.rank = 0 if self._group is None else dist.get_rank(self._group)
        self.kv = CompressedPagedKVCache(num_layers, num_kv_heads, head_dim, page_size=page_size,
                                         max_bytes=max_kv_bytes, memory_fraction=memory_fraction,
                                         device=self.device, sliding_window=windows, process_group=self._group,
                                         **({} if kv_chunk_bytes is None else {"chunk_bytes": kv_chunk_bytes}))
        self.max_kv_bytes = self.kv.data.numel() + self.kv.stats()["meta_bytes"]  # what the cache holds, all told
        self.hf_cache = EngineCache(self.kv)
        self._cache_kw = cache_kwarg(model)
        self._upload = Uploader(self.device)

        self._graphs = None
        if cuda_graphs and on_cuda:
            # A one-token sequence whose page takes the padded rows' writes (slots 1..): never full, never compressed.
            self._pad_seq = self.kv.add_sequence(prompt_len=1)
            zero = torch.zeros(1, num_kv_heads, head_dim, dtype=torch.bfloat16, device=self.device)
            for layer in range(self.kv.num_layers):
                self.kv.append(layer, self._pad_seq, zero, zero)
            pad_page = int(self.kv.page_table(0, [self._pad_seq])[1][0])
            self._graphs = DecodeGraphs(self._decode_forward, max_batch=max_batch or _UNLIMITED_BATCH,
                                        pad_page=pad_page, page_size=page_size, device=self.device)
        self._empty_pages = self.kv.capacity().pages  # what one request may be promised in an empty cache

        # Per-request device tables, indexed by the request's slot (row).
        self._seed_of: dict[int, int] = {}  # seeds of waiting requests, until they get a row
        self._rows = 0
        self._free_slots: list[int] = []
        self._grow_tables(64)

        self._rng = random.Random(seed)
        self._next_id = 0  # ids are issued in order: 0 .. _next_id - 1
        self._requests: dict[int, _Request] = {}  # every request not yet reported finished
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # admitted, in admission order (prefill or decode)
        self._finished_out: list[_Request] = []  # finished (abort) but not yet reported
        self._in_flight = None  # (requests, host tokens, event) of the last step: read back at the next
        self._host_bufs = [None, None]
        self._steps = 0
        self._largest_batch = 0
        self._generated = 0
        self._prefilled = 0
        # Tensor parallelism: this rank's add_request / abort calls since the last step, and a digest of its state
        # after the last step (_sync_ranks).
        self._log: list[tuple] = []
        self._state_digest = b""

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams | None = None, *,
                    kv_source: Callable | None = None) -> int:
        """Queue a request; returns its id. ``prompt_ids``: a list of ints or a 1-D integer tensor (a str needs the
        engine's tokenizer). ``kv_source`` (benchmarks): ``kv_source(layer) -> (k, v)``, each bf16
        [len(prompt_ids) - 1, num_kv_heads, head_dim] on the cache's device, appended instead of running the prompt
        through the model; the first decode step then feeds ``prompt_ids[-1]``."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if kv_source is not None and not callable(kv_source):
            raise TypeError(f"kv_source must be callable (layer -> (k, v)), got {type(kv_source).__name__}")
        prompt = self._prompt_list(prompt_ids)
        total = len(prompt) + params.max_new_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise ValueError(f"prompt_ids ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                             f"exceeds the model's max length {self.max_model_len}")
        pages = -(-total // self.kv.page_size)
        if pages > self._empty_pages:
            raise ValueError(f"prompt_ids ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) needs "
                             f"{pages} pages per layer, more than the whole KV cache holds ({self._empty_pages}); "
                             "raise max_kv_bytes / memory_fraction or shorten the request")
        if params.seed is None:
            params_seed = self._rng.getrandbits(32)
        else:
            params_seed = seed32(params.seed)
        rid = self._next_id
        self._enqueue(rid, prompt, params, params_seed, kv_source)
        if self._group is not None:
            self._log.append(("add", rid, tuple(prompt), params, params_seed, kv_source is not None))
        return rid

    def _enqueue(self, rid: int, prompt: list[int], params: SamplingParams, seed: int, kv_source) -> None:
        req = _Request(rid, prompt, params, kv_source)
        self._next_id = rid + 1
        self._seed_of[rid] = seed
        self._requests[rid] = req
        self._waiting.append(req)

    def abort(self, request_id: int) -> bool:
        """Stop a request (waiting or running). Its last :class:`RequestOutput` (finish reason "abort") comes with
        the next :meth:`step`. Returns False if it had already finished; KeyError for an id never issued."""
        if not _is_int(request_id):
            raise TypeError(f"request_id must be an int, got {type(request_id).__name__}")
        if not 0 <= request_id < self._next_id:
            raise KeyError(f"no request with id {request_id}")
        if self._group is not None:
            self._log.append(("abort", int(request_id)))
        return self._abort(request_id)

    def _abort(self, request_id: int) -> bool:
        req = self._requests.get(request_id)
        if req is None or req.state == "finished":
            return False
        if req.state == "waiting":
            self._waiting.remove(req)
            self._seed_of.pop(req.rid, None)
        else:
            self._release(req)
        req.state, req.reason = "finished", "abort"
        self._finished_out.append(req)
        return True

    def has_unfinished(self) -> bool:
        """Whether some request is waiting, running, or has outputs that :meth:`step` has not reported yet."""
        return bool(self._waiting or self._running or self._finished_out or self._in_flight)

    # ---- the step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """One engine step: admit what fits, run one decode step for the running batch and up to ``prefill_chunk``
        prompt tokens of the requests being prefilled, and report the tokens of the step before (read back one step
        late, so the host plans this step while the device runs the last). Under tensor parallelism a collective: every
        rank calls it."""
        if self._group is not None:
            self._sync_ranks()
        self._steps += 1
        if self.compress and self._steps % self.compress_every == 0:
            self.kv.compress_full_pages(wait=False)
        self._admit()
        launched: list[tuple[list[_Request], torch.Tensor]] = []  # (rows, their sampled tokens on the device)
        decoding = [r for r in self._running if r.wants_decode]
        if decoding:
            launched.append((decoding, self._decode(decoding)))
            self._largest_batch = max(self._largest_batch, len(decoding))
        launched += self._prefill()
        previous = self._in_flight
        self._in_flight = self._launch_readback(launched)
        if previous is not None:
            self._read_back(previous)
        outs = self._report()
        if self._group is not None:
            self._state_digest = self._state_of(outs)
        return outs

    # ---- tensor parallelism -----------------------------------------------------------------------------------
    @property
    def process_group(self):
        """The ranks' host (gloo) group under tensor parallelism, else None."""
        return self._group

    def _sync_ranks(self) -> None:
        """Bring rank 0's add_request / abort calls since the last step to every rank, and check that the ranks
        agree. One host collective (gloo) per step, no device sync.

        Rank 0 sends its calls; every other rank sends a digest of its own calls: a rank that made none replays
        rank 0's (a rank that only steps: aborts from rank 0, requests arriving at rank 0), one that made them must
        have made the same. Every rank also sends a digest of its state after the last step (requests admitted,
        their progress, the tokens reported). Everything else is identical by construction (admission through the
        cache's agreed capacity, sampling on the same logits with the same seeds), so a difference is a bug; every
        rank raises the same error rather than one rank leaving the others waiting in a collective."""
        log, self._log = self._log, []
        mine = log if self.rank == 0 else (_digest(log) if log else None)
        got = exchange((self._state_digest, mine), self._group)
        events = got[0][1]
        diverged = [r for r, (state, _) in enumerate(got) if state != got[0][0]]
        if diverged:
            raise RuntimeError(f"tensor-parallel ranks {diverged} disagree with rank 0 on the engine's state after step "
                               f"{self._steps} (requests admitted, tokens sampled); the ranks must run the same model "
                               "and engine arguments, with every rank calling step()")
        want = _digest(events)
        differ = [r for r, (_, calls) in enumerate(got[1:], 1) if calls is not None and calls != want]
        if differ:
            raise RuntimeError(f"ranks {differ} called add_request / abort differently from rank 0 before step "
                               f"{self._steps + 1}: under tensor parallelism a rank other than 0 makes the same calls "
                               "as rank 0 or none (it then follows rank 0's)")
        followers = [r for r, (_, calls) in enumerate(got[1:], 1) if calls is None]
        injected = [e[1] for e in events if e[0] == "add" and e[5]]
        if followers and injected:
            raise RuntimeError(f"requests {injected} were added on rank 0 with a kv_source, which ranks {followers} "
                               "cannot replay: each rank must add such a request with its own kv_source")
        if self.rank != 0 and not log:
            for e in events:
                if e[0] == "add":
                    if e[3].seed is None:  # draw as rank 0 did, so that later same calls draw the same seeds
                        self._rng.getrandbits(32)
                    self._enqueue(e[1], list(e[2]), e[3], e[4], None)
                else:
                    self._abort(e[1])

    def _state_of(self, outs: list[RequestOutput]) -> bytes:
        """What every rank must agree on after a step: the requests waiting and running with their progress, and
        the tokens this step reported."""
        running = tuple((r.rid, r.state, r.prefilled, r.launched, len(r.tokens)) for r in self._running)
        reported = tuple((o.request_id, tuple(o.new_token_ids), o.finish_reason) for o in outs)
        return _digest((self._steps, self._next_id, tuple(r.rid for r in self._waiting), running, reported))

    # ---- admission ----------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        # FCFS, head of line: a request waits until the one before it is admitted, so none starves.
        while self._waiting:
            if self.max_batch is not None and len(self._running) >= self.max_batch:
                return
            req = self._waiting[0]
            try:
                req.seq_id = self.kv.add_sequence(prompt_len=len(req.prompt),
                                                  max_new_tokens=req.params.max_new_tokens)
            except CacheFullError:
                return
            self._waiting.popleft()
            self._take_slot(req)
            self._running.append(req)
            if req.kv_source is not None:
                self._inject(req)
            else:
                req.state = "prefill"

    def _inject(self, req: _Request) -> None:
        n = len(req.prompt) - 1
        want = (n, self.kv.num_kv_heads, self.kv.head_dim)
        for layer in range(self.kv.num_layers):
            k, v = req.kv_source(layer)
            for name, t in (("k", k), ("v", v)):
                if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or tuple(t.shape) != want \
                        or t.device != self.device:
                    self._release(req)
                    self._running.remove(req)
                    req.state, req.reason = "finished", "abort"
                    self._finished_out.append(req)
                    raise ValueError(f"kv_source({layer}) must return bf16 {name} of shape {list(want)} on "
                                     f"{self.device}, got {getattr(t, 'dtype', type(t).__name__)} "
                                     f"{tuple(getattr(t, 'shape', ()))} on {getattr(t, 'device', None)}; "
                                     f"request {req.rid} is aborted")
            if n:
                self.kv.append(layer, req.seq_id, k, v)
        req.prefilled = len(req.prompt)
        self._set_row(req, next_token=req.prompt[-1], position=n)
        req.state = "decode"

    # ---- prefill ----------------------------------------------------------------------------------------------
    def _prefill(self) -> list:
        budget, launched = self.prefill_chunk, []
        for req in list(self._running):
            if budget == 0:
                break
            if req.state != "prefill":
                continue
            start = req.prefilled
            n = min(budget, len(req.prompt) - start)
            budget -= n
            ids, = self._upload(np.asarray(req.prompt[start: start + n], dtype=np.int64))
            pos = torch.arange(start, start + n, device=self.device)[None]
            self.hf_cache.for_prefill(req.seq_id, start)
            logits = self.model(input_ids=ids[None], position_ids=pos, use_cache=True, logits_to_keep=1,
                                **{self._cache_kw: self.hf_cache}).logits[:, -1]
            req.prefilled += n
            self._prefilled += n
            if req.prefilled == len(req.prompt):
                slot = torch.full((1,), req.slot, dtype=torch.long, device=self.device)
                self._pos[req.slot] = len(req.prompt) - 1
                launched.append(([req], self._sample_and_store(logits, slot, [req])))
                req.state = "decode"
        return launched

    # ---- decode -----------------------------------------------------------------------------------------------
    def _decode(self, batch: list[_Request]) -> torch.Tensor:
        step = self.kv.prepare_step([r.seq_id for r in batch])
        slots, = self._upload(np.fromiter((r.slot for r in batch), dtype=np.int64, count=len(batch)))
        ids, pos = self._next[slots], self._pos[slots]
        if self._graphs is not None:
            logits = self._graphs.run(ids, pos, step)
        else:
            if step.stale:  # (cannot happen: nothing changes the cache between prepare_step and here)
                raise RuntimeError("decode step prepared before a change of the cache")
            logits = self._decode_forward(ids[:, None], pos[:, None], (step.page_ids, step.slots, step.kv_indptr,
                                                                       step.kv_indices, step.kv_last_page_len))
        return self._sample_and_store(logits, slots, batch)

    def _decode_forward(self, ids: torch.Tensor, pos: torch.Tensor, tables: tuple) -> torch.Tensor:
        self.hf_cache.for_decode(tables)
        return self.model(input_ids=ids, position_ids=pos, use_cache=True,
                          **{self._cache_kw: self.hf_cache}).logits[:, -1]

    def _sample_and_store(self, logits: torch.Tensor, slots: torch.Tensor, batch: list[_Request]) -> torch.Tensor:
        """Sample the next token of each row; store it (the next input) and advance the position, on the device."""
        pos = self._pos[slots] + 1  # the sampled token's position
        sampled = [r for r in batch if not r.params.greedy]
        if sampled:
            tokens = sample(logits, self._temp[slots], self._top_k[slots], self._top_p[slots], self._seed[slots], pos,
                            any_sampled=True, any_filtered=any(r.params.top_k > 0 or r.params.top_p < 1
                                                               for r in sampled))
        else:  # an all-greedy batch gathers no sampling parameters
            tokens = logits.argmax(-1)
        self._next[slots] = tokens
        self._pos[slots] = pos
        for r in batch:
            r.launched += 1
        return tokens

    # ---- read back ----------------------------------------------------------------------------------------------
    def _launch_readback(self, launched: list):
        if not launched:
            return None
        reqs = [r for batch, _ in launched for r in batch]
        tokens = launched[0][1] if len(launched) == 1 else torch.cat([t for _, t in launched])
        if self.device.type != "cuda":
            return reqs, tokens, None
        buf = self._host_bufs[self._steps % 2]
        if buf is None or buf.numel() < tokens.numel():
            buf = self._host_bufs[self._steps % 2] = torch.empty(max(256, 2 * tokens.numel()), dtype=torch.long,
                                                                 pin_memory=True)
        host = buf[: tokens.numel()]
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return reqs, host, event

    def _read_back(self, in_flight) -> None:
        reqs, host, event = in_flight
        if event is not None:
            event.synchronize()  # the step's one wait: for the step before, while the device runs this one
        for req, tok in zip(reqs, host.tolist()):
            if req.state == "finished":  # stopped or aborted meanwhile: a token launched one step late, dropped
                continue
            req.tokens.append(tok)
            self._generated += 1
            if tok in req.stops:
                self._finish(req, "stop")
            elif len(req.tokens) == req.params.max_new_tokens:
                self._finish(req, "length")

    def _finish(self, req: _Request, reason: str) -> None:
        self._release(req)
        req.state, req.reason = "finished", reason
        self._finished_out.append(req)

    def _report(self) -> list[RequestOutput]:
        outs = [self._output(r) for r in self._running if len(r.tokens) > r.emitted]
        for req in self._finished_out:  # released, so no longer running
            outs.append(self._output(req))
            self._requests.pop(req.rid, None)
        self._finished_out = []
        return outs

    def _output(self, req: _Request) -> RequestOutput:
        new = req.tokens[req.emitted:]
        req.emitted = len(req.tokens)
        text = None
        if self.tokenizer is not None and req.state == "finished":  # once: decoding every step would cost O(n^2)
            text = self.tokenizer.decode(req.tokens, skip_special_tokens=True)
        return RequestOutput(request_id=req.rid, prompt_token_ids=req.prompt, new_token_ids=new,
                             token_ids=list(req.tokens), finished=req.state == "finished",
                             finish_reason=req.reason, text=text)

    # ---- whole batches ------------------------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` (a list of token-id lists, 1-D tensors or str) to the end; returns one finished
        :class:`RequestOutput` per prompt, in order. ``params``: one for all, or one per prompt."""
        final = {}
        ids = self._add_all(prompts, params)
        for out in self._outputs_of(ids):
            if out.finished:
                final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Like :meth:`generate`, yielding each :class:`RequestOutput` as soon as a step reports it."""
        yield from self._outputs_of(self._add_all(prompts, params))

    def _add_all(self, prompts, params) -> list[int]:
        if isinstance(prompts, (str, torch.Tensor)) or (prompts and _is_int(prompts[0])):
            raise TypeError("prompts must be a list of prompts (token-id lists, 1-D tensors or str)")
        prompts = list(prompts)
        per = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"params has {len(per)} entries for {len(prompts)} prompts")
        return [self.add_request(p, sp) for p, sp in zip(prompts, per)]

    def _outputs_of(self, ids: list[int]) -> Iterator[RequestOutput]:
        pending = set(ids)
        while pending:
            if not self.has_unfinished():
                raise RuntimeError(f"requests {sorted(pending)} were lost")  # a bug, never a silent hang
            for out in self.step():
                if out.request_id in pending:
                    yield out
                    if out.finished:
                        pending.discard(out.request_id)

    # ---- stats ------------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """``running`` (requests admitted: ``prefilling`` + ``decoding``), ``waiting`` (queue length),
        ``kv_bytes_total`` (the cache's budget: arena + meta), ``kv_bytes_free`` (free chunks), ``kv_bytes_stored`` /
        ``kv_bytes_raw`` (live pages as stored / as BF16), ``kv_ratio``, ``largest_batch`` (decode rows in one step so
        far), ``steps``, ``generated_tokens``, ``prefilled_tokens``, ``cuda_graphs`` (graphs captured)."""
        s = self.kv.stats()
        prefilling = sum(r.state == "prefill" for r in self._running)
        return {"running": len(self._running), "prefilling": prefilling, "decoding": len(self._running) - prefilling,
                "waiting": len(self._waiting), "kv_bytes_total": self.max_kv_bytes,
                "kv_bytes_free": s["free_chunks"] * s["chunk_bytes"], "kv_bytes_stored": s["stored_bytes"],
                "kv_bytes_raw": s["raw_bytes"], "kv_ratio": s["ratio"], "largest_batch": self._largest_batch,
                "steps": self._steps, "generated_tokens": self._generated, "prefilled_tokens": self._prefilled,
                "cuda_graphs": 0 if self._graphs is None else len(self._graphs.graphs)}

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _prompt_list(self, prompt_ids) -> list[int]:
        if isinstance(prompt_ids, str):
            if self.tokenizer is None:
                raise TypeError("a str prompt needs the engine's tokenizer (Engine(..., tokenizer=...))")
            prompt_ids = self.tokenizer(prompt_ids).input_ids
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() != 1:
                raise ValueError(f"prompt_ids must be 1-D, got shape {tuple(prompt_ids.shape)}")
            if prompt_ids.dtype.is_floating_point or prompt_ids.dtype.is_complex or prompt_ids.dtype == torch.bool:
                raise TypeError(f"prompt_ids must hold integers, got {prompt_ids.dtype}")
            prompt = prompt_ids.tolist()
        elif isinstance(prompt_ids, (list, tuple)):
            prompt = list(prompt_ids)
            for t in prompt:
                if not _is_int(t):
                    raise TypeError(f"prompt_ids must hold ints, got {type(t).__name__} {t!r}")
            prompt = [int(t) for t in prompt]
        else:
            raise TypeError(f"prompt_ids must be a list of ints or a 1-D tensor, got {type(prompt_ids).__name__}")
        if not prompt:
            raise ValueError("prompt_ids is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids holds ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return prompt

    def _grow_tables(self, rows: int) -> None:
        old = self._rows
        dev = self.device

        def grown(t, dtype):
            new = torch.zeros(rows, dtype=dtype, device=dev)
            if t is not None:
                new[:old] = t
            return new

        g = lambda name, dtype: grown(getattr(self, name, None), dtype)  # noqa: E731
        self._next, self._pos, self._seed = g("_next", torch.long), g("_pos", torch.long), g("_seed", torch.long)
        self._top_k, self._temp, self._top_p = g("_top_k", torch.long), g("_temp", torch.float32), \
            g("_top_p", torch.float32)
        self._free_slots.extend(range(rows - 1, old - 1, -1))
        self._rows = rows

    def _take_slot(self, req: _Request) -> None:
        if not self._free_slots:
            self._grow_tables(2 * self._rows)
        req.slot = self._free_slots.pop()
        p = req.params
        self._temp[req.slot] = 0.0 if p.greedy else p.temperature
        self._top_k[req.slot] = p.top_k
        self._top_p[req.slot] = p.top_p
        self._seed[req.slot] = self._seed_of.pop(req.rid)

    def _set_row(self, req: _Request, *, next_token: int, position: int) -> None:
        self._next[req.slot] = next_token
        self._pos[req.slot] = position

    def _release(self, req: _Request) -> None:
        """Give back a running request's pages and row (the device work queued before runs first: one stream)."""
        if req.seq_id is not None:
            self.kv.free_sequence(req.seq_id)
            req.seq_id = None
        if req.slot is not None:
            self._free_slots.append(req.slot)
            req.slot = None
        if req in self._running:
            self._running.remove(req)


def _digest(value) -> bytes:
    """A short digest of ``value`` (ints, strs, tuples, SamplingParams: their repr is the same in every process)."""
    return hashlib.blake2b(repr(value).encode(), digest_size=16).digest()
