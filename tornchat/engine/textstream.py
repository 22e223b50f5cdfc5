"""Token ids in, showable text out: incremental detokenization, stop strings, and the reply's text events."""
from tornchat.engine.types import Event


class Detokenizer:
    """Decodes a growing list of ids without ever emitting half a character.

    Decoding a window that starts a few tokens back (``prefix``) keeps
    tokenizers that merge spaces or bytes across tokens correct, while the
    cost per token stays constant.

    Special tokens are skipped, except those in ``keep``: a tool-call
    format's markers that the tokenizer has as special tokens
    (``<|python_tag|>``), which the reply's parser must see.
    """

    def __init__(self, tokenizer, keep: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.skipped = frozenset(special_tokens(tokenizer).values()) - keep if keep else None  # None: every special token
        self.ids: list[int] = []
        self.prefix = 0  # start of the decoding window
        self.read = 0  # ids before this index have been emitted as text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        emitted = self._decode(self.ids[self.prefix : self.read])
        window = self._decode(self.ids[self.prefix :])
        if len(window) <= len(emitted) or window.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(emitted) :]

    def _decode(self, ids: list[int]) -> str:
        if self.skipped is None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        # The tokenizer skips all special tokens or none: drop the unwanted ones first, then decode the rest as written.
        return self.tokenizer.decode([i for i in ids if i not in self.skipped], skip_special_tokens=False)


def special_tokens(tokenizer) -> dict[str, int]:
    """The tokens decode(skip_special_tokens=True) skips (the added tokens marked special), text -> id."""
    return {token.content: i for i, token in tokenizer.added_tokens_decoder.items() if token.special}


class StopMatcher:
    """Finds stop strings in streamed text, holding back only what could still become one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            safe, self.pending = self.pending[: min(hits)], ""
            return safe, True
        hold = self._held_suffix()
        safe = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(safe) :]
        return safe, False

    def flush(self) -> str:
        rest, self.pending = self.pending, ""
        return rest

    def _held_suffix(self) -> int:
        """Length of the longest tail of pending that is a proper prefix of a stop string."""
        for length in range(min(len(self.pending), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            tail = self.pending[-length:]
            if any(s.startswith(tail) for s in self.stops):
                return length
        return 0


class Outbox:
    """A reply's tokens -> its text events: detokenized, stop strings held back, sent whenever there is text.

    ``observe``: also told each token's text (a thinking budget counts the
    thinking's tokens by it).
    """

    def __init__(self, tokenizer, keep: frozenset[int], stop: tuple[str, ...], emit, observe=None):
        self.detok, self.stops = Detokenizer(tokenizer, keep), StopMatcher(stop)
        self.emit, self.observe = emit, observe
        self.text, self.ids, self.logprobs = "", [], []  # not sent yet: text, its ids, their TokenLogprobs

    def push(self, token: int, logprob=None) -> bool:
        """Add a token; True where the text now ends with a stop string (the reply ends before it)."""
        self.ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        fresh = self.detok.push(token)
        if self.observe is not None:
            self.observe(fresh)
        piece, hit = self.stops.push(fresh)
        self.text += piece
        return hit

    def send(self) -> None:
        """Send what text there is (held-back text waits), with the ids and logprobs that wrote it."""
        if self.text:
            self._send(self.text)

    def close(self, hit_stop_string: bool) -> None:
        """The reply ended: send the rest, and what was held back unless it began a stop string; tokens that
        wrote no text (skipped special tokens, an unfinished character) still go out with their logprobs,
        which the usage counts."""
        rest = "" if hit_stop_string else self.stops.flush()
        if self.text or rest or self.ids:
            self._send(self.text + rest)

    def _send(self, text: str) -> None:
        self.emit(Event(text=text, token_ids=tuple(self.ids), logprobs=tuple(self.logprobs)))
        self.text, self.ids, self.logprobs = "", [], []
