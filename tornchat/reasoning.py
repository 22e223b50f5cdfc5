"""Reasoning models' thinking, returned apart from the answer, and the switches that turn it off or cap it.

A chat template thinks when it mentions ``<think>`` or ``enable_thinking``
(Qwen3, DeepSeek-R1 and their descendants). For such a template, a request
gets a ``Thinking`` for the decode loop (where the reply starts, and the
budget the loop enforces: engine/thinking.py) and its reply parser is
wrapped in ``Parser``, which sends the thinking out as ``reasoning`` pieces
and only the answer on to the tool-call parser: a call written while
thinking is no call.

Thinking is on unless the server's ``reasoning`` setting or the request
turns it off. Off, the template is rendered with ``enable_thinking=False``
(Qwen3's switch: it writes an empty thinking block); a template that opens
the thinking in its generation prompt all the same (R1's) gets a budget of
0, so the loop closes it at once.
"""
from dataclasses import dataclass

from tornchat.engine.thinking import CONTENT, OPEN, Splitter
from tornchat.engine.types import Thinking
from tornchat.functions import Piece

SWITCH = "enable_thinking"  # the template variable Qwen3's templates read


@dataclass(frozen=True)
class Asked:
    """What a request says about thinking, from whichever API carried it."""

    enabled: bool | None = None  # None: the server's default
    budget: int | None = None  # thinking tokens allowed; None: the server's


def template_thinks(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return OPEN in template or SWITCH in template


def template_kwargs(thinks: bool, enabled: bool, given: dict) -> dict:
    """The variables the template is rendered with: the request's own, and the switch where the template thinks."""
    return {**given, SWITCH: enabled} if thinks else given


def thinking(prompt_text: str, thinks: bool, enabled: bool, budget: int | None) -> Thinking | None:
    """What the decode loop is told about the reply to this prompt; None: it is all answer."""
    if not thinks:
        return None
    inside = prompt_text.rstrip().endswith(OPEN)
    if enabled:
        return Thinking(inside, budget)
    return Thinking(inside, 0) if inside else None


def tighter(*budgets: int | None) -> int | None:
    """The smallest of the budgets given (the server's cap and the request's), None if none is."""
    return min((b for b in budgets if b is not None), default=None)


class Parser:
    """The reply parser for a thinking reply: thinking as ``reasoning`` pieces, the answer through ``inner``.

    ``inner`` is the plan's tool-call parser (push / finish -> pieces), or
    None where all the answer is content.
    """

    def __init__(self, thinking: Thinking, inner):
        self.splitter = Splitter(thinking.inside)
        self.inner = inner

    def push(self, text: str) -> list[Piece]:
        return self._pieces(self.splitter.push(text))

    def finish(self) -> list[Piece]:
        pieces = self._pieces(self.splitter.finish())
        return pieces + (self.inner.finish() if self.inner is not None else [])

    def _pieces(self, parts: list[tuple[str, str]]) -> list[Piece]:
        pieces: list[Piece] = []
        for kind, text in parts:
            if kind != CONTENT:
                pieces.append(Piece("reasoning", text))
            elif self.inner is None:
                pieces.append(Piece("content", text))
            else:
                pieces += self.inner.push(text)
        return pieces
