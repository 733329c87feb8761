"""save_blocks / load_blocks against what they must do, on random shapes.

Each example draws a cache layout (vLLM NHD, HND or MLA; SGLang
layer_first, page_first or page_first_direct, MHA or MLA), a geometry (layers,
heads, head groups, head size, page tokens), a tensor-parallel degree and
rank, the load unit size, verified or unverified reads and a DRAM tier or
none.  It saves a few runs from random pages of a source cache, deletes one
of them at times, and loads a random sequence of keys (stored ones in any
order, runs entered in the middle, a missing key somewhere) into random
pages of a rank's cache.  What must hold (README "KV tensors ..."):

- the load returns the stored prefix of the keys: up to the first key
  that is not stored;
- each loaded page holds, for every layer and KV part, the source page's
  tokens of the rank's heads (``tp_size`` ranks split the KV heads; beyond
  the head count each head is replicated over ``tp_size / heads`` ranks);
- no other page of the rank's cache is written.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvblock import Geometry, KVStore, create_file  # noqa: E402
from kvblock.tensors import SGLangHostLayout, VLLMLayout, load_blocks, save_blocks  # noqa: E402

PAGES = 12          # pages in each cache
EXAMPLES = int(os.environ.get("KVBLOCK_MODEL_EXAMPLES", "25")) * 4

LAYOUTS = ["vllm-NHD", "vllm-HND", "vllm-mla", "sglang-layer_first", "sglang-page_first",
           "sglang-page_first_direct", "sglang-layer_first-mla", "sglang-page_first-mla",
           "sglang-page_first_direct-mla"]


def _cache(kind: str, g: Geometry, heads: int, fill: bool, seed: int):
    """A cache of PAGES pages holding ``heads`` KV heads, and its layout."""
    L, bs, d = g.num_layers, g.block_tokens, g.head_dim

    def t(*shape):
        if not fill:
            return torch.zeros(*shape, dtype=torch.bfloat16)
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)
    if kind.startswith("vllm"):
        order = kind.split("-")[1]
        if order == "mla":
            return VLLMLayout([t(PAGES, bs, d) for _ in range(L)], mla=True)
        shape = (2, PAGES, bs, heads, d) if order == "NHD" else (2, PAGES, heads, bs, d)
        return VLLMLayout([t(*shape) for _ in range(L)], order)
    _, layout, *mla = kind.split("-")
    mla = bool(mla)
    lead = () if mla else (2,)
    shape = {"layer_first": (*lead, L, PAGES * bs, heads, d),
             "page_first": (*lead, PAGES * bs, L, heads, d),
             "page_first_direct": (*lead, PAGES, L, bs, heads, d)}[layout]
    return SGLangHostLayout(t(*shape), layout, bs, mla=mla)


def _page(layout, layer: int, part: int, page: int):
    """(block_tokens, heads, head_dim) of one page, as int16 (bf16's bits)."""
    return layout.layer_views(layer)[part][page].view(torch.int16)


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(LAYOUTS))
    mla = kind.endswith("mla")
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0]))
    g = Geometry(draw(st.integers(1, 3)), heads, draw(st.sampled_from([64, 128])),
                 "bfloat16", draw(st.sampled_from([1, 4, 16])), 1 if mla else 2, groups)
    # TP degrees the store serves: the heads split over the ranks, as many or
    # more ranks than groups (part of one group) or fewer (whole groups), or
    # more ranks than heads (each head replicated).
    tps = [tp for tp in (1, 2, 4) if heads % tp == 0 and (tp % groups == 0 or groups % tp == 0)]
    tps += [heads * k for k in (2, 4)]
    tp = draw(st.sampled_from(tps))
    rank = draw(st.integers(0, tp - 1))
    runs = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    return kind, g, tp, rank, runs


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases(), data=st.data(), unit=st.sampled_from([4096, 12288, 8 << 20]),
       verify=st.sampled_from(["always", "never"]), dram=st.booleans())
def test_loads_answer_as_the_model(tmp_path_factory, case, data, unit, verify, dram):
    kind, g, tp, rank, runs = case
    path = tmp_path_factory.getbasetemp() / "transfer-model.img"
    if not path.exists():
        create_file(path, 64 << 20)        # formatted again (force) by each example
    options = {"host_cache_bytes": 64 * g.block_bytes} if dram else {}
    src = _cache(kind, g, g.num_kv_heads, True, seed=data.draw(st.integers(0, 1 << 16)))
    if tp > g.num_kv_heads:
        width, first = 1, rank // (tp // g.num_kv_heads)
    else:
        width = g.num_kv_heads // tp
        first = rank * width
    dst = _cache(kind, g, width, False, seed=0)
    where: dict[bytes, int] = {}                 # stored key -> its source page
    run_keys = []
    with mock.patch("kvblock.tensors.transfer.UNIT_BYTES", unit), \
            KVStore.format([str(path)], g, region_size=1 << 20, force=True, verify=verify,
                           **options) as store:
        for r, n in enumerate(runs):
            keys = [b"r%d-%d" % (r, k) for k in range(n)]
            pages = data.draw(st.permutations(range(PAGES)))[:n]
            assert save_blocks(store, keys, src, pages) == n
            where.update(zip(keys, pages))
            run_keys.append(keys)
        if len(runs) > 1 and data.draw(st.booleans()):
            gone = data.draw(st.sampled_from(run_keys))
            store.delete(gone[:1])               # a delete takes the whole run
            for k in gone:
                del where[k]
        stored = list(where)
        keys = data.draw(st.lists(st.sampled_from(stored), unique=True, max_size=PAGES - 1)) \
            if stored else []
        if data.draw(st.booleans()):
            keys.insert(data.draw(st.integers(0, len(keys))), b"missing")
        if not keys:
            keys = [b"missing"]
        ids = data.draw(st.permutations(range(PAGES)))[:len(keys)]
        handle = load_blocks(store, keys, dst, ids, tp_rank=rank, tp_size=tp)
        got = handle.wait()
    want = keys.index(b"missing") if b"missing" in keys else len(keys)
    assert got == want, (got, want, keys)
    for layer in range(g.num_layers):
        for part in range(g.kv_parts):
            for k in range(got):
                a = _page(src, layer, part, where[keys[k]])[:, first:first + width]
                assert torch.equal(_page(dst, layer, part, ids[k]), a), (layer, part, k)
            for page in set(range(PAGES)) - set(ids[:got]):
                assert not _page(dst, layer, part, page).any(), (layer, part, page)
