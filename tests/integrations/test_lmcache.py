"""kvblock as an LMCache 0.5.x storage plugin, driven through LMCache itself.

Each test builds LMCache's ``StorageManager`` from a real
``LMCacheEngineConfig`` (``storage_plugins: ["kvblock"]`` with the plugin's
module path and class name in ``extra_config``) and ``LMCacheMetadata``: the
manager's own plugin loader constructs the backend next to a real
``LocalCPUBackend``, whose allocator makes the chunks (``MemoryObj``) that
are put and got.  All on the CPU.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

from kvblock.errors import ConfigError, GeometryMismatchError
from kvblock.store import KVStore
from kvblock.integrations.lmcache import KVBlockStorageBackend
from tests.integrations.lmcache_gc import collect_lmcache_garbage
from tests.support.servers import wait_reconnected

CHUNK = 16
# (layers, kv, chunk tokens, heads, head size): 2 * 4 * 16 * 4 * 32 * 2 bytes = 32 KiB a chunk
KV_SHAPE = (4, 2, CHUNK, 4, 32)
MLA_SHAPE = (4, 1, CHUNK, 1, 64)


def make_config(devices, lmcache_options=None, **extra):
    return LMCacheEngineConfig.from_defaults(
        **(lmcache_options or {}), chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05,
        storage_plugins=["kvblock"],
        extra_config={"storage_plugin.kvblock.module_path": "kvblock.integrations.lmcache",
                      "storage_plugin.kvblock.class_name": "KVBlockStorageBackend",
                      "kvblock.devices": devices, **extra})


def make_metadata(model="org/model-a", mla=False, worker_id=0, world_size=1):
    return LMCacheMetadata(model_name=model, world_size=world_size,
                           local_world_size=world_size, worker_id=worker_id,
                           local_worker_id=worker_id, kv_dtype=torch.bfloat16,
                           kv_shape=MLA_SHAPE if mla else KV_SHAPE, use_mla=mla,
                           chunk_size=CHUNK)


class Engine:
    """LMCache's storage side, as its cache engine builds it."""

    def __init__(self, devices, *, model="org/model-a", mla=False, worker_id=0, world_size=1,
                 async_lookup_server=None, lmcache_options=None, config=None, **extra):
        """``config``: an LMCacheEngineConfig to use instead of make_config's."""
        self.metadata = make_metadata(model, mla, worker_id, world_size)
        self.manager = StorageManager(config or make_config(devices, lmcache_options, **extra),
                                      self.metadata,
                                      EventManager(), async_lookup_server=async_lookup_server)
        self.plugin = self.manager.storage_backends.get("kvblock")
        assert isinstance(self.plugin, KVBlockStorageBackend), \
            f"LMCache did not load the plugin: {list(self.manager.storage_backends)}"
        self.model, self.seed = model, 0

    def key(self, chunk_hash: int) -> CacheEngineKey:
        return CacheEngineKey(self.model, 1, 0, chunk_hash, torch.bfloat16)

    def chunk(self, tokens=CHUNK, seed=None):
        """A chunk of random bits (from ``seed``, else the next of this
        engine's seeds), allocated the way the cache engine does."""
        shapes = self.metadata.get_shapes(tokens)
        obj = self.manager.allocate(shapes, self.metadata.get_dtypes(),
                                    fmt=self.plugin.chunk.fmt)
        if seed is None:
            self.seed += 1
            seed = self.seed
        g = torch.Generator().manual_seed(seed)
        raw = obj.raw_tensor.view(torch.uint8)[:obj.get_size()]
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        return obj

    def put(self, keys, objs):
        """StorageManager.batched_put, then wait for the plugin's writes."""
        want = [bytes(o.raw_tensor.view(torch.uint8)[:o.get_size()].numpy()) for o in objs]
        self.manager.batched_put(keys, objs)    # drops the caller's reference to objs
        deadline = time.monotonic() + 30
        while any(self.plugin.exists_in_put_tasks(k) for k in keys):
            assert time.monotonic() < deadline, "writes did not finish"
            time.sleep(0.01)
        return want

    def retrieve(self, keys):
        """The cache engine's retrieve: block mapping, then a batched get per location."""
        infos = [(k, i * CHUNK, (i + 1) * CHUNK) for i, k in enumerate(keys)]
        out = []
        for location, blocks in self.manager.get_block_mapping(infos).items():
            out += self.manager.batched_get([k for k, _, _ in blocks], location=location)
        return out

    def close(self):
        manager, self.manager, self.plugin = self.manager, None, None
        manager.close()
        if not manager.thread.is_alive():
            manager.loop.close()           # StorageManager.close() leaves it open
        del manager
        collect_lmcache_garbage()


def obj_bytes(obj) -> bytes:
    return bytes(obj.raw_tensor.view(torch.uint8)[:obj.get_size()].numpy())


def test_plugin_loader_builds_the_backend(file_target, engines):
    e = Engine([file_target()])
    engines.append(e)
    assert e.plugin.get_allocator_backend() is e.manager.storage_backends["LocalCPUBackend"]
    g = e.plugin.store.geometry
    assert (g.num_layers, g.kv_parts, g.head_dim, g.dtype) == (1, 1, 2 * 4 * CHUNK * 128 * 2,
                                                               "uint8")


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_put_get_round_trip_bytes_identical(store_target, engines, mla):
    e = Engine([store_target()], mla=mla)
    engines.append(e)
    keys = [e.key(h) for h in (11, 12, 13)]
    want = e.put(keys, [e.chunk() for _ in keys])
    assert e.manager.contains(keys[0]) == "kvblock"
    got = e.manager.get(keys[1])                    # the manager's blocking get
    assert got is not None and obj_bytes(got) == want[1]
    assert got.get_memory_format() == (MemoryFormat.KV_MLA_FMT if mla else MemoryFormat.KV_2LTD)
    assert got.get_shape() == e.metadata.get_shapes()[0]
    got.ref_count_down()
    objs = e.retrieve(keys)
    assert [obj_bytes(o) for o in objs] == want
    for o in objs:
        o.ref_count_down()


def test_prefix_lookups_and_missing_keys(file_target, engines):
    e = Engine([file_target()])
    engines.append(e)
    keys = [e.key(h) for h in range(1, 6)]
    e.put(keys[:2] + keys[3:], [e.chunk() for _ in range(4)])   # chunk 3 missing
    hits, mapping = e.manager.batched_contains(keys)
    assert hits == 2 and mapping == {"kvblock": keys[:2]}
    assert e.plugin.get_blocking(keys[2]) is None
    assert e.plugin.get_non_blocking(keys[2]) is None
    assert e.manager.get(e.key(999)) is None
    objs = e.plugin.batched_get_blocking(keys)
    assert [o is not None for o in objs] == [True, True, False, False, False]
    for o in objs[:2]:
        o.ref_count_down()
    fut = e.plugin.get_non_blocking(keys[3])
    obj = fut.result(timeout=30)
    assert obj is not None
    obj.ref_count_down()
    # the async lookup + prefetch path runs these on the manager's event loop
    hits = asyncio.run_coroutine_threadsafe(
        e.plugin.batched_async_contains("req-1", keys, pin=False), e.manager.loop).result(30)
    assert hits == 2
    loaded = asyncio.run_coroutine_threadsafe(
        e.plugin.batched_get_non_blocking("req-1", keys), e.manager.loop).result(30)
    assert len(loaded) == 2
    for o in loaded:
        o.ref_count_down()


