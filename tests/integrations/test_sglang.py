"""kvblock as SGLang's HiCache L3 backend, driven the way SGLang 0.5.23 drives it.

The backend is created by SGLang's own ``StorageBackendFactory`` from a real
``HiCacheStorageConfig`` (``--hicache-storage-backend dynamic``), then given
the host pool with ``register_mem_pool_host`` and called with SGLang's page
keys and host token indices (``batch_set_v1``/``batch_get_v1``/``batch_exists``
as ``HiCacheController`` calls them).

The host pools here are ``tests.integrations.sglang_pools.HostPool``: the
``kv_buffer`` of ``MHATokenToKVPoolHost``/``MLATokenToKVPoolHost`` with
their exact shapes, because SGLang's pool module cannot be imported beside
the CPU build of torch (it pulls in torchvision; see sglang_pools.py).
``test_real_host_pools`` runs ``sglang_real_pool_check.py`` in a child
process, where the real pool classes are built, their shapes compared with
these and the backend driven through them (flat-page calls included).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage import StorageBackendFactory

from kvblock.errors import ConfigError, GeometryMismatchError, NotAStoreError
from kvblock.integrations.sglang import KVBlockHiCacheStorage
from kvblock.store import KVStore
from tests.integrations.sglang_pools import HostPool
from tests.support.servers import stop_server, wait_reconnected

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUTS = ("page_first", "page_first_direct", "layer_first")


def storage_config(devices, *, model="org/model-a", mla=False, tp_rank=0, tp_size=1,
                   metrics=False, **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
        is_page_first_layout=True, model_name=model,
        extra_config={"backend_name": "kvblock", "module_path": "kvblock.integrations.sglang",
                      "class_name": "KVBlockHiCacheStorage", "interface_v1": 1,
                      "devices": devices, **extra})


def attach(pool, devices, **kw) -> KVBlockHiCacheStorage:
    """HiCacheController.attach_storage_backend, storage part."""
    config = storage_config(devices, mla=hasattr(pool, "kv_cache_dim"), **kw)
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def keys_for(prefix, n):
    # SGLang's keys are SHA-256 hex strings; any string works the same
    return [f"{prefix}{i:060d}" for i in range(n)]


def test_dynamic_loader_builds_a_hicache_storage(file_target, backends):
    pool = HostPool()
    backend = attach(pool, [file_target()])
    backends.append(backend)
    assert isinstance(backend, HiCacheStorage) and isinstance(backend, KVBlockHiCacheStorage)
    g = backend.store.geometry
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.dtype, g.block_tokens, g.kv_parts) == \
        (3, 2, 16, "bfloat16", 4, 2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("wide", [False, True], ids=["rows64", "rows512"])
def test_round_trip_bytes_identical(store_target, backends, monkeypatch, mla, layout, wide):
    """Runs come back with one native copy per run (kvblock.tensors.pagecopy),
    except page_first pools with short token rows (2 heads x 16 dims: 64
    bytes between layers), which go through numpy's indexing."""
    from kvblock.integrations import sglang as backend_mod

    native = []
    real = backend_mod.copy_pages
    monkeypatch.setattr(backend_mod, "copy_pages",
                        lambda *a, **k: native.append(real(*a, **k)) or native[-1])
    head_dim = (256 if mla else 128) if wide else (32 if mla else 16)
    pool = HostPool(mla=mla, layout=layout, head_dim=head_dim)
    backend = attach(pool, [store_target()])
    backends.append(backend)
    keys = keys_for("a", 6)
    src_pages = [3, 7, 8, 9, 15, 0]                     # scattered, like a reused pool
    before = [pool.page_bytes(p) for p in src_pages]
    assert backend.batch_set_v1(keys, pool.token_indices(src_pages)) == [True] * 6
    assert backend.batch_exists(keys) == 6
    pool.randomize(99)
    dst_pages = [20, 21, 1, 2, 11, 5]
    assert backend.batch_get_v1(keys, pool.token_indices(dst_pages)) == [True] * 6
    for p, want in zip(dst_pages, before):
        assert torch.equal(pool.page_bytes(p), want)
    assert native and all(native) == (wide or layout != "page_first")
    if not mla:
        assert backend.store.geometry.kv_parts == 2
    else:
        assert (backend.store.geometry.kv_parts, backend.store.geometry.num_kv_heads) == (1, 1)


def test_batch_exists_is_the_stored_prefix(file_target, backends):
    pool = HostPool()
    backend = attach(pool, [file_target()])
    backends.append(backend)
    keys = keys_for("p", 8)
    stored = keys[:3] + keys[4:6]                       # a hole at 3
    assert all(backend.batch_set_v1(stored, pool.token_indices([0, 1, 2, 4, 5])))
    assert backend.batch_exists(keys) == 3
    assert backend.batch_exists(keys[4:]) == 2
    assert backend.batch_exists(keys[3:]) == 0
    assert backend.batch_exists([]) == 0
    assert backend.exists(keys[0]) and not backend.exists(keys[3])


def test_missing_keys_load_the_prefix_only(file_target, backends):
    pool = HostPool()
    backend = attach(pool, [file_target()])
    backends.append(backend)
    keys = keys_for("m", 4)
    want = [pool.page_bytes(p) for p in (0, 1)]
    assert all(backend.batch_set_v1(keys[:2] + keys[3:], pool.token_indices([0, 1, 3])))
    untouched = pool.page_bytes(12)
    got = backend.batch_get_v1(keys, pool.token_indices([10, 11, 12, 13]))
    assert got == [True, True, False, False]
    assert torch.equal(pool.page_bytes(10), want[0]) and torch.equal(pool.page_bytes(11), want[1])
    assert torch.equal(pool.page_bytes(12), untouched)
    assert backend.batch_get_v1(["nowhere"], pool.token_indices([5])) == [False]
    assert backend.get("nowhere") is None
    assert backend.batch_get(["nowhere", keys[0]]) == [None, None]   # prefix semantics


def test_two_models_never_share_blocks(file_target, backends):
    path = file_target()
    pool = HostPool()
    a = attach(pool, [path], model="org/model-a")
    keys = keys_for("k", 3)
    assert all(a.batch_set_v1(keys, pool.token_indices([0, 1, 2])))
    a.close()
    # the device is fingerprinted with its model: another model is refused ...
    with pytest.raises(GeometryMismatchError):
        attach(pool, [path], model="org/model-b")
    # ... and keys carry the model too, should two stores ever be merged
    cfg_a, cfg_b = storage_config([path], model="org/model-a"), storage_config(
        [path], model="org/model-b")
    assert KVBlockHiCacheStorage(cfg_a, {}).kvblock_key(keys[0]) != \
        KVBlockHiCacheStorage(cfg_b, {}).kvblock_key(keys[0])
    a = attach(pool, [path], model="org/model-a")
    backends.append(a)
    assert a.batch_exists(keys) == 3


def test_tenants_and_ranks_get_their_own_keys(file_target, backends):
    path = file_target()
    pool = HostPool()
    tenant_a = attach(pool, [path], namespace="tenant-a")
    keys = keys_for("t", 2)
    assert all(tenant_a.batch_set_v1(keys, pool.token_indices([0, 1])))
    tenant_a.close()
    tenant_b = attach(pool, [path], namespace="tenant-b")
    backends.append(tenant_b)
    assert tenant_b.batch_exists(keys) == 0
    assert tenant_b.batch_get_v1(keys, pool.token_indices([2, 3])) == [False, False]
    key = keys[0]
    mha = [KVBlockHiCacheStorage(storage_config([path], tp_rank=r, tp_size=2), {})
           for r in (0, 1)]
    mla = [KVBlockHiCacheStorage(storage_config([path], tp_rank=r, tp_size=2, mla=True,
                                                server=str(path) + ".sock"), {})
           for r in (0, 1)]
    assert mha[0].kvblock_key(key) != mha[1].kvblock_key(key)      # each rank: its heads
    assert mla[0].kvblock_key(key) == mla[1].kvblock_key(key)      # MLA: replicated pages
    # Mamba state is TP-sharded even beside MLA KV; other extra pools follow the KV
    from sglang.srt.mem_cache.hicache_storage import PoolName
    def pool_keys(b, name):
        return b._pool_keys(name, [key], 2, b"page-format")
    assert pool_keys(mla[0], PoolName.MAMBA) != pool_keys(mla[1], PoolName.MAMBA)
    assert pool_keys(mla[0], PoolName.SWA) == pool_keys(mla[1], PoolName.SWA)
    assert pool_keys(mha[0], PoolName.SWA) != pool_keys(mha[1], PoolName.SWA)


def test_geometry_comes_from_the_pool_and_is_checked(file_target, backends):
    path = file_target()
    backends.append(attach(HostPool(layers=3), [path]))
    backends.pop().close()
    with pytest.raises(GeometryMismatchError):
        attach(HostPool(layers=4), [path])
    with pytest.raises(GeometryMismatchError):
        attach(HostPool(dtype=torch.float16), [path])
    # a store written from a page_first pool serves a page_first_direct one
    pool = HostPool(layout="page_first_direct")
    backend = attach(pool, [path], format="never")
    backends.append(backend)
    assert backend.store.geometry.num_layers == 3


