"""HuggingFace transformers (>= 5.17) on the compressed cache: a ``Cache`` and an attention implementation, "zipkv".

    import torch_zipkv
    model = torch_zipkv.enable(AutoModelForCausalLM.from_pretrained(...))     # or attn_implementation="zipkv"
    cache = torch_zipkv.ZipKVCache.from_model(model, batch_size=2, max_length=512, max_new_tokens=64)
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)  # transformers < 5.24: past_key_values=cache

Importing this module registers "zipkv" with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``
(``torch_zipkv.enable`` and ``torch_zipkv.ZipKVCache`` import it; import it yourself before
``from_pretrained(..., attn_implementation="zipkv")``). transformers 5.24 renamed the cache argument of ``forward``
and ``generate`` from ``past_key_values`` to ``cache``; :func:`cache_kwarg` tells which one a model takes.

Which models: decoder-only, attention (full or sliding-window) in every layer, GQA groups of at most ``MAX_GROUP``
query heads per KV head, one head_dim the format takes for keys and values, bfloat16. :func:`check_model` refuses any
other ("this model type is not supported: ..."), and :func:`enable`, :func:`kv_geometry` (so
:meth:`ZipKVCache.from_model` and the engine) and :func:`generate` run it first.

How the attention function reaches the cache. transformers' attention modules (Llama, Qwen2/3, Mistral, Gemma 2/3,
...) call ``cache.update(k, v, layer_idx, kwargs=kwargs)`` and then ``attention_interface(module, q, k, v, mask,
**kwargs)`` with the same ``kwargs`` dict. :meth:`ZipKVCache.update` stores the cache in that dict as
``zipkv_cache`` (older transformers, which pass ``update`` no kwargs: in a module-level slot that the same layer's
attention call takes right after) and returns the new ``k, v`` unchanged; the "zipkv" attention function then does
all the work for ``module.layer_idx``:

- prefill (the first call, into an empty cache): append each sequence's real tokens to its pages (pads, read from
  the mask's diagonal, never enter the cache) and attend with transformers' own SDPA over the prompt's K/V and mask;
  a later multi-token call continues each sequence (below);
- decode (every later call, one token per sequence): append the new token of every sequence, then ``paged_decode``
  on the compressed pages.

Sequences are added to the :class:`~torch_zipkv.CompressedPagedKVCache` at prefill, when their real lengths are known,
each with a budget of prompt + ``max_new_tokens`` tokens (or prefilled elsewhere and taken over with
:meth:`ZipKVCache.adopt`). Full pages are handed to the compressor at the start of a decode step
(:meth:`ZipKVCache.begin_step`; every ``compress_every`` steps, the first decode step included), after the attention
that read them, never inside the attention, and without waiting for the device: their compressed copies take their place
at a later such call, once their sizes have reached the host, and until then they are read raw. Without a ``ZipKVCache``
(``use_cache=False``, or another cache class), "zipkv" attention is plain SDPA.

Compiling a decode step: call :meth:`ZipKVCache.begin_step` before it (compression of full pages and the step's
plan: host work), pass ``position_ids``, and the step itself is tensor ops only. ``torch.compile(fullgraph=True)``
traces it as one graph and never recompiles, wherever the cache is held (a global, a closure, an attribute): what
transformers asks the cache during a step is the same Python value every step (mask sizes) or a device tensor
(``get_seq_length``, which the step advances), and the step's page table keeps one shape while the batch runs. The
"zipkv" mask function returns no mask for a decode step: ``paged_decode`` attends to exactly the stored tokens.

Sliding-window layers (Mistral, Gemma 2/3, Qwen2 with ``use_sliding_window``): :meth:`ZipKVCache.from_model` builds
the paged cache with each layer's window from the config, so decode attends to the window only, and the pages wholly
before it are freed at each compression. Attention logit softcapping (Gemma 2): decode passes the cap to
``paged_decode``; prefill, which SDPA cannot cap, runs a plain eager attention with the cap.

Prefill into a non-empty cache (a second ``generate`` on the same cache continues the conversation): a model call of
more than one token per sequence into a cache that holds the batch appends every new token (a continuation has no
padding) and attends with ``paged_prefill`` to each sequence's stored tokens, read from the pages in place.

``num_return_sequences > 1`` works: ``generate`` repeats the prompts before the prefill (size the cache for the
repeated batch). Not supported yet (each raises ``NotImplementedError``): assisted decoding (it crops the cache) and
beam search.
"""

