"""Calls from the engine's worker thread onto the IOLoop, many to one wake-up.

``IOLoop.add_callback`` from another thread is asyncio's ``call_soon_threadsafe``,
which writes to the loop's self-pipe on every call: a system call on the
worker's time, between decode steps, where the loop thread it wakes then
competes for the GIL. A step of several streams posts one event for each;
the mailbox wakes the loop once for all that arrive before it runs.
"""
import logging
from collections import deque
from typing import Callable

from tornado.ioloop import IOLoop

log = logging.getLogger("tornchat.server")


class Mailbox:
    def __init__(self, loop: IOLoop):
        self.loop = loop
        self.calls: deque[tuple[Callable, tuple]] = deque()
        self.waking = False  # a delivery is scheduled and has not started

    def post(self, fn: Callable, *args) -> None:
        """From any thread: ``fn(*args)`` on the loop, in the order posted."""
        self.calls.append((fn, args))
        if not self.waking:
            self.waking = True
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
