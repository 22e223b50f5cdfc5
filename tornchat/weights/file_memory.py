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
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HUGE_PAGE = 2 << 20
# Parts read at once: the first touch of fresh 2 MiB pages is most of a read (zeroing them; on a VM whose
# host took freed memory back, faulting them in from it), and it goes as fast again on two cores as on one.
READERS = max(1, min(4, os.cpu_count() or 1))


def read(path: Path) -> mmap.mmap:
    """The whole file (header and tensors, at their offsets in it) in private anonymous memory, with 2 MiB
    pages where the kernel gives them, read in ``READERS`` parts at once."""
    with open(path, "rb", buffering=0) as handle:
        nbytes = handle.seek(0, 2)
    anonymous = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    memory = mmap.mmap(-1, max(nbytes, 1), **({"flags": anonymous} if anonymous else {}))
    with contextlib.suppress(AttributeError, OSError, ValueError):  # no THP (Windows, macOS, older kernels)
        memory.madvise(mmap.MADV_HUGEPAGE)
    share = max(HUGE_PAGE, -(-nbytes // READERS // HUGE_PAGE) * HUGE_PAGE)  # whole 2 MiB pages each
    view = memoryview(memory)
    try:
        with ThreadPoolExecutor(READERS) as readers:
            for part in [readers.submit(_read_part, path, view[start:start + share], start)
                         for start in range(0, nbytes, share)]:
                part.result()  # a part's OSError is the read's
    finally:
        view.release()
    return memory


def _read_part(path: Path, into: memoryview, offset: int) -> None:
    with open(path, "rb", buffering=0) as handle:
        handle.seek(offset)
        got = 0
        while got < len(into):  # read() returns at most 2 GiB a call
            count = handle.readinto(into[got:])
            if not count:
                raise OSError(f"{path.name} shrank while it was read")
            got += count


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