from __future__ import annotations

import inspect

import torch
from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import format as fmt
from ..cache import CompressedPagedKVCache
from ..checks import check_int, is_int
from ..distributed import local_kv_heads, tp_group
from ..ops import MAX_GROUP

ATTN_IMPLEMENTATION = "zipkv"
# (cache, layer_idx) from the last ZipKVCache.update that had no attention kwargs to carry the cache (older
# transformers); the attention call of that layer, which comes right after it, takes it.
_PENDING: list = [None]


def hand_to_attention(cache, layer_idx: int, key_states: torch.Tensor, update_kwargs: dict) -> None:
    """Called by a paged cache's ``update``: makes ``cache`` the one that this layer's "zipkv" attention call uses.
    transformers 5.20 on pass ``update`` the forward's kwargs, which reach the attention function: the cache goes
    there. Before, ``update`` gets no kwargs: the cache waits in ``_PENDING`` for this layer's attention call, which
    receives these very key states (a forward that raised in between must not hand the cache to a later, unrelated
    call: the tensor's identity tells them apart)."""
    forward_kwargs = update_kwargs.get("kwargs")
    if isinstance(forward_kwargs, dict):
        forward_kwargs["zipkv_cache"] = cache
        _PENDING[0] = None
    else:
        _PENDING[0] = (cache, layer_idx, key_states)


class _PagedLayer(CacheLayerMixin):
    """What transformers asks one layer of a paged cache; the tokens live in the pages, so ``update`` hands the new
    K/V back untouched and the attention function stores them. The mask spans the new tokens only: a prefill starts
    from an empty cache (or, in the engine, attends to earlier chunks through its own mask), and a decode step reads
    its keys from the pages, which hold exactly each sequence's real tokens. No answer depends on the cache's length.
    """

    is_sliding = False

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        # transformers 5.24 passes the query length, older versions the cache positions (a tensor)
        n = int(query_length.shape[-1]) if isinstance(query_length, torch.Tensor) else query_length
        return n, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False


class _ZipKVLayer(_PagedLayer):
    """A layer of :class:`ZipKVCache`. No answer is a Python int that changes from one decode step to the next, so a
    compiled decode step never guards on one (a guard on a per-step int recompiles every step). Before the prefill
    the cache is empty: length 0. From the prefill on, the length is the owner's device tensor ``positions``
    (positions as transformers counts them, pads included), which the step itself advances, as transformers'
    ``StaticCache`` does.
    """

    def __init__(self, owner: "ZipKVCache"):
        super().__init__()
        self.owner = owner

    def get_seq_length(self):
        return 0 if self.owner.seq_ids is None else self.owner.positions


