"""Fresh process: open the store, restore the prompt's prefix layer by layer,
continue the prompt and decode; write logits and tokens to argv[2]."""

import sys

import torch

from kvblock import KVStore, chain_keys
from kvblock.tensors import HFDynamicLayout, load_blocks
from tests.tensors.hf_model import BLOCK, continue_from, geometry, model, prompt

m = model()
ids = prompt()
keys = chain_keys(ids[0].tolist(), BLOCK, salt="tiny-llama")
with KVStore.open([sys.argv[1]], geometry=geometry(m), model="tiny-llama") as store:
    n = store.lookup(keys)
    cfg = m.config
    layout = HFDynamicLayout.empty(cfg.num_hidden_layers, cfg.num_key_value_heads, n * BLOCK,
                                   cfg.hidden_size // cfg.num_attention_heads, BLOCK,
                                   torch.float32)
    handle = load_blocks(store, keys[:n], layout, list(range(n)))
    assert handle.wait() == n
logits, tokens = continue_from(m, layout.to_cache(), ids, n * BLOCK)
torch.save({"logits": logits, "tokens": tokens, "restored_blocks": n}, sys.argv[2])
