"""Which path a load into CUDA memory takes (kvblock.io.gpu.gpu_path),
decided without a GPU: the environment override, and verify="always",
whose checksums are computed on the host, winning over it."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kvblock.errors import ConfigError
from kvblock.io.gpu import gpu_path


def _store(verify):
    def no_kvikio():
        raise AssertionError("kvikio must not be opened for this choice")
    return SimpleNamespace(verify=verify, _kvikio_reader=no_kvikio)


@pytest.mark.parametrize("forced,verify,want", [("host", "never", "host"),
                                                ("kvikio", "never", "kvikio"),
                                                ("host", "always", "host"),
                                                ("kvikio", "always", "host")])
def test_the_override_and_verify(monkeypatch, caplog, forced, verify, want):
    monkeypatch.setenv("KVBLOCK_GPU_PATH", forced)
    store = _store(verify)
    with caplog.at_level(logging.WARNING, logger="kvblock"):
        assert gpu_path(store) == want
    assert gpu_path(store) == want                    # cached on the store
    ignored = forced == "kvikio" and verify == "always"
    assert ("KVBLOCK_GPU_PATH=kvikio ignored" in caplog.text) == ignored


def test_verify_always_reads_on_the_host_without_an_override(monkeypatch):
    monkeypatch.delenv("KVBLOCK_GPU_PATH", raising=False)
    assert gpu_path(_store("always")) == "host"


def test_a_bad_override_is_refused(monkeypatch):
    monkeypatch.setenv("KVBLOCK_GPU_PATH", "bogus")
    with pytest.raises(ConfigError, match="KVBLOCK_GPU_PATH must be one of"):
        gpu_path(_store("never"))
