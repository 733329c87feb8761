"""Tiers in front of the device: a DRAM cache of hot blocks."""

from kvblock.tiers.host import HostTier

__all__ = ["HostTier"]
