"""Reply bodies in the OpenAI shape: chat.completion(.chunk), text_completion, model list.

``Reply`` collects one choice's pieces (reasoning, content, call name, call arguments)
and gives both the streamed delta for each piece and the whole message at
the end, so the two modes cannot drift apart; ``TextReply`` does the same
for /v1/completions. Token log-probabilities, where asked for, ride on the
next chunk sent after they arrive, and all of them on a whole reply. A request
for n choices has n replies that share one id (``first``), each with its index.
"""
import secrets
import time

from tornchat import MODEL_ID
from tornchat.engine.types import TokenLogprob, Usage
from tornchat.functions import Piece


def model_card() -> dict:
    return {
        "id": MODEL_ID,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "owner",
        "root": None,
        "parent": None,
        "permission": None,
    }


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {
            "reasoning_tokens": usage.reasoning_tokens,
            "accepted_prediction_tokens": usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens,
        },
    }


def total_usage(usages: list[Usage]) -> Usage:
    """The usage of n choices of one prompt: the prompt counted once (choice 0's), the completions summed, as OpenAI counts."""
    first = usages[0]
    return Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=first.cached_tokens,
        accepted_prediction_tokens=sum(u.accepted_prediction_tokens for u in usages),
        rejected_prediction_tokens=sum(u.rejected_prediction_tokens for u in usages),
        reasoning_tokens=sum(u.reasoning_tokens for u in usages),
    )


def completion(choices: list[tuple["_Reply", str]], usage: Usage) -> dict:
    """The whole (not streamed) reply: each choice's reply with its engine finish reason."""
    first = choices[0][0]
    return {**first.envelope(first.completion_object), "choices": [r.choice(reason) for r, reason in choices], "usage": usage_body(usage)}


def _token(token_id: int, logprob: float, spelling: tuple[bytes, ...]) -> dict:
    spelled = spelling[token_id] if token_id < len(spelling) else b""  # models may have ids their tokenizer lacks
    return {"token": spelled.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(spelled)}


class Logprobs:
    """One reply's token log-probabilities in the chat shape, and how many have been streamed."""

    def __init__(self, spelling: tuple[bytes, ...]):
        self.spelling = spelling  # the bytes of each token id
        self.content: list[dict] = []
        self.sent = 0

    def add(self, entries: tuple[TokenLogprob, ...]) -> None:
        for entry in entries:
            token = _token(entry.token_id, entry.logprob, self.spelling)
            token["top_logprobs"] = [_token(t, lp, self.spelling) for t, lp in entry.top]
            self.content.append(token)

    def unsent(self) -> list[dict]:
        start, self.sent = self.sent, len(self.content)
        return self.content[start:]


def legacy_logprobs(content: list[dict], offset: int) -> dict:
    """Chat-shaped entries in /v1/completions' shape; text_offset counts characters from offset."""
    offsets, text = [], b""
    for token in content:
        offsets.append(offset + len(text.decode("utf-8", errors="ignore")))
        text += bytes(token["bytes"])
    return {
        "tokens": [t["token"] for t in content],
        "token_logprobs": [t["logprob"] for t in content],
        "top_logprobs": [{top["token"]: top["logprob"] for top in t["top_logprobs"]} for t in content],
        "text_offset": offsets,
    }


class _Reply:
    """What both reply kinds share: id, timestamps, log-probabilities, the usage chunk."""

    id_prefix = chunk_object = completion_object = ""

    def __init__(self, spelling: tuple[bytes, ...] | None, index: int = 0, first: "_Reply | None" = None):
        self.index = index
        self.id = first.id if first else self.id_prefix + secrets.token_hex(12)
        self.created = first.created if first else int(time.time())
        self.logprobs = None if spelling is None else Logprobs(spelling)  # None: not asked for

    def add_logprobs(self, entries: tuple[TokenLogprob, ...]) -> None:
        if self.logprobs is not None:
            self.logprobs.add(entries)

    def finish_reason(self, engine_reason: str) -> str:
        return engine_reason

    def opening(self) -> list[dict]:
        """Chunks a stream starts with, before any text."""
        return []

    def envelope(self, kind: str | None = None) -> dict:
        return {"id": self.id, "object": kind or self.chunk_object, "created": self.created, "model": MODEL_ID}

    def usage_chunk(self, usage: Usage) -> dict:
        """The extra chunk ``stream_options.include_usage`` asks for: no choices, only usage."""
        return {**self.envelope(), "choices": [], "usage": usage_body(usage)}


