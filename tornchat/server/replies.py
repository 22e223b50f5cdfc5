"""Reply bodies in the OpenAI shape: chat.completion, chat.completion.chunk, model list.

``Reply`` collects one choice's pieces (content, call name, call arguments)
and gives both the streamed delta for each piece and the whole message at
the end, so the two modes cannot drift apart.
"""
import secrets
import time

from tornchat import MODEL_ID
from tornchat.engine.types import Usage
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
    }


class Reply:
    def __init__(self, call_style: str | None):
        self.call_style = call_style  # "functions", "tools" or None (no functions offered)
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.content: list[str] = []
        self.calls: list[dict] = []  # {id, name, arguments}

    def add(self, piece: Piece) -> dict | None:
        """Record a piece; returns its streaming delta (None if this reply style drops it)."""
        if piece.kind == "content":
            self.content.append(piece.text)
            return {"content": piece.text}
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
        if self.calls and self.call_style == "functions":
            call = self.calls[0]
            message["function_call"] = {"name": call["name"], "arguments": call["arguments"]}
        elif self.calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in self.calls
            ]
        return message

    def completion(self, engine_reason: str, usage: Usage) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": MODEL_ID,
            "choices": [{"index": 0, "message": self.message(), "finish_reason": self.finish_reason(engine_reason)}],
            "usage": usage_body(usage),
        }

    def chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": MODEL_ID,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }

    def usage_chunk(self, usage: Usage) -> dict:
        """The extra chunk ``stream_options.include_usage`` asks for: no choices, only usage."""
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": MODEL_ID,
            "choices": [],
            "usage": usage_body(usage),
        }