def test_pin_unpin_remove(file_target, engines):
    e = Engine([file_target()])
    engines.append(e)
    keys = [e.key(h) for h in (21, 22)]
    e.put(keys, [e.chunk(), e.chunk()])
    assert e.manager.contains(keys[0], pin=True) == "kvblock"
    assert e.plugin.remove(keys[0], force=False) is False       # pinned: kept
    assert e.plugin.contains(keys[0])
    e.manager.batched_unpin([keys[0]])
    assert e.plugin.remove(keys[0], force=False) is True
    assert not e.plugin.contains(keys[0]) and e.plugin.contains(keys[1])
    assert e.plugin.pin(keys[1]) and e.plugin.pin(keys[1])
    assert e.plugin.remove(keys[1], force=True) is True          # forced: removed anyway
    assert e.manager.remove(keys[1]) == 0
    assert e.plugin.pin(keys[1]) is False                        # gone: nothing to pin
    e.put([e.key(23)], [e.chunk()])
    assert e.manager.clear() == CHUNK                            # one chunk's tokens
    assert not e.plugin.contains(e.key(23))


def test_close_closes_the_store_even_when_releasing_a_pin_fails(file_target, engines):
    """close() released the plugin's pins, then closed the store; an unpin
    that raised (a server call timing out: only ServerGoneError is quiet)
    skipped the store's close, leaving its devices open (and, through a
    server, its fence file and heartbeat thread).  The store is closed all
    the same, every pin's release tried, and the failure still raised."""
    from kvblock.errors import ServerError

    e = Engine([file_target()])
    engines.append(e)
    keys = [e.key(h) for h in (41, 42)]
    e.put(keys, [e.chunk(), e.chunk()])
    assert e.plugin.pin(keys[0]) and e.plugin.pin(keys[1])
    store, real_unpin, tried = e.plugin.store, e.plugin.store.unpin, []

    def unpin_times_out(segs):
        tried.append(segs)
        real_unpin(segs)
        raise ServerError("the store server did not answer unpin within 30 s")

    store.unpin = unpin_times_out
    with pytest.raises(ServerError, match="unpin"):
        e.plugin.close()
    assert len(tried) == 2
    assert store.closed and store.io is None


def test_a_pin_held_across_a_clear_does_not_make_the_chunk_found(file_target, engines):
    """A chunk pinned, then deleted by another holder of the store (a
    delete through kvblock's API or another process on a shared store;
    the plugin's own clear leaves pinned chunks): a pinned lookup must not
    find it through the pin left over, nor keep it pinned."""
    e = Engine([file_target()])
    engines.append(e)
    key = e.key(31)
    e.put([key], [e.chunk()])
    assert e.plugin.contains(key, pin=True)
    assert e.plugin.store.delete([e.plugin.kvblock_key(key)]) == 1
    assert not e.plugin.contains(key)
    assert e.plugin.contains(key, pin=True) is False
    assert e.plugin.pin(key) is False
    e.put([key], [e.chunk()])                 # stored again: pinned anew, loads back
    assert e.plugin.contains(key, pin=True)
    assert e.plugin.get_blocking(key) is not None


def test_async_lookup_pins_end_with_its_load(file_target, engines):
    """LMCache's async loading (vLLM's async lookup client always pins):
    ``async_lookup_and_prefetch`` pins the hits in ``batched_async_contains``
    and loads them with ``batched_get_non_blocking``; LMCache then unpins
    the objects it got, never the backend's keys.  The load ends the
    lookup's pins, so lookups cannot pin the store full (every region
    pinned, every put refused)."""
    from lmcache.v1.event_manager import EventType

    class LookupServer:                 # LMCacheAsyncLookupServer's reply channel
        def __init__(self):
            self.replies = {}

        def send_response_to_scheduler(self, lookup_id, hits):
            self.replies[lookup_id] = hits

    server = LookupServer()
    e = Engine([file_target(4 << 20)], async_lookup_server=server,
               lmcache_options={"enable_async_loading": True},
               **{"kvblock.region_size": "64K"})   # 2 chunks a region, 32 regions
    engines.append(e)
    regions = e.plugin.store.stats()["regions"]
    stored = []
    for h in range(1, 3 * regions):
        e.put([e.key(h)], [e.chunk()])
    stored = [k for k in (e.key(h) for h in range(1, 3 * regions)) if e.plugin.contains(k)]
    assert len(stored) >= regions
    for i, key in enumerate(stored):                 # one request per chunk
        lookup_id = f"req{i}"
        asyncio.run_coroutine_threadsafe(
            e.manager.async_lookup_and_prefetch(lookup_id, [key], [0, CHUNK], None, True),
            e.manager.loop).result(30)
        deadline = time.monotonic() + 30
        while lookup_id not in server.replies:
            assert time.monotonic() < deadline, "the lookup never answered"
            time.sleep(0.01)
        assert server.replies[lookup_id] == CHUNK
        future = e.manager.event_manager.pop_event(EventType.LOADING, lookup_id)
        for tier in future.result():                 # the cache engine's retrieve
            for _, obj in tier:
                if obj.is_pinned:
                    obj.unpin()
                obj.ref_count_down()
    assert e.plugin._pins == {} and not (e.plugin.store.regions.pins > 0).any()
    new = [e.key(1000 + h) for h in range(8)]       # the store still takes puts
    for key in new:
        e.put([key], [e.chunk()])
    assert all(e.plugin.contains(k) for k in new)
    # a pinned lookup whose load is for another lookup keeps its pins
    assert asyncio.run_coroutine_threadsafe(
        e.plugin.batched_async_contains("a", new[:2], pin=True), e.manager.loop).result(30) == 2
    got = asyncio.run_coroutine_threadsafe(
        e.plugin.batched_get_non_blocking("b", new[:1]), e.manager.loop).result(30)
    for obj in got:
        obj.ref_count_down()
    assert len(e.plugin._pins) == 2
    got = asyncio.run_coroutine_threadsafe(
        e.plugin.batched_get_non_blocking("a", new[:2]), e.manager.loop).result(30)
    for obj in got:
        obj.ref_count_down()
    assert e.plugin._pins == {}


def test_keys_of_different_tags_never_collide(file_target, engines):
    """LMCache's to_string() joins tags with "@" and "%" unescaped: these two
    keys differ in LMCache but spell one string.  They must not share a
    block (one tenant would be served another's chunk)."""
    e = Engine([file_target()])
    engines.append(e)
    a = CacheEngineKey(e.model, 1, 0, 51, torch.bfloat16,
                       request_configs={"lmcache.tag.user": "alice@tenant%b"})
    b = CacheEngineKey(e.model, 1, 0, 51, torch.bfloat16,
                       request_configs={"lmcache.tag.user": "alice", "lmcache.tag.tenant": "b"})
    assert a != b and a.to_string() == b.to_string()
    e.put([a], [e.chunk()])
    assert e.plugin.contains(a) and not e.plugin.contains(b)
    assert e.plugin.get_blocking(b) is None


def test_completion_callback_only_for_stored_chunks(file_target, engines):
    """on_complete_callback means "persisted": not called for a chunk that
    admission declined."""
    e = Engine([file_target()], **{"kvblock.admit_after": 2})
    engines.append(e)
    done = []
    keys = [e.key(h) for h in (61, 62)]
    objs = [e.chunk(), e.chunk()]
    futures = e.plugin.batched_submit_put_task(keys, objs, on_complete_callback=done.append)
    assert [f.result(30) for f in futures] == [0]               # first offers: declined
    assert done == [] and not any(e.plugin.contains(k) for k in keys)
    futures = e.plugin.batched_submit_put_task(keys, objs, on_complete_callback=done.append)
    assert [f.result(30) for f in futures] == [2]               # second offers: stored
    assert done == keys and all(e.plugin.contains(k) for k in keys)
    for obj in objs:
        obj.ref_count_down()