class ZipKVCache(Cache):
    """A transformers ``Cache`` whose K/V live in a :class:`~torch_zipkv.CompressedPagedKVCache` (``self.kv``).

    Use with a model whose attention implementation is "zipkv" (:func:`enable`). Build it with :meth:`from_model`,
    or wrap a ``CompressedPagedKVCache`` whose geometry matches the model. One cache serves one batch of prompts;
    :meth:`reset` frees its sequences for the next batch.

    Args:
        kv: the paged cache (its ``num_layers``, ``num_kv_heads`` and ``head_dim`` must match the model).
        max_new_tokens: tokens each sequence may grow by after its prompt; reserved in the cache at prefill, so
            generation never runs out of room. ``None`` reserves nothing beyond the prompt.
        compress_every: decode steps between compressions of the pages filled meanwhile (the first decode step
            compresses the prompts). Each compression costs host time per call more than per page, and a page
            left raw a few steps longer costs nothing but its 4/3 size (raw pages are promised anyway).
    """

    def __init__(self, kv: CompressedPagedKVCache, *, max_new_tokens: int | None = None, compress_every: int = 8):
        if not isinstance(kv, CompressedPagedKVCache):
            raise TypeError(f"kv must be a CompressedPagedKVCache, got {type(kv).__name__}")
        check_int("max_new_tokens", max_new_tokens, 0, optional=True)
        check_int("compress_every", compress_every, 1)
        super().__init__(layers=[_ZipKVLayer(self) for _ in range(kv.num_layers)])
        self.kv = kv
        # Positions stored, pads included: what transformers' get_seq_length answers once the prefill ran. A device
        # tensor that layer 0's update advances inside the step, so a compiled step reads no per-step Python int.
        self.positions = torch.zeros((), dtype=torch.long, device=kv.device)
        if kv.device.type == "cuda":
            # The arena, meta rows and positions live as long as the cache and decode steps write them in place: as
            # static addresses, a CUDA Graph (torch.compile mode="reduce-overhead") captures them instead of skipping.
            for t in (kv.data, self.positions, *(kv.meta(layer) for layer in range(kv.num_layers))):
                torch._dynamo.mark_static_address(t)
        self.max_new_tokens = max_new_tokens
        self.compress_every = compress_every
        self.steps = 0  # decode steps planned since the prefill
        self._backlog = False  # full pages the last compression call left waiting
        self.seq_ids: list[int] | None = None  # one per batch row, set at prefill
        self.step = None  # the current decode step (CompressedPagedKVCache.prepare_step)
        self.planned = False  # begin_step ran for the coming decode step: the model call is a decode step
        self.touched = False  # a model call reached layer 0's update since the last reset
        self.continuing = False  # this model call prefills more tokens into the sequences the cache holds

    @classmethod
    def from_model(cls, model, *, batch_size: int = 1, max_length: int | None = None,
                   max_new_tokens: int | None = None, max_bytes: int | None = None, page_size: int = 16,
                   device=None, compress_every: int = 8, process_group=None) -> "ZipKVCache":
        """A cache shaped for ``model`` (its text config: layers, KV heads, head_dim), on the model's device.

        Size it with ``max_bytes`` (data + metadata, see :class:`~torch_zipkv.CompressedPagedKVCache`) or with
        ``max_length``: room for ``batch_size`` sequences of ``max_length`` tokens (prompt + new tokens) stored raw,
        so whatever compresses is headroom. Both size this rank's cache.

        Under tensor parallelism (``from_pretrained(..., tp_plan="auto")`` under ``torchrun``) the cache holds this
        rank's KV heads, read from the width of the sharded ``k_proj`` (ValueError if the heads do not split into
        whole heads per rank), and agrees on what fits with the other ranks over ``process_group``: by default the
        model's tensor-parallel group (see :class:`~torch_zipkv.CompressedPagedKVCache`).
        """
        check_int("batch_size", batch_size, 1)
        check_int("max_length", max_length, 1, optional=True)
        check_int("max_new_tokens", max_new_tokens, 0, optional=True)
        check_int("max_bytes", max_bytes, 1, optional=True)
        check_int("page_size", page_size)
        check_int("compress_every", compress_every, 1)
        if (max_bytes is None) == (max_length is None):
            raise ValueError(f"give exactly one of max_bytes and max_length, got max_bytes={max_bytes!r}, "
                             f"max_length={max_length!r}")
        num_layers, num_kv_heads, head_dim, windows = kv_geometry(model)  # refuses a model the cache cannot serve
        fmt.check_geometry(page_size, head_dim)  # the model's head_dim passed kv_geometry: this checks page_size
        if process_group is None:
            process_group = tp_group(model)
        if device is None:
            device = next(model.parameters()).device
        if max_length is not None:
            if max_new_tokens is not None and max_new_tokens > max_length:
                raise ValueError(f"max_new_tokens ({max_new_tokens}) exceeds max_length ({max_length}), which counts "
                                 "prompt and new tokens")
            kwargs = CompressedPagedKVCache.raw_sizing(num_layers, num_kv_heads, head_dim, batch_size=batch_size,
                                                       max_length=max_length, page_size=page_size)
        else:
            kwargs = {"max_bytes": max_bytes}
        kv = CompressedPagedKVCache(num_layers, num_kv_heads, head_dim, page_size=page_size, device=device,
                                    sliding_window=windows, process_group=process_group, **kwargs)
        return cls(kv, max_new_tokens=max_new_tokens, compress_every=compress_every)

    def adopt(self, seq_ids, length: int | None = None) -> None:
        """Make sequences prefilled outside the model this cache's batch, as if a prefill through the model had
        stored them: ``seq_ids`` are running sequences of :attr:`kv` (``kv.add_sequence``, then ``kv.append`` of each
        one's real tokens to every layer), row ``i`` of the batch being ``seq_ids[i]``. The next model call is then a
        decode step (the first one compresses the full pages, as after a prefill), and :meth:`reset` frees them.

        ``length`` is the position count transformers reads (``get_seq_length``), pads included, as a prefill of
        left-padded prompts leaves it: at least each sequence's length; by default their common length (ValueError
        if they differ: give the padded length). RuntimeError if the cache holds a batch, or a model call reached it,
        since the last :meth:`reset`; ValueError for an id that is not a running sequence of :attr:`kv`, an id given
        twice, or a sequence whose layers hold different numbers of tokens (a prefill fills every layer)."""
        if self.seq_ids is not None or self.touched:
            raise RuntimeError("ZipKVCache.adopt: the cache already holds a batch (or a model call reached it); "
                               "call cache.reset() first")
        ids = self._adoptable(seq_ids)
        check_int("length", length, 1, optional=True)
        lengths = [self._prefilled_length(sid) for sid in ids]
        if length is None:
            if len(set(lengths)) > 1:
                raise ValueError(f"length: the sequences hold different numbers of tokens ({lengths}); give length, "
                                 "the prompts' padded length as transformers counts positions")
            length = lengths[0]
        elif length < max(lengths):
            raise ValueError(f"length must be at least each sequence's length, got {length} for a sequence of "
                             f"{max(lengths)} tokens")
        self.seq_ids = ids
        self.positions.fill_(length)
        self.steps, self.step, self.planned, self.touched = 0, None, False, True
        for layer in self.layers:
            layer.is_initialized = True

    def _adoptable(self, seq_ids) -> list[int]:
        """``seq_ids`` as a list: distinct running sequences of :attr:`kv`, at least one."""
        if is_int(seq_ids) or isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__iter__"):
            raise TypeError(f"seq_ids must be a list of ints, got {type(seq_ids).__name__} {seq_ids!r}")
        ids = list(seq_ids)
        for sid in ids:
            if not is_int(sid):
                raise TypeError(f"seq_ids must be a list of ints, got an entry {type(sid).__name__} {sid!r}")
        if not ids:
            raise ValueError("seq_ids must name at least one sequence, got none")
        running = set(self.kv.seq_ids)
        for sid in ids:
            if sid not in running:
                raise ValueError(f"seq_ids: {sid!r} is not a running sequence of cache.kv (kv.add_sequence)")
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids names a sequence more than once: {ids}")
        return [int(sid) for sid in ids]

    def _prefilled_length(self, seq_id: int) -> int:
        """Tokens ``seq_id`` holds, the same in every layer (ValueError otherwise, or if it holds none)."""
        counts = [self.kv.seq_len(layer, seq_id) for layer in range(self.kv.num_layers)]
        if len(set(counts)) > 1 or counts[0] == 0:
            raise ValueError(f"seq_ids: sequence {seq_id} holds {counts} tokens in layers 0..{len(counts) - 1}; "
                             "adopt takes prefilled sequences, the same tokens appended to every layer")
        return counts[0]

    # ---- transformers' Cache interface ---------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Hand this cache to the attention function (through the attention module's kwargs) and return ``k, v``
        unchanged: the "zipkv" attention appends them to the pages. Layer 0 advances ``positions`` and, on a decode
        step that :meth:`begin_step` did not plan yet, plans it (eager use, ``model.generate``)."""
        if layer_idx == 0:
            if self.touched and self.seq_ids is None:
                raise RuntimeError(
                    "ZipKVCache holds no sequences after a prefill: the model's attention implementation is not "
                    "'zipkv' (call torch_zipkv.enable(model), or load it with attn_implementation='zipkv')")
            if self.seq_ids is not None and key_states.shape[-2] > 1:
                if self.planned:  # refused before anything changes
                    raise RuntimeError(f"ZipKVCache: begin_step planned a decode step, but the model call brings "
                                       f"{key_states.shape[-2]} tokens per sequence")
                if key_states.shape[0] != len(self.seq_ids):
                    raise ValueError(f"a prefill into the non-empty ZipKVCache has batch {key_states.shape[0]}, the "
                                     f"cache holds {len(self.seq_ids)} sequences")
            # More than one token per sequence into a cache that holds the batch: a prefill that continues each
            # sequence (a conversation's next turn), for every layer of this call.
            self.continuing = self.seq_ids is not None and key_states.shape[-2] > 1
            self.touched = True
            self.positions.add_(key_states.shape[-2])
            if self.seq_ids is not None and key_states.shape[-2] == 1 and not self.planned:
                self.begin_step()
        hand_to_attention(self, layer_idx, key_states, kwargs)
        return self.layers[layer_idx].update(key_states, value_states)

    def begin_step(self) -> None:
        """Host work of one decode step, for every layer: every ``compress_every`` steps, and every step while full
        pages wait beyond what one call takes on (after a long prefill), compress the pages filled since (after the
        attention that read them; without waiting for the device, see
        :meth:`~torch_zipkv.CompressedPagedKVCache.compress_full_pages`), then plan where each sequence's next token
        goes and the page table (:meth:`~torch_zipkv.CompressedPagedKVCache.prepare_step`). A decode step's layer-0
        update calls it; call it yourself before a compiled or graph-captured decode step, so the step itself only
        runs tensor ops."""
        if self.seq_ids is None:
            raise RuntimeError("ZipKVCache.begin_step before any prefill")
        if self.steps % self.compress_every == 0 or self._backlog:
            self.kv.compress_full_pages(wait=False)  # never waits for the device: a round is placed a call later
            self._backlog = self.kv.compression_backlog() > 0
        self.step = self.kv.prepare_step(self.seq_ids)
        self.steps += 1
        self.planned = True

    def reset(self) -> None:
        """Free every sequence, so the cache can take the next batch."""
        for sid in self.seq_ids or ():
            self.kv.free_sequence(sid)
        self.seq_ids = self.step = None
        self.steps = 0
        self.planned = self.touched = self.continuing = self._backlog = False
        self.positions.zero_()
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("ZipKVCache cannot crop (assisted decoding is not supported)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("ZipKVCache does not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:  # transformers 5.24's num_return_sequences repeats the prompts before the prefill instead
            raise NotImplementedError("ZipKVCache cannot repeat the rows of a batch it holds (beam search, "
                                      "contrastive search)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("ZipKVCache does not support selecting batch rows")

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return -1 if self.seq_ids is None else len(self.seq_ids)

    def stats(self) -> dict:
        """The paged cache's :meth:`~torch_zipkv.CompressedPagedKVCache.stats`."""
        return self.kv.stats()

    # ---- attention -----------------------------------------------------------------------------------------------
    def attend(self, module, query, key, value, attention_mask, *, scaling, sliding_window, softcap, kwargs):
        """The "zipkv" attention of ``module.layer_idx`` (see the module docstring). Returns ``(out, None)``,
        ``out`` [batch, q_len, Hq, D]."""
        layer = module.layer_idx
        if query.dtype != torch.bfloat16 or key.dtype != torch.bfloat16:
            raise ValueError(f"'zipkv' attention needs a bfloat16 model, got query {query.dtype} and key {key.dtype}")
        if self.kv.sliding_window[layer] != sliding_window:
            # The paged cache frees what lies before its window: it must be the model's, or decode would be wrong.
            raise ValueError(f"layer {layer} attends with sliding_window={sliding_window}, but the cache was built "
                             f"with {self.kv.sliding_window[layer]}; build it with ZipKVCache.from_model(model, ...)")
        if self.continuing:
            return self._prefill_more(layer, query, key, value, scaling, softcap)
        if not self.planned:  # a prefill (begin_step plans every decode step): prompts of any length, one included
            self._prefill(layer, key, value, attention_mask)
            if softcap is not None:  # SDPA cannot cap logits
                return _softcapped_attention(query, key, value, attention_mask, scaling, softcap), None
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                          sliding_window=sliding_window, **kwargs)
        if query.shape[0] != len(self.seq_ids):
            raise ValueError(f"query has batch {query.shape[0]}, the cache holds {len(self.seq_ids)} sequences")
        # [B, H, 1, D] -> [B, H, D]; the step was planned for all layers at layer 0's update: no host work here
        self.kv.step_append(layer, self.step, key[:, :, 0].contiguous(), value[:, :, 0].contiguous())
        out = self.kv.step_decode(layer, self.step, query[:, :, 0].contiguous(), sm_scale=scaling,
                                  logits_soft_cap=softcap or 0.0)
        if layer == len(self.layers) - 1:
            self.planned = False  # the next decode step plans again (eagerly at layer 0, or by an explicit begin_step)
        return out.unsqueeze(1), None

    def _prefill(self, layer: int, key: torch.Tensor, value: torch.Tensor, attention_mask) -> None:
        real = _real_tokens(attention_mask, key.shape[0], key.shape[2], key.device)  # bool [B, L]
        if layer == 0:  # update refused a prefill into a non-empty cache
            seq_ids = []
            try:
                for n in real.sum(1).tolist():
                    seq_ids.append(self.kv.add_sequence(prompt_len=n, max_new_tokens=self.max_new_tokens or 0))
            except Exception:  # e.g. CacheFullError: leave the cache empty, as it was
                for sid in seq_ids:
                    self.kv.free_sequence(sid)
                self.reset()
                raise
            self.seq_ids = seq_ids
        elif self.seq_ids is None or len(self.seq_ids) != key.shape[0]:
            raise RuntimeError(f"'zipkv' prefill reached layer {layer} before layer 0")
        for row, sid in enumerate(self.seq_ids):
            keep = real[row]
            # [H, L, D] -> [n, H, D], real tokens only
            self.kv.append(layer, sid, key[row][:, keep].transpose(0, 1), value[row][:, keep].transpose(0, 1))


    def _prefill_more(self, layer: int, query, key, value, scaling: float, softcap) -> tuple[torch.Tensor, None]:
        """A prefill into sequences the cache holds: every new token of each row is appended (a continuation has no
        padding: its rows' pads were left out at the first prefill), then the new tokens attend causally to the
        sequence's stored tokens and to each other, read from the pages in place (``paged_prefill``)."""
        if query.shape[0] != len(self.seq_ids):
            raise ValueError(f"query has batch {query.shape[0]}, the cache holds {len(self.seq_ids)} sequences")
        batch, n = query.shape[0], query.shape[2]
        for row, sid in enumerate(self.seq_ids):
            self.kv.append(layer, sid, key[row].transpose(0, 1), value[row].transpose(0, 1))
        q = query.transpose(1, 2).reshape(batch * n, query.shape[1], query.shape[3])  # [B n, Hq, D], row by row
        out = self.kv.prefill(layer, q, self.seq_ids, q_lens=[n] * batch, sm_scale=scaling,
                              logits_soft_cap=float(softcap or 0.0))
        return out.view(batch, n, *out.shape[1:]), None  # [B, n, Hq, D]


