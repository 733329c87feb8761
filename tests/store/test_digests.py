"""store.digests: where each block of a run lies in the memory its write
reads from, checked for real (not by an assert, gone under python -O)."""

from __future__ import annotations

import pytest

from kvblock.errors import ConfigError
from kvblock.io import IOBatch
from kvblock.layout.geometry import RunLayout
from kvblock.store.digests import block_addresses, block_digests
from tests.store.workload import GEOM

DEV_OFF = 1 << 20


def _layout():
    return RunLayout(GEOM, 2, 4096)   # 4 ranges of 4096 bytes, 2 blocks of 2 KiB each


def test_block_addresses_of_a_whole_run_image():
    lay = _layout()
    base = 1 << 32
    batch = IOBatch.single(base, 0, DEV_OFF, lay.data_bytes)
    got = block_addresses(batch, lay, DEV_OFF)
    gbb = GEOM.group_block_bytes
    want = [base + r * lay.range_bytes + k * gbb for r in range(GEOM.ranges)
            for k in range(lay.nblocks)]
    assert got.tolist() == want


@pytest.mark.parametrize("case", ["block across two entries", "block before the batch",
                                  "block past the batch", "empty batch"])
def test_a_batch_that_does_not_hold_each_block_whole_is_a_config_error(case):
    """The check was an assert: under python -O a block before the first
    entry took index -1 (the last entry) and an address wrapped past 2**64,
    and the native hash read whatever memory that named.  Now a
    ConfigError naming the block, raised under -O too (a real check)."""
    lay = _layout()
    gbb = GEOM.group_block_bytes
    base = 1 << 32
    n = lay.data_bytes
    if case == "block across two entries":    # cut in the middle of range 0's block 0
        batch = IOBatch([base, base + gbb // 2], 0, [DEV_OFF, DEV_OFF + gbb // 2],
                        [gbb // 2, n - gbb // 2])
    elif case == "block before the batch":    # the batch starts one range late
        batch = IOBatch.single(base, 0, DEV_OFF + lay.range_bytes, n - lay.range_bytes)
    elif case == "block past the batch":      # the last range's last block missing
        batch = IOBatch.single(base, 0, DEV_OFF, n - gbb)
    else:
        batch = IOBatch([], 0, [], 0)
    with pytest.raises(ConfigError, match="block"):
        block_addresses(batch, lay, DEV_OFF)
    with pytest.raises(ConfigError, match="block"):
        block_digests(batch, lay, DEV_OFF, 7)
