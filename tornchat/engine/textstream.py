"""Token ids in, showable text out: incremental detokenization and stop strings."""


class Detokenizer:
    """Decodes a growing list of ids without ever emitting half a character.

    Decoding a window that starts a few tokens back (``prefix``) keeps
    tokenizers that merge spaces or bytes across tokens correct, while the
    cost per token stays constant.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the decoding window
        self.read = 0  # ids before this index have been emitted as text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        emitted = decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        window = decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(window) <= len(emitted) or window.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(emitted) :]


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
