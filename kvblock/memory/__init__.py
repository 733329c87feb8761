"""Page-aligned host memory for O_DIRECT I/O: single buffers and a pool."""

from kvblock.memory.aligned import PAGE_SIZE, HostBuffer, aligned_empty, is_aligned
from kvblock.memory.pool import BufferPool

__all__ = ["PAGE_SIZE", "HostBuffer", "BufferPool", "aligned_empty", "is_aligned"]