def test_format_modes_and_file_creation(file_target, tmp_path, backends):
    pool = HostPool()
    with pytest.raises(NotAStoreError):
        attach(pool, [file_target()], format="never")
    created = str(tmp_path / "new" / "kv.img")
    backend = attach(pool, [created], size="32M")
    assert os.path.getsize(created) == 32 << 20
    keys = keys_for("f", 2)
    assert all(backend.batch_set_v1(keys, pool.token_indices([0, 1])))
    backend.close()
    backend = attach(pool, [created], format="force")          # a fresh store every start
    backends.append(backend)
    assert backend.batch_exists(keys) == 0
    with pytest.raises(ConfigError):
        KVBlockHiCacheStorage(storage_config([created], format="sometimes"), {})
    with pytest.raises(ConfigError):
        KVBlockHiCacheStorage(storage_config(None), {})


def test_per_rank_device_templates(tmp_path):
    tmpl = str(tmp_path / "kv-{tp_rank}-of-{tp_size}.img")
    b = KVBlockHiCacheStorage(storage_config([tmpl], tp_rank=1, tp_size=2), {})
    assert b.devices == [str(tmp_path / "kv-1-of-2.img")]
    b = KVBlockHiCacheStorage(storage_config({"0": ["/a"], "1": ["/b", "/c"]}, tp_rank=1,
                                             tp_size=2), {})
    assert b.devices == ["/b", "/c"]


def test_ranks_given_the_same_devices_are_told_how_to_split_them(file_target, backends):
    """A "devices" dict is keyed by TP rank only: two pipeline stages with
    the same TP rank get the same devices, and the second stage's exclusive
    open fails.  Its DeviceBusyError names the ranks and the way out
    ({pp_rank} in the paths, or a server), not "stop the other process";
    {pp_rank} in the dict's paths gives each stage its own store."""
    import dataclasses

    from kvblock.errors import DeviceBusyError

    shared = file_target()

    def stage(pp_rank, devices):
        config = dataclasses.replace(storage_config(devices, size="64M"), pp_rank=pp_rank,
                                     pp_size=2)
        backend = KVBlockHiCacheStorage(config, {})
        backend.register_mem_pool_host(HostPool())
        backends.append(backend)
        return backend

    stage(0, {"0": [shared]})
    with pytest.raises(DeviceBusyError, match=r"pp_size 2.*\{pp_rank\}.*\"server\""):
        stage(1, {"0": [shared]})
    split = str(os.path.join(os.path.dirname(shared), "kv-pp{pp_rank}.img"))
    assert [stage(pp, {"0": [split]}).devices for pp in (0, 1)] == \
        [[split.format(pp_rank=pp)] for pp in (0, 1)]


def test_survives_a_restart(store_target, backends):
    path = store_target()
    pool = HostPool(mla=True, layout="page_first")
    backend = attach(pool, [path])
    keys = keys_for("r", 5)
    want = [pool.page_bytes(p) for p in range(5)]
    assert all(backend.batch_set_v1(keys, pool.token_indices(range(5))))
    backend.close()
    fresh = HostPool(mla=True, layout="page_first", seed=5)
    backend = attach(fresh, [path], format="never")
    backends.append(backend)
    assert backend.batch_exists(keys) == 5
    assert backend.batch_get_v1(keys, fresh.token_indices(range(10, 15))) == [True] * 5
    assert all(torch.equal(fresh.page_bytes(10 + i), want[i]) for i in range(5))


def test_runs_are_cut_and_stored_pages_not_rewritten(file_target, backends):
    pool = HostPool(pages=40)
    block = 3 * 2 * 4 * 2 * 16 * 2                                  # bytes per page
    backend = attach(pool, [file_target()], max_run_bytes=4 * block)  # 4 pages per run
    backends.append(backend)
    keys = keys_for("c", 10)
    assert all(backend.batch_set_v1(keys[:3], pool.token_indices(range(3))))
    want = [pool.page_bytes(p) for p in range(10)]
    assert all(backend.batch_set_v1(keys, pool.token_indices(range(10))))
    stats = backend.stats()
    assert stats["put_blocks"] == 10 and stats["runs"] == 1 + 2   # 3, then 7 as 4 + 3
    # skipping stored pages is not a lookup: the hit counters stay the engine's
    assert stats["lookups"] == 0 and stats["lookup_hit_blocks"] == 0
    assert backend.batch_get_v1(keys, pool.token_indices(range(20, 30))) == [True] * 10
    assert all(torch.equal(pool.page_bytes(20 + i), want[i]) for i in range(10))


@pytest.mark.parametrize("call", ["v1", "flat", "v2"])
def test_a_run_longer_than_the_store_holds_is_cut_to_fit(file_target, backends, call):
    """max_run_bytes beyond what the store holds at once (a small store, or
    the setting raised): the store refuses such a run whole (StoreFullError:
    its pieces would evict one another), so every backup of that many pages
    failed, call after call.  Runs are cut to what one region holds: the
    backup is stored, its latest pages evicting the store's oldest."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    pool = HostPool(head_dim=1024, page_size=64, pages=24)     # 1.5 MiB pages
    backend = attach(pool, [file_target(32 << 20)])             # 64M runs by default
    backends.append(backend)
    keys = keys_for("big", 20)                                  # more than it holds at once
    if call == "v2":
        states = StatePool(slots=20, state_bytes=3 << 20)       # 2 blocks a page
        backend.register_mem_host_pool_v2(states, PoolName.INDEXER)
        want = states.buf.clone()
        out = backend.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                                 host_indices=torch.arange(20))])
        assert out == {"indexer": [True] * 20}
        states.buf.zero_()
        tail = [PoolTransfer(name=PoolName.INDEXER, keys=keys[-2:],
                             host_indices=torch.arange(18, 20))]
        assert backend.batch_get_v2(tail) == {"indexer": [True, True]}
        assert torch.equal(states.buf[18:], want[18:])
        return
    want = [pool.page_bytes(p) for p in range(17, 20)]
    if call == "v1":
        assert backend.batch_set_v1(keys, pool.token_indices(range(20))) == [True] * 20
    else:
        pages = [pool.page_bytes(p).view(pool.dtype).reshape(-1) for p in range(20)]
        assert backend.batch_set(keys, pages) is True
    # the latest pages are stored (the earliest made room for them)
    assert backend.batch_exists(keys[-3:]) == 3
    pool.randomize(1)
    assert backend.batch_get_v1(keys[-3:], pool.token_indices([21, 22, 23])) == [True] * 3
    assert all(torch.equal(pool.page_bytes(21 + i), want[i]) for i in range(3))


def test_clear_and_metrics(file_target, backends):
    pool = HostPool()
    backend = attach(pool, [file_target()])
    backends.append(backend)
    keys = keys_for("x", 4)
    assert all(backend.batch_set_v1(keys, pool.token_indices(range(4))))
    assert backend.get_stats() is None                 # storage metrics off
    assert backend.clear() is True
    assert backend.batch_exists(keys) == 0


def test_bad_calls_fail_softly_and_bad_pools_loudly(file_target, backends):
    pool = HostPool()
    backend = attach(pool, [file_target()])
    backends.append(backend)
    keys = keys_for("b", 2)
    assert backend.batch_set_v1(keys, torch.arange(1, 9)) == [False, False]   # not page-aligned
    assert backend.batch_set_v1(keys, torch.arange(0, 4)) == [False, False]   # too few indices
    gappy = torch.tensor([0, 1, 2, 3, 4, 6, 5, 7])                            # not whole pages
    assert backend.batch_set_v1(keys, gappy) == [False, False]
    assert backend.batch_set_v1(keys, torch.arange(-4, 4)) == [False, False]  # negative
    assert backend.store.lookup([backend.kvblock_key(k) for k in keys]) == 0  # nothing written
    assert backend.batch_set_v1([], torch.arange(0)) == []
    odd = HostPool()
    odd.layout = "page_head"
    with pytest.raises(ConfigError):
        attach(odd, [file_target()])
    unborn = KVBlockHiCacheStorage(storage_config([file_target()]), {})
    assert unborn.batch_exists(keys) == 0 and unborn.batch_get_v1(keys, torch.arange(8)) == \
        [False, False]


def test_store_is_a_plain_kvblock_store(file_target):
    path = file_target()
    pool = HostPool()
    backend = attach(pool, [path])
    backend.batch_set_v1(keys_for("s", 2), pool.token_indices([0, 1]))
    backend.close()
    with KVStore.open([path], readonly=True) as store:   # `kvblock info/fsck` can read it
        assert store.stats()["blocks"] == 2


def test_real_host_pools(tmp_path):
    """SGLang's own MHA/MLA host pools (page_first and page_first_direct): shapes
    as assumed here, v1 and flat-page round trips, a store read back through a
    pool of the other layout, get_stats(); page_unified pools (MLA and MHA,
    v1 calls: they have no flat pages); and the hybrid *_v2 calls over an
    MHA pool with SGLang's MambaPoolHost and a sliding-window KV pool beside
    it (child process: see its docstring)."""
    res = subprocess.run([sys.executable, "-m", "tests.integrations.sglang_real_pool_check",
                          str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=240,
                         check=False)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["ok"] and len(summary["cases"]) == 7
    assert {"mla-page_unified", "mha-page_unified"} <= set(summary["cases"])
    assert "scales outside kv_buffer" in summary["refused"]["mxfp8"]
    assert summary["cases"]["hybrid"]["state_pages"] == summary["cases"]["hybrid"]["swa_pages"] == 2


def test_clear_forgets_the_dram_tier_too(file_target, backends):
    """SGLang clears storage after a weight update; its page keys stay the
    same, so blocks kept in the DRAM tier (host_cache_bytes) would come
    back as hits of the old weights' KV."""
    pool = HostPool()
    backend = attach(pool, [file_target()], host_cache_bytes="8M")
    backends.append(backend)
    keys = keys_for("c", 4)
    assert backend.batch_set_v1(keys, pool.token_indices(range(4))) == [True] * 4
    assert backend.clear() is True
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, pool.token_indices(range(4, 8))) == [False] * 4


