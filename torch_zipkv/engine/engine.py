"""The continuous-batching engine: a :class:`~torch_zipkv.engine.scheduler.Scheduler` (requests, admission against
the cache's capacity, what each step prefills and decodes; host only) and a
:class:`~torch_zipkv.engine.runner.ModelRunner` (the model's forwards on the paged cache, CUDA Graphs, sampling on the
device, tokens read back one step late), with the tensor-parallel exchange (:mod:`torch_zipkv.engine.tp`) between
ranks. docs/engine.md explains the design."""

from __future__ import annotations

import random
from typing import Callable, Iterable, Iterator

import torch

from ..cache import CompressedPagedKVCache
from ..checks import check_int, is_int
from ..distributed import check_process_group, host_group, tp_group
from ..integrations.transformers import enable, kv_geometry
from .fused_projections import fuse_projections as fuse
from .params import RequestOutput, SamplingParams
from .runner import ModelRunner
from .sampling import seed32
from .scheduler import Scheduler
from .tp import RankSync

_CPU_DEFAULT_KV_BYTES = 256 << 20
_CUDA_DEFAULT_MEMORY_FRACTION = 0.7
# Engine(reclaim=True): while requests wait for room, each compression call reclaims the holes finished requests left
# in packed chunks (CompressedPagedKVCache.compact(max_bytes, sparse)): chunks at most this live are emptied into
# others, moving at most this share of the arena a call.
_RECLAIM_SPARSE = 0.9
_RECLAIM_SHARE = 8


