"""The engine's model runner: the model's forwards on the paged cache (chunked prefill; decode steps compiled with
``torch.compile`` and replayed as CUDA Graphs on CUDA), the per-request device tables, sampling on the device, and the
read back of sampled tokens one step late. It runs what the scheduler decided; it decides nothing."""

from __future__ import annotations

import types

import numpy as np
import torch

from ..integrations.transformers import cache_kwarg
from ..upload import Uploader
from .attention import EngineCache
from .decode_graphs import DecodeGraphs
from .sampling import sample
from .scheduler import Request

_UNLIMITED_BATCH = 1024  # the largest graph bucket when max_batch is None


def _own_code(method):
    """``method`` over a copy of its code object. Dynamo keeps one cache of compiled graphs per code object, at most
    ``torch._dynamo.config.cache_size_limit`` (8) entries, and each runner's forward guards on its own model and
    cache: in a process with more engines than that (tests, a notebook) a shared code object would make the later
    engines fall back to eager, silently. A code object of its own gives every runner its own cache."""
    f = method.__func__
    own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return types.MethodType(own, method.__self__)


class ModelRunner:
    """Runs ``model`` (switched to the "zipkv" attention) on the paged cache ``kv``.

    Per-request state the device needs lives in tables indexed by the request's row (``Request.slot``): the next input
    token (the last sampled one), its position, and the sampling parameters. A step's sampling writes the next inputs
    in place, so the host never waits for a token before launching the next step."""

    def __init__(self, model, kv, *, cuda_graphs: bool, compile: bool, max_batch: int | None,
                 shared_prefix: bool = False):
        self.model, self.kv, self.device = model, kv, kv.device
        self.shared_prefix = shared_prefix  # decode steps attend to the pages their rows share once
        self.shared_steps = 0  # decode steps that did
        config = model.config.get_text_config()
        self.vocab_size = config.vocab_size
        self.hf_cache = EngineCache(kv)
        self._cache_kw = cache_kwarg(model)
        self._upload = Uploader(self.device)
        self.graphs = None
        self.compiled = compile
        if cuda_graphs or compile:
            # A one-token sequence whose page takes the padded rows' writes (slots 1..): never full, never compressed.
            self.pad_seq = kv.add_sequence(prompt_len=1)
            zero = torch.zeros(1, kv.num_kv_heads, kv.head_dim, dtype=torch.bfloat16, device=self.device)
            for layer in range(kv.num_layers):
                kv.append(layer, self.pad_seq, zero, zero)
            pad_page = int(kv.page_table(0, [self.pad_seq])[1][0])
            # One compilation for every bucket and width (DecodeGraphs marks their dimensions dynamic); the zipkv
            # ops trace through their fake kernels.
            forward = torch.compile(_own_code(self._decode_forward), fullgraph=True) if compile else \
                self._decode_forward
            self.graphs = DecodeGraphs(forward, kv, max_batch=max_batch or _UNLIMITED_BATCH, pad_page=pad_page,
                                       capture=cuda_graphs, compiled=compile, shared_prefix=shared_prefix)
        self._rows = 0
        self._free_rows: list[int] = []
        self._grow_tables(64)
        self._host_bufs = [None, None]  # pinned buffers for the read back, used in turn
        self._launches = 0

    # ---- device tables ----------------------------------------------------------------------------------------
    def take_row(self, req: Request) -> None:
        """Give ``req`` a row of the device tables and write its sampling parameters there."""
        if not self._free_rows:
            self._grow_tables(2 * self._rows)
        slot = self._free_rows.pop()
        p = req.params
        # fill_ takes the number as an argument; ``t[slot] = value`` copies it from host memory first (with an index
        # tensor that copy waits for the device: page_store.py).
        self._temp[slot].fill_(0.0 if p.greedy else p.temperature)
        self._top_k[slot].fill_(min(p.top_k, self.vocab_size))  # more than the vocabulary keeps all: the same as all
        self._top_p[slot].fill_(p.top_p)
        self._seed[slot].fill_(req.seed)
        req.slot = slot

    def free_row(self, req: Request) -> None:
        if req.slot is not None:
            self._free_rows.append(req.slot)
            req.slot = None

    def _grow_tables(self, rows: int) -> None:
        old, dev = self._rows, self.device

        def grown(name, dtype):
            new = torch.zeros(rows, dtype=dtype, device=dev)
            if old:
                new[:old] = getattr(self, name)
            setattr(self, name, new)

        for name in ("_next", "_pos", "_seed", "_top_k"):
            grown(name, torch.long)
        for name in ("_temp", "_top_p"):
            grown(name, torch.float32)
        self._free_rows.extend(range(rows - 1, old - 1, -1))
        self._rows = rows

    # ---- forwards ---------------------------------------------------------------------------------------------
    def inject(self, req: Request) -> None:
        """Append ``req.kv_source(layer)``'s K/V for the prompt but its last token, in every layer, instead of a
        prefill; its first decode step then feeds the last prompt token. ValueError for a wrong tensor (what was
        appended stays with the request's sequence, which the caller frees); whatever ``kv_source`` raises
        propagates."""
        n = len(req.prompt) - 1
        want = (n, self.kv.num_kv_heads, self.kv.head_dim)
        for layer in range(self.kv.num_layers):
            k, v = req.kv_source(layer)
            for name, t in (("k", k), ("v", v)):
                if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or tuple(t.shape) != want \
                        or t.device != self.device:
                    raise ValueError(f"kv_source({layer}) must return bf16 {name} of shape {list(want)} on "
                                     f"{self.device}, got {getattr(t, 'dtype', type(t).__name__)} "
                                     f"{tuple(getattr(t, 'shape', ()))} on {getattr(t, 'device', None)}; "
                                     f"request {req.rid} is aborted")
            if n:
                self.kv.append(layer, req.seq_id, k, v)
        self._next[req.slot] = req.prompt[-1]
        self._pos[req.slot] = n

    def prefill(self, chunks: list[tuple[Request, int, int]]) -> tuple[list[Request], torch.Tensor] | None:
        """Prefill prompt tokens ``start .. start + n`` of each ``(request, start, n)`` in ``chunks``, all in one
        forward (their tokens one after another in a ``[1, total]`` row: one launch sequence, where a forward per
        request left the host launching most of a prefill step). For the requests whose prompt this ends, sample the
        first token on the device; returns (those requests, their tokens int64 [k]), or None if none ends."""
        ids = np.concatenate([np.asarray(req.prompt[start: start + n], dtype=np.int64) for req, start, n in chunks])
        pos = np.concatenate([np.arange(start, start + n, dtype=np.int64) for _, start, n in chunks])
        ends, done, at = [], [], 0
        for req, start, n in chunks:
            at += n
            if start + n == len(req.prompt):
                ends.append(at - 1)
                done.append(req)
        keep = np.asarray(ends or [at - 1], dtype=np.int64)  # the logits sampled from (one, unused, if none ends)
        for req, start, _ in chunks:
            if self.kv.seq_len(0, req.seq_id) != start:
                raise RuntimeError(f"the prefill chunk starts at position {start}, but request {req.rid}'s sequence "
                                   f"holds {self.kv.seq_len(0, req.seq_id)} tokens")
        step = self.kv.prepare_prefill([req.seq_id for req, _, _ in chunks], [n for _, _, n in chunks])
        ids, pos, keep = self._upload(ids, pos, keep)
        self.hf_cache.for_prefill(step)
        logits = self.model(input_ids=ids[None], position_ids=pos[None], use_cache=True, logits_to_keep=keep,
                            **{self._cache_kw: self.hf_cache}).logits[0]
        if not done:
            return None
        slots, last = self._upload(np.fromiter((r.slot for r in done), dtype=np.int64, count=len(done)),
                                   np.fromiter((len(r.prompt) - 1 for r in done), dtype=np.int64, count=len(done)))
        self._pos[slots] = last
        return done, self._sample_and_store(logits, slots, done)

    def decode(self, batch: list[Request]) -> torch.Tensor:
        """One decode step of ``batch`` (one token each); returns the sampled tokens (int64 [B], on the device)."""
        rows = len(batch) if self.graphs is None else self.graphs.bucket(len(batch))
        step = self.kv.prepare_step([r.seq_id for r in batch], shared_prefix=self.shared_prefix, rows=rows)
        self.shared_steps += step.shared is not None
        slots, = self._upload(np.fromiter((r.slot for r in batch), dtype=np.int64, count=len(batch)))
        ids, pos = self._next[slots], self._pos[slots]
        if self.graphs is not None:
            logits = self.graphs.run(ids, pos, step)
        else:
            logits = self._decode_forward(ids[:, None], pos[:, None], step)
        return self._sample_and_store(logits, slots, batch)

    def _decode_forward(self, ids: torch.Tensor, pos: torch.Tensor, step) -> torch.Tensor:
        self.hf_cache.for_decode(step)
        return self.model(input_ids=ids, position_ids=pos, use_cache=True,
                          **{self._cache_kw: self.hf_cache}).logits[:, -1]

    def _sample_and_store(self, logits: torch.Tensor, slots: torch.Tensor, batch: list[Request]) -> torch.Tensor:
        """Sample the next token of each row; store it (the next input) and advance the position, on the device."""
        pos = self._pos[slots] + 1  # the sampled token's position
        sampled = [r for r in batch if not r.params.greedy]
        if sampled:
            filtered = any(r.params.top_k > 0 or r.params.top_p < 1 for r in sampled)
            tokens = sample(logits, self._temp[slots], self._top_k[slots], self._top_p[slots], self._seed[slots], pos,
                            any_sampled=True, any_filtered=filtered)
        else:  # an all-greedy batch gathers no sampling parameters
            tokens = logits.argmax(-1)
        self._next[slots] = tokens
        self._pos[slots] = pos
        return tokens

    # ---- read back --------------------------------------------------------------------------------------------
    def launch_readback(self, launched: list[tuple[list[Request], torch.Tensor]]):
        """Start copying the tokens of this step's launches (``(requests, tokens)`` pairs) to the host; returns what
        :meth:`read_back` takes, or None if nothing was launched. On CUDA: into pinned memory, with an event."""
        if not launched:
            return None
        reqs = [r for batch, _ in launched for r in batch]
        tokens = launched[0][1] if len(launched) == 1 else torch.cat([t for _, t in launched])
        if self.device.type != "cuda":
            return reqs, tokens, None
        self._launches += 1
        which = self._launches % 2  # the other buffer may still be read by the previous step's copy
        buf = self._host_bufs[which]
        if buf is None or buf.numel() < tokens.numel():
            buf = self._host_bufs[which] = torch.empty(max(256, 2 * tokens.numel()), dtype=torch.long,
                                                       pin_memory=True)
        host = buf[: tokens.numel()]
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return reqs, host, event

    @staticmethod
    def read_back(in_flight) -> tuple[list[Request], list[int]]:
        """The requests and tokens of an earlier :meth:`launch_readback`, once the device has them (the step's one
        wait: for the step before, while the device runs this one)."""
        reqs, host, event = in_flight
        if event is not None:
            event.synchronize()
        return reqs, host.tolist()
