"""`kvblock demo` end to end on a short prompt: it must find identical tokens
and logits after the cold restore, and report both times to first token."""

import json
import os
import subprocess
import sys

import pytest

from kvblock.errors import ConfigError

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_short_prompt(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    res = subprocess.run([sys.executable, "-m", "kvblock", "demo", "--tokens", "200", "--json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["identical_tokens_and_logits"] is True
    assert out["restored_tokens"] == 192 and out["prompt_tokens"] == 200
    assert out["ttft_recompute_s"] > 0 and out["ttft_restore_s"] > 0
    assert len(out["first_tokens"]) == 8
    assert (tmp_path / ".kvblock" / "demo.img").is_file()


def test_demo_refuses_a_device_without_yes(tmp_path, loop_device):
    dev = loop_device(64 << 20)
    res = subprocess.run([sys.executable, "-m", "kvblock", "demo", "--device", dev,
                          "--tokens", "64"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 8 and "pass --yes" in res.stderr


def test_demo_refuses_to_format_over_someone_elses_store(tmp_path):
    """--device that holds a store of another model (or a filesystem) is not
    formatted without --force; a previous demo's store needs none."""
    from kvblock import Geometry, KVStore, create_file

    path = tmp_path / "kv.img"
    create_file(path, 64 << 20)
    KVStore.format([str(path)], Geometry(2, 2, 64), model="an-engine").close()
    res = subprocess.run([sys.executable, "-m", "kvblock", "demo", "--device", str(path),
                          "--tokens", "64"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 16, res.stderr
    assert "holds kvblock store" in res.stderr and "--force" in res.stderr
    with KVStore.open([str(path)], model="an-engine") as store:   # untouched
        assert store.geometry == Geometry(2, 2, 64)


def test_demo_refuses_a_size_it_would_ignore(tmp_path, monkeypatch):
    """--size is the size of the demo's own store file: given with --device
    it was accepted and ignored (the device used whole, or a missing one
    refused as not found though a size was given).  A usage error now,
    before anything touches the device."""
    from click.testing import CliRunner

    from kvblock import demo
    from kvblock.cli.main import cli

    ran = []
    monkeypatch.setattr(demo, "run_demo", lambda *a, **kw: ran.append(a) or {})
    path = tmp_path / "kv.img"
    res = CliRunner().invoke(cli, ["demo", "--device", str(path), "--size", "64M",
                                   "--tokens", "64"])
    assert res.exit_code == 2, res.output
    assert "--size" in res.output and "--device" in res.output
    assert not ran and not path.exists()


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _demo_with_child(monkeypatch, tmp_path, child):
    """`kvblock demo --tokens 64 --json` in this process, on a tiny model,
    with ``child(argv)`` standing in for the restore process."""
    from click.testing import CliRunner

    from kvblock import demo
    from kvblock.cli.main import cli

    monkeypatch.setattr(demo, "MODEL_CONFIG", TINY)
    monkeypatch.setattr(demo.subprocess, "run", lambda argv, **kw: child(argv, kw))
    monkeypatch.chdir(tmp_path)
    return CliRunner().invoke(cli, ["demo", "--tokens", "64", "--json"])


def test_a_failed_restore_is_a_one_line_error(monkeypatch, tmp_path):
    """A restore process that failed, or restored KV that gave other tokens
    or logits, raised a bare RuntimeError: a traceback, not the CLI's
    one-line `kvblock: error:` with an exit code.  The failed child's own
    last line of error (not shown under --json) is part of the message."""
    import torch

    def failing(argv, kw):
        if kw.get("stderr") is subprocess.PIPE:
            return subprocess.CompletedProcess(argv, 1, None,
                                               b"noise\nkvblock demo: only 2 of 3 blocks found\n")
        return subprocess.CompletedProcess(argv, 1)

    res = _demo_with_child(monkeypatch, tmp_path, failing)
    assert res.exit_code == 1, (res.exception, res.output)
    assert res.output.startswith("kvblock: error: ") and len(res.output.splitlines()) == 1
    assert "restore process failed with exit code 1" in res.output
    assert "only 2 of 3 blocks found" in res.output, res.output

    def different(argv, kw):
        torch.save({"ttft": 0.1, "logits": torch.zeros(8, TINY["vocab_size"]),
                    "tokens": [1] * 8, "blocks": 3, "bytes_read": 1, "load_s": 0.1,
                    "first_layer_s": 0.01}, argv[-1])
        return subprocess.CompletedProcess(argv, 0)

    res = _demo_with_child(monkeypatch, tmp_path, different)
    assert res.exit_code == 1, (res.exception, res.output)
    assert res.output.startswith("kvblock: error: ") and len(res.output.splitlines()) == 1
    assert "different tokens or logits" in res.output


def test_recompute_computes_no_logits_for_the_prefix(monkeypatch, tmp_path):
    """Time to first token by recompute is the prefill a serving engine does:
    the KV of the prompt and the logits of its last position.  The demo's
    prefill computed the logits of every prompt position (8K x 32000 floats,
    1 GiB, and an LM-head matmul over all of them, 12-25% of the prefill)
    and threw them away, which inflated the recompute time and the
    speed-up."""
    from tests.support.lm_head import watch_lm_head

    rows = watch_lm_head(monkeypatch)
    res = _demo_with_child(monkeypatch, tmp_path,
                           lambda argv, kw: subprocess.CompletedProcess(argv, 1, None, b""))
    assert "restore process failed" in res.output, res.output   # after the recompute
    assert rows and max(rows) == 1, rows


@pytest.mark.parametrize("target", ["missing", "small"])
def test_a_device_that_cannot_hold_the_kv_is_refused_before_the_model_runs(
        monkeypatch, tmp_path, target):
    """A --device that does not exist, or is too small for the prefix's run,
    was refused only when the KV was saved: after the model was built and
    the whole prompt recomputed (15 s at the default 8K tokens on the CI
    machine, minutes on a busy one).  The store is now formatted and the
    run checked to fit it first."""
    from click.testing import CliRunner

    from kvblock import demo
    from kvblock.cli.main import cli

    def no_model():
        raise AssertionError("the model was built before the store was checked")

    monkeypatch.setattr(demo, "build_model", no_model)
    path = tmp_path / "kv.img"
    if target == "small":
        with open(path, "wb") as f:
            f.truncate(8 << 20)             # 31 blocks of 512 KiB do not fit
    res = CliRunner().invoke(cli, ["demo", "--device", str(path), "--tokens", "512", "--json"])
    assert res.exit_code != 0 and res.output.startswith("kvblock: error: "), \
        (res.exception, res.output)
    assert ("no such device or file" if target == "missing" else "does not fit") in res.output


def test_size_is_the_size_of_the_demo_store_file(monkeypatch, tmp_path):
    """--size ("Size of the demo store file") was raised without a word to
    twice the KV plus 256 MiB when it was smaller (--size 8M made a 287 MiB
    file), a bigger file left by an earlier demo was kept at its size, and
    with --device it was ignored.  The file now has the size asked for, one
    too small for the prefix's run is refused before the model runs, and
    --size with --device is a usage error."""
    from click.testing import CliRunner

    from kvblock import demo
    from kvblock.cli.main import cli

    built = []
    monkeypatch.setattr(demo, "build_model", lambda: built.append(1) or 1 / 0)
    monkeypatch.chdir(tmp_path)
    img = tmp_path / ".kvblock" / "demo.img"
    img.parent.mkdir()
    with open(img, "wb") as f:
        f.truncate(400 << 20)               # an earlier, bigger demo's store

    res = CliRunner().invoke(cli, ["demo", "--size", "40M", "--tokens", "64", "--json"])
    assert built and img.stat().st_size == 40 << 20, (res.exception, res.output)

    built.clear()
    res = CliRunner().invoke(cli, ["demo", "--size", "8M", "--tokens", "512", "--json"])
    assert res.exit_code != 0 and res.output.startswith("kvblock: error: "), res.output
    assert "does not fit" in res.output and not built

    dev = tmp_path / "kv.img"
    with open(dev, "wb") as f:
        f.truncate(64 << 20)
    with pytest.raises(ConfigError, match="--size"):       # (the CLI: a usage error)
        demo.run_demo(tokens=64, device=str(dev), size=32 << 20, quiet=True)
    assert not built and dev.stat().st_size == 64 << 20


def test_a_device_that_is_a_directory_is_a_clear_error(monkeypatch, tmp_path):
    """--device naming a directory raised a bare IsADirectoryError from the
    overwrite check's superblock read ("kvblock: error: Is a directory",
    naming no path, exit code of an untyped OSError) where `kvblock format`
    on it says what it is and what to pass.  It is now the store's own
    refusal, a KVBlockError naming the path, before the model runs."""
    from click.testing import CliRunner

    from kvblock import demo
    from kvblock.cli.main import cli
    from kvblock.errors import KVBlockError

    def no_model():
        raise AssertionError("the model was built before the store was checked")

    monkeypatch.setattr(demo, "build_model", no_model)
    folder = tmp_path / "kvdir"
    folder.mkdir()
    with pytest.raises(KVBlockError, match="directory"):
        demo.run_demo(tokens=64, device=str(folder), quiet=True)
    res = CliRunner().invoke(cli, ["demo", "--device", str(folder), "--tokens", "64", "--json"])
    assert res.output.startswith("kvblock: error: ") and str(folder) in res.output, res.output
    assert list(folder.iterdir()) == []


def test_an_empty_device_is_refused_not_taken_for_the_demo_store(monkeypatch, tmp_path):
    """--device '' (an unset shell variable: --device "$DEV") passed the
    overwrite check as a device, then `device or ./.kvblock/demo.img`
    formatted and ran on the demo's own store file, unsized (as a --device
    is used): one too small for the prompt was refused as "does not fit",
    a missing one as "no such device", both naming .kvblock/demo.img,
    which the user never gave.  An empty --device is now a ConfigError,
    and the demo's own file is left alone."""
    from kvblock import Geometry, KVStore, create_file, demo
    from kvblock.errors import ConfigError

    def no_model():
        raise AssertionError("the demo ran on ./.kvblock/demo.img")

    monkeypatch.setattr(demo, "build_model", no_model)
    monkeypatch.chdir(tmp_path)
    img = tmp_path / ".kvblock" / "demo.img"
    create_file(img, 64 << 20)
    KVStore.format([str(img)], Geometry(2, 2, 64), model="earlier").close()
    with pytest.raises(ConfigError, match="--device"):
        demo.run_demo(tokens=64, device="", quiet=True)
    with KVStore.open([str(img)], model="earlier") as store:        # untouched
        assert store.geometry == Geometry(2, 2, 64)


@pytest.mark.parametrize("earlier", ["demo", "engine"])
def test_a_device_too_small_for_the_run_is_refused_before_it_is_formatted(
        monkeypatch, tmp_path, earlier):
    """`demo --device DEV` formatted DEV before it checked that the prompt's
    run fits the store: a device too small for the prompt was refused
    ("does not fit") after its store was wiped -- an earlier demo's store
    (which needs no --force), or an engine's given --force.  The run is now
    checked against the format's own plan first: the refused command leaves
    the device byte-identical."""
    import numpy as np
    from click.testing import CliRunner

    from kvblock import KVStore, demo
    from kvblock.cli.main import cli

    def no_model():
        raise AssertionError("the model was built before the store was checked")

    monkeypatch.setattr(demo, "build_model", no_model)
    path = tmp_path / "kv.img"
    with open(path, "wb") as f:
        f.truncate(8 << 20)                 # 31 blocks of 512 KiB do not fit
    g = demo.geometry() if earlier == "demo" else demo.geometry().__class__(2, 2, 64)
    model = demo.SALT if earlier == "demo" else "an-engine"
    keys = [b"kept-0", b"kept-1"]
    with KVStore.format([str(path)], g, model=model) as store:
        store.put_run(keys, np.full(2 * g.block_bytes, 5, np.uint8))
    before = path.read_bytes()
    res = CliRunner().invoke(cli, ["demo", "--device", str(path), "--tokens", "512", "--json"]
                             + (["--force"] if earlier == "engine" else []))
    assert res.exit_code == 15 and res.output.startswith("kvblock: error: "), \
        (res.exception, res.output)
    assert "does not fit" in res.output
    assert path.read_bytes() == before
    with KVStore.open([str(path)], model=model) as store:
        assert store.lookup(keys) == 2


@pytest.mark.parametrize("target", ["device", "own file"])
def test_a_store_too_small_for_any_store_names_what_the_demo_takes(monkeypatch, tmp_path,
                                                                   target):
    """A --device (or --size) too small for a store at all was refused with
    the store's advice, "use a larger device or a smaller region_size": the
    demo takes no region size.  It now names the least size that holds the
    demo's store, and the option that gives it."""
    from click.testing import CliRunner

    from kvblock import demo
    from kvblock.cli.main import cli

    def no_model():
        raise AssertionError("the model was built before the store was checked")

    monkeypatch.setattr(demo, "build_model", no_model)
    monkeypatch.chdir(tmp_path)
    if target == "device":
        path = tmp_path / "kv.img"
        with open(path, "wb") as f:
            f.truncate(2 << 20)
        args = ["--device", str(path)]
    else:
        args = ["--size", "2M"]
    res = CliRunner().invoke(cli, ["demo", *args, "--tokens", "64", "--json"])
    assert res.exit_code == 7 and res.output.startswith("kvblock: error: "), res.output
    assert "region_size" not in res.output
    least = int(res.output.split("at least ")[1].split()[0])
    assert (f"--size {least}" in res.output) == (target == "own file"), res.output
    assert ("larger --device" in res.output) == (target == "device"), res.output
    if target == "own file":    # the least named holds the demo's store and the prompt's run
        built = []
        monkeypatch.setattr(demo, "build_model", lambda: built.append(1) or 1 / 0)
        res = CliRunner().invoke(cli, ["demo", "--size", str(least), "--tokens", "64", "--json"])
        assert built, res.output


def test_a_refused_size_leaves_the_demo_store_file_as_it_was(monkeypatch, tmp_path):
    """Without --device, a bigger ./.kvblock/demo.img left by an earlier
    demo was cut down to --size before the prefix's run was checked to fit
    it: a run refused as not fitting still cut the file (and, with none
    there, made one).  The size is checked first; a refused run changes
    nothing."""
    from click.testing import CliRunner

    from kvblock import demo
    from kvblock.cli.main import cli

    built = []
    monkeypatch.setattr(demo, "build_model", lambda: built.append(1) or 1 / 0)
    monkeypatch.chdir(tmp_path)
    img = tmp_path / ".kvblock" / "demo.img"
    for args in (["--size", "8M", "--tokens", "512"],     # the run does not fit
                 ["--size", "2M", "--tokens", "64"]):     # no store fits
        res = CliRunner().invoke(cli, ["demo", *args, "--json"])
        assert res.exit_code != 0 and res.output.startswith("kvblock: error: "), res.output
        assert not built and not img.parent.exists(), res.output
    img.parent.mkdir()
    with open(img, "wb") as f:
        f.truncate(400 << 20)               # an earlier, bigger demo's store
    for args in (["--size", "8M", "--tokens", "512"], ["--size", "2M", "--tokens", "64"]):
        res = CliRunner().invoke(cli, ["demo", *args, "--json"])
        assert res.exit_code != 0 and res.output.startswith("kvblock: error: "), res.output
        assert not built and img.stat().st_size == 400 << 20, res.output
