"""On-device structures: superblock, journal records, checkpoints.

Every structure is fixed little-endian with a checksum; each module pins its
byte layout in a golden test.  Bump FORMAT_VERSION on any layout change, and
add its row to GOLDENS in tests/format/test_format_version.py.
"""

FORMAT_VERSION = 2   # 2: runs end in a block digest trailer (format/trailer.py)
