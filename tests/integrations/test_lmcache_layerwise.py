"""kvblock as LMCache's storage plugin in layer-wise mode (``use_layerwise``),
driven by LMCache's own cache engine.

``LMCacheEngine.store_layer`` / ``retrieve_layer`` / ``lookup`` run as LMCache
runs them (its token database, storage manager and plugin loader); only the
GPU connector is a stand-in that copies the layers of a CPU tensor where
LMCache's layer-wise vLLM connector would copy paged GPU memory, with the same
generator protocol and the same object shapes (``get_shape``).
"""

from __future__ import annotations

import time

import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngine
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager, EventType
from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemLayerwiseGPUConnector
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.token_database import ChunkedTokenDatabase

from kvblock.errors import GeometryMismatchError
from kvblock.integrations.lmcache import KVBlockStorageBackend
from tests.integrations.lmcache_gc import collect_lmcache_garbage

CHUNK = 16
LAYERS = 4
HEADS, HEAD_SIZE = 4, 32
MODEL = "org/layerwise-model"


def make_config(devices, *, layerwise=True, blending=False, async_loading=False, **extra):
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05,
        use_layerwise=layerwise, enable_blending=blending, storage_plugins=["kvblock"],
        enable_async_loading=async_loading,
        extra_config={"storage_plugin.kvblock.module_path": "kvblock.integrations.lmcache",
                      "storage_plugin.kvblock.class_name": "KVBlockStorageBackend",
                      "kvblock.devices": devices, **extra})


def make_metadata(mla=False):
    shape = (LAYERS, 1, CHUNK, 1, HEAD_SIZE) if mla else (LAYERS, 2, CHUNK, HEADS, HEAD_SIZE)
    return LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=shape,
                           use_mla=mla, chunk_size=CHUNK)


class CPULayerwiseConnector(VLLMPagedMemLayerwiseGPUConnector):
    """LMCache's layer-wise vLLM connector with the model's KV in a CPU tensor
    ``kv[layer, token]`` (``[tokens, 2, hidden]`` a layer; ``[tokens,
    hidden]`` for MLA) instead of paged GPU memory.  Same generators: one
    yield per layer and one more (store), a send per layer and two more
    yields (load)."""

    def __init__(self, kv: torch.Tensor, mla: bool):      # not super(): it needs CUDA
        self.kv, self.use_mla = kv, mla
        self.num_layers, self.hidden_dim_size = kv.shape[0], kv.shape[-1]

    def get_shape(self, num_tokens: int) -> torch.Size:
        if self.use_mla:
            return torch.Size([num_tokens, self.hidden_dim_size])
        return torch.Size([num_tokens, 2, self.hidden_dim_size])

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for layer in range(self.num_layers):
            for start, end, obj in zip(starts, ends, memory_objs[layer]):
                obj.tensor.copy_(self.kv[layer, start:end])
            yield
        yield

    def batched_to_gpu(self, starts, ends, **kwargs):
        for layer in range(self.num_layers):
            objs = yield
            assert len(objs) == len(starts), "a layer came back short"
            for start, end, obj in zip(starts, ends, objs):
                self.kv[layer, start:end].copy_(obj.tensor)
        yield
        yield