def test_completion_callback_for_chunks_stored_before_a_put_failed(file_target, engines):
    """put_runs publishes its runs group by group; one that fails part way
    keeps the groups before the failure (stored, found, loadable).  Those
    chunks are persisted: on_complete_callback is called for them (LMCache:
    once per key "after the backend finishes persisting the KV chunk for
    that key"), and the put's future counts them; not for the others."""
    from kvblock.errors import DeviceError

    e = Engine([file_target()])
    engines.append(e)
    real = e.plugin.store.put_runs

    def failing_put_runs(runs):     # the first group published, then EIO
        runs = list(runs)
        real(runs[:2])
        raise DeviceError("write failed", e.plugin.devices[0], 5)
    e.plugin.store.put_runs = failing_put_runs
    done = []
    keys = [e.key(h) for h in (71, 72, 73)]
    objs = [e.chunk() for _ in keys]
    try:
        futures = e.plugin.batched_submit_put_task(keys, objs, on_complete_callback=done.append)
        assert [f.result(30) for f in futures] == [2]
        assert done == keys[:2]
        assert [e.plugin.contains(k) for k in keys] == [True, True, False]
        assert not any(e.plugin.exists_in_put_tasks(k) for k in keys)
    finally:
        for obj in objs:
            obj.ref_count_down()


def test_chunks_survive_a_restart(store_target, engines):
    path = store_target()
    e = Engine([path])
    keys = [e.key(h) for h in (31, 32)]
    want = e.put(keys, [e.chunk(), e.chunk()])
    e.close()
    e = Engine([path], **{"kvblock.format": "never"})
    engines.append(e)
    objs = e.retrieve(keys)
    assert [obj_bytes(o) for o in objs] == want
    for o in objs:
        o.ref_count_down()


def test_models_and_namespaces_never_share_chunks(file_target, engines):
    path = file_target()
    e = Engine([path])
    keys = [e.key(41)]
    e.put(keys, [e.chunk()])
    e.close()
    # LMCache's loader logs and drops a plugin that fails; build it directly to see why
    other = make_metadata(model="org/model-b")
    manager = StorageManager(make_config([path]), other, EventManager())
    try:
        assert "kvblock" not in manager.storage_backends
        assert manager.get_block_mapping([(keys[0], 0, CHUNK)]) == {}
        with pytest.raises(GeometryMismatchError):
            KVBlockStorageBackend(config=make_config([path]), metadata=other,
                                  local_cpu_backend=manager.storage_backends["LocalCPUBackend"],
                                  loop=manager.loop)
    finally:
        manager.close()
        manager.loop.close()
    tenant = Engine([path], **{"kvblock.namespace": "tenant-b"})
    engines.append(tenant)
    assert not tenant.plugin.contains(keys[0])
    assert tenant.plugin.get_blocking(keys[0]) is None


