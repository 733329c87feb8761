"""The DRAM tier: frequency-aware replacement, and a store that serves hot
blocks from memory and the rest from the device, byte-identical."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict

import numpy as np
import pytest

from kvblock import KVStore, create_file
from kvblock.errors import ConfigError
from kvblock.index import normalize_keys
from kvblock.tiers import HostTier
from tests.store.workload import GEOM, REGION, run_data, run_keys


def block(i, size=4096):
    return np.full(size, i % 251, np.uint8)


def test_one_hit_blocks_do_not_push_out_hot_ones():
    tier = HostTier(10 * 4096, 4096)
    hot = [f"hot{i}".encode() for i in range(5)]
    for k in hot:
        tier.put(k, block(1))
        assert tier.get(k) is not None      # second touch: protected
    for i in range(100):                    # a scan of one-hit blocks
        tier.put(f"scan{i}".encode(), block(i))
    assert all(k in tier for k in hot)
    assert len(tier) == 10
    s = tier.stats()
    assert s["host_evictions"] == 95 and s["host_tier_hits"] == 5


def test_lru_within_segments_and_discard():
    tier = HostTier(4 * 4096, 4096)
    for i in range(4):
        tier.put(bytes([i]) * 16, block(i))
    tier.put(b"x" * 16, block(9))           # evicts the oldest probation block
    assert bytes([0]) * 16 not in tier and b"x" * 16 in tier
    out = np.zeros(4096, np.uint8)
    assert tier.read_into(b"x" * 16, out) and (out == 9).all()
    tier.discard(b"x" * 16)
    assert b"x" * 16 not in tier and not tier.read_into(b"x" * 16, out)
    with pytest.raises(ConfigError, match="fewer than two"):
        HostTier(4096, 4096)


def test_copy_out_hands_the_block_over_under_the_lock_and_counts_like_get():
    """copy_out (DRAM hits copied straight into CUDA) calls its copy with
    the block's bytes while the tier's lock is held (a slot a delete frees
    is reused at once), counts a hit or a miss as get does, and drops a
    copy older than the run its key names without calling the copy."""
    tier = HostTier(4 * 4096, 4096)
    tier.put(b"a" * 16, block(7), current=lambda: 5)
    seen = []

    def copy(b):
        assert tier.lock.locked()
        seen.append(b.copy())

    hits, misses = tier.hits, tier.misses
    assert tier.copy_out(b"a" * 16, copy, since=5)
    assert len(seen) == 1 and np.array_equal(seen[0], block(7))
    assert (tier.hits, tier.misses) == (hits + 1, misses)
    assert not tier.copy_out(b"b" * 16, copy)
    assert (tier.hits, tier.misses, len(seen)) == (hits + 1, misses + 1, 1)
    assert not tier.copy_out(b"a" * 16, copy, since=6)    # a newer run names the key
    assert len(seen) == 1 and b"a" * 16 not in tier
    assert not tier.lock.locked()


def test_a_block_of_the_wrong_size_is_refused_and_costs_no_slot():
    """A block that is not block_bytes long is a ConfigError naming both
    sizes, raised before anything is evicted or a slot taken: the tier still
    holds what it held and takes full-size blocks into every slot after."""
    tier = HostTier(2 * 4096, 4096)
    tier.put(b"a" * 16, block(1))
    for _ in range(3):
        with pytest.raises(ConfigError, match="block of 100 bytes.*4096-byte blocks"):
            tier.put(b"bad" * 5, block(2, size=100))
        with pytest.raises(ConfigError, match="block of 100 bytes"):
            tier.put(b"a" * 16, block(2, size=100), replace=True)
    assert b"a" * 16 in tier and b"bad" * 5 not in tier
    assert tier.get(b"a" * 16).tolist() == block(1).tolist()
    for i in range(4):
        tier.put(bytes([i]) * 16, block(i))
    assert len(tier) == 2 and tier.stats()["host_evictions"] == 3


def test_store_serves_from_both_tiers(tmp_path):
    path = tmp_path / "s.img"
    create_file(path, 16 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION).close()
    with KVStore.open([str(path)], host_cache_bytes=6 * GEOM.block_bytes) as store:
        a, b = run_keys(1, 4), run_keys(2, 4)
        store.put_run(a, run_data(a))
        store.put_run(b, run_data(b))        # the tier holds 6 of these 8 blocks
        keys = a + b
        assert store.lookup(keys) == 8
        out = np.zeros(8 * GEOM.block_bytes, np.uint8)
        assert store.get_run(keys, out) == 8
        want = np.concatenate([run_data(a).reshape(2, 2, 4, -1), run_data(b).reshape(2, 2, 4, -1)],
                              axis=2)
        assert np.array_equal(out.reshape(2, 2, 8, -1), want)
        s = store.stats()
        assert s["host_hit_blocks"] > 0 and s["device_hit_blocks"] > 0
        assert s["host_hit_blocks"] + s["device_hit_blocks"] == 8
        # delete() reaches the DRAM copies too (a block left only in DRAM:
        # test_delete_reaches_blocks_left_only_in_dram)
        store.delete(a[:1])
        assert store.lookup(a) == 0


def _layerwise_setup(tmp_path, torch):
    """(geometry, a 32 MiB store file, a vLLM-layout cache of 3 layers x 8
    blocks) for the layer-wise load tests."""
    from kvblock import Geometry

    path = tmp_path / "t.img"
    create_file(path, 32 << 20)
    src = [torch.randn(2, 8, 16, 4, 16).to(torch.bfloat16) for _ in range(3)]
    return Geometry(3, 4, 16, "bfloat16", 16), path, src


def test_layerwise_load_takes_hot_head_from_dram(tmp_path):
    torch = pytest.importorskip("torch")
    from kvblock.index import normalize_key
    from kvblock.tensors import VLLMLayout, load_blocks, save_blocks

    g, path, src = _layerwise_setup(tmp_path, torch)
    keys = [f"b{i}".encode() for i in range(6)]
    with KVStore.format([str(path)], g, region_size=1 << 20,
                        host_cache_bytes=3 * g.block_bytes) as store:
        save_blocks(store, keys, VLLMLayout(src), [0, 1, 2, 3, 4, 5])
        # Plant marked copies of blocks 0-2 in DRAM: a load must take them from there.
        for k in range(6):
            store.host.discard(normalize_key(keys[k]))
        for k in range(3):
            store.host.put(normalize_key(keys[k]), np.zeros(g.block_bytes, np.uint8))
        dst = [torch.ones(2, 8, 16, 4, 16, dtype=torch.bfloat16) for _ in range(3)]
        h = load_blocks(store, keys, VLLMLayout(dst), [0, 1, 2, 3, 4, 5])
        assert h.wait() == 6
        assert store.counters["host_hit_blocks"] == 3
    for layer in range(3):
        assert not dst[layer][:, :3].any()              # from DRAM
        assert torch.equal(dst[layer][:, 3:6].view(torch.int16),
                           src[layer][:, 3:6].view(torch.int16))  # from the device


@contextlib.contextmanager
def _old_and_new(tmp_path, seed: int, tier_blocks: int = 8):
    """A store over an 8 MiB file with a DRAM tier of ``tier_blocks``
    blocks, nothing put yet; the 2 keys ``run_keys(seed, 2)`` and two
    versions of their run's bytes: (store, keys, old, new)."""
    path = tmp_path / "kv.img"
    create_file(path, 8 << 20)
    keys = run_keys(seed, 2)
    old, new = run_data(keys), (run_data(keys) + 1).astype(np.uint8)
    with KVStore.format([str(path)], GEOM, region_size=REGION,
                        host_cache_bytes=tier_blocks * GEOM.block_bytes) as store:
        yield store, keys, old, new


def test_delete_reaches_blocks_left_only_in_dram(tmp_path):
    """A block whose run was evicted from the device lives on in the DRAM
    tier: delete() must remove it there too (it used to stay, and a re-put
    of the key then kept serving the deleted bytes)."""
    with _old_and_new(tmp_path, 5, tier_blocks=4) as (store, keys, old, new):
        store.put_run(keys, old)
        store.evict(all=True)                                # gone from the device
        assert store.lookup(keys) == 2                       # still in DRAM
        assert store.delete(keys) == 2 and store.lookup(keys) == 0
        store.put_run(keys, new)
        got = np.zeros_like(new)
        assert store.get_run(keys, got) == 2 and np.array_equal(got, new)
        assert store.delete(keys + [b"never-stored"]) == 2