def kv_geometry(model) -> tuple[int, int, int, list[int | None]]:
    """What a KV cache for ``model`` holds on this rank: ``(num_layers, num_kv_heads, head_dim, sliding_window)``,
    from its text config, with this rank's share of the KV heads under tensor parallelism
    (:func:`~torch_zipkv.distributed.local_kv_heads`) and one sliding window (or None) per layer. ValueError for a
    model the cache cannot serve (:func:`check_model`)."""
    check_model(model)
    config = model.config.get_text_config()
    num_heads, num_kv_heads, head_dim = config_heads(config)
    return config.num_hidden_layers, local_kv_heads(model, num_kv_heads, head_dim), head_dim, _sliding_windows(config)


# Layer types (transformers' config.layer_types) whose K/V the paged cache holds; the others keep a state of another
# shape (linear attention, Mamba, hybrid layers) or attend in a way paged_decode does not (chunked, sparse).
LAYER_TYPES = ("full_attention", "sliding_attention")


def check_model(model) -> None:
    """ValueError "this model type is not supported: <why>" unless the compressed cache can serve ``model``: a
    decoder-only model whose every layer is (sliding-window) attention, with a GQA group of at most ``MAX_GROUP``
    query heads per KV head, one ``head_dim`` the format takes for keys and values, and bfloat16 weights. Run by
    :func:`enable`, :func:`kv_geometry` (so :meth:`ZipKVCache.from_model` and the engine) and :func:`generate`, so
    such a model is refused before anything runs, not at its first decode step."""
    why = _unsupported(model)
    if why is not None:
        raise ValueError(f"this model type is not supported: {why}")