class Engine:
    """An LMCacheEngine in layer-wise mode over a kvblock store, its model's KV
    in CPU memory: ``tokens`` tokens of random KV."""

    def __init__(self, devices, *, mla=False, tokens=5 * CHUNK, seed=0, **extra):
        self.metadata = make_metadata(mla)
        self.config = make_config(devices, **extra)
        hidden = HEAD_SIZE if mla else HEADS * HEAD_SIZE
        shape = (LAYERS, tokens, hidden) if mla else (LAYERS, tokens, 2, hidden)
        g = torch.Generator().manual_seed(seed)
        self.want = torch.randn(shape, generator=g).to(torch.bfloat16)
        self.connector = CPULayerwiseConnector(self.want.clone(), mla)
        self.engine = LMCacheEngine(self.config, self.metadata,
                                    ChunkedTokenDatabase(self.config, self.metadata),
                                    self.connector, lambda *a: None, lambda *a: None)
        self.engine.post_init()
        self.plugin = self.engine.storage_manager.storage_backends.get("kvblock")
        assert isinstance(self.plugin, KVBlockStorageBackend), \
            f"LMCache did not load the plugin: {list(self.engine.storage_manager.storage_backends)}"
        self.tokens = torch.arange(tokens)

    def store(self, tokens=None) -> None:
        """The cache engine's layer-wise store, then wait for the plugin's writes."""
        tokens = self.tokens if tokens is None else tokens
        want = self.plugin.stats()["blocks"] + LAYERS * (len(tokens) // CHUNK)
        for _ in self.engine.store_layer(tokens):
            pass
        deadline = time.monotonic() + 30
        while self.plugin.stats()["blocks"] < want:
            assert time.monotonic() < deadline, "writes did not finish"
            time.sleep(0.01)

    def retrieve(self, tokens=None) -> torch.Tensor:
        """The cache engine's layer-wise retrieve into zeroed KV; its token mask."""
        self.connector.kv.zero_()
        *_, mask = self.engine.retrieve_layer(self.tokens if tokens is None else tokens)
        return mask

    def chunk_key(self, i: int) -> CacheEngineKey:
        db = self.engine.token_database
        return [key for _, _, key in db.process_tokens(tokens=self.tokens)][i]

    def close(self) -> None:
        engine, self.engine, self.plugin = self.engine, None, None
        manager = engine.storage_manager
        engine.close()
        if not manager.thread.is_alive():
            manager.loop.close()          # StorageManager.close() leaves it open
        del engine, manager
        collect_lmcache_garbage()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_store_layer_then_retrieve_layer_bytes_identical(store_target, engines, mla):
    e = Engine([store_target()], mla=mla)
    engines.append(e)
    e.store()
    fmt = MemoryFormat.KV_MLA_FMT if mla else MemoryFormat.KV_T2D
    assert e.plugin.chunk.fmt == fmt
    assert e.plugin.stats()["blocks"] == 5 * LAYERS      # one object per layer and chunk
    assert e.plugin.stats()["skipped_chunks"] == 0
    assert e.engine.lookup(e.tokens, lookup_id="req-1", pin=True) == len(e.tokens)
    assert len(e.plugin._pins) == 5 * LAYERS              # lookup pinned every layer
    reads = e.plugin.store.stats()["get_blocks"]
    mask = e.retrieve()
    assert bool(mask.all()) and torch.equal(e.connector.kv, e.want)
    assert e.plugin.store.stats()["get_blocks"] - reads == 5 * LAYERS   # from the store
    e.engine.lookup_unpin("req-1")
    assert not e.plugin._pins
    # a longer prompt: its stored prefix is found and loaded, the rest is not
    longer = torch.arange(7 * CHUNK)
    assert e.engine.lookup(longer) == 5 * CHUNK
    e.connector.kv.zero_()
    *_, mask = e.engine.retrieve_layer(longer)
    assert int(mask.sum()) == 5 * CHUNK and torch.equal(e.connector.kv, e.want)


def test_layers_survive_a_restart(store_target, engines):
    path = store_target()
    e = Engine([path], seed=1)
    e.store()
    e.close()
    e = Engine([path], seed=1, **{"kvblock.format": "never"})
    engines.append(e)
    e.connector.kv.zero_()
    mask = e.retrieve()
    assert bool(mask.all()) and torch.equal(e.connector.kv, e.want)


def test_a_missing_layer_ends_the_prefix(file_target, engines):
    """A chunk one of whose layers is gone (evicted, removed) is a miss from
    there on: lookup stops before it, retrieve_layer (which asks for layer 0
    only) loads just the chunks before it, and the next store_layer writes
    the missing layer again."""
    e = Engine([file_target()], tokens=3 * CHUNK, seed=2)
    engines.append(e)
    e.store()
    layer_key = e.chunk_key(1).split_layers(LAYERS)[2]
    assert e.plugin.remove(layer_key)
    assert e.engine.lookup(e.tokens) == CHUNK
    assert not e.plugin.contains(e.chunk_key(1).split_layers(LAYERS)[0])
    mask = e.retrieve()
    assert int(mask.sum()) == CHUNK and bool(mask[:CHUNK].all())
    assert torch.equal(e.connector.kv[:, :CHUNK], e.want[:, :CHUNK])
    assert not e.connector.kv[:, CHUNK:].any()
    e.connector.kv.copy_(e.want)
    blocks = e.plugin.stats()["blocks"]
    for _ in e.engine.store_layer(e.tokens):
        pass
    deadline = time.monotonic() + 30
    while not e.plugin.contains(layer_key):
        assert time.monotonic() < deadline, "the missing layer was not written again"
        time.sleep(0.01)
    assert e.plugin.stats()["blocks"] == blocks + 1       # just that layer
    assert e.engine.lookup(e.tokens) == 3 * CHUNK
    mask = e.retrieve()
    assert bool(mask.all()) and torch.equal(e.connector.kv, e.want)


def test_a_layer_lost_after_the_lookup_fails_the_load(file_target, engines):
    """retrieve_layer checks layer 0 of each chunk, then loads a layer of
    every chunk per call; LMCache's connectors zip what comes back with the
    chunks.  A layer lost in between (evicted) must fail that load, not come
    back short: a short list would leave the layer's stale KV in place with
    its tokens counted as loaded."""
    from kvblock.errors import KVBlockError

    e = Engine([file_target()], tokens=3 * CHUNK, seed=4)
    engines.append(e)
    e.store()
    layers = [e.chunk_key(c).split_layers(LAYERS) for c in range(3)]
    assert all(e.plugin.contains(chunk[0]) for chunk in layers)   # the lookup's check
    assert e.plugin.remove(layers[0][2])                         # then evicted
    manager = e.engine.storage_manager
    layer_major = [[chunk[layer] for chunk in layers] for layer in range(LAYERS)]
    for layer, task in enumerate(manager.layerwise_batched_get(layer_major,
                                                               location="kvblock")):
        if layer == 2:
            with pytest.raises(KVBlockError, match="3 of 3 layer objects"):
                task.result(timeout=30)
            continue
        got = task.result(timeout=30)
        assert len(got) == 3
        for obj in got:
            obj.ref_count_down()


def test_an_async_lookup_pins_whole_chunks_only(file_target, engines):
    """LMCache rounds a layer-wise async lookup down to whole chunks and
    unpins the layers past that itself.  The plugin rounds first (and
    releases those pins), so none is released twice: here another lookup's
    pin on chunk 1's layers survives, and the load ends the lookup's pins."""
    import asyncio

    e = Engine([file_target()], tokens=2 * CHUNK, seed=5)
    engines.append(e)
    e.store()
    layers = [e.chunk_key(c).split_layers(LAYERS) for c in range(2)]
    assert e.plugin.remove(layers[1][2])                  # chunk 1: only part of it left
    loop = e.engine.storage_manager.loop

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)
    assert e.plugin.pin(layers[1][0])                     # another lookup's pin
    assert run(e.plugin.batched_async_contains("a", layers[0] + layers[1], pin=True)) == LAYERS
    assert e.plugin._pins[e.plugin.kvblock_key(layers[1][0])][0] == 1
    assert set(e.plugin._pins) == {e.plugin.kvblock_key(k) for k in layers[0] + layers[1][:1]}
    got = run(e.plugin.batched_get_non_blocking("a", layers[0]))
    assert len(got) == LAYERS
    for obj in got:
        obj.ref_count_down()
    assert set(e.plugin._pins) == {e.plugin.kvblock_key(layers[1][0])}   # the other's
    e.plugin.unpin(layers[1][0])
    assert e.plugin._pins == {}