def test_partial_chunks_are_not_stored(file_target, engines):
    e = Engine([file_target()])
    engines.append(e)
    key = e.key(51)
    e.put([key], [e.chunk(tokens=CHUNK // 2)])
    assert not e.plugin.contains(key) and e.plugin.stats()["skipped_chunks"] == 1


def test_workers_share_one_store_through_a_server(tmp_path, engines):
    """Two workers, one device: the first formats it and starts `kvblock
    serve`, the second connects; chunks one writes the other reads, pins
    and removes go through the server, and the store survives its stop."""
    import os
    import signal

    from kvblock.store import KVStore

    dev, sock = str(tmp_path / "kv.img"), str(tmp_path / "kv.sock")
    shared = {"kvblock.server": sock, "kvblock.size": "32M"}
    w0 = Engine([dev], worker_id=0, world_size=2, **shared)
    engines.append(w0)
    w1 = Engine([dev], worker_id=1, world_size=2, **shared)
    engines.append(w1)
    server_pid = w0.plugin.store.server_pid
    try:
        assert w1.plugin.store.server_pid == server_pid
        keys = [w0.key(h) for h in (41, 42, 43)]
        want = w0.put(keys, [w0.chunk() for _ in keys])
        objs = w1.retrieve(keys)
        assert [obj_bytes(o) for o in objs] == want
        for o in objs:
            o.ref_count_down()
        assert w1.plugin.pin(keys[0])
        assert w0.plugin.remove(keys[0], force=False) is True    # w1's pin is not w0's
        w1.manager.batched_unpin([keys[0]])
        assert not w1.plugin.contains(keys[0]) and w1.plugin.contains(keys[1])
        # another model on the same server: refused (LMCache's loader would log
        # and drop the plugin; build it directly to see why)
        other = make_metadata(model="org/model-b")
        with pytest.raises(GeometryMismatchError, match="another model"):
            KVBlockStorageBackend(config=make_config([dev], **shared), metadata=other,
                                  local_cpu_backend=w0.manager.storage_backends[
                                      "LocalCPUBackend"], loop=w0.manager.loop)
        # The server dies: every call answers as a miss, at once, and nothing
        # raises into LMCache; the workers reconnect (one restarts the
        # server) and find what was stored before.
        assert w1.plugin.pin(keys[1])                      # a pin the kill voids
        os.kill(server_pid, signal.SIGKILL)
        later = [w0.key(h) for h in (51, 52)]
        t0 = time.monotonic()
        assert not w1.plugin.contains(keys[1]) and w1.plugin.batched_contains(keys[1:]) == 0
        assert not w1.plugin.pin(keys[2]) and not w1.plugin.remove(keys[2])
        assert w1.plugin.get_blocking(keys[1]) is None
        assert w1.plugin.batched_get_blocking(keys[1:]) == [None, None]
        w0.put(later, [w0.chunk() for _ in later])        # not stored, not stuck
        assert w0.plugin.stats()["store_failures"] > 0 and "store_error" in w0.plugin.stats()
        assert time.monotonic() - t0 < 5
        server_pid = wait_reconnected([w0.plugin.store, w1.plugin.store], server_pid)
        # the pin from before the kill protects nothing now: pinning again
        # takes a real pin on the new server, and both unpins release it
        assert w1.plugin.pin(keys[1]) and w1.plugin.stats()["pinned_regions"] == 1
        assert w1.plugin.unpin(keys[1]) and w1.plugin.stats()["pinned_regions"] == 1
        assert w1.plugin.unpin(keys[1]) and w1.plugin.stats()["pinned_regions"] == 0
        objs = w1.retrieve(keys[1:])
        assert [obj_bytes(o) for o in objs] == want[1:]
        for o in objs:
            o.ref_count_down()
        assert w1.plugin.batched_contains(later) == 0
        w0.put(later, [w0.chunk() for _ in later])
        assert w1.plugin.batched_contains(later) == 2
    finally:
        for e in engines:
            e.close()
        engines.clear()
        os.kill(server_pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while os.path.exists(sock):
            assert time.monotonic() < deadline, "server did not stop"
            time.sleep(0.05)
    with KVStore.open([dev]) as store:
        assert len(store.index) == 4


def test_clear_on_a_shared_store_removes_each_workers_own_chunks(tmp_path, engines):
    """LMCache's cache controller clears every worker at once and asserts
    they all report the same token count.  On one shared store the first
    worker's clear removed every worker's chunks (and another tenant's)
    and the others reported 0 ([144, 0]): the controller's clear failed.  Each worker removes its
    own chunks now (its key prefix); another namespace's chunks stay."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.servers import stop_server

    dev, sock = str(tmp_path / "kv.img"), str(tmp_path / "kv.sock")
    shared = {"kvblock.server": sock, "kvblock.size": "32M"}
    workers = [Engine([dev], worker_id=w, world_size=2, **shared) for w in (0, 1)]
    engines.extend(workers)
    tenant = Engine([dev], worker_id=0, world_size=2,
                    **{**shared, "kvblock.namespace": "tenant-b"})
    engines.append(tenant)
    server_pid = workers[0].plugin.store.server_pid
    try:
        def own_keys(e):     # as LMCache makes them: the worker's id in each
            return [CacheEngineKey(e.model, 2, e.metadata.worker_id, h, torch.bfloat16)
                    for h in (1, 2, 3)]
        want = {id(e): e.put(own_keys(e), [e.chunk() for _ in range(3)])
                for e in workers + [tenant]}
        assert workers[1].plugin.batched_contains(own_keys(workers[0])) == 3
        with ThreadPoolExecutor(2) as pool:
            counts = list(pool.map(lambda e: e.manager.clear(locations=["kvblock"]),
                                   workers))
        assert counts == [3 * CHUNK, 3 * CHUNK]
        assert [e.plugin.batched_contains(own_keys(e)) for e in workers] == [0, 0]
        tenant_keys = own_keys(tenant)
        objs = tenant.retrieve(tenant_keys)
        assert [obj_bytes(o) for o in objs] == want[id(tenant)]
        for o in objs:
            o.ref_count_down()
        assert tenant.plugin.clear() == 3 * CHUNK
        assert tenant.plugin.batched_contains(tenant_keys) == 0
    finally:
        for e in engines:
            e.close()
        engines.clear()
        stop_server(server_pid)


CLOSE_WITH_QUEUED_PUTS = """
import sys, time, torch
sys.path.insert(0, {root!r})
from tests.integrations.test_lmcache import Engine
e = Engine([{path!r}], **{{"kvblock.writer_threads": 1}})
real = e.plugin.store.put_runs
def slow_put_runs(runs):
    time.sleep(0.01)
    return real(runs)
e.plugin.store.put_runs = slow_put_runs
keys = [e.key(h) for h in range(1, 41)]
for k in keys:
    e.manager.batched_put([k], [e.chunk()])
queued = sum(e.plugin.exists_in_put_tasks(k) for k in keys)
e.close()                   # LocalCPUBackend first, then the plugin
print("queued", queued)
"""


def test_close_with_queued_puts_waits_for_them(file_target, tmp_path):
    """StorageManager.close() closes LocalCPUBackend (freeing the memory the
    plugin's queued writes read) before the plugin: the writes must be done
    first.  They read freed memory and crashed the process (SIGSEGV), so
    this runs in a child process.  Every queued chunk ends up stored."""
    import os
    import subprocess
    import sys

    path = file_target()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", CLOSE_WITH_QUEUED_PUTS.format(root=root,
                                                                              path=path)],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    queued = int(res.stdout.split("queued")[-1])
    assert queued > 0                  # the close did find writes in flight
    with KVStore.open([path]) as store:
        assert store.stats()["blocks"] == 40


def test_settings_typed_by_hand(file_target, engines):
    """Unknown kvblock.* settings (a misspelling) are refused; numbers as
    strings parse or fail naming the setting; a tenant named 0 is its own.
    (LMCache's loader logs a plugin's errors and runs without it, so the
    plugin is built directly here to see them.)"""
    path = file_target()
    manager = StorageManager(make_config([path]), make_metadata(), EventManager())

    def build(config=None, **extra):
        return KVBlockStorageBackend(config=config or make_config([path], **extra),
                                     metadata=make_metadata(),
                                     local_cpu_backend=manager.storage_backends["LocalCPUBackend"],
                                     loop=manager.loop)
    try:
        manager.storage_backends["kvblock"].close()
        with pytest.raises(ConfigError, match=r"unknown settings \['kvblock.namepsace'\]"):
            build(**{"kvblock.namepsace": "tenant-a"})
        with pytest.raises(ConfigError, match="writer_threads must be a whole number"):
            build(**{"kvblock.writer_threads": "two"})
        plugin = build(**{"kvblock.namespace": 0, "kvblock.queue_depth": "8"})
        assert plugin.namespace == "0"
        plugin.close()
        # a key that is no string (YAML's `1: x`) is not kvblock's: passed over,
        # not an AttributeError ('int' object has no attribute 'startswith')
        config = make_config([path])
        config.extra_config.update({1: "x", None: "y"})
        build(config).close()
    finally:
        manager.close()
        manager.loop.close()


def test_server_and_namespace_that_are_not_strings_are_refused(file_target, engines,
                                                              monkeypatch):
    """kvblock.server is a socket path and kvblock.namespace a name mixed
    into every key: a number or a list typed there was made its repr (the
    socket "['/run/kvblock/lm.sock']", the tenant "[1]" or "True"), silently
    another store or tenant.  A whole number stays a name; anything else is
    a ConfigError naming the setting, before any store is opened."""
    path = file_target()
    manager = StorageManager(make_config([path]), make_metadata(), EventManager())
    monkeypatch.chdir(os.path.dirname(path))
    before = sorted(os.listdir("."))

    def build(**extra):
        return KVBlockStorageBackend(config=make_config([path], **extra), metadata=make_metadata(),
                                     local_cpu_backend=manager.storage_backends["LocalCPUBackend"],
                                     loop=manager.loop)
    try:
        manager.storage_backends["kvblock"].close()
        for key, value in (("server", 123), ("server", ["/run/kvblock/lm.sock"]),
                           ("server", True), ("namespace", [1]), ("namespace", True),
                           ("namespace", 1.5)):
            with pytest.raises(ConfigError, match=rf"kvblock lmcache plugin: kvblock.{key} must"):
                build(**{f"kvblock.{key}": value})
        assert sorted(os.listdir(".")) == before
    finally:
        manager.close()
        manager.loop.close()


def test_a_region_size_of_zero_is_refused_not_ignored(file_target, engines):
    """kvblock.region_size 0 (or false) was taken for no setting, the store
    formatted with the default regions, while "0" was refused: both are a
    ConfigError naming the setting, as every other size of 0 is."""
    path = file_target()
    manager = StorageManager(make_config([path]), make_metadata(), EventManager())
    try:
        manager.storage_backends["kvblock"].close()
        for value in (0, False, "0"):
            with pytest.raises(ConfigError, match="kvblock.region_size must be"):
                KVBlockStorageBackend(
                    config=make_config([path], **{"kvblock.region_size": value}),
                    metadata=make_metadata(),
                    local_cpu_backend=manager.storage_backends["LocalCPUBackend"],
                    loop=manager.loop)
    finally:
        manager.close()
        manager.loop.close()


def test_devices_of_the_wrong_type_are_a_config_error(file_target, engines):
    """kvblock.devices is a path, a list of paths, or a map of worker ids to
    either.  A number (a YAML slip: ``kvblock.devices: 0``, or ``"0": 1``
    in the map) raised a bare TypeError ('int' object is not iterable) from
    inside the plugin; it is a ConfigError naming the setting."""
    path = file_target()
    manager = StorageManager(make_config([path]), make_metadata(), EventManager())

    def build(devices):
        return KVBlockStorageBackend(config=make_config(devices), metadata=make_metadata(),
                                     local_cpu_backend=manager.storage_backends["LocalCPUBackend"],
                                     loop=manager.loop)
    try:
        manager.storage_backends["kvblock"].close()
        for devices in (5, {"0": 5}, [path, 5], {"0": {"path": path}}, [[path]]):
            with pytest.raises(ConfigError, match="kvblock.devices"):
                build(devices)
        build({0: path}).close()                # a map by int worker id, a path alone
    finally:
        manager.close()
        manager.loop.close()


def test_puts_do_not_count_as_lookups(file_target, engines):
    """A put skips the chunks already stored with an uncounted probe: the
    store's lookup counters (lookups, lookup_hit_blocks: the hit rate that
    `kvblock stats` and the metrics report) stay the engine's lookups."""
    e = Engine([file_target()])
    engines.append(e)
    keys = [e.key(h) for h in (51, 52, 53)]
    e.put(keys[:2], [e.chunk() for _ in keys[:2]])
    e.put(keys, [e.chunk() for _ in keys])          # two stored, one new
    stats = e.plugin.stats()
    assert stats["put_blocks"] == 3
    assert (stats["lookups"], stats["lookup_hit_blocks"]) == (0, 0)
    assert e.plugin.batched_contains(keys) == 3       # the engine's lookup counts
    stats = e.plugin.stats()
    assert (stats["lookups"], stats["lookup_hit_blocks"]) == (1, 3)


def test_a_put_of_stored_chunks_keeps_them_under_lru(file_target, engines):
    """A put of chunks stored already writes nothing, but they are in use
    again (LMCache stored them anew): like LocalDiskBackend's put of a key it
    holds (update_on_hit), the put marks them as just used, so LRU eviction
    keeps them while chunks written once and never used again are evicted."""
    e = Engine([file_target(4 << 20)], **{"kvblock.eviction": "lru",
                                          "kvblock.region_size": "256K"})
    engines.append(e)
    hot = [e.key(h) for h in (1, 2)]
    want = e.put(hot, [e.chunk() for _ in hot])
    before = e.plugin.stats()["put_blocks"]
    for i in range(40):                                 # several times the store
        cold = [e.key(1000 + 8 * i + j) for j in range(8)]
        e.put(cold, [e.chunk() for _ in cold])
        e.put(hot, [e.chunk() for _ in hot])             # stored: not written again
    stats = e.plugin.stats()
    assert stats["evicted_regions"] >= stats["regions"]
    assert stats["put_blocks"] - before == 40 * 8
    assert e.plugin.batched_contains(hot) == 2
    assert [obj_bytes(o) for o in e.plugin.batched_get_blocking(hot)] == want


def test_a_pinned_lookup_of_one_key_counts_as_a_lookup(file_target, engines):
    """contains(key, pin=True) (LMCache's StorageManager.contains with
    pin_in_backend) is a lookup as contains(key) and batched_contains(keys,
    pin=True) are: it counts in the store's lookups and hits."""
    e = Engine([file_target()])
    engines.append(e)
    keys = [e.key(h) for h in (81, 82)]
    e.put(keys[:1], [e.chunk()])
    assert e.plugin.contains(keys[0], pin=True) is True
    assert e.plugin.contains(keys[1], pin=True) is False
    stats = e.plugin.stats()
    assert (stats["lookups"], stats["lookup_hit_blocks"]) == (2, 1)
    assert e.plugin.batched_contains(keys, pin=True) == 1
    stats = e.plugin.stats()
    assert (stats["lookups"], stats["lookup_hit_blocks"]) == (3, 2)
    assert e.plugin.unpin(keys[0]) and e.plugin.unpin(keys[0])


def test_an_unpin_does_not_count_as_a_lookup(file_target, engines):
    """An unpin of a key the plugin holds no pin on (a forced remove or a
    clear dropped it; LMCache's lookup_unpin then still unpins each key)
    answers whether the key is stored with an uncounted probe: it is no
    lookup of the engine's in the store's hit rate."""
    e = Engine([file_target()])
    engines.append(e)
    keys = [e.key(h) for h in (71, 72)]
    e.put(keys[:1], [e.chunk()])
    assert e.plugin.unpin(keys[0]) and not e.plugin.unpin(keys[1])
    stats = e.plugin.stats()
    assert (stats["lookups"], stats["lookup_hit_blocks"]) == (0, 0)


def test_gets_do_not_count_as_lookups(file_target, engines):
    """A load finds its stored prefix with an uncounted probe: LMCache's
    retrieve (a lookup, then a get) is one lookup in the store's counters,
    not two with every hit counted twice."""
    e = Engine([file_target()])
    engines.append(e)
    keys = [e.key(h) for h in (61, 62, 63)]
    want = e.put(keys, [e.chunk() for _ in keys])
    objs = e.retrieve(keys)                          # batched_contains, batched_get
    assert [obj_bytes(o) for o in objs] == want
    for o in objs:
        o.ref_count_down()
    got = e.plugin.get_blocking(keys[0])             # gets alone: no lookup
    assert got is not None and obj_bytes(got) == want[0]
    got.ref_count_down()
    got = e.plugin.get_non_blocking(keys[1]).result(timeout=30)
    assert got is not None and obj_bytes(got) == want[1]
    got.ref_count_down()
    stats = e.plugin.stats()
    assert (stats["lookups"], stats["lookup_hit_blocks"]) == (1, 3)
    assert stats["get_blocks"] == 5


def test_a_forced_remove_ends_the_lookup_pins_on_the_key(file_target, engines):
    """remove(key, force=True) drops every pin on the key.  The async lookup
    that had pinned it must not, when its load ends, release the pin a later
    lookup took on the key stored again: that one's chunk would be
    unpinned (evictable) before its own load."""
    e = Engine([file_target()])
    engines.append(e)
    key = e.key(71)
    kb = e.plugin.kvblock_key(key)

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, e.manager.loop).result(30)

    e.put([key], [e.chunk()])
    assert run(e.plugin.batched_async_contains("a", [key], pin=True)) == 1
    assert e.plugin.remove(key, force=True) is True
    e.put([key], [e.chunk()])                            # stored again
    assert run(e.plugin.batched_async_contains("b", [key], pin=True)) == 1
    for obj in run(e.plugin.batched_get_non_blocking("a", [key])):   # a's load ends
        obj.ref_count_down()
    assert kb in e.plugin._pins, "lookup a released lookup b's pin"
    assert (e.plugin.store.regions.pins > 0).any()
    for obj in run(e.plugin.batched_get_non_blocking("b", [key])):
        obj.ref_count_down()
    assert e.plugin._pins == {} and not (e.plugin.store.regions.pins > 0).any()


@pytest.mark.parametrize("where", ["read", "allocate", "interrupt"])
def test_a_load_failing_past_its_allocations_frees_every_object(file_target, engines, where):
    """_load_prefix allocates a MemoryObj per stored chunk, then reads into
    them; an error other than a store failure (a RuntimeError of the read
    or of LMCache's allocator on a later chunk, a KeyboardInterrupt) must
    still give every allocated object back to LMCache's allocator, not
    leak it (LMCache's CPU pool would shrink for good)."""
    e = Engine([file_target()])
    engines.append(e)
    keys = [e.key(h) for h in (131, 132, 133)]
    e.put(keys, [e.chunk() for _ in keys])
    cpu = e.plugin.local_cpu_backend
    real_allocate, made = cpu.allocate, []

    def allocate(*args, **kwargs):
        if where == "allocate" and len(made) == 2:
            raise RuntimeError("allocator failed")
        obj = real_allocate(*args, **kwargs)
        made.append(obj)
        return obj

    def get_blocks(kbs, outs):
        raise (KeyboardInterrupt() if where == "interrupt" else ValueError("bad copy"))

    cpu.allocate = allocate
    e.plugin.store.get_blocks = get_blocks
    try:
        with pytest.raises((RuntimeError, ValueError, KeyboardInterrupt)):
            e.plugin.batched_get_blocking(keys)
    finally:
        del cpu.allocate
        del e.plugin.store.get_blocks
    assert made and [o.get_ref_count() for o in made] == [0] * len(made), \
        "allocated objects leaked"


def test_a_cancelled_async_load_frees_the_objects_it_read(file_target, engines):
    """batched_get_non_blocking awaits its load on a loader thread; when the
    awaiting task is cancelled (the request's prefetch cancelled, the event
    loop's tasks cancelled at close) the thread still reads and returns
    its MemoryObjs, which nobody then receives: each must go back to
    LMCache's allocator, not leak."""
    import threading

    e = Engine([file_target()])
    engines.append(e)
    keys = [e.key(h) for h in (151, 152)]
    e.put(keys, [e.chunk() for _ in keys])
    entered, gate, done, loaded = (threading.Event(), threading.Event(), threading.Event(),
                                   [])
    real_get_blocks, real_load = e.plugin.store.get_blocks, e.plugin._load_prefix

    def held_get_blocks(kbs, outs):
        entered.set()
        assert gate.wait(30)
        return real_get_blocks(kbs, outs)

    def recorded_load(*args):
        try:
            objs = real_load(*args)
            loaded.extend(objs)
            return objs
        finally:
            done.set()
    e.plugin.store.get_blocks = held_get_blocks
    e.plugin._load_prefix = recorded_load
    try:
        fut = asyncio.run_coroutine_threadsafe(
            e.plugin.batched_get_non_blocking("c", keys), e.manager.loop)
        assert entered.wait(30)
        fut.cancel()
        with pytest.raises(BaseException):      # CancelledError (of either kind)
            fut.result(30)
    finally:
        gate.set()
    assert done.wait(30)
    # (given back on the loader thread as its future completes, just after)
    deadline = time.monotonic() + 30
    while any(o.get_ref_count() for o in loaded) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(loaded) == 2
    assert [o.get_ref_count() for o in loaded] == [0, 0], "the cancelled load's objects leaked"


def test_a_put_after_the_writers_stopped_is_dropped_cleanly(file_target, engines):
    """StorageManager.close() closes LocalCPUBackend first, and the plugin's
    hook on it stops the writer threads; a put arriving then (another
    thread's store, or close_backend("LocalCPUBackend")) is not stored.  It
    must not raise out of LMCache's batched_put, keep a reference to the
    chunk, nor leave the key "in put tasks" for ever."""
    e = Engine([file_target()])
    engines.append(e)
    key = e.key(81)
    obj = e.chunk()
    refs = obj.get_ref_count()
    e.plugin._stop_threads()                     # what the LocalCPUBackend close hook does
    assert e.plugin.batched_submit_put_task([key], [obj]) is None
    assert not e.plugin.exists_in_put_tasks(key)
    assert obj.get_ref_count() == refs
    assert not e.plugin.contains(key)
    obj.ref_count_down()


def test_a_pin_taken_again_after_a_clear_protects_the_chunk_stored_again(file_target, engines):
    """A chunk pinned, deleted by another holder of the store, stored again
    (in another region) and pinned again while the first pin is held: the
    second pin must protect the chunk as stored now, not only the region of
    the copy the delete took."""
    e = Engine([file_target()], **{"kvblock.region_size": "64K"})
    engines.append(e)
    key = e.key(91)
    kb = e.plugin.kvblock_key(key)
    store = e.plugin.store

    def region_of_key():
        handle = store.pin([kb])
        try:
            return handle[0][0].region
        finally:
            store.unpin(handle)

    e.put([key], [e.chunk()])
    assert e.plugin.pin(key)
    first = region_of_key()
    assert store.delete([kb]) == 1
    e.put([key], [e.chunk()])                    # stored again
    assert region_of_key() != first
    assert e.plugin.pin(key)
    assert store.regions.pins[region_of_key()] > 0, "the chunk stored again is not pinned"
    assert e.plugin.unpin(key) and e.plugin.unpin(key)
    assert e.plugin._pins == {} and not (store.regions.pins > 0).any()


def test_remove_and_clear_win_over_puts_queued_before_them(file_target, engines):
    """A put queued (not written yet by the writer thread) and then the key
    removed, or the store cleared: the queued write must not land after
    remove()/clear() returned (the key found again), nor keep a reference
    to its chunk or leave the key "in put tasks"."""
    import threading

    e = Engine([file_target()], **{"kvblock.writer_threads": 1})
    engines.append(e)
    gate = threading.Event()
    real = e.plugin.store.put_runs

    def gated_put_runs(runs):
        assert gate.wait(30)
        return real(runs)
    e.plugin.store.put_runs = gated_put_runs
    keys = [e.key(h) for h in (101, 102, 103, 104)]
    objs = [e.chunk() for _ in keys]
    refs = [o.get_ref_count() for o in objs]
    try:
        futures = [e.plugin.batched_submit_put_task([k], [o])[0] for k, o in zip(keys, objs)]
        assert all(e.plugin.exists_in_put_tasks(k) for k in keys)
        # keys[0]'s write holds the writer (or is about to); the others are queued
        e.plugin.remove(keys[1])
        assert not e.plugin.exists_in_put_tasks(keys[1])
        remover = threading.Thread(target=e.plugin.clear)
        remover.start()
    finally:
        gate.set()
    remover.join(30)
    assert not remover.is_alive()
    for f in futures:
        f.result(30)
    assert not any(e.plugin.contains(k) for k in keys)
    assert not any(e.plugin.exists_in_put_tasks(k) for k in keys)
    assert [o.get_ref_count() for o in objs] == refs
    e.put([keys[1]], [objs[1]])                 # a put after them is stored
    assert e.plugin.contains(keys[1])
    for o in objs[:1] + objs[2:]:
        o.ref_count_down()


def test_an_async_lookup_keeps_the_pins_it_took_not_later_ones(file_target, engines):
    """batched_async_contains pins the hits, then records them for its load
    to release.  A forced remove and another pin of the key stored again
    between the two must not make this lookup's load release that other pin
    (the other holder's chunk would be evictable under it)."""
    e = Engine([file_target()])
    engines.append(e)
    key = e.key(111)
    kb = e.plugin.kvblock_key(key)
    real = e.plugin.pin
    e.put([key], [e.chunk()])

    def pin_then_others(k, *args):
        pinned = real(k, *args)
        e.plugin.pin = real                         # once
        assert e.plugin.remove(key, force=True)    # another thread's forced remove...
        e.put([key], [e.chunk()])                   # ... the key stored again and pinned
        assert e.plugin.pin(key)
        return pinned
    e.plugin.pin = pin_then_others

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, e.manager.loop).result(30)

    assert run(e.plugin.batched_async_contains("a", [key], pin=True)) == 1
    for obj in run(e.plugin.batched_get_non_blocking("a", [key])):   # a's load ends
        obj.ref_count_down()
    assert kb in e.plugin._pins, "lookup a released the other holder's pin"
    assert (e.plugin.store.regions.pins > 0).any()
    assert e.plugin.unpin(key)
    assert e.plugin._pins == {} and not (e.plugin.store.regions.pins > 0).any()


def test_a_load_after_the_writers_stopped_answers_a_miss(file_target, engines):
    """StorageManager.close() closes LocalCPUBackend first, and the plugin's
    hook on it stops the plugin's writer and load threads; LMCache's async
    lookup server still runs.  A lookup then must be answered (0 tokens:
    a miss) with its pins released, not fail inside LMCache's prefetch with
    an untyped RuntimeError (the scheduler never answered)."""
    class LookupServer:
        def __init__(self):
            self.replies = {}

        def send_response_to_scheduler(self, lookup_id, hits):
            self.replies[lookup_id] = hits

    server = LookupServer()
    e = Engine([file_target()], async_lookup_server=server,
               lmcache_options={"enable_async_loading": True})
    engines.append(e)
    key = e.key(121)
    e.put([key], [e.chunk()])
    e.plugin._stop_threads()                     # what the LocalCPUBackend close hook does
    asyncio.run_coroutine_threadsafe(
        e.manager.async_lookup_and_prefetch("req", [key], [0, CHUNK], None, True),
        e.manager.loop).result(30)
    deadline = time.monotonic() + 30
    while "req" not in server.replies:
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.01)
    assert server.replies["req"] == 0
    assert e.plugin._pins == {} and not (e.plugin.store.regions.pins > 0).any()
    assert e.plugin.get_non_blocking(key) is None


def test_a_load_does_not_wait_behind_queued_puts(file_target, engines):
    """LMCache's async prefetch (batched_get_non_blocking) is on a request's
    critical path; it must not queue behind the puts the writer threads are
    busy with (here: one writer held inside a write)."""
    import threading

    e = Engine([file_target()], **{"kvblock.writer_threads": 1})
    engines.append(e)
    stored = [e.key(131), e.key(132)]
    want = e.put(stored, [e.chunk(), e.chunk()])
    gate, writing = threading.Event(), threading.Event()
    real = e.plugin.store.put_runs

    def held_put_runs(runs):
        writing.set()
        assert gate.wait(30)
        return real(runs)
    e.plugin.store.put_runs = held_put_runs
    try:
        e.manager.batched_put([e.key(133)], [e.chunk()])
        assert writing.wait(30)
        e.manager.batched_put([e.key(134)], [e.chunk()])        # queued behind it
        load = asyncio.run_coroutine_threadsafe(
            e.plugin.batched_get_non_blocking("req", stored), e.manager.loop)
        objs = load.result(10)
        assert [obj_bytes(o) for o in objs] == want
        for o in objs:
            o.ref_count_down()
        single = e.plugin.get_non_blocking(stored[1]).result(10)
        assert obj_bytes(single) == want[1]
        single.ref_count_down()
    finally:
        gate.set()
    deadline = time.monotonic() + 30
    while any(e.plugin.exists_in_put_tasks(e.key(h)) for h in (133, 134)):
        assert time.monotonic() < deadline, "writes did not finish"
        time.sleep(0.01)
    assert e.plugin.contains(e.key(133)) and e.plugin.contains(e.key(134))


@pytest.mark.parametrize("shared", [False, True], ids=["own", "server"])
def test_clear_leaves_pinned_chunks(tmp_path, engines, shared):
    """LMCache's LocalCPUBackend.clear skips the objects that are pinned, as
    remove(force=False) does.  The plugin's clear removed the chunks an
    async lookup had pinned for its load (and counted them): the load then
    found nothing.  Pinned chunks stay and are not counted; once unpinned, a
    clear removes them.  Through a store server, another owner's chunks
    stay too."""
    from tests.support.servers import stop_server

    dev = str(tmp_path / "kv.img")
    opts = ({"kvblock.server": str(tmp_path / "kv.sock"), "kvblock.size": "32M"} if shared
            else {"kvblock.size": "32M"})
    e = Engine([dev], **opts)
    engines.append(e)
    other = Engine([dev], **opts, **{"kvblock.namespace": "tenant-b"}) if shared else None
    if other is not None:
        engines.append(other)
    server_pid = e.plugin.store.server_pid if shared else None

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, e.manager.loop).result(30)
    try:
        keys = [e.key(h) for h in (131, 132, 133, 134)]
        want = e.put(keys, [e.chunk() for _ in keys])
        if other is not None:
            other.put([other.key(131)], [other.chunk()])
        assert run(e.plugin.batched_async_contains("req", keys[:2], pin=True)) == 2
        assert e.plugin.pin(keys[3])
        assert e.manager.clear(locations=["kvblock"]) == CHUNK       # keys[2] only
        assert [e.plugin.contains(k) for k in keys] == [True, True, False, True]
        loaded = run(e.plugin.batched_get_non_blocking("req", keys[:2]))
        assert [obj_bytes(o) for o in loaded] == want[:2]
        for o in loaded:
            o.ref_count_down()
        assert e.plugin.clear() == 2 * CHUNK                       # the lookup's, unpinned
        assert e.plugin.contains(keys[3])
        assert e.plugin.unpin(keys[3]) and e.plugin.clear() == CHUNK
        assert e.plugin.batched_contains(keys) == 0
        if other is not None:
            assert other.plugin.contains(other.key(131))
    finally:
        if shared:
            for x in engines:
                x.close()
            engines.clear()
            stop_server(server_pid)


