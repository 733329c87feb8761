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

import numbers

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvblock.errors import ConfigError, PartialLoadError
from kvblock.tensors import HFDynamicLayout, LoadHandle


class _RestoringLayer(DynamicLayer):
    def __init__(self, handle: LoadHandle, layer: int, keys, values, length: int,
                 block_tokens: int):
        super().__init__()
        self.handle, self.layer, self.block_tokens = handle, layer, block_tokens
        self._k, self._v, self.length = keys, values, length
        self.restored = length          # leading tokens that come from the load
        self._views()
        self.device = keys.device
        self.is_initialized = True

    def _views(self):
        self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]

    # Read from outside (DynamicCache.__iter__, code reading ``layer.keys``),
    # the tensors are the restored KV only once this layer has arrived.
    @property
    def keys(self):
        self._wait()
        return self._keys

    @keys.setter
    def keys(self, t):
        self._keys = t

    @property
    def values(self):
        self._wait()
        return self._values

    @values.setter
    def values(self, t):
        self._values = t

    def get_seq_length(self) -> int:
        """The restored length counts before the layer arrives (masks, positions)."""
        return self.length

    def _wait(self):
        """This layer's restored tokens are in place, or PartialLoadError:
        the model never attends to KV the load did not deliver (a run that
        failed its checksum, one evicted since the lookup).  A layer reset
        or cropped to none of them waits only for the load's writes to end:
        its error concerns tokens no longer part of the cache."""
        try:
            blocks = self.handle.wait_layer(self.layer)
        except Exception:
            if self.restored == 0:     # a failed load has stopped writing into _k/_v
                return
            raise
        need = -(-self.restored // self.block_tokens)
        if blocks < need:
            raise PartialLoadError(
                f"kvblock: layer {self.layer} has {blocks} of the {need} blocks "
                f"({self.restored} tokens) the cache was built for; a run failed its "
                "checksum or was evicted since the lookup: recompute from token "
                f"{blocks * self.block_tokens}")

    def _check_fits(self, key_states, value_states):
        """The model's new KV is of the layout's kind: another dtype would be
        cast into the spare room (or promoted by the concatenation past it),
        other heads or head size broadcast or fail deep in torch."""
        for name, new, have in (("keys", key_states, self._k), ("values", value_states, self._v)):
            if new.dim() != 4 or new.shape[:2] != have.shape[:2] or \
                    new.shape[-1] != have.shape[-1] or new.dtype != have.dtype or \
                    new.device != have.device:
                raise ConfigError(
                    f"streaming_cache: layer {self.layer}'s new {name} are "
                    f"{tuple(new.shape)} {new.dtype} on {new.device}, the layout holds "
                    f"(batch, heads, tokens, head_dim) {tuple(have.shape)} {have.dtype} on "
                    f"{have.device}: the layout is not of this model's KV (build it with the "
                    "model's KV heads, head size, dtype and device)")

    def update(self, key_states, value_states, *args, **kwargs):
        self._check_fits(key_states, value_states)
        self._wait()
        n = key_states.shape[-2]
        if self.length + n > self._k.shape[-2]:      # out of spare room: grow by concatenation
            self._k = torch.cat([self._k[:, :, :self.length], key_states], dim=-2)
            self._v = torch.cat([self._v[:, :, :self.length], value_states], dim=-2)
        else:
            self._k[:, :, self.length:self.length + n] = key_states
            self._v[:, :, self.length:self.length + n] = value_states
        self.length += n
        self._views()
        return self._keys, self._values

    # DynamicLayer's own versions of these act on ``keys``/``values`` only,
    # which ``update`` rebuilds from ``_k``/``_v`` and ``length``.
    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens "
                             "to remove (as DynamicLayer takes it)")
        self.length = max(0, self.length + tokens_to_remove)
        self.restored = min(self.restored, self.length)
        self._views()

    def reset(self) -> None:
        self.length = self.restored = 0
        self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._wait()
        self._k = self._k.repeat_interleave(repeats, dim=0)
        self._v = self._v.repeat_interleave(repeats, dim=0)
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._wait()
        self._k, self._v = self._k[indices, ...], self._v[indices, ...]
        self._views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # Beam search's reorder after each step: the mixin's version
        # reorders ``keys`` only, which the next update rebuilds from _k/_v.
        self._wait()
        beam_idx = beam_idx.to(self._k.device)
        self._k, self._v = self._k.index_select(0, beam_idx), self._v.index_select(0, beam_idx)
        self._views()


