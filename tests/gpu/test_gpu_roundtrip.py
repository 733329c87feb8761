"""GPU caches end to end (needs CUDA; run by perf/gpu_check.sh on a GPU machine).

test_gpu_path.py loads into CUDA caches from host-written KV; these save
from CUDA caches too (torch and cupy), let the store choose its GPU path
itself, and check that a corrupt range never reaches GPU memory."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from kvblock import Geometry, KVStore  # noqa: E402
from kvblock.index import normalize_keys  # noqa: E402
from kvblock.io.gpu import GPU_PATHS  # noqa: E402
from kvblock.tensors import VLLMLayout, load_blocks, save_blocks  # noqa: E402
from tests.store.test_corruption import _flip  # noqa: E402
from tests.support.gpu import bits  # noqa: E402

L, H, D, BS = 4, 8, 128, 16


def _pages(n, order="NHD", device="cuda", fill=None):
    shape = (2, n, BS, H, D) if order == "NHD" else (2, n, H, BS, D)
    if fill == "zeros":
        return [torch.zeros(*shape, dtype=torch.bfloat16, device=device) for _ in range(L)]
    return [torch.randn(*shape, device=device).to(torch.bfloat16) for _ in range(L)]


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("path_kind", ["kvikio", "host"])
def test_kv_saved_from_a_cuda_cache_reads_back_on_host_and_gpu(path, monkeypatch, path_kind,
                                                               order):
    """save_blocks gathers from CUDA memory: the bytes on the device are the
    cache's (read back into a CPU cache), and a load into another CUDA
    cache through either GPU path returns them, at other page ids, leaving
    the pages outside them untouched."""
    if path_kind == "kvikio":
        pytest.importorskip("kvikio")
    monkeypatch.setenv("KVBLOCK_GPU_PATH", path_kind)
    n = 24
    src = _pages(n, order)
    keys = [f"c{i}".encode() for i in range(n)]
    with KVStore.format([str(path)], Geometry(L, H, D, "bfloat16", BS), verify="never",
                        force=True) as store:
        assert save_blocks(store, keys, VLLMLayout(src, order), list(range(n))) == n
        host = _pages(n, order, device="cpu", fill="zeros")
        assert load_blocks(store, keys, VLLMLayout(host, order), list(range(n))).wait() == n
        for layer in range(L):
            assert torch.equal(host[layer].view(torch.int16), bits(src[layer])), layer
        dst = _pages(2 * n, order, fill="zeros")
        ids = list(range(2 * n - 1, n - 1, -1))          # reversed, in the upper half
        assert load_blocks(store, keys, VLLMLayout(dst, order), ids).wait() == n
        assert store.stats()["gpu_path"] == path_kind
        for layer in range(L):
            assert torch.equal(bits(dst[layer][:, ids]), bits(src[layer])), layer
            assert not dst[layer][:, :n].any(), layer


def test_a_cupy_cache_round_trips(path):
    """A cupy cache (raw 16-bit words: cupy has no bfloat16) saves and
    loads on its own device's stream, bytes identical."""
    cupy = pytest.importorskip("cupy")
    n = 16
    rng = np.random.default_rng(7)
    src = [cupy.asarray(rng.integers(-2**15, 2**15, size=(2, n, BS, H, D), dtype=np.int16))
           for _ in range(L)]
    keys = [f"p{i}".encode() for i in range(n)]
    with KVStore.format([str(path)], Geometry(L, H, D, "bfloat16", BS), force=True) as store:
        assert save_blocks(store, keys, VLLMLayout(src), list(range(n))) == n
        dst = [cupy.zeros((2, n, BS, H, D), dtype=cupy.int16) for _ in range(L)]
        assert load_blocks(store, keys, VLLMLayout(dst), list(range(n))).wait() == n
        for layer in range(L):
            assert bool(cupy.array_equal(dst[layer], src[layer])), layer


