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
