"""The engine: requests from a bounded FIFO queue, up to ``parallel`` of them decoded together (scheduler.py)
on one worker thread."""
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tornchat.engine import decode, scheduler, speculate
from tornchat.engine.model import Runner
from tornchat.engine.slots import SlotPool
from tornchat.engine.types import Event, GenerationRequest, QueueFull

log = logging.getLogger("tornchat.engine")

FAULT_ENV = "TORNCHAT_FAULT"
OUT_OF_MEMORY = "the device ran out of memory"


@dataclass(frozen=True)
class Fault:
    """Test hook, off unless TORNCHAT_FAULT=KIND:N is set when the Engine starts.

    In every generation, model step N (prefill chunks and decode steps count
    alike, from 1) raises instead of running: KIND ``error`` raises a
    RuntimeError, ``oom`` a torch.OutOfMemoryError. Generations shorter than
    N steps are unaffected, so one server process shows both the failure and
    the recovery. It rides on the cancellation check, which the decode loop
    calls once before every step.
    """

    kind: str
    step: int

    @classmethod
    def from_env(cls) -> "Fault | None":
        spec = os.environ.get(FAULT_ENV)
        if not spec:
            return None
        kind, _, step = spec.partition(":")
        if kind not in ("error", "oom") or not step.isdigit() or int(step) < 1:
            raise ValueError(f"{FAULT_ENV}={spec!r}: expected error:N or oom:N with N >= 1")
        log.warning("fault injection on: model step %s of every generation raises (%s)", step, kind)
        return cls(kind, int(step))

    def arm(self, cancelled: Callable[[], bool]) -> Callable[[], bool]:
        steps = itertools.count(1)

        def check() -> bool:
            if next(steps) == self.step:
                if self.kind == "oom":
                    raise torch.OutOfMemoryError(f"injected by {FAULT_ENV}")
                raise RuntimeError(f"injected by {FAULT_ENV}")
            return cancelled()

        return check




@dataclass(eq=False)  # identity: two equal requests are still two requests to withdraw
class Handle:
    """A submitted request. ``cancel`` takes effect within one decode step."""

    request: GenerationRequest
    on_event: Callable[[Event], None]
    _cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)  # when it joined the queue

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


QUEUE_WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds


@dataclass
class EngineStats:
    """Counters the tests and /metrics read. Written by the worker thread only."""

    counters: dict = field(
        default_factory=lambda: {
            "requests": 0,
            "completed": 0,
            "cancelled": 0,
            "failed": 0,
            "prefill_tokens": 0,
            "reused_tokens": 0,
            "decode_steps": 0,  # forwards after the prompt: one-token steps and verifies alike
            "drafted_tokens": 0,
            "accepted_tokens": 0,
        }
    )
    last_prefill_tokens: int = 0
    last_reused_tokens: int = 0
    kv_slots: int = 0  # slots held when the last generation ended (a cancelled one leaves them as they were)
    kv_bytes: int = 0  # their caches, together
    # Seconds from a request's arrival in the queue to its generation's start: how many fell at or under each of
    # QUEUE_WAIT_BUCKETS (the last count: above them all), and their sum.
    queue_waits: list = field(default_factory=lambda: [0] * (len(QUEUE_WAIT_BUCKETS) + 1))
    queue_wait_sum: float = 0.0

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_waits[next((i for i, le in enumerate(QUEUE_WAIT_BUCKETS) if seconds <= le), -1)] += 1
        self.queue_wait_sum += seconds