def test_a_delete_during_a_read_or_put_is_not_undone_by_the_dram_tier(tmp_path):
    """A read that fetched blocks from the device puts them into the DRAM
    tier afterwards, a put its blocks once it has published the run: a
    delete() of those keys in between (another thread) must not be undone
    by that insert, which would keep the deleted keys hits."""
    with _old_and_new(tmp_path, 6) as (store, keys, old, new):
        store.put_run(keys, run_data(keys))
        for k in normalize_keys(keys):                   # pushed out of DRAM meanwhile
            store.host.discard(k)
        real_read, real_publish = store._read, store._publish_put

        def read_then_deleted(*args):
            n = real_read(*args)
            assert store.delete(keys) == 2               # another thread, right here
            return n
        store._read = read_then_deleted
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        assert store.get_run(keys, out) == 2 and np.array_equal(out, run_data(keys))
        del store._read
        assert store.lookup(keys) == 0 and store.get_run(keys, out) == 0

        def publish_then_deleted(run, clears):
            published = real_publish(run, clears)
            assert store.delete(keys) == 2
            return published
        store._publish_put = publish_then_deleted
        assert store.put_run(keys, run_data(keys)) == 2
        del store._publish_put
        assert store.lookup(keys) == 0 and store.get_run(keys, out) == 0
        # a put whose keys live on in DRAM only (their run was evicted from
        # the device): the older copies there go as well
        store.put_run(keys, old)
        store.evict(all=True)
        assert all(k in store.host for k in normalize_keys(keys))
        other = run_keys(7, 1)
        store.put_run(other, run_data(other))

        def publish_then_other_deleted(run, clears):
            published = real_publish(run, clears)
            store.delete(other)
            return published
        store._publish_put = publish_then_other_deleted
        assert store.put_run(keys, new) == 2
        del store._publish_put
        assert store.get_run(keys, out) == 2 and np.array_equal(out, new)



def test_a_read_overtaken_by_a_put_leaves_no_older_copy_in_dram(tmp_path):
    """A read that fetched a key's old run from the device, while that run
    was evicted and a put of new bytes for the key published (and its copy
    in DRAM pushed out again by other blocks), must not put the old bytes
    into the tier after it: later reads would be served the overwritten bytes from DRAM while
    the device holds the new ones."""
    with _old_and_new(tmp_path, 8) as (store, keys, old, new):
        store.put_run(keys, old)
        for k in normalize_keys(keys):                   # pushed out of DRAM meanwhile
            store.host.discard(k)
        real_read = store._read

        def read_then_overwritten(*args):
            n = real_read(*args)                         # the old run's bytes
            store.evict(all=True)                        # other threads, right here: the
            assert store.put_run(keys, new) == 2         # run is evicted, the keys put anew
            with store.host.lock:                        # and pushed out by other blocks
                for k in normalize_keys(keys):
                    store.host._drop_locked(k)
            return n
        store._read = read_then_overwritten
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        assert store.get_run(keys, out) == 2 and np.array_equal(out, old)
        del store._read
        assert store.get_run(keys, out) == 2
        assert np.array_equal(out, new), "the DRAM tier served the overwritten bytes"

@pytest.mark.parametrize("corrupt", [False, True])
def test_layerwise_load_goes_on_across_dram_and_device(tmp_path, corrupt):
    """Blocks 0-3 on the device, 4-5 only in DRAM (their run was evicted),
    6-7 on the device: load_blocks loads all 8, each from where it is (it
    used to stop at block 4).  A corrupt run after the DRAM stretch cuts
    the load there: the prefix before it is still whole."""
    torch = pytest.importorskip("torch")
    from kvblock.index import normalize_key
    from kvblock.tensors import VLLMLayout, load_blocks, save_blocks

    g, path, src = _layerwise_setup(tmp_path, torch)
    keys = [f"b{i}".encode() for i in range(8)]
    with KVStore.format([str(path)], g, region_size=1 << 20,
                        host_cache_bytes=8 * g.block_bytes) as store:
        save_blocks(store, keys[4:6], VLLMLayout(src), [4, 5])
        store.evict(all=True)                        # 4-5: only in DRAM now
        save_blocks(store, keys[:4], VLLMLayout(src), [0, 1, 2, 3])
        save_blocks(store, keys[6:], VLLMLayout(src), [6, 7])
        for k in keys[:4] + keys[6:]:                # these come from the device
            store.host.discard(normalize_key(k))
        assert store.lookup(keys) == 8
        if corrupt:
            run = store.index.segments([normalize_key(keys[6])])[0][0]
            _dev, off = store.regions.address(run.region, run.offset)
            with open(path, "r+b") as f:
                f.seek(off)
                f.write(b"\xff" * 4096)
        dst = [torch.zeros(2, 8, 16, 4, 16, dtype=torch.bfloat16) for _ in range(3)]
        h = load_blocks(store, keys, VLLMLayout(dst), list(range(8)))
        n = h.wait()
        assert n == (6 if corrupt else 8)
        assert store.counters["host_hit_blocks"] == 2
        # (load_blocks counted only its DRAM blocks; a corrupt run's are no hit)
        assert store.counters["device_hit_blocks"] == n - 2
        assert store.counters["checksum_failures"] == int(corrupt)
        assert store.regions.pins.sum() == 0
    for layer in range(3):
        assert torch.equal(dst[layer][:, :n].view(torch.int16),
                           src[layer][:, :n].view(torch.int16))


def test_close_unpins_the_arena_it_pinned(monkeypatch):
    """With a GPU the arena is page-locked with cudaHostRegister; close()
    must cudaHostUnregister it before unmapping.  It only unmapped: the
    driver kept the pages locked (host_cache_bytes of memory lost to every
    reopen of the store) and a later arena mapped at the same address could
    not be pinned (already registered)."""
    torch = pytest.importorskip("torch")

    class FakeCudart:
        def __init__(self):
            self.registered = {}

        def cudaHostRegister(self, address, nbytes, flags):
            if address in self.registered:
                return 712                   # cudaErrorHostMemoryAlreadyRegistered
            self.registered[address] = nbytes
            return 0

        def cudaHostUnregister(self, address):
            return 0 if self.registered.pop(address, None) is not None else 713

    rt = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    tier = HostTier(8 * 4096, 4096)
    assert tier.pinned and rt.registered == {tier.arena.address: 8 * 4096}
    tier.close()
    assert rt.registered == {}, "the closed arena is still page-locked"
    tier.close()                                 # twice: nothing more to undo


def test_a_pinned_arena_dropped_without_close_is_unpinned_before_its_unmap(monkeypatch):
    """A DRAM tier never closed (a KVStore collected without close(): it
    holds no thread that keeps it alive) had its arena unmapped by the
    garbage collector still registered with CUDA: the driver kept
    host_cache_bytes of pages locked for the process's life, and an arena
    or staging buffer mapped at that address later could not be
    page-locked.  It is unregistered as it is collected, while still
    mapped, and close() still unregisters it once."""
    import gc

    torch = pytest.importorskip("torch")
    seen = []

    from tests.support.gpu import mapped

    class FakeCudart:
        def __init__(self):
            self.registered = {}

        def cudaHostRegister(self, address, nbytes, flags):
            if address in self.registered:
                return 712
            self.registered[address] = nbytes
            return 0

        def cudaHostUnregister(self, address):
            seen.append((address, mapped(address)))
            return 0 if self.registered.pop(address, None) is not None else 713

    rt = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    tier = HostTier(8 * 4096, 4096)
    assert tier.pinned
    address = tier.arena.address
    del tier
    gc.collect()
    assert seen == [(address, True)], seen
    assert rt.registered == {}
    closed = HostTier(8 * 4096, 4096)
    assert closed.pinned
    closed.close()
    closed.close()
    del closed
    gc.collect()
    assert len(seen) == 2 and seen[1][1] and rt.registered == {}, seen


def test_a_failed_pin_clears_the_cuda_error_it_left(monkeypatch):
    """A cudaHostRegister that fails (the arena already registered, locked
    memory over its limit) falls back to pageable memory, but left the CUDA
    runtime's last error set: the next unrelated check on the thread
    (torch's cudaGetLastError after each kernel launch) reported it as its
    own.  The fallback clears it (cudaGetLastError, in the loaded runtime:
    torch's bindings have none)."""
    torch = pytest.importorskip("torch")
    from kvblock.memory import cudapin
    from tests.support.gpu import LoadedRuntime

    lib = LoadedRuntime()

    class FakeCudart:                   # torch.cuda.cudart(): no cudaGetLastError
        def cudaHostRegister(self, address, nbytes, flags):
            lib.last_error = 712         # cudaErrorHostMemoryAlreadyRegistered
            return 712

        def cudaHostUnregister(self, address):
            raise AssertionError("nothing was pinned")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    monkeypatch.setattr(cudapin, "_loaded_cudart", lambda: lib)
    tier = HostTier(8 * 4096, 4096)
    try:
        assert not tier.pinned
        assert lib.last_error == 0, "the failed registration left CUDA's last error set"
    finally:
        tier.close()


def test_the_loaded_cuda_runtime_is_none_without_one():
    """Without a libcudart mapped (no CUDA here) there is nothing to call."""
    from kvblock.memory import cudapin

    assert cudapin._loaded_cudart() is None


def test_a_host_cache_larger_than_memory_is_a_config_error(tmp_path):
    # 1 PiB: more than any address space; mmap answers ENOMEM, which used to
    # escape as a bare OSError naming neither the setting nor the fix
    with pytest.raises(ConfigError, match=r"host cache of 1125899906842624 bytes.*less"):
        HostTier(1 << 50, 4096)
    path = tmp_path / "s.img"
    create_file(path, 16 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION).close()
    with pytest.raises(ConfigError, match="host_cache_bytes"):
        KVStore.open([str(path)], host_cache_bytes=1 << 50)
    with KVStore.open([str(path)]) as store:     # the failed open left nothing held
        assert store.lookup(run_keys(1, 4)) == 0