def _unsupported(model) -> str | None:
    """Why the compressed cache cannot serve ``model`` (a sentence that starts with its ``model_type``), or None."""
    config = model.config
    kind = getattr(config, "model_type", None) or type(config).__name__
    if getattr(config, "is_encoder_decoder", False):  # its decoder's first call would look like a second prefill
        return (f"{kind} is an encoder-decoder model (config.is_encoder_decoder); the cache serves decoder-only "
                "models, whose forward is one prefill and then one decode step per token")
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    if not is_int(heads) or heads < 1:
        return (f"{kind} has no attention heads in its text config (num_attention_heads: {heads!r}); the cache "
                "holds attention K/V")
    others = sorted(set(getattr(text, "layer_types", None) or ()) - set(LAYER_TYPES))
    if others:
        return f"{kind} has layers of type {others}; the cache holds the K/V of {list(LAYER_TYPES)} layers only"
    heads, kv_heads, head_dim = config_heads(text)
    if not is_int(kv_heads) or kv_heads < 1 or heads % kv_heads:
        return f"{kind} has {heads} query heads over {kv_heads!r} KV heads (num_key_value_heads): not whole groups"
    if heads // kv_heads > MAX_GROUP:  # every decode step's paged_decode would refuse it
        return (f"{kind} has a GQA group of {heads // kv_heads} query heads per KV head (num_attention_heads="
                f"{heads}, num_key_value_heads={kv_heads}); paged_decode takes groups of at most {MAX_GROUP}")
    for name in ("qk_head_dim", "v_head_dim"):  # multi-head latent attention: keys and values of other widths
        width = getattr(text, name, None)
        if width is not None and width != head_dim:
            return (f"{kind} has {name}={width} beside head_dim={head_dim} (multi-head latent attention); the cache "
                    "holds keys and values of one head_dim")
    error = fmt.geometry_error(fmt.TILE_TOKENS, head_dim)  # a valid page size: only head_dim can be refused
    if error is not None:
        return f"{kind} has head_dim {head_dim}, and the compressed format's {error}"
    dtype = getattr(model, "dtype", None)
    if dtype != torch.bfloat16:
        return (f"{kind} runs in {dtype}; the cache holds bfloat16 K/V (load the model with dtype=torch.bfloat16, "
                "or call model.bfloat16())")
    return None