def test_a_lookup_with_pins_releases_them_on_a_partial_chunk(file_target, engines):
    """LMCache's layer-wise lookup asks for one chunk's layers at a time and
    records the pins only of a chunk found whole: a chunk missing a layer
    ends the lookup, and the pins taken on its other layers would never be
    released (lookup_unpin does not know them).  They must not outlive the
    lookup: nothing pinned after lookup_unpin."""
    e = Engine([file_target()], tokens=3 * CHUNK, seed=2)
    engines.append(e)
    e.store()
    assert e.plugin.remove(e.chunk_key(1).split_layers(LAYERS)[2])
    assert e.engine.lookup(e.tokens, lookup_id="req-1", pin=True) == CHUNK
    assert set(e.plugin._pins) == {e.plugin.kvblock_key(k)
                                   for k in e.chunk_key(0).split_layers(LAYERS)}
    e.engine.lookup_unpin("req-1")
    assert e.plugin._pins == {}
    with e.plugin.store._lock:
        assert int(e.plugin.store.regions.pins.sum()) == 0


def test_an_async_prefetch_that_comes_back_short_answers_the_whole_chunks(file_target,
                                                                         engines):
    """A layer-wise async prefetch (vLLM's async lookup): LMCache loads every
    layer of every chunk found, rounds what came back down to whole chunks
    itself and answers the scheduler.  A layer evicted between the lookup
    and the load must shorten the answer, not fail the load (the scheduler
    would get no answer and recompute everything after its timeout)."""
    import asyncio

    e = Engine([file_target()], tokens=2 * CHUNK, seed=6, async_loading=True)
    engines.append(e)
    e.store()
    manager = e.engine.storage_manager
    replies = {}

    class LookupServer:
        def send_response_to_scheduler(self, lookup_id, length):
            replies[lookup_id] = length
    manager.async_lookup_server = LookupServer()
    layers = [e.chunk_key(c).split_layers(LAYERS) for c in range(2)]
    real = e.plugin._load_prefix

    def load_prefix(keys, busy_loop):
        e.plugin.remove(layers[1][2])                  # evicted after the lookup
        return real(keys, busy_loop)
    e.plugin._load_prefix = load_prefix
    asyncio.run_coroutine_threadsafe(
        manager.async_lookup_and_prefetch("req-1", layers[0] + layers[1], [0, CHUNK, 2 * CHUNK],
                                          None, True, keys_per_chunk=LAYERS),
        manager.loop).result(30)
    deadline = time.monotonic() + 30
    while "req-1" not in replies:
        assert time.monotonic() < deadline, "the scheduler got no answer"
        time.sleep(0.01)
    assert replies["req-1"] == CHUNK
    got = manager.event_manager.pop_event(EventType.LOADING, "req-1").result()   # done
    held = [obj for tier in got for _, obj in tier][:LAYERS]   # LMCache freed the tail
    assert len(held) == LAYERS
    for obj in held:
        obj.ref_count_down()
    assert e.plugin._pins == {}


