"""KV-cache slots reused across calls by longest common token prefix.

Clients resend the whole conversation; a slot remembers the exact token ids
its cache holds (generated ids included), so the next turn prefills only
what follows the shared prefix.
"""
import itertools
from dataclasses import dataclass, field
from typing import Any

from tornchat.engine.model import Runner

_clock = itertools.count()


@dataclass(eq=False)  # identity: the pool removes slots by object, and caches hold tensors that do not compare to a bool
class Slot:
    cache: Any
    tokens: list[int] = field(default_factory=list)  # exactly what cache holds
    last_used: int = 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SlotPool:
    """At most ``max_slots`` caches, together at most ``max_bytes``."""

    def __init__(self, runner: Runner, max_slots: int, max_bytes: int):
        if max_slots < 1:
            raise ValueError("max_slots must be >= 1")
        self.runner = runner
        self.max_slots = max_slots
        self.max_bytes = max_bytes
        self.slots: list[Slot] = []

    def acquire(self, prompt: list[int]) -> tuple[Slot, int]:
        """The slot to generate in, truncated to what it shares with prompt.

        Returns (slot, reused) where reused < len(prompt): even an identical
        prompt prefills its last token, to get fresh logits.
        """
        best, shared = None, 0
        for slot in self.slots:
            n = common_prefix(slot.tokens, prompt)
            if n > shared or (n == shared and best is not None and slot.last_used > best.last_used):
                best, shared = slot, n
        shared = min(shared, len(prompt) - 1)
        if best is None:
            best = self._fresh_slot(self.runner.new_cache(), [])
        elif shared < len(best.tokens):
            # The slot's tail may be another conversation, or a branch the
            # client may come back to: copy the shared prefix instead of
            # cutting it. Least recently used slots make room.
            best = self._fresh_slot(self.runner.fork(best.cache, shared), best.tokens[:shared])
        best.last_used = next(_clock)
        return best, shared

    def _fresh_slot(self, cache, tokens: list[int]) -> Slot:
        if len(self.slots) >= self.max_slots:
            oldest = min(self.slots, key=lambda s: s.last_used)
            self.slots.remove(oldest)
        slot = Slot(cache=cache, tokens=tokens)
        self.slots.append(slot)
        return slot

    def discard(self, slot: Slot) -> None:
        """Forget a slot whose cache may no longer match its tokens (a failed forward)."""
        if slot in self.slots:
            self.slots.remove(slot)

    def total_bytes(self) -> int:
        return sum(self.runner.cache_bytes(s.cache) for s in self.slots)

    def enforce_budget(self) -> None:
        """Drop least recently used slots until the pool fits max_bytes."""
        while self.slots and self.total_bytes() > self.max_bytes:
            self.slots.remove(min(self.slots, key=lambda s: s.last_used))