def _close_ranks(ranks) -> None:
    """Close the ranks' backends, then stop the server the first one started."""
    server = ranks[0].store if ranks else None
    for b in ranks:
        b.close()
    if server is not None:
        stop_server(server.server_pid)


def test_mla_ranks_share_one_store_through_a_server(tmp_path):
    """MLA, tp_size 2: rank 0 writes (as SGLang does), rank 1 reads what it
    wrote, from one store on one device; the first rank formats the device
    and starts the server, the second connects to it."""
    dev, sock = str(tmp_path / "kv.img"), str(tmp_path / "kv.sock")
    pools = [HostPool(mla=True, head_dim=32, seed=r) for r in range(2)]
    ranks = []
    try:
        for r in range(2):
            ranks.append(attach(pools[r], [dev], tp_rank=r, tp_size=2, server=sock,
                                size="32M"))
        assert ranks[0].store.server_pid == ranks[1].store.server_pid
        keys = keys_for("mla", 5)
        want = [pools[0].page_bytes(p) for p in range(5)]
        assert ranks[0].batch_set_v1(keys, pools[0].token_indices(range(5))) == [True] * 5
        assert ranks[1].batch_exists(keys) == 5
        assert ranks[1].batch_get_v1(keys, pools[1].token_indices([9, 8, 7, 6, 5])) == [True] * 5
        for p, w in zip([9, 8, 7, 6, 5], want):
            assert torch.equal(pools[1].page_bytes(p), w)
        # another model on the same server is refused, not served foreign KV
        with pytest.raises(GeometryMismatchError, match="another model"):
            attach(HostPool(mla=True, head_dim=32), [dev], model="org/model-b", server=sock)
        # and a pool of another geometry too
        with pytest.raises(GeometryMismatchError, match="this process needs"):
            attach(HostPool(mla=True, head_dim=64), [dev], tp_rank=1, tp_size=2, server=sock)
        with pytest.raises(ConfigError, match="host_cache_bytes"):
            attach(HostPool(mla=True, head_dim=32), [dev], server=sock, host_cache_bytes="1M")

        # Mamba state is TP-sharded beside MLA KV: SGLang has every rank back
        # up its own shard, so each rank must get its own back, not rank 0's
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
        mamba = [StatePool(seed=10 + r) for r in range(2)]
        for r in range(2):
            ranks[r].register_mem_host_pool_v2(mamba[r], PoolName.MAMBA)
        want_state = [m.buf[0].clone() for m in mamba]
        for r in range(2):
            assert ranks[r].batch_set_v2([PoolTransfer(
                name=PoolName.MAMBA, keys=keys[:1], host_indices=torch.tensor([0]))]) == \
                {"mamba": [True]}
        for r in range(2):
            assert ranks[r].batch_get_v2([PoolTransfer(
                name=PoolName.MAMBA, keys=keys[:1], host_indices=torch.tensor([3]))]) == \
                {"mamba": [True]}
            assert torch.equal(mamba[r].buf[3], want_state[r])
        state_blocks = ranks[0]._page_blocks(mamba[0])[1]

        # The server dies: every call answers as a miss, at once, and nothing
        # raises into SGLang; the ranks reconnect (one restarts the server)
        # and find what was stored before.
        pid = ranks[0].store.server_pid
        os.kill(pid, signal.SIGKILL)
        later = keys_for("mla-later", 2)
        t0 = time.monotonic()
        assert ranks[1].batch_exists(keys) == 0 and not ranks[1].exists(keys[0])
        assert ranks[0].batch_set_v1(later, pools[0].token_indices([5, 6])) == [False] * 2
        assert ranks[1].batch_get_v1(keys, pools[1].token_indices(range(5))) == [False] * 5
        assert ranks[1].batch_get(keys[:2]) == [None, None]
        assert ranks[1].batch_exists_v2(keys).kv_hit_pages == 0
        assert ranks[1].stats()["store_failures"] >= 4 and "store_error" in ranks[1].stats()
        assert time.monotonic() - t0 < 5
        wait_reconnected([r.store for r in ranks], pid)
        assert ranks[1].batch_exists(keys) == 5
        assert ranks[1].batch_get_v1(keys, pools[1].token_indices([4, 3, 2, 1, 0])) == [True] * 5
        for p, w in zip([4, 3, 2, 1, 0], want):
            assert torch.equal(pools[1].page_bytes(p), w)
    finally:
        _close_ranks(ranks)
    # the server checkpointed on SIGTERM: the store opens and holds rank 0's
    # pages and each rank's state page
    with KVStore.open([dev]) as store:
        assert len(store.index) == 5 + 2 * state_blocks


@pytest.mark.parametrize("mla", [True, False], ids=["mla", "mha"])
def test_mla_pages_outlive_a_restart_at_another_tp_size(tmp_path, mla):
    """MLA pages are the same on every TP rank at any TP size (the latent KV
    is replicated, not sharded; SGLang's HiCacheFile keys them without TP
    rank and size).  Keyed with tp_size, SGLang restarted at another TP
    size missed every page stored.  Now the MLA key leaves tp_size out: a
    store written at tp_size 2 is read at tp_size 4, byte for byte.  MHA
    pages hold a rank's own heads, which depend on the TP size: a miss."""
    dev, sock = str(tmp_path / "kv.img"), str(tmp_path / "kv.sock")
    keys = keys_for("tp", 4)

    def ranks_at(tp_size, seed):
        pools, ranks = [], []
        for r in (0, tp_size - 1):
            pools.append(HostPool(mla=mla, head_dim=32, seed=seed + r))
            ranks.append(attach(pools[-1], [dev], tp_rank=r, tp_size=tp_size, server=sock,
                                size="32M"))
        return pools, ranks

    pools, ranks = ranks_at(2, 0)
    try:
        want = [pools[0].page_bytes(p) for p in range(4)]
        assert ranks[0].batch_set_v1(keys, pools[0].token_indices(range(4))) == [True] * 4
    finally:
        _close_ranks(ranks)
    pools, ranks = ranks_at(4, 10)
    try:
        for pool, rank in zip(pools, ranks):
            if not mla:
                assert rank.batch_exists(keys) == 0
                continue
            assert rank.batch_exists(keys) == 4
            assert rank.batch_get_v1(keys, pool.token_indices([7, 6, 5, 4])) == [True] * 4
            for p, w in zip([7, 6, 5, 4], want):
                assert torch.equal(pool.page_bytes(p), w)
    finally:
        _close_ranks(ranks)


def test_a_clear_by_another_rank_stops_a_backup_between_its_runs(tmp_path):
    """Shared store: rank 1 clears (after a weight update) while rank 0's
    backup is between two runs.  The backup's later runs hold KV of the old
    weights: none may be stored (they were: rank 0 counted only its own
    clear() calls, and the pages read back as hits after the clear)."""
    dev, sock = str(tmp_path / "kv.img"), str(tmp_path / "kv.sock")
    block = 3 * 4 * 32 * 2                      # layers x page x MLA dim x bf16
    pools = [HostPool(mla=True, head_dim=32, pages=40, seed=r) for r in range(2)]
    ranks = []
    try:
        for r in range(2):
            ranks.append(attach(pools[r], [dev], tp_rank=r, tp_size=2, server=sock,
                                size="32M", max_run_bytes=4 * block))  # 4 pages per run
        real, calls = ranks[0].store.put_run, []

        def put_run(run_keys, data):
            n = real(run_keys, data)
            calls.append(len(run_keys))
            if len(calls) == 1:
                assert ranks[1].clear() is True         # the other rank, between two runs
            return n

        ranks[0].store.put_run = put_run
        keys = keys_for("other-clear", 10)
        assert ranks[0].batch_set_v1(keys, pools[0].token_indices(range(10))) == [False] * 10
        assert calls == [4]                                 # no run after the clear
        assert ranks[1].batch_exists(keys) == 0 and ranks[0].batch_exists(keys) == 0
        ranks[0].store.put_run = real
        assert ranks[0].batch_set_v1(keys, pools[0].token_indices(range(10))) == [True] * 10
        assert ranks[1].batch_exists(keys) == 10            # a backup after it is stored
    finally:
        _close_ranks(ranks)


