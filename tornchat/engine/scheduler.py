"""Generations decoded together: each step is one forward over the rows every running generation asks for.

A generation (decode.generate) yields the forward it needs next: a prefill
chunk, a one-token step or a verify of drafts. ``Batch.step`` gathers one
such request from each running generation into ``runner.forward_many``
and sends each its own logits back. The C++ forward computes each row by
itself, so a generation's reply is the same batched as alone; a batch
reads every weight once for all its rows, which is what makes N streams
cheaper than N times one.
"""
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from tornchat.engine.decode import Forward
from tornchat.engine.model import Runner

Finish = Callable[[BaseException | None], None]  # called once when a generation ends; the exception if it failed


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

    def __len__(self) -> int:
        return len(self.running)

    def full(self) -> bool:
        return len(self.running) >= self.limit

    def add(self, generation: Generator[Forward, torch.Tensor, None], finish: Finish) -> None:
        """Start a generation: it runs up to the first forward it needs (or to its end)."""
        self._advance(generation, finish, lambda: next(generation))

    def step(self) -> None:
        """One forward over every running generation's rows; each goes on to the forward it needs next. A lone
        generation's step whose token the runner can choose itself (``Forward.choice``) is chosen there."""
        running, self.running = self.running, []
        self.stepped = len(running)
        self.largest = max(self.largest, len(running))
        try:
            if len(running) == 1 and running[0].pending.choice is not None:
                token_ids, cache, _, choice = running[0].pending
                results = [[self.runner.choose_step(token_ids[0], cache, choice)]]
            else:
                results = self.runner.forward_many([r.pending[:3] for r in running])
        except Exception as exc:  # the model failed: every generation in the forward fails with it
            for r in running:
                self._advance(r.generation, r.finish, lambda r=r, exc=exc: r.generation.throw(exc))
            return
        for r, logits in zip(running, results):
            self._advance(r.generation, r.finish, lambda r=r, logits=logits: r.generation.send(logits))

    def _advance(self, generation, finish: Finish, resume: Callable[[], Forward]) -> None:
        try:
            pending = resume()
        except StopIteration:
            finish(None)
        except Exception as exc:
            finish(exc)
        else:
            self.running.append(Running(generation, pending, finish))
