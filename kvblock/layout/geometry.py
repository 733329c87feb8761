"""KV geometry and where each (layer, head group) of a run lives.

A run of N blocks is stored as ``layers x head_groups`` ranges, each one
contiguous and aligned, each holding that layer's K/V for that group's heads
for all N blocks in token order::

    run = [layer][head_group][block][kv][token][head_in_group][dim]

so restoring layer ``l`` on rank ``g`` is one read per run, and reading the
first k blocks of that range is one shorter read.  Ranges are padded to the
store's alignment (>= 4 KiB, what GPUDirect Storage needs).
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import asdict, dataclass

from kvblock.errors import ConfigError
from kvblock.units import is_whole

# On-device dtype codes (part of the format: never renumber).
DTYPES: dict[str, tuple[int, int]] = {  # name -> (code, itemsize)
    "float16": (1, 2), "bfloat16": (2, 2), "float32": (3, 4), "float8_e4m3fn": (4, 1),
    "float8_e5m2": (5, 1), "int8": (6, 1), "uint8": (7, 1),
}
DTYPE_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _derive(obj, **sizes) -> None:
    """Set a frozen layout's derived sizes as plain attributes at its
    construction.  Not functools.cached_property: its first read makes the
    object's __dict__, and on CPython 3.11 a GC started by that allocation
    can run Python code (a finalizer; another thread meanwhile) whose first
    read of the same shared layout makes a second dict over the same values
    array, freed under it when the layout dies (a segfault in a later GC).
    Attributes set here stay in the object's inline values: no dict."""
    for name, value in sizes.items():
        object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class Geometry:
    """The shape of one block of KV and how the store cuts it.

    ``kv_parts`` is 2 for K and V, 1 for MLA's latent; ``head_groups`` is the
    tensor-parallel degree the layout is cut for (``num_kv_heads`` must divide
    by it).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_tokens: int = 16
    kv_parts: int = 2
    head_groups: int = 1

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "head_groups",
                     "kv_parts"):
            value = getattr(self, name)
            if not is_whole(value, index=True):  # ints and numpy ints; not floats or bools
                raise ConfigError(f"geometry: {name} must be an integer, got {value!r}")
            number = operator.index(value)
            if number < 1 or number >= 1 << 31:
                raise ConfigError(f"geometry: {name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(number))
        if not isinstance(self.dtype, str):
            raise ConfigError(f"geometry: dtype must be a name such as 'bfloat16', got "
                              f"{self.dtype!r}")
        if self.kv_parts not in (1, 2):
            raise ConfigError(f"geometry: kv_parts must be 2 (K and V) or 1 (MLA latent), "
                              f"got {self.kv_parts!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"geometry: unknown dtype {self.dtype!r}; choose one of "
                              f"{', '.join(DTYPES)}")
        if self.num_kv_heads % self.head_groups:
            raise ConfigError(f"geometry: {self.num_kv_heads} kv heads do not split into "
                              f"{self.head_groups} head groups; choose a divisor")
        # The derived sizes are computed here, once, not as cached_property:
        # see _derive.
        group_block_bytes = (self.kv_parts * self.block_tokens * self.heads_per_group
                             * self.head_dim * self.itemsize)
        _derive(self,
                # bytes of one block for one layer and one head group
                group_block_bytes=group_block_bytes,
                # bytes of one block over every layer and head
                block_bytes=group_block_bytes * self.num_layers * self.head_groups,
                # (layer, head group) ranges of a run
                ranges=self.num_layers * self.head_groups)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def heads_per_group(self) -> int:
        return self.num_kv_heads // self.head_groups

    @property
    def run_checksums(self) -> int:
        """Checksums the index keeps per run: one per range, then the block
        digest trailer's (see RunLayout)."""
        return self.ranges + 1

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"{self.num_layers} layers x {self.num_kv_heads} kv heads x {self.head_dim} "
                f"{self.dtype}, kv_parts={self.kv_parts}, {self.block_tokens} tokens/block, "
                f"{self.head_groups} head group(s)")


def model_fingerprint(model: str | bytes | None) -> bytes:
    """32-byte fingerprint of a model identity (name, revision, salt...)."""
    if model is None:
        return bytes(32)
    if not isinstance(model, (str, bytes, bytearray, memoryview)):
        # bytes() of an int is that many zero bytes (0 would be ""), of a
        # tuple a TypeError: two models could share a fingerprint
        raise ConfigError(f"model must be a name (str or bytes) such as "
                          f"'meta-llama/Llama-3.1-8B@rev', got {type(model).__name__} {model!r}; "
                          "join a name and a revision into one string")
    try:
        data = model.encode() if isinstance(model, str) else bytes(model)
    except UnicodeEncodeError:
        # lone surrogates: bytes of another locale (Latin-1) that Python
        # decoded with surrogateescape (an environment variable, argv)
        raise ConfigError(f"model {model!r} is not valid UTF-8; give the model's name in "
                          "UTF-8, as the engines name it") from None
    return hashlib.sha256(data).digest()


@dataclass(frozen=True)
class RunLayout:
    """Byte offsets of a run of ``nblocks`` blocks, relative to the run's start:
    ``ranges`` ranges of ``range_bytes`` each (the data), then the block
    digest trailer (kvblock/format/trailer.py), which lets a read of some
    of the run's blocks verify just those."""

    geometry: Geometry
    nblocks: int
    alignment: int

    def __post_init__(self):
        g = self.geometry
        # bytes reserved per (layer, group) range, padded to the alignment
        range_bytes = round_up(self.nblocks * g.group_block_bytes, self.alignment)
        # the block digest trailer, padded to the alignment
        trailer_bytes = round_up(g.ranges * self.nblocks * 8, self.alignment)
        _derive(self, range_bytes=range_bytes,
                data_bytes=range_bytes * g.ranges,    # the ranges: the run's data image
                trailer_bytes=trailer_bytes,
                # all the run takes on the device: data, then trailer
                run_bytes=range_bytes * g.ranges + trailer_bytes)

    def range_index(self, layer: int, group: int) -> int:
        return layer * self.geometry.head_groups + group

    def range_offset(self, layer: int, group: int) -> int:
        return self.range_index(layer, group) * self.range_bytes

    def prefix_bytes(self, blocks: int) -> int:
        """Payload bytes of the first ``blocks`` blocks of one range."""
        return blocks * self.geometry.group_block_bytes

    def prefix_read_bytes(self, blocks: int) -> int:
        """The aligned read that covers the first ``blocks`` blocks of a range."""
        return min(round_up(self.prefix_bytes(blocks), self.alignment), self.range_bytes)

    @staticmethod
    def max_blocks(geometry: Geometry, alignment: int, space: int) -> int:
        """Most blocks a run can hold within ``space`` bytes."""
        per_range = space // geometry.ranges // alignment * alignment
        lo, hi = 0, per_range // geometry.group_block_bytes   # the trailer aside
        while lo < hi:     # run_bytes grows with the block count: bisect
            mid = (lo + hi + 1) // 2
            if RunLayout(geometry, mid, alignment).run_bytes <= space:
                lo = mid
            else:
                hi = mid - 1
        return lo