def test_layerwise_and_whole_chunk_stores_are_told_apart(file_target, engines):
    """A store written in one mode is refused in the other (LMCache's loader
    logs and drops a plugin that fails: build it directly to see why)."""
    path = file_target()
    e = Engine([path])
    e.store()
    e.close()
    manager = StorageManager(make_config([path], layerwise=False), make_metadata(),
                             EventManager())
    try:
        assert "kvblock" not in manager.storage_backends
        with pytest.raises(GeometryMismatchError):
            KVBlockStorageBackend(config=make_config([path], layerwise=False),
                                  metadata=make_metadata(),
                                  local_cpu_backend=manager.storage_backends["LocalCPUBackend"],
                                  loop=manager.loop)
    finally:
        manager.close()
        manager.loop.close()


def test_blending_layer_objects_through_the_storage_manager(file_target):
    """With ``enable_blending`` LMCache's layer objects are ``[2, tokens,
    hidden]`` ``KV_2TD`` (its buffer connector): put as the cache engine puts
    them (``batched_allocate`` of every layer, a ``batched_put`` per layer)
    and loaded with ``layerwise_batched_get``; an object of another format is
    skipped, not stored."""
    config = make_config([file_target()], blending=True)
    manager = StorageManager(config, make_metadata(), EventManager())
    try:
        plugin = manager.storage_backends["kvblock"]
        assert plugin.chunk.fmt == MemoryFormat.KV_2TD
        shape = torch.Size([2, CHUNK, HEADS * HEAD_SIZE])
        chunks = [CacheEngineKey(MODEL, 1, 0, h, torch.bfloat16) for h in (71, 72)]
        keys = [c.split_layers(LAYERS) for c in chunks]           # [chunk][layer]
        objs = [manager.batched_allocate(shape, torch.bfloat16, batch_size=LAYERS,
                                         fmt=MemoryFormat.KV_2TD) for _ in chunks]
        want, positions = {}, {}
        g = torch.Generator().manual_seed(3)
        for c in range(len(chunks)):
            for layer, obj in enumerate(objs[c]):
                obj.tensor.copy_(torch.randn(shape, generator=g).to(torch.bfloat16))
                want[keys[c][layer]] = obj.tensor.clone()
                # the token positions the KV was computed at, which CacheBlend's
                # buffer connector reads back (chunk 1: none were set)
                obj.metadata.cached_positions = (
                    torch.arange(100 * c, 100 * c + CHUNK) if c == 0 else None)
                positions[keys[c][layer]] = obj.metadata.cached_positions
        for layer in range(LAYERS):
            manager.batched_put([keys[c][layer] for c in range(len(chunks))],
                                [objs[c][layer] for c in range(len(chunks))])
        deadline = time.monotonic() + 30
        while plugin.stats()["blocks"] < len(want):
            assert time.monotonic() < deadline, "writes did not finish"
            time.sleep(0.01)
        layer_major = [[keys[c][layer] for c in range(len(chunks))] for layer in range(LAYERS)]
        for layer, task in enumerate(manager.layerwise_batched_get(layer_major,
                                                                   location="kvblock")):
            got = task.result(timeout=30)
            assert len(got) == len(chunks)
            for key, obj in zip(layer_major[layer], got):
                assert obj.get_memory_format() == MemoryFormat.KV_2TD
                assert torch.equal(obj.tensor, want[key])
                if positions[key] is None:
                    assert obj.metadata.cached_positions is None
                else:
                    assert torch.equal(obj.metadata.cached_positions, positions[key])
                obj.ref_count_down()
        wrong = manager.batched_allocate(torch.Size([CHUNK, 2, HEADS * HEAD_SIZE]),
                                         torch.bfloat16, batch_size=1,
                                         fmt=MemoryFormat.KV_T2D)
        other = CacheEngineKey(MODEL, 1, 0, 73, torch.bfloat16).split_layers(LAYERS)[0]
        manager.batched_put([other], wrong)
        assert not plugin.contains(other) and plugin.stats()["skipped_chunks"] == 1
    finally:
        manager.close()
        manager.loop.close()