def test_a_server_restart_during_a_backup_reports_the_pages_not_stored(tmp_path):
    """The store server restarts (and the rank reconnects) between two runs
    of one backup.  The new server's clear ticket matches none of the old
    one's (a clear may have come there), so the backup stops and drops the
    run it wrote after the restart -- but it answered every page True, as
    for a clear, though the restart is a store failure and the pages after
    the first run are not in storage.  Answered False (as for any store
    failure part way), SGLang stops the operation's later batches too."""
    dev, sock = str(tmp_path / "kv.img"), str(tmp_path / "kv.sock")
    block = 3 * 4 * 32 * 2                      # layers x page x MLA dim x bf16
    pool = HostPool(mla=True, head_dim=32, pages=40)
    ranks = []
    try:
        ranks.append(attach(pool, [dev], server=sock, size="32M",
                            max_run_bytes=4 * block))      # 4 pages per run
        store = ranks[0].store
        real, calls = store.put_run, []

        def put_run(run_keys, data):
            calls.append(len(run_keys))
            if len(calls) == 2:                 # the server restarts between two runs
                pid = store.server_pid
                stop_server(pid)
                wait_reconnected([store], pid)
            return real(run_keys, data)

        store.put_run = put_run
        keys = keys_for("restart", 10)
        answer = ranks[0].batch_set_v1(keys, pool.token_indices(range(10)))
        store.put_run = real
        assert calls == [4, 4]                              # no run after the restart
        stored = ranks[0].batch_exists(keys)
        assert stored == 4                                  # the run before it stays
        assert answer == [True] * 4 + [False] * 6
        assert ranks[0].stats()["store_failures"] >= 1
        # a backup after it is stored whole
        assert ranks[0].batch_set_v1(keys, pool.token_indices(range(10))) == [True] * 10
        assert ranks[0].batch_exists(keys) == 10

        # an extra pool's backup (one page per run here) alike
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
        ranks[0].register_mem_host_pool_v2(StatePool(), PoolName.MAMBA)
        real, calls = store.put_blocks, []

        def put_blocks(block_keys, blocks):
            calls.append(1)
            if len(calls) == 2:
                pid = store.server_pid
                stop_server(pid)
                wait_reconnected([store], pid)
            return real(block_keys, blocks)

        store.put_blocks = put_blocks
        transfer = PoolTransfer(name=PoolName.MAMBA, keys=keys[:3],
                                host_indices=torch.tensor([0, 1, 2]))
        answer = ranks[0].batch_set_v2([transfer])
        store.put_blocks = real
        assert len(calls) == 2
        assert answer == {"mamba": [True, False, False]}
        assert ranks[0]._pool_present(PoolName.MAMBA, keys[:3]).tolist() == \
            [True, False, False]
    finally:
        _close_ranks(ranks)


def test_mla_ranks_without_a_server_are_refused(file_target):
    """SGLang writes MLA pages from one rank only: ranks with stores of their
    own would never hit (and SGLang takes the smallest hit of all ranks)."""
    pool = HostPool(mla=True, head_dim=32)
    with pytest.raises(ConfigError, match='needs one store for every rank.*"server"'):
        attach(pool, [file_target()], tp_rank=1, tp_size=2)
    backend = attach(pool, [file_target()], tp_rank=0, tp_size=1)   # one rank: fine
    backend.close()


class StatePool:
    """An extra host pool of a hybrid model (Mamba state, SWA...), reduced to
    the flat-page interface SGLang's storage path uses: one state slot per
    page (page_size 1), ``get_data_page(i, flat=True)`` /
    ``get_dummy_flat_data_page()`` / ``set_from_flat_data_page(i, data)``."""

    page_size = 1

    def __init__(self, slots=8, state_bytes=12000, seed=0):   # not a multiple of a block
        g = torch.Generator().manual_seed(seed)
        self.buf = torch.randint(-2**15, 2**15 - 1, (slots, state_bytes // 2),
                                 dtype=torch.int16, generator=g)

    def get_data_page(self, index, flat=True):
        return self.buf[index].flatten()

    def get_dummy_flat_data_page(self):
        return torch.zeros(self.buf.shape[1], dtype=self.buf.dtype)

    def set_from_flat_data_page(self, index, data):
        self.buf[index] = data.reshape(self.buf.shape[1:])


class MHADraftPool(StatePool):
    """An MHA draft model's host pool beside an MLA main model (PoolName.DRAFT,
    SGLang's MHATokenToKVPoolHost: ``head_num``, no ``kv_cache_dim``): each
    TP rank holds its own heads of the draft's KV."""

    head_num, head_dim = 2, 16


def test_an_mha_draft_pool_beside_mla_is_not_served_another_ranks_heads(tmp_path, caplog):
    """MLA main model at tp_size 2 with an MHA draft pool: SGLang 0.5.23 backs
    the draft pool up from rank 0 only (HybridCacheController.should_backup:
    rank-specific draft keys are Mooncake's alone), and every rank loads it.
    The draft's KV is TP-sharded (each rank its own heads), so rank 1 must
    miss, not load rank 0's heads as its own (it did: extra pools other than
    Mamba were keyed without the TP rank beside MLA KV).  As SGLang takes
    the smallest hit of all ranks, such a deployment gets no L3 hit at all:
    each rank says so when the draft pool is registered (it was silent: an
    L3 that never hit, no reason given)."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    dev, sock = str(tmp_path / "kv.img"), str(tmp_path / "kv.sock")
    pools = [HostPool(mla=True, head_dim=32, seed=r) for r in range(2)]
    drafts = [MHADraftPool(seed=20 + r) for r in range(2)]
    ranks = []
    try:
        for r in range(2):
            ranks.append(attach(pools[r], [dev], tp_rank=r, tp_size=2, server=sock,
                                size="32M"))
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="kvblock.integrations.sglang"):
                ranks[r].register_mem_host_pool_v2(drafts[r], PoolName.DRAFT)
            said = [m.getMessage() for m in caplog.records
                    if "MHA draft pool 'draft'" in m.getMessage()]
            assert len(said) == 1 and "no L3 hit" in said[0] and "tp_size 2" in said[0], \
                caplog.text
        keys = keys_for("draft", 2)
        want0 = drafts[0].buf[0].clone()
        assert ranks[0].batch_set_v1(keys, pools[0].token_indices([0, 1])) == [True] * 2
        assert ranks[0].batch_set_v2([PoolTransfer(
            name=PoolName.DRAFT, keys=keys, host_indices=torch.tensor([0, 1]))]) == \
            {"draft": [True, True]}
        exists = [ranks[r].batch_exists_v2(keys, [PoolTransfer(
            name=PoolName.DRAFT, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)])
            for r in range(2)]
        assert exists[0].kv_hit_pages == 2
        assert exists[1].kv_hit_pages == 0             # rank 1's heads were never stored
        before = drafts[1].buf[5].clone()
        assert ranks[1].batch_get_v2([PoolTransfer(
            name=PoolName.DRAFT, keys=keys[:1], host_indices=torch.tensor([5]))]) == \
            {"draft": [False]}
        assert torch.equal(drafts[1].buf[5], before)   # not rank 0's heads
        assert ranks[0].batch_get_v2([PoolTransfer(
            name=PoolName.DRAFT, keys=keys[:1], host_indices=torch.tensor([6]))]) == \
            {"draft": [True]}
        assert torch.equal(drafts[0].buf[6], want0)
    finally:
        _close_ranks(ranks)


def test_hybrid_v2_calls_store_kv_and_state_pools(store_target, backends):
    """The *_v2 calls of SGLang's hybrid controller: KV pages through the v1
    path, an extra state pool's pages as opaque bytes; batch_exists_v2 cuts
    the prefix by each pool's hit policy; bytes come back identical."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    pool = HostPool(pages=24)
    backend = attach(pool, [store_target()])
    backends.append(backend)
    states = StatePool(seed=1)
    backend.register_mem_host_pool_v2(states, PoolName.MAMBA)
    keys = keys_for("h", 5)
    kv_pages = [3, 4, 5, 6, 7]
    want_kv = [pool.page_bytes(p) for p in kv_pages]
    want_state = states.buf[[6, 7]].clone()
    # state kept for the last two pages only (a Mamba-style trailing window)
    res = backend.batch_set_v2([
        PoolTransfer(name=PoolName.KV, keys=keys, host_indices=pool.token_indices(kv_pages)),
        PoolTransfer(name=PoolName.MAMBA, keys=keys[3:], host_indices=torch.tensor([6, 7]))])
    assert res == {"kv": [True] * 5, "mamba": [True, True]}
    # a pool never registered: that transfer fails, as an error of the setup
    # (logged each time), not as a store failure answered as a miss
    assert backend.batch_set_v2([PoolTransfer(
        name=PoolName.SWA, keys=keys[:1], host_indices=torch.tensor([0]))]) == {"swa": [False]}
    assert backend.stats()["store_failures"] == 0

    def exists(policy, trailing_keys):
        return backend.batch_exists_v2(keys, [PoolTransfer(
            name=PoolName.MAMBA, keys=trailing_keys, hit_policy=policy)])
    r = exists(PoolHitPolicy.TRAILING_PAGES, keys[3:])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (5, {"kv": 5, "mamba": 5})
    assert r.restorable_prefix_pages == [5]             # the only prefix whose last 2 states exist
    r = exists(PoolHitPolicy.ALL_PAGES, keys)
    assert r.kv_hit_pages == 0 and r.extra_pool_hit_pages == {"kv": 5}   # page 0 has no state
    assert backend.batch_exists_v2(keys).kv_hit_pages == 5               # KV alone

    # BLOCK_GROUPS: groups of 2 pool keys, each covering 2 KV pages; the pool's
    # own hit is what its leading complete groups cover, the KV hit is not cut
    def groups(group_keys, group_pages=2, block_pages=2):
        return backend.batch_exists_v2(keys, [PoolTransfer(
            name=PoolName.MAMBA, keys=group_keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS,
            group_pages=group_pages, block_pages=block_pages)])
    r = groups(keys[3:])                              # one whole group, both stored
    assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (5, {"kv": 5, "mamba": 2})
    assert r.restorable_prefix_pages == [1, 2, 3, 4, 5]
    r = groups(keys[3:] + keys[3:], block_pages=4)     # two groups: 8 pages, capped at the KV's 5
    assert r.extra_pool_hit_pages == {"kv": 5, "mamba": 5}
    r = groups(keys[2:4] + keys[3:])                   # first group lacks page 2's state
    assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (5, {"kv": 5})
    assert groups(keys[3:4]).extra_pool_hit_pages == {"kv": 5}   # no complete group
    assert groups(keys[3:], group_pages=0).extra_pool_hit_pages == {"kv": 5}  # no geometry

    pool.randomize(7)
    fresh = StatePool(seed=2)
    backend.registered_pools[PoolName.MAMBA] = fresh
    out = backend.batch_get_v2([
        PoolTransfer(name=PoolName.KV, keys=keys, host_indices=pool.token_indices(range(10, 15))),
        PoolTransfer(name=PoolName.MAMBA, keys=keys[3:], host_indices=torch.tensor([0, 1]))])
    assert out == {"kv": [True] * 5, "mamba": [True, True]}
    assert all(torch.equal(pool.page_bytes(10 + i), want_kv[i]) for i in range(5))
    assert torch.equal(fresh.buf[[0, 1]], want_state)
    # a state page never stored: a miss for that pool, nothing else touched
    out = backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys[:1],
                                             host_indices=torch.tensor([2]))])
    assert out == {"mamba": [False]}
    # storing again writes nothing new; a pool nobody registered is an error, softly
    before = backend.stats()["put_blocks"]
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys[3:],
                                              host_indices=torch.tensor([0, 1]))]) == \
        {"mamba": [True, True]}
    assert backend.stats()["put_blocks"] == before
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, keys=keys[:1],
                                              host_indices=torch.tensor([0]))]) == \
        {"swa": [False]}


