"""Drive KVBlockHiCacheStorage through SGLang's real host pools (run as a child
process by test_sglang.py: ``python -m tests.integrations.sglang_real_pool_check DIR``).

``sglang.srt.mem_cache.pool_host`` imports ``sglang.srt.configs``, whose
multimodal model configs import ``torchvision`` at module level; no
torchvision on PyPI loads beside the CPU build of torch 2.13.0.  This process
installs a stand-in ``torchvision`` package (attributes are mocks) before
importing SGLang, so that import chain -- which has nothing to do with KV
pools -- succeeds; the pools, SGLang's backend factory and the pools'
flat-page methods are SGLang's own code.  The stand-in lives only in this
child process (transformers would otherwise see torchvision as installed).

Prints one JSON line; exits non-zero on the first failed check.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import sys
import types
import warnings
from unittest import mock


class _StandInTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: mock.MagicMock(name=f"{spec.name}.{attr}")
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_StandInTorchvision())
with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # SGLang warns about CUDA-only quantization on import
    import torch
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MambaStateBufferInfo,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorageConfig,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.observability.metrics_collector import StorageMetrics

from kvblock.devices import create_file
from tests.integrations.sglang_pools import kv_buffer_shape

LAYERS, HEADS, HEAD_DIM, PAGE, DEVICE_TOKENS = 3, 2, 16, 4, 48
MLA_LORA, MLA_ROPE = 24, 8
DTYPE = torch.bfloat16


def real_pool(mla: bool, layout: str):
    """A host pool built the way SGLang's assembler builds it, on the CPU."""
    cpu = torch.device("cpu")
    if mla:
        dim = MLA_LORA + MLA_ROPE
        bufs = tuple(torch.zeros(DEVICE_TOKENS, 1, dim, dtype=DTYPE) for _ in range(LAYERS))
        info = MLABufferInfo(
            buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs],
                                                 dtype=torch.uint64),
            layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PAGE,
            kv_lora_rank=MLA_LORA, qk_rope_head_dim=MLA_ROPE, kv_cache_dim=dim, dtype=DTYPE,
            device=cpu)
        return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=DEVICE_TOKENS, start_layer=0,
                                    end_layer=LAYERS, target_layer_num=LAYERS)
    k = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS))
    v = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS))
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, dtype=DTYPE,
        device=cpu)
    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=DEVICE_TOKENS, start_layer=0,
                                end_layer=LAYERS)