def test_a_partial_chunk_releases_only_its_own_pins(file_target, engines):
    """A lookup with pins releases the pins it took on a partial chunk's
    layers.  A forced remove and another pin of such a layer stored again
    before that release must not make the lookup release the other pin."""
    e = Engine([file_target()], tokens=2 * CHUNK, seed=3)
    engines.append(e)
    e.store()
    layers0 = e.chunk_key(0).split_layers(LAYERS)
    layers1 = e.chunk_key(1).split_layers(LAYERS)
    assert e.plugin.remove(layers1[2])
    kb = e.plugin.kvblock_key(layers1[0])
    real = e.plugin.pin

    def pin_then_others(key, *args):
        pinned = real(key, *args)
        if key == layers1[0]:
            e.plugin.pin = real                          # once
            assert e.plugin.remove(key, force=True)     # another thread's forced remove...
            for _ in e.engine.store_layer(e.tokens):     # ... the layer stored again
                pass
            deadline = time.monotonic() + 30
            while not all(e.plugin.store.contains(e.plugin.kvblock_key(k))
                          and not e.plugin.exists_in_put_tasks(k) for k in layers1):
                assert time.monotonic() < deadline, "writes did not finish"
                time.sleep(0.01)
            assert e.plugin.pin(key)                     # and pinned by its holder
        return pinned
    e.plugin.pin = pin_then_others
    assert e.plugin.batched_contains(layers0 + layers1, pin=True) == LAYERS
    assert kb in e.plugin._pins, "the lookup released the other holder's pin"
    for key in layers0 + [layers1[0]]:
        assert e.plugin.unpin(key)
    assert e.plugin._pins == {}
    with e.plugin.store._lock:
        assert int(e.plugin.store.regions.pins.sum()) == 0


def test_clear_of_tokens_removes_their_chunks_layers(file_target, engines):
    """LMCacheEngine.clear(tokens) removes each chunk by its chunk key
    (storage_manager.remove(key)); layer-wise, the store holds that chunk as
    layer objects under layer keys.  The remove must take every layer of the
    chunk (the chunk is then a miss), not answer 'nothing removed' and leave
    the chunk found and loadable; a remove that is not forced leaves a chunk
    with a pinned layer whole."""
    e = Engine([file_target()], tokens=3 * CHUNK, seed=6)
    engines.append(e)
    e.store()
    assert e.engine.clear(e.tokens[:2 * CHUNK]) == 2
    assert e.plugin.stats()["blocks"] == LAYERS                 # chunk 2's layers only
    assert e.engine.lookup(e.tokens) == 0
    assert not e.plugin.remove(e.chunk_key(0))                   # gone already
    assert e.plugin.contains(e.chunk_key(2).split_layers(LAYERS)[0])
    pinned = e.chunk_key(2).split_layers(LAYERS)[3]
    assert e.plugin.pin(pinned)
    assert not e.plugin.remove(e.chunk_key(2), force=False)
    assert e.plugin.stats()["blocks"] == LAYERS
    assert e.plugin.remove(e.chunk_key(2))                       # forced: pins or not
    assert e.plugin.stats()["blocks"] == 0
    assert not e.plugin.unpin(pinned)


