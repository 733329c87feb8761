"""kvblock.store.planning: the plan a format makes over stand-in devices,
whether a run fits it, and the least size that holds a store (what
`kvblock format`, the store bench and the demo check before a format)."""

from __future__ import annotations

import numpy as np
import pytest

from kvblock import Geometry, KVStore, aligned_empty, create_file
from kvblock.devices import Device
from kvblock.errors import ConfigError, DeviceTooSmallError, StoreFullError
from kvblock.store.planning import StandIn, check_fits, least_size, plan_for, plan_or_none
from tests.store.workload import GEOM, run_data, run_keys

# a run's journal record of one block larger than any store's journal (64 MiB)
HUGE_RECORD = Geometry(num_layers=65536, num_kv_heads=64, head_dim=8, dtype="bfloat16",
                       block_tokens=1, head_groups=64)


def test_a_stand_in_of_no_capacity_is_planned_at_the_size_as_a_device_sees_a_file(tmp_path):
    """plan_for(size=) takes a stand-in of no capacity at that size in whole
    blocks of its own: the plan a format makes over a file of that size."""
    path = tmp_path / "store.img"
    create_file(path, 8 << 20)
    with Device(str(path)) as dev:
        want = plan_for([dev], GEOM)
    assert plan_for([StandIn(str(path), 4096)], GEOM, size=(8 << 20) + 100) == want
    assert plan_for([StandIn(str(path), 4096, 8 << 20)], GEOM) == want
    # one of a capacity keeps its own; refusals are the format's
    with pytest.raises(DeviceTooSmallError):
        plan_for([StandIn("a", 4096), StandIn("b", 4096, 4096)], GEOM, size=8 << 20)
    assert plan_or_none([StandIn("a", 4096), StandIn("b", 4096, 4096)], GEOM,
                        size=8 << 20) is None


def test_least_size_is_the_least_file_a_format_takes(tmp_path):
    least = least_size([StandIn("x", 4096)], GEOM)
    assert least is not None and least % 4096 == 0
    assert plan_or_none([StandIn("x", 4096)], GEOM, size=least - 4096) is None
    small, fits = tmp_path / "small.img", tmp_path / "fits.img"
    create_file(small, least - 4096)
    create_file(fits, least)
    with pytest.raises(DeviceTooSmallError):
        KVStore.format([str(small)], GEOM)
    KVStore.format([str(fits)], GEOM).close()
    # two devices: each must have it (a store needs a region on each)
    both = least_size([StandIn("x", 4096), StandIn("y", 4096)], GEOM)
    assert plan_or_none([StandIn("x", 4096), StandIn("y", 4096)], GEOM, size=both) is not None
    assert plan_or_none([StandIn("x", 4096), StandIn("y", 4096)], GEOM,
                        size=both - 4096) is None


def test_least_size_for_a_run_holds_it_and_check_fits_refuses_as_the_put(tmp_path):
    """least_size(run_blocks=) is the least store that holds the run at
    once; check_fits on the plan of one a block smaller refuses it with the
    store's own put's StoreFullError, before any format."""
    n = 400      # 3.2 MiB: more than the least store's one region of a run
    least = least_size([StandIn("x", 4096)], GEOM, run_blocks=n)
    assert least > least_size([StandIn("x", 4096)], GEOM)
    check_fits(plan_for([StandIn("x", 4096)], GEOM, size=least), GEOM, n)
    short = plan_for([StandIn("x", 4096)], GEOM, size=least - 4096)
    with pytest.raises(StoreFullError) as planned:
        check_fits(short, GEOM, n)
    keys = run_keys(1, n)
    path = tmp_path / "short.img"
    create_file(path, least - 4096)
    with KVStore.format([str(path)], GEOM) as store:
        with pytest.raises(StoreFullError) as put:
            store.put_run(keys, run_data(keys))
    assert str(put.value) == str(planned.value)
    path = tmp_path / "fits.img"
    create_file(path, least)
    with KVStore.format([str(path)], GEOM) as store:
        assert store.put_run(keys, run_data(keys)) == n
        out = aligned_empty(n * GEOM.block_bytes)
        assert store.get_run(keys, out) == n and np.array_equal(out, run_data(keys))


def test_no_least_size_where_no_store_holds_the_model():
    assert least_size([StandIn("x", 4096)], HUGE_RECORD) is None


# blocks of 4 bytes: a checkpoint slot keeps 16 bytes per block a store's
# space could hold, two slots 32: more than the blocks themselves
TINY_BLOCKS = Geometry(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float16",
                       block_tokens=1)


def test_a_model_of_blocks_too_small_for_any_store_is_a_config_error(tmp_path):
    """KVStore.format of a model whose blocks are too small for any store's
    checkpoint said the device was too small ("use a larger device"), which
    none is: and the planner's probes reported their own 2**60-byte stand-in
    under an empty path.  It is a ConfigError naming the model's block size,
    the least a store takes (over these devices: the first holds the
    metadata of all), and the fix."""
    path = tmp_path / "store.img"
    create_file(path, 64 << 20)
    with pytest.raises(ConfigError) as e:
        KVStore.format([str(path)], TINY_BLOCKS)
    msg = str(e.value)
    assert "blocks of 4 bytes" in msg and "tokens per block" in msg, msg
    least = int(msg.split("at least ")[1].split()[0])
    # the least is exact: blocks of that size plan a store, one byte less none
    one = [StandIn("x", 4096)]
    assert plan_for(one, Geometry(1, 1, least, "int8", 1, kv_parts=1), size=1 << 60)
    with pytest.raises(ConfigError, match=f"blocks of {least - 1} bytes"):
        plan_for(one, Geometry(1, 1, least - 1, "int8", 1, kv_parts=1), size=1 << 60)
    assert least_size(one, TINY_BLOCKS) is None
    # a stand-in's refusal names the model, not the probe
    with pytest.raises(ConfigError) as e:
        plan_for([StandIn("", 4096)], TINY_BLOCKS, size=1 << 60)
    assert str(1 << 60) not in str(e.value)
    # four devices: blocks a store of one takes, but not one of four
    fine = Geometry(1, 1, 2 * least, "int8", 1, kv_parts=1)
    assert least_size(one, fine) is not None
    four = [StandIn(str(i), 4096) for i in range(4)]
    with pytest.raises(ConfigError, match="over 4 devices") as e:
        plan_for(four, fine, size=1 << 30)
    assert int(str(e.value).split("at least ")[1].split()[0]) > 2 * least


def test_least_size_for_a_run_beside_a_device_of_its_own_size_is_the_least():
    """least_size over a new device (no capacity) beside one of its own
    size (format --size with an existing device) and a run: its quick
    bound took the data offset of the device of its own size (metadata and
    all, the first device) for the new one's, and passed sizes that hold
    the run (6,340,608 bytes said, 4,243,456 holds it)."""
    from kvblock.store.planning import MAX_SIZE

    small = Geometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=1)
    devs = [StandIn("old", 4096, MAX_SIZE // 4096 * 4096), StandIn("new", 4096)]
    least = least_size(devs, small, run_blocks=20000)
    assert plan_or_none(devs, small, size=least, run_blocks=20000) is not None
    assert not any(plan_or_none(devs, small, size=size, run_blocks=20000) is not None
                   for size in range(4096, least, 4096))
