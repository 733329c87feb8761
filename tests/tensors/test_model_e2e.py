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