def config_heads(config) -> tuple[int, int, int]:
    """``(num_attention_heads, num_key_value_heads, head_dim)`` of a transformers text config, as transformers'
    attention modules read them: KV heads default to the query heads, head_dim to hidden_size / heads."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, head_dim


def _sliding_windows(config) -> list[int | None]:
    """Each layer's sliding window (tokens attended, the newest included) from a transformers text config: from
    ``layer_types`` where the config has them ("sliding_attention"), else ``sliding_window`` for every layer."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * config.num_hidden_layers


def _softcapped_attention(query, key, value, attention_mask, scaling: float, softcap: float) -> torch.Tensor:
    """Prefill attention with logits capped at ``softcap * tanh(logits / softcap)`` (Gemma 2), as transformers'
    eager attention computes it: [B, Hq, L, D] inputs, a bool (True: attend) or additive mask; returns [B, L, Hq, D]."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    logits = torch.matmul(query, key.transpose(2, 3)) * scaling
    logits = torch.tanh(logits / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        if mask.dtype == torch.bool:  # a large negative, not -inf: a fully masked (pad) row stays finite
            mask = torch.zeros(mask.shape, dtype=logits.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(logits.dtype).min)
        logits = logits + mask
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def _real_tokens(attention_mask, batch: int, length: int, device) -> torch.Tensor:
    """bool [batch, length]: which prompt positions are real tokens. With an empty cache, position i attends to itself
    exactly when it is not padding, so this is the diagonal of the 4D mask (bool: True = attend; float: 0 = attend).
    No mask means no padding."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4 or \
            attention_mask.shape[-2:] != (length, length):
        raise ValueError(f"'zipkv' prefill needs a 4D attention_mask [batch, 1, {length}, {length}], got "
                         f"{type(attention_mask).__name__} {tuple(getattr(attention_mask, 'shape', ()))}")
    diag = attention_mask[:, 0].diagonal(dim1=-2, dim2=-1)
    real = diag if diag.dtype == torch.bool else diag == 0
    return real.expand(batch, length)