@pytest.mark.parametrize("size", [10 ** 20, float("nan"), float("inf"), -1, "lots", True])
def test_a_host_cache_size_that_is_no_size_is_a_config_error(tmp_path, size):
    """A host_cache_bytes past the address space (mmap: OverflowError), or
    that is no byte count, is the ConfigError naming the setting, as a size
    larger than memory is; the failed open leaves nothing held."""
    with pytest.raises(ConfigError, match="host_cache_bytes"):
        HostTier(size, 4096)
    path = tmp_path / "s.img"
    create_file(path, 16 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION).close()
    with pytest.raises(ConfigError, match="host_cache_bytes"):
        KVStore.open([str(path)], host_cache_bytes=size)
    with KVStore.open([str(path)]) as store:
        assert store.lookup(run_keys(1, 4)) == 0


def test_get_blocks_counts_every_block_a_read_returned(tmp_path):
    """get_blocks / get_bytes count the blocks a read returned, from DRAM or
    the device (host_hit_blocks + device_hit_blocks split them): get_run
    counted only its device blocks and a load served wholly from DRAM none,
    while a load that read the device counted its DRAM blocks too."""
    torch = pytest.importorskip("torch")
    from kvblock.index import normalize_key
    from kvblock.tensors import VLLMLayout, load_blocks, save_blocks

    g, path, src = _layerwise_setup(tmp_path, torch)
    keys = [f"b{i}".encode() for i in range(6)]
    nkeys = [normalize_key(k) for k in keys]
    with KVStore.format([str(path)], g, region_size=1 << 20,
                        host_cache_bytes=6 * g.block_bytes) as store:
        save_blocks(store, keys, VLLMLayout(src), list(range(6)))
        stored = [store.host.get(k).copy() for k in nkeys]    # write-through: all in DRAM

        def only_in_dram(n):       # the first n blocks in DRAM, the rest on the device only
            for k in nkeys:
                store.host.discard(k)
            for k in range(n):
                store.host.put(nkeys[k], stored[k])
            c = store.counters
            return c["get_blocks"], c["get_bytes"], c["host_hit_blocks"], c["device_hit_blocks"]

        def since(before):
            c = store.counters
            now = c["get_blocks"], c["get_bytes"], c["host_hit_blocks"], c["device_hit_blocks"]
            return tuple(a - b for a, b in zip(now, before))

        dst = [torch.zeros(2, 8, 16, 4, 16, dtype=torch.bfloat16) for _ in range(3)]
        before = only_in_dram(3)
        assert load_blocks(store, keys[:3], VLLMLayout(dst), [0, 1, 2]).wait() == 3
        d = since(before)
        assert d == (3, 3 * g.block_bytes, 3, 0)
        before = only_in_dram(2)
        assert load_blocks(store, keys, VLLMLayout(dst), list(range(6))).wait() == 6
        d = since(before)
        assert d == (6, 6 * g.block_bytes, 2, 4)
        before = only_in_dram(2)
        out = np.zeros(6 * g.block_bytes, np.uint8)
        assert store.get_run(keys, out) == 6
        assert since(before) == (6, 6 * g.block_bytes, 2, 4)
    for layer in range(3):
        assert torch.equal(dst[layer][:, :6].view(torch.int16),
                           src[layer][:, :6].view(torch.int16))


def test_read_range_with_a_host_tier_counts_its_device_blocks(tmp_path):
    """README: host_hit_blocks and device_hit_blocks add up to get_blocks.
    read_range counted its device blocks in get_blocks but not in
    device_hit_blocks, so the two no longer added up."""
    path = create_file(tmp_path / "s.img", 4 << 20)
    keys = run_keys(1, 4)
    with KVStore.format([str(path)], GEOM, region_size=REGION,
                        host_cache_bytes=8 * GEOM.block_bytes) as store:
        assert store.put_run(keys, run_data(keys)) == 4
        out = np.zeros(4 * GEOM.group_block_bytes, np.uint8)
        assert store.read_range(keys, 1, 0, out) == 4
        want = run_data(keys).reshape(GEOM.num_layers, GEOM.head_groups, 4, -1)[1, 0]
        assert np.array_equal(out, want.reshape(-1))
        c = store.counters
        assert c["get_blocks"] == 4
        assert c["host_hit_blocks"] + c["device_hit_blocks"] == c["get_blocks"]


def test_delete_prefix_reaches_blocks_left_only_in_dram(tmp_path):
    """delete_prefix() drops the DRAM tier's blocks of the prefix, those
    whose runs are gone from the device too, and counts them; another
    prefix's blocks stay there."""
    path = tmp_path / "kv.img"
    create_file(path, 8 << 20)
    mine = [b"\xaa\xbb" + bytes([i]) * 14 for i in (1, 2)]
    theirs = [b"\xaa\xbc" + bytes([i]) * 14 for i in (1, 2)]
    with KVStore.format([str(path)], GEOM, region_size=REGION,
                        host_cache_bytes=8 * GEOM.block_bytes) as store:
        store.put_run(mine, run_data(mine))
        store.put_run(theirs, run_data(theirs))
        store.evict(all=True)                                # gone from the device
        assert store.lookup(mine) == 2 and store.lookup(theirs) == 2   # in DRAM
        assert store.delete_prefix(b"\xaa\xbb") == 2
        assert store.lookup(mine) == 0 and store.lookup(theirs) == 2
        got = np.zeros(2 * GEOM.block_bytes, np.uint8)
        assert store.get_run(theirs, got) == 2 and np.array_equal(got, run_data(theirs))


def test_a_load_cut_short_by_a_checksum_failure_counts_only_what_it_returned(tmp_path):
    """A layer-wise load of a device run then blocks only in DRAM: the run
    fails its checksum, so the load returns 0 blocks.  The DRAM stretch
    after it was counted in get_blocks / host_hit_blocks as soon as it was
    copied (README: get_blocks counts the blocks reads returned)."""
    torch = pytest.importorskip("torch")
    from kvblock.index import normalize_key
    from kvblock.tensors import VLLMLayout, load_blocks, save_blocks

    g, path, src = _layerwise_setup(tmp_path, torch)
    a, b = [b"a0", b"a1"], [b"b0", b"b1"]
    with KVStore.format([str(path)], g, region_size=1 << 20,
                        host_cache_bytes=6 * g.block_bytes) as store:
        save_blocks(store, b, VLLMLayout(src), [2, 3])
        store.evict(all=True)            # b in DRAM only (evict keeps the tier)
        save_blocks(store, a, VLLMLayout(src), [0, 1])
        for k in a:                      # a on the device only
            store.host.discard(normalize_key(k))
        run_a = store.index.locate(normalize_key(a[0]))[0]
        _, off = store.regions.address(run_a.region, run_a.offset)
        with open(path, "r+b") as f:     # damage run a's last layer
            f.seek(off + (g.num_layers - 1) * store.layout(2).range_bytes + 64)
            f.write(b"\xde\xad")
        before = dict(store.counters)
        dst = [torch.zeros(2, 8, 16, 4, 16, dtype=torch.bfloat16) for _ in range(3)]
        assert load_blocks(store, a + b, VLLMLayout(dst), [0, 1, 2, 3]).wait() == 0
        c = store.counters
        assert c["checksum_failures"] - before["checksum_failures"] == 1
        assert c["get_blocks"] == before["get_blocks"]
        assert c["host_hit_blocks"] == before["host_hit_blocks"]
        assert c["device_hit_blocks"] == before["device_hit_blocks"]


@pytest.mark.parametrize("how", ["prefix", "keys"])
def test_delete_keeps_another_owners_block_a_newer_run_holds_in_dram(tmp_path, how):
    """A run of mine whose last key another owner's newer run stored again;
    that newer run was evicted from the device, its blocks live on in DRAM.
    Deleting my run discarded the DRAM copies of all its keys, the other
    owner's too: its block was gone from the store though it never asked."""
    path = create_file(tmp_path / "s.img", 4 << 20)
    me, them = b"\xaa\x01", b"\xaa\x02"
    mine = [me + bytes([i]) * 14 for i in (1, 2)]
    theirs = [them + bytes([i]) * 14 for i in (1, 2)]
    with KVStore.format([str(path)], GEOM, region_size=REGION,
                        host_cache_bytes=64 * GEOM.block_bytes) as store:
        store.put_run(mine + theirs[:1], run_data(mine + theirs[:1]))
        region = store.index.locate(mine[0])[0].region
        i = 0
        while store.regions.open == region:      # my run's region sealed
            store.put_run(run_keys(i, 4), run_data(run_keys(i, 4)))
            i += 1
        store.put_run(theirs, run_data(theirs))  # another region; supersedes theirs[0]
        pins = store.pin(mine)                   # keeps my region on the device
        store.evict(all=True)
        store.unpin(pins)
        assert store.index.locate(theirs[0]) is None and store.lookup(theirs) == 2  # DRAM
        removed = store.delete_prefix(me) if how == "prefix" else store.delete(mine)
        assert removed == 2
        assert store.lookup(mine) == 0 and store.lookup(theirs) == 2
        got = np.zeros(2 * GEOM.block_bytes, np.uint8)
        assert store.get_run(theirs, got) == 2 and np.array_equal(got, run_data(theirs))


