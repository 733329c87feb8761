"""KV tensors through the store in engines' layouts: bytes identical after a
round trip, any tensor-parallel slice, layer-wise loads that overlap I/O."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvblock import Geometry, KVStore, create_file  # noqa: E402
from kvblock.errors import ConfigError, ServerGoneError  # noqa: E402
from kvblock.index import normalize_keys  # noqa: E402
from kvblock.tensors import (  # noqa: E402
    HFDynamicLayout,
    SGLangHostLayout,
    VLLMLayout,
    load_blocks,
    save_blocks,
)

L, H, D, BS = 3, 8, 16, 16


def geom(kv_parts=2, groups=1, heads=H):
    return Geometry(L, heads, D, "bfloat16", BS, kv_parts, groups)


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "kv.img"
    create_file(p, 16 << 20)
    return str(p)


def _store(path, g, **kw):
    return KVStore.format([path], g, region_size=1 << 20, force=True, **kw)


def rand(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_vllm_round_trip(path, order):
    nb = 12
    shape = (2, nb, BS, H, D) if order == "NHD" else (2, nb, H, BS, D)
    src = [rand(*shape) for _ in range(L)]
    keys = [f"k{i}".encode() for i in range(5)]
    src_pages, dst_pages = [3, 7, 1, 0, 9], [2, 4, 6, 8, 10]
    with _store(path, geom()) as store:
        assert save_blocks(store, keys, VLLMLayout(src, order), src_pages) == 5
        dst = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(L)]
        h = load_blocks(store, keys + [b"missing"], VLLMLayout(dst, order), dst_pages + [11])
        assert h.wait() == 5
    for layer in range(L):
        a = src[layer][:, src_pages]
        b = dst[layer][:, dst_pages]
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert not dst[layer][:, 11].any()  # the miss stays untouched


def test_vllm_mla_and_numpy_cache(path):
    g = Geometry(L, 1, 32, "float16", BS, kv_parts=1)
    src = [np.random.default_rng(i).standard_normal((6, BS, 32)).astype(np.float16)
           for i in range(L)]
    dst = [np.zeros_like(s) for s in src]
    keys = [b"m0", b"m1", b"m2"]
    with _store(path, g) as store:
        save_blocks(store, keys, VLLMLayout(src, mla=True), [5, 0, 2])
        assert load_blocks(store, keys, VLLMLayout(dst, mla=True), [1, 2, 3]).wait() == 3
    for layer in range(L):
        assert np.array_equal(src[layer][[5, 0, 2]], dst[layer][[1, 2, 3]])


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("mla", [False, True])
def test_sglang_host_layouts(path, layout, mla):
    pages, heads = 6, (1 if mla else H)
    g = geom(kv_parts=1 if mla else 2, heads=heads)
    lead = () if mla else (2,)
    shape = {"layer_first": (*lead, L, pages * BS, heads, D),
             "page_first": (*lead, pages * BS, L, heads, D),
             "page_first_direct": (*lead, pages, L, BS, heads, D)}[layout]
    src, dst = rand(*shape), torch.zeros(shape, dtype=torch.bfloat16)
    keys = [b"s0", b"s1", b"s2", b"s3"]
    with _store(path, g) as store:
        save_blocks(store, keys, SGLangHostLayout(src, layout, BS, mla=mla), [0, 2, 4, 5])
        h = load_blocks(store, keys, SGLangHostLayout(dst, layout, BS, mla=mla), [5, 4, 3, 1])
        assert h.wait() == 4
    sv = SGLangHostLayout(src, layout, BS, mla=mla)
    dv = SGLangHostLayout(dst, layout, BS, mla=mla)
    for layer in range(L):
        for a, b in zip(sv.layer_views(layer), dv.layer_views(layer)):
            assert torch.equal(a[[0, 2, 4, 5]].view(torch.int16),
                               b[[5, 4, 3, 1]].view(torch.int16))


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_every_tp_degree_from_one_store(path, groups):
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    keys = [b"t0", b"t1", b"t2"]
    with _store(path, geom(groups=groups)) as store:
        save_blocks(store, keys, VLLMLayout(src), [0, 1, 2])
        for tp in (1, 2, 4, 8):
            per = H // tp
            for rank in range(tp):
                dst = [torch.zeros(2, 4, BS, per, D, dtype=torch.bfloat16) for _ in range(L)]
                h = load_blocks(store, keys, VLLMLayout(dst), [3, 2, 1], tp_rank=rank,
                                tp_size=tp)
                assert h.wait() == 3
                for layer in range(L):
                    want = src[layer][:, [0, 1, 2], :, rank * per:(rank + 1) * per]
                    assert torch.equal(dst[layer][:, [3, 2, 1]].view(torch.int16),
                                       want.view(torch.int16)), (tp, rank, layer)


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_tp_beyond_the_kv_heads_replicates_them(path, groups):
    """More TP ranks than KV heads: engines replicate each head over
    tp_size / heads ranks, so rank r's cache holds head r // (tp / heads)."""
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    keys = [b"p0", b"p1"]
    with _store(path, geom(groups=groups)) as store:
        save_blocks(store, keys, VLLMLayout(src), [0, 1])
        for tp in (16, 32):
            for rank in range(tp):
                dst = [torch.zeros(2, 4, BS, 1, D, dtype=torch.bfloat16) for _ in range(L)]
                h = load_blocks(store, keys, VLLMLayout(dst), [2, 3], tp_rank=rank, tp_size=tp)
                assert h.wait() == 2
                head = rank // (tp // H)
                for layer in range(L):
                    want = src[layer][:, [0, 1], :, head:head + 1]
                    assert torch.equal(dst[layer][:, [2, 3]].view(torch.int16),
                                       want.view(torch.int16)), (tp, rank, layer)
        with pytest.raises(ConfigError, match="do not split over tp_size 12"):
            load_blocks(store, keys, VLLMLayout(src), [0, 1], tp_rank=0, tp_size=12)


def test_mla_latent_is_read_by_every_tp_rank(path):
    g = Geometry(L, 1, 32, "float16", BS, kv_parts=1)
    src = [np.random.default_rng(i).standard_normal((4, BS, 32)).astype(np.float16)
           for i in range(L)]
    with _store(path, g) as store:
        save_blocks(store, [b"l0", b"l1"], VLLMLayout(src, mla=True), [0, 3])
        for rank in range(4):
            dst = [np.zeros_like(x) for x in src]
            h = load_blocks(store, [b"l0", b"l1"], VLLMLayout(dst, mla=True), [1, 2],
                            tp_rank=rank, tp_size=4)
            assert h.wait() == 2
            for layer in range(L):
                assert np.array_equal(dst[layer][[1, 2]], src[layer][[0, 3]])


def test_page_ids_outside_the_cache_are_refused(path):
    """A negative id would wrap to the cache's end, one past it fail in
    the middle of a copy: both are refused up front."""
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    with _store(path, geom()) as store:
        for ids in ([0, -1], [3, 4]):
            with pytest.raises(ConfigError, match=f"save: page id {ids[1]} is outside"):
                save_blocks(store, [b"x0", b"x1"], VLLMLayout(src), ids)
        save_blocks(store, [b"x0", b"x1"], VLLMLayout(src), [0, 1])
        with pytest.raises(ConfigError, match="load: page id 4 is outside the cache's 4"):
            load_blocks(store, [b"x0", b"x1"], VLLMLayout(src), [2, 4])
        with pytest.raises(ConfigError, match="integers"):
            load_blocks(store, [b"x0", b"x1"], VLLMLayout(src), [0.5, 1.5])
        # one id for one key, or a generator: TypeError "object of type
        # 'int' has no len()", naming neither the argument nor what to pass
        for ids in (2, (i for i in [2])):
            with pytest.raises(ConfigError, match="save: page ids must be a 1-D sequence"):
                save_blocks(store, [b"x2"], VLLMLayout(src), ids)
        for ids in (2, (i for i in [2])):
            with pytest.raises(ConfigError, match="load: page ids must be a 1-D sequence"):
                load_blocks(store, [b"x0"], VLLMLayout(src), ids)
        assert store.stats()["runs"] == 1


