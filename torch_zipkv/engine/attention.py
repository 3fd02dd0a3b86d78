"""The engine's transformers ``Cache``: what one model call of the engine appends to the paged cache and attends to.

The engine runs the model's own forward with the "zipkv" attention (``torch_zipkv.enable``). That attention function
hands its work to the ``zipkv_cache`` the cache's ``update`` put in the attention kwargs (see
``torch_zipkv/integrations/transformers.py``), here an :class:`EngineCache`, which is in one of two modes per call:

- ``decode``: one token per batch row, through the cache's own decode path (``step_append`` and ``step_decode``, as
  ``ZipKVCache`` does) on the ``DecodeStep`` the engine set: the one ``prepare_step`` made, or a CUDA Graph's static
  step (``CompressedPagedKVCache.static_step``, padded rows included);
- ``prefill``: one chunk of each of several requests, their tokens one after another in one row of the batch, on
  the ``PrefillStep`` the engine prepared for every layer (``prepare_prefill``). In each layer the chunks' K/V are
  appended to their requests' pages (``step_append``), then every chunk attends to its own request's tokens
  causally, with the layer's sliding window and Gemma 2's logit soft cap, straight from the pages as they are stored
  (``step_prefill``, the ``paged_prefill`` op): nothing is decompressed into scratch, and a layer does no host
  bookkeeping. Only attention mixes tokens, and it keeps to each request's own; positions come from
  ``position_ids``.
"""

from __future__ import annotations

import torch
from transformers import Cache

from ..cache import CompressedPagedKVCache, DecodeStep, PrefillStep
from ..integrations.transformers import _PagedLayer, hand_to_attention


class _EngineLayer(_PagedLayer):
    """A layer of :class:`EngineCache`. The engine passes ``position_ids`` and the attention builds its own masks, so
    every answer is a constant: nothing per step for a captured graph to depend on."""

    def get_seq_length(self) -> int:
        return 0


class EngineCache(Cache):
    """A transformers ``Cache`` over the engine's :class:`~torch_zipkv.CompressedPagedKVCache` (``kv``). The engine
    sets the mode before each model call: :meth:`for_decode` or :meth:`for_prefill`."""

    def __init__(self, kv: CompressedPagedKVCache):
        super().__init__(layers=[_EngineLayer() for _ in range(kv.num_layers)])
        self.kv = kv
        self.mode: str | None = None
        self.step: DecodeStep | PrefillStep | None = None

    def for_decode(self, step: DecodeStep) -> None:
        self.mode, self.step = "decode", step

    def for_prefill(self, step: PrefillStep) -> None:
        """The next call prefills the new tokens of ``step`` (from ``prepare_prefill``), its chunks' tokens one after
        another."""
        self.mode, self.step = "prefill", step

    # ---- transformers' Cache interface ---------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        hand_to_attention(self, layer_idx, key_states, kwargs)
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_croppable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("the engine's cache does not support beam search")

    # ---- attention -----------------------------------------------------------------------------------------------
    def attend(self, module, query, key, value, attention_mask, *, scaling, sliding_window, softcap, kwargs):
        """``query`` [B, Hq, L, D], ``key``/``value`` [B, Hkv, L, D] -> ``(out [B, L, Hq, D], None)``."""
        layer = module.layer_idx
        kv = self.kv
        if query.dtype != torch.bfloat16 or key.dtype != torch.bfloat16:
            raise ValueError(f"the engine needs a bfloat16 model, got query {query.dtype} and key {key.dtype}")
        if kv.sliding_window[layer] != sliding_window:
            raise ValueError(f"layer {layer} attends with sliding_window={sliding_window}, the engine's cache has "
                             f"{kv.sliding_window[layer]}")
        if self.mode == "decode":  # [B, H, 1, D] -> [B, H, D]
            kv.step_append(layer, self.step, key[:, :, 0].contiguous(), value[:, :, 0].contiguous())
            out = kv.step_decode(layer, self.step, query[:, :, 0].contiguous(), sm_scale=scaling,
                                 logits_soft_cap=float(softcap or 0.0))
            return out.unsqueeze(1), None
        if self.mode != "prefill":
            raise RuntimeError("EngineCache used outside the engine's step (no mode set)")
        return self._prefill_chunk(module, layer, query, key, value, scaling, sliding_window, softcap)

    def _prefill_chunk(self, module, layer, query, key, value, scaling, window, softcap):
        tokens = self.step.page_ids.shape[0]
        if query.shape[0] != 1 or query.shape[2] != tokens:
            raise ValueError(f"a prefill is one row of the chunks' {tokens} tokens, got query of shape "
                             f"{tuple(query.shape)}")
        # Append every chunk, then attend to each request's pages in place (earlier chunks compressed or raw, these
        # raw): paged_prefill applies the causal mask per request, the layer's window and the soft cap.
        kv = self.kv
        kv.step_append(layer, self.step, key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous())
        out = kv.step_prefill(layer, self.step, query[0].transpose(0, 1).contiguous(), sm_scale=scaling,
                              logits_soft_cap=float(softcap or 0.0))
        return out[None], None  # [1, total, Hq, D]