def zipkv_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, zipkv_cache: ZipKVCache | None = None, **kwargs):
    """transformers attention function "zipkv": decode from the compressed pages of the ``ZipKVCache`` that
    :meth:`ZipKVCache.update` put in ``kwargs``; plain SDPA when there is none."""
    pending = _PENDING[0]
    if zipkv_cache is None and pending is not None:
        _PENDING[0] = None
        if pending[1] == module.layer_idx and pending[2] is key:
            zipkv_cache = pending[0]
    if zipkv_cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, softcap=softcap, **kwargs)
    if dropout:
        raise ValueError(f"'zipkv' attention is for inference: dropout must be 0, got {dropout}")
    return zipkv_cache.attend(module, query, key, value, attention_mask, scaling=scaling,
                              sliding_window=sliding_window, softcap=softcap, kwargs=kwargs)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, max_new_tokens: int,
             cache: ZipKVCache | None = None, compile: bool | str = False, do_sample: bool = False,
             temperature: float = 1.0, eos_token_id: int | None = None, generator: torch.Generator | None = None,
             return_logits: bool = False):
    """Decode loop on the compressed cache whose per-step host work runs outside the model call, so the decode step
    can be compiled: ``compile=True`` (``torch.compile(fullgraph=True)``) or a mode string such as
    ``"reduce-overhead"`` (CUDA Graphs). Greedy by default; ``do_sample`` samples at ``temperature``.

    ``input_ids`` / ``attention_mask``: [batch, L] with left padding. The prompt is prefilled eagerly into ``cache``
    (a fresh ``ZipKVCache.from_model`` sized for the batch if None); then every step: ``cache.begin_step()`` on the
    host, one model call for one token per sequence. Returns the tokens [batch, L + new] (after ``eos_token_id`` a
    finished sequence repeats it), and the per-step logits [batch, new, vocab] if ``return_logits``.
    """
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError("model must use the 'zipkv' attention: call torch_zipkv.enable(model) first")
    check_model(model)  # a model loaded with attn_implementation="zipkv" has not been through enable
    check_int("max_new_tokens", max_new_tokens, 1)
    check_int("eos_token_id", eos_token_id, 0, optional=True)
    if cache is not None and not isinstance(cache, ZipKVCache):
        raise TypeError(f"cache must be a ZipKVCache or None, got {type(cache).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    batch, length = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got "
                         f"{tuple(attention_mask.shape)}")
    if cache is None:
        cache = ZipKVCache.from_model(model, batch_size=batch, max_length=length + max_new_tokens,
                                      max_new_tokens=max_new_tokens)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    cache_kw = {cache_kwarg(model): cache}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                   **cache_kw).logits[:, -1]

    def step(token, position):
        return model(input_ids=token, position_ids=position, use_cache=True, **cache_kw).logits[:, -1]

    if compile:
        step = torch.compile(step, fullgraph=True, mode=compile if isinstance(compile, str) else None)
    tokens, seen, done = [input_ids], [], torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    # Stepped on the device: a tensor built from a host int each step would be a blocking copy that waits for the
    # queued step, and the host could no longer run ahead of the GPU.
    position = position_ids[:, -1:] + 1
    for t in range(max_new_tokens):
        seen.append(logits)
        if do_sample:
            probs = torch.softmax(logits.float() / temperature, -1)
            token = torch.multinomial(probs, 1, generator=generator)
        else:
            token = logits.argmax(-1, keepdim=True)
        if eos_token_id is not None:
            token = torch.where(done[:, None], torch.full_like(token, eos_token_id), token)
            done |= token[:, 0] == eos_token_id
        tokens.append(token)
        if t + 1 == max_new_tokens or (eos_token_id is not None and bool(done.all())):
            break
        cache.begin_step()
        logits = step(token, position)
        if compile:  # a CUDA Graph's output buffer is rewritten by the next replay: keep this step's own copy
            logits = logits.clone()
        position = position + 1
    out = torch.cat(tokens, 1)
    return (out, torch.stack(seen, 1)) if return_logits else out


