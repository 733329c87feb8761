"""Page-locking host buffers with CUDA (cudaHostRegister through torch's
runtime bindings): the DRAM tier's arena, and the load staging buffers
that feed CUDA caches.  Everything here falls back to pageable memory
without torch, CUDA or a GPU."""

from __future__ import annotations

import contextlib
import logging

logger = logging.getLogger("kvblock")

# cudaHostRegisterPortable: page-locked for every CUDA context, not only
# the one current at the call (without it a copy to another GPU than that
# one goes through the driver's pageable bounce buffer still)
_PORTABLE = 1


def _on(torch, device):
    """``device`` (a CUDA device index) current for the calls made in it;
    None: the thread's current one (a new thread's is GPU 0, whose context
    a call there makes in a process that uses another GPU)."""
    return contextlib.nullcontext() if device is None else torch.cuda.device(device)


def pin(buf, device: int | None = None) -> bool:
    """Page-lock HostBuffer ``buf`` with CUDA when a GPU is present (faster,
    async host-to-device copies), with CUDA ``device`` current (give the
    GPU the copies go to); False when it stays pageable."""
    return pin_refused(buf, device) is None


def pin_refused(buf, device: int | None = None) -> str | None:
    """:func:`pin`, answering None when ``buf`` was page-locked, else why
    it stays pageable (for the caller's log)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"
        rt = torch.cuda.cudart()
        with _on(torch, device):
            err = rt.cudaHostRegister(buf.address, buf.nbytes, _PORTABLE)
            if int(err) != 0:
                # Left set, the runtime's last error would be reported by the
                # next unrelated check on this thread (torch's after each kernel
                # launch: "CUDA error: ... already mapped" from the model's code).
                _clear_cuda_error(rt)
                return f"cudaHostRegister of {buf.nbytes} bytes answered CUDA error {int(err)}"
        return None
    except Exception as e:  # no torch / no CUDA runtime: plain pageable memory
        return f"{type(e).__name__}: {e}"


def _clear_cuda_error(rt) -> None:
    """Reset the CUDA runtime's last error (cudaGetLastError) after a
    failed call handled here.  torch's runtime bindings have no
    cudaGetLastError: it is called in the libcudart this process loaded."""
    clear = getattr(rt, "cudaGetLastError", None)
    if clear is None:
        lib = _loaded_cudart()
        clear = getattr(lib, "cudaGetLastError", None) if lib is not None else None
    if clear is not None:
        try:
            clear()
        except Exception:  # noqa: BLE001 (nothing more to do: the fallback stands)
            pass


def _loaded_cudart():
    """The CUDA runtime library already mapped into this process (ctypes),
    or None (none mapped: a runtime linked statically, no CUDA)."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = [line.split(None, 5)[-1].strip() for line in f if "libcudart.so" in line]
    except OSError:
        return None
    for path in paths:
        if path.startswith("/"):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def unpin(buf, device: int | None = None) -> None:
    """Undo :func:`pin` (before the buffer is unmapped), with the ``device``
    current that it was pinned with."""
    unpin_at(buf.address, device)


def unpin_at(address: int, device: int | None = None, quiet: bool = False) -> None:
    """:func:`unpin` of the buffer at ``address`` (a finalizer's: no buffer
    to hold).  ``quiet``: the buffer may not be pinned (an interrupted pin
    undone), so a refusal is no news to log."""
    try:
        import torch

        rt = torch.cuda.cudart()
        with _on(torch, device):
            err = rt.cudaHostUnregister(address)
            if int(err) != 0:
                # as a refused register: left set, the runtime's last error
                # was reported by the next unrelated check on this thread
                _clear_cuda_error(rt)
                if not quiet:
                    logger.warning("kvblock: cudaHostUnregister of the buffer at 0x%x "
                                   "answered CUDA error %d: its pages may stay page-locked",
                                   address, int(err))
    except Exception:  # the CUDA runtime is gone (interpreter exit): nothing to undo
        pass