def test_a_read_while_clear_drops_the_runs_does_not_refill_dram(tmp_path):
    """clear() empties the DRAM tier and then drops the runs from the
    device: a read that begins in between (another thread) fetches a run
    not yet dropped and puts its blocks into the tier.  Those blocks must
    not outlive the clear: keys cleared stay hits otherwise, served old KV."""
    path = tmp_path / "kv.img"
    create_file(path, 8 << 20)
    keys = run_keys(9, 2)
    with KVStore.format([str(path)], GEOM, region_size=REGION,
                        host_cache_bytes=8 * GEOM.block_bytes) as store:
        store.put_run(keys, run_data(keys))
        real_evict = store.evict
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)

        def read_then_evict(*args, **kw):
            assert store.get_run(keys, out) == 2         # another thread, right here
            return real_evict(*args, **kw)
        store.evict = read_then_evict
        store.clear()
        del store.evict
        assert store.lookup(keys) == 0 and store.get_run(keys, out) == 0
        assert len(store.host) == 0 and store.stats()["host_blocks"] == 0


def test_host_tier_misses_count_the_blocks_dram_did_not_have(tmp_path):
    """host_tier_hits / host_tier_misses give the DRAM tier's hit ratio: a
    read counts a miss for each block of its prefix it took from the device,
    and one for the key that ended the prefix (in neither tier); get_run
    counted none of them, a layer-wise load one per device stretch."""
    torch = pytest.importorskip("torch")
    from kvblock.index import normalize_key
    from kvblock.tensors import VLLMLayout, load_blocks, save_blocks

    g, path, src = _layerwise_setup(tmp_path, torch)
    keys = [f"b{i}".encode() for i in range(6)]
    nkeys = [normalize_key(k) for k in keys]
    with KVStore.format([str(path)], g, region_size=1 << 20,
                        host_cache_bytes=6 * g.block_bytes) as store:
        save_blocks(store, keys, VLLMLayout(src), list(range(6)))

        def in_dram_only(*which):     # these blocks in DRAM, the others on the device only
            for k in range(6):
                if k not in which:
                    store.host.discard(nkeys[k])
            s = store.host.stats()
            return s["host_tier_hits"], s["host_tier_misses"]

        def since(before):
            s = store.host.stats()
            return s["host_tier_hits"] - before[0], s["host_tier_misses"] - before[1]

        out = np.zeros(7 * g.block_bytes, np.uint8)
        before = in_dram_only(0, 3)
        assert store.get_run(keys, out[:6 * g.block_bytes]) == 6
        assert since(before) == (2, 4)
        before = in_dram_only(0, 3)
        assert store.get_run(keys + [b"nowhere"], out) == 6
        assert since(before) == (2, 5)
        dst = [torch.zeros(2, 8, 16, 4, 16, dtype=torch.bfloat16) for _ in range(3)]
        before, device = in_dram_only(0, 3), store.counters["device_hit_blocks"]
        assert load_blocks(store, keys, VLLMLayout(dst), list(range(6))).wait() == 6
        # the load reads blocks 1-5 from the device in one stretch (3 too)
        assert since(before) == (1, 5) == (1, store.counters["device_hit_blocks"] - device)


def test_read_range_returns_blocks_left_only_in_dram(tmp_path):
    """lookup() counts blocks whose runs were evicted from the device but
    that the DRAM tier still holds, and get_run returns them; read_range
    (the README reads lookup()'s prefix with it) read the device only and
    returned 0 for them.  It takes them from DRAM now, counted as host hits,
    and a prefix half on the device, half only in DRAM reads whole."""
    path = create_file(tmp_path / "s.img", 4 << 20)
    old, new = run_keys(1, 3), run_keys(2, 2)
    g = GEOM
    with KVStore.format([str(path)], g, region_size=REGION,
                        host_cache_bytes=8 * g.block_bytes) as store:
        assert store.put_run(old, run_data(old)) == 3
        store.evict(all=True)                         # only in DRAM now
        assert store.put_run(new, run_data(new)) == 2
        for k in normalize_keys(new):                 # only on the device
            assert store.host.discard(k)
        keys = old + new
        want = np.concatenate([run_data(old).reshape(g.num_layers, g.head_groups, 3, -1),
                               run_data(new).reshape(g.num_layers, g.head_groups, 2, -1)],
                              axis=2)
        assert store.lookup(keys) == 5
        before = dict(store.counters)
        for layer in range(g.num_layers):
            for group in range(g.head_groups):
                out = np.zeros(5 * g.group_block_bytes, np.uint8)
                assert store.read_range(keys, layer, group, out) == 5
                assert np.array_equal(out, want[layer, group].reshape(-1))
        c = {k: v - before.get(k, 0) for k, v in store.counters.items()}
        reads = g.num_layers * g.head_groups
        assert c["get_blocks"] == 5 * reads
        assert c["get_bytes"] == 5 * reads * g.group_block_bytes
        assert (c["host_hit_blocks"], c["device_hit_blocks"]) == (3 * reads, 2 * reads)


def test_delete_prefix_counts_and_keeps_the_dram_copies_of_a_kept_run(tmp_path):
    """delete_prefix(prefix, keep=...) keeps the runs holding a key of keep,
    all their keys; with a DRAM tier it still dropped the tier's copies of
    the kept run's other keys and counted them as removed (2 here, 0
    without a tier), though lookup() still finds every one on the device."""
    path = create_file(tmp_path / "s.img", 4 << 20)
    mine = [b"\xaa\xbb" + bytes([i]) * 14 for i in (1, 2, 3)]
    with KVStore.format([str(path)], GEOM, region_size=REGION,
                        host_cache_bytes=8 * GEOM.block_bytes) as store:
        assert store.put_run(mine, run_data(mine)) == 3
        assert store.delete_prefix(b"\xaa\xbb", keep=mine[:1]) == 0
        assert store.lookup(mine) == 3
        assert store.stats()["host_blocks"] == 3
        got = np.zeros(3 * GEOM.block_bytes, np.uint8)
        assert store.get_run(mine, got) == 3 and np.array_equal(got, run_data(mine))
        # A newer run took mine[2]: it is not kept, nor is its DRAM copy.
        newer = mine[2:] + [b"\xaa\xbb" + b"\x04" * 14]
        assert store.put_run(newer, run_data(newer)) == 2
        assert store.delete_prefix(b"\xaa\xbb", keep=mine[:1]) == 2
        assert store.lookup(mine) == 2 and store.lookup(newer[1:]) == 0
        assert store.stats()["host_blocks"] == 2


def test_puts_after_a_clear_enter_the_dram_tier_again(tmp_path):
    """clear() moves the tier's epoch with the store's clear count: a put
    that began before a clear is kept out of DRAM, and one that begins
    after it goes in.  Were the two counts apart (the tier's epoch left
    behind), no put after the first clear() would ever reach the tier:
    every read served from the device, silently."""
    path = tmp_path / "kv.img"
    create_file(path, 8 << 20)
    with KVStore.format([str(path)], GEOM, region_size=REGION,
                        host_cache_bytes=8 * GEOM.block_bytes) as store:
        for i in range(3):                       # before any clear, and after one and two
            keys = run_keys(20 + i, 2)
            assert store.put_run(keys, run_data(keys)) == 2
            assert all(k in store.host for k in normalize_keys(keys)), i
            before = store.stats()["host_hit_blocks"]
            out = np.zeros(2 * GEOM.block_bytes, np.uint8)
            assert store.get_run(keys, out) == 2 and np.array_equal(out, run_data(keys))
            assert store.stats()["host_hit_blocks"] - before == 2, i
            store.clear()
            assert store.lookup(keys) == 0 and len(store.host) == 0


def test_an_insert_that_began_before_a_clear_or_discard_is_kept_out():
    """HostTier.put's ``epoch`` and ``discards``: a block read or written
    before a clear() or a discard() (of any key) since is not inserted, and
    with ``replace`` the older copy of its key goes too; one taken after
    them goes in.  (The store looks at its index as well, so only the tier
    itself shows a guard that stopped working.)"""
    tier = HostTier(8 * 4096, 4096)
    old, new = b"o" * 16, b"n" * 16
    for guard in ("clear", "discard", "discard_prefix"):
        tier.clear()
        tier.put(old, block(1))
        epoch, discards = tier.epoch, tier.discards
        if guard == "clear":
            tier.clear()
            tier.put(old, block(1))                      # back, by a read after the clear
            stale = {"epoch": epoch}
        else:
            getattr(tier, guard)(b"zz" * 8 if guard == "discard" else b"zz")  # another key
            stale = {"discards": discards}
        tier.put(new, block(2), **stale)
        assert new not in tier, guard
        tier.put(old, block(3), replace=True, **stale)
        assert old not in tier, guard                   # the older copy went too
        fresh = {"epoch": tier.epoch} if guard == "clear" else {"discards": tier.discards}
        tier.put(new, block(4), **fresh)
        assert new in tier and tier.get(new).tolist() == block(4).tolist(), guard


