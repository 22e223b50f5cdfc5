"""A weights file's bytes in private memory of their own, and that read begun before torch is imported.

A decode step streams every weight, and on a file map's 4 KiB pages the TLB's misses (one every 4 KiB) cost
whole 1B and 135M steps 3-8% of their time (2026-12-06, AMD Zen 4): so the CPU's kernels compute on a copy
in anonymous memory that the kernel backs with 2 MiB pages where it can (MADV_HUGEPAGE), which
``blocks`` then rearranges in place. Reading a 1B file into it takes 0.7-2.3 s of a start (the pages' first
touch, without the GIL), and importing torch 1.2-1.4 s on another core: ``start`` begins the read in a thread
from the command line's first moments, so the two overlap, and ``take`` collects it. This module imports
nothing heavy, so that the command line can use it before torch.
"""
import contextlib
import mmap
import threading
from pathlib import Path


def read(path: Path) -> mmap.mmap:
    """The whole file (header and tensors, at their offsets in it) in private anonymous memory, with 2 MiB
    pages where the kernel gives them."""
    with open(path, "rb", buffering=0) as handle:
        nbytes = handle.seek(0, 2)
        anonymous = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        memory = mmap.mmap(-1, max(nbytes, 1), **({"flags": anonymous} if anonymous else {}))
        with contextlib.suppress(AttributeError, OSError, ValueError):  # no THP (Windows, macOS, older kernels)
            memory.madvise(mmap.MADV_HUGEPAGE)
        handle.seek(0)
        view, got = memoryview(memory), 0
        try:
            while got < nbytes:  # read() returns at most 2 GiB a call
                count = handle.readinto(view[got:])
                if not count:
                    raise OSError(f"{path.name} shrank while it was read")
                got += count
        finally:
            view.release()
    return memory


class _Reading:
    """One ``read`` on a thread of its own; its memory once done (None where it failed: ``take`` reads again
    and meets the error itself)."""

    def __init__(self, path: Path):
        self.memory: mmap.mmap | None = None
        self.thread = threading.Thread(target=self._run, args=(path,), name="tornchat-read", daemon=True)
        self.thread.start()

    def _run(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            self.memory = read(path)


_readings: dict[Path, _Reading] = {}


def start(path: Path) -> None:
    """Begin reading the file into memory in the background, for ``take``."""
    key = path.resolve()
    if key not in _readings:
        _readings[key] = _Reading(key)


def take(path: Path) -> mmap.mmap:
    """The file in memory: what ``start`` read, once it has, or read now where it was not started (or
    failed: read again, so that the error is this call's)."""
    reading = _readings.pop(path.resolve(), None)
    if reading is not None:
        reading.thread.join()
        if reading.memory is not None:
            return reading.memory
    return read(path)


def forget() -> None:
    """Drop the reads nobody took (a file the loader read another way): their memory goes when their threads
    end."""
    _readings.clear()
