"""POST /v1/responses: OpenAI's Responses API (what Codex CLI speaks), on the chat-completions path.

The request (``input`` as a string or items, ``instructions``, function
``tools``, ``tool_choice``, ``text.format``, ``max_output_tokens``,
sampling) becomes the ``validate.ChatRequest`` the chat handler builds: the
same prompt, KV slots and grammar. ``previous_response_id`` prepends the
conversation of a response kept in a bounded in-memory store
(``responses_store`` in the config: how many responses are kept).

The reply is a ``response`` object whose ``output`` holds a ``reasoning``
item for a thinking model's thinking (its text as ``reasoning_text``
content), a ``message`` item for text and a ``function_call`` item per call; streamed, it is
OpenAI's event sequence (``response.created`` ... ``response.completed``),
each record with its ``event:`` line. Errors are ``{"error": {"message",
"type", "param", "code"}}``; a failure after the stream started is a
``response.failed`` event.
"""
import secrets
import time
from collections import OrderedDict

from tornchat import MODEL_ID, reasoning
from tornchat.engine.types import PromptTooLong, Usage
from tornchat.functions import Choice, Format, Piece
from tornchat.server import validate
from tornchat.server.agents import AgentHandler, Events
from tornchat.server.errors import APIError, invalid
from tornchat.server.handlers import ChoiceState
from tornchat.server.validate import FUNCTION_NAME, ChatRequest

INPUT_ROLES = ("user", "assistant", "system", "developer")
TURN_ORDER = ("reasoning_content", "content", "tool_calls")  # an assistant turn's parts, as templates write them
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")  # refusal: an assistant's own words all the same
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error"}


class Store:
    """The conversations of recent responses, by id, for ``previous_response_id``; the oldest go first."""

    def __init__(self, limit: int):
        self.limit = limit
        self.items: OrderedDict[str, list[dict]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict]) -> None:
        if self.limit <= 0:
            return
        self.items[response_id] = messages
        while len(self.items) > self.limit:
            self.items.popitem(last=False)

    def get(self, response_id: str) -> list[dict] | None:
        return self.items.get(response_id)


# ---- request ------------------------------------------------------------------------


def parse(data: dict, max_messages: int, vocab_size: int, store: Store) -> tuple[ChatRequest, list[dict], dict]:
    """The chat request, the conversation to keep for a next turn (without instructions), and the fields a reply echoes."""
    model = data.get("model")
    if not isinstance(model, str):
        raise invalid("model is required and must be a string")
    if validate._boolean(data, "background"):
        raise invalid("background must be false: responses are answered on the request's own connection")
    if data.get("truncation") not in (None, "disabled"):
        raise invalid('truncation must be "disabled": a conversation longer than the context is an error, never cut')
    history: list[dict] = []
    previous = validate._string(data, "previous_response_id", "previous_response_id")
    if previous is not None:
        history = store.get(previous)
        if history is None:
            raise invalid(f"previous_response_id {previous!r} not found: the server keeps the last {store.limit} responses in memory")
    conversation = history + _input(data.get("input"), max_messages)
    if len(conversation) > max_messages:
        raise invalid(f"the conversation has {len(conversation)} messages; at most {max_messages} are allowed")
    if not any(m["role"] == "user" for m in conversation):
        raise invalid("input must hold at least one user message")
    instructions = validate._string(data, "instructions", "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    functions = _tools(data.get("tools"))
    choice = _tool_choice(data.get("tool_choice"), functions)
    parallel = validate._boolean(data, "parallel_tool_calls")
    text = validate._object(data, "text")
    max_output = validate._integer(data, "max_output_tokens", 1)
    effort = validate._object(data, "reasoning").get("effort")
    request = ChatRequest(
        sampling=validate._sampling(data, vocab_size),
        max_tokens=max_output,
        stop=validate._stop(data.get("stop")),  # not OpenAI's: our extension, as in chat completions
        stream=bool(validate._boolean(data, "stream")),
        messages=messages,
        functions=functions,
        call_style="tools" if functions else None,
        choice=choice,
        response_format=_format(text.get("format")),
        thinking=reasoning.Asked(validate.effort_enables(effort, "reasoning.effort"), validate._integer(data, "reasoning_budget", 0)),
    )
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_output,
        "parallel_tool_calls": True if parallel is None else parallel,
        "previous_response_id": previous,
        "store": validate._boolean(data, "store") is not False,
        "temperature": request.sampling.temperature,
        "top_p": request.sampling.top_p,
        "tool_choice": data.get("tool_choice") or "auto",
        "tools": [t for t in data.get("tools") or () if isinstance(t, dict) and t.get("type") == "function"],
        "text": {"format": text.get("format") or {"type": "text"}},
        "metadata": data.get("metadata") if isinstance(data.get("metadata"), dict) else {},
        "reasoning": {"effort": effort, "summary": None},
    }
    return request, conversation, echo


