"""A real transformer (Llama architecture, random weights): its prefill KV saved
to kvblock, restored in a new process, gives exactly the logits and tokens of
recomputing the prefix (several runs, partial last block)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvblock import KVStore, chain_keys, create_file  # noqa: E402
from kvblock.tensors import HFDynamicLayout, save_blocks  # noqa: E402
from tests.tensors.hf_model import BLOCK, continue_from, geometry, model, prefill, prompt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_restored_prefix_gives_identical_logits(tmp_path):
    m = model()
    ids = prompt()                      # 3 full blocks + 5 tokens
    full = ids.shape[1] // BLOCK
    keys = chain_keys(ids[0].tolist(), BLOCK, salt="tiny-llama")
    assert len(keys) == full == 3
    path = tmp_path / "kv.img"
    create_file(path, 32 << 20)
    cache = prefill(m, ids[:, :full * BLOCK])
    with KVStore.format([str(path)], geometry(m), model="tiny-llama",
                        region_size=1 << 20) as store:
        layout = HFDynamicLayout.from_cache(cache, BLOCK)
        assert save_blocks(store, keys[:2], layout, [0, 1]) == 2   # run 1: blocks 0-1
        assert save_blocks(store, keys[2:], layout, [2]) == 1      # run 2: block 2
        assert len(store.index.runs) == 2
    # recompute: the same prefix prefilled from scratch, then the rest of the prompt
    want_logits, want_tokens = continue_from(m, prefill(m, ids[:, :full * BLOCK]), ids,
                                             full * BLOCK)
    out = tmp_path / "restored.pt"
    res = subprocess.run([sys.executable, "-m", "tests.tensors.restore_child", str(path),
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got = torch.load(out)
    assert got["restored_blocks"] == 3
    assert got["tokens"] == want_tokens
    assert torch.equal(got["logits"], want_logits)


def test_streaming_cache_consumes_layers_while_loading(tmp_path):
    """The model runs on a cache whose layers arrive one by one from a slowed
    device: same logits as recomputing, and layer 0 was consumed before the
    last layer had been read."""
    import time

    from kvblock.integrations.transformers import streaming_cache
    from kvblock.store.storeio import StoreIO
    from kvblock.tensors import load_blocks

    class SlowIO(StoreIO):
        # slow enough that the last layer lands well after layer 0 has been
        # computed, also on a loaded machine (0.05 s lost that race once)
        def read(self, batch):
            time.sleep(0.25)
            super().read(batch)

    m = model()
    ids = prompt()
    keys = chain_keys(ids[0].tolist(), BLOCK, salt="tiny-llama")
    path = tmp_path / "kv.img"
    create_file(path, 32 << 20)
    cache = prefill(m, ids[:, :3 * BLOCK])
    with KVStore.format([str(path)], geometry(m), region_size=1 << 20) as store:
        save_blocks(store, keys, HFDynamicLayout.from_cache(cache, BLOCK), [0, 1, 2])
    want_logits, want_tokens = continue_from(m, prefill(m, ids[:, :3 * BLOCK]), ids, 3 * BLOCK)
    consumed = {}
    def mark(i):
        def hook(module, args):
            consumed.setdefault(i, time.perf_counter())
        return hook

    for i, layer in enumerate(m.model.layers):
        layer.register_forward_pre_hook(mark(i))
    with KVStore.open([str(path)], storeio_factory=SlowIO) as store:
        cfg = m.config
        layout = HFDynamicLayout.empty(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                       3 * BLOCK, cfg.hidden_size // cfg.num_attention_heads,
                                       BLOCK, torch.float32)
        handle = load_blocks(store, keys, layout, [0, 1, 2])
        logits, tokens = continue_from(m, streaming_cache(handle, layout), ids, 3 * BLOCK)
        assert handle.wait() == 3
    assert tokens == want_tokens and torch.equal(logits, want_logits)
    last_layer_read = handle.started_at + handle.layer_ready_at[-1]
    assert consumed[1] < last_layer_read  # layer 0 computed on restored KV before the last layer landed


def test_streaming_cache_refuses_a_prefix_that_did_not_all_arrive(tmp_path):
    """A run of the prefix fails its checksum (one layer's range): the
    model must never attend to what was not restored (zeros here): the
    forward raises PartialLoadError naming where to recompute from."""
    from kvblock.errors import PartialLoadError
    from kvblock.integrations.transformers import streaming_cache
    from kvblock.tensors import load_blocks

    m = model()
    ids = prompt()
    keys = chain_keys(ids[0].tolist(), BLOCK, salt="tiny-llama")[:3]
    path = tmp_path / "kv.img"
    create_file(path, 32 << 20)
    src = HFDynamicLayout.from_cache(prefill(m, ids[:, :3 * BLOCK]), BLOCK)
    with KVStore.format([str(path)], geometry(m), region_size=1 << 20) as store:
        save_blocks(store, keys[:2], src, [0, 1])        # one run of blocks 0-1
        save_blocks(store, keys[2:], src, [2])           # one of block 2
        run = [r for r in store.index.runs.values() if r.nblocks == 1][0]
        _, off = store.regions.address(run.region, run.offset)
        at = off + store.layout(1).range_offset(1, 0) + 8     # its layer 1
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    with KVStore.open([str(path)]) as store:
        cfg = m.config
        layout = HFDynamicLayout.empty(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                       3 * BLOCK, cfg.hidden_size // cfg.num_attention_heads,
                                       BLOCK, torch.float32)
        handle = load_blocks(store, keys, layout, [0, 1, 2])
        with pytest.raises(PartialLoadError, match=f"recompute from token {2 * BLOCK}"):
            continue_from(m, streaming_cache(handle, layout), ids, 3 * BLOCK)
        assert handle.wait() == 2 and store.counters["checksum_failures"] == 1


def test_streaming_cache_crops_and_selects_like_a_dynamic_cache(tmp_path):
    """Assisted generation crops rejected draft tokens (DynamicCache.crop);
    beam search selects and repeats batch rows.  The streaming cache keeps
    its own length and spare room: each must act on those, giving what a
    plain DynamicCache gives."""
    from transformers import DynamicCache

    from kvblock import Geometry
    from kvblock.integrations.transformers import streaming_cache
    from kvblock.tensors import load_blocks

    bs, heads, dim = 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    src = HFDynamicLayout([torch.randn(1, heads, 2 * bs, dim, generator=gen)],
                          [torch.randn(1, heads, 2 * bs, dim, generator=gen)], bs)
    path = tmp_path / "kv.img"
    create_file(path, 8 << 20)
    with KVStore.format([str(path)], Geometry(1, heads, dim, "float32", bs),
                        region_size=1 << 20) as store:
        save_blocks(store, [b"a", b"b"], src, [0, 1])
        dst = HFDynamicLayout.empty(1, heads, 2 * bs + 8, dim, bs, torch.float32)
        handle = load_blocks(store, [b"a", b"b"], dst, [0, 1])
        cache = streaming_cache(handle, dst, 2 * bs)
        ref = DynamicCache()
        ref.update(src.keys[0].clone(), src.values[0].clone(), 0)
        draft, new = torch.randn(1, heads, 3, dim), torch.randn(1, heads, 1, dim)
        for c in (cache, ref):
            c.update(draft, draft, 0)
            c.crop(-1)                              # the last draft token rejected
            assert c.get_seq_length() == 2 * bs + 2
        for c in (cache, ref):
            c.update(new, new, 0)
        assert torch.equal(cache.layers[0].keys, ref.layers[0].keys)
        for c in (cache, ref):
            c.batch_repeat_interleave(2)
            c.batch_select_indices(torch.tensor([1]))
            c.update(new, new, 0)
        assert torch.equal(cache.layers[0].keys, ref.layers[0].keys)
        assert torch.equal(cache.layers[0].values, ref.layers[0].values)


def test_streaming_cache_reorders_beams_like_a_dynamic_cache(tmp_path):
    """Beam search reorders the cache's batch rows after each step
    (Cache.reorder_cache): the streaming cache must keep that order in the
    tensors it grows, as a plain DynamicCache does, not lose it at the next
    update."""
    from transformers import DynamicCache

    from kvblock import Geometry
    from kvblock.integrations.transformers import streaming_cache
    from kvblock.tensors import load_blocks

    bs, heads, dim = 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    src = HFDynamicLayout([torch.randn(1, heads, 2 * bs, dim, generator=gen)],
                          [torch.randn(1, heads, 2 * bs, dim, generator=gen)], bs)
    path = tmp_path / "kv.img"
    create_file(path, 8 << 20)
    with KVStore.format([str(path)], Geometry(1, heads, dim, "float32", bs),
                        region_size=1 << 20) as store:
        save_blocks(store, [b"a", b"b"], src, [0, 1])
        dst = HFDynamicLayout.empty(1, heads, 2 * bs + 8, dim, bs, torch.float32)
        cache = streaming_cache(load_blocks(store, [b"a", b"b"], dst, [0, 1]), dst, 2 * bs)
        ref = DynamicCache()
        ref.update(src.keys[0].clone(), src.values[0].clone(), 0)
        step = torch.randn(2, heads, 1, dim, generator=gen)     # a different token per beam
        for c in (cache, ref):
            c.batch_repeat_interleave(2)
            c.update(step, step, 0)
            c.reorder_cache(torch.tensor([1, 1]))              # beam 1 wins both places
            c.update(step, step, 0)
        assert torch.equal(cache.layers[0].keys, ref.layers[0].keys)
        assert torch.equal(cache.layers[0].values, ref.layers[0].values)


def test_streaming_cache_reset_after_a_failed_load_starts_afresh(tmp_path):
    """A load that failed (EIO on a layer's range) fails the restored
    layers; after reset() (or a crop of every restored token) the cache
    holds nothing of the load, so a fresh generation on it must run.  Each
    layer's update re-raised the old load error, so the cache could never
    be used again."""
    from kvblock import Geometry
    from kvblock.errors import IOFailedError
    from kvblock.integrations.transformers import streaming_cache
    from kvblock.tensors import load_blocks
    from tests.support.faults import BadSectors

    bs, heads, dim = 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    src = HFDynamicLayout([torch.randn(1, heads, 2 * bs, dim, generator=gen) for _ in range(2)],
                          [torch.randn(1, heads, 2 * bs, dim, generator=gen) for _ in range(2)],
                          bs)
    path = tmp_path / "kv.img"
    create_file(path, 8 << 20)
    with KVStore.format([str(path)], Geometry(2, heads, dim, "float32", bs),
                        region_size=1 << 20) as store:
        save_blocks(store, [b"a", b"b"], src, [0, 1])
        run = next(iter(store.index.runs.values()))
        dev, off = store.regions.address(run.region, run.offset)
        bad = BadSectors()
        bad.add(dev, off + store.layout(2).range_offset(1, 0), 4096)
        bad.install(store)
        for cut in ("reset", "crop"):
            dst = HFDynamicLayout.empty(2, heads, 2 * bs + 8, dim, bs, torch.float32)
            handle = load_blocks(store, [b"a", b"b"], dst, [0, 1])
            cache = streaming_cache(handle, dst, 2 * bs)
            with pytest.raises(IOFailedError):       # (layer 1 is never handed over)
                cache.update(src.keys[0][:, :, :1], src.values[0][:, :, :1], 1)
            if cut == "reset":
                cache.reset()
            else:
                cache.crop(-2 * bs)
            new = torch.randn(1, heads, 3, dim, generator=gen)
            for layer in range(2):
                k, v = cache.update(new, -new, layer)
                assert torch.equal(k, new) and torch.equal(v, -new)
            assert cache.get_seq_length() == 3
            store.delete([b"a", b"b"])
            save_blocks(store, [b"a", b"b"], src, [0, 1])
            run = max(store.index.runs.values(), key=lambda r: r.run_id)
            dev, off = store.regions.address(run.region, run.offset)
            bad.add(dev, off + store.layout(2).range_offset(1, 0), 4096)



def test_streaming_cache_iterated_or_read_waits_for_its_layers(tmp_path):
    """DynamicCache.__iter__ (and code reading ``layer.keys``) reads each
    layer's tensors: they must be the restored KV, not what the cache held
    before its layer arrived.  Only update() and the batch operations
    waited, so iterating a cache whose load was in flight gave zeros."""
    from kvblock.integrations.transformers import streaming_cache
    from kvblock.tensors import LoadHandle

    bs, heads, dim = 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    src = HFDynamicLayout([torch.randn(1, heads, 2 * bs, dim, generator=gen) for _ in range(2)],
                          [torch.randn(1, heads, 2 * bs, dim, generator=gen) for _ in range(2)],
                          bs)
    dst = HFDynamicLayout.empty(2, heads, 2 * bs, dim, bs, torch.float32)

    class Arriving(LoadHandle):
        """A load whose layer lands when it is waited for (in flight till then)."""

        def wait_layer(self, layer, timeout=None):
            if not self._events[layer].is_set():
                dst.keys[layer].copy_(src.keys[layer])
                dst.values[layer].copy_(src.values[layer])
                self._events[layer].set()
            return super().wait_layer(layer, timeout)

    cache = streaming_cache(Arriving(2, 2), dst)
    assert cache.get_seq_length() == 2 * bs       # known before any layer arrives
    got = [(k.clone(), v.clone()) for k, v, _ in cache]
    for layer, (k, v) in enumerate(got):
        assert torch.equal(k, src.keys[layer]) and torch.equal(v, src.values[layer])
    cache = streaming_cache(Arriving(2, 2), dst := HFDynamicLayout.empty(
        2, heads, 2 * bs, dim, bs, torch.float32))
    assert torch.equal(cache.layers[1].values, src.values[1])


@pytest.mark.parametrize("length", [3 * 4, -1, 1.5])
def test_streaming_cache_of_a_length_the_layout_does_not_hold_is_a_clear_error(length):
    """A length past the layout's tensors (or negative, or not a whole
    count) is the caller's mistake: it raised PartialLoadError blaming a
    checksum failure or an eviction when the model reached a layer."""
    from kvblock.errors import ConfigError
    from kvblock.integrations.transformers import streaming_cache
    from kvblock.tensors import LoadHandle

    dst = HFDynamicLayout.empty(2, 2, 2 * 4, 8, 4, torch.float32)
    with pytest.raises(ConfigError, match=rf"length {length!r}.* 8 tokens"):
        streaming_cache(LoadHandle(2, 2), dst, length)


@pytest.mark.parametrize("wrong", ["layers", "dtype", "dtype_no_spare", "heads", "head_dim",
                                   "batch"])
def test_streaming_cache_of_another_models_layout_is_a_clear_error(wrong):
    """A layout cut for another model (fewer layers, another dtype, other
    KV heads or head size) ran the model into torch's own RuntimeError deep
    in attention (a shape or dtype mismatch), or, for a dtype whose layout
    had no spare room, was accepted: the new tokens were concatenated by
    type promotion onto KV of the other precision.  The model's first
    update of a layer that does not fit is refused as a ConfigError."""
    from kvblock.errors import ConfigError
    from kvblock.integrations.transformers import streaming_cache
    from kvblock.tensors import LoadHandle

    m = model()                          # 3 layers, 2 KV heads of 16, float32
    ids = prompt(2 * BLOCK + 3)
    shape = dict(num_layers=3, heads=2, tokens=3 * BLOCK, head_dim=16, dtype=torch.float32)
    if wrong == "layers":
        shape["num_layers"] = 2
    elif wrong == "dtype":
        shape["dtype"] = torch.bfloat16
    elif wrong == "dtype_no_spare":
        shape.update(dtype=torch.bfloat16, tokens=2 * BLOCK)
    elif wrong == "heads":
        shape["heads"] = 4
    elif wrong == "head_dim":
        shape["head_dim"] = 8
    layout = HFDynamicLayout.empty(block_tokens=BLOCK, **shape)
    handle = LoadHandle(shape["num_layers"], 2)
    for e in handle._events:             # the load has landed
        e.set()
    cache = streaming_cache(handle, layout, 2 * BLOCK)
    if wrong == "batch":                 # two prompts on a cache restored for one
        ids = ids.repeat(2, 1)
    with pytest.raises(ConfigError, match="layout"):
        continue_from(m, cache, ids, 2 * BLOCK)


def test_streaming_cache_of_a_deeper_layout_than_the_model_is_a_clear_error():
    """A layout of more layers than the model (another model's KV, cut for
    4 layers, under a 3-layer model) was accepted silently: the model
    updates only its own layers, none past them, and decoded on KV not of
    it.  Given the model's config, streaming_cache refuses it up front;
    without one the model's next forward (layer 0 again after a pass that
    stopped at layer 2) is refused, naming both counts."""
    from kvblock.errors import ConfigError
    from kvblock.integrations.transformers import streaming_cache
    from kvblock.tensors import LoadHandle

    m = model()                          # 3 layers, 2 KV heads of 16, float32
    ids = prompt(2 * BLOCK + 3)

    def cache(layers, **kw):
        layout = HFDynamicLayout.empty(layers, 2, 3 * BLOCK, 16, BLOCK, torch.float32)
        handle = LoadHandle(layers, 2)
        for e in handle._events:         # the load has landed
            e.set()
        return streaming_cache(handle, layout, 2 * BLOCK, **kw)

    for config in (m.config, m):
        with pytest.raises(ConfigError, match="model has 3 layers, the layout holds 4"):
            cache(4, config=config)
    with pytest.raises(ConfigError, match="model has 3 layers, the layout holds 2"):
        cache(2, config=m.config)
    with pytest.raises(ConfigError, match="model has 3 layers, the layout holds 4"):
        continue_from(m, cache(4), ids, 2 * BLOCK, steps=1)
    continue_from(m, cache(3, config=m.config), ids, 2 * BLOCK, steps=1)  # its own: runs


def test_streaming_cache_given_the_config_lets_a_pass_stop_short():
    """Early-exit drafting runs the first layers only, on the same cache:
    without a config that reads as a model of fewer layers (refused at the
    next pass); with the model's config checked up front, the depth is
    known and such passes run."""
    from kvblock.errors import ConfigError
    from kvblock.integrations.transformers import streaming_cache
    from kvblock.tensors import LoadHandle

    def cache(**kw):
        layout = HFDynamicLayout.empty(3, 2, 3 * BLOCK, 16, BLOCK, torch.float32)
        handle = LoadHandle(3, 2)
        for e in handle._events:
            e.set()
        return streaming_cache(handle, layout, 2 * BLOCK, **kw)

    kv = torch.zeros(1, 2, 1, 16)
    guessed, given = cache(), cache(config=model().config)
    for c in (guessed, given):
        for layer in (0, 1):             # a pass of the first two layers (the draft's)
            c.update(kv, kv, layer)
    with pytest.raises(ConfigError, match="model has 2 layers, the layout holds 3"):
        guessed.update(kv, kv, 0)
    given.update(kv, kv, 0)              # the next pass: the depth was given
    assert given.layers[0].keys.shape[-2] == 2 * BLOCK + 2


def test_streaming_cache_of_another_engines_layout_is_a_clear_error():
    """streaming_cache builds a transformers cache over an HFDynamicLayout's
    tensors; given another layout (a vLLM one, the engine's paged cache) it
    raised AttributeError ('VLLMLayout' object has no attribute 'tokens')."""
    from kvblock.errors import ConfigError
    from kvblock.integrations.transformers import streaming_cache
    from kvblock.tensors import LoadHandle, VLLMLayout

    layout = VLLMLayout([torch.zeros(2, 4, BLOCK, 2, 8)], "NHD")
    with pytest.raises(ConfigError, match="HFDynamicLayout"):
        streaming_cache(LoadHandle(1, 1), layout, BLOCK)


def _landed_cache(layers=3, handle=None, **kw):
    """A streaming cache over an empty 3-layer layout whose load has landed."""
    from kvblock.integrations.transformers import streaming_cache
    from kvblock.tensors import LoadHandle

    layout = HFDynamicLayout.empty(layers, 2, 3 * BLOCK, 16, BLOCK, torch.float32)
    handle = handle or LoadHandle(layers, 2)
    for e in handle._events:
        e.set()
    return streaming_cache(handle, layout, 2 * BLOCK, **kw)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_streaming_cache_runs_a_retry_after_a_forward_interrupted_in_a_layers_wait(error):
    """A forward interrupted while layer 1 waited for its KV (Ctrl-C during
    the restore; any error there) had updated layer 0 only: the retry (layer
    0 again) was refused as a model of 1 layer under a layout of 3.  The
    cache takes back what the failed forward wrote: the retry runs, with
    the logits of a cache that never saw the failed forward."""
    from kvblock.tensors import LoadHandle

    class Interrupted(LoadHandle):
        fired = False

        def wait_layer(self, layer, timeout=None):
            if layer == 1 and not self.fired:
                self.fired = True
                raise error("interrupted (test)")
            return super().wait_layer(layer, timeout)

    m = model()
    ids = prompt(2 * BLOCK + 3)
    cache = _landed_cache(handle=Interrupted(3, 2))
    with pytest.raises(error, match="interrupted"):
        continue_from(m, cache, ids, 2 * BLOCK, steps=0)
    assert [layer.length for layer in cache.layers] == [2 * BLOCK] * 3
    got = continue_from(m, cache, ids, 2 * BLOCK, steps=2)
    want = continue_from(m, _landed_cache(), ids, 2 * BLOCK, steps=2)
    assert got[1] == want[1] and torch.equal(got[0], want[0])


@pytest.mark.parametrize("after_a_whole_forward", [False, True])
def test_streaming_cache_does_not_blame_the_layout_for_a_forward_that_raised(
        after_a_whole_forward):
    """A forward that raised in the model's own code in layer 1 (past the
    cache's update there) left layers 0 and 1 holding its tokens.  Its
    retry was refused as "the model has 2 layers, the layout holds 3: the
    layout is not of this model's KV", though the layout is: once a forward
    reached the last layer the depth is known, and the cache says the last
    forward stopped partway (its tokens in some layers only), not that the
    layout is wrong; before any whole forward it names both causes."""
    from kvblock.errors import ConfigError

    m = model()
    ids = prompt(2 * BLOCK + 3)
    cache = _landed_cache()
    start = 2 * BLOCK
    if after_a_whole_forward:
        continue_from(m, cache, ids, start, steps=0)
        ids, start = torch.cat([ids, ids[:, -1:]], dim=1), ids.shape[1]
    fired = []

    def boom(module, args, out):
        if not fired:
            fired.append(1)
            raise RuntimeError("boom (test)")
    hook = m.model.layers[1].register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            continue_from(m, cache, ids, start, steps=0)
    finally:
        hook.remove()
    with pytest.raises(ConfigError) as e:
        continue_from(m, cache, ids, start, steps=0)
    assert "raised" in str(e.value)
    if after_a_whole_forward:
        assert "not of this model" not in str(e.value)
        assert "layout holds" not in str(e.value)
