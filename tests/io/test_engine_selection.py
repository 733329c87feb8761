"""Engine choice: io_uring when the kernel allows it, the thread engine when a
seccomp profile forbids io_uring_setup, and KVBLOCK_IO_ENGINE to override."""

import json
import os
import subprocess
import sys

import pytest

import kvblock
from kvblock.errors import ConfigError, EngineUnavailableError
from tests.support import seccomp

CHILD = r"""
import json, os, sys
from tests.support.seccomp import block_io_uring
block_io_uring(kill=bool(os.environ.get("KVB_TEST_KILL_ON_URING")))
import numpy as np
import kvblock
from kvblock import Device, HostBuffer, IOBatch, open_engine
out = {"report": kvblock.engine_report()}
try:
    with Device(sys.argv[1]) as dev, open_engine([dev]) as eng, HostBuffer(65536) as a, \
            HostBuffer(65536) as b:
        a.array[:] = np.arange(65536) % 251
        eng.write(IOBatch.single(a.address, 0, 0, 65536))
        eng.read(IOBatch.single(b.address, 0, 0, 65536))
        out["engine"] = eng.name
        out["equal"] = bool((a.array == b.array).all())
except kvblock.KVBlockError as e:
    out["error"] = type(e).__name__ + ": " + str(e)
print(json.dumps(out))
"""


def _child(path, **env):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True,
                         cwd=root, env={**os.environ, **env}, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_auto_selects_uring_here():
    report = kvblock.engine_report("auto")
    assert report["engine"] in ("uring", "threads")
    if report["engine"] == "threads":
        assert report["reason"].startswith("fallback: io_uring_setup failed")


@pytest.mark.skipif(not seccomp.supported(), reason="seccomp filter written for Linux x86_64/arm64")
def test_seccomp_blocked_io_uring_falls_back_to_threads(file_target):
    out = _child(file_target(1 << 20), KVBLOCK_IO_ENGINE="auto")
    assert out["report"]["engine"] == "threads"
    assert out["report"]["reason"] == "fallback: io_uring_setup failed: ENOSYS (Function not implemented)"
    assert out["engine"] == "threads" and out["equal"] is True


@pytest.mark.skipif(not seccomp.supported(), reason="seccomp filter written for Linux x86_64/arm64")
def test_threads_asked_for_never_touches_io_uring(file_target):
    """Where io_uring_setup kills the process (a systemd SystemCallFilter=
    without SystemCallErrorNumber=, a sandbox's policy), KVBLOCK_IO_ENGINE=
    threads is the way to run.  Before: engine_report() and open_engine()
    probed io_uring all the same, to say why not, and the process died of
    SIGSYS; now an engine asked for by name is taken without the probe."""
    out = _child(file_target(1 << 20), KVBLOCK_IO_ENGINE="threads", KVB_TEST_KILL_ON_URING="1")
    assert out["report"] == {"engine": "threads",
                             "reason": "requested (KVBLOCK_IO_ENGINE=threads)"}
    assert out["engine"] == "threads" and out["equal"] is True