def _input(value, max_messages: int) -> list[dict]:
    """Input items as chat messages: role, content, and tool_calls / tool_call_id as the chat handler has them."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input must be a string or a non-empty array of input items")
    if len(value) > max_messages:
        raise invalid(f"input has {len(value)} items; at most {max_messages} are allowed")
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object")
        kind = item.get("type", "message")  # an "easy" input message has no type
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise invalid(f"{where}.role must be one of {', '.join(INPUT_ROLES)}")
            content = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                _assistant(messages, "content")["content"] = content
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call = {
                "id": validate._string(item, "call_id", f"{where}.call_id", required=True),
                "type": "function",
                "function": {
                    "name": validate._string(item, "name", f"{where}.name", required=True),
                    "arguments": validate._string(item, "arguments", f"{where}.arguments", required=True),
                },
            }
            _assistant(messages, "tool_calls").setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = validate._string(item, "call_id", f"{where}.call_id", required=True)
            messages.append({"role": "tool", "content": _text(item.get("output"), f"{where}.output"), "tool_call_id": call_id})
        elif kind == "reasoning":
            if thought := _reasoning_text(item):
                _assistant(messages, "reasoning_content")["reasoning_content"] = thought
        else:
            raise invalid(f"{where}.type {str(kind)[:40]!r} is not supported: use message, function_call, function_call_output or reasoning items")
    return messages


def _assistant(messages: list[dict], part: str) -> dict:
    """The assistant message an item's ``part`` belongs to: the last one, if the part can still join it, else a new one.

    One turn's items (reasoning, a message, calls) make one assistant
    message, as chat templates render a turn in that order: an item joins
    the last message unless that already holds its part or a later one
    (any number of calls may join).
    """
    last = messages[-1] if messages else None
    later = () if part == "tool_calls" else TURN_ORDER[TURN_ORDER.index(part):]
    if last is None or last["role"] != "assistant" or any(last.get(key) for key in later):
        last = {"role": "assistant", "content": ""}
        messages.append(last)
    return last


def _reasoning_text(item: dict) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary (what Codex sends back)."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if isinstance(parts, list):
            texts = [p["text"] for p in parts if isinstance(p, dict) and p.get("type") == kind and isinstance(p.get("text"), str)]
            if texts:
                return "\n\n".join(texts)
    return ""


def _text(value, where: str) -> str:
    """A message's text: a string, or text parts (input_text / output_text)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(f"{where} must be a string or an array of text parts")
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise invalid(f"{where}[{j}] must be a text part (input_text or output_text); this server's model reads text only")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise invalid(f"{where}[{j}].text must be a string")
        texts.append(text)
    return "".join(texts)