def test_a_tier_full_of_hot_blocks_leaves_new_ones_room_to_earn_a_second_read():
    """The protected segment holds at most 80% of the slots (PROTECTED_SHARE):
    once every block was read twice, the coldest of them go back to
    probation, so a new block is not pushed out by the very next new one
    before its own second read.  With no limit the tier kept its whole
    hot set and gave new blocks one slot between them."""
    tier = HostTier(10 * 4096, 4096)
    hot = [f"hot{i}".encode() for i in range(10)]
    for i, k in enumerate(hot):
        tier.put(k, block(i))
        assert tier.get(k) is not None           # read twice: protected
    tier.put(b"new-a", block(100))
    tier.put(b"new-b", block(101))
    assert b"new-a" in tier and b"new-b" in tier
    assert tier.get(b"new-a").tolist() == block(100).tolist()
    assert [k in tier for k in hot] == [False, False] + [True] * 8   # the two coldest went


def test_a_put_overtaken_by_a_newer_put_never_serves_its_older_copy_from_dram(tmp_path):
    """Two puts of a key racing (a grown prefix): the older put, which found
    its run still naming the key and then copied its blocks into the DRAM
    tier, must not replace the copy the newer put (published and returned
    meanwhile) gave the tier: a read begun after the newer put returned was
    served the older bytes from DRAM until the older put looked again."""
    with _old_and_new(tmp_path, 9) as (store, keys, _, new):
        old = run_data(keys[:1])                         # the older put: the first block
        real_put, real_keep = store.host.put, store._tier_keep_newest
        seen, newer, began = [], [], []

        def in_thread(call, *args):                      # another thread, right here
            t = threading.Thread(target=lambda: newer.append(call(*args)))
            t.start()
            t.join(10)

        def put_overtaken(key, block, **kw):
            if not began:                                # the older put, about to copy
                began.append(True)
                in_thread(store.put_run, keys, new)      # the newer one, whole
                assert newer == [2]
            return real_put(key, block, **kw)

        def read_before_the_older_put_looks_again(keys_, named, *rest):
            if newer and not seen and keys_ == normalize_keys(keys[:1]):
                out = np.zeros(GEOM.block_bytes, np.uint8)
                in_thread(lambda: (store.get_run(keys[:1], out), out.copy()))
                seen.append(newer.pop())
            return real_keep(keys_, named, *rest)
        store.host.put = put_overtaken
        store._tier_keep_newest = read_before_the_older_put_looks_again
        assert store.put_run(keys[:1], old) == 1
        del store.host.put, store._tier_keep_newest
        n, got = seen[0]
        g = GEOM
        first = new.reshape(g.num_layers, g.head_groups, 2, g.group_block_bytes)[:, :, :1]
        assert n == 1
        assert np.array_equal(got, first.reshape(-1)), "DRAM served the older put's bytes"
        out = np.zeros(GEOM.block_bytes, np.uint8)
        assert store.get_run(keys[:1], out) == 1 and np.array_equal(out, first.reshape(-1))


@pytest.mark.parametrize("reader", ["get_run", "load_blocks"])
def test_reads_served_from_dram_keep_their_run_under_lru(tmp_path, reader):
    """A read the DRAM tier answers is a read all the same: LRU keeps the
    run's region on the device as it does for a store without a tier (a
    hot run read from DRAM only used to look never read, and was the first
    to go; once the tier dropped it too, the hot run was lost)."""
    path = tmp_path / "small.img"
    create_file(path, 3 << 20)
    with KVStore.format([str(path)], GEOM, region_size=REGION, eviction="lru",
                        host_cache_bytes=8 * GEOM.block_bytes) as store:
        hot = run_keys(0, 4)
        store.put_run(hot, run_data(hot))
        out = np.zeros(4 * GEOM.block_bytes, np.uint8)

        def read():
            if reader == "get_run":
                return store.get_run(hot, out)
            torch = pytest.importorskip("torch")
            from kvblock.tensors import VLLMLayout, load_blocks
            cache = [torch.zeros(2, 4, 16, 2, 32, dtype=torch.float16) for _ in range(2)]
            return load_blocks(store, hot, VLLMLayout(cache), [0, 1, 2, 3]).wait()
        for i in range(1, 80):
            keys = run_keys(i, 4)
            assert store.put_run(keys, run_data(keys)) == 4
            assert read() == 4
        assert store.stats()["evicted_regions"] >= store.regions.count
        assert store.stats()["host_hit_blocks"] > 0
        with store._lock:
            assert (store.index.lookup(normalize_keys(hot)) >= 0).all()


def test_pin_holds_the_whole_prefix_lookup_reports_with_a_dram_tier(tmp_path):
    """lookup() counts blocks the DRAM tier holds; pin() is the lease
    between that lookup and the load, so it must hold the same prefix: the
    device runs past a block that lives only in DRAM (pin() used to stop
    there and return [], and evict() then took them), and that block in
    the tier while other puts fill it."""
    path = tmp_path / "kv.img"
    create_file(path, 8 << 20)
    head, tail = run_keys(1, 1), run_keys(2, 3)
    with KVStore.format([str(path)], GEOM, region_size=REGION,
                        host_cache_bytes=4 * GEOM.block_bytes) as store:
        assert store.put_run(head, run_data(head)) == 1
        store.evict(all=True)                # head lives on only in DRAM
        assert store.put_run(tail, run_data(tail)) == 3
        keys = head + tail
        assert store.lookup(keys) == 4
        pins = store.pin(keys)
        assert pins
        store.evict(all=True)                # the pinned tail stays
        for i in range(3, 10):               # one-hit puts fill the tier
            other = run_keys(i, 2)
            store.put_run(other, run_data(other))
        out = np.zeros(4 * GEOM.block_bytes, np.uint8)
        assert store.get_run(keys, out) == 4
        want = np.concatenate([run_data(head).reshape(2, 2, 1, -1),
                               run_data(tail).reshape(2, 2, 3, -1)], axis=2)
        assert np.array_equal(out.reshape(2, 2, 4, -1), want)
        store.unpin(pins)
        with pytest.raises(ConfigError, match="released already"):
            store.unpin(pins)
        assert not store.host.pins           # released: the tier may drop head again


