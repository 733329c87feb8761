"""SGLang host KV pools for tests, without SGLang's pool classes.

``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` cannot be imported in the
test process on a CPU machine: ``sglang.srt.mem_cache.pool_host`` imports
``sglang.srt.configs``, whose multimodal configs import ``torchvision``, and
no torchvision release on PyPI loads beside the CPU build of torch 2.13.0
(``operator torchvision::nms does not exist``).  So the in-process tests use
``HostPool``: the same ``kv_buffer`` tensor, of exactly the shape and layout
those classes allocate (``init_kv_buffer`` in ``pool_host/mha.py`` and
``pool_host/mla.py``), with the attributes the backend reads.
``sglang_real_pool_check.py`` builds the real classes in a child process
(with a stand-in ``torchvision`` module that only satisfies that import),
checks that they allocate exactly these shapes, and drives the backend through
them, flat-page methods included.
"""

from __future__ import annotations

import torch


def kv_buffer_shape(mla: bool, layout: str, layers: int, heads: int, head_dim: int,
                    page_size: int, pages: int) -> tuple[int, ...]:
    size = pages * page_size
    if mla:
        return {"layer_first": (layers, size, 1, head_dim),
                "page_first": (size, layers, 1, head_dim),
                "page_first_direct": (pages, layers, page_size, 1, head_dim)}[layout]
    return {"layer_first": (2, layers, size, heads, head_dim),
            "page_first": (2, size, layers, heads, head_dim),
            "page_first_direct": (2, pages, layers, page_size, heads, head_dim)}[layout]


class HostPool:
    """A host pool's geometry and ``kv_buffer`` (what ``register_mem_pool_host``
    hands the backend), filled with random bits."""

    def __init__(self, *, mla: bool = False, layout: str = "page_first", layers: int = 3,
                 heads: int = 2, head_dim: int = 16, page_size: int = 4, pages: int = 24,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0):
        self.layout, self.page_size, self.dtype = layout, page_size, dtype
        self.layer_num, self.page_num, self.size = layers, pages, pages * page_size
        if mla:
            self.kv_cache_dim = head_dim
        else:
            self.head_num, self.head_dim, self.v_head_dim = heads, head_dim, head_dim
        shape = kv_buffer_shape(mla, layout, layers, heads, head_dim, page_size, pages)
        self.kv_buffer = torch.empty(shape, dtype=dtype)
        self.randomize(seed)

    def randomize(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        raw = self.kv_buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))

    def token_indices(self, page_ids) -> torch.Tensor:
        """Host indices of whole pages, as SGLang's controller passes them."""
        ps = self.page_size
        return torch.cat([torch.arange(p * ps, (p + 1) * ps, dtype=torch.int64)
                          for p in page_ids])

    def _page(self, page: int) -> torch.Tensor:
        """A view of one page (all layers, K and V) in ``kv_buffer``."""
        b, ps = self.kv_buffer, self.page_size
        tok = slice(page * ps, (page + 1) * ps)
        mla = hasattr(self, "kv_cache_dim")
        if self.layout == "page_first_direct":
            return b[page] if mla else b[:, page]
        if self.layout == "page_first":
            return b[tok] if mla else b[:, tok]
        return b[:, tok] if mla else b[:, :, tok]

    def page_bytes(self, page: int) -> torch.Tensor:
        """Every byte of one page (all layers, K and V), as a copy."""
        return self._page(page).contiguous().view(torch.uint8).clone()

    def fill_page(self, page: int, data: torch.Tensor) -> None:
        """Write ``data`` (bytes, as page_bytes returns them) into one page."""
        v = self._page(page)
        v.copy_(data.view(self.dtype).view(v.shape))