def test_the_store_chooses_a_gpu_path_itself_and_loads_the_same_bytes(path, monkeypatch):
    """With no override and verify='never' the store times both paths on
    the cache's GPU and keeps one (named in stats with its reason); the
    load through it is byte-identical."""
    monkeypatch.delenv("KVBLOCK_GPU_PATH", raising=False)
    n = 32
    src = _pages(n, device="cpu")
    keys = [f"a{i}".encode() for i in range(n)]
    with KVStore.format([str(path)], Geometry(L, H, D, "bfloat16", BS), verify="never",
                        force=True) as store:
        save_blocks(store, keys, VLLMLayout(src), list(range(n)))
        dst = _pages(n, fill="zeros")
        assert load_blocks(store, keys, VLLMLayout(dst), list(range(n))).wait() == n
        stats = store.stats()
        assert stats["gpu_path"] in GPU_PATHS, stats
        print("chosen:", stats["gpu_path"], stats.get("gpu_path_reason"))
        for layer in range(L):
            assert torch.equal(bits(dst[layer]), src[layer].view(torch.int16)), layer


def test_a_corrupt_range_never_reaches_gpu_memory(path):
    """A flipped byte inside run b (verify='always', the default): a load
    of a+b into a CUDA cache hands over run a only (b's pages are not
    counted as loaded), and the failure is counted."""
    n = 4
    src = _pages(3 * n, device="cpu")
    a, b = ([f"{x}{i}".encode() for i in range(n)] for x in "ab")
    with KVStore.format([str(path)], Geometry(L, H, D, "bfloat16", BS), region_size=1 << 20,
                        force=True) as store:
        save_blocks(store, a, VLLMLayout(src), list(range(n)))
        save_blocks(store, b, VLLMLayout(src), list(range(n, 2 * n)))
        run_b = store.index.runs[max(r.run_id for r in store.index.runs.values()
                                     if r.keys.startswith(normalize_keys(b)[0]))]
        lay = store.layout(n)
        _, off = store.regions.address(run_b.region, run_b.offset)
        at = off + lay.range_offset(1, 0) + store.geometry.group_block_bytes + 100
    _flip(path, at)
    with KVStore.open([str(path)]) as store:
        dst = _pages(3 * n, fill="zeros")
        assert load_blocks(store, a + b, VLLMLayout(dst), list(range(2 * n))).wait() == n
        assert store.counters["checksum_failures"] == 1
        for layer in range(L):
            assert torch.equal(bits(dst[layer][:, :n]), src[layer][:, :n].view(torch.int16))
        assert store.lookup(a + b) == n           # run b dropped: the next lookup stops at a


@pytest.mark.parametrize("path_kind", ["kvikio", "host"])
def test_a_served_store_loads_into_cuda_on_each_rank(tmp_path, path, monkeypatch, path_kind):
    """Ranks of one served store (kvblock serve) read the runs the server
    published straight into their CUDA caches, each its own TP slice of
    heads, through either GPU path (kvikio opens the devices the server
    handed over), bytes identical."""
    from kvblock.store.client import RemoteStore
    from kvblock.store.server import serve_in_background

    if path_kind == "kvikio":
        pytest.importorskip("kvikio")
    monkeypatch.setenv("KVBLOCK_GPU_PATH", path_kind)
    g = Geometry(L, H, D, "bfloat16", BS, head_groups=2)
    KVStore.format([str(path)], g, force=True).close()
    sock = str(tmp_path / "kv.sock")
    server = serve_in_background([str(path)], sock, verify="never")
    n, tp = 16, 2
    src = _pages(n, device="cpu")
    keys = [f"r{i}".encode() for i in range(n)]
    try:
        with RemoteStore(sock) as writer:
            assert save_blocks(writer, keys, VLLMLayout(src), list(range(n))) == n
        per = H // tp
        for rank in range(tp):
            with RemoteStore(sock) as store:
                dst = [torch.zeros(2, n, BS, per, D, dtype=torch.bfloat16, device="cuda")
                       for _ in range(L)]
                h = load_blocks(store, keys, VLLMLayout(dst), list(range(n)), tp_rank=rank,
                                tp_size=tp)
                assert h.wait() == n
                assert store.stats()["client"]["gpu_path"] == path_kind
                # the path the load took: the kvikio one opens the rank's reader
                assert (getattr(store, "_kvikio", None) is not None) == (path_kind == "kvikio")
                for layer in range(L):
                    want = src[layer][..., rank * per:(rank + 1) * per, :]
                    assert torch.equal(bits(dst[layer]), want.view(torch.int16)), (rank, layer)
    finally:
        server.stop()