def test_a_layer_0_check_counts_one_lookup(file_target, engines):
    """retrieve_layer checks each chunk by its layer 0 (contains), which the
    plugin answers by looking up all the chunk's layers: that is the
    engine's lookup, counted once in the store's hit rate (lookups,
    lookup_hit_blocks), as LMCache's lookup of the same chunk
    (batched_contains of its layers) counts -- not a second time for layer
    0 alone."""
    e = Engine([file_target()], tokens=3 * CHUNK, seed=7)
    engines.append(e)
    e.store()

    def counted(fn):
        before = e.plugin.stats()
        fn()
        after = e.plugin.stats()
        return tuple(after[k] - before[k] for k in ("lookups", "lookup_hit_blocks"))
    assert counted(lambda: e.engine.lookup(e.tokens)) == (3, 3 * LAYERS)
    assert counted(lambda: e.retrieve()) == (3, 3 * LAYERS)
    layer0 = e.chunk_key(1).split_layers(LAYERS)[0]
    assert counted(lambda: e.plugin.contains(layer0)) == (1, LAYERS)
    assert e.plugin.remove(e.chunk_key(1).split_layers(LAYERS)[2])
    assert counted(lambda: e.plugin.contains(layer0)) == (1, 2)     # layers 0 and 1 found


def test_clear_keeps_a_chunk_with_a_pinned_layer_whole(file_target, engines):
    """clear() leaves pinned chunks, as remove(chunk, force=False) does.
    Layer-wise, a chunk is found (and loads) only with all its layers: a
    pin of one layer (contains(layer 0, pin=True) pins layer 0) must keep
    the whole chunk, not that layer alone with the others gone -- the pinned
    chunk would then never be found or load again."""
    e = Engine([file_target()], tokens=2 * CHUNK, seed=8)
    engines.append(e)
    e.store()
    layer0 = e.chunk_key(0).split_layers(LAYERS)[0]
    assert e.plugin.contains(layer0, pin=True)
    assert e.engine.clear() == CHUNK                            # chunk 1 only
    assert e.plugin.stats()["blocks"] == LAYERS                 # chunk 0 whole
    assert e.plugin.contains(layer0)
    assert e.engine.lookup(e.tokens) == CHUNK
    assert e.retrieve()[:CHUNK].all()
    assert torch.equal(e.connector.kv[:, :CHUNK], e.want[:, :CHUNK])
    assert e.plugin.unpin(layer0)


def test_a_pin_taken_while_an_unforced_chunk_remove_runs_keeps_the_chunk_whole(file_target,
                                                                              engines):
    """remove(chunk key, force=False) checked every layer's pin under the
    plugin's lock, then removed the layers one by one, each under the lock
    on its own.  A pin of a later layer taken in between (an async lookup on
    LMCache's event loop) kept that layer alone while the others went: the
    chunk is then never found or loaded again, and LMCache's pin holds a
    layer no load can use.  A pin comes before the remove (the chunk kept
    whole, the remove says False) or after it (a miss, nothing pinned)."""
    import threading

    from lmcache.utils import LayerCacheEngineKey

    e = Engine([file_target()], tokens=CHUNK, seed=9)
    engines.append(e)
    e.store()
    chunk = e.chunk_key(0)
    layers = chunk.split_layers(LAYERS)
    pinned, racing = [], []

    def race_a_pin():
        """A pin of the last layer from another thread, once; it may wait."""
        if racing:
            return
        other = threading.Thread(target=lambda: pinned.append(e.plugin.pin(layers[-1])))
        racing.append(other)
        other.start()
        other.join(1)
    real_remove, store = e.plugin.remove, e.plugin.store
    real_delete = store.delete

    def remove_racing_a_pin(key, force=True):
        if isinstance(key, LayerCacheEngineKey):
            race_a_pin()                # between the pin check and a layer's remove
        return real_remove(key, force)

    def delete_racing_a_pin(keys):
        race_a_pin()                    # or while the delete runs
        return real_delete(keys)
    e.plugin.remove = remove_racing_a_pin
    store.delete = delete_racing_a_pin
    try:
        removed = real_remove(chunk, force=False)
    finally:
        e.plugin.remove = real_remove
        store.delete = real_delete
    racing[0].join(30)
    assert pinned, "the pin never ended"
    stored = [store.contains(e.plugin.kvblock_key(k)) for k in layers]
    try:
        assert stored == [pinned[0]] * LAYERS, f"layers stored {stored}, pinned {pinned}"
        assert removed is not pinned[0]
        assert e.plugin.contains(layers[0]) is pinned[0]
    finally:
        if pinned[0]:
            e.plugin.unpin(layers[-1])
