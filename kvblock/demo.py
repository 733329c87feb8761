"""``kvblock demo``: cold recovery of a long prompt's KV versus recomputing it.

1. recompute: a Llama-architecture model (random weights, built in code)
   prefills a long prompt and produces its first tokens;
2. save: the prompt's KV cache goes to a kvblock store (a pre-sized file under
   ./.kvblock/ by default, or ``--device``);
3. cold restore: in a fresh process with no copy of the KV in memory (and the
   store file dropped from the page cache), the store is opened, the prefix
   looked up and loaded layer by layer while the model consumes the layers,
   and the first tokens are produced.

The first generated tokens and their logits must be bit-identical between 1
and 3, or the demo fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext

BLOCK = 16
SALT = "kvblock-demo-llama"
MODEL_CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                    max_position_embeddings=65536)
DECODE_STEPS = 8


def build_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2026)
    return LlamaForCausalLM(LlamaConfig(**MODEL_CONFIG)).eval()


def warm_up(model) -> None:
    """One tiny forward: lazy initialisation belongs to server start-up, not TTFT."""
    import torch

    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long), use_cache=True, logits_to_keep=1)


def make_prompt(tokens: int):
    import torch

    g = torch.Generator().manual_seed(11)
    return torch.randint(0, MODEL_CONFIG["vocab_size"], (1, tokens), generator=g)


def geometry():
    from kvblock import Geometry

    c = MODEL_CONFIG
    return Geometry(c["num_hidden_layers"], c["num_key_value_heads"],
                    c["hidden_size"] // c["num_attention_heads"], "float32", BLOCK)


def split(tokens: int) -> int:
    """Tokens served from the store: whole blocks, leaving at least one prompt
    token to compute (its logits are the first token's)."""
    return (tokens - 1) // BLOCK * BLOCK


def decode(model, cache, ids, start):
    """Feed the prompt from ``start`` on top of ``cache`` and decode greedily.
    Returns (first-token time, logits per step, tokens).  Only the last
    position's logits are computed (``logits_to_keep=1``), as a serving
    engine computes them: the prompt positions' logits are never used."""
    import torch

    with torch.no_grad():
        out = model(ids[:, start:], cache=cache, use_cache=True, logits_to_keep=1)
        first = time.perf_counter()
        logits, tokens = [out.logits[:, -1]], []
        cache = out.cache
        for _ in range(DECODE_STEPS - 1):
            nxt = logits[-1].argmax(-1, keepdim=True)
            tokens.append(int(nxt))
            out = model(nxt, cache=cache, use_cache=True, logits_to_keep=1)
            cache = out.cache
            logits.append(out.logits[:, -1])
        tokens.append(int(logits[-1].argmax(-1)))
    return first, torch.cat(logits), tokens


@contextmanager
def layer_progress(model, label, quiet):
    """A progress bar advanced by each decoder layer's forward."""
    if quiet:
        yield
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(label, total=len(model.model.layers))
        hooks = [layer.register_forward_hook(lambda *a: bar.advance(task))
                 for layer in model.model.layers]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()


def drop_page_cache(path: str) -> None:
    """Drop the store's pages from the OS page cache (reads use O_DIRECT
    anyway; this makes sure nothing cached could help)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_demo(tokens: int = 8192, device: str | None = None, size: int | None = None,
             quiet: bool = False, yes: bool = False, force: bool = False) -> dict:
    import torch

    from kvblock import KVStore, chain_keys, create_file
    from kvblock.bench.store_bench import VerifyError
    from kvblock.errors import ConfigError, KVBlockError
    from kvblock.tensors import HFDynamicLayout, save_blocks

    if tokens < 2 * BLOCK:
        raise ConfigError(f"--tokens must be at least {2 * BLOCK}")
    g = geometry()
    prefix = split(tokens)
    kv_bytes = prefix // BLOCK * g.block_bytes
    if device is not None and not str(device):
        # (`device or the demo's file` took it for no --device, unsized)
        raise ConfigError("--device is empty (an unset variable?): give the raw device, "
                          "loop device or file to use, or leave --device out for "
                          "./.kvblock/demo.img")
    path = device if device is not None else os.path.join(".kvblock", "demo.img")
    if device is not None and size is not None:
        raise ConfigError("--size sizes the demo's own store file (./.kvblock/demo.img); "
                          "a --device is used at its own size: drop one of them")
    if device is None:
        # The size asked for, exactly (a run that does not fit it is refused
        # below, before the model runs); the file is the demo's own store,
        # formatted anew, so one left bigger by an earlier demo is cut to it.
        want = size if size is not None else kv_bytes * 2 + (256 << 20)
        # checked at that size before the file is made or cut: a refused run
        # leaves an earlier demo's file as it was
        _check_run_fits(path, g, prefix // BLOCK, own=True, size=want)
        if size is not None and os.path.isfile(path) and os.path.getsize(path) > want:
            os.truncate(path, want)
        create_file(path, want)
    else:
        from kvblock.store.provision import guard_overwrite

        guard_overwrite(device, "the demo", force=force, yes=yes, allow_model=SALT)
    say = (lambda *a: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))

    # The prefix's run is checked to fit the store, and the store formatted,
    # before the model runs: a --device that is missing or too small is
    # refused at once, not after the whole recompute; and the run is checked
    # against the format's own plan before the format wipes the device (a
    # refused one keeps what it held: an earlier demo's store, or one given
    # --force).
    _check_run_fits(path, g, prefix // BLOCK, own=device is None)
    with KVStore.format([path], g, model=SALT, force=True) as store:
        say(f"building a Llama-architecture model ({MODEL_CONFIG['num_hidden_layers']} "
            f"layers, hidden {MODEL_CONFIG['hidden_size']}, random weights) and a "
            f"{tokens}-token prompt")
        model = build_model()
        warm_up(model)
        ids = make_prompt(tokens)
        keys = chain_keys(ids[0, :prefix].tolist(), BLOCK, salt=SALT)

        # 1. recompute: prefill from scratch, then the rest of the prompt -> first
        # token.  The prefill wants the prefix's KV only: the logits of its
        # positions (8K x 32000 floats at 8K tokens) would add work that no
        # serving engine does.
        t0 = time.perf_counter()
        with layer_progress(model, f"recompute: prefill {prefix} tokens", quiet), \
                torch.no_grad():
            cache = model(ids[:, :prefix], use_cache=True, logits_to_keep=1).cache
        first, want_logits, want_tokens = decode(model, cache, ids, prefix)
        ttft_recompute = first - t0
        say(f"recompute: first token after {ttft_recompute:.2f} s")

        # 2. save the prefix's KV as runs in the store
        t0 = time.perf_counter()
        layout = HFDynamicLayout.from_cache(cache, BLOCK)
        # the decode above appended tokens to the cache; save only the prefix's pages
        saved = save_blocks(store, keys, layout, list(range(len(keys))))
        save_s = time.perf_counter() - t0
        runs = len(store.index.runs)
        engine = store.io.engine.name
    say(f"saved {saved} blocks ({kv_bytes / 2**20:.0f} MiB) in {runs} runs in {save_s:.2f} s")
    del cache, layout
    if os.path.isfile(path):
        drop_page_cache(path)

    # 3. cold restore in a fresh process
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "restore.pt")
        # quiet (--json): its progress is not shown, but its error goes in ours
        res = subprocess.run([sys.executable, "-m", "kvblock.demo", path, str(tokens), out],
                             stderr=None if not quiet else subprocess.PIPE)
        if res.returncode != 0:
            last = (res.stderr or b"").decode(errors="replace").strip().splitlines()
            raise KVBlockError(f"the demo's restore process failed with exit code "
                               f"{res.returncode}" + (f": {last[-1]}" if last else ""))
        got = torch.load(out)
    identical = (got["tokens"] == want_tokens and torch.equal(got["logits"], want_logits))
    report = {
        "model": f"Llama-architecture, {MODEL_CONFIG['num_hidden_layers']} layers, "
                 f"hidden {MODEL_CONFIG['hidden_size']}, random weights",
        "prompt_tokens": tokens, "restored_tokens": got["blocks"] * BLOCK,
        "kv_bytes": kv_bytes, "runs": runs, "engine": engine, "store": path,
        "ttft_recompute_s": round(ttft_recompute, 3),
        "ttft_restore_s": round(got["ttft"], 3),
        "speedup": round(ttft_recompute / got["ttft"], 1),
        "restore_gib_per_s": round(got["bytes_read"] / got["load_s"] / 2**30, 2),
        "time_to_first_layer_s": round(got["first_layer_s"], 4),
        "save_s": round(save_s, 3),
        "first_tokens": want_tokens,
        "identical_tokens_and_logits": identical,
    }
    if not identical:
        raise VerifyError(f"the demo's KV restored from {path} produced different tokens or "
                          f"logits than recompute: {got['tokens']} vs {want_tokens}")
    return report


def _check_run_fits(path: str, g, nblocks: int, own: bool = False,
                    size: int | None = None) -> None:
    """A run of ``nblocks`` must fit the store the demo formats on ``path``
    (StoreFullError, as the store's put says it): refused before the format.
    A ``path`` too small for any store is refused with the least size that
    holds one, and the demo's option that gives it (the store's own advice,
    a smaller region_size, names none the demo takes).  With ``size``: the
    demo's own file as it will be made, of that size (not opened)."""
    from kvblock.devices import Device
    from kvblock.devices.device import FILE_BLOCK_SIZE, said_size
    from kvblock.errors import DeviceTooSmallError
    from kvblock.store.planning import StandIn, check_fits, least_size, plan_for

    if size is not None:
        dev = StandIn(path, FILE_BLOCK_SIZE, size // FILE_BLOCK_SIZE * FILE_BLOCK_SIZE)
        opened = nullcontext(dev)
    else:
        # opened as the format opens it: a device missing, busy or read-only
        # is refused as that, before its size
        opened = Device(path)
    with opened as dev:
        try:
            plan = plan_for([dev], g)
        except DeviceTooSmallError as e:
            # the least size of a store there that holds the run
            least = least_size([StandIn(dev.path, dev.block_size)], g, run_blocks=nblocks)
            if least is None:
                raise
            raise DeviceTooSmallError(
                f"{dev.path}: {said_size(dev)} cannot hold the demo's store: it needs at "
                f"least {least} bytes for a run of {nblocks} blocks; "
                + (f"give --size {least} or more" if own else "use a larger --device"),
                dev.path) from e
    check_fits(plan, g, nblocks)


def _restore_child(path: str, tokens: int, out: str) -> None:
    """The fresh process of step 3."""
    import torch

    from kvblock import KVStore, chain_keys
    from kvblock.integrations.transformers import streaming_cache
    from kvblock.tensors import HFDynamicLayout, load_blocks

    model = build_model()           # server start-up, not part of time to first token
    warm_up(model)
    ids = make_prompt(tokens)
    prefix = split(tokens)
    g = geometry()
    # Room for the rest of the prompt and the decoded tokens after the restored prefix.
    capacity = prefix + (tokens - prefix) + DECODE_STEPS
    layout = HFDynamicLayout.empty(g.num_layers, g.num_kv_heads, capacity, g.head_dim, BLOCK,
                                   torch.float32)
    for t in layout.keys + layout.values:   # touch the destination before timing
        t.fill_(0)
    quiet = not sys.stderr.isatty()
    t0 = time.perf_counter()
    store = KVStore.open([path], geometry=g, model=SALT)
    keys = chain_keys(ids[0, :prefix].tolist(), BLOCK, salt=SALT)
    n = store.lookup(keys)
    if n != len(keys):
        raise SystemExit(f"kvblock demo: only {n} of {len(keys)} blocks found in {path}")
    handle = load_blocks(store, keys, layout, list(range(n)))
    with layer_progress(model, "restore: load + compute layer by layer", quiet):
        cache = streaming_cache(handle, layout, n * BLOCK, config=model.config)
        first, logits, gen = decode(model, cache, ids, n * BLOCK)
    blocks = handle.wait()
    load_s = handle.layer_ready_at[-1]
    store.close()
    torch.save({"ttft": first - t0, "logits": logits, "tokens": gen, "blocks": blocks,
                "bytes_read": handle.bytes_read, "load_s": load_s,
                "first_layer_s": handle.layer_ready_at[0]}, out)


if __name__ == "__main__":
    _restore_child(sys.argv[1], int(sys.argv[2]), sys.argv[3])
