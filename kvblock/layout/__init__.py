"""KV geometry and the byte layout of a run on the device."""

from kvblock.layout.geometry import DTYPES, Geometry, RunLayout

__all__ = ["DTYPES", "Geometry", "RunLayout"]
