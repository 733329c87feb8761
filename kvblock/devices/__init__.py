"""Devices kvblock stores on: raw block devices (NVMe, NVMe-oF, loop) or pre-sized files."""

from kvblock.devices.device import (
    Device,
    DeviceInfo,
    check_distinct,
    create_file,
    medium_key,
    refuse_one_path,
)

__all__ = ["Device", "DeviceInfo", "check_distinct", "create_file", "medium_key",
           "refuse_one_path"]
