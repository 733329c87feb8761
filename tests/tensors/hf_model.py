"""A small Llama-architecture model from transformers, random weights built in
code (nothing downloaded), and the two ways to reach its first token after a
prompt: recompute the prefix, or restore it from kvblock."""

from __future__ import annotations

import torch

BLOCK = 16


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


def geometry(m):
    from kvblock import Geometry

    cfg = m.config
    return Geometry(cfg.num_hidden_layers, cfg.num_key_value_heads,
                    cfg.hidden_size // cfg.num_attention_heads, "float32", BLOCK)


def prompt(n=3 * BLOCK + 5):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 512, (1, n), generator=g)


@torch.no_grad()
def continue_from(m, cache, ids, start, steps=4):
    """Feed ids[:, start:] on top of ``cache``, then decode ``steps`` tokens
    greedily.  Returns (logits of every step, generated token ids)."""
    out = m(ids[:, start:], cache=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    tokens = []
    cache = out.cache
    for _ in range(steps):
        nxt = logits[-1].argmax(-1, keepdim=True)
        tokens.append(int(nxt))
        out = m(nxt, cache=cache, use_cache=True)
        cache = out.cache
        logits.append(out.logits[:, -1])
    return torch.cat(logits), tokens


@torch.no_grad()
def prefill(m, ids):
    return m(ids, use_cache=True).cache
