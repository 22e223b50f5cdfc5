"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (what Claude Code speaks).

The request (``system``, ``messages`` with text / tool_use / tool_result
blocks, ``tools`` with ``input_schema``, ``tool_choice``,
``stop_sequences``, ``max_tokens``, sampling) becomes the
``validate.ChatRequest`` the chat handler builds: the same prompt, KV slots
and grammar. ``thinking`` turns a thinking model's thinking on
(``enabled``, with ``budget_tokens`` as its budget, or ``adaptive``) or
off (``disabled``); earlier ``thinking`` blocks go to the template as the
turn's reasoning. Fields Claude Code sends that change nothing here
(metadata, context_management, output_config, cache_control, betas) are
accepted and ignored.

The reply is a ``message`` with ``thinking``, ``text`` and ``tool_use`` content blocks;
streamed, it is Anthropic's event sequence (message_start, ping,
content_block_start / _delta / _stop, message_delta, message_stop), each
record with its ``event:`` line. Errors are ``{"type": "error", "error":
{"type": ..., "message": ...}}``, also as an ``error`` event once a stream
has started. ``x-api-key`` is accepted as the API key, beside
``Authorization: Bearer``.
"""
import hmac
import json
import secrets

from tornchat import MODEL_ID, prompt, reasoning
from tornchat.engine.types import PromptTooLong, Usage
from tornchat.functions import Choice, Piece
from tornchat.server import validate
from tornchat.server.agents import AgentHandler, Events
from tornchat.server.errors import APIError, invalid
from tornchat.server.handlers import ChoiceState
from tornchat.server.validate import MAX_STOP, ChatRequest

ROLES = ("user", "assistant", "system")  # system: Claude Code puts one inside messages
BILLING_HEADER = "x-anthropic-billing-header:"
THINKING = ("enabled", "adaptive", "disabled")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


# ---- request ------------------------------------------------------------------------


def parse(data: dict, max_messages: int, vocab_size: int, counting: bool = False) -> ChatRequest:
    """The chat request for a Messages body; ``counting``: for count_tokens, where max_tokens is not needed."""
    model = data.get("model")
    if not isinstance(model, str):
        raise invalid("model is required and must be a string")
    max_tokens = validate._integer(data, "max_tokens", 1)
    if max_tokens is None and not counting:
        raise invalid("max_tokens is required")
    value = data.get("messages")
    if not isinstance(value, list) or not value:
        raise invalid("messages must be a non-empty array")
    if len(value) > max_messages:
        raise invalid(f"messages has {len(value)} entries; at most {max_messages} are allowed")
    system = _system(data.get("system"))
    messages = ([{"role": "system", "content": system}] if system else []) + _messages(value)
    if not any(m["role"] == "user" for m in messages):
        raise invalid("messages must hold at least one user message")
    tools = _tools(data.get("tools"))
    stops = data.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise invalid("stop_sequences must be an array of strings")
    if stops and len(stops) > MAX_STOP:
        raise invalid(f"stop_sequences has {len(stops)} strings; at most {MAX_STOP} are allowed")
    return ChatRequest(
        sampling=validate._sampling(data, vocab_size),
        max_tokens=max_tokens,
        stop=tuple(s for s in stops or () if s),
        stream=bool(validate._boolean(data, "stream")),
        messages=messages,
        functions=tools,
        call_style="tools" if tools else None,
        choice=_tool_choice(data.get("tool_choice"), tools),
        thinking=_thinking(data.get("thinking")),
    )


def _thinking(value) -> reasoning.Asked:
    """``thinking``: {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} or {"type": "disabled"}."""
    if value is None:
        return reasoning.Asked()
    if not isinstance(value, dict) or value.get("type") not in THINKING:
        raise invalid('thinking must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} or {"type": "disabled"}')
    budget = validate._integer(value, "budget_tokens", 0) if value["type"] == "enabled" else None
    return reasoning.Asked(value["type"] != "disabled", budget)


def _system(value) -> str:
    """``system``: a string or text blocks (their cache_control ignored).

    Claude Code's first block is a billing header for Anthropic's servers
    (``x-anthropic-billing-header: cc_version=...``), not words for the model;
    it is dropped, so that the prompt (and the KV slot's prefix) does not hang on it.
    """
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise invalid("system must be a string or an array of text blocks")
    texts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise invalid(f'system[{j}] must be a text block: {{"type": "text", "text": ...}}')
        if not block["text"].startswith(BILLING_HEADER):
            texts.append(block["text"])
    return "\n\n".join(texts)


def _messages(value: list) -> list[dict]:
    """Messages as chat messages: tool_use blocks become tool_calls, tool_result blocks role-tool messages."""
    messages: list[dict] = []
    for i, raw in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(raw, dict):
            raise invalid(f"{where} must be an object")
        role = raw.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(ROLES)}")
        content = raw.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise invalid(f"{where}.content must be a string or an array of content blocks")
        texts, thoughts, calls, results = [], [], [], []
        for j, block in enumerate(content):
            here = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(validate._string(block, "text", f"{here}.text", required=True))
            elif kind == "tool_use" and role == "assistant":
                name = validate._string(block, "name", f"{here}.name", required=True)
                arguments = block.get("input", {})
                if not isinstance(arguments, dict):
                    raise invalid(f"{here}.input must be an object")
                call_id = validate._string(block, "id", f"{here}.id", required=True)
                calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                call_id = validate._string(block, "tool_use_id", f"{here}.tool_use_id", required=True)
                results.append({"role": "tool", "content": _result(block.get("content"), f"{here}.content"), "tool_call_id": call_id})
            elif kind in ("thinking", "redacted_thinking"):
                if kind == "thinking" and role == "assistant":  # redacted: encrypted by another server, unreadable here
                    thoughts.append(validate._string(block, "thinking", f"{here}.thinking", required=True))
            elif kind in ("tool_use", "tool_result"):
                raise invalid(f"{here}: a {kind} block belongs in an {'assistant' if kind == 'tool_use' else 'user'} message")
            else:
                raise invalid(f"{here}.type {str(kind)[:40]!r} is not supported: this server's model reads text, tool_use and tool_result blocks")
        messages += results  # the results answer the calls of the assistant turn before; any text follows them
        if texts or calls or not results:
            message = {"role": role, "content": "".join(texts)}
            if thoughts:
                message["reasoning_content"] = "\n\n".join(thoughts)
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    return messages


def _result(value, where: str) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise invalid(f"{where} must be a string or an array of text blocks")
    texts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise invalid(f"{where}[{j}] must be a text block; this server's model reads text only")
        texts.append(block["text"])
    return "\n".join(texts)


def _tools(value) -> list[dict]:
    """Client tools (name, description, input_schema) as definitions; Anthropic's server tools are ignored."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("tools must be an array")
    definitions = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise invalid(f"tools[{i}] must be an object")
        if tool.get("type") not in (None, "custom"):
            continue  # bash_..., web_search_...: tools Anthropic's servers run, not this one
        definition = validate._definition({key: tool.get(key) for key in ("name", "description")}, f"tools[{i}]")
        if tool.get("input_schema") is not None:
            definition["parameters"] = validate._schema(tool, "input_schema", f"tools[{i}].input_schema ({definition['name']})")
        definitions.append(definition)
    return definitions


def _tool_choice(value, tools: list[dict]) -> Choice:
    if value is None:
        return Choice("auto")
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "auto" or (kind == "any" and not tools):
        return Choice("auto")
    if kind == "none":
        return Choice("none")
    if kind == "any":
        return Choice("required")
    if kind == "tool":
        name = value.get("name")
        if name not in {t["name"] for t in tools}:
            raise invalid(f"tool_choice.name {str(name)[:64]!r} is not one of the tools given")
        return Choice("named", name)
    raise invalid('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}')


# ---- reply --------------------------------------------------------------------------


def usage_body(usage: Usage) -> dict:
    """Anthropic counts the prompt tokens read from a cache apart from the rest."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


# Piece kind -> (content block type, its text field, its delta type)
TEXT_BLOCKS = {"content": ("text", "text", "text_delta"), "reasoning": ("thinking", "thinking", "thinking_delta")}


class MessageReply:
    """One message's content blocks, as stream events and as the whole ``message`` object."""

    def __init__(self, prompt_tokens: int, parallel: bool = True):
        self.id = "msg_" + secrets.token_hex(12)
        self.prompt_tokens = prompt_tokens
        self.parallel = parallel
        self.blocks: list[dict] = []
        self.arguments: dict[int, str] = {}  # block index -> a tool_use block's JSON so far
        self.open: int | None = None  # index of the block being written
        self.dropped: set[int] = set()  # calls past the first where parallel tool use is off
        self.calls: dict[int, int] = {}  # call index -> block index

    def message(self, stop_reason: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": MODEL_ID, "content": self.blocks,
                "stop_reason": stop_reason, "stop_sequence": None, "usage": usage}

    def opening(self) -> Events:
        usage = {"input_tokens": self.prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0}
        return [("message_start", {"type": "message_start", "message": self.message(None, usage)}), ("ping", {"type": "ping"})]

    def add(self, piece: Piece) -> Events:
        if piece.kind in TEXT_BLOCKS:
            kind, field, delta = TEXT_BLOCKS[piece.kind]
            writing = self.open is not None and self.blocks[self.open]["type"] == kind
            events = [] if writing else self._start({"type": kind, field: "", **({"signature": ""} if kind == "thinking" else {})})
            self.blocks[self.open][field] += piece.text
            return events + [self._delta({"type": delta, field: piece.text})]
        if piece.index in self.dropped or (piece.kind == "name" and piece.index > 0 and not self.parallel):
            self.dropped.add(piece.index)
            return []
        if piece.kind == "name":
            events = self._start({"type": "tool_use", "id": "toolu_" + secrets.token_hex(12), "name": piece.text, "input": {}})
            self.arguments[self.open] = ""
            return events
        self.arguments[self.open] += piece.text
        return [self._delta({"type": "input_json_delta", "partial_json": piece.text})]

    def _start(self, block: dict) -> Events:
        events = self._close()
        self.blocks.append(block)
        self.open = len(self.blocks) - 1
        return events + [("content_block_start", {"type": "content_block_start", "index": self.open, "content_block": dict(block)})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.open, "delta": delta}

    def _close(self) -> Events:
        index, self.open = self.open, None
        if index is None:
            return []
        block = self.blocks[index]
        if block["type"] == "tool_use":
            try:
                block["input"] = json.loads(self.arguments[index] or "{}")
            except ValueError:
                block["input"] = {}  # cut off by max_tokens: stop_reason says so
            if not isinstance(block["input"], dict):
                block["input"] = {"value": block["input"]}
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def stop_reason(self, engine_reason: str) -> str:
        if engine_reason == "length":
            return "max_tokens"
        return "tool_use" if any(b["type"] == "tool_use" for b in self.blocks) else "end_turn"

    def closing(self, engine_reason: str, usage: Usage) -> Events:
        events = self._close()
        delta = {"type": "message_delta", "delta": {"stop_reason": self.stop_reason(engine_reason), "stop_sequence": None},
                 "usage": usage_body(usage)}
        return events + [("message_delta", delta), ("message_stop", {"type": "message_stop"})]

    def failed(self, status: int, message: str) -> Events:
        return [("error", error_body(status, message))]

    def body(self, engine_reason: str, usage: Usage) -> dict:
        self._close()
        return self.message(self.stop_reason(engine_reason), usage_body(usage))


def error_body(status_code: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status_code, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---- handlers -----------------------------------------------------------------------


class _Anthropic:
    """What both endpoints share: the x-api-key header and Anthropic's error shape."""

    def authorized(self) -> bool:
        key = self.request.headers.get("x-api-key")
        if key is not None and self.config.api_key:
            return hmac.compare_digest(key.encode(), self.config.api_key.encode())
        return super().authorized()

    def error_body(self, status_code: int, detail: str, code: str | None) -> dict:
        return error_body(status_code, detail)

    def too_long(self, exc: PromptTooLong) -> APIError:
        # Anthropic's own wording, which Claude Code recognises (it then compacts the conversation).
        return APIError(400, f"prompt is too long: {exc.prompt_tokens} tokens > {exc.context_length - 1} maximum ({exc})")


class MessagesHandler(_Anthropic, AgentHandler):
    """POST /v1/messages (Claude Code adds ?beta=true)."""

    async def post(self) -> None:
        data = self.body()
        request = parse(data, self.config.max_messages, self.vocab_size)
        generation, parser = self.chat_generation(request)
        parallel = not (isinstance(data.get("tool_choice"), dict) and data["tool_choice"].get("disable_parallel_tool_use") is True)
        await self.generate([ChoiceState(0, generation, MessageReply(len(generation.prompt_ids), parallel), parser)], request)


class CountTokensHandler(_Anthropic, AgentHandler):
    """POST /v1/messages/count_tokens: the prompt's tokens as /v1/messages would build it, with no generation."""

    async def post(self) -> None:
        request = parse(self.body(), self.config.max_messages, self.vocab_size, counting=True)
        plan, _, _ = self.plan(request)
        self.write_json({"input_tokens": len(prompt.encode(self.engine.tokenizer, plan.prompt))})