def test_hybrid_state_pages_read_back_in_any_grouping(store_target, backends):
    """An extra pool's page is its own blocks: pages stored in one call load
    alone, as a trailing window, or beside pages stored by another call, the
    way SGLang's hybrid controller regroups them (windows, prefetch batches,
    backups that write only the new pages)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    pool = HostPool(pages=24)                  # several layers: a run spans them
    backend = attach(pool, [store_target()])
    backends.append(backend)
    states = StatePool(slots=12, seed=1)
    backend.register_mem_host_pool_v2(states, PoolName.MAMBA)
    want = states.buf.clone()
    keys = keys_for("g", 5)

    def put(ks, slots):
        return backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=ks,
                                                  host_indices=torch.tensor(slots))])["mamba"]

    def get(ks, slots):
        return backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=ks,
                                                  host_indices=torch.tensor(slots))])["mamba"]

    assert put(keys[:3], [0, 1, 2]) == [True] * 3
    assert put(keys[2:5], [2, 3, 4]) == [True] * 3      # page 2 stored already: not rewritten
    states.buf.zero_()
    assert get(keys[1:3], [5, 6]) == [True, True]        # a trailing window of the first call
    assert torch.equal(states.buf[5], want[1]) and torch.equal(states.buf[6], want[2])
    assert get(keys[2:3], [7]) == [True]                 # one page alone
    assert torch.equal(states.buf[7], want[2])
    assert get(keys[1:5], [8, 9, 10, 11]) == [True] * 4  # across both calls
    assert torch.equal(states.buf[8:12], want[1:5])


def test_settings_typed_by_hand(file_target, backends, caplog):
    """A tenant named 0 is tenant "0", not the default one; numbers as
    strings parse or fail naming the setting; a key that is a close
    misspelling of one of kvblock's is refused naming both (ignored, "sever"
    would give every rank its own store, "fromat": "force" would keep old
    pages); another unknown key is named in a warning (the dict also holds
    SGLang's and other backends' keys, so it is not refused)."""
    pool = HostPool()
    zero = attach(pool, [file_target()], namespace=0)
    backends.append(zero)
    default = KVBlockHiCacheStorage(storage_config([file_target()]), {})
    assert zero.namespace == "0" and zero.prefix != default.prefix
    with caplog.at_level("WARNING", logger="kvblock.integrations.sglang"):
        foreign = attach(pool, [file_target()], extra_backend_tag="t", queue_depth="8",
                         file_storage_path="/x")
    backends.append(foreign)
    # file_storage_path: SGLang's own (its unified radix cache adds it to
    # the dict whenever --file-storage-path is set), not warned of
    assert "['extra_backend_tag'] are not kvblock's" in caplog.text
    for typo, meant in (("sever", "server"), ("fromat", "format"), ("Max-Run-Bytes",
                                                                      "max_run_bytes"),
                        ("admit_afer", "admit_after")):
        with pytest.raises(ConfigError, match=rf"{typo!r}.*{meant!r}.*devices"):
            KVBlockHiCacheStorage(storage_config([file_target()], **{typo: "1"}), {})
    with pytest.raises(ConfigError, match="admit_after must be a whole number"):
        attach(pool, [file_target()], admit_after="twice")
    with pytest.raises(ConfigError, match="size must be at least"):
        attach(pool, [file_target() + ".new"], size=64)


def test_devices_that_are_not_paths_are_refused(tmp_path, monkeypatch):
    """"devices" entries must be paths: a number was a TypeError, a null the
    path "None" (with "size", a store file of that name was created in the
    working directory when the pool was registered)."""
    monkeypatch.chdir(tmp_path)
    for devices in (5, [None], [str(tmp_path / "kv.img"), 7], {"0": [None]}, {"0": 3}):
        with pytest.raises(ConfigError, match=r'"devices" must be a path or a list of paths'):
            KVBlockHiCacheStorage(storage_config(devices, size="1G"), {})
    assert not os.listdir(tmp_path)


def test_names_and_server_that_are_not_strings_are_refused(tmp_path, monkeypatch):
    """"server" is a socket path and "namespace"/"model" are names mixed into
    every key: a number or a list typed there was made its repr (a socket
    "['/run/kvblock/sglang.sock']" in the working directory, a tenant "[1]",
    "True"), silently another store or another tenant.  A whole number stays
    a name ("0"); anything else is a ConfigError naming the key."""
    monkeypatch.chdir(tmp_path)
    dev = str(tmp_path / "kv.img")
    for key, value in (("server", 123), ("server", ["/run/kvblock/sglang.sock"]),
                       ("server", True), ("namespace", [1]), ("namespace", True),
                       ("namespace", 1.5), ("namespace", {"a": 1}), ("model", ["org/m"]),
                       ("model", False), ("model", 2.0)):
        config = storage_config([dev])
        config.extra_config[key] = value      # (storage_config's model is SGLang's)
        with pytest.raises(ConfigError, match=rf"kvblock sglang backend: {key} must be"):
            KVBlockHiCacheStorage(config, {})
    config = storage_config([dev], namespace=7)
    config.extra_config["model"] = 3
    named = KVBlockHiCacheStorage(config, {})
    assert (named.namespace, named.model) == ("7", "3")
    assert not os.listdir(tmp_path)


def test_a_region_size_of_zero_is_refused_not_ignored(tmp_path):
    """"region_size": 0 (or false) was taken for no setting, and the store
    formatted with the default regions, while "0" was refused: both are a
    ConfigError naming the key, as every other size of 0 is."""
    for value in (0, False, "0"):
        with pytest.raises(ConfigError, match="kvblock sglang backend: region_size must be"):
            KVBlockHiCacheStorage(storage_config([str(tmp_path / "kv.img")],
                                                 region_size=value), {})


def test_close_while_a_call_is_in_flight_answers_a_miss(file_target, backends, monkeypatch):
    """close() on another thread while a batch is between two runs: the rest
    of the call meets a closed store and answers a miss (logged), instead of
    raising AttributeError out of the engine's prefetch/backup thread (the
    backend dropped its store reference halfway through the call)."""
    import threading

    import kvblock.store.store as store_module

    # the call waits for the close it started, so close() waits its whole
    # wait for that call to leave: 1 s here, not 30
    monkeypatch.setattr(store_module, "CLOSE_WAIT_S", 1.0)

    pool = HostPool(pages=40)
    block = 3 * 2 * 4 * 2 * 16 * 2
    backend = attach(pool, [file_target()], max_run_bytes=4 * block)  # 4 pages per run
    backends.append(backend)
    keys = keys_for("z", 10)
    assert all(backend.batch_set_v1(keys[:8], pool.token_indices(range(8))))
    store = backend.store
    real_get_run = store.get_run

    def close_meanwhile():
        t = threading.Thread(target=backend.close)
        t.start()
        t.join()

    def get_run_then_close(keys, out):
        got = real_get_run(keys, out)
        close_meanwhile()
        return got

    store.get_run = get_run_then_close
    got = backend.batch_get_v1(keys[:8], pool.token_indices(range(20, 28)))
    assert got in ([True] * 4 + [False] * 4, [False] * 8)
    assert backend.batch_get_v1(keys[:8], pool.token_indices(range(20, 28))) == [False] * 8

    # and a backup: close between its two runs
    backend2 = attach(pool, [file_target()], max_run_bytes=4 * block)
    backends.append(backend2)
    store2 = backend2.store
    real_put = store2.put_run

    def put_run_then_close(keys, data):
        n = real_put(keys, data)
        t = threading.Thread(target=backend2.close)
        t.start()
        t.join()
        return n

    store2.put_run = put_run_then_close
    # the first run was stored before the close: reported stored, the rest not
    assert backend2.batch_set_v1(keys[:8], pool.token_indices(range(8))) == \
        [True] * 4 + [False] * 4
    assert backend2.batch_exists(keys[:8]) == 0


def test_a_close_right_after_the_open_check_leaves_no_staging_buffer(file_target, backends):
    """The backend takes the store's staging buffer itself: a close() between
    its open check and that call made a new buffer for a closed store, which
    close() had already freed them all for, so it stayed mapped (and
    registered for io_uring) for the life of SGLang's thread.  The call
    answers a miss, and the closed store holds no buffer."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    pool = HostPool(pages=8)
    backend = attach(pool, [file_target()])
    backends.append(backend)
    states = StatePool(slots=4, state_bytes=3000)
    backend.register_mem_host_pool_v2(states, PoolName.INDEXER)
    keys = keys_for("c", 4)
    assert all(backend.batch_set_v1(keys, pool.token_indices(range(4))))
    store, real_ready = backend.store, backend._ready

    def ready_then_closed():
        ok = real_ready()
        store.close()
        return ok

    backend._ready = ready_then_closed
    assert backend.batch_get_v1(keys, pool.token_indices(range(4, 8))) == [False] * 4
    out = backend.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                             host_indices=torch.arange(4))])
    assert out == {"indexer": [False] * 4}
    assert [b for b in store._stagings._all if not b.closed] == []


