"""io_uring failures that cannot be caused on purpose on this kernel,
injected with an LD_PRELOAD shim over liburing (tests/support/uring_faults.c,
built here with the C compiler the native core was built with): a ring that
breaks after taking a batch's I/Os, and a kernel too old for SINGLE_ISSUER
(whose rings a forked child shares with its parent)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvblock.devices import create_file
from kvblock.io.uring import probe

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "tests" / "support" / "uring_faults.c"
pytestmark = pytest.mark.skipif(not probe()[0], reason="io_uring unavailable here")


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler (make install builds the native core with one)"
    out = tmp_path_factory.mktemp("shim") / "uring_faults.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(SHIM), "-ldl"],
                   check=True, capture_output=True, text=True)
    return str(out)


def _child(shim, case, path, **env) -> dict:
    res = subprocess.run([sys.executable, "-m", "tests.io.uring_faults_child", case, path],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LD_PRELOAD": shim,
                              "KVBLOCK_IO_ENGINE": "uring", **env})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_broken_ring_is_drained_and_replaced(shim, tmp_path):
    """Before: the I/Os the broken ring had taken landed later, and the next
    batch took their completions for its own (success, with its buffer
    partly unread); then every batch of that thread failed.  A batch whose
    I/Os all completed before the ring was retired has its bytes: no error
    (before: IOFailedError for a batch read in full)."""
    path = str(create_file(tmp_path / "f.img", 16 << 20))
    out = _child(shim, "broken_ring", path, KVB_FAULT_SUBMIT_AT="1")
    del out["first_seconds"]
    assert out == {"first": "no error", "first_equal": True, "second_equal": True,
                   "again_equal": True}


def test_a_broken_ring_that_took_nothing_fails_at_once(shim, tmp_path):
    """The kernel took none of the batch's I/Os: each is ECANCELED and the
    call returns at once (before: it waited 5 s for completions that could
    never come).  The error names the device, the first I/O that did not
    run, and the way out."""
    path = str(create_file(tmp_path / "f.img", 16 << 20))
    out = _child(shim, "broken_ring", path, KVB_FAULT_SUBMIT_AT="1", KVB_FAULT_SUBMIT_NONE="1")
    assert out.pop("first_seconds") < 4
    assert out == {"first": "IOFailedError 12", "failed": 8, "second_equal": True,
                   "again_equal": True,
                   "named": {"path": True, "offset": True, "fix": True}}


def test_a_broken_ring_counts_the_callers_ios_not_their_pieces(shim, tmp_path):
    """Before: the broken-ring error counted the pieces the engine had cut
    the batch into (8 for two 4 MiB reads split at 1 MiB), and a store
    reading one run split into pieces took failed > 1 for 'several I/Os
    failed' and dropped every run of the batch, not the one named."""
    path = str(create_file(tmp_path / "f.img", 16 << 20))
    out = _child(shim, "broken_ring_split", path, KVB_FAULT_SUBMIT_AT="1",
                 KVB_FAULT_SUBMIT_NONE="1")
    assert out == {"first": "IOFailedError 12", "failed": 2, "says": True}


def test_a_broken_ring_waits_for_every_io_it_took(shim, tmp_path):
    """A device slow to complete what a broken ring took (6 s here): the
    call returns only once every such I/O has landed (before: it gave up
    after 5 s, and an I/O landing later wrote into a buffer its caller had
    reused)."""
    path = str(create_file(tmp_path / "f.img", 16 << 20))
    out = _child(shim, "broken_ring", path, KVB_FAULT_SUBMIT_AT="1",
                 KVB_FAULT_REAP_AFTER_MS="6000")
    assert out.pop("first_seconds") >= 5.9
    assert out == {"first": "no error", "first_equal": True, "second_equal": True,
                   "again_equal": True}


def test_a_forked_child_leaves_the_parents_ring_alone_on_older_kernels(shim, tmp_path):
    path = str(create_file(tmp_path / "f.img", 8 << 20))
    out = _child(shim, "fork_old_kernel", path, KVB_FAULT_OLD_KERNEL="1")
    assert out == {"fixed_files": True, "parent_read_ok": True}