# LMCache drops the load's coroutine unawaited when its serializer refuses it
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_pins_of_a_lookup_whose_load_never_starts_are_released(file_target, engines):
    """An async lookup's pins end with the load LMCache starts for it.  When
    LMCache never starts that load -- its AsyncMultiSerializer refuses a
    load over its chunk budget (ValueError: the load's coroutine is never
    run), or the request is aborted -- no call reaches the plugin and the
    pins stayed for ever: their regions could never be reclaimed.  They end
    once the scheduler has given up on the lookup (LMCache's
    lookup_timeout_ms), at the next lookup or put, and at once with the
    abort (StorageManager.cancel_request)."""
    import types

    from lmcache.v1.event_manager import EventStatus, EventType
    from lmcache.v1.storage_backend.storage_manager import AsyncMultiSerializer

    class LookupServer:
        def __init__(self):
            self.replies = {}

        def send_response_to_scheduler(self, lookup_id, hits):
            self.replies[lookup_id] = hits

    server = LookupServer()
    e = Engine([file_target()], async_lookup_server=server,
               lmcache_options={"enable_async_loading": True})
    engines.append(e)
    store = e.plugin.store
    # LMCache's budgeted serializer, with a budget of 2 chunks
    e.manager.async_serializer = AsyncMultiSerializer(
        types.SimpleNamespace(calculate_chunk_budget=lambda: 2), e.manager.loop)
    keys = [e.key(h) for h in (141, 142, 143)]
    e.put(keys, [e.chunk() for _ in keys])
    asyncio.run_coroutine_threadsafe(
        e.manager.async_lookup_and_prefetch("req", keys, [0, CHUNK, 2 * CHUNK, 3 * CHUNK],
                                            None, True), e.manager.loop).result(30)
    deadline = time.monotonic() + 30
    while e.manager.event_manager.get_event_status(EventType.LOADING, "req") != \
            EventStatus.DONE:
        assert time.monotonic() < deadline, "the prefetch never ended"
        time.sleep(0.01)
    assert "req" not in server.replies          # refused: no load, no answer
    assert len(e.plugin._pins) == 3             # the lookup's pins, still needed?
    e.put([e.key(144)], [e.chunk()])            # before the deadline: kept
    assert len(e.plugin._pins) == 3
    now = time.monotonic()
    e.plugin._clock = lambda: now + e.manager.config.lookup_timeout_ms / 1000 + 1
    e.put([e.key(145)], [e.chunk()])            # past it: released
    assert e.plugin._pins == {} and not (store.regions.pins > 0).any()
    e.manager.event_manager.pop_event(EventType.LOADING, "req")
    collect_lmcache_garbage()                   # the refused load, under this test's filter
    # an aborted request's lookup: its pins end with the abort, and its load
    # (if it comes after all) releases nothing of anyone else's
    assert asyncio.run_coroutine_threadsafe(
        e.plugin.batched_async_contains("gone", keys[:2], pin=True),
        e.manager.loop).result(30) == 2
    assert e.plugin.pin(keys[0])                # another holder's pin
    e.manager.cancel_request("gone")
    assert len(e.plugin._pins) == 1
    got = asyncio.run_coroutine_threadsafe(
        e.plugin.batched_get_non_blocking("gone", keys[:2]), e.manager.loop).result(30)
    for obj in got:
        obj.ref_count_down()
    assert len(e.plugin._pins) == 1 and e.plugin.unpin(keys[0])
    assert e.plugin._pins == {} and not (store.regions.pins > 0).any()