def test_extra_pool_pages_are_staged_a_run_at_a_time(file_target, backends):
    """An extra pool's call is staged max_run_bytes at a time, as KV pages
    are.  SGLang's backup hands a KV-derived pool (a DSA indexer) every page
    of the operation in one call (thousands for a long prompt), each padded
    to whole KV blocks; staging that call whole grew the thread's staging
    buffer, kept for the thread's life, to the size of the largest call."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    pool = HostPool(pages=8)
    block = 3 * 2 * 4 * 2 * 16 * 2                    # 1536 bytes
    backend = attach(pool, [file_target()], max_run_bytes=8 * block)
    backends.append(backend)
    states = StatePool(slots=200, state_bytes=3000, seed=3)   # 2 blocks a page
    backend.register_mem_host_pool_v2(states, PoolName.INDEXER)
    want = states.buf.clone()
    store = backend.store
    real_staging, asked = store._staging, []

    def staging(nbytes, purpose="staging"):
        asked.append((purpose, nbytes))
        return real_staging(nbytes, purpose)

    store._staging = staging
    keys = keys_for("x", 200)
    out = backend.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                             host_indices=torch.arange(200))])
    assert out == {"indexer": [True] * 200}
    states.buf.zero_()
    out = backend.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                             host_indices=torch.arange(200))])
    assert out == {"indexer": [True] * 200}
    assert torch.equal(states.buf, want)
    biggest = max(n for purpose, n in asked if purpose == "pages")
    assert biggest <= 8 * block, f"staged {biggest} bytes at once, max_run_bytes {8 * block}"
    # a miss in a later run: the pages before it load, none after it
    states.buf.zero_()
    missing = keys[:10] + keys_for("y", 1) + keys[11:20]
    out = backend.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, keys=missing,
                                             host_indices=torch.arange(20))])
    assert out == {"indexer": [True] * 10 + [False] * 10}
    assert torch.equal(states.buf[:10], want[:10])
    assert not states.buf[10:20].any()


def test_extra_pool_pages_of_another_format_are_a_miss(file_target, backends):
    """A restart with the same model but another extra-pool page format (a
    Mamba state of another --mamba-ssm-dtype, MTP draft layers or slot side
    states added: SGLang's MambaPoolHost refuses a stored page of another
    size) must miss, not load the old page's leading bytes: its padding to
    whole KV blocks hid the size, so a smaller page read back the first
    blocks of a larger one (fp32 state bytes read as bf16)."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    path = file_target()
    pool = HostPool(pages=8)
    backend = attach(pool, [path])
    big = StatePool(slots=4, state_bytes=12000, seed=1)    # 8 blocks of 1536 bytes
    backend.register_mem_host_pool_v2(big, PoolName.MAMBA)
    keys = keys_for("f", 2)
    assert backend.batch_set_v1(keys, pool.token_indices([0, 1])) == [True, True]
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys[1:],
                                              host_indices=torch.tensor([0]))]) == \
        {"mamba": [True]}
    backend.close()

    backend = attach(pool, [path])                         # same model, same KV pool
    backends.append(backend)
    small = StatePool(slots=4, state_bytes=10000, seed=2)  # 7 blocks: half-size dtype
    backend.register_mem_host_pool_v2(small, PoolName.MAMBA)
    before = small.buf.clone()
    r = backend.batch_exists_v2(keys, [PoolTransfer(
        name=PoolName.MAMBA, keys=keys[1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert r.kv_hit_pages == 0 and r.extra_pool_hit_pages == {"kv": 2}
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys[1:],
                                              host_indices=torch.tensor([2]))]) == \
        {"mamba": [False]}
    assert torch.equal(small.buf, before)


class SWAPool:
    """A sliding-window KV host pool (SGLang's MHATokenToKVPoolHost as an
    extra pool): its flat page is the pool's own slice, in its layout's order
    (``get_data_page``/``set_from_flat_data_page`` of pool_host/mha.py)."""

    def __init__(self, layout, layers=4, page_size=4, pages=4, seed=0):
        self.layout, self.page_size, self.layer_num = layout, page_size, layers
        shape = ((2, pages * page_size, layers, 2, 8) if layout == "page_first"
                 else (2, layers, pages * page_size, 2, 8))
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randint(-2**15, 2**15 - 1, shape, dtype=torch.int16, generator=g)

    def _slice(self, index):
        ps = self.page_size
        return (self.kv_buffer[:, index:index + ps] if self.layout == "page_first"
                else self.kv_buffer[:, :, index:index + ps])

    def get_data_page(self, index, flat=True):
        page = self._slice(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros(2 * self.layer_num * self.page_size * 2 * 8, dtype=torch.int16)

    def set_from_flat_data_page(self, index, data):
        page = self._slice(index)
        page[...] = data.reshape(page.shape)

    def layer_major(self, index):
        """One page as (2, layers, tokens, heads, dim), whatever the layout."""
        page = self._slice(index)
        return page.transpose(1, 2) if self.layout == "page_first" else page


def test_extra_pool_pages_of_another_layout_are_a_miss(file_target, backends):
    """A KV-like extra pool (SWA) stores its flat page in its host layout's
    order.  A restart with another --hicache-mem-layout must not read the
    old order back as the new one: with as many tokens a page as layers,
    page_first and layer_first pages have the same shape, and the page came
    back transposed (wrong KV, no error)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    path = file_target()
    pool = HostPool(pages=8, layout="page_first")
    backend = attach(pool, [path])
    old = SWAPool("page_first", seed=1)
    backend.register_mem_host_pool_v2(old, PoolName.SWA)
    keys = keys_for("w", 1)
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, keys=keys,
                                              host_indices=torch.arange(4))]) == {"swa": [True]}
    backend.close()

    backend = attach(HostPool(pages=8, layout="layer_first"), [path])
    backends.append(backend)
    new = SWAPool("layer_first", seed=2)
    backend.register_mem_host_pool_v2(new, PoolName.SWA)
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.SWA, keys=keys,
                                             host_indices=torch.arange(4, 8))])["swa"]
    # a miss, or the same KV: never the old bytes in the new order
    assert got == [False] or torch.equal(new.layer_major(4), old.layer_major(0))


def _second_run_fails(backend) -> list[int]:
    """The backend's store fails its second put_run (EIO); the list of the
    runs' lengths put_run was called with.  Undo: backend.store.put_run =
    the real one."""
    from kvblock.errors import IOFailedError

    real, calls = backend.store.put_run, []

    def put_run(run_keys, data):
        calls.append(len(run_keys))
        if len(calls) == 2:
            raise IOFailedError("write failed", "kv.img", 5, offset=0, length=4096)
        return real(run_keys, data)

    backend.store.put_run = put_run
    return calls


def test_a_backup_failing_part_way_reports_the_pages_it_stored(file_target, backends):
    """A backup cut into runs (max_run_bytes) whose second run fails: the
    pages of the first run, and pages stored before the call, are stored and
    reported True; only the failed run's pages and those after it are False
    (they were all reported False, pages the store holds among them)."""
    pool = HostPool(pages=40)
    block = 3 * 2 * 4 * 2 * 16 * 2
    backend = attach(pool, [file_target()], max_run_bytes=4 * block)  # 4 pages per run
    backends.append(backend)
    keys = keys_for("p", 10)
    assert backend.batch_set_v1([keys[9]], pool.token_indices([9])) == [True]
    real, calls = backend.store.put_run, _second_run_fails(backend)
    assert backend.batch_set_v1(keys, pool.token_indices(range(10))) == \
        [True] * 4 + [False] * 5 + [True]
    backend.store.put_run = real
    assert calls == [4, 4]
    assert backend.batch_exists(keys) == 4 and backend.stats()["store_failures"] == 1


def test_a_backup_failing_part_way_counts_the_pages_it_wrote_in_storage_metrics(
        file_target, backends, monkeypatch):
    """A backup whose second run fails wrote its first run: that run's pages
    are a backup in get_stats() (they were left out, as if nothing had been
    written; an extra pool's failing backup counts them)."""
    _stand_in_storage_metrics(monkeypatch)
    pool = HostPool(pages=40)
    block = 3 * 2 * 4 * 2 * 16 * 2
    backend = attach(pool, [file_target()], metrics=True, max_run_bytes=4 * block)
    backends.append(backend)
    keys = keys_for("pm", 10)
    real = backend.store.put_run
    _second_run_fails(backend)
    assert backend.batch_set_v1(keys, pool.token_indices(range(10))) == [True] * 4 + [False] * 6
    backend.store.put_run = real
    stats = backend.get_stats()
    assert stats.backup_pgs == [4] and len(stats.backup_bandwidth) == 1


def test_a_run_stored_before_its_clear_check_failed_is_counted_in_storage_metrics(
        file_target, backends, monkeypatch):
    """A run is written, then the clear ticket check after it fails (the
    store server went away): the run's pages are stored and answered True,
    so they are a backup in get_stats() too (they were left out: the count
    was taken after the check, so backup_pgs said nothing was written), for
    KV pages (batch_set_v1) and an extra pool's (batch_set_v2) alike."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from kvblock.errors import ServerGoneError

    _stand_in_storage_metrics(monkeypatch)
    pool = HostPool(pages=8)
    backend = attach(pool, [file_target()], metrics=True)
    backends.append(backend)
    states = StatePool(seed=5)
    backend.register_mem_host_pool_v2(states, PoolName.MAMBA)
    real, calls = backend.store.clear_ticket, []

    def away_after_the_put():
        calls.append(1)
        if len(calls) == 3:            # the mark, the check before the put, the one after
            raise ServerGoneError("the store server went away (test)")
        return real()

    backend.store.clear_ticket = away_after_the_put
    keys = keys_for("ck", 4)
    assert backend.batch_set_v1(keys, pool.token_indices(range(4))) == [True] * 4
    assert backend.batch_exists(keys) == 4
    assert backend.get_stats().backup_pgs == [4]
    calls.clear()
    skeys = keys_for("cs", 2)
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=skeys,
                                              host_indices=torch.tensor([0, 1]))]) == \
        {"mamba": [True, True]}
    assert backend._pool_present(PoolName.MAMBA, skeys).all()
    assert backend.get_stats().backup_pgs == [2]
    backend.store.clear_ticket = real


def test_an_extra_pool_backup_failing_part_way_reports_the_pages_it_stored(file_target,
                                                                          backends):
    """batch_set_v2 of an extra pool cut into runs whose second run fails:
    the first run's pages are stored and reported True, the rest False
    (SGLang counts the leading True pages as the pool's backed-up hit; it
    was 0, every page reported False)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from kvblock.errors import IOFailedError

    pool = HostPool(pages=8)
    block = 3 * 2 * 4 * 2 * 16 * 2                    # 1536 bytes
    backend = attach(pool, [file_target()], max_run_bytes=8 * block)
    backends.append(backend)
    states = StatePool(slots=20, state_bytes=3000, seed=4)    # 2 blocks a page: 4 a run
    backend.register_mem_host_pool_v2(states, PoolName.INDEXER)
    real, calls = backend.store.put_blocks, []

    def put_blocks(keys, blocks):
        calls.append(len(keys))
        if len(calls) == 2:
            raise IOFailedError("write failed", "kv.img", 5, offset=0, length=4096)
        return real(keys, blocks)

    backend.store.put_blocks = put_blocks
    keys = keys_for("w", 10)
    out = backend.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                             host_indices=torch.arange(10))])
    assert out == {"indexer": [True] * 4 + [False] * 6}
    backend.store.put_blocks = real
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                             host_indices=torch.arange(10, 20))])
    assert got == {"indexer": [True] * 4 + [False] * 6}


