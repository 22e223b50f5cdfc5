"""Generations decoded together: each step is one forward over the rows every running generation asks for.

A generation (decode.generate) yields the forward it needs next: a prefill
chunk, a one-token step or a verify of drafts. ``Batch.step`` gathers one
such request from each running generation into ``runner.forward_many``
and sends each its own logits back. The C++ forward computes each row by
itself, so a generation's reply is the same batched as alone; a batch
reads every weight once for all its rows, which is what makes N streams
cheaper than N times one.

A prompt chunk that shares a forward with other generations sets how long
they wait for their next token (a stream's next piece, a new request's first
one): there ``Batch.step`` reads fewer of its rows than offered, as many as
take about ``SHARED_GAP_S`` at the rows' measured cost, and the generation
learns how many (a chunk's size changes no row's bits).
"""
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from tornchat.engine.decode import Forward
from tornchat.engine.model import PREFILL_CHUNK, Runner

Finish = Callable[[BaseException | None], None]  # called once when a generation ends; the exception if it failed

# How long a forward that reads prompt chunks beside other generations should take: a stream's gap between tokens
# while a prompt is read, or a new request's wait behind one (llama-server holds its streams for a whole prompt).
# Each smaller chunk reads the weights once more and spreads the block kernels' unpacking over fewer rows, so a
# chunk reads SHARED_CHUNK_MIN rows at least: where that takes longer than the gap (a 1B and larger on 2 cores),
# the others wait a little longer and the prompt's first token comes 1.0-1.2x later than alone; at some 40-55 rows
# (a 1B's 0.25 s) it came 1.2-1.5x later (AMD Zen 4, docs/performance.md, 2026-12-07).
SHARED_GAP_S = 0.25
SHARED_CHUNK_MIN = 128  # also the size before any chunk's cost was measured


@dataclass(eq=False)
class Running:
    generation: Generator[Forward, torch.Tensor, None]
    pending: Forward  # the forward it waits for
    finish: Finish


class Batch:
    """At most ``limit`` generations, stepped together."""

    def __init__(self, runner: Runner, limit: int):
        if limit < 1:
            raise ValueError("a batch holds at least one generation")
        self.runner = runner
        self.limit = limit
        self.running: list[Running] = []
        self.largest = 0  # most generations one forward has served (tests, /metrics)
        self.stepped = 1  # generations in the last forward: what a draft's rows are weighed against
        self.row_seconds: float | None = None  # the last forward that read prompt rows: its seconds per such row

    def __len__(self) -> int:
        return len(self.running)

    def full(self) -> bool:
        return len(self.running) >= self.limit

    def add(self, generation: Generator[Forward, torch.Tensor, None], finish: Finish) -> None:
        """Start a generation: it runs up to the first forward it needs (or to its end)."""
        self._advance(generation, finish, lambda: next(generation))

    def shared_rows(self, prompts: int) -> int:
        """Rows each of ``prompts`` prompt chunks reads in a forward beside other generations: together as many as
        take SHARED_GAP_S at the last prompt rows' measured cost (a forward's fixed cost counted in it, so that the
        size settles where the whole forward takes about that long), within SHARED_CHUNK_MIN and PREFILL_CHUNK."""
        if self.row_seconds is None:
            return SHARED_CHUNK_MIN
        return max(SHARED_CHUNK_MIN, min(PREFILL_CHUNK, int(SHARED_GAP_S / (self.row_seconds * prompts))))

    def step(self) -> None:
        """One forward over every running generation's rows; each goes on to the forward it needs next. A lone
        generation's step whose token the runner can choose itself (``Forward.choice``) is chosen there."""
        running, self.running = self.running, []
        self.stepped = len(running)
        self.largest = max(self.largest, len(running))
        chunks = [r for r in running if not r.pending.every]
        if chunks and len(running) > 1:  # others wait on this forward: each prompt read in fewer rows than offered
            rows = self.shared_rows(len(chunks))
            for r in chunks:
                r.pending = r.pending._replace(token_ids=r.pending.token_ids[:rows])
        prompt_rows = sum(len(r.pending.token_ids) for r in chunks)
        try:
            if len(running) == 1 and running[0].pending.choice is not None:
                token_ids, cache, _, choice = running[0].pending
                results = [[self.runner.choose_step(token_ids[0], cache, choice)]]
            else:
                started = time.perf_counter()
                results = self.runner.forward_many([r.pending[:3] for r in running])
                if prompt_rows:  # on CUDA what the host waited for, at most the device's time: chunks stay whole
                    self.row_seconds = (time.perf_counter() - started) / prompt_rows
        except Exception as exc:  # the model failed: every generation in the forward fails with it
            for r in running:
                self._advance(r.generation, r.finish, lambda r=r, exc=exc: r.generation.throw(exc))
            return
        for r, logits in zip(running, results):
            sent = logits if r.pending.every else (logits, len(r.pending.token_ids))  # a chunk: how many rows read
            self._advance(r.generation, r.finish, lambda r=r, sent=sent: r.generation.send(sent))

    def _advance(self, generation, finish: Finish, resume: Callable[[], Forward]) -> None:
        try:
            pending = resume()
        except StopIteration:
            finish(None)
        except Exception as exc:
            finish(exc)
        else:
            self.running.append(Running(generation, pending, finish))