def test_the_pins_of_a_lookup_whose_load_started_outlast_its_deadline(file_target, engines):
    """lookup_timeout_ms ends the pins of a lookup whose load never came.
    A load that came but is still queued or reading at the deadline (the
    loader threads busy with other loads) kept them only until the next
    lookup or put: its chunks could be evicted before it read them, and it
    came back short of the hits its lookup reported.  A started load holds
    its lookup's pins until it ends."""
    import threading

    e = Engine([file_target()])
    engines.append(e)
    key = e.key(151)
    kb = e.plugin.kvblock_key(key)
    e.put([key], [e.chunk()])
    loop = e.manager.loop
    assert asyncio.run_coroutine_threadsafe(
        e.plugin.batched_async_contains("slow", [key], pin=True), loop).result(30) == 1
    entered, gate = threading.Event(), threading.Event()
    real = e.plugin._load_prefix

    def gated_load(keys, busy_loop):
        entered.set()
        assert gate.wait(30)
        return real(keys, busy_loop)
    e.plugin._load_prefix = gated_load
    try:
        load = asyncio.run_coroutine_threadsafe(
            e.plugin.batched_get_non_blocking("slow", [key]), loop)
        assert entered.wait(30)                     # the load has started
        now = time.monotonic()
        e.plugin._clock = lambda: now + e.manager.config.lookup_timeout_ms / 1000 + 1
        e.put([e.key(152)], [e.chunk()])           # past the deadline: expiry runs
        assert kb in e.plugin._pins, "a started load's pins were released under it"
        assert (e.plugin.store.regions.pins > 0).any()
    finally:
        gate.set()
    got = load.result(30)
    assert [obj_bytes(o) for o in got] and len(got) == 1
    for obj in got:
        obj.ref_count_down()
    assert e.plugin._pins == {} and not (e.plugin.store.regions.pins > 0).any()