def test_a_pin_alternating_dram_and_device_looks_up_about_its_own_keys(tmp_path, monkeypatch):
    """pin() with a DRAM tier looked up all the keys left once per block
    held only in DRAM: a prefix alternating DRAM and device blocks cost
    work quadratic in its length under the store's lock.  The keys looked
    up in all grow with the keys pinned; the lease is the same (every
    device block pinned there, every DRAM one in the tier)."""
    from tests.support.lookups import count_key_lookups

    n = 128
    keys = run_keys(1, n)
    dram, device = keys[0::2], keys[1::2]
    path = tmp_path / "kv.img"
    create_file(path, 8 << 20)
    with KVStore.format([str(path)], GEOM, region_size=REGION,
                        host_cache_bytes=(n + 2) * GEOM.block_bytes) as store:
        assert store.put_run(dram, run_data(dram)) == n // 2
        store.evict(all=True)                # the even keys live only in DRAM
        assert store.put_run(device, run_data(device)) == n // 2
        for k in normalize_keys(device):     # the odd keys only on the device
            store.host.discard(k)
        looked = count_key_lookups(monkeypatch)
        pins = store.pin(keys)
        monkeypatch.undo()
        assert pins.host_keys == tuple(normalize_keys(dram))
        assert [(count, at) for _, _, count, at in pins] == [(1, 2 * i + 1) for i in range(n // 2)]
        store.unpin(pins)
        assert not store.host.pins
    # n / 2 DRAM blocks: about n * n / 4 keys when each looked at all the
    # keys left; a few per key pinned now
    # (at least each device key's own lookup: an empty count is no count)
    assert n // 2 <= sum(looked) < 10 * n, \
        f"{len(looked)} lookups of {sum(looked)} keys for {n} keys"


@contextlib.contextmanager
def _held_only_in_dram(tmp_path, keys, tier_blocks: int):
    """A store whose DRAM tier (of ``tier_blocks`` blocks) alone holds the
    run of ``keys`` (put, then evicted from the device)."""
    path = tmp_path / "kv.img"
    create_file(path, 8 << 20)
    with KVStore.format([str(path)], GEOM, region_size=REGION,
                        host_cache_bytes=tier_blocks * GEOM.block_bytes) as store:
        assert store.put_run(keys, run_data(keys)) == len(keys)
        store.evict(all=True)                # in DRAM only
        yield store


def test_a_pin_of_a_prefix_held_only_in_dram_is_a_pin(tmp_path):
    """A prefix the DRAM tier alone holds pins no device stretch: its handle
    was an empty list, which callers (the LMCache plugin: `if not segs`)
    take for a miss and never release, leaving the blocks pinned in the
    tier for good.  The handle is true when it pins anything."""
    keys = run_keys(1, 2)
    with _held_only_in_dram(tmp_path, keys, 4) as store:
        pins = store.pin(keys)
        assert pins and len(pins) == 0 and pins.host_keys == tuple(normalize_keys(keys))
        assert not store.pin(run_keys(2, 1))  # nothing stored: nothing pinned
        store.unpin(pins)
        assert not store.host.pins


def test_a_tier_whose_blocks_are_all_pinned_takes_no_new_one():
    tier = HostTier(2 * 4096, 4096)
    tier.put(b"a" * 16, block(1))
    tier.put(b"b" * 16, block(2))
    pin_a = tier.pin(b"a" * 16)
    assert pin_a and tier.pin(b"b" * 16) and not tier.pin(b"c" * 16)
    tier.put(b"c" * 16, block(3))
    assert b"c" * 16 not in tier and len(tier) == 2 and tier.stats()["host_evictions"] == 0
    tier.unpin([pin_a])
    tier.put(b"c" * 16, block(3))
    assert b"a" * 16 not in tier and b"b" * 16 in tier and b"c" * 16 in tier


def test_a_read_whose_prefix_came_from_dram_is_no_miss(tmp_path):
    """miss_gets counts reads that returned nothing.  With a DRAM tier, a
    get whose prefix came from DRAM and whose next key is stored nowhere
    counted a miss (the device read of the rest found nothing), though it
    returned blocks, and the same get without a tier counts none."""
    path = create_file(tmp_path / "s.img", 4 << 20)
    a = run_keys(1, 2)
    for host in (8 * GEOM.block_bytes, 0):
        with KVStore.format([str(path)], GEOM, region_size=REGION, force=True,
                            host_cache_bytes=host) as store:
            assert store.put_run(a, run_data(a)) == 2
            out = np.zeros(3 * GEOM.block_bytes, np.uint8)
            c = store.counters
            before = dict(c)
            assert store.get_run(a + [b"nowhere"], out) == 2
            assert store.get_runs([(a + [b"nowhere"], out)]) == [2]
            part = np.zeros(3 * GEOM.group_block_bytes, np.uint8)
            assert store.read_range(a + [b"nowhere"], 0, 0, part) == 2
            assert c["miss_gets"] == before["miss_gets"], host
            assert c["get_blocks"] - before["get_blocks"] == 6
            assert store.get_run([b"nowhere"] + a, out) == 0      # a miss, in either
            assert c["miss_gets"] - before["miss_gets"] == 1, host


@pytest.mark.parametrize("how", ["discard", "clear"])
def test_a_pin_ends_with_the_block_it_pinned(how):
    """delete() and clear() remove a pinned block; the pin was kept by key,
    so a later copy of that key (a re-put nobody pinned) was unevictable
    until the old lease was released, and with every slot so held the
    tier took no new block.  A pin holds the copy it pinned; a new pin of
    the new copy is not released by the old handle."""
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    tier = HostTier(2 * 4096, 4096)
    tier.put(a, block(1))
    old = tier.pin(a)
    assert old
    if how == "discard":
        tier.discard(a)
    else:
        tier.clear()
    tier.put(a, block(2))                  # a new copy: nobody's pin
    tier.put(b, block(3))
    tier.put(c, block(4))                  # evicts the oldest: a
    assert a not in tier and b in tier and c in tier
    tier.put(a, block(5))                  # b goes
    new = tier.pin(a)
    tier.unpin([old])                      # the old lease ends: not the new one
    tier.put(b, block(6))
    tier.put(b"d" * 16, block(7))
    assert a in tier and tier.get(a).tolist() == block(5).tolist()
    tier.unpin([new])
    assert not tier.pins


def test_a_store_pin_of_a_deleted_block_leaves_its_re_put_evictable(tmp_path):
    keys = run_keys(1, 2)
    with _held_only_in_dram(tmp_path, keys, 2) as store:
        pins = store.pin(keys)
        assert pins.host_keys == tuple(normalize_keys(keys))
        assert store.delete(keys) == 2
        assert store.put_run(keys, run_data(keys)) == 2
        for i in range(2, 5):                # other puts take the tier's slots
            other = run_keys(i, 2)
            store.put_run(other, run_data(other))
        assert not any(k in store.host for k in normalize_keys(keys))
        store.unpin(pins)
        assert not store.host.pins


@pytest.mark.parametrize("how", ["delete", "delete_prefix", "clear", "dram_eviction"])
def test_removed_since_reports_blocks_that_leave_the_dram_tier(tmp_path, how):
    """A run evicted from the device is logged (removed_since) while its
    blocks live on in DRAM, so a watcher checking present() keeps them.
    When they then left DRAM (delete, clear, the tier's own eviction) no
    log said so: the watcher (the vLLM tier's BlockRemoved events) never
    heard that the store no longer held them."""
    path = tmp_path / "kv.img"
    create_file(path, 8 << 20)
    keys = run_keys(1, 2)
    with KVStore.format([str(path)], GEOM, region_size=REGION,
                        host_cache_bytes=4 * GEOM.block_bytes) as store:
        assert store.put_run(keys, run_data(keys)) == 2
        store.evict(all=True)                        # in DRAM only
        cursor, logged = store.removed_since(None)
        assert store.present(keys).all()             # a watcher keeps them
        if how == "delete":
            assert store.delete(keys) == 2
        elif how == "delete_prefix":
            keys = keys[:1]                          # the prefix of one of them
            assert store.delete_prefix(normalize_keys(keys)[0][:8]) == 1
        elif how == "clear":
            store.clear()
        else:
            for i in range(2, 5):                    # other puts fill the tier
                other = run_keys(i, 2)
                store.put_run(other, run_data(other))
        assert not store.present(keys).any()
        _, logged = store.removed_since(cursor)
        assert set(normalize_keys(keys)) <= set(logged)


def test_a_put_evicted_before_it_reaches_dram_leaves_no_older_copy_there(tmp_path):
    """A key held only in DRAM (its run evicted from the device) is put
    anew, and the new run is evicted (another thread's evict, or a put's)
    between its publish and the put's turn at the tier: the older copy in
    DRAM stayed, and reads were served the overwritten bytes from it."""
    with _old_and_new(tmp_path, 8) as (store, keys, old, new):
        store.put_run(keys, old)
        store.evict(all=True)
        assert all(k in store.host for k in normalize_keys(keys))
        real_unpin = store._unpin_writers

        def unpinned_then_evicted(regions):
            real_unpin(regions)
            store.evict(all=True)                        # another thread, right here
        store._unpin_writers = unpinned_then_evicted
        assert store.put_run(keys, new) == 2
        del store._unpin_writers
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        n = store.get_run(keys, out)
        assert not np.array_equal(out, old), "DRAM served the overwritten bytes"
        assert n == 0 and store.lookup(keys) == 0


@pytest.mark.parametrize("how", ["promoted", "demoted"])
def test_a_block_moving_between_segments_is_still_held(tmp_path, how):
    """A hit moves a block from probation to protected (and may push
    protected's coldest back to probation): membership was asked of the two
    segments without the tier's lock, so a lookup() or present() in
    another thread at that moment found the block in neither, and said a
    block held only in DRAM was not stored."""
    keys = run_keys(10, 2)
    with _held_only_in_dram(tmp_path, keys, 2) as store:  # protected holds 1 block
        ks, tier = normalize_keys(keys), store.host
        out = np.zeros(GEOM.block_bytes, np.uint8)
        if how == "demoted":
            assert store.get_run(keys[:1], out) == 1     # ks[0] protected, ks[1] probation
            moving, segment = ks[0], "probation"         # ks[1]'s hit demotes ks[0]
        else:
            moving, segment = ks[1], "protected"
        answers, threads = [], []

        class Watched(OrderedDict):
            def __setitem__(self, key, value):
                if key == moving and not threads:        # it left the other segment
                    threads.append(threading.Thread(target=lambda: answers.append(
                        (store.lookup(keys), store.present(keys).tolist()))))
                    threads[0].start()                   # another thread, right here
                    threads[0].join(0.3)                 # (or it waits for the tier's lock)
                super().__setitem__(key, value)
        setattr(tier, segment, Watched(getattr(tier, segment)))
        assert store.get_run(keys[1:], out) == 1          # ks[1]: a hit, promoted
        threads[0].join(10)
        assert answers == [(2, [True, True])]


@pytest.mark.parametrize("when", ["before_its_look", "after_its_copy"])
def test_an_older_put_finishing_late_keeps_the_newer_puts_copy_in_dram(tmp_path, when):
    """Two puts of a key in flight together: the newer one published after
    the older, gave the DRAM tier its copy and returned, and its run was
    evicted from the device (the tier keeps its blocks).  The older put,
    finishing after it, found no run naming the key (or its own run no
    longer naming it) and dropped the key from the tier: the newer put's
    copy, the only one left, was lost (a miss for stored blocks)."""
    with _old_and_new(tmp_path, 11) as (store, keys, old, new):
        real_publish, real_unpin, real_put = store._publish_put, store._unpin_writers, \
            store.host.put
        older = threading.get_ident()
        newer_waits, older_published, newer_done = (threading.Event() for _ in range(3))
        newer = threading.Thread(target=lambda: store.put_run(keys, new) == 2 and newer_done.set())

        def publish(run, clears):
            if threading.get_ident() != older:           # the newer put: after the older
                newer_waits.set()
                assert older_published.wait(10)
                return real_publish(run, clears)
            newer.start()                                # both past their look at the index
            assert newer_waits.wait(10)
            return real_publish(run, clears)

        def newer_returns_and_is_evicted():              # other threads, right here
            older_published.set()
            newer.join(10)
            assert newer_done.is_set()
            store.evict(all=True)
            assert all(k in store.host for k in normalize_keys(keys))

        def unpinned(regions):
            real_unpin(regions)
            if when == "before_its_look" and threading.get_ident() == older:
                newer_returns_and_is_evicted()

        def copied(key, block, **kw):
            real_put(key, block, **kw)
            if when == "after_its_copy" and threading.get_ident() == older \
                    and key == normalize_keys(keys)[-1]:
                newer_returns_and_is_evicted()
        store._publish_put, store._unpin_writers, store.host.put = publish, unpinned, copied
        assert store.put_run(keys, old) == 2
        del store._publish_put, store._unpin_writers, store.host.put
        assert newer_done.is_set()
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        assert store.get_run(keys, out) == 2, "the newer put's copy left DRAM"
        assert np.array_equal(out, new)


def test_a_reads_newest_check_drops_a_copy_older_than_the_run_named_now(tmp_path):
    """A read's copy went into DRAM, then a put published a newer run of
    the key (a grown prefix) whose own DRAM step did not happen (a put's
    thread cut between its publish and that step): the read's check after
    its insert found the key moved and must drop the older copy, whose age
    it compares with the run named now (the newer put's), not with the run
    it read (equal: kept, and served in place of the newer bytes)."""
    with _old_and_new(tmp_path, 11) as (store, keys, _, new):
        first = normalize_keys(keys[:1])
        store.put_run(keys[:1], run_data(keys[:1]))          # the run the read read
        with store._lock:
            named = store.index.lookup(first)
            published = [store.index.runs[int(p) >> 24].published for p in named]
        assert first[0] in store.host                         # its copy in DRAM
        real_put, real_keep = store.host.put, store._tier_keep_newest
        store.host.put = lambda *a, **kw: None                # the put's DRAM step skipped
        store._tier_keep_newest = lambda *a, **kw: None
        try:
            assert store.put_run(keys, new) == 2              # the newer run names it now
        finally:
            store.host.put, store._tier_keep_newest = real_put, real_keep
        store._tier_keep_newest(first, named, published)     # the read's check
        g = GEOM
        want = new.reshape(g.num_layers, g.head_groups, 2, g.group_block_bytes)[:, :, :1]
        got = np.zeros(g.block_bytes, np.uint8)
        assert store.get_run(keys[:1], got) == 1
        assert np.array_equal(got, want.reshape(-1)), "the older copy was served from DRAM"


@pytest.mark.parametrize("reader", ["get_run", "load_blocks"])
def test_a_dram_copy_older_than_the_run_its_key_names_is_not_served(tmp_path, reader):
    """A put published a newer run of a key (a grown prefix) and its DRAM
    step never came (its thread cut between the publish and that step):
    the older run's copy stayed in DRAM, and reads that found the key there
    served it, though the store names the newer run.  A copy older than
    the run named is a miss (and leaves the tier)."""
    with _old_and_new(tmp_path, 12) as (store, keys, _, new):
        store.put_run(keys[:1], run_data(keys[:1]))          # its copy in DRAM
        real_put, real_keep = store.host.put, store._tier_keep_newest
        store.host.put = lambda *a, **kw: None                # the put's DRAM step skipped
        store._tier_keep_newest = lambda *a, **kw: None
        try:
            assert store.put_run(keys, new) == 2
        finally:
            store.host.put, store._tier_keep_newest = real_put, real_keep
        assert normalize_keys(keys[:1])[0] in store.host     # the older copy

        def read():
            if reader == "get_run":
                out = np.zeros(GEOM.block_bytes, np.uint8)
                assert store.get_run(keys[:1], out) == 1
                return out
            torch = pytest.importorskip("torch")
            from kvblock.tensors import VLLMLayout, load_blocks
            cache = [torch.zeros(2, 1, 16, 2, 32, dtype=torch.float16) for _ in range(2)]
            assert load_blocks(store, keys[:1], VLLMLayout(cache), [0]).wait() == 1
            return torch.cat([c.reshape(-1) for c in cache]).view(torch.uint8).numpy().copy()
        got = read()
        store.host.clear()                                    # the device's bytes
        assert np.array_equal(got, read()), "DRAM served the older run's copy"


def test_a_read_of_a_key_put_and_evicted_while_it_read_raises_nothing(tmp_path):
    """A read with a DRAM tier looks up the run each key names, then reads
    the device: a key stored nowhere at the look (-1) that a put published
    before the device read (which then found it) and eviction took again
    before the read's DRAM insert made the insert's check (is the key still
    named by what the read looked at?) take -1 for a run id: a bare
    KeyError out of get_run.  The bytes read are the put's, the read counts
    them; they stay out of DRAM (the read cannot tell how old they are)."""
    with _old_and_new(tmp_path, 12) as (store, keys, old, _):
        real_read = store._read

        def put_read_evicted(*args):
            assert store.put_run(keys, old) == 2         # another thread, right here
            n = real_read(*args)
            store.evict(all=True)                        # and the run evicted
            return n
        store._read = put_read_evicted
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        assert store.get_run(keys, out) == 2 and np.array_equal(out, old)
        del store._read
        assert store.get_run(keys, out) == 2 and np.array_equal(out, old)   # the put's DRAM copies


def test_without_a_tier_every_block_read_is_a_device_hit(tmp_path):
    """device_hit_blocks stayed 0 on a store without a DRAM tier while
    get_blocks grew (stats and Prometheus said no block came from the
    device): every read path counts its device blocks, tier or not."""
    torch = pytest.importorskip("torch")
    from kvblock.tensors import VLLMLayout, load_blocks, save_blocks

    g, path, src = _layerwise_setup(tmp_path, torch)
    keys = [f"b{i}".encode() for i in range(6)]
    with KVStore.format([str(path)], g, region_size=1 << 20) as store:
        save_blocks(store, keys, VLLMLayout(src), list(range(6)))
        dst = [torch.zeros(2, 8, 16, 4, 16, dtype=torch.bfloat16) for _ in range(3)]
        assert load_blocks(store, keys, VLLMLayout(dst), list(range(6))).wait() == 6
        assert store.get_run(keys, np.zeros(6 * g.block_bytes, np.uint8)) == 6
        assert store.read_range(keys, 1, 0, np.zeros(6 * g.group_block_bytes, np.uint8)) == 6
        c = store.counters
        assert c["get_blocks"] == 18
        assert c["device_hit_blocks"] == 18 and c["host_hit_blocks"] == 0


@pytest.mark.parametrize("reader", ["get_run", "load_blocks"])
def test_a_tiered_read_dates_its_copies_once_per_run(tmp_path, monkeypatch, reader):
    """A read with a DRAM tier dates each copy by the run its key names
    (Run.published), under the store's lock: it took the run of every key
    from the index's runs one key at a time (2K keys: ~0.5 ms of Python
    under the lock, each read).  Each run named is taken once; the bytes
    are the same."""
    n = 32
    keys = run_keys(1, n)
    path = tmp_path / "kv.img"
    create_file(path, 8 << 20)
    with KVStore.format([str(path)], GEOM, region_size=REGION,
                        host_cache_bytes=(n + 2) * GEOM.block_bytes) as store:
        for half in (keys[:n // 2], keys[n // 2:]):          # two runs, all in DRAM
            assert store.put_run(half, run_data(half)) == n // 2
        taken = []

        class Runs(dict):
            def __getitem__(self, run_id):
                taken.append(run_id)
                return super().__getitem__(run_id)
        monkeypatch.setattr(store.index, "runs", Runs(store.index.runs))
        if reader == "get_run":
            out = np.zeros(n * GEOM.block_bytes, np.uint8)
            assert store.get_run(keys, out) == n
            got = [out.reshape(2, 2, n, -1)[:, :, :n // 2], out.reshape(2, 2, n, -1)[:, :, n // 2:]]
        else:
            torch = pytest.importorskip("torch")
            from kvblock.tensors import VLLMLayout, load_blocks
            cache = [torch.zeros(2, n, 16, 2, 32, dtype=torch.float16) for _ in range(2)]
            assert load_blocks(store, keys, VLLMLayout(cache), list(range(n))).wait() == n
            # (layer, kv, page, token, head, dim) back to the store's (layer,
            # head group: one head each, block, (kv, token, dim) bytes)
            blocks = torch.stack(cache).view(torch.uint8).numpy()
            blocks = blocks.reshape(2, 2, n, 16, 2, 64).transpose(0, 4, 2, 1, 3, 5)
            blocks = blocks.reshape(2, 2, n, -1)
            got = [blocks[:, :, :n // 2], blocks[:, :, n // 2:]]
        monkeypatch.undo()
        assert store.stats()["host_hit_blocks"] == n
        # each of the 2 runs: once to date its copies, once to count its
        # hits (_host_hits_used); not once per key
        assert len(set(taken)) == 2 and len(taken) <= 4, \
            f"{len(taken)} runs taken ({taken}) for {n} keys of 2 runs"
    for part, half in zip(got, (keys[:n // 2], keys[n // 2:])):
        assert np.array_equal(part.reshape(-1), run_data(half).reshape(-1))


def _tier_consistent(tier, where) -> None:
    """Every slot is free or holds one key of one segment; each key held
    has its copy's insert number and age, and nothing else has."""
    held = list(tier.probation.values()) + list(tier.protected.values())
    assert sorted(held + tier.free) == list(range(tier.slots)), (where, held, tier.free)
    keys = set(tier.probation) | set(tier.protected)
    assert len(keys) == len(held), where
    assert set(tier.born) == keys and set(tier.published) == keys, (where, tier.born, keys)


def test_a_tier_call_interrupted_at_any_line_holds_each_pin_once_and_loses_no_slot():
    """A KeyboardInterrupt landing at any line of HostTier.pin, unpin, put
    or discard (their loops' back jumps, the calls they make).  unpin's
    loop cut between two tokens kept the ones after it pinned for good
    (their blocks never evicted again, and a tier all pinned takes no new
    block); pin cut as it returned counted a pin whose token nobody got;
    put cut as it took a slot, or as it evicted, lost the slot (the tier
    one block smaller for good) or left the key's insert number behind
    (every later eviction looking at it raised KeyError); discard likewise.
    Now a token leaves the caller's list in the line its pin drops (pin:
    enters it in the line its pin is counted), a call cut partway finishes
    its steps, then raises, and a second unpin of the list releases only
    what is left; another lease's pin of the same copy is never released
    by it."""
    from tests.store.test_store import _LineInterrupt

    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    functions = [HostTier.pin, HostTier.unpin, HostTier.put, HostTier.discard,
                 HostTier.get, HostTier.clear, HostTier._drop_locked, HostTier._victim_locked,
                 HostTier._insert_locked, HostTier._lookup_locked, HostTier._protect]
    fired, n, cut = [], 0, _LineInterrupt(functions, 0)
    while True:
        n += 1
        cut.n, cut.count, cut.fired = n, 0, None      # (its code read once)
        tier = HostTier(3 * 4096, 4096)
        for i, k in enumerate((a, b, c)):
            tier.put(k, block(i))
        tier.get(b)                           # b protected
        other = tier.pin(a)                   # another lease's pin of a's copy
        held = []
        with cut:
            try:
                tier.pin(a, held)
                tier.pin(c, held)
                tier.put(d, block(4))             # evicts b (a and c pinned)
                tier.discard(c)
                tier.put(c, block(5), replace=True)   # into c's freed slot
                tier.put(d, block(6), replace=True)
                tier.get(a)
                tier.get(c)                       # a and c protected: b demoted
                tier.unpin(held)
                tier.clear()
            except KeyboardInterrupt:
                tier.unpin(held)              # the caller's cleanup: what is left
        assert held == [], (cut.fired, held)
        assert tier.pins == {other: 1}, (cut.fired, tier.pins)
        assert [k in tier for k in (a, b, c, d)].count(True) <= 3, cut.fired
        _tier_consistent(tier, cut.fired)
        tier.unpin([other])
        assert not tier.pins
        for i in range(8):                    # every slot takes blocks again
            tier.put(bytes([10 + i]) * 16, block(10 + i))
        assert len(tier) == 3 and not tier.free, cut.fired
        tier.close()
        if cut.fired is None:
            break
        fired.append(cut.fired)
    names = {name for name, _ in fired}
    assert {"pin", "unpin", "put", "discard", "_drop_locked", "_insert_locked", "_protect",
            "clear"} <= names, names


def test_a_clear_cut_short_still_empties_dram_and_later_puts_enter_it(tmp_path):
    """clear() counts itself first (the store's clear count, which puts
    compare with the tier's epoch), then evicts and drops the runs, then
    empties the DRAM tier.  Cut in between (a KeyboardInterrupt, an error
    out of the eviction) the tier kept the cleared blocks (lookup hits that
    served pre-clear KV) and its epoch stayed one behind the clear count
    for good: no put after it, not even after a clear() that completed,
    ever reached DRAM again."""
    path = tmp_path / "kv.img"
    create_file(path, 8 << 20)
    with KVStore.format([str(path)], GEOM, region_size=REGION,
                        host_cache_bytes=8 * GEOM.block_bytes) as store:
        old = run_keys(30, 2)
        store.put_run(old, run_data(old))
        real_evict = store.evict

        def evict_then_cut(*args, **kw):
            real_evict(*args, **kw)                  # the runs leave the device
            raise KeyboardInterrupt
        store.evict = evict_then_cut
        with pytest.raises(KeyboardInterrupt):
            store.clear()
        del store.evict
        assert len(store.host) == 0 and store.lookup(old) == 0, \
            "the DRAM tier kept blocks a clear() forgot"
        store.clear()                                # the caller's retry completes
        keys = run_keys(31, 2)
        assert store.put_run(keys, run_data(keys)) == 2
        assert all(k in store.host for k in normalize_keys(keys)), \
            "puts after the clear no longer enter the DRAM tier"


@contextlib.contextmanager
def _device_dram_device(tmp_path):
    """A store of a (2 blocks, on the device only), b (1, in DRAM only) and
    c (1, on the device only): yields (store, a, b, c)."""
    path = tmp_path / "kv.img"
    create_file(path, 8 << 20)
    a, b, c = run_keys(40, 2), run_keys(41, 1), run_keys(42, 1)
    with KVStore.format([str(path)], GEOM, region_size=REGION,
                        host_cache_bytes=8 * GEOM.block_bytes) as store:
        store.put_run(b, run_data(b))
        store.evict(all=True)                        # b: only in DRAM
        store.put_run(a, run_data(a))
        store.put_run(c, run_data(c))
        for k in normalize_keys(a + c):              # a and c: on the device only
            store.host.discard(k)
        yield store, a, b, c


def _fail_reads_of(store, keys) -> None:
    """The store's device reads of the run holding ``keys[0]`` fail (EIO);
    ``del store._read_segs`` undoes it."""
    from kvblock.errors import IOFailedError

    real, first = store._read_segs, normalize_keys(keys)[0]

    def failing(segs, dst, only, *rest):
        if any(run.key(0) == first for run, _, _, _ in segs):
            raise IOFailedError("injected EIO", path=store.io.devices[0].path, errno=5,
                                offset=0)
        return real(segs, dst, only, *rest)
    store._read_segs = failing


def test_a_tiered_read_failed_by_a_device_error_counts_no_block(tmp_path):
    """A prefix of a run on the device, a block only in DRAM, then a run on
    the device whose read fails with a device error: get_run raises, and
    get_runs answers 0 for the request, so none of its blocks was returned.
    The first run's blocks had been counted in get_blocks /
    device_hit_blocks all the same (README: get_blocks counts the blocks
    reads returned; without a tier such a read counted none)."""
    from kvblock.errors import IOFailedError

    with _device_dram_device(tmp_path) as (store, a, b, c):
        keys = a + b + c
        assert store.lookup(keys) == 4
        _fail_reads_of(store, c)
        names = ("get_blocks", "get_bytes", "host_hit_blocks", "device_hit_blocks",
                 "bytes_read")
        before = [store.counters[n] for n in names]
        out = np.zeros(4 * GEOM.block_bytes, np.uint8)
        assert store.get_runs([(keys, out)]) == [0]
        with pytest.raises(IOFailedError):
            store.get_run(keys, out)
        del store._read_segs
        assert [store.counters[n] for n in names] == before, \
            "blocks of a read that returned none were counted"
        assert store.get_run(a, out[:2 * GEOM.block_bytes]) == 2   # a read that returns counts
        assert store.counters["get_blocks"] == before[0] + 2


def test_a_tiered_read_failed_by_a_device_error_counts_its_tier_lookups(tmp_path):
    """host_tier_hits / host_tier_misses count the DRAM tier's lookups
    (README), whether the read they were part of returns or not: a read of
    a (device) + b (DRAM only) + c (device, EIO) looked b up and found it
    (read_into counted the hit at once), and a and c up and found them not;
    the misses were counted only once the whole read returned, so a failed
    read counted its hit and none of its misses (the hit ratio rose)."""
    from kvblock.errors import IOFailedError

    with _device_dram_device(tmp_path) as (store, a, b, c):
        keys = a + b + c
        out = np.zeros(4 * GEOM.block_bytes, np.uint8)

        def lookups():
            s = store.host.stats()
            return s["host_tier_hits"], s["host_tier_misses"]
        before = lookups()
        assert store.get_run(keys, out) == 4         # a read that returns
        hits, misses = (x - y for x, y in zip(lookups(), before))
        assert (hits, misses) == (1, 3)
        for k in normalize_keys(a + c):              # (the read put them in the tier)
            store.host.discard(k)
        _fail_reads_of(store, c)
        try:
            before = lookups()
            with pytest.raises(IOFailedError):
                store.get_run(keys, out)
            assert tuple(x - y for x, y in zip(lookups(), before)) == (hits, misses)
            before = lookups()
            assert store.get_runs([(keys, out)]) == [0]
            assert tuple(x - y for x, y in zip(lookups(), before)) == (hits, misses)
        finally:
            del store._read_segs
