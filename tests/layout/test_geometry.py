"""KV geometry validation and run byte layout."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblock.errors import ConfigError, KVBlockError
from kvblock.layout.geometry import (DTYPE_BY_CODE, DTYPES, Geometry, RunLayout,
                                     model_fingerprint, round_up)

KIB = 1024
MIB = 1 << 20


def big() -> Geometry:
    return Geometry(num_layers=62, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                    block_tokens=512, head_groups=8)


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("kwargs,words", [
    (dict(num_layers=0), ["num_layers", "positive", "0"]),
    (dict(num_layers=-3), ["num_layers", "-3"]),
    (dict(num_kv_heads=0), ["num_kv_heads"]),
    (dict(head_dim=0), ["head_dim"]),
    (dict(block_tokens=0), ["block_tokens"]),
    (dict(head_groups=0), ["head_groups"]),
    (dict(num_layers=1 << 31), ["num_layers"]),
    (dict(num_layers=2.0), ["num_layers", "2.0"]),
    (dict(head_dim="128"), ["head_dim", "'128'"]),
    (dict(num_kv_heads=8, head_groups=3), ["8 kv heads", "3 head groups", "divisor"]),
    (dict(num_kv_heads=6, head_groups=4), ["6 kv heads", "4 head groups"]),
    (dict(kv_parts=3), ["kv_parts", "3", "MLA"]),
    (dict(kv_parts=0), ["kv_parts", "0"]),
    (dict(dtype="float64"), ["unknown dtype", "'float64'", "bfloat16", "float8_e4m3fn"]),
    (dict(dtype="bf16"), ["unknown dtype", "'bf16'"]),
])
def test_validation_errors(kwargs, words):
    base = dict(num_layers=4, num_kv_heads=8, head_dim=64)
    with pytest.raises(ConfigError) as ei:
        Geometry(**{**base, **kwargs})
    msg = str(ei.value)
    assert msg.startswith("geometry: ")
    for w in words:
        assert w in msg, (w, msg)
    assert isinstance(ei.value, KVBlockError) and isinstance(ei.value, ValueError)


def test_valid_edge_values():
    g = Geometry(num_layers=(1 << 31) - 1, num_kv_heads=1, head_dim=1, block_tokens=1)
    assert g.num_layers == (1 << 31) - 1
    assert Geometry(1, 8, 64, head_groups=8).heads_per_group == 1
    assert Geometry(1, 8, 64, head_groups=1).heads_per_group == 8


def test_defaults():
    g = Geometry(num_layers=2, num_kv_heads=4, head_dim=64)
    assert (g.dtype, g.block_tokens, g.kv_parts, g.head_groups) == ("bfloat16", 16, 2, 1)


def test_dtype_tables():
    assert DTYPE_BY_CODE == {code: name for name, (code, _) in DTYPES.items()}
    assert len(DTYPE_BY_CODE) == len(DTYPES)  # codes are unique
    sizes = {name: Geometry(1, 1, 1, dtype=name).itemsize for name in DTYPES}
    assert sizes == {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1,
                     "float8_e5m2": 1, "int8": 1, "uint8": 1}


def test_frozen_and_hashable():
    g = big()
    with pytest.raises(AttributeError):
        g.num_layers = 3
    assert {g: 1}[big()] == 1
    assert g.as_dict() == dict(num_layers=62, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                               block_tokens=512, kv_parts=2, head_groups=8)
    assert Geometry(**g.as_dict()) == g


def test_describe():
    d = big().describe()
    for w in ("62 layers", "8 kv heads", "128", "bfloat16", "kv_parts=2", "512 tokens/block",
              "8 head group"):
        assert w in d


# ------------------------------------------------------------------ byte math
def test_byte_math_big_model():
    g = big()
    assert g.heads_per_group == 1
    assert g.itemsize == 2
    assert g.group_block_bytes == 2 * 512 * 1 * 128 * 2 == 262144
    assert g.block_bytes == 262144 * 62 * 8 == 130_023_424
    assert g.ranges == 62 * 8 == 496


def test_byte_math_small_cases():
    # llama-8B-like: 32 layers, 8 kv heads, 128 dim, fp16, 16-token blocks, TP=2
    g = Geometry(32, 8, 128, dtype="float16", block_tokens=16, head_groups=2)
    assert g.heads_per_group == 4
    assert g.group_block_bytes == 2 * 16 * 4 * 128 * 2 == 32768
    assert g.block_bytes == 32768 * 32 * 2 == 2 * 16 * 8 * 128 * 2 * 32
    # fp8, a single group
    g = Geometry(3, 2, 64, dtype="float8_e4m3fn", block_tokens=32)
    assert g.group_block_bytes == 2 * 32 * 2 * 64 * 1 == 8192
    assert g.block_bytes == 8192 * 3
    # float32
    assert Geometry(1, 1, 10, dtype="float32", block_tokens=3).group_block_bytes == 2 * 3 * 10 * 4


def test_mla_kv_parts_1():
    # DeepSeek-style MLA: one latent "head" of 576 per token, no separate K/V
    g = Geometry(num_layers=61, num_kv_heads=1, head_dim=576, dtype="bfloat16",
                 block_tokens=64, kv_parts=1)
    assert g.group_block_bytes == 1 * 64 * 1 * 576 * 2 == 73728
    assert g.block_bytes == 73728 * 61
    two = Geometry(61, 1, 576, block_tokens=64, kv_parts=2)
    assert two.group_block_bytes == 2 * g.group_block_bytes


def test_round_up():
    assert round_up(0, 4096) == 0
    assert round_up(1, 4096) == 4096
    assert round_up(4096, 4096) == 4096
    assert round_up(4097, 4096) == 8192


# ------------------------------------------------------------------ run layout
def small() -> Geometry:
    # an unaligned block size on purpose:
    # 2 parts * 3 tokens * 1 head * 10 dim * 2 bytes = 120 bytes per block per range
    return Geometry(num_layers=4, num_kv_heads=3, head_dim=10, block_tokens=3, head_groups=3)


def test_range_bytes_padded_to_alignment():
    g = small()
    assert g.group_block_bytes == 120
    assert RunLayout(g, 1, 4096).range_bytes == 4096
    assert RunLayout(g, 34, 4096).range_bytes == 4096      # 4080 bytes
    assert RunLayout(g, 35, 4096).range_bytes == 8192      # 4200 bytes
    assert RunLayout(g, 35, 512).range_bytes == 4608
    big_layout = RunLayout(big(), 3, 4096)
    assert big_layout.range_bytes == 3 * 262144             # already aligned: no padding
    assert big_layout.data_bytes == 3 * 262144 * 496
    # then the block digest trailer: 496 ranges x 3 blocks x 8 bytes, aligned
    assert big_layout.trailer_bytes == 12288
    assert big_layout.run_bytes == 3 * 262144 * 496 + 12288
    lay = RunLayout(g, 35, 4096)
    assert lay.data_bytes == 8192 * 12
    assert lay.trailer_bytes == 4096                       # 12 x 35 x 8 = 3360 bytes
    assert lay.run_bytes == 8192 * 12 + 4096
    assert RunLayout(g, 35, 512).trailer_bytes == 3584


def test_range_offsets_layer_major_then_group():
    g = small()  # 4 layers x 3 groups
    lay = RunLayout(g, 35, 4096)
    order = [(layer, group) for layer in range(4) for group in range(3)]
    offsets = [lay.range_offset(layer, group) for layer, group in order]
    assert offsets == [i * 8192 for i in range(12)]
    assert [lay.range_index(layer, group) for layer, group in order] == list(range(12))
    assert lay.range_offset(1, 0) == 3 * 8192
    assert lay.range_offset(0, 1) == 8192
    assert lay.range_offset(3, 2) + lay.range_bytes == lay.data_bytes   # the trailer next
    assert all(o % 4096 == 0 for o in offsets)


@pytest.mark.parametrize("nblocks", [1, 5, 34, 35, 100])
@pytest.mark.parametrize("alignment", [512, 4096, 65536])
def test_prefix_read_bytes(nblocks, alignment):
    lay = RunLayout(small(), nblocks, alignment)
    prev = 0
    for k in range(0, nblocks + 1):
        payload = lay.prefix_bytes(k)
        read = lay.prefix_read_bytes(k)
        assert payload == k * 120
        assert read % alignment == 0
        assert payload <= read <= lay.range_bytes
        assert read - payload < alignment
        assert read >= prev
        prev = read
    assert lay.prefix_read_bytes(nblocks) == lay.range_bytes
    assert lay.prefix_read_bytes(0) == 0


def test_prefix_read_examples():
    lay = RunLayout(small(), 100, 4096)     # 12000 bytes -> 12288 per range
    assert lay.range_bytes == 12288
    assert lay.prefix_read_bytes(1) == 4096
    assert lay.prefix_read_bytes(34) == 4096
    assert lay.prefix_read_bytes(35) == 8192
    assert lay.prefix_read_bytes(100) == 12288


def test_max_blocks_examples():
    g = small()                                  # 12 ranges, 120 bytes per block per range
    # 13 * 4096 bytes: 4096 per range -> 34 blocks, and a page of trailer
    assert RunLayout.max_blocks(g, 4096, 13 * 4096) == 34
    # 12 pages: the ranges would fit, the trailer not
    assert RunLayout.max_blocks(g, 4096, 12 * 4096) == 0
    # one byte short of 12 pages: per range rounds down to 4095 // 4096 * 4096 = 0
    assert RunLayout.max_blocks(g, 4096, 12 * 4096 - 1) == 0
    assert RunLayout.max_blocks(g, 4096, 0) == 0
    gb = big()
    assert RunLayout.max_blocks(gb, 4096, 256 * MIB) == 256 * MIB // 496 // 4096 * 4096 // 262144
    assert RunLayout.max_blocks(gb, 4096, 256 * MIB) == 2
    assert RunLayout.max_blocks(gb, 4096, 496 * 262144 * 7) == 6    # no room for a trailer
    assert RunLayout.max_blocks(gb, 4096, 496 * 262144 * 7 + 32768) == 7


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 80), st.sampled_from([1, 2, 4, 8]), st.sampled_from([16, 64, 128]),
       st.sampled_from(sorted(DTYPES)), st.integers(1, 600), st.sampled_from([1, 2]),
       st.sampled_from([512, 4096, 1 << 16, 1 << 21]), st.integers(0, 1 << 34))
def test_max_blocks_is_the_largest_that_fits(layers, groups, dim, dtype, tokens, parts,
                                            alignment, space):
    g = Geometry(layers, groups * 2, dim, dtype=dtype, block_tokens=tokens, kv_parts=parts,
                 head_groups=groups)
    n = RunLayout.max_blocks(g, alignment, space)
    assert n >= 0
    if n:
        assert RunLayout(g, n, alignment).run_bytes <= space
    assert RunLayout(g, n + 1, alignment).run_bytes > space


# ------------------------------------------------------------------ fingerprints
def test_model_fingerprint():
    a = model_fingerprint("meta-llama/Llama-3.1-8B")
    b = model_fingerprint("meta-llama/Llama-3.1-70B")
    assert len(a) == len(b) == 32
    assert a != b
    assert a == model_fingerprint("meta-llama/Llama-3.1-8B")
    assert a == hashlib.sha256(b"meta-llama/Llama-3.1-8B").digest()
    assert model_fingerprint(b"meta-llama/Llama-3.1-8B") == a
    assert model_fingerprint(bytearray(b"x")) == model_fingerprint("x")
    assert model_fingerprint("model@rev2") != model_fingerprint("model@rev1")
    assert model_fingerprint(None) == bytes(32)
    assert model_fingerprint("") != bytes(32)


def test_model_fingerprint_refuses_what_is_not_a_name():
    # bytes(n) of an int is n zero bytes: model 0 was model "", a large id
    # allocated gigabytes; a (name, revision) tuple raised a bare TypeError
    for model in (0, 3, True, 10 ** 12, ("meta-llama/Llama-3.1-8B", "rev1"), 1.5):
        with pytest.raises(ConfigError, match="model must be a name"):
            model_fingerprint(model)


def test_geometry_normalises_numpy_ints_and_refuses_floats_and_bools():
    import numpy as np

    g = Geometry(np.int64(4), 2, 64, "float16")
    assert g.num_layers == 4 and type(g.num_layers) is int
    with pytest.raises(ConfigError, match="kv_parts must be an integer, got 2.0"):
        Geometry(4, 2, 64, "float16", kv_parts=2.0)
    with pytest.raises(ConfigError, match="num_layers must be an integer, got True"):
        Geometry(True, 2, 64, "float16")
    with pytest.raises(ConfigError, match="dtype must be a name"):
        Geometry(4, 2, 64, ["float16"])


def test_model_fingerprint_refuses_a_name_that_is_not_utf8():
    # A name from a Latin-1 locale (an environment variable, a config read
    # with surrogateescape) holds lone surrogates: the library refuses it as
    # bad input (typed), as kvblock's --model does, not UnicodeEncodeError.
    with pytest.raises(ConfigError, match="not valid UTF-8"):
        model_fingerprint("caf\udce9-7B")
    assert model_fingerprint("café-7B") == model_fingerprint("café-7B".encode())


def test_reading_a_layout_never_makes_an_instance_dict():
    """Geometry's and RunLayout's derived sizes were functools.cached_property,
    whose first read makes the object's __dict__.  On CPython 3.11 a GC
    started by that dict's allocation can run Python code (a finalizer, or
    another thread the GIL passes to meanwhile) whose first read of the same
    shared layout makes a second dict over the same values array; the
    layout's death frees that array under the other dict: a segfault in a
    later GC (a test worker's silent death, seen at
    test_serve.py::test_put_runs_refused_by_a_rank_before_a_write_counts_no_offer_on_the_server
    in a core dump: a leaked RunLayout dict whose values were reused by a
    string).  The sizes are computed at construction now, and no read of a
    layout makes a dict (an object's GC referents show a materialized one)."""
    import gc

    g = Geometry(4, 2, 64, "float16", head_groups=2)
    lay = RunLayout(g, 5, 4096)
    for obj, names in ((g, ("itemsize", "heads_per_group", "group_block_bytes", "block_bytes",
                            "ranges", "run_checksums")),
                       (lay, ("range_bytes", "data_bytes", "trailer_bytes", "run_bytes"))):
        for name in names:
            getattr(obj, name)
        lay.range_offset(1, 1), lay.prefix_read_bytes(2), g.describe(), hash(obj), obj == obj
        made = [r for r in gc.get_referents(obj) if type(r) is dict]
        assert made == [], f"reading {type(obj).__name__} made its __dict__: {made}"


def test_derived_sizes_are_plain_attributes_equal_to_the_formulas():
    g = Geometry(5, 4, 96, "bfloat16", block_tokens=32, head_groups=2)
    assert g.group_block_bytes == 2 * 32 * 2 * 96 * 2
    assert g.block_bytes == g.group_block_bytes * 5 * 2 and g.ranges == 10
    lay = RunLayout(g, 7, 4096)
    assert lay.range_bytes == round_up(7 * g.group_block_bytes, 4096)
    assert lay.data_bytes == lay.range_bytes * 10
    assert lay.trailer_bytes == round_up(10 * 7 * 8, 4096)
    assert lay.run_bytes == lay.data_bytes + lay.trailer_bytes
    # still frozen, compared and hashed by their fields only
    with pytest.raises(AttributeError):
        lay.run_bytes = 1
    assert lay == RunLayout(g, 7, 4096) and hash(lay) == hash(RunLayout(g, 7, 4096))
    assert g.as_dict() == {"num_layers": 5, "num_kv_heads": 4, "head_dim": 96,
                           "dtype": "bfloat16", "block_tokens": 32, "kv_parts": 2,
                           "head_groups": 2}