def _tools(value) -> list[dict]:
    """Function tools as definitions (name, description, parameters); other tool types are ignored."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("tools must be an array")
    functions = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise invalid(f"tools[{i}] must be an object")
        if tool.get("type") != "function":
            continue  # web_search, namespace, ...: tools this server does not run
        functions.append(validate._definition(tool, f"tools[{i}]"))
    return functions


def _tool_choice(value, functions: list[dict]) -> Choice:
    if value is None or value == "auto":
        return Choice("auto")
    if value == "none":
        return Choice("none")
    if value == "required":
        return Choice("required") if functions else Choice("auto")  # no function tool offered: nothing to require
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        if value["name"] not in {f["name"] for f in functions}:
            raise invalid(f"tool_choice.name {value['name']!r} is not one of the function tools given")
        return Choice("named", value["name"])
    raise invalid('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}')


def _format(value) -> Format:
    """text.format: text, json_object, or json_schema (flat: name, schema, strict, description)."""
    if value is None:
        return Format()
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid('text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name": ..., "schema": {...}}')
    if value["type"] != "json_schema":
        return Format(value["type"])
    name = validate._string(value, "name", "text.format.name", required=True)
    if not FUNCTION_NAME.match(name):
        raise invalid("text.format.name must be 1-64 letters, digits, underscores or dashes")
    validate._boolean(value, "strict", "text.format.strict")  # always enforced: the grammar allows nothing else
    if value.get("schema") is None:
        raise invalid("text.format.schema is required")
    return Format("json_schema", validate._schema(value, "schema", "text.format.schema"), name)


# ---- reply --------------------------------------------------------------------------

# Piece kind -> (output item type, event name prefix, its text part as it starts)
TEXT_ITEMS = {
    "content": ("message", "response.output_text", {"type": "output_text", "text": "", "annotations": []}),
    "reasoning": ("reasoning", "response.reasoning_text", {"type": "reasoning_text", "text": ""}),
}
ITEM_FIELDS = {"message": {"role": "assistant"}, "reasoning": {"summary": []}}  # beside id, type, status, content


def usage_body(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


class ResponseReply:
    """One response's output items, as stream events and as the whole ``response`` object."""

    def __init__(self, echo: dict):
        self.id = "resp_" + secrets.token_hex(24)
        self.created_at = int(time.time())
        self.echo = echo
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.sequence = 0
        self.dropped: set[int] = set()  # calls past the first when parallel_tool_calls is false
        self.status = "in_progress"

    def _event(self, kind: str, **fields) -> tuple[str, dict]:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return kind, payload

    def response(self, usage: Usage | None = None, error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "error": error, "incomplete_details": incomplete, "model": MODEL_ID, "output": self.output,
            "usage": None if usage is None else usage_body(usage),
            "truncation": "disabled", "user": None, **self.echo,
        }

    def opening(self) -> Events:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def add(self, piece: Piece) -> Events:
        if piece.kind in TEXT_ITEMS:
            kind, name, part = TEXT_ITEMS[piece.kind]
            events = []
            if not self._writing(kind):
                prefix = "msg_" if kind == "message" else "rs_"
                events = self._start({"id": prefix + secrets.token_hex(24), "type": kind, "status": "in_progress",
                                      **ITEM_FIELDS[kind], "content": []})
                self.open["content"].append(dict(part))
                events.append(self._event("response.content_part.added", item_id=self.open["id"], output_index=len(self.output) - 1,
                                          content_index=0, part=dict(part)))
            self.open["content"][0]["text"] += piece.text
            return events + [self._event(f"{name}.delta", item_id=self.open["id"], output_index=len(self.output) - 1,
                                         content_index=0, delta=piece.text, **_logprobs(kind))]
        if piece.index in self.dropped or (piece.kind == "name" and piece.index > 0 and not self.echo["parallel_tool_calls"]):
            self.dropped.add(piece.index)
            return []
        if piece.kind == "name":
            return self._start({
                "id": "fc_" + secrets.token_hex(24), "type": "function_call", "status": "in_progress",
                "arguments": "", "call_id": "call_" + secrets.token_hex(12), "name": piece.text,
            })
        self.open["arguments"] += piece.text
        return [self._event("response.function_call_arguments.delta", item_id=self.open["id"], output_index=len(self.output) - 1,
                            delta=piece.text)]

    def _writing(self, kind: str) -> bool:
        return self.open is not None and self.open["type"] == kind

    def _start(self, item: dict) -> Events:
        events = self._close()
        self.open = item
        self.output.append(item)
        return events + [self._event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item))]

    def _close(self, status: str = "completed") -> Events:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output) - 1
        item["status"] = status
        if item["type"] in ITEM_FIELDS:
            part = item["content"][0]
            event = next(name for kind, name, _ in TEXT_ITEMS.values() if kind == item["type"])
            events = [
                self._event(f"{event}.done", item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                            **_logprobs(item["type"])),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=dict(part)),
            ]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"])]
        return events + [self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _finish(self, engine_reason: str) -> Events:
        self.status = "incomplete" if engine_reason == "length" else "completed"
        return self._close(self.status)

    def closing(self, engine_reason: str, usage: Usage) -> Events:
        events = self._finish(engine_reason)
        return events + [self._event(f"response.{self.status}", response=self.response(usage))]

    def failed(self, status: int, message: str) -> Events:
        self.status = "failed"
        error = {"code": "server_error" if status >= 500 else "invalid_request", "message": message}
        return [self._event("response.failed", response=self.response(error=error))]

    def body(self, engine_reason: str, usage: Usage) -> dict:
        self._finish(engine_reason)
        return self.response(usage)

    def messages(self) -> list[dict]:
        """The output as chat messages, for the next turn's conversation."""
        messages: list[dict] = []
        for item in self.output:
            if item["type"] == "reasoning":
                _assistant(messages, "reasoning_content")["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                _assistant(messages, "content")["content"] = item["content"][0]["text"]
            else:
                call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
                _assistant(messages, "tool_calls").setdefault("tool_calls", []).append(call)
        return messages or [{"role": "assistant", "content": ""}]


def _copy(item: dict) -> dict:
    """A snapshot of an item as it is now (the stream's events must not change as the item grows)."""
    return {**item, "content": [dict(p) for p in item["content"]]} if "content" in item else dict(item)


def _logprobs(kind: str) -> dict:
    """Output text events carry logprobs (none here); reasoning text events have no such field."""
    return {"logprobs": []} if kind == "message" else {}


# ---- handler ------------------------------------------------------------------------


class ResponsesHandler(AgentHandler):
    """POST /v1/responses."""

    @property
    def store(self) -> Store:
        return self.settings["responses_store"]

    def error_body(self, status_code: int, detail: str, code: str | None) -> dict:
        kind = ERROR_TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")
        return {"error": {"message": detail, "type": kind, "param": None, "code": code}}

    def too_long(self, exc: PromptTooLong) -> APIError:
        return APIError(400, f"Invalid request: {exc}", code="context_length_exceeded")

    async def post(self) -> None:
        request, self.conversation, echo = parse(self.body(), self.config.max_messages, self.vocab_size, self.store)
        generation, parser = self.chat_generation(request)
        await self.generate([ChoiceState(0, generation, ResponseReply(echo), parser)], request)

    def finished(self, reply: ResponseReply, event) -> None:
        if reply.echo["store"]:
            self.store.put(reply.id, self.conversation + reply.messages())