class _StreamingCache(DynamicCache):
    """A DynamicCache of the layout's layers only: a model of more layers
    would get a fresh, empty layer past them (the plain cache's lazy
    growth), attending there to none of the restored prefix.  A model of
    fewer layers never names the layers past its own: its next forward
    (layer 0 updated again after a pass that stopped short of the last
    layer) is refused; streaming_cache(..., config=) refuses it up front.

    A forward that raises in one of the cache's updates (Ctrl-C while a
    layer waits for its KV, a PartialLoadError) leaves no trace: the layers
    it updated are cut back to their length before it, so the same forward
    can be run again.  One that raises in the model's own code after an
    update, which the cache does not see, left its tokens in the layers it
    reached only: without config= the next forward is refused, saying so
    (with it the per-forward check is off: build a new cache after such an
    error)."""

    _top: int | None = None     # the highest layer updated since layer 0 last was
    _known_depth = False        # a forward reached the last layer: the model has its depth
    _before: dict | None = None  # layer: its length before this forward updated it
    # Off when the model's config was checked up front: a pass may then stop
    # short on purpose (early-exit drafting runs the first layers only).
    _guess_depth = True

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise ConfigError(
                f"streaming_cache: the model updates layer {layer_idx}, the layout holds "
                f"{len(self.layers)} layers: the layout is not of this model's KV (build it "
                "with the model's layer count)")
        last = len(self.layers) - 1
        if layer_idx == 0:
            if self._guess_depth and self._top is not None and self._top < last:
                raise ConfigError(_stopped_short(self._top, len(self.layers),
                                                 self._known_depth))
            self._top, self._before = 0, {}
        elif self._top is not None:
            self._top = max(self._top, layer_idx)
        if self._top == last:
            self._known_depth = True
        if self._before is not None:
            self._before.setdefault(layer_idx, self.layers[layer_idx].length)
        try:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException:
            # This forward fails: what it wrote is taken back, and its
            # stop short of the last layer says nothing of the model's depth.
            for layer, length in (self._before or {}).items():
                self.layers[layer].crop(min(0, length - self.layers[layer].length))
            self._top = self._before = None
            raise


def _stopped_short(top: int, layout_layers: int, known_depth: bool) -> str:
    """Why a forward after one that stopped after layer ``top`` is refused."""
    raised = (f"the last forward stopped after layer {top} of the layout's {layout_layers}: "
              f"it raised there, its tokens are in layers 0 to {top} only, and the cache "
              "cannot continue from it (build a new streaming_cache)")
    if known_depth:       # an earlier forward ran every layer
        return f"streaming_cache: {raised}"
    return (f"{_layer_mismatch(top + 1, layout_layers)}; or {raised}; pass config= to "
            "have the layout checked up front")


def _layer_mismatch(model_layers: int, layout_layers: int) -> str:
    return (f"streaming_cache: the model has {model_layers} layers, the layout holds "
            f"{layout_layers}: the layout is not of this model's KV (build it with the "
            "model's layer count: config.num_hidden_layers)")


def _model_layers(config) -> int | None:
    """The decoder layer count of a transformers config (or of a model's)."""
    config = getattr(config, "config", config)      # a model: its config
    text = getattr(config, "get_text_config", None)
    if text is not None:
        try:
            config = text(decoder=True)
        except TypeError:
            config = text()
    n = getattr(config, "num_hidden_layers", None)
    return n if isinstance(n, numbers.Integral) and not isinstance(n, bool) else None


def streaming_cache(handle: LoadHandle, layout: HFDynamicLayout,
                    length: int | None = None, *, config=None) -> DynamicCache:
    """A cache over ``layout``'s tensors holding ``length`` restored tokens
    (default: all of them), filled layer by layer by ``handle``.  A layer
    whose restored tokens did not all arrive (a checksum failure, an
    eviction since the lookup) raises PartialLoadError when the model
    reaches it, instead of attending to what is not there.

    ``config``: the model's config (or the model), as DynamicCache takes
    it; a layout of another layer count is then refused here.  Without it
    the cache learns the model's depth only from its updates: a model of
    more layers is refused at its first update past the layout's, one of
    fewer at its second forward (its first ran on KV not of this model);
    a pass that runs the first layers only on purpose (early-exit
    drafting) then needs ``config``, which turns that guess off."""
    if not isinstance(layout, HFDynamicLayout):
        raise ConfigError(f"streaming_cache: the layout is a {type(layout).__name__}; a "
                          "transformers cache is built over an HFDynamicLayout's tensors "
                          "(HFDynamicLayout.empty(...), loaded into by load_blocks)")
    if config is not None:
        model_layers = _model_layers(config)
        if model_layers is None:
            raise ConfigError(f"streaming_cache: config {type(config).__name__} has no "
                              "num_hidden_layers; pass the model's config (model.config)")
        if model_layers != layout.num_layers:
            raise ConfigError(_layer_mismatch(model_layers, layout.num_layers))
    length = layout.tokens if length is None else length
    # Past the tensors, the layers would later blame the missing tokens on
    # a checksum failure or an eviction (PartialLoadError).
    if isinstance(length, bool) or not isinstance(length, numbers.Integral) or \
            not 0 <= length <= layout.tokens:
        raise ConfigError(f"streaming_cache: length {length!r} is not a token count the "
                          f"layout holds (0 to its {layout.tokens} tokens); pass the tokens "
                          "restored, or a layout with room for them")
    cache = _StreamingCache()
    cache._guess_depth = config is None
    cache.layers = [_RestoringLayer(handle, layer, layout.keys[layer], layout.values[layer],
                                    length, layout.block_tokens)
                    for layer in range(layout.num_layers)]
    return cache
