"""torch_zipkv: a losslessly compressed BF16 paged KV cache, with decode attention that reads it directly.

Ops live under ``torch.ops.zipkv`` (schemas in csrc/ops.cpp); :mod:`torch_zipkv.ops` has typed wrappers.
The high-level API:

- :func:`compress` turns BF16 pages ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` into a
  :class:`CompressedKV`; :func:`decompress` returns them bit-exactly.
- :func:`paged_decode` runs decode attention over a :class:`CompressedKV` with a FlashInfer-style page table;
  :func:`decode_plan` tells the CUDA launch (split count, CTA layout) it would make; :func:`paged_prefill` runs
  attention of many query tokens per request (chunked prefill, speculative verification) over the same pages, and
  :func:`prefill_plan` tells which CUDA kernel serves them.
- :func:`empty_storage` allocates the storage the ops write into (``data``, ``meta``, ``cursor``) for a number of
  pages, to drive :mod:`torch_zipkv.ops` directly.
- :class:`CompressedPagedKVCache` keeps a model's KV cache compressed in a byte budget: sequences, appends, page
  tables, compression of full pages, capacity for the scheduler (:class:`CacheFullError` when something won't fit).
- :class:`ZipKVCache` and :func:`enable` (HuggingFace transformers, imported on first use): a transformers ``Cache``
  on the compressed pages and the "zipkv" attention implementation that decodes from them.
"""

import torch  # loads libtorch before our extension


def _load_ops() -> None:
    """Load the compiled ops (registering ``torch.ops.zipkv``), built against this torch release (major.minor): the
    binary links against torch's C++ ABI, which torch does not keep from one minor release to the next
    (docs/install.md)."""
    try:
        from ._build_info import TORCH_VERSION as built_with
    except ImportError:  # a source tree never built: the import below says so
        built_with = None
    def release(version: str) -> tuple[str, ...]:  # major.minor: torch keeps its C++ ABI within patch releases only
        return tuple(version.split("+")[0].split(".")[:2])

    if built_with is not None and release(built_with) != release(torch.__version__):
        raise ImportError(f"torch_zipkv's ops were compiled against torch {built_with} but torch {torch.__version__} "
                          "is running: rebuild them against this torch with `pip install --no-build-isolation .` "
                          "(docs/install.md)")
    try:
        from . import _C  # noqa: F401
    except ImportError as e:
        raise ImportError(f"torch_zipkv's compiled ops (torch_zipkv._C) failed to load under torch "
                          f"{torch.__version__}: {e}. Build them with `pip install --no-build-isolation .` "
                          "(docs/install.md)") from e


_load_ops()
from . import ops  # noqa: E402
from .ops import empty_storage  # noqa: E402
from .cache import CacheFullError, Capacity, CompressedPagedKVCache, DecodeStep, PrefillStep  # noqa: E402
from .compressed_kv import (CompressedKV, compress, decode_plan, decompress, paged_decode, paged_prefill,  # noqa: E402
                            prefill_plan)
from .format import FORMAT_VERSION  # noqa: E402

__all__ = ["CompressedKV", "compress", "decompress", "paged_decode", "paged_prefill", "decode_plan", "prefill_plan",
           "empty_storage", "ops", "FORMAT_VERSION", "CompressedPagedKVCache", "CacheFullError", "Capacity",
           "DecodeStep", "PrefillStep", "ZipKVCache", "enable", "generate"]

_TRANSFORMERS_NAMES = ("ZipKVCache", "enable", "generate")


def __getattr__(name: str):
    # transformers takes seconds to import: load the integration only when one of its names is asked for.
    if name in _TRANSFORMERS_NAMES:
        from .integrations import transformers as hf

        return getattr(hf, name)
    raise AttributeError(f"module 'torch_zipkv' has no attribute {name!r}")
