"""Space management: large regions written sequentially, reclaimed whole."""

from kvblock.alloc.regions import RegionTable

__all__ = ["RegionTable"]
