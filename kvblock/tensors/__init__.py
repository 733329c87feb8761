"""KV tensors in and out of the store, in the paged layouts engines use.

A layout adapter (:mod:`kvblock.tensors.layouts`) exposes, for one layer, a
``(num_pages, block_tokens, heads, head_dim)`` view per KV part of the
engine's cache (numpy, torch CPU/CUDA, cupy); :mod:`kvblock.tensors.transfer`
gathers pages into the store's contiguous (layer, head group) ranges and
scatters them back, one native row copy (:mod:`kvblock.tensors.pagecopy`) per
part and layer.
"""

from kvblock.tensors.layouts import (
    CacheLayout,
    HFDynamicLayout,
    SGLangHostLayout,
    VLLMLayout,
)
from kvblock.tensors.transfer import LoadHandle, LoadTimeoutError, load_blocks, save_blocks

__all__ = ["CacheLayout", "VLLMLayout", "SGLangHostLayout", "HFDynamicLayout", "save_blocks",
           "load_blocks", "LoadHandle", "LoadTimeoutError"]