@pytest.mark.skipif(not seccomp.supported(), reason="seccomp filter written for Linux x86_64/arm64")
def test_forcing_uring_when_blocked_is_a_clear_error(file_target):
    res = subprocess.run(
        [sys.executable, "-c", "from tests.support.seccomp import block_io_uring\n"
         "block_io_uring()\nimport kvblock\nkvblock.io_engine()"],
        capture_output=True, text=True, env={**os.environ, "KVBLOCK_IO_ENGINE": "uring"},
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode != 0
    assert "EngineUnavailableError: KVBLOCK_IO_ENGINE=uring but io_uring_setup failed: ENOSYS" \
        in res.stderr


def test_env_override(monkeypatch):
    monkeypatch.setenv("KVBLOCK_IO_ENGINE", "threads")
    assert kvblock.io_engine() == "threads"
    assert "requested" in kvblock.engine_report()["reason"]
    monkeypatch.setenv("KVBLOCK_IO_ENGINE", "spdk")
    with pytest.raises(ConfigError, match="unknown I/O engine 'spdk' .KVBLOCK_IO_ENGINE.*"
                                          "uring, threads, auto"):
        kvblock.io_engine()


def test_engine_names_as_users_write_them(monkeypatch):
    """io_uring is uring; a bad name from a setting names the setting, not
    the environment variable."""
    from kvblock.io import _requested

    monkeypatch.delenv("KVBLOCK_IO_ENGINE", raising=False)
    assert _requested("io_uring") == "uring" and _requested("IO_URING ") == "uring"
    with pytest.raises(ConfigError, match="'spdk' .the engine setting."):
        _requested("spdk")


@pytest.mark.parametrize("engine", [1, ["uring"], True])
def test_an_engine_setting_that_is_no_name_is_a_config_error(engine, monkeypatch):
    """An engine given as a number or list (a hand-typed config: SGLang's
    or LMCache's extra config, KVStore.open(engine=...)) raised
    AttributeError ('int' object has no attribute 'strip')."""
    from kvblock.io import _requested

    monkeypatch.delenv("KVBLOCK_IO_ENGINE", raising=False)
    with pytest.raises(ConfigError, match="must be a name"):
        _requested(engine)


def test_unavailable_error_is_kvblock_error():
    assert issubclass(EngineUnavailableError, kvblock.KVBlockError)


def test_the_native_library_is_found_past_a_path_this_user_cannot_search(monkeypatch):
    """A sys.path entry in another user's home (stat: EACCES) is passed
    over, not raised: an engine's worker running as its own user must still
    find the library further on (and a missing one is NativeLibraryError)."""
    from pathlib import Path

    from kvblock.errors import NativeLibraryError
    from kvblock.io import native

    real = native._candidates()
    found = next(p for p in real if p.is_file())
    hidden = Path("/root/other-user/kvblock/_native") / native.LIB_NAME
    real_is_file = Path.is_file

    def is_file(self):
        if self == hidden:
            raise PermissionError(13, "Permission denied", str(self))
        return real_is_file(self)

    monkeypatch.setattr(Path, "is_file", is_file)
    monkeypatch.setattr(native, "_candidates", lambda: [hidden, found])
    assert native.lib.__wrapped__().kvb_abi_version() == native.ABI_VERSION
    monkeypatch.setattr(native, "_candidates", lambda: [hidden])
    with pytest.raises(NativeLibraryError, match="not found"):
        native.lib.__wrapped__()


def test_a_refused_engine_setting_names_the_setting_not_the_variable(monkeypatch):
    """engine='uring' given as an argument (a store option, an integration's
    "engine") where io_uring is refused: the error told to unset
    KVBLOCK_IO_ENGINE, which the user never set; threads asked for that way
    was reported as requested by the variable."""
    import kvblock.io as kio

    monkeypatch.delenv("KVBLOCK_IO_ENGINE", raising=False)
    monkeypatch.setattr(kio, "_uring_probe",
                        lambda: (False, "io_uring_setup failed: ENOSYS (Function not implemented)"))
    with pytest.raises(EngineUnavailableError) as exc:
        kio.engine_report("uring")
    assert "KVBLOCK_IO_ENGINE" not in str(exc.value)
    assert "engine setting 'uring'" in str(exc.value) and "auto" in str(exc.value)
    assert kio.engine_report("threads")["reason"] == "requested (the engine setting)"
    monkeypatch.setenv("KVBLOCK_IO_ENGINE", "uring")
    with pytest.raises(EngineUnavailableError, match="KVBLOCK_IO_ENGINE=uring but io_uring"):
        kio.engine_report()
    monkeypatch.setenv("KVBLOCK_IO_ENGINE", "threads")
    assert kio.engine_report()["reason"] == "requested (KVBLOCK_IO_ENGINE=threads)"


def _another_shared_library() -> str:
    """The path of a shared library this process has loaded that is not
    kvblock's native core (the C library)."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "/libc.so" in path or "/libc-" in path:
                return path
    pytest.skip("no libc mapping found in /proc/self/maps")


@pytest.mark.parametrize("what", ["missing", "not a library", "another library"])
def test_a_native_lib_setting_that_cannot_be_loaded_is_an_error(what, tmp_path, monkeypatch):
    """KVBLOCK_NATIVE_LIB names the native core to load (README: from that
    file, before the one pip install built): a path that is not there, or a
    file that is no library, was passed over and the package's own core
    loaded, so a user testing another build ran the old one, unsaid.  A
    shared library that is not kvblock's (no kvb_abi_version) raised cffi's
    AttributeError, a traceback, where README promises NativeLibraryError
    (exit 10)."""
    from kvblock.errors import NativeLibraryError
    from kvblock.io import native

    path = tmp_path / "libkvblock_io.so"
    if what == "not a library":
        path.write_bytes(b"not an ELF file\n")
    elif what == "another library":
        path = _another_shared_library()
    monkeypatch.setenv("KVBLOCK_NATIVE_LIB", str(path))
    with pytest.raises(NativeLibraryError, match="KVBLOCK_NATIVE_LIB") as exc:
        native.lib.__wrapped__()
    assert str(path) in str(exc.value)
    monkeypatch.delenv("KVBLOCK_NATIVE_LIB")
    assert native.lib.__wrapped__().kvb_abi_version() == native.ABI_VERSION


def test_a_native_lib_setting_of_a_bare_file_name_loads_that_file(tmp_path, monkeypatch):
    """KVBLOCK_NATIVE_LIB=libkvblock_io.so (a file in the working directory,
    named without a slash) was handed to dlopen as is, which then searches the
    library path (LD_LIBRARY_PATH, the system's), never the working
    directory: the file named failed as 'cannot be loaded', or another
    libkvblock_io.so on the library path was loaded in its place, unsaid."""
    import shutil

    from kvblock.io import native

    own = os.environ.get("KVBLOCK_NATIVE_LIB") or \
        next(p for p in native._candidates() if native._is_file(p))
    shutil.copy(own, tmp_path / native.LIB_NAME)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVBLOCK_NATIVE_LIB", native.LIB_NAME)
    handle = native.lib.__wrapped__()
    assert handle.kvb_abi_version() == native.ABI_VERSION
    with open("/proc/self/maps") as f:
        assert str(tmp_path / native.LIB_NAME) in f.read()


@pytest.mark.parametrize("what", ["not a library", "another library"])
@pytest.mark.parametrize("setting", [None, "auto", "threads", "uring"])
def test_engine_report_with_a_native_core_that_cannot_load_is_that_error(setting, what, tmp_path,
                                                                         monkeypatch):
    """KVBLOCK_NATIVE_LIB naming a file that is no library: engine_report
    said {'engine': 'threads', 'reason': 'fallback: ...'} (and an engine
    setting of threads 'requested'), yet the threads engine needs the native
    core too, so opening it then failed with NativeLibraryError; and
    open_engine's uring path said EngineUnavailableError 'use
    KVBLOCK_IO_ENGINE=threads', which fails the same way.  The report is
    the error the open would be (the CLI's exit 10)."""
    import kvblock.io as kio
    from kvblock.errors import NativeLibraryError
    from kvblock.io import native, uring

    path = tmp_path / "libkvblock_io.so"
    path.write_bytes(b"not an ELF file\n")
    if what == "another library":     # loads, but is not kvblock's core
        path = _another_shared_library()
    monkeypatch.delenv("KVBLOCK_IO_ENGINE", raising=False)
    monkeypatch.setenv("KVBLOCK_NATIVE_LIB", str(path))
    monkeypatch.setattr(native, "lib", native.lib.__wrapped__)   # uncached: loads the file named
    kio._uring_probe.cache_clear()
    try:
        with pytest.raises(NativeLibraryError, match="KVBLOCK_NATIVE_LIB"):
            kio.engine_report(setting)
        with pytest.raises(NativeLibraryError, match="KVBLOCK_NATIVE_LIB"):
            uring.UringEngine([])
    finally:
        kio._uring_probe.cache_clear()


def test_a_probe_that_failed_for_now_is_not_kept_for_the_process(monkeypatch, caplog):
    """io_uring_setup failing with an error that passes (ENOMEM, EMFILE: memory
    or descriptors short at that moment) pinned every `auto` engine of the
    process on threads for good, unsaid: the probe's answer was cached.  Such
    a failure is now logged (once) and probed again at the next open; one that
    stays (ENOSYS: a seccomp policy) is still kept."""
    import errno
    import logging

    import kvblock.io as kio
    from kvblock.io import native
    from kvblock.io.uring import probe

    real = native.lib()

    class Refusing:
        def __init__(self, code):
            self.code, self.calls = code, 0

        def __getattr__(self, name):
            return getattr(real, name)

        def kvb_ring_create(self, entries, err):
            self.calls += 1
            err[0] = -self.code
            return native.ffi.NULL

    if not probe()[0]:
        pytest.skip(f"io_uring unavailable here: {probe()[1]}")
    monkeypatch.delenv("KVBLOCK_IO_ENGINE", raising=False)
    monkeypatch.setattr(kio, "_said", set())
    kio._uring_probe.cache_clear()
    try:
        short = Refusing(errno.ENOMEM)
        monkeypatch.setattr(native, "lib", lambda: short)
        with caplog.at_level(logging.WARNING, logger="kvblock"):
            for _ in range(2):
                report = kio.engine_report("auto")
                assert report == {"engine": "threads", "reason": "fallback: io_uring_setup "
                                  "failed: ENOMEM (Cannot allocate memory)"}
        assert short.calls == 2                       # probed again, not kept
        said = [r.getMessage() for r in caplog.records if "io_uring" in r.getMessage()]
        assert len(said) == 1 and "ENOMEM" in said[0] and "threads" in said[0], said
        monkeypatch.setattr(native, "lib", lambda: real)
        assert kio.engine_report("auto")["engine"] == "uring"    # memory back: io_uring
        kio._uring_probe.cache_clear()
        blocked = Refusing(errno.ENOSYS)
        monkeypatch.setattr(native, "lib", lambda: blocked)
        for _ in range(2):
            assert kio.engine_report("auto")["engine"] == "threads"
        assert blocked.calls == 1                     # a refusal that stays is kept
    finally:
        kio._uring_probe.cache_clear()
