import os
import stat
import subprocess

import pytest

from tests.support import loopdev


def test_loop_device_is_block_device_and_detached_after_failure():
    ok, why = loopdev.can_make_loop_devices()
    if not ok:
        pytest.skip(why)
    seen = {}
    with pytest.raises(RuntimeError):
        with loopdev.loop_device(8 << 20) as dev:
            seen["dev"], seen["backing"] = dev, loopdev.backing_of(dev)
            assert stat.S_ISBLK(os.stat(dev).st_mode)
            raise RuntimeError("test body failed")
    # By its backing file (a name of its own), not its minor: under make test
    # another test file's loop device (a second process) may take the minor.
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    assert seen["backing"] not in out, (seen, out)
