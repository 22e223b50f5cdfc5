"""What the agents' APIs (Responses, Messages) share: a reply that speaks in named SSE events.

Each API module (responses.py, messages.py) turns its body into the same
``validate.ChatRequest`` the chat-completions handler builds, so a
conversation renders to the same tokens through any of them and a KV slot
filled by one turn serves the next. What differs is the reply: an
``EventReply`` takes the parser's pieces (content, call name, call
arguments) and gives both the stream's events and the whole body, so the
two modes cannot drift apart.
"""
import logging
from typing import Protocol

from tornchat.engine.types import Usage
from tornchat.functions import Piece
from tornchat.server import sse
from tornchat.server.errors import APIError
from tornchat.server.handlers import ChoiceState, GenerationHandler, _pieces, failure

log = logging.getLogger("tornchat.server")

Events = list[tuple[str, dict]]  # (event name, payload)


class EventReply(Protocol):
    def opening(self) -> Events: ...

    def add(self, piece: Piece) -> Events: ...

    def closing(self, engine_reason: str, usage: Usage) -> Events: ...

    def failed(self, status: int, message: str) -> Events: ...

    def body(self, engine_reason: str, usage: Usage) -> dict: ...


def _records(events: Events) -> bytes:
    return b"".join(sse.event(name, payload) for name, payload in events)


class AgentHandler(GenerationHandler):
    """GenerationHandler with the reply in named events (streamed) or one body (not)."""

    async def _complete(self, choices: list[ChoiceState]) -> None:
        (choice,) = choices  # these APIs take no n
        reply, parser = choice.reply, choice.parser
        async for _, event in self._events():
            if event.error is not None:
                status, message = failure(event.error)  # the engine has logged it
                raise APIError(status, message, {"Retry-After": "1"} if status == 503 else None)
            for piece in _pieces(parser, event):
                reply.add(piece)
            if event.is_last:
                self.usage = event.usage
                self.finished(reply, event)
                self.write_json(reply.body(event.finish_reason, event.usage))

    async def _stream(self, choices: list[ChoiceState], include_usage: bool = False) -> None:
        (choice,) = choices
        reply, parser = choice.reply, choice.parser
        self.server_stats.counters["streams"] += 1
        self.set_header("Content-Type", "text/event-stream; charset=utf-8")
        self.set_header("Cache-Control", "no-cache")
        if not await self._send(_records(reply.opening())):
            return
        try:
            async for batch in self._batches():
                events: Events = []
                for _, event in batch:
                    if event.error is not None:
                        status, message = failure(event.error)
                        await self._send(_records(events + reply.failed(status, "Generation failed" if status == 500 else message)))
                        return
                    for piece in _pieces(parser, event):
                        events += reply.add(piece)
                    if event.is_last:
                        self.usage = event.usage
                        events += reply.closing(event.finish_reason, event.usage)
                        self.finished(reply, event)
                if events and not await self._send(_records(events)):
                    return
        except Exception:
            log.exception("stream failed")
            await self._send(_records(reply.failed(500, "Internal server error")))

    def finished(self, reply: EventReply, event) -> None:
        """A reply is complete (before it is sent); the Responses API keeps it for previous_response_id."""
