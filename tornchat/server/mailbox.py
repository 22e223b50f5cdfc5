"""Calls from the engine's worker thread onto the IOLoop, many to one wake-up.

``IOLoop.add_callback`` from another thread is asyncio's ``call_soon_threadsafe``,
which writes to the loop's self-pipe on every call: a system call on the
worker's time, between decode steps, where the loop thread it wakes then
competes for the GIL. A step of several streams posts one event for each;
the mailbox wakes the loop once for all that arrive before it runs.

Where the OS has eventfd, the wake-up is a doorbell of the mailbox's own:
an eventfd the loop watches, written without releasing the GIL. The send
in ``call_soon_threadsafe`` releases it, the woken loop thread takes it,
and the worker then sleeps until the loop gives it back: 2.8% of a
135M server's wall time at two streams (py-spy, AMD Zen 4, 2026-12-06).
Holding it, the worker goes on to the next forward, which releases the GIL
in C++, and the loop runs its deliveries meanwhile: where a core is free of
the forward's threads (--threads 1 on two cores), 1-12% more tokens/s at one
and two streams in each of three rounds in turns; with both cores in the
forward, no difference measurable (docs/performance.md, 2026-12-06).
"""
import ctypes
import logging
import os
from collections import deque
from typing import Callable

from tornado.ioloop import IOLoop

log = logging.getLogger("tornchat.server")


class Mailbox:
    def __init__(self, loop: IOLoop):
        self.loop = loop
        self.calls: deque[tuple[Callable, tuple]] = deque()
        self.waking = False  # a delivery is scheduled and has not started
        self.doorbell = Doorbell.on(loop, self._deliver)

    def post(self, fn: Callable, *args) -> None:
        """From any thread: ``fn(*args)`` on the loop, in the order posted."""
        self.calls.append((fn, args))
        if not self.waking:
            self.waking = True
            if self.doorbell:
                self.doorbell.ring()
            else:
                self.loop.add_callback(self._deliver)

    def _deliver(self) -> None:
        # Cleared before the calls are taken: a call posted from here on either is taken below or schedules its
        # own delivery (which may find nothing left), never neither.
        self.waking = False
        while self.calls:
            fn, args = self.calls.popleft()
            try:
                fn(*args)
            except Exception:  # as add_callback would: logged, and the calls after it still delivered
                log.exception("an engine event's delivery failed")


class Doorbell:
    """An eventfd that runs ``answer`` on the loop each time it is rung (rings before it runs: once). It stays
    open as long as the process: the engine's thread may ring it until the process ends, and a closed number
    could by then be another file's."""

    def __init__(self, loop: IOLoop, answer: Callable[[], None], write: Callable):
        self.loop, self.answer, self.write = loop, answer, write
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.one = ctypes.c_uint64(1)
        loop.add_handler(self.fd, self._rung, IOLoop.READ)

    @classmethod
    def on(cls, loop: IOLoop, answer: Callable[[], None]) -> "Doorbell | None":
        """A doorbell for loop, or None where the OS has no eventfd or the loop watches no file descriptors."""
        if not hasattr(os, "eventfd") or not hasattr(loop, "add_handler"):
            return None
        try:
            # ctypes.PyDLL calls keep the GIL (ctypes.CDLL's, os.write and os.eventfd_write release it).
            write = ctypes.PyDLL(None).write
            write.argtypes, write.restype = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t), ctypes.c_ssize_t
        except (OSError, AttributeError):
            return None
        return cls(loop, answer, write)

    def ring(self) -> None:
        """From any thread, the GIL kept: 8 bytes added to the eventfd's count (it cannot fill: a read empties it)."""
        self.write(self.fd, ctypes.byref(self.one), 8)

    def _rung(self, fd: int, events: int) -> None:
        try:
            os.eventfd_read(fd)
        except BlockingIOError:  # already emptied by an earlier answer
            return
        self.answer()
