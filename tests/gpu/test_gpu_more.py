"""More caches on the GPU (needs CUDA; run by perf/gpu_check.sh on a GPU machine).

test_gpu_path.py and test_gpu_roundtrip.py cover vLLM's NHD/HND caches and
cupy; these cover the other layouts on CUDA (Hugging Face, SGLang pools,
vLLM MLA), a DRAM-tier hit with the kvikio path set, a store of two device
files read through kvikio, and a load of a prefix that starts mid-run.
Each checks the bytes (16-bit words on the host) and, where a path is
forced, that the load took it."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from kvblock import Geometry, KVStore, create_file  # noqa: E402
from kvblock.index import normalize_keys  # noqa: E402
from tests.support.gpu import bits, count_reads, took, use_path  # noqa: E402
from kvblock.tensors import (HFDynamicLayout, SGLangHostLayout, VLLMLayout,  # noqa: E402
                             load_blocks, save_blocks)

L, H, D, BS = 4, 8, 128, 16
MLA_D = 576                 # DeepSeek's latent (512) + rope (64)
DEV = "cuda"
PATHS = ["kvikio", "host"]


def _rand(*shape, device=DEV):
    return torch.randn(*shape, device=device).to(torch.bfloat16)


def _zeros(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16, device=DEV)


@pytest.mark.parametrize("path_kind", PATHS)
def test_a_hugging_face_cache_on_cuda_saves_and_loads_layer_by_layer(path, monkeypatch,
                                                                     path_kind):
    """A DynamicCache's (1, heads, tokens, dim) CUDA tensors (paged through
    _StridedPages: several heads) save, and load back layer by layer
    (each layer's bytes read right after its wait_layer) at the same pages
    (one strided slice copy) and in another page order (token indexing),
    through the path set; the partial page at the end stays untouched."""
    use_path(monkeypatch, path_kind)
    n, tokens = 6, 6 * BS + 5
    src = HFDynamicLayout([_rand(1, H, tokens, D) for _ in range(L)],
                          [_rand(1, H, tokens, D) for _ in range(L)], BS)
    keys = [f"hf{i}".encode() for i in range(n)]
    with KVStore.format([str(path)], Geometry(L, H, D, "bfloat16", BS), verify="never",
                        force=True) as store:
        assert save_blocks(store, keys, src, list(range(n))) == n
        taken = count_reads(store, monkeypatch)
        for ids in (list(range(n)), [5, 3, 1, 0, 2, 4]):
            dst = HFDynamicLayout.empty(L, H, tokens, D, BS, torch.bfloat16, device=DEV)
            h = load_blocks(store, keys, dst, ids)
            for layer in range(L):
                assert h.wait_layer(layer, timeout=60) == n
                for have, want in ((dst.keys[layer], src.keys[layer]),
                                   (dst.values[layer], src.values[layer])):
                    for block, page in enumerate(ids):
                        assert torch.equal(bits(have[:, :, page * BS:(page + 1) * BS]),
                                           bits(want[:, :, block * BS:(block + 1) * BS])), \
                            (ids, layer, page)
                    assert not have[:, :, n * BS:].any(), (ids, layer)
            assert h.wait(timeout=60) == n
        took(taken, path_kind)


def _sglang_pool(layout, mla, pages, zeros=False):
    size = pages * BS
    heads, dim = (1, MLA_D) if mla else (H, D)
    shape = {"layer_first": (L, size, heads, dim), "page_first": (size, L, heads, dim),
             "page_first_direct": (pages, L, BS, heads, dim)}[layout]
    shape = shape if mla else (2, *shape)
    return _zeros(*shape) if zeros else _rand(*shape)


def _sglang_page(pool, layout, mla, layer, page):
    """Every KV part of one pool page of one layer: (parts, BS, heads, dim)."""
    parts = [pool] if mla else [pool[0], pool[1]]
    tok = slice(page * BS, (page + 1) * BS)
    if layout == "layer_first":
        return torch.stack([p[layer, tok] for p in parts])
    if layout == "page_first":
        return torch.stack([p[tok, layer] for p in parts])
    return torch.stack([p[page, layer] for p in parts])


@pytest.mark.parametrize("path_kind", PATHS)
@pytest.mark.parametrize("layout,mla", [("page_first", False), ("page_first_direct", False),
                                        ("page_first", True), ("page_first_direct", True),
                                        ("layer_first", True)])
def test_an_sglang_pool_on_cuda_round_trips(path, monkeypatch, path_kind, layout, mla):
    """SGLang pools in CUDA memory (MHA and MLA, page_first and
    page_first_direct: a layer's pages are strided views) save from some
    pages and load into others of a second pool, bytes identical, the
    pages not named untouched."""
    use_path(monkeypatch, path_kind)
    g = Geometry(L, 1, MLA_D, "bfloat16", BS, kv_parts=1) if mla else \
        Geometry(L, H, D, "bfloat16", BS)
    pages = 8
    src = _sglang_pool(layout, mla, pages)
    dst = _sglang_pool(layout, mla, pages, zeros=True)
    keys = [f"sg{i}".encode() for i in range(3)]
    saved, loaded = [1, 4, 6], [7, 0, 3]
    with KVStore.format([str(path)], g, verify="never", force=True) as store:
        assert save_blocks(store, keys, SGLangHostLayout(src, layout, BS, mla=mla), saved) == 3
        taken = count_reads(store, monkeypatch)
        h = load_blocks(store, keys, SGLangHostLayout(dst, layout, BS, mla=mla), loaded)
        assert h.wait(timeout=60) == 3
        took(taken, path_kind)
    for layer in range(L):
        for a, b in zip(saved, loaded):
            assert torch.equal(bits(_sglang_page(dst, layout, mla, layer, b)),
                               bits(_sglang_page(src, layout, mla, layer, a))), (layer, b)
        for page in set(range(pages)) - set(loaded):
            assert not _sglang_page(dst, layout, mla, layer, page).any(), (layer, page)


@pytest.mark.parametrize("path_kind", PATHS)
def test_a_vllm_mla_cache_on_cuda_round_trips_on_every_rank(path, monkeypatch, path_kind):
    """vLLM's MLA cache (blocks, block_size, latent) on CUDA: saved, then
    loaded by each of 2 TP ranks (the one latent head replicated over them)
    at other pages, bytes identical."""
    use_path(monkeypatch, path_kind)
    g = Geometry(L, 1, MLA_D, "bfloat16", BS, kv_parts=1)
    n, pages = 5, 12
    src = [_rand(pages, BS, MLA_D) for _ in range(L)]
    keys = [f"mla{i}".encode() for i in range(n)]
    saved, loaded = [0, 2, 4, 6, 8], [11, 10, 9, 3, 1]
    with KVStore.format([str(path)], g, verify="never", force=True) as store:
        assert save_blocks(store, keys, VLLMLayout(src, mla=True), saved) == n
        taken = count_reads(store, monkeypatch)
        for rank in range(2):
            dst = [_zeros(pages, BS, MLA_D) for _ in range(L)]
            h = load_blocks(store, keys, VLLMLayout(dst, mla=True), loaded, tp_rank=rank,
                            tp_size=2)
            assert h.wait(timeout=60) == n
            for layer in range(L):
                assert torch.equal(bits(dst[layer][loaded]), bits(src[layer][saved])), \
                    (rank, layer)
                others = [p for p in range(pages) if p not in loaded]
                assert not dst[layer][others].any(), (rank, layer)
        took(taken, path_kind)


def test_dram_tier_hits_load_into_cuda_with_the_kvikio_path_set(path, monkeypatch):
    """With a DRAM tier (its arena pinned with CUDA: a GPU is present) and
    KVBLOCK_GPU_PATH=kvikio: a prefix all in DRAM is copied into the CUDA
    cache with no device read at all; with every other block dropped from
    DRAM, the load alternates DRAM and device stretches, the device's
    through kvikio.  Bytes identical both times."""
    use_path(monkeypatch, "kvikio")
    g = Geometry(L, H, D, "bfloat16", BS)
    n = 12
    src = [_rand(2, n, BS, H, D) for _ in range(L)]
    keys = [f"dt{i}".encode() for i in range(n)]
    ids = list(range(n - 1, -1, -1))
    with KVStore.format([str(path)], g, verify="never", force=True,
                        host_cache_bytes=(n + 4) * g.block_bytes) as store:
        assert store.stats()["host_pinned"] is True
        assert save_blocks(store, keys, VLLMLayout(src), list(range(n))) == n
        assert all(k in store.host for k in normalize_keys(keys))
        taken = count_reads(store, monkeypatch)
        hits = store.counters["host_hit_blocks"]
        dst = [_zeros(2, n, BS, H, D) for _ in range(L)]
        assert load_blocks(store, keys, VLLMLayout(dst), ids).wait(timeout=60) == n
        assert taken["kvikio"] == 0 and taken["host"] == 0, taken
        assert store.counters["host_hit_blocks"] - hits == n
        for layer in range(L):
            assert torch.equal(bits(dst[layer][:, ids]), bits(src[layer])), layer
        for k in normalize_keys(keys)[1::2]:
            assert store.host.discard(k)
        dst = [_zeros(2, n, BS, H, D) for _ in range(L)]
        assert load_blocks(store, keys, VLLMLayout(dst), ids).wait(timeout=60) == n
        took(taken, "kvikio")
        for layer in range(L):
            assert torch.equal(bits(dst[layer][:, ids]), bits(src[layer])), layer


@pytest.mark.parametrize("tp", [(0, 1), (1, 2)])
def test_dram_tier_hits_go_into_cuda_from_the_arena_in_chunks(path, monkeypatch, tp):
    """DRAM-tier hits into a CUDA cache are copied from the tier's arena
    into device staging a few blocks at a time (the staging bound set to
    3 blocks here: 10 hits take 4 chunks) and cut into this rank's heads
    on the device; then with block 7 gone from DRAM, the DRAM stretch ends
    there and the rest come from the device.  Bytes identical, the pages
    not loaded untouched, each block counted once where it came from."""
    from kvblock.tensors import transfer

    g = Geometry(L, H, D, "bfloat16", BS)
    monkeypatch.setattr(transfer, "HOST_HITS_STAGING_BYTES", 3 * g.block_bytes)
    rank, size = tp
    heads = H // size
    mine = slice(rank * heads, (rank + 1) * heads)
    n, pages = 10, 14
    src = [_rand(2, n, BS, H, D) for _ in range(L)]
    keys = [f"dc{i}".encode() for i in range(n)]
    ids = [13, 0, 5, 2, 11, 7, 1, 9, 4, 12]
    others = [p for p in range(pages) if p not in ids]
    with KVStore.format([str(path)], g, verify="never", force=True,
                        host_cache_bytes=(n + 4) * g.block_bytes) as store:
        assert save_blocks(store, keys, VLLMLayout(src), list(range(n))) == n
        for from_dram in (n, 7):
            if from_dram < n:
                assert store.host.discard(normalize_keys(keys)[from_dram])
            hits = store.counters["host_hit_blocks"]
            device = store.counters["device_hit_blocks"]
            dst = [_zeros(2, pages, BS, heads, D) for _ in range(L)]
            assert load_blocks(store, keys, VLLMLayout(dst), ids, tp_rank=rank,
                               tp_size=size).wait(timeout=60) == n
            assert store.counters["host_hit_blocks"] - hits == from_dram
            assert store.counters["device_hit_blocks"] - device == n - from_dram
            for layer in range(L):
                assert torch.equal(bits(dst[layer][:, ids]),
                                   bits(src[layer][..., mine, :])), (from_dram, layer)
                assert not dst[layer][:, others].any(), (from_dram, layer)


def test_a_store_of_two_device_files_loads_into_cuda_through_kvikio(tmp_path, monkeypatch):
    """A store striped over two device files (regions alternate between
    them): one load of runs on both reads each file through its own
    kvikio handle, bytes identical."""
    use_path(monkeypatch, "kvikio")
    g = Geometry(L, H, D, "bfloat16", BS)
    paths = [tmp_path / "a.img", tmp_path / "b.img"]
    for p in paths:
        create_file(p, 64 << 20)
    runs, per = 4, 3
    n = runs * per
    src = [_rand(2, n, BS, H, D) for _ in range(L)]
    keys = [f"two{i}".encode() for i in range(n)]
    with KVStore.format([str(p) for p in paths], g, verify="never", force=True,
                        region_size=1 << 20) as store:
        for r in range(runs):
            part = list(range(r * per, (r + 1) * per))
            assert save_blocks(store, keys[r * per:(r + 1) * per], VLLMLayout(src), part) == per
        devs = {store.regions.address(run.region, run.offset)[0]
                for run in store.index.runs.values()}
        assert devs == {0, 1}, devs          # the runs lie on both files
        taken = count_reads(store, monkeypatch)
        dst = [_zeros(2, n, BS, H, D) for _ in range(L)]
        assert load_blocks(store, keys, VLLMLayout(dst), list(range(n))).wait(timeout=60) == n
        took(taken, "kvikio")
        assert taken["kvikio_devs"] == {0, 1}, taken
        for layer in range(L):
            assert torch.equal(bits(dst[layer]), bits(src[layer])), layer


@pytest.mark.parametrize("path_kind", PATHS)
def test_a_prefix_starting_mid_run_loads_into_cuda(path, monkeypatch, path_kind):
    """A load of keys that start inside a stored run (its first 5 blocks
    not asked for) into a CUDA cache, at page ids given as a CUDA tensor,
    for all heads and for TP rank 1 of 2: only the blocks asked for land,
    at their pages, bytes identical; the other pages untouched."""
    use_path(monkeypatch, path_kind)
    g = Geometry(L, H, D, "bfloat16", BS, head_groups=2)
    n, skip, pages = 12, 5, 16
    src = [_rand(2, n, BS, H, D) for _ in range(L)]
    keys = [f"mid{i}".encode() for i in range(n)]
    with KVStore.format([str(path)], g, verify="never", force=True) as store:
        assert save_blocks(store, keys, VLLMLayout(src), list(range(n))) == n
        assert len(store.index.runs) == 1
        taken = count_reads(store, monkeypatch)
        want_n = n - skip
        ids = list(range(pages - 1, pages - 1 - want_n, -1))
        for tp, rank in ((1, 0), (2, 1)):
            per = H // tp
            dst = [_zeros(2, pages, BS, per, D) for _ in range(L)]
            page_ids = torch.tensor(ids, dtype=torch.int32, device=DEV)
            h = load_blocks(store, keys[skip:], VLLMLayout(dst), page_ids, tp_rank=rank,
                            tp_size=tp)
            assert h.wait(timeout=60) == want_n
            for layer in range(L):
                want = src[layer][:, skip:, :, rank * per:(rank + 1) * per]
                assert torch.equal(bits(dst[layer][:, ids]), bits(want)), (tp, layer)
                others = [p for p in range(pages) if p not in ids]
                assert not dst[layer][:, others].any(), (tp, layer)
        took(taken, path_kind)


@contextlib.contextmanager
def _saved_for_the_host_path(path, monkeypatch, tag, n=32):
    """A store on ``path`` holding ``n`` blocks saved from a host cache,
    loads forced onto the host path: (store, keys, the host cache)."""
    use_path(monkeypatch, "host")
    src = [_rand(2, n, BS, H, D, device="cpu") for _ in range(L)]
    keys = [f"{tag}{i}".encode() for i in range(n)]
    with KVStore.format([str(path)], Geometry(L, H, D, "bfloat16", BS), verify="never",
                        force=True) as store:
        assert save_blocks(store, keys, VLLMLayout(src), list(range(n))) == n
        yield store, keys, src


def test_host_path_staging_is_page_locked_and_reused(path, monkeypatch):
    """The host path's unit buffers, which feed the copies into a CUDA
    cache, are page-locked with CUDA when a load first takes them and kept
    so in the store's spares: two loads give the same bytes, and every
    idle staging buffer after them is pinned."""
    with _saved_for_the_host_path(path, monkeypatch, "pl") as (store, keys, src):
        n = len(keys)
        for _ in range(2):
            dst = [_zeros(2, n, BS, H, D) for _ in range(L)]
            assert load_blocks(store, keys, VLLMLayout(dst), list(range(n))).wait(timeout=60) == n
            for layer in range(L):
                assert torch.equal(bits(dst[layer]), src[layer].view(torch.int16)), layer
        idle = store.spares._idle
        assert idle and all(b.cuda_pinned for b in idle), [b.cuda_pinned for b in idle]


def test_a_host_path_load_overlaps_work_queued_on_the_default_stream_after_it(path, monkeypatch):
    """A layer-wise load runs beside the model: the host path's copies and
    scatters go on the loads' own non-blocking stream.  On the legacy
    default stream (the scatter thread's own) they waited for every kernel
    the model queued there after the load began, so the load ended only
    after them.  Here a kernel that spins ~2 s is queued on the default
    stream right after load_blocks: the load is done (bytes in place)
    while it still runs.  A warm-up load first, so the timed one allocates
    nothing (a cudaMalloc may wait for the device).  (kvikio's POSIX
    compat path copies on kvikio's own blocking streams, which CUDA orders
    with the legacy stream: not asked of it here.)"""
    with _saved_for_the_host_path(path, monkeypatch, "ov") as (store, keys, src):
        n = len(keys)
        for spin in (False, True):
            dst = [_zeros(2, n, BS, H, D) for _ in range(L)]
            torch.cuda.synchronize()
            h = load_blocks(store, keys, VLLMLayout(dst), list(range(n)))
            if spin:
                torch.cuda._sleep(4_000_000_000)      # cycles: ~2 s at the H200's ~2 GHz
            assert h.wait(timeout=60) == n
            busy = spin and not torch.cuda.default_stream().query()
            torch.cuda.synchronize()
            for layer in range(L):
                assert torch.equal(bits(dst[layer]), src[layer].view(torch.int16)), layer
        assert busy, "the load ended only once the default stream's later work was done"


def test_a_scatter_of_pages_in_any_order_waits_for_nothing():
    """A unit's pages scattered into a CUDA cache at page ids in no order
    (vLLM's block ids seldom run consecutively) queue their copies without
    a wait for the device (torch's sync debug mode raises on one): the
    ids went to the GPU from pageable memory (a wait for the stream) and
    were copied back to be looked at once per KV part (another).  Bytes
    identical."""
    from kvblock.tensors.transfer import _scatter_pages

    n, pages = 5, 12
    ids = np.array([9, 2, 7, 0, 11])
    src = _rand(1, n, 2, BS, H, D)                        # (groups, n, kv, BS, Hg, D)
    views = [_zeros(pages, BS, H, D) for _ in range(2)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _scatter_pages(views, src.view(torch.int16), ids, 0, H, 2)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for k, view in enumerate(views):
        assert torch.equal(bits(view[ids]), bits(src[0, :, k])), k
        assert not view[[p for p in range(pages) if p not in ids]].any(), k