def attach(pool, mla: bool, devices, model="org/model-a", **extra):
    """What HiCacheController.attach_storage_backend does for a dynamic backend."""
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True,
        is_page_first_layout=pool.layout == "page_first", model_name=model,
        extra_config={"backend_name": "kvblock", "module_path": "kvblock.integrations.sglang",
                      "class_name": "KVBlockHiCacheStorage", "interface_v1": 1,
                      "devices": devices, **extra})
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def fill(pool, seed):
    g = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def pages_of(pool, indices):
    """Each page's flat bytes through the pool's own get_data_page."""
    ps = pool.page_size
    return [pool.get_data_page(int(indices[i * ps]), flat=True).view(torch.uint8).clone()
            for i in range(len(indices) // ps)]


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def run_case(mla: bool, layout: str, tmp: str, results: dict) -> None:
    name = f"{'mla' if mla else 'mha'}-{layout}"
    pool = real_pool(mla, layout)
    want = kv_buffer_shape(mla, layout, LAYERS, HEADS, MLA_LORA + MLA_ROPE if mla else HEAD_DIM,
                           PAGE, pool.page_num)
    check(tuple(pool.kv_buffer.shape) == want,
          f"{name}: real kv_buffer {tuple(pool.kv_buffer.shape)} != stand-in {want}")
    check(pool.kv_buffer.is_contiguous(), f"{name}: kv_buffer not contiguous")
    path = f"{tmp}/{name}.img"
    create_file(path, 64 << 20)
    backend = attach(pool, mla, [path])
    fill(pool, 1)
    n = 5
    keys = [f"{name}-page-{i:02d}" for i in range(n)]

    # zero-copy path, as _page_set_zero_copy / _page_get_zero_copy call it
    src = pool.alloc(n * PAGE)
    before = pages_of(pool, src)
    check(all(backend.batch_set_v1(keys, src, None)), f"{name}: batch_set_v1 failed")
    check(backend.batch_exists(keys + ["missing"], None) == n, f"{name}: batch_exists")
    dst = pool.alloc(n * PAGE)
    pool.kv_buffer.zero_()
    check(backend.batch_get_v1(keys, dst, None) == [True] * n, f"{name}: batch_get_v1")
    after = pages_of(pool, dst)
    check(all(a.equal(b) for a, b in zip(before, after)), f"{name}: v1 bytes differ")

    # flat-page path, as _generic_page_set / _generic_page_get call it
    fill(pool, 2)
    keys2 = [f"{name}-flat-{i:02d}" for i in range(3)]
    idx = pool.alloc(3 * PAGE)
    data = [pool.get_data_page(idx[i * PAGE]) for i in range(3)]
    flat_before = [d.view(torch.uint8).clone() for d in data]
    check(backend.batch_set(keys2, data), f"{name}: batch_set")
    dummies = [pool.get_dummy_flat_data_page() for _ in keys2]
    got = backend.batch_get(keys2 + ["absent"], dummies + [pool.get_dummy_flat_data_page()])
    check(got[-1] is None, f"{name}: batch_get of a missing key")
    pool.kv_buffer.zero_()
    for i in range(3):
        pool.set_from_flat_data_page(idx[i * PAGE], got[i])
    flat_after = pages_of(pool, idx)
    check(all(a.equal(b) for a, b in zip(flat_before, flat_after)), f"{name}: flat bytes differ")
    check(backend.exists(keys2[0]) and not backend.exists("absent"), f"{name}: exists")
    metrics = backend.get_stats()
    # the v1 calls' pages, then the flat-page calls' (counted alike)
    check(isinstance(metrics, StorageMetrics) and metrics.backup_pgs == [n, 3]
          and metrics.prefetch_pgs == [n, 3], f"{name}: get_stats {metrics}")
    backend.close()

    # the store keeps kvblock's layout: a pool of the other page layout reads it
    other = "page_first_direct" if layout == "page_first" else "page_first"
    pool2 = real_pool(mla, other)
    backend2 = attach(pool2, mla, [path], format="never")
    dst2 = pool2.alloc(n * PAGE)
    check(backend2.batch_get_v1(keys, dst2, None) == [True] * n, f"{name}: reopen get")
    across = pages_of(pool2, dst2)
    # a page's flat bytes differ between layouts; compare through the layout-free view
    for a, b in zip(before, across):
        check(_canonical(a, mla, layout).equal(_canonical(b, mla, other)),
              f"{name}: bytes differ when read through a {other} pool")
    backend2.close()
    results[name] = {"pages": n, "flat_pages": 3, "kv_buffer": list(want)}


def run_unified_case(mla: bool, tmp: str, results: dict) -> None:
    """SGLang's ``page_unified`` host layout (its own pool class): each page is
    one block of (layer, kv, token, head, dim) bytes -- kvblock's block order.
    The pool has no flat pages (get_data_page refuses the layout), so only the
    zero-copy calls: a v1 round trip, and the store read back through a
    page_first pool of the same model (the bytes compared per layer, K and V)."""
    name = f"{'mla' if mla else 'mha'}-page_unified"
    pool = real_pool(mla, "page_unified")
    path = f"{tmp}/{name}.img"
    create_file(path, 64 << 20)
    backend = attach(pool, mla, [path])
    fill(pool, 7)
    n = 5
    keys = [f"{name}-page-{i:02d}" for i in range(n)]
    src = pool.alloc(n * PAGE)
    ps = PAGE
    pages = lambda p, idx: [p.kv_buffer[int(idx[i * ps]) // ps].view(torch.int16).clone()
                            for i in range(n)]   # bits (random bf16 holds NaNs)
    before = pages(pool, src)
    check(all(backend.batch_set_v1(keys, src, None)), f"{name}: batch_set_v1 failed")
    check(backend.batch_exists(keys + ["missing"], None) == n, f"{name}: batch_exists")
    dst = pool.alloc(n * PAGE)
    pool.kv_buffer.zero_()
    check(backend.batch_get_v1(keys, dst, None) == [True] * n, f"{name}: batch_get_v1")
    check(all(a.equal(b) for a, b in zip(before, pages(pool, dst))), f"{name}: v1 bytes differ")
    backend.close()

    pool2 = real_pool(mla, "page_first")
    backend2 = attach(pool2, mla, [path], format="never")
    dst2 = pool2.alloc(n * PAGE)
    check(backend2.batch_get_v1(keys, dst2, None) == [True] * n, f"{name}: page_first get")
    for i, want in enumerate(before):
        tok = slice(int(dst2[i * ps]), int(dst2[i * ps]) + ps)
        if mla:       # unified (L, ps, D); page_first (size, L, 1, D)
            got = pool2.kv_buffer[tok, :, 0].transpose(0, 1)
        else:         # unified (1, L, 2, ps, H, D); page_first (2, size, L, H, D)
            want = want[0]
            got = pool2.kv_buffer[:, tok].permute(2, 0, 1, 3, 4)
        check(got.view(torch.int16).equal(want),
              f"{name}: bytes differ when read through a page_first pool")
    backend2.close()
    results[name] = {"pages": n, "kv_buffer": list(pool.kv_buffer.shape)}


MAMBA_SLOTS = 6


def real_mamba_pool(seed: int):
    """SGLang's Mamba state host pool (a hybrid model's extra pool), on the
    CPU, its state slots filled with random bytes through its own flat pages."""
    cpu_layers = 2
    info = MambaStateBufferInfo(
        temporal=torch.zeros(cpu_layers, MAMBA_SLOTS, 4, 8, dtype=torch.float32),
        conv=(torch.zeros(cpu_layers, MAMBA_SLOTS, 3, 16, dtype=DTYPE),))
    pool = MambaPoolHost(info, 2.0, 0, device_capacity=MAMBA_SLOTS, pin_memory=False,
                         device="cpu", layout="page_first")
    g = torch.Generator().manual_seed(seed)
    like = pool.get_dummy_flat_data_page()
    for slot in range(pool.size):
        pool.set_from_flat_data_page(slot, torch.randint(0, 256, like.shape, dtype=torch.uint8,
                                                         generator=g).view(like.dtype))
    return pool


def run_hybrid_case(tmp: str, results: dict) -> None:
    """The *_v2 calls of SGLang's hybrid controller with SGLang's own pools:
    the KV pool (MHA, page_first), a MambaPoolHost and a sliding-window KV
    pool (an MHA host pool of PAGE-token pages, as SGLang's assembler builds
    for SWA layers) registered beside it; state and window KV kept for the
    trailing pages only, as such models do."""
    pool = real_pool(False, "page_first")
    mamba = real_mamba_pool(3)
    swa = real_pool(False, "page_first")
    check(mamba.page_size == 1, f"MambaPoolHost page_size {mamba.page_size}")
    path = f"{tmp}/hybrid.img"
    create_file(path, 64 << 20)
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="org/hybrid", extra_config={
            "backend_name": "kvblock", "module_path": "kvblock.integrations.sglang",
            "class_name": "KVBlockHiCacheStorage", "interface_v1": 1, "devices": [path]})
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)                       # the anchor pool
    backend.register_mem_host_pool_v2(pool, PoolName.KV)      # the host pool group entries
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    backend.on_host_pools_registered()
    fill(pool, 4)
    fill(swa, 6)
    n = 5
    keys = [f"hybrid-page-{i:02d}" for i in range(n)]
    kv_idx = pool.alloc(n * PAGE)
    want_kv = pages_of(pool, kv_idx)
    slots = torch.tensor([1, 4])
    want_state = [mamba.get_data_page(int(i), flat=True).clone() for i in slots]
    swa_idx = swa.alloc(2 * PAGE)
    want_swa = pages_of(swa, swa_idx)
    res = backend.batch_set_v2([
        PoolTransfer(name=PoolName.KV, keys=keys, host_indices=kv_idx),
        PoolTransfer(name=PoolName.MAMBA, keys=keys[3:], host_indices=slots),
        PoolTransfer(name=PoolName.SWA, keys=keys[3:], host_indices=swa_idx)])
    check(res == {"kv": [True] * n, "mamba": [True, True], "swa": [True, True]},
          f"hybrid: batch_set_v2 {res}")
    hit = backend.batch_exists_v2(keys, [PoolTransfer(
        name=PoolName.MAMBA, keys=keys[3:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        PoolTransfer(name=PoolName.SWA, keys=keys[3:], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    check(hit.kv_hit_pages == n and hit.restorable_prefix_pages == [n],
          f"hybrid: batch_exists_v2 {hit}")
    hit = backend.batch_exists_v2(keys, [PoolTransfer(
        name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)])
    check(hit.kv_hit_pages == 0, f"hybrid: page 0 has no state, yet {hit}")

    fresh = real_mamba_pool(5)                 # another process's pools, other contents
    check(not any(fresh.get_data_page(i, flat=True).equal(w)
                  for i, w in zip((0, 5), want_state)), "hybrid: fresh pool already holds it")
    backend.register_mem_host_pool_v2(fresh, PoolName.MAMBA)
    pool.kv_buffer.zero_()
    swa.kv_buffer.zero_()
    dst_idx = pool.alloc(n * PAGE)
    swa_dst = swa.alloc(2 * PAGE)
    out = backend.batch_get_v2([
        PoolTransfer(name=PoolName.KV, keys=keys, host_indices=dst_idx),
        PoolTransfer(name=PoolName.MAMBA, keys=keys[3:], host_indices=torch.tensor([0, 5])),
        PoolTransfer(name=PoolName.SWA, keys=keys[3:], host_indices=swa_dst)])
    check(out == {"kv": [True] * n, "mamba": [True, True], "swa": [True, True]},
          f"hybrid: batch_get_v2 {out}")
    check(all(a.equal(b) for a, b in zip(want_kv, pages_of(pool, dst_idx))),
          "hybrid: KV bytes differ")
    check(all(a.equal(b) for a, b in zip(want_swa, pages_of(swa, swa_dst))),
          "hybrid: sliding-window KV bytes differ")
    got_state = [fresh.get_data_page(i, flat=True) for i in (0, 5)]
    check(all(a.equal(b) for a, b in zip(want_state, got_state)), "hybrid: Mamba state differs")
    out = backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys[:1],
                                             host_indices=torch.tensor([2]))])
    check(out == {"mamba": [False]}, f"hybrid: a state never stored loaded: {out}")
    backend.close()
    results["hybrid"] = {"pages": n, "state_pages": 2, "swa_pages": 2,
                               "state_page_bytes": int(want_state[0].numel()
                                                       * want_state[0].element_size())}


def _canonical(flat_u8, mla, layout):
    """A flat page (get_data_page order) as (layers, kv, tokens, heads*dim) bytes."""
    x = flat_u8.view(DTYPE)
    if mla:
        D = MLA_LORA + MLA_ROPE
        if layout == "page_first":
            return x.view(PAGE, LAYERS, D).transpose(0, 1).contiguous().view(torch.uint8)
        return x.view(LAYERS, PAGE, D).contiguous().view(torch.uint8)
    if layout == "page_first":
        return x.view(2, PAGE, LAYERS, HEADS * HEAD_DIM).permute(2, 0, 1, 3).contiguous() \
            .view(torch.uint8)
    return x.view(2, LAYERS, PAGE, HEADS * HEAD_DIM).transpose(0, 1).contiguous() \
        .view(torch.uint8)


def mxfp8_pool():
    """SGLang's MXFP8 KV host pool (the class SGLang picks for an
    interleaved-MXFP8 KV cache), built on the CPU: only its check for a
    CUDA write-back kernel is stood in for, not the buffers it allocates."""
    from sglang.srt.mem_cache.device_pool_info import KVScaleBuffers, KVScaleLayout
    from sglang.srt.mem_cache.pool_host import mha as mha_mod
    from sglang.srt.mem_cache.pool_host import mha_mxfp8
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    ps, pages, u8 = 128, 2, torch.uint8
    k = tuple(torch.zeros(pages * ps, 1, 32, dtype=u8) for _ in range(LAYERS))
    v = tuple(torch.zeros(pages * ps, 1, 32, dtype=u8) for _ in range(LAYERS))
    scales = [tuple(torch.zeros(pages, 1, 32, ps // 32, 1, dtype=u8) for _ in range(LAYERS))
              for _ in "kv"]
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=ps, head_num=1, head_dim=32, v_head_dim=32, dtype=u8,
        device=torch.device("cpu"),
        scales=KVScaleBuffers(k=scales[0], v=scales[1], layout=KVScaleLayout.MXFP8_INTERLEAVED))
    cls = get_mha_host_pool_cls(info)
    check(cls is mha_mxfp8.MHATokenToKVPoolMXFP8Host, f"SGLang picked {cls} for MXFP8 KV")

    def staging(self, buffer_info, write_back_staging):
        self.staging_page_capacity = self.staging_token_capacity = 0
        self.staging_k_buffer = self.staging_v_buffer = None
        self.can_use_write_back_jit = True
    with mock.patch.object(mha_mod.MHATokenToKVPoolHost, "_init_write_back_staging_buffers",
                           staging), \
            mock.patch.object(mha_mxfp8, "can_use_write_back_jit_kernel", lambda **kw: True):
        return cls(info, 2.0, 0, ps, "page_first", pin_memory=False, device="cpu",
                   device_capacity_tokens=pages * ps, start_layer=0, end_layer=LAYERS)


def run_refused_cases(tmp: str) -> dict:
    """Pools whose pages kvblock cannot store whole are refused at
    registration with a ConfigError that says why."""
    from kvblock.errors import ConfigError

    refused = {}
    pool = mxfp8_pool()
    check(pool.k_scale_host is not None, "the MXFP8 pool has no k_scale_host")
    try:
        attach(pool, False, [f"{tmp}/mxfp8.img"], size="64M")
    except ConfigError as e:
        check("k_scale_host" in str(e), f"MXFP8 refusal does not say why: {e}")
        refused["mxfp8"] = str(e)
    else:
        raise AssertionError("an MXFP8 host pool (scales outside kv_buffer) was accepted")
    return refused


def main() -> int:
    tmp = sys.argv[1]
    results: dict = {}
    for mla in (False, True):
        for layout in ("page_first", "page_first_direct"):
            run_case(mla, layout, tmp, results)
        run_unified_case(mla, tmp, results)
    run_hybrid_case(tmp, results)
    refused = run_refused_cases(tmp)
    print(json.dumps({"ok": True, "cases": results, "refused": refused}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