def test_a_failed_pin_keeps_the_pins_held(file_target, engines):
    """A pin that fails (a store server call timing out: answered as a
    miss) dropped the key's pin entry and released its store pin, as if
    the chunk were gone: the async lookup holding it then had its chunk
    evictable before its load.  The held pins stay; the failure is a miss."""
    from kvblock.errors import ServerError

    e = Engine([file_target()])
    engines.append(e)
    key = e.key(151)
    kb = e.plugin.kvblock_key(key)
    store = e.plugin.store
    e.put([key], [e.chunk()])
    assert asyncio.run_coroutine_threadsafe(
        e.plugin.batched_async_contains("a", [key], pin=True), e.manager.loop).result(30) == 1
    real = store.pin

    def failing_pin(keys):
        store.pin = real
        raise ServerError("kvblock store server: call timed out")
    store.pin = failing_pin
    assert e.plugin.contains(key, pin=True) is False
    assert kb in e.plugin._pins and (store.regions.pins > 0).any()
    got = asyncio.run_coroutine_threadsafe(
        e.plugin.batched_get_non_blocking("a", [key]), e.manager.loop).result(30)
    assert len(got) == 1
    got[0].ref_count_down()
    assert e.plugin._pins == {} and not (store.regions.pins > 0).any()


def test_a_pin_taken_while_clear_runs_keeps_its_chunk(file_target, engines):
    """clear() leaves pinned chunks (as LocalCPUBackend.clear): it took the
    list of pinned keys under the plugin's lock, then deleted the worker's
    chunks after releasing it.  A pin taken in between (an async lookup on
    LMCache's event loop while its controller clears) succeeded, and the
    chunk it pinned was deleted anyway: the lookup's load then missed (a
    layer-wise one fails).  A pin either comes before the clear (its chunk
    kept) or after it (a miss), never a pin on a chunk the clear removed."""
    import threading

    e = Engine([file_target()])
    engines.append(e)
    key = e.key(161)
    e.put([key], [e.chunk()])
    store = e.plugin.store
    real = store.delete_prefix
    pinned = []

    def delete_prefix_racing_a_pin(prefix, keep=()):
        store.delete_prefix = real
        other = threading.Thread(target=lambda: pinned.append(e.plugin.pin(key)))
        other.start()
        other.join(1)        # a pin that can run now does (bounded: it may wait)
        return real(prefix, keep)
    store.delete_prefix = delete_prefix_racing_a_pin
    removed = e.plugin.clear()
    deadline = time.monotonic() + 30
    while not pinned:
        assert time.monotonic() < deadline, "the pin never ended"
        time.sleep(0.01)
    try:
        assert pinned == [e.plugin.contains(key)], "a pinned chunk was cleared"
        assert removed == (0 if pinned[0] else CHUNK)
    finally:
        if pinned[0]:
            e.plugin.unpin(key)


