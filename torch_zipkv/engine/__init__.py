"""Continuous batching over a transformers causal LM on the compressed paged KV cache (docs/engine.md).

    from torch_zipkv.engine import Engine, SamplingParams
    eng = Engine(model, max_kv_bytes=8 << 30)                 # or memory_fraction=0.8 on CUDA
    outs = eng.generate([prompt_ids, ...], SamplingParams(max_new_tokens=64))
"""

from .engine import Engine
from .params import RequestOutput, SamplingParams

__all__ = ["Engine", "SamplingParams", "RequestOutput"]