def test_a_load_into_one_page_twice_is_refused_up_front(path):
    """Two keys given one cache page: the load wrote both blocks into it
    and reported both loaded, so the model attended to one block's KV at
    the other's positions too (which block landed depended on the pieces'
    order, and on a GPU index_put_ with repeated indices defines none).
    Refused before anything is pinned or written; a save from one page
    twice stays allowed (it only reads the page)."""
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    with _store(path, geom()) as store:
        assert save_blocks(store, [b"d0", b"d1", b"d2"], VLLMLayout(src), [1, 1, 3]) == 3
        dst = [torch.zeros(2, 4, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        for ids in ([2, 2, 0], np.array([0, 2, 2], np.int32), torch.tensor([3, 0, 3])):
            with pytest.raises(ConfigError, match=r"load: page id (2|3) is given for keys "
                                                  r"(0 and 1|1 and 2|0 and 2)"):
                load_blocks(store, [b"d0", b"d1", b"d2"], VLLMLayout(dst), ids)
        assert not any(d.any() for d in dst)
        assert store.regions.pins.sum() == 0
        # ids past the keys are not the load's: a repeat there is no clash
        assert load_blocks(store, [b"d0", b"d1"], VLLMLayout(dst), [2, 0, 2]).wait() == 2
        for layer in range(L):
            assert torch.equal(dst[layer][:, [2, 0]].view(torch.int16),
                               src[layer][:, [1, 1]].view(torch.int16))


def test_an_unsigned_page_id_past_int64_is_named_as_given(path):
    """A uint64 page id of 2**63 or more was cast to int64 and refused as a
    negative id the caller never passed ('page id -9223372036854775807')."""
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    with _store(path, geom()) as store:
        with pytest.raises(ConfigError, match=r"save: page id 9223372036854775809 is outside"):
            save_blocks(store, [b"u0", b"u1"], VLLMLayout(src),
                        np.array([0, 2**63 + 1], np.uint64))
        with pytest.raises(ConfigError, match=r"load: page id 18446744073709551615 is outside"):
            load_blocks(store, [b"u0"], VLLMLayout(src), np.array([2**64 - 1], np.uint64))
        assert store.stats()["runs"] == 0


def test_tp_rank_and_size_must_be_integers(path):
    """tp_size=2.0 (a number read from a JSON config) passed every check,
    pinned and read the runs, then failed in the scatter thread with numpy's
    IndexError (a float head slice), surfaced by wait(); a bool rank was taken
    for rank 0 or 1.  Both are refused up front, as Geometry refuses them."""
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    with _store(path, geom(groups=2)) as store:
        save_blocks(store, [b"x0"], VLLMLayout(src), [0])
        half = [torch.zeros(2, 4, BS, H // 2, D, dtype=torch.bfloat16) for _ in range(L)]
        for rank, size in ((1, 2.0), (1.0, 2), (True, 2), (0, "2")):
            with pytest.raises(ConfigError, match="must be an integer"):
                load_blocks(store, [b"x0"], VLLMLayout(half), [1], tp_rank=rank, tp_size=size)
        assert not any(h.any() for h in half)
        assert load_blocks(store, [b"x0"], VLLMLayout(half), [1], tp_rank=np.int64(1),
                           tp_size=np.int32(2)).wait() == 1
        assert torch.equal(half[0][:, 1], src[0][:, 0, :, H // 2:])
        assert store.regions.pins.sum() == 0


def test_a_failed_load_ends_its_reads_before_wait_raises(path, monkeypatch):
    """The scatter stage fails while the reader still has reads to do:
    wait() raises only once the reader has stopped, so no read is left in
    flight on a region the load has unpinned (and the caller may close the
    store at once)."""
    import threading
    import time

    monkeypatch.setattr("kvblock.tensors.transfer.UNIT_BYTES", 4096)
    src = [rand(2, 8, BS, H, D) for _ in range(L)]
    keys = [f"f{i}".encode() for i in range(8)]
    with _store(path, geom()) as store:
        save_blocks(store, keys, VLLMLayout(src), list(range(8)))
        real_read = store.io.read

        def slow_read(batch):
            time.sleep(0.02)
            return real_read(batch)
        monkeypatch.setattr(store.io, "read", slow_read)

        def scatter_fails(*args, **kwargs):
            raise RuntimeError("scatter failed")
        monkeypatch.setattr("kvblock.tensors.transfer._scatter_pages", scatter_fails)
        dst = [torch.zeros(2, 8, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        with pytest.raises(RuntimeError, match="scatter failed"):
            load_blocks(store, keys, VLLMLayout(dst), list(range(8))).wait()
        assert not [t for t in threading.enumerate()
                    if t.name == "kvblock-load-read" and t.is_alive()]
        assert store.regions.pins.sum() == 0


def test_tp_reads_only_its_ranges(path):
    """A rank of a store cut for its TP degree reads 1/G of the bytes."""
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    keys = [b"r0", b"r1", b"r2", b"r3"]
    with _store(path, geom(groups=4), verify="never") as store:
        save_blocks(store, keys, VLLMLayout(src), [0, 1, 2, 3])
        full = [torch.zeros(2, 4, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        h_all = load_blocks(store, keys, VLLMLayout(full), [0, 1, 2, 3])
        h_all.wait()
        part = [torch.zeros(2, 4, BS, H // 4, D, dtype=torch.bfloat16) for _ in range(L)]
        h_one = load_blocks(store, keys, VLLMLayout(part), [0, 1, 2, 3], tp_rank=1, tp_size=4)
        h_one.wait()
        assert h_one.bytes_read * 4 == h_all.bytes_read


def test_layout_mismatch_is_a_clear_error(path):
    with _store(path, geom()) as store:
        bad = [rand(2, 4, BS, H, D * 2) for _ in range(L)]
        with pytest.raises(ConfigError, match=r"head_dim 32 \(store: 16\)"):
            save_blocks(store, [b"x"], VLLMLayout(bad), [0])
        with pytest.raises(ConfigError, match="8 kv heads do not split over tp_size 3"):
            load_blocks(store, [b"x"], VLLMLayout(bad), [0], tp_rank=0, tp_size=3)
        with pytest.raises(ConfigError, match="tp_rank 4 outside tp_size 4"):
            load_blocks(store, [b"x"], VLLMLayout(bad), [0], tp_rank=4, tp_size=4)


def test_a_cache_passed_where_its_layout_belongs_is_a_clear_error(path):
    """save_blocks(store, keys, kv_caches, ids) (the engine's cache list,
    not a layout over it) failed with AttributeError "'list' object has no
    attribute 'check'", naming neither the argument nor the layouts; None
    the same.  Each is a ConfigError naming the layouts, before anything
    is put or pinned."""
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    with _store(path, geom()) as store:
        for bad in (src, src[0], None):
            with pytest.raises(ConfigError, match=r"save: layout must be a CacheLayout.*"
                                                  r"VLLMLayout\(kv_caches\)"):
                save_blocks(store, [b"c0"], bad, [0])
            with pytest.raises(ConfigError, match=r"load: layout must be a CacheLayout.*"
                                                  r"VLLMLayout\(kv_caches\)"):
                load_blocks(store, [b"c0"], bad, [1])
        assert store.lookup([b"c0"]) == 0
        assert save_blocks(store, [b"c0"], VLLMLayout(src), [0]) == 1
        dst = [torch.zeros_like(t) for t in src]
        assert load_blocks(store, [b"c0"], VLLMLayout(dst), [1]).wait() == 1
        assert all(torch.equal(d[:, 1], s[:, 0]) for d, s in zip(dst, src))
        assert store.regions.pins.sum() == 0


def test_a_vllm_cache_of_the_other_order_names_the_order_to_pass(path):
    """An HND cache passed as NHD (the default) was refused as 'block_tokens
    8 (store: 16), heads 16 (store: 8)', naming neither the layout nor that
    its order is the other one.  The error names both and the fix."""
    with _store(path, geom()) as store:
        hnd = [rand(2, 4, H, BS, D) for _ in range(L)]
        with pytest.raises(ConfigError, match=r"VLLMLayout \(NHD\) of shape \(2, 4, 8, 16, 16\) "
                                              r"does not match the store's geometry: "
                                              r"block_tokens 8 \(store: 16\), heads 16 \(store: "
                                              r"8\); its blocks and heads are the other way "
                                              r"round: an HND cache\? pass order='HND'"):
            save_blocks(store, [b"o0"], VLLMLayout(hnd), [0])
        assert save_blocks(store, [b"o0"], VLLMLayout(hnd, "HND"), [0]) == 1


def test_a_heads_mismatch_under_tensor_parallelism_names_the_ranks_share(path):
    """A load for rank 0 of tp_size 2 into a cache of all 8 heads said
    'heads 8 (store: 4)', calling the rank's share the store's head count
    (it holds 8); a save from one rank's 4 heads said 'heads 4 (store: 8)'
    without saying that a save takes every head."""
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    with _store(path, geom(groups=2)) as store:
        save_blocks(store, [b"x"], VLLMLayout(src), [0])
        with pytest.raises(ConfigError, match=r"heads 8 \(store: 4 per rank of its 8 at "
                                              r"tp_size 2\)"):
            load_blocks(store, [b"x"], VLLMLayout(src), [1], tp_rank=0, tp_size=2)
        with pytest.raises(ConfigError, match=r"heads 8 \(store: 1 per rank of its 8 at "
                                              r"tp_size 16\)"):
            load_blocks(store, [b"x"], VLLMLayout(src), [1], tp_rank=3, tp_size=16)
        half = [x[:, :, :, :H // 2] for x in src]
        with pytest.raises(ConfigError, match=r"heads 4 \(store: 8; save_blocks takes a cache "
                                              r"of every head"):
            save_blocks(store, [b"y"], VLLMLayout(half), [0])
        with pytest.raises(ConfigError, match=r"heads 4 \(store: 8; a tensor-parallel rank's "
                                              r"cache: pass tp_rank and tp_size\)"):
            load_blocks(store, [b"x"], VLLMLayout(half), [1])
        # the rank's share of heads matches: only head_dim is named
        with pytest.raises(ConfigError, match=r"geometry: head_dim 32 \(store: 16\)$"):
            load_blocks(store, [b"x"], VLLMLayout([x[..., :H // 2, :].repeat(1, 1, 1, 1, 2)
                                                   for x in src]), [1], tp_rank=1, tp_size=2)


def test_layerwise_load_overlaps_io(path):
    """With a slow device, layer 0 is usable long before the last layer is read."""
    from kvblock.store.storeio import StoreIO

    class SlowIO(StoreIO):
        def read(self, batch):      # slow enough to hold on a loaded machine too
            time.sleep(0.1)
            super().read(batch)

    g = Geometry(8, H, D, "bfloat16", BS)
    src = [rand(2, 4, BS, H, D) for _ in range(8)]
    keys = [b"o0", b"o1", b"o2", b"o3"]
    with KVStore.format([path], g, region_size=1 << 20, force=True) as store:
        save_blocks(store, keys, VLLMLayout(src), [0, 1, 2, 3])
    with KVStore.open([path], storeio_factory=SlowIO) as store:
        dst = [torch.zeros(2, 4, BS, H, D, dtype=torch.bfloat16) for _ in range(8)]
        h = load_blocks(store, keys, VLLMLayout(dst), [0, 1, 2, 3])
        assert h.wait_layer(0) == 4
        assert not h.done()
        assert torch.equal(dst[0][:, :4].view(torch.int16), src[0][:, :4].view(torch.int16))
        assert not dst[7].any()  # the last layer is still on its way
        assert h.wait() == 4
        # layer 7 came at least one slow read after layer 0 (no ratio of
        # times: on a loaded machine layer 0's own wait may be long too)
        assert h.layer_ready_at[7] - h.layer_ready_at[0] >= 0.1
        assert torch.equal(dst[7].view(torch.int16), src[7].view(torch.int16))


def _saved_with_run_b_damaged(path):
    """A store at ``path`` holding runs a and b (two blocks each, saved
    from one random vLLM cache), the last layer of run b corrupt on the
    device.  Returns (the saved cache, a's keys, b's keys)."""
    src = [rand(2, 6, BS, H, D) for _ in range(L)]
    a, b = [b"a0", b"a1"], [b"b0", b"b1"]
    with _store(path, geom()) as store:
        save_blocks(store, a, VLLMLayout(src), [0, 1])
        save_blocks(store, b, VLLMLayout(src), [2, 3])
        run_b = store.index.locate(normalize_keys(b)[0])[0]
        _, off = store.regions.address(run_b.region, run_b.offset)
    with open(path, "r+b") as f:  # corrupt the last layer of run b
        f.seek(off + (L - 1) * store.layout(2).range_bytes + 64)
        f.write(b"\xde\xad")
    return src, a, b


def test_checksum_failure_during_load_shrinks_the_prefix(path):
    src, a, b = _saved_with_run_b_damaged(path)
    with KVStore.open([path]) as store:
        dst = [torch.zeros(2, 6, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        h = load_blocks(store, a + b, VLLMLayout(dst), [0, 1, 2, 3])
        assert h.wait() == 2
        assert store.counters["checksum_failures"] == 1
        assert store.lookup(a + b) == 2


def test_a_load_counts_no_bytes_read_for_the_runs_its_checksum_failure_cut_off(path):
    """The reader counted every unit it read in bytes_read, those of a run
    that then failed its checksum (and of the runs after it) too: stats()
    said bytes were read and returned that the load did not deliver, where
    get_run counts only the runs it verified.  The load counts the bytes of
    the runs it delivered, as get_run of that prefix does."""
    src, a, b = _saved_with_run_b_damaged(path)
    with KVStore.open([path]) as store:
        g, c = store.geometry, store.counters
        before = c["bytes_read"]
        assert store.get_run(a, np.zeros(2 * g.block_bytes, np.uint8)) == 2
        prefix = c["bytes_read"] - before
        before = c["bytes_read"]
        dst = [torch.zeros(2, 6, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        assert load_blocks(store, a + b, VLLMLayout(dst), [0, 1, 2, 3]).wait() == 2
        assert c["checksum_failures"] == 1
        assert c["bytes_read"] - before == prefix


@pytest.mark.parametrize("dim", [D, 64], ids=["rows64", "rows256"])
def test_hf_dynamic_cache_round_trip(path, monkeypatch, dim):
    """HF caches are (1, heads, tokens, dim): a page is a token span of every
    head.  Rows of 256 bytes (dim 64, fp32) move with native row copies,
    shorter ones through numpy; the same bytes either way."""
    from kvblock.tensors import transfer

    native = []
    real = transfer.copy_pages
    monkeypatch.setattr(transfer, "copy_pages",
                        lambda *a, **k: native.append(real(*a, **k)) or native[-1])
    g = Geometry(L, 2, dim, "float32", BS)
    tokens = 3 * BS + 5   # a partial last block is not stored
    src = HFDynamicLayout([torch.randn(1, 2, tokens, dim) for _ in range(L)],
                          [torch.randn(1, 2, tokens, dim) for _ in range(L)], BS)
    keys = [b"h0", b"h1", b"h2"]
    with _store(path, g) as store:
        save_blocks(store, keys, src, [0, 1, 2])
        dst = HFDynamicLayout.empty(L, 2, 3 * BS + 7, dim, BS, torch.float32)
        assert load_blocks(store, keys, dst, [2, 0, 1]).wait() == 3
    assert native and all(native) == (dim == 64)
    for layer in range(L):
        for d, s_ in ((dst.keys[layer], src.keys[layer]), (dst.values[layer], src.values[layer])):
            for page, src_page in ((2, 0), (0, 1), (1, 2)):
                assert torch.equal(d[:, :, page * BS:(page + 1) * BS],
                                   s_[:, :, src_page * BS:(src_page + 1) * BS])
            assert not d[:, :, 3 * BS:].any()     # the tail past the pages is untouched


def test_the_partial_last_block_of_a_hf_cache_is_refused_naming_it(path):
    """A DynamicCache of 3 blocks and 5 tokens pages only its 3 whole
    blocks: a save of page 3 (the 5 tokens) was refused as 'page id 3 is
    outside the cache's 3 pages', naming neither the tokens left over nor
    that a partial block is never stored.  The error says both, and how
    many tokens a load's cache needs for the page."""
    g = Geometry(L, 2, 64, "float32", BS)
    tokens = 3 * BS + 5
    src = HFDynamicLayout([torch.randn(1, 2, tokens, 64) for _ in range(L)],
                          [torch.randn(1, 2, tokens, 64) for _ in range(L)], BS)
    with _store(path, g) as store:
        with pytest.raises(ConfigError, match=rf"save: page id 3 is outside the cache's 3 pages "
                                              rf"\(its {tokens} tokens hold 3 whole {BS}-token "
                                              rf"blocks; the last 5 tokens are a partial block, "
                                              rf"which is not stored"):
            save_blocks(store, [b"h0", b"h1", b"h2", b"h3"], src, [0, 1, 2, 3])
        assert store.lookup([b"h0"]) == 0
        assert save_blocks(store, [b"h0", b"h1", b"h2"], src, [0, 1, 2]) == 3
        dst = HFDynamicLayout.empty(L, 2, 2 * BS + 1, 64, BS, torch.float32)
        with pytest.raises(ConfigError, match=rf"load: page id 2 is outside the cache's 2 pages "
                                              rf"\(its {2 * BS + 1} tokens hold 2 whole {BS}-token "
                                              rf"blocks; .* page 2 needs a cache of at least "
                                              rf"{3 * BS} tokens"):
            load_blocks(store, [b"h0", b"h1", b"h2"], dst, [0, 1, 2])
        assert not any(t.any() for t in dst.keys + dst.values)


def _hf_cache(layers):
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    cache.layers = layers
    return cache


def test_a_hf_cache_whose_layers_hold_no_prefix_from_token_0_is_refused(path):
    """from_cache took each layer's tensors for the cache's tokens from
    token 0: a sliding-window layer past its window holds only its last
    tokens (every layer alike in a model of sliding layers only, so the
    shapes agreed), and its page 0 was saved under the key of the
    prompt's first block.  Such a layer is refused, naming it."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    g = Geometry(L, 2, 64, "float32", BS)
    layers = []
    for _ in range(L):
        layer = DynamicSlidingWindowLayer(sliding_window=2 * BS + 1)
        kv = torch.randn(1, 2, 3 * BS, 64)
        layer.update(kv, kv.clone())
        layers.append(layer)
    assert layers[0].keys.shape[2] == 2 * BS     # its last 2 blocks of 3
    with pytest.raises(ConfigError, match=rf"layer 0 \(DynamicSlidingWindowLayer\) holds the "
                                          rf"last {2 * BS} of its {3 * BS} tokens"):
        HFDynamicLayout.from_cache(_hf_cache(layers), BS)
    with _store(path, g) as store:
        assert store.lookup([b"w0"]) == 0


def test_a_static_hf_cache_pages_only_the_tokens_it_holds(path):
    """A StaticCache's layers are tensors of max_cache_len tokens, zeros
    past those filled: from_cache paged all of them, and a save of a page
    past the prompt stored zeros as KV.  Its pages are its filled tokens."""
    from transformers.cache_utils import StaticLayer

    g = Geometry(L, 2, 64, "float32", BS)
    tokens = 2 * BS + 3
    layers, src = [], []
    for _ in range(L):
        layer = StaticLayer(max_cache_len=4 * BS)
        k, v = torch.randn(1, 2, tokens, 64), torch.randn(1, 2, tokens, 64)
        layer.update(k, v)
        layers.append(layer)
        src.append((k, v))
    layout = HFDynamicLayout.from_cache(_hf_cache(layers), BS)
    assert layout.tokens == tokens
    with _store(path, g) as store:
        with pytest.raises(ConfigError, match=rf"save: page id 2 is outside the cache's 2 pages "
                                              rf"\(its {tokens} tokens hold 2 whole"):
            save_blocks(store, [b"s0", b"s1", b"s2"], layout, [0, 1, 2])
        assert save_blocks(store, [b"s0", b"s1"], layout, [1, 0]) == 2
        dst = HFDynamicLayout.empty(L, 2, 2 * BS, 64, BS, torch.float32)
        assert load_blocks(store, [b"s0", b"s1"], dst, [0, 1]).wait() == 2
    for layer, (k, v) in enumerate(src):
        for got, want in ((dst.keys[layer], k), (dst.values[layer], v)):
            assert torch.equal(got[:, :, :BS], want[:, :, BS:2 * BS])
            assert torch.equal(got[:, :, BS:], want[:, :, :BS])


def test_hf_empty_layout_takes_the_geometrys_dtype_name(path):
    """HFDynamicLayout.empty(..., g.dtype) (the store's dtype, a name)
    failed in torch.zeros with a TypeError naming neither the layout nor
    the fix.  The name is taken as the torch dtype; a name torch has no
    dtype for is a ConfigError."""
    g = Geometry(L, 2, 64, "bfloat16", BS)
    src = HFDynamicLayout([rand(1, 2, 2 * BS, 64) for _ in range(L)],
                          [rand(1, 2, 2 * BS, 64) for _ in range(L)], BS)
    with _store(path, g) as store:
        save_blocks(store, [b"e0", b"e1"], src, [0, 1])
        dst = HFDynamicLayout.empty(L, 2, 2 * BS, 64, BS, g.dtype)
        assert dst.keys[0].dtype == torch.bfloat16
        assert load_blocks(store, [b"e0", b"e1"], dst, [1, 0]).wait() == 2
    for layer in range(L):
        assert torch.equal(dst.values[layer][:, :, :BS], src.values[layer][:, :, BS:])
    with pytest.raises(ConfigError, match=r"HFDynamicLayout.empty: dtype 'bfloat17' is no "
                                          r"torch dtype"):
        HFDynamicLayout.empty(L, 2, 2 * BS, 64, BS, "bfloat17")


def test_loads_reuse_staging_memory(path, monkeypatch):
    """Later loads take earlier ones' staging buffers (no fresh memory to map
    and touch before their first layer); a failing scatter stage still hands
    them back and stops the reader."""
    from kvblock.memory import spares as spares_mod
    from kvblock.tensors.transfer import UNIT_BUFFERS

    made = []
    real = spares_mod.HostBuffer
    monkeypatch.setattr(spares_mod, "HostBuffer",
                        lambda *a, **k: made.append(a) or real(*a, **k))
    src = [rand(2, 6, BS, H, D) for _ in range(L)]
    keys = [f"r{i}".encode() for i in range(4)]
    with _store(path, geom()) as store:
        save_blocks(store, keys, VLLMLayout(src), [0, 1, 2, 3])
        for round_ in range(6):
            dst = [torch.zeros(2, 6, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
            assert load_blocks(store, keys, VLLMLayout(dst), [5, 4, 3, 2]).wait() == 4
            assert torch.equal(dst[2][:, [5, 4, 3, 2]].view(torch.int16),
                               src[2][:, [0, 1, 2, 3]].view(torch.int16))
        # at most UNIT_BUFFERS ever (at least one per load without reuse)
        assert 1 <= len(made) <= UNIT_BUFFERS
        made_before = len(made)
        assert store.spares.idle_bytes >= store.layout(4).range_bytes

        def broken(*a, **k):
            raise RuntimeError("scatter failed")
        monkeypatch.setattr("kvblock.tensors.transfer._scatter_pages", broken)
        h = load_blocks(store, keys, VLLMLayout(dst), [0, 1, 2, 3])
        with pytest.raises(RuntimeError, match="scatter failed"):
            h.wait(timeout=10)
        deadline = time.monotonic() + 10
        while store.spares.idle_bytes < made_before * store.layout(4).range_bytes:
            assert time.monotonic() < deadline, "staging buffers never came back"
            time.sleep(0.01)
        assert len(made) == made_before
    assert store.spares.idle_bytes == 0      # freed with the store


@pytest.mark.parametrize("unit_bytes", [4096, 12288, 8 << 20], ids=["1page", "3pages", "8M"])
@pytest.mark.parametrize("verify", ["always", "never"])
@pytest.mark.parametrize("groups,tp", [(1, 1), (2, 1), (2, 2)])
def test_units_cut_ranges_anywhere(path, monkeypatch, unit_bytes, verify, groups, tp):
    """Loads cut into units of one page up to whole layers read the same
    bytes: runs of several pages, a prefix that starts inside a run, head
    groups read together (tp 1 of a 2-group store) or alone (tp 2)."""
    monkeypatch.setattr("kvblock.tensors.transfer.UNIT_BYTES", unit_bytes)
    src = [rand(2, 16, BS, H, D) for _ in range(L)]
    a = [f"a{i}".encode() for i in range(7)]
    b = [f"b{i}".encode() for i in range(5)]
    per = H // tp
    with _store(path, geom(groups=groups), verify=verify) as store:
        save_blocks(store, a, VLLMLayout(src), list(range(7)))
        save_blocks(store, b, VLLMLayout(src), list(range(7, 12)))
        keys = a[3:] + b                       # starts at page 3 of run a
        want_ids = list(range(3, 12))
        dst_ids = list(range(15, 6, -1))
        for rank in range(tp):
            dst = [torch.zeros(2, 16, BS, per, D, dtype=torch.bfloat16) for _ in range(L)]
            h = load_blocks(store, keys, VLLMLayout(dst), dst_ids, tp_rank=rank, tp_size=tp)
            assert h.wait() == 9
            for layer in range(L):
                want = src[layer][:, want_ids, :, rank * per:(rank + 1) * per]
                assert torch.equal(dst[layer][:, dst_ids].view(torch.int16),
                                   want.view(torch.int16)), (rank, layer)
                assert not dst[layer][:, :7].any()       # nothing outside the pages


@pytest.mark.parametrize("unit_bytes", [4096, 8 << 20], ids=["1page", "8M"])
def test_corrupt_middle_piece_ends_the_prefix_at_its_run(path, monkeypatch, unit_bytes):
    """A flipped byte inside run b (page 2 of its layer-1 range, not the
    range's first or last piece) fails that range's streaming checksum:
    the load keeps run a only, and run b is dropped."""
    monkeypatch.setattr("kvblock.tensors.transfer.UNIT_BYTES", unit_bytes)
    src = [rand(2, 12, BS, H, D) for _ in range(L)]
    a, b, c = ([f"{x}{i}".encode() for i in range(4)] for x in "abc")
    with _store(path, geom()) as store:
        for i, keys in enumerate((a, b, c)):
            save_blocks(store, keys, VLLMLayout(src), list(range(4 * i, 4 * i + 4)))
        run_b = store.index.runs[max(r.run_id for r in store.index.runs.values()
                                     if r.keys.startswith(normalize_keys(b)[0]))]
        lay = store.layout(4)
        _, off = store.regions.address(run_b.region, run_b.offset)
        at = off + lay.range_offset(1, 0) + 2 * store.geometry.group_block_bytes + 100
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    with KVStore.open([path]) as store:
        dst = [torch.zeros(2, 12, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        h = load_blocks(store, a + b + c, VLLMLayout(dst), list(range(12)))
        assert h.wait() == 4
        assert store.counters["checksum_failures"] == 1
        assert store.last_checksum_failure[3] == lay.range_index(1, 0)
        assert store.lookup(a + b + c) == 4 and store.lookup(c) == 4
        for layer in range(L):
            assert torch.equal(dst[layer][:, :4].view(torch.int16),
                               src[layer][:, :4].view(torch.int16))


def test_unreadable_run_fails_the_load_and_is_dropped(path):
    """EIO on run b's layer-1 range: the load raises IOFailedError and run b
    is dropped, so the next lookup stops before it and the next load
    returns run a instead of failing again."""
    from kvblock.errors import IOFailedError
    from tests.support.faults import BadSectors

    src = [rand(2, 12, BS, H, D) for _ in range(L)]
    a, b, c = ([f"{x}{i}".encode() for i in range(4)] for x in "abc")
    with _store(path, geom()) as store:
        for i, keys in enumerate((a, b, c)):
            save_blocks(store, keys, VLLMLayout(src), list(range(4 * i, 4 * i + 4)))
    with KVStore.open([path]) as store:
        run_b = store.index.runs[max(r.run_id for r in store.index.runs.values()
                                     if r.keys.startswith(normalize_keys(b)[0]))]
        dev, off = store.regions.address(run_b.region, run_b.offset)
        bad = BadSectors()
        bad.add(dev, off + store.layout(4).range_offset(1, 0), 4096)
        bad.install(store)
        dst = [torch.zeros(2, 12, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        with pytest.raises(IOFailedError, match="EIO"):
            load_blocks(store, a + b + c, VLLMLayout(dst), list(range(12))).wait()
        assert store.counters["read_errors"] == 1 and bad.reads_failed == 1
        assert store.lookup(a + b + c) == 4 and store.lookup(c) == 4
        dst = [torch.zeros(2, 12, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        assert load_blocks(store, a + b + c, VLLMLayout(dst), list(range(12))).wait() == 4
        for layer in range(L):
            assert torch.equal(dst[layer][:, :4].view(torch.int16),
                               src[layer][:, :4].view(torch.int16))


class _FakeFuture:
    def __init__(self, n):
        self.n = n

    def get(self):
        return self.n


class _PreadReader:
    """Stands in for kvblock.io.gpu.KvikioReader on a CPU machine: reads with
    pread into the tensor it is handed (kvikio gets a CUDA tensor there)."""

    def __init__(self, paths):
        import os

        self.fds = [os.open(p, os.O_RDONLY) for p in paths]
        self.calls = 0

    def read(self, dev, offset, dst, nbytes):
        import os

        assert isinstance(dst, torch.Tensor) and dst.numel() == nbytes   # not a wrapper
        self.calls += 1
        got = os.preadv(self.fds[dev], [dst.numpy()], offset)
        return _FakeFuture(got)

    def close(self):
        import os

        for fd in self.fds:
            os.close(fd)


@pytest.mark.parametrize("unit_bytes", [4096, 8 << 20], ids=["1page", "8M"])
def test_kvikio_job_orchestration_on_cpu(path, monkeypatch, unit_bytes):
    """The GPU job (device staging, reads through kvikio, scatter on the
    device) driven on the CPU: a pread stand-in for kvikio, CPU tensors for
    the device.  Same bytes as the host path, any unit size, any TP rank."""
    from kvblock.tensors import transfer

    monkeypatch.setattr(transfer, "UNIT_BYTES", unit_bytes)
    monkeypatch.setattr(transfer, "_job_class", lambda store, layout: transfer._KvikioLoadJob)
    src = [rand(2, 12, BS, H, D) for _ in range(L)]
    keys = [f"k{i}".encode() for i in range(9)]
    with _store(path, geom(groups=2), verify="never") as store:
        save_blocks(store, keys[:4], VLLMLayout(src), [0, 1, 2, 3])
        save_blocks(store, keys[4:], VLLMLayout(src), [4, 5, 6, 7, 8])
        reader = _PreadReader([path])
        monkeypatch.setattr(store, "_kvikio_reader", lambda: reader)
        for tp, rank in ((1, 0), (2, 1)):
            per = H // tp
            dst = [torch.zeros(2, 12, BS, per, D, dtype=torch.bfloat16) for _ in range(L)]
            h = load_blocks(store, keys[1:], VLLMLayout(dst), list(range(11, 3, -1)),
                            tp_rank=rank, tp_size=tp)
            assert h.wait(timeout=30) == 8
            for layer in range(L):
                want = src[layer][:, 1:9, :, rank * per:(rank + 1) * per]
                assert torch.equal(dst[layer][:, list(range(11, 3, -1))].view(torch.int16),
                                   want.view(torch.int16)), (tp, layer)
        # Consecutive pages go as a slice: no index tensor made (on a GPU
        # each was a copy to it and back, a wait for the stream per part).
        made = []
        ids_for = transfer._ids_for
        monkeypatch.setattr(transfer, "_ids_for", lambda *a: made.append(a) or ids_for(*a))
        dst = [torch.zeros(2, 12, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        assert load_blocks(store, keys[1:], VLLMLayout(dst), range(4, 12)).wait(timeout=30) == 8
        assert not made
        for layer in range(L):
            assert torch.equal(dst[layer][:, 4:12].view(torch.int16),
                               src[layer][:, 1:9].view(torch.int16)), layer
        assert reader.calls > 0
        reader.close()


def test_the_kvikio_job_keeps_more_units_in_flight_than_the_host_path(path, monkeypatch):
    """kvikio splits each read over its own threads and its staging is
    device memory: its load keeps a window of up to KVIKIO_UNIT_BUFFERS
    units' reads in flight, the oldest waited for while the others go on
    (H200, KVIKIO_NTHREADS=8: batches of 2 -> 8 units 6.2 -> 9.3 GiB/s; the
    window: see KVIKIO_UNIT_BUFFERS), the host path batches at most
    UNIT_BUFFERS - 1 (a few buffers that fit the CPU's cache).  Driven on
    the CPU with the pread stand-in; bytes identical."""
    from kvblock.tensors import transfer

    monkeypatch.setattr(transfer, "UNIT_BYTES", 4096)
    src = [rand(2, 24, BS, H, D) for _ in range(L)]
    keys = [f"f{i}".encode() for i in range(24)]
    with _store(path, geom(), verify="never") as store:
        assert save_blocks(store, keys, VLLMLayout(src), list(range(24))) == 24
        reader = _PreadReader([path])

        def load(job):
            monkeypatch.setattr(transfer, "_job_class", lambda store, layout: job)
            monkeypatch.setattr(store, "_kvikio_reader", lambda: reader)
            made = []
            new_buffer = job._new_buffer
            monkeypatch.setattr(job, "_new_buffer",
                                lambda self: made.append(1) or new_buffer(self))
            dst = [torch.zeros(2, 24, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
            assert load_blocks(store, keys, VLLMLayout(dst), list(range(24))).wait(timeout=30) == 24
            for layer in range(L):
                assert torch.equal(dst[layer].view(torch.int16), src[layer].view(torch.int16))
            return len(made)

        # kvikio: units started and not yet waited for, counted as each wait begins
        flight, at_wait = [0], []
        start_reads, wait_reads = transfer._KvikioLoadJob._start_reads, \
            transfer._KvikioLoadJob._wait_reads

        def started(self, *a):
            flight[0] += 1
            return start_reads(self, *a)

        def waited(self, reads, quiet=False):
            at_wait.append(flight[0])
            flight[0] -= 1
            return wait_reads(self, reads, quiet)
        monkeypatch.setattr(transfer._KvikioLoadJob, "_start_reads", started)
        monkeypatch.setattr(transfer._KvikioLoadJob, "_wait_reads", waited)
        made = load(transfer._KvikioLoadJob)
        assert len(at_wait) == L * 24 and flight[0] == 0      # every unit read, waited once
        assert max(at_wait) == transfer.KVIKIO_UNIT_BUFFERS, at_wait
        assert made == transfer.KVIKIO_UNIT_BUFFERS
        monkeypatch.undo()

        monkeypatch.setattr(transfer, "UNIT_BYTES", 4096)
        batches = []
        read_batch = transfer._LoadJob._read_batch
        monkeypatch.setattr(transfer._LoadJob, "_read_batch",
                            lambda self, batch: batches.append(len(batch)) or
                            read_batch(self, batch))
        made = load(transfer._LoadJob)
        assert max(batches) == transfer.UNIT_BUFFERS - 1, batches
        assert made <= transfer.UNIT_BUFFERS
        reader.close()
        assert transfer.KVIKIO_UNIT_BUFFERS > transfer.UNIT_BUFFERS


def test_kvikio_job_loads_a_hugging_face_cache(path, monkeypatch):
    """A Hugging Face cache of several heads pages through _StridedPages
    (no torch tensor): the kvikio job took its staging device from
    ``layout.sample().device``, which _StridedPages has none of
    (AttributeError, the load failed), and _job_class never chose the
    kvikio job for one on CUDA (it looked for a torch sample), so
    KVBLOCK_GPU_PATH=kvikio read it through host staging.  Driven on the
    CPU with the pread stand-in for kvikio: bytes identical."""
    from kvblock.tensors import transfer

    monkeypatch.setattr(transfer, "UNIT_BYTES", 4096)
    monkeypatch.setattr(transfer, "_job_class", lambda store, layout: transfer._KvikioLoadJob)
    tokens = 5 * BS
    src = HFDynamicLayout([rand(1, H, tokens, D) for _ in range(L)],
                          [rand(1, H, tokens, D) for _ in range(L)], BS)
    assert isinstance(src.layer_views(0)[0], transfer._StridedPages)
    keys = [f"h{i}".encode() for i in range(5)]
    with _store(path, geom(), verify="never") as store:
        assert save_blocks(store, keys, src, list(range(5))) == 5
        reader = _PreadReader([path])
        monkeypatch.setattr(store, "_kvikio_reader", lambda: reader)
        dst = HFDynamicLayout.empty(L, H, tokens, D, BS, torch.bfloat16)
        h = load_blocks(store, keys[1:], dst, [4, 0, 1, 2])     # mid-run, pages out of order
        assert h.wait(timeout=30) == 4
        assert reader.calls > 0
        reader.close()
    for layer in range(L):
        for have, want in ((dst.keys[layer], src.keys[layer]),
                           (dst.values[layer], src.values[layer])):
            for page, block in ((4, 1), (0, 2), (1, 3), (2, 4)):
                got = have[:, :, page * BS:(page + 1) * BS].view(torch.int16)
                assert torch.equal(got, want[:, :, block * BS:(block + 1) * BS]
                                   .view(torch.int16)), (layer, page)
            assert not have[:, :, 3 * BS:4 * BS].any()


def test_kvikio_staging_is_read_into_again_only_once_its_scatter_is_done(path,
                                                                         monkeypatch):
    """GPU path: the scatter's copies out of a device staging buffer are
    queued on the stream, and kvikio's reads are not ordered with it; so a
    buffer is read into again only after the reader waited for the mark
    (an event) the scatter that used it left after its copies, or the next
    read could overwrite pages not yet copied.  Recorded on the CPU: per
    staging buffer, reads, marks and waits."""
    from kvblock.tensors import transfer

    monkeypatch.setattr(transfer, "UNIT_BYTES", 4096)
    monkeypatch.setattr(transfer, "_job_class", lambda store, layout: transfer._KvikioLoadJob)
    events, buffers = [], []
    real_new = transfer._KvikioLoadJob._new_buffer

    def new_buffer(job):
        buf = real_new(job)
        buffers.append(buf)
        return buf
    monkeypatch.setattr(transfer._KvikioLoadJob, "_new_buffer", new_buffer)
    monkeypatch.setattr(transfer._DeviceStaging, "mark_used",
                        lambda buf: events.append(("mark", buffers.index(buf))))
    monkeypatch.setattr(transfer._DeviceStaging, "wait_unused",
                        lambda buf: events.append(("wait", buffers.index(buf))))

    def owner(t, nbytes):
        for i, buf in enumerate(buffers):
            base = buf.array.t.data_ptr()
            if base <= t.data_ptr() < base + buf.array.t.numel():
                return i, t.data_ptr() - base, t.data_ptr() - base + nbytes
        raise AssertionError("a read outside the staging buffers")

    class Recording(_PreadReader):
        def read(self, dev, offset, dst, nbytes):
            events.append(("read", owner(dst, nbytes)))
            return super().read(dev, offset, dst, nbytes)

    src = [rand(2, 12, BS, H, D) for _ in range(L)]
    keys = [f"k{i}".encode() for i in range(9)]
    with _store(path, geom(groups=2), verify="never") as store:
        save_blocks(store, keys, VLLMLayout(src), list(range(9)))
        reader = Recording([path])
        monkeypatch.setattr(store, "_kvikio_reader", lambda: reader)
        dst = [torch.zeros(2, 12, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        assert load_blocks(store, keys, VLLMLayout(dst), list(range(9))).wait(timeout=30) == 9
        reader.close()
    for layer in range(L):
        assert torch.equal(dst[layer][:, :9].view(torch.int16), src[layer][:, :9].view(torch.int16))
    # A read into bytes of a buffer that an earlier read filled: the buffer
    # was reused, and the reader must have waited, since that read, for a
    # mark its scatter left after it.
    reused = 0
    for i, (kind, what) in enumerate(events):
        if kind != "read":
            continue
        buf, lo, hi = what
        earlier = [j for j in range(i) if events[j][0] == "read" and events[j][1][0] == buf
                   and events[j][1][1] < hi and lo < events[j][1][2]]
        if earlier:
            reused += 1
            since = events[earlier[-1]:i]
            assert ("mark", buf) in since, (i, events[:i + 1])
            marked = since.index(("mark", buf))
            assert ("wait", buf) in since[marked:], (i, events[:i + 1])
    assert reused, "no staging buffer was reused: the test shows nothing"


class _ShortReader(_PreadReader):
    """A kvikio stand-in whose reads of one device range come back short."""

    def __init__(self, paths, bad_start, bad_end):
        super().__init__(paths)
        self.bad = (bad_start, bad_end)

    def read(self, dev, offset, dst, nbytes):
        got = super().read(dev, offset, dst, nbytes).get()
        if self.bad[0] <= offset < self.bad[1]:
            got -= 4096
        return _FakeFuture(got)


def test_kvikio_short_read_fails_the_load_as_an_io_error_and_drops_the_run(path, monkeypatch):
    """A short read through kvikio is a failed device read like the engine's:
    IOFailedError naming the device and offset (not a bare OSError), counted,
    and the run it was reading dropped, so the next lookup stops before it."""
    from kvblock.errors import IOFailedError
    from kvblock.tensors import transfer

    monkeypatch.setattr(transfer, "_job_class", lambda store, layout: transfer._KvikioLoadJob)
    src = [rand(2, 12, BS, H, D) for _ in range(L)]
    a, b = [f"a{i}".encode() for i in range(4)], [f"b{i}".encode() for i in range(4)]
    with _store(path, geom(), verify="never") as store:
        save_blocks(store, a, VLLMLayout(src), [0, 1, 2, 3])
        save_blocks(store, b, VLLMLayout(src), [4, 5, 6, 7])
        run_b = [r for r in store.index.runs.values()
                 if r.keys.startswith(normalize_keys(b)[0])][0]
        _, off = store.regions.address(run_b.region, run_b.offset)
        reader = _ShortReader([path], off, off + store.layout(4).run_bytes)
        monkeypatch.setattr(store, "_kvikio_reader", lambda: reader)
        dst = [torch.zeros(2, 12, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        with pytest.raises(IOFailedError, match=path) as err:
            load_blocks(store, a + b, VLLMLayout(dst), list(range(8))).wait(timeout=30)
        assert off <= err.value.offset < off + store.layout(4).run_bytes
        assert store.counters["read_errors"] == 1
        assert store.lookup(a + b) == 4
        reader.close()


class _LaggingReader(_PreadReader):
    """A kvikio stand-in whose reads run in the background as kvikio's do:
    reads at [bad_start, bad_end) come back short at once, the others land
    a while later.  ``pending`` counts reads not yet finished."""

    def __init__(self, paths, bad_start, bad_end, fail="short"):
        super().__init__(paths)
        self.bad = (bad_start, bad_end)
        self.fail = fail
        self.pending = 0
        self.lock = threading.Lock()

    def read(self, dev, offset, dst, nbytes):
        if self.bad[0] <= offset < self.bad[1]:
            if self.fail == "raise":       # kvikio refusing to start a read
                raise RuntimeError("kvikio: cuFileRead failed to start")
            return _FakeFuture(nbytes - 4096)
        with self.lock:
            self.pending += 1
        done = threading.Event()

        def later():
            time.sleep(0.5)
            super(_LaggingReader, self).read(dev, offset, dst, nbytes)
            with self.lock:
                self.pending -= 1
            done.set()
        threading.Thread(target=later, daemon=True).start()
        return _WaitFuture(done, nbytes)


class _WaitFuture:
    def __init__(self, done, n):
        self.done, self.n = done, n

    def get(self):
        self.done.wait()
        return self.n


@pytest.mark.parametrize("fail", ["short", "raise"])
def test_kvikio_failed_read_waits_for_the_batchs_other_reads(path, monkeypatch, fail):
    """A short kvikio read (or one that fails to start) in a batch whose
    other reads are still in flight: the load fails only once they have
    landed.  It raised at the first bad one, so wait() returned (pins
    released, device staging freed, the caller free to close the store)
    while kvikio still wrote into it."""
    from kvblock.errors import IOFailedError
    from kvblock.tensors import transfer

    monkeypatch.setattr(transfer, "_job_class", lambda store, layout: transfer._KvikioLoadJob)
    src = [rand(2, 12, BS, H, D) for _ in range(L)]
    a, b = [f"a{i}".encode() for i in range(4)], [f"b{i}".encode() for i in range(4)]
    with _store(path, geom(), verify="never") as store:
        save_blocks(store, a, VLLMLayout(src), [0, 1, 2, 3])
        save_blocks(store, b, VLLMLayout(src), [4, 5, 6, 7])
        # (a read failing to start: run b's, after run a's reads started)
        bad = normalize_keys(a if fail == "short" else b)[0]
        run_bad = [r for r in store.index.runs.values() if r.keys.startswith(bad)][0]
        _, off = store.regions.address(run_bad.region, run_bad.offset)
        reader = _LaggingReader([path], off, off + store.layout(4).run_bytes, fail)
        monkeypatch.setattr(store, "_kvikio_reader", lambda: reader)
        dst = [torch.zeros(2, 12, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        with pytest.raises(IOFailedError if fail == "short" else RuntimeError,
                           match=path if fail == "short" else "failed to start"):
            load_blocks(store, a + b, VLLMLayout(dst), list(range(8))).wait(timeout=30)
        assert reader.pending == 0, "the load failed with kvikio reads still in flight"
        assert store.regions.pins.sum() == 0
        time.sleep(0.6)
        reader.close()


def test_save_takes_device_page_ids_as_load_does(path, monkeypatch):
    """Page ids as a CUDA tensor (vLLM keeps block tables on the GPU): load
    and save check them on the host (``.cpu()``), but save's gather for a
    cache on the device then indexed with the ids as given, through
    numpy: a TypeError ("can't convert cuda:0 device type tensor to
    numpy").  Simulated on the CPU: ids that refuse numpy as CUDA tensors
    do, and the cache taken down the path a CUDA cache takes."""
    from kvblock.tensors import transfer

    class DeviceIds(torch.Tensor):
        def __array__(self, *a, **k):
            raise TypeError("can't convert cuda:0 device type tensor to numpy.")

        def cpu(self):
            return self.as_subclass(torch.Tensor)
    DeviceIds.__module__ = "torch"            # a torch tensor to kvblock

    monkeypatch.setattr(transfer, "_host_np", lambda view, itemsize: None)
    src = [rand(2, 6, BS, H, D) for _ in range(L)]
    keys = [b"d0", b"d1", b"d2"]
    with _store(path, geom()) as store:
        ids = torch.tensor([4, 0, 2]).as_subclass(DeviceIds)
        assert save_blocks(store, keys, VLLMLayout(src), ids) == 3
        dst = [torch.zeros(2, 6, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        assert load_blocks(store, keys, VLLMLayout(dst), ids).wait() == 3
    for layer in range(L):
        assert torch.equal(dst[layer][:, [4, 0, 2]].view(torch.int16),
                           src[layer][:, [4, 0, 2]].view(torch.int16))


def test_save_and_load_take_cupy_page_ids(path):
    """Page ids as a cupy array (an engine keeping its block table in
    cupy): numpy's implicit conversion, which cupy refuses (TypeError), was
    taken for ids that are no sequence of integers, a ConfigError saying
    "page ids must be a 1-D sequence of integers ... got ndarray" of a 1-D
    integer array.  They are copied to the host (``.get()``), as a CUDA
    tensor's are (``.cpu()``).  Stood in on the CPU by _CupyLike."""
    src = [rand(2, 6, BS, H, D) for _ in range(L)]
    keys = [b"p0", b"p1", b"p2"]
    ids = _CupyLike(np.array([4, 0, 2], dtype=np.int32))
    with _store(path, geom()) as store:
        assert save_blocks(store, keys, VLLMLayout(src), ids) == 3
        dst = [torch.zeros(2, 6, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        assert load_blocks(store, keys, VLLMLayout(dst), _CupyLike(np.array([1, 3, 5]))).wait() == 3
    for layer in range(L):
        assert torch.equal(dst[layer][:, [1, 3, 5]].view(torch.int16),
                           src[layer][:, [4, 0, 2]].view(torch.int16))


def test_sglang_page_first_direct_page_size_must_match_the_pool():
    """page_first_direct pools hold their page size in their shape: a
    page_size that differs from it would move other token counts than the
    store's blocks (a 1-token pool page broadcast over a 16-token block)."""
    pool = rand(2, 6, L, 1, H, D)                 # (2, pages, L, page_size 1, H, D)
    with pytest.raises(ConfigError, match="holds 1-token pages, not page_size 16"):
        SGLangHostLayout(pool, "page_first_direct", BS)
    with pytest.raises(ConfigError, match="holds 1-token pages, not page_size 16"):
        SGLangHostLayout(rand(6, L, 1, 1, D), "page_first_direct", BS, mla=True)
    assert SGLangHostLayout(pool, "page_first_direct", 1).block_tokens == 1


def test_sglang_pool_that_is_no_tensor_is_a_config_error():
    """The rank check reads the pool's shape: a pool with none (None, a
    list of K and V tensors, a bytearray) failed with an untyped
    AttributeError ('list' object has no attribute 'shape'); it is a
    ConfigError naming the shape expected."""
    for pool in (None, [rand(L, 8, H, D), rand(L, 8, H, D)], bytearray(16)):
        with pytest.raises(ConfigError, match="SGLang MHA pool .* expected"):
            SGLangHostLayout(pool, "layer_first", BS)


def test_sglang_pool_of_another_layouts_rank_is_refused(path):
    """SGLangHostLayout took a pool of any rank: a page_first_direct pool
    (2, pages, L, page_size, H, D) passed as page_first passed check() (its
    layers, heads and dims read from the right axes) and was cut into views
    of 5 dims, so a load of one block broadcast it over page_size pool pages
    (15 pages nobody named overwritten, no error) and a save failed with
    numpy's broadcast ValueError.  A pool whose rank or leading K/V axis does
    not fit the layout is a ConfigError naming both."""
    g = geom()
    pages = 4
    src = rand(2, pages * BS, L, H, D)
    with _store(path, g) as store:
        assert save_blocks(store, [b"a"], SGLangHostLayout(src, "page_first", BS), [1]) == 1
        direct = torch.zeros(2, 32, L, BS, H, D, dtype=torch.bfloat16)
        with pytest.raises(ConfigError, match=r"shape \(2, 32, 3, 16, 8, 16\) does not fit "
                                              r"layout 'page_first'"):
            load_blocks(store, [b"a"], SGLangHostLayout(direct, "page_first", BS), [0])
        assert not direct.any()        # no pool page written
        dst = torch.zeros_like(src)
        assert load_blocks(store, [b"a"], SGLangHostLayout(dst, "page_first", BS), [2]).wait() == 1
    assert dst[:, 2 * BS:3 * BS].view(torch.int16).numpy().tobytes() == \
        src[:, BS:2 * BS].view(torch.int16).numpy().tobytes()
    assert not dst[:, :2 * BS].any() and not dst[:, 3 * BS:].any()
    with pytest.raises(ConfigError, match=r"shape \(3, 3, 64, 8, 16\) does not fit"):
        SGLangHostLayout(rand(3, L, 4 * BS, H, D), "layer_first", BS)   # no (K, V) pair
    with pytest.raises(ConfigError, match=r"shape \(2, 3, 64, 1, 16\) does not fit"):
        SGLangHostLayout(rand(2, L, 4 * BS, 1, D), "layer_first", BS, mla=True)
    with pytest.raises(ConfigError, match=r"shape \(3, 64, 8, 16\) does not fit"):
        SGLangHostLayout(rand(L, 4 * BS, H, D), "layer_first", BS)


def test_hf_layers_of_another_shape_are_refused():
    """Every layer's pages are cut as layer 0's: a layer holding fewer
    tokens (a sliding-window layer of a DynamicCache) or other heads would
    be read and written past its tensor's end, so the layout refuses it."""
    full = [torch.zeros(1, 2, 4 * BS, D) for _ in range(2)]
    short = torch.zeros(1, 2, BS, D)                           # one page, not four
    with pytest.raises(ConfigError, match=r"layer 1 values have shape \(1, 2, 16, 16\)"):
        HFDynamicLayout(full, [full[0].clone(), short], BS)
    with pytest.raises(ConfigError, match=r"layer 1 keys have shape \(1, 1, 64, 16\)"):
        HFDynamicLayout([full[0], torch.zeros(1, 1, 4 * BS, D)], full, BS)
    assert HFDynamicLayout(full, [t.clone() for t in full], BS).layer_views(1)[1].shape[0] == 4


def test_vllm_layers_of_another_shape_are_refused(path):
    """Page ids are checked against layer 0's cache: a later layer with
    fewer pages failed mid-load with an untyped numpy error (a broadcast
    ValueError, an IndexError) after the earlier layers were written.  The
    layout refuses it up front."""
    caches = [torch.zeros(2, 4, BS, H, D, dtype=torch.bfloat16),
              torch.zeros(2, 2, BS, H, D, dtype=torch.bfloat16)]
    with pytest.raises(ConfigError, match=r"layer 1 cache has shape \(2, 2, 16, 8, 16\)"):
        VLLMLayout(caches)
    with pytest.raises(ConfigError, match=r"layer 1 cache has shape \(2, 16, 16\)"):
        VLLMLayout([torch.zeros(4, BS, D), torch.zeros(2, BS, D)], mla=True)


def test_layers_of_another_dtype_are_refused():
    """Only layer 0's K array was checked against the store's dtype: a later
    layer (or HF's values) of another element size was copied with layer
    0's strides, so a load into float16 HF values of a float32 store wrote
    past each token's row (past the tensor's end for its last head), and a
    vLLM layer failed in the scatter with numpy's broadcast ValueError after
    the reads.  The layouts refuse it as they refuse another shape."""
    with pytest.raises(ConfigError, match=r"layer 1 cache has dtype torch.float16, layer 0 "
                                          r"torch.float32"):
        VLLMLayout([torch.zeros(2, 4, BS, H, D), torch.zeros(2, 4, BS, H, D).half(),
                    torch.zeros(2, 4, BS, H, D)])
    keys = [torch.zeros(1, H, 2 * BS, D) for _ in range(L)]
    values = [torch.zeros(1, H, 2 * BS, D) for _ in range(L - 1)] + \
        [torch.zeros(1, H, 2 * BS, D, dtype=torch.float16)]
    with pytest.raises(ConfigError, match=rf"layer {L - 1} values have dtype torch.float16, "
                                          r"layer 0 keys torch.float32"):
        HFDynamicLayout(keys, values, BS)
    with pytest.raises(ConfigError, match=r"layer 1 cache has dtype float16, layer 0 float32"):
        VLLMLayout([np.zeros((4, BS, D), np.float32), np.zeros((4, BS, D), np.float16)],
                   mla=True)


def test_wait_layer_outside_the_store_layers_is_a_clear_error(path):
    """A bool (True, a flag passed for a layer) waited for layer 1 (False
    for layer 0) and returned as if that was asked: refused like 0.5.  A
    layer that is no int is refused for its type: "0" read 'layer 0 is not
    one of the store's 2 layers (0-1)', which 0 is."""
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    with _store(path, geom()) as store:
        save_blocks(store, [b"w0"], VLLMLayout(src), [0])
        h = load_blocks(store, [b"w0"], VLLMLayout(src), [1])
        for layer in (L, -1):
            with pytest.raises(ConfigError, match=f"layer {layer} is not one of the store's "
                                                  f"{L} layers"):
                h.wait_layer(layer)
        for layer in ("0", 0.5, True, False, np.True_):
            with pytest.raises(ConfigError, match=re.escape(
                    f"wait_layer: layer must be an int, got {layer!r} "
                    f"({type(layer).__name__})")):
                h.wait_layer(layer)
        assert h.wait_layer(L - 1) == 1 and h.wait() == 1


def test_load_wait_timeouts_are_kvblock_errors(path, monkeypatch):
    """wait()/wait_layer() past their timeout raise a KVBlockError (that is
    also a TimeoutError): one ``except KVBlockError`` covers a load."""
    from kvblock.errors import KVBlockError

    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    with _store(path, geom()) as store:
        save_blocks(store, [b"t0"], VLLMLayout(src), [0])
        gate = threading.Event()
        real_read = store.io.read

        def gated_read(batch):
            gate.wait(10)
            return real_read(batch)
        monkeypatch.setattr(store.io, "read", gated_read)
        h = load_blocks(store, [b"t0"], VLLMLayout(src), [1])
        with pytest.raises(KVBlockError, match="layer 0 not loaded within 0.01 s") as e:
            h.wait_layer(0, timeout=0.01)
        assert isinstance(e.value, TimeoutError)
        with pytest.raises(KVBlockError, match="load not finished within 0.01 s"):
            h.wait(timeout=0.01)
        gate.set()
        assert h.wait(timeout=10) == 1


def test_load_wait_timeouts_that_are_no_seconds_are_clear_errors(path):
    """wait(timeout="5") (a setting read as text) failed in threading with
    TypeError "'>' not supported between instances of 'str' and 'int'";
    NaN waited as a poll.  Each is a ConfigError naming the call; the load
    is unharmed and waits as asked."""
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    with _store(path, geom()) as store:
        save_blocks(store, [b"s0"], VLLMLayout(src), [0])
        dst = [torch.zeros_like(t) for t in src]
        h = load_blocks(store, [b"s0"], VLLMLayout(dst), [1])
        for bad in ("5", float("nan"), True, [1]):
            with pytest.raises(ConfigError, match=r"wait: timeout must be seconds \(a number "
                                                  rf">= 0\) or None, got {re.escape(repr(bad))}"):
                h.wait(timeout=bad)
            with pytest.raises(ConfigError, match=r"wait_layer: timeout must be seconds"):
                h.wait_layer(0, timeout=bad)
        assert h.wait_layer(0, timeout=np.float64(10)) == 1
        assert h.wait(timeout=10) == 1
        assert all(torch.equal(d[:, 1], s[:, 0]) for d, s in zip(dst, src))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("tiered", [False, True])
def test_a_read_only_cache_is_refused_up_front(path, engine, tiered):
    """A load into a read-only numpy cache is refused by load_blocks with a
    ConfigError naming the cache and the fix, before anything is read or
    pinned: it failed in the scatter with numpy's plain ValueError
    ('assignment destination is read-only') out of wait(), or out of
    load_blocks itself for blocks from the DRAM tier.  save_blocks, which
    only reads the cache, still takes it."""
    g = Geometry(L, H, D, "float16", BS)
    nb = 4
    src = [np.random.default_rng(i).standard_normal((2, nb, BS, H, D)).astype(np.float16)
           for i in range(L)]
    keys = [b"r0", b"r1"]
    kw = {"host_cache_bytes": 4 * g.block_bytes} if tiered else {}
    with _store(path, g, **kw) as store:
        save_blocks(store, keys, VLLMLayout(src), [0, 1])
        if engine == "vllm":
            dst = [np.zeros((2, nb, BS, H, D), np.float16) for _ in range(L)]
            dst[2].flags.writeable = False
            layout, where = VLLMLayout(dst), "layer 2"
        else:
            dst = np.zeros((2, L, nb * BS, H, D), np.float16)
            dst.flags.writeable = False
            layout, where = SGLangHostLayout(dst, "layer_first", BS), "layer 0"
        with pytest.raises(ConfigError, match=f"read-only.*{where}.*writeable"):
            load_blocks(store, keys, layout, [2, 3])
        assert store.regions.pins.sum() == 0
        assert store.counters["get_blocks"] == 0
        assert save_blocks(store, [b"x0"], layout, [0]) == 1


def test_a_cache_of_another_float_dtype_is_refused(path):
    """check() compared element sizes only: a float16 cache was saved into a
    bfloat16 store (and a bfloat16 store loaded into a float16 cache) as raw
    bits, so the model attended to garbage with no error.  Another float
    dtype is refused; same-size integer caches (raw bytes, e.g. SGLang's
    uint8 pools of fp8) still pass."""
    g = geom()
    half = [torch.randn(2, 4, BS, H, D).half() for _ in range(L)]
    with _store(path, g) as store:
        with pytest.raises(ConfigError, match=r"cache holds float16, the store's KV is bfloat16"):
            save_blocks(store, [b"x"], VLLMLayout(half), [0])
        assert save_blocks(store, [b"x"], VLLMLayout([rand(2, 4, BS, H, D) for _ in range(L)]),
                           [0]) == 1
        with pytest.raises(ConfigError, match=r"cache holds float16, the store's KV is bfloat16"):
            load_blocks(store, [b"x"], VLLMLayout(half), [0])
        raw = [np.zeros((2, 4, BS, H, D), np.int16) for _ in range(L)]
        assert load_blocks(store, [b"x"], VLLMLayout(raw), [1]).wait() == 1
        assert raw[0][:, 1].any()
    g8 = Geometry(L, H, D, "float8_e4m3fn", BS)
    with _store(path, g8) as store:
        e5 = [torch.zeros(2, 4, BS, H, D, dtype=torch.float8_e5m2) for _ in range(L)]
        with pytest.raises(ConfigError, match=r"cache holds float8_e5m2, the store's KV is float8_e4m3fn"):
            save_blocks(store, [b"y"], VLLMLayout(e5), [0])


def test_a_cache_of_another_byte_order_is_refused(path):
    """check() passed a numpy cache in big-endian byte order ('>f2' for a
    float16 store; its dtype name '>f2' is no float name): save_blocks copied
    its bytes as they lie, so the store held byte-swapped float16 and a load
    into a native cache handed back garbage values (a load into it likewise
    garbage).  A non-native byte order is refused, naming the fix."""
    g = Geometry(L, H, D, "float16", BS)
    rng = np.random.default_rng(7)
    native = [rng.standard_normal((2, 4, BS, H, D)).astype(np.float16) for _ in range(L)]
    swapped = [a.astype(">f2") for a in native]
    with _store(path, g) as store:
        with pytest.raises(ConfigError, match=r"byte order"):
            save_blocks(store, [b"x"], VLLMLayout(swapped), [1])
        assert store.lookup([b"x"]) == 0
        assert save_blocks(store, [b"x"], VLLMLayout(native), [1]) == 1
        with pytest.raises(ConfigError, match=r"byte order"):
            load_blocks(store, [b"x"], VLLMLayout([np.zeros_like(a) for a in swapped]), [0])
        dst = [np.zeros_like(a) for a in native]
        assert load_blocks(store, [b"x"], VLLMLayout(dst), [0]).wait() == 1
    for layer in range(L):   # bytes compared: the native round trip is exact
        assert dst[layer][:, 0].tobytes() == native[layer][:, 1].tobytes()
    bf = Geometry(L, H, D, "bfloat16", BS)   # raw-bytes integer caches too
    with _store(path, bf) as store, pytest.raises(ConfigError, match=r"byte order"):
        save_blocks(store, [b"y"], VLLMLayout([np.zeros((2, 4, BS, H, D), ">i2")
                                               for _ in range(L)]), [0])


def test_layouts_of_no_layers_other_ranks_or_no_page_size_are_clear_errors():
    """An empty cache list raised IndexError, HF tensors of another rank
    ValueError (unpacking), a page size of 0 ZeroDivisionError at the first
    copy: none of them said which cache or what to pass."""
    with pytest.raises(ConfigError, match="vLLM cache has no layers"):
        VLLMLayout([])
    with pytest.raises(ConfigError, match="HFDynamicLayout has no layers"):
        HFDynamicLayout([], [], BS)
    with pytest.raises(ConfigError, match=r"HFDynamicLayout: layer 0 keys have shape "
                                          r"\(8, 32, 16\), not \(1, heads, tokens, head_dim\)"):
        HFDynamicLayout([torch.zeros(H, 2 * BS, D)], [torch.zeros(H, 2 * BS, D)], BS)
    for bad in (0, -16, 2.0):
        with pytest.raises(ConfigError, match=rf"block_tokens must be a positive integer, "
                                              rf"got {bad}"):
            HFDynamicLayout([torch.zeros(1, H, 2 * BS, D)], [torch.zeros(1, H, 2 * BS, D)], bad)
        with pytest.raises(ConfigError, match=rf"page_size must be a positive integer, "
                                              rf"got {bad}"):
            SGLangHostLayout(rand(2, L, 4 * BS, H, D), "layer_first", bad)


def test_layers_that_are_no_arrays_are_clear_errors():
    """vLLM v1 hands its connector the KV caches as a dict (layer name ->
    tensor): VLLMLayout took the names for layers and failed with
    AttributeError ("'str' object has no attribute 'shape'"); a
    DynamicCache made with a config holds layers whose keys are None until
    the model fills them, and HFDynamicLayout.from_cache failed the same way.
    Each is now a ConfigError that says what was given and what to pass."""
    layer = torch.zeros(2, 4, BS, H, D, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"list\(kv_caches.values\(\)\)"):
        VLLMLayout({"model.layers.0.self_attn.attn": layer})
    with pytest.raises(ConfigError, match=r"vLLM cache layer 1 is NoneType, not an array"):
        VLLMLayout([layer, None])
    k = torch.zeros(1, H, 2 * BS, D, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"HFDynamicLayout layer 0 is NoneType"):
        HFDynamicLayout([None], [None], BS)
    with pytest.raises(ConfigError, match=r"HFDynamicLayout values layer 1 is NoneType"):
        HFDynamicLayout([k, k], [k, None], BS)
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64,
                                      num_attention_heads=H, num_key_value_heads=H)
    cache = transformers.DynamicCache(config=config)
    with pytest.raises(ConfigError, match=r"HFDynamicLayout layer 0 is NoneType"):
        HFDynamicLayout.from_cache(cache, BS)


def test_caches_that_are_no_sequence_of_layers_are_clear_errors():
    """VLLMLayout(None) (caches not allocated yet) or of one number failed
    with TypeError "'NoneType' object is not iterable" from list(), naming
    neither the layout nor what to pass; HFDynamicLayout's values too."""
    k = torch.zeros(1, H, 2 * BS, D, dtype=torch.bfloat16)
    for bad in (None, 5):
        with pytest.raises(ConfigError, match=rf"vLLM cache is {type(bad).__name__}, not a "
                                              r"sequence of layers: pass one cache tensor "
                                              r"per layer"):
            VLLMLayout(bad)
        with pytest.raises(ConfigError, match=rf"HFDynamicLayout is {type(bad).__name__}, not"):
            HFDynamicLayout(bad, [k], BS)
        with pytest.raises(ConfigError, match=rf"HFDynamicLayout values is "
                                              rf"{type(bad).__name__}, not"):
            HFDynamicLayout([k], bad, BS)


def test_hf_layout_of_numpy_arrays_is_a_clear_error():
    """HFDynamicLayout took numpy (or any non-torch) arrays, then failed at
    the first layer_views (check, save, load) with AttributeError "'numpy.
    ndarray' object has no attribute 'permute'": its pages are torch views.
    A DynamicCache holds torch tensors; anything else is a ConfigError up front."""
    k = np.zeros((1, H, 2 * BS, D), np.float16)
    with pytest.raises(ConfigError, match=r"HFDynamicLayout layer 0 keys are a numpy\.ndarray, "
                                          r"not a torch tensor"):
        HFDynamicLayout([k], [k], BS)
    t = torch.zeros(1, H, 2 * BS, D, dtype=torch.float16)
    with pytest.raises(ConfigError, match=r"HFDynamicLayout layer 1 values are a numpy"):
        HFDynamicLayout([t, t], [t, k], BS)


def test_a_load_counts_its_bytes_and_misses_as_other_reads_do(path):
    """A layer-wise load counted its blocks (get_blocks) but not their bytes
    (get_bytes: what the read returned, bytes_read: what it read from the
    device), nor a load that found nothing (miss_gets): stats() showed no
    read traffic for a restore of the whole prefix."""
    g = geom(groups=2)
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    keys = [b"c0", b"c1", b"c2", b"c3"]
    with _store(path, g) as store:
        save_blocks(store, keys, VLLMLayout(src), [0, 1, 2, 3])
        c = store.counters
        out = np.zeros(4 * g.block_bytes, np.uint8)
        before = dict(c)
        assert store.get_run(keys, out) == 4
        get_run = {k: c[k] - before[k] for k in ("get_blocks", "get_bytes", "bytes_read")}
        before = dict(c)
        dst = [torch.zeros(2, 4, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        h = load_blocks(store, keys, VLLMLayout(dst), [0, 1, 2, 3])
        assert h.wait() == 4
        assert {k: c[k] - before[k] for k in get_run} == get_run   # the same blocks, all heads
        assert h.bytes_read == get_run["bytes_read"]
        before = dict(c)
        part = [torch.zeros(2, 4, BS, H // 2, D, dtype=torch.bfloat16) for _ in range(L)]
        h = load_blocks(store, keys, VLLMLayout(part), [0, 1, 2, 3], tp_rank=1, tp_size=2)
        assert h.wait() == 4
        assert c["get_blocks"] - before["get_blocks"] == 4
        assert c["get_bytes"] - before["get_bytes"] == 4 * g.block_bytes // 2   # its heads
        assert c["bytes_read"] - before["bytes_read"] == h.bytes_read > 0
        before = dict(c)
        assert load_blocks(store, [b"nothing"], VLLMLayout(dst), [0]).wait() == 0
        assert c["miss_gets"] - before["miss_gets"] == 1
        assert c["get_blocks"] == before["get_blocks"]


def test_a_failed_load_reports_no_blocks_loaded(path):
    """EIO on run b's layer-1 range: layer 1 and those after it were never
    loaded, yet handle.blocks still said the whole prefix was ("the number
    of leading pages loaded, final after wait").  It is 0 once the load
    failed, and every layer's waiter gets the typed error."""
    from kvblock.errors import IOFailedError
    from tests.support.faults import BadSectors

    src = [rand(2, 8, BS, H, D) for _ in range(L)]
    a, b = ([f"{x}{i}".encode() for i in range(4)] for x in "ab")
    with _store(path, geom()) as store:
        save_blocks(store, a, VLLMLayout(src), [0, 1, 2, 3])
        save_blocks(store, b, VLLMLayout(src), [4, 5, 6, 7])
        run_b = store.index.locate(normalize_keys(b)[0])[0]
        dev, off = store.regions.address(run_b.region, run_b.offset)
        bad = BadSectors()
        bad.add(dev, off + store.layout(4).range_offset(1, 0), 4096)
        bad.install(store)
        dst = [torch.zeros(2, 8, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        h = load_blocks(store, a + b, VLLMLayout(dst), list(range(8)))
        with pytest.raises(IOFailedError):
            h.wait()
        assert h.blocks == 0
        for layer in range(L):
            with pytest.raises(IOFailedError):
                h.wait_layer(layer)
        assert store.regions.pins.sum() == 0


def test_a_load_whose_probe_of_unreadable_runs_fails_still_ends_and_unpins(path, monkeypatch):
    """A layer-wise load meeting two failed I/Os (runs a and b unreadable in
    layer 1) has _read_failed read each run again to tell which: that probe
    allocates a buffer, which can fail (ConfigError: host memory cannot be
    mapped).  Its error came out of the scatter thread, past the unpin and
    past handle._fail: wait() never returned and the runs stayed pinned for
    good.  The load fails with the device's error, no pin is left, and the
    runs that could not be told apart are dropped."""
    from kvblock.errors import IOFailedError
    from kvblock.store import reads
    from tests.support.faults import BadSectors

    src = [rand(2, 8, BS, H, D) for _ in range(L)]
    a, b = ([f"{x}{i}".encode() for i in range(4)] for x in "ab")
    with _store(path, geom()) as store:
        save_blocks(store, a, VLLMLayout(src), [0, 1, 2, 3])
        save_blocks(store, b, VLLMLayout(src), [4, 5, 6, 7])
        bad = BadSectors()
        for keys in (a, b):
            run = store.index.locate(normalize_keys(keys)[0])[0]
            dev, off = store.regions.address(run.region, run.offset)
            bad.add(dev, off + store.layout(4).range_offset(1, 0), 4096)
        bad.install(store)

        def no_memory(*args, **kwargs):
            raise ConfigError("4194304 bytes of host memory cannot be mapped: "
                              "Cannot allocate memory")
        monkeypatch.setattr(reads, "HostBuffer", no_memory)
        dst = [torch.zeros(2, 8, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        h = load_blocks(store, a + b, VLLMLayout(dst), list(range(8)))
        done = _error_within(10, h.wait)
        assert isinstance(done[0], IOFailedError), done[0]
        assert store.regions.pins.sum() == 0
        assert store.lookup(a) == 0 and store.lookup(b) == 0


def _served_load(tmp_path, path, monkeypatch, lapse):
    """Save a prefix through a store server, then load it while the server
    goes away as ``lapse(server, job)`` says; the client's counters before and
    after, and how the load ended."""
    from kvblock.store.client import RemoteStore
    from kvblock.store.server import serve_in_background
    from kvblock.tensors import transfer

    _store(path, geom()).close()
    sock = str(tmp_path / "kv.sock")
    server = serve_in_background([path], sock)
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    keys = [b"p0", b"p1", b"p2", b"p3"]
    try:
        with RemoteStore(sock) as r:
            save_blocks(r, keys, VLLMLayout(src), [0, 1, 2, 3])
            lapse(server, r, monkeypatch, transfer)
            before = dict(r.counters)
            dst = [torch.zeros(2, 4, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
            h = load_blocks(r, keys, VLLMLayout(dst), [0, 1, 2, 3])
            # ServerGoneError, as every other call meeting a server gone:
            # a caller retrying after a reconnect catches that one
            with pytest.raises(ServerGoneError, match="pins lapsed"):
                h.wait(10)
            for layer in range(L):
                with pytest.raises(ServerGoneError):
                    h.wait_layer(layer, 10)
            assert h.blocks == 0
            after = dict(r.counters)
    finally:
        server.stop()
    return before, after


def test_a_load_whose_pins_lapse_at_their_release_counts_a_lapse_not_its_blocks(
        tmp_path, path, monkeypatch):
    """Every layer was handed over under pins that held, then the server went
    away before the load released them: the load fails (PINS_LAPSED), yet its
    blocks had already gone into get_blocks / get_bytes, and lapsed_pin_gets
    stayed 0.  A read unpins first, then counts its blocks or the lapse
    (README: such a read is a miss, counted in lapsed_pin_gets)."""
    def at_the_release(server, r, monkeypatch, transfer):
        real = r._unpin

        def server_gone_first(segs):
            server.stop()
            return real(segs)
        monkeypatch.setattr(r, "_unpin", server_gone_first)

    before, after = _served_load(tmp_path, path, monkeypatch, at_the_release)
    assert after["get_blocks"] == before["get_blocks"]
    assert after["get_bytes"] == before["get_bytes"]
    assert after["lapsed_pin_gets"] == before["lapsed_pin_gets"] + 1


def test_a_load_whose_server_goes_away_between_layers_counts_a_lapse(
        tmp_path, path, monkeypatch):
    """The server goes away while layer 1 is read: layers 1 and 2 are not
    handed over (StoreClosedError for every waiter, no blocks), and the load
    is a lapsed read as a get_run under pins that lapsed is."""
    def mid_load(server, r, monkeypatch, transfer):
        real = transfer._LoadJob._read_batch

        def read_batch(job, batch):
            if batch[0][0] == 1 and batch[0][1] == 0:
                server.stop()
            return real(job, batch)
        monkeypatch.setattr(transfer._LoadJob, "_read_batch", read_batch)

    before, after = _served_load(tmp_path, path, monkeypatch, mid_load)
    assert after["get_blocks"] == before["get_blocks"]
    assert after["lapsed_pin_gets"] == before["lapsed_pin_gets"] + 1


def test_a_load_whose_rank_is_closed_between_layers_is_no_server_gone(
        tmp_path, path, monkeypatch):
    """The rank itself is closed while layer 1 is read (its pins go with its
    connection): the load fails with StoreClosedError, not ServerGoneError
    saying the server went away, on which a caller would wait for a
    reconnect that a closed rank never makes."""
    from kvblock.errors import StoreClosedError
    from kvblock.store.client import RemoteStore
    from kvblock.store.server import serve_in_background
    from kvblock.tensors import transfer

    _store(path, geom()).close()
    sock = str(tmp_path / "kv.sock")
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    keys = [b"p0", b"p1", b"p2", b"p3"]
    with serve_in_background([path], sock):
        r = RemoteStore(sock)
        save_blocks(r, keys, VLLMLayout(src), [0, 1, 2, 3])
        real = transfer._LoadJob._read_batch
        closer = threading.Thread(target=r.close)

        def read_batch(job, batch):
            if batch[0][0] == 1 and batch[0][1] == 0 and closer.ident is None:
                closer.start()                    # waits for the load's read
                while r._session.gone is None and closer.is_alive():
                    time.sleep(0.001)
            return real(job, batch)
        monkeypatch.setattr(transfer._LoadJob, "_read_batch", read_batch)
        dst = [torch.zeros(2, 4, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        h = load_blocks(r, keys, VLLMLayout(dst), [0, 1, 2, 3])
        with pytest.raises(StoreClosedError, match="closed during the load") as e:
            h.wait(10)
        assert not isinstance(e.value, ServerGoneError)
        closer.join(20)
        assert not closer.is_alive()


def test_two_loads_meeting_one_damaged_run_count_it_once(path, monkeypatch):
    """Two layer-wise loads in flight together both read run b, whose last
    layer is corrupt: each added a checksum failure (2 for one damaged run)
    and dropped it again.  Reads count and drop a damaged run once (the
    store remembers the run ids it found damaged); so do loads, and a load
    and a read alike."""
    from kvblock.tensors import transfer

    src, a, b = _saved_with_run_b_damaged(path)
    with KVStore.open([path]) as store:
        both_pinned = threading.Barrier(2, timeout=10)
        real, first = transfer._LoadJob._read_batch, set()

        def read_batch(job, batch):
            if id(job) not in first:       # each load's first read: both hold their pins
                first.add(id(job))
                both_pinned.wait()
            return real(job, batch)
        monkeypatch.setattr(transfer._LoadJob, "_read_batch", read_batch)
        dsts = [[torch.zeros(2, 6, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
                for _ in range(2)]
        handles = [load_blocks(store, a + b, VLLMLayout(d), [0, 1, 2, 3]) for d in dsts]
        assert [h.wait(10) for h in handles] == [2, 2]
        assert store.counters["checksum_failures"] == 1
        assert store.lookup(a + b) == 2
        monkeypatch.setattr(transfer._LoadJob, "_read_batch", real)
        assert store.regions.pins.sum() == 0


class _LoggedStream:
    """A CUDA stream stood in on the CPU: what is asked of it, in ``log``."""

    def __init__(self, log: list, owner: str):
        self.log, self.owner = log, owner

    def synchronize(self):
        self.log.append(("sync", self.owner))

    def wait_event(self, event):
        self.log.append(("wait", self.owner, event.recorded_on))

    def wait_stream(self, other):
        self.log.append(("wait", self.owner, other.owner))


def test_a_damaged_run_whose_drop_failed_is_dropped_by_the_next_load(path, monkeypatch):
    """A load met a damaged run and could not drop it (the drop raised: a
    served store's server gone at that moment); the load stands, and the
    next load that meets the run drops it (counted once in all)."""
    from kvblock.errors import StoreClosedError

    src, a, b = _saved_with_run_b_damaged(path)
    with KVStore.open([path]) as store:
        real, calls = store._drop_runs, []

        def gone_once(runs, *args, **kwargs):
            calls.append(runs)
            if len(calls) == 1:
                raise StoreClosedError("the store server went away")
            return real(runs, *args, **kwargs)
        monkeypatch.setattr(store, "_drop_runs", gone_once)
        dst = [torch.zeros(2, 6, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        assert load_blocks(store, a + b, VLLMLayout(dst), [0, 1, 2, 3]).wait(10) == 2
        assert store.lookup(a + b) == 4                   # its drop failed: still indexed
        assert load_blocks(store, a + b, VLLMLayout(dst), [0, 1, 2, 3]).wait(10) == 2
        assert store.lookup(a + b) == 2, "the run stayed indexed, a hit no load returns"
        assert store.counters["checksum_failures"] == 1


def _stand_in_torch_streams(monkeypatch, log: list, fail_at: int | None = None) -> list:
    """Loads into a CUDA cache (device 0) stood in on the CPU: torch's
    streams and events faked per thread, what is asked of them in ``log``
    with each scatter ("scatter", its stream, its thread); the scatter
    number ``fail_at`` (from 0) raises OSError.  Returns the list of the
    devices streams were made for."""
    from kvblock.tensors import transfer

    local = threading.local()           # torch's current stream: per thread
    defaults, made = {}, []

    def current_stream(device=None):
        me = threading.current_thread().name
        return getattr(local, "stream", None) or defaults.setdefault(me, _LoggedStream(log, me))

    class FakeStream(_LoggedStream):
        def __init__(self, device=None):
            super().__init__(log, f"load stream {len(made)}")
            made.append(device)

    @contextlib.contextmanager
    def stream(s):
        was, local.stream = getattr(local, "stream", None), s
        try:
            yield
        finally:
            local.stream = was

    class FakeEvent:
        def __init__(self, *a, **kw):
            self.recorded_on = None

        def record(self, stream=None):
            self.recorded_on = (stream or current_stream()).owner

    real_scatter = transfer._scatter_pages

    def scatter(*args, **kw):
        log.append(("scatter", current_stream().owner, threading.current_thread().name))
        if sum(e[0] == "scatter" for e in log) - 1 == fail_at:
            raise OSError("a scatter failed")
        return real_scatter(*args, **kw)

    monkeypatch.setattr(transfer, "_cuda_device", lambda layout: torch.device("cuda", 0))
    monkeypatch.setattr(transfer, "_scatter_pages", scatter)
    monkeypatch.setattr(transfer, "_LOAD_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return made


def test_a_failed_load_into_a_cuda_cache_settles_its_stream_before_it_fails(path, monkeypatch):
    """A load into a CUDA cache that fails part way (here its second
    scatter raises) settles the loads' stream before wait() raises: its
    copies still queued would land in pages the caller reuses once the
    load failed (recomputing them), and read staging freed meanwhile."""
    log = []
    _stand_in_torch_streams(monkeypatch, log, fail_at=1)
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    keys = [b"f0", b"f1"]
    with _store(path, geom()) as store:
        save_blocks(store, keys, VLLMLayout(src), [0, 1])
        dst = [torch.zeros(2, 4, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        h = load_blocks(store, keys, VLLMLayout(dst), [2, 3])
        with pytest.raises(OSError, match="a scatter failed"):
            h.wait(timeout=30)
    failed = [i for i, e in enumerate(log) if e[0] == "scatter"][1]
    assert ("sync", "load stream 0") in log[failed:], log


def test_a_background_load_into_a_cuda_cache_waits_for_the_callers_stream(path, monkeypatch):
    """A background load scatters on its own thread and stream, not the
    caller's: work the caller had queued on its stream before load_blocks
    (zeroing the pages, a previous layer's copy) was not waited for, so it
    could land in the pages after the load's writes.  The load's stream
    now waits for an event recorded on the caller's stream when the load
    was started, before it writes a page.  And the copies go on the loads'
    own non-blocking stream, not the scatter thread's default one (the
    legacy default stream, where they waited for all the model's work
    queued there, and the kvikio path's scatters for kvikio's copies in
    flight), settled before each layer is handed over.  Stood in on the
    CPU: fake streams and events, per thread, logged in order."""
    log = []
    made = _stand_in_torch_streams(monkeypatch, log)
    src = [rand(2, 4, BS, H, D) for _ in range(L)]
    keys = [b"s0", b"s1"]
    caller = threading.current_thread().name
    with _store(path, geom()) as store:
        save_blocks(store, keys, VLLMLayout(src), [0, 1])
        for _ in range(2):
            dst = [torch.zeros(2, 4, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
            h = load_blocks(store, keys, VLLMLayout(dst), [2, 3])
            assert h.wait(timeout=30) == 2
            for layer in range(L):
                assert torch.equal(dst[layer][:, 2:4].view(torch.int16),
                                   src[layer][:, :2].view(torch.int16))
    assert made == [torch.device("cuda", 0)], "one loads' stream, made once"
    scatters = [i for i, e in enumerate(log) if e[0] == "scatter"]
    assert len(scatters) == 2 * L, log
    assert {log[i][1] for i in scatters} == {"load stream 0"}, log   # not the thread's default
    assert log[scatters[0]][2] != caller, log     # a background load: on its own thread
    assert ("wait", "load stream 0", caller) in log[:scatters[0]], log
    assert ("sync", "load stream 0") in log[scatters[-1]:], "the last layer was handed over unsettled"
    assert not any(e[0] == "sync" and e[1] != "load stream 0" for e in log), log


def _stand_in_cuda_hits(monkeypatch, log: list, fail_at: int | None = None) -> None:
    """_stand_in_torch_streams, and DRAM-tier hits into the CUDA cache
    (_host_hits_into_cuda) stood in too: their device staging made in CPU
    memory, its record_stream logged; each sync logged with its thread."""
    from kvblock.tensors import transfer

    _stand_in_torch_streams(monkeypatch, log, fail_at=fail_at)
    monkeypatch.setattr(transfer, "_HITS_STREAMS", {})
    empty = torch.empty

    def cpu_empty(*shape, device=None, **kw):
        return empty(*shape, **kw)      # (the stand-in's "cuda" memory: the CPU's)
    monkeypatch.setattr(torch, "empty", cpu_empty)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda t, stream: log.append(("record", stream.owner)), raising=False)
    monkeypatch.setattr(_LoggedStream, "synchronize", lambda s: s.log.append(
        ("sync", s.owner, threading.current_thread().name)))


def test_a_dram_hit_load_into_a_cuda_cache_that_fails_settles_before_it_raises(
        path, monkeypatch):
    """DRAM-tier hits into a CUDA cache are scattered on the loads' stream
    in load_blocks' own call: one that failed part way (a scatter raised)
    raised with the stretch's earlier scatters still queued there, to land
    in pages the caller reuses (recomputes) once the load failed, racing
    its writes on its own stream.  The stream is settled before it raises
    (as a failed device load's); the device stretch's pins are released
    and nothing is counted as loaded.  Stood in on the CPU."""
    from kvblock.tensors import transfer

    log = []
    # scatters: the DRAM key 0's L layers, then key 2's first, then its second fails
    _stand_in_cuda_hits(monkeypatch, log, fail_at=L + 1)
    g = geom()
    n = 4
    src = [rand(2, n, BS, H, D) for _ in range(L)]
    keys = [f"x{i}".encode() for i in range(n)]
    with _store(path, g, host_cache_bytes=(n + 2) * g.block_bytes) as store:
        _interleaved_dram_and_device(store, keys, src)   # DRAM, device, DRAM, device
        before = store.stats()
        dst = [torch.zeros(2, n, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        with pytest.raises(OSError, match="a scatter failed"):
            load_blocks(store, keys, VLLMLayout(dst), list(range(n)))
        assert store.regions.pins.sum() == 0
        after = store.stats()
        for name in ("get_blocks", "host_hit_blocks", "device_hit_blocks"):
            assert after[name] == before[name], name
        loads = transfer._LOAD_STREAMS[("torch", 0)].owner
    scatters = [i for i, e in enumerate(log) if e[0] == "scatter"]
    assert len(scatters) == L + 2 and all(log[i][1] == loads for i in scatters), log
    assert any(e[:2] == ("sync", loads) for e in log[scatters[-1]:]), \
        f"the failed stretch's scatters were left queued: {log}"


def test_a_load_with_no_dram_hits_does_not_wait_for_the_callers_gpu_work(path, monkeypatch):
    """With a DRAM tier, every load into a CUDA cache asks it for hits in
    load_blocks' own call (_host_hits_into_cuda): the loads' stream waits
    for the caller's work queued so far, and is settled before the call
    goes on.  With no block in DRAM (the first key a miss) nothing was
    scattered, yet the stream was settled all the same: a background
    load_blocks blocked its caller until the model's queued GPU work was
    done (before, a load with no hits touched no stream).  Only the load's
    own thread settles it now.  Stood in on the CPU; bytes identical."""
    log = []
    _stand_in_cuda_hits(monkeypatch, log)
    g = geom()
    n = 4
    src = [rand(2, n, BS, H, D) for _ in range(L)]
    keys = [f"y{i}".encode() for i in range(n)]
    caller = threading.current_thread().name
    with _store(path, g, host_cache_bytes=(n + 2) * g.block_bytes) as store:
        assert save_blocks(store, keys, VLLMLayout(src), list(range(n))) == n
        for k in normalize_keys(keys):
            assert store.host.discard(k)
        dst = [torch.zeros(2, n, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        h = load_blocks(store, keys, VLLMLayout(dst), list(range(n)))
        assert h.wait(timeout=30) == n
        assert store.stats()["device_hit_blocks"] == n
    for layer in range(L):
        assert torch.equal(dst[layer].view(torch.int16), src[layer].view(torch.int16))
    assert not [e for e in log if e[0] == "sync" and e[2] == caller], log


class _CupyLike:
    """Stands in for a cupy array on the CPU: device memory in the ways
    kvblock meets it (__cuda_array_interface__, .get() for a host copy,
    indexing, views, setitem from device arrays) and, as cupy, refusing the
    implicit conversions from and to numpy.  Tests that write one install
    a cupy module whose asarray makes one (_cupy_module)."""

    __module__ = "cupy._core.core"

    def __init__(self, a):
        self._a = a

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    itemsize = property(lambda self: self._a.itemsize)
    ndim = property(lambda self: self._a.ndim)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self._a.shape, "typestr": self._a.dtype.str, "version": 3,
                "data": (self._a.ctypes.data, False), "strides": self._a.strides}

    def __array__(self, *a, **k):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def get(self):
        return self._a.copy()

    def _unwrap(self, x):
        if isinstance(x, _CupyLike):
            return x._a
        if isinstance(x, tuple):
            return tuple(self._unwrap(i) for i in x)
        return x

    def __getitem__(self, idx):
        return _CupyLike(self._a[self._unwrap(idx)])

    def __setitem__(self, idx, value):
        if isinstance(value, np.ndarray) and value.ndim:
            # as cupy 14 does (seen on an H200): no implicit host copy
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        self._a[self._unwrap(idx)] = self._unwrap(value)

    def view(self, dtype):
        return _CupyLike(self._a.view(dtype))

    def reshape(self, *shape):
        return _CupyLike(self._a.reshape(*shape))

    def transpose(self, *axes):
        return _CupyLike(self._a.transpose(*axes))


def _cupy_module(array_class=_CupyLike, **cuda):
    """A stand-in cupy module: asarray copies a host array into
    ``array_class`` ("device memory"), ``cuda`` its cuda namespace."""
    import types

    cupy = types.ModuleType("cupy")
    cupy.asarray = lambda a: array_class(np.array(a))
    cupy.cuda = types.SimpleNamespace(**cuda)
    return cupy


def test_a_cupy_cache_saves_and_loads(path, monkeypatch):
    """cupy arrays are documented cache types (kvblock.tensors); a save from
    one copied the gathered pages into host staging with numpy's implicit
    conversion (staging[...] = pages), which cupy refuses with TypeError:
    every save from a cupy cache failed.  A load scattered host staging
    into it the same way (cache[ids] = staging), which cupy refuses with
    ValueError: every load into one failed (seen on an H200)."""
    import sys

    monkeypatch.setitem(sys.modules, "cupy", _cupy_module())
    g = Geometry(L, H, D, "float16", BS)
    rng = np.random.default_rng(7)
    src_np = [rng.standard_normal((2, 6, BS, H, D)).astype(np.float16) for _ in range(L)]
    dst_np = [np.zeros_like(s) for s in src_np]
    keys = [b"c0", b"c1", b"c2"]
    with _store(path, g) as store:
        assert save_blocks(store, keys, VLLMLayout([_CupyLike(s) for s in src_np]),
                           [4, 0, 2]) == 3
        assert load_blocks(store, keys, VLLMLayout([_CupyLike(d) for d in dst_np]),
                           [1, 3, 5]).wait(timeout=30) == 3
    for layer in range(L):
        assert np.array_equal(dst_np[layer][:, [1, 3, 5]].view(np.int16),
                              src_np[layer][:, [4, 0, 2]].view(np.int16))


def test_a_load_into_a_cupy_cache_settles_cupys_stream(path, monkeypatch):
    """A torch CUDA cache has each layer's copies waited for on the
    scatter thread's stream before the layer is handed over (and the
    caller's queued work waited for before the first write); a cupy cache
    had neither (only torch devices were seen as CUDA): its layer was
    handed over with cupy's copies still queued, for a consumer on another
    stream to read before they land.  Stood in on the CPU: _CupyLike on a
    fake device and a fake cupy module whose per-thread streams log."""
    import sys
    import types

    from kvblock.tensors import transfer

    log = []
    streams = {}
    local = threading.local()        # cupy's current stream: per thread

    def get_current_stream(device_id=None):
        assert device_id == 0
        me = threading.current_thread().name
        return getattr(local, "stream", None) or streams.setdefault(me, _LoggedStream(log, me))

    class FakeStream(_LoggedStream):
        def __init__(self, non_blocking=False):
            assert non_blocking and current[0] == 0, "the loads' stream: non-blocking, on GPU 0"
            super().__init__(log, "load stream")

        def __enter__(self):
            self.was, local.stream = getattr(local, "stream", None), self

        def __exit__(self, *exc):
            local.stream = self.was

    current = [1]       # the caller's current device: another GPU than the cache's

    class FakeDevice:
        def __init__(self, id):
            self.id = id

        def __enter__(self):
            self.was, current[0] = current[0], self.id

        def __exit__(self, *exc):
            current[0] = self.was

    class FakeEvent:
        recorded_on = None

        def __init__(self):
            self.device = current[0]

        def record(self, stream=None):
            # CUDA records no event on another device's stream
            assert self.device == 0, "event made on another device than its stream's"
            self.recorded_on = (stream or get_current_stream(0)).owner

    monkeypatch.setitem(sys.modules, "cupy", _cupy_module(
        get_current_stream=get_current_stream, Event=FakeEvent, Device=FakeDevice,
        Stream=FakeStream))
    monkeypatch.setattr(transfer, "_LOAD_STREAMS", {})

    class OnDevice(_CupyLike):
        device = types.SimpleNamespace(id=0)

        def __getitem__(self, idx):
            return OnDevice(self._a[self._unwrap(idx)])

    real_scatter = transfer._scatter_pages

    def scatter(*args, **kw):
        log.append(("scatter", threading.current_thread().name))
        return real_scatter(*args, **kw)

    monkeypatch.setattr(transfer, "_scatter_pages", scatter)
    g = Geometry(L, H, D, "float16", BS)
    rng = np.random.default_rng(3)
    src = [rng.standard_normal((2, 4, BS, H, D)).astype(np.float16) for _ in range(L)]
    dst = [np.zeros_like(s) for s in src]
    keys = [b"s0", b"s1"]
    caller = threading.current_thread().name
    with _store(path, g) as store:
        save_blocks(store, keys, VLLMLayout(src), [0, 1])
        assert load_blocks(store, keys, VLLMLayout([OnDevice(d) for d in dst]),
                           [2, 3]).wait(timeout=30) == 2
    for layer in range(L):
        assert np.array_equal(dst[layer][:, 2:4].view(np.int16), src[layer][:, :2].view(np.int16))
    scatters = [i for i, e in enumerate(log) if e[0] == "scatter"]
    assert scatters, log
    worker = log[scatters[0]][1]
    assert worker != caller, log
    # on the loads' own stream (not the thread's default: the legacy stream)
    assert ("wait", "load stream", caller) in log[:scatters[0]], log
    assert ("sync", "load stream") in log[scatters[-1]:], "the last layer was handed over unsettled"
    assert not any(e[0] == "sync" and e[1] != "load stream" for e in log), log


def test_a_load_into_a_cupy_cache_on_another_gpu_scatters_on_that_gpu(path, monkeypatch):
    """cupy launches a kernel (a setitem's scatter, the host copy it makes)
    on the thread's current device, and a thread starts on device 0: the
    load's scatter thread wrote a cupy cache on GPU 1 from device 0 (cupy
    refuses that without peer access; with it, the copies were queued on
    device 0's stream while the layer was settled on device 1's, handed
    over before they landed).  The scatter thread now makes the cache's
    device current.  Stood in on the CPU: a per-thread current device,
    and a cupy-like cache on device 1 that refuses a write from another."""
    import sys
    import types

    from kvblock.tensors import transfer


    local = threading.local()            # CUDA's current device: per thread, 0 at first
    current = lambda: getattr(local, "device", 0)    # noqa: E731
    writes = []

    class FakeDevice:
        def __init__(self, id):
            self.id = id

        def __enter__(self):
            self.was, local.device = current(), self.id

        def __exit__(self, *exc):
            local.device = self.was

    class FakeStream:
        def synchronize(self):
            pass

        def wait_event(self, event):
            pass

    class FakeEvent:
        def record(self, stream=None):
            pass

    class LoadStream(FakeStream):
        def __init__(self, non_blocking=False):
            self.device = current()          # CUDA makes a stream on the current device

        def __enter__(self):
            pass

        def __exit__(self, *exc):
            pass

    monkeypatch.setitem(sys.modules, "cupy", _cupy_module(
        get_current_stream=lambda device_id=None: FakeStream(), Event=FakeEvent,
        Device=FakeDevice, Stream=LoadStream))
    monkeypatch.setattr(transfer, "_LOAD_STREAMS", {})

    class OnGpu1(_CupyLike):
        device = types.SimpleNamespace(id=1)

        def __getitem__(self, idx):
            return OnGpu1(self._a[self._unwrap(idx)])

        def __setitem__(self, idx, value):
            writes.append(current())
            if current() != 1:
                raise ValueError(f"The device where the array resides (1) is different "
                                 f"from the current device ({current()}).")
            super().__setitem__(idx, value)

        def view(self, dtype):
            return OnGpu1(self._a.view(dtype))

    g = Geometry(L, H, D, "float16", BS)
    rng = np.random.default_rng(5)
    src = [rng.standard_normal((2, 4, BS, H, D)).astype(np.float16) for _ in range(L)]
    dst = [np.zeros_like(s) for s in src]
    keys = [b"g0", b"g1"]
    with _store(path, g) as store:
        save_blocks(store, keys, VLLMLayout(src), [0, 1])
        with FakeDevice(1):              # the caller works on GPU 1, as its cache
            assert load_blocks(store, keys, VLLMLayout([OnGpu1(d) for d in dst]),
                               [2, 3]).wait(timeout=30) == 2
    assert writes and set(writes) == {1}, writes
    assert [st.device for st in transfer._LOAD_STREAMS.values()] == [1]   # the cache's GPU's
    for layer in range(L):
        assert np.array_equal(dst[layer][:, 2:4].view(np.int16), src[layer][:, :2].view(np.int16))


def test_a_dram_stretch_looks_up_only_its_own_keys(path, monkeypatch):
    """A load from a store with a DRAM tier takes the leading stretch of
    keys held there, then a stretch from the device, then DRAM again...
    Each DRAM stretch looked up the run of every key left to load (to date
    the copies), not only of the keys it took: a load alternating DRAM and
    device stretches cost quadratic Python work under the store's lock
    (2K keys, 1K stretches: 1M lookups, +1.7 s a load).  Only the stretch's
    keys (and the one that ends it) are looked up; the bytes are the same."""
    from kvblock.tensors import transfer

    g = geom()
    n = 64
    src = [rand(2, n, BS, H, D) for _ in range(L)]
    keys = [f"k{i}".encode() for i in range(n)]
    with _store(path, g, host_cache_bytes=(n + 2) * g.block_bytes) as store:
        assert save_blocks(store, keys, VLLMLayout(src), list(range(n))) == n
        for k in normalize_keys(keys[1:]):       # only the first key in DRAM
            store.host.discard(k)
        inside, looked = [False], []
        real_load, real_lookup = transfer._load_from_host, store.index.lookup

        def load_from_host(*a):
            inside[0] = True
            try:
                return real_load(*a)
            finally:
                inside[0] = False

        def lookup(ks):
            if inside[0]:
                looked.append(len(ks))
            return real_lookup(ks)
        monkeypatch.setattr(transfer, "_load_from_host", load_from_host)
        monkeypatch.setattr(store.index, "lookup", lookup)
        dst = [torch.zeros(2, n, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        assert load_blocks(store, keys, VLLMLayout(dst), list(range(n))).wait() == n
        # the stretch's one key and the one after, then the hit's own count
        # (_host_hits_used: the keys taken); not the 63 keys left
        assert 1 <= sum(looked) <= 3, f"a DRAM stretch of 1 key looked up {looked} keys"
    for layer in range(L):
        assert torch.equal(dst[layer], src[layer])


def _interleaved_dram_and_device(store, keys, src):
    """Store ``keys`` so that the even ones are held only in the DRAM tier
    and the odd ones only on the device (a load alternates one-key
    stretches of each)."""
    n = len(keys)
    nk = normalize_keys(keys)
    for first in (0, 1):       # the even keys' runs, the odd keys' runs
        ids = list(range(first, n, 2))
        assert save_blocks(store, [keys[i] for i in ids], VLLMLayout(src), ids) == len(ids)
    even = {i: store.host.get(nk[i]) for i in range(0, n, 2)}
    assert store.delete([keys[i] for i in even]) == len(even)   # their runs gone...
    for i, block in even.items():
        store.host.put(nk[i], block)               # ...their blocks only in DRAM
    for i in range(1, n, 2):
        store.host.discard(nk[i])


def test_a_device_stretch_looks_up_only_about_its_own_keys(path, monkeypatch):
    """A load alternating DRAM and device stretches asked the index for the
    stored prefix of all the keys left once per device stretch (_segments
    of keys[pos:]): quadratic work under the store's lock (2K keys fully
    interleaved: 1M keys looked up, about 2 s a load).  The keys looked up
    in all grow with the keys loaded, not with their square; the bytes are
    the same."""
    from tests.support.lookups import count_key_lookups

    g = geom()
    n = 256
    src = [rand(2, n, BS, H, D) for _ in range(L)]
    keys = [f"k{i}".encode() for i in range(n)]
    with _store(path, g, host_cache_bytes=(n + 2) * g.block_bytes) as store:
        _interleaved_dram_and_device(store, keys, src)
        looked = count_key_lookups(monkeypatch)
        dst = [torch.zeros(2, n, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        assert load_blocks(store, keys, VLLMLayout(dst), list(range(n))).wait() == n
        monkeypatch.undo()
        assert store.stats()["host_tier_hits"] >= n // 2
    # n / 2 device stretches: about n * n / 4 keys when each looked at all
    # the keys left; a few per key loaded now
    # (at least each device key's own lookup: an empty count is no count)
    assert n // 2 <= sum(looked) < 10 * n, \
        f"{len(looked)} lookups of {sum(looked)} keys for {n} keys"
    for layer in range(L):
        assert torch.equal(dst[layer].view(torch.int16), src[layer].view(torch.int16))


@pytest.mark.parametrize("load_fails", [False, True])
def test_a_load_whose_device_context_fails_to_exit_still_ends_and_unpins(
        path, monkeypatch, load_fails):
    """The scatter stage makes a cupy cache's CUDA device current for its
    work (a context, exited after it).  Its exit (cupy restoring the
    thread's device: a CUDA error) ran outside the stage's try: its error
    came out of the scatter thread past _stage_done, the unpin and
    handle._fail, so wait() never returned and the runs stayed pinned for
    good.  The load fails with that error (or the load's own, which came
    first), and no pin is left."""
    from contextlib import contextmanager

    from kvblock.errors import IOFailedError
    from kvblock.tensors import transfer
    from tests.support.faults import BadSectors

    @contextmanager
    def exit_fails(_device):
        yield
        raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access")

    @contextmanager
    def exit_fails_always(_device):
        try:
            yield
        finally:
            raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access")

    src = [rand(2, 8, BS, H, D) for _ in range(L)]
    a = [f"a{i}".encode() for i in range(4)]
    with _store(path, geom()) as store:
        save_blocks(store, a, VLLMLayout(src), [0, 1, 2, 3])
        if load_fails:
            run = store.index.locate(normalize_keys(a)[0])[0]
            dev, off = store.regions.address(run.region, run.offset)
            bad = BadSectors()
            bad.add(dev, off + store.layout(4).range_offset(1, 0), 4096)
            bad.install(store)
        monkeypatch.setattr(transfer, "_on_device",
                            exit_fails_always if load_fails else exit_fails)
        dst = [torch.zeros(2, 8, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        h = load_blocks(store, a, VLLMLayout(dst), list(range(4)))
        done = _error_within(10, h.wait)
        assert isinstance(done[0], IOFailedError if load_fails else RuntimeError), done[0]
        assert store.regions.pins.sum() == 0


@pytest.mark.parametrize("unpin_fails", [False, True], ids=["unpin answers", "unpin fails"])
def test_a_background_load_whose_caller_stream_event_fails_leaves_no_pin_or_call(
        path, monkeypatch, unpin_fails):
    """A background load first records an event on the caller's CUDA
    stream (the scatter thread waits for it).  That record (a CUDA error)
    ran before anything that unpins: load_blocks raised, but the runs stayed
    pinned for good and the load's call stayed in flight (every close()
    then waited CLOSE_WAIT_S for it).  The load raises the error and
    leaves neither.  Also when an error is answered to that unpin: it
    skipped the leave (the start's error is raised)."""
    from kvblock.tensors import transfer

    def record_fails(_device):
        raise RuntimeError("cudaErrorLaunchFailure: unspecified launch failure")

    with _store(path, geom()) as store:
        if unpin_fails:
            a = _saved_with_unpin_answering_an_error(store, monkeypatch)
        else:
            src = [rand(2, 8, BS, H, D) for _ in range(L)]
            a = [f"a{i}".encode() for i in range(4)]
            save_blocks(store, a, VLLMLayout(src), [0, 1, 2, 3])
        monkeypatch.setattr(transfer, "_record_cuda", record_fails)
        dst = [torch.zeros(2, 8, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        with pytest.raises(RuntimeError, match="cudaErrorLaunchFailure"):
            load_blocks(store, a, VLLMLayout(dst), list(range(4)))
        assert store.regions.pins.sum() == 0
        assert store._inflight._calls == 0


@pytest.mark.parametrize("call", ["save_blocks", "load_blocks", "load_blocks inline",
                                  "load_blocks of a miss"])
def test_a_save_or_load_cut_at_any_line_leaves_no_call_in_flight(path, call):
    """A KeyboardInterrupt at any line of save_blocks or load_blocks (and
    the InFlight enter/leave they call; inline, the load's scatter stage's
    leave too): they entered the store's InFlight before their try and
    left it without a token, so a Ctrl-C as enter returned, or as leave
    began, kept the call counted for good: close() then waited
    CLOSE_WAIT_S (30 s) and left the devices open and locked.  No call
    stays in flight."""
    from kvblock.store.inflight import InFlight
    from kvblock.tensors import transfer
    from tests.store.test_store import _LineInterrupt

    g = Geometry(L, 1, 32, "float16", BS, kv_parts=1)
    src = [np.random.default_rng(i).standard_normal((6, BS, 32)).astype(np.float16)
           for i in range(L)]
    keys = [b"m0", b"m1", b"m2"]
    with _store(path, g) as store:
        save_blocks(store, keys, VLLMLayout(src, mla=True), [5, 0, 2])
    functions = {"save_blocks": [transfer.save_blocks],
                 "load_blocks": [transfer.load_blocks],
                 "load_blocks inline": [transfer.load_blocks, transfer._LoadJob._scatter],
                 "load_blocks of a miss": [transfer.load_blocks]}[call]
    functions += [InFlight.enter, InFlight.leave]
    n = 0
    while True:
        n += 1
        with KVStore.open([path]) as store:
            dst = [np.zeros_like(s) for s in src]
            handles = []
            with _LineInterrupt(functions, n) as cut:
                try:
                    if call == "save_blocks":
                        save_blocks(store, [b"s0", b"s1"], VLLMLayout(src, mla=True), [1, 2])
                    else:
                        handles.append(load_blocks(
                            store, [b"nope"] if call.endswith("miss") else keys,
                            VLLMLayout(dst, mla=True), [1, 2, 3],
                            background=not call.endswith("inline")))
                except KeyboardInterrupt:
                    pass
            for h in handles:
                try:
                    h.wait(5)
                except Exception:
                    pass
            deadline = time.monotonic() + 5
            while store._inflight.calls and time.monotonic() < deadline:
                time.sleep(0.01)
            assert store._inflight.calls == 0, cut.fired
            if cut.fired is None:
                break
    assert n > 5, n


@pytest.mark.parametrize("background", [True, False])
def test_a_load_whose_unpin_is_answered_with_an_error_still_ends(path, monkeypatch,
                                                                 background):
    """The scatter stage's last steps release the load's pins (a store
    server's client: an unpin request) and then end the handle.  An error
    answered to that unpin (a ServerError, a ConfigError: anything but a
    connection lost, which _unpin takes itself) came out of the scatter
    thread before handle._fail: wait() never returned.  The load fails with
    that error (its pins cannot be told to have held), counts no blocks,
    and leaves no call in flight."""
    from kvblock.errors import ServerError

    with _store(path, geom()) as store:
        a = _saved_with_unpin_answering_an_error(store, monkeypatch)
        before = dict(store.counters)
        dst = [torch.zeros(2, 8, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        done = _error_within(10, lambda: load_blocks(store, a, VLLMLayout(dst), list(range(4)),
                                                     background=background).wait())
        assert isinstance(done[0], ServerError), done[0]
        assert store.counters["get_blocks"] == before["get_blocks"]
        assert store.regions.pins.sum() == 0
        deadline = time.monotonic() + 5
        while store._inflight._calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store._inflight._calls == 0


def _error_within(seconds: float, call) -> list:
    """[the error] ``call()`` raised in a thread of its own within
    ``seconds`` (a load that never ends fails the test here, not the run)."""
    done = []

    def run():
        try:
            call()
        except BaseException as e:
            done.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert done, "the load never ended (or ended without an error)"
    return done


def _saved_with_unpin_answering_an_error(store, monkeypatch) -> list:
    """Four blocks saved in ``store``, whose unpin from now on releases the
    pins, then raises as a store server's error answer would."""
    from kvblock.errors import ServerError

    src = [rand(2, 8, BS, H, D) for _ in range(L)]
    a = [f"a{i}".encode() for i in range(4)]
    save_blocks(store, a, VLLMLayout(src), [0, 1, 2, 3])
    real = store._unpin

    def unpin_answered_with_an_error(segs):
        real(segs)
        raise ServerError("store server: ServerError: KeyError: 7")
    monkeypatch.setattr(store, "_unpin", unpin_answered_with_an_error)
    return a


def test_a_load_cut_before_its_job_starts_raises_its_own_error_over_the_unpins(
        path, monkeypatch):
    """A load cut between its prepare and its job's start (a Ctrl-C there)
    unpins its runs itself: an error answered to that unpin (a store
    server's ServerError) came out instead of the load's own error (a
    Ctrl-C read as a miss by a caller).  The unpin's error is logged."""
    from kvblock.tensors import transfer

    def cut(self):
        raise KeyboardInterrupt
    with _store(path, geom()) as store:
        a = _saved_with_unpin_answering_an_error(store, monkeypatch)
        monkeypatch.setattr(transfer._LoadJob, "start", cut)
        dst = [torch.zeros(2, 8, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        with pytest.raises(KeyboardInterrupt):
            load_blocks(store, a, VLLMLayout(dst), list(range(4)))
        assert store.regions.pins.sum() == 0
        assert store._inflight._calls == 0


def _saved_with_unpins_counted(store, monkeypatch) -> tuple[list, list]:
    """Four blocks saved in ``store``, and the list each unpin appends its
    segments to from now on."""
    src = [rand(2, 8, BS, H, D) for _ in range(L)]
    a = [f"a{i}".encode() for i in range(4)]
    save_blocks(store, a, VLLMLayout(src), [0, 1, 2, 3])
    real, unpins = store._unpin, []

    def counted(segs):
        unpins.append(segs)
        return real(segs)
    monkeypatch.setattr(store, "_unpin", counted)
    return a, unpins


def test_an_inline_load_cut_as_it_starts_its_reader_unpins_once_and_leaves(path, monkeypatch):
    """run_inline took the load's pins and InFlight token over (``owned``)
    before it entered the scatter stage, whose cleanup releases them: a
    Ctrl-C between the two (as it called _start_reader) left both held for
    good (load_blocks leaves them to an owning job), and close() waited
    CLOSE_WAIT_S for the call.  The scatter stage runs, failing the load
    with the interrupt: one unpin, no call in flight, then it is raised."""
    from kvblock.tensors import transfer

    def cut(self, name):
        raise KeyboardInterrupt
    with _store(path, geom()) as store:
        a, unpins = _saved_with_unpins_counted(store, monkeypatch)
        monkeypatch.setattr(transfer._LoadJob, "_start_reader", cut)
        _inline_load_cut_unpins_once(store, a, unpins)


@pytest.mark.parametrize("where", ["in the scatter thread's start", "as the reader starts"])
def test_a_background_load_cut_once_its_scatter_thread_runs_unpins_once_and_ends(
        path, monkeypatch, where):
    """A Ctrl-C once the scatter thread was started: in Thread.start's wait
    for it to run (the thread runs), or as start() went on to start the
    reader.  The first released the pins and the token in start()'s
    except while the scatter stage, its cleanup to do the same, waited for
    good for a reader that never came; the second left start() outside
    its try: pins and token held for good, the thread waiting.  Now the
    running stage is handed the interrupt: it fails the load, unpins once,
    leaves, and its thread ends."""
    from kvblock.tensors import transfer

    real_start, scatters = threading.Thread.start, []

    def start(self):
        real_start(self)
        if self.name == "kvblock-load-scatter":
            scatters.append(self)
            if where == "in the scatter thread's start":
                raise KeyboardInterrupt     # as Thread.start waited for it to run

    def cut(self, name):
        raise KeyboardInterrupt
    with _store(path, geom()) as store:
        a, unpins = _saved_with_unpins_counted(store, monkeypatch)
        monkeypatch.setattr(threading.Thread, "start", start)
        if where == "as the reader starts":
            monkeypatch.setattr(transfer._LoadJob, "_start_reader", cut)
        dst = [torch.zeros(2, 8, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        with pytest.raises(KeyboardInterrupt):
            load_blocks(store, a, VLLMLayout(dst), list(range(4)))
        scatters[0].join(5)
        assert not scatters[0].is_alive(), "the scatter stage never ended"
        assert len(unpins) == 1
        assert store.regions.pins.sum() == 0
        assert store._inflight.calls == 0


def test_a_load_cut_in_its_readers_start_waits_for_its_reads(path, monkeypatch):
    """A Ctrl-C in Thread.start's wait for the reader thread to run (it
    runs): _start_reader took the reader for one that never started: it
    counted its stage done and left its InFlight hold, and the scatter
    stage, failing the load with the interrupt, did not wait for it: it
    unpinned the runs (and handed the unit buffers back to the store's
    spares) while the reader's reads were still landing in them, and a
    close() could free the devices under them.  Now the load fails once
    the reads are done: one unpin, after the reader ended."""
    from kvblock.tensors import transfer

    real_start, real_join, real_read = (threading.Thread.start, threading.Thread.join,
                                        transfer._LoadJob._read_batch)
    go, readers, alive_at_unpin = threading.Event(), [], []

    def is_reader(t):
        return getattr(getattr(t, "_target", None), "__func__", None) is transfer._LoadJob._reader

    def start(self):
        real_start(self)
        if is_reader(self):
            readers.append(self)
            raise KeyboardInterrupt      # as Thread.start waited for it to run

    def join(self, timeout=None):
        if is_reader(self):
            go.set()
        return real_join(self, timeout)

    def read_batch(self, batch):
        go.wait(10)                      # a read in flight until someone waits for it
        return real_read(self, batch)

    with _store(path, geom()) as store:
        a, unpins = _saved_with_unpins_counted(store, monkeypatch)
        counted = store._unpin

        def unpin(segs):
            alive_at_unpin.append(readers[0].is_alive())
            go.set()
            return counted(segs)
        monkeypatch.setattr(store, "_unpin", unpin)
        monkeypatch.setattr(threading.Thread, "start", start)
        monkeypatch.setattr(threading.Thread, "join", join)
        monkeypatch.setattr(transfer._LoadJob, "_read_batch", read_batch)
        dst = [torch.zeros(2, 8, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        with pytest.raises(KeyboardInterrupt):
            load_blocks(store, a, VLLMLayout(dst), list(range(4)))
        real_join(readers[0], 5)
        assert alive_at_unpin == [False]
        assert len(unpins) == 1
        assert store.regions.pins.sum() == 0
        assert store._inflight.calls == 0


@pytest.mark.parametrize("background", [True, False])
def test_a_load_cut_at_any_line_of_its_start_unpins_once_and_ends(path, background):
    """A KeyboardInterrupt at any line of load_blocks, of its job's start
    (start, run_inline, _start_reader, the scatter stage's entry and the
    claims) and of the InFlight calls: the runs are unpinned exactly once
    (cut at start()'s first line, before ``owned`` was set, start's except
    and load_blocks both unpinned: the pins went below zero), no call
    stays in flight, every thread of the load ends, and a handle returned
    ends."""
    from kvblock.store.inflight import InFlight
    from kvblock.tensors import transfer
    from tests.store.test_store import _LineInterrupt

    src = [rand(2, 8, BS, H, D) for _ in range(L)]
    a = [f"a{i}".encode() for i in range(4)]
    with _store(path, geom()) as store:
        save_blocks(store, a, VLLMLayout(src), [0, 1, 2, 3])
    job = transfer._LoadJob
    functions = [transfer.load_blocks, job.start, job.run_inline, job._start_reader,
                 job._scatter, job._claim_scatter, job._claim_reader,
                 InFlight.enter, InFlight.leave, InFlight.hold]
    n = 0
    while True:
        n += 1
        with KVStore.open([path]) as store:
            real, unpins = store._unpin, []

            def counted(segs, real=real, unpins=unpins):
                # a call made again after a cut one, with nothing left to
                # release (``held`` emptied), is no second unpin
                if getattr(segs, "held", None) != []:
                    unpins.append(segs)
                return real(segs)
            store._unpin = counted
            dst = [torch.zeros(2, 8, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
            handles, before = [], set(threading.enumerate())
            with _LineInterrupt(functions, n) as cut:
                try:
                    handles.append(load_blocks(store, a, VLLMLayout(dst), list(range(4)),
                                               background=background))
                except KeyboardInterrupt:
                    pass
            for h in handles:
                try:
                    h.wait(5)
                except KeyboardInterrupt:
                    pass
                assert h.done(), cut.fired
            for t in set(threading.enumerate()) - before:
                t.join(5)
                assert not t.is_alive(), (cut.fired, t)
            assert store.regions.pins.sum() == 0, cut.fired
            assert len(unpins) <= 1, cut.fired
            assert store._inflight.calls == 0, cut.fired
            if cut.fired is None:
                break
    assert n > 10, n


def test_an_inline_load_cut_while_it_drops_its_unreadable_runs_still_unpins(path, monkeypatch):
    """Inline, the scatter stage's last steps run in the caller's thread:
    a Ctrl-C in the ones before the unpin (here the re-reads of
    _read_failed, which tell which run the device failed) came out past
    the unpin: the runs stayed pinned for good (their regions never
    evicted).  They are unpinned once, then the interrupt is raised."""
    from kvblock.errors import IOFailedError
    from kvblock.tensors import transfer

    def read_fails(self, batch):
        raise IOFailedError("read failed at offset 0 on kv.img", path, 5, 0, 4096)

    def cut(error, runs):
        raise KeyboardInterrupt        # as it read the runs again
    with _store(path, geom()) as store:
        a, unpins = _saved_with_unpins_counted(store, monkeypatch)
        monkeypatch.setattr(transfer._LoadJob, "_read_batch", read_fails)
        monkeypatch.setattr(store, "_read_failed", cut)
        _inline_load_cut_unpins_once(store, a, unpins)


@pytest.mark.parametrize("tier", [False, True], ids=["device", "with a DRAM tier"])
def test_an_inline_load_cut_at_any_line_of_its_pinning_or_unpin_unpins_each_run_once(
        path, tier):
    """A KeyboardInterrupt at any line of an inline load's pinning
    (_prepare_load, _load_tiered), of the scatter stage and of the store's
    _unpin: cut between the pinning and the job's try (_prepare_load's
    lines after _segments; _load_tiered's between a stretch's pinning and
    its joining the list), the runs stayed pinned for good; cut in
    _unpin's loop or as it began, the runs after the cut (or all) did.
    Each run is unpinned once (none below zero) and the handle ends."""
    from kvblock.store.store import KVStore as Store
    from kvblock.tensors import transfer
    from tests.store.test_interrupt_accounting import _quiet_returns
    from tests.store.test_store import _LineInterrupt

    src = [rand(2, 8, BS, H, D) for _ in range(L)]
    a = [f"a{i}".encode() for i in range(4)]
    kw = {"host_cache_bytes": 8 * geom().block_bytes} if tier else {}
    with _store(path, geom(), **kw) as store:
        for i in range(0, 4, 2):        # two runs
            save_blocks(store, a[i:i + 2], VLLMLayout(src), [i, i + 1])
        if tier:                        # a DRAM block before each device stretch
            for k in normalize_keys([a[1], a[3]]):
                assert store.host.discard(k)
        functions = [transfer.load_blocks, transfer._prepare_load, transfer._load_tiered,
                     transfer._LoadJob._scatter_stage, Store._unpin]
        fired, n = [], 0
        while True:
            n += 1
            dst = [torch.zeros(2, 8, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
            handles, before = [], set(threading.enumerate())
            cut = _LineInterrupt(functions, n)
            for code in cut.codes:
                cut.skip[code] |= _quiet_returns(code)
            with cut:
                try:
                    handles.append(load_blocks(store, a, VLLMLayout(dst), list(range(4)),
                                               background=False))
                except KeyboardInterrupt:
                    pass
            for t in set(threading.enumerate()) - before:
                t.join(5)
                assert not t.is_alive(), (cut.fired, t)
            assert int(store.regions.pins.min()) >= 0, (cut.fired, store.regions.pins)
            assert int(store.regions.pins.sum()) == 0, (cut.fired, store.regions.pins)
            assert all(r.pins == 0 for r in store.index.runs.values()), cut.fired
            assert store._inflight.calls == 0, cut.fired
            if cut.fired is None:
                break
            fired.append(cut.fired)
        assert any(name == "_unpin" for name, _ in fired), fired
        if tier:
            assert any(name == "_load_tiered" for name, _ in fired), fired
        dst = [torch.zeros(2, 8, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        assert load_blocks(store, a, VLLMLayout(dst), list(range(4))).wait() == 4
        for s, d in zip(src, dst):
            assert torch.equal(s[:, :4], d[:, :4])


def test_a_load_whose_scatter_fails_before_its_reader_started_still_ends(path, monkeypatch):
    """start() starts the scatter thread, then makes the reader's Thread
    and starts it.  A scatter stage that failed at once (an error in
    _on_device or _wait_cuda) while the caller was between the two joined
    a reader not yet started: RuntimeError ("cannot join thread before it
    is started") came out of the stage past the unpin and the handle's
    end: wait() never returned, the runs stayed pinned and the load's call
    in flight.  The reader, started later, reads nothing (the load is
    aborted); the load fails with the stage's error, unpinned once."""
    from kvblock.tensors import transfer

    with _store(path, geom()) as store:
        a, unpins = _saved_with_unpins_counted(store, monkeypatch)

        made = threading.Event()

        def wait_cuda_fails(device, event):
            made.wait(5)          # once the reader's Thread is made
            raise RuntimeError("CUDA error: an illegal memory access (test)")
        monkeypatch.setattr(transfer, "_wait_cuda", wait_cuda_fails)
        real_hold, reads = store._inflight.hold, []

        def hold_after_scatter_ended(token):
            # the reader's Thread is made, not started: the scatter stage
            # fails and ends meanwhile
            made.set()
            for t in threading.enumerate():
                if t.name == "kvblock-load-scatter":
                    t.join(5)
                    assert not t.is_alive()
            return real_hold(token)
        monkeypatch.setattr(store._inflight, "hold", hold_after_scatter_ended)
        real_read = transfer._LoadJob._read_batch

        def read_batch(self, batch):
            reads.append(batch)
            return real_read(self, batch)
        monkeypatch.setattr(transfer._LoadJob, "_read_batch", read_batch)
        dst = [torch.zeros(2, 8, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        handle = load_blocks(store, a, VLLMLayout(dst), list(range(4)))
        with pytest.raises(RuntimeError, match="illegal memory access"):
            handle.wait(5)
        for t in threading.enumerate():
            if t.name.startswith("kvblock-load"):
                t.join(5)
                assert not t.is_alive(), t
        assert len(unpins) == 1
        assert reads == []
        assert int(store.regions.pins.sum()) == 0
        assert store._inflight.calls == 0


def _inline_load_cut_unpins_once(store, a, unpins):
    """An inline load_blocks of ``a``'s four blocks, cut by a
    KeyboardInterrupt: it is raised, the runs unpinned once, no call left
    in flight."""
    dst = [torch.zeros(2, 8, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
    with pytest.raises(KeyboardInterrupt):
        load_blocks(store, a, VLLMLayout(dst), list(range(4)), background=False)
    assert len(unpins) == 1
    assert store.regions.pins.sum() == 0
    assert store._inflight.calls == 0


@pytest.mark.parametrize("dram", [False, True], ids=["device", "dram"])
@pytest.mark.parametrize("groups,tp,rank", [(1, 1, 0), (2, 2, 1), (2, 1, 0)])
@pytest.mark.parametrize("kind", ["NHD", "HND", "hf"])
def test_a_cuda_cache_is_cut_on_the_device_from_one_copy_of_each_piece(path, monkeypatch, kind,
                                                                      groups, tp, rank, dram):
    """Host staging into a CUDA torch cache: each piece read (or taken
    from the DRAM tier) goes over whole in one host-to-device copy and is
    cut into K/V and the rank's heads there (it was cut on the host, each
    part gathered into a new pageable array, then copied).  Stood in on
    the CPU: a CPU torch cache taken as a CUDA one; the bytes must be the
    host path's, for every layout, head-group split and TP rank."""
    from kvblock.tensors import transfer
    from kvblock.tensors.layouts import _StridedPages

    copies = []

    def as_cuda(views):
        v = views[0]
        t = v.t if isinstance(v, _StridedPages) else v
        return t.device if transfer._is_torch(t) else None

    def from_host(a, device):
        copies.append(a.shape)
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)
    monkeypatch.setattr(transfer, "_torch_cuda", as_cuda)
    monkeypatch.setattr(transfer, "_torch_from_host", from_host)
    # (DRAM hits into a host cache go straight to its pages, a real CUDA
    # cache's never: the stand-in is kept off that path)
    monkeypatch.setattr(transfer, "_arena_rows", lambda *a: None)
    n, per = 6, H // tp
    keys = [f"d{i}".encode() for i in range(n)]
    ids = [5, 0, 3, 1, 4, 2]
    g = geom(groups=groups)
    options = {"host_cache_bytes": (n + 2) * g.block_bytes} if dram else {}
    with _store(path, g, **options) as store:
        if kind == "hf":
            src = HFDynamicLayout([rand(1, H, n * BS, D) for _ in range(L)],
                                  [rand(1, H, n * BS, D) for _ in range(L)], BS)
            dst = HFDynamicLayout.empty(L, per, n * BS, D, BS, torch.bfloat16)
            want = [src.keys[layer][:, rank * per:(rank + 1) * per] for layer in range(L)]
            have = dst.keys
        else:
            shape = (2, n, BS, H, D) if kind == "NHD" else (2, n, H, BS, D)
            cache = [rand(*shape) for _ in range(L)]
            src = VLLMLayout(cache, kind)
            heads = slice(rank * per, (rank + 1) * per)
            want = [c[:, :, :, heads] if kind == "NHD" else c[:, :, heads] for c in cache]
            have = [torch.zeros_like(w) for w in want]
            dst = VLLMLayout(have, kind)
        assert save_blocks(store, keys, src, list(range(n))) == n
        assert load_blocks(store, keys, dst, ids, tp_rank=rank, tp_size=tp).wait(timeout=30) == n
    assert copies, "the device-side cut was not taken"
    for layer in range(L):
        if kind == "hf":
            for block, page in enumerate(ids):
                tok = slice(page * BS, (page + 1) * BS)
                wtok = slice(block * BS, (block + 1) * BS)
                assert torch.equal(have[layer][:, :, tok].view(torch.int16),
                                   want[layer][:, :, wtok].view(torch.int16)), (layer, page)
        else:
            assert torch.equal(have[layer][:, ids].view(torch.int16),
                               want[layer].view(torch.int16)), layer


class _FakeCudart:
    """torch.cuda.cudart() stood in: page-locked ranges by address."""

    def __init__(self, fail=False):
        self.registered, self.calls, self.fail = {}, [], fail

    def cudaHostRegister(self, address, nbytes, flags):
        self.calls.append(("register", address))
        if self.fail or address in self.registered:
            return 712                   # cudaErrorHostMemoryAlreadyRegistered
        self.registered[address] = nbytes
        return 0

    def cudaHostUnregister(self, address):
        self.calls.append(("unregister", address))
        return 0 if self.registered.pop(address, None) is not None else 713


def _stand_in_cuda_loads(path, monkeypatch, device="cuda-stand-in", loads=1, seen=None):
    """Save 6 blocks, then load them ``loads`` times into a CPU cache
    taken as a CUDA one on ``device`` (its stream calls no-ops), bytes
    checked each time; ``seen(store)`` runs before the store closes."""
    from kvblock.tensors import transfer

    monkeypatch.setattr(transfer, "UNIT_BYTES", 8192)
    monkeypatch.setattr(transfer, "CUDA_UNIT_BYTES", 8192)
    if device is not None:
        monkeypatch.setattr(transfer, "_cuda_device", lambda layout: device)
        for name in ("_record_cuda", "_wait_cuda", "_settle_cuda"):
            monkeypatch.setattr(transfer, name, lambda *a: None)
        monkeypatch.setattr(transfer, "_on_device", lambda device: contextlib.nullcontext())
    n = 6
    src = [rand(2, n, BS, H, D) for _ in range(L)]
    keys = [f"p{i}".encode() for i in range(n)]
    with _store(path, geom()) as store:
        assert save_blocks(store, keys, VLLMLayout(src), list(range(n))) == n
        for _ in range(loads):
            dst = [torch.zeros(2, n, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
            assert load_blocks(store, keys, VLLMLayout(dst), list(range(n))).wait(timeout=30) == n
            for layer in range(L):
                assert torch.equal(dst[layer].view(torch.int16), src[layer].view(torch.int16))
        if seen is not None:
            seen(store)


def test_a_host_buffer_is_pinned_for_cuda_once_and_unpinned_before_unmap(monkeypatch):
    from kvblock.memory import HostBuffer, cudapin

    rt = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    buf = HostBuffer(1 << 20, register=False)
    assert buf.pin_for_cuda() and buf.pin_for_cuda() and buf.cuda_pinned
    assert rt.calls == [("register", buf.address)]
    buf.close()
    buf.close()
    assert rt.registered == {} and rt.calls[1:] == [("unregister", buf.address)]
    assert not buf.pin_for_cuda()                      # closed: nothing to lock
    failing = _FakeCudart(fail=True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: failing)
    monkeypatch.setattr(cudapin, "_loaded_cudart", lambda: None)
    other = HostBuffer(1 << 20, register=False)
    assert not other.pin_for_cuda() and not other.pin_for_cuda()
    assert len(failing.calls) == 1                     # refused once: not asked again
    other.close()
    assert len(failing.calls) == 1                     # nothing to undo


@pytest.mark.parametrize("cuda", [True, False], ids=["cuda-cache", "host-cache"])
def test_staging_for_a_cuda_cache_is_pinned_once_and_kept_pinned_between_loads(
        path, monkeypatch, cuda):
    """The host path's unit buffers feed a CUDA cache's copies: page-locked
    (cudaHostRegister) they go at DMA speed, pageable through the driver's
    bounce buffer.  They are locked when a load for a CUDA cache first
    takes them, stay so in the store's spares for the next load (not
    registered again), and are unlocked before they are unmapped; a host
    cache's are never locked.  Stood in on the CPU: a fake CUDA runtime and
    the cache's device taken as a CUDA one (its stream calls no-ops)."""
    rt = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)

    def seen(store):
        registers = [a for op, a in rt.calls if op == "register"]
        if cuda:
            assert registers and len(registers) == len(set(registers)), rt.calls
            assert set(rt.registered) == set(registers)        # kept locked in the spares
            assert all(b.cuda_pinned for b in store.spares._idle)
        else:
            assert registers == []
    _stand_in_cuda_loads(path, monkeypatch, "cuda-stand-in" if cuda else None, loads=2,
                         seen=seen)
    assert rt.registered == {}, "a staging buffer was unmapped still page-locked"


def test_staging_that_cannot_be_page_locked_loads_from_pageable_memory_logged_once(
        path, monkeypatch, caplog):
    """A CUDA cache's staging that the driver refuses to page-lock (locked
    memory over its limit, the range registered by someone else) stays
    pageable: the loads are correct, each buffer is asked once (the spares
    keep it for the next load, not asked again), and the fallback, which
    makes every copy to the GPU go through the driver's bounce buffer
    (2-4x slower), is logged once with the driver's answer: it was silent,
    the host path slow with nothing said."""
    from kvblock.memory import cudapin
    from kvblock.tensors import transfer

    rt = _FakeCudart(fail=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(cudapin, "_loaded_cudart", lambda: None)
    monkeypatch.setattr(transfer, "_PAGEABLE_LOGGED", False, raising=False)

    def seen(store):
        registers = [a for op, a in rt.calls if op == "register"]
        assert registers and len(registers) == len(set(registers)), rt.calls
        assert not any(b.cuda_pinned for b in store.spares._idle)
    with caplog.at_level(logging.WARNING, logger="kvblock"):
        _stand_in_cuda_loads(path, monkeypatch, loads=2, seen=seen)
    logged = [r.getMessage() for r in caplog.records if "page-lock" in r.getMessage()]
    assert len(logged) == 1, logged
    assert "712" in logged[0] and "pageable" in logged[0], logged[0]
    assert rt.registered == {}


def test_a_failed_unpin_clears_the_cuda_error_it_left_and_is_logged(monkeypatch, caplog):
    """cudaHostUnregister refusing (a context gone, the range not
    registered as thought) left the CUDA runtime's last error set, which
    the next unrelated check on the closing thread (torch's
    cudaGetLastError after each kernel launch) reported as its own, and
    said nothing of the pages that may stay locked.  As a refused
    register: the error is cleared, and the refusal logged."""
    from kvblock.memory import HostBuffer, cudapin
    from tests.support.gpu import LoadedRuntime

    lib = LoadedRuntime()

    class Cudart(_FakeCudart):
        def cudaHostUnregister(self, address):
            self.calls.append(("unregister", address))
            lib.last_error = 1           # cudaErrorInvalidValue
            return 1

    rt = Cudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(cudapin, "_loaded_cudart", lambda: lib)
    buf = HostBuffer(1 << 20, register=False)
    assert buf.pin_for_cuda()
    with caplog.at_level(logging.WARNING, logger="kvblock"):
        buf.close()
    assert rt.calls == [("register", buf.address), ("unregister", buf.address)]
    assert lib.last_error == 0, "the failed unregistration left CUDA's last error set"
    logged = [r.getMessage() for r in caplog.records if "cudaHostUnregister" in r.getMessage()]
    assert len(logged) == 1 and "error 1" in logged[0], logged


class _FakeCudaDevice:
    """torch.cuda.device stood in: the thread's current CUDA device (None:
    never set, CUDA's default device 0 on a new thread)."""

    current = threading.local()

    def __init__(self, device):
        self.idx = device.index if isinstance(device, torch.device) else device

    def __enter__(self):
        self.prev = getattr(self.current, "idx", None)
        self.current.idx = self.idx

    def __exit__(self, *exc):
        self.current.idx = self.prev
        return False


def test_staging_for_a_cache_on_another_gpu_is_pinned_on_its_device_for_all_contexts(
        path, monkeypatch):
    """The unit buffers are page-locked by the reader thread, a new thread
    whose current CUDA device is 0 whatever the cache's: with no device
    set, cudaHostRegister made (or used) GPU 0's context in a process
    whose cache is on GPU 1 (a TP rank's worker: hundreds of MiB of GPU
    0 per process), and, registered without cudaHostRegisterPortable, the
    pages counted as page-locked for GPU 0's context only: the copies to
    GPU 1 went through the driver's bounce buffer still.  They are now
    registered portable, with the cache's device current, and unregistered
    with the same device current."""
    calls = []

    class Cudart(_FakeCudart):
        def cudaHostRegister(self, address, nbytes, flags):
            calls.append(("register", getattr(_FakeCudaDevice.current, "idx", None), flags))
            return super().cudaHostRegister(address, nbytes, flags)

        def cudaHostUnregister(self, address):
            calls.append(("unregister", getattr(_FakeCudaDevice.current, "idx", None)))
            return super().cudaHostUnregister(address)

    rt = Cudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "device", _FakeCudaDevice)
    _stand_in_cuda_loads(path, monkeypatch, torch.device("cuda", 1))
    registers = [c for c in calls if c[0] == "register"]
    assert registers and all(c == ("register", 1, 1) for c in registers), calls
    unregisters = [c for c in calls if c[0] == "unregister"]
    assert unregisters == [("unregister", 1)] * len(registers), calls
    assert rt.registered == {}


def test_a_pinned_buffer_dropped_without_close_is_unpinned_before_its_unmap(monkeypatch):
    """A page-locked staging buffer that is never closed (the spares of a
    store collected without close(), or of a RemoteStore collected: its
    finalizer closes its connections and devices, not its spares) was
    unmapped by the garbage collector still registered with CUDA: the
    driver kept its pages locked for the process's life, and a buffer
    mapped at that address later could not be page-locked ('already
    registered': pageable for good).  It is unregistered as it is
    collected, while its memory is still mapped."""
    import gc

    from kvblock.memory import HostBuffer
    from tests.support.gpu import mapped

    seen = []

    class Cudart(_FakeCudart):
        def cudaHostUnregister(self, address):
            seen.append((address, mapped(address)))
            return super().cudaHostUnregister(address)

    rt = Cudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    buf = HostBuffer(1 << 20, register=False)
    assert buf.pin_for_cuda()
    address = buf.address
    del buf
    gc.collect()
    assert seen == [(address, True)], seen
    assert rt.registered == {}
    closed = HostBuffer(1 << 20, register=False)      # closed: unregistered once, not again
    assert closed.pin_for_cuda()
    closed.close()
    del closed
    gc.collect()
    assert len(seen) == 2 and rt.registered == {}


def test_pieces_for_a_cuda_cache_go_to_the_gpu_from_the_page_locked_staging(path, monkeypatch):
    """Host staging into a CUDA cache with two head groups read at once:
    a piece is one row per group in the unit buffer, so a piece cut short
    (a load of part of a run) is no contiguous array; np.ascontiguousarray
    gathered it into a new pageable array, and the copy to the GPU went
    from there: not from the page-locked unit buffer, through the driver's
    bounce buffer.  Each host-to-device copy's source must lie in a unit
    buffer (stood in on the CPU: the H2D copy recorded)."""
    from kvblock.tensors import transfer

    sources = []

    def as_cuda(views):
        return torch.device("cpu")

    def h2d(t, device):
        sources.append((t.data_ptr(), t.numel() * t.element_size()))
        return t.clone()

    monkeypatch.setattr(transfer, "_torch_cuda", as_cuda)
    monkeypatch.setattr(transfer, "_h2d", h2d, raising=False)
    n, load = 6, 4
    src = [rand(2, n, BS, H, D) for _ in range(L)]
    keys = [f"q{i}".encode() for i in range(n)]
    with _store(path, geom(groups=2)) as store:
        assert save_blocks(store, keys, VLLMLayout(src), list(range(n))) == n
        dst = [torch.zeros(2, load, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        assert load_blocks(store, keys[:load], VLLMLayout(dst),
                           list(range(load))).wait(timeout=30) == load
        for layer in range(L):
            assert torch.equal(dst[layer].view(torch.int16),
                               src[layer][:, :load].view(torch.int16)), layer
        staging = [(b.address, b.address + b.nbytes) for b in store.spares._idle]
    assert sources and staging
    outside = [(p, nb) for p, nb in sources
               if not any(lo <= p and p + nb <= hi for lo, hi in staging)]
    assert not outside, f"{len(outside)} of {len(sources)} copies from outside the staging"


def test_a_save_of_keys_all_stored_gathers_nothing_and_counts_as_put_run(path, monkeypatch):
    """A save whose every key the store holds is a duplicate: put_run writes
    nothing and counts it in put_duplicate_runs.  Its pages are not copied
    into staging first (a re-save of a stored prefix copied all its bytes
    for nothing); what is stored and counted is put_run's all the same."""
    nb = 8
    src = [rand(2, nb, BS, H, D) for _ in range(L)]
    other = [rand(2, nb, BS, H, D) for _ in range(L)]
    keys = [f"dup{i}".encode() for i in range(4)]
    with _store(path, geom()) as store:
        assert save_blocks(store, keys, VLLMLayout(src), [0, 1, 2, 3]) == 4
        gathers = []
        staging = store._staging

        def counted(nbytes, purpose="staging"):
            if purpose == "gather":
                gathers.append(nbytes)
            return staging(nbytes, purpose)
        monkeypatch.setattr(store, "_staging", counted)
        before = store.stats()
        # other KV under the stored keys: a key names one KV, the stored one
        assert save_blocks(store, keys, VLLMLayout(other), [4, 5, 6, 7]) == 4
        assert save_blocks(store, keys[1:3], VLLMLayout(other), [5, 6]) == 2
        assert gathers == []
        after = store.stats()
        assert after["put_duplicate_runs"] == before["put_duplicate_runs"] + 2
        for name in ("put_runs", "put_blocks", "bytes_written", "admission_rejected_runs"):
            assert after[name] == before[name], name
        dst = [torch.zeros_like(s) for s in src]
        assert load_blocks(store, keys, VLLMLayout(dst), [0, 1, 2, 3]).wait() == 4
        for layer in range(L):
            assert torch.equal(dst[layer][:, :4].view(torch.int16),
                               src[layer][:, :4].view(torch.int16))
        # one key not stored: the whole run is gathered and written, as before
        assert save_blocks(store, keys[:2] + [b"new"], VLLMLayout(other), [4, 5, 6]) == 3
        assert len(gathers) == 1
        assert store.stats()["put_runs"] == after["put_runs"] + 1


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_sglang_pool_of_no_whole_pages_names_the_layout_and_the_fix(path, layout):
    """An SGLang pool whose token slots are no whole number of pages was
    refused with "cache holds N token slots, not a multiple of the P-token
    page", naming neither the pool (its layout, its shape) nor the fix."""
    slots = 4 * BS + 3
    shape = (2, L, slots, H, D) if layout == "layer_first" else (2, slots, L, H, D)
    pool = SGLangHostLayout(rand(*shape), layout, BS)
    with _store(path, geom()) as store, pytest.raises(ConfigError) as e:
        save_blocks(store, [b"a"], pool, [0])
    msg = str(e.value)
    assert f"SGLang {layout} pool of shape {shape}" in msg, msg
    assert f"{slots} token slots" in msg and f"page_size {BS}" in msg, msg
    assert "pass the page_size the pool was made with" in msg, msg


def test_hf_values_of_another_head_size_say_what_differs():
    """A model whose values have another head size than its keys (MLA
    expanded: DeepSeek's 192-dim keys, 128-dim values) was refused as if a
    layer were a sliding-window one.  The error says the values' head size
    differs from the keys' and that such a cache cannot be paged as one
    geometry; a layer of other tokens still names sliding windows."""
    k, v = torch.zeros(1, H, 2 * BS, D), torch.zeros(1, H, 2 * BS, D // 2)
    with pytest.raises(ConfigError) as e:
        HFDynamicLayout([k, k], [v, v], BS)
    msg = str(e.value)
    assert "layer 0 values have shape (1, 8, 32, 8), layer 0 keys (1, 8, 32, 16): " \
        "head_dim 8, not 16;" in msg, msg
    assert "one geometry" in msg and "sliding" not in msg, msg
    short = torch.zeros(1, H, BS, D)
    with pytest.raises(ConfigError, match=r"layer 1 keys .*: tokens 16, not 32; .*"
                                          r"sliding-window"):
        HFDynamicLayout([k, short], [k, short], BS)
    with pytest.raises(ConfigError, match=r"layer 1 keys .*: heads 4, not 8; .*one geometry"):
        HFDynamicLayout([k, k[:, :4]], [k, k[:, :4]], BS)


@pytest.mark.parametrize("where", ["pin", "log"])
def test_a_staging_buffer_whose_page_locking_raises_goes_back_to_the_spares(
        path, monkeypatch, where):
    """The host path's _new_buffer takes a unit buffer from the store's
    spares, then page-locks it for a CUDA cache (and logs a refusal): an
    error raised there (a Ctrl-C in cudaHostRegister, a logging handler
    that raises) left the buffer in neither the load's buffers nor the
    spares, lost to every later load.  It goes back to the spares; the
    load fails with the error, and the next load takes the buffer again."""
    from kvblock.memory import HostBuffer
    from kvblock.memory.spares import SpareBuffers
    from kvblock.tensors import transfer

    monkeypatch.setattr(transfer, "UNIT_BYTES", 8192)
    monkeypatch.setattr(transfer, "CUDA_UNIT_BYTES", 8192)
    monkeypatch.setattr(transfer, "_cuda_device", lambda layout: "cuda-stand-in")
    for name in ("_record_cuda", "_wait_cuda", "_settle_cuda"):
        monkeypatch.setattr(transfer, name, lambda *a: None)
    monkeypatch.setattr(transfer, "_on_device", lambda device: contextlib.nullcontext())
    taken, real_take = [], SpareBuffers.take

    def take(self, nbytes):
        taken.append(real_take(self, nbytes))
        return taken[-1]

    monkeypatch.setattr(SpareBuffers, "take", take)
    fail = [True]

    def pin_for_cuda(self, device=None):
        if fail[0] and where == "pin":
            raise RuntimeError("cudaHostRegister interrupted")
        self.cuda_pin_refusal = "refused"
        return False

    def log_pageable(why):
        if fail[0]:
            raise RuntimeError("a logging handler raised")

    monkeypatch.setattr(HostBuffer, "pin_for_cuda", pin_for_cuda)
    monkeypatch.setattr(transfer, "_log_pageable", log_pageable)
    n = 2
    src = [rand(2, n, BS, H, D) for _ in range(L)]
    keys = [f"s{i}".encode() for i in range(n)]
    with _store(path, geom()) as store:
        assert save_blocks(store, keys, VLLMLayout(src), list(range(n))) == n
        dst = [torch.zeros(2, n, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
        with pytest.raises(RuntimeError, match="interrupted|handler raised"):
            load_blocks(store, keys, VLLMLayout(dst), list(range(n))).wait(timeout=30)
        assert taken, "no buffer was taken"
        lost = [b for b in taken if b not in store.spares._idle and not b.closed]
        assert not lost, (taken, store.spares._idle)
        first, taken[:] = set(map(id, store.spares._idle)), []
        fail[0] = False
        assert load_blocks(store, keys, VLLMLayout(dst), list(range(n))).wait(timeout=30) == n
        assert first & set(map(id, taken)), "the next load made a new buffer"
    for layer in range(L):
        assert torch.equal(dst[layer].view(torch.int16), src[layer].view(torch.int16))


# DRAM-tier hits into host caches: rows of 256 bytes or more (D=128 bf16:
# one head a row), the native row copy's, for every layout and TP slice.
DL, DH, DD, DBS = 3, 8, 128, 4


def _dram_cache(kind, pages, heads, mla=False):
    """(layout, its tensors' owner) of ``pages`` pages of ``heads`` heads."""
    if kind == "hf":
        lay = HFDynamicLayout([rand(1, heads, pages * DBS, DD) for _ in range(DL)],
                              [rand(1, heads, pages * DBS, DD) for _ in range(DL)], DBS)
    elif kind == "sglang":
        lay = SGLangHostLayout(rand(2, pages * DBS, DL, heads, DD), "page_first", DBS)
    elif kind == "mla":
        lay = VLLMLayout([rand(pages, DBS, 2 * DD) for _ in range(DL)], mla=True)
    else:
        shape = (2, pages, DBS, heads, DD) if kind == "NHD" else (2, pages, heads, DBS, DD)
        lay = VLLMLayout([rand(*shape) for _ in range(DL)], kind)
    return lay


def _dram_pages(lay, layer):
    """Raw int16 numpy views (pages, tokens, heads, dim) of a layer's K/V parts."""
    from kvblock.tensors import transfer

    return [transfer._host_np(v, 2) for v in lay.layer_views(layer)]


def _zero(lay):
    for layer in range(DL):
        for v in _dram_pages(lay, layer):
            v[...] = 0


def _dram_load(path, g, keys, src, dst, ids, monkeypatch, **load_kwargs):
    """Save ``keys`` from ``src`` into a store whose DRAM tier holds them
    all, then load them into ``dst`` at ``ids``, counting HostTier.get's
    calls: (their args, stats before the load, stats after)."""
    from kvblock.tiers import HostTier

    n = len(keys)
    gets, real_get = [], HostTier.get

    def get(self, *a, **kw):
        gets.append(a)
        return real_get(self, *a, **kw)

    with _store(path, g, host_cache_bytes=(n + 2) * g.block_bytes) as store:
        assert save_blocks(store, keys, src, list(range(n))) == n
        monkeypatch.setattr(HostTier, "get", get)
        before = store.stats()
        assert load_blocks(store, keys, dst, ids, **load_kwargs).wait(timeout=30) == n
        return gets, before, store.stats()


@pytest.mark.parametrize("kind,groups,tp,rank", [
    (kind, *split) for kind in ("NHD", "HND", "sglang", "hf")
    for split in ((1, 1, 0), (1, 2, 1), (2, 2, 1), (2, 1, 0), (2, 4, 3), (4, 2, 1), (1, 16, 5))
] + [("mla", 1, 1, 0), ("mla", 1, 4, 3)])    # MLA: one latent head, whole or replicated
def test_dram_hits_into_a_host_cache_are_copied_straight_from_the_arena(path, monkeypatch,
                                                                        kind, groups, tp, rank):
    """DRAM-tier hits loaded into a host (CPU) cache were copied three
    times: HostTier.get copied each block out of the arena, np.stack
    copied them all again, then each layer's pages were scattered.  Each
    hit now goes straight from the arena into every layer's pages (under
    the tier's lock, HostTier.copy_out): the same bytes for every layout,
    head-group split, TP rank and page order, the same hit counts."""
    heads = 1 if kind == "mla" else DH
    g = Geometry(DL, heads, 2 * DD if kind == "mla" else DD, "bfloat16", DBS,
                 1 if kind == "mla" else 2, 1 if kind == "mla" else groups)
    per, first = (heads // tp, rank * (heads // tp)) if tp <= heads else \
        (1, rank // (tp // heads))
    n, ids = 6, [7, 2, 9, 0, 5, 3]
    keys = [f"t{i}".encode() for i in range(n)]
    src = _dram_cache(kind, n, heads)
    dst = _dram_cache(kind, 10, per)
    _zero(dst)
    gets, before, after = _dram_load(path, g, keys, src, dst, ids, monkeypatch,
                                     tp_rank=rank, tp_size=tp)
    for name, want in (("host_tier_hits", n), ("host_tier_misses", 0),
                       ("device_hit_blocks", 0), ("host_hit_blocks", n)):
        assert after[name] - before[name] == want, name
    for layer in range(DL):
        for s, d in zip(_dram_pages(src, layer), _dram_pages(dst, layer)):
            assert np.array_equal(d[ids], s[:, :, first:first + per]), layer
            assert not d[[1, 4, 6, 8]].any()         # pages not loaded stay untouched
    assert not gets, "DRAM hits were copied out of the arena with HostTier.get"


@pytest.mark.parametrize("end", ["on the device", "stale", "nowhere"])
def test_a_dram_stretch_into_a_host_cache_ends_at_the_first_block_it_cannot_serve(path, end):
    """A DRAM stretch copied straight from the arena stops at the first key
    whose copy is not there (on the device only, or nowhere) or is older
    than the run its key names (stale: it leaves, and is not served); the
    blocks before it are in place, the rest come from the device (or the
    load ends there), counted as before: a hit per DRAM block, a miss for
    the key that ended the stretch and each device block after it."""
    g = Geometry(DL, DH, DD, "bfloat16", DBS)
    n, ids = 6, [7, 2, 9, 0, 5, 3]
    keys = [f"e{i}".encode() for i in range(n)]
    src = _dram_cache("NHD", n, DH)
    dst = _dram_cache("NHD", 10, DH)
    _zero(dst)
    nk = normalize_keys(keys)
    with _store(path, g, host_cache_bytes=(n + 2) * g.block_bytes) as store:
        if end == "nowhere":
            assert save_blocks(store, keys[:3] + keys[4:], src, [0, 1, 2, 4, 5]) == 5
        else:
            assert save_blocks(store, keys, src, list(range(n))) == n
        if end == "on the device":
            assert store.host.discard(nk[3])
        elif end == "stale":      # a copy older than any run (publish counts start at 1)
            store.host.put(nk[3], np.full(g.block_bytes, 0x55, np.uint8), replace=True,
                           current=lambda: 0)
            assert nk[3] in store.host
        before = store.stats()
        got = load_blocks(store, keys, dst, ids).wait(timeout=30)
        after = store.stats()
    loaded = 3 if end == "nowhere" else n
    assert got == loaded
    device = loaded - 3
    for name, want in (("host_tier_hits", 3), ("host_tier_misses", 1 + max(0, device - 1)),
                       ("device_hit_blocks", device), ("host_hit_blocks", 3)):
        assert after[name] - before[name] == want, name
    for layer in range(DL):
        for s, d in zip(_dram_pages(src, layer), _dram_pages(dst, layer)):
            assert np.array_equal(d[ids[:loaded]], s[:loaded]), layer
            assert not d[[1, 4, 6, 8] + ids[loaded:]].any()


@pytest.mark.parametrize("why", ["no native library", "layers of other strides"])
def test_dram_hits_into_a_host_cache_without_a_row_copy_are_scattered_with_numpy(
        path, monkeypatch, why):
    """Where no one row copy applies (no native library, or layers whose
    pages lie with other strides: no one plan for every layer), DRAM hits
    take get, stack and the scatter: the same bytes and counts."""
    from kvblock.tensors import pagecopy

    g = Geometry(DL, DH, DD, "bfloat16", DBS)
    n, ids = 6, [7, 2, 9, 0, 5, 3]
    keys = [f"f{i}".encode() for i in range(n)]
    src = _dram_cache("NHD", n, DH)
    dst = _dram_cache("NHD", 10, DH)
    if why == "no native library":
        monkeypatch.setattr(pagecopy, "_lib", lambda: None)
    else:                     # layer 1: every other head_dim of a wider tensor
        dst.caches[1] = torch.zeros(2, 10, DBS, DH, 2 * DD, dtype=torch.bfloat16)[..., ::2]
    _zero(dst)
    gets, before, after = _dram_load(path, g, keys, src, dst, ids, monkeypatch)
    assert len(gets) == n, "the fallback was not taken"
    assert after["host_tier_hits"] - before["host_tier_hits"] == n
    assert after["device_hit_blocks"] == before["device_hit_blocks"]
    for layer in range(DL):
        for s, d in zip(_dram_pages(src, layer), _dram_pages(dst, layer)):
            assert np.array_equal(d[ids], s), layer


def test_dram_hits_into_a_layer_of_fewer_pages_are_not_copied_past_its_end(path):
    """Page ids are checked against layer 0's pages only: a layer of fewer
    pages (a layout whose layers differ) must not have the arena's row copy
    write past its end (into whatever memory follows it): the load fails
    as the numpy scatter makes it, and nothing outside the layer changes."""
    g = Geometry(DL, DH, DD, "bfloat16", DBS)
    n, ids = 2, [1, 8]
    keys = [f"p{i}".encode() for i in range(n)]
    src = _dram_cache("NHD", n, DH)
    dst = _dram_cache("NHD", 10, DH)
    # layer 1: the first 5 pages of a 10-page tensor (the strides of layer 0's)
    whole = torch.zeros(2, 10, DBS, DH, DD, dtype=torch.bfloat16)
    dst.caches[1] = whole[:, :5]
    _zero(dst)
    with _store(path, g, host_cache_bytes=(n + 2) * g.block_bytes) as store:
        assert save_blocks(store, keys, src, list(range(n))) == n
        with pytest.raises(IndexError):
            load_blocks(store, keys, dst, ids).wait(timeout=30)
    assert not whole[:, 5:].any(), "written past layer 1's 5 pages"