def test_a_pin_taken_while_an_unforced_remove_runs_keeps_its_chunk(file_target, engines):
    """remove(key, force=False) leaves a pinned chunk: it checked for a pin
    under the plugin's lock, then deleted after releasing it, so a pin taken
    in between succeeded on the chunk the delete then removed.  A pin comes
    before the remove (kept, the remove says False) or after it (a miss)."""
    import threading

    e = Engine([file_target()])
    engines.append(e)
    key = e.key(171)
    e.put([key], [e.chunk()])
    store = e.plugin.store
    real = store.delete
    pinned = []

    def delete_racing_a_pin(keys):
        store.delete = real
        other = threading.Thread(target=lambda: pinned.append(e.plugin.pin(key)))
        other.start()
        other.join(1)        # a pin that can run now does (bounded: it may wait)
        return real(keys)
    store.delete = delete_racing_a_pin
    removed = e.plugin.remove(key, force=False)
    deadline = time.monotonic() + 30
    while not pinned:
        assert time.monotonic() < deadline, "the pin never ended"
        time.sleep(0.01)
    try:
        assert pinned == [e.plugin.contains(key)], "a pinned chunk was removed"
        assert removed is not pinned[0]
    finally:
        if pinned[0]:
            e.plugin.unpin(key)


def test_a_failed_unpin_neither_fails_the_load_nor_keeps_the_lookups_other_pins(file_target,
                                                                               engines):
    """An unpin through a store server can fail (a call timing out raises
    ServerError; only a gone server is quiet).  The load of an async lookup
    ends the lookup's pins in its ``finally``: an unpin raising there threw
    the objects it had loaded away (their references never given back: CPU
    memory leaked) and failed the load into LMCache (its prefetch's done
    callback raised, the scheduler never answered), and the lookup's other
    pins, its list already popped, were never released.  A failed unpin is
    a store failure: logged and counted, the load and the other pins go on."""
    from kvblock.errors import ServerError

    e = Engine([file_target()])
    engines.append(e)
    keys = [e.key(h) for h in (161, 162)]
    want = e.put(keys, [e.chunk(), e.chunk()])
    store = e.plugin.store
    assert asyncio.run_coroutine_threadsafe(
        e.plugin.batched_async_contains("a", keys, pin=True), e.manager.loop).result(30) == 2
    real = store.unpin

    def unpin_times_out(segs):
        store.unpin = real
        real(segs)
        raise ServerError("the store server did not answer unpin within 30 s")
    store.unpin = unpin_times_out
    got = asyncio.run_coroutine_threadsafe(
        e.plugin.batched_get_non_blocking("a", keys), e.manager.loop).result(30)
    assert [obj_bytes(o) for o in got] == want
    for o in got:
        o.ref_count_down()
    assert e.plugin._pins == {} and not (store.regions.pins > 0).any()
    assert e.plugin.stats()["store_failures"] == 1
    # LMCache's own unpin (lookup_unpin, batched_unpin) of a pin whose
    # release fails: answered, not raised into the engine
    assert e.plugin.pin(keys[0])
    store.unpin = unpin_times_out
    assert e.plugin.unpin(keys[0]) is True
    assert e.plugin._pins == {} and e.plugin.stats()["store_failures"] == 2


def _damaged_store_file(path):
    """A store file whose superblocks are damaged: no store opens on it, and
    "if-empty" will not format over it (provision.store_held names it)."""
    from kvblock import Geometry, create_file
    from kvblock.format import superblock as sbfmt

    create_file(path, 16 << 20)
    KVStore.format([path], Geometry(num_layers=1, num_kv_heads=1, head_dim=64,
                                    dtype="uint8", block_tokens=1, kv_parts=1,
                                    head_groups=1), region_size=1 << 20).close()
    with open(path, "r+b") as f:
        for off in sbfmt.COPY_OFFSETS:
            f.seek(off + 100)
            f.write(b"\xff" * 4)


def test_a_shared_start_that_will_not_format_names_the_plugins_own_setting(tmp_path):
    """kvblock.server on a device holding a store that cannot be opened (a
    damaged one): the plugin will not format over it, and the refusal names
    its own setting, as without a server (`kvblock.format: force`), not
    open_or_format's generic 'set format to "force"'."""
    from kvblock.errors import UnsafeTargetError

    dev, sock = str(tmp_path / "kv.img"), str(tmp_path / "kv.sock")
    _damaged_store_file(dev)
    for shared in ({}, {"kvblock.server": sock}):
        with pytest.raises(UnsafeTargetError, match="holds a damaged kvblock store") as e:
            KVBlockStorageBackend(config=make_config([dev], **shared),
                                  metadata=make_metadata(), local_cpu_backend=object())
        assert str(e.value).endswith("set kvblock.format: force"), (shared, str(e.value))
        assert "kvblock LMCache plugin will not format" in str(e.value), str(e.value)
    assert not os.path.exists(sock)
