"""FORMAT_VERSION against the bytes of every on-device structure.

Only the superblock and the checkpoint header carry the format version; the
journal records, the block digest trailer, a run's byte layout and the
checksums stored in them do not, so a change of their bytes that forgets to
bump FORMAT_VERSION goes unseen until a store of the earlier release is
misread.  Each module's golden test pins its structure; this table ties all
of them to the version that writes them: changing any structure's bytes
without a new FORMAT_VERSION fails here, and so does a new FORMAT_VERSION
without its row.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

from kvblock.format import FORMAT_VERSION
from kvblock.format import journal as jfmt
from kvblock.format import trailer as trailerfmt
from kvblock.format.checksum import data_checksum, meta_checksum
from kvblock.layout.geometry import DTYPES, Geometry, RunLayout, model_fingerprint
from kvblock.store.digests import block_digests_at
from tests.format.test_checkpoint import sample_checkpoint
from tests.format.test_journal import DROP, EPOCH, PUT, RECL
from tests.format.test_superblock import STORE_UUID, golden_superblock

# FORMAT_VERSION -> the xxh64 digest of each on-device structure's sample
# bytes (structures() below), as that version writes them.  Rows of earlier
# versions stay as they are: they say what each release wrote.
GOLDENS = {
    2: {
        "superblock": "2af5dc6e94c5cb7e",
        "checkpoint": "889d7e6259f7e685",
        "journal PUT_RUN record": "84bbfed7558e88af",
        "journal DROP_RUN record": "c95dd783707597fa",
        "journal RECLAIM record": "91e7fcafb7a72147",
        "journal commit": "75350ae651972629",
        "journal epoch": "b6ac69cdd8dc9222",
        "block digest trailer": "ae2842f12e9d0407",
        "run layout": "86b6bac9dfc10aad",
        "checksums": "53ced116f76422d6",
        "model fingerprint": "5e7070ef4e0fd034",
        "dtype codes": "d99c425ec08163f2",
    },
}


def _digest(data) -> str:
    return xxhash.xxh64_hexdigest(bytes(data))


def _run_layouts() -> bytes:
    """Where a run's ranges and its trailer lie, for geometries whose fields
    all differ (range r = layer x head_groups + group)."""
    out = []
    for g, nblocks, alignment in (
            (Geometry(3, 6, 64, "float16", 16, 2, 3), 5, 4096),
            (Geometry(5, 12, 96, "float32", 32, 1, 4), 35, 512),
            (Geometry(2, 8, 128, "bfloat16", 512, 2, 8), 3, 8192)):
        lay = RunLayout(g, nblocks, alignment)
        out.append(struct.pack("<QQQQQ", g.group_block_bytes, lay.range_bytes, lay.data_bytes,
                               lay.trailer_bytes, lay.run_bytes))
        out.extend(struct.pack("<Q", lay.range_offset(layer, group))
                   for layer in range(g.num_layers) for group in range(g.head_groups))
    return b"".join(out)


def _checksums() -> bytes:
    """The checksums a store keeps on the device (range and trailer ones in
    the journal and checkpoints, block digests in trailers), metadata ones."""
    data = np.frombuffer(bytes(range(256)) * 64, dtype=np.uint8)
    blocks = block_digests_at([data.ctypes.data, data.ctypes.data + 4096], 4096, 0x1122334455)
    return struct.pack("<QQQQ", data_checksum(data, 0x1122334455), int(blocks[0]),
                       int(blocks[1]), meta_checksum(data))


def structures() -> dict[str, bytes]:
    """Sample bytes of every on-device structure (and of what decides them)."""
    digests = np.array([[0x0102030405060708, 2, 3], [4, 5, 0xFFFFFFFFFFFFFFFF]], np.uint64)
    return {
        "superblock": golden_superblock().encode(),
        "checkpoint": sample_checkpoint().encode(),
        "journal PUT_RUN record": jfmt.encode_record(PUT, 42, EPOCH),
        "journal DROP_RUN record": jfmt.encode_record(DROP, 42, EPOCH),
        "journal RECLAIM record": jfmt.encode_record(RECL, 42, EPOCH),
        "journal commit": jfmt.encode_commit([PUT, DROP, RECL], 42, EPOCH),
        "journal epoch": struct.pack("<Q", jfmt.epoch(STORE_UUID, 7)),
        "block digest trailer": trailerfmt.encode(digests, 4096).tobytes(),
        "run layout": _run_layouts(),
        "checksums": _checksums(),
        "model fingerprint": model_fingerprint("meta-llama/Llama-3.1-8B@rev1"),
        "dtype codes": repr(sorted((k, v[0]) for k, v in DTYPES.items())).encode(),
    }


def _row() -> str:
    return "\n".join(f"        {name!r}: {_digest(data)!r}," for name, data in
                     structures().items())


def test_this_format_version_has_a_row_of_goldens():
    assert FORMAT_VERSION in GOLDENS, (
        f"FORMAT_VERSION is {FORMAT_VERSION}, but GOLDENS (tests/format/"
        f"test_format_version.py) has no row for it: add this one, the bytes this code "
        f"writes, and keep the rows of the earlier versions as they are:\n"
        f"    {FORMAT_VERSION}: {{\n{_row()}\n    }},")


def _changed(want: dict) -> list[str]:
    now = {name: _digest(data) for name, data in structures().items()}
    return [f"{name} (digest now {now.get(name)}, format version {FORMAT_VERSION} "
            f"wrote {want.get(name)})" for name in sorted(set(now) | set(want))
            if now.get(name) != want.get(name)]


def test_every_on_device_structure_is_as_this_format_version_writes_it():
    want = GOLDENS.get(FORMAT_VERSION)
    if want is None:
        return      # the test above says what to do
    changed = _changed(want)
    assert not changed, (
        f"the on-device bytes of {', '.join(changed)} are not what format version "
        f"{FORMAT_VERSION} writes: this release would misread the stores earlier ones "
        f"wrote. Bump FORMAT_VERSION (kvblock/format/__init__.py) and add its row to "
        f"GOLDENS (tests/format/test_format_version.py), keeping version {FORMAT_VERSION}'s "
        f"(once bumped, this test prints the row to add); or undo the change")



def test_a_change_of_a_structure_that_does_not_carry_the_version_is_caught(monkeypatch):
    """The journal's records carry no format version: a change of their
    bytes (here RECLAIM's fields swapped to big-endian) is named."""
    if FORMAT_VERSION not in GOLDENS:
        return      # test_this_format_version_has_a_row_of_goldens says what to do
    monkeypatch.setattr(jfmt, "_RECLAIM", struct.Struct(">II"))
    changed = _changed(GOLDENS[FORMAT_VERSION])
    assert [c.split(" (")[0] for c in changed] == ["journal RECLAIM record", "journal commit"]
