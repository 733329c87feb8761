"""Random byte flips in the superblocks, checkpoints, journal and data: reopening
gives a typed error or a smaller-but-correct cache, never wrong bytes."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kvblock import KVStore, create_file
from kvblock.errors import KVBlockError
from tests.store.workload import GEOM, REGION, Journal, check_store, workload

TRIALS = 25


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """A store with checkpointed runs and journal records after the checkpoint."""
    path = tmp_path_factory.mktemp("corrupt") / "base.img"
    create_file(path, 8 << 20)
    KVStore.format([str(path)], GEOM, region_size=REGION, journal_bytes=256 << 10).close()
    log = Journal()
    store = KVStore.open([str(path)])
    workload(store, log, runs=12)
    sb = store.sb
    data_runs = [store.regions.address(r.region, r.offset)[1] for r in store.index.runs.values()]
    store._release_devices()  # leave journal records unreplayed
    areas = {
        "superblock": (0, 8192),
        "checkpoint": (sb.checkpoint_offset, sb.checkpoint_offset + 2 * sb.checkpoint_bytes),
        "journal": (sb.journal_offset, sb.journal_offset + (64 << 10)),
        "data": (min(data_runs), max(data_runs) + (64 << 10)),
    }
    return path, log, areas


@pytest.mark.parametrize("area", ["superblock", "checkpoint", "journal", "data"])
def test_random_flips(image, tmp_path, area):
    base, log, areas = image
    lo, hi = areas[area]
    rng = np.random.default_rng(area.encode()[0])
    outcomes = {"error": 0, "opened": 0}
    for trial in range(TRIALS):
        path = tmp_path / "trial.img"
        shutil.copy(base, path)
        with open(path, "r+b") as f:
            for pos in rng.integers(lo, hi, rng.integers(1, 9)):
                f.seek(int(pos))
                byte = f.read(1)
                f.seek(int(pos))
                f.write(bytes([byte[0] ^ int(rng.integers(1, 256))]))
        try:
            store = KVStore.open([str(path)])
        except KVBlockError:
            outcomes["error"] += 1
            continue
        with store:
            # a corrupt cache may be smaller (or forget a delete), never wrong
            check_store(store, log, evicting=True, live=True, corrupted=True)
        outcomes["opened"] += 1
    assert sum(outcomes.values()) == TRIALS
    if area in ("data", "journal"):
        assert outcomes["opened"] > 0, outcomes  # damage there shrinks the cache, no more
