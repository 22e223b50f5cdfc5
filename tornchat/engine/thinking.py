"""A reasoning model's thinking: where it ends in the generated text, and its budget.

Models such as Qwen3 and DeepSeek-R1 write ``<think>...</think>`` before
their answer (or start inside it, where the chat template's generation
prompt opens the tag). ``Splitter`` reads the reply as it arrives and tells
the thinking from the answer; the server uses it to return the two apart,
and ``Budget`` uses it here, in the decode loop, to count the thinking's
tokens and, past a request's budget, to write the closing tag itself so
that the model goes on to its answer.
"""
from tornchat.engine.types import Thinking

OPEN, CLOSE = "<think>", "</think>"
# What the decode loop writes to end thinking cut at its budget: the shape Qwen3 and R1 close it with themselves.
CLOSING = "\n" + CLOSE + "\n\n"

START, THINKING, ANSWER = "start", "thinking", "answer"  # Splitter.state
REASONING, CONTENT = "reasoning", "content"  # the kinds of text Splitter.push returns


class Splitter:
    """Reply text in, (kind, text) pieces out, holding back only what a tag cut across chunks could still be.

    The thinking is the text between an opening ``<think>`` at the very
    start of the reply (or the reply's start, ``inside``) and the first
    ``</think>``; the answer is everything after. The whitespace that
    frames each section (``<think>\\n``, ``\\n</think>\\n\\n``) is dropped,
    as chat templates write it back themselves. A reply that does not
    open with the tag is all answer, as it is.
    """

    def __init__(self, inside: bool):
        self.state = THINKING if inside else START
        self.pending = ""  # text not returned yet
        self.fresh = inside  # at the start of a section, whose leading whitespace is dropped

    def push(self, text: str) -> list[tuple[str, str]]:
        self.pending += text
        out: list[tuple[str, str]] = []
        while self.pending:
            if self.state == START:
                head = self.pending.lstrip()
                if head.startswith(OPEN):
                    self.pending, self.state, self.fresh = head[len(OPEN):], THINKING, True
                elif OPEN.startswith(head):
                    break  # whitespace, or the start of the tag: undecided
                else:
                    self.state = ANSWER
            elif self.state == THINKING:
                end = self.pending.find(CLOSE)
                if end >= 0:
                    self._take(out, REASONING, self.pending[:end].rstrip())
                    self.pending, self.state, self.fresh = self.pending[end + len(CLOSE):], ANSWER, True
                    continue
                # Held: a tail that may still become the closing tag, and whitespace that may come just before it.
                safe = self.pending[: len(self.pending) - _partial(self.pending, CLOSE)].rstrip()
                self._take(out, REASONING, safe)
                self.pending = self.pending[len(safe):]
                break
            else:
                self._take(out, CONTENT, self.pending)
                self.pending = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is still held back, once the reply has ended."""
        out: list[tuple[str, str]] = []
        rest, self.pending = self.pending, ""
        if self.state == THINKING:
            self._take(out, REASONING, rest.rstrip())  # cut off while thinking
        elif self.state == START:
            self._take(out, CONTENT, rest)
        return out

    def _take(self, out: list[tuple[str, str]], kind: str, text: str) -> None:
        if self.fresh:
            text = text.lstrip()
        if text:
            self.fresh = False
            out.append((kind, text))


def _partial(text: str, tag: str) -> int:
    """Length of the longest tail of text that is a proper prefix of tag."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class Budget:
    """Follows one reply's thinking token by token; past ``Thinking.budget`` tokens it forces the close.

    A token counts against the budget when the thinking was open before it
    (the tokens that write the opening tag do not, the ones that write the
    closing tag do). Once the budget is spent and the thinking still open,
    ``forced`` names the tokens of CLOSING one step at a time, and the model
    writes its answer after them.
    """

    def __init__(self, thinking: Thinking, tokenizer):
        self.splitter = Splitter(thinking.inside)
        self.limit = thinking.budget
        self.closing_ids: list[int] = tokenizer(CLOSING, add_special_tokens=False)["input_ids"]
        self.queued: list[int] | None = None  # the closing tokens still to write, once forced
        self.spent = 0  # tokens written while the thinking was open, forced ones aside
        self.reasoning_tokens = 0  # every token of the thinking, its tags included (usage)
        self.undecided = 0  # tokens written while the reply could still be opening the tag

    def forced(self) -> int | None:
        """The token the next step must write, or None where the model chooses."""
        if self.queued is None and self.limit is not None and self.splitter.state == THINKING and self.spent >= self.limit:
            self.queued = list(self.closing_ids)
        return self.queued[0] if self.queued else None

    def observe(self, text: str) -> None:
        """The text of the token just written (empty while a character is incomplete)."""
        before = self.splitter.state
        self.splitter.push(text)
        if self.queued:
            self.queued.pop(0)
        elif before == THINKING:
            self.spent += 1
        after = self.splitter.state
        if after == START:
            self.undecided += 1
        elif before == START and after == THINKING:
            self.reasoning_tokens += self.undecided  # they wrote the opening tag
        if THINKING in (before, after):
            self.reasoning_tokens += 1
