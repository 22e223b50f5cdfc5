"""KV-cache slots reused across calls by longest common token prefix.

Clients resend the whole conversation; a slot remembers the exact token ids
its cache holds (generated ids included), so the next turn prefills only
what follows the shared prefix. Where the resent text tokenizes differently
from the ids the model generated, the prompt takes the slot's ids (realign).
"""
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tornchat.engine.model import Runner

_clock = itertools.count()


@dataclass(eq=False)  # identity: the pool removes slots by object, and caches hold tensors that do not compare to a bool
class Slot:
    cache: Any
    tokens: list[int] = field(default_factory=list)  # exactly what cache holds
    prompt_length: int = 0  # the last generation's prompt: tokens past it are its reply
    last_used: int = 0
    busy: bool = False  # a running generation's: neither taken over nor dropped until released


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def realign(prompt: list[int], cached: list[int], spelling: Sequence[bytes]) -> list[int]:
    """prompt, with cached's ids in place of its own for as long as both spell the same bytes.

    A model's tokens for a text are not always its tokenizer's (SmolLM2
    writes "\n\n" as one token, the tokenizer splits it in two), so a reply
    the client sends back can tokenize differently from the ids a slot holds.
    The result spells the same text; it is used only if no longer than prompt,
    whose token budget has been checked.
    """
    start = common_prefix(cached, prompt)
    a = b = start  # next token of cached, of prompt
    text_a, text_b = bytearray(), bytearray()  # what cached[start:a] and prompt[start:b] spell
    checked = 0  # bytes known to agree
    aligned = (start, start)
    while True:
        if len(text_a) <= len(text_b):
            if a == len(cached) or cached[a] >= len(spelling):  # models may have ids their tokenizer lacks
                break
            text_a += spelling[cached[a]]
            a += 1
        else:
            if b == len(prompt):
                break
            text_b += spelling[prompt[b]]
            b += 1
        shorter = min(len(text_a), len(text_b))
        if text_a[checked:shorter] != text_b[checked:shorter]:
            break
        checked = shorter
        if len(text_a) == len(text_b):
            aligned = (a, b)
    a, b = aligned
    realigned = cached[:a] + prompt[b:]
    return realigned if len(realigned) <= len(prompt) else prompt


class SlotPool:
    """At most ``max_slots`` caches, together at most ``max_bytes``.

    With ``spelling`` (the bytes of each token id, ``stopcheck.prompt_bytes``)
    a prompt is matched against each slot by text as well as by ids (realign).
    """

    def __init__(self, runner: Runner, max_slots: int, max_bytes: int, spelling: Sequence[bytes] | None = None):
        if max_slots < 1:
            raise ValueError("max_slots must be >= 1")
        self.runner = runner
        self.max_slots = max_slots
        self.max_bytes = max_bytes
        self.spelling = spelling
        self.slots: list[Slot] = []

    def acquire(self, prompt: list[int]) -> tuple[Slot, int, list[int]]:
        """The slot to generate in, truncated to what it shares with the prompt.

        Returns (slot, reused, prompt ids to use): the prompt, realigned to
        the chosen slot's ids where they spell the same text. reused is below
        its length: even an identical prompt prefills its last token, to get
        fresh logits.
        """
        best, shared, chosen = None, 0, prompt
        for slot in self.slots:
            candidate = realign(prompt, slot.tokens, self.spelling) if self.spelling else prompt
            n = common_prefix(slot.tokens, candidate)
            if min(n, len(candidate) - 1) < self.runner.resumable_from(slot.cache):
                continue  # its windowed layers no longer hold what the first new row would see
            if n > shared or (n == shared and best is not None and slot.last_used > best.last_used):
                best, shared, chosen = slot, n, candidate
        prompt = chosen
        shared = min(shared, len(prompt) - 1)
        if best is None:
            best = self._fresh_slot(self.runner.new_cache(), [])
        elif shared < len(best.tokens) and not best.busy and shared >= best.prompt_length > 0:
            # The slot's whole last prompt, then text other than the reply generated after it: the next turn,
            # its history rendered again by the template (an earlier reply's thinking dropped, a reply cut at
            # max_tokens closed). The client has moved past that reply, so it is cut here; a copy of the
            # prefix kept the conversation twice over at every such turn.
            del best.tokens[shared:]
            self.runner.truncate(best.cache, shared)
        elif shared < len(best.tokens) or best.busy:
            # The slot's tail may be another conversation, or a branch the
            # client may come back to (the same prompt again: another reply),
            # or a generation running beside this one: copy the shared prefix
            # instead of cutting it. Least recently used slots make room.
            best = self._fresh_slot(self.runner.fork(best.cache, shared), best.tokens[:shared])
        best.prompt_length = len(prompt)
        self.runner.hold(best.cache, len(prompt) - 1)  # the same prompt again, or the next turn, can go on from it
        best.last_used = next(_clock)
        best.busy = True
        return best, shared, prompt

    def release(self, slot: Slot) -> None:
        """The generation in slot has ended: the slot may be reused, or dropped to make room."""
        slot.busy = False

    def _fresh_slot(self, cache, tokens: list[int]) -> Slot:
        idle = [s for s in self.slots if not s.busy]
        if len(self.slots) >= self.max_slots and idle:  # with every slot running, the pool grows for a while
            self.slots.remove(min(idle, key=lambda s: s.last_used))
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
        """Drop least recently used idle slots until the pool fits max_slots and max_bytes (running ones stay:
        while more generations run than there are slots, the pool is larger for a while)."""
        while (len(self.slots) > self.max_slots or self.total_bytes() > self.max_bytes) and (
                idle := [s for s in self.slots if not s.busy]):
            self.slots.remove(min(idle, key=lambda s: s.last_used))
