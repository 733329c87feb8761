"""GPU data path (needs CUDA; run by perf/gpu_check.sh on a GPU machine).

Loads into CUDA caches through both GPU paths (kvikio straight into device
memory, io_uring into host memory plus a copy) and checks the bytes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from kvblock import Geometry, KVStore, create_file  # noqa: E402
from kvblock.tensors import VLLMLayout, load_blocks, save_blocks  # noqa: E402
from tests.support.gpu import count_reads, took  # noqa: E402

L, H, D, BS = 4, 8, 128, 16


@pytest.mark.parametrize("path_kind", ["kvikio", "host"])
@pytest.mark.parametrize("tp", [1, 2])
def test_load_into_cuda_cache(tmp_path, monkeypatch, path_kind, tp):
    if path_kind == "kvikio":
        pytest.importorskip("kvikio")
    monkeypatch.setenv("KVBLOCK_GPU_PATH", path_kind)
    g = Geometry(L, H, D, "bfloat16", BS, head_groups=2)
    store_path = tmp_path / "kv.img"
    create_file(store_path, 256 << 20)
    src = [torch.randn(2, 16, BS, H, D).to(torch.bfloat16) for _ in range(L)]
    keys = [f"g{i}".encode() for i in range(8)]
    with KVStore.format([str(store_path)], g, verify="never", force=True) as store:
        save_blocks(store, keys, VLLMLayout(src), list(range(8)))
        taken = count_reads(store, monkeypatch)
        per = H // tp
        for rank in range(tp):
            dst = [torch.zeros(2, 16, BS, per, D, dtype=torch.bfloat16, device="cuda")
                   for _ in range(L)]
            taken.update(kvikio=0, host=0)
            h = load_blocks(store, keys, VLLMLayout(dst), list(range(8, 16)), tp_rank=rank,
                            tp_size=tp)
            assert h.wait() == 8
            assert store.stats()["gpu_path"] == path_kind
            took(taken, path_kind)        # the path the load took, not only the one chosen
            for layer in range(L):
                want = src[layer][:, :8, :, rank * per:(rank + 1) * per]
                assert torch.equal(dst[layer][:, 8:].cpu().view(torch.int16),
                                   want.view(torch.int16))


def test_verify_always_takes_the_host_path(tmp_path, monkeypatch):
    monkeypatch.delenv("KVBLOCK_GPU_PATH", raising=False)
    from kvblock.io.gpu import gpu_path

    g = Geometry(L, H, D, "bfloat16", BS)
    store_path = tmp_path / "kv.img"
    create_file(store_path, 64 << 20)
    with KVStore.format([str(store_path)], g, verify="always") as store:
        assert gpu_path(store) == "host"


@pytest.mark.parametrize("path_kind", ["kvikio", "host"])
def test_a_layer_handed_over_is_in_place_for_another_stream(tmp_path, monkeypatch, path_kind):
    """wait_layer() hands a layer over once its bytes are in the cache, for
    a consumer on any stream: the host path's last copy (device staging to
    the cache) was left queued on the scatter thread's stream, so a reader
    on another stream could see the old bytes.  Read here on a side stream
    right after each wait_layer, and from a DRAM-tier load too."""
    if path_kind == "kvikio":
        pytest.importorskip("kvikio")
    monkeypatch.setenv("KVBLOCK_GPU_PATH", path_kind)
    g = Geometry(L, H, D, "bfloat16", BS)
    store_path = tmp_path / "kv.img"
    create_file(store_path, 256 << 20)
    n = 64
    src = [torch.randn(2, n, BS, H, D).to(torch.bfloat16) for _ in range(L)]
    keys = [f"s{i}".encode() for i in range(n)]
    for host_cache in (0, 64 << 20):
        with KVStore.format([str(store_path)], g, verify="never", force=True,
                            host_cache_bytes=host_cache or None) as store:
            save_blocks(store, keys, VLLMLayout(src), list(range(n)))
            side = torch.cuda.Stream()
            dst = [torch.zeros(2, n, BS, H, D, dtype=torch.bfloat16, device="cuda")
                   for _ in range(L)]
            h = load_blocks(store, keys, VLLMLayout(dst), list(range(n)))
            seen = []
            with torch.cuda.stream(side):
                for layer in range(L):
                    h.wait_layer(layer)
                    seen.append(dst[layer].clone())      # on the side stream
            side.synchronize()
            assert h.wait() == n
            for layer in range(L):
                assert torch.equal(seen[layer].cpu().view(torch.int16),
                                   src[layer].view(torch.int16)), (host_cache, layer)
