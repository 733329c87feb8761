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
            seen["dev"] = dev
            assert stat.S_ISBLK(os.stat(dev).st_mode)
            raise RuntimeError("test body failed")
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    assert f"{seen['dev']}:" not in out
