"""Adapters from engines' KV cache layouts to per-layer page views.

``layer_views(layer)`` returns, for each KV part (K and V, or MLA's single
latent), a view of shape ``(num_pages, block_tokens, heads, head_dim)`` into
the engine's own memory (no copy), so that ``view[page_ids]`` gathers pages
and ``view[page_ids] = x`` scatters them.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import numpy as np

from kvblock.errors import ConfigError
from kvblock.units import is_whole


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _permute(x, order):
    return x.permute(*order) if _is_torch(x) else x.transpose(order)


def _is_float(name: str) -> bool:
    return name.startswith(("float", "bfloat"))


def _layers(caches, what: str) -> list:
    if isinstance(caches, Mapping):
        # vLLM v1 hands connectors {layer name: tensor}: its keys are no layers
        raise ConfigError(f"{what} is a {type(caches).__name__} (layer names to tensors?); "
                          "pass one cache tensor per layer, in layer order, e.g. "
                          "list(kv_caches.values())")
    caches = _as_list(caches, what)
    if not caches:
        raise ConfigError(f"{what} has no layers: pass one cache tensor per layer")
    return _arrays(caches, what)


def _as_list(caches, what: str) -> list:
    """``caches`` as a list: None (caches not allocated yet) failed in
    list() with a TypeError naming neither the layout nor the fix."""
    try:
        return list(caches)
    except TypeError:
        raise ConfigError(f"{what} is {type(caches).__name__}, not a sequence of layers: pass "
                          "one cache tensor per layer, in layer order") from None


def _arrays(caches: list, what: str) -> list:
    """``caches``, each checked to be an array (a shape and a dtype): the
    layouts read them, and None (a DynamicCache layer the model has not
    filled yet) failed with an AttributeError naming neither."""
    for layer, c in enumerate(caches):
        if not isinstance(getattr(c, "shape", None), tuple) or not hasattr(c, "dtype"):
            raise ConfigError(f"{what} layer {layer} is {type(c).__name__}, not an array: "
                              "pass one cache tensor per layer (a Hugging Face cache: run "
                              "the model over the prompt first, so every layer holds KV)")
    return caches


def _page_tokens(value, name: str) -> int:
    """A page size as an int: 0 would divide by zero at the first copy."""
    n = operator.index(value) if is_whole(value, index=True) else 0
    if n < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return n


def _split_tokens(x, page_tokens, what: str):
    """(tokens, ...) -> (tokens // page_tokens, page_tokens, ...); ``what``:
    the cache, for the error."""
    tokens = x.shape[0]
    if tokens % page_tokens:
        raise ConfigError(f"{what} holds {tokens} token slots, not a multiple of page_size "
                          f"{page_tokens}: pass the page_size the pool was made with (SGLang's "
                          "host pools hold whole pages)")
    return x.reshape(tokens // page_tokens, page_tokens, *x.shape[1:])


class CacheLayout:
    """Base: subclasses implement ``layer_views`` and set ``num_layers``,
    ``kv_parts``, ``block_tokens``, ``heads`` and ``head_dim``."""

    num_layers: int
    kv_parts: int
    block_tokens: int
    heads: int
    head_dim: int

    def layer_views(self, layer: int) -> list:
        raise NotImplementedError

    def sample(self):
        """One of the cache's arrays (for dtype and device)."""
        return self.layer_views(0)[0]

    def pages_note(self, page: int, what: str) -> str:
        """Why ``page`` (past the cache's pages) is none, for the error."""
        return ""

    def _describe(self) -> str:
        """The layout, for errors."""
        return f"{type(self).__name__} cache layout"

    def _mismatch_hint(self, want: tuple) -> str:
        """The likely fix of a geometry mismatch (``want``: check()'s tuple)."""
        return ""

    def check(self, geometry, heads: int | None = None, tp_size: int | None = None) -> None:
        """Raise ConfigError unless this cache fits ``geometry`` (``heads``: the
        heads this cache holds, fewer than the geometry's under tensor
        parallelism of ``tp_size`` ranks)."""
        want = (geometry.num_layers, geometry.kv_parts, geometry.block_tokens,
                heads or geometry.num_kv_heads, geometry.head_dim)
        have = (self.num_layers, self.kv_parts, self.block_tokens, self.heads, self.head_dim)
        if want != have:
            names = ("layers", "kv_parts", "block_tokens", "heads", "head_dim")
            # The heads wanted are a rank's share under TP (not the store's
            # count), and a save wants every head (not one rank's)
            shown = [str(w) for w in want]
            if tp_size is None:
                if self.heads < want[3]:
                    shown[3] += "; save_blocks takes a cache of every head, not one rank's"
            elif want[3] != geometry.num_kv_heads:
                shown[3] = (f"{want[3]} per rank of its {geometry.num_kv_heads} at tp_size "
                            f"{tp_size}")
            elif self.heads < want[3]:
                shown[3] += "; a tensor-parallel rank's cache: pass tp_rank and tp_size"
            diff = ", ".join(f"{n} {h} (store: {label})"
                             for n, h, w, label in zip(names, have, want, shown) if h != w)
            raise ConfigError(f"{self._describe()} does not match the store's geometry: "
                              f"{diff}{self._mismatch_hint(want)}")
        x = self.sample()
        itemsize = x.element_size() if hasattr(x, "element_size") else x.itemsize
        if itemsize != geometry.itemsize:
            raise ConfigError(f"cache elements are {itemsize} bytes, the store's {geometry.dtype} "
                              f"are {geometry.itemsize}")
        # Bytes move as they lie in memory: a numpy array of the other byte
        # order ('>f2') would store (or receive) every element byte-swapped.
        if isinstance(x.dtype, np.dtype) and not x.dtype.isnative:
            raise ConfigError(f"cache holds {x.dtype} elements in non-native byte order; the "
                              f"store's {geometry.dtype} is in the machine's: pass "
                              "arr.astype(arr.dtype.newbyteorder('='))")
        # Bytes move as raw bits: another float type of the same size
        # (float16 vs bfloat16) would be read back as garbage values.
        # Integer caches stand for raw bytes (numpy has no bfloat16).
        name = str(x.dtype).removeprefix("torch.")
        if name != geometry.dtype and _is_float(name) and _is_float(geometry.dtype):
            raise ConfigError(f"cache holds {name}, the store's KV is {geometry.dtype}: its bits "
                              f"would be read as the other type; use a {geometry.dtype} cache "
                              "or a store formatted for " + name)


class VLLMLayout(CacheLayout):
    """vLLM's paged KV cache: one tensor per layer of shape
    ``(2, num_blocks, block_size, num_kv_heads, head_size)`` ("NHD"),
    ``(2, num_blocks, num_kv_heads, block_size, head_size)`` ("HND"), or
    ``(num_blocks, block_size, head_size)`` for MLA."""

    def __init__(self, kv_caches: list, order: str = "NHD", mla: bool = False):
        if order not in ("NHD", "HND"):
            raise ConfigError(f"vLLM cache order must be NHD or HND, got {order!r}")
        self.caches, self.order, self.mla = _layers(kv_caches, "vLLM cache"), order, mla
        shape, dtype = tuple(self.caches[0].shape), str(self.caches[0].dtype)
        for layer, c in enumerate(self.caches):
            if tuple(c.shape) != shape:   # page ids are checked against layer 0's
                raise ConfigError(f"vLLM layer {layer} cache has shape {tuple(c.shape)}, layer 0 "
                                  f"{shape}; every layer must hold as many pages of one shape")
            if str(c.dtype) != dtype:     # check() sees layer 0's element size only
                raise ConfigError(f"vLLM layer {layer} cache has dtype {c.dtype}, layer 0 "
                                  f"{dtype}; every layer must hold the store's dtype")
        self.num_layers = len(self.caches)
        if mla:
            if len(shape) != 3:
                raise ConfigError(f"vLLM MLA cache must be (blocks, block_size, dim), got {shape}")
            self.kv_parts, self.block_tokens, self.heads, self.head_dim = 1, shape[1], 1, shape[2]
        else:
            if len(shape) != 5 or shape[0] != 2:
                raise ConfigError(f"vLLM cache must be (2, blocks, ...) with 5 dims, got {shape}")
            self.kv_parts, self.head_dim = 2, shape[4]
            self.block_tokens, self.heads = (shape[2], shape[3]) if order == "NHD" \
                else (shape[3], shape[2])

    def _describe(self) -> str:
        kind = "MLA" if self.mla else self.order
        return f"VLLMLayout ({kind}) of shape {tuple(self.caches[0].shape)}"

    def _mismatch_hint(self, want: tuple) -> str:
        # NHD and HND swap the blocks' tokens and heads: a cache of the
        # other order matches with them swapped
        have = (self.num_layers, self.kv_parts, self.heads, self.block_tokens, self.head_dim)
        if self.mla or have != want:
            return ""
        other = "HND" if self.order == "NHD" else "NHD"
        return (f"; its blocks and heads are the other way round: an {other} cache? pass "
                f"order={other!r}")

    def layer_views(self, layer):
        c = self.caches[layer]
        if self.mla:
            return [c.reshape(c.shape[0], c.shape[1], 1, c.shape[2])]
        if self.order == "HND":
            c = _permute(c, (0, 1, 3, 2, 4))
        return [c[0], c[1]]


class SGLangHostLayout(CacheLayout):
    """SGLang's host KV pool: ``layer_first (2, L, size, H, D)``, ``page_first
    (2, size, L, H, D)``, ``page_first_direct (2, pages, L, page_size, H, D)``;
    MLA pools drop the leading 2 (``(L, size, 1, D)`` / ``(size, L, 1, D)`` /
    ``(pages, L, page_size, 1, D)``)."""

    LAYOUTS = ("layer_first", "page_first", "page_first_direct")
    _SHAPES = {"layer_first": ("(L, size, 1, D)", "(2, L, size, H, D)"),
               "page_first": ("(size, L, 1, D)", "(2, size, L, H, D)"),
               "page_first_direct": ("(pages, L, page_size, 1, D)",
                                     "(2, pages, L, page_size, H, D)")}

    def __init__(self, kv_buffer, layout: str, page_size: int, mla: bool = False):
        if layout not in self.LAYOUTS:
            raise ConfigError(f"SGLang layout must be one of {self.LAYOUTS}, got {layout!r}")
        page_size = _page_tokens(page_size, "SGLang page_size")
        self.buf, self.layout, self.block_tokens, self.mla = kv_buffer, layout, page_size, mla
        # A pool of another layout's rank (page_first_direct's 6 dims as
        # page_first) would be cut into views of other dims than the pages'
        # (pages, tokens, heads, dim): a load broadcast each block over many
        # pool pages.  MHA pools hold K and V in front.
        # (a pool without a shape, None or a list of K and V, is none either:
        # a ConfigError, not an AttributeError)
        shape = getattr(kv_buffer, "shape", None)
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else None  # torch.Size: a tuple
        dims = (4 if mla else 5) + (layout == "page_first_direct")
        if shape is None or len(shape) != dims or (not mla and shape[0] != 2):
            raise ConfigError(f"SGLang {'MLA' if mla else 'MHA'} pool of shape {shape} does not "
                              f"fit layout {layout!r}: expected "
                              f"{self._SHAPES[layout][0 if mla else 1]}")
        parts = [kv_buffer] if mla else [kv_buffer[0], kv_buffer[1]]
        self.parts = parts
        shape = tuple(parts[0].shape)
        self.kv_parts = len(parts)
        self.num_layers = shape[1] if layout != "layer_first" else shape[0]
        self.heads, self.head_dim = shape[-2], shape[-1]
        if layout == "page_first_direct" and (len(shape) != 5 or shape[2] != page_size):
            raise ConfigError(f"SGLang page_first_direct pool of shape {tuple(kv_buffer.shape)} "
                              f"holds {shape[2] if len(shape) == 5 else '?'}-token pages, not "
                              f"page_size {page_size}; pass the pool's page size")

    def layer_views(self, layer):
        views = []
        what = f"SGLang {self.layout} pool of shape {tuple(self.buf.shape)}"
        for p in self.parts:
            if self.layout == "layer_first":
                views.append(_split_tokens(p[layer], self.block_tokens, what))
            elif self.layout == "page_first":
                views.append(_split_tokens(p[:, layer], self.block_tokens, what))
            else:
                views.append(p[:, layer])
        return views


class HFDynamicLayout(CacheLayout):
    """A Hugging Face ``DynamicCache`` (batch 1): per layer K and V tensors of
    shape ``(1, heads, tokens, head_dim)``; pages are consecutive
    ``block_tokens`` token spans (page i = tokens [i*T, (i+1)*T))."""

    def __init__(self, keys: list, values: list, block_tokens: int):
        self.keys = _layers(keys, "HFDynamicLayout")
        self.values = _arrays(_as_list(values, "HFDynamicLayout values"),
                              "HFDynamicLayout values")
        self.block_tokens = _page_tokens(block_tokens, "HFDynamicLayout block_tokens")
        # Its pages are torch views (permute, _StridedPages): a numpy or cupy
        # array failed at the first layer_views with an AttributeError.
        for name, ts in (("keys", self.keys), ("values", self.values)):
            for layer, t in enumerate(ts):
                if not _is_torch(t):
                    raise ConfigError(
                        f"HFDynamicLayout layer {layer} {name} are a "
                        f"{type(t).__module__}.{type(t).__name__}, not a torch tensor; a "
                        "Hugging Face cache holds torch tensors (for numpy pages use "
                        "VLLMLayout or SGLangHostLayout)")
        if len(self.keys[0].shape) != 4:
            raise ConfigError(f"HFDynamicLayout: layer 0 keys have shape "
                              f"{tuple(self.keys[0].shape)}, not (1, heads, tokens, head_dim)")
        b, self.heads, tokens, self.head_dim = self.keys[0].shape
        if b != 1:
            raise ConfigError(f"HFDynamicLayout holds batch 1, got batch {b}")
        if len(self.values) != len(self.keys):
            raise ConfigError(f"HFDynamicLayout: {len(self.keys)} key tensors but "
                              f"{len(self.values)} value tensors")
        # Every layer is cut into pages as layer 0 is: a layer of other
        # tokens (a sliding-window layer) would be copied past its end.
        want, dtype = tuple(self.keys[0].shape), str(self.keys[0].dtype)
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            for name, t in (("keys", k), ("values", v)):
                if tuple(t.shape) != want:
                    raise ConfigError(_shape_differs(layer, name, tuple(t.shape), want))
                # check() sees layer 0's keys only: another element size would
                # be paged with their strides, past the tensor's rows
                if str(t.dtype) != dtype:
                    raise ConfigError(
                        f"HFDynamicLayout: layer {layer} {name} have dtype {t.dtype}, layer 0 "
                        f"keys {dtype}; every layer must hold the store's dtype")
        self.num_layers, self.kv_parts = len(self.keys), 2
        self.tokens = tokens

    @classmethod
    def from_cache(cls, cache, block_tokens: int) -> "HFDynamicLayout":
        # A layer's tensors are its tokens from token 0 only when they hold
        # as many as it has seen: a sliding-window layer past its window
        # (or a quantized one) holds its last tokens, which would be saved
        # as the prompt's first blocks; a static layer's tensors run past
        # its tokens (zeros, or stale after a crop), paged as KV.
        keys, values = [], []
        for i, layer in enumerate(cache.layers):
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            seen = getattr(layer, "get_seq_length", None)
            held = k.shape[-2] if getattr(k, "ndim", 0) == 4 else None
            if held is not None and seen is not None:
                seen = int(seen())
                if held < seen:
                    raise ConfigError(
                        f"HFDynamicLayout.from_cache: layer {i} ({type(layer).__name__}) holds "
                        f"the last {held} of its {seen} tokens, not its tokens from token 0: "
                        "its pages would be saved as the prompt's first blocks; save from a "
                        "DynamicCache of full-attention layers (a sliding-window or quantized "
                        "layer cannot be paged)")
                k, v = k[:, :, :seen], v[:, :, :seen]
            keys.append(k)
            values.append(v)
        return cls(keys, values, block_tokens)

    @classmethod
    def empty(cls, num_layers, heads, tokens, head_dim, block_tokens, dtype, device="cpu"):
        import torch

        # The store's dtype is a name (g.dtype): torch.zeros refused it
        # with a TypeError naming neither the layout nor the fix
        if isinstance(dtype, str):
            name = dtype
            dtype = getattr(torch, name.removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise ConfigError(f"HFDynamicLayout.empty: dtype {name!r} is no torch dtype; "
                                  "pass the store's (geometry.dtype) or a torch.dtype")
        make = lambda: torch.zeros(1, heads, tokens, head_dim, dtype=dtype, device=device)  # noqa: E731
        return cls([make() for _ in range(num_layers)], [make() for _ in range(num_layers)],
                   block_tokens)

    def pages_note(self, page: int, what: str) -> str:
        # Only whole blocks are pages: a cache of 3 blocks and 5 tokens
        # read as "page 3 is outside the cache's 3 pages", naming neither
        # the tokens left over nor that a partial block is never stored.
        bt, whole = self.block_tokens, self.tokens // self.block_tokens
        rest = self.tokens - whole * bt
        note = f" (its {self.tokens} tokens hold {whole} whole {bt}-token blocks"
        if rest:
            note += f"; the last {rest} tokens are a partial block, which is not stored"
        if what == "save":
            pages = f"pages 0-{whole - 1}" if whole else "none yet"
            return note + f": save whole blocks only, a key per whole block ({pages}))"
        return note + f": page {page} needs a cache of at least {(page + 1) * bt} tokens)"

    def layer_views(self, layer):
        out = []
        for t in (self.keys[layer], self.values[layer]):
            full = self.tokens // self.block_tokens * self.block_tokens
            x = t[0, :, :full].permute(1, 0, 2)                  # (tokens, heads, dim)
            out.append(x.reshape(full // self.block_tokens, self.block_tokens, self.heads,
                                 self.head_dim) if x.is_contiguous() else
                       _StridedPages(t, self.block_tokens, full))
        return out

    def to_cache(self):
        """A DynamicCache holding these tensors (for model.forward)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            cache.update(k, v, layer)
        return cache


def _shape_differs(layer: int, name: str, shape: tuple, want: tuple) -> str:
    """Why an HF layer's tensors of ``shape`` cannot be paged with layer 0's
    keys (``want``): what differs, and what kind of model has it."""
    if len(shape) != len(want) or shape[0] != want[0]:
        return (f"HFDynamicLayout: layer {layer} {name} have shape {shape}, layer 0 keys "
                f"{want}; every layer's keys and values must be (1, heads, tokens, head_dim), "
                "batch 1")
    dims = [(n, h, w) for n, h, w in zip(("heads", "tokens", "head_dim"), shape[1:], want[1:])
            if h != w]
    msg = (f"HFDynamicLayout: layer {layer} {name} have shape {shape}, layer 0 keys "
           f"{want}: " + ", ".join(f"{n} {h}, not {w}" for n, h, w in dims))
    if [n for n, _, _ in dims] == ["tokens"]:
        # a layer of other tokens: a sliding-window one past its window
        return msg + ("; every layer must hold the same tokens (a sliding-window layer "
                      "cannot be paged with the others)")
    # values of another head size than the keys (MLA expanded), or layers
    # of other heads: no one (heads, head_dim) describes every page
    return msg + ("; a model whose layers, keys and values differ in heads or head size "
                  "cannot be paged as one geometry (one heads x head_dim for every layer's "
                  "K and V)")


class _StridedPages:
    """Pages of a (1, heads, tokens, dim) tensor: reshaping its (tokens, heads,
    dim) permutation into pages needs a copy, so index it explicitly instead."""

    def __init__(self, t, block_tokens, full):
        self.t, self.bt = t, block_tokens
        self.shape = (full // block_tokens, block_tokens, t.shape[1], t.shape[3])
        self.dtype = t.dtype

    def element_size(self):
        return self.t.element_size()

    def _tokens(self, ids):
        import torch

        ids = torch.as_tensor(ids, dtype=torch.long, device=self.t.device)
        return (ids[:, None] * self.bt + torch.arange(self.bt, device=self.t.device)).reshape(-1)

    def __getitem__(self, ids):
        tok = self._tokens(ids)
        x = self.t[0][:, tok]                                   # (heads, n*bt, dim)
        return x.permute(1, 0, 2).reshape(len(tok) // self.bt, self.bt, *self.shape[2:])

    def __setitem__(self, ids, value):
        tok = self._tokens(ids)
        self.t[0][:, tok] = value.reshape(len(tok), *self.shape[2:]).permute(1, 0, 2)