def cache_kwarg(model) -> str:
    """The keyword under which ``model``'s ``forward`` and ``generate`` take a cache: ``"cache"`` from transformers
    5.24 on (which still takes ``past_key_values`` with a FutureWarning), ``"past_key_values"`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def enable(model):
    """Switch ``model`` (a transformers ``PreTrainedModel``) to the "zipkv" attention, in place; returns it.
    ValueError, with the model left as it was, for a model the compressed cache cannot serve (:func:`check_model`)."""
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    check_model(model)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise RuntimeError(f"{type(model).__name__} kept attn_implementation={model.config._attn_implementation!r}: "
                           "it does not dispatch attention through transformers' AttentionInterface")
    return model


AttentionInterface.register(ATTN_IMPLEMENTATION, zipkv_attention_forward)
def zipkv_mask(batch_size: int, q_length: int, kv_length: int, *args, **kwargs):
    """transformers mask function "zipkv": SDPA's mask for prefill; none for a decode step on a ZipKVCache, where
    paged_decode attends to exactly each sequence's stored tokens (pads never enter the cache). A ZipKVCache's mask
    spans the new token only (``get_mask_sizes``); a decode step whose mask spans more keys runs on another cache
    (transformers' default one), whose SDPA needs the mask to skip the pads."""
    if q_length == 1 and kv_length == 1:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, *args, **kwargs)


AttentionMaskInterface.register(ATTN_IMPLEMENTATION, zipkv_mask)
