"""Hugging Face transformers: a DynamicCache whose layers are restored from
kvblock while the model runs.

``streaming_cache(handle, layout, length)`` returns a cache that already
reports the restored length (so masks and positions are right from the
start) and makes each attention layer wait only for its own layer: layer 0
computes while later layers are still being read.  New tokens are written in
place into the layout's spare capacity (tensors larger than ``length``)
instead of concatenated, so no layer's KV is copied to fresh memory.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvblock.tensors import HFDynamicLayout, LoadHandle


class _RestoringLayer(DynamicLayer):
    def __init__(self, handle: LoadHandle, layer: int, keys, values, length: int):
        super().__init__()
        self.handle, self.layer = handle, layer
        self._k, self._v, self.length = keys, values, length
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        self.device = keys.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.handle.wait_layer(self.layer)
        n = key_states.shape[-2]
        if self.length + n > self._k.shape[-2]:      # out of spare room: grow by concatenation
            self._k = torch.cat([self._k[:, :, :self.length], key_states], dim=-2)
            self._v = torch.cat([self._v[:, :, :self.length], value_states], dim=-2)
        else:
            self._k[:, :, self.length:self.length + n] = key_states
            self._v[:, :, self.length:self.length + n] = value_states
        self.length += n
        self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]
        return self.keys, self.values


def streaming_cache(handle: LoadHandle, layout: HFDynamicLayout,
                    length: int | None = None) -> DynamicCache:
    """A cache over ``layout``'s tensors holding ``length`` restored tokens
    (default: all of them), filled layer by layer by ``handle``."""
    length = layout.tokens if length is None else length
    cache = DynamicCache()
    cache.layers = [_RestoringLayer(handle, layer, layout.keys[layer], layout.values[layer],
                                    length) for layer in range(layout.num_layers)]
    return cache