def _stand_in_storage_metrics(monkeypatch) -> None:
    """SGLang's metrics module imports torchvision (see sglang_pools.py): its
    StorageMetrics, as sglang_real_pool_check.py checks it, stands in."""
    import dataclasses
    import types

    @dataclasses.dataclass
    class StorageMetrics:
        prefetch_pgs: list = dataclasses.field(default_factory=list)
        backup_pgs: list = dataclasses.field(default_factory=list)
        prefetch_bandwidth: list = dataclasses.field(default_factory=list)
        backup_bandwidth: list = dataclasses.field(default_factory=list)

    monkeypatch.setitem(sys.modules, "sglang.srt.observability.metrics_collector",
                        types.SimpleNamespace(StorageMetrics=StorageMetrics))


def test_backup_metrics_count_the_pages_written(file_target, backends, monkeypatch):
    """SGLang's storage metrics (get_stats: backup_pgs, backup_bandwidth)
    count the pages the store wrote: pages admission declines (admit_after)
    and pages stored already are not backups (they were counted, and their
    bytes made the backup bandwidth up)."""
    _stand_in_storage_metrics(monkeypatch)
    pool = HostPool()
    backend = attach(pool, [file_target()], metrics=True, admit_after=2)
    backends.append(backend)
    keys = keys_for("m", 4)
    assert backend.batch_set_v1(keys, pool.token_indices(range(4))) == [True] * 4
    assert backend.batch_exists(keys) == 0                  # declined: seen once
    assert backend.get_stats().backup_pgs == []
    assert backend.batch_set_v1(keys, pool.token_indices(range(4))) == [True] * 4
    assert backend.batch_exists(keys) == 4
    assert backend.batch_set_v1(keys, pool.token_indices(range(4))) == [True] * 4
    stats = backend.get_stats()
    assert stats.backup_pgs == [4] and len(stats.backup_bandwidth) == 1
    assert backend.batch_get_v1(keys, pool.token_indices(range(4, 8))) == [True] * 4
    assert backend.get_stats().prefetch_pgs == [4]


def test_page_unified_pool_of_several_head_groups_is_refused_saying_why():
    """page_unified MHA pages of two head groups split a token's heads in two
    parts of the page: refused, naming the head groups and the layouts to use."""
    from kvblock.integrations.sglang import PoolPages

    buf = torch.zeros(4, 2, 3, 2, 4, 1, 16, dtype=torch.bfloat16)  # (P, G, L, 2, ps, H/G, D)
    with pytest.raises(ConfigError, match=r"2 head groups.*page_first"):
        PoolPages(buf, "page_unified", 4, mla=False)
    one = PoolPages(torch.zeros(4, 1, 3, 2, 4, 2, 16, dtype=torch.bfloat16), "page_unified", 4,
                    mla=False)
    assert (one.layers, one.heads, one.num_pages, one.host_layout) == (3, 2, 4, "page_unified")


def test_extra_pool_pages_are_counted_in_storage_metrics(file_target, backends, monkeypatch):
    """A hybrid model's extra pool pages (batch_set_v2 / batch_get_v2) are
    backups and prefetches in get_stats() too, one entry per pool transfer
    with its own page count, as SGLang's HF3FS backend counts them."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    _stand_in_storage_metrics(monkeypatch)
    pool = HostPool(pages=12)
    backend = attach(pool, [file_target()], metrics=True)
    backends.append(backend)
    states = StatePool(seed=2)
    backend.register_mem_host_pool_v2(states, PoolName.MAMBA)
    keys = keys_for("xm", 3)
    transfers = lambda kv_pages, slots: [  # noqa: E731
        PoolTransfer(name=PoolName.KV, keys=keys, host_indices=pool.token_indices(kv_pages)),
        PoolTransfer(name=PoolName.MAMBA, keys=keys[1:], host_indices=torch.tensor(slots))]
    assert backend.batch_set_v2(transfers([0, 1, 2], [1, 2])) == \
        {"kv": [True] * 3, "mamba": [True, True]}
    stats = backend.get_stats()
    assert sorted(stats.backup_pgs) == [2, 3] and len(stats.backup_bandwidth) == 2
    assert backend.batch_set_v2(transfers([0, 1, 2], [1, 2]))["mamba"] == [True, True]
    assert backend.get_stats().backup_pgs == []           # stored already: nothing written
    assert backend.batch_get_v2(transfers([3, 4, 5], [4, 5])) == \
        {"kv": [True] * 3, "mamba": [True, True]}
    stats = backend.get_stats()
    assert sorted(stats.prefetch_pgs) == [2, 3] and len(stats.prefetch_bandwidth) == 2


def test_flat_page_calls_are_counted_in_storage_metrics(file_target, backends, monkeypatch):
    """Without "interface_v1" SGLang backs up and prefetches with the flat-page
    calls (batch_set / batch_get): their pages are backups and prefetches in
    get_stats() as the v1 calls' are (HF3FS counts both kinds alike)."""
    _stand_in_storage_metrics(monkeypatch)
    pool = HostPool()
    backend = attach(pool, [file_target()], metrics=True)
    backends.append(backend)
    keys = keys_for("fm", 3)
    flat = [pool.page_bytes(p).view(pool.dtype).reshape(-1) for p in range(3)]
    assert backend.batch_set(keys, flat) is True
    stats = backend.get_stats()
    assert stats.backup_pgs == [3] and len(stats.backup_bandwidth) == 1
    assert backend.batch_set(keys, flat) is True
    assert backend.get_stats().backup_pgs == []           # stored already: nothing written
    got = backend.batch_get(keys + ["fm-absent"])
    assert got[3] is None
    assert all(torch.equal(got[p].view(torch.uint8), pool.page_bytes(p).reshape(-1))
               for p in range(3))
    stats = backend.get_stats()
    assert stats.prefetch_pgs == [3] and len(stats.prefetch_bandwidth) == 1


def test_a_backup_that_cannot_note_the_clear_ticket_stores_nothing(file_target, backends):
    """A backup notes the store's clear ticket first; a store away then (a
    server restarting) was noted as no ticket and the backup went on: a
    reconnect before its puts let it write with no clear or restart seen
    (another rank's clear meanwhile: the old weights' KV stored after it).
    It fails instead, as a store away fails a backup, every page False."""
    from kvblock.errors import ServerGoneError

    pool = HostPool(pages=8)
    backend = attach(pool, [file_target()])
    backends.append(backend)
    real, calls = backend.store.clear_ticket, []

    def away_once():
        calls.append(1)
        if len(calls) == 1:
            raise ServerGoneError("the store server went away (test)")
        return real()

    backend.store.clear_ticket = away_once
    keys = keys_for("away", 4)
    assert backend.batch_set_v1(keys, pool.token_indices(range(4))) == [False] * 4
    assert backend.batch_exists(keys) == 0 and backend.stats()["store_failures"] == 1
    assert backend.batch_set_v1(keys, pool.token_indices(range(4))) == [True] * 4
    assert backend.batch_exists(keys) == 4