class Engine:
    """Continuous batching over a transformers causal LM whose KV cache lives in one
    :class:`~torch_zipkv.CompressedPagedKVCache`.

    ``model`` is switched to the "zipkv" attention in place (``torch_zipkv.enable``, which refuses a model the cache
    or the decode kernel cannot serve); it must be bfloat16.

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
        compile: run the decode forward ``torch.compile``d (fullgraph, one compilation for every batch bucket; the
            zipkv ops trace through their fake kernels), inside the CUDA Graphs when they are on. Default: on CUDA
            without tensor parallelism. False: the eager forward.
        fuse_projections: fuse each layer's q/k/v projections into one GEMM and its gate/up projections into another,
            in the model, in place (:mod:`torch_zipkv.engine.fused_projections`; the memory does not grow). Default:
            on without tensor parallelism.
        tokenizer: for str prompts and ``RequestOutput.text``.
        page_size: tokens per page (a multiple of 16).
        compress_every: steps between calls that compress the full pages (never waiting for the device); a call that
            leaves pages waiting (more than two rounds of 256 MiB) is followed by another at the next step.
        seed: seeds the draws of requests that give no seed.
        kv_chunk_bytes: the cache's arena chunk (default: sized from the budget, see
            :class:`~torch_zipkv.CompressedPagedKVCache`).
        prefix_caching: a request starts from the longest run of its prompt's whole pages the cache holds (another
            request's, running or finished) and prefills only the rest; finished requests' full pages stay cached
            until their room is needed (docs/engine.md, "Prefix caching"); a decode step attends to the pages its
            requests share once for all of them (:mod:`torch_zipkv.shared_prefix`). False: every prompt is
            prefilled whole.
        reclaim: while requests wait for room, follow each compression call with a bounded compaction
            (``kv.compact(max_bytes, sparse)``): finished requests leave holes in the packed chunks their compressed
            pages shared with others, which only compaction turns into room. Off by default until measured on a GPU
            in its present form (docs/performance.md, "Prefix caching end to end": on the H100 it kept 1.18x the
            raw engine's requests at once in steady state against 1.07x, but its earlier, per-chunk host work cost
            more tokens/s than that bought).
    """

    def __init__(self, model, *, max_kv_bytes: int | None = None, memory_fraction: float | None = None,
                 compress: bool = True, max_batch: int | None = None, prefill_chunk: int = 512,
                 cuda_graphs: bool | None = None, tokenizer=None, page_size: int = 16, compress_every: int = 8,
                 seed: int = 0, kv_chunk_bytes: int | None = None, compile: bool | None = None,
                 fuse_projections: bool | None = None, prefix_caching: bool = True, reclaim: bool = False):
        if not hasattr(model, "config") or not hasattr(model, "set_attn_implementation"):
            raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
        check_int("prefill_chunk", prefill_chunk, 1)
        check_int("compress_every", compress_every, 1)
        check_int("max_batch", max_batch, 1, optional=True)
        check_int("max_kv_bytes", max_kv_bytes, 1, optional=True)
        check_int("kv_chunk_bytes", kv_chunk_bytes, 1, optional=True)
        check_int("seed", seed)
        for name, flag in (("compress", compress), ("prefix_caching", prefix_caching), ("reclaim", reclaim)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        for name, flag in (("cuda_graphs", cuda_graphs), ("compile", compile), ("fuse_projections", fuse_projections)):
            if flag is not None and not isinstance(flag, bool):
                raise TypeError(f"{name} must be None or a bool, got {type(flag).__name__}")
        if max_kv_bytes is not None and memory_fraction is not None:
            raise ValueError("give at most one of max_kv_bytes and memory_fraction")
        self.device = next(model.parameters()).device
        on_cuda = self.device.type == "cuda"
        if max_kv_bytes is None and memory_fraction is None:
            if on_cuda:
                memory_fraction = _CUDA_DEFAULT_MEMORY_FRACTION
            else:
                max_kv_bytes = _CPU_DEFAULT_KV_BYTES

        self.model = enable(model)  # refuses, before anything is built, a model the cache cannot serve (not bf16, ...)
        self.tokenizer = tokenizer
        self.compress, self.compress_every, self.reclaim = compress, compress_every, reclaim
        self._compression_backlog = False  # full pages the last compression call left waiting
        self.prefill_chunk = prefill_chunk
        self.max_batch = max_batch
        config = model.config.get_text_config()
        self.vocab_size = config.vocab_size
        self.max_model_len = getattr(config, "max_position_embeddings", None)
        num_layers, num_kv_heads, head_dim, windows = kv_geometry(model)  # this rank's KV heads under TP
        # Under tensor parallelism: the ranks' host-side group (gloo), for the cache's agreement on what fits and the
        # per-step exchange; host collectives never wait for the device. None for a model that is not sharded.
        tp = tp_group(model)
        group = None if tp is None else check_process_group(host_group(tp))
        # Fused before the cache takes its memory: each layer's concatenation briefly holds its weights twice (the
        # old ones are freed as its layers switch to views), and the cache's memory_fraction reads the free memory.
        if fuse_projections if fuse_projections is not None else group is None:
            fuse(self.model)  # a shard's DTensor weights are left as they are
            if on_cuda:
                torch.cuda.empty_cache()
        self.kv = CompressedPagedKVCache(num_layers, num_kv_heads, head_dim, page_size=page_size,
                                         max_bytes=max_kv_bytes, memory_fraction=memory_fraction,
                                         device=self.device, sliding_window=windows, process_group=group,
                                         chunk_bytes=kv_chunk_bytes)
        self.max_kv_bytes = self.kv.data.numel() + self.kv.stats()["meta_bytes"]  # what the cache holds, all told
        if compile is None:  # compiled tensor-parallel decode is untested on GPUs (no multi-GPU machine ran it)
            compile = on_cuda and group is None
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        shared_prefix = bool(prefix_caching and heads and heads % kv_heads == 0)
        self.runner = ModelRunner(self.model, self.kv, cuda_graphs=on_cuda and cuda_graphs is not False,
                                  compile=compile, max_batch=max_batch, shared_prefix=shared_prefix)
        self.scheduler = Scheduler(self.kv, max_batch=max_batch, release=self.runner.free_row,
                                   prefix_caching=prefix_caching, prefill_budget=prefill_chunk)
        self._empty_pages = self.kv.capacity().pages  # what one request may be promised in an empty cache

        self._rng = random.Random(seed)
        self._next_id = 0  # ids are issued in order: 0 .. _next_id - 1
        self._in_flight = None  # (requests, host tokens, event) of the last step: read back at the next
        self._undelivered: list[RequestOutput] = []  # outputs that generate / stream took for other requests
        self._steps = 0
        self._largest_batch = 0
        self._generated = 0
        self._prefilled = 0
        self._tp = None if group is None else RankSync(group, replay_add=self._enqueue,
                                                        replay_abort=self.scheduler.abort,
                                                        draw_seed=lambda: self._rng.getrandbits(32))

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams | None = None, *,
                    kv_source: Callable | None = None, cache_salt: str | bytes | None = None) -> int:
        """Queue a request; returns its id. ``prompt_ids``: a list of ints or a 1-D integer tensor (a str needs the
        engine's tokenizer). ``kv_source`` (benchmarks): ``kv_source(layer) -> (k, v)``, each bf16
        [len(prompt_ids) - 1, num_kv_heads, head_dim] on the cache's device, appended at admission instead of
        running the prompt through the model; the first decode step then feeds ``prompt_ids[-1]``. If it returns a
        wrong tensor (ValueError) or raises, the :meth:`step` that admits the request aborts it (its last output,
        reason "abort", comes with a later step) and raises that error; the engine keeps serving the others.
        ``cache_salt``: the prefix cache's namespace for this request (anything besides the tokens that changes their
        K/V, e.g. an adapter, or a tenant whose pages others must not reuse): it finds only pages of requests with
        the same salt (None: the engine's shared namespace)."""
        return self._add_checked(*self._check_request(prompt_ids, params, kv_source, cache_salt), kv_source, cache_salt)

    def _add_checked(self, prompt: list[int], params: SamplingParams, kv_source=None, cache_salt=None) -> int:
        seed = self._rng.getrandbits(32) if params.seed is None else seed32(params.seed)
        rid = self._next_id
        self._enqueue(rid, prompt, params, seed, kv_source, cache_salt)
        if self._tp is not None:
            self._tp.record(("add", rid, tuple(prompt), params, seed, kv_source is not None, cache_salt))
        return rid

    def _check_request(self, prompt_ids, params, kv_source=None, cache_salt=None) -> tuple[list[int], SamplingParams]:
        """The prompt as a list of ids and the params, or the error that refuses the request (nothing changes)."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if kv_source is not None and not callable(kv_source):
            raise TypeError(f"kv_source must be callable (layer -> (k, v)), got {type(kv_source).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, (str, bytes)):
            raise TypeError(f"cache_salt must be None, a str or bytes, got {type(cache_salt).__name__}")
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
        return prompt, params

    def _enqueue(self, rid: int, prompt: list[int], params: SamplingParams, seed: int, kv_source=None,
                 cache_salt=None) -> None:
        self._next_id = rid + 1
        self.scheduler.add(rid, prompt, params, seed, kv_source, cache_salt)

    def abort(self, request_id: int) -> bool:
        """Stop a request (waiting or running). Its last :class:`RequestOutput` (finish reason "abort") comes with
        the next :meth:`step`. Returns False if it had already finished; KeyError for an id never issued."""
        check_int("request_id", request_id)
        if not 0 <= request_id < self._next_id:
            raise KeyError(f"no request with id {request_id}")
        if self._tp is not None:
            self._tp.record(("abort", int(request_id)))
        return self.scheduler.abort(int(request_id))

    def has_unfinished(self) -> bool:
        """Whether some request is waiting, running, or has outputs that :meth:`step` has not reported yet."""
        return bool(self.scheduler.has_unfinished() or self._in_flight or self._undelivered)

    # ---- the step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """One engine step: admit what fits, run one decode step for the running batch and up to ``prefill_chunk``
        prompt tokens of the requests being prefilled, and report the tokens of the step before (read back one step
        late, so the host plans this step while the device runs the last), with any outputs :meth:`generate` or
        :meth:`stream` left for the caller. Under tensor parallelism a collective: every rank calls it."""
        if self._tp is not None:
            self._tp.sync(self._steps)
        self._steps += 1
        self._admit()
        sched, runner = self.scheduler, self.runner
        launched = []  # (requests, their sampled tokens on the device)
        decoding = sched.decoding()
        if decoding:
            launched.append((decoding, runner.decode(decoding)))
            sched.launched(decoding)
            self._largest_batch = max(self._largest_batch, len(decoding))
        chunks = sched.prefill_chunks(self.prefill_chunk)
        if chunks:  # every request's chunk in one forward
            first = runner.prefill(chunks)
            for req, _, n in chunks:
                self._prefilled += n
                sched.prefilled(req, n)
            if first is not None:
                launched.append(first)
                sched.launched(first[0])
        previous, self._in_flight = self._in_flight, runner.launch_readback(launched)
        # Every compress_every steps, and every step while full pages wait beyond what one call takes on: after this
        # step's launches (its kernels read the pages first: stream order), so that the call's host time (~14 ms a
        # call on the H100's host, ~32 after a prefill) runs while the device works, not while it waits for the next
        # step's launches. Its room serves the next step's admission.
        if self.compress and (self._steps % self.compress_every == 0 or self._compression_backlog):
            self.kv.compress_full_pages(wait=False)
            self._compression_backlog = self.kv.compression_backlog() > 0
            if self.reclaim and self.scheduler.waiting:
                self.kv.compact(self.kv.data.numel() // _RECLAIM_SHARE, sparse=_RECLAIM_SPARSE)
        if previous is not None:
            reqs, tokens = runner.read_back(previous)
            self._generated += sum(r.state != "finished" for r in reqs)
            sched.read_back(reqs, tokens)
        outs = sched.report(self.tokenizer)
        if self._tp is not None:
            self._tp.after_step(self._steps, self._next_id, sched, outs)
        if self._undelivered:
            outs, self._undelivered = self._undelivered + outs, []
        return outs

    def _admit(self) -> None:
        """Admit what fits, giving each request its row; inject a ``kv_source`` request's K/V. A request that cannot
        be set up is aborted before the error propagates, so nothing of it stays behind."""
        for req in self.scheduler.admit():
            try:
                self.runner.take_row(req)
                if req.kv_source is not None:
                    self.runner.inject(req)
                    req.prefilled, req.state = len(req.prompt), "decode"
            except BaseException:
                self.scheduler.finish(req, "abort")
                raise

    # ---- whole batches ------------------------------------------------------------------------------------------
    def generate(self, prompts: Iterable, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run ``prompts`` (an iterable of token-id lists, 1-D tensors or str) to the end; returns one finished
        :class:`RequestOutput` per prompt, in order. ``params``: one for all, or one per prompt. Outputs of other
        requests that finish meanwhile are kept for the next :meth:`step`."""
        final = {}
        ids = self._add_all(prompts, params)
        for out in self._outputs_of(ids):
            if out.finished:
                final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompts: Iterable, params: SamplingParams | list[SamplingParams] | None = None
               ) -> Iterator[RequestOutput]:
        """Like :meth:`generate`, yielding each :class:`RequestOutput` of these prompts as soon as a step reports
        it."""
        yield from self._outputs_of(self._add_all(prompts, params))

    def _add_all(self, prompts, params) -> list[int]:
        if isinstance(prompts, (str, torch.Tensor)):
            raise TypeError("prompts must be an iterable of prompts (token-id lists, 1-D tensors or str), got "
                            f"{type(prompts).__name__}")
        try:
            prompts = list(prompts)
        except TypeError:
            raise TypeError(f"prompts must be an iterable of prompts, got {type(prompts).__name__}") from None
        if prompts and is_int(prompts[0]):
            raise TypeError("prompts must be an iterable of prompts (token-id lists, 1-D tensors or str), got one "
                            "prompt's ids: wrap it in a list")
        per = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"params has {len(per)} entries for {len(prompts)} prompts")
        checked = [self._check_request(p, sp) for p, sp in zip(prompts, per)]  # a refusal queues none of them
        return [self._add_checked(p, sp) for p, sp in checked]

    def _outputs_of(self, ids: list[int]) -> Iterator[RequestOutput]:
        """Step until every request of ``ids`` has finished, yielding their outputs; other requests' outputs go to
        the next :meth:`step`'s caller."""
        pending, others = set(ids), []
        try:
            while pending:
                if not self.has_unfinished():
                    raise RuntimeError(f"requests {sorted(pending)} were lost")  # a bug, never a silent hang
                for out in self.step():
                    if out.request_id not in pending:
                        others.append(out)
                        continue
                    yield out
                    if out.finished:
                        pending.discard(out.request_id)
        finally:
            self._undelivered[:0] = others

    # ---- stats ------------------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank in the tensor-parallel group (0 without one)."""
        return 0 if self._tp is None else self._tp.rank

    @property
    def process_group(self):
        """The ranks' host (gloo) group under tensor parallelism, else None."""
        return None if self._tp is None else self._tp.group

    def stats(self) -> dict:
        """``running`` (requests admitted: ``prefilling`` + ``decoding``), ``waiting`` (queue length),
        ``kv_bytes_total`` (the cache's budget: arena + meta), ``kv_bytes_free`` (free chunks), ``kv_bytes_stored`` /
        ``kv_bytes_raw`` (live pages as stored / as BF16), ``kv_ratio``, ``largest_batch`` (decode rows in one step so
        far), ``steps``, ``generated_tokens``, ``prefilled_tokens``, ``cuda_graphs`` (graphs captured),
        ``decode_setup_s`` (seconds spent compiling the decode forward and capturing its graphs); prefix caching:
        ``prefix_cached_tokens`` (prompt tokens found in the cache at admission: the prefill tokens saved),
        ``prefix_hit_rate`` (their share of the prompt tokens admitted), ``prefix_hits`` (requests that found a prefix),
        ``shared_prefix_steps`` (decode steps that attended to their rows' shared pages once), and the cache's pages as
        stored, ``kv_bytes_cached`` (findable), ``kv_bytes_shared`` (held by two requests or more),
        ``kv_bytes_evictable`` (held by none: room admission may take)."""
        s, sched = self.kv.stats(), self.scheduler
        running = sched.running
        prefilling = sum(r.state == "prefill" for r in running)
        graphs = self.runner.graphs
        return {"running": len(running), "prefilling": prefilling, "decoding": len(running) - prefilling,
                "waiting": len(self.scheduler.waiting), "kv_bytes_total": self.max_kv_bytes,
                "kv_bytes_free": s["free_chunks"] * s["chunk_bytes"], "kv_bytes_stored": s["stored_bytes"],
                "kv_bytes_raw": s["raw_bytes"], "kv_ratio": s["ratio"], "largest_batch": self._largest_batch,
                "steps": self._steps, "generated_tokens": self._generated, "prefilled_tokens": self._prefilled,
                "cuda_graphs": 0 if graphs is None else graphs.graphs,
                "decode_setup_s": 0.0 if graphs is None else graphs.setup_s,
                "prefix_cached_tokens": sched.cached_tokens, "prefix_hits": sched.hits,
                "shared_prefix_steps": self.runner.shared_steps,
                "prefix_hit_rate": sched.cached_tokens / sched.prompt_tokens if sched.prompt_tokens else 0.0,
                "kv_bytes_cached": s["cached_bytes"], "kv_bytes_shared": s["shared_bytes"],
                "kv_bytes_evictable": s["evictable_bytes"]}

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
                if not is_int(t):
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