class Engine:
    """Runs queued requests on its worker thread, up to ``parallel`` at once (first come, first served).

    The constructor starts that thread, unless ``on_this_thread``: then the
    calling thread is the worker and calls ``run_forever`` next (see ``start``).
    ``measuring``: speculation's costs being measured (``speculate.measuring``, the start did not wait for
    it), run a piece at a time while nothing is queued or running; what it returns becomes ``speculation``.
    """

    def __init__(
        self,
        runner: Runner,
        tokenizer,
        stop_token_ids: frozenset[int],
        slots: SlotPool,
        max_queue: int = 16,
        on_this_thread: bool = False,
        speculation: speculate.Costs | None = None,
        measuring: Generator[None, None, speculate.Costs | None] | None = None,
        parallel: int = 1,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids
        self.slots = slots
        self.max_queue = max_queue
        self.speculation = speculation  # None: one token per forward
        self._measuring = measuring
        self.batch = scheduler.Batch(runner, parallel)
        self.stats = EngineStats()
        self.fault = Fault.from_env()
        self._waiting: deque[Handle] = deque()
        # A step's events, handed on once every generation in it has moved on (_hand_on).
        self._outgoing: list[tuple[Callable[[Event], None], Event]] = []
        self._wakeup = threading.Condition()
        self._closed = False
        if on_this_thread:
            self._thread = threading.current_thread()
        else:
            self._thread = threading.Thread(target=self.run_forever, name="tornchat-decode", daemon=True)
            self._thread.start()

    @classmethod
    def start(cls, build: Callable[[], "Engine"]) -> "Engine":
        """A worker thread that calls build() (loading the model, ``on_this_thread=True``), then serves.

        With OpenMP, every thread that runs torch ops gets a team of its own;
        two teams on few cores throttle each other's barriers, so the model
        is loaded on the thread that runs it (docs/performance.md has what
        the second team cost). build's exceptions are raised here.
        """
        built: Future[Engine] = Future()

        def work() -> None:
            try:
                engine = build()
            except BaseException as exc:  # reported to the caller, which decides
                built.set_exception(exc)
                return
            built.set_result(engine)
            engine.run_forever()

        threading.Thread(target=work, name="tornchat-decode", daemon=True).start()
        return built.result()

    @property
    def context_length(self) -> int:
        return self.runner.context_length

    def queue_depth(self) -> int:
        return len(self._waiting)

    def running(self) -> int:
        return len(self.batch)

    def submit(self, request: GenerationRequest, on_event: Callable[[Event], None]) -> Handle:
        """Queue a request; on_event is called from the worker thread. Raises QueueFull."""
        decode.token_budget(request, self.runner.context_length)  # PromptTooLong before queueing
        handle = Handle(request, on_event)
        with self._wakeup:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting")
            self._waiting.append(handle)
            self._wakeup.notify()
        return handle

    def withdraw(self, handle: Handle) -> None:
        """Cancel a request; one still waiting leaves the queue at once."""
        handle.cancel()
        with self._wakeup:
            if handle in self._waiting:
                self._waiting.remove(handle)
                self.stats.counters["cancelled"] += 1

    def generate(self, request: GenerationRequest) -> Iterator[Event]:
        """Blocking iterator over one request's events (tests, benchmarks, scripts)."""
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        handle = self.submit(request, events.put)
        event = Event()
        try:
            while not event.is_last:
                event = events.get()
                yield event
        finally:
            if not event.is_last:  # the caller stopped early
                self.withdraw(handle)

    def close(self) -> None:
        with self._wakeup:
            self._closed = True
            for handle in self._waiting:
                handle.cancel()
            self._waiting.clear()
            self._wakeup.notify()
        self._thread.join(timeout=10)

    def _admit(self) -> bool:
        """Move waiting requests into the batch while it has room, waiting for one when nothing runs (or
        measuring meanwhile); False once closed."""
        while True:
            self._hand_on()  # the last step's or admission's events: out before any wait
            with self._wakeup:
                while self._idle() and self._measuring is None:
                    self._wakeup.wait()
                if self._closed:
                    return False
                idle = self._idle()
                if not idle and (not self._waiting or self.batch.full()):
                    return True
                handle = None if idle else self._waiting.popleft()
            if handle is None:
                self._measure_a_piece()
            else:
                self._start(handle)

    def _idle(self) -> bool:
        """Nothing waiting, nothing running (asked with ``_wakeup`` held)."""
        return not self._waiting and not self._closed and not len(self.batch)

    def _measure_a_piece(self) -> None:
        """One piece of ``measuring`` (a round of verifies: a request that comes meanwhile waits for it alone)."""
        try:
            next(self._measuring)
        except StopIteration as done:
            self.speculation, self._measuring = done.value, None
        except Exception:  # drafts stay off; the engine serves on
            log.exception("measuring a verify's costs failed")
            self._measuring = None

    def run_forever(self) -> None:
        """The worker loop: admit (handing on the events of the step before), then one forward over every
        running generation, until close()."""
        while self._admit():
            if len(self.batch):
                self.batch.step()

    def _hand_on(self) -> None:
        """Each event of the step (or admissions) just done to its on_event, in order.

        Held until the whole step is done because the server's on_event wakes
        its IOLoop thread, which then takes the GIL at the worker's next
        release (every torch call) and keeps it while it writes the events:
        the worker's Python between forwards waited on it. Handed on
        together, the loop writes them while the next forward runs in C++
        without the GIL (135M server at 4 streams, AMD Zen 4: 1.0 -> 0.3 ms
        of Python between forwards; docs/performance.md, 2026-12-06).
        """
        outgoing, self._outgoing = self._outgoing, []
        for on_event, event in outgoing:
            try:
                on_event(event)
            except Exception:  # the receiver's failure: the worker and the other generations go on
                log.exception("an event's receiver failed")

    def _start(self, handle: Handle) -> None:
        counters = self.stats.counters
        counters["requests"] += 1
        self.stats.observe_queue_wait(time.monotonic() - handle.submitted)
        prefill_before, reused_before = counters["prefill_tokens"], counters["reused_tokens"]
        finished = False

        def emit(event: Event) -> None:
            # Counters are settled before the last event leaves, so whoever
            # receives it reads final numbers.
            nonlocal finished
            if event.is_last:
                finished = True
                counters["failed" if event.error else "completed"] += 1
                self.stats.last_prefill_tokens = counters["prefill_tokens"] - prefill_before
                self.stats.last_reused_tokens = counters["reused_tokens"] - reused_before
                self.stats.kv_slots = len(self.slots.slots)
                self.stats.kv_bytes = self.slots.total_bytes()
            self._outgoing.append((handle.on_event, event))

        def cancelled() -> bool:
            return handle.cancelled

        def finish(exc: BaseException | None) -> None:
            if exc is None:
                if not finished:
                    counters["cancelled"] += 1
            elif isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
                # decode has dropped the slot; hand its memory back before the next request.
                log.error("generation failed: %s (%s)", OUT_OF_MEMORY, exc)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                emit(Event(error=MemoryError(OUT_OF_MEMORY)))
            else:
                log.error("generation failed", exc_info=exc)
                emit(Event(error=exc))

        generation = decode.generate(
            self.runner,
            self.slots,
            self.tokenizer,
            self.stop_token_ids,
            handle.request,
            emit,
            self.fault.arm(cancelled) if self.fault else cancelled,
            counters,
            self.speculation,
            lambda: self.batch.stepped,
        )
        self.batch.add(generation, finish)