def test_a_clear_during_a_multi_run_backup_stores_none_of_its_later_runs(file_target, backends):
    """SGLang clears the store after a weight update: a backup cut into runs
    (max_run_bytes) that a clear() overtakes after its first run holds KV of
    the old weights, so none of its later runs may be stored (they were, and
    read back as hits after the clear).  None of the call's pages is stored
    then (the clear took those before it), and each is answered False: they
    were answered True, so SGLang's _page_backup went on to the operation's
    next batch, written under the new clear ticket with the old KV."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    pool = HostPool(pages=40)
    block = 3 * 2 * 4 * 2 * 16 * 2
    backend = attach(pool, [file_target()], max_run_bytes=4 * block)  # 4 pages per run
    backends.append(backend)
    states = StatePool(seed=3)
    backend.register_mem_host_pool_v2(states, PoolName.MAMBA)
    keys = keys_for("cl", 10)
    real, calls = backend.store.put_run, []

    def put_run(run_keys, data):
        n = real(run_keys, data)
        calls.append(len(run_keys))
        if len(calls) == 1:
            assert backend.clear() is True                  # between the first and second run
        return n

    backend.store.put_run = put_run
    assert backend.batch_set_v1(keys, pool.token_indices(range(10))) == [False] * 10
    assert calls == [4]                                     # no run after the clear
    assert backend.store.present([backend.kvblock_key(k) for k in keys]).sum() == 0
    backend.store.put_run = real
    assert backend.batch_set_v1(keys, pool.token_indices(range(10))) == [True] * 10
    assert backend.batch_exists(keys) == 10                 # a backup after it is stored

    # an extra pool's pages (batch_set_v2), written a run of pages at a time
    real_blocks, block_calls = backend.store.put_blocks, []

    def put_blocks(run_keys, blocks):
        n = real_blocks(run_keys, blocks)
        block_calls.append(len(run_keys))
        if len(block_calls) == 1:
            assert backend.clear() is True
        return n

    backend.store.put_blocks = put_blocks
    backend.max_run_bytes = 1                                # one page per run
    skeys = keys_for("st", 3)
    res = backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=skeys,
                                             host_indices=torch.tensor([0, 1, 2]))])
    assert res == {"mamba": [False] * 3} and len(block_calls) == 1
    assert not backend._pool_present(PoolName.MAMBA, skeys).any()


def test_a_load_failing_part_way_reports_the_pages_it_loaded(file_target, backends, monkeypatch):
    """A prefetch cut into runs (max_run_bytes) whose second run meets a
    device error: the first run's pages are in the host pool, byte for byte,
    and reported loaded (SGLang takes the leading True pages as the hit);
    they were all reported False, so a failing run threw away the hits
    before it.  Likewise the flat-page batch_get and an extra pool's
    batch_get_v2, and the loaded pages are a prefetch in get_stats()."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from kvblock.errors import IOFailedError

    _stand_in_storage_metrics(monkeypatch)
    pool = HostPool(pages=40)
    block = 3 * 2 * 4 * 2 * 16 * 2
    backend = attach(pool, [file_target()], metrics=True, max_run_bytes=4 * block)
    backends.append(backend)
    states = StatePool(slots=20, state_bytes=3000, seed=5)    # 2 blocks a page: 2 a run
    backend.register_mem_host_pool_v2(states, PoolName.INDEXER)
    keys = keys_for("lf", 10)
    want = [pool.page_bytes(p) for p in range(10)]
    assert all(backend.batch_set_v1(keys, pool.token_indices(range(10))))
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                              host_indices=torch.arange(10))]) == \
        {"indexer": [True] * 10}
    want_states = states.buf.clone()
    backend.get_stats()

    def failing_second(real):
        calls = []

        def call(*args):
            calls.append(1)
            if len(calls) == 2:
                raise IOFailedError("read failed", "kv.img", 5, offset=0, length=4096)
            return real(*args)
        return call

    store = backend.store
    store.get_run = failing_second(store.get_run)
    assert backend.batch_get_v1(keys, pool.token_indices(range(20, 30))) == \
        [True] * 4 + [False] * 6
    assert all(torch.equal(pool.page_bytes(20 + i), want[i]) for i in range(4))
    assert backend.get_stats().prefetch_pgs == [4]

    store.get_run = failing_second(type(store).get_run.__get__(store))
    got = backend.batch_get(keys)
    assert [g is not None for g in got] == [True] * 4 + [False] * 6
    assert all(torch.equal(got[i].view(torch.uint8), want[i].reshape(-1)) for i in range(4))

    store.get_blocks = failing_second(store.get_blocks)
    states.buf.zero_()
    out = backend.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                             host_indices=torch.arange(10))])
    assert out == {"indexer": [True] * 2 + [False] * 8}
    assert torch.equal(states.buf[:2], want_states[:2])
    assert backend.stats()["store_failures"] == 3


def test_kv_transfers_without_host_indices_fail_softly(file_target, backends):
    """PoolTransfer.host_indices is Optional: a KV transfer without them (or
    a v1 call given None) answers every page False and logs it, as an extra
    pool's transfer does; it raised torch's untyped RuntimeError ('Could not
    infer dtype of NoneType') out of SGLang's backup thread."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    pool = HostPool()
    backend = attach(pool, [file_target()])
    backends.append(backend)
    keys = keys_for("ni", 2)
    assert backend.batch_set_v1(keys, None) == [False, False]
    assert backend.batch_get_v1(keys, None) == [False, False]
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=keys)]) == \
        {"kv": [False, False]}
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=keys)]) == \
        {"kv": [False, False]}
    assert backend.batch_exists(keys) == 0


@pytest.mark.parametrize("call", ["v1", "flat"])
def test_a_backup_of_stored_pages_keeps_them_under_lru(file_target, backends, call):
    """SGLang backs a prefix up again when it was computed anew (its L3 copy
    was not prefetched: below the prefetch threshold, or the request hit in
    GPU/host memory). Such pages are in use, so like HiCacheFile's set of an
    existing file the call marks them as just used: LRU eviction keeps them
    while pages written once and never used again are evicted."""
    pool = HostPool(head_dim=128)                       # 12 KiB pages
    backend = attach(pool, [file_target(4 << 20)], eviction="lru", region_size="256K")
    backends.append(backend)
    hot = keys_for("hot", 4)
    want = [pool.page_bytes(p) for p in (0, 1, 2, 3)]

    def backup(keys, pages):
        if call == "v1":
            return all(backend.batch_set_v1(keys, pool.token_indices(pages)))
        flat = PoolFlat(pool)
        return backend.batch_set(keys, [flat.page(p) for p in pages])

    assert backup(hot, [0, 1, 2, 3])
    before = backend.store.stats()["put_blocks"]
    for i in range(120):                                # several times the store
        assert backup(keys_for(f"cold{i}-", 4), [4, 5, 6, 7])
        assert backup(hot, [0, 1, 2, 3])                 # stored: not written again
    stats = backend.store.stats()
    assert stats["evicted_regions"] >= stats["regions"]
    assert stats["put_blocks"] - before == 120 * 4
    assert backend.batch_exists(hot) == 4
    assert backend.batch_get_v1(hot, pool.token_indices([8, 9, 10, 11])) == [True] * 4
    for p, page in zip((8, 9, 10, 11), want):
        assert torch.equal(pool.page_bytes(p), page)


class PoolFlat:
    """A page_first HostPool's flat pages, as SGLang's get_data_page gives them."""

    def __init__(self, pool):
        self.pool = pool

    def page(self, p):
        ps = self.pool.page_size
        return self.pool.kv_buffer[:, p * ps:(p + 1) * ps].flatten()


def test_a_shared_start_that_will_not_format_names_the_backends_own_setting(tmp_path):
    """"server" on a device holding a store that cannot be opened (its
    superblocks damaged): the backend will not format over it, and the
    refusal names its own setting, as without a server, not
    open_or_format's generic 'set format to "force"'."""
    from kvblock import Geometry, create_file
    from kvblock.errors import UnsafeTargetError
    from kvblock.format import superblock as sbfmt

    dev, sock = str(tmp_path / "kv.img"), str(tmp_path / "kv.sock")
    create_file(dev, 16 << 20)
    KVStore.format([dev], Geometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8",
                                   block_tokens=1, kv_parts=1, head_groups=1),
                   region_size=1 << 20).close()
    with open(dev, "r+b") as f:
        for off in sbfmt.COPY_OFFSETS:
            f.seek(off + 100)
            f.write(b"\xff" * 4)
    for shared in ({}, {"server": sock}):
        with pytest.raises(UnsafeTargetError, match="holds a damaged kvblock store") as e:
            attach(HostPool(), [dev], **shared)
        assert str(e.value).endswith('set "format": "force" in the extra config'), \
            (shared, str(e.value))
    assert not os.path.exists(sock)


def test_flat_batch_set_of_a_missing_page_answers_false(file_target, backends):
    """HiCacheStorage.batch_set answers a bool ("True if all operations were
    successful, False otherwise"), as set(key, None) does and HiCacheFile's
    batch_set does for a page it cannot take: a None (or non-tensor) value
    among the pages is a False, with nothing stored, not an AttributeError
    out of the backend."""
    pool = HostPool()
    backend = attach(pool, [file_target()])
    backends.append(backend)
    keys = keys_for("fn", 2)
    flat = PoolFlat(pool)
    assert backend.set(keys[0], None) is False
    assert backend.batch_set(keys, [flat.page(0), None]) is False
    assert backend.batch_set(keys, [flat.page(0), "not a page"]) is False
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set(keys, [flat.page(0), flat.page(1)]) is True
    assert backend.batch_exists(keys) == 2