class Reply(_Reply):
    """/v1/chat/completions."""

    id_prefix, chunk_object, completion_object = "chatcmpl-", "chat.completion.chunk", "chat.completion"

    def __init__(self, call_style: str | None, spelling: tuple[bytes, ...] | None = None, index: int = 0, first: "Reply | None" = None):
        super().__init__(spelling, index, first)
        self.call_style = call_style  # "functions", "tools" or None (no functions offered)
        self.content: list[str] = []
        self.reasoning: list[str] = []  # a thinking model's thinking (tornchat/reasoning.py)
        self.calls: list[dict] = []  # {id, name, arguments}

    def opening(self) -> list[dict]:
        return [self.chunk({"role": "assistant"})]

    def add(self, piece: Piece) -> dict | None:
        """Record a piece; returns its streaming delta (None if this reply style drops it)."""
        if piece.kind == "content":
            self.content.append(piece.text)
            return {"content": piece.text}
        if piece.kind == "reasoning":
            self.reasoning.append(piece.text)
            return _reasoning(piece.text)
        if self.call_style == "functions" and piece.index > 0:
            return None  # the legacy form carries a single call
        if piece.kind == "name":
            self.calls.append({"id": "call_" + secrets.token_hex(12), "name": piece.text, "arguments": ""})
            call = self.calls[-1]
            if self.call_style == "functions":
                return {"function_call": {"name": piece.text, "arguments": ""}}
            function = {"name": piece.text, "arguments": ""}
            return {"tool_calls": [{"index": piece.index, "id": call["id"], "type": "function", "function": function}]}
        self.calls[piece.index]["arguments"] += piece.text
        if self.call_style == "functions":
            return {"function_call": {"arguments": piece.text}}
        return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}

    def finish_reason(self, engine_reason: str) -> str:
        """A completed call reports function_call / tool_calls; a cut-off one still says length."""
        if self.calls and engine_reason == "stop":
            return "function_call" if self.call_style == "functions" else "tool_calls"
        return engine_reason

    def message(self) -> dict:
        content = "".join(self.content)
        message = {"role": "assistant", "content": content or (None if self.calls else "")}
        if self.reasoning:
            message.update(_reasoning("".join(self.reasoning)))
        if self.calls and self.call_style == "functions":
            call = self.calls[0]
            message["function_call"] = {"name": call["name"], "arguments": call["arguments"]}
        elif self.calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in self.calls
            ]
        return message

    def choice(self, engine_reason: str) -> dict:
        choice = {"index": self.index, "message": self.message(), "finish_reason": self.finish_reason(engine_reason)}
        if self.logprobs is not None:
            choice["logprobs"] = {"content": self.logprobs.content}
        return choice

    def chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        choice = {"index": self.index, "delta": delta, "finish_reason": finish_reason}
        if self.logprobs is not None and (content := self.logprobs.unsent()):
            choice["logprobs"] = {"content": content}
        return {**self.envelope(), "choices": [choice]}


def _reasoning(text: str) -> dict:
    """Thinking under both names clients read: reasoning_content (DeepSeek's, llama.cpp's) and reasoning (vLLM's newer)."""
    return {"reasoning_content": text, "reasoning": text}


class TextReply(_Reply):
    """/v1/completions: the same interface as Reply, in the text_completion shape."""

    id_prefix, chunk_object, completion_object = "cmpl-", "text_completion", "text_completion"

    def __init__(self, spelling: tuple[bytes, ...] | None = None, index: int = 0, first: "TextReply | None" = None):
        super().__init__(spelling, index, first)
        self.text: list[str] = []
        self.streamed = 0  # characters sent in chunks so far: the next chunk's text_offset starts there

    def add(self, piece: Piece) -> dict:
        self.text.append(piece.text)
        return {"text": piece.text}

    def choice(self, engine_reason: str) -> dict:
        logprobs = None if self.logprobs is None else legacy_logprobs(self.logprobs.content, 0)
        return {"index": self.index, "text": "".join(self.text), "logprobs": logprobs, "finish_reason": engine_reason}

    def chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        text = delta.get("text", "")
        tokens = self.logprobs.unsent() if self.logprobs is not None else []
        logprobs = legacy_logprobs(tokens, self.streamed) if tokens else None
        self.streamed += len(text)
        choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self.envelope(), "choices": [choice]}
